"""The public contract of spmd.partition, spmd.annotate, spmd.make_mesh and Plan."""
import collections
import contextlib
from typing import Iterator

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import spmd
from helpers import check_plan, randn


@pytest.fixture(scope="module")
def mesh():
  return spmd.make_mesh({"data": 2, "model": 4})


def f(x, w):
  h = spmd.annotate(x @ w, P("data", "model"))
  return jnp.tanh(h).sum(0)


X = jnp.linspace(-1, 1, 8 * 16, dtype=jnp.float32).reshape(8, 16)
W = jnp.linspace(-1, 1, 16 * 32, dtype=jnp.float32).reshape(16, 32)


def test_decorator_and_function_forms_agree(mesh):
  specs = (P("data", None), P(None, "model"))
  decorated = spmd.partition(mesh=mesh, in_specs=specs)(f)
  called = spmd.partition(f, mesh=mesh, in_specs=specs)
  np.testing.assert_allclose(decorated(X, W), f(X, W), rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(called(X, W), decorated(X, W))
  assert decorated.__name__ == "f"


def test_make_mesh_has_auto_axes_and_chosen_devices():
  mesh = spmd.make_mesh({"a": 2, "b": 2}, devices=jax.devices()[4:])
  assert mesh.shape == {"a": 2, "b": 2}
  assert all(t == jax.sharding.AxisType.Auto for t in mesh.axis_types)
  assert [d.id for d in mesh.devices.flat] == [4, 5, 6, 7]
  with pytest.raises(ValueError, match="needs 16 devices"):
    spmd.make_mesh({"a": 16})


def test_outputs_are_global_arrays_with_the_inferred_sharding(mesh):
  g = spmd.partition(f, mesh=mesh, in_specs=(P("data", None), P(None, "model")))
  out = g(X, W)
  assert g.plan(X, W).out_specs == P("model")
  assert out.sharding == NamedSharding(mesh, P("model"))


def test_out_specs_given(mesh):
  g = spmd.partition(f, mesh=mesh, in_specs=(P("data", None), P(None, "model")), out_specs=P())
  out = g(X, W)
  assert out.sharding.is_fully_replicated
  assert g.plan(X, W).out_specs == P(None)
  np.testing.assert_allclose(out, f(X, W), rtol=1e-5, atol=1e-5)


def test_out_specs_prefix_of_output_pytree(mesh):
  def two(x):
    return {"a": x * 2, "b": (x + 1, x.sum(1))}

  g = spmd.partition(two, mesh=mesh, in_specs=P("data"), out_specs={"a": P(None, "model"),
                                                                    "b": P("data")})
  out = g(X)
  assert out["a"].sharding.spec == P(None, "model")
  assert out["b"][0].sharding.spec == P("data")  # the entry as given, as jax.jit returns it
  assert out["b"][1].sharding.spec == P("data")
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6), out, two(X))


def test_namedtuple_out_specs_for_a_namedtuple_output(mesh):
  """A namedtuple of specs for a namedtuple output is matched field by field (it was rebuilt as
  the output's type from one positional argument, a TypeError)."""
  Pair = collections.namedtuple("Pair", "h s")
  g = spmd.partition(lambda x: Pair(x * 2, x.sum(1)), mesh=mesh, in_specs=P("data"),
                     out_specs=Pair(P(None, "model"), P("data")))
  out = g(X)
  assert (out.h.sharding.spec, out.s.sharding.spec) == (P(None, "model"), P("data"))
  np.testing.assert_allclose(out.s, X.sum(1), rtol=1e-6)


def test_in_specs_none_takes_shardings_of_arrays_on_the_mesh(mesh):
  x = jax.device_put(X, NamedSharding(mesh, P(None, "model")))
  g = spmd.partition(lambda x, y: x * 2 + y, mesh=mesh)
  plan = g.plan(x, X)
  assert plan.in_specs == (P(None, "model"), P(None, "model"))  # y is open: it follows x
  assert "input 0" in plan.explain()
  np.testing.assert_allclose(g(x, X), X * 3)


