"""A GShard mixture-of-experts layer (Lepikhin et al. 2020) in a small language model.

Tokens come in groups, [groups, group_size, d_model]; each group is routed on its own. A softmax
router sends every token to its top ``k`` experts, each expert taking at most ``capacity`` tokens
per group (first choices queue before second choices; tokens past the capacity are dropped for
that expert). Dispatch and combine are GShard's einsums over [groups, group_size, experts,
capacity] masks built from one-hot queue positions (a cumsum along group_size): the experts run on
[experts, groups, capacity, d_model], with weights [experts, d_model, mlp]. The auxiliary load
balancing loss is GShard's: experts x mean over groups of sum_e (fraction of first choices going
to e) x (mean router probability of e); 1 when routing is uniform.

``MoELM`` wraps one residual MoE block between an embedding and an output projection; each sequence
is a group. Written in linen like ``spmd.models.transformer``.

Logical axes. Params: "vocab", "embed", "expert", "mlp" (the router's kernel is replicated in every
rule set: each token's gate needs every expert). Activations: "act_group" (the token groups,
sharded like a batch), "act_embed", "act_expert", "act_capacity", "act_mlp", "act_vocab". The
group_size dim is never sharded (the cumsum of queue positions runs along it). ``RULES`` maps them
to a ("data", "model") mesh, the Transformer's (a logical name must not be a mesh axis name, so
the mesh has no "expert" axis).
"""
from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from spmd.logical import rule_set

Array = jax.Array

PARAM_AXES = ("vocab", "embed", "expert", "mlp")
ACTIVATION_AXES = ("act_group", "act_embed", "act_expert", "act_capacity", "act_mlp", "act_vocab")


_rules = functools.partial(rule_set, PARAM_AXES + ACTIVATION_AXES)


# Rule sets over a mesh with axes ("data", "model"), in flax's logical_axis_rules format. Groups
# are split over every device in both.
RULES: dict[str, tuple[tuple[str, Any], ...]] = {
    # Every device holds every expert and routes its own groups.
    "dp": _rules(("act_group", ("data", "model"))),
    # GShard: experts split over "model". Where an array has an expert dim, it takes "model" and
    # its groups only "data" (flax skips a rule whose mesh axes are taken), so dispatch and
    # combine move "model" between the group and the expert dims: one all-to-all each.
    "expert_parallel": _rules(("expert", "model"), ("act_expert", "model"),
                              ("act_group", ("data", "model")), ("act_group", "data")),
}

TOKENS = ("act_group", None, "act_embed")  # [groups, group_size, d_model]
# [experts, groups, capacity, d_model] where the experts run. Dispatch and combine einsums run on
# each device's own groups, so the reshards to and from it are the all-to-alls.
EXPERT_TOKENS = ("act_expert", "act_group", "act_capacity", "act_embed")


@dataclasses.dataclass(frozen=True)
class Config:
  vocab: int = 256
  d_model: int = 128
  mlp: int = 512
  experts: int = 8
  k: int = 2
  capacity_factor: float = 1.25
  aux_loss_weight: float = 1e-2


def _lecun(names: tuple[str | None, ...], **axes: Any) -> Any:
  """LeCun-normal initialiser (``axes``: its in/out/batch axes) of a param whose dims are named
  ``names``."""
  return nn.with_logical_partitioning(nn.initializers.lecun_normal(**axes), names)


def capacity(config: Config, group_size: int) -> int:
  """Tokens an expert takes per group: its share of the group's ``k`` choices, times the factor."""
  return math.ceil(config.k * group_size * config.capacity_factor / config.experts)


