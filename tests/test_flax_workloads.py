"""flax's example workloads, a second round (google/flax examples/ and the NNX guides), small and
written as their users write them, run through spmd.partition on the ("data", "model") meshes:
a Gemma-style NNX decoder trained and sampled with a KV cache, linen autoregressive decoding
with the "cache" collection, an ogbg-molpcba-style GNN, PPO, an LSTM seq2seq and an ImageNet
ResNet stage in bfloat16. Each is checked against the unpartitioned function, step by step
where a loop feeds the state back (helpers.train_loop / check_plan)."""
from typing import Any

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
from helpers import (assert_partitioned_matches, assert_trees_match, check_plan, mesh_of, randn,
                     train_loop)


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


def decode_loop(model, tokens, caches, start, done, pick):
  """Gemma's cached decoding: from ``start``, each trip feeds the token at ``index`` (its keys and
  values written into ``caches``), and ``pick(index, logits, tokens, done)`` gives the token to
  write at ``index + 1`` and the new ``done``; it stops at the end of ``tokens`` or once every
  sequence is done. Returns the tokens and the index it stopped at."""
  graphdef, state = nnx.split(model)
  batch, length = tokens.shape

  def cond(carry):
    index, _, _, done = carry
    return (index < length - 1) & ~jnp.all(done)

  def body(carry):
    index, tokens, caches, done = carry
    token = lax.dynamic_slice_in_dim(tokens, index, 1, axis=1)
    mask = jnp.broadcast_to(jnp.arange(length) <= index, (batch, 1, length))
    logits, caches = nnx.merge(graphdef, state)(token, jnp.full((batch, 1), index), mask,
                                                caches, index)
    following, done = pick(index, logits[:, 0], tokens, done)
    tokens = lax.dynamic_update_slice(tokens, following[:, None], (0, index + 1))
    return index + 1, tokens, caches, done

  index, tokens, _, _ = lax.while_loop(cond, body, (start, tokens, caches, done))
  return tokens, index


def greedy_sample(model, prompt, eos, steps: int):
  """Gemma's sampler, greedy: the prompt fed token by token, then each step's argmax, the keys
  and values kept in a cache written by dynamic_update_slice inside a while loop that stops
  once every sequence has produced ``eos``. Returns the tokens and the number of steps run."""
  batch, prompt_len = prompt.shape
  length = prompt_len + steps
  tokens = jnp.zeros((batch, length), jnp.int32).at[:, :prompt_len].set(prompt)
  caches = [(jnp.zeros((batch, length, KV_HEADS, HEAD_DIM)),) * 2 for _ in model.blocks]

  def pick(index, logits, tokens, done):
    sampled = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    in_prompt = index + 1 < prompt_len
    following = lax.dynamic_slice_in_dim(tokens, index + 1, 1, axis=1)[:, 0]
    following = jnp.where(in_prompt, following, jnp.where(done, 0, sampled))
    return following, done | (~in_prompt & (sampled == eos))

  return decode_loop(model, tokens, caches, jnp.int32(0), jnp.zeros((batch,), bool), pick)


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

  # every sequence has sampled token 6 by the fifth of 8 steps: the while loop stops there
  prompt = jnp.asarray(np.random.default_rng(0).integers(1, VOCAB, (4, 3)), jnp.int32)
  model, eos, steps = reference[0], 6, 8
  sample = spmd.partition(greedy_sample, mesh=mesh, in_specs=(None, P("batch"), P()),
                          static_argnums=3, rules=GEMMA_RULES)
  want = nnx.jit(greedy_sample, static_argnums=3)(model, prompt, eos, steps)
  assert int(want[1]) < prompt.shape[1] + steps - 1
  assert_trees_match(sample(model, prompt, eos, steps), want)
  check_plan(sample, model, prompt, eos, steps)


# --- linen autoregressive decoding (examples/lm1b predict_step): the mutable "cache" collection --

DECODE_RULES = (("batch", "data"), ("kv", "model"), ("mlp", "model"), ("vocab", None),
                ("embed", None))


