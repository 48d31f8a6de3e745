"""benchmarks/scale_bench.py end to end on CPU at tiny geometry: one results file of topic "scale" with a row per
(P, mode), the memory plan against what each step held, a failed row that does not stop the run, and the plot."""

import json
from pathlib import Path

import pytest

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
        # the row's peak is its steps' highest, the warm-up step's kept apart (planned from estimates)
        assert r["peak_gib"] == max(r.get("peak_warm_up_gib", 0.0), r["peak_timed_gib"])
        planned, measured = r["memory"]["planned"], r["memory"]["measured"]
        assert planned["residents"]["rollout"]["kv_pool"] == measured["kv_pool_bytes"] > 0  # the budget-sized pool
        assert planned["residents"]["rollout"]["actor_weights"] == measured["actor_weights_bytes"]
        assert planned["residents"]["rollout"]["optimizer_state"] == measured["optimizer_state_bytes"]  # AdamW
        # the decode loop: every step over the pool's slots, a share of them live (responses of at most 4 tokens:
        # at most 3 decode steps, the first token from the prefill)
        d = r["decode"]
        assert d["slots"] >= r["samples"] and 1 <= d["steps"] <= 3 and d["s"] > 0
        assert 0 < d["live_fraction"] <= r["samples"] / d["slots"]
        assert d["live_fraction"] == (r["response_tokens"] - r["samples"]) / (d["steps"] * d["slots"])
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


def test_scale_rows_carry_phase_mfu_counted_from_the_step_and_a_profile(tmp_path):
    """Issue 19's `mfu` object on scale rows: training counts 3x the reference's forward FLOPs in decomposed mode
    (trainable tower); overlapped training lacks the held prefixes' forward, which the fused prefill ran (so its
    train PFLOP is 3x reference minus exactly the prefill's FLOPs when every prompt is held); --warmup first gives
    only the first mode a warm-up step; --profile adds kernel time by category for the prefill, ref and train."""
    out = tmp_path / "s.json"
    result = scale_bench.main(["--geometry", "debug", "--dtype", "float32", "--prompt-tokens", "32", "--response", "4",
                               "--group", "2", "--micro-batch", "4", "--repeats", "1", "--prompts", "2",
                               "--modes", "decomposed,overlapped", "--warmup", "first", "--profile", "2:decomposed",
                               "--out", str(out), "--plot", str(tmp_path / "s.png")])
    dec, ovl = result["rows"]
    assert dec["ok"] and ovl["ok"] and result["peak_tflops"] > 0
    assert dec["warm_up_step"] and not ovl["warm_up_step"]
    for r in (dec, ovl):
        assert set(r["mfu"]) == {"prefill", "reference", "train"} and all(v > 0 for v in r["mfu"].values())
        assert r["logprob_mismatch"]["tokens"] == r["response_tokens"]
    p = dec["pflop"]
    assert abs(p["train"] - 3 * p["reference"]) <= 1e-9 * p["train"]
    assert ovl["memory"]["planned"]["forms"] == {"graph": 2}
    q, t = ovl["pflop"], scale_bench.bench_flavor("debug").text
    head = 2 * t.hidden_size * t.vocab_size * 2 / 1e15  # the prefill's LM head on one token of each of 2 prompts
    assert abs(q["train"] - (3 * q["reference"] - (q["prefill"] - head))) <= 1e-9 * q["train"]
    assert set(dec["profile"]) == {"prefill", "ref", "train"}
    assert all(v["wall_s"] > 0 for v in dec["profile"].values()) and "profile" not in ovl
    # the docs' tables and the merged chart come from such files
    from benchmarks.memory_table import tables
    table = tables([str(out)]).splitlines()
    assert len(table) == 2 + 2 + 2 and "| img | 2 | overlapped | graph 2 |" in table[3]
    plot = tmp_path / "merged.png"
    merged = scale_bench.main(["--plot-from", str(out), str(out), "--plot", str(plot)])
    assert len(merged["rows"]) == 4 and plot.stat().st_size > 0


