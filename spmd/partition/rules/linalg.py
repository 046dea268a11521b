"""Batched matrix and FFT ops (cholesky, qr, svd, eigh, triangular_solve, lu, fft, ...): the
leading batch dims pass through every operand and result; the trailing core dims (the matrices,
the transformed axes) are whole on each device."""
from __future__ import annotations

from typing import Callable

from spmd.partition.ir import Op, Value
from spmd.partition.rules.factors import OpShardingRule, RuleBuilder


def batched(core_rank: Callable[[Op], int]) -> Callable[[Op], OpShardingRule]:
  """The rule of an op whose first operand has ``core_rank(op)`` trailing core dims."""

  def rule(op: Op) -> OpShardingRule:
    first = op.inputs[0].aval.shape
    batch = first[:len(first) - core_rank(op)]
    b = RuleBuilder()
    shared = b.factors(batch)

    def dims(x: object) -> list | None:
      if not isinstance(x, Value):
        return None
      lead = len(batch) if x.shape[:len(batch)] == batch else 0
      return shared[:lead] + [None] * (len(x.shape) - lead)

    return b.build([dims(x) for x in op.inputs], [dims(v) for v in op.outputs])

  return rule


def matrix(op: Op) -> int:
  return 2


def vector(op: Op) -> int:
  return 1


def fft_axes(op: Op) -> int:
  return len(op.params["fft_lengths"])
