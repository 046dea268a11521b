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
  block i + ``distance`` cyclically starting at row ``starts[sender]`` ("rotate"; distance 0 and
  no ``routes``: a block's own rows, not sent), from the blocks ``routes`` pair it with, at
  several distances, starting at row ``starts[sender]`` ("route"), or block ``shards - 1 - i``
  whole ("mirror"). ``routes``, where given, are the only (sender, receiver) blocks it
  connects."""

  dim: int
  shards: int
  axes: Axes
  block: int
  side: str
  distance: int
  rows: int
  starts: tuple[int, ...] = ()
  skip: int = 0
  routes: tuple[tuple[int, int], ...] = ()

  @property
  def pairs(self) -> list[tuple[int, int]]:
    """(sender, receiver) blocks."""
    if self.routes:
      return list(self.routes)
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
  (one without routes: its own rows, no exchange); ``positions[i][r]`` is the row of the
  pieces, concatenated in order, that its row r is, -1 for a row outside the array, which holds
  the op's pad value (None: they are its block in order, as for a roll of an evenly split dim).
  ``joined``: the block rows of a concatenate's operands, whose blocks, concatenated, are each
  shard's block here (``plan_concatenation``; ``operand`` is then 0)."""

  operand: int
  dim: int
  axes: Axes
  size: int
  shards: int
  pieces: tuple[Hop, ...]
  positions: tuple[tuple[int, ...], ...] | None
  length: int
  joined: tuple[int, ...] = ()

  @property
  def block(self) -> int:
    return -(-self.size // self.shards)

  @property
  def padded(self) -> bool:
    """Some shard's rows lie outside the array."""
    return self.positions is not None and any(p < 0 for mine in self.positions for p in mine)


@dataclass(frozen=True)
class _Run:
  """Rows [row, row + rows) of block ``sender``, which are rows [at, at + rows) of block
  ``receiver``'s span."""

  receiver: int
  sender: int
  row: int
  rows: int
  at: int


@dataclass(frozen=True)
class _Segment:
  """Rows [first, first + rows) of the dim, which are rows [at, at + rows) of a shard's span."""

  at: int
  first: int
  rows: int


def _runs(segments: list[list[_Segment]], block: int) -> list[_Run]:
  """The runs of rows of one block each shard's ``segments`` are."""
  runs = []
  for i, mine in enumerate(segments):
    for seg in mine:
      at, first, left = seg.at, seg.first, seg.rows
      while left > 0:
        j, row = divmod(first, block)
        n = min(left, block - row)
        runs.append(_Run(i, j, row, n, at))
        at, first, left = at + n, first + n, left - n
  return runs


def _own_and_sent(runs: list[_Run]) -> tuple[list[_Run], list[_Run]]:
  """Each block's first run of its own rows (not sent), and the other runs."""
  own: dict[int, _Run] = {}
  sent = []
  for r in runs:
    if r.sender == r.receiver and r.receiver not in own:
      own[r.receiver] = r
    else:
      sent.append(r)
  return list(own.values()), sent


def _rounds(runs: list[_Run], shards: int) -> list[list[_Run]]:
  """``runs`` in ppermutes, each sending at most one run from a block and one into it: a
  rotation per distance, or, where that moves more rows, distances merged, the longest runs
  first, each in the first ppermute its sender and receiver are free in (shorter runs ride in
  ppermutes longer ones pay for)."""
  def first_fit(ordered: list[_Run]) -> list[list[_Run]]:
    rounds: list[list[_Run]] = []
    busy: list[tuple[set[int], set[int]]] = []  # per round: its senders, its receivers
    for run in ordered:
      k = next((k for k, (senders, receivers) in enumerate(busy)
                if run.sender not in senders and run.receiver not in receivers), len(rounds))
      if k == len(rounds):
        rounds.append([])
        busy.append((set(), set()))
      rounds[k].append(run)
      busy[k][0].add(run.sender)
      busy[k][1].add(run.receiver)
    return rounds

  by_distance: dict[int, list[_Run]] = {}
  for r in runs:
    by_distance.setdefault((r.sender - r.receiver) % shards, []).append(r)
  rotations = [g for group in by_distance.values() for g in first_fit(group)]
  merged = first_fit(sorted(runs, key=lambda r: -r.rows))
  return merged if _rows(merged) < _rows(rotations) else rotations


def _rows(rounds: list[list[_Run]]) -> int:
  """The rows the ppermutes of ``rounds`` send: each as many as its longest run."""
  return sum(max(r.rows for r in each) for each in rounds)


def _hop(runs: list[_Run], dim: int, shards: int, axes: Axes, block: int, sent: bool) -> Hop:
  """The ppermute (``sent``; else a block's own rows) carrying ``runs``: as long as the longest,
  each sender cutting its run at its receiver's offset (a shorter run's piece starts earlier
  where it would end past the block)."""
  rows = max(r.rows for r in runs)
  starts = {r.sender: min(r.row, block - rows) for r in runs}
  default = next(iter(starts.values()))
  distances = {(r.sender - r.receiver) % shards for r in runs}
  distance = next(iter(distances)) if len(distances) == 1 else 0
  routes = tuple(sorted((r.sender, r.receiver) for r in runs)) if sent else ()
  return Hop(dim, shards, axes, block, "rotate" if len(distances) == 1 else "route", distance,
             rows, tuple(starts.get(j, default) for j in range(shards)), routes=routes)


def _plan_pieces(operand: int, dim: int, axes: Axes, size: int, shards: int,
                 segments: list[list[_Segment]], length: int) -> Rotation:
  """Shard i's span of ``length`` rows holds the rows ``segments[i]`` of the dim (the others are
  outside the array, or past its block's end, left unread): its own rows are one piece, the
  runs of other shards' rows are sent in ppermutes (``_rounds``)."""
  block = -(-size // shards)
  runs = _runs(segments, block)
  own, sent = _own_and_sent(runs)
  order = {id(r): k for k, r in enumerate(runs)}
  groups = sorted(([(own, False)] if own else []) + [(g, True) for g in _rounds(sent, shards)],
                  key=lambda group: min(order[id(r)] for r in group[0]))  # as the rows read them
  pieces, positions, base = [], [[-1] * length for _ in segments], 0
  for group, is_sent in groups:
    hop = _hop(group, dim, shards, axes, block, is_sent)
    for r in group:
      start = base + r.row - hop.starts[r.sender]
      positions[r.receiver][r.at:r.at + r.rows] = range(start, start + r.rows)
    pieces.append(hop)
    base += hop.rows
  identity = all(p == list(range(length)) for p in positions)
  return Rotation(operand, dim, axes, size, shards, tuple(pieces),
                  None if identity else tuple(map(tuple, positions)), length)


def plan_rotation(operand: int, dim: int, axes: Axes, size: int, shards: int,
                  shift: int) -> Rotation:
  """Each shard's result rows rotate from runs of rows of one or two (uneven: a few) shards."""
  block = -(-size // shards)
  segments = []
  for i in range(shards):
    lo, hi = block * i, min(block * (i + 1), size)  # result rows lo..hi-1: rows o - shift
    first = (lo - shift) % size
    head = min(hi - lo, size - first)  # up to the dim's end, then from its start
    segments.append([_Segment(0, first, head)] + ([_Segment(head, 0, hi - lo - head)]
                                                  if hi - lo > head else []))
  return _plan_pieces(operand, dim, axes, size, shards, segments, block)


def plan_concatenation(dim: int, axes: Axes, sizes: tuple[int, ...], shards: int) -> Rotation:
  """A concatenate's result blocks along its sharded concatenated dim, of operands of ``sizes``
  rows there, cut from each shard's operand blocks concatenated: one exchange for them all, in
  which a ppermute carries runs of any operand (each sender sends one)."""
  blocks = tuple(-(-n // shards) for n in sizes)
  width, length = sum(blocks), -(-sum(sizes) // shards)
  segments: list[list[_Segment]] = [[] for _ in range(shards)]
  offset = 0  # of operand k in the result
  for k, (n, block) in enumerate(zip(sizes, blocks)):
    for j in range(-(-n // block)):  # operand k's block j: its rows are the result's rows
      rows = range(offset + block * j, offset + min(block * (j + 1), n))
      while rows:
        i, at = divmod(rows.start, length)
        take = min(len(rows), length - at)
        segments[i].append(_Segment(at, j * width + sum(blocks[:k]) + rows.start - offset
                                    - block * j, take))
        rows = rows[take:]
    offset += n
  for mine in segments:
    mine.sort(key=lambda seg: seg.at)
  rotation = _plan_pieces(0, dim, axes, width * shards, shards, segments, length)
  return dataclasses.replace(rotation, joined=blocks)


def plan_window(operand: int, dim: int, axes: Axes, window: Window,
                shards: int) -> Halo | Rotation | None:
  """The halo of a windowed dim, or, where it is undilated, the spans cut from the blocks they
  read at each shard's own offset (rows outside the array as pad), if that moves fewer rows (a
  slice whose result blocks start at a different offset in each input block: the halo carries
  the widest reach for every shard, the pieces each shard's rows alone, as XLA does)."""
  halo = plan_halo(operand, dim, axes, window, shards)
  if halo is None or halo.dilation != 1:
    return halo
  segments = []
  for i in range(min(shards, -(-window.out // window.on(shards).block_out))):
    first = halo.first(i)
    lo, hi = max(first, 0), min(first + halo.length, halo.size)
    segments.append([_Segment(lo - first, lo, hi - lo)] if lo < hi else [])
  segments += [[]] * (shards - len(segments))
  _, sent = _own_and_sent(_runs(segments, halo.block))
  if not any(segments) or _rows(_rounds(sent, shards)) >= sum(h.rows for h in hops(halo)):
    return halo
  return _plan_pieces(operand, dim, axes, halo.size, shards, segments, halo.length)


Exchange = Halo | Mirror | Rotation


def joint(x: Exchange) -> bool:
  """Whether the exchange is a concatenate's, cut from all its operands' blocks concatenated."""
  return isinstance(x, Rotation) and bool(x.joined)


def halo_piece(value: Any, read: Any, chain: tuple, hop: Hop) -> tuple:
  """Identifies a received piece: the same piece of the same buffer (a value in one form, widened
  by the same earlier exchanges) is exchanged once."""
  return (value, read, chain, hop)


def hops(x: Exchange) -> list[Hop]:
  """Every ppermute of the exchange: rows from the shard ``distance`` places to the left (they
  end the sender's block) or to the right (they start it), the mirrored shard's whole block, or
  the pieces a rotation takes from other shards."""
  if isinstance(x, Rotation):
    return [h for h in x.pieces if h.routes]
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
