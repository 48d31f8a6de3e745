"""Training metrics: a JSONL + TensorBoard logger, a one-line step summary, a progress bar, and a
per-phase wall-time / peak-memory timer.

Everything here is rank-aware in the simplest way: only rank 0 writes files or draws a bar, other
ranks get objects whose methods do nothing, so the trainer can call them unconditionally.

Metric key convention (what the trainer logs and `format_step_line` knows how to show):

    reward/mean, reward/std      group reward statistics            -> "reward 0.41±0.22"
    accuracy                     fraction of correct rollouts       -> "acc 0.38"
    kl                           policy-vs-reference KL             -> "kl 0.0012"
    entropy                      mean token entropy                 -> "ent 1.3"
    clip_fraction                fraction of tokens ratio-clipped   -> "clip 0.02"
    response_length/mean         mean generated tokens              -> "len 14.2"
    grad_norm                    total grad norm before clipping    -> "gnorm 0.83"
    time/step_s                  wall time of the whole step        -> "12.3s"
    time/rollout_s, time/ref_s,
    time/train_s                 phase times (PhaseTimer keys)      -> "(roll 5.1 ref 2.0 train 5.2)"
    memory/peak_gib              peak memory over the step          -> "mem 1.2G"
    skipped/bad_samples          samples dropped as malformed       -> "skip 3" (only when non-zero)

Any other key is still written to metrics.jsonl and TensorBoard; the summary line just omits it.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import sys
import time
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import torch

from . import peak_memory

METRICS_FILENAME = "metrics.jsonl"
TENSORBOARD_DIRNAME = "tb"

_GIB = 1024**3
_log = logging.getLogger("torchplex")


# --------------------------------------------------------------------------------------------------
# JSONL + TensorBoard logger
# --------------------------------------------------------------------------------------------------


def _to_python_scalar(key: str, value: Any) -> float | int | bool | str:
    """Turn tensors / numpy scalars into plain Python numbers so json and TensorBoard accept them."""
    if isinstance(value, torch.Tensor):
        if value.numel() != 1:
            raise TypeError(f"metric {key!r} is a tensor with {value.numel()} elements; log a scalar")
        value = value.item()
    elif hasattr(value, "item") and callable(value.item):  # numpy scalar / 0-d array
        value = value.item()
    if isinstance(value, (bool, int, float, str)):
        return value
    raise TypeError(f"metric {key!r} has unsupported type {type(value).__name__}; log a number")


def _json_safe(value: float | int | bool | str) -> float | int | bool | str:
    """JSON has no NaN/Infinity; write them as the strings Python's float() reads back."""
    if isinstance(value, float) and not math.isfinite(value):
        return "nan" if math.isnan(value) else ("inf" if value > 0 else "-inf")
    return value


class MetricsLogger:
    """Appends one JSON object per step to `run_dir/metrics.jsonl` and mirrors numbers to TensorBoard.

    Each line is `{"step": int, "wall_time": float, <metric>: value, ...}`. Non-finite floats are written
    as the strings "nan", "inf", "-inf" (valid JSON; `float(s)` restores them). The file is flushed
    after every step so a crashed run keeps everything logged before the crash.
    """

    def __init__(self, run_dir: Path | str, tensorboard: bool = True, rank: int = 0,
                 wandb_project: str | None = None, run_name: str = "", config: dict | None = None) -> None:
        self.run_dir = Path(run_dir)
        self.enabled = rank == 0
        self._file = None
        self._writer = None
        self._wandb = None
        if not self.enabled:
            return
        if wandb_project is not None:  # optional extra: imported only when asked for (components/wandb_run.py)
            from .wandb_run import start_wandb

            self._wandb = start_wandb(self.run_dir, wandb_project, run_name, config)
        self.run_dir.mkdir(parents=True, exist_ok=True)
        # Append so that a resumed run continues the same file.
        self._file = open(self.run_dir / METRICS_FILENAME, "a", encoding="utf-8")
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(log_dir=str(self.run_dir / TENSORBOARD_DIRNAME))

    @property
    def path(self) -> Path:
        return self.run_dir / METRICS_FILENAME

    def drop_after(self, step: int) -> int:
        """Remove the records of steps after `step` (a run resumed from a checkpoint at `step` logs them again);
        returns how many were removed. A line that is not a JSON record is kept as it is. TensorBoard's events of
        those steps are purged too (SummaryWriter's purge_step), or its curves would hold them twice."""
        if not self.enabled or self._file is None:
            return 0
        if self._writer is not None:
            from torch.utils.tensorboard import SummaryWriter

            self._writer.close()
            self._writer = SummaryWriter(log_dir=str(self.run_dir / TENSORBOARD_DIRNAME), purge_step=step + 1)
        self._file.close()
        kept, dropped = [], 0
        for line in self.path.read_text(encoding="utf-8").splitlines(keepends=True):
            try:
                late = int(json.loads(line)["step"]) > step
            except (ValueError, KeyError, TypeError):
                late = False
            dropped += late
            if not late:
                kept.append(line)
        tmp = self.path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(kept), encoding="utf-8")
        tmp.replace(self.path)
        self._file = open(self.path, "a", encoding="utf-8")
        return dropped

    def log(self, step: int, metrics: Mapping[str, Any]) -> None:
        if not self.enabled:
            return
        if self._file is None:
            raise RuntimeError(f"MetricsLogger for {self.run_dir} is closed")
        values = {key: _to_python_scalar(key, value) for key, value in metrics.items()}
        record: dict[str, Any] = {"step": int(step), "wall_time": time.time()}
        record.update({key: _json_safe(value) for key, value in values.items()})
        self._file.write(json.dumps(record, allow_nan=False) + "\n")
        self._file.flush()
        if self._writer is not None:
            for key, value in values.items():
                if isinstance(value, (int, float)):  # bool is an int: logged as 0/1
                    self._writer.add_scalar(key, float(value), global_step=int(step))
            # RL steps take seconds, so flushing every step costs nothing and keeps TB live.
            self._writer.flush()
        if self._wandb is not None:
            self._wandb.log({k: v for k, v in values.items() if isinstance(v, (int, float))}, step=int(step))

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None

    def __enter__(self) -> MetricsLogger:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# --------------------------------------------------------------------------------------------------
