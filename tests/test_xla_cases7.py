"""XLA's SPMD partitioner cases, round 7 (openxla/xla ``xla/service/spmd/spmd_partitioner_test.cc``
and shardy's partitioner tests): families tests/test_xla_cases.py and test_xla_cases3.py to
test_xla_cases6.py do not mirror: dots whose operands name their axes in other orders or leave
some replicated, the windowed-einsum families in forms of XLA's bytes, negative and interior
padding, strided slices and reverses over two axes, dilated windows, max-pool gradients on two
sharded dims, gathers and scatters on 3-D meshes, sorts with an iota operand, reshapes and
transposes with partial replication, conditionals and loops with sharded carries, and reshards
between partial tilings of a 2x2x2 mesh; and the gaps closed this round (axes traded between
dims while others are dropped, loop carries whose in and out specs disagree, reshapes into
uneven tilings). Each test names the XLA test it mirrors (or the family
it extends), checks values, plan == compiled HLO and no replicated fallback (tests/helpers.py),
and that spmd moves no more bytes per device than XLA's own partitioner with the same specs."""
from __future__ import annotations

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from helpers import indices, ints, no_more_than_xla, randn

BF16 = jnp.bfloat16
A2B2 = {"a": 2, "b": 2}  # the first 4 devices
A4B2 = {"a": 4, "b": 2}


# --- Dots: axis orders, partial replication, windowed-einsum families ---------------------------

def test_dot_contracting_axes_in_other_orders():  # DotPartialContracting, ('b','a') vs ('a','b')
  no_more_than_xla(lambda x, y: x @ y, (randn(4, 16), randn(16, 6, seed=1)),
                   (P(None, ("b", "a")), P(("a", "b"), None)), "a2b4")


def test_dot_batch_and_non_contracting_3d():  # DotBatchAndNonContracting
  no_more_than_xla(lambda x, y: jnp.einsum("bmk,bkn->bmn", x, y),
                   (randn(2, 4, 6), randn(2, 6, 4, seed=1)),
                   (P("a", "b", None), P("a", None, "c")), "a2b2c2", P("a", "b", "c"))


def test_einsum_rhs_windowed_in_contracting():  # EinsumRHSWindowedInContracting
  no_more_than_xla(lambda x, y: jnp.einsum("mk,kn->mn", x, y), (randn(8, 12), randn(12, 4, seed=1)),
                   (P("x", None), P("x", None)), "x4", P("x", None))


def test_einsum_lhs_windowed_contracting_bf16():  # EinsumLHSWindowedContracting
  no_more_than_xla(lambda x, y: jnp.einsum("mk,kn->mn", x, y),
                   (randn(8, 8, dtype=BF16), randn(8, 12, seed=1, dtype=BF16)),
                   (P(None, "x"), P(None, "x")), "x4", P(None, "x"))


def test_dot_non_contracting_partial_replicate_3d():  # DotPartialNonContracting, 3-D mesh
  no_more_than_xla(lambda x, y: x @ y, (randn(8, 6), randn(6, 8, seed=1)),
                   (P(("a", "c"), None), P(None, "b")), "a2b2c2", P(("a", "c"), "b"))


def test_dot_output_axes_reordered():  # Dot2DPartitionedNonContractingAndContracting, reshard
  no_more_than_xla(lambda x, y: x @ y, (randn(8, 8), randn(8, 8, seed=1)),
                   (P("a", "b"), P("b", None)), A2B2, P("b", "a"))


# --- Padding, slicing, reversing ------------------------------------------------------------

def test_pad_negative_both_sides():  # PadAlongPartitionedDimensionWithNegativePadding
  no_more_than_xla(lambda x: lax.pad(x, 0.0, [(-1, -2, 0), (0, 0, 0)]), (randn(16, 4),),
                   P("x"), "x4")


def test_pad_negative_high_interior_other_dim_int32():
  no_more_than_xla(lambda x: lax.pad(x, jnp.int32(7), [(0, -3, 0), (1, 0, 1)]), (ints(8, 4),),
                   P("a", "b"), A2B2)


def test_slice_strided_two_axes():  # SliceAlongPartitionedDimension, stride over ('a','b')
  no_more_than_xla(lambda x: x[1::3], (randn(24, 2),), P(("a", "b")), "a2b4")


