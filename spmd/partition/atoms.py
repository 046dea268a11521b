"""The atoms of a program (ir.py): its arrays (``Value``) and the scalars written into its
equations (``Literal``). Apart from ir.py so that the modules it builds on can tell them apart."""
from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from typing import Any, Union

import numpy as np

_ids = itertools.count()


@dataclass(eq=False)
class Value:
  """One array of the program (its aval is global: no sharding is baked in)."""

  aval: Any
  const: Any = None  # a closed-over constant's array, or a folded value's fold.Folded
  id: int = field(default_factory=lambda: next(_ids))
  shape: tuple[int, ...] = field(init=False)
  size: int = field(init=False)  # the number of elements

  def __post_init__(self) -> None:
    self.shape = tuple(self.aval.shape)
    self.size = math.prod(self.shape)

  @property
  def dtype(self) -> np.dtype:
    return self.aval.dtype

  def __repr__(self) -> str:
    return f"v{self.id}:{self.aval.str_short()}"


@dataclass(frozen=True)
class Literal:
  """A scalar constant written into an equation."""

  val: Any
  aval: Any


Atom = Union[Value, Literal]
