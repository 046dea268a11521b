"""What spmd knows about a primitive: one record per family, keyed by the primitive object.

A record says how the primitive is sharded (its factor rule), where a pending partial sum may flow
through it (its linearity), how it runs on a device's shards (its local lowering), and, for control
flow, where its regions are, how they link to the op and how the op runs partitioned. Every record
is registered in one table, ``catalog.py``; this module only defines the records and looks them up.
"""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Mapping

import jax.numpy as jnp
from jax.extend import core as jcore
from jax.extend.core import Primitive

from spmd.partition.atoms import Value
from spmd.partition.rules.factors import OpShardingRule, RuleBuilder

if TYPE_CHECKING:
  from spmd.partition.ir import Op

RuleFn = Callable[["Op"], OpShardingRule]
LocalFn = Callable[[Any, list], list]  # (Local, local operands) -> local results


@dataclass(frozen=True)
class Linearity:
  """Operands a pending partial sum may flow through, so the psum can wait.

  ``additive``: f(a1 + a2, b1 + b2) = f(a1, b1) + f(a2, b2) over the listed operands jointly (they
  must all be partial over the same axes); otherwise f is linear in each listed operand on its own
  (only one may be partial). ``operands=None`` lists every operand. ``widening_float_only``: only
  when every tensor is a float and the result is no narrower (rounding each partial sum before
  adding them would round several times where the program rounds once).
  """

  operands: tuple[int, ...] | None = ()
  additive: bool = False
  widening_float_only: bool = False


NONLINEAR = Linearity()
ADDITIVE_IN_FIRST = Linearity((0,), additive=True)


@dataclass(frozen=True)
class ControlFlow:
  """A primitive with regions (scan, while, cond)."""

  bodies: tuple[str, ...]                    # params holding the region jaxprs, in region order
  links: Callable[["Op"], list]              # -> rules.control.Link per tied group of tensors
  lower: Callable[[Any, Any, list], list]    # (interpreter, scheduled op, operands) -> results
  # how often each copy of the regions in the lowered program runs per op (None: unknown)
  trips: Callable[[dict], tuple[int | None, ...]]
  invariants: Callable[["Op"], list]         # -> rules.control.Invariant per loop-invariant input


@dataclass(frozen=True)
class Manual:
  """A user's manual region (``jax.shard_map``, manual.py): ``specs`` (its params) are the
  in_specs its operands are resharded to and the out_specs its results are written in (a region
  manual over every mesh axis: the record's ``inline`` expands one over only some);
  ``shardings`` (op, mesh) are those specs as each operand is read (None: a literal) and each
  result written; ``collectives`` (op, wire) are its body's own; ``whole`` (op, operands) binds
  it on whole arrays (backend="xla")."""

  specs: Callable[[Mapping[str, Any]], tuple[tuple[Any, ...], tuple[Any, ...]]]
  shardings: Callable[["Op", Any], tuple[tuple, tuple]]
  collectives: Callable[["Op", Any], tuple]
  whole: Callable[["Op", list], list]


# (equation params, operands) -> (the closed jaxpr the equation evaluates, its operands), or None
# where the params hold no body (releases name them differently)
Inline = Callable[[Mapping[str, Any], tuple], "tuple[Any, tuple] | None"]


@dataclass(frozen=True)
class PrimitiveInfo:
  """Everything spmd knows about one primitive."""

  rule: RuleFn | None = None          # None: runs replicated (see ``reason``)
  linear: Linearity = NONLINEAR
  local: LocalFn | None = None        # None: re-bind on the local operands
  control: ControlFlow | None = None
  inline: Inline | None = None        # a call: the body inlined into the program, and its inputs
  annotation: Callable[["Op"], Any] | None = None  # an identity asking for a sharding
  reason: str = ""                    # why a primitive without a rule runs replicated
  manual: Manual | None = None        # a user's shard_map: pinned to its specs, its body run as is
  stateful: bool = False              # each application draws new values: never merged (cse_key)


@functools.cache
def registry() -> Mapping[Primitive, PrimitiveInfo]:
  from spmd.partition.catalog import build_registry  # the table imports every family
  return build_registry()


def describe(primitive: Primitive) -> PrimitiveInfo | None:
  """The record of ``primitive``, or None if spmd has never heard of it."""
  return registry().get(primitive)


# An op's params naming its result's sharding (under an Explicit mesh, or written by JAX).
SHARDING_PARAMS = ("sharding", "out_sharding")


def bind(op: "Op", args: list, **overrides: Any) -> list:
  """The op's primitive applied to ``args`` (its params, sharding params dropped, computations
  traced here, ``overrides`` replacing others): the op run on arrays rather than traced."""
  from spmd.partition.unchecked import traced_here  # it evaluates with these records
  params = {k: (None if k in SHARDING_PARAMS
                else traced_here(v) if isinstance(v, (jcore.Jaxpr, jcore.ClosedJaxpr)) else v)
            for k, v in op.params.items()}
  params.update(overrides)
  out = op.eqn.primitive.bind(*args, **params)
  return list(out) if op.eqn.primitive.multiple_results else [out]


def operands(local: Any, args: list) -> list:
  """The local lowering of an identity (annotations, reshard, device_put): results are the
  operands."""
  return args[:len(local.op.outputs)]


def replicated_rule(op: "Op") -> OpShardingRule:
  """Every dim of every tensor replicated: correct for any primitive, never fast."""
  b = RuleBuilder()
  return b.build([None if not isinstance(x, Value) else [None] * len(x.aval.shape)
                  for x in op.inputs],
                 [[None] * len(v.aval.shape) for v in op.outputs])


def rule_for(op: "Op") -> tuple[OpShardingRule, PrimitiveInfo | None]:
  """The op's rule (with its linearity) and its record; records without a rule replicate."""
  info = describe(op.eqn.primitive)
  if info is None or info.rule is None:
    return replicated_rule(op), info
  rule = info.rule(op)
  linear = info.linear
  if linear.widening_float_only and not _widening_float(op):
    linear = NONLINEAR
  operands = tuple(range(len(op.inputs))) if linear.operands is None else linear.operands
  return dataclasses.replace(rule, linear_in=operands, additive=linear.additive), info


def _widening_float(op: "Op") -> bool:
  avals = [x.aval for x in (*op.inputs, *op.outputs)]
  return (bool(op.inputs) and all(jnp.issubdtype(a.dtype, jnp.inexact) for a in avals)
          and op.outputs[0].aval.dtype.itemsize >= op.inputs[0].aval.dtype.itemsize)
