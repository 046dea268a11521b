"""partition(auto=True): the search's plan moves no more bytes than the best hand-written rule set
that fits the same memory limit (priced by the same planner), and its step equals the
unpartitioned one."""
from __future__ import annotations

import dataclasses
import functools
import importlib
import math

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax.training.train_state import TrainState
from jax.sharding import PartitionSpec as P

import spmd
from helpers import assert_trees_match
from spmd.models import transformer
from spmd.train import make_train_step, state_specs

search_module = importlib.import_module("spmd.partition.search")  # spmd.partition is a function

MESH = {"data": 2, "model": 4}
FEATURES, HIDDEN, PAIRS, BATCH = 32, 128, 2, 256
LEARNING_RATE = 1e-2
MLP_NAMES = {"up": [{"kernel": P("embed", "mlp"), "bias": P("mlp")}] * PAIRS,
             "down": [{"kernel": P("mlp", "embed"), "bias": P("embed")}] * PAIRS}
_MEGATRON = (("act_batch", "data"), ("mlp", "model"))
MLP_RULES = {  # unnamed logical axes are replicated
    "dp": (("act_batch", ("data", "model")), ("embed", None), ("mlp", None)),
    "fsdp": (("act_batch", ("data", "model")), ("embed", ("data", "model")), ("mlp", None)),
    "megatron": _MEGATRON + (("embed", None),),
    "2d": _MEGATRON + (("embed", "data"),),
}


@functools.lru_cache(maxsize=None)
def _mesh():
  return spmd.make_mesh(MESH)


def _mlp_loss(params: dict, batch: tuple) -> jax.Array:
  """spmd.models.mlp's residual MLP as a function of plain params."""
  x, y = batch
  for up, down in zip(params["up"], params["down"]):
    x = x + jax.nn.gelu(x @ up["kernel"] + up["bias"]) @ down["kernel"] + down["bias"]
  return jnp.mean((x - y) ** 2)


def _mlp_problem():
  rng = np.random.default_rng(0)

  def layer(n_in: int, n_out: int) -> dict:
    kernel = rng.standard_normal((n_in, n_out)) / np.sqrt(n_in)
    return {"kernel": jnp.asarray(kernel, jnp.float32), "bias": jnp.zeros((n_out,))}

  params = {"up": [layer(FEATURES, HIDDEN) for _ in range(PAIRS)],
            "down": [layer(HIDDEN, FEATURES) for _ in range(PAIRS)]}
  state = TrainState.create(apply_fn=None, params=params, tx=optax.adamw(LEARNING_RATE))
  x = jnp.asarray(rng.standard_normal((BATCH, FEATURES)), jnp.float32)
  return make_train_step(_mlp_loss), state, (x, jnp.sin(x))


