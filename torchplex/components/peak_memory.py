"""Peak allocated memory of named windows inside a stage (CUDA's allocator; off elsewhere unless given a counter),
and the whole-phase peak readers that the windows' resets must not fool (`reset_peak`, `max_allocated`).

The allocator keeps one peak counter. A window resets it at its entry and at its exit, and reads it at its exit:
what the window allocated above what it found (less what `growth` says grew for good inside it, e.g. the gradients a
first backward creates). The stage's own peak survives the resets: `peak()` is the largest value the counter
reached since `begin`, `peak(excluding=names)` the same outside those windows (training's micro-batches that kept
their whole graph use what was free by design). The counters are the allocator's host-side books, so no device
synchronisation is needed to read them.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Callable, Protocol

import torch


# device index -> the largest peak a window's reset took from the allocator's counter since the last `reset_peak`:
# readers of a whole phase's or step's peak (components.metrics.PhaseTimer, the memory manager, the benchmarks) read
# `max_allocated`, which adds it back, so the windows inside a stage hide nothing from them
_carried: dict[int, int] = {}


def _index(device) -> int:
    if isinstance(device, int):
        return device
    index = torch.device(device).index if device is not None else None
    return torch.cuda.current_device() if index is None else index


def reset_peak(device=None) -> None:
    """torch.cuda.reset_peak_memory_stats, forgetting what the windows carried too."""
    _carried[_index(device)] = 0
    torch.cuda.reset_peak_memory_stats(device)


def max_allocated(device=None) -> int:
    """torch.cuda.max_memory_allocated since the last `reset_peak`, the windows' resets notwithstanding."""
    return max(_carried.get(_index(device), 0), torch.cuda.max_memory_allocated(device))


class AllocationCounter(Protocol):
    def allocated(self) -> int: ...
    def max_allocated(self) -> int: ...
    def reset_peak(self) -> None: ...


class CudaCounter:
    def __init__(self, device: torch.device):
        self.device = device

    def allocated(self) -> int:
        return torch.cuda.memory_allocated(self.device)

    def max_allocated(self) -> int:
        return torch.cuda.max_memory_allocated(self.device)

    def reset_peak(self) -> None:  # what it takes from the counter is carried for `max_allocated`'s readers
        _carried[_index(self.device)] = max_allocated(self.device)
        torch.cuda.reset_peak_memory_stats(self.device)


class PeakWindows:
    def __init__(self, counter: AllocationCounter | None):
        self.counter = counter  # None: nothing is measured
        self.above: dict[str, int] = {}  # name -> the largest peak above entry of its windows since `begin`
        self.stayed: dict[str, int] = {}  # name -> the most one of its windows left allocated beyond its entry
        self.last: dict[str, int] = {}  # name -> its last window's peak above entry (less growth)
        self._peaks: dict[str, int] = {}  # name -> the largest peak of its windows; "" outside every window

    @classmethod
    def for_device(cls, device: torch.device) -> "PeakWindows":
        return cls(CudaCounter(device) if device.type == "cuda" else None)

    def begin(self) -> int:
        """A new stage: forgets the windows and resets the peak; returns what is allocated now (0 unmeasured)."""
        self.above, self.stayed, self.last, self._peaks = {}, {}, {}, {}
        if self.counter is None:
            return 0
        self.counter.reset_peak()
        return self.counter.allocated()

    def _note(self, name: str, peak: int) -> None:
        self._peaks[name] = max(self._peaks.get(name, 0), peak)

    def peak(self, excluding: tuple[str, ...] = ()) -> int:
        """The stage's peak allocated memory since `begin`, outside the windows named in `excluding` (0 when
        nothing is measured)."""
        if self.counter is None:
            return 0
        self._note("", self.counter.max_allocated())
        return max(p for name, p in self._peaks.items() if name not in excluding)

    @contextmanager
    def window(self, name: str, growth: Callable[[], int] | None = None):
        c = self.counter
        if c is None:
            yield
            return
        self._note("", c.max_allocated())
        c.reset_peak()
        entry = c.allocated()
        grown = growth() if growth else 0
        yield
        peak = c.max_allocated()
        self.stayed[name] = max(self.stayed.get(name, 0), c.allocated() - entry)
        c.reset_peak()
        self._note(name, peak)
        grown = (growth() if growth else 0) - grown
        self.last[name] = peak - entry - max(0, grown)
        self.above[name] = max(self.above.get(name, 0), self.last[name])


def grad_bytes(params) -> int:
    """Bytes of the gradients the parameters hold now (a DTensor's: this rank's shard)."""
    total = 0
    for p in params:
        g = p.grad
        if g is not None:
            g = g.to_local() if hasattr(g, "to_local") else g
            total += g.numel() * g.element_size()
    return total


# the caching allocator's counters of work it does beyond handing out cached blocks (torch.cuda.memory_stats):
# a retry frees every cached block (a device synchronisation) and allocates again; near a full device they cost
ALLOCATOR_EVENTS = {"alloc_retries": "num_alloc_retries", "device_allocs": "num_device_alloc",
                    "device_frees": "num_device_free"}


def allocator_events(stats: dict) -> dict[str, int]:
    """The allocator's event counts out of a `torch.cuda.memory_stats` dict (0 where this torch lacks a key)."""
    return {name: int(stats.get(key, 0)) for name, key in ALLOCATOR_EVENTS.items()}
