"""A user's shard_map body evaluated in its unchecked form, inside spmd's unchecked shard_map.

A body traced with ``check_vma=True`` holds collectives typed by the manual axes their operands
vary over: ``psum`` binds ``psum_invariant`` (which refuses an operand not varying over its axes)
and values are cast to varying with ``pvary``. spmd's program is unchecked, and so is every
re-trace JAX makes of it (``jax.vmap`` batches it unchecked), where no value varies over any
axis: the body's collectives are bound in their unchecked forms (``psum``, ``all_gather``), its
casts dropped, and the bodies of its calls and control flow evaluated the same way. The forward
values are the same; only their differentiation differs, and spmd differentiates the original
function, never its local program. A region manual over only some axes (partly_manual.py) is
evaluated the same way under ``jax.vmap``, with rewrites of its own.
"""
from __future__ import annotations

from typing import Any, Callable, Mapping, Sequence

import jax
from jax import lax
from jax._src import source_info_util
from jax.extend import core as jcore

from spmd.partition.jax_compat import open_jaxpr, reduction_jaxpr, scan_layout
from spmd.partition.primitives import describe

# How an equation of a primitive is evaluated instead of bound as written: (its params, its
# operands, the rewrites in force for the bodies it holds) -> its results.
Rewrite = Callable[[Mapping[str, Any], list, "Rewrites"], list]
Rewrites = Mapping[str, Rewrite]


def evaluate(jaxpr: Any, args: Sequence[Any], rewrites: Rewrites | None = None) -> list:
  """The results of the closed (or open, with no consts) ``jaxpr`` on ``args``, unchecked
  (``REWRITES``, or ``rewrites``), each equation under its own source line."""
  rewrites = REWRITES if rewrites is None else rewrites
  body, consts = open_jaxpr(jaxpr)
  env = dict(zip(body.constvars, consts)) | dict(zip(body.invars, args))
  read = lambda v: v.val if isinstance(v, jcore.Literal) else env[v]  # noqa: E731
  for eqn in body.eqns:
    with source_info_util.user_context(eqn.source_info.traceback,
                                       name_stack=eqn.source_info.name_stack):
      outs = _equation(eqn, [read(v) for v in eqn.invars], rewrites)
    env.update(zip(eqn.outvars, outs))
  return [read(v) for v in body.outvars]


def traced_here(jaxpr: Any) -> Any:
  """An op's computation combining two values of one type, element by element (a scatter's
  combiner, a reduce's or reduce_window's body, variadic too), open or closed, ``evaluate``d
  anew in the current trace (``jax_compat.reduction_jaxpr``), outside the mesh context each
  equation recorded. Traced beside the user's program on a mesh with Explicit axes, its values'
  types name that mesh, which inside spmd's shard_map lower to sharding constraints on its
  manual axes. Any other (with consts, not scalars in two equal halves) is kept as it is."""
  body, consts = open_jaxpr(jaxpr)
  avals, half = body.in_avals, len(body.in_avals) // 2
  if (consts or body.constvars or not avals or avals[:half] != avals[half:]
      or any(a.shape for a in avals) or len(body.outvars) != half):
    return jaxpr
  fresh = tuple(jax.core.ShapedArray((), a.dtype, weak_type=a.weak_type) for a in avals[:half])
  new = reduction_jaxpr(lambda xs, ys: tuple(evaluate(body, [*xs, *ys])), fresh)
  return new if isinstance(jaxpr, jcore.ClosedJaxpr) else open_jaxpr(new)[0]


def _equation(eqn: Any, args: list, rewrites: Rewrites) -> list:
  name, params = eqn.primitive.name, eqn.params
  if name in rewrites and not params.get("branches_platforms"):  # lowering picks a platform's
    return rewrites[name](params, args, rewrites)
  info = describe(eqn.primitive)
  inline = info.inline(params, tuple(args)) if info is not None and info.inline else None
  if inline is not None:
    return evaluate(*inline, rewrites)
  return _bind(eqn, args)


def _bind(eqn: Any, args: list) -> list:
  """The equation bound as written (as ``jax.core.eval_jaxpr`` binds it)."""
  out = eqn.primitive.bind(*args, **eqn.primitive.get_bind_params(eqn.params))
  return list(out) if eqn.primitive.multiple_results else [out]


def _scan(params: Mapping[str, Any], args: list, rewrites: Rewrites) -> list:
  layout = scan_layout(params)
  consts = args[:layout.num_consts]
  carry = args[layout.num_consts:layout.num_consts + layout.num_carry]
  xs = args[layout.num_consts + layout.num_carry:]

  def step(c: list, x: list) -> tuple[list, list]:
    outs = evaluate(params["jaxpr"], [*consts, *c, *x], rewrites)
    return outs[:layout.num_carry], outs[layout.num_carry:]

  carry, ys = lax.scan(step, carry, xs, length=params["length"], reverse=params["reverse"],
                       unroll=params["unroll"])
  return [*carry, *ys]


def _while(params: Mapping[str, Any], args: list, rewrites: Rewrites) -> list:
  n_cond, n_body = params["cond_nconsts"], params["body_nconsts"]
  cond_consts, body_consts = args[:n_cond], args[n_cond:n_cond + n_body]
  return lax.while_loop(
      lambda c: evaluate(params["cond_jaxpr"], [*cond_consts, *c], rewrites)[0],
      lambda c: evaluate(params["body_jaxpr"], [*body_consts, *c], rewrites),
      args[n_cond + n_body:])


def _cond(params: Mapping[str, Any], args: list, rewrites: Rewrites) -> list:
  branch = lambda jaxpr: lambda *ops: evaluate(jaxpr, ops, rewrites)  # noqa: E731
  return lax.switch(args[0], [branch(b) for b in params["branches"]], *args[1:])


REWRITES: Rewrites = {
    "psum_invariant": lambda p, args, _: [lax.psum(args[0], p["axes"])],
    "all_gather_invariant": lambda p, args, _: [lax.all_gather(
        args[0], p["axis_name"], axis=p["all_gather_dimension"], tiled=p["tiled"])],
    "pvary": lambda p, args, _: args,
    "scan": _scan,
    "while": _while,
    "cond": _cond,
}
