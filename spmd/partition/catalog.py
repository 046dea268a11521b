"""Every primitive spmd knows, in one table: its family's rule, linearity and local lowering.

Adding a primitive, or following a JAX release that adds or renames one, is an entry here.
Names absent from the installed JAX are skipped (``jax_compat.primitives_named``). Primitives
that run replicated on purpose are listed in ``REPLICATED`` with the reason, which the plan's
warning repeats; tests/test_coverage.py fails for a primitive of JAX's that is in neither.
"""
from __future__ import annotations

import functools
import itertools
from typing import Any, Callable, Mapping

import jax
import jax.numpy as jnp
from jax.extend.core import Primitive, jaxpr_as_fun

from spmd.partition import local, manual, partly_manual
from spmd.partition.annotation import (annotate_p, annotate_request, constraint_request,
                                       reshard_request)
from spmd.partition.jax_compat import gamma_one, open_jaxpr, poisson_local, primitives_named
from spmd.partition.primitives import (ADDITIVE_IN_FIRST, NONLINEAR, ControlFlow, Inline,
                                      Linearity, Manual, PrimitiveInfo, operands)
from spmd.partition.roll import roll_dynamic_p, roll_p
from spmd.partition.rules import (control, conv, dot, elementwise, indexing, linalg, random,
                                  reduce, shape, sort, window)

ELEMENTWISE_UNARY = """sign floor ceil round is_finite exp exp2 log log1p log2 expm1 tanh logistic
sin cos tan asin acos atan sinh cosh asinh acosh atanh sqrt rsqrt cbrt abs not erf erfc erf_inv
lgamma digamma bessel_i0e bessel_i1e integer_pow square one_minus_square reduce_precision
population_count clz stop_gradient zeros_like random_seed random_clone
layout_constraint sinpi cospi tanpi asinpi acospi atanpi exp2m1 log2p1""".split()
ELEMENTWISE_NARY = """pow max min nextafter atan2 and or xor eq ne lt le gt ge eq_to le_to lt_to
rem shift_left shift_right_logical shift_right_arithmetic complex igamma igammac igamma_grad_a
random_gamma_grad polygamma zeta regularized_incomplete_beta clamp threefry2x32 threefry4x32
philox2x32 philox4x32 mulhi polynomial atan2pi fma fmuladd""".split()
# Linear in their operand: a pending partial sum flows through them.
ELEMENTWISE_LINEAR = "neg copy copy_p real imag conj".split()

# Primitives that run replicated (operands gathered whole), each with the reason.
COLLECTIVE = ("a collective over named mesh axes: valid only inside shard_map, whose body spmd "
              "does not partition")
INTERNAL = "internal to JAX's transformations: never left in a program spmd traces"
REF = "a mutable array reference: spmd partitions pure programs"
REPLICATED: dict[str, str] = {
    **{n: COLLECTIVE for n in """ppermute all_gather all_to_all reduce_scatter
       axis_index pbroadcast pvary psum_invariant all_gather_invariant ragged_all_to_all
       pbroadcast_dynamic preduced unreduced_psum unreduced_pmax unreduced_pmin
       unreduced_reduce_scatter all_gather_reduced reduced_vary_cast reduced_vary_cast_p
       vary_unreduced_cast vary_unreduced_cast_p psend precv all_gather_start all_gather_done
       all_gather_reduced_start all_to_all_start all_to_all_done pbroadcast_start pbroadcast_done
       ppermute_start ppermute_done psum_start psum_done psum_invariant_start reduce_scatter_start
       reduce_scatter_done unreduced_psum_start unreduced_reduce_scatter_start pmax_scatter
       pmin_scatter pxor""".split()},
    **{n: INTERNAL for n in """custom_lin remat_opt stage tie dce_sink
       unreachable empty""".split()},
    **{n: REF for n in "new_ref empty_ref free_ref freeze accum_grad_in_ref".split()},
    "create_token": "a token holds no array data",
    "after_all": "a token holds no array data",
    "platform_index": "a scalar with no operands, computed whole on every device",
    "iota_2x32_shape": "no rule yet: its values depend on the global position, as iota's do",
    "to_edtype": "no rule yet: converts to an extended dtype that drops trailing dims",
    "from_edtype": "no rule yet: converts from an extended dtype that adds trailing dims",
    "pure_callback": "a host callback sees whole arrays",
    "io_callback": "a host callback sees whole arrays",
    "debug_callback": "a host callback sees whole arrays",
    "debug_print": "a host callback sees whole arrays",
    "inspect_sharding": "a host callback sees whole arrays",
    "rng_bit_generator": "its bits depend on the whole output shape, so no device can compute "
                         "its block alone",
    "rng_uniform": "its bits depend on the whole output shape",
    "raw_bits": "no rule yet (new in jax 0.12.1): a key's raw bit streams, drawn whole",
    "ragged_dot_general": "no rule yet: group sizes index the whole ragged dim",
    "scaled_dot": "no rule yet: the scales' block layout ties them to whole dims",
    "composite": "a composite's decomposition runs on whole operands",
}

