"""The plan says what a GSPMD expert predicts, and no more bytes than XLA's own choice."""
import jax
import jax.numpy as jnp
from jax import lax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import spmd
import workloads
from helpers import assert_partitioned_matches
from spmd.hlo import collective_bytes

TOL = 1e-4


@pytest.fixture(scope="module")
def mesh():
  return spmd.make_mesh({"data": 2, "model": 4})


def test_megatron_mlp_forward_needs_one_all_reduce_over_model(mesh):
  def mlp(x, w1, w2):
    return jax.nn.gelu(x @ w1) @ w2

  args = (jnp.ones((8, 16)), jnp.ones((16, 32)) / 16, jnp.ones((32, 16)) / 32)
  plan = assert_partitioned_matches(
      mlp, args, (P("data", None), P(None, "model"), P("model", None)), mesh, rtol=TOL, atol=TOL)
  kinds = [(c.kind, c.axes) for c in plan.collectives]
  assert kinds in ([("all-reduce", ("model",))], [("reduce-scatter", ("model",))]), kinds
  assert plan.out_specs == P("data", None)


def test_megatron_mlp_training_step(mesh):
  w = workloads.mlp(layout="megatron")
  plan = spmd.partition(w.fn, mesh=mesh, in_specs=w.in_specs).plan(*w.args)
  # forward: the logits of the row-split W2 (no gradient flows into the input x)
  over_model = [c for c in plan.collectives if "model" in c.axes]
  # (the psum of the logits waits for their first consumer)
  assert [(c.kind, c.shape) for c in over_model] == [("all-reduce", "float32[16,16]")]
  # the rest is data parallelism: one all-reduce per weight gradient, one for the loss
  rest = [c for c in plan.collectives if c not in over_model]
  assert all(c.kind == "all-reduce" and c.axes == ("data",) for c in rest)
  assert len(rest) == 3


def test_data_parallel_gradient_one_all_reduce_per_parameter(mesh):
  params = {"w1": jnp.ones((16, 32)) / 16, "b1": jnp.zeros((32,)), "w2": jnp.ones((32, 4)) / 32}

  def loss(p, x, y):
    h = jnp.tanh(x @ p["w1"] + p["b1"])
    return ((h @ p["w2"] - y) ** 2).mean()

  x, y = jnp.linspace(0, 1, 8 * 16).reshape(8, 16), jnp.ones((8, 4))
  plan = assert_partitioned_matches(jax.grad(loss), (params, x, y),
                                    (P(), P(("data", "model")), P(("data", "model"))), mesh,
                                    rtol=TOL, atol=TOL)
  reductions = [c for c in plan.collectives if c.kind in ("all-reduce", "reduce-scatter")]
  assert len(reductions) == len(params)
  assert all(set(c.axes) == {"data", "model"} for c in reductions)
  assert not [c for c in plan.collectives if c.kind == "all-gather"]


@pytest.mark.parametrize("make", [workloads.mlp, lambda: workloads.mlp(layout="dp"),
                                  workloads.transformer, workloads.convnet],
                         ids=["mlp-megatron", "mlp-dp", "transformer", "convnet"])
def test_no_more_bytes_than_xla_and_plan_matches_hlo(mesh, make):
  w = make()
  plan = assert_partitioned_matches(w.fn, w.args, w.in_specs, mesh, rtol=TOL, atol=TOL,
                                    reference=jax.jit(w.fn))
  named = lambda tree: jax.tree.map(lambda s: NamedSharding(mesh, s), tree,  # noqa: E731
                                    is_leaf=lambda s: isinstance(s, P))
  xla = jax.jit(w.fn, in_shardings=named(w.in_specs), out_shardings=named(plan.out_specs))
  assert plan.total_bytes <= collective_bytes(xla.lower(*w.args).compile().as_text())


def test_explain_lists_every_op_with_source_and_totals(mesh):
  def f(x, w):
    h = spmd.annotate(x @ w, P("data", "model"))
    return jnp.tanh(h).sum(0)

  p = spmd.partition(f, mesh=mesh, in_specs=(P("data", None), P(None, "model")))
  plan = p.plan(jnp.ones((8, 16)), jnp.ones((16, 32)))
  text = plan.explain()
  ops = [r for r in plan.rows if not r.primitive.startswith("output")]
  assert len(ops) == 4  # dot_general, annotation, tanh, reduce_sum
  # the partial sum over data is reduced where it is needed whole: at the output
  assert [r.primitive for r in plan.rows[4:]] == ["output[0]"]
  for row in ops:
    assert row.primitive in text and "test_plan.py" in row.source
  assert "annotation at tests/test_plan.py" in text or "annotation at test_plan.py" in text
  assert "<- op 1 (backward via op 1)" in text  # the dot took the annotation's sharding
  assert "all-reduce(data)" in text  # the sum over the data-sharded dim
  assert text.splitlines()[-1].startswith("collectives per device: all-reduce x1")


