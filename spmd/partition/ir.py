"""The traced program as spmd sees it: call-like equations inlined, control flow kept as regions.

Every ``Value`` is one array of the program, unique across regions, so propagation can treat the
whole nested program as one graph. Each ``Op`` keeps its jaxpr equation, so it can be re-bound.
"""
from __future__ import annotations

import functools
import itertools
import os
from dataclasses import dataclass, replace
from typing import Any, Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax._src import source_info_util
from jax.extend import core as jcore
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from spmd.partition.atoms import Atom, Literal, Value
from spmd.partition.fold import fold_constants, fold_region_empties
from spmd.partition.jax_compat import open_jaxpr, scan_layout, without_dead_outputs
from spmd.partition.primitives import SHARDING_PARAMS, PrimitiveInfo, bind, describe, operands
from spmd.partition.roll import fuse_rolls

# Frames inside spmd.partition (e.g. spmd.annotate) are not the user's source line.
source_info_util.register_exclusion(os.path.dirname(os.path.abspath(__file__)))


@dataclass(eq=False)
class Region:
  """A body of a control-flow op: its own inputs, ops and outputs."""

  inputs: tuple[Value, ...]
  ops: list[Op]
  outputs: tuple[Atom, ...]


@dataclass(eq=False)
class Op:
  """One primitive application; ``index`` is its place in the program's depth-first order."""

  index: int
  primitive: str
  params: dict
  inputs: tuple[Atom, ...]
  outputs: tuple[Value, ...]
  source: str
  eqn: Any
  regions: tuple[Region, ...] = ()
  name_stack: Any = source_info_util.NameStack()  # the whole stack, enclosing calls' included

  def __repr__(self) -> str:
    return f"op{self.index}:{self.primitive}"

  @functools.cached_property
  def params_key(self) -> tuple | None:
    """Primitive and params, hashable (None if a param cannot be hashed)."""
    return hashable_or_none((self.primitive, tuple(sorted(self.params.items()))))

  @functools.cached_property
  def merge_params(self) -> tuple | None:
    """Primitive and params as ``cse_key`` compares them (None for ops never merged). An op
    with regions (a loop, a cond) merges when every op of its regions would: its params hold
    its jaxprs, equal only when they are one traced function (a jitted helper called twice, as
    ``jnp.lcm`` calls ``jnp.gcd``), which XLA's CSE merges too. A reshape in effect is keyed by
    its result's type alone: ``x[:, :, None]`` and ``x.reshape(8, 4, 1)`` are one reshape once
    XLA's simplifier has run, and its CSE merges them and what reads them."""
    info = describe(self.eqn.primitive)
    if self.eqn.effects or (info is not None and info.stateful) or any(
        op.merge_params is None for region in self.regions for op in region.ops):
      return None
    if reshapes_in_effect(self) and not any(names_mesh_axes(self.params.get(k))
                                            for k in SHARDING_PARAMS):
      out = self.outputs[0].aval
      return "reshape in effect", out.shape, out.dtype, out.weak_type
    params = _canonical_slice(self) if self.primitive == "slice" else dict(self.params)
    if info is None or info.annotation is None:
      params.update({k: None for k in SHARDING_PARAMS
                     if k in params and not names_mesh_axes(params[k])})
    return hashable_or_none((self.primitive, tuple(sorted(params.items()))))


@dataclass(eq=False)
class Program:
  inputs: tuple[Value, ...]
  ops: list[Op]
  outputs: tuple[Atom, ...]
  consts: tuple[Value, ...]

  def all_ops(self) -> tuple[Op, ...]:
    """Every op, region ops right after their owner, in index order."""
    return tuple(op for op, _ in self.nested_ops)

  @functools.cached_property
  def nested_ops(self) -> tuple[tuple[Op, int], ...]:
    """(op, nesting depth) of every op, as ``all_ops`` orders them; read once the program is
    built (its ops do not change afterwards)."""
    return tuple(depth_first(self.ops))

  @functools.cached_property
  def reads(self) -> dict[Value, tuple[tuple[Op, int], ...]]:
    """Per value: each op reading it and at which operand position, in op order."""
    out: dict[Value, list[tuple[Op, int]]] = {}
    for op, _ in self.nested_ops:
      for k, x in enumerate(op.inputs):
        if isinstance(x, Value):
          out.setdefault(x, []).append((op, k))
    return {v: tuple(readers) for v, readers in out.items()}

  @functools.cached_property
  def annotations(self) -> frozenset[Op]:
    """The ops that annotate a value (a sharding constraint): their result names their
    operand."""
    return frozenset(op for op, _ in self.nested_ops
                     if op.inputs and isinstance(op.inputs[0], Value) and annotates(op))

  @functools.cached_property
  def value_depths(self) -> dict[Value, int]:
    """The depth of the region each value is defined in (0: the program's own; its inputs and
    constants are left out)."""
    depths: dict[Value, int] = {}
    for op, depth in self.nested_ops:
      depths.update((v, depth) for v in op.outputs)
      depths.update((v, depth + 1) for region in op.regions for v in region.inputs)
    return depths


def annotates(op: Op) -> bool:
  """Whether ``op`` is a sharding annotation (its result is its operand, resharded)."""
  info = describe(op.eqn.primitive)
  return info is not None and info.annotation is not None


def depth_first(items: list, children: Any = lambda item: [r.ops for r in item.regions]
                ) -> list[tuple[Any, int]]:
  """(item, nesting depth) of every item, each followed by those of its regions."""
  out: list[tuple[Any, int]] = []

  def visit(level: list, depth: int) -> None:
    for item in level:
      out.append((item, depth))
      for inner in children(item):
        visit(inner, depth + 1)

  visit(items, 0)
  return out


def layer(op: Op) -> tuple[tuple[str, ...], bool]:
  """The scopes (flax module path, ``jax.named_scope``) ``op`` was traced in, and whether it is
  in a transposed (backward) computation."""
  stack = op.name_stack.stack
  scopes = tuple(e.name for e in stack if isinstance(e, source_info_util.Scope))
  return scopes, any(isinstance(e, source_info_util.Transform) and e.name == "transpose"
                     for e in stack)


def source_line(source_info: source_info_util.SourceInfo) -> str:
  """``file:line:col (function)`` of the user's code, the file relative to the working dir."""
  text = source_info_util.summarize(source_info)
  if text.startswith("unknown"):
    return ""
  path, sep, rest = text.partition(":")
  if sep and os.path.isabs(path):
    rel = os.path.relpath(path)
    path = rel if not rel.startswith("..") else os.path.basename(path)
  return path + sep + rest


