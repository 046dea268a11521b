"""XLA's SPMD partitioner cases, round 10 (openxla/xla ``xla/service/spmd/spmd_partitioner_test.cc``,
``xla/service/sharding_propagation_test.cc`` and shardy's explicit-reshards and propagation
tests): families tests/test_xla_cases.py and test_xla_cases3.py to test_xla_cases9.py do not
mirror: explicit reshards for dots whose operands and result all disagree, elementwise operands
splitting one dim over other axes or in another order, reductions whose result is sharded on a
reduced axis; a sharding reaching an open value backward from an output spec through slice,
pad, reverse, concatenate, broadcast and transpose, and forward from an input through them;
dynamic update slices across shard boundaries (literal and traced starts) on 4x2 and 2x2x2
meshes; concatenates of uneven pieces along a sharded dim; partially replicated dots and
convolutions (a kernel tiled on its input features only, grouped convolutions whose groups
straddle shards); parallel-dim gathers and scatters on 4x2; iotas and broadcasts along
unsharded dims of 3-D tilings; tuple reduces mixing sum and max; and tiled-to-tiled and
replicated-to-tiled reshards inside while loop bodies; and the gap closed this round (a reshard
whose new blocks lie inside the old ones, for a value's sole reader, one collective-permute of
the new block).
Each test names the XLA test it mirrors (or the family it extends), checks values, plan ==
compiled HLO and no replicated fallback (tests/helpers.py), and that spmd moves no more bytes
per device than XLA's own partitioner with the same specs; strict xfails give both counts."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from helpers import get_mesh, indices, ints, no_more_than_xla, randn
from test_xla_cases8 import conv

A2B2 = {"a": 2, "b": 2}  # the first 4 devices
A4B2 = {"a": 4, "b": 2}


# --- Explicit reshards (shardy's explicit_reshards tests) ---------------------------------------

def test_dot_operands_and_result_all_disagree():  # explicit_reshards: dot, lhs/rhs/result conflict
  no_more_than_xla(lambda x, y: x @ y, (randn(8, 8), randn(8, 8, seed=1)),
                   (P("a", None), P(None, "b")), A2B2, P("b", "a"))


def test_dot_contracting_split_differently_result_tiled():  # explicit_reshards: dot_general
  no_more_than_xla(lambda x, y: x @ y, (randn(8, 16), randn(16, 8, seed=1)),
                   (P(None, "a"), P("b", None)), "a2b4", P("a", "b"))


def test_dot_general_batch_conflict_result_on_third_axis():  # explicit_reshards: batching dims
  no_more_than_xla(lambda x, y: jnp.einsum("bmk,bkn->bmn", x, y),
                   (randn(4, 4, 8), randn(4, 8, 4, seed=1)), (P("a"), P("b")), "a2b2c2",
                   P("c"))


def test_elementwise_same_dim_other_axes():  # explicit_reshards: add, operands on 'a' vs 'b'
  no_more_than_xla(lambda x, y: x + y, (randn(16, 4), randn(16, 4, seed=1)), (P("a"), P("b")),
                   "a2b4")


def test_elementwise_same_dim_axes_in_other_order():  # explicit_reshards: ('a','b') vs ('b','a')
  no_more_than_xla(lambda x, y: x * y, (randn(8, 4), randn(8, 4, seed=1)),
                   (P(("a", "b")), P(("b", "a"))), A2B2)


def test_elementwise_three_operands_three_tilings_4x2():  # explicit_reshards: select of three
  no_more_than_xla(lambda p, x, y: jnp.where(p > 0, x, y),
                   (randn(8, 8), randn(8, 8, seed=1), randn(8, 8, seed=2)),
                   (P("a", "b"), P("b", "a"), P(None, "a")), A4B2)


def test_reduce_result_sharded_on_reduced_axis():  # explicit_reshards: reduce, result on 'b'
  """The [4] partial sums all-reduced over 'b' (16 B), then each device's [2] block of P('b')
  permuted from its own (8 B), 24 B as XLA (was 48 B: all-gathered over 'a' and sliced)."""
  plan = no_more_than_xla(lambda x: x.sum(1), (randn(8, 8),), P("a", "b"), "a2b4", P("b"))
  assert plan.total_bytes == 24, plan.explain()


def test_reduce_result_on_reduced_axis_reduce_scatter():  # explicit_reshards: reduce-scatter
  no_more_than_xla(lambda x: x.sum(1), (randn(4, 16),), P(None, "b"), "a2b4", P("b"))


def test_reduce_max_result_on_reduced_axes_3d():  # explicit_reshards: reduce_max on ('a','c')
  """All-reduced (max) over ('a','c') (16 B), then the [2] block permuted, 24 B as XLA."""
  plan = no_more_than_xla(lambda x: x.max(0), (randn(8, 8),), P(("a", "c"), "b"), "a2b2c2",
                          P(("a", "c")))
  assert plan.total_bytes == 24, plan.explain()


# --- Propagation: backward from an output spec, forward from an input --------------------------

def test_out_spec_backward_through_slice():  # ShardingPropagation SliceBackwardPass
  no_more_than_xla(lambda x: jnp.sin(x)[2:10], (randn(12, 8),), P(), "a2b4", P("a", "b"))


def test_out_spec_backward_through_pad():  # ShardingPropagation PadBackwardPass
  no_more_than_xla(lambda x: jnp.pad(jnp.exp(x), ((2, 2), (0, 0))), (randn(4, 8),), P(), A2B2,
                   P("a", "b"))


def test_out_spec_backward_through_reverse():  # ShardingPropagation ReverseBackwardPass
  no_more_than_xla(lambda x: jnp.tanh(x)[::-1, ::-1], (randn(8, 8),), P(), A4B2, P("a", "b"))


def test_out_spec_backward_through_concatenate():  # ShardingPropagation ConcatenateBackwardPass
  f = lambda x, y: jnp.concatenate([x * 2, y + 1], 1)
  no_more_than_xla(f, (randn(8, 4), randn(8, 4, seed=1)), (P(), P()), "a2b4", P("a", "b"))


def test_out_spec_backward_through_broadcast_and_transpose():  # BroadcastBackwardPass
  f = lambda x: jnp.broadcast_to(jnp.cos(x), (4, 8, 8)).transpose(0, 2, 1)
  no_more_than_xla(f, (randn(8, 8),), P(), "a2b2c2", P("c", "a", "b"))


def test_out_spec_backward_through_pad_uneven_operand():  # PadBackwardPass, 5 rows over 2
  no_more_than_xla(lambda x: jnp.pad(x * 2, ((1, 2), (0, 0))), (randn(5, 4),), P(), "a2b4",
                   P("a", "b"))


def test_slice_forward_open_output():  # ShardingPropagation SliceForwardPass, jax.jit's output
  no_more_than_xla(lambda x: x[:, 2:6] * 2, (randn(8, 8),), P("a", "b"), "a2b4", like_jit=True)


def test_pad_forward_open_output():  # ShardingPropagation PadForwardPass
  no_more_than_xla(lambda x: jnp.pad(x, ((0, 0), (1, 3))), (randn(8, 4),), P("a", "b"), A2B2,
                   like_jit=True)


def test_reverse_forward_open_output_3d():  # ShardingPropagation ReverseForwardPass
  no_more_than_xla(lambda x: lax.rev(x, (1,)) + 1, (randn(4, 8, 4),), P("a", "b", "c"),
                   "a2b2c2", like_jit=True)


def test_concatenate_forward_operands_disagree():  # ShardingPropagation Concatenate, two tilings
  f = lambda x, y: jnp.concatenate([x, y], 0)
  no_more_than_xla(f, (randn(8, 8), randn(8, 8, seed=1)), (P("a", None), P(None, "b")),
                   "a2b4", like_jit=True)


def test_constraint_mid_chain_backward_through_transpose():  # user sharding, BackwardPass
  mesh = get_mesh("a2b4")
  tiled = NamedSharding(mesh, P("b", "a"))
  f = lambda x: jnp.exp(lax.with_sharding_constraint(jnp.sin(x).T, tiled)) + 1
  no_more_than_xla(f, (randn(8, 8),), P(), mesh, like_jit=True)


# --- Dynamic update slice across shard boundaries ----------------------------------------------

def test_dus_literal_start_straddles_shards_4x2():  # DynamicUpdateSliceAlongPartitionedDimension
  f = lambda x, u: lax.dynamic_update_slice(x, u, (3, 0))
  no_more_than_xla(f, (randn(16, 8), randn(6, 8, seed=1)), (P("a", "b"), P(None, "b")), A4B2)


def test_dus_traced_start_both_dims_3d():  # DUSAlongPartitionedDimension2, two traced starts
  f = lambda x, u, i, j: lax.dynamic_update_slice(x, u, (i, j))
  no_more_than_xla(f, (randn(8, 8), randn(3, 2, seed=1), np.int32(5), np.int32(1)),
                   (P(("a", "b"), "c"), P(), P(), P()), "a2b2c2")


def test_dus_literal_start_int32_update_sharded_on_slice_dim():  # DUS, update tiled too
  f = lambda x, u: lax.dynamic_update_slice(x, u, (0, 4))
  no_more_than_xla(f, (ints(4, 16), ints(4, 8, seed=1)), (P(None, "b"), P(None, "b")), "a2b4")


# --- Concatenate of uneven pieces --------------------------------------------------------------

def test_concatenate_uneven_pieces_sharded_dim():  # ConcatenateAlongPartitionedDimension, 5 + 3
  f = lambda x, y: jnp.concatenate([x, y], 0)
  no_more_than_xla(f, (randn(5, 4), randn(3, 4, seed=1)), (P("a"), P("a")), A2B2, P("a"))


def test_concatenate_three_uneven_pieces_4x2():  # ConcatenateAlongPartitionedDimension, 3+6+7
  f = lambda x, y, z: jnp.concatenate([x, y, z], 1)
  no_more_than_xla(f, (randn(4, 3), randn(4, 6, seed=1), randn(4, 7, seed=2)),
                   (P("b", "a"), P("b", "a"), P("b", "a")), A4B2, P("b", "a"))


# --- Partial replication: dots and convolutions ------------------------------------------------

def test_dot_partial_replicate_lhs_only():  # PartialReplicate dot, lhs on 'a', 'b' replicated
  no_more_than_xla(lambda x, y: x @ y, (randn(8, 8), randn(8, 8, seed=1)), (P("a"), P()),
                   "a2b4", P("a", "b"))


def test_dot_partial_replicate_contracting_3d():  # DotPartialContracting2, 'c' left replicated
  no_more_than_xla(lambda x, y: x @ y, (randn(8, 16), randn(16, 8, seed=1)),
                   (P("a", "b"), P("b", None)), "a2b2c2", P("a", "c"))


def test_dot_contracting_partial_result_rows_other_axis_4x2():  # DotPartialContracting3
  no_more_than_xla(lambda x, y: x @ y, (randn(8, 8), randn(8, 8, seed=1)),
                   (P(None, "b"), P("b", None)), A4B2, P("a"))


def test_conv_kernel_tiled_on_input_features():  # ConvolutionLhsTiledRhsTiled, partial replicate
  no_more_than_xla(conv, (randn(2, 6, 6, 4), randn(3, 3, 4, 4, seed=1)),
                   (P("c", "a", None, "b"), P(None, None, "b")), "a2b2c2")


def test_conv_feature_groups_straddle_shards():  # ConvolutionFeatureGroupCount, 2 groups over 4
  f = lambda x, k: conv(x, k, feature_group_count=2)
  no_more_than_xla(f, (randn(2, 6, 6, 8), randn(3, 3, 4, 4, seed=1)),
                   (P(None, None, None, "b"), P()), "a2b4")


def test_conv_batch_group_count_feature_sharded():  # ConvolutionBatchGroupCount, features tiled
  f = lambda x, k: lax.conv_general_dilated(x, k, (1, 1), "VALID", dimension_numbers=(
      "NHWC", "HWIO", "NHWC"), batch_group_count=4)
  no_more_than_xla(f, (randn(4, 6, 6, 2), randn(3, 3, 2, 4, seed=1)),
                   (P("a"), P(None, None, None, "a")), A2B2)


# --- Gather / scatter on the index parallel dims -----------------------------------------------

def test_take_along_axis_parallel_dim_4x2():  # GatherParallelDim, operand and indices alike
  f = lambda x, i: jnp.take_along_axis(x, i, axis=1)
  no_more_than_xla(f, (randn(8, 16), indices(16, 8, 4)), (P("a", "b"), P("a")), A4B2)


def test_take_along_axis_parallel_dim_uneven():  # GatherParallelDim, 6 rows over 4
  f = lambda x, i: jnp.take_along_axis(x, i, axis=1)
  no_more_than_xla(f, (randn(6, 8), indices(8, 6, 3)), (P("a"), P("a")), A4B2)


def test_scatter_parallel_dim_add_4x2():  # ScatterParallelDim, operand, indices, updates alike
  f = lambda x, i, u: x.at[jnp.arange(8)[:, None], i].add(u)
  no_more_than_xla(f, (randn(8, 8), indices(8, 8, 3), randn(8, 3, seed=1)),
                   (P("a", "b"), P("a"), P("a")), A4B2, P("a", "b"))


# --- Iota / broadcast along unsharded dims -----------------------------------------------------

def test_iota_along_unsharded_dims_3d():  # IotaAlongNonTileDimension, 2x2x2
  f = lambda x: x + lax.broadcasted_iota(jnp.float32, x.shape, 1) * lax.broadcasted_iota(
      jnp.float32, x.shape, 3)
  no_more_than_xla(f, (randn(4, 4, 4, 4),), P("a", None, ("b", "c")), "a2b2c2")


def test_broadcast_new_dims_unsharded_old_dim_tiled():  # BroadcastOnlyOldDimsSharded, 4x2
  f = lambda v, x: v[None, :, None] * x
  no_more_than_xla(f, (randn(8), randn(4, 8, 4, seed=1)), (P("a"), P(None, "a", "b")), A4B2)


# --- Tuple reduce ----------------------------------------------------------------------------

def test_tuple_reduce_sum_and_max_sharded_dim():  # TiledToTiledTupleReduce, sum with max
  def sum_max(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    return lax.reduce((x, x), (np.float32(0), np.float32(-np.inf)),
                      lambda a, b: (a[0] + b[0], jnp.maximum(a[1], b[1])), (1,))
  no_more_than_xla(sum_max, (randn(8, 8),), P("a", "b"), A4B2)


# --- Reshards inside while loop bodies ---------------------------------------------------------

def test_while_body_tiled_to_tiled_reshard():  # While, TiledToTiled inside the body
  mesh = get_mesh("a2b4")
  cols = NamedSharding(mesh, P(None, "b"))
  f = lambda x, w: lax.fori_loop(
      0, 2, lambda i, c: jnp.tanh(lax.with_sharding_constraint(c, cols) @ w), x)
  no_more_than_xla(f, (randn(8, 8), randn(8, 8, seed=1) / 4), (P("a"), P("b")), mesh, P("a"))


def test_while_body_replicated_to_tiled_reshard():  # While, ReplicatedToTiled inside the body
  mesh = get_mesh("a2b2c2")
  tiled = NamedSharding(mesh, P("a", ("b", "c")))
  f = lambda x: lax.fori_loop(
      0, 3, lambda i, c: jnp.sin(lax.with_sharding_constraint(c * 2, tiled)).sum(0) + c, x)
  no_more_than_xla(f, (randn(4, 8),), P(), mesh)


def test_scan_body_reshards_carry_against_xs():  # While (a scan), TiledToTiled carry vs xs
  """The carry keeps the body's P('b') and the init P('a') is permuted once before the loop
  (32 B), as XLA does: per trip only xs moves (an all-to-all, 32 B). Before round 15 the init's
  P('a') won the carry and the body resharded it there and back on every trip (128 B)."""
  mesh = get_mesh("a2b4")
  rows = NamedSharding(mesh, P("b"))

  def step(c: jax.Array, x: jax.Array) -> tuple[jax.Array, jax.Array]:
    c = jnp.tanh(lax.with_sharding_constraint(c, rows) + x)
    return c, c.sum(1)
  plan = no_more_than_xla(lambda c, xs: lax.scan(step, c, xs),
                          (randn(8, 4), randn(3, 8, 4, seed=1)), (P("a"), P(None, None, "b")), mesh)
  assert plan.step_bytes == 32 + 3 * 32, plan.explain()
