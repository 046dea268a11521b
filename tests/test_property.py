"""Property test: random small JAX programs, partitioned, agree with the unpartitioned program, and
the plan moves the compiled HLO's bytes per collective kind (helpers.assert_partitioned_matches).

A program is data (``Program``): its inputs (shape, dtype, in_spec), a list of Python source lines
and its outputs, on one of three 8-device meshes. Its ``repr`` is a runnable reproducer, so a
failing example prints as code. Every dim is a power of two no larger than the shapes allow, and
every drawn spec divides the dims it shards (uneven sharding is out of scope here).

The plan describes the program spmd emits; XLA then simplifies it (common subexpressions,
``x - x``, ``abs(abs(x))``, ``slice(concatenate(...))``, on integers ``(x + y) - x``), which merges
or deletes collectives that feed equal or unused values. So the generator never writes one computation twice (up to views:
reshape, broadcast, transpose, annotate) nor such foldable forms: a plan/HLO difference is then
the partitioner's. Annotations are not deduplicated: the partitioner itself must handle those.

Profiles: ``ci`` (default: 40 derandomized examples) and ``thorough`` (10,000 random examples,
about 40 minutes on 2 cores), one command:
``SPMD_HYPOTHESIS_PROFILE=thorough python -m pytest tests/test_property.py --hypothesis-show-statistics``.
"""
from __future__ import annotations

import math
import os
import re
from dataclasses import dataclass, field
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jax.sharding import PartitionSpec as P

import spmd
from helpers import MESH_AXES, MESH_NAMES, assert_partitioned_matches

settings.register_profile("ci", max_examples=40, deadline=None, derandomize=True,
                          suppress_health_check=[HealthCheck.too_slow], print_blob=True)
settings.register_profile("thorough", max_examples=10_000, deadline=None,
                          suppress_health_check=[HealthCheck.too_slow], print_blob=True)
settings.load_profile(os.environ.get("SPMD_HYPOTHESIS_PROFILE", "ci"))

DIMS = (1, 2, 4, 8, 16)
MAX_RANK = 4
MAX_SIZE = 4096     # elements per value
MAX_INPUTS = 3
MAX_OPS = 6
LETTERS = "abcdefghijklmnopqrstuvwxyz"


# --- programs as data ----------------------------------------------------------------------------


def spec_src(spec: P | None) -> str:
  """``spec`` as Python source (``P('a', ('b', 'c'), None)``)."""
  if spec is None:
    return "None"

  def entry(e: Any) -> str:
    if e is P.UNCONSTRAINED:
      return "P.UNCONSTRAINED"
    return repr(e)

  return "P(" + ", ".join(entry(e) for e in spec) + ")"


def _tuple_src(specs: tuple[P | None, ...], single: bool = False) -> str:
  if single:
    return spec_src(specs[0])
  return "(" + ", ".join(spec_src(s) for s in specs) + ("," if len(specs) == 1 else "") + ")"


@dataclass(frozen=True)
class Input:
  name: str
  shape: tuple[int, ...]
  dtype: str
  spec: P | None