class _Builder:
  def __init__(self, platform: str) -> None:
    self.platform = platform
    self.counter = itertools.count()
    self.consts: list[Value] = []
    # A program's equations come from a few hundred distinct tracebacks (equal tracebacks hash
    # alike): each is summarized once, not once per equation.
    self.sources: dict[Any, str] = {}

  def source(self, eqn: Any) -> str:
    traceback = eqn.source_info.traceback
    if traceback not in self.sources:
      self.sources[traceback] = source_line(eqn.source_info)
    return self.sources[traceback]

  def region(self, closed: Any, inputs: tuple[Atom, ...] | None = None, call_site: str = "",
             outer: Any = source_info_util.NameStack()) -> Region:
    """Builds a region from a closed jaxpr; with ``inputs`` its invars are bound to those atoms.
    Ops with no user frame of their own (inside library functions) take ``call_site``; every
    op's name stack continues ``outer``, the stack of the equation that holds the region."""
    jaxpr, consts = open_jaxpr(closed)
    env: dict[Any, Atom] = {}
    for var, c in zip(jaxpr.constvars, consts):
      env[var] = self._const(var, c)
    region_inputs = tuple(Value(v.aval) for v in jaxpr.invars)
    for var, atom in zip(jaxpr.invars, inputs if inputs is not None else region_inputs):
      env[var] = atom
    ops: list[Op] = []
    self._eqns(jaxpr.eqns, env, ops, call_site, outer)
    return Region(region_inputs, ops, tuple(_read(env, v) for v in jaxpr.outvars))

  def _const(self, var: Any, array: Any) -> Value:
    value = Value(var.aval, const=array)
    self.consts.append(value)
    return value

  def _eqns(self, eqns: list, env: dict, ops: list[Op], call_site: str, outer: Any) -> None:
    for eqn in eqns:
      inputs = tuple(_read(env, v) for v in eqn.invars)
      info = describe(eqn.primitive)
      source = self.source(eqn) or call_site
      stack = outer + eqn.source_info.name_stack
      inline = _inlined(eqn, info, inputs, self.platform)
      if inline is None and info is not None and info.manual is not None:
        self._manual(eqn, info, inputs, env, ops, source, stack)
        continue
      if inline is not None:
        inlined = self.region(*inline, source, stack)
        ops.extend(inlined.ops)
        for var, atom in zip(eqn.outvars, inlined.outputs):
          env[var] = atom
        continue
      outputs = tuple(Value(v.aval) for v in eqn.outvars)
      op = Op(next(self.counter), eqn.primitive.name, dict(eqn.params), inputs, outputs, source,
              eqn, name_stack=stack)
      ops.append(op)
      if info is not None and info.control is not None:
        closed = [c for p in info.control.bodies for c in _as_list(eqn.params[p])]
        op.regions = tuple(self.region(c, call_site=source, outer=stack) for c in closed)
      for var, value in zip(eqn.outvars, outputs):
        env[var] = value

  def _manual(self, eqn: Any, info: PrimitiveInfo, inputs: tuple[Atom, ...], env: dict,
              ops: list[Op], source: str, stack: Any) -> None:
    """A user's shard_map (manual.py): its operands pinned to its in_specs and its results to its
    out_specs by annotations around it, as JAX's lowering marks them (a sharding custom call on
    each side), so that propagation carries its shardings to its neighbours."""
    in_specs, out_specs = info.manual.specs(eqn.params)
    pinned = tuple(self._pin(x, spec, eqn, source, stack, ops) if isinstance(x, Value) else x
                   for x, spec in zip(inputs, in_specs))
    outputs = tuple(Value(v.aval) for v in eqn.outvars)
    ops.append(Op(next(self.counter), eqn.primitive.name, dict(eqn.params), pinned, outputs,
                  source, eqn, name_stack=stack))
    for var, v, spec in zip(eqn.outvars, outputs, out_specs):
      env[var] = self._pin(v, spec, eqn, source, stack, ops)

  def _pin(self, x: Value, spec: P, eqn: Any, source: str, stack: Any, ops: list[Op]) -> Value:
    """An annotation asking that ``x`` be sharded as ``spec`` (appended to ``ops``): its result."""
    from spmd.partition.annotation import annotate_p  # noqa: PLC0415 (annotation.py builds on ir)
    result = Value(x.aval)
    params = {"spec": spec}
    ops.append(Op(next(self.counter), annotate_p.name, params, (x,), (result,), source,
                  eqn.replace(primitive=annotate_p, params=params, effects=jcore.no_effects),
                  name_stack=stack))
    return result


def _inlined(eqn: Any, info: Any, inputs: tuple[Atom, ...],
             platform: str) -> tuple[Any, tuple[Atom, ...]] | None:
  """The body an equation stands for and its inputs, to inline: a call's, or the branch of a
  platform-dependent ``cond`` (``lax.platform_dependent``: ``jnp.diagonal``, linear algebra) for
  ``platform``, the one JAX keeps when it lowers; None for any other equation."""
  if info is not None and info.inline is not None:
    return info.inline(eqn.params, inputs)
  platforms = eqn.params.get("branches_platforms") if eqn.primitive.name == "cond" else None
  if platforms is None:
    return None
  for branch, names in zip(eqn.params["branches"], platforms):
    if names is None or platform in names:
      return branch, inputs[1:]
  raise ValueError(f"{source_line(eqn.source_info)}: lax.platform_dependent has no branch for "
                   f"{platform!r} (it has {[n for n in platforms if n]}) and no default")


def _as_list(x: Any) -> list:
  return list(x) if isinstance(x, (tuple, list)) else [x]


def _read(env: dict, var: Any) -> Atom:
  if isinstance(var, jcore.Literal):
    return Literal(var.val, var.aval)
  return env[var]


