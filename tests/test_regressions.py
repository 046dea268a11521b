"""Regressions found by tests/test_property.py: minimal reproducers, one test per bug."""
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import spmd
from helpers import assert_partitioned_matches


def test_reshape_merged_dim_with_a_dropped_major_factor():
  """(1, 4, 4) -> (8, 2) with the input P(None, 'a', ('b', 'c')) and the result propagated to
  P('a', 'c'): the result's merged dim [4 | 2] keeps only 'a' (half of its major factor), so its
  minor factor (also the major factor of the input's last dim) is dropped; the input's last dim
  then kept 'c' on its now-unsharded minor factor and the reshape read a block of columns where
  it needed a stride: wrong values. execution._drop_inexpressible now runs to a fixed point."""
  def f(x):
    return x.reshape(8, 2) + 2

  assert_partitioned_matches(f, (jnp.arange(16, dtype=jnp.int32).reshape(1, 4, 4),),
                             P(None, "a", ("b", "c")), "a2b2c2")


def test_form_passed_through_by_a_reshard_is_reused():
  """P('a') -> P('b') gathers over 'a' (to whole) then slices 'b'; the output then wanted the
  whole array and gathered it again: XLA merged the two identical all-gathers, so the HLO moved
  64 B where the plan said 128 B. schedule.acquire now records every form a transfer passes
  through (and lower keeps them), so later consumers start from them."""
  def f(x):
    return spmd.annotate(x, P("b")) * 2, x

  plan = assert_partitioned_matches(f, (jnp.arange(16, dtype=jnp.float32),), P("a"), "a2b4",
                                    (P("b"), P(None)))
  assert [c.kind for c in plan.collectives] == ["all-gather"]


def test_annotated_value_and_its_operand_share_reshards():
  """``a = annotate(y, P('x', None))`` is ``y`` itself (same form, no transfer); gathering ``a``
  and gathering ``y`` were scheduled as two all-gathers (forms were kept per value, and an
  annotation's result was a new value), which XLA CSEd: HLO 128 B, plan 256 B. An annotation's
  result now shares its operand's forms (schedule.annotation)."""
  def f(x):
    y = x * 2
    a = spmd.annotate(y, P("x", None))
    return spmd.annotate(a, P(None, None)), spmd.annotate(y, P(None, None))

  assert_partitioned_matches(f, (jnp.arange(32, dtype=jnp.float32).reshape(8, 4),),
                             P("x", None), "x8")


def test_two_annotations_of_one_value_share_reshards():
  """``annotate(x, P(None))`` gathers x; the output ``annotate(x, P('x'))`` (x itself) is wanted
  whole too and was gathered a second time, which XLA CSEd: HLO 32 B, plan 64 B. (Shrunk by
  tests/test_property.py from a random program.)"""
  def f(x):
    return spmd.annotate(x, P(None)), spmd.annotate(x, P("x"))

  assert_partitioned_matches(f, (jnp.arange(8, dtype=jnp.int32),), None, "x8", (None, P(None)))


def test_annotation_rows_show_the_reshards_they_cause():
  """Annotations move nothing themselves (their readers reshard, once for every reader), yet
  explain() shows each reshard on the row of the annotation that asked for it."""
  def f(x):
    whole = spmd.annotate(x * 2, P(None, None))
    return jnp.tanh(whole) + 1, whole.sum(0), whole

  plan = assert_partitioned_matches(f, (jnp.arange(32, dtype=jnp.float32).reshape(8, 4),),
                                    P("x", None), "x8")
  (row,) = [r for r in plan.rows if r.primitive == "spmd_annotate"]
  assert [c.kind for c in row.collectives] == ["all-gather"]
  assert [c.kind for c in plan.collectives] == ["all-gather"]  # one gather, three readers


def test_reduction_repeated_through_an_annotation_is_reduced_once():
  """Both einsums pre-sum dim 'a' of x (jnp.einsum sums a dim only one operand has), the second
  through an annotation that leaves x as it is: two reduce_sums of one value, each psum'd over
  'a'. XLA's CSE merged the two all-reduces: HLO 4 B, plan 8 B. The second reduce_sum now
  repeats the first (cse.py) and neither runs nor communicates."""
  def f(x0):
    v1 = jnp.einsum("ab,cb->c", x0, x0)
    v2 = spmd.annotate(x0, P(P.UNCONSTRAINED, None))
    return jnp.einsum("ab,c->bc", v2, v1)

  x0 = jnp.asarray(np.random.default_rng(0).integers(-3, 4, (2, 1), dtype=np.int32))
  plan = assert_partitioned_matches(f, (x0,), (P("a", None),), "a2b2c2")
  assert [c.kind for c in plan.collectives] == ["all-reduce"]


