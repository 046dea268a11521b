"""flax's own examples, a fourth round (google/flax examples/ and the NNX guides), small and
written as their users write them, run through spmd.partition on the ("data", "model") meshes:
layers the earlier rounds left out (depthwise and circular convolutions, transposed
convolutions, GroupNorm, Dropout with broadcast dims, SpectralNorm / WeightNorm, attention masks,
nnx.Einsum / LinearGeneral / RMSNorm), wmt's beam search, a Gemma-style sampler with
temperature and top-p, and the NNX toy examples (array leaves and parameter surgery, FSDP with
a hand-written optimizer, scan over layers whose params name a "layers" axis).
Each is checked against the unpartitioned step, step by step where a loop feeds the state back
(helpers.train_loop / nnx_steps / check_plan)."""
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from flax.training import train_state
from jax import lax
from jax.sharding import PartitionSpec as P

import spmd
from helpers import (assert_partitioned_matches, assert_trees_match, check_plan, mesh_of,
                     nnx_steps, randn, train_loop)
from test_flax_workloads import (GEMMA_RULES, HEAD_DIM, KV_HEADS, VOCAB, decode_loop,
                                 fresh_gemma)


# --- linen convolution zoo: depthwise + circular, transposed, GroupNorm, broadcast dropout -------

class ConvZoo(nn.Module):
  """A MobileNet-style depthwise block with circular padding, GroupNorm, dropout whose mask is
  shared along the width (``broadcast_dims``), and a transposed convolution upsampling back."""

  @nn.compact
  def __call__(self, x, train: bool):
    x = nn.Conv(8, (3, 3), padding="SAME")(x)
    x = nn.Conv(8, (3, 3), feature_group_count=8, padding="CIRCULAR")(x)  # depthwise
    x = nn.GroupNorm(num_groups=4)(x)
    x = nn.Dropout(0.25, broadcast_dims=(2,), deterministic=not train)(nn.swish(x))
    x = nn.ConvTranspose(4, (2, 2), strides=(2, 2))(x)
    x = nn.WeightNorm(nn.Conv(3, (1, 1)))(x)
    return x


def conv_zoo_step(state, images, targets, key):
  def loss_fn(params):
    out = state.apply_fn({"params": params}, images, True, rngs={"dropout": key})
    return jnp.mean((out - targets) ** 2)

  loss, grads = jax.value_and_grad(loss_fn)(state.params)
  return state.apply_gradients(grads=grads), loss


@pytest.mark.parametrize("mesh,batch", [("8x1", 6)])
def test_linen_depthwise_circular_transposed_conv_groupnorm(mesh, batch):
  model = ConvZoo()
  images = randn(batch, 8, 8, 3)
  params = jax.jit(model.init, static_argnums=2)(jax.random.key(0), images, False)["params"]
  state = train_state.TrainState.create(apply_fn=model.apply, params=params, tx=optax.adam(1e-2))
  keys = jax.random.split(jax.random.key(1), 3)
  batches = [(randn(batch, 8, 8, 3, seed=s), randn(batch, 16, 16, 3, seed=s + 5), keys[s])
             for s in range(3)]
  step = spmd.partition(conv_zoo_step, mesh=mesh_of(mesh),
                        in_specs=(None, P("data"), P("data"), P()))
  plan = train_loop(jax.jit(conv_zoo_step), step, (state,), batches, rtol=1e-4, atol=1e-5)
  assert {c.axes for c in plan.collectives} <= {("data",), ("data", "model")}


@pytest.mark.parametrize("mesh,batch,height", [("1x8", 1, 12)])
def test_linen_conv_zoo_eval_with_rows_split(mesh, batch, height):
  """The image's rows over "model" (12 rows over 8: uneven): the circular padding wraps the
  first and last shards' halos around, the transposed convolution's rows stay local."""
  model = ConvZoo()
  images = randn(batch, height, 8, 3)
  params = jax.jit(model.init, static_argnums=2)(jax.random.key(0), images, False)["params"]
  apply = lambda params, images: model.apply({"params": params}, images, False)
  plan = assert_partitioned_matches(apply, (params, images), (None, P("data", "model")),
                                    mesh_of(mesh), out_specs=P("data", "model"), rtol=1e-4,
                                    atol=1e-5)
  assert {c.kind for c in plan.collectives} <= {"collective-permute", "all-reduce"}


# --- linen attention with flax's masks, a tied embedding and SpectralNorm, by logical rules ------

