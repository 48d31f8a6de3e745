"""What a new user meets running the trainer (issue 47): own data and rewards, Ctrl-C, two launches into one run
folder, resume. Whole tiny runs on CPU, in process where one process shows the behaviour and as real processes
(subprocess + signals) where it takes two of them or a signal."""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from PIL import Image

from torchplex.config import load_config
from torchplex.rl import rewards
from torchplex.train import USER_ERRORS, Trainer

from test_train_e2e import read_metrics

REPO = Path(__file__).resolve().parents[1]
DEBUG_TOML = REPO / "train_configs" / "debug.toml"


def write_records(path: Path, n: int, prefix: str = "t", images: bool = False) -> Path:
    """`n` records "What is i + 1?"; with `images`, each with a small image of its own."""
    rows = []
    for i in range(n):
        row = {"id": f"{prefix}{i}", "prompt": f"What is {i} + 1?", "answer": str(i + 1)}
        if images:
            Image.new("RGB", (56, 56), (40 * i % 256, 90, 160)).save(path.parent / f"{prefix}{i}.png")
            row["images"] = [f"{prefix}{i}.png"]
        rows.append(json.dumps(row) + "\n")
    path.write_text("".join(rows))
    return path


def run_args(tmp_path: Path, tiny_ckpt: Path, name: str, *extra: str, images: bool = False) -> list[str]:
    """debug.toml cut to a run of a few seconds on the tiny checkpoint and a JSONL of 8 records."""
    train = write_records(tmp_path / "train.jsonl", 8, images=images)
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


def test_a_launch_that_fails_its_checks_leaves_an_earlier_run_as_it_was(tmp_path, tiny_ckpt):
    """Issue 47, defect 1: with job.overwrite = true, a launch whose data glob matched nothing first deleted the
    earlier run's metrics and TensorBoard logs, then failed. Every check now runs before the folder is touched."""
    run = tmp_path / "runs" / "kept"
    (run / "tb").mkdir(parents=True)
    (run / "tb" / "events.out.tfevents.1").write_bytes(b"events")
    (run / "metrics.jsonl").write_text('{"step": 1, "loss": 1.0}\n')
    before = {p.relative_to(run): p.read_bytes() for p in run.rglob("*") if p.is_file()}
    args = run_args(tmp_path, tiny_ckpt, "kept", "--job.overwrite=true")
    with pytest.raises(FileNotFoundError, match="matches no file"):
        Trainer(load_config(args + [f"--data.train_files={tmp_path / 'nothing-*.parquet'}"]))
    assert {p.relative_to(run): p.read_bytes() for p in run.rglob("*") if p.is_file()} == before


def test_an_unset_checkpoint_path_is_named_as_unset(tmp_path, monkeypatch):
    """Issue 47, defect 11: with no config the error showed `model.hf_checkpoint = '.'`, a value never set."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(FileNotFoundError) as failed:
        Trainer(load_config([]))
    assert str(failed.value).startswith("model.hf_checkpoint is not set") and "'.'" not in str(failed.value)
    assert not any(tmp_path.iterdir())  # nothing written


# ---- real processes ------------------------------------------------------------------------------------------------
def process_env() -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=str(REPO), PYTHON=sys.executable, OMP_NUM_THREADS="1")


def launch(args: list[str], cwd: Path, **popen) -> subprocess.Popen:
    """./run_train.sh with `args`, its output (stdout and stderr together) piped; SIGINT at its default in the child
    (a suite started in the background has it ignored, inherited through exec)."""
    return subprocess.Popen([str(REPO / "run_train.sh"), *args], cwd=cwd, env=process_env(), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL), **popen)


def read_until(proc: subprocess.Popen, marker: str, lines: list[str]) -> None:
    """Read the process's output into `lines` until a line contains `marker` (fails if it ends first)."""
    for line in proc.stdout:
        lines.append(line)
        if marker in line:
            return
    raise AssertionError(f"{marker!r} never printed:\n{''.join(lines)}")


@pytest.mark.slow
def test_a_second_launch_into_a_live_runs_folder_is_refused_and_the_live_run_goes_on(tmp_path, tiny_ckpt):
    """Issue 47, defect 1: a second `--job.name=X` launch while run X was alive printed "held an earlier run:
    replaced (... removed metrics.jsonl, tb)" and then its own error; the live run crashed on its deleted TensorBoard
    file and its metrics were gone. Now the live run's lock refuses any second launch (one line, exit 2) and a launch
    with a bad config fails its checks first; the live run finishes untouched."""
    args = run_args(tmp_path, tiny_ckpt, "live", "--training.steps=1000", "--metrics.tensorboard=true")
    first, lines = launch(args, tmp_path), []
    try:
        read_until(first, "step 1/1000", lines)
        failing = subprocess.run([str(REPO / "run_train.sh"), *args, f"--data.train_files={tmp_path}/none-*.jsonl"],
                                 cwd=tmp_path, env=process_env(), capture_output=True, text=True, timeout=300)
        assert failing.returncode == 2 and "matches no file" in failing.stderr, failing.stderr
        second = subprocess.run([str(REPO / "run_train.sh"), *args], cwd=tmp_path, env=process_env(),
                                capture_output=True, text=True, timeout=300)
        assert second.returncode == 2, second.stdout + second.stderr
        refusal = second.stderr.strip().splitlines()
        assert len(refusal) == 1 and "is in use by a running job" in refusal[0] and f"pid {first.pid}" in refusal[0]
        assert "replaced" not in failing.stdout + failing.stderr + second.stdout + second.stderr
        first.send_signal(signal.SIGINT)
        rest, _ = first.communicate(timeout=300)
    finally:
        if first.poll() is None:
            first.kill()
    output = "".join(lines) + rest
    assert first.returncode == 130 and "Traceback" not in output, output
    stopped = int(output.split("stopped at step ")[1].split()[0])
    metrics = (tmp_path / "runs" / "live" / "metrics.jsonl").read_text().splitlines()
    steps = [json.loads(line)["step"] for line in metrics]
    assert steps == list(range(1, stopped + 1))
    assert any((tmp_path / "runs" / "live" / "tb").iterdir())


