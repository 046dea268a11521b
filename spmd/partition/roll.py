"""``jnp.roll`` and its gradient as one op: JAX traces a roll by k along a dim of size n as
``concatenate([x[n-k:], x[:n-k]])``, and its transpose as the cotangent's two pieces padded into
place and added (``pad(ct[k:], (0, k)) + pad(ct[:k], (n-k, 0))``, cut by ``split`` or
``slice``): pieces whose rows lie far from the rows they end up beside. As one op, ``roll``, the
dim is a rotation: each shard takes its rows from the one or two shards they rotate from
(halo_geometry.Rotation), as XLA does. A roll by a traced shift, which JAX traces as a
``dynamic_slice`` of ``concatenate([x, x])``, is one ``roll_dynamic`` op: its dim is gathered
once (XLA gathers ``x`` before the concatenate) rather than the doubled dim built by halos and
then gathered."""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from jax import lax
from jax.extend import core as jcore
from jax.interpreters import batching, mlir

if TYPE_CHECKING:
  from spmd.partition.ir import Op, Value


def _roll(x: Any, *, shift: int, axis: int) -> Any:
  n = x.shape[axis]
  return lax.concatenate([lax.slice_in_dim(x, n - shift, n, axis=axis),
                          lax.slice_in_dim(x, 0, n - shift, axis=axis)], axis)


def _roll_batched(args: Any, dims: Any, *, shift: int, axis: int) -> tuple[Any, Any]:
  """The roll under vmap: along its own axis, past the mapped one (a partly manual region's
  blocks rolled along one manual axis, mapped over another)."""
  (x,), (d,) = args, dims
  return roll_p.bind(x, shift=shift, axis=axis + (d is not None and d <= axis)), d


roll_p = jcore.Primitive("roll")
roll_p.def_impl(_roll)
roll_p.def_abstract_eval(lambda x, *, shift, axis: x)
mlir.register_lowering(roll_p, mlir.lower_fun(_roll, multiple_results=False))
batching.primitive_batchers[roll_p] = _roll_batched


def _roll_dynamic(x: Any, start: Any, *, axis: int) -> Any:
  """Rows [start, start + n) of ``concatenate([x, x])`` along ``axis`` (start clamped into
  [0, n], as dynamic_slice clamps it)."""
  doubled = lax.concatenate([x, x], axis)
  return lax.dynamic_slice_in_dim(doubled, start, x.shape[axis], axis)


roll_dynamic_p = jcore.Primitive("roll_dynamic")
roll_dynamic_p.def_impl(_roll_dynamic)
roll_dynamic_p.def_abstract_eval(lambda x, start, *, axis: x)
mlir.register_lowering(roll_dynamic_p, mlir.lower_fun(_roll_dynamic, multiple_results=False))


@dataclass(frozen=True)
class _Piece:
  """Rows [start, start + rows) along one dim of ``source`` (jaxpr variable ``var``), whole
  along the others, placed at row ``at`` of the result."""

  source: Value
  var: Any
  start: int
  rows: int
  at: int


def fuse_rolls(ops: list[Op]) -> None:
  """Replaces every roll (a concatenation of two pieces of one value, or the sum of two such
  pieces padded into place) by a ``roll`` of that value, and every roll by a traced shift by a
  ``roll_dynamic``, here and in regions (the pieces stay for their other readers, if any)."""
  producer = {v: op for op in ops for v in op.outputs}
  for k, op in enumerate(ops):
    for region in op.regions:
      fuse_rolls(region.ops)
    dynamic = _dynamic_rotation(op, producer)
    if dynamic is not None:
      ops[k] = dynamic
      continue
    found = _rotation(op, producer)
    if found is None:
      continue
    (x, var), axis, shift = found
    params = {"shift": shift, "axis": axis}
    eqn = op.eqn.replace(primitive=roll_p, params=params, invars=[var])
    ops[k] = dataclasses.replace(op, primitive=roll_p.name, params=params, inputs=(x,), eqn=eqn)


