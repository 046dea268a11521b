"""spmd.models: each model's partitioned training step equals the unpartitioned step (loss, params
and optimizer state over several steps) and communicates what its strategy predicts."""
from __future__ import annotations

import dataclasses
import functools
from collections import Counter
from typing import Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.training.train_state import TrainState
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import spmd
from helpers import assert_plan_is_hlo, assert_trees_match
from spmd.hlo import collective_bytes
from spmd.models import mlp, transformer
from spmd.train import create_train_state, init_module, make_train_step

MESH = {"data": 2, "model": 4}
TINY = transformer.Config(vocab=64, d_model=32, heads=4, head_dim=8, mlp=64, layers=1)
BATCH, SEQ = 8, 16
STEPS = 2
LEARNING_RATE = 1e-2
# Adam divides each gradient by its own magnitude, so reduction-order noise in a gradient that is
# zero up to rounding moves its param by a fraction of the learning rate: params are compared to
# a quarter of it. The loss of every step (which the previous update feeds), the init and the
# moments (to 1e-6: sums of cancelling per-example gradients round differently) are compared
# tightly.
PARAM_ATOL = LEARNING_RATE / 4


@functools.lru_cache(maxsize=None)
def _mesh():
  return spmd.make_mesh(MESH)


def _tokens(config: transformer.Config, seed: int = 0) -> jax.Array:
  rng = np.random.default_rng(seed)
  return jnp.asarray(rng.integers(0, config.vocab, (BATCH, SEQ + 1)), jnp.int32)


@functools.lru_cache(maxsize=None)
def _training(config: transformer.Config) -> tuple[Callable, optax.GradientTransformation,
                                                    Callable]:
  """The params initialiser, the optimizer and the training step of a Transformer (the same
  objects every time: a TrainState's tree holds its optimizer)."""
  model = transformer.Transformer(config)
  init = lambda key: model.init(key, _tokens(config)[:, :-1])["params"]  # noqa: E731
  step = make_train_step(functools.partial(transformer.next_token_loss, model))
  return init, optax.adamw(LEARNING_RATE), step


def _unpartitioned_state(init: Callable, tx: optax.GradientTransformation
                         ) -> Callable[[jax.Array], TrainState]:
  return lambda key: TrainState.create(apply_fn=None, params=nn.unbox(init(key)), tx=tx)


def _partitioned_step(config: transformer.Config, strategy: str
                      ) -> tuple[spmd.Partitioned, TrainState]:
  """The training step partitioned by ``strategy``'s rules (state donated) and the sharded train
  state it takes."""
  mesh, rules = _mesh(), transformer.RULES[strategy]
  init, tx, step = _training(config)
  state, specs = create_train_state(init, tx, mesh, jax.random.key(0), rules=rules)
  partitioned = spmd.partition(step, mesh=mesh, rules=rules, donate_argnums=0,
                               in_specs=(specs, P("act_batch", None)), out_specs=(specs, P()))
  return partitioned, state


def _run_transformer(config: transformer.Config, strategy: str) -> spmd.Plan:
  """Creates the sharded train state, runs STEPS partitioned steps (state donated) beside the
  unpartitioned ones, compares everything, and returns the step's plan."""
  tokens = [_tokens(config, seed) for seed in range(STEPS)]
  init, tx, step = _training(config)
  partitioned, state = _partitioned_step(config, strategy)
  want = jax.jit(_unpartitioned_state(init, tx))(jax.random.key(0))
  # The partitioned init draws what jax.jit draws into the same layouts, bit for bit, and the
  # unpartitioned values within rounding (XLA:CPU's erf_inv behind normal initializers can round
  # a value 1 ulp apart for another block shape: jax 0.12 on AVX-512, under jax.jit too).
  same_layouts = jax.jit(_unpartitioned_state(init, tx),
                         out_shardings=jax.tree.map(lambda x: x.sharding, state))
  assert_trees_match(state, same_layouts(jax.random.key(0)), rtol=0, atol=0)
  assert_trees_match(state, want)
  plan = partitioned.plan(state, tokens[0])
  assert not [w for w in plan.warnings if "replicated" in w], plan.warnings
  reference = jax.jit(step)
  for batch in tokens:
    state, loss = partitioned(state, batch)
    want, want_loss = reference(want, batch)
    assert_trees_match(loss, want_loss, rtol=1e-5, atol=1e-6)
    assert_trees_match(state.params, want.params, rtol=1e-4, atol=PARAM_ATOL)
    assert_trees_match(state.opt_state, want.opt_state, rtol=1e-4, atol=1e-6)
    assert int(state.step) == int(want.step)
  for leaf, spec in zip(jax.tree.leaves(state), jax.tree.leaves(
      plan.out_specs[0], is_leaf=lambda x: isinstance(x, P))):
    assert leaf.sharding.spec == spec  # the state stays sharded as its specs say
  return plan


