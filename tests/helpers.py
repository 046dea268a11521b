"""Shared test helpers: the test meshes and a check that a partitioned function matches ``fn``.

Import after ``conftest.py`` has set up the simulated devices (pytest does this first).
"""
from __future__ import annotations

import functools
import os
from typing import Any, Mapping

import jax
import numpy as np
from jax.sharding import Mesh

import spmd

# Name -> mesh axes (major to minor); every test mesh uses all 8 simulated devices.
MESH_AXES: dict[str, dict[str, int]] = {
    "x8": {"x": 8},
    "a2b4": {"a": 2, "b": 4},
    "a2b2c2": {"a": 2, "b": 2, "c": 2},
}
MESH_NAMES = tuple(MESH_AXES)


@functools.lru_cache(maxsize=None)
def get_mesh(name: str) -> Mesh:
  """The test mesh called ``name`` (see ``MESH_AXES``), built once per session."""
  return spmd.make_mesh(MESH_AXES[name])


def as_mesh(mesh: Mesh | str | Mapping[str, int]) -> Mesh:
  """A Mesh, a ``MESH_AXES`` name, or an axes mapping, as a Mesh."""
  if isinstance(mesh, Mesh):
    return mesh
  if isinstance(mesh, str):
    return get_mesh(mesh)
  return spmd.make_mesh(dict(mesh))


def rng(seed: int = 0) -> np.random.Generator:
  return np.random.default_rng(seed)


def randn(*shape: int, seed: int = 0, dtype: Any = np.float32) -> np.ndarray:
  return rng(seed).standard_normal(shape).astype(dtype)


def assert_trees_match(got: Any, want: Any, rtol: float = 1e-5, atol: float = 1e-5) -> None:
  """Same structure, shapes and dtypes; floats close, ints / bools / keys exactly equal."""
  got_leaves, got_tree = jax.tree_util.tree_flatten(got)
  want_leaves, want_tree = jax.tree_util.tree_flatten(want)
  assert got_tree == want_tree, f"output structure {got_tree} != {want_tree}"
  for k, (g, w) in enumerate(zip(got_leaves, want_leaves)):
    dtype = getattr(w, "dtype", None)
    if dtype is not None and jax.dtypes.issubdtype(dtype, jax.dtypes.prng_key):
      g, w = jax.random.key_data(g), jax.random.key_data(w)
    g, w = np.asarray(g), np.asarray(w)
    assert g.shape == w.shape, f"leaf {k}: shape {g.shape} != {w.shape}"
    assert g.dtype == w.dtype, f"leaf {k}: dtype {g.dtype} != {w.dtype}"
    if np.issubdtype(w.dtype, np.inexact):
      np.testing.assert_allclose(g, w, rtol=rtol, atol=atol, err_msg=f"leaf {k}")
    else:
      np.testing.assert_array_equal(g, w, err_msg=f"leaf {k}")


def assert_partitioned_matches(fn: Any, args: tuple, in_specs: Any, mesh: Mesh | str,
                               out_specs: Any = None, rtol: float = 1e-5, atol: float = 1e-5,
                               *, backend: str | None = None) -> spmd.Plan:
  """Partitions ``fn`` over ``mesh``, runs it on ``args`` and compares with ``fn(*args)``.

  ``mesh`` is a Mesh or a ``MESH_AXES`` name. ``backend`` defaults to ``$SPMD_TEST_BACKEND`` or
  else the library's default. Returns the plan so callers can inspect it.
  """
  mesh = as_mesh(mesh)
  backend = backend or os.environ.get("SPMD_TEST_BACKEND")
  options = {"backend": backend} if backend else {}
  # numpy leaves as jax arrays, so that ``fn`` may use jax-only methods (x.at[...]) on them
  args = jax.tree_util.tree_map(
      lambda a: jax.numpy.asarray(a) if isinstance(a, (np.ndarray, np.generic)) else a,
      tuple(args))
  f = spmd.partition(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, **options)
  plan = f.plan(*args)
  got = f(*args)
  want = fn(*args)
  assert_trees_match(got, want, rtol=rtol, atol=atol)
  return plan


def missing_rules(plan: spmd.Plan) -> list[str]:
  """The plan's warnings about primitives without a sharding rule."""
  return [w for w in plan.warnings if "has no sharding rule" in w]


def assert_all_rules(plan: spmd.Plan) -> None:
  missing = missing_rules(plan)
  assert not missing, "\n".join(missing) + "\n" + plan.explain()
