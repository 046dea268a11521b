"""flax's own examples, a twelfth round (google/flax examples/ and the NNX guides), small and
written as their users write them, run through spmd.partition on the ("data", "model") meshes:
an NNX ImageNet-style CNN in ``nnx.Sequential`` whose ``nnx.BatchNorm`` statistics are updated
across steps from a batch over "data" (uneven included), switched ``model.train()`` /
``model.eval()`` inside the step, with ``nnx.Dropout`` drawing from the model's ``nnx.Rngs``;
a custom ``Count`` Variable collection incremented per call and read back by ``nnx.state``
filters, gradients by ``nnx.grad(has_aux=True)``; the functional API split into several states
(``nnx.split(model, nnx.Param, nnx.BatchStat, Count)``) under ``jax.value_and_grad``; the
linen <-> NNX bridge carrying BatchNorm statistics (``nnx.bridge.ToNNX`` called with
``mutable=["batch_stats"]``, ``nnx.bridge.ToLinen`` inside a linen TrainState); and an
ogbg_molpcba-style graph network (jraph's GraphNetwork: edge, node and global updates by segment
sums over padded graphs) whose node and edge arrays are sharded, its blocks in an ``nnx.List``.
Each is checked against the jitted unpartitioned step, step by step where the state is fed back,
then its plan against the compiled program (helpers.train_loop / nnx_steps / check_plan)."""
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from flax.training import train_state
from jax.sharding import PartitionSpec as P

import spmd
from helpers import as_mesh, mesh_of, nnx_steps, randn, train_loop

MESH_4X2 = {"data": 4, "model": 2}


def sharded(*names):
  """lecun_normal, its dims named by mesh axes (the NNX sharding guide's kernel_init)."""
  return nnx.with_partitioning(nnx.initializers.lecun_normal(), names)


def labels_of(batch: int, classes: int, seed: int = 0) -> jax.Array:
  return jnp.asarray(np.random.default_rng(seed).integers(0, classes, batch), jnp.int32)


# --- imagenet-style CNN (NNX): BatchNorm statistics across steps, train / eval modes -------------

def cnn(rngs: nnx.Rngs) -> nnx.Sequential:
  """Conv -> BatchNorm -> relu -> mean-pool -> Dropout -> Linear, the conv's features (8) over
  "model"."""
  return nnx.Sequential(
      nnx.Conv(3, 8, (3, 3), use_bias=False, kernel_init=sharded(None, None, None, "model"),
               rngs=rngs),
      nnx.BatchNorm(8, momentum=0.9, rngs=rngs), nnx.relu,
      lambda x: x.mean(axis=(1, 2)),
      nnx.Dropout(0.2, rngs=rngs),
      nnx.Linear(8, 5, rngs=rngs))


def train_then_eval_step(model, optimizer, images, labels):
  """A training step in ``train()`` mode, then the updated model scores the batch in ``eval()``
  mode (running statistics, no dropout), as imagenet's train and eval steps do."""
  model.train()

  def loss_fn(model):
    logits = model(images)
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean(), logits

  (loss, _), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model)
  optimizer.update(model, grads)
  model.eval()
  return loss, model(images)


def test_nnx_batchnorm_stats_across_steps_train_eval_modes():
  """3 steps on 4x2; 6 rows over 4 "data" shards (uneven: padded rows must not enter the batch
  mean and variance), the features over "model"; BatchNorm's mean / var compared after the
  steps by nnx_steps."""
  def fresh():
    with nnx.use_eager_sharding(False):
      model = cnn(nnx.Rngs(0, dropout=1))
      return model, nnx.Optimizer(model, optax.sgd(0.1, momentum=0.9), wrt=nnx.Param)

  batches = [(randn(6, 6, 6, 3, seed=s), labels_of(6, 5, s)) for s in range(3)]
  _, (model, _) = nnx_steps(train_then_eval_step, fresh, as_mesh(MESH_4X2),
                            (None, None, P("data"), P("data")), batches)
  assert float(jnp.abs(model.layers[1].mean.get_value()).sum()) > 0  # the statistics moved


# --- a custom Variable collection (the NNX basics guide's Count), nnx.state filters -------------

class Count(nnx.Variable):
  """A custom collection: not a Param, so neither differentiated nor optimized."""


