"""flax's own examples, a ninth round, small and written as their users write them, run through
spmd.partition on the ("data", "model") meshes: lm1b's decoder, its blocks under ``nn.scan``,
with its own attention whose "cache" collection is boxed by logical names (the stacked cache
split over heads and batch, several decode steps fed back), trained on packed examples
(segment-aware shift and masks, positions) with lm1b's label-smoothed loss weighted by padding,
its vocabulary (250) uneven over "model", no more bytes than XLA's; an ``nnx.vmap`` ensemble
whose members' params, batch statistics and dropout streams are vmapped by ``nnx.StateAxes``
and named "members" by ``transform_metadata`` (3 members over 4 devices: their keys padded, as
an uneven key argument's); ``nnx.scan`` over layers split over "model" (``nnx.remat`` with a
policy inside) and over time with the recurrent cell itself the ``nnx.Carry`` (sequences of
uneven lengths masked); and an ``nnx.Optimizer`` whose ``wrt`` is ``nnx.All(nnx.Param,
nnx.PathContains(...))``, the step splitting the model by that filter with ``nnx.split`` /
``nnx.merge``.
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
from flax.training import common_utils
from jax import lax
from jax.sharding import PartitionSpec as P

import spmd
from helpers import (assert_partitioned_matches, assert_trees_match, check_plan, mesh_of,
                     nnx_steps, randn, train_loop, xla_bytes)
from test_flax_zoo import scan_stack_step  # a classifier's adam step over an NNX model


# --- lm1b's decoder, blocks scanned: its own attention with a logically named "cache" ----------

LM_RULES = (("batch", "data"), ("heads", "model"), ("mlp", "model"), ("vocab", "model"),
            ("embed", None), ("kv", None), ("length", None), ("layers", None))
LENGTH, EMBED, HEADS = 8, 16, 4


def logical(init, *names):
  return nn.with_logical_partitioning(init, names)


class CachedSelfAttention(nn.Module):
  """lm1b's attention written out: q, k, v by DenseGeneral, whose kernels are named in their
  flat (embed, heads * kv) form as flax initializes them (("embed", "heads")); when
  ``decode``, keys and values are written into the "cache" collection (boxed by logical names)
  at its index, and the query attends to the positions written so far."""
  decode: bool = False

  @nn.compact
  def __call__(self, x, mask=None):
    dense = lambda name: nn.DenseGeneral(  # noqa: E731
        (HEADS, EMBED // HEADS), name=name, use_bias=False,
        kernel_init=logical(nn.initializers.lecun_normal(), "embed", "heads"))
    q, k, v = dense("query")(x), dense("key")(x), dense("value")(x)
    if self.decode:
      initialized = self.has_variable("cache", "cached_key")
      shape = (x.shape[0], LENGTH, HEADS, EMBED // HEADS)
      zeros = logical(jnp.zeros, "batch", "length", "heads", "kv")
      cached_key = self.variable("cache", "cached_key", zeros, shape, k.dtype)
      cached_value = self.variable("cache", "cached_value", zeros, shape, v.dtype)
      index = self.variable("cache", "cache_index", lambda: jnp.array(0, jnp.int32))
      if initialized:
        i = index.value
        cached_key.value = lax.dynamic_update_slice(cached_key.value, k, (0, i, 0, 0))
        cached_value.value = lax.dynamic_update_slice(cached_value.value, v, (0, i, 0, 0))
        k, v = cached_key.value, cached_value.value
        index.value = i + 1
        mask = (jnp.arange(LENGTH) <= i)[None, None, None, :]
    y = nn.dot_product_attention(q, k, v, mask=mask)
    return nn.DenseGeneral(EMBED, axis=(-2, -1), use_bias=False, name="out", kernel_init=logical(
        nn.initializers.lecun_normal(), "heads", "embed"))(y)


class DecoderBlock(nn.Module):
  decode: bool = False

  @nn.compact
  def __call__(self, x, mask):
    x = x + CachedSelfAttention(self.decode)(nn.LayerNorm()(x), mask)
    z = nn.relu(nn.Dense(32, kernel_init=logical(nn.initializers.lecun_normal(), "embed", "mlp"))(
        nn.LayerNorm()(x)))
    return x + nn.Dense(EMBED, kernel_init=logical(nn.initializers.lecun_normal(), "mlp",
                                                   "embed"))(z), None


class Decoder(nn.Module):
  """lm1b's TransformerLM with its blocks scanned (``nn.scan`` over params and cache, the mask
  broadcast, the stacked params and caches named "layers"): token and learned position
  embeddings, masks from padding, causality and packed segments (none when decoding: the cache
  masks)."""
  vocab: int
  decode: bool = False

  @nn.compact
  def __call__(self, tokens, positions, segmentation=None):
    x = nn.Embed(self.vocab, EMBED, embedding_init=logical(nn.initializers.normal(1.0), "vocab",
                                                           "embed"))(tokens)
    x = x + nn.Embed(LENGTH, EMBED, name="pos", embedding_init=logical(
        nn.initializers.normal(0.02), None, "embed"))(positions)
    mask = None if self.decode else nn.combine_masks(
        nn.make_attention_mask(tokens > 0, tokens > 0), nn.make_causal_mask(tokens),
        nn.make_attention_mask(segmentation, segmentation, jnp.equal))
    blocks = nn.scan(DecoderBlock, variable_axes={"params": 0, "cache": 0}, length=2,
                     split_rngs={"params": True}, in_axes=nn.broadcast,
                     metadata_params={nn.PARTITION_NAME: "layers"})
    x, _ = blocks(self.decode, name="layers")(x, mask)
    return nn.Dense(self.vocab, kernel_init=logical(nn.initializers.lecun_normal(), "embed",
                                                    "vocab"))(nn.LayerNorm()(x))


def shift_inputs(x, segmentation):
  """lm1b's shift right within each packed segment: every segment starts from token 0."""
  shifted = jnp.pad(x, ((0, 0), (1, 0)))[:, :-1]
  return shifted * (segmentation == jnp.pad(segmentation, ((0, 0), (1, 0)))[:, :-1])