def _sum_twice(annotations):
  """x.sum(0) twice, the second read through ``annotations`` (specs applied in turn)."""
  def f(x):
    y = x
    for spec in annotations:
      y = spmd.annotate(y, spec)
    return jnp.tanh(x.sum(0)), jnp.cos(y.sum(0))
  return f


def test_same_reduction_written_twice_is_reduced_once():
  """The same sum on x, read directly, through one and through two annotations that keep x's
  sharding: one all-reduce."""
  x = jnp.arange(64, dtype=jnp.float32).reshape(8, 8) / 64
  for annotations in [(), (P("x", None),), (P("x", None), P(P.UNCONSTRAINED, None))]:
    plan = assert_partitioned_matches(_sum_twice(annotations), (x,), P("x", None),
                                      {"x": 4, "y": 2})
    assert [c.kind for c in plan.collectives] == ["all-reduce"], annotations


def test_reduction_after_an_annotation_that_moves_data_is_not_merged():
  """When the annotation reshards x (P('x', None) -> P(None, 'x')), the second sum reads another
  layout: the two sums stay two ops and the plan still prices what the program moves."""
  x = jnp.arange(64, dtype=jnp.float32).reshape(8, 8) / 64
  plan = assert_partitioned_matches(_sum_twice((P(None, "x"),)), (x,), P("x", None),
                                    {"x": 4, "y": 2})
  assert sorted(c.kind for c in plan.collectives) == ["all-reduce", "all-to-all"]


def test_random_draws_are_not_merged():
  """Keyed draws from two keys read different values; stateful draws (rng_uniform, no key) are
  two different arrays however equal their params: neither pair is merged."""
  mesh = spmd.make_mesh({"x": 8})

  def keyed(x, key):
    k1, k2 = jax.random.split(key)
    return x + jax.random.uniform(k1, (8,)), x + jax.random.uniform(k2, (8,))

  x, key = jnp.arange(8, dtype=jnp.float32), jax.random.key_data(jax.random.key(0))
  assert_partitioned_matches(keyed, (x, key), (P("x"), None), mesh)
  a, b = spmd.partition(keyed, mesh=mesh, in_specs=(P("x"), None))(x, key)
  assert not np.array_equal(a, b)

  @spmd.partition(mesh=mesh, in_specs=P("x"))
  def stateful(x):
    return x + jax.lax.rng_uniform(0.0, 1.0, (8,)), x + jax.lax.rng_uniform(0.0, 1.0, (8,))

  a, b = stateful(x)
  assert not np.array_equal(a, b)


def test_halo_pieces_of_an_annotated_value_are_exchanged_once():
  """``v1 = annotate(x0, P('x'))`` is x0's buffer; concatenating both shifted pieces of v1 and of
  x0 across shards, and spmd exchanged each piece twice (halo pieces were keyed by the value's
  name), which XLA CSEd: HLO 96 B, plan 112 B. Pieces are now keyed by the buffer. (Found by the
  thorough property profile, --hypothesis-seed=1.)"""
  def f(x0, x1):
    v1 = spmd.annotate(x0, P("x"))
    v3 = jnp.concatenate([v1, x1, x1], axis=0)
    return jnp.concatenate([v3, v1, x0], axis=0), v1

  rng = np.random.default_rng(0)
  args = (jnp.asarray(rng.integers(-3, 4, (8,), dtype=np.int32)),
          jnp.asarray(rng.integers(-3, 4, (4,), dtype=np.int32)))
  assert_partitioned_matches(f, args, (None, None), "x8")


def test_slices_taking_the_same_elements_are_one_slice():
  """``x[::2]`` and ``x[0:1]`` of a 2-element x take the same element with other params; XLA's
  simplifier makes them one slice and merged the two gathers of that element: HLO 4 B, plan 8 B.
  A slice's params are now compared in one canonical form (ir.cse_key). (Found by the thorough
  property profile, --hypothesis-seed=1.)"""
  def f(x0):
    v1 = x0[::2]
    v2 = spmd.annotate(v1, P(None))
    return x0[0:1], v2, v1

  x0 = jnp.asarray(np.random.default_rng(0).integers(-3, 4, (2,), dtype=np.int32))
  plan = assert_partitioned_matches(f, (x0,), (P("a"),), "a2b4")
  assert len(plan.collectives) == 1


