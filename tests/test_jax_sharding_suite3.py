"""JAX's own sharding tests, round 3 (themes of tests/pjit_test.py and shard_map_test.py): JAX's
transformations of a partitioned function (vmap, grad, vjp, jit, scan, checkpoint), pjit's
argument, output and constraint forms, and shard_map bodies' collectives, written as a user of
``spmd.partition`` writes them. Each is compared with ``jax.jit`` given the same shardings (values
and output shardings) and, where a partitioned program is built, its plan with the compiled HLO
(tests/helpers.py). Cases of test_jax_cases.py, test_jit_parity.py, test_jax_sharding_suite.py
and test_nested_shard_map.py are not repeated."""
from __future__ import annotations

import functools
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

import spmd
from helpers import Cases, both, check_jit, check_plan, get_mesh, named, randn, same

CASES = Cases()  # functions of no arguments, or pytest.params of one
MESH = "a2b4"
X, W = randn(8, 16), randn(16, 8, seed=1)

case = CASES.register


def mlp(x, w):
  return jnp.tanh(x @ w), (x * x).sum(1)


# --- transformations of a partitioned function ----------------------------------------------------

@case
def vmap_over_a_sharded_arguments_other_dim():
  """vmap with in_axes on a dim the spec leaves unsharded: the batch dim is unsharded in the
  outputs, as jax.jit's batching rule inserts None for it."""
  ours, theirs = both(mlp, (P(None, "a"), P(None, "b")))
  xs = randn(3, 8, 16, seed=2)
  same(jax.vmap(ours, in_axes=(0, None))(xs, W), jax.vmap(theirs, in_axes=(0, None))(xs, W))


@case
def vmap_in_axes_one_and_out_axes():
  ours, theirs = both(mlp, (P("a"), P(None, "b")))
  xs = randn(8, 3, 16, seed=2)
  batched = lambda f: jax.vmap(f, in_axes=(1, None), out_axes=(2, 0))  # noqa: E731
  same(batched(ours)(xs, W), batched(theirs)(xs, W))


@case
def vmap_spmd_axis_name():
  """spmd_axis_name: the batch dim is sharded over that mesh axis, as in jax.jit's batching."""
  ours, theirs = both(mlp, (P(None, "b"), P("b")))
  xs = randn(2, 8, 16, seed=2)
  ws = randn(2, 16, 8, seed=3)
  same(jax.vmap(ours, spmd_axis_name="a")(xs, ws), jax.vmap(theirs, spmd_axis_name="a")(xs, ws))


@case
def vmap_of_vmap():
  ours, theirs = both(lambda x, w: jnp.sin(x) @ w, (P("a", "b"), P("b")))
  xs = randn(2, 3, 8, 16, seed=2)
  nested = lambda f: jax.vmap(jax.vmap(f, (0, None)), (0, None))  # noqa: E731
  same(nested(ours)(xs, W), nested(theirs)(xs, W))


@case
def vmap_of_a_function_with_a_constraint_inside():
  def fn(x, w):
    h = lax.with_sharding_constraint(x @ w, NamedSharding(get_mesh(MESH), P("a", "b")))
    return jnp.tanh(h).sum(0)
  ours, theirs = both(fn, (P("a"), P()))
  xs = randn(2, 8, 16, seed=2)
  same(jax.vmap(ours, (0, None))(xs, W), jax.vmap(theirs, (0, None))(xs, W))


@case
def grad_has_aux_several_argnums():
  def loss(x, w, b):
    h = jnp.tanh(x @ w + b)
    return (h ** 2).mean(), {"h": h, "n": h.sum(0)}
  specs = (P("a", "b"), P("b"), P())
  ours, theirs = both(loss, specs, (P(), {"h": P("a"), "n": P()}))
  b = randn(8, seed=4)
  for argnums in (0, (0, 2), (1, 2)):
    same(jax.grad(ours, argnums, has_aux=True)(X, W, b),
         jax.grad(theirs, argnums, has_aux=True)(X, W, b), shardings=False)
  same(jax.value_and_grad(ours, (0, 1, 2), has_aux=True)(X, W, b),
       jax.value_and_grad(theirs, (0, 1, 2), has_aux=True)(X, W, b), shardings=False)


@case
def grad_shardings_are_jits():
  """The cotangents of a partitioned function's inputs are sharded as jax.jit's gradient gives
  them (its in_shardings)."""
  loss = lambda x, w: jnp.mean(jnp.tanh(x @ w) ** 2)  # noqa: E731
  ours, theirs = both(loss, (P("a", "b"), P("b")), P())
  same(jax.grad(ours, (0, 1))(X, W), jax.grad(theirs, (0, 1))(X, W))


@case
def vjp_with_several_outputs():
  ours, theirs = both(mlp, (P("a"), P(None, "b")), (P("a", "b"), P("a")))
  cts = (randn(8, 8, seed=5), randn(8, seed=6))
  (y1, pull1), (y2, pull2) = jax.vjp(ours, X, W), jax.vjp(theirs, X, W)
  same(y1, y2)
  same(pull1(cts), pull2(cts), shardings=False)


@case
def vjp_has_aux_and_integer_argument():
  """An int argument gets a float0 cotangent, as under jax.jit."""
  def fn(x, k):
    return jnp.roll(x, 1, 0) * k, k + 1
  ours, theirs = both(fn, (P("a", "b"), P()))
  k = jnp.int32(3)
  (y1, pull1, aux1) = jax.vjp(ours, X, k, has_aux=True)
  (y2, pull2, aux2) = jax.vjp(theirs, X, k, has_aux=True)
  same((y1, aux1), (y2, aux2))
  g1, g2 = pull1(X), pull2(X)
  same(g1[0], g2[0], shardings=False)
  assert g1[1].dtype == g2[1].dtype == jax.dtypes.float0