def test_open_inputs_stay_open(mesh):
  g = spmd.partition(lambda x, w: x @ w, mesh=mesh, in_specs=(P("data", None), None))
  assert g.plan(X, W).in_specs == (P("data", None), P(None, None))


def test_annotate_is_identity_outside_partition():
  def h(x):
    return jnp.sin(spmd.annotate(x, P("data", None))) * 2

  np.testing.assert_allclose(jax.jit(h)(X), jnp.sin(X) * 2, rtol=1e-6)
  np.testing.assert_allclose(jax.grad(lambda x: h(x).sum())(X), jnp.cos(X) * 2, rtol=1e-6)
  np.testing.assert_allclose(jax.vmap(h)(X[None]), jnp.sin(X[None]) * 2, rtol=1e-6)
  assert h(X).shape == X.shape


def test_annotate_validates_its_spec():
  with pytest.raises(TypeError, match="PartitionSpec"):
    spmd.annotate(X, ("data",))
  with pytest.raises(ValueError, match="rank 2"):
    spmd.annotate(X, P("a", "b", "c"))


def test_with_sharding_constraint_is_honoured(mesh):
  def h(x, w):
    y = jax.lax.with_sharding_constraint(x @ w, P(None, "model"))
    z = jax.lax.with_sharding_constraint(jnp.exp(y), NamedSharding(mesh, P("data", None)))
    return z

  g = spmd.partition(h, mesh=mesh, in_specs=(P(), P()))
  plan = g.plan(X, W)
  specs = {r.primitive: r.specs[0] for r in plan.rows}
  assert [r.specs[0] for r in plan.rows if r.primitive == "sharding_constraint"] == [
      "P(None, 'model')", "P('data', None)"]
  assert specs["exp"] == "P('data', 'model')"  # compatible with both annotations: the finest
  assert [(c.kind, c.axes) for c in plan.collectives] == [("all-gather", ("model",))]
  np.testing.assert_allclose(g(X, W), jnp.exp(X @ W), rtol=1e-5)


def test_unconstrained_dims_stay_open(mesh):
  def h(x):
    return spmd.annotate(x * 2, P(P.UNCONSTRAINED, "model")) + 1

  plan = spmd.partition(h, mesh=mesh, in_specs=P("data", None)).plan(X)
  assert plan.rows[1].specs[0] == "P('data', 'model')"


def test_conflicting_annotations_are_reported_with_their_cost(mesh):
  def h(x):
    y = spmd.annotate(x + 1, P("model", None))
    return y * x

  g = spmd.partition(h, mesh=mesh, in_specs=P("data", None))
  plan = g.plan(X)
  # closed shardings of one size: neither is kept (jax.jit's P()), each reported as dropped
  conflicts = [w for w in plan.warnings if "conflicting shardings" in w]
  assert len(conflicts) == 2 and all("kept ()" in w and "bytes per device" in w for w in conflicts)
  assert "dropped ('data',)" in conflicts[0] and "dropped ('model',)" in conflicts[1]
  np.testing.assert_allclose(g(X), (X + 1) * X, rtol=1e-6)


def test_primitive_without_rule_runs_replicated_and_is_reported(mesh):
  def h(a):
    return jax.lax.ragged_dot(a @ a.T, W[:, :6].reshape(2, 8, 6), jnp.array([3, 5])) * 2

  g = spmd.partition(h, mesh=mesh, in_specs=P("data", None))
  plan = g.plan(X)
  assert any("ragged_dot_general" in w and "no sharding rule (no rule yet" in w and "test_api.py" in w
             for w in plan.warnings)
  np.testing.assert_allclose(g(X), h(X), rtol=1e-5, atol=1e-5)


