"""flax's own examples, a twelfth round (google/flax examples/ and the NNX guides), small and
written as their users write them, run through spmd.partition on the ("data", "model") meshes:
an NNX ImageNet-style CNN in ``nnx.Sequential`` whose ``nnx.BatchNorm`` statistics are updated
across steps from a batch over "data" (uneven included), switched ``model.train()`` /
``model.eval()`` inside the step, with ``nnx.Dropout`` drawing from the model's ``nnx.Rngs``;
a custom ``Count`` Variable collection incremented per call and read back by ``nnx.state``
filters, gradients by ``nnx.grad(has_aux=True)``; the functional API split into several states
(``nnx.split(model, nnx.Param, nnx.BatchStat, Count)``) under ``jax.value_and_grad``; the
linen <-> NNX bridge carrying BatchNorm statistics (``nnx.bridge.ToNNX`` called with
``mutable=["batch_stats"]``, ``nnx.bridge.ToLinen`` inside a linen TrainState); and an
ogbg_molpcba-style graph network (jraph's GraphNetwork: edge, node and global updates by segment
sums over padded graphs) whose node and edge arrays are sharded, its blocks in an ``nnx.List``,
its messages summed into the nodes and its gradients against XLA's bytes.
Each is checked against the jitted unpartitioned step, step by step where the state is fed back,
then its plan against the compiled program (helpers.train_loop / nnx_steps / check_plan)."""
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from flax.training import train_state
from jax.sharding import PartitionSpec as P

import spmd
from helpers import as_mesh, mesh_of, nnx_steps, no_more_than_xla, randn, train_loop

MESH_4X2 = {"data": 4, "model": 2}


def sharded(*names):
  """lecun_normal, its dims named by mesh axes (the NNX sharding guide's kernel_init)."""
  return nnx.with_partitioning(nnx.initializers.lecun_normal(), names)


def labels_of(batch: int, classes: int, seed: int = 0) -> jax.Array:
  return jnp.asarray(np.random.default_rng(seed).integers(0, classes, batch), jnp.int32)


# --- imagenet-style CNN (NNX): BatchNorm statistics across steps, train / eval modes -------------

def cnn(rngs: nnx.Rngs) -> nnx.Sequential:
  """Conv -> BatchNorm -> relu -> mean-pool -> Dropout -> Linear, the conv's features (8) over
  "model"."""
  return nnx.Sequential(
      nnx.Conv(3, 8, (3, 3), use_bias=False, kernel_init=sharded(None, None, None, "model"),
               rngs=rngs),
      nnx.BatchNorm(8, momentum=0.9, rngs=rngs), nnx.relu,
      lambda x: x.mean(axis=(1, 2)),
      nnx.Dropout(0.2, rngs=rngs),
      nnx.Linear(8, 5, rngs=rngs))


def train_then_eval_step(model, optimizer, images, labels):
  """A training step in ``train()`` mode, then the updated model scores the batch in ``eval()``
  mode (running statistics, no dropout), as imagenet's train and eval steps do."""
  model.train()

  def loss_fn(model):
    logits = model(images)
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean(), logits

  (loss, _), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model)
  optimizer.update(model, grads)
  model.eval()
  return loss, model(images)


def test_nnx_batchnorm_stats_across_steps_train_eval_modes():
  """2 steps on 4x2; 6 rows over 4 "data" shards (uneven: padded rows must not enter the batch
  mean and variance), the features over "model"; BatchNorm's mean / var compared after the
  steps by nnx_steps."""
  def fresh():
    with nnx.use_eager_sharding(False):
      model = cnn(nnx.Rngs(0, dropout=1))
      return model, nnx.Optimizer(model, optax.sgd(0.1, momentum=0.9), wrt=nnx.Param)

  batches = [(randn(6, 6, 6, 3, seed=s), labels_of(6, 5, s)) for s in range(2)]
  _, (model, _) = nnx_steps(train_then_eval_step, fresh, as_mesh(MESH_4X2),
                            (None, None, P("data"), P("data")), batches)
  assert float(jnp.abs(model.layers[1].mean.get_value()).sum()) > 0  # the statistics moved


# --- a custom Variable collection (the NNX basics guide's Count), nnx.state filters -------------

