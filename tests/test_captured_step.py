"""The room a CUDA-graph capture is given: the decision of `make_room`, the driver's calls stood in for on CPU
(the capture itself needs a GPU; benchmarks/scale_gpu.sh img-64 runs it)."""

import torch

from torchplex.components import captured_step
from torchplex.components.captured_step import make_room


def driver(monkeypatch, free: int) -> list[str]:
    calls = []
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda *a: (calls.append("info"), (free, 2**37))[1])
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: calls.append("empty"))
    return calls


def test_a_capture_short_of_driver_memory_empties_the_cache_first(monkeypatch):
    calls = driver(monkeypatch, free=19 * 2**20)  # what the failed img P = 64 capture found free
    assert make_room(captured_step.CAPTURE_ROOM)
    assert calls == ["info", "empty"]


def test_a_capture_with_room_keeps_the_cache(monkeypatch):
    calls = driver(monkeypatch, free=4 * 2**30)
    assert not make_room(captured_step.CAPTURE_ROOM)
    assert not make_room(4 * 2**30)  # exactly enough is enough
    assert calls == ["info", "info"]
    assert make_room(4 * 2**30 + 1)
    assert calls[-1] == "empty"