@case
def called_inside_jit_with_shardings():
  ours, theirs = both(mlp, (P("a"), P(None, "b")), (P("a", "b"), P()))
  mesh = get_mesh(MESH)
  outer = lambda f: jax.jit(lambda x, w: jax.tree.map(lambda v: v * 2, f(x + 1, w)),  # noqa
                            in_shardings=named(mesh, (P(None, "b"), P())))
  same(outer(ours)(X, W), outer(theirs)(X, W))


@case
def called_in_scan_and_fori_bodies():
  step = lambda c, w: jnp.tanh(c @ w) @ w.T * 0.5 + c  # noqa: E731
  ours, theirs = both(step, (P("a"), P(None, "b")), P("a"))

  def loops(f):
    s = lax.scan(lambda c, _: (f(c, W), c.sum()), X, None, length=3)
    return s, lax.fori_loop(0, 2, lambda i, c: f(c, W), X)
  same(jax.jit(loops, static_argnums=0)(ours), jax.jit(loops, static_argnums=0)(theirs))


@case
def grad_through_checkpoint_of_a_partitioned_function():
  step = lambda c, w: jnp.sin(c @ w) @ w.T  # noqa: E731
  ours, theirs = both(step, (P("a", "b"), P("b")))

  def loss(f, x, w):
    return (jax.checkpoint(f)(jax.checkpoint(f)(x, w), w) ** 2).mean()
  w = W * 0.25
  same(jax.grad(loss, (1, 2))(ours, X, w), jax.grad(loss, (1, 2))(theirs, X, w), shardings=False)


@case
def shapes_dtypes_and_committed_shardings_recompile_or_hit_the_cache():
  """Another shape or dtype traces again; the same avals with an argument committed to another
  sharding are resharded without a new trace (spmd) where jax.jit refuses them."""
  traces = []

  def fn(x):
    traces.append((x.shape, x.dtype))
    return jnp.sin(x) * 2 + x.sum(0)

  mesh = get_mesh(MESH)
  ours, theirs = both(fn, P("a", "b"))
  calls = [X, X[:4], X.astype(jnp.bfloat16), X, jax.device_put(X, NamedSharding(mesh, P("b"))),
           jax.device_put(X, NamedSharding(mesh, P("b")))]
  wants = [theirs(np.asarray(x) if x.dtype == np.float32 else x) for x in calls]
  traces.clear()
  for x, want in zip(calls, wants):
    same(ours(x), want)
  assert traces == [((8, 16), jnp.float32), ((4, 16), jnp.float32), ((8, 16), jnp.bfloat16)]


@case
def keyword_arguments_with_pytrees():
  def fn(params, x):
    return jnp.tanh(x @ params["w"]) + params["b"]
  specs = ({"w": P(None, "b"), "b": P("b")}, P("a"))
  ours, theirs = both(fn, specs)
  params = {"w": W, "b": randn(8, seed=3)}
  same(ours(params=params, x=X), theirs(params, X))
  same(ours(x=X, params=params), theirs(params, X))
  check_plan(ours, params, x=X)


@case
def vmap_of_a_committed_batch_sharded_argument():
  """The batched argument arrives committed with its batch dim split over "a", which the
  batched in_spec (None there) does not: jax.jit refuses it; spmd reshards it on entry and
  returns jax.jit's values and output shardings for the argument placed as the spec says."""
  mesh = get_mesh(MESH)
  ours, theirs = both(mlp, (P(None, "b"), P()))
  xs = randn(2, 8, 16, seed=2)
  committed = jax.device_put(xs, NamedSharding(mesh, P("a")))
  with pytest.raises(ValueError):
    jax.vmap(theirs, (0, None))(committed, W)
  same(jax.vmap(ours, (0, None))(committed, W), jax.vmap(theirs, (0, None))(xs, W))


@case
def vmap_spmd_axis_name_with_a_constraint_inside():
  def fn(x):
    h = lax.with_sharding_constraint(jnp.sin(x), NamedSharding(get_mesh(MESH), P(None, "b")))
    return h * h.sum()
  ours, theirs = both(fn, P(None, "b"))
  xs = randn(2, 8, 16, seed=2)
  same(jax.vmap(ours, spmd_axis_name="a")(xs), jax.vmap(theirs, spmd_axis_name="a")(xs))


@case
def grad_of_grad():
  """Reverse over reverse: the backward pass is itself a partitioned function with a
  partitioned VJP."""
  f = lambda x, w: jnp.sum(jnp.sin(x @ w) ** 2)  # noqa: E731
  ours, theirs = both(f, (P("a", "b"), P("b")))
  second = lambda g: jax.grad(lambda w: jax.grad(g, 0)(X, w).sum())  # noqa: E731
  same(second(ours)(W), second(theirs)(W), shardings=False)


@case
def jacrev_has_aux_and_make_jaxpr():
  f = lambda x, w: (jnp.tanh(x @ w).sum(0), x.max())  # noqa: E731
  ours, theirs = both(f, (P("a", "b"), P("b")))
  same(jax.jacrev(ours, 1, has_aux=True)(X, W), jax.jacrev(theirs, 1, has_aux=True)(X, W),
       shardings=False)
  avals = jax.make_jaxpr(ours)(X, W).out_avals
  assert [(a.shape, a.dtype) for a in avals] == [((8,), jnp.float32), ((), jnp.float32)]


