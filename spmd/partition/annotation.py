"""User annotations: ``spmd.annotate`` and ``jax.lax.with_sharding_constraint`` inside a program.

``annotate`` binds its own identity primitive, so the same function runs unpartitioned anywhere
(jit, grad, vmap): the annotation means something only to ``spmd.partition``.
"""
from __future__ import annotations

import os
import traceback
from typing import Any, Mapping

import jax
from jax.extend.core import Primitive
from jax.interpreters import ad, batching, mlir
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from spmd.partition.ir import Op, names_mesh_axes
from spmd.partition.primitives import describe
from spmd.partition.sharding import TensorSharding, mesh_text, without_reductions

annotate_p = Primitive("spmd_annotate")
annotate_p.def_impl(lambda x, *, spec: x)
annotate_p.def_abstract_eval(lambda x, *, spec: x)
mlir.register_lowering(annotate_p, lambda ctx, x, *, spec: [x])
ad.deflinear2(annotate_p, lambda ct, x, *, spec: [annotate_p.bind(ct, spec=spec)])


def _batch(axis_data: Any, args: tuple, dims: tuple, *, spec: P) -> tuple[Any, int | None]:
  """As ``with_sharding_constraint`` batches: the mapped dim is split over the vmap's
  ``spmd_axis_name`` (a partly manual shard_map's axis), else left open to propagation."""
  (x,), (d,) = args, dims
  if d is None:
    return annotate_p.bind(x, spec=spec), None
  entries = list(spec) + [None] * (x.ndim - 1 - len(spec))
  name = axis_data.spmd_name
  entries.insert(d, P.UNCONSTRAINED if name is None else name[0] if len(name) == 1 else name)
  return annotate_p.bind(x, spec=P(*entries)), d


batching.fancy_primitive_batchers[annotate_p] = _batch


def annotate(x: Any, spec: P) -> Any:
  """Asks that every array in ``x`` be sharded as ``spec`` inside ``spmd.partition``.

  The identity everywhere else. Entries given as ``P.UNCONSTRAINED`` stay open to propagation.
  """
  if not isinstance(spec, P):
    raise TypeError(f"spmd.annotate: spec must be a jax.sharding.PartitionSpec, got {spec!r}")

  def one(leaf: Any) -> Any:
    ndim = jax.numpy.ndim(leaf)
    if len(spec) > ndim:
      raise ValueError(f"spmd.annotate: {spec} has {len(spec)} entries but the array has "
                       f"rank {ndim}")
    return annotate_p.bind(leaf, spec=spec)

  return jax.tree_util.tree_map(one, x)


Request = tuple[P, frozenset[int]]  # the spec asked for, and its open (unconstrained) dims


def annotation_spec(op: Op) -> Request | None:
  """What an op asks of its result's sharding: an annotation's spec, or the ``out_sharding=`` a
  user gave an op under an Explicit mesh; None if it asks nothing."""
  info = describe(op.eqn.primitive)
  if info is not None and info.annotation is not None:
    return info.annotation(op)
  return _out_sharding(op)


def annotate_request(op: Op) -> Request:
  spec = op.params["spec"]
  return spec, frozenset(d for d, e in enumerate(spec) if e is P.UNCONSTRAINED)


def constraint_request(op: Op) -> Request:
  sharding = op.params["sharding"]
  if not isinstance(sharding, NamedSharding):
    raise TypeError(f"with_sharding_constraint at {op.source}: spmd.partition needs a "
                    f"PartitionSpec or NamedSharding, got {type(sharding).__name__}")
  spec = without_reductions(sharding.spec)
  open_dims = set(op.params.get("unconstrained_dims") or ())
  open_dims |= {d for d, e in enumerate(spec) if e is P.UNCONSTRAINED}
  return spec, frozenset(open_dims)


