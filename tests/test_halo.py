"""Halo exchange: windowed ops along sharded dims (conv_general_dilated, reduce_window, pad,
slice and the stencils built from them) must match the unpartitioned program, and where the
result splits evenly they must communicate with neighbour exchanges (collective-permute) only.

Every case checks: partitioned == unpartitioned, no replicated-rule fallback, and that the plan's
bytes per collective kind are the compiled HLO's (the halos' collective-permutes among them).
Cases whose sharded output dims divide by their shard count additionally assert that the program
has no all-gather (and, where a window straddles shards, that it has collective-permutes).
"""
from __future__ import annotations

import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import spmd
from helpers import assert_partitioned_matches
from spmd.hlo import collectives

MESHES = {"x2": {"x": 2}, "x4": {"x": 4}, "x8": {"x": 8}, "ab": {"a": 2, "b": 4},
          "h4": {"h": 4}}
AB = ("a", "b")
NWC, NHWC, NCHW, NDHWC = (("NWC", "WIO", "NWC"), ("NHWC", "HWIO", "NHWC"),
                          ("NCHW", "OIHW", "NCHW"), ("NDHWC", "DHWIO", "NDHWC"))


@functools.lru_cache(maxsize=None)
def _mesh(name: str):
  return spmd.make_mesh(MESHES[name])


def data(*shape, seed=0, scale=1.0):
  return jnp.asarray(np.random.default_rng(seed).standard_normal(shape).astype(np.float32) *
                     scale)


def _shards(spec, mesh: str, dim: int) -> int:
  entry = tuple(spec)[dim] if dim < len(tuple(spec)) else None
  axes = () if entry is None else (entry,) if isinstance(entry, str) else tuple(entry)
  return int(np.prod([MESHES[mesh][a] for a in axes]))


def _divides(want, spec, mesh: str) -> bool:
  """Does every dim that ``spec`` shards (of the first input, laid out like the output) split
  the reference output evenly? Then no output gather is needed."""
  out = jax.tree.leaves(want)[0]
  return all(out.shape[d] % _shards(spec, mesh, d) == 0 for d in range(out.ndim))


def check(fn, args, in_specs, mesh, *, halo_only=None, permutes=True, tol=2e-5) -> spmd.Plan:
  """``assert_partitioned_matches`` (floats to ``tol`` of their magnitude); then the halo checks.

  ``halo_only``: assert the program has no all-gather and (if ``permutes``) has
  collective-permutes, all of them halos; by default it is asserted when the first input's
  sharded dims divide the output evenly. The plan's kinds are the compiled program's. Returns
  the plan.
  """
  plan = assert_partitioned_matches(fn, args, in_specs, _mesh(mesh), rtol=tol, atol=tol,
                                    atol_per_magnitude=True)
  first_spec = in_specs[0] if isinstance(in_specs, tuple) else in_specs
  if halo_only is None:
    halo_only = _divides(jax.eval_shape(fn, *args), first_spec, mesh)
  if halo_only:
    kinds = {c.kind for c in plan.collectives}
    assert "all-gather" not in kinds, plan.explain()
    if permutes:
      assert "collective-permute" in kinds, plan.explain()
      halos = [c for c in plan.collectives if c.kind == "collective-permute"]
      assert halos and all("halo" in c.tensor for c in halos), plan.explain()
  return plan


def conv(x, w, stride=1, padding="SAME", dn=NHWC, **kw):
  strides = (stride,) * (x.ndim - 2) if isinstance(stride, int) else stride
  return lax.conv_general_dilated(x, w, strides, padding, dimension_numbers=dn, **kw)


# --- conv: window, stride, padding ---------------------------------------------------------------

