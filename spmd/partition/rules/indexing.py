"""Slicing, padding, reversal, concatenation and gather/scatter.

A dim the op moves elements along is a *permutation* factor on the operand (it must be whole, or
exchanged with neighbours) and a factor computed whole on the result; untouched dims pass through.
"""
from __future__ import annotations

import functools
from typing import Callable, Sequence

import jax.numpy as jnp

from spmd.partition.halo_geometry import Window
from spmd.partition.ir import Op, Value
from spmd.partition.rules.factors import FactorKind, OpShardingRule, RuleBuilder

PERM, WHOLE, REDUCE = FactorKind.PERMUTATION, FactorKind.NEED_REPLICATION, FactorKind.REDUCTION


def _moved_dims(b: RuleBuilder, operands: Sequence[tuple[int, ...]], result: tuple[int, ...],
                moved: set[int]) -> tuple[list[list], list]:
  """Factors for ops whose ``moved`` dims change; other dims are shared by every tensor."""
  shared = {d: b.factor(n) for d, n in enumerate(result) if d not in moved}
  operand_dims = [[shared[d] if d in shared else b.factor(n, PERM) for d, n in enumerate(shape)]
                  for shape in operands]
  result_dims = [shared[d] if d in shared else b.factor(n, WHOLE) for d, n in enumerate(result)]
  return operand_dims, result_dims


def slice_(op: Op) -> OpShardingRule:
  """A sliced dim is a window of one row with the slice's stride: a halo factor. A single row
  taken from a sharded dim is a reduction instead: its owner extracts it, the rest add zeros."""
  p, shape, out = op.params, op.inputs[0].aval.shape, op.outputs[0].shape
  strides = p["strides"] or (1,) * len(shape)
  b = RuleBuilder()
  operand, result = [], []
  for d, n in enumerate(shape):
    if out[d] == n:
      f = b.factor(n)
      operand.append(f)
      result.append(f)
    elif out[d] == 1 and _masked_reduction_ok(op):
      operand.append(b.factor(n, REDUCE))
      result.append(None)
    elif _is_key(op):  # a halo needs a pad value, a key array has none: the dim is whole
      operand.append(b.factor(n, PERM))
      result.append(b.factor(out[d], WHOLE))
    else:
      f = b.windowed(0, d, Window(n, out[d], 1, strides[d], -p["start_indices"][d],
                                  p["limit_indices"][d] - n))
      operand.append(f)
      result.append(f)
  return b.build([operand], [result], pass_through=out == shape)


def pad(op: Op) -> OpShardingRule:
  """A padded dim is a window of one row over the (interior-)dilated, edge-padded operand."""
  shape, out = op.inputs[0].aval.shape, op.outputs[0].shape
  b = RuleBuilder()
  dims = [b.factor(n) if tuple(cfg) == (0, 0, 0) else b.windowed(0, d, Window(
      n, out[d], 1, 1, cfg[0], cfg[1], cfg[2] + 1))
          for d, (n, cfg) in enumerate(zip(shape, op.params["padding_config"]))]
  return b.build([dims, None if not isinstance(op.inputs[1], Value) else []], [dims])


def rev(op: Op) -> OpShardingRule:
  """A reversed dim is shared by operand and result: shard i's rows come from shard n-1-i."""
  shape, reversed_dims = op.inputs[0].aval.shape, set(op.params["dimensions"])
  b = RuleBuilder()
  dims = [b.windowed(0, d, Window(n, n), mode="reverse") if d in reversed_dims else b.factor(n)
          for d, n in enumerate(shape)]
  return b.build([dims], [dims])


def roll(op: Op) -> OpShardingRule:
  """A rolled dim is shared by operand and result: shard i's rows rotate from one or two shards
  (the window's ``lo`` is the shift)."""
  shape, axis = op.inputs[0].aval.shape, op.params["axis"]
  b = RuleBuilder()
  dims = [b.windowed(0, d, Window(n, n, lo=op.params["shift"]), mode="rotate") if d == axis
          else b.factor(n) for d, n in enumerate(shape)]
  return b.build([dims], [dims])


