"""JAX's own sharding tests, round 5: explicit-mode ops with ``out_sharding=`` (reshape, full,
arange, einsum, dot_general's preferred type), types read with ``jax.typeof`` and used to build
results, shard_map bodies (collectives over several axes, tiled gathers and scatters on dim 1,
integer pmax/pmin, permutations of several cycles, nested shard_maps over disjoint axes, remat,
scan and cond in a body), lax control flow with sharded carries, forward- and reverse-mode
derivatives taken inside the partitioned function, and dtypes from bool to complex64 through
elementwise ops, reductions and dots. Each is compared with ``jax.jit`` given the same shardings
(values and output shardings) and its plan with the compiled HLO (tests/helpers.py). Cases of
the earlier suites, test_jax_cases.py, test_jit_parity.py, test_nested_shard_map.py,
test_partly_manual.py and test_primitives.py are not repeated."""
from __future__ import annotations

import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import AxisType
from jax.sharding import PartitionSpec as P

import spmd
from helpers import (Cases, assert_partitioned_matches, check_committed, check_jit, get_mesh, ints,
                     randn)

CASES = Cases()  # functions of no arguments
MESH = "a2b4"
X, W = randn(8, 16), randn(16, 8, seed=1)

case = CASES.register


# --- explicit sharding mode -------------------------------------------------------------------

def check_explicit(fn: Callable, args: tuple, specs: tuple) -> spmd.Plan:
  """helpers.check_committed on a (2, 4) mesh of Explicit axes "x", "y"."""
  mesh = jax.make_mesh((2, 4), ("x", "y"), axis_types=(AxisType.Explicit,) * 2)
  return check_committed(fn, args, specs, mesh)


@case
def explicit_reshape_with_out_sharding():
  """A reshape splitting a sharded dim, its result sharding given by out_sharding."""
  check_explicit(lambda x: jnp.reshape(x * 2, (8, 4, 4), out_sharding=P("x", None, "y")), (X,),
                 (P("x", "y"),))


@case
def explicit_full_ones_and_arange_with_out_sharding():
  def f(x):
    full = jnp.full((8, 16), 3.0, out_sharding=P("x", "y"))
    ones = jnp.ones((8, 16), out_sharding=P(None, "y"))
    cols = jnp.arange(16, dtype=jnp.float32, out_sharding=P("y"))
    return x * full + ones, x + cols
  check_explicit(f, (X,), (P("x", None),))


@case
def explicit_batched_einsum_out_sharding():
  def f(a, b):
    return jnp.einsum("bij,bjk->bik", a, b, out_sharding=P("x", None, "y"))
  check_explicit(f, (randn(2, 8, 16), randn(2, 16, 8, seed=1)), (P("x"), P("x", None, "y")))


@case
def explicit_typeof_spec_reshards_another_value():
  """shard_map-free ShardingInTypes idiom: one argument's spec, read with jax.typeof, used to
  reshard the other before combining them."""
  def f(x, y):
    return x + jax.sharding.reshard(y, jax.typeof(x).sharding.spec) * 2
  check_explicit(f, (X, randn(8, 16, seed=2)), (P("x", "y"), P(None, "y")))


@case
def explicit_typeof_spec_builds_an_iota():
  def f(x):
    spec = jax.typeof(x).sharding.spec
    return x * lax.broadcasted_iota(jnp.float32, x.shape, 1, out_sharding=spec)
  check_explicit(f, (X,), (P(None, "y"),))


@case
def explicit_dot_general_preferred_element_type():
  def f(x, w):
    return lax.dot_general(x, w, (((1,), (0,)), ((), ())), preferred_element_type=jnp.float32,
                           out_sharding=P("x", None))
  check_explicit(f, (X.astype(jnp.bfloat16), W.astype(jnp.bfloat16)), (P("x", "y"), P("y")))


@case
def explicit_auto_axes_with_an_annotation_inside():
  """auto_axes over both axes: inside, a constraint XLA (spmd) honours; outside, out_sharding."""
  def inner(x, w):
    h = lax.with_sharding_constraint(x @ w, P(None, "y"))
    return jnp.tanh(h)

  def f(x, w):
    return jax.sharding.auto_axes(inner, out_sharding=P("x", None))(x, w) + 1
  check_explicit(f, (X, randn(16, 16, seed=1)), (P("x"), P(None, "y")))


