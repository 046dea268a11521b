"""flax's documentation guides, a third round of flax patterns run through spmd.partition as their
users write them: the NNX "Scale up on multiple devices" guide (a sharded model created by a
function of no arguments, logical names under a rules context, NamedShardings from
``nnx.get_named_sharding``, eager sharding under ``jax.set_mesh``, the optimizer's state sharded
otherwise than the params), NNX transforms inside the step (remat, scan with split rngs, vmap
ensembles, cond / switch, fori_loop / while_loop, LoRA through ``DiffState``, train and eval
modes), the NNX / linen bridge, optax around the model (clipping, schedules, gradient
accumulation, masked weight decay, EMA), and linen's lifted transforms (vmap ensembles, scan over
remat'd blocks with dropout, share_scope, pmap-style BatchNorm, boxed params with mesh
shardings); on the 2x4, 8x1 and 1x8 ("data", "model") meshes, uneven sizes included. Each is
compared step by step with nnx.jit / jax.jit of the same step, then its plan with the compiled
program (helpers.train_loop / check_plan)."""
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import spmd
from helpers import assert_trees_match, check_plan, mesh_of, nnx_steps, randn, train_loop


# --- the NNX "Scale up on multiple devices" guide ----------------------------------------------

class DotReluDot(nnx.Module):
  """The guide's model: a column-split then a row-split kernel (mesh axes, or logical names)."""

  def __init__(self, depth: int, names: tuple, rngs: nnx.Rngs):
    init = nnx.initializers.lecun_normal()
    embed, hidden = names
    self.dot1 = nnx.Linear(depth, depth, use_bias=False, rngs=rngs,
                           kernel_init=nnx.with_partitioning(init, (embed, hidden)))
    self.w2 = nnx.Param(init(rngs.params(), (depth, depth)), out_sharding=(hidden, embed))

  def __call__(self, x):
    y = nnx.relu(self.dot1(x))
    return jnp.dot(y, self.w2[...])


def guide_train_step(model, optimizer, x, y):
  def loss_fn(model):
    return jnp.mean((model(x) - y) ** 2)

  loss, grads = nnx.value_and_grad(loss_fn)(model)
  optimizer.update(model, grads)
  return loss


GUIDE_RULES = (("batch", "data"), ("hidden", "model"), ("embed", None))


@pytest.mark.parametrize("mesh,names,batch", [("2x4", (None, "model"), 8),
                                              ("1x8", ("embed", "hidden"), 6)])
def test_nnx_guide_create_sharded_model_then_train(mesh, names, batch):
  """The guide's ``create_sharded_model()``: no arguments, the state constrained to
  ``nnx.get_partition_spec(state)`` (resolved by flax under ``nnx.logical_axis_rules`` where
  the names are logical) and ``nnx.update``d into the model, returned. Then its steps with in_specs
  from ``nnx.get_named_sharding``."""
  mesh = mesh_of(mesh)
  rules = GUIDE_RULES if names[0] == "embed" else ()

  def create_sharded_model():
    model = DotReluDot(16, names, nnx.Rngs(0))
    state = nnx.state(model)
    pspecs = nnx.get_partition_spec(state)
    sharded_state = jax.lax.with_sharding_constraint(state, pspecs)
    nnx.update(model, sharded_state)
    return model

  with nnx.use_eager_sharding(False), nnx.logical_axis_rules(rules):
    model = spmd.partition(create_sharded_model, mesh=mesh)()
    with jax.set_mesh(mesh):
      reference = nnx.jit(create_sharded_model)()
    state_sharding = nnx.get_named_sharding(nnx.state(model), mesh)
  for got, want, spec in [(model.dot1.kernel, reference.dot1.kernel, P(None, "model")),
                          (model.w2, reference.w2, P("model", None))]:
    assert got[...].sharding.is_equivalent_to(NamedSharding(mesh, spec), 2)
    assert got[...].sharding.spec == want[...].sharding.spec  # as jax.jit spells it
  assert_trees_match(nnx.state(model), nnx.state(reference))

  step = spmd.partition(guide_train_step, mesh=mesh,
                        in_specs=(state_sharding, None, P("data"), P("data")))
  jitted = nnx.jit(guide_train_step)
  optimizer = nnx.Optimizer(model, optax.adamw(1e-2), wrt=nnx.Param)
  with jax.set_mesh(mesh):
    ref_optimizer = nnx.Optimizer(reference, optax.adamw(1e-2), wrt=nnx.Param)
  with nnx.logical_axis_rules(rules):  # the moments' logical names resolve as the params' did
    for s in range(3):
      x, y = randn(batch, 16, seed=s), randn(batch, 16, seed=s + 10)
      with jax.set_mesh(mesh):
        want = jitted(reference, ref_optimizer, x, y)
      assert_trees_match(step(model, optimizer, x, y), want, rtol=1e-5, atol=1e-6)
    plan = check_plan(step, model, optimizer, x, y)
  assert_trees_match(nnx.state(model), nnx.state(reference), rtol=1e-5, atol=1e-6)
  # Megatron: the row-split kernel's output all-reduced over "model", forward; the gradients'
  # partial sums over "data"
  assert {c.axes for c in plan.collectives} <= {("model",), ("data",)}


