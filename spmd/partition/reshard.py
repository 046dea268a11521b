"""Sharding A → sharding B as a list of steps: the only place that picks collectives, and where
each step is carried out.

Order (cheapest first, as XLA prefers): pending partial sums are reduced (reduce-scatter where
the target shards that axis, else all-reduce); dims whose axes only change order are permuted;
axes free everywhere are sliced locally (no communication) so later collectives move less;
axes that move from one dim to another are an all-to-all (one for a run of minor axes; an axis
is made the minor axis of its dim first by a collective-permute, as are several axes leaving for
one dim); an axis traded for another of its size in one place of a dim is one
collective-permute (each device takes the block of the device with the two coordinates swapped);
axes that trade dims (P('a', 'b') -> P('b', 'a')) may instead be parked in the dim that
wants them, behind axes that leave it later, where that moves less than gathering them; axes to
drop are all-gathered (a dim keeping axes behind the ones it drops reorders them first by a
collective-permute, where that moves less); finally the remaining axes are sliced locally.
Gathers (reduce-scatters) of distinct dims that follow one another run as one collective over
all their axes (``GatherDims``, ``ScatterDims``).

Each step kind is one record that prices itself and carries itself out: ``buffers`` names the
per-device input and output buffers of its collective (padding included), ``bytes`` is the
larger of the two, and ``apply`` runs the collective on exactly those buffers (the local block
padded to the input buffer, the output cut to the local block of ``after``). So what the plan
counts is what the program moves.

Uneven dims (size N not divisible by the shard count n) are held padded: shard k has rows
[k*S, (k+1)*S), S = ceil(N/n), rows past N are padding. A step that regroups shards is only
taken where the blocks nest exactly (k*S(n) == S(n/k)); otherwise a dim keeping its first axes
realigns its blocks to the kept ones by collective-permutes and gathers the rest (``Realign``),
and any other is gathered whole (padding dropped) and sliced again in one step (padded to n*S
first). Axes that only trade dims, each dim keeping its number of blocks, may move in one
collective-permute of whole blocks (``TradeBlocks``); dims whose new blocks each lie inside one
old block or are several whole old ones (or both, along different dims) by collective-permutes
of the pieces each device lacks (``ExchangePieces``, ``sub_blocks``).
"""
from __future__ import annotations

import abc
import functools
import itertools
import math
from dataclasses import InitVar, dataclass, field
from typing import Any, Callable, ClassVar, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from spmd.partition.devices import permute, shard_index
from spmd.partition.key_arrays import over_key_data
from spmd.partition.rounds import into_rounds, rounds_needed
from spmd.partition.sharding import Axes, MeshShape, TensorSharding, axes_size

Shape = Sequence[int]


@dataclass(frozen=True, kw_only=True)
class ReshardStep(abc.ABC):
  """One step on a tensor of global shape ``shape``: ``before`` → ``after`` over mesh ``axes``,
  acting on dim ``dim``. ``bytes`` is per device: what it ``moved`` at ``itemsize`` bytes per
  element, in ``collectives`` instructions (0 and 0 for a step that does not communicate)."""

  kind: ClassVar[str]
  communicates: ClassVar[bool] = True
  axes: Axes
  before: TensorSharding
  after: TensorSharding
  dim: int | None = None
  bytes: int = field(init=False)
  collectives: int = field(init=False)
  shape: InitVar[Shape]
  itemsize: InitVar[int]
  mesh: InitVar[MeshShape]

  def __post_init__(self, shape: Shape, itemsize: int, mesh: MeshShape) -> None:
    # collectives first: what a step moves may be a piece per round
    object.__setattr__(self, "collectives", self.rounds(shape, mesh) if self.communicates else 0)
    object.__setattr__(self, "bytes", self.moved(shape, mesh) * itemsize if self.communicates
                       else 0)

  def rounds(self, shape: Shape, mesh: MeshShape) -> int:
    """The collectives a communicating step runs, each moving ``bytes / collectives``."""
    return 1

  def moved(self, shape: Shape, mesh: MeshShape) -> int:
    """Elements the step moves per device: the larger of its ``buffers``."""
    src, out = self.buffers(shape, mesh)
    return max(math.prod(src), math.prod(out))

  def sent(self, mesh: MeshShape) -> int:
    """Bytes this device sends: a collective-permute sends its whole buffer, a collective over
    a group of k devices (k-1)/k of it (twice that for an all-reduce), as in a ring; what the
    step costs a link, where ``bytes`` is the buffer size XLA's HLO shows."""
    if self.kind == "collective-permute":
      return self.bytes
    k = self.count(mesh)
    return self.bytes * (k - 1) * (2 if self.kind == "all-reduce" else 1) // k

  def count(self, mesh: MeshShape) -> int:
    """Devices along ``axes``: the blocks the step combines or splits."""
    return math.prod(mesh[a] for a in self.axes)

  @property
  def axis_name(self) -> str | Axes:
    """``axes`` as a collective names them."""
    return self.axes if len(self.axes) > 1 else self.axes[0]

  def buffers(self, shape: Shape, mesh: MeshShape) -> tuple[list[int], list[int]]:
    """The per-device input and output buffers: by default the local blocks before and after."""
    return (list(self.before.local_shape(shape, mesh)),
            list(self.after.local_shape(shape, mesh)))

  def apply(self, x: jax.Array, shape: Shape, mesh: MeshShape) -> jax.Array:
    """Carries the step out on the local block ``x``: padded to the input buffer (a whole uneven
    dim about to be split), the collective, then cut to the local block of ``after`` (a dim
    gathered whole loses its padding)."""
    src, _ = self.buffers(shape, mesh)
    return cut_to(self.run(pad_to(x, src), mesh), self.after.local_shape(shape, mesh))

  @abc.abstractmethod
  def run(self, x: jax.Array, mesh: MeshShape) -> jax.Array:
    """The collective (or local slice) on the input buffer ``x``."""


@dataclass(frozen=True, kw_only=True)
class AllReduce(ReshardStep):
  """Reduces the pending partial sums over ``axes`` (with ``before.partial_op``); ``width``:
  bytes per element on the wire (a float extremum's ordered integers take as many)."""

  kind: ClassVar[str] = "all-reduce"
  width: int = field(init=False)

  def __post_init__(self, shape: Shape, itemsize: int, mesh: MeshShape) -> None:
    super().__post_init__(shape, itemsize, mesh)
    object.__setattr__(self, "width", itemsize)

  def run(self, x: jax.Array, mesh: MeshShape) -> jax.Array:
    return _all_reduce(x, self.axis_name, self.before.partial_op, self.width)


@dataclass(frozen=True, kw_only=True)
class _Split(ReshardStep):
  """A step that keeps this device's block of ``dim`` split further over ``axes``: its input
  holds ``count`` output blocks (an uneven dim padded to them)."""

  def buffers(self, shape: Shape, mesh: MeshShape) -> tuple[list[int], list[int]]:
    src, out = super().buffers(shape, mesh)
    src[self.dim] = self.count(mesh) * out[self.dim]
    return src, out


@dataclass(frozen=True, kw_only=True)
class ReduceScatter(_Split):
  """Reduces the partial sums over ``axes`` and keeps this device's block of ``dim``."""

  kind: ClassVar[str] = "reduce-scatter"

  def run(self, x: jax.Array, mesh: MeshShape) -> jax.Array:
    return lax.psum_scatter(x, self.axis_name, scatter_dimension=self.dim, tiled=True)


@dataclass(frozen=True, kw_only=True)
class AllGather(ReshardStep):
  """Concatenates the ``count`` blocks of ``dim`` (padded blocks: an uneven dim's padding is cut
  afterwards)."""

  kind: ClassVar[str] = "all-gather"

  def buffers(self, shape: Shape, mesh: MeshShape) -> tuple[list[int], list[int]]:
    src, _ = super().buffers(shape, mesh)
    out = list(src)
    out[self.dim] = self.count(mesh) * src[self.dim]
    return src, out

  def run(self, x: jax.Array, mesh: MeshShape) -> jax.Array:
    return lax.all_gather(x, self.axis_name, axis=self.dim, tiled=True)


