"""Training-step helpers: optimizer state sharded like the params it belongs to."""
from __future__ import annotations

from typing import Any

import optax
from jax.sharding import PartitionSpec as P


def optimizer_specs(optimizer: optax.GradientTransformation, opt_state: Any,
                    param_specs: Any) -> Any:
  """Specs for ``opt_state`` of any optax ``optimizer``: every per-param leaf (Adam's moments,
  momentum, ...) takes its param's spec; the rest (step counts, scalars) is replicated.

  ``param_specs`` is a tree like the params with a spec (PartitionSpec, logical names or None)
  per leaf, e.g. ``nn.get_partition_spec(variables)["params"]``. Uses optax's own
  ``tree_map_params``, so wrappers (chains, masks, multi_transform) are followed as optax does.
  """
  return optax.tree_map_params(optimizer, lambda _, spec: spec, opt_state, param_specs,
                               transform_non_params=lambda _: P(),
                               is_leaf=lambda x: x is None or isinstance(x, P))
