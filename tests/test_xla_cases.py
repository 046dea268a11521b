"""XLA's own SPMD partitioner cases (openxla/xla ``xla/service/spmd/spmd_partitioner_test.cc``
and the dot, convolution and gather/scatter handlers' behaviours), rewritten as JAX functions
with PartitionSpecs on the test meshes and run through tests/helpers.py's one check (values equal
to the unpartitioned function's, plan == compiled HLO, no replicated fallback). Each case names
the XLA test it mirrors; shapes are shrunk, and where the XLA test uses an even size an uneven
one is often taken instead. ``last_tile_dim_replicate`` shardings are specs naming fewer mesh
axes than the mesh has; a transposed device order is a dim sharded over ("b", "a") rather than
("a", "b"). tests/test_jax_cases.py holds the primitive-level cases; these do not repeat them."""
from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from helpers import assert_partitioned_matches as check
from helpers import Cases, check_jit, get_mesh, indices, ints, no_more_than_xla, randn, xla_bytes

NHWC = ("NHWC", "HWIO", "NHWC")
# XLA's weight-gradient form f01b_i01o->01bf: lhs (C, H, W, N), rhs (I, H, W, O), out (H, W, N, C)
WGRAD = ("CHWN", "IHWO", "HWNC")
BF16 = jnp.bfloat16
CASES = Cases()

case = CASES.register


def argmax_reduce(x: jax.Array, axis: int) -> tuple[jax.Array, jax.Array]:
  """XLA's variadic (value, index) reduce, as JAX writes an argmax by hand."""
  idx = lax.broadcasted_iota(jnp.int32, x.shape, axis)

  def pick(a, b):
    take_a = (a[0] > b[0]) | ((a[0] == b[0]) & (a[1] < b[1]))
    return jnp.where(take_a, a[0], b[0]), jnp.where(take_a, a[1], b[1])
  return lax.reduce((x, idx), (jnp.array(-jnp.inf, x.dtype), jnp.int32(0)), pick, (axis,))


def argmax_2d_reduce(x: jax.Array) -> tuple[jax.Array, jax.Array, jax.Array]:
  """A variadic reduce of three operands over both dims: the maximum and its (row, column)."""
  rows, cols = (lax.broadcasted_iota(jnp.int32, x.shape, d) for d in (0, 1))

  def pick(a, b):
    first = (a[1] < b[1]) | ((a[1] == b[1]) & (a[2] < b[2]))
    take_a = (a[0] > b[0]) | ((a[0] == b[0]) & first)
    return tuple(jnp.where(take_a, u, v) for u, v in zip(a, b))
  return lax.reduce((x, rows, cols), (jnp.array(-jnp.inf, x.dtype), jnp.int32(0), jnp.int32(0)),
                    pick, (0, 1))


def argmin_int_reduce(x: jax.Array) -> tuple[jax.Array, jax.Array]:
  """A variadic (value, index) reduce of int32 along dim 1, keeping the minimum."""
  idx = lax.broadcasted_iota(jnp.int32, x.shape, 1)

  def pick(a, b):
    take_a = (a[0] < b[0]) | ((a[0] == b[0]) & (a[1] < b[1]))
    return jnp.where(take_a, a[0], b[0]), jnp.where(take_a, a[1], b[1])
  return lax.reduce((x, idx), (jnp.int32(2**31 - 1), jnp.int32(0)), pick, (1,))


def max_pool_grad(window, strides, padding):
  """The cotangent of a max pool: select-and-scatter of ``g`` over ``x``'s windows."""
  def f(x, g):
    pool = lambda x: lax.reduce_window(x, -jnp.inf, lax.max, window, strides, padding)
    return jax.vjp(pool, x)[1](g)[0]
  return f


# --- Resharding between tilings ------------------------------------------------------------------

@case
def tiled_to_replicated_uneven():  # TiledToReplicated
  check(lambda x: x + 1, (randn(3, 5),), P("x"), "x4", out_specs=P())


@case
def tiled_to_tiled_uneven():  # TiledToTiledUneven
  check(lambda x: x * 2, (randn(7, 31, 6),), P(None, "x"), "x8", out_specs=P("x"))


@case
def tiled_to_single_dim_two_axes():  # TiledToTiledEven (2-D tile to 1-D)
  check(lambda x: x - 1, (randn(8, 16),), P("a", "b"), "a2b4", out_specs=P(None, ("a", "b")))


@case
def transposed_device_order():  # GetTupleElementSwapDevice (device order 1,0)
  check(lambda x: x * 3, (randn(16, 4),), P(("a", "b")), "a2b4", out_specs=P(("b", "a")))


@case
def transposed_device_order_uneven_3d():  # GetTupleElementSwapDevice, 3-D mesh
  check(lambda x: x + 2, (randn(13, 3),), P(("a", "b", "c")), "a2b2c2",
        out_specs=P(("c", "b", "a")))


@case
def partial_replicate_to_tile():  # PartialReplicateToTileReshard
  check(lambda x: jnp.sin(x), (randn(8, 8),), P("a", None), "a2b4", out_specs=P("a", "b"))


@case
def tile_to_partial_replicate():  # TileToPartialReplicateReshard
  check(lambda x: jnp.cos(x), (randn(8, 8),), P("a", "b"), "a2b4", out_specs=P("a"))


@case
def partial_to_partial_all_gather():  # PartialReplicateToPartialReplicateReshard_AllGather
  check(lambda x: x * x, (randn(8, 8),), P(("a", "b"), "c"), "a2b2c2", out_specs=P("a", "c"))


@case
def partial_to_partial_dynamic_slice():  # PartialReplicateToPartialReplicateReshard_DynamicSlice
  check(lambda x: x * x, (randn(8, 8),), P("a"), "a2b2c2", out_specs=P(("a", "b"), "c"))


@case
def axes_swap_between_dims():  # TiledToTiledEven with the tile assignment transposed
  check(lambda x: x + 1, (randn(8, 8),), P("a", "b"), "a2b4", out_specs=P("b", "a"))


@case
def multi_axis_dim_split():  # ReshardTiledTo(Tiled) merged dims split
  check(lambda x: x + 1, (randn(8, 8),), P(("a", "b"), None), "a2b4", out_specs=P("a", "b"))


@case
def multi_axis_dim_merge_uneven():  # ReshardTiledTo(Tiled) dims merged, uneven
  check(lambda x: x + 1, (randn(6, 10),), P("a", "b"), "a2b4", out_specs=P(("a", "b"), None))


@case
def three_d_mesh_rotate_axes():  # 3-D tile assignment rotated
  check(lambda x: x * 2, (randn(4, 6, 8),), P("a", "b", "c"), "a2b2c2", out_specs=P("c", "a", "b"))


@case
def tile_to_partial_replicate_halo_padding():  # TileToPartialReplicateHaloExchangeWithPadding
  check(lambda x: x + 1, (randn(123),), P(("a", "b")), "a2b4", out_specs=P("a"))


@case
def partial_replicate_to_tiled_elementwise():  # ElementwiseTest_PartialReplicateToTiledHaloExchange
  check(lambda x, y: x + y, (randn(6, 3), randn(6, 3, seed=1)), (P("a"), P(("a", "b"))), "a2b4",
        out_specs=P(("a", "b")))


@case
def tiled_elementwise_mixed_operands():  # TiledElementwise
  check(lambda x, y: jnp.maximum(x, y) * 2, (randn(26, 3), randn(26, 3, seed=1)),
        (P("x"), P(None, "x")), "x4")


# --- Broadcast, iota, transpose ------------------------------------------------------------------

