"""How often each op runs per call of the program: the product of the lengths of the scans
around it; None inside a while loop, whose trip count is a runtime value. A scan unrolled by JAX
holds several copies of its body in the lowered program, each run its own number of times."""
from __future__ import annotations

from spmd.partition.ir import Op, Program
from spmd.partition.primitives import describe

Trips = dict[int, "int | None"]  # per op index
Copies = tuple["int | None", ...]  # the runs per call of each copy of an op in the lowered program


def copy_counts(program: Program) -> dict[int, Copies]:
  """Per op index: the runs per call of each of its copies in the lowered program."""
  out: dict[int, Copies] = {}

  def visit(ops: list[Op], copies: Copies) -> None:
    for op in ops:
      out[op.index] = copies
      for region in op.regions:
        visit(region.ops, region_copies(op, copies))

  visit(program.ops, (1,))
  return out


def trip_counts(program: Program) -> Trips:
  return {index: total(copies) for index, copies in copy_counts(program).items()}


def total(copies: Copies) -> int | None:
  """The runs per call of all copies together (None: unknown)."""
  return None if None in copies else sum(copies)


def region_copies(op: Op, copies: Copies) -> Copies:
  """The runs per call of each copy of the regions of ``op`` in the lowered program, ``op``'s
  copies running ``copies`` times (its record says how often per op, per copy)."""
  if not op.regions:
    return copies
  per_op = describe(op.eqn.primitive).control.trips(op.params)
  return tuple(None if n is None or k is None else n * k for n in copies for k in per_op)


def region_trips(op: Op, count: int | None) -> int | None:
  """How often the regions of ``op`` run per call, ``op`` running ``count`` times."""
  return total(region_copies(op, (count,)))
