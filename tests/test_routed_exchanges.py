"""Exchanges whose rows come from shards at several distances (halo_geometry.py): the runs of
rows a shard takes from others travel in shared collective-permutes (each device sends one run
and receives one per permute) rather than one permute per distance, and a concatenate along a
sharded dim exchanges its operands' blocks together, one permute carrying runs of any operand.

The geometry is checked on its own (every shard's rows rebuilt from the pieces as halo.py cuts
and routes them, against numpy), then partitioned programs: values, plan == compiled HLO, no
replicated fallback and no more bytes per device than XLA's own partitioner, on the test meshes,
even and uneven, for concatenates (two and three operands, bf16, int32, a gradient), strided and
shifted slices, pools and pads whose shards hold one or two rows."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

from helpers import ints, no_more_than_xla, randn, rng
from spmd.partition.halo_geometry import (Rotation, Window, hops, plan_concatenation,
                                          plan_rotation, plan_window)


def rebuilt(r: Rotation, blocks: list[np.ndarray], pad: float) -> list[np.ndarray]:
  """Each shard's rows of ``r``, as halo.py's ``rotate`` makes them from the shards' ``blocks``:
  every piece cut by its sender at its start, sent along its routes (or kept, without routes),
  concatenated and read at ``positions`` (-1: ``pad``)."""
  out = []
  for i in range(r.shards):
    parts = []
    for hop in r.pieces:
      sender = next((s for s, d in hop.routes if d == i), None) if hop.routes else i
      if sender is None:  # a permute that sends this shard nothing delivers zeros
        parts.append(np.zeros(hop.rows))
      else:
        parts.append(blocks[sender][hop.starts[sender]:hop.starts[sender] + hop.rows])
    buf = np.concatenate(parts)
    positions = range(r.length) if r.positions is None else r.positions[i]
    out.append(np.array([pad if p < 0 else buf[p] for p in positions]))
  return out


def blocks_of(rows: np.ndarray, shards: int) -> list[np.ndarray]:
  """The padded blocks a dim of ``rows`` splits into (padding: NaN)."""
  block = -(-len(rows) // shards)
  padded = np.concatenate([rows, np.full(block * shards - len(rows), np.nan)])
  return [padded[block * i:block * (i + 1)] for i in range(shards)]


def assert_one_run_per_device(r: Rotation) -> None:
  for hop in hops(r):
    assert len({s for s, _ in hop.routes}) == len(hop.routes) == len({d for _, d in hop.routes})


@pytest.mark.parametrize("seed", range(40))
def test_window_pieces_rebuild_every_span(seed: int):
  """Random undilated windows over up to 9 shards: where the pieces are chosen over the halo,
  every shard's span (rows outside the array as pad) is rebuilt exactly from them."""
  g = rng(seed)
  shards, size = int(g.integers(2, 10)), int(g.integers(2, 40))
  window, stride = int(g.integers(1, 5)), int(g.integers(1, 4))
  lo, hi = (int(v) for v in g.integers(-2, 4, 2))
  out = (size + lo + hi - window) // stride + 1
  if out < 1:
    return
  w = Window(size, out, window, stride, lo, hi)
  planned = plan_window(0, 0, ("x",), w, shards)
  if not isinstance(planned, Rotation):
    return
  assert_one_run_per_device(planned)
  rows = np.arange(size, dtype=float)
  block_out = -(-out // shards)
  span = planned.length
  for i, got in enumerate(rebuilt(planned, blocks_of(rows, shards), -1.0)):
    if i * block_out >= out:
      break
    first = i * block_out * stride - lo
    want = [rows[p] if 0 <= p < size else -1.0 for p in range(first, first + span)]
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("seed", range(40))
def test_concatenation_pieces_rebuild_every_result_block(seed: int):
  """Random concatenates of 2-4 operands over up to 9 shards: each shard's result block is
  rebuilt from its operands' blocks concatenated, every permute one run per device."""
  g = rng(seed)
  shards = int(g.integers(2, 10))
  sizes = tuple(int(n) for n in g.integers(2, 30, int(g.integers(2, 5))))
  r = plan_concatenation(1, ("x",), sizes, shards)
  assert_one_run_per_device(r)
  operands = [np.arange(n, dtype=float) + 100 * k for k, n in enumerate(sizes)]
  joined = [np.concatenate(parts) for parts in zip(*(blocks_of(x, shards) for x in operands))]
  whole = np.concatenate(operands)
  for got, want in zip(rebuilt(r, joined, np.nan), blocks_of(whole, shards)):
    keep = ~np.isnan(want)  # an uneven result's padding may hold anything
    np.testing.assert_array_equal(got[keep], want[keep])


def test_a_roll_of_an_even_dim_needs_no_reordering():
  """A roll's rows arrive in order: the pieces are the block (positions None), one permute."""
  r = plan_rotation(0, 0, ("x",), 16, 4, 1)
  assert r.positions is None and len(hops(r)) == 1


def test_runs_at_several_distances_share_a_permute():
  """Result block i of concatenate([x, x]) (16 rows each, 8 shards of 2) is x's blocks 2i and
  2i + 1 (i < 4) or 2i - 8 and 2i - 7: each shard sends two runs and receives two, 2 permutes
  of 2 rows where rotations by each distance take 7."""
  r = plan_concatenation(0, ("x",), (16, 16), 8)
  assert [h.rows for h in hops(r)] == [2, 2]


CONCATENATES = [  # (operands' sizes along dim 1, spec, mesh)
    ((16, 16), P(None, "x"), "x4"),
    ((16, 16), P(None, "x"), "x8"),
    ((16, 16), P(None, ("b", "a")), "a2b4"),
    ((16, 16), P("a", "b"), "a2b4"),
    ((32, 32), P(None, ("a", "b")), "a2b4"),
    ((16, 48), P(None, "x"), "x4"),
    ((24, 40), P(None, "x"), "x8"),
    ((16, 8, 8), P(None, ("a", "b", "c")), "a2b2c2"),
    ((13, 11), P(None, "x"), "x4"),
    ((16, 32, 5), P(None, ("b", "a")), "a2b4"),
]


@pytest.mark.parametrize("sizes,spec,mesh", CONCATENATES)
def test_concatenate_along_a_sharded_dim(sizes, spec, mesh):
  xs = tuple(randn(8, n, seed=k) for k, n in enumerate(sizes))
  no_more_than_xla(lambda *xs: jnp.concatenate(xs, 1), xs, (spec,) * len(xs), mesh)


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.int32])
def test_concatenate_of_other_dtypes(dtype):
  xs = (randn(8, 24).astype(dtype) if dtype != jnp.int32 else ints(8, 24),
        randn(8, 40, seed=1).astype(dtype) if dtype != jnp.int32 else ints(8, 40, seed=1))
  no_more_than_xla(lambda x, y: jnp.concatenate([x, y], 1), xs, (P(None, "x"),) * 2, "x8")


