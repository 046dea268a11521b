"""JAX's own tests, round 7 (themes of tests/linalg_test.py, nn_test.py, lax_numpy_test.py,
lax_control_flow_test.py and api_test.py run with sharded inputs): linear algebra on a matrix
sharded along its own dims and on sharded right-hand sides, jax.nn's ops along a sharded axis,
sized set and index ops, narrow integer, float16 and bool dtypes, loops with traced bounds and
sharded carries, and JAX's transformations and staging APIs applied to a partitioned function.
Each is compared with ``jax.jit`` given the same shardings (values and output shardings) and its
plan with the compiled HLO (tests/helpers.py). Cases of the earlier suites, test_jax_cases.py,
test_jit_parity.py and test_primitives.py are not repeated."""
from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from helpers import (Cases, both, check_jit, check_plan, get_mesh, indices, ints, randn, same,
                     spd)

CASES = Cases()  # functions of no arguments, or pytest.params of one
MESH = "a2b4"
X, W = randn(8, 16), randn(16, 8, seed=1)
A = spd(1, 8)[0]  # one well-conditioned f32[8, 8]

case = CASES.register


# --- linear algebra on sharded matrix dims and right-hand sides --------------------------------

@case
def cholesky_of_a_matrix_sharded_along_both_dims():
  check_jit(jnp.linalg.cholesky, (A,), P("a", "b"), MESH)


@case
def qr_of_a_tall_matrix_sharded_by_rows():
  check_jit(jnp.linalg.qr, (randn(16, 4),), P("b"), MESH)


@case
def svd_with_vectors_of_a_batch_sharded_stack():
  check_jit(lambda x: jnp.linalg.svd(x, full_matrices=False), (randn(8, 4, 3),), P("a", "b"),
            MESH)


@case
def eigh_of_a_matrix_sharded_along_columns():
  check_jit(lambda a: jnp.linalg.eigh(a), (A,), P(None, "b"), MESH)


@case
def triangular_solve_with_the_right_hand_sides_columns_sharded():
  """Each column of b is solved alone: no collective needed for b's sharded columns."""
  def f(a, b):
    return lax.linalg.triangular_solve(jnp.linalg.cholesky(a), b, left_side=True, lower=True)
  check_jit(f, (A, randn(8, 16)), (P(), P(None, "b")), MESH)


@case
def lu_with_pivots_and_permutation_of_a_row_sharded_matrix():
  check_jit(lax.linalg.lu, (randn(8, 8),), P("a"), MESH)


@case
def cho_solve_of_sharded_right_hand_sides():
  def f(a, b):
    return jax.scipy.linalg.cho_solve(jax.scipy.linalg.cho_factor(a, lower=True), b)
  check_jit(f, (A, randn(8, 16)), (P("a", "b"), P(None, ("a", "b"))), MESH)


@case
def spectral_and_nuclear_norms_of_a_batch_sharded_stack():
  def f(x):
    return jnp.linalg.norm(x, ord=2, axis=(1, 2)), jnp.linalg.norm(x, ord="nuc", axis=(1, 2))
  check_jit(f, (randn(8, 4, 4),), P("a"), MESH)


@case
def multi_dot_of_three_differently_sharded_matrices():
  check_jit(jnp.linalg.multi_dot, ([X, W, randn(8, 4, seed=2)],),
            ([P("a", "b"), P("b"), P(None, "a")],), MESH)


@case
def grad_of_slogdet_of_a_batch_sharded_stack():
  check_jit(jax.grad(lambda a: jnp.linalg.slogdet(a)[1].sum()), (spd(8, 4),), P(("a", "b")), MESH)


# --- jax.nn along a sharded axis ------------------------------------------------------------------

@case
def softmax_with_a_where_mask_along_a_sharded_axis():
  check_jit(lambda x, m: jax.nn.softmax(x, axis=1, where=m), (X, X > -0.5),
            (P("a", "b"), P("a", "b")), MESH)


@case
def logsumexp_with_scale_and_sign_along_a_sharded_axis():
  def f(x, b):
    return jax.nn.logsumexp(x, axis=1, b=b, return_sign=True)
  check_jit(f, (X, randn(8, 16, seed=3)), (P("a", "b"), P(None, "b")), MESH)


@case
def one_hot_of_sharded_labels_with_the_class_dim_sharded():
  check_jit(lambda i: jax.nn.one_hot(i, 16, dtype=jnp.bfloat16), (indices(16, 8),), P("a"), MESH,
            P("a", "b"))


@case
def dot_product_attention_with_sharded_heads_and_a_mask():
  q, k, v = (randn(2, 8, 4, 8, seed=s) for s in range(3))
  mask = np.tril(np.ones((8, 8), bool))[None, None]

  def f(q, k, v, m):
    return jax.nn.dot_product_attention(q, k, v, mask=m)
  spec = P("a", None, "b")
  check_jit(f, (q, k, v, mask), (spec, spec, spec, P()), MESH)


