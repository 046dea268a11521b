"""Planning time: spmd's own work on an L-layer Transformer training step, against XLA's compile.

    python benchmarks/planning.py [--layers 1 4 16 64]

For each L, a fresh partitioned step (value_and_grad + AdamW, 2-D sharded: batch over "data",
Megatron over "model", on 8 simulated CPU devices) is timed in phases, side by side in one run:
  spmd   trace + propagate + schedule (``plan``) and lowering to StableHLO (``lower``);
  XLA    compiling that lowered program;
  jit    ``jax.jit`` of the same step with the same in_shardings: trace + lower + compile.
Reported: equations in the program, spmd's time per equation, spmd / XLA compile, jit's trace
alone (the floor: spmd traces the same step), spmd's own work (spmd less its trace and JAX's
lowering) / XLA compile, and spmd's total (spmd + its XLA compile) / jax.jit's total; then spmd's
phases per equation:
  trace      jax.make_jaxpr of the step (as jax.jit also does);
  program    building the program (inlining, CSE, dead ops; ir.py);
  propagate  shardings for every value (propagate.py);
  schedule   executions and reshards of every op (schedule.py);
  render     the Plan's rows, collectives and warnings (rendering.py);
  replay     tracing the shard_map body: the schedule replayed, each op and collective bound on
             local shards (lower.py; mostly JAX's binding of each equation);
  lower      JAX's lowering of that program to StableHLO.
"""
from __future__ import annotations

import argparse
import contextlib
import gc
import importlib
import os
import time
from typing import Iterator

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import optax  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import spmd  # noqa: E402
from spmd.train import optimizer_specs  # noqa: E402

# The pipeline's steps, each timed where it is called from: (phase, module, attribute).
PHASES = (("program", "spmd.api", "build_program"),
          ("propagate", "spmd.partition.planner", "Propagator.__call__"),
          ("schedule", "spmd.partition.planner", "schedule"),
          ("render", "spmd.partition.planner", "render_plan"),
          ("replay", "spmd.partition.lower", "_Interpreter.run"))
D, HEADS, SEQ, BATCH, VOCAB = 64, 4, 16, 8, 128
LAYER_SPECS = {"ln": P(), "wq": P(None, "model"), "wk": P(None, "model"),
               "wv": P(None, "model"), "wo": P("model", None), "w1": P(None, "model"),
               "w2": P("model", None)}


def init(layers: int) -> dict:
  keys = iter(jax.random.split(jax.random.key(0), 8 * layers + 1))
  normal = lambda *shape: jax.random.normal(next(keys), shape) / shape[0] ** 0.5  # noqa: E731
  blocks = [{"ln": jnp.ones((D,)), "wq": normal(D, D), "wk": normal(D, D), "wv": normal(D, D),
             "wo": normal(D, D), "w1": normal(D, 4 * D), "w2": normal(4 * D, D)}
            for _ in range(layers)]
  return {"embed": normal(VOCAB, D), "blocks": blocks}