def test_calls_are_cached_per_avals_and_specs(mesh):
  traces = []

  def h(x):
    traces.append(x.shape)
    return x * 2

  g = spmd.partition(h, mesh=mesh, in_specs=P("data"))
  g(X)
  g(X + 1)
  g.plan(X)
  assert len(traces) == 1
  g(jnp.ones((4, 16)))
  assert len(traces) == 2


def test_steady_state_calls_see_new_values_statics_and_placements(mesh):
  """Repeated calls take the dispatch fast path; it must never serve a stale program."""
  def h(x, power, scale):
    return x ** power * scale

  g = spmd.partition(h, mesh=mesh, in_specs=(P("data"), None), static_argnums=1)
  for k in range(3):  # new values, the same avals: one program
    np.testing.assert_allclose(g(X + k, 2, 0.5 * k), (X + k) ** 2 * 0.5 * k, rtol=1e-5)
  np.testing.assert_allclose(g(X, 3, 2.0), X ** 3 * 2, rtol=1e-5)  # another static value
  np.testing.assert_allclose(g(np.asarray(X), 3, 2), X ** 3 * 2, rtol=1e-5)  # numpy, an int
  placed = jax.device_put(X, NamedSharding(mesh, P(None, "model")))  # committed elsewhere
  np.testing.assert_allclose(g(placed, 3, 2.0), X ** 3 * 2, rtol=1e-5)
  np.testing.assert_allclose(g(X.astype(jnp.bfloat16), 1, 1.0), X.astype(jnp.bfloat16))


def test_steady_state_path_runs_the_program_a_fresh_call_would_build(mesh):
  """A repeated call hands its arguments to the compiled program, which checks their shapes,
  dtypes and committed shardings itself; what it does not check must still pick the program a
  fresh call builds: weak types, whether an open leaf arrives committed, tracers."""
  def h(x, s):
    return x * s

  g = spmd.partition(h, mesh=mesh)
  xb = X.astype(jnp.bfloat16)
  committed = jax.device_put(xb, NamedSharding(mesh, P(None, "model")))
  strong, weak = jnp.float32(2), jnp.asarray(2.0)  # both f32[], the second weakly typed
  assert not strong.weak_type and weak.weak_type
  for x, s in [(committed, strong), (committed, strong), (committed, weak), (committed, weak),
               (xb, weak), (xb, weak), (committed, weak), (xb[:4], weak), (np.asarray(xb), 2.0)]:
    out, want = g(x, s), spmd.partition(h, mesh=mesh)(x, s)
    assert (out.dtype, out.sharding) == (want.dtype, want.sharding)
    np.testing.assert_array_equal(out, want)
  assert g(xb, weak).sharding != g(committed, weak).sharding  # the open leaf's seed differs
  grad = jax.grad(lambda x: g(x, strong).sum())(X)
  np.testing.assert_array_equal(grad, jnp.full_like(X, 2.0))


def test_steady_state_calls_return_none_and_none_leaves(mesh):
  """None is an output like any other on the steady path (not a miss of it)."""
  nothing = spmd.partition(lambda x: None, mesh=mesh, in_specs=P("data"))
  some = spmd.partition(lambda x: {"none": None, "y": (x * 2, None)}, mesh=mesh,
                        in_specs=P("data"))
  for _ in range(3):
    assert nothing(X) is None
    out = some(X)
    assert out["none"] is None and out["y"][1] is None
    np.testing.assert_array_equal(out["y"][0], X * 2)


def test_static_argnums_and_keyword_arguments(mesh):
  def h(x, power, scale):
    return x ** power * scale

  g = spmd.partition(h, mesh=mesh, in_specs=(P("data"), None), static_argnums=1)
  np.testing.assert_allclose(g(X, 3, 2.0), X ** 3 * 2, rtol=1e-5)
  np.testing.assert_allclose(g(X, 2, scale=1.0), X ** 2, rtol=1e-5)
  with pytest.raises(TypeError, match="hashable"):
    g(X, [2], 1.0)