class Count(nnx.Variable):
  """A custom collection: not a Param, so neither differentiated nor optimized."""


class CountedMlp(nnx.Module):
  """Counts its calls and the rows it has seen (a Count each), and keeps a running mean of its
  inputs (a Count too: a custom collection may hold floats), the hidden dim over "model"."""

  def __init__(self, rngs: nnx.Rngs):
    self.up = nnx.Linear(6, 12, kernel_init=sharded(None, "model"), rngs=rngs)
    self.down = nnx.Linear(12, 3, kernel_init=sharded("model", None), rngs=rngs)
    self.calls = Count(jnp.array(0, jnp.int32))
    self.rows = Count(jnp.array(0, jnp.int32))
    self.input_mean = Count(jnp.zeros(6))

  def __call__(self, x):
    self.calls[...] += 1
    self.rows[...] += x.shape[0]
    self.input_mean[...] = 0.5 * self.input_mean[...] + 0.5 * x.mean(axis=0)
    return self.down(nnx.gelu(self.up(x)))


def counted_step(model, optimizer, x, y):
  """``nnx.grad(has_aux=True)`` over the model (its Params: Count is not differentiable), then
  the counters read back through ``nnx.state`` filters."""
  def loss_fn(model):
    pred = model(x)
    return jnp.mean((pred - y) ** 2), pred

  grads, pred = nnx.grad(loss_fn, has_aux=True)(model)
  optimizer.update(model, grads)
  return nnx.state(model, Count), nnx.state(grads, nnx.Param), pred


def test_nnx_custom_count_collection_read_by_state_filters():
  """3 steps on 2x4, the batch of 8 over "data"; the counters, the running mean (a sum over
  the sharded batch) and the gradients' Params match nnx.jit's."""
  def fresh():
    with nnx.use_eager_sharding(False):
      model = CountedMlp(nnx.Rngs(0))
      return model, nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)

  batches = [(randn(8, 6, seed=s), randn(8, 3, seed=s + 10)) for s in range(3)]
  _, (model, _) = nnx_steps(counted_step, fresh, mesh_of("2x4"),
                            (None, None, P("data"), P("data")), batches)
  assert (int(model.calls.get_value()), int(model.rows.get_value())) == (3, 24)


# --- the functional API with several states: nnx.split by three filters, jax.value_and_grad -----

class ConvCounter(nnx.Module):
  """A conv and BatchNorm over 6 features (uneven over "model"'s 4), a call Count."""

  def __init__(self, rngs: nnx.Rngs):
    self.conv = nnx.Conv(2, 6, (3,), use_bias=False,  # BatchNorm cancels a bias's gradient
                         kernel_init=sharded(None, None, "model"), rngs=rngs)
    self.norm = nnx.BatchNorm(6, rngs=rngs)
    self.head = nnx.Linear(6, 4, rngs=rngs)
    self.calls = Count(jnp.array(0, jnp.int32))

  def __call__(self, x):
    self.calls[...] += 1
    return self.head(nnx.relu(self.norm(self.conv(x))).max(axis=1))


def test_nnx_split_into_params_batch_stats_and_counts_functional_step():
  """``graphdef, params, stats, counts = nnx.split(model, nnx.Param, nnx.BatchStat, Count)``;
  the loss merges them and splits the updated statistics and counts back out as its aux (the
  functional API's pure step), params' in_specs from ``nnx.get_partition_spec``; 2 steps on 2x4,
  6 rows over "data", fed back."""
  with nnx.use_eager_sharding(False):
    model = ConvCounter(nnx.Rngs(0))
  graphdef, params, stats, counts = nnx.split(model, nnx.Param, nnx.BatchStat, Count)
  tx = optax.adamw(1e-2)

  def step(params, stats, counts, opt_state, x, labels):
    def loss_fn(params):
      model = nnx.merge(graphdef, params, stats, counts, copy=True)
      logits = model(x)
      _, _, stats_out, counts_out = nnx.split(model, nnx.Param, nnx.BatchStat, Count)
      loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
      return loss, (stats_out, counts_out)

    (loss, (stats, counts)), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
    updates, opt_state = tx.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), stats, counts, opt_state, loss

  in_specs = (nnx.get_partition_spec(params), None, None, None, P("data"), P("data"))
  batches = [(randn(6, 10, 2, seed=s), labels_of(6, 4, s)) for s in range(2)]
  train_loop(jax.jit(step), spmd.partition(step, mesh=mesh_of("2x4"), in_specs=in_specs),
             (params, stats, counts, tx.init(params)), batches, rtol=1e-4, atol=1e-5)


