"""Logical axis names (flax's logical_axis_rules) and what flax users already hold: specs from
nn.get_partition_spec, boxed params passed straight in, nn.with_logical_constraint inside the
model, NamedSharding leaves."""
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import spmd
from spmd.train import optimizer_specs
from helpers import assert_trees_match

RULES = (("batch", "data"), ("embed", None), ("mlp", "model"), ("vocab", "model"))


class MLP(nn.Module):
  hidden: int = 64
  out: int = 16

  @nn.compact
  def __call__(self, x):
    dense = lambda n, names: nn.Dense(  # noqa: E731
        n, kernel_init=nn.with_logical_partitioning(nn.initializers.lecun_normal(), names))
    h = nn.relu(dense(self.hidden, ("embed", "mlp"))(x))
    h = nn.with_logical_constraint(h, ("batch", "mlp"))
    return dense(self.out, ("mlp", "embed"))(h)


@pytest.fixture(scope="module")
def mesh():
  return spmd.make_mesh({"data": 2, "model": 4})


@pytest.fixture(scope="module")
def setup():
  model = MLP()
  x = jnp.asarray(np.random.default_rng(0).standard_normal((8, 32)), jnp.float32)
  variables = model.init(jax.random.key(0), x)
  return model, variables, x


def test_rules_resolve_logical_names_as_flax_does(mesh):
  rules = spmd.logical.AxisRules.of((("batch", "data"), ("embed", "data"), ("embed", "model")),
                                    mesh.axis_names)
  assert rules.resolve(P("batch", "embed"), "x") == P("data", "model")  # "data" taken: next rule
  assert rules.resolve(P("embed", None), "x") == P("data", None)
  assert rules.resolve(P("model", "embed"), "x") == P("model", "data")  # mesh axes stay
  with pytest.raises(ValueError, match="'heads', which is not in the mesh.*rules= has batch"):
    rules.resolve(P("heads"), "in_specs for argument 'x'")


def test_training_step_from_get_partition_spec_and_rules(mesh, setup):
  """A flax model's step with no hand-written specs: nn.get_partition_spec + rules=."""
  model, variables, x = setup
  params = nn.unbox(variables)["params"]
  opt = optax.adamw(1e-2)
  labels = jnp.arange(8) % 16

  def step(params, opt_state, x, labels):
    def loss_fn(p):
      logits = model.apply({"params": p}, x)
      return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

    loss, grads = jax.value_and_grad(loss_fn)(params)
    updates, opt_state = opt.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  param_specs = nn.get_partition_spec(variables)["params"]
  opt_state = opt.init(params)
  opt_specs = optimizer_specs(opt, opt_state, param_specs)
  g = spmd.partition(step, mesh=mesh, rules=RULES,
                     in_specs=(param_specs, opt_specs, P("batch", None), P("batch")))
  plan = g.plan(params, opt_state, x, labels)
  got = g(params, opt_state, x, labels)
  assert_trees_match(got, step(params, opt_state, x, labels), rtol=1e-4, atol=1e-5)
  kernel = plan.in_specs[0]["Dense_0"]["kernel"]
  assert kernel == P(None, "model")
  assert "as P('embed', 'mlp')" in plan.explain(full=True)  # logical names beside mesh axes


def test_annotations_with_logical_names(mesh):
  def fn(x, w):
    return jnp.tanh(spmd.annotate(x @ w, P("batch", "mlp"))).sum(0)

  x, w = jnp.ones((8, 16)), jnp.ones((16, 32))
  g = spmd.partition(fn, mesh=mesh, rules=RULES, in_specs=(P("batch", None), P()))
  plan = g.plan(x, w)
  (row,) = [r for r in plan.rows if r.primitive == "spmd_annotate"]
  assert row.specs == ("P('data', 'model')",)
  assert row.origins[0].endswith("as P('batch', 'mlp')")
  np.testing.assert_allclose(g(x, w), fn(x, w), rtol=1e-5)


def test_boxed_params_passed_straight_in_take_their_names(mesh, setup):
  model, variables, x = setup
  g = spmd.partition(lambda v, x: model.apply(v, x), mesh=mesh, rules=RULES,
                     in_specs=(None, P("batch", None)))
  plan = g.plan(variables, x)
  assert plan.in_specs[0]["params"]["Dense_1"]["kernel"].value == P("model", None)
  np.testing.assert_allclose(g(variables, x), model.apply(variables, x), rtol=1e-5, atol=1e-5)


def test_with_logical_constraint_counts_without_flax_rules_context(mesh, setup):
  """spmd traces under its own rules: the constraint pins the hidden layer as ("batch",
  "mlp") even though the user opened no flax axis_rules context."""
  model, variables, x = setup
  params = nn.unbox(variables)
  g = spmd.partition(model.apply, mesh=mesh, rules=RULES, in_specs=(None, P()))
  plan = g.plan(params, x)
  constrained = [r for r in plan.rows if r.primitive == "sharding_constraint"]
  assert constrained and constrained[0].specs == ("P('data', 'model')",), plan.explain()