def test_gradient_through_a_concatenate_along_a_sharded_dim():
  """The cotangent of each operand is its slice of the result's: routed back the other way."""
  def loss(x, y, w):
    return jnp.sum(jnp.tanh(jnp.concatenate([x, y], 1)) * w)

  args = (randn(8, 24), randn(8, 40, seed=1), randn(8, 64, seed=2))
  no_more_than_xla(jax.grad(loss, argnums=(0, 1)), args, (P(None, "x"),) * 3, "x8")


def test_a_concatenate_beside_a_replicated_operand_pads_it_into_place():
  """An operand held whole is read whole, the others exchanged each on its own."""
  args = (randn(8, 16), randn(8, 16, seed=1))
  no_more_than_xla(lambda x, y: jnp.concatenate([x, y], 1), args, (P(None, "x"), P()), "x8")


ONE_ROW_SHARDS = {  # (function, rows): shards of 1-3 rows whose spans reach several distances
    "shifted_slice": (lambda x: x[2:10], 16),
    "strided_slice": (lambda x: x[:16:2], 24),
    "shifted_strided_slice": (lambda x: x[3:19:2], 24),
    "max_pool_2_stride_2": (lambda x: lax.reduce_window(x, -jnp.inf, lax.max, (2, 1), (2, 1),
                                                        "VALID"), 16),
    "sum_pool_3_stride_2_same": (lambda x: lax.reduce_window(x, 0.0, lax.add, (3, 1), (2, 1),
                                                             "SAME"), 16),
    "pad_by_one": (lambda x: jnp.pad(x, ((1, 1), (0, 0)))[:16], 16),
}


@pytest.mark.parametrize("name", ONE_ROW_SHARDS)
@pytest.mark.parametrize("mesh,spec", [("x8", P("x")), ("a2b4", P(("b", "a"))),
                                       ("a2b2c2", P(("a", "b", "c")))])
def test_windows_over_one_row_shards(name, mesh, spec):
  fn, rows = ONE_ROW_SHARDS[name]
  no_more_than_xla(fn, (randn(rows, 8),), (spec,), mesh)


def test_two_concatenates_sharing_one_operand_exchange_each_their_own_blocks():
  """[x, h] and [x, 2h] (a GRU cell's two concatenates) each exchange their joined blocks: the
  plan took the second's pieces for the first's, keyed by operand 0 alone (x), where the
  program cuts them from both operands' blocks, and XLA runs both (plan 368 B, HLO 416 B in
  tests/test_flax_zoo5.py)."""
  def f(x, h):
    return jnp.concatenate([x, h], 1), jnp.concatenate([x, 2 * h], 1)

  no_more_than_xla(f, (randn(4, 8), randn(4, 16, seed=1)), (P(None, "x"), P(None, "x")), "x4")