@dataclass(frozen=True)
class Program:
  """A random program: inputs, source lines (``v3 = jnp.tanh(x0)``), outputs, mesh, specs."""

  mesh: str
  inputs: tuple[Input, ...]
  lines: tuple[str, ...]
  outputs: tuple[str, ...]
  shapes: tuple[tuple[str, tuple[int, ...], str], ...]   # (name, shape, dtype) of every value
  out_specs: tuple[P | None, ...] | None
  seed: int

  def body(self) -> str:
    params = ", ".join(x.name for x in self.inputs)
    ret = self.outputs[0] if len(self.outputs) == 1 else "(" + ", ".join(self.outputs) + ")"
    return "\n".join([f"def f({params}):", *(f"  {line}" for line in self.lines),
                      f"  return {ret}"])

  def in_specs(self) -> tuple[P | None, ...]:
    return tuple(x.spec for x in self.inputs)

  def partition_kwargs(self) -> dict[str, Any]:
    kwargs: dict[str, Any] = {"in_specs": self.in_specs()}
    if self.out_specs is not None:
      kwargs["out_specs"] = (self.out_specs[0] if len(self.outputs) == 1 else self.out_specs)
    return kwargs

  def fn(self) -> Callable:
    scope: dict[str, Any] = {"jnp": jnp, "jax": jax, "spmd": spmd, "P": P}
    exec(compile(self.body(), "<random program>", "exec"), scope)  # noqa: S102
    return scope["f"]

  def arg_src(self, x: Input) -> str:
    """The expression (over ``rng``) that makes input ``x``: small ints, or floats in [-1, 1]."""
    if x.dtype == "int32":
      return f"jnp.asarray(rng.integers(-3, 4, {x.shape}, dtype=np.int32))"
    return f"jnp.asarray(rng.uniform(-1, 1, {x.shape}).astype(np.float32))"

  def args(self) -> list[jax.Array]:
    scope = {"rng": np.random.default_rng(self.seed), "np": np, "jnp": jnp}
    return [eval(self.arg_src(x), scope) for x in self.inputs]  # noqa: S307

  def __repr__(self) -> str:
    """A runnable reproducer (with ``import numpy as np, jax, jax.numpy as jnp, spmd`` and
    ``from jax.sharding import PartitionSpec as P``)."""
    names = ", ".join(x.name for x in self.inputs)
    lines = [self.body(), f"mesh = spmd.make_mesh({MESH_AXES[self.mesh]})",
             f"g = spmd.partition(f, mesh=mesh, in_specs={_tuple_src(self.in_specs())}"
             + ("" if self.out_specs is None else
                f", out_specs={_tuple_src(self.out_specs, len(self.outputs) == 1)}") + ")",
             f"rng = np.random.default_rng({self.seed})",
             *(f"{x.name} = {self.arg_src(x)}" for x in self.inputs),
             f"out, want = g({names}), f({names})"]
    return "\n" + "\n".join(lines)

  def _repr_pretty_(self, p: Any, cycle: bool) -> None:  # how hypothesis prints an example
    p.text(repr(self))


# --- the generator -------------------------------------------------------------------------------


def _size(shape: tuple[int, ...]) -> int:
  return math.prod(shape)


def _fits(shape: tuple[int, ...]) -> bool:
  return len(shape) <= MAX_RANK and _size(shape) <= MAX_SIZE


def _promote(*dtypes: str) -> str:
  return "float32" if "float32" in dtypes else "int32"


def _broadcast_shape(a: tuple[int, ...], b: tuple[int, ...]) -> tuple[int, ...] | None:
  n = max(len(a), len(b))
  a, b = (1,) * (n - len(a)) + a, (1,) * (n - len(b)) + b
  out = []
  for x, y in zip(a, b):
    if x != y and 1 not in (x, y):
      return None
    out.append(max(x, y))
  return tuple(out)


def draw_spec(draw: Callable, shape: tuple[int, ...], mesh: dict[str, int],
              unconstrained: bool = False) -> P:
  """A valid spec: each mesh axis at most once, its axes' product dividing the dim it shards."""
  dims: list[list[str]] = [[] for _ in shape]
  for axis in draw(st.permutations(list(mesh))):
    options = [None] + [d for d, n in enumerate(shape)
                        if n % (math.prod(mesh[a] for a in dims[d]) * mesh[axis]) == 0]
    d = draw(st.sampled_from(options))
    if d is not None:
      dims[d].append(axis)
  entries: list[Any] = []
  for axes in dims:
    if not axes:
      entries.append(P.UNCONSTRAINED if unconstrained and draw(st.booleans()) else None)
    elif len(axes) == 1 and draw(st.integers(0, 3)):
      entries.append(axes[0])
    else:
      entries.append(tuple(axes))
  while entries and entries[-1] is None and draw(st.booleans()):
    entries.pop()  # trailing Nones may be left out
  return P(*entries)


