"""Partial sums added before anything else reads them are reduced once, at the root of their
add tree (sum_trees.py), so a masked gather's or a dot's reduction is priced at its share there;
but an add takes pending sums only jointly, so where another term is no partial sum (an operand
gathered locally from a replicated table, an elementwise value) each is reduced on its own and
priced in full. Values, plan == compiled HLO and bytes against XLA's partitioner on 4x2."""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from helpers import no_more_than_xla, randn

MESH = {"data": 4, "model": 2}
EDGES = P(("data", "model"))


def _indices(high: int, seed: int) -> np.ndarray:
  return np.random.default_rng(seed).integers(0, high, 24).astype(np.int32)


@pytest.mark.parametrize("fn,args,specs,moved", [
    # t's rows gathered whole (512 B, as XLA), not a masked gather reduce-scattered (768 B)
    # priced at half for a tree whose other term, u[j] of a replicated u, is no partial sum
    pytest.param(lambda t, u, i, j: t[i] + u[j],
                 (randn(16, 8), randn(4, 8, seed=1), _indices(16, 0), _indices(4, 1)),
                 (P("data"), P(), EDGES, EDGES), 512, id="gather-plus-a-local-gather"),
    pytest.param(lambda t, u, i, j: t[i] + jnp.sin(u)[j],
                 (randn(16, 8), randn(4, 8, seed=1), _indices(16, 0), _indices(4, 1)),
                 (P("data"), P(), EDGES, EDGES), 512, id="gather-plus-an-elementwise-value"),
    # both terms masked gathers of tables over "data": one reduction shared (XLA 1024 B)
    pytest.param(lambda t, u, i, j: t[i] + u[j],
                 (randn(16, 8), randn(16, 8, seed=1), _indices(16, 0), _indices(16, 1)),
                 (P("data"), P("data"), EDGES, EDGES), 960, id="two-masked-gathers"),
    # two dots' partial sums over "model" reduced once below the add of x's slice (XLA 640 B)
    pytest.param(lambda x, w, y, v: x @ w + y @ v + x[:, :8],
                 (randn(8, 16), randn(16, 8, seed=1), randn(8, 16, seed=2), randn(16, 8, seed=3)),
                 (P(None, "model"), P("model"), P(None, "model"), P("model")), 384,
                 id="two-dots-then-a-value"),
])
def test_a_partial_sum_shares_its_reduction_only_with_partial_sums(fn, args, specs, moved):
  plan = no_more_than_xla(fn, args, specs, MESH)
  assert plan.total_bytes == moved, plan.explain()
