"""Every primitive family, partitioned on the test meshes, must match the unpartitioned function.

Each case traces ``fn``, propagates shardings from ``in_specs`` (replicated, sharded on different
dims, several axes on one dim, and specs that disagree so that operands must be resharded), runs
the partitioned program and compares it with ``fn(*args)``. Each case also asserts that every
primitive has a sharding rule (no replicated fallback) and, on backend 'spmd', that the plan's
bytes per collective kind are the compiled HLO's (helpers.assert_partitioned_matches).

Runs on the default backend; ``SPMD_TEST_BACKEND=xla`` runs the same cases on backend='xla'.
"""
from __future__ import annotations

import functools
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

import spmd
from helpers import assert_partitioned_matches, indices, no_more_than_xla, randn, rng
from spmd.partition.wire import wire_for

ABC = ("a", "b", "c")


def ints(*shape, low=0, high=8, seed=0):
  return rng(seed).integers(low, high, size=shape).astype(np.int32)


def bools(*shape, seed=0):
  return rng(seed).random(shape) < 0.5


# (mesh, spec) for one rank-2 [8, 16] operand: replicated, either dim, several axes on one dim.
SPECS_2D = [
    ("x8", P()),
    ("x8", P("x")),
    ("x8", P(None, "x")),
    ("a2b4", P("a", "b")),
    ("a2b4", P("b", "a")),
    ("a2b4", P(("a", "b"))),
    ("a2b4", P(None, ("b", "a"))),
    ("a2b2c2", P("a", ("b", "c"))),
    ("a2b2c2", P(ABC)),
    ("a2b2c2", P("c", "a")),
]
# (mesh, spec of x, spec of y) for two [8, 16] operands; the later ones disagree (resharding).
PAIRS_2D = [
    ("x8", P(), P()),
    ("x8", P("x"), P("x")),
    ("x8", P("x"), P(None, "x")),
    ("a2b4", P("a", "b"), P("a", "b")),
    ("a2b4", P("a", "b"), P("b", "a")),
    ("a2b4", P(("a", "b")), P(None, "b")),
    ("a2b2c2", P(ABC), P(None, ABC)),
    ("a2b2c2", P("a", ("b", "c")), P(("c", "b"), "a")),
]


def _ids(cases):
  return [f"{m}-{'-'.join(str(s) for s in specs)}" for m, *specs in cases]


# --- elementwise ---------------------------------------------------------------------------------

UNARY = {
    "neg": lambda x: -x,
    "exp": jnp.exp,
    "tanh": jnp.tanh,
    "sin_cos": lambda x: jnp.sin(x) * jnp.cos(x),
    "abs_sqrt": lambda x: jnp.sqrt(jnp.abs(x)),
    "log1p": lambda x: jnp.log1p(jnp.abs(x)),
    "rsqrt": lambda x: lax.rsqrt(jnp.abs(x) + 1),
    "logistic": jax.nn.sigmoid,
    "floor_ceil_round": lambda x: jnp.floor(x) + jnp.ceil(x) + jnp.round(x),
    "sign": jnp.sign,
    "erf": jax.scipy.special.erf,
    "isfinite": lambda x: jnp.isfinite(jnp.log(x)),
    "square": jnp.square,
    "not": lambda x: ~(x > 0),
    "special": lambda x: (lax.erf_inv(jnp.tanh(x) * 0.9), lax.lgamma(jnp.abs(x) + 1),
                          lax.digamma(jnp.abs(x) + 1), jnp.expm1(x), lax.cbrt(x),
                          lax.reduce_precision(x, 5, 10), jnp.nextafter(x, 0.0)),
}


@pytest.mark.parametrize("name", list(UNARY))
def test_unary(name):
  x = randn(8, 16)
  k = list(UNARY).index(name)
  for mesh, spec in (SPECS_2D[k % len(SPECS_2D)], SPECS_2D[(k + 5) % len(SPECS_2D)]):
    plan = assert_partitioned_matches(UNARY[name], (x,), (spec,), mesh, rtol=2e-5)
    assert not plan.collectives, plan.explain()  # elementwise: every device keeps its shard


@pytest.mark.parametrize("mesh,spec", SPECS_2D[2::3], ids=_ids(SPECS_2D[2::3]))
def test_integer_unary(mesh, spec):
  def fn(i):
    return (lax.population_count(i), lax.clz(i), jnp.abs(i), -i, jnp.sign(i), ~i,
            lax.shift_right_logical(i, 2), i.astype(jnp.uint32) >> 3)

  assert_partitioned_matches(fn, (ints(8, 16, low=-50, high=50),), (spec,), mesh)


BINARY = {
    "add": jnp.add,
    "sub": jnp.subtract,
    "mul": jnp.multiply,
    "div": lambda x, y: x / (jnp.abs(y) + 1),
    "max_min": lambda x, y: jnp.maximum(x, y) - jnp.minimum(x, y),
    "pow": lambda x, y: jnp.power(jnp.abs(x) + 1, y),
    "atan2": jnp.arctan2,
    "rem": lambda x, y: jnp.fmod(x, jnp.abs(y) + 1),
    "compare": lambda x, y: (x < y, x <= y, x == y, x != y, x > y, x >= y),
}


# every spec pair for add and the comparisons; two pairs for the other ops
BINARY_CASES = [(name, *pair) for name in BINARY
                for pair in (PAIRS_2D if name in ("add", "compare") else PAIRS_2D[-2:])]


@pytest.mark.parametrize("name,mesh,sx,sy", BINARY_CASES,
                         ids=[c[0] + "-" + _ids([c[1:]])[0] for c in BINARY_CASES])
def test_binary(name, mesh, sx, sy):
  plan = assert_partitioned_matches(BINARY[name], (randn(8, 16), randn(8, 16, seed=1)), (sx, sy),
                                    mesh)
  if sx == sy:
    assert not plan.collectives, plan.explain()


@pytest.mark.parametrize("mesh,sx,sy", PAIRS_2D[::2], ids=_ids(PAIRS_2D[::2]))
def test_integer_and_bool_binary(mesh, sx, sy):
  def fn(i, j, p, q):
    return (i + j, i * j, i // (j + 1), i % (j + 1), i & j, i | j, i ^ j, i << 1, i >> 1,
            jnp.maximum(i, j), p & q, p | q, p ^ q, ~p, i == j)

  args = (ints(8, 16), ints(8, 16, seed=1), bools(8, 16), bools(8, 16, seed=1))
  assert_partitioned_matches(fn, args, (sx, sy, sy, sx), mesh)


BROADCASTS = {
    # name: (fn, shapes)
    "row": (lambda x, y: x + y, [(8, 16), (1, 16)]),
    "col": (lambda x, y: x * y, [(8, 16), (8, 1)]),
    "outer": (lambda x, y: x - y, [(8, 1), (1, 16)]),
    "rank": (lambda x, y: x / (jnp.abs(y) + 1), [(8, 16), (16,)]),
    "scalar_arg": (lambda x, s: x * s + s, [(8, 16), ()]),
    "python_scalar": (lambda x: 2.0 * x + 1, [(8, 16)]),
    "rank3": (lambda x, y: x + y, [(8, 8, 16), (8, 1)]),
}
BROADCAST_SPECS = [
    ("x8", [P("x"), P()]),
    ("a2b4", [P("a", "b"), P(None, "b")]),
    ("a2b2c2", [P(None, ("a", "b")), P("c")]),
]


@pytest.mark.parametrize("mesh,specs", BROADCAST_SPECS, ids=[m for m, _ in BROADCAST_SPECS])
@pytest.mark.parametrize("name", list(BROADCASTS))
def test_broadcasting(name, mesh, specs):
  fn, shapes = BROADCASTS[name]
  args = [randn(*s, seed=k) for k, s in enumerate(shapes)]
  in_specs = []
  for s, spec in zip(shapes, specs):
    # keep only the spec entries that fit (size-1 dims and scalars stay replicated)
    entries = [e if n > 1 else None for e, n in zip(tuple(spec), s)]
    in_specs.append(P(*entries))
  assert_partitioned_matches(fn, tuple(args), tuple(in_specs), mesh)


@pytest.mark.parametrize("mesh,sx,sy", PAIRS_2D[1::2], ids=_ids(PAIRS_2D[1::2]))
def test_select_n(mesh, sx, sy):
  def fn(c, x, y, k):
    return (jnp.where(c, x, y), jnp.where(x > 0, x, 0.0), lax.select_n(k, x, y, x * y),
            jnp.where(c, 1, k))

  args = (bools(8, 16), randn(8, 16), randn(8, 16, seed=1), ints(8, 16, high=3))
  assert_partitioned_matches(fn, args, (sy, sx, sy, sx), mesh)


def test_select_n_of_three_cases_split_unlike_each_other():
  """Three cases and the index, each split its own way, are the tree of two-case selects XLA
  runs (as JAX lowers them), each select taking its own operands' shardings: 168 B, XLA 224 B
  (was 320 B: one four-operand op whose disagreeing dims were all left whole, then gathered)."""
  args = (ints(8, 8, high=3), randn(8, 8), randn(8, 8, seed=1), randn(8, 8, seed=2))
  no_more_than_xla(lambda w, a, b, c: lax.select_n(w, a, b, c), args,
                   (P("a"), P(None, "b"), P("b"), P(None, "a")), "a2b4")


@pytest.mark.parametrize("mesh,sx,sy", PAIRS_2D[::3], ids=_ids(PAIRS_2D[::3]))
def test_clamp(mesh, sx, sy):
  def fn(x, lo, hi, s):
    return (jnp.clip(x, -0.5, 0.5), lax.clamp(lo, x, hi), lax.clamp(-s, x, s),
            jnp.clip(x, lo, None))

  lo = randn(8, 16, seed=1) - 1
  args = (randn(8, 16), lo, lo + 2, np.float32(0.3))
  assert_partitioned_matches(fn, args, (sx, sy, sx, P()), mesh)


@pytest.mark.parametrize("mesh,spec", SPECS_2D[::2], ids=_ids(SPECS_2D[::2]))
def test_convert_element_type(mesh, spec):
  def fn(x, i):
    return (x.astype(jnp.int32), i.astype(jnp.float32) * x, (x > 0).astype(jnp.float32),
            x.astype(jnp.bfloat16).astype(jnp.float32), x.astype(jnp.float16), i.astype(bool),
            lax.bitcast_convert_type(x, jnp.int32), i.astype(jnp.uint8))

  assert_partitioned_matches(fn, (randn(8, 16) * 4, ints(8, 16, low=-3, high=300)), (spec, spec),
                             mesh, rtol=1e-5, atol=1e-5)  # float16 too


@pytest.mark.parametrize("mesh,spec", SPECS_2D[1::3], ids=_ids(SPECS_2D[1::3]))
def test_integer_pow(mesh, spec):
  fn = lambda x, i: (x ** 2, x ** 3, lax.integer_pow(x + 3, -2), i ** 3)  # noqa: E731
  assert_partitioned_matches(fn, (randn(8, 16), ints(8, 16, low=-4)), (spec, spec), mesh, rtol=1e-5)


# --- shapes --------------------------------------------------------------------------------------

@pytest.mark.parametrize("mesh,specs", [
    ("x8", (P("x"), P())),
    ("a2b4", (P("b"), P("a"))),
    ("a2b2c2", (P(("a", "b")), P(None, "c"))),
], ids=["x8", "a2b4", "a2b2c2"])
def test_broadcast_in_dim(mesh, specs):
  def fn(v, m):
    return (jnp.broadcast_to(v, (8, 16)), lax.broadcast_in_dim(v, (4, 8, 16), (2,)),
            lax.broadcast_in_dim(m, (2, 8, 4, 16), (1, 3)), jnp.broadcast_to(m[:1], (8, 16)),
            jnp.zeros((8, 16)) + v[None, :])

  assert_partitioned_matches(fn, (randn(16), randn(8, 16, seed=1)), specs, mesh)


