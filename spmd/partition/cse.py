"""Equal computations on equal values, found once shardings are known, run (and communicate) once.

The program's own merge (ir.py) joins ops that read the same values. It cannot see through an
annotation, which is a new value until propagation says whether it moved anything:
``reduce_sum(x)`` and ``reduce_sum(annotate(x, P(P.UNCONSTRAINED, None)))`` are one computation
when the annotation leaves ``x`` as it is, and XLA's CSE after partitioning merges the two (their
collectives included). So does spmd: the later op repeats the earlier one, its results are other
names for the earlier op's (as an annotation's result is for its operand, schedule.py), and it
runs, communicates and costs nothing.
"""
from __future__ import annotations

from typing import Mapping

from spmd.partition.ir import Op, Program, Value, cse_key
from spmd.partition.primitives import describe
from spmd.partition.sharding import TensorSharding


def duplicates(program: Program, shardings: Mapping[Value, TensorSharding]) -> dict[Op, Op]:
  """Each op that repeats an earlier op of its region -> that op: the same primitive and params,
  operands that are the same values (seeing through annotations whose result keeps their
  operand's sharding) and results given the same shardings. Control flow, effects and stateful
  primitives are never merged (cse_key)."""
  names: dict[Value, Value] = {}
  found: dict[Op, Op] = {}

  def name(v: Value) -> Value:
    return names.get(v, v)

  def visit(ops: list[Op]) -> None:
    seen: dict[tuple, Op] = {}
    for op in ops:
      for region in op.regions:
        visit(region.ops)
      info = describe(op.eqn.primitive)
      if info is not None and info.annotation is not None and isinstance(op.inputs[0], Value):
        source, result = op.inputs[0], op.outputs[0]
        if shardings[result] == shardings[source]:
          names[result] = name(source)
        continue
      key = cse_key(op, name)
      if key is None:
        continue
      first = seen.setdefault((key, tuple(shardings[v] for v in op.outputs)), op)
      if first is not op:
        found[op] = first
        names.update(zip(op.outputs, first.outputs))

  visit(program.ops)
  return found
