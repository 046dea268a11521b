"""Halo geometry: which rows of its neighbours each shard of a windowed dim needs (pure data).

Per windowed dim (input size N on n shards of S = ceil(N/n) rows; window w, stride s, window
dilation wd, base dilation bd, padding lo/hi): in padded-dilated coordinates output row o reads
positions [o*s, o*s + D), D = 1 + (w-1)*wd. Shard i makes output rows [i*Wc, (i+1)*Wc),
Wc = ceil(W/n), so it reads positions [i*Wc*s - lo, i*Wc*s - lo + s*(Wc-1) + D): input rows
ceil((i*Wc*s - lo)/bd) .. ceil((i*Wc*s - lo + s*(Wc-1) + D)/bd) - 1. The static maxima over shards
of the rows inside the array that lie left and right of the shard's own rows are the halos,
fetched from neighbours (several hops when a halo is wider than a shard); the shard's buffer
reaches as far as its span does, rows outside the array holding the op's pad value.

``rev`` takes the mirrored shard's block (``Mirror``; on uneven blocks, then rotated into place);
``roll`` takes its rows from the one or
two shards its rows rotate from (``Rotation``). halo.py carries these exchanges out.
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Any

from spmd.partition.sharding import Axes


@dataclass(frozen=True)
class Window:
  """How an op reads one dim of one operand; ``out`` is the result's size along it."""

  size: int
  out: int
  window: int = 1
  stride: int = 1
  lo: int = 0
  hi: int = 0
  base_dilation: int = 1
  window_dilation: int = 1

  shards: int = 1

  @property
  def span(self) -> int:
    """Padded-dilated positions one shard's output block reads: s*(Wc-1) + D."""
    return self.stride * (self.block_out - 1) + 1 + (self.window - 1) * self.window_dilation

  @property
  def block_out(self) -> int:
    return -(-self.out // self.shards)

  def on(self, shards: int) -> Window:
    return dataclasses.replace(self, shards=shards)


@dataclass(frozen=True)
class Start:
  """Where shard i's span starts in padded-dilated positions (row r at r*dilation):
  floor((scale*i + offset) / divisor) * stride + shift."""

  scale: int
  offset: int = 0
  divisor: int = 1
  stride: int = 1
  shift: int = 0

  def __call__(self, shard: Any) -> Any:
    return (self.scale * shard + self.offset) // self.divisor * self.stride + self.shift


@dataclass(frozen=True)
class Hop:
  """One ppermute of an exchange along dim ``dim`` split in ``shards`` blocks of ``block`` rows:
  block i receives ``rows`` rows from block i - ``distance`` (``side`` "left": the sender's last
  rows but ``skip``), from block i + ``distance`` ("right": its first rows after ``skip``), from
  block i + ``distance`` cyclically starting at row ``starts[sender]`` ("rotate"), or block
  ``shards - 1 - i`` whole ("mirror")."""

  dim: int
  shards: int
  axes: Axes
  block: int
  side: str
  distance: int
  rows: int
  starts: tuple[int, ...] = ()
  skip: int = 0

  @property
  def pairs(self) -> list[tuple[int, int]]:
    """(sender, receiver) blocks."""
    n, k = self.shards, self.distance
    if self.side == "mirror":
      return [(j, n - 1 - j) for j in range(n)]
    if self.side == "left":
      return [(j, j + k) for j in range(n - k)]
    if self.side == "right":
      return [(j, j - k) for j in range(k, n)]
    return [(j, (j - k) % n) for j in range(n)]

  def sent_rows(self, length: int) -> tuple[int, int] | None:
    """The rows [start, stop) every sender sends of its block of ``length`` rows along ``dim``
    (None for a rotation whose senders start at different rows)."""
    if self.side == "left":
      return length - self.skip - self.rows, length - self.skip
    if self.side == "right":
      return self.skip, self.skip + self.rows
    if self.side == "mirror":
      return 0, length
    if len(set(self.starts)) > 1:
      return None
    return self.starts[0], self.starts[0] + self.rows


@dataclass(frozen=True)
class Halo:
  """The exchange along one sharded dim of one operand: ``left``/``right`` rows come from
  neighbours (several hops when wider than a shard); the shard's buffer holds ``before`` rows
  before its own and ``after`` after (those past the received ones lie outside the array); the
  ``skip_left`` / ``skip_right`` halo rows next to its block no span reads are not sent (a window
  starting past the shard's own rows, as a shift by more than a block does). Shard i's span
  starts at position ``first(i)`` of the padded-dilated coordinates and is ``length`` positions
  long."""

  operand: int
  dim: int
  axes: Axes
  size: int
  shards: int
  left: int
  right: int
  before: int
  after: int
  length: int
  first: Start
  dilation: int = 1
  skip_left: int = 0
  skip_right: int = 0

  @property
  def block(self) -> int:
    return -(-self.size // self.shards)

  @property
  def buffer_rows(self) -> int:
    """The rows of a shard's undilated buffer (halo.py's ``exchange``)."""
    return self.before + self.block + self.after

  def hop_rows(self, width: int, skip: int = 0) -> list[tuple[int, int, int]]:
    """(distance, rows, skip) of each hop carrying halo rows [skip, width), counted from the
    block's edge: hop k covers rows [(k-1)*block, k*block); a hop of skipped rows only is none."""
    out = []
    for k in range(1, -(-width // self.block) + 1):
      near, far = max(skip, (k - 1) * self.block), min(width, k * self.block)
      if near < far:
        out.append((k, far - near, near - (k - 1) * self.block))
    return out

  def uncovered(self) -> tuple[int, int]:
    """The most rows of a shard's own block before and after its span (undilated): a strided
    window's gradient leaves rows between windows, which its span need not reach."""
    shards = range(-(-self.size // self.block))
    return (max(0, *(self.first(i) - self.block * i for i in shards)),
            max(0, *(self.block * (i + 1) - self.first(i) - self.length for i in shards)))

  def start(self, shard: Any) -> Any:
    """Where this shard's span begins in its dilated buffer (which starts with ``dilation - 1``
    pad positions: a span may begin in the hole before its first row)."""
    return (self.first(shard) - (self.block * shard - self.before) * self.dilation
            + self.dilation - 1)


def _halo(operand: int, dim: int, axes: Axes, size: int, shards: int, length: int, first: Start,
          dilation: int, active: int,
          needed: list[tuple[int, int]] | None = None) -> Halo | None:
  """Measures the halo the first ``active`` shards need: the rows inside the array their spans
  reach, or only ``needed[i]`` (rows [lo, hi)) of shard i's span, the rest of it being pad. None
  when it would move more than gathering the dim (all of its blocks)."""
  block = -(-size // shards)
  left = right = before = after = 0
  skips_left, skips_right = [block * shards], [block * shards]
  for i in range(active):
    lo, hi = -(-first(i) // dilation), -(-(first(i) + length) // dilation)
    before, after = max(before, block * i - lo), max(after, hi - block * (i + 1))
    lo, hi = needed[i] if needed is not None else (max(lo, 0), min(hi, size))
    if lo < hi:
      left, right = max(left, block * i - lo), max(right, hi - block * (i + 1))
      if lo < block * i:
        skips_left.append(block * i - min(hi, block * i))
      if hi > block * (i + 1):
        skips_right.append(max(lo, block * (i + 1)) - block * (i + 1))
  if left + right > shards * block:
    return None
  return Halo(operand, dim, axes, size, shards, left, right, max(before, left),
              max(after, right), length, first, dilation, min(min(skips_left), left),
              min(min(skips_right), right))


def plan_halo(operand: int, dim: int, axes: Axes, window: Window, shards: int) -> Halo | None:
  """Shard i makes output rows [i*Wc, (i+1)*Wc): its span starts at i*Wc*s - lo."""
  w = window.on(shards)
  active = min(shards, -(-w.out // w.block_out))
  return _halo(operand, dim, axes, w.size, shards, w.span, Start(w.stride * w.block_out,
                                                                  shift=-w.lo),
               w.base_dilation, active)


def plan_scatter_halos(dim: int, axes: Axes, window: Window,
                       shards: int) -> tuple[Halo, Halo, int] | None:
  """select_and_scatter_add(source, operand): shard i makes operand rows [S*i, S*(i+1)), which
  the windows from c = ceil((S*i + lo - w + 1)/s) to floor((S*(i+1) - 1 + lo)/s) touch (none when
  the block lies between two windows strided apart). Every shard runs the K windows from its c,
  K the most any block has; the halos carry only the touching windows' source rows and the
  operand rows they read, the rest of the spans is pad (a window touching none of the shard's
  rows scatters nowhere it keeps). Returns the source halo, the operand halo and K; None when
  either is too wide."""
  n, out, w, s, lo = window.size, window.out, window.window, window.stride, window.lo
  block = -(-n // shards)
  active = min(shards, -(-n // block))
  first = Start(block, lo - w + s, s)  # ceil((S*i + lo - w + 1) / s)
  touching = [(first(i), min((block * (i + 1) - 1 + lo) // s + 1, out)) for i in range(active)]
  count = max(1, *(end - c for c, end in touching))
  windows = [(max(c, 0), end) for c, end in touching]
  source = _halo(0, dim, axes, out, shards, count, first, 1, active, windows)
  operand = _halo(1, dim, axes, n, shards, s * (count - 1) + w, Start(block, lo - w + s, s, s, -lo),
                  1, active, [(max(c * s - lo, 0), min((end - 1) * s - lo + w, n)) if c < end
                              else (0, 0) for c, end in windows])
  if source is None or operand is None:
    return None
  return source, operand, count


@dataclass(frozen=True)
class Mirror:
  """rev along a sharded dim: shard i takes shard n-1-i's block (then reverses it). ``also``:
  the further evenly split dims (and their shard counts) mirrored by the same permute, whose
  axes follow ``dim``'s in ``axes``: over them all the mirrored block is at the mirrored linear
  index (as XLA permutes a block reversed along several dims once)."""

  operand: int
  dim: int
  axes: Axes
  size: int
  shards: int
  also: tuple[tuple[int, int], ...] = ()

  @property
  def dims(self) -> tuple[int, ...]:
    return (self.dim, *(d for d, _ in self.also))

  @property
  def block(self) -> int:
    return -(-self.size // self.shards)

  @property
  def length(self) -> int:
    return self.block


def plan_reversal(operand: int, dim: int, axes: Axes, size: int,
                  shards: int) -> tuple[Mirror] | tuple[Mirror, Rotation]:
  """The mirrored block; on uneven blocks (padded to P = n*S rows at the end) the mirrored,
  reversed blocks are the padded dim reversed, whose rows sit P - size rows after the result's:
  a rotation back by P - size along the padded (evenly split) dim puts them in place."""
  mirror = Mirror(operand, dim, axes, size, shards)
  padded = shards * mirror.block
  if padded == size:
    return (mirror,)
  return mirror, plan_rotation(operand, dim, axes, padded, shards, size - padded)


def joint_mirrors(exchanges: tuple[Exchange, ...]) -> tuple[Exchange, ...]:
  """``exchanges`` with the mirrors of evenly split dims (no rotation after them) made one
  mirror of them all: one permute of the block rather than one per dim."""
  rotated = {x.dim for x in exchanges if isinstance(x, Rotation)}
  even = [x for x in exchanges if isinstance(x, Mirror) and x.dim not in rotated]
  if len(even) < 2:
    return exchanges
  joint = dataclasses.replace(even[0], axes=tuple(a for m in even for a in m.axes),
                              also=tuple((m.dim, m.shards) for m in even[1:]))
  return tuple(joint if x is even[0] else x for x in exchanges if x not in even[1:])


@dataclass(frozen=True)
class Rotation:
  """Each shard's ``length`` rows taken from runs of rows of other shards' blocks at per-shard
  offsets: roll along a dim (result row o is row (o - shift) mod size), or a window's span cut
  from the blocks it reads (``plan_window``). Shard i receives one piece per hop in ``pieces``
  (distance 0: its own rows, no exchange); ``positions[i][r]`` is the row of the pieces,
  concatenated in order, that its row r is (None: they are its block in order, as for a roll
  of an evenly split dim)."""

  operand: int
  dim: int
  axes: Axes
  size: int
  shards: int
  pieces: tuple[Hop, ...]
  positions: tuple[tuple[int, ...], ...] | None
  length: int

  @property
  def block(self) -> int:
    return -(-self.size // self.shards)


def _plan_pieces(operand: int, dim: int, axes: Axes, size: int, shards: int,
                 sources: list[list[int]], length: int) -> Rotation:
  """Shard i's rows are the rows ``sources[i]`` of the dim (its first ``length`` rows; the rest
  are left unread): a run from the shard ``d`` places after it is piece ``d``, as long as the
  longest such run, each sender cutting it at its receiver's offset."""
  block = -(-size // shards)
  runs: list[list[tuple[int, int, int]]] = []  # per shard: (distance, first row, rows)
  for i, rows_of_i in enumerate(sources):
    mine: list[tuple[int, int, int]] = []
    for source in rows_of_i:
      j, row = divmod(source, block)
      d = (j - i) % shards
      if mine and mine[-1][0] == d and mine[-1][1] + mine[-1][2] == row:
        mine[-1] = (d, mine[-1][1], mine[-1][2] + 1)
      else:
        mine.append((d, row, 1))
    runs.append(mine)
  order = list(dict.fromkeys(d for mine in runs for d, _, _ in mine))
  rows = {d: max(n for mine in runs for e, _, n in mine if e == d) for d in order}
  starts = {d: [0] * shards for d in order}
  for i, mine in enumerate(runs):
    for d, row, _ in mine:
      starts[d][(i + d) % shards] = min(row, block - rows[d])
  base = dict(zip(order, [sum(rows[e] for e in order[:k]) for k in range(len(order))]))
  positions = []
  for i, mine in enumerate(runs):
    mine_positions = [base[d] + row - starts[d][(i + d) % shards] + t
                      for d, row, n in mine for t in range(n)]
    positions.append(tuple(mine_positions + [0] * (length - len(mine_positions))))
  pieces = tuple(Hop(dim, shards, axes, block, "rotate", d, rows[d], tuple(starts[d]))
                 for d in order)
  identity = all(p == tuple(range(length)) for p in positions)
  return Rotation(operand, dim, axes, size, shards, pieces,
                  None if identity else tuple(positions), length)


def plan_rotation(operand: int, dim: int, axes: Axes, size: int, shards: int,
                  shift: int) -> Rotation:
  """Each shard's result rows rotate from runs of rows of one or two (uneven: a few) shards."""
  block = -(-size // shards)
  return _plan_pieces(operand, dim, axes, size, shards,
                      [[(o - shift) % size for o in range(block * i, min(block * (i + 1), size))]
                       for i in range(shards)], block)


def plan_window(operand: int, dim: int, axes: Axes, window: Window,
                shards: int) -> Halo | Rotation | None:
  """The halo of a windowed dim, or, where every span lies inside the array undilated, the
  spans cut from the blocks they read at each shard's own offset, if that moves fewer rows (a
  slice whose result blocks start at a different offset in each input block: the halo carries
  the widest reach for every shard, the pieces each shard's rows alone, as XLA does)."""
  halo = plan_halo(operand, dim, axes, window, shards)
  if halo is None or halo.dilation != 1:
    return halo
  active = range(min(shards, -(-window.out // window.on(shards).block_out)))
  spans = [range(halo.first(i), halo.first(i) + halo.length) for i in active]
  if any(s.start < 0 or s.stop > halo.size for s in spans):
    return halo
  pieces = _plan_pieces(operand, dim, axes, halo.size, shards,
                        [list(s) for s in spans] + [[]] * (shards - len(spans)), halo.length)
  moved = sum(h.rows for h in pieces.pieces if h.distance)
  return pieces if moved < sum(h.rows for h in hops(halo)) else halo


Exchange = Halo | Mirror | Rotation


def halo_piece(value: Any, read: Any, chain: tuple, hop: Hop) -> tuple:
  """Identifies a received piece: the same piece of the same buffer (a value in one form, widened
  by the same earlier exchanges) is exchanged once."""
  return (value, read, chain, hop)


def hops(x: Exchange) -> list[Hop]:
  """Every ppermute of the exchange: rows from the shard ``distance`` places to the left (they
  end the sender's block) or to the right (they start it), the mirrored shard's whole block, or
  the pieces a rotation takes from other shards."""
  if isinstance(x, Rotation):
    return [h for h in x.pieces if h.distance]
  if isinstance(x, Mirror):
    shards = x.shards * math.prod(n for _, n in x.also)
    return [Hop(x.dim, shards, x.axes, x.block, "mirror", 0, x.block)]
  return ([Hop(x.dim, x.shards, x.axes, x.block, "left", k, rows, skip=skip)
           for k, rows, skip in x.hop_rows(x.left, x.skip_left)]
          + [Hop(x.dim, x.shards, x.axes, x.block, "right", k, rows, skip=skip)
             for k, rows, skip in x.hop_rows(x.right, x.skip_right)])


def geometry(x: Exchange) -> Exchange:
  """What the widened buffer depends on: the exchange, the operand index aside."""
  return dataclasses.replace(x, operand=0)