def test_nnx_guide_eager_sharding_under_set_mesh():
  """The guide's current form: the model and optimizer created under ``jax.set_mesh`` (flax
  shards each variable as its metadata says, eagerly); the step's in_specs left open take the
  committed shardings, as jax.jit does."""
  mesh = mesh_of("2x4")

  def fresh():
    with jax.set_mesh(mesh):
      model = DotReluDot(16, (None, "model"), nnx.Rngs(0))
      return model, nnx.Optimizer(model, optax.adamw(1e-2), wrt=nnx.Param)

  batches = [(randn(8, 16, seed=s), randn(8, 16, seed=s + 10)) for s in range(2)]
  plan, _ = nnx_steps(guide_train_step, fresh, mesh, (None, None, P("data"), P("data")), batches,
                      rtol=1e-5, atol=1e-6)
  specs = plan.in_specs[0]
  assert specs[0]["w2"].get_value() == P("model", None)
  assert specs[1]["opt_state"][0]["mu"]["dot1"]["kernel"].get_value() == P(None, "model")


# --- NNX transforms inside the step: scan with split rngs over remat'd blocks, train and eval ----

class DropoutBlock(nnx.Module):
  def __init__(self, dim: int, rngs: nnx.Rngs):
    # no bias before the norm (its gradient is zero but for rounding, which Adam would scale up)
    self.linear = nnx.Linear(dim, dim, use_bias=False, rngs=rngs)
    self.norm = nnx.BatchNorm(dim, momentum=0.9, rngs=rngs)
    self.dropout = nnx.Dropout(0.2, rngs=rngs)

  def __call__(self, x):
    return x + self.dropout(nnx.gelu(self.norm(self.linear(x))))


class ScannedDropoutNet(nnx.Module):
  """The NNX transforms guide's stacked layers: created by ``nnx.vmap`` under ``split_rngs``,
  applied by ``nnx.scan`` with the carry, each layer ``nnx.remat``'d, its dropout drawing from
  the layer's own rng stream (split at creation, stacked); BatchNorm's statistics stacked per
  layer."""

  def __init__(self, layers: int, dim: int, rngs: nnx.Rngs):
    @nnx.split_rngs(splits=layers)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def create(rngs):
      return DropoutBlock(dim, rngs)

    self.blocks = create(rngs)
    self.head = nnx.Linear(dim, 3, rngs=rngs)

  def __call__(self, x):
    @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
    def forward(x, block):
      return nnx.remat(lambda block, x: block(x))(block, x)

    return self.head(forward(x, self.blocks))


def classify_step(model, optimizer, x, labels):
  def loss_fn(model):
    logits = model(x)
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean(), logits

  (loss, logits), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model)
  optimizer.update(model, grads)
  return loss, logits


def evaluate(model, x):
  return model(x)