ATTN_RULES = (("batch", "data"), ("vocab", "model"), ("heads", "model"), ("mlp", "model"),
              ("embed", None), ("length", None))


def logical(init, names):
  return nn.with_logical_partitioning(init, names)


class MaskedDecoder(nn.Module):
  """Self-attention under ``make_causal_mask`` & ``make_attention_mask`` of the padding (combined
  by ``combine_masks``), an MLP whose output kernel is spectrally normalised (its power
  iteration's vector in "batch_stats"), and logits from the embedding table (``Embed.attend``)."""
  vocab: int = 24
  dim: int = 16

  @nn.compact
  def __call__(self, tokens, train: bool):
    embed = nn.Embed(self.vocab, self.dim,
                     embedding_init=logical(nn.initializers.normal(1.0), ("vocab", "embed")))
    x = nn.with_logical_constraint(embed(tokens), ("batch", "length", "embed"))
    mask = nn.combine_masks(nn.make_causal_mask(tokens),
                            nn.make_attention_mask(tokens > 0, tokens > 0))
    kernel = nn.initializers.lecun_normal()
    # DenseGeneral draws and constrains its kernel flattened to 2-D: two names. No biases, as
    # lm1b's: the key bias's gradient is zero but for rounding, which Adam would scale up
    x = x + nn.MultiHeadDotProductAttention(
        num_heads=4, use_bias=False, kernel_init=logical(kernel, ("embed", "heads")),
        out_kernel_init=logical(kernel, ("heads", "embed")))(nn.LayerNorm()(x), mask=mask)
    h = nn.gelu(nn.Dense(32, kernel_init=logical(kernel, ("embed", "mlp")))(x))
    # a plain kernel: SpectralNorm's path walk fails on a boxed one (flax 0.12)
    x = x + nn.SpectralNorm(nn.Dense(self.dim))(h, update_stats=train)
    return embed.attend(nn.LayerNorm()(x))


class SpectralState(train_state.TrainState):
  batch_stats: dict


def masked_lm_step(state, tokens):
  def loss_fn(params):
    logits, updates = state.apply_fn({"params": params, "batch_stats": state.batch_stats},
                                     tokens[:, :-1], True, mutable=["batch_stats"])
    weights = tokens[:, 1:] > 0
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:])
    return jnp.sum(loss * weights) / jnp.sum(weights), updates["batch_stats"]

  (loss, stats), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
  return state.apply_gradients(grads=grads).replace(batch_stats=stats), loss


@pytest.mark.parametrize("mesh,batch", [("2x4", 4)])
def test_linen_attention_masks_tied_embedding_spectral_norm(mesh, batch):
  model = MaskedDecoder()
  tokens = jnp.asarray(np.random.default_rng(0).integers(1, 24, (batch, 9)), jnp.int32)
  tokens = tokens.at[0, 6:].set(0)  # padding: masked keys, unweighted targets
  variables = jax.jit(model.init, static_argnums=2)(jax.random.key(0), tokens[:, :-1], False)
  # lm1b's way: the state made from boxed params, its specs read off the boxes' logical names
  boxed = SpectralState.create(apply_fn=model.apply, params=variables["params"],
                               tx=optax.adamw(1e-2), batch_stats=variables["batch_stats"])
  state, state_specs = nn.unbox(boxed), nn.get_partition_spec(boxed)
  batches = [(jnp.roll(tokens, s, axis=1),) for s in range(3)]
  step = spmd.partition(masked_lm_step, mesh=mesh_of(mesh), in_specs=(state_specs, P("batch")),
                        rules=ATTN_RULES)
  plan = train_loop(jax.jit(masked_lm_step), step, (state,), batches, rtol=1e-4, atol=1e-5)
  vocab_axis = "model" if mesh_of(mesh).shape["model"] > 1 else None
  assert plan.in_specs[0].params["Embed_0"]["embedding"] == P(vocab_axis, None)


# --- lm1b_nnx-style LM: nnx.LinearGeneral heads, nnx.Einsum MLP, nnx.RMSNorm, dropout keys -------

LM_RULES = (("batch", "data"), ("vocab", "model"), ("heads", "model"), ("mlp", "model"),
            ("embed", None), ("kv", None))
DIM, HEADS, KV = 16, 4, 4


def names(*axes):
  return {"out_sharding": axes}