# --- the linen <-> NNX bridge carrying BatchNorm statistics -------------------------------------

class LinenNormBlock(nn.Module):
  """A linen Dense -> BatchNorm -> Dropout block (its statistics in "batch_stats")."""

  @nn.compact
  def __call__(self, x, train: bool):
    x = nn.BatchNorm(use_running_average=not train, momentum=0.8)(nn.Dense(10, use_bias=False)(x))
    return nn.Dropout(0.25, deterministic=not train)(nn.relu(x))


class BridgedNormClassifier(nnx.Module):
  """``nnx.bridge.ToNNX`` of the linen block, called with ``mutable=["batch_stats"]`` in
  training, as the bridge guide writes it; its statistics become NNX state."""

  def __init__(self, x, rngs: nnx.Rngs):
    self.block = nnx.bridge.ToNNX(LinenNormBlock(), rngs=rngs)
    nnx.bridge.lazy_init(self.block, x, train=False)
    self.head = nnx.Linear(10, 3, rngs=rngs)

  def __call__(self, x, train: bool):
    mutable = ["batch_stats"] if train else False
    return self.head(self.block(x, train=train, mutable=mutable))


def bridged_step(model, optimizer, x, labels):
  def loss_fn(model):
    logits = model(x, train=True)
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()

  loss, grads = nnx.value_and_grad(loss_fn)(model)
  optimizer.update(model, grads)
  return loss, model(x, train=False)


def test_nnx_bridge_to_nnx_linen_batchnorm_stats_updated():
  """2 steps on 4x2, 12 rows over "data": the linen block's batch_stats, carried as NNX state,
  match nnx.jit's after the steps, dropout keys drawn from the bridge's forked Rngs."""
  def fresh():
    model = BridgedNormClassifier(randn(12, 7), nnx.Rngs(params=0, dropout=1))
    return model, nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)

  batches = [(randn(12, 7, seed=s), labels_of(12, 3, s)) for s in range(2)]
  nnx_steps(bridged_step, fresh, as_mesh(MESH_4X2), (None, None, P("data"), P("data")), batches)


class NnxNormUnit(nnx.Module):
  """An NNX unit with its own BatchNorm, to run inside linen."""

  def __init__(self, din: int, dout: int, *, rngs: nnx.Rngs):
    self.linear = nnx.Linear(din, dout, use_bias=False, rngs=rngs)
    self.norm = nnx.BatchNorm(dout, momentum=0.8, rngs=rngs)

  def __call__(self, x, *, use_running_average: bool):
    return nnx.relu(self.norm(self.linear(x), use_running_average=use_running_average))


class LinenWithNnxNorm(nn.Module):
  """``nnx.bridge.to_linen`` of the NNX unit: its BatchStat surfaces as linen's
  "batch_stats" collection."""

  @nn.compact
  def __call__(self, x, train: bool):
    x = nnx.bridge.to_linen(NnxNormUnit, 8, 16)(x, use_running_average=not train)
    return nn.Dense(3)(x)


class NormTrainState(train_state.TrainState):
  batch_stats: dict