def weighted_cross_entropy(logits, targets, weights, label_smoothing: float = 0.1):
  """lm1b's compute_weighted_cross_entropy: label smoothing, its constant normalizer removed,
  each position weighted (padding 0). Returns the sum and the weights' sum."""
  vocab, confidence = logits.shape[-1], 1.0 - label_smoothing
  low = (1.0 - confidence) / (vocab - 1)
  normalizing = -(confidence * jnp.log(confidence) + (vocab - 1) * low * jnp.log(low + 1e-20))
  soft = common_utils.onehot(targets, vocab, on_value=confidence, off_value=low)
  loss = (-jnp.sum(soft * nn.log_softmax(logits), axis=-1) - normalizing) * weights
  return loss.sum(), weights.sum()


def packed_batch(batch: int, vocab: int, seed: int):
  """Rows of two packed sequences and padding: tokens, segment ids and positions."""
  rng = np.random.default_rng(seed)
  tokens, segmentation, positions = (np.zeros((batch, LENGTH), np.int32) for _ in range(3))
  for row in range(batch):
    first, second = rng.integers(1, LENGTH // 2 + 1, 2)
    for segment, (start, size) in enumerate([(0, first), (first, second)], start=1):
      tokens[row, start:start + size] = rng.integers(1, vocab, size)
      segmentation[row, start:start + size] = segment
      positions[row, start:start + size] = np.arange(size)
  return tuple(jnp.asarray(a) for a in (tokens, segmentation, positions))


def lm1b_train_step(params, opt_state, tokens, segmentation, positions, *, vocab: int, tx):
  def loss_fn(params):
    logits = Decoder(vocab).apply({"params": params}, shift_inputs(tokens, segmentation),
                                  positions, segmentation)
    loss, normalizer = weighted_cross_entropy(logits, tokens, (tokens > 0).astype(jnp.float32))
    return loss / normalizer

  loss, grads = jax.value_and_grad(loss_fn)(params)
  updates, opt_state = tx.update(grads, opt_state, params)
  return optax.apply_updates(params, updates), opt_state, loss


def init_decoder(vocab: int, batch: int):
  """Params (unboxed) and their logical specs, as lm1b's sharded init gives them."""
  tokens = jnp.ones((batch, LENGTH), jnp.int32)
  variables = jax.jit(Decoder(vocab).init)(jax.random.key(0), tokens, tokens, tokens)
  return nn.unbox(variables)["params"], nn.get_partition_spec(variables)["params"]


def test_lm1b_packed_weighted_label_smoothing_uneven_vocab():
  """Two steps on packed rows, padding weighted out of the label-smoothed loss; the vocabulary
  (250 rows of the embedding, 250 logits) split unevenly over "model"; no more bytes than XLA's
  partitioner moves for the same step."""
  vocab, tx, mesh = 250, optax.adamw(1e-2, weight_decay=0.1), mesh_of("2x4")
  params, param_specs = init_decoder(vocab, 4)
  step = lambda *args: lm1b_train_step(*args, vocab=vocab, tx=tx)  # noqa: E731
  batches = [packed_batch(4, vocab, seed) for seed in range(2)]
  state, rows = (params, tx.init(params)), P("batch")
  plan = train_loop(jax.jit(step), spmd.partition(
      step, mesh=mesh, in_specs=(param_specs, None, rows, rows, rows), rules=LM_RULES),
                    state, batches, rtol=1e-4, atol=1e-5)
  assert plan.in_specs[0]["Embed_0"]["embedding"] == P("model", None)
  resolved = (plan.in_specs[0], None, *plan.in_specs[2:])
  assert plan.total_bytes <= xla_bytes(step, (*state, *batches[0]), resolved, mesh)


def decode_step(params, cache, token, position, *, vocab: int):
  """lm1b's predict step for one token: the cache mutated, the greedy next token."""
  logits, mutated = Decoder(vocab, decode=True).apply(
      {"params": params, "cache": cache}, token, position, mutable=["cache"])
  return mutated["cache"], jnp.argmax(logits[:, -1], axis=-1).astype(jnp.int32)[:, None]


@pytest.mark.parametrize("mesh,batch", [("2x4", 4)])
def test_linen_decode_cache_split_over_heads_and_batch(mesh, batch):
  """Several decode steps, the cache and token fed back: the cache's specs are its boxes' logical
  names (batch over "data", heads over "model") and it comes back split as it went in; no more
  bytes than XLA's partitioner moves for the same step."""
  vocab = 32
  params, param_specs = init_decoder(vocab, batch)
  token = jnp.asarray(np.random.default_rng(0).integers(1, vocab, (batch, 1)), jnp.int32)
  boxed = Decoder(vocab, decode=True).init(jax.random.key(0), token, token)["cache"]
  cache, cache_specs = nn.unbox(boxed), nn.get_partition_spec(boxed)
  assert cache_specs["layers"]["CachedSelfAttention_0"]["cached_key"] == P(
      "layers", "batch", "length", "heads", "kv")
  step = lambda *args: decode_step(*args, vocab=vocab)  # noqa: E731
  mesh = mesh_of(mesh)
  decode = spmd.partition(step, mesh=mesh, rules=LM_RULES,
                          in_specs=(param_specs, cache_specs, P("batch"), P()),
                          out_specs=(cache_specs, P("batch")))
  want = got = (cache, token)
  for position in range(5):
    position = jnp.full((1, 1), position, jnp.int32)
    want = jax.jit(step)(params, *want, position)
    got = decode(params, *got, position)
    assert_trees_match(got, want, rtol=1e-5, atol=1e-5)
  split = nn.logical_to_mesh_sharding(cache_specs, mesh, LM_RULES)
  assert all(jax.tree.leaves(jax.tree.map(lambda a, s: a.sharding.is_equivalent_to(s, a.ndim),
                                          got[0], split)))
  args = (params, cache, token, jnp.zeros((1, 1), jnp.int32))
  plan = check_plan(decode, *args)
  assert plan.total_bytes <= xla_bytes(step, args, plan.in_specs, mesh, plan.out_specs)


# --- nnx.vmap ensemble: params, batch statistics and dropout streams vmapped by StateAxes --------

MEMBERS = 3  # over "model"'s 4 devices: uneven, the members' dropout keys padded
ENSEMBLE_RULES = (("members", "model"), ("batch", "data"), ("embed", None), ("hidden", None))


def named(*names):
  return nnx.with_partitioning(nnx.initializers.lecun_normal(), names)


class Member(nnx.Module):
  def __init__(self, rngs: nnx.Rngs):
    self.up = nnx.Linear(8, 16, use_bias=False,  # BatchNorm would cancel a bias: adam of noise
                         kernel_init=named("embed", "hidden"), rngs=rngs)
    self.norm = nnx.BatchNorm(16, momentum=0.9, rngs=rngs,
                              scale_metadata={"out_sharding": ("hidden",)},
                              bias_metadata={"out_sharding": ("hidden",)})
    self.dropout = nnx.Dropout(0.25, rngs=rngs)
    self.down = nnx.Linear(16, 4, kernel_init=named("hidden", None), rngs=rngs)

  def __call__(self, x):
    return self.down(self.dropout(nnx.relu(self.norm(self.up(x)))))


class VmapEnsemble(nnx.Module):
  """The transforms guide's ensemble: members made by ``nnx.vmap`` over split rngs, their params
  named "members" by ``transform_metadata``; run by ``nnx.vmap`` over
  ``StateAxes({(nnx.Param, nnx.BatchStat, nnx.RngState): 0, ...: None})``, each member with its
  own batch statistics and dropout stream, the input broadcast."""

  def __init__(self, rngs: nnx.Rngs):
    @nnx.split_rngs(splits=MEMBERS)
    @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "members"})
    def create(rngs):
      return Member(rngs)

    self.members = create(rngs)

  def __call__(self, x):
    axes = nnx.StateAxes({(nnx.Param, nnx.BatchStat, nnx.RngState): 0, ...: None})

    @nnx.vmap(in_axes=(axes, None), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "members"})
    def run(member, x):
      return member(x)

    return jnp.mean(run(self.members, x), axis=0)


