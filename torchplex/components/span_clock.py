"""Named spans of a phase timed on the host and on the device stream at once, without synchronising inside it.

    clock = SpanClock(device)
    with clock.span("recompute"):      # host: the time to enqueue the span's work; device: CUDA events on the
        ...                            # current stream around it (the GPU's time from its first to its last kernel)
    clock.spans()                      # after the phase (synchronises once): [{"name", "host_s", "device_s",
                                       # "idle_before_s"}, ...]

Where a span's device time is well above its host time, the GPU is the bound; where the two are close, the host's
launches are (the GPU waited on them), and `idle_before_s` is the device time between the previous span's end and
this one's start: work outside every span, or none. On CPU the device fields are None.
"""

from __future__ import annotations

import time
from contextlib import contextmanager, nullcontext

import torch


class SpanClock:
    def __init__(self, device: torch.device):
        self.cuda = torch.device(device).type == "cuda"
        self._spans: list[tuple[str, float, object, object]] = []

    @contextmanager
    def span(self, name: str):
        start = end = None
        if self.cuda:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
        t = time.perf_counter()
        try:
            yield
        finally:
            host = time.perf_counter() - t
            if self.cuda:
                end.record()
            self._spans.append((name, host, start, end))

    def spans(self) -> list[dict]:
        if self.cuda and self._spans:
            torch.cuda.synchronize()
        out, previous = [], None
        for name, host, start, end in self._spans:
            row = {"name": name, "host_s": host, "device_s": None, "idle_before_s": None}
            if self.cuda:
                row["device_s"] = start.elapsed_time(end) / 1e3
                if previous is not None:
                    row["idle_before_s"] = max(0.0, previous.elapsed_time(start) / 1e3)
                previous = end
            out.append(row)
        return out


def span_or_nothing(clock: SpanClock | None):
    """`clock.span`, or without a clock a span that times nothing."""
    return clock.span if clock is not None else (lambda name: nullcontext())


def span_totals(spans: list[dict]) -> dict[str, dict]:
    """Per span name: how many, and the sums of host, device and idle-before seconds (None where not measured)."""
    totals: dict[str, dict] = {}
    for s in spans:
        t = totals.setdefault(s["name"], {"count": 0, "host_s": 0.0, "device_s": None, "idle_before_s": None})
        t["count"] += 1
        t["host_s"] += s["host_s"]
        for key in ("device_s", "idle_before_s"):
            if s[key] is not None:
                t[key] = (t[key] or 0.0) + s[key]
    return totals
