"""Gathers and reduce-scatters of several dims at once (reshard.py's ``GatherDims`` and
``ScatterDims``): one collective over all their axes, its blocks laid out per dim, where XLA
gathers dim by dim and all-reduces partial sums that two dims split. Values, plan == compiled
HLO and bytes against XLA's partitioner, for axes in and out of mesh order, dims that keep a
major axis, uneven dims, three dims, integer and bfloat16 values, partial sums and a gradient."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from helpers import assert_partitioned_matches, ints, no_more_than_xla, randn
from test_xla_cases10 import A2B2, A4B2
from spmd.partition.reshard import AllGather, GatherDims, ScatterDims, plan_reshard
from spmd.partition.sharding import TensorSharding

BF16 = jnp.bfloat16

CASES = [  # mesh, shape, in spec, out spec, dtype, bytes per device (XLA's, dim by dim)
    (A2B2, (8, 4), P("a", "b"), P(), np.float32, 128),  # 64 + 128
    (A2B2, (8, 4), P("b", "a"), P(), np.float32, 128),  # axes out of mesh order
    ("a2b2c2", (8, 4, 4), P("a", "b", "c"), P(), np.float32, 512),  # 128 + 256 + 512
    ("a2b2c2", (8, 8), P(("a", "b"), "c"), P("a"), np.float32, 128),  # dim 0 keeps 'a'
    ("a2b2c2", (8, 8), P(("c", "a"), "b"), P("c"), np.int32, 128),
    ("a2b4", (8, 16), P("a", "b"), P(), BF16, 512),  # moved as f32 on CPU
    ("a2b4", (6, 10), P("a", "b"), P(), np.float32, 288),  # dim 1 uneven: 4 blocks of 3
    ("a2b2c2", (5, 6, 3), P("a", ("b", "c")), P(), np.float32, 576),  # both uneven
    (A4B2, (16, 4), P(None, "b"), P(), np.float32, 256),  # one dim: a plain all-gather
]


@pytest.mark.parametrize("mesh,shape,spec,out,dtype,want", CASES)
def test_dims_gathered_in_one_all_gather(mesh, shape, spec, out, dtype, want):
  x = ints(*shape).astype(dtype) if dtype == np.int32 else randn(*shape).astype(dtype)
  plan = no_more_than_xla(lambda x: x * 2, (x,), spec, mesh, out)
  assert plan.total_bytes == want, plan.explain()
  assert [c.kind for c in plan.collectives] == ["all-gather"], plan.explain()


def test_consecutive_gathers_of_distinct_dims_fuse():
  """P(('a','b'),'c') -> P('a') of f32[8,8] on 2x2x2: dim 0 loses 'b' and dim 1 'c', one
  collective over ('b','c') whose buffer is the result's [4,8] block; one dim alone stays an
  ``AllGather``."""
  mesh = {"a": 2, "b": 2, "c": 2}
  src, dst = TensorSharding((("a", "b"), ("c",))), TensorSharding((("a",), ()))
  step, = plan_reshard(src, dst, (8, 8), 4, mesh)
  assert isinstance(step, GatherDims) and step.axes == ("b", "c")
  assert (step.bytes, step.collectives) == (4 * 8 * 4, 1)
  one, = plan_reshard(TensorSharding((("a",), ())), TensorSharding(((), ())), (8, 8), 4, mesh)
  assert isinstance(one, AllGather)


def test_partial_sums_reduced_then_gathered_whole():
  """A dot's partial sums over 'b', its result's dims over 'a' and 'c', returned replicated:
  the [4,4] sums all-reduced over 'b' (64 B), then both dims gathered over ('a','c') in one
  collective (256 B)."""
  f = lambda x, w: x @ w
  plan = no_more_than_xla(f, (randn(8, 4), randn(4, 8, seed=1)), (P("a", "b"), P("b", "c")),
                          "a2b2c2", P())
  assert [(c.kind, c.bytes) for c in plan.collectives] == [("all-reduce", 64),
                                                           ("all-gather", 256)], plan.explain()


def test_gradient_of_a_replicated_output():
  """The loss's gradient through a 2-D sharded weight gathered whole for a replicated output."""
  def f(w, x):
    return jax.grad(lambda w: jnp.sum(jnp.tanh(w * x) ** 2))(w), w * 3
  no_more_than_xla(f, (randn(8, 8), randn(8, 8, seed=1)), (P("a", "b"), P("a", "b")), "a2b4",
                   (P("a", "b"), P()), rtol=1e-5, atol=1e-6)


SCATTERS = [  # mesh, x spec, w spec, out spec, bytes per device (XLA's)
    ("a2b2c2", P(None, ("a", "b")), P(("a", "b"), None), P("a", "b"), 256),  # 512
    ("a2b2c2", P(None, ("a", "b")), P(("a", "b"), None), P("b", "a"), 256),  # 512
    ("a2b2c2", P(None, ("a", "b", "c")), P(("a", "b", "c"), None), P(("c", "a"), "b"), 256),
    ("a2b2c2", P("c", ("a", "b")), P(("a", "b"), None), P(("c", "b"), "a"), 128),
    (A4B2, P(None, ("a", "b")), P(("a", "b"), None), P("b", "a"), 256),
]


@pytest.mark.parametrize("mesh,x_spec,w_spec,out,want", SCATTERS)
def test_partial_sums_scattered_into_two_dims_in_one_reduce_scatter(mesh, x_spec, w_spec, out,
                                                                    want):
  """A dot contracting a dim sharded over several axes, its result asked for split over two
  dims by those axes: one reduce-scatter of the partial [8,8] block, where scattering dim by
  dim reduces 256 + 128 B and an all-reduce (XLA's choice) sends twice as much."""
  plan = no_more_than_xla(lambda x, w: x @ w, (randn(8, 8), randn(8, 8, seed=1)),
                          (x_spec, w_spec), mesh, out, rtol=1e-5, atol=1e-5)
  assert [(c.kind, c.bytes) for c in plan.collectives] == [("reduce-scatter", want)], \
      plan.explain()


def test_consecutive_reduce_scatters_of_distinct_dims_fuse():
  """Partial sums over ('a','b') of f32[8,8] into P('b','a') on 2x2x2: one collective over
  ('a','b') reducing the whole [8,8] block, a [4,4] block kept."""
  mesh = {"a": 2, "b": 2, "c": 2}
  src = TensorSharding(((), ()), ("a", "b"))
  step, = plan_reshard(src, TensorSharding((("b",), ("a",))), (8, 8), 4, mesh)
  assert isinstance(step, ScatterDims) and step.axes == ("a", "b")
  assert (step.bytes, step.sent(mesh)) == (256, 192)



def test_uneven_dims_all_reduced_rather_than_scattered_padded():
  """f32[6,10] partial sums over ('a','b') on 2x4 into P('a','b'): dim 1 splits into 4 blocks
  of 3, the last padded, so a reduce-scatter would reduce a [6,12] buffer (288 B) where an
  all-reduce of the [6,10] block reduces 240 B and each device slices its block (jax.jit takes
  no uneven out_spec to compare bytes with)."""
  f = lambda x, w: x @ w
  plan = assert_partitioned_matches(f, (randn(6, 8), randn(8, 10, seed=1)),
                                    (P(None, ("a", "b")), P(("a", "b"), None)), "a2b4",
                                    P("a", "b"), rtol=1e-5, atol=1e-5)
  assert [(c.kind, c.bytes) for c in plan.collectives] == [("all-reduce", 240)], plan.explain()