@dataclass(frozen=True, kw_only=True)
class SumGather(ReshardStep):
  """Gathers uneven ``dim`` whole from its blocks over ``axes`` by an all-reduce, as XLA does:
  each device places its block at its offset in zeros of the whole dim, which are summed. The
  all-reduce's buffer is the dim unpadded: it sends no more bytes than an all-gather of the
  padded blocks where those are at least twice the dim (3 or 4 rows over 8 devices)."""

  kind: ClassVar[str] = "all-reduce"
  rows: int = field(init=False)

  def __post_init__(self, shape: Shape, itemsize: int, mesh: MeshShape) -> None:
    super().__post_init__(shape, itemsize, mesh)
    object.__setattr__(self, "rows", shape[self.dim])

  def run(self, x: jax.Array, mesh: MeshShape) -> jax.Array:
    d, block = self.dim, x.shape[self.dim]
    shape = list(x.shape)
    shape[d] = block * self.count(mesh)
    placed = lax.dynamic_update_slice_in_dim(jnp.zeros(shape, x.dtype), x,
                                             shard_index(self.axes) * block, d)
    return _all_reduce(lax.slice_in_dim(placed, 0, self.rows, axis=d), self.axis_name, "sum")


def _summed_gathers(steps: tuple[ReshardStep, ...], shape: Sequence[int], itemsize: int,
                    mesh: MeshShape) -> tuple[ReshardStep, ...]:
  """``steps`` with each all-gather of all of an uneven dim's axes that a ``SumGather`` does
  sending no more bytes (and holding fewer) made one."""
  out = []
  for s in steps:
    if (isinstance(s, AllGather) and not s.before.partial and not s.after.dims[s.dim]
        and shape[s.dim] % s.count(mesh)):
      summed = SumGather(axes=s.axes, before=s.before, after=s.after, dim=s.dim, shape=shape,
                         itemsize=itemsize, mesh=mesh)
      s = summed if summed.sent(mesh) <= s.sent(mesh) else s
    out.append(s)
  return tuple(out)


