"""What a new user meets running the trainer (issue 47): own data and rewards, Ctrl-C, two launches into one run
folder, resume. Whole tiny runs on CPU, in process where one process shows the behaviour and as real processes
(subprocess + signals) where it takes two of them or a signal."""

from __future__ import annotations

import json
import logging
from pathlib import Path

from torchplex.config import load_config
from torchplex.train import Trainer

REPO = Path(__file__).resolve().parents[1]
DEBUG_TOML = REPO / "train_configs" / "debug.toml"


def write_records(path: Path, n: int, prefix: str = "t") -> Path:
    path.write_text("".join(json.dumps({"id": f"{prefix}{i}", "prompt": f"What is {i} + 1?", "answer": str(i + 1)})
                            + "\n" for i in range(n)))
    return path


def run_args(tmp_path: Path, tiny_ckpt: Path, name: str, *extra: str) -> list[str]:
    """debug.toml cut to a run of a few seconds on the tiny checkpoint and a text-only JSONL."""
    train = write_records(tmp_path / "train.jsonl", 8)
    return [f"--job.config_file={DEBUG_TOML}", f"--job.output_dir={tmp_path / 'runs'}", f"--job.name={name}",
            f"--model.hf_checkpoint={tiny_ckpt}", f"--data.train_files={train}", "--data.prompts_per_step=2",
            "--rollout.n_samples=2", "--rollout.max_new_tokens=4", "--training.steps=2",
            "--training.sft_warmup_steps=0", "--metrics.eval_interval=0", "--metrics.tensorboard=false",
            "--metrics.progress_bar=false", "--metrics.log_interval=1", *extra]


def test_every_evaluation_of_named_eval_sets_is_on_the_console(tmp_path, tiny_ckpt, caplog):
    """Issue 47, defect 3: with data.eval_files only "eval step 0" was printed; later evaluations (metrics
    eval/<set>/..., not eval/prompts) reached metrics.jsonl only, and the summary had no eval line."""
    geo = write_records(tmp_path / "geo.jsonl", 2, prefix="g")
    trainer = Trainer(load_config(run_args(tmp_path, tiny_ckpt, "named", f"--data.eval_files={geo}",
                                           "--metrics.eval_interval=1")))
    with caplog.at_level(logging.INFO, logger="torchplex"):
        trainer.train()
    console = [r.getMessage() for r in caplog.records]
    for step in (0, 1, 2):
        assert any(line.startswith(f"eval step {step}: geo: accuracy") for line in console), console
    assert any(line.startswith("  eval accuracy (geo): last") and "(step 2, 2/2 prompts)" in line for line in console)