@case
def explicit_mean_var_and_broadcast_back():
  def f(x):
    mu = x.mean(1, keepdims=True)
    return (x - mu) / jnp.sqrt(((x - mu) ** 2).mean(1, keepdims=True) + 1e-5), mu
  check_explicit(f, (X,), (P("x", "y"),))


# --- shard_map bodies inside a partitioned function -----------------------------------------------

def smap(body: Callable, in_specs: Any, out_specs: Any, **kwargs: Any) -> Callable:
  return jax.shard_map(body, mesh=get_mesh(MESH), in_specs=in_specs, out_specs=out_specs,
                       **kwargs)


@case
def shard_map_integer_pmax_pmin_over_both_axes():
  def body(b):
    return lax.pmax(b, ("a", "b")) - lax.pmin(b, ("b", "a")), lax.pmax(b.max(1), "b")
  f = lambda x: smap(body, P("a", "b"), (P("a", "b"), P("a")))(x + 1)  # noqa: E731
  check_jit(f, (ints(8, 16),), P("a", "b"), MESH)


@case
def shard_map_axis_index_of_axes_in_reverse_order():
  def body(b):
    k = lax.axis_index(("b", "a"))  # "b" major: k = b * 2 + a
    return b + k.astype(b.dtype) * 100
  check_jit(lambda x: smap(body, P(("b", "a")), P(("b", "a")))(x), (X,), P("a"), MESH)


@case
def shard_map_all_gather_tiled_axis_one():
  def body(b):  # b: [4, 4] -> [4, 16]
    return lax.all_gather(b, "b", axis=1, tiled=True) * 2
  f = lambda x: smap(body, P("a", "b"), P("a"), check_vma=False)(x) + 1  # noqa: E731
  check_jit(f, (X,), P("a", "b"), MESH)


@case
def shard_map_psum_scatter_dim_one_tiled_over_two_axes():
  def body(b):  # b: [8, 16] -> [8, 2], summed over all 8 devices
    return lax.psum_scatter(b, ("a", "b"), scatter_dimension=1, tiled=True)
  check_jit(lambda x: smap(body, P(), P(None, ("a", "b")), check_vma=False)(jnp.cos(x)), (X,),
            P(), MESH)


@case
def shard_map_ppermute_of_several_cycles():
  """Two cycles over the 8 devices: (0 1 2) and (3 4 5 6 7)."""
  perm = [(0, 1), (1, 2), (2, 0), (3, 4), (4, 5), (5, 6), (6, 7), (7, 3)]
  def body(b):
    return lax.ppermute(b, ("a", "b"), perm) - b
  check_jit(lambda x: smap(body, P(("a", "b")), P(("a", "b")))(x), (X,), P("a"), MESH)


@case
def shard_map_swapping_pairs_over_b():
  def body(b):
    return lax.ppermute(b, "b", [(0, 1), (1, 0), (2, 3), (3, 2)]) * 3
  check_jit(lambda x: smap(body, P("a", "b"), P("a", "b"))(x), (X,), P("a", "b"), MESH)


@case
def shard_map_unchecked_out_spec_naming_an_axis_the_body_does_not_vary_over():
  """check_vma=False, out_specs P("a", "b") for a value equal on every device (a psum over both
  axes): the result stacks its 2 x 4 copies."""
  def body(b):
    return lax.psum(b.sum(0, keepdims=True), ("a", "b"))
  check_jit(lambda x: smap(body, P("a", "b"), P("a", "b"), check_vma=False)(x) * 2, (X,),
            P("a", "b"), MESH)


@case
def shard_map_nested_over_disjoint_axes():
  """An outer shard_map manual over "a", an inner one over "b" inside it."""
  mesh = get_mesh(MESH)

  def inner(c):
    return lax.psum(c, "b")

  def outer(b):
    s = jax.shard_map(inner, in_specs=P(None, "b"), out_specs=P(), axis_names={"b"})
    return s(b) + lax.psum(b.sum(), "a")
  f = lambda x: jax.shard_map(outer, mesh=mesh, in_specs=P("a"), out_specs=P("a"),  # noqa
                              axis_names={"a"})(x)
  check_jit(f, (X,), P("a", "b"), MESH)


