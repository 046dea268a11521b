"""jax.random under threefry: key arrays map dim by dim. Bits drawn from one key are new factors
any consumer may shard (threefry bits depend only on the global position, so each device computes
its block exactly); bits per key of a key array, and split keys, are computed whole per key."""
from __future__ import annotations

from spmd.partition.ir import Op
from spmd.partition.rules import register
from spmd.partition.rules.factors import FactorKind, OpShardingRule, RuleBuilder

WHOLE = FactorKind.NEED_REPLICATION


@register("random_bits", "random_split")
def generate(op: Op) -> OpShardingRule:
  keys, out = op.inputs[0].aval.shape, op.outputs[0].shape
  b = RuleBuilder()
  key_dims = b.factors(keys)
  per_key = FactorKind.PASS if op.primitive == "random_bits" and not keys else WHOLE
  return b.build([key_dims], [key_dims + b.factors(out[len(keys):], per_key)])


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
