"""Pictures and summaries checked against the plan and the sharding they draw."""
import math
import xml.etree.ElementTree as ET
from collections import Counter

import flax.linen as nn
import jax
import jax.numpy as jnp
import pytest
from jax import lax
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import spmd
from spmd.visual import layout, program

SVG = "{http://www.w3.org/2000/svg}"
NHWC = ("NHWC", "HWIO", "NHWC")


@pytest.fixture(scope="module")
def mesh():
  return spmd.make_mesh({"data": 2, "model": 4})


def _groups(svg: str, cls: str) -> list[ET.Element]:
  return [g for g in ET.fromstring(svg).iter(f"{SVG}g") if g.get("class") == cls]


def _ranges(text: str) -> tuple:
  return tuple(tuple(map(int, r.split(":"))) for r in text.split(";")) if text else ()


LAYOUTS = [((16, 32), P("data", "model")),
           ((10, 7), P("data", "model")),                       # uneven along both dims
           ((5, 3, 6), P(("data", "model"), None, None)),       # 8 shards of 5 rows: 3 all padding
           ((9,), P(("model", "data"))),                        # minor-major order of axes
           ((3, 4, 5, 6), P(None, "model", None, "data")),
           ((6, 4), P(None, None)),                             # replicated: 8 devices, one block
           ((), P())]


