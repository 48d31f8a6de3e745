"""The README's headline numbers are a committed run's (issue 47, defect 11): docs/results/debug_run.json, written
with the README block by `python tools/refresh_readme_numbers.py` from a run of `./run_train.sh`."""

from __future__ import annotations

import json
from pathlib import Path

from tools import refresh_readme_numbers as refresh

REPO = Path(__file__).resolve().parents[1]


def test_the_readme_numbers_are_those_of_the_committed_run():
    """Issue 47, defect 11: the README's headline accuracy numbers came from a run 179 commits old, kept by hand.
    They are now rendered from the committed run summary, so they cannot drift from it."""
    summary = json.loads(refresh.RESULTS.read_text())
    assert refresh.readme_block(refresh.README.read_text()) == refresh.render(summary)
    assert summary["command"] == "./run_train.sh" and summary["grpo_steps"] == 300


CONSOLE = """\
[10:00:00] eval before the warm-up: accuracy 0.000 | format 0.00 | 4/4 prompts
[10:00:01] warm-up step 50/150 | loss 0.5
[10:00:02] warm-up step 100/150 | loss 0.4
[10:00:03] warm-up step 150/150 | loss 0.3
[10:00:04] eval step 0: accuracy 0.250 | format 1.00 | 4/4 prompts
[10:00:05] step 1/4 | reward 0.1
[10:00:06] step 2/4 | reward 0.2
[10:00:06] eval step 2: accuracy 0.500 | format 1.00 | 4/4 prompts
[10:00:07] step 3/4 | reward 0.3
[10:00:08] step 4/4 | reward 0.4
[10:00:08] eval step 4: accuracy 0.750 | format 1.00 | 4/4 prompts
[10:00:09] done: 4/4 GRPO steps after 150 warm-up steps in 0m09s
[10:00:09]   run folder: {repo}/runs/debug (metrics.jsonl, config.toml)
"""


def test_a_run_folder_is_summarized_into_the_readme_numbers(tmp_path, monkeypatch):
    """How the numbers are read from a finished run: every evaluation, train-batch accuracy at both ends, the
    console with its repeated progress lines cut."""
    monkeypatch.setattr(refresh, "TRAIN_WINDOW", 2)
    (tmp_path / "config.toml").write_text("[training]\nsteps = 4\nsft_warmup_steps = 150\n[data]\n"
                                          "prompts_per_step = 2\n[rollout]\nn_samples = 4\n")
    records = [{"step": 0, "eval/accuracy_before_sft": 0.0, "eval/format_before_sft": 0.0},
               {"step": 0, "eval/accuracy": 0.25, "eval/format": 1.0, "eval/prompts": 4.0},
               *({"step": s, "accuracy": a} for s, a in ((1, 0.25), (2, 0.5), (3, 0.5), (4, 1.0))),
               {"step": 2, "eval/accuracy": 0.5, "eval/format": 1.0, "eval/prompts": 4.0},
               {"step": 4, "eval/accuracy": 0.75, "eval/format": 1.0, "eval/prompts": 4.0}]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    summary = refresh.summarize(tmp_path, 9.4, CONSOLE.format(repo=refresh.REPO), "abc1234", 0.5)
    assert [(e["point"], e["accuracy"]) for e in summary["evals"]] == [
        ("before the warm-up (random model)", 0.0), ("GRPO step 0", 0.25), ("GRPO step 2", 0.5),
        ("GRPO step 4", 0.75)]
    assert (summary["train_accuracy_first"], summary["train_accuracy_last"]) == (0.375, 0.75)
    assert (summary["wall_s"], summary["warmup_steps"], summary["grpo_steps"]) == (9, 150, 4)
    assert summary["eval_prompts"] == 4
    assert summary["console_lines"] == 13
    assert summary["console_excerpt"] == [
        "[10:00:00] eval before the warm-up: accuracy 0.000 | format 0.00 | 4/4 prompts",
        "[10:00:01] warm-up step 50/150 | loss 0.5", "...", "[10:00:03] warm-up step 150/150 | loss 0.3",
        "[10:00:04] eval step 0: accuracy 0.250 | format 1.00 | 4/4 prompts", "[10:00:05] step 1/4 | reward 0.1",
        "...", "[10:00:08] step 4/4 | reward 0.4", "[10:00:08] eval step 4: accuracy 0.750 | format 1.00 | 4/4 prompts",
        "[10:00:09] done: 4/4 GRPO steps after 150 warm-up steps in 0m09s",
        "[10:00:09]   run folder: runs/debug (metrics.jsonl, config.toml)"]
    block = refresh.render(summary)
    assert "| after the warm-up (GRPO step 0) | 0.250 | 1.00 |" in block
    assert "| GRPO step 2 / 4 | 0.500 / 0.750 | 1.00 / 1.00 |" in block
    assert "GRPO added 50.0 points on top of the warm-up" in block and "**0 min 9 s**" in block
    readme = f"intro\n{refresh.BEGIN}\nold numbers\n{refresh.END}\nrest\n"
    assert refresh.rewrite_readme(readme, block) == f"intro\n{block}\nrest\n"