def _dynamic_rotation(op: Op, producer: dict[Value, Op]) -> Op | None:
  """``op`` as a ``roll_dynamic`` if it is a ``dynamic_slice`` taking one whole value's worth
  of ``concatenate([x, x])`` at a traced start along the concatenated dim, else None."""
  from spmd.partition.ir import Literal  # ir imports this module
  if op.eqn.primitive is not lax.dynamic_slice_p or op.inputs[0] not in producer:
    return None
  joined = producer[op.inputs[0]]
  if joined.eqn.primitive is not lax.concatenate_p or len(joined.inputs) != 2:
    return None
  x, axis = joined.inputs[0], joined.params["dimension"]
  start = op.inputs[1 + axis]
  if (joined.inputs[1] is not x or tuple(op.params["slice_sizes"]) != x.shape
      or isinstance(start, Literal)):
    return None
  params = {"axis": axis}
  eqn = op.eqn.replace(primitive=roll_dynamic_p, params=params,
                       invars=[joined.eqn.invars[0], op.eqn.invars[1 + axis]])
  return dataclasses.replace(op, primitive=roll_dynamic_p.name, params=params,
                             inputs=(x, start), eqn=eqn)


def _rotation(op: Op, producer: dict[Value, Op]) -> tuple[tuple[Value, Any], int, int] | None:
  """((value, its variable), dim, shift) if ``op`` rolls a value along a dim, else None."""
  from spmd.partition.ir import Literal  # ir imports this module
  if op.eqn.primitive is lax.concatenate_p:  # its operands are arrays, never literals
    d = op.params["dimension"]
    starts = [sum(x.shape[d] for x in op.inputs[:j]) for j in range(len(op.inputs))]
    pieces = [_piece(x, d, at, producer) for x, at in zip(op.inputs, starts)]
  elif op.primitive in ("add", "add_any") and not any(
      isinstance(x, Literal) for x in op.inputs) and all(x in producer for x in op.inputs):
    # (op.inputs, not the equation's: a call's literal argument, inlined, reaches an equation
    # that names a variable)
    pads = [producer[x] for x in op.inputs]
    widened = [_zero_pad_dims(p) for p in pads]
    if None in widened or len(dims := set().union(*widened)) != 1:
      return None
    (d,) = dims
    pieces = [_piece(p.inputs[0], d, p.params["padding_config"][d][0], producer) for p in pads]
  else:
    return None
  if len(pieces) != 2 or None in pieces:
    return None
  x, n = pieces[0].source, op.outputs[0].shape[d]
  shifts = {(p.at - p.start) % n for p in pieces}
  rows = sorted((p.start, p.rows) for p in pieces)
  if (any(p.source is not x for p in pieces) or x.shape != op.outputs[0].shape
      or len(shifts) != 1 or rows[0][0] != 0 or rows[0][1] != rows[1][0]
      or rows[1][0] + rows[1][1] != n):
    return None
  return (x, pieces[0].var), d, shifts.pop()


def _zero_pad_dims(op: Op) -> set[int] | None:
  """The dims a ``pad`` by zeros with no interior padding widens; None for any other op."""
  if op.eqn.primitive is not lax.pad_p:
    return None
  from spmd.partition.ir import Literal  # ir imports this module
  value, config = op.inputs[1], op.params["padding_config"]
  if (not isinstance(value, Literal) or value.val != 0
      or any(lo < 0 or hi < 0 or interior for lo, hi, interior in config)):
    return None
  return {d for d, (lo, hi, _) in enumerate(config) if lo or hi}


def _piece(v: Value, d: int, at: int, producer: dict[Value, Op]) -> _Piece | None:
  """``v`` as a piece of a value along ``d`` (a ``slice`` with unit strides; a ``split`` is
  inlined as slices)."""
  op = producer.get(v)
  if op is None or op.eqn.primitive is not lax.slice_p or any(
      s != 1 for s in op.params["strides"] or ()):
    return None  # (another producer's operand may be a literal: a broadcast of a zero)
  x = op.inputs[0]
  if any(m != n for e, (m, n) in enumerate(zip(v.shape, x.shape)) if e != d):
    return None
  return _Piece(x, op.eqn.invars[0], op.params["start_indices"][d], v.shape[d], at)
