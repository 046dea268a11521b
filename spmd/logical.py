"""Logical axis names, in flax's ``logical_axis_rules`` convention, resolved by flax itself.

A spec entry that is not a mesh axis name is a logical name ("batch", "embed", "mlp"). ``rules``
is a sequence of ``(logical_name, mesh_axes)`` pairs (mesh_axes: a mesh axis, a tuple of them or
None); flax's ``logical_to_mesh_axes`` resolves them (first matching rule whose mesh axes are
still free wins). Flax's boxed params (``nn.Partitioned``, ``nn.LogicallyPartitioned``) and NNX
variables carry such names in their metadata: ``box_specs`` reads them.
"""
from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any, Sequence

import jax
import numpy as np
from flax.core import meta as flax_meta
from flax.core import spmd as flax_spmd
from flax.linen import logical_to_mesh_axes
from jax.sharding import PartitionSpec as P

Rules = tuple[tuple[str, Any], ...]


@dataclass(frozen=True)
class AxisRules:
  """``rules`` over a mesh with ``mesh_axes``."""

  rules: Rules
  mesh_axes: tuple[str, ...]

  @classmethod
  def of(cls, rules: Sequence[tuple[str, Any]] | None, mesh_axes: Sequence[str],
         *, check_axes: bool = True) -> AxisRules:
    """``rules`` checked; ``check_axes``: a rule naming a mesh axis not in the mesh is an error
    (not for a flax context's rules, which may name the axes of other meshes)."""
    if rules is None:
      return cls((), tuple(mesh_axes))
    out = []
    for rule in rules:
      if (not isinstance(rule, (tuple, list)) or len(rule) != 2 or not isinstance(rule[0], str)):
        raise TypeError(f"spmd.partition: rules must be (logical_name, mesh_axes) pairs, as "
                        f"flax's logical_axis_rules, got {rule!r}")
      unknown = [a for a in _names(rule[1]) if a not in mesh_axes]
      if unknown and check_axes:
        raise ValueError(f"spmd.partition: rule {tuple(rule)!r} names mesh axis {unknown[0]!r}, "
                         f"which is not in the mesh (axes: {', '.join(mesh_axes)})")
      out.append((rule[0], tuple(rule[1]) if isinstance(rule[1], list) else rule[1]))
    return cls(tuple(out), tuple(mesh_axes))

  def resolve(self, spec: P, what: str) -> P:
    """``spec`` with its logical names replaced by mesh axes; mesh-axis entries stay as they are
    (and are not handed out again)."""
    entries = tuple(spec)
    logical = [e if isinstance(e, str) and e not in self.mesh_axes
               and e is not P.UNCONSTRAINED else None for e in entries]
    if not any(logical):
      return spec
    known = {name for name, _ in self.rules}
    for name in logical:
      if name is not None and name not in known:
        hint = (f"rules= has {', '.join(sorted(known))}" if known else
                "pass rules= (flax's logical_axis_rules) to use logical axis names")
        raise ValueError(f"{what}: {spec} names mesh axis {name!r}, which is not in the mesh "
                         f"(axes: {', '.join(self.mesh_axes)}) and no logical axis with a rule; "
                         f"{hint}")
    taken = {a for e, name in zip(entries, logical) if name is None for a in _names(e)}
    free = tuple((name, axes) for name, axes in self.rules if not set(_names(axes)) & taken)
    mesh = logical_to_mesh_axes(logical, free)
    return P(*(m if name is not None else e for e, name, m in zip(entries, logical, mesh)))

  @classmethod
  def ambient(cls, mesh_axes: Sequence[str]) -> AxisRules:
    """The rules of the flax context in effect (``nn.logical_axis_rules`` /
    ``nnx.logical_axis_rules``), as ``jax.jit`` of a flax model resolves logical names."""
    return cls.of(flax_spmd.get_logical_axis_rules(), mesh_axes, check_axes=False)

  def context(self) -> Any:
    """Flax's rules context, so ``nn.with_logical_constraint`` inside the model resolves."""
    return flax_spmd.logical_axis_rules(self.rules)


def rule_set(names: Sequence[str], *sharded: tuple[str, Any]) -> Rules:
  """Rules ``sharded`` first, then every one of ``names`` replicated (first match wins), so each
  logical axis a model uses has a rule and an unknown name stays an error."""
  return tuple(sharded) + tuple((name, None) for name in names)


def _names(entry: Any) -> tuple[str, ...]:
  if entry is None or entry is P.UNCONSTRAINED:
    return ()
  return (entry,) if isinstance(entry, str) else tuple(entry)


def box_specs(tree: Any) -> list[P | None]:
  """Per leaf of ``tree``: the names of the flax box (linen ``Partitioned`` /
  ``LogicallyPartitioned``) or NNX variable holding it, None where there are none."""
  nnx = sys.modules.get("flax.nnx")  # NNX variables exist only where the user imported NNX
  variable = nnx.Variable if nnx is not None else ()

  def is_box(x: Any) -> bool:
    return isinstance(x, flax_meta.AxisMetadata) or isinstance(x, variable)

  out: list[P | None] = []
  for item in jax.tree_util.tree_leaves(tree, is_leaf=is_box):
    count = len(jax.tree_util.tree_leaves(item)) if is_box(item) else 1
    out.extend([_box_spec(item, variable)] * count)
  return out


def _box_spec(item: Any, variable: Any) -> P | None:
  """The box's names, where they name each dim of its value: flax gives an optimizer's state the
  names of its param, whose rank a factored moment (adafactor's) or a stacked memory (lbfgs's)
  does not have; such a leaf is open, as ``nnx.jit`` leaves it."""
  spec = None
  if isinstance(item, flax_meta.AxisMetadata) and hasattr(item, "get_partition_spec"):
    spec = item.get_partition_spec()
  elif variable and isinstance(item, variable):
    metadata = item.get_metadata()
    names = metadata.get("out_sharding") or metadata.get("sharding")
    spec = P(*names) if names else None
  leaves = jax.tree_util.tree_leaves(item)
  if spec is None or len(leaves) != 1 or len(spec) != len(np.shape(leaves[0])):
    return None
  return spec
