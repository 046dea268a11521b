"""A user's ``jax.shard_map`` manual over only some mesh axes (``axis_names=``), as the global
computation it stands for.

Such a body sees its operands' blocks along the manual axes and whole arrays along the others,
which JAX partitions automatically inside it. spmd's program is manual over every axis, so it
cannot place that body as it is (manual.py places one manual over all axes). Instead the region
is inlined as what it computes: each operand's blocks along the manual axes stacked on leading
dims (one per manual axis, pinned to that axis), the body ``jax.vmap``-ed over them under those
axes' names, so that its collectives over them become ops on the leading dims (a ``psum`` a sum,
an ``all_gather`` a broadcast, ``axis_index`` an iota), and each result's leading dims put back
where its out_specs name them. spmd then partitions the body like any other code, over every
axis, the manual ones among them.
"""
from __future__ import annotations

import functools
import math
from typing import Any, Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax
from jax.extend import core as jcore
from jax.interpreters import batching
from jax.sharding import PartitionSpec as P

from spmd.partition.annotation import annotate
from spmd.partition import unchecked
from spmd.partition.jax_compat import check_vma, open_jaxpr
from spmd.partition.roll import roll_p

_NO_MESH = jax.sharding.AbstractMesh((), ())
DimAxes = tuple[tuple[str, ...], ...]  # per dim, the mesh axes splitting it, major first


def region_body(params: Mapping[str, Any], inputs: tuple) -> tuple[Any, tuple] | None:
  """The region's global computation as a jaxpr over ``inputs``; None for a region manual over
  every mesh axis (manual.py places it)."""
  mesh = params["mesh"]
  manual = [a for a in mesh.axis_names if a in params["newly_manual_axes"]]
  if len(manual) == len(mesh.axis_names):
    return None
  jaxpr = open_jaxpr(params["jaxpr"])[0]
  sizes = dict(mesh.shape)
  ins = [_dim_axes(s, len(x.aval.shape)) for s, x in zip(params["in_specs"], inputs)]
  outs = [_dim_axes(s, len(v.aval.shape)) for s, v in zip(params["out_specs"], jaxpr.outvars)]

  rewrites = {**_REWRITES, "ppermute": functools.partial(_ppermute, mesh.axis_names, sizes)}

  def body(*args: Any) -> list:
    with check_vma(False):
      return unchecked.evaluate(params["jaxpr"], args, rewrites)

  # Unchecked (check_vma=False), a result its out_specs leave whole along a manual axis may still
  # vary over it: JAX returns the first block's, so it is mapped and its first block taken.
  checked = params["check_vma"]

  def whole(*args: Any) -> list:
    stacked = [_stack(x, axes, manual, sizes) for x, axes in zip(args, ins)]
    mapped = outs if checked else [tuple((a,) for a in manual)] * len(outs)
    results = _vmapped(body, ins, mapped, manual, sizes)(*stacked)
    return [_unstack(y if checked else _first_blocks(y, axes, manual), axes, manual, sizes)
            for y, axes in zip(results, outs)]

  avals = [jax.ShapeDtypeStruct(x.aval.shape, x.aval.dtype) for x in inputs]
  with jax.sharding.use_abstract_mesh(_NO_MESH):  # the body's ops are typed by its own mesh
    return jax.make_jaxpr(whole)(*avals), inputs


def _dim_axes(spec: P, rank: int) -> DimAxes:
  entries = tuple(spec) + (None,) * (rank - len(spec))
  return tuple(() if e is None else (e,) if isinstance(e, str) else tuple(e) for e in entries)


def _mentions(axes: DimAxes, axis: str) -> bool:
  return any(axis in dim for dim in axes)


def _vmapped(body: Callable, ins: Sequence[DimAxes], outs: Sequence[DimAxes],
             manual: Sequence[str], sizes: Mapping[str, int]) -> Callable:
  """``body`` mapped over one leading dim per manual axis an operand (result) is split over,
  outermost first, each under its axis's name."""
  f = body
  for axis in reversed(manual):
    f = jax.vmap(f, in_axes=[0 if _mentions(a, axis) else None for a in ins],
                 out_axes=[0 if _mentions(a, axis) else None for a in outs],
                 axis_name=axis, spmd_axis_name=axis, axis_size=sizes[axis])
  return f


