"""Reshards that build each device's new block from pieces of old blocks (reshard.py's
``ExchangePieces``) and the rounds its collective-permutes are grouped into (rounds.py): values,
plan == compiled HLO and bytes against XLA's partitioner, on every test mesh, for dims getting
finer and coarser blocks at once, replicated holders, a kept sharded dim, integer and bfloat16
values, and a gradient."""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

import spmd
from helpers import assert_partitioned_matches, ints, no_more_than_xla, randn, rng
from test_xla_cases10 import A4B2
from spmd.partition.reshard import ExchangePieces, plan_reshard, sub_blocks
from spmd.partition.rounds import into_rounds, rounds_needed
from spmd.partition.sharding import TensorSharding

BF16 = jnp.bfloat16


@pytest.mark.parametrize("seed", range(20))
def test_rounds_send_and_receive_one_piece_per_device(seed: int):
  """Random transfers between up to 9 devices, repeated pairs included: each round is a
  permutation's worth (a device sends at most one and receives at most one), in as many rounds
  as the busiest device needs."""
  r = rng(seed)
  devices = int(r.integers(2, 10))
  transfers = [tuple(map(int, r.integers(0, devices, 2))) for _ in range(int(r.integers(1, 40)))]
  rounds = into_rounds(transfers)
  assert max(rounds) + 1 == rounds_needed(transfers)
  for k in range(rounds_needed(transfers)):
    these = [t for t, c in zip(transfers, rounds) if c == k]
    assert len({s for s, _ in these}) == len(these) == len({d for _, d in these})


def test_rows_of_two_axes_into_columns_of_another_pair_3d():
  """f32[16,8] P(('b','a'), None) -> P(None, ('b','c')) on 2x2x2: each new [16,2] block is four
  [4,2] pieces, one of which the device holds; the other three come from the two holders of each
  old block, three per holder: 3 collective-permutes of 32 B, 96 B (512 B gathered whole and
  sliced before, XLA 256 B)."""
  plan = no_more_than_xla(lambda x: x * 2, (randn(16, 8),), P(("b", "a"), None), "a2b2c2",
                          P(None, ("b", "c")))
  assert plan.total_bytes == 96, plan.explain()
  mesh = {"a": 2, "b": 2, "c": 2}
  src, dst = TensorSharding((("b", "a"), ())), TensorSharding(((), ("b", "c")))
  steps = sub_blocks(src, dst, (16, 8), 4, mesh, plan_reshard(src, dst, (16, 8), 4, mesh))
  assert [type(s) for s in steps] == [ExchangePieces]
  assert steps[0].rounds((16, 8), mesh) == 3


CASES = [
    ("a2b4", (8, 8), P("a", "b"), P("b", "a"), np.float32),
    (A4B2, (8, 16), P("a", "b"), P("b", "a"), np.int32),
    ("a2b2c2", (4, 8, 6), P("a", "b", "c"), P(("a", "b"), None, "c"), np.float32),
    ("a2b2c2", (8, 8), P(None, ("a", "c")), P(("c", "b"), None), BF16),
    ("a2b2c2", (16, 8), P(("b", "c"), None), P(None, ("c", "a")), np.float32),
    (A4B2, (8, 4, 4, 2), P(None, "b", "a"), P("b", "a"), np.float32),
    ("a2b4", (4, 8, 8), P("b", "a"), P("a", None, "b"), BF16),
]


@pytest.mark.parametrize("mesh, shape, src, dst, dtype", CASES,
                         ids=[f"{m if isinstance(m, str) else 'a4b2'}-{s}-{d}"
                              for m, _, s, d, _ in CASES])
def test_reshard_of_a_sole_reader(mesh, shape, src, dst, dtype):
  x = ints(*shape) if dtype == np.int32 else randn(*shape, dtype=dtype)
  no_more_than_xla(lambda x: x * 2, (x,), src, mesh, dst)


def test_an_all_to_all_is_not_traded_for_permutes_of_as_many_bytes():
  """P('x') -> P(None,'x') of f32[8,8] on 8 devices: the pieces would send 7/8 of the block in 7
  collective-permutes, what the one all-to-all sends, so the all-to-all stays."""
  plan = no_more_than_xla(lambda x: x * 2, (randn(8, 8),), P("x"), "x8", P(None, "x"))
  assert [c.kind for c in plan.collectives] == ["all-to-all"], plan.explain()


def test_gradient_through_operands_tiled_transposed():
  """value_and_grad of sum(sin(x + y)) with x P('a','b') and y P('b','a') on 2x4: y is read in
  x's tiling and its gradient returned in its own, both by pieces."""
  f = jax.value_and_grad(lambda x, y: jnp.sin(x + y).sum(), argnums=(0, 1))
  no_more_than_xla(f, (randn(8, 8), randn(8, 8, seed=1)), (P("a", "b"), P("b", "a")), "a2b4",
                   (P(), (P("a", "b"), P("b", "a"))))


