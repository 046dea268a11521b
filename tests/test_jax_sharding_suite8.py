"""JAX's own tests, round 8 (themes of tests/lax_test.py, lax_numpy_reducers_test.py,
lax_numpy_indexing_test.py, lax_numpy_einsum_test.py, lax_scipy_test.py and pjit_test.py run with
sharded inputs): lax ops acting along a sharded dim (multi-operand sorts with num_keys, top_k,
variadic reduces, select_n, clamp with broadcast bounds, negative padding, dynamic slices at
traced starts), jnp reducers with where= / initial= over several axes, nan-reducers, weighted
averages and order statistics, einsum forms (ellipsis, traces, permuted outputs) and tensor
products, jax.scipy's special functions and signal convolution, jnp's advanced indexing, and
pjit's argument and output forms (keyword-only arguments, NamedTuple outputs, outputs aliasing
inputs, zero-size arrays, scalar outputs). Even and uneven sizes, f32, bf16 and int32. Each is
compared with ``jax.jit`` given the same shardings (values and output shardings) or, where a dim
is uneven, with the unpartitioned function, and its plan with the compiled HLO
(tests/helpers.py). Cases of the earlier suites, test_jax_cases.py, test_jit_parity.py and
test_primitives.py are not repeated."""
from __future__ import annotations

from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import jax.scipy as jsp
import numpy as np
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

import spmd
from helpers import (Cases, assert_partitioned_matches, check_jit, check_plan, get_mesh, indices,
                     ints, named, randn, same)

CASES = Cases()  # functions of no arguments
MESH = "a2b4"
X = randn(8, 16)
BF = X.astype(jnp.bfloat16)
I = ints(8, 16)

case = CASES.register


# --- lax ops along a sharded dim ------------------------------------------------------------------

@case
def sort_of_three_operands_with_two_keys_along_a_sharded_dim():
  keys = ints(8, 16, high=3)

  def f(k, i, x):
    return lax.sort((k, i, x), dimension=1, num_keys=2)
  check_jit(f, (keys, I, X), P("a", "b"), MESH, P("a", "b"))


@case
def top_k_of_bfloat16_along_a_sharded_last_dim():
  check_jit(lambda x: lax.top_k(x, 3), (BF,), P("a", "b"), MESH, P("a"))


def _argmax_pair(a: tuple, b: tuple) -> tuple:
  """The reducer of an argmax as a variadic reduce: the larger value, the first index on ties."""
  (av, ai), (bv, bi) = a, b
  take_a = (av > bv) | ((av == bv) & (ai < bi))
  return lax.select(take_a, av, bv), lax.select(take_a, ai, bi)


@case
def variadic_reduce_argmax_of_value_and_index_over_a_sharded_dim():
  """XLA's tuple reduce: the largest value and its first index, over dim 1 split four ways."""
  def f(x):
    idx = lax.broadcasted_iota(jnp.int32, x.shape, 1)
    return lax.reduce((x, idx), (-jnp.inf, jnp.int32(0)), _argmax_pair, (1,))
  check_jit(f, (X,), P("a", "b"), MESH, P("a"))


@case
def select_n_of_three_cases_sharded_differently():
  def f(which, a, b, c):
    return lax.select_n(which, a, b, c)
  check_jit(f, (indices(3, 8, 16), X, X * 2, -X), (P("a", "b"), P("a"), P(None, "b"), P()), MESH)


@case
def clamp_int32_with_row_and_scalar_bounds():
  lo = ints(8, 1, high=20)[:, 0]

  def f(x, lo):
    return lax.clamp(jnp.broadcast_to(lo[:, None], x.shape), x, jnp.int32(40)), jnp.clip(
        x, max=lo[:, None])
  check_jit(f, (I, lo), (P("a", "b"), P("a")), MESH)


@case
def pad_with_negative_low_and_positive_high_of_a_bfloat16_sharded_dim():
  check_jit(lambda x: lax.pad(x, jnp.bfloat16(0), ((0, 0, 0), (-3, 5, 0))), (BF,), P("a", "b"),
            MESH)


@case
def dynamic_slice_at_a_traced_start_along_a_sharded_dim():
  def f(x, i):
    return lax.dynamic_slice_in_dim(x, i, 5, axis=1) * 2
  check_jit(f, (X, jnp.int32(9)), (P("a", "b"), P()), MESH)


