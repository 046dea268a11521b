"""Where this device sits along a sharded dim, and moving blocks between devices."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from spmd.partition.sharding import Axes, MeshShape


def shard_index(axes: Axes) -> jax.Array:
  """This device's block along a dim split over ``axes`` (major to minor)."""
  if not axes:
    return jnp.int32(0)
  return lax.axis_index(axes if len(axes) > 1 else axes[0])


def permute(x: jax.Array, axes: Axes, pairs: list[tuple[int, int]], mesh: MeshShape) -> jax.Array:
  """ppermute with (source, target) block indices linearized in ``axes`` order, as
  ``shard_index`` counts (lax.ppermute itself counts devices in mesh order)."""
  ordered, perm = mesh_pairs(axes, pairs, mesh)
  return lax.ppermute(x, ordered if len(ordered) > 1 else ordered[0], perm)


def mesh_pairs(axes: Axes, pairs: list[tuple[int, int]], mesh: MeshShape
               ) -> tuple[Axes, list[tuple[int, int]]]:
  """``axes`` in mesh order, and ``pairs`` of block indices in ``axes`` order as device indices
  along them (what lax.ppermute takes)."""
  ordered = tuple(a for a in mesh if a in axes)
  sizes = [mesh[a] for a in axes]

  def to_mesh(k: int) -> int:
    coords = dict(zip(axes, np.unravel_index(k, sizes)))
    return int(np.ravel_multi_index([coords[a] for a in ordered], [mesh[a] for a in ordered]))

  return ordered, [(to_mesh(i), to_mesh(j)) for i, j in pairs]
