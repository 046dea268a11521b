"""JAX's own tests, round 11 (themes of tests/api_test.py's complex and integer derivatives,
custom_api_test.py, checkpoint policies, lax_numpy_test.py's array-API and numpy-2 functions,
lax_scipy_special_test.py and random_test.py, run with sharded inputs): gradients of real
functions of complex inputs and holomorphic gradients along a sharded dim, float0 cotangents of
integer inputs under ``allow_int``; custom_jvp with per-argument ``defjvps``, custom_vjp with
pytree residuals and ``None`` cotangents, ``closure_convert`` over sharded values; checkpoint
policies not yet covered (``everything_saveable``, ``save_any_names_but_these``,
``save_from_both_policies``, remat inside a scan body); ``optimization_barrier`` and
``lax.map`` with ``batch_size``; jnp's vectorize / apply_along_axis / apply_over_axes over a
sharded batch, the matvec / vecmat / vecdot / matrix_transpose family, cumulative_prod with
``include_initial`` and nan-cumulatives, unwrap / gradient / ediff1d along a sharded dim, sized
unique_counts / unique_inverse / flatnonzero / extract, pad modes with ``stat_length`` and
``linear_ramp``, correlate and cross, fill_diagonal and tril_indices; segment_min / segment_prod;
approx_min_k, reduce_and / reduce_xor and argmin's index dtype; elementwise corners (sinc, i0,
heaviside, logaddexp2, hypot, copysign, float_power, cbrt, spacing) and dtype promotion (int32 x
float16, bool arithmetic, uint8 wrap-around); random.cauchy / logistic / weibull_min / pareto
with sharded output shapes and sharded batches of folded-in keys. Even and uneven sizes; f32,
f16, complex64, int32, uint8 and bool. Each is compared with ``jax.jit`` given the same shardings
(values and output shardings) or, where a dim is uneven, with the unpartitioned function, and its
plan with the compiled HLO (tests/helpers.py). Cases of the earlier suites, test_jax_cases.py,
test_jit_parity.py, test_primitives.py and test_control_flow.py are not repeated."""
from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.ad_checkpoint import checkpoint_name
from jax.sharding import PartitionSpec as P

from helpers import (Cases, assert_partitioned_matches, check_jit, check_jit_within_xla, indices,
                     ints, randn)

CASES = Cases()  # functions of no arguments
MESH = "a2b4"
X = randn(8, 16)
U = randn(6, 10, seed=7)  # uneven over 'a' (2) x 'b' (4) along dim 1, and over 4 along dim 0
Z = (randn(8, 16, seed=3) + 1j * randn(8, 16, seed=4)).astype(np.complex64)

case = CASES.register


# --- complex and integer derivatives --------------------------------------------------------------

@case
def grad_of_a_real_loss_of_complex_inputs_along_a_sharded_dim():
  def loss(z, w):
    return jnp.sum(jnp.abs(z * w) ** 2) + jnp.sum(jnp.real(z) * jnp.imag(jnp.conj(w)))
  check_jit(jax.grad(loss, argnums=(0, 1)), (Z, Z[::-1].copy()), (P("a", "b"), P(None, "b")),
            MESH)


@case
def holomorphic_grad_and_complex_vjp_of_a_complex_dot():
  w = (randn(16, 8, seed=5) + 1j * randn(16, 8, seed=6)).astype(np.complex64)

  def f(z, w):
    g = jax.grad(lambda z: jnp.sum(jnp.sin(z @ w) * z[:, :8]), holomorphic=True)(z)
    y, vjp = jax.vjp(lambda z: jnp.exp(z @ w * 0.1), z)
    return g, vjp(jnp.conj(y))[0]
  check_jit(f, (Z, w), (P("a", "b"), P("b")), MESH)


