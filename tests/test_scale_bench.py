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
        assert planned["residents"]["rollout"]["actor_weights"] == measured["actor_weights_bytes"]
        assert planned["residents"]["rollout"]["optimizer_state"] == measured["optimizer_state_bytes"]  # AdamW
    overlapped = [r for r in rows if r["mode"] == "overlapped"]
    # the fused graph held what the plan declared (the first step's estimate, then the measured rate)
    assert all(r["memory"]["planned"]["forms"] == {"graph": r["prompts"]} for r in overlapped)
    assert all(r["memory"]["measured"]["held_graph_bytes"] > 0 for r in overlapped)
    # a budget nothing fits in: failed rows with the error's first line, and the run goes on to the next mode
    failed = scale_bench.main(common + ["--prompts", "1", "--modes", "serial,decomposed", "--memory-budget-gib",
                                        "0.001"])["rows"]
    assert [(r["mode"], r["ok"]) for r in failed] == [("serial", False), ("decomposed", False)]
    assert all("BatchTooLargeError" in r["error"] and "rollout.kv_pool_gib" in r["error"] for r in failed)


def test_video_workload_prompt_has_the_workloads_token_count_and_runs(tmp_path):
    """vid: 32 frames of 448 x 448 are 16 temporal grids x 256 merged patches (4,096 vision tokens, ~4,120 in
    all); a small video prompt runs a step end to end."""
    args = scale_bench.bench_flavor("debug")
    prompt = scale_bench.make_video_prompt(args, 32, 448, seed=0)
    assert (prompt.input_ids == args.video_token_id).sum() == 4096 and 4100 < len(prompt.input_ids) < 4130
    rows = scale_bench.main(["--workload", "vid", "--video", "4,56", "--geometry", "debug", "--dtype", "float32",
                             "--response", "4", "--group", "2", "--repeats", "0", "--prompts", "1",
                             "--modes", "overlapped", "--out", str(tmp_path / "v.json"),
                             "--plot", str(tmp_path / "v.png")])["rows"]
    assert rows[0]["ok"], rows[0]["error"]