def test_warmup_first_warms_each_new_p_with_a_rollout_and_reuses_the_runners_rates(tmp_path):
    """--warmup first: one whole warm-up step at the first P only; later P warm their new KV-pool shape with a
    rollout alone and run each mode's runner of the first P, whose measured rates (the fused graph's bytes per token)
    carry over: the second overlapped row plans with the rate the first one measured, not the geometry's estimate."""
    result = scale_bench.main(["--geometry", "debug", "--dtype", "float32", "--prompt-tokens", "32", "--response", "4",
                               "--group", "2", "--micro-batch", "4", "--repeats", "1", "--prompts", "1,2",
                               "--modes", "overlapped,decomposed", "--warmup", "first",
                               "--out", str(tmp_path / "w.json"), "--plot", str(tmp_path / "w.png")])
    rows = result["rows"]
    assert [(r["prompts"], r["mode"], r["ok"], r["warm_up_step"]) for r in rows] == [
        (1, "overlapped", True, True), (1, "decomposed", True, False), (2, "overlapped", True, False),
        (2, "decomposed", True, False)]
    first, second = rows[0]["memory"], rows[2]["memory"]
    rate = lambda m: m["measured"]["held_graph_bytes"] / m["planned"]["forms"]["graph"]
    measured_per_prompt = rate(first)
    # the same prompt length at both P: the planned bytes per held prompt at P=2 are the measured ones of P=1
    assert abs(second["planned"]["held_graph_bytes"] / 2 - measured_per_prompt) <= 0.01 * measured_per_prompt


def test_the_warm_up_rollout_of_a_new_p_decodes_in_the_pool_its_steps_use(tmp_path, monkeypatch):
    """Defect (H200, img P = 32 then 64): the warm-up rollout of P = 64 ran in the pool the previous P's budget had
    sized (32 groups), so the first timed step at P = 64 compiled the decode step for its own 64-group pool inside
    the row. The warm-up must decode in the pool geometry the steps of that P decode in."""
    from torchplex.rollout.engine import RolloutEngine

    pools, generate = [], RolloutEngine.generate

    def recording(self, prompts, params, **kw):
        out = generate(self, prompts, params, **kw)
        pools.append((len(prompts), self.pool.num_groups, self.pool.max_prompt, self.pool.max_new))
        return out

    monkeypatch.setattr(RolloutEngine, "generate", recording)
    scale_bench.main(["--geometry", "debug", "--dtype", "float32", "--prompt-tokens", "32", "--response", "4",
                      "--group", "2", "--micro-batch", "4", "--repeats", "1", "--prompts", "1,2",
                      "--modes", "decomposed", "--warmup", "first", "--out", str(tmp_path / "p.json"),
                      "--plot", str(tmp_path / "p.png")])
    # P=1: warm-up step, timed step; P=2: warm-up rollout, timed step
    assert [p[0] for p in pools] == [1, 1, 2, 2]
    assert pools[2] == pools[3] and pools[3][1] == 2


def test_overlapped_window_mode_scores_the_reference_in_the_decode_window(tmp_path):
    """`overlapped-window`: the overlapped step with the reference scored beside decode (runtime.reference_in_window),
    which leaves the ref stage less to do than plain overlapped with the same samples."""
    rows = scale_bench.main(["--geometry", "debug", "--dtype", "float32", "--prompt-tokens", "32", "--response", "4",
                             "--group", "2", "--micro-batch", "4", "--repeats", "0", "--prompts", "2",
                             "--modes", "overlapped,overlapped-window", "--out", str(tmp_path / "o.json"),
                             "--plot", str(tmp_path / "o.png")])["rows"]
    plain, window = rows
    assert plain["ok"] and window["ok"], window["error"]
    assert window["mode"] == "overlapped-window" and window["response_tokens"] == plain["response_tokens"]
    assert plain["window_phases"] == [] and window["window_phases"]  # the reference placed beside decode
    assert all("ref" in name for name in window["window_phases"])


def test_warmup_modes_warms_every_mode_at_the_first_p_only(tmp_path):
    """--warmup modes: each mode's first step at the first P is a warm-up (no mode's timed row runs cold, so ratios
    in one run are fair); a later P warms its new pool with a rollout, as --warmup first does."""
    result = scale_bench.main(["--geometry", "debug", "--dtype", "float32", "--prompt-tokens", "32", "--response", "4",
                               "--group", "2", "--micro-batch", "4", "--repeats", "1", "--prompts", "1,2",
                               "--modes", "overlapped,decomposed", "--warmup", "modes",
                               "--out", str(tmp_path / "m.json"), "--plot", str(tmp_path / "m.png")])
    assert [(r["prompts"], r["mode"], r["ok"], r["warm_up_step"]) for r in result["rows"]] == [
        (1, "overlapped", True, True), (1, "decomposed", True, True), (2, "overlapped", True, False),
        (2, "decomposed", True, False)]