class NnxZooBlock(nnx.Module):
  def __init__(self, rngs: nnx.Rngs):
    self.norm = nnx.RMSNorm(DIM, rngs=rngs, scale_init=nnx.with_partitioning(
        nnx.initializers.ones_init(), ("embed",)))
    self.qkv = nnx.List([nnx.LinearGeneral(DIM, (HEADS, KV), use_bias=False, rngs=rngs,
                                           kernel_metadata=names("embed", "heads", "kv"))
                for _ in range(3)])
    self.out = nnx.LinearGeneral((HEADS, KV), DIM, axis=(-2, -1), rngs=rngs,
                                 kernel_metadata=names("heads", "kv", "embed"))
    init = nnx.initializers.lecun_normal()
    self.up = nnx.Einsum("btd,df->btf", (DIM, 32), (32,), rngs=rngs,
                         kernel_init=nnx.with_partitioning(init, ("embed", "mlp")),
                         bias_init=nnx.with_partitioning(nnx.initializers.zeros_init(), ("mlp",)))
    self.down = nnx.Einsum("btf,fd->btd", (32, DIM), rngs=rngs,
                           kernel_init=nnx.with_partitioning(init, ("mlp", "embed")))
    self.dropout = nnx.Dropout(0.1)

  def __call__(self, x, mask, rngs):
    q, k, v = (proj(self.norm(x)) for proj in self.qkv)
    x = x + self.dropout(self.out(nnx.dot_product_attention(q, k, v, mask=mask)), rngs=rngs)
    return x + self.dropout(self.down(nnx.gelu(self.up(self.norm(x)))), rngs=rngs)


class NnxZooLM(nnx.Module):
  def __init__(self, rngs: nnx.Rngs):
    self.embed = nnx.Embed(24, DIM, rngs=rngs, embedding_init=nnx.with_partitioning(
        nnx.initializers.normal(1.0), ("vocab", "embed")))
    self.blocks = nnx.List([NnxZooBlock(rngs)])
    self.final_norm = nnx.RMSNorm(DIM, rngs=rngs)

  def __call__(self, tokens, rngs: nnx.Rngs):
    mask = nnx.combine_masks(nnx.make_causal_mask(tokens),
                             nnx.make_attention_mask(tokens > 0, tokens > 0))
    x = self.embed(tokens)
    for block in self.blocks:
      x = block(x, mask, rngs)
    return self.embed.attend(self.final_norm(x))


def lm1b_nnx_train_step(model, optimizer, tokens, dropout_key):
  """lm1b_nnx's step: weighted cross entropy over the non-padding targets, dropout drawn from
  a key passed in each step, an nnx.Optimizer whose learning rate follows a schedule."""
  inputs, targets = tokens[:, :-1], tokens[:, 1:]

  def loss_fn(model):
    logits = model(inputs, nnx.Rngs(dropout=dropout_key))
    weights = (targets > 0).astype(jnp.float32)
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
    return jnp.sum(loss * weights) / jnp.sum(weights), logits

  (loss, logits), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model)
  optimizer.update(model, grads)
  accuracy = jnp.sum((jnp.argmax(logits, -1) == targets) * (targets > 0))
  return loss, accuracy


def fresh_zoo_lm():
  with nnx.use_eager_sharding(False):  # the names stay metadata: spmd resolves them
    model = NnxZooLM(nnx.Rngs(0))
    schedule = optax.warmup_cosine_decay_schedule(0.0, 1e-2, 2, 10)
    return model, nnx.Optimizer(model, optax.adamw(schedule, weight_decay=0.1), wrt=nnx.Param)


@pytest.mark.parametrize("mesh,batch", [("1x8", 4)])
def test_nnx_lm1b_linear_general_einsum_rmsnorm_dropout_keys(mesh, batch):
  """The 4 heads over 8 shards (uneven), the vocabulary and the MLP over 8."""
  tokens = jnp.asarray(np.random.default_rng(0).integers(1, 24, (batch, 9)), jnp.int32)
  tokens = tokens.at[0, 6:].set(0)
  keys = jax.random.split(jax.random.key(2), 3)
  batches = [(jnp.roll(tokens, s, axis=1), keys[s]) for s in range(3)]
  plan, (model, _) = nnx_steps(lm1b_nnx_train_step, fresh_zoo_lm, mesh_of(mesh),
                               (None, None, P("batch"), P()), batches, rules=LM_RULES)
  # the even MLP kernel stays split; the uneven heads come back whole (JAX arrays cannot hold
  # uneven shards) and are split again on entry to the next step
  block = plan.in_specs[0][0]["blocks"][0]
  assert block["up"]["kernel"].get_value() == P(None, "model")
  assert block["qkv"][0]["kernel"].get_value() == P(None, None, None)
  assert any("resharded inside the program" in w for w in plan.warnings)


