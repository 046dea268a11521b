"""The work of every device in order: which reshards run before each op, which form (sharding)
of each value an op reads, and which forms it writes.

A value can exist in several forms at once (produced partial, then reduced, then sliced): a
consumer reuses an existing form or reshards from the cheapest one, so a value is gathered or
reduced once however many ops read it; choosing how an op runs, a reshard of an operand that
later ops of the same kind also read (the q, k and v projections of one stream) is priced at its
share, since the form it makes serves them all. A pending partial sum flows through ops that are
linear in it (add, dot, reduce_sum, ...) and is reduced where a consumer needs it whole: a dot
followed by an add of another partial sum needs one psum, not two (the add runs in their
layout, whatever its result's, and choosing how each dot runs, the reduction of a result that
adds sum with others is priced at its share); a psum whose consumer shards the summed axis
becomes a reduce-scatter. Partial sums never cross a control-flow boundary or the
output. A loop body reads its invariants from outside (ir.py): a reshard of a value defined
outside the region being scheduled runs where the value is, before the loop (as XLA's
loop-invariant code motion moves it), so it runs once, and two loops reading one weight in one
form share it.
"""
from __future__ import annotations

import math
from collections import ChainMap, Counter
from dataclasses import dataclass, replace
from typing import Hashable, Mapping

from spmd.partition.execution import Execution, ExecutionPlanner, Price
from spmd.partition.halo_geometry import Exchange, Hop, halo_piece, joint
from spmd.partition.ir import Op, Program, Region, Value, depth_first
from spmd.partition.manual import BodyCollective
from spmd.partition.primitives import PrimitiveInfo, describe
from spmd.partition.propagate import Constraint
from spmd.partition.reshard import ReshardStep
from spmd.partition.sharding import Axes, MeshShape, TensorSharding
from spmd.partition.sum_trees import SumTrees, sum_trees
from spmd.partition.trips import Trips, region_trips


@dataclass(frozen=True)
class Slot:
  """Which tensor a transfer makes available: an op's operand, a region's output, or a program
  input (at entry) or output (at exit)."""

  kind: str                 # "operand", "region output", "input" or "output"
  index: int
  region: int | None = None

  def __str__(self) -> str:
    if self.kind == "region output":
      return f"region {self.region} output {self.index}"
    return f"{self.kind} {self.index}"


@dataclass(frozen=True)
class Transfer:
  """Makes ``value`` available as ``dst`` from its existing form ``src``."""

  value: Value
  src: TensorSharding
  dst: TensorSharding
  steps: tuple[ReshardStep, ...]
  slot: Slot
  reader: Op | None = None  # hoisted out of a loop: the body op whose slot it fills (else None)
  repeats: tuple[int, ...] = ()  # per step: its collectives that repeat earlier ones (repeats.py)

  def repeated(self, k: int) -> int:
    """Step ``k``'s collectives that repeat earlier ones, which XLA merges."""
    return self.repeats[k] if self.repeats else 0

  def runs(self, k: int) -> int:
    """The collectives step ``k`` runs in the compiled program."""
    return self.steps[k].collectives - self.repeated(k)

  @property
  def moved(self) -> int:
    """Bytes per device of the collectives it runs."""
    return sum(step.bytes - step.bytes // step.collectives * self.repeated(k)
               for k, step in enumerate(self.steps) if step.collectives)


@dataclass(eq=False)
class RegionSchedule:
  inputs: tuple[TensorSharding, ...]             # forms the region's inputs arrive in
  ops: list[ScheduledOp]
  exit: list[Transfer]                           # run at the end of the region
  outputs: tuple[TensorSharding, ...]            # forms of the outputs handed back


@dataclass(eq=False)
class ScheduledOp:
  op: Op
  transfers: list[Transfer]                      # run before the op
  reads: tuple[TensorSharding | None, ...]       # per input (None: a literal)
  writes: tuple[TensorSharding, ...]             # per output
  execution: Execution | None = None             # None for control flow and annotations
  regions: tuple[RegionSchedule, ...] = ()
  halo_hops: tuple[tuple[Exchange, Hop, int], ...] = ()  # ppermutes of pieces not received before
  body_collectives: tuple[BodyCollective, ...] = ()  # a user's shard_map: its body's (manual.py)
  gathered: int = 0  # bytes of its own all-gather of per-shard partial results (rule.gathers)


