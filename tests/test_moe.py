"""spmd.models.moe: GShard routing, and the partitioned training step of the MoE model equals the
unpartitioned one with the communication each rule set predicts (expert parallel: dispatch and
combine are all-to-alls, forward and backward; expert weights never gathered)."""
from __future__ import annotations

import functools
from collections import Counter

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax.training.train_state import TrainState
from jax.sharding import PartitionSpec as P

import spmd
from helpers import assert_trees_match
from spmd.models import moe
from spmd.train import create_train_state, make_train_step

MESH = {"data": 2, "model": 4}
# 8 experts of capacity 4 per group of 16 tokens (top-2): capacity binds, some choices drop
TINY = moe.Config(vocab=32, d_model=16, mlp=32, experts=8, k=2, capacity_factor=1.0)
GROUPS, GROUP_SIZE = 8, 16
STEPS = 2
LEARNING_RATE = 1e-2
# As in test_models: Adam turns rounding noise in a near-zero gradient into a step of up to the
# learning rate, so params are compared to a quarter of it; losses and moments tightly.
PARAM_ATOL = LEARNING_RATE / 4
# Routing is discrete: every token's top k+1 router probabilities are this far apart in the
# reference, far above the rounding differences of two programs (~1e-7), so no choice can flip.
ROUTING_MARGIN = 1e-5
F32 = 4


MODEL = moe.MoELM(TINY)
TX = optax.adamw(LEARNING_RATE)
BATCHES = [jnp.asarray(np.random.default_rng(seed).integers(0, TINY.vocab,
                                                            (GROUPS, GROUP_SIZE + 1)), jnp.int32)
           for seed in range(STEPS)]
STEP = make_train_step(functools.partial(moe.next_token_loss, MODEL))


def _init(key: jax.Array):
  return MODEL.init(key, BATCHES[0][:, :-1])["params"]


@jax.jit
def _routing_margin(params, tokens: jax.Array) -> jax.Array:
  """The smallest gap between consecutive ones of any token's top k+1 router probabilities."""
  _, state = MODEL.apply({"params": params}, tokens[:, :-1],
                         capture_intermediates=lambda m, _: m.name == "router")
  probs = jax.nn.softmax(state["intermediates"]["moe"]["router"]["__call__"][0], axis=-1)
  top = jax.lax.top_k(probs, TINY.k + 1)[0]
  return jnp.min(top[..., :-1] - top[..., 1:])


@functools.lru_cache(maxsize=None)
def _reference() -> tuple[TrainState, tuple[tuple[TrainState, jax.Array], ...]]:
  """The unpartitioned initial state and, after each step, the state and the loss (shared by
  every rule set). Checks the routing margin before each step."""
  init = state = jax.jit(lambda key: TrainState.create(
      apply_fn=None, params=nn.unbox(_init(key)), tx=TX))(jax.random.key(0))
  step, after = jax.jit(STEP), []
  for batch in BATCHES:
    assert _routing_margin(state.params, batch) > ROUTING_MARGIN
    state, loss = step(state, batch)
    after.append((state, loss))
  return init, tuple(after)


def _run(strategy: str) -> spmd.Plan:
  """Creates the sharded train state, runs STEPS partitioned steps (state donated), compares the
  init, every loss, params and optimizer state with the unpartitioned ones, and returns the
  step's plan."""
  mesh, rules = spmd.make_mesh(MESH), moe.RULES[strategy]
  state, specs = create_train_state(_init, TX, mesh, jax.random.key(0), rules=rules)
  init, reference = _reference()
  assert_trees_match(state, init, rtol=0, atol=0)
  partitioned = spmd.partition(STEP, mesh=mesh, rules=rules, donate_argnums=0,
                               in_specs=(specs, P("act_group", None)), out_specs=(specs, P()))
  plan = partitioned.plan(state, BATCHES[0])
  assert not plan.warnings, plan.warnings
  for batch, (want, want_loss) in zip(BATCHES, reference):
    state, loss = partitioned(state, batch)
    assert_trees_match(loss, want_loss, rtol=1e-5, atol=1e-6)
    assert_trees_match(state.params, want.params, rtol=1e-4, atol=PARAM_ATOL)
    assert_trees_match(state.opt_state, want.opt_state, rtol=1e-4, atol=1e-7)
    assert int(state.step) == int(want.step)
  for leaf, spec in zip(jax.tree.leaves(state), jax.tree.leaves(
      plan.out_specs[0], is_leaf=lambda x: isinstance(x, P))):
    assert leaf.sharding.spec == spec  # the state stays sharded as its specs say
  return plan


