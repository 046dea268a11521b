"""Windowed reductions (pooling) and their gradients: dims with a trivial window pass through;
a dim with a real window is a halo factor shared by operands and result (reduce_window,
select_and_scatter_add), or whole (select_and_gather_add, select_and_scatter)."""
from __future__ import annotations

from spmd.partition.halo import Window
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


@register("reduce_window_sum", "reduce_window_max", "reduce_window_min", "reduce_window")
def reduce_window(op: Op) -> OpShardingRule:
  p, moved = op.params, _windowed_dims(op)
  shape = op.outputs[0].shape
  rank = len(shape)
  ones = (1,) * rank
  b = RuleBuilder()
  dims = []
  for d, n in enumerate(shape):
    if d not in moved:
      dims.append(b.factor(n))
      continue
    window = Window(op.inputs[0].aval.shape[d], n, p["window_dimensions"][d],
                    p["window_strides"][d], *p["padding"][d], p.get("base_dilation", ones)[d],
                    p.get("window_dilation", ones)[d])
    dims.append(b.windowed(0, d, window))
  arrays = [x for x in op.inputs if isinstance(x, Value) and len(x.shape) == rank]
  operands = [dims if x in arrays else None if not isinstance(x, Value) else [None] * len(x.shape)
              for x in op.inputs]
  return b.build(operands, [dims] * len(op.outputs))


@register("select_and_scatter_add")
def select_and_scatter_add(op: Op) -> OpShardingRule:
  """The max-pool gradient: source (one row per window) scatters into operand-shaped rows; a
  windowed dim is one halo factor over source, operand and result."""
  p, moved = op.params, _windowed_dims(op)
  source, operand = op.inputs[0].aval.shape, op.inputs[1].aval.shape
  b = RuleBuilder()
  dims = []
  for d, n in enumerate(operand):
    if d not in moved:
      dims.append(b.factor(n))
      continue
    window = Window(n, source[d], p["window_dimensions"][d], p["window_strides"][d],
                    *p["padding"][d])
    dims.append(b.windowed(1, d, window, mode="scatter"))
  return b.build([dims, dims], [dims])


@register("select_and_gather_add", "select_and_scatter")
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