@case
def grad_through_scan_of_checkpointed_partitioned_steps():
  step = lambda c, w: jnp.tanh(c @ w) @ w.T * 0.5 + c  # noqa: E731
  ours, theirs = both(step, (P("a"), P(None, "b")), P("a"))

  def loss(f, w):
    body = jax.checkpoint(lambda c, _: (f(c, w), None))
    return (lax.scan(body, X, None, length=3)[0] ** 2).mean()
  w = W * 0.3
  same(jax.grad(loss, 1)(ours, w), jax.grad(loss, 1)(theirs, w), shardings=False)


@case
def none_leaves_and_empty_containers_in_outputs():
  def fn(x, extra):
    return {"y": x * 2, "none": None, "empty": ()}, [x.sum(), extra]
  check_jit(fn, (X, randn(4, seed=2)), (P("a", "b"), P()), MESH,
            ({"y": P("b"), "none": None, "empty": ()}, [P(), P()]))


@case
def vmap_with_unbatched_outputs_and_out_specs():
  def fn(x, w):
    return x @ w, w * 2
  ours, theirs = both(fn, (P("a", "b"), P("b")), (P("a"), P(None, "b")))
  xs = randn(3, 8, 16, seed=2)
  batched = lambda f: jax.vmap(f, (0, None), (1, None))  # noqa: E731
  same(batched(ours)(xs, W), batched(theirs)(xs, W))


@case
def per_example_grads_by_vmap_of_grad():
  loss = lambda w, x: jnp.tanh(x @ w).sum()  # noqa: E731
  ours, theirs = both(loss, (P(None, "b"), P("b")), P())
  per_example = lambda f: jax.vmap(jax.grad(f), (None, 0))  # noqa: E731
  same(per_example(ours)(W, X), per_example(theirs)(W, X), shardings=False)


@case
def called_in_cond_branches_and_under_jit_with_donation():
  ours, theirs = both(lambda x, w: jnp.tanh(x @ w) @ w.T, (P("a"), P(None, "b")), P("a"))

  def outer(f):
    g = lambda x: lax.cond(x.sum() > 0, lambda v: f(v, W), lambda v: -f(-v, W), x)  # noqa
    return jax.jit(g, donate_argnums=0)
  same(outer(ours)(jnp.asarray(X)), outer(theirs)(jnp.asarray(X)))


@case
def lower_with_abstract_arguments_carrying_shardings():
  """AOT with ShapeDtypeStructs: the compiled program takes arrays of those avals."""
  mesh = get_mesh(MESH)
  ours, theirs = both(mlp, (P("a"), P(None, "b")), (P("a", "b"), P("a")))
  abstract = (jax.ShapeDtypeStruct(X.shape, X.dtype, sharding=NamedSharding(mesh, P("a"))),
              jax.ShapeDtypeStruct(W.shape, W.dtype))
  mine, jits = ours.lower(*abstract).compile(), theirs.lower(*abstract).compile()
  same(mine(X, W), jits(X, W))
  assert mine.input_shardings == jits.input_shardings


@case
def vmap_spmd_axis_name_over_both_axes():
  ours, theirs = both(lambda x, w: jnp.tanh(x @ w), (P(), P()))
  xs = randn(8, 4, 16, seed=2)
  same(jax.vmap(ours, (0, None), spmd_axis_name=("a", "b"))(xs, W),
       jax.vmap(theirs, (0, None), spmd_axis_name=("a", "b"))(xs, W))


@case
def vmap_over_typed_keys_and_a_static_argument():
  def fn(key, x, scale):
    return x * scale + jax.random.normal(key, x.shape)
  mesh = get_mesh(MESH)
  ours = spmd.partition(fn, mesh=mesh, in_specs=(P(), P("a", "b")), static_argnums=2)
  theirs = jax.jit(fn, in_shardings=named(mesh, (P(), P("a", "b"))), static_argnums=2)
  keys = jax.random.split(jax.random.key(5), 3)
  batched = lambda f: jax.vmap(f, (0, None, None))  # noqa: E731
  same(batched(ours)(keys, X, 2.0), batched(theirs)(keys, X, 2.0))


@case
def grad_and_vmap_of_an_uneven_partitioned_function():
  """Rows split 4 ways unevenly (6 rows over "b"), which jax.jit refuses: grad and vmap of the
  partitioned function equal the unpartitioned function's."""
  loss = lambda x, w: jnp.mean(jnp.tanh(x @ w) ** 2)  # noqa: E731
  f = spmd.partition(loss, mesh=get_mesh(MESH), in_specs=(P("b"), P()))
  x = randn(6, 16, seed=2)
  same(jax.grad(f, (0, 1))(x, W), jax.grad(loss, (0, 1))(x, W), shardings=False)
  xs = randn(3, 6, 16, seed=3)
  same(jax.vmap(f, (0, None))(xs, W), jax.vmap(loss, (0, None))(xs, W), shardings=False)


@case
def grad_with_dict_params_none_leaves_and_integer_aux():
  def loss(params, x):
    h = jnp.tanh(x @ params["w"])
    if params["b"] is not None:
      h = h + params["b"]
    return (h ** 2).mean(), (h > 0).sum()
  ours, theirs = both(loss, ({"w": P(None, "b"), "b": None}, P("a")), (P(), P()))
  params = {"w": W, "b": None}
  same(jax.value_and_grad(ours, has_aux=True)(params, X),
       jax.value_and_grad(theirs, has_aux=True)(params, X), shardings=False)