# --- wmt: an encoder-decoder translated by beam search (a while loop over beam states) -----------

WMT_RULES = (("batch", "data"), ("vocab", None), ("mlp", "model"), ("embed", None))
WMT_VOCAB, EOS, BEAMS = 12, 6, 3  # EOS: a token the untrained model favours, so beams end


class Translator(nn.Module):
  """wmt's Transformer, one layer each side: a shared embedding, the decoder's causal self
  attention and cross attention over the encoding, logits from the embedding table."""

  def setup(self):
    self.embed = nn.Embed(WMT_VOCAB, 16, embedding_init=logical(nn.initializers.normal(1.0),
                                                                ("vocab", "embed")))
    kernel = nn.initializers.lecun_normal()
    self.encoder_mlp = [nn.Dense(32, kernel_init=logical(kernel, ("embed", "mlp"))),
                        nn.Dense(16, kernel_init=logical(kernel, ("mlp", "embed")))]
    self.self_attention = nn.MultiHeadDotProductAttention(num_heads=2, use_bias=False)
    self.cross_attention = nn.MultiHeadDotProductAttention(num_heads=2, use_bias=False)
    self.norm = nn.LayerNorm()

  def encode(self, inputs):
    x = self.embed(inputs)
    return x + self.encoder_mlp[1](nn.relu(self.encoder_mlp[0](x)))

  def decode(self, encoded, inputs, targets):
    y = self.embed(targets)
    y = y + self.self_attention(y, mask=nn.make_causal_mask(targets))
    cross_mask = nn.make_attention_mask(targets >= 0, inputs > 0)
    y = y + self.cross_attention(self.norm(y), encoded, mask=cross_mask)
    return self.embed.attend(self.norm(y))

  def __call__(self, inputs, targets):
    return self.decode(self.encode(inputs), inputs, targets)


def beam_search(params, inputs, max_len: int):
  """wmt's beam search, simplified: every step scores BEAMS * vocab continuations of the live
  beams (``lax.top_k`` over the flattened beam * vocab dim), gathers the chosen beams' sequences
  with ``take_along_axis``, keeps the best live and finished beams (length-normalised), and
  stops once no live beam can beat the worst finished one."""
  model = Translator()
  batch = inputs.shape[0]
  encoded = model.apply(params, inputs, method=Translator.encode)
  # each example's encoding repeated for its beams, flattened into the batch
  flat_encoded = jnp.repeat(encoded, BEAMS, axis=0)
  flat_inputs = jnp.repeat(inputs, BEAMS, axis=0)
  penalty = lambda length: ((5.0 + length) / 6.0) ** 0.6
  alive_seqs = jnp.zeros((batch, BEAMS, max_len), jnp.int32)
  alive_logp = jnp.tile(jnp.array([0.0] + [-1e7] * (BEAMS - 1)), (batch, 1))
  finished = (jnp.zeros((batch, BEAMS, max_len), jnp.int32), jnp.full((batch, BEAMS), -1e7),
              jnp.zeros((batch, BEAMS), bool))

  def cond(state):
    i, _, alive_logp, (_, finished_scores, flags) = state
    best_alive = alive_logp[:, 0] / penalty(max_len)
    worst_finished = jnp.where(jnp.all(flags, axis=1), jnp.min(finished_scores, axis=1), -1e7)
    return (i < max_len - 1) & ~jnp.all(worst_finished > best_alive)

  def body(state):
    i, alive_seqs, alive_logp, (finished_seqs, finished_scores, flags) = state
    logits = model.apply(params, flat_encoded, flat_inputs,
                         alive_seqs.reshape(batch * BEAMS, max_len), method=Translator.decode)
    logits = lax.dynamic_index_in_dim(logits, i, axis=1, keepdims=False)
    logp = jax.nn.log_softmax(logits).reshape(batch, BEAMS, WMT_VOCAB)
    candidates = (alive_logp[:, :, None] + logp).reshape(batch, BEAMS * WMT_VOCAB)
    top_logp, top_index = lax.top_k(candidates, 2 * BEAMS)
    beam, token = top_index // WMT_VOCAB, top_index % WMT_VOCAB
    seqs = jnp.take_along_axis(alive_seqs, beam[:, :, None], axis=1)
    seqs = lax.dynamic_update_slice(seqs, token[:, :, None], (0, 0, i + 1))
    ended = token == EOS
    # live: the best BEAMS that did not end
    live_logp, live = lax.top_k(jnp.where(ended, -1e7, top_logp), BEAMS)
    alive_seqs = jnp.take_along_axis(seqs, live[:, :, None], axis=1)
    # finished: the best BEAMS of the old finished and the newly ended
    new_scores = jnp.where(ended, top_logp / penalty(i + 1), -1e7)
    all_seqs = jnp.concatenate([finished_seqs, seqs], axis=1)
    all_scores = jnp.concatenate([finished_scores, new_scores], axis=1)
    all_flags = jnp.concatenate([flags, ended], axis=1)
    finished_scores, best = lax.top_k(all_scores, BEAMS)
    finished = (jnp.take_along_axis(all_seqs, best[:, :, None], axis=1), finished_scores,
                jnp.take_along_axis(all_flags, best, axis=1))
    return i + 1, alive_seqs, live_logp, finished

  i, alive_seqs, alive_logp, (seqs, scores, flags) = lax.while_loop(
      cond, body, (jnp.int32(0), alive_seqs, alive_logp, finished))
  # examples with no finished beam return their live ones
  any_finished = jnp.any(flags, axis=1)
  seqs = jnp.where(any_finished[:, None, None], seqs, alive_seqs)
  scores = jnp.where(any_finished[:, None], scores, alive_logp / penalty(max_len))
  return seqs, scores, i