@pytest.mark.parametrize("mesh,batch", [("8x1", 6)])
def test_nnx_scan_remat_split_rngs_dropout_train_then_eval(mesh, batch):
  """Train mode (dropout masks from the split streams, batch statistics), then
  ``model.eval()``: dropout off, BatchNorm on its running averages, each example alone."""
  def fresh():
    model = ScannedDropoutNet(3, 16, nnx.Rngs(0))
    return model, nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)

  mesh = mesh_of(mesh)
  batches = [(randn(batch, 16, seed=s), jnp.arange(batch) % 3) for s in range(3)]
  plan, (model, _) = nnx_steps(classify_step, fresh, mesh, (None, None, P("data"), P("data")),
                               batches)
  assert {c.axes for c in plan.collectives} == {("data",)}  # gradients, statistics, the loss
  model.eval()
  x = randn(batch, 16, seed=7)
  evaluate_partitioned = spmd.partition(evaluate, mesh=mesh, in_specs=(None, P("data")))
  want = nnx.jit(evaluate)(model, x)
  assert_trees_match(evaluate_partitioned(model, x), want, rtol=1e-4, atol=1e-5)
  # each example alone: nothing moves but an uneven batch's logits, returned whole
  assert {c.source for c in check_plan(evaluate_partitioned, model, x).collectives} <= {
      "out_specs"}


# --- nnx.vmap ensembles over StateAxes, nnx.cond / nnx.switch, nnx.fori_loop / while_loop ------

class Ensemble(nnx.Module):
  """The transforms guide's ensemble: members created by ``nnx.vmap`` over split rngs, run by
  ``nnx.vmap`` with ``in_axes=(StateAxes({nnx.Param: 0, ...: None}), None)``; a refinement
  picked by ``nnx.switch`` on a traced index, and one applied ``nnx.fori_loop`` times; a gate
  by ``nnx.cond``."""

  def __init__(self, members: int, dim: int, rngs: nnx.Rngs):
    @nnx.split_rngs(splits=members)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def create(rngs):
      return nnx.Linear(dim, dim, rngs=rngs)

    self.members = create(rngs)
    self.refine = nnx.List([nnx.Linear(dim, dim, rngs=rngs) for _ in range(3)])
    self.scale = nnx.Param(jnp.ones((dim,)))

  def __call__(self, x, choice):
    axes = nnx.StateAxes({nnx.Param: 0, ...: None})

    @nnx.vmap(in_axes=(axes, None), out_axes=0)
    def members(member, x):
      return member(x)

    y = jnp.mean(members(self.members, x), axis=0)
    branches = [lambda m, y, k=k: nnx.tanh(m.refine[k](y)) for k in range(3)]
    y = nnx.switch(choice, branches, self, y)

    def twice(i, carry):
      model, y = carry
      return model, y + 0.5 * model.refine[0](y)

    _, y = nnx.fori_loop(0, 2, twice, (self, y))
    return nnx.cond(jnp.mean(y) > 0, lambda m, y: y * m.scale[...], lambda m, y: -y, self, y)


def ensemble_refined(model, x, choice):
  """Inference: the ensemble's output halved by ``nnx.while_loop`` until within bounds."""
  def halve(carry):
    model, y = carry
    return model, y * 0.5 * model.scale[...]

  _, y = nnx.while_loop(lambda carry: jnp.max(jnp.abs(carry[1])) > 0.5, halve,
                        (model, model(x, choice)))
  return y


def ensemble_step(model, optimizer, x, y, choice):
  loss, grads = nnx.value_and_grad(lambda m: jnp.mean((m(x, choice) - y) ** 2))(model)
  optimizer.update(model, grads)
  return loss


@pytest.mark.parametrize("mesh,batch", [("1x8", 8)])
def test_nnx_vmap_ensemble_switch_cond_and_loops(mesh, batch):
  def fresh():
    model = Ensemble(4, 16, nnx.Rngs(0))
    return model, nnx.Optimizer(model, optax.sgd(0.1, momentum=0.9), wrt=nnx.Param)

  mesh = mesh_of(mesh)
  batches = [(randn(batch, 16, seed=s), 3 * randn(batch, 16, seed=s + 10), jnp.int32(s))
             for s in range(3)]
  _, (model, _) = nnx_steps(ensemble_step, fresh, mesh, (None, None, P("data"), P("data"), P()),
                            batches)
  x, choice = 4 * randn(batch, 16, seed=5), jnp.int32(1)
  want = nnx.jit(ensemble_refined)(model, x, choice)
  assert float(jnp.max(jnp.abs(nnx.jit(Ensemble.__call__)(model, x, choice)))) > 1.0
  refined = spmd.partition(ensemble_refined, mesh=mesh, in_specs=(None, P("data"), P()))
  assert_trees_match(refined(model, x, choice), want, rtol=1e-4, atol=1e-5)
  check_plan(refined, model, x, choice)