@case
def broadcast_only_new_dims_sharded():  # BroadcastOnlyNewDimsSharded
  check(lambda x: jnp.broadcast_to(x, (4, 4, 3)), (randn(4, 3),), P(), "a2b4",
        out_specs=P("a", "b"))


@case
def broadcast_only_old_dims_sharded():  # BroadcastOnlyOldDimsSharded
  check(lambda x: jnp.broadcast_to(x[None], (4, 5, 8)), (randn(5, 8),), P(None, "b"), "a2b4",
        out_specs=P(None, None, "b"))


@case
def broadcast_both_old_and_new_dims_sharded():  # BroadcastBothOldAndNewDimsSharded
  check(lambda x: jnp.broadcast_to(x[None], (4, 4, 3)), (randn(4, 3),), P("a"), "a2b4",
        out_specs=P("b", "a"))


@case
def iota_along_non_tile_dimension():  # IotaAlongNonTileDimension
  check(lambda: lax.broadcasted_iota(jnp.int32, (4, 10, 91), 1), (), (), "x2",
        out_specs=P(None, None, "x"))


@case
def iota_along_tile_dimension():  # IotaAlongTileDimension
  check(lambda: lax.broadcasted_iota(jnp.int32, (4, 10, 91), 2), (), (), "x2",
        out_specs=P(None, None, "x"))


@case
def u32_iota_along_tile_dimension():  # U32IotaAlongTileDimension
  check(lambda x: lax.broadcasted_iota(jnp.uint32, (4, 10, 13), 2) + x, (np.uint32(1),), P(),
        "a2b4", out_specs=P("a", None, "b"))


@case
def shardable_transpose():  # ShardableTranspose
  check(lambda x: jnp.transpose(x, (0, 2, 1, 3)), (randn(4, 6, 6, 2),), P(None, None, "x"), "x2")


@case
def multi_dimension_sharded_transpose():  # MultiDimensionShardedTranspose
  check(lambda x: jnp.transpose(x, (1, 3, 0, 2)), (randn(4, 8, 6, 2),), P("a", "b"), "a2b4",
        out_specs=P("b", None, "a"))


@case
def transpose_3d_mesh_uneven():  # NonShardableTranspose (kept sharded, uneven)
  check(lambda x: jnp.transpose(x, (2, 0, 1)) + 1, (randn(5, 3, 7),), P("a", "b", "c"), "a2b2c2")


# --- Reshape -------------------------------------------------------------------------------------

@case
def shardable_reshape():  # ShardableReshape
  check(lambda x: x.reshape(38, 38, 4, 3), (randn(38, 38, 12),), P("x"), "x2")


@case
def reshape_with_reshard():  # ReshapeWithReshard
  check(lambda x: x.reshape(6, 8), (randn(48, 1),), P("x"), "x4", out_specs=P(None, "x"))


@case
def reshape_merge_dims_with_halo_exchange():  # ReshapeMergeDimsWithHaloExchange
  check(lambda x: x.reshape(3, 2, 1, 14, 5), (ints(2, 3, 7, 10),), P(None, None, "x"), "x2",
        out_specs=P(None, None, None, "x"))


@case
def partial_replicate_shardable_reshape():  # PartialReplicateShardableReshape
  check(lambda x: x.reshape(38, 38, 4, 3), (randn(38, 38, 12),), P("a"), "a2b4")


@case
def reshape_split_multi_axis_3d():  # ReshapeWithReshard (multi-axis dim split)
  check(lambda x: x.reshape(4, 2, 6) * 2, (randn(8, 6),), P(("a", "b", "c")), "a2b2c2",
        out_specs=P("a", ("b", "c")))


# --- Pad, slice, concatenate ---------------------------------------------------------------------

@case
def pad_along_partitioned_dimension():  # PadAlongPartitionedDimension
  check(lambda x: lax.pad(x, 0., [(0, 0, 0), (2, 1, 0)]), (randn(4, 257),), P(None, "x"), "x2")


@case
def pad_partitioned_interior():  # PadAlongPartitionedDimensionWithInteriorPadding
  check(lambda x: lax.pad(x, 1., [(2, 1, 2)]), (randn(7),), P("x"), "x2")


@case
def pad_partitioned_negative_uneven():  # PadAlongPartitionedDimensionWithNegativePadding
  check(lambda x: lax.pad(x, 0., [(-2, 1, 0)]), (randn(7),), P("x"), "x4")


@case
def pad_non_partitioned_reshard():  # PadAlongNonPartitionedDimensionReshard
  check(lambda x: jnp.pad(x, ((0, 0), (1, 2))), (randn(8, 6),), P(None, "b"), "a2b4",
        out_specs=P("b"))


@case
def slice_along_partitioned_dimension():  # SliceAlongPartitionedDimension
  check(lambda x: x[:, :, 2:149], (randn(4, 3, 257),), P(None, None, "x"), "x2")


@case
def slice_along_partitioned_dimension2():  # SliceAlongPartitionedDimension2
  check(lambda x: x[3:4], (randn(4),), P("x"), "x4")


@case
def partial_replicate_slice_non_partitioned():  # PartialReplicateSliceAlongNonPartitionedDimension
  check(lambda x: x[:, 1:7], (randn(8, 9),), P("a"), "a2b4")


@case
def merged_pad_then_slice_shift_right():  # MergedPadThenSliceShiftRight
  check(lambda x: lax.pad(x, 0., [(1, 0, 0)])[:4], (randn(4),), P("x"), "x4")


@case
def merged_pad_then_slice_shift_right_uneven():  # MergedPadThenSliceShiftRightNoMasking
  check(lambda x: lax.pad(x, 1., [(2, 0, 0), (0, 0, 0)])[:10], (randn(10, 3),), P("x"), "x4")


@case
def merged_slice_then_concat_rotate_right():  # MergedSliceThenConcatRotateRight
  check(lambda x: jnp.concatenate([x[8:], x[:8]]), (randn(12),), P("x"), "x4")


@case
def merged_slice_then_concat_rotate_aligned_padding():  # ...RotateRightWithAlignedPadding
  check(lambda x: jnp.concatenate([x[2:], x[:2]]), (randn(6),), P("x"), "x4")


@case
def concatenate_along_partitioned_dimension():  # ConcatenateAlongPartitionedDimension
  check(lambda x, y: jnp.concatenate([x, y], 1), (randn(4, 257), randn(4, 116)),
        (P(None, "x"), P(None, "x")), "x2")


@case
def concatenate_along_non_partitioned_dimension():  # ConcatenateAlongNonPartitionedDimension
  check(lambda x, y: jnp.concatenate([x, y], 1), (randn(14, 25), randn(14, 11)),
        (P("x"), P("x")), "x4")


@case
def concatenate_along_both_dimensions():  # ConcatenateAlongBothDimensions
  check(lambda x, y: jnp.concatenate([x, y], 1), (randn(6, 13), randn(6, 7)),
        (P("a", "b"), P("a", "b")), "a2b2c2")


@case
def concatenate_differently_sharded_int():  # ConcatenateAlongPartitionedDimension, mixed tiles
  check(lambda x, y: jnp.concatenate([x, y], 0), (ints(10, 4), ints(6, 4, seed=1)),
        (P("a"), P(("a", "b"))), "a2b4")


# --- Dynamic slice / dynamic update slice -------------------------------------------------------

@case
def dynamic_slice_along_non_partitioned():  # DynamicSliceAlongNonPartitionedDimension
  check(lambda x, i: lax.dynamic_slice(x, (0, i), (16, 2)), (ints(16, 8), np.int32(5)),
        (P("x"), P()), "x8")


