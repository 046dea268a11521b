"""A user's ``jax.shard_map`` inside the partitioned function: a manual region placed in spmd's.

spmd's program is one shard_map over every mesh axis, so a user's shard_map over the same mesh
needs no region of its own: its operands are resharded to the shardings its ``in_specs`` name,
its body runs on the local shards as written (its collectives and ``axis_index`` name the same
mesh axes, all manual already), and its results are the blocks its ``out_specs`` name (an axis
they leave out is one the body's result is invariant over, as JAX's ``check_vma`` guarantees, or
the user asserts with ``check_vma=False``). The program pins its operands and results to those
shardings with annotations (ir.py), so that propagation carries them to their neighbours; the plan
lists the body's own collectives with their bytes.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterator, Mapping

from jax.sharding import PartitionSpec as P

from spmd.partition.annotation import user_site
from spmd.partition.ir import Value, source_line
from spmd.partition import unchecked
from spmd.partition.jax_compat import open_jaxpr
from spmd.partition.rules.control import scan_copies
from spmd.partition.rules.factors import OpShardingRule, RuleBuilder
from spmd.partition.sharding import Axes, MeshShape, TensorSharding
from spmd.partition.wire import Wire

if TYPE_CHECKING:
  from spmd.partition.ir import Op
  from spmd.partition.local import Local


def restate_unbound_axis(e: Exception) -> NameError | None:
  """JAX's refusal of a collective over a named axis outside any ``shard_map`` (a pmap-style
  ``lax.pmean(x, "batch")``, ``nn.BatchNorm(axis_name=...)``), restated with what it means here;
  None for any other error. The function is partitioned as written for one device, which sees
  whole arrays: such a collective has no devices' values to combine."""
  if not isinstance(e, NameError) or e.name is not None:  # Python's own names a variable
    return None
  return NameError(
      f"spmd.partition: a collective over a named axis{user_site(e)} outside a jax.shard_map "
      f"({e}). spmd.partition takes the function as written for one device, which sees whole "
      "arrays: drop the axis name (flax's BatchNorm(axis_name=...) then takes its statistics "
      "over the whole batch, which is what its mean over devices computed under pmap), or run "
      "that part inside a jax.shard_map over the mesh")

# The body's collectives, by primitive: the HLO collective each lowers to, and whether its bytes
# are its result's (an all-gather's grows) rather than its operand's.
COLLECTIVES: dict[str, tuple[str, bool]] = {
    **{name: ("all-reduce", False) for name in ("psum", "psum_invariant", "pmax", "pmin")},
    **{name: ("all-gather", True) for name in ("all_gather", "all_gather_invariant")},
    "reduce_scatter": ("reduce-scatter", False),
    "ppermute": ("collective-permute", False),
    "all_to_all": ("all-to-all", False),
}


@dataclass(frozen=True)
class BodyCollective:
  """One collective a manual region's body runs: ``bytes`` per device (the larger of its input
  and output, priced for the backend), ``trips`` per run of the region (the lengths of the body's
  own scans around it; None inside its while loop)."""

  kind: str
  axes: Axes
  bytes: int
  primitive: str
  source: str
  shape: str
  trips: int | None


def specs(params: Mapping[str, Any]) -> tuple[tuple[P, ...], tuple[P, ...]]:
  """The region's in_specs and out_specs (a region manual over every mesh axis: one over only
  some is inlined as what it computes, partly_manual.py)."""
  return tuple(params["in_specs"]), tuple(params["out_specs"])


def shardings(op: Op, mesh: MeshShape) -> tuple[tuple[TensorSharding | None, ...],
                                                tuple[TensorSharding, ...]]:
  """What each operand is read as (None: a literal) and each result is written as."""
  ins, outs = specs(op.params)
  what = f"jax.shard_map at {op.source}"
  reads = tuple(TensorSharding.from_spec(s, len(x.aval.shape), mesh, what=f"{what}: in_specs")
                if isinstance(x, Value) else None for x, s in zip(op.inputs, ins))
  writes = tuple(TensorSharding.from_spec(s, len(v.shape), mesh, what=f"{what}: out_specs")
                 for v, s in zip(op.outputs, outs))
  return reads, writes


def rule(op: Op) -> OpShardingRule:
  """Every dim of every operand and result its own factor: the body is opaque, so the op relates
  none of them to another; the annotations pinning them to the specs carry shardings (ir.py)."""
  b = RuleBuilder()
  return b.build([b.factors(x.aval.shape) if isinstance(x, Value) else None for x in op.inputs],
                 [b.factors(v.shape) for v in op.outputs])


def lower(local: Local, args: list) -> list:
  """The body evaluated on the local shards in its unchecked form (unchecked.py), as spmd's
  program and JAX's re-traces of it (``jax.vmap``) type values."""
  return unchecked.evaluate(local.op.params["jaxpr"], args)


def bind_whole(op: Op, args: list) -> list:
  """The shard_map bound as JAX binds it, on whole arrays (backend="xla", where XLA partitions
  the program)."""
  return list(op.eqn.primitive.bind(*args, **op.eqn.primitive.get_bind_params(op.params)))


def collectives(op: Op, wire: Wire) -> tuple[BodyCollective, ...]:
  """The collectives the body runs, as the compiled program lists them (XLA keeps one over mesh
  axes of size 1 too)."""
  out = []
  for eqn, trips in _equations(open_jaxpr(op.params["jaxpr"])[0], 1):
    found = COLLECTIVES.get(eqn.primitive.name)
    if found is None:
      continue
    kind, by_result = found
    buffers = eqn.outvars if by_result else eqn.invars
    nbytes = sum(math.prod(v.aval.shape) * wire(v.aval.dtype) for v in buffers)
    out.append(BodyCollective(kind, _axes(eqn.params), nbytes, eqn.primitive.name,
                              source_line(eqn.source_info) or op.source,
                              ", ".join(v.aval.str_short() for v in eqn.invars), trips))
  return tuple(out)


def _axes(params: Mapping[str, Any]) -> Axes:
  names = params.get("axes", params.get("axis_name", ()))
  return tuple(names) if isinstance(names, (tuple, list)) else (names,)


def _equations(jaxpr: Any, trips: int | None) -> Iterator[tuple[Any, int | None]]:
  """Every equation of ``jaxpr`` and of the bodies in its equations' params, once per copy in the
  lowered program, with how often that copy runs per run of ``jaxpr`` times ``trips``: a scan's
  body ``length`` times (an unrolled one in copies, ``scan_copies``), a while loop's an unknown
  number (None), any other body (a call, each branch of a cond) once."""
  for eqn in jaxpr.eqns:
    yield eqn, trips
    name = eqn.primitive.name
    copies = scan_copies(eqn.params) if name == "scan" else (None,) if name == "while" else (1,)
    for value in eqn.params.values():
      for body in value if isinstance(value, (tuple, list)) else (value,):
        if hasattr(body, "eqns") or hasattr(getattr(body, "jaxpr", None), "eqns"):
          for n in copies:
            yield from _equations(open_jaxpr(body)[0],
                                  None if trips is None or n is None else trips * n)