def test_strided_slices_with_other_limits_are_one_slice():
  """Limits past the last element taken do not make another slice: ``x[1:8:3]`` is
  ``x[1:10:3]``."""
  def f(x):
    return jnp.sin(x[1:8:3]), jnp.cos(jax.lax.slice(x, (1,), (10,), (3,)))

  x = jnp.arange(16, dtype=jnp.float32) / 16
  plan = assert_partitioned_matches(f, (x,), (P("x"),), "x8")
  assert [r.primitive for r in plan.rows].count("slice") == 1


def test_select_between_one_value_is_that_value():
  """The gradient of ``table.at[ids].set(0.0)`` selects, by a winner mask read from a gather of
  the table's scatter, between two zero arrays: one traced with ``sharding=None``, the other with
  ``P(None, None)`` under the abstract mesh. XLA merges the two zeros and folds the select, so
  the mask, its gather and the gather's all-reduce are dead: HLO 32 B, plan 544 B. ``cse_key``
  now takes a sharding param naming no mesh axis as None, and a select whose cases are all one
  value is that value (ir._dedupe). (tests/test_primitives.py::test_grad_gather_scatter.)"""
  def loss(table, ids):
    return jnp.sum(table.at[ids].set(0.0) ** 2)

  table = jnp.asarray(np.random.default_rng(0).standard_normal((32, 16)), jnp.float32)
  ids = jnp.asarray(np.random.default_rng(1).integers(0, 32, (8,)), jnp.int32)
  plan = assert_partitioned_matches(jax.grad(loss), (table, ids), (P("x"), P("x")), "x8")
  assert [c.kind for c in plan.collectives] == ["all-gather"]


def test_reshapes_back_to_a_values_shape_are_that_value():
  """``sum(expand_dims(v, 0), 0)`` is ``v``: XLA's simplifier folds the chain to nothing, so the
  output's gather of it and the annotation's gather of ``v`` are one: HLO 16 B, plan 32 B. A chain
  of reshapes in effect that gives a value back its own shape is now that value (ir._dedupe).
  (Found by the thorough property profile, --hypothesis-seed=2.)"""
  def f(x0):
    v1 = x0[::2]
    v2 = spmd.annotate(v1, P(None))
    return jnp.sum(jnp.expand_dims(v1, 0), axis=0), v2

  x0 = jnp.asarray(np.random.default_rng(0).integers(-3, 4, (4,), dtype=np.int32))
  plan = assert_partitioned_matches(f, (x0,), (P("b"),), "a2b4")
  # gathered by a sum since round 16: its 2 rows are padded to 4 blocks (reshard.SumGather)
  assert [c.kind for c in plan.collectives] == ["collective-permute", "all-reduce"]


def test_constants_are_folded():
  """``exp`` of a constant annotated ``P('a', 'b')`` ran on those shards and was all-gathered
  over 'b' to be concatenated along dim 1 into a ``P('a', None)`` result; XLA folds the constant
  and drops the all-gather (a broadcast of one value, gathered, is that broadcast): HLO 0 B, plan
  256 B. Ops computing only from constants are now folded when the program is built (fold.py),
  so any block of their result is a local slice. (Found in the sequence-parallel Transformer's
  loss gradient: -1/tokens per token, scattered into the label logits.)"""
  def f(x):
    return jnp.concatenate([x, jnp.exp(spmd.annotate(jnp.full((8, 16), 0.5), P("a", "b")))], 1)

  x = jnp.asarray(np.random.default_rng(0).standard_normal((8, 16)), jnp.float32)
  plan = assert_partitioned_matches(f, (x,), (P("a", None),), "a2b4", P("a", None))
  assert not plan.collectives



SELECTS_ON_CONSTANTS = {
    "true picks the zeros": lambda z, b: jax.lax.select(z == 0, z, b),
    "false picks the zeros": lambda z, b: jax.lax.select(jnp.full(z.shape, 1.0) > 2, b, z),
    "an index picks the zeros": lambda z, b: jax.lax.select_n(
        jnp.full(z.shape, 2, jnp.int32), b, b * 2, z),
    "ldexp of the zeros": lambda z, b: jnp.ldexp(z, jnp.argmax(b).astype(jnp.int32) % 3),
}


