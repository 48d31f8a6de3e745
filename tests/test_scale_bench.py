"""benchmarks/scale_bench.py and benchmarks/recipes.py on CPU (--smoke: the tiny checkpoint): every row comes from a
real `./run_train.sh` run (the product path), read back from its metrics.jsonl; a failed run is an ok: false row and
the sweep goes on."""

import json
import tomllib
from pathlib import Path

import pytest

from benchmarks import recipes, scale_bench
from benchmarks.product_run import steps_row

REPO = Path(__file__).resolve().parents[1]


def test_scale_rows_come_from_run_train_runs_and_a_failure_is_a_row(tmp_path):
    out, plot = tmp_path / "scale.json", tmp_path / "scale.png"
    result = scale_bench.main(["--smoke", "--prompts", "1,2", "--modes", "serial,overlapped", "--repeats", "1",
                               "--work", str(tmp_path / "w"), "--out", str(out), "--plot", str(plot)])
    assert json.loads(out.read_text()) == result and plot.stat().st_size > 0 and result["topic"] == "scale"
    rows = result["rows"]
    assert [(r["prompts"], r["mode"]) for r in rows] == [(1, "serial"), (1, "overlapped"), (2, "serial"),
                                                          (2, "overlapped")]
    for r in rows:
        assert r["ok"], r["error"]
        # one warm-up step and one timed step, both logged by the trainer itself
        assert len(r["steps_s"]) == 2 and r["step_s"] == r["steps_s"][1]
        assert r["samples"] == 2 * r["prompts"] and r["tokens"] > r["samples"]
        assert {"rollout", "train"} <= set(r["phases_s"]) and r["decode"]["steps"] >= 1
        assert r["micro_batch"]["tokens"] > 0 and r["micro_batch"]["train_count"] >= 1  # the planner's budget
        # the timed step's decode at the ladder's sizes: its steps, the rows they decoded, the live share of those
        d = r["decode"]
        assert sum(d["steps_by_rows"].values()) == d["steps"]
        assert d["row_steps"] == sum(int(rows) * k for rows, k in d["steps_by_rows"].items())
        assert 0 < d["live_fraction"] <= 1 and d["captures"] == 0  # the CPU captures no graphs
        run_dir = tmp_path / "w" / "runs" / f"scale-img-{r['prompts']}-{r['mode']}"
        saved = tomllib.loads((run_dir / "config.toml").read_text())  # the trainer's resolved config
        assert (saved["runtime"]["mode"], saved["data"]["prompts_per_step"]) == (r["mode"], r["prompts"])
    # issue 49's rows: another workload and topic, each mode at a memory budget (one too small: a failed row)
    failed = scale_bench.main(["--smoke", "--workload", "img-256", "--topic", "microbatch", "--budgets", "0.001",
                               "--prompts", "1", "--modes", "decomposed", "--work", str(tmp_path / "w"),
                               "--out", str(tmp_path / "failed.json")])
    assert failed["topic"] == "microbatch" and [r["budget_gib"] for r in failed["rows"]] == [0.001]
    assert [r["ok"] for r in failed["rows"]] == [False] and "memory" in failed["rows"][0]["error"].lower()


@pytest.mark.slow
def test_every_shipped_recipe_runs_saves_resumes_and_exports_through_run_train(tmp_path):
    """The GPU acceptance flow of the product-on-GPU issue at CPU size: each recipe (its own data format, rewards,
    mode) runs its steps with evaluation before and after, saves a checkpoint, a second launch resumes from it for
    one more step and exports HF weights."""
    result = recipes.main(["--recipe", "all", "--smoke", "--steps", "2", "--work", str(tmp_path),
                           "--out", str(tmp_path / "recipes.json")])
    rows = {r["recipe"]: r for r in result["rows"]}
    assert set(rows) == set(recipes.RECIPES)
    for name, r in rows.items():
        assert r["ok"], (name, r["error"])
        assert r["resumed"] and r["exported"] and r["resumed_steps"] == [3]
        assert r["eval_steps"] == [0, 2] and len(r["steps_s"]) == 2
        assert r["metrics"]["step"] == 3 and any(k.startswith("eval/") for k in r["metrics"])  # the resumed run's
        assert r["mode"] == tomllib.loads((REPO / "train_configs" / f"{name}.toml").read_text())["runtime"]["mode"]
    assert result["topic"] == "recipes" and result["command"].startswith("python benchmarks/recipes.py")


def test_a_recipe_without_room_for_its_checkpoints_is_a_row_that_says_so(tmp_path, monkeypatch):
    monkeypatch.setattr(recipes, "FLAVOR_PARAMS", {**recipes.FLAVOR_PARAMS, "debug": 1e15})  # a petabyte model
    result = recipes.main(["--recipe", "qwen2_5_vl_7b", "--smoke", "--work", str(tmp_path),
                           "--out", str(tmp_path / "r.json")])
    [row] = result["rows"]
    assert not row["ok"] and row["error"].startswith("not run:") and "GB free" in row["error"]


def test_steps_row_times_the_steps_after_the_warm_up_and_divides_flops_by_time_and_peak():
    records = [{"step": 1, "wall_time": 110.0, "time/step_s": 9.0, "time/train_s": 6.0, "flops/train_tflop": 600.0,
                "samples": 8, "tokens/samples": 100, "memory/peak_gib": 3.0},
               {"step": 2, "wall_time": 112.0, "time/step_s": 2.0, "time/train_s": 1.0, "flops/train_tflop": 400.0,
                "samples": 8, "tokens/samples": 100, "memory/peak_gib": 2.0},
               {"step": 3, "wall_time": 115.0, "time/step_s": 3.0, "time/train_s": 2.0, "flops/train_tflop": 400.0,
                "samples": 8, "tokens/samples": 120, "memory/peak_gib": 2.5}]
    row = steps_row(records, launched=100.0, warm_up_steps=1, peak_tflops=800.0)
    assert row["step_s"] == 2.5 and row["phases_s"] == {"train": 1.5} and row["peak_gib"] == 2.5
    assert row["startup_s"] == 1.0 and row["first_step_s"] == 9.0 and row["tokens"] == 110
    assert row["mfu"]["train"] == pytest.approx(400.0 / 1.5 / 800.0)