class CachedDecoder(nn.Module):
  """lm1b's decoder, one layer: learned positions whose index is kept in the "cache" collection
  beside the attention's keys and values when ``decode``."""
  decode: bool = False
  vocab: int = 16
  length: int = 12

  @nn.compact
  def __call__(self, tokens):
    names = lambda *n: nn.with_logical_partitioning(nn.initializers.lecun_normal(), n)  # noqa
    x = nn.Embed(self.vocab, 16, embedding_init=nn.with_logical_partitioning(
        nn.initializers.normal(1.0), ("vocab", "embed")))(tokens)
    positions = self.param("pos_embedding", nn.initializers.normal(0.02), (self.length, 16))
    if self.decode:
      initialized = self.has_variable("cache", "position")
      index = self.variable("cache", "position", lambda: jnp.zeros((), jnp.int32))
      if initialized:
        x = x + lax.dynamic_slice_in_dim(positions, index.value, 1)[None]
        index.value += 1
      mask = None  # the cache masks the positions not yet written
    else:
      x = x + positions[None, :x.shape[1]]
      mask = nn.make_causal_mask(tokens)
    y = nn.MultiHeadDotProductAttention(num_heads=4, qkv_features=16, decode=self.decode,
                                        kernel_init=names("embed", "kv"))(nn.LayerNorm()(x),
                                                                          mask=mask)
    x = x + y
    z = nn.relu(nn.Dense(32, kernel_init=names("embed", "mlp"))(nn.LayerNorm()(x)))
    x = x + nn.Dense(16, kernel_init=names("mlp", "embed"))(z)
    return nn.Dense(self.vocab, kernel_init=names("embed", "vocab"))(nn.LayerNorm()(x))


def predict(params, cache, prompt):
  """Greedy decoding as lm1b's predict_step: one token per fori_loop trip through
  ``apply(..., mutable=["cache"])``; prompt tokens are fed until their end."""
  model = CachedDecoder(decode=True)
  batch, prompt_len = prompt.shape
  tokens = jnp.zeros((batch, model.length), jnp.int32).at[:, :prompt_len].set(prompt)

  def body(i, carry):
    cache, tokens = carry
    logits, variables = model.apply({"params": params, "cache": cache},
                                    lax.dynamic_slice_in_dim(tokens, i, 1, axis=1),
                                    mutable=["cache"])
    sampled = jnp.argmax(logits[:, 0], axis=-1).astype(jnp.int32)
    following = lax.dynamic_slice_in_dim(tokens, i + 1, 1, axis=1)[:, 0]
    following = jnp.where(i + 1 < prompt_len, following, sampled)
    return variables["cache"], lax.dynamic_update_slice(tokens, following[:, None], (0, i + 1))

  return lax.fori_loop(0, model.length - 1, body, (cache, tokens))


@pytest.mark.parametrize("mesh,batch", [("2x4", 4), ("8x1", 6)])
def test_linen_decode_with_mutable_cache(mesh, batch):
  """The partitioned decode loop against the jitted one (6 sequences over 8: uneven)."""
  trained = CachedDecoder()
  prompt = jnp.asarray(np.random.default_rng(1).integers(1, 16, (batch, 4)), jnp.int32)
  variables = jax.jit(trained.init)(jax.random.key(0), prompt)
  params, param_specs = nn.unbox(variables)["params"], nn.get_partition_spec(variables)["params"]
  decoder = CachedDecoder(decode=True)
  cache = nn.unbox(decoder.init(jax.random.key(0), jnp.ones((batch, decoder.length),
                                                            jnp.int32))["cache"])
  decode = spmd.partition(predict, mesh=mesh_of(mesh), in_specs=(param_specs, None, P("batch")),
                          rules=DECODE_RULES)
  got, want = decode(params, cache, prompt), jax.jit(predict)(params, cache, prompt)
  assert_trees_match(got, want, rtol=1e-5, atol=1e-5)
  check_plan(decode, params, cache, prompt)


