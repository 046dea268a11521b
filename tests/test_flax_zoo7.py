"""flax's own examples, an eleventh round (google/flax examples/ and the NNX guides), small and
written as their users write them, run through spmd.partition on the ("data", "model") meshes:
a gemma-style NNX block whose grouped-query attention is ``jax.nn.dot_product_attention`` over 6
query and 3 key/value heads, both uneven over "model", trained by ``nnx.Optimizer`` of
``optax.chain(clip_by_global_norm, adamw)`` on a schedule with a weight-decay mask; NNX's
optimizer guide's gradient accumulation (``optax.MultiSteps``), ``optax.masked`` weight decay and
an EMA copy of the model updated in the step; ``nnx.LoRA`` adapters over a base ``nnx.Linear``
split over "model", only the adapters trained (``nnx.DiffState``); seq2seq's LSTM encoder-decoder
(``nn.RNN``, ``nn.scan``) teacher-forced into a cross-entropy over a vocabulary uneven over
"model"; and wmt-style decoding with ``nnx.MultiHeadAttention(decode=True)`` and ``init_cache``,
heads over "model" and the batch over "data", several steps fed back from Python.
Each is checked against the jitted unpartitioned step, step by step where the state is fed back,
then its plan against the compiled program (helpers.train_loop / nnx_steps / check_plan)."""
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from flax.training import train_state
from jax.sharding import PartitionSpec as P

import spmd
from helpers import (as_mesh, assert_trees_match, check_plan, mesh_of, nnx_steps, no_more_than_xla,
                     randn, train_loop)
from test_flax_examples import lm_train_step  # next-token cross-entropy through nnx.Optimizer

MESH_4X2 = {"data": 4, "model": 2}


def sharded(*names):
  """lecun_normal, its dims named by mesh axes (the NNX sharding guide's kernel_init)."""
  return nnx.with_partitioning(nnx.initializers.lecun_normal(), names)


def tokens_of(batch: int, length: int, vocab: int, seed: int = 0) -> jax.Array:
  return jnp.asarray(np.random.default_rng(seed).integers(1, vocab, (batch, length)), jnp.int32)


# --- gemma-style block: RMSNorm, RoPE, grouped-query jax.nn.dot_product_attention, gated MLP -----

EMBED, HEADS, KV_HEADS, HEAD_DIM, GQA_VOCAB = 16, 6, 3, 4, 20


def rope(x, positions, max_wavelength: float = 10_000.0):
  """Rotary embedding of x [B, T, N, H] at positions [T]."""
  half = x.shape[-1] // 2
  timescale = max_wavelength ** (2 * jnp.arange(half) / x.shape[-1])
  angle = (positions[:, None] / timescale)[:, None, :]
  sin, cos = jnp.sin(angle), jnp.cos(angle)
  first, second = jnp.split(x, 2, axis=-1)
  return jnp.concatenate([first * cos - second * sin, second * cos + first * sin], axis=-1)


class GqaBlock(nnx.Module):
  """One pre-norm block: 6 query heads over 3 key/value heads (jax.nn.dot_product_attention
  groups them), the heads over "model" (uneven over 4), a gated GeLU MLP."""

  def __init__(self, rngs: nnx.Rngs):
    self.embed = nnx.Embed(GQA_VOCAB, EMBED, rngs=rngs)
    self.attention_norm, self.mlp_norm = nnx.RMSNorm(EMBED, rngs=rngs), nnx.RMSNorm(EMBED,
                                                                                    rngs=rngs)
    self.q = nnx.LinearGeneral(EMBED, (HEADS, HEAD_DIM), use_bias=False, rngs=rngs,
                               kernel_init=sharded(None, "model", None))
    self.kv = nnx.LinearGeneral(EMBED, (2, KV_HEADS, HEAD_DIM), use_bias=False, rngs=rngs,
                                kernel_init=sharded(None, None, "model", None))
    self.out = nnx.LinearGeneral((HEADS, HEAD_DIM), EMBED, axis=(-2, -1), use_bias=False,
                                 rngs=rngs, kernel_init=sharded("model", None, None))
    self.gate = nnx.Linear(EMBED, 32, use_bias=False, rngs=rngs, kernel_init=sharded(None, "model"))
    self.up = nnx.Linear(EMBED, 32, use_bias=False, rngs=rngs, kernel_init=sharded(None, "model"))
    self.down = nnx.Linear(32, EMBED, use_bias=False, rngs=rngs, kernel_init=sharded("model", None))

  def __call__(self, tokens):
    x = self.embed(tokens)
    positions = jnp.arange(tokens.shape[1])
    h = self.attention_norm(x)
    q = rope(self.q(h), positions)
    kv = self.kv(h)
    k, v = rope(kv[:, :, 0], positions), kv[:, :, 1]
    x = x + self.out(jax.nn.dot_product_attention(q, k, v, is_causal=True))
    h = self.mlp_norm(x)
    x = x + self.down(nnx.gelu(self.gate(h)) * self.up(h))
    return self.embed.attend(x)


