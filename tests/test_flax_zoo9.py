"""flax's own examples, a thirteenth round (google/flax examples/, the NNX guides and the linen
docs), small and written as their users write them, run through spmd.partition on the ("data",
"model") meshes: linen's ``nn.ConvLSTMCell`` under ``nn.RNN`` predicting the next frame of a
sequence of images whose rows are split over "model" (a convolution's halo inside the time
scan); an sst2-style classifier over ``nnx.RNN(nnx.SimpleCell, reverse=True)`` whose embedding
(13 words, uneven over "model") ``optax.multi_transform`` freezes with ``set_to_zero``;
``optax.contrib.schedule_free_adamw`` on a linen ``TrainState`` of boxed params, the step also
returning the loss at ``schedule_free_eval_params``; linen's lifted ``nn.jit`` inside an
``nn.Sequential`` with ``nn.PReLU`` over an uneven batch; and an NNX VAE whose encoder is
``nnx.Conv`` with stride 2 and padding 'CIRCULAR' under ``nnx.GroupNorm`` and whose decoder is
``nnx.ConvTranspose``, the image rows split over "model" and the noise drawn from a key argument;
lm1b's temperature sampling in ``nnx.fori_loop`` over a KV cache whose length is split over
"model"; and linen's fp8 training (``Fp8DirectDotGeneralOp`` as ``nn.Dense``'s dot_general, its
scales and amax histories overwritten by their gradients).
Each is checked against the jitted unpartitioned step, step by step where the state is fed back,
then its plan against the compiled program (helpers.train_loop / nnx_steps / check_plan)."""
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import optax.contrib
from flax import nnx
from flax.linen import fp8_ops
from flax.training import train_state
from jax.sharding import PartitionSpec as P

import spmd
from helpers import as_mesh, mesh_of, nnx_steps, no_more_than_xla, randn, train_loop
from test_flax_zoo2 import sentiment_step  # cross-entropy of (tokens, lengths) -> logits
from test_flax_zoo7 import MESH_4X2


# --- linen ConvLSTM (nn.ConvLSTMCell under nn.RNN): next-frame prediction, rows split ------------

class NextFrame(nn.Module):
  """A ConvLSTM over frames [B, T, H, W, C] whose hidden state, of C channels, is each step's
  prediction of the next frame."""

  @nn.compact
  def __call__(self, frames):
    return nn.RNN(nn.ConvLSTMCell(frames.shape[-1], kernel_size=(3, 3)))(frames)


def frame_step(state, frames):
  def loss_fn(params):
    predicted = state.apply_fn({"params": params}, frames[:, :-1])
    return jnp.mean((predicted - frames[:, 1:]) ** 2)

  loss, grads = jax.value_and_grad(loss_fn)(state.params)
  return state.apply_gradients(grads=grads), loss


def test_linen_conv_lstm_next_frame_rows_split_over_model():
  """2 steps on 2x4: 8 rows over "model" (2 a shard), the cell's 3x3 convolutions exchanging one
  row with each neighbour at every time step."""
  frames = jnp.asarray(randn(4, 4, 8, 6, 2))
  model = NextFrame()
  params = jax.jit(model.init)(jax.random.key(0), frames[:, :-1])["params"]
  state = train_state.TrainState.create(apply_fn=model.apply, params=params, tx=optax.adam(1e-2))
  step = spmd.partition(frame_step, mesh=mesh_of("2x4"), in_specs=(None, P("data", None, "model")))
  batches = [(frames,), (jnp.flip(frames, axis=1),)]
  train_loop(jax.jit(frame_step), step, (state,), batches, rtol=1e-4, atol=1e-5)


# --- sst2 (examples/sst2) in NNX: a reversed SimpleCell RNN, the embedding frozen ----------------

SST_VOCAB = 13  # over "model" of 4: 4, 4, 4, 1


class SentimentRnn(nnx.Module):
  def __init__(self, rngs: nnx.Rngs):
    self.embed = nnx.Embed(SST_VOCAB, 8, rngs=rngs, embedding_init=nnx.with_partitioning(
        nnx.initializers.normal(1.0), ("model", None)))
    self.rnn = nnx.RNN(nnx.SimpleCell(8, 12, rngs=rngs), reverse=True, keep_order=True,
                       return_carry=True)
    self.classify = nnx.Linear(12, 2, rngs=rngs)

  def __call__(self, tokens, lengths):
    carry, _ = self.rnn(self.embed(tokens), seq_lengths=lengths)
    return self.classify(carry)


