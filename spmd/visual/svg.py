"""SVG elements as strings: the few shapes the pictures need, escaped, with a text-width guess."""
from __future__ import annotations

import abc
import html
from pathlib import Path

FONT = 11                 # px, monospace
CHAR = 7.2                # px per character at FONT (a generous guess)
PALETTE = ("#8dd3c7", "#bebada", "#fb8072", "#80b1d3", "#fdb462", "#b3de69", "#fccde5",
           "#bc80bd", "#ccebc5", "#ffed6f", "#d9d9d9", "#9ecae1")
KIND_COLORS = {"all-reduce": "#d62728", "all-gather": "#1f77b4", "reduce-scatter": "#ff7f0e",
               "all-to-all": "#9467bd", "collective-permute": "#2ca02c"}
PADDING_FILL = "url(#padding)"


def _attrs(attrs: dict) -> str:
  """``class_`` -> ``class``, ``data_kind`` -> ``data-kind``; None values are left out."""
  return "".join(f' {k.rstrip("_").replace("_", "-")}="{html.escape(str(v))}"'
                 for k, v in attrs.items() if v is not None)


def element(tag: str, body: str = "", **attrs: object) -> str:
  return f"<{tag}{_attrs(attrs)}>{body}</{tag}>" if body else f"<{tag}{_attrs(attrs)}/>"


def rect(x: float, y: float, w: float, h: float, fill: str, title: str | None = None,
         **attrs: object) -> str:
  tip = element("title", html.escape(title)) if title else ""
  return element("rect", tip, x=f"{x:.1f}", y=f"{y:.1f}", width=f"{w:.1f}", height=f"{h:.1f}",
                 fill=fill, **attrs)


def text(x: float, y: float, s: str, **attrs: object) -> str:
  return element("text", html.escape(s), x=f"{x:.1f}", y=f"{y:.1f}", **attrs)


def arrow(x1: float, y1: float, x2: float, y2: float, **attrs: object) -> str:
  return element("line", x1=f"{x1:.1f}", y1=f"{y1:.1f}", x2=f"{x2:.1f}", y2=f"{y2:.1f}",
                 stroke="#333", marker_end="url(#arrow)", **attrs)


def group(body: list[str], **attrs: object) -> str:
  return element("g", "".join(body), **attrs)


def width_of(s: str) -> float:
  return len(s) * CHAR


def document(width: float, height: float, body: list[str]) -> str:
  defs = ('<defs><marker id="arrow" viewBox="0 0 10 10" refX="9" refY="5" markerWidth="6" '
          'markerHeight="6" orient="auto-start-reverse"><path d="M0,0 L10,5 L0,10 z" '
          'fill="#333"/></marker><pattern id="padding" width="6" height="6" '
          'patternUnits="userSpaceOnUse" patternTransform="rotate(45)"><rect width="6" '
          'height="6" fill="#eee"/><line x1="0" y1="0" x2="0" y2="6" stroke="#999" '
          'stroke-width="2"/></pattern></defs>')
  return (f'<svg xmlns="http://www.w3.org/2000/svg" width="{width:.0f}" height="{height:.0f}" '
          f'viewBox="0 0 {width:.0f} {height:.0f}" font-family="monospace" '
          f'font-size="{FONT}">{defs}{"".join(body)}</svg>')


class Picture(abc.ABC):
  """Base of the pictures: ``svg()`` is shown inline by Jupyter and written by ``save``."""

  @abc.abstractmethod
  def svg(self) -> str:
    """The picture as an SVG document."""

  def _repr_svg_(self) -> str:
    return self.svg()

  def save(self, path: str | Path) -> None:
    Path(path).write_text(self.svg())
