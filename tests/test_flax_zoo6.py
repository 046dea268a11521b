"""flax's own examples, a tenth round (google/flax examples/, the NNX guides and the linen
lifted-transform docs), small and written as their users write them, run through spmd.partition
on the ("data", "model") meshes: nlp_seq's Transformer encoder tagging parts of speech (padding
weighted out, logical rules over "model", 45 tags uneven over 4), mixed precision as flax writes
it (NNX layers ``dtype=bfloat16, param_dtype=float32``, the loss in float32), linen's lifted
transforms inside a module (``nn.cond``, ``nn.switch``, ``nn.while_loop``, ``nn.map_variables``
weight standardisation, ``nn.checkpoint`` with ``static_argnums``, ``nn.custom_vjp``, ``nn.jvp``
/ ``nn.vjp`` penalties differentiated again), NNX's ``nnx.DiffState`` argnums with ``has_aux``,
the flax_gspmd guide's abstract init (``nnx.get_abstract_model``, the state made sharded by
``jax.jit(out_shardings=)``, in_specs from ``nnx.get_partition_spec``) and tied embeddings
(``nnx.Embed.attend``) over a vocabulary of 250 uneven over "model".
Each is checked against the jitted unpartitioned step, step by step where a loop feeds the state
back, then its plan against the compiled program (helpers.train_loop / nnx_steps / check_plan).
"""
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import spmd
from helpers import (assert_like_jit, assert_partitioned_matches, assert_trees_match, mesh_of,
                     nnx_steps, randn, train_loop)


def logical(init, *names):
  return nn.with_logical_partitioning(init, names)


# --- nlp_seq: a Transformer encoder tagging parts of speech, padding weighted out ---------------

TAG_RULES = (("batch", "data"), ("embed", None), ("mlp", "model"), ("heads", "model"),
             ("tags", "model"), ("vocab", None))
EMBED, TAGS = 16, 45


class EncoderBlock(nn.Module):
  """nlp_seq's Encoder1DBlock: pre-norm self-attention and an MLP, dropout after each; the
  attention's kernels named in the flat form DenseGeneral initializes them in."""
  deterministic: bool

  @nn.compact
  def __call__(self, x, mask):
    init = nn.initializers.lecun_normal()
    y = nn.MultiHeadDotProductAttention(
        num_heads=4, kernel_init=logical(init, "embed", "heads"),
        out_kernel_init=logical(init, "heads", "embed"), deterministic=True)(
            nn.LayerNorm()(x), mask=mask)
    x = x + nn.Dropout(0.1, deterministic=self.deterministic)(y)
    y = nn.relu(nn.Dense(32, kernel_init=logical(init, "embed", "mlp"))(nn.LayerNorm()(x)))
    y = nn.Dense(EMBED, kernel_init=logical(init, "mlp", "embed"))(y)
    return x + nn.Dropout(0.1, deterministic=self.deterministic)(y)


class Tagger(nn.Module):
  """nlp_seq's Transformer: token and learned position embeddings, an encoder block, a tag
  classifier per token; attention masked by padding (token 0)."""
  vocab: int
  deterministic: bool = False

  @nn.compact
  def __call__(self, tokens):
    x = nn.Embed(self.vocab, EMBED, embedding_init=logical(nn.initializers.normal(1.0), "vocab",
                                                           "embed"))(tokens)
    x = x + self.param("pos", logical(nn.initializers.normal(0.02), None, "embed"),
                       (1, tokens.shape[1], EMBED))
    mask = nn.make_attention_mask(tokens > 0, tokens > 0)
    x = EncoderBlock(self.deterministic)(x, mask)
    return nn.Dense(TAGS, kernel_init=logical(nn.initializers.lecun_normal(), "embed", "tags"))(
        nn.LayerNorm()(x))