def synthetic_args(tmp_path: Path, tiny_ckpt: Path, name: str, *extra: str) -> list[str]:
    return [f"--job.config_file={DEBUG_TOML}", f"--job.output_dir={tmp_path / 'runs'}", f"--job.name={name}",
            f"--model.hf_checkpoint={tiny_ckpt}", f"--data.synthetic_dir={tmp_path / 'synthetic'}",
            "--data.synthetic_train=8", "--data.synthetic_eval=4", "--data.prompts_per_step=2", *extra]


def task_of(trainer: Trainer) -> list[tuple]:
    """The eval set as the model sees it: prompts, answers and image bytes."""
    return [(r.prompt, r.answer, [Path(i).read_bytes() for i in r.images]) for r in trainer.eval_records]


def test_the_synthetic_task_is_the_same_for_every_job_seed_and_never_rewritten_under_a_run(tmp_path, tiny_ckpt):
    """Issue 47, defect 10: the synthetic task was generated from job.seed into one shared folder, so runs with
    different seeds trained and evaluated on different tasks, and a new run rewrote the images under a run still
    reading them. The task now has its own seed (data.synthetic_seed) and a folder per task version, seed and size."""
    first = Trainer(load_config(synthetic_args(tmp_path, tiny_ckpt, "a", "--job.seed=0")))
    files = {p: (p.read_bytes(), p.stat().st_mtime_ns) for p in (tmp_path / "synthetic").rglob("*") if p.is_file()}
    other_seed = Trainer(load_config(synthetic_args(tmp_path, tiny_ckpt, "b", "--job.seed=1")))
    assert task_of(other_seed) == task_of(first)
    other_task = Trainer(load_config(synthetic_args(tmp_path, tiny_ckpt, "c", "--data.synthetic_seed=1")))
    assert task_of(other_task) != task_of(first)
    for path, (data, mtime) in files.items():  # the first run's files, as it found them
        assert path.read_bytes() == data and path.stat().st_mtime_ns == mtime, path
    assert len([p for p in (tmp_path / "synthetic").iterdir() if not p.name.startswith(".")]) == 2


def test_after_a_warm_up_the_reference_is_the_warmed_up_policy(tmp_path, tiny_ckpt):
    """Issue 47, defect 7: with a KL penalty after an SFT warm-up the reference was the random checkpoint before the
    warm-up (KL 6-9 from the first GRPO step). The reference of an RL run is its starting policy: at the first GRPO
    step, before any update, the actor scores every sample exactly as the reference does."""
    trainer = Trainer(load_config(run_args(tmp_path, tiny_ckpt, "kl", "--algorithm.kl_coef=0.05",
                                           "--training.sft_warmup_steps=3", "--training.sft_batch_size=2",
                                           "--training.steps=1")))
    before = {name: p.detach().clone() for name, p in trainer.reference.named_parameters()}
    trainer.train()
    assert read_metrics(tmp_path / "runs" / "kl")[1]["kl"] == pytest.approx(0.0, abs=1e-7)
    assert any(not torch.equal(p, before[name]) for name, p in trainer.reference.named_parameters())


def test_a_resumed_run_keeps_the_warmed_up_reference(tmp_path, tiny_ckpt, monkeypatch):
    """Issue 47, defect 7 on resume: the warmed-up reference is saved with the checkpoints, so a run resumed after a
    crash has the same KL term as the run that went straight through."""
    # a reward the random model earns unevenly, so the steps move the actor away from the reference
    monkeypatch.setitem(rewards.REWARD_FUNCTIONS, "distinct_chars", lambda response, answer: len(set(response)) / 16)
    options = ["--algorithm.kl_coef=0.05", "--training.sft_warmup_steps=3", "--training.sft_batch_size=2",
               "--training.steps=3", "--checkpoint.enable=true", "--checkpoint.interval=1", "--optimizer.lr=1e-3",
               "--reward.functions=distinct_chars", "--reward.weights=1.0"]
    # images: every weight trains (a checkpoint of text-only steps has no optimizer state for the vision tower)
    Trainer(load_config(run_args(tmp_path, tiny_ckpt, "straight", *options, images=True))).train()
    crashing = Trainer(load_config(run_args(tmp_path, tiny_ckpt, "resumed", *options, images=True)))
    run_step = crashing.train_step

    def crash_in_step_3():
        if crashing.step == 3:
            raise KeyboardInterrupt  # a second Ctrl-C, or a preemption
        return run_step()

    crashing.train_step = crash_in_step_3
    with pytest.raises(KeyboardInterrupt):
        crashing.train()
    Trainer(load_config(run_args(tmp_path, tiny_ckpt, "resumed", *options, images=True))).train()
    straight, resumed = read_metrics(tmp_path / "runs" / "straight"), read_metrics(tmp_path / "runs" / "resumed")
    assert straight[3]["kl"] > 0 and resumed[3]["kl"] == straight[3]["kl"]


