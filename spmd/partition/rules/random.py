"""jax.random under threefry: key arrays map dim by dim; generated bits are new factors that any
consumer may shard (bits depend only on the global position, so any sharding is exact)."""
from __future__ import annotations

from spmd.partition.ir import Op
from spmd.partition.rules import register
from spmd.partition.rules.factors import OpShardingRule, RuleBuilder


@register("random_bits", "random_split")
def generate(op: Op) -> OpShardingRule:
  keys, out = op.inputs[0].aval.shape, op.outputs[0].shape
  b = RuleBuilder()
  key_dims = b.factors(keys)
  return b.build([key_dims], [key_dims + b.factors(out[len(keys):])])


@register("random_wrap")
def wrap(op: Op) -> OpShardingRule:
  b = RuleBuilder()
  key_dims = b.factors(op.outputs[0].shape)
  return b.build([key_dims + [None]], [key_dims], pass_through=True)


@register("random_unwrap")
def unwrap(op: Op) -> OpShardingRule:
  b = RuleBuilder()
  key_dims = b.factors(op.inputs[0].aval.shape)
  return b.build([key_dims], [key_dims + [None]], pass_through=True)