@dataclass
class _Builder:
  """Tracks the values of a program being drawn (name -> shape, dtype) and its source lines."""

  draw: Callable
  mesh: dict[str, int]
  dtype: str
  inputs: list[Input] = field(default_factory=list)
  values: dict[str, tuple[tuple[int, ...], str]] = field(default_factory=dict)
  data: dict[str, str] = field(default_factory=dict)  # value -> root: the value it is a view of
  unary: dict[str, str] = field(default_factory=dict)  # value -> the unary template that made it
  made_by: dict[str, str] = field(default_factory=dict)  # value -> the OPS entry that made it
  summands: dict[str, frozenset[str]] = field(default_factory=dict)  # int sum -> roots it adds
  sigs: set[tuple] = field(default_factory=set)  # what each value computes, up to views
  # value -> for each of its dims the root's dim it is (None: a dim of 1 the view inserted), for
  # views that only permute the root's dims and add or drop dims of 1; absent: unknown
  dims_in_root: dict[str, tuple[int | None, ...]] = field(default_factory=dict)
  lines: list[str] = field(default_factory=list)
  last: str = ""

  def fresh_input(self, shape: tuple[int, ...], dtype: str | None = None) -> str | None:
    if len(self.inputs) >= MAX_INPUTS or not _fits(shape):
      return None
    name = f"x{len(self.inputs)}"
    draw = self.draw
    spec = None if not draw(st.integers(0, 7)) else draw_spec(draw, shape, self.mesh)
    self.inputs.append(Input(name, shape, dtype or self.dtype, spec))
    self.values[name] = (shape, dtype or self.dtype)
    return name

  def emit(self, expr: str, shape: tuple[int, ...], dtype: str, view_of: str = "",
           sig: tuple | None = None, any_shape: bool = False,
           dims_in_root: tuple[int | None, ...] | None = None) -> str | None:
    """Appends ``name = expr``; ``view_of``: a value it holds the elements of (reshape, broadcast,
    transpose, annotate), ``dims_in_root`` its dims as its root's where known. ``sig`` says what
    it computes in terms of roots (values up to views): a second line with the same ``sig`` (and
    shape, unless ``any_shape``: results that are views of one another) is refused (None). XLA
    would find the two lines equal (CSE, after folding views) and merge the collectives that
    feed them, so the HLO would move less than the plan says: a duplicate in the program, not a
    fault of the partitioner."""
    if sig is not None:
      key = sig if any_shape else (sig, shape)
      if key in self.sigs:
        return None
      self.sigs.add(key)
    name = f"v{len(self.values)}"
    self.lines.append(f"{name} = {expr}")
    self.values[name] = (shape, dtype)
    self.data[name] = self.root(view_of) if view_of else name
    if view_of and dims_in_root is not None:
      self.dims_in_root[name] = dims_in_root
    self.last = name
    return name

  def pick(self) -> str:
    """A value to operate on, most often the latest."""
    if self.draw(st.integers(0, 2)):
      return self.last
    return self.draw(st.sampled_from(sorted(self.values)))

  def root(self, name: str) -> str:
    return self.data.get(name, name)

  def root_dims(self, name: str) -> tuple[int | None, ...] | None:
    """``name``'s dims as its root's (``dims_in_root``); None where that is unknown."""
    if self.root(name) == name:
      return tuple(range(len(self.shape(name))))
    return self.dims_in_root.get(name)

  def terms(self, name: str) -> frozenset[str]:
    """The roots an integer value adds up, through sums of sums: ``{a, b}`` for ``(a + 1) - b``."""
    root = self.root(name)
    return self.summands.get(root, frozenset()) | {root}

  def add_sum(self, name: str | None, *operands: str) -> str | None:
    """Records ``name``, an integer sum or difference of ``operands`` (and literals), in
    ``summands``. XLA's simplifier cancels a summand on integers (``(a + b) - a`` is ``b``,
    ``(a + 1) - a`` is ``1``), which leaves the collectives that fed it dead."""
    if name is not None and self.dtype_of(name) == "int32":
      self.summands[name] = frozenset().union(*(self.terms(o) for o in operands))
    return name

  def shape(self, name: str) -> tuple[int, ...]:
    return self.values[name][0]

  def dtype_of(self, name: str) -> str:
    return self.values[name][1]

  def other(self, fits: Callable[[tuple[int, ...], str], bool],
            make: Callable[[], tuple[int, ...] | None]) -> str | None:
    """An operand: an existing value whose (shape, dtype) ``fits``, or a fresh input."""
    existing = sorted(n for n, (s, d) in self.values.items() if fits(s, d))
    choices = ["existing"] * bool(existing) + ["fresh"] * (len(self.inputs) < MAX_INPUTS)
    if not choices:
      return None
    if self.draw(st.sampled_from(choices)) == "existing":
      return self.draw(st.sampled_from(existing))
    shape = make()
    return None if shape is None else self.fresh_input(shape)


