"""Two processes of 4 simulated CPU devices each, started by ``python -m spmd launch``, run a
partitioned Transformer training step on their 8-device global mesh: it must equal the same
step run in this one process on 8 devices.

Run as a script (``python -m spmd launch -n 2 --cpu-devices 4 tests/test_multiprocess.py OUT``),
this file is the program each process runs; process 0 saves the results to ``OUT`` (.npz).
"""
from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
from pathlib import Path
from typing import Callable

import jax
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import spmd
from spmd import checkpoint
from workloads import Workload, transformer

ROOT = Path(__file__).resolve().parents[1]
MESH = {"data": 2, "model": 4}
STEPS = 2
TIMEOUT_S = 150  # the launcher's own limit; the subprocess gets a little more


def traced_workload() -> Workload:
  """The Transformer workload's function and specs, traced, not run (its args are abstract):
  its jax.random initialisation compiles a program per shape, seconds each on a loaded machine."""
  made: list[Workload] = []
  jax.eval_shape(lambda: made.append(transformer()))
  return made[0]


def initial_args() -> list[np.ndarray]:
  """Values for the workload's argument leaves, by numpy: floats in [0, 0.1) (params, and an
  Adam state: its second moments must not be negative), ints (step count, tokens) below 8."""
  rng = np.random.default_rng(0)
  return [rng.uniform(0, 0.1, x.shape).astype(x.dtype) if jax.numpy.issubdtype(x.dtype, np.floating)
          else rng.integers(0, 8, x.shape).astype(x.dtype)
          for x in jax.tree.leaves(traced_workload().args)]


def placed_state(mesh: jax.sharding.Mesh, args: list[np.ndarray]) -> list:
  """The (params, optimizer state) in ``args`` as global arrays, made from a callback."""
  w = traced_workload()
  place = lambda spec, x: jax.make_array_from_callback(  # noqa: E731
      x.shape, NamedSharding(mesh, spec), lambda index: x[index])
  state = jax.tree.unflatten(jax.tree.structure(w.args), args)[:2]
  return jax.tree.map(place, w.in_specs[:2], state, is_leaf=lambda s: isinstance(s, P))


def run_steps(mesh: jax.sharding.Mesh, args: list[np.ndarray], batch: tuple,
              fetch: Callable[[jax.Array], np.ndarray], donate: tuple[int, ...] = ()
              ) -> tuple[list[np.ndarray], spmd.Plan]:
  """``STEPS`` partitioned training steps from the state in ``args`` (the workload's arguments'
  leaves), placed as global arrays from a callback, on ``batch``: every output of every step,
  fetched, and the plan. Every step has the same argument shardings: one plan, one compilation."""
  w = traced_workload()
  state = placed_state(mesh, args)
  step = spmd.partition(w.fn, mesh=mesh, in_specs=w.in_specs, donate_argnums=donate)
  plan = step.plan(*state, *batch)
  outs = []
  for _ in range(STEPS):
    *state, loss = step(*state, *batch)
    outs.extend(fetch(x) for x in jax.tree.leaves((state, loss)))
  return outs, plan


def collectives(plan: spmd.Plan) -> list:
  return [[c.kind, list(c.axes), c.bytes] for c in plan.collectives]


def child(out: str) -> None:
  """One process of the run: tokens as a global array of this process's rows, labels as numpy
  (the global value, placed by spmd), the state donated; every output is a global array on the
  8 devices, gathered to process 0, which saves them to ``out``."""
  from jax.experimental import multihost_utils
  assert (jax.process_count(), jax.device_count(), jax.local_device_count()) == (2, 8, 4)
  mesh = spmd.make_mesh(MESH)
  args = initial_args()
  tokens, labels = args[-2:]
  half, k = tokens.shape[0] // 2, jax.process_index()
  tokens = jax.make_array_from_process_local_data(
      NamedSharding(mesh, P("data", None)), tokens[k * half:(k + 1) * half], tokens.shape)

  def fetch(x: jax.Array) -> np.ndarray:
    assert x.sharding.device_set == set(jax.devices()), x.sharding
    return multihost_utils.process_allgather(x, tiled=True)

  outs, plan = run_steps(mesh, args, (tokens, labels), fetch, donate=(0, 1))
  uneven = np.arange(15 * 3, dtype=np.float32).reshape(15, 3)  # padded to 16 rows, then placed
  total = spmd.partition(lambda x: x.sum(0), mesh=mesh, in_specs=P(("data", "model")))(uneven)
  np.testing.assert_array_equal(fetch(total), uneven.sum(0))
  checkpoint.save(Path(out).with_suffix(".ckpt"), 0, placed_state(mesh, args))  # shards per process
  if k == 0:
    np.savez(out, *outs)
    Path(out).with_suffix(".json").write_text(json.dumps(collectives(plan)))


