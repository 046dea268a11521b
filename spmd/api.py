"""spmd.partition: trace → propagate → plan → lower, cached per argument avals and specs."""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import inspect
import itertools
import math
import numbers
import sys
import traceback
import warnings
from dataclasses import dataclass
from typing import Any, Callable, Iterator, Mapping, Sequence

import jax
import numpy as np
from jax.interpreters import ad, partial_eval
from jax.sharding import AxisType, Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from jax.tree_util import keystr, tree_flatten, tree_flatten_with_path, tree_unflatten

from spmd.logical import AxisRules, box_specs
from spmd.mesh import mesh_shape, with_auto_axes
from spmd.partition.annotation import restate_spec_error
from spmd.partition.ir import build_program, names_mesh_axes
from spmd.partition.jax_compat import (context_mesh, lowering_platform, trace_context,
                                       under_jit)
from spmd.partition.lower import lower_spmd
from spmd.partition.lower_xla import lower_xla
from spmd.partition.manual import restate_unbound_axis
from spmd.partition.planner import Analysis, Boundary, Planner
from spmd.partition.search import device_memory, search
from spmd.partition.sharding import TensorSharding, mesh_text, without_reductions
from spmd.plan import Plan

BACKENDS = ("spmd", "xla")


def partition(fun: Callable | None = None, *, mesh: Mesh | None = None, in_specs: Any = None,
              out_specs: Any = None, rules: Sequence[tuple[str, Any]] | None = None,
              static_argnums: int | Sequence[int] = (),
              donate_argnums: int | Sequence[int] = (), backend: str = "spmd",
              auto: bool = False, memory_limit: int | None = None,
              static_argnames: str | Sequence[str] = (),
              donate_argnames: str | Sequence[str] = ()) -> Any:
  """Partitions ``fun`` over ``mesh``: one SPMD program for every device.

  ``in_specs`` / ``out_specs`` are pytree prefixes of the (non-static) arguments / the outputs
  with ``PartitionSpec``, ``NamedSharding`` (on ``mesh``) or ``None`` (open: propagation chooses)
  leaves. An open argument committed to ``mesh`` keeps its sharding, as under ``jax.jit``; one
  boxed by flax (``nn.Partitioned``, ``nn.LogicallyPartitioned``) takes its box's names. Works as
  a decorator (``@partition(mesh=...)``) or a call (``partition(f, mesh=...)``).

  ``mesh=None``: each call takes the mesh of the ``jax.set_mesh`` context it is made in, as
  ``jax.jit`` does, else the one mesh of the ``NamedSharding`` leaves of ``in_specs`` /
  ``out_specs``; a call with neither is a TypeError.

  ``rules``: flax-style ``logical_axis_rules``, ``(logical_name, mesh_axes)`` pairs. A spec entry
  that is not a mesh axis is a logical name, resolved through them (in in_specs, out_specs, box
  names and annotations; flax's ``nn.with_logical_constraint`` inside ``fun`` resolves too).
  None: the rules of the flax context the call is made in (``nn.logical_axis_rules``), as
  ``jax.jit`` of a flax function resolves them.

  ``backend="spmd"`` (default) emits one ``jax.jit(jax.shard_map(...))`` program in which every
  collective is one spmd chose (the plan lists them exactly); ``backend="xla"`` jits the program
  with the propagated shardings as constraints and lets XLA's partitioner communicate.

  ``auto=True``: the open leaves of ``in_specs`` are chosen by a search over candidate shardings
  (``spmd/partition/search.py``) that minimises the plan's per-call bytes with the inputs' bytes
  per device at most ``memory_limit`` (None: the devices' memory where JAX reports it,
  ``memory_stats()["bytes_limit"]``; XLA:CPU reports none: no limit); ``plan.search`` says what
  it chose.
  Given specs, committed arguments and annotations are kept; open outputs follow propagation.

  ``static_argnames`` / ``donate_argnames`` name parameters as ``jax.jit``'s do: they add to
  ``static_argnums`` / ``donate_argnums`` (arguments passed by keyword are bound to positions).
  Keyword-only arguments (and ``**kwargs``) are traced, as under ``jax.jit``, with open specs
  (propagation or a committed sharding chooses), unless ``static_argnames`` names them.
  """
  if fun is None:
    return functools.partial(partition, mesh=mesh, in_specs=in_specs, out_specs=out_specs,
                             rules=rules, static_argnums=static_argnums,
                             donate_argnums=donate_argnums, backend=backend, auto=auto,
                             memory_limit=memory_limit, static_argnames=static_argnames,
                             donate_argnames=donate_argnames)
  static_nums, static_names = _argnums(fun, static_argnames, "static_argnames")
  donate_nums, donate_names = _argnums(fun, donate_argnames, "donate_argnames")
  static = _ints(static_argnums, "static_argnums") + static_nums
  donated = _ints(donate_argnums, "donate_argnums") + donate_nums
  on_mesh = functools.partial(Partitioned, fun, in_specs=in_specs, out_specs=out_specs,
                              static_argnums=tuple(dict.fromkeys(static)),
                              donate_argnums=tuple(dict.fromkeys(donated)), backend=backend,
                              rules=rules, auto=auto, memory_limit=memory_limit,
                              static_kwnames=static_names, donate_kwnames=donate_names)
  if mesh is None:
    return ContextMeshPartitioned(fun, on_mesh, _specs_mesh(in_specs, out_specs))
  return on_mesh(mesh)


@dataclass(frozen=True)
class _Compiled:
  analysis: Analysis
  fn: Callable         # the jitted program over flat leaves (no custom derivative)
  traced: Callable     # ``fn`` for traced leaves: in a jit without in_shardings
  call: Callable       # ``traced`` with a partitioned backward pass, for jax.grad / jax.vjp
  forward: Callable    # ``traced`` with a partitioned JVP, for jax.jvp / jacfwd (forward mode)
  out_tree: Any
  steady: bool         # called as compiled ahead of time: inputs split evenly, one process
  watched: tuple[int, ...]  # leaves whose plan depends on whether they arrive committed
  graph_out: bool      # the outputs hold NNX modules, flattened by nnx.to_tree
  in_tree: Any         # of the non-static arguments
  donated: tuple[int, ...]  # the donated ones, by position among the non-static arguments
  in_shardings: tuple[NamedSharding, ...] | None  # the inputs' (None: some are uneven, padded)
  out_shardings: tuple[NamedSharding, ...]  # the outputs' shardings, as jax.jit returns them

  def outputs(self, flat: Sequence[Any]) -> Any:
    """The function's outputs from the program's flat ones."""
    return self.rebuilt(tree_unflatten(self.out_tree, flat))

  def rebuilt(self, out: Any) -> Any:
    """The outputs' pytree with NNX modules rebuilt, their shared variables shared, as nnx.jit
    returns them."""
    return sys.modules["flax.nnx"].from_tree(out) if self.graph_out else out

  @functools.cached_property
  def whole(self) -> Any:
    """``fn`` as ``jax.jit`` of the user's function: called with the non-static arguments
    (pytrees), returning the outputs' pytree. What ``lower`` lowers and ``executable``
    compiles (one program: a compiled one is reused). Only for even inputs."""
    def whole(*dyn: Any) -> Any:
      return tree_unflatten(self.out_tree, self.fn(*jax.tree_util.tree_leaves(dyn)))

    return jax.jit(whole, in_shardings=tuple(tree_unflatten(self.in_tree, self.in_shardings)),
                   out_shardings=tree_unflatten(self.out_tree, self.out_shardings),
                   donate_argnums=self.donated)

  @functools.cached_property
  def lowered(self) -> jax.stages.Lowered:
    """``whole`` lowered for its inputs' avals (its in_shardings fixed): one lowering for
    ``executable`` and ``lower`` whether the arguments arrive committed or not (JAX keys its
    cache of lowerings by the arguments' types, and a committed array's type names its mesh),
    so that ``lower(...).compile()`` finds the program a call compiled."""
    return self.whole.lower(*tree_unflatten(self.in_tree, [
        jax.ShapeDtypeStruct(v.aval.shape, v.aval.dtype, weak_type=v.aval.weak_type)
        for v in self.analysis.program.inputs]))

  @functools.cached_property
  def executable(self) -> jax.stages.Compiled:
    """``lowered`` compiled: a call checks its arguments' shapes, dtypes and committed
    shardings itself (in C++, as ``jax.jit`` does) and raises rather than retraces on a
    mismatch."""
    return self.lowered.compile()

  def execute(self, leaves: Sequence[Any]) -> Any:
    """``executable``'s outputs (their pytree, before ``rebuilt``) for the arguments' flat
    leaves."""
    return self.executable(*tree_unflatten(self.in_tree, leaves))


