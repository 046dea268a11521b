"""Plan: what the partitioned program does, before anything runs, and why."""
from __future__ import annotations

import html
from collections import Counter
from dataclasses import dataclass
from typing import Any

from spmd.partition.sharding import Axes


@dataclass(frozen=True)
class HaloExchange:
  """One ppermute of a halo exchange along dim ``dim`` of operand ``operand``, split in
  ``shards`` blocks: ``rows`` rows from the block ``hop`` places before each block (``side``
  "left"), after it ("right"), after it cyclically ("rotate"), from blocks at several distances
  ("route", ``hop`` 0), or the mirrored block whole ("mirror"); ``pairs`` are the (sender,
  receiver) blocks the ppermute connects."""

  operand: int
  dim: int
  shards: int
  side: str
  hop: int
  rows: int
  pairs: tuple[tuple[int, int], ...]


@dataclass(frozen=True)
class Collective:
  """One collective of the emitted program.

  ``bytes`` is per device, the larger of its input and output buffers (V in the usual cost
  formulas), priced for the backend compiled for; ``op`` is the op index it belongs to (None at
  the program boundary); ``tensor`` says which tensor moves (``"operand 1"``, ``"output 2"``);
  ``trips`` is how often it runs per call (the lengths of the scans around it; None inside a
  while loop, whose trip count is a runtime value); ``halo`` describes a halo exchange.
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
  halo: HaloExchange | None = None

  @property
  def step_bytes(self) -> int:
    """Bytes per call: ``bytes`` times ``trips`` (one iteration where the count is unknown)."""
    return self.bytes * (self.trips or 1)

  @property
  def label(self) -> str:
    """Kind and mesh axes: ``all-reduce(model)``."""
    return f"{self.kind}({','.join(self.axes)})"

  def describe(self) -> str:
    times = "" if self.trips == 1 else " x ?" if self.trips is None else f" x {self.trips}"
    return f"{self.label} {fmt_bytes(self.bytes)}{times}"


@dataclass(frozen=True)
class PlanRow:
  """One op of the program as ``explain()`` shows it; ``scope`` is the layer it was traced in
  (flax module path or ``jax.named_scope``s), ``backward`` says it is part of a transposed
  (gradient) computation, ``annotated`` that an annotation fixed its result's sharding."""

  index: int
  primitive: str
  source: str
  depth: int
  shapes: tuple[str, ...]
  specs: tuple[str, ...]
  origins: tuple[str, ...]
  collectives: tuple[Collective, ...]
  scope: tuple[str, ...] = ()
  backward: bool = False
  annotated: bool = False


@dataclass(frozen=True)
class Group:
  """The ops of one layer (``layer``) or, outside any layer, of one source line, and what they
  move."""

  name: str
  rows: tuple[PlanRow, ...]
  layer: bool

  @property
  def collectives(self) -> tuple[Collective, ...]:
    return tuple(c for r in self.rows for c in r.collectives)

  def step_bytes(self, backward: bool | None = None) -> int:
    """Bytes per call of its collectives; ``backward`` True / False: of the gradient / forward
    ops only."""
    return sum(c.step_bytes for r in self.rows if backward in (None, r.backward)
               for c in r.collectives)


@dataclass(frozen=True)
class Table:
  """Rows of cells for display; ``numeric`` columns align right."""

  header: tuple[str, ...]
  rows: tuple[tuple[str, ...], ...]
  numeric: frozenset[int] = frozenset()

  def text(self, indent: str = "") -> list[str]:
    table = (self.header,) + self.rows
    widths = [max(len(r[i]) for r in table) for i in range(len(self.header))]
    last = len(self.header) - 1
    return [indent + "  ".join(
        c.rjust(w) if i in self.numeric else c if i == last else c.ljust(w)
        for i, (c, w) in enumerate(zip(r, widths))).rstrip() for r in table]

  def html(self) -> str:
    def row(cells: tuple[str, ...], tag: str) -> str:
      return "<tr>" + "".join(
          f'<{tag} style="text-align:{"right" if i in self.numeric else "left"}">'
          f"{html.escape(c)}</{tag}>" for i, c in enumerate(cells)) + "</tr>"

    body = "".join(row(r, "td") for r in self.rows)
    return f"<table><thead>{row(self.header, 'th')}</thead><tbody>{body}</tbody></table>"


@dataclass(frozen=True)
class SearchVariable:
  """One choice of ``partition(auto=True)``: open inputs tied together (same shape, dtype and
  last pytree key), the specs it could take, and the spec each input has in the chosen plan."""

  inputs: tuple[str, ...]
  candidates: tuple[Any, ...]
  chosen: tuple[Any, ...]