def launch(script: Path, *args: str, timeout: float = TIMEOUT_S) -> subprocess.CompletedProcess:
  """``python -m spmd launch -n 2 --cpu-devices 4 --timeout T script args``; the whole process
  group is killed if the launcher itself overruns."""
  command = [sys.executable, "-m", "spmd", "launch", "-n", "2", "--cpu-devices", "4",
             "--timeout", str(timeout), str(script), *args]
  proc = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True, start_new_session=True)
  try:
    out, _ = proc.communicate(timeout=timeout + 30)
  except subprocess.TimeoutExpired:
    os.killpg(proc.pid, signal.SIGKILL)
    out, _ = proc.communicate()
    pytest.fail(f"spmd launch overran its own timeout:\n{out[-3000:]}")
  return subprocess.CompletedProcess(command, proc.returncode, out)


def test_two_processes_match_one_process(tmp_path: Path) -> None:
  out = tmp_path / "result.npz"
  proc = launch(Path(__file__), str(out))
  assert proc.returncode == 0, proc.stdout[-4000:]

  # The one-process run equals the unpartitioned step: test_plan.py checks this workload.
  args = initial_args()
  one, plan = run_steps(spmd.make_mesh(MESH), args, tuple(args[-2:]), np.asarray)
  with np.load(out) as saved:
    two = [saved[f"arr_{i}"] for i in range(len(saved.files))]
  assert len(two) == len(one)
  for k, (a, b) in enumerate(zip(two, one)):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6, err_msg=f"output {k}")
  assert json.loads(out.with_suffix(".json").read_text()) == collectives(plan)
  # The state both processes checkpointed, restored here onto another mesh shape.
  state = placed_state(spmd.make_mesh(MESH), args)
  target = checkpoint.targets(state, spmd.make_mesh({"data": 4, "model": 2}),
                              traced_workload().in_specs[:2])
  restored = checkpoint.restore(out.with_suffix(".ckpt"), target)
  for got, want in zip(jax.tree.leaves(restored), jax.tree.leaves(state)):
    np.testing.assert_array_equal(got, want)


def test_launcher_propagates_first_failure_and_stops_the_rest(tmp_path: Path) -> None:
  script = tmp_path / "fail.py"
  script.write_text(textwrap.dedent("""
      import os, sys, time, jax
      from jax.experimental import multihost_utils
      print("process", jax.process_index(), "of", jax.process_count(), sys.argv[1:])
      print("pid", os.getpid())
      multihost_utils.sync_global_devices("printed")
      if jax.process_index() == 1:
        sys.exit(3)
      time.sleep(600)  # the launcher must stop this one
      """))
  proc = launch(script, "a", "b")
  assert proc.returncode == 3, proc.stdout[-2000:]
  assert "[p0] process 0 of 2 ['a', 'b']" in proc.stdout
  assert "[p1] process 1 of 2 ['a', 'b']" in proc.stdout
  (pid,) = re.findall(r"\[p0\] pid (\d+)", proc.stdout)
  with pytest.raises(ProcessLookupError):
    os.kill(int(pid), 0)  # stopped and reaped


def test_launcher_timeout_stops_every_process(tmp_path: Path) -> None:
  script = tmp_path / "hang.py"
  script.write_text("import os, time\nprint('pid', os.getpid())\ntime.sleep(600)\n")
  proc = launch(script, timeout=8)
  assert proc.returncode == 124, proc.stdout[-2000:]
  assert "spmd launch: timed out after 8.0 s" in proc.stdout
  pids = re.findall(r"\[p\d\] pid (\d+)", proc.stdout)
  assert len(pids) == 2, proc.stdout[-2000:]
  for pid in pids:
    with pytest.raises(ProcessLookupError):
      os.kill(int(pid), 0)


if __name__ == "__main__":
  child(sys.argv[1])