@pytest.mark.parametrize("shape,spec", LAYOUTS)
def test_layout_blocks_are_the_shards_index_ranges(mesh, shape, spec):
  """spmd pads a dim of N split n ways to n * ceil(N/n) and lets JAX place the padded array: the
  blocks are what JAX's placement of the padded shape gives each device, clipped to the array."""
  lay = layout(shape, spec, mesh)
  counts = [math.prod(mesh.shape[a] for a in ((e,) if isinstance(e, str) else e or ()))
            for e in tuple(spec) + (None,) * (len(shape) - len(spec))]
  padded = tuple(-(-n // k) * k for n, k in zip(shape, counts))
  placed = NamedSharding(mesh, spec).devices_indices_map(padded)
  held = {d: b for b in lay.blocks for d in b.devices}
  assert sorted(held) == sorted(d.id for d in mesh.devices.flat)
  for device, index in placed.items():
    b = held[device.id]
    want = tuple((s.start or 0, n if s.stop is None else s.stop) for s, n in zip(index, padded))
    assert b.ranges == want
    assert b.valid == tuple((min(a, n), min(z, n)) for (a, z), n in zip(want, shape))
    assert b.padding == tuple((z - a) - (min(z, n) - min(a, n)) for (a, z), n in zip(want, shape))
  blocks = _groups(lay.svg(), "block")
  assert [(g.get("data-devices"), _ranges(g.get("data-ranges")), _ranges(g.get("data-valid")))
          for g in blocks] == [(",".join(map(str, b.devices)), b.ranges, b.valid)
                               for b in lay.blocks]
  for g, b in zip(blocks, lay.blocks):  # padding hatched exactly where a block has some
    assert any(r.get("class") == "padding" for r in g.iter(f"{SVG}rect")) == any(b.padding)


def test_layout_of_an_array_and_before_any_array_exists(mesh):
  x = jax.device_put(jnp.arange(8 * 12.0).reshape(8, 12), NamedSharding(mesh, P("model", "data")))
  lay = layout(x)
  assert lay == layout((8, 12), P("model", "data"), mesh)
  for shard in x.addressable_shards:
    (b,) = [b for b in lay.blocks if shard.device.id in b.devices]
    assert b.ranges == tuple((s.start, s.stop) for s in shard.index)
  abstract = layout((10, 7), P("data", "model"), {"data": 2, "model": 4})  # no devices at all
  assert [b.valid for b in abstract.blocks] == [b.valid for b in layout((10, 7), P("data", "model"),
                                                                         mesh).blocks]
  assert "devices 3: [0:5, 6:7] + padding (0, 1)" in str(abstract)


def _conv_net(x, w1, w2):
  h = jax.nn.relu(lax.conv_general_dilated(x, w1, (1, 1), "SAME", dimension_numbers=NHWC))
  h = spmd.annotate(h, P(None, "model", None, None))
  h = lax.conv_general_dilated(h, w2, (1, 1), "SAME", dimension_numbers=NHWC)
  return jnp.cumsum(h, axis=0).mean()


def _rnn(x, w):
  return lax.scan(lambda h, xt: (jnp.tanh(h @ w + xt), None), jnp.zeros(x.shape[1:]), x)[0]


def _plans(mesh):
  conv = spmd.partition(_conv_net, mesh=mesh, in_specs=(P("data", "model", None, None), P(), P()))
  conv_args = jnp.ones((2, 30, 16, 3)), jnp.ones((3, 3, 3, 8)), jnp.ones((5, 5, 8, 8))
  rnn = spmd.partition(_rnn, mesh=mesh, in_specs=(P(None, "data", None), P(None, "model")))
  grad = spmd.partition(jax.grad(_conv_net, argnums=(1, 2)), mesh=mesh,
                        in_specs=(P("data", "model", None, None), P(), P()))
  roll = spmd.partition(lambda x: jnp.roll(x, 3, axis=0) * 2, mesh=mesh, in_specs=P("model"))
  return [conv.plan(*conv_args), rnn.plan(jnp.ones((5, 8, 16)), jnp.ones((16, 16))),
          grad.plan(*conv_args), roll.plan(jnp.ones((16, 8)))]


def _key(c) -> tuple:
  return (str(c.op), c.kind, ",".join(c.axes), str(c.bytes), str(c.trips))


def test_program_picture_draws_the_plans_collectives_and_halo_arrows(mesh):
  plans = _plans(mesh)
  assert any(c.trips != 1 for c in plans[1].collectives)
  sides = {c.halo.side for p in plans for c in p.collectives if c.halo is not None}
  assert {"left", "right", "rotate"} <= sides, sides
  for plan in plans:
    svg = program(plan, by_layer=False).svg()
    badges = _groups(svg, "collective")
    assert Counter((g.get("data-op", "None"), g.get("data-kind"), g.get("data-axes"),
                    g.get("data-bytes"), g.get("data-trips")) for g in badges) == Counter(
                        _key(c) for c in plan.collectives)
    halos = [c.halo for c in plan.collectives if c.halo is not None]
    drawn = _groups(svg, "halo")
    assert len(drawn) == len(halos) > 0 or plan is plans[1]
    for g, h in zip(drawn, halos):
      arrows = {(int(a.get("data-from")), int(a.get("data-to"))) for a in g.iter(f"{SVG}line")}
      assert arrows == {p for p in h.pairs if p[0] != p[1]}
      assert h.rows > 0
    ops = _groups(svg, "op")
    assert [int(g.get("data-index")) for g in ops] == [r.index for r in plan.rows]
    fills = {}
    for g, row in zip(ops, plan.rows):  # one colour per sharding, annotations outlined
      swatch = next(r for r in g.iter(f"{SVG}rect"))
      assert fills.setdefault(row.specs[0], swatch.get("fill")) == swatch.get("fill")
      assert (swatch.get("class") == "annotation") == row.annotated
    assert len(set(fills.values())) == len(fills)
    assert any(r.annotated for r in plan.rows) or plan in (plans[1], plans[3])


def test_program_picture_by_layer_sums_each_layers_collectives(mesh):
  for plan in _plans(mesh):
    svg = program(plan, by_layer=True).svg()
    layers = _groups(svg, "layer")
    assert [g.get("data-name") for g in layers] == [g.name for g in plan.groups()]
    for drawn, group in zip(layers, plan.groups()):
      got = {b.get("data-kind"): (int(b.get("data-count")), int(b.get("data-step-bytes")))
             for b in drawn.iter(f"{SVG}g") if b.get("class") == "collective"}
      want = {k: (sum(c.kind == k for c in group.collectives),
                  sum(c.step_bytes for c in group.collectives if c.kind == k))
              for k in {c.kind for c in group.collectives}}
      assert got == want


class _Block(nn.Module):
  @nn.compact
  def __call__(self, x):
    return x + nn.Dense(32)(nn.relu(nn.Dense(64)(x)))


class _Net(nn.Module):
  @nn.compact
  def __call__(self, x):
    for _ in range(3):
      x = _Block()(x)
    return x


def test_explain_of_a_training_step_summarizes_by_kind_and_layer(mesh):
  x = jnp.ones((16, 32))
  variables = _Net().init(jax.random.key(0), x)

  def step(v, x):
    loss, g = jax.value_and_grad(lambda v: (_Net().apply(v, x) ** 2).mean())(v)
    return loss, jax.tree.map(lambda a, b: a - 0.1 * b, v, g)

  specs = jax.tree.map(lambda a: P(*(None,) * (a.ndim - 1), "model"), variables)
  plan = spmd.partition(step, mesh=mesh, in_specs=(specs, P("data", None))).plan(variables, x)
  assert len(plan.rows) > 40
  layers = [g.name for g in plan.groups() if g.layer]  # the deepest level with <= 12 layers
  assert sorted(layers) == [f"_Net/_Block_{b}{d}" for b in range(3) for d in ("", "/Dense_0",
                                                                               "/Dense_1")]
  assert sorted(g.name for g in plan.groups(2) if g.layer) == [f"_Net/_Block_{b}" for b in range(3)]
  assert sum(g.step_bytes() for g in plan.groups()) == plan.step_bytes
  assert any(r.backward for r in plan.rows) and not all(r.backward for r in plan.rows)
  text = plan.explain()
  assert "by layer" in text and "_Net/_Block_1/Dense_0" in text
  assert "op table: explain(full=True)" in text
  assert "dot_general" not in text  # no op rows
  kinds = plan.kind_table()
  assert kinds.rows[-1][1] == str(len(plan.collectives))
  assert [r[0] for r in kinds.rows[:-1]] == sorted({c.label for c in plan.collectives})
  assert any(c.axes == ("data",) for c in plan.collectives) and "all-reduce(data)" in text
  full = plan.explain(full=True)
  assert full.startswith(text.split("op table")[0]) and "dot_general" in full
  assert plan.explain(full=False) == text
  html = plan._repr_html_()
  assert "<details>" in html and html.count("<tr>") > len(plan.rows)


def test_small_plans_show_their_op_table(mesh):
  plan = _plans(mesh)[0]
  assert len(plan.rows) <= 40
  assert plan.explain() == plan.explain(full=True)
  assert "by layer" not in plan.explain() and "conv_general_dilated" in plan.explain()
  assert "by layer" in plan.explain(full=False)
  assert "conv_general_dilated" not in plan.explain(full=False)
  assert "<details open>" in plan._repr_html_()