def _first_blocks(y: Any, axes: DimAxes, manual: Sequence[str]) -> Any:
  """``y``, mapped over every manual axis, with the first block taken along those ``axes`` do
  not split."""
  return y[tuple(slice(None) if _mentions(axes, a) else 0 for a in manual)]


def _stack(x: Any, axes: DimAxes, manual: Sequence[str], sizes: Mapping[str, int]) -> Any:
  """``x`` with its blocks along the manual axes on leading dims (in ``manual``'s order), each
  pinned to its axis; its other dims the blocks' own, open to propagation."""
  shape, where = [], {}
  for n, dim in zip(x.shape, axes):
    for a in dim:
      where[a] = len(shape)
      shape.append(sizes[a])
    shape.append(n // math.prod(sizes[a] for a in dim))
  lead = [where[a] for a in manual if a in where]
  stacked = jnp.transpose(x.reshape(shape), lead + [i for i in range(len(shape)) if i not in lead])
  return _pinned(stacked, [a for a in manual if a in where])


def _unstack(y: Any, axes: DimAxes, manual: Sequence[str], sizes: Mapping[str, int]) -> Any:
  """The inverse of ``_stack``: each leading dim put back before its dim's block."""
  present = [a for a in manual if _mentions(axes, a)]
  y = _pinned(y, present)
  block = y.shape[len(present):]
  order = [i for d, dim in enumerate(axes) for i in [*(present.index(a) for a in dim),
                                                      len(present) + d]]
  return jnp.transpose(y, order).reshape(
      [n * math.prod(sizes[a] for a in dim) for n, dim in zip(block, axes)])


def _pinned(x: Any, leading: Sequence[str]) -> Any:
  if not leading:
    return x
  return annotate(x, P(*leading, *[P.UNCONSTRAINED] * (x.ndim - len(leading))))


# A ppermute over one manual axis, bound as this so that vmap over that axis moves the stacked
# blocks along their dim by a roll (collective permutes) where JAX's own batching gathers them
# (and refuses a permutation that leaves some blocks without a source).
block_permute_p = jcore.Primitive("block_permute")
block_permute_p.def_abstract_eval(lambda x, *, axis_name, perm: x)


def _permute_blocks(axis_data: Any, args: Sequence[Any], dims: Sequence[int | None], *,
                    axis_name: tuple[str, ...], perm: tuple[tuple[int, int], ...]
                    ) -> tuple[Any, int | None]:
  """``block_permute`` under vmap: over another axis, bound again; over its own, the blocks on
  the mapped dim moved from source to destination by one roll per distance the pairs move
  (collective permutes; each destination takes its block from its pairs' roll); a destination
  no pair names gets zeros, as under ppermute."""
  (x,), (d,) = args, dims
  if axis_data.name not in axis_name:
    return block_permute_p.bind(x, axis_name=axis_name, perm=perm), d
  k = axis_data.size
  if d is None:
    if len(perm) == k:  # the same block everywhere, moved onto itself
      return x, None
    x, d = jnp.broadcast_to(x, (k, *x.shape)), 0
  destinations: dict[int, list[int]] = {}
  for src, dst in perm:
    destinations.setdefault((dst - src) % k, []).append(dst)
  moved = None
  for shift, dsts in destinations.items():
    rolled = roll_p.bind(x, shift=shift, axis=d) if shift else x
    moved = rolled if moved is None else jnp.where(_blocks(dsts, k, d, x.ndim), rolled, moved)
  if len(perm) < k:
    moved = jnp.where(_blocks([dst for _, dst in perm], k, d, x.ndim), moved,
                      jnp.zeros((), x.dtype))
  return moved, d


def _blocks(indices: Sequence[int], k: int, dim: int, rank: int) -> np.ndarray:
  """A mask true at ``indices`` along ``dim`` (of size ``k``), broadcasting along the others."""
  mask = np.zeros([k if i == dim else 1 for i in range(rank)], bool)
  mask.flat[list(indices)] = True
  return mask


batching.fancy_primitive_batchers[block_permute_p] = _permute_blocks


def _ppermute(mesh_axes: Sequence[str], sizes: Mapping[str, int], params: Mapping[str, Any],
              args: list, _: Any) -> list:
  """A ppermute over one manual axis as ``block_permute``. Over several (its devices numbered in
  mesh order, as JAX lowers it), the pairs grouped by how far they move along each axis: each
  group's blocks rolled along every axis (a ``block_permute`` rotating it) and kept at the
  group's destinations; a destination no pair names gets zeros."""
  (x,), axes, perm = args, tuple(params["axis_name"]), tuple(map(tuple, params["perm"]))
  if len(axes) == 1:
    return [block_permute_p.bind(x, axis_name=axes, perm=perm)]
  axes = tuple(a for a in mesh_axes if a in axes)
  shape = [sizes[a] for a in axes]
  here = sum(lax.axis_index(a) * math.prod(shape[k + 1:]) for k, a in enumerate(axes))
  moves: dict[tuple[int, ...], list[int]] = {}
  for src, dst in perm:
    at, to = np.unravel_index(src, shape), np.unravel_index(dst, shape)
    moves.setdefault(tuple(int(t - a) % n for a, t, n in zip(at, to, shape)), []).append(dst)
  out = jnp.zeros_like(x)
  for shifts, destinations in moves.items():
    moved = x
    for a, shift, n in zip(axes, shifts, shape):
      if shift:
        rotation = tuple((i, (i + shift) % n) for i in range(n))
        moved = block_permute_p.bind(moved, axis_name=(a,), perm=rotation)
    out = jnp.where(jnp.isin(here, np.array(destinations)), moved, out)
  return [out]


def _all_gather(params: Mapping[str, Any], args: list, _: Any) -> list:
  """An all_gather over several manual axes as one per axis, the minor one (as named) first,
  each tiled (JAX's batching of one over several axes refuses the mapped one)."""
  (x,), axes, dim = args, _names(params["axis_name"]), params["all_gather_dimension"]
  y = x if params["tiled"] else jnp.expand_dims(x, dim)
  for a in reversed(axes):
    y = lax.all_gather(y, a, axis=dim, tiled=True)
  return [y]


def _reduce_scatter(params: Mapping[str, Any], args: list, _: Any) -> list:
  """A psum_scatter over several manual axes as one per axis, the major one (as named) first,
  each tiled."""
  (x,), axes, dim = args, _names(params["axis_name"]), params["scatter_dimension"]
  for a in axes:
    x = lax.psum_scatter(x, a, scatter_dimension=dim, tiled=True)
  return [x if params["tiled"] else jnp.squeeze(x, dim)]


def _names(axis_name: Any) -> tuple[str, ...]:
  return (axis_name,) if isinstance(axis_name, str) else tuple(axis_name)


# The body evaluated unchecked (vmap batches only unchecked collectives), its collectives over
# several manual axes made one per axis (its ppermutes, which move the stacked blocks, are
# bound per region: they number devices by its mesh).
_REWRITES: unchecked.Rewrites = {**unchecked.REWRITES, "all_gather": _all_gather,
                                 "all_gather_invariant": _all_gather,
                                 "reduce_scatter": _reduce_scatter}


def positional_reduction(reduce: Callable[..., Any]) -> Callable:
  """The inline body of a psum/pmax/pmin over positional axes (what ``vmap`` makes of one over
  its named axis): the reduction ``reduce`` over those dims; None for one over mesh axes."""
  def body(params: Mapping[str, Any], inputs: tuple) -> tuple[Any, tuple] | None:
    axes = params["axes"]
    if not all(isinstance(a, int) for a in axes):
      return None
    avals = [jax.ShapeDtypeStruct(x.aval.shape, x.aval.dtype) for x in inputs]
    return jax.make_jaxpr(lambda *xs: [reduce(x, axis=axes) for x in xs])(*avals), inputs
  return body