def tagging_step(params, opt_state, tokens, tags, key, *, tx):
  """nlp_seq's train_step: cross entropy per token, weighted by ``tags > 0`` (padding 0)."""
  def loss_fn(params):
    logits = Tagger(32).apply({"params": params}, tokens, rngs={"dropout": key})
    weights = (tags > 0).astype(jnp.float32)
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, tags) * weights
    return loss.sum() / weights.sum()

  loss, grads = jax.value_and_grad(loss_fn)(params)
  updates, opt_state = tx.update(grads, opt_state, params)
  return optax.apply_updates(params, updates), opt_state, loss


def tagged_batch(batch: int, length: int, seed: int):
  """Sentences of uneven lengths padded with 0: word ids and their tags (0 where padding)."""
  rng = np.random.default_rng(seed)
  live = np.arange(length)[None] < rng.integers(2, length + 1, (batch, 1))
  tokens = np.where(live, rng.integers(1, 32, (batch, length)), 0).astype(np.int32)
  tags = np.where(live, rng.integers(1, TAGS, (batch, length)), 0).astype(np.int32)
  return jnp.asarray(tokens), jnp.asarray(tags), jax.random.key(seed)


@pytest.mark.parametrize("mesh,batch", [("2x4", 4)])
def test_nlp_seq_pos_tagger_padding_weights_uneven_tags(mesh, batch):
  """A step of sgd with a dropout key (not adam: the key projection's bias has a zero
  gradient, softmax being shift-invariant, whose rounding adam would scale up): heads, mlp and
  the 45 tags split over "model" (uneven over 4: the classifier's kernel and logits padded),
  sentences over "data"."""
  tx = optax.sgd(0.1)
  tokens = jnp.ones((batch, 8), jnp.int32)
  variables = jax.jit(Tagger(32, deterministic=True).init)(jax.random.key(0), tokens)
  params, specs = nn.unbox(variables)["params"], nn.get_partition_spec(variables)["params"]
  step = lambda *args: tagging_step(*args, tx=tx)  # noqa: E731
  rows = P("batch")
  plan = train_loop(jax.jit(step), spmd.partition(
      step, mesh=mesh_of(mesh), in_specs=(specs, None, rows, rows, None), rules=TAG_RULES),
                    (params, tx.init(params)), [tagged_batch(batch, 8, 0)],
                    rtol=1e-4, atol=1e-5)
  assert plan.in_specs[0]["Dense_0"]["kernel"] == P(None, "model")


# --- mixed precision as flax writes it: bfloat16 compute, float32 params, the loss in float32 ----

class HalfBlock(nnx.Module):
  """The NNX mixed-precision pattern: every layer ``dtype=bfloat16, param_dtype=float32``."""

  def __init__(self, rngs: nnx.Rngs):
    half = dict(dtype=jnp.bfloat16, param_dtype=jnp.float32, rngs=rngs)
    self.norm = nnx.LayerNorm(16, **half)
    self.up = nnx.Linear(16, 30, kernel_init=nnx.with_partitioning(
        nnx.initializers.lecun_normal(), (None, "model")), **half)
    self.down = nnx.Linear(30, 16, kernel_init=nnx.with_partitioning(
        nnx.initializers.lecun_normal(), ("model", None)), **half)
    self.head = nnx.Linear(16, 3, **half)

  def __call__(self, x):
    x = x + self.down(nnx.relu(self.up(self.norm(x))))
    return self.head(x)


def nnx_half_step(model, optimizer, x, labels):
  def loss_fn(model):
    logits = model(x).astype(jnp.float32)
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

  loss, grads = nnx.value_and_grad(loss_fn)(model)
  optimizer.update(model, grads)
  return loss