def test_slice_strided_both_dims_3d_bf16():
  no_more_than_xla(lambda x: x[::2, 1::2], (randn(8, 8, dtype=BF16),), P("a", ("b", "c")),
                   "a2b2c2")


def test_reverse_two_axes_uneven():  # ReverseAlongPartitionedDimension, uneven over ('a','b')
  no_more_than_xla(lambda x: jnp.flip(x, 0), (randn(10, 3),), P(("a", "b")), A2B2)


# --- Windows ---------------------------------------------------------------------------------

def test_reduce_window_negative_left_halo_dilated():  # ReduceWindowTiledNegativeLeftHalo, dilated
  f = lambda x: lax.reduce_window(x, -jnp.inf, lax.max, (3, 1), (1, 1), ((2, 0), (0, 0)),
                                  window_dilation=(2, 1))
  no_more_than_xla(f, (randn(16, 4),), P("x"), "x4")


def test_reduce_window_sum_stride_two_dims_3d():  # ReduceWindowTiled2D, on a 2x2x2 mesh
  f = lambda x: lax.reduce_window(x, 0.0, lax.add, (2, 2), (2, 2), "VALID")
  no_more_than_xla(f, (randn(8, 8),), P("a", ("b", "c")), "a2b2c2")


def test_select_and_scatter_two_dims():  # SelectAndScatterNoOverlap, two sharded dims
  pool = lambda x: lax.reduce_window(x, -jnp.inf, lax.max, (2, 2), (2, 2), "VALID")
  f = lambda x: jax.grad(lambda v: (pool(v) ** 2).sum())(x)
  no_more_than_xla(f, (randn(8, 8),), P("a", "b"), A2B2)


def test_select_and_scatter_overlap_padded():  # SelectAndScatterWithOverlap, SAME padding
  pool = lambda x: lax.reduce_window(x, -jnp.inf, lax.max, (3,), (2,), "SAME")
  f = lambda x: jax.grad(lambda v: (pool(v) * jnp.arange(8.0)).sum())(x)
  no_more_than_xla(f, (randn(16),), P("x"), "x4")


# --- Gather / scatter ------------------------------------------------------------------------

def test_gather_index_passthrough_3d():  # IndexPassthroughGather, indices on two axes
  no_more_than_xla(lambda x, i: x[i], (randn(8, 4), indices(8, 8, 2)),
                   (P(None, "c"), P(("a", "b"), None)), "a2b2c2")


def test_gather_trivial_slice_dims_int32():  # GatherPartitionedOnTrivialSliceDims
  dnums = lax.GatherDimensionNumbers(offset_dims=(1,), collapsed_slice_dims=(0,),
                                     start_index_map=(0,))
  f = lambda x, i: lax.gather(x, i, dnums, (1, 4), mode="clip")
  no_more_than_xla(f, (ints(16, 4), indices(16, 6, 1)), (P("a", "b"), P()), A2B2)


def test_scatter_add_index_passthrough_3d():  # IndexPassthroughScatter, 2x2x2
  f = lambda x, i, u: x.at[i].add(u)
  no_more_than_xla(f, (randn(6, 8), indices(6, 8), randn(8, 8, seed=1)),
                   (P(None, "c"), P(("a", "b")), P(("a", "b"), "c")), "a2b2c2", P(None, "c"))


def test_scatter_trivial_slice_dims_2x4():  # ScatterPartitionedOnTrivialSliceDims
  f = lambda x, i, u: x.at[i].set(u, mode="drop")
  no_more_than_xla(f, (randn(8, 8), indices(8, 3), randn(3, 8, seed=1)),
                   (P("a", "b"), P(), P(None, "b")), "a2b4", P("a", "b"))


# --- Sort and top-k --------------------------------------------------------------------------

def test_sort_sharded_on_sort_dim_with_iota():  # SortShardedOnSortDim, (keys, iota) variadic
  f = lambda x: lax.sort((x, lax.broadcasted_iota(jnp.int32, x.shape, 1)), dimension=1,
                         num_keys=1)
  no_more_than_xla(f, (randn(4, 16),), P("a", "b"), "a2b4")


