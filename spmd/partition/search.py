"""Automatic sharding: the open inputs' shardings chosen by an integer program whose costs are
full plans priced by the planner itself.

Open inputs are tied into variables (same shape, dtype and last pytree key: a param and its
optimizer moments, the same projection in every layer). Each candidate of each variable is
priced by a whole plan with that variable fixed and every other open input left to propagation;
the integer program (``scipy.optimize.milp``, HiGHS) picks one candidate per variable under the
memory limit, taking each variable's cost as its own plan's change from the propagation-only plan
(a linearisation: interactions between variables are not priced). A program with more than
``ILP_COLUMNS`` candidates, or one HiGHS does not solve within ``ILP_SECONDS``, is solved greedily
instead (``greedy``). Its answer is then priced by a whole plan, and the search keeps the
cheapest fitting plan it priced.
"""
from __future__ import annotations

import itertools
import math
import time
from dataclasses import dataclass, replace
from typing import Any, Hashable, Sequence

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, milp

from spmd.partition.ir import Program
from spmd.partition.planner import Analysis, Boundary, Planner, Scheduled
from spmd.partition.sharding import MeshShape, TensorSharding
from spmd.plan import Search, SearchVariable

ILP_COLUMNS = 20_000   # candidates (binary columns) the integer program takes at most
ILP_SECONDS = 10.0     # HiGHS's time limit


@dataclass(frozen=True)
class Choice:
  """One candidate per variable and how it was found: "milp" or "greedy (<why>)"."""

  picks: tuple[int, ...]
  method: str


@dataclass(frozen=True)
class _Priced:
  scheduled: Scheduled
  step_bytes: int
  memory: int


def candidates(shape: Sequence[int], mesh: MeshShape) -> tuple[TensorSharding, ...]:
  """Every sharding that places each mesh axis (of size > 1) on one dim or none, axes sharing a
  dim in mesh order, every dim split evenly; replicated first."""
  axes = [a for a, n in mesh.items() if n > 1]
  out = []
  for placement in itertools.product(range(-1, len(shape)), repeat=len(axes)):
    s = TensorSharding(tuple(tuple(a for a, p in zip(axes, placement) if p == d)
                             for d in range(len(shape))))
    if s.divides(shape, mesh):
      out.append(s)
  return tuple(out)


def memory(program: Program, scheduled: Scheduled, mesh: MeshShape) -> int:
  """Per-device bytes of the program's inputs as the schedule shards them."""
  return sum(_local_bytes(v, s, mesh)
             for v, s in zip(program.inputs, scheduled.schedule.inputs))


def _local_bytes(v: object, s: TensorSharding, mesh: MeshShape) -> int:
  return math.prod(s.local_shape(v.shape, mesh)) * v.aval.dtype.itemsize


def _variables(boundary: Boundary, ties: Sequence[Hashable]) -> list[list[int]]:
  """Open inputs (no spec, not committed) grouped by tie key, in input order."""
  groups: dict[Hashable, list[int]] = {}
  for k, (spec, arrival) in enumerate(zip(boundary.inputs, boundary.arrivals)):
    if spec is None and arrival is None:
      groups.setdefault(ties[k], []).append(k)
  return list(groups.values())


def _assign(boundary: Boundary, fixed: dict[int, TensorSharding]) -> Boundary:
  inputs = tuple(fixed.get(k, s) for k, s in enumerate(boundary.inputs))
  return replace(boundary, inputs=inputs)


def device_memory(devices: Sequence[Any]) -> int | None:
  """The bytes each of ``devices`` can hold (the least of them), as JAX reports it
  (``memory_stats()["bytes_limit"]``); None where a device reports none (XLA:CPU)."""
  limits = [(d.memory_stats() or {}).get("bytes_limit") for d in devices]
  return None if not limits or None in limits else min(limits)