def test_nnx_bfloat16_compute_float32_params():
  """Two sgd steps of an NNX block in bfloat16 over float32 params, its 30 hidden features
  split unevenly over "model", 5 rows unevenly over "data"; the loss in float32."""
  def fresh():
    with nnx.use_eager_sharding(False):
      model = HalfBlock(nnx.Rngs(0))
      return model, nnx.Optimizer(model, optax.sgd(0.1), wrt=nnx.Param)

  batches = [(randn(5, 16, seed=s), jnp.arange(5) % 3) for s in range(2)]
  _, (model, _) = nnx_steps(nnx_half_step, fresh, mesh_of("2x4"),
                            (None, None, P("data"), P("data")), batches, rtol=2e-2, atol=2e-2)
  assert model.up.kernel.dtype == jnp.float32


# --- linen's lifted control flow inside a module: nn.cond, nn.switch, nn.while_loop -------------

class Routed(nn.Module):
  """The lifted-transform docs' cond and switch: ``nn.cond`` applies one Dense (made in either
  branch under one name) or its negation, each branch counting its calls in "state";
  ``nn.switch`` one of three heads (every branch run at init, as the docs do, so each makes its
  params)."""

  @nn.compact
  def __call__(self, x, pred, index):
    self.variable("state", "true_count", lambda: jnp.array(0, jnp.int32))
    self.variable("state", "false_count", lambda: jnp.array(0, jnp.int32))
    dense = lambda: nn.Dense(32, name="dense", kernel_init=logical(  # noqa: E731
        nn.initializers.lecun_normal(), "embed", "mlp"))

    def true_fn(mdl, x):
      mdl.variable("state", "true_count").value += 1
      return nn.relu(dense()(x))

    def false_fn(mdl, x):
      mdl.variable("state", "false_count").value += 1
      return -nn.relu(dense()(x))

    def head(i):
      return lambda mdl, h: nn.Dense(4, name=f"head{i}", kernel_init=logical(
          nn.initializers.lecun_normal(), "mlp", None))(h) * (i + 1)

    h = nn.cond(pred, true_fn, false_fn, self, x)
    branches = [head(i) for i in range(3)]
    if self.is_initializing():
      for branch in branches:
        branch(self, h)
    return nn.switch(index, branches, self, h)


def routed_step(params, state, opt_state, x, labels, pred, index, *, tx):
  def loss_fn(params):
    logits, mutated = Routed().apply({"params": params, **state}, x, pred, index,
                                     mutable=["state"])
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean(), mutated

  (loss, state), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
  updates, opt_state = tx.update(grads, opt_state, params)
  return optax.apply_updates(params, updates), state, opt_state, loss


def test_linen_lifted_cond_and_switch_train_step():
  """Three steps, each taking another branch of the cond and of the switch (traced predicate
  and index): the hidden features split over "model", the counters in "state" fed back."""
  tx, x = optax.sgd(0.1, momentum=0.9), randn(8, 16)
  variables = jax.jit(Routed().init)(jax.random.key(0), x, True, 0)
  params, specs = nn.unbox(variables["params"]), nn.get_partition_spec(variables["params"])
  step = lambda *args: routed_step(*args, tx=tx)  # noqa: E731
  batches = [(randn(8, 16, seed=s), jnp.arange(8) % 4, jnp.array(s != 1), jnp.array(s))
             for s in range(3)]
  rules, rows = (("embed", None), ("mlp", "model")), P("data")
  train_loop(jax.jit(step), spmd.partition(
      step, mesh=mesh_of("2x4"), in_specs=(specs, None, None, rows, rows, None, None),
      rules=rules), (params, {"state": variables["state"]}, tx.init(params)), batches,
             rtol=1e-4, atol=1e-5)


class Refine(nn.Module):
  """The docs' ``nn.while_loop``: a Dense applied to the carry while the "state" counter (a
  carried variable) stays under ``steps``; the Dense's params broadcast into the loop."""
  steps: int

  @nn.compact
  def __call__(self, x):
    def cond_fn(mdl, c):
      return mdl.variables["state"]["acc"] < self.steps

    def body_fn(mdl, c):
      acc = mdl.variable("state", "acc", lambda: jnp.array(0, jnp.int32))
      acc.value += 1
      return jnp.tanh(nn.Dense(c.shape[-1], kernel_init=logical(
          nn.initializers.lecun_normal(), "embed", "mlp"))(c))

    if self.is_mutable_collection("params"):
      return body_fn(self, x)
    return nn.while_loop(cond_fn, body_fn, self, x, carry_variables="state")


