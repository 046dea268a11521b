"""Bytes per element that a collective moves, for the backend the program is compiled for.

XLA:CPU widens every bfloat16 collective (all-reduce, all-gather, reduce-scatter, all-to-all,
collective-permute) to float32, so there a bfloat16 element costs 4 bytes; other dtypes, and
bfloat16 on GPU and TPU, move at their own size.
"""
from __future__ import annotations

from typing import Any, Callable

import jax.numpy as jnp

Wire = Callable[[Any], int]  # dtype -> bytes per element in a collective


def wire_for(platform: str) -> Wire:
  if platform == "cpu":
    return lambda dtype: 4 if dtype == jnp.bfloat16 else dtype.itemsize
  return lambda dtype: dtype.itemsize