def _out_size(n, k, s, padding):
  if padding == "SAME":
    return -(-n // s)
  if padding == "VALID":
    return (n - k) // s + 1
  (lo, hi), = padding
  return (n + lo + hi - k) // s + 1


PADDINGS = {"SAME": "SAME", "VALID": "VALID", "asym-2-1": [(2, 1)], "asym-0-3": [(0, 3)],
            "asym-3-0": [(3, 0)]}


@pytest.mark.parametrize("padding", list(PADDINGS))
@pytest.mark.parametrize("stride", [1, 2])
@pytest.mark.parametrize("window", [1, 3, 5, 7])
def test_conv1d_window_stride_padding(window, stride, padding):
  """W = 32 on 8 shards of 4 (window 7 needs 3 rows a side: nearly a whole shard)."""
  x, w = data(1, 32, 2), data(window, 2, 3, seed=1)
  pad = PADDINGS[padding]
  plan = check(lambda x, w: conv(x, w, stride, pad, NWC), (x, w), (P(None, "x", None), P()),
               "x8", permutes=window > 1)
  if _out_size(32, window, stride, pad) % 8 == 0 and window > 1:
    assert {c.kind for c in plan.collectives} == {"collective-permute"}


@pytest.mark.parametrize("window,padding", [(3, [(2, 0)]), (5, [(3, 1)]), (7, [(1, 5)]),
                                            (4, [(2, 1)]), (2, [(1, 0)])])
def test_conv1d_asymmetric_padding_with_even_output_is_halo_only(window, padding):
  x, w = data(1, 32, 2), data(window, 2, 3, seed=1)
  plan = check(lambda x, w: conv(x, w, 1, padding, NWC), (x, w), (P(None, "x", None), P()),
               "x8", halo_only=True)
  assert {c.kind for c in plan.collectives} == {"collective-permute"}


def test_conv1d_explicit_padding_wider_than_the_window():
  x, w = data(1, 32, 2), data(3, 2, 3, seed=1)
  check(lambda x, w: conv(x, w, 1, [(4, 2)], NWC), (x, w), (P(None, "x", None), P()), "x8")
  check(lambda x, w: conv(x, w, 2, [(5, 5)], NWC), (x, w), (P(None, "x", None), P()), "x4")


@pytest.mark.parametrize("dilation,stride,padding", [(2, 1, "SAME"), (3, 2, [(3, 3)]),
                                                     (2, 1, "VALID"), (4, 1, [(4, 4)])])
def test_conv1d_rhs_dilation(dilation, stride, padding):
  x, w = data(1, 32, 2), data(3, 2, 3, seed=1)
  check(lambda x, w: conv(x, w, stride, padding, NWC, rhs_dilation=(dilation,)), (x, w),
        (P(None, "x", None), P()), "x8")


@pytest.mark.parametrize("mesh", ["x4", "x8"])
@pytest.mark.parametrize("dilation,padding,window", [(2, [(1, 2)], 3), (2, [(2, 2)], 4),
                                                     (3, [(2, 2)], 3), (2, [(0, 0)], 2)])
def test_conv1d_lhs_dilation(mesh, dilation, padding, window):
  """Base (lhs) dilation is the transposed conv / the input gradient of a strided conv. With
  dilation a window may fall within one shard's rows (no exchange at all): no all-gather is
  asserted, collective-permutes are not required."""
  x, w = data(1, 16, 2), data(window, 2, 3, seed=1)
  check(lambda x, w: conv(x, w, 1, padding, NWC, lhs_dilation=(dilation,)), (x, w),
        (P(None, "x", None), P()), mesh, permutes=False)


@pytest.mark.parametrize("padding,window", [("SAME", 3), ("SAME", 4), ("VALID", 2),
                                            ("VALID", 3)])
def test_conv_transpose_1d_and_2d(padding, window):
  x1, w1 = data(1, 16, 2), data(window, 2, 3, seed=1)
  check(lambda x, w: lax.conv_transpose(x, w, (2,), padding, dimension_numbers=NWC), (x1, w1),
        (P(None, "x", None), P()), "x8", permutes=False)
  x2, w2 = data(1, 8, 8, 2), data(window, window, 2, 2, seed=2)
  check(lambda x, w: lax.conv_transpose(x, w, (2, 2), padding, dimension_numbers=NHWC),
        (x2, w2), (P(None, "b", "a", None), P()), "ab", permutes=False)


@pytest.mark.parametrize("stride,padding", [(1, "SAME"), (2, "SAME"), (2, "VALID"),
                                            (1, [(2, 0)])])
def test_conv_input_and_weight_gradients_with_a_sharded_cotangent(stride, padding):
  """jax.vjp of a conv: the input gradient is an lhs-dilated conv (halo), the weight gradient a
  conv over the sharded spatial dim (correctness only)."""
  x, w = data(1, 32, 3), data(3, 3, 4, seed=1)
  y = conv(x, w, stride, padding, NWC)
  ct = data(*y.shape, seed=2)

  def grads(x, w, ct):
    _, vjp = jax.vjp(lambda x, w: conv(x, w, stride, padding, NWC), x, w)
    return vjp(ct)

  spec = P(None, "x", None)
  check(lambda x, w, ct: grads(x, w, ct)[0], (x, w, ct), (spec, P(), spec), "x8", tol=1e-4)
  check(grads, (x, w, ct), (spec, P(), spec), "x4", halo_only=False, tol=1e-4)


# --- conv: groups, layouts, ranks ----------------------------------------------------------------

def test_depthwise_conv_spatially_sharded():
  x, w = data(1, 16, 4), data(3, 1, 4, seed=1)
  fn = lambda x, w: conv(x, w, 1, "SAME", NWC, feature_group_count=4)  # noqa: E731
  check(fn, (x, w), (P(None, "x", None), P()), "x8")
  check(fn, (x, w), (P(None, "a", "b"), P(None, None, "b")), "ab")  # and channels
  x2, w2 = data(1, 16, 16, 4), data(5, 5, 1, 4, seed=2)
  check(lambda x, w: conv(x, w, 2, "SAME", NHWC, feature_group_count=4), (x2, w2),
        (P(None, "a", "b", None), P()), "ab")


def test_grouped_conv_spatially_sharded():
  x, w = data(1, 16, 4), data(5, 2, 6, seed=1)
  check(lambda x, w: conv(x, w, 1, "SAME", NWC, feature_group_count=2), (x, w),
        (P(None, "x", None), P()), "x8")


@pytest.mark.parametrize("groups,mesh,spec", [(2, "x8", P(None, "x", None)),
                                              (4, "ab", P("a", "b", None))])
def test_batch_group_conv_spatially_sharded(groups, mesh, spec):
  x, w = data(4, 16, 2), data(3, 2, 8, seed=1)
  check(lambda x, w: conv(x, w, 1, "SAME", NWC, batch_group_count=groups), (x, w), (spec, P()),
        mesh)


@pytest.mark.parametrize("stride", [1, 2])
@pytest.mark.parametrize("mesh,spec", [("x8", P(None, None, "x", None)),
                                       ("x4", P(None, None, None, "x")),
                                       ("ab", P(None, None, "b", "a"))])
def test_conv2d_nchw(mesh, spec, stride):
  x, w = data(1, 2, 16, 8), data(4, 2, 3, 3, seed=1)
  check(lambda x, w: conv(x, w, stride, "SAME", NCHW), (x, w), (spec, P()), mesh)


@pytest.mark.parametrize("window,stride,padding", [(3, 1, "SAME"), (3, 2, "SAME"),
                                                   (5, 1, [(3, 1), (1, 3)]), (2, 2, "VALID")])
@pytest.mark.parametrize("spec", [P(None, "a", "b", None), P(None, "b", "a", None),
                                  P(None, AB, None, None)])
def test_conv2d_nhwc_h_and_w_sharded(spec, window, stride, padding):
  x, w = data(1, 16, 16, 2), data(window, window, 2, 4, seed=1)
  check(lambda x, w: conv(x, w, stride, padding, NHWC), (x, w), (spec, P()), "ab",
        permutes=window > stride)


@pytest.mark.parametrize("dn,lhs_shape,rhs_shape,spec,mesh", [
    (("NHWC", "HWIO", "NCHW"), (2, 16, 8, 4), (3, 3, 4, 6), P(None, "a", "b", None), "ab"),
    (("NHWC", "OIHW", "NHWC"), (2, 16, 8, 4), (6, 4, 3, 3), P(None, "x", None, None), "x8"),
    (("HWNC", "HWIO", "HWNC"), (16, 8, 2, 4), (3, 3, 4, 6), P("x", None, None, None), "x8"),
    (("NWHC", "WHIO", "NHWC"), (2, 16, 8, 4), (3, 5, 4, 6), P(None, "a", "b", None), "ab"),
], ids=["out-nchw", "kernel-oihw", "spatial-first", "spatial-swapped"])
def test_conv_dimension_numbers(dn, lhs_shape, rhs_shape, spec, mesh):
  x, w = data(*lhs_shape), data(*rhs_shape, seed=1)
  plan = check(lambda x, w: conv(x, w, 1, "SAME", dn), (x, w), (spec, P()), mesh,
               halo_only=True)
  assert {c.kind for c in plan.collectives} == {"collective-permute"}


@pytest.mark.parametrize("stride", [1, 2])
def test_conv3d(stride):
  x, w = data(1, 8, 8, 4, 2), data(3, 3, 3, 2, 2, seed=1)
  check(lambda x, w: conv(x, w, stride, "SAME", NDHWC), (x, w),
        (P(None, "a", "b", None, None), P()), "ab")
  check(lambda x, w: conv(x, w, stride, "SAME", NDHWC), (x, w),
        (P(None, None, "a", "b", None), P()), "ab")


# --- multi-hop halos and uneven sizes ------------------------------------------------------------

@pytest.mark.parametrize("fn", [
    lambda x, w: conv(x, w, 1, "SAME", NWC),
    lambda x, w: conv(x, w, 1, [(6, 0)], NWC),
    lambda x, w: conv(x, w[:5], 1, "SAME", NWC, rhs_dilation=(2,)),
    lambda x, w: nn.max_pool(x, (7,), (1,), "SAME") + w.sum(),
], ids=["conv7", "conv7-left", "conv5-dilated", "maxpool7"])
def test_multi_hop_halo_wider_than_a_shard(fn):
  """16 rows on 8 shards of 2: a window of 7 needs 3 rows a side (two hops)."""
  x, w = data(1, 16, 2), data(7, 2, 3, seed=1)
  plan = check(fn, (x, w), (P(None, "x", None), P()), "x8", halo_only=True)
  assert len([c for c in plan.collectives if c.kind == "collective-permute"]) >= 3


@pytest.mark.parametrize("n,mesh,window,stride", [(13, "x8", 3, 1), (13, "x4", 5, 2),
                                                  (7, "x4", 3, 1), (10, "x8", 7, 1),
                                                  (3, "x8", 3, 1), (29, "x8", 3, 2)])
def test_conv_uneven_spatial(n, mesh, window, stride):
  x, w = data(1, n, 2), data(window, 2, 3, seed=1)
  check(lambda x, w: conv(x, w, stride, "SAME", NWC), (x, w), (P(None, "x", None), P()), mesh)


def test_conv2d_uneven_h_and_w():
  x, w = data(1, 10, 7, 2), data(3, 3, 2, 3, seed=1)
  check(lambda x, w: conv(x, w), (x, w), (P(None, "a", "b", None), P()), "ab")
  check(lambda x, w: conv(x, w, 2), (x, w), (P(None, "b", "a", None), P()), "ab")


# --- reduce_window (pooling) ---------------------------------------------------------------------

POOL_SPECS = [("x8", P(None, "x", None, None)), ("ab", P(None, "a", "b", None)),
              ("x4", P(None, None, "x", None))]
# name -> pooling fn; the names in POOLS_H_ONLY window along H only (W passes through).
POOLS_H_ONLY = ("min-base-dilated", "generic-mul")
POOLS = {
    "max3s2-same": lambda x: nn.max_pool(x, (3, 3), (2, 2), "SAME"),
    "max2s2": lambda x: nn.max_pool(x, (2, 2), (2, 2)),
    "avg2s2": lambda x: nn.avg_pool(x, (2, 2), (2, 2)),
    "avg3-same": lambda x: nn.avg_pool(x, (3, 3), (1, 1), "SAME"),
    "avg3-same-exclude-pad": lambda x: nn.avg_pool(x, (3, 3), (1, 1), "SAME",
                                                   count_include_pad=False),
    "sum5x3-asym": lambda x: lax.reduce_window(x, 0.0, lax.add, (1, 5, 3, 1), (1, 1, 1, 1),
                                               [(0, 0), (3, 1), (1, 1), (0, 0)]),
    "min3": lambda x: lax.reduce_window(x, jnp.inf, lax.min, (1, 3, 3, 1), (1, 1, 1, 1),
                                        "SAME"),
    "max-window-dilated": lambda x: lax.reduce_window(x, -jnp.inf, lax.max, (1, 3, 3, 1),
                                                      (1, 1, 1, 1), "SAME",
                                                      window_dilation=(1, 2, 2, 1)),
    "min-base-dilated": lambda x: lax.reduce_window(x, jnp.inf, lax.min, (1, 3, 1, 1),
                                                    (1, 2, 1, 1), [(0, 0), (1, 1), (0, 0),
                                                                   (0, 0)],
                                                    base_dilation=(1, 2, 1, 1)),
    "generic-mul": lambda x: lax.reduce_window(x, 1.0, lax.mul, (1, 3, 1, 1), (1, 1, 1, 1),
                                               "SAME"),
}


@pytest.mark.parametrize("mesh,spec", POOL_SPECS, ids=[m for m, _ in POOL_SPECS])
@pytest.mark.parametrize("name", list(POOLS))
def test_pooling(name, mesh, spec):
  x = data(2, 16, 8, 3)
  aligned = name in ("max2s2", "avg2s2")  # 2x2 windows, stride 2: no window straddles shards
  # base dilation: the (exact, minimal) halo may be empty
  needs_halo = not aligned and name != "min-base-dilated" and not (name in POOLS_H_ONLY
                                                                    and mesh == "x4")
  check(POOLS[name], (x,), spec, mesh, permutes=needs_halo)


def test_reduce_window_int():
  x = jnp.asarray(np.random.default_rng(0).integers(-50, 50, (1, 16, 8)).astype(np.int32))
  imin = jnp.iinfo(jnp.int32).min
  check(lambda x: (lax.reduce_window(x, imin, lax.max, (1, 3, 1), (1, 1, 1), "SAME"),
                   lax.reduce_window(x, 0, lax.add, (1, 5, 1), (1, 1, 1), "SAME")),
        (x,), P(None, "x", None), "x8")


def test_reduce_window_with_an_idempotent_non_identity_init():
  """max with init 0 (a ReLU-pool): the init is not max's identity, but max is idempotent."""
  x = data(1, 16, 3)
  check(lambda x: lax.reduce_window(x, 0.0, lax.max, (1, 3, 1), (1, 2, 1), "SAME"), (x,),
        P(None, "x", None), "x8")


@pytest.mark.parametrize("mesh", ["x2", "x8"])
def test_reduce_window_with_a_non_identity_init(mesh):
  """XLA leaves padding out of a generic reduce_window, whose identity spmd cannot know: a padded
  windowed dim is gathered whole, exactly, and the plan says so."""
  x = data(1, 16, 3)
  plan = check(lambda x: lax.reduce_window(x, 1.0, lax.add, (1, 3, 1), (1, 1, 1), "SAME"),
               (x,), P(None, "x", None), mesh, halo_only=False)
  assert any("needs dim 1 of operand 0 whole" in w for w in plan.warnings)


def _argmax_pool(x):
  """Variadic reduce_window: (value, index) pairs, the first maximum of each window of 3."""
  idx = lax.broadcasted_iota(jnp.int32, x.shape, 0)

  def pick(a, b):
    (av, ai), (bv, bi) = a, b
    first = (av > bv) | ((av == bv) & (ai < bi))
    return lax.select(first, av, bv), lax.select(first, ai, bi)

  return lax.reduce_window((x, idx), (-jnp.inf, jnp.int32(2 ** 30)), pick, (3,), (1,), "SAME")


@pytest.mark.parametrize("mesh", ["x2", "x8"])
def test_variadic_reduce_window_argmax_pool(mesh):
  check(_argmax_pool, (data(16),), P("x"), mesh)


@pytest.mark.parametrize("fn,n,mesh", [
    (lambda x: nn.max_pool(x, (3,), (2,), "SAME"), 13, "x4"),
    (lambda x: nn.avg_pool(x, (3,), (1,), "VALID"), 13, "x8"),
    (lambda x: nn.max_pool(x, (2,), (2,)), 7, "x2"),
    (lambda x: nn.avg_pool(x, (5,), (1,), "SAME"), 10, "x8"),
], ids=["max13on4", "avg13on8", "max7on2", "avg10on8"])
def test_pooling_uneven(fn, n, mesh):
  check(fn, (data(1, n, 2),), P(None, "x", None), mesh)


def test_pooling_uneven_2d_mesh():
  check(lambda x: nn.max_pool(x, (3, 3), (2, 2), "SAME"), (data(1, 11, 9, 2),),
        P(None, "a", "b", None), "ab")


# --- pad, slice, stencils, roll ------------------------------------------------------------------

PADS = {
    "zero-pad": lambda v: jnp.pad(v, ((2, 2), (0, 0))),
    "asym": lambda v: lax.pad(v, 0.0, [(3, 1, 0), (0, 0, 0)]),
    "negative": lambda v: lax.pad(v, 1.5, [(-2, -2, 0), (0, 0, 0)]),
    "neg-lo-pos-hi": lambda v: lax.pad(v, 1.5, [(-3, 3, 0), (0, 0, 0)]),
    "interior": lambda v: lax.pad(v, -1.0, [(1, 1, 1), (0, 0, 0)]),
    "interior-negative": lambda v: lax.pad(v, -1.0, [(-1, 0, 1), (0, 0, 0)]),
    "interior-2": lambda v: lax.pad(v, 2.0, [(0, -2, 2), (0, 0, 0)]),
    "wide": lambda v: lax.pad(v, 0.0, [(9, 5, 0), (0, 0, 0)]),
    "mode-edge": lambda v: jnp.pad(v, ((2, 2), (0, 0)), mode="edge"),
    "mode-reflect": lambda v: jnp.pad(v, ((2, 2), (0, 0)), mode="reflect"),
    "mode-wrap": lambda v: jnp.pad(v, ((1, 2), (0, 0)), mode="wrap"),
}


@pytest.mark.parametrize("mesh", ["x4", "x8"])
@pytest.mark.parametrize("name", list(PADS))
def test_pad(name, mesh):
  """lax.pad is a halo op (halo-only when the result divides); jnp.pad's edge / reflect / wrap
  modes are concatenations of slices: correctness only."""
  concatenated = name.startswith("mode-")
  check(PADS[name], (data(16, 3),), P("x", None), mesh, halo_only=False if concatenated else None)


@pytest.mark.parametrize("n,mesh", [(13, "x4"), (13, "x8"), (10, "ab")])
def test_pad_uneven(n, mesh):
  spec = P("x", None) if mesh != "ab" else P(AB, None)
  check(lambda v: (lax.pad(v, 0.0, [(2, 1, 0), (0, 0, 0)]),
                   lax.pad(v, 0.5, [(-3, 2, 1), (0, 0, 0)])), (data(n, 3),), spec, mesh)


SLICES = {
    "window": lambda v: v[3:11],
    "window-far": lambda v: v[6:14],
    "tail": lambda v: v[9:],
    "stride2": lambda v: v[1::2],
    "stride3": lambda v: v[2:14:3],
    "stride5": lambda v: v[::5],
    "lax-strided": lambda v: lax.slice(v, (1, 0), (15, 3), (2, 1)),
}
# (name, mesh) whose every output row already lies on the device that makes it: no collectives.
LOCAL_SLICES = {("stride2", "x4"), ("stride2", "x8"), ("stride5", "x4")}


@pytest.mark.parametrize("mesh", ["x4", "x8"])
@pytest.mark.parametrize("name", list(SLICES))
def test_slice(name, mesh):
  local = (name, mesh) in LOCAL_SLICES
  plan = check(SLICES[name], (data(16, 3),), P("x", None), mesh, permutes=not local)
  if local:
    assert plan.collectives == ()


def test_strided_slice_uneven():
  check(lambda v: (v[1:12:4], v[::2], v[2:]), (data(13, 3),), P("x", None), "x4")


def test_slice_of_a_pad_is_one_halo():
  """A pad then a slice back to the operand's length shifts the dim (XLA's
  MergedPadThenSliceShiftRight): one halo of the rows shifted in (a row per shard here). It was
  a halo into an uneven pad and then a reshard of it: 48 B where XLA moves 12 B."""
  shift = lambda v: lax.pad(v, 0., [(1, 0, 0), (0, 0, 0)])[:16]
  plan = check(shift, (data(16, 3),), P("x", None), "x4")
  assert [(c.kind, c.bytes) for c in plan.collectives] == [("collective-permute", 12)]
  check(lambda v: lax.pad(v, 1., [(2, 3, 1), (0, 0, 0)])[3:20], (data(13, 3),), P("x", None), "x4")


def _laplacian_valid(u):
  return u[:-2, 1:-1] + u[2:, 1:-1] + u[1:-1, :-2] + u[1:-1, 2:] - 4 * u[1:-1, 1:-1]


def _laplacian_same(u):
  p = jnp.pad(u, 1)
  return p[:-2, 1:-1] + p[2:, 1:-1] + p[1:-1, :-2] + p[1:-1, 2:] - 4 * u


def _laplacian_periodic(u):
  return (jnp.roll(u, 1, 0) + jnp.roll(u, -1, 0) + jnp.roll(u, 1, 1) + jnp.roll(u, -1, 1)
          - 4 * u)


STENCILS = {
    "forward-diff": lambda u: u[1:] - u[:-1],
    "forward-diff-padded": lambda u: jnp.pad(u[1:] - u[:-1], ((0, 1), (0, 0))),
    "central-diff": lambda u: (u[2:] - u[:-2]) / 2,
    "jnp-diff": lambda u: jnp.diff(u, axis=0),
    "laplacian-valid": _laplacian_valid,
    "laplacian-same": _laplacian_same,
    "laplacian-periodic": _laplacian_periodic,
    "roll+1": lambda u: jnp.roll(u, 1, 0),
    "roll-3": lambda u: jnp.roll(u, -3, 0),
    "roll-both": lambda u: jnp.roll(u, (2, -1), (0, 1)),
}
STENCIL_SPECS = [("x8", P("x", None)), ("ab", P("a", "b")), ("ab", P("b", "a"))]


@pytest.mark.parametrize("mesh,spec", STENCIL_SPECS, ids=[f"{m}-{s}" for m, s in STENCIL_SPECS])
@pytest.mark.parametrize("name", list(STENCILS))
def test_stencils(name, mesh, spec):
  check(STENCILS[name], (data(16, 16),), spec, mesh)


def _xla_bytes(fn, args, spec, mesh) -> int:
  """Per-device collective bytes of jax.jit with every input and output constrained to the same
  sharding (constraints, since jit's own shardings must divide every dim)."""
  named = NamedSharding(_mesh(mesh), spec)
  pin = functools.partial(jax.lax.with_sharding_constraint, shardings=named)
  program = jax.jit(lambda *args: jax.tree.map(pin, fn(*map(pin, args))))
  return sum(c.bytes for c in collectives(program.lower(*args).compile().as_text()))


@pytest.mark.parametrize("shift,mesh,spec", [
    (1, "x8", P("x", None)), (-1, "x8", P("x", None)), (-3, "x8", P("x", None)),
    (2, "x8", P("x", None)), (9, "x8", P("x", None)), (8, "x4", P("x", None)),
    (2, "ab", P("a", "b")), (-3, "ab", P("b", "a")), (5, "ab", P(AB, None))])
def test_roll_is_halo_only_with_no_more_bytes_than_xla(shift, mesh, spec):
  """A roll takes each shard's rows from the one or two shards they rotate from: a block's worth
  of rows (XLA moves the same); a shift by whole blocks is one permute of whole blocks."""
  u = data(16, 16)
  fn = lambda u: jnp.roll(u, shift, 0)  # noqa: E731
  plan = check(fn, (u,), spec, mesh, halo_only=True)
  assert {c.kind for c in plan.collectives} == {"collective-permute"}
  assert plan.total_bytes <= _xla_bytes(fn, (u,), spec, mesh), plan.explain()


def test_roll_along_two_sharded_dims_and_of_a_gradient():
  u = data(16, 16)
  fn = lambda u: jnp.roll(u, (2, -1), (0, 1))  # noqa: E731
  plan = check(fn, (u,), P("a", "b"), "ab", halo_only=True)
  assert plan.total_bytes <= _xla_bytes(fn, (u,), P("a", "b"), "ab")
  grad = jax.grad(lambda u: (jnp.roll(u, 3, 0) * u).sum())
  plan = check(grad, (u,), P("x", None), "x8", halo_only=True)
  assert {c.kind for c in plan.collectives} == {"collective-permute"}
  assert plan.total_bytes <= _xla_bytes(grad, (u,), P("x", None), "x8"), plan.explain()


@pytest.mark.parametrize("n,shift,mesh,spec", [
    (16, 3, "x8", P("x", None)), (16, -3, "x8", P("x", None)), (16, 11, "x8", P("x", None)),
    (16, -1, "x4", P("x", None)), (16, 8, "x4", P("x", None)), (16, 16, "x8", P("x", None)),
    (16, 5, "ab", P(AB, None)), (16, -2, "ab", P("b", "a")), (13, 5, "x8", P("x", None)),
    (13, -4, "x4", P("x", None)), (13, 20, "x8", P("x", None))])
def test_roll_gradient_is_halo_only_with_no_more_bytes_than_xla(n, shift, mesh, spec):
  """The transpose of a roll (the cotangent's two pieces padded into place and added) is a roll
  back: each shard takes its rows from the shards they rotate from, as the forward does."""
  grad = jax.grad(lambda u, v: (jnp.roll(u, shift, 0) * v).sum())
  args = (data(n, 16), data(n, 16, seed=1))
  plan = check(grad, args, (spec, spec), mesh, halo_only=n % 8 == 0, permutes=shift % n != 0)
  assert {c.kind for c in plan.collectives if c.op is not None} <= {"collective-permute"}
  assert plan.total_bytes <= _xla_bytes(grad, args, spec, mesh), plan.explain()


@pytest.mark.parametrize("n,shift,mesh", [(13, 1, "x4"), (13, -3, "x4"), (13, 5, "x8"),
                                          (9, 2, "x4"), (3, 1, "x8")])
def test_roll_uneven(n, shift, mesh):
  """Uneven blocks: each shard's rows rotate from a few shards, at offsets that vary by shard."""
  check(lambda u: jnp.roll(u, shift, 0), (data(n, 3),), P("x", None), mesh)


@pytest.mark.parametrize("n,mesh,spec", [(13, "x4", P("x", None)), (13, "x8", P("x", None)),
                                         (9, "x8", P("x", None)), (7, "ab", P("a", "b")),
                                         (13, "ab", P(AB, None))])
def test_rev_uneven_is_halo_only_with_no_more_bytes_than_xla(n, mesh, spec):
  """Uneven blocks: the mirrored block reversed, then rotated back by the padding's rows."""
  fn = lambda u: (jnp.flip(u, 0), jnp.flip(u, (0, 1)) * 2)  # noqa: E731
  args = (data(n, 7),)
  plan = check(fn, args, spec, mesh)
  assert {c.kind for c in plan.collectives if c.op is not None} == {"collective-permute"}
  assert plan.total_bytes <= _xla_bytes(fn, args, spec, mesh), plan.explain()


@pytest.mark.parametrize("mesh,spec", STENCIL_SPECS, ids=[f"{m}-{s}" for m, s in STENCIL_SPECS])
def test_same_size_stencils_are_halo_only(mesh, spec):
  """Padded Laplacian and padded forward differences keep 16x16: only neighbour exchanges."""
  u = data(16, 16)
  check(_laplacian_same, (u,), spec, mesh, halo_only=True)
  check(lambda u: jnp.pad(u[1:] - u[:-1], ((0, 1), (0, 0))), (u,), spec, mesh, halo_only=True)


@pytest.mark.parametrize("name", ["forward-diff", "laplacian-same", "roll+1", "roll-3"])
def test_stencils_uneven(name):
  check(STENCILS[name], (data(13, 10),), P("a", "b"), "ab")
  check(STENCILS[name], (data(13, 3),), P("x", None), "x4")


# --- gradients -----------------------------------------------------------------------------------

def _conv_pool(x, w, pool):
  y = jnp.tanh(conv(x, w, 1, "SAME"))
  return pool(y, (3, 3), (2, 2), "SAME")


@pytest.mark.parametrize("pool", [nn.max_pool, nn.avg_pool], ids=["max", "avg"])
@pytest.mark.parametrize("mesh,spec", [("x8", P(None, "x", None, None)),
                                       ("ab", P(None, "a", "b", None)),
                                       ("x4", P(None, "x", None, None))])
def test_grad_of_conv_pool_loss_with_sharded_h(mesh, spec, pool):
  x, w = data(1, 16, 8, 2), data(3, 3, 2, 3, seed=1, scale=0.5)
  h = 13 if mesh == "x4" else 16  # and an uneven height
  x = x[:, :h]

  def loss(x, w):
    return (_conv_pool(x, w, pool) ** 2).sum()

  f = spmd.partition(loss, mesh=_mesh(mesh), in_specs=(spec, P()))
  got = jax.grad(f, argnums=(0, 1))(x, w)
  want = jax.grad(loss, argnums=(0, 1))(x, w)
  for g, wt in zip(got, want):
    np.testing.assert_allclose(np.asarray(g), np.asarray(wt), rtol=1e-4, atol=1e-4)
  # the gradient program (select_and_scatter_add / lhs-dilated conv / weight-grad conv)
  check(jax.grad(loss, argnums=(0, 1)), (x, w), (spec, P()), mesh, halo_only=False, tol=1e-4)


# --- models: ResNet stem and a U-Net block on a 224-pixel-high image, H on 4 shards -------------

IMAGE = (1, 224, 16, 3)
H4 = P(None, "h", None, None)


def resnet_stem(x, w):
  y = jax.nn.relu(conv(x, w, 2, [(3, 3), (3, 3)]))       # 7x7 stride 2, pad 3: 112 x 8
  return nn.max_pool(y, (3, 3), (2, 2), "SAME")           # 3x3 stride 2: 56 x 4


def unet_block(x, w1, w2, wt, w3, up="transpose"):
  h1 = jax.nn.relu(conv(x, w1))                           # 224 x 16 x 8
  d = nn.max_pool(h1, (2, 2), (2, 2))                     # 112 x 8 x 8
  h2 = jax.nn.relu(conv(d, w2))                           # 112 x 8 x 8
  if up == "transpose":
    u = lax.conv_transpose(h2, wt, (2, 2), "SAME", dimension_numbers=NHWC)
  elif up == "repeat":
    u = conv(jnp.repeat(jnp.repeat(h2, 2, axis=1), 2, axis=2), wt)
  else:
    u = conv(jax.image.resize(h2, (1, 224, 16, 8), "nearest"), wt)
  cat = jnp.concatenate([u, h1], axis=-1)                 # skip connection: 224 x 16 x 16
  return conv(cat, w3)                                    # 224 x 16 x 4


def _unet_weights(up):
  k = 2 if up == "transpose" else 3
  return (data(3, 3, 3, 8, seed=1, scale=0.3), data(3, 3, 8, 8, seed=2, scale=0.2),
          data(k, k, 8, 8, seed=3, scale=0.2), data(3, 3, 16, 4, seed=4, scale=0.2))


def _assert_grads_match(fn, args, specs, argnums, tol=1e-4):
  loss = lambda *a: (fn(*a) ** 2).sum()  # noqa: E731
  f = spmd.partition(loss, mesh=_mesh("h4"), in_specs=specs)
  got = jax.grad(f, argnums=argnums)(*args)
  want = jax.grad(loss, argnums=argnums)(*args)
  for g, w in zip(got, want):
    scale = float(np.max(np.abs(np.asarray(w))))
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=tol, atol=tol * scale)