# --- LoRA (flax's LoRA guide): only the nnx.LoRAParam variables trained, through DiffState -------

class LoraMLP(nnx.Module):
  def __init__(self, rngs: nnx.Rngs):
    self.up = nnx.LoRALinear(16, 32, lora_rank=2, rngs=rngs)
    self.down = nnx.LoRALinear(32, 16, lora_rank=2, rngs=rngs)

  def __call__(self, x):
    return self.down(nnx.relu(self.up(x)))


def lora_step(model, optimizer, x, y):
  def loss_fn(model):
    prediction = model(x)
    return jnp.mean((prediction - y) ** 2), prediction

  grad_fn = nnx.value_and_grad(loss_fn, argnums=nnx.DiffState(0, nnx.LoRAParam), has_aux=True)
  (loss, _), grads = grad_fn(model)
  optimizer.update(model, grads)
  return loss


@pytest.mark.parametrize("mesh,batch", [("2x4", 6)])
def test_nnx_lora_trains_only_lora_params(mesh, batch):
  def fresh():
    model = LoraMLP(nnx.Rngs(0))
    return model, nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.LoRAParam)

  batches = [(randn(batch, 16, seed=s), randn(batch, 16, seed=s + 10)) for s in range(3)]
  _, (model, _) = nnx_steps(lora_step, fresh, mesh_of(mesh), (None, None, P("data"), P("data")),
                            batches)
  frozen = nnx.All(nnx.Param, nnx.Not(nnx.LoRAParam))
  assert_trees_match(nnx.state(model, frozen), nnx.state(LoraMLP(nnx.Rngs(0)), frozen))


# --- linen BatchNorm written for pmap: axis_name= under spmd.partition ----------------------------

class PmapStyleNet(nn.Module):
  """A classifier whose BatchNorm averages its statistics over ``axis_name`` devices (pmap)."""
  axis_name: str | None = None

  @nn.compact
  def __call__(self, x):
    x = nn.Dense(16, use_bias=False)(x)
    x = nn.BatchNorm(use_running_average=False, momentum=0.9, axis_name=self.axis_name)(x)
    return nn.Dense(3)(nn.relu(x))


def batchnorm_step(model, params, batch_stats, x, labels):
  """A plain SGD step; with ``model.axis_name`` the pmap form, its gradients pmean'd."""
  def loss_fn(params):
    logits, updates = model.apply({"params": params, "batch_stats": batch_stats}, x,
                                  mutable=["batch_stats"])
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
    return loss, updates["batch_stats"]

  (loss, batch_stats), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
  if model.axis_name:
    grads, loss = jax.lax.pmean((grads, loss), model.axis_name)
  params = jax.tree.map(lambda p, g: p - 0.1 * g, params, grads)
  return params, batch_stats, loss


def test_linen_batchnorm_axis_name_written_for_pmap():
  """What a user porting a pmap step expects. spmd.partition takes the function as written for
  one device, which sees the whole batch: there ``axis_name="data"`` names no devices (as under
  jax.jit), and the error says so and what to do. Without it, BatchNorm's statistics are the
  whole batch's: the pmap step's values (its per-device statistics and gradients pmean'd), here
  emulated by jax.vmap over the devices' batches. Kept, the pmap step runs as written inside a
  jax.shard_map over the mesh."""
  mesh, x, labels = mesh_of("2x4"), randn(8, 12), jnp.arange(8) % 3
  variables = jax.jit(PmapStyleNet().init)(jax.random.key(0), x)
  state = (variables["params"], variables["batch_stats"])
  pmap_style = functools.partial(batchnorm_step, PmapStyleNet("data"))
  with pytest.raises(NameError, match="outside a jax.shard_map.*drop the axis name"):
    spmd.partition(pmap_style, mesh=mesh, in_specs=(None, None, P("data"), P("data")))(
        *state, x, labels)

  def devices(step):  # pmap over the 2 "data" devices, as jax.vmap
    def run(params, batch_stats, x, labels):
      out = jax.vmap(step, in_axes=(None, None, 0, 0), axis_name="data")(
          params, batch_stats, x.reshape(2, -1, *x.shape[1:]), labels.reshape(2, -1))
      return jax.tree.map(lambda leaf: leaf[0], out)
    return run

  batches = [(randn(8, 12, seed=s), labels) for s in range(3)]
  whole_batch = functools.partial(batchnorm_step, PmapStyleNet())
  train_loop(jax.jit(devices(pmap_style)),
             spmd.partition(whole_batch, mesh=mesh, in_specs=(None, None, P("data"), P("data"))),
             state, batches, rtol=1e-4, atol=1e-5)
  # check_vma=False: pmap's semantics (with it, JAX sums the gradients of the replicated params
  # over the devices itself, and the step's own pmean would count them twice)
  in_shard_map = jax.shard_map(pmap_style, mesh=mesh, in_specs=(P(), P(), P("data"), P("data")),
                               out_specs=P(), check_vma=False)
  train_loop(jax.jit(devices(pmap_style)),
             spmd.partition(in_shard_map, mesh=mesh, in_specs=(None, None, P("data"), P("data"))),
             state, batches, rtol=1e-4, atol=1e-5)


