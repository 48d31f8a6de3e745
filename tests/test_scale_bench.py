"""benchmarks/scale_bench.py end to end on CPU at tiny geometry: one results file of topic "scale" with a row per
(P, mode), the memory plan against what each step held, a failed row that does not stop the run, and the plot."""

import json

from benchmarks import scale_bench


def test_scale_bench_runs_a_list_of_p_and_modes_and_keeps_going_after_a_failure(tmp_path):
    out, plot = tmp_path / "scale.json", tmp_path / "scale.png"
    common = ["--geometry", "debug", "--dtype", "float32", "--prompt-tokens", "32", "--response", "4", "--group", "2",
              "--micro-batch", "4", "--repeats", "0", "--out", str(out), "--plot", str(plot)]
    result = scale_bench.main(common + ["--prompts", "1,2", "--modes", "decomposed,overlapped"])
    assert json.loads(out.read_text()) == result and plot.stat().st_size > 0
    assert result["topic"] == "scale"
    rows = result["rows"]
    assert [(r["prompts"], r["mode"]) for r in rows] == [(1, "decomposed"), (1, "overlapped"), (2, "decomposed"),
                                                          (2, "overlapped")]
    for r in rows:
        assert r["ok"] and r["step_s"] > 0 and r["samples"] == 2 * r["prompts"] and r["tokens"] > 0
        for key in ("workload", "geometry", "group", "phases_s", "peak_gib", "error"):
            assert key in r
        planned, measured = r["memory"]["planned"], r["memory"]["measured"]
        assert planned["residents"]["rollout"]["kv_pool"] == measured["kv_pool_bytes"] > 0  # the budget-sized pool
    overlapped = [r for r in rows if r["mode"] == "overlapped"]
    # the fused graph held what the plan declared (the first step's estimate, then the measured rate)
    assert all(r["memory"]["planned"]["forms"] == {"graph": r["prompts"]} for r in overlapped)
    assert all(r["memory"]["measured"]["held_graph_bytes"] > 0 for r in overlapped)
    # a budget nothing fits in: failed rows with the error's first line, and the run goes on to the next mode
    failed = scale_bench.main(common + ["--prompts", "1", "--modes", "serial,decomposed", "--memory-budget-gib",
                                        "0.001"])["rows"]
    assert [(r["mode"], r["ok"]) for r in failed] == [("serial", False), ("decomposed", False)]
    assert all("BatchTooLargeError" in r["error"] and "rollout.kv_pool_gib" in r["error"] for r in failed)