def test_resnet_stem_forward_is_halo_only():
  x, w = data(*IMAGE), data(7, 7, 3, 8, seed=1, scale=0.1)
  plan = check(resnet_stem, (x, w), (H4, P()), "h4", halo_only=True, tol=1e-4)
  assert {c.kind for c in plan.collectives} == {"collective-permute"}
  assert plan.out_specs == H4


def test_resnet_stem_gradient():
  x, w = data(*IMAGE), data(7, 7, 3, 8, seed=1, scale=0.1)
  _assert_grads_match(resnet_stem, (x, w), (H4, P()), (0, 1))


@pytest.mark.parametrize("up", ["transpose", "repeat", "resize"])
def test_unet_block_forward(up):
  x, ws = data(*IMAGE), _unet_weights(up)
  fn = functools.partial(unet_block, up=up)
  specs = (H4, P(), P(), P(), P())
  plan = check(fn, (x, *ws), specs, "h4", halo_only=up != "resize", tol=1e-4)
  if up != "resize":  # nearest resize is a gather: it may gather H
    assert {c.kind for c in plan.collectives} == {"collective-permute"}


@pytest.mark.parametrize("up", ["transpose", "repeat"])
def test_unet_block_gradient(up):
  x, ws = data(*IMAGE), _unet_weights(up)
  fn = functools.partial(unet_block, up=up)
  _assert_grads_match(fn, (x, *ws), (H4, P(), P(), P(), P()), (0, 1, 2, 3, 4))