@case
def lax_map_and_remat_policy_around_a_partitioned_function():
  ours, theirs = both(lambda x, w: jnp.sin(x @ w).sum(), (P("a"), P(None, "b")))

  def loss(f, w):
    g = jax.checkpoint(f, policy=jax.checkpoint_policies.nothing_saveable)
    return lax.map(lambda x: g(x, w), jnp.stack([X, -X, X * 0.5])).sum()
  same(jax.value_and_grad(loss, 1)(ours, W), jax.value_and_grad(loss, 1)(theirs, W),
       shardings=False)


@case
def vmap_and_grad_on_an_explicit_mesh_under_set_mesh():
  mesh = jax.make_mesh((2, 4), ("a", "b"), axis_types=(AxisType.Explicit,) * 2)
  fn = lambda x, w: jnp.tanh(x @ w)  # noqa: E731
  ours = spmd.partition(fn, mesh=mesh, in_specs=(P("a"), P()))
  theirs = jax.jit(fn, in_shardings=named(mesh, (P("a"), P())))
  xs = randn(3, 8, 16, seed=2)
  with jax.set_mesh(mesh):
    same(jax.vmap(ours, (0, None))(xs, W), jax.vmap(theirs, (0, None))(xs, W))
    grad = lambda f: jax.grad(lambda x, w: f(x, w).sum(), (0, 1))  # noqa: E731
    same(grad(ours)(X, W), grad(theirs)(X, W))


@case
def vmap_with_dict_in_axes():
  fn = lambda p, x: jnp.tanh(x @ p["w"]) + p["b"]  # noqa: E731
  ours, theirs = both(fn, ({"w": P(None, "b"), "b": P()}, P("a")))
  params = {"w": np.stack([W, W * 2]), "b": randn(8, seed=3)}
  axes = ({"w": 0, "b": None}, None)
  same(jax.vmap(ours, axes)(params, X), jax.vmap(theirs, axes)(params, X))


@case
def jit_of_vmap_spmd_axis_name_and_vmap_of_grad():
  ours, theirs = both(mlp, (P(None, "b"), P("b")))
  xs, ws = randn(2, 8, 16, seed=2), randn(2, 16, 8, seed=3)
  batched = lambda f: jax.jit(jax.vmap(f, spmd_axis_name="a"))  # noqa: E731
  same(batched(ours)(xs, ws), batched(theirs)(xs, ws))
  loss = lambda x, w: jnp.mean(jnp.tanh(x @ w) ** 2)  # noqa: E731
  ours, theirs = both(loss, (P("a", "b"), P("b")), P())
  grads = lambda f: jax.vmap(jax.grad(f, (0, 1)), (0, None))  # noqa: E731
  same(grads(ours)(xs, W), grads(theirs)(xs, W))


@case
def grad_through_an_identity_output_and_an_integer_output():
  fn = lambda x, i: (x, i * 2, (x * x).sum())  # noqa: E731
  ours, theirs = both(fn, (P("a", "b"), P()))
  grad = lambda f: jax.grad(lambda x: f(x, 3)[0].sum() + f(x, 3)[2])  # noqa: E731
  same(grad(ours)(X), grad(theirs)(X))


@case
def committed_primals_and_cotangents_sharded_otherwise():
  """A primal or a cotangent committed to another sharding than the partitioned function's:
  spmd reshards it (eagerly, under jax.jit, and in the VJP) where jax.jit's VJP refuses the
  cotangent; the values and gradients' shardings are jax.jit's for uncommitted ones."""
  mesh = get_mesh(MESH)
  loss = lambda x, w: jnp.mean(jnp.tanh(x @ w) ** 2)  # noqa: E731
  ours, theirs = both(loss, (P("a", "b"), P("b")), P())
  x = jax.device_put(X, NamedSharding(mesh, P("b", "a")))
  want = jax.grad(theirs, (0, 1))(X, W)
  same(jax.grad(ours, (0, 1))(x, W), want)
  same(jax.jit(jax.grad(ours, (0, 1)))(x, W), want)
  ours, theirs = both(mlp, (P("a"), P(None, "b")), (P("a", "b"), P("a")))
  ct = randn(8, 8, seed=5)
  committed = (jax.device_put(ct, NamedSharding(mesh, P(None, "a"))), randn(8, seed=6))
  with pytest.raises(ValueError, match="Sharding passed to jit does not match"):
    jax.vjp(theirs, X, W)[1](committed)
  same(jax.vjp(ours, X, W)[1](committed), jax.vjp(theirs, X, W)[1]((ct, committed[1])),
       shardings=False)


# --- pjit themes ----------------------------------------------------------------------------------

@case
def one_spec_prefix_for_a_dict_and_a_tuple_of_outputs():
  def fn(tree):
    return tree["x"] * 2, (tree["y"] + 1, tree["x"].T)
  check_jit(fn, ({"x": X, "y": randn(8, 4, seed=2)},), P("a"), MESH, P(None, "b"))


@case
def spec_forms_on_one_d_and_rank_padding():
  """P(None), P(('a', 'b')) on a 1-D array, P('a', None, None) on a 3-D one, P(('b', 'a'))."""
  def fn(v, u, t):
    return v * 2, u + 1, t.sum(2), (u[:, None] * v[None, :8]).ravel()
  args = (randn(16), randn(16, seed=2), randn(4, 4, 6, seed=3))
  check_jit(fn, args, (P(None), P(("a", "b")), P("a", None, None)), MESH,
            (P(), P(("b", "a")), P(None, "b"), P(("a", "b"))))


@case
def unused_arguments():
  check_jit(lambda x, unused, w: x @ w, (X, randn(4, 4, seed=2), W), (P("a"), P("b"), P()), MESH)


