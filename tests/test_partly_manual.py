"""A user's ``jax.shard_map`` manual over only some mesh axes (``axis_names=``) inside a
partitioned function (spmd/partition/partly_manual.py), after JAX's shard_map_test.py partial-auto
cases: the body's blocks along the manual axes are stacked on leading dims, its collectives over
them become ops on those dims, and spmd partitions the whole over every axis. Each case checks
values against the unpartitioned function, the plan against the compiled HLO and that no op ran
replicated (tests/helpers.py)."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import lax
from jax.sharding import PartitionSpec as P

import spmd
from tests.helpers import assert_partitioned_matches as _assert_partitioned_matches
from tests.helpers import get_mesh, randn, xla_bytes

MESH = "a2b4"


def assert_partitioned_matches(fn, args, in_specs, mesh, above_xla=False, **kwargs):
  """helpers' check against ``jax.jit`` of ``fn`` (JAX runs a partly manual shard_map only
  under jit), and no more bytes than XLA's partitioner moves for it (unless ``above_xla``: a
  known gap, docs/ARCHITECTURE.md)."""
  plan = _assert_partitioned_matches(fn, args, in_specs, mesh, reference=jax.jit(fn), **kwargs)
  xla = xla_bytes(fn, args, in_specs, mesh, kwargs.get("out_specs"))
  assert (plan.total_bytes > xla) == above_xla, (plan.total_bytes, xla, plan.explain())
  return plan


def smap(body, in_specs, out_specs, axis_names=frozenset({"a"}), mesh=MESH, **kwargs):
  return jax.shard_map(body, mesh=get_mesh(mesh), in_specs=in_specs, out_specs=out_specs,
                       axis_names=set(axis_names), **kwargs)


@pytest.mark.parametrize("check_vma", [True, False])
def test_psum_over_the_manual_axis_with_a_matmul_over_the_auto_one(check_vma):
  """The body's matmul runs on whole rows along "b" (automatic inside): spmd shards it over "b"
  as propagation chooses; the psum over "a" is a sum over the stacked blocks."""
  def f(x, w):
    def body(xb, w):
      return lax.psum(jnp.tanh(xb @ w), "a")
    return smap(body, (P("a", None), P()), P(), check_vma=check_vma)(x, w) * 2

  x, w = randn(16, 8), randn(8, 32, seed=1)
  assert_partitioned_matches(f, (x, w), (P("a", None), P(None, "b")), MESH, rtol=1e-5)


def test_an_unchecked_body_returning_a_varying_value_as_replicated_gives_the_first_block():
  """With check_vma=False the user may return a value that varies over "a" with out_specs
  leaving "a" out: JAX returns the first block's value, and so does spmd, sending that block to
  the devices of the other (16 B; XLA leaves each device its own block, 0 B)."""
  def f(x):
    return smap(lambda b: jnp.cos(b) * 2, P("a"), P(), check_vma=False)(x)

  assert_partitioned_matches(f, (randn(8),), (P("a"),), MESH, above_xla=True)


def test_every_collective_over_the_manual_axis_in_a_checked_body():
  def body(x):
    i = lax.axis_index("a")
    return (x * i + lax.pmax(x, "a"),
            lax.all_gather(x, "a", tiled=True),
            lax.all_gather(x, "a", axis=1),
            lax.psum_scatter(x, "a", scatter_dimension=0, tiled=True),
            lax.all_to_all(x, "a", 0, 1, tiled=True),
            lax.ppermute(x, "a", [(0, 1), (1, 0)]),
            lax.pmean(x.sum(0), "a"))

  def f(x):
    return smap(body, P("a", None), (P("a"), P("a"), P("a"), P("a"), P("a"), P("a"), P()))(x)

  assert_partitioned_matches(f, (randn(16, 8),), (P("a", "b"),), MESH)


def test_a_sharding_constraint_on_the_auto_axis_inside_the_body():
  def f(x):
    def body(xb):
      h = lax.with_sharding_constraint(jnp.sin(xb), P(None, "b"))
      return h.sum(1, keepdims=True) + lax.psum(h.sum(0), "a")[None, :1]
    return smap(body, P("a", None), P("a", None))(x)

  with jax.set_mesh(get_mesh(MESH)):
    assert_partitioned_matches(f, (randn(16, 8),), (P("a", None),), MESH, rtol=1e-5)


def test_two_manual_axes_of_a_three_axis_mesh():
  """Manual over "a" and "c", automatic over "b": a dim split over both manual axes stacks two
  leading dims, and a psum over both sums them. x arrives split over "b" and is wanted over
  "a": one collective permute, 48 B, as XLA's (it was gathered, 96 B, before SwapAxes)."""
  def f(x, y):
    def body(xb, yb):
      return lax.psum(xb.sum(0), ("a", "c")) + lax.psum(yb.sum(), "c"), xb * lax.axis_index("c")
    return smap(body, (P(("a", "c"), None), P("c")), (P(), P(("a", "c"), None)),
                axis_names={"a", "c"}, mesh="a2b2c2")(x, y)

  assert_partitioned_matches(f, (randn(8, 6), randn(4, seed=1)), (P("b", None), P()), "a2b2c2",
                             rtol=1e-5)


