"""Which primitives a pending partial sum may flow through, so the psum can wait.

``additive``: f(a1 + a2, b1 + b2) = f(a1, b1) + f(a2, b2) over the listed operands jointly (they must
all be partial over the same axes). Otherwise f is linear in each listed operand on its own (only
one of them may be partial, the rest are whole values).
"""
from __future__ import annotations

ADDITIVE: dict[str, tuple[int, ...]] = {
    **{p: (0, 1) for p in ("add", "sub", "add_any")},
    **{p: (0,) for p in ("neg", "copy", "copy_p", "transpose", "reshape", "broadcast_in_dim",
                         "squeeze", "expand_dims", "reduce_sum", "slice", "rev", "real", "imag",
                         "conj", "cumsum", "dynamic_slice", "gather")},
    "select_n": (1, 2),
    "concatenate": (),  # every operand: filled in by linearity()
}
LINEAR_EACH: dict[str, tuple[int, ...]] = {
    "mul": (0, 1), "dot_general": (0, 1), "conv_general_dilated": (0, 1), "div": (0,),
}
# convert_element_type: only from a float to an equal or wider float (narrowing each partial
# sum before adding them would round several times where the program rounds once).
FLOAT_ONLY = {"convert_element_type": (0,)}


def linearity(primitive: str, num_inputs: int, widening_float: bool) -> tuple[tuple[int, ...], bool]:
  """(operand positions, additive) for ``primitive``; ``((), False)`` if sums must be done first."""
  if primitive == "concatenate":
    return tuple(range(num_inputs)), True
  if primitive in ADDITIVE:
    return ADDITIVE[primitive], True
  if primitive in LINEAR_EACH:
    return LINEAR_EACH[primitive], False
  if primitive in FLOAT_ONLY and widening_float:
    return FLOAT_ONLY[primitive], True
  return (), False