RESHAPES = [
    # (in shape, out shape, mesh, spec)
    ((8, 4), (32,), "x8", P("x")),
    ((8, 4), (32,), "a2b4", P("a", "b")),
    ((8, 4), (32,), "a2b4", P(None, "b")),
    ((8, 4), (32,), "a2b2c2", P(ABC)),
    ((32,), (4, 8), "x8", P("x")),
    ((32,), (4, 8), "a2b4", P(("b", "a"))),
    ((32,), (4, 8), "a2b2c2", P(ABC)),
    ((4, 6), (8, 3), "a2b4", P("b", "a")),
    ((4, 6), (8, 3), "a2b2c2", P(("a", "b"), "c")),
    ((4, 6), (8, 3), "a2b4", P("a")),
    ((8, 16), (2, 4, 16), "a2b4", P(("a", "b"))),
    ((2, 4, 16), (8, 16), "a2b2c2", P("a", "b", "c")),
    ((16, 8), (8, 16), "x8", P(None, "x")),
    ((16, 8), (8, 16), "a2b2c2", P(("a", "b"), "c")),
    ((8, 16), (4, 4, 8), "a2b4", P("a", "b")),
    ((8, 16), (128,), "a2b2c2", P("c", ("a", "b"))),
]


@pytest.mark.parametrize("src,dst,mesh,spec", RESHAPES,
                         ids=[f"{s}->{d}-{m}-{p}" for s, d, m, p in RESHAPES])
def test_reshape(src, dst, mesh, spec):
  x = np.arange(int(np.prod(src)), dtype=np.float32).reshape(src)
  assert_partitioned_matches(lambda x: (x.reshape(dst) * 2, jnp.sin(x).reshape(dst)), (x,),
                             (spec,), mesh)


@pytest.mark.parametrize("mesh,spec", [
    ("x8", P("x")), ("a2b4", P("a", None, "b")), ("a2b2c2", P(None, None, ("a", "b", "c"))),
], ids=["x8", "a2b4", "a2b2c2"])
def test_squeeze_expand_dims(mesh, spec):
  def fn(x):
    return (jnp.squeeze(x, 1), jnp.expand_dims(x[:, 0], 0), lax.expand_dims(x, (0, 3)),
            x.reshape(8, 16)[:, None, :, None].squeeze((1, 3)))

  assert_partitioned_matches(fn, (randn(8, 1, 16),), (spec,), mesh)


@pytest.mark.parametrize("mesh,spec", [
    ("x8", P(None, "x")), ("a2b4", P("a", "b")), ("a2b4", P(None, ("a", "b"))),
    ("a2b2c2", P("a", "b", "c")), ("a2b2c2", P(None, ("c", "a"), "b")),
], ids=str)
def test_transpose(mesh, spec):
  def fn(x):
    return (x.transpose(2, 0, 1), jnp.swapaxes(x, 0, 2), x.reshape(4, 128).T,
            jnp.einsum("abc->cba", x) + 1)

  assert_partitioned_matches(fn, (randn(4, 8, 16),), (spec,), mesh)


@pytest.mark.parametrize("mesh,spec", SPECS_2D[::2], ids=_ids(SPECS_2D[::2]))
def test_rev(mesh, spec):
  fn = lambda x: (jnp.flip(x, 0), jnp.flip(x, (0, 1)), x[:, ::-1] + x)  # noqa: E731
  assert_partitioned_matches(fn, (randn(8, 16),), (spec,), mesh)


# --- dot_general ---------------------------------------------------------------------------------

MATMUL = [
    ("x8", P(), P()),
    ("x8", P("x"), P()),
    ("x8", P(None, "x"), P("x")),              # contraction on the sharded dims
    ("x8", P(None, "x"), P(None, "x")),        # contraction sharded on one side only
    ("a2b4", P("a", "b"), P("b")),
    ("a2b4", P("a", "b"), P(None, "b")),       # "b" wanted by two factors
    ("a2b4", P(("a", "b")), P("a", "b")),
    ("a2b2c2", P("a", ("b", "c")), P(("b", "c"), "a")),
    ("a2b2c2", P(ABC), P(None, ABC)),
    ("a2b2c2", P(None, ("c", "a")), P(("a", "c"), "b")),  # same axes, other order
]


