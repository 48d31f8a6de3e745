"""Start-up and shut-down behaviour a user meets (issue 21): refusals that name what to change, corrupt files named,
a quiet import, the closing summary."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from torchplex.components.console import RunSummary, format_eval, optimizer_notice
from torchplex.components.metrics import MetricsLogger
from torchplex.models.qwen2_5_vl.build import build_model
from torchplex.models.qwen2_5_vl.weights import CorruptCheckpointError
from torchplex.run_folder import (
    DEBUG_HF_CHECKPOINT,
    RunFolderError,
    check_run_folder,
    clear_run_folder,
    may_write_tiny_checkpoint,
    missing_checkpoint_error,
)

REPO = Path(__file__).resolve().parents[1]


def test_a_truncated_safetensors_file_is_named(tmp_path, tiny_ckpt):
    """Defect 7: a truncated shard gave a bare SafetensorError without the file."""
    broken = tmp_path / "ckpt"
    shutil.copytree(tiny_ckpt, broken)
    weights = broken / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
    with pytest.raises(CorruptCheckpointError, match=str(weights)):
        build_model(hf_dir=broken, device=torch.device("cpu"), dtype=torch.float32)


def test_a_folder_holding_a_run_is_refused_unless_resumed_or_overwritten(tmp_path):
    """Defects 2: rerunning without checkpoints appended to metrics.jsonl (steps 1,2,3,1,2,3) and TensorBoard."""
    run, ckpts = tmp_path / "runs" / "x", tmp_path / "runs" / "x" / "checkpoints"
    assert check_run_folder(run, ckpts, overwrite=False, resuming=False) == "new"
    with MetricsLogger(run) as logger:
        logger.log(1, {"loss": 1.0})
    (run / "config.toml").write_text("")
    with pytest.raises(RunFolderError, match=r"holds an earlier run.*--job\.name.*--job\.overwrite=true"):
        check_run_folder(run, ckpts, overwrite=False, resuming=False)
    assert check_run_folder(run, ckpts, overwrite=False, resuming=True) == "resume"
    assert check_run_folder(run, ckpts, overwrite=True, resuming=False) == "overwrite"
    (run / "notes.txt").write_text("mine")
    assert set(clear_run_folder(run, ckpts)) == {"metrics.jsonl", "tb"}
    assert sorted(p.name for p in run.iterdir()) == ["config.toml", "notes.txt"]  # only the trainer's outputs go
    assert check_run_folder(run, ckpts, overwrite=False, resuming=False) == "new"


def test_only_the_debug_path_may_get_a_tiny_checkpoint(tmp_path):
    """Defect 5: a mistyped --model.hf_checkpoint with the default config wrote a tiny random model there."""
    assert may_write_tiny_checkpoint(DEBUG_HF_CHECKPOINT) or Path.cwd() != REPO
    assert may_write_tiny_checkpoint(str(REPO / DEBUG_HF_CHECKPOINT))
    assert not may_write_tiny_checkpoint(str(tmp_path / "Qwen2.5-VL-7B-Instuct"))
    message = missing_checkpoint_error(str(tmp_path / "typo"), make_tiny_if_missing=True)
    assert "model.hf_checkpoint" in message and str(tmp_path / "typo") in message and DEBUG_HF_CHECKPOINT in message


def test_trainer_refuses_a_mistyped_checkpoint_path_and_writes_nothing(tmp_path):
    from torchplex.config import load_config
    from torchplex.train import Trainer

    typo = tmp_path / "outputs" / "tiny-qwen2_5_vI"
    cfg = load_config([f"--job.config_file={REPO / 'train_configs' / 'debug.toml'}", f"--model.hf_checkpoint={typo}",
                       f"--job.output_dir={tmp_path / 'runs'}"])
    with pytest.raises(FileNotFoundError, match="model.hf_checkpoint"):
        Trainer(cfg)
    assert not typo.exists() and not (tmp_path / "runs").exists()


def test_adamw8bit_on_cpu_is_announced():
    """Defect 12: adamw8bit on CPU paused 86 s at the first step with no message."""
    assert "adamw8bit" in optimizer_notice("adamw8bit", "cpu")
    assert optimizer_notice("adamw8bit", "cuda") is None and optimizer_notice("adamw", "cpu") is None


def test_summary_names_steps_evals_checkpoint_and_plot(tmp_path):
    """Defect 9: no closing summary; eval accuracy was printed only at step 0."""
    summary = RunSummary(tmp_path, total_steps=300, warmup_steps=800, checkpoints_enabled=True, steps_done=300,
                         seconds=482.0, plot=tmp_path / "metrics.png", checkpoint=tmp_path / "checkpoints/step-300")
    for step, accuracy in ((0, 0.48), (50, 0.555), (300, 0.545)):
        summary.add_eval(step, {"eval/accuracy": accuracy, "eval/format": 1.0, "eval/prompts": 199.0,
                                "eval/skipped": 1.0})
    summary.skipped = {"skipped/train/media": 2.0, "skipped/eval/media": 0.0}
    text = "\n".join(summary.lines())
    assert text.startswith("done: 300/300 GRPO steps after 800 warm-up steps in 8m02s")
    assert "last 0.545 (step 300, 199/200 prompts), best 0.555 (step 50)" in text
    assert "train/media 2" in text and "eval/media" not in text
    assert str(tmp_path / "metrics.png") in text and "step-300" in text
    assert format_eval(50, {"eval/accuracy": 0.5, "eval/format": 1.0, "eval/prompts": 4.0, "eval/skipped": 0.0}) \
        == "eval step 50: accuracy 0.500 | format 1.00 | 4/4 prompts"


def test_summary_has_an_eval_line_per_named_eval_set(tmp_path):
    """Issue 47, defect 3: with named eval sets (data.eval_files, metrics eval/<set>/...) the closing summary had no
    eval line."""
    summary = RunSummary(tmp_path, total_steps=4, steps_done=4)
    for step, geo, chart in ((0, 0.25, 0.5), (2, 0.75, 0.25), (4, 0.5, 0.5)):
        summary.add_eval(step, {"eval/geo/accuracy": geo, "eval/geo/prompts": 4.0, "eval/geo/skipped": 0.0,
                                "eval/chart/accuracy": chart, "eval/chart/prompts": 3.0, "eval/chart/skipped": 1.0})
    lines = summary.lines()
    assert "  eval accuracy (geo): last 0.500 (step 4, 4/4 prompts), best 0.750 (step 2)" in lines
    assert "  eval accuracy (chart): last 0.500 (step 4, 3/4 prompts), best 0.500 (step 0)" in lines


def test_importing_the_trainer_prints_nothing():
    """Defect 9: every start printed torchao's `Failed to load ..._C_mxfp8...so` and torch's Enum deprecation."""
    done = subprocess.run([sys.executable, "-c", "import torchplex.train"], capture_output=True, text=True,
                          env=dict(os.environ, PYTHONPATH=str(REPO)), timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout == "" and done.stderr == "", done.stderr


@pytest.mark.slow
def test_run_train_sh_config_error_is_its_message_only(tmp_path):
    """Defect 9: a one-key typo gave ~54 lines ending in torchrun's FAILED banner."""
    env = dict(os.environ, PYTHONPATH=str(REPO), PYTHON=sys.executable)
    done = subprocess.run([str(REPO / "run_train.sh"), "--training.stepz=3"], cwd=tmp_path, env=env,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert done.stdout == "" and done.stderr.count("\n") == 1, done.stderr
    assert "training.stepz" in done.stderr and "did you mean training.steps" in done.stderr
    helped = subprocess.run([str(REPO / "run_train.sh"), "--help"], cwd=tmp_path, env=env, capture_output=True,
                            text=True, timeout=120)
    assert helped.returncode == 0 and "NGPU" in helped.stdout and "debug.toml" in helped.stdout


@pytest.mark.slow
def test_ctrl_c_stops_after_the_step_with_a_checkpoint_and_says_how_to_resume(tmp_path, tiny_ckpt):
    """Defect 9: Ctrl-C printed ~80 lines of tracebacks and saved nothing. The first SIGINT finishes the step,
    writes a checkpoint, prints the summary and exits 130 (issue 47, defect 8: it exited 0, where shells and
    schedulers expect 130); the same command then resumes from that step."""
    import signal

    argv = [sys.executable, "-m", "torchplex.train", f"--job.config_file={REPO / 'train_configs' / 'debug.toml'}",
            f"--job.output_dir={tmp_path}", "--job.name=interrupted", f"--model.hf_checkpoint={tiny_ckpt}",
            f"--data.synthetic_dir={tmp_path / 'synthetic'}", "--data.synthetic_train=32", "--data.synthetic_eval=4",
            "--data.prompts_per_step=2", "--rollout.max_new_tokens=4", "--training.steps=200",
            "--training.sft_warmup_steps=0", "--metrics.eval_interval=0", "--metrics.log_interval=1",
            "--metrics.tensorboard=false", "--checkpoint.enable=true", "--checkpoint.interval=1000"]
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    # SIGINT at its default in the child: a suite started in the background (`pytest &`) has it ignored, inherited
    # through exec, and the run would never see the Ctrl-C (it finished all 200 steps)
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if "step 2/200" in line:
            proc.send_signal(signal.SIGINT)
            break
    rest, _ = proc.communicate(timeout=120)
    output = "".join(lines) + rest
    assert proc.returncode == 130, output
    assert "Traceback" not in output
    stopped = int(output.split("stopped at step ")[1].split()[0])
    assert (tmp_path / "interrupted" / "checkpoints" / f"step-{stopped}").is_dir()
    assert "resumes from" in output and "checkpoint: " in output.rstrip().splitlines()[-1]


def _trainer_args(tmp_path: Path, tiny_ckpt: Path, records: Path, name: str) -> list[str]:
    return [f"--job.config_file={REPO / 'train_configs' / 'debug.toml'}", f"--job.output_dir={tmp_path}",
            f"--job.name={name}", f"--model.hf_checkpoint={tiny_ckpt}", f"--data.train_file={records}",
            "--data.prompts_per_step=2", "--rollout.max_new_tokens=4", "--training.steps=2",
            "--training.sft_warmup_steps=0", "--metrics.eval_interval=0", "--metrics.tensorboard=false"]


def test_a_dataset_of_bad_records_fails_naming_the_file_and_the_skips(tmp_path, tiny_ckpt):
    """Defect 4: a dataset in which every record is bad "succeeded" (exit 0, nothing trained)."""
    from torchplex.config import load_config
    from torchplex.data.skips import DataError
    from torchplex.train import Trainer

    malformed = tmp_path / "malformed.jsonl"
    malformed.write_text('{"prompt": "p"}\nnot json\n{"answer": "1"}\n')
    with pytest.raises(DataError, match=r"malformed\.jsonl: 0 valid records.*train/malformed 3"):
        Trainer(load_config(_trainer_args(tmp_path, tiny_ckpt, malformed, "malformed")))

    missing = tmp_path / "missing.jsonl"
    missing.write_text("".join(f'{{"id": "m{i}", "prompt": "p", "answer": "1", "image": "gone{i}.png"}}\n'
                               for i in range(4)))
    trainer = Trainer(load_config(_trainer_args(tmp_path, tiny_ckpt, missing, "missing")))
    with pytest.raises(DataError, match=r"train step has no valid sample.*missing\.jsonl.*train/media 2"):
        trainer.train()


def test_trainer_refuses_a_used_run_folder_and_overwrites_it_when_told(tmp_path, tiny_ckpt):
    """Defect 2 at the trainer: a second run into the same folder appended its steps to the first's."""
    from torchplex.config import load_config
    from torchplex.train import Trainer

    records = tmp_path / "train.jsonl"
    records.write_text("".join(f'{{"id": "t{i}", "prompt": "p", "answer": "1"}}\n' for i in range(4)))
    run = tmp_path / "used"
    run.mkdir()
    (run / "metrics.jsonl").write_text('{"step": 1, "loss": 1.0}\n')
    args = _trainer_args(tmp_path, tiny_ckpt, records, "used")
    with pytest.raises(RunFolderError, match="holds an earlier run"):
        Trainer(load_config(args + ["--job.overwrite=false"]))
    assert (run / "metrics.jsonl").read_text() and not (run / "config.toml").exists()
    Trainer(load_config(args + ["--job.overwrite=true"]))
    assert not (run / "metrics.jsonl").exists() or (run / "metrics.jsonl").read_text() == ""
    assert (run / "config.toml").is_file()
