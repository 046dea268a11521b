"""The ``python -m spmd demo`` job: a Megatron-sharded MLP training step (forward, backward and
AdamW) on a ("data", "model") mesh of every device (2 x 4 on 8 devices), checked against the
unpartitioned step."""
from __future__ import annotations

import math
import sys
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
from jax.sharding import PartitionSpec as P

import spmd
from spmd.train import optimizer_specs

MODEL_WAYS = 4  # the "model" axis on 8 devices; data parallel over the rest
BATCH, D_IN, HIDDEN, CLASSES, STEPS = 16, 32, 64, 10, 3
RTOL, ATOL = 1e-4, 1e-5  # float32; AdamW amplifies reduction-order noise in tiny gradients

# Megatron: W1 split by columns, W2 by rows, so the hidden layer never leaves its "model" shard.
PARAM_SPECS = {"w1": P(None, "model"), "b1": P("model"), "w2": P("model", None), "b2": P()}
BATCH_SPECS = (P("data", None), P("data"))

Params = dict[str, jax.Array]


def mlp(params: Params, x: jax.Array) -> jax.Array:
  h = jax.nn.gelu(x @ params["w1"] + params["b1"])
  return h @ params["w2"] + params["b2"]


def make_train_step(opt: optax.GradientTransformation) -> Callable:
  """One step: softmax cross-entropy loss, its gradient, and an ``opt`` update."""

  def loss_fn(params: Params, x: jax.Array, labels: jax.Array) -> jax.Array:
    return optax.softmax_cross_entropy_with_integer_labels(mlp(params, x), labels).mean()

  def train_step(params: Params, opt_state: Any, x: jax.Array,
                 labels: jax.Array) -> tuple[Params, Any, jax.Array]:
    loss, grads = jax.value_and_grad(loss_fn)(params, x, labels)
    updates, opt_state = opt.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  return train_step


def init_params(rng: np.random.Generator) -> Params:
  def normal(*shape: int) -> jax.Array:
    return jnp.asarray(rng.standard_normal(shape, dtype=np.float32) / np.sqrt(shape[0]))

  return {"w1": normal(D_IN, HIDDEN), "b1": jnp.zeros(HIDDEN), "w2": normal(HIDDEN, CLASSES),
          "b2": jnp.zeros(CLASSES)}


def compare(got: Any, want: Any) -> tuple[float, list[str]]:
  """The largest absolute difference over matching leaves, and the leaves not ``allclose``."""
  diff, bad = 0.0, []
  for (path, g), w in zip(jax.tree.leaves_with_path(got), jax.tree.leaves(want)):
    g, w = np.asarray(g), np.asarray(w)
    diff = max(diff, float(np.max(np.abs(g - w))))
    if not np.allclose(g, w, rtol=RTOL, atol=ATOL):
      bad.append(jax.tree_util.keystr(path))
  return diff, bad


def mesh_axes(devices: int) -> dict[str, int]:
  """A 2-D mesh over ``devices``: up to MODEL_WAYS-way Megatron, data parallel over the rest."""
  model = math.gcd(devices, MODEL_WAYS)
  return {"data": devices // model, "model": model}


def run_demo() -> int:
  """Partitions the step, prints its plan, runs ``STEPS`` steps against the unpartitioned step.

  Returns 0 if losses, parameters and optimizer state agree (numpy ``allclose``), 1 otherwise.
  """
  axes = mesh_axes(jax.device_count())
  mesh = spmd.make_mesh(axes)
  opt = optax.adamw(learning_rate=1e-2, weight_decay=1e-2)
  train_step = make_train_step(opt)
  rng = np.random.default_rng(0)
  params = init_params(rng)
  opt_state = opt.init(params)
  opt_specs = optimizer_specs(opt, opt_state, PARAM_SPECS)  # moments follow their params
  state_specs = (PARAM_SPECS, opt_specs)
  step = spmd.partition(train_step, mesh=mesh, in_specs=state_specs + BATCH_SPECS,
                        out_specs=state_specs + (P(),))
  reference = jax.jit(train_step)

  batches = [(jnp.asarray(rng.standard_normal((BATCH, D_IN), dtype=np.float32)),
              jnp.asarray(rng.integers(0, CLASSES, BATCH, dtype=np.int32)))
             for _ in range(STEPS)]
  print(step.plan(params, opt_state, *batches[0]).explain())
  print()

  ref_params, ref_state = params, opt_state
  for i, (x, labels) in enumerate(batches):
    params, opt_state, loss = step(params, opt_state, x, labels)
    ref_params, ref_state, ref_loss = reference(ref_params, ref_state, x, labels)
    diff, bad = compare({"loss": loss, "params": params, "opt_state": opt_state},
                        {"loss": ref_loss, "params": ref_params, "opt_state": ref_state})
    print(f"step {i}: loss {float(loss):.6f}  unpartitioned {float(ref_loss):.6f}  "
          f"max |diff| {diff:.1e}")
    if bad:
      print(f"FAILED: step {i} differs from the unpartitioned step (rtol={RTOL:.0e}, "
            f"atol={ATOL:.0e}) in {', '.join(bad)}", file=sys.stderr)
      return 1

  devices = mesh.devices.size
  print(f"OK: {STEPS} partitioned training steps on {devices} {jax.default_backend()} devices "
        f"{axes} match the unpartitioned step (numpy allclose, rtol={RTOL:.0e}, atol={ATOL:.0e})")
  return 0
