"""Search time of partition(auto=True) for an L-layer Transformer training step (AdamW), batch
sharded over "data", params and optimizer state open, memory limit half the replicated state.

  python benchmarks/auto.py [--layers 1 4 16]
"""
from __future__ import annotations

import argparse
import functools
import os

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from flax.training.train_state import TrainState  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import spmd  # noqa: E402
from spmd.models import transformer  # noqa: E402
from spmd.train import make_train_step  # noqa: E402


def report(layers: int) -> str:
  """The search's summary for a Transformer step of ``layers`` layers."""
  config = transformer.Config(vocab=64, d_model=32, heads=4, head_dim=8, mlp=64, layers=layers)
  model = transformer.Transformer(config)
  tokens = jax.ShapeDtypeStruct((8, 17), jnp.int32)
  state = jax.eval_shape(lambda key: TrainState.create(
      apply_fn=None, params=nn.unbox(model.init(key, jnp.zeros((8, 16), jnp.int32))["params"]),
      tx=optax.adamw(1e-2)), jax.random.key(0))
  step = make_train_step(functools.partial(transformer.next_token_loss, model))
  replicated = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state))
  f = spmd.partition(step, mesh=spmd.make_mesh({"data": 2, "model": 4}), auto=True,
                     memory_limit=replicated // 2, in_specs=(None, P("data", None)))
  search = f.plan(state, tokens).search
  return f"{layers} layers: " + "\n".join(search.lines())


def main() -> None:
  parser = argparse.ArgumentParser()
  parser.add_argument("--layers", type=int, nargs="+", default=[1, 4, 16])
  for layers in parser.parse_args().layers:
    print(report(layers), flush=True)


if __name__ == "__main__":
  main()
