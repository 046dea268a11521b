"""XLA's SPMD partitioner cases, round 12 (openxla/xla ``xla/service/spmd/spmd_partitioner_test.cc``,
``xla/service/sharding_propagation_test.cc`` and shardy's propagation and explicit-reshard
tests): families tests/test_xla_cases.py and test_xla_cases3.py to test_xla_cases11.py do not
mirror: gathers whose parallel (batch) dim is split unlike the indices', replicated or partially
replicated on one side, or with swapped parallel dims, and gathers merging index parallel, operand
passthrough, trivially sliced and index passthrough dims; scatters of the same families (the
update window split, the parallel dim redistributed on indices or updates, partial replication);
argmax / argmin and a (value, index) tuple reduce along sharded dims with mesh axes left
replicated; partially replicated shardings meeting full tilings (elementwise, reshapes, halo
exchanges, dots); dynamic-update-slices whose update spans a sharded dim; concatenates of three
operands over three axes; pads then slices (a shift left); broadcasts into a sharded dim;
operands whose annotations conflict (which one an op takes); while loops swapping sharded carries.
Each test names the XLA test it mirrors (or the family it extends), checks values, plan ==
compiled HLO and no replicated fallback (tests/helpers.py), and that spmd moves no more bytes
per device than XLA's own partitioner with the same specs; strict xfails give both counts."""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from helpers import get_mesh, indices, ints, no_more_than_xla, randn
from test_xla_cases10 import A2B2, A4B2

rows_at = lambda x, i: jnp.take_along_axis(x, i, axis=1)  # a gather with a parallel dim 0
rows_add = lambda x, i, u: x.at[jnp.arange(x.shape[0])[:, None], i].add(u)  # its scatter


# --- Gather: parallel dims ---------------------------------------------------------------------

def test_gather_parallel_dim_redistribution_indices():  # GatherParallelDimRedistributionIndices
  no_more_than_xla(rows_at, (randn(8, 16), indices(16, 8, 4)), (P("a"), P("b")), "a2b4")


def test_gather_parallel_dim_replicated_operand():  # GatherParallelDimReplicatedOperand
  no_more_than_xla(rows_at, (randn(8, 16), indices(16, 8, 4)), (P(), P("a", "b")), A4B2)


def test_gather_parallel_dim_partial_replicated_indices():  # ...PartialReplicatedIndices
  no_more_than_xla(rows_at, (randn(8, 16), indices(16, 8, 4)), (P(("a", "b")), P("a")),
                   "a2b2c2")


def test_gather_parallel_dim_partial_replicated_operand():  # ...PartialReplicatedOperand
  no_more_than_xla(rows_at, (randn(8, 16), indices(16, 8, 4)), (P("a"), P(("a", "b"))),
                   "a2b2c2")


def test_gather_parallel_dim_swapped_dimensions():  # GatherParallelDimSwappedDimensions
  f = lambda x, i: x[jnp.arange(4)[None, :], jnp.arange(8)[:, None], i]
  no_more_than_xla(f, (randn(4, 8, 6), indices(6, 8, 4)), (P("a", "b"), P("b", "a")), A2B2)


# --- Gather: merged families -------------------------------------------------------------------

def test_gather_merged_index_parallel_and_index_passthrough():  # GatherMergedIndexParallelAnd...
  no_more_than_xla(rows_at, (randn(8, 16), indices(16, 8, 8)), (P("a"), P("a", "b")), "a2b4")


def test_gather_merged_index_parallel_and_trivial_sliced_operand():  # ...TrivialSlicedOperand
  no_more_than_xla(rows_at, (randn(8, 16), indices(16, 8, 4)), (P("a", "b"), P("a")), "a2b4")


def test_gather_merged_operand_passthrough_and_trivial_sliced():  # GatherMergedOperandPassthr...
  no_more_than_xla(lambda x, i: x[i], (randn(16, 8), indices(16, 4)), (P("a", "b"), P()), A4B2)


def test_gather_merged_operand_passthrough_and_index_passthrough():  # ...AndIndexPassthrough
  no_more_than_xla(lambda x, i: x[i], (randn(16, 8), indices(16, 8)), (P(None, "b"), P("a")),
                   "a2b4")


