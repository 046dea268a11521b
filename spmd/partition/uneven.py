"""Uneven partitioning: a dim of size N split n ways is held padded to n * ceil(N/n), the
padding at the end (reshard.py keeps regroupings exact). Padding may hold anything until an op
mixes elements along that dim: then it is replaced by the op's identity (0 for sums and for both
operands of a contraction, -inf/min for max, +inf/max for min, True for and, False for or, the
init values for a variadic reduce).
Elementwise chains never mask. Ops that need a dim whole get it gathered, padding dropped."""
from __future__ import annotations


import jax
import jax.numpy as jnp
from jax import lax

from spmd.partition.execution import Execution
from spmd.partition.ir import Op, Value
from spmd.partition.devices import shard_index
from spmd.partition.rules.factors import FactorKind
from spmd.partition.rules.reduce import identity
from spmd.partition.sharding import MeshShape, TensorSharding


def valid_rows(shape: tuple[int, ...], dim: int, size: int, s: TensorSharding,
               local: int) -> jax.Array:
  """Mask of the local block: True where the element along ``dim`` is inside the array."""
  rows = lax.broadcasted_iota(jnp.int32, shape, dim) + shard_index(s.dims[dim]) * local
  return rows < size


def mask_padding(ex: Execution, op: Op, reads: tuple, args: list, mesh: MeshShape) -> list:
  """Replaces padding with the op's identity along every uneven dim it reduces over."""
  if not ex.partial_axes:
    return args  # no reduction factor is sharded: the op mixes no padding into a result
  rule = ex.constraint.rule
  out = list(args)
  for k, (x, tf, read) in enumerate(zip(op.inputs, rule.operands, reads)):
    if not isinstance(x, Value) or tf is None or read is None:
      continue
    for d, factors in enumerate(tf):
      if not any(rule.kinds[f] is FactorKind.REDUCTION and ex.factor_axes[f] for f in factors):
        continue
      n, count = x.shape[d], read.shards(d, mesh)
      if n % count:
        local = -(-n // count)
        keep = valid_rows(out[k].shape, d, n, read, local)
        out[k] = jnp.where(keep, out[k], _pad_value(rule.combiner, args, k))
  return out


def _pad_value(combiner: str, args: list, k: int) -> jax.Array:
  """What pads operand ``k``: the combiner's identity, or (combiner "init": a variadic reduce,
  its operands then their init values) operand k's init value."""
  if combiner == "init":
    return jnp.asarray(args[len(args) // 2 + k], args[k].dtype)
  return identity(combiner, args[k].dtype)


