"""JAX's own sharding tests, round 4 (themes of the explicit-sharding tests, pjit_test.py's calling
conventions, and lax_numpy / linalg / fft / random tests run with sharded inputs): explicit and
mixed meshes, custom derivatives and remat policies under grad, batched linear algebra, FFTs,
random draws sharded by their outputs' specs, jnp's indexed and sized ops, and pjit's argument
forms, written as a user of ``spmd.partition`` writes them. Each is compared with ``jax.jit``
given the same shardings (values and output shardings) and, where a partitioned program is built,
its plan with the compiled HLO (tests/helpers.py). Cases of test_jax_cases.py, test_jit_parity.py,
test_jax_sharding_suite.py, test_jax_sharding_suite3.py and test_primitives.py are not
repeated."""
from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import AxisType, NamedSharding
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec as P

import spmd
from helpers import (Cases, assert_like_jit, assert_trees_match, check_committed, check_jit, check_plan,
                     get_mesh, named, randn, spd)

CASES = Cases()  # functions of no arguments, or pytest.params of one
X, W = randn(8, 16), randn(16, 8, seed=1)

case = CASES.register


# --- explicit and mixed meshes ----------------------------------------------------------------

def typed_mesh(*types: AxisType) -> jax.sharding.Mesh:
  return jax.make_mesh((2, 4), ("x", "y"), axis_types=types)


def check_typed(fn: Callable, args: tuple, specs: tuple,
                types: tuple[AxisType, ...] = (AxisType.Explicit,) * 2) -> spmd.Plan:
  """helpers.check_committed on a mesh of ``types``."""
  return check_committed(fn, args, specs, typed_mesh(*types))


@case
def mixed_explicit_and_auto_axes():
  """x Explicit, y Auto: types carry only the explicit axis; the auto one is XLA's (spmd's)."""
  check_typed(lambda x, w: (jnp.tanh(x @ w), x.sum(1)), (X, W), (P("x", "y"), P("y")),
              (AxisType.Explicit, AxisType.Auto))


@case
def explicit_dot_out_sharding_of_a_contraction_split_alike():
  """Contracting dims sharded alike: JAX needs out_sharding, here a reduce-scatter."""
  check_typed(lambda x, w: jnp.dot(x, w, out_sharding=P("x", "y")), (X, W), (P("x", "y"), P("y")))


@case
def explicit_reshard_to_two_axes_on_one_dim():
  check_typed(lambda x: jax.sharding.reshard(x * 2, P(("x", "y"))).sum(1), (X,), (P("x", "y"),))


@case
def explicit_concatenate_stack_and_at_set():
  def f(x, y):
    return jnp.concatenate([x, y], 1), jnp.stack([x, y]), x.at[:, 0].set(1.0)
  check_typed(f, (X, randn(8, 16, seed=2)), (P("x"), P("x")))


@case
def explicit_scan_over_a_sharded_carry():
  def f(x, w):
    return lax.scan(lambda c, wi: (jnp.tanh(c * wi), c.sum()), x, w)
  check_typed(f, (X, randn(3, 16, seed=2)), (P("x", "y"), P(None, "y")))


@case
def explicit_argmax_max_and_cumsum():
  """JAX's typing refuses a cumulative op along a sharded dim: resharded first, as a user must."""
  def f(x):
    return x.max(0), jnp.argmax(x, 1), jnp.cumsum(jax.sharding.reshard(x, P(None, "y")), 0)
  check_typed(f, (X,), (P("x", "y"),))


@case
def explicit_zeros_like_and_full_typed_by_typeof():
  """An array made with the sharding ``jax.typeof`` reads from an argument."""
  def f(x):
    return x + jnp.full(x.shape, 2.0, out_sharding=jax.typeof(x).sharding), jnp.zeros_like(x)
  check_typed(f, (X,), (P(None, "y"),))


# --- custom derivatives, remat and forward mode inside -------------------------------------------

@jax.custom_vjp
def clipped_matmul(x, w):
  return x @ w


def _clipped_fwd(x, w):
  return x @ w, (x, w)  # residuals sharded as the operands


def _clipped_bwd(res, g):
  x, w = res
  return jnp.clip(g @ w.T, -0.1, 0.1), x.T @ g


clipped_matmul.defvjp(_clipped_fwd, _clipped_bwd)


@jax.custom_jvp
def softplus(x):
  return jnp.logaddexp(x, 0.0)


softplus.defjvp(lambda p, t: (softplus(p[0]), jax.nn.sigmoid(p[0]) * t[0]))