def test_arguments_are_not_modified_unless_donated(mesh):
  x = jax.device_put(X, NamedSharding(mesh, P("data")))
  g = spmd.partition(lambda x: x + 1, mesh=mesh, in_specs=P("data"))
  g(x)
  np.testing.assert_array_equal(x, X)
  donating = spmd.partition(lambda x: x + 1, mesh=mesh, in_specs=P("data"), donate_argnums=0)
  # A program's output: no other array shares its buffers (x's may be X's, which numpy views of X
  # hold on to: then JAX keeps a donated x, as jax.jit does on jax 0.11).
  owned = g(x)
  donating(owned)
  assert owned.is_deleted()


@pytest.mark.parametrize("spec, match", [
    (P("nope"), "mesh axis 'nope', which is not in the mesh"),
    (P("data", "data"), "uses mesh axis 'data' more than once"),
    (P(("model", "model")), "uses mesh axis 'model' more than once"),
    (P("data", None, None), "has 3 entries but the array has rank 2"),
    (P(3), "entries are None, a mesh axis name"),
])
def test_bad_specs_name_the_argument(mesh, spec, match):
  g = spmd.partition(lambda x, w: x @ w, mesh=mesh, in_specs=(P(), spec))
  with pytest.raises((ValueError, TypeError), match=match) as info:
    g(X, W)
  assert "argument 'w'" in str(info.value)


def test_bad_out_specs(mesh):
  g = spmd.partition(lambda x: x * 2, mesh=mesh, out_specs=P("nope"))
  with pytest.raises(ValueError, match="out_specs for output.*'nope'"):
    g(X)
  g = spmd.partition(lambda x: (x, x), mesh=mesh, out_specs=(P(), P(), P()))
  with pytest.raises(ValueError, match="out_specs .* does not match the structure of the outputs"):
    g(X)


def test_in_specs_structure_must_match(mesh):
  g = spmd.partition(lambda x, w: x @ w, mesh=mesh, in_specs=(P(),))
  with pytest.raises(ValueError, match="in_specs .* does not match the structure of the arguments"):
    g(X, W)
  g = spmd.partition(lambda p: p["a"], mesh=mesh, in_specs=({"b": P()},))
  with pytest.raises(ValueError, match="does not match"):
    g({"a": X})
  g = spmd.partition(lambda x: x, mesh=mesh, in_specs=("data",))
  with pytest.raises(TypeError, match="PartitionSpec, NamedSharding or None"):
    g(X)


def test_annotation_with_unknown_axis(mesh):
  g = spmd.partition(lambda x: spmd.annotate(x, P("rows")), mesh=mesh)
  with pytest.raises(ValueError, match="annotation at .*test_api.py.*'rows'"):
    g(X)


def test_non_array_arguments_are_rejected(mesh):
  g = spmd.partition(lambda x, s: x, mesh=mesh)
  with pytest.raises(TypeError, match="argument 's' is a str, not an array"):
    g(X, "hello")
  g = spmd.partition(lambda p: p["x"], mesh=mesh)
  with pytest.raises(TypeError, match=r"argument 'p'\['f'\] is a builtin_function_or_method, not"):
    g({"x": X, "f": len})


def test_mesh_and_backend_are_checked():
  with pytest.raises(TypeError, match="jax.sharding.Mesh"):
    spmd.partition(f, mesh={"data": 2})
  with pytest.raises(ValueError, match="backend"):
    spmd.partition(f, mesh=spmd.make_mesh({"data": 2}), backend="magic")


def test_without_mesh_each_call_takes_the_set_mesh_context(mesh):
  """As jax.jit under jax.set_mesh: no mesh= is needed, and a call under another mesh
  partitions over that one (its plan names it)."""
  specs = (P("data", None), P(None, "model"))
  g = spmd.partition(f, in_specs=specs)
  with jax.set_mesh(mesh):
    got = g(X, W)
    assert got.sharding.mesh == mesh
    assert "data=2, model=4" in str(g.plan(X, W))
  np.testing.assert_allclose(got, f(X, W), rtol=1e-5, atol=1e-5)
  other = spmd.make_mesh({"data": 4, "model": 2})
  with jax.set_mesh(other):
    got = g(X, W)
    assert got.sharding.mesh == other and "data=4, model=2" in str(g.plan(X, W))
  np.testing.assert_allclose(got, f(X, W), rtol=1e-5, atol=1e-5)
  assert g.__name__ == "f"