# Each op takes the builder and appends one line, or returns None when it does not apply.

# sin and cos read their argument through tanh: of a cumulative sum along 4,096 elements (values
# near 2,000) float32 rounding alone, in another summation order, moves them by more than the
# tolerance (seed 40 drew sin(cumsum(cummax(x)))): an outcome that hangs on rounding
FLOAT_UNARY = ("jnp.tanh({})", "jnp.sin(jnp.tanh({}))", "jnp.cos(jnp.tanh({}))", "-{}",
               "jnp.abs({})", "{} * 2", "jnp.square({})", "jax.nn.relu({})")
FOLDED_UNARY = ("jnp.abs({})", "jax.nn.relu({})", "-{}")  # f(f(y)) is f(y) or y
INT_UNARY = ("-{}", "jnp.abs({})", "{} * 3", "{} + 1", "jnp.square({})")
BINARY = ("{} + {}", "{} - {}", "{} * {}", "jnp.maximum({}, {})", "jnp.minimum({}, {})")
FOLDED = ("{} - {}", "jnp.maximum({}, {})", "jnp.minimum({}, {})")  # trivial on equal operands
SUMS = ("{} + {}", "{} - {}")
COMMUTATIVE = ("{} + {}", "{} * {}", "jnp.maximum({}, {})", "jnp.minimum({}, {})")


def op_unary(b: _Builder) -> str | None:
  x = b.pick()
  dtype = b.dtype_of(x)
  if dtype == "int32" and b.draw(st.integers(0, 5)) == 0:
    return b.emit(f"{x}.astype(jnp.float32)", b.shape(x), "float32", sig=("astype", b.root(x)))
  template = b.draw(st.sampled_from(FLOAT_UNARY if dtype == "float32" else INT_UNARY))
  if b.unary.get(b.root(x)) == template and template in FOLDED_UNARY:
    return None  # XLA folds abs(abs(y)) to abs(y) and -(-y) to y: a duplicate (see emit)
  name = b.emit(template.format(x), b.shape(x), dtype, sig=(template, b.root(x)))
  if name:
    b.unary[name] = template
  return b.add_sum(name, x) if template == "{} + 1" else name


def op_binary(b: _Builder) -> str | None:
  x = b.pick()
  sx, draw = b.shape(x), b.draw
  template = draw(st.sampled_from(BINARY))
  if draw(st.integers(0, 5)) == 0:  # a scalar literal
    literal = "0.5" if b.dtype_of(x) == "float32" else "2"
    name = b.emit(template.format(x, literal), sx, b.dtype_of(x),
                  sig=(template, b.root(x), literal))
    return b.add_sum(name, x) if template in SUMS else name

  def fits(s: tuple[int, ...], d: str) -> bool:
    out = _broadcast_shape(sx, s)
    return out is not None and _fits(out)

  def make() -> tuple[int, ...]:
    # x's shape with some dims set to 1 (or size-1 dims grown), maybe without leading dims
    shape = [draw(st.sampled_from([n, 1])) if n > 1 else draw(st.sampled_from(DIMS)) for n in sx]
    drop = draw(st.integers(0, len(shape)))
    return tuple(shape[drop:])

  y = b.other(fits, make)
  if y is None:
    return None
  if draw(st.booleans()):
    x, y = y, x
  if b.root(x) == b.root(y) and template in FOLDED:
    # x - x, max(x, x): XLA folds these, and the two collectives that fed them become one
    # (common-subexpression elimination), so the HLO would move less than the plan says
    template = "{} + {}"
  dtype = _promote(b.dtype_of(x), b.dtype_of(y))
  if (template in SUMS and dtype == "int32" and b.root(x) != b.root(y)
      and b.terms(x) & b.terms(y)):
    return None  # (a + b) - a, (a - b) + b on integers: XLA cancels a summand (see add_sum)
  out = _broadcast_shape(b.shape(x), b.shape(y))
  if out is None or not _fits(out):
    return None
  roots = (b.root(x), b.root(y))
  sig = (template, *(sorted(roots) if template in COMMUTATIVE else roots))
  name = b.emit(template.format(x, y), out, dtype, sig=sig)
  return b.add_sum(name, x, y) if template in SUMS else name