def frozen_embedding(params):
  """optax.multi_transform's labels: "frozen" for the embedding, "trained" elsewhere."""
  return jax.tree_util.tree_map_with_path(
      lambda path, _: "frozen" if path[0].key == "embed" else "trained", params)


def test_nnx_sst2_reversed_simple_cell_rnn_frozen_uneven_embedding():
  """2 steps on 2x4 of 4 sentences of lengths 6, 3, 5, 1; the embedding stays as initialised."""
  def fresh():
    with nnx.use_eager_sharding(False):
      model = SentimentRnn(nnx.Rngs(0))
      tx = optax.multi_transform({"trained": optax.adam(1e-2), "frozen": optax.set_to_zero()},
                                 frozen_embedding)
      return model, nnx.Optimizer(model, tx, wrt=nnx.Param)

  rows = np.random.default_rng(0)
  lengths = jnp.asarray([6, 3, 5, 1], jnp.int32)
  batches = [(jnp.asarray(rows.integers(1, SST_VOCAB, (4, 6)), jnp.int32), lengths,
              jnp.asarray(rows.integers(0, 2, (4,)), jnp.int32)) for _ in range(2)]
  _, (model, _) = nnx_steps(sentiment_step, fresh, mesh_of("2x4"),
                            (None, None, P("data"), P("data"), P("data")), batches)
  with nnx.use_eager_sharding(False):
    untrained = SentimentRnn(nnx.Rngs(0))
  np.testing.assert_array_equal(model.embed.embedding[...], untrained.embed.embedding[...])


# --- schedule-free AdamW (optax.contrib) on a linen TrainState of boxed params -------------------

class WideMlp(nn.Module):
  """Two Dense layers, their kernels boxed by ``nn.with_partitioning`` over "model"."""

  @nn.compact
  def __call__(self, x):
    init = nn.initializers.lecun_normal()
    x = nn.gelu(nn.Dense(24, kernel_init=nn.with_partitioning(init, (None, "model")))(x))
    return nn.Dense(3, kernel_init=nn.with_partitioning(init, ("model", None)))(x)


def schedule_free_step(state, x, y):
  """A step of schedule-free AdamW, and the loss at the params it evaluates with (its averaged
  iterate, ``schedule_free_eval_params``) after the step."""
  def loss_fn(params):
    return jnp.mean((state.apply_fn({"params": params}, x) - y) ** 2)

  loss, grads = jax.value_and_grad(loss_fn)(state.params)
  state = state.apply_gradients(grads=grads)
  evaluated = optax.contrib.schedule_free_eval_params(state.opt_state, state.params)
  return state, (loss, loss_fn(evaluated))


def test_schedule_free_adamw_train_state_of_boxed_params_eval_loss():
  """3 steps on 4x2; 6 rows over 4 "data" shards (uneven), a hidden dim of 24 over "model"."""
  x = jnp.asarray(randn(6, 10))
  model = WideMlp()
  params = jax.jit(model.init)(jax.random.key(0), x)["params"]
  tx = optax.contrib.schedule_free_adamw(1e-2, warmup_steps=2, weight_decay=1e-3)
  state = train_state.TrainState.create(apply_fn=model.apply, params=params, tx=tx)
  step = spmd.partition(schedule_free_step, mesh=as_mesh(MESH_4X2),
                        in_specs=(None, P("data"), P("data")))
  batches = [(x * (s + 1), jnp.asarray(randn(6, 3, seed=s))) for s in range(3)]
  train_loop(jax.jit(schedule_free_step), step, (state,), batches, rtol=1e-4, atol=1e-5)


# --- linen's lifted nn.jit inside nn.Sequential, with nn.PReLU, over an uneven batch -------------

class Residual(nn.Module):
  """x + Dense(LayerNorm(x)): the block flax's docs wrap in ``nn.jit``."""

  @nn.compact
  def __call__(self, x):
    return x + nn.Dense(x.shape[-1])(nn.LayerNorm()(x))


def classifier() -> nn.Sequential:
  JittedResidual = nn.jit(Residual)
  return nn.Sequential([nn.Dense(16), JittedResidual(), nn.PReLU(), JittedResidual(),
                        nn.Dense(5)])