@pytest.mark.parametrize("mesh,batch", [("2x4", 6)])
def test_nnx_vmap_ensemble_state_axes_members_named_over_model(mesh, batch):
  """Three steps: each member's params, batch statistics and dropout keys split over "model" by
  their "members" name (3 members over 4 devices), the batch over "data". Regression: the
  members' dropout keys, split unevenly, were padded by ``jnp.pad``, which cannot make keys."""
  def fresh():
    with nnx.use_eager_sharding(False):  # the names stay metadata: spmd resolves them
      model = VmapEnsemble(nnx.Rngs(0, dropout=1))
      return model, nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)

  mesh, in_specs = mesh_of(mesh), (None, None, P("batch"), P("batch"))
  batches = [(randn(batch, 8, seed=s), jnp.arange(batch) % 4) for s in range(3)]
  partitioned = spmd.partition(scan_stack_step, mesh=mesh, in_specs=in_specs,
                               rules=ENSEMBLE_RULES)
  first = partitioned.plan(*fresh(), *batches[0])
  assert first.in_specs[0][0]["members"]["up"]["kernel"].get_value() == P("model", None, None)
  _, (model, _) = nnx_steps(scan_stack_step, fresh, mesh, in_specs, batches,
                            rules=ENSEMBLE_RULES)
  assert model.members.norm.mean.shape == (MEMBERS, 16)



