"""JAX's own sharding tests, round 2 (themes of tests/pjit_test.py, shard_map_test.py, array_test.py
and the explicit-sharding tests), written as a user of ``spmd.partition`` writes them and compared
with ``jax.jit`` given the same shardings: values, the outputs' shardings as jax.jit returns them,
and the plan against the compiled HLO (tests/helpers.py). Cases already in test_jax_cases.py,
test_jit_parity.py and test_nested_shard_map.py are not repeated."""
from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import spmd
from helpers import (Cases, assert_like_jit, assert_partitioned_matches, assert_trees_match,
                     check_committed, check_jit, get_mesh, named, randn)

CASES = Cases()

case = CASES.register


def explicit_mesh() -> jax.sharding.Mesh:
  """JAX's default mesh today: jax.make_mesh's axes are Explicit."""
  return jax.make_mesh((2, 4), ("x", "y"), axis_types=(AxisType.Explicit,) * 2)


X, W = randn(8, 16), randn(16, 8, seed=1)


# --- explicit sharding mode -----------------------------------------------------------------------

def check_explicit(fn: Callable, args: tuple, specs: tuple) -> spmd.Plan:
  return check_committed(fn, args, specs, explicit_mesh())


@case
def explicit_elementwise_reduce_transpose_reshape():
  def f(x):
    return x * 2, x.sum(0), x.sum(1), x.T, x.reshape(4, 2, 16), jnp.zeros_like(x) + 1
  check_explicit(f, (X,), (P("x", None),))


@case
def explicit_ops_keep_their_types():
  """Explicit-mode ops of JAX's ShardingInTypes tests: each output has the sharding its type
  gives (concatenate, max, broadcast, cond, scan, where, a scatter, a dot with out_sharding)."""
  def f(x, w):
    y = jnp.concatenate([x, x * 2], axis=1)
    m = jnp.max(x, axis=1)
    b = jnp.broadcast_to(m[:, None], (8, 4))
    c = lax.cond(m.sum() > 0, lambda v: v * 2, lambda v: -v, x)
    s = lax.scan(lambda carry, col: (carry + col, carry.sum()), jnp.zeros(8, out_sharding=P("x")),
                 x.T)
    d = jnp.dot(x, w, out_sharding=P("x", None))
    row0 = x.at[0].set(1.0, out_sharding=P("x", None))
    return y, m, b, c, s, jnp.where(x > 0, x, 0.0), row0, d
  check_explicit(f, (X, W), (P("x", None), P()))


@case
def explicit_reshard_inside():
  check_explicit(lambda x: jax.sharding.reshard(x * 2, P(None, "y")) + 1, (X,), (P("x", None),))


@case
def explicit_reshard_to_replicated():
  check_explicit(lambda x: jax.sharding.reshard(x * 2, P()).sum(0), (X,), (P("x", "y"),))


@case
def explicit_einsum_out_sharding():
  check_explicit(lambda x, w: jnp.einsum("ij,jk->ik", x, w, out_sharding=P("x", None)), (X, W),
                 (P("x", "y"), P("y", None)))


@case
def explicit_zeros_out_sharding():
  check_explicit(lambda x: x + jnp.zeros((8, 16), out_sharding=P("x", "y")), (X,),
                 (P("x", None),))


@case
def explicit_random_out_sharding():
  check_explicit(lambda k: jax.random.uniform(k, (8, 16), out_sharding=P("x", "y")),
                 (jax.random.key(0),), (P(),))


@case
def explicit_auto_axes():
  def f(x, w):
    return jax.sharding.auto_axes(lambda a, b: jnp.tanh(a @ b), out_sharding=P("x", None))(x, w)
  check_explicit(f, (X, W), (P("x", "y"), P("y", None)))


@case
def explicit_contraction_jax_refuses_spmd_runs():
  """Contracting dims sharded alike: JAX's typing refuses (ambiguous output sharding, asks for
  out_sharding=); spmd partitions it and returns its propagated sharding."""
  mesh = explicit_mesh()
  x = jax.device_put(X, NamedSharding(mesh, P("x", "y")))
  w = jax.device_put(W, NamedSharding(mesh, P("y", None)))
  with jax.set_mesh(mesh), pytest.raises(Exception, match="out_sharding"):
    jax.jit(lambda x, w: x @ w)(x, w)
  plan = assert_partitioned_matches(lambda x, w: x @ w, (x, w), None, mesh,
                                    reference=lambda *_: X @ W)
  assert plan.out_specs == P("x", None)


