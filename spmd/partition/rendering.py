"""The public Plan of a schedule: one row per op (its sharding, where it came from, the
collectives it causes, with bytes and trip counts), the boundary's rows, and the warnings."""
from __future__ import annotations

import dataclasses
import functools
from typing import TYPE_CHECKING, Any, Sequence

from jax.tree_util import tree_unflatten

from spmd.partition.halo_geometry import Exchange, Hop, joint
from spmd.partition.ir import Op, Program, Value, layer
from spmd.partition.manual import BodyCollective
from spmd.partition.primitives import describe
from spmd.partition.propagate import Origin, Propagation
from spmd.partition.rules.factors import FactorKind
from spmd.partition.schedule import Schedule, ScheduledOp, Transfer
from spmd.partition.sharding import MeshShape, TensorSharding
from spmd.partition.trips import Copies, copy_counts, region_copies
from spmd.plan import Collective, HaloExchange, Plan, PlanRow

if TYPE_CHECKING:
  from spmd.partition.planner import Boundary


def render_plan(program: Program, prop: Propagation, sched: Schedule, boundary: Boundary,
                wanted: tuple[TensorSharding, ...], mesh: MeshShape, backend: str, name: str,
                in_tree: Any, out_tree: Any) -> Plan:
  """``wanted``: the sharding each output had before it was made even (``sched.outputs``)."""
  exits = {t.slot.index: t for t in sched.exit}
  warnings = [_uneven_output_warning(k, atom, wanted[k], sched.outputs[k], exits.get(k), boundary,
                                     mesh)
              for k, atom in enumerate(program.outputs)
              if sched.outputs[k] != wanted[k]
              and (boundary.outputs[k] is not None or _gathered(exits.get(k)))]
  producers = _producers(program, boundary)
  copies = copy_counts(program)
  annotations = {op.outputs[0]: op for op in program.all_ops()
                 if op.outputs and op.outputs[0] in sched.aliases and op not in sched.duplicates}
  by_op: dict[int, list[Collective]] = {}
  hoisted: dict[Op, list[Transfer]] = {}  # a loop body op -> its reshards run before the loop
  for s in sched.walk():
    outer = copies[s.op.index]
    inner = region_copies(s.op, outer)
    by_op.setdefault(s.op.index, [])
    for t in s.transfers:
      if t.reader is not None:
        hoisted.setdefault(t.reader, []).append(t)
      owner = _caused_by(t.value, t, annotations, prop) or t.reader or s.op
      by_op.setdefault(owner.index, []).extend(_placed(_collectives(t, owner), outer))
    by_op[s.op.index] += _placed(
        [c for r in s.regions for t in r.exit for c in _collectives(t, s.op)], inner)
    by_op[s.op.index] += _placed([_halo_collective(h, hop, b, s) for h, hop, b in s.halo_hops],
                                 outer)
    by_op[s.op.index] += [_body_collective(b, s.op, n) for b in s.body_collectives for n in outer]
    if s.gathered:
      by_op[s.op.index] += _placed([_partials_collective(s)], outer)
    if s.execution is not None and s.op not in prop.unsupported:
      warnings.extend(_whole_dim_warnings(s, [*s.transfers, *hoisted.get(s.op, ())],
                                          prop.shardings))
  for op in program.all_ops():
    if op.index in by_op and any(c.trips is None for c in by_op[op.index]):
      warnings.append(f"op {op.index} ({op.primitive} at {op.source}) communicates inside a while "
                      "loop whose trip count is unknown: per-step bytes count one iteration")
  rows = [_row(op, depth, prop, producers, by_op.get(op.index, []))
          for op, depth in program.nested_ops]
  for t in sched.entry:
    k = t.slot.index
    cols = tuple(_collectives(t, None))
    committed = boundary.arrivals[k] is not None
    why = "committed" if committed else "returned unchanged, in an even form"
    rows.append(PlanRow(len(rows), f"input[{k}]", "in_specs", 0, (_shape(t.value),),
                        (str(t.dst),), (f"arrives as {t.src} ({why})",), cols))
    if committed:
      warnings.append(f"argument {boundary.input_names[k]} arrives committed as {t.src} but "
                      f"in_specs asks for {t.dst}: resharded inside the program "
                      f"({sum(c.bytes for c in cols)} bytes per device)")
  for t in sched.exit:
    owner = _caused_by(program.outputs[t.slot.index], t, annotations, prop)
    if owner is not None:  # the output is an annotation's result, gathered as it asks
      cols = tuple(_collectives(t, owner))
      by_op.setdefault(owner.index, []).extend(cols)
      _attach(rows, owner, cols)
      continue
    cols = tuple(_collectives(t, None))
    if cols:
      k = t.slot.index
      rows.append(PlanRow(len(rows), f"output[{k}]", "out_specs", 0, (_shape(t.value),),
                          (str(sched.outputs[k]),), (f"out_specs[{k}]",), cols))
  collectives = [c for r in rows for c in r.collectives]
  for op in prop.unsupported:
    info = describe(op.eqn.primitive)
    why = f" ({info.reason})" if info is not None and info.reason else ""
    warnings.append(f"{op.primitive} at {op.source} (op {op.index}) has no sharding rule{why}: "
                    "it runs replicated, its operands gathered whole")
  for conflict in prop.conflicts:
    if "type" in (conflict.kept_from.kind, conflict.dropped_from.kind):
      continue  # a type is JAX's inference, the layout spmd weighs, not a user's request
    cost = sum(c.bytes for c in by_op.get(conflict.op.index, []))
    warnings.append(
        f"conflicting shardings at op {conflict.op.index} ({conflict.op.primitive}, "
        f"{conflict.op.source}): kept {conflict.kept} from "
        f"{_origin_text(conflict.kept_from, producers)}, dropped {conflict.dropped} from "
        f"{_origin_text(conflict.dropped_from, producers)}; the reshard costs {cost} bytes per "
        "device")
  in_specs = tree_unflatten(in_tree, [s.to_spec() for s in sched.inputs])
  out_specs = tree_unflatten(out_tree, [s.to_spec() for s in sched.outputs])
  return Plan(dict(mesh), backend, tuple(rows), tuple(collectives),
              tuple(dict.fromkeys(warnings)), in_specs, out_specs, name)