def route(logits: Array, k: int, capacity: int) -> tuple[Array, Array, Array]:
  """Top-``k`` routing of router ``logits`` [groups, group_size, experts] (float32).

  Returns ``combine`` [groups, group_size, experts, capacity] (each token's normalised gate at
  its expert and queue slot), the 0/1 ``dispatch`` mask of the same shape, and the auxiliary load
  balancing loss.
  """
  groups, size, experts = logits.shape
  probs = jax.nn.softmax(logits, axis=-1)
  gates, chosen = jax.lax.top_k(probs, k)  # [g, s, k], best first
  gates = gates / gates.sum(-1, keepdims=True)
  choice = jax.nn.one_hot(chosen, experts, dtype=jnp.float32)  # [g, s, k, e]
  # Queue positions in each expert: all first choices of the group in token order, then all
  # second choices, ... (a cumsum along group_size, in every group on its own).
  queue = jnp.swapaxes(choice, 1, 2).reshape(groups, k * size, experts)
  position = jnp.swapaxes(((jnp.cumsum(queue, axis=1) - 1) * queue).reshape(
      groups, k, size, experts), 1, 2).sum(-1)  # [g, s, k]
  # one_hot of a position past the capacity is all zeros: that choice is dropped
  slot = jax.nn.one_hot(position.astype(jnp.int32), capacity, dtype=jnp.float32)  # [g, s, k, c]
  dispatch = jnp.einsum("gske,gskc->gsec", choice, slot)
  combine = jnp.einsum("gsk,gske,gskc->gsec", gates, choice, slot)
  first_share = choice[:, :, 0].mean(1)  # [g, e]
  aux_loss = experts * jnp.mean(jnp.sum(first_share * probs.mean(1), -1))
  return combine, dispatch, aux_loss


class MoE(nn.Module):
  """[groups, group_size, d_model] -> (the same shape, auxiliary loss): a ReLU MLP per expert."""

  config: Config

  @nn.compact
  def __call__(self, x: Array) -> tuple[Array, Array]:
    c = self.config
    per_expert = dict(in_axis=1, out_axis=2, batch_axis=0)
    w_in = self.param("w_in", _lecun(("expert", "embed", "mlp"), **per_expert),
                      (c.experts, c.d_model, c.mlp))
    w_out = self.param("w_out", _lecun(("expert", "mlp", "embed"), **per_expert),
                       (c.experts, c.mlp, c.d_model))
    logits = nn.Einsum((c.d_model, c.experts), "gsm,me->gse", use_bias=False,
                       kernel_init=_lecun(("embed", None)), name="router")(x)
    combine, dispatch, aux_loss = route(logits, c.k, capacity(c, x.shape[1]))
    expert_in = nn.with_logical_constraint(jnp.einsum("gsec,gsm->egcm", dispatch, x),
                                           EXPERT_TOKENS)
    h = nn.with_logical_constraint(
        nn.relu(jnp.einsum("egcm,emh->egch", expert_in, w_in)),
        ("act_expert", "act_group", "act_capacity", "act_mlp"))
    expert_out = nn.with_logical_constraint(jnp.einsum("egch,ehm->egcm", h, w_out),
                                            EXPERT_TOKENS)
    y = nn.with_logical_constraint(jnp.einsum("gsec,egcm->gsm", combine, expert_out), TOKENS)
    return y, aux_loss


class MoELM(nn.Module):
  """Tokens [groups, group_size] (int) -> (logits [groups, group_size, vocab], auxiliary loss):
  embedding, x + MoE(x), output projection."""

  config: Config

  @nn.compact
  def __call__(self, tokens: Array) -> tuple[Array, Array]:
    c = self.config
    embed = nn.Embed(c.vocab, c.d_model, name="embed", embedding_init=nn.with_logical_partitioning(
        nn.initializers.normal(1.0), ("vocab", "embed")))
    x = nn.with_logical_constraint(embed(tokens), TOKENS)
    y, aux_loss = MoE(c, name="moe")(x)
    x = nn.with_logical_constraint(x + y, TOKENS)
    logits = nn.Einsum((c.d_model, c.vocab), "gsm,mv->gsv", use_bias=False,
                       kernel_init=_lecun(("embed", "vocab")), name="unembed")(x)
    return nn.with_logical_constraint(logits, ("act_group", None, "act_vocab")), aux_loss


def next_token_loss(model: MoELM, params: Any, tokens: Array) -> Array:
  """Mean cross entropy of predicting ``tokens[:, 1:]`` from ``tokens[:, :-1]``, plus the
  weighted auxiliary loss."""
  logits, aux_loss = model.apply({"params": params}, tokens[:, :-1])
  loss = optax.softmax_cross_entropy_with_integer_labels(logits, tokens[:, 1:]).mean()
  return loss + model.config.aux_loss_weight * aux_loss
