"""JAX's own tests, round 13 (themes of tests/lax_numpy_reducers_test.py, lax_numpy_einsum_test.py,
lax_test.py's convolutions and integer ops, random_lax_test.py, lax_autodiff_test.py, nn_test.py
and linalg_test.py, run with sharded inputs): nanstd with NaNs on several shards, all / any with
where= over two sharded axes, reversed cumulative sums, products and maxima of int8, int16, uint8
and bool, count_nonzero with keepdims and integer ptp over an uneven dim; three-operand
contractions, int8 einsums accumulated in int32 over a sharded contraction, dot_general with two
batch dims over different mesh axes, ellipsis broadcasting of a size-1 batch and a batched
diagonal; 1-D depthwise and 3-D convolutions, NCHW transposed convolutions (lhs_dilation) and
batch_group_count with the batch sharded; shifts of int16 / uint8 by sharded amounts, lax.div /
lax.rem sign rules, bitwise ops of uint16 and bool with broadcasting, popcount / clz sums and a
three-operand sort with two keys; random bits, normals and categorical draws from keys passed as
arguments and vmapped split keys; gradients of cumprod, of max with ties, of take_along_axis and of
sort along sharded dims, jacrev, linearize, custom_jvp activations, checkpoint policies and
stop_gradient inside a loss; batched det / slogdet / solve over a sharded batch. Even and uneven
sizes; f32, int8, int16, int32, uint8, uint16, uint32 and bool. Each is compared with ``jax.jit``
given the same shardings (values and output shardings) or, where a dim is uneven, with the
unpartitioned function, and its plan with the compiled HLO (tests/helpers.py). Cases of the earlier
suites, test_jax_cases.py, test_jit_parity.py, test_primitives.py and test_control_flow.py are not
repeated."""
from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

from helpers import (Cases, assert_partitioned_matches, check_jit, indices, ints, randn, rng,
                     spd)

CASES = Cases()  # functions of no arguments
MESH = "a2b4"
X = randn(8, 16)
U = randn(6, 10, seed=7)  # uneven over 'a' (2) x 'b' (4) along dim 1, and over 4 along dim 0
I = ints(8, 16, seed=3)

case = CASES.register


# --- reducers along sharded dims -----------------------------------------------------------------

@case
def nanstd_with_nans_on_several_shards():
  x = X.copy()
  x[0, 1] = x[3, 6] = x[5, 13] = x[7, 9] = np.nan  # NaNs in four of 'b''s column blocks

  def f(x):
    return jnp.nanstd(x, axis=1), jnp.nanstd(x, axis=0, ddof=1), jnp.nanstd(x)
  check_jit(f, (x,), P("a", "b"), MESH)


@case
def all_and_any_with_where_over_two_sharded_axes():
  b, w = X > 0.5, I % 3 == 0

  def f(b, w):
    return jnp.all(b, axis=(0, 1), where=w), jnp.any(b, axis=1, where=w)
  check_jit(f, (b, w), (P("a", "b"), P("b", "a")), MESH)


@case
def all_with_a_negated_mask_sharded_across_the_operand():
  def f(b, w):
    return jnp.all(b, axis=0, where=~w, keepdims=True)
  check_jit(f, (X > 0.5, I % 3 == 0), (P("a", "b"), P("b", "a")), MESH)


@case
def reversed_cumulative_ops_of_narrow_ints_along_a_sharded_dim():
  i8 = (I % 5).astype(np.int8)
  u8 = (I % 200 + 100).astype(np.uint8)

  def f(i8, u8):
    return (lax.cumsum(i8, 1, reverse=True), lax.cumprod((i8 % 2 + 1).astype(jnp.int16), 1,
                                                          reverse=True),
            lax.cummax(u8, 1, reverse=True), lax.cummin(u8, 0, reverse=True))
  check_jit(f, (i8, u8), (P("a", "b"), P("a", "b")), MESH)


@case
def cumsum_of_bool_and_cumulative_or_of_masks_along_a_sharded_dim():
  b = I > 20

  def f(b):
    return jnp.cumsum(b, axis=1), lax.cummax(b.astype(jnp.int32), 1, reverse=True) > 0
  check_jit(f, (b,), P(None, ("a", "b")), MESH)


@case
def count_nonzero_with_keepdims_and_integer_ptp_over_an_uneven_dim():
  i = ints(6, 10, seed=5, high=4)

  def f(i):
    return (jnp.count_nonzero(i, axis=1, keepdims=True), jnp.count_nonzero(i, axis=(0, 1)),
            jnp.ptp(i, axis=1), jnp.ptp(i, axis=0, keepdims=True))
  assert_partitioned_matches(f, (i,), P("a", "b"), MESH)