@case
def dynamic_update_slice_along_non_partitioned():  # DynamicUpdateSliceAlongNonPartitionedDim
  check(lambda x, u, i: lax.dynamic_update_slice(x, u, (0, i)),
        (ints(16, 8), ints(16, 2, seed=1), np.int32(3)), (P("x"), P("x"), P()), "x8")


@case
def dynamic_update_slice_along_partitioned():  # DynamicUpdateSliceAlongPartitionedDimension
  check(lambda x, u: lax.dynamic_update_slice(x, u, (0, 5)), (ints(8, 16), ints(8, 2, seed=1)),
        (P(None, "x"), P()), "x8")


@case
def dynamic_update_slice_partitioned_dynamic_index():  # DUSAlongPartitionedDimension2
  check(lambda x, u, i: lax.dynamic_update_slice(x, u, (i, 0, 0)),
        (ints(8, 7, 2), ints(1, 7, 2, seed=1), np.int32(6)), (P("x"), P(), P()), "x8")


@case
def dynamic_update_slice_slice_and_non_slice_dims():  # DUSPartitionSliceAndNonSliceDims
  check(lambda x, u, i: lax.dynamic_update_slice(x, u, (i, 0)),
        (randn(16, 8), randn(4, 8, seed=1), np.int32(9)), (P("a", "b"), P(None, "b"), P()),
        "a2b4")


@case
def dynamic_slice_both_dims_uneven():  # DynamicSlice on two partitioned dims, uneven
  check(lambda x, i, j: lax.dynamic_slice(x, (i, j), (3, 5)),
        (randn(10, 13), np.int32(6), np.int32(-2)), (P("a", "b"), P(), P()), "a2b4")


# --- Dots ----------------------------------------------------------------------------------------

@case
def einsum_batch_partitioned():  # EinsumBatchPartitioned
  check(lambda x, y: jnp.einsum("bxf,byf->bxy", x, y), (randn(8, 6, 4), randn(8, 5, 4, seed=1)),
        (P("x"), P("x")), "x8", out_specs=P("x"))


@case
def einsum_lhs_and_output_batch_partitioned():  # EinsumLHSandOutputBatchPartitioned
  check(lambda x, y: jnp.einsum("bxf,byf->bxy", x, y), (randn(8, 6, 4), randn(8, 5, 4, seed=1)),
        (P("x"), P()), "x8", out_specs=P("x"))


@case
def einsum_rhs_and_output_batch_partitioned():  # EinsumRHSandOutputBatchPartitioned
  check(lambda x, y: jnp.einsum("bxf,byf->bxy", x, y), (randn(8, 6, 4), randn(8, 5, 4, seed=1)),
        (P(), P("a")), "a2b4", out_specs=P("a"))


@case
def einsum_output_batch_partitioned():  # EinsumOutputBatchPartitioned
  check(lambda x, y: jnp.einsum("bxf,byf->bxy", x, y), (randn(8, 6, 4), randn(8, 5, 4, seed=1)),
        (P(), P()), "a2b4", out_specs=P(("a", "b")))


@case
def einsum_contracting_dims_partitioned():  # EinsumContractingDimsPartitioned
  check(lambda x, y: jnp.einsum("bxcd,bycd->bxy", x, y),
        (randn(4, 6, 8, 4), randn(4, 5, 8, 4, seed=1)),
        (P(None, None, "a", "b"), P(None, None, "a", "b")), "a2b4")


@case
def einsum_contracting_result_partially_sliced():
  # EinsumContractingDimsPartitionedResultPartiallySliced
  check(lambda x, y: x @ y, (randn(8, 16), randn(16, 8, seed=1)), (P(None, "x"), P("x")), "x4",
        out_specs=P("x"))


@case
def einsum_lhs_non_contracting_partitioned():  # EinsumLHSNonContractingDimsPartitioned
  check(lambda x, y: jnp.einsum("bxzf,byf->bxzy", x, y),
        (randn(4, 8, 6, 4), randn(4, 5, 4, seed=1)), (P(None, "a", "b"), P()), "a2b4",
        out_specs=P(None, "a", "b"))


@case
def einsum_rhs_non_contracting_partitioned():  # EinsumRHSNonContractingDimsPartitioned
  check(lambda x, y: jnp.einsum("bxf,byzf->bxyz", x, y),
        (randn(4, 6, 4), randn(4, 8, 8, 4, seed=1)), (P(), P(None, "a", "b")), "a2b4",
        out_specs=P(None, None, "a", "b"))


@case
def einsum_output_lhs_non_contracting_partitioned():  # EinsumOutputLHSNonContractingDimPartitioned
  check(lambda x, y: jnp.einsum("bxf,byf->bxy", x, y), (randn(4, 8, 4), randn(4, 5, 4, seed=1)),
        (P(), P()), "x8", out_specs=P(None, "x"))


@case
def einsum_rhs_windowed_non_contracting():  # EinsumRHSWindowedNonContracting
  check(lambda x, y: jnp.einsum("bxcd,bycd->bxy", x, y),
        (randn(2, 8, 6, 4), randn(2, 13, 6, 4, seed=1)), (P(None, "x"), P(None, "x")), "x4",
        out_specs=P(None, "x"))


@case
def einsum_lhs_windowed_non_contracting():  # EinsumLHSWindowedNonContracting
  check(lambda x, y: jnp.einsum("bxcd,bycd->bxy", x, y),
        (randn(2, 13, 6, 4), randn(2, 8, 6, 4, seed=1)), (P(None, "x"), P(None, "x")), "x4",
        out_specs=P(None, None, "x"))


@case
def einsum_rhs_windowed_contracting():  # EinsumRHSWindowedContracting
  check(lambda x, y: jnp.einsum("bxcd,bycd->bxy", x, y),
        (randn(2, 8, 7, 4), randn(2, 12, 7, 4, seed=1)), (P(None, "x"), P(None, None, "x")), "x4",
        out_specs=P(None, "x"))


@case
def windowed_einsum_bf16_two_axes():  # EinsumRHSWindowedNonContracting, bf16 on a 2-D mesh
  check(lambda x, y: x @ y.T, (randn(16, 8, dtype=BF16), randn(12, 8, seed=1, dtype=BF16)),
        (P(("a", "b")), P(("a", "b"))), "a2b4", out_specs=P(("a", "b")))


@case
def dot_batch_dims_mismatch():  # EinsumBatchPartitioned with lhs / rhs batch on other axes
  check(lambda x, y: jnp.einsum("bmk,bkn->bmn", x, y), (randn(8, 4, 6), randn(8, 6, 4, seed=1)),
        (P("a"), P("b")), "a2b4")


@case
def dot_batch_and_contracting_mixed():  # EinsumBatchAndContractingPartitioned
  check(lambda x, y: jnp.einsum("bmk,bkn->bmn", x, y), (randn(4, 4, 16), randn(4, 16, 6, seed=1)),
        (P("a", None, "b"), P("b", "a")), "a2b4")


@case
def dot_int32_non_contracting_both_3d():  # TiledDotOutputTiled, int32 on a 3-D mesh
  check(lambda x, y: x @ y, (ints(8, 6, high=10), ints(6, 8, seed=1, high=10)),
        (P(("a", "b")), P(None, "c")), "a2b2c2", out_specs=P("c", ("a", "b")))


@case
def tiled_dot_replicated_output():  # TiledDot
  check(lambda x, y: x @ y, (randn(12, 10), randn(10, 16, seed=1)), (P(None, "x"), P("x")), "x4",
        out_specs=P())


