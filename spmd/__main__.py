"""Command line: ``python -m spmd demo`` and ``python -m spmd launch``, also installed as the
``spmd`` console script."""
from __future__ import annotations

import argparse
import os
import sys
from typing import Sequence

from spmd.partition.jax_compat import set_cpu_device_count

DEMO_DEVICES = 8


def setup_devices(cpu_devices: int | None) -> None:
  """The machine's accelerators when it has them; else, or when ``cpu_devices`` is given, that
  many simulated CPU devices (DEMO_DEVICES by default).

  Must run before JAX starts a backend. ``python -m spmd`` has imported JAX already, but the
  backends start at the first device query, after this. A count the environment chose already
  (XLA_FLAGS or JAX_NUM_CPU_DEVICES) is kept.
  """
  import jax
  if cpu_devices is not None:
    jax.config.update("jax_platforms", "cpu")
  chosen = ("--xla_force_host_platform_device_count" in os.environ.get("XLA_FLAGS", "")
            or "JAX_NUM_CPU_DEVICES" in os.environ)
  if cpu_devices is not None or not chosen:
    set_cpu_device_count(cpu_devices or DEMO_DEVICES)  # only the CPU backend reads it


def demo(args: argparse.Namespace) -> int:
  setup_devices(args.cpu_devices)
  from spmd.demo import run_demo  # only after the device setup
  return run_demo()


def launch(args: argparse.Namespace) -> int:
  from spmd.launch import launch as run
  return run(args.script, args.args, args.num_processes, args.cpu_devices, args.timeout)


def main(argv: Sequence[str] | None = None) -> int:
  parser = argparse.ArgumentParser(prog="spmd", description="GSPMD-style partitioning for JAX.")
  commands = parser.add_subparsers(dest="command", required=True)
  demo_parser = commands.add_parser(
      "demo", help="partition an MLP training step over the machine's accelerators (or "
      f"{DEMO_DEVICES} simulated CPU devices where it has none), print its plan and check it "
      "against the unpartitioned step")
  demo_parser.add_argument("--cpu-devices", type=int, default=None, metavar="N",
                           help="simulate N CPU devices even where accelerators exist")
  demo_parser.set_defaults(run=demo)
  launch_parser = commands.add_parser(
      "launch", help="run a script in N local processes joined by jax.distributed (simulated "
      "CPU devices), as on N hosts; output prefixed [pK]")
  launch_parser.add_argument("-n", "--num-processes", type=int, required=True, metavar="N")
  launch_parser.add_argument("--cpu-devices", type=int, default=1, metavar="K",
                             help="simulated CPU devices per process (default 1)")
  launch_parser.add_argument("--timeout", type=float, default=None, metavar="SECONDS",
                             help="stop every process after this long (exit code 124)")
  launch_parser.add_argument("script")
  launch_parser.add_argument("args", nargs=argparse.REMAINDER)
  launch_parser.set_defaults(run=launch)
  args = parser.parse_args(argv)
  return args.run(args)


if __name__ == "__main__":
  sys.exit(main())