@pytest.mark.parametrize("mesh,sx,sw", MATMUL, ids=_ids(MATMUL))
def test_matmul(mesh, sx, sw):
  assert_partitioned_matches(lambda x, w: x @ w, (randn(8, 16), randn(16, 8, seed=1)), (sx, sw),
                             mesh, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("mesh,sx,sw", MATMUL[2::3], ids=_ids(MATMUL[2::3]))
def test_matmul_out_specs(mesh, sx, sw):
  axes = [a for e in sx for a in ((e,) if isinstance(e, str) else e or ())]
  out = P(None, axes[-1])  # the minor axis of x moves to the result's column dim
  plan = assert_partitioned_matches(lambda x, w: jnp.tanh(x @ w),
                                    (randn(8, 16), randn(16, 8, seed=1)), (sx, sw), mesh,
                                    out_specs=out, rtol=1e-4, atol=1e-4)
  assert plan.out_specs == out


EINSUMS = [
    # (equation, shapes, mesh, specs)
    ("bij,bjk->bik", [(4, 8, 16), (4, 16, 8)], "a2b4", [P("a", "b"), P("a", None, "b")]),
    ("bij,bjk->bik", [(4, 8, 16), (4, 16, 8)], "a2b2c2", [P("a", None, ("b", "c")),
                                                          P("b", ("a", "c"))]),
    ("bij,bjk->bik", [(4, 8, 16), (4, 16, 8)], "x8", [P(None, "x"), P(None, None, "x")]),
    ("bij,bkj->bki", [(8, 4, 16), (8, 8, 16)], "a2b4", [P("b", None, "a"), P("a", "b")]),
    ("ij,ij->", [(8, 16), (8, 16)], "a2b4", [P("a", "b"), P("b", "a")]),
    ("ij,ij->", [(8, 16), (8, 16)], "x8", [P("x"), P("x")]),
    ("i,i->", [(16,), (16,)], "a2b2c2", [P(ABC), P(("a", "b"))]),
    ("i,j->ij", [(8,), (16,)], "a2b4", [P("b"), P("a")]),
    ("ij,j->i", [(8, 16), (16,)], "a2b2c2", [P("a", ("b", "c")), P("b")]),
    ("bhqd,bhkd->bhqk", [(2, 4, 8, 8), (2, 4, 8, 8)], "a2b2c2", [P("a", "b", "c"),
                                                                P("a", "b", None, "c")]),
    ("abc,cd->abd", [(2, 8, 16), (16, 8)], "a2b4", [P("a", None, "b"), P("b", "a")]),
]


@pytest.mark.parametrize("eq,shapes,mesh,specs", EINSUMS,
                         ids=[f"{e}-{m}-{k}" for k, (e, _, m, _) in enumerate(EINSUMS)])
def test_einsum(eq, shapes, mesh, specs):
  args = tuple(randn(*s, seed=k) for k, s in enumerate(shapes))
  assert_partitioned_matches(lambda *a: jnp.einsum(eq, *a), args, tuple(specs), mesh, rtol=1e-4,
                             atol=1e-4)


def test_integer_dot():
  fn = lambda a, b: (a @ b, lax.dot(a, b, preferred_element_type=jnp.int32))  # noqa: E731
  assert_partitioned_matches(fn, (ints(8, 16), ints(16, 8, seed=1)), (P("a", "b"), P("b", "a")),
                             "a2b4")


def _moves_as_much_as(fn, alone, args, specs, mesh, out_specs=None):
  """``fn`` and ``alone`` each match their unpartitioned selves, and ``fn`` moves no other bytes
  than ``alone``: what ``fn`` adds to ``alone`` is one value with it."""
  plan = assert_partitioned_matches(fn, args, specs, mesh, out_specs)
  single = assert_partitioned_matches(alone, args, specs, mesh, out_specs)
  assert plan.total_bytes == single.total_bytes, (plan.explain(), single.explain())


PRODUCT_DOTS = [
    # (equation, shape, specs, dtype)
    ("a,a->a", (2,), (P("a"), None), np.int32),
    ("ab,ab->ab", (8, 6), (P("a", "b"), P("b")), np.float32),
    ("abc,abc->abc", (5, 4, 3), (P("a", None, "c"), P(None, ("b", "c"))), jnp.bfloat16),
    ("a,a->a", (6,), (P(ABC), None), np.int8),
]


@pytest.mark.parametrize("commuted", [False, True], ids=["x*y", "y*x"])
@pytest.mark.parametrize("eq,shape,specs,dtype", PRODUCT_DOTS,
                         ids=[f"{e}-{np.dtype(d).name}" for e, _, _, d in PRODUCT_DOTS])
def test_dot_of_batch_dims_only_is_a_product(eq, shape, specs, dtype, commuted):
  """A dot whose dims are all batch dims, in order, is a multiply (XLA's simplifier makes it
  one, and its CSE merges it with an equal multiply, operands in either order): the two are one
  value, resharded once, and the plan is that of the multiply alone."""
  def fn(x, y, dot=True):
    product = y * x if commuted else x * y
    first = jnp.einsum(eq, x, y) if dot else x * y
    return jnp.argmax(first, axis=0), jnp.argmax(product, axis=0), first
  x = ints(*shape, low=-3, high=4).astype(dtype)
  y = ints(*shape, low=-3, high=4, seed=1).astype(dtype)
  out_specs = (None, None, P(*([None] * (len(shape) - 1)), "b"))
  _moves_as_much_as(fn, functools.partial(fn, dot=False), (x, y), specs, "a2b2c2", out_specs)


@pytest.mark.parametrize("eq", ["a,->a", ",a->a"])
def test_dot_by_a_scalar_is_a_product(eq):
  """``einsum('a,->a', x, s)`` is ``x * s`` (XLA's simplifier makes it one, and merges it with
  an equal multiply): one value, resharded once (the thorough property run, seed 48)."""
  def fn(x, s, dot=True):
    first = jnp.einsum(eq, *((x, s) if eq[0] == "a" else (s, x))) if dot else x * s
    return jnp.argmax(first, axis=0), jnp.argmax(x * s, axis=0), first
  _moves_as_much_as(fn, functools.partial(fn, dot=False), (ints(4, low=-3, high=4), np.int32(-2)),
                    (P("a"), None), "a2b2c2", (None, None, P("b")))


@pytest.mark.parametrize("name", ["mul", "add", "einsum", "eq"])
def test_commuted_operands_are_one_computation(name):
  """``x * y`` and ``y * x`` (``+``, ``==``, a batch-only einsum) are one value, as XLA's CSE
  merges them: resharded once, in the plan as in the compiled program."""
  op = {"mul": jnp.multiply, "add": jnp.add, "eq": jnp.equal,
        "einsum": functools.partial(jnp.einsum, "ab,ab->ab")}[name]
  _moves_as_much_as(lambda x, y: (op(x, y), op(y, x)), op, (randn(8, 6), randn(8, 6, seed=1)),
                    (P("a", "b"), P("b", "a")), "a2b4")


@pytest.mark.parametrize("dtype,preferred", [(np.float32, np.int32), (np.float32, jnp.bfloat16),
                                             (jnp.bfloat16, np.float16), (np.int8, np.int32)])
def test_dot_of_batch_dims_only_into_another_type(dtype, preferred):
  """A batch-only dot with another result type multiplies in its operands' type, as XLA's
  simplifier does, and is no multiply of converted operands (which truncates them first)."""
  x = (10 * randn(8, 6)).astype(dtype)
  y = (10 * randn(8, 6, seed=1)).astype(dtype)
  dn = (((), ()), ((0, 1), (0, 1)))
  assert_partitioned_matches(
      lambda x, y: (lax.dot_general(x, y, dn, preferred_element_type=preferred), x * y),
      (x, y), (P("a"), P("b")), "a2b4")


# --- reductions and scans ------------------------------------------------------------------------

REDUCTIONS = {
    "sum": jnp.sum, "max": jnp.max, "min": jnp.min,
    "prod": lambda x, axis: jnp.prod(1 + 0.1 * x, axis=axis),
    "mean": jnp.mean,
    "all": lambda x, axis: jnp.all(x > -1, axis=axis),
    "any": lambda x, axis: jnp.any(x > 1, axis=axis),
    "argmax": lambda x, axis: jnp.argmax(x, axis=axis),
    "argmin": lambda x, axis: jnp.argmin(x, axis=axis),
    "int_sum": lambda x, axis: jnp.sum((x * 4).astype(jnp.int32), axis=axis),
}
REDUCE_SPECS = [
    ("x8", P("x")), ("x8", P(None, "x")), ("a2b4", P("a", "b")), ("a2b4", P(("b", "a"))),
    ("a2b2c2", P("c", ("a", "b"))), ("a2b2c2", P(None, ABC)),
]


REDUCE_CASES = [(name, axis) for name in REDUCTIONS for axis in (0, 1, None, (0, 1))
                if not (name.startswith("arg") and isinstance(axis, tuple))]


@pytest.mark.parametrize("name,axis", REDUCE_CASES, ids=[f"{n}-{a}" for n, a in REDUCE_CASES])
def test_reduce(name, axis):
  x = randn(8, 16)
  k = list(REDUCTIONS).index(name) + (0 if axis is None else 1 if axis == (0, 1) else 2 + axis)
  for mesh, spec in (REDUCE_SPECS[k % 6], REDUCE_SPECS[(k + 3) % 6]):
    assert_partitioned_matches(lambda x: REDUCTIONS[name](x, axis=axis), (x,), (spec,), mesh,
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [np.int32, np.uint8, np.int8, np.uint32, np.bool_])
@pytest.mark.parametrize("rows,mesh,spec", [(8, "x8", P("x")), (13, "x8", P("x")),
                                            (7, "a2b4", P("a", "b"))])
def test_bitwise_and_or_reductions_of_integers(dtype, rows, mesh, spec):
  """reduce_or / reduce_and of integers combine bitwise (they were all-reduced as max / min,
  right for booleans only: [70 87 94] for [-1 -1 -1]); uneven padding is all bits set for and."""
  r = rng(0)
  x = (r.integers(-100, 100, (rows, 5)) if dtype != np.bool_ else
       r.integers(0, 2, (rows, 5))).astype(dtype)
  fn = lambda x: (jnp.bitwise_or.reduce(x, 0), jnp.bitwise_and.reduce(x, 0),  # noqa: E731
                  jnp.bitwise_or.reduce(x, 1), jnp.bitwise_and.reduce(x, axis=None))
  assert_partitioned_matches(fn, (x,), (spec,), mesh)


@pytest.mark.parametrize("dtype", [np.float32, jnp.bfloat16, np.float16])
@pytest.mark.parametrize("rows,mesh,spec", [(8, "x8", P("x")), (13, "x8", P("x")),
                                            (7, "a2b4", P("a", "b"))])
def test_max_and_min_over_a_split_dim_keep_a_nan(dtype, rows, mesh, spec):
  """A NaN on one device wins the max and min as in the unpartitioned reduce_max (XLA's CPU and
  GPU all-reduces drop it, and so does jax.jit's result); -inf, -0.0 and negated NaNs too."""
  x = randn(rows, 5)
  x[rows - 1, 0] = x[0, 1] = np.nan
  x[1, 4], x[2, 2], x[3, 3] = -np.nan, -np.inf, -0.0
  fn = lambda x: (x.max(0), x.min(0), x.max(1), x.min(axis=None), jnp.max(-x, 0))  # noqa: E731
  assert_partitioned_matches(fn, (x.astype(dtype),), (spec,), mesh)


@pytest.mark.parametrize("platform,dtype,width", [
    ("cpu", jnp.bfloat16, 4), ("cpu", jnp.float16, 2), ("cpu", jnp.float32, 4),
    ("gpu", jnp.bfloat16, 4), ("gpu", jnp.float16, 4), ("gpu", jnp.float32, 4)])
def test_a_float_extremum_all_reduce_is_priced_as_the_backend_runs_its_integers(
    platform, dtype, width):
  """The ordered integers a max over a split dim all-reduces are as wide as the float on the
  wire (XLA:CPU widens bfloat16 to 32 bits), except that XLA:GPU promotes 16-bit integer
  all-reduces to 32 bits: the plan prices each backend's width."""
  from spmd.partition.execution import ExecutionPlanner
  from spmd.partition.ir import Value
  from spmd.partition.sharding import TensorSharding
  from spmd.partition.wire import wire_for

  value = Value(jax.ShapeDtypeStruct((8, 16), jnp.dtype(dtype)))
  partial = TensorSharding(((), ()), ("x",), "max")
  steps = ExecutionPlanner({"x": 8}, wire_for(platform), {}).reshard(
      value, partial, TensorSharding.replicated(2))
  assert [(s.kind, s.bytes) for s in steps] == [("all-reduce", 8 * 16 * width)]


def test_reduce_rank3_keepdims():
  def fn(x):
    return (x.sum(axis=(0, 2), keepdims=True), x.max(axis=1), x.min(axis=(1, 2)),
            jnp.argmax(x, axis=2), jnp.argmin(x.reshape(4, -1), axis=1))

  x = randn(4, 8, 16)
  for mesh, spec in (("a2b2c2", P("a", "b", "c")), ("a2b4", P(None, "a", "b")),
                     ("x8", P(None, None, "x"))):
    assert_partitioned_matches(fn, (x,), (spec,), mesh)


def test_complex_reductions_order_lexicographically():
  """max / min of complex values compare real parts, then imaginary ones (``lax.max``'s order),
  which no backend's all-reduce takes (XLA's own partitioner fails on it: "Unsupported reduction
  computation"): the real parts' extremum, then the imaginary parts' among its holders. Real
  parts tie across shards here, so the second all-reduce decides."""
  r = np.random.default_rng(3)
  def complex_ints(*shape):
    return (r.integers(-2, 3, shape) + 1j * r.integers(-9, 10, shape)).astype(np.complex64)

  def fn(z):
    return jnp.max(z, 0), jnp.min(z, 1), jnp.sum(z, 0), jnp.prod(z[:, :2], 0)

  for mesh, spec, shape in (("a2b4", P("a", "b"), (8, 16)), ("x8", P("x"), (8, 4)),
                            ("a2b4", P("b", "a"), (6, 10)), ("a2b2c2", P(ABC), (12, 3))):
    assert_partitioned_matches(fn, (complex_ints(*shape),), (spec,), mesh)
  plan = assert_partitioned_matches(lambda z: jnp.max(z, 0), (complex_ints(8, 16),), P("a"),
                                    "a2b4", P())
  assert [(c.kind, c.bytes) for c in plan.collectives] == [("all-reduce", 128)]  # 16 x c64


CUMULATIVE = {
    "cumsum": jnp.cumsum,
    "cumprod": lambda x, axis: jnp.cumprod(1 + 0.1 * x, axis=axis),
    "cummax": lambda x, axis: lax.cummax(x, axis=axis),
    "cummin": lambda x, axis: lax.cummin(x, axis=axis, reverse=True),
    "int_cumsum": lambda x, axis: jnp.cumsum((x * 4).astype(jnp.int32), axis=axis),
    "logcumsumexp": lambda x, axis: lax.cumlogsumexp(x, axis=axis),
}


@pytest.mark.parametrize("axis", [0, 1])
@pytest.mark.parametrize("name", list(CUMULATIVE))
def test_cumulative(name, axis):
  x = randn(8, 16)
  k = list(CUMULATIVE).index(name) + axis
  for mesh, spec in (REDUCE_SPECS[k % 6], REDUCE_SPECS[(k + 2) % 6]):
    assert_partitioned_matches(lambda x: CUMULATIVE[name](x, axis=axis), (x,), (spec,), mesh,
                               rtol=1e-5, atol=1e-5)


# --- iota, slicing, padding, concatenation -------------------------------------------------------

@pytest.mark.parametrize("mesh,spec", SPECS_2D[1::2], ids=_ids(SPECS_2D[1::2]))
def test_iota(mesh, spec):
  def fn(x):
    rows = lax.broadcasted_iota(jnp.int32, (8, 16), 0)
    cols = lax.broadcasted_iota(jnp.float32, (8, 16), 1)
    return (x + jnp.arange(16), x * cols, jnp.where(rows > cols, x, -x), jnp.arange(8) * 2,
            x[jnp.arange(8) % 3])

  assert_partitioned_matches(fn, (randn(8, 16),), (spec,), mesh)


@pytest.mark.parametrize("mesh,spec", SPECS_2D[::2] + SPECS_2D[5:6], ids=_ids(
    SPECS_2D[::2] + SPECS_2D[5:6]))
def test_slice(mesh, spec):
  def fn(x):
    return (x[2:6], x[:, 1:15:2], x[1:, 3:], lax.slice(x, (0, 4), (8, 12)), x[::2, ::4],
            x[3], x[:, -1])

  assert_partitioned_matches(fn, (randn(8, 16),), (spec,), mesh)


@pytest.mark.parametrize("mesh,spec", [
    ("x8", P(None, None, "x")), ("a2b4", P(None, "a", "b")), ("a2b4", P(None, None, ("a", "b"))),
    ("a2b2c2", P("a", "b", "c")),
], ids=str)
def test_strided_slice_of_sharded_dims(mesh, spec):
  def fn(x):
    return x[1:3, ::2, 4:12], x[:, 1::2], x[:, :, 1:15:3], x[:, 2:7:2, ::5]

  assert_partitioned_matches(fn, (randn(4, 8, 16),), (spec,), mesh)


@pytest.mark.parametrize("mesh,spec", SPECS_2D[1::2], ids=_ids(SPECS_2D[1::2]))
def test_dynamic_slice(mesh, spec):
  def fn(x, i, j):
    return (lax.dynamic_slice(x, (i, 0), (4, 16)), lax.dynamic_slice(x, (i, j), (2, 8)),
            lax.dynamic_slice_in_dim(x, j, 4, axis=1), lax.dynamic_index_in_dim(x, i, 0, False),
            x[i], lax.dynamic_slice(x, (i, 20), (4, 8)))  # out-of-range start is clamped

  assert_partitioned_matches(fn, (randn(8, 16), np.int32(3), np.int32(5)), (spec, P(), P()), mesh)


@pytest.mark.parametrize("mesh,sx,su", [
    ("x8", P("x"), P()), ("x8", P(None, "x"), P(None, "x")), ("a2b4", P("a", "b"), P(None, "b")),
    ("a2b4", P(("a", "b")), P("b", "a")), ("a2b2c2", P("c", ("a", "b")), P("a", "b")),
], ids=str)
def test_dynamic_update_slice(mesh, sx, su):
  def fn(x, u, i, j):
    return (lax.dynamic_update_slice(x, u, (i, 0)),
            lax.dynamic_update_slice(x, u[:2, :8], (i, j)),
            lax.dynamic_update_slice_in_dim(x, u[:, :4] * 2, j, axis=1),
            x.at[i].set(u[0]))

  assert_partitioned_matches(fn, (randn(8, 16), randn(4, 16, seed=1), np.int32(3), np.int32(6)),
                             (sx, su, P(), P()), mesh)


@pytest.mark.parametrize("start", [-2, 3, 8])
def test_dynamic_update_slice_along_a_sharded_dim_keeps_it_sharded(start):
  """Each device writes the update's rows that land in its block (the start clamped), as XLA
  does (DynamicUpdateSliceAlongPartitionedDimension2): no collective for an update replicated
  along the dim, one dim or two (uneven: only the result is gathered, as JAX arrays hold no
  uneven shards). The operand used to be gathered whole."""
  x = np.arange(8 * 7 * 2, dtype=np.int32).reshape(8, 7, 2)
  u = -np.arange(3 * 7 * 2, dtype=np.int32).reshape(3, 7, 2)
  plan = assert_partitioned_matches(lambda x, u, i: lax.dynamic_update_slice(x, u, (i, 0, 0)),
                                    (x, u, np.int32(start)), (P("x"), P(), P()), "x8", P("x"))
  assert plan.collectives == ()
  dus2 = lambda y, u, i: lax.dynamic_update_slice(y, u, (i, i - 1))
  plan = assert_partitioned_matches(dus2, (randn(10, 8), randn(3, 4, seed=1), np.int32(start)),
                                    (P("a", "b"), P(), P()), "a2b4", P("a", "b"))
  assert plan.collectives == ()
  plan = assert_partitioned_matches(dus2, (randn(10, 9), randn(3, 4, seed=1), np.int32(start)),
                                    (P("a", "b"), P(), P()), "a2b4")
  assert {c.primitive for c in plan.collectives} <= {"output"}  # only the uneven result's gather


@pytest.mark.parametrize("mesh,sx,sy", PAIRS_2D, ids=_ids(PAIRS_2D))
def test_concatenate(mesh, sx, sy):
  def fn(x, y):
    return (jnp.concatenate([x, y], 0), jnp.concatenate([x, y, x], 1),
            jnp.concatenate([x[:3], y[5:]], 0), jnp.stack([x, y], 1))

  assert_partitioned_matches(fn, (randn(8, 16), randn(8, 16, seed=1)), (sx, sy), mesh)


@pytest.mark.parametrize("mesh,spec", SPECS_2D[::2] + SPECS_2D[3:4],
                         ids=_ids(SPECS_2D[::2] + SPECS_2D[3:4]))
def test_pad(mesh, spec):
  def fn(x):
    return (jnp.pad(x, ((1, 2), (0, 0))), jnp.pad(x, ((0, 0), (3, 5)), constant_values=7.0),
            lax.pad(x, 0.5, ((1, 0, 1), (-2, 1, 0))), jnp.pad(x, 2, mode="edge"),
            lax.pad(x, x[0, 0], ((0, 0, 0), (0, -4, 1))))

  assert_partitioned_matches(fn, (randn(8, 16),), (spec,), mesh)


@pytest.mark.parametrize("mesh,spec", [("x8", P(None, "x", None)), ("a2b4", P("a", "b", None))],
                         ids=str)
def test_pad_of_a_one_row_dim(mesh, spec):
  """A sharded dim of one row (uneven: the first shard holds it) padded to many, as the
  gradient of ``x[:, 0]`` is: each shard pads its own block of the result."""
  def fn(x):
    row = spmd.annotate(x[:, None], spec)
    return (jnp.pad(row, ((0, 0), (0, 16), (0, 0))),
            jnp.pad(row, ((0, 0), (3, 9), (0, 0)), constant_values=2.0))

  assert_partitioned_matches(fn, (randn(8, 16),), (P(),), mesh)


@pytest.mark.parametrize("mesh,spec", SPECS_2D[::2], ids=_ids(SPECS_2D[::2]))
def test_tile(mesh, spec):
  """Dims repeated from one row are broadcasts (split like any dim); others whole."""
  def fn(x):
    return jnp.tile(x, (2, 1)), jnp.tile(x[:1], (8, 1)) * x, jnp.tile(x[:, :1], (3, 1, 16)) + x

  assert_partitioned_matches(fn, (randn(8, 16),), (spec,), mesh)


@pytest.mark.parametrize("mesh,spec", SPECS_2D[1::2], ids=_ids(SPECS_2D[1::2]))
def test_split(mesh, spec):
  def fn(x):
    a, b = jnp.split(x, 2, axis=0)
    c, d, e = jnp.split(x, [3, 5], axis=1)
    return a * 2, b, c, d + 1, e, jnp.array_split(x, 3, axis=1)

  assert_partitioned_matches(fn, (randn(8, 16),), (spec,), mesh)


def test_split_of_a_sharded_dim_keeps_it_sharded():
  """A split is one slice per piece, as JAX lowers it: each piece of a sharded dim is a halo of
  the rows it needs (collective-permutes), sharded as jax.jit returns it; the split's own rule
  gathered the dim (256 B per device) and returned the pieces replicated along it."""
  plan = assert_partitioned_matches(lambda x: jnp.split(x, 2, axis=1), (randn(8, 16),),
                                    P("a", "b"), "a2b4", like_jit=True)
  assert plan.bytes_by_kind() == {"collective-permute": 128}, plan.explain()


def test_concatenate_of_a_broadcast_zero_and_a_piece():
  """The gradient of a split whose other pieces go unused concatenates broadcasts of a literal
  zero around the used piece's cotangent; looking for a roll, roll.py read the broadcast's literal
  operand as an array ('Literal' object has no attribute 'shape')."""
  def fn(x):
    return jax.grad(lambda x: (jnp.split(x, 4, axis=1)[1] ** 2).sum())(x), jnp.concatenate(
        [jnp.zeros((8, 4)), x[:, :12]], axis=1)

  assert_partitioned_matches(fn, (randn(8, 16),), P("a", "b"), "a2b4", like_jit=True)


def test_program_order_call_is_inlined():
  """jax 0.11's ``jax.experimental.overlap.program_order`` binds a call primitive
  (``program_order``) that JAX lowers as a plain call under jit: its body is partitioned with
  the ops around it."""
  overlap = pytest.importorskip("jax.experimental.overlap")
  if not hasattr(overlap, "program_order"):
    pytest.skip(f"jax {jax.__version__} has no program_order")

  def fn(x, w):
    h = overlap.program_order(lambda a, b: jnp.tanh(a @ b), enforce=False)(x, w)
    return h.sum(1)

  assert_partitioned_matches(fn, (randn(8, 16), randn(16, 8, seed=1)), (P("a", "b"), P("b")),
                             "a2b4", like_jit=True)


# --- gather and scatter --------------------------------------------------------------------------

GATHER = [
    # (mesh, spec of x [8, 16], spec of idx [8])
    ("x8", P(), P()),
    ("x8", P("x"), P()),
    ("x8", P(None, "x"), P("x")),
    ("a2b4", P("a", "b"), P("b")),
    ("a2b4", P(("b", "a")), P("a")),
    ("a2b2c2", P("a", ("b", "c")), P(("b", "c"))),
    ("a2b2c2", P(ABC), P(ABC)),
]


@pytest.mark.parametrize("mesh,sx,si", GATHER, ids=_ids(GATHER))
def test_gather(mesh, sx, si):
  def fn(x, idx):
    return (x[idx], jnp.take(x, idx, axis=1), x[idx, idx], x[:, idx[:4]], x[-idx + 1],
            jnp.take(x, idx + 20, axis=0, mode="clip"), x.at[idx].get(mode="fill", fill_value=-1),
            x[idx, 3])

  idx = np.array([3, 0, 7, 7, 1, 5, 2, 6], np.int32)
  assert_partitioned_matches(fn, (randn(8, 16), idx), (sx, si), mesh)


TAKE_ALONG = [
    # (mesh, spec of x [8, 16], spec of idx [8, 16])
    ("x8", P("x"), P()),
    ("x8", P(None, "x"), P("x")),
    ("a2b4", P("a", "b"), P("b", "a")),
    ("a2b2c2", P("a", ("b", "c")), P(("b", "c"), "a")),
]


@pytest.mark.parametrize("mesh,sx,si", TAKE_ALONG, ids=_ids(TAKE_ALONG))
def test_take_along_axis(mesh, sx, si):
  def fn(x, idx):
    return (jnp.take_along_axis(x, idx, axis=1),
            jnp.take_along_axis(x[:, :4], idx[:, :4] % 8, axis=0),
            jnp.take_along_axis(x, jnp.argsort(x, axis=1), axis=1))

  assert_partitioned_matches(fn, (randn(8, 16), ints(8, 16, high=16)), (sx, si), mesh)


EMBED = [
    # (mesh, table [32, 16] sharded on the vocab dim, ids [4, 8])
    ("x8", P("x"), P()),
    ("x8", P("x"), P(None, "x")),
    ("a2b4", P("b", "a"), P("a")),
    ("a2b4", P(("a", "b")), P("a", "b")),
    ("a2b2c2", P(("a", "b"), "c"), P("c", ("a", "b"))),
    ("a2b2c2", P(ABC), P()),
]


@pytest.mark.parametrize("mesh,st,si", EMBED, ids=_ids(EMBED))
def test_embedding_lookup(mesh, st, si):
  def fn(table, ids):
    emb = table[ids]
    return emb, jnp.take(table, ids, axis=0).sum(-1), emb @ table.T

  assert_partitioned_matches(fn, (randn(32, 16), ints(4, 8, high=32)), (st, si), mesh, rtol=1e-4,
                             atol=1e-4)


@pytest.mark.parametrize("mesh,sx,si", GATHER[2::2], ids=_ids(GATHER[2::2]))
def test_batched_gather_scatter(mesh, sx, si):
  """vmap of indexing: gather / scatter with operand and index batching dims."""
  def fn(x, idx):
    return (jax.vmap(lambda r, j: r[j])(x, idx), jax.vmap(lambda r, j: r.at[j].add(1.0))(x, idx),
            jax.vmap(lambda r, j: lax.dynamic_slice(r, (j,), (4,)))(x, idx[:, 0]),
            jax.vmap(lambda r, j, u: r.at[j].set(u))(x, idx, x[:, :4] * 2))

  idx = np.stack([np.array([3, 0, 7, 12], np.int32) + k for k in range(8)])
  assert_partitioned_matches(fn, (randn(8, 16), idx), (sx, si), mesh)


WHOLE_SPAN = [
    # (mesh, spec of x [4, 16], spec of the starts [3])
    ("x8", P(None, "x"), P()),
    ("x8", P(None, "x"), P("x")),
    ("a2b4", P("a", "b"), P()),
    ("a2b4", P(None, ("b", "a")), P("a")),
    ("a2b2c2", P("c", ("a", "b")), P("b")),
]


@pytest.mark.parametrize("mesh,sx,si", WHOLE_SPAN, ids=_ids(WHOLE_SPAN))
def test_vmapped_slices_spanning_a_split_dim(mesh, sx, si):
  """vmap of ``x[k]``, ``dynamic_slice`` and ``dynamic_update_slice`` over whole rows: a gather
  (scatter) indexing the split column dim too, whose slice is the whole dim (start 0, clamped),
  runs locally on each device's columns. Each device but the first masked its columns away as
  rows it does not own (wrong values, nothing moved)."""
  def fn(x, k):
    rows = x[:3] + 100
    return (jax.vmap(lambda j: x[j])(k), jax.vmap(lambda j: lax.dynamic_slice(x, (j, 3), (2, 16)))(k),
            jax.vmap(lambda j: lax.dynamic_slice(x, (j + 1, 5), (1, 16)))(k),
            jax.vmap(lambda j, r: lax.dynamic_update_slice(x, r[None], (j, 2)))(k, rows),
            jax.vmap(lambda j: x.at[j].get(mode="fill", fill_value=-1))(k + 2))

  assert_partitioned_matches(fn, (randn(4, 16), np.array([3, 0, 1], np.int32)), (sx, si), mesh)


VMAPPED_ROWS = {  # name: (fn, x's spec, how many indices)
    "row": (lambda x, k: jax.vmap(lambda j: x[j])(k), P("x", None), 4),
    "row_of_each_row": (lambda x, k: jax.vmap(lambda r, j: r[j])(x, k), P(None, "x"), 16),
    "column": (lambda x, k: jax.vmap(lambda j: x[:, j])(k), P(None, "x"), 4),
    "dynamic_slice": (lambda x, k: jax.vmap(lambda j: lax.dynamic_slice(x, (j, 2), (1, 3)))(k),
                      P("x", None), 4),
    "gradient": (lambda x, k: jax.grad(lambda x: (jax.vmap(lambda j: x[j])(k) ** 2).sum())(x),
                 P("x", None), 4),
}


@pytest.mark.parametrize("name", list(VMAPPED_ROWS))
def test_vmapped_rows_at_indices_are_gathered_from_their_owners(name):
  """``jax.vmap`` of ``x[k]`` (or a slice of 1 row) keeps the indexed dim as a dim of 1: a row
  at an index all the same, summed from the device that owns it, as XLA does (the whole operand
  was gathered: 1,024 B for f32[16,16] on 8 devices, against XLA's 256 B for 4 rows)."""
  fn, spec, count = VMAPPED_ROWS[name]
  for n in (16, 10):  # even, uneven
    k = np.array([3, 0, 15, 7, 7, 2, 9, 1, 4, 12, 5, 6, 8, 11, 10, 13], np.int32)[:count] % n
    no_more_than_xla(fn, (randn(n, 16) if spec[0] else randn(16, n), k), (spec, P()), "x8")


@pytest.mark.parametrize("mesh,spec", [("x8", P("x")), ("a2b4", P(("a", "b"))), ("a2b4", P("b"))])
def test_searchsorted_of_a_split_sorted_array(mesh, spec):
  """jnp.searchsorted's binary search takes one row of the sorted array at an index each step
  (a gather keeping it as a dim of 1): summed from its owner, as XLA does (128 / 32 B before)."""
  a = np.sort(randn(32))
  for side in ("left", "right"):
    no_more_than_xla(lambda a, v: jnp.searchsorted(a, v, side=side),
                     (a, np.linspace(-2, 2, 8, dtype=np.float32)), (spec, P()), mesh)


def test_gather_int_and_bool_operands():
  def fn(x, b, idx):
    return x[idx], b[idx], jnp.take(b, idx, axis=1)

  for mesh, specs in (("x8", (P("x"), P("x"), P())), ("a2b4", (P("b", "a"), P(("a", "b")),
                                                                P("a")))):
    indices = np.array([3, 0, 7, 7, 1, 5, 2, 6], np.int32)
    assert_partitioned_matches(fn, (ints(8, 16), bools(8, 16), indices), specs, mesh)


SCATTER = [
    # (mesh, spec of x [8, 16], spec of updates [4, 16])
    ("x8", P(), P()),
    ("x8", P("x"), P()),
    ("x8", P(None, "x"), P(None, "x")),
    ("a2b4", P("a", "b"), P("b", "a")),
    ("a2b4", P(("a", "b")), P(None, ("a", "b"))),
    ("a2b2c2", P("a", ("b", "c")), P(("b", "c"))),
    ("a2b2c2", P(ABC), P("c", "a")),
]


@pytest.mark.parametrize("mesh,sx,su", SCATTER, ids=_ids(SCATTER))
def test_scatter(mesh, sx, su):
  unique = np.array([6, 1, 3, 0], np.int32)
  dup = np.array([2, 5, 2, 7], np.int32)

  def fn(x, u, unique, dup):
    return (x.at[unique].set(u), x.at[dup].add(u), x.at[:, unique].set(u[:, :8].T),
            x.at[:, dup].add(u[:, 8:].T), x.at[dup, unique].add(u[:, 0]),
            x.at[unique].mul(u), x.at[dup].max(u), x.at[dup].min(u),
            x.at[unique + 10].set(u, mode="drop"), x.at[-unique - 1].add(u))

  assert_partitioned_matches(fn, (randn(8, 16), randn(4, 16, seed=1), unique, dup),
                             (sx, su, P(), P()), mesh)


@pytest.mark.parametrize("mesh,sx,su", SCATTER[1::3], ids=_ids(SCATTER[1::3]))
def test_scatter_int(mesh, sx, su):
  dup = np.array([2, 5, 2, 7], np.int32)
  fn = lambda x, u, d: (x.at[d].add(u), x.at[d[:2] + 1].set(u[:2]))  # noqa: E731
  assert_partitioned_matches(fn, (ints(8, 16), ints(4, 16, seed=1), dup), (sx, su, P()), mesh)


SCATTER_EXTREMA = {  # (fn, args, specs, mesh): updates split like their indices
    "segment_max": (lambda d, s: jax.ops.segment_max(d, s, num_segments=6),
                    (randn(16, 8), indices(6, 16)), (P("a", "b"), P("a")), "a2b4"),
    "max_into_a_replicated_operand": (lambda x, i, u: x.at[i].max(u),
                                      (randn(10, 4), indices(10, 16), randn(16, 4, seed=1)),
                                      (P(), P("x"), P("x")), "x8"),
    "min_over_one_axis_of_two": (lambda x, i, u: x.at[i].min(u),
                                 (randn(10, 4), indices(10, 16), randn(16, 4, seed=1)),
                                 (P(), P("a"), P("a")), "a2b4"),
    "segment_min_uneven": (lambda d, s: jax.ops.segment_min(d, s, num_segments=5),
                           (randn(14, 3), indices(5, 14)), (P("x"), P("x")), "x4"),
    "int32_operand_split_too": (lambda x, i, u: x.at[i].max(u),
                                (ints(8, 4), indices(8, 8), ints(8, 4, seed=1)),
                                (P(None, "c"), P(("a", "b")), P(("a", "b"), "c")), "a2b2c2"),
    "vmapped_with_batching_dims": (jax.vmap(lambda x, i, u: x.at[i].max(u)),
                                   (randn(4, 8, 4), indices(8, 4, 6), randn(4, 6, 4, seed=1)),
                                   (P("a", "b"), P("a", "c"), P("a", "c")), "a2b2c2"),
    "grad_of_segment_max": (jax.grad(lambda d: jax.ops.segment_max(
        d, jnp.arange(16) // 3, num_segments=6).sum()), (randn(16, 2),), (P("x"),), "x8"),
    "bool": (lambda x, i, u: x.at[i].max(u), (np.zeros((10, 4), bool), indices(10, 16),
                                              randn(16, 4, seed=1) > 0), (P(), P("x"), P("x")),
             "x8"),
    "all_below_the_operand": (lambda x, i, u: x.at[i].max(u),
                              (np.full((10, 4), -100.0, np.float32), indices(10, 16),
                               -np.abs(randn(16, 4, seed=1))), (P(), P("x"), P("x")), "x8"),
    "bfloat16_min": (lambda x, i, u: x.at[i].min(u),
                     (randn(10, 4).astype(jnp.bfloat16), indices(10, 16),
                      randn(16, 4, seed=1).astype(jnp.bfloat16)), (P(), P("x"), P("x")), "x8"),
}


@pytest.mark.parametrize("name", SCATTER_EXTREMA)
def test_scatter_max_and_min_of_split_updates_combine_by_max_and_min(name):
  """Each device scatters its part of the updates into the operand, and the results combine by
  an all-reduce max (min), as XLA partitions them (the updates and indices were gathered whole:
  segment_max of f32[16,8] 192 B, XLA 48 B)."""
  fn, args, specs, mesh = SCATTER_EXTREMA[name]
  no_more_than_xla(fn, args, specs, mesh)


def _embedding_loss(table, tokens, w):
  return jnp.sum(jnp.tanh(table[tokens] @ w))


SMALL_UPDATES = {  # (fn, args, specs, mesh, the result's bytes): updates and indices both split
    "add": (lambda x, i, u: x.at[i].add(u), (randn(16, 8), indices(16, 4), randn(4, 8, seed=1)),
            (P(), P(), P("x")), "x8", 512),
    "subtract": (lambda x, i, u: x.at[i].subtract(u),
                 (randn(16, 8), indices(16, 4), randn(4, 8, seed=1)), (P(), P(), P("x")), "x8",
                 512),
    "segment_sum_uneven": (lambda d, s: jax.ops.segment_sum(d, s, num_segments=64),
                           (randn(6, 8), indices(64, 6)), (P("x"), P("x")), "x4", 2048),
    "embedding_gradient": (jax.grad(_embedding_loss),
                           (randn(512, 64), indices(512, 8, 8), randn(64, 64, seed=1)),
                           (P(), P("x"), P()), "x8", 131072),
    "embedding_gradient_2d": (jax.grad(_embedding_loss),
                              (randn(512, 64), indices(512, 8, 8), randn(64, 64, seed=1)),
                              (P(None, "b"), P("a"), P("b", None)), "a2b4", 32768),
}


@pytest.mark.parametrize("name", SMALL_UPDATES)
def test_a_scatter_gathers_updates_smaller_than_its_result(name):
  """Updates split in every operand holding them (the tokens' rows of an embedding's gradient,
  whose tokens are split over the batch) are gathered and applied on every device where they
  are smaller than the result, rather than each device's share summed over the whole result,
  which XLA all-reduces (embedding gradient on x8: 16,640 B, XLA 131,072 B)."""
  fn, args, specs, mesh, result_bytes = SMALL_UPDATES[name]
  plan = no_more_than_xla(fn, args, specs, mesh)
  assert plan.total_bytes < result_bytes // 2, plan.explain()


@pytest.mark.parametrize("mode", [lax.GatherScatterMode.CLIP,
                                  lax.GatherScatterMode.PROMISE_IN_BOUNDS])
@pytest.mark.parametrize("mesh,sx", [("x8", P("x")), ("a2b4", P("a", "b")), ("a2b4", P("b"))])
def test_scatter_of_windows_clamped_along_an_indexed_dim(mesh, sx, mode):
  """Rows 3..15 of indexed rows (x.at[i, 3:] is such a scatter, and the gradient of x[i, 3:]):
  the start along the windowed dim is clamped by the window's length, not the dim's (which
  clamped it to 0 where the indexed rows were split: wrong values)."""
  dn = lax.ScatterDimensionNumbers(update_window_dims=(1,), inserted_window_dims=(0,),
                                   scatter_dims_to_operand_dims=(0, 1))
  rows = np.array([[5, 3], [0, 3], [2, 3], [7, 2]], np.int32)
  i = np.array([5, 0, 2, 2, 1])

  def fn(x, u, rows):
    return (lax.scatter_add(x, rows, u, dn, mode=mode),
            jax.grad(lambda x: jnp.sum(x[i, 3:] ** 2) + jnp.sum(x * x))(x))

  assert_partitioned_matches(fn, (randn(8, 16), randn(4, 13, seed=1), rows), (sx, P(), P()),
                             mesh)


# --- sort and top_k ------------------------------------------------------------------------------

@pytest.mark.parametrize("mesh,spec", SPECS_2D[1:], ids=_ids(SPECS_2D[1:]))
def test_sort(mesh, spec):
  def fn(x, i):
    keys, vals = lax.sort((x[:, :8], i[:, :8]), dimension=1, num_keys=1)
    return (jnp.sort(x, axis=0), jnp.sort(x, axis=1), jnp.argsort(x, axis=0),
            jnp.argsort(-x, axis=1), jnp.sort(i, axis=1), keys, vals,
            jnp.argsort(i, axis=0, stable=True), jnp.sort(x, axis=None))

  assert_partitioned_matches(fn, (randn(8, 16), ints(8, 16, high=5)), (spec, spec), mesh)


@pytest.mark.parametrize("mesh,spec", SPECS_2D[::2] + SPECS_2D[5:6],
                         ids=_ids(SPECS_2D[::2] + SPECS_2D[5:6]))
def test_top_k(mesh, spec):
  def fn(x):
    v, i = lax.top_k(x, 3)
    w, j = lax.top_k(x.T, 2)
    return v, i, w * 2, j, v.sum(-1)

  assert_partitioned_matches(fn, (randn(8, 16),), (spec,), mesh)


def test_a_primitive_listed_replicated_runs_replicated():
  """ragged_dot_general is in catalog.REPLICATED: its operand is gathered and it runs whole on
  every device, the plan warns, and the gather is what the compiled program moves."""
  def f(x, w):
    return lax.ragged_dot(x * 2, w, jnp.array([3, 5], jnp.int32)) + 1
  plan = assert_partitioned_matches(f, (randn(8, 16), randn(2, 16, 4, seed=1)),
                                    (P("x", None), P()), "x8", replicated=("ragged_dot_general",))
  assert [c.kind for c in plan.collectives] == ["all-gather"], plan.explain()


# --- convolution and windows ---------------------------------------------------------------------

CONV_NHWC = [
    # (mesh, spec of x [N=8, H=8, W=8, C=8], spec of kernel [3, 3, I=8, O=8])
    ("x8", P(), P()),
    ("x8", P("x"), P()),
    ("x8", P(None, "x"), P()),
    ("x8", P(None, None, None, "x"), P(None, None, None, "x")),
    ("a2b4", P("a", "b"), P(None, None, None, "b")),
    ("a2b4", P("a", None, None, "b"), P(None, None, "b")),
    ("a2b2c2", P("a", "b", "c"), P(None, None, None, ("a", "b"))),
    ("a2b2c2", P(("a", "b"), None, None, "c"), P(None, None, "c", "a")),
]


@pytest.mark.parametrize("padding", ["SAME", "VALID"])
@pytest.mark.parametrize("mesh,sx,sk", CONV_NHWC, ids=_ids(CONV_NHWC))
def test_conv_nhwc(mesh, sx, sk, padding):
  dn = ("NHWC", "HWIO", "NHWC")

  def fn(x, k):
    y = lax.conv_general_dilated(x, k, (1, 1), padding, dimension_numbers=dn)
    s = lax.conv_general_dilated(x, k, (2, 2), padding, dimension_numbers=dn)
    d = lax.conv_general_dilated(x, k, (1, 1), padding, rhs_dilation=(2, 1),
                                 dimension_numbers=dn)
    return y, s, d

  assert_partitioned_matches(fn, (randn(8, 8, 8, 8), randn(3, 3, 8, 8, seed=1)), (sx, sk), mesh,
                             rtol=1e-4, atol=1e-4)


CONV_NCHW = [
    # (mesh, spec of x [N=8, C=4, H=8, W=8], spec of kernel OIHW [8, I, 3, 3])
    ("x8", P("x"), P()),
    ("x8", P(None, None, "x"), P("x")),
    ("a2b4", P("a", "b"), P("b")),
    ("a2b4", P(None, "a", None, "b"), P(("a", "b"))),
    ("a2b2c2", P("a", None, "b", "c"), P("c", None)),
]


@pytest.mark.parametrize("mesh,sx,sk", CONV_NCHW, ids=_ids(CONV_NCHW))
def test_conv_nchw_grouped(mesh, sx, sk):
  dn = ("NCHW", "OIHW", "NCHW")

  def fn(x, k, k2, kd):
    plain = lax.conv_general_dilated(x, k, (2, 2), "SAME", dimension_numbers=dn)
    grouped = lax.conv_general_dilated(x, k2, (1, 1), "VALID", dimension_numbers=dn,
                                       feature_group_count=2)
    depthwise = lax.conv_general_dilated(x, kd, (2, 1), ((1, 0), (2, 2)), dimension_numbers=dn,
                                         feature_group_count=4)
    pointwise = lax.conv_general_dilated(x, k[:, :, :1, :1], (1, 1), "VALID",
                                         dimension_numbers=dn)
    return plain, grouped, depthwise, pointwise

  args = (randn(8, 4, 8, 8), randn(8, 4, 3, 3, seed=1), randn(8, 2, 3, 3, seed=2),
          randn(8, 1, 2, 2, seed=3))
  assert_partitioned_matches(fn, args, (sx, sk, sk, sk), mesh, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("mesh,sx,sk", CONV_NHWC[1::2] + CONV_NHWC[2:3],
                         ids=_ids(CONV_NHWC[1::2] + CONV_NHWC[2:3]))
def test_conv_transpose_and_batch_groups(mesh, sx, sk):
  dn = ("NHWC", "HWIO", "NHWC")

  def fn(x, k):
    transposed = lax.conv_transpose(x, k, (2, 2), "SAME", dimension_numbers=dn)
    dilated = lax.conv_general_dilated(x, k, (1, 1), ((1, 1), (2, 0)), lhs_dilation=(2, 2),
                                       dimension_numbers=dn)
    # batch-grouped (as in the kernel gradient of a grouped conv): 8 images in 2 groups
    grouped = lax.conv_general_dilated(x, k, (1, 1), "SAME", dimension_numbers=dn,
                                       batch_group_count=2)
    return transposed, dilated, grouped

  assert_partitioned_matches(fn, (randn(8, 8, 8, 8), randn(3, 3, 8, 8, seed=1)), (sx, sk), mesh,
                             rtol=1e-4, atol=1e-4)


POOL = [
    ("x8", P("x")),
    ("x8", P(None, "x")),
    ("a2b4", P("a", None, "b")),
    ("a2b4", P(None, None, None, ("a", "b"))),
    ("a2b2c2", P("a", "b", "c")),
    ("a2b2c2", P(ABC)),
]


@pytest.mark.parametrize("mesh,spec", POOL, ids=_ids(POOL))
def test_pooling(mesh, spec):
  def fn(x):
    return (nn.max_pool(x, (2, 2), strides=(2, 2)), nn.avg_pool(x, (3, 3), padding="SAME"),
            nn.max_pool(x, (3, 2), strides=(1, 2), padding="SAME"),
            lax.reduce_window(x, jnp.inf, lax.min, (1, 2, 2, 1), (1, 1, 1, 1), "VALID"),
            lax.reduce_window(x, 0.0, lax.add, (1, 1, 1, 4), (1, 1, 1, 4), "VALID"),
            # not a known monoid: the generic reduce_window primitive
            lax.reduce_window(x, 0.0, lambda a, b: a + b, (1, 2, 1, 1), (1, 2, 1, 1), "VALID"))

  assert_partitioned_matches(fn, (randn(8, 8, 8, 8),), (spec,), mesh)


@pytest.mark.parametrize("mesh,spec", POOL[::2] + POOL[3:4], ids=_ids(POOL[::2] + POOL[3:4]))
def test_max_pool_grad(mesh, spec):
  """select_and_scatter_add: the gradient of max pooling."""
  def fn(x):
    g1 = jax.grad(lambda x: (nn.max_pool(x, (2, 2), strides=(2, 2)) ** 2).sum())(x)
    g2 = jax.grad(lambda x: nn.max_pool(x, (3, 3), padding="SAME").sum())(x)
    g3 = jax.grad(lambda x: nn.avg_pool(x, (2, 2), strides=(2, 2)).sum())(x)
    return g1, g2, g3

  assert_partitioned_matches(fn, (randn(8, 8, 8, 8),), (spec,), mesh)


# --- copy, stop_gradient, random -----------------------------------------------------------------

@pytest.mark.parametrize("mesh,spec", SPECS_2D[1::3], ids=_ids(SPECS_2D[1::3]))
def test_copy_stop_gradient(mesh, spec):
  def fn(x):
    return (jnp.copy(x), lax.stop_gradient(x) * 2, jnp.array(x, copy=True) + 1,
            jax.grad(lambda x: (lax.stop_gradient(x) * x).sum())(x))

  assert_partitioned_matches(fn, (randn(8, 16),), (spec,), mesh)


RANDOM = [("x8", P(None, "x")), ("a2b4", P(("b", "a"))), ("a2b2c2", P("c", ("a", "b")))]


@pytest.mark.parametrize("mesh,spec", RANDOM, ids=_ids(RANDOM))
def test_random_typed_key(mesh, spec):
  """Random values depend only on the key and the global position: bit-identical when sharded.
  (Only exact operations are applied to them here: XLA may fuse float arithmetic differently.)"""
  def fn(key, x):
    k1, k2, k3 = jax.random.split(key, 3)
    keep = jax.random.bernoulli(k3, 0.7, x.shape)
    return (jax.random.normal(k1, (8, 16)), jax.random.uniform(k2, (8, 16)) * x,
            jnp.where(keep, x, 0.0), jax.random.randint(k1, (8, 16), 0, 100),
            jax.random.fold_in(k2, 3), jax.random.bits(k3, (16, 8)).T,
            jax.random.normal(jax.random.fold_in(k1, 1), (4, 8, 16)))

  assert_partitioned_matches(fn, (jax.random.key(42), randn(8, 16)), (P(), spec), mesh, rtol=0,
                             atol=0)


@pytest.mark.parametrize("mesh,spec", [("x8", P("x")), ("a2b4", P("a", "b"))], ids=["x8", "a2b4"])
def test_random_raw_key(mesh, spec):
  def fn(key, x):
    noise = jax.random.normal(key, (16, 8)).T
    keys = jax.random.split(key, 8)
    per_row = jax.vmap(lambda k: jax.random.uniform(k, (16,)))(keys)
    return x * noise, per_row + x, jax.random.bernoulli(key, 0.5, (8, 16)), keys

  assert_partitioned_matches(fn, (jax.random.PRNGKey(7), randn(8, 16)), (P(), spec), mesh, rtol=0,
                             atol=0)


@pytest.mark.parametrize("mesh,spec", [("a2b4", P("b")), ("a2b2c2", P(ABC))],
                         ids=["a2b4", "a2b2c2"])
def test_random_sharded_keys(mesh, spec):
  def fn(keys, x):
    noise = jax.vmap(lambda k: jax.random.normal(k, (16,)))(keys)
    # key arrays are indexed like any other array: slice, gather, reverse
    picked = (keys[2], keys[jnp.array([5, 1, 1])], keys[::-1], keys[1:5])
    return noise, jnp.where(noise > 0, x, noise), picked, jax.random.uniform(keys[3], (8,))

  keys = jax.random.split(jax.random.key(0), 8)
  assert_partitioned_matches(fn, (keys, randn(8, 16)), (spec, spec), mesh, rtol=0, atol=0)


@pytest.mark.parametrize("impl", ["threefry2x32", "rbg", "unsafe_rbg"])
@pytest.mark.parametrize("mesh,spec", [("a2b4", P("a")), ("x8", P("x"))], ids=["a2b4", "x8"])
def test_random_key_arrays_of_every_impl(impl, mesh, spec):
  """rbg draws bits, and unsafe_rbg does everything, with rng_bit_generator, which over a key
  array draws the whole batch from its first key: a device cannot draw its keys' share alone."""
  def fn(keys, a):
    return (jax.vmap(lambda k: jax.random.normal(k, (4,)))(keys), jax.vmap(jax.random.bits)(keys),
            jax.random.key_data(jax.vmap(jax.random.split)(keys)),
            jax.random.key_data(jax.vmap(jax.random.fold_in)(keys, jnp.arange(8))),
            jax.vmap(jax.random.gamma)(keys, a), jax.random.gamma(keys[0], a))

  keys = jax.random.split(jax.random.key(0, impl=impl), 8)
  alpha = np.arange(1, 33, dtype=np.float32).reshape(8, 4)
  assert_partitioned_matches(fn, (keys, alpha), (spec, spec), mesh)


@pytest.mark.parametrize("mesh,spec", RANDOM, ids=_ids(RANDOM))
def test_random_without_partitionable_threefry(mesh, spec):
  """Under ``jax.threefry_partitionable(False)`` threefry's bits are not a function of their
  position alone: a split result is drawn whole on every device and sliced, as XLA does."""
  def fn(key, x):
    k1, k2 = jax.random.split(key)
    return (jax.random.normal(k1, (8, 16)) * x, jax.random.bits(k2, (16, 8)).T,
            jax.vmap(lambda k: jax.random.uniform(k, (16,)))(jax.random.split(k2, 8)),
            jax.random.poisson(k1, 4.0, (8, 16)))

  with jax.threefry_partitionable(False):
    assert_partitioned_matches(fn, (jax.random.key(42), randn(8, 16)), (P(), spec), mesh,
                               out_specs=(spec,) * 4, rtol=0, atol=0)

  def inside(key, x):  # the setting inside the function, which JAX records per op
    with jax.threefry_partitionable(False):
      return fn(key, x)

  assert_partitioned_matches(inside, (jax.random.key(42), randn(8, 16)), (P(), spec), mesh,
                             out_specs=(spec,) * 4, rtol=0, atol=0)


def test_a_call_under_other_jax_settings_traces_again():
  """As ``jax.jit``, a partitioned function traces and compiles again when called under other
  settings that change its program (``jax.threefry_partitionable``, rank promotion)."""
  mesh = spmd.make_mesh({"x": 8})
  draw = spmd.partition(lambda k: jax.random.normal(k, (16, 4)), mesh=mesh, in_specs=(P(),),
                        out_specs=P("x"))
  key = jax.random.key(1)
  for partitionable in (True, False, True):
    with jax.threefry_partitionable(partitionable):
      np.testing.assert_array_equal(draw(key), jax.random.normal(key, (16, 4)))
  added = spmd.partition(jnp.add, mesh=mesh, in_specs=(P("x"), P()))
  x, y = randn(8, 4), randn(4)
  np.testing.assert_array_equal(added(x, y), x + y)
  with jax.numpy_rank_promotion("raise"), pytest.raises(ValueError, match="rank_promotion"):
    added(x, y)


POISSON = [("a2b4", (8, 12), P(), P("a", "b")), ("a2b4", (6, 15), P(), P("b", "a")),
           ("x8", (16, 3), P(), P("x")), ("a2b4", (8, 12), P("b"), P("b", "a")),
           ("a2b2c2", (6, 5), P("c"), P(("b", "c"), "a"))]


@pytest.mark.parametrize("mesh,shape,key_spec,spec", POISSON, ids=_ids(POISSON))
def test_random_poisson(mesh, shape, key_spec, spec):
  """Poisson variates (rates below 10 by Knuth's loop, above by rejection) are drawn per key from
  uniforms at their positions: each device draws its block's, as JAX lowers a split result."""
  lam = np.linspace(0.5, 40, math.prod(shape), dtype=np.float32).reshape(shape)
  if key_spec == P():
    key = jax.random.key(3)
    fn = lambda k, rates: jax.random.poisson(k, rates, rates.shape)  # noqa: E731
  else:
    key = jax.random.split(jax.random.key(3), shape[0])
    fn = jax.vmap(lambda k, rates: jax.random.poisson(k, rates, rates.shape))
  for out in (None, spec):
    assert_partitioned_matches(fn, (key, lam), (key_spec, spec), mesh, out_specs=out, rtol=0,
                               atol=0)


KEY_RESHARDS = [("a2b4", P("a", "b"), None), ("a2b4", P("b", "a"), P()),
                ("a2b2c2", P(("a", "b"), "c"), P("c")), ("x8", P(None, "x"), P("x"))]


@pytest.mark.parametrize("mesh,spec,out", KEY_RESHARDS, ids=_ids(KEY_RESHARDS))
def test_key_arrays_through_collectives(mesh, spec, out):
  """Key arrays are gathered (untiled, or summed into zeros where uneven), exchanged in halos
  and rotated like any array: JAX cannot add, pad or fill keys, so the partitioner's own
  collectives run on their data. (One op a function: XLA merges a gather of keys with one of
  their data, which the plan lists apart.)"""
  data = jax.random.key_data
  ops = [data, lambda k: data(k.T), lambda k: data(k.reshape(-1)),
         lambda k: data(jnp.concatenate([k, k[:3]])), lambda k: data(jnp.roll(k, 2, axis=0)),
         jax.vmap(jax.vmap(lambda k: jax.random.uniform(k)))]
  for shape in [(16, 4), (13, 3), (16, 2)]:  # even, uneven, fewer rows than shards
    keys = jax.random.split(jax.random.key(1), shape)
    for fn in ops:
      assert_partitioned_matches(fn, (keys,), (spec,), mesh, out_specs=out, rtol=0, atol=0)


ZERO_SIZE = [("a2b4", (0, 8), P("a"), P("a")), ("a2b4", (0,), P(), P("b")),
             ("a2b4", (8, 0), P(None, "b"), P("b")), ("x8", (0, 8), P("x"), P(None, "x")),
             ("a2b2c2", (4, 0, 6), P("a", "b", "c"), P())]


@pytest.mark.parametrize("mesh,shape,spec,out", ZERO_SIZE, ids=_ids(ZERO_SIZE))
def test_arrays_with_no_elements(mesh, shape, spec, out):
  """A value with no elements is made anew in any form: nothing moves."""
  def fn(x):
    y = jnp.swapaxes(x, 0, -1) if x.ndim > 1 else x
    return x + 1, y * 2, x.sum(0), x.sum(), jnp.tanh(x)

  x = np.zeros(shape, np.float32)
  plan = assert_partitioned_matches(fn, (x,), (spec,), mesh, out_specs=(out, None, None, None, out))
  assert not plan.collectives


# --- identities, unstack, linear algebra, FFT, generic reduce -------------------------------------

def _moves(plan):
  return sorted((c.kind, c.axes, c.bytes) for c in plan.collectives)


@pytest.mark.parametrize("mesh,spec", [("x8", P(None, "x")), ("a2b4", P("a", "b")),
                                       ("a2b2c2", P("c", ("a", "b")))])
def test_identities_move_nothing(mesh, spec):
  """checkpoint_name, random_clone, device_put and optimization_barrier are identities: the plan
  with them is the plan without them."""
  from jax.ad_checkpoint import checkpoint_name

  def plain(x, w):
    return jnp.tanh(x @ w) * 2

  def named(x, w):
    h = checkpoint_name(jnp.tanh(jax.device_put(x) @ w), "h")
    h, = lax.optimization_barrier((h,))
    return h * 2

  args, specs = (randn(8, 16), randn(16, 16, seed=1)), (spec, P())
  want = assert_partitioned_matches(plain, args, specs, mesh)
  got = assert_partitioned_matches(named, args, specs, mesh)
  assert _moves(got) == _moves(want)
  key = assert_partitioned_matches(lambda k, x: jax.random.normal(jax.random.clone(k), (8, 16)) + x,
                                   (jax.random.key(3), randn(8, 16)), (P(), spec), mesh)
  assert not key.collectives


@pytest.mark.parametrize("spec", [P(("a", "b")), P("b"), P("a", "b")])
def test_barrier_results_nothing_reads_leave_it(spec):
  """A Hessian through ``optimization_barrier((x @ w, x))`` passes ``x`` through a barrier
  whose result only a dead part of the derivative reads: it leaves the barrier, and nothing
  gathers it (XLA drops it too; before, the plan listed an all-gather XLA deleted)."""
  def loss(x, w):
    a, b = lax.optimization_barrier((x @ w, x))
    return jnp.mean(jnp.tanh(a) ** 2) + jnp.mean(b * b)
  assert_partitioned_matches(jax.hessian(loss), (randn(8, 8), 0.5 * randn(8, 8, seed=1)),
                             (spec, P()), "a2b4", rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("mesh,spec", [("x8", P(None, "x")), ("x8", P("x")),
                                       ("a2b4", P("a", "b")), ("a2b4", P(None, ("a", "b")))])
def test_unstack(mesh, spec):
  plan = assert_partitioned_matches(
      lambda x: [u * (k + 1) for k, u in enumerate(jnp.unstack(x, axis=0))], (randn(8, 16),),
      (spec,), mesh)
  if spec[0] is None:  # the unstacked dim is whole: every row is local
    assert not plan.collectives


@pytest.mark.parametrize("mesh,spec", [("x8", P("x")), ("a2b4", P(("a", "b"))),
                                       ("a2b4", P("a", "b"))])
def test_batched_linear_algebra(mesh, spec):
  """Batch dims pass through; a sharded matrix dim is gathered first."""
  a = randn(8, 4, 4)
  spd = a @ np.swapaxes(a, -1, -2) + 4 * np.eye(4, dtype=np.float32)

  def fn(m):
    chol = jnp.linalg.cholesky(m)
    w, v = jnp.linalg.eigh(m)
    q, r = jnp.linalg.qr(m)
    solved = lax.linalg.triangular_solve(chol, m, left_side=True, lower=True)
    return chol, w, jnp.abs(v), jnp.abs(q), jnp.abs(r), solved, jnp.linalg.svd(m)[1]

  plan = assert_partitioned_matches(fn, (spd,), (spec,), mesh, rtol=1e-4, atol=1e-4)
  if len(spec) == 1:
    assert not plan.collectives, plan.explain()


@pytest.mark.parametrize("mesh,spec", [("x8", P("x")), ("a2b4", P("a", "b")),
                                       ("a2b4", P(None, ("a", "b")))])
def test_fft_and_log2(mesh, spec):
  def fn(x):
    spectrum = jnp.fft.rfft(x, axis=-1)
    return jnp.abs(spectrum), jnp.log2(jnp.abs(x) + 1), jnp.fft.ifft(jnp.fft.fft(x)).real

  plan = assert_partitioned_matches(fn, (randn(8, 16),), (spec,), mesh, rtol=1e-4, atol=1e-4)
  if len(spec) == 1:  # the transformed dim is whole
    assert not plan.collectives, plan.explain()


@pytest.mark.parametrize("mesh,spec", [("x8", P("x")), ("a2b4", P("a", "b")),
                                       ("a2b2c2", P(("c", "a"), "b"))])
def test_variadic_reduce(mesh, spec):
  """A reduce with two operands and its own computation (the value and index of the largest)."""
  def fn(x):
    idx = lax.broadcasted_iota(jnp.int32, x.shape, 1)

    def pick(a, b):
      take_a = a[0] >= b[0]
      return jnp.where(take_a, a[0], b[0]), jnp.where(take_a, a[1], b[1])

    return lax.reduce((x, idx), (-jnp.inf, 0), pick, (1,))

  assert_partitioned_matches(fn, (randn(8, 16),), (spec,), mesh)


# --- control flow and calls ----------------------------------------------------------------------

CONTROL = [
    ("x8", P(), P()),
    ("x8", P("x"), P(None, "x")),
    ("a2b4", P("a", "b"), P("b", "a")),
    ("a2b4", P(("a", "b")), P(None, "a")),
    ("a2b2c2", P("a", ("b", "c")), P(ABC)),
]


@pytest.mark.parametrize("mesh,sx,sw", CONTROL, ids=_ids(CONTROL))
def test_scan(mesh, sx, sw):
  def fn(c, xs, w):
    def body(carry, x):
      h, n = carry
      h = jnp.tanh(h @ w + x)
      return (h, n + 1), h.sum(axis=1)

    (h, n), ys = lax.scan(body, (c, jnp.int32(0)), xs)
    rev = lax.scan(lambda a, x: (a + x, a * x), c, xs, reverse=True)
    return h, n, ys, rev, jnp.cumsum(xs, axis=0)

  xs_spec = P(None, *tuple(sx))
  assert_partitioned_matches(fn,
                             (randn(8, 16), randn(3, 8, 16, seed=1), randn(16, 16, seed=2) * 0.3),
                             (sx, xs_spec, sw), mesh, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("mesh,sx,sw", CONTROL[1::2] + [("x8", P("x"), P())],
                         ids=_ids(CONTROL[1::2] + [("x8", P("x"), P())]))
def test_scan_over_sharded_dim(mesh, sx, sw):
  """The scanned dim itself is sharded: the scan needs it whole."""
  def fn(xs, w):
    return lax.scan(lambda c, x: (c @ w + x, c.sum()), jnp.zeros(16), xs)

  assert_partitioned_matches(fn, (randn(8, 16), randn(16, 16, seed=2) * 0.3), (sx, sw), mesh,
                             rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("mesh,sx,sw", CONTROL, ids=_ids(CONTROL))
def test_while_loop(mesh, sx, sw):
  """w is invariant in both loops: a reshard of it runs once, before the first loop, and serves
  both (as XLA hoists and merges it)."""
  def fn(x, w, n):
    static = lax.fori_loop(0, 3, lambda i, h: jnp.tanh(h @ w) + i, x)       # lowers to scan
    dynamic = lax.fori_loop(0, n, lambda i, h: jnp.tanh(h @ w) + i, x)      # a while loop
    count, y = lax.while_loop(lambda s: s[1].sum() < 1000.0,
                              lambda s: (s[0] + 1, s[1] * 2 + 1), (0, jnp.abs(x)))
    return static, dynamic, count, y

  assert_partitioned_matches(fn, (randn(8, 16), randn(16, 16, seed=1) * 0.3, np.int32(4)),
                             (sx, sw, P()), mesh, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("mesh,sx,sw", CONTROL, ids=_ids(CONTROL))
def test_cond(mesh, sx, sw):
  def fn(p, i, x, w):
    a = lax.cond(p, lambda x, w: x @ w, lambda x, w: x - w[:8], x, w)
    b = lax.cond(p, lambda x: x.sum(0), lambda x: x.max(0), x)
    c = lax.switch(i, [lambda x: x * 2, lambda x: jnp.sin(x), lambda x: x.T.reshape(8, 16)], x)
    return a, b, c

  for p in (True, False):
    args = (np.bool_(p), np.int32(2 if p else 1), randn(8, 16), randn(16, 16, seed=1))
    assert_partitioned_matches(fn, args, (P(), P(), sx, sw), mesh, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("mesh,sx,sw", CONTROL[1:], ids=_ids(CONTROL[1:]))
def test_nested_calls(mesh, sx, sw):
  """jit, custom_jvp (relu / gelu / softmax / logsumexp) and remat bodies are inlined."""
  @jax.jit
  def inner(x, w):
    return jax.nn.relu(x @ w)

  @jax.checkpoint
  def block(x):
    return jax.nn.gelu(x) * jax.nn.softmax(x, axis=-1)

  def fn(x, w):
    h = inner(x, w)
    return (block(h), jax.nn.softmax(h, axis=0), jax.nn.gelu(h, approximate=False),
            jax.scipy.special.logsumexp(h, axis=1), jax.nn.silu(h), jax.nn.log_softmax(h),
            jax.jit(jax.checkpoint(lambda x: jax.nn.relu(x) * 2))(h),
            jax.nn.one_hot(jnp.argmax(h, -1), 16))

  assert_partitioned_matches(fn, (randn(8, 16), randn(16, 16, seed=1)), (sx, sw), mesh, rtol=1e-4,
                             atol=1e-4)


# --- gradients -----------------------------------------------------------------------------------

def _mlp_loss(params, x, labels):
  w1, w2, table = params
  h = jax.nn.gelu(x @ w1) + table[labels]
  logits = jax.nn.relu(h) @ w2
  logp = jax.nn.log_softmax(logits)
  return -jnp.take_along_axis(logp, labels[:, None], axis=1).mean() + 1e-3 * (w1 ** 2).sum()


GRAD = [
    ("x8", (P(), P(), P()), P("x")),
    ("x8", (P(None, "x"), P("x"), P("x")), P()),
    ("a2b4", (P(None, "b"), P("b"), P(None, "b")), P("a")),
    ("a2b4", (P("a", "b"), P("b", "a"), P("b")), P(("a", "b"))),
    ("a2b2c2", (P("c", ("a", "b")), P(ABC), P("a", "c")), P(("b", "a"))),
]


@pytest.mark.parametrize("mesh,sp,sx", GRAD, ids=[m + str(k) for k, (m, _, _) in enumerate(GRAD)])
def test_grad_mlp(mesh, sp, sx):
  params = (randn(16, 16) * 0.3, randn(16, 8, seed=1) * 0.3, randn(8, 16, seed=2))
  x, labels = randn(8, 16, seed=3), ints(8, high=8, seed=4)
  fn = jax.value_and_grad(_mlp_loss)
  labels_spec = P(*tuple(sx)[:1])  # labels split like x
  assert_partitioned_matches(fn, (params, x, labels), (sp, sx, labels_spec), mesh, rtol=1e-4,
                             atol=1e-5)


def _conv_loss(k, x):
  y = lax.conv_general_dilated(x, k, (1, 1), "SAME", dimension_numbers=("NHWC", "HWIO", "NHWC"))
  y = nn.max_pool(jax.nn.relu(y), (2, 2), strides=(2, 2))
  return jnp.mean(nn.avg_pool(y, (2, 2), strides=(2, 2)) ** 2)


@pytest.mark.parametrize("mesh,sk,sx", [
    ("x8", P(), P("x")),
    ("a2b4", P(None, None, None, "b"), P("a")),
    ("a2b2c2", P(None, None, "a"), P("b", "c")),
], ids=["x8", "a2b4", "a2b2c2"])
def test_grad_conv_pool(mesh, sk, sx):
  fn = jax.grad(_conv_loss, argnums=(0, 1))
  assert_partitioned_matches(fn, (randn(3, 3, 4, 8, seed=1), randn(8, 8, 8, 4)), (sk, sx), mesh,
                             rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("mesh,sx,sw", CONTROL[1::2], ids=_ids(CONTROL[1::2]))
def test_grad_scan_cond_remat(mesh, sx, sw):
  def loss(w, x, p):
    @jax.checkpoint
    def body(h, _):
      h = jnp.tanh(h @ w)
      return h, jnp.sort(h, axis=1)[:, -1]

    h, tops = lax.scan(body, x, None, length=3)
    h = lax.cond(p, lambda h: jnp.cumsum(h, axis=0), lambda h: jnp.flip(h, 1), h)
    return (h ** 2).sum() + tops.sum() + jnp.max(h[::2, 1:5])

  fn = jax.grad(loss, argnums=(0, 1))
  for p in (True, False):
    assert_partitioned_matches(fn, (randn(16, 16) * 0.3, randn(8, 16, seed=1), np.bool_(p)),
                               (sw, sx, P()), mesh, rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("mesh,st,si", EMBED[1::2], ids=_ids(EMBED[1::2]))
def test_grad_gather_scatter(mesh, st, si):
  """The gradient of a gather is a scatter-add, of a pad a slice, of a concat a split."""
  def loss(table, ids):
    emb = table[ids]                                   # [4, 8, 16]
    h = jnp.concatenate([emb, jnp.pad(emb[:, :6], ((0, 0), (1, 1), (0, 0)))], axis=-1)
    return jnp.sum(jnp.sin(h) * jnp.arange(32)) + jnp.sum(table.at[ids[0]].set(0.0) ** 2)

  assert_partitioned_matches(jax.grad(loss), (randn(32, 16), ints(4, 8, high=32)), (st, si), mesh,
                             rtol=1e-4, atol=1e-5)


# --- uneven dims ---------------------------------------------------------------------------------

UNEVEN = {
    "elementwise": lambda x, y: jnp.tanh(x) * y + 1,
    "reduce": lambda x, y: (x.sum(0), x.max(1), jnp.argmax(x, 0), jnp.prod(1 + 0.1 * y, 1)),
    "dot": lambda x, y: x @ y.T,
    "transpose_reshape": lambda x, y: (x.T + y.T, x.reshape(3, 20) + y.reshape(3, 20)),
    "cumsum_sort": lambda x, y: (jnp.cumsum(x, 0) + jnp.cumsum(y, 1), jnp.sort(x, 0)),
    "slice_pad_concat": lambda x, y: (x[1:5], y[:, 3:7], jnp.pad(x, ((1, 0), (2, 3))),
                                      jnp.concatenate([x, y], 0)),
    "gather_iota": lambda x, y: (x[jnp.array([5, 0, 3])], x + jnp.arange(10)),
}
UNEVEN_SPECS = [
    ("x8", P("x"), P(None, "x")),
    ("a2b4", P("b", "a"), P("a", "b")),
    ("a2b2c2", P(("a", "b")), P("c", ("a", "b"))),
]


@pytest.mark.parametrize("mesh,sx,sy", UNEVEN_SPECS, ids=_ids(UNEVEN_SPECS))
@pytest.mark.parametrize("name", list(UNEVEN))
def test_uneven_dims(name, mesh, sx, sy):
  """[6, 10] operands split 8, 4 or 2 ways: padded shards (backend='spmd')."""
  assert_partitioned_matches(UNEVEN[name], (randn(6, 10), randn(6, 10, seed=1)), (sx, sy), mesh,
                             backend="spmd")


ROW_PICKS = {
    "row_slice": lambda x: x[3:4] * 2,
    "rows_taken": lambda x: jnp.take(x, jnp.array([5, 2]), axis=0) * 2,
    "associative_scan": lambda x: lax.associative_scan(jnp.add, x, axis=0),
}


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float16, jnp.int8])
@pytest.mark.parametrize("name", list(ROW_PICKS))
def test_rows_of_a_split_dim_are_summed_from_their_owner_in_every_numeric_dtype(name, dtype):
  """A row picked from a split dim is taken by its owner and summed (masked pieces: exact in
  any numeric dtype), in bfloat16 too, whose numpy kind is "V": it gathered the whole operand
  (`x[3:4]` of bf16[16,8] over 8 devices 512 B, not 32 B; an associative scan 1,632 B, not
  800 B). On the CPU wire bf16 is as wide as f32, so it moves what f32 moves."""
  fn, mesh = ROW_PICKS[name], "x8"
  x = randn(16, 8).astype(dtype) if dtype != jnp.int8 else ints(16, 8).astype(np.int8)
  plan = assert_partitioned_matches(fn, (x,), P("x"), mesh, rtol=2e-2, atol=2e-2)
  f32 = assert_partitioned_matches(fn, (x.astype(np.float32),), P("x"), mesh)
  assert plan.total_bytes == f32.total_bytes * wire_for("cpu")(jnp.dtype(dtype)) // 4, (
      plan.explain())
  assert not any(c.kind == "all-gather" for c in plan.collectives), plan.explain()
