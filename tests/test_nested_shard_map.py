"""A user's ``jax.shard_map`` inside a partitioned function (spmd/partition/manual.py), after JAX's
tests/shard_map_test.py: its operands are resharded to its in_specs, its body runs on the local
shards with its own collectives (which the plan lists), its results are its out_specs' blocks and
propagate to their neighbours. Each case goes through helpers' one check (values against
``jax.jit`` of the same function, plan against the compiled HLO)."""
from __future__ import annotations

from collections import Counter

import jax
import jax.numpy as jnp
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

import spmd
from tests.helpers import assert_partitioned_matches, get_mesh, randn

MESH = "a2b4"


def body_kinds(plan: spmd.Plan) -> Counter:
  """Bytes per kind of the collectives a shard_map's body runs."""
  kinds: Counter = Counter()
  for c in plan.collectives:
    if c.primitive == "shard_map" and c.before == "manual":
      kinds[c.kind] += c.bytes
  return kinds


def reshards(plan: spmd.Plan) -> list:
  """The collectives that are not a shard_map body's own."""
  return [c for c in plan.collectives if c.before != "manual"]


def smap(body, in_specs, out_specs, **kwargs):
  return jax.shard_map(body, mesh=get_mesh(MESH), in_specs=in_specs, out_specs=out_specs,
                       **kwargs)


def test_psum_in_a_body():
  """psum over one axis: an all-reduce of the local block; the result is replicated over it."""
  def f(x):
    return smap(lambda b: lax.psum(b, "b"), P("a", "b"), P("a"))(x) * 2

  x = randn(8, 16)
  plan = assert_partitioned_matches(f, (x,), (P("a", "b"),), MESH)
  assert body_kinds(plan) == {"all-reduce": 4 * 4 * 4}
  assert not reshards(plan)


def test_all_gather_in_a_body():
  """all_gather of the local blocks over one axis (tiled): the plan counts the gathered buffer."""
  def f(x):
    return smap(lambda b: lax.all_gather(b, "b", axis=1, tiled=True) + 1.0, P("a", "b"),
                P("a", "b"))(x)

  x = randn(8, 16)
  plan = assert_partitioned_matches(f, (x,), (P("a", "b"),), MESH)
  assert body_kinds(plan) == {"all-gather": 4 * 16 * 4}


def test_ppermute_ring_and_axis_index():
  """A ring over "b" (JAX's ppermute example) shifted by each device's axis_index."""
  def body(b):
    n = 4
    ring = lax.ppermute(b, "b", [(i, (i + 1) % n) for i in range(n)])
    return ring * (lax.axis_index("b") + 1).astype(b.dtype)

  x = randn(8, 16)
  plan = assert_partitioned_matches(lambda x: smap(body, P("a", "b"), P("a", "b"))(x), (x,),
                                    (P("a", "b"),), MESH)
  assert body_kinds(plan) == {"collective-permute": 4 * 4 * 4}


@pytest.mark.parametrize("body, in_spec, out_spec, kind, nbytes", [
    (lambda b: lax.all_to_all(b, "b", 1, 0, tiled=True), P("a", "b"), P(("a", "b")),
     "all-to-all", 4 * 4 * 4),
    (lambda b: lax.psum_scatter(b, "b", scatter_dimension=0, tiled=True), P("a"),
     P(("a", "b")), "reduce-scatter", 4 * 16 * 4),
    (lambda b: lax.pmax(b, ("a", "b")), P("a", "b"), P(), "all-reduce", 4 * 4 * 4),
], ids=["all_to_all", "psum_scatter", "pmax"])
def test_other_collectives_in_a_body(body, in_spec, out_spec, kind, nbytes):
  x = randn(8, 16)
  plan = assert_partitioned_matches(lambda x: smap(body, in_spec, out_spec)(x), (x,), (in_spec,),
                                    MESH)
  assert body_kinds(plan) == {kind: nbytes}


