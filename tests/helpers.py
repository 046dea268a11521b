"""Shared test helpers: the test meshes, and the one check of a partitioned function: its values,
its plan against the compiled program, and no op run replicated for want of a rule.

Import after ``conftest.py`` has set up the simulated devices (pytest does this first).
"""
from __future__ import annotations

import functools
import os
from collections import Counter
from typing import Any, Callable, Collection, Mapping

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import spmd
from spmd.hlo import collectives

# Name -> mesh axes (major to minor); x2 and x4 use the first 2 and 4 of the 8 simulated devices.
MESH_AXES: dict[str, dict[str, int]] = {
    "x2": {"x": 2},
    "x4": {"x": 4},
    "x8": {"x": 8},
    "a2b4": {"a": 2, "b": 4},
    "a2b2c2": {"a": 2, "b": 2, "c": 2},
}
MESH_NAMES = ("x8", "a2b4", "a2b2c2")  # the meshes over all 8 devices

# rtol = atol per floating dtype where a test gives none: a few ulps once sums are reordered
# (bfloat16: a few bf16 ulps, 2^-8 = 0.4%, on inputs without cancellation, as partial results are
# rounded to bfloat16 like the output).
TOLERANCE = {jnp.dtype(jnp.bfloat16): 2e-2, jnp.dtype(jnp.float16): 1e-3,
             jnp.dtype(jnp.float32): 1e-5, jnp.dtype(jnp.complex64): 1e-5,
             jnp.dtype(jnp.float64): 1e-12, jnp.dtype(jnp.complex128): 1e-12}


class Cases(list):
  """A test file's cases: functions of no arguments that run their checks, registered by
  decorating them with ``register`` (or pytest.params of one, appended)."""

  def register(self, fn: Callable[[], None]) -> Callable[[], None]:
    self.append(fn)
    return fn

  def params(self, xfail: Mapping[Callable, str]) -> list:
    """The cases as pytest params named by their functions; those in ``xfail`` are strict
    xfails with their reasons."""
    return [pytest.param(c, id=c.__name__, marks=[pytest.mark.xfail(strict=True, reason=xfail[c])]
                         if c in xfail else []) for c in self]


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


def assert_trees_match(got: Any, want: Any, rtol: float | None = None, atol: float | None = None,
                       *, atol_per_magnitude: bool = False) -> None:
  """Same structure, shapes and dtypes; floats close (``rtol``/``atol``, else ``TOLERANCE`` of
  the leaf's dtype; ``atol_per_magnitude``: atol times max(1, max |want|) per leaf, for sums
  whose terms cancel), ints / bools / keys exactly equal."""
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
    if jnp.issubdtype(w.dtype, jnp.inexact):
      tol = TOLERANCE[jnp.dtype(w.dtype)]
      scale = max(1.0, float(np.max(np.abs(w), initial=0.0))) if atol_per_magnitude else 1.0
      wide = np.complex128 if jnp.issubdtype(w.dtype, jnp.complexfloating) else np.float64
      np.testing.assert_allclose(g.astype(wide), w.astype(wide), err_msg=f"leaf {k}",
                                 rtol=tol if rtol is None else rtol,
                                 atol=(tol if atol is None else atol) * scale)
    else:
      np.testing.assert_array_equal(g, w, err_msg=f"leaf {k}")


def as_jax(args: tuple) -> tuple:
  """``args`` with numpy leaves as uncommitted jax arrays (made outside ``jax.set_mesh``, which
  would commit them), so that a function may use jax-only methods (x.at[...]) on them."""
  return jax.tree_util.tree_map(
      lambda a: jnp.asarray(a) if isinstance(a, (np.ndarray, np.generic)) else a, tuple(args))


