"""flax's example workloads, a second round (google/flax examples/ and the NNX guides), small and
written as their users write them, run through spmd.partition on the ("data", "model") meshes:
a Gemma-style NNX decoder trained and sampled with a KV cache, linen autoregressive decoding
with the "cache" collection, an ogbg-molpcba-style GNN, PPO, an LSTM seq2seq and an ImageNet
ResNet stage in bfloat16. Each is checked against the unpartitioned function, step by step
where a loop feeds the state back (helpers.train_loop / check_plan)."""
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax import lax
from jax.sharding import PartitionSpec as P

import spmd
from helpers import assert_partitioned_matches, assert_trees_match, check_plan, mesh_of, randn


# --- Gemma-style NNX decoder (examples/gemma): RMSNorm, RoPE, GQA, gated GeLU, tied embedding ----

GEMMA_RULES = (("batch", "data"), ("vocab", "model"), ("heads", "model"), ("kv_heads", "model"),
               ("mlp", "model"), ("embed", None), ("head_dim", None))
VOCAB, EMBED, HEADS, KV_HEADS, HEAD_DIM, MLP = 16, 32, 8, 4, 8, 64


def param(rngs: nnx.Rngs, shape: tuple, names: tuple) -> nnx.Param:
  init = nnx.with_partitioning(nnx.initializers.normal(shape[0] ** -0.5), names)
  return nnx.Param(init(rngs.params(), shape))


class RMSNorm(nnx.Module):
  def __init__(self, dim: int):
    self.scale = nnx.Param(jnp.zeros((dim,)), out_sharding=("embed",))

  def __call__(self, x):
    x = x * lax.rsqrt(jnp.mean(jnp.square(x), axis=-1, keepdims=True) + 1e-6)
    return x * (1 + self.scale[...])


def rope(x, positions, max_wavelength: float = 10_000.0):
  """Rotary embedding of x [B, T, N, H] at positions [B, T]."""
  half = x.shape[-1] // 2
  timescale = max_wavelength ** (2 * jnp.arange(half) / x.shape[-1])
  angle = (positions[..., None] / timescale)[..., None, :]
  sin, cos = jnp.sin(angle), jnp.cos(angle)
  first, second = jnp.split(x, 2, axis=-1)
  return jnp.concatenate([first * cos - second * sin, second * cos + first * sin], axis=-1)


class Attention(nnx.Module):
  """Grouped-query attention: HEADS query heads share KV_HEADS key/value heads."""

  def __init__(self, rngs: nnx.Rngs):
    self.q = param(rngs, (EMBED, HEADS, HEAD_DIM), ("embed", "heads", "head_dim"))
    self.kv = param(rngs, (2, EMBED, KV_HEADS, HEAD_DIM), (None, "embed", "kv_heads", "head_dim"))
    self.out = param(rngs, (HEADS, HEAD_DIM, EMBED), ("heads", "head_dim", "embed"))

  def __call__(self, x, positions, mask, cache=None, index=None):
    """x [B, T, D]; mask [B, T, S]; with a cache ([B, S, K, H] keys and values), the new keys
    and values are written at ``index`` and attention reads the whole cache."""
    q = rope(jnp.einsum("BTD,DNH->BTNH", x, self.q[...]), positions) * HEAD_DIM ** -0.5
    k, v = jnp.einsum("BTD,CDKH->CBTKH", x, self.kv[...])
    k = rope(k, positions)
    if cache is not None:
      k = lax.dynamic_update_slice(cache[0], k, (0, index, 0, 0))
      v = lax.dynamic_update_slice(cache[1], v, (0, index, 0, 0))
      cache = (k, v)
    b, t, _, h = q.shape
    q = q.reshape(b, t, KV_HEADS, HEADS // KV_HEADS, h)
    logits = jnp.einsum("BTKGH,BSKH->BTKGS", q, k)
    logits = jnp.where(mask[:, :, None, None, :], logits, -1e30)
    probs = jax.nn.softmax(logits, axis=-1)
    y = jnp.einsum("BTKGS,BSKH->BTKGH", probs, v).reshape(b, t, HEADS, h)
    return jnp.einsum("BTNH,NHD->BTD", y, self.out[...]), cache


class GatedMLP(nnx.Module):
  def __init__(self, rngs: nnx.Rngs):
    self.gating = param(rngs, (2, EMBED, MLP), (None, "embed", "mlp"))
    self.down = param(rngs, (MLP, EMBED), ("mlp", "embed"))

  def __call__(self, x):
    gate, up = jnp.einsum("BTD,CDF->CBTF", x, self.gating[...])
    return (nnx.gelu(gate) * up) @ self.down[...]


class GemmaBlock(nnx.Module):
  def __init__(self, rngs: nnx.Rngs):
    self.pre_attention_norm, self.pre_mlp_norm = RMSNorm(EMBED), RMSNorm(EMBED)
    self.attention, self.mlp = Attention(rngs), GatedMLP(rngs)

  def __call__(self, x, positions, mask, cache=None, index=None):
    y, cache = self.attention(self.pre_attention_norm(x), positions, mask, cache, index)
    x = x + y
    return x + self.mlp(self.pre_mlp_norm(x)), cache


class Gemma(nnx.Module):
  def __init__(self, layers: int, rngs: nnx.Rngs):
    self.embedder = nnx.Embed(VOCAB, EMBED, rngs=rngs, embedding_init=nnx.with_partitioning(
        nnx.initializers.normal(1.0), ("vocab", "embed")))
    self.blocks = nnx.List([GemmaBlock(rngs) for _ in range(layers)])
    self.final_norm = RMSNorm(EMBED)

  def __call__(self, tokens, positions, mask, caches=None, index=None):
    """Logits [B, T, VOCAB] (the embedding table tied to the output), and the caches."""
    x = self.embedder(tokens) * jnp.sqrt(EMBED).astype(jnp.float32)
    new_caches = []
    for layer, block in enumerate(self.blocks):
      x, cache = block(x, positions, mask, None if caches is None else caches[layer], index)
      new_caches.append(cache)
    return self.embedder.attend(self.final_norm(x)), new_caches


def gemma_train_step(model, optimizer, tokens):
  inputs, targets = tokens[:, :-1], tokens[:, 1:]
  positions = jnp.broadcast_to(jnp.arange(inputs.shape[1]), inputs.shape)
  mask = nnx.make_causal_mask(inputs, dtype=bool)[:, 0] & (inputs > 0)[:, None, :]

  def loss_fn(model):
    logits, _ = model(inputs, positions, mask)
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, targets)
    weights = targets > 0
    return jnp.sum(loss * weights) / jnp.sum(weights)

  loss, grads = nnx.value_and_grad(loss_fn)(model)
  optimizer.update(model, grads)
  return loss


