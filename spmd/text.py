"""A small character-level corpus for the demo: sentences generated from a fixed grammar (no data
to download, no licence to ship), a character vocabulary and random training windows."""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

SUBJECTS = ("the cat", "a dog", "the old man", "my sister", "a small bird", "the teacher",
            "our neighbour", "the child")
VERBS = ("sees", "likes", "follows", "finds", "paints", "remembers", "watches", "carries")
OBJECTS = ("the red ball", "a green door", "the moon", "an apple", "the river", "a wooden box",
           "the garden", "a yellow kite")
ENDINGS = (".", " today.", " at night.", " again.", " in the rain.", " every morning.")


def sentences(count: int, seed: int = 0) -> str:
  """``count`` sentences, one per line, drawn from the grammar with a seeded generator."""
  rng = np.random.default_rng(seed)
  pick = lambda words: words[rng.integers(len(words))]  # noqa: E731
  return "\n".join(f"{pick(SUBJECTS)} {pick(VERBS)} {pick(OBJECTS)}{pick(ENDINGS)}".capitalize()
                   for _ in range(count)) + "\n"


@dataclass(frozen=True)
class CharVocab:
  """The characters of a text, in sorted order; ``size`` may be padded past them (e.g. to a
  multiple of a mesh axis), the padding ids never occur."""

  chars: str
  size: int

  @classmethod
  def of(cls, text: str, multiple_of: int = 1) -> CharVocab:
    chars = "".join(sorted(set(text)))
    return cls(chars, -(-len(chars) // multiple_of) * multiple_of)

  def encode(self, text: str) -> np.ndarray:
    index = {c: i for i, c in enumerate(self.chars)}
    return np.array([index[c] for c in text], np.int32)

  def decode(self, ids: np.ndarray) -> str:
    return "".join(self.chars[i] if i < len(self.chars) else "?" for i in np.asarray(ids))


def windows(ids: np.ndarray, batch: int, length: int, rng: np.random.Generator) -> np.ndarray:
  """``batch`` random windows of ``length`` consecutive ids: [batch, length] int32."""
  starts = rng.integers(0, len(ids) - length, batch)
  return np.stack([ids[s:s + length] for s in starts])