@dataclass(frozen=True, kw_only=True)
class ScatterDims(ReshardStep):
  """Reduce-scatters into several dims as one collective over ``axes`` (all of them, in mesh
  order): each dim's new blocks are stacked in its axes' order, one per device, then reduced and
  scattered. Where ``ReduceScatter``s into one dim after another reduce a buffer each (f32[8,8]
  partial over ('a','b') -> P('a','b'): 256 B then 128 B), this reduces the first one's (256 B)
  once, sending (k-1)/k of it as one all-reduce would send twice that."""

  kind: ClassVar[str] = "reduce-scatter"

  def added(self, d: int) -> Axes:
    """The axes dim ``d`` gains, major first."""
    return self.after.dims[d][len(self.before.dims[d]):]

  def buffers(self, shape: Shape, mesh: MeshShape) -> tuple[list[int], list[int]]:
    _, out = super().buffers(shape, mesh)
    return [n * axes_size(self.added(d), mesh) for d, n in enumerate(out)], out

  def run(self, x: jax.Array, mesh: MeshShape) -> jax.Array:
    out = [n // axes_size(self.added(d), mesh) for d, n in enumerate(x.shape)]
    split = [k for d, n in enumerate(out) for k in [mesh[a] for a in self.added(d)] + [n]]
    first = list(itertools.accumulate((len(self.added(d)) + 1 for d in range(len(out))),
                                      initial=0))  # each dim's first place in ``split``
    dim_of = {a: d for d in range(len(out)) for a in self.added(d)}
    order = ([first[dim_of[a]] + self.added(dim_of[a]).index(a) for a in self.axes]
             + [first[d] + len(self.added(d)) for d in range(len(out))])
    stacked = x.reshape(split).transpose(order).reshape([-1] + out)
    return lax.psum_scatter(stacked, self.axes, scatter_dimension=0)


@dataclass(frozen=True, kw_only=True)
class GatherDims(ReshardStep):
  """All-gathers of several dims' minor axes as one collective over ``axes`` (all of them, in
  mesh order): the blocks arrive stacked, and each dim's are laid end to end in its axes'
  order. Where ``AllGather``s of one dim after another move a buffer each (f32[8,4]
  P('a','b') -> P() on 2x2: 64 B then 128 B, as XLA), this moves the last one's (128 B) in one
  collective's latency, sending as much."""

  kind: ClassVar[str] = "all-gather"

  def gathered(self, d: int) -> Axes:
    """The axes dim ``d`` loses, major first."""
    return self.before.dims[d][len(self.after.dims[d]):]

  def buffers(self, shape: Shape, mesh: MeshShape) -> tuple[list[int], list[int]]:
    src, _ = super().buffers(shape, mesh)
    return src, [n * axes_size(self.gathered(d), mesh) for d, n in enumerate(src)]

  def run(self, x: jax.Array, mesh: MeshShape) -> jax.Array:
    stacked = lax.all_gather(x[None], self.axes, axis=0, tiled=True).reshape(  # keys too
        [mesh[a] for a in self.axes] + list(x.shape))
    order = [i for d in range(x.ndim)
             for i in [self.axes.index(a) for a in self.gathered(d)] + [len(self.axes) + d]]
    return stacked.transpose(order).reshape(
        [n * axes_size(self.gathered(d), mesh) for d, n in enumerate(x.shape)])


_FUSED: dict[type[ReshardStep], type[ReshardStep]] = {AllGather: GatherDims,
                                                      ReduceScatter: ScatterDims}


def _fused(steps: Sequence[ReshardStep], shape: Sequence[int], itemsize: int,
           mesh: MeshShape) -> tuple[ReshardStep, ...]:
  """``steps`` with each run of ``AllGather``s (``ReduceScatter``s) of distinct dims as one
  ``GatherDims`` (``ScatterDims``)."""
  out: list[ReshardStep] = []
  for step in steps:
    last = out[-1] if out else None
    fused = _FUSED.get(type(step))
    if (fused is not None and type(last) in (type(step), fused)
        and step.before.dims[step.dim] == last.before.dims[step.dim]):
      out[-1] = fused(axes=tuple(a for a in mesh if a in last.axes or a in step.axes),
                      before=last.before, after=step.after, shape=shape, itemsize=itemsize,
                      mesh=mesh)
    else:
      out.append(step)
  return tuple(out)


@dataclass(frozen=True, kw_only=True)
class AllToAll(ReshardStep):
  """Moves the minor axes ``axes`` of ``dim`` to ``dst_dim``: ``dst_dim`` is split (padded to
  ``count`` blocks) and ``dim`` concatenated (padded blocks)."""

  kind: ClassVar[str] = "all-to-all"
  dst_dim: int

  def buffers(self, shape: Shape, mesh: MeshShape) -> tuple[list[int], list[int]]:
    src, out = super().buffers(shape, mesh)
    src[self.dst_dim] = self.count(mesh) * out[self.dst_dim]
    out[self.dim] = self.count(mesh) * src[self.dim]
    return src, out

  def run(self, x: jax.Array, mesh: MeshShape) -> jax.Array:
    return lax.all_to_all(x, self.axis_name, split_axis=self.dst_dim, concat_axis=self.dim,
                          tiled=True)


@dataclass(frozen=True, kw_only=True)
class CollectivePermute(ReshardStep):
  """The axes of ``dim`` change order: whole blocks change places, between devices that differ
  along ``axes`` (the reordered axes whose coordinate changes; see ``moving_axes``)."""

  kind: ClassVar[str] = "collective-permute"

  def run(self, x: jax.Array, mesh: MeshShape) -> jax.Array:
    before = self.before.dims[self.dim]
    return permute(x, before, _reorder_pairs(before, self.after.dims[self.dim], mesh), mesh)

  @staticmethod
  def moving_axes(before: Sequence[str], after: Sequence[str], mesh: MeshShape) -> Axes:
    """The axes along which a reorder ``before`` → ``after`` of one dim's axes moves blocks (in
    ``after``'s order): an axis that keeps its place and stride moves nothing."""
    sizes = [mesh[a] for a in before]
    moving: set[str] = set()
    for source, target in _reorder_pairs(before, after, mesh):
      moving |= {a for a, i, j in zip(before, np.unravel_index(source, sizes),
                                      np.unravel_index(target, sizes)) if i != j}
    return tuple(a for a in after if a in moving)


def _changed_dims(src: TensorSharding, dst: TensorSharding) -> list[int]:
  """The dims whose axes differ between ``src`` and ``dst``."""
  return [d for d, (h, w) in enumerate(zip(src.dims, dst.dims)) if h != w]


def _axes_of(src: TensorSharding, dst: TensorSharding, dims: Sequence[int],
             mesh: MeshShape) -> Axes:
  """The mesh axes that split ``dims`` in ``src`` or ``dst``, in mesh order."""
  return tuple(a for a in mesh if any(a in src.dims[d] or a in dst.dims[d] for d in dims))


def _block(order: Sequence[str], coords: dict[str, int], mesh: MeshShape) -> int:
  """The block of a dim split over ``order`` that the device at ``coords`` holds."""
  return int(np.ravel_multi_index([coords[a] for a in order], [mesh[a] for a in order]))


def _reorder_pairs(before: Sequence[str], after: Sequence[str],
                   mesh: MeshShape) -> list[tuple[int, int]]:
  """(source, target) blocks of a reorder of one dim's axes, linearized in ``before``'s order:
  the device at a block's place in ``after``'s order gets it from its place in ``before``'s."""
  out = []
  for idx in itertools.product(*(range(mesh[a]) for a in before)):
    coords = dict(zip(before, idx))
    out.append((_block(after, coords, mesh), _block(before, coords, mesh)))
  return out


@dataclass(frozen=True, kw_only=True)
class TradeBlocks(ReshardStep):
  """Mesh axes ``axes`` trade places among dims while every dim keeps its number of blocks
  (P('c', 'b', 'a') -> P('a', 'b', 'c') on a 2x2x2 mesh): each device takes the whole block it
  needs from the one device holding it, in one collective-permute (XLA's device permutation)."""

  kind: ClassVar[str] = "collective-permute"

  def run(self, x: jax.Array, mesh: MeshShape) -> jax.Array:
    pairs = []
    for idx in itertools.product(*(range(mesh[a]) for a in self.axes)):
      target = dict(zip(self.axes, idx))
      source: dict[str, int] = {}
      for have, want in zip(self.before.dims, self.after.dims):
        if have:
          block = _block(want, target, mesh)
          source.update(zip(have, np.unravel_index(block, [mesh[a] for a in have])))
      pairs.append((_block(self.axes, source, mesh), _block(self.axes, target, mesh)))
    return permute(x, self.axes, pairs, mesh)


def _traded_blocks(src: TensorSharding, dst: TensorSharding, shape: Sequence[int],
                   itemsize: int, mesh: MeshShape) -> tuple[ReshardStep, ...] | None:
  """``src`` -> ``dst`` as one ``TradeBlocks`` where that applies: no partial sums, the same mesh
  axes in use, each dim split into as many blocks before as after; else None."""
  used = [a for d in src.dims for a in d]
  if (src == dst or src.partial or dst.partial
      or sorted(used) != sorted(a for d in dst.dims for a in d)
      or any(axes_size(h, mesh) != axes_size(w, mesh) for h, w in zip(src.dims, dst.dims))):
    return None
  axes = tuple(a for a in mesh if a in used)
  return (TradeBlocks(axes=axes, before=src, after=dst, shape=shape, itemsize=itemsize,
                      mesh=mesh),)


def _trades_before_gathers(src: TensorSharding, dst: TensorSharding,
                           mesh: MeshShape) -> list[TensorSharding]:
  """``dst`` if it uses ``src``'s axes, else ``dst`` with the axes it drops from ``src`` put back
  behind its own, each dim split into as many blocks as in ``src`` (P('a','b','c') ->
  P('c', None, 'a') on a 2x2x2 mesh: P('c','b','a')): one ``TradeBlocks`` of ``src``'s small
  blocks reaches each, and only gathers of minor axes are left, as XLA permutes devices before
  it gathers."""
  used = {a for d in src.dims for a in d}
  kept = {a for d in dst.dims for a in d}
  dropped = [a for a in mesh if a in used - kept]
  if src.partial or dst.partial or not kept <= used:
    return []
  mids = [] if dropped else [dst]
  for order in itertools.permutations(dropped):
    for places in itertools.product(range(len(dst.dims)), repeat=len(order)):
      dims = [list(d) for d in dst.dims]
      for a, d in zip(order, places):
        dims[d].append(a)
      mid = TensorSharding(tuple(tuple(d) for d in dims))
      if mid != src and mid not in mids and all(
          axes_size(h, mesh) == axes_size(m, mesh) for h, m in zip(src.dims, mid.dims)):
        mids.append(mid)
  return mids


@dataclass(frozen=True, kw_only=True)
class SwapAxes(ReshardStep):
  """``dim`` trades mesh axis ``axes[0]`` for ``axes[1]``, of one size, in one place of its axes
  (the tensor replicated along ``axes[1]`` before and along ``axes[0]`` after): each device takes
  the block of the device whose coordinates along the two axes are swapped."""

  kind: ClassVar[str] = "collective-permute"

  def run(self, x: jax.Array, mesh: MeshShape) -> jax.Array:
    n = mesh[self.axes[0]]
    return permute(x, self.axes, [(i * n + j, j * n + i) for i in range(n) for j in range(n)],
                   mesh)


@dataclass(frozen=True, kw_only=True)
class _PieceMove:
  """One move of a piece of each device's new block, per device (linearized in the step's
  ``axes``): where along the changing dims it starts in the old block it is cut from
  (``taken``) and in the new block (``placed``; None: the device places none in this move).
  ``pairs``: the collective-permute's (source, target) devices; None for a local copy."""

  pairs: tuple[tuple[int, int], ...] | None
  taken: tuple[tuple[int, ...], ...]
  placed: tuple[tuple[int, ...] | None, ...]


@dataclass(frozen=True, kw_only=True)
class _Transfer:
  """A piece that ``target`` needs from ``source`` (itself for a local copy), starting at
  ``taken`` in the old block and at ``placed`` in the new one (changing dims)."""

  source: int
  target: int
  taken: tuple[int, ...]
  placed: tuple[int, ...]


@dataclass(frozen=True, kw_only=True)
class ExchangePieces(ReshardStep):
  """Dims change their axes so that along each the new blocks are whole old ones or lie inside
  one (P('a','b') -> P('b','a') of f32[8,8] on a 2x4 mesh: a new [2,4] block is two [2,2]
  pieces of old blocks), or, along an uneven dim, are cut into pieces as long as the two block
  lengths' greatest common divisor (f32[12,4] P('a') -> P(('a','b')) on a 4x2 mesh: blocks of 3
  rows into blocks of 2, pieces of a row; none past the dim's end): each device builds its new
  block from the pieces of old blocks it covers, copying those it holds and receiving the
  others by collective-permutes of one piece, as many as the device that sends or receives the
  most needs (``rounds.py``); a piece held by several devices comes from the least busy. XLA
  moves such axes through sub-axes, by an all-to-all and a permute of whole blocks; this moves
  each missing piece once. ``axes``: the mesh axes of the changing dims, in mesh order;
  ``extent``: the global shape."""

  kind: ClassVar[str] = "collective-permute"
  extent: tuple[int, ...] = field(init=False)

  def __post_init__(self, shape: Shape, itemsize: int, mesh: MeshShape) -> None:
    object.__setattr__(self, "extent", tuple(shape))
    super().__post_init__(shape, itemsize, mesh)

  def piece(self, mesh: MeshShape) -> list[int]:
    """The pieces' shape: the longest that tiles both the old and the new block, per dim."""
    return list(map(math.gcd, self.before.local_shape(self.extent, mesh),
                    self.after.local_shape(self.extent, mesh)))

  def rounds(self, shape: Shape, mesh: MeshShape) -> int:
    """The collective-permutes the step runs."""
    return rounds_needed([(t.source, t.target) for t in _piece_transfers(
        self.before, self.after, self.axes, self.extent, tuple(mesh.items()))
                          if t.source != t.target])

  def moved(self, shape: Shape, mesh: MeshShape) -> int:
    """A piece per round (``collectives``, set first)."""
    return self.collectives * math.prod(self.piece(mesh))

  def run(self, x: jax.Array, mesh: MeshShape) -> jax.Array:
    dims = _changed_dims(self.before, self.after)
    piece = self.piece(mesh)
    me = shard_index(self.axes)
    out = jnp.zeros(self.after.local_shape(self.extent, mesh), x.dtype)
    for move in _piece_moves(self.before, self.after, self.axes, self.extent,
                             tuple(mesh.items())):
      part = lax.dynamic_slice(x, _starts(move.taken, dims, x.ndim, me), piece)
      if move.pairs is not None:
        part = permute(part, self.axes, list(move.pairs), mesh)
      zero = (0,) * len(dims)
      placed = _starts([p or zero for p in move.placed], dims, x.ndim, me)
      if None in move.placed:  # a device placing nothing writes back what it has
        idle = jnp.asarray([p is None for p in move.placed])[me]
        part = jnp.where(idle, lax.dynamic_slice(out, placed, piece), part)
      out = lax.dynamic_update_slice(out, part, placed)
    return out


def _starts(table: Sequence[tuple[int, ...]], dims: Sequence[int], rank: int,
            me: jax.Array) -> list[jax.Array | int]:
  """This device's row of a per-device ``table`` of starts along ``dims``, as starts of all
  ``rank`` dims (0 on the others)."""
  row = jnp.asarray(table, jnp.int32)[me]
  return [row[dims.index(d)] if d in dims else 0 for d in range(rank)]


@functools.lru_cache(maxsize=256)
def _piece_transfers(before: TensorSharding, after: TensorSharding, axes: Axes,
                     shape: tuple[int, ...], mesh_items: tuple[tuple[str, int], ...]
                     ) -> tuple[_Transfer, ...]:
  """Every piece each device needs for ``ExchangePieces`` on a tensor of global ``shape``, from
  itself where it holds the piece, else from the holder with the fewest pieces to send so far;
  a piece starting past the end of an uneven dim is padding, needed by none."""
  mesh = dict(mesh_items)
  dims = _changed_dims(before, after)
  sizes = [shape[d] for d in dims]
  old = [before.local_shape(shape, mesh)[d] for d in dims]
  new = [after.local_shape(shape, mesh)[d] for d in dims]
  coords = [dict(zip(axes, idx)) for idx in itertools.product(*(range(mesh[a]) for a in axes))]
  held = [tuple(_block(before.dims[d], c, mesh) for d in dims) for c in coords]
  holders: dict[tuple[int, ...], list[int]] = {}
  for k, b in enumerate(held):
    holders.setdefault(b, []).append(k)
  load = [0] * len(coords)
  out = []
  for k, c in enumerate(coords):
    first = [_block(after.dims[d], c, mesh) * n for d, n in zip(dims, new)]
    for placed in itertools.product(*(range(0, n, math.gcd(n, o)) for n, o in zip(new, old))):
      at = [f + p for f, p in zip(first, placed)]
      if any(a >= n for a, n in zip(at, sizes)):
        continue
      source = tuple(a // o for a, o in zip(at, old))
      sender = k if held[k] == source else min(holders[source], key=lambda h: load[h])
      load[sender] += sender != k
      out.append(_Transfer(source=sender, target=k, taken=tuple(a % o for a, o in zip(at, old)),
                           placed=placed))
  return tuple(out)


@functools.lru_cache(maxsize=64)
def _piece_moves(before: TensorSharding, after: TensorSharding, axes: Axes,
                 shape: tuple[int, ...], mesh_items: tuple[tuple[str, int], ...]
                 ) -> tuple[_PieceMove, ...]:
  """``ExchangePieces``'s moves: the local copies (as many as the device holding the most of its
  pieces makes), then one collective-permute per round of the other pieces
  (``rounds.into_rounds``)."""
  transfers = _piece_transfers(before, after, axes, shape, mesh_items)
  devices = math.prod(m for a, m in mesh_items if a in axes)
  width = len(_changed_dims(before, after))
  local: list[list[_Transfer]] = [[] for _ in range(devices)]
  for t in transfers:
    if t.source == t.target:
      local[t.target].append(t)
  sent = [t for t in transfers if t.source != t.target]
  moves = []
  for i in range(max(map(len, local))):
    mine = [own[i] if i < len(own) else None for own in local]
    moves.append(_PieceMove(pairs=None, taken=tuple(t.taken if t else (0,) * width for t in mine),
                            placed=tuple(t and t.placed for t in mine)))
  colour = into_rounds([(t.source, t.target) for t in sent])
  for r in range(max(colour, default=-1) + 1):
    these = [t for t, c in zip(sent, colour) if c == r]
    taken, placed = [(0,) * width] * devices, [None] * devices
    for t in these:
      taken[t.source], placed[t.target] = t.taken, t.placed
    moves.append(_PieceMove(pairs=tuple((t.source, t.target) for t in these),
                            taken=tuple(taken), placed=tuple(placed)))
  return tuple(moves)


def _pieces(src: TensorSharding, dst: TensorSharding, shape: Sequence[int], itemsize: int,
            mesh: MeshShape) -> tuple[ReshardStep]:
  """``src`` -> ``dst`` as one ``ExchangePieces`` over the mesh axes of the changing dims."""
  axes = _axes_of(src, dst, _changed_dims(src, dst), mesh)
  return (ExchangePieces(axes=axes, before=src, after=dst, shape=shape, itemsize=itemsize,
                         mesh=mesh),)


def _exchanged(src: TensorSharding, dst: TensorSharding, shape: Sequence[int], itemsize: int,
               mesh: MeshShape) -> tuple[ReshardStep, ...] | None:
  """``src`` -> ``dst`` (no partial sums) as one ``ExchangePieces`` where along each changing dim
  a new block is cut into no more pieces than the old blocks it can meet (blocks that nest, or
  uneven ones whose lengths share a long enough divisor); else None."""
  changed = _changed_dims(src, dst)
  old, new = src.local_shape(shape, mesh), dst.local_shape(shape, mesh)
  if not changed or any(new[d] // math.gcd(new[d], old[d]) > -(-new[d] // old[d]) + 1
                        for d in changed):
    return None
  return _pieces(src, dst, shape, itemsize, mesh)


def _cheaper(steps: Sequence[ReshardStep], route: Sequence[ReshardStep], mesh: MeshShape
             ) -> bool:
  """Whether ``steps`` send fewer bytes than ``route`` (``ReshardStep.sent``: a gather's or an
  all-to-all's HLO buffer overstates what it sends), or as many in fewer collectives (each
  costs a collective's latency)."""
  def cost(steps: Sequence[ReshardStep]) -> tuple[int, int]:
    return sum(s.sent(mesh) for s in steps), sum(s.collectives for s in steps)
  return cost(steps) < cost(route)


def _collected(src: TensorSharding, dst: TensorSharding, shape: Sequence[int], itemsize: int,
               mesh: MeshShape) -> tuple[ReshardStep, ...] | None:
  """``src`` -> ``dst`` as one ``ExchangePieces`` where each changing dim's new blocks are whole
  old ones (evenly split, fewer blocks after) and its axes are not merely a prefix kept (a
  gather of the rest moves as much); else None."""
  changed = _changed_dims(src, dst)
  if any(shape[d] % axes_size(src.dims[d], mesh)
         or axes_size(src.dims[d], mesh) % axes_size(dst.dims[d], mesh)
         or axes_size(src.dims[d], mesh) == axes_size(dst.dims[d], mesh)
         or tuple(src.dims[d][:len(dst.dims[d])]) == tuple(dst.dims[d]) for d in changed):
    return None
  return _pieces(src, dst, shape, itemsize, mesh)


def sub_blocks(src: TensorSharding, dst: TensorSharding, shape: Sequence[int], itemsize: int,
               mesh: MeshShape, route: Sequence[ReshardStep]) -> tuple[ReshardStep, ...] | None:
  """``src`` -> ``dst`` (after an all-reduce of partial sums ``dst`` does not keep) as the
  cheapest of: ``_permuted`` (an ``ExchangePieces`` where every changing dim gets finer, else a
  swap of a dim's major axis before gathers or a collection of whole old blocks);
  ``_permuted_then_gathered`` (one of these into a form that still holds the axes ``dst``
  drops, then gathers); ``_exchanged`` (an ``ExchangePieces`` wherever blocks nest, dims getting
  finer and coarser at once included, if ``_cheaper`` than ``route``, ``plan_reshard``'s steps);
  None where none applies. Not among ``plan_reshard``'s options: these skip the forms a gather
  passes through, which a value's other readers may reuse, so the schedule takes them only for
  a sole reader."""
  summed, reduced = _reduced(src, dst, shape, itemsize, mesh)
  if summed.partial or dst.partial:
    return None
  exchanged = _exchanged(summed, dst, shape, itemsize, mesh)
  options = [reduced + steps for steps in (_permuted(summed, dst, shape, itemsize, mesh),
                                           _permuted_then_gathered(summed, dst, shape, itemsize,
                                                                   mesh))
             if steps is not None]
  if exchanged is not None and _cheaper(reduced + exchanged, route, mesh):
    options.append(reduced + exchanged)
  return min(options, key=_moved) if options else None


def _moved(steps: Sequence[ReshardStep]) -> int:
  return sum(s.bytes for s in steps)


def _permuted(src: TensorSharding, dst: TensorSharding, shape: Sequence[int], itemsize: int,
              mesh: MeshShape) -> tuple[ReshardStep, ...] | None:
  """``src`` -> ``dst`` (no partial sums) as one ``ExchangePieces`` of a piece per device, or
  the cheaper of ``_swapped_then_gathered`` and ``_collected`` (see ``sub_blocks``); None where
  none applies."""
  changed = _changed_dims(src, dst)
  if not any(src.dims[d] for d in changed):
    return None
  if any(axes_size(dst.dims[d], mesh) % axes_size(src.dims[d], mesh)
         or shape[d] % axes_size(dst.dims[d], mesh) for d in changed):
    options = [steps for steps in (_swapped_then_gathered(src, dst, shape, itemsize, mesh),
                                   _collected(src, dst, shape, itemsize, mesh))
               if steps is not None]
    return min(options, key=_moved) if options else None
  return _pieces(src, dst, shape, itemsize, mesh)


def _permuted_then_gathered(src: TensorSharding, dst: TensorSharding, shape: Sequence[int],
                            itemsize: int, mesh: MeshShape) -> tuple[ReshardStep, ...] | None:
  """``src`` -> ``dst`` through ``dst`` with the axes it drops kept where ``src`` has them
  (after ``dst``'s own on their dim): a permute (``_permuted``) into that form, then gathers of
  the kept axes, so a block moves before it grows (P('a','b') -> P(None,('c','b')) of f32[8,16]
  on a 2x2x2 mesh: a [4,4] block permuted, then gathered over 'a', 192 B, where gathering first
  moves 768 B); None where there is no such form or no permute into it."""
  used = {a for axes in dst.dims for a in axes}
  dims = tuple(tuple(want) + tuple(a for a in have if a not in used)
               for have, want in zip(src.dims, dst.dims))
  mid = TensorSharding(dims)
  if mid.dims in (src.dims, dst.dims) or any(n % axes_size(axes, mesh)
                                              for n, axes in zip(shape, dims)):
    return None
  permuted = _permuted(src, mid, shape, itemsize, mesh)
  if permuted is None:
    return None
  return permuted + _plan_reshard(mid, dst, shape, itemsize, mesh, park=False)


def _swapped_then_gathered(src: TensorSharding, dst: TensorSharding, shape: Sequence[int],
                           itemsize: int, mesh: MeshShape) -> tuple[ReshardStep, ...] | None:
  """``src`` -> ``dst`` where a dim's major axis becomes the one axis ``dst`` splits it by (of
  its size, held by no dim before nor kept after) by one ``SwapAxes`` of the block, and its minor
  axes are then gathered: each new block is several old ones on other devices (P(('b','c')) ->
  P('a') on a 2x2x2 mesh: a collective-permute of the [2] block, then an all-gather over 'c', as
  XLA permutes devices before it gathers; gathering 'b' and 'c' whole moves more); None where no
  dim's does."""
  for d, (have, want) in enumerate(zip(src.dims, dst.dims)):
    if len(have) < 2 or len(want) != 1 or shape[d] % axes_size(have, mesh):
      continue
    dims = list(src.dims)
    dims[d] = (want[0], *have[1:])
    mid = TensorSharding(tuple(dims))
    if _swapped(have, dims[d], src.dims, mid.dims, mesh) is not None:
      return (_plan_reshard(src, mid, shape, itemsize, mesh, park=False)
              + _plan_reshard(mid, dst, shape, itemsize, mesh, park=False))
  return None


def _reduced(src: TensorSharding, dst: TensorSharding, shape: Sequence[int], itemsize: int,
             mesh: MeshShape) -> tuple[TensorSharding, tuple[ReshardStep, ...]]:
  """``src`` with its partial sums all-reduced where ``dst`` has none, and that step (none
  where nothing is reduced)."""
  if not src.partial or dst.partial:
    return src, ()
  summed = TensorSharding(src.dims)
  return summed, (AllReduce(axes=src.partial, before=src, after=summed, shape=shape,
                            itemsize=itemsize, mesh=mesh),)


@dataclass(frozen=True, kw_only=True)
class Realign(ReshardStep):
  """An uneven ``dim`` of ``size`` rows split over ``axes`` that keeps its first ``kept`` axes and
  is about to gather the rest (the next step): each device takes the rows at its place in the
  coarser tiling, block j of kept block k starting at k*S + j*s rather than (k*L + j)*s (S, s the
  two block sizes, L the gathered blocks), cut from at most two neighbouring blocks by
  collective-permutes, so that gathering the rest gives the kept blocks, as XLA realigns uneven
  tiles, rather than gathering the dim whole. The sharding's name does not change (``after`` ==
  ``before``): only the gather after it reads the realigned rows."""

  kind: ClassVar[str] = "collective-permute"
  kept: int
  size: int

  def moves(self, mesh: MeshShape) -> list[tuple[int, int, int]]:
    """(k, q, m) per kept block k whose rows shift by q*s + m (0 <= m < s): its devices take the
    last m rows of the block q+1 before their own and the first s-m rows of the one q before."""
    big, rest = self.count(mesh) // self._lost(mesh), self._lost(mesh)
    s = _shard(self.size, big * rest)
    shift = rest * s - _shard(self.size, big)
    return [(k, *divmod(k * shift, s)) for k in range(1, big) if k * shift]

  def _lost(self, mesh: MeshShape) -> int:
    return math.prod(mesh[a] for a in self.axes[self.kept:])

  def buffers(self, shape: Shape, mesh: MeshShape) -> tuple[list[int], list[int]]:
    """One buffer of all the rows its permutes move (their bytes summed)."""
    local = list(self.before.local_shape(shape, mesh))
    s = local[self.dim]
    local[self.dim] = sum(m + (s - m if q else 0) for _, q, m in self.moves(mesh))
    return local, local

  def apply(self, x: jax.Array, shape: Shape, mesh: MeshShape) -> jax.Array:
    """``run`` on the local block as it is: the block keeps its shape, and ``buffers`` price the
    rows the permutes move, not a buffer to pad the block to."""
    return self.run(x, mesh)

  def run(self, x: jax.Array, mesh: MeshShape) -> jax.Array:
    d, rest = self.dim, self._lost(mesh)
    s, out = x.shape[d], x
    block = shard_index(self.axes[:self.kept])
    for k, q, m in self.moves(mesh):
      targets = range(k * rest, (k + 1) * rest)
      send = lambda piece, back: permute(piece, self.axes, [(t - back, t) for t in targets], mesh)
      head = lax.slice_in_dim(x, 0, s - m, axis=d)
      parts = [send(lax.slice_in_dim(x, s - m, s, axis=d), q + 1)] if m else []
      parts.append(send(head, q) if q else head)
      out = jnp.where(block == k, jnp.concatenate(parts, d) if m else parts[0], out)
    return out


@dataclass(frozen=True, kw_only=True)
class DynamicSlice(_Split):
  """Keeps this device's block of ``dim`` split further over ``axes``: local, no communication."""

  kind: ClassVar[str] = "dynamic-slice"
  communicates: ClassVar[bool] = False

  def run(self, x: jax.Array, mesh: MeshShape) -> jax.Array:
    size = x.shape[self.dim] // self.count(mesh)
    if size == 1 and x.dtype in _MISFOLDED:
      x = lax.optimization_barrier(x)
    return lax.dynamic_slice_in_dim(x, shard_index(self.axes) * size, size, self.dim)


# XLA's simplifier (jaxlib 0.10.2 to 0.12.1, CPU) folds a one-row dynamic slice of ``y * c``,
# ``y`` a dynamic slice of these 32-bit integers and ``c`` a constant, into a slice of ``y``'s
# operand and drops the multiply (``jax.jit`` of ``lax.dynamic_slice(lax.dynamic_slice(x, (i,),
# (2,)) * 10, (j,), (1,))`` returns ``x[i + j]``): a one-row block of them is sliced behind a
# barrier, which that fold does not see through.
_MISFOLDED = {jnp.dtype(jnp.int32), jnp.dtype(jnp.uint32)}


@dataclass(frozen=True)
class IotaFill:
  """The elements of an iota: each its index along ``dimension``."""

  dimension: int


@dataclass(frozen=True, kw_only=True)
class Splat(ReshardStep):
  """Makes ``after``'s block of a value every device can make itself anew: one whose elements
  all equal ``fill`` (a broadcast of a literal) or an iota (``fill`` an IotaFill), or one with
  no elements. Local, no communication, as XLA folds a collective of such a value."""

  kind: ClassVar[str] = "splat"
  communicates: ClassVar[bool] = False
  fill: Any

  def apply(self, x: jax.Array, shape: Shape, mesh: MeshShape) -> jax.Array:
    return self.run(jnp.empty(self.after.local_shape(shape, mesh), x.dtype), mesh)

  def run(self, x: jax.Array, mesh: MeshShape) -> jax.Array:
    """``after``'s block, of ``x``'s shape and dtype."""
    if not x.size:
      return x
    if not isinstance(self.fill, IotaFill):
      return jnp.full_like(x, self.fill)
    d = self.fill.dimension
    first = shard_index(self.after.dims[d]) * x.shape[d]
    return lax.broadcasted_iota(x.dtype, x.shape, d) + first.astype(x.dtype)


@over_key_data
def pad_to(x: jax.Array, shape: Shape) -> jax.Array:
  """``x`` padded at the end of every dim shorter than ``shape`` (whole uneven dims about to be
  split; a key array's data has more dims than ``shape``)."""
  widths = [(0, max(0, n - m)) for n, m in zip(shape, x.shape)]
  if not any(w for _, w in widths):
    return x
  return jnp.pad(x, widths + [(0, 0)] * (x.ndim - len(widths)))


def cut_to(x: jax.Array, shape: Shape) -> jax.Array:
  """``x`` without the rows past ``shape`` (the padding of dims gathered whole)."""
  for d, n in enumerate(shape):
    if x.shape[d] > n:
      x = lax.slice_in_dim(x, 0, n, axis=d)
  return x


_ALL_REDUCE = {"sum": lax.psum, "max": lax.pmax, "min": lax.pmin}


def ordered_extrema(steps: tuple[ReshardStep, ...], shape: Sequence[int], width: int,
                    mesh: MeshShape) -> tuple[ReshardStep, ...]:
  """``steps`` with their all-reduces of a float max or min ``width`` bytes per element: the
  ordered integers they reduce (``_ordered_extremum``), as wide as the backend runs them."""
  return tuple(AllReduce(axes=s.axes, before=s.before, after=s.after, dim=s.dim, shape=shape,
                         itemsize=width, mesh=mesh)
               if isinstance(s, AllReduce) and s.before.partial_op != "sum" else s
               for s in steps)


@over_key_data  # a SumGather of keys: each key summed with zeros
def _all_reduce(x: jax.Array, axes: str | Axes, op: str, width: int | None = None) -> jax.Array:
  """``x`` combined by ``op`` over ``axes`` (a float extremum's ordered integers ``width``
  bytes per element on the wire, its own size by default)."""
  width = width or x.dtype.itemsize
  if x.dtype == jnp.bool_:
    return _all_reduce(x.astype(jnp.uint8), axes, op).astype(jnp.bool_)
  if op != "sum" and jnp.iscomplexobj(x):
    return _complex_extremum(x, axes, op)
  if op != "sum" and jnp.issubdtype(x.dtype, jnp.floating):
    return _differentiable_extremum(x, axes, op, width)
  return _ALL_REDUCE[op](x, axes)


@functools.partial(jax.custom_jvp, nondiff_argnums=(1, 2, 3))
def _differentiable_extremum(x: jax.Array, axes: str | Axes, op: str, width: int) -> jax.Array:
  """The max / min of floating ``x`` over ``axes`` with a derivative (JAX gives ``lax.pmax``
  none): so ``jax.jvp``, ``jax.jacfwd`` and ``jax.hessian`` run through a partitioned max (a
  logsumexp's, a softmax's) over a split dim. As ``reduce_max``'s: the tangents of the devices
  whose value is the result, averaged (each device's its own block's average over ties: where
  the extremum is tied across devices holding it a different number of times, the weights
  differ from JAX's per element)."""
  return _ordered_extremum(x, axes, op, width)


def _ordered_extremum(x: jax.Array, axes: str | Axes, op: str, width: int) -> jax.Array:
  """The max / min of floating ``x`` over ``axes``, a NaN winning as in ``reduce_max`` (XLA's
  CPU and GPU all-reduces drop it): all-reduced as ordered integers of ``width`` bytes (the
  float's bits, negative ones reversed; a NaN the largest, or smallest), as many bytes as the
  float takes on the wire."""
  bits = jnp.dtype(f"int{8 * x.dtype.itemsize}")
  top = jnp.iinfo(bits).max
  k = lax.bitcast_convert_type(x, bits)
  key = jnp.where(jnp.isnan(x), top if op == "max" else jnp.iinfo(bits).min,
                  jnp.where(k < 0, k ^ top, k))
  m = _ALL_REDUCE[op](key.astype(f"int{8 * width}"), axes).astype(bits)
  return lax.bitcast_convert_type(jnp.where(m < 0, m ^ top, m), x.dtype)


@_differentiable_extremum.defjvp
def _extremum_jvp(axes: str | Axes, op: str, width: int, primals: tuple, tangents: tuple
                  ) -> tuple:
  (x,), (t,) = primals, tangents
  out = _differentiable_extremum(x, axes, op, width)
  held = x == out
  count = lax.psum(held.astype(t.dtype), axes)
  return out, lax.psum(jnp.where(held, t, jnp.zeros_like(t)), axes) / count


def _complex_extremum(x: jax.Array, axes: str | Axes, op: str) -> jax.Array:
  """The max / min of complex ``x`` over ``axes`` in ``lax.max``'s lexicographic order (real
  part, then imaginary), which no backend's all-reduce takes: the real parts' extremum, then
  the imaginary parts' among the devices holding it (two all-reduces of the parts' bytes)."""
  extremum = _ALL_REDUCE[op]
  re = extremum(x.real, axes)
  beyond = -jnp.inf if op == "max" else jnp.inf
  im = extremum(jnp.where(x.real == re, x.imag, beyond), axes)
  return lax.complex(re, im)


def _shard(n: int, count: int) -> int:
  return -(-n // count)


def splits_exactly(n: int, count: int, k: int) -> bool:
  """Can each of ``count`` blocks of a size-``n`` dim be cut into ``k`` blocks of the finer
  sharding? Always from whole (padding goes at the end)."""
  return count == 1 or _shard(n, count) == k * _shard(n, count * k)


def gathers_exactly(n: int, count: int, k: int) -> bool:
  """Do ``k`` neighbouring blocks of ``count`` concatenate to a block of the coarser sharding?
  Always to whole (the padding is sliced off)."""
  return count == k or k * _shard(n, count) == _shard(n, count // k)


def plan_reshard(src: TensorSharding, dst: TensorSharding, shape: Sequence[int], itemsize: int,
                 mesh: MeshShape) -> tuple[ReshardStep, ...]:
  """The steps from ``src`` to ``dst``: the cheapest of the plan that gathers an axis it cannot
  move straight to the dim that wants it next, the plan that parks such an axis in the dim
  that wants it (behind axes that leave later, reordered by collective-permutes), as XLA moves
  axes between dims by all-to-alls rather than gathering them, where axes only trade
  dims of as many blocks, one collective-permute of whole blocks (``TradeBlocks``), and where
  axes trade dims while others are dropped, that permute before gathering the dropped axes;
  and where the cheapest of these gathers nothing, one that first slices by the axes no dim
  holds (``_sliced_early``)."""
  options = [_plan_reshard(src, dst, shape, itemsize, mesh, park=False)]
  if _gathers(options[0]):
    options.append(_plan_reshard(src, dst, shape, itemsize, mesh, park=True))
  summed, reduced = _reduced(src, dst, shape, itemsize, mesh)  # reduced first, then traded
  if reduced and any(isinstance(s, (ReduceScatter, ScatterDims)) for s in options[0]):
    # one all-reduce over all the axes may move less than a reduce-scatter over some and an
    # all-reduce of the rest
    options.append(reduced + _plan_reshard(summed, dst, shape, itemsize, mesh, park=False))
  for mid in _trades_before_gathers(summed, dst, mesh):
    traded = _traded_blocks(summed, mid, shape, itemsize, mesh)
    if traded is not None:
      options.append(reduced + traded + _plan_reshard(mid, dst, shape, itemsize, mesh, park=False))
  def cost(steps: Sequence[ReshardStep]) -> tuple[int, int]:
    return sum(s.bytes for s in steps), sum(s.sent(mesh) for s in steps)

  options = [_summed_gathers(steps, shape, itemsize, mesh) for steps in options]
  best = min(options, key=cost)
  if _gathers(best):
    return best
  sliced = _sliced_early(summed, dst, shape, itemsize, mesh)
  if not sliced:
    return best
  return min(best, reduced + sliced + plan_reshard(sliced[-1].after, dst, shape, itemsize, mesh),
             key=cost)


def _gathers(steps: Sequence[ReshardStep]) -> bool:
  return any(isinstance(s, (AllGather, GatherDims)) for s in steps)


def _sliced_early(src: TensorSharding, dst: TensorSharding, shape: Sequence[int], itemsize: int,
                  mesh: MeshShape) -> tuple[ReshardStep, ...]:
  """Local slices of each dim by the axes ``dst`` splits it by and no dim of ``src`` holds, where
  ``dst`` wants them behind axes still to arrive (in order, ``_plan_reshard`` slices them first
  itself): the collectives then move smaller blocks, and a collective-permute puts the axes in
  order once the others arrive (P(None, 'a') -> P(('a', 'b')) of f32[8,16] on a 2x4 mesh: rows
  sliced by 'b', an all-to-all of 'a', a permute into ('a', 'b'), 128 B, as XLA, where an
  all-to-all of the whole block first moves 256 B). No steps where no dim has such axes.
  ``plan_reshard`` takes them only where its other routes gather nothing: a gathered form on the
  way is one a value's other readers may reuse (the schedule keeps the forms a reshard passes
  through), and slicing first skips it."""
  if src.partial:
    return ()
  used = {a for axes in src.dims for a in axes}
  steps: list[ReshardStep] = []
  cur = src
  for d, want in enumerate(dst.dims):
    have = cur.dims[d]
    free = tuple(a for a in want if a not in used)
    if (not free or want[:len(have) + len(free)] == have + free
        or not splits_exactly(shape[d], axes_size(have, mesh), axes_size(free, mesh))):
      continue
    after = TensorSharding(cur.dims[:d] + (have + free,) + cur.dims[d + 1:])
    steps.append(DynamicSlice(axes=free, before=cur, after=after, shape=shape, itemsize=itemsize,
                              mesh=mesh, dim=d))
    cur = after
  return tuple(steps)


def _plan_reshard(src: TensorSharding, dst: TensorSharding, shape: Sequence[int], itemsize: int,
                  mesh: MeshShape, park: bool) -> tuple[ReshardStep, ...]:
  steps: list[ReshardStep] = []
  dims = [list(d) for d in src.dims]
  partial = [a for a in src.partial if a not in dst.partial]
  target = [list(d) for d in dst.dims]

  count = functools.partial(axes_size, mesh_shape=mesh)

  def cur() -> TensorSharding:
    left = tuple(a for a in src.partial if a in partial or a in dst.partial)
    return TensorSharding(tuple(tuple(d) for d in dims), left, src.partial_op if left else "sum")

  def emit(step: type[ReshardStep], axes: Sequence[str], change: Callable[[], Any],
           **where: int) -> None:
    """Appends a ``step`` over ``axes`` with the fields ``where`` gives (the dims it acts on);
    ``change`` makes it in the working sharding."""
    before = cur()
    change()
    steps.append(step(axes=tuple(axes), before=before, after=cur(), shape=shape,
                      itemsize=itemsize, mesh=mesh, **where))

  def wants_next(d: int, run: Sequence[str]) -> bool:
    want, have = target[d], len(dims[d])
    return want[:have] == dims[d] and want[have:have + len(run)] == list(run)

  # 1. Partial sums: reduce-scatter into the dim that wants the axis next (one collective for a
  # run of axes that dim wants in turn), else all-reduce.
  for a in list(partial) if src.partial_op == "sum" else ():
    for d in range(len(dims)):
      run = _scatter_run(a, partial, dims[d], target[d])
      if run and splits_exactly(shape[d], count(dims[d]), count(run)):
        emit(ReduceScatter, run, lambda run=run, d=d: (
            [partial.remove(b) for b in run], dims[d].extend(run)), dim=d)
        break
  if partial:
    emit(AllReduce, list(partial), partial.clear)

  # 2. Same axes in another order: a collective-permute.
  def reorder() -> None:
    for d, want in enumerate(target):
      if dims[d] != want and sorted(dims[d]) == sorted(want):
        emit(CollectivePermute, CollectivePermute.moving_axes(dims[d], want, mesh),
             lambda d=d, want=want: dims[d].__setitem__(slice(None), list(want)), dim=d)

  reorder()

  # 2b. One axis traded for another of its size in one place of a dim: a collective-permute.
  for d, want in enumerate(target):
    swap = _swapped(dims[d], want, dims, target, mesh)
    if swap is not None:
      emit(SwapAxes, swap, lambda d=d, want=want: dims[d].__setitem__(slice(None), list(want)),
           dim=d)

  # Uneven dims whose blocks do not nest between source and target are gathered whole first,
  # except the axes a dim keeps in front where the blocks they make split exactly into the
  # target's: its blocks are realigned to theirs and the rest gathered.
  for d, want in enumerate(target):
    have = dims[d]
    if have and want != have and not _nests(shape[d], have, want, mesh):
      kept = _common_prefix(have, want)
      if kept == len(have) or not splits_exactly(shape[d], count(have[:kept]), count(want[kept:])):
        kept = 0
      if kept:
        emit(Realign, list(have), lambda: None, dim=d, kept=kept, size=shape[d])
      emit(AllGather, list(have[kept:]), lambda d=d, kept=kept: dims[d].__delitem__(
          slice(kept, None)), dim=d)

  def used() -> set[str]:
    return {a for d in dims for a in d}

  def slice_free() -> None:
    for d, want in enumerate(target):
      added: list[str] = []
      while (len(want) > len(dims[d]) + len(added)
             and want[:len(dims[d])] == dims[d] and want[len(dims[d]) + len(added)] not in used()
             and want[len(dims[d]) + len(added)] not in added):
        added.append(want[len(dims[d]) + len(added)])
      if added and splits_exactly(shape[d], count(dims[d]), count(added)):
        emit(DynamicSlice, added, lambda d=d, added=added: dims[d].extend(added), dim=d)

  # 3. Local slices first, so that collectives move less.
  slice_free()
  def movable(i: int, run: Sequence[str]) -> int | None:
    """The dim that wants axes ``run`` of dim ``i`` next, in order, if one all-to-all can move
    them there."""
    for j in range(len(dims)):
      if (j != i and wants_next(j, run) and gathers_exactly(shape[i], count(dims[i]), count(run))
          and splits_exactly(shape[j], count(dims[j]), count(run))):
        return j
    return None

  def leaving_last(i: int) -> list[str] | None:
    """An order of dim i's axes that puts last, in the order their dim wants them next, the
    axes that leave it for one other dim while the rest stay (None: none such, or already)."""
    for a in dims[i][-2::-1]:
      rest = [b for b in dims[i] if b != a]
      if target[i][:len(rest)] == rest and movable(i, [a]) is not None:
        return rest + [a]
    keep = [a for a in target[i] if a in dims[i]]
    leave = [a for a in dims[i] if a not in keep]
    if len(leave) < 2 or target[i][:len(keep)] != keep:
      return None
    for j, want in enumerate(target):
      run = list(want[len(dims[j]):len(dims[j]) + len(leave)])
      if j != i and sorted(run) == sorted(leave) and movable(i, run) is not None:
        return None if keep + run == dims[i] else keep + run
    return None

  # 4. All-to-all: the minor axes of dim i are wanted next on dim j, in order (one all-to-all
  # over all of them, the longest such run first). An axis wanted elsewhere
  # from a more major position of a dim whose other axes stay is made minor first by a
  # collective-permute (whole blocks change places, padded ones too), as XLA does, rather than
  # gathered.
  moved = True
  while moved:
    moved = False
    for i in range(len(dims)):
      if not dims[i] or target[i][:len(dims[i])] == dims[i]:
        continue
      order = leaving_last(i)
      if order is not None:
        emit(CollectivePermute, CollectivePermute.moving_axes(dims[i], order, mesh),
             lambda i=i, order=order: dims[i].__setitem__(slice(None), order), dim=i)
      for k in range(len(dims[i]), 0, -1):
        run = dims[i][-k:]
        j = movable(i, run)
        if j is not None:
          emit(AllToAll, run, lambda i=i, j=j, run=run: (
              dims[i].__delitem__(slice(-len(run), None)), dims[j].extend(run)), dim=i, dst_dim=j)
          moved = True
          break
    if not moved and park:
      moved = _park(dims, target, shape, mesh, emit)
  reorder()
  # 5. All-gather the axes a dim must lose (minor first, one step per dim, the dims whose
  # gathers grow the array least first, as XLA orders them; ``_fused`` then makes gathers in a
  # row one collective); kept axes behind lost ones are first made major by a
  # collective-permute where that moves less.
  def growth(d: int) -> int:
    return count(dims[d]) // count([a for a in dims[d] if a in target[d]])

  for d in sorted(range(len(target)), key=growth):
    want = target[d]
    order = _kept_first(dims[d], want, shape[d], mesh)
    if order is not None:
      emit(CollectivePermute, CollectivePermute.moving_axes(dims[d], order, mesh),
           lambda d=d, order=order: dims[d].__setitem__(slice(None), order), dim=d)
    keep = 0
    while keep < len(dims[d]) and keep < len(want) and dims[d][keep] == want[keep]:
      keep += 1
    if keep < len(dims[d]):
      lost = dims[d][keep:]
      if not gathers_exactly(shape[d], count(dims[d]), count(lost)):
        keep, lost = 0, list(dims[d])
      emit(AllGather, lost, lambda d=d, keep=keep: dims[d].__delitem__(slice(keep, None)),
           dim=d)
  # 6. What is left is more tiling: local slices.
  slice_free()
  # 7. Uneven dims whose remaining axes cannot be cut from their blocks: whole, then sliced.
  for d, want in enumerate(target):
    if dims[d] != want:
      if dims[d]:
        emit(AllGather, list(dims[d]), lambda d=d: dims[d].clear(), dim=d)
      emit(DynamicSlice, list(want), lambda d=d, want=want: dims[d].extend(want), dim=d)
  if cur() != dst:
    raise AssertionError(f"reshard {src} -> {dst} of {tuple(shape)} stopped at {cur()}")
  return _fused(steps, shape, itemsize, mesh)


def _park(dims: list[list[str]], target: Sequence[Sequence[str]], shape: Sequence[int],
          mesh: MeshShape, emit: Callable[..., None]) -> bool:
  """Moves the longest run of minor axes of a dim that another dim wants (not next: behind
  axes of its own that leave later) there by an all-to-all; whether one moved. Each move puts
  axes in their target dim, which they never leave again, so parking ends."""
  count = functools.partial(axes_size, mesh_shape=mesh)
  for i in range(len(dims)):
    for k in range(len(dims[i]), 0, -1):
      run = dims[i][-k:]
      for j in range(len(dims)):
        if (j != i and all(a in target[j] for a in run)
            and gathers_exactly(shape[i], count(dims[i]), count(run))
            and splits_exactly(shape[j], count(dims[j]), count(run))):
          emit(AllToAll, run, lambda i=i, j=j, run=run: (
              dims[i].__delitem__(slice(-len(run), None)), dims[j].extend(run)), dim=i, dst_dim=j)
          return True
  return False


def _swapped(have: Sequence[str], want: Sequence[str], dims: Sequence[Sequence[str]],
             target: Sequence[Sequence[str]], mesh: MeshShape) -> tuple[str, str] | None:
  """(x, y) where a dim's axes ``have`` become ``want`` by trading x for y of the same size in
  one place, y held by no dim now and x by no dim after (XLA's device permutation); else
  None."""
  places = [i for i, (a, b) in enumerate(zip(have, want)) if a != b]
  if len(have) != len(want) or len(places) != 1:
    return None
  x, y = have[places[0]], want[places[0]]
  if (mesh[x] != mesh[y] or any(y in axes for axes in dims)
      or any(x in axes for axes in target)):
    return None
  return x, y


def _kept_first(have: Sequence[str], want: Sequence[str], n: int,
                mesh: MeshShape) -> list[str] | None:
  """An order of an even dim's axes ``have`` that puts first, in ``want``'s order, the axes it
  keeps (the longest prefix of ``want`` it holds), where that reorder (one block per device) and
  then gathering the rest moves less than gathering them all (XLA's ('a', 'b') -> ('b',): a
  collective-permute and an all-gather over 'a'); None where no such order helps."""
  kept: list[str] = []
  for a in want:
    if a not in have:
      break
    kept.append(a)
  order = kept + [a for a in have if a not in kept]
  total, keep = (math.prod(mesh[a] for a in axes) for axes in (have, kept))
  if not kept or order == list(have) or n % total or 1 / total + 1 / keep >= 1:
    return None
  return order


def _scatter_run(first: str, partial: Sequence[str], have: Sequence[str],
                 want: Sequence[str]) -> list[str]:
  """The partial axes, from ``first`` on, that a dim sharded by ``have`` wants next, in order."""
  if first not in partial or len(want) <= len(have) or list(want[:len(have)]) != list(have):
    return []
  run: list[str] = []
  for b in want[len(have):]:
    if b not in partial or (not run and b != first):
      break
    run.append(b)
  return run


def _nests(n: int, have: Sequence[str], want: Sequence[str], mesh: MeshShape) -> bool:
  """Even dims always regroup exactly; uneven ones only along a shared prefix of axes."""
  counts = [math.prod(mesh[a] for a in axes) for axes in (have, want)]
  if all(n % c == 0 for c in counts):
    return True
  common = _common_prefix(have, want)
  base = math.prod(mesh[a] for a in have[:common])
  return (gathers_exactly(n, counts[0], counts[0] // base)
          and splits_exactly(n, base, counts[1] // base))


def _common_prefix(have: Sequence[str], want: Sequence[str]) -> int:
  """How many leading axes ``have`` and ``want`` share."""
  common = 0
  while common < min(len(have), len(want)) and have[common] == want[common]:
    common += 1
  return common
