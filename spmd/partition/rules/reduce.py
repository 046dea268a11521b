"""Reductions and scans along an axis.

Sums, max, min, and the and / or of booleans combine partial results across devices (an
all-reduce); argmax/argmin and the variadic reduce reduce each shard, all-gather the per-shard
results and reduce them again (XLA's tuple reduce), and so do prod, xor and the and / or of
integers; cumulative ops combine each shard's scan with the totals of the shards before it.
"""
from __future__ import annotations

from typing import Any, Callable

import jax.numpy as jnp
import numpy as np

from spmd.partition.ir import Op
from spmd.partition.rules.factors import FactorKind, OpShardingRule, RuleBuilder

def reduction(combiner: str) -> Callable[[Op], OpShardingRule]:
  """Reduces ``params["axes"]``; partial results of a sharded axis combine with ``combiner``:
  "sum", "max" or "min" by an all-reduce later (and "or" and "and" of booleans, as "max" and
  "min"), "prod", "xor", and "or" and "and" of integers (which no JAX collective combines) by
  the op itself, all-gathering them and reducing again (or its axes moved to another dim first:
  relocatable)."""

  def rule(op: Op) -> OpShardingRule:
    boolean = op.outputs[0].aval.dtype == jnp.bool_
    combined = {"or": "max", "and": "min"}.get(combiner, combiner) if boolean else combiner
    itself = combined in ("prod", "xor", "or", "and")
    shape = op.inputs[0].aval.shape
    axes = {a % len(shape) for a in op.params["axes"]}
    b = RuleBuilder()
    operand = [b.factor(n, FactorKind.REDUCTION if d in axes else FactorKind.PASS)
               for d, n in enumerate(shape)]
    result = [f for d, f in enumerate(operand) if d not in axes]
    return b.build([operand] * len(op.inputs), [result] * len(op.outputs), combiner=combined,
                   gathers=(op.outputs[0].aval.dtype,) if itself else (), relocatable=itself)

  return rule


def arg_reduction(combiner: str) -> Callable[[Op], OpShardingRule]:
  """argmax (``combiner`` "max") or argmin ("min"): each shard's best value and its index are
  all-gathered over a sharded reduced dim and the best of them taken (padding masked with the
  ``combiner``'s identity)."""

  def rule(op: Op) -> OpShardingRule:
    x = op.inputs[0].aval
    axes = {a % len(x.shape) for a in op.params["axes"]}
    b = RuleBuilder()
    operand = [b.factor(n, FactorKind.REDUCTION if d in axes else FactorKind.PASS)
               for d, n in enumerate(x.shape)]
    result = [f for d, f in enumerate(operand) if d not in axes]
    return b.build([operand], [result], combiner=combiner,
                   gathers=(x.dtype, jnp.dtype(op.params["index_dtype"])), relocatable=True)

  return rule


# Computations of a one-array ``reduce`` whose per-shard results an all-reduce combines: the
# idempotent ones, so the init each shard folds in counts once (or / and on booleans only).
_IDEMPOTENT = {"max": "max", "min": "min", "or": "max", "and": "min"}


def all_reduce_combiner(op: Op) -> str | None:
  """The all-reduce ("max" or "min") that combines the per-shard results of a one-array generic
  ``reduce`` (``lax.reduce`` with an init JAX does not take for the identity) whose computation
  is max, min, or, and of its two arguments; None for any other."""
  jaxpr = op.params["jaxpr"].jaxpr
  if len(op.inputs) != 2 or len(jaxpr.eqns) != 1:
    return None
  (eqn,) = jaxpr.eqns
  name = eqn.primitive.name
  if name in ("or", "and") and op.inputs[0].aval.dtype != jnp.bool_:
    return None
  args = list(jaxpr.invars)
  if list(eqn.invars) not in (args, args[::-1]) or list(eqn.outvars) != list(jaxpr.outvars):
    return None
  return _IDEMPOTENT.get(name)


def variadic_reduce(op: Op) -> OpShardingRule:
  """The generic ``reduce`` (any computation, several operands): each shard is reduced, the
  per-shard results all-gathered over a sharded reduced dim and reduced again (padding masked
  with the init values, ``combiner`` "init"); or, for an idempotent computation
  (``all_reduce_combiner``), all-reduced as reduce_max / reduce_min's are."""
  shape = op.inputs[0].aval.shape
  axes = set(op.params["dimensions"])
  b = RuleBuilder()
  operand = [b.factor(n, FactorKind.REDUCTION if d in axes else FactorKind.PASS)
             for d, n in enumerate(shape)]
  result = [f for d, f in enumerate(operand) if d not in axes]
  combiner = all_reduce_combiner(op)
  if combiner:
    return b.build([operand, None], [result], combiner=combiner)
  arrays = len(op.inputs) // 2
  return b.build([operand] * arrays + [None] * arrays, [result] * len(op.outputs),
                 combiner="init", gathers=tuple(v.aval.dtype for v in op.outputs),
                 relocatable=True)


def cumulative(combiner: str) -> Callable[[Op], OpShardingRule]:
  """cumsum ("sum"), cumprod ("prod"), cummax, cummin, cumlogsumexp ("logaddexp"): along a
  sharded axis each shard scans its block, the shards' totals are all-gathered and each shard
  combines its block with the totals of the shards before it; or the axis's mesh axes move to
  another dim first (relocatable)."""

  def rule(op: Op) -> OpShardingRule:
    x = op.inputs[0].aval
    b = RuleBuilder()
    dims = [b.factor(n, FactorKind.REDUCTION if d == op.params["axis"] else FactorKind.PASS)
            for d, n in enumerate(x.shape)]
    return b.build([dims], [dims], combiner=combiner, gathers=(x.dtype,), relocatable=True)

  return rule


def identity(combiner: str, dtype: Any) -> Any:
  """The value that leaves a ``combiner`` reduction unchanged."""
  dtype = jnp.dtype(dtype)
  if combiner in ("sum", "xor", "or"):
    return jnp.zeros((), dtype)
  if combiner == "and":  # every bit set
    return jnp.asarray(np.invert(np.zeros((), dtype)))
  if combiner == "prod":
    return jnp.ones((), dtype)
  if combiner == "logaddexp":
    return jnp.asarray(-jnp.inf, dtype)
  if dtype == jnp.bool_:
    return jnp.asarray(combiner == "min")
  big = jnp.inf if jnp.issubdtype(dtype, jnp.inexact) else jnp.iinfo(dtype).max
  small = -jnp.inf if jnp.issubdtype(dtype, jnp.inexact) else jnp.iinfo(dtype).min
  return jnp.asarray(small if combiner == "max" else big, dtype)
