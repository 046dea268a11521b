"""Sharding rules, one table entry per primitive: ``RULES[name](op) -> OpShardingRule``.

Importing this package registers every rule family; ``rule_for`` is the engine's only entry.
"""
from __future__ import annotations

import dataclasses
from typing import Callable

import jax.numpy as jnp

from spmd.partition.ir import Op
from spmd.partition.rules.factors import FactorKind, OpShardingRule, RuleBuilder
from spmd.partition.rules.linear import linearity

RuleFn = Callable[[Op], OpShardingRule]
RULES: dict[str, RuleFn] = {}


def register(*names: str) -> Callable[[RuleFn], RuleFn]:
  def deco(fn: RuleFn) -> RuleFn:
    for name in names:
      RULES[name] = fn
    return fn
  return deco


def replicated_rule(op: Op) -> OpShardingRule:
  """Every dim of every tensor replicated: correct for any primitive, never fast."""
  b = RuleBuilder()
  return b.build([None if _is_literal(x) else [None] * len(x.aval.shape) for x in op.inputs],
                 [[None] * len(v.aval.shape) for v in op.outputs])


def rule_for(op: Op) -> tuple[OpShardingRule, bool]:
  """The op's rule and whether the primitive has one (False: replicated fallback)."""
  fn = RULES.get(op.primitive)
  if fn is None:
    return replicated_rule(op), False
  avals = [x.aval for x in (*op.inputs, *op.outputs)]
  widening = (bool(op.inputs) and all(jnp.issubdtype(a.dtype, jnp.inexact) for a in avals)
              and op.outputs[0].aval.dtype.itemsize >= op.inputs[0].aval.dtype.itemsize)
  linear_in, additive = linearity(op.primitive, len(op.inputs), widening)
  return dataclasses.replace(fn(op), linear_in=linear_in, additive=additive), True


def _is_literal(x: object) -> bool:
  return not hasattr(x, "id")


from spmd.partition.rules import (  # noqa: E402,F401  (registration side effects)
    control, conv, dot, elementwise, indexing, random, reduce, shape, sort, window)

__all__ = ["FactorKind", "OpShardingRule", "RuleBuilder", "RULES", "register", "rule_for",
           "replicated_rule"]
