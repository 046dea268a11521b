"""XLA's SPMD partitioner cases, round 5 (openxla/xla ``xla/service/spmd/spmd_partitioner_test.cc``
and shardy's partitioner tests): families tests/test_xla_cases.py, test_xla_cases3.py and
test_xla_cases4.py do not mirror, and the neighbours of the known gaps worked on this round.
Each test names the XLA test it mirrors, checks values, plan == compiled HLO and no replicated
fallback (tests/helpers.py), and that spmd moves no more bytes per device than XLA's own
partitioner with the same specs."""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import PartitionSpec as P

from helpers import assert_partitioned_matches as check
from helpers import indices, ints, no_more_than_xla, randn

BF16 = jnp.bfloat16
A2B2 = {"a": 2, "b": 2}  # the first 4 devices


def bmk_bkn(x, y):
  return jnp.einsum("bmk,bkn->bmn", x, y)


# --- A dot whose operands' batch axes disagree: the op may run in either operand's layout -------

def test_dot_batch_disputed_smaller_operand_kept():
  """x P('a','b',None) f32[4,4,16], y P('b',None,'c') f32[4,16,6]: running in x's layout and
  permuting y (XLA's choice), then gathering the result over 'a' into jax.jit's output sharding,
  moves 480 B, as XLA (was 1024 B: y keeping its batch axis, x moved by an all-to-all, a permute
  and a gather)."""
  plan = no_more_than_xla(bmk_bkn, (randn(4, 4, 16), randn(4, 16, 6, seed=1)),
                          (P("a", "b", None), P("b", None, "c")), "a2b2c2", P(None, "b", "c"))
  assert plan.total_bytes == 480, plan.explain()


def test_dot_batch_disputed_smaller_operand_kept_open_output():
  """The same with the output open: propagation gives it y's batch axis, P('b',None,'c'), where
  jax.jit's is P(None,'b','c'), and the result's reshard there moves 144 B (a permute of the
  blocks, then a gather over 'a'; 192 B before round 7): 528 / 480 B (was 1024 B; Known gaps)."""
  plan = check(bmk_bkn, (randn(4, 4, 16), randn(4, 16, 6, seed=1)),
               (P("a", "b", None), P("b", None, "c")), "a2b2c2")
  assert plan.total_bytes == 528, plan.explain()


def test_dot_batch_disputed_smaller_operand_kept_bf16_uneven():
  no_more_than_xla(bmk_bkn, (randn(4, 6, 16, dtype=BF16), randn(4, 16, 10, seed=1, dtype=BF16)),
                   (P("a", "b", None), P("b", None, "c")), "a2b2c2", P(None, "b", "c"))


def test_dot_batch_disputed_2d_mesh():  # DotBatchDimsMismatch, the smaller operand on 'a'
  no_more_than_xla(bmk_bkn, (randn(4, 2, 8), randn(4, 8, 12, seed=1)),
                   (P("a", "b", None), P("b", None, None)), A2B2, P(None, "b", None))


# --- Dot ----------------------------------------------------------------------------------------

def test_dot_inputs_are_identical():  # DotInputsAreIdentical: x @ x, x on a 2x4 tiling
  no_more_than_xla(lambda x: x @ x, (randn(8, 8),), P("a", "b"), "a2b4", P("a", "b"))


def test_dot_inputs_are_identical_transposed_uneven():
  no_more_than_xla(lambda x: x.T @ x, (randn(6, 6),), P("a", "b"), "a2b4")


def test_einsum_rhs_from_broadcast():  # EinsumRHSWindowedContractingFromBroadcast
  no_more_than_xla(lambda x, v: jnp.einsum("bxy,byz->bxz", x, jnp.broadcast_to(v, (2, 8, 4))),
                   (randn(2, 4, 8), randn(4, seed=1)), (P(None, None, "x"), P()), "x4",
                   P(None, "x", None))


def test_dot_int32_contracting_two_axes_3d_mesh():  # DotPartialContracting3
  no_more_than_xla(lambda x, y: x @ y, (ints(4, 8), ints(8, 6, seed=1)),
                   (P(None, ("a", "b")), P(("a", "b"), "c")), "a2b2c2")


# --- Reshards between tilings: subgroup all-to-alls --------------------------------------------

def test_subgroup_all_to_all_reshard():  # SubgroupAllToAllReshard: [2,2,2] -> [2,1,4]
  no_more_than_xla(lambda x: x + 1, (randn(4, 4, 8),), P("a", "b", "c"), "a2b2c2",
                   P("a", None, ("b", "c")))


def test_all_to_all_4d_bf16():  # AllToAll4D: a dim's axis moves to another, two dims stay
  no_more_than_xla(lambda x: x - 1, (randn(2, 4, 4, 2, dtype=BF16),), P("a", "b", None, None),
                   "a2b2c2", P("a", None, "b", None))


def test_reshard_int32_uneven_dim_to_other_dim():  # TiledToTiledUneven, int32
  no_more_than_xla(lambda x: x * 2, (ints(6, 8),), P("x", None), "x4", P(None, "x"))


# --- Gather with parallel (iota) index dims -----------------------------------------------------

def gather_iota(x):
  return x[jnp.arange(x.shape[0])[:, None], jnp.arange(x.shape[1])[None, :]]


def test_gather_parallel_dim_redistribution_operand():  # GatherParallelDimRedistributionOperand
  no_more_than_xla(gather_iota, (ints(8, 4, 2, 2),), P("b", "a"), "a2b4")


def test_gather_parallel_dim_replicated_indices():  # GatherParallelDimReplicatedIndices
  no_more_than_xla(gather_iota, (ints(8, 4, 2, 2),), P("x"), "x8", P("x"))


