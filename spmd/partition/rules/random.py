"""jax.random: key arrays map dim by dim. Bits drawn from one key are new factors any consumer
may shard (threefry bits depend only on the global position where threefry is partitionable, so
each device computes its block exactly; other bits are drawn whole and sliced,
local.random_bits); bits per key of a key array, and split keys, are computed whole per key.

Only where each key's results depend on that key alone (``_per_key``): rng_bit_generator, with
which rbg draws bits and unsafe_rbg does everything, draws a whole key array's batch from its
first key (JAX's batching rule), so there the op runs on the whole key array."""
from __future__ import annotations

import math

from jax.extend.random import rbg_prng_impl, threefry_prng_impl

from spmd.partition.ir import Op
from spmd.partition.jax_compat import key_impl, threefry_partitionable_at
from spmd.partition.primitives import replicated_rule
from spmd.partition.rules.elementwise import elementwise
from spmd.partition.rules.factors import FactorKind, OpShardingRule, RuleBuilder

WHOLE = FactorKind.NEED_REPLICATION


def random_bits(op: Op) -> OpShardingRule:
  return _generate(op, FactorKind.PASS if not op.inputs[0].aval.shape else WHOLE)


def random_split(op: Op) -> OpShardingRule:
  return _generate(op, WHOLE)


def fold_in(op: Op) -> OpShardingRule:
  return elementwise(op) if _per_key(op) else replicated_rule(op)


def gamma(op: Op) -> OpShardingRule:
  """Per element of alpha, keyed by its key's dims (alpha's leading ones) and its position in
  the rest (local.random_gamma)."""
  if not _per_key(op):
    return replicated_rule(op)
  b = RuleBuilder()
  dims = b.factors(op.outputs[0].shape)
  return b.build([dims[:op.inputs[0].aval.ndim], dims], [dims])


def poisson(op: Op) -> OpShardingRule:
  """Per element of lam, keyed by its key's dims (lam's leading ones); the rest drawn at their
  positions (local.random_poisson) where threefry bits are (``by_position``), else whole per
  key."""
  if not _per_key(op):
    return replicated_rule(op)
  b = RuleBuilder()
  shape, keys = op.outputs[0].shape, op.inputs[0].aval.ndim
  by_key = b.factors(shape[:keys])
  drawn = b.factors(shape[keys:], FactorKind.PASS if by_position(op)
                    and math.prod(shape[keys:]) < 2 ** 32 else WHOLE)
  return b.build([by_key, by_key + drawn], [by_key + drawn])


def by_position(op: Op) -> bool:
  """Whether bits ``op`` draws from one key are a function of their flat position alone, so that
  each device can draw its block: threefry's, where ``jax_threefry_partitionable`` holds where
  the op was traced (JAX's default; a ``with`` inside the function sets it per op)."""
  return (key_impl(op.inputs[0].aval) is threefry_prng_impl
          and threefry_partitionable_at(op.eqn))


def _per_key(op: Op) -> bool:
  """Whether each key's results depend on that key alone (and the global position): so under
  threefry, and rbg's split and fold_in (threefry on its halves), but not where rbg draws bits
  or unsafe_rbg does anything (rng_bit_generator)."""
  impl = key_impl(op.inputs[0].aval)
  return impl is threefry_prng_impl or (impl is rbg_prng_impl and op.primitive != "random_bits")


def _generate(op: Op, per_key: FactorKind) -> OpShardingRule:
  keys, out = op.inputs[0].aval.shape, op.outputs[0].shape
  if keys and not _per_key(op):
    return replicated_rule(op)
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