# Primitives whose every application draws new values from the device's generator state (no key
# operand): two equal applications are two different arrays, never merged.
STATEFUL = {"rng_uniform"}
# Callbacks with no results, for their effect on the host (printing): called once per call.
DEBUG_CALLBACKS = {"debug_callback", "debug_print"}

CONTROL_FLOW = {
    "scan": ControlFlow(("jaxpr",), control.scan, control.lower_scan, control.scan_copies,
                        control.scan_invariants),
    "while": ControlFlow(("cond_jaxpr", "body_jaxpr"), control.while_, control.lower_while,
                         lambda p: (None,),  # a runtime trip count
                         control.while_invariants),
    "cond": ControlFlow(("branches",), control.cond, control.lower_cond,
                        lambda p: (1,),  # one branch runs (the plan counts each branch's)
                        control.cond_invariants),
}
# Calls whose body is inlined (sharding decisions see through them): the param holding it.
INLINED_CALLS = {
    "jit": "jaxpr", "pjit": "jaxpr", "closed_call": "call_jaxpr", "core_call": "call_jaxpr",
    "call": "call_jaxpr", "eval_jaxpr": "call_jaxpr", "custom_jvp_call": "call_jaxpr",
    "custom_jvp_call_jaxpr": "fun_jaxpr", "custom_vjp_call": "call_jaxpr",
    "custom_vjp_call_jaxpr": "fun_jaxpr", "remat": "jaxpr",
    "remat2": "jaxpr", "checkpoint": "jaxpr", "linear_call": "callee",
    "program_order": "call_jaxpr",  # jax.experimental.overlap (0.11+): a call under jit
    # jax.experimental.custom_partitioning: its function's body, partitioned by spmd's rules
    # (its partition callback lowers for XLA's partitioner, whose shardings it names)
    "custom_partitioning": "call",
}


def call_body(param: str) -> Inline:
  """A call's body is its ``param``, reading the call's last operands."""
  def body(params: Mapping[str, Any], inputs: tuple) -> tuple[Any, tuple] | None:
    if param not in params:
      return None
    jaxpr = params[param]
    return jaxpr, inputs[len(inputs) - len(open_jaxpr(jaxpr)[0].invars):]
  return body


def linear_solve_body(params: Mapping[str, Any], inputs: tuple) -> tuple[Any, tuple]:
  """``custom_linear_solve`` (``jnp.linalg.solve`` / ``inv``) evaluates its solve body on the
  solve's consts and ``b``, as JAX lowers it; its other bodies serve differentiation, which the
  traced program has already done."""
  lengths = params["const_lengths"]
  start = lengths.matvec + lengths.vecmat
  return params["jaxprs"].solve, (*inputs[start:start + lengths.solve], *inputs[sum(lengths):])


