"""TensorSharding: which mesh axes split each dimension of one array (pure data, no tracing)."""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping, Sequence

from jax.sharding import PartitionSpec as P

Axes = tuple[str, ...]
MeshShape = Mapping[str, int]


def axes_size(axes: Sequence[str], mesh_shape: MeshShape) -> int:
  """Devices along ``axes``: the blocks a dim split over them has."""
  return math.prod(mesh_shape[a] for a in axes)


@dataclass(frozen=True)
class TensorSharding:
  """Mesh axes per dimension (major to minor) and pending partial-sum axes.

  ``dims[d] == ("data", "model")`` means dim ``d`` is split over ``data`` then, within each piece,
  over ``model``. ``partial`` names axes over which the per-device values still have to be
  combined with ``partial_op`` (``"sum"``, ``"max"`` or ``"min"``).
  """

  dims: tuple[Axes, ...]
  partial: Axes = ()
  partial_op: str = "sum"

  @classmethod
  def replicated(cls, rank: int) -> TensorSharding:
    return cls(((),) * rank)

  @classmethod
  def from_spec(cls, spec: P, rank: int, mesh_shape: MeshShape, *,
                what: str = "spec") -> TensorSharding:
    """Validates ``spec`` against the mesh and the array rank; ``what`` names it in errors.
    Mesh axes of size 1 are dropped: a dim they split is whole, and nothing moves over them."""
    if not isinstance(spec, P):
      raise TypeError(f"{what}: expected a jax.sharding.PartitionSpec or None, got {spec!r}")
    entries = tuple(spec)
    if len(entries) > rank:
      raise ValueError(
          f"{what}: {spec} has {len(entries)} entries but the array has rank {rank} (mesh "
          f"{mesh_text(mesh_shape)}): give one entry per dim at most")
    dims: list[Axes] = []
    seen: set[str] = set()
    for entry in entries + (None,) * (rank - len(entries)):
      axes = _entry_axes(entry, what, spec)
      for axis in axes:
        if axis not in mesh_shape:
          raise ValueError(
              f"{what}: {spec} names mesh axis {axis!r}, which is not in the mesh "
              f"(axes: {', '.join(mesh_shape)})")
        if axis in seen:
          raise ValueError(f"{what}: {spec} uses mesh axis {axis!r} more than once (mesh "
                           f"{mesh_text(mesh_shape)}): a mesh axis splits one dim at most")
        seen.add(axis)
      dims.append(tuple(a for a in axes if mesh_shape[a] > 1))  # one of size 1 splits nothing
    return cls(tuple(dims))

  @property
  def rank(self) -> int:
    return len(self.dims)

  @property
  def axes(self) -> Axes:
    """Every mesh axis that tiles a dimension, in dimension order."""
    return tuple(a for dim in self.dims for a in dim)

  def to_spec(self) -> P:
    return P(*(None if not d else d[0] if len(d) == 1 else d for d in self.dims))

  def shards(self, dim: int, mesh_shape: MeshShape) -> int:
    return axes_size(self.dims[dim], mesh_shape)

  def local_shape(self, shape: Sequence[int], mesh_shape: MeshShape) -> tuple[int, ...]:
    """Per-device shape; uneven dims round up (the last shards are padded)."""
    return tuple(-(-n // self.shards(d, mesh_shape)) for d, n in enumerate(shape))

  def divides(self, shape: Sequence[int], mesh_shape: MeshShape) -> bool:
    return all(n % self.shards(d, mesh_shape) == 0 for d, n in enumerate(shape))

  def with_dims(self, dims: Sequence[Axes]) -> TensorSharding:
    return TensorSharding(tuple(tuple(d) for d in dims), self.partial, self.partial_op)

  def __str__(self) -> str:
    text = "P(" + ", ".join(
        "None" if not d else repr(d[0]) if len(d) == 1 else "(" + ", ".join(map(repr, d)) + ")"
        for d in self.dims) + ")"
    if not self.partial:
      return text
    return text + f" partial-{self.partial_op}({', '.join(self.partial)})"


def without_reductions(spec: P) -> P:
  """``spec``'s per-dim entries alone. A type's ``unreduced`` axes (JAX 0.12: partial sums an
  op leaves for a later reshard to reduce) and ``reduced`` ones name no split: the value is the
  reduced one, and spmd reduces partial sums where its schedule puts them."""
  return P(*spec.partitions) if spec.unreduced or spec.reduced else spec


def mesh_text(mesh_shape: MeshShape) -> str:
  """``data=2, model=4``: a mesh as errors name it."""
  return ", ".join(f"{name}={size}" for name, size in mesh_shape.items())


def _entry_axes(entry: object, what: str, spec: P) -> Axes:
  if entry is None or entry is P.UNCONSTRAINED:
    return ()
  if isinstance(entry, str):
    return (entry,)
  if isinstance(entry, tuple) and all(isinstance(a, str) for a in entry):
    return entry
  raise TypeError(f"{what}: {spec} has entry {entry!r}; entries are None, a mesh axis name "
                  "or a tuple of names")
