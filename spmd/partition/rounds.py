"""Transfers between devices grouped into rounds, each round one collective-permute: every
device sends at most one transfer and receives at most one per round.

A proper edge colouring of the bipartite multigraph senders x receivers (König: as many colours
as the largest number of transfers one device sends or receives), by the alternating-path
method: an edge whose ends have no free colour in common frees one at its receiver by swapping
two colours along the path that starts there.
"""
from __future__ import annotations

from typing import Sequence


def rounds_needed(transfers: Sequence[tuple[int, int]]) -> int:
  """The rounds ``into_rounds`` makes of the (sender, receiver) ``transfers``: the most that any
  one device sends or receives."""
  sends: dict[int, int] = {}
  receives: dict[int, int] = {}
  for src, dst in transfers:
    sends[src] = sends.get(src, 0) + 1
    receives[dst] = receives.get(dst, 0) + 1
  return max([*sends.values(), *receives.values()], default=0)


def into_rounds(transfers: Sequence[tuple[int, int]]) -> list[int]:
  """The round of each (sender, receiver) transfer, in ``rounds_needed`` rounds."""
  count = rounds_needed(transfers)
  at_sender: dict[tuple[int, int], int] = {}  # (sender, round) -> transfer
  at_receiver: dict[tuple[int, int], int] = {}  # (receiver, round) -> transfer
  colour = [-1] * len(transfers)

  def free(at: dict[tuple[int, int], int], device: int) -> int:
    return next(c for c in range(count) if (device, c) not in at)

  def assign(t: int, c: int) -> None:
    colour[t] = c
    at_sender[transfers[t][0], c] = t
    at_receiver[transfers[t][1], c] = t

  for t, (src, dst) in enumerate(transfers):
    a, b = free(at_sender, src), free(at_receiver, dst)
    if (dst, a) in at_receiver:  # swap a and b along the path from dst through a, b, a, ...
      path, device, on_receiver, c = [], dst, True, a
      while (device, c) in (at_receiver if on_receiver else at_sender):
        edge = (at_receiver if on_receiver else at_sender)[device, c]
        path.append(edge)
        device = transfers[edge][0] if on_receiver else transfers[edge][1]
        on_receiver, c = not on_receiver, b if c == a else a
      for edge in path:
        del at_sender[transfers[edge][0], colour[edge]]
        del at_receiver[transfers[edge][1], colour[edge]]
      for edge in path:
        assign(edge, b if colour[edge] == a else a)
    assign(t, a)
  return colour
