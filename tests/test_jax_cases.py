"""JAX's and XLA's sharding cases, written as a user of ``spmd.partition`` writes them: each case
is a jnp / lax function with PartitionSpecs, run through tests/helpers.py's one check (values
equal to the unpartitioned function's, plan == compiled HLO, no replicated fallback unless the
case names it). The themes follow XLA's spmd_partitioner_test.cc and JAX's pjit / shard_map tests:
dots and einsums with batch and contracting dims on different mesh axes and partial replication;
windows, gathers and scatters with passthrough or index dims sharded; sorts, cumulative ops and
scans along and across sharded dims; reshapes that split or merge sharded dims; uneven sizes, 0-d
and one-element dims, mesh axes of size 1, a 3-D mesh; bf16, f16, int8, bool and complex dtypes;
control flow, custom derivatives, remat, vmap / jvp / hessian inside; linear algebra and FFTs."""
from __future__ import annotations

from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax import lax
from jax.experimental.custom_partitioning import custom_partitioning
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from helpers import assert_partitioned_matches as check
from helpers import Cases, get_mesh, randn

NHWC = ("NHWC", "HWIO", "NHWC")
NWC = ("NWC", "WIO", "NWC")
CASES = Cases()

case = CASES.register


@case
def cumsum_sharded():
  check(lambda x: jnp.cumsum(x, axis=0), (randn(16, 8),), P("x", None), "x8")


@case
def cummax_rev():
  check(lambda x: lax.cummax(x, axis=1, reverse=True), (randn(4, 16),), P(None, "x"), "x4")


@case
def argsort_sharded():
  check(lambda x: jnp.argsort(x, axis=0), (randn(16, 8),), P("a", None), "a2b4")


@case
def sort_other_dim():
  check(lambda x: jnp.sort(x, axis=1), (randn(16, 8),), P("a", "b"), "a2b4")


@case
def argmax_sharded():
  check(lambda x: jnp.argmax(x, axis=0), (randn(16, 8),), P("x", None), "x8")


@case
def argmin_both():
  check(lambda x: jnp.argmin(x, axis=1), (randn(16, 8),), P("a", "b"), "a2b4")


@case
def einsum_batch_contract_diff_axes():
  check(lambda x, y: jnp.einsum("bij,bjk->bik", x, y), (randn(4, 8, 16), randn(4, 16, 8)),
        (P("a", None, "b"), P(None, "b", None)), "a2b4")


@case
def einsum_outer():
  check(lambda x, y: jnp.einsum("i,j->ij", x, y), (randn(16), randn(8)), (P("a"), P("b")), "a2b4")


@case
def dot_both_contract_sharded_differently():
  check(lambda x, y: x @ y, (randn(8, 16), randn(16, 8)), (P(None, "a"), P("b", None)), "a2b4")


@case
def complex_mul():
  check(lambda x, y: x * y + jnp.conj(x),
        (randn(8, 8) + 1j * randn(8, 8, seed=1), randn(8, 8, seed=2).astype(np.complex64)),
        (P("x"), P(None, "x")), "x8")


@case
def bf16_matmul():
  check(lambda x, y: x @ y, (randn(16, 32, dtype=jnp.bfloat16), randn(32, 8, dtype=jnp.bfloat16)),
        (P("x", None), P()), "x8")


@case
def int8_sum():
  check(lambda x: x.astype(jnp.int32).sum(0), (np.arange(64, dtype=np.int8).reshape(16, 4),),
        P("x"), "x8")


@case
def bool_any():
  check(lambda x: jnp.any(x > 0, axis=0), (randn(16, 4),), P("x"), "x8")


@case
def zero_d():
  check(lambda x, s: x * s, (randn(8, 4), np.float32(3.0)), (P("x"), P()), "x8")


@case
def one_element_dim():
  check(lambda x: x.sum(1), (randn(8, 1),), P("x", None), "x8")


@case
def uneven_reduce():
  check(lambda x: x.sum(0), (randn(10, 3),), P("x", None), "x4")


@case
def uneven_two_axes():
  check(lambda x: jnp.tanh(x) @ x.T, (randn(6, 10),), P("a", "b"), "a2b4")


@case
def reshape_merge_sharded():
  check(lambda x: x.reshape(32, 4), (randn(8, 4, 4),), P("x", None, None), "x8")


@case
def reshape_split_sharded():
  check(lambda x: x.reshape(4, 8, 4), (randn(32, 4),), P("x", None), "x8")


@case
def reshape_merge_two_sharded():
  check(lambda x: x.reshape(32), (randn(4, 8),), P("a", "b"), "a2b4")


@case
def transpose_3d():
  check(lambda x: jnp.transpose(x, (2, 0, 1)) * 2, (randn(4, 8, 6),), P("a", "b", None), "a2b4")


@case
def rev_sharded():
  check(lambda x: jnp.flip(x, 0), (randn(10, 4),), P("x"), "x4")


@case
def dynamic_slice_sharded():
  check(lambda x, i: lax.dynamic_slice_in_dim(x, i, 4, 0), (randn(16, 4), np.int32(3)),
        (P("x"), P()), "x8")


