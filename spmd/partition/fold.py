"""Constant folding: an op computing only from constants is taken out of the program's ops and its
results become constants of the program, as XLA's constant folding does when it compiles. A
constant is held whole by every device, so any block of it is a local slice: a value XLA folds
never costs a collective (XLA drops one on a folded value: an all-gather of a constant whose
elements are all equal becomes a broadcast). A folded value is computed whole on every device
where the program is lowered (``const_arrays``), which XLA folds; nothing runs when planning.

As in XLA, broadcasts stay ops (cheap to make, large to hold) yet count as constants for the ops
reading them, iotas are not constants, and nothing larger than XLA's bound is folded. An op whose
results hold no elements is an empty constant whatever it reads (XLA's simplifier replaces it), and
a program input holding no elements counts as a constant for the ops reading it: a sum of it is its
init value, which XLA folds and jax.jit returns replicated (read inside the shard_map, empty
operands were all dropped by XLA, which then refused the manual computation). An
identity (an annotation, which steers propagation, a reshard, a device_put) stays, and each of
its results whose operand is a constant counts as a constant too.
Only the top-level program is folded; in region bodies only the ops with empty results, or
reading nothing but empty values, are.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Iterable, Mapping

import jax
import jax.numpy as jnp
import numpy as np

from spmd.partition.atoms import Atom, Value
from spmd.partition.primitives import bind, describe, operands

if TYPE_CHECKING:
  from spmd.partition.ir import Op

# XLA's bound (hlo_constant_folding.cc): neither the result nor its operands together may hold
# more elements.
MAX_ELEMENTS = 45_000_000
_KEPT = ("broadcast_in_dim",)  # constant when its operand is, never folded itself


@dataclass(frozen=True, eq=False)
class Folded:
  """The ``const`` of a folded value: the op making each constant value of the program that an
  op makes (the folded ones, and the broadcasts and identities they read)."""

  makers: Mapping[Value, Op]


def fold_constants(ops: list[Op]) -> tuple[list[Op], list[Value]]:
  """The ops left once every foldable op is folded, and the values they made constants (each
  ``const`` a ``Folded``)."""
  makers: dict[Value, Op] = {}  # constant values that ops of the program make
  kept: list[Op] = []
  folded: list[Value] = []
  for op in ops:
    if _empty(op) and _foldable(op):
      makers.update((v, op) for v in op.outputs)
      for v in op.outputs:
        v.const = Folded(makers)
        folded.append(v)
      continue
    if _is_identity(op):  # result k is operand k: constant where its operand is
      makers.update((v, op) for v, x in zip(op.outputs, op.inputs) if _constant(x, makers))
      kept.append(op)
      continue
    if not all(_constant(x, makers) for x in op.inputs):
      kept.append(op)
      continue
    if op.primitive in _KEPT:
      makers.update((v, op) for v in op.outputs)
      kept.append(op)
      continue
    if not _foldable(op):
      kept.append(op)
      continue
    makers.update((v, op) for v in op.outputs)
    for v in op.outputs:
      v.const = Folded(makers)
      folded.append(v)
  return kept, folded


def fold_region_empties(ops: list[Op]) -> list[Value]:
  """Folds the ops with empty results, or reading only empty values, in the bodies of ``ops``'
  regions (at any depth), as ``fold_constants`` does at the top level, and returns their values:
  they read nothing."""
  folded: list[Value] = []
  for op in ops:
    for region in op.regions:
      kept = []
      for inner in region.ops:
        if (_empty(inner) or _reads_only_empties(inner)) and _foldable(inner):
          for v in inner.outputs:
            v.const = Folded({v: inner})
            folded.append(v)
        else:
          kept.append(inner)
      region.ops = kept
      folded += fold_region_empties(kept)
  return folded


def _constant(x: Atom, makers: Mapping[Value, Op]) -> bool:
  """Whether ``x`` is a literal, a program constant, an empty value or made from constants."""
  return not isinstance(x, Value) or x.const is not None or x.size == 0 or x in makers


def _empty(op: Op) -> bool:
  """Whether every result of ``op`` holds no elements."""
  return bool(op.outputs) and all(v.size == 0 for v in op.outputs)


def _reads_only_empties(op: Op) -> bool:
  """Whether every value ``op`` reads holds no elements (and it reads one)."""
  values = [x for x in op.inputs if isinstance(x, Value)]
  return bool(values) and all(x.size == 0 for x in values)


def _is_identity(op: Op) -> bool:
  """An annotation, or another op whose results are its operands (reshard, device_put)."""
  info = describe(op.eqn.primitive)
  return info is not None and (info.annotation is not None or info.local is operands)


def _foldable(op: Op) -> bool:
  """Pure, without regions, not an iota (XLA keeps iotas) or a user's shard_map (its body's
  collectives run), results of plain dtypes, and within XLA's bound."""
  info = describe(op.eqn.primitive)
  if (op.regions or op.eqn.effects or op.primitive == "iota"
      or (info is not None and (info.stateful or info.manual is not None))):
    return False
  avals = [x.aval for x in (*op.inputs, *op.outputs)]
  if any(jax.dtypes.issubdtype(a.dtype, jax.dtypes.extended) for a in avals):
    return False
  operands = sum(math.prod(x.aval.shape) for x in op.inputs)
  return max([operands, *(v.size for v in op.outputs)]) <= MAX_ELEMENTS


def const_arrays(consts: Iterable[Value]) -> dict[Value, Any]:
  """Every program constant's whole array: a closed-over constant's own, a folded value computed
  from its op (traced where the program is lowered; XLA folds it)."""
  env: dict[Value, Any] = {}

  def read(x: Any, makers: Mapping[Value, Op]) -> Any:
    if not isinstance(x, Value):
      return np.asarray(x.val, dtype=x.aval.dtype)
    if x not in env:
      if x not in makers and x.size:
        env[x] = x.const
      elif x not in makers or _empty(makers[x]):
        env[x] = jnp.zeros(x.aval.shape, x.aval.dtype)  # made in the program: no 0-size operand
      else:
        op = makers[x]
        if _is_identity(op):  # its other operands need not be constants
          env[x] = read(op.inputs[op.outputs.index(x)], makers)
        else:
          env.update(zip(op.outputs, bind(op, [read(a, makers) for a in op.inputs])))
    return env[x]

  return {c: read(c, c.const.makers if isinstance(c.const, Folded) else {}) for c in consts}
