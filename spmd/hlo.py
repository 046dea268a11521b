"""Collectives counted from compiled HLO text, to check a plan against what XLA emits."""
from __future__ import annotations

import re
from dataclasses import dataclass

KINDS = ("all-reduce", "all-gather", "reduce-scatter", "all-to-all", "collective-permute")
_ELEMENT_BYTES = {"pred": 1, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "f16": 2, "bf16": 2, "s32": 4,
                  "u32": 4, "f32": 4, "s64": 8, "u64": 8, "f64": 8, "c64": 8, "c128": 16}
_ARRAY = re.compile(r"\b([a-z]+[0-9a-z]*)\[([0-9,]*)\]")
_INSTR = re.compile(r"^\s*(?:ROOT\s+)?%?([\w.\-]+)\s*=\s*")


@dataclass(frozen=True)
class HloCollective:
  """``bytes`` is per device: the larger of the operands' and the result's total size;
  ``arrays`` are the result's array types (``f32[8,16]``); ``text`` is the instruction."""

  kind: str
  bytes: int
  name: str
  arrays: tuple[str, ...] = ()
  text: str = ""


def array_bytes(text: str) -> int:
  """Bytes of every array type (``f32[8,16]``) written in ``text``."""
  total = 0
  for dtype, dims in _ARRAY.findall(text):
    size = _ELEMENT_BYTES.get(dtype[:4] if dtype.startswith("f8") else dtype,
                              1 if dtype.startswith("f8") else 0)
    for d in filter(None, dims.split(",")):
      size *= int(d)
    total += size
  return total


def _split(line: str) -> tuple[str, str, str, str] | None:
  """(name, result shape, opcode, operand text) of one HLO instruction line."""
  m = _INSTR.match(line)
  if not m:
    return None
  rest = line[m.end():]
  if rest.startswith("("):
    depth = 0
    for i, ch in enumerate(rest):
      depth += ch == "("
      depth -= ch == ")"
      if depth == 0:
        break
    shape, rest = rest[:i + 1], rest[i + 1:].lstrip()
  else:
    shape, _, rest = rest.partition(" ")
  opcode, _, args = rest.partition("(")
  return m.group(1), shape, opcode.strip(), args


def collectives(hlo_text: str) -> list[HloCollective]:
  shapes: dict[str, int] = {}
  found: list[tuple] = []
  for line in hlo_text.splitlines():
    parts = _split(line)
    if parts is None:
      continue
    name, shape, opcode, args = parts
    shapes[name] = array_bytes(shape)
    kind = opcode.removesuffix("-start")
    if kind in KINDS and not opcode.endswith("-done"):
      operands = args.split(")", 1)[0]
      found.append((kind, name, shapes[name], operands, opcode.endswith("-start"), shape, line))
  out = []
  for kind, name, result_bytes, operands, is_start, shape, line in found:
    names = [o.strip().lstrip("%") for o in operands.split(",") if o.strip()]
    operand_bytes = sum(shapes.get(n.split()[-1].lstrip("%"), 0) for n in names)
    if is_start and operand_bytes:
      result_bytes -= operand_bytes  # async starts return an (operands, result) tuple
    arrays = tuple(f"{t}[{d}]" for t, d in _ARRAY.findall(shape))
    out.append(HloCollective(kind, max(result_bytes, operand_bytes), name, arrays, line.strip()))
  return out


def collective_bytes(hlo_text: str) -> int:
  """Total per-device bytes moved by the collectives of a compiled HLO module."""
  return sum(c.bytes for c in collectives(hlo_text))