@case
def dynamic_update():
  check(lambda x, u, i: lax.dynamic_update_slice_in_dim(x, u, i, 0),
        (randn(16, 4), randn(4, 4), np.int32(5)), (P("x"), P(), P()), "x4")


@case
def concat_uneven():
  check(lambda x, y: jnp.concatenate([x, y], 0), (randn(6, 4), randn(5, 4)), (P("x"), P("x")), "x4")


@case
def pad_negative():
  check(lambda x: lax.pad(x, 0.0, [(-1, 2, 1), (0, 0, 0)]), (randn(16, 4),), P("x"), "x4")


@case
def select_and_scatter():
  def f(x):
    pool = lambda x: lax.reduce_window(x, -jnp.inf, lax.max, (1, 3, 3, 1), (1, 2, 2, 1), "SAME")
    return jax.grad(lambda x: pool(x).sum())(x)
  check(f, (randn(2, 16, 16, 3),), P(None, "x", None, None), "x4")


@case
def while_sharded():
  def f(x):
    step = lambda c: (c[0] + 1, c[1] * 1.1 + jnp.roll(c[1], 1, 0))
    return lax.while_loop(lambda c: c[0] < 5, step, (0, x))[1]
  check(f, (randn(16, 4),), P("x"), "x8")


@case
def fori_sharded():
  check(lambda x: lax.fori_loop(0, 3, lambda i, x: x @ x.T @ x / 10, x), (randn(8, 8),), P("x"),
        "x8")


@case
def custom_jvp():
  @jax.custom_jvp
  def f(x): return jnp.sin(x)
  f.defjvp(lambda p, t: (jnp.sin(p[0]), jnp.cos(p[0]) * t[0]))
  check(lambda x: jax.grad(lambda x: f(x).sum())(x), (randn(16, 4),), P("x"), "x8")


@case
def custom_vjp():
  @jax.custom_vjp
  def f(x): return x * 2
  f.defvjp(lambda x: (x * 2, x), lambda r, g: (g * r,))
  check(lambda x: jax.grad(lambda x: f(x).sum())(x), (randn(16, 4),), P("x"), "x8")


@case
def custom_partitioning_call():
  """A jax.experimental.custom_partitioning function (written for XLA's partitioner: a Shardy
  sharding rule and a partition callback) is partitioned by its body: a row softmax over a
  batch split 8 ways moves nothing, as the callback would."""
  @custom_partitioning
  def softmax(x):
    return jax.nn.softmax(x, axis=-1)

  def partition(mesh, arg_shapes, result_shape):
    rows = NamedSharding(mesh, P(arg_shapes[0].sharding.spec[0], None))
    return mesh, lambda x: jax.nn.softmax(x, axis=-1), rows, (rows,)

  softmax.def_partition(partition=partition, sharding_rule="i j -> i j")
  plan = check(lambda x: softmax(x) * 2, (randn(16, 12),), P("x"), "x8")
  assert not plan.collectives, plan.explain()


@case
def vmap_inside():
  check(lambda x, w: jax.vmap(lambda r: w @ r)(x), (randn(16, 8), randn(4, 8)), (P("x"), P()), "x8")


@case
def nested_jit():
  check(lambda x: jax.jit(lambda y: y * 2 + 1)(x).sum(0), (randn(16, 4),), P("x"), "x8")


@case
def checkpoint_inside():
  check(lambda x: jax.grad(lambda x: jax.checkpoint(lambda y: jnp.sin(y) ** 2)(x).sum())(x),
        (randn(16, 4),), P("x"), "x8")


@case
def random_in_fn():
  check(lambda k, x: x + jax.random.normal(k, x.shape), (jax.random.key(0), randn(16, 4)),
        (P(), P("x")), "x8")


@case
def take_neg_index():
  check(lambda x, i: jnp.take(x, i, axis=0), (randn(16, 4), np.array([-1, 3, 0, 15], np.int32)),
        (P("x"), P()), "x8")


@case
def where_scalars():
  check(lambda x: jnp.where(x > 0, 1.0, -1.0), (randn(16, 4),), P("x"), "x8")


@case
def linalg_batched():
  check(lambda x: jnp.linalg.inv(x @ jnp.swapaxes(x, -1, -2) + 4 * jnp.eye(4)), (randn(8, 4, 4),),
        P("x"), "x8")


@case
def fft_batched():
  check(lambda x: jnp.fft.fft(x, axis=1), (randn(8, 16),), P("x"), "x8")


@case
def fft_sharded_axis():
  check(lambda x: jnp.fft.fft(x, axis=0), (randn(16, 8),), P("x"), "x8")


@case
def bitcast():
  check(lambda x: lax.bitcast_convert_type(x, jnp.int32) >> 3, (randn(16, 4),), P("x"), "x8")


@case
def bitcast_shape():
  check(lambda x: lax.bitcast_convert_type(x, jnp.uint8), (randn(16, 4),), P("x"), "x8")


@case
def iota_cmp():
  check(lambda x: jnp.where(jnp.arange(16)[:, None] < 5, x, 0.), (randn(16, 4),), P("x"), "x8")


@case
def mesh_size1():
  check(lambda x: x @ x.T, (randn(8, 8),), P("x", None), {"x": 8, "y": 1})


