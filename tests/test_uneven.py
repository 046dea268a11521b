"""Uneven partitioning: dims whose size does not divide the shard count (held padded to
n * ceil(N/n)) must give exactly the unpartitioned result, with a plan whose collective bytes are
those of the compiled program.

Sizes 5, 7, 10, 13 and 3 (more shards than elements) on 2, 4 and 8 shards and on a 2D mesh, next
to even sizes; float32, bfloat16, int32 and bool where the op allows. Every case checks:
partitioned == unpartitioned (same shape and dtype; floats close, the rest equal), no primitive
fell back to the replicated rule, and the plan moves the compiled HLO's bytes per collective kind
(helpers.assert_partitioned_matches).
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

import spmd
from helpers import assert_partitioned_matches, get_mesh

AB = ("a", "b")

F32, BF16, I32, BOOL = jnp.float32, jnp.bfloat16, jnp.int32, jnp.bool_


def data(shape, dtype=F32, seed=0):
  """Deterministic inputs: normal floats (bfloat16: positive, in [0.5, 1.5)), small ints,
  random bools."""
  r = np.random.default_rng(seed)
  if dtype == BOOL:
    return jnp.asarray(r.random(shape) < 0.5)
  if dtype == I32:
    return jnp.asarray(r.integers(-4, 5, size=shape).astype(np.int32))
  if dtype == BF16:
    return jnp.asarray(r.uniform(0.5, 1.5, size=shape).astype(np.float32)).astype(BF16)
  return jnp.asarray(r.standard_normal(shape).astype(np.float32))


# --- reductions ----------------------------------------------------------------------------------

# (shape, mesh, spec, axis): the reduced dim is sharded unevenly, except the "even" controls.
LAYOUTS = {
    "5on2": ((5, 3), "x2", P("x", None), 0),
    "7on4": ((7, 3), "x4", P("x", None), 0),
    "13on8": ((13, 2), "x8", P("x", None), 0),
    "3on8": ((3, 4), "x8", P("x", None), 0),
    "10on8-ab": ((10, 3), "a2b4", P(AB, None), 0),
    "7x5-ab-rows": ((7, 5), "a2b4", P("a", "b"), 0),
    "7x5-ab-cols": ((7, 5), "a2b4", P("a", "b"), 1),
    "7x5-ab-all": ((7, 5), "a2b4", P("b", "a"), None),
    "even-8on4": ((8, 3), "x4", P("x", None), 0),
}

REDUCTIONS = {
    "sum": lambda x, a: jnp.sum(x, a),
    "mean": lambda x, a: jnp.mean(x, a),
    "max": lambda x, a: jnp.max(x, a),
    "min": lambda x, a: jnp.min(x, a),
    "prod": lambda x, a: jnp.prod(x, a),
    "all": lambda x, a: jnp.all(x > 0, a),
    "any": lambda x, a: jnp.any(x > 1, a),
    "argmax": lambda x, a: jnp.argmax(x, a),
    "argmin": lambda x, a: jnp.argmin(x, a),
    "logsumexp": lambda x, a: jax.nn.logsumexp(x, a),
    "softmax": lambda x, a: jax.nn.softmax(x, a if a is not None else (0, 1)),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("name", list(REDUCTIONS))
def test_reduction_f32(name, layout):
  shape, mesh, spec, axis = LAYOUTS[layout]
  x = data(shape, seed=len(name))
  if name == "prod":
    x = 1 + x / 4  # a product of moderate factors
  fn = REDUCTIONS[name]
  assert_partitioned_matches(lambda x: fn(x, axis), (x,), spec, mesh)


DTYPE_REDUCTIONS = [
    (BF16, ["sum", "mean", "max", "min", "prod", "argmax", "logsumexp", "softmax"]),
    (I32, ["sum", "max", "min", "prod", "argmax", "argmin", "all", "any"]),
    (BOOL, ["all", "any", "sum", "max"]),
]


@pytest.mark.parametrize("layout", ["7on4", "7x5-ab-cols", "3on8"])
@pytest.mark.parametrize("dtype,name", [(d, n) for d, names in DTYPE_REDUCTIONS for n in names],
                         ids=[f"{jnp.dtype(d).name}-{n}" for d, names in DTYPE_REDUCTIONS
                              for n in names])
def test_reduction_dtypes(dtype, name, layout):
  shape, mesh, spec, axis = LAYOUTS[layout]
  x = data(shape, dtype, seed=3)
  if dtype == BOOL:
    fn = {"all": jnp.all, "any": jnp.any, "sum": jnp.sum, "max": jnp.max}[name]
  elif name in ("all", "any"):
    fn = lambda x, a, r=REDUCTIONS[name]: r(x + 1, a)  # noqa: E731  (ints > 0 and > 1)
  else:
    fn = REDUCTIONS[name]
  assert_partitioned_matches(lambda x: fn(x, axis), (x,), spec, mesh)


def test_reductions_ignore_padding_values():
  """Padding must not leak: all-negative max, all-positive min, all-True all, all-False any,
  a zero-free product and argmax of a row whose maximum is in the last (partial) shard."""
  x = -5 - jnp.abs(data((13, 3)))

  def f(x):
    return (x.max(0), (-x).min(0), (x < 0).all(0), (x > 0).any(0), (x / 5).prod(0),
            jnp.argmax(x.at[12].set(0.0), 0), jnp.argmin(x.at[12].set(-99.0), 0),
            jnp.sum(x, 0), jnp.count_nonzero(x < -5.5, 0))

  for mesh in ("x2", "x4", "x8"):
    assert_partitioned_matches(f, (x,), P("x", None), mesh)


def test_python_scalar_argument_beside_an_uneven_input():
  """Inputs are padded before the program where they split unevenly; a Python scalar beside
  one (a TrainState's step) went through the padding too, which failed on an int."""
  assert_partitioned_matches(lambda x, step: x * (step + 1), (data((6, 3)), 2),
                             (P("x", None), None), "x8")


def test_mean_var_std_use_the_global_count():
  x = data((7, 10))
  assert_partitioned_matches(
      lambda x: (x.mean(), x.var(0), x.std(1), jnp.mean(x, 0, keepdims=True)), (x,),
      P("b", "a"), "a2b4")


# --- contractions --------------------------------------------------------------------------------

# (k, mesh, spec of a [5, k], spec of b [k, 3]): k, the contracted dim, sharded in both operands.
DOTS = [
    (5, "x2", P(None, "x"), P("x", None)),
    (7, "x4", P(None, "x"), P("x", None)),
    (13, "x8", P(None, "x"), P("x", None)),
    (3, "x8", P(None, "x"), P("x", None)),
    (10, "a2b4", P(None, AB), P(AB, None)),
    (5, "a2b4", P("a", "b"), P("b", None)),
    (6, "a2b4", P("a", "b"), P("b", "a")),
    (7, "a2b4", P(None, ("b", "a")), P(("b", "a"), None)),
    (8, "x4", P(None, "x"), P("x", None)),  # even control
]


@pytest.mark.parametrize("k,mesh,sa,sb", DOTS, ids=[f"k{k}-{m}-{a}-{b}" for k, m, a, b in DOTS])
def test_dot_contracting_an_uneven_sharded_dim(k, mesh, sa, sb):
  a, b = data((5, k), seed=1), data((k, 3), seed=2)
  assert_partitioned_matches(lambda a, b: (a @ b, jnp.einsum("ik,kj->ji", a, b)), (a, b),
                             (sa, sb), mesh)


@pytest.mark.parametrize("dtype", [I32, BF16])
def test_dot_uneven_int_and_bf16(dtype):
  a, b = data((5, 7), dtype, seed=1), data((7, 3), dtype, seed=2)
  assert_partitioned_matches(lambda a, b: a @ b, (a, b), (P("a", "b"), P("b", None)), "a2b4")


@pytest.mark.parametrize("sa,sb", [
    (P("a", None, "b"), P("a", "b", None)),
    (P(None, "a", "b"), P(None, "b", "a")),
    (P("b", None, "a"), P(None, "a", None)),
])
def test_batched_einsum_uneven(sa, sb):
  a, b = data((3, 5, 7), seed=1), data((3, 7, 6), seed=2)
  assert_partitioned_matches(lambda a, b: jnp.einsum("bik,bkj->bij", a, b), (a, b), (sa, sb),
                             "a2b4")


def test_dot_then_uneven_sharded_reduction_chain():
  x, w = data((7, 13), seed=1), data((13, 5), seed=2)
  assert_partitioned_matches(lambda x, w: jax.nn.softmax(jnp.tanh(x @ w), -1).sum(0), (x, w),
                             (P("a", "b"), P("b", None)), "a2b4")


# --- convolution ---------------------------------------------------------------------------------

def _conv(x, w, stride=1, padding="SAME"):
  return lax.conv_general_dilated(x, w, (stride, stride), padding,
                                  dimension_numbers=("NHWC", "HWIO", "NHWC"))


# x [2, 13, 5, 3], w [3, 3, 3, 5]: H=13, W=5, Cin=3 and Cout=5 sharded unevenly.
CONVS = [
    ("h13on8", "x8", P(None, "x", None, None), P(), 1, "SAME"),
    ("h13on4-s2-valid", "x4", P(None, "x", None, None), P(), 2, "VALID"),
    ("h-and-w", "a2b4", P(None, "a", "b", None), P(), 1, "SAME"),
    ("cin3on2", "x2", P(None, None, None, "x"), P(None, None, "x", None), 1, "SAME"),
    ("cout5on4", "x4", P(), P(None, None, None, "x"), 1, "VALID"),
    ("h-and-cin", "a2b4", P(None, "a", None, "b"), P(None, None, "b", None), 2, "SAME"),
    ("batch-and-cout", "a2b4", P("a", None, None, None), P(None, None, None, "b"), 1, "SAME"),
]


@pytest.mark.parametrize("name,mesh,sx,sw,stride,padding", CONVS, ids=[c[0] for c in CONVS])
def test_conv_uneven(name, mesh, sx, sw, stride, padding):
  x, w = data((2, 13, 5, 3), seed=1), data((3, 3, 3, 5), seed=2)
  assert_partitioned_matches(lambda x, w: _conv(x, w, stride, padding), (x, w), (sx, sw), mesh)


def test_conv_uneven_bf16():
  x, w = data((1, 13, 5, 3), BF16, seed=1), data((3, 3, 3, 4), BF16, seed=2)
  assert_partitioned_matches(lambda x, w: _conv(x, w), (x, w), (P(None, "a", "b", None), P()),
                             "a2b4")


# --- cumulative ops ------------------------------------------------------------------------------

CUMULATIVE = {
    "cumsum": lambda x, a: jnp.cumsum(x, a),
    "cumprod": lambda x, a: jnp.cumprod(1 + x / 4, a),
    "cummax": lambda x, a: lax.cummax(x, a),
    "cummin": lambda x, a: lax.cummin(x, a),
    "cumsum-reverse": lambda x, a: lax.cumsum(x, a, reverse=True),
    "cumlogsumexp": lambda x, a: lax.cumlogsumexp(x, a),
}
CUM_LAYOUTS = ["5on2", "13on8", "7x5-ab-rows", "7x5-ab-cols"]


@pytest.mark.parametrize("layout", CUM_LAYOUTS)
@pytest.mark.parametrize("name", list(CUMULATIVE))
def test_cumulative_along_an_uneven_sharded_dim(name, layout):
  shape, mesh, spec, axis = LAYOUTS[layout]
  fn = CUMULATIVE[name]
  assert_partitioned_matches(lambda x: fn(x, axis), (data(shape, seed=5),), spec, mesh)


@pytest.mark.parametrize("dtype", [I32, BOOL, BF16])
def test_cumulative_dtypes(dtype):
  x = data((7, 3), dtype, seed=6)
  if dtype == BOOL:
    fn = lambda x: (jnp.cumsum(x, 0), lax.cummax(x.astype(jnp.int32), 0))  # noqa: E731
  else:
    fn = lambda x: (jnp.cumsum(x, 0), lax.cummax(x, 0), lax.cummin(x, 0))  # noqa: E731
  assert_partitioned_matches(fn, (x,), P("x", None), "x4")


# --- sort and top_k ------------------------------------------------------------------------------

SORT_LAYOUTS = [(5, "x2", P(None, "x")), (7, "x4", P(None, "x")), (13, "x8", P(None, "x")),
                (3, "x8", P(None, "x")), (7, "a2b4", P("a", "b"))]


@pytest.mark.parametrize("n,mesh,spec", SORT_LAYOUTS,
                         ids=[f"{n}-{m}-{s}" for n, m, s in SORT_LAYOUTS])
def test_sort_and_top_k_along_an_uneven_sharded_dim(n, mesh, spec):
  x = data((4, n), seed=7)
  k = min(n, 5)  # 5 > the shard size for 7 on 4 and 13 on 8

  def f(x):
    return jnp.sort(x, 1), jnp.argsort(x, 1), lax.top_k(x, 2), lax.top_k(x, k), jnp.sort(x, 0)

  assert_partitioned_matches(f, (x,), spec, mesh)


@pytest.mark.parametrize("dtype", [I32, BF16, BOOL])
def test_sort_dtypes(dtype):
  x = data((3, 13), dtype, seed=8)
  fn = (lambda x: jnp.sort(x, 1)) if dtype == BOOL else (lambda x: (jnp.sort(x, 1),
                                                                    lax.top_k(x, 3)))
  assert_partitioned_matches(fn, (x,), P(None, "x"), "x8")


def test_multi_operand_sort_uneven():
  keys, vals = data((7, 3), I32, seed=1), data((7, 3), seed=2)
  assert_partitioned_matches(lambda k, v: lax.sort((k, v), dimension=0, num_keys=1),
                             (keys, vals), (P("x", None), P("x", None)), "x4")


# --- gather and scatter --------------------------------------------------------------------------

IDX = jnp.array([0, 12, 5, 7, 3, 3, 11], jnp.int32)  # duplicates; first and last rows
GATHER_LAYOUTS = [("x8", P("x", None)), ("x4", P("x", None)), ("x2", P("x", None)),
                  ("a2b4", P("a", "b")), ("a2b4", P(AB, None)), ("x8", P(None, "x"))]


@pytest.mark.parametrize("mesh,spec", GATHER_LAYOUTS,
                         ids=[f"{m}-{s}" for m, s in GATHER_LAYOUTS])
def test_gather_from_an_uneven_sharded_operand(mesh, spec):
  x = data((13, 5), seed=9)

  def f(x, i):
    return (x[i], jnp.take(x, i, axis=0), jnp.take(x, i % 5, axis=1),
            jnp.take(x, 2 * i - 4, axis=0, mode="clip"),
            jnp.take(x, 2 * i - 4, axis=0, mode="fill", fill_value=-1.0))

  assert_partitioned_matches(f, (x, IDX), (spec, P()), mesh)


@pytest.mark.parametrize("mesh,st,si", [
    ("x8", P("x", None), P()),
    ("x4", P("x", None), P("x", None)),
    ("a2b4", P("b", None), P("a", None)),
    ("a2b4", P("b", "a"), P(None, "a")),
    ("a2b4", P(AB, None), P()),
])
def test_embedding_lookup_with_an_uneven_vocab_sharded_table(mesh, st, si):
  table = data((13, 6), seed=10)  # vocab 13: uneven on 2, 4 and 8 shards
  ids = jnp.array([[0, 12, 5, 7], [3, 3, 11, 1], [6, 2, 9, 10]], jnp.int32)
  assert_partitioned_matches(lambda t, i: t[i], (table, ids), (st, si), mesh)
  assert_partitioned_matches(jax.grad(lambda t, i: (jnp.tanh(t[i]) ** 2).sum()), (table, ids),
                             (st, si), mesh)


def test_gather_uneven_int_and_bool_tables():
  ids = jnp.array([0, 12, 5, 5, 9], jnp.int32)
  assert_partitioned_matches(lambda t, b, i: (t[i], b[i]),
                             (data((13, 3), I32), data((13, 3), BOOL), ids),
                             (P("x", None), P("x", None), P()), "x4")


def test_take_along_axis_uneven():
  x = data((5, 13), seed=11)
  idx = jnp.asarray(np.random.default_rng(0).integers(0, 13, (5, 4)).astype(np.int32))
  assert_partitioned_matches(lambda x, i: jnp.take_along_axis(x, i, axis=1), (x, idx),
                             (P("a", "b"), P("a", None)), "a2b4")


@pytest.mark.parametrize("mesh,spec", GATHER_LAYOUTS[:5],
                         ids=[f"{m}-{s}" for m, s in GATHER_LAYOUTS[:5]])
def test_scatter_into_an_uneven_sharded_operand(mesh, spec):
  x = data((13, 5), seed=12)
  updates = data((7, 5), seed=13)

  def f(x, i, u):
    return (x.at[i[:3]].set(7.0), x.at[i].add(1.5), x.at[i].add(u), x.at[i].max(0.5),
            x.at[i].min(u), x.at[2 * i - 4].add(u, mode="drop"))

  assert_partitioned_matches(f, (x, IDX, updates), (spec, P(), P()), mesh)


def test_scatter_add_with_sharded_updates_and_int_operand():
  x, u = data((13, 5), I32), data((7, 5), I32, seed=1)
  assert_partitioned_matches(lambda x, i, u: x.at[i].add(u), (x, IDX, u),
                             (P("x", None), P("x"), P("x", None)), "x4")
  assert_partitioned_matches(lambda x, i, u: x.at[i].add(u), (x, IDX, u),
                             (P("a", "b"), P("b"), P("b", None)), "a2b4")


MISC = {
    "vmap-gather": (lambda t, i: jax.vmap(lambda t, i: t[i])(t, i),
                    (P("a", "b", None), P("a", None))),
    "vmap-scatter-add": (lambda t, i: jax.vmap(lambda t, i: t.at[i].add(1.0))(t, i),
                         (P(None, "b", "a"), P(None, "b"))),
    "one-hot-matmul": (lambda t, i: jax.nn.one_hot(i, 13) @ t[0], (P(None, "b", None),
                                                                 P("a", None))),
    "segment-sum": (lambda t, i: jax.ops.segment_sum(t[0, :5], i[0], num_segments=13),
                    (P(None, "b", None), P(None, "b"))),
    "dynamic-slice": (lambda t, i: lax.dynamic_slice_in_dim(t, i[0, 0], 4, 1),
                      (P(None, "b", None), P())),
    "dynamic-update-slice": (lambda t, i: lax.dynamic_update_slice_in_dim(t, t[:, :4] * 2,
                                                                         i[0, 0], 1),
                             (P(None, "b", None), P())),
    "concatenate": (lambda t, i: jnp.concatenate([t[:, :5], t[:, 6:]], 1),
                    (P(None, "b", None), P())),
    "rev-iota": (lambda t, i: t[:, ::-1] + jnp.arange(13.0)[:, None], (P(None, "b", None), P())),
}


@pytest.mark.parametrize("name", list(MISC))
def test_indexing_ops_on_an_uneven_sharded_dim(name):
  """t [3, 13, 4] (batch 3 on a, vocab 13 on b), ids [3, 5] in [0, 13)."""
  fn, specs = MISC[name]
  t = data((3, 13, 4), seed=23)
  ids = jnp.asarray(np.random.default_rng(1).integers(0, 13, (3, 5)).astype(np.int32))
  assert_partitioned_matches(fn, (t, ids), specs, "a2b4")


# --- reshapes ------------------------------------------------------------------------------------

RESHAPES = [
    ("merge-major", (5, 6), lambda x: x.reshape(30), "x2", P("x", None)),
    ("merge-major-4", (5, 6), lambda x: x.reshape(30), "x4", P("x", None)),
    ("merge-minor", (6, 5), lambda x: x.reshape(30), "x4", P(None, "x")),
    ("merge-2d", (7, 5), lambda x: x.reshape(35) * 2, "a2b4", P("a", "b")),
    ("split", (10, 3), lambda x: x.reshape(2, 5, 3), "a2b4", P("b", None)),
    ("split-minor", (5, 6), lambda x: x.reshape(5, 2, 3), "x4", P(None, "x")),
    ("split-then-reduce", (10, 3), lambda x: x.reshape(5, 2, 3).sum(1), "a2b4", P(AB, None)),
    ("rank3-merge", (3, 7, 2), lambda x: x.reshape(3, 14).sum(1), "x4", P(None, "x", None)),
    ("transpose-merge", (5, 6), lambda x: x.T.reshape(3, 10), "x4", P("x", None)),
    ("merge-then-dot", (7, 5), None, "a2b4", P("a", None)),
]


@pytest.mark.parametrize("name,shape,fn,mesh,spec", RESHAPES, ids=[r[0] for r in RESHAPES])
def test_reshape_merging_or_splitting_an_uneven_sharded_dim(name, shape, fn, mesh, spec):
  x = data(shape, seed=14)
  if fn is None:
    w = data((35, 2), seed=15)
    assert_partitioned_matches(lambda x, w: x.reshape(35) @ w, (x, w), (spec, P("b", None)), mesh)
  else:
    assert_partitioned_matches(fn, (x,), spec, mesh)


# --- elementwise chains --------------------------------------------------------------------------

ELEMENTWISE_LAYOUTS = [("x4", P("x", None)), ("x8", P("x", None)), ("a2b4", P("a", "b")),
                       ("a2b4", P("b", "a")), ("x8", P(None, "x"))]


@pytest.mark.parametrize("mesh,spec", ELEMENTWISE_LAYOUTS,
                         ids=[f"{m}-{s}" for m, s in ELEMENTWISE_LAYOUTS])
def test_elementwise_chain_uneven(mesh, spec):
  x, y = data((7, 5), seed=16), data((7, 5), seed=17)

  def f(x, y):
    z = jnp.tanh(x * y + 1) - jnp.exp(-x) / (1 + y ** 2)
    return jnp.where(z > 0, z, y) + jnp.maximum(x, 0) * y[:, :1] + y[0]

  assert_partitioned_matches(f, (x, y), (spec, spec), mesh)
  assert_partitioned_matches(f, (x, y), (spec, P()), mesh)


@pytest.mark.parametrize("dtype", [BF16, I32, BOOL])
def test_elementwise_chain_dtypes(dtype):
  x, y = data((7, 5), dtype, seed=18), data((7, 5), dtype, seed=19)
  if dtype == BOOL:
    fn = lambda x, y: (x ^ ~y) | (x & y)  # noqa: E731
  elif dtype == I32:
    fn = lambda x, y: (x * y + 3) // 2 - jnp.abs(x) % 3 + jnp.maximum(x, y)  # noqa: E731
  else:
    fn = lambda x, y: jnp.tanh(x * y) + x / y  # noqa: E731
  for mesh, spec in [("x4", P("x", None)), ("a2b4", P("a", "b"))]:
    assert_partitioned_matches(fn, (x, y), (spec, spec), mesh)


# --- boundary: uneven inputs and outputs ---------------------------------------------------------

def test_uneven_output_spec_is_returned_with_its_exact_shape_and_a_warning():
  x = data((7, 8))
  f = spmd.partition(lambda x: x * 2, mesh=get_mesh("a2b4"), in_specs=P("a", "b"),
                     out_specs=P("a", "b"))
  plan = f.plan(x)
  assert plan.out_specs == P(None, "b")
  assert any("evenly" in w for w in plan.warnings), plan.warnings
  y = f(x)
  assert y.shape == (7, 8) and y.sharding.spec == P(None, "b")
  np.testing.assert_array_equal(np.asarray(y), np.asarray(x * 2))


def test_numpy_input_that_does_not_divide_is_accepted():
  x = np.asarray(data((13, 3)))
  f = spmd.partition(lambda x: jnp.cumsum(x, 0) + x.sum(0), mesh=get_mesh("x8"), in_specs=P("x"))
  np.testing.assert_allclose(np.asarray(f(x)), np.cumsum(x, 0) + x.sum(0), rtol=2e-5, atol=2e-5)


# --- resharding between uneven layouts -----------------------------------------------------------

# (mesh, shape, src, dst): spmd.annotate forces the reshard src -> dst of an arange.
RESHARDS = [
    ("a2b4", (3, 4), P(AB, None), P("a", None)),
    ("a2b4", (3, 4), P(AB, None), P("b", None)),
    ("a2b4", (5, 4), P("a", None), P(AB, None)),
    ("a2b4", (4, 4), P(None, "a"), P(None, AB)),
    ("a2b4", (7, 5), P("a", "b"), P("b", "a")),
    ("a2b4", (7, 5), P("b", None), P(None, "b")),
    ("x8", (13, 3), P("x", None), P(None, "x")),
    ("a2b4", (8, 8), P("a", None), P(None, AB)),  # even control
    # these stopped short of their target before reshard.py finished uneven dims whole:
    ("a2b4", (4, 4), P("a", None), P(None, AB)),
    ("a2b4", (8, 3), P("a", None), P(None, AB)),
    ("a2b4", (3, 5), P("a", "b"), P(AB, None)),
    ("a2b4", (12, 3), P("b", "a"), P(("b", "a"), None)),
]


@pytest.mark.parametrize("mesh,shape,src,dst", RESHARDS)
def test_reshard_between_uneven_layouts(mesh, shape, src, dst):
  x = jnp.arange(np.prod(shape), dtype=F32).reshape(shape)
  assert_partitioned_matches(lambda x: spmd.annotate(x * 1, dst) + 0, (x,), src, mesh)


def test_dot_chain_with_mismatched_uneven_layouts():
  x, w, v = data((3, 9), seed=1), data((9, 3), seed=2), data((3, 2), seed=3)
  assert_partitioned_matches(lambda x, w, v: (x @ w) @ v, (x, w, v),
                             (P("a", "b"), P(None, ("b", "a")), P(AB, None)), "a2b4")


def test_bf16_sum_over_a_sharded_dim_is_rounded_once():
  x = jnp.asarray(np.random.default_rng(0).standard_normal((7, 5)).astype(np.float32) * 3)
  x = x.astype(BF16)
  f = spmd.partition(lambda x: x.sum(0), mesh=get_mesh("x4"), in_specs=P("x", None))
  want = np.asarray(x.astype(F32).sum(0).astype(BF16).astype(F32))
  # float32 reassociation may flip the final rounding by one bf16 ulp (2^-8 relative), no more
  np.testing.assert_allclose(np.asarray(f(x).astype(F32)), want, rtol=2 ** -7, atol=0)


# --- gradients -----------------------------------------------------------------------------------

def _loss(x, w1, w2):
  h = jax.nn.gelu(x @ w1)
  return (jax.nn.log_softmax(h @ w2, -1) ** 2).mean() + (h.max(0) ** 2).sum()


# x [7, 5], w1 [5, 13], w2 [13, 3]: the hidden dim 13 and the batch 7 split unevenly.
GRAD_SPECS = [
    ("x4", (P("x", None), P(None, "x"), P("x", None))),
    ("x8", (P("x", None), P(None, "x"), P("x", None))),
    ("a2b4", (P("a", "b"), P("b", None), P(None, "a"))),
]


@pytest.mark.parametrize("mesh,specs", GRAD_SPECS, ids=[m for m, _ in GRAD_SPECS])
def test_grad_with_uneven_sharded_inputs(mesh, specs):
  args = data((7, 5), seed=20), data((5, 13), seed=21) * 0.5, data((13, 3), seed=22) * 0.5
  f = spmd.partition(_loss, mesh=get_mesh(mesh), in_specs=specs)
  got = jax.grad(f, argnums=(0, 1, 2))(*args)
  want = jax.grad(_loss, argnums=(0, 1, 2))(*args)
  for g, w in zip(got, want):
    assert g.shape == w.shape
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-4, atol=1e-5)
  # the gradient program itself, partitioned
  assert_partitioned_matches(jax.grad(_loss, argnums=(0, 1, 2)), args, specs, mesh, rtol=1e-4,
                             atol=1e-4)