def decay_where(decays):
  """A weight-decay mask over an NNX params state: True at the variables whose name
  ``decays(name)`` accepts (each leaf's path ends in its variable's name, then ``.value``)."""
  return lambda params: jax.tree_util.tree_map_with_path(
      lambda path, _: decays(path[-2].key), params)


def test_gemma_style_gqa_uneven_heads_clipped_adamw_schedule():
  """3 steps on 2x4: q's 6 heads and k/v's 3 split 2,2,2,0 and 1,1,1,0 over "model"."""
  schedule = optax.warmup_cosine_decay_schedule(0.0, 1e-2, warmup_steps=1, decay_steps=4)

  def fresh():
    with nnx.use_eager_sharding(False):  # the names stay metadata: spmd reads them
      model = GqaBlock(nnx.Rngs(0))
      decayed = decay_where(lambda name: name != "scale")  # not the norms' scales
      tx = optax.chain(optax.clip_by_global_norm(1.0),
                       optax.adamw(schedule, weight_decay=0.1, mask=decayed))
      return model, nnx.Optimizer(model, tx, wrt=nnx.Param)

  batches = [(tokens_of(4, 7, GQA_VOCAB, seed=s),) for s in range(3)]
  nnx_steps(lm_train_step, fresh, mesh_of("2x4"), (None, None, P("data")), batches)


# --- NNX optimizer guide: gradient accumulation, masked weight decay, an EMA copy of the model ---

class Mlp(nnx.Module):
  def __init__(self, rngs: nnx.Rngs):
    self.up = nnx.Linear(12, 16, rngs=rngs, kernel_init=sharded(None, "model"))
    self.norm = nnx.LayerNorm(16, rngs=rngs)
    self.down = nnx.Linear(16, 4, rngs=rngs, kernel_init=sharded("model", None))

  def __call__(self, x):
    return self.down(self.norm(nnx.relu(self.up(x))))


def accumulating_step(model, optimizer, ema, x, y):
  """A step of the accumulated optimizer, then the EMA copy moved toward the params (as the
  optimizer guide keeps an ``nnx.clone`` of the model and ``nnx.update``s it)."""
  loss, grads = nnx.value_and_grad(lambda m: jnp.mean((m(x) - y) ** 2))(model)
  optimizer.update(model, grads)
  averaged = jax.tree.map(lambda e, p: 0.9 * e + 0.1 * p, nnx.state(ema, nnx.Param),
                          nnx.state(model, nnx.Param))
  nnx.update(ema, averaged)
  return loss


def test_nnx_optimizer_multisteps_masked_decay_and_ema_copy():
  """4 steps on 4x2, the optimizer applying every second; 6 rows over 4 "data" shards."""
  def fresh():
    with nnx.use_eager_sharding(False):
      model = Mlp(nnx.Rngs(0))
      kernels = decay_where(lambda name: name == "kernel")
      tx = optax.MultiSteps(optax.chain(
          optax.clip_by_global_norm(1.0), optax.masked(optax.add_decayed_weights(0.1), kernels),
          optax.adam(optax.exponential_decay(1e-2, 2, 0.5))), every_k_schedule=2)
      return model, nnx.Optimizer(model, tx, wrt=nnx.Param), nnx.clone(model)

  batches = [(randn(6, 12, seed=s), randn(6, 4, seed=s + 10)) for s in range(4)]
  nnx_steps(accumulating_step, fresh, as_mesh(MESH_4X2), (None, None, None, P("data"), P("data")),
            batches)


# --- LoRA (the NNX LoRA guide): nnx.LoRA adapters around a base model split over "model" --------