def test_prng_key_array_split_unevenly_as_an_argument():
  """The ensemble's regression at its root, without flax: a key array argument split unevenly
  (3 rows over 4 devices) is padded by its key data before the program runs, and its keys fold
  and draw as unpartitioned."""
  def draw(keys):
    folded = jax.vmap(jax.vmap(jax.random.fold_in))(keys, jnp.arange(15).reshape(3, 5))
    return jax.vmap(jax.vmap(lambda k: jax.random.bits(k, (2,))))(folded)

  assert_partitioned_matches(draw, (jax.random.split(jax.random.key(0), (3, 5)),), P("x"), "x4")

# --- nnx.scan over time, the recurrent cell itself the carry; sequences of uneven lengths -------

class CountingCell(nnx.Module):
  """A GRU-style cell whose hidden state and step count are its own Variables."""

  def __init__(self, batch: int, features: int, hidden: int, rngs: nnx.Rngs):
    self.gates = nnx.Linear(features + hidden, 2 * hidden, kernel_init=named("embed", "hidden"),
                            rngs=rngs)
    self.candidate = nnx.Linear(features + hidden, hidden, kernel_init=named("embed", "hidden"),
                                rngs=rngs)
    self.h = nnx.Variable(jnp.zeros((batch, hidden)))
    self.steps = nnx.Variable(jnp.array(0))

  def __call__(self, x, live):
    xh = jnp.concatenate([x, self.h[...]], axis=-1)
    reset, update = jnp.split(nnx.sigmoid(self.gates(xh)), 2, axis=-1)
    candidate = jnp.tanh(self.candidate(jnp.concatenate([x, reset * self.h[...]], axis=-1)))
    h = (1 - update) * self.h[...] + update * candidate
    self.h[...] = jnp.where(live[:, None], h, self.h[...])  # padding leaves the state alone
    self.steps[...] += 1
    return self.h[...]


