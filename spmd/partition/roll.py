"""``jnp.roll`` as one op: JAX traces a roll by k along a dim of size n as
``concatenate([x[n-k:], x[:n-k]])``, two slices whose rows lie far from the rows they end up
beside. As one op, ``roll``, the dim is a rotation: each shard takes its rows from the one or two
shards they rotate from (halo_geometry.Rotation), as XLA does."""
from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from jax import lax
from jax.extend.core import Primitive
from jax.interpreters import mlir

if TYPE_CHECKING:
  from spmd.partition.ir import Op


def _roll(x: Any, *, shift: int, axis: int) -> Any:
  n = x.shape[axis]
  return lax.concatenate([lax.slice_in_dim(x, n - shift, n, axis=axis),
                          lax.slice_in_dim(x, 0, n - shift, axis=axis)], axis)


roll_p = Primitive("roll")
roll_p.def_impl(_roll)
roll_p.def_abstract_eval(lambda x, *, shift, axis: x)
mlir.register_lowering(roll_p, mlir.lower_fun(_roll, multiple_results=False))


def fuse_rolls(ops: list[Op]) -> None:
  """Replaces every concatenation of a roll's two slices, here and in regions, by a ``roll`` of
  the sliced value (the slices stay for their other readers, if any)."""
  producer = {v: op for op in ops for v in op.outputs}
  for k, op in enumerate(ops):
    for region in op.regions:
      fuse_rolls(region.ops)
    if op.eqn.primitive is not lax.concatenate_p:  # its operands are arrays, never literals
      continue
    shift = _roll_shift(op, [producer.get(x) for x in op.inputs])
    if shift is None:
      continue
    x = producer[op.inputs[0]].inputs[0]
    params = {"shift": shift, "axis": op.params["dimension"]}
    eqn = op.eqn.replace(primitive=roll_p, params=params,
                         invars=[producer[op.inputs[0]].eqn.invars[0]])
    ops[k] = dataclasses.replace(op, primitive=roll_p.name, params=params, inputs=(x,), eqn=eqn)


def _roll_shift(op: Op, pieces: list[Op | None]) -> int | None:
  """k if ``op`` is ``concatenate([x[n-k:], x[:n-k]])`` along one dim, else None."""
  if len(pieces) != 2 or any(p is None or p.eqn.primitive is not lax.slice_p for p in pieces):
    return None
  (tail, head), d = pieces, op.params["dimension"]
  x = tail.inputs[0]
  if head.inputs[0] is not x or x.shape != op.outputs[0].shape:
    return None
  n = x.shape[d]
  for p, (start, limit) in zip(pieces, [(head.params["limit_indices"][d], n),
                                        (0, tail.params["start_indices"][d])]):
    want_start = tuple(start if e == d else 0 for e in range(len(x.shape)))
    want_limit = tuple(limit if e == d else m for e, m in enumerate(x.shape))
    if (tuple(p.params["start_indices"]) != want_start
        or tuple(p.params["limit_indices"]) != want_limit
        or any(s != 1 for s in p.params["strides"] or ())):
      return None
  return n - tail.params["start_indices"][d]
