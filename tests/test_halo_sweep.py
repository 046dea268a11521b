"""A sweep of window geometries along sharded dims: max and sum pooling (reduce_window) and
convolutions, forward and gradient, over window, stride, padding (none, one side, both sides),
base and window dilation, shards of 1-2 rows and uneven sizes, one or two sharded dims.

Every case checks that the partitioned program equals the unpartitioned one, that the plan moves
the compiled HLO's bytes per collective kind, and that no op fell back to running replicated.
Where the output splits evenly and a halo moves no more than gathering the dim (its reach is
enumerated here, window by window, independently of spmd/partition/halo_geometry.py), the program
must exchange halos only: no all-gather; on one sharded dim the halo is exactly the rows the
windows reach, less those next to the shards' own rows that no window reads.

The max-pool gradient (select_and_scatter_add) has its own sweep: it exchanges exactly the
windows (cotangent rows) touching a shard's rows and the input rows those windows read, even or
uneven, whether or not the windows are aligned with the blocks.

The cases are a fixed sample of the product of the geometry choices (~4,500 programs on one
sharded dim alone), three in four with an even output: the file takes about 80 s of CPU (5 minutes
on 2 shared, loaded cores).
"""
from __future__ import annotations

import functools
import itertools
import random
from dataclasses import dataclass

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

import spmd
from helpers import assert_partitioned_matches

WINDOWS, STRIDES = (1, 2, 3, 5), (1, 2, 3)
PADDINGS = ((0, 0), (1, 1), (2, 0), (0, 2), (2, 2), (3, 1))
DILATIONS = (1, 2)
SIZES_1D = ((8, 8), (8, 16), (8, 13), (4, 6), (4, 8), (8, 5))  # (shards, rows): 1-2 row shards
SIZES_2D = ((4, 8), (6, 8), (8, 6), (5, 7))                     # (H on 2 shards, W on 4)
OPS = ("max", "sum", "conv")