def test_linen_lifted_while_loop_carries_state_over_rows_split():
  """Evaluation through ``nn.while_loop`` (three trips), the rows over "data" and the kernel's
  output features over "model": the loop's carry and its counter come back as the
  unpartitioned apply gives them."""
  x = randn(8, 16)
  variables = jax.jit(Refine(3).init)(jax.random.key(0), x)
  params, specs = nn.unbox(variables["params"]), nn.get_partition_spec(variables["params"])
  state = {"acc": jnp.array(0, jnp.int32)}

  def evaluate(params, state, x):
    return Refine(3).apply({"params": params, "state": state}, x, mutable=["state"])

  with nn.logical_axis_rules((("embed", None), ("mlp", "model"))):
    assert_partitioned_matches(evaluate, (params, state, x), (specs, None, P("data")),
                               mesh_of("2x4"), rtol=1e-5, atol=1e-5)


# --- linen: nn.map_variables (weight standardisation), nn.checkpoint static_argnums, custom_vjp --

def standardize(params):
  """Weight standardisation of every kernel over its input features."""
  def one(x):
    if x.ndim < 2:
      return x
    x = x - jnp.mean(x, axis=0, keepdims=True)
    return x / jnp.sqrt(jnp.mean(jnp.square(x), axis=0, keepdims=True) + 1e-5)

  return jax.tree.map(one, params)


StdDense = nn.map_variables(nn.Dense, "params", trans_in_fn=standardize, init=True)


class StdBlock(nn.Module):
  """A residual block of standardised Dense layers (30 hidden features), dropout unless
  ``deterministic``."""

  @nn.compact
  def __call__(self, x, deterministic: bool):
    init = nn.initializers.lecun_normal()
    y = nn.gelu(StdDense(30, kernel_init=logical(init, "embed", "mlp"))(nn.LayerNorm()(x)))
    y = nn.Dropout(0.2, deterministic=deterministic)(y)
    return x + StdDense(16, kernel_init=logical(init, "mlp", "embed"))(y)


class ClippedHead(nn.Module):
  """The docs' ``nn.custom_vjp`` around a Dense: its backward pass clips each param gradient's
  norm to 0.1."""

  @nn.compact
  def __call__(self, x):
    def f(mdl, x):
      return mdl(x)

    def fwd(mdl, x):
      return nn.vjp(f, mdl, x)

    def bwd(vjp_fn, y_t):
      params_t, *inputs_t = vjp_fn(y_t)
      return (jax.tree.map(lambda g: g * jnp.minimum(1.0, 0.1 / jnp.linalg.norm(g)), params_t),
              *inputs_t)

    return nn.custom_vjp(f, forward_fn=fwd, backward_fn=bwd)(nn.Dense(4), x)


class StdNet(nn.Module):
  @nn.compact
  def __call__(self, x, deterministic: bool = False):
    x = nn.checkpoint(StdBlock, static_argnums=(2,))()(x, deterministic)
    return ClippedHead()(x)


def std_step(params, opt_state, x, labels, key, *, tx):
  def loss_fn(params):
    logits = StdNet().apply({"params": params}, x, rngs={"dropout": key})
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

  loss, grads = jax.value_and_grad(loss_fn)(params)
  updates, opt_state = tx.update(grads, opt_state, params)
  return optax.apply_updates(params, updates), opt_state, loss


