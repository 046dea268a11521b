"""The pipeline driver: from a program and its boundary specs to shardings (propagate.py), the
schedule (schedule.py) and the public Plan (rendering.py)."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from jax.sharding import PartitionSpec as P

from spmd.partition.annotation import annotation_spec, explicit_type
from spmd.partition.cse import Duplicates
from spmd.partition.execution import ExecutionPlanner
from spmd.partition.ir import Literal, Program, Value, annotates
from spmd.partition.propagate import Origin, Propagation, Propagator, Seed
from spmd.partition.reshard import IotaFill
from spmd.partition.rendering import render_plan
from spmd.partition.repeats import mark_repeats
from spmd.partition.schedule import ProgramFacts, Schedule, program_facts, schedule
from spmd.partition.sharding import Axes, MeshShape, TensorSharding, axes_size
from spmd.partition.trips import trip_counts
from spmd.partition.wire import wire_for
from spmd.plan import Plan


@dataclass(frozen=True)
class Boundary:
  """Specs at the program boundary: one entry per flat input / output (None = open), and the
  sharding each input arrives in when it is a JAX array committed to the mesh (None: placed by
  the program as it wants)."""

  inputs: tuple[TensorSharding | None, ...]
  input_names: tuple[str, ...]
  outputs: tuple[TensorSharding | None, ...]
  arrivals: tuple[TensorSharding | None, ...]
  # Per input and output, the mesh axes propagation may add after its spec's on each dim (one
  # typed on a mesh mixing Explicit and Auto axes: its type names only the Explicit ones, and
  # jax.jit shards it over the Auto ones as it propagates); none: the spec is closed.
  input_open_axes: tuple[Axes, ...]
  output_open_axes: tuple[Axes, ...]

  def input_text(self, k: int) -> str:
    return f"input {k} ({self.input_names[k]})"


@dataclass
class Analysis:
  program: Program
  propagation: Propagation
  schedule: Schedule
  plan: Plan


@dataclass(frozen=True)
class Scheduled:
  """A boundary's propagation and schedule, before the plan is rendered; ``wanted``: the
  sharding each output had before it was made even (``schedule.outputs``)."""

  boundary: Boundary
  propagation: Propagation
  schedule: Schedule
  wanted: tuple[TensorSharding, ...]


def made_anywhere(program: Program) -> dict[Value, Any]:
  """The values every device can make itself, each by its Splat fill: a broadcast of a literal
  (the literal's value), or of an annotation of one (jax.grad's cotangent seed under an Explicit
  mesh, ``reshard(1.0)``), and an iota (IotaFill). They are made anew in the form an op reads
  (XLA folds a collective of such a value into the value)."""
  annotated = {op.outputs[0]: op.inputs[0] for op in program.all_ops() if annotates(op)}
  made: dict[Value, Any] = {}
  for op in program.all_ops():
    if op.primitive == "broadcast_in_dim":
      operand = op.inputs[0]
      while isinstance(operand, Value) and operand in annotated:
        operand = annotated[operand]
      if isinstance(operand, Literal):
        made[op.outputs[0]] = operand.val
    elif op.primitive == "iota":
      made[op.outputs[0]] = IotaFill(op.params["dimension"])
  return made


class Planner:
  """Plans one program for any boundary. What does not depend on the boundary (the ops' rules,
  propagation outcomes, candidate executions, reshard steps) is computed once and shared by
  every plan, and so is the schedule of shardings met before: the search prices dozens.

  ``resolve`` turns an annotation's logical axis names into mesh axes; ``backend``, ``name``,
  ``in_tree`` and ``out_tree`` are for the plan's rendering."""

  def __init__(self, program: Program, mesh: MeshShape, *, platform: str,
               resolve: Callable[[P, str], P], backend: str, name: str, in_tree: Any,
               out_tree: Any):
    self.program, self.mesh = program, mesh
    self.backend, self.name, self.in_tree, self.out_tree = backend, name, in_tree, out_tree
    self.propagator = Propagator(program, mesh)
    self.executions = ExecutionPlanner(mesh, wire_for(platform), made_anywhere(program))
    self.trips = trip_counts(program)
    self.duplicates = Duplicates(program)
    self.annotations = annotation_seeds(program, mesh, resolve)
    self.types = type_seeds(program, mesh)
    # A schedule depends only on the shardings and the boundary's forms: boundaries that
    # propagate alike (the search's candidates often do) share one.
    self._schedules: dict[tuple, Schedule] = {}
    self._step_bytes: dict[Schedule, int] = {}
    self._program_facts: dict[tuple, ProgramFacts] = {}

  def analyze(self, boundary: Boundary) -> Analysis:
    return self.render(self.schedule(boundary))

  def schedule(self, boundary: Boundary) -> Scheduled:
    """The cheaper of two schedules where the program was traced on a mesh with Explicit
    axes: propagation from the annotations alone, each dim a type leaves None open (as spmd
    propagates on any mesh), and every value kept as its type says (jax.jit's layout: open
    only to the Auto axes); at equal step bytes, the first. The second is planned only where
    the first put some value otherwise than its type allows."""
    free = self._scheduled(boundary, self.annotations)
    if all(_fits(seed, free.propagation.shardings[v]) for v, seed in self.types.items()):
      return free
    typed = self._scheduled(boundary, {**self.annotations, **self.types})
    return typed if self.step_bytes(typed) < self.step_bytes(free) else free

  def _scheduled(self, boundary: Boundary, annotations: Mapping[Value, Seed]) -> Scheduled:
    """Open inputs, inputs returned unchanged (``_returned_whole``) and every output get
    shardings that divide their dims: JAX arrays cannot hold uneven shards (an uneven out_spec
    is returned replicated along that dim, with a warning)."""
    program, mesh = self.program, self.mesh
    prop = self.propagator(_seeds(program, boundary, annotations))
    wanted = tuple(_wanted(atom, spec, axes, prop, mesh) for atom, spec, axes in
                   zip(program.outputs, boundary.outputs, boundary.output_open_axes))
    outputs = tuple(_even(w, atom.aval.shape, mesh) for w, atom in zip(wanted, program.outputs))
    forms = tuple(arrival or (_wanted(v, spec, axes, prop, mesh) if spec is not None
                              else _even(prop.shardings[v], v.shape, mesh))
                  for v, spec, arrival, axes in zip(program.inputs, boundary.inputs,
                                                    boundary.arrivals, boundary.input_open_axes))
    whole = _returned_whole(program, forms, outputs, mesh)
    inputs = tuple(w or form for w, form in zip(whole, forms))
    entries = tuple(_entry(program, v, w, form, spec, arrival)
                    for v, w, form, spec, arrival in zip(program.inputs, whole, forms,
                                                         boundary.inputs, boundary.arrivals))
    key = (prop.layout, inputs, entries, outputs)
    sched = self._schedules.get(key)
    if sched is None:
      sched = self._schedules[key] = schedule(
          program, self._facts(prop), prop.shardings, inputs, entries, outputs, self.executions)
      mark_repeats(sched, dict(mesh))
    return Scheduled(boundary, prop, sched, wanted)

  def _facts(self, prop: Propagation) -> ProgramFacts:
    """The program's facts for scheduling ``prop``: one per set of repeated ops (every
    propagation of one Propagator shares its constraints)."""
    duplicates = self.duplicates(prop.shardings)
    key = tuple(duplicates.items())
    if key not in self._program_facts:
      self._program_facts[key] = program_facts(self.program, prop.constraints, duplicates)
    return self._program_facts[key]

  def step_bytes(self, scheduled: Scheduled) -> int:
    """The rendered plan's ``step_bytes``."""
    sched = scheduled.schedule
    if sched not in self._step_bytes:
      self._step_bytes[sched] = sched.step_bytes(self.trips)
    return self._step_bytes[sched]

  def render(self, scheduled: Scheduled) -> Analysis:
    plan = render_plan(self.program, scheduled.propagation, scheduled.schedule,
                       scheduled.boundary, scheduled.wanted, self.mesh, self.backend, self.name,
                       self.in_tree, self.out_tree)
    return Analysis(self.program, scheduled.propagation, scheduled.schedule, plan)