@case
def identity_and_the_same_array_twice_with_other_specs():
  check_jit(lambda x: (x, x, x), (X,), P("a", "b"), MESH, (P("a", "b"), P(), P("b", "a")))


@case
def out_specs_replicating_a_sharded_result():
  plan = check_jit(lambda x, w: (x @ w, x.sum()), (X, W), (P("a", "b"), P("b")), MESH, P())
  assert {c.kind for c in plan.collectives} <= {"all-reduce", "all-gather"}


@case
def large_numpy_constant_closed_over():
  table = np.linspace(-1, 1, 64 * 16, dtype=np.float32).reshape(64, 16)
  check_jit(lambda x: x @ table.T @ table, (X,), P("a", "b"), MESH, P("a", "b"))


@case
def arange_and_zeros_created_inside_and_constrained():
  mesh = get_mesh(MESH)

  def fn(x):
    r = lax.with_sharding_constraint(jnp.arange(8 * 16, dtype=jnp.float32).reshape(8, 16),
                                     NamedSharding(mesh, P("a", "b")))
    z = lax.with_sharding_constraint(jnp.zeros((16, 8)), NamedSharding(mesh, P("b")))
    return x * r + 1, z + x.T
  check_jit(fn, (X,), P(), MESH)


@case
def typed_random_keys_as_sharded_arguments_and_outputs():
  """New-style typed keys (jax.random.key) split into a sharded key array: per-row draws, the
  keys passed through and split again."""
  keys = jax.random.split(jax.random.key(7), 8)

  def fn(keys, x):
    draws = jax.vmap(lambda k: jax.random.normal(k, (16,)))(keys)
    nxt = jax.vmap(lambda k: jax.random.split(k)[0])(keys)
    return x + draws, nxt, keys
  check_jit(fn, (keys, X), (P("a"), P("a", "b")), MESH, (P("a", "b"), P("a"), P(("a", "b"))))


@case
def nested_constraints_on_one_value():
  mesh = get_mesh(MESH)

  def fn(x):
    y = lax.with_sharding_constraint(x * 2, NamedSharding(mesh, P("a", "b")))
    y = lax.with_sharding_constraint(y, NamedSharding(mesh, P("b", None)))
    y = lax.with_sharding_constraint(y, NamedSharding(mesh, P(None, ("a", "b"))))
    return y + 1
  check_jit(fn, (X,), P(), MESH)


@case
def bare_spec_constraints_under_set_mesh_in_cond_and_while():
  def fn(x):
    def body(c):
      i, v = c
      return i + 1, lax.with_sharding_constraint(jnp.tanh(v) + i, P(None, "b"))
    _, v = lax.while_loop(lambda c: (c[0] < 3) & (c[1].sum() < 1e6), body, (0, x))
    # the branches' results pinned alike (XLA refuses a conditional whose branches' roots are
    # constrained differently), their intermediates otherwise
    out = lambda u: lax.with_sharding_constraint(u, P(None, "b"))  # noqa: E731
    return lax.cond(v[0, 0] > 0, lambda u: out(lax.with_sharding_constraint(u * 2, P("a", "b"))),
                    lambda u: out(lax.with_sharding_constraint(u - 1, P("b")) + 1), v)
  with jax.set_mesh(get_mesh(MESH)):
    check_jit(fn, (X,), P("a"), MESH)


@case
def wsc_on_a_scalar_and_zero_size():
  mesh = get_mesh(MESH)

  def fn(x, e):
    s = lax.with_sharding_constraint(x.sum(), NamedSharding(mesh, P()))
    return x * s, lax.with_sharding_constraint(e * 2, NamedSharding(mesh, P("a")))
  check_jit(fn, (X, randn(0, 4)), (P("a", "b"), P()), MESH)


@case
def scalar_kinds_and_integer_dtypes():
  def fn(x, i, n, u, b):
    return (x * n + i, (u >> 3) ^ jnp.uint32(5), jnp.where(b, x, -x).astype(jnp.float16),
            (x > 0).astype(jnp.int8).sum(0, dtype=jnp.int8))
  u = np.arange(8 * 16, dtype=np.uint32).reshape(8, 16) * 977
  args = (X, 3, np.float32(0.5), u, X > 0.5)
  check_jit(fn, args, (P("a", "b"), P(), P(), P("b"), P(None, "b")), MESH)


@case
def complex_and_bfloat16_through_a_dot():
  def fn(z, h):
    return z @ z.conj().T, (h @ h.T).astype(jnp.float32), jnp.abs(z).astype(jnp.bfloat16)
  z = (randn(8, 16) + 1j * randn(8, 16, seed=2)).astype(np.complex64)
  check_jit(fn, (z, X.astype(jnp.bfloat16)), (P("a", "b"), P("a", "b")), MESH, rtol=2e-2,
            atol=2e-2)


@case
def zeros_and_arange_placed_by_device_inside():
  mesh = get_mesh(MESH)

  def fn(x):
    z = jnp.zeros((8, 16), device=NamedSharding(mesh, P("b", "a")))
    r = jnp.arange(16.0, device=NamedSharding(mesh, P("b")))
    return x + z + r
  check_jit(fn, (X,), P("a"), MESH)


@case
def key_data_and_wrap_key_data_on_sharded_keys():
  def fn(keys):
    data = jax.random.key_data(keys)
    again = jax.random.wrap_key_data(data + 1)
    return jax.vmap(lambda k: jax.random.uniform(k, (4,)))(again), data
  check_jit(fn, (jax.random.split(jax.random.key(1), 8),), P("a"), MESH, (P("a", "b"), P("b")))


