"""scan / while / cond: their bodies are regions; *links* tie outer operands and results to the
region's inputs and outputs (carries to a fixed point), each link an ordinary factor rule; and
how each runs partitioned: the same control flow over region bodies replayed on local shards."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol, Sequence

from jax import lax

from spmd.partition.ir import Atom, Op, Region, Value
from spmd.partition.jax_compat import scan_layout
from spmd.partition.rules.factors import FactorKind, OpShardingRule, RuleBuilder


@dataclass(frozen=True)
class Link:
  """One rule over outer and region tensors; planned like an op whose operands flow to results."""

  rule: OpShardingRule
  operands: tuple[Atom, ...]
  results: tuple[Atom, ...]


def identity(operands: Sequence[Atom], results: Sequence[Atom], outside: tuple[int, ...] = ()
             ) -> Link:
  """All tensors share one factor per dim (literals take no part); ``outside``: a carry's
  tensors outside its loop (OpShardingRule.outside)."""
  shape = next((x.shape for x in (*operands, *results) if isinstance(x, Value)), ())
  b = RuleBuilder()
  dims = b.factors(shape)

  def of(x: Atom) -> list | None:
    return list(dims) if isinstance(x, Value) else None

  return Link(b.build([of(x) for x in operands], [of(x) for x in results], pass_through=True,
                      outside=outside), tuple(operands), tuple(results))


@dataclass(frozen=True)
class Invariant:
  """A loop body's input that holds the same value on every trip (one of the loop's consts),
  and the op's operand it is: the body reads the operand itself (ir.py)."""

  region: int
  input: int
  operand: int


def scan_invariants(op: Op) -> list[Invariant]:
  return [Invariant(0, k, k) for k in range(scan_layout(op.params).num_consts)]


def while_invariants(op: Op) -> list[Invariant]:
  """The body's consts; the condition's stay inside (XLA hoists only out of the body)."""
  cn, bn = op.params["cond_nconsts"], op.params["body_nconsts"]
  return [Invariant(1, k, cn + k) for k in range(bn)]


def cond_invariants(op: Op) -> list[Invariant]:
  """None: a branch runs at most once, and a reshard moved before the cond would run for the
  branches not taken too."""
  return []


def scan(op: Op) -> list[Link]:
  layout = scan_layout(op.params)
  nc, nk = layout.num_consts, layout.num_carry
  length = op.params["length"]
  body = op.regions[0]
  consts, init, xs = op.inputs[:nc], op.inputs[nc:nc + nk], op.inputs[nc + nk:]
  links = [identity([c], [v]) for c, v in zip(consts, body.inputs[:nc])]
  for j in range(nk):  # the body's output ranks before the init
    links.append(identity([body.outputs[j], init[j]], [body.inputs[nc + j], op.outputs[j]],
                          outside=(1, 3)))  # the init and the loop's result
  for x, v in zip(xs, body.inputs[nc + nk:]):
    links.append(_stacked([x], [v], length, outer_side="operands"))
  for y, r in zip(body.outputs[nk:], op.outputs[nk:]):
    links.append(_stacked([y], [r], length, outer_side="results"))
  return links


def while_(op: Op) -> list[Link]:
  """A loop of one predicate (catalog.one_predicate_loop rewrites one per element)."""
  cn, bn = op.params["cond_nconsts"], op.params["body_nconsts"]
  cond, body = op.regions
  links = [identity([c], [v]) for c, v in zip(op.inputs[:cn], cond.inputs[:cn])]
  links += [identity([c], [v]) for c, v in zip(op.inputs[cn:cn + bn], body.inputs[:bn])]
  for j, init in enumerate(op.inputs[cn + bn:]):
    links.append(identity([body.outputs[j], init],
                          [body.inputs[bn + j], cond.inputs[cn + j], op.outputs[j]],
                          outside=(1, 4)))  # the init and the loop's result
  return links


def cond(op: Op) -> list[Link]:
  branches = op.regions
  links = [identity([x], [br.inputs[k] for br in branches]) for k, x in enumerate(op.inputs[1:])]
  links += [identity([br.outputs[j] for br in branches], [r]) for j, r in enumerate(op.outputs)]
  return links


def _stacked(operands: Sequence[Atom], results: Sequence[Atom], length: int,
             outer_side: str) -> Link:
  """A scanned input (outer ``[L, ...]`` → per-iteration ``[...]``) or stacked output."""
  inner = operands[0] if outer_side == "results" else results[0]
  b = RuleBuilder()
  shared = b.factors(inner.shape) if isinstance(inner, Value) else []
  lead = b.factor(length, FactorKind.NEED_REPLICATION)

  def dims(x: Atom, side: str) -> list | None:
    if not isinstance(x, Value):
      return None
    return [lead] + shared if side == outer_side else list(shared)

  return Link(b.build([dims(x, "operands") for x in operands],
                      [dims(x, "results") for x in results], pass_through=True),
              tuple(operands), tuple(results))


class Interpreter(Protocol):
  """What lowering a control-flow op needs of the partitioned program's interpreter (lower.py)."""

  def region(self, schedule: Any, region: Region, args: Sequence[Any]) -> list: ...


def lower_scan(it: Interpreter, s: Any, args: list) -> list:
  op, p = s.op, s.op.params
  layout = scan_layout(p)
  nc, nk = layout.num_consts, layout.num_carry
  consts, init, xs = args[:nc], args[nc:nc + nk], args[nc + nk:]

  def body(carry, x):
    outs = it.region(s.regions[0], op.regions[0], [*consts, *carry, *x])
    return outs[:nk], outs[nk:]

  carry, ys = lax.scan(body, list(init), list(xs), length=p["length"], reverse=p["reverse"],
                       unroll=p["unroll"])
  return [*carry, *ys]


def scan_copies(p: dict) -> tuple[int, ...]:
  """The runs per scan of each copy of its body in the lowered program, as JAX lowers it
  (lax's ``_scan_impl``): a loop of ``length // unroll`` trips over ``unroll`` copies, then one
  copy per remaining step; fully unrolled (one trip and no remainder, or unroll 0) where that
  loop would run once."""
  length, unroll = p["length"], p["unroll"]
  if unroll == 1:
    return (length,)
  trips, rest = divmod(length, unroll) if unroll else (0, length)
  if trips == 1 and not rest:
    trips, rest = 0, length
  return (trips,) * (unroll if trips else 0) + (1,) * rest


def lower_while(it: Interpreter, s: Any, args: list) -> list:
  op, p = s.op, s.op.params
  cn, bn = p["cond_nconsts"], p["body_nconsts"]
  cond_consts, body_consts, init = args[:cn], args[cn:cn + bn], args[cn + bn:]

  def pred(carry):
    return it.region(s.regions[0], op.regions[0], [*cond_consts, *carry])[0]

  def body(carry):
    return it.region(s.regions[1], op.regions[1], [*body_consts, *carry])

  return list(lax.while_loop(pred, body, list(init)))


def lower_cond(it: Interpreter, s: Any, args: list) -> list:
  branches = [lambda *a, r=r, region=region: it.region(r, region, a)
              for r, region in zip(s.regions, s.op.regions)]
  return list(lax.switch(args[0], branches, *args[1:]))
