"""The propagation engine: a fixed point over factor rules. It knows no primitive by name.

Each constraint (an op's rule, or a control-flow link) projects the shardings of its tensors onto
factors, merges them per factor, and writes the merged factors back to every open tensor.

Policy (deterministic), per factor:
  1. Candidates that are prefixes of one another merge into the longest.
  2. Otherwise a closed sharding (in_specs, annotations, out_specs) beats an open one, a larger
     tensor beats a smaller one (moving the smaller one is cheaper), then the earlier tensor
     (operands before results). Two closed shardings that disagree are reported as a conflict.
  3. A mesh axis wanted by two factors of one op goes to the factor of the larger tensor (the op
     then moves the smaller one), closed before open among tensors of one size.
Shardings only grow (an open dim gets more axes appended), so the fixed point is reached.
Pass-through ops (elementwise-like) run to a fixed point first, then every op (Shardy's op
priority); only then does a broadcast's smaller operand donate its sharding to the larger result
(XLA's propagation also defers forward propagation through broadcasts), so a small param's
sharding does not claim a large activation's mesh axes before the activation's own sharding
arrives.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Iterable, Mapping

from spmd.partition.ir import Op, Program, Value
from spmd.partition.primitives import describe, rule_for
from spmd.partition.rules.factors import FactorKind, OpShardingRule
from spmd.partition.sharding import Axes, MeshShape, TensorSharding


@dataclass(frozen=True)
class Origin:
  """Why a value has its sharding: ``kind`` is input, annotation, output, propagated or default."""

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
  sharding: TensorSharding
  closed_dims: frozenset[int]
  origin: Origin


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


def constraints_for(program: Program) -> tuple[list[Constraint], list[Op]]:
  """One constraint per op (several links per control-flow op), and the ops without a rule."""
  out: list[Constraint] = []
  unsupported: list[Op] = []
  for op in program.all_ops():
    info = describe(op.eqn.primitive)
    if info is not None and info.control is not None:
      for link in info.control.links(op):
        out.append(Constraint(op, link.rule, _values(link.operands), _values(link.results)))
      continue
    rule, info = rule_for(op)
    if info is None or info.rule is None:
      unsupported.append(op)
    out.append(Constraint(op, rule, _values(op.inputs), _values(op.outputs)))
  return out, unsupported


def _values(atoms: Iterable[object]) -> tuple[Value | None, ...]:
  return tuple(a if isinstance(a, Value) else None for a in atoms)


@dataclass(frozen=True)
class _Candidate:
  axes: Axes
  closed: bool
  size: int
  pos: int
  value: Value

  def priority(self) -> tuple:
    return (not self.closed, -self.size, self.pos)


class _Engine:
  def __init__(self, mesh_shape: MeshShape, seeds: Mapping[Value, Seed],
               constraints: list[Constraint]):
    self.mesh = mesh_shape
    self.dims: dict[Value, list[Axes]] = {}
    self.closed: dict[Value, frozenset[int]] = {}
    self.origins: dict[Value, Origin] = {}
    self.conflicts: dict[tuple, Conflict] = {}
    for value, seed in seeds.items():
      self.dims[value] = list(seed.sharding.dims)
      self.closed[value] = seed.closed_dims
      self.origins[value] = seed.origin
    self.constraints = constraints
    # Per constraint: (position, value, factors, size) of each tensor taking part, and the size
    # of its largest tensor.
    self.parts = [tuple((pos, v, tf, v.size) for pos, (v, tf) in
                        enumerate(zip(c.tensors(), c.rule.tensors()))
                        if v is not None and tf is not None) for c in constraints]
    self.largest = [max((v.size for v in c.tensors() if v is not None), default=0)
                    for c in constraints]
    # A constraint reads only its tensors' dims: one none of whose tensors changed since its last
    # application would write nothing new, so it is skipped (the same fixed point, sooner).
    self.dirty = [True] * len(constraints)
    self.readers: dict[Value, list[int]] = {}
    for i, c in enumerate(constraints):
      for v in c.tensors():
        if v is not None:
          self.readers.setdefault(v, []).append(i)
    self.broadcasting = False
    self.deferred: set[int] = set()  # constraints that left a broadcast's operand out

  def dims_of(self, v: Value) -> list[Axes]:
    if v not in self.dims:
      self.dims[v] = [()] * len(v.shape)
    return self.dims[v]

  def run(self) -> None:
    for level in (0, 1, 2):
      active = [i for i, c in enumerate(self.constraints) if level or c.rule.pass_through]
      self.broadcasting = level == 2
      for i in self.deferred if self.broadcasting else ():
        self.dirty[i] = True  # now they may write what they could not before
      changed = True
      while changed:
        changed = False
        for i in active + active[::-1]:
          if self.dirty[i]:
            changed |= self.apply(i)

  def apply(self, i: int) -> bool:
    self.dirty[i] = False
    c, parts = self.constraints[i], self.parts[i]
    rule = c.rule
    candidates: dict[int, list[_Candidate]] = {}
    defer = rule.pass_through and not self.broadcasting
    for pos, v, tf, size in parts:
      if defer and size < self.largest[i]:
        self.deferred.add(i)
        continue  # a broadcast's small operand donates last (as XLA's propagation does)
      dims, closed = self.dims_of(v), self.closed.get(v, frozenset())
      for d, factors in enumerate(tf):
        if not dims[d]:
          continue  # no axes: no candidate for any of its factors
        for f, axes in project(factors, dims[d], rule.sizes, self.mesh):
          candidates.setdefault(f, []).append(_Candidate(axes, d in closed, size, pos, v))
    merged = self._merge(c, rule, candidates)
    if not any(axes for axes, _ in merged.values()):
      return False
    changed = False
    for _, v, tf, _ in parts:
      changed |= self._write(c, v, tf, rule, merged)
    return changed

  def _merge(self, c: Constraint, rule: OpShardingRule,
             candidates: dict[int, list[_Candidate]]) -> dict[int, tuple[Axes, _Candidate]]:
    chosen: list[tuple[tuple, int, Axes, _Candidate]] = []
    for f, cands in candidates.items():
      if rule.kinds[f] in (FactorKind.NEED_REPLICATION, FactorKind.PERMUTATION):
        continue
      ranked = sorted((x for x in cands if x.axes), key=_Candidate.priority)
      if not ranked:
        continue
      longest = max(ranked, key=lambda x: len(x.axes))
      if all(longest.axes[:len(x.axes)] == x.axes for x in ranked):
        best = next(x for x in ranked if x.axes == longest.axes)
      else:
        best = ranked[0]
        for other in ranked[1:]:
          if other.closed and best.closed and best.axes[:len(other.axes)] != other.axes:
            key = (c.op.index, f, best.axes, other.axes)
            self.conflicts.setdefault(key, Conflict(
                c.op, best.axes, self.origins.get(best.value, DEFAULT), other.axes,
                self.origins.get(other.value, DEFAULT)))
      chosen.append((best.priority(), f, best.axes, best))
    used: set[str] = set()
    merged: dict[int, tuple[Axes, _Candidate]] = {}
    # Between factors, the larger tensor's factor takes a contested mesh axis first: the op then
    # moves the smaller tensor (closedness only breaks ties; a closed tensor that loses an axis
    # here is resharded for this op, never changed).
    for _, f, axes, best in sorted(chosen, key=lambda t: (-t[3].size, not t[3].closed,
                                                          t[3].pos, t[1])):
      keep = prefix_without(axes, used)
      used.update(keep)
      merged[f] = (keep, best)
    return merged

  def _write(self, c: Constraint, v: Value, tf: tuple, rule: OpShardingRule,
             merged: dict[int, tuple[Axes, _Candidate]]) -> bool:
    dims = self.dims_of(v)
    closed = self.closed.get(v, frozenset())
    changed = False
    for d, factors in enumerate(tf):
      if d in closed or not factors:
        continue
      new: list[str] = []
      source = None
      for f in factors:
        axes, cand = merged.get(f, ((), None))
        new.extend(axes)
        source = source or (cand if axes else None)
        if len(factors) > 1 and math.prod(self.mesh[a] for a in axes) != rule.sizes[f]:
          break
      old = dims[d]
      if len(new) <= len(old) or tuple(new[:len(old)]) != old:
        continue
      used = {a for i, dim in enumerate(dims) if i != d for a in dim} | set(old)
      added = prefix_without(tuple(new[len(old):]), used)
      if not added:
        continue
      dims[d] = old + added
      for i in self.readers[v]:
        self.dirty[i] = True
      if source is not None and source.value is not v:
        self.origins[v] = Origin("propagated", via=c.op, source=source.value)
      changed = True
    return changed


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


def prefix_without(axes: Axes, used: set[str]) -> Axes:
  out: list[str] = []
  for a in axes:
    if a in used or a in out:
      break
    out.append(a)
  return tuple(out)


def propagate(program: Program, seeds: Mapping[Value, Seed], mesh_shape: MeshShape) -> Propagation:
  constraints, unsupported = constraints_for(program)
  engine = _Engine(mesh_shape, seeds, constraints)
  engine.run()
  values = _all_values(program)
  shardings = {v: TensorSharding(tuple(engine.dims_of(v))) for v in values}
  origins = {v: engine.origins.get(v, DEFAULT) for v in values}
  return Propagation(shardings, origins, list(engine.conflicts.values()), constraints, unsupported)


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