@case
def dynamic_update_slice_at_a_traced_start_along_a_sharded_dim():
  def f(x, u, i):
    return lax.dynamic_update_slice_in_dim(x, u, i, axis=0)
  check_jit(f, (I, ints(3, 16, seed=2), jnp.int32(4)), (P("a", "b"), P(None, "b"), P()), MESH)


@case
def rem_and_nextafter_of_operands_sharded_differently():
  y = np.abs(randn(8, 16, seed=3)) + 0.5

  def f(x, y):
    return lax.rem(x, y), lax.nextafter(x, y), lax.rem(jnp.int32(7) * I, jnp.int32(5))
  check_jit(f, (X, y), (P("a", "b"), P("b")), MESH)


@case
def cumlogsumexp_and_cummin_in_bfloat16_reversed_along_a_sharded_dim():
  def f(x):
    return lax.cumlogsumexp(x, axis=0, reverse=True), lax.cummin(x, axis=0)
  check_jit(f, (BF,), P("a", "b"), MESH, P("a", "b"))


@case
def lax_ops_along_an_uneven_sharded_dim_in_three_dtypes():
  """Dim 1 of 10 over 'b' (4 shards): a two-key sort, top_k of bf16, a negative pad and a
  dynamic slice at a traced start of int32."""
  x, k, i = randn(4, 10), ints(4, 10, high=3), ints(4, 10, seed=1)

  def f(x, k, i, start):
    return (lax.sort((k, x), dimension=1, num_keys=2), lax.top_k(x.astype(jnp.bfloat16), 2),
            lax.pad(x, 0.0, ((0, 0, 0), (-2, 3, 0))), lax.dynamic_slice_in_dim(i, start, 4, 1))
  assert_partitioned_matches(f, (x, k, i, jnp.int32(5)), (P("a", "b"), P("a", "b"), P(None, "b"),
                                                          P()), MESH)


# --- jnp reducers ---------------------------------------------------------------------------------

@case
def sum_with_where_and_initial_over_two_axes_one_sharded():
  x = randn(4, 8, 16)

  def f(x):
    return (jnp.sum(x, axis=(0, 2), where=x > 0, initial=1.0),
            jnp.max(x, axis=(1, 2), where=x < 1, initial=-5.0, keepdims=True))
  check_jit(f, (x,), P("a", None, "b"), MESH)


@case
def int32_min_with_where_and_prod_with_keepdims():
  def f(x):
    return jnp.min(x, axis=1, where=x % 2 == 0, initial=1000), jnp.prod(x % 3 + 1, 0, keepdims=True)
  check_jit(f, (I,), P("a", "b"), MESH, (P("a"), P(None, "b")))


@case
def nanmean_nanvar_and_nanmax_along_a_sharded_dim():
  x = np.where(randn(8, 16, seed=4) > 1.0, np.nan, X).astype(np.float32)

  def f(x):
    return jnp.nanmean(x, axis=1), jnp.nanvar(x, axis=1, ddof=1), jnp.nanmax(x, axis=0)
  check_jit(f, (x,), P("a", "b"), MESH)


@case
def ptp_and_average_with_weights_over_sharded_dims():
  w = np.abs(randn(16, seed=5)) + 0.1

  def f(x, w):
    return jnp.ptp(x, axis=1), jnp.average(x, axis=1, weights=w, returned=True)
  check_jit(f, (X, w), (P("a", "b"), P("b")), MESH)


@case
def median_and_quantile_of_bfloat16_along_a_sharded_dim():
  def f(x):
    return jnp.median(x, axis=1), jnp.quantile(x.astype(jnp.float32), jnp.array([0.1, 0.9]),
                                               axis=0, method="nearest")
  check_jit(f, (BF,), P("a", "b"), MESH, (P("a"), P(None, "b")))


@case
def count_nonzero_and_argmin_with_keepdims_over_a_three_d_mesh():
  x = ints(4, 8, 8, high=3)

  def f(x):
    return jnp.count_nonzero(x, axis=(0, 2)), jnp.argmin(x, axis=2, keepdims=True)
  check_jit(f, (x,), P("a", "b", "c"), "a2b2c2", (P("b"), P("a", "b")))


