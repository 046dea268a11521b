"""Loop invariants: a loop body reading one of the loop's consts, or a value computed from them
alone, in another sharding reshards it once, before the loop (as XLA's loop-invariant code motion
does), not once per trip; reshards of carries and scanned slices stay inside."""
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

import spmd

from helpers import assert_partitioned_matches, no_more_than_xla, randn

# x is split over both axes and w over them the other way round: x @ w gathers w over "a" (the
# dot keeps x's layout), and the partial sum over "b" is reduce-scattered into the carry.
MESH, SX, SW = "a2b4", P("a", "b"), P("b", "a")
W_SHAPE = "float32[16,16]"


def _of_w(plan, shape: str = W_SHAPE) -> list:
  """The plan's collectives moving a tensor of w's shape."""
  return [c for c in plan.collectives if c.shape == shape]


def test_scan_reads_an_invariant_weight_resharded_once():
  """Ten steps read w: its gather runs once, before the scan (bytes counted once per call, not
  ten times), on the row of the dot that reads it; the carry's reduce-scatter runs every step."""
  def fn(x, w):
    return lax.scan(lambda h, _: (jnp.tanh(h @ w), None), x, None, length=10)[0]

  plan = assert_partitioned_matches(fn, (randn(8, 16), randn(16, 16, seed=1) * 0.3), (SX, SW),
                                    MESH, rtol=1e-4, atol=1e-4)
  (gather,) = _of_w(plan)
  assert (gather.kind, gather.trips, gather.primitive) == ("all-gather", 1, "dot_general")
  assert gather.step_bytes == gather.bytes == 256
  assert "hoisted" in gather.tensor
  carry = [c for c in plan.collectives if c is not gather]
  assert carry and all(c.trips == 10 for c in carry), plan.explain()


def test_two_loops_reading_one_weight_share_its_reshard():
  def fn(x, w):
    a = lax.fori_loop(0, 3, lambda i, h: jnp.tanh(h @ w), x)
    b = lax.scan(lambda h, _: (jnp.sin(h @ w), None), x, None, length=5)[0]
    return a, b

  plan = assert_partitioned_matches(fn, (randn(8, 16), randn(16, 16, seed=1) * 0.3), (SX, SW),
                                    MESH, rtol=1e-4, atol=1e-4)
  assert [(c.kind, c.trips) for c in _of_w(plan)] == [("all-gather", 1)], plan.explain()


def test_a_value_computed_from_invariants_leaves_the_loop():
  """``w.T * 2`` in two loop bodies depends on w alone: it is computed before each loop (the two
  merged, cse.py) and gathered once, as XLA hoists and merges it."""
  def fn(x, w):
    a = lax.fori_loop(0, 3, lambda i, h: jnp.tanh(h @ (w.T * 2)), x)
    b = lax.fori_loop(0, 5, lambda i, h: jnp.sin(h @ (w.T * 2)), x)
    return a, b

  plan = assert_partitioned_matches(fn, (randn(8, 16), randn(16, 16, seed=1) * 0.3), (SX, SX),
                                    MESH, rtol=1e-4, atol=1e-4)
  assert [(c.kind, c.trips) for c in _of_w(plan)] == [("all-gather", 1)], plan.explain()
  assert [r.depth for r in plan.rows if r.primitive in ("transpose", "mul")] == [0] * 4


def test_a_partial_sum_computed_before_the_loop_is_reduced_there():
  """``a @ b`` contracts a sharded dim and is invariant: it runs before the loop, partial, and is
  reduced there once (the sum does not flow into the body to be reduced every trip)."""
  def fn(c, a, b):
    return lax.fori_loop(0, 4, lambda i, h: jnp.tanh(h * (a @ b)), c)

  plan = assert_partitioned_matches(fn, (randn(8, 8), randn(8, 16, seed=1), randn(16, 8, seed=2)),
                                    (P(), P(None, "x"), P("x", None)), "x8", rtol=1e-4, atol=1e-4)
  assert [(c.kind, c.trips) for c in plan.collectives] == [("all-reduce", 1)], plan.explain()


def _sort_in_a_loop(x, w):
  return lax.fori_loop(0, 3, lambda i, h: lax.sort((w, h), dimension=0, num_keys=1)[1] * 2, x)


def test_a_hoisted_gather_of_a_whole_dim_is_still_reported():
  """A sort in the body needs dim 0 of both its operands whole, and they have no other dim: the
  invariant keys are gathered before the loop, the carry in every trip, and the plan warns
  about both."""
  plan = assert_partitioned_matches(_sort_in_a_loop, (randn(8), randn(8, seed=1)),
                                    (P("x"), P("x")), "x8")
  assert sorted(c.trips for c in plan.collectives if c.kind == "all-gather") == [1, 3]
  whole = [w for w in plan.warnings if "needs dim 0 of operand" in w]
  assert len(whole) == 2, plan.warnings


