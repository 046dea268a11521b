"""backend='spmd': the emitted program, its collectives, and its agreement with the plan."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import spmd
from spmd.hlo import collective_bytes, collectives


@pytest.fixture(scope="module")
def mesh():
  return spmd.make_mesh({"data": 2, "model": 4})


X = jnp.linspace(-1, 1, 8 * 16, dtype=jnp.float32).reshape(8, 16)


def _check(f, *args, ref=None):
  """Runs ``f``, compares with ``ref`` (default: the unpartitioned function), and checks that the
  plan's collective bytes equal those counted from the compiled HLO. Returns (plan, hlo text)."""
  out = f(*args)
  want = (ref or f.__wrapped__)(*args)
  for a, b in zip(jax.tree.leaves(out), jax.tree.leaves(want)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=2e-5, atol=2e-5)
  plan = f.plan(*args)
  hlo = f.lower(*args).compile().as_text()
  assert plan.total_bytes == collective_bytes(hlo), plan.explain()
  return plan, hlo


def _reshard(mesh, src, dst):
  @spmd.partition(mesh=mesh, in_specs=src)
  def f(x):
    return spmd.annotate(x * 2, dst) + 1
  return f


@pytest.mark.parametrize("src, dst, kind", [
    (P("data", None), P(None, None), "all-gather"),
    (P(("data", "model"), None), P(None, None), "all-gather"),
    (P("model", None), P(None, "model"), "all-to-all"),
    (P(("data", "model"), None), P("data", "model"), "all-to-all"),
    (P(("data", "model"), None), P(None, ("data", "model")), "all-to-all"),  # both at once
    (P(("data", "model"), None), P(("model", "data"), None), "collective-permute"),
])
def test_reshard_kinds_appear_in_hlo(mesh, src, dst, kind):
  f = _reshard(mesh, src, dst)
  plan, hlo = _check(f, X)
  assert [c.kind for c in plan.collectives] == [kind] * len(plan.collectives)
  assert {c.kind for c in collectives(hlo)} == {kind}


@pytest.mark.parametrize("axes, src, dst", [
    ({"data": 2, "model": 4}, P(("data", "model"), None), P("model", "data")),
    ({"data": 2, "model": 4}, P(("model", "data"), None), P("data", "model")),
    ({"a": 2, "b": 2, "c": 2}, P(("a", "b", "c"), None), P(("b", "c"), "a")),
    ({"a": 2, "b": 2, "c": 2}, P(("a", "b", "c"), None), P(("a", "c"), "b")),
    ({"a": 2, "b": 2, "c": 2}, P(("a", "b"), "c"), P("b", ("c", "a"))),
])
def test_a_major_axis_moving_to_another_dim_is_permute_then_all_to_all(axes, src, dst):
  """The axis is made minor by reordering whole blocks, then moved: no gather (as XLA)."""
  m = spmd.make_mesh(axes)
  f = _reshard(m, src, dst)
  plan, hlo = _check(f, X)
  assert [c.kind for c in plan.collectives] == ["collective-permute", "all-to-all"]
  assert sorted(c.kind for c in collectives(hlo)) == ["all-to-all", "collective-permute"]
  xla = jax.jit(lambda x: jax.lax.with_sharding_constraint(x * 2, NamedSharding(m, dst)) + 1,
                in_shardings=NamedSharding(m, src))
  assert plan.total_bytes <= collective_bytes(xla.lower(X).compile().as_text())


@pytest.mark.parametrize("rows", [13, 14])
def test_a_major_axis_moving_out_of_an_uneven_dim_is_permute_then_all_to_all(mesh, rows):
  """Blocks of 2 rows over (data, model) regroup exactly into blocks of 4 over model, so data is
  made minor by reordering whole (padded) blocks and moved, as XLA does."""
  src, dst = P(("data", "model"), None), P("model", "data")
  x = jnp.linspace(-1, 1, rows * 16, dtype=jnp.float32).reshape(rows, 16)
  f = spmd.partition(lambda x: (spmd.annotate(x * 2, dst) + 1).sum(0), mesh=mesh, in_specs=src)
  plan, hlo = _check(f, x)
  assert [c.kind for c in plan.collectives][:2] == ["collective-permute", "all-to-all"]
  assert "all-gather" not in {c.kind for c in collectives(hlo)}
  pin = lambda s: lambda x: jax.lax.with_sharding_constraint(x, NamedSharding(mesh, s))  # noqa
  xla = jax.jit(lambda x: (pin(dst)(pin(src)(x) * 2) + 1).sum(0))
  assert plan.total_bytes <= collective_bytes(xla.lower(x).compile().as_text())