class ScanClassifier(nnx.Module):
  def __init__(self, batch: int, rngs: nnx.Rngs):
    self.embed = nnx.Embed(20, 8, rngs=rngs)
    self.cell = CountingCell(batch, 8, 16, rngs)
    self.head = nnx.Linear(16, 3, rngs=rngs)

  def __call__(self, tokens, lengths):
    self.cell.h[...] = jnp.zeros_like(self.cell.h[...])
    live = jnp.arange(tokens.shape[1])[None, :] < lengths[:, None]

    @nnx.scan(in_axes=(nnx.Carry, 1, 1), out_axes=(nnx.Carry, 1))
    def over_time(cell, x, live):
      return cell, cell(x, live)

    _, hs = over_time(self.cell, self.embed(tokens), live)
    pooled = jnp.sum(hs * live[..., None], axis=1) / lengths[:, None]
    return self.head(pooled)


def scan_step(model, optimizer, tokens, lengths, labels):
  def loss_fn(model):
    return optax.softmax_cross_entropy_with_integer_labels(model(tokens, lengths), labels).mean()

  loss, grads = nnx.value_and_grad(loss_fn)(model)
  optimizer.update(model, grads)
  return loss


@pytest.mark.parametrize("mesh,batch", [("2x4", 4)])
def test_nnx_scan_with_the_cell_as_carry_over_padded_sequences(mesh, batch):
  """The cell (its hidden state and step count Variables) threaded through ``nnx.scan`` as the
  ``nnx.Carry``; the hidden features named "hidden" (over "model"), the batch over "data", each
  sequence pooled within its length."""
  def fresh():
    with nnx.use_eager_sharding(False):
      model = ScanClassifier(batch, nnx.Rngs(0))
      return model, nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)

  rng = np.random.default_rng(0)
  batches = [(jnp.asarray(rng.integers(0, 20, (batch, 7)), jnp.int32),
              jnp.asarray(rng.integers(1, 8, batch), jnp.int32), jnp.arange(batch) % 3)
             for _ in range(2)]
  rules = (("batch", "data"), ("embed", None), ("hidden", "model"))
  _, (model, _) = nnx_steps(scan_step, fresh, mesh_of(mesh),
                            (None, None, P("batch"), P("batch"), P("batch")), batches,
                            rules=rules)
  assert int(model.cell.steps[...]) == 2 * 7



# --- nnx.scan over layers split over "model": StateAxes, nnx.Carry, nnx.remat with a policy ----

class LayerNormMLP(nnx.Module):
  def __init__(self, rngs: nnx.Rngs):
    self.norm = nnx.LayerNorm(16, rngs=rngs, scale_init=nnx.with_partitioning(
        nnx.initializers.ones_init(), ("embed",)))
    self.up = nnx.Linear(16, 32, kernel_init=named("embed", "mlp"), rngs=rngs)
    self.down = nnx.Linear(32, 16, kernel_init=named("mlp", "embed"), rngs=rngs)

  def __call__(self, x):
    return x + self.down(nnx.gelu(self.up(self.norm(x))))


class LayerStack(nnx.Module):
  """Four layers made by ``nnx.vmap`` and run by ``nnx.scan`` over
  ``StateAxes({nnx.Param: 0, ...: None})`` with the activations the ``nnx.Carry``, each layer
  under ``nnx.remat`` saving only its non-batched dots; the stacked params named "layers"."""

  def __init__(self, rngs: nnx.Rngs):
    @nnx.split_rngs(splits=4)
    @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: "layers"})
    def create(rngs):
      return LayerNormMLP(rngs)

    self.layers = create(rngs)
    self.head = nnx.Linear(16, 3, rngs=rngs)

  def __call__(self, x):
    @nnx.scan(in_axes=(nnx.Carry, nnx.StateAxes({nnx.Param: 0, ...: None})), out_axes=nnx.Carry,
              transform_metadata={nnx.PARTITION_NAME: "layers"})
    @nnx.remat(policy=jax.checkpoint_policies.dots_with_no_batch_dims_saveable)
    def forward(x, layer):
      return layer(x)

    return self.head(forward(x, self.layers))