def test_linen_bridge_to_linen_nnx_batchnorm_in_train_state():
  """imagenet's TrainState with batch_stats, the statistics coming from an NNX BatchNorm
  through ``to_linen``; 2 steps on 2x4, the batch of 6 over "data" (uneven), the hidden units'
  statistics open, compared with jax.jit's step by step."""
  model = LinenWithNnxNorm()
  variables = jax.jit(model.init, static_argnums=2)(jax.random.key(0), randn(6, 8), False)
  state = NormTrainState.create(apply_fn=model.apply, params=variables["params"],
                                batch_stats=variables["batch_stats"], tx=optax.sgd(0.1, 0.9))

  def step(state, x, labels):
    def loss_fn(params):
      logits, updates = state.apply_fn({"params": params, "batch_stats": state.batch_stats}, x,
                                       True, mutable=["batch_stats"])
      loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
      return loss, updates["batch_stats"]

    (loss, stats), grads = jax.value_and_grad(loss_fn, has_aux=True)(state.params)
    return state.apply_gradients(grads=grads, batch_stats=stats), loss

  batches = [(randn(6, 8, seed=s), labels_of(6, 3, s)) for s in range(2)]
  train_loop(jax.jit(step), spmd.partition(step, mesh=mesh_of("2x4"),
                                           in_specs=(None, P("data"), P("data"))),
             (state,), batches, rtol=1e-4, atol=1e-5)


# --- ogbg_molpcba's graph network (jraph's GraphNetwork): edge, node and global updates ---------

class GraphBlock(nnx.Module):
  """One GraphNetwork layer: edges from their endpoints and their graph's globals, nodes from
  the sum of incoming and outgoing edges, globals from the sums of their graph's nodes and
  edges (jraph.GraphNetwork's segment-sum aggregations), each a residual update."""

  def __init__(self, dim: int, rngs: nnx.Rngs):
    self.edge = nnx.Linear(4 * dim, dim, rngs=rngs)
    self.node = nnx.Linear(3 * dim, dim, rngs=rngs)
    self.globe = nnx.Linear(3 * dim, dim, rngs=rngs)

  def __call__(self, h, e, g, senders, receivers, node_graph, edge_graph):
    nodes, graphs = h.shape[0], g.shape[0]
    e = e + nnx.relu(self.edge(jnp.concatenate(
        [e, h[senders], h[receivers], g[edge_graph]], -1)))
    incoming = jax.ops.segment_sum(e, receivers, num_segments=nodes)
    outgoing = jax.ops.segment_sum(e, senders, num_segments=nodes)
    h = h + nnx.relu(self.node(jnp.concatenate([h, incoming, outgoing], -1)))
    node_sums = jax.ops.segment_sum(h, node_graph, num_segments=graphs)
    edge_sums = jax.ops.segment_sum(e, edge_graph, num_segments=graphs)
    return h, e, g + nnx.relu(self.globe(jnp.concatenate([g, node_sums, edge_sums], -1)))


class GraphNet(nnx.Module):
  """Embeddings, GraphBlocks in an ``nnx.List``, a per-graph task head on the globals."""

  def __init__(self, rngs: nnx.Rngs, dim: int = 8, tasks: int = 4, blocks: int = 2):
    self.embed_nodes = nnx.Linear(5, dim, rngs=rngs)
    self.embed_edges = nnx.Linear(3, dim, rngs=rngs)
    self.blocks = nnx.List([GraphBlock(dim, rngs) for _ in range(blocks)])
    self.head = nnx.Linear(dim, tasks, rngs=rngs)
    self.dim = dim

  def __call__(self, graph):
    h, e = self.embed_nodes(graph["nodes"]), self.embed_edges(graph["edges"])
    g = jnp.zeros((graph["graph_mask"].shape[0], self.dim))
    for block in self.blocks:
      h, e, g = block(h, e, g, graph["senders"], graph["receivers"], graph["node_graph"],
                      graph["edge_graph"])
    return self.head(g)


def padded_graphs(nodes_per_graph: list[int], edges: int, nodes: int, seed: int) -> dict:
  """A batch of graphs as flat arrays, padded as jraph.pad_with_graphs pads them: the padding
  nodes and edges belong to a last, masked-out graph; edges stay within their graph."""
  r = np.random.default_rng(seed)
  sizes = nodes_per_graph + [nodes - sum(nodes_per_graph)]
  node_graph = np.repeat(np.arange(len(sizes)), sizes).astype(np.int32)
  edge_graph = np.sort(r.integers(0, len(sizes), edges)).astype(np.int32)
  starts = np.cumsum([0] + sizes[:-1])
  pick = lambda: (starts[edge_graph] + r.integers(0, 1 << 20, edges)  # noqa: E731
                  % np.asarray(sizes)[edge_graph]).astype(np.int32)
  return {"nodes": randn(nodes, 5, seed=seed), "edges": randn(edges, 3, seed=seed + 1),
          "senders": pick(), "receivers": pick(), "node_graph": node_graph,
          "edge_graph": edge_graph, "labels": (r.random((len(sizes), 4)) > 0.5).astype(np.float32),
          "graph_mask": np.arange(len(sizes)) < len(nodes_per_graph)}