def op_broadcast(b: _Builder) -> str | None:
  x = b.pick()
  sx, draw = b.shape(x), b.draw
  if draw(st.booleans()):
    axis = draw(st.integers(0, len(sx)))
    out = sx[:axis] + (1,) + sx[axis:]
    if not _fits(out):
      return None
    rd = b.root_dims(x)
    return b.emit(f"jnp.expand_dims({x}, {axis})", out, b.dtype_of(x), x, sig=("view", b.root(x)),
                  dims_in_root=None if rd is None else rd[:axis] + (None,) + rd[axis:])
  lead = tuple(draw(st.lists(st.sampled_from(DIMS), max_size=2)))
  out = lead + tuple(draw(st.sampled_from(DIMS)) if n == 1 else n for n in sx)
  if not _fits(out):
    return None
  return b.emit(f"jnp.broadcast_to({x}, {out})", out, b.dtype_of(x), x, sig=("view", b.root(x)))


def _powers_of_two_splitting(total: int, rank: int, draw: Callable) -> tuple[int, ...]:
  """A shape of ``rank`` power-of-two dims with product ``total`` (a power of two)."""
  exps = [0] * rank
  for _ in range(int(math.log2(total))):
    exps[draw(st.integers(0, rank - 1))] += 1
  return tuple(2 ** e for e in exps)