def test_gather_merged_trivial_sliced_operand_and_index_passthrough():  # GatherMergedTrivial...
  no_more_than_xla(lambda x, i: x[i], (randn(16, 8), indices(16, 8)), (P("a"), P("b")), A2B2)


def test_gather_operand_passthrough_index_passthrough_3d():  # GatherOperandPassthroughIndexPass.
  no_more_than_xla(lambda x, i: x[i], (randn(16, 8), indices(16, 4, 2)),
                   (P(None, "c"), P("a", "b")), "a2b2c2")


# --- Scatter: parallel dims and merged families ------------------------------------------------

def test_scatter_parallel_dim_redistribution_indices():  # ScatterParallelDimRedistributionIndices
  no_more_than_xla(rows_add, (randn(8, 16), indices(16, 8, 4), randn(8, 4, seed=1)),
                   (P("a"), P("b"), P("a")), "a2b4")


def test_scatter_parallel_dim_redistribution_update():  # ScatterParallelDimRedistributionUpdate
  no_more_than_xla(rows_add, (randn(8, 16), indices(16, 8, 4), randn(8, 4, seed=1)),
                   (P("a"), P("a"), P("b")), "a2b4")


def test_scatter_parallel_dim_replicated_indices():  # ScatterParallelDimReplicatedIndices
  no_more_than_xla(rows_add, (randn(8, 16), indices(16, 8, 4), randn(8, 4, seed=1)),
                   (P("a", "b"), P(), P("a")), A4B2)


def test_scatter_parallel_dim_replicated_operand():  # ScatterParallelDimReplicatedOperand
  no_more_than_xla(rows_add, (randn(8, 16), indices(16, 8, 4), randn(8, 4, seed=1)),
                   (P(), P("a"), P("a")), A4B2, P("a"))


def test_scatter_parallel_dim_replicated_update():  # ScatterParallelDimReplicatedUpdate
  no_more_than_xla(rows_add, (randn(8, 16), indices(16, 8, 4), randn(8, 4, seed=1)),
                   (P("a"), P("a"), P()), "a2b2c2")


def test_scatter_parallel_dim_partial_replicated_index():  # ScatterParallelDimPartialReplicated..
  no_more_than_xla(rows_add, (randn(8, 16), indices(16, 8, 4), randn(8, 4, seed=1)),
                   (P(("a", "b")), P("a"), P(("a", "b"))), "a2b2c2")


def test_scatter_merged_index_parallel_and_operand_passthrough():  # ScatterMergedIndexParallel..
  f = lambda x, i, u: x.at[jnp.arange(8)[:, None], i].add(u)
  no_more_than_xla(f, (randn(8, 16, 4), indices(16, 8, 3), randn(8, 3, 4, seed=1)),
                   (P("a", None, "b"), P("a"), P("a", None, "b")), A2B2)


def test_scatter_merged_index_parallel_and_trivial_sliced_operand():  # ...TrivialSlicedOperand
  no_more_than_xla(rows_add, (randn(8, 16), indices(16, 8, 4), randn(8, 4, seed=1)),
                   (P("a", "b"), P("a"), P("a")), "a2b4")


def test_scatter_merged_index_parallel_and_index_passthrough():  # ...AndIndexPassthrough
  no_more_than_xla(rows_add, (randn(8, 16), indices(16, 8, 8), randn(8, 8, seed=1)),
                   (P("a"), P("a", "b"), P("a", "b")), "a2b4")


def test_scatter_merged_operand_passthrough_and_index_passthrough():  # ScatterMergedOperandPass..
  f = lambda x, i, u: x.at[i].add(u)
  no_more_than_xla(f, (randn(16, 8), indices(16, 8), randn(8, 8, seed=1)),
                   (P(None, "b"), P("a"), P("a", "b")), A2B2)


# --- Tuple reductions --------------------------------------------------------------------------