@dataclass(eq=False)
class Schedule:
  inputs: tuple[TensorSharding, ...]             # forms the program's inputs arrive in
  entry: list[Transfer]                          # run first: inputs resharded as in_specs ask
  ops: list[ScheduledOp]
  exit: list[Transfer]
  outputs: tuple[TensorSharding, ...]
  aliases: dict[Value, Value]                    # an annotation's result -> the value it names
  duplicates: dict[Op, Op]                       # an op repeating an earlier one (cse.py) -> it

  def walk(self) -> list[ScheduledOp]:
    """Every scheduled op, region ops right after their owner."""
    return [s for s, _ in depth_first(self.ops)]

  def step_bytes(self, trips: Trips) -> int:
    """Per-device bytes of every collective per call, each counted as often as it runs (one
    iteration inside a while loop): the plan's ``step_bytes``, without rendering the plan."""
    total = sum(t.moved for t in self.entry + self.exit)
    for s in self.walk():
      if not (s.transfers or s.halo_hops or s.regions or s.body_collectives or s.gathered):
        continue  # most ops move nothing
      runs = trips[s.op.index]
      inner = region_trips(s.op, runs) or 1
      total += (runs or 1) * (sum(t.moved for t in s.transfers) + s.gathered
                              + sum(nbytes for _, _, nbytes in s.halo_hops))
      total += inner * sum(t.moved for r in s.regions for t in r.exit)
      total += sum(b.bytes * ((None if runs is None or b.trips is None else runs * b.trips) or 1)
                   for b in s.body_collectives)
    return total


@dataclass(frozen=True)
class ProgramFacts:
  """What scheduling reads of a program besides its shardings, the same for every plan of it
  that repeats the same ops (the search schedules dozens): each op's constraints, which values
  may carry a pending partial sum to their reader, and every name of each value."""

  by_op: Mapping[int, list[Constraint]]
  partial_ok: Mapping[Value, bool]
  sums: SumTrees
  names: Mapping[Value, tuple[Value, ...]]
  duplicates: Mapping[Op, Op]


def program_facts(program: Program, constraints: list[Constraint],
                  duplicates: Mapping[Op, Op]) -> ProgramFacts:
  """``duplicates``: ops repeating an earlier op (cse.py), which run nothing."""
  by_op: dict[int, list[Constraint]] = {}
  for c in constraints:
    by_op.setdefault(c.op.index, []).append(c)
  partial_ok = _partial_ok(program, by_op, duplicates, program.value_depths)
  return ProgramFacts(by_op, partial_ok, sum_trees(program, by_op, partial_ok),
                      _names(program, duplicates), duplicates)