@case
def mesh_size1_spec():
  check(lambda x: x @ x.T, (randn(8, 8),), P("y", "x"), {"x": 8, "y": 1})


@case
def three_d_mesh_reduce():
  check(lambda x: x.sum((0, 1)), (randn(4, 4, 8),), P("a", "b", "c"), "a2b2c2")


@case
def partial_replication():
  check(lambda x, y: x @ y, (randn(8, 16), randn(16, 8)), (P("a", None), P(None, ("b", "c"))),
        "a2b2c2")


@case
def multi_axis_dim():
  check(lambda x: jnp.exp(x).sum(0), (randn(16, 4),), P(("a", "b")), "a2b4")


@case
def top_k_sharded():
  check(lambda x: lax.top_k(x, 3), (randn(8, 16),), P(None, "x"), "x8")


@case
def scatter_add_sharded():
  check(lambda x, i, u: x.at[i].add(u),
        (randn(16, 4), np.array([1, 5, 5, 14], np.int32), randn(4, 4)), (P("x"), P(), P()), "x8")


@case
def segment_sum():
  check(lambda x, s: jax.ops.segment_sum(x, s, num_segments=4),
        (randn(16, 4), np.arange(16, dtype=np.int32) % 4), (P("x"), P("x")), "x8")


@case
def conv_dilated():
  def f(x, k):
    return lax.conv_general_dilated(x, k, (1, 1), "SAME", rhs_dilation=(2, 2),
                                    dimension_numbers=NHWC)
  check(f, (randn(2, 16, 16, 3), randn(3, 3, 3, 4)), (P(None, "x"), P()), "x4")


@case
def conv1d_strided():
  f = lambda x, k: lax.conv_general_dilated(x, k, (2,), [(1, 1)], dimension_numbers=NWC)
  check(f, (randn(2, 30, 3), randn(4, 3, 4)), (P(None, "x"), P()), "x4")


@case
def avg_pool_uneven():
  check(lambda x: lax.reduce_window(x, 0., lax.add, (1, 3, 1), (1, 2, 1), "VALID"),
        (randn(2, 23, 3),), P(None, "x"), "x4")


@case
def logsumexp():
  check(lambda x: jax.nn.logsumexp(x, axis=1), (randn(8, 16),), P("a", "b"), "a2b4")


@case
def softmax_grad():
  check(lambda x: jax.grad(lambda x: jax.nn.softmax(x, axis=-1)[:, 0].sum())(x), (randn(8, 16),),
        P("a", "b"), "a2b4")


@case
def expand_squeeze_chain():
  check(lambda x: jnp.squeeze(x[:, None, :, None], (1, 3)) + 1, (randn(8, 8),), P("x"), "x8")


@case
def broadcast_to_sharded():
  check(lambda x: jnp.broadcast_to(x, (16, 8)) * jnp.arange(16.)[:, None], (randn(1, 8),),
        P(None, "x"), "x8")


@case
def clip_and_round():
  check(lambda x: jnp.round(jnp.clip(x, -0.5, 0.5), 1), (randn(16, 4),), P("x"), "x8")


@case
def f16_ops():
  check(lambda x: (x * x).sum(0), (randn(16, 4, dtype=np.float16),), P("x"), "x8", rtol=1e-2,
        atol=1e-2)