@case
def dot_product_attention_grouped_query_with_a_sharded_batch():
  """Four query heads over two key/value heads (GQA), the batch split over both axes."""
  q = randn(8, 4, 4, 8)
  k, v = randn(8, 4, 2, 8, seed=1), randn(8, 4, 2, 8, seed=2)
  check_jit(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True), (q, k, v),
            P(("a", "b")), MESH)


@case
def exact_gelu_and_silu_in_bfloat16_after_a_sharded_contraction():
  def f(x, w):
    h = x @ w
    return jax.nn.gelu(h, approximate=False), jax.nn.silu(h)
  check_jit(f, (X.astype(jnp.bfloat16), W.astype(jnp.bfloat16)), (P("a", "b"), P("b")), MESH)


@case
def glu_splitting_a_sharded_axis_in_halves():
  check_jit(lambda x: jax.nn.glu(x, axis=1), (X,), P("a", "b"), MESH)


@case
def standardize_along_a_sharded_axis():
  check_jit(lambda x: jax.nn.standardize(x, axis=1, epsilon=1e-3), (X,), P("a", "b"), MESH)


# --- sized set ops, searches and indexed updates ------------------------------------------------

@case
def nonzero_with_size_of_a_two_d_sharded_array():
  check_jit(lambda x: jnp.nonzero(x > 0.5, size=24, fill_value=-1), (X,), P("a", "b"), MESH)


@case
def bincount_with_sharded_weights_and_length():
  check_jit(lambda i, w: jnp.bincount(i, w, length=8), (indices(8, 32), randn(32, seed=1)),
            (P(("a", "b")), P("b")), MESH)


@case
def searchsorted_into_a_sharded_sorted_array_side_right():
  edges = np.sort(randn(32, seed=4))

  def f(e, q):
    return (jnp.searchsorted(e, q, side="right"),
            jnp.searchsorted(e, q, method="compare_all"))
  check_jit(f, (edges, X), (P("b"), P("a")), MESH)


@case
def argsort_stable_descending_along_a_sharded_dim():
  check_jit(lambda x: jnp.argsort(x, axis=0, stable=True, descending=True),
            (ints(8, 16, high=3),), P("a", "b"), MESH, P("a", "b"))


@case
def segment_max_with_sorted_sharded_segment_ids():
  ids = np.sort(indices(6, 32))
  check_jit(lambda x, s: jax.ops.segment_max(x, s, num_segments=6, indices_are_sorted=True),
            (randn(32, 4), ids), (P(("a", "b")), P(("a", "b"))), MESH)


@case
def scatter_mul_min_max_with_duplicate_indices():
  idx = np.array([1, 3, 1, 6, 3, 1, 0, 6], np.int32)

  def f(x, i, u):
    return x.at[i].mul(u), x.at[i].min(u), x.at[i].max(u)
  check_jit(f, (X, idx, randn(8, 16, seed=2)), (P("a", "b"), P("a"), P("b")), MESH)


@case
def set_with_dropped_and_get_with_filled_out_of_bounds_indices():
  idx = np.array([2, 9, -12, 5, 7, 40, 0, 3], np.int32)

  def f(x, i):
    return x.at[i].set(1.0, mode="drop"), x.at[i].get(mode="fill", fill_value=-7.0)
  check_jit(f, (X, idx), (P("a", "b"), P("b")), MESH)


# --- dtypes ---------------------------------------------------------------------------------------

@case
def int8_dot_accumulating_in_int32_over_a_sharded_contraction():
  def f(x, w):
    return lax.dot(x, w, preferred_element_type=jnp.int32)
  x, w = ints(8, 16, high=100).astype(np.int8), ints(16, 8, seed=1, high=100).astype(np.int8)
  check_jit(f, (x, w), (P("a", "b"), P("b")), MESH)


@case
def population_count_clz_and_logical_shifts_of_uint32():
  u = np.random.default_rng(5).integers(0, 2**32, (8, 16), dtype=np.uint32)

  def f(u):
    return (lax.population_count(u).sum(1), lax.clz(u), lax.shift_right_logical(u, jnp.uint32(3)),
            (u.astype(jnp.uint8) >> 2).max(0))
  check_jit(f, (u,), P("a", "b"), MESH)


@case
def bitcast_float32_to_bytes_and_back():
  """f32[8, 16] -> u8[8, 16, 4] (a new minor dim) and f32 -> int32 -> f32."""
  def f(x):
    b = lax.bitcast_convert_type(x, jnp.uint8)
    return b, lax.bitcast_convert_type(b, jnp.float32), lax.bitcast_convert_type(x, jnp.int32)
  check_jit(f, (X,), P("a", "b"), MESH)


@case
def reduce_precision_and_float16_sums_along_a_sharded_dim():
  def f(x):
    r = lax.reduce_precision(x, exponent_bits=5, mantissa_bits=10)
    return r, x.astype(jnp.float16).sum(1), (r * 3).astype(jnp.float16).max(0)
  check_jit(f, (X,), P("a", "b"), MESH)


@case
def bool_reductions_and_argmax_of_bools_along_sharded_dims():
  def f(m):
    return m.all(1), m.any(0), jnp.argmax(m, axis=0), m.sum(dtype=jnp.int8)
  check_jit(f, (X > 0.8,), P("a", "b"), MESH, (P("a"), P("b"), P("b"), P()))