def search(boundary: Boundary, ties: Sequence[Hashable], planner: Planner,
           memory_limit: int | None, limit_source: str) -> tuple[Analysis, Search]:
  """The cheapest plan found whose inputs fit ``memory_limit`` bytes per device (None: no
  limit; ``limit_source`` says where it came from); ``ties[k]`` is input k's tie key. Candidates
  are priced by their schedules; only the chosen plan is rendered."""
  start = time.perf_counter()
  program, mesh = planner.program, planner.mesh

  def price(b: Boundary) -> _Priced:
    scheduled = planner.schedule(b)
    return _Priced(scheduled, planner.step_bytes(scheduled), memory(program, scheduled, mesh))

  base = price(boundary)
  groups = _variables(boundary, ties)
  groups = [g for g in groups if len(candidates(program.inputs[g[0]].shape, mesh)) > 1]
  options = [candidates(program.inputs[g[0]].shape, mesh) for g in groups]
  priced = [[price(_assign(boundary, {k: s for k in g})) for s in opts]
            for g, opts in zip(groups, options)]
  mems = [[sum(_local_bytes(program.inputs[k], s, mesh) for k in g) for s in opts]
          for g, opts in zip(groups, options)]
  grouped = {k for g in groups for k in g}
  fixed_mem = sum(_local_bytes(v, s, mesh) for k, (v, s) in
                  enumerate(zip(program.inputs, base.scheduled.schedule.inputs))
                  if k not in grouped)
  solve_start = time.perf_counter()
  choice = choose([[p.step_bytes - base.step_bytes for p in ps] for ps in priced], mems,
                  None if memory_limit is None else memory_limit - fixed_mem)
  solver_seconds = time.perf_counter() - solve_start
  predicted = base.step_bytes + sum(priced[i][j].step_bytes - base.step_bytes
                                    for i, j in enumerate(choice.picks))
  solution = price(_assign(boundary, {k: options[i][j] for i, j in enumerate(choice.picks)
                                      for k in groups[i]}))
  pool = [solution, base] + [p for ps in priced for p in ps]
  fitting = [p for p in pool if memory_limit is None or p.memory <= memory_limit]
  best = min(fitting, key=lambda p: (p.step_bytes, p.memory))  # the solution fits
  inputs = best.scheduled.schedule.inputs
  variables = tuple(SearchVariable(tuple(boundary.input_names[k] for k in g),
                                   tuple(s.to_spec() for s in opts),
                                   tuple(inputs[k].to_spec() for k in g))
                    for g, opts in zip(groups, options))
  report = Search(variables, 2 + sum(map(len, priced)), solver_seconds,
                  time.perf_counter() - start, best.step_bytes, base.step_bytes, predicted,
                  solution.step_bytes, best.memory, memory_limit, limit_source, best is solution,
                  choice.method)
  return planner.render(best.scheduled), report


def choose(costs: list[list[int]], mems: list[list[int]], budget: int | None) -> Choice:
  """One candidate per variable minimising the summed costs with summed memory <= ``budget``
  (None: no limit): the integer program, or the greedy fallback where it is too large or
  HiGHS runs out of time."""
  columns = sum(map(len, costs))
  if columns > ILP_COLUMNS:
    return Choice(greedy(costs, mems, budget), f"greedy ({columns} candidates, the integer "
                                               f"program takes {ILP_COLUMNS})")
  picks = _solve(costs, mems, budget)
  if picks is None:
    return Choice(greedy(costs, mems, budget),
                  f"greedy (HiGHS found no solution in {ILP_SECONDS:g} s)")
  return Choice(picks, "milp")


def greedy(costs: list[list[int]], mems: list[list[int]], budget: int | None) -> tuple[int, ...]:
  """Deterministic fallback: every variable at its cheapest candidate (less memory, then the
  earlier, breaking ties); then, while over ``budget``, the one move (a variable to a candidate
  holding less) that adds the fewest bytes per byte of memory it frees, the earlier variable
  and candidate breaking ties."""
  picks = [min(range(len(c)), key=lambda j: (c[j], m[j], j)) for c, m in zip(costs, mems)]
  used = sum(m[j] for m, j in zip(mems, picks))
  while budget is not None and used > budget:
    moves = [((costs[i][j] - costs[i][picks[i]]) / (mems[i][picks[i]] - mems[i][j]), i, j)
             for i in range(len(costs)) for j in range(len(costs[i]))
             if mems[i][j] < mems[i][picks[i]]]
    if not moves:
      least = sum(map(min, mems))
      raise ValueError(f"spmd.partition(auto=True): the open inputs hold at least {least} "
                       f"bytes per device, more than the {budget} bytes memory_limit leaves them")
    _, i, j = min(moves)
    used += mems[i][j] - mems[i][picks[i]]
    picks[i] = j
  return tuple(picks)


def _solve(costs: list[list[int]], mems: list[list[int]],
           budget: int | None) -> tuple[int, ...] | None:
  """The integer program's answer; None where HiGHS stops at its time limit without one."""
  if not costs:
    return ()
  sizes = [len(c) for c in costs]
  n, offsets = sum(sizes), np.cumsum([0] + sizes)
  one_hot = np.zeros((len(sizes), n))
  for i, size in enumerate(sizes):
    one_hot[i, offsets[i]:offsets[i] + size] = 1
  constraints = [LinearConstraint(one_hot, 1, 1)]
  if budget is not None:
    constraints.append(LinearConstraint(np.concatenate(mems)[None, :], -np.inf, budget))
  # memory as a tie-break: of equally cheap choices, the one holding less
  cost = np.concatenate(costs).astype(float) + np.concatenate(mems) / (1 + sum(map(max, mems)))
  result = milp(cost, integrality=np.ones(n), bounds=Bounds(0, 1), constraints=constraints,
                options={"time_limit": ILP_SECONDS})
  if result.x is None and result.status == 1:  # the time limit, no solution found yet
    return None
  if result.x is None:
    least = sum(map(min, mems))
    raise ValueError(f"spmd.partition(auto=True): the open inputs hold at least {least} bytes "
                     f"per device, more than the {budget} bytes memory_limit leaves them")
  x = np.round(result.x).astype(int)
  return tuple(int(np.argmax(x[offsets[i]:offsets[i] + size])) for i, size in enumerate(sizes))
