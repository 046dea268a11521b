"""Elementwise ops: one factor per output dim, shared by every operand that is not broadcast;
identities (annotations, checkpoint names) and bitcasts are elementwise too."""
from __future__ import annotations

import functools

from spmd.partition.ir import Op, Value
from spmd.partition.rules.factors import OpShardingRule, RuleBuilder

def elementwise(op: Op) -> OpShardingRule:
  return _elementwise(op.outputs[0].shape,
                      tuple(x.shape if isinstance(x, Value) else None for x in op.inputs),
                      len(op.outputs))


@functools.lru_cache(maxsize=4096)
def _elementwise(out_shape: tuple[int, ...], operand_shapes: tuple[tuple[int, ...] | None, ...],
                 results: int) -> OpShardingRule:
  """The rule depends on shapes only (None: a literal), so a program's thousands of elementwise
  ops share a few rules."""
  b = RuleBuilder()
  factors = b.factors(out_shape)
  operands = [None if shape is None else _broadcast_dims(shape, out_shape, factors)
              for shape in operand_shapes]
  return b.build(operands, [factors] * results, pass_through=True)


def bitcast_convert_type(op: Op) -> OpShardingRule:
  """Same-width bitcasts are elementwise; width changes add or drop a minor dim."""
  x, out = op.inputs[0], op.outputs[0]
  rank = min(len(x.shape), len(out.shape))
  b = RuleBuilder()
  shared = b.factors(out.shape[:rank])
  operand = shared + [None] * (len(x.shape) - rank)
  result = shared + [None] * (len(out.shape) - rank)
  return b.build([operand], [result], pass_through=True)


def per_tensor_identity(op: Op) -> OpShardingRule:
  """Operand k is result k (optimization_barrier, device_put)."""
  b = RuleBuilder()
  per_tensor = [b.factors(v.shape) for v in op.outputs]
  return b.build([None if not isinstance(x, Value) else f for x, f in zip(op.inputs, per_tensor)],
                 per_tensor, pass_through=True)


def _broadcast_dims(shape: tuple[int, ...], out_shape: tuple[int, ...], factors: list) -> list:
  if len(shape) != len(out_shape):
    return [None] * len(shape)  # rank-0 operands broadcast implicitly
  return [f if n == m else None for f, n, m in zip(factors, shape, out_shape)]
