"""A user's shard_map body evaluated in its unchecked form, inside spmd's unchecked shard_map.

A body traced with ``check_vma=True`` holds collectives typed by the manual axes their operands
vary over: ``psum`` binds ``psum_invariant`` (which refuses an operand not varying over its axes)
and values are cast to varying with ``pvary``. spmd's program is unchecked, and so is every
re-trace JAX makes of it (``jax.vmap`` batches it unchecked), where no value varies over any
axis: the body's collectives are bound in their unchecked forms (``psum``, ``all_gather``), its
casts dropped, and the bodies of its calls and control flow evaluated the same way. The forward
values are the same; only their differentiation differs, and spmd differentiates the original
function, never its local program.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

from jax import lax
from jax.extend import core as jcore

from spmd.partition.jax_compat import open_jaxpr, scan_layout
from spmd.partition.primitives import describe


def evaluate(jaxpr: Any, args: Sequence[Any]) -> list:
  """The results of the closed (or open, with no consts) ``jaxpr`` on ``args``, unchecked."""
  body, consts = open_jaxpr(jaxpr)
  env = dict(zip(body.constvars, consts)) | dict(zip(body.invars, args))
  read = lambda v: v.val if isinstance(v, jcore.Literal) else env[v]  # noqa: E731
  for eqn in body.eqns:
    env.update(zip(eqn.outvars, _equation(eqn, [read(v) for v in eqn.invars])))
  return [read(v) for v in body.outvars]


def _equation(eqn: Any, args: list) -> list:
  name, params = eqn.primitive.name, eqn.params
  if name in REWRITES and not params.get("branches_platforms"):  # lowering picks a platform's
    return REWRITES[name](params, args)
  info = describe(eqn.primitive)
  inline = info.inline(params, tuple(args)) if info is not None and info.inline else None
  if inline is not None:
    return evaluate(*inline)
  return _bind(eqn, args)


def _bind(eqn: Any, args: list) -> list:
  """The equation bound as written (as ``jax.core.eval_jaxpr`` binds it)."""
  out = eqn.primitive.bind(*args, **eqn.primitive.get_bind_params(eqn.params))
  return list(out) if eqn.primitive.multiple_results else [out]


def _scan(params: Any, args: list) -> list:
  layout = scan_layout(params)
  consts = args[:layout.num_consts]
  carry = args[layout.num_consts:layout.num_consts + layout.num_carry]
  xs = args[layout.num_consts + layout.num_carry:]

  def step(c: list, x: list) -> tuple[list, list]:
    outs = evaluate(params["jaxpr"], [*consts, *c, *x])
    return outs[:layout.num_carry], outs[layout.num_carry:]

  carry, ys = lax.scan(step, carry, xs, length=params["length"], reverse=params["reverse"],
                       unroll=params["unroll"])
  return [*carry, *ys]


def _while(params: Any, args: list) -> list:
  n_cond, n_body = params["cond_nconsts"], params["body_nconsts"]
  cond_consts, body_consts = args[:n_cond], args[n_cond:n_cond + n_body]
  return lax.while_loop(lambda c: evaluate(params["cond_jaxpr"], [*cond_consts, *c])[0],
                        lambda c: evaluate(params["body_jaxpr"], [*body_consts, *c]),
                        args[n_cond + n_body:])


def _cond(params: Any, args: list) -> list:
  branch = lambda jaxpr: lambda *ops: evaluate(jaxpr, ops)  # noqa: E731
  return lax.switch(args[0], [branch(b) for b in params["branches"]], *args[1:])


REWRITES: dict[str, Callable[[Any, list], list]] = {
    "psum_invariant": lambda p, args: [lax.psum(args[0], p["axes"])],
    "all_gather_invariant": lambda p, args: [lax.all_gather(
        args[0], p["axis_name"], axis=p["all_gather_dimension"], tiled=p["tiled"])],
    "pvary": lambda p, args: args,
    "scan": _scan,
    "while": _while,
    "cond": _cond,
}