def test_bfloat16_body_collectives_are_priced_as_xla_cpu_moves_them():
  """XLA:CPU widens a bfloat16 all-reduce to float32: the plan prices the body's psum so."""
  def f(x):
    return smap(lambda b: lax.psum(b, "b"), P("a", "b"), P("a"))(x)

  plan = assert_partitioned_matches(f, (randn(8, 16).astype(jnp.bfloat16),), (P("a", "b"),),
                                    MESH)
  assert body_kinds(plan) == {"all-reduce": 4 * 4 * 4}


def test_pytree_operands_a_literal_and_a_closed_over_constant():
  """in_specs as a pytree prefix, a Python scalar operand (replicated) and a constant the body
  closes over."""
  table = jnp.arange(16.0)

  def body(scale, t):
    return {"u": lax.psum(t["p"], "a") * scale, "v": t["q"] + table[:4]}

  def f(d):
    return smap(body, (P(), {"p": P("a"), "q": P(None, "b")}), {"u": P(), "v": P(None, "b")})(
        3.0, d)

  x = randn(8, 16)
  plan = assert_partitioned_matches(f, ({"p": x, "q": x},), ({"p": P("a"), "q": P()},), MESH)
  assert body_kinds(plan) == {"all-reduce": 4 * 16 * 4}
  assert not reshards(plan)


def test_a_size_one_mesh_axis():
  """Collectives over a mesh axis of size 1 stay in the compiled program: the plan lists them."""
  mesh = spmd.make_mesh({"a": 1, "b": 8})

  def f(x):
    return jax.shard_map(lambda b: lax.psum(lax.psum(b, "a"), "b"), mesh=mesh,
                         in_specs=P("a", "b"), out_specs=P())(x)

  plan = assert_partitioned_matches(f, (randn(8, 16),), (P("a", "b"),), mesh)
  assert {(c.axes, c.bytes) for c in plan.collectives} == {(("a",), 8 * 2 * 4),
                                                          (("b",), 8 * 2 * 4)}


def test_out_specs_replicated_over_every_axis():
  """A psum over both axes: the result is whole on every device, out_specs P()."""
  def f(x):
    return smap(lambda b: lax.psum(jnp.sum(b, axis=0), ("a", "b")), P("a", "b"), P())(x)

  x = randn(8, 16)
  plan = assert_partitioned_matches(f, (x,), (P(None, "b"),), MESH, out_specs=P())
  assert body_kinds(plan) == {"all-reduce": 4 * 4}


def test_operands_are_resharded_to_the_in_specs():
  """An operand sharded otherwise is resharded to the in_specs first (priced as any reshard), on
  the row of the annotation pinning it: P(None, ('a','b')) -> P('a','b') of f32[8,16], each new
  [4,4] block two [4,2] pieces of old blocks, by two collective-permutes of a piece, 64 B (128 B
  before reshard.py's ExchangePieces: a permute and an all-to-all)."""
  def f(x):
    return smap(lambda b: lax.psum(b, "a"), P("a", "b"), P(None, "b"))(x)

  x = randn(8, 16)
  plan = assert_partitioned_matches(f, (x,), (P(None, ("a", "b")),), MESH)
  assert body_kinds(plan) == {"all-reduce": 4 * 4 * 4}
  assert [(c.kind, c.bytes, c.primitive) for c in reshards(plan)] == [
      ("collective-permute", 32, "spmd_annotate")] * 2