@case
def integer_sum_and_mean_of_sharded_rows_exact():
  def f(i):
    return jnp.sum(i, axis=(0, 1)), jnp.sum(i * i, axis=0), jnp.max(jnp.abs(i), axis=1)
  check_jit(f, (I,), P(("a", "b"), None), MESH)


# --- einsum forms ----------------------------------------------------------------------------------

@case
def three_operand_chain_contraction():
  a, b, c = randn(8, 16, seed=1), randn(16, 8, seed=2), randn(8, 4, seed=3)

  def f(a, b, c):
    return jnp.einsum("ij,jk,kl->il", a, b, c), jnp.einsum("ij,jk,ik->i", a, b, a[:, :8])
  check_jit(f, (a, b, c), (P("a", "b"), P("b", None), P(None, "a")), MESH)


@case
def int8_einsum_accumulated_in_int32_over_a_sharded_contraction():
  a, b = (I % 100).astype(np.int8), ints(16, 8, seed=4).astype(np.int8)

  def f(a, b):
    return (jnp.einsum("ij,jk->ik", a, b, preferred_element_type=jnp.int32),
            jnp.einsum("ij,ij->i", a, a, preferred_element_type=jnp.int32))
  check_jit(f, (a, b), (P("a", "b"), P("b", None)), MESH)


@case
def dot_general_with_two_batch_dims_over_different_mesh_axes():
  x, y = randn(2, 4, 8, 6, seed=1), randn(4, 2, 6, 4, seed=2)

  def f(x, y):
    return lax.dot_general(x, y, (((3,), (2,)), ((0, 1), (1, 0))))
  check_jit(f, (x, y), (P("a", "b"), P("b", "a")), MESH)


@case
def einsum_ellipsis_broadcasting_a_size_one_batch():
  x, y = randn(1, 4, 8, seed=1), randn(8, 8, 4, seed=2)

  def f(x, y):
    return jnp.einsum("...ij,...jk->...ik", x, y), jnp.einsum("...j,...j->...", y, y[:1])
  check_jit(f, (x, y), (P(None, "b"), P("a", None, "b")), MESH)


@case
def ellipsis_contraction_whose_free_and_contracted_dims_hold_one_axis():
  def f(x, y):
    return jnp.einsum("...ij,...jk->...ik", x, y)
  check_jit(f, (randn(1, 4, 8, seed=1), randn(8, 8, 4, seed=2)), (P(None, "b"), P("a", "b")),
            MESH)


@case
def batched_diagonal_and_trace_of_a_sharded_batch():
  x = randn(8, 6, 6, seed=1)

  def f(x):
    return jnp.einsum("bii->bi", x), jnp.einsum("bii->b", x), jnp.einsum("bij,bjj->bi", x, x)
  check_jit(f, (x,), P(("a", "b")), MESH)


# --- convolutions ----------------------------------------------------------------------------------

@case
def depthwise_1d_convolution_nwc_with_the_feature_dim_sharded():
  x, w = randn(4, 16, 8, seed=1), randn(3, 1, 8, seed=2)

  def f(x, w):
    return lax.conv_general_dilated(x, w, (1,), "SAME", dimension_numbers=("NWC", "WIO", "NWC"),
                                    feature_group_count=8)
  check_jit(f, (x, w), (P("a", None, "b"), P(None, None, "b")), MESH)


@case
def three_d_convolution_ndhwc_with_batch_and_depth_sharded():
  x, w = randn(2, 8, 4, 4, 2, seed=1), randn(3, 3, 3, 2, 4, seed=2)

  def f(x, w):
    return lax.conv_general_dilated(x, w, (1, 1, 1), "SAME",
                                    dimension_numbers=("NDHWC", "DHWIO", "NDHWC"))
  check_jit(f, (x, w), (P("a", "b"), P()), MESH)


@case
def transposed_nchw_convolution_with_a_sharded_spatial_dim():
  x, w = randn(2, 3, 8, 8, seed=1), randn(4, 3, 3, 3, seed=2)

  def f(x, w):
    return lax.conv_general_dilated(x, w, (1, 1), ((2, 2), (1, 1)), lhs_dilation=(2, 1),
                                    dimension_numbers=("NCHW", "OIHW", "NCHW"))
  check_jit(f, (x, w), (P(None, None, "b"), P()), MESH)


@case
def batch_group_count_convolution_with_the_batch_sharded():
  x, w = randn(8, 8, 2, seed=1), randn(3, 2, 4, seed=2)  # 4 output features over 2 groups

  def f(x, w):
    return lax.conv_general_dilated(x, w, (1,), "VALID", dimension_numbers=("NWC", "WIO", "NWC"),
                                    batch_group_count=2)
  check_jit(f, (x, w), (P("a"), P()), MESH)


