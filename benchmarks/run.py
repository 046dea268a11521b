"""spmd (backend="spmd") side by side with XLA's own partitioner (GSPMD / Shardy) on one program.

    python benchmarks/run.py [--quick]

Three sections, each a table and a one-line summary (see benchmarks/README.md):
  a. collective bytes per device per step, from the compiled HLO of both programs;
  b. steady-state step time on 8 simulated CPU devices, runs interleaved;
  c. compile time (trace, propagate, lower, XLA compile) on 64 vs 8 simulated devices, in
     subprocesses (``--compile-child N`` prints JSON) that alternate the device counts.
"""
from __future__ import annotations

import argparse
import functools
import json
import os
import re
import statistics
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path
from typing import Any, Callable, Sequence

REPO = Path(__file__).resolve().parent.parent


def _device_count(argv: list[str]) -> int:
  """8, or N for ``--compile-child N``; read ahead of argparse, as JAX fixes it at start-up."""
  return int(argv[argv.index("--compile-child") + 1]) if "--compile-child" in argv else 8


_DEVICE_FLAG = f"--xla_force_host_platform_device_count={_device_count(sys.argv)}"
os.environ["XLA_FLAGS"] = f"{os.environ.get('XLA_FLAGS', '')} {_DEVICE_FLAG}".strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# The training steps live in tests/workloads.py, which the test suite imports as a top-level
# module and which is not part of the installed package; import it from there, not a copy.
sys.path.insert(0, str(REPO / "tests"))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import Mesh, NamedSharding  # noqa: E402
from jax.sharding import PartitionSpec as P  # noqa: E402

import spmd  # noqa: E402
import workloads  # noqa: E402
from spmd.hlo import array_bytes, collectives  # noqa: E402
from workloads import Workload  # noqa: E402

MESHES = {8: {"data": 2, "model": 4}, 64: {"data": 8, "model": 8}}
# Step-time sizes, bigger than the tests' so that a step is not all dispatch overhead.
STEP_SIZES: dict[str, list[tuple[Callable[..., Workload], dict[str, int]]]] = {
    "full": [(workloads.mlp, dict(batch=256, d=512, h=2048)),
             (workloads.transformer, dict(batch=8, seq=128, d=256, heads=4, vocab=1024))],
    "quick": [(workloads.mlp, dict(batch=64, d=128, h=512)),
              (workloads.transformer, dict(batch=4, seq=32, d=64, heads=4, vocab=256))],
}
# Compile-time sizes: the same for every device count, so they divide a (data=8, model=8) mesh.
COMPILE_SIZES: list[tuple[Callable[..., Workload], dict[str, int]]] = [
    (workloads.mlp, dict(batch=64, d=128, h=512)),
    (workloads.transformer, dict(batch=8, seq=32, d=128, heads=8, vocab=256)),
]


def _fmt_sizes(sizes: dict[str, int]) -> str:
  return " ".join(f"{k}={v}" for k, v in sizes.items())


def named_shardings(mesh: Mesh, specs: Any) -> Any:
  return jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda s: isinstance(s, P))


def _programs(w: Workload, mesh: Mesh) -> tuple[spmd.Partitioned, Callable]:
  """Ours, and XLA's jit of the same function with the same in / out shardings."""
  ours = spmd.partition(w.fn, mesh=mesh, in_specs=w.in_specs)
  out_specs = ours.plan(*w.args).out_specs
  return ours, jax.jit(w.fn, in_shardings=named_shardings(mesh, w.in_specs),
                       out_shardings=named_shardings(mesh, out_specs))


def table(header: Sequence[str], rows: Sequence[Sequence[Any]]) -> str:
  cells = [list(map(str, header))] + [list(map(str, r)) for r in rows]
  widths = [max(len(r[i]) for r in cells) for i in range(len(header))]
  lines = ["| " + " | ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)) + " |"
           for r in cells]
  lines.insert(1, "|" + "|".join("-" * (w + 2) for w in widths) + "|")
  return "\n".join(lines)


def geomean(xs: Sequence[float]) -> float:
  return float(np.exp(np.mean(np.log(xs))))


# --- a. communication bytes ------------------------------------------------------------------

def _mlp_forward(x: jax.Array, w1: jax.Array, w2: jax.Array) -> jax.Array:
  return jax.nn.gelu(x @ w1) @ w2


def _einsum_chain(x: jax.Array, a: jax.Array, b: jax.Array) -> jax.Array:
  h = jax.nn.relu(jnp.einsum("bsd,dh->bsh", x, a))
  y = jnp.einsum("bsh,hd->bsd", h, b)
  return jnp.einsum("bsd,btd->bst", y, x)


def _embed(table: jax.Array, ids: jax.Array) -> jax.Array:
  return table[ids]