def _prune(ops: list[Op], outputs: tuple[Atom, ...]) -> list[Op]:
  """Drops ops whose results nothing uses (XLA deletes them too, and a conditional's and a
  loop's dead results with what computes them); effectful ops stay."""
  live = {a for a in outputs if isinstance(a, Value)}
  kept: list[Op] = []
  for op in reversed(ops):
    if not op.eqn.effects and not any(v in live for v in op.outputs):
      continue
    if op.primitive == "scan":
      _drop_dead_stacked_outputs(op, live)
    if op.primitive == "cond":
      _drop_dead_branch_outputs(op, live)
    if op.primitive == "shard_map":
      op = _without_dead_manual_outputs(op, live)
    if op.primitive == "optimization_barrier":
      op = _without_dead_barrier_outputs(op, live)
    if op.primitive in ("scan", "while"):
      _pass_dead_carries_through(op, live)
    for region in op.regions:
      region.ops = _prune(region.ops, region.outputs)
    if op.primitive == "cond":
      _drop_unread_branch_operands(op)
    live.update(a for a in op.inputs if isinstance(a, Value))
    kept.append(op)
  return kept[::-1]


def _values_read(ops: list[Op], outputs: Sequence[Atom]) -> set[Value]:
  """The values computing ``outputs`` (and the effects of ``ops``) reads, themselves included."""
  live = {a for a in outputs if isinstance(a, Value)}
  for op in reversed(ops):
    if op.eqn.effects or any(v in live for v in op.outputs):
      live.update(a for a in op.inputs if isinstance(a, Value))
  return live


def _without_dead_manual_outputs(shard_map: Op, live: set) -> Op:
  """A user's shard_map without the results nothing reads, nor the body equations computing
  only them (XLA drops a dead result and its collectives: the forward ``psum`` of a loss under
  ``jax.grad``)."""
  used = [v in live for v in shard_map.outputs]
  if all(used):
    return shard_map
  params = dict(shard_map.params, jaxpr=without_dead_outputs(shard_map.params["jaxpr"], used),
                out_specs=tuple(_kept(shard_map.params["out_specs"], used)))
  eqn = shard_map.eqn.replace(params=params, outvars=_kept(shard_map.eqn.outvars, used))
  return replace(shard_map, params=params, eqn=eqn,
                 outputs=tuple(_kept(shard_map.outputs, used)))


def _without_dead_barrier_outputs(barrier: Op, live: set) -> Op:
  """An ``optimization_barrier`` without the results nothing reads, nor their operands (XLA
  drops them when it expands the barrier: a Hessian's barrier passing a value only a dead
  branch of the derivative reads)."""
  used = [v in live for v in barrier.outputs]
  if all(used):
    return barrier
  eqn = barrier.eqn.replace(invars=_kept(barrier.eqn.invars, used),
                            outvars=_kept(barrier.eqn.outvars, used))
  return replace(barrier, eqn=eqn, inputs=tuple(_kept(barrier.inputs, used)),
                 outputs=tuple(_kept(barrier.outputs, used)))


def _kept(items: Sequence, used: Sequence[bool]) -> list:
  """The ``items`` whose ``used`` flag is set."""
  return [x for x, u in zip(items, used) if u]


def _drop_dead_branch_outputs(cond: Op, live: set) -> None:
  """A conditional's results that nothing reads leave it, with each branch's output there."""
  keep = [j for j, v in enumerate(cond.outputs) if v in live]
  cond.outputs = tuple(cond.outputs[j] for j in keep)
  for branch in cond.regions:
    branch.outputs = tuple(branch.outputs[j] for j in keep)


def _drop_unread_branch_operands(cond: Op) -> None:
  """A conditional's operands that no branch reads leave it (the branch index stays)."""
  keep = [k for k in range(len(cond.inputs) - 1)
          if any(branch.inputs[k] in _values_read(branch.ops, branch.outputs)
                 for branch in cond.regions)]
  cond.inputs = (cond.inputs[0], *(cond.inputs[k + 1] for k in keep))
  for branch in cond.regions:
    branch.inputs = tuple(branch.inputs[k] for k in keep)


def _pass_dead_carries_through(loop: Op, live: set) -> None:
  """A loop's carries that nothing reads after it, its condition does not read and no live
  carry is computed from are passed through its body unchanged, so the ops computing them are
  dead (XLA's while-loop simplifier removes such carries)."""
  if loop.primitive == "scan":
    (body,), layout = loop.regions, scan_layout(loop.params)
    first, carries, reads = layout.num_consts, layout.num_carry, set()
    stacked = body.outputs[carries:]
  else:
    (cond, body), first = loop.regions, loop.params["body_nconsts"]
    carries, stacked = len(loop.outputs), ()
    cond_first = loop.params["cond_nconsts"]
    reads = {j for j in range(carries)
             if cond.inputs[cond_first + j] in _values_read(cond.ops, cond.outputs)}
  needed = {j for j in range(carries) if loop.outputs[j] in live} | reads
  while True:
    used = _values_read(body.ops, [*(body.outputs[j] for j in needed), *stacked])
    more = needed | {j for j in range(carries) if body.inputs[first + j] in used}
    if more == needed:
      break
    needed = more
  body.outputs = tuple(out if j >= carries or j in needed else body.inputs[first + j]
                       for j, out in enumerate(body.outputs))


def _drop_dead_stacked_outputs(scan: Op, live: set) -> None:
  """A scan's stacked outputs that nothing reads leave it, with the body outputs they stack (XLA
  drops a loop's dead tuple elements, and the body ops computing only them)."""
  carries = scan_layout(scan.params).num_carry
  keep = [j for j, v in enumerate(scan.outputs) if j < carries or v in live]
  body = scan.regions[0]
  scan.outputs = tuple(scan.outputs[j] for j in keep)
  body.outputs = tuple(body.outputs[j] for j in keep)