# --- integer and bit ops ---------------------------------------------------------------------------

@case
def shifts_of_int16_and_uint8_by_sharded_amounts():
  x16 = ints(8, 16, seed=1, high=3000).astype(np.int16)
  u8 = rng(2).integers(0, 256, (8, 16)).astype(np.uint8)
  s16 = indices(8, 8, 16, seed=3).astype(np.int16)
  s8 = indices(9, 8, 16, seed=4).astype(np.uint8)  # 8: all bits shifted out

  def f(x16, u8, s16, s8):
    return (lax.shift_left(x16, s16), lax.shift_right_arithmetic(x16, s16),
            lax.shift_right_logical(u8, s8), u8 << 1, x16 >> 2)
  check_jit(f, (x16, u8, s16, s8), (P("a", "b"), P("b", "a"), P("a"), P("b")), MESH)


@case
def lax_div_and_rem_sign_rules_against_floor_division():
  d = ints(8, 16, seed=4, high=7)
  d = np.where(d == 0, 3, d).astype(np.int32)

  def f(n, d):
    return lax.div(n, d), lax.rem(n, d), n // d, n % d, lax.div(n, -3)
  check_jit(f, (I, d), (P("a", "b"), P(None, "b")), MESH)


@case
def bitwise_ops_of_uint16_and_bool_with_broadcasting():
  u = rng(5).integers(0, 2**16, (8, 16)).astype(np.uint16)
  m = rng(6).integers(0, 2**16, (16,)).astype(np.uint16)

  def f(u, m):
    b = (u & 1).astype(bool)
    return u & m, u | m, u ^ m, ~u, b ^ (m > 1000), ~b & (u > m)
  check_jit(f, (u, m), (P("a", "b"), P("a")), MESH)


@case
def popcount_and_clz_summed_along_a_sharded_dim():
  u = rng(7).integers(0, 2**32, (8, 16), dtype=np.uint64).astype(np.uint32)

  def f(u):
    return (jnp.sum(lax.population_count(u), axis=1), jnp.max(lax.clz(u), axis=0),
            jnp.sum(lax.clz(u.astype(jnp.int32)), axis=(0, 1)))
  check_jit(f, (u,), P("a", "b"), MESH)


@case
def three_operand_sort_with_two_keys_along_an_unsharded_dim():
  k1, k2 = (I % 3).T.copy(), ints(16, 8, seed=8, high=4)

  def f(k1, k2, v):
    return lax.sort((k1, k2, v), dimension=1, num_keys=2)
  check_jit(f, (k1, k2, randn(16, 8, seed=9)), (P("b"), P("b"), P(("a", "b"))), MESH)


# --- random ----------------------------------------------------------------------------------------

KEY = jax.random.key_data(jax.random.key(42))


@case
def random_bits_and_normals_from_a_key_argument_into_sharded_shapes():
  def f(raw, x):
    key = jax.random.wrap_key_data(raw)
    k1, k2 = jax.random.split(key)
    return (jax.random.bits(k1, (8, 16), jnp.uint8) + x.astype(jnp.uint8),
            jax.random.normal(k2, (8, 16)) * x)
  check_jit(f, (KEY, X), (P(), P("a", "b")), MESH, out_specs=(P("a", "b"), P("a", "b")))


@case
def vmapped_split_keys_over_a_sharded_batch():
  keys = jax.random.key_data(jax.random.split(jax.random.key(3), 8))

  def f(raw, x):
    draw = jax.vmap(lambda k: jax.random.uniform(jax.random.wrap_key_data(k), (16,)))
    return draw(raw) + x
  check_jit(f, (keys, X), (P("a"), P("a", "b")), MESH)


@case
def categorical_draws_over_a_sharded_batch_of_logits():
  def f(raw, logits):
    key = jax.random.wrap_key_data(raw)
    return (jax.random.categorical(key, logits, axis=-1),
            jax.random.categorical(key, logits, axis=0, shape=(3, 16)))
  check_jit(f, (KEY, X), (P(), P("a")), MESH)


@case
def permutation_of_rows_along_an_unsharded_dim():
  def f(raw, x):
    key = jax.random.wrap_key_data(raw)
    return jax.random.permutation(key, x, axis=1, independent=True), jax.random.permutation(
        key, x, axis=0)
  check_jit(f, (KEY, X), (P(), P("b", None)), MESH)


# --- autodiff through the partitioned function -------------------------------------------------