# --- flax.nnx.bridge: a linen module inside an NNX model, an NNX module inside a linen model ------

class LinenEncoder(nn.Module):
  @nn.compact
  def __call__(self, x, train: bool):
    x = nn.Dense(32)(x)
    x = nn.Dropout(0.1, deterministic=not train)(nn.relu(x))
    return nn.LayerNorm()(x)


class BridgedClassifier(nnx.Module):
  """``nnx.bridge.ToNNX``: a linen encoder as an NNX submodule, initialised lazily."""

  def __init__(self, x, rngs: nnx.Rngs):
    self.encoder = nnx.bridge.ToNNX(LinenEncoder(), rngs=rngs)
    nnx.bridge.lazy_init(self.encoder, x, train=False)
    self.head = nnx.Linear(32, 3, rngs=rngs)

  def __call__(self, x):
    return self.head(self.encoder(x, train=True))


def test_nnx_bridge_to_nnx_linen_encoder_trained():
  x = randn(8, 12)

  def fresh():
    model = BridgedClassifier(x, nnx.Rngs(params=0, dropout=1))
    return model, nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)

  batches = [(randn(8, 12, seed=s), jnp.arange(8) % 3) for s in range(3)]
  plan, _ = nnx_steps(classify_step, fresh, mesh_of("2x4"), (None, None, P("data"), P("data")),
                      batches)
  assert {c.axes for c in plan.collectives} == {("data",)}


class NnxGatedUnit(nnx.Module):
  def __init__(self, din: int, dout: int, *, rngs: nnx.Rngs):
    self.gate = nnx.Linear(din, dout, rngs=rngs)
    self.value = nnx.Linear(din, dout, rngs=rngs)

  def __call__(self, x):
    return nnx.sigmoid(self.gate(x)) * self.value(x)


class LinenWithNnx(nn.Module):
  """``nnx.bridge.to_linen``: an NNX module as a linen submodule."""

  @nn.compact
  def __call__(self, x):
    x = nnx.bridge.to_linen(NnxGatedUnit, 12, 24)(x)
    return nn.Dense(3)(x)


def test_linen_bridge_to_linen_nnx_unit_trained():
  """On 1x8 with 6 examples: the batch stays whole, the hidden units split over "model"."""
  model, tx = LinenWithNnx(), optax.adamw(1e-2)
  x = randn(6, 12)
  params = jax.jit(model.init)(jax.random.key(0), x)["params"]

  def step(params, opt_state, x, labels):
    def loss_fn(params):
      logits = model.apply({"params": params}, x)
      return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

    loss, grads = jax.value_and_grad(loss_fn)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  batches = [(randn(6, 12, seed=s), jnp.arange(6) % 3) for s in range(3)]
  train_loop(jax.jit(step), spmd.partition(step, mesh=mesh_of("1x8"),
                                           in_specs=(None, None, P("data"), P("data"))),
             (params, tx.init(params)), batches, rtol=1e-4, atol=1e-5)