@dataclass(frozen=True)
class Search:
  """What ``partition(auto=True)`` searched. Bytes are ``step_bytes`` of whole plans:
  ``step_bytes`` of the chosen one, ``propagation_bytes`` with the open inputs left to
  propagation, ``ilp_bytes`` of the solver's answer (the integer program's, or the greedy
  fallback's; ``predicted_bytes`` is its own linearised estimate); ``from_ilp`` says the chosen
  plan is that answer (else it is one of the single-variable plans priced for its costs).
  ``memory_bytes``: per device, of the chosen plan's inputs; ``memory_limit``: the bound it
  kept, ``limit_source`` where that came from ("memory_limit", "device memory" or "none": the
  devices report no memory).
  ``method``: how one candidate per variable was chosen ("milp", or "greedy (<why>)")."""

  variables: tuple[SearchVariable, ...]
  plans_priced: int
  solver_seconds: float
  seconds: float
  step_bytes: int
  propagation_bytes: int
  predicted_bytes: int
  ilp_bytes: int
  memory_bytes: int
  memory_limit: int | None
  limit_source: str
  from_ilp: bool
  method: str

  @property
  def candidates(self) -> int:
    return sum(len(v.candidates) for v in self.variables)

  def lines(self) -> list[str]:
    limit = ("no limit: the devices report no memory" if self.memory_limit is None
             else f"limit {fmt_bytes(self.memory_limit)}, {self.limit_source}")
    chosen = "the solver's answer" if self.from_ilp else "a single-variable plan"
    head = (f"auto sharding: {len(self.variables)} variables, {self.candidates} candidates, "
            f"{self.plans_priced} plans priced in {self.seconds:.1f} s (solver {self.method}, "
            f"{self.solver_seconds:.3f} s); chose {chosen}: {fmt_bytes(self.step_bytes)} per "
            f"call (propagation alone {fmt_bytes(self.propagation_bytes)}), inputs "
            f"{fmt_bytes(self.memory_bytes)} per device ({limit})")
    return [head] + [f"  {_spec_text(v.chosen)}: {v.inputs[0]}"
                     + (f" and {len(v.inputs) - 1} tied" if len(v.inputs) > 1 else "")
                     for v in self.variables]


def _spec_text(specs: tuple[Any, ...]) -> str:
  return " / ".join(str(s) for s in dict.fromkeys(specs))