@case
def jvp_of_complex_elementwise_and_reductions_over_an_uneven_dim():
  z = (U + 1j * randn(6, 10, seed=8)).astype(np.complex64)

  def f(z, t):
    return jax.jvp(lambda z: (jnp.sum(z * jnp.conj(z), 1), jnp.cumsum(jnp.sqrt(z), 1)), (z,),
                   (t,))
  assert_partitioned_matches(f, (z, z * 0.5j), (P("a", "b"), P("a", "b")), MESH)


@case
def grad_with_allow_int_gives_float0_for_sharded_integer_inputs():
  """Against the unpartitioned function: a float0 cotangent is a numpy array, with no sharding."""
  def f(x, i):
    return jax.grad(lambda x, i: jnp.sum(x * i), argnums=(0, 1), allow_int=True)(x, i)
  assert_partitioned_matches(f, (X, ints(8, 16, high=5)), (P("a", "b"), P("a", "b")), MESH)


# --- custom derivatives ---------------------------------------------------------------------------

@jax.custom_jvp
def scaled_softplus(x: jax.Array, s: jax.Array) -> jax.Array:
  return jnp.logaddexp(x * s, 0.0)


scaled_softplus.defjvps(lambda t, y, x, s: t * s * jax.nn.sigmoid(x * s),
                        lambda t, y, x, s: t * x * jax.nn.sigmoid(x * s))


@case
def custom_jvp_with_per_argument_defjvps_under_grad():
  def loss(x, s):
    return jnp.sum(scaled_softplus(x, s) ** 2)
  check_jit(jax.grad(loss, argnums=(0, 1)), (X, randn(16, seed=1)), (P("a", "b"), P("b")), MESH)


@jax.custom_vjp
def normalize(x: jax.Array) -> dict[str, jax.Array]:
  n = jnp.sqrt(jnp.sum(x * x, 1, keepdims=True))
  return {"unit": x / n, "norm": n[:, 0]}


def _normalize_fwd(x: jax.Array) -> tuple[dict, dict]:
  out = normalize(x)
  return out, {"unit": out["unit"], "norm": out["norm"]}


def _normalize_bwd(res: dict, g: dict) -> tuple[jax.Array]:
  u, n = res["unit"], res["norm"][:, None]
  gu = g["unit"]
  return ((gu - u * jnp.sum(gu * u, 1, keepdims=True)) / n + g["norm"][:, None] * u,)


normalize.defvjp(_normalize_fwd, _normalize_bwd)


@case
def custom_vjp_with_dict_outputs_and_residuals_along_a_sharded_dim():
  def loss(x):
    out = normalize(x)
    return jnp.sum(out["unit"] * jnp.arange(16.0)) + jnp.sum(out["norm"] ** 2)
  check_jit(jax.grad(loss), (X,), P("a", "b"), MESH)


@jax.custom_vjp
def clip_grad_mul(x: jax.Array, y: jax.Array) -> jax.Array:
  return x * y


clip_grad_mul.defvjp(lambda x, y: (x * y, y), lambda y, g: (jnp.clip(g * y, -0.5, 0.5), None))


@case
def custom_vjp_returning_none_for_an_argument_under_grad():
  def loss(x, y):
    return jnp.sum(clip_grad_mul(x, y) ** 2)
  check_jit(jax.grad(loss, argnums=(0, 1)), (X, randn(8, 16, seed=1)), (P("a", "b"), P(None, "b")),
            MESH)


@case
def closure_convert_of_a_function_closing_over_a_sharded_value():
  def f(x, w):
    def g(y):
      return jnp.tanh(y @ w)
    converted, consts = jax.closure_convert(g, x)
    return converted(x, *consts), jax.grad(lambda x: jnp.sum(converted(x, *consts)))(x)
  check_jit(f, (X, randn(16, 16, seed=1) * 0.3), (P("a", "b"), P("b")), MESH)


@case
def custom_jvp_under_vmap_over_an_uneven_sharded_dim():
  f = jax.vmap(jax.grad(lambda r, s: jnp.sum(scaled_softplus(r, s))), in_axes=(1, None),
               out_axes=1)
  assert_partitioned_matches(f, (U, np.float32(1.5)), (P("a", "b"), P()), MESH)


