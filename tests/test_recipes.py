"""The public-recipe configs (geometry3k-style math, CLEVR-style counting, video reasoning) read data shaped like
their public datasets with their own column keys, and their rewards score a well-formed correct answer 1."""

from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
from datasets import Dataset, Features, Image as ImageFeature, List, Value
from PIL import Image

from torchplex.config import load_config
from torchplex.data.sources import ColumnKeys, load_records
from torchplex.data.synthetic_video import generate_video_task
from torchplex.rl.reward_functions import get_reward
from torchplex.rl.rewards import combine_rewards

CONFIGS = Path(__file__).resolve().parents[1] / "train_configs"


def png() -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (64, 48), "white").save(buf, "PNG")
    return buf.getvalue()


def image_parquet(path: Path, prompt: str, answer: str) -> None:
    features = Features({"problem": Value("string"), "answer": Value("string"), "images": List(ImageFeature())})
    Dataset.from_dict({"problem": [prompt], "answer": [answer], "images": [[{"bytes": png(), "path": None}]]},
                      features=features).to_parquet(str(path))


def keys_of(cfg) -> ColumnKeys:
    d = cfg.data
    return ColumnKeys(prompt=d.prompt_key, answer=d.answer_key, images=d.image_key, videos=d.video_key)


@pytest.mark.parametrize("recipe, response", [
    ("geometry3k_7b.toml", "<think>angles sum</think><answer>\\boxed{2\\sqrt{3}}</answer>"),
    ("clevr_count_7b.toml", "<think>one, two, three</think><answer>3</answer>"),
    ("video_reasoning_7b.toml", "<think>the ball moves left</think><answer>B</answer>"),
])
def test_recipe_reads_its_dataset_shape_and_rewards_a_correct_answer(tmp_path, recipe, response):
    cfg = load_config(["--job.config_file", str(CONFIGS / recipe)])
    if recipe == "geometry3k_7b.toml":
        image_parquet(tmp_path / "train-00000-of-00001.parquet", "<image>Find x.", "2\\sqrt{3}")
    elif recipe == "clevr_count_7b.toml":
        image_parquet(tmp_path / "train-00000-of-00001.parquet", "How many items are there?", "3")
    else:
        generate_video_task(tmp_path / "v", num_train=1, num_eval=0)
        row = {"problem": "Where does the ball go? Options: (A) right (B) left", "solution": "<answer>B</answer>",
               "path": "v/videos/train-0.mp4", "problem_type": "multiple choice"}
        (tmp_path / "train.jsonl").write_text(json.dumps(row) + "\n")
    pattern = str(tmp_path / ("train.jsonl" if "video" in recipe else "train-*.parquet"))
    [record] = load_records([pattern], keys_of(cfg))
    assert (len(record.images), len(record.videos)) == ((0, 1) if "video" in recipe else (1, 0))
    get_reward(cfg.reward.correct)  # resolves
    total, parts = combine_rewards([response], [record.answer], cfg.reward.functions, cfg.reward.weights)
    assert all(v == [1.0] for v in parts.values()) and total == [pytest.approx(sum(cfg.reward.weights))]
