"""A deep MLP in flax NNX whose weights name logical axes: the NNX model of spmd.models.

Layers alternate between widening ("embed" -> "mlp") and narrowing ("mlp" -> "embed") kernels,
so Megatron's rules split each pair by columns then rows and its hidden activations never leave
their shard. Pass the module (and an ``nnx.Optimizer``) straight to a partitioned step: spmd
partitions over their state, with specs from the variables' ``nnx.with_partitioning`` names, and
writes the updated state back, as ``nnx.jit`` does.
"""
from __future__ import annotations

import dataclasses
import functools
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx
from flax.linen import with_logical_constraint  # flax's activation constraint, for NNX too

from spmd.logical import rule_set

PARAM_AXES = ("embed", "mlp")
ACTIVATION_AXES = ("act_batch", "act_embed", "act_mlp")


_rules = functools.partial(rule_set, PARAM_AXES + ACTIVATION_AXES)


# Rule sets over a mesh with axes ("data", "model").
RULES: dict[str, tuple[tuple[str, Any], ...]] = {
    "dp": _rules(("act_batch", ("data", "model"))),
    "fsdp": _rules(("act_batch", ("data", "model")), ("embed", ("data", "model"))),
    "megatron": _rules(("act_batch", "data"), ("mlp", "model"), ("act_mlp", "model")),
}


@dataclasses.dataclass(frozen=True)
class Config:
  features: int = 32
  hidden: int = 128
  pairs: int = 2        # widening + narrowing layer pairs


class MLP(nnx.Module):
  """x [batch, features] -> [batch, features]: ``pairs`` residual blocks of
  gelu(x W1 + b1) W2 + b2."""

  def __init__(self, config: Config, rngs: nnx.Rngs):
    def linear(n_in: int, n_out: int, names: tuple[str, str]) -> nnx.Linear:
      return nnx.Linear(n_in, n_out, rngs=rngs,
                        kernel_init=nnx.with_partitioning(nnx.initializers.lecun_normal(), names),
                        bias_init=nnx.with_partitioning(nnx.initializers.zeros, names[1:]))

    self.up = nnx.List([linear(config.features, config.hidden, ("embed", "mlp"))
                        for _ in range(config.pairs)])
    self.down = nnx.List([linear(config.hidden, config.features, ("mlp", "embed"))
                          for _ in range(config.pairs)])

  def __call__(self, x: jax.Array) -> jax.Array:
    for up, down in zip(self.up, self.down):
      h = with_logical_constraint(jax.nn.gelu(up(x)), ("act_batch", "act_mlp"))
      x = x + down(h)
    return x


def regression_loss(model: MLP, x: jax.Array, y: jax.Array) -> jax.Array:
  return jnp.mean((model(x) - y) ** 2)


def train_step(model: MLP, optimizer: nnx.Optimizer, x: jax.Array, y: jax.Array) -> jax.Array:
  """One optimizer step on ``regression_loss``, in place (model and optimizer are updated)."""
  loss, grads = nnx.value_and_grad(regression_loss)(model, x, y)
  optimizer.update(model, grads)
  return loss
