"""Regressions found by tests/test_property.py: minimal reproducers, one test per bug."""
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

import spmd
from spmd.hlo import collective_bytes


def _check(f, *args):
  """Partitioned == unpartitioned, and plan bytes == compiled HLO collective bytes."""
  for g, w in zip(jax.tree.leaves(f(*args)), jax.tree.leaves(f.__wrapped__(*args))):
    np.testing.assert_allclose(np.asarray(g), np.asarray(w), rtol=1e-5, atol=1e-5)
  plan = f.plan(*args)
  assert plan.total_bytes == collective_bytes(f.lower(*args).compile().as_text()), plan.explain()


def test_reshape_merged_dim_with_a_dropped_major_factor():
  """(1, 4, 4) -> (8, 2) with the input P(None, 'a', ('b', 'c')) and the result propagated to
  P('a', 'c'): the result's merged dim [4 | 2] keeps only 'a' (half of its major factor), so its
  minor factor (also the major factor of the input's last dim) is dropped; the input's last dim
  then kept 'c' on its now-unsharded minor factor and the reshape read a block of columns where
  it needed a stride: wrong values. execution._drop_inexpressible now runs to a fixed point."""
  mesh = spmd.make_mesh({"a": 2, "b": 2, "c": 2})

  @spmd.partition(mesh=mesh, in_specs=P(None, "a", ("b", "c")))
  def f(x):
    return x.reshape(8, 2) + 2

  _check(f, jnp.arange(16, dtype=jnp.int32).reshape(1, 4, 4))


def test_form_passed_through_by_a_reshard_is_reused():
  """P('a') -> P('b') gathers over 'a' (to whole) then slices 'b'; the output then wanted the
  whole array and gathered it again: XLA merged the two identical all-gathers, so the HLO moved
  64 B where the plan said 128 B. schedule.acquire now records every form a transfer passes
  through (and lower keeps them), so later consumers start from them."""
  mesh = spmd.make_mesh({"a": 2, "b": 4})

  @spmd.partition(mesh=mesh, in_specs=P("a"), out_specs=(P("b"), P(None)))
  def f(x):
    return spmd.annotate(x, P("b")) * 2, x

  x = jnp.arange(16, dtype=jnp.float32)
  _check(f, x)
  assert [c.kind for c in f.plan(x).collectives] == ["all-gather"]


def test_annotated_value_and_its_operand_share_reshards():
  """``a = annotate(y, P('x', None))`` is ``y`` itself (same form, no transfer); gathering ``a``
  and gathering ``y`` were scheduled as two all-gathers (forms were kept per value, and an
  annotation's result was a new value), which XLA CSEd: HLO 128 B, plan 256 B. An annotation's
  result now shares its operand's forms (schedule.annotation)."""
  mesh = spmd.make_mesh({"x": 8})

  @spmd.partition(mesh=mesh, in_specs=P("x", None))
  def f(x):
    y = x * 2
    a = spmd.annotate(y, P("x", None))
    return spmd.annotate(a, P(None, None)), spmd.annotate(y, P(None, None))

  _check(f, jnp.arange(32, dtype=jnp.float32).reshape(8, 4))


def test_two_annotations_of_one_value_share_reshards():
  """``annotate(x, P(None))`` gathers x; the output ``annotate(x, P('x'))`` (x itself) is wanted
  whole too and was gathered a second time, which XLA CSEd: HLO 32 B, plan 64 B. (Shrunk by
  tests/test_property.py from a random program.)"""
  mesh = spmd.make_mesh({"x": 8})

  @spmd.partition(mesh=mesh, in_specs=None, out_specs=(None, P(None)))
  def f(x):
    return spmd.annotate(x, P(None)), spmd.annotate(x, P("x"))

  _check(f, jnp.arange(8, dtype=jnp.int32))


def test_annotation_rows_show_the_reshards_they_cause():
  """Annotations move nothing themselves (their readers reshard, once for every reader), yet
  explain() shows each reshard on the row of the annotation that asked for it."""
  mesh = spmd.make_mesh({"x": 8})

  @spmd.partition(mesh=mesh, in_specs=P("x", None))
  def f(x):
    whole = spmd.annotate(x * 2, P(None, None))
    return jnp.tanh(whole) + 1, whole.sum(0), whole

  x = jnp.arange(32, dtype=jnp.float32).reshape(8, 4)
  _check(f, x)
  plan = f.plan(x)
  (row,) = [r for r in plan.rows if r.primitive == "spmd_annotate"]
  assert [c.kind for c in row.collectives] == ["all-gather"]
  assert [c.kind for c in plan.collectives] == ["all-gather"]  # one gather, three readers