# --- optax around the model (flax's optimization cookbook): clipping, a schedule, weight decay on
# kernels only, gradient accumulation, an EMA of the params ---------------------------------------

class Regressor(nn.Module):
  @nn.compact
  def __call__(self, x):
    x = nn.gelu(nn.Dense(32)(x))
    return nn.Dense(4)(nn.LayerNorm()(x))


def cookbook_optimizer() -> optax.GradientTransformation:
  """Clip by global norm, AdamW on a warmup-cosine schedule whose weight decay reaches the kernels
  only (``optax.multi_transform``; biases and norms by plain Adam), gradients accumulated over 2
  steps (``optax.MultiSteps``)."""
  schedule = optax.warmup_cosine_decay_schedule(0.0, 1e-2, warmup_steps=2, decay_steps=8)
  labels = lambda params: jax.tree_util.tree_map_with_path(  # noqa: E731
      lambda path, _: "decay" if path[-1].key == "kernel" else "plain", params)
  inner = optax.chain(optax.clip_by_global_norm(0.5), optax.multi_transform(
      {"decay": optax.adamw(schedule, weight_decay=0.1), "plain": optax.adam(schedule)}, labels))
  return optax.MultiSteps(inner, every_k_schedule=2)


@pytest.mark.parametrize("mesh,batch", [("8x1", 6)])
def test_optax_cookbook_chain_schedule_masked_decay_accumulation_and_ema(mesh, batch):
  model, tx, ema = Regressor(), cookbook_optimizer(), optax.ema(0.9)
  x = randn(batch, 12)
  params = jax.jit(model.init)(jax.random.key(0), x)["params"]

  def step(params, opt_state, ema_state, x, y):
    loss, grads = jax.value_and_grad(
        lambda p: jnp.mean((model.apply({"params": p}, x) - y) ** 2))(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    params = optax.apply_updates(params, updates)
    _, ema_state = ema.update(params, ema_state)
    return params, opt_state, ema_state, loss

  batches = [(randn(batch, 12, seed=s), randn(batch, 4, seed=s + 10)) for s in range(4)]
  state = (params, tx.init(params), ema.init(params))
  plan = train_loop(jax.jit(step), spmd.partition(
      step, mesh=mesh_of(mesh), in_specs=(None, None, None, P("data"), P("data"))),
      state, batches, rtol=1e-4, atol=1e-5)
  assert {c.axes for c in plan.collectives} == {("data",)}


# --- linen lifted transforms: an nn.vmap ensemble, nn.scan over nn.remat'd layers with dropout,
# nn.share_scope; boxed params (nn.Partitioned, logical names) placed by logical_to_mesh_sharding --

# "model": nn.Partitioned's mesh-axis names go through logical_to_mesh_sharding as logical names
# (flax leaves a name without a rule unsharded)
LIFTED_RULES = (("batch", "data"), ("mlp", "model"), ("embed", None), ("layers", None),
                ("members", None), ("model", "model"))


class ScanLayer(nn.Module):
  train: bool

  @nn.compact
  def __call__(self, x, _):
    init = nn.with_logical_partitioning(nn.initializers.lecun_normal(), ("embed", "mlp"))
    h = nn.relu(nn.Dense(32, kernel_init=init)(x))
    h = nn.with_logical_constraint(h, ("batch", "mlp"))
    h = nn.Dropout(0.1, deterministic=not self.train)(h)
    out = nn.with_logical_partitioning(nn.initializers.lecun_normal(), ("mlp", "embed"))
    return x + nn.Dense(16, kernel_init=out)(h), None


class Member(nn.Module):
  @nn.compact
  def __call__(self, x):
    kernel = nn.with_partitioning(nn.initializers.lecun_normal(), (None, "model"))
    return nn.tanh(nn.Dense(8, kernel_init=kernel)(x))


class Trunk(nn.Module):
  """Its params live in its parent's scope (``nn.share_scope``)."""

  def setup(self):
    self.stem = nn.Dense(16)

  def __call__(self, x):
    return self.stem(x)


class LiftedNet(nn.Module):
  train: bool = True

  def setup(self):
    self.trunk = Trunk()
    nn.share_scope(self, self.trunk)
    self.layers = nn.scan(nn.remat(ScanLayer), variable_axes={"params": 0},
                          split_rngs={"params": True, "dropout": True}, length=3,
                          metadata_params={nn.PARTITION_NAME: "layers"})(self.train)
    self.ensemble = nn.vmap(Member, variable_axes={"params": 0}, split_rngs={"params": True},
                            in_axes=None, axis_size=4,
                            metadata_params={nn.PARTITION_NAME: "members"})()
    self.head = nn.Dense(3)

  def __call__(self, x):
    x, _ = self.layers(self.trunk(x), None)
    return self.head(jnp.mean(self.ensemble(x), axis=0))


def test_linen_lifted_transforms_boxed_params_logical_to_mesh_sharding():
  """in_specs are NamedShardings from ``nn.logical_to_mesh_sharding(nn.get_partition_spec(...))``
  (no rules= to spmd); the step runs in the user's ``nn.logical_axis_rules`` context, which
  resolves the activations' ``with_logical_constraint``, as it does for jax.jit."""
  model, tx, mesh = LiftedNet(), optax.adam(1e-2), mesh_of("2x4")
  x = randn(8, 12)
  variables = jax.jit(LiftedNet(train=False).init)(jax.random.key(0), x)
  assert variables["params"]["stem"]["kernel"].shape == (12, 16)  # shared scope: no "trunk"
  param_shardings = nn.logical_to_mesh_sharding(nn.get_partition_spec(variables), mesh,
                                                LIFTED_RULES)["params"]
  params = nn.unbox(variables)["params"]

  def step(params, opt_state, x, labels, key):
    def loss_fn(params):
      logits = model.apply({"params": params}, x, rngs={"dropout": key})
      return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

    loss, grads = jax.value_and_grad(loss_fn)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  batches = [(randn(8, 12, seed=s), jnp.arange(8) % 3, k)
             for s, k in enumerate(jax.random.split(jax.random.key(1), 3))]
  partitioned = spmd.partition(step, mesh=mesh,
                               in_specs=(param_shardings, None, P("data"), P("data"), P()))
  with nn.logical_axis_rules(LIFTED_RULES):
    plan = train_loop(jax.jit(step), partitioned, (params, tx.init(params)), batches, rtol=1e-4,
                      atol=1e-5)
  layer = plan.in_specs[0]["layers"]["Dense_0"]["kernel"]
  assert layer == P(None, None, "model")
  assert plan.in_specs[0]["ensemble"]["Dense_0"]["kernel"] == P(None, None, "model")
  assert plan.in_specs[1][0].mu["layers"]["Dense_0"]["kernel"] == layer  # the moments follow


# --- the optimizer's state sharded otherwise than the params (flax's guide): ZeRO-1 ------------------

def test_nnx_optimizer_state_sharded_otherwise_than_params():
  """Params replicated, Adam's moments split over "data" along their first dim (an nnx.State of
  specs for the optimizer, ZeRO-1)."""
  mesh = mesh_of("8x1")

  def fresh():
    with nnx.use_eager_sharding(False):
      model = DotReluDot(16, (None, None), nnx.Rngs(0))
      return model, nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)

  model, optimizer = fresh()
  model_specs = jax.tree.map(lambda _: P(), nnx.state(model))
  opt_specs = jax.tree.map(lambda x: P("data") if x.ndim else P(), nnx.state(optimizer))
  batches = [(randn(8, 16, seed=s), randn(8, 16, seed=s + 10)) for s in range(2)]
  plan, _ = nnx_steps(guide_train_step, fresh, mesh, (model_specs, opt_specs, P("data"),
                                                      P("data")), batches, rtol=1e-5, atol=1e-6)
  assert plan.in_specs[0][1]["opt_state"][0]["mu"]["w2"].get_value() == P("data", None)
  # no gradient is all-reduced (the loss only): each device computes its moments' rows of the
  # gradient (here from the output gradients gathered and the inputs all-to-all'd, 576 B a
  # kernel, where a reduce-scatter of the partial sums would move 1 KiB), and the update is
  # gathered into the replicated params
  assert plan.bytes_by_kind()["all-reduce"] == 4, plan.explain()
  updates = [c for c in plan.collectives if "apply_updates" in c.source]
  assert {(c.kind, c.bytes) for c in updates} == {("all-gather", 1024)}, plan.explain()