def test_argmax_sharded_dim_4x2():  # TiledToTiledTupleReduce (argmax), 4x2
  no_more_than_xla(lambda x: jnp.argmax(x, axis=1), (randn(8, 16),), P("a", "b"), A4B2)


def test_argmin_int32_ties_partial_replicate_3d():  # TiledToPartiallyTiledTupleReduce, ties
  no_more_than_xla(lambda x: jnp.argmin(x, axis=0), (ints(16, 4, high=3),), P(("a", "b")),
                   "a2b2c2")


def test_max_with_index_tuple_reduce_partial_replicate():  # TiledToTiledTupleReduce, lax.reduce
  def f(x):
    def pick(a, b):
      take = (a[0] > b[0]) | ((a[0] == b[0]) & (a[1] < b[1]))
      return jnp.where(take, a[0], b[0]), jnp.where(take, a[1], b[1])
    iota = lax.broadcasted_iota(jnp.int32, x.shape, 0)
    return lax.reduce((x, iota), (np.float32(-np.inf), np.int32(0)), pick, (0,))
  no_more_than_xla(f, (randn(16, 4),), P("b"), "a2b4")


# --- Partial replication -----------------------------------------------------------------------

def test_partial_replicate_elementwise_meets_tiled():  # PartialReplicateElementwise
  no_more_than_xla(lambda x, y: x * y + 1, (randn(8, 8), randn(8, 8, seed=1)),
                   (P("a"), P("a", "b")), "a2b4")


def test_partial_replicate_to_partial_replicate_3d():  # PartialReplicateToPartialReplicate
  no_more_than_xla(lambda x: x * 2, (randn(8, 8),), P(None, "a"), "a2b2c2", P("c"))


def test_tile_to_partial_replicate_halo_exchange():  # TileToPartialReplicateHaloExchange
  f = lambda x: jnp.pad(x, ((1, 1), (0, 0)))[:-2] + x
  no_more_than_xla(f, (randn(16, 4),), P("a"), A4B2)


def test_partial_replicate_reshape_merge():  # PartialReplicateReshape, 'b' replicated
  no_more_than_xla(lambda x: x.reshape(64) * 2, (randn(8, 8),), P("a"), A2B2)


def test_coarser_blocks_beside_a_kept_dim_3d():  # ReshardTiledTo, ('a','b') -> 'b' beside 'c'
  """Each [2,4] block of P('c','b') is two [2,2] blocks of P('c',('a','b')): two
  collective-permutes of the old block (ExchangePieces), 32 B, where XLA permutes and gathers."""
  plan = no_more_than_xla(lambda x: x * 2, (randn(4, 8),), P("c", ("a", "b")), "a2b2c2",
                          P("c", "b"))
  assert plan.total_bytes == 32, plan.explain()


def test_reshard_permutes_the_block_before_gathering_a_dropped_axis_3d():  # ReshardTiledTo
  """P('a','b') -> P(None,('c','b')) of f32[8,16]: each device's new [8,4] block is a column
  quarter of the 'b' half held by the devices with b == its c, in both 'a' row halves: two
  [4,4] pieces, each taken by a collective-permute (``ExchangePieces``), 128 B. A permute into
  P('a',('c','b')) then a gather of 'a' moves 192 B, as XLA (768 B before that: 'a'
  gathered first, then the columns gathered whole and sliced)."""
  plan = no_more_than_xla(lambda x: x * 2, (randn(8, 16),), P("a", "b"), "a2b2c2",
                          P(None, ("c", "b")))
  assert plan.total_bytes == 128, plan.explain()


def test_dot_lhs_partial_replicate_rhs_tiled_3d():  # DotPartialDeviceOrder-like, 2x2x2
  no_more_than_xla(lambda x, y: x @ y, (randn(8, 8), randn(8, 16, seed=1)),
                   (P("a"), P(None, ("b", "c"))), "a2b2c2")


