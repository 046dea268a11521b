"""The propagation engine: a fixed point over factor rules. It knows no primitive by name.

Each constraint (an op's rule, or a control-flow link) projects the shardings of its tensors onto
factors, merges them per factor, and writes the merged factors back to every open tensor.

Policy (deterministic), per factor:
  1. Candidates that are prefixes of one another merge into the longest.
  2. Otherwise a closed sharding (in_specs, annotations, out_specs) beats an open one, a larger
     tensor beats a smaller one (moving the smaller one is cheaper), then the earlier tensor
     (operands before results); shardings of the first's size on its side of the op that
     disagree with it, closed or open, keep only their common prefix (as Shardy's, and so
     jax.jit's, propagation). Two closed shardings that disagree are reported as a conflict.
  3. A mesh axis wanted by two factors of one op goes to the factor of the larger tensor (the op
     then moves the smaller one; a result holding the factor counts); among tensors of one size,
     to a factor whose tensors agree before one whose tensors disagree, a pass factor before a
     reduction, then the earlier tensor, closed or open (as Shardy's, so `sin(x) @ c` with x
     P('a') and c P(None, 'a') keeps the rows' 'a', as jax.jit does); between an elementwise
     op's factors, first the factor split more ways, then the one the earliest tensor holds.
     An axis a reduction factor takes stays free on the op's results, which the op sums over
     it: a factor that lost it to the reduction still writes it to open results (the partial
     results are reduce-scattered).
Shardings only grow (an open dim gets more axes appended), so the fixed point is reached.
Pass-through ops (elementwise-like) run to a fixed point first, then every op (Shardy's op
priority); only then does a broadcast's smaller operand donate its sharding to the larger result
(XLA's propagation also defers forward propagation through broadcasts), so a small param's
sharding does not claim a large activation's mesh axes before the activation's own sharding
arrives. On a loop carry's link the init and the loop's result rank after the body's input and
output (OpShardingRule.outside): what the body asks of its carry wins over the init, which is
resharded once before the loop.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Iterable, Mapping

from spmd.partition.ir import Op, Program, Value, literal_identity
from spmd.partition.primitives import describe, rule_for
from spmd.partition.rules.factors import FactorKind, OpShardingRule
from spmd.partition.sharding import Axes, MeshShape, TensorSharding

# Factors that yield a contested axis to a pass factor: along a halo factor every operand's
# window exchanges halos, along a factor needing replication the op gathers the dim.
_YIELDING = (FactorKind.HALO, FactorKind.NEED_REPLICATION)


@dataclass(frozen=True)
class Origin:
  """Why a value has its sharding: ``kind`` is input, annotation, type (its type on a mesh with
  Explicit axes), output, propagated or default."""

  kind: str
  text: str = ""
  via: Op | None = None          # the op whose rule carried the sharding (propagated)
  source: Value | None = None    # the value it came from (propagated)


DEFAULT = Origin("default", "replicated: nothing constrains it")


@dataclass(frozen=True)
class Constraint:
  op: Op
  rule: OpShardingRule
  operands: tuple[Value | None, ...]
  results: tuple[Value | None, ...]

  def tensors(self) -> tuple[Value | None, ...]:
    return self.operands + self.results


@dataclass(frozen=True)
class Seed:
  """A value's sharding before propagation. Propagation appends axes only to its dims outside
  ``closed_dims``, and to closed ones only axes of ``open_axes`` (a type on a mesh mixing
  Explicit and Auto axes names only the Explicit ones; jax.jit shards it over the Auto ones
  after them as it propagates: Shardy's ``{"x", ?}``)."""

  sharding: TensorSharding
  closed_dims: frozenset[int]
  origin: Origin
  open_axes: frozenset[str] = frozenset()


@dataclass(frozen=True)
class Conflict:
  """Two closed shardings want different axes for one factor of ``op``."""

  op: Op
  kept: Axes
  kept_from: Origin
  dropped: Axes
  dropped_from: Origin


@dataclass
class Propagation:
  shardings: dict[Value, TensorSharding]
  origins: dict[Value, Origin]
  conflicts: list[Conflict]
  constraints: list[Constraint]
  unsupported: list[Op] = field(default_factory=list)
  layout: tuple = ()  # every value's dims, in one order: equal layouts, equal shardings


def constraints_for(program: Program) -> tuple[list[Constraint], list[Op]]:
  """One constraint per op (several links per control-flow op), and the ops without a rule."""
  out: list[Constraint] = []
  unsupported: list[Op] = []
  rules: dict[tuple, OpShardingRule] = {}  # repeated layers repeat their ops' rules
  for op in _regions_first(program.ops):
    info = describe(op.eqn.primitive)
    if info is not None and info.control is not None:
      for link in info.control.links(op):
        out.append(Constraint(op, link.rule, _values(link.operands), _values(link.results)))
      continue
    if info is None or info.rule is None:
      unsupported.append(op)
    key = _rule_key(op)
    rule = rules.get(key) if key is not None else None
    if rule is None:
      rule = rule_for(op)[0]
      if key is not None:
        rules[key] = rule
    out.append(Constraint(op, rule, _values(op.inputs), _values(op.outputs)))
  return out, unsupported


def _regions_first(ops: Iterable[Op]) -> Iterable[Op]:
  """Every op, a control-flow op after the ops of its regions: a sweep then carries what a loop
  body asks of its carry to the loop's links before the links carry the init's sharding in
  (XLA keeps a carry as its body shards it, and reshards the init once before the loop)."""
  for op in ops:
    for region in op.regions:
      yield from _regions_first(region.ops)
    yield op


def _rule_key(op: Op) -> tuple | None:
  """What an op's rule depends on: its primitive, params, operands' avals (literals' values too)
  and results' avals; None if a param cannot be hashed."""
  if op.params_key is None:
    return None
  return (op.params_key,
          tuple(x.aval if isinstance(x, Value) else literal_identity(x.val, x.aval)
                for x in op.inputs),
          tuple(v.aval for v in op.outputs))


def _values(atoms: Iterable[object]) -> tuple[Value | None, ...]:
  return tuple(a if isinstance(a, Value) else None for a in atoms)


@dataclass(frozen=True)
class _Candidate:
  axes: Axes
  closed: bool
  size: int
  pos: int
  part: int  # which of the constraint's tensors (its index in _Engine.parts)
  outside: bool = False  # a loop carry's init or result (OpShardingRule.outside)

  def priority(self) -> tuple:
    return (not self.closed, self.outside, -self.size, self.pos)


@dataclass(frozen=True)
class _Dropped:
  """A conflict on ``factor``: ``kept`` axes (from part ``kept_part``) won over ``dropped``."""

  factor: int
  kept: Axes
  kept_part: int
  dropped: Axes
  dropped_part: int


@dataclass(frozen=True)
class _Chosen:
  """A factor's axes merged from its candidates, before factors contest mesh axes: whether its
  candidates ``disagreed``, the ``best`` one, and the position of the tensor that breaks ties
  (``first``: the best's, or for an elementwise op the earliest tensor agreeing with ``axes``)."""

  factor: int
  axes: Axes
  disagreed: bool
  best: _Candidate
  first: int


@dataclass(frozen=True)
class _Merged:
  """A factor's axes on the op (``axes``) and on its results (``on_results``: also the axes a
  reduction factor of the op took from it, which the op sums over, so its results are free to
  hold them: the partial results are reduce-scattered), and the candidate they came from."""

  axes: Axes
  on_results: Axes
  best: _Candidate


@dataclass(frozen=True)
class _Write:
  """Dim ``dim`` of part ``part`` takes ``axes`` (propagated from part ``source``, if any)."""

  part: int
  dim: int
  axes: Axes
  source: int | None


@dataclass(frozen=True)
class _Outcome:
  """What applying a constraint does, by the positions of its tensors: it depends only on the
  rule, the tensors' sizes, closed dims, which of them are one value, and their dims now. A
  model's layers repeat those, so each outcome is computed once and replayed."""

  deferred: bool  # a broadcast's smaller operand was left out (it donates at level 2)
  conflicts: tuple[_Dropped, ...]
  writes: tuple[_Write, ...]


class Propagator:
  """Propagation through one program from any seeds. The constraints, the tensors taking part in
  each, and the outcome of applying a constraint to given dims do not depend on the seeds: they
  are computed once and shared by every propagation (the search runs dozens)."""

  def __init__(self, program: Program, mesh_shape: MeshShape):
    self.mesh = mesh_shape
    self.constraints, self.unsupported = constraints_for(program)
    # Per constraint: (position, value, factors, size) of each tensor taking part, and the size
    # of its largest tensor.
    self.parts = [tuple((pos, v, tf, v.size) for pos, (v, tf) in
                        enumerate(zip(c.tensors(), c.rule.tensors()))
                        if v is not None and tf is not None) for c in self.constraints]
    self.largest = [max((v.size for v in c.tensors() if v is not None), default=0)
                    for c in self.constraints]
    # Per constraint: what its outcome depends on besides its tensors' dims and closed dims.
    # (constraints_for shares one rule among equal ops, so the rule's identity is its key)
    self.signatures = [(id(c.rule), self.largest[i],
                        tuple((pos, tf, size, next(k for k, p in enumerate(parts) if p[1] is v))
                              for pos, v, tf, size in parts))
                       for i, (c, parts) in enumerate(zip(self.constraints, self.parts))]
    self.readers: dict[Value, list[int]] = {}
    for i, c in enumerate(self.constraints):
      for v in c.tensors():
        if v is not None:
          self.readers.setdefault(v, []).append(i)
    self.values = _all_values(program)
    self.kinds: dict[tuple, int] = {}
    self.outcomes: dict[tuple, _Outcome] = {}
    self.open_kinds = [self.kind(i, {}, {}) for i in range(len(self.constraints))]
    # The constraints each level applies, forward then backward: pass-through rules first, then
    # every rule, then every rule again with broadcasts' operands open to them (_Engine.run)
    passing = [i for i, c in enumerate(self.constraints) if c.rule.pass_through]
    every = list(range(len(self.constraints)))
    self.sweeps = [passing + passing[::-1], every + every[::-1], every + every[::-1]]
    self._shardings: dict[tuple[Axes, ...], TensorSharding] = {}

  def __call__(self, seeds: Mapping[Value, Seed]) -> Propagation:
    engine = _Engine(self, seeds)
    engine.run()
    layout = tuple(tuple(engine.dims[v]) for v in self.values)
    shardings = {v: self._sharding(dims) for v, dims in zip(self.values, layout)}
    origins = {v: engine.origins.get(v, DEFAULT) for v in self.values}
    return Propagation(shardings, origins, list(engine.conflicts.values()), self.constraints,
                       self.unsupported, layout)

  def _sharding(self, dims: tuple[Axes, ...]) -> TensorSharding:
    """One TensorSharding per distinct ``dims`` (a program has few)."""
    sharding = self._shardings.get(dims)
    if sharding is None:
      sharding = self._shardings[dims] = TensorSharding(dims)
    return sharding

  def kind(self, i: int, closed: Mapping[Value, frozenset[int]],
           open_axes: Mapping[Value, frozenset[str]]) -> int:
    """The id of what constraint ``i``'s outcome depends on besides its tensors' dims."""
    key = (self.signatures[i], tuple((closed.get(v, _OPEN), open_axes.get(v, _NONE))
                                     for _, v, _, _ in self.parts[i]))
    return self.kinds.setdefault(key, len(self.kinds))


_OPEN: frozenset[int] = frozenset()
_NONE: frozenset[str] = frozenset()


class _Engine:
  def __init__(self, propagator: Propagator, seeds: Mapping[Value, Seed]):
    self.mesh = propagator.mesh
    self.dims: dict[Value, list[Axes]] = {v: [()] * len(v.shape) for v in propagator.values}
    self.closed: dict[Value, frozenset[int]] = {}
    self.open_axes: dict[Value, frozenset[str]] = {}  # axes its closed dims may still take
    self.origins: dict[Value, Origin] = {}
    self.conflicts: dict[tuple, Conflict] = {}
    for value, seed in seeds.items():
      self.dims[value] = list(seed.sharding.dims)
      self.closed[value] = seed.closed_dims
      if seed.open_axes:
        self.open_axes[value] = seed.open_axes
      self.origins[value] = seed.origin
    self.constraints, self.parts = propagator.constraints, propagator.parts
    self.largest, self.readers = propagator.largest, propagator.readers
    self.outcomes, self.sweeps = propagator.outcomes, propagator.sweeps
    self.kind = list(propagator.open_kinds)
    for v in self.closed:
      for i in self.readers.get(v, ()):
        self.kind[i] = propagator.kind(i, self.closed, self.open_axes)
    # A constraint reads only its tensors' dims: one none of whose tensors changed since its last
    # application would write nothing new, so it is skipped (the same fixed point, sooner).
    self.dirty = [True] * len(self.constraints)
    self.broadcasting = False
    self.deferred: set[int] = set()  # constraints that left a broadcast's operand out

  def run(self) -> None:
    for level, sweep in enumerate(self.sweeps):
      self.broadcasting = level == 2
      for i in self.deferred if self.broadcasting else ():
        self.dirty[i] = True  # now they may write what they could not before
      changed = True
      while changed:
        changed = False
        for i in sweep:
          if self.dirty[i]:
            changed |= self.apply(i)

  def apply(self, i: int) -> bool:
    self.dirty[i] = False
    c, parts = self.constraints[i], self.parts[i]
    every = self.dims
    dims = [every[v] for _, v, _, _ in parts]
    key = (self.kind[i], self.broadcasting, tuple(map(tuple, dims)))
    outcome = self.outcomes.get(key)
    if outcome is None:
      outcome = self.outcomes[key] = self._outcome(c.rule, parts, self.largest[i],
                                                   [list(d) for d in dims])
    if outcome.deferred:
      self.deferred.add(i)
    for x in outcome.conflicts:
      self.conflicts.setdefault((c.op.index, x.factor, x.kept, x.dropped), Conflict(
          c.op, x.kept, self.origins.get(parts[x.kept_part][1], DEFAULT), x.dropped,
          self.origins.get(parts[x.dropped_part][1], DEFAULT)))
    for w in outcome.writes:
      v = parts[w.part][1]
      self.dims[v][w.dim] = w.axes
      for j in self.readers[v]:
        self.dirty[j] = True
      if w.source is not None and parts[w.source][1] is not v:
        self.origins[v] = Origin("propagated", via=c.op, source=parts[w.source][1])
    return bool(outcome.writes)

  def _outcome(self, rule: OpShardingRule, parts: tuple, largest: int,
               dims: list[list[Axes]]) -> _Outcome:
    """Applies ``rule`` to ``dims`` (each part's, changed in place; a value taking part twice
    shares one list)."""
    for k, (_, v, _, _) in enumerate(parts):
      first = next(j for j, p in enumerate(parts) if p[1] is v)
      dims[k] = dims[first]
    candidates: dict[int, list[_Candidate]] = {}
    defer = (rule.pass_through or rule.broadcast) and not self.broadcasting
    deferred = False
    for part, (pos, v, tf, size) in enumerate(parts):
      if defer and size < largest:
        deferred = True
        continue  # a broadcast's small operand donates last (as XLA's propagation does)
      closed = self.closed.get(v, frozenset())
      for d, factors in enumerate(tf):
        if not dims[part][d]:
          continue  # no axes: no candidate for any of its factors
        for f, axes in project(factors, dims[part][d], rule.sizes, self.mesh):
          candidates.setdefault(f, []).append(
              _Candidate(axes, d in closed and pos not in rule.outside, size, pos, part,
                         pos in rule.outside))
    conflicts: list[_Dropped] = []
    merged = self._merge(rule, candidates, conflicts, _result_sizes(rule, parts))
    writes: list[_Write] = []
    if any(m.axes or m.on_results for m in merged.values()):
      for part, (_, v, tf, _) in enumerate(parts):
        self._write(part, dims[part], self.closed.get(v, _OPEN), self.open_axes.get(v, _NONE),
                    tf, rule, merged, writes, result=parts[part][0] >= len(rule.operands))
    return _Outcome(deferred, tuple(conflicts), tuple(writes))

  def _merge(self, rule: OpShardingRule, candidates: dict[int, list[_Candidate]],
             conflicts: list[_Dropped], result_sizes: Mapping[int, int]) -> dict[int, _Merged]:
    chosen: list[_Chosen] = []
    for f, cands in candidates.items():
      if rule.kinds[f] is FactorKind.PERMUTATION or (
          rule.kinds[f] is FactorKind.NEED_REPLICATION and not _kept(rule, f)):
        continue
      ranked = sorted((x for x in cands if x.axes), key=_Candidate.priority)
      if not ranked:
        continue
      longest = max(ranked, key=lambda x: len(x.axes))
      agreed = all(longest.axes[:len(x.axes)] == x.axes for x in ranked)
      if agreed:
        best = next(x for x in ranked if x.axes == longest.axes)
        axes = best.axes
      else:
        best = ranked[0]
        axes = _tied_axes(ranked, rule)
        for other in ranked[1:]:
          if other.closed and best.closed and best.axes[:len(other.axes)] != other.axes:
            conflicts.append(_Dropped(f, axes, best.part, other.axes, other.part))
            if axes != best.axes:  # tied: the first loses its axes too
              conflicts.append(_Dropped(f, axes, other.part, best.axes, best.part))
      first = (min(x.pos for x in ranked if _compatible(x.axes, axes)) if rule.pass_through
               else best.pos)
      chosen.append(_Chosen(f, axes, not agreed, best, first))
    used: set[str] = set()
    used_on_results: set[str] = set()  # the axes of the factors the results hold
    merged: dict[int, _Merged] = {}
    # Between factors, the larger tensor's factor takes a contested mesh axis first: the op then
    # moves the smaller tensor. A factor's tensor is its candidate's, or a larger result holding
    # it (which loses the axis with it); a reduction factor reaches no result. Among tensors of
    # one size, a factor whose tensors agree goes before one whose tensors disagree (the op moves
    # a tensor along that one whichever wins, so it yields the axis rather than make the op move
    # a second tensor; as Shardy's propagation, which gives such a factor only its tensors'
    # common axes), a pass factor before a reduction (whose partial result is summed later)
    # and before a halo factor or a kept factor the op needs whole (along which every operand
    # exchanges halos or is gathered: a concatenate's or sort's operands split one axis on a
    # kept dim and on the joined or sorted dim keep the kept dim's),
    # then the larger candidate, then the earlier tensor, closed or open (a closed tensor that
    # loses an axis here is resharded for this op, never changed). Between an elementwise op's
    # factors, which every tensor holds, first the factor split more ways (the tensor resharded
    # to it keeps a smaller block), then the one the earliest tensor holds. As Shardy's: `x + y`
    # of x P(None, 'a') and y P(('a', 'b')) is P(('a', 'b')); `jnp.where(x > y, x, y)` of x
    # P('a') and y P(None, 'a') is the predicate's P('a'); `jnp.einsum('ij,kj->ikj', x, y)` of x
    # P(('a', 'b')) and y P(None, 'a') keeps y's 'a' (y is the dot_general's first operand).
    def order(c: _Chosen) -> tuple:
      ways = math.prod(self.mesh[a] for a in c.axes) if rule.pass_through else 1
      kind = rule.kinds[c.factor]
      return (-max(c.best.size, result_sizes.get(c.factor, 0)), c.disagreed,
              kind is FactorKind.REDUCTION, kind in _YIELDING, -c.best.size, -ways, c.first,
              c.factor)
    # A result's factor that lost an axis to a reduction factor the results lack (summed away)
    # still holds it on the results (as jax.jit's `x.at[i].get()` of x P('a', 'b') by i P('a')
    # returns P('a', 'b')).
    held_by_results = rule.result_factors()
    for c in sorted(chosen, key=order):
      keep = prefix_without(c.axes, used)
      used.update(keep)
      summed_away = (rule.kinds[c.factor] is FactorKind.REDUCTION
                     and c.factor not in held_by_results)
      on_results = () if summed_away else prefix_without(c.axes, used_on_results)
      used_on_results.update(on_results)
      merged[c.factor] = _Merged(keep, on_results, c.best)
    return merged

  def _write(self, part: int, dims: list[Axes], closed: frozenset[int],
             open_axes: frozenset[str], tf: tuple, rule: OpShardingRule,
             merged: dict[int, _Merged], writes: list[_Write], result: bool) -> None:
    """Writes the merged factors into the open dims of part ``part`` (into a closed one, only
    axes of ``open_axes``, ahead of any other). A result's dim merged from
    factors takes, of a factor split unevenly, the major axes that split it evenly: the op
    reshards its operand to those (realigning uneven blocks) rather than gathering it whole. An
    operand's such dim takes none: it would be made in a form the op reshards anyway."""
    for d, factors in enumerate(tf):
      if not factors or (d in closed and not open_axes):
        continue
      new: list[str] = []
      source = None
      for f in factors:
        m = merged.get(f)
        axes = () if m is None else m.on_results if result else m.axes
        cand = None if m is None else m.best
        if len(factors) > 1 and rule.sizes[f] % math.prod(self.mesh[a] for a in axes):
          if not result:  # split unevenly in a merged dim: its padding would land inside it
            break
          axes = _even_prefix(axes, rule.sizes[f], self.mesh)
        new.extend(axes)
        source = source or (cand if axes else None)
        if len(factors) > 1 and math.prod(self.mesh[a] for a in axes) != rule.sizes[f]:
          break
      old = dims[d]
      if len(new) <= len(old) or tuple(new[:len(old)]) != old:
        continue
      used = {a for i, dim in enumerate(dims) if i != d for a in dim} | set(old)
      added = prefix_without(tuple(new[len(old):]), used)
      if d in closed:
        added = added[:next((k for k, a in enumerate(added) if a not in open_axes), len(added))]
      if not added:
        continue
      dims[d] = old + added
      writes.append(_Write(part, d, dims[d], None if source is None else source.part))


def _kept(rule: OpShardingRule, f: int) -> bool:
  """A factor the op needs whole keeps its axes through propagation where the op returns it and
  has another factor (a sort's sorted dim, as Shardy's rule for sort: the op gathers it and its
  result is sliced back)."""
  return (rule.relocatable and f in rule.result_factors()
          and any(k is FactorKind.PASS for k in rule.kinds))


def _compatible(a: Axes, b: Axes) -> bool:
  """Whether one of ``a`` and ``b`` is a prefix of the other."""
  n = min(len(a), len(b))
  return a[:n] == b[:n]


def _tied_axes(ranked: list[_Candidate], rule: OpShardingRule) -> Axes:
  """The axes a factor takes from disagreeing candidates (best first): the first's, or where
  candidates of its tensor size on its side of the op (operands, or results), closed or open,
  disagree with it, their common prefix (as Shardy's propagation, and so jax.jit, resolves
  ``x * y`` with x P('a', 'b') and y P('b'): P(None, 'b'), and ``x * sin(y)`` with x P('a') and
  y P('b'): P()). An operand and a result do not tie: an op between an in_spec and another
  out_spec runs in its operand's axes (its result is resharded once) rather than replicated. A
  loop carry's init does not tie with the body's output, which it ranks after
  (OpShardingRule.outside)."""
  best = ranked[0]
  side = best.pos < len(rule.operands)
  tied = [x.axes for x in ranked if x.size == best.size and x.pos not in rule.outside
          and (x.pos < len(rule.operands)) == side]
  if len(tied) < 2:
    return best.axes
  n = 0
  while all(len(axes) > n and axes[n] == best.axes[n] for axes in tied):
    n += 1
  return best.axes[:n]


def _result_sizes(rule: OpShardingRule, parts: tuple) -> dict[int, int]:
  """Factor -> the size of the largest result of the op holding it."""
  out: dict[int, int] = {}
  for pos, _, tf, size in parts:
    if pos >= len(rule.operands):
      for f in (f for factors in tf for f in factors):
        out[f] = max(out.get(f, 0), size)
  return out


def project(factors: tuple[int, ...], axes: Axes, sizes: tuple[int, ...],
            mesh: MeshShape) -> list[tuple[int, Axes]]:
  """Splits a dim's axes among its factors, major to minor (a dim of one factor takes them all)."""
  if len(factors) == 1:
    return [(factors[0], tuple(axes))]
  out: list[tuple[int, Axes]] = []
  rest = list(axes)
  for f in factors:
    taken: list[str] = []
    prod = 1
    while rest and sizes[f] % (prod * mesh[rest[0]]) == 0:
      prod *= mesh[rest[0]]
      taken.append(rest.pop(0))
    out.append((f, tuple(taken)))
    if prod != sizes[f]:
      break
  return out


def _even_prefix(axes: Axes, size: int, mesh: MeshShape) -> Axes:
  """The longest prefix of ``axes`` that splits ``size`` evenly."""
  n = len(axes)
  while size % math.prod(mesh[a] for a in axes[:n]):
    n -= 1
  return axes[:n]


def prefix_without(axes: Axes, used: set[str]) -> Axes:
  out: list[str] = []
  for a in axes:
    if a in used or a in out:
      break
    out.append(a)
  return tuple(out)


def _all_values(program: Program) -> list[Value]:
  seen: dict[int, Value] = {}

  def add(atoms: Iterable[object]) -> None:
    for a in atoms:
      if isinstance(a, Value):
        seen.setdefault(a.id, a)

  add(program.inputs)
  add(program.consts)
  for op in program.all_ops():
    add(op.inputs)
    add(op.outputs)
    for region in op.regions:
      add(region.inputs)
      add(region.outputs)
  add(program.outputs)
  return list(seen.values())
