"""Sharding A → sharding B as a list of steps: the only place that picks collectives.

Order (cheapest first, as XLA prefers): pending partial sums are reduced (reduce-scatter where
the target shards that axis, else all-reduce); dims whose axes only change order are permuted;
axes free everywhere are sliced locally (no communication) so later collectives move less;
an axis that moves from one dim to another is an all-to-all (made the minor axis of its dim
first by a collective-permute); axes to drop are all-gathered;
finally the remaining axes are sliced locally.

Uneven dims (size N not divisible by the shard count n) are held padded: shard k has rows
[k*S, (k+1)*S), S = ceil(N/n), rows past N are padding. A step that regroups shards is only
taken where the blocks nest exactly (k*S(n) == S(n/k)); otherwise the dim is gathered whole
(padding dropped) and sliced again in one step (padded to n*S first).
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


def _shard(n: int, count: int) -> int:
  return -(-n // count)


def splits_exactly(n: int, count: int, k: int) -> bool:
  """Can each of ``count`` blocks of a size-``n`` dim be cut into ``k`` blocks of the finer
  sharding? Always from whole (padding goes at the end)."""
  return count == 1 or _shard(n, count) == k * _shard(n, count * k)


def gathers_exactly(n: int, count: int, k: int) -> bool:
  """Do ``k`` neighbouring blocks of ``count`` concatenate to a block of the coarser sharding?
  Always to whole (the padding is sliced off)."""
  return count == k or k * _shard(n, count) == _shard(n, count // k)


def plan_reshard(src: TensorSharding, dst: TensorSharding, shape: Sequence[int], itemsize: int,
                 mesh: MeshShape) -> tuple[ReshardStep, ...]:
  steps: list[ReshardStep] = []
  dims = [list(d) for d in src.dims]
  partial = [a for a in src.partial if a not in dst.partial]
  target = [list(d) for d in dst.dims]

  def count(axes: Sequence[str]) -> int:
    return math.prod(mesh[a] for a in axes)

  def cur() -> TensorSharding:
    left = tuple(a for a in src.partial if a in partial or a in dst.partial)
    return TensorSharding(tuple(tuple(d) for d in dims), left, src.partial_op if left else "sum")

  def emit(kind: str, axes: Sequence[str], change, dim=None, dst_dim=None) -> None:
    before = cur()
    change()
    after = cur()
    moved = 0 if kind == "dynamic-slice" else _buffer_bytes(kind, count(axes), before, after,
                                                           dim, dst_dim, shape, itemsize, mesh)
    steps.append(ReshardStep(kind, tuple(axes), before, after, moved, dim, dst_dim))

  def wants_next(d: int, a: str) -> bool:
    want = target[d]
    return len(want) > len(dims[d]) and want[:len(dims[d])] == dims[d] and want[len(dims[d])] == a

  # 1. Partial sums: reduce-scatter into the dim that wants the axis next (one collective for a
  # run of axes that dim wants in turn), else all-reduce.
  for a in list(partial) if src.partial_op == "sum" else ():
    for d in range(len(dims)):
      run = _scatter_run(a, partial, dims[d], target[d])
      if run and splits_exactly(shape[d], count(dims[d]), count(run)):
        emit("reduce-scatter", run, lambda run=run, d=d: (
            [partial.remove(b) for b in run], dims[d].extend(run)), d)
        break
  if partial:
    emit("all-reduce", list(partial), partial.clear)

  # 2. Same axes in another order: a collective-permute.
  for d, want in enumerate(target):
    if dims[d] != want and sorted(dims[d]) == sorted(want):
      emit("collective-permute", want, lambda d=d, want=want: dims[d].__setitem__(
          slice(None), list(want)), d)

  # Uneven dims whose blocks do not nest between source and target are gathered whole first.
  for d, want in enumerate(target):
    have = dims[d]
    if have and want != have and not _nests(shape[d], have, want, mesh):
      emit("all-gather", list(have), lambda d=d: dims[d].clear(), d)

  def used() -> set[str]:
    return {a for d in dims for a in d}

  def slice_free() -> None:
    for d, want in enumerate(target):
      added: list[str] = []
      while (len(want) > len(dims[d]) + len(added)
             and want[:len(dims[d])] == dims[d] and want[len(dims[d]) + len(added)] not in used()
             and want[len(dims[d]) + len(added)] not in added):
        added.append(want[len(dims[d]) + len(added)])
      if added and splits_exactly(shape[d], count(dims[d]), count(added)):
        emit("dynamic-slice", added, lambda d=d, added=added: dims[d].extend(added), d)

  # 3. Local slices first, so that collectives move less.
  slice_free()
  def movable(i: int, a: str) -> int | None:
    """The dim that wants axis ``a`` of dim ``i`` next, if an all-to-all can move it there."""
    for j in range(len(dims)):
      if (j != i and wants_next(j, a) and gathers_exactly(shape[i], count(dims[i]), mesh[a])
          and splits_exactly(shape[j], count(dims[j]), mesh[a])):
        return j
    return None

  # 4. All-to-all: the minor axis of dim i is wanted next on dim j. An axis wanted elsewhere
  # from a more major position of an even dim whose other axes stay is made minor first by a
  # collective-permute (whole blocks change places), as XLA does, rather than gathered.
  moved = True
  while moved:
    moved = False
    for i in range(len(dims)):
      if not dims[i] or target[i][:len(dims[i])] == dims[i]:
        continue
      for a in dims[i][-2::-1] if shape[i] % count(dims[i]) == 0 else ():
        rest = [b for b in dims[i] if b != a]
        if target[i][:len(rest)] == rest and movable(i, a) is not None:
          order = rest + [a]
          emit("collective-permute", order,
               lambda i=i, order=order: dims[i].__setitem__(slice(None), order), i)
          break
      a = dims[i][-1]
      j = movable(i, a)
      if j is not None:
        emit("all-to-all", [a], lambda i=i, j=j, a=a: (dims[i].pop(), dims[j].append(a)), i, j)
        moved = True
  # 5. All-gather the axes a dim must lose (minor first, one collective per dim).
  for d, want in enumerate(target):
    keep = 0
    while keep < len(dims[d]) and keep < len(want) and dims[d][keep] == want[keep]:
      keep += 1
    if keep < len(dims[d]):
      lost = dims[d][keep:]
      if not gathers_exactly(shape[d], count(dims[d]), count(lost)):
        keep, lost = 0, list(dims[d])
      emit("all-gather", lost, lambda d=d, keep=keep: dims[d].__delitem__(slice(keep, None)), d)
  # 6. What is left is more tiling: local slices.
  slice_free()
  # 7. Uneven dims whose remaining axes cannot be cut from their blocks: whole, then sliced.
  for d, want in enumerate(target):
    if dims[d] != want:
      if dims[d]:
        emit("all-gather", list(dims[d]), lambda d=d: dims[d].clear(), d)
      emit("dynamic-slice", list(want), lambda d=d, want=want: dims[d].extend(want), d)
  if cur() != dst:
    raise AssertionError(f"reshard {src} -> {dst} of {tuple(shape)} stopped at {cur()}")
  return tuple(steps)


def _scatter_run(first: str, partial: Sequence[str], have: Sequence[str],
                 want: Sequence[str]) -> list[str]:
  """The partial axes, from ``first`` on, that a dim sharded by ``have`` wants next, in order."""
  if first not in partial or len(want) <= len(have) or list(want[:len(have)]) != list(have):
    return []
  run: list[str] = []
  for b in want[len(have):]:
    if b not in partial or (not run and b != first):
      break
    run.append(b)
  return run


def _buffer_bytes(kind: str, k: int, before: TensorSharding, after: TensorSharding, dim: int | None,
                  dst_dim: int | None, shape: Sequence[int], itemsize: int, mesh: MeshShape) -> int:
  """The larger of a collective's per-device input and output buffers, padding included: an
  uneven dim is gathered as k padded blocks and split from a padded whole."""
  src = list(before.local_shape(shape, mesh))
  out = list(after.local_shape(shape, mesh))
  if kind == "all-gather":
    out[dim] = k * src[dim]
  elif kind == "reduce-scatter":
    src[dim] = k * out[dim]
  elif kind == "all-to-all":
    src[dst_dim] = k * out[dst_dim]
    out[dim] = k * src[dim]
  return max(math.prod(src), math.prod(out)) * itemsize


def _nests(n: int, have: Sequence[str], want: Sequence[str], mesh: MeshShape) -> bool:
  """Even dims always regroup exactly; uneven ones only along a shared prefix of axes."""
  counts = [math.prod(mesh[a] for a in axes) for axes in (have, want)]
  if all(n % c == 0 for c in counts):
    return True
  common = 0
  while common < min(len(have), len(want)) and have[common] == want[common]:
    common += 1
  base = math.prod(mesh[a] for a in have[:common])
  return (gathers_exactly(n, counts[0], counts[0] // base)
          and splits_exactly(n, base, counts[1] // base))
