"""flax's own example models (google/flax examples/ and the NNX guides), small, written as their
users write them, run through spmd.partition: a batch over "data", params open or named by
logical rules over "model", on 2x4, 8x1 and 1x8 meshes, uneven sizes included; each checked
against the unpartitioned function (helpers.assert_partitioned_matches, or its checks after a
loop of training steps feeding the state back)."""
import functools

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
from helpers import (assert_partitioned_matches, assert_trees_match, check_plan, mesh_of, randn,
                     train_loop)

# --- linen MNIST CNN (examples/mnist) -----------------------------------------------------------

class CNN(nn.Module):
  @nn.compact
  def __call__(self, x):
    x = nn.Conv(features=8, kernel_size=(3, 3))(x)
    x = nn.relu(x)
    x = nn.avg_pool(x, window_shape=(2, 2), strides=(2, 2))
    x = nn.Conv(features=16, kernel_size=(3, 3))(x)
    x = nn.relu(x)
    x = nn.avg_pool(x, window_shape=(2, 2), strides=(2, 2))
    x = x.reshape((x.shape[0], -1))
    x = nn.Dense(features=32)(x)
    x = nn.relu(x)
    return nn.Dense(features=10)(x)


@pytest.mark.parametrize("mesh,batch", [("8x1", 6)])
def test_linen_mnist_cnn_train_step(mesh, batch):
  model, tx = CNN(), optax.sgd(0.1, momentum=0.9)
  images = randn(batch, 12, 12, 1)
  labels = jnp.arange(batch) % 10
  params = jax.jit(model.init)(jax.random.key(0), images)["params"]

  def step(params, opt_state, images, labels):
    def loss_fn(params):
      logits = model.apply({"params": params}, images)
      return optax.softmax_cross_entropy(logits, jax.nn.one_hot(labels, 10)).mean()

    loss, grads = jax.value_and_grad(loss_fn)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  in_specs, reference = (None, None, P("data"), P("data")), jax.jit(step)
  state = (params, tx.init(params))
  batches = [(randn(batch, 12, 12, 1, seed=s), labels) for s in range(3)]
  plan = train_loop(reference, spmd.partition(step, mesh=mesh_of(mesh), in_specs=in_specs),
                    state, batches, rtol=1e-4, atol=1e-5)
  # data parallel: the gradients (and the loss) all-reduced once, nothing else
  assert {(c.kind, c.axes) for c in plan.collectives} == {("all-reduce", ("data",))}
  assert plan.total_bytes == 4 * (sum(p.size for p in jax.tree.leaves(params)) + 1)


# --- the MNIST example's TrainState step: a dict batch, dropout's rng, remat, bfloat16 ------------

class DropoutMLP(nn.Module):
  @nn.compact
  def __call__(self, x, train: bool):
    x = nn.remat(nn.Dense)(32, dtype=jnp.bfloat16)(x.reshape(x.shape[0], -1))
    x = nn.Dropout(0.5, deterministic=not train)(nn.relu(x))
    return nn.Dense(10)(x)


def test_linen_train_state_step_with_dropout_rng():
  model = DropoutMLP()
  images = randn(8, 4, 4, 1)
  params = jax.jit(model.init, static_argnums=2)(jax.random.key(0), images, False)["params"]
  state = train_state.TrainState.create(apply_fn=model.apply, params=params, tx=optax.adam(1e-3))

  def step(state, batch, key):
    def loss_fn(params):
      logits = state.apply_fn({"params": params}, batch["image"], True, rngs={"dropout": key})
      return optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()

    loss, grads = jax.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads=grads), loss

  batches = [({"image": randn(8, 4, 4, 1, seed=s), "label": jnp.arange(8) % 10}, k)
             for s, k in enumerate(jax.random.split(jax.random.key(1), 3))]
  in_specs = (None, {"image": P("data"), "label": P("data")}, P())
  train_loop(jax.jit(step), spmd.partition(step, mesh=mesh_of("2x4"), in_specs=in_specs),
             (state,), batches, rtol=2e-2, atol=2e-2)


# --- linen ResNet block with BatchNorm (examples/imagenet) ---------------------------------------

class ResNetBlock(nn.Module):
  filters: int

  @nn.compact
  def __call__(self, x, train: bool = True):
    norm = lambda: nn.BatchNorm(use_running_average=not train, momentum=0.9)  # noqa: E731
    residual = x
    y = nn.Conv(self.filters, (3, 3), use_bias=False)(x)
    y = nn.relu(norm()(y))
    y = nn.Conv(self.filters, (3, 3), use_bias=False)(y)
    y = norm()(y)
    if residual.shape != y.shape:
      residual = norm()(nn.Conv(self.filters, (1, 1), use_bias=False)(residual))
    return nn.relu(residual + y)