@pytest.mark.parametrize("mesh,spec", [("x8", P("x")), ("a2b4", P(("a", "b")))])
@pytest.mark.parametrize("name", SELECTS_ON_CONSTANTS)
def test_a_select_on_a_constant_predicate_is_the_case_it_picks(name, mesh, spec):
  """jax 0.12.1's conjugate gradient scales ``x0 = zeros_like(b)`` by ``jnp.ldexp``, whose bits
  pass a select on ``exp == 0``: a predicate of one value everywhere. XLA's simplifier folds
  such a select to the case it picks, so ``a @ x0`` of a split ``a`` gathers nothing, and the max
  of ``abs(x0)`` reduces nothing: the plan gathered x0 (128 B) and all-reduced that max (4 B),
  x0 taken out of ``device_put((b, x0))`` not being seen as a constant either. Both are now
  seen as XLA sees them (fold.py, ir._chosen_case); only ``abs(b)``'s max all-reduces."""
  pick = SELECTS_ON_CONSTANTS[name]

  def fn(a, b):
    b, zeros = jax.device_put((b, jnp.zeros_like(b)))
    x0 = pick(zeros, b)
    return a @ x0 + b, jnp.abs(x0).max() + jnp.abs(b).max()

  rng = np.random.default_rng(0)
  args = (jnp.asarray(rng.standard_normal((32, 32)), jnp.float32),
          jnp.asarray(rng.standard_normal(32), jnp.float32))
  plan = assert_partitioned_matches(fn, args, (P(spec[0], None), spec), mesh)
  if name != "ldexp of the zeros":  # jax 0.12.1's ldexp selects; older ones multiply
    assert [c.kind for c in plan.collectives] == ["all-reduce"], plan.explain()


def test_an_add_reading_a_calls_literal_argument():
  """``jax.nn.log_sigmoid`` (optax's sigmoid cross entropy) calls a custom_jvp with a literal:
  inlined, an ``add`` reads that literal where its equation names a variable, and the roll
  recognizer (roll.py) hashed it (a literal holding an array is unhashable). It now looks at the
  op's inputs, not the equation's. (Found in flax's VAE example.)"""
  def f(x):
    return jax.nn.log_sigmoid(x) * 2

  x = jnp.asarray(np.random.default_rng(0).standard_normal((8, 16)), jnp.float32)
  assert_partitioned_matches(f, (x,), (P("a", None),), "a2b4")


def test_a_mesh_axis_of_size_one_splits_nothing():
  """Logical rules map names to a mesh axis that may have size 1 (flax's rules on an 8x1 mesh):
  a value moved between dims over it was an all-to-all the plan counted and XLA deletes (a
  gradient's reductions over it were all-reduces). Specs drop such axes when read."""
  def f(x):
    return jnp.tanh(spmd.annotate(x * 2, P(None, "model"))).sum(1)

  x = jnp.asarray(np.random.default_rng(0).standard_normal((8, 16)), jnp.float32)
  plan = assert_partitioned_matches(f, (x,), (P("model", None),), {"data": 8, "model": 1})
  assert not plan.collectives


def test_associative_scan_over_a_sharded_dim():
  """``lax.associative_scan`` halves its dim with strided slices down to one row, then slices
  that row's odd rows: an empty result, whose window had no output block to divide by (a
  ZeroDivisionError in halo_geometry). An op with empty results is a constant, as XLA's simplifier
  makes it (fold.py)."""
  x = jnp.asarray(np.random.default_rng(0).standard_normal((16, 4)), jnp.float32)
  assert_partitioned_matches(lambda x: jax.lax.associative_scan(jnp.add, x, axis=0), (x,),
                             (P("x"),), "x8")


def test_empty_slices_move_nothing():
  """Empty slices of a sharded dim, at the top level and in a scan body, read nothing: no
  collective for them, and no empty operand handed to the manual computation (Shardy rejects a
  program whose manual computation reads only an empty constant)."""
  def scanned(x):
    def body(c, r):
      return c + r[2:2].sum() + r.sum(), r[1::2][:0]
    return jax.lax.scan(body, 0., x)

  x = jnp.asarray(np.random.default_rng(0).standard_normal((16, 4)), jnp.float32)
  plan = assert_partitioned_matches(lambda x: x[3:3].sum(0) + x[1::2][:0].sum(0), (x,),
                                    (P("x"),), "x8")
  assert not plan.collectives
  plan = assert_partitioned_matches(scanned, (x.T,), (P(None, "x"),), "x8")
  assert [c.kind for c in plan.collectives] == ["all-reduce"]


