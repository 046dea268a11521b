"""flax's own examples, a fifth round (google/flax examples/ and nnx_toy_examples), small and
written as their users write them, run through spmd.partition on the ("data", "model") meshes:
imagenet's float16 step under ``DynamicScale`` (a skipped non-finite step, the scale backing off
and growing), pixelcnn++'s shifted convolutions with a discretized logistic mixture loss and
Polyak averaging (the image rows split), NNX's VAE (a loss Variable written in the forward pass,
noise from the model's own Rngs) and NNX's recurrent layers (``nnx.Bidirectional`` of
``nnx.RNN``s over an LSTM and a GRU cell, each sequence within its length).
Each is checked against the unpartitioned step, step by step (helpers.train_loop / nnx_steps /
check_plan)."""
import functools
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from flax.training import dynamic_scale as dynamic_scale_lib
from flax.training import train_state
from jax.sharding import PartitionSpec as P

import spmd
from helpers import assert_trees_match, mesh_of, nnx_steps, randn, train_loop


# --- imagenet with half_precision on GPU: float16 compute, DynamicScale, BatchNorm ---------------

class HalfBlock(nn.Module):
  """ResNet18's basic block, in float16 as imagenet's ``half_precision`` runs it on GPU."""
  filters: int
  strides: tuple = (1, 1)

  @nn.compact
  def __call__(self, x, train: bool):
    conv = functools.partial(nn.Conv, use_bias=False, dtype=jnp.float16)
    norm = functools.partial(nn.BatchNorm, use_running_average=not train, momentum=0.9,
                             epsilon=1e-5, dtype=jnp.float16)
    y = nn.relu(norm()(conv(self.filters, (3, 3), self.strides)(x)))
    y = norm(scale_init=nn.initializers.zeros)(conv(self.filters, (3, 3))(y))
    if x.shape != y.shape:
      x = norm(name="norm_proj")(conv(self.filters, (1, 1), self.strides, name="conv_proj")(x))
    return nn.relu(x + y)


class HalfResNet(nn.Module):
  @nn.compact
  def __call__(self, x, train: bool = True):
    x = nn.Conv(8, (3, 3), use_bias=False, dtype=jnp.float16, name="conv_init")(x)
    x = nn.relu(nn.BatchNorm(use_running_average=not train, momentum=0.9, dtype=jnp.float16,
                             name="bn_init")(x))
    x = HalfBlock(16, strides=(2, 2))(x, train)
    return nn.Dense(10, dtype=jnp.float16)(jnp.mean(x, axis=(1, 2))).astype(jnp.float32)


class ScaledState(train_state.TrainState):
  batch_stats: Any
  dynamic_scale: dynamic_scale_lib.DynamicScale


def half_train_step(state, batch):
  """imagenet's train_step with a dynamic scale: the gradients of the scaled loss, and where
  they are not finite the params and optimizer state kept (the batch statistics still move)."""
  def loss_fn(params):
    logits, updates = state.apply_fn({"params": params, "batch_stats": state.batch_stats},
                                     batch["image"], mutable=["batch_stats"])
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()
    decay = sum(jnp.sum(p ** 2) for p in jax.tree.leaves(params) if p.ndim > 1)
    return loss + 1e-4 * 0.5 * decay, (updates, logits)

  grad_fn = state.dynamic_scale.value_and_grad(loss_fn, has_aux=True)
  dynamic_scale, is_finite, (loss, (updates, logits)), grads = grad_fn(state.params)
  new_state = state.apply_gradients(grads=grads, batch_stats=updates["batch_stats"])
  keep = functools.partial(jnp.where, is_finite)
  new_state = new_state.replace(opt_state=jax.tree.map(keep, new_state.opt_state, state.opt_state),
                                params=jax.tree.map(keep, new_state.params, state.params),
                                dynamic_scale=dynamic_scale)
  accuracy = jnp.mean(jnp.argmax(logits, -1) == batch["label"])
  return new_state, {"loss": loss, "accuracy": accuracy, "scale": dynamic_scale.scale,
                     "finite": is_finite}