def test_dot_contracting_disputed_rows_from_out_spec():  # DotPartialContracting, out spec rows
  """x's contracting dim is on 'a', y's on 'b', the result's rows on 'a': x's [4,6] block of
  P('a','b') is taken in one collective-permute (96 B) and the [4,8] partial sum over 'b' is
  all-reduced (128 B), 224 B, where XLA moves 320 B (was 448 B: y moved to 'a' and the [8,8]
  partial sum reduce-scattered; the op ran in each operand's layout only with its operands'
  axes, not the result's rows)."""
  plan = no_more_than_xla(lambda x, y: x @ y, (randn(8, 12), randn(12, 8, seed=1)),
                          (P(None, "a"), P("b")), A2B2, P("a"))
  assert plan.total_bytes == 224, plan.explain()


# --- Dynamic update slice, concatenate, pad, broadcast -----------------------------------------

def test_dynamic_update_slice_update_spans_sharded_dim():  # PartialReplicateDynamicUpdateSlice
  f = lambda x, u, i: lax.dynamic_update_slice(x, u, (0, i))
  no_more_than_xla(f, (randn(8, 8), randn(8, 2, seed=1), np.int32(3)),
                   (P("a", "b"), P("a"), P()), A2B2)


def test_dynamic_update_slice_literal_update_spans_rows_3d():  # DUSAlongNonPartitionedDimension
  f = lambda x, u: lax.dynamic_update_slice(x, u, (0, 5))
  no_more_than_xla(f, (randn(8, 8), randn(8, 2, seed=1)), (P(("a", "b"), "c"), P()), "a2b2c2")


def test_concatenate_three_even_pieces_three_axes():  # ConcatenateAlongPartitionedDimension
  f = lambda x, y, z: jnp.concatenate([x, y, z])
  no_more_than_xla(f, (randn(8, 4), randn(8, 4, seed=1), randn(8, 4, seed=2)),
                   (P(("a", "b", "c")),) * 3, "a2b2c2")


def test_pad_then_slice_shift_left():  # MergedPadThenSliceShiftLeft
  no_more_than_xla(lambda x: jnp.pad(x, ((0, 2), (0, 0)))[2:], (randn(16, 4),), P("a", "b"),
                   A4B2)


def test_broadcast_into_sharded_new_dim():  # Broadcast, the new dim tiled by the out spec
  no_more_than_xla(lambda v: jnp.broadcast_to(v[:, None], (8, 16)) * 2, (randn(8),), P("a"),
                   "a2b4", P("a", "b"))


# --- Conflicting annotations, while loops ------------------------------------------------------

def test_add_of_conflicting_annotations():  # shardy op priorities: operands annotated apart
  mesh = get_mesh("a2b4")
  s = lambda v, spec: lax.with_sharding_constraint(v, NamedSharding(mesh, spec))
  f = lambda x, y: jnp.exp(s(x * 2, P("a", "b")) + s(y * 3, P("b")))
  no_more_than_xla(f, (randn(8, 8), randn(8, 8, seed=1)), (P(), P()), mesh)


def test_while_swaps_sharded_carries():  # While, carries P('a') and P('b') swapped each trip
  """Each trip takes P('b')'s [2,8] blocks into P('a')'s [4,8] ones by two collective-permutes
  (reshard.py's ExchangePieces, 128 B) and P('a')'s into P('b')'s by one (64 B): 192 B, where XLA
  permutes and gathers pairs, 256 B (was 320 B: 'b' gathered whole and sliced)."""
  f = lambda x, y: lax.fori_loop(0, 3, lambda i, c: (jnp.sin(c[1]), c[0] * 2), (x, y))
  plan = no_more_than_xla(f, (randn(8, 8), randn(8, 8, seed=1)), (P("a"), P("b")), "a2b4",
                          (P("a"), P("b")))
  assert plan.total_bytes == 192, plan.explain()


def test_while_body_constrains_carry_two_ways():  # While, the carry's sharding changes twice
  mesh = get_mesh("a2b4")
  s = lambda v, spec: lax.with_sharding_constraint(v, NamedSharding(mesh, spec))
  f = lambda x: lax.fori_loop(
      0, 3, lambda i, c: s(jnp.sin(s(c, P(None, "b"))) * 2, P("a")), x)
  no_more_than_xla(f, (randn(8, 8),), P("a"), mesh, P("a"))