# --- checkpoint policies and staging --------------------------------------------------------------

def _mlp(x: jax.Array, w1: jax.Array, w2: jax.Array) -> jax.Array:
  h = checkpoint_name(jnp.sin(x @ w1), "h")
  return checkpoint_name(jnp.tanh(h @ w2), "out")


W1, W2 = randn(16, 32, seed=1) * 0.3, randn(32, 16, seed=2) * 0.3
MLP_SPECS = (P("a", "b"), P("b"), P(None, "b"))


def _remat_grad(policy: Callable) -> Callable:
  f = jax.checkpoint(_mlp, policy=policy)
  return jax.grad(lambda x, w1, w2: jnp.sum(f(x, w1, w2) ** 2), argnums=(0, 1, 2))


@case
def checkpoint_with_everything_saveable_under_grad():
  check_jit(_remat_grad(jax.checkpoint_policies.everything_saveable), (X, W1, W2), MLP_SPECS,
            MESH)


@case
def checkpoint_saving_any_names_but_these_under_grad():
  check_jit(_remat_grad(jax.checkpoint_policies.save_any_names_but_these("out")), (X, W1, W2),
            MLP_SPECS, MESH)


@case
def checkpoint_saving_from_both_policies_under_grad():
  policy = jax.checkpoint_policies.save_from_both_policies(
      jax.checkpoint_policies.save_only_these_names("h"),
      jax.checkpoint_policies.dots_with_no_batch_dims_saveable)
  check_jit(_remat_grad(policy), (X, W1, W2), MLP_SPECS, MESH)


@case
def remat_inside_a_scan_body_under_grad():
  def loss(c, w, xs):
    step = jax.checkpoint(lambda c, x: (jnp.tanh(c @ w + x), jnp.sum(c)),
                          policy=jax.checkpoint_policies.nothing_saveable)
    return jnp.sum(lax.scan(step, c, xs)[0] ** 2)
  check_jit(jax.grad(loss, argnums=(0, 1)), (X, randn(16, 16, seed=1) * 0.3, randn(3, 8, 16)),
            (P("a", "b"), P(None, "b"), P(None, "a", "b")), MESH)


@case
def optimization_barrier_between_sharded_values():
  def f(x, y):
    a, b = lax.optimization_barrier((jnp.sin(x), y * 2))
    return a @ b.T, lax.optimization_barrier(a + 1)
  check_jit(f, (X, randn(8, 16, seed=1)), (P("a", "b"), P(None, "b")), MESH)


@case
def lax_map_with_batch_size_over_a_sharded_dim():
  def f(x, w):
    return lax.map(lambda r: jnp.tanh(r @ w), x, batch_size=4)
  check_jit(f, (X, randn(16, 8, seed=1)), (P("a", "b"), P("b")), MESH)


# --- jnp's function transforms and array-API functions --------------------------------------------

@case
def vectorize_with_a_signature_over_a_sharded_batch():
  f = jnp.vectorize(lambda a, b: jnp.dot(a, b) / jnp.linalg.norm(b), signature="(n),(n)->()")
  check_jit(f, (randn(4, 8, 16), X), (P("a", "b"), P(None, "b")), MESH)


@case
def apply_along_axis_and_apply_over_axes_along_sharded_dims():
  def f(x):
    return (jnp.apply_along_axis(lambda r: r[::2] * r.max() - r[1::2], 1, x),
            jnp.apply_over_axes(jnp.sum, x, (0, 1)))
  check_jit(f, (X,), P("a", "b"), MESH)


@case
def matvec_vecmat_vecdot_and_matrix_transpose():
  m, v = randn(4, 8, 16), randn(4, 16, seed=1)

  def f(m, v, z):
    return (jnp.matvec(m, v), jnp.vecmat(v[:, :8], m), jnp.vecdot(m, v[:, None]),
            jnp.matrix_transpose(m), jnp.vecdot(z, z[::-1]))
  check_jit(f, (m, v, Z), (P("a", "b"), P(None, "b"), P(None, "b")), MESH)