@pytest.mark.parametrize("mesh,batch", [("8x1", 6)])
def test_imagenet_float16_dynamic_scale_skips_non_finite_step(mesh, batch):
  """6 images over 8 (uneven). The first step's scale (2^28) overflows float16's cotangents:
  the step is skipped and the scale backs off to 2^12; the next two are finite, and the scale
  grows after the second finite one in a row (growth_interval 1)."""
  model = HalfResNet()
  images = randn(batch, 8, 8, 3)
  variables = jax.jit(model.init)(jax.random.key(0), images)
  scale = dynamic_scale_lib.DynamicScale(growth_interval=1, scale=2.0 ** 28,
                                         backoff_factor=2.0 ** -16)
  state = ScaledState.create(apply_fn=model.apply, params=variables["params"],
                             tx=optax.sgd(0.1, momentum=0.9, nesterov=True),
                             batch_stats=variables["batch_stats"], dynamic_scale=scale)
  batches = [({"image": randn(batch, 8, 8, 3, seed=s), "label": jnp.arange(batch) % 10},)
             for s in range(3)]
  step = spmd.partition(half_train_step, mesh=mesh_of(mesh), in_specs=(None, P("data")))
  reference = jax.jit(half_train_step)
  # float16 activations: each partitioned step starts from the reference's state, whose
  # float16 rounding would otherwise compound
  train_loop(reference, step, (state,), batches, from_reference=True, rtol=1e-2, atol=1e-2)
  trajectory = [state]
  for batch_ in batches:
    trajectory.append(reference(trajectory[-1], *batch_)[0])
  scales = [float(s.dynamic_scale.scale) for s in trajectory]
  assert scales == [2.0 ** 28, 2.0 ** 12, 2.0 ** 12, 2.0 ** 13]
  assert_trees_match(trajectory[1].params, state.params)  # the skipped step kept them


# --- pixelcnn++: down / down-right shifted convolutions, gated resnets, a logistic mixture -------

def down_shift(x):
  return jnp.pad(x[:, :-1], ((0, 0), (1, 0), (0, 0), (0, 0)))


def right_shift(x):
  return jnp.pad(x[:, :, :-1], ((0, 0), (0, 0), (1, 0), (0, 0)))