def test_collective_records_name_op_and_source(mesh):
  def f(x):
    return jnp.exp(x.sum())

  plan = spmd.partition(f, mesh=mesh, in_specs=P("data")).plan(jnp.ones((8,)))
  (c,) = plan.collectives
  assert (c.kind, c.axes, c.bytes, c.primitive) == ("all-reduce", ("data",), 4, "exp")
  assert (c.tensor, c.before, c.after) == ("operand 0", "P() partial-sum(data)", "P()")
  assert c.op == plan.rows[1].index and "test_plan.py" in c.source


def _rnn(x, w):
  def body(h, xt):
    h = jnp.tanh(h @ w + xt)
    return h, h.sum()
  return jax.lax.scan(body, jnp.zeros((x.shape[1],)), x)


def _loop(x, w):
  return jax.lax.fori_loop(0, 3, lambda i, h: jnp.tanh(h @ w) + i, x)


def _branch(x, w):
  return jax.lax.cond(x.mean() > -0.5,  # far from the mean 0: no rounding decides it
                       lambda a: a @ w, lambda a: -a, x)


@pytest.mark.parametrize("fn, specs, expected", [
    (_rnn, (P(None, "model"), P(None, "model")), [("all-gather", 64), ("all-reduce", 4)]),
    (_loop, (P("data", None), P(None, "model")), [("all-gather", 256)]),
    (_branch, (P("data", None), P()), [("all-reduce", 4)]),
], ids=["scan", "fori_loop", "cond"])
def test_control_flow_plans_match_hlo_and_xla(mesh, fn, specs, expected):
  """An axis wanted by both the contraction and the result: gathering the small carry beats
  all-to-all of the weight plus reduce-scatter of the product."""
  x = jnp.linspace(-1, 1, 8 * 16).reshape(8, 16)
  w = jnp.linspace(-1, 1, 16 * 16).reshape(16, 16) / 4
  plan = assert_partitioned_matches(fn, (x, w), specs, mesh, rtol=TOL, atol=TOL)
  assert sorted((c.kind, c.bytes) for c in plan.collectives) == expected
  named = lambda tree: jax.tree.map(lambda s: NamedSharding(mesh, s), tree,  # noqa: E731
                                    is_leaf=lambda s: isinstance(s, P))
  xla = jax.jit(fn, in_shardings=named(specs), out_shardings=named(plan.out_specs))
  assert plan.total_bytes <= collective_bytes(xla.lower(x, w).compile().as_text())


def test_per_call_bytes_count_loop_trips():
  """A collective inside a scan of 10 layers runs 10 times per call; nested scans multiply; a
  while loop's trip count is unknown, and the plan says so."""
  mesh = spmd.make_mesh({"data": 2, "model": 4})

  def layers(x, ws):
    def layer(h, w):
      return jnp.tanh(h @ w), None

    def block(h, w_pair):
      return jax.lax.scan(layer, h, w_pair)[0], None

    h, _ = jax.lax.scan(layer, x, ws)                        # 10 trips
    h, _ = jax.lax.scan(block, h, ws.reshape(5, 2, 16, 16))   # 5 x 2 trips
    return jax.lax.while_loop(lambda c: c[1] < 3,
                              lambda c: (jnp.tanh(c[0] @ ws[0]), c[1] + 1), (h, 0))[0]

  x, ws = jnp.ones((8, 16)), jnp.ones((10, 16, 16)) / 16
  plan = assert_partitioned_matches(layers, (x, ws), (P("data", None), P(None, "model", None)),
                                    mesh, rtol=1e-5, atol=1e-6)
  trips = sorted((c.trips or 0) for c in plan.collectives)
  assert trips == [0, 10, 10], plan.explain()  # 0: the while loop's (unknown)
  per_layer = plan.collectives[0].bytes
  assert all(c.bytes == per_layer for c in plan.collectives)
  assert plan.total_bytes == 3 * per_layer  # as the compiled program lists them
  assert plan.step_bytes == (10 + 10 + 1) * per_layer
  assert any("while loop whose trip count is unknown" in w for w in plan.warnings)
  assert "per call (loop trips counted)" in plan.explain()