@dataclass(frozen=True)
class _Differentiated:
  """A program's inputs and outputs that derivatives flow through (inexact ones, by position),
  and every input's and output's spec."""
  in_specs: tuple[P, ...]
  out_specs: tuple[P, ...]
  in_diff: tuple[int, ...]
  out_diff: tuple[int, ...]

  @staticmethod
  def of(analysis: Analysis) -> _Differentiated:
    program = analysis.program
    return _Differentiated(
        tuple(s.to_spec() for s in analysis.schedule.inputs),
        tuple(s.to_spec() for s in analysis.schedule.outputs),
        tuple(i for i, v in enumerate(program.inputs) if _inexact(v.aval)),
        tuple(j for j, x in enumerate(program.outputs) if _inexact(x.aval)))

  def of_differentiated(self, flat_fun: Callable, others: Sequence[Any]) -> Callable:
    """``flat_fun`` of the differentiated inputs, the ``others`` fixed."""
    def f(*diff: Any) -> list:
      full = list(others)
      for i, x in zip(self.in_diff, diff):
        full.insert(i, x)
      return flat_fun(*full)
    return f


@dataclass(frozen=True)
class _Steady:
  """What a call with a known argument structure tries first: ``compiled.executable`` on its
  leaves, when what that executable does not check and the plan depends on is as it was: the
  leaves' types (a tracer, a Python scalar), which are weakly typed, and which of
  ``compiled.watched`` are committed."""
  compiled: _Compiled
  types: tuple[type, ...]
  weak: tuple[bool, ...]
  committed: tuple[bool, ...]
  arrays: tuple[int, ...]  # the leaves that are JAX arrays

  @staticmethod
  def of(compiled: _Compiled, leaves: Sequence[Any]) -> _Steady:
    return _Steady(compiled, tuple(map(type, leaves)), _weak_types(leaves),
                   tuple(_committed(leaves[i]) for i in compiled.watched),
                   tuple(i for i, x in enumerate(leaves) if isinstance(x, jax.Array)))

  def call(self, leaves: Sequence[Any]) -> Any:
    """The outputs' pytree (as ``_Compiled.execute``), or ``_MISSED`` where the arguments need
    the full path (other avals, shardings or types, a deleted buffer: the full path says
    which)."""
    if (tuple(map(type, leaves)) != self.types or _weak_types(leaves) != self.weak
        or tuple(_committed(leaves[i]) for i in self.compiled.watched) != self.committed
        or any(leaves[i].is_deleted() for i in self.arrays)):  # JAX 0.10 crashes on those
      return _MISSED
    try:
      return self.compiled.execute(leaves)
    except (TypeError, ValueError):  # raised by the argument check, before anything runs
      return _MISSED


_MISSED = object()  # a steady call that needs the full path (None is a valid output tree)


@contextlib.contextmanager
def _collector_paused() -> Iterator[None]:
  """Python's cyclic garbage collector paused: a build allocates millions of small objects that
  all live until it returns (the jaxpr, the program, shardings, the schedule), which the
  collector would otherwise rescan over and over (a fifth of a build's CPU at 8 layers). Cycles
  made meanwhile (JAX's tracers) are collected once it resumes."""
  enabled = gc.isenabled()
  gc.disable()
  try:
    yield
  finally:
    if enabled:
      gc.enable()


class ContextMeshPartitioned:
  """``partition`` without ``mesh=``: partitioned over the mesh each call finds (the
  ``jax.set_mesh`` context's, else the specs' ``NamedSharding`` mesh), one ``Partitioned`` per
  mesh."""

  def __init__(self, fun: Callable, on_mesh: Callable[[Mesh], Partitioned],
               specs_mesh: Mesh | None):
    self._on_mesh, self._specs_mesh = on_mesh, specs_mesh
    self._per_mesh: dict[Mesh, Partitioned] = {}
    functools.update_wrapper(self, fun)

  def __call__(self, *args: Any, **kwargs: Any) -> Any:
    return self.partitioned(args, kwargs)(*args, **kwargs)

  def plan(self, *args: Any, **kwargs: Any) -> Plan:
    """The plan over the mesh a call made here would use (see ``Partitioned.plan``)."""
    return self.partitioned(args, kwargs).plan(*args, **kwargs)

  def lower(self, *args: Any, **kwargs: Any) -> jax.stages.Lowered:
    """The program lowered over the mesh a call made here would use (``Partitioned.lower``)."""
    return self.partitioned(args, kwargs).lower(*args, **kwargs)

  def partitioned(self, args: tuple = (), kwargs: Mapping[str, Any] | None = None
                  ) -> Partitioned:
    """The function partitioned over the mesh found here: the ``jax.set_mesh`` context's, else
    the specs' ``NamedSharding`` mesh, else the one mesh ``args`` are committed to (as
    ``jax.jit`` runs where its committed arguments are)."""
    context = context_mesh()
    mesh = self._specs_mesh if context.empty else context
    if mesh is None:
      mesh = _committed_mesh((args, kwargs or {}))
    if mesh is None:
      raise TypeError("spmd.partition: no mesh: pass mesh=, call inside jax.set_mesh(mesh), "
                      "give in_specs / out_specs as NamedShardings, or pass arrays committed "
                      "to a mesh")
    if mesh not in self._per_mesh:
      self._per_mesh[mesh] = self._on_mesh(mesh)
    return self._per_mesh[mesh]