class ResNet(nn.Module):
  @nn.compact
  def __call__(self, x, train: bool = True):
    x = nn.Conv(8, (3, 3), strides=(2, 2), use_bias=False)(x)
    x = ResNetBlock(16)(x, train)
    x = jnp.mean(x, axis=(1, 2))
    return nn.Dense(10)(x)


@pytest.mark.parametrize("mesh,batch", [("2x4", 8)])
def test_linen_resnet_batchnorm_train_and_eval(mesh, batch):
  model, tx = ResNet(), optax.adam(1e-2)
  images = randn(batch, 8, 8, 3)
  labels = jnp.arange(batch) % 10
  variables = jax.jit(model.init)(jax.random.key(0), images)

  def step(params, batch_stats, opt_state, images, labels):
    def loss_fn(params):
      logits, updates = model.apply({"params": params, "batch_stats": batch_stats}, images,
                                    mutable=["batch_stats"])
      loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
      return loss, updates["batch_stats"]

    (loss, batch_stats), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), batch_stats, opt_state, loss

  def evaluate(variables, images):
    return model.apply(variables, images, train=False)

  mesh = mesh_of(mesh)
  in_specs, reference = (None, None, None, P("data"), P("data")), jax.jit(step)
  state = (variables["params"], variables["batch_stats"], tx.init(variables["params"]))
  batches = [(randn(batch, 8, 8, 3, seed=s), labels) for s in range(3)]
  plan = train_loop(reference, spmd.partition(step, mesh=mesh, in_specs=in_specs), state,
                    batches, rtol=1e-4, atol=1e-4)
  # the gradients and the batch statistics all-reduced over "data", nothing else
  assert {(c.kind, c.axes) for c in plan.collectives} == {("all-reduce", ("data",))}
  plan = assert_partitioned_matches(evaluate, (variables, images), (None, P("data")), mesh,
                             reference=jax.jit(evaluate), rtol=1e-4, atol=1e-5)
  assert not plan.collectives  # running averages: every image on its own


# --- linen recurrent networks: nn.RNN over an LSTM cell, nn.scan (examples/sort, seq2seq) --------

class SeqClassifier(nn.Module):
  cell: str

  @nn.compact
  def __call__(self, x):
    if self.cell == "lstm":
      h = nn.RNN(nn.OptimizedLSTMCell(16))(x)
    else:  # nn.scan over a cell, as before nn.RNN
      scan = nn.scan(nn.LSTMCell, variable_broadcast="params", split_rngs={"params": False},
                     in_axes=1, out_axes=1)
      carry = nn.LSTMCell(16, parent=None).initialize_carry(jax.random.key(0), x[:, 0].shape)
      _, h = scan(16)(carry, x)
    return nn.Dense(4)(h[:, -1])


@pytest.mark.parametrize("cell,mesh,batch", [("lstm", "2x4", 8), ("scan", "8x1", 6)])
def test_linen_recurrent_grads(cell, mesh, batch):
  model = SeqClassifier(cell)
  x = randn(batch, 5, 3)
  params = jax.jit(model.init)(jax.random.key(0), x)["params"]

  def loss_and_grads(params, x):
    return jax.value_and_grad(lambda p: jnp.mean(model.apply({"params": p}, x) ** 2))(params)

  assert_partitioned_matches(loss_and_grads, (params, x), (None, P("data")), mesh_of(mesh),
                             reference=jax.jit(loss_and_grads), rtol=1e-4, atol=1e-5)


# --- linen SST-2 classifier (examples/sst2): a bidirectional LSTM over padded sequences --------

class SentimentClassifier(nn.Module):
  @nn.compact
  def __call__(self, tokens, lengths):
    x = nn.Embed(30, 8)(tokens)
    h = nn.Bidirectional(nn.RNN(nn.LSTMCell(8)), nn.RNN(nn.GRUCell(8)))(x, seq_lengths=lengths)
    return nn.Dense(2)(h.mean(1))


