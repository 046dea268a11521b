"""Automatic sharding: the open inputs' shardings chosen by an integer program whose costs are
full plans priced by the planner itself.

Open inputs are tied into variables (same shape, dtype and last pytree key: a param and its
optimizer moments, the same projection in every layer). Each candidate of each variable is
priced by a whole plan with that variable fixed and every other open input left to propagation;
the integer program (``scipy.optimize.milp``, HiGHS) picks one candidate per variable under the
memory limit, taking each variable's cost as its own plan's change from the propagation-only plan
(a linearisation: interactions between variables are not priced). Its answer is then priced by a
whole plan, and the search keeps the cheapest fitting plan it priced.
"""
from __future__ import annotations

import itertools
import math
import time
from dataclasses import dataclass
from typing import Callable, Hashable, Sequence

import numpy as np
from scipy.optimize import Bounds, LinearConstraint, milp

from spmd.partition.planner import Analysis, Boundary
from spmd.partition.sharding import MeshShape, TensorSharding
from spmd.plan import Search, SearchVariable

Evaluate = Callable[[Boundary], Analysis]


@dataclass(frozen=True)
class _Priced:
  boundary: Boundary
  analysis: Analysis
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


def memory(analysis: Analysis, mesh: MeshShape) -> int:
  """Per-device bytes of the program's inputs as the plan shards them."""
  return sum(_local_bytes(v, s, mesh)
             for v, s in zip(analysis.program.inputs, analysis.schedule.inputs))


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
  return Boundary(inputs, boundary.input_names, boundary.outputs, boundary.arrivals)


def search(boundary: Boundary, ties: Sequence[Hashable], mesh: MeshShape,
           memory_limit: int | None, evaluate: Evaluate) -> tuple[Analysis, Search]:
  """The cheapest plan found whose inputs fit ``memory_limit`` bytes per device (None: no
  limit); ``ties[k]`` is input k's tie key."""
  start = time.perf_counter()

  def price(b: Boundary) -> _Priced:
    a = evaluate(b)
    return _Priced(b, a, a.plan.step_bytes, memory(a, mesh))

  base = price(boundary)
  program = base.analysis.program
  groups = _variables(boundary, ties)
  groups = [g for g in groups if len(candidates(program.inputs[g[0]].shape, mesh)) > 1]
  options = [candidates(program.inputs[g[0]].shape, mesh) for g in groups]
  priced = [[price(_assign(boundary, {k: s for k in g})) for s in opts]
            for g, opts in zip(groups, options)]
  mems = [[sum(_local_bytes(program.inputs[k], s, mesh) for k in g) for s in opts]
          for g, opts in zip(groups, options)]
  grouped = {k for g in groups for k in g}
  fixed_mem = sum(_local_bytes(v, s, mesh) for k, (v, s) in
                  enumerate(zip(program.inputs, base.analysis.schedule.inputs)) if k not in grouped)
  solve_start = time.perf_counter()
  choice = _solve([[p.step_bytes - base.step_bytes for p in ps] for ps in priced], mems,
                  None if memory_limit is None else memory_limit - fixed_mem)
  solver_seconds = time.perf_counter() - solve_start
  predicted = base.step_bytes + sum(priced[i][j].step_bytes - base.step_bytes
                                    for i, j in enumerate(choice))
  solution = price(_assign(boundary, {k: options[i][j] for i, j in enumerate(choice)
                                      for k in groups[i]}))
  pool = [solution, base] + [p for ps in priced for p in ps]
  fitting = [p for p in pool if memory_limit is None or p.memory <= memory_limit]
  best = min(fitting, key=lambda p: (p.step_bytes, p.memory))  # the solution fits
  inputs = best.analysis.schedule.inputs
  variables = tuple(SearchVariable(tuple(boundary.input_names[k] for k in g),
                                   tuple(s.to_spec() for s in opts),
                                   tuple(inputs[k].to_spec() for k in g))
                    for g, opts in zip(groups, options))
  report = Search(variables, 2 + sum(map(len, priced)), solver_seconds,
                  time.perf_counter() - start, best.step_bytes, base.step_bytes, predicted,
                  solution.step_bytes, best.memory, memory_limit, best is solution)
  return best.analysis, report


def _solve(costs: list[list[int]], mems: list[list[int]], budget: int | None) -> list[int]:
  """One candidate per variable minimising the summed costs, summed memory <= ``budget``."""
  if not costs:
    return []
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
  result = milp(cost, integrality=np.ones(n), bounds=Bounds(0, 1), constraints=constraints)
  if result.x is None:
    least = sum(map(min, mems))
    raise ValueError(f"spmd.partition(auto=True): the open inputs hold at least {least} bytes "
                     f"per device, more than the {budget} bytes memory_limit leaves them")
  x = np.round(result.x).astype(int)
  return [int(np.argmax(x[offsets[i]:offsets[i] + size])) for i, size in enumerate(sizes)]