@case
def cumulative_prod_with_include_initial_and_nan_cumulatives():
  """With out_specs: open, they come back as propagation moved their axes (Known gaps)."""
  x = X.copy()
  x[1, 3] = x[5, 10] = np.nan

  def f(x):
    return (jnp.cumulative_prod(1 + x * 0.1, axis=1, include_initial=True),
            jnp.nancumsum(x, 1), jnp.nancumprod(1 + x * 0.1, 0))
  check_jit(f, (x,), P("a", "b"), MESH, (P("a"), P("a", "b"), P("a", "b")))


@case
def unwrap_gradient_and_ediff1d_along_a_sharded_dim():
  phase = np.cumsum(randn(8, 16) * 2, 1).astype(np.float32)

  def f(p):
    return jnp.unwrap(p, axis=1), jnp.gradient(p, axis=1), jnp.gradient(p, 0.5, axis=0), \
        jnp.ediff1d(p[0], to_begin=-1.0, to_end=1.0)
  check_jit(f, (phase,), P("a", "b"), MESH)


@case
def sized_unique_counts_inverse_flatnonzero_and_extract():
  v = indices(6, 8, 16)

  def f(v):
    u = jnp.unique_counts(v, size=8, fill_value=-1)
    inv = jnp.unique_inverse(v[0], size=8, fill_value=-1)
    return (u.values, u.counts, inv.values, inv.inverse_indices,
            jnp.flatnonzero(v > 3, size=40, fill_value=-1), jnp.extract(v > 4, v, size=30))
  check_jit(f, (v,), P("a", "b"), MESH)


@case
def pad_modes_with_stat_length_and_linear_ramp_along_sharded_dims():
  def f(x):
    return (jnp.pad(x, ((1, 2), (3, 1)), mode="maximum", stat_length=((2, 3), (4, 2))),
            jnp.pad(x, ((2, 0), (1, 3)), mode="linear_ramp", end_values=((1.0, 2.0), (-1.0, 0.0))),
            jnp.pad(x, ((0, 1), (2, 2)), mode="mean", stat_length=3))
  check_jit(f, (X,), P("a", "b"), MESH)


@case
def correlate_and_cross_of_sharded_operands():
  def f(a, b, u, v):
    return (jnp.correlate(a, b, mode="full"), jnp.correlate(a, b[:5], mode="same"),
            jnp.cross(u, v), jnp.cross(u, v, axisa=1, axisb=1, axisc=0))
  args = (randn(16), randn(7, seed=1), randn(8, 3, seed=2), randn(8, 3, seed=3))
  check_jit(f, args, (P("b"), P(), P("a"), P("b")), MESH)


@case
def fill_diagonal_and_tril_indices_of_a_sharded_matrix():
  def f(x):
    r, c = jnp.tril_indices(8, -1)
    return jnp.fill_diagonal(x, 0.0, inplace=False), x[r, c], x.at[jnp.triu_indices(8, 1, 16)].set(1)
  check_jit(f, (X,), P("a", "b"), MESH)


@case
def segment_min_and_prod_with_sorted_and_unsorted_ids():
  ids_sorted = np.sort(indices(5, 16))
  ids = indices(6, 16, seed=1)

  def f(x, s, i):
    return (jax.ops.segment_min(x, s, 5, indices_are_sorted=True),
            jax.ops.segment_prod(1 + 0.1 * x, i, 6), jax.ops.segment_max(x, i, 4, mode="drop"))
  check_jit(f, (X.T.copy(), ids_sorted, ids), (P("b", "a"), P("b"), P("b")), MESH)


@case
def resize_append_and_sized_compress_of_sharded_arrays():
  def f(x, m):
    return (jnp.resize(x, (12, 16)), jnp.append(x, x[:2], axis=0),
            jnp.compress(m, x, axis=1, size=10, fill_value=-1.0))
  check_jit(f, (X, randn(16, seed=1) > 0), (P("a", "b"), P("b")), MESH)


