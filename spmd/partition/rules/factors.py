"""OpShardingRule: every tensor dim of an op named by factors (Shardy style), plus factor kinds."""
from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import Any, Sequence

from spmd.partition.halo_geometry import Window

DimFactors = tuple[int, ...]          # factor ids of one dim, major to minor; () = never sharded
TensorFactors = tuple[DimFactors, ...]


class FactorKind(enum.Enum):
  PASS = "pass"                          # same index space in operands and results
  REDUCTION = "reduction"                # summed away: sharded → partial sums (psum)
  NEED_REPLICATION = "need_replication"  # the op must see the whole factor (all-gather)
  PERMUTATION = "permutation"            # elements move along it (the op needs it whole)
  HALO = "halo"                          # a window slides along it: shards exchange halos


@dataclass(frozen=True)
class OpShardingRule:
  """Factors per dim of each operand and result; ``None`` marks a tensor that takes no part."""

  operands: tuple[TensorFactors | None, ...]
  results: tuple[TensorFactors | None, ...]
  sizes: tuple[int, ...]
  kinds: tuple[FactorKind, ...]
  pass_through: bool = False  # propagated first (elementwise-like ops), as Shardy's op priority
  # A broadcast_in_dim: its smaller operand donates to its result only at propagation's last
  # level, as Shardy's op priority propagates a broadcast backward only until then.
  broadcast: bool = False
  combiner: str = "sum"       # how partial results of sharded reduction factors combine
  linear_in: tuple[int, ...] = ()  # operands a pending partial sum may flow through (rules/linear)
  additive: bool = False      # True: all of linear_in jointly (add); False: any one (mul, dot)
  windows: tuple[WindowedDim, ...] = ()  # geometry of the HALO factors
  # An op that combines the partial results of its sharded reduction factors itself (a variadic
  # reduce, argmax, prod; a cumulative op's totals): the dtypes of the per-shard partial results
  # it all-gathers over those factors' axes (its first result's local shape without the
  # reduction factors' dims) and combines; its results are whole.
  gathers: tuple[Any, ...] = ()
  # The axes of a factor the op needs whole (or combines itself) may move to a pass factor instead
  # (an all-to-all before the op), as XLA sorts along a sharded dim; every tensor holding such a
  # factor holds every pass factor. Propagation gives the results Shardy's sharding, as jax.jit's
  # outputs (a sort's sorted dim keeps its axes: propagate._kept).
  relocatable: bool = False
  # An op cheap to run again on every device (a scatter, applying its updates): it may gather
  # its operands' sharded reduction factors whole where that moves less than summing its partial
  # results (an embedding's gradient: the token rows' updates, not the table).
  repeatable: bool = False
  # A loop carry's link: the tensors (by position) outside the loop, its init and result. Each is
  # resharded once whatever the carry is, so it ranks after the body's input and output, closed or
  # not (XLA keeps a carry as its body shards it), where every trip would reshard.
  outside: tuple[int, ...] = ()

  @property
  def num_factors(self) -> int:
    return len(self.sizes)

  def tensors(self) -> tuple[TensorFactors | None, ...]:
    return self.operands + self.results

  def whole_or_combined(self, f: int) -> bool:
    """Factor ``f`` is one whose axes a relocatable rule may move to a pass factor: one the op
    needs whole, or a reduction whose partial results it combines itself (``gathers``)."""
    kind = self.kinds[f]
    return kind is FactorKind.NEED_REPLICATION or (kind is FactorKind.REDUCTION
                                                   and bool(self.gathers))

  def result_factors(self) -> set[int]:
    return {f for t in self.results if t for dim in t for f in dim}



@dataclass(frozen=True)
class WindowedDim:
  """A HALO factor: dim ``dim`` of operand ``operand`` is read through ``window``."""

  factor: int
  operand: int
  dim: int
  window: Window
  mode: str = "window"  # "scatter": select_and_scatter_add; "reverse": rev; "rotate": roll;
  # "concatenate": a window of a concatenate's operand
  readable_whole: bool = False  # the op may instead read the dim whole (a concatenate's operand)


@dataclass
class RuleBuilder:
  """Creates factors and assembles the rule; factors of size 1 are dropped (never sharded)."""

  sizes: list[int] = field(default_factory=list)
  kinds: list[FactorKind] = field(default_factory=list)
  windows: list[WindowedDim] = field(default_factory=list)

  def factor(self, size: int, kind: FactorKind = FactorKind.PASS) -> int | None:
    if size == 1:
      return None
    self.sizes.append(int(size))
    self.kinds.append(kind)
    return len(self.sizes) - 1

  def windowed(self, operand: int, dim: int, window: Window, mode: str = "window",
               factor: int | None = None, readable_whole: bool = False) -> int | None:
    """A HALO factor shared by the operand dim and the result dim it slides along (``factor``:
    another operand's window over an existing one; ``readable_whole``: see WindowedDim)."""
    f = factor if factor is not None else self.factor(
        window.out if mode == "window" else window.size, FactorKind.HALO)
    if f is not None and (window.size > 1 or window.out > 1):  # one row padded to many too
      self.windows.append(WindowedDim(f, operand, dim, window, mode, readable_whole))
    return f

  def factors(self, sizes: Sequence[int], kind: FactorKind = FactorKind.PASS) -> list[int | None]:
    return [self.factor(n, kind) for n in sizes]

  def build(self, operands: Sequence[Sequence[object] | None],
            results: Sequence[Sequence[object] | None], pass_through: bool = False,
            combiner: str = "sum", gathers: tuple[Any, ...] = (),
            relocatable: bool = False, broadcast: bool = False, outside: tuple[int, ...] = (),
            repeatable: bool = False) -> OpShardingRule:
    return OpShardingRule(tuple(_tensor(t) for t in operands), tuple(_tensor(t) for t in results),
                          tuple(self.sizes), tuple(self.kinds), pass_through, broadcast,
                          combiner, windows=tuple(self.windows), gathers=gathers,
                          relocatable=relocatable, repeatable=repeatable, outside=outside)


def _tensor(dims: Sequence[object] | None) -> TensorFactors | None:
  """Each dim is a factor id, None (replicated), or a sequence of ids (a merged dim)."""
  if dims is None:
    return None
  out = []
  for d in dims:
    if d is None:
      out.append(())
    elif isinstance(d, int):
      out.append((d,))
    else:
      out.append(tuple(f for f in d if f is not None))
  return tuple(out)