def test_platform_dependent_code_is_the_branch_for_the_mesh_platform():
  """``jnp.diagonal`` (so ``jnp.trace``) is ``lax.platform_dependent``: a cond over a
  ``platform_index`` whose unused branch JAX drops when it lowers. spmd planned both branches'
  collectives (36 B of all-reduce against the compiled 20 B); it now inlines the branch for the
  mesh's platform, as JAX does."""
  x = jnp.asarray(np.random.default_rng(0).standard_normal((16, 16)), jnp.float32)
  plan = assert_partitioned_matches(lambda x: jnp.diagonal(x) + jnp.trace(x), (x,),
                                    (P("a", "b"),), "a2b4")
  assert "cond" not in {row.primitive for row in plan.rows}
  assert_partitioned_matches(lambda x: jax.lax.platform_dependent(x, cpu=jnp.sin, default=jnp.cos),
                             (x,), (P("a", "b"),), "a2b4")


def test_batched_solve_and_inverse_split_their_batch():
  """``jnp.linalg.solve`` / ``inv`` are ``custom_linear_solve``, which ran replicated (its
  operands gathered whole); it is now its solve body, as JAX lowers it, whose batched LU and
  triangular solves keep the batch split: nothing moves, forward or backward."""
  rng = np.random.default_rng(0)
  a = jnp.asarray(rng.standard_normal((8, 4, 4)) + 4 * np.eye(4), jnp.float32)
  b = jnp.asarray(rng.standard_normal((8, 4, 1)), jnp.float32)
  plan = assert_partitioned_matches(jnp.linalg.inv, (a,), (P("x"),), "x8")
  assert not plan.collectives
  grad = jax.grad(lambda a, b: jnp.linalg.solve(a, b).sum())
  plan = assert_partitioned_matches(grad, (a, b), (P("x"), P("x")), "x8", rtol=1e-4, atol=1e-4)
  assert not plan.collectives


def test_a_scans_unread_stacked_outputs_are_dropped():
  """A scan's stacked output nothing reads is dropped with the body ops computing it, as XLA
  drops a loop's dead tuple elements: here its uneven carry's sum, an all-reduce the plan
  counted and the compiled program lacks."""
  def f(x):
    return jax.lax.scan(lambda c, r: (c * 0.5 + r, c.sum()), jnp.zeros(10), x)[0]

  x = jnp.asarray(np.random.default_rng(0).standard_normal((5, 10)), jnp.float32)
  plan = assert_partitioned_matches(f, (x,), (P(None, "x"),), "x4")
  assert {c.kind for c in plan.collectives} == {"all-gather"}


def test_linear_call_is_its_callee():
  """``linear_call`` (a linear function with a custom transpose) ran replicated, and re-binding
  its callee on the local shards failed on the manual mesh; it is a call of its callee, inlined,
  forward and transposed."""
  def f(w, x):
    def scaled(y):
      return jax.custom_derivatives.linear_call(lambda w, y: y * w, lambda w, ct: ct * w, w, y)
    return jax.grad(lambda x: (scaled(x) * x).sum())(x)

  x = jnp.asarray(np.random.default_rng(0).standard_normal((8, 8)), jnp.float32)
  plan = assert_partitioned_matches(f, (jnp.float32(3.0), x), (P(), P("a")), "a2b4")
  assert not plan.collectives


def test_abs_of_a_square_is_the_square():
  """max(|x^2|) and max(x^2) along a sharded dim (seed 6 of the thorough profile): XLA's
  simplifier drops an abs of a value that cannot be negative (x * x, |x|), merges the two maxima
  and all-reduces once, where the plan counted two all-reduces. The program now drops such an
  abs too, for integers as XLA does; a complex square's abs is kept (it is real, not the square)."""
  def f(x):
    square = jnp.square(x)
    return jnp.max(square, axis=0), jnp.max(jnp.abs(square), axis=0), square

  def g(x):
    return (jnp.max(jnp.abs(x * x), axis=0), jnp.max(x * x, axis=0),
            jnp.max(jnp.abs(jnp.abs(x)), axis=0), jnp.max(jnp.abs(x), axis=0))

  x = jnp.linspace(-1, 1, 8 * 3).reshape(8, 3)
  for fn, all_reduces in ((f, 1), (g, 2)):
    plan = assert_partitioned_matches(fn, (x,), P("a"), "a2b4")
    assert [c.kind for c in plan.collectives] == ["all-reduce"] * all_reduces, plan.explain()
  ints = jnp.arange(-12, 12, dtype=jnp.int32).reshape(8, 3)
  plan = assert_partitioned_matches(f, (ints,), P("a"), "a2b4")
  assert [c.kind for c in plan.collectives] == ["all-reduce"], plan.explain()

  def h(z):
    square = jnp.square(z)
    return jnp.abs(square).sum(0), square.real.sum(0)

  plan = assert_partitioned_matches(h, (x * (1 + 2j),), P("a"), "a2b4")
  assert "abs" in {row.primitive for row in plan.rows}


