"""XLA's SPMD partitioner cases, round 11 (openxla/xla ``xla/service/spmd/spmd_partitioner_test.cc``,
``xla/service/sharding_propagation_test.cc`` and shardy's propagation and explicit-reshard
tests): families tests/test_xla_cases.py and test_xla_cases3.py to test_xla_cases10.py do not
mirror: multi-operand sorts along an unsharded dim of 3-D tilings and sorts along a dim split over
two axes of 4x2 meshes; top_k of uneven rows; pads with negative and interior padding together on
sharded dims; strided slices with an offset start; a concatenate of transposed tilings; reverses
of uneven (padded) dims; transposes of 4-D tilings with two sharded dims; reshapes splitting a dim
into an uneven tiling and merging dims with the minor one sharded; selects and clamps whose
operands are sharded on other dims; conds whose branches move differently; bitcast-converts to a
wider type over a sharded dim; dots with batch dims over other axes per operand, partial
contracting over two axes, and batch with non-contracting on 4x2; the gradients of average pooling
(a reduce window's) and of max pooling with SAME padding on both spatial dims; backward-filter and
backward-input convolutions with dilated kernels; dynamic slices at a traced index into an uneven
sharded dim; iotas along a sharded dim of 4x2; random bits drawn into 3-D tilings; scatters whose
indices repeat along a sharded operand dim; and the gaps closed this round (a reshard to coarser
blocks on other axes swapping a dim's major axis before gathering the minor ones; base-dilated
dims exchanged undilated).
Each test names the XLA test it mirrors (or the family it extends), checks values, plan ==
compiled HLO and no replicated fallback (tests/helpers.py), and that spmd moves no more bytes
per device than XLA's own partitioner with the same specs; strict xfails give both counts."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

from helpers import indices, ints, no_more_than_xla, randn
from test_xla_cases8 import conv
from test_xla_cases10 import A2B2, A4B2


# --- Sort and top_k ----------------------------------------------------------------------------

def test_sort_two_operands_unsharded_dim_3d():  # SortShardedOnNonSortDims, 3-D tiling
  f = lambda k, v: lax.sort((k, v), dimension=1, num_keys=1)
  no_more_than_xla(f, (randn(4, 8, 4), ints(4, 8, 4)), (P("a", None, ("b", "c")),) * 2,
                   "a2b2c2")


def test_sort_sort_dim_over_two_axes_4x2():  # SortShardedOnSortDim_OneOperand, ('a','b')
  no_more_than_xla(lambda x: jnp.sort(x, axis=1), (randn(8, 16),), P(None, ("a", "b")), A4B2)


def test_sort_descending_sort_dim_sharded_int32():  # SortShardedOnSortDim, descending
  no_more_than_xla(lambda x: jnp.sort(x, axis=0, descending=True), (ints(16, 4),), P("a", "b"),
                   A2B2)


def test_argsort_sort_dim_sharded_3d():  # SortShardedOnSortDim_TwoOperands (argsort's iota)
  no_more_than_xla(lambda x: jnp.argsort(x, axis=2), (randn(4, 4, 8),), P("a", None, "b"),
                   "a2b2c2")


def test_top_k_uneven_rows_4x2():  # PartitionCustomCall TopK, 6 rows over 4
  no_more_than_xla(lambda x: lax.top_k(x, 3), (randn(6, 16),), P("a", "b"), A4B2)


# --- Pad, slice, reverse -----------------------------------------------------------------------

def test_pad_negative_low_interior_sharded_dim_3d():  # PadAlongPartitionedDimensionWithNegative
  f = lambda x: lax.pad(x, np.float32(0), ((-2, 1, 1), (0, 0, 0)))
  no_more_than_xla(f, (randn(8, 4),), P(("a", "b"), "c"), "a2b2c2")


def test_pad_interior_both_dims_negative_high_4x2():  # PadAlongPartitionedDimensionWithInterior
  f = lambda x: lax.pad(x, np.int32(-1), ((1, -2, 1), (0, 1, 2)))
  no_more_than_xla(f, (ints(8, 4),), P("a", "b"), A4B2)


def test_slice_strided_offset_start_uneven_4x2():  # SliceAlongPartitionedDimension, 3:15:4
  no_more_than_xla(lambda x: x[3:15:4] * 2, (randn(16, 4),), P("a", "b"), A4B2)


def test_slice_strided_offset_start_2d_sharded_int32():  # SliceAlongPartitionedDimension2
  no_more_than_xla(lambda x: x[1::3, 2::2], (ints(12, 8),), P("a", "b"), A2B2)


def test_reverse_uneven_dim_4x2():  # TiledReverseHaloExchange, 10 rows over 4
  no_more_than_xla(lambda x: lax.rev(x, (0,)) + 1, (randn(10, 4),), P("a", "b"), A4B2)


def test_reverse_after_pad_sharded_dim():  # ReverseAlongPartitionedDimension of a padded dim
  f = lambda x: lax.rev(jnp.pad(x, ((1, 2), (0, 0))), (0,))
  no_more_than_xla(f, (randn(8, 4),), P("a", "b"), "a2b4")


def test_concatenate_operands_transposed_tilings_open_output():  # ConcatenateAlongNonPartitioned
  """f32[8,4] x P('a','b') and y P('b','a') concatenated along dim 1 on 2x2, output open
  (replicated, as jax.jit's): each operand gathered whole in one all-gather over both axes
  (reshard.py's GatherDims), 256 B; XLA reshards y to x's tiling (96 B), concatenates and
  gathers the result (256 B), 352 B (was 384 B: two all-gathers per operand)."""
  f = lambda x, y: jnp.concatenate([x, y], 1)
  plan = no_more_than_xla(f, (randn(8, 4), randn(8, 4, seed=1)), (P("a", "b"), P("b", "a")),
                          A2B2)
  assert plan.total_bytes == 256, plan.explain()


# --- Transpose, reshape ------------------------------------------------------------------------

def test_transpose_4d_two_sharded_dims():  # MultiDimensionShardedTranspose, 4-D
  no_more_than_xla(lambda x: x.transpose(2, 0, 3, 1), (randn(4, 4, 4, 4),),
                   P("a", None, "b"), A2B2)


def test_transpose_4d_two_sharded_dims_out_spec_4x2():  # TransposeAllToAll, out spec given
  """The transpose's P('b','a') -> P('a','b') on a 4x2 mesh: dim 0 splits finer, dim 1 coarser,
  so each new [1,4,2,4] block is two [1,2,2,4] pieces of old blocks: 2 collective-permutes of
  64 B, 128 B; XLA splits 'a' into sub-axes, 256 B (was 384 B: a2a + permute + a2a)."""
  plan = no_more_than_xla(lambda x: x.transpose(1, 0, 3, 2), (randn(8, 4, 4, 2),), P("a", "b"),
                          A4B2, P("a", "b"))
  assert plan.total_bytes == 128, plan.explain()


def test_reshape_split_into_uneven_tiling_2x2x2():  # ReshapeSplitDim, 12 -> (3, 4) over 4
  no_more_than_xla(lambda x: x.reshape(3, 4, 8) * 2, (randn(12, 8),), P(("a", "b"), "c"),
                   "a2b2c2")


def test_reshape_merge_minor_dim_sharded_4x2():  # ReshapeMergeDimsWithHaloExchange, minor split
  no_more_than_xla(lambda x: x.reshape(32, 4), (randn(4, 8, 4),), P(None, "a", "b"), A4B2)


def test_reshape_split_major_keeps_tiling_out_spec():  # ReshapeWithReshard, out spec other dim
  no_more_than_xla(lambda x: x.reshape(4, 4, 8), (randn(16, 8),), P("a"), "a2b4",
                   P(None, None, "b"))


# --- Select, clamp, cond, convert ----------------------------------------------------------------

def test_select_operands_on_other_dims_4x2():  # Select, pred on rows, x on columns
  f = lambda p, x, y: jnp.where(p > 0, x, y)
  no_more_than_xla(f, (randn(8, 8), randn(8, 8, seed=1), randn(8, 8, seed=2)),
                   (P("a"), P(None, "b"), P()), A4B2)


def test_clamp_bounds_on_other_axes_2x2():  # Clamp, lo and hi tiled unlike x
  f = lambda lo, x, hi: lax.clamp(lo, x, hi)
  no_more_than_xla(f, (randn(8, 8) - 1, randn(8, 8, seed=1), randn(8, 8, seed=2) + 1),
                   (P("b"), P("a", "b"), P(None, "a")), A2B2)


def test_cond_branches_move_differently_3d():  # Conditional, a transpose vs a reduction
  """The reduction's [1,8] P(None,('b','c')) is read as P(None,'a') by the broadcast: two
  collective-permutes of the [1,2] block (reshard.py's ExchangePieces), 8 + 16 = 24 B with the
  all-reduce (was 32 B, as XLA: a permute swapping 'b' for 'a' and a gather over 'c'; 40 B
  before that, gathered whole)."""
  f = lambda p, x: lax.cond(p, lambda v: v.T * 2, lambda v: jnp.broadcast_to(
      v.sum(0, keepdims=True), v.shape), x)
  for p in (True, False):
    plan = no_more_than_xla(f, (np.bool_(p), randn(8, 8)), (P(), P("a", ("b", "c"))), "a2b2c2")
    assert plan.total_bytes == 24, plan.explain()


def test_reshard_to_coarser_blocks_swapped_major_axis_3d():  # ReshardTiledTo, (('b','c'),) -> a
  """Each [4,4] block of P('a') is two [2,4] blocks of P(('b','c')): two collective-permutes of
  the old block (reshard.py's ExchangePieces), 64 B (was 96 B, as XLA: a permute swapping 'b'
  for 'a' and a gather over 'c'; 128 B before that, gathered whole and sliced)."""
  plan = no_more_than_xla(lambda x: x * 2, (randn(8, 4),), P(("b", "c")), "a2b2c2", P("a"))
  assert plan.total_bytes == 64, plan.explain()


def test_bitcast_convert_to_wider_sharded_dims_3d():  # BitcastConvert, u16[...,2] -> f32
  f = lambda x: lax.bitcast_convert_type(x, jnp.float32) * 1
  x = np.asarray(randn(8, 8)).view(np.uint16).reshape(8, 8, 2)
  no_more_than_xla(f, (x,), P("a", ("b", "c")), "a2b2c2")


def test_convert_int_to_bf16_then_reshard():  # Convert, then an all-to-all of the bf16 values
  no_more_than_xla(lambda x: x.astype(jnp.bfloat16) * 2, (ints(8, 8),), P("a", "b"), A4B2,
                   P(None, "a"))


# --- Dots --------------------------------------------------------------------------------------

def test_dot_batch_on_other_axes_per_operand_3d():  # DotBatchAndNonContracting, batch disputed
  f = lambda x, y: jnp.einsum("bmk,bkn->bmn", x, y)
  no_more_than_xla(f, (randn(4, 8, 4), randn(4, 4, 8, seed=1)),
                   (P("a", "b"), P("c", None, "b")), "a2b2c2")


def test_dot_partial_contracting_two_axes_4x2():  # DotPartialContracting, ('a','b') contracting
  no_more_than_xla(lambda x, y: x @ y, (randn(8, 16), randn(16, 8, seed=1)),
                   (P(None, ("a", "b")), P(("a", "b"))), A4B2, P("a", "b"))


def test_dot_batch_and_non_contracting_4x2():  # DotBatchAndNonContracting, out spec given
  f = lambda x, y: jnp.einsum("bmk,bkn->bmn", x, y)
  no_more_than_xla(f, (randn(4, 8, 4), randn(4, 4, 8, seed=1)),
                   (P("a", "b"), P("a", None, "b")), A4B2, P("a", "b"))


def test_dot_contracting_partial_and_batch_2x4():  # DotPartialContracting2 with a batch dim
  f = lambda x, y: jnp.einsum("bmk,bkn->bmn", x, y)
  no_more_than_xla(f, (randn(2, 4, 8), randn(2, 8, 4, seed=1)),
                   (P("a", None, "b"), P("a")), "a2b4")


# --- Pooling and convolution gradients ---------------------------------------------------------

def test_avg_pool_gradient_spatial_sharded():  # ReduceWindow gradient, strided, padded
  pool = lambda x: lax.reduce_window(x, 0.0, lax.add, (1, 3, 3, 1), (1, 2, 2, 1), "SAME") / 9
  f = lambda x: jax.grad(lambda v: (pool(v) ** 2).sum())(x)
  no_more_than_xla(f, (randn(2, 8, 8, 2),), P(None, "a", "b"), A2B2)


def test_max_pool_gradient_same_both_spatial_3d():  # SelectAndScatter, SAME, H and W sharded
  pool = lambda x: lax.reduce_window(x, -jnp.inf, lax.max, (1, 3, 3, 1), (1, 2, 2, 1), "SAME")
  f = lambda x: jax.grad(lambda v: (pool(v) * 2).sum())(x)
  no_more_than_xla(f, (randn(2, 8, 8, 2),), P("c", "a", "b"), "a2b2c2")


def test_conv_backward_input_dilated_kernel():  # backward-input convolution, rhs dilation 2
  f = lambda x, k: jax.grad(lambda v: (conv(v, k, rhs_dilation=(2, 2)) ** 2).sum())(x)
  no_more_than_xla(f, (randn(2, 8, 8, 2), randn(3, 3, 2, 2, seed=1)),
                   (P(None, "a"), P()), A4B2, rtol=1e-4, atol=1e-4)


def test_conv_backward_input_strided_two_spatial_dims_3d():  # backward input, lhs dilation 2
  """The cotangent is base-dilated along H and W: its W halo is one column of the H-widened
  block's 3 rows undilated, f32[1,3,1,2] 24 B, as XLA (was 48 B: 6 rows, exchanged after H's
  dilation); 112 B in all, as XLA (was 136 B)."""
  f = lambda x, k: jax.grad(lambda v: (conv(v, k, (2, 2)) ** 2).sum())(x)
  plan = no_more_than_xla(f, (randn(2, 8, 8, 2), randn(3, 3, 2, 2, seed=1)),
                          (P("c", "a", "b"), P()), "a2b2c2", rtol=1e-4, atol=1e-4)
  assert plan.total_bytes == 112, plan.explain()


def test_conv_backward_filter_spatial_sharded_4x2():  # backward-filter convolution, H on 'a'
  f = lambda x, k: jax.grad(lambda w: (conv(x, w) ** 2).sum())(k)
  no_more_than_xla(f, (randn(2, 8, 8, 2), randn(3, 3, 2, 2, seed=1)),
                   (P("b", "a"), P()), A4B2, rtol=1e-4, atol=1e-4)


# --- Dynamic slice, iota, random, scatter ------------------------------------------------------

def test_dynamic_slice_traced_index_uneven_dim():  # DynamicSliceAlongPartitionedDimension
  f = lambda x, i: lax.dynamic_slice_in_dim(x, i, 3, axis=0)
  no_more_than_xla(f, (randn(10, 8), np.int32(6)), (P("a", "b"), P()), A4B2)


def test_iota_along_sharded_dim_4x2_uint32():  # U32IotaAlongTileDimension, 4x2
  f = lambda x: x + lax.broadcasted_iota(jnp.uint32, x.shape, 0) * 3
  no_more_than_xla(f, (np.arange(64, dtype=np.uint32).reshape(16, 4),), P("a", "b"), A4B2)


def test_random_bits_into_3d_tiling():  # Rng, random bits of a 3-D tiling
  no_more_than_xla(lambda k: jax.random.bits(k, (4, 4, 8)), (jax.random.key(3),), P(),
                   "a2b2c2", P("a", "b", "c"))


def test_random_normal_into_4x2_tiling_transposed():  # Rng, sharded shape, axes transposed
  no_more_than_xla(lambda k: jax.random.normal(k, (8, 8)), (jax.random.key(7),), P(), A4B2,
                   P("b", "a"))


def test_scatter_add_duplicate_indices_sharded_dim():  # Scatter, indices repeat, rows sharded
  f = lambda x, i, u: x.at[i].add(u)
  i = np.array([1, 5, 1, 7, 5, 1], np.int32)
  no_more_than_xla(f, (randn(8, 4), i, randn(6, 4, seed=1)), (P("a", "b"), P(), P(None, "b")),
                   A4B2)


def test_scatter_max_duplicate_indices_sharded_3d():  # Scatter, indices repeat, both sharded
  f = lambda x, i, u: x.at[i].max(u)
  no_more_than_xla(f, (randn(8, 4), indices(8, 8), randn(8, 4, seed=1)),
                   (P(("a", "b"), "c"), P("a"), P("a", "c")), "a2b2c2")
