"""Windowed reductions (pooling) and their gradients: dims with a trivial window pass through,
dims with a real window are permutation factors."""
from __future__ import annotations

from spmd.partition.ir import Op, Value
from spmd.partition.rules import register
from spmd.partition.rules.factors import FactorKind, OpShardingRule, RuleBuilder

PERM, WHOLE = FactorKind.PERMUTATION, FactorKind.NEED_REPLICATION


def _windowed_dims(op: Op) -> set[int]:
  p = op.params
  rank = len(p["window_dimensions"])
  ones = (1,) * rank
  return {d for d in range(rank)
          if p["window_dimensions"][d] != 1 or p["window_strides"][d] != 1
          or tuple(p["padding"][d]) != (0, 0)
          or p.get("base_dilation", ones)[d] != 1 or p.get("window_dilation", ones)[d] != 1}


@register("reduce_window_sum", "reduce_window_max", "reduce_window_min", "reduce_window",
          "select_and_scatter_add", "select_and_gather_add", "select_and_scatter")
def windowed(op: Op) -> OpShardingRule:
  moved = _windowed_dims(op)
  shape = op.outputs[0].shape
  b = RuleBuilder()
  shared = {d: b.factor(n) for d, n in enumerate(shape) if d not in moved}
  operands = []
  for x in op.inputs:
    if not isinstance(x, Value) or len(x.shape) != len(shape):
      operands.append(None if not isinstance(x, Value) else [None] * len(x.shape))
      continue
    operands.append([shared[d] if d in shared else b.factor(n, PERM)
                     for d, n in enumerate(x.shape)])
  results = [[shared[d] if d in shared else b.factor(n, WHOLE) for d, n in enumerate(v.shape)]
             for v in op.outputs]
  return b.build(operands, results)