@pytest.mark.parametrize("mesh,batch", [("2x4", 8)])
def test_nnx_scan_over_layers_split_over_model_with_remat_policy(mesh, batch):
  """Two adam steps with the stacked layers split over "model" (one layer per device column):
  each trip reads its layer from the devices that hold it."""
  def fresh():
    with nnx.use_eager_sharding(False):
      model = LayerStack(nnx.Rngs(0))
      return model, nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)

  rules = (("batch", "data"), ("layers", "model"), ("embed", None), ("mlp", None))
  batches = [(randn(batch, 16, seed=s), jnp.arange(batch) % 3) for s in range(2)]
  plan, _ = nnx_steps(scan_stack_step, fresh, mesh_of(mesh),
                      (None, None, P("batch"), P("batch")), batches, rules=rules)
  assert plan.in_specs[0][0]["layers"]["up"]["kernel"].get_value() == P("model", None, None)


# --- nnx.Optimizer over a path filter: adapters trained, the frozen encoder split off ----------

ADAPTERS = nnx.All(nnx.Param, nnx.PathContains("adapter"))


class AdaptedBlock(nnx.Module):
  """A residual block with a bottleneck adapter beside it (Houlsby-style)."""

  def __init__(self, rngs: nnx.Rngs):
    self.mlp = nnx.Linear(16, 32, kernel_init=named("embed", "mlp"), rngs=rngs)
    self.out = nnx.Linear(32, 16, kernel_init=named("mlp", "embed"), rngs=rngs)
    self.adapter = nnx.Sequential(
        nnx.Linear(16, 4, kernel_init=named("embed", None), rngs=rngs), nnx.gelu,
        nnx.Linear(4, 16, kernel_init=nnx.with_partitioning(nnx.initializers.zeros_init(),
                                                            (None, "embed")), rngs=rngs))

  def __call__(self, x):
    y = x + self.out(nnx.relu(self.mlp(x)))
    return y + self.adapter(y)


class AdaptedEncoder(nnx.Module):
  def __init__(self, rngs: nnx.Rngs):
    self.blocks = nnx.List([AdaptedBlock(rngs) for _ in range(2)])
    self.norm = nnx.LayerNorm(16, rngs=rngs)
    self.head = nnx.Linear(16, 5, rngs=rngs)

  def __call__(self, x):
    for block in self.blocks:
      x = block(x)
    return self.head(self.norm(x))


def adapter_step(model, optimizer, x, labels):
  """The filters guide's split: ``nnx.split(model, ADAPTERS, ...)``, the loss of the trainable
  state merged back, its gradient by ``jax.value_and_grad``, the optimizer over ``wrt=ADAPTERS``."""
  graphdef, trainable, rest = nnx.split(model, ADAPTERS, ...)

  def loss_fn(trainable):
    logits = nnx.merge(graphdef, trainable, rest)(x)
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

  loss, grads = jax.value_and_grad(loss_fn)(trainable)
  optimizer.update(model, grads)
  return loss


@pytest.mark.parametrize("mesh,batch", [("2x4", 6)])
def test_nnx_optimizer_wrt_path_filter_trains_only_adapters(mesh, batch):
  """Three steps of adam over the adapters only: the encoder's kernels (split over "model" by
  their "mlp" names) and the head stay as made; the adapters move."""
  def fresh():
    with nnx.use_eager_sharding(False):
      model = AdaptedEncoder(nnx.Rngs(0))
      return model, nnx.Optimizer(model, optax.adam(1e-2), wrt=ADAPTERS)

  batches = [(randn(batch, 16, seed=s), jnp.arange(batch) % 5) for s in range(3)]
  rules = (("batch", "data"), ("embed", None), ("mlp", "model"))
  plan, (model, _) = nnx_steps(adapter_step, fresh, mesh_of(mesh),
                               (None, None, P("batch"), P("batch")), batches, rules=rules)
  made = fresh()[0]
  frozen = nnx.Not(ADAPTERS)
  assert_trees_match(nnx.state(model, frozen), nnx.state(made, frozen))
  moved = jax.tree.map(lambda a, b: bool(jnp.any(a != b)), nnx.state(model, ADAPTERS),
                       nnx.state(made, ADAPTERS))
  assert all(jax.tree.leaves(moved))
  assert plan.in_specs[0][0]["blocks"][0]["mlp"]["kernel"].get_value() == P(None, "model")