def reshard_request(op: Op) -> Request | None:
  """``jax.sharding.reshard``'s destination. Over Explicit axes it is the result's type: a dim it
  leaves None is replicated, as under ``jax.jit``; where its mesh has Auto axes the dims stay
  open as a type's do (``_typed_open_dims``). One onto a mesh without axes (the cast jax.grad
  adds to a cotangent under ``jax.set_mesh``) asks nothing."""
  sharding = op.params["dst_sharding"]
  if not sharding.mesh.axis_names:
    return None
  spec, rank = without_reductions(sharding.spec), len(op.outputs[0].shape)
  if AxisType.Auto not in sharding.mesh.axis_types:
    return spec, frozenset(d for d in range(min(rank, len(spec))) if spec[d] is P.UNCONSTRAINED)
  return spec, _typed_open_dims(spec, sharding.mesh, rank)


def _out_sharding(op: Op) -> Request | None:
  """Under an Explicit mesh ops record their result's sharding in ``out_sharding`` (einsum, dot,
  reduce) or ``sharding`` (reshape, broadcast, convert): the dims it names mesh axes for are a
  request; the dims it leaves None stay open, since JAX writes the shardings it infers into the
  same params and spmd cannot tell a user's None from an inferred one."""
  sharding = op.params.get("out_sharding", op.params.get("sharding"))
  if not names_mesh_axes(sharding) or len(op.outputs) != 1:
    return None
  spec = without_reductions(sharding.spec)
  return spec, _typed_open_dims(spec, sharding.mesh, len(op.outputs[0].shape))


def explicit_type(aval: Any, mesh_axes: frozenset[str]) -> NamedSharding | None:
  """A value's type where it was traced on a mesh naming ``mesh_axes`` with Explicit axes and no
  Manual ones (jax.jit's layout for it: a dim it leaves None is whole over the Explicit axes,
  open to the Auto ones); None for a value on any other mesh, or typed unreduced or reduced."""
  sharding = getattr(aval, "sharding", None)
  mesh = getattr(sharding, "mesh", None)
  if (mesh is None or set(mesh.axis_names) != mesh_axes or not mesh.explicit_axes
      or mesh.manual_axes):
    return None
  spec = sharding.spec
  return None if spec.unreduced or spec.reduced else sharding


def _typed_open_dims(spec: P, mesh: Any, rank: int) -> frozenset[int]:
  """The dims a spec in a type on ``mesh`` leaves open: those it leaves None; every dim where
  the mesh has Auto axes and the spec names none of them (a type names only the Explicit axes,
  and jax.jit lowers it open to the Auto ones after them: Shardy's ``{"x", ?}``)."""
  auto = set(mesh.auto_axes)
  if auto and not auto & set(TensorSharding.from_spec(spec, rank, dict(mesh.shape)).axes):
    return frozenset(range(rank))
  return frozenset(d for d in range(rank) if d >= len(spec) or spec[d] is None
                   or spec[d] is P.UNCONSTRAINED)


_JAX_DIR = os.path.dirname(jax.__file__)
_SPEC_CHECKS = os.path.join("jax", "_src", "named_sharding.py")  # where JAX validates specs


def user_site(e: Exception) -> str:
  """" at file:line (function)" of the innermost frame of ``e`` outside JAX, or ""."""
  user = [f for f in traceback.extract_tb(e.__traceback__)
          if not f.filename.startswith(_JAX_DIR)]
  return (f" at {os.path.basename(user[-1].filename)}:{user[-1].lineno} ({user[-1].name})"
          if user else "")


def restate_spec_error(e: Exception, mesh: Mapping[str, int]) -> ValueError | None:
  """JAX's check of a spec asked for inside the traced function (``with_sharding_constraint``
  naming a mesh axis the mesh lacks, or one axis twice), restated with where it was asked, the
  mesh and the fix; None for any other error."""
  frames = traceback.extract_tb(e.__traceback__)
  if not any(f.filename.endswith(_SPEC_CHECKS) for f in frames):
    return None
  return ValueError(f"spmd.partition: the sharding asked for{user_site(e)} does not fit the mesh "
                    f"({mesh_text(mesh)}): {e} Name only the mesh's axes, each at most once; "
                    "logical names resolve through rules= in spmd.annotate or flax's "
                    "nn.with_logical_constraint")
