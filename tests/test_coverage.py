"""Every primitive the installed JAX defines is described: it has a rule, or it is on the explicit
list of primitives that run replicated on purpose, with the reason (spmd/partition/catalog.py).
A new JAX release that adds a primitive fails here until it is given one or the other."""
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
