"""What a run prints: log set-up per rank, a quiet start, a clean stop on Ctrl-C, and the closing summary.

The console is for a person reading it as the run goes (metrics.jsonl and TensorBoard hold every number): one
line per `metrics.log_interval` steps, every evaluation, and a summary that says where the results are.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path

log = logging.getLogger("torchplex")


# ---- logging ----------------------------------------------------------------------------------------------------
def setup_logging(rank: int) -> None:
    """INFO on the ranks listed in LOG_RANK (run_train.sh's variable, default "0"), warnings only on the others;
    ranks other than 0 say who they are."""
    shown = {int(r) for r in os.environ.get("LOG_RANK", "0").split(",") if r.strip().isdigit()}
    local_rank = int(os.environ.get("LOCAL_RANK", rank))  # LOG_RANK counts ranks of this node, as torchrun does
    prefix = f"[rank {rank}] " if rank != 0 else ""
    logging.basicConfig(level=logging.INFO if local_rank in shown else logging.WARNING,
                        format=f"[%(asctime)s] {prefix}%(message)s", datefmt="%H:%M:%S", force=True)


class _DropMessages(logging.Filter):
    def __init__(self, *fragments: str) -> None:
        super().__init__()
        self.fragments = fragments

    def filter(self, record: logging.LogRecord) -> bool:
        return not any(f in record.getMessage() for f in self.fragments)


def quiet_third_party_imports() -> None:
    """Drop the start-up noise of libraries we do not control, and only that: torchao (imported by transformers
    whenever it is installed) reports its optional CUDA kernels missing on CPU, and registers Enums with torch's
    pytree, which torch reports as deprecated. Filters on those loggers, matched on the messages."""
    logging.getLogger("torchao").addFilter(_DropMessages("Failed to load", "Could not load this library"))
    logging.getLogger("torch.utils._pytree").addFilter(_DropMessages("is an Enum subclass"))


# ---- Ctrl-C -------------------------------------------------------------------------------------------------------
class StopRequest:
    """The first Ctrl-C (SIGINT) asks the loop to stop after the current step (so a checkpoint can be written); a
    second Ctrl-C stops at once."""

    def __init__(self) -> None:
        self.requested = False
        self._previous = None

    def install(self) -> "StopRequest":
        # Only in the main thread (signal handlers can be set nowhere else) and where nobody else handles SIGINT
        if threading.current_thread() is threading.main_thread() and \
                signal.getsignal(signal.SIGINT) is signal.default_int_handler:
            self._previous = signal.signal(signal.SIGINT, self._handle)
        return self

    def _handle(self, signum, frame) -> None:
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True
        print("\nstopping after this step (Ctrl-C again to stop now)", file=sys.stderr, flush=True)

    def uninstall(self) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGINT, self._previous)
            self._previous = None


# ---- notices at start -------------------------------------------------------------------------------------------
def optimizer_notice(name: str, device_type: str) -> str | None:
    """A warning for settings that look stuck without one (adamw8bit on CPU paused 86 s at the first step)."""
    if name == "adamw8bit" and device_type == "cpu":
        return ("optimizer.name = 'adamw8bit' on CPU: torchao compiles its 8-bit kernels at the first step (about "
                "90 s on 2 cores, nothing printed meanwhile) and saves no time on CPU; 'adamw' is the CPU choice")
    return None


# ---- the closing summary -----------------------------------------------------------------------------------------
@dataclass
class RunSummary:
    """What the last lines of a run say; filled as the run goes."""

    run_dir: Path
    total_steps: int
    warmup_steps: int = 0
    warmup_done: int = 0  # warm-up steps run (fewer than warmup_steps when stopped during the warm-up)
    steps_done: int = 0
    resumed_from: int | None = None
    evals: list[tuple[int, dict[str, float]]] = field(default_factory=list)
    checkpoint: Path | None = None
    checkpoints_enabled: bool = False
    plot: Path | None = None
    skipped: dict[str, float] = field(default_factory=dict)
    stopped_early: bool = False
    seconds: float = 0.0

    def add_eval(self, step: int, metrics: Mapping[str, float]) -> None:
        if metrics:
            self.evals.append((step, dict(metrics)))

    def lines(self) -> list[str]:
        minutes, seconds = divmod(int(round(self.seconds)), 60)
        head = "stopped" if self.stopped_early else "done"
        started = f", resumed from step {self.resumed_from}" if self.resumed_from else ""
        warmup = ""
        if self.warmup_steps and not self.resumed_from:
            done = self.warmup_done if self.stopped_early and self.steps_done == 0 else self.warmup_steps
            warmup = f" after {self.warmup_steps} warm-up steps" if done == self.warmup_steps else \
                f" after {done}/{self.warmup_steps} warm-up steps (the warm-up is not checkpointed)"
        out = [f"{head}: {self.steps_done}/{self.total_steps} GRPO steps{warmup}{started} in {minutes}m{seconds:02d}s"]
        for name, prefix in _eval_sets(self.evals):
            key = prefix + "accuracy"
            accuracy = [(s, m) for s, m in self.evals if key in m]
            last_step, last = accuracy[-1]
            best_step, best = max(accuracy, key=lambda sm: sm[1][key])
            out.append(f"  eval accuracy{f' ({name})' if name else ''}: last {last[key]:.3f} "
                       f"(step {last_step}{_scored(last, prefix)}), best {best[key]:.3f} (step {best_step})")
        skipped = {k.removeprefix("skipped/"): int(v) for k, v in self.skipped.items() if v}
        out.append("  skipped samples: " + (", ".join(f"{k} {v}" for k, v in sorted(skipped.items())) or "none"))
        out.append(f"  run folder: {self.run_dir} (metrics.jsonl, config.toml"
                   f"{', tb/' if (self.run_dir / 'tb').is_dir() else ''})")
        if self.plot is not None:
            out.append(f"  plot: {self.plot}")
        if self.checkpoint is not None:
            out.append(f"  checkpoint: {self.checkpoint} (resume: run the same command again)")
        elif not self.checkpoints_enabled:
            out.append("  checkpoint: none (checkpoint.enable = false)")
        return out


def _eval_sets(evals: list[tuple[int, dict[str, float]]]) -> list[tuple[str, str]]:
    """(set name, metric prefix) of every eval set with an accuracy, in the order first logged: ("", "eval/") for
    the single unnamed set (eval/accuracy), ("geo", "eval/geo/") for a named one (eval/geo/accuracy)."""
    sets: dict[str, str] = {}
    for _, metrics in evals:
        for key in metrics:
            if key.startswith("eval/") and key.endswith("/accuracy"):
                prefix = key.removesuffix("accuracy")
                sets.setdefault(prefix, prefix.removeprefix("eval/").rstrip("/"))
    return [(name, prefix) for prefix, name in sets.items()]


def _scored(metrics: Mapping[str, float], prefix: str = "eval/") -> str:
    if prefix + "prompts" not in metrics:
        return ""
    scored = int(metrics[prefix + "prompts"])
    asked = int(metrics[prefix + "prompts"] + metrics.get(prefix + "skipped", 0))
    return f", {scored}/{asked} prompts"


def format_eval(step: int, metrics: Mapping[str, float], label: str = "") -> str:
    """`eval step 50: accuracy 0.490 | format 1.00 | 200/200 prompts`; with named eval sets (evaluation.py) one
    `name: ...` part per set, joined by ` || `."""
    sets: dict[str, dict[str, float]] = {}
    for key, value in metrics.items():
        if key.startswith("eval/"):
            name, _, metric = key.removeprefix("eval/").rpartition("/")
            sets.setdefault(name, {})[metric] = value
    parts = []
    for name, values in sets.items():
        shown = [f"{metric} {value:.2f}" if metric == "format" else f"{metric} {value:.3f}"
                 for metric, value in values.items() if metric not in ("prompts", "skipped")]
        if "prompts" in values:
            asked = values["prompts"] + values.get("skipped", 0)
            shown.append(f"{int(values['prompts'])}/{int(asked)} prompts")
        parts.append((f"{name}: " if name else "") + " | ".join(shown))
    return f"eval {label or f'step {step}'}: " + " || ".join(parts)