def test_linen_bidirectional_lstm_with_seq_lengths():
  """The backward RNN (a GRU) reverses each sequence within its length (a gather per
  example)."""
  model = SentimentClassifier()
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, 30, (8, 6)), jnp.int32)
  lengths = jnp.asarray([6, 3, 5, 1, 2, 6, 4, 5], jnp.int32)
  params = jax.jit(model.init)(jax.random.key(0), tokens, lengths)["params"]

  def loss_and_grads(params, tokens, lengths):
    return jax.value_and_grad(
        lambda p: jnp.mean(model.apply({"params": p}, tokens, lengths) ** 2))(params)

  assert_partitioned_matches(loss_and_grads, (params, tokens, lengths),
                             (None, P("data"), P("data")), mesh_of("2x4"),
                             reference=jax.jit(loss_and_grads), rtol=1e-4, atol=1e-5)


# --- linen VAE (examples/vae): an rng argument, the reparameterization --------------------------

class VAE(nn.Module):
  latents: int = 4

  @nn.compact
  def __call__(self, x, z_rng):
    h = nn.relu(nn.Dense(32, name="enc_hidden")(x))
    mean = nn.Dense(self.latents, name="enc_mean")(h)
    logvar = nn.Dense(self.latents, name="enc_logvar")(h)
    z = mean + jnp.exp(0.5 * logvar) * jax.random.normal(z_rng, logvar.shape)
    logits = nn.Dense(x.shape[-1], name="dec_out")(nn.relu(nn.Dense(32, name="dec_hidden")(z)))
    return logits, mean, logvar


@pytest.mark.parametrize("mesh,batch", [("8x1", 6)])
def test_linen_vae_train_step(mesh, batch):
  model, tx = VAE(), optax.adam(1e-3)
  x = (randn(batch, 20) > 0).astype(np.float32)
  params = jax.jit(model.init)(jax.random.key(0), x, jax.random.key(1))["params"]

  def step(params, opt_state, x, key):
    def loss_fn(params):
      logits, mean, logvar = model.apply({"params": params}, x, key)
      bce = optax.sigmoid_binary_cross_entropy(logits, x).sum(-1).mean()
      kld = (-0.5 * jnp.sum(1 + logvar - mean ** 2 - jnp.exp(logvar), -1)).mean()
      return bce + kld

    loss, grads = jax.value_and_grad(loss_fn)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  mesh = mesh_of(mesh)
  in_specs, reference = (None, None, P("data"), P()), jax.jit(step)
  state = (params, tx.init(params))
  batches = [(x, k) for k in jax.random.split(jax.random.key(3), 3)]
  train_loop(reference, spmd.partition(step, mesh=mesh, in_specs=in_specs), state, batches,
             rtol=1e-4, atol=1e-5)


# --- linen LM1B-style Transformer with logical partitioning (examples/lm1b) ---------------------

LM_RULES = (("batch", "data"), ("vocab", "model"), ("mlp", "model"), ("kv", "model"),
            ("embed", None))


class DecoderBlock(nn.Module):
  @nn.compact
  def __call__(self, x, mask):
    names = lambda *n: nn.with_logical_partitioning(nn.initializers.lecun_normal(), n)  # noqa
    norm = lambda: nn.LayerNorm(  # noqa: E731
        scale_init=nn.with_logical_partitioning(nn.initializers.ones, ("embed",)),
        bias_init=nn.with_logical_partitioning(nn.initializers.zeros, ("embed",)))
    y = nn.MultiHeadDotProductAttention(num_heads=4, qkv_features=16, use_bias=False,
                                        kernel_init=names("embed", "kv"))(norm()(x), mask=mask)
    x = x + y
    z = nn.relu(nn.Dense(32, kernel_init=names("embed", "mlp"))(norm()(x)))
    z = nn.with_logical_constraint(z, ("batch", None, "mlp"))
    return x + nn.Dense(x.shape[-1], kernel_init=names("mlp", "embed"))(z)


class TransformerLM(nn.Module):
  vocab: int = 24

  @nn.compact
  def __call__(self, tokens):
    mask = nn.combine_masks(nn.make_attention_mask(tokens > 0, tokens > 0),
                            nn.make_causal_mask(tokens))
    embed = nn.Embed(self.vocab, 16, embedding_init=nn.with_logical_partitioning(
        nn.initializers.normal(1.0), ("vocab", "embed")))
    x = embed(tokens)
    x = DecoderBlock()(x, mask)
    return nn.Dense(self.vocab, kernel_init=nn.with_logical_partitioning(
        nn.initializers.lecun_normal(), ("embed", "vocab")))(nn.LayerNorm()(x))


