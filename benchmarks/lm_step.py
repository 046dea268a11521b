"""A language model's training step, built once for the benchmarks that compare spmd's program
with ``jax.jit``'s: ``spmd.train``'s step (value_and_grad of the next-token loss, an optax
optimizer) over state created sharded, ours partitioned by flax logical rules, and ``jax.jit`` of
the same step given our resolved boundary shardings, tracing the model under the same rules (so
XLA sees every activation constraint we see). Importing it sets up no devices.
"""
from __future__ import annotations

import contextlib
import functools
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

import spmd
from spmd.plan import Plan
from spmd.train import create_train_state, make_train_step


@dataclass(frozen=True)
class LMStep:
  """The step's state (as created, ``specs`` its logical specs), a batch of tokens placed as our
  program takes it, our partitioned step with its plan, and ``jax.jit`` of the same step."""

  mesh: Mesh
  rules: Any
  state: Any
  specs: Any
  tokens: jax.Array
  ours: spmd.Partitioned
  plan: Plan
  jitted: Any

  @contextlib.contextmanager
  def xla_context(self) -> Iterator[None]:
    """The context ``jitted`` is traced in: the mesh, and the rules for the model's constraints."""
    with jax.set_mesh(self.mesh), nn.logical_axis_rules(self.rules):
      yield


def build(model: nn.Module, loss: Callable[..., jax.Array], mesh: Mesh, rules: Any,
          batch_axis: str, vocab: int, batch: int, seq: int,
          optimizer: optax.GradientTransformation) -> LMStep:
  """``model``'s training step on ``batch`` random token rows of ``seq + 1`` ids below ``vocab``,
  the batch dim named ``batch_axis``."""
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, vocab, (batch, seq + 1)), jnp.int32)
  state, specs = create_train_state(lambda key: model.init(key, tokens[:, :-1])["params"],
                                    optimizer, mesh, jax.random.key(0), rules=rules)
  step = make_train_step(functools.partial(loss, model))
  ours = spmd.partition(step, mesh=mesh, rules=rules, in_specs=(specs, P(batch_axis, None)),
                        out_specs=(specs, P()))
  plan = ours.plan(state, tokens)
  in_shardings, out_shardings = jax.tree.map(
      lambda s: NamedSharding(mesh, s), (plan.in_specs, plan.out_specs),
      is_leaf=lambda x: isinstance(x, P))
  jitted = jax.jit(step, in_shardings=in_shardings, out_shardings=out_shardings)
  tokens = jax.device_put(tokens, in_shardings[1])
  return LMStep(mesh, rules, state, specs, tokens, ours, plan, jitted)