def op_reshape(b: _Builder) -> str | None:
  x = b.pick()
  sx, draw = b.shape(x), b.draw
  kind = draw(st.sampled_from(["merge", "split", "regroup"]))
  if kind == "merge":
    if len(sx) < 2:
      return None
    i = draw(st.integers(0, len(sx) - 2))
    out = sx[:i] + (sx[i] * sx[i + 1],) + sx[i + 2:]
  elif kind == "split":
    if not sx:
      return None
    i = draw(st.integers(0, len(sx) - 1))
    p = draw(st.sampled_from([d for d in DIMS if sx[i] % d == 0]))
    out = sx[:i] + (p, sx[i] // p) + sx[i + 1:]
  else:
    out = _powers_of_two_splitting(_size(sx), draw(st.integers(1, MAX_RANK)), draw)
  if not _fits(out) or out == sx:
    return None
  return b.emit(f"{x}.reshape({out})", out, b.dtype_of(x), x, sig=("view", b.root(x)),
                dims_in_root=_reshaped_dims(b.root_dims(x), sx, out))


def _reshaped_dims(rd: tuple[int | None, ...] | None, before: tuple[int, ...],
                   after: tuple[int, ...]) -> tuple[int | None, ...] | None:
  """The root dims of a reshape's result, where it only adds or drops dims of 1."""
  if rd is None or [n for n in before if n > 1] != [n for n in after if n > 1]:
    return None
  kept = iter(r for r, n in zip(rd, before) if n > 1)
  return tuple(next(kept) if n > 1 else None for n in after)


def op_transpose(b: _Builder) -> str | None:
  x = b.pick()
  sx = b.shape(x)
  if len(sx) < 2:
    return None
  perm = tuple(b.draw(st.permutations(range(len(sx)))))
  if perm == tuple(range(len(sx))):
    return None
  rd = b.root_dims(x)
  return b.emit(f"jnp.transpose({x}, {perm})", tuple(sx[p] for p in perm), b.dtype_of(x), x,
                sig=("view", b.root(x)),
                dims_in_root=None if rd is None else tuple(rd[p] for p in perm))


def op_dot(b: _Builder) -> str | None:
  """An einsum: contracting and batch dims paired by size, free (or summed) dims on either side."""
  lhs = b.pick()
  sl, draw = b.shape(lhs), b.draw
  if not sl:
    return None
  roles = [draw(st.sampled_from(["contract", "contract", "batch", "free", "sum"])) for _ in sl]
  if b.draw(st.booleans()) and len(b.inputs) < MAX_INPUTS:
    paired = [d for d, r in enumerate(sl) if roles[d] in ("contract", "batch")]
    extra = draw(st.lists(st.sampled_from(DIMS), max_size=2))
    rhs_dims: list[Any] = paired + [("new", k) for k in range(len(extra))]
    rhs_dims = draw(st.permutations(rhs_dims))
    rhs_shape = tuple(sl[d] if isinstance(d, int) else extra[d[1]] for d in rhs_dims)
    rhs = b.fresh_input(rhs_shape)
    if rhs is None:
      return None
    pairs = {d: j for j, d in enumerate(rhs_dims) if isinstance(d, int)}
  else:
    rhs = draw(st.sampled_from(sorted(b.values)))
    sr = b.shape(rhs)
    pairs = {}
    for d in draw(st.permutations(range(len(sl)))):
      if roles[d] not in ("contract", "batch"):
        continue
      options = [j for j, n in enumerate(sr) if n == sl[d] and j not in pairs.values()]
      if options:
        pairs[d] = draw(st.sampled_from(options))
      else:
        roles[d] = "free"
  sr = b.shape(rhs)
  lhs_idx = LETTERS[:len(sl)]
  rhs_idx = [""] * len(sr)
  fresh = iter(LETTERS[len(sl):])
  for d, j in pairs.items():
    rhs_idx[j] = lhs_idx[d]
  for j in range(len(sr)):
    rhs_idx[j] = rhs_idx[j] or next(fresh)
  out_idx = ([lhs_idx[d] for d in range(len(sl)) if roles[d] == "batch" and d in pairs]
             + [lhs_idx[d] for d in range(len(sl)) if roles[d] == "free" or
                (roles[d] == "batch" and d not in pairs)]
             + [i for i in rhs_idx if i not in lhs_idx])
  if draw(st.booleans()):
    out_idx = draw(st.permutations(out_idx))
  sizes = {**dict(zip(lhs_idx, sl)), **dict(zip(rhs_idx, sr))}
  out = tuple(sizes[i] for i in out_idx)
  if not _fits(out):
    return None
  spec = f"{lhs_idx},{''.join(rhs_idx)}->{''.join(out_idx)}"
  dtype = _promote(b.dtype_of(lhs), b.dtype_of(rhs))
  return b.emit(f"jnp.einsum({spec!r}, {lhs}, {rhs})", out, dtype,
                sig=("dot", *sorted((b.root(lhs), b.root(rhs)))))


def op_reduce(b: _Builder) -> str | None:
  x = b.pick()
  sx, draw = b.shape(x), b.draw
  if not sx:
    return None
  fn = draw(st.sampled_from(["sum", "max", "min", "mean"]))
  axes = tuple(sorted(draw(st.sets(st.integers(0, len(sx) - 1), min_size=1))))
  keepdims = draw(st.booleans())
  out = tuple((1 if keepdims else None) if d in axes else n for d, n in enumerate(sx))
  out = tuple(n for n in out if n is not None)
  dtype = "float32" if fn == "mean" else b.dtype_of(x)
  axis = axes[0] if len(axes) == 1 else axes
  expr = f"jnp.{fn}({x}, axis={axis}{', keepdims=True' if keepdims else ''})"
  if all(sx[d] == 1 for d in axes):  # over size-1 dims only: XLA folds it to a reshape
    return b.emit(expr, out, dtype, x, sig=("view", b.root(x)),
                  dims_in_root=_reshaped_dims(b.root_dims(x), sx, out))
  if _size(out) == 1:  # every element of x, so of any view of x: the same value
    return b.emit(expr, out, dtype, sig=("reduce-all", fn, b.root(x)), any_shape=True)
  rd = b.root_dims(x)
  if rd is not None:  # over the same root dims of any view that only permutes them: one value
    over = frozenset(rd[d] for d in axes if rd[d] is not None)
    return b.emit(expr, out, dtype, sig=(fn, b.root(x), over), any_shape=True)
  return b.emit(expr, out, dtype, sig=(fn, x, axes))


ALONG = {"sort": "jnp.sort({}, axis={})", "cumsum": "jnp.cumsum({}, axis={})",
         "cummax": "jax.lax.cummax({}, axis={})", "argmax": "jnp.argmax({}, axis={})",
         "argmin": "jnp.argmin({}, axis={})"}


def op_along(b: _Builder) -> str | None:
  """A sort, a cumulative op or an arg-reduction along one dim longer than 1 (along a sharded
  dim their rules move its axes to another dim, scan each block, or gather partial results)."""
  x = b.pick()
  sx, draw = b.shape(x), b.draw
  dims = [d for d, n in enumerate(sx) if n > 1]
  if not dims:
    return None
  fn, axis = draw(st.sampled_from(sorted(ALONG))), draw(st.sampled_from(dims))
  expr = ALONG[fn].format(x, axis)
  out, dtype = (sx[:axis] + sx[axis + 1:], "int32") if fn.startswith("arg") else (sx, b.dtype_of(x))
  rd = b.root_dims(x)
  if rd is not None:  # along the same root dim of any view that only permutes dims: one value
    return b.emit(expr, out, dtype, sig=(fn, b.root(x), "root dim", rd[axis]), any_shape=True)
  return b.emit(expr, out, dtype, sig=(fn, b.root(x), axis))


def op_slice(b: _Builder) -> str | None:
  x = b.pick()
  sx, draw = b.shape(x), b.draw
  if not sx or all(n == 1 for n in sx) or b.made_by.get(b.root(x)) == "concatenate":
    # XLA folds slice(concatenate(...)) into slices of the operands: the collectives of an
    # operand the slice misses are dead code to it, so the HLO would move less than planned
    return None
  parts, out = [], []
  for n in sx:
    kind = draw(st.sampled_from(["all", "range", "step", "odd", "index"])) if n > 1 else "all"
    if kind == "range":
      length = draw(st.sampled_from([d for d in DIMS if d < n]))
      start = draw(st.integers(0, n - length))
      parts.append(f"{start}:{start + length}")
      out.append(length)
    elif kind == "step":
      parts.append("::2")
      out.append(n // 2)
    elif kind == "odd":
      parts.append("1::2")
      out.append(n // 2)
    elif kind == "index":
      parts.append(str(draw(st.integers(0, n - 1))))
    else:
      parts.append(":")
      out.append(n)
  if all(p == ":" for p in parts):
    return None
  while parts and parts[-1] == ":":
    parts.pop()
  return b.emit(f"{x}[{', '.join(parts)}]", tuple(out), b.dtype_of(x), sig=("slice", b.root(x), *parts))


def op_concatenate(b: _Builder) -> str | None:
  x = b.pick()
  sx, draw = b.shape(x), b.draw
  if not sx:
    return None
  axis = draw(st.integers(0, len(sx) - 1))
  n = sx[axis]
  sizes = [n] if n == 1 or draw(st.booleans()) else [n // 2, n // 2]
  parts = [x]
  for size in sizes:
    want = sx[:axis] + (size,) + sx[axis + 1:]
    part = b.other(lambda s, d, want=want: s == want, lambda want=want: want)
    if part is None:
      return None
    parts.append(part)
  out = sx[:axis] + (2 * n,) + sx[axis + 1:]
  if not _fits(out):
    return None
  parts = draw(st.permutations(parts))
  dtype = _promote(*(b.dtype_of(p) for p in parts))
  return b.emit(f"jnp.concatenate([{', '.join(parts)}], axis={axis})", out, dtype,
                sig=("concatenate", *(b.root(p) for p in parts)))


INDEXING = {
    "take": "jnp.take({x}, {k}, axis={axis})",
    "vmap_index": "jax.vmap(lambda j: jax.lax.dynamic_index_in_dim({x}, j, {axis}, False))({k})",
    "vmap_slice": "jax.vmap(lambda j: jax.lax.dynamic_slice_in_dim({x}, j, {size}, {axis}))({k})",
}


def op_index(b: _Builder) -> str | None:
  """Rows along one dim at literal indices: ``jnp.take``, or ``jax.vmap`` of an index or a
  dynamic slice by them (a gather indexing every dim, the others by slices of the whole dim)."""
  x = b.pick()
  sx, draw = b.shape(x), b.draw
  if not sx or b.made_by.get(b.root(x)) == "concatenate":
    return None  # XLA makes rows at constant indices slices, then slices of the pieces (op_slice)
  kind, axis = draw(st.sampled_from(sorted(INDEXING))), draw(st.integers(0, len(sx) - 1))
  size = draw(st.sampled_from([d for d in DIMS if d <= sx[axis]])) if kind == "vmap_slice" else 1
  count = draw(st.sampled_from(DIMS[:4]))
  rows = tuple(draw(st.lists(st.integers(0, sx[axis] - size), min_size=count, max_size=count)))
  if rows == tuple(range(0, sx[axis], size)):  # every row once, in order: XLA makes it a view
    return None
  rest = sx[:axis] + sx[axis + 1:]
  out = {"take": sx[:axis] + (count,) + sx[axis + 1:], "vmap_index": (count, *rest),
         "vmap_slice": (count, *sx[:axis], size, *sx[axis + 1:])}[kind]
  if not _fits(out):
    return None
  expr = INDEXING[kind].format(x=x, k=f"jnp.array({list(rows)}, jnp.int32)", axis=axis, size=size)
  rd = b.root_dims(x)
  where = ("root dim", rd[axis]) if rd is not None else (axis,)
  return b.emit(expr, out, b.dtype_of(x), sig=(kind, b.root(x), *where, rows, size),
                any_shape=rd is not None)


def op_annotate(b: _Builder) -> str | None:
  x = b.pick()
  spec = draw_spec(b.draw, b.shape(x), b.mesh, unconstrained=True)
  return b.emit(f"spmd.annotate({x}, {spec_src(spec)})", b.shape(x), b.dtype_of(x), x,
                dims_in_root=b.root_dims(x))


OPS: dict[str, Callable[[_Builder], str | None]] = {
    "unary": op_unary, "binary": op_binary, "broadcast": op_broadcast, "reshape": op_reshape,
    "transpose": op_transpose, "dot": op_dot, "reduce": op_reduce, "slice": op_slice,
    "concatenate": op_concatenate, "annotate": op_annotate, "along": op_along, "index": op_index,
}


@st.composite
def programs(draw: Callable) -> Program:
  mesh_name = draw(st.sampled_from(sorted(MESH_NAMES)))
  mesh = MESH_AXES[mesh_name]
  dtype = "int32" if draw(st.integers(0, 4)) == 0 else "float32"
  b = _Builder(draw, mesh, dtype)
  rank = draw(st.integers(1, 3))
  b.fresh_input(tuple(draw(st.lists(st.sampled_from(DIMS), min_size=rank, max_size=rank))))
  b.last = "x0"
  n_ops = draw(st.integers(2, MAX_OPS))
  done = attempts = 0
  while done < n_ops and attempts < 3 * n_ops:
    attempts += 1
    kind = draw(st.sampled_from(sorted(OPS)))
    name = OPS[kind](b)
    if name is not None:
      b.made_by[name] = kind
      done += 1
  # every value no later line reads is an output (so no op is dead code), the latest first
  used = {n for line in b.lines for n in re.findall(r"\b[vx]\d+\b", line.split(" = ", 1)[1])}
  outputs = [b.last] + [n for n in b.values if n.startswith("v") and n not in used | {b.last}]
  if draw(st.integers(0, 4)) == 0:
    extra = draw(st.sampled_from(sorted(b.values)))
    if extra not in outputs:
      outputs.append(extra)
  out_specs = None
  if draw(st.integers(0, 4)) == 0:
    out_specs = tuple(None if not draw(st.integers(0, 3)) else draw_spec(draw, b.shape(o), mesh)
                      for o in outputs)
  shapes = tuple((n, s, d) for n, (s, d) in b.values.items())
  return Program(mesh_name, tuple(b.inputs), tuple(b.lines), tuple(outputs), shapes, out_specs,
                 draw(st.integers(0, 2 ** 16)))


# --- the properties ------------------------------------------------------------------------------


def check_program(prog: Program) -> None:
  """The generator's shapes are JAX's; then ``assert_partitioned_matches`` against the jitted
  program (floats to 1e-4 of their magnitude: random sums may cancel)."""
  fn, args = prog.fn(), prog.args()
  traced = jax.eval_shape(fn, *args)   # the generator's own shape bookkeeping
  want_shapes = {n: (s, d) for n, s, d in prog.shapes}
  for name, out in zip(prog.outputs, jax.tree.leaves(traced)):
    assert (tuple(out.shape), str(out.dtype)) == want_shapes[name], f"generator bug: {name}"
  assert_partitioned_matches(fn, args, mesh=prog.mesh, rtol=1e-4, atol=1e-4,
                             atol_per_magnitude=True, reference=jax.jit(fn),
                             **prog.partition_kwargs())


@given(programs())
def test_random_programs(prog: Program) -> None:
  check_program(prog)