@pytest.mark.parametrize("mesh,batch", [("2x4", 4)])
def test_linen_lm1b_transformer_logical_rules(mesh, batch):
  model, tx = TransformerLM(), optax.adamw(1e-2)
  tokens = jnp.asarray(np.random.default_rng(0).integers(1, 24, (batch, 8)), jnp.int32)
  variables = jax.jit(model.init)(jax.random.key(0), tokens)
  params = nn.unbox(variables)["params"]
  param_specs = nn.get_partition_spec(variables)["params"]

  def step(params, opt_state, tokens):
    def loss_fn(params):
      logits = model.apply({"params": params}, tokens[:, :-1])
      return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

    loss, grads = jax.value_and_grad(loss_fn)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  mesh = mesh_of(mesh)
  in_specs, reference = (param_specs, None, P("batch")), jax.jit(step)
  state = (params, tx.init(params))
  batches = [(jnp.roll(tokens, s, axis=1),) for s in range(3)]
  plan = train_loop(reference, spmd.partition(step, mesh=mesh, in_specs=in_specs,
                                              rules=LM_RULES), state, batches, rtol=1e-4, atol=1e-5)
  assert plan.in_specs[0]["Embed_0"]["embedding"] == P("model", None)


# --- WMT-style encoder-decoder (examples/wmt): cross attention, a shared embedding's attend ------

class EncoderDecoder(nn.Module):
  @nn.compact
  def __call__(self, source, target):
    kernel = nn.with_logical_partitioning(nn.initializers.lecun_normal(), ("embed", "kv"))
    embed = nn.Embed(30, 16, dtype=jnp.bfloat16, embedding_init=nn.with_logical_partitioning(
        nn.initializers.normal(1.0), ("vocab", "embed")))
    encoded = embed(source)
    encoded += nn.MultiHeadDotProductAttention(4, dtype=jnp.bfloat16, kernel_init=kernel)(
        encoded, mask=nn.make_attention_mask(source > 0, source > 0))
    decoded = embed(target)
    decoded += nn.MultiHeadDotProductAttention(4, dtype=jnp.bfloat16, kernel_init=kernel)(
        decoded, encoded, mask=nn.make_attention_mask(target > 0, source > 0))
    decoded = nn.LayerNorm(dtype=jnp.bfloat16)(decoded)
    return embed.attend(decoded.astype(jnp.float32)) / 4.0


@pytest.mark.parametrize("mesh", ["8x1"])
def test_linen_encoder_decoder_shared_embedding(mesh):
  """On 8x1 the rules name "model", of size 1: it splits nothing and moves nothing."""
  model = EncoderDecoder()
  source = jnp.asarray(np.random.default_rng(1).integers(0, 30, (6, 7)), jnp.int32)
  target = jnp.asarray(np.random.default_rng(2).integers(0, 30, (6, 5)), jnp.int32)
  variables = jax.jit(model.init)(jax.random.key(0), source, target)

  def loss_and_grads(params, source, target):
    def loss_fn(params):
      logits = model.apply({"params": params}, source, target)
      return optax.softmax_cross_entropy_with_integer_labels(logits, target).mean()

    return jax.value_and_grad(loss_fn)(params)

  in_specs = (nn.get_partition_spec(variables)["params"], P("batch"), P("batch"))
  assert_partitioned_matches(loss_and_grads, (nn.unbox(variables)["params"], source, target),
                             in_specs, mesh_of(mesh), rules=LM_RULES,
                             reference=jax.jit(loss_and_grads), rtol=3e-2, atol=3e-2)


# --- flax's "Scale up on multiple devices" guide: a sharded TrainState init, then its steps -------

class DotReluDot(nn.Module):
  depth: int

  @nn.compact
  def __call__(self, x):
    init = nn.initializers.xavier_normal()
    y = nn.Dense(self.depth, use_bias=False,
                 kernel_init=nn.with_logical_partitioning(init, ("embed", "hidden")))(x)
    y = nn.with_logical_constraint(nn.relu(y), ("batch", "hidden"))
    w2 = self.param("W2", nn.with_logical_partitioning(init, ("hidden", "embed")),
                    (self.depth, x.shape[-1]))
    return jnp.dot(y, w2)