def _traced_over(fn: Callable, inputs: tuple) -> tuple[Any, tuple]:
  """``fn``'s jaxpr at ``inputs``' shapes and dtypes, read on ``inputs``: an op's body written as
  the ordinary primitives JAX lowers it to."""
  return jax.make_jaxpr(fn)(*(jax.ShapeDtypeStruct(x.aval.shape, x.aval.dtype)
                              for x in inputs)), inputs


def hi_primitive_body(params: Mapping[str, Any], inputs: tuple) -> tuple[Any, tuple]:
  """``call_hi_primitive`` (JAX 0.12's "hijax" ops: ``jnp.nonzero(size=...)``, ``jnp.unique``) is
  its expansion into ordinary primitives, traced here as JAX expands it when it lowers."""
  (call,) = primitives_named("call_hi_primitive")
  return _traced_over(functools.partial(call.to_lojax, _prim=params["_prim"]), inputs)


def one_predicate_loop(params: Mapping[str, Any], inputs: tuple) -> tuple[Any, tuple] | None:
  """A ``while`` whose predicate is per element (``jax.vmap`` of a loop whose elements run
  different trip counts) is, as JAX lowers it, a loop while any element's predicate holds whose
  body keeps the carry of each element whose own predicate fails (the predicate's dims lead every
  carry's): the elements then stay split, the ``any`` an all-reduce per trip. A loop with one
  predicate is the op itself (None)."""
  cond, body = params["cond_jaxpr"], params["body_jaxpr"]
  if not cond.out_avals[0].shape:
    return None
  cn, bn = params["cond_nconsts"], params["body_nconsts"]

  def loop(*args: jax.Array) -> list[jax.Array]:
    cond_consts, body_consts, init = args[:cn], args[cn:cn + bn], args[cn + bn:]

    def holds(carry: list) -> jax.Array:
      return jaxpr_as_fun(cond)(*cond_consts, *carry)[0]

    def step(carry: list) -> list[jax.Array]:
      keep = holds(carry)
      new = jaxpr_as_fun(body)(*body_consts, *carry)
      return [jax.lax.select(jax.lax.broadcast_in_dim(keep, n.shape, tuple(range(keep.ndim))),
                             n, old) for n, old in zip(new, carry)]
    return jax.lax.while_loop(lambda carry: jnp.any(holds(carry)), step, list(init))
  return _traced_over(loop, inputs)


def split_as_slices(params: Mapping[str, Any], inputs: tuple) -> tuple[Any, tuple]:
  """``split`` is one ``slice`` per piece, as JAX lowers it: a piece of a sharded dim is then a
  halo of the rows it needs, kept sharded as under jax.jit, not a gather of the dim."""
  axis, ends = params["axis"], list(itertools.accumulate(int(n) for n in params["sizes"]))

  def pieces(x: jax.Array) -> tuple[jax.Array, ...]:
    return tuple(jax.lax.slice_in_dim(x, end - int(n), end, axis=axis)
                 for end, n in zip(ends, params["sizes"]))
  return _traced_over(pieces, inputs)


def transposing_reshape(params: Mapping[str, Any], inputs: tuple) -> tuple[Any, tuple] | None:
  """A ``reshape`` with ``dimensions`` (``lax.reshape``'s transpose first, as a grouped
  convolution's input gradient regroups its kernel) is that transpose then a plain reshape, as
  XLA lowers it; a plain reshape (None) is the op itself."""
  if params.get("dimensions") is None:
    return None

  def transposed(x: jax.Array) -> jax.Array:
    return jax.lax.reshape(jax.lax.transpose(x, params["dimensions"]), params["new_sizes"])
  return _traced_over(transposed, inputs)