def _dedupe(ops: list[Op], outputs: tuple[Atom, ...]) -> tuple[list[Op], tuple[Atom, ...]]:
  """Common subexpressions: a pure op with the same primitive, params and inputs as an earlier
  one reuses its results (XLA merges them too, collectives included); a select whose cases are
  all one value is that value (XLA's simplifier folds it, and the predicate may then be dead), as
  is a select whose predicate is one known value everywhere (the case it picks), and
  so is an ``abs`` of a value that cannot be negative, a ``max(max(x, y), y)`` (or ``min``), an
  ``x * 1`` (or ``x / 1``), a chain of adds, subtracts and negations of scalar literals that
  comes back to its start (``x + 2 - 2``, ``3 - (3 - x)``; any other such chain is keyed by where
  it ends, ``(x + 1) + 2`` as ``x + 3``: XLA's simplifier folds the literals, for floats too),
  and a chain of reshapes in effect that
  gives a value back its own shape (``sum(x[None], 0)``: XLA's simplifier folds the chain to one
  reshape, then to nothing). Ops computing only from iotas and literals are not merged: they need
  no data, so each use may take them in its own sharding at no cost (XLA merges them only after
  partitioning; cse.py merges those that end up in one sharding); a select between two equal
  ones is still the first."""
  alias: dict[Value, Value] = {}
  equal: dict[Value, Value] = {}  # a value computed from iotas and literals -> the first equal one
  makers: dict[Value, Op] = {}
  splats: dict[Value, np.ndarray | None] = {}  # values known to hold one element everywhere
  relaid: dict[Value, Value] = {}  # a reshape in effect's result -> the value it re-lays
  shifted: dict[Value, _Affine] = {}  # a value made from another by literal adds and negations
  seen: dict[tuple, Op] = {}
  kept: list[Op] = []
  sub = lambda a: alias.get(a, a) if isinstance(a, Value) else a  # noqa: E731
  for op in ops:
    op.inputs = tuple(sub(a) for a in op.inputs)
    for region in op.regions:
      region.ops, region.outputs = _dedupe(region.ops, region.outputs)
    same = (_only_case(op, equal) or _chosen_case(op, makers, splats)
            or _needless_abs(op, makers) or _without_empty_pieces(op)
            or _identity_arithmetic(op, makers) or _repeated_bound(op, makers))
    affine = _affine(op, makers, shifted)
    if affine is not None and affine.is_identity():
      same = affine.base
    if same is not None:
      alias[op.outputs[0]] = same
      continue
    if affine is not None:
      shifted[op.outputs[0]] = affine
    if reshapes_in_effect(op):
      source, result = op.inputs[0], op.outputs[0]
      source = relaid.get(source, source)
      if result.shape == source.shape:  # a reshape in effect keeps the dtype
        alias[result] = source
        continue
      relaid[result] = source
    key = (_full_reduction_key(op, relaid) or (affine and affine.key()) or _commuted_key(op)
           or cse_key(op))
    if key is not None and not op.regions and all(
        not isinstance(a, Value) or a in equal for a in op.inputs):
      first = seen.setdefault(cse_key(op, equal.__getitem__), op)
      equal.update(zip(op.outputs, first.outputs))
      kept.append(op)
      makers.update((v, op) for v in op.outputs)
      continue
    if key is not None and key in seen:
      alias.update(zip(op.outputs, seen[key].outputs))
      continue
    if key is not None:
      seen[key] = op
    kept.append(op)
    makers.update((v, op) for v in op.outputs)
  return kept, tuple(sub(a) for a in outputs)


def _split_constants(ops: list[Op], outputs: tuple[Atom, ...]
                     ) -> tuple[list[Op], tuple[Atom, ...]]:
  """Each further reader of a value computed from literals and iotas alone reads its own copy of
  that computation, as Shardy's constant splitter gives each use its own: the sharding one reader
  gives a constant does not reach the others (the cotangent ``jax.grad`` of a sum seeds, read by
  the gradient of every argument). cse.py merges the copies that end up in one sharding. A
  conditional's or a loop's region reading such a value as an operand the same on every trip
  computes its own copy (XLA sinks constants into branches and loop bodies)."""
  made: dict[Value, Op] = {}  # constant values -> the op making them
  read: set[Value] = set()
  kept: list[Op] = []

  def copy(v: Value, into: list[Op]) -> Value:
    op = made[v]
    clone = replace(op, inputs=tuple(copy(a, into) if isinstance(a, Value) and a in made else a
                                     for a in op.inputs),
                    outputs=tuple(Value(o.aval) for o in op.outputs))
    into.append(clone)
    return clone.outputs[op.outputs.index(v)]

  def reader(atoms: tuple[Atom, ...]) -> tuple[Atom, ...]:
    mine: dict[Value, Value] = {}  # one op reading a constant twice reads one copy
    for a in atoms:
      if isinstance(a, Value) and a in made and a not in mine:
        mine[a] = copy(a, kept) if a in read else a
        read.add(a)
    return tuple(mine.get(a, a) if isinstance(a, Value) else a for a in atoms)

  def sink(op: Op) -> None:
    for k, region, j in _invariant_region_inputs(op):
      if isinstance(op.inputs[k], Value) and op.inputs[k] in made:
        inside: list[Op] = []
        names = {region.inputs[j]: copy(op.inputs[k], inside)}
        _substitute(region.ops, names)
        region.ops = inside + region.ops
        region.outputs = tuple(names.get(a, a) if isinstance(a, Value) else a
                               for a in region.outputs)

  for op in ops:
    sink(op)
    for region in op.regions:
      region.ops, region.outputs = _split_constants(region.ops, region.outputs)
    op.inputs = reader(op.inputs)
    if not op.regions and cse_key(op) is not None and all(
        not isinstance(a, Value) or a in made for a in op.inputs):
      made.update((v, op) for v in op.outputs)
    kept.append(op)
  return kept, reader(outputs)


def _invariant_region_inputs(op: Op) -> list[tuple[int, Region, int]]:
  """(operand k, region, its input j): a conditional's operands in each branch, a loop's consts
  in its body (and a while's in its condition): the same value on every trip."""
  if op.primitive == "cond":
    return [(k + 1, branch, k) for branch in op.regions for k in range(len(op.inputs) - 1)]
  if op.primitive == "scan":
    return [(k, op.regions[0], k) for k in range(scan_layout(op.params).num_consts)]
  if op.primitive == "while":
    cn, bn = op.params["cond_nconsts"], op.params["body_nconsts"]
    cond, body = op.regions
    return [(k, cond, k) for k in range(cn)] + [(cn + k, body, k) for k in range(bn)]
  return []