class CountedMlp(nnx.Module):
  """Counts its calls and the rows it has seen (a Count each), and keeps a running mean of its
  inputs (a Count too: a custom collection may hold floats), the hidden dim over "model"."""

  def __init__(self, rngs: nnx.Rngs):
    self.up = nnx.Linear(6, 12, kernel_init=sharded(None, "model"), rngs=rngs)
    self.down = nnx.Linear(12, 3, kernel_init=sharded("model", None), rngs=rngs)
    self.calls = Count(jnp.array(0, jnp.int32))
    self.rows = Count(jnp.array(0, jnp.int32))
    self.input_mean = Count(jnp.zeros(6))

  def __call__(self, x):
    self.calls[...] += 1
    self.rows[...] += x.shape[0]
    self.input_mean[...] = 0.5 * self.input_mean[...] + 0.5 * x.mean(axis=0)
    return self.down(nnx.gelu(self.up(x)))


def counted_step(model, optimizer, x, y):
  """``nnx.grad(has_aux=True)`` over the model (its Params: Count is not differentiable), then
  the counters read back through ``nnx.state`` filters."""
  def loss_fn(model):
    pred = model(x)
    return jnp.mean((pred - y) ** 2), pred

  grads, pred = nnx.grad(loss_fn, has_aux=True)(model)
  optimizer.update(model, grads)
  return nnx.state(model, Count), nnx.state(grads, nnx.Param), pred


def test_nnx_custom_count_collection_read_by_state_filters():
  """3 steps on 2x4, the batch of 8 over "data"; the counters, the running mean (a sum over
  the sharded batch) and the gradients' Params match nnx.jit's."""
  def fresh():
    with nnx.use_eager_sharding(False):
      model = CountedMlp(nnx.Rngs(0))
      return model, nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)

  batches = [(randn(8, 6, seed=s), randn(8, 3, seed=s + 10)) for s in range(3)]
  _, (model, _) = nnx_steps(counted_step, fresh, mesh_of("2x4"),
                            (None, None, P("data"), P("data")), batches)
  assert (int(model.calls.get_value()), int(model.rows.get_value())) == (3, 24)


# --- the functional API with several states: nnx.split by three filters, jax.value_and_grad -----

class ConvCounter(nnx.Module):
  """A conv and BatchNorm over 6 features (uneven over "model"'s 4), a call Count."""

  def __init__(self, rngs: nnx.Rngs):
    self.conv = nnx.Conv(2, 6, (3,), use_bias=False,  # BatchNorm cancels a bias's gradient
                         kernel_init=sharded(None, None, "model"), rngs=rngs)
    self.norm = nnx.BatchNorm(6, rngs=rngs)
    self.head = nnx.Linear(6, 4, rngs=rngs)
    self.calls = Count(jnp.array(0, jnp.int32))

  def __call__(self, x):
    self.calls[...] += 1
    return self.head(nnx.relu(self.norm(self.conv(x))).max(axis=1))


def test_nnx_split_into_params_batch_stats_and_counts_functional_step():
  """``graphdef, params, stats, counts = nnx.split(model, nnx.Param, nnx.BatchStat, Count)``;
  the loss merges them and splits the updated statistics and counts back out as its aux (the
  functional API's pure step), params' in_specs from ``nnx.get_partition_spec``; 2 steps on 2x4,
  6 rows over "data", fed back."""
  with nnx.use_eager_sharding(False):
    model = ConvCounter(nnx.Rngs(0))
  graphdef, params, stats, counts = nnx.split(model, nnx.Param, nnx.BatchStat, Count)
  tx = optax.adamw(1e-2)

  def step(params, stats, counts, opt_state, x, labels):
    def loss_fn(params):
      model = nnx.merge(graphdef, params, stats, counts, copy=True)
      logits = model(x)
      _, _, stats_out, counts_out = nnx.split(model, nnx.Param, nnx.BatchStat, Count)
      loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
      return loss, (stats_out, counts_out)

    (loss, (stats, counts)), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), stats, counts, opt_state, loss

  in_specs = (nnx.get_partition_spec(params), None, None, None, P("data"), P("data"))
  batches = [(randn(6, 10, 2, seed=s), labels_of(6, 4, s)) for s in range(2)]
  train_loop(jax.jit(step), spmd.partition(step, mesh=mesh_of("2x4"), in_specs=in_specs),
             (params, stats, counts, tx.init(params)), batches, rtol=1e-4, atol=1e-5)
