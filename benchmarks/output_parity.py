"""Output shardings against jax.jit's, over random programs.

    python benchmarks/output_parity.py [--examples 1500] [--show 5]

Draws programs from the property test's generator (tests/test_property.py: elementwise ops,
broadcasts, reshapes, transposes, dots, reductions, scans and sorts along an axis, slices and
concatenates of small arrays on 8 simulated devices), keeps those with neither annotations nor
out_specs, and runs each under ``jax.set_mesh`` through ``spmd.partition`` and through
``jax.jit`` with the same in_shardings. Reported: how many programs ran, how many return an
output whose sharding differs from jax.jit's (``is_equivalent_to``), those grouped by the
operations they use, and the shortest few as reproducers. The draws are derandomized: a run
sees the same programs as the last. It only reports; it asserts nothing.
"""
from __future__ import annotations

import argparse
import collections
import os
import re
import sys
from dataclasses import dataclass
from pathlib import Path

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

import jax  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import spmd  # noqa: E402
import test_property  # noqa: E402
from helpers import as_mesh, named  # noqa: E402

_OPERATION = re.compile(r"jnp\.\w+|lax\.\w+|\.reshape|\.T\b|@")


@dataclass(frozen=True)
class Difference:
  """A program whose output ``index`` comes back as ``spmd`` where jax.jit returns ``jit``."""

  prog: test_property.Program
  index: int
  jit: P
  spmd: P


def difference(prog: test_property.Program) -> Difference | None:
  """The first output of ``prog`` that comes back sharded otherwise than from jax.jit."""
  mesh = as_mesh(prog.mesh)
  f, args = prog.fn(), prog.args()
  with jax.set_mesh(mesh):
    want = jax.jit(f, in_shardings=named(mesh, prog.in_specs()))(*args)
    got = spmd.partition(f, mesh=mesh, in_specs=prog.in_specs())(*args)
  for k, (w, g) in enumerate(zip(jax.tree.leaves(want), jax.tree.leaves(got))):
    if not w.sharding.is_equivalent_to(g.sharding, w.ndim):
      return Difference(prog, k, w.sharding.spec, g.sharding.spec)
  return None


def main() -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--examples", type=int, default=1500, help="programs drawn (some skipped)")
  parser.add_argument("--show", type=int, default=5, help="reproducers printed")
  args = parser.parse_args()
  ran: list[test_property.Program] = []
  different: list[Difference] = []

  @settings(max_examples=args.examples, deadline=None, database=None, derandomize=True,
            suppress_health_check=list(HealthCheck))
  @given(test_property.programs())
  def draw(prog: test_property.Program) -> None:
    if prog.out_specs is not None or any("annotate" in line for line in prog.lines):
      return
    ran.append(prog)
    found = difference(prog)
    if found is not None:
      different.append(found)

  draw()
  print(f"output shardings vs jax.jit, jax {jax.__version__}: {len(different)} of {len(ran)} "
        f"random programs return an output sharded otherwise")
  groups = collections.Counter(
      ", ".join(sorted(set(_OPERATION.findall(d.prog.body())))) for d in different)
  for ops, count in groups.most_common():
    print(f"  {count:4d}  {ops}")
  for d in sorted(different, key=lambda d: len(repr(d.prog)))[:args.show]:
    print(f"{d.prog!r}\n# output {d.index}: jax.jit {d.jit}, spmd {d.spmd}")


if __name__ == "__main__":
  main()
