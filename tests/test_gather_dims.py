"""Gathers of several dims at once (reshard.py's ``GatherDims``): one all-gather over all their
axes, its blocks laid out per dim, where XLA gathers dim by dim. Values, plan == compiled HLO and
bytes against XLA's partitioner, for axes in and out of mesh order, dims that keep a major axis,
uneven dims, three dims, integer and bfloat16 values, partial sums and a gradient."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from helpers import ints, no_more_than_xla, randn
from test_xla_cases10 import A2B2, A4B2
from spmd.partition.reshard import AllGather, GatherDims, plan_reshard
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