# One-line step summary and progress bar
# --------------------------------------------------------------------------------------------------


def _compact(value: float) -> str:
    """Short human number: 0.41, 0.0012, 14.2, 830, nan."""
    value = float(value)
    if not math.isfinite(value):
        return str(value)
    magnitude = abs(value)
    if magnitude == 0:
        return "0"
    if magnitude >= 100:
        return f"{value:.0f}"
    if magnitude >= 1:
        return f"{value:.3g}"
    return f"{value:.2g}"


# (metric key, label) pairs shown as "label value", in display order.
_SIMPLE_FIELDS: tuple[tuple[str, str], ...] = (
    ("accuracy", "acc"),
    ("kl", "kl"),
    ("entropy", "ent"),
    ("clip_fraction", "clip"),
    ("response_length/mean", "len"),
    ("grad_norm", "gnorm"),
)
_PHASE_FIELDS: tuple[tuple[str, str], ...] = (
    ("time/rollout_s", "roll"),
    ("time/ref_s", "ref"),
    ("time/train_s", "train"),
)


def format_metrics(metrics: Mapping[str, Any]) -> str:
    """The metrics part of the step line (no "step i/n"); only keys present in `metrics` appear."""
    parts: list[str] = []
    if "reward/mean" in metrics:
        reward = _compact(metrics["reward/mean"])
        if "reward/std" in metrics:
            reward += "±" + _compact(metrics["reward/std"])
        parts.append(f"reward {reward}")
    for key, label in _SIMPLE_FIELDS:
        if key in metrics:
            parts.append(f"{label} {_compact(metrics[key])}")
    phases = " ".join(f"{label} {float(metrics[key]):.1f}" for key, label in _PHASE_FIELDS if key in metrics)
    if "time/step_s" in metrics:
        timing = f"{float(metrics['time/step_s']):.1f}s"
        parts.append(f"{timing} ({phases})" if phases else timing)
    elif phases:
        parts.append(phases)
    if "memory/peak_gib" in metrics:
        parts.append(f"mem {float(metrics['memory/peak_gib']):.1f}G")
    skipped = metrics.get("skipped/bad_samples", 0)
    if skipped:
        parts.append(f"skip {_compact(skipped)}")
    return " | ".join(parts)


def format_step_line(step: int, total: int, metrics: Mapping[str, Any]) -> str:
    """e.g. `step 3/20 | reward 0.41±0.22 | acc 0.38 | kl 0.0012 | len 14.2 | 12.3s (roll 5.1 ...)`."""
    body = format_metrics(metrics)
    head = f"step {step}/{total}"
    return f"{head} | {body}" if body else head


