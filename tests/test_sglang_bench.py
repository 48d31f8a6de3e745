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
    assert rows["sglang"]["deterministic"] is False is rows["native"]["deterministic"]  # SGLang's fast setup
    assert not FakeSGLangEngine.instances[-1].settings.get("enable_deterministic_inference")


def test_train_rows_on_the_fake(tiny_ckpt, tmp_path):
    out = tmp_path / "sglang-train.json"
    sglang_bench.main(["--suite", "train", "--ckpt", str(tiny_ckpt), "--backends", "sglang", "--steps", "1",
                       "--group", "2", "--dtype", "float32", "--sglang-deterministic", "--out", str(out)],
                      engine_factory=FakeSGLangEngine)
    [row] = json.loads(out.read_text())["rows"]
    assert row["ok"], row["error"]
    assert row["deterministic"] is True and FakeSGLangEngine.instances[-1].settings["enable_deterministic_inference"]
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


def test_overlap_probe_times_each_part_alone_and_together_on_the_fake(tiny_ckpt, tmp_path):
    """benchmarks/probes/sglang_overlap.py: a row with (a) the rollout alone, (b) the prefix work alone, (c) both at
    once and the gain (a + b) / c, labelled with whether MPS served it (the run itself needs SGLang on a GPU)."""
    from benchmarks.probes import sglang_overlap

    out = tmp_path / "overlap.json"
    doc = sglang_overlap.main(["--ckpt", str(tiny_ckpt), "--prompts", "2", "--group", "2", "--max-new-tokens", "3",
                               "--prompt-tokens", "30", "--prefix-rounds", "2", "--repeats", "1", "--dtype", "float32",
                               "--out", str(out)], engine_factory=FakeSGLangEngine)
    assert json.loads(out.read_text()) == doc and doc["topic"] == "sglang"
    assert doc["command"].startswith("python benchmarks/probes/sglang_overlap.py --ckpt")
    [row] = doc["rows"]
    assert row["ok"], row["error"]
    assert row["backend"] == "sglang" and row["mps"] is False and row["prefix_rounds"] == 2
    for k in ("rollout_alone_s", "prefix_alone_s", "together_s", "rollout_together_s", "prefix_together_s"):
        assert row[k] > 0
    assert row["together_s"] >= max(row["rollout_together_s"], row["prefix_together_s"]) - 1e-6
    assert row["gain"] == pytest.approx((row["rollout_alone_s"] + row["prefix_alone_s"]) / row["together_s"])


def test_overlap_probe_on_a_folder_without_weights_starts_sglang_on_dummy_weights(tmp_path):
    """make_tiny_checkpoint(weights=False) (the probe's 7B geometry on the GPU): random-init models on this side,
    SGLang on load_format="dummy", and the first rollout samples with the actor's pushed weights."""
    from benchmarks.probes import sglang_overlap
    from torchplex.models.qwen2_5_vl.tiny_checkpoint import make_tiny_checkpoint

    ckpt = make_tiny_checkpoint(tmp_path / "noweights", weights=False)
    assert not list(ckpt.path.glob("*.safetensors")) and ckpt.num_params > 0
    FakeSGLangEngine.instances.clear()
    doc = sglang_overlap.main(["--ckpt", str(ckpt.path), "--prompts", "1", "--group", "2", "--max-new-tokens", "2",
                               "--prompt-tokens", "30", "--prefix-rounds", "1", "--repeats", "1", "--dtype",
                               "float32"], engine_factory=FakeSGLangEngine)
    [row] = doc["rows"]
    assert row["ok"], row["error"]
    [fake] = FakeSGLangEngine.instances
    assert fake.settings["load_format"] == "dummy" and fake.pushes  # every weight pushed before sampling


def test_overlap_probe_killed_by_sglang_leaves_a_failed_row(tiny_ckpt, tmp_path):
    """On the H200 SGLang's scheduler died at start-up and took the probe process with it (no except ran, no file
    came back): the probe writes its failed row before it starts, and a finished run replaces it."""
    from benchmarks.probes import sglang_overlap

    def killed(**settings):
        raise SystemExit(1)  # what SGLang's SIGQUIT handler does to its parent, as far as this process can tell

    out = tmp_path / "overlap.json"
    with pytest.raises(SystemExit):
        sglang_overlap.main(["--ckpt", str(tiny_ckpt), "--prompts", "1", "--group", "2", "--max-new-tokens", "2",
                             "--prompt-tokens", "30", "--dtype", "float32", "--out", str(out)], engine_factory=killed)
    [row] = json.loads(out.read_text())["rows"]
    assert row["ok"] is False and "ended before its measurement finished" in row["error"]
    assert row["backend"] == "sglang" and row["suite"] == "overlap"