@pytest.mark.parametrize("out_specs", [None, P(None, "x")], ids=["open", "given"])
def test_uneven_output_is_returned_gathered_with_a_warning(out_specs):
  """A 30-row conv on 4 shards: JAX arrays cannot hold uneven shards, so the output comes back
  gathered along that dim, and the plan says so, with its bytes and the cheaper choices."""
  def conv(x, k):
    return jax.lax.conv_general_dilated(x, k, (1, 1), "SAME",
                                        dimension_numbers=("NHWC", "HWIO", "NHWC"))

  x, k = data((2, 30, 16, 4)), data((3, 3, 4, 8), seed=1)
  plan = assert_partitioned_matches(conv, (x, k), (P(None, "x"), P()), "x4", out_specs, rtol=1e-4,
                                    atol=1e-4)
  (warning,) = [w for w in plan.warnings if "cannot hold uneven shards" in w]
  gathered = sum(c.bytes for c in plan.collectives if c.primitive == "output")
  assert gathered > 0 and f"({gathered} bytes per device gathered)" in warning
  assert "out_specs P(None, None, 'x', None) (dim 2 splits evenly)" in warning
  assert "padding dim 1 from 30 to 32" in warning
  assert plan.out_specs == P(None, None, None, None)


def test_uneven_input_returned_unchanged_is_whole_already_and_warns_only_when_asked():
  """An uneven input returned unchanged arrives whole and leaves whole: nothing is gathered, so
  an open output is not warned about; a given uneven out_spec still says it cannot be honoured."""
  def f(x, y):
    return x, y * 2

  args = data((30, 4)), data((30, 4), seed=1)
  plan = assert_partitioned_matches(f, args, (P("x"), P("x")), "x4")
  (warning,) = [w for w in plan.warnings if "cannot hold uneven shards" in w]
  assert warning.startswith("output 1,") and "bytes per device gathered" in warning
  plan = assert_partitioned_matches(f, args, (P("x"), P("x")), "x4", (P("x"), P()))
  (warning,) = [w for w in plan.warnings if "cannot hold uneven shards" in w]
  assert warning.startswith("out_specs[0] P('x', None)") and "nothing gathered" in warning


