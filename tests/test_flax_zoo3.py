"""flax's and optax's own examples, a seventh round, small and written as their users write them,
run through spmd.partition on the ("data", "model") meshes: optax optimizers whose update
reduces over or multiplies 2-D sharded kernels (adafactor's factored moments, muon's
Newton-Schulz iterations, lamb's trust ratio under inject_hyperparams, a global-norm clip,
apply_if_finite), NNX's functional API (``nnx.split`` into plain states with in_specs from
``nnx.get_partition_spec``, ``nnx.merge`` in the step; InstanceNorm, BatchNorm in train and eval
mode, an ``nnx.Dict`` of heads), and linen's ``nn.remat_scan`` beside an ``nn.vmap`` ensemble of
logically partitioned params with ``spmd_axis_name``.
Each is checked against the jitted unpartitioned step over two steps, the state fed back, then
its plan against the compiled program (helpers.train_loop)."""
import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
import optax.contrib
from flax import nnx
from jax.sharding import PartitionSpec as P

import spmd
from helpers import mesh_of, randn, train_loop


# --- optax optimizers on an MLP whose kernels are split over both mesh axes ----------------------

class MLP(nn.Module):
  @nn.compact
  def __call__(self, x):
    x = nn.gelu(nn.Dense(16, name="up")(x))
    x = nn.gelu(nn.Dense(16, name="mid")(x))
    return nn.Dense(8, name="down")(x)


MLP_SPECS = {"up": {"kernel": P("data", "model"), "bias": P("model")},
             "mid": {"kernel": P("model", "data"), "bias": P()},
             "down": {"kernel": P("data", "model"), "bias": P()}}


def test_optax_optimizers_on_2d_sharded_kernels():
  """One optimizer per layer, each reducing over or multiplying a kernel split over both mesh
  axes: adafactor's factored second moments (a row and a column mean of the squared gradient),
  muon's Newton-Schulz iterations (X X^T X products in a fully unrolled loop; adam on its bias),
  lamb's trust ratio (||param|| / ||update||) with its learning rate injected as state; the
  global-norm clip sums every sharded gradient, and apply_if_finite checks them all."""
  per_layer = {"up": "factored", "mid": "orthogonal", "down": "trust"}
  tx = optax.apply_if_finite(optax.chain(
      optax.clip_by_global_norm(0.05),
      optax.multi_transform(
          {"factored": optax.adafactor(1e-2, min_dim_size_to_factor=4),
           "orthogonal": optax.contrib.muon(1e-2, ns_steps=2),
           "trust": optax.inject_hyperparams(optax.lamb)(
               learning_rate=optax.linear_schedule(1e-2, 0, 4), weight_decay=1e-3)},
          {name: {"kernel": label, "bias": label} for name, label in per_layer.items()})),
      max_consecutive_errors=2)

  def step(params, opt_state, x, y):
    def loss_fn(params):
      return jnp.mean((MLP().apply({"params": params}, x) - y) ** 2)

    loss, grads = jax.value_and_grad(loss_fn)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  params = jax.jit(MLP().init)(jax.random.key(0), randn(8, 8))["params"]
  in_specs = (MLP_SPECS, None, P("data"), P("data"))
  batches = [(randn(8, 8, seed=s), randn(8, 8, seed=10 + s)) for s in range(2)]
  plan = train_loop(jax.jit(step), spmd.partition(step, mesh=mesh_of("2x4"), in_specs=in_specs),
                    (params, tx.init(params)), batches, rtol=1e-4, atol=1e-5)
  # muon's two unrolled Newton-Schulz steps: each step's collectives listed once per copy
  ns = [c for c in plan.collectives if "_base_newton_schulz_iteration" in c.source]
  assert ns and len(ns) % 2 == 0 and all(c.trips == 1 for c in ns), plan.explain()


# --- NNX's functional API: nnx.split into plain states, nnx.merge inside a jax-style step --------

class ConvHeads(nnx.Module):
  """A conv net with a partitioned kernel, each image normalized by InstanceNorm, BatchNorm,
  dropout, and an nnx.Dict of two heads."""

  def __init__(self, rngs: nnx.Rngs):
    shard = lambda *names: nnx.with_partitioning(nnx.initializers.lecun_normal(), names)  # noqa: E731
    self.instance_norm = nnx.InstanceNorm(3, rngs=rngs)
    self.conv = nnx.Conv(3, 8, (3, 3), use_bias=False,  # BatchNorm would cancel a bias
                         kernel_init=shard(None, None, None, "model"), rngs=rngs)
    self.batch_norm = nnx.BatchNorm(8, momentum=0.9, rngs=rngs)
    self.dropout = nnx.Dropout(0.25, rngs=rngs)
    self.heads = nnx.Dict(
        label=nnx.Linear(8, 4, kernel_init=shard("model", None), rngs=rngs),
        box=nnx.Linear(8, 2, kernel_init=shard("model", None), rngs=rngs))

  def __call__(self, x):
    x = nnx.relu(self.batch_norm(self.conv(self.instance_norm(x))))
    x = self.dropout(jnp.mean(x, axis=(1, 2)))
    return {name: head(x) for name, head in self.heads.items()}