def test_more_tiling_is_a_local_slice(mesh):
  f = _reshard(mesh, P(), P("data", "model"))
  plan, hlo = _check(f, X)
  assert plan.collectives == () and collectives(hlo) == []


def test_pending_partial_sums_fuse_into_one_all_reduce(mesh):
  @spmd.partition(mesh=mesh, in_specs=(P(None, "model"), P("model", None), P(None, "model"),
                                       P("model", None)))
  def f(a, w, b, v):
    return jnp.tanh(a @ w + b @ v)

  w = jnp.linspace(0, 1, 16 * 8).reshape(16, 8)
  plan, hlo = _check(f, X, w, X * 2, w - 1)
  assert [(c.kind, c.axes) for c in plan.collectives] == [("all-reduce", ("model",))]
  assert [c.kind for c in collectives(hlo)] == ["all-reduce"]


def test_partial_sum_into_a_sharded_consumer_is_a_reduce_scatter(mesh):
  @spmd.partition(mesh=mesh, in_specs=(P(None, "model"), P("model", None)))
  def f(a, w):
    return spmd.annotate(a @ w, P("model", None)) * 3

  w = jnp.linspace(0, 1, 16 * 8).reshape(16, 8)
  plan, hlo = _check(f, X, w)
  assert [c.kind for c in plan.collectives] == ["reduce-scatter"]
  kinds = {c.kind for c in collectives(hlo)}
  assert kinds in ({"reduce-scatter"}, {"all-reduce"})  # CPU XLA: all-reduce + dynamic-slice


def test_einsum_runs_on_its_operands_shards_when_resharding_its_result_is_cheaper(mesh):
  """GShard's dispatch: mask and tokens split by group, the result [experts, groups, capacity,
  d_model] pinned split by expert. Run in the result's layout, the mask is all-to-all'd and the
  tokens gathered over "model" (3x the bytes); run on the local groups, only the result moves."""
  groups = P(("data", "model"))

  @spmd.partition(mesh=mesh, in_specs=(groups, groups))
  def f(mask, x):
    return spmd.annotate(jnp.einsum("gsec,gsm->egcm", mask, x), P("model", "data"))

  mask = jnp.linspace(-1, 1, 8 * 4 * 8 * 2).reshape(8, 4, 8, 2)
  x = jnp.linspace(0, 1, 8 * 4 * 16).reshape(8, 4, 16)
  plan, _ = _check(f, mask, x)
  result = 8 * 8 * 2 * 16 * 4 // 8  # per device
  assert [(c.kind, c.axes, c.bytes) for c in plan.collectives] == [
      ("all-to-all", ("model",), result)]


@pytest.mark.parametrize("spec", [P("data", "model"), P(("model", "data"), None), P(None, "data")])
def test_random_numbers_are_bit_identical(mesh, spec):
  def f(key):
    bits = spmd.annotate(jax.random.bits(key, (16, 8)), spec)
    normal = spmd.annotate(jax.random.normal(key, (16, 8)), spec)
    coin = spmd.annotate(jax.random.bernoulli(jax.random.fold_in(key, 1), 0.3, (16, 8)), spec)
    return bits, normal, coin

  key = jax.random.key(42)
  out = spmd.partition(f, mesh=mesh)(key)
  for a, b in zip(out, f(key)):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b))
  assert out[0].sharding.spec == spec


def test_embedding_lookup_with_a_vocab_sharded_table(mesh):
  @spmd.partition(mesh=mesh, in_specs=(P("model", None), P("data", None)))
  def embed(table, ids):
    return table[ids]

  table = jnp.arange(32 * 8, dtype=jnp.float32).reshape(32, 8)
  ids = jnp.array([[0, 5, 31, 8], [17, 16, 3, 9]] * 2)
  plan, _ = _check(embed, table, ids)
  # each device gathers the rows it owns, one all-reduce over the vocab axis combines them
  assert [(c.kind, c.axes) for c in plan.collectives] == [("all-reduce", ("model",))]


def test_embedding_gradient_is_a_sharded_scatter_add(mesh):
  def loss(table, ids):
    return (jnp.tanh(table[ids]) ** 2).sum()

  grad = spmd.partition(jax.grad(loss), mesh=mesh, in_specs=(P("model", None), P("data", None)))
  table = jnp.linspace(-1, 1, 32 * 8, dtype=jnp.float32).reshape(32, 8)
  ids = jnp.array([[0, 5, 31, 8], [17, 16, 3, 9]] * 2)
  _check(grad, table, ids, ref=jax.grad(loss))


