"""Collectives repeated on one local buffer (spmd/partition/repeats.py): two values whose local
blocks are one buffer (reshapes in effect of one value) resharded alike run the same collective
twice in the lowered program, and XLA's CSE merges them. The plan counts each such collective
once: values, plan == compiled HLO (per kind of collective) and the collectives expected, for
gathers, all-to-alls, all-reduces of partial sums, piece exchanges, inside a loop body, dtypes
and meshes; and values that are not one buffer (another shape per device, another value), whose
collectives both run."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import spmd
from helpers import as_mesh, assert_partitioned_matches, assert_trees_match, ints, randn

BF16 = jnp.bfloat16


def _data(shape: tuple[int, ...], dtype) -> np.ndarray:
  return ints(*shape).astype(dtype) if np.dtype(dtype).kind in "iu" else randn(*shape).astype(dtype)


def _kinds(plan: spmd.Plan) -> list[str]:
  return [c.kind for c in plan.collectives]


def _moves(plan: spmd.Plan) -> list[str]:
  """The collectives that move a block to sort along its dim: all-to-alls (the sort then runs
  on another dim's shards) or gathers."""
  assert set(_kinds(plan)) <= {"all-to-all", "all-gather"}, plan.explain()
  return _kinds(plan)


@pytest.mark.parametrize("dtype", [np.float32, np.int32, BF16])
@pytest.mark.parametrize("mesh,spec", [("a2b4", P("a")), ("a2b4", P("b")),
                                       ("a2b2c2", P(("a", "c")))])
def test_two_reshapes_of_one_block_moved_alike_move_once(mesh, spec, dtype):
  """``x[:, :, None]`` and ``x.reshape(8, 4, 1)``: one reshape once XLA's simplifier has run, so
  one value (ir.py merges them), sorted once along its sharded dim 0: its block moves once to
  the sort, and once back where the outputs' form is not a slice of the whole (an all-to-all
  out of 'a', a gather into it)."""
  def f(x):
    return jnp.sort(x[:, :, None], axis=0), jnp.sort(x.reshape(8, 4, 1), axis=0)

  plan = assert_partitioned_matches(f, (_data((8, 4), dtype),), (spec,), mesh)
  assert [r.primitive for r in plan.rows].count("sort") == 1, plan.explain()
  assert len(_moves(plan)) == (1 if spec == P("a") else 2), plan.explain()


@pytest.mark.parametrize("mesh", ["a2b4", "a2b2c2"])
def test_reshapes_with_other_blocks_move_each(mesh):
  """``x[:, :, None]`` and ``x[:, None, :]`` hold x's block in two shapes ([n,4,1] and
  [n,1,4]): the collectives on two shapes are two instructions."""
  def f(x):
    return jnp.sort(x[:, :, None], axis=0), jnp.sort(x[:, None, :], axis=0)

  plan = assert_partitioned_matches(f, (randn(8, 4),), (P("a"),), mesh)
  assert len(_moves(plan)) == 2, plan.explain()


def test_two_values_of_one_shape_move_each():
  """Two different values (x and x + 1) of one shape are moved by two collectives."""
  def f(x):
    return jnp.sort(x[:, :, None], axis=0), jnp.sort((x + 1).reshape(8, 4, 1), axis=0)

  plan = assert_partitioned_matches(f, (randn(8, 4),), (P("a"),), "a2b4")
  assert len(_moves(plan)) == 2, plan.explain()


@pytest.mark.parametrize("dtype", [np.int32, np.float32])
@pytest.mark.parametrize("mesh,spec,shapes,outs", [
    ("a2b4", P(None, ("b", "a"), None), [(4, 1, 8, 1), (4, 4, 2, 1)], [P("a"), P("a", "b")]),
    ("a2b2c2", P(None, ("b", "a"), None), [(4, 1, 4, 1), (4, 2, 2, 1)], [P("a"), P("a", "b")]),
])
def test_all_to_alls_of_reshapes_of_one_block_run_once(mesh, spec, shapes, outs, dtype):
  """Two reshapes of x, each with the one block of x per device, each moving 'a' to dim 0 by
  an all-to-all of that block (seed 31 of the thorough profile)."""
  def f(x):
    return tuple(spmd.annotate(x.reshape(shape), out) for shape, out in zip(shapes, outs))

  n = shapes[0][2]
  plan = assert_partitioned_matches(f, (_data((4, n, 1), dtype),), (spec,), mesh)
  assert _kinds(plan).count("all-to-all") == 1, plan.explain()


@pytest.mark.parametrize("mesh", ["a2b4", "a2b2c2"])
def test_partial_sums_of_one_buffer_reduced_once(mesh):
  """``x @ w`` with the contraction split over 'a' is a partial sum; two reshapes of it, each
  needed whole, reduce the one buffer alike."""
  def f(x, w):
    y = x @ w
    return jnp.sort(y[:, :, None], axis=1), jnp.sort(y.reshape(4, 8, 1), axis=1)

  plan = assert_partitioned_matches(f, (randn(4, 8), randn(8, 8, seed=1)),
                                    (P(None, "a"), P("a", None)), mesh)
  assert _kinds(plan) == ["all-reduce"], plan.explain()


def test_repeats_inside_a_scan_body_merge_there():
  """Two reshapes of a carry gathered alike inside a scan body: merged in the body."""
  def f(x):
    def body(c, _):
      a = jnp.sort(c[:, :, None], axis=0)[..., 0]
      b = jnp.sort(c.reshape(8, 4, 1), axis=0)[..., 0]
      return spmd.annotate(a + b, P("a")), None
    return jax.lax.scan(body, x, None, length=3)[0]

  plan = assert_partitioned_matches(f, (randn(8, 4),), (P("a"),), "a2b4")
  assert [(c.kind, c.trips) for c in plan.collectives] == [("all-gather", 3)], plan.explain()


def test_gradient_through_two_reshapes():
  """The gradient of a loss over two sorted reshapes of a sharded activation: values and
  plan == HLO whichever of its reshards repeat."""
  def loss(w, x):
    h = jnp.tanh(x @ w)
    return (jnp.sort(h[:, :, None], axis=0) ** 2).sum() + jnp.sort(h.reshape(8, 8, 1), 0).sum()

  assert_partitioned_matches(jax.grad(loss), (randn(8, 8), randn(8, 8, seed=1)),
                             (P(None, "b"), P("a", None)), "a2b4")


@pytest.mark.parametrize("n", [6, 10])
@pytest.mark.parametrize("mesh,spec", [("a2b4", P("b")), ("a2b2c2", P(("a", "b"))),
                                       ("a2b2c2", P(("c", "a")))])
def test_reshapes_of_an_uneven_block(mesh, spec, n):
  """Reshapes of an unevenly split int32[n] (padded blocks), returned as JAX can hold them
  (realigned, then gathered): plan == HLO whichever collectives XLA merges (seed 21 of the
  thorough profile)."""
  def f(x):
    return x.reshape(1, n), x[:, None], x, jnp.sort(x.reshape(n, 1), axis=0)

  assert_partitioned_matches(f, (ints(n),), (spec,), mesh)


@pytest.mark.parametrize("shift", [1, -3])
@pytest.mark.parametrize("mesh,spec", [("a2b4", P("b")), ("a2b2c2", P(("a", "c")))])
def test_rolls_of_two_reshapes_of_one_block_exchange_once(mesh, spec, shift):
  """``roll`` of ``x[:, :, None]`` and of ``x.reshape(16, 4, 1)`` along the sharded dim: the
  same rows of one [n,4,1] block go to the same neighbours, one set of permutes."""
  def f(x):
    return jnp.roll(x[:, :, None], shift, 0), jnp.roll(x.reshape(16, 4, 1), shift, 0)

  plan = assert_partitioned_matches(f, (randn(16, 4),), (spec,), mesh)
  alone = assert_partitioned_matches(lambda x: jnp.roll(x[:, :, None], shift, 0),
                                     (randn(16, 4),), (spec,), mesh)
  assert plan.total_bytes == alone.total_bytes, plan.explain()


@pytest.mark.parametrize("mesh", ["a2b4", "a2b2c2"])
def test_rolls_of_reshapes_with_other_blocks_exchange_each(mesh):
  """``roll`` of ``x[:, :, None]`` and of ``x[:, None, :]``: rows of blocks of two shapes."""
  def f(x):
    return jnp.roll(x[:, :, None], 1, 0), jnp.roll(x[:, None, :], 1, 0)

  plan = assert_partitioned_matches(f, (randn(16, 4),), (P("a"),), mesh)
  alone = assert_partitioned_matches(lambda x: jnp.roll(x[:, :, None], 1, 0),
                                     (randn(16, 4),), (P("a"),), mesh)
  assert plan.total_bytes == 2 * alone.total_bytes, plan.explain()


def test_pooling_of_two_reshapes_of_one_block_exchanges_once():
  """Max pooling (3 rows, stride 1, SAME) of two reshapes of one NHWC block sharded along H."""
  def pool(x):
    return jax.lax.reduce_window(x, -jnp.inf, jax.lax.max, (1, 3, 1, 1), (1, 1, 1, 1), "SAME")

  def f(x):
    return pool(x[..., None]), pool(x.reshape(2, 16, 4, 1))

  plan = assert_partitioned_matches(f, (randn(2, 16, 4),), (P(None, "b"),), "a2b4")
  alone = assert_partitioned_matches(lambda x: pool(x[..., None]), (randn(2, 16, 4),),
                                     (P(None, "b"),), "a2b4")
  assert plan.total_bytes == alone.total_bytes > 0, plan.explain()


def test_reshapes_of_a_key_array_move_once():
  """PRNG keys (an extended dtype) over 'a', two reshapes of them wanted over 'b': one
  reshard of their one block, then a draw from each key."""
  def f(keys):
    a = spmd.annotate(keys[:, None], P("b"))
    b = spmd.annotate(keys.reshape(8, 1), P("b"))
    return jax.vmap(jax.random.normal)(a[:, 0]), jax.vmap(jax.random.uniform)(b[:, 0])

  keys = jax.random.split(jax.random.key(0), 8)
  assert_partitioned_matches(f, (keys,), (P("a"),), "a2b4")


@pytest.mark.parametrize("mesh,spec", [("x8", P(None, "x")), ("a2b4", P("a", "b")),
                                       ("a2b2c2", P("a", ("b", "c")))])
def test_sums_equal_through_a_stop_gradient_reduce_once(mesh, spec):
  """``exp(h - m)`` and ``exp(h - stop_gradient(m))`` of a row max ``m``, summed over a split dim
  (jax 0.12.1's ``log_softmax`` beside ``softmax``): ``stop_gradient`` lowers to nothing, so
  XLA's CSE merges the two sums and their all-reduce; the plan counted both. The lowered program
  keeps the ``stop_gradient``: forward-mode derivatives of the partitioned function, which
  differ between the two sums, are the unpartitioned function's."""
  def fn(h):
    m = h.max(1, keepdims=True)
    return jnp.exp(h - m).sum(1), jnp.exp(h - jax.lax.stop_gradient(m)).sum(1)

  h, t = randn(8, 16), randn(8, 16, seed=1)
  plan = assert_partitioned_matches(fn, (h,), spec, mesh, rtol=1e-5, atol=1e-5)
  assert _kinds(plan) == ["all-reduce", "all-reduce"], plan.explain()  # the max, one sum
  partitioned = spmd.partition(fn, mesh=as_mesh(mesh), in_specs=spec)
  assert_trees_match(jax.jvp(partitioned, (h,), (t,)), jax.jvp(fn, (h,), (t,)), 1e-5, 1e-5)