def _xla_step_bytes(config: transformer.Config, strategy: str, plan: spmd.Plan) -> int:
  """Collective bytes per device of ``jax.jit``'s training step given the plan's boundary specs,
  the model's logical constraints resolved through the same rules."""
  mesh, rules = _mesh(), transformer.RULES[strategy]
  init, tx, step = _training(config)
  state = jax.eval_shape(_unpartitioned_state(init, tx), jax.random.key(0))
  named = lambda specs: jax.tree.map(  # noqa: E731
      lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda x: isinstance(x, P))
  step = jax.jit(step, in_shardings=named(plan.in_specs), out_shardings=named(plan.out_specs))
  with jax.set_mesh(mesh), nn.logical_axis_rules(rules):
    tokens = jax.ShapeDtypeStruct((BATCH, SEQ + 1), jnp.int32)
    return collective_bytes(step.lower(state, tokens).compile().as_text())


def _bytes(plan: spmd.Plan, kind: str, axes: tuple[str, ...]) -> list[int]:
  return [c.bytes for c in plan.collectives if c.kind == kind and tuple(c.axes) == axes]


def _param_bytes(config: transformer.Config, shards: dict[str, int]) -> int:
  """Bytes of the params one device holds when each param's logical axes split as ``shards``."""
  model = transformer.Transformer(config)
  boxed = jax.eval_shape(model.init, jax.random.key(0), jnp.zeros((1, SEQ), jnp.int32))["params"]
  names = jax.tree.leaves(nn.get_partition_spec(boxed), is_leaf=lambda x: isinstance(x, P))
  sizes = [x.size * 4 for x in jax.tree.leaves(nn.unbox(boxed))]
  return sum(n // int(np.prod([shards.get(a, 1) for a in spec])) for n, spec in zip(sizes, names))


ACTIVATION = BATCH // MESH["data"] * SEQ * TINY.d_model * 4  # one [batch/data, seq, embed] f32


@pytest.mark.parametrize("strategy", sorted(transformer.RULES))
def test_plan_is_the_compiled_step(strategy):
  """Every strategy's plan moves what its compiled training step moves, per kind of collective
  (sp's loss gradient is a constant XLA folds: fold.py folds it too)."""
  partitioned, state = _partitioned_step(TINY, strategy)
  tokens = _tokens(TINY)
  assert_plan_is_hlo(partitioned.plan(state, tokens),
                     partitioned.lower(state, tokens).compile().as_text())


def test_data_parallel_all_reduces_each_gradient_once():
  plan = _run_transformer(TINY, "dp")
  kinds = Counter(c.kind for c in plan.collectives)
  assert set(kinds) == {"all-reduce"}, kinds
  # every gradient once over all devices, and the loss
  assert sum(_bytes(plan, "all-reduce", ("data", "model"))) == _param_bytes(TINY, {}) + 4


def test_fsdp_gathers_params_and_reduce_scatters_gradients():
  plan = _run_transformer(TINY, "fsdp")
  everything = _param_bytes(TINY, {})
  table = TINY.vocab * TINY.d_model * 4
  assert _param_bytes(TINY, {"embed": 8}) == everything // 8  # every param has an embed dim
  # each param but the embedding table is gathered once for the step and its gradient
  # reduce-scattered once, over all 8 devices. The table stays split along embed (as XLA does):
  # the lookup gathers the token ids, and its result (and the gradient's cotangent) move between
  # the embed and batch splits by one all-to-all each
  tokens, embedded = BATCH * SEQ * 4, BATCH * SEQ * TINY.d_model * 4 // 8
  assert sorted(_bytes(plan, "all-gather", ("data", "model"))) == sorted(
      _bytes(plan, "reduce-scatter", ("data", "model")) + [tokens])
  assert sum(_bytes(plan, "reduce-scatter", ("data", "model"))) == everything - table
  assert _bytes(plan, "all-to-all", ("data", "model")) == [embedded] * 2
  assert _bytes(plan, "all-reduce", ("data", "model")) == [4]  # the loss
  assert plan.total_bytes <= _xla_step_bytes(TINY, "fsdp", plan), plan.explain()


def test_megatron_all_reduces_each_block_once_forward_and_once_backward():
  plan = _run_transformer(TINY, "megatron")
  blocks = _bytes(plan, "all-reduce", ("model",))
  # forward: the embedding (vocab-sharded table) and 2 per layer (attention, MLP); backward: 2
  # per layer and the output projection's input gradient
  assert blocks.count(ACTIVATION) == 2 * (2 * TINY.layers + 1)
  assert all(b == ACTIVATION or b < ACTIVATION // 16 for b in blocks)  # the rest: softmax stats
  # each gradient all-reduced over "data" once: the params one device holds
  assert sum(_bytes(plan, "all-reduce", ("data",))) == _param_bytes(
      TINY, {"vocab": 4, "heads": 4, "mlp": 4}) + 4
  assert {c.kind for c in plan.collectives} == {"all-reduce"}


def test_2d_is_megatron_over_model_and_fsdp_over_data():
  plan = _run_transformer(TINY, "2d")
  megatron = {"vocab": 4, "heads": 4, "mlp": 4}
  held = _param_bytes(TINY, megatron)  # after the "model" split, before the "data" split
  assert _bytes(plan, "all-reduce", ("model",)).count(ACTIVATION) == 2 * (2 * TINY.layers + 1)
  assert sum(_bytes(plan, "all-gather", ("data",))) == held
  assert sum(_bytes(plan, "reduce-scatter", ("data",))) == held
  assert _bytes(plan, "all-reduce", ("data",)) == [4]  # the loss
  assert {c.kind for c in plan.collectives} == {"all-gather", "reduce-scatter", "all-reduce"}


def test_sequence_parallel_block_boundaries_are_reduce_scatters():
  plan = _run_transformer(TINY, "sp")
  # no activation is all-reduced over "model": block outputs are reduce-scattered along the
  # sequence and gathered again where a block starts
  assert max(_bytes(plan, "all-reduce", ("model",)), default=0) < ACTIVATION // 16
  assert ACTIVATION in _bytes(plan, "reduce-scatter", ("model",))
  assert ACTIVATION in _bytes(plan, "all-gather", ("model",))


def test_scanned_rematerialised_layers():
  """nn.scan over layers (stacked params with a "layers" axis) and nn.remat: one scan whose
  collectives run once per layer."""
  config = dataclasses.replace(TINY, layers=2, scan_layers=True, remat=True)
  plan = _run_transformer(config, "2d")
  in_scan = [c for c in plan.collectives if c.trips == config.layers]
  assert in_scan and plan.step_bytes > plan.total_bytes


def test_bfloat16_activations_with_float32_params():
  """Loss and gradients of the bf16 model, partitioned, within bf16's precision of the
  unpartitioned ones (relative to each gradient's norm: Adam's updates of near-zero bf16
  gradients are noise, so the step's state is not the measure here)."""
  config = dataclasses.replace(TINY, dtype=jnp.bfloat16)
  model, mesh, rules = transformer.Transformer(config), _mesh(), transformer.RULES["megatron"]
  tokens = _tokens(config)
  params = nn.unbox(model.init(jax.random.key(0), tokens[:, :-1])["params"])
  specs = nn.get_partition_spec(model.init(jax.random.key(0), tokens[:, :-1]))["params"]
  grad = jax.value_and_grad(functools.partial(transformer.next_token_loss, model))
  loss, grads = spmd.partition(grad, mesh=mesh, rules=rules,
                               in_specs=(specs, P("act_batch", None)))(params, tokens)
  want_loss, want_grads = jax.jit(grad)(params, tokens)
  assert jax.tree.map(lambda x: x.dtype, grads) == jax.tree.map(lambda x: x.dtype, params)
  np.testing.assert_allclose(loss, want_loss, rtol=1e-2)
  for g, w in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads)):
    assert np.linalg.norm(np.asarray(g) - w) <= 0.05 * np.linalg.norm(w)