def test_linen_map_variables_checkpoint_static_argnums_custom_vjp():
  """Two adam steps: kernels standardised by ``nn.map_variables`` (a mean and norm over the
  input features, in the second layer its 30 hidden features split unevenly over "model": the
  padding masked out of both), the block under ``nn.checkpoint`` with
  the deterministic flag static, the head's gradients clipped by ``nn.custom_vjp``."""
  tx, x = optax.adam(1e-2), randn(8, 16)
  variables = jax.jit(StdNet().init, static_argnums=2)(jax.random.key(0), x, True)
  params, specs = nn.unbox(variables)["params"], nn.get_partition_spec(variables)["params"]
  step = lambda *args: std_step(*args, tx=tx)  # noqa: E731
  batches = [(randn(8, 16, seed=s), jnp.arange(8) % 4, jax.random.key(s)) for s in range(2)]
  rules, rows = (("embed", None), ("mlp", "model")), P("data")
  train_loop(jax.jit(step), spmd.partition(
      step, mesh=mesh_of("2x4"), in_specs=(specs, None, rows, rows, None), rules=rules),
             (params, tx.init(params)), batches, rtol=1e-4, atol=1e-5)


# --- NNX transforms: nnx.DiffState argnums, value_and_grad with has_aux -------------------------

def sharded(*names):
  return nnx.with_partitioning(nnx.initializers.lecun_normal(), names)


class Encoder(nnx.Module):
  def __init__(self, rngs: nnx.Rngs):
    self.up = nnx.Linear(16, 32, kernel_init=sharded(None, "model"), rngs=rngs)
    self.down = nnx.Linear(32, 16, kernel_init=sharded("model", None), rngs=rngs)
    self.norm = nnx.LayerNorm(16, rngs=rngs)

  def __call__(self, x):
    return self.norm(x + self.down(nnx.gelu(self.up(x))))


class Probe(nnx.Module):
  """A linear probe whose logits are also counted in a non-Param Variable."""

  def __init__(self, rngs: nnx.Rngs):
    self.linear = nnx.Linear(16, 4, rngs=rngs)
    self.calls = nnx.Variable(jnp.array(0, jnp.int32))

  def __call__(self, x):
    self.calls[...] += 1
    return self.linear(x)


def probe_step(encoder, probe, optimizer, x, labels):
  """The transforms guide's ``argnums`` with ``nnx.DiffState``: gradients of the probe's Params
  only (the encoder is an argument but not differentiated), the logits returned as aux."""
  def loss_fn(encoder, probe):
    logits = probe(encoder(x))
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean(), logits

  grad_fn = nnx.value_and_grad(loss_fn, argnums=nnx.DiffState(1, nnx.Param), has_aux=True)
  (loss, logits), grads = grad_fn(encoder, probe)
  optimizer.update(probe, grads)
  return loss, jnp.argmax(logits, axis=-1)


def test_nnx_diff_state_argnums_value_and_grad_has_aux():
  """Three adam steps of the probe over a frozen encoder split over "model" (4x2 mesh): the
  encoder stays as made, the probe's call counter (not differentiated) advances."""
  def fresh():
    with nnx.use_eager_sharding(False):
      probe = Probe(nnx.Rngs(1))
      return Encoder(nnx.Rngs(0)), probe, nnx.Optimizer(probe, optax.adam(1e-2), wrt=nnx.Param)

  batches = [(randn(8, 16, seed=s), jnp.arange(8) % 4) for s in range(3)]
  mesh = spmd.make_mesh({"data": 4, "model": 2})
  _, (encoder, probe, _) = nnx_steps(probe_step, fresh, mesh,
                                     (None, None, None, P("data"), P("data")), batches)
  assert_trees_match(nnx.state(encoder), nnx.state(fresh()[0]))
  assert int(probe.calls[...]) == 3


# --- the flax_gspmd guide: abstract init, the state made sharded, the step over its specs -------