def _memory(plan: spmd.Plan, args: tuple) -> int:
  """Per-device bytes of the arguments as the plan shards them."""
  specs = jax.tree.leaves(plan.in_specs, is_leaf=lambda x: isinstance(x, P))
  total = 0
  for leaf, spec in zip(map(jnp.asarray, jax.tree.leaves(args)), specs):
    shards = [math.prod(MESH[a] for a in ((e,) if isinstance(e, str) else e or ()))
              for e in tuple(spec) + (None,) * (leaf.ndim - len(spec))]
    total += math.prod(-(-n // s) for n, s in zip(leaf.shape, shards)) * leaf.dtype.itemsize
  return total


def _rule_sets(step, state, batch, names, rule_sets) -> dict[str, tuple[int, int]]:
  """(bytes per call, memory per device) of each rule set's plan."""
  specs = state_specs(state, names)
  out = {}
  for name, rules in rule_sets.items():
    plan = spmd.partition(step, mesh=_mesh(), rules=rules, in_specs=(specs, P("act_batch", None)),
                          out_specs=(specs, P())).plan(state, batch)
    out[name] = plan.step_bytes, _memory(plan, (state, batch))
  return out


def _check_search(step, state, batch, limit, rule_sets) -> spmd.Plan:
  """The search's plan fits ``limit``, moves no more than the best fitting rule set and its
  step equals the unpartitioned one."""
  f = spmd.partition(step, mesh=_mesh(), auto=True, memory_limit=limit,
                     in_specs=(None, P("data", None)))
  plan = f.plan(state, batch)
  fitting = {k: b for k, (b, m) in rule_sets.items() if limit is None or m <= limit}
  assert fitting, rule_sets
  assert plan.step_bytes <= min(fitting.values()), (plan.explain(full=False), rule_sets)
  assert plan.search.step_bytes == plan.step_bytes
  assert plan.search.memory_bytes == _memory(plan, (state, batch))
  assert limit is None or plan.search.memory_bytes <= limit
  assert "auto sharding:" in plan.explain()
  new_state, loss = f(state, batch)
  want_state, want_loss = jax.jit(step)(state, batch)
  assert_trees_match(loss, want_loss, rtol=1e-5, atol=1e-6)
  # Adam turns rounding noise in near-zero gradients into a fraction of the learning rate: params
  # to a quarter of it, as in test_models.py; the moments tightly
  assert_trees_match(new_state.params, want_state.params, rtol=1e-4, atol=LEARNING_RATE / 4)
  assert_trees_match(new_state.opt_state, want_state.opt_state, rtol=1e-4, atol=1e-6)
  return plan


@pytest.fixture(scope="module")
def mlp_problem():
  step, state, batch = _mlp_problem()
  return step, state, batch, _rule_sets(step, state, batch, MLP_NAMES, MLP_RULES)


def test_mlp_without_limit_beats_every_rule_set(mlp_problem):
  step, state, batch, rule_sets = mlp_problem
  # Megatron moves 3 activation all-reduces (16 KiB each) and the gradients of the unsplit
  # params; data parallel every gradient (66.8 KB): Megatron is the best rule set here.
  assert min(rule_sets, key=lambda k: rule_sets[k][0]) == "megatron"
  _check_search(step, state, batch, None, rule_sets)


def test_mlp_memory_limit_rules_out_replicated_params(mlp_problem):
  step, state, batch, rule_sets = mlp_problem
  limit = 80_000  # replicated state holds ~200 KB, Megatron's ~100 KB: 2-D is the best that fits
  assert rule_sets["dp"][1] > limit and rule_sets["megatron"][1] > limit
  assert min((b, k) for k, (b, m) in rule_sets.items() if m <= limit)[1] == "2d"
  _check_search(step, state, batch, limit, rule_sets)


def test_search_is_deterministic_and_keeps_given_specs(mlp_problem):
  step, state, batch, _ = mlp_problem
  specs = state_specs(state, jax.tree.map(lambda _: None, state.params))
  given = specs.replace(params={"up": [{"kernel": P("data", None), "bias": None}] * PAIRS,
                                "down": specs.params["down"]})
  plans = [spmd.partition(step, mesh=_mesh(), auto=True, memory_limit=80_000,
                          in_specs=(given, P("data", None))).plan(state, batch)
           for _ in range(2)]
  assert plans[0].in_specs == plans[1].in_specs
  assert plans[0].search.variables == plans[1].search.variables
  assert plans[0].step_bytes == plans[1].step_bytes
  for params in (p.in_specs[0].params for p in plans):
    assert all(layer["kernel"] == P("data", None) for layer in params["up"])
  searched = {name for v in plans[0].search.variables for name in v.inputs}
  assert "'state'.params['up'][0]['kernel']" not in searched
  assert "'state'.params['down'][0]['kernel']" in searched


TRANSFORMER = transformer.Config(vocab=64, d_model=32, heads=4, head_dim=8, mlp=64, layers=1)


def test_transformer_with_only_the_batch_sharded():
  model = transformer.Transformer(TRANSFORMER)
  tokens = jnp.asarray(np.random.default_rng(0).integers(0, 64, (8, 17)), jnp.int32)
  boxed = model.init(jax.random.key(0), tokens[:, :-1])["params"]
  state = TrainState.create(apply_fn=None, params=nn.unbox(boxed), tx=optax.adamw(LEARNING_RATE))
  step = make_train_step(functools.partial(transformer.next_token_loss, model))
  rule_sets = _rule_sets(step, state, tokens, nn.get_partition_spec(boxed),
                         {k: transformer.RULES[k] for k in ("dp", "fsdp", "megatron", "2d")})
  limit = rule_sets["dp"][1] // 2  # no room for replicated params and optimizer state
  _check_search(step, state, tokens, limit, rule_sets)


def test_greedy_fallback_fits_and_matches(mlp_problem, monkeypatch):
  """A program too large for the integer program is chosen greedily: it still fits, says so
  and computes the same step."""
  step, state, batch, rule_sets = mlp_problem
  monkeypatch.setattr(search_module, "ILP_COLUMNS", 0)
  plan = _check_search(step, state, batch, 80_000, rule_sets)
  assert plan.search.method.startswith("greedy (")
  assert "greedy" in plan.explain()


def test_greedy_frees_memory_at_the_least_cost_per_byte():
  costs = [[0, 10, 40], [0, 5]]
  mems = [[100, 50, 10], [60, 20]]
  # 160 bytes: the second variable frees 40 for 5 bytes (0.125/byte), the first 50 for 10 (0.2)
  assert search_module.greedy(costs, mems, 120) == (0, 1)
  assert search_module.greedy(costs, mems, 80) == (1, 1)
  assert search_module.greedy(costs, mems, None) == (0, 0)
  with pytest.raises(ValueError, match="at least 30 bytes"):
    search_module.greedy(costs, mems, 29)
  assert search_module.choose(costs, mems, 80).picks == (1, 1)


@dataclasses.dataclass(frozen=True)
class _Device:
  """A device as ``device_memory`` sees it: what ``memory_stats()`` reports."""

  stats: dict | None

  def memory_stats(self) -> dict | None:
    return self.stats


def test_memory_limit_defaults_to_the_devices_memory(mlp_problem):
  assert search_module.device_memory([_Device({"bytes_limit": 2**30}),
                                      _Device({"bytes_limit": 2**29})]) == 2**29
  assert search_module.device_memory(jax.devices()) is None  # XLA:CPU reports no memory
  step, state, batch, _ = mlp_problem
  plan = spmd.partition(step, mesh=_mesh(), auto=True,
                        in_specs=(None, P("data", None))).plan(state, batch)
  assert plan.search.memory_limit is None and plan.search.limit_source == "none"
  assert "no limit: the devices report no memory" in plan.explain()


def _loops(x, ws):
  """Collectives in a scan (10 trips), nested scans (5 x 2) and a while loop (unknown trips)."""
  def layer(h, w):
    return jnp.tanh(h @ w), None

  def block(h, w_pair):
    return jax.lax.scan(layer, h, w_pair)[0], None

  h, _ = jax.lax.scan(layer, x, ws)
  h, _ = jax.lax.scan(block, h, ws.reshape(5, 2, 16, 16))
  return jax.lax.while_loop(lambda c: c[1] < 3,
                            lambda c: (jnp.tanh(c[0] @ ws[0]), c[1] + 1), (h, 0))[0]


def _pooled_conv(x, k):
  """A 3x3 conv and a 3x3/2 max pool: halo exchanges wherever the search splits H or W."""
  y = jax.lax.conv_general_dilated(x, k, (1, 1), "SAME",
                                   dimension_numbers=("NHWC", "HWIO", "NHWC"))
  return jax.lax.reduce_window(y, -jnp.inf, jax.lax.max, (1, 3, 3, 1), (1, 2, 2, 1), "SAME")


def _manual_in_a_scan(x, w):
  """A user's shard_map whose body all-reduces, 3 times in a scan."""
  reduce = jax.shard_map(lambda block: jax.lax.psum(block, "model"), mesh=_mesh(),
                         in_specs=P("data", "model"), out_specs=P("data", None))
  return jax.lax.scan(lambda h, _: (jnp.tanh(reduce(h) @ w), None), x, None, length=3)[0]


@pytest.mark.parametrize("fn, args, specs", [
    (_loops, (jnp.ones((8, 16)), jnp.ones((10, 16, 16)) / 16), (P("data", None), None)),
    (_pooled_conv, (jnp.linspace(-1, 1, 2 * 16 * 16 * 4).reshape(2, 16, 16, 4),
                    jnp.linspace(-1, 1, 3 * 3 * 4 * 8).reshape(3, 3, 4, 8)), (None, P())),
    (_manual_in_a_scan, (jnp.linspace(-1, 1, 8 * 16).reshape(8, 16),
                         jnp.linspace(-1, 1, 4 * 16).reshape(4, 16)), (None, None)),
], ids=["loops", "halos", "shard_map"])
def test_candidates_are_priced_as_their_plans_count(fn, args, specs, monkeypatch):
  """The search prices each candidate from its schedule without rendering its plan: that price
  is the rendered plan's step_bytes (loop trips counted, halo exchanges and a shard_map body's
  collectives included)."""
  planner_module = importlib.import_module("spmd.partition.planner")
  priced = []
  price = planner_module.Planner.step_bytes

  def checked(self, scheduled):
    priced.append((price(self, scheduled), self.render(scheduled).plan.step_bytes))
    return priced[-1][0]

  monkeypatch.setattr(planner_module.Planner, "step_bytes", checked)
  f = spmd.partition(fn, mesh=_mesh(), auto=True, in_specs=specs)
  plan = f.plan(*args)
  assert len({bytes_ for bytes_, _ in priced}) > 2, priced  # candidates that move different bytes
  assert all(ours == rendered for ours, rendered in priced), priced
  assert plan.search.step_bytes == plan.step_bytes
  assert_trees_match(f(*args), jax.jit(fn)(*args), rtol=1e-5, atol=1e-6)
