"""Wall-clock timeline of a real step: phases and decode-window jobs per lane, as a Chrome trace or a PNG."""

from __future__ import annotations

import json
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path

import torch

from .phases import PHASE_COLOURS


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
        return draw_timelines({"": self}, path, title)

    @classmethod
    def from_chrome_trace(cls, path: str | Path) -> "Timeline":
        """A timeline written by to_chrome_trace, back (to draw traces of several runs together)."""
        events = json.loads(Path(path).read_text())["traceEvents"]
        lanes = {e["tid"]: e["args"]["name"] for e in events if e["ph"] == "M"}
        return cls(spans=[Span(e["name"], lanes[e["tid"]], e["ts"] / 1e6, (e["ts"] + e["dur"]) / 1e6)
                          for e in events if e["ph"] == "X"], origin=0.0)


def draw_timelines(timelines: dict[str, Timeline], path: str | Path, title: str = "") -> Path:
    """PNG of one or more timelines on a shared time axis (one row per label and lane), phases in fixed colours."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = []  # (row label, spans)
    for label, tl in timelines.items():
        lanes = sorted({s.lane for s in tl.spans}, key=lambda lane: (lane != "main", lane))
        for lane in lanes:
            name = lane if not label else (label if lane == "main" else f"{label}: {lane}")
            rows.append((name, [s for s in tl.spans if s.lane == lane]))
    names = sorted({s.name for _, spans in rows for s in spans})
    # One colour per phase in every picture (side-by-side timelines compare), others after them.
    others = [n for n in names if n not in PHASE_COLOURS]
    colours = {**PHASE_COLOURS, **{n: plt.get_cmap("tab10")((i + 5) % 10) for i, n in enumerate(others)}}
    fig, ax = plt.subplots(figsize=(11, 1.2 + 0.5 * len(rows)))
    for y, (_, spans) in enumerate(rows):
        for s in spans:
            ax.broken_barh([(s.start_s, s.end_s - s.start_s)], (y - 0.35, 0.7), color=colours[s.name])
    ax.set_yticks(range(len(rows)), [r[0] for r in rows])
    ax.set_xlabel("seconds")
    ax.invert_yaxis()
    handles = [plt.Rectangle((0, 0), 1, 1, color=colours[n]) for n in names]
    ax.legend(handles, names, loc="center left", bbox_to_anchor=(1.01, 0.5), fontsize=8, frameon=False)
    ax.set_title(title)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
