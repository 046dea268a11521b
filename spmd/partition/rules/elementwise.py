"""Elementwise ops: one factor per output dim, shared by every operand that is not broadcast;
identities (annotations, checkpoint names) and bitcasts are elementwise too."""
from __future__ import annotations

from spmd.partition.ir import Op, Value
from spmd.partition.rules.factors import OpShardingRule, RuleBuilder

def elementwise(op: Op) -> OpShardingRule:
  out_shape = op.outputs[0].shape
  b = RuleBuilder()
  factors = b.factors(out_shape)
  operands = [_broadcast_dims(x, out_shape, factors) for x in op.inputs]
  return b.build(operands, [factors] * len(op.outputs), pass_through=True)


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


def _broadcast_dims(x: object, out_shape: tuple[int, ...], factors: list) -> list | None:
  if not isinstance(x, Value):
    return None
  shape = x.shape
  if len(shape) != len(out_shape):
    return [None] * len(shape)  # rank-0 operands broadcast implicitly
  return [f if n == m else None for f, n, m in zip(factors, shape, out_shape)]