def test_rule_sets_name_every_logical_axis():
  model = transformer.Transformer(TINY)
  boxed = jax.eval_shape(model.init, jax.random.key(0), jnp.zeros((1, SEQ), jnp.int32))
  used = {a for spec in jax.tree.leaves(nn.get_partition_spec(boxed),
                                        is_leaf=lambda x: isinstance(x, P)) for a in spec}
  assert used <= set(transformer.PARAM_AXES)
  for rules in transformer.RULES.values():
    assert set(transformer.PARAM_AXES + transformer.ACTIVATION_AXES) <= {n for n, _ in rules}


# --- spmd.models.mlp: an NNX model and optimizer passed straight in, as to nnx.jit -------------

MLP_BATCH = 256  # activations outweigh the weights, so FSDP gathers weights rather than inputs


@pytest.fixture(scope="module")
def mlp_data():
  x = np.random.default_rng(0).standard_normal((MLP_BATCH, mlp.Config().features))
  return jnp.asarray(x, jnp.float32), jnp.asarray(np.sin(x), jnp.float32)


def _run_mlp(strategy: str, data: tuple) -> spmd.Plan:
  """The NNX model and optimizer created sharded (init_module), STEPS partitioned in-place steps
  beside nnx.jit's on a copy; returns the plan."""
  from flax import nnx
  mesh, rules = _mesh(), mlp.RULES[strategy]

  def create():
    model = mlp.MLP(mlp.Config(), nnx.Rngs(0))
    return model, nnx.Optimizer(model, optax.adamw(LEARNING_RATE), wrt=nnx.Param)

  model, optimizer = init_module(create, mesh, rules)
  graphdef, state = nnx.split((model, optimizer))
  want_model, want_optimizer = nnx.merge(graphdef, jax.tree.map(np.asarray, state))
  step = spmd.partition(mlp.train_step, mesh=mesh, rules=rules,
                        in_specs=(None, None, P("act_batch", None), P("act_batch", None)))
  reference = nnx.jit(mlp.train_step)
  plan = step.plan(model, optimizer, *data)
  for _ in range(STEPS):
    loss, want_loss = step(model, optimizer, *data), reference(want_model, want_optimizer, *data)
    assert_trees_match(loss, want_loss, rtol=1e-5, atol=1e-6)
    assert_trees_match(nnx.state(model), nnx.state(want_model), rtol=1e-4, atol=PARAM_ATOL)
    assert_trees_match(nnx.state(optimizer, nnx.OptState), nnx.state(want_optimizer, nnx.OptState),
                       rtol=1e-4, atol=1e-6)
  return plan


