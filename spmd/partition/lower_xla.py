"""backend="xla": ``jax.jit`` of the program with our shardings as constraints on every operand
(as the schedule reads it) and every result, so XLA's SPMD partitioner inserts the
communication."""
from __future__ import annotations

from typing import Any, Callable, Sequence

import jax
import jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding

from spmd.mesh import with_auto_axes
from spmd.partition.fold import const_arrays
from spmd.partition.ir import Atom, Literal, Op, Value
from spmd.partition.jax_compat import weakly_typed
from spmd.partition.planner import Analysis
from spmd.partition.primitives import bind, describe

def lower_xla(analysis: Analysis, mesh: Mesh, donate_argnums: Sequence[int],
              out_shardings: Sequence[NamedSharding]) -> Callable:
  """The outputs come back as ``out_shardings`` (equivalent to the propagated ones); inside, the
  constraints are on ``mesh`` with Auto axes."""
  program, shardings = analysis.program, analysis.propagation.shardings
  mesh = with_auto_axes(mesh)
  reads = {s.op: s.reads for s in analysis.schedule.walk()}

  def named(s) -> NamedSharding:
    return NamedSharding(mesh, s.to_spec())

  def run(ops: list[Op], env: dict[Value, Any]) -> None:
    for op in ops:
      args = [_read(env, x) for x in op.inputs]
      if not op.regions:  # each operand as the schedule reads it (XLA needs no guessing)
        args = [a if r is None or not isinstance(x, Value) else
                jax.lax.with_sharding_constraint(a, named(r))
                for a, x, r in zip(args, op.inputs, reads[op])]
      info = describe(op.eqn.primitive)  # an annotation's request is in the shardings already
      if info is not None and info.annotation:
        outs = args[:1]
      elif info is not None and info.manual:
        outs = info.manual.whole(op, args)
      else:
        outs = bind(op, args)
      for v, out in zip(op.outputs, outs):
        env[v] = jax.lax.with_sharding_constraint(out, named(shardings[v]))

  def body(*flat_args: Any) -> tuple[Any, ...]:
    env: dict[Value, Any] = const_arrays(program.consts)
    env.update(zip(program.inputs, flat_args))
    with jax.sharding.use_abstract_mesh(mesh.abstract_mesh):  # whatever mesh the caller set
      run(program.ops, env)
    return tuple(weakly_typed(_read(env, x)) if x.aval.weak_type else _read(env, x)
                 for x in program.outputs)

  return jax.jit(body, in_shardings=tuple(named(s) for s in analysis.schedule.inputs),
                 out_shardings=tuple(out_shardings), donate_argnums=tuple(donate_argnums))


def _read(env: dict[Value, Any], x: Atom) -> Any:
  if isinstance(x, Literal):
    return jnp.asarray(x.val, dtype=x.aval.dtype)
  return env[x]