def greedy_sample(model, prompt, eos, steps: int):
  """Gemma's sampler, greedy: the prompt fed token by token, then each step's argmax, the keys
  and values kept in a cache written by dynamic_update_slice inside a while loop that stops
  once every sequence has produced ``eos``. Returns the tokens and the number of steps run."""
  graphdef, state = nnx.split(model)
  batch, prompt_len = prompt.shape
  length = prompt_len + steps
  tokens = jnp.zeros((batch, length), jnp.int32).at[:, :prompt_len].set(prompt)
  caches = [(jnp.zeros((batch, length, KV_HEADS, HEAD_DIM)),) * 2 for _ in model.blocks]

  def cond(carry):
    index, _, _, done = carry
    return (index < length - 1) & ~jnp.all(done)

  def body(carry):
    index, tokens, caches, done = carry
    token = lax.dynamic_slice_in_dim(tokens, index, 1, axis=1)
    positions = jnp.full((batch, 1), index)
    mask = jnp.broadcast_to(jnp.arange(length) <= index, (batch, 1, length))
    logits, caches = nnx.merge(graphdef, state)(token, positions, mask, caches, index)
    sampled = jnp.argmax(logits[:, 0], axis=-1).astype(jnp.int32)
    in_prompt = index + 1 < prompt_len
    following = lax.dynamic_slice_in_dim(tokens, index + 1, 1, axis=1)[:, 0]
    following = jnp.where(in_prompt, following, jnp.where(done, 0, sampled))
    tokens = lax.dynamic_update_slice(tokens, following[:, None], (0, index + 1))
    done = done | (~in_prompt & (sampled == eos))
    return index + 1, tokens, caches, done

  index, tokens, _, _ = lax.while_loop(
      cond, body, (jnp.int32(0), tokens, caches, jnp.zeros((batch,), bool)))
  return tokens, index


def fresh_gemma():
  with nnx.use_eager_sharding(False):  # the names stay metadata: spmd resolves them
    model = Gemma(1, nnx.Rngs(0))
    return model, nnx.Optimizer(model, optax.adamw(1e-2, weight_decay=0.1), wrt=nnx.Param)


@pytest.mark.parametrize("mesh", ["2x4", "1x8"])
def test_nnx_gemma_train_then_greedy_sample_with_kv_cache(mesh):
  """1x8 puts the 4 kv heads over 8 shards (an uneven dim: half the shards hold padding)."""
  mesh = mesh_of(mesh)
  ours, reference = fresh_gemma(), fresh_gemma()
  step = spmd.partition(gemma_train_step, mesh=mesh, in_specs=(None, None, P("batch")),
                        rules=GEMMA_RULES)
  jitted = nnx.jit(gemma_train_step)
  tokens = jnp.asarray(np.random.default_rng(0).integers(1, VOCAB, (4, 9)), jnp.int32)
  tokens = tokens.at[0, 6:].set(0)  # a padded sequence
  for s in range(3):
    batch = jnp.roll(tokens, s, axis=1)
    assert_trees_match(step(*ours, batch), jitted(*reference, batch), rtol=1e-4, atol=1e-5)
  assert_trees_match(nnx.state(ours[0]), nnx.state(reference[0]), rtol=1e-4, atol=1e-5)
  check_plan(step, *ours, tokens)

  model, prompt = ours[0], tokens[:, :3]
  want, _ = nnx.jit(greedy_sample, static_argnums=3)(model, prompt, -1, 8)
  eos = int(want[0, 4])  # the first sequence's second sampled token: the loop stops early
  sample = spmd.partition(greedy_sample, mesh=mesh, in_specs=(None, P("batch"), P()),
                          static_argnums=3, rules=GEMMA_RULES)
  want = nnx.jit(greedy_sample, static_argnums=3)(model, prompt, eos, 8)
  assert_trees_match(sample(model, prompt, eos, 8), want)
  check_plan(sample, model, prompt, eos, 8)