def test_linen_sharded_train_state_init_from_eval_shape():
  """The state's specs from ``nn.get_partition_spec(jax.eval_shape(init_fn, ...))`` (boxed
  params and optimizer moments), an init partitioned with them as out_specs, then steps."""
  rules = (("batch", "data"), ("hidden", "model"), ("embed", None))
  model, optimizer, mesh = DotReluDot(32), optax.adam(1e-3), mesh_of("2x4")
  x = jnp.asarray(randn(8, 16))

  def init_fn(key, x, model, optimizer):
    variables = model.init(key, x)
    return train_state.TrainState.create(apply_fn=model.apply, params=variables["params"],
                                         tx=optimizer)

  def train_step(state, x):
    grads = jax.grad(lambda p: jnp.mean(state.apply_fn({"params": p}, x) ** 2))(state.params)
    return state.apply_gradients(grads=grads), jnp.zeros(())

  abstract = jax.eval_shape(functools.partial(init_fn, model=model, optimizer=optimizer),
                            jax.random.key(0), x)
  state_spec = nn.get_partition_spec(abstract)
  init = spmd.partition(init_fn, mesh=mesh, in_specs=(P(), P("batch")), out_specs=state_spec,
                        static_argnums=(2, 3), rules=rules)
  state = init(jax.random.key(0), x, model, optimizer)
  want = jax.jit(init_fn, static_argnums=(2, 3))(jax.random.key(0), x, model, optimizer)
  assert_trees_match(state, want)
  assert nn.unbox(state.params)["W2"].sharding.spec == P("model", None)
  step = spmd.partition(train_step, mesh=mesh, in_specs=(state_spec, P("batch")),
                        out_specs=(state_spec, P()), rules=rules)
  train_loop(jax.jit(train_step), step, (state,), [(x,)] * 3, rtol=1e-5, atol=1e-6)


# --- ViT patch embedding (vision_transformer): a conv whose stride is its patch ------------------

class PatchEmbed(nn.Module):
  @nn.compact
  def __call__(self, images):
    x = nn.Conv(16, kernel_size=(4, 4), strides=(4, 4), padding="VALID", name="embedding")(images)
    n, h, w, c = x.shape
    x = x.reshape(n, h * w, c)
    cls = self.param("cls", nn.initializers.zeros, (1, 1, c))
    x = jnp.concatenate([jnp.tile(cls, (n, 1, 1)), x], axis=1)
    x = x + self.param("pos_embedding", nn.initializers.normal(0.02), (1, h * w + 1, c))
    x = nn.MultiHeadDotProductAttention(num_heads=4)(x, x)
    return nn.Dense(10)(nn.LayerNorm()(x[:, 0]))


@pytest.mark.parametrize("mesh,batch,spec", [("1x8", 2, P("data", "model"))])
def test_vit_patch_embedding_grads(mesh, batch, spec):
  """Images split by rows over 8 shards, 2 rows each, fewer than a patch's 4: a patch's rows come
  from two shards (halo exchanges); the class token's gradient pads a one-row dim to 17 rows."""
  model = PatchEmbed()
  images = randn(batch, 16, 16, 3)
  params = jax.jit(model.init)(jax.random.key(0), images)["params"]

  def loss_and_grads(params, images):
    return jax.value_and_grad(lambda p: jnp.mean(model.apply({"params": p}, images) ** 2))(params)

  assert_partitioned_matches(loss_and_grads, (params, images), (None, spec), mesh_of(mesh),
                             reference=jax.jit(loss_and_grads), rtol=1e-4, atol=1e-5)


# --- NNX (the NNX basics / MNIST tutorial) -------------------------------------------------------

class NnxCNN(nnx.Module):
  """The NNX MNIST tutorial's CNN, with BatchNorm and Dropout (nnx.Rngs) added."""

  def __init__(self, *, rngs: nnx.Rngs):
    self.conv1 = nnx.Conv(1, 8, kernel_size=(3, 3), rngs=rngs)
    self.bn = nnx.BatchNorm(8, rngs=rngs)
    self.conv2 = nnx.Conv(8, 16, kernel_size=(3, 3), rngs=rngs)
    self.avg_pool = lambda x: nnx.avg_pool(x, window_shape=(2, 2), strides=(2, 2))
    self.linear1 = nnx.Linear(3 * 3 * 16, 32, rngs=rngs)
    self.dropout = nnx.Dropout(0.25, rngs=rngs)
    self.linear2 = nnx.Linear(32, 10, rngs=rngs)

  def __call__(self, x):
    x = self.avg_pool(nnx.relu(self.bn(self.conv1(x))))
    x = self.avg_pool(nnx.relu(self.conv2(x)))
    x = x.reshape(x.shape[0], -1)
    return self.linear2(self.dropout(nnx.relu(self.linear1(x))))


