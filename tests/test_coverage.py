"""Every primitive the installed JAX defines is described: it has a rule, or it is on the explicit
list of primitives that run replicated on purpose, with the reason (spmd/partition/catalog.py).
A new JAX release that adds a primitive fails here until it is given one or the other."""
import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from helpers import assert_partitioned_matches
from spmd.partition import catalog
from spmd.partition.catalog import REPLICATED
from spmd.partition.jax_compat import all_primitives
from spmd.partition.primitives import registry


def test_every_jax_primitive_has_a_rule_or_a_reason():
  missing = sorted({p.name for objects in all_primitives().values() for p in objects
                    if p not in registry()})
  assert not missing, (f"{len(missing)} primitives of this JAX have no record in "
                       f"spmd/partition/catalog.py: {missing}")


def test_replicated_primitives_say_why():
  for primitive, info in registry().items():
    described = (info.rule is not None or info.control is not None or info.inline is not None)
    assert described or info.reason, primitive.name
    assert not (info.reason and described), f"{primitive.name} has a rule and a reason"
  assert all(REPLICATED.values())


def test_random_gamma_runs_replicated_on_a_jax_without_gamma_one(monkeypatch):
  """random_gamma's rule draws each block's variates with JAX's private ``_gamma_one``
  (jax_compat.gamma_one); on a release without it random_gamma runs replicated, its reason in
  the plan, drawing what the unpartitioned function draws."""
  key, alpha = jax.random.key(0), jnp.abs(jnp.linspace(-2, 2, 32)).reshape(4, 8) + 0.5
  monkeypatch.setattr(catalog, "gamma_one", lambda: None)
  registry.cache_clear()
  try:
    plan = assert_partitioned_matches(jax.random.gamma, (key, alpha), (P(), P("a", "b")),
                                      "a2b4", replicated=("random_gamma",))
    assert any("_gamma_one" in w for w in plan.warnings), plan.explain()
  finally:
    monkeypatch.undo()
    registry.cache_clear()