def select_tree(params: Mapping[str, Any], inputs: tuple) -> tuple[Any, tuple] | None:
  """A ``select_n`` of more than two cases is the tree of two-case selects XLA runs, as JAX
  lowers it: ``which < k`` splitting the cases in halves (each select then takes its own
  operands' shardings, as Shardy sees them); two cases are the op itself (None)."""
  if len(inputs) <= 3:
    return None

  def tree(which: jax.Array, *cases: jax.Array) -> jax.Array:
    def pick(offset: int, cases: tuple) -> jax.Array:
      if len(cases) == 1:
        return cases[0]
      mid = len(cases) // 2
      low = jax.lax.lt(which, jax.lax.full_like(which, offset + mid))
      return jax.lax.select_n(low, pick(offset + mid, cases[mid:]), pick(offset, cases[:mid]))
    return pick(0, cases)
  return _traced_over(tree, inputs)


LINALG = """cholesky cholesky_update eig eigh hessenberg householder_product lu qr geqrf geqp3
ormqr schur svd symmetric_product triangular_solve tridiagonal""".split()


def _cumulative(combiner: str, linear: Linearity = NONLINEAR) -> PrimitiveInfo:
  """A scan along an axis combining with ``combiner`` (rules.reduce.cumulative)."""
  return PrimitiveInfo(reduce.cumulative(combiner), linear, local.cumulative(combiner))