@case
def custom_vjp_with_sharded_residuals_under_grad():
  loss = lambda x, w: (jnp.tanh(clipped_matmul(x, w)) ** 2).sum()  # noqa: E731
  check_jit(jax.grad(loss, (0, 1)), (X, W), (P("a", "b"), P("b")), "a2b4")


@case
def grad_of_a_partitioned_function_calling_custom_vjp_and_custom_jvp():
  """jax.grad outside: spmd differentiates the original function (its custom rules) and
  partitions that VJP."""
  mesh = get_mesh("a2b4")
  loss = lambda x, w: softplus(clipped_matmul(x, w)).mean()  # noqa: E731
  specs = (P("a", "b"), P("b"))
  ours = jax.grad(spmd.partition(loss, mesh=mesh, in_specs=specs), (0, 1))
  theirs = jax.grad(jax.jit(loss, in_shardings=named(mesh, specs)), (0, 1))
  got, want = ours(X, W), theirs(X, W)
  assert_trees_match(got, want)
  assert_like_jit(got, want)


@case
def custom_jvp_value_and_grad():
  check_jit(jax.value_and_grad(lambda x, w: softplus(x @ w).mean(), 1), (X, W),
            (P("a"), P(None, "b")), "a2b4")


@pytest.mark.parametrize("policy", ["dots_saveable", "nothing_saveable",
                                    "dots_with_no_batch_dims_saveable"])
def test_checkpoint_policies_under_grad(policy: str) -> None:
  block = jax.checkpoint(lambda x, w: jnp.tanh(jnp.tanh(x @ w) @ w.T),
                         policy=getattr(jax.checkpoint_policies, policy))
  check_jit(jax.grad(lambda x, w: block(x, w).sum(), (0, 1)), (X, W), (P("a"), P(None, "b")),
            "a2b4")


@case
def checkpoint_save_any_names_but_these():
  def block(x, w):
    h = checkpoint_name(jnp.tanh(x @ w), "h")
    return jnp.sin(checkpoint_name(h @ w.T, "g")).sum()
  policy = jax.checkpoint_policies.save_any_names_but_these("g")
  check_jit(jax.grad(jax.checkpoint(block, policy=policy), 1), (X, W), (P("a", "b"), P("b")),
            "a2b4")


@case
def stop_gradient_target_in_a_loss():
  def loss(x, w, w_target):
    return ((jnp.tanh(x @ w) - lax.stop_gradient(jnp.tanh(x @ w_target))) ** 2).mean()
  check_jit(jax.grad(loss, 1), (X, W, randn(16, 8, seed=2)), (P("a"), P(None, "b"), P(None, "b")),
            "a2b4")


@case
def hessian_vector_product_by_jvp_of_grad_inside():
  """Forward mode inside the partitioned function (the function calling jax.jvp is partitioned)."""
  loss = lambda w, x: (jnp.tanh(x @ w) ** 2).sum()  # noqa: E731

  def hvp(w, x, v):
    return jax.jvp(lambda w: jax.grad(loss)(w, x), (w,), (v,))[1]
  check_jit(hvp, (W, X, randn(16, 8, seed=2)), (P(None, "b"), P("a"), P(None, "b")), "a2b4")


@case
def conjugate_gradient_on_a_sharded_vector():
  """jax.scipy.sparse.linalg.cg: a while loop around a sharded matvec (custom_linear_solve)."""
  a = spd(1, 32)[0]

  def solve(a, b):
    return jax.scipy.sparse.linalg.cg(lambda v: a @ v, b, tol=1e-6, maxiter=40)[0]
  check_jit(solve, (a, randn(32, seed=2)), (P("x"), P("x")), "x8")


# --- batched linear algebra, split over the batch ------------------------------------------------

LINALG: dict[str, Callable] = {
    "cholesky": jnp.linalg.cholesky,
    "qr": jnp.linalg.qr,
    "inv": jnp.linalg.inv,
    "solve": lambda a: jnp.linalg.solve(a, a[..., :1] + 1),
    "eigh": jnp.linalg.eigh,
    "svd": lambda a: jnp.linalg.svd(a, compute_uv=False),
    "slogdet": jnp.linalg.slogdet,
    "det": jnp.linalg.det,
    "solve_triangular": lambda a: jax.scipy.linalg.solve_triangular(a, a[..., :2], lower=True),
    "lu": lambda a: jax.scipy.linalg.lu_factor(a),
    "eigvalsh": jnp.linalg.eigvalsh,
    "matrix_power": lambda a: jnp.linalg.matrix_power(a / 8, 3),
}