@pytest.mark.parametrize("columns", [16, 3])
def test_a_sorted_dims_axis_moves_to_another_dim_before_and_inside_the_loop(columns):
  """Where dim 1 can take the 8 devices, evenly (16 columns) or padded (3), the sort's axis
  moves there by an all-to-all instead: the invariant keys' once before the loop, the carry's
  in every trip (and back to the carry's form), nothing gathered."""
  plan = assert_partitioned_matches(_sort_in_a_loop, (randn(8, columns),
                                                      randn(8, columns, seed=1)),
                                    (P("x"), P("x")), "x8")
  assert sorted((c.kind, c.trips) for c in plan.collectives) == [
      ("all-to-all", 1), ("all-to-all", 3), ("all-to-all", 3)], plan.explain()
  assert not plan.warnings, plan.warnings


def test_nested_loops_hoist_out_of_every_loop():
  """w is invariant in the inner loop and in the outer one: its gather runs once per call;
  ``sin(h)`` of the outer carry is invariant in the inner loop only: it runs in the outer body."""
  def fn(x, w):
    def outer(h, _):
      return lax.fori_loop(0, 3, lambda i, g: jnp.tanh(g @ w) + jnp.sin(h) * i, h), None

    return lax.scan(outer, x, None, length=4)[0]

  plan = assert_partitioned_matches(fn, (randn(8, 16), randn(16, 16, seed=1) * 0.3), (SX, SW),
                                    MESH, rtol=1e-4, atol=1e-4)
  assert [(c.kind, c.trips) for c in _of_w(plan)] == [("all-gather", 1)], plan.explain()
  assert {c.trips for c in plan.collectives if c.shape != W_SHAPE} == {12}, plan.explain()
  assert [r.depth for r in plan.rows if r.primitive == "sin"] == [1], plan.explain()


def test_invariant_read_in_a_while_body_of_unknown_trips():
  """A while loop's trip count is a runtime value (zero included: the reshard before the loop
  then runs for nothing, harmlessly, as XLA's hoisted copy does); w's gather is counted once, the
  carry's per (unknown) trip."""
  def fn(x, w, n):
    return lax.while_loop(lambda s: s[0] < n, lambda s: (s[0] + 1, jnp.tanh(s[1] @ w)), (0, x))

  for n in (0, 4):
    plan = assert_partitioned_matches(fn, (randn(8, 16), randn(16, 16, seed=1) * 0.3,
                                           np.int32(n)), (SX, SW, P()), MESH, rtol=1e-4, atol=1e-4)
    assert [(c.kind, c.trips) for c in _of_w(plan)] == [("all-gather", 1)], plan.explain()
    assert {c.trips for c in plan.collectives if c.shape != W_SHAPE} == {None}, plan.explain()


def test_cond_branches_in_a_loop_keep_their_reshards():
  """A cond's branches read w through their own inputs: a branch runs at most once per cond, so
  its reshards stay in the branch (XLA leaves them there too), once per trip."""
  def fn(x, w):
    def body(i, h):
      return lax.cond(i % 2 == 0, lambda h, w: jnp.tanh(h @ w), lambda h, w: jnp.sin(h @ w), h, w)

    return lax.fori_loop(0, 4, body, x)

  plan = assert_partitioned_matches(fn, (randn(8, 16), randn(16, 16, seed=1) * 0.3), (SX, SW),
                                    MESH, rtol=1e-4, atol=1e-4)
  assert [(c.kind, c.trips) for c in _of_w(plan)] == [("all-gather", 4)] * 2, plan.explain()


def test_gradient_of_a_scanned_layer_stack():
  """Layers scanned over stacked kernels (resharded per layer) with a shared projection (an
  invariant, resharded once before the forward scan: two all-to-alls and a permute, 768 B, since
  a dot runs in an operand's layout with the result's axes on its other factors, 26112 B per
  call, was 27392 B with the projection gathered) and their gradient: the backward scan
  accumulates the projection's gradient in a carry, reduced every trip."""
  def loss(ws, proj, x):
    def layer(h, w):
      return jnp.tanh(h @ w) @ proj, None

    return jnp.sum(lax.scan(layer, x, ws)[0] ** 2)

  args = (randn(6, 16, 32, seed=2) * 0.3, randn(32, 16, seed=1) * 0.3, randn(8, 16))
  plan = assert_partitioned_matches(jax.grad(loss, argnums=(0, 1)), args,
                                    (P(None, "b", "a"), SW, SX), MESH, rtol=1e-4, atol=1e-4)
  hoisted = [(c.kind, c.shape, c.trips) for c in plan.collectives if "hoisted" in c.tensor]
  assert hoisted == [(kind, "float32[32,16]", 1) for kind in (
      "all-to-all", "collective-permute", "all-to-all")], plan.explain()
  accumulated = [c for c in _of_w(plan, "float32[32,16]") if c.kind == "all-reduce"]
  assert accumulated and all(c.trips == 6 for c in accumulated), plan.explain()