def _param_bytes(expert_shards: int) -> dict[str, int]:
  """Bytes per device of the expert weights (split ``expert_shards`` ways) and of the rest."""
  sizes = {"w_in": TINY.experts * TINY.d_model * TINY.mlp,
           "w_out": TINY.experts * TINY.mlp * TINY.d_model}
  rest = 2 * TINY.vocab * TINY.d_model + TINY.d_model * TINY.experts  # embed, unembed, router
  return {"experts": sum(sizes.values()) * F32 // expert_shards, "rest": rest * F32}


def _reduced(plan: spmd.Plan, axes: tuple[str, ...]) -> list[int]:
  return sorted(c.bytes for c in plan.collectives if c.kind == "all-reduce" and c.axes == axes)


def test_route_queues_first_choices_first_and_drops_past_capacity():
  """``route`` against a token-by-token queue: each group's first choices in token order, then
  its second choices; a choice finding its expert full is dropped."""
  logits = jnp.asarray(np.random.default_rng(0).standard_normal((2, GROUP_SIZE, TINY.experts)),
                       jnp.float32)
  capacity = moe.capacity(TINY, GROUP_SIZE)
  route = jax.jit(moe.route, static_argnums=(1, 2))
  combine, dispatch, aux_loss = route(logits, TINY.k, capacity)
  probs = np.asarray(jax.nn.softmax(logits, axis=-1))
  want_dispatch, want_combine = np.zeros(dispatch.shape), np.zeros(combine.shape)
  for g, group in enumerate(probs):
    chosen = np.argsort(-group, axis=-1)[:, :TINY.k]
    gates = np.take_along_axis(group, chosen, -1)
    gates /= gates.sum(-1, keepdims=True)
    filled = np.zeros(TINY.experts, int)
    for j in range(TINY.k):
      for s, e in enumerate(chosen[:, j]):
        if filled[e] < capacity:
          want_dispatch[g, s, e, filled[e]], want_combine[g, s, e, filled[e]] = 1, gates[s, j]
        filled[e] += 1
  assert 0 < want_dispatch.sum() < logits.shape[0] * GROUP_SIZE * TINY.k  # some choices drop
  np.testing.assert_array_equal(dispatch, want_dispatch)
  np.testing.assert_allclose(combine, want_combine, rtol=1e-6)
  first = np.eye(TINY.experts)[probs.argmax(-1)].mean(1)  # [groups, experts]
  want_aux = TINY.experts * np.mean(np.sum(first * probs.mean(1), -1))
  np.testing.assert_allclose(aux_loss, want_aux, rtol=1e-6)


def test_data_parallel_all_reduces_each_gradient_once():
  plan = _run("dp")
  assert {c.kind for c in plan.collectives} == {"all-reduce"}
  params = _param_bytes(1)
  assert sum(_reduced(plan, ("data", "model"))) == params["experts"] + params["rest"] + F32


def test_expert_parallel_dispatch_and_combine_are_all_to_alls():
  """Expert weights split over "model": the only collectives are 4 all-to-alls over "model" of
  the expert inputs / outputs [experts, groups, capacity, d_model] (dispatch and combine, forward
  and backward), each gradient all-reduced once (expert weights' over "data" only, the rest over
  every device) and the loss. No all-gather: expert weights and tokens never move whole."""
  plan = _run("expert_parallel")
  assert Counter(c.kind for c in plan.collectives) == {"all-to-all": 4, "all-reduce": 6}
  capacity = moe.capacity(TINY, GROUP_SIZE)
  expert_tokens = TINY.experts * GROUPS * capacity * TINY.d_model * F32 // 8  # per device
  moves = Counter((r.scope, r.backward, c.axes, c.bytes) for r in plan.rows
                  for c in r.collectives if c.kind == "all-to-all")
  dispatch, combine = (("MoELM", "moe", equation) for equation in ("gsec,gsm->egcm",
                                                                   "gsec,egcm->gsm"))
  assert moves == {(scope, backward, ("model",), expert_tokens): 1
                   for scope in (dispatch, combine) for backward in (False, True)}, moves
  params = _param_bytes(MESH["model"])
  assert _reduced(plan, ("data",)) == [params["experts"] // 2] * 2  # w_in, w_out
  assert sum(_reduced(plan, ("data", "model"))) == params["rest"] + F32


def test_rule_sets_name_every_logical_axis():
  boxed = jax.eval_shape(moe.MoELM(TINY).init, jax.random.key(0),
                         jnp.zeros((GROUPS, GROUP_SIZE), jnp.int32))
  used = {a for spec in jax.tree.leaves(nn.get_partition_spec(boxed),
                                        is_leaf=lambda x: isinstance(x, P)) for a in spec}
  assert used - {None} <= set(moe.PARAM_AXES)
  for rules in moe.RULES.values():
    assert set(moe.PARAM_AXES + moe.ACTIVATION_AXES) <= {n for n, _ in rules}