@case
def mean_of_an_uneven_dim_with_where_over_both_axes():
  x = randn(6, 10)
  assert_partitioned_matches(lambda x: jnp.mean(x, axis=(0, 1), where=x > -0.5), (x,),
                             P("a", "b"), MESH)


@case
def lexsort_and_partition_along_a_sharded_dim():
  def f(k, x):
    return jnp.lexsort((x, k), axis=1), jnp.partition(x, 4, axis=1)
  check_jit(f, (ints(8, 16, high=3), X), P("a", "b"), MESH, P("a", "b"))


@case
def cov_and_corrcoef_of_observations_sharded_along_both_dims():
  check_jit(lambda x: (jnp.cov(x), jnp.corrcoef(x, rowvar=False)), (X,), P("a", "b"), MESH)


@case
def trapezoid_and_ravel_multi_index_of_sharded_operands():
  def f(y, i, j):
    return jnp.trapezoid(y, dx=0.5, axis=1), jnp.ravel_multi_index((i, j), (8, 16), mode="clip")
  check_jit(f, (X, indices(8, 32), indices(16, 32, seed=1)), (P("a", "b"), P("b"), P("b")),
            MESH)


@case
def reducers_along_uneven_sharded_dims_in_three_dtypes():
  """Dims of 6 and 10 over 'a' and 'b': nanvar of bf16, a median, int32 cumsum and cummax."""
  x = np.where(randn(6, 10, seed=6) > 1.0, np.nan, randn(6, 10)).astype(jnp.bfloat16)

  def f(x, i):
    return jnp.nanvar(x, axis=1), jnp.median(i.astype(jnp.float32), axis=0), jnp.cumsum(i, 1), \
        lax.cummax(i, 0)
  assert_partitioned_matches(f, (x, ints(6, 10)), P("a", "b"), MESH)


# --- einsum forms and tensor products -------------------------------------------------------------

@case
def einsum_with_an_ellipsis_over_sharded_batch_dims():
  x, y = randn(2, 4, 8, 6), randn(2, 4, 6, 8, seed=1)  # ellipsis dims: P('a','b') on both
  check_jit(lambda x, y: jnp.einsum("...ij,...jk->...ik", x, y), (x, y),
            (P("a", "b", None, None), P("a", "b")), MESH)


@case
def einsum_trace_and_diagonal_of_a_matrix_sharded_both_ways():
  a = randn(8, 8)
  check_jit(lambda a: (jnp.einsum("ii->", a), jnp.einsum("ii->i", a)), (a,), P("a", "b"), MESH)


@case
def einsum_diagonal_of_a_batch_with_the_output_transposed():
  check_jit(lambda x: jnp.einsum("iij->ji", x), (randn(8, 8, 4),), P("a", "b"), MESH)


@case
def einsum_with_a_permuted_output_order():
  x, y = randn(4, 8, 16), randn(16, 8, seed=1)
  check_jit(lambda x, y: jnp.einsum("bij,jk->kbi", x, y), (x, y), (P("a", None, "b"), P("b")),
            MESH)


@case
def tensordot_over_two_axes_both_sharded():
  x, y = randn(4, 8, 16), randn(8, 16, 4, seed=1)
  check_jit(lambda x, y: jnp.tensordot(x, y, axes=([1, 2], [0, 1])), (x, y),
            (P(None, "a", "b"), P("a", "b")), MESH)


@case
def kron_outer_and_vdot_of_sharded_operands():
  a, b = randn(4, 4), randn(2, 8, seed=1)
  v = randn(16, seed=2)

  def f(a, b, v):
    return jnp.kron(a, b), jnp.outer(v, v[:8]), jnp.vdot(v, v * 2)
  check_jit(f, (a, b, v), (P("a"), P(None, "b"), P("b")), MESH)


@case
def matrix_power_of_a_matrix_sharded_both_ways():
  a = randn(8, 8) * 0.3
  check_jit(lambda a: (jnp.linalg.matrix_power(a, 3), jnp.linalg.matrix_power(a, 0)), (a,),
            P("a", "b"), MESH)


