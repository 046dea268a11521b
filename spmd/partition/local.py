"""Per-primitive local lowering: how one op runs on a device's shards.

The default re-binds the primitive on local arrays (elementwise ops, reductions over whole or
partial dims, dot, sort, ...). Ops whose params carry shapes, whose values depend on the global
position (iota, random bits), or whose sharded dims need masks (gather of owned rows, scatter
into owned rows) have a function here, named in their record in ``catalog.py``.
"""
from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend.random import threefry2x32_p, threefry_prng_impl

from spmd.partition.devices import shard_index
from spmd.partition.halo import cut, mirror, rotate, span
from spmd.partition.halo_geometry import Exchange, Halo, Mirror, Rotation, geometry, joint
from spmd.partition.ir import Op, Value
from spmd.partition.jax_compat import gamma_one, key_impl, poisson_local
from spmd.partition.primitives import bind, describe
from spmd.partition.rules.random import by_position
from spmd.partition.rules.reduce import identity
from spmd.partition.sharding import Axes, MeshShape, TensorSharding


@dataclass(frozen=True)
class Local:
  """One op as scheduled: what each input was read as and each output is written as."""

  op: Op
  reads: tuple[TensorSharding | None, ...]
  writes: tuple[TensorSharding, ...]
  partial_axes: Axes  # axes of the op's sharded reduction factors: its results are partial
  mesh: MeshShape
  halos: tuple[Exchange, ...] = ()
  received: dict = field(default_factory=dict)  # halo pieces already exchanged (schedule.py)
  buffers: Mapping[Value, Value] = field(default_factory=dict)  # a name -> its buffer (aliases)

  def with_halos(self, args: list, *pad_values: Any) -> tuple[list, set[int]]:
    """Operands widened by their halos and cut to this shard's span along each halo dim
    (``pad_values[k]`` fills operand k's rows outside the array)."""
    args = list(args)
    chains: dict[int, tuple] = {}
    for h in self.halos:
      chain = chains.get(h.operand, ())
      args[h.operand] = span(args[h.operand], h, shard_index(h.axes), pad_values[h.operand],
                             self.mesh, self.received, self.prefix(h.operand, chain))
      chains[h.operand] = chain + (geometry(h),)
    for h in self.halos:  # base-dilated dims, exchanged undilated
      if isinstance(h, Halo) and h.dilation > 1:
        args[h.operand] = cut(args[h.operand], h, shard_index(h.axes), pad_values[h.operand])
    return args, {h.dim for h in self.halos}

  def prefix(self, operand: int, chain: tuple) -> tuple:
    """What identifies the pieces received for ``operand`` widened by ``chain`` (halo.py)."""
    x = self.op.inputs[operand]
    return (self.buffers.get(x, x), self.reads[operand], chain)

  def shape(self, x: Any, s: TensorSharding) -> tuple[int, ...]:
    return s.local_shape(x.aval.shape, self.mesh)

  def out_shape(self, k: int = 0) -> tuple[int, ...]:
    return self.shape(self.op.outputs[k], self.writes[k])

  def offset(self, s: TensorSharding, dim: int, local_size: int) -> jax.Array:
    """Global index of this device's first element along ``dim``."""
    return shard_index(s.dims[dim]) * local_size


def run_local(local: Local, args: list) -> list:
  info = describe(local.op.eqn.primitive)
  return info.local(local, args) if info and info.local else bind(local.op, args)


def on_first_device(local: Local, args: list) -> list:
  """A debug callback (``jax.debug.print``, ``jax.debug.callback``) on whole operands, called by
  the first device only: it prints once per call, as under ``jax.jit``, not once per device."""
  def call(whole: tuple) -> tuple:
    bind(local.op, list(whole))
    return ()

  lax.cond(shard_index(tuple(local.mesh)) == 0, call, lambda _: (), tuple(args))
  return []


def broadcast_in_dim(local: Local, args: list) -> list:
  return bind(local.op, args, shape=local.out_shape())


