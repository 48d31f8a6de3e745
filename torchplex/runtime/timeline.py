"""Wall-clock timeline of a real step: phases and decode-window jobs per lane, as a Chrome trace or a PNG."""

from __future__ import annotations

import json
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch


@dataclass
class Span:
    name: str
    lane: str
    start_s: float
    end_s: float


@dataclass
class Timeline:
    spans: list[Span] = field(default_factory=list)
    origin: float = field(default_factory=time.perf_counter)
    sync_cuda: bool = False  # synchronise the launching stream around spans: its GPU work is charged to the span

    @contextmanager
    def span(self, name: str, lane: str = "main", sync: bool = True):
        """A span of the calling thread's current stream: the decode window's jobs, on their own thread and side
        stream, record when their GPU work completed without holding up the decode loop. sync=False records host
        launch time only (for work launched beside another lane from the same thread)."""
        sync = sync and self.sync_cuda
        # The current stream only: copies the memory manager runs on its own streams keep going across phases.
        if sync:
            torch.cuda.current_stream().synchronize()
        start = time.perf_counter()
        try:
            yield
        finally:
            if sync:
                torch.cuda.current_stream().synchronize()
            self.spans.append(Span(name, lane, start - self.origin, time.perf_counter() - self.origin))

    def total_s(self, name: str) -> float:
        return sum(s.end_s - s.start_s for s in self.spans if s.name == name)

    def to_chrome_trace(self, path: str | Path) -> Path:
        lanes = sorted({s.lane for s in self.spans})
        events = [{"name": s.name, "ph": "X", "pid": 0, "tid": lanes.index(s.lane), "ts": s.start_s * 1e6,
                   "dur": (s.end_s - s.start_s) * 1e6, "args": {"lane": s.lane}} for s in self.spans]
        events += [{"name": "thread_name", "ph": "M", "pid": 0, "tid": i, "args": {"name": lane}}
                   for i, lane in enumerate(lanes)]
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"traceEvents": events}))
        return path

    def draw(self, path: str | Path, title: str = "") -> Path:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        lanes = sorted({s.lane for s in self.spans}, key=lambda lane: (lane != "main", lane))
        names = sorted({s.name for s in self.spans})
        colours = {n: plt.get_cmap("tab10")(i % 10) for i, n in enumerate(names)}
        fig, ax = plt.subplots(figsize=(11, 1.2 + 0.6 * len(lanes)))
        for s in self.spans:
            y = lanes.index(s.lane)
            ax.broken_barh([(s.start_s, s.end_s - s.start_s)], (y - 0.35, 0.7), color=colours[s.name])
        ax.set_yticks(range(len(lanes)), lanes)
        ax.set_xlabel("seconds")
        ax.invert_yaxis()
        handles = [plt.Rectangle((0, 0), 1, 1, color=colours[n]) for n in names]
        ax.legend(handles, names, loc="upper center", bbox_to_anchor=(0.5, -0.35), ncol=min(len(names), 6),
                  fontsize=8, frameon=False)
        ax.set_title(title)
        fig.tight_layout()
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        fig.savefig(path, dpi=110)
        plt.close(fig)
        return path
