"""Shape ops: broadcast_in_dim, tile, reshape, squeeze, transpose, iota."""
from __future__ import annotations

from spmd.partition.ir import Op
from spmd.partition.rules.factors import OpShardingRule, RuleBuilder


def broadcast_in_dim(op: Op) -> OpShardingRule:
  x, out_shape = op.inputs[0], op.outputs[0].shape
  b = RuleBuilder()
  factors = b.factors(out_shape)
  operand = [factors[d] if x.aval.shape[i] == out_shape[d] else None
             for i, d in enumerate(op.params["broadcast_dimensions"])]
  return b.build([operand] + [None] * (len(op.inputs) - 1), [factors], broadcast=True)


def tile(op: Op) -> OpShardingRule:
  """A dim repeated from one row is a broadcast (its result dim may be split); one repeated from
  several rows is whole in the operand and the result; the others pass."""
  x, out_shape = op.inputs[0], op.outputs[0].shape
  b = RuleBuilder()
  factors = [b.factor(m) if n in (1, m) else None for n, m in zip(x.aval.shape, out_shape)]
  operand = [f if n == m else None for f, n, m in zip(factors, x.aval.shape, out_shape)]
  return b.build([operand], [factors])


def transpose(op: Op) -> OpShardingRule:
  b = RuleBuilder()
  operand = b.factors(op.inputs[0].aval.shape)
  return b.build([operand], [[operand[d] for d in op.params["permutation"]]], pass_through=True)


def squeeze(op: Op) -> OpShardingRule:
  shape = op.inputs[0].aval.shape
  dropped = {d % len(shape) for d in op.params["dimensions"]}
  b = RuleBuilder()
  operand = [None if d in dropped else b.factor(n) for d, n in enumerate(shape)]
  return b.build([operand], [[f for d, f in enumerate(operand) if d not in dropped]],
                 pass_through=True)


def expand_dims(op: Op) -> OpShardingRule:
  b = RuleBuilder()
  operand = b.factors(op.inputs[0].aval.shape)
  added = {d % len(op.outputs[0].shape) for d in op.params["dimensions"]}
  it = iter(operand)
  return b.build([operand], [[None if d in added else next(it)
                              for d in range(len(op.outputs[0].shape))]], pass_through=True)


def iota(op: Op) -> OpShardingRule:
  b = RuleBuilder()
  return b.build([None] * len(op.inputs), [b.factors(op.outputs[0].shape)])


def reshape(op: Op) -> OpShardingRule:
  """Factors refine both shapes major to minor: (4, 6) -> (8, 3) is
  ([a], [b, c]) -> ([a, b], [c])."""
  src, dst = op.inputs[0].aval.shape, op.outputs[0].shape
  b = RuleBuilder()
  src_dims: list[list[int]] = [[] for _ in src]
  dst_dims: list[list[int]] = [[] for _ in dst]
  i = j = 0
  ri, rj = (src[0] if src else 1), (dst[0] if dst else 1)
  while i < len(src) and j < len(dst):
    if ri == 1:
      i += 1
      ri = src[i] if i < len(src) else 1
      continue
    if rj == 1:
      j += 1
      rj = dst[j] if j < len(dst) else 1
      continue
    if ri == 0 or rj == 0 or (ri % rj and rj % ri):
      break  # a zero-size dim, or no common major factor: the rest stays replicated
    size = min(ri, rj)
    f = b.factor(size)
    src_dims[i].append(f)
    dst_dims[j].append(f)
    ri //= size
    rj //= size
  return b.build([src_dims] + [None] * (len(op.inputs) - 1), [dst_dims], pass_through=True)
