"""Collectives repeated on one local buffer, which XLA's CSE merges: the plan counts them once.

The schedule shares a reshard per value and its other names (schedule.py). Distinct values can
still hold one local buffer: a value and a reshape in effect of it (``x`` and
``x.transpose(1, 0, 2)`` moving a size-1 dim, two reshapes of one block) are one block on each
device, laid out in one or another shape. Their reshards may run the same collective on that
block (permute it between the same devices, all-to-all it alike). The lowered program runs each
reshard as scheduled, and XLA, once its simplifier has made the reshapes one, merges the repeats
(CSE). This pass marks each such repeat on its transfer (``Transfer.repeats``), and drops from
an op's ``halo_hops`` a halo piece of such a block sent between the same devices before (the
whole [1,1,1] block of ``x`` and of its transpose, as two concatenates exchange them), so that
the plan prices each as the compiled program runs it: once.

A buffer is named by where it was made: an op's result in the form it was written, a reshape in
effect's result (the buffer it reads), or a reshard step (the buffer it read and what it did to
it). Two steps on one buffer, in one computation, do the same when their local computations
(traced on the local block, ``jax.make_jaxpr`` with the mesh's axes) are equal; a collective of
a step repeats an earlier one when the computation leading to it is equal. Steps are traced only
where two of them read one buffer in one shape.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any, Hashable, Mapping

import jax
from jax.extend import core as jcore

from spmd.partition.devices import mesh_pairs
from spmd.partition.halo_geometry import Exchange, Hop, joint
from spmd.partition.ir import (Value, hashable_or_none, literal_identity, literal_key,
                               reshapes_in_effect)
from spmd.partition.manual import COLLECTIVES
from spmd.partition.reshard import ReshardStep
from spmd.partition.schedule import RegionSchedule, Schedule, ScheduledOp, Transfer
from spmd.partition.sharding import MeshShape, TensorSharding


class _Buffer:
  """One local buffer of the program (compared by identity)."""


@dataclasses.dataclass(frozen=True)
class _Trace:
  """A step's local computation, as comparable keys: of its outputs, and of each collective."""

  outputs: Hashable
  collectives: tuple[Hashable, ...]


@dataclasses.dataclass(eq=False)
class _Run:
  """A step run on a buffer, and the buffer it made."""

  step: ReshardStep
  shape: tuple[int, ...]  # the tensor's global shape
  made: _Buffer


@dataclasses.dataclass(frozen=True)
class _Place:
  """Where steps read a buffer: in one computation, in one local shape and dtype."""

  scope: int
  buffer: _Buffer
  local: tuple[int, ...]
  dtype: Any  # a numpy dtype, or JAX's (a PRNG key's)


@dataclasses.dataclass(frozen=True)
class _Piece:
  """A halo exchange's ppermute: rows ``region`` (dim, start, stop; None: the whole block) of a
  buffer's block, sent between the devices ``pairs`` along ``axes``."""

  scope: int
  buffer: _Buffer
  local: tuple[int, ...]
  dtype: Any  # a numpy dtype, or JAX's (a PRNG key's)
  region: tuple[int, int, int] | None
  axes: tuple[str, ...]
  pairs: tuple[tuple[int, int], ...]


def mark_repeats(sched: Schedule, mesh: MeshShape) -> None:
  """Sets ``repeats`` on each transfer of ``sched`` whose steps repeat earlier collectives, and
  drops from each op's ``halo_hops`` those that send a piece sent before."""
  _Marker(sched.aliases, mesh).walk(sched)