# --- loops with traced bounds and sharded carries ------------------------------------------------

@case
def fori_loop_with_a_traced_bound_and_sharded_carries():
  def f(x, w, n):
    return lax.fori_loop(0, n, lambda i, c: (jnp.tanh(c[0] @ w) @ w.T, c[1] + i * c[0]), (x, x))
  check_jit(f, (X, W * 0.3, jnp.int32(3)), (P("a", "b"), P("b"), P()), MESH)


@case
def while_loop_until_a_sharded_norm_is_small():
  def f(x):
    def body(c):
      return c[0] * 0.5, c[1] + 1
    return lax.while_loop(lambda c: jnp.linalg.norm(c[0]) > 0.1, body, (x, 0))
  check_jit(f, (X,), P("a", "b"), MESH)


@case
def cummax_and_cumlogsumexp_along_a_sharded_dim():
  check_jit(lambda x: (lax.cummax(x, axis=1), lax.cumlogsumexp(x, axis=1)), (X,), P("a", "b"),
            MESH, P("a", "b"))


# --- transformations and staging of a partitioned function ---------------------------------------

def loss(x, w):
  return jnp.mean(jnp.tanh(x @ w) ** 2)


@case
def value_and_grad_with_two_argnums():
  ours, theirs = both(loss, (P("a", "b"), P("b")))
  same(jax.value_and_grad(ours, argnums=(0, 1))(X, W),
       jax.value_and_grad(theirs, argnums=(0, 1))(X, W))


@case
def linear_transpose_of_a_partitioned_linear_function():
  ours, theirs = both(lambda x: (x @ W) * 2.0, P("a", "b"))
  ct = randn(8, 8, seed=5)
  same(jax.linear_transpose(ours, X)(ct), jax.linear_transpose(theirs, X)(ct))


@case
def eval_shape_of_structs_with_and_without_shardings():
  mesh = get_mesh(MESH)
  ours, theirs = both(lambda x, w: (jnp.tanh(x @ w), x.sum(1)), (P("a", "b"), P("b")), P("a"))
  plain = (jax.ShapeDtypeStruct(X.shape, X.dtype), jax.ShapeDtypeStruct(W.shape, W.dtype))
  placed = (jax.ShapeDtypeStruct(X.shape, X.dtype, sharding=NamedSharding(mesh, P("a", "b"))),
            jax.ShapeDtypeStruct(W.shape, W.dtype, sharding=NamedSharding(mesh, P("b"))))
  for structs in (plain, placed):
    got, want = jax.eval_shape(ours, *structs), jax.eval_shape(theirs, *structs)
    assert [(g.shape, g.dtype) for g in got] == [(w.shape, w.dtype) for w in want]


@case
def make_jaxpr_of_a_partitioned_function_under_grad():
  ours, theirs = both(loss, (P("a", "b"), P("b")))
  got, want = jax.make_jaxpr(jax.grad(ours, 1))(X, W), jax.make_jaxpr(jax.grad(theirs, 1))(X, W)
  assert [(a.shape, a.dtype) for a in got.out_avals] == [(a.shape, a.dtype)
                                                         for a in want.out_avals]


@case
def vjp_of_a_partitioned_function_with_a_pytree_output():
  f = lambda x, w: {"h": jnp.tanh(x @ w), "n": (x * x).sum()}  # noqa: E731
  ours, theirs = both(f, (P("a", "b"), P("b")))
  cts = {"h": randn(8, 8, seed=6), "n": jnp.float32(2.0)}
  (got_out, got_vjp), (want_out, want_vjp) = jax.vjp(ours, X, W), jax.vjp(theirs, X, W)
  same(got_out, want_out)
  same(got_vjp(cts), want_vjp(cts), shardings=False)


@case
def jvp_with_an_integer_argument_and_float0_tangent():
  ours, theirs = both(lambda x, k: jnp.sin(x) * k, (P("a", "b"), P()))
  k = jnp.int32(3)
  tangents = (randn(8, 16, seed=7), np.zeros((), jax.dtypes.float0))
  same(jax.jvp(ours, (X, k), tangents), jax.jvp(theirs, (X, k), tangents))


@case
def checkpoint_of_a_partitioned_function_under_grad_and_jit():
  ours, theirs = both(lambda x, w: jnp.sin(x @ w), (P("a", "b"), P("b")), P("a"))

  def outer(f):
    return jax.jit(jax.grad(lambda w: (jax.checkpoint(f)(X, w) ** 2).sum()))
  same(outer(ours)(W), outer(theirs)(W), shardings=False)


@case
def lower_compile_and_as_text_of_a_partitioned_function():
  ours, theirs = both(loss, (P("a", "b"), P("b")))
  lowered = ours.lower(X, W)
  assert "all-reduce" in lowered.compile().as_text() and lowered.as_text()
  same(lowered.compile()(X, W), theirs(X, W))
  check_plan(ours, X, W)


@pytest.mark.parametrize("run", CASES, ids=lambda c: c.__name__)
def test_case(run: Callable[[], None]) -> None:
  run()