class _Scheduler:
  def __init__(self, program: Program, facts: ProgramFacts,
               shardings: Mapping[Value, TensorSharding], executions: ExecutionPlanner):
    self.shardings, self.mesh, self.wire = shardings, executions.mesh, executions.wire
    self.duplicates, self.by_op = facts.duplicates, facts.by_op
    self.partial_ok, self.names = facts.partial_ok, facts.names
    self.summed_with = lambda v: facts.sums.sharing(v, self._may_be_partial)
    self._partial_executions: dict[Value, bool] = {}
    self.scopes = program.value_depths
    self.forms: dict[Value, list[TensorSharding]] = {}
    self.aliases: dict[Value, Value] = {}
    self.halo_pieces: set[tuple] = set()
    self.enclosing: list[list[Transfer]] = []  # per depth: transfers before the op scheduled
    self.reads = program.reads
    self.annotations = program.annotations
    self.kinds: dict[Op, Hashable | None] = {}
    self.executions = executions
    self.returned = Counter(x for x in program.outputs if isinstance(x, Value))
    self.returned.update(x for op, _ in program.nested_ops for r in op.regions
                         for x in r.outputs if isinstance(x, Value))

  # --- forms ------------------------------------------------------------------------------------

  def _may_be_partial(self, v: Value, op: Op) -> bool:
    """Whether ``v``, the result of ``op``, was made a pending partial sum, or, not made yet,
    some execution of ``op`` leaves it one."""
    forms = self.forms.get(v)
    if forms is not None:
      return bool(forms[0].partial)
    if v not in self._partial_executions:
      (c,) = self.by_op[op.index]
      self._partial_executions[v] = self.executions.may_leave_partial(
          c, self.shardings, op.outputs.index(v))
    return self._partial_executions[v]

  def _best(self, v: Value, dst: TensorSharding, sole_reader: bool = False,
            forms: list[TensorSharding] | None = None
            ) -> tuple[TensorSharding, tuple[ReshardStep, ...]]:
    """The form of ``v`` (of ``forms``; default: those made so far) cheapest to reshard to
    ``dst`` from, and the steps; for ``v``'s sole reader, the reshards of
    ``reshard.sub_blocks`` from each form too (``_sub_blocks``)."""
    forms = self.forms[v] if forms is None else forms
    options = [(s, self.executions.reshard(v, s, dst)) for s in forms]
    if sole_reader:
      options += self._sub_blocks(v, dst, forms)
    return min(options, key=lambda o: (sum(s.bytes for s in o[1]), len(o[1])))

  def price(self, v: Value, dst: TensorSharding) -> int:
    if dst in self.forms.get(v, ()):
      return 0
    return sum(s.bytes for s in self._best(v, dst)[1])

  def link_price(self, v: Value, dst: TensorSharding) -> int:
    """``price`` for a control-flow op's links, which read its regions' values before they are
    scheduled: such a value is priced from the sharding propagation gave it, as its region will
    make it."""
    if v in self.forms:
      return self.price(v, dst)
    return sum(s.bytes for s in self.executions.reshard(v, self.shardings[v], dst))

  def shared_price(self, op: Op) -> Price:
    """``price`` for choosing how ``op`` runs: a reshard of an operand is split evenly between
    ``op`` and the later ops of its kind that read the value at the same position (they face the
    same choice, so they read the form it makes, and a form is made once)."""
    def price(v: Value, dst: TensorSharding) -> int:
      moved = self.price(v, dst)
      return moved and moved // self._sharers(op, v)
    return price

  def _sharers(self, op: Op, v: Value) -> int:
    """How many ops of ``op``'s kind read ``v`` (by any of its names) where ``op`` does, ``op``
    and later ones."""
    kind, most = self._kind(op), 1
    for k, x in enumerate(op.inputs):
      if x is v and kind is not None:
        most = max(most, sum(1 for name in self.names.get(v, (v,))
                             for reader, j in self.reads.get(name, ())
                             if j == k and reader.index >= op.index
                             and self._kind(reader) == kind))
    return most

  def _kind(self, op: Op) -> Hashable | None:
    """``_kind`` of an op that reads (None for annotations and repeated ops: they read nothing
    themselves, their results are other names)."""
    if op not in self.kinds:
      self.kinds[op] = None if op in self.duplicates or op in self.annotations else _kind(
          op, self.shardings)
    return self.kinds[op]

  def acquire(self, v: Value, dst: TensorSharding, out: list[Transfer], slot: Slot,
              reader: Op | None = None) -> None:
    """Makes ``v`` available as ``dst`` (``slot`` of ``reader``); a value read from outside the
    regions being scheduled (a loop invariant, ir.py) is resharded where it is defined, before
    the op holding those regions."""
    if dst in self.forms[v]:
      return
    depth = self.scopes.get(self.aliases.get(v, v), 0)
    hoisted = depth < len(self.enclosing)
    src, steps = self._best(v, dst, not hoisted and self._sole_reader(v, reader))
    (self.enclosing[depth] if hoisted else out).append(
        Transfer(v, src, dst, steps, slot, reader if hoisted else None))
    for form in [s.after for s in steps] + [dst]:  # forms passed through on the way count too
      if form not in self.forms[v]:
        self.forms[v].append(form)

  def _sub_blocks(self, v: Value, dst: TensorSharding, forms: list[TensorSharding]
                  ) -> list[tuple[TensorSharding, tuple[ReshardStep, ...]]]:
    """Each of ``forms`` of ``v`` with the ``reshard.sub_blocks`` reshard from it to ``dst``,
    where one applies."""
    options = [(s, self.executions.sub_blocks(v, s, dst)) for s in forms]
    return [(s, steps) for s, steps in options if steps is not None]

  def _read(self, v: Value) -> bool:
    """Whether anything reads ``v`` by any of its names, or returns it."""
    names = self.names.get(v, (v,))
    return any(self.reads.get(n) or self.returned[n] for n in names)

  def _sole_reader(self, v: Value, reader: Op | None) -> bool:
    """Whether ``reader`` (None: an output) reading ``v`` once is all that reads it by any of its
    names: annotations and repeated ops, which name it, aside. A reshard passing through no
    other form (``reshard.sub_blocks``) then leaves no other read the worse for it."""
    return self._readers(v) == (([reader], 0) if reader is not None else ([], 1))

  def _readers(self, v: Value) -> tuple[list[Op], int]:
    """The ops reading ``v`` by any of its names, once per read (annotations and repeated ops,
    which name it, aside), and how many times it is returned."""
    names = self.names.get(v, (v,))
    readers = [op for n in names for op, _ in self.reads.get(n, ())
               if op not in self.annotations and op not in self.duplicates]
    return readers, sum(self.returned[n] for n in names)

  # --- ops --------------------------------------------------------------------------------------

  def region(self, region: Region, inputs: tuple[TensorSharding, ...]) -> list[ScheduledOp]:
    for v, s in zip(region.inputs, inputs):
      self.forms[v] = [s]
    return [self.op(op) for op in region.ops]

  def op(self, op: Op) -> ScheduledOp:
    constraints = self.by_op[op.index]
    if op in self.duplicates:
      return self.repeat(op, self.duplicates[op])
    if op.regions:
      return self.control(op, constraints)
    if op in self.annotations:
      return self.annotation(op)
    (c,) = constraints
    info = describe(op.eqn.primitive)
    if info is not None and info.manual is not None:
      return self.manual(op, c, info)
    ex = self.executions.plan(c, self.shardings, self.shared_price(op), self.summed_with,
                              self._read)
    if op.primitive == "broadcast_in_dim":
      ex = self._broadcast_as_read(op, c, ex)
    ex = self._in_pending_layout(op, ex)
    reads, writes = list(ex.needs), list(ex.produces)
    deferred = self._deferrable(op, ex)
    if deferred:
      positions, axes = deferred
      for k in positions:
        reads[k] = replace(reads[k], partial=axes, partial_op="sum")
      writes = [replace(w, partial=tuple(sorted(set(w.partial) | set(axes), key=self._order)),
                        partial_op="sum") for w in writes]
    transfers: list[Transfer] = []
    for k, (x, need) in enumerate(zip(op.inputs, reads)):
      if isinstance(x, Value) and need is not None and need not in self.forms[x]:
        self.acquire(x, need, transfers, Slot("operand", k), op)
    for v, w in zip(op.outputs, writes):
      self.forms[v] = [w]
    new_hops = []
    for halo, chain, hop, nbytes in ex.halo_exchanges(self.mesh, self.wire) if ex.halos else ():
      # pieces are of the buffer, whichever name reads it (of all operands' blocks, joined)
      read = range(len(op.inputs)) if joint(halo) else (halo.operand,)
      key = halo_piece(tuple(self.aliases.get(op.inputs[k], op.inputs[k]) for k in read),
                       tuple(reads[k] for k in read), chain, hop)
      if key not in self.halo_pieces:
        self.halo_pieces.add(key)
        new_hops.append((halo, hop, nbytes))
    return ScheduledOp(op, transfers, tuple(reads), tuple(writes), ex, (), tuple(new_hops),
                       gathered=ex.gather_bytes(self.mesh, self.wire))

  def annotation(self, op: Op) -> ScheduledOp:
    """An annotation moves nothing itself: its result is another name for its operand, sharing
    its forms, and its readers reshard (so a value is resharded once however many annotations
    and readers it has, as XLA does)."""
    source, result = op.inputs[0], op.outputs[0]
    self.forms[result] = self.forms[source]  # the same list: a form made for one serves both
    self.aliases[result] = self.aliases.get(source, source)
    return ScheduledOp(op, [], (None,), (self.shardings[result],))

  def manual(self, op: Op, c: Constraint, info: PrimitiveInfo) -> ScheduledOp:
    """A user's shard_map (manual.py) reads its operands as its in_specs name and writes its
    results as its out_specs name; its body runs its own collectives."""
    reads, writes = info.manual.shardings(op, self.mesh)
    transfers: list[Transfer] = []
    for k, (x, need) in enumerate(zip(op.inputs, reads)):
      if need is not None:
        self.acquire(x, need, transfers, Slot("operand", k), op)
    for v, w in zip(op.outputs, writes):
      self.forms[v] = [w]
    ex = Execution(c, ((),) * c.rule.num_factors, reads, writes)
    return ScheduledOp(op, transfers, reads, writes, ex,
                       body_collectives=info.manual.collectives(op, self.wire))

  def repeat(self, op: Op, first: Op) -> ScheduledOp:
    """An op repeating ``first`` (cse.py) runs nothing: its results are other names for first's,
    sharing their forms, as an annotation's result does its operand's."""
    for result, earlier in zip(op.outputs, first.outputs):
      self.forms[result] = self.forms[earlier]
      self.aliases[result] = earlier
    writes = tuple(self.shardings[v] for v in op.outputs)
    return ScheduledOp(op, [], (None,) * len(op.inputs), writes)

  def _broadcast_as_read(self, op: Op, c: Constraint, ex: Execution) -> Execution:
    """A broadcast whose one reader would reshard its result reads its operand resharded
    instead, where that moves less, and writes the form its reader reads: the smaller tensor
    moves (XLA carries the reader's sharding back through the broadcast). GQA's
    ``jnp.repeat`` of kv heads split unevenly gathers the cache, not the repeated heads."""
    (v,), written = op.outputs, ex.produces[0]
    readers, returned = self._readers(v)
    if len(readers) != 1 or returned or written is None or written.partial:
      return ex
    (reader,), names = readers, self.names.get(v, (v,))
    info = describe(reader.eqn.primitive)
    if (reader.regions or info is None or info.manual is not None or not reader.outputs
        or self.scopes.get(reader.outputs[0], 0) != self.scopes.get(v, 0)
        or sum(x in names for x in reader.inputs) != 1):
      return ex
    (rc,) = self.by_op[reader.index]

    def read_from(form: TensorSharding | None) -> tuple[Execution, int]:
      """The reader's execution and bytes with ``v`` in ``form`` (None: any form, free)."""
      def price(x: Value, need: TensorSharding) -> int:
        if x not in names:
          return self.link_price(x, need)
        if form is None:
          return 0
        return sum(s.bytes for s in self._best(v, need, sole_reader=True, forms=[form])[1])
      return self.executions.priced(rc, self.shardings, price, self.summed_with, self._read)

    ideal, ideal_bytes = read_from(None)
    need = next(n for x, n in zip(reader.inputs, ideal.needs) if x in names)
    if need is None or need == written or need.partial:
      return ex
    alt, alt_bytes = self.executions.priced(c, ChainMap({v: need}, self.shardings),
                                            self.shared_price(op), self.summed_with, self._read)
    if alt.produces[0] != need:
      return ex
    _, own_bytes = self.executions.priced(c, self.shardings, self.shared_price(op),
                                          self.summed_with, self._read)
    return alt if alt_bytes + ideal_bytes < own_bytes + read_from(written)[1] else ex

  def _order(self, axis: str) -> int:
    return list(self.mesh).index(axis)

  def _in_pending_layout(self, op: Op, ex: Execution) -> Execution:
    """An add of pending partial sums that share one layout runs in it, whatever the layout its
    result was propagated: its sum stays pending, reduced once by its reader, rather than each
    operand reduced into the propagated layout."""
    rule = ex.constraint.rule
    if not rule.additive:
      return ex
    pending = set()
    for k in rule.linear_in:
      x = op.inputs[k]
      if not isinstance(x, Value) or not self.partial_ok.get(x, False) or ex.needs[k] is None:
        return ex
      pending.add(next((f for f in self.forms[x] if f.partial and f.partial_op == "sum"), None))
    if len(pending) != 1 or None in pending:
      return ex
    (form,) = pending
    if form.dims == ex.needs[rule.linear_in[0]].dims:
      return ex
    return self.executions.in_layout(ex.constraint, form) or ex

  def _deferrable(self, op: Op, ex: Execution) -> tuple[tuple[int, ...], Axes] | None:
    """Operands whose pending partial sum can flow through ``op``, and the summed axes."""
    rule = ex.constraint.rule
    if not rule.linear_in or (rule.combiner != "sum" and ex.partial_axes):
      return None
    found: dict[int, Axes] = {}
    for k in rule.linear_in:
      x, need = op.inputs[k], ex.needs[k]
      if not isinstance(x, Value) or need is None or not self.partial_ok.get(x, False):
        continue
      for form in self.forms[x]:
        if form.partial and form.partial_op == "sum" and form.dims == need.dims:
          found[k] = form.partial
          break
    if rule.additive:
      if len(found) != len(rule.linear_in) or len(set(found.values())) != 1:
        return None
      positions = tuple(found)
    else:
      if not found:
        return None
      positions = (next(iter(found)),)
    axes = found[positions[0]]
    used = {a for f in ex.factor_axes for a in f}
    if used & set(axes):
      return None
    result_bytes = sum(_local_bytes(v, w, self.mesh) for v, w in zip(op.outputs, ex.produces))
    operand_bytes = sum(_local_bytes(op.inputs[k], ex.needs[k], self.mesh) for k in positions)
    return (positions, axes) if result_bytes <= operand_bytes else None

  def control(self, op: Op, constraints: list[Constraint]) -> ScheduledOp:
    """Outer operands enter in the form their link needs; region outputs leave in the form their
    link needs (resharded inside the region); region inputs and results take the link's form."""
    execs = [self.executions.plan(c, self.shardings, self.link_price) for c in constraints]
    reads: list[TensorSharding | None] = [None] * len(op.inputs)
    writes: list[TensorSharding | None] = [None] * len(op.outputs)
    exits: list[list[TensorSharding | None]] = [[None] * len(r.outputs) for r in op.regions]
    inputs: list[list[TensorSharding | None]] = [[None] * len(r.inputs) for r in op.regions]
    for ex in execs:
      for v, need in zip(ex.constraint.operands, ex.needs):
        _place(v, need, op.inputs, reads, [r.outputs for r in op.regions], exits)
      for v, made in zip(ex.constraint.results, ex.produces):
        _place(v, made, op.outputs, writes, [r.inputs for r in op.regions], inputs)
    transfers: list[Transfer] = []
    for k, (x, need) in enumerate(zip(op.inputs, reads)):
      if isinstance(x, Value):
        reads[k] = need or self.shardings[x]
        self.acquire(x, reads[k], transfers, Slot("operand", k), op)
    self.enclosing.append(transfers)
    regions = []
    for r, region in enumerate(op.regions):
      arrive = tuple(s or self.shardings[v] for s, v in zip(inputs[r], region.inputs))
      ops = self.region(region, arrive)
      exit_transfers: list[Transfer] = []
      leave = []
      for j, (x, need) in enumerate(zip(region.outputs, exits[r])):
        need = need or TensorSharding.replicated(len(x.aval.shape))
        if isinstance(x, Value):
          self.acquire(x, need, exit_transfers, Slot("region output", j, r))
        leave.append(need)
      regions.append(RegionSchedule(arrive, ops, exit_transfers, tuple(leave)))
    self.enclosing.pop()
    final = tuple(w or self.shardings[v] for w, v in zip(writes, op.outputs))
    for v, w in zip(op.outputs, final):
      self.forms[v] = [w]
    return ScheduledOp(op, transfers, tuple(reads), final, None, tuple(regions))