# --- Scatter --------------------------------------------------------------------------------

def test_scatter_add_rows_operand_sharded_free_dim():  # ScatterPartitionedOnTrivialSliceDims, 2-D
  no_more_than_xla(lambda x, i, u: x.at[i].add(u),
                   (randn(8, 8), indices(8, 4), randn(4, 8, seed=1)),
                   (P(None, "b"), P(), P(None, "b")), "a2b4", P(None, "b"))


def test_scatter_max_int32_index_parallel():  # ScatterIndexParallel with iota indices
  no_more_than_xla(lambda x, u: x.at[jnp.arange(8)].max(u), (ints(8, 4), ints(8, 4, seed=1)),
                   (P("x"), P("x")), "x8", P("x"))


# --- Constants, slices to a scalar ----------------------------------------------------------

def test_constant_slice_reshard():  # ConstantSliceReshard: one element of a sharded row
  no_more_than_xla(lambda x: x[0:1, 0:1].reshape(()), (randn(1, 8),), P(None, "x"), "x8", P())


def test_slice_one_element_3d_mesh_int32():
  no_more_than_xla(lambda x: x[3, 5], (ints(8, 8),), P(("a", "b"), "c"), "a2b2c2", P())


# --- Slices whose blocks read at a per-shard offset -------------------------------------------

def test_slice_2d_per_shard_offset():  # x[1:5, 8:16] of f32[8,16] P('a','b')
  """Result blocks of 2 columns read from input blocks of 4 at a different offset per shard:
  each shard's piece cut at its own offset (halo_geometry.plan_window), 48 B as XLA; was 64 B
  (the halo's widest reach, 4 columns, sent at distance 1)."""
  plan = no_more_than_xla(lambda x: x[1:5, 8:16], (randn(8, 16),), P("a", "b"), "a2b4")
  assert plan.total_bytes == 48, plan.explain()


def test_slice_per_shard_offset_uneven_3d_mesh_int32():
  no_more_than_xla(lambda x: x[2:9, 3:11], (ints(12, 16),), P("a", ("b", "c")), "a2b2c2")


def test_strided_conv_valid_per_shard_offset():  # spans inside the array: pieces or halo
  no_more_than_xla(lambda x, w: conv(x, w, (1, 3), "VALID"),
                   (randn(1, 4, 24, 2), randn(1, 2, 2, 2, seed=1)), (P(None, None, "x"), P()), "x4")


def test_slice_per_shard_offset_1d_bf16():
  no_more_than_xla(lambda x: x[2:10], (randn(16, 2, dtype=BF16),), P("x"), "x4")


# --- Reduce window / pooling -----------------------------------------------------------------

def test_reduce_window_one_side_unequal_halo():  # ReduceWindowTiledOneSideUnequalHalo
  no_more_than_xla(lambda x: lax.reduce_window(x, -jnp.inf, lax.max, (3,), (3,),
                                               ((0, 1),)), (randn(15),), P("x"), "x4")


# --- Convolutions -----------------------------------------------------------------------------

def conv(x, w, stride=(1, 1), padding="SAME"):
  return lax.conv_general_dilated(x, w, stride, padding,
                                  dimension_numbers=("NHWC", "HWIO", "NHWC"))


def test_conv_filter_if_of_partitioned_input_partial_replicate():  # ConvolutionFilterIFOF...
  no_more_than_xla(lambda x, w: conv(x, w, (2, 2)), (randn(2, 8, 8, 4), randn(3, 3, 4, 8, seed=1)),
                   (P(None, None, None, "a"), P(None, None, "a", "b")), A2B2,
                   P(None, None, None, "b"))


def test_conv_input_spatial_and_feature_partitioned():  # ConvolutionInputSpatialDimAndFeature...
  no_more_than_xla(conv, (randn(2, 8, 6, 4), randn(3, 3, 4, 4, seed=1)),
                   (P(None, "a", None, "b"), P(None, None, "b", None)), A2B2, P(None, "a"))


def test_conv_strided_uneven_spatial():
  no_more_than_xla(lambda x, w: conv(x, w, (2, 1)), (randn(1, 13, 4, 2), randn(3, 1, 2, 2, seed=1)),
                   (P(None, "x"), P()), "x4")


# --- Elementwise and friends -----------------------------------------------------------------

def test_complex_elementwise_uneven():  # complex64 elementwise on an uneven tiling
  x = (randn(6, 5) + 1j * randn(6, 5, seed=1)).astype(np.complex64)
  no_more_than_xla(lambda z: z * jnp.conj(z) + 1j, (x,), P("x"), "x4")


def test_atan2_partial_replicate_3d():
  no_more_than_xla(jnp.arctan2, (randn(4, 8), randn(4, 8, seed=1)), (P("a", None), P(None, "c")),
                   "a2b2c2", P("a", "c"))


def test_broadcast_in_dim_transposed_sharding():  # BroadcastPropagateTiledSharding, transposed
  no_more_than_xla(lambda v: jnp.broadcast_to(v[:, None], (8, 6)).T, (randn(8),), P("x"), "x4",
                   P(None, "x"))


# --- Sort / top-k -------------------------------------------------------------------------------

def test_top_k_non_sort_dims_sharded_3d():  # SortTopKNonSortDims
  no_more_than_xla(lambda x: tuple(lax.top_k(x, 2)), (randn(4, 2, 8),), P("a", "b", None), "a2b2c2",
                   (P("a", "b", None), P("a", "b", None)))


def test_sort_int32_keys_along_unsharded_dim_uneven():
  no_more_than_xla(lambda x: jnp.sort(x, 1), (ints(6, 8),), P("x"), "x4")
