"""Command line: ``python -m spmd demo``, also installed as the ``spmd`` console script."""
from __future__ import annotations

import argparse
import os
import sys
from typing import Sequence

DEMO_DEVICES = 8


def simulate_cpu_devices(count: int) -> None:
  """Asks XLA for ``count`` CPU devices on the CPU platform, unless the environment chose already.

  ``python -m spmd`` imports ``spmd`` (and so JAX) before this module runs. XLA_FLAGS still takes
  effect because XLA reads it when the backend starts (the first device query); JAX_PLATFORMS is
  read when JAX is imported, so the platform is also passed on through ``jax.config``.
  """
  flags = os.environ.get("XLA_FLAGS", "")
  if "--xla_force_host_platform_device_count" not in flags:
    os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={count}".strip()
  os.environ.setdefault("JAX_PLATFORMS", "cpu")
  import jax
  jax.config.update("jax_platforms", os.environ["JAX_PLATFORMS"])


def demo() -> int:
  simulate_cpu_devices(DEMO_DEVICES)
  from spmd.demo import run_demo  # only after the device setup
  return run_demo()


def main(argv: Sequence[str] | None = None) -> int:
  parser = argparse.ArgumentParser(prog="spmd", description="GSPMD-style partitioning for JAX.")
  commands = parser.add_subparsers(dest="command", required=True)
  commands.add_parser(
      "demo", help=f"partition an MLP training step over {DEMO_DEVICES} simulated CPU devices, "
      "print its plan and check it against the unpartitioned step").set_defaults(run=demo)
  return parser.parse_args(argv).run()


if __name__ == "__main__":
  sys.exit(main())