def _partial_ok(program: Program, by_op: dict[int, list[Constraint]],
                duplicates: Mapping[Op, Op], scopes: Mapping[Value, int]) -> dict[Value, bool]:
  """Values read once, by an op that can take a pending partial sum: only there does letting the
  sum flow save a reduction (a second reader would reduce it again, or anyway). A repeated op
  (cse.py) reads nothing, and its readers read the earlier op's results. A value read inside a
  loop from outside (a loop invariant) is reduced before the loop, not in every trip."""
  names = {v: earlier for dup, first in duplicates.items()
           for v, earlier in zip(dup.outputs, first.outputs)}
  ok: dict[Value, bool] = {}
  for op, depth in program.nested_ops:
    if op in duplicates:
      continue
    linear = by_op[op.index][0].rule.linear_in if not op.regions else ()
    for k, x in enumerate(op.inputs):
      if isinstance(x, Value):
        x = names.get(x, x)
        ok[x] = x not in ok and k in linear and scopes.get(x, 0) == depth
    for region in op.regions:
      for x in region.outputs:
        if isinstance(x, Value):
          ok[names.get(x, x)] = False
  for x in program.outputs:
    if isinstance(x, Value):
      ok[names.get(x, x)] = False
  return ok


def _kind(op: Op, shardings: Mapping[Value, TensorSharding]) -> Hashable | None:
  """Primitive, params and the shardings of every operand and result: ops of one kind reading a
  value at one position face the same choice, so they want one form of it (None: params that do
  not compare)."""
  if op.params_key is None:
    return None
  return (op.params_key, tuple(shardings.get(x) if isinstance(x, Value) else None
                               for x in op.inputs),
          tuple(shardings.get(v) for v in op.outputs))


