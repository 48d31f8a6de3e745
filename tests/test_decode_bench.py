"""benchmarks/decode_bench.py's results file (its measurement needs CUDA): the rows and the file follow
../shared/RESULTS.md (topic "decode"), a variant that failed is a row with ok false, and the floor fraction is the
bandwidth floor over the step's time."""

import json

import pytest

from benchmarks import decode_bench

RESULTS_KEYS = ("workload", "geometry", "prompts", "group", "mode", "step_s", "phases_s", "peak_gib", "samples",
                "tokens", "ok", "error")
FILE_KEYS = ("topic", "command", "device", "gpus", "torch", "transformers", "date", "rows")


def test_decode_rows_and_file_follow_results_md():
    ok = decode_bench.decode_row("7B", 64, 8, "compiled", per_step=6.72e-3, floor=5.33e-3, peak_bytes=3 * 2**30,
                                 first_step_s=60.0)
    failed = decode_bench.decode_row("7B", 256, 8, "compiled_autotune", error="OutOfMemoryError: CUDA out of memory")
    info = {"gpu": "NVIDIA H200", "torch": "2.11.0+cu130", "geometry": "7B"}
    doc = decode_bench.results_doc(["--batch", "64", "256", "--group", "8"], info, [ok, failed])
    json.dumps(doc)  # a file's content
    assert all(k in doc for k in FILE_KEYS) and doc["topic"] == "decode" and doc["gpus"] == 1
    assert doc["command"] == "python benchmarks/decode_bench.py --batch 64 256 --group 8"
    for row in doc["rows"]:
        assert all(k in row for k in RESULTS_KEYS)
    assert ok["ok"] and ok["error"] == "" and ok["prompts"] == 8 and ok["samples"] == ok["tokens"] == 64
    assert ok["step_s"] == ok["phases_s"]["decode"] == 6.72e-3 and ok["peak_gib"] == 3.0
    assert ok["floor_fraction"] == ok["fraction_of_floor"] == pytest.approx(5.33 / 6.72)
    assert ok["tokens_per_s"] == pytest.approx(64 / 6.72e-3) and ok["first_step_s"] == 60.0
    assert not failed["ok"] and failed["error"].startswith("OutOfMemoryError") and failed["step_s"] == 0.0
    assert "floor_fraction" not in failed
