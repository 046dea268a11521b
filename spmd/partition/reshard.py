"""Sharding A → sharding B as a list of steps: the only place that picks collectives.

Order (cheapest first, as XLA prefers): pending partial sums are reduced (reduce-scatter where
the target shards that axis, else all-reduce); dims whose axes only change order are permuted;
axes free everywhere are sliced locally (no communication) so later collectives move less;
an axis that moves from one dim to another is an all-to-all; axes to drop are all-gathered;
finally the remaining axes are sliced locally.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

from spmd.partition.sharding import Axes, MeshShape, TensorSharding

COLLECTIVE_KINDS = ("all-reduce", "reduce-scatter", "all-gather", "all-to-all",
                    "collective-permute")


@dataclass(frozen=True)
class ReshardStep:
  """One step; ``dim``/``dst_dim`` say which dims it acts on; ``bytes`` is per device: the larger
  of its input and output buffers (0 for a local dynamic-slice)."""

  kind: str                    # a COLLECTIVE_KINDS entry or "dynamic-slice"
  axes: Axes
  before: TensorSharding
  after: TensorSharding
  bytes: int
  dim: int | None = None
  dst_dim: int | None = None

  @property
  def communicates(self) -> bool:
    return self.kind in COLLECTIVE_KINDS


def local_bytes(sharding: TensorSharding, shape: Sequence[int], itemsize: int,
                mesh: MeshShape) -> int:
  return math.prod(sharding.local_shape(shape, mesh)) * itemsize


def plan_reshard(src: TensorSharding, dst: TensorSharding, shape: Sequence[int], itemsize: int,
                 mesh: MeshShape) -> tuple[ReshardStep, ...]:
  steps: list[ReshardStep] = []
  dims = [list(d) for d in src.dims]
  partial = [a for a in src.partial if a not in dst.partial]
  target = [list(d) for d in dst.dims]

  def cur() -> TensorSharding:
    left = tuple(a for a in src.partial if a in partial or a in dst.partial)
    return TensorSharding(tuple(tuple(d) for d in dims), left, src.partial_op if left else "sum")

  def nbytes(s: TensorSharding) -> int:
    return local_bytes(s, shape, itemsize, mesh)

  def emit(kind: str, axes: Sequence[str], change, dim=None, dst_dim=None) -> None:
    before = cur()
    change()
    after = cur()
    moved = 0 if kind == "dynamic-slice" else max(nbytes(before), nbytes(after))
    steps.append(ReshardStep(kind, tuple(axes), before, after, moved, dim, dst_dim))

  # 1. Partial sums: reduce-scatter into the dim that wants the axis next, else all-reduce.
  for a in list(partial) if src.partial_op == "sum" else ():
    for d, want in enumerate(target):
      if len(want) > len(dims[d]) and want[:len(dims[d])] == dims[d] and want[len(dims[d])] == a:
        emit("reduce-scatter", [a], lambda a=a, d=d: (partial.remove(a), dims[d].append(a)), d)
        break
  if partial:
    emit("all-reduce", list(partial), partial.clear)

  # 2. Same axes in another order: a collective-permute.
  for d, want in enumerate(target):
    if dims[d] != want and sorted(dims[d]) == sorted(want):
      emit("collective-permute", want, lambda d=d, want=want: dims[d].__setitem__(
          slice(None), list(want)), d)

  def used() -> set[str]:
    return {a for d in dims for a in d}

  def slice_free() -> None:
    for d, want in enumerate(target):
      while (len(want) > len(dims[d]) and want[:len(dims[d])] == dims[d]
             and want[len(dims[d])] not in used()):
        a = want[len(dims[d])]
        emit("dynamic-slice", [a], lambda d=d, a=a: dims[d].append(a), d)

  # 3. Local slices first, so that collectives move less.
  slice_free()
  # 4. All-to-all: the minor axis of dim i is wanted next on dim j.
  moved = True
  while moved:
    moved = False
    for i in range(len(dims)):
      if not dims[i] or target[i][:len(dims[i])] == dims[i]:
        continue
      a = dims[i][-1]
      for j, want in enumerate(target):
        if j != i and len(want) > len(dims[j]) and want[:len(dims[j])] == dims[j] \
            and want[len(dims[j])] == a:
          emit("all-to-all", [a], lambda i=i, j=j, a=a: (dims[i].pop(), dims[j].append(a)), i, j)
          moved = True
          break
  # 5. All-gather the axes a dim must lose (minor first, one collective per dim).
  for d, want in enumerate(target):
    keep = 0
    while keep < len(dims[d]) and keep < len(want) and dims[d][keep] == want[keep]:
      keep += 1
    if keep < len(dims[d]):
      lost = dims[d][keep:]
      emit("all-gather", lost, lambda d=d, keep=keep: dims[d].__delitem__(slice(keep, None)), d)
  # 6. What is left is more tiling: local slices.
  slice_free()
  return tuple(steps)
