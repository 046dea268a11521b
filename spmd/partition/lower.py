"""backend="spmd": one program for every device, ``jax.jit(jax.shard_map(local_program))``.

The local program replays the schedule: before each op the scheduled reshards run as explicit
collectives (psum, psum_scatter, all_gather, all_to_all, ppermute) or local slices; each op runs
on local shards (spmd/partition/local.py); scan / while / cond run with partitioned bodies, which
read the loop invariants made before them (ir.py).
"""
from __future__ import annotations

import contextlib
from collections import ChainMap
from dataclasses import dataclass
from typing import Any, Callable, MutableMapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding

from spmd.mesh import with_auto_axes
from spmd.partition.fold import const_arrays
from spmd.partition.ir import Atom, Literal, Op, Value
from spmd.partition.jax_compat import threefry_partitionable_at, weakly_typed
from spmd.partition.local import Local, run_local
from spmd.partition.primitives import describe
from spmd.partition.uneven import mask_padding
from spmd.partition.planner import Analysis
from spmd.partition.reshard import AllToAll, pad_to
from spmd.partition.schedule import RegionSchedule, ScheduledOp, Transfer
from spmd.partition.sharding import MeshShape, TensorSharding

Env = MutableMapping[tuple[Value, TensorSharding], Any]


def lower_spmd(analysis: Analysis, mesh: Mesh, donate_argnums: Sequence[int],
               out_shardings: Sequence[NamedSharding]) -> Callable:
  """Inputs sharded unevenly are padded before the program (JAX cannot hold uneven shards; the
  padded array splits evenly and is placed like any input), outputs are always even and come
  back as ``out_shardings`` (equivalent to the program's output specs). The program runs over
  ``mesh`` with Auto axes; its boundary is on ``mesh`` itself."""
  sched, shape = analysis.schedule, dict(mesh.shape)
  interpreter = _Interpreter(analysis, shape)
  in_specs = tuple(s.to_spec() for s in sched.inputs)
  out_specs = tuple(s.to_spec() for s in sched.outputs)
  auto = with_auto_axes(mesh)
  program = jax.shard_map(interpreter.run, mesh=auto, in_specs=in_specs, out_specs=out_specs,
                          check_vma=False)

  def local(*args: Any) -> Any:  # traced under its own mesh, whatever mesh the caller set
    with jax.sharding.use_abstract_mesh(auto.abstract_mesh):
      return program(*args)

  in_shardings = tuple(NamedSharding(mesh, p) for p in in_specs)
  jitted = jax.jit(local, in_shardings=in_shardings, out_shardings=tuple(out_shardings),
                   donate_argnums=tuple(donate_argnums))
  uneven = [k for k, (s, v) in enumerate(zip(sched.inputs, analysis.program.inputs))
            if not s.divides(v.shape, shape)]
  if not uneven:
    return jitted
  padded = [_padded_shape(sched.inputs[k], analysis.program.inputs[k].shape, shape)
            for k in uneven]
  pad = jax.jit(lambda *xs: [pad_to(x, n) for x, n in zip(xs, padded)],
                out_shardings=[in_shardings[k] for k in uneven])
  return _PaddedInputs(jitted, pad, tuple(uneven))


@dataclass(frozen=True)
class _PaddedInputs:
  """``jitted`` called on its ``uneven`` inputs padded at the end of every unevenly sharded dim,
  by ``pad``, a program that places them as ``jitted`` takes them (also when the caller set a
  mesh, under which an eager pad would come back replicated); the even ones (a TrainState's
  Python step among them) as given."""

  jitted: Any
  pad: Callable
  uneven: tuple[int, ...]

  def _pad(self, args: Sequence[Any]) -> list:
    args = list(args)
    for k, x in zip(self.uneven, self.pad(*(args[k] for k in self.uneven))):
      args[k] = x
    return args

  def __call__(self, *args: Any) -> Any:
    return self.jitted(*self._pad(args))

  def lower(self, *args: Any) -> jax.stages.Lowered:
    return self.jitted.lower(*self._pad(args))