def _mlp_param_bytes(names: set[str]) -> int:
  """Bytes of the MLP's params whose logical names include one of ``names`` (all: empty set)."""
  c = mlp.Config()
  params = {("embed", "mlp"): c.features * c.hidden, ("mlp",): c.hidden,
            ("mlp", "embed"): c.hidden * c.features, ("embed",): c.features}
  return 4 * c.pairs * sum(n for axes, n in params.items() if not names or set(axes) & names)


def test_nnx_mlp_data_parallel(mlp_data):
  plan = _run_mlp("dp", mlp_data)
  assert {c.kind for c in plan.collectives} == {"all-reduce"}
  assert sum(c.bytes for c in plan.collectives) == _mlp_param_bytes(set()) + 4


def test_nnx_mlp_fsdp(mlp_data):
  plan = _run_mlp("fsdp", mlp_data)
  sharded = _mlp_param_bytes({"embed"})  # the params with an embed dim; "mlp" biases stay whole
  assert sum(_bytes(plan, "all-gather", ("data", "model"))) == sharded
  assert sum(_bytes(plan, "reduce-scatter", ("data", "model"))) == sharded
  assert sum(_bytes(plan, "all-reduce", ("data", "model"))) == (
      _mlp_param_bytes(set()) - sharded + 4)


def test_nnx_mlp_megatron(mlp_data):
  plan = _run_mlp("megatron", mlp_data)
  activation = MLP_BATCH // MESH["data"] * mlp.Config().features * 4
  pairs = mlp.Config().pairs
  # one all-reduce per pair forward (after the row-parallel kernel) and one backward (before the
  # column-parallel kernel; not for the first pair, whose input needs no gradient)
  assert _bytes(plan, "all-reduce", ("model",)) == [activation] * (2 * pairs - 1)
  # gradients over "data": the params one device holds, once each, and the loss
  assert sum(_bytes(plan, "all-reduce", ("data",))) == (
      _mlp_param_bytes(set()) - _mlp_param_bytes({"mlp"}) * 3 // 4 + 4)