def _caused_by(atom: Any, t: Transfer, annotations: dict[Value, Op],
               prop: Propagation) -> Op | None:
  """The annotation whose request a transfer carries out: it reads the annotation's result in
  the sharding the annotation asks for (annotations move nothing themselves; their readers do)."""
  op = annotations.get(atom) if isinstance(atom, Value) else None
  if op is None or t.dst.partial or t.dst.dims != prop.shardings[atom].dims:
    return None
  return op


def _attach(rows: list[PlanRow], op: Op, collectives: tuple[Collective, ...]) -> None:
  """Adds ``collectives`` to the row of ``op``."""
  for k, row in enumerate(rows):
    if row.index == op.index:
      rows[k] = dataclasses.replace(row, collectives=row.collectives + collectives)
      return


def _placed(collectives: list[Collective], copies: Copies) -> list[Collective]:
  """Each collective once per copy of its op in the lowered program (an unrolled scan's body is
  copied), with that copy's runs per call."""
  return [dataclasses.replace(c, trips=n) for c in collectives for n in copies]


def _collectives(t: Transfer, op: Op | None) -> list[Collective]:
  """The collectives ``t``'s steps run (none for a local step, nor those repeating earlier
  ones, repeats.py); ``op`` None: a transfer at the program's entry (an input) or exit (an
  output)."""
  boundary = "in_specs" if t.slot.kind == "input" else "out_specs"
  tensor = str(t.slot) if t.reader is None else f"{t.slot}, hoisted before its loop"
  return [Collective(step.kind, step.axes, step.bytes // step.collectives,
                     None if op is None else op.index, t.slot.kind if op is None else op.primitive,
                     boundary if op is None else op.source, tensor, _shape(t.value),
                     str(step.before), str(step.after))
          for k, step in enumerate(t.steps) for _ in range(t.runs(k))]


def _halo_collective(h: Exchange, hop: Hop, nbytes: int, s: ScheduledOp) -> Collective:
  x = s.op.inputs[h.operand]
  read = str(s.reads[h.operand])
  return Collective("collective-permute", h.axes, nbytes, s.op.index, s.op.primitive, s.op.source,
                    f"operands' halo (dim {h.dim})" if joint(h)
                    else f"operand {h.operand} halo (dim {h.dim})", _shape(x), read, read, 1,
                    HaloExchange(h.operand, h.dim, h.shards, hop.side, hop.distance, hop.rows,
                                 tuple(hop.pairs)))


def _partials_collective(s: ScheduledOp) -> Collective:
  """An op's all-gather of its per-shard partial results, which it reduces again (rule.gathers)."""
  ex, result = s.execution, s.op.outputs[0]
  return Collective("all-gather", ex.partial_axes, s.gathered, s.op.index, s.op.primitive,
                    s.op.source, "per-shard partial results", _shape(result), str(s.reads[0]),
                    str(s.writes[0]))


def _body_collective(b: BodyCollective, op: Op, trips: int | None) -> Collective:
  """A collective a user's shard_map body runs, ``trips`` the runs of the shard_map."""
  runs = None if trips is None or b.trips is None else trips * b.trips
  return Collective(b.kind, b.axes, b.bytes, op.index, op.primitive, b.source,
                    f"its body's {b.primitive}", b.shape, "manual", "manual", runs)