class AdaptedMlp(nnx.Module):
  """Two ``nnx.LoRA`` adapters (rank 3) whose base ``nnx.Linear``s are a column- and a
  row-split kernel over a hidden dim of 20 (uneven over 8); lora_b / lora_a follow them."""

  def __init__(self, rngs: nnx.Rngs):
    up = nnx.Linear(16, 20, rngs=rngs, kernel_init=sharded(None, "model"))
    down = nnx.Linear(20, 16, rngs=rngs, kernel_init=sharded("model", None))
    nonzero = nnx.initializers.normal(0.1)  # so the first step trains lora_a too
    self.up = nnx.LoRA(16, 3, 20, base_module=up, rngs=rngs, b_initializer=nonzero,
                       b_metadata={"out_sharding": (None, "model")})
    self.down = nnx.LoRA(20, 3, 16, base_module=down, rngs=rngs, b_initializer=nonzero,
                         a_metadata={"out_sharding": ("model", None)})

  def __call__(self, x):
    return self.down(nnx.relu(self.up(x)))


def adapter_step(model, optimizer, x, y):
  diff = nnx.DiffState(0, nnx.LoRAParam)
  loss, grads = nnx.value_and_grad(lambda m: jnp.mean((m(x) - y) ** 2), argnums=diff)(model)
  optimizer.update(model, grads)
  return loss


def test_nnx_lora_adapters_over_a_split_base_model():
  def fresh():
    with nnx.use_eager_sharding(False):
      model = AdaptedMlp(nnx.Rngs(0))
      return model, nnx.Optimizer(model, optax.adamw(1e-2), wrt=nnx.LoRAParam)

  batches = [(randn(8, 16, seed=s), randn(8, 16, seed=s + 10)) for s in range(3)]
  _, (model, _) = nnx_steps(adapter_step, fresh, mesh_of("1x8"), (None, None, P("data"),
                                                                  P("data")), batches)
  base = nnx.All(nnx.Param, nnx.Not(nnx.LoRAParam))
  with nnx.use_eager_sharding(False):
    untrained = AdaptedMlp(nnx.Rngs(0))
  assert_trees_match(nnx.state(model, base), nnx.state(untrained, base))


# --- seq2seq (examples/seq2seq): LSTM encoder-decoder, teacher forcing, an uneven vocabulary -----

SEQ_VOCAB = 13  # over "model" of 4: 4, 4, 4, 1
SEQ_RULES = (("batch", "data"), ("vocab", "model"), ("embed", None), ("hidden", None))


class TeacherForcedCell(nn.Module):
  """One decoder step reading the embedded target token, predicting the next one's logits over
  the vocabulary (its kernel named "vocab")."""
  features: int

  @nn.compact
  def __call__(self, carry, x):
    carry, y = nn.OptimizedLSTMCell(self.features)(carry, x)
    kernel_init = nn.with_logical_partitioning(nn.initializers.lecun_normal(), ("hidden", "vocab"))
    return carry, nn.Dense(SEQ_VOCAB, kernel_init=kernel_init)(y)


class Seq2seqLM(nn.Module):
  features: int = 16

  @nn.compact
  def __call__(self, inputs, targets):
    """inputs [B, S], targets [B, T] token ids (targets[:, 0] the start token): logits
    [B, T - 1, SEQ_VOCAB] for targets[:, 1:]."""
    embed = nn.Embed(SEQ_VOCAB, 8, embedding_init=nn.with_logical_partitioning(
        nn.initializers.normal(1.0), ("vocab", "embed")))
    carry, _ = nn.RNN(nn.OptimizedLSTMCell(self.features), return_carry=True)(embed(inputs))
    decoder = nn.scan(TeacherForcedCell, variable_broadcast="params", split_rngs={"params": False},
                      in_axes=1, out_axes=1)
    _, logits = decoder(self.features)(carry, embed(targets[:, :-1]))
    return logits


def seq2seq_step(state, inputs, targets):
  def loss_fn(params):
    logits = state.apply_fn({"params": params}, inputs, targets)
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets[:, 1:]).mean()

  loss, grads = jax.value_and_grad(loss_fn)(state.params)
  return state.apply_gradients(grads=grads), loss


