"""Specification of the metrics logger, step summary line, progress bar, phase timer and plot tool."""

from __future__ import annotations

import importlib.util
import io
import json
import logging
import math
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from torchplex.components.metrics import (
    MetricsLogger,
    PhaseTimer,
    StepProgress,
    format_metrics,
    format_step_line,
    process_peak_rss_bytes,
)

REPO_ROOT = Path(__file__).resolve().parents[1]
PLOT_SCRIPT = REPO_ROOT / "tools" / "plot_metrics.py"


def _load_plot_module():
    # Loaded from its path: tools/ is a script folder, not necessarily on sys.path under pytest.
    spec = importlib.util.spec_from_file_location("plot_metrics_under_test", PLOT_SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up while being defined
    spec.loader.exec_module(module)
    return module


def _read_jsonl(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


# ---- MetricsLogger ---------------------------------------------------------------------------------


def test_log_appends_one_valid_json_object_per_step(tmp_path):
    with MetricsLogger(tmp_path, tensorboard=False) as logger:
        logger.log(1, {"reward/mean": 0.5, "accuracy": 0.25})
        logger.log(2, {"reward/mean": 0.75, "kl": torch.tensor(0.125), "bad": 3})
    records = _read_jsonl(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in records] == [1, 2]
    assert records[0]["reward/mean"] == 0.5 and records[0]["accuracy"] == 0.25
    assert records[1]["kl"] == 0.125  # 0-d tensor became a float
    assert records[1]["bad"] == 3


def test_log_writes_non_finite_values_as_strings_that_float_reads_back(tmp_path):
    with MetricsLogger(tmp_path, tensorboard=False) as logger:
        logger.log(1, {"a": float("nan"), "b": float("inf"), "c": -float("inf"), "d": 1.5})
    raw = (tmp_path / "metrics.jsonl").read_text()
    record = json.loads(raw)  # strict JSON: Python's parser would also accept bare NaN, so check text
    assert "NaN" not in raw and "Infinity" not in raw
    assert math.isnan(float(record["a"]))
    assert float(record["b"]) == math.inf and float(record["c"]) == -math.inf
    assert record["d"] == 1.5


def test_log_flushes_every_step(tmp_path):
    logger = MetricsLogger(tmp_path, tensorboard=False)
    logger.log(7, {"x": 1.0})
    # Read while the logger is still open: the line must already be on disk.
    assert _read_jsonl(tmp_path / "metrics.jsonl")[0]["step"] == 7
    logger.close()


def test_log_rejects_non_scalar_metrics_naming_the_key(tmp_path):
    with MetricsLogger(tmp_path, tensorboard=False) as logger:
        with pytest.raises(TypeError, match="'vec'"):
            logger.log(1, {"vec": torch.ones(3)})


def test_non_zero_rank_writes_nothing(tmp_path):
    logger = MetricsLogger(tmp_path / "run", tensorboard=True, rank=1)
    logger.log(1, {"x": 1.0})
    logger.close()
    assert not (tmp_path / "run").exists()


def test_tensorboard_receives_the_logged_scalars(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    with MetricsLogger(tmp_path) as logger:
        logger.log(1, {"reward/mean": 0.5, "note": "text is jsonl-only"})
        logger.log(2, {"reward/mean": 0.25})
    tb_dir = tmp_path / "tb"
    assert list(tb_dir.glob("events.out.tfevents.*"))
    events = EventAccumulator(str(tb_dir))
    events.Reload()
    assert events.Tags()["scalars"] == ["reward/mean"]
    scalars = events.Scalars("reward/mean")
    assert [(e.step, e.value) for e in scalars] == [(1, 0.5), (2, 0.25)]


# ---- step line and progress bar --------------------------------------------------------------------

FULL_METRICS = {
    "reward/mean": 0.41,
    "reward/std": 0.22,
    "accuracy": 0.38,
    "kl": 0.0012,
    "entropy": 1.25,
    "clip_fraction": 0.02,
    "response_length/mean": 14.2,
    "grad_norm": 0.83,
    "time/step_s": 12.34,
    "time/rollout_s": 5.12,
    "time/ref_s": 2.0,
    "time/train_s": 5.22,
    "memory/peak_gib": 1.23,
    "skipped/bad_samples": 3,
    "unknown/key": 99.0,
}


def test_step_line_shows_every_known_key_in_order():
    line = format_step_line(3, 20, FULL_METRICS)
    assert line == (
        "step 3/20 | reward 0.41±0.22 | acc 0.38 | kl 0.0012 | ent 1.25 | clip 0.02 | len 14.2"
        " | gnorm 0.83 | 12.3s (roll 5.1 ref 2.0 train 5.2) | mem 1.2G | skip 3"
    )


def test_step_line_omits_absent_keys_and_zero_skips():
    line = format_step_line(1, 5, {"reward/mean": 0.5, "kl": 2.5e-5, "skipped/bad_samples": 0})
    assert line == "step 1/5 | reward 0.5 | kl 2.5e-05"
    assert format_step_line(1, 5, {}) == "step 1/5"


def test_step_line_shows_non_finite_values():
    assert format_step_line(2, 4, {"grad_norm": float("nan")}) == "step 2/4 | gnorm nan"


class FakeTerminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_progress_bar_postfix_is_the_metrics_summary(tmp_path):
    bar = StepProgress(total=20, initial=2, stream=FakeTerminal())
    bar.update(3, FULL_METRICS)
    assert bar.n == 3
    assert bar.postfix == format_metrics(FULL_METRICS)
    bar.close()


# ---- PhaseTimer ------------------------------------------------------------------------------------


def test_phase_timer_measures_and_accumulates_wall_time():
    timer = PhaseTimer(device="cpu")
    with timer.phase("rollout"):
        time.sleep(0.05)
    with timer.phase("train"):
        time.sleep(0.02)
    with timer.phase("train"):
        time.sleep(0.02)
    metrics = timer.metrics()
    assert 0.05 <= metrics["time/rollout_s"] < 0.5
    assert 0.04 <= metrics["time/train_s"] < 0.5


def test_phase_timer_reports_process_peak_rss_on_cpu():
    timer = PhaseTimer(device="cpu")
    with timer.phase("ref"):
        pass
    metrics = timer.metrics()
    expected_gib = process_peak_rss_bytes() / 1024**3
    assert expected_gib > 0
    # RSS peak is monotone; nothing large was allocated since the phase ended.
    assert metrics["memory/ref_peak_gib"] == pytest.approx(expected_gib, rel=0.05)
    assert metrics["memory/peak_gib"] == metrics["memory/ref_peak_gib"]


def test_phase_timer_reset_and_nesting():
    timer = PhaseTimer(device="cpu")
    with timer.phase("a"):
        with pytest.raises(RuntimeError, match="do not nest"):
            with timer.phase("b"):
                pass
    timer.reset()
    assert timer.metrics() == {}


def test_phase_timer_counts_the_allocators_retries_and_device_calls_per_phase(monkeypatch):
    """CUDA's allocator counters stood in for: each phase gets the counts made inside it, a phase entered twice
    their sum; a torch without a counter reads 0."""
    from torchplex.components import peak_memory

    books = {"num_alloc_retries": 0, "num_device_alloc": 10, "num_device_free": 4}
    monkeypatch.setattr(PhaseTimer, "_on_cuda", property(lambda self: True))
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    monkeypatch.setattr(torch.cuda, "memory_stats", lambda device=None: dict(books))
    monkeypatch.setattr(peak_memory, "reset_peak", lambda device=None: None)
    monkeypatch.setattr(peak_memory, "max_allocated", lambda device=None: 0)
    timer = PhaseTimer(device="cpu")
    for name, retries, allocs in (("train", 2, 5), ("ref", 0, 1), ("train", 1, 3)):
        with timer.phase(name):
            books["num_alloc_retries"] += retries
            books["num_device_alloc"] += allocs
    assert timer.allocator_events == {"train": {"alloc_retries": 3, "device_allocs": 8, "device_frees": 0},
                                      "ref": {"alloc_retries": 0, "device_allocs": 1, "device_frees": 0}}
    assert peak_memory.allocator_events({}) == {"alloc_retries": 0, "device_allocs": 0, "device_frees": 0}
    timer.reset()
    assert timer.allocator_events == {}


# ---- tools/plot_metrics.py -------------------------------------------------------------------------


def _write_fake_run(run_dir: Path) -> None:
    run_dir.mkdir(parents=True, exist_ok=True)
    lines = []
    for step in range(1, 11):
        record = {
            "step": step,
            "reward/mean": step / 10,
            "reward/std": 0.1,
            "accuracy": step / 20,
            "kl": 0.001 * step,
            "response_length/mean": 20.0 + step,
            "grad_norm": "nan" if step == 4 else 1.0 / step,
        }
        lines.append(json.dumps(record))
        if step % 5 == 0:
            lines.append(json.dumps({"step": step, "eval/accuracy": step / 15}))
    lines.insert(3, "{not json")
    lines.insert(6, json.dumps({"no_step": 1}))
    (run_dir / "metrics.jsonl").write_text("\n".join(lines) + "\n")


def test_plot_writes_a_png_and_counts_malformed_lines(tmp_path, capsys):
    plot = _load_plot_module()
    _write_fake_run(tmp_path)
    out = plot.plot_metrics(tmp_path)
    assert out == tmp_path / "metrics.png"
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "skipped 2 malformed line(s)" in capsys.readouterr().out


def test_plot_reads_eval_entries_and_drops_non_finite_points(tmp_path):
    plot = _load_plot_module()
    _write_fake_run(tmp_path)
    history = plot.read_metrics(tmp_path / "metrics.jsonl")
    assert history.malformed_lines == 2
    assert history.series["eval/accuracy"].steps == [5, 10]
    assert 4 not in history.series["grad_norm"].steps
    titles = [panel.title for panel in plot._panels(history)]
    assert titles == ["reward", "accuracy", "KL", "response length", "grad norm"]


def test_plot_error_names_the_missing_file(tmp_path):
    plot = _load_plot_module()
    with pytest.raises(FileNotFoundError, match=str(tmp_path / "metrics.jsonl")):
        plot.plot_metrics(tmp_path)


def test_plot_error_names_the_empty_file(tmp_path):
    plot = _load_plot_module()
    (tmp_path / "metrics.jsonl").write_text("\n")
    with pytest.raises(ValueError, match="empty.*metrics.jsonl"):
        plot.plot_metrics(tmp_path)


def test_plot_cli_writes_to_out_and_fails_cleanly_without_metrics(tmp_path):
    _write_fake_run(tmp_path / "run")
    out = tmp_path / "figs" / "curves.png"
    done = subprocess.run(
        [sys.executable, str(PLOT_SCRIPT), str(tmp_path / "run"), "--out", str(out)],
        capture_output=True, text=True, timeout=120,
    )
    assert done.returncode == 0, done.stderr
    assert out.is_file()
    failed = subprocess.run(
        [sys.executable, str(PLOT_SCRIPT), str(tmp_path / "nowhere")], capture_output=True, text=True, timeout=120
    )
    assert failed.returncode == 1
    assert str(tmp_path / "nowhere" / "metrics.jsonl") in failed.stderr


def test_drop_after_removes_later_steps_and_keeps_appending(tmp_path):
    logger = MetricsLogger(tmp_path, tensorboard=False)
    for step in (0, 1, 2, 3):
        logger.log(step, {"loss": float(step)})
    with open(logger.path, "a") as f:
        f.write("not json\n")
    assert logger.drop_after(1) == 2
    logger.log(2, {"loss": 20.0})
    logger.close()
    lines = logger.path.read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines if line != "not json"] == [0, 1, 2]
    assert "not json" in lines and json.loads(lines[-1])["loss"] == 20.0


def test_progress_redraws_in_place_on_a_terminal_and_prints_only_lines_elsewhere(caplog):
    """Issue 21, defect 9: under torchrun (not a terminal) every bar redraw became a new line (2,375 lines in the
    default run). The bar is drawn only on a terminal (carriage returns, one line); elsewhere the progress is the
    step lines, through the log; the phase's label is its own (the warm-up bar said `train`)."""
    terminal = FakeTerminal()
    bar = StepProgress(total=50, desc="warmup", stream=terminal)
    for step in range(1, 51):
        bar.update(step, {"sft/loss": 1.0})
    bar.close()
    drawn = terminal.getvalue()
    assert "warmup" in drawn and "\r" in drawn and drawn.count("\n") <= 1

    pipe = io.StringIO()
    caplog.set_level(logging.INFO, logger="torchplex")
    bar = StepProgress(total=50, desc="train", stream=pipe)
    for step in range(1, 51):
        bar.update(step, {"reward/mean": 0.5})
        if step % 10 == 0:
            bar.write(f"step {step}/50")
    bar.close()
    assert pipe.getvalue() == ""
    assert [r.getMessage() for r in caplog.records] == [f"step {s}/50" for s in (10, 20, 30, 40, 50)]
    quiet = StepProgress(total=5, rank=1, stream=FakeTerminal())
    quiet.write("not shown on rank 1")
    assert len(caplog.records) == 5


def test_resume_purges_tensorboard_steps_after_the_checkpoint(tmp_path):
    """Issue 21, defect 3: after a resume TensorBoard held the steps after the checkpoint twice."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    with MetricsLogger(tmp_path) as logger:
        for step in (1, 2, 3, 4):
            logger.log(step, {"loss": float(step)})
    with MetricsLogger(tmp_path) as logger:  # the resumed run: checkpoint at step 2
        logger.drop_after(2)
        for step in (3, 4, 5):
            logger.log(step, {"loss": 10.0 * step})
    events = EventAccumulator(str(tmp_path / "tb"))
    events.Reload()
    assert [(e.step, e.value) for e in events.Scalars("loss")] == [(1, 1.0), (2, 2.0), (3, 30.0), (4, 40.0),
                                                                    (5, 50.0)]