def test_without_mesh_under_jit_and_grad_in_an_explicit_context(explicit_mesh):
  g = spmd.partition(lambda x, w: jnp.sin(x @ w).sum(), in_specs=(P("data", None), None))
  with jax.set_mesh(explicit_mesh):
    got = jax.jit(jax.grad(g, argnums=(0, 1)))(X, W)
    want = jax.jit(jax.grad(lambda x, w: jnp.sin(x @ w).sum(), argnums=(0, 1)))(X, W)
  for a, b in zip(got, want):
    np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


def test_without_mesh_the_named_shardings_give_it(mesh):
  decorated = spmd.partition(in_specs=(NamedSharding(mesh, P("data", None)), None))(f)
  got = decorated(X, W)
  assert got.sharding.mesh == mesh
  np.testing.assert_allclose(got, f(X, W), rtol=1e-5, atol=1e-5)


def test_without_mesh_the_committed_arguments_give_it(mesh):
  """As jax.jit runs where its committed arguments are: no mesh=, no context, no
  NamedSharding specs; the arguments' shardings seed the plan and their spelling comes back."""
  x = jax.device_put(X, NamedSharding(mesh, P("data", None)))
  w = jax.device_put(W, NamedSharding(mesh, P(None, "model")))
  g = spmd.partition(lambda x, w: jnp.tanh(x @ w))
  got, want = g(x, w), jax.jit(lambda x, w: jnp.tanh(x @ w))(x, w)
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)
  assert got.sharding == want.sharding  # P('data', 'model'), spelled as jax.jit spells it
  assert g.plan(x, w).total_bytes == 0
  other = jax.device_put(W, NamedSharding(spmd.make_mesh({"data": 4, "model": 2}), P()))
  with pytest.raises(ValueError, match="committed to different meshes"):
    g(x, other)


def test_without_mesh_and_outside_a_context_is_a_clear_error(mesh):
  with pytest.raises(TypeError, match="no mesh: pass mesh=, call inside jax.set_mesh"):
    spmd.partition(f, in_specs=(P("data", None), None))(X, W)
  two = (NamedSharding(mesh, P("data")), NamedSharding(spmd.make_mesh({"data": 8}), P("data")))
  with pytest.raises(ValueError, match="name 2 meshes"):
    spmd.partition(f, in_specs=two)


def test_uneven_boundary_is_a_clear_error_for_the_xla_backend(mesh):
  g = spmd.partition(lambda x: x * 2, mesh=mesh, in_specs=P("model"), backend="xla")
  with pytest.raises(ValueError, match="dim 0 of size 6 does not split evenly into 4 shards"):
    g(jnp.ones((6,)))


def test_uneven_inputs_and_outputs_with_the_spmd_backend(mesh):
  g = spmd.partition(lambda x: (x * 2, x.sum()), mesh=mesh, in_specs=P("model"),
                     out_specs=(P("model"), P()))
  out = g(jnp.arange(6.0))
  np.testing.assert_array_equal(out[0], jnp.arange(6.0) * 2)
  assert out[0].shape == (6,) and out[1] == 15
  plan = g.plan(jnp.arange(6.0))
  assert plan.in_specs == (P("model"),) and plan.out_specs == (P(None), P())
  assert any("out_specs[0]" in w and "returned as P(None)" in w for w in plan.warnings)


def test_lower_returns_a_jax_lowered(mesh):
  g = spmd.partition(f, mesh=mesh, in_specs=(P("data", None), P(None, "model")))
  lowered = g.lower(X, W)
  assert isinstance(lowered, jax.stages.Lowered)
  assert "all-reduce" in lowered.compile().as_text()