def test_arithmetic_identities_are_their_operand():
  """``sort(a)`` and ``sort(a * 1)`` of int32[16] P('b'): XLA's simplifier folds ``a * 1`` (and
  ``x + 0``, ``x - 0``, ``x / 1``) to its operand and merges the two gathers (64 B), where the
  plan counted two (128 B). The program now folds them too; ``x * 2`` and ``x + 1`` stay."""
  a = jnp.arange(16, dtype=jnp.int32)[::-1]
  plan = assert_partitioned_matches(lambda a: (jnp.sort(a), jnp.sort(a * 1), jnp.sort(0 + a)),
                                    (a,), P("b"), "a2b4")
  assert [c.kind for c in plan.collectives] == ["all-gather"], plan.explain()
  x = jnp.linspace(-1, 1, 32).reshape(8, 4)
  plan = assert_partitioned_matches(
      lambda x: (jnp.sort(x, 0), jnp.sort(x - 0.0, 0), jnp.sort(x / 1.0, 0), jnp.sort(x * 2, 0),
                 jnp.sort(x + 1, 0)), (x,), P("a"), "a2b4")
  assert len(plan.collectives) == 3, plan.explain()  # one per distinct sort


def test_all_to_all_of_a_concatenate_with_a_transposed_piece():
  """A concatenate with a transposed piece, resharded along the joined dim by an all-to-all
  (seed 16 of the thorough profile): XLA folded the all-to-all's slices of the concatenate into
  its pieces, of different layouts, and its verifier refused the program ("HLO all-to-all has
  operands with different shapes"), where jax.jit compiles it."""
  def f(x0, x1):
    v3 = jnp.concatenate([x1, x1, jnp.transpose(x0, (1, 2, 0))], axis=2)
    v6 = jnp.concatenate([jnp.argmin(v3, axis=2)] * 2, axis=1)
    return jnp.expand_dims(v6, 2), jnp.abs(v3)

  x0 = jnp.linspace(-1, 1, 128).reshape(4, 4, 8)[:, ::-1]
  x1 = jnp.linspace(1, -1, 64).reshape(4, 8, 2) ** 3
  plan = assert_partitioned_matches(f, (x0, x1), (P(None, "a", "b"), P("b", None, "a")), "a2b4")
  assert "all-to-all" in {c.kind for c in plan.collectives}, plan.explain()


def test_ops_combining_one_row_per_shard_gather_the_operand_once():
  """cummax and argmax along a dim split one row per device (int32[8,1] P('x', None)): each
  could all-gather its own per-shard results (block totals, block maxima) or the operand whole,
  32 B either way. Each took its own gather (the first of equal options), which XLA merged into
  one, as a block of one row is its own total: the plan said 64 B, the HLO moved 32 B.
  ExecutionPlanner.plan now prefers, among equally cheap executions, the one whose own gather
  moves less: a reshard's form is shared with later readers, an op's own gather is not."""
  def f(x0):
    v1 = x0 + 2
    v2 = spmd.annotate(v1, P(None, None))
    v3 = jax.lax.cummax(v1, axis=0)
    return jnp.argmax(v1, axis=0), v2, v3

  x0 = jnp.asarray(np.random.default_rng(0).integers(-3, 4, (8, 1), dtype=np.int32))
  plan = assert_partitioned_matches(f, (x0,), (P("x", None),), "x8")
  assert [(c.kind, c.bytes) for c in plan.collectives] == [("all-gather", 32)], plan.explain()


def test_reshards_of_two_reshapes_of_one_block_that_xla_merges():
  """Found by the thorough profile (seed 21): three outputs of one uneven slice, each returned
  as P('a') (an uneven dim realigned by a permute, then gathered over 'b'). XLA's CSE sees the
  [2,1] and [1,2] values' blocks as one [1,1] reshape of the slice's block and merges their
  permutes (8 B, where the plan counted 12 B), not their gathers, which run along different
  dims, nor the permute of the slice's own [1] block. repeats.py now marks them."""
  def f(x0):
    v1 = x0[0:2]
    return v1.reshape((1, 2)), jnp.expand_dims(v1, 1), v1

  x0 = jnp.asarray(np.random.default_rng(0).integers(-3, 4, (4,), dtype=np.int32))
  plan = assert_partitioned_matches(f, (x0,), (P(("a", "b")),), "a2b2c2")
  assert sorted((c.kind, c.bytes) for c in plan.collectives) == (
      [("all-gather", 8)] * 3 + [("collective-permute", 4)] * 2), plan.explain()