def test_more_warm_up_steps_run_untimed_and_the_timed_plan_caps_the_held_prefixes(tmp_path, capsys):
    """--warm-up-steps 2: two untimed steps before the timed one where a warm-up runs (H200, 7B, img P = 64: the timed
    step's plan, learned from the warm-up, batched a prefix shape the warm-up had not compiled, 8.3 s for a round's
    prefix forward that took 2.0 in the warm-up); a later P's rows run none. The rows record the held cap the plan
    took from the last step's whole graphs (none before a step has run: the first row's warm-up)."""
    result = scale_bench.main(["--geometry", "debug", "--dtype", "float32", "--prompt-tokens", "32", "--response", "4",
                               "--group", "2", "--micro-batch", "4", "--repeats", "1", "--prompts", "1,2",
                               "--modes", "decomposed", "--warmup", "modes", "--warm-up-steps", "2",
                               "--activation-checkpointing",
                               "--out", str(tmp_path / "w.json"), "--plot", str(tmp_path / "w.png")])
    rows = result["rows"]
    assert [(r["prompts"], r["ok"], r["warm_up_step"], r["warm_up_steps"]) for r in rows] == [
        (1, True, True, 2), (2, True, False, 0)]
    log = capsys.readouterr().out
    assert log.count("P=1 decomposed warm-up") == 2 and log.count("P=1 decomposed timed") == 1
    assert log.count("P=2 decomposed warm-up") == 0 and log.count("P=2 decomposed timed") == 1
    planned = rows[0]["memory"]["planned"]
    assert planned["held_cap_bytes"] is not None and "micro-batches whole" in planned["held_cap"]
    with pytest.raises(SystemExit):
        scale_bench.parse(["--warm-up-steps", "0"])


def test_batched_actor_prefix_rows_record_and_tabulate_what_training_held(tmp_path):
    """decomposed-batched: the prefixes held within training are planned (their forms and bytes) and measured, and the
    memory table counts them in the train stage's plan (they are not held from the rollout)."""
    out = tmp_path / "b.json"
    result = scale_bench.main(["--geometry", "debug", "--dtype", "float32", "--prompt-tokens", "32", "--response", "4",
                               "--group", "2", "--micro-batch", "2", "--repeats", "0", "--prompts", "2",
                               "--modes", "decomposed-batched", "--out", str(out), "--plot", str(tmp_path / "b.png")])
    [row] = result["rows"]
    planned, measured = row["memory"]["planned"], row["memory"]["measured"]
    assert row["ok"] and planned["forms"] == {"none": 2} and sum(planned["train_forms"].values()) == 2
    assert planned["held_graph_bytes"] == 0 < planned["train_held_bytes"]
    assert planned["train_held_at_once_bytes"] == planned["train_held_bytes"]  # one round
    assert measured["held_graph_bytes"] + measured["held_compact_bytes"] > 0
    from benchmarks.memory_table import tables
    line = tables([str(out)]).splitlines()[2]
    assert "in training: " in line and f"| {planned['train_held_bytes'] / 2**30:.1f} / " in line


@pytest.mark.parametrize("step", ["img-8-64", "img-8", "img-64", "vid-4", "vid-16", "img-32", "img-32-pair",
                                  "compact-32", "compact-64", "serial-64", "serial-vid-16", "profile-32"])
def test_each_gpu_step_of_scale_gpu_sh_is_a_command_scale_bench_accepts(step, tmp_path):
    """benchmarks/scale_gpu.sh runs on the H200 only, where a typo costs a device call: its steps (printed with
    DRY=1) parse as scale_bench arguments, each under the device call's 10-minute limit."""
    import os
    import shlex
    import subprocess

    env = {**os.environ, "DRY": "1", "OUT": str(tmp_path)}
    printed = subprocess.run(["bash", "benchmarks/scale_gpu.sh", step], capture_output=True, text=True, env=env,
                             check=True, cwd=Path(scale_bench.__file__).parents[1]).stdout
    words = shlex.split(printed)
    assert words[:4] == ["timeout", "-k", "10", "585"] and int(words[3]) < 600
    a = scale_bench.parse(words[words.index("benchmarks/scale_bench.py") + 1:])
    assert a.watchdog_s < int(words[3]) and a.repeats == 1 and a.activation_checkpointing
    assert a.workload in ("img", "vid") and a.out.startswith(str(tmp_path))


def test_profile_names_a_prompt_count_and_any_of_the_run_modes():
    """--profile P:MODE[,MODE]: the rows profiled; a mode it names that the run does not know is refused at start."""
    a = scale_bench.parse(["--prompts", "32", "--modes", "overlapped,decomposed", "--profile", "32:overlapped,decomposed"])
    assert a.profile == (32, {"overlapped", "decomposed"})
    assert scale_bench.parse(["--prompts", "8"]).profile == (0, set())
    with pytest.raises(SystemExit):
        scale_bench.parse(["--prompts", "32", "--profile", "32:overlaped"])


