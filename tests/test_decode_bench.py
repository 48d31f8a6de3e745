"""benchmarks/decode_bench.py in its CPU smoke mode (the debug geometry, eager): one row per ladder size following
../shared/RESULTS.md (topic "decode"), each against its floor, and a size that cannot run is a row with ok false."""

import json

import pytest

from benchmarks import decode_bench

RESULTS_KEYS = ("workload", "geometry", "prompts", "group", "mode", "step_s", "phases_s", "peak_gib", "samples",
                "tokens", "ok", "error")
FILE_KEYS = ("topic", "command", "device", "gpus", "torch", "transformers", "date", "rows")


def test_smoke_run_writes_one_row_per_ladder_size_against_its_floor(tmp_path):
    out = tmp_path / "decode.json"
    result = decode_bench.main(["--smoke", "--rows", "1", "2", "4", "9", "--out", str(out)])
    assert json.loads(out.read_text()) == result
    assert all(k in result for k in FILE_KEYS) and result["topic"] == "decode" and result["device"] == "cpu"
    assert result["command"].startswith("python benchmarks/decode_bench.py --smoke")
    info = result["info"]
    assert info["copy_bandwidth_GBps"] > 0 and info["matmul_peak_TFLOPs"] > 0 and not info["cuda_graph"]
    rows = {r["rows"]: r for r in result["rows"]}
    assert [r["rows"] for r in result["rows"]] == [9, 4, 2, 1]  # from the largest down, as a rollout meets them
    for r in result["rows"]:
        assert all(k in r for k in RESULTS_KEYS) and r["workload"] == "decode" and r["mode"] == f"rows-{r['rows']}"
    failed = rows[9]  # more rows than the pool's 2 x 2 slots
    assert not failed["ok"] and failed["error"].startswith("ValueError") and failed["step_s"] == 0.0
    assert "floor_fraction" not in failed
    for size in (1, 2, 4):
        r = rows[size]
        assert r["ok"] and r["error"] == "" and r["step_s"] > 0 and r["samples"] == r["tokens"] == size
        assert r["floor_ms"] == max(r["floor_bytes_ms"], r["floor_flops_ms"]) > 0
        assert r["floor_fraction"] == pytest.approx(r["floor_ms"] / r["step_ms"])
        assert r["floor_bound"] == ("bytes" if r["floor_bytes_ms"] >= r["floor_flops_ms"] else "flops")
        bytes_s = (r["weight_bytes"] + r["kv_bytes"]) / (info["copy_bandwidth_GBps"] * 1e9)
        assert r["floor_bytes_ms"] == pytest.approx(bytes_s * 1e3)
        assert r["floor_flops_ms"] == pytest.approx(r["flops"] / (info["matmul_peak_TFLOPs"] * 1e12) * 1e3)
    # more rows read more K/V (one more group's prompt from 1 to 2 rows, then only own tokens) and do more FLOPs
    assert rows[1]["kv_bytes"] < rows[2]["kv_bytes"] < rows[4]["kv_bytes"]
    assert rows[4]["flops"] == pytest.approx(4 * rows[1]["flops"])


def test_decode_rows_follow_results_md():
    ok = decode_bench.decode_row("7B", 64, 8, 64, per_step=6.72e-3, floor=(5.33e-3, 1.1e-3), peak_bytes=3 * 2**30,
                                 first_step_s=60.0)
    failed = decode_bench.decode_row("7B", 64, 8, 512, error="OutOfMemoryError: CUDA out of memory")
    assert ok["ok"] and ok["prompts"] == 64 and ok["samples"] == ok["tokens"] == 64 and ok["mode"] == "rows-64"
    assert ok["step_s"] == ok["phases_s"]["decode"] == 6.72e-3 and ok["peak_gib"] == 3.0
    assert ok["floor_fraction"] == pytest.approx(5.33 / 6.72) and ok["floor_bound"] == "bytes"
    assert ok["tokens_per_s"] == pytest.approx(64 / 6.72e-3) and ok["first_step_s"] == 60.0
    assert not failed["ok"] and failed["error"].startswith("OutOfMemoryError") and failed["step_s"] == 0.0


@pytest.mark.parametrize("step", ["decode", "decode-whole-layer"])
def test_the_decode_steps_of_decode_gpu_sh_are_commands_decode_bench_accepts(step, tmp_path):
    """decode_gpu.sh's `decode` steps (printed with DRY=1) parse, time every ladder size of the 64 x 8 pool, and
    their watchdog fires before the call's timeout, itself well inside a short device call."""
    import os
    import shlex
    import subprocess
    from pathlib import Path

    env = {**os.environ, "DRY": "1", "OUT": str(tmp_path)}
    printed = subprocess.run(["bash", "benchmarks/decode_gpu.sh", step], capture_output=True, text=True, env=env,
                             check=True, cwd=Path(decode_bench.__file__).parents[1]).stdout
    words = shlex.split(printed)
    assert words[:3] == ["timeout", "-k", "10"] and int(words[3]) <= 300
    a = decode_bench.parse(words[words.index("benchmarks/decode_bench.py") + 1:])
    assert a.watchdog_s < int(words[3]) and not a.smoke and a.geometry == "7B"
    assert a.rows == [8, 16, 32, 64, 128, 192, 256, 384, 512] == [r for r in a.rows if r <= a.groups * a.group]
    assert a.out.startswith(str(tmp_path)) and a.whole_layer == (step == "decode-whole-layer")