@case
def dot_2d_partitioned_non_contracting_and_contracting():
  # Dot2DPartitionedNonContractingAndContracting0
  check(lambda x, y: x @ y, (randn(8, 12), randn(12, 6, seed=1)), (P("a", "b"), P("b", "c")),
        "a2b2c2", out_specs=P("a", "c"))


@case
def dot_2d_partitioned_batch_and_non_contracting():  # Dot2DPartitionedBatchAndNonContracting
  check(lambda x, y: jnp.einsum("bmk,bkn->bmn", x, y), (randn(4, 8, 6), randn(4, 6, 10, seed=1)),
        (P("a", "b"), P("a", None, "c")), "a2b2c2", out_specs=P("a", "b", "c"))


@case
def dot_partial_contracting_partial_replicate():  # DotPartialContracting2 (partial replication)
  check(lambda x, y: x @ y, (randn(8, 16), randn(16, 8, seed=1)), (P(None, "b"), P("b", "a")),
        "a2b4", out_specs=P("b"))


# A dot whose operands disagree on a factor (contracting or batch) keeps the factors they agree on
# (as XLA does): propagation once gave the disputed factor a mesh axis another factor wanted, the
# result lost that axis and both operands were gathered (tril(x) @ x: 1536 B, XLA 768 B).
@case
def dot_contracting_disputed_keeps_result_axes():
  no_more_than_xla(lambda x: jnp.tril(x) @ x, (randn(16, 16),), P("a", "b"), "a2b4")


@case
def dot_contracting_disputed_rectangular():
  no_more_than_xla(lambda x, y: (x * 2) @ y, (randn(16, 24), randn(24, 16, seed=1)),
                   (P("a", "b"), P("a", "b")), "a2b4")


@case
def dot_contracting_disputed_uneven():
  no_more_than_xla(lambda x: jnp.tril(x) @ x, (randn(12, 12),), P("a", "b"), "a2b4")


@case
def dot_contracting_disputed_3d_mesh():
  no_more_than_xla(lambda x: jnp.triu(x) @ x, (randn(16, 16),), P(("a", "b"), "c"), "a2b2c2")


@case
def dot_batch_disputed_keeps_free_axes():  # bmk,bkn with batch on a (lhs) and b (rhs)
  no_more_than_xla(lambda x, y: jnp.einsum("bmk,bkn->bmn", x, y),
                   (randn(4, 8, 16), randn(4, 16, 8, seed=1)), (P("a", "b", None),
                                                                 P("b", None, "a")), "a2b4")


@case
def dot_batch_disputed_attention_scores():
  no_more_than_xla(lambda q, k: jnp.einsum("bqhd,bkhd->bhqk", q, k),
                   (randn(4, 8, 2, 8), randn(4, 8, 2, 8, seed=1)), (P("a", "b"), P("b", "a")),
                   "a2b4")


# jax.image.resize builds one weight matrix per resized dim from iotas; the two were merged as a
# common subexpression before propagation, so both dots read it in one sharding (the second
# gathered its partial result, 28288 B for bilinear 16x16 -> 32x32 of P(None, 'x') over 4, XLA
# 12288 B). Values computed from iotas alone are merged only after propagation now.
@case
def resize_linear_down_sharded_rows():
  no_more_than_xla(lambda x: jax.image.resize(x, (2, 8, 8, 3), "linear"), (randn(2, 16, 16, 3),),
                   P(None, "x"), "x4")


@case
def resize_bilinear_uneven_rows():
  no_more_than_xla(lambda x: jax.image.resize(x, (2, 20, 20, 3), "bilinear"),
                   (randn(2, 12, 12, 3),), P(None, "x"), "x8")


@case
def transpose_all_to_all():  # TransposeAllToAll (a transpose keeping the device assignment)
  check(lambda x: x.T, (randn(8, 16),), P("x"), "x8", out_specs=P("x"))


# --- Convolutions --------------------------------------------------------------------------------

@case
def conv_lhs_tiled_rhs_replicated():  # ConvolutionLhsTiledRhsReplicated
  f = lambda x, k: lax.conv_general_dilated(x, k, (2, 2), [(3, 3), (3, 3)], dimension_numbers=NHWC)
  check(f, (randn(2, 16, 16, 3), randn(7, 7, 3, 4, seed=1)), (P(None, "x"), P()), "x2")


@case
def conv_lhs_tiled_rhs_tiled():  # ConvolutionLhsTiledRhsTiled (window covers the whole image)
  f = lambda x, y: lax.conv_general_dilated(x, y, (1, 1), "VALID", dimension_numbers=WGRAD)
  check(f, (randn(4, 8, 8, 2), randn(4, 8, 8, 6, seed=1)), (P(None, "x"), P(None, "x")), "x2",
        atol_per_magnitude=True)


@case
def dot_lhs_tiled_rhs_tiled_with_reshard():  # DotLhsTiledRhsTiledWithReshard
  f = lambda x, y: lax.conv_general_dilated(x, y, (1, 1), "VALID", dimension_numbers=WGRAD)
  check(f, (randn(4, 8, 8, 2), randn(4, 8, 8, 6, seed=1)), (P(None, "x"), P("x")), "x2",
        atol_per_magnitude=True)


@case
def conv_lhs_tiled_rhs_tiled_with_padding():  # ConvolutionLhsTiledRhsTiledWithPadding
  f = lambda x, y: lax.conv_general_dilated(x, y, (1, 1), [(1, 1), (1, 1)],
                                            dimension_numbers=WGRAD)
  check(f, (randn(4, 8, 8, 2), randn(4, 8, 8, 6, seed=1)), (P(None, "x"), P(None, "x")), "x2",
        atol_per_magnitude=True)


@case
def conv_lhs_tiled_rhs_tiled_window_dilate():  # ConvolutionLhsTiledRhsTiledWindowDilate
  f = lambda x, y: lax.conv_general_dilated(x, y, (1, 1), [(3, 2), (3, 2)], rhs_dilation=(2, 2),
                                            dimension_numbers=WGRAD)
  check(f, (randn(3, 16, 16, 2), randn(3, 8, 8, 4, seed=1)), (P(None, "x"), P(None, "x")), "x2",
        atol_per_magnitude=True)


@case
def conv_lhs_tiled_rhs_tiled_uneven_dilated_rhs():  # ..._UnevenDilatedRHSPartitioned
  f = lambda x, y: lax.conv_general_dilated(x, y, (1, 1), [(0, -1), (0, -1)], rhs_dilation=(2, 2),
                                            dimension_numbers=WGRAD)
  check(f, (randn(2, 12, 12, 2), randn(2, 6, 6, 3, seed=1)), (P(None, "x"), P(None, "x")), "x4",
        atol_per_magnitude=True)


@case
def conv_window_reversal():  # ConvolutionLhsTiledRhsTiledWindowReversal
  f = lambda x, y: lax.conv_general_dilated(x, lax.rev(y, (0,)), (1,), "VALID",
                                            dimension_numbers=("WCN", "WIO", "WNC"))
  check(f, (randn(5, 8, 4), randn(5, 8, 6, seed=1)), (P("x"), P("x")), "x2",
        atol_per_magnitude=True)


@case
def conv_base_dilation_same_start_pattern():  # ConvolutionBaseDilationSameStartPattern...
  f = lambda x, k: lax.conv_general_dilated(x, k, (2, 2), [(0, 0), (0, 0)], lhs_dilation=(2, 2),
                                            dimension_numbers=NHWC)
  check(f, (randn(2, 8, 8, 4), randn(1, 1, 4, 3, seed=1)), (P(None, "x"), P()), "x2")