@case
def shard_map_under_remat_and_grad():
  def body(b, w):
    return lax.psum(jnp.sin(b) @ w, "b")

  @jax.remat
  def layer(x, w):
    return smap(body, (P("a", "b"), P("b")), P("a"))(x, w)
  loss = lambda x, w: (layer(x, w) ** 2).sum()  # noqa: E731
  check_jit(jax.value_and_grad(loss, argnums=(0, 1)), (X, W * 0.5), (P("a", "b"), P("b")), MESH)


@case
def shard_map_cond_in_body_on_a_psum():
  def body(b):
    total = lax.psum(b.sum(), ("a", "b"))
    return lax.cond(total > 0, lambda v: lax.psum(v, "b"), lambda v: v * 4, b)
  check_jit(lambda x: smap(body, P("a", "b"), P("a", "b"), check_vma=False)(x), (X,),
            P("a", "b"), MESH)


@case
def shard_map_scan_of_all_gathers_in_body():
  def body(b, ws):  # ws: [3, 4, 16] per device (its 4 rows of every 16x16 layer)
    def step(c, w):
      return jnp.tanh(c @ lax.all_gather(w, "b", tiled=True)), c.sum()
    return lax.scan(step, b, ws)
  f = lambda x, ws: smap(body, (P("a"), P(None, "b")), (P("a"), P("a")),  # noqa: E731
                        check_vma=False)(x, ws)
  check_jit(f, (X, randn(3, 16, 16, seed=2) * 0.3), (P("a"), P(None, "b")), MESH)


@case
def shard_map_body_switch_on_axis_index():
  def body(b):
    return lax.switch(lax.axis_index("b") % 3, [lambda v: v + 1, lambda v: v * 2, jnp.sin], b)
  check_jit(lambda x: smap(body, P(None, "b"), P(None, "b"))(x), (X,), P(None, "b"), MESH)


@case
def vmap_spmd_axis_name_of_a_shard_map():
  """jax.vmap with spmd_axis_name around a shard_map: the batch dim is split over "a" and the
  shard_map's specs gain it."""
  def per_example(v):  # v: [16], 4 per device over "b"
    return smap(lambda b: lax.psum(jnp.sin(b), "b") * 2, P("b"), P())(v)
  f = lambda x: jax.vmap(per_example, spmd_axis_name="a")(x)  # noqa: E731
  check_jit(f, (X,), P("a", "b"), MESH)


# --- control flow with sharded carries ------------------------------------------------------------

@case
def while_loop_of_two_carries_sharded_differently_with_a_data_dependent_trip_count():
  def f(x, y):
    def cond(c):
      i, a, b = c
      return (jnp.abs(a).sum() < 1e3) & (i < 20)

    def body(c):
      i, a, b = c
      return i + 1, a * 1.5 + b.T, b + 1
    return lax.while_loop(cond, body, (0, x, y))
  check_jit(f, (X, randn(16, 8, seed=2)), (P("a", "b"), P("b", "a")), MESH)


@case
def cond_branches_constrain_their_results_differently():
  """jax.jit's own program fails XLA's verifier here (the branches' results must share one
  sharding), so the reference is the function without the constraints."""
  def f(x, p, constrain=lax.with_sharding_constraint):
    return lax.cond(p.sum() > 0, lambda v: constrain(v * 2, P("a", "b")),
                    lambda v: constrain(jnp.cos(v), P(None, "b")), x)
  reference = jax.jit(functools.partial(f, constrain=lambda v, _: v))
  for seed in (0, 5):
    args = (X, randn(8, seed=seed))
    assert_partitioned_matches(f, args, (P("a"), P("a")), MESH, reference=reference)


@case
def switch_of_three_branches_on_a_sharded_reduction():
  def f(x, w):
    i = jnp.argmax(x.sum(0)) % 3
    return lax.switch(i, [lambda a, b: a @ b, lambda a, b: jnp.tanh(a) @ b,
                          lambda a, b: a @ jnp.sin(b)], x, w)
  check_jit(f, (X, W), (P("a", "b"), P("b")), MESH, P("a"))


@case
def associative_scan_of_a_linear_recurrence_along_a_sharded_dim():
  """h_t = a_t h_{t-1} + b_t by the (a, b) composition, along dim 0 sharded over "a"."""
  def combine(l, r):
    return r[0] * l[0], r[0] * l[1] + r[1]

  def f(a, b):
    return lax.associative_scan(combine, (a, b), axis=0)[1]
  a = 0.5 + 0.4 * np.tanh(randn(8, 4, seed=3))
  check_jit(f, (a, randn(8, 4, seed=4)), (P("a", "b"), P("a", "b")), MESH)


