"""Training state created already sharded, optimizer state sharded like its params, one step.

The state is flax's ``TrainState`` (step, params, optimizer and its state). ``create_train_state``
runs the params' initialiser as a partitioned program whose outputs are the sharded state, so no
param is ever whole on one device; ``init_module`` does the same for an NNX module. A step built
by ``make_train_step`` is partitioned like any function; donate the state (``donate_argnums=0``) so
each step updates it in place.
"""
from __future__ import annotations

import sys
from typing import Any, Callable, Sequence

import flax.linen as nn
import jax
import optax
from flax.core import spmd as flax_spmd
from flax.training.train_state import TrainState
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

import spmd.api

Rules = Sequence[tuple[str, Any]] | None


def optimizer_specs(optimizer: optax.GradientTransformation, opt_state: Any,
                    param_specs: Any) -> Any:
  """Specs for ``opt_state`` of any optax ``optimizer``: every per-param leaf (Adam's moments,
  momentum, ...) takes its param's spec; the rest (step counts, scalars) is replicated.

  ``param_specs`` is a tree like the params with a spec (PartitionSpec, logical names or None)
  per leaf, e.g. ``nn.get_partition_spec(variables)["params"]``. Uses optax's own
  ``tree_map_params``, so wrappers (chains, masks, multi_transform) are followed as optax does.
  """
  return optax.tree_map_params(optimizer, lambda _, spec: spec, opt_state, param_specs,
                               transform_non_params=lambda _: P(),
                               is_leaf=lambda x: x is None or isinstance(x, P))


def state_specs(state: TrainState, param_specs: Any) -> TrainState:
  """``state`` (concrete or abstract) with a spec per leaf: the step counter replicated, params
  as ``param_specs``, optimizer state following its params."""
  return state.replace(step=P(), params=param_specs,
                       opt_state=optimizer_specs(state.tx, state.opt_state, param_specs))


def create_train_state(init_params: Callable[..., Any], tx: optax.GradientTransformation,
                       mesh: Mesh, *init_args: Any, rules: Rules = None,
                       param_specs: Any = None,
                       apply_fn: Callable | None = None) -> tuple[TrainState, TrainState]:
  """A ``TrainState`` created sharded over ``mesh``, and its specs.

  ``init_params(*init_args)`` returns the params, boxed by flax's ``with_logical_partitioning``
  / ``with_partitioning`` (e.g. ``lambda key: model.init(key, x)["params"]``) or plain.
  ``param_specs`` defaults to the boxes' names (``nn.get_partition_spec``), resolved through
  ``rules``; an unboxed param is replicated. The initialiser and ``tx.init`` run as one
  partitioned program whose outputs are the state's shards.
  """
  if param_specs is None:
    param_specs = nn.get_partition_spec(jax.eval_shape(init_params, *init_args))

  def create(*args: Any) -> TrainState:
    return TrainState.create(apply_fn=apply_fn, params=nn.unbox(init_params(*args)), tx=tx)

  specs = state_specs(jax.eval_shape(create, *init_args), param_specs)
  init = spmd.api.partition(create, mesh=mesh, rules=rules, in_specs=P(), out_specs=specs)
  return init(*init_args), specs


def init_module(create: Callable[[], Any], mesh: Mesh, rules: Rules = None) -> Any:
  """The NNX module(s) ``create()`` returns (a module, or e.g. a model and its
  ``nnx.Optimizer``), every variable created sharded as its metadata says
  (``nnx.with_partitioning`` names, resolved through ``rules``): the constructor runs as a
  partitioned program, so no variable is ever whole on one device."""
  nnx = sys.modules["flax.nnx"]
  with jax.sharding.use_abstract_mesh(mesh.abstract_mesh), flax_spmd.logical_axis_rules(
      tuple(rules or ())):
    graphdef, abstract = nnx.split(nnx.eval_shape(create))
  build = spmd.api.partition(lambda: nnx.state(create()), mesh=mesh, rules=rules,
                             out_specs=nnx.get_partition_spec(abstract))
  return nnx.merge(graphdef, build())


def make_train_step(loss_fn: Callable[[Any, Any], jax.Array]
                    ) -> Callable[[TrainState, Any], tuple[TrainState, jax.Array]]:
  """``step(state, batch) -> (state, loss)``: the gradient of ``loss_fn(params, batch)`` applied
  by the state's optimizer."""

  def step(state: TrainState, batch: Any) -> tuple[TrainState, jax.Array]:
    loss, grads = jax.value_and_grad(loss_fn)(state.params, batch)
    return state.apply_gradients(grads=grads), loss

  return step