def test_uneven_input_only_returned_is_not_resharded_to_its_spec():
  """An uneven input nothing reads but the return arrives in its even form and leaves in it:
  f32[7,10] P('c', ('b','a')) on 2x2x2 was resharded to its spec on entry (280 B, its blocks
  not nested in the even form's) and back for the output (208 B); the entry's row said the
  uncommitted array arrived "committed". One the program reads is still sliced on entry."""
  x = data((7, 10))
  plan = assert_partitioned_matches(lambda x: x, (x,), P("c", ("b", "a")), "a2b2c2")
  assert plan.total_bytes == 0, plan.explain()
  plan = assert_partitioned_matches(lambda x: (x, x.sum(0)), (x,), P("c", ("b", "a")), "a2b2c2")
  (row,) = [r for r in plan.rows if r.primitive == "input[0]"]
  assert "returned unchanged" in row.origins[0] and "committed" not in row.origins[0]
  assert not any("committed" in w for w in plan.warnings), plan.warnings


# --- fewer rows than shards ------------------------------------------------------------------------

def _small_batch_step(x, w):
  """A matmul, reductions over the batch, and the gradient of a loss through both."""
  def loss(w):
    return (jnp.tanh(x @ w).sum(0) ** 2).mean()

  value, grad = jax.value_and_grad(loss)(w)
  return value, grad, jnp.tanh(x @ w).max(0)