# --- ogbg-molpcba-style GNN (examples/ogbg_molpcba): flat node / edge arrays, segment ops ---------

class GraphNet(nn.Module):
  """Message passing over a batch of graphs given as flat arrays (jraph's GraphsTuple layout):
  edge updates from their endpoints, node updates from the sum and max of incoming messages,
  then a mean over each graph's nodes."""
  tasks: int = 6

  @nn.compact
  def __call__(self, nodes, edges, senders, receivers, node_graph, graphs: int):
    h, e = nn.Dense(16)(nodes), nn.Dense(16)(edges)
    for _ in range(2):
      e = e + nn.relu(nn.Dense(16)(jnp.concatenate([h[senders], h[receivers], e], -1)))
      total = jax.ops.segment_sum(e, receivers, num_segments=h.shape[0])
      largest = jax.ops.segment_max(e, receivers, num_segments=h.shape[0])
      largest = jnp.where(jnp.isfinite(largest), largest, 0.0)  # nodes without incoming edges
      h = h + nn.relu(nn.Dense(16)(jnp.concatenate([h, total, largest], -1)))
    counts = jax.ops.segment_sum(jnp.ones_like(node_graph), node_graph, num_segments=graphs)
    pooled = jax.ops.segment_sum(h, node_graph, num_segments=graphs)
    return nn.Dense(self.tasks)(pooled / jnp.maximum(counts, 1)[:, None])


def random_graphs(nodes_per_graph: list[int], edges: int, seed: int = 0) -> dict:
  """A batch of graphs with ``edges`` edges, each inside one graph, and labels with a mask (the
  molpcba labels are mostly missing)."""
  r = np.random.default_rng(seed)
  node_graph = np.repeat(np.arange(len(nodes_per_graph)), nodes_per_graph).astype(np.int32)
  starts = np.cumsum([0] + nodes_per_graph[:-1])
  edge_graph = r.integers(0, len(nodes_per_graph), edges)
  pick = lambda: (starts[edge_graph] + r.integers(0, 1 << 30, edges)  # noqa: E731
                  % np.asarray(nodes_per_graph)[edge_graph]).astype(np.int32)
  return {"nodes": randn(len(node_graph), 5, seed=seed), "edges": randn(edges, 3, seed=seed + 1),
          "senders": pick(), "receivers": pick(), "node_graph": node_graph,
          "labels": (r.random((len(nodes_per_graph), 6)) > 0.5).astype(np.float32),
          "mask": r.random((len(nodes_per_graph), 6)) > 0.3}


@pytest.mark.parametrize("mesh,edges,spec", [
    ("8x1", 24, {"edges": P("data"), "senders": P("data"), "receivers": P("data")}),
    ("2x4", 21, {"nodes": P("data"), "node_graph": P("data"), "edges": P("model"),
                 "senders": P("model"), "receivers": P("model")})])
def test_gnn_segment_message_passing_train_step(mesh, edges, spec):
  """Edges sharded (24 over 8), or nodes and edges both, unevenly (15 over 2, 21 over 4); the
  loss is a masked binary cross-entropy over the graphs' tasks, then an adam step."""
  model, tx = GraphNet(), optax.adam(1e-2)
  graphs = random_graphs([3, 5, 4, 3], edges)
  features = tuple(graphs[k] for k in ("nodes", "edges", "senders", "receivers", "node_graph"))
  params = jax.jit(model.init, static_argnums=6)(jax.random.key(0), *features, 4)["params"]

  def step(params, opt_state, graphs):
    def loss_fn(params):
      logits = model.apply({"params": params}, graphs["nodes"], graphs["edges"],
                           graphs["senders"], graphs["receivers"], graphs["node_graph"], 4)
      loss = optax.sigmoid_binary_cross_entropy(logits, graphs["labels"])
      return jnp.sum(jnp.where(graphs["mask"], loss, 0.0)) / jnp.sum(graphs["mask"])

    loss, grads = jax.value_and_grad(loss_fn)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  in_specs = (None, None, {k: spec.get(k) for k in graphs})
  partitioned = spmd.partition(step, mesh=mesh_of(mesh), in_specs=in_specs)
  batches = [(random_graphs([3, 5, 4, 3], edges, seed=s),) for s in range(3)]
  train_loop(jax.jit(step), partitioned, (params, tx.init(params)), batches, rtol=1e-4,
             atol=1e-5)


