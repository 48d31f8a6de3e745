"""The decode ladder: the row counts a decode step runs at, and which sample slot of the pool each row decodes.

A decode step runs over B rows, B a rung of the ladder: the smallest that holds the live samples, chosen again at
every finished-sample check, so a rollout whose responses are long-tailed decodes its tail at a few rows instead
of every slot of the pool. Row r decodes the sample in slot `slot_of_row[r]`: the live slots first, in slot order;
the rows past them are scratch rows. The top rung is the pool's slot count, where the map is the identity (every
slot decodes, finished ones computing what nobody reads: the full-pool step), so a ladder of that one rung is the
engine without row maps.

Scratch rows all decode one slot outside the live set (`RowMap.scratch`), as a finished sample whose state they do
not share: their token, position and count are fixed (token 0 at own position 0, inactive), so they write the same
k/v into that slot's own position 0 and their sampled token into the dummy column of its output row. Nothing reads
either: a slot's own K/V is read only by a row decoding that slot, and a sample admitted there later writes each of
its positions before it reads it; the outputs read at a check are the live rows' and the finished slots' counted
tokens. Such a slot exists whenever there are scratch rows (B <= the pool's slots), so the pool needs no extra one.

Why these rungs (DEFAULT_LADDER). What a row costs is the lever: a decode step reads every weight once whatever B is,
and its GEMMs stay bound by that read until B nears the accelerator's FLOPs-per-byte ratio (about 200-300 rows for
bf16 weights on current GPUs); past it every row adds its share of the 2 x parameters FLOPs. So up to 128 rows the
rungs double (8 ... 128): there a smaller rung saves only the per-row work that does not read weights (sampling
over the vocabulary, the LM head's epilogue, the own-token attention), and the tail of a long-tailed rollout spends
most of its steps at the smallest rungs. From 128 on, near and past the point where rows are the cost, the rungs
grow by 1.5x and 1.33x, so a step runs at most half (on average about a fifth) more rows than are live. The price
of a rung is a CUDA graph of the step at that size: one capture per rollout that reaches it (the pool's storage is
released between rollouts, so its graphs are captured again), a few steps' time each, and the memory of the largest
graph only (the graphs of one pool storage share their memory pool, rollout/decode_step.py). A rung between the
small doublings (96) would buy little: GEMM kernels pad rows to tiles of 64 or 128 in the weight-bound range.
benchmarks/decode_bench.py measures each rung against its floor.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

DEFAULT_LADDER = (8, 16, 32, 64, 128, 192, 256, 384, 512, 768, 1024, 1536, 2048, 3072, 4096)


def pool_ladder(num_slots: int, sizes: Sequence[int] = DEFAULT_LADDER) -> tuple[int, ...]:
    """The rungs of a pool of `num_slots` slots: the given sizes below its slot count, then the slot count itself
    (an empty `sizes` leaves that one rung: every step runs every slot)."""
    return tuple(sorted({int(s) for s in sizes if 0 < s < num_slots})) + (num_slots,)


def rows_for(live: int, ladder: Sequence[int]) -> int:
    """The smallest rung that holds `live` rows."""
    for rows in ladder:
        if rows >= live:
            return rows
    raise ValueError(f"{live} live samples do not fit the ladder {tuple(ladder)}")


@dataclass(frozen=True)
class RowMap:
    """Which slot each of a step's rows decodes: rows [0, live) hold the live slots (all rows, at the top rung's
    identity map), the rest the scratch slot."""

    slot_of_row: tuple[int, ...]
    live: int  # leading rows whose state is a sample's own (pushed back to its slot at a check)
    scratch: int | None  # the slot the scratch rows decode, None without scratch rows

    @property
    def rows(self) -> int:
        return len(self.slot_of_row)


def row_map(live_slots: Sequence[int], num_slots: int, ladder: Sequence[int]) -> RowMap:
    """The map of a step that must decode `live_slots` (ascending) of a pool of `num_slots` slots."""
    rows = rows_for(len(live_slots), ladder)
    if rows == num_slots:
        return RowMap(tuple(range(num_slots)), num_slots, None)
    live = set(live_slots)
    scratch = next(s for s in range(num_slots) if s not in live)
    return RowMap(tuple(live_slots) + (scratch,) * (rows - len(live_slots)), len(live_slots), scratch)
