"""Acceptance runs of users' own data through `./run_train.sh` overrides on CPU (tiny model, 2 steps, no warm-up):
a Parquet dataset with image bytes (several images in some records) and a user reward by file import path; a
JSONL of video files with a broken video (skipped and counted) and a reward that raises on one record (counted);
the run stopping when too many samples' rewards fail."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from datasets import Dataset, Features, Image as ImageFeature, List, Value
from PIL import Image

from torchplex.data.synthetic_video import generate_video_task

REPO_ROOT = Path(__file__).resolve().parents[1]
DEBUG_TOML = REPO_ROOT / "train_configs" / "debug.toml"
VIDEO_TOML = REPO_ROOT / "train_configs" / "debug_video.toml"
TIMEOUT_S = 300

USER_REWARDS = textwrap.dedent("""
    def distinct(prompts, responses, answers, records):
        # differs between samples of the random model, so advantages and gradients are non-zero
        return [len(set(r)) / 16 for r in responses]

    def fragile(prompts, responses, answers, records):
        out = []
        for rec, r in zip(records, responses):
            if rec.id == "video-train-0":
                raise RuntimeError("no reward for " + rec.id)
            out.append(len(set(r)) / 16)
        return out
""")


def png(colour: str, size=(56, 56)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, colour).save(buf, "PNG")
    return buf.getvalue()


def run_train_sh(config: Path, args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO_ROOT), PYTHON=sys.executable,
               CONFIG_FILE=str(config))
    return subprocess.run([str(REPO_ROOT / "run_train.sh"), *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=TIMEOUT_S)


def tiny_args(tmp_path: Path, tiny_ckpt: Path, name: str) -> list[str]:
    return [f"--model.hf_checkpoint={tiny_ckpt}", f"--job.output_dir={tmp_path}", f"--job.name={name}",
            "--training.steps=2", "--training.sft_warmup_steps=0", "--data.prompts_per_step=2",
            "--rollout.n_samples=4", "--rollout.max_new_tokens=8", "--metrics.eval_interval=2",
            "--metrics.tensorboard=false", "--metrics.progress_bar=false", "--optimizer.lr=1e-3"]


def read_metrics(run_dir: Path) -> dict[int, dict]:
    return {r["step"]: r for r in map(json.loads, (run_dir / "metrics.jsonl").read_text().splitlines())}


@pytest.fixture
def reward_file(tmp_path) -> Path:
    path = tmp_path / "my_rewards.py"
    path.write_text(USER_REWARDS)
    return path


@pytest.mark.slow
def test_parquet_with_image_bytes_trains_with_a_user_reward(tmp_path, tiny_ckpt, reward_file):
    features = Features({"problem": Value("string"), "solution": Value("string"), "pics": List(ImageFeature())})
    train = {"problem": ["Which is red, <image> or <image>?", "How many squares?", "", "Colour of the square?"],
             "solution": ["first", "1", "x", "red"],
             "pics": [[{"bytes": png("red"), "path": None}, {"bytes": png("blue", (84, 56)), "path": None}],
                      [{"bytes": png("green"), "path": None}], [], [{"bytes": png("red"), "path": None}]]}
    Dataset.from_dict(train, features=features).to_parquet(str(tmp_path / "train-00000.parquet"))
    evals = {"problem": ["Colour?", "Colour?"], "solution": ["red", "blue"],
             "pics": [[{"bytes": png("red"), "path": None}], [{"bytes": png("blue"), "path": None}]]}
    Dataset.from_dict(evals, features=features).to_parquet(str(tmp_path / "geo_test.parquet"))
    args = tiny_args(tmp_path, tiny_ckpt, "parquet") + [
        f"--data.train_files={tmp_path / 'train-*.parquet'}", f"--data.eval_files={tmp_path / 'geo_test.parquet'}",
        "--data.prompt_key=problem", "--data.answer_key=solution", "--data.image_key=pics", "--data.eval_k=2",
        f"--reward.functions=accuracy,{reward_file}:distinct", "--reward.weights=1.0,1.0"]
    done = run_train_sh(DEBUG_TOML, args, tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    metrics = read_metrics(tmp_path / "parquet")
    assert sorted(metrics) == [0, 1, 2]
    for step in (1, 2):
        assert metrics[step]["grad_norm"] > 0 and metrics[step][f"reward/{reward_file}:distinct"] > 0
    for key in ("accuracy", "mean@2", "pass@1", "pass@2"):
        assert 0 <= metrics[2][f"eval/geo_test/{key}"] <= 1
    assert "skipping bad record" in done.stdout + done.stderr  # the empty prompt, skipped while reading
    assert metrics[1]["skipped/bad_records"] == 1
    assert "geo_test: accuracy" in done.stdout + done.stderr  # per-set metrics on the console


@pytest.mark.slow
def test_jsonl_of_video_files_trains_skipping_a_broken_video_and_counting_a_raising_reward(
        tmp_path, tiny_ckpt, reward_file):
    train, _ = generate_video_task(tmp_path / "videos", num_train=3, num_eval=2, seed=0)
    (tmp_path / "videos" / "videos" / "broken.mp4").write_bytes(b"\x00\x01 not a video" * 50)
    lines = train.read_text() + json.dumps({"id": "broken", "prompt": "How many?", "answer": "1",
                                            "videos": ["videos/broken.mp4"]}) + "\n"
    train.write_text(lines)
    args = tiny_args(tmp_path, tiny_ckpt, "video") + [
        f"--data.train_file={train}", f"--data.eval_file={train.with_name('eval.jsonl')}", "--data.prompts_per_step=4",
        f"--reward.functions=format,{reward_file}:fragile", "--reward.weights=1.0,1.0",
        "--reward.max_failure_fraction=0.5"]
    done = run_train_sh(VIDEO_TOML, args, tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    metrics = read_metrics(tmp_path / "video")
    # every step's batch is the 4 records: the broken video is skipped, video-train-0's 4 samples fail to score
    assert [metrics[s]["skipped/bad_samples"] for s in (1, 2)] == [1, 2]
    assert [metrics[s]["reward/failures"] for s in (1, 2)] == [4, 8]
    assert all(metrics[s]["grad_norm"] > 0 for s in (1, 2))
    assert "eval/accuracy" in metrics[2]
    assert "video-train-0" in done.stdout + done.stderr  # the failing record is named


@pytest.mark.slow
def test_run_stops_when_too_many_rewards_fail(tmp_path, tiny_ckpt, reward_file):
    train, _ = generate_video_task(tmp_path / "videos", num_train=2, num_eval=0, seed=0)
    args = tiny_args(tmp_path, tiny_ckpt, "stop") + [
        f"--data.train_file={train}", "--metrics.eval_interval=0",
        f"--reward.functions={reward_file}:fragile", "--reward.weights=1.0", "--reward.max_failure_fraction=0.1"]
    done = run_train_sh(VIDEO_TOML, args, tmp_path)
    assert done.returncode != 0
    assert "reward.max_failure_fraction=0.1" in done.stdout + done.stderr
