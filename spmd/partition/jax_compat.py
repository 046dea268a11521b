"""What differs between the JAX releases spmd supports (0.10.2 to the newest), in one place.

The rest of the package reads jaxprs only through these helpers:
- jaxprs: 0.10 has ``ClosedJaxpr`` (a jaxpr plus its consts) beside open ``Jaxpr``s; from 0.11 a
  ``Jaxpr`` carries its own ``consts`` and ``ClosedJaxpr`` is another name for it.
- scan: 0.10 counts its operands with ``num_consts`` / ``num_carry``; from 0.11 the params hold
  flat trees ``ft_in`` (consts, carry, xs) and ``ft_out`` (carry, ys).
- primitives: each release adds some (``one_minus_square``, ``log2``, ``eval_jaxpr`` for
  ``closed_call``, ...); ``primitives_named`` finds those the installed JAX defines.
"""
from __future__ import annotations

import functools
import importlib
import pkgutil
from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

import jax
from jax._src import core as src_core  # unsafe_am_i_under_a_jit, internal in 0.10 to 0.12
from jax.extend import core as jcore
from jax.sharding import Mesh

# JAX's modules that define the primitives of the programs users write (lax and its control
# flow, linear algebra and collectives, random numbers, differentiation, calls).
PRIMITIVE_MODULES = ("jax._src.lax", "jax._src.prng", "jax._src.random", "jax._src.ad_util",
                     "jax._src.ad_checkpoint", "jax._src.custom_derivatives", "jax._src.pjit",
                     "jax._src.core", "jax._src.interpreters.ad", "jax._src.dispatch",
                     "jax._src.shard_map", "jax._src.callback", "jax._src.debugging",
                     "jax._src.shard_alike", "jax._src.program_order",
                     "jax._src.custom_partitioning")


def open_jaxpr(jaxpr: Any) -> tuple[Any, list]:
  """(open jaxpr, its consts) of a closed or open jaxpr on any release."""
  return getattr(jaxpr, "jaxpr", jaxpr), list(getattr(jaxpr, "consts", ()))


@dataclass(frozen=True)
class ScanLayout:
  """How a scan's flat operands split: consts, then carry, then scanned xs."""

  num_consts: int
  num_carry: int


def scan_layout(params: Mapping[str, Any]) -> ScanLayout:
  if "num_consts" in params:
    return ScanLayout(params["num_consts"], params["num_carry"])
  consts, carry, _ = params["ft_in"].unpack()
  return ScanLayout(len(consts), len(carry))


@functools.cache
def all_primitives() -> Mapping[str, tuple[jcore.Primitive, ...]]:
  """Every primitive object defined in ``PRIMITIVE_MODULES`` (and their submodules), by name."""
  found: dict[str, list[jcore.Primitive]] = {}

  def visit(name: str) -> None:
    try:
      module = importlib.import_module(name)
    except ImportError:  # optional parts (e.g. GPU-only modules) may be absent
      return
    for value in vars(module).values():
      if isinstance(value, jcore.Primitive) and value not in found.get(value.name, ()):
        found.setdefault(value.name, []).append(value)
    for info in pkgutil.iter_modules(getattr(module, "__path__", ())):
      visit(f"{name}.{info.name}")

  for name in PRIMITIVE_MODULES:
    visit(name)
  return {name: tuple(objects) for name, objects in found.items()}


def primitives_named(*names: str) -> tuple[jcore.Primitive, ...]:
  """The primitives of these names that the installed JAX defines (releases add and rename)."""
  table = all_primitives()
  return tuple(p for n in names for p in table.get(n, ()))


def lowering_platform(device: Any) -> str:
  """The platform JAX lowers programs for ``device`` to ("gpu" devices: "cuda" or "rocm")."""
  from jax._src import xla_bridge  # noqa: PLC0415 (JAX's own name resolution; no public API)
  return xla_bridge.canonicalize_platform(device.platform)


def check_vma(enabled: bool) -> Any:
  """A context in which primitives type-check their varying manual axes (``enabled``) or not, as
  inside a ``jax.shard_map(..., check_vma=enabled)``: a partly manual region's body is traced
  unchecked outside any shard_map (its ``lax.psum`` then binds ``psum``, which vmap batches)."""
  from jax._src import config  # noqa: PLC0415 (shard_map's own switch; no public API)
  return config._check_vma(enabled)  # noqa: SLF001