def test_seq2seq_integer_targets_vocabulary_uneven_over_model():
  """3 steps on 2x4 of a state holding the boxed params as flax's examples do (their logical
  names resolved by the rules): the embedding and output kernel split 4, 4, 4, 1 along vocab."""
  inputs, targets = tokens_of(4, 5, SEQ_VOCAB), tokens_of(4, 6, SEQ_VOCAB, seed=1)
  model = Seq2seqLM()
  params = jax.jit(model.init)(jax.random.key(0), inputs, targets)["params"]
  state = train_state.TrainState.create(apply_fn=model.apply, params=params, tx=optax.adam(1e-2))
  step = spmd.partition(seq2seq_step, mesh=mesh_of("2x4"), in_specs=(None, P("batch"), P("batch")),
                        rules=SEQ_RULES)
  batches = [(jnp.roll(inputs, s, axis=1), jnp.roll(targets, s, axis=0)) for s in range(3)]
  train_loop(jax.jit(seq2seq_step), step, (state,), batches, rtol=1e-4, atol=1e-5)


# --- wmt / lm1b decoding: nnx.MultiHeadAttention(decode=True), its cache made by init_cache -----

class GqaDecoder(nnx.Module):
  """Embedding, one grouped-query decoding attention (4 query heads and 2 key/value heads over
  "model": uneven over its 4 on 2x4) and the tied output."""

  def __init__(self, rngs: nnx.Rngs):
    self.embed = nnx.Embed(GQA_VOCAB, EMBED, rngs=rngs)
    self.norm = nnx.RMSNorm(EMBED, rngs=rngs)
    self.attention = nnx.MultiHeadAttention(
        num_heads=4, num_kv_heads=2, in_features=EMBED, decode=True, rngs=rngs,
        kernel_metadata={"out_sharding": (None, "model", None)},
        out_kernel_metadata={"out_sharding": ("model", None, None)})

  def __call__(self, token):
    x = self.embed(token)
    return self.embed.attend(x + self.attention(self.norm(x)))


def greedy_step(model, token):
  """One decoding step: the token's keys and values written into the cache, the next token."""
  return jnp.argmax(model(token), axis=-1).astype(jnp.int32)


def test_nnx_gqa_decode_cache_fed_back_from_python():
  """5 steps on 4x2, each a partitioned call whose cache the module keeps, the sampled token fed
  back; 6 sequences over 4 "data" shards (the cache's batch uneven)."""
  batch = 6

  def fresh():
    with nnx.use_eager_sharding(False):
      model = GqaDecoder(nnx.Rngs(0))
      model.attention.init_cache((batch, 6, EMBED))
      return model

  ours, reference = fresh(), fresh()
  step = spmd.partition(greedy_step, mesh=as_mesh(MESH_4X2), in_specs=(None, P("data")))
  jitted = nnx.jit(greedy_step)
  token = tokens_of(batch, 1, GQA_VOCAB)
  for _ in range(5):
    got, want = step(ours, token), jitted(reference, token)
    assert_trees_match(got, want)
    token = want
  assert_trees_match(nnx.state(ours), nnx.state(reference), rtol=1e-5, atol=1e-6)
  check_plan(step, fresh(), token)


def split_decode_step(graphdef, state, token):
  """The NNX performance guide's form of ``greedy_step``: the model split once outside, merged in
  the step, its state (params unchanged, the cache written) returned."""
  model = nnx.merge(graphdef, state)
  return greedy_step(model, token), nnx.state(model)


def test_nnx_split_decode_step_returns_uneven_params_without_gathering():
  """The k and v kernels f32[16,2,4] P(None,'model',None), uneven over 4, come back unchanged:
  they arrive whole and are sliced on entry, as XLA takes them (2048 B per device, XLA 2752 B;
  padded and split before the program they were gathered again, 1024 B each, 4096 B in all)."""
  with nnx.use_eager_sharding(False):
    model = GqaDecoder(nnx.Rngs(0))
    model.attention.init_cache((4, 6, EMBED))
  graphdef, state = nnx.split(model)
  specs = jax.tree.map(lambda v: v.get_value(), nnx.get_partition_spec(state),
                       is_leaf=lambda x: isinstance(x, nnx.Variable))
  no_more_than_xla(functools.partial(split_decode_step, graphdef),
                   (state, tokens_of(4, 1, GQA_VOCAB)), (specs, P("data")), mesh_of("2x4"))