class _Marker:
  def __init__(self, aliases: Mapping[Value, Value], mesh: MeshShape):
    self.aliases, self.mesh = aliases, mesh
    self.buffers: dict[tuple[Value, TensorSharding], _Buffer] = {}
    self.runs: dict[_Place, list[_Run]] = {}
    self.pieces: set[_Piece] = set()
    self.computed: dict[Hashable, ScheduledOp] = {}  # what an op computed -> the first to do it
    self.scopes = 0

  def walk(self, sched: Schedule) -> None:
    self._transfers(sched.entry, 0)
    self._ops(sched.ops, 0)
    self._transfers(sched.exit, 0)

  def _ops(self, ops: list[ScheduledOp], scope: int) -> None:
    for s in ops:
      self._transfers(s.transfers, scope)
      self._hops(s, scope)
      self._written(s, scope)
      for region in s.regions:
        self._region(region)

  def _region(self, region: RegionSchedule) -> None:
    self.scopes += 1  # a region is a computation of its own: XLA's CSE stays inside it
    scope = self.scopes
    self._ops(region.ops, scope)
    self._transfers(region.exit, scope)

  def _buffer(self, v: Value, form: TensorSharding, made: _Buffer | None = None) -> _Buffer:
    """The buffer holding ``v`` in ``form``: where none is named yet, ``made`` (or a new one)."""
    return self.buffers.setdefault((self.aliases.get(v, v), form),
                                   _Buffer() if made is None else made)

  def _relaid_locally(self, s: ScheduledOp) -> bool:
    """A transpose whose local block moves only dims of one element: on each device a reshape
    in effect, whatever it does to the array (a [2,2] of 1x1 blocks transposed)."""
    if s.op.primitive != "transpose":
      return False
    block = s.reads[0].local_shape(s.op.inputs[0].shape, self.mesh)
    moved = [d for d in s.op.params["permutation"] if block[d] != 1]
    return moved == sorted(moved)

  def _written(self, s: ScheduledOp, scope: int) -> None:
    """The buffers an op run on local blocks alone writes. A reshape in effect or a
    ``stop_gradient`` (lowered to nothing) writes the buffer it reads, re-laid (its padding too,
    where a dim splits unevenly: the blocks hold as many elements). An op computing what an
    earlier op of ``scope`` did, from the same buffers in the same forms, writes that op's
    buffers: XLA's CSE merges the two (``log_softmax`` and ``softmax`` of one value sum one
    buffer once, the first's ``stop_gradient`` gone)."""
    op, ex = s.op, s.execution
    if ex is None or ex.halos or s.gathered:
      return
    if reshapes_in_effect(op) or op.primitive == "stop_gradient" or self._relaid_locally(s):
      read, written = (math.prod(f.local_shape(v.shape, self.mesh)) for v, f in
                       [(op.inputs[0], s.reads[0]), (op.outputs[0], s.writes[0])])
      if read == written:
        self._buffer(op.outputs[0], s.writes[0], self._buffer(op.inputs[0], s.reads[0]))
      return
    if op.merge_params is None or op.regions:  # XLA merges no loops or conditionals
      return
    operands = tuple(self._buffer(x, f) if isinstance(x, Value)
                     else literal_identity(x.val, x.aval) for x, f in zip(op.inputs, s.reads))
    first = self.computed.setdefault((scope, op.merge_params, operands, s.writes), s)
    for v, w, earlier in zip(op.outputs, s.writes, first.op.outputs):
      self._buffer(v, w, self._buffer(earlier, w))

  def _hops(self, s: ScheduledOp, scope: int) -> None:
    """Keeps in ``s.halo_hops`` the ppermutes that send no piece sent before in ``scope``."""
    if not s.halo_hops:
      return
    first: dict[int, Exchange] = {}  # per operand: its exchange on the block as read
    for h in s.execution.halos:
      first.setdefault(h.operand, h)
    kept = []
    for h, hop, nbytes in s.halo_hops:
      piece = self._piece(s, h, hop, scope) if first[h.operand] is h else None
      if piece is None or piece not in self.pieces:
        kept.append((h, hop, nbytes))
      if piece is not None:
        self.pieces.add(piece)
    s.halo_hops = tuple(kept)

  def _piece(self, s: ScheduledOp, h: Exchange, hop: Hop, scope: int) -> _Piece | None:
    if joint(h):  # cut from several operands' blocks
      return None
    x, read = s.op.inputs[h.operand], s.reads[h.operand]
    local = read.local_shape(x.shape, self.mesh)
    rows = hop.sent_rows(local[hop.dim])
    if rows is None:
      return None
    axes, pairs = mesh_pairs(hop.axes, hop.pairs, self.mesh)
    return _Piece(scope, self._buffer(x, read), local, x.dtype,
                  None if rows == (0, local[hop.dim]) else (hop.dim, *rows), axes, tuple(pairs))

  def _transfers(self, transfers: list[Transfer], scope: int) -> None:
    for k, t in enumerate(transfers):
      repeats = self._steps(t, scope)
      if any(repeats):
        transfers[k] = dataclasses.replace(t, repeats=repeats)

  def _steps(self, t: Transfer, scope: int) -> tuple[int, ...]:
    """How many collectives of each step of ``t`` repeat earlier ones; registers the buffers
    the steps make."""
    v, dtype = t.value, t.value.dtype
    buffer, repeats = self._buffer(v, t.src), []
    for step in t.steps:
      place = _Place(scope, buffer, step.before.local_shape(v.shape, self.mesh), dtype)
      runs = self.runs.setdefault(place, [])
      made, repeated = self._run(step, v.shape, place, runs)
      runs.append(_Run(step, v.shape, made))
      repeats.append(repeated)
      self._buffer(v, step.after, made)
      buffer = made
    return tuple(repeats)

  def _run(self, step: ReshardStep, shape: tuple[int, ...], place: _Place, runs: list[_Run]
           ) -> tuple[_Buffer, int]:
    """The buffer ``step`` makes and how many of its collectives earlier ``runs`` on the same
    buffer ran already."""
    for run in runs:
      if (run.step, run.shape) == (step, shape):
        return run.made, step.collectives
    if not runs:
      return _Buffer(), 0
    mine = _traced(step, shape, place.dtype, self.mesh)
    if mine is None:
      return _Buffer(), 0
    earlier = [(run, trace) for run in runs
               if (trace := _traced(run.step, run.shape, place.dtype, self.mesh)) is not None]
    made = next((run.made for run, trace in earlier if trace.outputs == mine.outputs), _Buffer())
    seen = {key for _, trace in earlier for key in trace.collectives}
    repeated = sum(key in seen for key in mine.collectives)
    if len(mine.collectives) != step.collectives:  # not one collective per instruction
      repeated = step.collectives if repeated == len(mine.collectives) else 0
    return made, repeated