def _embed_loss(table: jax.Array, ids: jax.Array) -> jax.Array:
  return (jnp.tanh(table[ids]) ** 2).sum()


def _rnn(w: jax.Array, xs: jax.Array) -> jax.Array:
  def body(h, x):
    h = jnp.tanh(h @ w + x)
    return h, h.mean()
  h, ys = jax.lax.scan(body, jnp.zeros((xs.shape[1],)), xs)
  return (h ** 2).sum() + ys.sum()


def _pending_sums(a: jax.Array, w: jax.Array, b: jax.Array, v: jax.Array) -> jax.Array:
  return jnp.tanh(a @ w + b @ v)


def comm_cases() -> list[Workload]:
  """The four training steps (test sizes) and cases in the style of the correctness suite."""
  def lin(*shape: int) -> jax.Array:
    return jnp.linspace(-1, 1, int(np.prod(shape))).reshape(shape)

  x, w = lin(8, 16), lin(16, 8)
  table, ids = lin(32, 8), jnp.array([[0, 5, 31, 8], [17, 16, 3, 9]] * 2)
  row, col = P("model", None), P(None, "model")
  return [
      workloads.mlp(), workloads.mlp(layout="dp"), workloads.transformer(), workloads.convnet(),
      Workload("megatron mlp forward", _mlp_forward, (x, lin(16, 32), lin(32, 16)),
               (P("data", None), col, row)),
      Workload("2d einsum chain", _einsum_chain, (lin(4, 8, 16), lin(16, 32), lin(32, 16)),
               (P("data", None, None), col, row)),
      Workload("embedding lookup", _embed, (table, ids), (row, P("data", None))),
      Workload("embedding gradient", jax.grad(_embed_loss), (table, ids), (row, P("data", None))),
      Workload("scan rnn", _rnn, (lin(16, 16) / 4, x), (col, col)),
      Workload("scan rnn gradient", jax.grad(_rnn), (lin(16, 16) / 4, x), (col, col)),
      Workload("tanh(a@w + b@v)", _pending_sums, (x, w, x * 2, w - 1), (col, row, col, row)),
  ]


_GROUPS = re.compile(r"replica_groups=(\{[\d,{}]*\}|\[[\d,]+\]<=\[[\d,]+\](?:T\([\d,]+\))?"
                     r"|mesh\[[^\]]*\](?:, device_ids=\(.*?\))? \{[^}]*\})")
_PAIRS = re.compile(r"source_target_pairs=(\{[\d,{}]*\})")
_IOTA = re.compile(r"\[([\d,]+)\](?:T\(([\d,]+)\))?")


def _iota(dims: str, perm: str | None) -> np.ndarray:
  """XLA's iota tile assignment ``[dims]T(perm)``."""
  shape = [int(d) for d in dims.split(",")]
  a = np.arange(int(np.prod(shape))).reshape(shape)
  return a.transpose([int(p) for p in perm.split(",")]) if perm else a


