"""flax's documentation guides, a third round of flax patterns run through spmd.partition as their
users write them: the NNX "Scale up on multiple devices" guide (a sharded model created by a
function of no arguments, logical names under a rules context, NamedShardings from
``nnx.get_named_sharding``), NNX transforms inside the step (remat, scan with split rngs, vmap
ensembles, cond / switch, fori_loop / while_loop, LoRA through ``DiffState``, train and eval
modes), the NNX / linen bridge, optax around the model (clipping, schedules, gradient
accumulation, masked weight decay, EMA), and linen's lifted transforms (vmap ensembles, scan over
remat'd blocks with dropout, share_scope, pmap-style BatchNorm, boxed params with mesh
shardings); on the 2x4, 8x1 and 1x8 ("data", "model") meshes, uneven sizes included. Each is
compared step by step with nnx.jit / jax.jit of the same step, then its plan with the compiled
program (helpers.train_loop / check_plan)."""
import functools

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import spmd
from helpers import (assert_partitioned_matches, assert_trees_match, check_plan, mesh_of, randn,
                     train_loop)


def nnx_steps(step, fresh, mesh, in_specs, batches, rtol=1e-4, atol=1e-5, **options):
  """``step`` partitioned beside ``nnx.jit(step)``, each over its own ``fresh()`` modules, for
  every batch: the same outputs, then the same module states; then ``check_plan``. Returns the
  plan and the partitioned modules."""
  ours, reference = fresh(), fresh()
  partitioned = spmd.partition(step, mesh=mesh, in_specs=in_specs, **options)
  jitted = nnx.jit(step)
  for batch in batches:
    assert_trees_match(partitioned(*ours, *batch), jitted(*reference, *batch), rtol=rtol,
                       atol=atol)
  for got, want in zip(ours, reference):
    assert_trees_match(nnx.state(got), nnx.state(want), rtol=rtol, atol=atol)
  return check_plan(partitioned, *ours, *batches[0]), ours


# --- the NNX "Scale up on multiple devices" guide ----------------------------------------------

class DotReluDot(nnx.Module):
  """The guide's model: a column-split then a row-split kernel (mesh axes, or logical names)."""

  def __init__(self, depth: int, names: tuple, rngs: nnx.Rngs):
    init = nnx.initializers.lecun_normal()
    embed, hidden = names
    self.dot1 = nnx.Linear(depth, depth, use_bias=False, rngs=rngs,
                           kernel_init=nnx.with_partitioning(init, (embed, hidden)))
    self.w2 = nnx.Param(init(rngs.params(), (depth, depth)), out_sharding=(hidden, embed))

  def __call__(self, x):
    y = nnx.relu(self.dot1(x))
    return jnp.dot(y, self.w2[...])


def guide_train_step(model, optimizer, x, y):
  def loss_fn(model):
    return jnp.mean((model(x) - y) ** 2)

  loss, grads = nnx.value_and_grad(loss_fn)(model)
  optimizer.update(model, grads)
  return loss


GUIDE_RULES = (("batch", "data"), ("hidden", "model"), ("embed", None))


@pytest.mark.parametrize("mesh,names,batch", [("2x4", (None, "model"), 8),
                                              ("1x8", ("embed", "hidden"), 6)])
def test_nnx_guide_create_sharded_model_then_train(mesh, names, batch):
  """The guide's ``create_sharded_model()``: no arguments, the state constrained to
  ``nnx.get_partition_spec(state)`` (resolved by flax under ``nnx.logical_axis_rules`` where
  the names are logical) and ``nnx.update``d into the model, returned. Then its steps with in_specs
  from ``nnx.get_named_sharding``."""
  mesh = mesh_of(mesh)
  rules = GUIDE_RULES if names[0] == "embed" else ()

  def create_sharded_model():
    model = DotReluDot(16, names, nnx.Rngs(0))
    state = nnx.state(model)
    pspecs = nnx.get_partition_spec(state)
    sharded_state = jax.lax.with_sharding_constraint(state, pspecs)
    nnx.update(model, sharded_state)
    return model

  with nnx.use_eager_sharding(False), nnx.logical_axis_rules(rules):
    model = spmd.partition(create_sharded_model, mesh=mesh)()
    with jax.set_mesh(mesh):
      reference = nnx.jit(create_sharded_model)()
    state_sharding = nnx.get_named_sharding(nnx.state(model), mesh)
  for got, want, spec in [(model.dot1.kernel, reference.dot1.kernel, P(None, "model")),
                          (model.w2, reference.w2, P("model", None))]:
    assert got[...].sharding.is_equivalent_to(NamedSharding(mesh, spec), 2)
    assert got[...].sharding.spec == want[...].sharding.spec  # as jax.jit spells it
  assert_trees_match(nnx.state(model), nnx.state(reference))

  step = spmd.partition(guide_train_step, mesh=mesh,
                        in_specs=(state_sharding, None, P("data"), P("data")))
  jitted = nnx.jit(guide_train_step)
  optimizer = nnx.Optimizer(model, optax.adamw(1e-2), wrt=nnx.Param)
  with jax.set_mesh(mesh):
    ref_optimizer = nnx.Optimizer(reference, optax.adamw(1e-2), wrt=nnx.Param)
  with nnx.logical_axis_rules(rules):  # the moments' logical names resolve as the params' did
    for s in range(3):
      x, y = randn(batch, 16, seed=s), randn(batch, 16, seed=s + 10)
      with jax.set_mesh(mesh):
        want = jitted(reference, ref_optimizer, x, y)
      assert_trees_match(step(model, optimizer, x, y), want, rtol=1e-5, atol=1e-6)
    plan = check_plan(step, model, optimizer, x, y)
  assert_trees_match(nnx.state(model), nnx.state(reference), rtol=1e-5, atol=1e-6)
  # Megatron: the row-split kernel's output all-reduced over "model", forward; the gradients'
  # partial sums over "data"
  assert {c.axes for c in plan.collectives} <= {("model",), ("data",)}