def test_2d_einsum_chain(mesh):
  @spmd.partition(mesh=mesh, in_specs=(P("data", None, None), P(None, "model"), P("model", None)))
  def chain(x, a, b):
    h = jnp.einsum("bsd,dh->bsh", x, a)
    h = jax.nn.relu(h)
    y = jnp.einsum("bsh,hd->bsd", h, b)
    return jnp.einsum("bsd,btd->bst", y, x)

  x = jnp.linspace(-1, 1, 4 * 8 * 16).reshape(4, 8, 16)
  a = jnp.linspace(-1, 1, 16 * 32).reshape(16, 32)
  b = jnp.linspace(1, -1, 32 * 16).reshape(32, 16)
  plan, _ = _check(chain, x, a, b)
  assert not [c for c in plan.collectives if c.kind == "all-gather"]


def test_grad_vjp_and_value_and_grad_of_a_partitioned_function(mesh):
  def mlp(x, w1, w2, n):
    return (jax.nn.gelu(x @ w1) @ w2).sum() * n

  f = spmd.partition(mlp, mesh=mesh, in_specs=(P("data", None), P(None, "model"),
                                               P("model", None), P()))
  w1 = jnp.linspace(0, 1, 16 * 32).reshape(16, 32)  # positive: the sum does not cancel to ~0
  w2 = jnp.linspace(0, 1, 32 * 4).reshape(32, 4)
  n = jnp.int32(3)
  got = jax.grad(f, argnums=(0, 1, 2))(X, w1, w2, n)
  want = jax.grad(mlp, argnums=(0, 1, 2))(X, w1, w2, n)
  for a, b in zip(got, want):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)
  _, vjp = jax.vjp(lambda *a: f(*a, n), X, w1, w2)
  assert [g.sharding.spec for g in vjp(jnp.float32(1))] == [P("data", None), P(None, "model"),
                                                          P("model", None)]
  value, g = jax.jit(jax.value_and_grad(f, argnums=1))(X, w1, w2, n)
  np.testing.assert_allclose(value, mlp(X, w1, w2, n), rtol=1e-5)
  np.testing.assert_allclose(g, want[1], rtol=1e-4, atol=1e-4)


def test_scan_carry_and_gradient(mesh):
  def rnn(w, xs):
    def body(h, x):
      h = jnp.tanh(h @ w + x)
      return h, h.mean()
    h, ys = jax.lax.scan(body, jnp.zeros((xs.shape[1],)), xs)
    return (h ** 2).sum() + ys.sum()

  w = jnp.linspace(-1, 1, 16 * 16).reshape(16, 16) / 4
  f = spmd.partition(rnn, mesh=mesh, in_specs=(P(None, "model"), P(None, "model")))
  _check(f, w, X)
  np.testing.assert_allclose(jax.grad(f)(w, X), jax.grad(rnn)(w, X), rtol=1e-4, atol=1e-5)


def test_while_with_sharded_carry_and_cond_inside(mesh):
  def f(x):
    def body(c):
      i, v = c
      v = jax.lax.cond(i % 2 == 0, lambda a: a * 2, lambda a: jnp.sin(a), v)
      return i + 1, v
    return jax.lax.while_loop(lambda c: c[0] < 5, body, (0, x))[1]

  _check(spmd.partition(f, mesh=mesh, in_specs=P("data", "model")), X)


@pytest.mark.parametrize("backend", ["spmd", "xla"])
def test_backends_agree(mesh, backend):
  def f(x, w):
    return jax.nn.softmax(x @ w, axis=-1).sum(0)

  w = jnp.linspace(-1, 1, 16 * 8).reshape(16, 8)
  g = spmd.partition(f, mesh=mesh, in_specs=(P("data", None), P(None, "model")), backend=backend)
  np.testing.assert_allclose(g(X, w), f(X, w), rtol=1e-5, atol=1e-6)


def test_partitioned_function_inside_jit(mesh):
  g = spmd.partition(lambda x: jnp.cos(x) @ x.T, mesh=mesh, in_specs=P("data", "model"))
  np.testing.assert_allclose(jax.jit(lambda x: g(x) + 1)(X), jnp.cos(X) @ X.T + 1, rtol=1e-5,
                             atol=1e-5)