def roll_dynamic(op: Op) -> OpShardingRule:
  """A roll by a traced shift: its rows may come from any shard, so the dim is whole (gathered
  once, as XLA gathers the operand before its concatenate); the others pass."""
  x, out = op.inputs[0].aval.shape, op.outputs[0].shape
  b = RuleBuilder()
  (operand,), result = _moved_dims(b, [x], out, {op.params["axis"]})
  return b.build([operand, _scalar(op.inputs[1])], [result])


def concatenate(op: Op) -> OpShardingRule:
  """Operand k reads the concatenated dim through a window of one row shifted by its offset: a
  halo factor over the result that every operand longer than one row shares; an operand held
  whole along it may be read whole instead (padded into place, no exchange). With every operand
  exchanged, their exchanges may be one (execution.py)."""
  dim, out = op.params["dimension"], op.outputs[0].shape
  b = RuleBuilder()
  shared = {d: b.factor(n) for d, n in enumerate(out) if d != dim}
  joined = b.factor(out[dim], FactorKind.HALO)
  operands, offset = [], 0
  for k, x in enumerate(op.inputs):
    n = x.aval.shape[dim]
    f = b.windowed(k, dim, Window(n, out[dim], lo=offset, hi=out[dim] - offset - n),
                   mode="concatenate", factor=joined, readable_whole=True) if n > 1 else None
    operands.append([f if d == dim else shared[d] for d in range(len(out))])
    offset += n
  return b.build(operands, [[joined if d == dim else shared[d] for d in range(len(out))]])


def stack(op: Op) -> OpShardingRule:
  """Operand dims pass through; the new dim exists only in the result, stacked whole (a device
  keeps its slice of it afterwards, locally)."""
  axis, out = op.params["axis"], op.outputs[0].shape
  b = RuleBuilder()
  result = [b.factor(n, WHOLE) if d == axis else b.factor(n) for d, n in enumerate(out)]
  operand = [f for d, f in enumerate(result) if d != axis]
  return b.build([operand if isinstance(x, Value) else None for x in op.inputs], [result])


def unstack(op: Op) -> OpShardingRule:
  """Result k is row k of the unstacked dim: that dim is whole on the operand, the others pass."""
  axis, shape = op.params["axis"], op.inputs[0].aval.shape
  b = RuleBuilder()
  operand = [b.factor(n, PERM) if d == axis else b.factor(n) for d, n in enumerate(shape)]
  return b.build([operand], [[f for d, f in enumerate(operand) if d != axis]] * len(op.outputs))


def dynamic_slice(op: Op) -> OpShardingRule:
  shape, out = op.inputs[0].aval.shape, op.outputs[0].shape
  b = RuleBuilder()
  (operand,), result = _moved_dims(b, [shape], out, {d for d in range(len(shape))
                                                      if out[d] != shape[d]})
  return b.build([operand] + [_scalar(x) for x in op.inputs[1:]], [result])


def dynamic_update_slice(op: Op) -> OpShardingRule:
  """Every dim of the operand passes to the result: each device writes the update's rows that
  land in its block (local.py), as XLA does. Dims the update covers whole pass through it too; a
  dim it covers in part is whole on the update (its rows may land on any shard)."""
  shape, update = op.inputs[0].aval.shape, op.inputs[1].aval.shape
  b = RuleBuilder()
  operand = b.factors(shape)
  update_dims = [f if update[d] == shape[d] else b.factor(update[d], WHOLE)
                 for d, f in enumerate(operand)]
  return b.build([operand, update_dims] + [_scalar(x) for x in op.inputs[2:]], [operand])