def loss_fn(params: dict, tokens: jax.Array) -> jax.Array:
  x = params["embed"][tokens]
  for p in params["blocks"]:
    h = x * jax.lax.rsqrt((x * x).mean(-1, keepdims=True) + 1e-6) * p["ln"]
    q, k, v = (jnp.reshape(h @ p[w], (BATCH, SEQ, HEADS, D // HEADS)) for w in ("wq", "wk", "wv"))
    s = jnp.einsum("bqhd,bkhd->bhqk", q, k) / (D // HEADS) ** 0.5
    s = jnp.where(jnp.tril(jnp.ones((SEQ, SEQ), bool)), s, -1e9)
    a = jnp.einsum("bhqk,bkhd->bqhd", jax.nn.softmax(s, -1), v).reshape(BATCH, SEQ, D)
    x = x + a @ p["wo"]
    x = x + jax.nn.gelu(x @ p["w1"]) @ p["w2"]
  logits = x @ params["embed"].T
  return optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1], tokens[:, 1:]).mean()


@contextlib.contextmanager
def timed_phases(times: dict[str, float]) -> Iterator[None]:
  """While open, each step in PHASES adds its wall time to ``times[phase]``."""
  replaced = []
  for phase, module_name, path in PHASES:
    *owners, name = path.split(".")
    module = importlib.import_module(module_name)
    for owner in owners:
      module = getattr(module, owner)
    original = getattr(module, name)

    def timed(*args, _phase=phase, _original=original, **kwargs):
      start = time.perf_counter()
      try:
        return _original(*args, **kwargs)
      finally:
        times[_phase] = times.get(_phase, 0.0) + time.perf_counter() - start

    setattr(module, name, timed)
    replaced.append((module, name, original))
  try:
    yield
  finally:
    for module, name, original in replaced:
      setattr(module, name, original)


def measure(layers: int, mesh) -> dict:
  opt = optax.adamw(1e-3)
  params = init(layers)
  opt_state = opt.init(params)
  tokens = jax.random.randint(jax.random.key(1), (BATCH, SEQ), 0, VOCAB)

  def step(params, opt_state, tokens):
    loss, grads = jax.value_and_grad(loss_fn)(params, tokens)
    updates, opt_state = opt.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, loss

  param_specs = {"embed": P(), "blocks": [LAYER_SPECS] * layers}
  specs = (param_specs, optimizer_specs(opt, opt_state, param_specs), P("data", None))
  args = (params, opt_state, tokens)
  ours = spmd.partition(step, mesh=mesh, in_specs=specs)
  phases: dict[str, float] = {}
  gc.collect()
  with timed_phases(phases):
    start = time.perf_counter()
    plan = ours.plan(*args)
    planned = time.perf_counter()
    in_plan = sum(phases.values())
    lowered = ours.lower(*args)
    done = time.perf_counter()
  spmd_time = done - start
  phases = {"trace": planned - start - in_plan, **phases,
            "lower": done - planned - phases["replay"]}
  gc.collect()
  start = time.perf_counter()
  lowered.compile()
  xla_time = time.perf_counter() - start
  shardings = jax.tree.map(lambda s: NamedSharding(mesh, s), specs,
                           is_leaf=lambda x: isinstance(x, P))
  gc.collect()
  start = time.perf_counter()
  traced = jax.jit(step, in_shardings=shardings).trace(*args)
  jit_trace = time.perf_counter() - start
  traced.lower().compile()
  jit_time = time.perf_counter() - start
  return {"layers": layers, "ops": len(plan.rows), "spmd": spmd_time, "xla": xla_time,
          "jit": jit_time, "jit_trace": jit_trace, "phases": phases}


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--layers", type=int, nargs="+", default=[1, 4, 16, 64])
  args = parser.parse_args()
  mesh = spmd.make_mesh({"data": 2, "model": 4})
  measure(1, mesh)  # warm up JAX's own caches
  print(f"planning time, jax {jax.__version__}, {os.cpu_count()} cores, load average "
        f"{os.getloadavg()[0]:.1f}")
  print("| layers | ops | spmd (s) | ms/op | XLA compile (s) | spmd/XLA | jit trace (s) | "
        "own/XLA | jit (s) | total/jit |")
  print("|---|---|---|---|---|---|---|---|---|---|")
  results = []
  for layers in args.layers:
    r = measure(layers, mesh)
    results.append(r)
    own = r["spmd"] - r["phases"]["trace"] - r["phases"]["lower"]
    print(f"| {layers} | {r['ops']} | {r['spmd']:.2f} | {1e3 * r['spmd'] / r['ops']:.2f} | "
          f"{r['xla']:.2f} | {r['spmd'] / r['xla']:.2f} | {r['jit_trace']:.2f} | "
          f"{own / r['xla']:.2f} | {r['jit']:.2f} | {(r['spmd'] + r['xla']) / r['jit']:.2f} |",
          flush=True)
  names = list(results[0]["phases"])
  print("\nspmd's phases, ms per op (seconds in parentheses)\n")
  print("| layers | " + " | ".join(names) + " |")
  print("|---|" + "---|" * len(names))
  for r in results:
    print(f"| {r['layers']} | " + " | ".join(
        f"{1e3 * r['phases'][n] / r['ops']:.3f} ({r['phases'][n]:.2f})" for n in names) + " |")


if __name__ == "__main__":
  main()
