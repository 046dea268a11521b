"""conv_general_dilated: batch and output features pass, input features are a reduction,
grouped convs split features into (group, per-group) factors, and spatial dims with a real
window are halo factors shared by input and output (the kernel's spatial dims stay whole), or,
when the window is larger than the output (weight gradients), reductions shared by input and
window with a halo on the input."""
from __future__ import annotations

from spmd.partition.halo_geometry import Window
from spmd.partition.ir import Op
from spmd.partition.rules.factors import FactorKind, OpShardingRule, RuleBuilder

WHOLE, REDUCE = FactorKind.NEED_REPLICATION, FactorKind.REDUCTION


def conv_general_dilated(op: Op) -> OpShardingRule:
  p = op.params
  dn = p["dimension_numbers"]
  lhs, rhs, out = op.inputs[0].aval.shape, op.inputs[1].aval.shape, op.outputs[0].shape
  lhs_b, lhs_f, *lhs_sp = dn.lhs_spec
  rhs_o, rhs_i, *rhs_sp = dn.rhs_spec
  out_b, out_f, *out_sp = dn.out_spec
  groups, batch_groups = p["feature_group_count"], p["batch_group_count"]
  b = RuleBuilder()
  lhs_dims: list = [None] * len(lhs)
  rhs_dims: list = [None] * len(rhs)
  out_dims: list = [None] * len(out)

  cout_per_group = rhs[rhs_o] // (groups * batch_groups)
  group = b.factor(groups * batch_groups)
  co = b.factor(cout_per_group)
  rhs_dims[rhs_o] = out_dims[out_f] = [group, co]
  ci = b.factor(rhs[rhs_i], REDUCE)
  rhs_dims[rhs_i] = [ci]
  if batch_groups > 1:
    nb = b.factor(out[out_b])
    lhs_dims[lhs_b], out_dims[out_b] = [group, nb], [nb]
    lhs_dims[lhs_f] = [ci]
  else:
    lhs_dims[lhs_b] = out_dims[out_b] = b.factor(lhs[lhs_b])
    lhs_dims[lhs_f] = [group, ci]

  strides, padding = p["window_strides"], p["padding"]
  lhs_dil = p["lhs_dilation"]
  for i, (ld, rd, od) in enumerate(zip(lhs_sp, rhs_sp, out_sp)):
    trivial = (rhs[rd] == 1 and strides[i] == 1 and tuple(padding[i]) == (0, 0)
               and lhs_dil[i] == 1)
    if trivial:
      lhs_dims[ld] = out_dims[od] = b.factor(lhs[ld])
    elif rhs[rd] > out[od]:
      # A weight-gradient conv: the window (the cotangent's spatial dim) is the big dim. It is a
      # reduction shared with the input's dim; each device convolves its window rows with the
      # input rows they read (a halo: output positions and window swap roles) and sums.
      f = b.factor(rhs[rd], REDUCE)
      b.windowed(0, ld, Window(lhs[ld], rhs[rd], out[od], p["rhs_dilation"][i], *padding[i],
                               lhs_dil[i], strides[i]), factor=f)
      lhs_dims[ld] = rhs_dims[rd] = f
      out_dims[od] = b.factor(out[od], WHOLE)
    else:
      window = Window(lhs[ld], out[od], rhs[rd], strides[i], *padding[i], lhs_dil[i],
                      p["rhs_dilation"][i])
      lhs_dims[ld] = out_dims[od] = b.windowed(0, ld, window)
      rhs_dims[rd] = b.factor(rhs[rd], WHOLE)
  return b.build([lhs_dims, rhs_dims], [out_dims])