# --- PPO (examples/ppo): GAE by a reverse scan, clipped surrogate, shuffled minibatch epochs -------

class ActorCritic(nn.Module):
  actions: int = 4

  @nn.compact
  def __call__(self, x):
    h = nn.tanh(nn.Dense(32)(x))
    h = nn.tanh(nn.Dense(32)(h))
    return nn.Dense(self.actions)(h), nn.Dense(1)(h)[..., 0]


def gae_advantages(rewards, dones, values, gamma: float = 0.99, lam: float = 0.95):
  """Generalized advantage estimates over [T, N] rollouts (values [T + 1, N]), by a reverse
  scan over time; returns (advantages, returns)."""
  def backward(advantage, step):
    reward, done, value, following = step
    delta = reward + gamma * following * (1 - done) - value
    advantage = delta + gamma * lam * (1 - done) * advantage
    return advantage, advantage

  _, advantages = lax.scan(backward, jnp.zeros_like(values[0]),
                           (rewards, dones, values[:-1], values[1:]), reverse=True)
  return advantages, advantages + values[:-1]


def ppo_update(state, rollout, key, epochs: int = 2, minibatches: int = 2, clip: float = 0.2):
  """One PPO iteration on a rollout of [T, N] steps: advantages, then ``epochs`` passes (a
  fori_loop) over the T * N samples shuffled by jax.random.permutation, a minibatch per scan
  step. Returns the state and the last minibatch's loss."""
  advantages, returns = gae_advantages(rollout["rewards"], rollout["dones"], rollout["values"])
  samples = {"obs": rollout["obs"], "actions": rollout["actions"],
             "log_probs": rollout["log_probs"], "advantages": advantages, "returns": returns}
  samples = jax.tree.map(lambda x: x.reshape(-1, *x.shape[2:]), samples)
  size = samples["actions"].shape[0]

  def loss_fn(params, batch):
    logits, values = state.apply_fn({"params": params}, batch["obs"])
    log_probs = jax.nn.log_softmax(logits)
    taken = jnp.take_along_axis(log_probs, batch["actions"][:, None], axis=1)[:, 0]
    ratio = jnp.exp(taken - batch["log_probs"])
    advantage = batch["advantages"]
    advantage = (advantage - advantage.mean()) / (advantage.std() + 1e-8)
    surrogate = jnp.minimum(ratio * advantage, jnp.clip(ratio, 1 - clip, 1 + clip) * advantage)
    entropy = -jnp.sum(jnp.exp(log_probs) * log_probs, axis=-1)
    value_loss = jnp.square(batch["returns"] - values)
    return -surrogate.mean() + 0.5 * value_loss.mean() - 0.01 * entropy.mean()

  def minibatch(state, indices):
    batch = jax.tree.map(lambda x: x[indices], samples)
    loss, grads = jax.value_and_grad(loss_fn)(state.params, batch)
    return state.apply_gradients(grads=grads), loss

  def epoch(i, carry):
    state, _ = carry
    order = jax.random.permutation(jax.random.fold_in(key, i), size)
    state, losses = lax.scan(minibatch, state, order.reshape(minibatches, -1))
    return state, losses[-1]

  return lax.fori_loop(0, epochs, epoch, (state, jnp.zeros(())))