@case
def explicit_refusal_is_jax_jits_error():
  """JAX's typing refuses a scatter along a sharded dim, and spmd's untyped trace fails too (the
  einsum's out_sharding= types its result, the cache untyped): the error is jax.jit's, not the
  untyped trace's dynamic_update_slice mismatch (examples/gemma's sampler, forbidden tokens
  masked in vocab-sharded logits)."""
  mesh = explicit_mesh()

  def f(x, w, cache):
    y = jnp.einsum("ij,jk->ik", x, w, out_sharding=P("x", "y"))
    return lax.dynamic_update_slice(cache, y, (0, 0)).at[:, jnp.array([1, 3])].set(0.0)

  args = tuple(jax.device_put(a, NamedSharding(mesh, s))
               for a, s in ((W, P("x")), (X, P()), (randn(16, 16), P("x", "y"))))
  with jax.set_mesh(mesh):
    for g in (jax.jit(f), spmd.partition(f, mesh=mesh)):
      with pytest.raises(Exception,
                         match=r"\.at\[\.\.\.\]\.set.*out_sharding"):
        g(*args)


@case
def explicit_under_set_mesh():
  """Called inside ``with jax.set_mesh(mesh)`` (explicit-mode code runs there): the program over
  the mesh's Auto twin ran into JAX's check that a shard_map's mesh is the context mesh (and
  with backend="xla", its constraints into explicit mode's assert); grad too."""
  mesh = explicit_mesh()
  fn = lambda x, w: jnp.tanh(jnp.einsum("ij,jk->ik", x, w, out_sharding=P(None, "y")))  # noqa
  args = tuple(jax.device_put(a, NamedSharding(mesh, s)) for a, s in ((X, P("x")), (W, P())))
  with jax.set_mesh(mesh):
    want = jax.jit(fn)(*args)
    want_grad = jax.jit(jax.grad(lambda x, w: fn(x, w).sum()))(*args)
    for backend in ("spmd", "xla"):
      f = spmd.partition(fn, mesh=mesh, backend=backend)
      got = f(*args)
      assert_trees_match(got, want, rtol=1e-5, atol=1e-5)
      assert_like_jit(got, want)
      grad = jax.grad(lambda x, w: f(x, w).sum())(*args)
      assert_trees_match(grad, want_grad, rtol=1e-5, atol=1e-5)
  assert_partitioned_matches(fn, args, None, mesh, reference=lambda *_: want)


@case
def explicit_axes_inside():
  """explicit_axes needs the concrete mesh in context (jax.set_mesh), under jax.jit as here."""
  mesh = get_mesh("a2b4")
  def f(x):
    return jax.sharding.explicit_axes(lambda a: a * 2, axes=("a",), in_sharding=P("a", None))(x)
  with jax.set_mesh(mesh):
    check_jit(f, (X,), P(None, "b"), mesh, P("a", None))


@case
def explicit_typeof_sharding_inside():
  """jax.typeof inside reads the argument's type, as under jax.jit: spmd traced on avals without
  shardings, so this computed x * 3."""
  def f(x):
    return x * 2 if jax.typeof(x).sharding.spec[0] == "x" else x * 3
  check_explicit(f, (X,), (P("x", None),))


# --- pjit themes ----------------------------------------------------------------------------------

@case
def nested_jit_with_shardings():
  mesh = get_mesh("a2b4")
  inner = jax.jit(lambda y: jnp.sin(y) * 2, in_shardings=NamedSharding(mesh, P("a")),
                  out_shardings=NamedSharding(mesh, P(None, "b")))
  check_jit(lambda x: inner(x) + 1, (X,), P(None, "b"), mesh)