@case
def scan_carrying_a_key_with_a_constraint_on_the_other_carry():
  mesh = get_mesh(MESH)

  def fn(key, x):
    def step(c, row):
      k, acc = c
      k, sub = jax.random.split(k)
      acc = lax.with_sharding_constraint(acc + row * jax.random.normal(sub, row.shape),
                                         NamedSharding(mesh, P("b")))
      return (k, acc), acc.sum()
    return lax.scan(step, (key, jnp.zeros(16)), x)
  check_jit(fn, (jax.random.key(2), X), (P(), P(None, "b")), MESH)


@case
def grad_of_a_function_calling_a_partitioned_function_partitioned():
  mesh = get_mesh(MESH)
  inner = spmd.partition(lambda x, w: jnp.tanh(x @ w), mesh=mesh, in_specs=(P("a"), P(None, "b")))
  outer = lambda f: lambda x, w: (f(x * 2, w) ** 2).sum()  # noqa: E731
  reference = outer(lambda x, w: jnp.tanh(x @ w))
  g = spmd.partition(jax.grad(outer(inner), (0, 1)), mesh=mesh, in_specs=(P("b"), P()))
  w = W * 0.3
  same(g(X, w), jax.grad(reference, (0, 1))(X, w), shardings=False)


# --- shard_map bodies inside a partitioned function -----------------------------------------------

def smap(body: Callable, in_specs: Any, out_specs: Any, **kwargs: Any) -> Callable:
  return jax.shard_map(body, mesh=get_mesh(MESH), in_specs=in_specs, out_specs=out_specs,
                       **kwargs)


@case
def shard_map_psum_tuple_pmin():
  def body(b):
    return lax.psum(b, ("a", "b")) + lax.pmin(b, "b").sum()
  check_jit(lambda x: smap(body, P("a", "b"), P("a", "b"))(jnp.sin(x)), (X,), P("a"), MESH)


@case
def shard_map_all_gather_untiled_axis_one():
  def body(b):  # b: [4, 4] -> [4, 4(b), 4]
    return lax.all_gather(b, "b", axis=1, tiled=False).sum(2)
  check_jit(lambda x: smap(body, P("a", "b"), P("a"), check_vma=False)(x) * 2, (X,),
            P("a", "b"), MESH)


@case
def shard_map_psum_scatter_dim_one_tiled():
  def body(b):  # b: [4, 16] -> [4, 4], summed over "b"
    return lax.psum_scatter(b, "b", scatter_dimension=1, tiled=True)
  check_jit(lambda x: smap(body, P("a"), P("a", "b"))(x * 3), (X,), P("a"), MESH)


@case
def shard_map_all_to_all_over_a():
  def body(b):  # b: [8, 4] split 2 ways along dim 0, gathered along dim 1
    return lax.all_to_all(b, "a", split_axis=0, concat_axis=1, tiled=True)
  check_jit(lambda x: smap(body, P(None, ("a", "b")), P("a", ("b",)))(x),
            (randn(8, 32, seed=2),), P(None, ("a", "b")), MESH)


@case
def shard_map_ring_over_two_axes_and_axis_index():
  def body(b):
    n = 8
    shifted = lax.ppermute(b, ("a", "b"), [(i, (i + 3) % n) for i in range(n)])
    k = lax.axis_index("a") * 4 + lax.axis_index("b")
    return shifted * (k + 1).astype(b.dtype) - lax.axis_index(("a", "b")).astype(b.dtype)
  check_jit(lambda x: smap(body, P(("a", "b")), P(("a", "b")))(x), (X,), P(), MESH)


@case
def shard_map_ring_all_reduce_in_fori_loop():
  """shard_map_test's ring reduce-scatter + all-gather written with ppermute in a loop."""
  n = 4

  def body(b):  # b: [8, 4]: the ring sums the 4 blocks of "b"
    def step(_, acc):
      return lax.ppermute(acc, "b", [(i, (i + 1) % n) for i in range(n)]) + b
    return lax.fori_loop(0, n - 1, step, b)
  check_jit(lambda x: smap(body, P(None, "b"), P(None, "b"), check_vma=False)(x), (X,),
            P(None, "b"), MESH)


@case
def shard_map_pcast_varying_then_psum():
  def body(b, w):
    v = lax.pcast(w, ("a",), to="varying") * b.sum()
    return lax.psum(v, "a")
  f = lambda x, w: smap(body, (P("a", "b"), P("b")), P("b"))(x, w)  # noqa: E731
  check_jit(f, (X, randn(16, seed=2)), (P("a", "b"), P("b")), MESH)


@case
def shard_map_data_parallel_grad_with_pmean():
  """The pmap-era data-parallel step inside one shard_map: each shard's gradient, pmean'd."""
  def body(w, x, y):
    g = jax.grad(lambda w: jnp.mean((jnp.tanh(x @ w) - y) ** 2))(w)
    return w - 0.1 * lax.pmean(g, ("a", "b"))
  y = randn(8, 8, seed=3)
  f = lambda w, x, y: smap(body, (P(), P(("a", "b")), P(("a", "b"))), P())(w, x, y)  # noqa
  check_jit(f, (W, X, y), (P(), P("a"), P("a")), MESH)


@case
def shard_map_scan_with_psum_per_step_and_grad_outside():
  def body(x, w):
    def step(c, row):
      c = jnp.tanh(lax.psum(c * row, "b") @ w)
      return c, c.sum()
    return lax.scan(step, jnp.ones((4,)), x)

  def loss(x, w):
    c, ys = smap(body, (P(None, "b"), P()), (P(), P()), check_vma=False)(x, w)
    return (c ** 2).sum() + ys.sum()
  check_jit(jax.value_and_grad(loss, (0, 1)), (X * 0.3, randn(4, 4, seed=2) * 0.5),
            (P("a", "b"), P("b")), MESH)


