"""Small training steps used across tests: MLP, Transformer block, conv net (plain JAX + optax)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax
from jax.sharding import PartitionSpec as P

from spmd.train import optimizer_specs


@dataclass(frozen=True)
class Workload:
  name: str
  fn: Callable
  args: tuple
  in_specs: Any
  out_specs: Any = None


def _train_step(loss_fn: Callable, opt: optax.GradientTransformation) -> Callable:
  def step(params, opt_state, *batch):
    loss, grads = jax.value_and_grad(loss_fn)(params, *batch)
    updates, opt_state = opt.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss
  return step


def _layer_norm(x: jax.Array, scale: jax.Array) -> jax.Array:
  mu = x.mean(-1, keepdims=True)
  var = ((x - mu) ** 2).mean(-1, keepdims=True)
  return (x - mu) * jax.lax.rsqrt(var + 1e-5) * scale


def _opt_specs(opt: optax.GradientTransformation, params: Any, param_specs: Any) -> Any:
  return optimizer_specs(opt, opt.init(params), param_specs)


def mlp(batch: int = 16, d: int = 32, h: int = 64, classes: int = 16,
        layout: str = "megatron") -> Workload:
  k = jax.random.split(jax.random.key(0), 4)
  params = {"w1": jax.random.normal(k[0], (d, h)) / d ** 0.5,
            "w2": jax.random.normal(k[1], (h, classes)) / h ** 0.5}
  x = jax.random.normal(k[2], (batch, d))
  y = jax.random.randint(k[3], (batch,), 0, classes)

  def loss_fn(p, x, y):
    logits = jax.nn.gelu(x @ p["w1"]) @ p["w2"]
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

  opt = optax.adamw(1e-2)
  if layout == "megatron":
    param_specs = {"w1": P(None, "model"), "w2": P("model", None)}
  else:
    param_specs = {"w1": P(), "w2": P()}
  specs = (param_specs, _opt_specs(opt, params, param_specs), P("data", None), P("data"))
  return Workload(f"mlp-{layout}", _train_step(loss_fn, opt),
                  (params, opt.init(params), x, y), specs)


def transformer(batch: int = 4, seq: int = 8, d: int = 32, heads: int = 4, vocab: int = 64) -> Workload:
  k = jax.random.split(jax.random.key(1), 9)
  dh = d // heads
  params = {
      "embed": jax.random.normal(k[0], (vocab, d)) * 0.02,
      "ln1": jnp.ones((d,)), "ln2": jnp.ones((d,)),
      "wq": jax.random.normal(k[1], (d, heads, dh)) / d ** 0.5,
      "wk": jax.random.normal(k[2], (d, heads, dh)) / d ** 0.5,
      "wv": jax.random.normal(k[3], (d, heads, dh)) / d ** 0.5,
      "wo": jax.random.normal(k[4], (heads, dh, d)) / d ** 0.5,
      "w1": jax.random.normal(k[5], (d, 4 * d)) / d ** 0.5,
      "w2": jax.random.normal(k[6], (4 * d, d)) / (4 * d) ** 0.5,
  }
  tokens = jax.random.randint(k[7], (batch, seq), 0, vocab)
  labels = jax.random.randint(k[8], (batch, seq), 0, vocab)

  def loss_fn(p, tokens, labels):
    x = p["embed"][tokens]
    h = _layer_norm(x, p["ln1"])
    q = jnp.einsum("bsd,dhk->bhsk", h, p["wq"])
    kk = jnp.einsum("bsd,dhk->bhsk", h, p["wk"])
    v = jnp.einsum("bsd,dhk->bhsk", h, p["wv"])
    mask = jnp.tril(jnp.ones((seq, seq), bool))
    s = jnp.where(mask, jnp.einsum("bhqk,bhsk->bhqs", q, kk) / dh ** 0.5, -1e9)
    a = jnp.einsum("bhqs,bhsk->bhqk", jax.nn.softmax(s, -1), v)
    x = x + jnp.einsum("bhsk,hkd->bsd", a, p["wo"])
    x = x + jax.nn.gelu(_layer_norm(x, p["ln2"]) @ p["w1"]) @ p["w2"]
    logits = x @ p["embed"].T
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

  opt = optax.adamw(1e-3)
  param_specs = {"embed": P(), "ln1": P(), "ln2": P(),
                 "wq": P(None, "model", None), "wk": P(None, "model", None),
                 "wv": P(None, "model", None), "wo": P("model", None, None),
                 "w1": P(None, "model"), "w2": P("model", None)}
  specs = (param_specs, _opt_specs(opt, params, param_specs), P("data", None), P("data", None))
  return Workload("transformer", _train_step(loss_fn, opt),
                  (params, opt.init(params), tokens, labels), specs)


def convnet(batch: int = 8, hw: int = 8, c: int = 4, classes: int = 8) -> Workload:
  k = jax.random.split(jax.random.key(2), 4)
  params = {"conv": jax.random.normal(k[0], (3, 3, c, 8)) * 0.2,
            "dense": jax.random.normal(k[1], (8 * (hw // 2) ** 2, classes)) * 0.1}
  x = jax.random.normal(k[2], (batch, hw, hw, c))
  y = jax.random.randint(k[3], (batch,), 0, classes)

  def loss_fn(p, x, y):
    h = jax.lax.conv_general_dilated(x, p["conv"], (1, 1), "SAME",
                                     dimension_numbers=("NHWC", "HWIO", "NHWC"))
    h = jax.nn.relu(h)
    h = jax.lax.reduce_window(h, -jnp.inf, jax.lax.max, (1, 2, 2, 1), (1, 2, 2, 1), "VALID")
    logits = h.reshape(h.shape[0], -1) @ p["dense"]
    return optax.softmax_cross_entropy_with_integer_labels(logits, y).mean()

  opt = optax.sgd(0.1)
  param_specs = {"conv": P(), "dense": P()}
  specs = (param_specs, _opt_specs(opt, params, param_specs), P("data"), P("data"))
  return Workload("convnet", _train_step(loss_fn, opt), (params, opt.init(params), x, y), specs)