def _groups(text: str, n: int) -> list[list[int]]:
  """The device groups of a ``replica_groups=`` attribute, in any of XLA's three formats."""
  if text.startswith("{"):
    groups = [[int(i) for i in g.split(",")] for g in re.findall(r"\{([\d,]+)\}", text)]
    return groups or [list(range(n))]
  if text.startswith("["):  # [G,S]<=[dims]T(perm)
    head, tail = text.split("<=")
    m = _IOTA.fullmatch(tail)
    return _iota(m.group(1), m.group(2)).reshape(
        [int(d) for d in head.strip("[]").split(",")]).tolist()
  m = re.fullmatch(r"mesh\[(.*?)\](?:, device_ids=\((.*?)\))? \{(.*)\}", text)
  ids = np.arange(n)
  if m.group(2):
    iota = _IOTA.fullmatch(m.group(2))
    ids = _iota(*iota.groups()) if iota else np.array([int(i) for i in m.group(2).split(",")])
  # every mesh axis as (major, sub-axis, minor) parts, for ``'name':(pre)size`` sub-axes
  split: list[int] = []
  picked: list[int] = []
  for name, size in re.findall(r"'([^']+)'=(\d+)", m.group(1)):
    size = int(size)
    pick = re.search(rf"'{re.escape(name)}'(?::\((\d+)\)(\d+))?", m.group(3))
    pre, sub = (int(pick[1]), int(pick[2])) if pick and pick[2] else (1, size)
    picked += [len(split) + 1] if pick else []
    split += [size // (pre * sub), sub, pre]
  rest = [d for d in range(len(split)) if d not in picked]
  group_size = int(np.prod([split[d] for d in picked]))
  return np.reshape(ids, split).transpose(rest + picked).reshape(-1, group_size).tolist()


def _axes(line: str, mesh: Mesh) -> str:
  """The mesh axes a collective's device groups span, e.g. ``data,model``."""
  if m := _GROUPS.search(line):
    groups = _groups(m.group(1), mesh.size)
  elif m := _PAIRS.search(line):
    groups = [[int(i) for i in p.split(",")] for p in re.findall(r"\{(\d+,\d+)\}", m.group(1))]
  else:
    return "?"
  varying: set[int] = set()
  for g in groups:
    coords = np.unravel_index(g, mesh.devices.shape)
    varying |= {d for d, c in enumerate(coords) if len(set(c.tolist())) > 1}
  return ",".join(mesh.axis_names[d] for d in sorted(varying)) or "-"


def comm_list(hlo: str, mesh: Mesh) -> list[tuple[str, int, list[str]]]:
  """Each collective of compiled HLO as (``kind(axes)``, bytes, the arrays of its result)."""
  return [(f"{c.kind}({_axes(c.text, mesh)})", c.bytes, list(c.arrays)) for c in collectives(hlo)]


def _fmt_comm(comm: list[tuple[str, int, list[str]]]) -> str:
  return " ".join(f"{what}:{n}" + (f"[{len(arrays)} arrays]" if len(arrays) > 1 else "")
                  for what, n, arrays in comm) or "none"


def why_differs(ours: list, xla: list) -> str:
  """The arrays only one side moves. Arrays pair off by collective kind and size, so that a
  transposed layout, or the same bytes over other axes, is no difference."""
  def arrays(comm: list) -> dict[tuple[str, int], list[tuple[str, str]]]:
    out: dict[tuple[str, int], list[tuple[str, str]]] = {}
    for what, _, shapes in comm:
      for a in shapes:
        out.setdefault((what.split("(")[0], array_bytes(a)), []).append((what, a))
    return out

  def only(a: dict, b: dict) -> str:
    extra = Counter(x for key, xs in a.items() for x in xs[len(b.get(key, ())):])
    return ", ".join((f"{k}x " if k > 1 else "") + f"{what} {arr} ({k * array_bytes(arr)} B)"
                     for (what, arr), k in sorted(extra.items()))

  mine, theirs = arrays(ours), arrays(xla)
  parts = [("XLA only", only(theirs, mine)), ("ours only", only(mine, theirs))]
  return "; ".join(f"{who}: {what}" for who, what in parts if what)


def section_bytes() -> None:
  mesh = spmd.make_mesh(MESHES[8])
  rows, lists, ratios = [], [], []
  for w in comm_cases():
    ours, xla = _programs(w, mesh)
    mine = comm_list(ours.lower(*w.args).compile().as_text(), mesh)
    theirs = comm_list(xla.lower(*w.args).compile().as_text(), mesh)
    a, b = sum(n for _, n, _ in mine), sum(n for _, n, _ in theirs)
    ratios.append(a / b if b else 1.0)
    rows.append((w.name, a, b, f"{a / b:.3f}" if b else "-", why_differs(mine, theirs) if a != b else "-"))
    lists.append(f"  {w.name}\n    ours: {_fmt_comm(mine)}\n    XLA:  {_fmt_comm(theirs)}")
  print(f"\n## a. Collective bytes per device per step (mesh {MESHES[8]})\n")
  print(table(("case", "ours B", "XLA B", "ours/XLA", "why (collective, per-device array)"),
               rows))
  print("\ncollective lists, kind(axes):bytes\n" + "\n".join(lists))
  fewer = sum(r < 1 for r in ratios)
  more = sum(r > 1 for r in ratios)
  print(f"\nsummary: ours/XLA bytes geomean {geomean(ratios):.3f} over {len(ratios)} cases "
        f"(min {min(ratios):.3f}, max {max(ratios):.3f}); fewer in {fewer}, same in "
        f"{len(ratios) - fewer - more}, more in {more}")


# --- b. step time ------------------------------------------------------------------------------

def timed(fn: Callable[[], Any]) -> float:
  start = time.perf_counter()
  jax.block_until_ready(fn())
  return time.perf_counter() - start


def section_step_time(quick: bool) -> None:
  mesh = spmd.make_mesh(MESHES[8])
  runs, warmup = (10, 2) if quick else (30, 3)
  rows = []
  for build, sizes in STEP_SIZES["quick" if quick else "full"]:
    w = build(**sizes)
    args = jax.device_put(w.args, named_shardings(mesh, w.in_specs))
    ours, xla = _programs(w, mesh)
    ours_exe, xla_exe = ours.lower(*args).compile(), xla.lower(*args).compile()
    counts = [len(collectives(e.as_text())) for e in (ours_exe, xla_exe)]
    contenders = {"ours": functools.partial(ours_exe, *args),
                  "xla": functools.partial(xla_exe, *args)}
    for fn in contenders.values():
      for _ in range(warmup):
        timed(fn)
    times: dict[str, list[float]] = {k: [] for k in contenders}
    for _ in range(runs):  # interleaved, so drift hits every contender alike
      for k, fn in contenders.items():
        times[k].append(timed(fn))
    med = {k: statistics.median(v) * 1e3 for k, v in times.items()}
    rows.append((w.name, _fmt_sizes(sizes), f"{med['ours']:.2f}", f"{med['xla']:.2f}",
                 f"{med['ours'] / med['xla']:.3f}", f"{min(times['ours']) / min(times['xla']):.3f}",
                 "/".join(map(str, counts))))
  print(f"\n## b. Steady-state step time, median of {runs} interleaved runs (ms, mesh "
        f"{MESHES[8]})\n")
  print(table(("step", "sizes", "ours", "XLA", "ours/XLA", "ours/XLA of fastest runs",
                "collectives ours/XLA"), rows))
  print("\nsummary: ours/XLA median step time " +
        ", ".join(f"{r[0]} {r[4]}" for r in rows))


# --- c. compile time ---------------------------------------------------------------------------

def compile_child(devices: int) -> dict[str, dict[str, float]]:
  """Seconds for one fresh compile per case on ``devices`` simulated devices, caches cleared."""
  mesh = spmd.make_mesh(MESHES[devices])
  out = {}
  for build, sizes in COMPILE_SIZES:
    w = build(**sizes)
    jax.clear_caches()
    start = time.perf_counter()
    f = spmd.partition(w.fn, mesh=mesh, in_specs=w.in_specs)
    out_specs = f.plan(*w.args).out_specs
    planned = time.perf_counter()
    f.lower(*w.args).compile()
    done = time.perf_counter()
    jax.clear_caches()
    xla = jax.jit(w.fn, in_shardings=named_shardings(mesh, w.in_specs),
                  out_shardings=named_shardings(mesh, out_specs))
    xla.lower(*w.args).compile()
    out[w.name] = {"ours": done - start, "plan": planned - start,
                   "xla": time.perf_counter() - done}
  return out


def section_compile_time(quick: bool) -> None:
  rounds = 1 if quick else 3
  runs: dict[int, list[dict[str, dict[str, float]]]] = {n: [] for n in MESHES}
  for _ in range(rounds):  # alternate the device counts, so drift in machine load hits both
    for n in MESHES:
      proc = subprocess.run([sys.executable, __file__, "--compile-child", str(n)],
                            stdout=subprocess.PIPE, text=True, check=True)
      runs[n].append(json.loads(proc.stdout.splitlines()[-1]))
  med = {n: {w: {k: statistics.median(r[w][k] for r in rs) for k in rs[0][w]} for w in rs[0]}
         for n, rs in runs.items()}
  rows = []
  for name in med[8]:
    a, b = med[8][name], med[64][name]
    rows.append((name, f"{a['ours']:.2f} ({a['plan']:.2f})", f"{b['ours']:.2f} ({b['plan']:.2f})",
                 f"{b['ours'] / a['ours']:.2f}", f"{a['xla']:.2f}", f"{b['xla']:.2f}",
                 f"{b['xla'] / a['xla']:.2f}"))
  print(f"\n## c. Compile time, median of {rounds} fresh compiles, one process per device count "
        f"and round (s; meshes {MESHES[8]} and {MESHES[64]}; in parentheses: trace + propagate "
        f"+ plan)\n")
  print(table(("step", "ours 8 dev", "ours 64 dev", "ours 64/8", "XLA 8 dev", "XLA 64 dev",
                "XLA 64/8"), rows))
  print("\nsummary: ours compile time 64/8 devices " + ", ".join(f"{r[0]} {r[3]}" for r in rows)
        + "; XLA's " + ", ".join(f"{r[0]} {r[6]}" for r in rows))


def main(argv: Sequence[str] | None = None) -> None:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--quick", action="store_true",
                      help="smaller step-time sizes, fewer step-time runs, one compile round")
  parser.add_argument("--compile-child", type=int, choices=sorted(MESHES), metavar="N",
                      help="internal: time compiles on N simulated devices, print JSON")
  args = parser.parse_args(argv)
  if args.compile_child:
    print(json.dumps(compile_child(args.compile_child)))
    return
  start = time.perf_counter()
  print(f"spmd vs XLA's partitioner; jax {jax.__version__}, {jax.device_count()} simulated "
        f"{jax.devices()[0].platform} devices on {os.cpu_count()} cores, load average "
        f"{os.getloadavg()[0]:.1f} at start")
  section_bytes()
  section_step_time(args.quick)
  section_compile_time(args.quick)
  print(f"\ntotal runtime {time.perf_counter() - start:.0f} s, load average "
        f"{os.getloadavg()[0]:.1f} at the end")


if __name__ == "__main__":
  main()