class Partitioned:
  """A partitioned function: call it, or ask for its ``plan`` / ``lower`` without running it."""

  def __init__(self, fun: Callable, mesh: Mesh, in_specs: Any, out_specs: Any,
               static_argnums: tuple[int, ...], donate_argnums: tuple[int, ...], backend: str,
               rules: Sequence[tuple[str, Any]] | None = None, auto: bool = False,
               memory_limit: int | None = None, static_kwnames: tuple[str, ...] = (),
               donate_kwnames: tuple[str, ...] = ()):
    if not callable(fun):
      raise TypeError(f"spmd.partition: fun must be callable, got {fun!r}")
    if not isinstance(mesh, Mesh):
      raise TypeError(f"spmd.partition: mesh must be a jax.sharding.Mesh (see spmd.make_mesh), "
                      f"got {type(mesh).__name__}")
    if backend not in BACKENDS:
      raise ValueError(f"spmd.partition: backend must be one of {BACKENDS}, got {backend!r}")
    self.fun, self.mesh, self.backend = fun, mesh, backend
    self.in_specs, self.out_specs = in_specs, out_specs
    self.auto, self.memory_limit = auto, memory_limit
    self.static_argnums, self.donate_argnums = static_argnums, donate_argnums
    self.static_kwnames, self.donate_kwnames = static_kwnames, donate_kwnames
    self._mesh_shape = mesh_shape(mesh)
    self._given_rules = None if rules is None else AxisRules.of(rules, mesh.axis_names)
    self._cache: dict[Any, _Compiled] = {}
    # by argument structure, avals, static values and rules: a new committed sharding of the
    # same avals plans again without tracing again, as jax.jit compiles again without tracing
    self._traces: dict[Any, tuple] = {}
    self._dispatch: dict[Any, _Compiled] = {}  # by argument structure, avals, shardings
    self._steady: dict[Any, _Steady] = {}  # by argument structure and static values
    self._graph_calls: dict[Any, Partitioned] = {}
    self._keyword_calls: dict[Any, Partitioned] = {}
    functools.update_wrapper(self, fun)

  @property
  def _rules(self) -> AxisRules:
    """``rules=`` as given, else the rules of the flax context the call is made in."""
    if self._given_rules is not None:
      return self._given_rules
    return AxisRules.ambient(self.mesh.axis_names)

  def __call__(self, *args: Any, **kwargs: Any) -> Any:
    if kwargs:
      target, args = self._bound(args, kwargs)  # NNX modules passed by keyword are updated too
      if target is not self:
        return target(*args)
    if _graph_node_positions(args):
      pure, pure_args, nodes = self._over_graph_state(args)
      out, state = pure(*pure_args)
      sys.modules["flax.nnx"].update(nodes, state)  # the modules' updates, as nnx.jit does
      return out
    structure, leaves = _structure(args, self.static_argnums)
    staged = under_jit()  # on its arguments, concrete ones too (as of a jit closing over them)
    if staged:
      structure = None
    if structure is not None:
      structure = (structure, self._rules.rules, _in_mesh_context(self.mesh), trace_context())
    steady = self._steady.get(structure) if structure is not None else None
    if steady is not None:
      out = steady.call(leaves)
      if out is not _MISSED:
        return steady.compiled.rebuilt(out)
    key = _dispatch_key(structure, leaves) if structure is not None else None
    compiled = self._dispatch.get(key) if key is not None else None
    if compiled is None:
      compiled, leaves = self._compile(args)
      # Only traced or staged arguments are differentiated: eager calls on concrete ones skip
      # the custom_vjp wrapper.
      if staged or any(isinstance(leaf, jax.core.Tracer) for leaf in leaves):
        if _only_partial_eval(leaves):
          # jax.linear_transpose traces the call with unknown inputs, and has no transpose
          # for a custom_vjp: JAX's own rules transpose the partitioned program.
          return compiled.outputs(self._run_traced(compiled, compiled.traced, leaves))
        # Forward mode (jax.jvp, jacfwd, hessian), which JAX refuses through a custom_vjp: the
        # original function's JVP, partitioned. Seen on the leaves (JVP tracers), or raised by
        # JAX for a JVP outside another transformation's (jacfwd of jacrev: a linearization).
        if not any(isinstance(leaf, ad.JVPTracer) for leaf in leaves):
          try:
            return compiled.outputs(self._run_traced(compiled, compiled.call, leaves))
          except TypeError as e:
            if not _refuses_forward_mode(e):
              raise
        return compiled.outputs(self._run_traced(compiled, compiled.forward, leaves))
      if key is not None:
        self._dispatch[key] = compiled
    leaves = self._placed(compiled.analysis, leaves)
    if compiled.steady and key is not None:
      self._steady[structure] = _Steady.of(compiled, leaves)
      return compiled.rebuilt(compiled.execute(leaves))
    return compiled.outputs(compiled.fn(*leaves))

  def _run_traced(self, compiled: _Compiled, run: Callable, leaves: Sequence[Any]) -> Any:
    """``run(*leaves)`` for traced leaves. Staged (under ``jax.jit``) inside ``jax.set_mesh`` of
    this mesh with Explicit axes, its results are typed on that mesh as the program returns
    them: the program runs over the mesh's Auto twin (``jax.sharding.auto_axes``), whose types
    JAX refuses to mix with the context's. (Eager transformations see the results' concrete
    values, already placed on the mesh.)"""
    context = jax.sharding.get_abstract_mesh()
    if (context.empty or not context.explicit_axes
        or context.axis_names != self.mesh.axis_names or not under_jit()):
      return run(*leaves)
    return jax.sharding.auto_axes(lambda *flat: tuple(run(*flat)), out_sharding=tuple(
        NamedSharding(self.mesh, _typed_part(s, self.mesh))
        for s in compiled.analysis.schedule.outputs))(*leaves)

  def plan(self, *args: Any, **kwargs: Any) -> Plan:
    """The partitioned program's plan for these arguments (abstract values suffice)."""
    target, args = self._bound(args, kwargs)
    if target is not self:
      return target.plan(*args)
    if _graph_node_positions(args):
      pure, pure_args, _ = self._over_graph_state(args)
      return pure.plan(*pure_args)
    return self._compile(args)[0].analysis.plan

  def lower(self, *args: Any, **kwargs: Any) -> jax.stages.Lowered:
    """The program lowered as ``jax.jit`` lowers: ``.compile()`` gives a ``jax.stages.Compiled``
    called with the non-static arguments (pytrees, as here) that returns the outputs' pytree.
    With uneven inputs (which JAX cannot take), the program over their padded flat leaves."""
    target, args = self._bound(args, kwargs)
    if target is not self:
      return target.lower(*args)
    if _graph_node_positions(args):
      pure, pure_args, _ = self._over_graph_state(args)
      return pure.lower(*pure_args)
    compiled, leaves = self._compile(args)
    if compiled.in_shardings is None:
      return compiled.fn.lower(*self._placed(compiled.analysis, leaves))
    return compiled.lowered

  # --- NNX modules as arguments ----------------------------------------------------------------

  def _over_graph_state(self, args: tuple) -> tuple[Partitioned, tuple, tuple]:
    """NNX modules (graph nodes) among ``args``, as under ``nnx.jit``: the function is
    partitioned over their joint state (shared variables stay shared) and returns the state it
    leaves them in, to be written back. Returns (that partitioned function, its arguments, the
    modules)."""
    nnx = sys.modules["flax.nnx"]
    positions = _graph_node_positions(args)
    if set(positions) & _positions(self.static_argnums, len(args)):
      raise TypeError("spmd.partition: an NNX module cannot be a static argument")
    nodes = tuple(args[i] for i in positions)
    graphdef, state = nnx.split(nodes)
    others = tuple(a for i, a in enumerate(args) if i not in positions)
    key = (positions, len(args), graphdef)
    if key not in self._graph_calls:
      self._graph_calls[key] = self._pure_over_state(nnx, graphdef, state, positions, len(args))
    return self._graph_calls[key], (state, *others), nodes

  def _pure_over_state(self, nnx: Any, graphdef: Any, state: Any, positions: tuple[int, ...],
                       count: int) -> Partitioned:
    fun = self.fun

    def pure(state: Any, *others: Any) -> tuple[Any, Any]:
      nodes, rest = nnx.merge(graphdef, state), iter(others)
      out = fun(*[nodes[positions.index(i)] if i in positions else next(rest)
                  for i in range(count)])
      return out, nnx.state(nodes)

    kept = _positions(self.static_argnums, count)
    dynamic = [i for i in range(count) if i not in kept]  # in_specs name these, as without NNX
    spec_of = dict(zip(dynamic, self._specs_per_argument(len(dynamic))))
    # a module's spec given as an nnx.State (nnx.get_partition_spec / get_named_sharding of
    # nnx.state(model)) is held as the joint state holds each module's: its nested mapping
    state_specs = type(state)({k: _raw_state(nnx, spec_of[i])
                               for k, i in zip(state.keys(), positions)})
    in_specs = (state_specs, *(spec_of[i] for i in dynamic if i not in positions))
    def position(i: int) -> int:  # of argument i among pure's: the state, then the others
      return 1 + sum(1 for j in range(i) if j not in positions)

    static = tuple(position(i) for i in sorted(kept))
    donated = _positions(self.donate_argnums, count)
    # the modules' joint state is donated where every module is, as nnx.jit donates a module's
    donate = ((0,) if set(positions) <= donated else ()) + tuple(
        position(i) for i in sorted(donated) if i not in positions)
    return Partitioned(pure, self.mesh, in_specs, (self.out_specs, state_specs), static, donate,
                       self.backend, self._rules_as_given, self.auto, self.memory_limit)

  # --- tracing and caching -------------------------------------------------------------------

  def _compile(self, args: tuple) -> tuple[_Compiled, list]:
    names = self._arg_names(len(args))
    limit = max(len(args), self._positional_parameters())
    for i in self.static_argnums + self.donate_argnums:
      if not -limit <= i < limit:
        raise ValueError(f"spmd.partition: argnum {i} is out of range for {len(args)} arguments")
    static = _positions(self.static_argnums, len(args))
    statics = tuple((i, args[i]) for i in sorted(static))
    for i, value in statics:
      try:
        hash(value)
      except TypeError:
        raise TypeError(f"spmd.partition: static argument {names[i]} must be hashable, got "
                        f"{type(value).__name__}") from None
    dyn_idx = [i for i in range(len(args)) if i not in static]
    dyn = tuple(args[i] for i in dyn_idx)
    with_paths, in_tree = tree_flatten_with_path(dyn)
    leaves = [leaf for _, leaf in with_paths]
    leaf_names = [names[dyn_idx[path[0].idx]] + keystr(path[1:]) for path, _ in with_paths]
    for name, leaf in zip(leaf_names, leaves):
      _check_leaf(name, leaf)
    avals = tuple(jax.typeof(leaf) for leaf in leaves)
    requested = self._requested_specs(dyn, len(leaves))
    # A traced argument's type (under jax.jit) is its sharding on a mesh of Explicit axes, as a
    # committed array's is eagerly. On a mesh mixing Auto axes it names only the Explicit ones:
    # an open leaf takes it as a spec whose whole dims stay open to the Auto axes (_build).
    # (An eager jax.grad's tracers wrap the concrete arrays, whose shardings are whole.)
    concrete = [_concrete(leaf) for leaf in leaves]
    typed = [_traced_type(leaf, self.mesh) if c is None else None
             for leaf, c in zip(leaves, concrete)]
    mixed = bool(self.mesh.auto_axes)
    given = tuple(self._whole_size_one_dims(
        self._sharding(t if spec is None and mixed else spec, aval.shape,
                       f"in_specs for argument {name}"), aval.shape,
        f"in_specs for argument {name}")
        for spec, t, aval, name in zip(requested, typed, avals, leaf_names))
    committed = tuple(_committed_spec(c, self.mesh) for c in concrete)
    arrivals = tuple(self._sharding(t if t is not None and not mixed else c, aval.shape,
                                    f"the sharding of argument {name}")
                     for c, t, aval, name in zip(committed, typed, avals, leaf_names))
    key = (in_tree, avals, statics, given, arrivals, committed, self._rules.rules,
           _in_mesh_context(self.mesh), trace_context())
    if key not in self._cache:
      labels = [name + (f" as {spec}" if _names_logical(spec, self.mesh) else "")
                for name, spec in zip(leaf_names, requested)]
      # auto=True ties open leaves by shape, dtype and last pytree key
      ties = tuple((aval.shape, aval.dtype, path[-1]) for (path, _), aval in zip(with_paths, avals))
      self._cache[key] = self._build(args, statics, dyn_idx, in_tree, avals, labels, given,
                                     arrivals, ties, requested, committed)
    return self._cache[key], leaves

  @_collector_paused()
  def _build(self, args: tuple, statics: tuple, dyn_idx: list[int], in_tree: Any, avals: tuple,
             leaf_names: list[str], given: tuple, arrivals: tuple,
             ties: tuple, requested: list, committed: tuple) -> _Compiled:
    out_store: list[Any] = []

    def flat_fun(*flat: Any) -> list:
      full = list(args)
      for i, value in zip(dyn_idx, tree_unflatten(in_tree, flat)):
        full[i] = value
      out, graph_out = _graph_as_tree(self.fun(*full))
      out_leaves, out_tree = tree_flatten(out)
      out_store.append((out_tree, graph_out))
      return out_leaves

    explicit = AxisType.Explicit in self.mesh.axis_types
    trace_key = (in_tree, tuple((a.shape, a.dtype, a.weak_type) for a in avals), statics,
                 self._rules.rules, (avals, given, arrivals) if explicit else None,
                 trace_context())
    if trace_key not in self._traces:
      self._traces[trace_key] = (*self._trace(flat_fun, avals, given, arrivals), *out_store[-1])
    closed, types, out_tree, graph_out = self._traces[trace_key]
    program = build_program(closed, lowering_platform(self.mesh.devices.flat[0]))
    requests, open_axes = self._out_requests(out_tree, program, types)
    outputs = self._output_specs(requests, out_tree, program)
    # an input given a spec that in_specs left open took its type's (_compile)
    typed_open = tuple(self.mesh.auto_axes if r is None and g is not None else ()
                       for r, g in zip(requested, given))
    boundary = Boundary(given, tuple(leaf_names), outputs, arrivals, typed_open, open_axes)
    planner = Planner(program, self._mesh_shape, platform=self.mesh.devices.flat[0].platform,
                      resolve=self._rules.resolve, backend=self.backend,
                      name=getattr(self.fun, "__name__", "f"), in_tree=in_tree,
                      out_tree=out_tree)
    if self.auto:
      limit, source = self.memory_limit, "memory_limit"
      if limit is None:
        limit = device_memory(self.mesh.devices.flat)
        source = "device memory" if limit is not None else "none"
      analysis, report = search(boundary, ties, planner, limit, source)
      analysis = dataclasses.replace(analysis,
                                     plan=dataclasses.replace(analysis.plan, search=report))
    else:
      analysis = planner.analyze(boundary)
    donated = self._donated_leaves(args, dyn_idx, in_tree)
    lower = lower_spmd if self.backend == "spmd" else lower_xla
    # an open leaf is spelled as it is committed, as jax.jit spells its input (and the outputs
    # sharded alike) so
    spelled = [r if r is not None else c for r, c in zip(requested, committed)]
    in_shardings = tuple(self._spelled(r, s, len(v.shape)) for r, s, v in
                         zip(spelled, analysis.schedule.inputs, program.inputs))
    # jax.jit's in_shardings as given, else as committed (a committed argument sharded otherwise
    # is resharded here, where jax.jit refuses it), whose spelling an output sharded alike takes
    # where JAX types the outputs on the mesh: under set_mesh, or from committed arguments
    typed = _in_mesh_context(self.mesh) or any(a is not None for a in arrivals)
    first = next(((self._spelled(r, a if g is None else g, len(v.shape)), len(v.shape))
                  for r, g, a, v in zip(spelled, given, arrivals, program.inputs)
                  if r is not None),
                 None) if typed else None
    out_shardings = tuple(self._returned(r, s, len(x.aval.shape), first,
                                         _typed_on(x.aval, self.mesh))
                          for r, s, x in zip(requests, analysis.schedule.outputs, program.outputs))
    # the inputs' cotangents, as jax.grad of jax.jit returns them: sharded as in_specs ask (a
    # committed argument arriving otherwise included), spelled so, else as inferred
    cotangents = tuple(self._spelled(r, s if g is None or a is None else g, len(v.shape))
                       for r, g, a, s, v in zip(requested, given, arrivals,
                                                analysis.schedule.inputs, program.inputs))
    fn = lower(analysis, self.mesh, donated, out_shardings)
    even = all(s.divides(v.shape, self._mesh_shape)
               for s, v in zip(analysis.schedule.inputs, program.inputs))
    steady = even and not self.mesh.is_multi_process
    # An open leaf is seeded by its committed sharding; a committed leaf sharded otherwise than
    # its spec is resharded on entry. Either way the plan depends on whether it is committed.
    watched = tuple(i for i, (spec, arrival) in enumerate(zip(given, arrivals))
                    if spec is None or arrival not in (None, spec))
    donated_args = _positions(self.donate_argnums, len(args))
    # Traced leaves (under jax.vmap, say) hide their committed shardings, which jax.jit's
    # in_shardings would refuse where they differ: inside a jit without in_shardings, the
    # program's in_shardings constrain its operands instead (XLA reshards them on entry).
    traced = jax.jit(fn)
    return _Compiled(analysis, fn, traced,
                     self._differentiable(fn, traced, flat_fun, analysis, cotangents),
                     self._forward(traced, flat_fun, analysis),
                     out_tree, steady, watched, graph_out, in_tree,
                     tuple(k for k, i in enumerate(dyn_idx) if i in donated_args),
                     in_shardings if even else None, out_shardings)

  def _trace(self, flat_fun: Callable, avals: tuple, given: tuple,
             arrivals: tuple) -> tuple[Any, tuple[NamedSharding, ...] | None]:
    """The function's closed jaxpr and, on an Explicit mesh, its outputs' types. Traced under
    the mesh (its own axis types: bare-spec constraints and Explicit-mode ``out_sharding=``
    trace); on an Auto mesh on avals without shardings (a committed argument's sharding is a
    spec like any other), on an Explicit one typed as jax.jit types committed arguments where
    JAX's typing takes the function."""
    unsharded = [jax.ShapeDtypeStruct(a.shape, a.dtype, weak_type=a.weak_type) for a in avals]
    with jax.sharding.use_abstract_mesh(self.mesh.abstract_mesh), self._rules.context():
      try:
        closed, refusal = self._trace_typed(flat_fun, avals, given, arrivals)
        if closed is not None:
          return closed, tuple(NamedSharding(self.mesh, without_reductions(a.sharding.spec))
                               for a in closed.out_avals)
        try:
          return jax.make_jaxpr(flat_fun)(*unsharded), None
        except Exception as untyped:  # noqa: BLE001
          if refusal is None:
            raise
          # jax.jit's error: values typed by out_sharding= mix with untyped ones in the fallback
          raise refusal from untyped
      except Exception as e:  # noqa: BLE001 (JAX's spec checks raise more than ValueError)
        clearer = restate_spec_error(e, self._mesh_shape) or restate_unbound_axis(e)
        if clearer is None:
          raise
        raise clearer from None

  def _differentiable(self, fn: Callable, traced: Callable, flat_fun: Callable,
                      analysis: Analysis, cotangents: tuple[NamedSharding, ...]) -> Callable:
    """``fn`` whose VJP is the VJP of the original function, partitioned the same way (inputs'
    cotangents sharded like the inputs, outputs' like the outputs). The inputs' cotangents come
    back with ``cotangents`` (as ``jax.grad`` of ``jax.jit`` returns them)."""
    d = _Differentiated.of(analysis)
    in_specs, out_specs, in_diff, out_diff = d.in_specs, d.out_specs, d.in_diff, d.out_diff
    program = analysis.program
    backward: list[Partitioned] = []

    def pullback(primals: list, others: list, cts: list) -> list:
      _, vjp = jax.vjp(d.of_differentiated(flat_fun, others), *primals)
      all_cts = [np.zeros(x.aval.shape, jax.dtypes.float0) for x in program.outputs]
      for j, ct in zip(out_diff, cts):
        all_cts[j] = ct
      return list(vjp(all_cts))

    @jax.custom_vjp
    def call(*leaves: Any) -> Any:
      return traced(*leaves)

    def fwd(*leaves: Any) -> tuple:
      if any(isinstance(x, jax.core.Tracer) for x in leaves):  # under another transformation
        return traced(*leaves), leaves  # (an eager vmap: jax.hessian's) as the call runs
      # Under an eager jax.grad the primals are concrete: one committed with another sharding
      # than the program's input is placed first (a traced call cannot see its sharding).
      placed = [jax.device_put(x, NamedSharding(with_auto_axes(self.mesh), spec))
                if _committed_spec(x, self.mesh) not in (None, spec)
                and s.divides(v.shape, self._mesh_shape) else x
                for x, spec, s, v in zip(leaves, in_specs, analysis.schedule.inputs,
                                         program.inputs)]
      return fn(*self._placed(analysis, placed)), leaves

    def bwd(leaves: tuple, cts: tuple) -> tuple:
      if not backward:
        backward.append(Partitioned(
            pullback, self.mesh,
            ([in_specs[i] for i in in_diff],
             [s for i, s in enumerate(in_specs) if i not in in_diff],
             [out_specs[j] for j in out_diff]),
            [cotangents[i] for i in in_diff], (), (), self.backend))
      # leaves typed on the mesh's Auto twin (by _run_traced, under an Explicit context): the
      # backward program runs there too, so the gradients come back typed as the leaves are
      with _on_leaves_mesh(leaves):
        grads = backward[0]([leaves[i] for i in in_diff],
                            [x for i, x in enumerate(leaves) if i not in in_diff],
                            [cts[j] for j in out_diff])
      out = [np.zeros(np.shape(x), jax.dtypes.float0) for x in leaves]
      for i, g in zip(in_diff, grads):
        out[i] = _typed_like(g, leaves[i])
      return tuple(out)

    call.defvjp(fwd, bwd)
    return call

  def _forward(self, traced: Callable, flat_fun: Callable, analysis: Analysis) -> Callable:
    """``traced`` whose JVP is the JVP of the original function, partitioned the same way
    (tangents sharded as their primals): forward mode (jax.jvp, jacfwd, hessian), which JAX
    refuses through ``_differentiable``'s custom_vjp, then honours the function's custom_jvp
    rules and linear solves, which the partitioned program has inlined as their primal bodies."""
    d = _Differentiated.of(analysis)
    in_specs, out_specs, in_diff, out_diff = d.in_specs, d.out_specs, d.in_diff, d.out_diff
    program = analysis.program
    forward: list[Partitioned] = []

    def pushforward(primals: list, others: list, tangents: list) -> tuple[list, list]:
      outs, out_tangents = jax.jvp(d.of_differentiated(flat_fun, others), tuple(primals),
                                   tuple(tangents))
      return list(outs), [out_tangents[j] for j in out_diff]

    @jax.custom_jvp
    def call(*leaves: Any) -> Any:
      return traced(*leaves)

    @call.defjvp
    def jvp(leaves: tuple, tangents: tuple) -> tuple:
      if not forward:
        diff_specs = [in_specs[i] for i in in_diff]
        forward.append(Partitioned(
            pushforward, self.mesh,
            (diff_specs, [s for i, s in enumerate(in_specs) if i not in in_diff], diff_specs),
            (list(out_specs), [out_specs[j] for j in out_diff]), (), (), self.backend))
      with _on_leaves_mesh(leaves):
        outs, diff_tangents = forward[0]([leaves[i] for i in in_diff],
                                         [x for i, x in enumerate(leaves) if i not in in_diff],
                                         [tangents[i] for i in in_diff])
      out_tangents = [np.zeros(x.aval.shape, jax.dtypes.float0) for x in program.outputs]
      for j, t in zip(out_diff, diff_tangents):
        out_tangents[j] = t
      return outs, out_tangents

    return call

  def _placed(self, analysis: Analysis, leaves: Sequence[Any]) -> Sequence[Any]:
    """The arguments as the program takes them. Arrays committed off the mesh (to one device,
    or to a mesh of other devices or another device order), which the plan took as
    uncommitted, are copied onto it as their input's sharding, as numpy arguments are (jax.jit
    refuses most of them). On a mesh spanning several processes, numpy arguments as global
    arrays: each process holds the whole value (as a script written for one process computes
    it) and places the shards its own devices hold, padded where uneven (``jax.jit`` takes
    numpy there only replicated)."""
    mesh = with_auto_axes(self.mesh)
    leaves = [_onto(x, NamedSharding(mesh, s.to_spec()), s.divides(v.aval.shape, self._mesh_shape))
              if _off_mesh(x, self.mesh) else x
              for x, s, v in zip(leaves, analysis.schedule.inputs, analysis.program.inputs)]
    if not self.mesh.is_multi_process:
      return leaves
    return [_global_array(x, s, v.aval.dtype, mesh) if isinstance(x, np.ndarray) and x.ndim
            else x for x, s, v in zip(leaves, analysis.schedule.inputs, analysis.program.inputs)]

  # --- specs -----------------------------------------------------------------------------------

  def _requested_specs(self, dyn: tuple, count: int) -> list[P | NamedSharding | None]:
    """Per leaf, the spec in_specs gives, else its flax box's names; None: open (a committed
    argument's own sharding then seeds it)."""
    given = ([None] * count if self.in_specs is None else
             _broadcast_prefix(self.in_specs, dyn, "in_specs", "arguments"))
    return [g if g is not None else boxed for g, boxed in zip(given, box_specs(dyn))]

  def _trace_typed(self, flat_fun: Callable, avals: tuple, given: tuple,
                   arrivals: tuple) -> tuple[Any, Exception | None]:
    """On a mesh with Explicit axes, the function's jaxpr as ``jax.jit`` traces it for arguments
    committed as their specs say (else as they are committed): their types carry the
    shardings, so ``jax.typeof`` inside, the shardings JAX infers into the ops' params and the
    outputs' types are jax.jit's. None where the mesh has no Explicit axis or JAX's typing
    refuses the function (contracting dims sharded alike without ``out_sharding=``, an uneven
    spec): spmd then traces it untyped and partitions it all the same. With it, the refusal
    (jax.jit's error), or None."""
    if AxisType.Explicit not in self.mesh.axis_types:
      return None, None
    try:
      typed = [jax.ShapeDtypeStruct(a.shape, a.dtype, weak_type=a.weak_type,
                                    sharding=None if s is None else
                                    NamedSharding(self.mesh, s.to_spec()))
               for a, g, r in zip(avals, given, arrivals) for s in [g if g is not None else r]]
      return jax.make_jaxpr(flat_fun)(*typed), None
    except Exception as refusal:  # noqa: BLE001 (JAX's typing raises several kinds)
      return None, refusal

  def _out_requests(self, out_tree: Any, program: Any,
                    types: tuple[NamedSharding, ...] | None
                    ) -> tuple[list[P | NamedSharding | None], tuple[tuple[str, ...], ...]]:
    """Per output, its out_specs entry, else its type's sharding on a mesh with Explicit axes
    (as ``jax.jit`` returns it; None: open), and the mesh axes left to propagation on the dims
    it leaves whole: a type names only the Explicit axes, and jax.jit shards it over the Auto
    ones as it propagates (``Boundary.output_open_axes``)."""
    given = [None] * out_tree.num_leaves
    if self.out_specs is not None:
      outs = tree_unflatten(out_tree, [a.aval for a in program.outputs])
      given = _broadcast_prefix(self.out_specs, outs, "out_specs", "outputs")
    if types is None:
      return given, ((),) * len(given)
    return ([g if g is not None else t for g, t in zip(given, types)],
            tuple(() if g is not None else self.mesh.auto_axes for g in given))

  def _output_specs(self, requests: list[P | NamedSharding | None], out_tree: Any,
                    program: Any) -> tuple[TensorSharding | None, ...]:
    """Per output, its request (``_out_requests``) as a sharding."""
    outs = tree_unflatten(out_tree, [a.aval for a in program.outputs])
    paths = [keystr(p) for p, _ in tree_flatten_with_path(outs)[0]]
    return tuple(self._sharding(spec, atom.aval.shape, f"out_specs for output {path or '0'}")
                 for spec, atom, path in zip(requests, program.outputs, paths))

  def _returned(self, given: P | NamedSharding | None, s: TensorSharding, ndim: int,
                first: tuple[NamedSharding, int] | None, typed: bool) -> NamedSharding:
    """The sharding an output comes back with, as from ``jax.jit``: on the user's mesh, its
    request (``_out_requests``: its out_specs entry as given, logical names resolved) where
    the program makes that sharding ``s``, else ``s`` as JAX spells a sharding it infers: one
    entry per dim on a mesh with Explicit axes where it names none of the Auto ones (it is then
    the output's type), else the ``first`` input's sharding as jax.jit's in_shardings spell it
    where the output has its rank, is sharded alike and is ``typed`` on this mesh (JAX recovers
    the user's spelling so where it types outputs on the mesh, under ``jax.set_mesh`` of it or
    from committed arguments: pxla's ``maybe_recover_user_shardings``; ``first`` is None
    elsewhere; a sort's result type has no mesh), else without trailing Nones."""
    made = self._spelled(given, s, ndim)
    if (given is None and AxisType.Explicit not in self.mesh.axis_types and first is not None
        and first[1] == ndim and typed and first[0].is_equivalent_to(made, ndim)):
      return first[0]
    return made

  def _spelled(self, given: P | NamedSharding | None, s: TensorSharding,
               ndim: int) -> NamedSharding:
    """Sharding ``s`` on the user's mesh as ``jax.jit`` spells it: ``given`` (a spec or
    sharding, logical names resolved as flax's logical_to_mesh_sharding does) where it is
    ``s``, else as JAX spells one it infers (see ``_returned``)."""
    typed = self.mesh.explicit_axes and not set(self.mesh.auto_axes) & set(s.axes)
    made = NamedSharding(self.mesh, s.to_spec() if typed else _trimmed(s.to_spec()))
    if isinstance(given, P):
      given = NamedSharding(self.mesh, self._rules.resolve(given, "specs"))
    return (given if isinstance(given, NamedSharding) and given.is_equivalent_to(made, ndim)
            else made)

  def _sharding(self, spec: P | NamedSharding | None, shape: tuple[int, ...],
                what: str) -> TensorSharding | None:
    if spec is None:
      return None
    if isinstance(spec, NamedSharding):
      if (spec.mesh.axis_names != self.mesh.axis_names
          or spec.mesh.shape_tuple != self.mesh.shape_tuple):
        raise ValueError(f"{what}: {spec} is on another mesh than spmd.partition's "
                         f"{dict(self.mesh.shape)}")
      spec = spec.spec
    if isinstance(spec, P) and spec.unreduced:
      raise ValueError(f"spmd.partition: {what}: {spec} names unreduced axes (partial sums), "
                       "which spmd takes only inside the function (out_sharding=, reshard); "
                       "give the reduced spec")
    if isinstance(spec, P):
      spec = without_reductions(spec)  # reduced axes: replicated over them
    if isinstance(spec, P) and any(e is P.UNCONSTRAINED for e in spec):
      raise ValueError(f"spmd.partition: {what}: {spec} leaves a dim unconstrained, which (as "
                       "in jax.jit) only an annotation inside the function may do; write None "
                       "for the whole leaf to leave it to propagation")
    spec = self._rules.resolve(spec, what)
    sharding = TensorSharding.from_spec(spec, len(shape), self._mesh_shape, what=what)
    for d, n in enumerate(shape):
      shards = sharding.shards(d, self._mesh_shape)
      if n % shards and self.backend == "xla":
        raise ValueError(f"{what}: dim {d} of size {n} does not split evenly into {shards} "
                         "shards; backend='xla' needs even shards at the boundary (JAX refuses "
                         "them): use backend='spmd', which pads")
    return sharding

  def _whole_size_one_dims(self, s: TensorSharding | None, shape: tuple[int, ...],
                           what: str) -> TensorSharding | None:
    """``s`` with its dims of size 1 unsharded, with a warning: one element cannot be split
    (one device would hold it, the others padding, and every op would gather it)."""
    split = [d for d, n in enumerate(shape) if n == 1 and s is not None and s.dims[d]]
    if not split:
      return s
    warnings.warn(f"spmd.partition: {what}: {s} shards dim {split[0]}, of size 1, over "
                  f"{', '.join(s.dims[split[0]])} (mesh {mesh_text(self._mesh_shape)}); one "
                  "element cannot be split, so that dim is whole on every device: write None "
                  "for it", stacklevel=5)
    return s.with_dims([() if d in split else a for d, a in enumerate(s.dims)])

  # --- arguments -------------------------------------------------------------------------------

  def _bound(self, args: tuple, kwargs: dict) -> tuple[Partitioned, tuple]:
    """The partitioned function and positional arguments a call comes to: arguments passed by
    keyword are bound to their positions; keyword-only ones (and ``**kwargs``) go to a variant
    of this function that takes the traced ones last among its positional arguments and the
    static ones (``static_argnames``) as constants, one variant per set of names and static
    values."""
    if not kwargs:
      return self, args
    bound = inspect.signature(self.fun).bind(*args, **kwargs)
    if not bound.kwargs:
      return self, bound.args
    static = tuple((k, v) for k, v in bound.kwargs.items() if k in self.static_kwnames)
    traced = tuple(k for k in bound.kwargs if k not in self.static_kwnames)
    key = (len(bound.args), traced, static)
    try:
      variant = self._keyword_calls.get(key)
    except TypeError:
      raise TypeError(f"spmd.partition: static arguments must be hashable, as jax.jit's are: "
                      f"{', '.join(k for k, _ in static)}") from None
    if variant is None:
      variant = self._keyword_calls[key] = self._keyword_variant(len(bound.args), traced,
                                                                 dict(static))
    return variant, bound.args + tuple(bound.kwargs[k] for k in traced)

  def _keyword_variant(self, count: int, traced: tuple[str, ...],
                       static: dict[str, Any]) -> Partitioned:
    """This function over ``count`` positional arguments and then the keyword-only ``traced``
    ones (open in_specs), with the ``static`` ones bound."""
    fun = self.fun

    def by_keyword(*args: Any) -> Any:
      return fun(*args[:count], **static, **dict(zip(traced, args[count:])))

    by_keyword.__name__ = by_keyword.__qualname__ = getattr(fun, "__name__", "fun")
    kept = _positions(self.static_argnums, count)
    in_specs = self._specs_per_argument(count - len(kept)) + (None,) * len(traced)
    donated = tuple(sorted(_positions(self.donate_argnums, count))) + tuple(
        count + traced.index(k) for k in self.donate_kwnames if k in traced)
    return Partitioned(by_keyword, self.mesh, in_specs, self.out_specs, tuple(sorted(kept)),
                       donated, self.backend, self._rules_as_given, self.auto, self.memory_limit)

  def _specs_per_argument(self, dynamic: int) -> tuple:
    """``in_specs`` as one entry per non-static argument (a single spec stands for each), for
    the partitioned functions derived from this one."""
    given = (tuple(self.in_specs) if isinstance(self.in_specs, (tuple, list)) else
             (self.in_specs,) * dynamic)
    if len(given) != dynamic:
      raise ValueError(f"spmd.partition: in_specs has {len(given)} entries for {dynamic} "
                       "non-static arguments")
    return given

  @property
  def _rules_as_given(self) -> Sequence[tuple[str, Any]] | None:
    """``rules=`` as given to this function, for the partitioned functions derived from it."""
    return None if self._given_rules is None else self._given_rules.rules

  def _positional_parameters(self) -> int | float:
    """How many positional parameters the function declares (infinitely many with ``*args``,
    or where its signature is unknown): an argnum past the arguments of a call but not past
    these names a parameter left to its default, which ``jax.jit`` ignores."""
    try:
      params = inspect.signature(self.fun).parameters.values()
    except (TypeError, ValueError):
      return math.inf
    if any(p.kind is p.VAR_POSITIONAL for p in params):
      return math.inf
    return sum(p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) for p in params)

  def _arg_names(self, n: int) -> list[str]:
    try:
      params = [p.name for p in inspect.signature(self.fun).parameters.values()
                if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    except (TypeError, ValueError):
      params = []
    return [repr(params[i]) if i < len(params) else f"#{i}" for i in range(n)]

  def _donated_leaves(self, args: tuple, dyn_idx: list[int], in_tree: Any) -> tuple[int, ...]:
    donate = _positions(self.donate_argnums, len(args))
    out, start = [], 0
    for i in dyn_idx:
      count = len(jax.tree_util.tree_leaves(args[i]))
      if i in donate:
        out.extend(range(start, start + count))
      start += count
    return tuple(out)


def _positions(argnums: Sequence[int], count: int) -> set[int]:
  """The positions among ``count`` arguments that ``argnums`` name (negative ones from the end);
  one out of range names a parameter the call leaves to its default (``jax.jit`` ignores it)."""
  return {i % count for i in argnums if -count <= i < count}


def _specs_mesh(in_specs: Any, out_specs: Any) -> Mesh | None:
  """The one mesh of the ``NamedSharding`` leaves of the specs; None without any."""
  leaves = jax.tree.leaves((in_specs, out_specs), is_leaf=lambda x: isinstance(x, NamedSharding))
  meshes = list(dict.fromkeys(x.mesh for x in leaves if isinstance(x, NamedSharding)))
  if len(meshes) > 1:
    raise ValueError(f"spmd.partition: the specs' NamedShardings name {len(meshes)} meshes; "
                     f"pass mesh= or give shardings on one mesh")
  return meshes[0] if meshes else None


def _broadcast_prefix(prefix: Any, tree: Any, what: str, of: str) -> list[P | NamedSharding | None]:
  """Expands a pytree prefix of specs to one spec per leaf of ``tree``."""
  if type(prefix) in (list, tuple) and type(tree) in (list, tuple):  # not a namedtuple
    prefix = type(tree)(prefix)  # a list of specs for a tuple of arguments, or the reverse
  is_spec = lambda x: x is None or isinstance(x, (P, NamedSharding))  # noqa: E731
  spec_leaves, spec_tree = tree_flatten(prefix, is_leaf=is_spec)
  for leaf in spec_leaves:
    if not is_spec(leaf):
      raise TypeError(f"spmd.partition: {what} leaves must be PartitionSpec, NamedSharding or "
                      f"None, got {leaf!r}")
  try:
    subtrees = spec_tree.flatten_up_to(tree)
  except (ValueError, TypeError):  # JAX's message would print the arrays themselves
    raise ValueError(f"spmd.partition: {what} {prefix!r} does not match the structure of the "
                     f"{of}: {what} is {spec_tree}, the {of} are "
                     f"{jax.tree_util.tree_structure(tree)}") from None
  out: list[P | NamedSharding | None] = []
  for spec, sub in zip(spec_leaves, subtrees):
    out.extend([spec] * len(jax.tree_util.tree_leaves(sub)))
  return out


def _raw_state(nnx: Any, spec: Any) -> Any:
  """``spec`` as a joint ``nnx.State`` holds a module's state: an ``nnx.State`` by its nested
  mapping (a State inside a State would be a pytree node of its own), anything else as it is."""
  return spec.raw_mapping if isinstance(spec, nnx.State) else spec


def _graph_node_positions(args: tuple) -> tuple[int, ...]:
  """Positions of NNX modules (graph nodes) among ``args``; none where NNX is not imported."""
  nnx = sys.modules.get("flax.nnx")
  if nnx is None:
    return ()
  return tuple(i for i, a in enumerate(args) if nnx.graph.is_graph_node(a))


def _graph_as_tree(out: Any) -> tuple[Any, bool]:
  """``out`` with its NNX modules as trees of their state in which a variable two of them share
  stays one (``nnx.to_tree``, as nnx.jit returns modules), and whether it held any (a
  variable alone, as in an ``nnx.State``, is no module)."""
  nnx = sys.modules.get("flax.nnx")
  if nnx is None or not any(
      nnx.graph.is_graph_node(x) and not isinstance(x, nnx.Variable)
      for x in jax.tree_util.tree_leaves(out, is_leaf=nnx.graph.is_graph_node)):
    return out, False
  return nnx.to_tree(out), True


def _names_logical(spec: Any, mesh: Mesh) -> bool:
  """Whether a PartitionSpec names something other than ``mesh``'s axes (logical names)."""
  return isinstance(spec, P) and any(isinstance(e, str) and e not in mesh.axis_names
                                     for e in spec)


def _in_mesh_context(mesh: Mesh) -> bool:
  """Whether the caller runs under ``jax.set_mesh`` of ``mesh``: only there does ``jax.jit``
  give an inferred output the first input's spelling (pxla's
  ``_get_out_sharding_from_orig_sharding`` compares the output type's mesh with it)."""
  return jax.sharding.get_abstract_mesh() == mesh.abstract_mesh


def _typed_on(aval: Any, mesh: Mesh) -> bool:
  """Whether ``aval``'s type carries ``mesh`` (JAX's sharding-in-types rules give most results
  the context mesh; a few, such as sort's, give none)."""
  sharding = getattr(aval, "sharding", None)
  return sharding is not None and sharding.mesh == mesh.abstract_mesh


def _trimmed(spec: P) -> P:
  """``spec`` without its trailing None entries."""
  entries = list(spec)
  while entries and entries[-1] is None:
    entries.pop()
  return P(*entries)


def _inexact(aval: Any) -> bool:
  return jax.numpy.issubdtype(aval.dtype, jax.numpy.inexact)


def _committed_sharding(leaf: Any) -> NamedSharding | None:
  """The ``NamedSharding`` on a concrete mesh of a committed JAX array, or of an abstract
  argument (``jax.ShapeDtypeStruct``) given one, which ``jax.jit``'s ``lower`` takes as
  committed; None for anything else."""
  if isinstance(leaf, jax.ShapeDtypeStruct):
    committed, sharding = leaf.sharding is not None, leaf.sharding
  elif isinstance(leaf, jax.Array) and not isinstance(leaf, jax.core.Tracer):
    committed, sharding = leaf.committed, leaf.sharding
  else:
    return None
  if committed and isinstance(sharding, NamedSharding) and isinstance(sharding.mesh, Mesh):
    return sharding
  return None


def _committed_spec(leaf: Any, mesh: Mesh) -> P | None:
  """The spec of ``leaf``'s committed sharding (``_committed_sharding``) where it is on
  ``mesh``'s devices, its reduced axes dropped (replicated over them; unreduced ones, partial
  sums, are refused); None for anything else."""
  sharding = _committed_sharding(leaf)
  if (sharding is None or sharding.mesh.axis_names != mesh.axis_names
      or not np.array_equal(sharding.mesh.device_ids, mesh.device_ids)):
    return None
  if sharding.spec.unreduced:
    raise ValueError(f"spmd.partition: an argument arrives as unreduced partial sums "
                     f"({sharding.spec}); reshard it to a reduced spec first")
  return without_reductions(sharding.spec)


def _committed_mesh(tree: Any) -> Mesh | None:
  """The mesh the committed arguments in ``tree`` (``_committed_sharding``) share; None where
  there is none. Arguments on several meshes are an error, as in ``jax.jit``."""
  meshes = {s.mesh for s in map(_committed_sharding, jax.tree_util.tree_leaves(tree))
            if s is not None}
  if len(meshes) > 1:
    raise ValueError("spmd.partition: the arguments are committed to different meshes "
                     f"({', '.join(str(dict(m.shape)) for m in meshes)}) and no mesh is given: "
                     "pass mesh= or call inside jax.set_mesh(mesh)")
  return next(iter(meshes), None)


def _concrete(leaf: Any) -> Any:
  """``leaf``, or the concrete value an eager ``jax.jvp`` / ``jax.grad`` tracer carries as its
  primal; None for a tracer of a staged or batched value."""
  while isinstance(leaf, jax.core.Tracer):
    leaf = getattr(leaf, "primal", None)
  return leaf


def _typed_part(s: TensorSharding, mesh: Mesh) -> P:
  """Sharding ``s`` as a type on ``mesh`` names it: its Explicit axes alone, without trailing
  Nones."""
  auto = set(mesh.auto_axes)
  return _trimmed(s.with_dims([tuple(a for a in d if a not in auto) for d in s.dims]).to_spec())


def _traced_type(leaf: Any, mesh: Mesh) -> P | None:
  """The spec of a traced argument's type on ``mesh``, where it has Explicit axes (the type
  names those); None for anything else."""
  if not isinstance(leaf, jax.core.Tracer):
    return None
  typed = jax.typeof(leaf).sharding
  if (typed.mesh.explicit_axes and typed.mesh.axis_names == mesh.axis_names
      and typed.mesh.axis_sizes == mesh.axis_sizes):
    return without_reductions(typed.spec)
  return None


def _typed_like(x: Any, like: Any) -> Any:
  """``x`` with the sharding of ``like``'s type: under explicit mode a committed argument's type
  carries its sharding, and JAX requires its cotangent to have that type (spmd's program, traced
  over the mesh's Auto twin, types its results without shardings). Concrete gradients (an eager
  jax.grad) are placed as a committed ``like`` is, on whichever twin of the mesh its type names."""
  want = jax.typeof(like).sharding
  if (isinstance(like, jax.Array) and not isinstance(like, jax.core.Tracer) and like.committed
      and isinstance(like.sharding, NamedSharding)):
    return x if jax.typeof(x).sharding == want else jax.device_put(x, like.sharding)
  if not names_mesh_axes(want) or jax.typeof(x).sharding.spec == want.spec:
    return x
  return jax.sharding.reshard(x, want)


def _off_mesh(leaf: Any, mesh: Mesh) -> bool:
  """Whether ``leaf`` is a concrete JAX array committed elsewhere than ``mesh``'s devices in
  their order."""
  return (isinstance(leaf, jax.Array) and not isinstance(leaf, jax.core.Tracer) and leaf.committed
          and _committed_spec(leaf, mesh) is None)


def _onto(x: jax.Array, sharding: NamedSharding, even: bool) -> Any:
  """``x`` copied onto ``sharding`` where it divides ``x`` evenly, else to the host (uneven
  inputs are padded there before the program, as numpy arguments are)."""
  return jax.device_put(x, sharding) if even else np.asarray(x)


def _global_array(x: np.ndarray, s: TensorSharding, dtype: Any, mesh: Mesh) -> jax.Array:
  """The global array of value ``x``, sharded as ``s`` (uneven dims padded at the end), built
  from this process's copy."""
  shape = mesh_shape(mesh)
  padded = [n * s.shards(d, shape) for d, n in enumerate(s.local_shape(x.shape, shape))]
  x = np.pad(np.asarray(x, dtype), [(0, p - n) for n, p in zip(x.shape, padded)])
  return jax.make_array_from_callback(x.shape, NamedSharding(mesh, s.to_spec()),
                                      lambda index: x[index])


def _structure(args: tuple, static_argnums: tuple[int, ...]) -> tuple[Any, list | None]:
  """(the non-static arguments' tree structure and the static values, their leaves); the key is
  None where a call must take the full path (unhashable static values)."""
  if not static_argnums:
    leaves, tree = tree_flatten(args)
    key = (tree, ())
  else:
    static = _positions(static_argnums, len(args))
    leaves, tree = tree_flatten(tuple(a for i, a in enumerate(args) if i not in static))
    key = (tree, tuple(args[i] for i in sorted(static)))
  try:
    hash(key)
  except TypeError:
    return None, None
  return key, leaves


def _dispatch_key(structure: Any, leaves: list) -> Any:
  """Calls with equal structure, avals and committed shardings share the key; None where a call
  must take the full path (traced, deleted, unhashable or unusual leaves)."""
  parts: list[Any] = [structure]
  for leaf in leaves:
    if isinstance(leaf, jax.core.Tracer):
      return None
    if isinstance(leaf, jax.Array):
      if leaf.is_deleted():
        return None  # the full path says which argument
      parts.append((leaf.shape, leaf.dtype, getattr(leaf, "weak_type", False),
                    leaf.sharding if leaf.committed else None))
    elif isinstance(leaf, (np.ndarray, np.generic)):
      parts.append((np.ndarray, leaf.shape, leaf.dtype))
    elif type(leaf) in (bool, int, float, complex):
      parts.append(type(leaf))  # weakly typed scalars: the aval is the type's
    else:
      return None
  key = tuple(parts)
  try:
    hash(key)
  except TypeError:
    return None
  return key


def _weak_types(leaves: Sequence[Any]) -> tuple[bool, ...]:
  return tuple(map(getattr, leaves, itertools.repeat("weak_type"), itertools.repeat(False)))


def _committed(leaf: Any) -> bool:
  return getattr(leaf, "committed", False)


def _on_leaves_mesh(leaves: Sequence[Any]) -> contextlib.AbstractContextManager:
  """Under a context mesh with Explicit axes, that mesh's Auto twin where ``leaves`` are typed on
  it (by ``_run_traced``): a derivative's program runs there too, its results typed as the
  leaves are."""
  auto = [m for m in (jax.typeof(x).sharding.mesh for x in leaves)
          if not m.empty and not m.explicit_axes]
  explicit = jax.sharding.get_abstract_mesh().explicit_axes
  return (jax.sharding.use_abstract_mesh(auto[0]) if auto and explicit
          else contextlib.nullcontext())


def _only_partial_eval(leaves: Sequence[Any]) -> bool:
  """Whether every traced leaf is a partial-evaluation tracer, as jax.linear_transpose traces
  a function (jax.grad, jax.vjp and jax.jvp reach the call with JVP or linearize tracers)."""
  traced = [leaf for leaf in leaves if isinstance(leaf, jax.core.Tracer)]
  return all(isinstance(leaf, partial_eval.JaxprTracer) for leaf in traced)


def _refuses_forward_mode(e: TypeError) -> bool:
  """Whether ``e`` is JAX's refusal to differentiate a custom_vjp in forward mode."""
  frames = traceback.extract_tb(e.__traceback__)
  return bool(frames) and frames[-1].name == "raise_custom_vjp_error_on_jvp"


def _check_leaf(name: str, leaf: Any) -> None:
  if isinstance(leaf, jax.Array) and not isinstance(leaf, jax.core.Tracer) and leaf.is_deleted():
    # jax 0.10's jit would crash on it rather than raise
    raise RuntimeError(f"spmd.partition: argument {name}: Array has been deleted with shape="
                       f"{leaf.aval.str_short()}: it was donated to an earlier call "
                       "(donate_argnums); pass what that call returned")
  if isinstance(leaf, (jax.Array, np.ndarray, np.generic, numbers.Number)) or (
      hasattr(leaf, "shape") and hasattr(leaf, "dtype")):
    return
  raise TypeError(f"spmd.partition: argument {name} is a {type(leaf).__name__}, not an array; "
                  "pass arrays or mark the argument static with static_argnums")


def _argnums(fun: Callable, names: str | Sequence[str],
             what: str) -> tuple[tuple[int, ...], tuple[str, ...]]:
  """The positions of the positional parameters among ``names`` of ``fun`` (as ``jax.jit``
  resolves them), and the names of the keyword-only ones (or of ``**kwargs`` entries)."""
  names = (names,) if isinstance(names, str) else tuple(names)
  if not names:
    return (), ()
  params = inspect.signature(fun).parameters
  positional = [p.name for p in params.values()
                if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
  by_keyword = any(p.kind == p.VAR_KEYWORD for p in params.values())
  unknown = [n for n in names if n not in params and not by_keyword]
  if unknown:
    raise ValueError(f"spmd.partition: {what} {unknown} are not parameters of "
                     f"{getattr(fun, '__name__', fun)}{tuple(params)}")
  return (tuple(positional.index(n) for n in names if n in positional),
          tuple(n for n in names if n not in positional))


def _ints(x: int | Sequence[int], what: str) -> tuple[int, ...]:
  items = (x,) if isinstance(x, int) else tuple(x)
  if not all(isinstance(i, int) for i in items):
    raise TypeError(f"spmd.partition: {what} must be ints, got {x!r}")
  return items