@pytest.mark.parametrize("mesh,batch", [("2x4", 4)])
def test_wmt_beam_search_while_loop_top_k_take_along_axis(mesh, batch):
  """The params by logical rules (the MLP over "model"), the sources over "data" (6 over 8:
  uneven); the search's sequences, scores and step count match the unpartitioned search."""
  model = Translator()
  inputs = jnp.asarray(np.random.default_rng(3).integers(2, WMT_VOCAB, (batch, 5)), jnp.int32)
  inputs = inputs.at[0, 3:].set(0)  # a padded source
  variables = jax.jit(model.init)(jax.random.key(0), inputs, inputs)
  params = nn.unbox(variables)
  specs = nn.get_partition_spec(variables)
  search = spmd.partition(beam_search, mesh=mesh_of(mesh), in_specs=(specs, P("batch")),
                          static_argnums=2, rules=WMT_RULES)
  want = jax.jit(beam_search, static_argnums=2)(params, inputs, 7)
  assert_trees_match(search(params, inputs, 7), want, rtol=1e-4, atol=1e-5)
  assert np.any(np.asarray(want[0]) == EOS)  # some beam finished: the finished set is exercised
  check_plan(search, params, inputs, 7)


# --- gemma's sampler: a prefilled KV cache, then temperature + top-p sampling in a while loop ---

EOS_TOKEN = 3

def top_p_sample(logits, key, temperature: float, top_p: float):
  """A token per row drawn from the smallest set of tokens whose probability reaches ``top_p``
  (the probabilities sorted by ``lax.top_k``), at ``temperature``."""
  probs = jax.nn.softmax(logits / temperature, axis=-1)
  sorted_probs, order = lax.top_k(probs, probs.shape[-1])
  kept = jnp.cumsum(sorted_probs, axis=-1) - sorted_probs < top_p
  choice = jax.random.categorical(key, jnp.log(jnp.where(kept, sorted_probs, 0.0)), axis=-1)
  return jnp.take_along_axis(order, choice[:, None], axis=-1)[:, 0].astype(jnp.int32)