def test_named_sharding_leaves(mesh, setup):
  model, variables, x = setup
  params = nn.unbox(variables)
  kernel = NamedSharding(mesh, P(None, "model"))
  specs = {"params": {"Dense_0": {"kernel": kernel, "bias": NamedSharding(mesh, P("model"))},
                      "Dense_1": {"kernel": NamedSharding(mesh, P("model", None)), "bias": None}}}
  g = spmd.partition(model.apply, mesh=mesh, in_specs=(specs, NamedSharding(mesh, P("data"))))
  plan = g.plan(params, x)
  assert plan.in_specs[0]["params"]["Dense_0"]["kernel"] == P(None, "model")
  np.testing.assert_allclose(g(params, x), model.apply(params, x), rtol=1e-5, atol=1e-5)
  other = spmd.make_mesh({"a": 8})
  g = spmd.partition(model.apply, mesh=mesh, in_specs=(None, NamedSharding(other, P("a"))))
  with pytest.raises(ValueError, match="another mesh"):
    g.plan(params, x)


def test_rules_of_the_flax_context_the_call_is_made_in(mesh, setup):
  """Without rules=, logical names resolve by the flax context in effect at the call
  (nn.logical_axis_rules), as under jax.jit: spmd traced under an empty context of its own,
  which hid the user's rules from nn.with_logical_constraint and get_partition_spec inside."""
  model, variables, x = setup
  g = spmd.partition(model.apply, mesh=mesh, in_specs=(None, P("batch", None)))
  with nn.logical_axis_rules(RULES):
    plan = g.plan(variables, x)
    np.testing.assert_allclose(g(variables, x), model.apply(variables, x), rtol=1e-5, atol=1e-5)
  assert plan.in_specs[1] == P("data", None)
  assert plan.in_specs[0]["params"]["Dense_1"]["kernel"].value == P("model", None)
  constrained = [r.specs for r in plan.rows if r.primitive == "sharding_constraint"]
  assert ("P('data', 'model')",) in constrained, plan.explain()  # the hidden layer's
  with nn.logical_axis_rules((("batch", "data"), ("embed", None), ("mlp", None))):
    assert g.plan(variables, x).in_specs[0]["params"]["Dense_1"]["kernel"].value == P(None, None)
  with pytest.raises(ValueError, match="'embed', which is not in the mesh"):
    g.plan(variables, x)  # outside any context: the names have no rule


# --- NNX modules as arguments, as under nnx.jit -------------------------------------------------

def test_nnx_module_spec_given_as_an_nnx_state(mesh):
  """A module's in_specs entry as flax's guide makes it, nnx.get_named_sharding (or
  get_partition_spec) of nnx.state(model): an nnx.State, refused as not matching the module's
  state (a State node inside the joint state, where the joint state holds nested dicts)."""
  from flax import nnx

  model = nnx.Linear(16, 32, rngs=nnx.Rngs(0))
  nnx.update(model, {"kernel": jax.device_put(model.kernel[...],
                                               NamedSharding(mesh, P(None, "model")))})
  specs = nnx.get_named_sharding(nnx.state(model), mesh)
  specs["kernel"] = specs["kernel"].replace(NamedSharding(mesh, P(None, "model")))
  f = spmd.partition(lambda m, x: m(x), mesh=mesh, in_specs=(specs, P("data", None)))
  x = jnp.ones((8, 16))
  np.testing.assert_allclose(f(model, x), model(x), rtol=1e-5, atol=1e-5)
  assert f.plan(model, x).in_specs[0][0]["kernel"].get_value() == P(None, "model")


def test_nnx_modules_updated_in_place_as_under_nnx_jit(mesh):
  from flax import nnx

  class Net(nnx.Module):
    def __init__(self, rngs):
      self.up = nnx.Linear(32, 64, rngs=rngs)
      self.down = nnx.Linear(64, 16, rngs=rngs)

    def __call__(self, x):
      return self.down(nnx.relu(self.up(x)))

  def train_step(model, optimizer, x, labels):
    def loss_fn(model):
      logits = model(x)
      return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return loss

  def make():
    model = Net(nnx.Rngs(0))
    return model, nnx.Optimizer(model, optax.adamw(1e-2), wrt=nnx.Param)

  ours, reference = make(), make()
  step = spmd.partition(train_step, mesh=mesh, in_specs=(None, None, P("data", None), P("data")))
  jitted = nnx.jit(train_step)
  rng = np.random.default_rng(0)
  losses = []
  for _ in range(3):
    x = jnp.asarray(rng.standard_normal((8, 32)), jnp.float32)
    labels = jnp.asarray(rng.integers(0, 16, 8), jnp.int32)
    got, want = step(*ours, x, labels), jitted(*reference, x, labels)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    losses.append(float(got))
  assert losses[-1] < losses[0]  # it trains: the updates were written back
  assert_trees_match(nnx.state(ours[0]), nnx.state(reference[0]), rtol=1e-5, atol=1e-6)
  assert_trees_match(nnx.state(ours[1]), nnx.state(reference[1]), rtol=1e-5, atol=1e-6)
  assert step.plan(*ours, x, labels).in_specs[1] == P("data", None)