@pytest.mark.parametrize("mesh,envs", [("2x4", 4), ("8x1", 8)])
def test_ppo_update_epochs_of_shuffled_minibatches(mesh, envs):
  """The rollout's environments over "data" (4 over 2, 8 over 8)."""
  steps, model = 4, ActorCritic()
  r = np.random.default_rng(0)
  rollout = {"obs": randn(steps, envs, 6), "actions": r.integers(0, 4, (steps, envs)),
             "rewards": randn(steps, envs, seed=1), "values": randn(steps + 1, envs, seed=2),
             "dones": (r.random((steps, envs)) > 0.8).astype(np.float32),
             "log_probs": -np.abs(randn(steps, envs, seed=3)) - 1.0}
  rollout["actions"] = rollout["actions"].astype(np.int32)
  params = jax.jit(model.init)(jax.random.key(0), rollout["obs"][0])["params"]
  state = train_state.TrainState.create(apply_fn=model.apply, params=params,
                                        tx=optax.chain(optax.clip_by_global_norm(0.5),
                                                       optax.adam(3e-3)))
  specs = {k: P(None, "data") for k in rollout}
  assert_partitioned_matches(ppo_update, (state, rollout, jax.random.key(1)),
                             (None, specs, P()), mesh_of(mesh), reference=jax.jit(ppo_update),
                             rtol=1e-4, atol=1e-5)


# --- seq2seq (examples/seq2seq): LSTM encoder-decoder, teacher forcing or one-hot feedback --------

class DecoderLSTMCell(nn.RNNCellBase):
  """One decoding step: the LSTM reads the target token (teacher forcing) or the one-hot of its
  own previous argmax, and predicts the next token."""
  features: int
  vocab: int
  teacher_force: bool

  @nn.compact
  def __call__(self, carry, x):
    lstm_state, previous = carry
    if not self.teacher_force:
      x = previous
    lstm_state, y = nn.LSTMCell(self.features)(lstm_state, x)
    logits = nn.Dense(self.vocab)(y)
    prediction = jax.nn.one_hot(jnp.argmax(logits, axis=-1), self.vocab, dtype=x.dtype)
    return (lstm_state, prediction), (logits, prediction)

  @property
  def num_feature_axes(self) -> int:
    return 1


class Seq2seq(nn.Module):
  teacher_force: bool
  features: int = 16
  vocab: int = 8

  @nn.compact
  def __call__(self, inputs, targets):
    """inputs [B, S, vocab], targets [B, T, vocab] (one-hot); targets[:, 0] is the start
    token. Returns logits [B, T - 1, vocab] and predictions."""
    encoder = nn.RNN(nn.LSTMCell(self.features), return_carry=True)
    carry, _ = encoder(inputs)
    decoder = nn.scan(DecoderLSTMCell, variable_broadcast="params",
                      split_rngs={"params": False}, in_axes=1, out_axes=1)
    _, (logits, predictions) = decoder(self.features, self.vocab, self.teacher_force)(
        (carry, targets[:, 0]), targets[:, :-1])
    return logits, predictions


@pytest.mark.parametrize("mesh,batch", [("2x4", 4), ("8x1", 6)])
def test_seq2seq_teacher_forced_train_step_and_greedy_decode(mesh, batch):
  r = np.random.default_rng(0)
  inputs = jax.nn.one_hot(r.integers(2, 8, (batch, 5)), 8)
  targets = jax.nn.one_hot(np.concatenate([np.zeros((batch, 1), int),
                                           r.integers(2, 8, (batch, 4))], 1), 8)
  lengths = jnp.asarray(r.integers(2, 5, batch), jnp.int32)
  model, tx = Seq2seq(teacher_force=True), optax.adam(1e-2)
  params = jax.jit(model.init)(jax.random.key(0), inputs, targets)["params"]
  state = train_state.TrainState.create(apply_fn=model.apply, params=params, tx=tx)

  def train_step(state, inputs, targets, lengths):
    def loss_fn(params):
      logits, _ = state.apply_fn({"params": params}, inputs, targets)
      mask = jnp.arange(logits.shape[1]) < lengths[:, None]
      loss = optax.softmax_cross_entropy(logits, targets[:, 1:])
      return jnp.sum(loss * mask) / jnp.sum(mask)

    loss, grads = jax.value_and_grad(loss_fn)(state.params)
    return state.apply_gradients(grads=grads), loss

  def decode(params, inputs, targets):
    return Seq2seq(teacher_force=False).apply({"params": params}, inputs, targets)[1]

  mesh = mesh_of(mesh)
  step = spmd.partition(train_step, mesh=mesh, in_specs=(None, P("data"), P("data"), P("data")))
  batches = [(jnp.roll(inputs, s, axis=1), targets, lengths) for s in range(3)]
  train_loop(jax.jit(train_step), step, (state,), batches, rtol=1e-4, atol=1e-5)
  assert_partitioned_matches(decode, (params, inputs, targets), (None, P("data"), P("data")),
                             mesh, reference=jax.jit(decode))


