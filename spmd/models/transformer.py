"""A decoder-only Transformer language model whose params and activations name logical axes.

Embedding, pre-norm blocks of causal self-attention with rotary position embeddings (RoPE) and a
gated (SwiGLU) MLP, RMSNorm, and an untied output projection. Params are float32; activations run
in ``Config.dtype`` (bfloat16 for mixed precision), with softmax and the loss in float32. Layers are
unrolled or one ``nn.scan`` over stacked params (``Config.scan_layers``), optionally rematerialised
in the backward pass (``Config.remat``, ``nn.remat`` = ``jax.checkpoint``).

Written in flax linen rather than NNX: ``nn.scan`` over layers with a logical "layers" axis on the
stacked params, ``nn.remat`` and ``nn.with_logical_partitioning`` compose into a plain pytree of
params with ``nn.get_partition_spec`` names, which is what a functional training step (and a
sharded ``init``) partitions. ``spmd.models.mlp`` is the NNX model.

Logical axes. Params: "vocab", "embed", "heads", "kv" (head dim), "mlp", "layers" (scan).
Activations: "act_batch", "act_res_seq" (the residual stream's sequence), "act_seq" (inside
attention and the MLP), "act_embed", "act_heads", "act_kv", "act_mlp", "act_vocab". ``RULES`` maps
them to a ("data", "model") mesh for each strategy.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from spmd.logical import rule_set

Array = jax.Array

PARAM_AXES = ("vocab", "embed", "heads", "kv", "mlp", "layers")
ACTIVATION_AXES = ("act_batch", "act_res_seq", "act_seq", "act_embed", "act_heads", "act_kv",
                   "act_mlp", "act_vocab")


_rules = functools.partial(rule_set, PARAM_AXES + ACTIVATION_AXES)


# Rule sets over a mesh with axes ("data", "model"), in flax's logical_axis_rules format.
_MEGATRON = (("act_batch", "data"), ("vocab", "model"), ("heads", "model"), ("mlp", "model"),
             ("act_heads", "model"), ("act_mlp", "model"), ("act_vocab", "model"))
RULES: dict[str, tuple[tuple[str, Any], ...]] = {
    # Every device holds every param and a slice of the batch.
    "dp": _rules(("act_batch", ("data", "model"))),
    # ZeRO-3: params split along their embed dim over every device, gathered where used.
    "fsdp": _rules(("act_batch", ("data", "model")), ("embed", ("data", "model"))),
    # Megatron tensor parallelism over "model" (heads, MLP and vocab split), batch over "data".
    "megatron": _rules(*_MEGATRON),
    # GSPMD's 2-D sharding: Megatron over "model", params' embed dim (and the batch) over "data".
    "2d": _rules(*_MEGATRON, ("embed", "data")),
    # Megatron with the residual stream (norms, residual adds) split along the sequence over
    # "model": block boundaries become reduce-scatters and all-gathers instead of all-reduces.
    "sp": _rules(*_MEGATRON, ("act_res_seq", "model")),
}

RESIDUAL = ("act_batch", "act_res_seq", "act_embed")


@dataclasses.dataclass(frozen=True)
class Config:
  vocab: int = 256
  d_model: int = 128
  heads: int = 4
  head_dim: int = 32
  mlp: int = 512
  layers: int = 2
  max_len: int = 256
  dtype: Any = jnp.float32         # activations (params are always float32)
  scan_layers: bool = False
  remat: bool = False
  rope_base: float = 10_000.0


def _init(initializer: Callable, names: tuple[str, ...]) -> Callable:
  return nn.with_logical_partitioning(initializer, names)


def _project(equation: str, shape: tuple[int, ...], inputs: int, names: tuple[str, ...],
             config: Config, name: str) -> nn.Einsum:
  """A bias-free projection whose kernel has ``shape``: its first ``inputs`` dims are contracted
  (LeCun-normal fan-in over them). ``nn.Einsum`` initialises the kernel in its own shape, so its
  logical names apply as they are (``nn.DenseGeneral`` boxes a flattened kernel)."""
  init = nn.initializers.lecun_normal(in_axis=tuple(range(inputs)),
                                      out_axis=tuple(range(inputs, len(shape))))
  return nn.Einsum(shape, equation, use_bias=False, dtype=config.dtype,
                   kernel_init=_init(init, names), name=name)


def _rms_norm(config: Config, name: str) -> nn.RMSNorm:
  return nn.RMSNorm(dtype=config.dtype, scale_init=_init(nn.initializers.ones, ("embed",)),
                    name=name)


def rope(x: Array, positions: Array, base: float) -> Array:
  """Rotary position embedding of ``x`` [batch, seq, heads, head_dim] at ``positions`` [seq]."""
  half = x.shape[-1] // 2
  freq = base ** (-jnp.arange(half, dtype=jnp.float32) / half)
  angle = positions[:, None].astype(jnp.float32) * freq  # [seq, half]
  sin, cos = jnp.sin(angle)[:, None, :], jnp.cos(angle)[:, None, :]
  x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
  return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], -1).astype(x.dtype)


class Attention(nn.Module):
  config: Config

  @nn.compact
  def __call__(self, x: Array) -> Array:
    c = self.config
    heads = ("act_batch", "act_seq", "act_heads", "act_kv")
    project = lambda name: _project("bse,ehd->bshd", (c.d_model, c.heads, c.head_dim), 1,
                                    ("embed", "heads", "kv"), c, name)
    q, k, v = (nn.with_logical_constraint(project(name)(x), heads)
               for name in ("query", "key", "value"))
    positions = jnp.arange(x.shape[1])
    q, k = rope(q, positions, c.rope_base), rope(k, positions, c.rope_base)
    scores = jnp.einsum("bqhd,bkhd->bhqk", q, k).astype(jnp.float32) / jnp.sqrt(c.head_dim)
    causal = jnp.tril(jnp.ones((x.shape[1], x.shape[1]), bool))
    weights = jax.nn.softmax(jnp.where(causal, scores, -1e9), axis=-1).astype(c.dtype)
    out = nn.with_logical_constraint(jnp.einsum("bhqk,bkhd->bqhd", weights, v), heads)
    return _project("bshd,hde->bse", (c.heads, c.head_dim, c.d_model), 2,
                    ("heads", "kv", "embed"), c, "out")(out)


class GatedMLP(nn.Module):
  config: Config

  @nn.compact
  def __call__(self, x: Array) -> Array:
    c = self.config
    gate = _project("bse,em->bsm", (c.d_model, c.mlp), 1, ("embed", "mlp"), c, "gate")(x)
    up = _project("bse,em->bsm", (c.d_model, c.mlp), 1, ("embed", "mlp"), c, "up")(x)
    h = nn.with_logical_constraint(nn.silu(gate) * up, ("act_batch", "act_seq", "act_mlp"))
    return _project("bsm,me->bse", (c.mlp, c.d_model), 1, ("mlp", "embed"), c, "down")(h)


class Block(nn.Module):
  """Pre-norm residual block: x + attention(norm(x)), then + mlp(norm(x))."""

  config: Config

  @nn.compact
  def __call__(self, x: Array, _: Any = None) -> tuple[Array, None]:
    c = self.config
    x = x + Attention(c, name="attention")(_rms_norm(c, "attention_norm")(x))
    x = nn.with_logical_constraint(x, RESIDUAL)
    x = x + GatedMLP(c, name="mlp")(_rms_norm(c, "mlp_norm")(x))
    return nn.with_logical_constraint(x, RESIDUAL), None  # (carry, output) for nn.scan


class Transformer(nn.Module):
  """Tokens [batch, seq] (int) -> logits [batch, seq, vocab] (float32)."""

  config: Config

  @nn.compact
  def __call__(self, tokens: Array) -> Array:
    c = self.config
    embed = nn.Embed(c.vocab, c.d_model, dtype=c.dtype, name="embed",
                     embedding_init=_init(nn.initializers.normal(1.0), ("vocab", "embed")))
    x = nn.with_logical_constraint(embed(tokens), RESIDUAL)
    block = nn.remat(Block) if c.remat else Block
    if c.scan_layers:
      stack = nn.scan(block, variable_axes={"params": 0}, split_rngs={"params": True},
                      length=c.layers, metadata_params={nn.PARTITION_NAME: "layers"})
      x, _ = stack(c, name="layers")(x, None)
    else:
      for i in range(c.layers):
        x, _ = block(c, name=f"layer_{i}")(x, None)
    x = _rms_norm(c, "final_norm")(x)
    logits = _project("bse,ev->bsv", (c.d_model, c.vocab), 1, ("embed", "vocab"), c,
                      "unembed")(x)
    return nn.with_logical_constraint(logits.astype(jnp.float32),
                                      ("act_batch", "act_seq", "act_vocab"))


def next_token_loss(model: Transformer, params: Any, tokens: Array) -> Array:
  """Mean cross entropy of predicting ``tokens[:, 1:]`` from ``tokens[:, :-1]``."""
  logits = model.apply({"params": params}, tokens[:, :-1])
  return optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()
