"""dot_general: batch and free dims pass through, contracting dims are reductions."""
from __future__ import annotations

from spmd.partition.ir import Op
from spmd.partition.rules.factors import FactorKind, OpShardingRule, RuleBuilder


def dot_general(op: Op) -> OpShardingRule:
  (lc, rc), (lb, rb) = op.params["dimension_numbers"]
  lhs, rhs = op.inputs[0].aval.shape, op.inputs[1].aval.shape
  b = RuleBuilder()
  lhs_dims: list = [None] * len(lhs)
  rhs_dims: list = [None] * len(rhs)
  batch = []
  for l, r in zip(lb, rb):
    lhs_dims[l] = rhs_dims[r] = b.factor(lhs[l])
    batch.append(lhs_dims[l])
  for l, r in zip(lc, rc):
    lhs_dims[l] = rhs_dims[r] = b.factor(lhs[l], FactorKind.REDUCTION)
  lhs_free = [d for d in range(len(lhs)) if d not in lb and d not in lc]
  rhs_free = [d for d in range(len(rhs)) if d not in rb and d not in rc]
  for d in lhs_free:
    lhs_dims[d] = b.factor(lhs[d])
  for d in rhs_free:
    rhs_dims[d] = b.factor(rhs[d])
  result = batch + [lhs_dims[d] for d in lhs_free] + [rhs_dims[d] for d in rhs_free]
  return b.build([lhs_dims, rhs_dims], [result])