@case
def nan_arg_reductions_and_nanmedian_along_sharded_dims():
  """With out_specs: open, an arg reduction along a sharded dim comes back with its axes moved
  (Known gaps)."""
  x = X.copy()
  x[2, 5] = x[6, :3] = np.nan

  def f(x):
    return jnp.nanargmax(x, 1), jnp.nanargmin(x, 0), jnp.nanmedian(x, 0), jnp.nanpercentile(x, 30, 1)
  check_jit(f, (x,), P("a", "b"), MESH, (P("a"), P("b"), P("b"), P("a")))


@case
def segment_sum_with_a_bucket_size_over_an_uneven_sharded_dim():
  ids = np.sort(indices(4, 10, seed=2))

  def f(x, i):
    return (jax.ops.segment_sum(x.T, i, 4, indices_are_sorted=True, bucket_size=3),
            jax.ops.segment_max(x.T, i, 5, mode="clip"))
  assert_partitioned_matches(f, (U, ids), (P("a", "b"), P("b")), MESH)


@case
def einsum_with_greedy_path_highest_precision_and_a_preferred_type():
  a, b, c = (randn(8, 16).astype(jnp.bfloat16), randn(16, 4, seed=1).astype(jnp.bfloat16),
             randn(4, 8, seed=2).astype(jnp.bfloat16))

  def f(a, b, c, x, w):
    return (jnp.einsum("ij,jk,kl->il", a, b, c, optimize="greedy",
                       preferred_element_type=jnp.float32),
            jnp.einsum("ij,jk->ik", x, w, precision=lax.Precision.HIGHEST, optimize=False))
  check_jit(f, (a, b, c, X, randn(16, 8, seed=3)),
            (P("a", "b"), P("b"), P(None, "a"), P("a", "b"), P("b")), MESH)


@case
def conv_patches_of_an_image_sharded_along_its_height():
  def f(x):
    return lax.conv_general_dilated_patches(x, (3, 3), (1, 1), "SAME",
                                            dimension_numbers=("NHWC", "HWIO", "NHWC"))
  check_jit(f, (randn(2, 8, 8, 3),), P("a", "b"), MESH)


# --- lax ops along sharded dims -------------------------------------------------------------------

@case
def approx_min_k_and_argmin_with_an_index_dtype_along_a_sharded_dim():
  """With out_specs: open, they come back as propagation moved their axes (Known gaps). The
  approximate top k moves its axis to the rows by an all-to-all, as top_k does, not gathered."""
  def f(x):
    return (lax.approx_min_k(x, 4, reduction_dimension=1, recall_target=1.0),
            lax.argmin(x, 1, jnp.int16), lax.argmax(x, 0, jnp.uint8))
  out_specs = ([P("a", "b"), P("a", "b")], P("a"), P("b"))
  check_jit_within_xla(f, (X,), P("a", "b"), MESH, out_specs)


@case
def reduce_and_or_xor_of_bools_and_ints_along_sharded_dims():
  """Against the unpartitioned function: XLA's CPU all-reduce has no xor of booleans, so
  ``jax.jit`` given these shardings fails to compile."""
  b, i = X > 0, ints(8, 16, high=1000)

  def f(b, i):
    return (lax.reduce_and(b, (1,)), lax.reduce_or(b, (0,)), lax.reduce_xor(b, (0, 1)),
            lax.reduce_xor(i, (1,)), lax.reduce_and(i, (0,)))
  assert_partitioned_matches(f, (b, i), (P("a", "b"), P(None, "b")), MESH)


@case
def special_elementwise_functions_on_sharded_operands():
  def f(x, y):
    return (jnp.sinc(x), jnp.i0(x), jnp.heaviside(x, y), jnp.logaddexp2(x, y), jnp.hypot(x, y),
            jnp.copysign(x, y), jnp.float_power(jnp.abs(x), y).astype(np.float32), jnp.cbrt(x),
            jnp.spacing(x), lax.tan(x * 0.5))
  check_jit(f, (X, randn(16, seed=1)), (P("a", "b"), P("b")), MESH)


