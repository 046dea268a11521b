"""Plan: what the partitioned program does, before anything runs, and why."""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

from spmd.partition.sharding import Axes


@dataclass(frozen=True)
class Collective:
  """One collective of the emitted program.

  ``bytes`` is per device, the larger of its input and output buffers (V in the usual cost
  formulas), priced for the backend compiled for; ``op`` is the op index it belongs to (None at
  the program boundary); ``tensor`` says which tensor moves (``"operand 1"``, ``"output 2"``);
  ``trips`` is how often it runs per call (the lengths of the scans around it; None inside a
  while loop, whose trip count is a runtime value).
  """

  kind: str
  axes: Axes
  bytes: int
  op: int | None
  primitive: str
  source: str
  tensor: str
  shape: str
  before: str
  after: str
  trips: int | None = 1

  @property
  def step_bytes(self) -> int:
    """Bytes per call: ``bytes`` times ``trips`` (one iteration where the count is unknown)."""
    return self.bytes * (self.trips or 1)

  def describe(self) -> str:
    times = "" if self.trips == 1 else " x ?" if self.trips is None else f" x {self.trips}"
    return f"{self.kind}({','.join(self.axes)}) {_fmt_bytes(self.bytes)}{times}"


@dataclass(frozen=True)
class PlanRow:
  """One op of the program as ``explain()`` shows it."""

  index: int
  primitive: str
  source: str
  depth: int
  shapes: tuple[str, ...]
  specs: tuple[str, ...]
  origins: tuple[str, ...]
  collectives: tuple[Collective, ...]


@dataclass(frozen=True)
class Plan:
  """The partitioned program: a row per op, every collective, and warnings.

  ``in_specs`` / ``out_specs`` are pytrees (like the arguments / outputs) of the PartitionSpec
  each array gets at the program boundary.
  """

  mesh_shape: dict[str, int]
  backend: str
  rows: tuple[PlanRow, ...]
  collectives: tuple[Collective, ...]
  warnings: tuple[str, ...]
  in_specs: Any
  out_specs: Any
  name: str = "f"

  def bytes_by_kind(self) -> dict[str, int]:
    totals: Counter = Counter()
    for c in self.collectives:
      totals[c.kind] += c.bytes
    return dict(totals)

  @property
  def total_bytes(self) -> int:
    """Bytes per device of the program's collectives, each counted once (as the compiled HLO
    lists them)."""
    return sum(c.bytes for c in self.collectives)

  @property
  def step_bytes(self) -> int:
    """Bytes per device that one call moves: collectives inside scans count once per iteration
    (inside a while loop, once: see ``warnings``)."""
    return sum(c.step_bytes for c in self.collectives)

  def explain(self) -> str:
    mesh = ", ".join(f"{k}={v}" for k, v in self.mesh_shape.items())
    lines = [f"spmd plan for {self.name} on mesh ({mesh}), backend={self.backend!r}"]
    header = ("#", "op", "source", "shape", "sharding", "from", "collectives")
    table = [header]
    for row in self.rows:
      comm = "; ".join(c.describe() for c in row.collectives) or "-"
      for k, (shape, spec, origin) in enumerate(zip(row.shapes, row.specs, row.origins)):
        first = k == 0
        table.append((str(row.index) if first else "",
                      ("  " * row.depth + row.primitive) if first else "",
                      row.source if first else "", shape, spec, origin, comm if first else ""))
      if not row.shapes:
        table.append((str(row.index), "  " * row.depth + row.primitive, row.source, "", "", "",
                      comm))
    widths = [max(len(r[i]) for r in table) for i in range(len(header) - 1)]
    for r in table:
      lines.append("  ".join(c.ljust(w) for c, w in zip(r, widths)) + "  " + r[-1])
    counts = Counter(c.kind for c in self.collectives)
    totals = self.bytes_by_kind()
    summary = ", ".join(f"{kind} x{counts[kind]} = {_fmt_bytes(totals[kind])}"
                        for kind in sorted(totals)) or "none"
    total = f"total {_fmt_bytes(self.total_bytes)}"
    if self.step_bytes != self.total_bytes:
      total += f" in the program, {_fmt_bytes(self.step_bytes)} per call (loop trips counted)"
    lines.append(f"collectives per device: {summary}; {total}")
    lines.extend(f"warning: {w}" for w in self.warnings)
    return "\n".join(lines)

  def __str__(self) -> str:
    return self.explain()

  def _repr_pretty_(self, p: Any, cycle: bool) -> None:  # IPython / notebooks
    p.text(self.explain())


def _fmt_bytes(n: int) -> str:
  for unit in ("B", "KiB", "MiB", "GiB"):
    if n < 1024 or unit == "GiB":
      return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
    n /= 1024
  return f"{n} B"
