"""sort, top_k and approx_top_k: the sorted dim must be whole on each device; other dims pass
through, and may take the sorted dim's mesh axes (an all-to-all, as XLA's partitioner moves
them)."""
from __future__ import annotations

from spmd.partition.ir import Op
from spmd.partition.rules.factors import FactorKind, OpShardingRule, RuleBuilder


def sort(op: Op) -> OpShardingRule:
  shape = op.inputs[0].aval.shape
  b = RuleBuilder()
  dims = [b.factor(n, FactorKind.NEED_REPLICATION if d == op.params["dimension"] else
                   FactorKind.PASS) for d, n in enumerate(shape)]
  return b.build([dims] * len(op.inputs), [dims] * len(op.outputs), relocatable=True)


def top_k(op: Op) -> OpShardingRule:
  shape = op.inputs[0].aval.shape
  return _top_k_along(op, op.params.get("axis", len(shape) - 1) % len(shape))


def approx_top_k(op: Op) -> OpShardingRule:
  """Each row's top k is the row's alone (XLA's approximate algorithm, like its CPU fallback, reads
  one row): with the reduced dim whole on a device, its block's call is the global call's block."""
  return _top_k_along(op, op.params["reduction_dimension"] % len(op.inputs[0].aval.shape))


def _top_k_along(op: Op, axis: int) -> OpShardingRule:
  """The top k along ``axis``: it must be whole in the operand and the results; the rest pass."""
  shape = op.inputs[0].aval.shape
  b = RuleBuilder()
  operand = [b.factor(n, FactorKind.NEED_REPLICATION) if d == axis else b.factor(n)
             for d, n in enumerate(shape)]
  k_dim = b.factor(op.outputs[0].shape[axis], FactorKind.NEED_REPLICATION)
  result = [k_dim if d == axis else f for d, f in enumerate(operand)]
  return b.build([operand], [result] * len(op.outputs), relocatable=True)