class StepProgress:
    """A tqdm bar over the steps of one phase whose postfix is the metrics summary of the last step.

    tqdm already prints "i/n", so the postfix is `format_metrics`, not the full step line. The bar is drawn only
    where it can redraw in place (a terminal): in a log file or a pipe every redraw would be a new line, so there
    `write` lines (every `metrics.log_interval` steps) are the progress. Ranks other than 0 show nothing.
    """

    def __init__(self, total: int, initial: int = 0, rank: int = 0, enable: bool = True, desc: str = "train",
                 stream=None) -> None:
        from tqdm import tqdm

        stream = stream if stream is not None else sys.stderr
        self._rank = rank
        self._bar = tqdm(
            total=total,
            initial=initial,
            desc=desc,
            unit="step",
            dynamic_ncols=True,
            file=stream,
            disable=not enable or rank != 0 or not _is_terminal(stream),
        )

    def update(self, step: int, metrics: Mapping[str, Any]) -> None:
        """Move the bar to `step` (absolute, so resumed runs and skipped steps stay right)."""
        self._bar.set_postfix_str(format_metrics(metrics), refresh=False)
        self._bar.update(step - self._bar.n)

    @property
    def n(self) -> int:
        return int(self._bar.n)

    @property
    def postfix(self) -> str:
        return self._bar.postfix or ""

    def write(self, line: str) -> None:
        """Print a line above the bar without breaking it (through the log when there is no bar)."""
        if self._rank != 0:
            return
        if self._bar.disable:
            _log.info(line)
        else:
            self._bar.write(line)

    def close(self) -> None:
        self._bar.close()


def _is_terminal(stream) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # no isatty, or closed
        return False


# --------------------------------------------------------------------------------------------------
# Per-phase wall time and peak memory
# --------------------------------------------------------------------------------------------------


def process_peak_rss_bytes() -> int:
    """Peak resident set size of this process since it started (0 where `resource` is missing).

    Unlike CUDA's peak counter this cannot be reset, so on CPU every phase reports the process peak.
    """
    try:
        import resource
    except ImportError:  # Windows
        return 0
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    # Linux reports KiB, macOS bytes.
    return int(peak if sys.platform == "darwin" else peak * 1024)


class PhaseTimer:
    """Records wall time and peak memory of named phases of a training step.

        timer = PhaseTimer()
        with timer.phase("rollout"):
            ...
        with timer.phase("train"):
            ...
        metrics = timer.metrics()   # {"time/rollout_s": ..., "memory/rollout_peak_gib": ...,
                                    #  "time/train_s": ..., ..., "memory/peak_gib": max over phases}
        timer.reset()               # before the next step

    On CUDA the device is synchronized at both ends of a phase, so asynchronous kernels are charged
    to the phase that launched them, and the allocator's peak counter is reset at phase start, so the
    peak is the phase's own. On CPU the peak is the process RSS peak (see `process_peak_rss_bytes`).
    A phase entered twice in one step accumulates time and keeps the larger peak. Phases do not
    nest: the CUDA peak counter is global, so a nested phase would corrupt the outer one's peak.
    """

    def __init__(self, device: torch.device | str | None = None) -> None:
        if device is None:
            device = "cuda" if torch.cuda.is_available() else "cpu"
        self.device = torch.device(device)
        self.seconds: dict[str, float] = {}
        self.peak_bytes: dict[str, int] = {}
        # CUDA: the allocator's retries and device allocations / frees in each phase (peak_memory.allocator_events)
        self.allocator_events: dict[str, dict[str, int]] = {}
        self._active: str | None = None

    @property
    def _on_cuda(self) -> bool:
        return self.device.type == "cuda"

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        if self._active is not None:
            raise RuntimeError(f"phase {name!r} started inside phase {self._active!r}; phases do not nest")
        self._active = name
        if self._on_cuda:
            torch.cuda.synchronize(self.device)
            peak_memory.reset_peak(self.device)
            events = peak_memory.allocator_events(torch.cuda.memory_stats(self.device))
        start = time.perf_counter()
        try:
            yield
        finally:
            if self._on_cuda:
                torch.cuda.synchronize(self.device)
            elapsed = time.perf_counter() - start
            peak = peak_memory.max_allocated(self.device) if self._on_cuda else process_peak_rss_bytes()
            self.seconds[name] = self.seconds.get(name, 0.0) + elapsed
            self.peak_bytes[name] = max(self.peak_bytes.get(name, 0), int(peak))
            if self._on_cuda:
                now = peak_memory.allocator_events(torch.cuda.memory_stats(self.device))
                seen = self.allocator_events.setdefault(name, dict.fromkeys(now, 0))
                for key, count in now.items():
                    seen[key] += count - events[key]
            self._active = None

    def metrics(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for name, seconds in self.seconds.items():
            out[f"time/{name}_s"] = seconds
            out[f"memory/{name}_peak_gib"] = self.peak_bytes[name] / _GIB
        if self.peak_bytes:
            out["memory/peak_gib"] = max(self.peak_bytes.values()) / _GIB
        return out

    def reset(self) -> None:
        self.seconds.clear()
        self.peak_bytes.clear()
        self.allocator_events.clear()