def classify_step(state, x, labels):
  def loss_fn(params):
    logits = state.apply_fn({"params": params}, x)
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

  loss, grads = jax.value_and_grad(loss_fn)(state.params)
  return state.apply_gradients(grads=grads), loss


def test_linen_lifted_jit_in_sequential_with_prelu_uneven_batch():
  """3 steps on 8x1 of 6 rows over 8 "data" shards (6 devices hold a row, 2 none)."""
  x = jnp.asarray(randn(6, 7))
  model = classifier()
  params = jax.jit(model.init)(jax.random.key(0), x)["params"]
  state = train_state.TrainState.create(apply_fn=model.apply, params=params,
                                        tx=optax.sgd(0.1, momentum=0.9))
  step = spmd.partition(classify_step, mesh=mesh_of("8x1"), in_specs=(None, P("data"), P("data")))
  labels = np.random.default_rng(0).integers(0, 5, (3, 6)).astype(np.int32)
  batches = [(x + s, jnp.asarray(labels[s])) for s in range(3)]
  train_loop(jax.jit(classify_step), step, (state,), batches, rtol=1e-4, atol=1e-5)


# --- NNX VAE over images: strided circular convolutions, GroupNorm, a transposed decoder -------

class ConvVae(nnx.Module):
  """Encoder: a 3x3 convolution of stride 2 with circular padding, GroupNorm (2 groups), 1x1
  convolutions to the latent mean and log-variance; decoder: a transposed convolution of stride 2
  back to the image's size and channel."""

  def __init__(self, rngs: nnx.Rngs):
    self.down = nnx.Conv(1, 4, (3, 3), strides=2, padding="CIRCULAR", rngs=rngs)
    self.norm = nnx.GroupNorm(4, num_groups=2, rngs=rngs)
    self.mean, self.logvar = nnx.Conv(4, 2, (1, 1), rngs=rngs), nnx.Conv(4, 2, (1, 1), rngs=rngs)
    self.up = nnx.ConvTranspose(2, 1, (3, 3), strides=(2, 2), rngs=rngs)

  def __call__(self, images, key):
    h = nnx.relu(self.norm(self.down(images)))
    mean, logvar = self.mean(h), self.logvar(h)
    z = mean + jnp.exp(0.5 * logvar) * jax.random.normal(key, mean.shape)
    return self.up(z), mean, logvar


def vae_step(model, optimizer, images, key):
  """flax's vae example's loss: binary cross-entropy of the logits plus the KL term."""
  def loss_fn(m):
    logits, mean, logvar = m(images, key)
    reconstruction = optax.sigmoid_binary_cross_entropy(logits, images).sum((1, 2, 3))
    kl = -0.5 * jnp.sum(1 + logvar - mean ** 2 - jnp.exp(logvar), (1, 2, 3))
    return jnp.mean(reconstruction + kl)

  loss, grads = nnx.value_and_grad(loss_fn)(model)
  optimizer.update(model, grads)
  return loss


def test_nnx_conv_vae_strided_circular_rows_split_over_model():
  """2 steps on 2x4: 8 image rows over "model" (2 a shard, 1 after the stride), the circular
  padding wrapping the last shard's row to the first; a fresh key per step."""
  def fresh():
    with nnx.use_eager_sharding(False):
      model = ConvVae(nnx.Rngs(0))
      return model, nnx.Optimizer(model, optax.adam(1e-3), wrt=nnx.Param)

  images = (randn(4, 8, 8, 1) > 0).astype(np.float32)
  batches = [(jnp.asarray(images), jax.random.key(s)) for s in range(2)]
  nnx_steps(vae_step, fresh, mesh_of("2x4"), (None, None, P("data", "model"), None), batches)


# --- lm1b's temperature sampling: decode steps in nnx.fori_loop, the KV cache's length split -----

DECODE_VOCAB = 20


class CachedDecoder(nnx.Module):
  """Embedding, one pre-norm ``nnx.MultiHeadAttention(decode=True)`` layer, the tied output."""

  def __init__(self, rngs: nnx.Rngs):
    self.embed = nnx.Embed(DECODE_VOCAB, 16, rngs=rngs)
    self.norm = nnx.RMSNorm(16, rngs=rngs)
    self.attention = nnx.MultiHeadAttention(num_heads=4, in_features=16, decode=True, rngs=rngs)

  def __call__(self, token):
    x = self.embed(token)
    return self.embed.attend(x + self.attention(self.norm(x)))