def test_a_sum_of_a_reshape_in_effect_is_the_sum_it_repeats():
  """Found by the thorough profile (seed 22): ``einsum('ab,cd->cd', x[None], x[None])`` sums
  ``x[None]`` over both dims, and ``x.sum(0)`` sums x: XLA's simplifier reduces x itself in
  both and its CSE merges them, all-reducing once (4 B), where the plan all-reduced twice (8 B).
  ir._dedupe now gives a reduction over every dim of a reshape in effect of x the key of that
  reduction of x."""
  def f(x0):
    v2 = jnp.expand_dims(x0, 0)
    return jnp.sum(x0, axis=0), jnp.argmax(x0, axis=0), jnp.einsum("ab,cd->cd", v2, v2)

  x0 = jnp.asarray(np.random.default_rng(65535).integers(-3, 4, (2,), dtype=np.int32))
  plan = assert_partitioned_matches(f, (x0,), (P("a"),), "a2b4", (None, P(), P(None, "a")))
  assert sum(c.kind == "all-reduce" for c in plan.collectives) == 1, plan.explain()


def test_literal_adds_that_cancel_leave_the_value_they_started_from():
  """Found by the thorough profile (seed 29): ``argmax(x + 2 + 2 - 2)`` and ``argmax(x + 2)``
  of int32[2] P('a'), both gathered: XLA's simplifier folds the literals, so the two gathered
  values are one and its CSE merges the gathers (8 B), where the plan gathered twice (16 B).
  ir._dedupe now folds chains of literal adds, subtracts and negations."""
  def f(x0):
    v1 = x0 + 2
    v3 = v1 + 2 - 2
    return jnp.argmax(v3, axis=0), jnp.argmax(v1, axis=0), v1

  x0 = jnp.asarray(np.random.default_rng(23858).integers(-3, 4, (2,), dtype=np.int32))
  plan = assert_partitioned_matches(f, (x0,), (P("a"),), "a2b4", (None, P(), P("a")))
  assert plan.total_bytes == 8, plan.explain()


@pytest.mark.parametrize("dtype", [np.int32, np.uint8, np.float32, jnp.bfloat16])
@pytest.mark.parametrize("chain", [
    lambda x: x + 1 - 1, lambda x: 3 - (3 - x), lambda x: -(-x), lambda x: (x + 1) + 2,
    lambda x: x - 1 + 1 + 0, lambda x: 1 + x - 2 + 1])
def test_literal_chains_fold_as_xla_folds_them(chain, dtype):
  """A chain of literal adds, subtracts and negations gathered beside its start, or beside
  ``x + 3``: the plan's gathers are the compiled program's (plan == HLO), one where XLA folds
  the chain into its start or into ``x + 3``."""
  x = np.arange(1, 9).astype(dtype)
  f = lambda x: (jnp.sort(chain(x)), jnp.sort(x), jnp.sort(x + np.asarray(3, dtype)))
  assert_partitioned_matches(f, (x,), (P("a"),), "a2b4")


def test_piece_exchanges_of_two_views_of_one_block_that_xla_merges():
  """Found by the thorough profile (seed 30, on bc072bf; also on acc34fa): a concatenate of
  ``[y, x, x]`` and one of ``[x.T, x.T]`` with their results over ('b','c') build their blocks
  from pieces of x's blocks. The pieces of x int32[4,1,1] P(('b','c')) and of its transpose
  moving only size-1 dims are the same [1,1,1] block, permuted between the same devices, and
  XLA's CSE merges those permutes (36 B), where the plan counted them twice (48 B):
  repeats.py now drops a halo piece sent before from one buffer. (Since each concatenate
  exchanges its operands' blocks together, 28 B, no piece repeated.)"""
  def f(y, x):
    t = x.transpose(1, 0, 2)
    return jnp.concatenate([y, x, x]), jnp.concatenate([t, t], 1)

  r = np.random.default_rng(0)
  y, x = (jnp.asarray(r.integers(-3, 4, (n, 1, 1), dtype=np.int32)) for n in (8, 4))
  plan = assert_partitioned_matches(f, (y, x), (P(("b", "c")), P(("b", "c"))), "a2b2c2",
                                    (P(("b", "c")), P(None, ("b", "c"))))
  assert plan.total_bytes == 28, plan.explain()