@case
def static_and_donate_argnames():
  """static_argnames / donate_argnames as jax.jit takes them (spmd.partition had neither), by
  position or by keyword (which jax.jit with in_shardings refuses); an unknown name is
  refused."""
  mesh = get_mesh("a2b4")

  def fn(x, w, act, scale):
    return getattr(jnp, act)(x @ w) * scale, x + 1

  specs = (P("a"), P(None, "b"))
  options = dict(static_argnames=("act", "scale"), donate_argnames="x")
  reference = jax.jit(fn, in_shardings=named(mesh, specs), **options)
  f = spmd.partition(fn, mesh=mesh, in_specs=specs, **options)
  placed = lambda: jax.device_put(X, NamedSharding(mesh, P("a")))  # noqa: E731
  for act, scale in (("tanh", 2.0), ("sin", 0.5)):  # jax.jit with in_shardings takes no kwargs
    mine, theirs = placed(), placed()
    got = f(mine, W, act, scale) if act == "tanh" else f(mine, W, act=act, scale=scale)
    want = reference(theirs, W, act, scale)
    assert_trees_match(got, want, rtol=1e-5, atol=1e-5)
    assert_like_jit(got, want)
    assert mine.is_deleted() and theirs.is_deleted()
  with pytest.raises(ValueError, match=r"static_argnames \['activation'\] are not parameters"):
    spmd.partition(fn, mesh=mesh, static_argnames="activation")


@case
def sub_mesh_axis_sets_and_short_specs():
  """A 3-D mesh: specs shorter than the rank, tuple axes over two of three mesh axes, and
  with_sharding_constraint on a pytree naming other axis sets."""
  mesh = get_mesh("a2b2c2")
  def f(x, y):
    t = lax.with_sharding_constraint(
        {"x": jnp.sin(x), "y": y * 2},
        {"x": NamedSharding(mesh, P(("a", "c"))), "y": NamedSharding(mesh, P(None, "b"))})
    return jnp.einsum("ijk,kl->ijl", t["x"], t["y"]), t["y"].sum(0)
  check_jit(f, (randn(8, 4, 6), randn(6, 4, seed=1)), (P(("b", "c")), P("a")), mesh,
            (P(("b", "c")), P()))


@case
def high_rank():
  check_jit(lambda x: jnp.tanh(x).sum((1, 3)), (randn(2, 3, 4, 2, 4, 2),),
            P("a", None, None, None, "b"), "a2b4")


@case
def float8_and_int4():
  def f(x):
    e4 = x.astype(jnp.float8_e4m3fn)
    i4 = jnp.clip(jnp.round(x), -8, 7).astype(jnp.int4)
    return e4.astype(jnp.float32) * 2, (i4 + i4).astype(jnp.int32)
  check_jit(f, (X,), P("a", "b"), "a2b4")


@case
def shard_alike():
  # jax.experimental.shard_alike is gone from JAX 0.12 (CI's newest JAX)
  alike = pytest.importorskip("jax.experimental.shard_alike").shard_alike
  def f(x, y):
    a, b = alike(x * 2, y + 1)
    return a + 1, b * 3
  check_jit(f, (X, X * 2), (P("a", "b"), None), "a2b4")


@case
def custom_vmap_inside():
  @jax.custom_batching.custom_vmap
  def f(x):
    return jnp.sin(x)

  @f.def_vmap
  def rule(axis_size, in_batched, x):
    return jnp.sin(x), in_batched[0]

  check_jit(lambda x: jax.vmap(f)(x) * 2, (X,), P("a", "b"), "a2b4")


@case
def named_call_and_scope():
  def f(x, w):
    with jax.named_scope("layer"):
      h = jax.named_call(lambda a, b: jnp.tanh(a @ b), name="dense")(x, w)
    return h.sum(1)
  check_jit(f, (X, W), (P("a", "b"), P("b")), "a2b4")


@case
def checkpoint_save_only_these_names():
  from jax.ad_checkpoint import checkpoint_name

  def f(x, w):
    def block(x):
      h = checkpoint_name(jnp.tanh(x @ w), "h")
      return jnp.sin(h) @ w.T
    g = jax.checkpoint(block, policy=jax.checkpoint_policies.save_only_these_names("h"))
    return jax.grad(lambda x: g(x).sum())(x)
  check_jit(f, (X, W), (P("a"), P(None, "b")), "a2b4")


@case
def checkpoint_dots_no_batch():
  def f(x, w):
    g = jax.checkpoint(lambda x: jnp.tanh(x @ w) @ w.T,
                       policy=jax.checkpoint_policies.dots_with_no_batch_dims_saveable)
    return jax.value_and_grad(lambda x: g(x).sum())(x)
  check_jit(f, (X, W), (P("a", "b"), P("b")), "a2b4")