def test_top_k_sharded_last_dim_3d():  # CustomCall TopK (PartitionSortInTopK), batch sharded too
  no_more_than_xla(lambda x: lax.top_k(x, 3), (randn(4, 16),), P("a", ("b", "c")), "a2b2c2")


# --- Dynamic slices / updates ------------------------------------------------------------------

def test_dynamic_slice_sharded_dims_constant_3d():  # DynamicSliceAlongPartitionedDimension
  no_more_than_xla(lambda x: lax.dynamic_slice(x, (1, 2), (4, 4)), (randn(8, 8),),
                   P("a", ("b", "c")), "a2b2c2")


def test_dynamic_update_slice_both_sharded_bf16():  # DUSAlongPartitionedDimension2
  no_more_than_xla(lambda x, u: lax.dynamic_update_slice(x, u, (2, 5)),
                   (randn(8, 8, dtype=BF16), randn(3, 2, seed=1, dtype=BF16)),
                   (P("a", "b"), P()), A4B2, P("a", "b"))


# --- Transposes, reshapes, iotas ---------------------------------------------------------------

def test_transpose_partial_replicate_3d():  # PartialReplicateShardableTranspose
  no_more_than_xla(lambda x: x.T, (randn(4, 8),), P("a", "c"), "a2b2c2", P("c", "a"))


def test_reshape_merge_two_sharded_dims_reordered():  # ShardableReshape, ('b','a') merged
  no_more_than_xla(lambda x: x.reshape(32), (randn(4, 8),), P("b", "a"), A2B2)


def test_reshape_split_uneven_partial_replicate():  # NonShardableReshape, 'a' only of 2x2
  no_more_than_xla(lambda x: x.reshape(3, 10), (randn(30),), P("a"), A2B2)


def test_iota_along_two_tiled_dims_transposed_axes():  # IotaAlongTileDimension, ('b','a')
  f = lambda x: x + lax.broadcasted_iota(jnp.int32, (8, 8), 0) * 8 + lax.broadcasted_iota(
      jnp.int32, (8, 8), 1)
  no_more_than_xla(f, (ints(8, 8),), P(("b", "a"), None), A4B2)


def test_iota_reshaped_into_uneven_tiling():  # IotaAlongTileDimension, through a reshape
  """jnp.arange(12.).reshape(3, 4) added to f32[3,4] P('a','b'): the iota is made whole
  (free) and reshaped, 32 B as XLA (was 80 B: propagation gave the iota P('a') through the
  reshape, blocks of 6 where the result's rows of 'a' are blocks of 8, then gathered it)."""
  plan = no_more_than_xla(lambda x: x + jnp.arange(12.0).reshape(3, 4), (randn(3, 4),),
                          P("a", "b"), A2B2)
  assert plan.total_bytes == 32, plan.explain()


def test_iota_reshaped_into_uneven_tiling_3d():  # the same over ('b','c'), 3-D mesh
  no_more_than_xla(lambda x: x * jnp.arange(30.0).reshape(5, 6), (randn(5, 6),),
                   P("a", ("b", "c")), "a2b2c2")


def test_reshape_split_into_uneven_tiling_3d():  # ReshapeWithReshard, the operand computed
  no_more_than_xla(lambda x, y: x + jnp.sin(y).reshape(6, 4), (randn(6, 4), randn(24, seed=1)),
                   (P(("a", "b"), "c"), P()), "a2b2c2")


# --- Control flow -----------------------------------------------------------------------------

def test_conditional_sharded_operands_differently():  # Conditional, branches on other tilings
  f = lambda p, x, y: lax.cond(p, lambda a, b: a * 2 + b, lambda a, b: a - b, x, y)
  no_more_than_xla(f, (jnp.bool_(True), randn(8, 8), randn(8, 8, seed=1)),
                   (P(), P("a", "b"), P("a", "b")), "a2b4", P("a", "b"))


def test_while_sharded_carry_reduce_3d():  # While, carry sharded over the whole 2x2x2 mesh
  def f(x):
    def body(c):
      v, k = c
      return jnp.sin(v) + v.sum(0, keepdims=True), k + 1
    return lax.while_loop(lambda c: c[1] < 3, body, (x, 0))[0]
  no_more_than_xla(f, (randn(4, 8),), P("a", ("b", "c")), "a2b2c2", P("a", ("b", "c")))