@pytest.mark.parametrize("budget_gib, on", [("1", 0), ("0.025", 2)])  # 25 MiB: ~1.4 MiB free for a 4.2 MiB graph
def test_rows_record_each_recompute_choice_of_the_warm_up_and_the_timed_step(tmp_path, budget_gib, on):
    """With checkpointing, every training forward's choice is kept per step (warm-up apart): its whole-graph estimate
    against the free bytes it was compared with, and whether it recomputed (on: the estimate did not fit)."""
    result = scale_bench.main(["--geometry", "debug", "--dtype", "float32", "--prompt-tokens", "32", "--response", "4",
                               "--group", "2", "--micro-batch", "2", "--repeats", "1", "--prompts", "2",
                               "--modes", "decomposed", "--activation-checkpointing", "--memory-budget-gib", budget_gib,
                               "--out", str(tmp_path / "r.json"), "--plot", str(tmp_path / "r.png")])
    [row] = result["rows"]
    for rc in (row["recompute_warm_up"], row["recompute"]):
        choices = list(zip(rc["estimate_gib"], rc["free_gib"], strict=True))
        assert len(choices) == rc["on"] + rc["off"] == 2  # one micro-batch per group of 2 samples
        assert rc["on"] == sum(est > free for est, free in choices) == on
        assert rc["measured_gib"] == []  # CPU: no allocator counter, so no window measured (CUDA: one per choice)


def test_host_profile_covers_the_chosen_training_micro_batches(tmp_path):
    """--host-profile P:MODE:FIRST:COUNT: one more step of that row whose training micro-batches FIRST.. are
    profiled with the host's events: the row says which ran under the profiler, the host ops by self time, and the
    GPU's idle gaps (none on CPU); asking past the last micro-batch says so in the row instead of failing the run."""
    common = ["--geometry", "debug", "--dtype", "float32", "--prompt-tokens", "32", "--response", "4", "--group", "2",
              "--micro-batch", "2", "--repeats", "0", "--prompts", "3", "--modes", "decomposed",
              "--out", str(tmp_path / "h.json"), "--plot", str(tmp_path / "h.png")]
    row = scale_bench.main(common + ["--host-profile", "3:decomposed:1:1"])["rows"][0]
    hp = row["host_profile"]
    assert hp["micro_batches"] == [1, 2] and hp["wall_s"] > 0
    assert hp["host_self_s"] and all(v >= 0 for v in hp["host_self_s"].values())
    assert hp["gaps"] == 0 and hp["idle_s"] == 0.0  # no kernels on CPU
    late = scale_bench.main(common + ["--host-profile", "3:decomposed:9:1"])["rows"][0]
    assert late["ok"] and "fewer than 10" in late["host_profile"]["error"]
    with pytest.raises(SystemExit):
        scale_bench.parse(["--host-profile", "3:decomposed"])


def test_the_memory_table_plans_training_with_the_largest_round_held_not_every_round(tmp_path):
    """Defect (docs/memory.md, 2026-12-04): with training's rounds the table planned the train stage with every round's
    held prefixes (img P = 64 overlapped read 135.1 GiB planned against 128.1 measured), though one round is held at a
    time, and the fused prefixes (round 0) are freed before round 1. The train peak's plan now adds the largest
    round's bytes; the held column keeps every round's; a file written before the at-once bytes were recorded counts
    all of training's as one round."""
    from benchmarks.memory_table import GIB, tables

    plan = {"residents": {"rollout": {"kv_pool": 4 * GIB}, "train": {"actor_weights": 16 * GIB, "grads": 16 * GIB}},
            "held_graph_bytes": 2 * GIB, "train_held_bytes": 30 * GIB, "train_held_at_once_bytes": 10 * GIB,
            "forms": {"compact": 2}, "train_forms": {"compact": 6}}
    row = {"ok": True, "workload": "img", "prompts": 8, "mode": "overlapped", "peak_gib": 60.0,
           "memory": {"planned": plan, "measured": {"stage_peak_bytes": {"train": 45 * GIB}}}}
    older = {**row, "memory": {**row["memory"], "planned": {k: v for k, v in plan.items()
                                                            if k != "train_held_at_once_bytes"}}}
    (tmp_path / "r.json").write_text(json.dumps({"rows": [row, older]}))
    cells = [line.split(" | ") for line in tables([str(tmp_path / "r.json")]).splitlines()[2:4]]
    # 16 + 16 + the largest round: 10 of training's (the 2 fused are round 0, freed before round 1), or all 30
    assert [c[11] for c in cells] == ["42.0 / 45.0", "62.0 / 45.0"]
    assert [c[8] for c in cells] == ["32.0 / 0", "32.0 / 0"]  # held prefixes: every round's, 2 + 30