@pytest.mark.parametrize("opt", [optax.adamw(1e-3), optax.sgd(0.1, momentum=0.9),
                                 optax.chain(optax.clip_by_global_norm(1.0), optax.lion(1e-3))],
                         ids=["adamw", "momentum", "chain-lion"])
def test_optimizer_specs_follow_their_params(opt):
  params = {"w": jnp.ones((8, 16)), "b": jnp.ones(16)}
  specs = optimizer_specs(opt, opt.init(params), {"w": P(None, "model"), "b": None})
  leaves = jax.tree_util.tree_leaves(specs, is_leaf=lambda x: isinstance(x, P))
  assert P(None, "model") in leaves  # the moments of w (b's stay open: None)
  assert all(s in (P(None, "model"), P()) for s in leaves)  # the rest (counts) replicated


FACTORED_OR_STACKED = {  # optimizers whose state leaves have another rank than their params
    "adafactor": lambda: optax.adafactor(1e-2, min_dim_size_to_factor=4),
    "sm3": lambda: optax.sm3(1e-2),
    "lbfgs": lambda: optax.chain(optax.scale_by_lbfgs(memory_size=3), optax.scale(-1e-2)),
}


@pytest.mark.parametrize("optimizer", FACTORED_OR_STACKED)
def test_nnx_optimizer_state_of_another_rank_than_its_param_is_open(optimizer):
  """flax gives each optimizer state variable its param's names; adafactor's factored moments
  and sm3's (rank 1) and lbfgs's memory (rank 3) of a rank-2 kernel are left open, as nnx.jit
  leaves them (they were refused: a spec of the wrong rank; or the memory's slots split)."""
  from flax import nnx
  from helpers import nnx_steps, randn

  class Net(nnx.Module):
    def __init__(self, rngs: nnx.Rngs):
      self.lin = nnx.Linear(16, 8, rngs=rngs, kernel_init=nnx.with_partitioning(
          nnx.initializers.lecun_normal(), ("data", "model")))

    def __call__(self, x):
      return self.lin(x)

  def fresh():
    with nnx.use_eager_sharding(False):
      model = Net(nnx.Rngs(0))
      return model, nnx.Optimizer(model, FACTORED_OR_STACKED[optimizer](), wrt=nnx.Param)

  def step(model, opt, x, y):
    loss, grads = nnx.value_and_grad(lambda m: jnp.mean((m(x) - y) ** 2))(model)
    opt.update(model, grads)
    return loss

  batches = [(randn(8, 16, seed=s), randn(8, 8, seed=s + 10)) for s in range(3)]
  mesh = spmd.make_mesh({"data": 2, "model": 4})
  plan, _ = nnx_steps(step, fresh, mesh, (None, None, P("data"), P("data")), batches)
  assert plan.in_specs[0][0]["lin"]["kernel"].get_value() == P("data", "model")


def test_linen_train_state_of_boxed_params_with_a_factored_optimizer():
  """optax keeps a boxed param's box around its factored moments (adafactor's v_row, v_col)."""
  class Dense(nn.Module):
    @nn.compact
    def __call__(self, x):
      return nn.Dense(8, kernel_init=nn.with_partitioning(nn.initializers.lecun_normal(),
                                                          (None, "model")))(x)

  from flax.training import train_state
  model, x = Dense(), np.random.default_rng(0).standard_normal((8, 16)).astype(np.float32)
  state = train_state.TrainState.create(
      apply_fn=model.apply, params=model.init(jax.random.key(0), x)["params"],
      tx=optax.adafactor(1e-2, min_dim_size_to_factor=4))

  def step(state, x):
    loss, grads = jax.value_and_grad(
        lambda p: jnp.mean(state.apply_fn({"params": p}, x) ** 2))(state.params)
    return state.apply_gradients(grads=grads), loss

  mesh = spmd.make_mesh({"data": 2, "model": 4})
  partitioned = spmd.partition(step, mesh=mesh, in_specs=(None, P("data")))
  got, want = state, state
  for _ in range(3):
    got, want = partitioned(got, x), jax.jit(step)(want, x)
    assert_trees_match(got, want)
    got, want = got[0], want[0]
