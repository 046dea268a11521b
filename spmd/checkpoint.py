"""Checkpoints of sharded state with orbax: saved from one mesh, restored onto any other.

Each process writes the shards it holds. A save is written to a temporary directory that orbax
renames to the step's name once complete, so an interrupted save leaves earlier steps readable
(and ``latest_step`` ignores it). A restore reads, for every device, its shard of the target
sharding, whatever mesh wrote the checkpoint.
"""
from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P


def save(directory: str | os.PathLike, step: int, state: Any) -> None:
  """Saves ``state`` (a pytree of arrays) as ``step`` under ``directory``; returns once the
  checkpoint is complete on disk."""
  with _manager(directory, create=True) as manager:
    manager.save(step, args=ocp.args.StandardSave(state))
    manager.wait_until_finished()


def restore(directory: str | os.PathLike, target: Any, step: int | None = None) -> Any:
  """The state saved as ``step`` (default: the latest complete one), placed as ``target``: a
  pytree of ``jax.ShapeDtypeStruct`` with shardings (see ``targets``) on any mesh."""
  with _manager(directory) as manager:
    step = manager.latest_step() if step is None else step
    if step is None:
      raise FileNotFoundError(f"spmd.checkpoint.restore: no complete checkpoint in {directory}")
    return manager.restore(step, args=ocp.args.StandardRestore(target))


def latest_step(directory: str | os.PathLike) -> int | None:
  """The latest step saved completely under ``directory``; None if there is none."""
  with _manager(directory) as manager:
    return manager.latest_step()


def targets(state: Any, mesh: Mesh, specs: Any) -> Any:
  """``state``'s leaves (arrays or abstract values) as ``jax.ShapeDtypeStruct`` sharded over
  ``mesh`` as ``specs`` (a pytree of PartitionSpec with ``state``'s structure): where
  ``restore`` places a checkpoint."""
  return jax.tree.map(
      lambda spec, x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=NamedSharding(mesh, spec)),
      specs, state, is_leaf=lambda s: isinstance(s, P))


def _manager(directory: str | os.PathLike, create: bool = False) -> ocp.CheckpointManager:
  options = ocp.CheckpointManagerOptions(create=create)
  return ocp.CheckpointManager(Path(directory).absolute(), options=options)