SLICED_CONCATENATES = {  # a slice reading one piece of a concatenate: the others are dead
    "partition_then_first_k": (lambda x: jnp.sort(jnp.partition(x, 2, axis=1)[:, :3], axis=1),
                               (6, 10), P("a", "b"), {"top_k": 1}),
    "strided_rows_of_the_first_piece": (
        lambda x: jnp.concatenate([jnp.sort(x, 1), jnp.cumsum(x, 1)], 1)[:, 1:9:3],
        (6, 10), P("a", "b"), {"sort": 1, "cumsum": 0}),
    "the_second_piece_strided": (
        lambda x: jnp.concatenate([jnp.sort(x, 1), jnp.cumsum(x, 1)], 1)[:, 10:16:2],
        (6, 10), P("a", "b"), {"sort": 0, "cumsum": 1}),
    "rows_of_the_first_piece_of_a_sharded_dim": (
        lambda x: jnp.concatenate([x, jnp.sort(x, 0)], 0)[2:7], (8, 16), P("b"), {"sort": 0}),
}


@pytest.mark.parametrize("name", SLICED_CONCATENATES)
def test_a_slice_of_one_piece_of_a_concatenate_plans_that_piece_alone(name):
  """XLA's simplifier makes such a slice a slice of the piece, and the other pieces' ops (a
  top_k, a sort, a cumulative sum and their gathers) drop out: the plan counts them no more."""
  fn, shape, spec, counts = SLICED_CONCATENATES[name]
  x = jax.random.normal(jax.random.key(0), shape)
  plan = assert_partitioned_matches(fn, (x,), (spec,), "a2b4")
  ran = [row.primitive for row in plan.rows]
  assert "concatenate" not in ran, plan.explain()
  assert {p: ran.count(p) for p in counts} == counts, plan.explain()


_X, _W, _ONE = jax.random.normal(jax.random.key(1), (8, 8)), jax.random.normal(
    jax.random.key(2), (8, 8)), jnp.float32(1.0)
DEAD_RESULTS = {  # control flow whose results, carries or operands nothing reads
    "grad_of_a_sum_of_a_cond": (jax.grad(lambda x, w, p: jnp.sum(lax.cond(
        p > 0, lambda: jnp.sin(x) @ w, lambda: x @ w)), argnums=(0, 1)), (_X, _W, _ONE)),
    "one_result_of_a_cond": (lambda x, w, p: lax.cond(
        p > 0, lambda: (x @ w, x.sum()), lambda: (x @ w.T, x.max()))[1], (_X, _W, _ONE)),
    "one_result_of_a_switch": (lambda x, w, p: lax.switch(
        (p > 0).astype(jnp.int32), [lambda: (x @ w, x.sum()), lambda: (x @ w.T, x.max()),
                                    lambda: (x, x.min())])[1], (_X, _W, _ONE)),
    "a_fori_carry_read_by_nothing": (lambda x, w: lax.fori_loop(
        0, 3, lambda i, c: (jnp.sin(c[0]), c[1] @ w), (x, x))[0], (_X, _W)),
    "a_while_carry_read_by_nothing": (lambda x, w: lax.while_loop(
        lambda c: c[2] < 3, lambda c: (jnp.sin(c[0]), c[1] @ w, c[2] + 1), (x, x, 0))[0],
        (_X, _W)),
    "two_carries_reading_only_each_other": (lambda x, w: lax.fori_loop(
        0, 3, lambda i, c: (jnp.sin(c[0]), c[2] @ w, c[1] @ w.T), (x, x, x))[0], (_X, _W)),
    "a_scan_carry_beside_stacked_results": (lambda x, w: lax.scan(
        lambda c, a: ((jnp.sin(c[0]), c[1] @ w), c[0].sum(0) * a), (x, x), jnp.arange(3.0))[1],
        (_X, _W)),
}


@pytest.mark.parametrize("name", DEAD_RESULTS)
def test_dead_results_of_control_flow_leave_the_plan(name):
  """XLA drops a conditional's results nothing reads (the forward result of jax.grad of a sum
  of a cond) and a loop's carries nothing reads, with the ops computing them: so does the plan
  (it priced their collectives, which the compiled program does not run)."""
  fn, args = DEAD_RESULTS[name]
  plan = assert_partitioned_matches(fn, args, (P(None, "x"), P("x"), P())[:len(args)], "x8")
  dots = [row for row in plan.rows if row.primitive == "dot_general"]
  assert len(dots) == (4 if name == "grad_of_a_sum_of_a_cond" else 0), plan.explain()