def tile(local: Local, args: list) -> list:
  """Each dim repeated as often as this shard's block of the result is longer than its operand
  (a broadcast dim's block: its local rows)."""
  reps = tuple(m // n for n, m in zip(args[0].shape, local.out_shape()))
  return bind(local.op, args, reps=reps)


def reshape(local: Local, args: list) -> list:
  return bind(local.op, args, new_sizes=local.out_shape(), dimensions=None)


def iota(local: Local, args: list) -> list:
  p, shape = local.op.params, local.out_shape()
  (out,) = bind(local.op, args, shape=shape)
  d = p["dimension"]
  if local.writes[0].dims[d]:
    out = out + local.offset(local.writes[0], d, shape[d]).astype(p["dtype"])
  return [out]


def slice_(local: Local, args: list) -> list:
  p, op = local.op.params, local.op
  args, _ = local.with_halos(args, 0)
  x = args[0]
  start, limit = list(p["start_indices"]), list(p["limit_indices"])
  strides = list(p["strides"] or (1,) * x.ndim)
  owned = []
  for d, axes in enumerate(local.reads[0].dims):
    if axes and op.outputs[0].shape[d] == 1 and op.inputs[0].aval.shape[d] > 1:
      owned.append(d)  # one row of a sharded dim: taken by its owner (rules: a reduction)
      rel = start[d] - shard_index(axes) * x.shape[d]
      mine = (rel >= 0) & (rel < x.shape[d])
      x = jnp.where(mine, lax.dynamic_slice_in_dim(x, jnp.clip(rel, 0, x.shape[d] - 1), 1, d),
                    jnp.zeros((), x.dtype))
    if axes:  # a pass-through dim, a halo dim (the span is the window) or an owned row
      start[d], limit[d] = 0, x.shape[d]
      strides[d] = 1 if d in owned else strides[d]
  return bind(op, [x], start_indices=tuple(start), limit_indices=tuple(limit),
              strides=None if p["strides"] is None else tuple(strides))


def pad(local: Local, args: list) -> list:
  args, halo_dims = local.with_halos(args, args[1])
  config = [(0, 0, 0) if d in halo_dims else c
            for d, c in enumerate(local.op.params["padding_config"])]
  return bind(local.op, args, padding_config=tuple(config))


def rev(local: Local, args: list) -> list:
  """Along each sharded dim takes the mirrored shard's block and reverses it (an uneven dim's
  then rotated into place); reverses the other dims locally."""
  x, chain = args[0], ()
  for h in local.halos:
    if isinstance(h, Rotation):
      x = rotate(x, h, shard_index(h.axes), local.mesh, local.received, local.prefix(0, chain))
    else:
      x = lax.rev(mirror(x, h, local.mesh, local.received, local.prefix(0, chain)), h.dims)
    chain += (geometry(h),)
  done = {d for h in local.halos for d in (h.dims if isinstance(h, Mirror) else (h.dim,))}
  rest = tuple(d for d in local.op.params["dimensions"] if d not in done)
  return bind(local.op, [x], dimensions=rest)


def roll(local: Local, args: list) -> list:
  """Along a sharded dim each shard takes its rows from the shards they rotate from."""
  if not local.halos:
    return bind(local.op, args)
  (r,) = local.halos
  return [rotate(args[0], r, shard_index(r.axes), local.mesh, local.received, local.prefix(0, ()))]


def concatenate(local: Local, args: list) -> list:
  """Along a sharded dim each operand's rows for this shard come from its halo span (or, for an
  operand held whole, from padding it into place); rows are taken by their global index. A
  joint exchange cuts this shard's rows from the operands' blocks concatenated."""
  op, d = local.op, local.op.params["dimension"]
  axes = local.writes[0].dims[d]
  if not axes:
    return bind(op, args)
  if len(local.halos) == 1 and joint(local.halos[0]):
    prefix = tuple(zip(*(local.prefix(k, ()) for k in range(len(args)))))
    return [rotate(lax.concatenate(args, d), local.halos[0], shard_index(axes), local.mesh,
                   local.received, prefix)]
  args, _ = local.with_halos(args, *([0] * len(args)))
  shape = local.out_shape()
  block, shards = shape[d], math.prod(local.mesh[a] for a in axes)
  rows = lax.broadcasted_iota(jnp.int32, shape, d) + shard_index(axes) * block
  out, offset = jnp.zeros(shape, op.outputs[0].dtype), 0
  windowed = {h.operand for h in local.halos}
  for k, (x, arg) in enumerate(zip(op.inputs, args)):
    n = x.aval.shape[d]
    if k not in windowed:  # held whole: pad it into the full dim, keep this shard's block
      config = [(0, 0, 0)] * arg.ndim
      config[d] = (offset, block * shards - offset - n, 0)
      arg = lax.dynamic_slice_in_dim(lax.pad(arg, jnp.zeros((), arg.dtype), config),
                                     shard_index(axes) * block, block, d)
    out = jnp.where((rows >= offset) & (rows < offset + n), arg, out)
    offset += n
  return [out]


def select_and_scatter_add(local: Local, args: list) -> list:
  """Runs on the windows covering this shard's rows, then keeps its own rows."""
  op, p = local.op, local.op.params
  never_selected = "max" if op.params["select_prim"] in (lax.ge_p, lax.gt_p) else "min"
  args, halo_dims = local.with_halos(args, 0, identity(never_selected, args[1].dtype))
  if not halo_dims:
    return bind(op, args)
  padding = tuple((0, 0) if d in halo_dims else tuple(c) for d, c in enumerate(p["padding"]))
  (out,) = bind(op, args, padding=padding)
  for h in local.halos:
    if h.operand == 1:  # the span's rows, widened to reach rows no window touches: the block
      before, after = h.uncovered()
      if before or after:
        config = [(0, 0, 0)] * out.ndim
        config[h.dim] = (before, after, 0)
        out = lax.pad(out, jnp.zeros((), out.dtype), config)
      shard = shard_index(h.axes)
      out = lax.dynamic_slice_in_dim(out, h.block * shard - h.first(shard) + before, h.block,
                                     h.dim)
  return [out]


def reduce_window(combiner: str | None) -> Callable[[Local, list], list]:
  """reduce_window_sum/max/min (``combiner``), or the generic one (None: operands then their
  inits, whose padded dims are whole)."""

  def run(local: Local, args: list) -> list:
    p = local.op.params
    if combiner is None:
      pad_values = list(args[len(args) // 2:])
    else:
      pad_values = [identity(combiner, args[0].dtype)]
    args, halo_dims = local.with_halos(args, *pad_values)
    if not halo_dims:
      return bind(local.op, args)
    padding = tuple((0, 0) if d in halo_dims else tuple(c) for d, c in enumerate(p["padding"]))
    base = tuple(1 if d in halo_dims else b for d, b in enumerate(p["base_dilation"]))
    return bind(local.op, args, padding=padding, base_dilation=base)

  return run


def reduce_again(local: Local, args: list) -> list:
  """A reduction that combines its own partial results (the variadic ``reduce``, reduce_prod,
  reduce_xor, reduce_and / reduce_or of integers) along sharded reduced dims (padding masked
  with the init values, uneven.py): each shard is reduced, the per-shard results all-gathered
  and reduced again (a generic reduce whose results are written partial, all-reduced later by
  ``all_reduce_combiner``'s collective, only reduces its shard)."""
  if not local.partial_axes or local.writes[0].partial:
    return bind(local.op, args)
  partials = _gather_partials(local, bind(local.op, args))
  if "dimensions" in local.op.params:  # the variadic reduce: operands, then their init values
    return bind(local.op, partials + args[len(args) // 2:], dimensions=(0,))
  return bind(local.op, partials, axes=(0,))


def arg_reduce(local: Local, args: list) -> list:
  """argmax / argmin along a sharded dim (padding masked, uneven.py): each shard's best value
  and its global index are all-gathered; the result is the first index of the best value (of a
  NaN, as JAX's argmax takes NaN as the largest)."""
  if not local.partial_axes:
    return bind(local.op, args)
  x, (axis,) = args[0], local.op.params["axes"]
  (index,) = bind(local.op, args)
  value = jnp.squeeze(jnp.take_along_axis(x, jnp.expand_dims(index, axis), axis), axis)
  index = index + local.offset(local.reads[0], axis, x.shape[axis]).astype(index.dtype)
  values, indices = _gather_partials(local, [value, index])
  best = (jnp.min if local.op.primitive == "argmin" else jnp.max)(values, axis=0)
  first = (values == best) | (values != values)
  return [jnp.min(jnp.where(first, indices, jnp.iinfo(indices.dtype).max), axis=0)]


_COMBINE = {"sum": (jnp.add, jnp.sum), "prod": (jnp.multiply, jnp.prod),
            "max": (jnp.maximum, jnp.max), "min": (jnp.minimum, jnp.min),
            "logaddexp": (jnp.logaddexp, jax.nn.logsumexp)}


def cumulative(combiner: str) -> Callable[[Local, list], list]:
  """A scan combining with ``combiner`` along a sharded axis (padding masked, uneven.py): each
  shard scans its block, the shards' totals are all-gathered and each shard combines its block
  with the totals of the shards before it (after it, for a reverse scan)."""
  pair, reduce = _COMBINE[combiner]

  def run(local: Local, args: list) -> list:
    if not local.partial_axes:
      return bind(local.op, args)
    axis, reverse = local.op.params["axis"], local.op.params["reverse"]
    (scan,) = bind(local.op, args)
    total = lax.index_in_dim(scan, 0 if reverse else scan.shape[axis] - 1, axis, keepdims=False)
    (totals,) = _gather_partials(local, [total])
    shards = lax.broadcasted_iota(jnp.int32, totals.shape, 0)
    me = shard_index(local.partial_axes)
    before = (shards > me) if reverse else (shards < me)
    prefix = reduce(jnp.where(before, totals, identity(combiner, totals.dtype)), axis=0)
    return [pair(scan, jnp.expand_dims(prefix, axis)).astype(scan.dtype)]

  return run


def _gather_partials(local: Local, partials: list) -> list:
  """Each device's partial results stacked along a new leading dim over the sharded reduction
  factors' axes (the all-gather ``Execution.gather_bytes`` prices)."""
  axes = local.partial_axes
  name = axes if len(axes) > 1 else axes[0]
  return [lax.all_gather(p, name, axis=0) for p in partials]


def dynamic_slice(local: Local, args: list) -> list:
  return bind(local.op, args, slice_sizes=local.out_shape())


def dynamic_update_slice(local: Local, args: list) -> list:
  """Along a sharded dim the update covers in part, each local row takes the update's row that
  lands on it (the start clamped as XLA clamps it), and keeps its own where none does."""
  op = local.op
  x, update, *starts = args
  shape, covered = op.inputs[0].aval.shape, op.inputs[1].aval.shape
  split = [d for d, axes in enumerate(local.reads[0].dims) if axes and covered[d] != shape[d]]
  if not split:
    return bind(op, args)
  keep = jnp.zeros(x.shape, bool)
  for d in split:
    start = jnp.clip(starts[d], 0, shape[d] - covered[d])
    rows = lax.broadcasted_iota(start.dtype, (x.shape[d],), 0) - start
    rows = rows + local.offset(local.reads[0], d, x.shape[d]).astype(start.dtype)
    update = jnp.take(update, jnp.clip(rows, 0, covered[d] - 1), axis=d)
    keep = keep | lax.broadcast_in_dim((rows < 0) | (rows >= covered[d]), x.shape, (d,))
    starts[d] = jnp.zeros((), start.dtype)
  return [jnp.where(keep, x, lax.dynamic_update_slice(x, update, starts))]


def conv(local: Local, args: list) -> list:
  """A device holding a share of the groups runs that many (lhs features = groups x per-group)."""
  p, op = local.op.params, local.op
  dn = p["dimension_numbers"]
  lhs = local.shape(op.inputs[0], local.reads[0])
  args, halo_dims = local.with_halos(args, 0)
  spatial = dn.lhs_spec[2:]
  params = {"padding": tuple((0, 0) if d in halo_dims else tuple(c)
                             for d, c in zip(spatial, p["padding"])),
            "lhs_dilation": tuple(1 if d in halo_dims else b
                                  for d, b in zip(spatial, p["lhs_dilation"]))}
  if p["feature_group_count"] > 1:
    rhs = local.shape(op.inputs[1], local.reads[1])
    params["feature_group_count"] = lhs[dn.lhs_spec[1]] // rhs[dn.rhs_spec[1]]
  if p["batch_group_count"] > 1:
    params["batch_group_count"] = lhs[dn.lhs_spec[0]] // local.out_shape()[dn.out_spec[0]]
  return bind(op, args, **params)


def random_bits(local: Local, args: list) -> list:
  """Threefry bits are a function of (key, global position) where ``jax_threefry_partitionable``
  holds (JAX's default): each device computes its block. Others are drawn whole and sliced."""
  p, key = local.op.params, args[0]
  if key.ndim:  # a key array: each key's bits are whole (rules/random.py)
    return bind(local.op, args)
  global_shape = tuple(p["shape"])
  if (not local.writes[0].axes or not by_position(local.op)
      or math.prod(global_shape) >= 2 ** 32 or p["bit_width"] == 64):
    return _whole_then_slice(local, args)
  counts = _flat_positions(local, 0)
  k1, k2 = jax.random.key_data(key)
  bits1, bits2 = threefry2x32_p.bind(k1, k2, jnp.zeros_like(counts), counts)
  bits = bits1 ^ bits2
  dtype = {8: jnp.uint8, 16: jnp.uint16, 32: jnp.uint32}[p["bit_width"]]
  return [bits.astype(dtype)]


def random_gamma(local: Local, args: list) -> list:
  """JAX draws element i of a gamma's trailing dims (those past its key's) from split(key)[i],
  i its flat position among them: each device splits its keys whole and keeps its block's."""
  key, alpha = args
  lead, count = key.ndim, math.prod(local.op.outputs[0].shape[key.ndim:])
  keys = jax.vmap(lambda k: jax.random.key_data(jax.random.split(k, count)))(key.reshape(-1))
  positions = jnp.minimum(_flat_positions(local, lead), count - 1)  # padding reads the last
  data_shape = keys.shape[2:]  # one key's data
  keys = jnp.take_along_axis(
      keys, positions.reshape(keys.shape[0], -1, *(1 for _ in data_shape)), axis=1)
  keys = jax.random.wrap_key_data(keys.reshape(-1, *data_shape), impl=jax.random.key_impl(key))
  draw = functools.partial(gamma_one(), log_space=local.op.params["log_space"])
  if key_impl(local.op.inputs[0].aval) is threefry_prng_impl:
    samples = jax.vmap(draw)(keys, alpha.reshape(-1))
  else:  # mapped one key at a time, as JAX does: others' batched bits come from one key
    samples = jax.lax.map(lambda ka: draw(*ka), (keys, alpha.reshape(-1)))
  return [samples.reshape(alpha.shape)]


def random_poisson(local: Local, args: list) -> list:
  """JAX draws a key's variates from uniforms at their flat positions among lam's dims past the
  keys' (what its own lowering of a split result passes as ``counts``): each device draws its
  block's, or all of a key's where those dims are whole."""
  key, lam = args
  drawn = local.writes[0].dims[key.ndim:]
  counts = None
  if any(drawn):
    positions = _flat_positions(local, key.ndim)[(0,) * key.ndim]
    counts = (jnp.zeros_like(positions), positions)
  return [poisson_local()(key, lam, dtype=local.op.params["dtype"], counts=counts)]


def _flat_positions(local: Local, first: int) -> jax.Array:
  """uint32 positions of this device's block of output 0 in the flat global order of its dims
  from ``first`` on, per element of the block."""
  shape, global_shape = local.out_shape(), local.op.outputs[0].shape
  positions = jnp.zeros(shape, jnp.uint32)
  for d in range(first, len(shape)):
    idx = lax.broadcasted_iota(jnp.uint32, shape, d)
    if local.writes[0].dims[d]:
      idx = idx + local.offset(local.writes[0], d, shape[d]).astype(jnp.uint32)
    positions = positions + idx * jnp.uint32(math.prod(global_shape[d + 1:]))
  return positions


def _whole_then_slice(local: Local, args: list) -> list:
  """Computes the op with global shapes (its operands are whole) and keeps this device's block."""
  outs = bind(local.op, args)
  return [_block(o, w, local.mesh) for o, w in zip(outs, local.writes)]


def _block(x: jax.Array, s: TensorSharding, mesh: MeshShape) -> jax.Array:
  """This device's block of the whole ``x``: ``ceil(N/n)`` rows of an uneven dim, padded."""
  for d, (axes, size) in enumerate(zip(s.dims, s.local_shape(x.shape, mesh))):
    if axes:
      padding = [(0, 0)] * x.ndim
      padding[d] = (0, size * s.shards(d, mesh) - x.shape[d])
      x = lax.dynamic_slice_in_dim(jnp.pad(x, padding), shard_index(axes) * size, size, d)
  return x


def gather(local: Local, args: list) -> list:
  """Offset and batch dims run locally; an indexed operand dim that is sharded (a reduction
  factor) gathers only the rows this device owns, zero elsewhere: the caller sums. An indexed
  dim whose slice is the whole dim (its start is 0, clamped) runs locally as an offset dim."""
  p, op = local.op.params, local.op
  dn, mode = p["dimension_numbers"], p["mode"]
  operand, indices = args
  read = local.reads[0]
  local_operand_shape = local.shape(op.inputs[0], read)
  sizes = tuple(min(s, n) for s, n in zip(p["slice_sizes"], local_operand_shape))
  global_shape = op.inputs[0].aval.shape
  owned = [(j, d) for j, d in enumerate(dn.start_index_map)
           if read.dims[d] and p["slice_sizes"][d] < global_shape[d]]
  if not owned:
    return bind(op, args, slice_sizes=sizes)
  starts = [indices[..., j] for j in range(len(dn.start_index_map))]
  oob = jnp.zeros(indices.shape[:-1], bool)
  for j, d in enumerate(dn.start_index_map):
    limit = global_shape[d] - p["slice_sizes"][d]
    oob = oob | (starts[j] < 0) | (starts[j] > limit)
    starts[j] = jnp.clip(starts[j], 0, limit)
  mine = jnp.ones(indices.shape[:-1], bool)
  for j, d in owned:
    offset = local.offset(read, d, local_operand_shape[d])
    rel = starts[j] - offset.astype(starts[j].dtype)
    mine = mine & (rel >= 0) & (rel < local_operand_shape[d])
    starts[j] = jnp.clip(rel, 0, local_operand_shape[d] - 1)
  (out,) = bind(op, [operand, jnp.stack(starts, -1).astype(indices.dtype)], slice_sizes=sizes,
                mode=lax.GatherScatterMode.CLIP)
  expand = lambda m: lax.expand_dims(m, dn.offset_dims) if dn.offset_dims else m  # noqa: E731
  zero = jnp.zeros((), out.dtype)
  fill_mode = mode == lax.GatherScatterMode.FILL_OR_DROP
  keep = mine & ~oob if fill_mode else mine
  out = jnp.where(expand(keep), out, zero)
  if fill_mode:
    first = jnp.all(jnp.stack([shard_index(read.dims[d]) == 0 for _, d in owned]))
    out = out + jnp.where(expand(oob & first), _fill_value(p, out.dtype), zero)
  return [out]


def _fill_value(p: dict, dtype: Any) -> Any:
  if p.get("fill_value") is not None:
    return jnp.asarray(p["fill_value"], dtype)
  if jnp.issubdtype(dtype, jnp.inexact):
    return jnp.asarray(np.nan, dtype)
  if jnp.issubdtype(dtype, jnp.signedinteger):
    return jnp.asarray(jnp.iinfo(dtype).min, dtype)
  if jnp.issubdtype(dtype, jnp.unsignedinteger):
    return jnp.asarray(jnp.iinfo(dtype).max, dtype)
  return jnp.asarray(True, dtype)


def scatter(local: Local, args: list) -> list:
  """Each device applies the updates that land in the operand rows it owns (indices shifted,
  the rest dropped); when the updates themselves are split (scatter-add), only one device of
  each group keeps the operand, so the partial results sum to the answer (scatter-max and -min
  keep it on every device: their partial results combine by max or min)."""
  p, op = local.op.params, local.op
  dn, mode = p["dimension_numbers"], p["mode"]
  operand, indices, updates = args[:3]
  read = local.reads[0]
  global_shape = op.inputs[0].aval.shape
  local_shape = local.shape(op.inputs[0], read)
  windowed = [d for d in range(len(global_shape))
              if d not in (*dn.inserted_window_dims, *dn.operand_batching_dims)]
  window = {d: op.inputs[2].aval.shape[w] for d, w in zip(windowed, dn.update_window_dims)}
  owned = [(j, d) for j, d in enumerate(dn.scatter_dims_to_operand_dims)
           if read.dims[d] and window.get(d, 1) < global_shape[d]]
  if owned:
    starts = [indices[..., j] for j in range(indices.shape[-1])]
    for j, d in enumerate(dn.scatter_dims_to_operand_dims):
      size = window.get(d, 1)  # an update window's rows, clamped into the operand
      if mode != lax.GatherScatterMode.FILL_OR_DROP:
        starts[j] = jnp.clip(starts[j], 0, global_shape[d] - size)
    for j, d in owned:
      offset = local.offset(read, d, local_shape[d]).astype(starts[j].dtype)
      in_bounds = (starts[j] >= 0) & (starts[j] < global_shape[d])
      rel = starts[j] - offset
      starts[j] = jnp.where(in_bounds, rel, local_shape[d])  # out of range: dropped
    indices = jnp.stack(starts, -1).astype(indices.dtype)
    mode = lax.GatherScatterMode.FILL_OR_DROP
  if local.partial_axes and local.writes[0].partial_op == "sum":  # (max, min: on every one)
    operand = jnp.where(shard_index(local.partial_axes) == 0, operand, jnp.zeros_like(operand))
  return bind(op, [operand, indices, updates, *args[3:]], mode=mode)
