"""How each op runs on local shards: the axes of every factor, the sharding each operand must
have, and the (possibly partial-sum) sharding of each result.

Factors that reach a result take the result's propagated axes; reduction factors keep the
operands' axes (their results become partial sums); need-replication and permutation factors
are whole on every device. When a mesh axis is wanted by a reduction factor and a result factor,
both choices are priced (gather the operands vs reduce-scatter the partial result) and the
cheaper one is taken. So is running in the operands' layout, the result resharded afterwards
(GShard's dispatch einsum: computed on each device's groups, its result all-to-all'd to the
expert layout, instead of an all-to-all of the mask and an all-gather of the tokens).
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass
from typing import Callable, Mapping

import jax.numpy as jnp

from spmd.partition.halo_geometry import (Exchange, Halo, Hop, geometry, hops, joint_mirrors,
                                          plan_concatenation, plan_reversal, plan_rotation,
                                          plan_scatter_halos, plan_window)
from spmd.partition.ir import Value
from spmd.partition.propagate import Constraint, prefix_without, project
from spmd.partition.reshard import ReshardStep, Splat, ordered_extrema, plan_reshard, sub_blocks
from spmd.partition.rules.factors import FactorKind, OpShardingRule, TensorFactors, WindowedDim
from spmd.partition.sharding import Axes, MeshShape, TensorSharding, axes_size
from spmd.partition.wire import Wire

Price = Callable[[Value, TensorSharding], int]  # bytes to make a value available as a sharding
_Projected = dict[int, list[tuple[int, Axes]]]  # per factor: (tensor size, axes) of each tensor


@dataclass(frozen=True)
class Execution:
  constraint: Constraint
  factor_axes: tuple[Axes, ...]
  needs: tuple[TensorSharding | None, ...]      # per operand: the sharding the op runs on
  produces: tuple[TensorSharding | None, ...]   # per result: local results (maybe partial)
  halos: tuple[Exchange, ...] = ()                # neighbour exchanges of sharded windowed dims

  @functools.cached_property
  def partial_axes(self) -> Axes:
    """Axes of the sharded reduction factors: results are partial over these."""
    rule = self.constraint.rule
    return tuple(a for f, k in enumerate(rule.kinds) if k is FactorKind.REDUCTION
                 for a in self.factor_axes[f])

  def gather_bytes(self, mesh: MeshShape, wire: Wire) -> int:
    """Per-device bytes of the all-gather of an op's per-shard partial results, which it
    combines itself (``rule.gathers``: a variadic reduce, argmax, prod; a cumulative op's
    totals); 0 for other ops."""
    rule = self.constraint.rule
    if not rule.gathers or not self.partial_axes:
      return 0
    result, factors = self.constraint.results[0], rule.results[0]
    elements = math.prod(n for n, dim in zip(self.produces[0].local_shape(result.shape, mesh),
                                             factors)  # a cumulative op gathers its totals
                         if not any(rule.kinds[f] is FactorKind.REDUCTION for f in dim))
    return elements * axes_size(self.partial_axes, mesh) * sum(wire(d) for d in rule.gathers)

  def halo_exchanges(self, mesh: MeshShape, wire: Wire) -> list[tuple[Exchange, tuple, Hop, int]]:
    """Each ppermute of the halos, in order: (halo, what its buffer depends on, hop, per-device
    bytes). A later halo dim is exchanged on the buffer already widened along the earlier ones
    (a base-dilated one undilated: halo.py cuts it last)."""
    out = []
    widened: dict[int, tuple[list[int], tuple]] = {}
    for h in self.halos:
      x = self.constraint.operands[h.operand]
      shape, chain = widened.setdefault(
          h.operand, (list(self.needs[h.operand].local_shape(x.shape, mesh)), ()))
      row = math.prod(n for d, n in enumerate(shape) if d != h.dim) * wire(x.dtype)
      out.extend((h, chain, hop, hop.rows * row) for hop in hops(h))
      shape[h.dim] = h.buffer_rows if isinstance(h, Halo) and h.dilation > 1 else h.length
      widened[h.operand] = (shape, chain + (geometry(h),))
    return out


class ExecutionPlanner:
  """Plans each op's execution, and the reshards between forms. The candidate executions of an
  op depend only on its rule and its tensors' shapes, dtypes and shardings, which a model's layers
  repeat: they are computed once per such key (with the bytes their results' reshards move); only
  the operands' prices, which depend on the forms made so far, are taken per op. Lives as long as
  the constraints it plans (one program's, shared by every schedule of it), which keep their
  rules alive (rules are keyed by identity)."""

  def __init__(self, mesh: MeshShape, wire: Wire, splats: Mapping[Value, object]):
    self.mesh, self.wire, self.splats = mesh, wire, splats
    self._options: dict[tuple, list[_Option]] = {}
    self._reshards: dict[tuple, tuple[ReshardStep, ...]] = {}
    # per constraint: (its rule, tensors' shapes and dtypes), its tensors
    self._signatures: dict[int, tuple[tuple, tuple[Value | None, ...]]] = {}

  def reshard(self, v: Value, src: TensorSharding, dst: TensorSharding
              ) -> tuple[ReshardStep, ...]:
    """The steps that make ``v`` available as ``dst`` from ``src`` (reshard.py), planned once;
    a value of ``splats`` (a broadcast of a literal, an iota) is made anew in any form without
    partial sums, and one with no elements in any form."""
    if (v in self.splats and not src.partial and not dst.partial) or not math.prod(v.shape):
      return (Splat(axes=(), before=src, after=dst, fill=self.splats.get(v, 0), shape=v.shape,
                    itemsize=v.dtype.itemsize, mesh=self.mesh),)
    key = (src, dst, v.shape, self.wire(v.dtype))
    steps = self._reshards.get(key)
    if steps is None:
      steps = plan_reshard(src, dst, v.shape, key[3], self.mesh)
      if src.partial_op != "sum" and jnp.issubdtype(v.dtype, jnp.floating):
        steps = ordered_extrema(steps, v.shape, self.wire.ordered(v.dtype), self.mesh)
      self._reshards[key] = steps
    return steps

  def sub_blocks(self, v: Value, src: TensorSharding, dst: TensorSharding
                 ) -> tuple[ReshardStep, ...] | None:
    """``reshard.sub_blocks`` for ``v`` (None where it does not apply, as to a value with no
    elements, made anew), against the route ``reshard`` plans."""
    if not math.prod(v.shape):
      return None
    return sub_blocks(src, dst, v.shape, self.wire(v.dtype), self.mesh,
                      self.reshard(v, src, dst))

  def plan(self, c: Constraint, shardings: Mapping[Value, TensorSharding], price: Price,
           summed_with: Callable[[Value], int] = lambda v: 1,
           read: Callable[[Value], bool] = lambda v: True) -> Execution:
    """The cheapest execution of ``c``: the bytes of its own gather, its results' reshards (of
    those ``read``: a result nothing reads is never resharded) and its operands' (``price``). A
    result left as a pending partial sum that ``summed_with`` other such sums (an add of several
    dots' partial results) is reduced once for all of them, so its reduction is priced at its
    share."""
    options = self._options_of(c, shardings)
    if len(options) == 1:
      return _for(c, options[0].execution)
    return self.priced(c, shardings, price, summed_with, read)[0]

  def priced(self, c: Constraint, shardings: Mapping[Value, TensorSharding], price: Price,
             summed_with: Callable[[Value], int] = lambda v: 1,
             read: Callable[[Value], bool] = lambda v: True) -> tuple[Execution, int]:
    """``plan``'s execution and the bytes it moves by ``plan``'s measure."""
    def total(o: _Option) -> int:
      return o.cost(c.results, summed_with, read) + sum(
          price(v, need) for v, need in zip(c.operands, o.execution.needs) if need is not None)
    # of equally cheap options, the first whose own gather moves least (an operand's reshard
    # makes a form later readers share; an op's own gather serves it alone)
    best = min(self._options_of(c, shardings), key=lambda o: (total(o), o.gathered))
    return _for(c, best.execution), total(best)

  def in_layout(self, c: Constraint, dims: TensorSharding) -> Execution | None:
    """``c`` run with every operand and result in ``dims``' layout, where its rule maps each dim
    to one factor alike for every tensor (an elementwise op); else None."""
    rule = c.rule
    layout = rule.operands[rule.linear_in[0]] if rule.linear_in else None
    if not layout or any(tf and tf != layout for tf in (*rule.operands, *rule.results)):
      return None  # (a scalar operand, a select's predicate, is whole anyway)
    axes: list[Axes] = [()] * rule.num_factors
    for factors, dim_axes in zip(layout, dims.dims):
      if dim_axes and len(factors) != 1:
        return None
      if dim_axes:
        axes[factors[0]] = dim_axes
    return _execute(c, tuple(axes), self.mesh)

  def may_leave_partial(self, c: Constraint, shardings: Mapping[Value, TensorSharding],
                        result: int) -> bool:
    """Whether some execution of ``c`` leaves its result ``result`` a pending partial sum."""
    return any(o.execution.produces[result] is not None and o.execution.produces[result].partial
               for o in self._options_of(c, shardings))

  def _options_of(self, c: Constraint, shardings: Mapping[Value, TensorSharding]
                  ) -> list[_Option]:
    """``_candidates``, computed once per rule, tensor shapes, dtypes and shardings."""
    known = self._signatures.get(id(c))
    if known is None:  # propagation shares equal ops' rules
      tensors = c.tensors()
      known = self._signatures[id(c)] = (id(c.rule), tuple(
          None if v is None else (v.shape, v.dtype) for v in tensors)), tensors
    signature, tensors = known
    key = (signature, tuple(None if v is None else shardings[v] for v in tensors))
    options = self._options.get(key)
    if options is None:
      options = self._options[key] = self._candidates(c, shardings)
    return options

  def _candidates(self, c: Constraint, shardings: Mapping[Value, TensorSharding]
                  ) -> list[_Option]:
    """Each distinct execution, with the bytes that reshard its results to their shardings."""
    from_results = _projections(c.results, c.rule.results, shardings, c.rule, self.mesh)
    from_operands = _projections(c.operands, c.rule.operands, shardings, c.rule, self.mesh)
    choices = dict.fromkeys(
        _factor_axes(c, from_results, from_operands, self.mesh, first, operands_first)
        for first, operands_first in (("reductions", False), ("others", False),
                                      ("reductions", True), ("larger", True)))
    for kept in _each_operands_layout(c, shardings, from_operands, self.mesh):
      for operands_first in (True, False):  # or the results' axes where they have them
        choices.setdefault(_factor_axes(c, from_results, kept, self.mesh, "larger",
                                        operands_first))
    if c.rule.gathers:  # or its reduced dims gathered whole (less where a shard holds one row)
      choices.update(dict.fromkeys(_without_reductions(axes, c.rule) for axes in list(choices)))
    gatherable = _gatherable_reductions(c.rule, from_operands)
    if gatherable:  # or those gathered where they would slice another operand and reduce the
      # result (XLA's dot: x.T @ y of x P('a','b'), y P(), gathers x's 'a', 128 B, not 256 B)
      choices.update(dict.fromkeys(_without_reductions(axes, c.rule, gatherable)
                                   for axes in list(choices)))
    if c.rule.relocatable:  # or the axes of the dims it needs whole moved to a pass dim first
      choices.update(dict.fromkeys(moved for axes in list(choices)
                                   for moved in _relocations(axes, c.rule, from_operands)))
    options = [_execute(c, axes, self.mesh) for axes in choices]
    options += [ex for ex in (_reading_whole(o, shardings, self.mesh) for o in options) if ex]
    if len(options) == 1:
      return [_Option(options[0], 0, ())]
    return [_Option(ex, ex.gather_bytes(self.mesh, self.wire) + sum(
        n for *_, n in ex.halo_exchanges(self.mesh, self.wire)), tuple(
        0 if made is None or made == shardings[v] else
        sum(s.bytes for s in self.reshard(v, made, shardings[v]))
        for v, made in zip(c.results, ex.produces)))
            for ex in options]


def _for(c: Constraint, ex: Execution) -> Execution:
  """``ex``, planned for an op with ``c``'s rule and tensors, as ``c``'s execution."""
  if ex.constraint is c:
    return ex
  return Execution(c, ex.factor_axes, ex.needs, ex.produces, ex.halos)


@dataclass(frozen=True)
class _Option:
  """A candidate execution and what it moves besides its operands' reshards: its own gather of
  partial results and its halo exchanges (``gathered``), and each result's reshard to its
  propagated sharding."""

  execution: Execution
  gathered: int
  result_bytes: tuple[int, ...]

  def cost(self, results: tuple[Value | None, ...], summed_with: Callable[[Value], int],
           read: Callable[[Value], bool]) -> int:
    return self.gathered + sum(
        moved // summed_with(v) if made is not None and made.partial else moved
        for v, made, moved in zip(results, self.execution.produces, self.result_bytes)
        if v is not None and read(v))


def _execute(c: Constraint, axes: tuple[Axes, ...], mesh: MeshShape,
             whole: frozenset[WindowedDim] = frozenset()) -> Execution:
  """``c`` run with ``axes`` per factor; the windowed dims ``whole`` read whole, unexchanged."""
  rule = c.rule
  needs = tuple(None if v is None or tf is None else _sharding(tf, axes)
                for v, tf in zip(c.operands, rule.operands))
  for w in whole:
    dims = list(needs[w.operand].dims)
    dims[w.dim] = ()
    needs = needs[:w.operand] + (TensorSharding(tuple(dims)),) + needs[w.operand + 1:]
  partial = tuple(a for f, k in enumerate(rule.kinds) if k is FactorKind.REDUCTION
                  for a in axes[f])
  pending = () if rule.gathers else partial  # such an op combines its partial results itself
  produces = tuple(None if v is None or tf is None else
                   TensorSharding(_sharding(tf, axes).dims, pending,
                                  rule.combiner if pending else "sum")
                   for v, tf in zip(c.results, rule.results))
  halos = joint_mirrors(_dilated_last(tuple(
      h for w in rule.windows if axes[w.factor] and w not in whole
      for h in _halos(w, axes[w.factor], mesh))))
  return Execution(c, axes, needs, produces, _joint_concatenation(rule, axes, halos, mesh))


def _joint_concatenation(rule: OpShardingRule, axes: tuple[Axes, ...],
                         halos: tuple[Exchange, ...], mesh: MeshShape) -> tuple[Exchange, ...]:
  """``halos``, or, where every operand of a concatenate is exchanged along its sharded dim, one
  exchange of their blocks together if that moves fewer rows (runs of two operands share a
  ppermute)."""
  windows = rule.windows
  if (len(windows) < 2 or windows[0].mode != "concatenate" or len(halos) != len(windows)
      or len(windows) != len(rule.operands) or not axes[windows[0].factor]):
    return halos
  w = windows[0]
  joined = plan_concatenation(w.dim, axes[w.factor], tuple(v.window.size for v in windows),
                              axes_size(axes[w.factor], mesh))
  rows = lambda exchanges: sum(hop.rows for x in exchanges for hop in hops(x))
  return (joined,) if rows((joined,)) < rows(halos) else halos


def _dilated_last(halos: tuple[Exchange, ...]) -> tuple[Exchange, ...]:
  """``halos`` with the base-dilated ones last: a later dim is exchanged on the buffer widened
  along the earlier ones, which a dilated dim widens by its halo rows (undilated, as XLA
  exchanges them: halo.py dilates and cuts it once every dim is exchanged)."""
  return tuple(sorted(halos, key=lambda h: isinstance(h, Halo) and h.dilation > 1))


def _reading_whole(ex: Execution, shardings: Mapping[Value, TensorSharding],
                   mesh: MeshShape) -> Execution | None:
  """``ex`` with the sharded windowed dims that may be read whole and that their operands hold
  whole read so, with no exchange (a replicated operand of a concatenate); None if there are
  none."""
  c = ex.constraint
  whole = frozenset(w for w in c.rule.windows if w.readable_whole and ex.factor_axes[w.factor]
                    and c.operands[w.operand] is not None
                    and not shardings[c.operands[w.operand]].dims[w.dim])
  return _execute(c, ex.factor_axes, mesh, whole) if whole else None


def _halos(w: WindowedDim, axes: Axes, mesh: MeshShape) -> tuple[Exchange, ...] | None:
  """The exchanges a sharded windowed dim needs; None if gathering it moves no more."""
  if w.mode == "scatter":
    planned = plan_scatter_halos(w.dim, axes, w.window, axes_size(axes, mesh))
    return None if planned is None else planned[:2]
  if w.mode == "rotate":
    return (plan_rotation(w.operand, w.dim, axes, w.window.size, axes_size(axes, mesh),
                          w.window.lo),)
  if w.mode == "reverse":
    return plan_reversal(w.operand, w.dim, axes, w.window.size, axes_size(axes, mesh))
  halo = plan_window(w.operand, w.dim, axes, w.window, axes_size(axes, mesh))
  return None if halo is None else (halo,)


def _factor_axes(c: Constraint, from_results: _Projected, from_operands: _Projected,
                 mesh: MeshShape, first: str, operands_first: bool) -> tuple[Axes, ...]:
  """Axes per factor: the results' (the operands' with ``operands_first``), else the operands';
  a mesh axis two factors want goes to the factors ``first`` names: the "reductions", the
  "others", or those of the "larger" operand (the smaller one is resharded: GSPMD's choice for a
  dot, and an embedding lookup's: its table keeps its split and the small indices are
  gathered)."""
  rule = c.rule
  chosen: dict[int, Axes] = {}
  for f, kind in enumerate(rule.kinds):
    if kind in (FactorKind.NEED_REPLICATION, FactorKind.PERMUTATION):
      continue
    if f in from_results and not (operands_first and f in from_operands):
      chosen[f] = from_results[f][0][1]
    elif f in from_operands:
      chosen[f] = _agreed(from_operands[f])
  def rank(f: int) -> tuple[int, int]:
    if first == "larger":
      return -max((size for size, axes in from_operands.get(f, []) if axes), default=0), f
    return (rule.kinds[f] is FactorKind.REDUCTION) != (first == "reductions"), f

  order = sorted((f for f in chosen if chosen[f]), key=rank)
  used: set[str] = set()
  final: list[Axes] = [()] * rule.num_factors
  for f in order:
    final[f] = prefix_without(chosen[f], used)
    used.update(final[f])
  _drop_inexpressible(final, rule, mesh)
  for w in rule.windows:  # a halo as wide as the rest of the array: gather instead
    if final[w.factor] and _halos(w, final[w.factor], mesh) is None:
      final[w.factor] = ()
  return tuple(final)


def _without_reductions(axes: tuple[Axes, ...], rule: OpShardingRule,
                        only: frozenset[int] | None = None) -> tuple[Axes, ...]:
  """``axes`` with the reduction factors (of ``only``, if given) unsharded."""
  return tuple(() if k is FactorKind.REDUCTION and (only is None or f in only) else a
               for f, (a, k) in enumerate(zip(axes, rule.kinds)))


def _gatherable_reductions(rule: OpShardingRule, from_operands: _Projected) -> frozenset[int]:
  """The sharded reduction factors the op may gather whole rather than sum its partial results:
  those whole in some operands holding them, and any where the op is cheap to repeat
  (``rule.repeatable``: a scatter). (Where every operand of a dot holds one sharded, as a
  data-parallel gradient's batch, the dot reduces locally and sums: gathering them would repeat
  its work on every device.)"""
  return frozenset(f for f, k in enumerate(rule.kinds) if k is FactorKind.REDUCTION
                   and f in from_operands and any(a for _, a in from_operands[f])
                   and (rule.repeatable or not all(a for _, a in from_operands[f])))


def _relocations(axes: tuple[Axes, ...], rule: OpShardingRule,
                 from_operands: _Projected) -> list[tuple[Axes, ...]]:
  """``axes`` with the operands' axes of the factors the op needs whole or combines itself
  appended to one pass factor, for each pass factor (an all-to-all moves them there first)."""
  whole = [f for f in range(rule.num_factors) if rule.whole_or_combined(f)]
  axes = tuple(() if f in whole else a for f, a in enumerate(axes))
  taken = {a for factor in axes for a in factor}
  moved: tuple[str, ...] = ()
  for f in whole:
    if f in from_operands:
      moved += prefix_without(_agreed(from_operands[f]), taken | set(moved))
  if not moved:
    return []
  return [tuple(a + moved if g == f else a for g, a in enumerate(axes))
          for f, kind in enumerate(rule.kinds) if kind is FactorKind.PASS]


def _each_operands_layout(c: Constraint, shardings: Mapping[Value, TensorSharding],
                          from_operands: _Projected, mesh: MeshShape) -> list[_Projected]:
  """For each operand of several whose axes disagree with another's on a factor: the operands'
  projections with that operand's axes taking every factor it shards, so that the op may run
  in its layout and move the others (XLA moves whichever operand costs less; the larger one
  keeping its axes is the default choice). The caller tries each with the results' axes on the
  other factors too (x P(None,'a') @ y P('b') into P('a'): y's contracting 'b', the rows 'a')."""
  disputed = {f for f, cands in from_operands.items() if len({a for _, a in cands if a}) > 1}
  if not disputed:
    return []
  out = []
  for v, tf in zip(c.operands, c.rule.operands):
    if v is None or tf is None:
      continue
    own = _projections((v,), (tf,), shardings, c.rule, mesh)
    if any(f in disputed and any(a for _, a in own[f]) for f in own):
      out.append({**from_operands, **{f: cands for f, cands in own.items()
                                      if any(a for _, a in cands)}})
  return out


def _projections(values, tensors, shardings, rule: OpShardingRule,
                 mesh: MeshShape) -> _Projected:
  """Per factor: (tensor size, axes) from every tensor that has the factor."""
  out: dict[int, list[tuple[int, Axes]]] = {}
  for v, tf in zip(values, tensors):
    if v is None or tf is None:
      continue
    dims = shardings[v].dims
    for d, factors in enumerate(tf):
      for f, axes in project(factors, dims[d], rule.sizes, mesh):
        out.setdefault(f, []).append((math.prod(v.shape), axes))
  return out


def _agreed(cands: list[tuple[int, Axes]]) -> Axes:
  """The longest axes all operands agree on as prefixes, else the largest operand's."""
  longest = max((a for _, a in cands), key=len)
  if all(longest[:len(a)] == a for _, a in cands):
    return longest
  return max(cands, key=lambda t: t[0])[1]


def _drop_inexpressible(axes: list[Axes], rule: OpShardingRule, mesh: MeshShape) -> None:
  """In a merged dim [f1, f2], f2 can only be sharded if f1 is sharded completely, and no factor
  of a merged dim may be split unevenly (its padding would land inside the merged dim).
  Repeats until nothing changes: dropping a factor in one tensor can strand a minor factor of
  another tensor's merged dim that was already checked."""
  changed = True
  while changed:
    changed = False
    for tf in rule.tensors():
      for factors in tf or ():
        if len(factors) < 2:
          continue
        for f in factors:
          if axes[f] and rule.sizes[f] % math.prod(mesh[a] for a in axes[f]):
            axes[f], changed = (), True
        for major, minor in zip(factors, factors[1:]):
          if axes[minor] and math.prod(mesh[a] for a in axes[major]) != rule.sizes[major]:
            axes[minor], changed = (), True


def _sharding(tf: TensorFactors, axes: tuple[Axes, ...] | list[Axes]) -> TensorSharding:
  return TensorSharding(tuple(tuple(a for f in factors for a in axes[f]) for factors in tf))