# --- ImageNet ResNet stage (examples/imagenet): bottleneck blocks, BatchNorm, bfloat16 compute -----

class BottleneckBlock(nn.Module):
  filters: int
  strides: tuple = (1, 1)

  @nn.compact
  def __call__(self, x, train: bool):
    conv = lambda *a, **k: nn.Conv(*a, use_bias=False, dtype=jnp.bfloat16, **k)  # noqa: E731
    norm = lambda **k: nn.BatchNorm(use_running_average=not train, momentum=0.9,  # noqa: E731
                                    epsilon=1e-5, dtype=jnp.bfloat16, **k)
    residual = x
    y = nn.relu(norm()(conv(self.filters, (1, 1))(x)))
    y = nn.relu(norm()(conv(self.filters, (3, 3), strides=self.strides)(y)))
    y = norm(scale_init=nn.initializers.zeros)(conv(self.filters * 4, (1, 1))(y))
    if residual.shape != y.shape:
      residual = norm(name="norm_proj")(
          conv(self.filters * 4, (1, 1), strides=self.strides, name="conv_proj")(residual))
    return nn.relu(residual + y)


class ResNetStage(nn.Module):
  """A stem (conv, BatchNorm, max pool), then one stage of bottleneck blocks, the first
  downsampling."""
  blocks: int = 2

  @nn.compact
  def __call__(self, x, train: bool = True):
    x = nn.Conv(8, (3, 3), strides=(2, 2), use_bias=False, dtype=jnp.bfloat16, name="conv_init")(x)
    x = nn.BatchNorm(use_running_average=not train, momentum=0.9, dtype=jnp.bfloat16,
                     name="bn_init")(x)
    x = nn.max_pool(nn.relu(x), (3, 3), strides=(2, 2), padding="SAME")
    for block in range(self.blocks):
      x = BottleneckBlock(4, strides=(2, 2) if block == 0 else (1, 1))(x, train)
    return nn.Dense(10, dtype=jnp.bfloat16)(jnp.mean(x, axis=(1, 2))).astype(jnp.float32)


class ImagenetState(train_state.TrainState):
  batch_stats: Any


def imagenet_train_step(state, batch):
  def loss_fn(params):
    logits, updates = state.apply_fn({"params": params, "batch_stats": state.batch_stats},
                                     batch["image"], mutable=["batch_stats"])
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()
    decay = sum(jnp.sum(p ** 2) for p in jax.tree.leaves(params) if p.ndim > 1)
    return loss + 1e-4 * 0.5 * decay, (updates["batch_stats"], logits)

  (loss, (batch_stats, logits)), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
  state = state.apply_gradients(grads=grads, batch_stats=batch_stats)
  accuracy = jnp.mean(jnp.argmax(logits, -1) == batch["label"])
  return state, {"loss": loss, "accuracy": accuracy}


def imagenet_eval_step(state, batch):
  logits = state.apply_fn({"params": state.params, "batch_stats": state.batch_stats},
                          batch["image"], train=False)
  loss = optax.softmax_cross_entropy_with_integer_labels(logits, batch["label"]).mean()
  return {"loss": loss, "logits": logits}


