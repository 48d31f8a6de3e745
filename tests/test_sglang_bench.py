"""benchmarks/sglang_bench.py's logic on CPU (its GPU runs need SGLang): arguments, rows per ../shared/RESULTS.md
(each with "backend" and, for training rows, "logprob_mismatch"), a failure as an ok:false row, with the fake
engine standing in for sglang.Engine."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import sglang_bench  # noqa: E402
from fake_sglang import FakeSGLangEngine  # noqa: E402

SMALL = ["--prompts", "1", "--group", "2", "--prompt-tokens", "40", "--repeats", "1", "--max-new-tokens", "6",
         "--mean-response", "3", "--dtype", "float32", "--kv-pool-gib", "0.05"]


def test_arguments_are_checked():
    a = sglang_bench.parse_args(["--suite", "step", "--ckpt", "x"])
    assert a.backends == ["native", "sglang"] and a.workloads == ["img-small", "img"]
    assert sglang_bench.WORKLOADS["img"]["prompts"] == 8 and sglang_bench.WORKLOADS["img-small"]["prompts"] == 2
    with pytest.raises(SystemExit):
        sglang_bench.parse_args(["--suite", "step", "--ckpt", "x", "--workloads", "vid"])


def test_sglang_on_cpu_is_an_ok_false_row_not_a_missing_one(tiny_ckpt, tmp_path):
    out = tmp_path / "sglang-x.json"
    sglang_bench.main(["--suite", "step", "--ckpt", str(tiny_ckpt), "--backends", "sglang", "--workloads",
                       "img-small", "--out", str(out)] + SMALL)
    doc = json.loads(out.read_text())
    assert doc["topic"] == "sglang" and {"command", "device", "torch", "transformers", "date"} <= doc.keys()
    [row] = doc["rows"]
    assert row["backend"] == "sglang" and row["ok"] is False and "needs a CUDA device" in row["error"]


def test_step_rows_of_both_backends_on_the_fake(tiny_ckpt, tmp_path):
    out = tmp_path / "sglang-step.json"
    doc = sglang_bench.main(["--suite", "step", "--ckpt", str(tiny_ckpt), "--workloads", "img-small", "--out",
                             str(out)] + SMALL, engine_factory=FakeSGLangEngine)
    rows = {r["backend"]: r for r in json.loads(out.read_text())["rows"]}
    assert doc["rows"] and rows.keys() == {"native", "sglang"}
    for r in rows.values():
        assert r["ok"], r["error"]
        assert {"step_s", "phases_s", "samples", "tokens", "logprob_mismatch", "mismatch_k3"} <= r.keys()
        assert r["logprob_mismatch"] < 1e-4  # the fake samples with the trainer's math in float32
    assert rows["sglang"]["weight_push_s"] > 0 and rows["native"]["weight_push_s"] == 0


def test_train_rows_on_the_fake(tiny_ckpt, tmp_path):
    out = tmp_path / "sglang-train.json"
    sglang_bench.main(["--suite", "train", "--ckpt", str(tiny_ckpt), "--backends", "sglang", "--steps", "1",
                       "--group", "2", "--dtype", "float32", "--out", str(out)], engine_factory=FakeSGLangEngine)
    [row] = json.loads(out.read_text())["rows"]
    assert row["ok"], row["error"]
    assert row["backend"] == "sglang" and row["logprob_mismatch"] < 1e-4 and row["weight_push_bytes"][0] > 0
    assert row["weights_changed"]



def test_rows_are_written_before_a_later_row_kills_the_run(tiny_ckpt, tmp_path, monkeypatch):
    """Defect: results were written only after the last row, so a row killed by the device call's time limit
    (a hung SGLang scheduler ended by `timeout -k` in sglang_gpu.sh) lost every finished row with it."""
    out = tmp_path / "sglang-step.json"

    def rows(a, backend, *args, **kwargs):
        if backend == "sglang":
            raise RuntimeError("scheduler died")  # an ordinary failed row
        raise KeyboardInterrupt  # what no `except Exception` catches, like the signal that ends a hung call

    monkeypatch.setattr(sglang_bench, "step_rows", rows)
    with pytest.raises(KeyboardInterrupt):
        sglang_bench.main(["--suite", "step", "--ckpt", str(tiny_ckpt), "--backends", "sglang,native",
                           "--workloads", "img-small", "--out", str(out)] + SMALL)
    [row] = json.loads(out.read_text())["rows"]
    assert row["backend"] == "sglang" and row["ok"] is False and "scheduler died" in row["error"]