@case
def grad_of_cumprod_along_a_sharded_dim():
  x = rng(11).uniform(0.5, 1.5, (2, 8)).astype(np.float32)

  def f(x):
    return jax.grad(lambda x: jnp.sum(jnp.cumprod(x, axis=1) * x))(x)
  check_jit(f, (x,), P("a", "b"), MESH)


@case
def grad_of_max_with_ties_along_a_sharded_dim():
  x = (I % 4).astype(np.float32)  # integer values: many ties in each row

  def f(x):
    return jax.grad(lambda x: jnp.sum(jnp.max(x, axis=1) * jnp.arange(8.0)))(x)
  check_jit(f, (x,), P("a", "b"), MESH)


@case
def grad_of_take_along_axis_along_a_sharded_dim():
  i = indices(16, 8, 5, seed=12)

  def f(x, i):
    return jax.grad(lambda x: jnp.sum(jnp.take_along_axis(x, i, axis=1) ** 2))(x)
  check_jit(f, (X, i), (P("a", "b"), P("a")), MESH)


@case
def vjp_of_sort_along_a_sharded_dim():
  x = rng(13).permutation(128).reshape(8, 16).astype(np.float32)  # no ties

  def f(x, ct):
    y, pull = jax.vjp(lambda x: jnp.sort(x, axis=1), x)
    return y, pull(ct)[0]
  check_jit(f, (x, randn(8, 16, seed=14)), (P("a", "b"), P("a", "b")), MESH)


@case
def jacrev_of_a_small_function_of_a_sharded_vector():
  v = randn(8, seed=15)

  def f(v):
    return jax.jacrev(lambda v: jnp.tanh(v) * jnp.cumsum(v))(v)
  check_jit(f, (v,), P("b"), MESH)


@case
def linearize_and_apply_the_tangent_map_twice():
  def f(x, t):
    y, lin = jax.linearize(lambda x: jnp.sin(x) @ x.T, x)
    return y, lin(t), lin(2 * t)
  check_jit(f, (X, randn(8, 16, seed=16)), (P("a", "b"), P("a", "b")), MESH)


@case
def custom_jvp_activations_under_grad_at_their_kinks():
  x = (I % 5 - 2).astype(np.float32)  # exact zeros: relu's custom derivative there

  def f(x):
    return jax.grad(lambda x: jnp.sum(jax.nn.relu(x) + jax.nn.softplus(x) + jax.nn.silu(x)))(x)
  check_jit(f, (x,), P("a", "b"), MESH)


@case
def checkpoint_with_a_dots_policy_under_grad():
  w = randn(16, 16, seed=17)
  policy = jax.checkpoint_policies.dots_with_no_batch_dims_saveable

  def f(x, w):
    block = jax.checkpoint(lambda x: jnp.tanh(x @ w) @ w.T, policy=policy)
    return jax.grad(lambda x, w: jnp.sum(block(x) ** 2), argnums=(0, 1))(x, w)
  check_jit(f, (X, w), (P("a", "b"), P("b", None)), MESH)


@case
def stop_gradient_inside_a_normalized_loss():
  def f(x):
    def loss(x):
      mean = lax.stop_gradient(jnp.mean(x, axis=1, keepdims=True))
      return jnp.sum((x - mean) ** 2)
    return jax.grad(loss)(x)
  check_jit(f, (X,), P("a", "b"), MESH)


@case
def grad_over_an_uneven_dim_of_a_cumulative_max():
  u = rng(18).permutation(12).reshape(2, 6).astype(np.float32)  # no ties

  def f(x):
    return jax.grad(lambda x: jnp.sum(lax.cummax(x, 1) * x))(x)
  assert_partitioned_matches(f, (u,), P("a", "b"), MESH)


# --- linear algebra over a sharded batch ---------------------------------------------------------

@case
def det_slogdet_and_solve_over_a_sharded_batch():
  a, b = spd(8, 4, seed=19), randn(8, 4, 2, seed=20)

  def f(a, b):
    sign, logdet = jnp.linalg.slogdet(a)
    return jnp.linalg.det(a), sign, logdet, jnp.linalg.solve(a, b)
  check_jit(f, (a, b), (P(("a", "b")), P(("a", "b"))), MESH)


@case
def inverse_and_matrix_power_over_a_batch_sharded_on_one_axis():
  a = spd(4, 4, seed=21)

  def f(a):
    return jnp.linalg.inv(a), jnp.linalg.matrix_power(a, 3)
  check_jit(f, (a,), P("b"), MESH)


XFAIL: dict[Callable, str] = {}


@pytest.mark.parametrize("run", CASES.params(XFAIL))
def test_case(run: Callable[[], None]) -> None:
  run()