def _traced(step: ReshardStep, shape: tuple[int, ...], dtype: Any, mesh: MeshShape
            ) -> _Trace | None:
  try:
    return _trace(step, shape, dtype, tuple(mesh.items()))
  except TypeError:  # a step that cannot be hashed is compared to none
    return None


@functools.lru_cache(maxsize=4096)
def _trace(step: ReshardStep, shape: tuple[int, ...], dtype: Any,
           mesh: tuple[tuple[str, int], ...]) -> _Trace | None:
  """``step``'s computation on the local block, as keys; None where they cannot be compared."""
  sizes = dict(mesh)
  block = jax.ShapeDtypeStruct(step.before.local_shape(shape, sizes), dtype)
  closed = jax.make_jaxpr(lambda x: step.apply(x, shape, sizes), axis_env=list(mesh))(block)
  collectives: list[Hashable] = []
  outputs = _keys(closed, ("input",), collectives)
  if outputs is None:
    return None
  return _Trace(outputs, tuple(collectives))


def _keys(closed: jcore.ClosedJaxpr, inputs: Any, collectives: list | None = None
          ) -> tuple | None:
  """Keys of ``closed``'s outputs: each the primitive, params and keys of the inputs that made
  it (``inputs``: what stands for its inputs); each collective's key is added to
  ``collectives``. None where a param cannot be hashed."""
  jaxpr = closed.jaxpr
  env: dict[Any, Hashable] = {v: (inputs, k) for k, v in enumerate(jaxpr.invars)}
  env.update((v, ("const", literal_key(c))) for v, c in zip(jaxpr.constvars, closed.consts))

  def read(a: Any) -> Hashable:
    if isinstance(a, jcore.Literal):
      return literal_identity(a.val, a.aval)
    return env[a]

  for eqn in jaxpr.eqns:
    params = tuple(sorted((name, _param(p)) for name, p in eqn.params.items()))
    key = hashable_or_none((eqn.primitive.name, params, tuple(map(read, eqn.invars)),
                            tuple(str(v.aval) for v in eqn.outvars)))
    if key is None:
      return None
    if collectives is not None and eqn.primitive.name in COLLECTIVES:
      collectives.append(key)
    env.update((v, (key, k)) for k, v in enumerate(eqn.outvars))
  return tuple(map(read, jaxpr.outvars))


def _param(p: Any) -> Any:
  """A param as keys compare it: a nested computation (a jitted helper) by its own keys."""
  if isinstance(p, jcore.ClosedJaxpr):
    return ("jaxpr", _keys(p, ("argument",)))
  if isinstance(p, jcore.Jaxpr):
    return ("jaxpr", _keys(jcore.ClosedJaxpr(p, ()), ("argument",)))
  if isinstance(p, tuple):
    return tuple(map(_param, p))
  return p
