"""Elementwise ops: one factor per output dim, shared by every operand that is not broadcast."""
from __future__ import annotations

from spmd.partition.ir import Op, Value
from spmd.partition.rules import register
from spmd.partition.rules.factors import OpShardingRule, RuleBuilder

UNARY = """neg sign floor ceil round is_finite exp exp2 log log1p expm1 tanh logistic sin cos tan
asin acos atan sinh cosh asinh acosh atanh sqrt rsqrt cbrt abs not erf erfc erf_inv lgamma digamma
bessel_i0e bessel_i1e imag real conj integer_pow square reduce_precision convert_element_type
population_count clz copy copy_p stop_gradient random_seed random_fold_in""".split()
BINARY = """add add_any sub mul div rem pow max min nextafter atan2 and or xor eq ne lt le gt ge
shift_left shift_right_logical shift_right_arithmetic complex igamma igammac igamma_grad_a
random_gamma_grad polygamma zeta regularized_incomplete_beta select_n clamp threefry2x32""".split()
# Identity ops that carry a user's sharding annotation (closed by the engine's seeding).
ANNOTATIONS = ["sharding_constraint", "spmd_annotate"]
# Identity ops JAX inserts under a mesh context (jnp.where, ...); on Auto axes they ask nothing.
IDENTITIES = ["reshard"]


@register(*UNARY, *BINARY, *ANNOTATIONS, *IDENTITIES)
def elementwise(op: Op) -> OpShardingRule:
  out_shape = op.outputs[0].shape
  b = RuleBuilder()
  factors = b.factors(out_shape)
  operands = [_broadcast_dims(x, out_shape, factors) for x in op.inputs]
  return b.build(operands, [factors] * len(op.outputs), pass_through=True)


@register("bitcast_convert_type")
def bitcast_convert_type(op: Op) -> OpShardingRule:
  """Same-width bitcasts are elementwise; width changes add or drop a minor dim."""
  x, out = op.inputs[0], op.outputs[0]
  rank = min(len(x.shape), len(out.shape))
  b = RuleBuilder()
  shared = b.factors(out.shape[:rank])
  operand = shared + [None] * (len(x.shape) - rank)
  result = shared + [None] * (len(out.shape) - rank)
  return b.build([operand], [result], pass_through=True)


@register("optimization_barrier")
def optimization_barrier(op: Op) -> OpShardingRule:
  b = RuleBuilder()
  per_tensor = [b.factors(v.shape) for v in op.outputs]
  return b.build([None if not isinstance(x, Value) else f for x, f in zip(op.inputs, per_tensor)],
                 per_tensor, pass_through=True)


def _broadcast_dims(x: object, out_shape: tuple[int, ...], factors: list) -> list | None:
  if not isinstance(x, Value):
    return None
  shape = x.shape
  if len(shape) != len(out_shape):
    return [None] * len(shape)  # rank-0 operands broadcast implicitly
  return [f if n == m else None for f, n, m in zip(factors, shape, out_shape)]