def gemma_sample(model, prompt, key, steps: int, temperature: float, top_p: float):
  """The prompt prefilled in one call (its keys and values written into the caches), then one
  sampled token per trip of a while loop that stops when every sequence has sampled EOS_TOKEN;
  each step's key is ``fold_in(key, index)``. Returns the tokens and the steps run."""
  batch, prompt_len = prompt.shape
  length = prompt_len + steps
  caches = [(jnp.zeros((batch, length, KV_HEADS, HEAD_DIM)),) * 2 for _ in model.blocks]
  positions = jnp.broadcast_to(jnp.arange(prompt_len), prompt.shape)
  mask = jnp.broadcast_to(jnp.arange(length)[None, :] <= jnp.arange(prompt_len)[:, None],
                          (batch, prompt_len, length))
  logits, caches = model(prompt, positions, mask, caches, 0)
  first = top_p_sample(logits[:, -1], jax.random.fold_in(key, prompt_len), temperature, top_p)
  tokens = jnp.zeros((batch, length), jnp.int32).at[:, :prompt_len].set(prompt)
  tokens = tokens.at[:, prompt_len].set(first)

  def pick(index, logits, tokens, done):
    sampled = top_p_sample(logits, jax.random.fold_in(key, index + 1), temperature, top_p)
    sampled = jnp.where(done, 0, sampled)
    return sampled, done | (sampled == EOS_TOKEN)

  return decode_loop(model, tokens, caches, jnp.int32(prompt_len), first == EOS_TOKEN, pick)


@pytest.mark.parametrize("mesh,batch", [("2x4", 4)])
def test_gemma_sampler_prefill_temperature_top_p_categorical(mesh, batch):
  model = fresh_gemma()[0]
  prompt = jnp.asarray(np.random.default_rng(4).integers(1, VOCAB, (batch, 3)), jnp.int32)
  sample = spmd.partition(gemma_sample, mesh=mesh_of(mesh), in_specs=(None, P("batch"), P()),
                          static_argnums=(3, 4, 5), rules=GEMMA_RULES)
  args = (model, prompt, jax.random.key(5), 8, 0.8, 0.9)
  want = nnx.jit(gemma_sample, static_argnums=(3, 4, 5))(*args)
  assert_trees_match(sample(*args), want)
  assert len(np.unique(np.asarray(want[0])[:, 3:])) > 2  # sampled, not one favourite token
  check_plan(sample, *args)


# --- nnx_toy_examples: array leaves and parameter surgery; FSDP with a hand-written optimizer ----

class ArrayLinear(nnx.Module):
  """07_array_leaves' layer: plain array attributes, no Variables."""

  def __init__(self, din: int, dout: int, rngs: nnx.Rngs):
    self.w = jax.random.normal(rngs.params(), (din, dout)) * din ** -0.5
    self.b = jnp.zeros((dout,))

  def __call__(self, x):
    return x @ self.w + self.b


class SurgeryClassifier(nnx.Module):
  def __init__(self, rngs: nnx.Rngs):
    self.count = jnp.array(0)  # an array leaf the step increments
    self.backbone = ArrayLinear(16, 32, rngs)
    self.head = ArrayLinear(32, 4, rngs)

  def __call__(self, x):
    self.count += 1
    return self.head(nnx.relu(self.backbone(x)))


def head_only(path, value):
  """09_parameter_surgery's filter, inverted: the head's weights train, the backbone is frozen."""
  return path[-1] in ("w", "b") and "head" in path


def surgery_step(model, optimizer, x, labels):
  def loss_fn(model):
    return optax.softmax_cross_entropy_with_integer_labels(model(x), labels).mean()

  loss, grads = nnx.value_and_grad(loss_fn, argnums=nnx.DiffState(0, head_only))(model)
  optimizer.update(model, grads)
  return loss


def fresh_surgery():
  model = SurgeryClassifier(nnx.Rngs(0))
  model.backbone = ArrayLinear(16, 32, nnx.Rngs(7))  # the "pretrained" backbone swapped in
  return model, nnx.Optimizer(model, optax.adam(1e-2), wrt=head_only)


@pytest.mark.parametrize("mesh,batch", [("8x1", 6)])
def test_nnx_parameter_surgery_array_leaves_frozen_backbone(mesh, batch):
  batches = [(randn(batch, 16, seed=s), jnp.arange(batch) % 4) for s in range(3)]
  _, (model, _) = nnx_steps(surgery_step, fresh_surgery, mesh_of(mesh),
                            (None, None, P("data"), P("data")), batches)
  assert int(model.count) == 3
  backbone = ArrayLinear(16, 32, nnx.Rngs(7))
  assert_trees_match(nnx.state(model.backbone), nnx.state(backbone))  # frozen


class MomentumState(nnx.Variable):
  pass


