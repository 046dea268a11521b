"""flax's own examples, an eighth round, small and written as their users write them, run through
spmd.partition: the NNX gemma example as it now runs, on a mesh of Explicit axes made by
``jax.make_mesh`` (model and optimizer made by ``nnx.jit`` under ``jax.set_mesh``, params sharded
as their ``out_sharding`` metadata says, einsums given ``out_sharding=``, a sliding-window layer
 logit soft-caps, QK-norm, grouped-query attention, packed examples,
intermediates captured by ``nnx.capture``, top-k attention logits sown through ``auto_axes``,
dropout from an ``nnx.Rngs`` argument forked in the step, an ``nnx.MultiMetric`` updated in the
step), and its sampler's step (``nnx.merge`` of a split model, the cache written by
dynamic_update_slice at its ``end_index``, the token, logits and intermediates buffers written
at a traced step), with in_specs None: the committed arguments' shardings.
Each is checked against the same step under ``nnx.jit`` / ``jax.jit``, the state fed back, then
its plan against the compiled program (helpers.check_plan)."""
import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from jax.sharding import PartitionSpec as P
from jax.sharding import auto_axes

import spmd
from helpers import assert_trees_match, check_plan

K_MASK = -2.3819763e38
INIT = nnx.initializers.normal(0.3)  # as examples/gemma's FeedForward (no truncated normal)


# --- examples/gemma on an Explicit mesh ("fsdp", "tp") ---------------------------------------

@dataclasses.dataclass(frozen=True)
class Shd:
  """examples/gemma's ShardingConfig.fsdp_tp_sharding (sampling: params not split over fsdp)."""
  sampling: bool = False

  def __getattr__(self, name):
    fsdp, tp = (None if self.sampling else "fsdp"), "tp"
    return {"emb_vd": P(tp, fsdp), "q_weight_ndh": P(tp, fsdp, None),
            "kv_weight_cndh": P(None, tp, fsdp, None), "o_weight_nhd": P(tp, None, fsdp),
            "ffw_weight_df": P(fsdp, tp), "ffw_weight_fd": P(tp, fsdp), "rms_norm_weight": P(tp),
            "act_btd": P("fsdp", None, None if self.sampling else tp),
            "act_btf": P("fsdp", None, tp), "act_btnh": P("fsdp", None, tp, None),
            "act_sbtnh": P(None, "fsdp", None, tp, None)}[name]


LAYERS = (True,)  # sliding-window layers (a global one: tests/test_flax_workloads.py)
VOCAB, EMBED, HEADS, KV_HEADS, HEAD_DIM, HIDDEN, WINDOW, TOPK = 16, 16, 8, 4, 4, 32, 3, 2


class RMSNorm(nnx.Module):
  def __init__(self, dim, spec=None):
    self.scale = nnx.Param(jnp.zeros((dim,)), out_sharding=spec)

  def __call__(self, x):
    x = x * jax.lax.rsqrt(jnp.mean(jnp.square(x), axis=-1, keepdims=True) + 1e-6)
    return x * (1.0 + self.scale[...])


