"""Bad records are set aside, never fatal: one reusable guard, and a tally of what was skipped, by phase and reason.

Any data source calls `guard_record(record_id, source, fn, ...)` around the work that turns one record into model
inputs (decoding, resizing, tokenizing): whatever that raises becomes a `BadSampleError` naming the record and its
file, so a single corrupt or odd input (a 20x5000 px image trips the processor's aspect-ratio check hours into a
run) costs one sample. `SkipTally` counts the skips by phase and reason for the metrics and warns once per record,
not every time the stream hands the same bad record out again.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TypeVar

from .records import BadSampleError

log = logging.getLogger(__name__)
T = TypeVar("T")

PHASES = ("warmup", "train", "eval")
# media: a file missing or undecodable; too_long: over data.max_prompt_tokens; preprocess: the processor (or any
# other step) raised on inputs it could read; malformed: a records line that is not a valid record.
REASONS = ("media", "too_long", "preprocess", "malformed")


def guard_record(record_id: str, source: str, fn: Callable[..., T], *args, **kwargs) -> T:
    """`fn(*args, **kwargs)`, with any exception turned into a BadSampleError for `record_id` read from `source`.

    Only `Exception`s are caught: KeyboardInterrupt and SystemExit still stop the run."""
    try:
        return fn(*args, **kwargs)
    except BadSampleError:
        raise
    except Exception as err:  # noqa: BLE001 - one record must never end the run, whatever its inputs break
        raise BadSampleError(record_id, source, f"{type(err).__name__}: {err}", kind="preprocess") from err


class SkipTally:
    """Skips counted as `skipped/<phase>/<reason>`; each record id is warned about once per tally."""

    def __init__(self) -> None:
        self.counts: dict[str, int] = {f"{p}/{r}": 0 for p in PHASES for r in REASONS}
        self._warned: set[tuple[str, str]] = set()

    def add(self, phase: str, err: BadSampleError) -> None:
        key = f"{phase}/{err.kind}"
        if key not in self.counts:
            raise KeyError(f"unknown skip phase/reason {key!r}; phases {PHASES}, reasons {REASONS}")
        self.counts[key] += 1
        if (phase, err.record_id) not in self._warned:
            self._warned.add((phase, err.record_id))
            log.warning("skipping %s sample: %s (warned once per record)", phase, err)

    def add_malformed(self, phase: str, count: int) -> None:
        """Records dropped while reading a data file (shown one by one by data/sources.BadRecords): counted."""
        self.counts[f"{phase}/malformed"] += count

    def total(self, phase: str | None = None) -> int:
        return sum(n for key, n in self.counts.items() if phase is None or key.startswith(phase + "/"))

    def vector(self) -> list[float]:
        """The counts in a fixed order (the same on every rank, so they can be summed with one all-reduce)."""
        return [float(self.counts[k]) for k in sorted(self.counts)]

    def metrics(self, summed: list[float] | None = None) -> dict[str, float]:
        """{"skipped/<phase>/<reason>": n}, from this tally or from `summed` (a `vector()` summed over ranks)."""
        values = self.vector() if summed is None else summed
        return {f"skipped/{k}": v for k, v in zip(sorted(self.counts), values)}

    def state_dict(self) -> dict[str, int]:
        return dict(self.counts)

    def load_state_dict(self, state: dict[str, int]) -> None:
        for key, value in state.items():
            if key in self.counts:
                self.counts[key] = int(value)


class DataError(RuntimeError):
    """The data cannot feed the run (no valid record, or a step with no valid sample); the message names the file
    and the skip counts."""


def skip_counts_text(counts: dict[str, float]) -> str:
    shown = [f"{key.removeprefix('skipped/')} {int(n)}" for key, n in sorted(counts.items()) if n]
    return ", ".join(shown) or "none"