@case
def conv_base_dilation_stride1_uneven():  # ConvolutionBaseDilationStride1LhsTiledRhsReplicated
  f = lambda x, k: lax.conv_general_dilated(x, k, (1, 1), [(1, 1), (1, 1)], lhs_dilation=(2, 2),
                                            dimension_numbers=NHWC)
  check(f, (randn(2, 7, 7, 4), randn(3, 3, 4, 3, seed=1)), (P(None, "x"), P()), "x2")


@case
def conv_input_feature_partitioned():  # ConvolutionInputFeatureDimPartitioned (all-reduce)
  f = lambda x, k: lax.conv_general_dilated(x, k, (1, 1), "SAME", dimension_numbers=NHWC)
  check(f, (randn(2, 6, 6, 8), randn(3, 3, 8, 4, seed=1)),
        (P(None, None, None, "x"), P(None, None, "x")), "x4")


@case
def conv_batch_and_spatial_2d():  # BatchPartitionedConvolution + spatial (2-D mesh)
  f = lambda x, k: lax.conv_general_dilated(x, k, (1, 1), "SAME", dimension_numbers=NHWC)
  check(f, (randn(4, 10, 6, 3), randn(3, 3, 3, 4, seed=1)), (P("a", "b"), P()), "a2b4")


@case
def conv_spatial_and_out_feature_3d():  # ConvolutionInputSpatialDimAndFeatureDimPartitioned
  f = lambda x, k: lax.conv_general_dilated(x, k, (1, 1), "SAME", dimension_numbers=NHWC)
  check(f, (randn(2, 8, 8, 4), randn(3, 3, 4, 6, seed=1)),
        (P("a", "b"), P(None, None, None, "c")), "a2b2c2")


@case
def conv_bf16_spatial_uneven():  # ConvolutionLhsTiledRhsReplicated, bf16 and uneven
  f = lambda x, k: lax.conv_general_dilated(x, k, (1, 1), "SAME", dimension_numbers=NHWC)
  check(f, (randn(2, 11, 5, 3, dtype=BF16), randn(3, 3, 3, 4, seed=1, dtype=BF16)),
        (P(None, "x"), P()), "x4", atol_per_magnitude=True)


# --- Reduce and reduce-window --------------------------------------------------------------------

@case
def tiled_to_tiled_tuple_reduce():  # TiledToTiledTupleReduce (argmax as a variadic reduce)
  check(lambda x: argmax_reduce(x, 1), (randn(14, 10),), P(None, "x"), "x4")


@case
def tiled_to_partially_tiled_tuple_reduce():  # TiledToPartiallyTiledTupleReduce
  # each shard reduced, the per-shard (value, index) all-gathered over b and reduced again:
  # 448 B per device, XLA's figure (gathering dim 1 whole moved 672 B)
  plan = check(lambda x: argmax_reduce(x, 1), (randn(28, 12),), P("a", "b"), "a2b4",
               out_specs=P("a"))
  assert plan.total_bytes == 448


@case
def tuple_reduce_three_operands_both_dims_uneven():  # TiledToTiledTupleReduce, 2-D tiles
  no_more_than_xla(argmax_2d_reduce, (randn(9, 11),), P("a", "b"), "a2b4")


@case
def tuple_reduce_bf16_transposed_axes():  # TiledToTiledTupleReduce, bf16, device order 1,0
  no_more_than_xla(argmax_2d_reduce, (randn(6, 10, dtype=BF16),), P("b", "a"), "a2b4")


@case
def tuple_reduce_two_axes_one_dim_uneven():  # TiledToTiledTupleReduce, dim over ("a", "b")
  no_more_than_xla(lambda x: argmax_reduce(x, 1), (randn(5, 13),), P(None, ("a", "b")), "a2b4")


@case
def tuple_reduce_int32_min():  # TiledToPartiallyTiledTupleReduce with an int32 min comparator
  no_more_than_xla(argmin_int_reduce, (ints(6, 30),), P("a", "b"), "a2b4")


@case
def tuple_reduce_bool_or_and_sum_uneven():  # a variadic reduce of a bool and an f32 operand
  def f(b, x):
    return lax.reduce((b, x), (False, jnp.float32(0)), lambda p, q: (p[0] | q[0], p[1] + q[1]),
                      (0,))
  no_more_than_xla(f, (randn(21, 4) > 0.5, randn(21, 4, seed=1)), (P("x"), P("x")), "x8")


@case
def argmin_int32_sharded():  # argmin (an argmin primitive: value and index reduced together)
  no_more_than_xla(lambda x: jnp.argmin(x, axis=1), (ints(6, 30),), P(None, "x"), "x8")


@case
def argmax_bool_2d_mesh():  # argmax of bool along a dim sharded on the mesh's minor axis
  no_more_than_xla(lambda x: jnp.argmax(x, axis=1), (randn(6, 30) > 1,), P("a", "b"), "a2b4")


@case
def argmax_nan_and_inf_uneven():  # argmax takes the first NaN; a row of -inf keeps index 0
  x = randn(5, 19)
  x[1, 3] = x[1, 17] = np.nan
  x[2, :] = -np.inf
  no_more_than_xla(lambda x: jnp.argmax(x, axis=1), (x,), P(None, "x"), "x8")
  no_more_than_xla(lambda x: jnp.argmin(x, axis=1), (x,), P(None, "x"), "x4")


@case
def argmax_one_row_per_shard():  # argmax where each shard holds one element of the reduced dim
  # gathering the array (32 B) moves less than gathering each shard's value and index (64 B):
  # both are priced
  plan = check(lambda x: jnp.argmax(x), (randn(8),), P("x"), "x8")
  assert plan.total_bytes == 32 <= xla_bytes(lambda x: jnp.argmax(x), (randn(8),), P("x"), "x8")


@case
def argmax_moved_to_free_dimension():  # TiledToTiledTupleReduce, the reduced dim's axis moved
  # asked for P('x'), x moves to dim 1 by an all-to-all (64 B) and each device takes the argmax
  # of its columns; XLA gathers each shard's (value, index) (512 B). Left open, the result is
  # jax.jit's P() (Shardy's: the reduced dim's axes leave it)
  plan = check(lambda x: jnp.argmax(x, axis=0), (randn(16, 8),), P("x"), "x8", out_specs=P("x"))
  assert plan.total_bytes == 64
  check_jit(lambda x: jnp.argmax(x, axis=0), (randn(16, 8),), P("x"), "x8")
  no_more_than_xla(lambda x: argmax_reduce(x, 1), (randn(16, 8),), P(None, "x"), "x8")


@case
def reduce_prod_and_xor_sharded():  # TiledToTiledReduce with multiply / xor computations
  # XLA all-reduces a product (f32[16,8] P('x') along dim 0: 32 B), which no JAX collective
  # does: x moves to dim 1 by an all-to-all (64 B; gathering dim 0 moved 512 B), or each
  # shard's products are all-gathered and multiplied (f32[61]: 32 B, was 256 B)
  assert check(lambda x: jnp.prod(x, axis=0), (randn(16, 8),), P("x"), "x8",
               out_specs=P("x")).total_bytes == 64
  assert check(lambda x: jnp.prod(x), (1 + 0.01 * randn(61),), P("x"), "x8").total_bytes == 32
  check(lambda x: jnp.prod(x, axis=(0, 1)), (ints(4, 8, high=2),), P("a", "b"), "a2b4")
  xor = lambda x: lax.reduce_xor_p.bind(x, axes=(0,))  # noqa: E731
  assert check(xor, (ints(19, 3),), P("x"), "x8").total_bytes == 96


