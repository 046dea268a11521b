"""One array's layout on a mesh: which device holds which block, padding of uneven shards.

Blocks follow spmd's own sharding (``TensorSharding``): a dim of size N split n ways is held
in blocks of ceil(N/n) rows, the padding at the end; a dim split over several mesh axes counts
its blocks major to minor, as ``lax.axis_index`` of those axes does.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Mapping

import numpy as np
from jax.sharding import PartitionSpec as P

from spmd.partition.sharding import TensorSharding
from spmd.visual import svg
from spmd.visual.svg import Picture

Range = tuple[int, int]


@dataclass(frozen=True)
class Block:
  """One block: the devices holding it, its block index per dim, its ``[start, stop)`` rows per
  dim of the padded array and the part of them inside the array (``valid``)."""

  devices: tuple[int, ...]
  index: tuple[int, ...]
  ranges: tuple[Range, ...]
  valid: tuple[Range, ...]

  @property
  def padding(self) -> tuple[int, ...]:
    """Padded rows per dim (at the end of the block)."""
    return tuple((b - a) - (d - c) for (a, b), (c, d) in zip(self.ranges, self.valid))


@dataclass(frozen=True)
class Layout(Picture):
  """``shape`` split by ``spec`` over a mesh of ``mesh_shape``: its blocks in block-index order."""

  shape: tuple[int, ...]
  spec: P
  mesh_shape: dict[str, int]
  blocks: tuple[Block, ...]

  @property
  def block_shape(self) -> tuple[int, ...]:
    return tuple(b - a for a, b in self.blocks[0].ranges)

  def describe(self) -> str:
    """A line per block: devices, rows per dim, padding."""
    lines = [_title(self)]
    for b in self.blocks:
      pad = ", ".join(map(str, b.padding)) if any(b.padding) else ""
      padding = f" + padding ({pad})" if pad else ""
      lines.append(f"devices {_ids(b.devices)}: {_rows(b)}{padding}")
    return "\n".join(lines)

  def __str__(self) -> str:
    return self.describe()

  def svg(self) -> str:
    return _draw(self)


def layout(x: Any, spec: P | None = None, mesh: Any = None) -> Layout:
  """The layout of ``x`` (a shape, or an array / ShapeDtypeStruct) split by ``spec`` over
  ``mesh`` (a ``jax.sharding.Mesh`` or ``{axis: size}``); a jax.Array or ShapeDtypeStruct with a
  NamedSharding supplies both. Nothing needs to exist but the shape: works for any rank, any
  spec, uneven sizes."""
  if spec is None or mesh is None:
    sharding = getattr(x, "sharding", None)
    spec = sharding.spec if spec is None else spec
    mesh = sharding.mesh if mesh is None else mesh
  shape = tuple(getattr(x, "shape", x))
  if isinstance(mesh, Mapping):
    mesh_shape = dict(mesh)
    devices = np.arange(math.prod(mesh_shape.values())).reshape(tuple(mesh_shape.values()))
  else:
    mesh_shape = dict(mesh.shape)
    devices = np.vectorize(lambda d: d.id)(np.asarray(mesh.devices)).reshape(
        tuple(mesh_shape.values()))
  sharding = TensorSharding.from_spec(spec, len(shape), mesh_shape)
  return Layout(shape, spec, mesh_shape, _blocks(shape, sharding, mesh_shape, devices))


def _blocks(shape: tuple[int, ...], s: TensorSharding, mesh: dict[str, int],
            devices: np.ndarray) -> tuple[Block, ...]:
  """Every block, in block-index order, with the devices that hold it (``devices``: the device
  id at each mesh position)."""
  local = s.local_shape(shape, mesh)
  holders: dict[tuple[int, ...], list[int]] = {}
  for position in np.ndindex(*mesh.values()):
    coords = dict(zip(mesh, position))
    index = tuple(_shard_index(coords, axes, mesh) for axes in s.dims)
    holders.setdefault(index, []).append(int(devices[position]))
  out = []
  for index in sorted(holders):
    ranges = tuple((k * n, (k + 1) * n) for k, n in zip(index, local))
    valid = tuple((min(a, size), min(b, size)) for (a, b), size in zip(ranges, shape))
    out.append(Block(tuple(sorted(holders[index])), index, ranges, valid))
  return tuple(out)


def _shard_index(coords: dict[str, int], axes: tuple[str, ...], mesh: dict[str, int]) -> int:
  """The block along a dim split over ``axes`` (major to minor) at these mesh coordinates."""
  if not axes:
    return 0
  return int(np.ravel_multi_index([coords[a] for a in axes], [mesh[a] for a in axes]))


def _title(lay: Layout) -> str:
  mesh = ", ".join(f"{k}={v}" for k, v in lay.mesh_shape.items())
  shape = "[" + ", ".join(map(str, lay.shape)) + "]"
  block = "[" + ", ".join(map(str, lay.block_shape)) + "]"
  return f"{shape} as {lay.spec} on mesh ({mesh}): blocks of {block}"


def _ids(devices: tuple[int, ...]) -> str:
  return ",".join(map(str, devices))


CELL_H, TOP = 58, 28


def _draw(lay: Layout) -> str:
  """A grid of blocks: columns split the last dim, rows the dims before it (row-major); each
  cell names its devices and rows, padding hatched at its right (last dim) / bottom."""
  rank = len(lay.shape)
  counts = [max(b.index[d] for b in lay.blocks) + 1 for d in range(rank)]
  cols = counts[-1] if rank else 1
  cell_w = max([132.0] + [svg.width_of(_rows(b)) + 12 for b in lay.blocks])
  body = [svg.text(4, 16, _title(lay), font_weight="bold")]
  for k, b in enumerate(lay.blocks):
    row = int(np.ravel_multi_index(b.index[:-1], counts[:-1])) if rank > 1 else 0
    col = b.index[-1] if rank else 0
    x, y = 4 + col * cell_w, TOP + row * CELL_H
    body.append(_cell(b, x, y, cell_w - 4, svg.PALETTE[k % len(svg.PALETTE)], rank))
  rows = math.prod(counts[:-1]) if rank > 1 else 1
  width = max(8 + cols * cell_w, svg.width_of(_title(lay)) + 8)
  return svg.document(width, TOP + rows * CELL_H + 6, body)


def _rows(b: Block) -> str:
  return "[" + ", ".join(f"{a}:{z}" for a, z in b.valid) + "]"


def _cell(b: Block, x: float, y: float, w: float, fill: str, rank: int) -> str:
  h = CELL_H - 4
  sizes = [z - a for a, z in b.ranges]
  kept = [z - a for a, z in b.valid]
  right = w * b.padding[-1] / sizes[-1] if rank else 0.0
  down = h * (1 - math.prod(k / n for k, n in zip(kept[:-1], sizes[:-1]))) if rank > 1 else 0.0
  rows = _rows(b)
  parts = [svg.rect(x, y, w, h, fill, title=f"devices {_ids(b.devices)}: {rows}", stroke="#555")]
  if right:
    parts.append(svg.rect(x + w - right, y, right, h, svg.PADDING_FILL, class_="padding"))
  if down:
    parts.append(svg.rect(x, y + h - down, w - right, down, svg.PADDING_FILL, class_="padding"))
  parts.append(svg.text(x + 4, y + 15, f"dev {_ids(b.devices)}"))
  parts.append(svg.text(x + 4, y + 30, rows))
  if any(b.padding):
    parts.append(svg.text(x + 4, y + 45, "pad " + ",".join(map(str, b.padding))))
  return svg.group(parts, class_="block", data_devices=_ids(b.devices),
                   data_ranges=";".join(f"{a}:{z}" for a, z in b.ranges),
                   data_valid=";".join(f"{a}:{z}" for a, z in b.valid))