def _names(program: Program, duplicates: Mapping[Op, Op]) -> dict[Value, tuple[Value, ...]]:
  """Every name of each value that has several: an annotation's result and a repeated op's
  (cse.py) are other names for the value they name."""
  parent: dict[Value, Value] = {}
  for op in program.annotations:
    parent[op.outputs[0]] = op.inputs[0]
  for op, first in duplicates.items():
    parent.update(zip(op.outputs, first.outputs))
  groups: dict[Value, list[Value]] = {}
  for v in parent:
    root = v
    while root in parent:
      root = parent[root]
    groups.setdefault(root, [root]).append(v)
  return {v: tuple(group) for group in groups.values() for v in group}


def _place(v: Value | None, sharding: TensorSharding, outer, outer_slots: list, regions: list,
           region_slots: list) -> None:
  """Puts a link's sharding in the slot of the outer atom ``v`` is, else of the region atom."""
  if v is None or _assign(outer, outer_slots, v, sharding):
    return
  for atoms, slots in zip(regions, region_slots):
    if _assign(atoms, slots, v, sharding):
      return


def _assign(atoms, slots: list, v: Value, sharding: TensorSharding) -> bool:
  """Puts ``sharding`` in the first empty slot whose atom is ``v``."""
  for k, atom in enumerate(atoms):
    if atom is v and slots[k] is None:
      slots[k] = sharding
      return True
  return any(atom is v for atom in atoms)