def _whole_dim_warnings(s: ScheduledOp, transfers: list[Transfer], shardings: dict) -> list[str]:
  """An op that needs a sharded dim whole (sort axis, windowed dim without halo); ``transfers``:
  its operands' reshards, those run before its loop included."""
  rule, op = s.execution.constraint.rule, s.op
  out = []
  for t in transfers:
    k = t.slot.index
    tf = rule.operands[k]
    for step in t.steps:
      if step.kind != "all-gather" or tf is None or step.dim is None:
        continue
      factors = tf[step.dim]
      if not factors or {rule.kinds[f] for f in factors} & {FactorKind.NEED_REPLICATION,
                                                           FactorKind.PERMUTATION}:
        out.append(f"op {op.index} ({op.primitive} at {op.source}) needs dim {step.dim} of "
                   f"operand {k} whole: all-gather over {','.join(step.axes)} moves "
                   f"{step.bytes} bytes per device")
  result, factors = s.op.outputs[0], rule.results[0] or ()
  for w in rule.windows:
    read = s.reads[w.operand]
    wanted = any(w.factor in fs and shardings[result].dims[d] for d, fs in enumerate(factors))
    if wanted and not s.execution.factor_axes[w.factor]:
      out.append(f"op {op.index} ({op.primitive} at {op.source}): dim {w.dim} cannot be exchanged "
                 "with neighbours (the halo would be as wide as the rest of the array), so it is "
                 f"gathered whole ({read})")
  return out


def _producers(program: Program, boundary: Boundary) -> dict[Value, str]:
  names: dict[Value, str] = {}
  for k, v in enumerate(program.inputs):
    names[v] = boundary.input_text(k)
  for v in program.consts:
    names[v] = "a constant"
  for op in program.all_ops():
    for v in op.outputs:
      names[v] = f"op {op.index}"
    for region in op.regions:
      for v in region.inputs:
        names.setdefault(v, f"op {op.index} (body input)")
  return names


def _origin_text(origin: Origin, producers: dict[Value, str], owner: Op | None = None) -> str:
  """``owner`` is the op that produces the value: a rule of another op means backward."""
  if origin.kind != "propagated":
    return origin.text
  src = producers.get(origin.source, "?")
  if owner is None or origin.via is owner:
    return f"<- {src}"
  return f"<- {src} (backward via op {origin.via.index})"


def _row(op: Op, depth: int, prop: Propagation, producers: dict[Value, str],
         collectives: Sequence[Collective]) -> PlanRow:
  scope, backward = layer(op)
  return PlanRow(op.index, op.primitive, op.source, depth, tuple(_shape(v) for v in op.outputs),
                 tuple(str(prop.shardings[v]) for v in op.outputs),
                 tuple(_origin_text(prop.origins[v], producers, op) for v in op.outputs),
                 tuple(collectives), scope, backward,
                 any(prop.origins[v].kind == "annotation" for v in op.outputs))


def _shape(atom: Any) -> str:
  return _aval_text(atom.aval)


@functools.lru_cache(maxsize=4096)
def _aval_text(aval: Any) -> str:
  """``aval.str_short()``, which JAX formats slowly, once per distinct aval (a program has few)."""
  return aval.str_short()


def _uneven_output_warning(k: int, atom: Any, wanted: TensorSharding, returned: TensorSharding,
                           t: Transfer | None, boundary: Boundary, mesh: MeshShape) -> str:
  """An output sharded unevenly (by out_specs, or by propagation where out_specs leave it open)
  comes back gathered along that dim; says what it costs and what the user could do instead
  (an open output that is whole already is not warned about: nothing surprising happens)."""
  shape = atom.aval.shape
  given = boundary.outputs[k] is not None
  what = (f"out_specs[{k}] {wanted}" if given
          else f"output {k}, sharded {wanted} inside the program,")
  cost = _gathered(t)
  head = (f"{what} does not split {atom.aval.str_short()} evenly: JAX arrays cannot hold "
          f"uneven shards, so it is returned as {returned}")
  if not cost:
    return f"{head} (it is whole already: nothing gathered)"
  hints = []
  for d, axes in enumerate(wanted.dims):
    if not axes or shape[d] % wanted.shards(d, mesh) == 0:
      continue
    count = wanted.shards(d, mesh)
    moved = [e for e, n in enumerate(shape) if e != d and not returned.dims[e] and n % count == 0]
    if moved:
      spec = list(returned.dims)
      spec[moved[0]] = axes
      hints.append(f"out_specs {returned.with_dims(spec)} (dim {moved[0]} splits evenly)")
    hints.append(f"padding dim {d} from {shape[d]} to {-(-shape[d] // count) * count}")
  return f"{head} ({cost} bytes per device gathered); cheaper: {' or '.join(hints)}"


def _gathered(t: Transfer | None) -> int:
  """Bytes per device an output's exit transfer moves (0 where it has none)."""
  return 0 if t is None else t.moved
