"""Draw the training curves of a run from its metrics.jsonl (the trainer does at the end; CLI: tools/plot_metrics.py).

Panels (each only when its metric was logged): reward mean with a ±std band (plus any
`eval/...reward...` key), accuracy with eval accuracy (any `eval/...accuracy...` key), KL,
response length (±std band when logged), entropy, grad norm, clip fraction. Eval entries are the
lines that carry `eval/` keys; they are plotted at their own steps. Lines that are not JSON
objects with an integer "step" are skipped and counted. Non-finite values (the "nan"/"inf" strings
MetricsLogger writes) are left out of the curves.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, field
from pathlib import Path

METRICS_FILENAME = "metrics.jsonl"
PLOT_FILENAME = "metrics.png"


@dataclass
class Series:
    steps: list[int] = field(default_factory=list)
    values: list[float] = field(default_factory=list)


@dataclass
class MetricsHistory:
    series: dict[str, Series]
    malformed_lines: int

    def get(self, key: str) -> Series | None:
        found = self.series.get(key)
        return found if found is not None and found.steps else None


def _as_float(value: object) -> float | None:
    """Numbers and the "nan"/"inf" strings MetricsLogger writes; None for anything else."""
    if isinstance(value, bool):
        return float(value)
    if isinstance(value, (int, float)):
        return float(value)
    if isinstance(value, str) and value.lower() in ("nan", "inf", "-inf", "infinity", "-infinity"):
        return float(value)
    return None


def read_metrics(path: Path) -> MetricsHistory:
    if not path.is_file():
        raise FileNotFoundError(f"metrics file not found: {path}")
    series: dict[str, Series] = {}
    malformed = 0
    lines = 0
    with open(path, encoding="utf-8") as f:
        for raw in f:
            if not raw.strip():
                continue
            lines += 1
            try:
                record = json.loads(raw)
            except json.JSONDecodeError:
                malformed += 1
                continue
            if not isinstance(record, dict) or not isinstance(record.get("step"), int):
                malformed += 1
                continue
            step = record["step"]
            for key, raw_value in record.items():
                if key in ("step", "wall_time"):
                    continue
                value = _as_float(raw_value)
                if value is None or not math.isfinite(value):
                    continue
                entry = series.setdefault(key, Series())
                entry.steps.append(step)
                entry.values.append(value)
    if lines == 0:
        raise ValueError(f"metrics file is empty: {path}")
    if malformed == lines:
        raise ValueError(f"metrics file has no valid lines ({malformed} malformed): {path}")
    return MetricsHistory(series=series, malformed_lines=malformed)


def _band(ax, mean: Series, std: Series | None, color: str) -> None:
    """Shade mean ± std at the steps where both were logged."""
    if std is None:
        return
    std_at = dict(zip(std.steps, std.values))
    steps = [s for s in mean.steps if s in std_at]
    centre = [v for s, v in zip(mean.steps, mean.values) if s in std_at]
    low = [c - std_at[s] for s, c in zip(steps, centre)]
    high = [c + std_at[s] for s, c in zip(steps, centre)]
    ax.fill_between(steps, low, high, color=color, alpha=0.2, linewidth=0)


@dataclass
class Panel:
    title: str
    curves: list[tuple[str, Series]]  # (label, curve)
    bands: list[tuple[Series, Series | None]] = field(default_factory=list)  # (mean, std) to shade


def _panels(history: MetricsHistory) -> list[Panel]:
    """Every panel that has data, in display order."""
    panels = []
    reward = history.get("reward/mean")
    if reward is not None:
        eval_keys = sorted(k for k in history.series if k.startswith("eval/") and "reward" in k and "std" not in k)
        curves = [("reward/mean", reward)] + [(k, history.get(k)) for k in eval_keys if history.get(k) is not None]
        panels.append(Panel("reward", curves, [(reward, history.get("reward/std"))]))
    accuracy_keys = ["accuracy"] + sorted(k for k in history.series if k.startswith("eval/") and "accuracy" in k)
    accuracy = [(k, history.get(k)) for k in accuracy_keys if history.get(k) is not None]
    if accuracy:
        panels.append(Panel("accuracy", accuracy, []))
    kl = history.get("kl")
    if kl is not None:
        panels.append(Panel("KL", [("kl", kl)], []))
    length = history.get("response_length/mean")
    if length is not None:
        band = (length, history.get("response_length/std"))
        panels.append(Panel("response length", [("response_length/mean", length)], [band]))
    for key in ("entropy", "grad_norm", "clip_fraction"):
        curve = history.get(key)
        if curve is not None:
            panels.append(Panel(key.replace("_", " "), [(key, curve)], []))
    return panels


def plot_metrics(run_dir: Path | str, out: Path | str | None = None) -> Path:
    """Read `run_dir/metrics.jsonl`, draw the panel grid and save it (default `run_dir/metrics.png`)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    run_dir = Path(run_dir)
    metrics_path = run_dir / METRICS_FILENAME
    history = read_metrics(metrics_path)
    if history.malformed_lines:
        print(f"plot_metrics: skipped {history.malformed_lines} malformed line(s) in {metrics_path}")
    panels = _panels(history)
    if not panels:
        raise ValueError(f"no plottable metrics (reward/mean, accuracy, kl, ...) in {metrics_path}")

    ncols = min(3, len(panels))
    nrows = math.ceil(len(panels) / ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(5 * ncols, 3.5 * nrows), squeeze=False)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for ax, panel in zip(axes.flat, panels):
        for i, (label, curve) in enumerate(panel.curves):
            marker = "o" if label.startswith("eval/") else None
            ax.plot(curve.steps, curve.values, label=label, color=colors[i % len(colors)], marker=marker, markersize=3)
        for mean, std in panel.bands:
            _band(ax, mean, std, colors[0])
        ax.set_title(panel.title)
        ax.set_xlabel("step")
        ax.grid(alpha=0.3)
        if len(panel.curves) > 1:
            ax.legend(fontsize="small")
    for ax in list(axes.flat)[len(panels):]:
        ax.set_visible(False)
    fig.suptitle(str(run_dir))
    fig.tight_layout()

    out_path = Path(out) if out is not None else run_dir / PLOT_FILENAME
    out_path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_path, dpi=100)
    plt.close(fig)
    return out_path