def _local_bytes(x: Value, s: TensorSharding, mesh: MeshShape) -> int:
  return math.prod(s.local_shape(x.shape, mesh)) * x.dtype.itemsize


def schedule(program: Program, facts: ProgramFacts, shardings: Mapping[Value, TensorSharding],
             inputs: tuple[TensorSharding, ...], entries: tuple[TensorSharding | None, ...],
             outputs: tuple[TensorSharding, ...], executions: ExecutionPlanner) -> Schedule:
  """``inputs``: the form each input arrives in; ``entries``: the form it is resharded to first
  (None: kept as it arrives); ``outputs``: the forms handed back; ``executions``: plans the ops'
  executions and the reshards, priced for the backend compiled for."""
  s = _Scheduler(program, facts, shardings, executions)
  for v in program.consts:
    s.forms[v] = [TensorSharding.replicated(len(v.shape))]
  for v, arrives in zip(program.inputs, inputs):
    s.forms[v] = [arrives]
  entry: list[Transfer] = []
  for k, (v, want) in enumerate(zip(program.inputs, entries)):
    if want is not None:
      s.acquire(v, want, entry, Slot("input", k))
      if entry and entry[-1].value is v and entry[-1].moved:
        s.forms[v] = [want]  # read as the entry made it, never as it arrived: that would leave
        # the entry's collectives unread, and the compiled program without them
  ops = [s.op(op) for op in program.ops]
  exit_transfers: list[Transfer] = []
  for k, (x, want) in enumerate(zip(program.outputs, outputs)):
    if isinstance(x, Value):
      s.acquire(x, want, exit_transfers, Slot("output", k))
  return Schedule(inputs, entry, ops, exit_transfers, outputs, s.aliases,
                  dict(facts.duplicates))

