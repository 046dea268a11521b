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

from typing import Callable, Iterator, Mapping

from spmd.partition.ir import Op, Program, Value, cse_key
from spmd.partition.primitives import describe
from spmd.partition.sharding import TensorSharding


class Duplicates:
  """Finds the ops of ``program`` that repeat an earlier op, for each sharding of it.

  Which ops can ever repeat one another is settled once per program: those that are equal when
  every annotation is seen through (the most any sharding can merge). Each call then visits only
  those and the annotations, so the search's many plans pay little for it."""

  def __init__(self, program: Program):
    ops = list(_visit_order(program.ops))
    equal = _merge(ops, lambda source, result: True, lambda op: ())
    mergeable = set(equal) | set(equal.values())
    self.visits = [(scope, op) for scope, op in ops
                   if op in mergeable or _annotated_value(op) is not None]

  def __call__(self, shardings: Mapping[Value, TensorSharding]) -> dict[Op, Op]:
    """Each op that repeats an earlier op of its region -> that op: the same primitive and
    params, operands that are the same values (seeing through annotations whose result keeps
    their operand's sharding) and results given the same shardings. Control flow, effects and
    stateful primitives are never merged (cse_key)."""
    return _merge(self.visits, lambda source, result: shardings[result] == shardings[source],
                  lambda op: tuple(shardings[v] for v in op.outputs))


def _visit_order(ops: list[Op], scope: int = 0) -> Iterator[tuple[int, Op]]:
  """(region scope, op), each op after the ops of its regions; a scope per region."""
  for op in ops:
    for region in op.regions:
      yield from _visit_order(region.ops, id(region))
    yield scope, op


def _annotated_value(op: Op) -> Value | None:
  info = describe(op.eqn.primitive)
  if info is not None and info.annotation is not None and isinstance(op.inputs[0], Value):
    return op.inputs[0]
  return None


def _merge(visits: list[tuple[int, Op]], keeps: Callable[[Value, Value], bool],
           results: Callable[[Op], tuple]) -> dict[Op, Op]:
  """Ops repeating an earlier op of their scope; an annotation's result is its operand's other
  name where ``keeps(source, result)``, and ``results(op)`` is part of what must be equal."""
  names: dict[Value, Value] = {}
  found: dict[Op, Op] = {}
  seen: dict[tuple, Op] = {}
  for scope, op in visits:
    source = _annotated_value(op)
    if source is not None:
      if keeps(source, op.outputs[0]):
        names[op.outputs[0]] = names.get(source, source)
      continue
    key = cse_key(op, lambda v: names.get(v, v))
    if key is None or op.regions:  # ops with regions merge before propagation (ir.py)
      continue
    first = seen.setdefault((scope, key, results(op)), op)
    if first is not op:
      found[op] = first
      names.update(zip(op.outputs, first.outputs))
  return found