@case
def int_div_rem():
  check(lambda x: (x // 3, x % 3), (np.arange(-32, 32, dtype=np.int32).reshape(16, 4),), P("x"),
        "x8")


@case
def nonzero_size():
  check(lambda x: jnp.nonzero(x > 0, size=8, fill_value=-1)[0], (randn(16),), P("x"), "x8")


@case
def unique_size():
  check(lambda x: jnp.unique(x, size=4, fill_value=0),
        (np.array([3, 1, 1, 2, 3, 3, 0, 1], np.int32),), P("x"), "x8")


@case
def searchsorted():
  check(lambda a, v: jnp.searchsorted(a, v), (np.arange(16, dtype=np.float32), randn(8)),
        (P(), P("x")), "x8")


@case
def histogram_like():
  check(lambda x: jnp.bincount(x, length=8), (np.arange(32, dtype=np.int32) % 8,), P("x"), "x8")


@case
def cond_sharded():
  check(lambda p, x: lax.cond(p, lambda x: x @ x.T, lambda x: -x @ x.T, x),
        (np.bool_(True), randn(8, 4)), (P(), P("x")), "x8")


@case
def switch_idx():
  check(lambda i, x: lax.switch(i, [lambda x: x * 2, lambda x: x - 1, jnp.sin], x),
        (np.int32(2), randn(8, 4)), (P(), P("x")), "x8")


@case
def map_inside():
  check(lambda x: lax.map(lambda r: r.sum(), x), (randn(16, 4),), P("x"), "x8")


@case
def associative_scan():
  check(lambda x: lax.associative_scan(jnp.add, x, axis=0), (randn(16, 4),), P("x"), "x8")


@case
def reduce_precision():
  check(lambda x: lax.reduce_precision(x, 5, 10), (randn(16, 4),), P("x"), "x8")


@case
def erf_inv_etc():
  check(lambda x: jax.scipy.special.erf(x) + jax.scipy.special.gammaln(jnp.abs(x) + 1),
        (randn(16, 4),), P("x"), "x8")


@case
def outspec_uneven():
  check(lambda x: x * 2, (randn(10, 4),), P("x"), "x4", out_specs=P("x"))


@case
def outspec_different():
  check(lambda x: x * 2, (randn(8, 8),), P("x"), "x8", out_specs=P(None, "x"))


@case
def ppermute_like_roll2d():
  check(lambda x: jnp.roll(x, (3, -2), (0, 1)), (randn(16, 8),), P("a", "b"), "a2b4")


@case
def gather_2d_index():
  check(lambda x, i, j: x[i, j],
        (randn(16, 8), np.array([0, 3, 15], np.int32), np.array([1, 7, 2], np.int32)),
        (P("a", "b"), P(), P()), "a2b4")


@case
def scatter_2d():
  check(lambda x, i, j, u: x.at[i, j].set(u),
        (randn(16, 8), np.array([0, 3, 15], np.int32), np.array([1, 7, 2], np.int32), randn(3)),
        (P("a", "b"), P(), P(), P()), "a2b4")


@case
def mask_fill_uneven():
  check(lambda x: jnp.where(jnp.isnan(x), 0, x).max(0), (randn(13, 5),), P("x", None), "x4")


@case
def einsum_three():
  check(lambda a, b, c: jnp.einsum("ij,jk,kl->il", a, b, c),
        (randn(8, 16), randn(16, 8), randn(8, 4)), (P("a", "b"), P("b", None), P()), "a2b4")


@case
def cholesky_batched():
  check(lambda x: jnp.linalg.cholesky(x @ jnp.swapaxes(x, -1, -2) + 4 * jnp.eye(4)),
        (randn(8, 4, 4),), P("x"), "x8")


@case
def qr_svd():
  check(lambda x: jnp.linalg.svd(x, compute_uv=False), (randn(8, 4, 3),), P("x"), "x8", rtol=1e-4,
        atol=1e-4)


@case
def eigh():
  check(lambda x: jnp.linalg.eigh(x + jnp.swapaxes(x, -1, -2))[0], (randn(8, 4, 4),), P("x"), "x8",
        rtol=1e-4, atol=1e-4)


@case
def matmul_int():
  check(lambda x, y: x @ y,
        (np.arange(64, dtype=np.int32).reshape(8, 8), np.arange(64, dtype=np.int32).reshape(8, 8)),
        (P("x"), P(None, "x")), "x8")


@case
def polyval():
  check(lambda c, x: jnp.polyval(c, x), (randn(4), randn(16)), (P(), P("x")), "x8")


@case
def interp():
  check(lambda x: jnp.interp(x, jnp.linspace(-3, 3, 7), jnp.arange(7.)), (randn(16),), P("x"), "x8")


@case
def tril_mask():
  check(lambda x: jnp.tril(x) @ x, (randn(16, 16),), P("a", "b"), "a2b4")


@case
def diag():
  check(lambda x: jnp.diagonal(x) + jnp.trace(x), (randn(16, 16),), P("a", "b"), "a2b4")


@case
def kron_outer():
  check(lambda x, y: jnp.kron(x, y), (randn(4, 4), randn(2, 2)), (P("x"), P()), "x4")


@case
def meshgrid():
  check(lambda x, y: sum(jnp.meshgrid(x, y)), (randn(8), randn(16)), (P("x"), P("x")), "x8")


@case
def cross_entropy_int_labels():
  check(lambda l, y: optax.softmax_cross_entropy_with_integer_labels(l, y).mean(),
        (randn(16, 10), np.arange(16, dtype=np.int32) % 10), (P("x"), P("x")), "x8")


@case
def layernorm_grad_uneven():
  def f(x, g):
    def loss(g):
      m = x.mean(-1, keepdims=True); v = ((x - m) ** 2).mean(-1, keepdims=True)
      return (((x - m) / jnp.sqrt(v + 1e-5)) * g).sum()
    return jax.grad(loss)(g)
  check(f, (randn(10, 6), randn(6)), (P("a", "b"), P("b")), "a2b4", atol_per_magnitude=True)


@case
def empty_slice_top():
  check(lambda x: x[3:3].sum(0) + x[1::2][:0].sum(0), (randn(16, 4),), P("x"), "x8")


@case
def empty_in_scan():
  def f(x):
    def body(c, r):
      return c + r[2:2].sum() + r.sum(), r[1::2][:0]
    return lax.scan(body, 0., x)
  check(f, (randn(4, 16),), P(None, "x"), "x8")


@case
def empty_input():
  check(lambda x, y: (x * 2, y.sum(0)), (randn(0, 4), randn(8, 4)), (P(None, "x"), P("x")), "x4")


@case
def empty_slice_used():
  check(lambda x: x.sum(0) + x[3:3].sum(0) + x[1::2][:0].sum(0), (randn(16, 4),), P("x"), "x8")


@case
def const_out():
  check(lambda x: jnp.arange(4.) * 2 + jnp.zeros((0, 4)).sum(0), (randn(16, 4),), P("x"), "x8")


@case
def solve_grad():
  def f(a, b):
    return jax.grad(lambda a: jnp.linalg.solve(a + 4 * jnp.eye(4), b).sum())(a)
  check(f, (randn(8, 4, 4), randn(8, 4, 1)), (P("x"), P("x")), "x8", rtol=1e-4, atol=1e-4)


@case
def platform_dependent_user():
  check(lambda x: lax.platform_dependent(x, cpu=jnp.sin, default=jnp.cos), (randn(16, 4),), P("x"),
        "x8")


@case
def diagonal_offset():
  check(lambda x: jnp.diagonal(x, 1, 1, 2).sum(), (randn(4, 8, 8),), P(None, "a", "b"), "a2b4",
        atol_per_magnitude=True)


@case
def einsum_trace():
  check(lambda x: jnp.einsum("bii->b", x), (randn(8, 4, 4),), P("x"), "x8")


@case
def det_slogdet():
  check(lambda x: jnp.linalg.slogdet(x + 4 * jnp.eye(4))[1], (randn(8, 4, 4),), P("x"), "x8",
        rtol=1e-4, atol=1e-4)


@case
def pinv_lstsq():
  check(lambda x: jnp.linalg.pinv(x), (randn(8, 4, 3),), P("x"), "x8", rtol=1e-3, atol=1e-3)


@case
def expm():
  check(lambda x: jax.scipy.linalg.expm(x * 0.1), (randn(8, 4, 4),), P("x"), "x8", rtol=1e-4,
        atol=1e-4)


@case
def cumsum_rev_uneven():
  check(lambda x: jnp.cumsum(x[::-1], 0), (randn(10, 3),), P("x"), "x4")


@case
def scan_uneven_carry():
  check(lambda x: lax.scan(lambda c, r: (c * 0.5 + r, c.sum()), jnp.zeros(10), x)[0],
        (randn(5, 10),), P(None, "x"), "x4")


@case
def vmap_grad_per_example():
  def f(w, x):
    return jax.vmap(jax.grad(lambda w, x: jnp.tanh(x @ w).sum()), (None, 0))(w, x)
  check(f, (randn(4, 4), randn(16, 4)), (P(), P("x")), "x8")


@case
def conv_grad_wrt_kernel_uneven():
  def f(x, k):
    conv = lambda k: lax.conv_general_dilated(x, k, (1, 1), "SAME", dimension_numbers=NHWC)
    return jax.grad(lambda k: conv(k).sum())(k)
  check(f, (randn(2, 15, 9, 3), randn(3, 3, 3, 4)), (P(None, "x"), P()), "x4",
        atol_per_magnitude=True)


@case
def max_pool_2d_both():
  check(lambda x: lax.reduce_window(x, -jnp.inf, lax.max, (1, 2, 2, 1), (1, 2, 2, 1), "VALID"),
        (randn(2, 16, 16, 3),), P(None, "a", "b"), "a2b4")


@case
def argmax_uneven_bf16():
  check(lambda x: jnp.argmax(x, axis=0), (randn(13, 4, dtype=jnp.bfloat16),), P("x"), "x4")


@case
def top_k_uneven():
  check(lambda x: lax.top_k(x, 2)[0], (randn(6, 10),), P(None, "x"), "x4")


@case
def sort_multi_operand():
  check(lambda k, v: lax.sort((k, v), dimension=0, num_keys=1),
        (randn(16, 4), randn(16, 4, seed=1)), (P("x"), P("x")), "x8")


@case
def gather_clip_mode():
  check(lambda x, i: jnp.take(x, i, axis=1, mode="clip"),
        (randn(8, 16), np.array([0, 20, -3, 15], np.int32)), (P("a", "b"), P()), "a2b4")


@case
def gather_fill_mode():
  check(lambda x, i: x.at[i].get(mode="fill", fill_value=-1.),
        (randn(16, 4), np.array([0, 20, -3, 15], np.int32)), (P("x"), P()), "x8")


@case
def scatter_mul_max():
  check(lambda x, i, u: x.at[i].max(u).at[i].multiply(2.),
        (randn(16, 4), np.array([1, 5, 5, 14], np.int32), randn(4, 4)), (P("x"), P(), P("x")), "x4")


@case
def one_hot_matmul():
  check(lambda i, w: jax.nn.one_hot(i, 16) @ w, (np.arange(8, dtype=np.int32), randn(16, 4)),
        (P("x"), P("x")), "x8")


@case
def expand_dims_then_sum_sharded():
  check(lambda x: (x[:, None, :] * x[None, :, :]).sum(-1), (randn(16, 4),), P("x"), "x8")


@case
def rng_bits_uneven():
  check(lambda k: jax.random.uniform(k, (10, 3)), (jax.random.key(1),), (P(),), "x4",
        out_specs=P("x"))


@case
def complex_fft2():
  check(lambda x: jnp.fft.ifft2(jnp.fft.fft2(x)).real, (randn(8, 8, 8),), P("x"), "x8")


@case
def rfft_irfft():
  check(lambda x: jnp.fft.irfft(jnp.fft.rfft(x, axis=1), n=16, axis=1), (randn(8, 16),), P("x"),
        "x8")


@case
def lax_reduce_and():
  check(lambda x: jnp.all(x > -3, axis=(0, 1)), (randn(8, 8, 2),), P("a", "b"), "a2b4")


@case
def population_count_shift():
  check(lambda x: lax.population_count(x) + lax.shift_left(x, jnp.uint32(2)),
        (np.arange(64, dtype=np.uint32).reshape(16, 4),), P("x"), "x8")


@case
def nextafter_atan2():
  check(lambda x, y: jnp.arctan2(x, y) + jnp.nextafter(x, y), (randn(16, 4), randn(16, 4, seed=1)),
        (P("x"), P(None, "x")), "x4")


@case
def cumlogsumexp():
  check(lambda x: lax.cumlogsumexp(x, axis=0), (randn(16, 4),), P("x"), "x8")


@case
def squeeze_sharded_one():
  check(lambda x: jnp.squeeze(x, 0) * 2, (randn(1, 16),), P(None, "x"), "x8")


@case
def transpose_uneven_2d():
  check(lambda x: x.T @ x, (randn(10, 6),), P("a", "b"), "a2b4")


@case
def while_dynamic_trip():
  def f(x, n):
    step = lambda c: (c[0] + 1, jnp.tanh(c[1] @ c[1].T) @ c[1])
    return lax.while_loop(lambda c: c[0] < n, step, (0, x))[1]
  check(f, (randn(8, 4), np.int32(3)), (P("x"), P()), "x8")


@case
def wsc_named():
  along = NamedSharding(get_mesh("x8"), P(None, "x"))
  check(lambda x: lax.with_sharding_constraint(x * 2, along) + 1, (randn(8, 8),), P("x"), "x8")


@case
def dpa():
  q = randn(2, 16, 4, 8)
  check(lambda q, k, v: jax.nn.dot_product_attention(q, k, v, is_causal=True),
        (q, randn(2, 16, 4, 8, seed=1), randn(2, 16, 4, 8, seed=2)),
        (P("a", None, "b"), P("a", None, "b"), P("a", None, "b")), "a2b4")


@case
def pad_reflect():
  check(lambda x: jnp.pad(x, ((2, 2), (0, 0)), mode="reflect"), (randn(16, 4),), P("x"), "x4")


@case
def pad_edge_uneven():
  check(lambda x: jnp.pad(x, ((1, 3), (0, 0)), mode="edge"), (randn(10, 4),), P("x"), "x4")


@case
def repeat_sharded():
  check(lambda x: jnp.repeat(x, 2, axis=0), (randn(8, 4),), P("x"), "x8")


@case
def cumprod():
  check(lambda x: jnp.cumprod(1 + 0.01 * x, axis=0), (randn(16, 4),), P("x"), "x8")


@case
def image_resize():
  check(lambda x: jax.image.resize(x, (2, 32, 32, 3), "bilinear"), (randn(2, 16, 16, 3),),
        P(None, "x"), "x4", rtol=1e-4, atol=1e-4)


@case
def preferred_type_dot():
  f = lambda x, y: lax.dot_general(x, y, (((1,), (0,)), ((), ())),
                                   preferred_element_type=jnp.float32)
  check(f, (randn(8, 16, dtype=jnp.bfloat16), randn(16, 8, dtype=jnp.bfloat16)),
        (P(None, "x"), P("x")), "x8", rtol=1e-2, atol=1e-2)


@case
def clip_global_norm():
  def f(g):
    return optax.clip_by_global_norm(1.0).update(g, optax.EmptyState())[0]
  check(f, ({"a": randn(16, 8), "b": randn(8)},), ({"a": P("a", "b"), "b": P("b")},), "a2b4")


@case
def gelu_exact():
  check(lambda x: jax.nn.gelu(x, approximate=False), (randn(16, 4),), P("x"), "x8")


@case
def roll_dynamic_shift():
  check(lambda x, s: jnp.roll(x, s, 0), (randn(16, 4), np.int32(3)), (P("x"), P()), "x8")


@case
def flip_uneven_2d():
  check(lambda x: jnp.flip(x, (0, 1)), (randn(10, 6),), P("a", "b"), "a2b4")


@case
def moveaxis_reshape():
  check(lambda x: jnp.moveaxis(x, 0, -1).reshape(4, -1), (randn(8, 4, 2),), P("x"), "x8")


@case
def argsort_desc_uneven():
  check(lambda x: jnp.argsort(-x, axis=1), (randn(4, 10),), P(None, "x"), "x4")


@case
def median_quantile():
  check(lambda x: jnp.median(x, axis=0), (randn(16, 4),), P("x"), "x8")


@case
def var_std():
  check(lambda x: (jnp.var(x, 0), jnp.std(x, 1)), (randn(16, 8),), P("a", "b"), "a2b4")


@case
def triu_indices_gather():
  check(lambda x: x[jnp.triu_indices(8)], (randn(8, 8),), P("x"), "x8")


@case
def boolean_mask_where_sum():
  check(lambda x: jnp.sum(x, where=x > 0, axis=0), (randn(16, 4),), P("x"), "x8")


@case
def stack_split():
  check(lambda x: jnp.stack(jnp.split(x, 4, axis=0), axis=1), (randn(16, 4),), P("x"), "x8")


@case
def tensordot():
  check(lambda x, y: jnp.tensordot(x, y, axes=([1, 2], [0, 1])), (randn(8, 4, 6), randn(4, 6, 3)),
        (P("a", "b"), P("b")), "a2b4")


@case
def dot_batch_diff_axes():
  check(lambda x, y: jnp.einsum("bmk,bkn->bmn", x, y), (randn(4, 8, 16), randn(4, 16, 8)),
        (P("a", "b", None), P("b", None, "a")), "a2b4")


@case
def dot_lhs_rhs_same_axis_nonc():
  check(lambda x, y: x @ y, (randn(16, 8), randn(8, 16)), (P("x", None), P(None, "x")), "x8")


@case
def dot_contract_multi_axis():
  check(lambda x, y: x @ y, (randn(8, 16), randn(16, 8)),
        (P(None, ("a", "b")), P(("a", "b"), None)), "a2b4")


@case
def dot_contract_partial_mismatch():
  check(lambda x, y: x @ y, (randn(8, 16), randn(16, 8)), (P(None, ("a", "b")), P("b", None)),
        "a2b4")


@case
def conv_feature_group_sharded():
  def f(x, k):
    return lax.conv_general_dilated(x, k, (1, 1), "SAME", feature_group_count=8,
                                    dimension_numbers=NHWC)
  check(f, (randn(2, 8, 8, 8), randn(3, 3, 1, 8)),
        (P(None, None, None, "x"), P(None, None, None, "x")), "x8")


@case
def conv_base_dilation():
  def f(x, k):
    return lax.conv_general_dilated(x, k, (1,), [(2, 2)], lhs_dilation=(2,),
                                    dimension_numbers=NWC)
  check(f, (randn(2, 16, 3), randn(3, 3, 4)), (P(None, "x"), P()), "x4")


@case
def conv_out_feature_sharded():
  f = lambda x, k: lax.conv_general_dilated(x, k, (1, 1), "SAME", dimension_numbers=NHWC)
  check(f, (randn(2, 8, 8, 4), randn(3, 3, 4, 8)), (P("a"), P(None, None, None, "b")), "a2b4")


@case
def reduce_window_base_dilated():
  check(lambda x: lax.reduce_window(x, 0., lax.add, (3,), (1,), [(1, 1)], base_dilation=(2,)),
        (randn(16),), P("x"), "x4")


@case
def gather_passthrough_sharded():
  check(lambda x, i: x[:, i], (randn(16, 8), np.array([0, 7, 3], np.int32)), (P("x", None), P()),
        "x8")


@case
def gather_index_sharded():
  check(lambda x, i: x[i], (randn(16, 8), np.arange(16, dtype=np.int32)[::-1].copy()),
        (P(), P("x")), "x8")


@case
def gather_both_sharded():
  check(lambda x, i: x[i], (randn(16, 8), np.arange(16, dtype=np.int32)[::-1].copy()),
        (P("a", "b"), P("a")), "a2b4")


@case
def scatter_update_window_sharded():
  check(lambda x, i, u: x.at[i].add(u), (randn(16, 8), np.array([1, 5, 5], np.int32), randn(3, 8)),
        (P(None, "x"), P(), P(None, "x")), "x8")


@case
def scatter_indices_sharded():
  check(lambda x, i, u: x.at[i].add(u),
        (randn(16, 8), np.arange(8, dtype=np.int32) * 2, randn(8, 8)), (P(), P("x"), P("x")), "x8")


@case
def sort_large_sharded():
  check(lambda x: jnp.sort(x, axis=0), (randn(64, 3),), P("x"), "x8")


@case
def pad_interior_sharded():
  check(lambda x: lax.pad(x, 0., [(1, 2, 1), (0, 0, 0)]), (randn(16, 4),), P("x"), "x8")


@case
def concat_sharded_dim():
  check(lambda x, y: jnp.concatenate([x, y], 0), (randn(16, 4), randn(8, 4)), (P("x"), P("x")),
        "x8")


@case
def dus_sharded_update_sharded():
  check(lambda x, u: lax.dynamic_update_slice(x, u, (4, 0)), (randn(16, 8), randn(8, 8)),
        (P("x"), P("x")), "x4")


@case
def iota_2d_sharded():
  iota = lambda d: lax.broadcasted_iota(jnp.float32, (16, 8), d)
  check(lambda x: x + iota(1) * iota(0), (randn(16, 8),), P("a", "b"), "a2b4")


@case
def reverse_uneven_multi():
  check(lambda x: lax.rev(x, (0,)), (randn(13, 4),), P(("a", "b")), "a2b4")


@case
def transpose_multi_axis_dim():
  check(lambda x: x.T + 1, (randn(16, 8),), P(("a", "b"), None), "a2b4",
        out_specs=P(None, ("a", "b")))


@case
def reshape_multi_axis_merge():
  check(lambda x: x.reshape(8, 2, 4).sum(1), (randn(8, 8),), P(("a", "b")), "a2b4")


@case
def reshape_split_major_minor():
  check(lambda x: x.reshape(4, 4, 8), (randn(16, 8),), P(("a", "b")), "a2b4")


@case
def reduce_multi_dims_multi_axes():
  check(lambda x: x.max((0, 2)), (randn(4, 6, 8),), P("a", None, "b"), "a2b4")


@case
def select_partial_sums():
  check(lambda x, y, p: jnp.where(p, x @ y, 0.),
        (randn(8, 16), randn(16, 8), np.ones((8, 8), bool)), (P(None, "x"), P("x"), P()), "x8")


@case
def elementwise_partial_replication():
  check(lambda x, y: x * y, (randn(8, 8), randn(8, 8)), (P("a", None), P(None, "c")), "a2b2c2")


@case
def broadcast_sharded_new_dim():
  check(lambda x: jnp.broadcast_to(x[None], (8, 16, 4)) * jnp.arange(8.)[:, None, None],
        (randn(16, 4),), P("x"), "x8", out_specs=P("x"))


@case
def cholesky_uneven_batch():
  check(lambda x: jnp.linalg.cholesky(x @ jnp.swapaxes(x, -1, -2) + 4 * jnp.eye(3)),
        (randn(5, 3, 3),), P("x"), "x4")


@case
def bitcast_convert_wider():
  check(lambda x: lax.bitcast_convert_type(x, jnp.float32),
        (np.arange(64, dtype=np.uint8).reshape(16, 1, 4),), P("x"), "x8")


@case
def complex_dot():
  complex_randn = lambda *shape: (randn(*shape) + 1j * randn(*shape, seed=3)).astype(np.complex64)
  check(lambda x, y: x @ y, (complex_randn(8, 16), complex_randn(16, 4)), (P(None, "x"), P("x")),
        "x8")


@case
def f64_disabled_int64():
  check(lambda x: x.astype(jnp.int16) * 3, (np.arange(64, dtype=np.int32).reshape(16, 4),), P("x"),
        "x8")


@case
def reduce_precision_bf16_sum():
  check(lambda x: x.sum(0), (randn(16, 8, dtype=jnp.bfloat16),), P("x"), "x8")


@case
def argmax_multi_axis():
  check(lambda x: jnp.argmax(x.reshape(-1)), (randn(8, 8),), P("a", "b"), "a2b4")


@case
def cumsum_2axes():
  check(lambda x: jnp.cumsum(x, 0), (randn(16, 8),), P(("a", "b")), "a2b4")


@case
def while_with_sharded_cond():
  check(lambda x: lax.while_loop(lambda c: c.sum() < 100., lambda c: c * 2., x),
        (np.abs(randn(16, 4)) + 0.1,), P("x"), "x8")


@case
def cond_different_branch_shardings():
  along = NamedSharding(get_mesh("a2b4"), P(None, "b"))
  def f(p, x):
    return lax.cond(p, lambda x: lax.with_sharding_constraint(x, along) * 2, lambda x: x + 1, x)
  check(f, (np.bool_(False), randn(8, 8)), (P(), P("a")), "a2b4")


@case
def device_put_inside():
  check(lambda x: jax.device_put(x * 2, NamedSharding(get_mesh("a2b4"), P(None, "b"))) + 1,
        (randn(8, 8),), P("a"), "a2b4")


@case
def wsc_unconstrained():
  rows = NamedSharding(get_mesh("a2b4"), P("a", P.UNCONSTRAINED))
  check(lambda x: lax.with_sharding_constraint(x * 2, rows) + 1, (randn(8, 8),), P(None, "b"),
        "a2b4")


@case
def remat_policy():
  def f(x, w):
    g = jax.checkpoint(lambda x: jnp.tanh(x @ w) @ w.T,
                       policy=jax.checkpoint_policies.dots_saveable)
    return jax.grad(lambda x: g(x).sum())(x)
  check(f, (randn(8, 16), randn(16, 16)), (P("a"), P(None, "b")), "a2b4")


@case
def scan_unroll():
  check(lambda x: lax.scan(lambda c, r: (c + r, c * r), jnp.zeros(8), x, unroll=2), (randn(6, 8),),
        P(None, "b"), "a2b4")


@case
def fori_unrolled_static():
  check(lambda x: lax.fori_loop(0, 4, lambda i, c: c * 1.1 + i, x, unroll=True), (randn(8, 8),),
        P("a", "b"), "a2b4")


@case
def jvp_inside():
  check(lambda x, t: jax.jvp(lambda y: jnp.sin(y) @ y.T, (x,), (t,)),
        (randn(8, 8), randn(8, 8, seed=1)), (P("a"), P("a")), "a2b4")


@case
def hessian_small():
  check(lambda x: jax.hessian(lambda y: (jnp.tanh(y) ** 2).sum())(x), (randn(8),), P("b"), "a2b4")


@case
def linear_transpose():
  check(lambda x, w: jax.linear_transpose(lambda y: y @ w, x)(x @ w)[0], (randn(8, 8), randn(8, 4)),
        (P("a"), P()), "a2b4")


@case
def pure_callback_inside():
  def f(x):
    shape = jax.ShapeDtypeStruct(x.shape, x.dtype)
    doubled = jax.pure_callback(lambda a: np.asarray(a) * 2, shape, x)
    return doubled + 1
  check(f, (randn(8, 8),), P("a"), "a2b4", replicated=("pure_callback",))


@pytest.mark.parametrize("run", CASES, ids=[c.__name__ for c in CASES])
def test_case(run: Callable[[], None]) -> None:
  run()