@case
def lax_map_of_a_pytree_with_batch_size():
  def f(x, y):
    return lax.map(lambda p: (p[0] @ p[1]).sum(), (x, y), batch_size=2)
  check_jit(f, (randn(8, 4, 16), randn(8, 16, 4, seed=1)), (P("a", None, "b"), P("a", "b")),
            MESH)


@case
def scan_in_reverse_with_a_sharded_carry_and_stacked_outputs():
  def f(c0, xs):
    def step(c, x):
      c = jnp.tanh(c + x)
      return c, c.sum(1)
    return lax.scan(step, c0, xs, reverse=True)
  check_jit(f, (X, randn(5, 8, 16, seed=2)), (P("a", "b"), P(None, "a", "b")), MESH)


@case
def fori_loop_with_a_sharded_carry_tuple_and_static_bounds():
  def f(x, w):
    def step(i, c):
      h, acc = c
      h = jnp.tanh(h @ w) + i
      return h, acc + h.sum(0)
    return lax.fori_loop(0, 3, step, (x, jnp.zeros(16)))
  check_jit(f, (randn(8, 16), randn(16, 16, seed=1) * 0.3), (P("a"), P(None, "b")), MESH)


# --- derivatives taken inside -------------------------------------------------------------------

def mlp_loss(w, x):
  return jnp.mean(jnp.tanh(x @ w) ** 2)


@case
def linearize_inside_applied_to_two_tangents():
  def f(x, w, t1, t2):
    y, lin = jax.linearize(lambda v: jnp.tanh(v @ w), x)
    return y, lin(t1), lin(t2)
  args = (X, W, randn(8, 16, seed=2), randn(8, 16, seed=3))
  check_jit(f, args, (P("a", "b"), P("b"), P("a", "b"), P("a")), MESH)


@case
def vjp_with_has_aux_inside():
  def f(x, w, ct):
    out, pullback, aux = jax.vjp(lambda v: (v @ w, v.max(1)), x, has_aux=True)
    return pullback(ct)[0], aux, out
  check_jit(f, (X, W, randn(8, 8, seed=2)), (P("a", "b"), P("b"), P("a")), MESH)


@case
def jvp_with_has_aux_inside():
  def f(x, t):
    return jax.jvp(lambda v: (jnp.sin(v).sum(1), v.max()), (x,), (t,), has_aux=True)
  check_jit(f, (X, randn(8, 16, seed=2)), (P("a", "b"), P("a", "b")), MESH)


@case
def hessian_of_a_small_sharded_function_inside():
  def f(v, m):
    return jax.hessian(lambda u: jnp.sum(jnp.tanh(m @ u) ** 2))(v)
  check_jit(f, (randn(8, seed=1), randn(16, 8, seed=2) * 0.5), (P("b"), P("a", "b")), MESH)


@case
def jacfwd_and_jacrev_of_a_vector_function_inside():
  def f(v, m):
    g = lambda u: jnp.tanh(m @ u)  # noqa: E731
    return jax.jacfwd(g)(v), jax.jacrev(g)(v)
  check_jit(f, (randn(8, seed=1), randn(16, 8, seed=2)), (P("b"), P("a", "b")), MESH)


@case
def grad_through_fori_loop_inside():
  def f(w, x):
    def loss(w):
      return lax.fori_loop(0, 3, lambda i, h: jnp.tanh(h @ w), x).sum()
    return jax.grad(loss)(w)
  check_jit(f, (randn(16, 16, seed=1) * 0.3, X), (P(None, "b"), P("a")), MESH)


@case
def value_and_grad_with_aux_inside():
  def f(w, x):
    (loss, aux), g = jax.value_and_grad(lambda w: (mlp_loss(w, x), (x @ w).max(0)),
                                        has_aux=True)(w)
    return loss, aux, g
  check_jit(f, (W, X), (P("b"), P("a", "b")), MESH, (P(), P("b"), P(None, "b")))


@case
def grad_of_a_while_free_scan_with_sharded_xs_inside():
  def f(w, xs):
    def loss(w):
      c, _ = lax.scan(lambda c, x: (jnp.tanh(c @ w + x), None), jnp.zeros((8, 16)), xs)
      return (c ** 2).sum()
    return jax.grad(loss)(w)
  check_jit(f, (randn(16, 16, seed=1) * 0.3, randn(4, 8, 16, seed=2)), (P(), P(None, "a", "b")),
            MESH)


