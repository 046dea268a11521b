"""The partitioned program as a picture: a line per op (or per layer, for big programs), its
result's sharding as a colour, annotations marked, every collective with its kind and bytes, and
halo exchanges as arrows between neighbouring shards."""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

from spmd.plan import SMALL, Collective, Group, HaloExchange, Plan, PlanRow, fmt_bytes
from spmd.visual import svg
from spmd.visual.svg import Picture

LINE = 26          # px per op or layer
LABEL = 300        # px for the op / layer name
MAX_LEGEND = 12    # shardings named in the legend
MAX_SHARDS = 8     # shards drawn in a halo picture


@dataclass(frozen=True)
class ProgramPicture(Picture):
  """``plan`` drawn a line per op, or with ``by_layer`` a line per ``plan.groups()``."""

  plan: Plan = field(repr=False)
  by_layer: bool = False

  def svg(self) -> str:
    colors = _colors(self.plan.rows)
    items = self.plan.groups() if self.by_layer else self.plan.rows
    draw = _layer_line if self.by_layer else _op_line
    swatch = min(max(map(svg.width_of, colors), default=0) + 12, 360)
    body, width = [svg.text(4, 16, self.plan.title(), font_weight="bold")], 400.0
    for k, item in enumerate(items):
      line, right = draw(item, 24 + k * LINE, colors, swatch)
      body.append(line)
      width = max(width, right)
    legend_y = 24 + len(items) * LINE + 14
    body.append(_legend(colors, legend_y))
    return svg.document(width + 8, legend_y + 18 * (min(len(colors), MAX_LEGEND) + 2), body)


def program(plan: Plan, by_layer: bool | None = None) -> ProgramPicture:
  """The picture of ``plan``; ``by_layer`` None: by layer for programs of more than SMALL ops."""
  return ProgramPicture(plan, len(plan.rows) > SMALL if by_layer is None else by_layer)


def _colors(rows: tuple[PlanRow, ...]) -> dict[str, str]:
  """A colour per sharding, in order of first appearance."""
  specs = dict.fromkeys(s for r in rows for s in r.specs)
  return {s: svg.PALETTE[k % len(svg.PALETTE)] for k, s in enumerate(specs)}


def _op_line(row: PlanRow, y: float, colors: dict[str, str], swatch: float
             ) -> tuple[str, float]:
  label = f"{row.index:>3} {'  ' * row.depth}{row.primitive}"
  parts = [svg.text(4, y + 15, label, **{"font-weight": "bold"} if row.annotated else {})]
  spec = row.specs[0] if row.specs else ""
  shape = row.shapes[0] if row.shapes else ""
  parts.append(svg.rect(LABEL, y + 3, swatch - 6, LINE - 6, colors.get(spec, "#fff"),
                        title=f"{shape} {spec}", stroke="#000" if row.annotated else "#888",
                        stroke_width=3 if row.annotated else 1,
                        class_="annotation" if row.annotated else None))
  parts.append(svg.text(LABEL + 4, y + 15, spec))
  x = LABEL + swatch
  for c in row.collectives:
    badge, x = _badge(c.kind, c.describe(), x, y, c.source, c)
    parts.append(badge)
    if c.halo is not None:
      halo, x = _halo(c.halo, x, y)
      parts.append(halo)
  return svg.group(parts, class_="op", data_index=row.index), x


def _layer_line(g: Group, y: float, colors: dict[str, str], swatch: float
                ) -> tuple[str, float]:
  annotated = sum(r.annotated for r in g.rows)
  label = g.name + (f"  ({annotated} annotated)" if annotated else "")
  parts = [svg.text(4, y + 15, label[:LABEL // 7])]
  shares = Counter(r.specs[0] for r in g.rows if r.specs)
  x = float(LABEL)
  for spec, n in shares.items():
    w = (swatch - 6) * n / sum(shares.values())
    parts.append(svg.rect(x, y + 3, w, LINE - 6, colors[spec], title=f"{spec}: {n} ops"))
    x += w
  x = LABEL + swatch
  for kind in dict.fromkeys(c.kind for c in g.collectives):
    of_kind = [c for c in g.collectives if c.kind == kind]
    step = sum(c.step_bytes for c in of_kind)
    text = f"{kind} x{len(of_kind)} {fmt_bytes(step)}"
    badge, x = _badge(kind, text, x, y, f"{len(of_kind)} collectives", None,
                      data_count=len(of_kind), data_step_bytes=step)
    parts.append(badge)
  for h in dict.fromkeys(c.halo for c in g.collectives if c.halo is not None):
    halo, x = _halo(h, x, y)
    parts.append(halo)
  return svg.group(parts, class_="layer", data_name=g.name), x


def _badge(kind: str, label: str, x: float, y: float, title: str, c: Collective | None,
           **data: object) -> tuple[str, float]:
  """A collective: its kind's colour, its text; ``c``'s fields as data attributes."""
  w = svg.width_of(label) + 10
  fields = {} if c is None else dict(data_op=c.op, data_axes=",".join(c.axes),
                                     data_bytes=c.bytes, data_trips=c.trips)
  parts = [svg.rect(x, y + 3, w, LINE - 6, svg.KIND_COLORS.get(kind, "#777"), title=title,
                    rx=4, opacity=0.85),
           svg.text(x + 5, y + 15, label, fill="#fff")]
  return svg.group(parts, class_="collective", data_kind=kind, **fields, **data), x + w + 6


def _halo(h: HaloExchange, x: float, y: float) -> tuple[str, float]:
  """The blocks of the exchanged dim as boxes, an arrow from each sender to its receiver: above
  for rows from the left, below for rows from the right, through the middle for a rotation, a
  route or a mirror."""
  shards = min(h.shards, MAX_SHARDS)
  box, gap = 16, 14
  parts = [svg.rect(x + k * (box + gap), y + 6, box, LINE - 12, "#eee", stroke="#555")
           for k in range(shards)]
  level = {"left": y + 8, "right": y + LINE - 8}.get(h.side, y + LINE / 2)
  for src, dst in h.pairs:
    if src != dst and max(src, dst) < shards:
      x0, x1 = (x + src * (box + gap) + (box if src < dst else 0),
                x + dst * (box + gap) + (0 if src < dst else box))
      parts.append(svg.arrow(x0, level, x1, level, class_="halo-arrow", data_from=src,
                             data_to=dst))
  end = x + shards * (box + gap)
  source = {"left": f"{h.hop} block(s) before", "right": f"{h.hop} block(s) after",
            "rotate": f"{h.hop} block(s) after, cyclically",
            "route": "the blocks the arrows name"}.get(h.side, "the mirrored block")
  note = f"dim {h.dim}: {h.rows} rows from {source}"
  parts.append(svg.text(end, y + 15, note))
  return (svg.group(parts, class_="halo", data_dim=h.dim, data_shards=h.shards),
          end + svg.width_of(note) + 8)


def _legend(colors: dict[str, str], y: float) -> str:
  parts = [svg.text(4, y, "sharding of each op's result (bold border: an annotation)")]
  for k, (spec, color) in enumerate(list(colors.items())[:MAX_LEGEND]):
    parts += [svg.rect(4, y + 6 + 18 * k, 14, 14, color, stroke="#888"),
              svg.text(24, y + 17 + 18 * k, spec)]
  if len(colors) > MAX_LEGEND:
    parts.append(svg.text(24, y + 17 + 18 * MAX_LEGEND, f"... {len(colors) - MAX_LEGEND} more"))
  return svg.group(parts, class_="legend")