def test_a_carry_a_live_carry_reads_stays():
  """A carry read by nothing after the loop but added into a live one each trip is live."""
  fn = lambda x, w: lax.fori_loop(0, 3, lambda i, c: (jnp.sin(c[0]) + c[1], c[1] @ w),  # noqa
                                  (x, x))[0]
  plan = assert_partitioned_matches(fn, (_X, _W), (P(None, "x"), P("x")), "x8")
  assert plan.total_bytes > 0, plan.explain()


KNOWN_BRANCHES = {  # a cond or switch whose index is known when the program is built
    "cond_by_a_python_bool": lambda x, w: lax.cond(True, lambda: x @ w, lambda: x @ w.T),
    "switch_by_an_index_past_the_last": lambda x, w: lax.switch(
        5, [lambda: x @ w, lambda: x @ w.T]),
    "switch_by_a_negative_index": lambda x, w: lax.switch(-1, [lambda: x @ w,
                                                               lambda: jnp.sin(x)]),
    "grad_of_a_cond_by_a_python_bool": jax.grad(lambda x, w: jnp.sum(lax.cond(
        False, lambda: x @ w, lambda: jnp.tanh(x) @ w.T)), argnums=(0, 1)),
    "switch_inside_a_loop": lambda x, w: lax.fori_loop(
        0, 2, lambda i, c: lax.switch(1, [lambda: c @ w, lambda: jnp.sin(c)]), x),
}


@pytest.mark.parametrize("name", KNOWN_BRANCHES)
def test_a_cond_by_a_known_index_is_the_branch_it_picks(name):
  """XLA inlines a conditional whose index is a constant (JAX clamps a switch's): the plan
  prices that branch alone (it priced every branch's collectives)."""
  plan = assert_partitioned_matches(KNOWN_BRANCHES[name], (_X, _W), (P(None, "x"), P("x")), "x8")
  assert not any(row.primitive == "cond" for row in plan.rows), plan.explain()


SUNK_CONSTANTS = {  # a constant read by a cond's branches or a loop's body (fn, args, specs, mesh)
    "ones_into_both_branches": (
        lambda x, p: lax.cond(p > 0, lambda c: (c * x).sum(0), lambda c: c.sum(0),
                              jnp.ones((8, 8))), (_X, _ONE), (P("x"), P()), "x8"),
    "grad_of_a_sum_of_a_cond_2x4": (jax.grad(lambda x, w, p: jnp.sum(lax.cond(
        p > 0, lambda: jnp.sin(x) @ w, lambda: x @ (w * 2))), argnums=(0, 1)),
        (_X, _W, _ONE), (P("a", "b"), P("b"), P()), "a2b4"),
    "grad_of_a_sum_of_a_cond_2x2x2": (jax.grad(lambda x, w, p: jnp.sum(lax.cond(
        p > 0, lambda: jnp.sin(x) @ w, lambda: x @ (w * 2))), argnums=(0, 1)),
        (_X, _W, _ONE), (P("a", "b"), P("b", "c"), P()), "a2b2c2"),
    "a_mask_into_both_branches": (
        lambda x, p: lax.cond(p > 0, lambda m: (m * x).sum(1), lambda m: (m + x).sum(1),
                              jnp.tril(jnp.ones((8, 8)))), (_X, _ONE), (P(None, "x"), P()), "x8"),
    "ones_read_by_a_scan_body": (lambda x: lax.scan(
        lambda c, a: (c + (a * jnp.ones((8, 8))).sum(0), c.sum()), jnp.zeros(8), x)[0],
        (_X,), (P("x"),), "x8"),
    "an_identity_read_by_a_while_body": (lambda x, w: lax.while_loop(
        lambda c: c[1] < 3, lambda c: (c[0] @ w + jnp.eye(8).sum(0), c[1] + 1), (x, 0))[0],
        (_X, _W), (P(None, "x"), P("x")), "x8"),
}


@pytest.mark.parametrize("name", SUNK_CONSTANTS)
def test_constants_read_inside_control_flow_are_made_there(name):
  """XLA sinks a constant operand into the branches and loop bodies reading it, where each use
  takes it in its own sharding (a branch summing ones sums a replicated block, folded; the
  cotangent of jax.grad's sum is made in each branch): the plan prices that (it reduced and
  gathered the constant as the other branch's sharding asked)."""
  fn, args, specs, mesh = SUNK_CONSTANTS[name]
  assert_partitioned_matches(fn, args, specs, mesh)