RING = tuple((i, (i + 1) % 4) for i in range(4))
SEVERAL_AXES = {
    "all_gather": lambda b, axes: lax.all_gather(b, axes, tiled=True),
    "all_gather_stacked": lambda b, axes: lax.all_gather(b, axes, axis=1),
    "psum_scatter": lambda b, axes: lax.psum_scatter(b, axes, scatter_dimension=1, tiled=True),
    "psum_scatter_stacked": lambda b, axes: lax.psum_scatter(b[:, :4], axes, scatter_dimension=1),
    "ppermute_ring": lambda b, axes: lax.ppermute(b, axes, RING),
    "ppermute_swaps": lambda b, axes: lax.ppermute(b, axes, ((0, 3), (3, 0), (1, 2), (2, 1))),
    "ppermute_partial": lambda b, axes: lax.ppermute(b, axes, ((0, 2), (1, 0))),
}


@pytest.mark.parametrize("name,check_vma,axes", [
    (name, check, axes) for name in SEVERAL_AXES for check in (False, True)
    for axes in (("a", "c"), ("c", "a"))
    if not (check and name.startswith("all_gather"))  # checked, an all_gather is not P()
    and not (name.startswith("ppermute") and axes == ("c", "a"))])  # JAX 0.12 refuses it
def test_collectives_over_two_manual_axes(name, check_vma, axes):
  """all_gather, psum_scatter and ppermute over both manual axes of a region manual over "a"
  and "c" (automatic over "b"), named in either order (a ppermute's in mesh order, the only one
  JAX 0.12 takes): one collective per axis, the blocks ordered as the axes are named, a
  ppermute by one roll along each axis it moves blocks over. JAX's batching of them refused the
  mapped axis (an AssertionError)."""
  collective = SEVERAL_AXES[name]

  def f(x):
    out_spec = P() if name.startswith("all_gather") else P(axes)
    return smap(lambda b: (collective(b, axes), lax.psum(b.sum(), axes)), P(axes),
                (out_spec, P()), axis_names={"a", "c"}, mesh="a2b2c2", check_vma=check_vma)(x)

  # a ppermute over both moves its blocks one axis at a time (docs/ARCHITECTURE.md, Known gaps)
  assert_partitioned_matches(f, (randn(16, 8),), (P(axes, "b"),), "a2b2c2", rtol=1e-5,
                             above_xla=name.startswith("ppermute"))


def test_gradient_through_a_partly_manual_region():
  def loss(w, x):
    def body(w, xb):
      return lax.psum(jnp.sum(jnp.tanh(xb @ w) ** 2), "a")
    return smap(body, (P(), P("a", None)), P())(w, x)

  w, x = randn(8, 16), randn(16, 8, seed=1)
  assert_partitioned_matches(jax.grad(loss), (w, x), (P(None, "b"), P("a", None)), MESH,
                             rtol=1e-4, atol=1e-5)


def test_a_scan_inside_the_body():
  """A scan in the body runs on the stacked blocks (its body mapped too); its carry starts
  typed varying over the manual axis, as JAX asks."""
  def f(x):
    def body(xb):
      def step(c, row):
        return c + row, c * row
      c, ys = lax.scan(step, lax.pcast(jnp.zeros(xb.shape[1:]), "a", to="varying"), xb)
      return lax.psum(c, "a"), ys
    return smap(body, P("a", None), (P(), P("a", None)))(x)

  assert_partitioned_matches(f, (randn(8, 12),), (P("a", "b"),), MESH, rtol=1e-5)