def assert_partitioned_matches(fn: Callable, args: tuple, in_specs: Any, mesh: Mesh | str,
                               out_specs: Any = None, rtol: float | None = None,
                               atol: float | None = None, *, atol_per_magnitude: bool = False,
                               reference: Callable | None = None, backend: str | None = None,
                               replicated: Collection[str] = (), like_jit: bool = False,
                               like: Any = None, **options: Any) -> spmd.Plan:
  """Partitions ``fn`` over ``mesh`` (a Mesh or a ``MESH_AXES`` name) and checks the three
  things every partitioned program must satisfy:

  - its values equal ``reference(*args)`` (default ``fn``), by ``assert_trees_match``;
  - with backend "spmd", its plan moves what the compiled program does: the same bytes per kind
    of collective (``assert_plan_is_hlo``);
  - no op ran replicated for want of a sharding rule, except the primitives ``replicated``
    names, which must (a test that expects the fallback says so);
  - with ``like_jit``: the outputs' shardings, dtypes and weak types are those of ``jax.jit``
    given the same specs as in_shardings / out_shardings (``assert_like_jit``); with ``like``
    (outputs jax.jit gave), those of ``like``.

  ``backend`` defaults to ``$SPMD_TEST_BACKEND``, else the library's default; ``options`` go to
  ``spmd.partition``. Returns the plan for further asserts.
  """
  mesh = as_mesh(mesh)
  backend = backend or os.environ.get("SPMD_TEST_BACKEND")
  if backend:
    options["backend"] = backend
  args = as_jax(args)
  f = spmd.partition(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs, **options)
  plan = f.plan(*args)
  out = f(*args)
  assert_trees_match(out, (reference or fn)(*args), rtol, atol,
                     atol_per_magnitude=atol_per_magnitude)
  if like_jit:
    like = jax.jit(fn, in_shardings=named(mesh, in_specs),
                   out_shardings=named(mesh, out_specs))(*args)
  if like is not None:
    assert_like_jit(out, like)
  if plan.backend == "spmd":
    assert_plan_is_hlo(plan, f.lower(*args).compile().as_text())
  fallbacks = missing_rules(plan)
  expected = tuple(f"{p} at " for p in replicated)
  unexpected = [w for w in fallbacks if not w.startswith(expected)]
  assert not unexpected, "\n".join(unexpected) + "\n" + plan.explain()
  absent = [p for p in expected if not any(w.startswith(p) for w in fallbacks)]
  assert not absent, f"expected to run replicated: {absent}\n{plan.explain()}"
  return plan


def check_jit(fn: Callable, args: tuple, in_specs: Any, mesh: Any, out_specs: Any = None,
              **options: Any) -> spmd.Plan:
  """``assert_partitioned_matches`` with ``jax.jit`` (the same shardings) as the reference: its
  values, and its outputs' shardings, dtypes and weak types (``assert_like_jit``). Both run under
  ``jax.set_mesh`` of the mesh, as JAX's tests do (an output sharded like an input is spelled as
  in_specs spell it there, and trimmed of trailing Nones elsewhere). Returns the plan."""
  mesh, arrays = as_mesh(mesh), as_jax(args)  # uncommitted unless the caller set a mesh
  with jax.set_mesh(mesh):
    want = jax.jit(fn, in_shardings=named(mesh, in_specs),
                   out_shardings=named(mesh, out_specs))(*args)
    return assert_partitioned_matches(fn, arrays, in_specs, mesh, out_specs,
                                      reference=lambda *_: want, like=want, **options)


def check_jit_within_xla(fn: Callable, args: tuple, in_specs: Any, mesh: Any,
                         out_specs: Any = None) -> spmd.Plan:
  """``check_jit``, and the plan moves no more bytes per device than XLA's own partitioner given
  the same specs (``xla_bytes``). Returns the plan."""
  plan = check_jit(fn, args, in_specs, mesh, out_specs)
  assert plan.total_bytes <= xla_bytes(fn, args, in_specs, mesh, out_specs), plan.explain()
  return plan


def both(fn: Callable, in_specs: Any, out_specs: Any = None,
         mesh: Mesh | str = "a2b4") -> tuple[Callable, Callable]:
  """``fn`` partitioned by spmd over ``mesh``, and ``jax.jit`` of it with the same shardings."""
  mesh = as_mesh(mesh)
  return (spmd.partition(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs),
          jax.jit(fn, in_shardings=named(mesh, in_specs), out_shardings=named(mesh, out_specs)))


def same(got: Any, want: Any, shardings: bool = True) -> None:
  """Values within float32 sums' reordering; with ``shardings``, jax.jit's output shardings."""
  assert_trees_match(got, want, rtol=1e-5, atol=1e-5)
  if shardings:
    assert_like_jit(got, want)


def spd(batch: int, n: int, seed: int = 0) -> np.ndarray:
  """A batch of well-conditioned symmetric positive definite matrices."""
  a = randn(batch, n, n, seed=seed)
  return a @ a.transpose(0, 2, 1) + n * np.eye(n, dtype=np.float32)