def test_loop_carry_annotated_otherwise_than_its_reader_wants():
  """A fori_loop whose body pins its carry to one sharding, read by a cond whose branch pins
  another: the loop's links have several executions, which were priced from forms of the body's
  values before the body was scheduled (a KeyError)."""
  def fn(x):
    y = lax.fori_loop(0, 3, lambda i, c: spmd.annotate(c * 1.01 + i, P("a", None)), x)
    return lax.cond(y.sum() > 0, lambda a: spmd.annotate(a * 2, P(None, "b")), lambda a: a, y)

  assert_partitioned_matches(fn, (randn(8, 16),), P("b", None), MESH)


def test_gradient_of_a_cond_whose_branches_make_different_residuals():
  """JAX fills the residual of sin, made only by the first branch, with an ``empty2`` scalar
  in the second (broadcast to the residual's shape), which had no rule and ran replicated."""
  def grads(x, w):
    def loss(w):
      y = lax.cond(x.sum() > 0, lambda w: jnp.sin(x @ w), lambda w: x @ w, w)
      return jnp.sum(y ** 2)

    return jax.grad(loss)(w)

  for sign in (1, -1):
    x = sign * jnp.abs(randn(8, 16, seed=1))
    assert_partitioned_matches(grads, (x, randn(16, 4, seed=2)), (P("x"), P()), "x8",
                               reference=jax.jit(grads), rtol=1e-4, atol=1e-5)


def test_an_unrolled_scan_holds_a_copy_of_its_collectives_per_unrolled_step():
  """JAX lowers a scan of length 5 unrolled 2 times as a loop of 2 trips over 2 copies of the
  body, then a fifth copy (unrolled fully: 5 copies, no loop; optax's muon runs its Newton-Schulz
  steps so): the plan lists each copy's collectives with its own trips, as the compiled program
  holds them (it listed the body's once, 5 trips, and read a fifth of the program's bytes)."""
  def fn(x, w, unroll):
    return lax.scan(lambda h, _: (jnp.tanh(h @ w), None), x, None, length=5, unroll=unroll)[0]

  args = (randn(8, 16), randn(16, 16, seed=1) * 0.3)
  for unroll, trips in ((2, [2, 2, 1]), (True, [1] * 5)):
    plan = assert_partitioned_matches(functools.partial(fn, unroll=unroll), args, (SX, SW), MESH,
                                      rtol=1e-4, atol=1e-4)
    copies: dict = {}
    for c in plan.collectives:
      if "hoisted" not in c.tensor:
        copies.setdefault((c.kind, c.bytes, c.shape), []).append(c.trips)
    assert copies and all(sorted(t) == sorted(trips) for t in copies.values()), plan.explain()


@pytest.mark.parametrize("mesh,spec", [("x8", P()), ("x8", P("x")), ("a2b4", P(("a", "b"))),
                                       ("a2b4", P("b"))])
def test_a_loop_with_a_trip_count_per_element(mesh, spec):
  """``jax.vmap`` of a while loop whose trip count differs per element (so too a vmapped
  ``jax.random.binomial``, and ``poisson`` before JAX 0.12): JAX's loop runs while any element's
  predicate holds, each element keeping its carry once its own fails. Its elements stay split
  as under jax.jit: the ``any`` is an all-reduce of one flag per trip, and nothing else moves."""
  def doubled(n):
    return lax.while_loop(lambda c: c[0] < n, lambda c: (c[0] + 1, c[1] * 2.0), (0, 1.0))[1]

  def sines(x, n):
    return lax.while_loop(lambda c: c[0] < n, lambda c: (c[0] + 1, jnp.sin(c[1]) * 2.0),
                          (0, x))[1]

  keys = jax.random.split(jax.random.key(0), 8)
  rates = np.arange(1, 9, dtype=np.float32)
  cases = [(jax.vmap(doubled), (np.arange(8) % 5,)),
           (jax.vmap(jax.vmap(doubled)), (np.arange(16).reshape(8, 2) % 5,)),
           (jax.vmap(lambda k, n: jax.random.binomial(k, n, 0.3)), (keys, rates)),
           (jax.vmap(sines), (randn(8, 16), np.arange(8) % 5))]
  for fn, args in cases:
    plan = no_more_than_xla(fn, args, (spec,) * len(args), mesh)
    assert {c.kind for c in plan.collectives} <= {"all-reduce"}, plan.explain()


@pytest.mark.parametrize("mesh,specs", [("x8", (P("x", None), P("x"))),
                                        ("a2b4", (P("a", "b"), P("a"))),
                                        ("a2b4", (P(None, "b"), P()))])
@pytest.mark.parametrize("rows", [8, 6, 3])
def test_a_loop_per_element_over_split_rows_and_features(mesh, specs, rows):
  """The predicate reads a reduction over the features, which may be split too, and the
  elements may not divide over their axis (padding rows take no part in the ``any``)."""
  def grown(x, limit):
    return lax.while_loop(lambda c: jnp.sum(c[1]) < limit,
                          lambda c: (c[0] + 1, c[1] * 1.5 + 0.25), (0, x))

  x, limits = np.abs(randn(rows, 16)), 8.0 * (1 + np.arange(rows, dtype=np.float32))
  no_more_than_xla(jax.vmap(grown), (x, limits), specs, mesh)