def graph_step(model, optimizer, graph):
  """ogbg_molpcba's loss: sigmoid cross-entropy over the tasks of the real graphs."""
  def loss_fn(model):
    loss = optax.sigmoid_binary_cross_entropy(model(graph), graph["labels"]).mean(-1)
    return jnp.sum(jnp.where(graph["graph_mask"], loss, 0.0)) / jnp.sum(graph["graph_mask"])

  loss, grads = nnx.value_and_grad(loss_fn)(model)
  optimizer.update(model, grads)
  return loss


def test_ogbg_graph_network_with_globals_node_and_edge_arrays_sharded():
  """2 steps on 4x2: the 16 nodes over "data", the 20 edges over both axes (uneven over 8),
  the 4 graphs (one of them padding) whole; nnx_steps compares loss and params."""
  def fresh():
    model = GraphNet(nnx.Rngs(0), blocks=1)
    return model, nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)

  edge_spec = P(("data", "model"))
  spec = {"nodes": P("data"), "node_graph": P("data"), "edges": edge_spec,
          "senders": edge_spec, "receivers": edge_spec, "edge_graph": edge_spec,
          "labels": None, "graph_mask": None}
  batches = [(padded_graphs([4, 6, 3], 20, 16, seed=s),) for s in range(2)]
  nnx_steps(graph_step, fresh, as_mesh(MESH_4X2), (None, None, spec), batches)


def graph_loss(graphdef, params, graph):
  """graph_step's loss, of the split model's params (the functional API)."""
  model = nnx.merge(graphdef, params)
  loss = optax.sigmoid_binary_cross_entropy(model(graph), graph["labels"]).mean(-1)
  return jnp.sum(jnp.where(graph["graph_mask"], loss, 0.0)) / jnp.sum(graph["graph_mask"])


def test_ogbg_messages_summed_into_nodes_over_data_no_more_than_xla():
  """Edge messages summed into their receivers (24 edges over both axes), the
  node features wanted over "data": the partial sums over both axes are all-reduced whole,
  512 B, as XLA does, not reduce-scattered over "data" and all-reduced over "model", 640 B."""
  edge_spec = P(("data", "model"))
  no_more_than_xla(lambda e, r: jax.ops.segment_sum(e, r, num_segments=16),
                   (randn(24, 8), padded_graphs([4, 6, 3], 24, 16, seed=0)["receivers"]),
                   (edge_spec, edge_spec), as_mesh(MESH_4X2), P("data"), rtol=1e-5, atol=1e-5)


def test_ogbg_graph_network_grads_no_more_than_xla():
  """The graph network's loss and gradients on 4x2, nodes over "data", 24 edges over both
  axes: 5920 B per device, XLA 6016 B (5952 B before a scatter could gather its updates). Each message's gradient, gathered from the nodes'
  gradient, all-gathers that operand (512 B) as XLA does; it was a masked local gather whose
  partial result was reduce-scattered (768 B), its reduction priced at a share of an add tree
  that also adds a value which is no partial sum (sum_trees.py), 6720 B in all."""
  graphdef, params = nnx.split(GraphNet(nnx.Rngs(0), blocks=1))
  edge_spec = P(("data", "model"))
  spec = {"nodes": P("data"), "node_graph": P("data"), "edges": edge_spec,
          "senders": edge_spec, "receivers": edge_spec, "edge_graph": edge_spec,
          "labels": None, "graph_mask": None}
  fn = jax.value_and_grad(lambda params, graph: graph_loss(graphdef, params, graph))
  plan = no_more_than_xla(fn, (params, padded_graphs([4, 6, 3], 24, 16, seed=0)), (None, spec),
                          as_mesh(MESH_4X2), rtol=1e-4, atol=1e-5)
  assert plan.total_bytes == 5920, plan.explain()