def check_plan(partitioned: Callable, *args: Any, **kwargs: Any) -> spmd.Plan:
  """assert_partitioned_matches's other checks, for a function whose values a test compared
  itself (a loop of training steps, NNX modules updated in place): the plan moves the compiled
  program's bytes, and no op ran replicated for want of a rule. Returns the plan."""
  plan = partitioned.plan(*args, **kwargs)
  assert_plan_is_hlo(plan, partitioned.lower(*args, **kwargs).compile().as_text())
  assert not missing_rules(plan), plan.explain()
  return plan


def is_spec(x: Any) -> bool:
  """A leaf of a spec tree: None, a PartitionSpec or a NamedSharding."""
  return x is None or isinstance(x, (P, NamedSharding))


def named(mesh: Mesh, specs: Any) -> Any:
  """``specs`` with its PartitionSpec leaves as NamedShardings on ``mesh`` (jax.jit's form)."""
  return jax.tree_util.tree_map(lambda s: NamedSharding(mesh, s) if isinstance(s, P) else s,
                                specs, is_leaf=is_spec)


def assert_like_jit(got: Any, want: Any) -> None:
  """Every output has ``jax.jit``'s sharding, dtype and weak type."""
  got_leaves, want_leaves = jax.tree_util.tree_leaves(got), jax.tree_util.tree_leaves(want)
  assert len(got_leaves) == len(want_leaves)
  for k, (g, w) in enumerate(zip(got_leaves, want_leaves)):
    got_weak, want_weak = jax.typeof(g).weak_type, jax.typeof(w).weak_type  # keys have no attr
    assert (g.sharding, g.dtype, got_weak) == (w.sharding, w.dtype, want_weak), (
        f"leaf {k}: {g.sharding}, {g.dtype}, weak {got_weak} != jax.jit's {w.sharding}, "
        f"{w.dtype}, weak {want_weak}")


def check_committed(fn: Callable, args: tuple, specs: tuple, mesh: Mesh) -> spmd.Plan:
  """JAX's explicit-sharding tests' form: arguments committed to ``mesh`` as ``specs`` say (on a
  mesh with Explicit axes their types carry the shardings), ``jax.jit`` without shardings under
  ``jax.set_mesh``; spmd takes the committed arguments with in_specs None, and returns jax.jit's
  values and output types."""
  args = tuple(jax.device_put(a, NamedSharding(mesh, s)) for a, s in zip(args, specs))
  with jax.set_mesh(mesh):
    want = jax.jit(fn)(*args)
  plan = assert_partitioned_matches(fn, args, None, mesh, reference=lambda *_: want)
  assert_like_jit(spmd.partition(fn, mesh=mesh)(*args), want)
  return plan


def assert_plan_is_hlo(plan: spmd.Plan, hlo_text: str) -> None:
  """The plan's collectives move what the compiled program's do: the same bytes per device for
  every kind of collective (XLA may combine collectives of one kind into one instruction, as it
  does a gradient's all-reduces, or split a halo's collective-permute by the devices it pairs)."""
  planned: Counter = Counter()
  for c in plan.collectives:
    planned[c.kind] += c.bytes
  compiled: Counter = Counter()
  for c in collectives(hlo_text):
    compiled[c.kind] += c.bytes
  assert planned == compiled, f"plan {dict(planned)} != compiled {dict(compiled)}\n{plan.explain()}"


def xla_bytes(fn: Callable, args: tuple, in_specs: Any, mesh: Mesh | str,
              out_specs: Any = None) -> int:
  """Per-device bytes of the collectives XLA's own partitioner compiles for ``fn`` given the
  same specs as ``jax.jit``'s in/out shardings (an argument, or a leaf of one, split unevenly,
  which ``jax.jit`` cannot take, arrives replicated and is constrained to its spec first: a
  local slice)."""
  mesh = as_mesh(mesh)
  specs = (in_specs,) if is_spec(in_specs) else tuple(in_specs)
  even = tuple(jax.tree_util.tree_map(
      lambda s, a: s is None or _divides(s, np.shape(a), mesh), s, a, is_leaf=is_spec)
      for s, a in zip(specs, args))

  def constrain(s: Any, ok: bool, x: Any) -> Any:
    return x if ok else jax.lax.with_sharding_constraint(x, NamedSharding(mesh, s))

  def constrained(*xs: Any) -> Any:
    return fn(*(jax.tree_util.tree_map(constrain, s, ok, x, is_leaf=is_spec)
                for x, s, ok in zip(xs, specs, even)))

  def arrival(s: Any, ok: bool) -> NamedSharding | None:
    """The spec, None (open) for none, replicated for an uneven one (left open, XLA would
    place it by the constraint: unevenly, which JAX cannot return)."""
    if not ok:
      return NamedSharding(mesh, P())
    return NamedSharding(mesh, s) if isinstance(s, P) else None

  jitted = jax.jit(constrained, out_shardings=named(mesh, out_specs), in_shardings=tuple(
      jax.tree_util.tree_map(arrival, s, ok, is_leaf=is_spec) for s, ok in zip(specs, even)))
  return sum(c.bytes for c in collectives(jitted.lower(*args).compile().as_text()))