def test_nnx_functional_split_merge_step_with_specs_from_metadata():
  """The NNX basics guide's functional form: ``graphdef, params, rest = nnx.split(model,
  nnx.Param, ...)`` passed to a ``jax.jit``-style step as plain states (params' in_specs from
  ``nnx.get_partition_spec``), ``nnx.merge`` at its start and ``nnx.split`` at its end;
  BatchNorm's statistics and the dropout key's count come back in ``rest``; the updated model
  also scores the batch in ``eval()`` mode (running statistics, no dropout). (``nnx.merge``
  inside a ``jax.grad``ed loss cannot update BatchNorm's statistics: flax's TraceContextError.)"""
  with nnx.use_eager_sharding(False):  # the names stay metadata, read into in_specs below
    model = nnx.jit(lambda: ConvHeads(nnx.Rngs(0, dropout=1)))()  # as flax's guides create it
  graphdef, params, rest = nnx.split(model, nnx.Param, ...)
  tx = optax.sgd(0.1, momentum=0.9)

  def step(params, rest, opt_state, images, labels, boxes):
    model = nnx.merge(graphdef, params, rest)

    def loss_fn(model):
      out = model(images)
      return (optax.softmax_cross_entropy_with_integer_labels(out["label"], labels).mean()
              + jnp.mean((out["box"] - boxes) ** 2))

    loss, grads = nnx.value_and_grad(loss_fn)(model)
    updates, opt_state = tx.update(grads, opt_state, params)
    nnx.update(model, optax.apply_updates(params, updates))
    model.eval()
    scores = model(images)["label"]
    model.train()
    _, params, rest = nnx.split(model, nnx.Param, ...)
    return params, rest, opt_state, (loss, scores)

  param_specs = nnx.get_partition_spec(params)
  assert param_specs["conv"]["kernel"].get_value() == P(None, None, None, "model")
  in_specs = (param_specs, None, None, P("data"), P("data"), P("data"))
  batches = [(randn(8, 6, 6, 3, seed=s), jnp.arange(8) % 4, randn(8, 2, seed=5 + s))
             for s in range(2)]
  train_loop(jax.jit(step), spmd.partition(step, mesh=mesh_of("2x4"), in_specs=in_specs),
             (params, rest, tx.init(params)), batches, rtol=1e-4, atol=1e-5)


# --- linen: logically partitioned params through nn.remat_scan and an nn.vmap ensemble ----------

RULES = (("batch", "data"), ("mlp", "model"), ("member", "model"), ("embed", None),
         ("hidden", None))


def logical(*names):
  return nn.with_logical_partitioning(nn.initializers.lecun_normal(), names)


class ScanBlock(nn.Module):
  """A residual MLP block: the carry of nn.remat_scan, its activations constrained by name (its
  params are plain arrays: remat_scan takes no ``metadata_params``, so flax refuses boxes)."""

  @nn.compact
  def __call__(self, x):
    h = nn.gelu(nn.Dense(16)(x))
    h = nn.with_logical_constraint(h, ("batch", "mlp"))
    return x + nn.Dense(8)(h)


class EnsembleHead(nn.Module):
  @nn.compact
  def __call__(self, x):
    logits = nn.Dense(4, kernel_init=logical("embed", "hidden"))(x)
    return nn.with_logical_constraint(logits, ("batch", "hidden"))


class RematScanEnsemble(nn.Module):
  @nn.compact
  def __call__(self, x):
    x = nn.remat_scan(ScanBlock, lengths=(2, 2))(name="stack")(x)
    heads = nn.vmap(EnsembleHead, variable_axes={"params": 0}, split_rngs={"params": True},
                    in_axes=None, axis_size=2, spmd_axis_name="model",
                    metadata_params={nn.PARTITION_NAME: "member"})
    return heads(name="heads")(x).mean(0)


def test_linen_remat_scan_and_vmap_ensemble_with_logical_boxes():
  """``nn.remat_scan`` (4 rematerialised steps, lengths (2, 2): a scan in a scan), its stacked
  kernels given logical in_specs by hand, and an ``nn.vmap`` ensemble of
  ``nn.LogicallyPartitioned`` params (``nn.with_logical_partitioning``) whose
  ``metadata_params`` name the member axis (on "model" by the rules) and whose
  ``spmd_axis_name`` places it on "model" in the body's constraints too; in_specs from
  ``nn.get_partition_spec`` with rules."""
  model, tx = RematScanEnsemble(), optax.adam(1e-2)
  x = randn(8, 8)
  boxed = jax.jit(model.init)(jax.random.key(0), x)["params"]
  params, specs = nn.unbox(boxed), nn.get_partition_spec(boxed)
  assert isinstance(boxed["heads"]["Dense_0"]["kernel"], nn.LogicallyPartitioned)
  assert specs["heads"]["Dense_0"]["kernel"] == P("member", "embed", "hidden")
  specs["stack"] = {"Dense_0": {"kernel": P(None, None, "embed", "mlp"), "bias": P(None, None, "mlp")},
                    "Dense_1": {"kernel": P(None, None, "mlp", "embed"), "bias": None}}

  def step(params, opt_state, x, y):
    def loss_fn(params):
      return optax.softmax_cross_entropy_with_integer_labels(
          model.apply({"params": params}, x), y).mean()

    loss, grads = jax.value_and_grad(loss_fn)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  batches = [(randn(8, 8, seed=s), jnp.arange(8) % 4) for s in range(2)]
  step_fn = spmd.partition(step, mesh=mesh_of("2x4"), in_specs=(specs, None, P("batch"), P("batch")),
                           rules=RULES)
  plan = train_loop(jax.jit(step), step_fn, (params, tx.init(params)), batches, rtol=1e-4,
                    atol=1e-5)
  assert plan.in_specs[0]["heads"]["Dense_0"]["kernel"] == P("model", None, None)