@case
def cond_on_sharded_predicate():
  def f(x):
    return lax.cond(x[3, 5] > 0, lambda v: v @ v.T, lambda v: -v @ v.T, x)
  check_jit(f, (X,), P("a", "b"), "a2b4")


@case
def lax_map_batch_size():
  check_jit(lambda x: lax.map(lambda r: jnp.tanh(r) * r.sum(), x, batch_size=4), (X,),
            P("a", "b"), "a2b4")


@case
def associative_scan_custom_op():
  def op(a, b):
    return (a[0] * b[0], a[1] * b[0] + b[1])
  check_jit(lambda g, x: lax.associative_scan(op, (g, x), axis=1), (X * 0.5, X),
            (P("a", "b"), P("a", "b")), "a2b4")


@case
def zero_size_dims_with_specs():
  check_jit(lambda x, y: (x.sum(1), y * 2), (randn(8, 0), randn(0, 16)), (P("a"), P(None, "b")),
            "a2b4", (P("a"), P(None, "b")))


@case
def debug_callbacks_run_once_per_call():
  """jax.debug.print / jax.debug.callback see whole values and run once per call (per trip in a
  scan), as under jax.jit: spmd's program ran them on every device (8 prints)."""
  def run(partitioned: Callable) -> list:
    calls: list = []

    def fn(x):
      jax.debug.callback(lambda s: calls.append(("sum", float(s))), x.sum())
      def step(c, row):
        jax.debug.callback(lambda r: calls.append(("row", r.shape)), row)
        return c + row, None
      jax.debug.print("x[0, 0] = {}", x[0, 0])
      return lax.scan(step, jnp.zeros(16), x)[0]

    out = partitioned(fn)(X)
    jax.effects_barrier()
    return out, sorted(calls, key=str)

  mesh = get_mesh("a2b4")
  got, got_calls = run(lambda fn: spmd.partition(fn, mesh=mesh, in_specs=P("a", "b")))
  want, want_calls = run(lambda fn: jax.jit(fn, in_shardings=NamedSharding(mesh, P("a", "b"))))
  assert_trees_match(got, want, rtol=1e-5, atol=1e-5)
  assert [c[0] for c in got_calls] == [c[0] for c in want_calls] == ["row"] * 8 + ["sum"]
  assert got_calls[:8] == want_calls[:8] and abs(got_calls[8][1] - want_calls[8][1]) < 1e-4
  calls_fn = lambda x: (jax.debug.print("{}", x.sum()), x * 2)[1]  # noqa: E731
  assert_partitioned_matches(calls_fn, (X,), P("a", "b"), mesh, replicated=("debug_print",))


@case
def compiled_formats_and_shardings_equal_jit():
  """layout_test's view of a compiled program: input / output formats (layout and sharding) and
  shardings as jax.jit's compiled object gives them (spmd spelled the inputs with trailing
  Nones, P('b', None) for the P('b') it was given). A Format as a spec is refused clearly."""
  mesh = get_mesh("a2b4")
  fn = lambda x, w: (jnp.tanh(x @ w), x.T)  # noqa: E731
  specs = (P("a", "b"), P("b"))
  mine = spmd.partition(fn, mesh=mesh, in_specs=specs).lower(X, W).compile()
  theirs = jax.jit(fn, in_shardings=named(mesh, specs)).lower(X, W).compile()
  for attr in ("input_formats", "output_formats", "input_shardings", "output_shardings"):
    assert getattr(mine, attr) == getattr(theirs, attr), attr
  with pytest.raises(TypeError, match="in_specs leaves must be PartitionSpec, NamedSharding or"):
    spmd.partition(fn, mesh=mesh, in_specs=(theirs.input_formats[0][0], P("b")))(X, W)


# --- shard_map themes -----------------------------------------------------------------------------

def smap(body: Callable, in_specs: Any, out_specs: Any, **kwargs: Any) -> Callable:
  return jax.shard_map(body, mesh=get_mesh("a2b4"), in_specs=in_specs, out_specs=out_specs,
                       **kwargs)