@contextlib.contextmanager
def counting_compiles() -> Iterator[list[str]]:
  """A list that gets an entry for every XLA compile while the context is open."""
  compiles: list[str] = []

  def count(event: str, *_: object, **__: object) -> None:
    if event == "/jax/core/compile/backend_compile_duration":
      compiles.append(event)

  jax.monitoring.register_event_duration_secs_listener(count)
  try:
    yield compiles
  finally:
    jax.monitoring.unregister_event_duration_listener(count)


def test_lower_after_a_call_with_committed_arguments_compiles_nothing(mesh):
  """``lower(...).compile()`` reuses the program a call compiled, also for committed arguments
  (a step's outputs fed back), whose types name their mesh: the two used to lower apart."""
  def step(w, x):
    return w - 0.1 * jnp.tanh(x @ w).sum(0), jnp.sum(x @ w)

  g = spmd.partition(step, mesh=mesh, in_specs=(None, P("data", None)))
  w = g(W[:, :16], X)[0]  # committed to the mesh
  assert w.committed
  g(w, X)
  with counting_compiles() as compiles:
    g.lower(w, X).compile()
  assert not compiles


def test_a_loop_feeding_back_arguments_committed_as_their_specs_compiles_once(mesh):
  """A step's first call takes fresh arguments, its later ones the state it returned, committed
  as in_specs say: one plan, one program, no compile after the first call."""
  def step(w, x):
    return w - 0.1 * jnp.tanh(x @ w).sum(0), jnp.sum(x @ w)

  g = spmd.partition(step, mesh=mesh, in_specs=(P(None, "model"), P("data", None)))
  w, _ = g(W[:, :16], X)
  assert w.committed
  with counting_compiles() as compiles:
    for _ in range(2):
      w, loss = g(w, X)
  assert not compiles
  ref = W[:, :16]
  for _ in range(3):
    ref, ref_loss = step(ref, X)
  np.testing.assert_allclose(w, ref, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(loss, ref_loss, rtol=1e-5, atol=1e-5)


def test_plan_accepts_abstract_values(mesh):
  g = spmd.partition(f, mesh=mesh, in_specs=(P("data", None), P(None, "model")))
  plan = g.plan(jax.ShapeDtypeStruct((8, 16), jnp.float32), jax.ShapeDtypeStruct((16, 32),
                                                                                  jnp.float32))
  assert plan.out_specs == P("model")


# --- today's JAX conventions: Explicit meshes from jax.make_mesh, out_sharding= ---------------------

@pytest.fixture(scope="module")
def explicit_mesh():
  mesh = jax.make_mesh((2, 4), ("data", "model"))
  assert all(t == jax.sharding.AxisType.Explicit for t in mesh.axis_types)
  return mesh


def test_explicit_mesh_with_host_inputs_over_several_steps(explicit_mesh):
  """A jax.make_mesh mesh (Explicit axes, JAX's default) with numpy inputs, outputs fed back."""
  def step(w, x):
    loss, grad = jax.value_and_grad(lambda w: jnp.mean(jnp.tanh(x @ w) ** 2))(w)
    return w - 0.5 * grad, loss

  g = spmd.partition(step, mesh=explicit_mesh, in_specs=(P(None, "model"), P("data", None)),
                     out_specs=(P(None, "model"), P()))
  w_got = w_want = np.asarray(W)
  for _ in range(3):
    w_got, loss_got = g(w_got, np.asarray(X))
    w_want, loss_want = step(w_want, X)
    np.testing.assert_allclose(loss_got, loss_want, rtol=1e-5, atol=1e-6)
  np.testing.assert_allclose(w_got, w_want, rtol=1e-5, atol=1e-6)
  assert w_got.sharding.spec == P(None, "model")


def test_explicit_out_sharding_is_an_annotation(explicit_mesh):
  """einsum / reshape with out_sharding= under an Explicit mesh pin their results, as
  spmd.annotate does; dims left None stay open."""
  def fn(x, w):
    h = jnp.einsum("ij,jk->ik", x, w, out_sharding=P(None, "model"))
    h = jnp.reshape(jnp.tanh(h), (8, 4, 8), out_sharding=P(None, "data", None))
    return h.sum(axis=(1, 2))

  g = spmd.partition(fn, mesh=explicit_mesh, in_specs=(P("data", None), P()))
  plan = g.plan(np.asarray(X), np.asarray(W))
  rows = {r.primitive: r for r in plan.rows}
  assert rows["dot_general"].specs[0] == "P('data', 'model')"  # dim 0 open: propagated
  assert rows["reshape"].specs[0].startswith("P(None, 'data'")  # moved off dim 0 as asked
  with jax.set_mesh(explicit_mesh):  # the reference needs the mesh its specs name
    want = jax.jit(fn)(X, W)
  np.testing.assert_allclose(g(np.asarray(X), np.asarray(W)), want, rtol=1e-5, atol=1e-5)


def test_committed_arguments_on_an_explicit_mesh(explicit_mesh):
  x = jax.device_put(X, NamedSharding(explicit_mesh, P("data", None)))
  w = jax.device_put(W, NamedSharding(explicit_mesh, P(None, "model")))
  g = spmd.partition(f, mesh=explicit_mesh)  # in_specs=None: the arguments' own shardings
  given = spmd.partition(f, mesh=explicit_mesh, in_specs=(P("data", None), P(None, "model")))
  assert ([(c.kind, c.bytes) for c in g.plan(x, w).collectives]
          == [(c.kind, c.bytes) for c in given.plan(X, W).collectives])
  np.testing.assert_allclose(g(x, w), f(X, W), rtol=1e-5, atol=1e-5)


# --- arguments already on the mesh --------------------------------------------------------------

def test_open_leaf_of_a_committed_argument_takes_its_sharding(mesh):
  """Like jax.jit: a committed argument whose in_specs leaf is None keeps its sharding, even
  where propagation alone would choose another."""
  x = jax.device_put(X, NamedSharding(mesh, P(None, "model")))
  g = spmd.partition(f, mesh=mesh, in_specs=(None, P(None, "model")))
  plan = g.plan(x, W)
  assert plan.in_specs[0] == P(None, "model")
  np.testing.assert_allclose(g(x, W), f(X, W), rtol=1e-5, atol=1e-5)


def test_spec_that_differs_from_the_committed_sharding_is_resharded_inside(mesh):
  x = jax.device_put(X, NamedSharding(mesh, P(None, "model")))
  g = spmd.partition(f, mesh=mesh, in_specs=(P("data", None), P(None, "model")))
  plan = g.plan(x, W)
  (row,) = [r for r in plan.rows if r.primitive == "input[0]"]
  assert row.specs == ("P('data', None)",) and "committed" in row.origins[0]
  assert [c.kind for c in row.collectives] == ["all-gather"]
  assert any("arrives committed as P(None, 'model')" in w for w in plan.warnings)
  np.testing.assert_allclose(g(x, W), f(X, W), rtol=1e-5, atol=1e-5)
  # the same call with a host array places it as asked: no reshard
  assert not [r for r in g.plan(np.asarray(X), W).rows if r.primitive == "input[0]"]
  grad = jax.grad(lambda x: g(x, W).sum())(x)  # an eager grad sees concrete committed primals
  np.testing.assert_allclose(grad, jax.grad(lambda x: f(x, W).sum())(X), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("shape,spec", [((4, 16, 6), P(None, "data", None)),
                                        ((3, 16, 6), P("model", "data", None))])
def test_an_argument_resharded_on_entry_is_read_as_resharded(mesh, shape, spec):
  """A scatter whose result propagates to the argument's committed sharding: it reads the
  argument as the entry's reshard made it (the plan priced that reshard while the op read the
  committed blocks, and the compiled program had no such collective)."""
  f = lambda mem, g: mem.at[1].set(g)  # noqa: E731
  mem = jax.device_put(randn(*shape), NamedSharding(mesh, P(None, None, "data")))
  g = jnp.asarray(randn(16, 6, seed=1))
  partitioned = spmd.partition(f, mesh=mesh, in_specs=(spec, P("model", "data")))
  np.testing.assert_array_equal(partitioned(mem, g), f(jnp.asarray(np.asarray(mem)), g))
  check_plan(partitioned, mem, g)


def test_uneven_param_fed_back_over_training_steps():
  """A 255-row table on 4 devices comes back replicated (JAX arrays cannot hold uneven shards);
  feeding it back takes this device's rows by a local slice, no communication."""
  mesh = spmd.make_mesh({"x": 4})
  table = np.asarray(np.random.default_rng(0).standard_normal((255, 16)), np.float32)
  ids = np.arange(0, 255, 9, dtype=np.int32)

  def step(table, ids):
    loss, grad = jax.value_and_grad(lambda t: jnp.sum(jnp.tanh(t[ids]) ** 2))(table)
    return table - 0.1 * grad, loss

  g = spmd.partition(step, mesh=mesh, in_specs=(P("x", None), P()), out_specs=(P("x", None), P()))
  got = want = table
  for k in range(3):
    got, loss = g(got, ids)
    want, want_loss = step(want, ids)
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
    if k == 0:
      rows = [r for r in g.plan(got, ids).rows if r.primitive == "input[0]"]
      assert rows and not rows[0].collectives, "a local slice of a replicated array is free"
  np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_structure_mismatch_names_structures_not_arrays(mesh):
  g = spmd.partition(lambda a, b, c: a + b, mesh=mesh, in_specs=(P(), P()))
  with pytest.raises(ValueError) as info:
    g(X, X, X)
  message = str(info.value)
  assert "in_specs is PyTreeDef((*, *)), the arguments are PyTreeDef((*, *, *))" in message
  assert "Array(" not in message and len(message.splitlines()) == 1


def test_keyword_only_arguments_traced_static_and_donated_as_under_jit(mesh):
  def h(x, *, scale, power=2, **extra):
    y = x ** power * scale
    return y + extra["shift"] if "shift" in extra else y

  g = spmd.partition(h, mesh=mesh, in_specs=(P("data"),), static_argnames="power",
                     donate_argnames="scale")
  want = jax.jit(h, static_argnames="power")
  scale = jax.device_put(jnp.full((8, 16), 3.0), NamedSharding(mesh, P("data")))
  out = g(X, scale=scale)
  np.testing.assert_allclose(out, want(X, scale=jnp.full((8, 16), 3.0)), rtol=1e-6)
  assert scale.is_deleted()  # donated by name into the output's buffer, as by jax.jit
  np.testing.assert_allclose(g(X, scale=2.0, power=3), want(X, scale=2.0, power=3), rtol=1e-6)
  np.testing.assert_allclose(g(X, scale=2.0, shift=X), want(X, scale=2.0, shift=X), rtol=1e-6)
  # a committed keyword argument's sharding seeds propagation, as for positional open leaves
  kept = jax.device_put(X, NamedSharding(mesh, P(None, "model")))
  plan = g.plan(X, scale=kept, power=1)
  assert plan.in_specs[1] == P(None, "model") and not plan.collectives
  assert g.lower(X, scale=kept, power=1).compile()(X, kept).shape == X.shape
  grads = jax.grad(lambda s: g(X, scale=s).sum())(2.0)  # through a traced keyword argument
  np.testing.assert_allclose(grads, (X ** 2).sum(), rtol=1e-5)
  with pytest.raises(TypeError, match="hashable"):
    g(X, scale=1.0, power=[2])
  with pytest.raises(ValueError, match=r"static_argnames \[.t.\] are not parameters"):
    spmd.partition(lambda x, *, s: x * s, mesh=mesh, static_argnames="t")
