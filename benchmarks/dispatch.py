"""Per-call overhead of a partitioned function against ``jax.jit`` with the same shardings.

    python benchmarks/dispatch.py [--leaves 100] [--rounds 15] [--open]

The function multiplies every leaf of a pytree of small arrays by 2 on 8 simulated CPU devices,
so a call is mostly dispatch: flattening, cache lookup, launching. Both are called in the
steady state (compiled, arguments already placed), in interleaved rounds (each goes first in
every other one); the report is the median time per call of each and the median of the
per-round ratios ours / jax.jit. With ``--open`` the partitioned function has no in_specs: the
arguments' committed shardings seed its plan, so a call also checks that every leaf is still
committed.
"""
from __future__ import annotations

import argparse
import os
import statistics
import time

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import spmd  # noqa: E402


def per_call(fn, args, calls: int) -> float:
  start = time.perf_counter()
  for _ in range(calls):
    out = fn(*args)
  jax.block_until_ready(out)
  return (time.perf_counter() - start) / calls


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--leaves", type=int, default=100)
  parser.add_argument("--rounds", type=int, default=15)
  parser.add_argument("--calls", type=int, default=200)
  parser.add_argument("--open", action="store_true", help="no in_specs: committed leaves seed")
  args = parser.parse_args()
  mesh = spmd.make_mesh({"data": 2, "model": 4})
  spec = P("data", None)
  sharding = NamedSharding(mesh, spec)
  tree = jax.device_put({f"w{i}": jnp.ones((8, 4)) for i in range(args.leaves)}, sharding)

  def double(t):
    return jax.tree.map(lambda x: x * 2, t)

  ours = spmd.partition(double, mesh=mesh, in_specs=None if args.open else spec, out_specs=spec)
  xla = jax.jit(double, in_shardings=sharding, out_shardings=sharding)
  for fn in (ours, xla):
    per_call(fn, (tree,), 10)
  times: dict[str, list[float]] = {"ours": [], "jit": []}
  ratios = []
  contenders = {"ours": ours, "jit": xla}
  for r in range(args.rounds):  # each goes first in every other round: no bias from the order
    for name in (("ours", "jit") if r % 2 == 0 else ("jit", "ours")):
      times[name].append(per_call(contenders[name], (tree,), args.calls))
    ratios.append(times["ours"][-1] / times["jit"][-1])
  print(f"per-call time, pytree of {args.leaves} leaves{', open in_specs' if args.open else ''}, "
        f"jax {jax.__version__}, "
        f"{os.cpu_count()} cores, load average {os.getloadavg()[0]:.1f}")
  for name, values in times.items():
    print(f"  {name:5s} median {statistics.median(values) * 1e3:.3f} ms "
          f"(min {min(values) * 1e3:.3f}, max {max(values) * 1e3:.3f})")
  print(f"  ours/jit median of {args.rounds} interleaved rounds: {statistics.median(ratios):.2f}")


if __name__ == "__main__":
  main()
