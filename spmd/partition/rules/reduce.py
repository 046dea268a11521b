"""Reductions and scans along an axis.

Sums, max, min, and, or combine partial results across devices (an all-reduce); prod, xor and
argmax/argmin need the whole reduced dim on one device, and so do cumulative ops along their axis.
"""
from __future__ import annotations

from typing import Any

import jax.numpy as jnp

from spmd.partition.ir import Op
from spmd.partition.rules import register
from spmd.partition.rules.factors import FactorKind, OpShardingRule, RuleBuilder

# Reduction primitive -> the collective that combines per-device partial results.
COMBINERS = {"reduce_sum": "sum", "reduce_max": "max", "reduce_min": "min",
             "reduce_and": "min", "reduce_or": "max"}


@register(*COMBINERS, "reduce_prod", "reduce_xor", "argmax", "argmin")
def reduce(op: Op) -> OpShardingRule:
  shape = op.inputs[0].aval.shape
  axes = {a % len(shape) for a in op.params["axes"]}
  kind = FactorKind.REDUCTION if op.primitive in COMBINERS else FactorKind.NEED_REPLICATION
  b = RuleBuilder()
  operand = [b.factor(n, kind if d in axes else FactorKind.PASS) for d, n in enumerate(shape)]
  result = [f for d, f in enumerate(operand) if d not in axes]
  return b.build([operand] * len(op.inputs), [result] * len(op.outputs),
                 combiner=COMBINERS.get(op.primitive, "sum"))


@register("cumsum", "cumprod", "cummax", "cummin", "cumlogsumexp")
def cumulative(op: Op) -> OpShardingRule:
  shape = op.inputs[0].aval.shape
  b = RuleBuilder()
  dims = [b.factor(n, FactorKind.NEED_REPLICATION if d == op.params["axis"] else FactorKind.PASS)
          for d, n in enumerate(shape)]
  return b.build([dims], [dims])


def identity(combiner: str, dtype: Any) -> Any:
  """The value that leaves a ``combiner`` reduction unchanged."""
  dtype = jnp.dtype(dtype)
  if combiner == "sum":
    return jnp.zeros((), dtype)
  if dtype == jnp.bool_:
    return jnp.asarray(combiner == "min")
  big = jnp.inf if jnp.issubdtype(dtype, jnp.inexact) else jnp.iinfo(dtype).max
  small = -jnp.inf if jnp.issubdtype(dtype, jnp.inexact) else jnp.iinfo(dtype).min
  return jnp.asarray(small if combiner == "max" else big, dtype)
