"""XLA's SPMD partitioner cases, round 9 (openxla/xla ``xla/service/spmd/spmd_partitioner_test.cc``,
``xla/service/sharding_propagation_test.cc`` and shardy's propagation tests): families
tests/test_xla_cases.py and test_xla_cases3.py to test_xla_cases8.py do not mirror: the output
sharding propagation chooses (compared with jax.jit's) for elementwise ops and dots whose operands
disagree, broadcast / reshape / transpose chains carrying a sharding forward, user annotations
inside a chain and in loop and conditional bodies; windows with base dilation, overlapping
max-pool gradients, interior padding, strides on a 4x2 mesh, a constant and a
traced dynamic slice side by side; sorts with two keys, top_k over two axes, a variadic reduce
over two mesh axes; merged and split reshapes with halos and partial replication; dots whose
contracting dims are split differently, whose batch dims disagree or whose output spec moves
both operands; scatters and gathers with operand and updates on other axes and full-dim slices;
batch-sharded cholesky, triangular_solve and eigh; and the gaps closed this round (gathers of
several dims ordered by growth, finer blocks on other axes taken by one collective-permute,
base-dilated halo dims exchanged last).
Each test names the XLA test it mirrors (or the family it extends), checks values, plan ==
compiled HLO and no replicated fallback (tests/helpers.py), and that spmd moves no more bytes
per device than XLA's own partitioner with the same specs; strict xfails give both counts."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from helpers import check_jit_within_xla, get_mesh, indices, ints, no_more_than_xla, randn, spd

A2B2 = {"a": 2, "b": 2}  # the first 4 devices
A4B2 = {"a": 4, "b": 2}


# --- Propagation: the output sharding chosen, as jax.jit chooses it ------------------------------

def test_elementwise_conflicting_operands_output():  # ShardingPropagation ElementwiseOperation
  no_more_than_xla(lambda x, y: x * y + 1, (randn(8, 8), randn(8, 8, seed=1)),
                   (P("a", None), P(None, "b")), "a2b4", like_jit=True)


def test_dot_operands_disagree_output():  # ShardingPropagation DotMergeOperands
  no_more_than_xla(lambda x, y: x @ y, (randn(8, 8), randn(8, 8, seed=1)),
                   (P("a", None), P(None, "a")), "a2b4", like_jit=True)


def test_broadcast_reshape_transpose_chain_forward():  # BroadcastForwardPass, then reshape
  f = lambda x: jnp.broadcast_to(x, (2, 8, 4)).reshape(16, 4).T * 2
  no_more_than_xla(f, (randn(8, 4),), P("a", "b"), A2B2, like_jit=True)


def test_transpose_reshape_chain_forward_3d():  # TransposeForwardPass, ReshapeForwardPass
  f = lambda x: jnp.tanh(x.transpose(1, 0, 2).reshape(4, 32))
  no_more_than_xla(f, (randn(4, 4, 8),), P("a", "b", "c"), "a2b2c2", like_jit=True)


def test_user_annotation_overrides_inferred():  # ShardingPropagation, user sharding priority
  mesh = get_mesh("a2b4")
  cols = NamedSharding(mesh, P(None, "b"))
  f = lambda x: jnp.exp(lax.with_sharding_constraint(jnp.sin(x), cols)) * 3
  no_more_than_xla(f, (randn(8, 8),), P("a", None), mesh, like_jit=True)


def test_annotation_propagates_backward_to_constant():  # BackwardPass from a user annotation
  mesh = get_mesh("a2b4")
  tiled = NamedSharding(mesh, P("a", "b"))
  f = lambda x: x + lax.with_sharding_constraint(
      lax.broadcasted_iota(jnp.float32, (8, 8), 0) * 2, tiled)
  no_more_than_xla(f, (randn(8, 8),), P(), mesh, like_jit=True)


def test_while_body_propagates_carry_sharding():  # ShardingPropagation While, carry tiled
  f = lambda x, w: lax.fori_loop(0, 3, lambda i, c: jnp.tanh(c @ w), x)
  no_more_than_xla(f, (randn(8, 8), randn(8, 8, seed=1) / 4), (P("a"), P(None, "b")), "a2b4",
                   P("a"))


def test_cond_branches_propagate_output():  # ShardingPropagation Conditional
  f = lambda p, x: lax.cond(p, lambda v: v.T @ v, lambda v: v.T * 2 @ v, x)
  no_more_than_xla(f, (jnp.bool_(False), randn(8, 8)), (P(), P("a", "b")), A2B2)



def test_two_annotations_the_later_wins():  # ShardingPropagation, user shardings in a chain
  mesh = get_mesh("a2b4")
  cols, rows = NamedSharding(mesh, P(None, "b")), NamedSharding(mesh, P("a"))
  f = lambda x: lax.with_sharding_constraint(
      jnp.sin(lax.with_sharding_constraint(x * 2, cols)), rows) + 1
  no_more_than_xla(f, (randn(8, 8),), P(), mesh, like_jit=True)


def test_dot_operands_disagree_3d_output():  # ShardingPropagation DotMergeOperands, 2x2x2
  no_more_than_xla(lambda x, y: x @ y, (randn(8, 8), randn(8, 8, seed=1)),
                   (P("a", "b"), P("c", None)), "a2b2c2", like_jit=True)


def test_while_annotation_shards_replicated_carry():  # ShardingPropagation While, from the body
  mesh = get_mesh("a2b4")
  rows = NamedSharding(mesh, P("a"))
  f = lambda x: lax.fori_loop(0, 2, lambda i, c: lax.with_sharding_constraint(c * 2, rows), x)
  no_more_than_xla(f, (randn(8, 8),), P(), mesh, like_jit=True)

# --- Windows --------------------------------------------------------------------------------

def test_reduce_window_base_dilation_2d_mesh():  # ReduceWindow with base dilation, tiled
  f = lambda x: lax.reduce_window(x, 0.0, lax.add, (3, 1), (1, 1), [(1, 1), (0, 0)],
                                  base_dilation=(2, 1))
  no_more_than_xla(f, (randn(8, 4),), P("a", "b"), A4B2)


def test_pad_interior_sharded_dim_int32_4x2():  # PadAlongPartitionedDimensionWithInteriorPadding
  no_more_than_xla(lambda x: lax.pad(x, np.int32(-1), [(1, 2, 1), (0, 0, 0)]), (ints(8, 4),),
                   P("a", "b"), A4B2)


def test_slice_stride3_sharded_dim_4x2():  # SliceAlongPartitionedDimension, stride 3
  no_more_than_xla(lambda x: x[1::3, ::2], (randn(24, 8),), P("a", "b"), A4B2)


def test_dynamic_slice_constant_and_traced_side_by_side():  # DynamicSlice, literal and traced
  f = lambda x, i: (lax.dynamic_slice(x, (2, 0), (4, 8)), lax.dynamic_slice(x, (i, 0), (4, 8)))
  no_more_than_xla(f, (randn(8, 8), np.int32(3)), (P("a", "b"), P()), A2B2)


# --- Sort, top_k, variadic reduce ------------------------------------------------------------

def test_sort_two_keys_and_payload_sharded_dim():  # SortShardedOnSortDim, num_keys=2
  f = lambda k1, k2: lax.sort((k1, k2, lax.broadcasted_iota(jnp.int32, k1.shape, 1)),
                              dimension=1, num_keys=2)
  no_more_than_xla(f, (indices(3, 4, 16), randn(4, 16)), (P(None, "b"), P(None, "b")), "a2b4")


def test_top_k_over_two_axes_2x2():  # PartitionSortInTopK, the sorted dim over ('a','b')
  no_more_than_xla(lambda x: lax.top_k(x, 2), (randn(8, 16),), P(None, ("a", "b")), A2B2)


def test_variadic_reduce_over_two_mesh_axes():  # TiledToReplicatedTupleReduce, two dims
  def argmax_2d(x: jax.Array) -> tuple[jax.Array, jax.Array]:
    idx = lax.broadcasted_iota(jnp.int32, x.shape, 0) * x.shape[1] + lax.broadcasted_iota(
        jnp.int32, x.shape, 1)

    def pick(a: tuple, b: tuple) -> tuple:
      take = (a[0] > b[0]) | ((a[0] == b[0]) & (a[1] < b[1]))
      return lax.select(take, a[0], b[0]), lax.select(take, a[1], b[1])
    return lax.reduce((x, idx), (np.float32(-np.inf), np.int32(0)), pick, (0, 1))
  no_more_than_xla(argmax_2d, (randn(8, 8),), P("a", "b"), A2B2)


# --- Reshapes ------------------------------------------------------------------------------

def test_reshape_merge_dims_with_halo_exchange_2d():  # ReshapeMergeDimsWithHaloExchange
  no_more_than_xla(lambda x: x.reshape(24, 4), (randn(4, 6, 4),), P(None, "a", "b"), A2B2)


def test_reshape_split_dims_with_halo_exchange():  # ReshapeSplitDimsWithHaloExchange
  no_more_than_xla(lambda x: x.reshape(3, 8, 4), (randn(24, 4),), P(("a", "b")), "a2b4")


def test_reshape_partial_replicate_split_3d():  # PartialReplicateShardableReshape, 'c' replicated
  no_more_than_xla(lambda x: x.reshape(4, 2, 6), (randn(8, 6),), P(("a", "b")), "a2b2c2")


# --- Dots ----------------------------------------------------------------------------------

def test_windowed_contracting_split_differently():  # EinsumRHSWindowedContracting, two axes
  no_more_than_xla(lambda x, y: x @ y, (randn(8, 64), randn(64, 8, seed=1)),
                   (P(None, "a"), P("b", None)), "a2b4")


def test_dot_batch_on_other_axes_per_operand_4x2():  # EinsumBatchPartitioned, batch disagrees
  no_more_than_xla(lambda x, y: jnp.einsum("bmk,bkn->bmn", x, y),
                   (randn(8, 4, 4), randn(8, 4, 4, seed=1)), (P("b"), P("a")), A4B2)


def test_dot_output_spec_moves_both_operands():  # DotLhsTiledRhsTiledWithReshard, both moved
  no_more_than_xla(lambda x, y: x @ y, (randn(8, 8), randn(8, 8, seed=1)),
                   (P(None, "a"), P("b", None)), A2B2, P("b", "a"))


# --- Scatter / gather ----------------------------------------------------------------------

def test_scatter_operand_and_updates_other_axes():  # Scatter, operand on a, updates on b
  f = lambda x, i, u: x.at[i].add(u)
  no_more_than_xla(f, (randn(8, 8), indices(8, 4), randn(4, 8, seed=1)),
                   (P("a"), P(), P(None, "b")), "a2b4", P("a"))


def test_gather_full_dim_slice_passthrough():  # PassthroughGather, sharded dim sliced whole
  no_more_than_xla(lambda x, i: x[:, i], (randn(8, 8), indices(8, 5)), (P("a", "b"), P()),
                   "a2b4")


def test_gather_two_indexed_dims_sharded_operand():  # Gather, point indices into a 2-D tile
  no_more_than_xla(lambda x, i: x[i[:, 0], i[:, 1]], (randn(8, 8), indices(8, 6, 2)),
                   (P("a", "b"), P()), A2B2)


# --- Linear algebra, batch-sharded ------------------------------------------------------------

def test_cholesky_batch_over_two_axes():  # PartitionCustomCall (Cholesky), batch tiled
  no_more_than_xla(jnp.linalg.cholesky, (spd(4, 4),), P(("a", "b")), A2B2, rtol=1e-4,
                   atol=1e-4)


def test_triangular_solve_batch_sharded():  # TriangularSolve, batch tiled, rhs columns too
  f = lambda a, b: lax.linalg.triangular_solve(a, b, left_side=True, lower=True)
  a = np.tril(randn(8, 4, 4)) + 4 * np.eye(4, dtype=np.float32)
  no_more_than_xla(f, (a, randn(8, 4, 4, seed=1)), (P("a"), P("a", None, "b")), "a2b4",
                   rtol=1e-4, atol=1e-4)


def test_eigh_batch_sharded_3d():  # PartitionCustomCall (Eigh), batch over the 2x2x2 mesh
  f = lambda x: jnp.linalg.eigh(x)[0]
  no_more_than_xla(f, (spd(8, 4),), P(("a", "b", "c")), "a2b2c2", rtol=1e-4, atol=1e-4)


# --- Propagation under set_mesh and backward; windows on uneven dims; 3-D meshes -------------

def test_dot_operands_disagree_output_under_set_mesh():  # DotMergeOperands, the user's spelling
  """Under jax.set_mesh, jax.jit gives an output sharded like the first input that input's
  spelling, P('a', None); the bytes as XLA's."""
  fn, args, specs = lambda x, y: x @ y, (randn(8, 8), randn(8, 8, seed=1)), (P("a", None),
                                                                             P(None, "a"))
  check_jit_within_xla(fn, args, specs, "a2b4")