def nnx_train_step(model, optimizer, metrics, images, labels):
  def loss_fn(model):
    logits = model(images)
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
    return loss, logits

  (loss, logits), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model)
  metrics.update(loss=loss, logits=logits, labels=labels)
  optimizer.update(model, grads)
  return loss


@pytest.mark.parametrize("make,shape,mesh,batch", [(NnxCNN, (12, 12, 1), "8x1", 6)])
def test_nnx_train_step_optimizer_metrics(make, shape, mesh, batch):
  """nnx.Optimizer and nnx.MultiMetric updated in place, BatchNorm's stats and Dropout's rng
  state carried from step to step, as under nnx.jit."""
  def fresh():
    model = make(rngs=nnx.Rngs(0))
    return (model, nnx.Optimizer(model, optax.sgd(0.1, momentum=0.9), wrt=nnx.Param),
            nnx.MultiMetric(accuracy=nnx.metrics.Accuracy(), loss=nnx.metrics.Average("loss")))

  ours, reference = fresh(), fresh()
  step = spmd.partition(nnx_train_step, mesh=mesh_of(mesh),
                        in_specs=(None, None, None, P("data"), P("data")))
  jitted = nnx.jit(nnx_train_step)
  for s in range(3):
    images, labels = randn(batch, *shape, seed=s), jnp.arange(batch) % 10
    assert_trees_match(step(*ours, images, labels), jitted(*reference, images, labels),
                       rtol=1e-4, atol=1e-5)
  for got, want in zip(ours, reference):
    assert_trees_match(nnx.state(got), nnx.state(want), rtol=1e-4, atol=1e-5)
  check_plan(step, *ours, images, labels)
  assert_trees_match(ours[2].compute(), reference[2].compute(), rtol=1e-4, atol=1e-5)


def test_nnx_modules_passed_by_keyword_are_updated():
  """``train_step(model=..., optimizer=..., batch=...)``: the modules were not written back."""
  def step(model, optimizer, batch):
    def loss_fn(model):
      logits = model(batch["image"])
      return optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()

    loss, grads = nnx.value_and_grad(loss_fn)(model)
    optimizer.update(model, grads)
    return loss

  def fresh():
    model = nnx.Linear(12, 10, rngs=nnx.Rngs(0))
    return model, nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)

  (model, optimizer), reference = fresh(), fresh()
  partitioned = spmd.partition(step, mesh=mesh_of("2x4"), in_specs=(None, None, P("data")))
  batch = {"image": randn(8, 12), "label": jnp.arange(8) % 10}
  for _ in range(2):
    assert_trees_match(partitioned(model, optimizer=optimizer, batch=batch),
                       nnx.jit(step)(*reference, batch), rtol=1e-5, atol=1e-6)
  assert_trees_match(nnx.state(model), nnx.state(reference[0]), rtol=1e-5, atol=1e-6)
  check_plan(partitioned, model, optimizer=optimizer, batch=batch)


def test_nnx_modules_donated_as_under_nnx_jit():
  """donate_argnums over modules donates their state, as nnx.jit's: the old param buffers are
  reused for the new ones, which the modules hold after the call."""
  def step(model, optimizer, x):
    grads = nnx.grad(lambda m: (m(x) ** 2).mean())(model)
    optimizer.update(model, grads)
    return model(x).sum()

  def fresh():
    model = nnx.Linear(12, 16, rngs=nnx.Rngs(0))
    return model, nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)

  (model, optimizer), reference = fresh(), fresh()
  partitioned = spmd.partition(step, mesh=mesh_of("2x4"), in_specs=(None, None, P("data")),
                               donate_argnums=(0, 1))
  x = randn(8, 12)
  old = model.kernel[...]
  assert_trees_match(partitioned(model, optimizer, x), nnx.jit(step)(*reference, x), rtol=1e-5)
  assert old.is_deleted() and not model.kernel[...].is_deleted()
  assert_trees_match(nnx.state(model), nnx.state(reference[0]), rtol=1e-5, atol=1e-6)


def test_nnx_module_with_static_argnums_takes_in_specs_of_the_non_static_arguments():
  """As without modules, in_specs name the non-static arguments: an NNX call counted the static
  one too and refused (model, x, power) with in_specs (None, P("data"))."""
  def forward(model, x, power):
    return model(x) ** power

  model = nnx.Linear(12, 4, rngs=nnx.Rngs(0))
  partitioned = spmd.partition(forward, mesh=mesh_of("2x4"), in_specs=(None, P("data")),
                               static_argnums=2)
  x = randn(8, 12)
  assert_trees_match(partitioned(model, x, 3), nnx.jit(forward, static_argnums=2)(model, x, 3),
                     rtol=1e-5, atol=1e-6)
  check_plan(partitioned, model, x, 3)