@pytest.mark.slow
def test_ctrl_c_during_the_warm_up_says_where_it_stopped_and_exits_130(tmp_path, tiny_ckpt):
    """Issue 47, defect 8: Ctrl-C during the warm-up said "checkpoints are off" with checkpoints on, and "0/8 GRPO
    steps after 100 warm-up steps" after 51 of them, without saying that the warm-up is not checkpointed (a rerun
    starts it over); a stop on request exited 0."""
    args = run_args(tmp_path, tiny_ckpt, "warm", "--training.sft_warmup_steps=100000", "--training.sft_batch_size=1",
                    "--checkpoint.enable=true")
    proc, lines = launch(args, tmp_path), []
    try:
        read_until(proc, "warm-up step 50/100000", lines)
        proc.send_signal(signal.SIGINT)
        rest, _ = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    output = "".join(lines) + rest
    assert proc.returncode == 130 and "Traceback" not in output, output
    assert "checkpoints are off" not in output
    done = int(output.split("stopped during the warm-up at step ")[1].split("/")[0])
    assert done >= 50 and "the warm-up is not checkpointed: the same command starts it over" in output
    assert f"stopped: 0/2 GRPO steps after {done}/100000 warm-up steps (the warm-up is not checkpointed)" in output


INTERRUPTED_SAVE = """
import signal, sys
from torch.distributed.checkpoint.filesystem import FileSystemWriter

write_data = FileSystemWriter.write_data

def second_ctrl_c(self, *args, **kwargs):  # the second Ctrl-C, while the checkpoint's files are being written
    signal.raise_signal(signal.SIGINT)
    return write_data(self, *args, **kwargs)

FileSystemWriter.write_data = second_ctrl_c
from torchplex.train import main
main(sys.argv[1:])
"""


@pytest.mark.slow
def test_a_second_ctrl_c_during_the_checkpoint_save_stops_at_once_leaving_no_partial_checkpoint(tmp_path, tiny_ckpt):
    """Issue 47, defect 8: a second Ctrl-C while the stop's checkpoint was written was a 66-line CheckpointException.
    It stops at once (exit 130, one line) and leaves no partial checkpoint that a resume would trip over."""
    script = tmp_path / "interrupted_save.py"
    script.write_text(INTERRUPTED_SAVE)
    args = run_args(tmp_path, tiny_ckpt, "saving", "--training.steps=1000", "--checkpoint.enable=true",
                    "--checkpoint.interval=100000")
    proc = subprocess.Popen([sys.executable, str(script), *args], cwd=tmp_path, env=process_env(),
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    lines: list[str] = []
    try:
        read_until(proc, "step 1/1000", lines)
        proc.send_signal(signal.SIGINT)  # the first Ctrl-C: finish the step and save
        rest, _ = proc.communicate(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
    output = "".join(lines) + rest
    assert proc.returncode == 130, output
    assert "Traceback" not in output and "CheckpointException" not in output, output
    assert output.rstrip().splitlines()[-1] == "interrupted"
    checkpoints = tmp_path / "runs" / "saving" / "checkpoints"
    assert not checkpoints.exists() or list(checkpoints.iterdir()) == []


def test_no_loadable_checkpoint_is_one_line_saying_how_to_start_over(tmp_path, tiny_ckpt):
    """Issue 47, defect 9: with every checkpoint truncated the resume was a 46-line traceback with no advice. It is a
    user error (one line, exit status 2) naming the folder, each checkpoint's reason and how to start over."""
    args = run_args(tmp_path, tiny_ckpt, "broken", "--training.steps=1", "--checkpoint.enable=true",
                    "--checkpoint.interval=1")
    Trainer(load_config(args)).train()
    checkpoints = tmp_path / "runs" / "broken" / "checkpoints"
    for shard in checkpoints.glob("step-*/*.distcp"):
        shard.write_bytes(shard.read_bytes()[:40])  # truncated mid-write
    with pytest.raises(USER_ERRORS) as failed:
        Trainer(load_config(args + ["--training.steps=2"])).train()
    message = str(failed.value)
    assert "\n" not in message and f"no checkpoint in {checkpoints} loads (step 1: " in message
    assert f"move {checkpoints} aside, or pass --checkpoint.resume=false --job.overwrite=true" in message