def gather(op: Op) -> OpShardingRule:
  """Offset dims pass to the result, index batch dims pass from the indices; an operand dim that
  is indexed with slice size 1 (collapsed or not) is a reduction: each device gathers the rows
  it owns (others masked to zero) and the partial results are summed."""
  dn, sizes = op.params["dimension_numbers"], op.params["slice_sizes"]
  operand, indices = op.inputs[0].aval.shape, op.inputs[1].aval.shape
  out = op.outputs[0].shape
  b = RuleBuilder()
  operand_dims: list = [None] * len(operand)
  index_dims: list = [None] * len(indices)
  result: list = [None] * len(out)
  batch_out = [d for d in range(len(out)) if d not in dn.offset_dims]
  index_batch = list(range(len(indices) - 1))  # the last dim holds the index vector
  for od, idim in zip(dn.operand_batching_dims, dn.start_indices_batching_dims):
    operand_dims[od] = index_dims[idim] = b.factor(operand[od])
  for idim, rd in zip(index_batch, batch_out):
    if index_dims[idim] is None:
      index_dims[idim] = b.factor(indices[idim])
    result[rd] = index_dims[idim]
  offset_operand = [d for d in range(len(operand))
                    if d not in dn.collapsed_slice_dims and d not in dn.operand_batching_dims]
  for od, rd in zip(offset_operand, dn.offset_dims):
    if sizes[od] == operand[od]:
      operand_dims[od] = result[rd] = b.factor(operand[od])
    elif _indexed_row(op, od):  # kept as a dim of 1 (jax.vmap's form of x[k])
      operand_dims[od] = b.factor(operand[od], REDUCE)
    else:
      operand_dims[od] = b.factor(operand[od], PERM)
      result[rd] = b.factor(out[rd], WHOLE)
  for od in dn.collapsed_slice_dims:
    operand_dims[od] = b.factor(operand[od], REDUCE if _indexed_row(op, od) else PERM)
  return b.build([operand_dims, index_dims], [result])


def _indexed_row(op: Op, d: int) -> bool:
  """Whether the gather takes one row of operand dim ``d`` at an index: a reduction factor
  there (local.gather masks the rows a device does not own)."""
  dn = op.params["dimension_numbers"]
  return (op.params["slice_sizes"][d] == 1 and d in dn.start_index_map
          and _masked_reduction_ok(op))


def scatter(combiner: str | None) -> Callable[[Op], OpShardingRule]:
  """Operand and result share every dim (each device applies the updates that land in its part);
  update window dims pass when whole, and a dim a window covers in part is whole on the operand
  and result too (a device would drop or shift a window straddling its part); when the updates
  combine by a ``combiner`` ("sum": scatter-add and -sub; "max", "min") the scatter batch dims
  of updates and indices are reductions (each device applies its part of the updates, the
  results combine: summed, each device but one adding to zeros; or their max or min, every
  device's from the operand, which max and min may count several times), or gathered whole
  where they are smaller than the result (OpShardingRule.repeatable)."""
  return functools.partial(_scatter, combiner=combiner)


def _scatter(op: Op, combiner: str | None) -> OpShardingRule:
  dn = op.params["dimension_numbers"]
  operand, indices, updates = (x.aval.shape for x in op.inputs[:3])
  b = RuleBuilder()
  window_operand = [d for d in range(len(operand))
                    if d not in dn.inserted_window_dims and d not in dn.operand_batching_dims]
  part = {od for od, ud in zip(window_operand, dn.update_window_dims) if updates[ud] != operand[od]}
  operand_dims = [b.factor(n, WHOLE if d in part else FactorKind.PASS)
                  for d, n in enumerate(operand)]
  update_dims: list = [None] * len(updates)
  index_dims: list = [None] * len(indices)
  for od, ud in zip(window_operand, dn.update_window_dims):
    update_dims[ud] = b.factor(updates[ud], WHOLE) if od in part else operand_dims[od]
  scatter_update = [d for d in range(len(updates)) if d not in dn.update_window_dims]
  batching = dict(zip(dn.scatter_indices_batching_dims, dn.operand_batching_dims))
  for idim, ud in zip(range(len(indices) - 1), scatter_update):
    if idim in batching:
      f = operand_dims[batching[idim]]
    else:
      f = b.factor(indices[idim], REDUCE if combiner else WHOLE)
    index_dims[idim] = update_dims[ud] = f
  rest = [None] * (len(op.inputs) - 3)
  return b.build([operand_dims, index_dims, update_dims] + rest, [operand_dims],
                 combiner=combiner or "sum", repeatable=True)


def _masked_reduction_ok(op: Op) -> bool:
  """Masked partial gathers sum exactly only for numeric dtypes (not bools, not key arrays;
  bfloat16 is one, though its numpy kind is "V")."""
  return jnp.issubdtype(op.outputs[0].dtype, jnp.number)


def _is_key(op: Op) -> bool:
  """A PRNG key array (an extended dtype without a numpy kind)."""
  return not hasattr(op.outputs[0].dtype, "kind")


def _scalar(x: object) -> list | None:
  return [] if isinstance(x, Value) else None
