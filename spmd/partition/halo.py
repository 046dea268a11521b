"""Halo exchange for windowed ops (conv, reduce_window, pad, strided slice) along sharded dims.

Per windowed dim (input size N on n shards of S = ceil(N/n) rows; window w, stride s, window
dilation wd, base dilation bd, padding lo/hi): in padded-dilated coordinates output row o reads
positions [o*s, o*s + D), D = 1 + (w-1)*wd. Shard i makes output rows [i*Wc, (i+1)*Wc),
Wc = ceil(W/n), so it needs input rows floor((i*Wc*s - lo)/bd) .. ceil((P1 - lo)/bd) with
P1 = i*Wc*s + s*(Wc-1) + D. The static maxima over shards of what lies left and right of the
shard's own rows are the halos, fetched from neighbours with ppermute (several hops when a halo
is wider than a shard). Rows outside the array are set to the op's pad value, the buffer is
dilated locally, and each shard slices its span at an offset linear in its index; the op then
runs with no padding and no base dilation.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from spmd.partition.devices import permute
from spmd.partition.sharding import Axes, MeshShape


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
    return Window(self.size, self.out, self.window, self.stride, self.lo, self.hi,
                  self.base_dilation, self.window_dilation, shards)


@dataclass(frozen=True)
class Halo:
  """The exchange along one sharded dim of one operand: ``left``/``right`` rows come from
  neighbours (several ppermute hops when wider than a shard). Shard i's span starts at position
  floor((a*i + b)/c)*e + f of the array's padded-dilated coordinates (row r at r*dilation) and
  is ``length`` positions long."""

  operand: int
  dim: int
  axes: Axes
  size: int
  shards: int
  left: int
  right: int
  length: int
  first: tuple[int, int, int, int, int]
  dilation: int = 1

  @property
  def block(self) -> int:
    return -(-self.size // self.shards)

  def first_position(self, shard: Any) -> Any:
    a, b, c, e, f = self.first
    return (a * shard + b) // c * e + f

  def hop_rows(self, width: int) -> list[int]:
    """Rows carried by hop 1, 2, ... to cover ``width`` rows of halo."""
    rows, out = width, []
    while rows > 0:
      out.append(min(rows, self.block))
      rows -= self.block
    return out

  def start(self, shard: Any) -> Any:
    """Where this shard's span begins in its dilated halo buffer (which starts with
    ``dilation - 1`` pad positions: a span may begin in the hole before its first row)."""
    return (self.first_position(shard) - (self.block * shard - self.left) * self.dilation
            + self.dilation - 1)


def _halo(operand: int, dim: int, axes: Axes, size: int, shards: int, length: int,
          first: tuple[int, int, int, int, int], dilation: int, active: int) -> Halo | None:
  """Measures the halo the first ``active`` shards need; None when it is as wide as the rest of
  the array (gathering moves no more)."""
  probe = Halo(operand, dim, axes, size, shards, 0, 0, length, first, dilation)
  block = probe.block
  left = right = 0
  for i in range(active):
    pos = probe.first_position(i)
    left = max(left, block * i - -(-pos // dilation))
    right = max(right, -(-(pos + length) // dilation) - block * (i + 1))
  if left + right >= (shards - 1) * block:
    return None
  return Halo(operand, dim, axes, size, shards, left, right, length, first, dilation)


def plan_halo(operand: int, dim: int, axes: Axes, window: Window, shards: int) -> Halo | None:
  """Shard i makes output rows [i*Wc, (i+1)*Wc): its span starts at i*Wc*s - lo."""
  w = window.on(shards)
  active = min(shards, -(-w.out // w.block_out))
  return _halo(operand, dim, axes, w.size, shards, w.span, (w.stride * w.block_out, 0, 1, 1, -w.lo),
               w.base_dilation, active)


def plan_scatter_halos(dim: int, axes: Axes, window: Window,
                       shards: int) -> tuple[Halo, Halo, int] | None:
  """select_and_scatter_add(source, operand): shard i makes operand rows [S*i, S*(i+1)), which
  windows floor((S*i + lo - w + 1)/s) .. + K cover. Returns the source halo (K windows), the
  operand halo (the rows those windows read) and K; None when either is too wide."""
  n, w, s, lo = window.size, window.window, window.stride, window.lo
  block = -(-n // shards)
  first = (block, lo - w + 1, s, 1, 0)  # in windows
  count = 0
  for i in range(min(shards, -(-n // block))):
    o0 = (block * i + lo - w + 1) // s
    last = (block * (i + 1) - 1 + lo) // s
    count = max(count, last - o0 + 1, -(-(block * (i + 1) + lo - w) // s) - o0 + 1)
  active = min(shards, -(-n // block))
  source = _halo(0, dim, axes, window.out, shards, count, first, 1, active)
  operand = _halo(1, dim, axes, n, shards, s * (count - 1) + w, (block, lo - w + 1, s, s, -lo), 1,
                  active)
  if source is None or operand is None:
    return None
  return source, operand, count


@dataclass(frozen=True)
class Mirror:
  """rev along a dim split evenly: shard i takes shard n-1-i's block (then reverses it)."""

  operand: int
  dim: int
  axes: Axes
  size: int
  shards: int

  @property
  def block(self) -> int:
    return self.size // self.shards

  @property
  def length(self) -> int:
    return self.block


