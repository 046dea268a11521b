"""Device meshes for spmd: named axes with Auto axis types, on real or simulated devices."""
from __future__ import annotations

import math
from typing import Mapping, Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh


def make_mesh(axes: Mapping[str, int], devices: Sequence[jax.Device] | None = None) -> Mesh:
  """A ``jax.sharding.Mesh`` with ``axes`` (name → size, major to minor) and Auto axis types.

  ``devices`` defaults to the first ``prod(sizes)`` of ``jax.devices()``. For simulated CPU
  devices set ``XLA_FLAGS=--xla_force_host_platform_device_count=N`` before importing JAX.
  """
  if not isinstance(axes, Mapping) or not axes:
    raise TypeError(f"make_mesh: axes must be a non-empty mapping of name to size, got {axes!r}")
  for name, size in axes.items():
    if not isinstance(name, str) or not isinstance(size, int) or size < 1:
      raise ValueError(f"make_mesh: axis {name!r} must be a string with a positive int size, "
                       f"got {size!r}")
  count = math.prod(axes.values())
  pool = list(jax.devices() if devices is None else devices)
  if len(pool) < count:
    raise ValueError(f"make_mesh: {dict(axes)} needs {count} devices, only {len(pool)} available "
                     "(simulate CPU devices with XLA_FLAGS=--xla_force_host_platform_device_count"
                     f"={count})")
  if devices is not None and len(pool) != count:
    raise ValueError(f"make_mesh: {dict(axes)} needs exactly {count} devices, got {len(pool)}")
  grid = np.array(pool[:count], dtype=object).reshape(tuple(axes.values()))
  return Mesh(grid, tuple(axes), axis_types=(AxisType.Auto,) * len(axes))


def with_auto_axes(mesh: Mesh) -> Mesh:
  """``mesh`` with every axis Auto (``jax.make_mesh`` makes Explicit axes by default): spmd's
  program places every array itself, so JAX's sharding-in-types must not check it."""
  if all(t == AxisType.Auto for t in mesh.axis_types):
    return mesh
  return Mesh(mesh.devices, mesh.axis_names, axis_types=(AxisType.Auto,) * len(mesh.axis_names))


def mesh_shape(mesh: Mesh) -> dict[str, int]:
  return dict(mesh.shape)