@case
def argmax_flattened_bf16():  # argmax over a reshaped 2-D tile, bf16
  no_more_than_xla(lambda x: jnp.argmax(x.reshape(-1)), (randn(8, 8, dtype=BF16),), P("a", "b"),
                   "a2b4")


@case
def tuple_reduce_uneven_3d():  # TiledToTiledTupleReduce2, uneven on a 3-D mesh
  check(lambda x: argmax_reduce(x, 0), (randn(7, 5),), P(("a", "b"), "c"), "a2b2c2")


@case
def tiled_to_tiled_reduce_output_reshard():  # TiledToTiledReduceOutputReshard
  check(lambda x: x.sum((0, 1, 2)), (randn(2, 8, 4, 16),), P(None, "x"), "x2", out_specs=P("x"))


@case
def partial_tiled_to_partial_tiled_reduce():  # PartialTiledToPartialTiledReduce
  check(lambda x: x.sum(1), (randn(4, 4),), P("a", "b"), "a2b2c2", out_specs=P("a"))


@case
def reduce_int32_max_multi_axis():  # TiledToTiledReduce, int32 max over two sharded dims
  check(lambda x: x.max((0, 2)), (ints(6, 4, 10),), P("a", None, "b"), "a2b4")


@case
def reduce_window_negative_left_halo():  # ReduceWindowTiledNegativeLeftHalo
  check(lambda x: lax.reduce_window(x, -jnp.inf, lax.max, (3, 1), (2, 1), [(-1, 1), (0, 0)]),
        (randn(6, 2),), P("x"), "x2")


@case
def reduce_window_one_side_halo_beyond_neighbor():  # ReduceWindowTiledOneSideHaloBeyondNeighbor
  check(lambda x: lax.reduce_window(x, 0., lax.add, (5, 1), (1, 1), [(4, 0), (0, 0)]),
        (randn(9, 2),), P("x"), "x4")


@case
def reduce_window_tiled_2d():  # ReduceWindowTiled2D
  check(lambda x: lax.reduce_window(x, -jnp.inf, lax.max, (5, 3), (2, 2), [(2, 2), (1, 1)]),
        (randn(9, 7),), P("a", "b"), "a2b4")


@case
def reduce_window_dilated_inception():  # InceptionV3_4_way_ReduceWindowDilated
  f = lambda x: lax.reduce_window(x, 0., lax.add, (1, 3, 3, 1), (1, 1, 1, 1),
                                  [(0, 0), (1, 1), (1, 1), (0, 0)], base_dilation=(1, 2, 2, 1))
  check(f, (randn(2, 5, 5, 3),), P(None, "x"), "x4")


@case
def reduce_window_int32_padded():  # ReduceWindowTiled... with padding, int32 max
  check(lambda x: lax.reduce_window(x, np.int32(-2**31), lax.max, (3,), (2,), [(1, 1)]),
        (ints(13),), P("x"), "x4")


# --- Select-and-scatter --------------------------------------------------------------------------

@case
def select_and_scatter_with_overlap():  # SelectAndScatterWithOverlap
  f = max_pool_grad((3, 2), (2, 2), [(1, 1), (0, 0)])
  check(f, (randn(11, 4), randn(6, 2, seed=1)), (P("x"), P("x")), "x4")


@case
def select_and_scatter_no_overlap():  # SelectAndScatterNoOverlap
  f = max_pool_grad((2, 2), (2, 2), [(0, 0), (0, 0)])
  check(f, (randn(11, 4), randn(5, 2, seed=1)), (P("x"), P("x")), "x4")


@case
def select_and_scatter_no_overlap_reshard():  # SelectAndScatterNoOverlapReshard
  f = max_pool_grad((2, 2), (2, 2), [(0, 0), (0, 0)])
  check(f, (randn(12, 4), randn(6, 2, seed=1)), (P(None, "x"), P("x")), "x2")


@case
def select_and_scatter_retina_net():  # SelectAndScatter_RetinaNet (1x1 window, stride 2)
  f = max_pool_grad((1, 1, 1, 1), (1, 2, 2, 1), [(0, 0)] * 4)
  check(f, (randn(2, 16, 12, 2), randn(2, 8, 6, 2, seed=1)), (P(None, "x"), P(None, "x")), "x8")


# --- Sort ----------------------------------------------------------------------------------------

@case
def sort_along_non_partitioned_dimension():  # SortAlongNonPartitionedDimension (key, iota)
  def f(x):
    return lax.sort((x, lax.broadcasted_iota(jnp.int32, x.shape, 1)), dimension=1, num_keys=1)
  check(f, (randn(10, 16),), P("x"), "x4")


@case
def sort_sharded_non_sort_dims_3d():  # SortShardedOnNonSortDims on a 3-D mesh
  check(lambda x: jnp.sort(x, axis=2), (randn(4, 6, 8, dtype=BF16),), P("a", "b", "c"), "a2b2c2")


@case
def partition_sort_in_top_k():  # PartitionSortInTopK (top-k along the sharded dim)
  no_more_than_xla(lambda x: lax.top_k(x, 3), (randn(6, 40),), P("a", "b"), "a2b4")


@case
def sort_along_partitioned_dimension():  # SortShardedOnSortDim (moved to a free dim)
  # b moves to dim 0 by an all-to-all (64 B) and the result, asked for in that form, keeps it;
  # gathering dim 1 moved 256 B, and XLA moves it back after sorting (128 B)
  plan = check(lambda x: jnp.sort(x, axis=1), (randn(16, 8),), P("a", "b"), "a2b4",
               out_specs=P(("a", "b")))
  assert plan.total_bytes == 64


@case
def sort_along_partitioned_dimension_out_spec():  # SortShardedOnSortDim, result resharded back
  no_more_than_xla(lambda x: jnp.sort(x, axis=1), (randn(16, 8),), P("a", "b"), "a2b4",
                   out_specs=P("a", "b"))


@case
def sort_along_partitioned_dimension_1d_mesh():  # SortShardedOnSortDim, all of a 1-D mesh
  no_more_than_xla(lambda x: jnp.sort(x, axis=0), (randn(16, 8),), P("x"), "x8")


@case
def sort_no_free_dimension():  # SortShardedOnSortDim where no other dim splits evenly
  no_more_than_xla(lambda x: jnp.sort(x, axis=2), (randn(4, 6, 8),), P("a", None, "b"), "a2b4")
  no_more_than_xla(lambda x: jnp.sort(x, axis=1), (randn(7, 8),), P(None, "x"), "x8")


@case
def argsort_along_partitioned_dimension():  # SortShardedOnSortDim, (key, iota) operands
  no_more_than_xla(lambda x: jnp.argsort(x, axis=0), (randn(16, 8),), P("a"), "a2b4")


@case
def sort_two_operands_one_key():  # SortShardedOnSortDim with num_keys=1 over two operands
  no_more_than_xla(lambda x, y: lax.sort((x, y), dimension=1, num_keys=1),
                   (randn(16, 8), ints(16, 8)), (P("a", "b"), P("a", "b")), "a2b4")


@case
def top_k_along_partitioned_dimension():  # PartitionSortInTopK on a 1-D mesh, bf16
  no_more_than_xla(lambda x: lax.top_k(x, 3), (randn(8, 40, dtype=BF16),), P(None, "x"), "x8")


