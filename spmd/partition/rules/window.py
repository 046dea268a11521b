"""Windowed reductions (pooling) and their gradients: dims with a trivial window pass through;
a dim with a real window is a halo factor shared by operands and result (reduce_window,
select_and_scatter_add), or whole (select_and_gather_add, select_and_scatter)."""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jax.extend import core as jcore

from spmd.partition.halo_geometry import Window
from spmd.partition.ir import Literal, Op, Value
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


def reduce_window(op: Op) -> OpShardingRule:
  """Every array operand reads a windowed dim through the window (a halo factor). Halo rows
  outside the array hold the init value while XLA leaves padding out of the reduction: the
  generic reduce_window (any computation, several operands) keeps a padded windowed dim whole
  unless combining the init once more changes nothing."""
  p, moved = op.params, _windowed_dims(op)
  shape = op.outputs[0].shape
  rank = len(shape)
  ones = (1,) * rank
  arrays = [k for k, x in enumerate(op.inputs) if isinstance(x, Value) and len(x.shape) == rank]
  b = RuleBuilder()
  operand_dims: list[list] = [[] for _ in op.inputs]
  result = []
  for d, n in enumerate(shape):
    if d not in moved:
      f = b.factor(n)
      result.append(f)
      for k in arrays:
        operand_dims[k].append(f)
      continue
    if ("jaxpr" in p and tuple(p["padding"][d]) != (0, 0)
        and not _init_absorbs(op)):
      result.append(b.factor(n, WHOLE))
      for k in arrays:
        operand_dims[k].append(b.factor(op.inputs[k].aval.shape[d], PERM))
      continue
    window = Window(op.inputs[0].aval.shape[d], n, p["window_dimensions"][d],
                    p["window_strides"][d], *p["padding"][d], p.get("base_dilation", ones)[d],
                    p.get("window_dilation", ones)[d])
    f = b.windowed(arrays[0], d, window)
    for k in arrays[1:]:
      b.windowed(k, d, window, factor=f)
    result.append(f)
    for k in arrays:
      operand_dims[k].append(f)
  operands = [operand_dims[k] if k in arrays else
              None if not isinstance(x, Value) else [None] * len(x.shape)
              for k, x in enumerate(op.inputs)]
  return b.build(operands, [result] * len(op.outputs))


def _init_absorbs(op: Op) -> bool:
  """Whether f(f(a, init), init) == f(a, init) on sample values: then padding filled with the
  init (an identity, or an idempotent combiner) gives what XLA gives by skipping padding."""
  arrays = len(op.inputs) // 2
  inits = op.inputs[arrays:]
  if not all(isinstance(x, Literal) for x in inits):
    return False
  closed = jcore.ClosedJaxpr(op.params["jaxpr"], op.params["consts"])
  combine = jcore.jaxpr_as_fun(closed)
  init = [np.asarray(x.val, x.aval.dtype) for x in inits]
  for sample in (-np.inf, -2.5, -1.0, 0.0, 0.5, 1.0, 3.0, np.inf):
    a = [np.asarray(sample).astype(x.dtype)
         if np.isfinite(sample) or jnp.issubdtype(x.dtype, jnp.floating)
         else np.asarray(0, x.dtype) for x in init]
    once = combine(*a, *init)
    twice = combine(*once, *init)
    if not all(np.array_equal(np.asarray(u), np.asarray(v), equal_nan=True)
               for u, v in zip(once, twice)):
      return False
  return True


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


def whole_windows(op: Op) -> OpShardingRule:
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
