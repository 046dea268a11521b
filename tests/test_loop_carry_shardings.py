"""A loop carry takes its body's sharding (propagate.py: links after their regions' ops, and a
carry's init and result do not outrank the body by being closed and rank after the body's
input and output, OpShardingRule.outside): the
init is resharded once before the loop rather than the carry on every trip, as XLA does. Values,
plan == compiled HLO and bytes against XLA's partitioner for scans and while loops, forward and
gradient, even and uneven, and the cases where the init's sharding still wins (a body that
leaves the carry open, a closed result)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from helpers import assert_partitioned_matches, get_mesh, no_more_than_xla, randn


def _constrained(mesh_name: str, spec: P):
  sharding = NamedSharding(get_mesh(mesh_name), spec)
  return lambda x: lax.with_sharding_constraint(x, sharding)


@pytest.mark.parametrize("mesh,init,body", [
    ("a2b4", P("a"), P("b")),
    ("a2b4", P("b"), P(None, "a")),
    ("a2b2c2", P("a", "b"), P("c", "a")),
    ("a2b2c2", P(("a", "b")), P("c")),
])
def test_scan_carry_keeps_the_body_sharding(mesh, init, body):
  """The carry is resharded once before the loop; per trip nothing moves (xs are replicated)."""
  constrain = _constrained(mesh, body)

  def f(c, xs):
    return lax.scan(lambda c, x: (jnp.tanh(constrain(c) * x), None), c, xs)[0]

  plan = no_more_than_xla(f, (randn(8, 8), randn(5, 8, 8, seed=1)), (init, P()), mesh)
  assert all(c.trips == 1 for c in plan.collectives), plan.explain()


@pytest.mark.parametrize("mesh,init,body", [("a2b4", P("a"), P("b")),
                                            ("a2b2c2", P("a", "b"), P("b", "c"))])
def test_while_carry_keeps_the_body_sharding(mesh, init, body):
  """A fori_loop (a while loop) whose body constrains its carry: no collective inside it."""
  constrain = _constrained(mesh, body)
  f = lambda x: lax.fori_loop(0, 4, lambda i, c: jnp.sin(constrain(c)) + 1.0, x)
  plan = no_more_than_xla(f, (randn(8, 8),), (init,), mesh)
  assert all(c.trips == 1 for c in plan.collectives), plan.explain()


def test_scan_carry_gradient_keeps_the_body_sharding():
  """The gradient of a loss over such a scan, whose body's constraint reaches its output only
  through a dot (a rule of propagation's second level): the carry still takes the body's P('b'),
  which its input has from the first level on, 320 B per device as XLA (was 704 B: the init's
  P('a') outranked the body's input and reached its output, the backward scan's carries
  meeting P('a') and P('b'))."""
  constrain = _constrained("a2b4", P("b"))

  def loss(c, w):
    def step(c, _):
      c = jnp.tanh(constrain(c) @ w)
      return c, c.sum()
    c, ys = lax.scan(step, c, None, length=3)
    return (c ** 2).sum() + ys.sum()

  plan = no_more_than_xla(jax.grad(loss, argnums=(0, 1)),
                          (randn(8, 8), randn(8, 8, seed=1) / 4), (P("a"), P()), "a2b4")
  assert plan.total_bytes == 320, plan.explain()


@pytest.mark.parametrize("loop", ["scan", "fori_loop"])
@pytest.mark.parametrize("mesh,init,body", [("a2b4", P("a"), P("b")), ("a2b4", P("b"), P("a")),
                                            ("a2b2c2", P(("a", "b")), P(("c", "a")))])
def test_gradient_of_a_carry_behind_a_dot(loop, mesh, init, body):
  """The gradient of a loss over a loop whose body's constraint reaches its output through a
  dot: bytes no more than XLA's (the carry takes the body's sharding)."""
  constrain = _constrained(mesh, body)
  step = lambda c, w: jnp.tanh(constrain(c) @ w)

  def loss(c, w):
    if loop == "scan":
      c = lax.scan(lambda c, _: (step(c, w), None), c, None, length=3)[0]
    else:  # static bounds: differentiated as a scan
      c = lax.fori_loop(0, 3, lambda i, c: step(c, w), c)
    return (c ** 2).sum()

  no_more_than_xla(jax.grad(loss, argnums=(0, 1)), (randn(8, 8), randn(8, 8, seed=1) / 4),
                   (init, P()), mesh)


def test_uneven_carry_keeps_the_body_sharding():
  """f32[6,8] over 4 devices: the uneven init is realigned once, the body runs on its form."""
  constrain = _constrained("a2b4", P("b"))
  f = lambda c, xs: lax.scan(lambda c, x: (jnp.tanh(constrain(c) + x), None), c, xs)[0]
  plan = assert_partitioned_matches(f, (randn(6, 8), randn(3, 6, 8, seed=1)), (P("a"), P()),
                                    "a2b4")
  assert all(c.trips == 1 for c in plan.collectives), plan.explain()


def test_open_body_keeps_the_init_sharding():
  """A body that asks nothing of its carry runs in the init's sharding: nothing moves."""
  f = lambda c, xs: lax.scan(lambda c, x: (jnp.tanh(c * x), None), c, xs)[0]
  plan = no_more_than_xla(f, (randn(8, 8), randn(3, 8, 8, seed=1)), (P("a"), P()), "a2b4")
  assert plan.collectives == (), plan.explain()


def test_closed_init_and_result_with_an_open_body_reshard_the_result_once():
  """in_specs P('a') and out_specs P('b') around a body that asks nothing: the carry keeps the
  init's axes and the result is resharded once after the loop (round 7's case)."""
  f = lambda c, xs: lax.scan(lambda c, x: (jnp.tanh(c * x), None), c, xs)[0]
  plan = no_more_than_xla(f, (randn(8, 8), randn(3, 8, 8, seed=1)), (P("a"), P()), "a2b4",
                          P("b"))
  assert all(c.trips == 1 for c in plan.collectives), plan.explain()