@case
def lax_special_functions_of_an_uneven_sharded_dim():
  a, x = np.abs(U) + 0.5, np.abs(randn(6, 10, seed=1)) + 0.1

  def f(a, x):
    return lax.igamma(a, x), lax.zeta(a + 1.5, x), lax.bessel_i1e(x)
  assert_partitioned_matches(f, (a, x), (P("a", "b"), P(None, "b")), MESH)


# --- dtype promotion ------------------------------------------------------------------------------

@case
def int32_times_float16_and_bool_arithmetic():
  h = randn(8, 16, seed=1).astype(np.float16)

  def f(i, h, b):
    return i * h, b + b, b * h, jnp.sum(b, 1), b.astype(np.int8) - True, i / 3, -b.astype(int)
  check_jit(f, (ints(8, 16, high=20), h, X > 0), (P("a", "b"), P(None, "b"), P("a")), MESH)


@case
def weak_typed_python_scalars_keep_narrow_dtypes():
  def f(i8, h, b, u):
    return i8 * 3 + 1, h + 1.5, b * 2, u // 2 + 7, (i8 > 0) + 1, h * True, jnp.float32(2) * h
  args = (ints(8, 16, high=40).astype(np.int8), randn(8, 16, seed=1).astype(np.float16),
          randn(8, 16, seed=2).astype(jnp.bfloat16), ints(8, 16, seed=3, high=100).astype(np.uint16))
  check_jit(f, args, (P("a", "b"), P(None, "b"), P("a"), P("b")), MESH)

@case
def uint8_arithmetic_wraps_around():
  a = ints(8, 16, high=128).astype(np.uint8) + np.uint8(100)
  b = ints(8, 16, seed=1, high=128).astype(np.uint8)

  def f(a, b):
    return a + b, a - b, a * b, jnp.sum(a, 1, dtype=np.uint8), jnp.sum(b, 0, dtype=np.uint8), -a
  check_jit(f, (a, b), (P("a", "b"), P("b")), MESH)


@case
def uint8_wrap_and_int32_times_float16_over_an_uneven_dim():
  a = (ints(6, 10, high=128) + 128).astype(np.uint8)

  def f(a, h):
    return a * np.uint8(3) + np.uint8(200), a.astype(np.int32) * h, jnp.sum(a, 1, dtype=np.uint8)
  assert_partitioned_matches(f, (a, U.astype(np.float16)), (P("a", "b"), P("b")), MESH)


# --- random draws with sharded output shapes ------------------------------------------------------

@case
def cauchy_logistic_weibull_and_pareto_draws_with_sharded_outputs():
  def f(key, b):
    k1, k2, k3, k4 = jax.random.split(key, 4)
    return (jax.random.cauchy(k1, (8, 16)), jax.random.logistic(k2, (8, 16)),
            jax.random.weibull_min(k3, 2.0, 1.5, (8, 16)), jax.random.pareto(k4, b, (8, 16)))
  check_jit(f, (jax.random.key(0), np.abs(randn(16, seed=1)) + 1), (P(), P("b")), MESH,
            P("a", "b"))


@case
def draws_keyed_by_a_sharded_batch_of_keys_folded_in():
  keys = jax.random.split(jax.random.key(3), 8)

  def f(keys, x):
    keys = jax.vmap(jax.random.fold_in)(keys, jnp.arange(8))
    bits = jax.vmap(lambda k: jax.random.bits(k, (16,), jnp.uint16))(keys)
    return bits, x + jax.vmap(lambda k: jax.random.laplace(k, (16,)))(keys)
  check_jit(f, (keys, X), (P("a"), P("a", "b")), MESH)


@pytest.mark.parametrize("run", CASES.params({}))
def test_case(run: Callable[[], None]) -> None:
  run()