def _returned_whole(program: Program, forms: tuple[TensorSharding, ...],
                    outputs: tuple[TensorSharding, ...],
                    mesh: MeshShape) -> tuple[TensorSharding | None, ...]:
  """Per input split unevenly and returned unchanged in the even form its split makes (an NNX
  step's untouched params): that form, in which it then arrives and is sliced into its split on
  entry, as XLA takes it, so the output is the input as it came rather than its blocks gathered
  again; None for every other input (padded before the program)."""
  returned: dict[Value, TensorSharding] = {}
  for atom, s in zip(program.outputs, outputs):
    if isinstance(atom, Value):
      returned.setdefault(atom, s)
  return tuple(returned.get(v) if not form.divides(v.shape, mesh)
               and returned.get(v) == _even(form, v.shape, mesh) else None
               for v, form in zip(program.inputs, forms))


def _entry(program: Program, v: Value, whole: TensorSharding | None, form: TensorSharding,
           spec: TensorSharding | None, arrival: TensorSharding | None) -> TensorSharding | None:
  """The form input ``v`` is resharded to first (None: kept as it arrives). One returned whole
  (``_returned_whole``) is sliced into its split ``form`` only where the program reads it; a
  committed one whose spec differs is resharded to its spec."""
  if whole is not None:
    return form if program.reads.get(v) else None
  return spec if spec is not None and arrival is not None and spec != arrival else None