def test_out_spec_propagates_backward_through_reshape():  # ReshapeBackwardPass
  no_more_than_xla(lambda x: jnp.sin(x * 2).reshape(4, 2, 8), (randn(8, 8),), P(), "a2b4",
                   P("a", None, "b"))


def test_reduce_window_base_dilation_strided_uneven():  # ReduceWindow base dilation, 10 over 4
  f = lambda x: lax.reduce_window(x, 0.0, lax.add, (3, 1), (2, 1), [(1, 1), (0, 0)],
                                  base_dilation=(2, 1))
  no_more_than_xla(f, (randn(10, 4),), P(("a", "b")), A2B2)


def test_select_and_scatter_strided_padded_uneven():  # SelectAndScatterWithOverlap, uneven
  pool = lambda v: lax.reduce_window(v, -jnp.inf, lax.max, (3, 1), (2, 1), [(1, 1), (0, 0)])
  f = lambda x, g: jax.vjp(pool, x)[1](g)[0]
  no_more_than_xla(f, (randn(10, 4), randn(5, 4, seed=1)), (P("a", "b"), P("a", "b")), A2B2)


def test_windowed_contracting_over_two_axes_each_3d():  # EinsumWindowedContracting, 2x2x2
  no_more_than_xla(lambda x, y: x @ y, (randn(8, 32), randn(32, 8, seed=1)),
                   (P("a", ("b", "c")), P(("c", "b"), None)), "a2b2c2")