# (rows, mesh, spec): a batch with fewer rows than the devices splitting it, so that some shards
# hold padding only. One row cannot be split: in_specs take it whole, with a warning.
SMALL_BATCHES = [(n, "a2b4", P(AB, None)) for n in range(1, 8)] + [(3, "x4", P("x", None))]


@pytest.mark.filterwarnings("ignore:.*of size 1")
@pytest.mark.parametrize("rows,mesh,spec", SMALL_BATCHES,
                         ids=[f"{n}on{m}" for n, m, _ in SMALL_BATCHES])
def test_batch_with_fewer_rows_than_shards_stays_split(rows, mesh, spec):
  """Each op runs on the batch split as given; the only collectives are the reductions over
  every device that splits it (no all-gather of the batch)."""
  args = data((rows, 5), seed=rows), data((5, 4), seed=30) * 0.5
  plan = assert_partitioned_matches(_small_batch_step, args, (spec, P()), mesh, rtol=1e-5,
                                    atol=1e-5)
  split = tuple(spec[0]) if isinstance(spec[0], tuple) else (spec[0],)
  assert all(c.kind == "all-reduce" and c.axes == split for c in plan.collectives), plan.explain()
  assert bool(plan.collectives) == (rows > 1), plan.explain()  # one row: whole on every device