class ConvDown(nn.Module):
  """A convolution seeing only the rows above (and its own): padded on top, centred across."""
  features: int
  kernel: tuple = (2, 3)

  @nn.compact
  def __call__(self, x):
    kh, kw = self.kernel
    x = jnp.pad(x, ((0, 0), (kh - 1, 0), ((kw - 1) // 2, (kw - 1) // 2), (0, 0)))
    return nn.Conv(self.features, self.kernel, padding="VALID")(x)


class ConvDownRight(nn.Module):
  """A convolution seeing only the rows above and the pixels to the left."""
  features: int
  kernel: tuple = (2, 2)

  @nn.compact
  def __call__(self, x):
    kh, kw = self.kernel
    x = jnp.pad(x, ((0, 0), (kh - 1, 0), (kw - 1, 0), (0, 0)))
    return nn.Conv(self.features, self.kernel, padding="VALID")(x)


def concat_elu(x):
  return nn.elu(jnp.concatenate([x, -x], axis=-1))


class GatedResnet(nn.Module):
  conv: Any
  dropout: float = 0.5

  @nn.compact
  def __call__(self, x, aux, train: bool):
    c = x.shape[-1]
    y = self.conv(c)(concat_elu(x))
    if aux is not None:
      y = y + nn.Dense(c)(concat_elu(aux))  # pixelcnn's network-in-network on the u stream
    y = nn.Dropout(self.dropout, deterministic=not train)(concat_elu(y))
    a, b = jnp.split(self.conv(2 * c)(y), 2, axis=-1)
    return x + a * nn.sigmoid(b)


MIXTURES = 3


class PixelCNN(nn.Module):
  """pixelcnn++'s two streams (up: rows above; up-left: rows above and pixels left), one gated
  resnet each, and a logistic mixture per pixel (greyscale: logits, means, log scales)."""
  features: int = 8

  @nn.compact
  def __call__(self, images, train: bool):
    u = down_shift(ConvDown(self.features, (2, 3))(images))
    ul = (down_shift(ConvDown(self.features, (1, 3))(images))
          + right_shift(ConvDownRight(self.features, (2, 1))(images)))
    u = GatedResnet(ConvDown)(u, None, train)
    ul = GatedResnet(ConvDownRight)(ul, u, train)
    return nn.Dense(3 * MIXTURES)(nn.elu(ul))


def logistic_mixture_nll(images, out):
  """The discretized logistic mixture's negative log-likelihood of pixels in [-1, 1] (256
  levels): the edge levels take the tails, the others the mass of their bin."""
  logits, means, log_scales = jnp.split(out, 3, axis=-1)
  log_scales = jnp.maximum(log_scales, -7.0)
  centered, inv_scale = images - means, jnp.exp(-log_scales)
  plus, minus = inv_scale * (centered + 1 / 255), inv_scale * (centered - 1 / 255)
  log_cdf_plus = plus - nn.softplus(plus)
  log_one_minus_cdf_minus = -nn.softplus(minus)
  bin_mass = nn.sigmoid(plus) - nn.sigmoid(minus)
  log_probs = jnp.where(images < -0.999, log_cdf_plus,
                        jnp.where(images > 0.999, log_one_minus_cdf_minus,
                                  jnp.log(jnp.maximum(bin_mass, 1e-12))))
  log_probs = jax.nn.logsumexp(log_probs + jax.nn.log_softmax(logits), axis=-1)
  return -jnp.mean(log_probs)


def pixelcnn_train_step(state, ema_params, images, key):
  """pixelcnn's step: the loss with dropout, an adam step with clipped gradients, and the
  Polyak average of the params."""
  def loss_fn(params):
    out = state.apply_fn({"params": params}, images, True, rngs={"dropout": key})
    return logistic_mixture_nll(images, out)

  loss, grads = jax.value_and_grad(loss_fn)(state.params)
  state = state.apply_gradients(grads=grads)
  ema_params = jax.tree.map(lambda e, p: 0.95 * e + 0.05 * p, ema_params, state.params)
  return state, ema_params, loss


def quantized_images(batch, height, seed):
  levels = np.random.default_rng(seed).integers(0, 256, (batch, height, 8, 1))
  levels[:, 0, 0] = (0, 255)[seed % 2]  # an edge level: the mixture's tails
  return jnp.asarray(levels / 127.5 - 1, jnp.float32)


@pytest.mark.parametrize("mesh,batch,height", [("2x4", 4, 8)])
def test_pixelcnn_shifted_convs_logistic_mixture_rows_split(mesh, batch, height):
  """The images' rows over "model": the shifts and the causal convolutions' padding reach
  into the shard above (halos), the mixture's loss sums over every pixel."""
  model = PixelCNN()
  images = quantized_images(batch, height, 0)
  params = jax.jit(model.init, static_argnums=2)(jax.random.key(0), images, False)["params"]
  # momentum SGD, not pixelcnn's adam: the first gated resnet's kernel has gradients of 1e-7
  # whose float32 rounding (1e-7 off float64's, partitioned or not) adam scales up to its step
  tx = optax.chain(optax.clip_by_global_norm(1.0), optax.sgd(optax.exponential_decay(
      0.1, transition_steps=1, decay_rate=0.9), momentum=0.95))
  state = train_state.TrainState.create(apply_fn=model.apply, params=params, tx=tx)
  keys = jax.random.split(jax.random.key(1), 3)
  batches = [(quantized_images(batch, height, s), keys[s]) for s in range(3)]
  step = spmd.partition(pixelcnn_train_step, mesh=mesh_of(mesh),
                        in_specs=(None, None, P("data", "model"), P()))
  plan = train_loop(jax.jit(pixelcnn_train_step), step, (state, params), batches, rtol=1e-4,
                    atol=1e-5)
  assert "collective-permute" in {c.kind for c in plan.collectives}  # halos, not gathers


# --- nnx_toy_examples/05_vae: a loss Variable set in the forward pass, noise from model Rngs ----

class KLLoss(nnx.Variable):
  pass


class VaeEncoder(nnx.Module):
  def __init__(self, din: int, dmid: int, dout: int, rngs: nnx.Rngs):
    self.linear1 = nnx.Linear(din, dmid, rngs=rngs)
    self.linear_mean = nnx.Linear(dmid, dout, rngs=rngs)
    self.linear_std = nnx.Linear(dmid, dout, rngs=rngs)
    self.rngs = rngs
    self.kl_loss = KLLoss(jnp.array(0.0))

  def __call__(self, x):
    x = nnx.relu(self.linear1(x.reshape((x.shape[0], -1))))
    mean, std = self.linear_mean(x), jnp.exp(self.linear_std(x))
    self.kl_loss[...] = jnp.mean(0.5 * jnp.mean(-jnp.log(std ** 2) - 1.0 + std ** 2 + mean ** 2,
                                                axis=-1))
    return mean + std * jax.random.normal(self.rngs.noise(), mean.shape)


class Vae(nnx.Module):
  def __init__(self, rngs: nnx.Rngs):
    self.encoder = VaeEncoder(36, 16, 4, rngs)
    self.decoder = nnx.Sequential(nnx.Linear(4, 16, rngs=rngs), nnx.relu,
                                  nnx.Linear(16, 36, rngs=rngs))

  def __call__(self, x):
    return self.decoder(self.encoder(x)).reshape(x.shape)


def vae_train_step(model, optimizer, x):
  def loss_fn(model):
    logits = model(x)
    kl = sum(jax.tree.leaves(nnx.state(model, KLLoss)))
    return optax.sigmoid_binary_cross_entropy(logits, x).mean() + 0.1 * kl

  loss, grads = nnx.value_and_grad(loss_fn)(model)
  optimizer.update(model, grads)
  return loss


@pytest.mark.parametrize("mesh,batch", [("8x1", 12)])
def test_nnx_vae_loss_variable_and_model_rngs(mesh, batch):
  """12 images over 8 (uneven); the noise key advances in the model each step, the KL loss
  Variable is written by the forward pass and read back by a filter."""
  def fresh():
    model = Vae(nnx.Rngs(params=0, noise=1))
    return model, nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)

  rng = np.random.default_rng(7)
  batches = [(jnp.asarray(rng.random((batch, 6, 6)) > 0.5, jnp.float32),) for _ in range(3)]
  _, (model, _) = nnx_steps(vae_train_step, fresh, mesh_of(mesh), (None, None, P("data")),
                            batches)
  assert int(model.encoder.rngs.noise.count[...]) == 3  # a key drawn per step


# --- NNX recurrent layers (the sst2 example as NNX writes it): nnx.Bidirectional of nnx.RNNs ----

class NnxSentiment(nnx.Module):
  """Embeddings read by an ``nnx.RNN`` of an LSTM forwards and one of a GRU backwards
  (``nnx.Bidirectional``), each sequence within its length; mean pooled, then a linear head."""

  def __init__(self, rngs: nnx.Rngs):
    self.embed = nnx.Embed(30, 8, rngs=rngs)
    self.rnn = nnx.Bidirectional(nnx.RNN(nnx.OptimizedLSTMCell(8, 8, rngs=rngs)),
                                 nnx.RNN(nnx.GRUCell(8, 8, rngs=rngs)))
    self.head = nnx.Linear(16, 2, rngs=rngs)

  def __call__(self, tokens, lengths):
    return self.head(self.rnn(self.embed(tokens), seq_lengths=lengths).mean(1))


def sentiment_step(model, optimizer, tokens, lengths, labels):
  def loss_fn(model):
    logits = model(tokens, lengths)
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

  loss, grads = nnx.value_and_grad(loss_fn)(model)
  optimizer.update(model, grads)
  return loss


def test_nnx_bidirectional_rnn_with_seq_lengths():
  """nnx.RNN scans its cell (an nnx.scan over the cell's graph state); the backward one
  reverses each sequence within its length (a gather per example)."""
  def fresh():
    model = NnxSentiment(nnx.Rngs(0))
    return model, nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)

  rng = np.random.default_rng(3)
  lengths = jnp.asarray([6, 3, 5, 1, 2, 6, 4, 5], jnp.int32)
  batches = [(jnp.asarray(rng.integers(0, 30, (8, 6)), jnp.int32), jnp.roll(lengths, s),
              jnp.arange(8) % 2) for s in range(2)]
  nnx_steps(sentiment_step, fresh, mesh_of("2x4"), (None, None, P("data"), P("data"),
                                                    P("data")), batches)