@case
def shard_map_pmean_all_gather_untiled():
  def body(b):
    m = lax.pmean(b, "a")
    return lax.all_gather(m, "b", axis=0).sum(0)  # stacked, then summed: equal over "b"
  f = lambda x: smap(body, P("a", "b"), P(), check_vma=False)(jnp.tanh(x)) * 2  # noqa: E731
  check_jit(f, (X,), P("a"), "a2b4")


@case
def shard_map_axis_index_two_axes():
  def body(b):
    i = lax.axis_index(("a", "b"))
    return b + i.astype(b.dtype)
  check_jit(lambda x: smap(body, P(("a", "b")), P(("a", "b")))(x) @ W, (X,), P(), "a2b4")


@case
def shard_map_psum_scatter_all_to_all_untiled():
  def body(b):  # b: f32[4, 16], split in 4 along "b" and summed over it, then exchanged
    s = lax.psum_scatter(b.reshape(4, 4, 4).transpose(1, 0, 2), "b", scatter_dimension=0)
    return lax.all_to_all(s, "b", 0, 1)
  check_jit(lambda x: smap(body, P("a"), P("a", "b"))(x), (randn(8, 16),), P("a", "b"), "a2b4")


@case
def shard_map_unchecked_unmapped_out():
  def body(b):
    return lax.psum(b.sum(0), "a")
  f = lambda x: smap(body, P("a", "b"), P("b"), check_vma=False)(x) + 1  # noqa: E731
  check_jit(f, (X,), P("a", "b"), "a2b4")


@case
def shard_map_under_grad_and_scan():
  def body(c, w):
    return lax.psum(jnp.tanh(c) @ w, "b")

  def loss(x, w):
    def step(c, _):
      return smap(body, (P("a", "b"), P("b")), P("a"))(c, w)[:, :16] * 0.5 + c, None
    return (lax.scan(step, x, None, length=2)[0] ** 2).sum()
  check_jit(jax.grad(loss, argnums=(0, 1)), (X, randn(16, 16, seed=2) * 0.3),
            (P("a", "b"), P("b")), "a2b4")


# --- array_test themes: where the arguments come from --------------------------------------------

def array_sources(mesh: jax.sharding.Mesh) -> dict[str, Any]:
  """X as JAX's array tests build it: from a callback, from single-device arrays, committed to
  one device (device 3), as numpy, and on a mesh of the same devices in the reverse order."""
  sharding = NamedSharding(mesh, P("a", "b"))
  pieces = [jax.device_put(X[index], d)
            for d, index in sharding.addressable_devices_indices_map(X.shape).items()]
  reverse = jax.sharding.Mesh(np.asarray(mesh.devices).flat[::-1].reshape(mesh.devices.shape),
                              mesh.axis_names)
  return {"callback": jax.make_array_from_callback(X.shape, sharding, lambda index: X[index]),
          "single_device_arrays": jax.make_array_from_single_device_arrays(X.shape, sharding,
                                                                           pieces),
          "device_3": jax.device_put(X, jax.devices()[3]), "numpy": X,
          "reversed_mesh": jax.device_put(X, NamedSharding(reverse, P("a", "b")))}


@case
def arguments_from_every_source():
  """Every source with the spec it has and with another: the values and output shardings of
  jax.jit given the value as numpy. An array committed off the mesh (device 3, the reversed
  mesh), which jax.jit refuses where its sharding differs, is copied onto the mesh as numpy is
  (it crashed in JAX's argument check)."""
  mesh = get_mesh("a2b4")
  fn = lambda x, w: jnp.tanh(x @ w)  # noqa: E731
  for specs in ((P("a", "b"), P("b")), (P(None, "a"), P())):
    want = jax.jit(fn, in_shardings=named(mesh, specs))(X, W)
    f = spmd.partition(fn, mesh=mesh, in_specs=specs)
    for name, x in array_sources(mesh).items():
      for _ in range(2):  # the first call and the cached one
        got = f(x, W)
        assert_trees_match(got, want, rtol=1e-5, atol=1e-5)
        assert_like_jit(got, want)
      assert_partitioned_matches(fn, (x, W), specs, mesh, reference=lambda *_: want, rtol=1e-5,
                                 atol=1e-5)


@pytest.mark.parametrize("run", CASES, ids=[c.__name__ for c in CASES])
def test_case(run: Callable[[], None]) -> None:
  run()