@pytest.mark.parametrize("name", LINALG)
def test_linalg_over_a_sharded_batch(name: str) -> None:
  check_jit(LINALG[name], (spd(8, 4),), P(("a", "b")), "a2b4")


@case
def linalg_batch_split_over_one_axis_of_two():
  """A batch split over "a" only: each "b" shard computes its batch rows whole (replicated)."""
  check_jit(lambda a: jnp.linalg.cholesky(a) @ jnp.linalg.inv(a), (spd(4, 4),), P("a"), "a2b4")


# --- FFTs --------------------------------------------------------------------------------------

@case
def fft_along_an_unsharded_dim_with_a_sharded_batch():
  check_jit(lambda x: jnp.fft.fft(x, axis=1), (X,), P("a", None), "a2b4")


@case
def fft_along_a_sharded_dim():
  """out_specs as jax.jit returns them (open, spmd's output keeps the dim gathered: Known gaps)."""
  check_jit(lambda x: jnp.fft.ifft(jnp.fft.fft(x, axis=0), axis=0).real, (X,), P("a", "b"),
            "a2b4", P("a", "b"))


@case
def rfft_irfft_and_fft2():
  def f(x):
    return jnp.fft.irfft(jnp.fft.rfft(x) * 2, n=16), jnp.abs(jnp.fft.fft2(x.reshape(2, 4, 16)))
  check_jit(f, (X,), P("a"), "a2b4")


@case
def complex_dot_of_ffts():
  """A complex64 contraction over a sharded dim (its partial sums all-reduced)."""
  def f(x, w):
    return jnp.fft.fft(x) @ w.astype(jnp.complex64)
  check_jit(f, (X, W), (P("a", "b"), P("b")), "a2b4")


# --- random numbers sharded by their outputs -----------------------------------------------------

KEY = jax.random.key(7)
RANDOM: dict[str, Callable] = {
    "normal": lambda k: jax.random.normal(k, (8, 16)),
    "uniform": lambda k: jax.random.uniform(k, (8, 16), minval=-2.0, maxval=3.0),
    "bernoulli": lambda k: jax.random.bernoulli(k, 0.3, (8, 16)),
    "randint": lambda k: jax.random.randint(k, (8, 16), 0, 100),
    "gumbel": lambda k: jax.random.gumbel(k, (8, 16)),
    "truncated_normal": lambda k: jax.random.truncated_normal(k, -1.0, 1.0, (8, 16)),
}


@pytest.mark.parametrize("names", [("normal", "uniform", "bernoulli"),
                                   ("randint", "gumbel", "truncated_normal")], ids="-".join)
def test_random_draws_sharded_by_out_specs(names: tuple[str, ...]) -> None:
  check_jit(lambda k: [RANDOM[n](jax.random.fold_in(k, i)) for i, n in enumerate(names)], (KEY,),
            P(), "a2b4", P("a", "b"))


@case
def random_categorical_over_sharded_logits():
  check_jit(lambda k, logits: jax.random.categorical(k, logits, axis=1), (KEY, X), (P(), P("a")),
            "a2b4")


@case
def random_permutation_of_a_sharded_array():
  check_jit(lambda k, x: jax.random.permutation(k, x, axis=0), (KEY, X), (P(), P(None, "b")),
            "a2b4")


@case
def random_split_and_fold_in_of_sharded_keys():
  def f(keys, i):
    folded = jax.vmap(jax.random.fold_in, (0, None))(keys, i)
    return jax.vmap(lambda k: jax.random.normal(k, (4,)))(folded), jax.random.split(keys[0], 3)
  check_jit(f, (jax.random.split(KEY, 8), jnp.int32(3)), (P("a"), P()), "a2b4")


# --- jnp's sized, searched and indexed ops -------------------------------------------------------

INTS = np.random.default_rng(3).integers(0, 6, size=(16,)).astype(np.int32)


@case
def unique_with_size_and_fill():
  check_jit(lambda v: jnp.unique(v, size=8, fill_value=-1), (INTS,), P("x"), "x8")


@case
def where_one_argument_with_size():
  check_jit(lambda x: jnp.where(x > 0.5, size=20, fill_value=0), (X,), P("a", "b"), "a2b4")


@case
def searchsorted_sharded_queries():
  edges = np.linspace(-2, 2, 9).astype(np.float32)
  check_jit(lambda e, q: jnp.searchsorted(e, q), (edges, X), (P(), P("a", "b")), "a2b4")


