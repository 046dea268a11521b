"""Halo exchange: bytes per device of spatially sharded windowed ops, side by side with the
analytic minimum and with XLA's own program.

    python benchmarks/halo.py

For each case (H sharded 4 ways on an 8-device mesh {"data": 2, "model": 4}):
  halo      per-device bytes of spmd's halo exchanges (its plan's collective-permutes);
  minimum   the halo rows the busiest shard must receive (REFERENCES formulas: rows
            ceil((s*Wc*i - lo)/bd) .. floor((s*Wc*i + s*(Wc-1) + D - 1 - lo)/bd) outside its own
            rows) times the bytes of one row; computed here, independently of spmd/partition/halo.py;
  total     per-device collective bytes of spmd's program, from its compiled HLO (equal to the
            plan's); with an uneven output this includes gathering it (JAX cannot hold uneven
            shards, so uneven outputs are returned replicated);
  XLA       per-device collective bytes of jax.jit with the same in/out shardings.
Uneven heights are run by spmd only: jax.jit refuses shardings that do not divide a dim.
"""
from __future__ import annotations

import os

os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + " --xla_force_host_platform_device_count=8").strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import math  # noqa: E402
from dataclasses import dataclass  # noqa: E402
from typing import Callable  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax import lax  # noqa: E402
from jax.sharding import NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import spmd  # noqa: E402
from spmd.hlo import collective_bytes  # noqa: E402

SHARDS = 4
NHWC = ("NHWC", "HWIO", "NHWC")


@dataclass(frozen=True)
class Case:
  name: str
  fn: Callable
  x_shape: tuple[int, ...]
  k_shape: tuple[int, ...] | None
  window: tuple[int, int, int, int, int] | None  # (w, stride, lo, hi, base dilation) along H


def conv(x, k, stride=1, pad=((1, 1), (1, 1)), lhs_dilation=(1, 1)):
  return lax.conv_general_dilated(x, k, (stride, stride), pad, lhs_dilation=lhs_dilation,
                                  dimension_numbers=NHWC)


def cases(h: int) -> list[Case]:
  c = 16  # width; channels are the last dim
  return [
      Case("conv 3x3 SAME", lambda x, k: conv(x, k), (1, h, c, 8), (3, 3, 8, 8), (3, 1, 1, 1, 1)),
      Case("ResNet stem 7x7/2 pad 3", lambda x, k: conv(x, k, 2, ((3, 3), (3, 3))),
           (1, h, c, 3), (7, 7, 3, 8), (7, 2, 3, 3, 1)),
      Case("conv 5x5 pad 3/1", lambda x, k: conv(x, k, 1, ((3, 1), (2, 2))),
           (1, h, c, 4), (5, 5, 4, 4), (5, 1, 3, 1, 1)),
      Case("max pool 3x3/2 SAME", lambda x, k: lax.reduce_window(
          x, -jnp.inf, lax.max, (1, 3, 3, 1), (1, 2, 2, 1), ((0, 0), (0, 1), (0, 1), (0, 0))),
           (1, h, c, 8), None, (3, 2, 0, 1, 1)),
      Case("transposed conv (lhs dilation 2)", lambda x, k: conv(x, k, 1, ((1, 2), (1, 2)), (2, 2)),
           (1, h, c, 4), (3, 3, 4, 4), (3, 1, 1, 2, 2)),
      Case("Laplacian stencil", lambda x, k: jnp.pad(x[:, 2:] - 2 * x[:, 1:-1] + x[:, :-2],
                                                     ((0, 0), (1, 1), (0, 0), (0, 0))),
           (1, h, c, 8), None, None),
      Case("jnp.roll by 1", lambda x, k: jnp.roll(x, 1, axis=1), (1, h, c, 8), None, None),
      Case("jnp.roll by -3", lambda x, k: jnp.roll(x, -3, axis=1), (1, h, c, 8), None, None),
      Case("jnp.roll by 100 (past a shard)", lambda x, k: jnp.roll(x, 100, axis=1), (1, h, c, 8),
           None, None),
      Case("max pool 3x3/2 SAME gradient", lambda x, k: jax.grad(lambda x: (lax.reduce_window(
          x, -jnp.inf, lax.max, (1, 3, 3, 1), (1, 2, 2, 1), ((0, 0), (0, 1), (0, 1), (0, 0)))
                                                                  ** 2).sum())(x),
           (1, h, c, 8), None, None),
      Case("jnp.roll by 1 gradient", lambda x, k: jax.grad(
          lambda x: (jnp.roll(x, 1, axis=1) * x).sum())(x), (1, h, c, 8), None, None),
      Case("conv weight gradient", lambda x, k: jax.grad(
          lambda k, x: (conv(x, k) ** 2).sum())(k, x), (1, h, c, 4), (3, 3, 4, 4), None),
  ]


