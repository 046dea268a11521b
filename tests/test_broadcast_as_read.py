"""A broadcast whose one reader would reshard its result reads its operand resharded instead and
writes the form the reader reads (schedule._broadcast_as_read): the smaller tensor moves, as
where XLA carries the reader's sharding back through the broadcast."""
import jax
import jax.numpy as jnp
import pytest
from jax.sharding import PartitionSpec as P

import spmd
from helpers import assert_partitioned_matches, check_jit_within_xla, randn


def gqa_scores(q, k):
  """Grouped-query attention's scores: each kv head repeated for its query heads."""
  return jnp.einsum("bshd,bthd->bhst", q, jnp.repeat(k, q.shape[2] // k.shape[2], axis=2))


def _collectives_on(plan: spmd.Plan, primitive: str) -> int:
  return sum(c.bytes for c in plan.collectives if c.primitive == primitive)


@pytest.mark.parametrize("kv_heads,heads,devices", [(2, 8, 4), (4, 16, 8), (2, 16, 8)])
def test_gqa_repeat_of_kv_heads_split_unevenly_gathers_the_cache(kv_heads, heads, devices):
  """Query heads split evenly, fewer kv heads than devices (uneven): the kv cache f32[2,4,kv,16]
  is gathered whole (its own bytes) before ``jnp.repeat`` broadcasts it, not the repeated heads
  summed from masked pieces after it (heads / kv times as many bytes)."""
  args = (randn(2, 4, heads, 16), randn(2, 4, kv_heads, 16, seed=1))
  mesh = jax.make_mesh((devices,), ("model",))
  plan = assert_partitioned_matches(gqa_scores, args, (P(None, None, "model"),) * 2, mesh)
  assert plan.total_bytes == args[1].nbytes, plan.explain()
  assert _collectives_on(plan, "broadcast_in_dim") == plan.total_bytes, plan.explain()


def test_gqa_decode_step_gathers_the_written_cache_once():
  """A decode step writes its token's keys into the cache (kv 2 over 'model' 4, batch over
  'data' on 2x4) and repeats them for 8 query heads: one 1,024 B gather of the cache's block."""
  def step(cache, x, w, q, i):
    cache = jax.lax.dynamic_update_slice(cache, jnp.einsum("btd,dhk->bthk", x, w), (0, i, 0, 0))
    return cache, jnp.einsum("bthk,bshk->bhts", q, jnp.repeat(cache, 4, axis=2))

  args = (jnp.zeros((4, 8, 2, 8)), randn(4, 1, 16), randn(16, 2, 8, seed=1),
          randn(4, 1, 8, 8, seed=2), jnp.int32(3))
  specs = (P("data"), P("data"), P(None, "model"), P("data", None, "model"), None)
  plan = assert_partitioned_matches(step, args, specs, spmd.make_mesh({"data": 2, "model": 4}))
  assert plan.total_bytes == 1024, plan.explain()


def test_gradient_of_gqa_scores():
  """The repeat's gradient (a sum over the repeats) and the scores' alike, kv split unevenly."""
  def loss(q, k):
    return jnp.sum(jnp.tanh(gqa_scores(q, k)))

  args = (randn(2, 4, 8, 16), randn(2, 4, 2, 16, seed=1))
  assert_partitioned_matches(jax.grad(loss, argnums=(0, 1)), args, (P(None, None, "model"),) * 2,
                             jax.make_mesh((4,), ("model",)), rtol=1e-4, atol=1e-5)


def test_broadcast_read_twice_keeps_its_form():
  """A broadcast with a second reader is made once, in its own form (guard)."""
  def f(q, k):
    repeated = jnp.repeat(k, 4, axis=2)
    return jnp.einsum("bshd,bthd->bhst", q, repeated), repeated.sum(2)

  args = (randn(2, 4, 8, 16), randn(2, 4, 2, 16, seed=1))
  assert_partitioned_matches(f, args, (P(None, None, "model"),) * 2,
                             jax.make_mesh((4,), ("model",)))


@pytest.mark.parametrize("mesh,specs", [
    ("x4", (P("x"), P("x"))),
    ("x4", (P(None, "x"), P("x"))),
    ("a2b4", (P("a", "b"), P("a"))),
    ("a2b4", (P(("a", "b")), P(("a", "b")))),
])
def test_bias_broadcast_against_an_otherwise_sharded_reader(mesh, specs):
  """A bias broadcast to rows an add reads sharded on another dim: the bias (not the broadcast
  rows) is resharded, no more bytes than XLA."""
  def f(x, b):
    return jnp.tanh(x + b[None, :])

  check_jit_within_xla(f, (randn(8, 16), randn(16, seed=1)), specs, mesh)
