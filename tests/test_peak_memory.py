"""Peak memory of windows inside a stage (components/peak_memory.py): a window's peak above its entry less what grew
for good, the stage's peak kept across the windows' resets (outside named windows too), and the whole-phase readers
(PhaseTimer, the benchmarks) seeing the peaks the windows' resets took from the allocator's counter."""

import torch

from torchplex.components import peak_memory
from torchplex.components.metrics import PhaseTimer
from torchplex.components.peak_memory import CudaCounter, PeakWindows

from step_runners import StandInCounter


def test_a_window_is_its_peak_above_entry_less_what_grew_for_good():
    counter = StandInCounter(100)
    windows = PeakWindows(counter)
    windows.begin()
    counter.now, counter.top = 150, 400  # the stage peaks at 400 before its first window
    grads = {"bytes": 0}
    with windows.window("recompute", growth=lambda: grads["bytes"]):
        counter.top, counter.now, grads["bytes"] = 150 + 70, 170, 20  # 70 above entry, 20 of it gradients that stay
    with windows.window("recompute"):
        counter.top = 170 + 30
    with windows.window("whole_graph"):
        counter.top = 170 + 500
    assert windows.above == {"recompute": 50, "whole_graph": 500}  # max(70 - 20, 30)
    assert windows.peak() == 670
    assert windows.peak(excluding=("whole_graph",)) == 400  # the stage outside the window that used what was free
    off = PeakWindows(None)
    assert off.begin() == 0
    with off.window("recompute"):
        pass
    assert off.above == {} and off.peak() == 0


class FakeCuda:
    """torch.cuda's allocator counters for one device."""

    def __init__(self):
        self.now = self.top = 0

    def install(self, monkeypatch):
        monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: self.now)
        monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: max(self.top, self.now))
        monkeypatch.setattr(torch.cuda, "reset_peak_memory_stats", lambda device=None: setattr(self, "top", self.now))
        monkeypatch.setattr(torch.cuda, "current_device", lambda: 0)
        monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)

    def allocate(self, nbytes):
        self.now += nbytes
        self.top = max(self.top, self.now)


def test_whole_phase_readers_see_the_peaks_a_window_reset_took(monkeypatch):
    """Defect a window would bring: PhaseTimer reads the allocator's peak at a phase's end, and the windows inside
    the train stage reset that counter, so the phase's (and the benchmark row's) peak would be only the last
    window's. `max_allocated` adds back what the resets took; `reset_peak` starts a new phase from zero."""
    cuda = FakeCuda()
    cuda.install(monkeypatch)
    timer = PhaseTimer(torch.device("cuda", 0))
    windows = PeakWindows(CudaCounter(torch.device("cuda", 0)))
    with timer.phase("train"):
        windows.begin()
        with windows.window("recompute"):
            cuda.allocate(900)  # the micro-batch's transient
            cuda.allocate(-900)
        with windows.window("recompute"):
            cuda.allocate(100)
            cuda.allocate(-100)
    assert windows.above == {"recompute": 900}
    assert timer.peak_bytes["train"] == 900 == peak_memory.max_allocated(0)
    with timer.phase("optimizer"):
        cuda.allocate(50)
    assert timer.peak_bytes["optimizer"] == 50  # a new phase forgets what the windows carried


def test_what_a_window_leaves_allocated_is_the_largest_of_its_windows():
    """Defect (H200, 7B, img P = 64, decomposed in 3 rounds): training's unplanned bytes subtract the held batched
    prefixes, read from what the prefix forward's window left allocated; that was the last window's (the last
    round's 8.0 GB, not the first round's ~14), so 6 GB of held prefixes counted as unplanned in the next plans."""
    counter = StandInCounter(100)
    windows = PeakWindows(counter)
    windows.begin()
    with windows.window("prefix_forward"):
        counter.now = 100 + 60  # round 0 holds 60
    counter.now = 100  # its backward frees them
    with windows.window("prefix_forward"):
        counter.now = 100 + 25  # round 1 holds 25
    assert windows.stayed == {"prefix_forward": 60}
    windows.begin()
    assert windows.stayed == {}