@case
def shard_map_in_specs_differ_from_propagation_both_sides():
  """Propagation around the shard_map chose other shardings: its operand and its result are
  resharded at its boundary, priced in the plan."""
  def fn(x, w):
    h = x @ w
    y = smap(lambda b: b * lax.psum(b.sum(), ("a", "b")), P("b", "a"), P("b", "a"))(h)
    return y @ w.T
  plan = check_jit(fn, (X, W), (P("a", "b"), P("b")), MESH, P("a", "b"))
  assert any(c.before != "manual" for c in plan.collectives)


@case
def shard_map_stacked_per_device_scalars():
  def body(b):
    return jnp.stack([b.sum(), b.max()])[None]
  check_jit(lambda x: smap(body, P("a", "b"), P(("a", "b")))(x).sum(0), (X,), P("a", "b"), MESH)


@case
def shard_map_partial_permutation_leaves_zeros():
  """ppermute with a partial perm: the devices nobody sends to receive zeros."""
  def body(b):
    return lax.ppermute(b, "b", [(0, 1), (1, 2)]) + 1
  check_jit(lambda x: smap(body, P("a", "b"), P("a", "b"))(x), (X,), P("a", "b"), MESH)


@case
def shard_map_tuple_axis_gather_and_scatter():
  def body(b):  # b: f32[1, 16]
    g = lax.all_gather(b, ("a", "b"), axis=0, tiled=True)  # [8, 16], whole on each device
    s = lax.psum_scatter(g * b, ("a", "b"), scatter_dimension=1, tiled=True)  # [8, 2]
    return s, lax.axis_size(("a", "b")) * g[:, :2]
  f = lambda x: smap(body, P(("a", "b")), (P(None, ("a", "b")), P()), check_vma=False)(x)  # noqa
  check_jit(f, (X,), P(("a", "b")), MESH)


@case
def shard_map_integer_and_bool_psums():
  def body(i, m):
    return lax.psum(i, "b"), lax.psum(m.astype(jnp.int32), ("a", "b")), lax.pmax(i, "a")
  ints = np.arange(8 * 16, dtype=np.int32).reshape(8, 16) % 7
  f = lambda i, m: smap(body, (P("a", "b"), P("a", "b")),  # noqa: E731
                        (P("a"), P(), P(None, "b")))(i, m)
  check_jit(f, (ints, X > 0), (P("a", "b"), P("a")), MESH)


@case
def shard_map_body_with_jit_and_checkpoint_under_grad():
  def body(x, w):
    inner = jax.jit(jax.checkpoint(lambda x: jnp.sin(x @ w)))
    return lax.psum(inner(x), "b")

  def loss(x, w):
    y = smap(body, (P("a", "b"), P("b")), P("a"))(x, w)
    return (y ** 2).mean()
  check_jit(jax.grad(loss, (0, 1)), (X, W * 0.5), (P("a", "b"), P("b")), MESH)


@case
def shard_map_custom_vjp_in_body_under_grad():
  @jax.custom_vjp
  def clip_grad(x):
    return x

  clip_grad.defvjp(lambda x: (x, None), lambda _, g: (jnp.clip(g, -0.01, 0.01),))

  def loss(x, w):
    y = smap(lambda b, v: clip_grad(jnp.tanh(b @ v)), (P("a"), P()), P("a"))(x, w)
    return (y ** 2).sum()
  check_jit(jax.grad(loss, (0, 1)), (X, W), (P("a", "b"), P("b")), MESH)


@case
def shard_map_collectives_under_grad():
  """The transposes of all_gather (a reduce-scatter), ppermute (the inverse permutation) and
  psum_scatter (an all-gather) in the backward body."""
  def body(b, w):
    g = lax.all_gather(b, "b", axis=1, tiled=True)  # [4, 16]
    r = lax.ppermute(jnp.tanh(g @ w), "a", [(0, 1), (1, 0)])  # [4, 8]
    return lax.psum_scatter(r, "b", scatter_dimension=1, tiled=True)  # [4, 2]

  def loss(x, w):
    return (smap(body, (P("a", "b"), P()), P("a", "b"))(x, w) ** 2).sum()
  check_jit(jax.grad(loss, (0, 1)), (X, W * 0.5), (P("a", "b"), P()), MESH)


@case
def shard_map_vmapped_inside():
  """jax.vmap of a shard_map inside the partitioned function: the batch dim is unmapped."""
  s = smap(lambda b: lax.psum(b * b, "b"), P("a", "b"), P("a"))
  check_jit(lambda xs: jax.vmap(s)(xs) + 1, (randn(3, 8, 16, seed=2),), P(None, "a", "b"), MESH)


@case
def shard_map_random_per_device_by_axis_index():
  def body(key, b):
    k = jax.random.fold_in(key, lax.axis_index(("a", "b")))
    return b + jax.random.normal(k, b.shape)
  f = lambda key, x: smap(body, (P(), P("a", "b")), P("a", "b"))(key, x)  # noqa: E731
  check_jit(f, (jax.random.key(3), X), (P(), P("a", "b")), MESH)


@case
def shard_map_axes_in_reverse_order_and_replicated_over_one():
  """in_specs naming the axes in the other order (("b", "a") on one dim) and a body replicated
  over "a" (its operand unsplit there)."""
  def body(u, v):
    return lax.psum(u.sum(), ("b", "a")) * v
  f = lambda u, v: smap(body, (P(("b", "a")), P(None, "b")), P(None, "b"))(u, v)  # noqa: E731
  check_jit(f, (randn(16, seed=2), X), (P("a"), P("b")), MESH)