def minimum_halo_rows(n: int, window: tuple[int, int, int, int, int], shards: int) -> int:
  """The most halo rows any shard must receive (REFERENCES: halo exchange formulas)."""
  w, s, lo, hi, bd = window
  d = w  # no window dilation in these cases
  f = 1 + (n - 1) * bd + lo + hi
  out = (f - d) // s + 1
  block, wc = -(-n // shards), -(-out // shards)
  worst = 0
  for i in range(shards):
    if i * wc >= out:
      break
    start = max(0, math.ceil((s * wc * i - lo) / bd))
    limit = min(n, math.floor((s * wc * i + s * (wc - 1) + d - 1 - lo) / bd) + 1)
    worst = max(worst, max(0, block * i - start) + max(0, limit - block * (i + 1)))
  return worst


def measure(case: Case, mesh: jax.sharding.Mesh) -> tuple[int, int, int | None, int | None]:
  x = jnp.asarray(np.random.default_rng(0).standard_normal(case.x_shape, dtype=np.float32))
  k = (jnp.ones(case.k_shape, jnp.float32) / 9 if case.k_shape else jnp.zeros((1,)))
  x_spec, k_spec = P(None, "model"), P()
  f = spmd.partition(case.fn, mesh=mesh, in_specs=(x_spec, k_spec))
  np.testing.assert_allclose(np.asarray(f(x, k)), np.asarray(case.fn(x, k)), rtol=1e-4,
                             atol=1e-4)
  ours = collective_bytes(f.lower(x, k).compile().as_text())
  plan = f.plan(x, k)
  assert plan.total_bytes == ours, plan.explain()
  halo = sum(c.bytes for c in plan.collectives if c.halo is not None)
  minimum = None
  if case.window:
    row = case.x_shape[2] * case.x_shape[3] * 4
    minimum = minimum_halo_rows(case.x_shape[1], case.window, SHARDS) * row
  named = lambda spec: NamedSharding(mesh, spec)  # noqa: E731
  try:
    out_specs = plan.out_specs
    xla = jax.jit(case.fn, in_shardings=(named(x_spec), named(k_spec)),
                  out_shardings=named(out_specs))
    theirs = collective_bytes(xla.lower(x, k).compile().as_text())
  except ValueError:
    theirs = None  # jax.jit refuses a sharding that does not divide the dim
  return halo, ours, minimum, theirs


def main() -> None:
  mesh = spmd.make_mesh({"data": 2, "model": SHARDS})
  for h in (224, 222):
    print(f"\nH = {h} on {SHARDS} shards ({'even' if h % SHARDS == 0 else 'uneven'}); "
          "bytes per device")
    print(f"| {'case':34s} | {'halo':>7s} | {'minimum':>7s} | {'halo/min':>8s} | {'total':>7s} "
          f"| {'XLA':>7s} | {'total/XLA':>9s} |")
    print(f"|{'-' * 36}|{'-' * 9}|{'-' * 9}|{'-' * 10}|{'-' * 9}|{'-' * 9}|{'-' * 11}|")
    for case in cases(h):
      halo, ours, minimum, theirs = measure(case, mesh)
      ratio_min = f"{halo / minimum:.2f}" if minimum else "-"
      xla = "refused" if theirs is None else str(theirs)
      ratio_xla = "-" if not theirs else f"{ours / theirs:.2f}"
      print(f"| {case.name:34s} | {halo:7d} | {minimum or '-':>7} | {ratio_min:>8s} | {ours:7d} "
            f"| {xla:>7s} | {ratio_xla:>9s} |")


if __name__ == "__main__":
  main()