def _wanted(atom: Any, spec: TensorSharding | None, open_axes: Axes, prop: Propagation,
            mesh: MeshShape) -> TensorSharding:
  """A boundary value's sharding as asked: its spec, each dim followed by the axes of
  ``open_axes`` propagation put after the spec's on that dim (in its order, each axis once,
  while they divide it: Shardy's open dim ``{"x", ?}``); an open value's, as propagated."""
  if not isinstance(atom, Value):
    return spec or TensorSharding.replicated(len(atom.aval.shape))
  if spec is None:
    return prop.shardings[atom]
  used = set(spec.axes)
  dims = []
  for want, got, n in zip(spec.dims, prop.shardings[atom].dims, atom.shape):
    more = tuple(a for a in got[len(want):] if a in open_axes and a not in used
                 ) if got[:len(want)] == want else ()
    while more and n % axes_size(want + more, mesh):
      more = more[:-1]
    used.update(more)
    dims.append(want + more)
  return spec.with_dims(dims)


def _even(s: TensorSharding, shape: tuple[int, ...], mesh: MeshShape) -> TensorSharding:
  dims = []
  for d, axes in enumerate(s.dims):
    while axes and shape[d] % math.prod(mesh[a] for a in axes):
      axes = axes[:-1]
    dims.append(axes)
  return s.with_dims(dims)


def _seeds(program: Program, boundary: Boundary,
           annotations: Mapping[Value, Seed]) -> dict[Value, Seed]:
  """The boundary's specs, the annotations' (``annotation_seeds``), then open outputs'. A spec
  is closed but to its ``open_axes``, which propagation may append to its dims."""
  seeds: dict[Value, Seed] = {}
  for k, (v, s, arrival) in enumerate(zip(program.inputs, boundary.inputs, boundary.arrivals)):
    if s is not None:
      seeds[v] = Seed(s, frozenset(range(s.rank)), Origin("input", boundary.input_text(k)),
                      frozenset(boundary.input_open_axes[k]))
    elif arrival is not None:  # an open leaf of a committed argument: its sharding, as jax.jit
      seeds[v] = Seed(arrival, frozenset(range(arrival.rank)),
                      Origin("input", f"{boundary.input_text(k)}, as committed"))
  seeds.update(annotations)
  for k, (atom, s) in enumerate(zip(program.outputs, boundary.outputs)):
    if s is not None and isinstance(atom, Value) and atom not in seeds:
      seeds[atom] = Seed(s, frozenset(range(s.rank)), Origin("output", f"out_specs[{k}]"),
                         frozenset(boundary.output_open_axes[k]))
  return seeds


def type_seeds(program: Program, mesh: MeshShape) -> dict[Value, Seed]:
  """Every value's sharding as its type says (``explicit_type``), closed but to the mesh's Auto
  axes, which propagation may append; the results of annotations keep their own requests, and
  values of any other mesh (Manual axes inside a shard_map) have none."""
  seeds: dict[Value, Seed] = {}
  for op in program.all_ops():
    if annotates(op):
      continue
    for v in (*op.outputs, *(x for region in op.regions for x in region.inputs)):
      typed = explicit_type(v.aval, frozenset(mesh))
      if typed is not None:
        sharding = TensorSharding.from_spec(typed.spec, len(v.shape), mesh)
        seeds[v] = Seed(sharding, frozenset(range(sharding.rank)),
                        Origin("type", f"its type {typed.spec}, as under jax.jit"),
                        frozenset(typed.mesh.auto_axes))
  return seeds


def _fits(seed: Seed, sharding: TensorSharding) -> bool:
  """Whether ``sharding`` is one propagation from ``seed`` could reach: its dims, each followed
  by axes the seed leaves open."""
  return all(got[:len(want)] == want and set(got[len(want):]) <= seed.open_axes
             for want, got in zip(seed.sharding.dims, sharding.dims))


def annotation_seeds(program: Program, mesh: MeshShape,
                     resolve: Callable[[P, str], P]) -> dict[Value, Seed]:
  """The sharding each annotation asks for; ``resolve`` turns logical axis names into mesh
  axes."""
  seeds: dict[Value, Seed] = {}
  for op in program.all_ops():
    spec = annotation_spec(op)
    if spec is None:
      continue
    out = op.outputs[0]
    what = f"annotation at {op.source}"
    resolved = resolve(spec[0], what)
    sharding = TensorSharding.from_spec(resolved, len(out.shape), mesh, what=what)
    if resolved != spec[0]:
      what += f" as {spec[0]}"
    closed = frozenset(range(sharding.rank)) - spec[1]
    seeds[out] = Seed(sharding, closed, Origin("annotation", what))
  return seeds