@case
def int32_einsum_contracting_a_sharded_dim():
  check_jit(lambda x, y: jnp.einsum("ij,kj->ik", x, y), (I, ints(4, 16, seed=1)),
            (P("a", "b"), P(None, "b")), MESH)


# --- jax.scipy ------------------------------------------------------------------------------------

@case
def scipy_logsumexp_over_two_axes_one_sharded():
  x = randn(4, 8, 16)
  check_jit(lambda x: jsp.special.logsumexp(x, axis=(0, 2), keepdims=True), (x,),
            P("a", None, "b"), MESH)


@case
def gammaln_erf_and_xlogy_of_sharded_operands():
  y = np.abs(X) + 0.1

  def f(x, y):
    return jsp.special.gammaln(y), jsp.special.erf(x) * x, jsp.special.xlogy(y, y).sum(1)
  check_jit(f, (X, y), (P("a", "b"), P("b")), MESH)


@case
def signal_convolve_same_along_a_sharded_dim():
  k = randn(5, seed=3)
  check_jit(lambda x, k: jsp.signal.convolve(x, k, mode="same"), (randn(64), k), (P("b"), P()),
            MESH)


@case
def signal_correlate2d_valid_of_a_sharded_image():
  check_jit(lambda x, k: jsp.signal.correlate2d(x, k, mode="valid"), (randn(16, 16),
                                                                       randn(3, 3, seed=1)),
            (P("a", "b"), P()), MESH)


# --- advanced indexing ----------------------------------------------------------------------------

@case
def mixed_slice_and_integer_array_indexing_of_sharded_dims():
  x = randn(4, 8, 16)
  i, j = indices(8, 3), indices(16, 3, seed=1)

  def f(x, i, j):
    return x[:, i, j], x[1:3, i], x[..., j]
  check_jit(f, (x, i, j), (P("a", None, "b"), P(), P()), MESH)


@case
def boolean_mask_indexing_by_where_with_a_static_size():
  def f(x):
    (rows,) = jnp.where(x.sum(1) > 0, size=4, fill_value=0)
    return x[rows]
  check_jit(f, (X,), P("a", "b"), MESH)


@case
def at_min_max_mul_and_get_fill_with_a_sharded_indexed_dim():
  i = np.array([0, 5, 3, 5, 7, 12], np.int32)

  def f(x, u):
    return (x.at[:, i].min(u), x.at[:, i].max(u), x.at[:, i].mul(2.0),
            x.at[:, i + 4].get(mode="fill", fill_value=0.0))
  check_jit(f, (X, randn(8, 6, seed=1)), (P("a", "b"), P("a")), MESH)


@case
def integer_array_indexing_of_an_uneven_sharded_dim():
  i = indices(10, 4)
  assert_partitioned_matches(lambda x, i: x[i] * 2, (randn(10, 8), i), (P("b"), P()), MESH)


@case
def indexing_along_an_uneven_sharded_dim():
  """Dim 1 of 10 over 'b': a filled get at out-of-bounds and negative columns, a sized where, a
  scatter-add of repeated columns and a dynamic update at a traced start."""
  cols, rows = np.array([-1, 3, 9, 12], np.int32), indices(10, 6)

  def f(x, u, start):
    return (x.at[:, cols].get(mode="fill", fill_value=-1.0), jnp.where(x[0] > 0, size=7,
                                                                        fill_value=-1),
            x.T.at[rows].add(u), lax.dynamic_update_slice_in_dim(x, u[:3].T, start, 1))
  assert_partitioned_matches(f, (randn(4, 10), randn(6, 4, seed=1), jnp.int32(6)),
                             (P("a", "b"), P(), P()), MESH)


# --- pjit's argument and output forms -------------------------------------------------------------

class Stats(NamedTuple):
  mean: jax.Array
  top: jax.Array


@case
def namedtuple_output_with_a_spec_per_field():
  def f(x):
    return Stats(x.mean(1), x.max())
  check_jit(f, (X,), P("a", "b"), MESH, Stats(P("a"), P()))


