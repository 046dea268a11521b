"""Bad inputs get errors that say where, which spec, on which mesh, and the fix; inputs that
looked bad but are fine (size-1 dims, rbg keys on uneven outputs, bool through collectives)
work; and no call loses the user's arrays. test_api.py has the errors' basic cases."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import spmd

X = np.arange(8 * 12, dtype=np.float32).reshape(8, 12)
MESH = "mesh data=2, model=4"


@pytest.fixture(scope="module")
def mesh():
  return spmd.make_mesh({"data": 2, "model": 4})


def wsc(spec):
  return lambda x: jax.lax.with_sharding_constraint(x * 2, spec)


# (what, function, in_specs, out_specs, what the message must say)
BAD = [
    ("with_sharding_constraint names an unknown axis", wsc(P("rows")), None, None,
     ["asked for at test_errors.py:", "(<lambda>)", "P('rows',)", "(data=2, model=4)",
      "Name only the mesh's axes"]),
    ("with_sharding_constraint uses an axis twice", wsc(P("data", "data")), None, None,
     ["asked for at test_errors.py:", "P('data', 'data')", "(data=2, model=4)",
      "each at most once"]),
    ("annotate uses an axis twice", lambda x: spmd.annotate(x, P("model", "model")), None, None,
     ["annotation at ", "test_errors.py", "P('model', 'model')", MESH,
      "a mesh axis splits one dim at most"]),
    ("in_specs uses an axis twice", lambda x: x, P(("data", "data")), None,
     ["in_specs for argument 'x'", "P(('data', 'data'),)", MESH,
      "a mesh axis splits one dim at most"]),
    ("in_specs has more entries than the rank", lambda x: x, P("data", None, None), None,
     ["in_specs for argument 'x'", "P('data', None, None)", MESH, "rank 2", "one entry per dim"]),
    ("out_specs has more entries than the rank", lambda x: x.sum(0), None, P("data", "model"),
     ["out_specs for output", "P('data', 'model')", MESH, "rank 1", "one entry per dim"]),
    ("out_specs uses an axis twice", lambda x: x, None, P("model", "model"),
     ["out_specs for output", "P('model', 'model')", MESH, "a mesh axis splits one dim at most"]),
]


@pytest.mark.parametrize("fn, in_specs, out_specs, fragments", [b[1:] for b in BAD],
                         ids=[b[0] for b in BAD])
def test_bad_specs_say_where_which_spec_mesh_and_fix(mesh, fn, in_specs, out_specs, fragments):
  f = spmd.partition(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs)
  with pytest.raises(ValueError) as info:
    f(X)
  missing = [fragment for fragment in fragments if fragment not in str(info.value)]
  assert not missing, (missing, str(info.value))


def test_size_one_dim_is_whole_with_a_warning_not_gathered(mesh):
  f = spmd.partition(lambda x, y: x * y, mesh=mesh, in_specs=(P("data", None), P("data", None)))
  x, y = X[:1], X[1:2]
  with pytest.warns(UserWarning) as caught:
    plan = f.plan(x, y)
  assert {str(w.message) for w in caught} == {
      f"spmd.partition: in_specs for argument {name}: P('data', None) shards dim 0, of size 1, "
      f"over data ({MESH}); one element cannot be split, so that dim is whole on every device: "
      "write None for it" for name in ("'x'", "'y'")}
  assert not plan.collectives and not plan.warnings
  with pytest.warns(UserWarning):
    np.testing.assert_array_equal(f(x, y), x * y)


@pytest.mark.parametrize("impl", ["rbg", "unsafe_rbg"])
@pytest.mark.parametrize("shape, spec", [((15, 4), P(("data", "model"))),
                                         ((6, 5), P("data", "model"))],
                         ids=["15-rows-over-8", "6x5-over-2x4"])
def test_non_threefry_keys_on_uneven_outputs(mesh, impl, shape, spec):
  fn = lambda key: jax.random.normal(key, shape)  # noqa: E731
  key = jax.random.key(0, impl=impl)
  got = spmd.partition(fn, mesh=mesh, in_specs=P(), out_specs=spec)(key)
  np.testing.assert_array_equal(got, jax.jit(fn)(key))


@pytest.mark.parametrize("fn, spec, out_spec, kind", [
    (lambda x: x.any(0), P("data", None), None, "all-reduce"),
    (lambda x: ~x, P("data", None), P(), "all-gather"),  # (a cumsum moves data to dim 1)
    (lambda x: x, P("data", None), P(None, "data"), "all-to-all"),
    (lambda x: jnp.roll(x, 1, 0), P("data", None), None, "collective-permute"),
    (lambda x: x[:7].all(0), P(("data", "model"), None), None, "all-reduce"),  # uneven
], ids=["all-reduce", "all-gather", "all-to-all", "permute", "uneven"])
def test_bool_arrays_through_every_collective(mesh, fn, spec, out_spec, kind):
  x = np.random.default_rng(0).random((8, 12)) > 0.5
  f = spmd.partition(fn, mesh=mesh, in_specs=spec, out_specs=out_spec)
  assert kind in [c.kind for c in f.plan(x).collectives]
  np.testing.assert_array_equal(f(x), fn(x))


# --- nothing lost ---------------------------------------------------------------------------------


def test_inputs_are_never_modified(mesh):
  def step(x, y, z):  # writes into its inputs' values, as a functional update
    return x.at[0].set(-1.0) * 2, y.at[:, 0].add(5.0), z.at[0].set(0.0)

  specs = (P("data"), P(None, "model"), P(("data", "model")))
  f = spmd.partition(step, mesh=mesh, in_specs=specs)
  committed = jax.device_put(X, NamedSharding(mesh, P("data")))
  host, uneven = X.copy(), jnp.arange(15.0)  # numpy, and an uneven uncommitted array
  f(committed, host, uneven)
  np.testing.assert_array_equal(committed, X)
  np.testing.assert_array_equal(host, X)
  np.testing.assert_array_equal(uneven, np.arange(15.0))
  assert not committed.is_deleted() and not uneven.is_deleted()


def test_a_failing_call_leaves_donated_arrays_intact(mesh):
  def broken(x):
    raise ZeroDivisionError("in the user's function")

  x = jax.device_put(X, NamedSharding(mesh, P("data")))
  with pytest.raises(ZeroDivisionError):
    spmd.partition(broken, mesh=mesh, in_specs=P("data"), donate_argnums=0)(x)
  with pytest.raises(ValueError, match="nope"):
    spmd.partition(lambda x: x, mesh=mesh, in_specs=P("nope"), donate_argnums=0)(x)
  assert not x.is_deleted()
  np.testing.assert_array_equal(x, X)


def test_reusing_a_donated_array_is_jax_error(mesh):
  f = spmd.partition(lambda x: x + 1, mesh=mesh, in_specs=P("data"), donate_argnums=0)
  x = jax.device_put(X, NamedSharding(mesh, P("data")))
  y = f(x)
  f(y)  # the steady-state path, then a donated array again, then a new program
  for call in (lambda: f(y), lambda: f(x),
               lambda: spmd.partition(lambda x: x * 2, mesh=mesh, in_specs=P("data"))(x)):
    with pytest.raises(RuntimeError, match="Array has been deleted"):
      call()
  with pytest.raises(RuntimeError, match="Array has been deleted"):
    np.asarray(x)


def test_a_pmap_style_collective_says_what_it_means_here(mesh):
  """``lax.pmean(x, "data")`` outside any shard_map (a step written for pmap, flax's
  ``BatchNorm(axis_name=...)``): JAX's unbound-axis error, restated with the site and the two
  ways out. A NameError of Python's own (an undefined variable) is left as it is."""
  f = spmd.partition(lambda x: jax.lax.pmean(x, "data").sum(), mesh=mesh, in_specs=P("data"))
  with pytest.raises(NameError, match=r"a collective over a named axis at test_errors.py:\d+ "
                                      r".*outside a jax.shard_map.*drop the axis name"):
    f(jnp.ones(8))
  g = spmd.partition(lambda x: x + undefined_name, mesh=mesh)  # noqa: F821
  with pytest.raises(NameError, match="name 'undefined_name' is not defined"):
    g(jnp.ones(8))