def plan_mirror(operand: int, dim: int, axes: Axes, size: int, shards: int) -> Mirror | None:
  """Uneven blocks do not mirror onto blocks: those are gathered instead."""
  return Mirror(operand, dim, axes, size, shards) if size % shards == 0 else None


Hop = tuple[int, int, Axes, int, str, int, int]  # dim, shards, axes, block, side, hop, rows


def hops(halo: Halo | Mirror) -> list[Hop]:
  """Every ppermute of the exchange: rows from the shard ``hop`` places to the left (they end
  the sender's block) or to the right (they start it), or the mirrored shard's whole block."""
  base = (halo.dim, halo.shards, halo.axes, halo.block)
  if isinstance(halo, Mirror):
    return [base + ("mirror", 0, halo.block)]
  return ([base + ("left", hop, rows) for hop, rows in enumerate(halo.hop_rows(halo.left), 1)]
          + [base + ("right", hop, rows) for hop, rows in enumerate(halo.hop_rows(halo.right), 1)])


def geometry(halo: Halo | Mirror) -> tuple:
  """What the widened buffer depends on (the operand index aside)."""
  if isinstance(halo, Mirror):
    return ("mirror", halo.dim, halo.axes, halo.size, halo.shards)
  return (halo.dim, halo.axes, halo.size, halo.shards, halo.left, halo.right, halo.length,
          halo.first, halo.dilation)


def mirror(x: jax.Array, m: Mirror, mesh: MeshShape, received: dict, prefix: tuple) -> jax.Array:
  """The mirrored shard's block (received once per buffer, as halo pieces are)."""
  (hop,) = hops(m)
  key = prefix + hop
  if key not in received:
    received[key] = permute(x, m.axes, [(j, m.shards - 1 - j) for j in range(m.shards)], mesh)
  return received[key]


def halo_piece(value: Any, read: Any, chain: tuple, hop: tuple) -> tuple:
  """Identifies a received halo piece: the same piece of the same buffer (a value in one form,
  widened by the same earlier halos) is exchanged once."""
  return (value, read, chain) + hop


def exchange(x: jax.Array, halo: Halo, shard: Any, pad_value: Any, mesh: MeshShape,
             received: dict, prefix: tuple) -> jax.Array:
  """This shard's rows with ``left`` rows before and ``right`` after, rows outside the array set
  to ``pad_value``, dilated by the base dilation: the buffer its span is sliced from. Pieces
  already received for the same buffer (``prefix``) are taken from ``received``."""
  d, n = halo.dim, halo.shards

  def fetch(hop: Hop) -> jax.Array:
    key = prefix + hop
    if key not in received:
      side, k, rows = hop[4:]
      if side == "left":
        piece = lax.slice_in_dim(x, x.shape[d] - rows, x.shape[d], axis=d)
        received[key] = permute(piece, halo.axes, [(j, j + k) for j in range(n - k)], mesh)
      else:
        piece = lax.slice_in_dim(x, 0, rows, axis=d)
        received[key] = permute(piece, halo.axes, [(j, j - k) for j in range(k, n)], mesh)
    return received[key]

  every = hops(halo)
  parts = ([fetch(h) for h in reversed(every) if h[4] == "left"] + [x]
           + [fetch(h) for h in every if h[4] == "right"])
  buf = lax.concatenate(parts, d) if len(parts) > 1 else x
  rows = lax.broadcasted_iota(jnp.int32, buf.shape, d) + shard * halo.block - halo.left
  buf = jnp.where((rows >= 0) & (rows < halo.size), buf, pad_value)
  bd = halo.dilation
  if bd > 1:
    config = [(0, 0, 0)] * buf.ndim
    config[d] = (bd - 1, bd - 1, bd - 1)
    buf = lax.pad(buf, jnp.asarray(pad_value, buf.dtype), config)
  return buf


def span(x: jax.Array, halo: Halo, shard: Any, pad_value: Any, mesh: MeshShape, received: dict,
         prefix: tuple) -> jax.Array:
  """The padded-dilated positions this shard's output block reads along the halo dim."""
  buf = exchange(x, halo, shard, pad_value, mesh, received, prefix)
  return lax.dynamic_slice_in_dim(buf, halo.start(shard), halo.length, halo.dim)