def test_all_to_alls_of_two_reshapes_of_one_block_that_xla_merges():
  """Found by the thorough profile (seed 31, on c737619, after 5,246 examples): two reshapes of
  x int32[4,8,1] P(None,('b','a')) have one [4,1,1,1] block, and each moves 'a' to dim 0 by an
  all-to-all of that block. XLA's CSE merges the two (16 B), where the plan counted both (32 B):
  repeats.py now marks a collective repeated on one local buffer."""
  def f(x):
    return (spmd.annotate(x.reshape((4, 1, 8, 1)), P("a")),
            spmd.annotate(x.reshape((4, 4, 2, 1)), P("a", "b")))

  x = jnp.asarray(np.random.default_rng(45).integers(-3, 4, (4, 8, 1), dtype=np.int32))
  plan = assert_partitioned_matches(f, (x,), (P(None, ("b", "a"), None),), "a2b4")
  assert [(c.kind, c.bytes) for c in plan.collectives] == [("all-to-all", 16), ("all-gather", 64)]


@pytest.mark.parametrize("bound", [jnp.maximum, jnp.minimum])
def test_a_repeated_bound_is_the_bound_it_repeats(bound):
  """Found by the thorough profile (seed 37, on 44233d8; the same on b981bd6): argmax of
  max(x, .5) and of max(max(x, .5), .5), x f32[16,1] P('b') on 2x2x2. XLA's simplifier folds
  the second max into the first, and its CSE merges the two argmaxes' gathers (24 B in all),
  where the plan counted both (40 B). The program now folds it too, and max(x, x)."""
  def f(x, y):
    v1 = bound(x, 0.5)
    v4 = bound(0.5, bound(v1, 0.5))
    return (jnp.argmax(v4, axis=0), jnp.argmax(v1, axis=0), jnp.cumsum(v1, axis=0), v4,
            jnp.argmax(bound(y, y), axis=0), jnp.argmax(bound(bound(x, y), y), axis=0))

  x = jnp.asarray(np.random.default_rng(0).uniform(-1, 1, (16, 1)).astype(np.float32))
  y = jnp.asarray(np.random.default_rng(1).uniform(-1, 1, (16, 1)).astype(np.float32))
  plan = assert_partitioned_matches(f, (x, y), (P("b", None), P("b", None)), "a2b2c2")
  assert len([c for c in plan.collectives if c.primitive == "argmax"]) == 3, plan.explain()


def test_a_transpose_of_one_element_blocks_reads_the_buffer_it_transposes():
  """Found by the thorough profile (seed 40): argmax(v, 0) and argmax(v.T, 0) of int32[2,2] v
  P('a','b') (one element per device) both gather v whole; on each device the transpose of a
  1x1 block is the block, so XLA merges the two all-gathers (16 B) where the plan counted two
  (32 B). repeats.py now takes a transpose moving only one-element dims of its local block as
  writing the buffer it reads."""
  def f(x0):
    v1 = x0 + 2
    v2 = spmd.annotate(v1, P("a", "b"))
    return jnp.argmax(jnp.transpose(v2, (1, 0)), axis=0), jnp.argmax(v1, axis=0)

  x0 = jnp.asarray(np.random.default_rng(0).integers(-3, 4, (2, 2), dtype=np.int32))
  plan = assert_partitioned_matches(f, (x0,), (P(None, None),), "a2b2c2", (P(None), P(None)))
  assert plan.total_bytes == 16, plan.explain()


@pytest.mark.parametrize("dtype", [np.int32, np.uint32, np.float32])
@pytest.mark.parametrize("spec", [P(None), None])
def test_one_row_blocks_of_a_scaled_block_keep_the_scale(dtype, spec):
  """XLA's simplifier folds a one-row dynamic slice of ``y * c`` (``y`` a dynamic slice of
  32-bit integers) into a slice of ``y``'s operand, dropping the multiply; the one-row blocks a
  concatenate's exchange takes of ``x * 10`` (itself a block of a gathered ``x``) came back as
  ``x`` (property run, seed 48)."""
  def f(x, z):
    y = x * dtype(10)
    return jnp.concatenate([y, z, z]), x + y, y
  x = np.arange(1, 5).astype(dtype)
  z = np.asarray([100, 200]).astype(dtype)
  assert_partitioned_matches(f, (x, z), (P(("b", "c")), spec), "a2b2c2",
                             out_specs=(P(("a", "c")), P(), P("a")))