def weakly_typed(x: Any) -> Any:
  """``x`` weakly typed, as ``jax.jit`` returns an output whose aval is (a Python scalar's
  arithmetic): the local program may compute it from literals bound strongly typed."""
  from jax._src.lax import lax as lax_internal  # noqa: PLC0415 (no public API sets weak_type)
  return lax_internal._convert_element_type(x, weak_type=True)  # noqa: SLF001


def without_dead_outputs(jaxpr: Any, used: Sequence[bool]) -> Any:
  """``jaxpr`` returning only its ``used`` outputs, with the equations computing only the others
  dropped (effects stay) and every input kept."""
  from jax._src.interpreters import partial_eval  # noqa: PLC0415 (dce_jaxpr: internal, 0.10-0.12)
  return partial_eval.dce_jaxpr(jaxpr, list(used), instantiate=True)[0]


def set_cpu_device_count(count: int) -> None:
  """Simulates ``count`` CPU devices; must run before JAX starts its CPU backend."""
  jax.config.update("jax_num_cpu_devices", count)


def context_mesh() -> Mesh:
  """The concrete mesh of the ``jax.set_mesh`` context (empty outside one), under ``jax.jit``
  too, where ``jax.sharding.get_mesh`` refuses to answer."""
  from jax._src import mesh  # noqa: PLC0415 (get_concrete_mesh: internal in 0.10 to 0.12)
  return mesh.get_concrete_mesh()


def trace_context() -> tuple:
  """The configuration a traced program depends on (``jax.threefry_partitionable``,
  ``jax.default_matmul_precision``, x64, dtype promotion, ...), by which ``jax.jit`` keys its
  caches: a call under other settings traces and compiles again (internal in 0.10 to 0.12)."""
  from jax._src import config  # noqa: PLC0415
  return config.trace_context()


def threefry_partitionable_at(eqn: Any) -> bool:
  """``jax_threefry_partitionable`` where ``eqn`` was traced (each equation records the settings
  around it: a ``with jax.threefry_partitionable(False)`` inside the function)."""
  with eqn.ctx.manager:
    return bool(jax.config.jax_threefry_partitionable)


def under_jit() -> bool:
  """Whether the current trace stages a program out (``jax.jit``, ``jax.make_jaxpr``), rather
  than running eagerly (eager ``jax.grad`` and ``jax.vmap`` see concrete values)."""
  return src_core.unsafe_am_i_under_a_jit()


def reduction_jaxpr(computation: Callable[[tuple, tuple], tuple], avals: tuple) -> Any:
  """``computation(xs, ys)`` of two tuples of values of ``avals`` traced in the current trace,
  as JAX traces a reduce's body (``lax._variadic_reduction_jaxpr`` and
  ``api_util.debug_info``, private in every release): a closed jaxpr."""
  debug = importlib.import_module("jax._src.api_util").debug_info(
      "reduction_jaxpr", computation, (avals, avals), {})
  closed, _ = importlib.import_module("jax._src.lax.lax")._variadic_reduction_jaxpr(
      computation, debug, avals, jax.tree_util.tree_structure(avals))
  return closed


def key_impl(aval: Any) -> Any:
  """The PRNG implementation (a ``jax.extend.random`` PRNGImpl) of a key array's aval;
  ``jax.random.key_impl`` takes arrays only and gives the name."""
  return aval.dtype._impl


@functools.cache
def gamma_one() -> Callable | None:
  """JAX's draw of one gamma variate from one key (``_gamma_one(key, alpha, log_space)``), which
  ``random_gamma`` maps over keys split per element; private in every release (0.10 to 0.12 keep
  it in jax._src.random.core, earlier layouts in jax._src.random). None where a release has
  none: random_gamma then runs replicated (catalog.py)."""
  return _random_private("_gamma_one")


@functools.cache
def poisson_local() -> Callable | None:
  """JAX's draw of Poisson variates per key (``_poisson_impl_local(keys, lam, dtype, counts)``,
  ``counts`` the flat positions the uniforms are drawn at, as JAX's own lowering of a split
  result passes them); private, in JAX 0.12.1+, whose ``random_poisson`` primitive it
  implements. None elsewhere."""
  return _random_private("_poisson_impl_local")


def _random_private(name: str) -> Callable | None:
  for module in ("jax._src.random.core", "jax._src.random"):
    try:
      return getattr(importlib.import_module(module), name)
    except (ImportError, AttributeError):
      continue
  return None