@case
def keyword_only_arguments_passed_by_name():
  def f(x, *, scale):
    return x * scale
  mesh, s = get_mesh(MESH), jnp.float32(3.0)
  ours = spmd.partition(f, mesh=mesh, in_specs=(P("a", "b"),))
  # jax.jit takes no keyword arguments with in_shardings: the keyword is passed positionally
  theirs = jax.jit(lambda x, s: f(x, scale=s), in_shardings=named(mesh, (P("a", "b"), P())))
  same(ours(X, scale=s), theirs(X, s))
  check_plan(ours, X, scale=s)


@case
def outputs_that_are_the_inputs_returned_in_other_shardings():
  check_jit(lambda x, y: (x, y, x), (X, I), (P("a", "b"), P("b")), MESH,
            (P("a", "b"), P("a"), P()))


@case
def zero_size_arrays_with_sharded_specs():
  """Every result computed from empty arrays is a constant XLA folds: jax.jit returns them
  replicated. spmd returned the sums sharded, and with two empty arguments read XLA refused its
  program (every operand of the manual computation dropped)."""
  def f(x, y):
    return x.sum(0), jnp.concatenate([y, y], 1), x * 2, y.sum(1), x.T @ x
  check_jit(f, (np.zeros((0, 8), np.float32), np.zeros((8, 0), np.int32)),
            (P(None, "b"), P("a")), MESH)


@case
def zero_size_arrays_read_in_cond_and_loop_bodies():
  """A body's results computed from empty arrays alone are constants too: spmd returned them
  sharded, and XLA refused the program whose loop body read both empty arguments."""
  def f(x, y, p):
    inner = lax.cond(p, lambda: (x.sum(0), y.sum(1)),
                     lambda: (x.max(0, initial=0.0), y.sum(1) + 1))
    looped = lax.fori_loop(0, 3, lambda i, c: (c[0] + x.sum(0), c[1] + y.sum(1)),
                           (jnp.zeros(8), jnp.zeros(8, jnp.int32)))
    return inner, looped
  check_jit(f, (np.zeros((0, 8), np.float32), np.zeros((8, 0), np.int32), True),
            (P(None, "b"), P("a"), P()), MESH)


@case
def concatenate_of_an_empty_argument_and_a_loop_carry():
  """Empty pieces leave a concatenate (XLA's simplifier): the empty argument's P(None, 'b')
  reached the carry, which jax.jit returns replicated."""
  def f(x, y):
    def body(i, c):
      return jnp.concatenate([x, c]) * 2 + jnp.concatenate([y.T.astype(jnp.float32), c, x])
    return lax.fori_loop(0, 3, body, jnp.ones((1, 8)))
  check_jit(f, (np.zeros((0, 8), np.float32), np.zeros((8, 0), np.int32)), (P(None, "b"), P("a")),
            MESH)


@case
def scalar_outputs_with_out_specs_replicated():
  def f(x, i):
    return x.sum(), (i * i).max(), jnp.float32(2.0)
  check_jit(f, (X, I), (P("a", "b"), P("b", "a")), MESH, (P(), P(), P()))


@case
def open_outputs_of_top_k_variadic_reduce_and_prod_along_a_sharded_dim():
  def f(x):
    idx = lax.broadcasted_iota(jnp.int32, x.shape, 1)
    first = lax.reduce((x, idx), (-jnp.inf, jnp.int32(0)), _argmax_pair, (1,))[1]
    return lax.top_k(x, 3)[0], first, jnp.prod(x, axis=1)
  check_jit(f, (X,), P("a", "b"), MESH)


# --- known gaps (docs/ARCHITECTURE.md) ----------------------------------------------------------

@case
def erf_as_an_open_output():
  check_jit(jsp.special.erf, (X,), P("a", "b"), MESH)


XFAIL: dict[Callable, str] = {}
if jax.__version_info__ < (0, 12):  # jax 0.12's Shardy has a rule for chlo.erf: P('a','b') too
  XFAIL[erf_as_an_open_output] = (
      "jax.jit returns erf of f32[8,16] P('a','b') replicated, P(), gathering 384 B: Shardy "
      "has no sharding rule for chlo.erf, so nothing reaches its open result; spmd returns "
      "P('a','b') moving nothing (docs/ARCHITECTURE.md, Known gaps)")


@pytest.mark.parametrize("run", CASES.params(XFAIL))
def test_case(run: Callable[[], None]) -> None:
  run()