@dataclass(frozen=True)
class Geometry:
  window: int
  stride: int
  padding: tuple[int, int]
  base_dilation: int
  window_dilation: int

  def out(self, size: int) -> int:
    span = (size - 1) * self.base_dilation + 1 + sum(self.padding)
    return (span - (self.window - 1) * self.window_dilation - 1) // self.stride + 1

  def reach(self, size: int, shards: int) -> tuple[int, int]:
    """The most rows inside the array that any output shard's windows read before and after its
    own rows, enumerating every window position."""
    out = self.out(size)
    block, block_out = -(-size // shards), -(-out // shards)
    left = right = 0
    for o in range(out):
      i = o // block_out
      for t in range(self.window):
        p = o * self.stride + t * self.window_dilation - self.padding[0]
        if p % self.base_dilation == 0 and 0 <= p // self.base_dilation < size:
          row = p // self.base_dilation
          left, right = max(left, block * i - row), max(right, row - block * (i + 1) + 1)
    return left, right

  def sent(self, size: int, shards: int) -> int:
    """The rows a halo carries (``halo_rows``), enumerating every window position."""
    out = self.out(size)
    block, block_out = -(-size // shards), -(-out // shards)
    read: dict[int, set[int]] = {}
    for o in range(out):
      for t in range(self.window):
        p = o * self.stride + t * self.window_dilation - self.padding[0]
        if p % self.base_dilation == 0 and 0 <= p // self.base_dilation < size:
          read.setdefault(o // block_out, set()).add(p // self.base_dilation)
    return halo_rows(read, block)

  def scatter_reach(self, size: int, shards: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """The max-pool gradient's reach: the most windows (rows of the cotangent, split like the
    output) and input rows that the windows touching a shard's own rows read before and after
    the shard's own, enumerating every window."""
    out = self.out(size)
    block, block_out = -(-size // shards), -(-out // shards)
    windows, rows = [0, 0], [0, 0]
    for o in range(out):
      read = [p for p in range(o * self.stride - self.padding[0],
                               o * self.stride - self.padding[0] + self.window) if 0 <= p < size]
      for i in {p // block for p in read}:
        windows = [max(windows[0], block_out * i - o), max(windows[1], o - block_out * (i + 1) + 1)]
        rows = [max(rows[0], block * i - min(read)), max(rows[1], max(read) - block * (i + 1) + 1)]
    return (windows[0], windows[1]), (rows[0], rows[1])

  def scatter_sent(self, size: int, shards: int) -> int:
    """The cotangent rows and input rows the max-pool gradient's halos carry: those of the
    windows touching each shard's rows and the rows those windows read."""
    out = self.out(size)
    block, block_out = -(-size // shards), -(-out // shards)
    windows: dict[int, set[int]] = {}
    rows: dict[int, set[int]] = {}
    for o in range(out):
      read = [p for p in range(o * self.stride - self.padding[0],
                               o * self.stride - self.padding[0] + self.window) if 0 <= p < size]
      for i in {p // block for p in read}:
        windows.setdefault(i, set()).add(o)
        rows.setdefault(i, set()).update(read)
    return halo_rows(windows, block_out) + halo_rows(rows, block)

  def scatter_halo_suffices(self, size: int, shards: int) -> bool:
    """Both halos of the max-pool gradient no wider than gathering their dims."""
    (wl, wr), (rl, rr) = self.scatter_reach(size, shards)
    out = self.out(size)
    return wl + wr <= shards * -(-out // shards) and rl + rr <= shards * -(-size // shards)

  def halo_suffices(self, size: int, shards: int) -> bool:
    """An even output and a halo no wider than gathering the dim (all of its blocks)."""
    return (self.out(size) % shards == 0
            and sum(self.reach(size, shards)) <= shards * -(-size // shards))


def halo_rows(read: dict[int, set[int]], block: int) -> int:
  """The rows a halo carries when shard i reads the rows from ``min(read[i])`` to
  ``max(read[i])`` of a dim in blocks of ``block``: on each side, the most rows any shard reads
  past its own block, less the fewest rows next to its block that a shard reading on that side
  skips."""
  lefts, rights = [], []
  for i, rows in read.items():
    lo, hi, start, end = min(rows), max(rows) + 1, block * i, block * (i + 1)
    if lo < start:
      lefts.append((start - lo, start - min(hi, start)))
    if hi > end:
      rights.append((hi - end, max(lo, end) - end))
  return sum(max(far for far, _ in side) - min(near for _, near in side)
             for side in (lefts, rights) if side)


GEOMETRIES = [Geometry(w, s, p, bd, wd) for w, s, p, bd, wd in itertools.product(
    WINDOWS, STRIDES, PADDINGS, DILATIONS, DILATIONS)
              if not (w == 1 and wd == 2)]  # window dilation of a 1-wide window: a duplicate
POOLS = [g for g in GEOMETRIES  # JAX has no transpose of a dilated max-pool's gradient
         if g.base_dilation == g.window_dilation == 1]


def _name(case: tuple) -> str:
  op, g, size = case
  return (f"{op}-w{g.window}s{g.stride}p{g.padding[0]}{g.padding[1]}"
          f"bd{g.base_dilation}wd{g.window_dilation}-{'x'.join(map(str, size))}")


def _cases(sizes, dims, k: int, seed: int, ops=OPS, geometries=GEOMETRIES):
  cases = _sample(sizes, dims, k, seed, ops, geometries)
  return pytest.mark.parametrize("op,g,size", cases, ids=[_name(c) for c in cases])


def _sample(sizes, dims, k: int, seed: int, ops, geometries) -> list[tuple]:
  """``k`` cases of the product, drawn with a fixed seed, three in four of them with an even
  output; ``dims(size)``: (rows, shards) of each windowed dim."""
  cases = [(op, g, size) for op, g, size in itertools.product(ops, geometries, sizes)
           if all(g.out(n) > 0 for n, _ in dims(size))]
  pools: dict[bool, list[tuple]] = {True: [], False: []}
  for c in cases:
    pools[all(c[1].out(n) % m == 0 for n, m in dims(c[2]))].append(c)
  rng = random.Random(seed)
  return rng.sample(pools[True], k - k // 4) + rng.sample(pools[False], k // 4)


@functools.lru_cache(maxsize=None)
def _mesh(axes: tuple[tuple[str, int], ...]):
  return spmd.make_mesh(dict(axes))


def _data(*shape: int, seed: int = 0) -> jax.Array:
  return jnp.asarray(np.random.default_rng(seed).standard_normal(shape).astype(np.float32))


def _windowed(op: str, g: Geometry, dims: tuple[int, ...]):
  """The op over an NHWC-like array (batch, spatial..., channels), windowed along ``dims``."""
  rank = len(dims) + 2
  per = lambda v, one: tuple(v if d in range(1, rank - 1) else one for d in range(rank))  # noqa
  pad = [g.padding if 0 < d < rank - 1 else (0, 0) for d in range(rank)]
  if op == "conv":
    spatial = "HW"[:len(dims)]
    dn = (f"N{spatial}C", f"{spatial}IO", f"N{spatial}C")
    kernel = _data(*(g.window,) * len(dims), 2, 3, seed=1)
    return lambda x: lax.conv_general_dilated(
        x, kernel, (g.stride,) * len(dims), [g.padding] * len(dims),
        (g.base_dilation,) * len(dims), (g.window_dilation,) * len(dims), dimension_numbers=dn)
  init, combine = (-jnp.inf, lax.max) if op == "max" else (0.0, lax.add)
  return lambda x: lax.reduce_window(x, init, combine, per(g.window, 1), per(g.stride, 1), pad,
                                     per(g.base_dilation, 1), per(g.window_dilation, 1))


def _check(fn, args, specs, mesh, *, halo_only: bool, halo_rows: int | None = None) -> spmd.Plan:
  """``assert_partitioned_matches``; then no all-gather where ``halo_only``, and halos of exactly
  ``halo_rows`` rows of the first input where given. Returns the plan."""
  x = args[0]
  plan = assert_partitioned_matches(fn, args, specs, mesh, rtol=1e-4, atol=1e-4)
  if halo_only:  # the plan's kinds are the compiled program's
    assert "all-gather" not in {c.kind for c in plan.collectives}, plan.explain()
  if halo_rows is not None:
    row = x.shape[0] * x.shape[-1] * x.dtype.itemsize
    halos = sum(c.bytes for c in plan.collectives if c.kind == "collective-permute")
    assert halos == halo_rows * row, plan.explain()
  return plan


@_cases(SIZES_1D, lambda s: [s[::-1]], 32, seed=0)
def test_one_sharded_dim(op, g, size):
  shards, n = size
  x = _data(2, n, 2)
  even = g.halo_suffices(n, shards)
  _check(_windowed(op, g, (1,)), (x,), (P(None, "x", None),), _mesh((("x", shards),)),
         halo_only=even, halo_rows=g.sent(n, shards) if even else None)


@_cases(SIZES_2D, lambda s: [(s[0], 2), (s[1], 4)], 12, seed=1)
def test_two_sharded_dims(op, g, size):
  h, w = size
  fn = _windowed(op, g, (1, 2))
  _check(fn, (_data(1, h, w, 2),), (P(None, "a", "b", None),), _mesh((("a", 2), ("b", 4))),
         halo_only=g.halo_suffices(h, 2) and g.halo_suffices(w, 4))


@_cases(SIZES_1D, lambda s: [s[::-1]], 16, seed=2)
def test_gradient_one_sharded_dim(op, g, size):
  """The input gradient: select_and_scatter_add (max), a padded, dilated sum (sum) or an
  lhs-dilated conv (conv), with the cotangent sharded like the output."""
  shards, n = size
  if op == "max" and (g.base_dilation > 1 or g.window_dilation > 1):
    op = "sum"  # JAX has no transpose of a dilated max-pool's gradient
  fn = _windowed(op, g, (1,))
  x = _data(2, n, 2)
  ct = _data(*jax.eval_shape(fn, x).shape, seed=3)
  grad = lambda x, ct: jax.vjp(fn, x)[1](ct)[0]  # noqa: E731
  even = n % shards == 0 and g.halo_suffices(n, shards)
  spec = P(None, "x", None)
  _check(grad, (x, ct), (spec, spec), _mesh((("x", shards),)), halo_only=even)


def _max_pool_gradient(g: Geometry, dims: tuple[int, ...]):
  fn = _windowed("max", g, dims)
  return lambda x, ct: jax.vjp(fn, x)[1](ct)[0]


def _scatters(plan) -> list:
  return [c for c in plan.collectives if c.primitive == "select_and_scatter_add"]


@_cases(SIZES_1D, lambda s: [s[::-1]], 24, seed=3, ops=("max",), geometries=POOLS)
def test_max_pool_gradient_one_sharded_dim(op, g, size):
  """The max-pool gradient, even or uneven, exchanges exactly the windows touching a shard's
  rows and the input rows they read (an uneven result is gathered at the output only)."""
  shards, n = size
  x = _data(2, n, 2)
  ct = _data(2, g.out(n), 2, seed=3)
  spec, mesh = P(None, "x", None), _mesh((("x", shards),))
  fits = g.scatter_halo_suffices(n, shards)
  _check(_max_pool_gradient(g, (1,)), (x, ct), (spec, spec), mesh,
         halo_only=fits and n % shards == 0, halo_rows=g.scatter_sent(n, shards) if fits else None)
  if fits:
    plan = spmd.partition(_max_pool_gradient(g, (1,)), mesh=mesh, in_specs=(spec, spec)).plan(x, ct)
    assert {c.kind for c in _scatters(plan)} <= {"collective-permute"}, plan.explain()


@_cases(SIZES_2D, lambda s: [(s[0], 2), (s[1], 4)], 8, seed=4, ops=("max",), geometries=POOLS)
def test_max_pool_gradient_two_sharded_dims(op, g, size):
  h, w = size
  x = _data(1, h, w, 2)
  ct = _data(1, g.out(h), g.out(w), 2, seed=3)
  spec, mesh = P(None, "a", "b", None), _mesh((("a", 2), ("b", 4)))
  fits = g.scatter_halo_suffices(h, 2) and g.scatter_halo_suffices(w, 4)
  _check(_max_pool_gradient(g, (1, 2)), (x, ct), (spec, spec), mesh,
         halo_only=fits and h % 2 == 0 and w % 4 == 0)
  if fits:
    plan = spmd.partition(_max_pool_gradient(g, (1, 2)), mesh=mesh,
                          in_specs=(spec, spec)).plan(x, ct)
    assert {c.kind for c in _scatters(plan)} <= {"collective-permute"}, plan.explain()


@pytest.mark.parametrize("rows,padding", [(16, "VALID"), (14, "SAME"), (12, "SAME")])
def test_grad_of_flax_max_pool(rows, padding):
  """jax.grad of nn.max_pool, 2x2 windows of stride 2 (aligned with 2-row blocks) or 3x3 of
  stride 2 (crossing them), H and W sharded."""
  x = _data(2, rows, 8, 3)
  for window in ((2, 2), (3, 3)):
    pool = functools.partial(nn.max_pool, window_shape=window, strides=(2, 2), padding=padding)
    grad = jax.grad(lambda x: (pool(x) * jnp.arange(pool(x).size).reshape(pool(x).shape)).sum())
    _check(grad, (x,), (P(None, "a", "b", None),), _mesh((("a", 2), ("b", 4))),
           halo_only=rows % 2 == 0)
