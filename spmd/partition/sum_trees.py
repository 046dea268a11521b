"""Trees of adds over sum-reductions' results (dots, reduce_sums, masked gathers): left pending,
their partial sums flow through the adds and are reduced once, at the tree's root, so the
schedule prices each one's reduction at its share. An add takes pending sums only jointly: where
one of its terms is not a partial sum (never one, or made whole by its op's execution), each of
the others is reduced on its own before it."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping

from spmd.partition.ir import Op, Program, Value
from spmd.partition.propagate import Constraint
from spmd.partition.rules.factors import FactorKind


@dataclass(frozen=True)
class SumTrees:
  chains: Mapping[Value, tuple[Op, ...]]         # a result -> the adds it flows into, in order
  terms: Mapping[Op, Mapping[int, Value | Op]]   # an add -> its terms fed by results or adds
  linear: Mapping[Op, tuple[int, ...]]           # an add -> the terms it sums
  made_by: Mapping[Value, Op]                    # a result -> its sum-reduction

  def sharing(self, v: Value, partial: Callable[[Value, Op], bool]) -> int:
    """How many results, ``v`` among them, share ``v``'s reduction: those under the last add of
    ``v``'s chain up to which every term is a partial sum. ``partial(x, op)``: whether result
    ``x`` of ``op`` is, or, not made yet, may be made, one."""
    chain = self.chains.get(v)
    if not chain:
      return 1
    known: dict[Op, int | None] = {}

    def term(x: Value | Op | None) -> int | None:
      """The partial sums a term holds, or None if it is not one."""
      if isinstance(x, Op):
        return leaves(x)
      if x is not None and (x is v or partial(x, self.made_by[x])):
        return 1
      return None

    def leaves(add: Op) -> int | None:
      """The partial sums under ``add``, or None if one of its terms is not one."""
      if add not in known:
        counts = [term(self.terms[add].get(k)) for k in self.linear[add]]
        known[add] = None if None in counts else sum(counts)
      return known[add]

    shared = 1
    for add in chain:
      n = leaves(add)
      if n is None:
        break
      shared = n
    return shared


def sum_trees(program: Program, by_op: Mapping[int, list[Constraint]],
              partial_ok: Mapping[Value, bool]) -> SumTrees:
  """The adds that sum each sum-reduction's result (maybe transposed or reshaped on the way)
  and that nothing else reads, up to the root of their tree."""
  def rule(op: Op):
    return None if op.regions else by_op[op.index][0].rule

  def sum_reduction(op: Op) -> bool:
    r = rule(op)
    return (r is not None and r.combiner == "sum"
            and any(k is FactorKind.REDUCTION for k in r.kinds))

  def summed_into(v: Value) -> tuple[Op, int] | None:
    """The add that sums ``v``, read by nothing else, and which of its terms ``v`` is."""
    while True:
      readers = program.reads.get(v, ())
      if not partial_ok.get(v, False) or len(readers) != 1:
        return None
      (reader, k), r = readers[0], rule(readers[0][0])
      if r is None or k not in r.linear_in:
        return None
      if r.additive:
        return reader, k
      if len(reader.inputs) != 1 or len(reader.outputs) != 1:
        return None
      v = reader.outputs[0]

  chains: dict[Value, tuple[Op, ...]] = {}
  terms: dict[Op, dict[int, Value | Op]] = {}
  made_by: dict[Value, Op] = {}
  for op, _ in program.nested_ops:
    if not (sum_reduction(op) and len(op.outputs) == 1):
      continue
    chain: list[Op] = []
    source: Value | Op = op.outputs[0]
    step = summed_into(op.outputs[0])
    while step is not None:
      add, k = step
      terms.setdefault(add, {})[k] = source
      chain.append(add)
      source, step = add, summed_into(add.outputs[0])
    if chain:
      chains[op.outputs[0]] = tuple(chain)
      made_by[op.outputs[0]] = op
  return SumTrees(chains, terms, {add: rule(add).linear_in for add in terms}, made_by)