def _padded_shape(s: TensorSharding, shape: tuple[int, ...], mesh: MeshShape) -> list[int]:
  """``shape`` with each dim ``s`` splits unevenly rounded up to a multiple of its shards."""
  return [-(-n // s.shards(d, mesh)) * s.shards(d, mesh) for d, n in enumerate(shape)]


class _Interpreter:
  def __init__(self, analysis: Analysis, mesh: MeshShape):
    self.analysis, self.mesh = analysis, mesh
    self.aliases = analysis.schedule.aliases  # an annotation's result is its operand
    self.outer: dict[RegionSchedule, Env] = {}  # while a region is traced: the env around it
    self.concatenated = {v for op in analysis.program.all_ops() if op.primitive == "concatenate"
                         for v in op.outputs}

  def run(self, *args: Any) -> tuple:
    program, sched = self.analysis.program, self.analysis.schedule
    env: Env = {(v, s): a for v, s, a in zip(program.inputs, sched.inputs, args)}
    for c, array in const_arrays(program.consts).items():
      env[(c, TensorSharding.replicated(len(c.shape)))] = array
    self.transfers(sched.entry, env)
    self.ops(sched.ops, env)
    self.transfers(sched.exit, env)
    return tuple(weakly_typed(self.read(env, x, s)) if x.aval.weak_type else
                 self.read(env, x, s) for x, s in zip(program.outputs, sched.outputs))

  # --- values -----------------------------------------------------------------------------------

  def read(self, env: Env, x: Atom, s: TensorSharding | None) -> Any:
    if isinstance(x, Literal):
      value = np.asarray(x.val, dtype=x.aval.dtype)
      return value if s is None else jnp.full(s.local_shape(x.aval.shape, self.mesh), value)
    return env[(self.aliases.get(x, x), s)]

  def transfers(self, transfers: list[Transfer], env: Env) -> None:
    for t in transfers:
      value = self.aliases.get(t.value, t.value)
      x = env[(value, t.src)]
      if value in self.concatenated and any(isinstance(step, AllToAll) for step in t.steps):
        # XLA splits an all-to-all's operand into slices and folds a slice of a concatenate into
        # the piece it takes, whose layout may differ from the others' (a transposed piece):
        # its verifier then refuses the all-to-all (jax 0.10 to 0.12). The barrier hides the
        # concatenate; it moves nothing.
        x = jax.lax.optimization_barrier(x)
      for step in t.steps:
        x = step.apply(x, t.value.shape, self.mesh)
        env.setdefault((value, step.after), x)  # forms passed through (schedule.acquire)
      env[(value, t.dst)] = x

  # --- ops --------------------------------------------------------------------------------------

  def ops(self, scheduled: list[ScheduledOp], env: Env) -> None:
    for s in scheduled:
      self.transfers(s.transfers, env)
      if s.op.outputs and s.op.outputs[0] in self.aliases:
        continue  # an annotation or a repeated op (cse.py): nothing to run
      args = [self.read(env, x, r) for x, r in zip(s.op.inputs, s.reads)]
      if s.regions:
        self.outer.update((r, env) for r in s.regions)
        outs = describe(s.op.eqn.primitive).control.lower(self, s, args)
        for r in s.regions:  # the bodies are traced: keep no tracer past them
          del self.outer[r]
      else:
        ex = s.execution
        args = mask_padding(ex, s.op, s.reads, args, self.mesh)
        with _as_traced(s.op):
          outs = run_local(Local(s.op, s.reads, s.writes, ex.partial_axes, self.mesh, ex.halos,
                                 env, self.aliases), args)
      for v, w, out in zip(s.op.outputs, s.writes, outs):
        env[(v, w)] = out

  def region(self, r: RegionSchedule, region: Any, args: Sequence[Any]) -> list:
    """A region reads values defined around it (loop invariants, ir.py) from the env there."""
    env: Env = ChainMap({(v, s): a for v, s, a in zip(region.inputs, r.inputs, args)},
                        self.outer[r])
    self.ops(r.ops, env)
    self.transfers(r.exit, env)
    return [self.read(env, x, s) for x, s in zip(region.outputs, r.outputs)]


def _as_traced(op: Op) -> contextlib.AbstractContextManager:
  """For a random op, ``jax.threefry_partitionable`` as where it was traced (a ``with`` inside the
  function sets it per op), which JAX's random ops read when bound."""
  if not op.primitive.startswith("random_"):
    return contextlib.nullcontext()
  return jax.threefry_partitionable(threefry_partitionable_at(op.eqn))