def test_while_carry_in_and_out_specs_disagree():  # WhileInputAndOutputTiled, other tilings
  """A carry entering P('a','b') and returned P('b','a'): it keeps the init's tiling and the
  result is permuted once, 16 B as XLA (was 96 B: the closed init and output tied on the
  carry's link, which ran replicated)."""
  plan = no_more_than_xla(lambda x: lax.fori_loop(0, 2, lambda i, c: jnp.sin(c), x),
                          (randn(4, 4),), P("a", "b"), A2B2, P("b", "a"))
  assert plan.total_bytes == 16, plan.explain()


def test_while_carry_transposed_each_trip_3d():  # While, the body transposes its carry
  no_more_than_xla(lambda x: lax.fori_loop(0, 2, lambda i, c: c.T * 2, x), (randn(4, 4),),
                   P("a", "c"), "a2b2c2", P("c", "a"))


# --- Reshards between partial tilings of a 3-D mesh ---------------------------------------------

def test_tiled_to_partially_tiled_3d():  # TiledToPartiallyTiled, 2x2x2
  no_more_than_xla(lambda x: x * 2, (randn(4, 4, 4),), P("a", "b", "c"), "a2b2c2",
                   P("a", None, None))


def test_partial_replicate_to_tiled_3d():  # PartialReplicateToTiled, 2x2x2
  no_more_than_xla(lambda x: x + 1, (randn(4, 4, 4),), P(None, "b"), "a2b2c2",
                   P("a", "b", "c"))


def test_all_to_all_between_dims_3d_int32():  # shardy AllToAll, 'c' moved with 'a' kept
  no_more_than_xla(lambda x: x * 3, (ints(4, 8, 4),), P("a", "c", None), "a2b2c2",
                   P("a", None, "c"))


def test_all_to_all_two_axes_to_other_dim():  # shardy AllToAll, ('a','b') moved together
  no_more_than_xla(lambda x: x - 1, (randn(8, 8),), P(("a", "b"), None), A2B2,
                   P(None, ("a", "b")))


def test_trade_axes_and_drop_one_3d():  # TiledToPartiallyTiled, the kept axes on other dims
  """P('a','b','c') -> P('c', None, 'a') of f32[4,4,4]: 'a' and 'c' trade dims in one permute of
  the block, then 'b' is gathered, 96 B as XLA (was 160 B: two all-to-alls and a permute)."""
  plan = no_more_than_xla(lambda x: x * 2, (randn(4, 4, 4),), P("a", "b", "c"), "a2b2c2",
                          P("c", None, "a"))
  assert plan.total_bytes == 96, plan.explain()


def test_trade_axes_and_drop_two_3d_bf16():  # TiledToPartiallyTiled, one axis kept elsewhere
  no_more_than_xla(lambda x: x + 1, (randn(4, 4, 4, dtype=BF16),), P("a", "b", "c"), "a2b2c2",
                   P("c", None, None))


def test_trade_axes_and_drop_one_uneven_int32():  # the same, with uneven dims
  no_more_than_xla(lambda x: x * 2, (ints(6, 5, 4),), P("a", "b", "c"), "a2b2c2",
                   P("b", None, "a"))


def test_reduce_then_trade_axes_3d():  # TiledToPartiallyTiledReduce, the result's axes traded
  """x.sum(1) of f32[4,4,4] P('a','b','c') into P('c','a'): the partial sums over 'b' reduced in
  the operand's layout, then 'a' and 'c' trade dims in one permute, 32 B as XLA (was 48 B: the
  operand permuted before the reduce)."""
  plan = no_more_than_xla(lambda x: x.sum(1), (randn(4, 4, 4),), P("a", "b", "c"), "a2b2c2",
                          P("c", "a"))
  assert plan.total_bytes == 32, plan.explain()


def test_reduce_max_then_trade_axes_int32():  # the same with a max
  no_more_than_xla(lambda x: x.max(1), (ints(4, 4, 8),), P("a", "b", "c"), "a2b2c2", P("c", "a"))
