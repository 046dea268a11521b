"""A Transformer LM's training step on the default device (a GPU where there is one): spmd's
partitioned step against ``jax.jit`` of the same step, each called as a training loop calls it.

    python benchmarks/device_step.py [--batches 4 16 32] [--layers 4] [--d-model 1024] [--seq 512]

The step is ``spmd.train``'s (value_and_grad of the next-token loss, AdamW) on a mesh of the
first ``--devices`` devices (default 1, where both programs are the same computation and what
differs is the work on the host around each call), data-parallel rules. Both are compiled by
their first call. Then ``--rounds`` interleaved rounds (ours, jit; jit, ours; ...), each of
``--steps`` steps that feed the returned state back, timed from the first call to the last
result ready: dispatch, argument checks and device time together, as a user's loop sees them.
Reported per batch size: median ms per step of each, their ratio, and each compiled program's
instruction and fusion counts (its entry computation, from the optimized HLO), and the relative
difference of the two loops' final params (both ran the same number of steps from one state).
"""
from __future__ import annotations

import argparse
import re
import statistics
import time
from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
import optax

import lm_step
import spmd
from spmd.models import transformer

RULES = transformer.RULES["dp"]
_INSTRUCTION = re.compile(r"^\s+(?:ROOT )?\S+ = \S+ (\w[\w-]*)\(")


def entry_counts(hlo_text: str) -> tuple[int, int]:
  """(instructions, fusions) in the optimized HLO module's entry computation."""
  entry = hlo_text[hlo_text.index("\nENTRY "):]
  entry = entry[:entry.index("\n}")]
  opcodes = [m.group(1) for m in map(_INSTRUCTION.match, entry.splitlines()) if m]
  return len(opcodes), opcodes.count("fusion")


def loop(step: Callable, state: Any, tokens: jax.Array, steps: int) -> tuple[float, Any]:
  """Seconds per step of ``steps`` calls feeding the state back, and the last state."""
  start = time.perf_counter()
  for _ in range(steps):
    state, loss = step(state, tokens)
  jax.block_until_ready((state, loss))
  return (time.perf_counter() - start) / steps, state


def measure(config: transformer.Config, batch: int, seq: int, devices: int, rounds: int,
            steps: int) -> tuple[Any, ...]:
  mesh = spmd.make_mesh({"data": devices, "model": 1}, devices=jax.devices()[:devices])
  lm = lm_step.build(transformer.Transformer(config), transformer.next_token_loss, mesh, RULES,
                     "act_batch", config.vocab, batch, seq, optax.adamw(1e-4))
  state, tokens = lm.state, lm.tokens

  def xla(*args: Any) -> Any:
    with lm.xla_context():
      return lm.jitted(*args)

  with lm.xla_context():
    jit_lowered = lm.jitted.lower(state, tokens)
  counts = [entry_counts(lm.ours.lower(state, tokens).compile().as_text()),
            entry_counts(jit_lowered.compile().as_text())]
  states = {"ours": state, "jit": state}
  contenders = {"ours": lm.ours, "jit": xla}
  names = list(contenders)
  times: dict[str, list[float]] = {name: [] for name in contenders}
  for name, fn in contenders.items():
    _, states[name] = loop(fn, states[name], tokens, 3)
  for r in range(rounds):  # each goes first in every other round: no bias from the order
    for name in (names if r % 2 == 0 else names[::-1]):
      seconds, states[name] = loop(contenders[name], states[name], tokens, steps)
      times[name].append(seconds)
  med = {name: statistics.median(v) * 1e3 for name, v in times.items()}
  return (batch, f"{med['ours']:.2f}", f"{med['jit']:.2f}", f"{med['ours'] / med['jit']:.3f}",
          f"{counts[0][0]}/{counts[1][0]}", f"{counts[0][1]}/{counts[1][1]}",
          f"{relative_difference(states['ours'].params, states['jit'].params):.1e}")


def relative_difference(a: Any, b: Any) -> float:
  """||a - b|| / ||b|| over all leaves of two trees of arrays."""
  leaves = zip(jax.tree.leaves(a), jax.tree.leaves(b))
  diff, norm = zip(*((jnp.sum((x - y) ** 2), jnp.sum(y ** 2)) for x, y in leaves))
  return float(jnp.sqrt(sum(diff) / sum(norm)))


def main(argv: Sequence[str] | None = None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--batches", type=int, nargs="+", default=[4, 16, 32])
  parser.add_argument("--layers", type=int, default=4)
  parser.add_argument("--d-model", type=int, default=1024)
  parser.add_argument("--seq", type=int, default=512)
  parser.add_argument("--vocab", type=int, default=32768)
  parser.add_argument("--devices", type=int, default=1)
  parser.add_argument("--rounds", type=int, default=15)
  parser.add_argument("--steps", type=int, default=10)
  args = parser.parse_args(argv)
  heads = max(1, args.d_model // 64)
  config = transformer.Config(vocab=args.vocab, d_model=args.d_model, heads=heads,
                              head_dim=args.d_model // heads, mlp=4 * args.d_model,
                              layers=args.layers, max_len=args.seq)
  rows = [measure(config, batch, args.seq, args.devices, args.rounds, args.steps)
          for batch in args.batches]
  device = jax.devices()[0]
  print(f"Transformer training step, {args.layers} layers, d_model {args.d_model}, seq "
        f"{args.seq}, vocab {args.vocab}, AdamW; {args.devices} x {device.device_kind} "
        f"({device.platform}), jax {jax.__version__}; median ms per step of {args.rounds} "
        f"interleaved rounds of {args.steps} steps\n")
  header = ("batch", "ours ms", "jit ms", "ours/jit", "instructions ours/jit",
            "fusions ours/jit", "params ours vs jit")
  widths = [max(len(str(c)) for c in col) for col in zip(header, *rows)]
  for row in (header, *rows):
    print("| " + " | ".join(str(c).ljust(w) for c, w in zip(row, widths)) + " |")


if __name__ == "__main__":
  main()