@case
def cumulative_along_partitioned_dimension():  # cumsum/cumprod/cummax (XLA: gathered scans)
  # asked for P(None, 'x'), the axis moves to the other dim by an all-to-all (64 B); XLA gathers
  # the dim (512 B). Left open, the result is jax.jit's P('x'): the axis moves there and back
  # (128 B)
  plan = check(lambda x: jnp.cumsum(x, axis=0), (randn(16, 8),), P("x"), "x8",
               out_specs=P(None, "x"))
  assert plan.total_bytes == 64
  assert check_jit(lambda x: jnp.cumsum(x, axis=0), (randn(16, 8),), P("x"),
                   "x8").total_bytes == 128
  no_more_than_xla(lambda x: jnp.cumprod(x, axis=1), (randn(16, 8),), P("a", "b"), "a2b4")
  no_more_than_xla(lambda x: lax.cummax(x, axis=1, reverse=True), (ints(4, 16),), P(None, "x"),
                   "x4")


@case
def cumulative_local_scan_and_shard_totals():  # cumsum of a 1-D array: no other dim to take x
  # each shard scans its block and adds the totals of the shards before it: an all-gather of
  # one f32 per shard (32 B); XLA gathers the array (256 B)
  plan = check(lambda x: jnp.cumsum(x), (randn(64),), P("x"), "x8")
  assert plan.total_bytes == 32
  no_more_than_xla(lambda x: lax.cumsum(x, reverse=True), (randn(61),), P("x"), "x8")


@case
def cumulative_totals_uneven_and_transposed():  # uneven blocks, dims over ("b", "a")
  no_more_than_xla(lambda x: lax.cummin(x, axis=0), (randn(19, 3),), P("x"), "x8")
  no_more_than_xla(lambda x: jnp.cumprod(x, axis=0), (1 + 0.01 * randn(19, 3),), P(("b", "a")),
                   "a2b4")
  no_more_than_xla(lambda x: lax.cumlogsumexp(x, axis=0, reverse=True), (randn(13, 3),),
                   P(("b", "a")), "a2b4")
  no_more_than_xla(lambda x: lax.cummax(x, axis=1, reverse=True), (ints(3, 21),), P(None, "x"),
                   "x4")


# --- Control flow --------------------------------------------------------------------------------

@case
def conditional_differently_sharded_operands():  # Conditional
  check(lambda p, x, y: lax.cond(p, lambda x, y: -y, lambda x, y: x, x, y),
        (np.bool_(True), randn(4, 5), randn(4, 5, seed=1)), (P(), P(), P("x")), "x2",
        out_specs=P("x"))


@case
def conditional_branches_annotated_differently():  # Conditional, branch-local shardings
  mesh = get_mesh("a2b4")
  rows, cols = NamedSharding(mesh, P("a", "b")), NamedSharding(mesh, P("b", "a"))
  def f(i, x):
    return lax.switch(i, [lambda x: jnp.tanh(lax.with_sharding_constraint(x @ x.T, rows)),
                          lambda x: jnp.sin(lax.with_sharding_constraint(x.T @ x, cols))], x)
  check(f, (np.int32(1), randn(8, 8)), (P(), P(None, "b")), "a2b4")


@case
def while_tuple_differently_sharded_carries():  # While with a tuple of sharded carries
  def f(x, y):
    def body(c):
      i, a, b = c
      return i + 1, jnp.tanh(a @ b), b * 0.5 + 1
    return lax.while_loop(lambda c: c[0] < 3, body, (0, x, y))[1:]
  check(f, (randn(8, 8), randn(8, 8, seed=1)), (P("a", "b"), P("b", "a")), "a2b4")


@case
def scan_sharded_carry_int32():  # While with a partially replicated int32 carry
  def f(x, xs):
    return lax.scan(lambda c, r: (c * 3 + r, c.sum(0)), x, xs)
  check(f, (ints(4, 6, high=3), ints(5, 4, 6, high=3, seed=1)), (P("a"), P(None, "a", "c")),
        "a2b2c2")


@case
def while_dynamic_update_slice_rows_into_sharded_carry():  # While + DUS along the sharded dim
  def f(x, rows):
    def body(i, acc):
      return lax.dynamic_update_slice(acc, rows[i][None] * i, (2 * i, 0))
    return lax.fori_loop(0, 5, body, x)
  check(f, (randn(10, 6), randn(5, 6, seed=1)), (P("x"), P()), "x4")


@case
def scan_writes_rows_of_a_sharded_buffer_int32():  # While, DUS of a partially replicated carry
  def f(buf, rows):
    def body(b, r):
      i, row = r
      return b.at[i].set(row), b.sum()
    return lax.scan(body, buf, (jnp.arange(4, dtype=jnp.int32) * 3, rows))
  check(f, (ints(12, 4), ints(4, 4, seed=1)), (P("a", "b"), P()), "a2b4")


@case
def dynamic_slice_gradient_is_update_slice():  # DynamicUpdateSlice as dynamic-slice's transpose
  check(lambda x, i: jax.grad(lambda x: jnp.sin(lax.dynamic_slice_in_dim(x, i, 3, 0)).sum())(x),
        (randn(13, 4), np.int32(7)), (P("x"), P()), "x4")


@case
def dynamic_update_slice_sharded_update_bf16():  # DUSAlongPartitionedDimension, bf16 sharded update
  check(lambda x, u, i: lax.dynamic_update_slice(x, u * 2, (i, 0)),
        (randn(16, 8, dtype=BF16), randn(4, 8, seed=1, dtype=BF16), np.int32(11)),
        (P("a", "b"), P("a", "b"), P()), "a2b4", out_specs=P("a", "b"))


@case
def dynamic_update_slice_3d_mesh_two_dims():  # DUSPartitionSliceAndNonSliceDims on a 3-D mesh
  check(lambda x, u, i, j: lax.dynamic_update_slice(x, u, (i, 1, j)),
        (randn(6, 4, 10), randn(2, 3, 4, seed=1), np.int32(5), np.int32(3)),
        (P("a", "b", "c"), P(), P(), P()), "a2b2c2")


@case
def dynamic_update_slice_bool_mask():  # DUS of a bool operand sharded on the slice dim
  check(lambda m, i: lax.dynamic_update_slice(m, jnp.ones((3, 4), bool), (i, 0)),
        (np.zeros((16, 4), bool), np.int32(6)), (P("x"), P()), "x8", out_specs=P("x"))


# --- Gather and scatter --------------------------------------------------------------------------

@case
def gather_partitioned_on_trivial_slice_dims():  # GatherPartitionedOnTrivialSliceDims
  check(lambda x, i: x[i], (randn(17, 9), indices(17, 2, 3)), (P("x"), P()), "x2")


@case
def gather_trivial_slice_dims_partial_replicate():  # ..._PartialReplicate
  check(lambda x, i: x[i], (randn(17, 9), indices(17, 2, 3, seed=1)), (P("a"), P()), "a2b4")


@case
def index_passthrough_gather():  # IndexPassthroughGather
  check(lambda x, i, j: x[i, j], (randn(2, 9, 8), indices(2, 4, 4), indices(9, 4, 4, seed=1)),
        (P(), P("a", "b"), P("a", "b")), "a2b4")


@case
def index_and_operand_passthrough_gather():  # IndexAndOperandPassthroughGather
  check(lambda x, i: x[i], (randn(16, 8), indices(16, 8, seed=2)), (P(None, "b"), P("a")), "a2b4",
        out_specs=P("a", "b"))


@case
def gather_operand_and_indices_sharded_3d():  # GatherMergedIndexParallelAndOperandPassthrough
  check(lambda x, i: jnp.take(x, i, axis=0), (randn(12, 6), indices(12, 8, seed=3)),
        (P("a", "b"), P("c")), "a2b2c2")