def temperature_sample(graphdef, state, prompt, key, steps: int = 3, temperature: float = 0.7):
  """``steps`` tokens drawn one at a time in ``nnx.fori_loop`` (the cache written at each), each
  fed back as the next input and written into the output buffer at its step."""
  def body(i, carry):
    model, out, token, key = carry
    key, draw = jax.random.split(key)
    token = jax.random.categorical(draw, model(token) / temperature).astype(jnp.int32)
    return model, jax.lax.dynamic_update_slice(out, token, (0, i)), token, key

  out = jnp.zeros((prompt.shape[0], steps), jnp.int32)
  model, out, _, _ = nnx.fori_loop(0, steps, body, (nnx.merge(graphdef, state), out, prompt, key))
  return out, nnx.state(model)


def cache_split(state, spec: P):
  """Specs for a decoder's split state: ``spec`` for the cached keys and values, P() elsewhere."""
  cached = ("cached_key", "cached_value")
  return jax.tree_util.tree_map_with_path(
      lambda path, _: spec if any(getattr(k, "key", None) in cached for k in path) else P(), state)


def test_lm1b_temperature_sampling_in_fori_loop_cache_length_over_model():
  """3 steps on 2x4: the cache f32[4,8,4,4] P('data','model') (its 8 positions over "model"),
  each step's keys written into one shard; no more bytes than XLA (192 B per device)."""
  with nnx.use_eager_sharding(False):
    model = CachedDecoder(nnx.Rngs(0))
    model.attention.init_cache((4, 8, 16))
  graphdef, state = nnx.split(model)
  prompt = jnp.asarray(np.random.default_rng(0).integers(0, DECODE_VOCAB, (4, 1)), jnp.int32)
  no_more_than_xla(functools.partial(temperature_sample, graphdef), (state, prompt, jax.random.key(1)),
                   (cache_split(state, P("data", "model")), P("data"), P()), mesh_of("2x4"))


# --- linen fp8 (the fp8 basics guide): Dense layers whose dot_general is Fp8DirectDotGeneralOp ---

FP8 = functools.partial(fp8_ops.Fp8DirectDotGeneralOp, amax_history_length=4)


class Fp8Mlp(nn.Module):
  """Two fp8 Dense layers, their kernels boxed column- and row-split over "model"."""

  @nn.compact
  def __call__(self, x):
    init = nn.initializers.lecun_normal()
    x = nn.gelu(nn.Dense(16, dot_general_cls=FP8,
                         kernel_init=nn.with_partitioning(init, (None, "model")))(x))
    return nn.Dense(4, dot_general_cls=FP8,
                    kernel_init=nn.with_partitioning(init, ("model", None)))(x)


def fp8_step(variables, x, y):
  """SGD on the params; the scales and amax histories (the ``OVERWRITE_WITH_GRADIENT``
  collection) replaced by their gradients, which carry their updated values."""
  def loss_fn(v):
    return jnp.mean((Fp8Mlp().apply(v, x) - y) ** 2)

  loss, grads = jax.value_and_grad(loss_fn)(variables)
  params = jax.tree.map(lambda p, g: p - 0.1 * g, variables["params"], grads["params"])
  return {"params": params, fp8_ops.OVERWRITE_WITH_GRADIENT: grads[
      fp8_ops.OVERWRITE_WITH_GRADIENT]}, loss


def test_linen_fp8_dense_overwrite_with_gradient_collection():
  """3 steps on 2x4, the params' specs from their boxes; the amax histories roll each step."""
  x = jnp.asarray(randn(8, 8))
  variables = jax.jit(Fp8Mlp().init)(jax.random.key(0), x)
  specs = nn.get_partition_spec(variables)
  step = spmd.partition(fp8_step, mesh=mesh_of("2x4"), in_specs=(specs, P("data"), P("data")))
  batches = [(x * (s + 1), jnp.asarray(randn(8, 4, seed=s))) for s in range(3)]
  train_loop(jax.jit(fp8_step), step, (nn.unbox(variables),), batches, rtol=1e-4, atol=1e-5)