def test_while_body_cond_changes_sharding():  # While whose body holds a Conditional
  def body(i: jax.Array, c: jax.Array) -> jax.Array:
    return lax.cond(i % 2 == 0, lambda v: v.T, lambda v: jnp.tanh(v), c)
  no_more_than_xla(lambda x: lax.fori_loop(0, 3, body, x), (randn(8, 8),), P("a", "b"), A2B2)


# --- Gaps closed this round --------------------------------------------------------------------

def test_dynamic_slice_traced_two_dims_gathers_both_at_once():  # DynamicSlice, traced, 2x2x2
  """Both dims gathered for a traced dynamic slice of f32[8,8] P(('a','b'),'c'): one all-gather
  over all three axes (reshard.py's GatherDims), 256 B; XLA gathers the dim over 'c' first
  (64 B, then 256 B), 320 B (was 384 B: dim 0 first, 128 B then 256 B)."""
  f = lambda x, i, j: lax.dynamic_slice(x, (i, j), (3, 5))
  plan = no_more_than_xla(f, (randn(8, 8), np.int32(2), np.int32(4)),
                          (P(("a", "b"), "c"), P(), P()), "a2b2c2")
  assert plan.total_bytes == 256, plan.explain()


# Reshards whose new blocks lie inside the old ones: one collective-permute of the new block, as
# XLA (reshard.py's ExchangePieces, taken for a value's sole reader; round 10, was gathered and
# sliced: 80, 256, 128, 192 and 256 B).
def test_vector_matrix_contracting_axes_disagree():  # DotPartialContracting, v on a, m on b
  """v f32[16] P('a') @ m f32[16,8] P('b','a'): v's blocks over 'a' hold the blocks over 'b'
  the dot needs; XLA permutes a 'b' block (16 B) and all-reduces over 'b' (16 B), 32 B."""
  plan = no_more_than_xla(lambda v, m: v @ m, (randn(16), randn(16, 8, seed=1)),
                          (P("a"), P("b", "a")), "a2b4")
  assert plan.total_bytes == 32, plan.explain()