def no_more_than_xla(fn: Callable, args: tuple, in_specs: Any, mesh: Mesh | str,
                     out_specs: Any = None, **options: Any) -> spmd.Plan:
  """``assert_partitioned_matches``, and the plan moves no more bytes per device than XLA's own
  partitioner given the same specs (``xla_bytes``). Returns the plan."""
  plan = assert_partitioned_matches(fn, args, in_specs, mesh, out_specs, **options)
  assert plan.total_bytes <= xla_bytes(fn, args, in_specs, mesh, out_specs), plan.explain()
  return plan


def ints(*shape: int, seed: int = 0, high: int = 100) -> np.ndarray:
  """``shape`` int32 values in [-high, high)."""
  return rng(seed).integers(-high, high, shape).astype(np.int32)


def indices(size: int, *shape: int, seed: int = 0) -> np.ndarray:
  """``shape`` int32 indices in [0, size)."""
  return rng(seed).integers(0, size, shape).astype(np.int32)


def _divides(spec: P, shape: tuple[int, ...], mesh: Mesh) -> bool:
  """Every dim of ``shape`` splits evenly over the mesh axes ``spec`` names for it."""
  for n, axes in zip(shape, spec):
    axes = () if axes is None else (axes,) if isinstance(axes, str) else axes
    if n % int(np.prod([mesh.shape[a] for a in axes])):
      return False
  return True


def missing_rules(plan: spmd.Plan) -> list[str]:
  """The plan's warnings about primitives without a sharding rule."""
  return [w for w in plan.warnings if "has no sharding rule" in w]


# The ("data", "model") meshes of the flax example tests, by name.
FLAX_MESHES: dict[str, dict[str, int]] = {
    "2x4": {"data": 2, "model": 4}, "8x1": {"data": 8, "model": 1}, "1x8": {"data": 1, "model": 8}}


def mesh_of(name: str) -> Mesh:
  """The flax tests' mesh called ``name`` (see ``FLAX_MESHES``)."""
  return spmd.make_mesh(FLAX_MESHES[name])


def train_loop(reference: Callable, partitioned: Callable, state: tuple, batches: list,
               from_reference: bool = False, **tolerance: Any) -> spmd.Plan:
  """Steps feeding the state back, partitioned beside ``reference`` (the jitted step): their
  states and losses stay equal; then ``check_plan``. ``from_reference``: each partitioned step
  starts from the reference's state (bfloat16 steps, whose rounding differences would otherwise
  compound from step to step). Returns the plan."""
  want = got = state
  for batch in batches:
    start = want if from_reference else got
    *want, want_loss = reference(*want, *batch)
    *got, got_loss = partitioned(*start, *batch)
    assert_trees_match((got, got_loss), (want, want_loss), **tolerance)
  return check_plan(partitioned, *state, *batches[0])


def nnx_steps(step: Callable, fresh: Callable, mesh: Mesh, in_specs: Any, batches: list,
              rtol: float = 1e-4, atol: float = 1e-5, **options: Any) -> tuple[spmd.Plan, Any]:
  """``step`` partitioned beside ``nnx.jit(step)``, each over its own ``fresh()`` modules, for
  every batch: the same outputs, then the same module states; then ``check_plan``. Returns the
  plan and the partitioned modules."""
  from flax import nnx  # here: the other test files need no flax

  ours, reference = fresh(), fresh()
  partitioned = spmd.partition(step, mesh=mesh, in_specs=in_specs, **options)
  jitted = nnx.jit(step)
  for batch in batches:
    assert_trees_match(partitioned(*ours, *batch), jitted(*reference, *batch), rtol=rtol,
                       atol=atol)
  for got, want in zip(ours, reference):
    assert_trees_match(nnx.state(got), nnx.state(want), rtol=rtol, atol=atol)
  return check_plan(partitioned, *ours, *batches[0]), ours
