"""The Transformer LM's training step under each rule set (spmd.models.transformer.RULES), and the
MoE LM's (spmd.models.moe.RULES), ours side by side with ``jax.jit`` given the same shardings and
the same rules for the model's logical constraints.

    python benchmarks/strategies.py [--quick] [--runs N] [--only NAME ...]

Per strategy, on a (data=2, model=4) mesh of 8 simulated CPU devices: collective bytes per device
per step read from both compiled programs, median step time of interleaved runs, and the
per-device memory of params + optimizer state: its analytic value (each leaf's bytes over the
devices its spec splits it across) beside the compiled programs' argument sizes less the batch.
"""
from __future__ import annotations

import argparse
import functools
import os
import statistics
import sys
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import run  # sets up the 8 simulated devices before JAX starts; shared table / HLO helpers
import lm_step  # noqa: E402

import flax.linen as nn  # noqa: E402
import jax  # noqa: E402
import numpy as np  # noqa: E402
import optax  # noqa: E402
from jax.sharding import Mesh  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import spmd  # noqa: E402
from spmd.models import moe, transformer  # noqa: E402

MESH = {"data": 2, "model": 4}
SIZES = {"full": (transformer.Config(vocab=256, d_model=256, heads=8, head_dim=32, mlp=1024,
                                     layers=4), 16, 128),
         "quick": (transformer.Config(vocab=128, d_model=64, heads=4, head_dim=16, mlp=256,
                                      layers=2), 8, 32)}


@dataclass(frozen=True)
class Family:
  """A language model whose strategies are compared: its rule sets, model, next-token loss, the
  logical name of its batch dim and its (config, batch, seq) per size."""

  name: str
  rules: Mapping[str, Any]
  model: Callable[[Any], nn.Module]
  loss: Callable[..., jax.Array]
  batch_axis: str
  sizes: Mapping[str, tuple[Any, int, int]]


FAMILIES = (
    Family("Transformer", transformer.RULES, transformer.Transformer, transformer.next_token_loss,
           "act_batch", SIZES),
    Family("MoE LM", moe.RULES, moe.MoELM, moe.next_token_loss, "act_group",
           {"full": (moe.Config(vocab=256, d_model=256, mlp=1024), 16, 128),
            "quick": (moe.Config(vocab=128, d_model=64, mlp=256), 8, 32)}),
)


def _shards(spec: P, mesh: Mesh) -> int:
  axes = [a for e in spec if e is not None for a in ((e,) if isinstance(e, str) else e)]
  return int(np.prod([mesh.shape[a] for a in axes]))


def state_bytes_per_device(state: Any, specs: Any, mesh: Mesh) -> int:
  """Params + optimizer state bytes one device holds under ``specs`` (resolved mesh axes)."""
  sizes = jax.tree.map(lambda x, s: x.nbytes // _shards(s, mesh), state, specs,
                       is_leaf=lambda x: isinstance(x, P))
  return int(sum(jax.tree.leaves(sizes)))


def measure(family: Family, name: str, config: Any, batch: int, seq: int, runs: int) -> tuple:
  mesh = spmd.make_mesh(MESH)
  lm = lm_step.build(family.model(config), family.loss, mesh, family.rules[name],
                     family.batch_axis, config.vocab, batch, seq, optax.adamw(1e-3))
  state, tokens, plan = lm.state, lm.tokens, lm.plan
  resolved = plan.in_specs[0]
  with lm.xla_context():
    xla_lower = lm.jitted.lower(state, tokens)
  ours_exe, xla_exe = lm.ours.lower(state, tokens).compile(), xla_lower.compile()
  mine = run.comm_list(ours_exe.as_text(), mesh)
  theirs = run.comm_list(xla_exe.as_text(), mesh)
  a, b = sum(n for _, n, _ in mine), sum(n for _, n, _ in theirs)
  contenders = {"ours": functools.partial(ours_exe, state, tokens),
                "xla": functools.partial(xla_exe, state, tokens)}
  times: dict[str, list[float]] = {k: [] for k in contenders}
  for fn in contenders.values():
    run.timed(fn)
  for _ in range(runs):
    for k, fn in contenders.items():
      times[k].append(run.timed(fn))
  med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
  batch_bytes = tokens.nbytes // _shards(plan.in_specs[1], mesh)
  analytic = state_bytes_per_device(state, resolved, mesh)
  compiled = [e.memory_analysis().argument_size_in_bytes - batch_bytes
              for e in (ours_exe, xla_exe)]
  return (name, a, b, f"{a / b:.3f}" if b else "-", f"{med['ours']:.2f}", f"{med['xla']:.2f}",
          f"{med['ours'] / med['xla']:.3f}", analytic, compiled[0], compiled[1],
          state_bytes_per_device(state, jax.tree.map(lambda _: P(), resolved,
                                                     is_leaf=lambda x: isinstance(x, P)), mesh),
          run.why_differs(mine, theirs) if a != b else "-")


def main(argv: Sequence[str] | None = None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true", help="smaller model, fewer timed runs")
  parser.add_argument("--runs", type=int, help="timed runs of each program (default 5 quick, 20)")
  parser.add_argument("--only", nargs="+", metavar="NAME", help="only these strategies")
  args = parser.parse_args(argv)
  runs = args.runs or (5 if args.quick else 20)
  for family in FAMILIES:
    config, batch, seq = family.sizes["quick" if args.quick else "full"]
    names = [name for name in family.rules if not args.only or name in args.only]
    if not names:
      continue
    rows = [measure(family, name, config, batch, seq, runs) for name in names]
    print(f"\n## {family.name} training step per strategy (mesh {MESH}; {config}, batch {batch}, "
          f"seq {seq}; step time: median of {runs} interleaved runs)\n")
    print(run.table(("strategy", "ours B", "XLA B", "bytes ours/XLA", "ours ms", "XLA ms",
                     "time ours/XLA", "state B/device (analytic)", "ours compiled",
                     "XLA compiled", "replicated", "why"), rows))
    ratios = [float(r[3]) for r in rows if r[3] != "-"]
    print(f"\nsummary: bytes ours/XLA geomean {run.geomean(ratios):.3f} (max "
          f"{max(ratios):.3f}); time ours/XLA " + ", ".join(f"{r[0]} {r[6]}" for r in rows)
          + f"; load average {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
  sys.exit(main())
