"""Halo exchange on the devices: the ppermutes an exchange's geometry (halo_geometry.py) asks for,
and the buffer each shard cuts its span from.

A windowed dim's buffer is the shard's rows with the received halo rows before and after it, as
far as its span reaches; rows outside the array are set to the op's pad value and the buffer is
dilated locally, so the op then runs with no padding and no base dilation. Every received piece
is keyed by what it is (the value, its form, the halos that widened it before, the hop), so a
piece two ops need is exchanged once.
"""
from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
from jax import lax

from spmd.partition.devices import permute
from spmd.partition.halo_geometry import Halo, Hop, Mirror, Rotation, halo_piece, hops
from spmd.partition.key_arrays import over_key_data
from spmd.partition.sharding import MeshShape


def _receive(piece: jax.Array, hop: Hop, mesh: MeshShape, received: dict, prefix: tuple
             ) -> jax.Array:
  key = halo_piece(*prefix, hop)
  if key not in received:
    received[key] = permute(piece, hop.axes, hop.pairs, mesh)
  return received[key]


def mirror(x: jax.Array, m: Mirror, mesh: MeshShape, received: dict, prefix: tuple) -> jax.Array:
  """The mirrored shard's block."""
  (hop,) = hops(m)
  return _receive(x, hop, mesh, received, prefix)


@over_key_data
def rotate(x: jax.Array, r: Rotation, shard: Any, mesh: MeshShape, received: dict,
           prefix: tuple, pad_value: Any = 0) -> jax.Array:
  """This shard's rows of the rolled dim: the pieces of the shards they rotate from (each sender
  cuts the piece its receiver needs), in the order ``positions`` reads them; rows outside the
  array are ``pad_value``."""
  parts = []
  for hop in r.pieces:
    starts = set(hop.starts)
    start = hop.starts[0] if len(starts) == 1 else jnp.asarray(hop.starts, jnp.int32)[shard]
    piece = lax.dynamic_slice_in_dim(x, start, hop.rows, r.dim)
    parts.append(_receive(piece, hop, mesh, received, prefix) if hop.routes else piece)
  buf = lax.concatenate(parts, r.dim) if len(parts) > 1 else parts[0]
  if r.positions is None:
    return buf
  positions = jnp.asarray(r.positions, jnp.int32)[shard]
  out = jnp.take(buf, jnp.maximum(positions, 0), axis=r.dim)
  if not r.padded:
    return out
  inside = lax.broadcast_in_dim(positions >= 0, out.shape, (r.dim,))
  return jnp.where(inside, out, jnp.asarray(pad_value, out.dtype))


def exchange(x: jax.Array, halo: Halo, shard: Any, pad_value: Any, mesh: MeshShape,
             received: dict, prefix: tuple) -> jax.Array:
  """This shard's rows with ``before`` rows before and ``after`` after, those outside the array
  set to ``pad_value``: the buffer its span is cut from (``cut``)."""
  d = halo.dim

  pad = jnp.asarray(pad_value, x.dtype)

  def fetch(hop: Hop) -> jax.Array:
    if hop.side == "left":
      end = x.shape[d] - hop.skip
      piece = lax.slice_in_dim(x, end - hop.rows, end, axis=d)
    else:
      piece = lax.slice_in_dim(x, hop.skip, hop.skip + hop.rows, axis=d)
    return _receive(piece, hop, mesh, received, prefix)

  def unsent(rows: int) -> list[jax.Array]:
    """The skipped halo rows, which no span reads: pad."""
    shape = list(x.shape)
    shape[d] = rows
    return [jnp.full(shape, pad)] if rows else []

  every = hops(halo)
  parts = ([fetch(h) for h in reversed(every) if h.side == "left"] + unsent(halo.skip_left)
           + [x] + unsent(halo.skip_right) + [fetch(h) for h in every if h.side == "right"])
  buf = lax.concatenate(parts, d) if len(parts) > 1 else x
  if halo.before > halo.left or halo.after > halo.right:  # the span reaches past the array
    config = [(0, 0, 0)] * buf.ndim
    config[d] = (halo.before - halo.left, halo.after - halo.right, 0)
    buf = lax.pad(buf, pad, config)
  rows = lax.broadcasted_iota(jnp.int32, buf.shape, d) + shard * halo.block - halo.before
  return jnp.where((rows >= 0) & (rows < halo.size), buf, pad)


def cut(buf: jax.Array, halo: Halo, shard: Any, pad_value: Any) -> jax.Array:
  """The padded-dilated positions this shard's output block reads, from its ``exchange``
  buffer: dilated by the base dilation, then sliced."""
  if halo.dilation > 1:
    config = [(0, 0, 0)] * buf.ndim
    config[halo.dim] = (halo.dilation - 1,) * 3
    buf = lax.pad(buf, jnp.asarray(pad_value, buf.dtype), config)
  return lax.dynamic_slice_in_dim(buf, halo.start(shard), halo.length, halo.dim)


@over_key_data
def span(x: jax.Array, halo: Halo | Rotation, shard: Any, pad_value: Any, mesh: MeshShape,
         received: dict, prefix: tuple) -> jax.Array:
  """The padded-dilated positions this shard's output block reads along the halo dim (a
  Rotation: cut from the blocks they lie in, all inside the array); a base-dilated dim's
  undilated buffer (its ``exchange``), which the caller ``cut``s once the other dims are
  exchanged, so that they send its rows undilated, as XLA does."""
  if isinstance(halo, Rotation):
    return rotate(x, halo, shard, mesh, received, prefix, pad_value)
  buf = exchange(x, halo, shard, pad_value, mesh, received, prefix)
  return buf if halo.dilation > 1 else cut(buf, halo, shard, pad_value)
