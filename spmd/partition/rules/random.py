"""jax.random under threefry: key arrays map dim by dim. Bits drawn from one key are new factors
any consumer may shard (threefry bits depend only on the global position, so each device computes
its block exactly); bits per key of a key array, and split keys, are computed whole per key."""
from __future__ import annotations

from spmd.partition.ir import Op
from spmd.partition.rules.factors import FactorKind, OpShardingRule, RuleBuilder

WHOLE = FactorKind.NEED_REPLICATION


def random_bits(op: Op) -> OpShardingRule:
  return _generate(op, FactorKind.PASS if not op.inputs[0].aval.shape else WHOLE)


def random_split(op: Op) -> OpShardingRule:
  return _generate(op, WHOLE)


def gamma(op: Op) -> OpShardingRule:
  """Per element of alpha, keyed by its key's dims (alpha's leading ones) and its position in
  the rest (local.random_gamma)."""
  b = RuleBuilder()
  dims = b.factors(op.outputs[0].shape)
  return b.build([dims[:op.inputs[0].aval.ndim], dims], [dims])


def _generate(op: Op, per_key: FactorKind) -> OpShardingRule:
  keys, out = op.inputs[0].aval.shape, op.outputs[0].shape
  b = RuleBuilder()
  key_dims = b.factors(keys)
  return b.build([key_dims], [key_dims + b.factors(out[len(keys):], per_key)])


def wrap(op: Op) -> OpShardingRule:
  b = RuleBuilder()
  key_dims = b.factors(op.outputs[0].shape)
  return b.build([key_dims + [None]], [key_dims], pass_through=True)


def unwrap(op: Op) -> OpShardingRule:
  b = RuleBuilder()
  key_dims = b.factors(op.inputs[0].aval.shape)
  return b.build([key_dims], [key_dims + [None]], pass_through=True)
