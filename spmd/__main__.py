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
  from spmd.demo import DemoOptions, run_demo  # only after the device setup
  return run_demo(DemoOptions(mesh=args.mesh, strategy=args.strategy, size=args.size,
                              steps=args.steps))


def mesh_axes(text: str) -> dict[str, int]:
  """``data=2,model=4`` as {"data": 2, "model": 4}."""
  try:
    return {name: int(size) for name, size in (part.split("=") for part in text.split(","))}
  except ValueError:
    raise argparse.ArgumentTypeError(f"expected axis=size pairs like data=2,model=4, got "
                                     f"{text!r}") from None


def launch(args: argparse.Namespace) -> int:
  from spmd.launch import launch as run
  return run(args.script, args.args, args.num_processes, args.cpu_devices, args.timeout)


def main(argv: Sequence[str] | None = None) -> int:
  parser = argparse.ArgumentParser(prog="spmd", description="GSPMD-style partitioning for JAX.")
  commands = parser.add_subparsers(dest="command", required=True)
  demo_parser = commands.add_parser(
      "demo", help="train a character-level Transformer LM sharded over the machine's "
      f"accelerators (or {DEMO_DEVICES} simulated CPU devices where it has none): plan, the "
      "first steps checked against the unpartitioned step, progress, a sample")
  demo_parser.add_argument("--cpu-devices", type=int, default=None, metavar="N",
                           help="simulate N CPU devices even where accelerators exist")
  demo_parser.add_argument("--mesh", type=mesh_axes, default=None, metavar="data=D,model=M",
                           help="mesh axes (default: up to 4-way model, data over the rest)")
  demo_parser.add_argument("--strategy", default="2d", choices=("dp", "fsdp", "megatron", "2d",
                                                                 "sp"),
                           help="rule set of spmd.models.transformer.RULES (default: 2d)")
  demo_parser.add_argument("--size", default="small", choices=("tiny", "small", "base"))
  demo_parser.add_argument("--steps", type=int, default=300)
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