# Random reshards between 2-D and 3-D specs on 2x4, 4x2 and 2x2x2 meshes that moved more than XLA
# before ExchangePieces: 3 of the 15 of 150 2-D draws, and all 23 of 301 3-D draws; no draw moves
# more now.
ABOVE_XLA_BEFORE = [
    (A4B2, (16, 16, 4), P(None, "a", "b"), P(None, "b", "a")),
    (A4B2, (16, 8, 16), P("a", None, "b"), P("b", None, "a")),
    ("a2b2c2", (4, 8, 16), P(("b", "c"), None, None), P("a", "b", "c")),
    ("a2b2c2", (16, 4, 8), P(("b", "a"), "c", None), P("c", "b", "a")),
    ("a2b2c2", (8, 8, 4), P("c", "a", None), P(None, ("c", "b"), "a")),
    ("a2b2c2", (16, 4, 4), P("b", "c", "a"), P(("a", "c"), None, "b")),
    ("a2b2c2", (4, 4, 16), P(None, "c", "b"), P(("b", "c"), "a", None)),
    ("a2b2c2", (8, 16, 16), P(None, ("b", "c"), None), P(None, None, ("c", "a", "b"))),
    ("a2b4", (16, 16, 8), P("a", None, "b"), P("b", None, "a")),
    ("a2b4", (4, 4, 4), P("b", "a", None), P(None, "b", None)),
    ("a2b2c2", (16, 8, 16), P("b", "c", None), P(None, ("a", "b"), None)),
    ("a2b4", (8, 4, 16), P("a", "b", None), P(None, "a", None)),
    ("a2b2c2", (4, 8, 16), P("a", "c", None), P("b", None, ("a", "c"))),
    ("a2b2c2", (4, 8, 4), P("a", None, ("b", "c")), P(None, "b", "a")),
    ("a2b4", (4, 16, 8), P("b", None, "a"), P("a", None, None)),
    ("a2b2c2", (16, 16, 4), P(("c", "b"), "a", None), P(None, None, "c")),
    (A4B2, (16, 16, 4), P("a", None, "b"), P(None, None, "a")),
    ("a2b2c2", (8, 4, 16), P(None, ("a", "b"), None), P(("b", "c"), None, "a")),
    ("a2b4", (4, 16, 4), P("b", None, "a"), P("a", None, "b")),
    ("a2b2c2", (4, 4, 4), P(("b", "a"), None, None), P(None, ("a", "c"), "b")),
    (A4B2, (16, 16, 8), P(None, "b", "a"), P(None, "a", "b")),
    ("a2b2c2", (16, 16, 8), P("c", "a", "b"), P("b", None, ("c", "a"))),
    ("a2b2c2", (4, 16, 16), P(None, None, ("c", "b")), P(("c", "a"), None, None)),
    ("a2b2c2", (16, 8), P(("b", "a"), None), P(None, ("b", "c"))),
    ("a2b2c2", (12, 8), P(("a", "b"), "c"), P(None, ("a", "c"))),
    ("a2b2c2", (16, 8), P("b", "c"), P(("c", "a"), None)),
]


@pytest.mark.parametrize("mesh, shape, src, dst", ABOVE_XLA_BEFORE,
                         ids=[f"{s}-{d}-{n}" for _, n, s, d in ABOVE_XLA_BEFORE])
def test_reshard_no_more_than_xla(mesh, shape, src, dst):
  no_more_than_xla(lambda x: x * 2, (randn(*shape),), src, mesh, dst)


UNEVEN = [  # mesh, shape, src, dst, bytes before uneven pieces (gathered or realigned), after
    (A4B2, (12, 5), P("b", "a"), P("a", "b"), 504, 120),
    ("a2b4", (5, 6), P("a", "b"), P("b", "a"), 280, 120),
    (A4B2, (12, 12, 8), P(("a", "b"), None, None), P("b", "a", None), 6144, 768),
    ("a2b2c2", (3, 10, 6), P("b", None, "a"), P(None, "b", "c"), 480, 180),
]


@pytest.mark.parametrize("mesh, shape, src, dst, before, after", UNEVEN,
                         ids=[f"{s}-{d}-{n}" for _, n, s, d, _, _ in UNEVEN])
def test_uneven_blocks_in_pieces_of_their_common_divisor(mesh, shape, src, dst, before, after):
  """An uneven dim's blocks are cut into pieces as long as the two block lengths' greatest common
  divisor (blocks of 3 rows into blocks of 2: rows), none past the dim's end, where a new block
  meets no more old blocks than it has pieces: values, plan == compiled HLO, and the bytes (the
  annotation inside the program, as jax.jit refuses an uneven spec at its boundary)."""
  plan = assert_partitioned_matches(lambda x: spmd.annotate(x * 2, dst) + 1,
                                    (randn(*shape),), src, mesh)
  assert plan.total_bytes == after < before, plan.explain()