SUM_GATHERED = {  # (fn, args, spec, mesh): an uneven result padded to at least twice its rows
    "cholesky_of_3_matrices_over_8": (jnp.linalg.cholesky, lambda: (np.stack(
        [np.eye(4) * (2 + k) for k in range(3)]).astype(np.float32),), P("x"), "x8"),
    "cumsum_of_3_rows_over_8": (lambda x: jnp.cumsum(x, 0), lambda: (data((3, 3)),),
                                P(AB), "a2b4"),
    "rows_1_to_5_over_8": (lambda x: x[1:5, 2:10], lambda: (data((8, 16)),), P("x"), "x8"),
    "a_bool_slice": (lambda x: x[:3] > 0, lambda: (data((8, 16)),), P("x"), "x8"),
    "an_int32_slice_over_two_axes": (lambda x: (x[:3] * 10).astype(I32),
                                     lambda: (data((8, 16)),), P(("b", "a")), "a2b4"),
    "nan_and_inf_rows": (lambda x: x[:3] * jnp.asarray([np.nan, 1, -0.0, np.inf] * 4, F32),
                         lambda: (data((8, 16)),), P("x"), "x8"),
}


@pytest.mark.parametrize("name", SUM_GATHERED)
def test_a_sparse_uneven_result_is_gathered_by_a_sum(name):
  """Returned whole, an uneven dim padded to at least twice its rows (3 rows in blocks of one
  over 8 devices) is gathered as XLA gathers it: each block placed in zeros of the whole dim and
  all-reduced, whose buffer is the dim unpadded (no more bytes sent than an all-gather of the
  padded blocks; cholesky of f32[3,4,4] 192 B per device, was 512 B)."""
  fn, args, spec, mesh = SUM_GATHERED[name]
  plan = assert_partitioned_matches(fn, args(), (spec,), mesh)
  assert "all-gather" not in {c.kind for c in plan.collectives}, plan.explain()