@case
def shard_map_typed_keys_in_and_out():
  """Typed key arrays through a shard_map body (drawn from, split and returned): spmd typed the
  body's key results back with a select, which XLA's lowering of key selects refused."""
  def fn(keys, x):
    def body(k, v):
      return v + jax.random.normal(k[0], v.shape), jax.random.split(k[0], 1)
    return smap(body, (P(("a", "b")), P(("a", "b"))), (P(("a", "b")), P(("a", "b"))))(keys, x)
  check_jit(fn, (jax.random.split(jax.random.key(1), 8), X), (P("a"), P("b")), MESH)


def psum_body_fn(x, w):
  return smap(lambda b, v: lax.psum(jnp.tanh(b @ v), "b"), (P("a", "b"), P("b")), P("a"))(x, w)


@case
def grad_of_a_partitioned_function_with_a_shard_map():
  loss = lambda x, w: (psum_body_fn(x, w) ** 2).mean()  # noqa: E731
  ours, theirs = both(loss, (P("a", "b"), P("b")))
  same(jax.grad(ours, (0, 1))(X, W), jax.grad(theirs, (0, 1))(X, W))


@case
def vmap_of_a_partitioned_function_with_an_unchecked_shard_map():
  def fn(x, w):
    return smap(lambda b, v: lax.psum(jnp.tanh(b @ v), "b"), (P("a", "b"), P("b")), P("a"),
                check_vma=False)(x, w)
  ours, theirs = both(fn, (P("a", "b"), P("b")))
  xs = randn(3, 8, 16, seed=2)
  same(jax.vmap(ours, (0, None))(xs, W), jax.vmap(theirs, (0, None))(xs, W))


@case
def vmap_of_a_partitioned_function_with_a_checked_shard_map():
  """A checked body's psum binds psum_invariant, which refused the unchecked re-trace vmap makes
  of spmd's program: the body is now evaluated in its unchecked form (unchecked.py)."""
  ours, theirs = both(psum_body_fn, (P("a", "b"), P("b")))
  xs = randn(3, 8, 16, seed=2)
  same(jax.vmap(ours, (0, None))(xs, W), jax.vmap(theirs, (0, None))(xs, W))


def _scanned_psum(b, v):
  """A psum inside the body's own scan (its body evaluated unchecked too)."""
  def step(c, _):
    return c + lax.psum(jnp.tanh(b @ v + c), "b"), None
  return lax.scan(step, lax.psum(b @ v, "b") * 0, None, length=2)[0]


# Checked bodies (check_vma=True) binding each collective: (body, in_specs, out_specs) of
# (x f32[8,16], w f32[16,8]).
CHECKED_BODIES = {
    "pmax": (lambda b, v: lax.pmax(jnp.tanh(b @ v), "b"), (P("a", "b"), P("b")), P("a")),
    "all_gather": (lambda b, v: jnp.tanh(lax.all_gather(b, "b", axis=1, tiled=True) @ v),
                   (P("a", "b"), P()), P("a", "b")),
    "ppermute": (lambda b, v: lax.ppermute(jnp.tanh(b) * v.sum(), "b",
                                           [(i, (i + 1) % 4) for i in range(4)]),
                 (P("a", "b"), P()), P("a", "b")),
    "psum_scatter": (lambda b, v: lax.psum_scatter(jnp.tanh(b @ v), "b", scatter_dimension=1,
                                                   tiled=True), (P("a", "b"), P("b")),
                     P("a", "b")),
    "psum_in_scan": (_scanned_psum, (P("a", "b"), P("b")), P("a")),
}


def _checked_body_fn(name: str) -> Callable:
  body, in_specs, out_specs = CHECKED_BODIES[name]
  return lambda x, w: smap(body, in_specs, out_specs)(x, w)  # noqa: E731


def vmap_of_a_checked_body(name: str) -> None:
  ours, theirs = both(_checked_body_fn(name), (P("a", "b"), P("b")))
  xs = randn(3, 8, 16, seed=2)
  same(jax.vmap(ours, (0, None))(xs, W), jax.vmap(theirs, (0, None))(xs, W))


def grad_of_a_checked_body(name: str) -> None:
  fn = _checked_body_fn(name)
  loss = lambda x, w: (fn(x, w) ** 2).mean()  # noqa: E731
  ours, theirs = both(loss, (P("a", "b"), P("b")))
  same(jax.grad(ours, (0, 1))(X, W), jax.grad(theirs, (0, 1))(X, W))


def vmap_of_grad_of_a_checked_body(name: str) -> None:
  fn = _checked_body_fn(name)
  loss = lambda x, w: (fn(x, w) ** 2).mean()  # noqa: E731
  ours, theirs = both(loss, (P("a", "b"), P("b")))
  xs = randn(3, 8, 16, seed=2)
  batched = lambda f: jax.vmap(jax.grad(f, (0, 1)), (0, None))  # noqa: E731
  same(batched(ours)(xs, W), batched(theirs)(xs, W))


CASES.extend(pytest.param(functools.partial(check, name), id=f"{check.__name__}_{name}")
             for check in (vmap_of_a_checked_body, grad_of_a_checked_body,
                           vmap_of_grad_of_a_checked_body)
             for name in CHECKED_BODIES
             if check is vmap_of_a_checked_body or name != "pmax")  # JAX differentiates no pmax


@pytest.mark.parametrize("run", [c if not callable(c) else pytest.param(c, id=c.__name__)
                                 for c in CASES])
def test_case(run: Callable[[], None]) -> None:
  run()
