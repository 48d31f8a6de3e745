"""benchmarks/step_bench.py --mfu on CPU (debug geometry, 1 prompt x 2 samples): the results file has the keys of
../shared/RESULTS.md, every mode a row with ok true, an mfu object per phase whose FLOPs are those of
torchplex.components.flops for the experience the run sampled, and a log-prob mismatch that is tiny in fp32 (the
rollout and the trainer compute the same log-probs up to float rounding: mean |diff| < 1e-4)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO_ROOT / "benchmarks"))

from phase_mfu import kernel_category, prefill_chunks  # noqa: E402


def test_prefill_chunks_follow_the_engine_budget():
    class P:
        def __init__(self, n):
            self.input_ids = [0] * n
    chunks = prefill_chunks([P(6), P(6), P(6), P(20)], budget=12)
    assert [[len(p.input_ids) for p in c] for c in chunks] == [[6, 6], [6], [20]]


def test_kernel_categories():
    assert kernel_category("sm90_xmma_gemm_bf16bf16_bf16f32") == "gemm"
    assert kernel_category("pytorch_flash::flash_fwd_kernel<...>") == "attention"
    assert kernel_category("void at::native::vectorized_elementwise_kernel<4, ...>") == "elementwise/other"


def test_mfu_results_file(tmp_path):
    out = tmp_path / "mfu.json"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(REPO_ROOT)}
    cmd = [sys.executable, str(REPO_ROOT / "benchmarks" / "step_bench.py"), "--mfu", "--geometry", "debug",
           "--prompts", "1", "--prompt-tokens", "40", "--group", "2", "--response", "6", "--mean-response", "0",
           "--repeats", "1", "--micro-batch", "2", "--modes", "decomposed", "serial", "decomposed-padded", "--out", str(out)]
    subprocess.run(cmd, check=True, env=env, cwd=REPO_ROOT, capture_output=True, timeout=120)
    result = json.loads(out.read_text())
    for key in ("topic", "command", "device", "gpus", "torch", "transformers", "date", "rows"):
        assert key in result
    assert result["topic"] == "mfu" and result["peak_tflops"] > 0
    assert [r["mode"] for r in result["rows"]] == ["decomposed", "serial", "decomposed-padded"]
    for row in result["rows"]:
        assert row["ok"] and row["error"] == ""
        assert set(row["mfu"]) == {"prefill", "vision", "reference", "train"}
        assert all(v > 0 for v in row["mfu"].values())
        assert row["pflop"]["train"] == pytest.approx(3 * row["pflop"]["reference"], rel=1e-9)  # tower trains
        assert row["logprob_mismatch"]["mean_abs_diff"] < 1e-4
    serial, decomposed = result["rows"][1]["pflop"], result["rows"][0]["pflop"]
    assert serial["reference"] > decomposed["reference"]  # the prompt once per sample, not once per prompt
    # The padded layout (packing's before side) counts the same model FLOPs: only its time differs.
    assert result["rows"][2]["pflop"] == decomposed