@case
def histogram_of_a_sharded_array():
  check_jit(lambda x: jnp.histogram(x, bins=6, range=(-3.0, 3.0)), (X,), P("a", "b"), "a2b4")


@case
def convolve_full_of_a_sharded_signal():
  check_jit(lambda x, k: jnp.convolve(x, k), (randn(32), randn(5, seed=1)), (P("x"), P()), "x8")


@case
def einsum_optimize_three_operands():
  def f(x, w, v):
    return jnp.einsum("ij,jk,kl->il", x, w, v, optimize="greedy")
  check_jit(f, (X, W, randn(8, 4, seed=2)), (P("a"), P("b"), P()), "a2b4")


@case
def take_along_axis_with_sharded_indices():
  idx = np.random.default_rng(4).integers(0, 16, size=(8, 5)).astype(np.int32)
  check_jit(lambda x, i: jnp.take_along_axis(x, i, axis=1), (X, idx), (P("a"), P("a")), "a2b4")


@case
def scatter_at_sharded_indices_add_min_max_mul_set():
  idx = np.array([3, 0, 7, 3, 12, 5, 0, 9], np.int32)
  check_jit(lambda x, i, u: [getattr(x.at[i], op)(u) for op in ("add", "min", "max", "mul", "set")],
            (X.T, idx, randn(8, 8, seed=2)), (P(None, "b"), P("a"), P("a")), "a2b4")


@case
def put_with_sharded_indices():
  idx = np.array([1, 40, 7, 99, 64, 5, 120, 33], np.int32)
  check_jit(lambda x, i: jnp.put(x, i, -1.0, inplace=False), (X, idx), (P("a", "b"), P("a")),
            "a2b4")


@case
def pad_modes_wrap_edge_symmetric_linear_ramp_of_sharded_dims():
  modes = ("wrap", "edge", "symmetric", "linear_ramp")
  check_jit(lambda x: [jnp.pad(x, ((2, 3), (1, 0)), mode=m) for m in modes], (X,), P("a", "b"),
            "a2b4")


@case
def interp_sharded_queries():
  xp = np.linspace(-3, 3, 11).astype(np.float32)
  check_jit(lambda q, fp: jnp.interp(q, xp, fp), (X, np.sin(xp)), (P("a", "b"), P()), "a2b4")


@case
def cumprod_and_cumlogsumexp_along_sharded_dims():
  """out_specs as jax.jit returns them (open, spmd's outputs keep the relocated form the scans
  ran in: Known gaps)."""
  def f(x):
    return jnp.cumprod(1 + x / 10, axis=0), lax.cumlogsumexp(x, axis=1, reverse=True)
  check_jit(f, (X,), P("a", "b"), "a2b4", (P("a", "b"), P("a", "b")))


@case
def reduce_precision_population_count_and_diff():
  def f(x, n):
    return (lax.reduce_precision(x, exponent_bits=5, mantissa_bits=2), lax.population_count(n),
            jnp.diff(x, axis=1))
  check_jit(f, (X, INTS.reshape(8, 2) * 1000), (P("a", "b"), P("a")), "a2b4")


@case
def quantile_and_percentile_of_a_sharded_dim():
  """out_specs as jax.jit returns them (open, a sort's result is not yet laid out as jax.jit's:
  Known gaps)."""
  check_jit(lambda x: (jnp.quantile(x, 0.25, axis=0), jnp.percentile(x, 90.0, axis=1)), (X,),
            P("a", "b"), "a2b4", (P("b"), P("a")))


@case
def open_output_of_a_scan_along_a_sharded_dim():
  check_jit(lambda x: jnp.cumsum(x, axis=0), (X,), P("a", "b"), "a2b4")


# --- pjit's calling conventions ----------------------------------------------------------------

@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Layer:
  w: jax.Array
  b: jax.Array
  act: str = dataclasses.field(default="tanh", metadata={"static": True})


def apply_layer(layer: Layer, x: jax.Array) -> jax.Array:
  return getattr(jnp, layer.act)(x @ layer.w + layer.b)


@case
def registered_dataclass_argument_and_spec_prefix():
  layer = Layer(W, randn(8, seed=2))
  check_jit(apply_layer, (layer, X), (Layer(P(None, "b"), P("b")), P("a")), "a2b4")