# --- NNX toy example 10 (FSDP and optimizer): a hand-written optimizer sharing the model's params --

class ShardedMLP(nnx.Module):
  def __init__(self, rngs: nnx.Rngs):
    init = nnx.initializers.lecun_normal()
    self.w1 = nnx.Param(init(rngs.params(), (1, 32)), out_sharding=(None, "model"))
    self.b1 = nnx.Param(jnp.zeros((32,)), out_sharding=("model",))
    self.w2 = nnx.Param(init(rngs.params(), (32, 1)), out_sharding=("model", None))

  def __call__(self, x):
    return nnx.relu(x @ self.w1 + self.b1) @ self.w2


class MomentumState(nnx.Variable):
  pass


class MomentumSGD(nnx.Pytree):
  def __init__(self, params: nnx.State, lr: float, decay: float = 0.9):
    self.lr, self.decay = lr, decay
    self.params = nnx.data(params)  # the model's own variables
    self.momentum = nnx.data(jax.tree.map(
        lambda v: MomentumState(jnp.zeros_like(v[...]), **v.get_metadata()), self.params,
        is_leaf=lambda x: isinstance(x, nnx.Variable)))

  def update(self, grads: nnx.State):
    def update_fn(param, momentum, grad):
      momentum[...] = self.decay * momentum[...] + (1 - self.decay) * grad[...]
      param[...] -= self.lr * momentum[...]

    jax.tree.map(update_fn, self.params, self.momentum, grads,
                 is_leaf=lambda x: isinstance(x, nnx.Variable))


def test_nnx_modules_returned_keep_shared_variables():
  """``create_model`` returns a model and an optimizer holding the model's own variables: they
  come back shared (as from nnx.jit), so the optimizer's updates train the model."""
  def create_model():
    model = ShardedMLP(nnx.Rngs(0))
    return model, MomentumSGD(nnx.variables(model, nnx.Param), 0.01)

  def train_step(model, optimizer, x, y):
    loss, grads = nnx.value_and_grad(lambda m: jnp.mean((y - m(x)) ** 2))(model)
    optimizer.update(grads)
    return loss

  mesh = mesh_of("2x4")
  model, optimizer = spmd.partition(create_model, mesh=mesh)()
  assert optimizer.params["w1"] is model.w1
  assert model.w1[...].sharding.spec == P(None, "model")
  with jax.set_mesh(mesh):
    reference = nnx.jit(create_model)()
  step = spmd.partition(train_step, mesh=mesh, in_specs=(None, None, P("data"), P("data")))
  jitted = nnx.jit(train_step)
  x = np.linspace(-2, 2, 32, dtype=np.float32)[:, None]
  for s in range(3):
    y = 0.8 * x ** 2 + 0.1 * s
    with jax.set_mesh(mesh):
      want = jitted(*reference, x, y)
    assert_trees_match(step(model, optimizer, x, y), want, rtol=1e-5, atol=1e-6)
  assert_trees_match(nnx.state(model), nnx.state(reference[0]), rtol=1e-5, atol=1e-6)
  check_plan(step, model, optimizer, x, y)


# --- NNX Transformer with logical names (nnx.with_partitioning) resolved by rules ---------------

NNX_RULES = (("batch", "data"), ("vocab", "model"), ("mlp", "model"), ("heads", "model"),
             ("embed", None), ("kv", None))


class NnxBlock(nnx.Module):
  def __init__(self, rngs: nnx.Rngs):
    init = nnx.initializers.lecun_normal()
    self.attention = nnx.MultiHeadAttention(
        num_heads=4, in_features=16, decode=False, rngs=rngs,
        kernel_init=nnx.with_partitioning(init, ("embed", "heads", "kv")),
        out_kernel_init=nnx.with_partitioning(init, ("heads", "kv", "embed")))
    self.norm = nnx.LayerNorm(16, rngs=rngs)
    self.up = nnx.Linear(16, 32, kernel_init=nnx.with_partitioning(init, ("embed", "mlp")),
                         rngs=rngs)
    self.down = nnx.Linear(32, 16, kernel_init=nnx.with_partitioning(init, ("mlp", "embed")),
                           rngs=rngs)
    self.dropout = nnx.Dropout(0.1, rngs=rngs)

  def __call__(self, x, mask):
    x = x + self.dropout(self.attention(self.norm(x), mask=mask))
    return x + self.down(nnx.relu(self.up(x)))