def _inline_chosen_branches(ops: list[Op], outputs: tuple[Atom, ...]
                            ) -> tuple[list[Op], tuple[Atom, ...]]:
  """Every ``cond`` whose branch index is a scalar literal, or made from them by elementwise ops
  (``lax.cond(True, ...)``, a ``switch`` by a Python int, which JAX clamps), replaced by the
  branch it picks, here and in regions, as XLA's conditional simplifier inlines it."""
  makers: dict[Value, Op] = {}
  splats: dict[Value, np.ndarray | None] = {}
  names: dict[Value, Atom] = {}  # a replaced cond's result -> what its branch returns there
  kept: list[Op] = []
  for op in ops:
    op.inputs = tuple(names.get(a, a) if isinstance(a, Value) else a for a in op.inputs)
    for region in op.regions:
      region.ops, region.outputs = _inline_chosen_branches(region.ops, region.outputs)
    index = (_splat(op.inputs[0], makers, splats, _SPLAT_DEPTH) if op.primitive == "cond"
             else None)
    if index is None:
      kept.append(op)
      makers.update((v, op) for v in op.outputs)
      continue
    branch = op.regions[int(np.clip(index, 0, len(op.regions) - 1))]
    operands = dict(zip(branch.inputs, op.inputs[1:]))
    _substitute(branch.ops, operands)
    kept.extend(branch.ops)
    makers.update((v, inner) for inner in branch.ops for v in inner.outputs)
    names.update((v, operands.get(out, out) if isinstance(out, Value) else out)
                 for v, out in zip(op.outputs, branch.outputs))
  return kept, tuple(names.get(a, a) if isinstance(a, Value) else a for a in outputs)


def _only_case(op: Op, equal: Mapping[Value, Value]) -> Value | None:
  """The value every case of a ``select_n`` is (``equal``: values computed from iotas and literals
  alone, each to the first equal one), else None."""
  if op.primitive != "select_n":
    return None
  first = op.inputs[1]
  same = lambda c: c is first or (  # noqa: E731
      isinstance(c, Value) and c in equal and equal[c] is equal.get(first))
  return first if isinstance(first, Value) and all(same(c) for c in op.inputs[2:]) else None


def _chosen_case(op: Op, makers: Mapping[Value, Op],
                 splats: dict[Value, np.ndarray | None]) -> Value | None:
  """The case a ``select_n`` picks everywhere, where its predicate is one known value (``_splat``),
  else None: XLA's simplifier folds such a select to the case (``jnp.ldexp`` of zeros picks the
  zeros' own bits, so what reads it reads a constant)."""
  if op.primitive != "select_n":
    return None
  which = _splat(op.inputs[0], makers, splats, _SPLAT_DEPTH)
  if which is None:
    return None
  case = op.inputs[1 + int(which)]
  return case if isinstance(case, Value) and _typed_alike(case, op.outputs[0]) else None


_SPLAT_DEPTH = 64  # ops followed back from a predicate before giving up (keeps recursion short)


def _splat(a: Atom, makers: Mapping[Value, Op], splats: dict[Value, np.ndarray | None],
           depth: int) -> np.ndarray | None:
  """The one element ``a`` holds everywhere, if ``a`` is a scalar literal or made from them by
  broadcasts, identities and elementwise ops (those run on the scalars, at compile time as XLA
  folds them), else None. Computed when first asked for and kept in ``splats``."""
  if not isinstance(a, Value):
    return np.asarray(a.val) if np.ndim(a.val) == 0 else None
  if a in splats or depth == 0:
    return splats.get(a)
  maker = makers.get(a)
  if maker is None or not _runs_on_scalars(maker):
    splats[a] = None
    return None
  if describe(maker.eqn.primitive).local is operands:  # an identity: result k is operand k
    splats[a] = _splat(maker.inputs[maker.outputs.index(a)], makers, splats, depth - 1)
    return splats[a]
  args = []
  for x in maker.inputs:
    args.append(_splat(x, makers, splats, depth - 1))
    if args[-1] is None:
      splats[a] = None
      return None
  if maker.primitive == "broadcast_in_dim":
    splats[a] = args[0]
  else:
    with jax.ensure_compile_time_eval():
      splats.update(zip(maker.outputs, (np.asarray(r) for r in bind(maker, args))))
  return splats[a]


def _runs_on_scalars(op: Op) -> bool:
  """Whether ``op`` computes each element of its results from the same element of its operands
  alone, of plain dtypes: elementwise ops, same-width bitcasts, identities (not annotations), and
  broadcasts of a scalar."""
  from spmd.partition.rules import elementwise  # the rules build on this module
  info = describe(op.eqn.primitive)
  if info is None or info.annotation is not None or info.stateful or any(
      jax.dtypes.issubdtype(x.aval.dtype, jax.dtypes.extended) for x in (*op.inputs, *op.outputs)):
    return False
  if op.primitive in ("broadcast_in_dim", "bitcast_convert_type"):
    shape = op.inputs[0].aval.shape
    return shape == op.outputs[0].shape or (op.primitive == "broadcast_in_dim" and not shape)
  return info.rule is elementwise.elementwise or info.local is operands


def _without_empty_pieces(op: Op) -> Value | None:
  """A ``concatenate``'s one piece holding elements, which it then is; with several, the
  concatenate is made of them alone (XLA's simplifier drops empty pieces: an empty argument's
  sharding reaches nothing through them). Else None."""
  if op.primitive != "concatenate" or op.outputs[0].size == 0:
    return None
  kept = [k for k, a in enumerate(op.inputs) if not (isinstance(a, Value) and a.size == 0)]
  if len(kept) == 1:
    return op.inputs[kept[0]]
  if len(kept) < len(op.inputs):
    op.inputs = tuple(op.inputs[k] for k in kept)
    op.eqn = op.eqn.replace(invars=[op.eqn.invars[k] for k in kept])
  return None


def _needless_abs(op: Op, makers: dict[Value, Op]) -> Value | None:
  """The operand of an ``abs`` of a real value that cannot be negative (a square ``x * x``, or an
  ``abs``), else None: XLA's algebraic simplifier drops such an abs (its ``IsNonNegative``, for
  integers too, as the programs compared with spmd's are compiled by it)."""
  x = op.inputs[0] if op.primitive == "abs" else None
  if not isinstance(x, Value) or jnp.issubdtype(x.dtype, jnp.complexfloating):
    return None
  maker = makers.get(x)
  if maker is None:
    return None
  squared = maker.primitive == "mul" and maker.inputs[0] is maker.inputs[1]
  return x if maker.primitive in ("square", "abs") or squared else None


def _repeated_bound(op: Op, makers: Mapping[Value, Op]) -> Value | None:
  """``x`` for ``max(x, x)``, and for ``max(x, y)`` where ``x = max(z, y)`` (either operand
  order; ``y`` one value or equal scalar literals), alike for ``min``; else None. XLA's
  simplifier folds both, so what reads either result merges in the compiled program
  (``argmax`` of both gathers once)."""
  if op.primitive not in ("max", "min"):
    return None
  for x, y in (op.inputs, op.inputs[::-1]):
    if not isinstance(x, Value) or not _typed_alike(x, op.outputs[0]):
      continue
    maker = makers.get(x)
    if x is y or (maker is not None and maker.primitive == op.primitive
                  and any(_same_operand(y, other, makers) for other in maker.inputs)):
      return x
  return None


