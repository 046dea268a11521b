"""spmd.checkpoint: a sharded train state saved on one mesh and restored onto others, exactly;
an interrupted save leaves the previous checkpoint readable."""
from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import jax
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import spmd
from spmd import checkpoint
from spmd.train import optimizer_specs

ROOT = Path(__file__).resolve().parents[1]
OPT = optax.adamw(1e-2)
# Meshes in the order the state travels, each with the axes its specs split a param's major and
# minor dims over: (2, 4) -> (4, 2) -> (8,) -> (2, 4).
MESHES = [({"data": 2, "model": 4}, ("data", "model")),
          ({"data": 4, "model": 2}, ("data", "model")),
          ({"x": 8}, (None, "x")),
          ({"data": 2, "model": 4}, ("data", "model"))]


def train_state(seed: int = 0) -> tuple:
  """(params, AdamW state, step): float32 and bfloat16 params, the optimizer's moments not zero."""
  rng = np.random.default_rng(seed)
  params = {"w1": rng.normal(size=(16, 32)).astype(np.float32),
            "w2": rng.normal(size=(32, 8)).astype(np.float32),
            "emb": rng.normal(size=(8, 16)).astype(jax.numpy.bfloat16)}
  grads = jax.tree.map(lambda p: np.ones_like(p), params)
  _, opt_state = OPT.update(grads, OPT.init(params), params)
  return params, opt_state, np.int32(7 + seed)


def specs(state: tuple, major: str | None, minor: str) -> tuple:
  param_specs = {"w1": P(major, minor), "w2": P(minor, None), "emb": P(minor, None)}
  return param_specs, optimizer_specs(OPT, state[1], param_specs), P()


def placed(state: tuple, axes: dict[str, int], split: tuple) -> tuple:
  mesh = spmd.make_mesh(axes)
  shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), specs(state, *split),
                           is_leaf=lambda s: isinstance(s, P))
  return jax.device_put(state, shardings)


def assert_restored(got: tuple, want: tuple, target: tuple) -> None:
  assert jax.tree.structure(got) == jax.tree.structure(want)
  for g, w, t in zip(jax.tree.leaves(got), jax.tree.leaves(want), jax.tree.leaves(target)):
    assert g.dtype == w.dtype and g.sharding == t.sharding
    np.testing.assert_array_equal(np.asarray(g), np.asarray(w))  # bits, not rounding


def test_round_trip_across_mesh_shapes(tmp_path: Path) -> None:
  state = train_state()
  current = placed(state, *MESHES[0])
  for step, (axes, split) in enumerate(MESHES[1:]):
    checkpoint.save(tmp_path, step, current)
    target = checkpoint.targets(state, spmd.make_mesh(axes), specs(state, *split))
    current = checkpoint.restore(tmp_path, target)
    assert_restored(current, state, target)
  assert checkpoint.latest_step(tmp_path) == len(MESHES) - 2
  first = checkpoint.targets(state, spmd.make_mesh(MESHES[2][0]), specs(state, *MESHES[2][1]))
  assert_restored(checkpoint.restore(tmp_path, first, step=0), state, first)


def test_interrupted_save_leaves_the_previous_checkpoint(tmp_path: Path) -> None:
  state = placed(train_state(), *MESHES[0])
  checkpoint.save(tmp_path, 1, state)
  # Step 2 dies as orbax is about to commit it (every byte written, the rename not done): the
  # process exits at once, running no cleanup.
  crash = textwrap.dedent(f"""
      import os, sys
      sys.path.insert(0, {str(Path(__file__).parent)!r})
      from orbax.checkpoint._src.path import atomicity
      from test_checkpoint import MESHES, checkpoint, placed, train_state

      async def die(self):
        os._exit(17)

      atomicity.AtomicRenameTemporaryPath.finalize = die
      checkpoint.save({str(tmp_path)!r}, 2, placed(train_state(seed=1), *MESHES[0]))
      """)
  proc = subprocess.run([sys.executable, "-c", crash], cwd=ROOT, capture_output=True, text=True,
                        timeout=120)
  assert proc.returncode == 17, proc.stderr[-3000:]
  leftovers = [p.name for p in tmp_path.iterdir() if p.name not in ("1",)]
  assert leftovers and all("tmp" in name for name in leftovers), leftovers

  assert checkpoint.latest_step(tmp_path) == 1
  target = checkpoint.targets(state, spmd.make_mesh(MESHES[1][0]),
                              specs(state, *MESHES[1][1]))
  assert_restored(checkpoint.restore(tmp_path, target), state, target)
  # A restarted run saves step 2 again over the debris.
  again = placed(train_state(seed=1), *MESHES[0])
  checkpoint.save(tmp_path, 2, again)
  assert_restored(checkpoint.restore(tmp_path, target), again, target)


def test_restore_without_a_checkpoint_says_where_it_looked(tmp_path: Path) -> None:
  missing = tmp_path / "run"
  with pytest.raises(FileNotFoundError, match=f"no complete checkpoint in {missing}"):
    checkpoint.restore(missing, {})
  assert checkpoint.latest_step(missing) is None and not missing.exists()  # nothing created