class NnxLM(nnx.Module):
  def __init__(self, rngs: nnx.Rngs):
    self.embed = nnx.Embed(24, 16, rngs=rngs, embedding_init=nnx.with_partitioning(
        nnx.initializers.normal(1.0), ("vocab", "embed")))
    self.blocks = nnx.List([NnxBlock(rngs)])

  def __call__(self, tokens):
    x, mask = self.embed(tokens), nnx.make_causal_mask(tokens)
    for block in self.blocks:
      x = block(x, mask)
    return self.embed.attend(x)


def lm_train_step(model, optimizer, tokens):
  """A language model's next-token cross-entropy step through an ``nnx.Optimizer``."""
  def loss_fn(model):
    logits = model(tokens[:, :-1])
    return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()

  loss, grads = nnx.value_and_grad(loss_fn)(model)
  optimizer.update(model, grads)
  return loss


def test_nnx_transformer_logical_names_with_rules():
  def fresh():
    with nnx.use_eager_sharding(False):  # the names stay metadata: spmd resolves them
      model = NnxLM(nnx.Rngs(0))
      return model, nnx.Optimizer(model, optax.sgd(0.1, momentum=0.9), wrt=nnx.Param)

  ours, reference = fresh(), fresh()
  partitioned = spmd.partition(lm_train_step, mesh=mesh_of("2x4"),
                               in_specs=(None, None, P("batch")), rules=NNX_RULES)
  jitted = nnx.jit(lm_train_step)
  tokens = jnp.asarray(np.random.default_rng(0).integers(1, 24, (4, 9)), jnp.int32)
  for s in range(3):
    batch = jnp.roll(tokens, s, axis=1)
    assert_trees_match(partitioned(*ours, batch), jitted(*reference, batch), rtol=1e-4,
                       atol=1e-5)
  assert_trees_match(nnx.state(ours[0]), nnx.state(reference[0]), rtol=1e-4, atol=1e-5)
  plan = check_plan(partitioned, *ours, tokens)
  state_specs = plan.in_specs[0][0]
  assert state_specs["embed"]["embedding"].get_value() == P("model", None)
  assert state_specs["blocks"][0]["up"]["kernel"].get_value() == P(None, "model")


# --- NNX scan over stacked layers (nnx.vmap to create, nnx.scan to apply) ------------------------

class Block(nnx.Module):
  def __init__(self, rngs: nnx.Rngs):
    self.linear = nnx.Linear(16, 16, rngs=rngs)
    self.norm = nnx.LayerNorm(16, rngs=rngs)

  def __call__(self, x):
    return x + nnx.gelu(self.linear(self.norm(x)))


class ScannedMLP(nnx.Module):
  def __init__(self, layers: int, rngs: nnx.Rngs):
    @nnx.split_rngs(splits=layers)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def create(rngs):
      return Block(rngs)

    self.blocks = create(rngs)
    self.head = nnx.Linear(16, 4, rngs=rngs)

  def __call__(self, x):
    @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry)
    def forward(x, block):
      return block(x)

    return self.head(forward(x, self.blocks))


@pytest.mark.parametrize("mesh,batch", [("8x1", 6)])
def test_nnx_scan_over_stacked_layers(mesh, batch):
  def step(model, optimizer, x, y):
    loss, grads = nnx.value_and_grad(lambda m: jnp.mean((m(x) - y) ** 2))(model)
    optimizer.update(model, grads)
    return loss

  def fresh():
    model = ScannedMLP(3, nnx.Rngs(0))
    return model, nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)

  ours, reference = fresh(), fresh()
  partitioned = spmd.partition(step, mesh=mesh_of(mesh), in_specs=(None, None, P("data"), P("data")))
  jitted = nnx.jit(step)
  for s in range(3):
    x, y = randn(batch, 16, seed=s), randn(batch, 4, seed=s + 10)
    assert_trees_match(partitioned(*ours, x, y), jitted(*reference, x, y), rtol=1e-4, atol=1e-5)
  assert_trees_match(nnx.state(ours[0]), nnx.state(reference[0]), rtol=1e-4, atol=1e-5)
  check_plan(partitioned, *ours, x, y)
