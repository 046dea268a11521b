"""spmd: GSPMD-style automatic partitioning for JAX, as an inspectable library."""
from spmd.api import ContextMeshPartitioned, Partitioned, partition
from spmd.mesh import make_mesh
from spmd.partition.annotation import annotate
from spmd.plan import Collective, Plan

__all__ = [
    "Collective", "ContextMeshPartitioned", "Partitioned", "Plan", "annotate", "make_mesh",
    "partition",
]