@pytest.mark.parametrize("mesh,batch,blocks", [("2x4", 8, 2), ("8x1", 6, 1)])
def test_imagenet_resnet_stage_bfloat16_batchnorm(mesh, batch, blocks):
  """3 training steps (6 images over 8: uneven; one block there, for time), then the eval step
  on the trained state."""
  model = ResNetStage(blocks)
  images = randn(batch, 16, 16, 3)
  variables = jax.jit(model.init)(jax.random.key(0), images)
  state = ImagenetState.create(apply_fn=model.apply, params=variables["params"],
                               tx=optax.sgd(0.1, momentum=0.9, nesterov=True),
                               batch_stats=variables["batch_stats"])
  state = state.replace(step=jnp.asarray(state.step))  # an array, as the example's replicate
  batches = [({"image": randn(batch, 16, 16, 3, seed=s), "label": jnp.arange(batch) % 10},)
             for s in range(3)]
  mesh = mesh_of(mesh)
  step = spmd.partition(imagenet_train_step, mesh=mesh, in_specs=(None, P("data")))
  # bfloat16: fed back, the two trajectories drift past its tolerance in 3 steps (with float32
  # compute they stay within 2e-7 of each other)
  train_loop(jax.jit(imagenet_train_step), step, (state,), batches, from_reference=True,
             rtol=2e-2, atol=2e-2)
  trained, _ = jax.jit(imagenet_train_step)(state, *batches[0])
  assert_partitioned_matches(imagenet_eval_step, (trained, *batches[1]), (None, P("data")), mesh,
                             reference=jax.jit(imagenet_eval_step), rtol=2e-2, atol=2e-2)


class NnxCachedDecoder(nnx.Module):
  """NNX's own decoding attention: nnx.MultiHeadAttention(decode=True) keeps its keys, values
  and index in nnx.Cache variables made by ``init_cache``."""

  def __init__(self, rngs: nnx.Rngs):
    self.embed = nnx.Embed(16, 16, rngs=rngs)
    self.norm = nnx.LayerNorm(16, rngs=rngs)
    self.attention = nnx.MultiHeadAttention(num_heads=4, in_features=16, decode=True,
                                            rngs=rngs)

  def __call__(self, tokens):
    x = self.embed(tokens)
    return self.embed.attend(x + self.attention(self.norm(x)))


def nnx_greedy_decode(model, prompt, length: int = 10):
  """The decode loop over the model's split state: each fori_loop trip merges the params with
  the carried cache, and the final cache is written back to the model."""
  graphdef, params, cache = nnx.split(model, nnx.Param, nnx.Cache)
  batch, prompt_len = prompt.shape
  tokens = jnp.zeros((batch, length), jnp.int32).at[:, :prompt_len].set(prompt)

  def body(i, carry):
    cache, tokens = carry
    model = nnx.merge(graphdef, params, cache)
    logits = model(lax.dynamic_slice_in_dim(tokens, i, 1, axis=1))
    sampled = jnp.argmax(logits[:, 0], axis=-1).astype(jnp.int32)
    following = lax.dynamic_slice_in_dim(tokens, i + 1, 1, axis=1)[:, 0]
    following = jnp.where(i + 1 < prompt_len, following, sampled)
    return (nnx.state(model, nnx.Cache),
            lax.dynamic_update_slice(tokens, following[:, None], (0, i + 1)))

  cache, tokens = lax.fori_loop(0, length - 1, body, (cache, tokens))
  nnx.update(model, cache)
  return tokens


def test_nnx_multihead_attention_decode_with_cache_variables():
  def fresh():
    model = NnxCachedDecoder(nnx.Rngs(0))
    model.attention.init_cache((4, 10, 16))
    return model

  ours, reference = fresh(), fresh()
  prompt = jnp.asarray(np.random.default_rng(1).integers(1, 16, (4, 3)), jnp.int32)
  decode = spmd.partition(nnx_greedy_decode, mesh=mesh_of("2x4"), in_specs=(None, P("data")))
  assert_trees_match(decode(ours, prompt), nnx.jit(nnx_greedy_decode)(reference, prompt))
  assert_trees_match(nnx.state(ours), nnx.state(reference))  # the caches written back
  plan = check_plan(decode, fresh(), prompt)
  assert not plan.collectives  # every sequence decoded on its own devices