class FsdpSGD(nnx.Pytree):
  """10_fsdp_and_optimizer's optimizer: a momentum per param, created with the param's metadata
  (its sharding names), updated in place."""

  def __init__(self, params: nnx.State, lr: float, decay: float = 0.9):
    self.lr, self.decay = lr, decay
    self.params = nnx.data(params)
    self.momentum = nnx.data(jax.tree.map(
        lambda p: MomentumState(jnp.zeros_like(p[...]), **p.get_metadata()), params,
        is_leaf=lambda x: isinstance(x, nnx.Variable)))

  def update(self, grads: nnx.State):
    def update_one(param, momentum, grad):
      momentum[...] = self.decay * momentum[...] + (1 - self.decay) * grad[...]
      param[...] -= self.lr * momentum[...]

    jax.tree.map(update_one, self.params, self.momentum, grads,
                 is_leaf=lambda x: isinstance(x, nnx.Variable))


class FsdpMLP(nnx.Module):
  """Kernels split over "data" (FSDP) and "model" (tensor parallel), as the toy's mesh rules."""

  def __init__(self, rngs: nnx.Rngs):
    init = nnx.initializers.lecun_normal()
    self.w1 = nnx.Param(init(rngs.params(), (8, 32)), out_sharding=("data", "model"))
    self.b1 = nnx.Param(jnp.zeros((32,)), out_sharding=("model",))
    self.w2 = nnx.Param(init(rngs.params(), (32, 2)), out_sharding=("model", None))

  def __call__(self, x):
    return nnx.relu(x @ self.w1 + self.b1) @ self.w2


def fsdp_step(model, optimizer, x, y):
  loss, grads = nnx.value_and_grad(lambda model: jnp.mean((model(x) - y) ** 2))(model)
  optimizer.update(grads)
  return loss


@pytest.mark.parametrize("mesh", ["2x4"])
def test_nnx_fsdp_toy_hand_written_optimizer_created_under_set_mesh(mesh):
  """Created as the toy creates them (nnx.jit under jax.set_mesh: the params and momenta
  sharded eagerly by their names), trained with the batch over "data"."""
  mesh = mesh_of(mesh)

  def fresh():
    @nnx.jit
    def create():
      model = FsdpMLP(nnx.Rngs(0))
      return model, FsdpSGD(nnx.variables(model, nnx.Param), 0.05)

    with jax.set_mesh(mesh):
      return create()

  batches = [(randn(8, 8, seed=s), randn(8, 2, seed=s + 3)) for s in range(3)]
  plan, (model, optimizer) = nnx_steps(fsdp_step, fresh, mesh,
                                       (None, None, P("data"), P("data")), batches)
  assert optimizer.momentum["w1"].get_value().sharding.spec == P("data", "model")
  assert model.w1.get_value().sharding.spec == P("data", "model")
  # w1 gathered over "data" forward, its gradient reduce-scattered
  kinds = {(c.kind, c.axes) for c in plan.collectives}
  assert {("all-gather", ("data",)), ("reduce-scatter", ("data",))} <= kinds


# --- 06_scan_over_layers with sharding names: the stacked params name a "layers" axis ----------

SCAN_RULES = (("batch", "data"), ("layers", None), ("embed", None), ("mlp", "model"))


class ScanLayer(nnx.Module):
  def __init__(self, rngs: nnx.Rngs):
    init = nnx.initializers.lecun_normal()
    self.norm = nnx.RMSNorm(16, rngs=rngs)
    self.up = nnx.Linear(16, 32, rngs=rngs,
                         kernel_init=nnx.with_partitioning(init, ("embed", "mlp")),
                         bias_init=nnx.with_partitioning(nnx.initializers.zeros_init(), ("mlp",)))
    self.down = nnx.Linear(32, 16, rngs=rngs,
                           kernel_init=nnx.with_partitioning(init, ("mlp", "embed")))
    self.dropout = nnx.Dropout(0.1, rngs=rngs)

  def __call__(self, x):
    return x + self.dropout(self.down(nnx.gelu(self.up(self.norm(x)))))


class ScanStack(nnx.Module):
  """Layers created by ``nnx.vmap`` (each its own dropout stream) and applied by ``nnx.scan``
  over ``nnx.remat``, both adding "layers" to the stacked params' names."""

  def __init__(self, layers: int, rngs: nnx.Rngs):
    @nnx.split_rngs(splits=layers)
    @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
    def create(rngs):
      return ScanLayer(rngs)

    self.layers = create(rngs)
    self.head = nnx.Linear(16, 4, rngs=rngs)

  def __call__(self, x):
    @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=nnx.Carry,
              transform_metadata={nnx.PARTITION_NAME: "layers"})
    @nnx.remat
    def forward(x, layer):
      return layer(x)

    return self.head(forward(x, self.layers))