def test_pipeline_style_ring_over_the_manual_axis_in_a_loop():
  """A pipeline's stage loop: each stage applies its weights and passes its activation to the
  next over the manual axis, inside a fori_loop (collectives in a nested body, checked): a roll
  of the stacked blocks, one collective permute per step as XLA's."""
  def f(w, x):
    def body(wb, xb):
      def step(_, h):
        h = jnp.tanh(h @ wb[0])
        return lax.ppermute(h, "a", [(0, 1), (1, 0)])
      return lax.fori_loop(0, 2, step, lax.pcast(xb, "a", to="varying"))
    return smap(body, (P("a", None, None), P()), P("a", None))(w, x)

  w, x = randn(2, 8, 8) / 3, randn(4, 8, seed=1)
  assert_partitioned_matches(f, (w, x), (P("a", None, "b"), P()), MESH, rtol=1e-5)


@pytest.mark.parametrize("perm", [
    [(0, 1), (1, 2), (2, 3), (3, 0)],  # a ring: a roll of the stacked blocks
    [(0, 1), (1, 2), (2, 3)],  # a shift without wrap-around (the last stage's block dropped)
    [(0, 2), (1, 3), (2, 0), (3, 1)],
    [(2, 0)],
])
def test_ppermute_over_a_manual_axis_of_four_stages(perm):
  """Every pair moving by one shift is a roll of the stacked blocks (a collective permute, no
  more bytes than XLA); destinations no pair names get zeros, as under ppermute."""
  def f(x):
    return smap(lambda b: lax.ppermute(jnp.sin(b), "b", perm), P("b", None), P("b", None),
                axis_names={"b"})(x)

  assert_partitioned_matches(f, (randn(8, 6),), (P("b", "a"),), MESH)


@pytest.mark.parametrize("perm", [
    [(0, 1), (1, 0), (2, 3), (3, 2)],  # swapping neighbours: shifts +1 and -1
    [(0, 2), (1, 1), (3, 0)],  # a block kept in place, one moved by 2, one by 1; 2 gets none
])
def test_a_permutation_of_several_shifts_is_one_roll_per_shift(perm):
  """Pairs that move by different shifts roll the stacked blocks once per shift (but 0), 32 B
  per device, where XLA permutes them in one collective, 16 B: a known gap (a gather of the
  blocks moved 64 B)."""
  def f(x):
    return smap(lambda b: lax.ppermute(b * 2, "b", perm), P("b"), P("b"), axis_names={"b"})(x)

  assert_partitioned_matches(f, (randn(16),), (P("b"),), MESH, above_xla=True)


def test_the_region_runs_on_blocks_the_user_gave_other_shardings():
  """Operands arriving sharded over the auto axis, results read sharded otherwise after the
  region: spmd reshards around the stacked blocks as around any op."""
  def f(x):
    y = smap(lambda b: b * lax.axis_index("a") + 1.0, P(None, "a"), P(None, "a"))(x)
    return y.T @ x

  assert_partitioned_matches(f, (randn(8, 16),), (P("b", None),), MESH, out_specs=P("a", "b"),
                             rtol=1e-5)


def test_the_plan_names_the_body_lines_and_prices_the_psum():
  """The body's ops keep their own source lines in the plan; its psum over "a" is a sum over the
  stacked blocks whose reduction (32 B per device) the plan prices where the sum is read."""
  def f(x):
    def body(xb):
      return lax.psum(xb.sum(0), "a")
    return smap(body, P("a", None), P())(x)

  plan = spmd.partition(f, mesh=get_mesh(MESH), in_specs=P("a", None)).plan(
      jax.ShapeDtypeStruct((16, 8), np.float32))
  assert [r.primitive for r in plan.rows if r.source.endswith("f.<locals>.body)")] == [
      "reduce_sum", "reduce_sum"], plan.explain()
  assert [(c.kind, c.axes, c.bytes) for c in plan.collectives] == [("all-reduce", ("a",), 32)]


def test_ring_attention_over_a_manual_sequence_axis():
  """Ring attention as written with shard_map over "b" (the sequence), the batch automatic over
  "a": each step attends to the visiting key/value block and passes it on around the ring."""
  def attention(q, k, v):
    def body(q, k, v):
      def step(_, carry):
        o, total, top, k, v = carry
        s = jnp.einsum("bqd,bkd->bqk", q, k)
        new_top = jnp.maximum(top, s.max(-1))
        p = jnp.exp(s - new_top[..., None])
        scale = jnp.exp(top - new_top)
        ring = [(j, (j + 1) % 4) for j in range(4)]
        return (o * scale[..., None] + jnp.einsum("bqk,bkd->bqd", p, v),
                total * scale + p.sum(-1), new_top, lax.ppermute(k, "b", ring),
                lax.ppermute(v, "b", ring))
      rows = q.shape[:2]
      varying = lambda a: lax.pcast(a, "b", to="varying")  # noqa: E731
      init = (jnp.zeros_like(q), varying(jnp.zeros(rows)), varying(jnp.full(rows, -jnp.inf)),
              k, v)
      o, total, *_ = lax.fori_loop(0, 4, step, init)
      return o / total[..., None]
    return smap(body, (P(None, "b"),) * 3, P(None, "b"), axis_names={"b"})(q, k, v)

  q, k, v = (randn(4, 16, 8, seed=s) for s in range(3))
  assert_partitioned_matches(attention, (q, k, v), (P("a", "b"),) * 3, MESH, rtol=1e-5,
                             atol=1e-5)