def test_reshard_to_finer_blocks_on_other_axes():  # ReshardTiledTo, P('a') -> P('b')
  """f32[16,4] P('a') -> P('b') on a 2x4 mesh: one collective-permute of the [4,4] block, 64 B."""
  plan = no_more_than_xla(lambda x: x * 2, (randn(16, 4),), P("a"), "a2b4", P("b"))
  assert plan.total_bytes == 64, plan.explain()


def test_reshard_to_finer_blocks_two_axes_3d_int32():  # ReshardTiledTo, P('b') -> P(('c','a'))
  no_more_than_xla(lambda x: x + 1, (ints(8, 4),), P("b", None), "a2b2c2", P(("c", "a"), None))


def test_reshard_two_dims_to_finer_blocks_3d():  # ReshardTiledTo, P('c','a') -> P(('a','b'),'c')
  """f32[8,8] on a 2x2x2 mesh: every new block lies inside an old one, one collective-permute of
  the [2,4] block, 32 B as XLA (spmd: two all-to-alls and a permute)."""
  plan = no_more_than_xla(lambda x: x * 2, (randn(8, 8),), P("c", "a"), "a2b2c2",
                          P(("a", "b"), "c"))
  assert plan.total_bytes == 32, plan.explain()


def test_reshard_finer_blocks_and_a_replicated_dim_split():  # ReshardTiledTo, P('a') -> P('b','a')
  """f32[16,8] P('a', None) -> P('b', 'a') on a 2x4 mesh: one collective-permute of the [4,4]
  block, 64 B as XLA."""
  plan = no_more_than_xla(lambda x: x * 2, (randn(16, 8),), P("a", None), "a2b4", P("b", "a"))
  assert plan.total_bytes == 64, plan.explain()