def _same_operand(a: Atom, b: Atom, makers: Mapping[Value, Op]) -> bool:
  """One value, or scalar literals (or broadcasts of them) of one value and type."""
  if a is b:
    return True
  la, lb = _scalar_literal(a, makers), _scalar_literal(b, makers)
  return (la is not None and lb is not None and la.aval == lb.aval
          and literal_key(la.val) == literal_key(lb.val))


# Binary ops that give back an operand when the other is a scalar literal: primitive -> (the
# literal's positions, its value). XLA's simplifier folds them (A + 0, A - 0, A * 1, A / 1).
_IDENTITY_LITERALS: dict[str, tuple[tuple[int, ...], int]] = {"mul": ((0, 1), 1),
                                                                "div": ((1,), 1)}


def _identity_arithmetic(op: Op, makers: Mapping[Value, Op]) -> Value | None:
  """The operand ``x`` of ``x * 1``, ``1 * x`` or ``x / 1`` (a scalar literal or a broadcast of
  one, as ``jax.grad`` seeds a sum's cotangent; the result typed as ``x``), else None: XLA's
  algebraic simplifier drops such an op, so collectives on either side of it merge in the
  compiled program (``_affine`` does ``x + 0``)."""
  places, value = _IDENTITY_LITERALS.get(op.primitive, ((), None))
  for k in places:
    literal, x = _scalar_literal(op.inputs[k], makers), op.inputs[1 - k]
    if (literal is not None and isinstance(x, Value) and _typed_alike(x, op.outputs[0])
        and literal.val == value):
      return x
  return None


@dataclass(frozen=True)
class _Affine:
  """A value that is ``sign * base + offset``, made from ``base`` by adds and subtracts of scalar
  literals and negations (``offset``: a NumPy scalar of the value's dtype)."""

  base: Value
  sign: int
  offset: Any

  def is_identity(self) -> bool:
    return self.sign == 1 and self.offset == 0

  def key(self) -> tuple:
    """One key for every chain ending at this form: XLA's simplifier folds each to one op."""
    return "affine", self.base.id, self.sign, self.offset.dtype.name, self.offset.item()


def _affine(op: Op, makers: Mapping[Value, Op], shifted: Mapping[Value, _Affine]
            ) -> _Affine | None:
  """The form of ``op``'s result if it is an add or subtract of a scalar literal (or a broadcast
  of one) and a value of its type, or a negation, of an integer or float dtype; else None.
  ``shifted`` holds the forms of earlier results, so a chain's literals add up (in the dtype, as
  XLA folds them: an integer's wrap)."""
  out = op.outputs[0] if len(op.outputs) == 1 else None
  if (op.primitive not in ("add", "sub", "neg") or out is None
      or not any(jnp.issubdtype(out.dtype, kind) for kind in (jnp.integer, jnp.floating))):
    return None

  def form(a: Atom) -> _Affine | None:
    if not isinstance(a, Value) or not _typed_alike(a, out):
      return None
    return shifted.get(a, _Affine(a, 1, np.zeros((), out.dtype)[()]))

  with np.errstate(over="ignore"):
    if op.primitive == "neg":
      x = form(op.inputs[0])
      return None if x is None else _Affine(x.base, -x.sign, -x.offset)
    for k in (0, 1):
      literal, x = _scalar_literal(op.inputs[1 - k], makers), form(op.inputs[k])
      if literal is None or x is None:
        continue
      c = np.asarray(literal.val).astype(out.dtype)[()]
      if op.primitive == "add":
        return _Affine(x.base, x.sign, x.offset + c)
      return (_Affine(x.base, x.sign, x.offset - c) if k == 0
              else _Affine(x.base, -x.sign, c - x.offset))
  return None


def _scalar_literal(a: Atom, makers: Mapping[Value, Op]) -> Literal | None:
  """``a`` if it is a scalar literal, the literal a ``broadcast_in_dim`` of one makes ``a`` from,
  else None."""
  maker = makers.get(a) if isinstance(a, Value) else None
  if maker is not None and maker.primitive == "broadcast_in_dim":
    a = maker.inputs[0]
  return a if isinstance(a, Literal) and np.ndim(a.val) == 0 else None


def _typed_alike(x: Value, y: Value) -> bool:
  """Same shape, dtype and weak type (an aval traced under a mesh also names the mesh)."""
  return (x.shape, x.dtype, x.aval.weak_type) == (y.shape, y.dtype, y.aval.weak_type)


def _static_dynamic_slices(ops: list[Op]) -> None:
  """Replaces every ``dynamic_slice`` whose start indices are all literals by the ``slice`` it
  takes (starts clamped into the operand, as dynamic_slice clamps them), here and in regions,
  as XLA's simplifier does: a slice of a sharded dim is a halo of the rows it needs, not a
  gather of the dim."""
  for k, op in enumerate(ops):
    for region in op.regions:
      _static_dynamic_slices(region.ops)
    if op.eqn.primitive is not lax.dynamic_slice_p or not all(
        isinstance(i, Literal) for i in op.inputs[1:]):
      continue
    sizes, shape = op.params["slice_sizes"], op.inputs[0].aval.shape
    starts = tuple(min(max(int(i.val), 0), n - size)
                   for i, n, size in zip(op.inputs[1:], shape, sizes))
    params = {"start_indices": starts, "strides": None,
              "limit_indices": tuple(b + size for b, size in zip(starts, sizes))}
    eqn = op.eqn.replace(primitive=lax.slice_p, params=params, invars=list(op.eqn.invars[:1]))
    ops[k] = replace(op, primitive="slice", params=params, inputs=op.inputs[:1], eqn=eqn)