def apply_rope(x, positions, max_wavelength=10_000):
  timescale = max_wavelength ** (2 * jnp.arange(x.shape[-1] // 2) / x.shape[-1])
  angle = (positions[..., None] / timescale)[..., None, :]
  first, second = jnp.split(x, 2, axis=-1)
  return jnp.concatenate([first * jnp.cos(angle) - second * jnp.sin(angle),
                          second * jnp.cos(angle) + first * jnp.sin(angle)], axis=-1)


class Attention(nnx.Module):
  """examples/gemma's Attention: GQA by grouped einsums, QK-norm, a soft-capped logit, an
  optional sliding window, the cache written at ``end_index % cache size``."""

  def __init__(self, shd, sliding, rngs):
    self.shd, self.sliding = shd, sliding
    einsum = lambda eq, shape, spec: nnx.Einsum(  # noqa: E731
        eq, shape, kernel_init=INIT, kernel_metadata={"out_sharding": spec}, rngs=rngs)
    self.q_einsum = einsum("BTD,NDH->BTNH", (HEADS, EMBED, HEAD_DIM), shd.q_weight_ndh)
    self.kv_einsum = einsum("BTD,CKDH->CBTKH", (2, KV_HEADS, EMBED, HEAD_DIM),
                            shd.kv_weight_cndh)
    self.attn_vec_einsum = einsum("BTNH,NHD->BTD", (HEADS, HEAD_DIM, EMBED), shd.o_weight_nhd)
    self.query_norm, self.key_norm = RMSNorm(HEAD_DIM), RMSNorm(HEAD_DIM)
    self.dropout = nnx.Dropout(0.1)

  def __call__(self, x, positions, cache, mask, rngs=None):
    q = self.query_norm(self.q_einsum(x, out_sharding=self.shd.act_btnh))
    k, v = self.kv_einsum(x, out_sharding=self.shd.act_sbtnh)
    k = apply_rope(self.key_norm(k), positions)
    q = apply_rope(q, positions) * HEAD_DIM ** -0.5
    if cache is not None:
      start = (0, cache["end_index"][0] % cache["v"].shape[1], 0, 0)
      k = jax.lax.dynamic_update_slice(cache["k"], k, start)
      v = jax.lax.dynamic_update_slice(cache["v"], v, start)
    b, t = q.shape[:2]
    q = q.reshape(b, t, KV_HEADS, HEADS // KV_HEADS, HEAD_DIM)
    logits = jnp.einsum("BTKGH,BSKH->BTKGS", q, k).reshape(b, t, HEADS, -1)
    logits = jnp.tanh(logits / 50.0) * 50.0
    if self.sliding:
      ones = jnp.ones(mask.shape, dtype=mask.dtype)
      mask = mask * jnp.triu(ones, 1 - WINDOW) * jnp.tril(ones, WINDOW - 1)
    logits = jnp.where(jnp.expand_dims(mask, -2), logits, K_MASK)
    shd = jax.typeof(logits).sharding
    values, indices = auto_axes(lambda z: jax.lax.top_k(z, TOPK), out_sharding=shd)(logits)
    self.sow(nnx.Intermediate, "logits_topk_values", values)
    self.sow(nnx.Intermediate, "logits_topk_indices", indices)
    probs = self.dropout(jax.nn.softmax(logits, axis=-1), rngs=rngs)
    probs = probs.reshape(b, t, KV_HEADS, HEADS // KV_HEADS, -1)
    encoded = jnp.einsum("BTKGS,BSKH->BTKGH", probs, v).reshape(b, t, HEADS, HEAD_DIM)
    out = self.attn_vec_einsum(encoded, out_sharding=self.shd.act_btd)
    if cache is None:
      return None, out
    return {"k": k, "v": v, "end_index": cache["end_index"] + t}, out


class Block(nnx.Module):
  def __init__(self, shd, sliding, rngs):
    self.pre_attention_norm = RMSNorm(EMBED, shd.rms_norm_weight)
    self.attn = Attention(shd, sliding, rngs)
    self.pre_ffw_norm = RMSNorm(EMBED, shd.rms_norm_weight)
    linear = lambda i, o, spec: nnx.Linear(  # noqa: E731
        i, o, use_bias=False, kernel_init=INIT, kernel_metadata={"out_sharding": spec},
        rngs=rngs)
    self.gate_proj = linear(EMBED, HIDDEN, shd.ffw_weight_df)
    self.up_proj = linear(EMBED, HIDDEN, shd.ffw_weight_df)
    self.down_proj = linear(HIDDEN, EMBED, shd.ffw_weight_fd)
    self.shd = shd

  def __call__(self, x, positions, cache, mask, rngs=None):
    cache, attn = self.attn(self.pre_attention_norm(x), positions, cache, mask, rngs=rngs)
    x = x + attn
    self.sow(nnx.Intermediate, "rs_after_attention", x)
    h = self.pre_ffw_norm(x)
    h = nnx.gelu(self.gate_proj(h, out_sharding=self.shd.act_btf)) * self.up_proj(
        h, out_sharding=self.shd.act_btf)
    x = x + self.down_proj(h, out_sharding=self.shd.act_btd)
    return cache, x


class Gemma(nnx.Module):
  """A local sliding-window layer, then a global one; the embedding tied, its logits soft-capped."""

  def __init__(self, shd, rngs):
    self.embedder = nnx.Embed(VOCAB, EMBED, embedding_init=INIT,
                              embedding_metadata={"out_sharding": shd.emb_vd}, rngs=rngs)
    self.layers = nnx.List([Block(shd, sliding, rngs) for sliding in LAYERS])
    self.final_norm = RMSNorm(EMBED, shd.rms_norm_weight)
    self.shd = shd

  def __call__(self, tokens, positions, cache, mask, rngs=None):
    x = self.embedder(tokens, out_sharding=self.shd.act_btd) * jnp.sqrt(EMBED)
    new_cache = None if cache is None else {}
    for i, layer in enumerate(self.layers):
      layer_cache, x = layer(x, positions, cache and cache[f"layer_{i}"], mask, rngs=rngs)
      if cache is not None:
        new_cache[f"layer_{i}"] = layer_cache
    logits = self.embedder.attend(self.final_norm(x), out_sharding=self.shd.act_btd)
    return jnp.tanh(logits / 30.0) * 30.0, new_cache


def causal_mask(input_mask):
  """examples/gemma's make_causal_attn_mask."""
  n = input_mask.shape[-1]
  return input_mask[..., None, :] * jnp.tril(jnp.ones((n, n), dtype=jnp.bool_))[None]


def gemma_train_step(model, optimizer, rngs, batch, metrics):
  """examples/gemma's nnx_train_step with_capture: packed examples (segment masks), label
  smoothing, intermediates captured, accuracy metrics on the unpadded tokens."""
  inputs, positions, segments, targets = (
      batch[k] for k in ("inputs", "inputs_position", "inputs_segmentation", "targets"))
  input_mask = inputs > 0
  weights = input_mask.astype(jnp.float32)
  mask = jnp.logical_and(segments[:, :, None] == segments[:, None, :], causal_mask(input_mask))

  def loss_fn(model, rngs):
    (logits, _), intermediates = nnx.capture(model, nnx.Intermediate)(
        inputs, positions, None, mask, rngs=rngs)
    soft = optax.smooth_labels(jax.nn.one_hot(targets, VOCAB), 0.1)
    loss = optax.softmax_cross_entropy(logits, soft) * weights
    per_sample = loss.sum(axis=1) * len(loss) / weights.sum()
    return per_sample.mean(), (per_sample, logits, intermediates)

  grad_fn = nnx.value_and_grad(loss_fn, has_aux=True)
  (loss, (per_sample, logits, intermediates)), grads = grad_fn(model, rngs.fork())
  optimizer.update(model, grads)
  metrics.update(loss=per_sample, logits=logits, labels=targets)
  return loss, intermediates


def make_gemma(mesh, shd=Shd()):
  """The model, its optimizer, the dropout stream and the metrics, made by one ``nnx.jit`` under
  the mesh (as flax's sharding guide makes them): params sharded as their metadata says."""

  @nnx.jit
  def create():
    model = Gemma(shd, nnx.Rngs(jax.random.key(0, impl="rbg")))  # rbg: compiles faster
    metrics = nnx.MultiMetric(loss=nnx.metrics.Average("loss"),
                              accuracy=nnx.metrics.Accuracy())
    return model, nnx.Optimizer(model, optax.adamw(1e-2), wrt=nnx.Param), nnx.Rngs(1), metrics

  with jax.set_mesh(mesh):
    return create()


def packed_batch(mesh, seed):
  """Two sequences packed per row, the last row padded; sharded over "fsdp" as the example's
  input pipeline places them."""
  rng = np.random.default_rng(seed)
  tokens = rng.integers(1, VOCAB, (4, 9)).astype(np.int32)
  tokens[3, 6:] = 0
  segments = np.repeat(np.array([[1] * 5 + [2] * 4]), 4, axis=0).astype(np.int32)
  positions = np.concatenate([np.arange(5), np.arange(4)])[None].repeat(4, 0).astype(np.int32)
  batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:],
           "inputs_position": positions[:, :-1], "inputs_segmentation": segments[:, :-1]}
  sharding = jax.sharding.NamedSharding(mesh, P("fsdp"))
  return jax.tree.map(lambda a: jax.device_put(a, sharding), batch)


def test_gemma_explicit_mesh_train_step_with_capture_and_metrics():
  """Two train steps, the model, optimizer, rngs and metrics fed back, against nnx.jit."""
  mesh = jax.make_mesh((2, 4), ("fsdp", "tp"))
  ours = make_gemma(mesh)
  reference = nnx.clone(ours)
  step = spmd.partition(gemma_train_step, mesh=mesh)
  with jax.set_mesh(mesh):
    jitted = nnx.jit(gemma_train_step)
    for seed in range(2):
      batch = packed_batch(mesh, seed)
      assert_trees_match(step(*ours[:3], batch, ours[3]),
                         jitted(*reference[:3], batch, reference[3]), rtol=1e-4, atol=1e-5)
    for got, want in zip(ours, reference):
      assert_trees_match(nnx.state(got), nnx.state(want), rtol=1e-4, atol=1e-5)
    assert_trees_match(ours[3].compute(), reference[3].compute(), rtol=1e-4, atol=1e-5)
  check_plan(step, *ours[:3], packed_batch(mesh, 0), ours[3])


CACHE, FORBIDDEN = 8, (3, 5)


def attention_masks(time_step, seq_len, input_mask):
  """examples/gemma's _compute_attention_masks: the positions up to ``time_step``, less pads."""
  batch = input_mask.shape[0]
  causal_padding = jnp.arange(seq_len)[None] > jnp.full((batch, 1), time_step, jnp.uint32)
  input_mask = jax.lax.dynamic_slice(input_mask, (0, jnp.maximum(time_step - seq_len + 1, 0)),
                                     (batch, seq_len))
  return ~jnp.logical_or(causal_padding, input_mask)[:, None, :]


def sample_step(graphdef, params, state):
  """examples/gemma's Sampler._sample_step, greedy: the token at ``decoding_step`` fed through
  the merged model with the cache, forbidden tokens masked, the prompt forced, the next token,
  its logits and the residual stream after each attention written at ``decoding_step + 1``."""
  step, tokens = state["decoding_step"], state["token_buffer"]
  batch = tokens.shape[0]
  forward = nnx.capture(nnx.merge(graphdef, params), nnx.Intermediate)
  (logits, cache), intermediates = forward(
      tokens[:, step].reshape(batch, 1), state["positions"][:, step][:, None], state["cache"],
      attention_masks(step, CACHE, tokens == 0))
  logits = logits.at[:, :, FORBIDDEN].set(-jnp.inf, out_sharding=jax.typeof(logits).sharding)
  following = jnp.where(step < state["num_input_tokens"] - 1, tokens[:, step + 1],
                        jnp.argmax(logits, axis=-1)[:, 0])
  residuals = state["residuals"]
  for i, layer in enumerate(intermediates["layers"].values()):
    residuals = residuals.at[i, :, step + 1].set(layer["rs_after_attention"][0][:, 0])
  tokens = tokens.at[:, step + 1].set(following)
  return dict(state, decoding_step=step + 1, token_buffer=tokens, cache=cache,
              logits_buffer=state["logits_buffer"].at[:, step + 1].set(logits[:, 0]),
              residuals=residuals, done=state["done"] | (following == 1))


def sampler_state(mesh, prompt):
  """The sampler's state for ``prompt`` (left aligned, 0-padded), split over "fsdp" by batch
  (its logits are, and jax.jit's typing refuses mixing them with whole tokens); each layer's
  cache also over "tp" by kv head, as examples/gemma's init_cache places it."""
  batch, length = prompt.shape
  tokens = np.zeros((batch, CACHE), np.int32)
  tokens[:, :length] = prompt
  positions = np.cumsum(tokens > 0, axis=-1)
  kv = np.zeros((batch, CACHE, KV_HEADS, HEAD_DIM), np.float32)
  state = {"token_buffer": tokens, "positions": (positions - (positions >= 1)).astype(np.int32),
           "num_input_tokens": (prompt > 0).sum(-1).astype(np.int32),
           "cache": {f"layer_{i}": {"k": kv, "v": kv, "end_index": np.zeros(batch, np.int32)}
                     for i in range(len(LAYERS))},
           "logits_buffer": np.zeros((batch, CACHE, VOCAB), np.float32),
           "residuals": np.zeros((len(LAYERS), batch, CACHE, EMBED), np.float32),
           "done": np.zeros(batch, bool)}
  specs = jax.tree.map(lambda _: P("fsdp"), state)
  specs["residuals"], specs["logits_buffer"] = P(None, "fsdp", None, "tp"), P("fsdp", None, "tp")
  for layer in specs["cache"].values():  # end_index whole: each layer reads its first entry
    layer.update(k=P("fsdp", None, "tp", None), v=P("fsdp", None, "tp", None), end_index=P())
  state = jax.device_put(state, jax.tree.map(lambda p: jax.sharding.NamedSharding(mesh, p),
                                             specs))
  return dict(state, decoding_step=jnp.int32(0))


def test_gemma_sampler_steps_over_a_sharded_cache_with_captured_intermediates():
  """Four sampler steps (two forced by the prompt), the state fed back, against jax.jit; the
  forbidden tokens masked in vocab-split logits by a scatter given ``out_sharding=``."""
  mesh = jax.make_mesh((2, 4), ("fsdp", "tp"))
  model = make_gemma(mesh)[0]
  model.eval()  # no dropout
  graphdef, params = nnx.split(model)
  prompt = np.array([[2, 7, 4], [9, 2, 0], [6, 6, 11], [8, 0, 0]], np.int32)
  ours = want = sampler_state(mesh, prompt)
  step = spmd.partition(sample_step, mesh=mesh, static_argnums=0)
  with jax.set_mesh(mesh):
    jitted = jax.jit(sample_step, static_argnums=0)
    for _ in range(4):
      ours, want = step(graphdef, params, ours), jitted(graphdef, params, want)
      assert_trees_match(ours, want, rtol=1e-4, atol=1e-5)
  check_plan(step, graphdef, params, ours)
