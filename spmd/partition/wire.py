"""Bytes per element that a collective moves, for the backend the program is compiled for.

XLA:CPU widens every bfloat16 collective (all-reduce, all-gather, reduce-scatter, all-to-all,
collective-permute) to float32, so there a bfloat16 element costs 4 bytes; other dtypes, and
bfloat16 on GPU and TPU, move at their own size. A max or min of floats is all-reduced as
ordered integers (reshard.py, so that a NaN wins): as wide as the float, but XLA:GPU promotes
all-reduces of 16-bit integers to 32 bits (taken to hold on TPU too).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax.numpy as jnp


@dataclass(frozen=True)
class Wire:
  """``wire(dtype)``: bytes per element of ``dtype`` in a collective on ``platform``."""

  platform: str

  def __call__(self, dtype: Any) -> int:
    if self.platform == "cpu" and dtype == jnp.bfloat16:
      return 4
    return dtype.itemsize

  def ordered(self, dtype: Any) -> int:
    """Bytes per element of an all-reduce of a float's ordered integers."""
    width = self(dtype)
    return 4 if width == 2 and self.platform != "cpu" else width


def wire_for(platform: str) -> Wire:
  return Wire(platform)