class DotReluDot(nnx.Module):
  """The flax_gspmd guide's model: a Linear split over "model" by its output features, a bare
  Param split by its input features, the activations constrained to P("data", "model")."""

  def __init__(self, depth: int, rngs: nnx.Rngs):
    init_fn = nnx.initializers.lecun_normal()
    self.dot1 = nnx.Linear(depth, depth, use_bias=False, rngs=rngs,
                           kernel_init=nnx.with_partitioning(init_fn, (None, "model")))
    self.w2 = nnx.Param(init_fn(rngs.params(), (depth, depth)), out_sharding=("model", None))

  def __call__(self, x):
    y = jax.lax.with_sharding_constraint(jax.nn.relu(self.dot1(x)), P("data", "model"))
    return jnp.dot(y, self.w2[...])


def test_nnx_gspmd_guide_abstract_init_then_sharded_state_steps():
  """``nnx.get_abstract_model`` gives the state's shapes and shardings without computing it;
  ``jax.jit(out_shardings=...)`` makes it sharded; three sgd steps of the functional step
  (``nnx.merge`` of the graphdef and state) run with in_specs from ``nnx.get_partition_spec``,
  beside ``jax.jit`` of the same step under the mesh."""
  mesh, tx = mesh_of("2x4"), optax.sgd(0.1, momentum=0.9)
  make = lambda: DotReluDot(16, nnx.Rngs(0))  # noqa: E731
  graphdef, abstract = nnx.get_abstract_model(make, mesh)
  with jax.set_mesh(mesh):
    state = jax.jit(lambda: nnx.state(make()),
                    out_shardings=jax.tree.map(lambda a: a.sharding, abstract))()
  specs = nnx.get_partition_spec(abstract)
  assert state["w2"][...].sharding.spec == specs["w2"].get_value() == P("model", None)

  def step(state, opt_state, x, y):
    def loss_fn(state):
      return jnp.mean((nnx.merge(graphdef, state)(x) - y) ** 2)

    loss, grads = jax.value_and_grad(loss_fn)(state)
    updates, opt_state = tx.update(grads, opt_state, state)
    return optax.apply_updates(state, updates), opt_state, loss

  jitted = jax.jit(step)

  def reference(*args):
    with jax.set_mesh(mesh):
      return jitted(*args)

  batches = [(randn(8, 16, seed=s), randn(8, 16, seed=10 + s)) for s in range(3)]
  partitioned = spmd.partition(step, mesh=mesh, in_specs=(specs, None, P("data"), P("data")))
  train_loop(reference, partitioned, (state, tx.init(state)), batches, rtol=1e-4, atol=1e-5)
  args = (state, tx.init(state), *batches[0])
  assert_like_jit(partitioned(*args)[0], reference(*args)[0])


# --- tied embeddings: nnx.Embed.attend over a vocabulary uneven over "model" --------------------

class TiedLM(nnx.Module):
  """A one-block language model whose output logits are ``embed.attend`` of its final features:
  the embedding table (250 rows, split over "model") is the input and output projection."""

  def __init__(self, vocab: int, rngs: nnx.Rngs):
    self.embed = nnx.Embed(vocab, 16, embedding_init=nnx.with_partitioning(
        nnx.initializers.normal(1.0), ("model", None)), rngs=rngs)
    self.up = nnx.Linear(16, 32, kernel_init=sharded(None, "model"), rngs=rngs)
    self.down = nnx.Linear(32, 16, kernel_init=sharded("model", None), rngs=rngs)
    self.norm = nnx.RMSNorm(16, rngs=rngs)

  def __call__(self, tokens):
    x = self.embed(tokens)
    x = x + self.down(nnx.gelu(self.up(x)))
    return self.embed.attend(self.norm(x))


def tied_step(model, optimizer, tokens):
  """Next-token cross entropy, the padding (token 0) after each row's end weighted out."""
  def loss_fn(model):
    targets = tokens[:, 1:]
    loss = optax.softmax_cross_entropy_with_integer_labels(model(tokens[:, :-1]), targets)
    weights = (targets > 0).astype(loss.dtype)
    return jnp.sum(loss * weights) / jnp.sum(weights)

  loss, grads = nnx.value_and_grad(loss_fn)(model)
  optimizer.update(model, grads)
  return loss