def _entries() -> list[tuple[tuple[str, ...], PrimitiveInfo]]:
  """(names, record) of every family, by JAX primitive name."""
  ew = elementwise.elementwise
  return [
      # elementwise and identities
      ((*ELEMENTWISE_UNARY, *ELEMENTWISE_NARY), PrimitiveInfo(ew)),
      (tuple(ELEMENTWISE_LINEAR), PrimitiveInfo(ew, ADDITIVE_IN_FIRST)),
      # identities: checkpoint_name, relayout
      (("name", "relayout"), PrimitiveInfo(ew, ADDITIVE_IN_FIRST, operands)),
      (("reshard",),
       PrimitiveInfo(ew, ADDITIVE_IN_FIRST, operands, annotation=reshard_request)),
      (("add", "sub", "add_any"), PrimitiveInfo(ew, Linearity((0, 1), additive=True))),
      (("mul",), PrimitiveInfo(ew, Linearity((0, 1)))),
      (("div",), PrimitiveInfo(ew, Linearity((0,)))),
      (("select_n",), PrimitiveInfo(ew, Linearity((1, 2), additive=True),
                                    inline=select_tree)),
      (("convert_element_type",),
       PrimitiveInfo(ew, Linearity((0,), additive=True, widening_float_only=True))),
      (("sharding_constraint",),
       PrimitiveInfo(ew, ADDITIVE_IN_FIRST, operands, annotation=constraint_request)),
      (("bitcast_convert_type",), PrimitiveInfo(elementwise.bitcast_convert_type)),
      (("optimization_barrier",), PrimitiveInfo(elementwise.per_tensor_identity)),
      # jax.experimental.shard_alike: its operands (one shape) share one sharding
      (("shard_alike",), PrimitiveInfo(ew, local=operands)),
      (("device_put",), PrimitiveInfo(elementwise.per_tensor_identity, local=operands)),
      # shapes
      (("broadcast_in_dim",),
       PrimitiveInfo(shape.broadcast_in_dim, ADDITIVE_IN_FIRST, local.broadcast_in_dim)),
      (("tile",), PrimitiveInfo(shape.tile, ADDITIVE_IN_FIRST, local.tile)),
      (("reshape",), PrimitiveInfo(shape.reshape, ADDITIVE_IN_FIRST, local.reshape,
                                    inline=transposing_reshape)),
      (("transpose",), PrimitiveInfo(shape.transpose, ADDITIVE_IN_FIRST)),
      (("squeeze",), PrimitiveInfo(shape.squeeze, ADDITIVE_IN_FIRST)),
      (("expand_dims",), PrimitiveInfo(shape.expand_dims, ADDITIVE_IN_FIRST)),
      (("iota",), PrimitiveInfo(shape.iota, local=local.iota)),
      # a scalar of no operands: the placeholder a cond branch gives a residual only another
      # branch makes, left in a cond's gradient (whole on every device, as a scalar always is)
      (("empty2",), PrimitiveInfo(ew)),
      # reductions and scans along an axis
      (("reduce_sum",), PrimitiveInfo(reduce.reduction("sum"), ADDITIVE_IN_FIRST)),
      (("reduce_max",), PrimitiveInfo(reduce.reduction("max"))),
      (("reduce_min",), PrimitiveInfo(reduce.reduction("min"))),
      (("reduce_or",), PrimitiveInfo(reduce.reduction("or"), local=local.reduce_again)),
      (("reduce_and",), PrimitiveInfo(reduce.reduction("and"), local=local.reduce_again)),
      (("reduce_prod",), PrimitiveInfo(reduce.reduction("prod"), local=local.reduce_again)),
      (("reduce_xor",), PrimitiveInfo(reduce.reduction("xor"), local=local.reduce_again)),
      (("argmax",), PrimitiveInfo(reduce.arg_reduction("max"), local=local.arg_reduce)),
      (("argmin",), PrimitiveInfo(reduce.arg_reduction("min"), local=local.arg_reduce)),
      (("reduce",), PrimitiveInfo(reduce.variadic_reduce, local=local.reduce_again)),
      (("cumsum",), _cumulative("sum", ADDITIVE_IN_FIRST)),
      (("cumprod",), _cumulative("prod")),
      (("cummax",), _cumulative("max")),
      (("cummin",), _cumulative("min")),
      (("cumlogsumexp",), _cumulative("logaddexp")),
      (("sort",), PrimitiveInfo(sort.sort)),
      (("top_k",), PrimitiveInfo(sort.top_k)),
      (("approx_top_k",), PrimitiveInfo(sort.approx_top_k)),
      # contractions
      (("dot_general",), PrimitiveInfo(dot.dot_general, Linearity((0, 1)))),
      (("conv_general_dilated",), PrimitiveInfo(conv.conv_general_dilated, Linearity((0, 1)),
                                                local.conv)),
      # indexing, slicing, padding
      (("slice",), PrimitiveInfo(indexing.slice_, ADDITIVE_IN_FIRST, local.slice_)),
      (("pad",), PrimitiveInfo(indexing.pad, local=local.pad)),
      (("rev",), PrimitiveInfo(indexing.rev, ADDITIVE_IN_FIRST, local.rev)),
      (("concatenate",), PrimitiveInfo(indexing.concatenate, Linearity(None, additive=True),
                                       local.concatenate)),
      (("stack",), PrimitiveInfo(indexing.stack)),
      (("split",), PrimitiveInfo(inline=split_as_slices)),
      (("unstack",), PrimitiveInfo(indexing.unstack)),
      (("dynamic_slice",),
       PrimitiveInfo(indexing.dynamic_slice, ADDITIVE_IN_FIRST, local.dynamic_slice)),
      (("dynamic_update_slice",),
       PrimitiveInfo(indexing.dynamic_update_slice, local=local.dynamic_update_slice)),
      (("gather",), PrimitiveInfo(indexing.gather, ADDITIVE_IN_FIRST, local.gather)),
      (("scatter", "scatter-mul", "scatter_mul"),
       PrimitiveInfo(indexing.scatter(None), local=local.scatter)),
      (("scatter-add", "scatter_add", "scatter-sub", "scatter_sub"),
       PrimitiveInfo(indexing.scatter("sum"), local=local.scatter)),
      (("scatter-max", "scatter_max"), PrimitiveInfo(indexing.scatter("max"), local=local.scatter)),
      (("scatter-min", "scatter_min"), PrimitiveInfo(indexing.scatter("min"), local=local.scatter)),
      # windows
      (("reduce_window_sum",), PrimitiveInfo(window.reduce_window,
                                             local=local.reduce_window("sum"))),
      (("reduce_window_max",), PrimitiveInfo(window.reduce_window,
                                             local=local.reduce_window("max"))),
      (("reduce_window_min",), PrimitiveInfo(window.reduce_window,
                                             local=local.reduce_window("min"))),
      (("reduce_window",), PrimitiveInfo(window.reduce_window, local=local.reduce_window(None))),
      (("select_and_scatter_add",),
       PrimitiveInfo(window.select_and_scatter_add, local=local.select_and_scatter_add)),
      (("select_and_gather_add", "select_and_scatter"), PrimitiveInfo(window.whole_windows)),
      # random numbers
      (("random_bits",), PrimitiveInfo(random.random_bits, local=local.random_bits)),
      (("random_split",), PrimitiveInfo(random.random_split)),
      (("random_fold_in",), PrimitiveInfo(random.fold_in)),
      (("random_gamma",), PrimitiveInfo(random.gamma, local=local.random_gamma) if gamma_one()
       else PrimitiveInfo(reason="this JAX has no _gamma_one, which a device needs to draw its "
                                 "block's variates alone")),
      (("random_poisson",), PrimitiveInfo(random.poisson, local=local.random_poisson)
       if poisson_local() else PrimitiveInfo(reason="this JAX has no _poisson_impl_local, which "
                                                    "a device needs to draw its block alone")),
      (("random_wrap",), PrimitiveInfo(random.wrap)),
      (("random_unwrap",), PrimitiveInfo(random.unwrap)),
      # linear algebra and FFTs: batch dims pass
      (tuple(LINALG), PrimitiveInfo(linalg.batched(linalg.matrix))),
      (("lu_pivots_to_permutation", "tridiagonal_solve"),
       PrimitiveInfo(linalg.batched(linalg.vector))),
      (("fft",), PrimitiveInfo(linalg.batched(linalg.fft_axes))),
      # control flow and calls
      *(((name,), PrimitiveInfo(control=flow, inline=one_predicate_loop if name == "while"
                                else None)) for name, flow in CONTROL_FLOW.items()),
      *(((name,), PrimitiveInfo(inline=call_body(param))) for name, param in INLINED_CALLS.items()),
      (("custom_linear_solve",), PrimitiveInfo(inline=linear_solve_body)),
      (("call_hi_primitive",), PrimitiveInfo(inline=hi_primitive_body)),
      *(((name,), PrimitiveInfo(reason=why, stateful=name in STATEFUL,
                                local=local.on_first_device if name in DEBUG_CALLBACKS else None))
        for name, why in REPLICATED.items()),
      (("shard_map",), PrimitiveInfo(manual.rule, local=manual.lower, manual=Manual(
          manual.specs, manual.shardings, manual.collectives, manual.bind_whole),
          inline=partly_manual.region_body)),
      # over mesh axes only inside a shard_map, whose body spmd does not partition; over
      # positional axes (a partly manual region's, vmapped: partly_manual.py) a reduction
      *(((name,), PrimitiveInfo(inline=partly_manual.positional_reduction(reduce)))
        for name, reduce in (("psum", jnp.sum), ("pmax", jnp.max), ("pmin", jnp.min))),
  ]


def build_registry() -> Mapping[Primitive, PrimitiveInfo]:
  table: dict[Primitive, PrimitiveInfo] = {
      annotate_p: PrimitiveInfo(elementwise.elementwise, ADDITIVE_IN_FIRST, operands,
                                annotation=annotate_request),
      roll_p: PrimitiveInfo(indexing.roll, ADDITIVE_IN_FIRST, local.roll),
      roll_dynamic_p: PrimitiveInfo(indexing.roll_dynamic, ADDITIVE_IN_FIRST)}
  for names, info in _entries():
    for primitive in primitives_named(*names):
      if primitive in table:
        raise AssertionError(f"primitive {primitive.name} is registered twice")
      table[primitive] = info
  return table