SMALL = 40         # programs of at most this many rows show their op table by default
MAX_GROUPS = 12    # the summary by layer shows at most this many layers


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
  search: Search | None = None

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

  def groups(self, depth: int | None = None) -> tuple[Group, ...]:
    """The rows by layer, in program order: ops traced in a scope (a flax module, a
    ``jax.named_scope``) by its first ``depth`` names, other ops by source line. ``None``: the
    deepest level with at most MAX_GROUPS layers (at least 1)."""
    if depth is None:
      deepest = max((len(r.scope) for r in self.rows), default=0)
      depth = next((d for d in range(deepest, 1, -1)
                    if len({r.scope[:d] for r in self.rows if r.scope}) <= MAX_GROUPS), 1)
    grouped: dict[tuple[str, bool], list[PlanRow]] = {}
    for r in self.rows:
      key = ("/".join(r.scope[:depth]), True) if r.scope else (r.source, False)
      grouped.setdefault(key, []).append(r)
    return tuple(Group(name, tuple(rows), layer) for (name, layer), rows in grouped.items())

  def kind_table(self) -> Table:
    """Collectives per device by kind and mesh axes: how many, bytes in the program and per
    call."""
    by_label: dict[str, list[Collective]] = {}
    for c in sorted(self.collectives, key=lambda c: c.label):
      by_label.setdefault(c.label, []).append(c)
    rows = [(label, str(len(cs)), fmt_bytes(sum(c.bytes for c in cs)),
             fmt_bytes(sum(c.step_bytes for c in cs))) for label, cs in by_label.items()]
    rows.append(("total", str(len(self.collectives)), fmt_bytes(self.total_bytes),
                 fmt_bytes(self.step_bytes)))
    return Table(("collective", "count", "in program", "per call"), tuple(rows),
                 frozenset({1, 2, 3}))

  def group_table(self, depth: int | None = None) -> Table:
    """Per layer (``groups``): ops, collectives by kind, bytes per call forward and backward.
    At most MAX_GROUPS rows: of the layers and the source lines that move bytes, those that move
    the most; the rest summed in a last row."""
    groups = self.groups(depth)
    candidates = [g for g in groups if g.layer or g.step_bytes()]
    shown = {g.name for g in sorted(candidates, key=lambda g: -g.step_bytes())[:MAX_GROUPS]}
    rows = [_group_row(g.name, [g]) for g in groups if g.name in shown]
    rest = [g for g in groups if g.name not in shown]
    if rest:
      rows.append(_group_row(f"{len(rest)} more", rest))
    return Table(("layer", "ops", "collectives", "forward", "backward"), tuple(rows),
                 frozenset({1, 3, 4}))

  def op_table(self) -> Table:
    """Every op: source, result shapes, shardings, where each came from, its collectives."""
    table = []
    for row in self.rows:
      comm = "; ".join(c.describe() for c in row.collectives) or "-"
      op = "  " * row.depth + row.primitive
      for k, (shape, spec, origin) in enumerate(zip(row.shapes, row.specs, row.origins)):
        first = k == 0
        table.append((str(row.index) if first else "", op if first else "",
                      row.source if first else "", shape, spec, origin, comm if first else ""))
      if not row.shapes:
        table.append((str(row.index), op, row.source, "", "", "", comm))
    return Table(("#", "op", "source", "shape", "sharding", "from", "collectives"), tuple(table))

  def _show(self, full: bool | None) -> tuple[bool, bool]:
    """(summary, op table): a small program shows its table, a large one its summary."""
    small = len(self.rows) <= SMALL
    return full is False or not small, full if full is not None else small

  def title(self) -> str:
    mesh = ", ".join(f"{k}={v}" for k, v in self.mesh_shape.items())
    return f"spmd plan for {self.name} on mesh ({mesh}), backend={self.backend!r}"

  def _totals(self) -> str:
    counts = Counter(c.kind for c in self.collectives)
    totals = self.bytes_by_kind()
    summary = ", ".join(f"{kind} x{counts[kind]} = {fmt_bytes(totals[kind])}"
                        for kind in sorted(totals)) or "none"
    total = f"total {fmt_bytes(self.total_bytes)}"
    if self.step_bytes != self.total_bytes:
      total += f" in the program, {fmt_bytes(self.step_bytes)} per call (loop trips counted)"
    return f"collectives per device: {summary}; {total}"

  def explain(self, full: bool | None = None) -> str:
    """The plan as text. ``full=None``: the op table for a program of at most SMALL rows, else
    a summary (collectives by kind, bytes by layer); ``full=True`` adds the op table to a
    summary, ``full=False`` shows only the summary. Totals and warnings end it."""
    summary, table = self._show(full)
    lines = [self.title()] + (self.search.lines() if self.search else [])
    if summary:
      lines.append(f"{len(self.rows)} ops, {len(self.collectives)} collectives; per device:")
      lines += self.kind_table().text("  ")
      lines.append("by layer (bytes per call per device):")
      lines += self.group_table().text("  ")
      if not table:
        lines.append("op table: explain(full=True)")
    if table:
      lines += self.op_table().text()
    lines.append(self._totals())
    lines.extend(f"warning: {w}" for w in self.warnings)
    return "\n".join(lines)

  def __str__(self) -> str:
    return self.explain()

  def _repr_pretty_(self, p: Any, cycle: bool) -> None:  # IPython / notebooks
    p.text(self.explain())

  def _repr_html_(self) -> str:
    """Jupyter: the summary tables, the op table folded (open for a small program)."""
    summary, table = self._show(None)
    parts = [f"<p><b>{html.escape(self.title())}</b></p>"]
    parts += [f"<pre>{html.escape(line)}</pre>" for line in (self.search.lines()
                                                              if self.search else [])]
    if summary:
      parts += ["<p>collectives per device</p>", self.kind_table().html(),
                "<p>by layer (bytes per call per device)</p>", self.group_table().html()]
    parts.append(f"<details{' open' if table else ''}><summary>op table ({len(self.rows)} rows)"
                 f"</summary>{self.op_table().html()}</details>")
    parts.append(f"<p>{html.escape(self._totals())}</p>")
    parts += [f"<p>warning: {html.escape(w)}</p>" for w in self.warnings]
    return "\n".join(parts)


def _group_row(name: str, groups: list[Group]) -> tuple[str, ...]:
  kinds = Counter(c.label for g in groups for c in g.collectives)
  return (name, str(sum(len(g.rows) for g in groups)),
          ", ".join(f"{k} x{n}" for k, n in kinds.items()) or "-",
          fmt_bytes(sum(g.step_bytes(False) for g in groups)),
          fmt_bytes(sum(g.step_bytes(True) for g in groups)))


def fmt_bytes(n: float) -> str:
  """``n`` bytes in B, KiB, MiB or GiB."""
  for unit in ("B", "KiB", "MiB", "GiB"):
    if n < 1024 or unit == "GiB":
      return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
    n /= 1024
  return f"{n} B"