def test_expert_parallel_all_to_all_over_a_manual_axis():
  """An MoE layer's dispatch and return by all_to_all over the manual expert axis "b", the
  model dim automatic over "a"."""
  def moe(x, w):
    def body(x, w):
      tokens = lax.all_to_all(x.reshape(4, -1, x.shape[-1]), "b", 0, 0)
      out = lax.all_to_all(jnp.einsum("etd,df->etf", tokens, w[0]), "b", 0, 0)
      return out.reshape(x.shape[0], -1)
    return smap(body, (P("b", None), P("b", None, None)), P("b", None), axis_names={"b"})(x, w)

  x, w = randn(64, 8), randn(4, 8, 8, seed=1)
  assert_partitioned_matches(moe, (x, w), (P("b", "a"), P("b", None, "a")), MESH, rtol=1e-5,
                             atol=1e-5)


def test_fsdp_layers_gathered_over_a_manual_axis_in_a_scan():
  """FSDP as written with shard_map over "a": each layer's weight shard all-gathered inside a
  scan over the layers; the activations' other dim automatic over "b"."""
  def fsdp(ws, x):
    def body(ws, x):
      def layer(h, w):
        return jnp.tanh(h @ lax.all_gather(w, "a", axis=0, tiled=True)), None
      return lax.scan(layer, x, ws)[0]
    return smap(body, (P(None, "a", None), P("a", None)), P("a", None))(ws, x)

  ws, x = randn(3, 8, 8) / 3, randn(16, 8, seed=1)
  assert_partitioned_matches(fsdp, (ws, x), (P(None, "a", None), P("a", "b")), MESH, rtol=1e-5)


def test_smap_is_a_partly_manual_region():
  """``jax.smap`` (a shard_map over one axis, given as in_axes/out_axes) under ``jax.set_mesh``."""
  def f(x):
    return jax.smap(lambda b: lax.psum(jnp.cos(b), "a") * 2, in_axes=0, out_axes=None,
                    axis_name="a")(x)

  with jax.set_mesh(get_mesh(MESH)):
    assert_partitioned_matches(f, (randn(8, 6),), (P("a", "b"),), MESH, rtol=1e-5)


def test_nested_regions_keep_the_outer_manual_axis_on_the_inner_blocks():
  """A shard_map manual over 'b' inside one manual over 'a': the inner region's blocks stay
  split over 'a' on their stacked dim (vmap's ``spmd_axis_name`` reaches ``spmd.annotate``'s
  batching rule as it reaches with_sharding_constraint's), where they were gathered over 'a'
  (256 B, XLA 64 B)."""
  def inner(block):  # on the outer region's mesh, as JAX requires
    return jax.shard_map(lambda b: lax.psum(b, "b"), in_specs=P(None, "b"),
                         out_specs=P(None, "b"), axis_names={"b"})(block)

  def f(x):
    return smap(inner, P("a"), P("a"), {"a"})(x)

  assert_partitioned_matches(f, (randn(8, 16),), (P("a", "b"),), MESH, rtol=1e-5)


@pytest.mark.parametrize("spmd_axis_name", [None, "a"])
def test_an_annotation_under_vmap_splits_the_mapped_dim_as_with_sharding_constraint(
    spmd_axis_name):
  """``jax.vmap`` of ``spmd.annotate``: the mapped dim is split over ``spmd_axis_name``, else
  left open to propagation (it was pinned whole: 128 B for rows committed over 'a'), as JAX
  batches ``with_sharding_constraint``."""
  f = jax.vmap(lambda r: spmd.annotate(jnp.sin(r), P("b")), spmd_axis_name=spmd_axis_name)
  plan = assert_partitioned_matches(f, (randn(8, 16),), (P("a", "b"),), MESH, rtol=1e-5)
  assert plan.total_bytes == 0, plan.explain()