def test_reduce_window_base_dilated_dim_exchanged_last_3d():  # ReduceWindow base dilation, 2x2x2
  """max pool of f32[2,8,8] P('c','a','b'), base dilation 2 on dim 1 (over 'a'), a 3-wide window
  on dim 2 (over 'b'): dim 2's halo columns are sent before dim 1's block is dilated, 16 B, XLA
  32 B (was 72 B: columns of the dilated 9-row span; then 32 B, a permute from each side where
  over 2 shards each sends one column and receives one: one permute, both ways)."""
  f = lambda x: lax.reduce_window(x, -jnp.inf, lax.max, (1, 3, 3), (1, 2, 1),
                                  [(0, 0), (1, 1), (1, 1)], base_dilation=(1, 2, 1))
  plan = no_more_than_xla(f, (randn(2, 8, 8),), P("c", "a", "b"), "a2b2c2")
  assert plan.total_bytes == 16, plan.explain()


def test_reshape_merge_uneven_major_dim():  # ReshapeMergeDimsWithHaloExchange, uneven
  """f32[6,4] P(('a','b')) (uneven, 2 rows per shard) reshaped to [24], output open: the merged
  dim takes 'a', which splits the 6 rows evenly; the rows are realigned to it by a permute and a
  gather over 'b', 80 B, where XLA moves 96 B (was 128 B: the merged dim gathered whole)."""
  plan = no_more_than_xla(lambda x: x.reshape(24), (randn(6, 4),), P(("a", "b")), A2B2)
  assert plan.total_bytes == 80, plan.explain()


def test_reshard_to_coarser_blocks_on_other_axes():  # ReshardTiledTo, P('b') -> P('a')
  """Each new [8,4] block is two old [4,4] ones: two collective-permutes of the old block
  (reshard.py's ExchangePieces), 128 B, where XLA permutes and gathers pairs, 192 B (was 256 B:
  'b' gathered whole and sliced)."""
  plan = no_more_than_xla(lambda x: x * 2, (randn(16, 4),), P("b"), "a2b4", P("a"))
  assert plan.total_bytes == 128, plan.explain()


# --- Known gaps --------------------------------------------------------------------------------

@pytest.mark.xfail(strict=True, reason=(
    "prod of f32[4,8] P('c',('a','b')) along dim 1 on 2x2x2: spmd all-gathers the per-shard "
    "products, 32 B; XLA all-reduces them with a multiply, 8 B (JAX has no product all-reduce)"))
def test_reduce_prod_over_two_axes_3d():  # TiledToTiledReduce, multiply over ('a','b')
  no_more_than_xla(lambda x: jnp.prod(x, axis=1), (randn(4, 8) * 0.1 + 1,),
                   P("c", ("a", "b")), "a2b2c2")
