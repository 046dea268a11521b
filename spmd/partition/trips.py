"""How often each op runs per call of the program: the product of the lengths of the scans
around it; None inside a while loop, whose trip count is a runtime value."""
from __future__ import annotations

from spmd.partition.ir import Op, Program
from spmd.partition.primitives import describe

Trips = dict[int, "int | None"]  # per op index


def trip_counts(program: Program) -> Trips:
  out: Trips = {}

  def visit(ops: list[Op], count: int | None) -> None:
    for op in ops:
      out[op.index] = count
      for region in op.regions:
        visit(region.ops, region_trips(op, count))

  visit(program.ops, 1)
  return out


def region_trips(op: Op, count: int | None) -> int | None:
  """How often the regions of ``op`` run per call, ``op`` running ``count`` times (its record
  says how often per op)."""
  if not op.regions or count is None:
    return count
  per_op = describe(op.eqn.primitive).control.trips(op.params)
  return None if per_op is None else count * per_op