def _merge_pad_slices(ops: list[Op]) -> None:
  """Replaces every unit-stride ``slice`` of a ``pad``'s result by one ``pad`` of the pad's
  operand whose low and high widths cut what the slice cuts (negative where it cuts into the
  operand), here and in regions: a pad then a slice that shifts a sharded dim is one halo of the
  rows shifted in, as XLA partitions it, not a halo and then a reshard of an uneven pad (the
  pad stays for its other readers, if any)."""
  producer = {v: op for op in ops for v in op.outputs}
  for k, op in enumerate(ops):
    for region in op.regions:
      _merge_pad_slices(region.ops)
    pad = producer.get(op.inputs[0]) if op.eqn.primitive is lax.slice_p else None
    if pad is None or pad.eqn.primitive is not lax.pad_p or any(
        s != 1 for s in op.params["strides"] or ()):
      continue
    config = tuple((lo - start, hi - (n - limit), interior) for (lo, hi, interior), start, limit, n
                   in zip(pad.params["padding_config"], op.params["start_indices"],
                          op.params["limit_indices"], pad.outputs[0].shape))
    params = {"padding_config": config}
    eqn = op.eqn.replace(primitive=lax.pad_p, params=params, invars=list(pad.eqn.invars))
    ops[k] = replace(op, primitive="pad", params=params, inputs=pad.inputs, eqn=eqn)


def _slices_of_one_piece(ops: list[Op]) -> None:
  """Replaces every ``slice`` of a ``concatenate``'s result that reads one of its pieces alone
  by a slice of that piece, here and in regions, as XLA's simplifier does: the other pieces
  may then be dead (``jnp.partition(x, k)[:, :k]`` computes one top_k, not two)."""
  producer = {v: op for op in ops for v in op.outputs}
  for k, op in enumerate(ops):
    for region in op.regions:
      _slices_of_one_piece(region.ops)
    joined = producer.get(op.inputs[0]) if op.eqn.primitive is lax.slice_p else None
    if joined is None or joined.eqn.primitive is not lax.concatenate_p:
      continue
    d, p = joined.params["dimension"], op.params
    stride = (p["strides"] or (1,) * len(p["start_indices"]))[d]
    first, end = p["start_indices"][d], p["limit_indices"][d]
    last = first + (end - first - 1) // stride * stride  # the last row read
    offset = 0
    for piece in joined.inputs:
      n = piece.aval.shape[d]
      if offset <= first and last < offset + n:
        break
      offset += n
    else:
      continue
    params = dict(p, start_indices=_set(p["start_indices"], d, first - offset),
                  limit_indices=_set(p["limit_indices"], d, last - offset + 1))
    eqn = op.eqn.replace(params=params, invars=[joined.eqn.invars[joined.inputs.index(piece)]])
    ops[k] = replace(op, params=params, inputs=(piece,), eqn=eqn)


def _set(values: tuple[int, ...], d: int, value: int) -> tuple[int, ...]:
  return values[:d] + (value,) + values[d + 1:]


def _hoist_invariants(ops: list[Op]) -> list[Op]:
  """Loop-invariant code motion, as XLA does it: ``ops`` with their loops' bodies reading the
  loop's operand itself where they read one of its consts (the same value on every trip), and
  every body op that reads only such values (and literals) and is pure (``cse_key``) moved
  before the loop; innermost loops first, so an op leaves every loop it is invariant in. A
  while loop's condition and cond branches keep theirs (a branch runs at most once). The
  schedule reshards a value read from outside before the loop (schedule.py)."""
  out: list[Op] = []
  for op in ops:
    for region in op.regions:
      region.ops = _hoist_invariants(region.ops)
    info = describe(op.eqn.primitive)
    if info is None or info.control is None:
      out.append(op)
      continue
    bodies: dict[int, dict[Value, Atom]] = {}
    for inv in info.control.invariants(op):
      bodies.setdefault(inv.region, {})[op.regions[inv.region].inputs[inv.input]] = (
          op.inputs[inv.operand])
    for r, outside in bodies.items():
      body = op.regions[r]
      _substitute(body.ops, outside)
      kept = []
      inside = set(body.inputs)
      for inner in body.ops:
        if _movable(inner, inside):
          out.append(inner)
        else:
          inside.update(inner.outputs)
          kept.append(inner)
      body.ops = kept
    out.append(op)
  return out


def _substitute(ops: list[Op], names: dict[Value, Atom]) -> None:
  """Every op of ``ops`` and of their regions reads ``names[v]`` where it read ``v``."""
  for op in ops:
    op.inputs = tuple(names.get(a, a) if isinstance(a, Value) else a for a in op.inputs)
    for region in op.regions:
      _substitute(region.ops, names)


def _movable(op: Op, inside: set[Value]) -> bool:
  """Pure, reading at least one value and none defined ``inside`` the body."""
  values = [a for a in op.inputs if isinstance(a, Value)]
  return (bool(values) and not inside.intersection(values) and not op.regions
          and cse_key(op) is not None)


_SIZE_ONE_REDUCTIONS = ("reduce_sum", "reduce_max", "reduce_min", "reduce_prod")


_FULL_REDUCTIONS = frozenset(("reduce_sum", "reduce_max", "reduce_min", "reduce_prod",
                              "reduce_and", "reduce_or", "reduce_xor"))


def _full_reduction_key(op: Op, relaid: Mapping[Value, Value]) -> tuple | None:
  """One key for a reduction over every dim of a value and the same reduction of a reshape in
  effect of it (``relaid``: such a value -> the value it re-lays): XLA's simplifier reduces the
  value itself, whose elements are in the same order, and its CSE merges the two, collectives
  included (``jnp.einsum('ab,cd->cd', x[None], x[None])`` sums ``x[None]``, as ``x.sum()``
  does). None for any other op."""
  if op.primitive not in _FULL_REDUCTIONS or op.merge_params is None:
    return None
  x = op.inputs[0]
  if len(op.params["axes"]) != len(x.shape):
    return None
  rest = tuple((k, v) for k, v in sorted(op.params.items())
               if k != "axes" and k not in SHARDING_PARAMS)  # a scalar's: it names no axes
  return "full reduction", op.primitive, rest, relaid.get(x, x).id


_COMMUTATIVE = {"add", "add_any", "mul", "and", "or", "xor", "eq", "ne"}


