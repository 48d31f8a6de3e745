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


@pytest.mark.parametrize("recipe, fmt, response", [
    ("geometry3k_7b.toml", "geometry3k", "<think>count</think><answer>\\boxed{{{n}}}</answer>"),
    ("clevr_count_7b.toml", "clevr_count", "<think>count</think><answer>{n}</answer>"),
    ("video_reasoning_7b.toml", "video_qa", "<think>count</think><answer>{letter}</answer>"),
])
def test_recipe_data_tool_writes_the_recipes_own_format(tmp_path, recipe, fmt, response):
    """tools/make_recipe_data.py (the GPU runs' data): the recipe's keys read every row, with its image or video,
    and the recipe's rewards give the row's true count full marks (geometry3k's answer is LaTeX, sqrt(n^2))."""
    import sys

    sys.path.insert(0, str(CONFIGS.parent))
    from tools.make_recipe_data import LETTERS, make_recipe_data

    cfg = load_config(["--job.config_file", str(CONFIGS / recipe)])
    keys = make_recipe_data(fmt, tmp_path, num_train=4, num_eval=2, size=56, frames=4)
    train, held_out = load_records([keys["train_files"]], keys_of(cfg)), load_records([keys["eval_files"]], keys_of(cfg))
    assert (len(train), len(held_out)) == (4, 2)
    for record in train:
        assert (len(record.images), len(record.videos)) == ((0, 1) if fmt == "video_qa" else (1, 0))
        if fmt == "geometry3k":
            assert record.prompt.startswith("<image>") and record.answer.startswith("\\sqrt{")
            n = round(int(record.answer[6:-1]) ** 0.5)
        elif fmt == "clevr_count":
            n = int(record.answer)
        else:
            n = LETTERS.index(record.answer.removeprefix("<answer>")[0]) + 1
        text = response.format(n=n, letter=LETTERS[n - 1])
        total, parts = combine_rewards([text], [record.answer], cfg.reward.functions, cfg.reward.weights)
        assert all(v == [1.0] for v in parts.values()), (record.answer, text, parts)
    # written once per set of arguments: a second call reuses the files
    stamp = {p: p.stat().st_mtime_ns for p in tmp_path.rglob("*") if p.is_file()}
    make_recipe_data(fmt, tmp_path, num_train=4, num_eval=2, size=56, frames=4)
    assert stamp == {p: p.stat().st_mtime_ns for p in tmp_path.rglob("*") if p.is_file()}