def test_between_auto_sharded_matmuls():
  """Matmuls before and after the shard_map take its specs by propagation: with every input open,
  nothing is resharded around it (the inputs are placed to suit it), and the one psum after it
  is the second matmul's contraction over "b", reduced for the output."""
  def f(x, w1, w2):
    h = jnp.tanh(x @ w1)
    y = smap(lambda b: b * lax.psum(jnp.sum(b * b, axis=1, keepdims=True), "b"),
             P("a", "b"), P("a", "b"))(h)
    return y @ w2

  args = (randn(8, 12), randn(12, 16, seed=1), randn(16, 8, seed=2))
  plan = assert_partitioned_matches(f, args, (None, None, None), MESH, out_specs=P("a"))
  assert body_kinds(plan) == {"all-reduce": 4 * 1 * 4}
  assert [(c.kind, c.bytes) for c in reshards(plan)] == [("all-reduce", 4 * 8 * 4)]
  assert plan.in_specs == (P("a", None), P(None, "b"), P("b", None))


def test_under_grad():
  """jax.grad through a shard_map: the forward body (its psum over "b", and residuals out) and
  the transposed body (the weight's cotangent summed over "a", psum's transpose being none) are
  two shard_maps, checked against jax.jit's gradient."""
  def loss(x, w):
    y = smap(lambda b, v: lax.psum(jnp.sin(b) * v, "b"), (P("a", "b"), P(None, "b")),
             P("a"))(x, w)
    return jnp.sum(y ** 2)

  args = (randn(8, 16), randn(1, 16, seed=1))
  plan = assert_partitioned_matches(jax.grad(loss, argnums=(0, 1)), args,
                                    (P("a", "b"), P(None, "b")), MESH)
  assert {(c.kind, c.axes, c.bytes) for c in plan.collectives} == {
      ("all-reduce", ("b",), 4 * 4 * 4), ("all-reduce", ("a",), 1 * 4 * 4)}


def test_inside_a_scan():
  """A shard_map in a scan's body runs once per trip: its collectives count that often. Its
  result is the carry itself (typed as spmd's program types values, as the carry's input is)."""
  def body(b):
    ring = lax.ppermute(b, "b", [(i, (i + 1) % 4) for i in range(4)])
    return ring + lax.psum(b, "a")

  def f(x):
    step = lambda c, _: (smap(body, P("a", "b"), P("a", "b"))(c), None)  # noqa: E731
    return lax.scan(step, x, None, length=3)[0]

  x = randn(8, 16)
  plan = assert_partitioned_matches(f, (x,), (P("a", "b"),), MESH)
  assert {(c.kind, c.trips) for c in plan.collectives} == {("collective-permute", 3),
                                                          ("all-reduce", 3)}


def test_in_a_cond_branch():
  """One branch returns the shard_map's result as it is, the other computes on it: both branches
  give one type. The plan lists each branch's collectives (one runs)."""
  s = smap(lambda b: lax.psum(jnp.sin(b), "b"), P("a", "b"), P("a"))

  def f(x):
    return lax.cond(x.sum() > 0, lambda v: s(v) * 2, lambda v: s(v * 3), x)

  x = randn(8, 16)
  plan = assert_partitioned_matches(f, (x,), (P("a", "b"),), MESH)
  assert body_kinds(plan) == {"all-reduce": 2 * 4 * 4 * 4}


def test_under_jvp():
  """Forward mode: the tangent's body (psum's linear part) is a second psum in the same body."""
  s = smap(lambda b: lax.psum(jnp.sin(b), "b"), P("a", "b"), P("a"))
  x = randn(8, 16)
  plan = assert_partitioned_matches(lambda x, t: jax.jvp(s, (x,), (t,)), (x, 2 * x),
                                    (P("a", "b"), P("a", "b")), MESH)
  assert body_kinds(plan) == {"all-reduce": 2 * 4 * 4 * 4}


def test_a_scan_inside_the_body():
  """The body's own scan (column sums of the block's rows, each summed over "a"): a psum in it
  runs once per trip of that scan."""
  def body(b):
    step = lambda c, r: (c + lax.psum(r, "a"), None)  # noqa: E731
    return lax.scan(step, lax.pcast(jnp.zeros(b.shape[1:], b.dtype), "b", to="varying"), b)[0]

  x = randn(8, 16)
  plan = assert_partitioned_matches(lambda x: smap(body, P("a", "b"), P("b"))(x), (x,),
                                    (P("a", "b"),), MESH, out_specs=P("b"))
  assert {(c.kind, c.trips, c.bytes) for c in plan.collectives
          if c.before == "manual"} == {("all-reduce", 4, 4 * 4)}