def test_nnx_tied_embedding_attend_uneven_vocab():
  """Two adamw steps over rows padded after their ends: the table's 250 rows over "model"
  (uneven over 4) serve both the lookup and the logits, whose softmax spans the padded shards;
  the table's gradient sums both uses. (The updated table, uneven, comes back replicated: the
  second step takes it so.)"""
  def fresh():
    with nnx.use_eager_sharding(False):
      model = TiedLM(250, nnx.Rngs(0))
      return model, nnx.Optimizer(model, optax.adamw(1e-2, weight_decay=0.1), wrt=nnx.Param)

  rng = np.random.default_rng(0)
  live = np.arange(9) < rng.integers(3, 10, (2, 4, 1))
  batches = [(jnp.asarray(np.where(row, rng.integers(1, 250, (4, 9)), 0), jnp.int32),)
             for row in live]
  in_specs = (None, None, P("data"))
  nnx_steps(tied_step, fresh, mesh_of("2x4"), in_specs, batches)
  first = spmd.partition(tied_step, mesh=mesh_of("2x4"), in_specs=in_specs).plan(
      *fresh(), *batches[0])
  assert first.in_specs[0][0]["embed"]["embedding"].get_value() == P("model", None)


# --- linen's nn.jvp and nn.vjp inside a module: a smoothness penalty, differentiated twice -------

class TanhMLP(nn.Module):
  @nn.compact
  def __call__(self, x):
    init = nn.initializers.lecun_normal()
    x = nn.tanh(nn.Dense(32, kernel_init=logical(init, "embed", "mlp"))(x))
    return nn.Dense(4, kernel_init=logical(init, "mlp", None))(x)


class Smooth(nn.Module):
  """An MLP's outputs with their derivative along ``v`` (``nn.jvp``, the params' tangents zero)
  and the input gradient of
  their sum (``nn.vjp``), as the lifted-transform docs differentiate a submodule."""

  @nn.compact
  def __call__(self, x, v):
    mlp = TanhMLP()
    params_t = jax.tree.map(jnp.zeros_like, mlp.variables.get("params", {}))
    y, y_t = nn.jvp(lambda mdl, x: mdl(x), mlp, (x,), (v,), {"params": params_t})
    _, vjp_fn = nn.vjp(lambda mdl, x: mdl(x), mlp, x)
    _, x_t = vjp_fn(jnp.ones_like(y))
    return y, y_t, x_t


def test_linen_jvp_and_vjp_penalties_double_backprop():
  """The loss adds the squared directional derivative and input gradient to the cross entropy;
  its gradient (through the jvp and the vjp: second derivatives) with the hidden features over
  "model" and rows over "data"."""
  x, v = randn(8, 16), randn(8, 16, seed=1)
  variables = jax.jit(Smooth().init)(jax.random.key(0), x, v)
  params, specs = nn.unbox(variables)["params"], nn.get_partition_spec(variables)["params"]

  def loss_and_grads(params, x, v, labels):
    def loss_fn(params):
      y, y_t, x_t = Smooth().apply({"params": params}, x, v)
      ce = optax.softmax_cross_entropy_with_integer_labels(y, labels).mean()
      return ce + 0.1 * jnp.mean(y_t ** 2) + 0.1 * jnp.mean(x_t ** 2)

    return jax.value_and_grad(loss_fn)(params)

  rows = P("data")
  assert_partitioned_matches(loss_and_grads, (params, x, v, jnp.arange(8) % 4),
                             (specs, rows, rows, rows), mesh_of("2x4"),
                             rules=(("embed", None), ("mlp", "model")), rtol=1e-4, atol=1e-5)