@case
def gather_explicit_batch_dims():  # GatherExplicitBatchDims (vmap over a sharded batch)
  check(lambda x, i: jax.vmap(lambda r, j: r[j])(x, i),
        (randn(8, 16, 4), indices(16, 8, 3, seed=4)),
        (P("x"), P("x")), "x8")


@case
def gather_parallel_dim_redistribution():  # GatherParallelDimRedistribution
  check(lambda x, i: jax.vmap(lambda r, j: r[j])(x, i),
        (randn(8, 16, 4), indices(16, 8, 3, seed=5)),
        (P("a"), P("b")), "a2b4")


@case
def scatter_partitioned_on_trivial_slice_dims():  # ScatterPartitionedOnTrivialSliceDims
  check(lambda x, i, u: x.at[i].add(u), (randn(17, 9), indices(17, 2, 3, seed=6), randn(2, 3, 9)),
        (P("x"), P(), P()), "x2", out_specs=P("x"))


@case
def index_passthrough_scatter():  # IndexPassthroughScatter, IndexPassthroughScatter_Min
  for seed, update in ((7, lambda ref, u: ref.add(u)), (9, lambda ref, u: ref.min(u))):
    check(lambda x, i, j, u: update(x.at[i, j], u),
          (randn(2, 9, 8), indices(2, 4, 4, seed=seed), indices(9, 4, 4, seed=seed + 1),
           randn(4, 4, 8, seed=1)),
          (P(), P("a", "b"), P("a", "b"), P("a", "b")), "a2b4")


@case
def passthrough_scatter_partial_replicate_uneven():  # PassthroughScatter_PartialReplicate
  check(lambda x, i, u: x.at[i].add(u), (randn(2, 9), indices(2, 3, seed=11), randn(3, 9, seed=1)),
        (P(None, "a"), P(), P(None, "a")), "a2b4")


@case
def scatter_operand_and_indices_sharded():  # ScatterParallelDimRedistribution (both sharded)
  check(lambda x, i, u: x.at[i].add(u),
        (randn(16, 8), indices(16, 8, seed=12), randn(8, 8, seed=1)),
        (P("a"), P("b"), P("b")), "a2b4")


@case
def scatter_int32_set_3d():  # Scatter with int32 updates, operand and indices on a 3-D mesh
  check(lambda x, i, u: x.at[i].set(u),
        (ints(12, 4), np.array([0, 5, 11, 7], np.int32), ints(4, 4, seed=1)),
        (P(("a", "b")), P("c"), P("c")), "a2b2c2")


def parallel_scatter_add(x: jax.Array, u: jax.Array) -> jax.Array:
  """XLA's ScatterParallelDim cases: a scatter-add whose indices are iotas over the leading
  dims (each update row lands on its own operand row)."""
  i, j = (lax.broadcasted_iota(jnp.int32, x.shape[:2], d) for d in (0, 1))
  return x.at[i, j].add(u)


@case
def scatter_parallel_dim_redistribution():  # ScatterParallelDimRedistributionOperand
  check(parallel_scatter_add, (ints(8, 4, 2, 2), ints(8, 4, 2, 2, seed=1)),
        (P("a", "b"), P(("a", "b"))), "a2b4")


@case
def scatter_parallel_dim_partial_replicated_operand():  # ScatterParallelDimPartialReplicatedOperand
  check(parallel_scatter_add, (ints(8, 4, 2, 2), ints(8, 4, 2, 2, seed=1)),
        (P("a"), P(("a", "b"))), "a2b4", out_specs=P(("a", "b")))


@case
def scatter_parallel_dim_swapped_dimensions():  # ScatterParallelDimSwappedDimensions
  check(parallel_scatter_add, (ints(8, 4, 2, 2), ints(8, 4, 2, 2, seed=1)),
        (P("b", "a"), P("b", "a")), "a2b4", out_specs=P("b", "a"))


@case
def gather_parallel_dim_iota_indices():  # GatherParallelDim (iota indices over the batch dim)
  def f(x, j):
    return x[lax.broadcasted_iota(jnp.int32, j.shape, 0), j]
  check(f, (randn(8, 10, 3), indices(10, 8, 5)), (P("x"), P("x")), "x8")


@case
def clamp_mixed_shardings():  # Clamp with operands tiled differently
  check(lambda lo, x, hi: lax.clamp(lo, x, hi), (randn(8, 8) - 1, randn(8, 8, seed=1),
                                                   randn(8, 8, seed=2) + 1),
        (P("a"), P(None, "b"), P()), "a2b4")


@case
def select_pred_sharded_differently_int32():  # Select with a differently tiled predicate
  check(lambda p, x, y: lax.select(p, x, y), (randn(12, 6) > 0, ints(12, 6), ints(12, 6, seed=1)),
        (P(None, "b"), P("a"), P(("a", "b"))), "a2b4")


# x[i] with the indexed dim and the indices' batch dim wanting one mesh axis: the axis goes to the
# indices' dim, which the result holds (as large as the operand here), and the operand is gathered,
# as XLA does; it went to the indexed dim of the larger operand, the indices were gathered and the
# result all-reduced (192 B, XLA 128 B; 768 / 128 B with 64 indices).
@case
def gather_indexed_and_index_dims_one_axis():
  no_more_than_xla(lambda x, i: x[i], (randn(16, 8), indices(16, 16)), (P("a", "b"), P("a")),
                   "a2b4")


@case
def gather_indexed_and_index_dims_one_axis_1d_mesh():
  no_more_than_xla(lambda x, i: x[i], (randn(16, 8), indices(16, 16)), (P("x"), P("x")), "x8")


@case
def gather_indexed_and_index_dims_uneven():
  no_more_than_xla(lambda x, i: x[i], (randn(12, 8), indices(12, 12)), (P("a", "b"), P("a")),
                   "a2b4")


@case
def gather_indexed_and_index_dims_3d_mesh():
  no_more_than_xla(lambda x, i: x[i], (randn(16, 8), indices(16, 16)),
                   (P(("a", "b"), "c"), P(("a", "b"))), "a2b2c2")


@case
def gather_more_indices_than_rows():
  no_more_than_xla(lambda x, i: x[i], (randn(16, 8), indices(16, 4, 16)),
                   (P("a", "b"), P(None, "a")), "a2b4")


@case
def take_columns_index_sharded():
  no_more_than_xla(lambda x, i: jnp.take(x, i, axis=1), (randn(8, 16), indices(16, 16)),
                   (P("b", "a"), P("a")), "a2b4")


@case
def gather_embedding_larger_than_result():  # the table stays split, the ids are gathered
  no_more_than_xla(lambda x, i: x[i], (randn(64, 8), indices(64, 16)), (P("x"), P("x")), "x8")


# --- Random numbers ------------------------------------------------------------------------------

@case
def rng_sharded_3d():  # Rng (RngBitGenerator partitioned on the output's tiles)
  check(lambda k: jax.random.normal(k, (12, 6)), (jax.random.key(3),), P(), "a2b2c2",
        out_specs=P(("a", "b"), "c"))


@case
def rng_bernoulli_partial_replicate():  # Rng, partially replicated output
  check(lambda k, x: jnp.where(jax.random.bernoulli(k, 0.5, x.shape), x, 0.),
        (jax.random.key(4), randn(8, 12)), (P(), P(None, "b")), "a2b4")


@pytest.mark.parametrize("run", CASES, ids=[c.__name__ for c in CASES])
def test_case(run: Callable[[], None]) -> None:
  run()