@case
def static_argnums_change_the_shape_and_recompile():
  mesh = get_mesh("a2b4")
  fn = lambda x, k: jnp.tile(x, (1, k)).sum(0)  # noqa: E731
  ours = spmd.partition(fn, mesh=mesh, in_specs=(P("a"),), static_argnums=1)
  theirs = jax.jit(fn, in_shardings=(NamedSharding(mesh, P("a")),), static_argnums=1)
  for k in (1, 3):
    got, want = ours(X, k), theirs(X, k)
    assert_trees_match(got, want)
    assert_like_jit(got, want)
    check_plan(ours, X, k)


@case
def keyword_arguments_and_static_argnames():
  mesh = get_mesh("a2b4")

  def scaled(x, w, scale):
    return (x @ w) * scale
  ours = spmd.partition(scaled, mesh=mesh, in_specs=(P("a"), P(None, "b")),
                        static_argnames="scale")
  theirs = jax.jit(scaled, in_shardings=named(mesh, (P("a"), P(None, "b"))),
                   static_argnames="scale")
  got, want = ours(X, w=W, scale=2.0), theirs(X, W, 2.0)  # jax.jit with shardings: no kwargs
  assert_trees_match(got, want)
  assert_like_jit(got, want)


@case
def donation_as_jax_jit_does():
  """A donated argument is consumed as jax.jit consumes it (deleted where the backend reuses
  its buffer), the other kept."""
  mesh = get_mesh("a2b4")
  fn = lambda x, w: (x * 2, x @ w)  # noqa: E731
  shardings = (NamedSharding(mesh, P("a")), NamedSharding(mesh, P()))
  deleted = []
  for make in (lambda: spmd.partition(fn, mesh=mesh, in_specs=(P("a"), P()), donate_argnums=0),
               lambda: jax.jit(fn, in_shardings=shardings, donate_argnums=0)):
    x, w = (jax.device_put(a, s) for a, s in zip((X, W), shardings))
    out = make()(x, w)
    assert_trees_match(out, fn(X, W))
    deleted.append((x.is_deleted(), w.is_deleted()))
  assert deleted[0] == deleted[1], deleted


@case
def arguments_placed_by_device_put_on_other_shardings():
  """Committed arguments sharded otherwise than in_specs: jax.jit refuses them, spmd reshards
  them on entry (its plan lists the reshards) and returns what jax.jit returns for the
  arguments placed as in_specs say."""
  mesh = get_mesh("a2b4")
  fn = lambda x, w: jnp.tanh(x @ w)  # noqa: E731
  specs = (P("a"), P(None, "b"))
  args = (jax.device_put(X, NamedSharding(mesh, P(None, "b"))),
          jax.device_put(W, NamedSharding(mesh, P("a"))))
  jitted = jax.jit(fn, in_shardings=named(mesh, specs))
  with pytest.raises(ValueError, match="does not match"):
    jitted(*args)
  want = jitted(*(jax.device_put(a, s) for a, s in zip((X, W), named(mesh, specs))))
  ours = spmd.partition(fn, mesh=mesh, in_specs=specs)
  got = ours(*args)
  assert_trees_match(got, want)
  assert_like_jit(got, want)
  assert check_plan(ours, *args).collectives


@case
def plan_and_lower_from_shape_dtype_structs_with_shardings():
  """in_specs None: the abstract arguments' shardings are the specs, as for jax.jit's lower."""
  mesh = get_mesh("a2b4")
  abstract = (jax.ShapeDtypeStruct(X.shape, X.dtype, sharding=NamedSharding(mesh, P("a", "b"))),
              jax.ShapeDtypeStruct(W.shape, W.dtype, sharding=NamedSharding(mesh, P("b"))))
  fn = lambda x, w: jnp.tanh(x @ w)  # noqa: E731
  f = spmd.partition(fn, mesh=mesh)
  compiled = f.lower(*abstract).compile()
  args = tuple(jax.device_put(a, s.sharding) for a, s in zip((X, W), abstract))
  want = jax.jit(fn).lower(*abstract).compile()(*args)
  got = compiled(*args)
  assert_trees_match(got, want)
  assert_like_jit(got, want)
  check_plan(f, *abstract)


@case
def pytree_outputs_with_none_and_a_nested_out_spec_prefix():
  fn = lambda x, w: {"h": (x @ w, None), "s": [x.sum(), x.max(1)]}  # noqa: E731
  check_jit(fn, (X, W), (P("a", "b"), P("b")), "a2b4",
            {"h": (P("a", "b"), None), "s": [P(), P("a")]})


@pytest.mark.parametrize("run", [c if not callable(c) else pytest.param(c, id=c.__name__)
                                 for c in CASES])
def test_case(run: Callable[[], None]) -> None:
  run()