def scan_stack_step(model, optimizer, x, labels):
  def loss_fn(model):
    return optax.softmax_cross_entropy_with_integer_labels(model(x), labels).mean()

  loss, grads = nnx.value_and_grad(loss_fn)(model)
  optimizer.update(model, grads)
  return loss


@pytest.mark.parametrize("mesh,batch", [("2x4", 8)])
def test_nnx_scan_over_layers_with_layers_axis_name_remat_dropout(mesh, batch):
  def fresh():
    with nnx.use_eager_sharding(False):  # the names stay metadata: spmd resolves them
      model = ScanStack(3, nnx.Rngs(0))
      return model, nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)

  batches = [(randn(batch, 16, seed=s), jnp.arange(batch) % 4) for s in range(3)]
  plan, _ = nnx_steps(scan_stack_step, fresh, mesh_of(mesh),
                      (None, None, P("batch"), P("batch")), batches, rules=SCAN_RULES)
  assert plan.in_specs[0][0]["layers"]["up"]["kernel"].get_value() == P(None, None, "model")


# --- sst2: word dropout, a bidirectional LSTM over padded sequences, MLP attention pooling -------

class Sst2Classifier(nn.Module):
  """sst2's model: embeddings with dropout and word dropout (one draw per token, broadcast over
  the features), forward and backward LSTMs (the backward one reversed within each length and
  kept in order), attention pooling over the valid steps, a binary logit."""

  @nn.compact
  def __call__(self, tokens, lengths, train: bool):
    x = nn.Embed(30, 8)(tokens)
    x = nn.Dropout(0.3, broadcast_dims=(-1,), deterministic=not train)(x)  # word dropout
    x = nn.Dropout(0.2, deterministic=not train)(x)
    x = nn.Bidirectional(nn.RNN(nn.LSTMCell(8)),
                         nn.RNN(nn.LSTMCell(8), reverse=True, keep_order=True))(
                             x, seq_lengths=lengths)
    mask = jnp.arange(tokens.shape[1])[None, :] < lengths[:, None]
    # no bias on the scores: softmax ignores it, so its gradient is rounding that Adam scales up
    scores = nn.Dense(1, use_bias=False)(nn.tanh(nn.Dense(16)(x)))[..., 0]
    weights = jax.nn.softmax(jnp.where(mask, scores, -1e9), axis=-1)
    pooled = jnp.einsum("bt,btd->bd", weights, x)
    h = nn.Dropout(0.2, deterministic=not train)(nn.tanh(nn.Dense(16)(pooled)))
    return nn.Dense(1)(h)[:, 0]


def sst2_train_step(state, batch, key):
  def loss_fn(params):
    logits = state.apply_fn({"params": params}, batch["token_ids"], batch["length"], True,
                            rngs={"dropout": key})
    return optax.sigmoid_binary_cross_entropy(logits, batch["label"]).mean(), logits

  (loss, logits), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
  return state.apply_gradients(grads=grads), {"loss": loss, "logits": logits}


@pytest.mark.parametrize("mesh,batch", [("8x1", 6)])
def test_sst2_word_dropout_bidirectional_lstm_attention_pooling(mesh, batch):
  model = Sst2Classifier()
  rng = np.random.default_rng(6)
  lengths = jnp.asarray(rng.integers(1, 7, batch), jnp.int32)
  tokens = jnp.where(jnp.arange(6)[None, :] < lengths[:, None],
                     jnp.asarray(rng.integers(1, 30, (batch, 6)), jnp.int32), 0)
  params = jax.jit(model.init, static_argnums=3)(jax.random.key(0), tokens, lengths,
                                                 False)["params"]
  state = train_state.TrainState.create(apply_fn=model.apply, params=params,
                                        tx=optax.adam(1e-2))
  keys = jax.random.split(jax.random.key(1), 3)
  batches = [({"token_ids": jnp.roll(tokens, s, axis=0), "length": jnp.roll(lengths, s),
               "label": (jnp.arange(batch) % 2).astype(jnp.float32)}, keys[s])
             for s in range(3)]
  step = spmd.partition(sst2_train_step, mesh=mesh_of(mesh), in_specs=(None, P("data"), P()))
  train_loop(jax.jit(sst2_train_step), step, (state,), batches, rtol=1e-4, atol=1e-5)