def _commuted_key(op: Op) -> tuple | None:
  """One key for a commutative binary op of two values whichever order they come in, and for a
  ``dot_general`` whose dims are all batch dims in order, or by a scalar, of one type
  (``einsum('a,a->a')``, ``einsum('a,->a')``) as the ``mul`` it is: XLA's simplifier makes that
  dot a multiply, and its CSE merges ``x * y``, ``y * x`` and that dot, collectives included.
  None for any other op."""
  if len(op.inputs) != 2 or not all(isinstance(a, Value) for a in op.inputs):
    return None
  primitive = op.primitive
  if primitive == "dot_general" and _dot_is_product(op):
    primitive = "mul"
  if primitive not in _COMMUTATIVE or op.merge_params is None:
    return None
  if primitive == "add_any":
    primitive = "add"
  out = op.outputs[0].aval
  return ("commuted", primitive, _aval_str(out), out.weak_type,
          tuple(sorted(a.id for a in op.inputs)))


def _dot_is_product(op: Op) -> bool:
  """Whether a ``dot_general`` multiplies elementwise: every dim of both operands a batch dim,
  in order, or one operand a scalar (``einsum('a,->a')``), operands and result of one type, at
  the backend's default precision (another precision or algorithm may round a float's operands
  first), no sharding asked of its result."""
  (contracting, _), (lhs_batch, rhs_batch) = op.params["dimension_numbers"]
  lhs, rhs = (a.aval for a in op.inputs)
  every = tuple(range(lhs.ndim))
  elementwise = (tuple(lhs_batch) == tuple(rhs_batch) == every and lhs.shape == rhs.shape
                 or not lhs_batch and 0 in (lhs.ndim, rhs.ndim))
  return (not contracting and elementwise
          and lhs.dtype == rhs.dtype == op.outputs[0].aval.dtype
          and op.params.get("precision") is None
          and not any(names_mesh_axes(op.params.get(k)) for k in SHARDING_PARAMS))


def reshapes_in_effect(op: Op) -> bool:
  """Whether ``op`` keeps its operand's elements in their row-major order and only re-lays them
  in another shape: a reshape, a squeeze (or an unstack of a size-1 dim, jax 0.11's squeeze in
  lexsort), a broadcast adding size-1 dims, a reduction over size-1 dims, a transpose moving
  only size-1 dims, a rev of size-1 dims, a slice of the whole operand (XLA's simplifier makes
  each of them a reshape, or nothing)."""
  if not op.inputs or not isinstance(op.inputs[0], Value) or len(op.outputs) != 1:
    return False
  source, result = op.inputs[0], op.outputs[0]
  if result.size != source.size or result.dtype != source.dtype:
    return False
  if op.primitive == "reshape":
    return op.params.get("dimensions") is None
  if op.primitive == "transpose":
    moved = [d for d in op.params["permutation"] if source.shape[d] != 1]
    return moved == sorted(moved)
  if op.primitive == "rev":
    return all(source.shape[d] == 1 for d in op.params["dimensions"])
  if op.primitive == "slice":
    return result.shape == source.shape and not any(op.params["start_indices"])
  return op.primitive in ("squeeze", "unstack", "broadcast_in_dim", *_SIZE_ONE_REDUCTIONS)


def cse_key(op: Op, name: Callable[[Value], Value] = lambda v: v) -> tuple | None:
  """What makes two ops one computation: primitive, params and inputs (``name`` maps a value to
  the value it equals); None for ops never merged (control flow, effects, stateful primitives)."""
  if op.merge_params is None:
    return None
  return op.merge_params, tuple(name(a).id if isinstance(a, Value)
                                else literal_identity(a.val, a.aval)
                                for a in op.inputs)


@functools.lru_cache(maxsize=4096)
def _aval_str(aval: Any) -> str:
  """``str(aval)``, which JAX formats slowly, once per distinct aval: literals compare by it
  (their avals may differ in a sharding that does not matter here)."""
  return str(aval)


def hashable_or_none(key: tuple) -> tuple | None:
  """``key`` if it can be hashed, else None (an op's params that do not compare, e.g. arrays)."""
  try:
    hash(key)
  except TypeError:
    return None
  return key


def names_mesh_axes(sharding: Any) -> bool:
  """Whether an op's ``sharding``/``out_sharding`` param names a mesh axis for some dim; one that
  names none (JAX writes ``P(None, ...)`` under an abstract mesh, or None) asks nothing."""
  return isinstance(sharding, NamedSharding) and any(
      entry not in (None, P.UNCONSTRAINED) for entry in sharding.spec.partitions)


def _canonical_slice(op: Op) -> dict[str, Any]:
  """A slice's params in the one form shared by every slice taking the same elements, as XLA's
  simplifier sees them: the limit just past the last element taken, stride 1 where one is."""
  shape, starts = op.outputs[0].shape, tuple(op.params["start_indices"])
  given = op.params["strides"] or (1,) * len(shape)
  strides = tuple(1 if n == 1 else s for n, s in zip(shape, given))
  limits = tuple(b + (n - 1) * s + 1 for b, n, s in zip(starts, shape, strides))
  return {"start_indices": starts, "limit_indices": limits, "strides": strides}


def literal_key(val: Any) -> Any:
  """A hashable stand-in for a literal's value (no repr: printing numpy values is slow)."""
  array = np.asarray(val)
  return (array.dtype.str, array.item()) if array.ndim == 0 else repr(val)


def literal_identity(val: Any, aval: Any) -> tuple:
  """What makes two literals one operand: value, dtype and aval (as printed)."""
  return ("literal", literal_key(val), _aval_str(aval))


def build_program(closed: jcore.ClosedJaxpr, platform: str) -> Program:
  """Builds the program of a traced function: calls and the branches of conds by a known index
  inlined, common subexpressions merged, constants folded, dynamic slices at literal starts made
  slices, rolls made one op, slices of pads made pads, slices of one piece of a concatenate made
  slices of it, dead ops dropped, loop invariants read from outside their loops, ops numbered
  depth-first. ``platform`` (as JAX lowers for it: "cpu", "cuda", "tpu") picks the branch of
  each platform-dependent cond."""
  builder = _Builder(platform)
  top = builder.region(closed)
  ops, outputs = _dedupe(*_inline_chosen_branches(top.ops, top.outputs))
  ops, outputs = _split_constants(ops, outputs)
  ops, folded = fold_constants(ops)
  folded += fold_region_empties(ops)
  _static_dynamic_slices(ops)
  fuse_rolls(ops)
  _merge_pad_slices(ops)
  _slices_of_one_piece(ops)
  program = Program(top.inputs, _hoist_invariants(_prune(ops, outputs)), outputs, ())
  for index, op in enumerate(program.all_ops()):
    op.index = index
  program.consts = (*builder.consts, *folded)
  return program