def test_unchecked_body():
  """check_vma=False: the body's psum is the unchecked one, and the user asserts out_specs."""
  def f(x):
    return smap(lambda b: lax.psum(b, "b"), P("a", "b"), P("a"), check_vma=False)(x)

  x = randn(8, 16)
  plan = assert_partitioned_matches(f, (x,), (P("a", "b"),), MESH)
  assert body_kinds(plan) == {"all-reduce": 4 * 4 * 4}


def test_another_mesh_is_refused_by_jax():
  """spmd traces under its mesh, and JAX refuses a shard_map over another mesh there, naming
  both."""
  def f(x):
    return jax.shard_map(lambda b: b * 2, mesh=get_mesh("x8"), in_specs=P("x"),
                         out_specs=P("x"))(x)

  g = spmd.partition(f, mesh=get_mesh(MESH), in_specs=P("a"))
  with pytest.raises(ValueError, match=r"context mesh .*'a': 2, 'b': 4.* should match the mesh "
                                       r"passed to shard_map .*'x': 8"):
    g(randn(8, 8))


def test_uneven_in_specs_are_refused_by_jax():
  """JAX's shard_map refuses blocks that do not divide evenly when it is traced, naming them."""
  def f(x):
    return smap(lambda b: b * 2, P("a", "b"), P("a", "b"))(x)

  g = spmd.partition(f, mesh=get_mesh(MESH), in_specs=P("a"))
  with pytest.raises(ValueError, match=r"(?s)shard_map.*evenly divisible"):
    g(randn(8, 6))


def test_an_unrolled_scan_in_a_body_holds_a_psum_per_copy():
  """A scan of 3 steps unrolled 2 times in the body: 2 copies of its psum in a loop of one trip
  and a third copy after it, as the compiled program holds them (the plan listed one, 3 trips)."""
  def f(x):
    def body(b):
      return lax.scan(lambda c, _: (c + jnp.sin(lax.psum(c, "b")), None), b, None, length=3,
                      unroll=2)[0]
    return smap(body, P("a", "b"), P("a", "b"))(x)

  plan = assert_partitioned_matches(f, (randn(8, 16),), (P("a", "b"),), MESH, rtol=1e-4)
  psums = [c for c in plan.collectives if c.primitive == "shard_map" and c.before == "manual"]
  assert sorted(c.trips for c in psums) == [1, 1, 1], plan.explain()
  assert body_kinds(plan) == {"all-reduce": 3 * 4 * 4 * 4}


@pytest.mark.parametrize("with_value", [False, True])
def test_gradient_of_a_psum_loss_drops_the_unread_forward_psum(with_value):
  """``jax.grad`` of a loss a shard_map psums: the forward psum's result is not read (the
  gradient is the backward's), so it leaves the region with its collective, as XLA drops it
  (the plan listed it: plan != HLO, 132 / 128 B). ``jax.value_and_grad`` reads it: it stays."""
  mesh = get_mesh(MESH)

  def loss(w, x):
    return jax.shard_map(lambda a, b: lax.psum(jnp.sum(jnp.tanh(a @ b)), ("a", "b")), mesh=mesh,
                         in_specs=(P("a", "b"), P("b", None)), out_specs=P())(x, w)

  fn = jax.value_and_grad(loss) if with_value else jax.grad(loss)
  plan = assert_partitioned_matches(fn, (randn(16, 8, seed=1), randn(8, 16)),
                                    (P("b", None), P("a", "b")), MESH, rtol=1e-4, atol=1e-5)
  assert body_kinds(plan)["all-reduce"] == (4 if with_value else 0) + 128, plan.explain()