# --- dtypes -------------------------------------------------------------------------------------

@case
def float16_elementwise_and_reductions():
  def f(x):
    return jnp.exp(x) * 0.5 - x, x.sum(0), x.max(1), jnp.mean(x, 0)
  check_jit(f, (randn(8, 16).astype(np.float16),), P("a", "b"), MESH)


@case
def bfloat16_dot_with_preferred_float32():
  def f(x, w):
    return lax.dot(x, w, preferred_element_type=jnp.float32), (x * 2).astype(jnp.float32)
  check_jit(f, (X.astype(jnp.bfloat16), W.astype(jnp.bfloat16)), (P("a", "b"), P("b")), MESH)


@case
def int8_dot_with_preferred_int32_contracting_a_sharded_dim():
  def f(x, w):
    return lax.dot_general(x, w, (((1,), (0,)), ((), ())), preferred_element_type=jnp.int32)
  x = ints(8, 16, high=10).astype(np.int8)
  w = ints(16, 8, seed=1, high=10).astype(np.int8)
  check_jit(f, (x, w), (P("a", "b"), P("b", None)), MESH)


@case
def uint32_shifts_xors_sums_and_max():
  def f(x, y):
    z = (x >> 3) ^ (y << 2)
    return z, z.sum(0), jnp.max(z, 1), (x % 7 + y // 3).astype(jnp.uint32)
  x = np.random.default_rng(0).integers(0, 2**31, (8, 16), dtype=np.uint32)
  y = np.random.default_rng(1).integers(0, 2**20, (8, 16), dtype=np.uint32)
  check_jit(f, (x, y), (P("a", "b"), P(None, "b")), MESH)


@case
def bool_logic_any_all_and_counts():
  def f(m, n):
    both = m & n
    return both, both.any(0), (m | n).all(1), (m ^ n).sum(), jnp.count_nonzero(m, axis=0)
  r = np.random.default_rng(2)
  check_jit(f, (r.random((8, 16)) > 0.5, r.random((8, 16)) > 0.3), (P("a", "b"), P("b")), MESH)


@case
def elementwise_of_an_argument_and_a_value_computed_from_another_sharded_differently():
  """x P("a") times sin(y), y P("b"): the product takes neither's axis on dim 0 (they are of one
  size and disagree, closed and open: their common prefix), as jax.jit (Shardy)."""
  check_jit(lambda x, y: x * jnp.sin(y), (X, randn(8, 16, seed=2)), (P("a"), P("b")), MESH)


@case
def complex64_elementwise_reductions_and_dot():
  def f(z, w):
    return jnp.abs(z) * jnp.angle(z), jnp.conj(z).sum(1), (z @ w).real, jnp.exp(1j * z.imag)
  z = (randn(8, 16) + 1j * randn(8, 16, seed=1)).astype(np.complex64)
  w = (randn(16, 4, seed=2) - 1j * randn(16, 4, seed=3)).astype(np.complex64)
  check_jit(f, (z, w), (P("a", "b"), P("b")), MESH)


@case
def int16_and_uint8_argmax_min_and_cumsum():
  def f(x, y):
    return jnp.argmax(x, 0), jnp.min(y, 1), jnp.cumsum(x.astype(jnp.int32), 1)
  x = ints(8, 16, high=1000).astype(np.int16)
  y = np.random.default_rng(3).integers(0, 255, (8, 16), dtype=np.uint8)
  check_jit(f, (x, y), (P("a", "b"), P("a", "b")), MESH, (P("b"), P("a"), P("a", "b")))


@case
def bfloat16_softmax_over_a_sharded_dim():
  check_jit(lambda x: jax.nn.softmax(x, axis=1), (X.astype(jnp.bfloat16),), P("a", "b"), MESH)


@case
def float16_scan_carry_and_int8_convert():
  def f(x):
    c, ys = lax.scan(lambda c, r: (c + r, (c * 2).astype(jnp.int8)), jnp.zeros(16, x.dtype), x)
    return c, ys
  check_jit(f, ((randn(8, 16) * 3).astype(np.float16),), P(None, "b"), MESH)


@pytest.mark.parametrize("run", CASES.params({}))
def test_case(run: Callable[[], None]) -> None:
  run()
