"""Write local data in a shipped recipe's own format from the synthetic tasks (no hub): what the recipes' GPU runs
(benchmarks/recipes.py) and tests train on.

    python tools/make_recipe_data.py --format geometry3k --output /tmp/geo --train 64 --eval 16 --size 896
    python tools/make_recipe_data.py --format clevr_count --output /tmp/clevr
    python tools/make_recipe_data.py --format video_qa --output /tmp/video --size 448 --frames 32

Formats (the columns the recipe TOMLs name):
  geometry3k   Parquet shards train-00000-of-00001.parquet / test-..., columns problem (with an <image>
               placeholder), answer (LaTeX: a count n written \\sqrt{n^2}, which the math reward must prove
               equal to \\boxed{n}), images (a list of datasets Image values: PNG bytes)
  clevr_count  Parquet shards likewise, columns problem, answer (an integer as text), images
  video_qa     train.jsonl / eval.jsonl rows {"problem": question + lettered options, "solution":
               "<answer>B</answer>", "path": "videos/....mp4"} (Video-R1's layout), mp4 files next to them
Every sample is the synthetic tasks' counting question (torchplex/data/synthetic.py, synthetic_video.py), so an
answer is checkable; the files are written once per set of arguments (a manifest) and reused.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `torchplex` importable from the repo root
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from torchplex.data.records import read_records  # noqa: E402
from torchplex.data.synthetic import generate_synthetic_task  # noqa: E402
from torchplex.data.synthetic_video import MAX_COUNT, QUESTION, generate_video_task  # noqa: E402

FORMATS = ("geometry3k", "clevr_count", "video_qa")
LETTERS = "ABCD"


def _parquet(records, folder: Path, path: Path, answer) -> None:
    """The records as a Parquet shard of problem / answer / images (PNG bytes as datasets Image values)."""
    from datasets import Dataset, Features, Image, Sequence, Value
    from datasets.utils.logging import disable_progress_bar

    disable_progress_bar()
    rows = {"problem": [], "answer": [], "images": []}
    for r in records:
        question = r.prompt.split(" Put the final answer")[0]
        rows["problem"].append(f"<image>{question}")
        rows["answer"].append(answer(r.answer))
        rows["images"].append([{"bytes": (folder / image).read_bytes(), "path": None} for image in r.images])
    features = Features({"problem": Value("string"), "answer": Value("string"), "images": Sequence(Image())})
    Dataset.from_dict(rows, features=features).to_parquet(str(path))


def _video_rows(jsonl: Path) -> list[dict]:
    """The video task's rows (synthetic_video.py's JSONL) as multiple-choice questions over the video file."""
    rows = []
    for line in jsonl.read_text().splitlines():
        r = json.loads(line)
        count = int(r["answer"])
        options = " ".join(f"{LETTERS[i]}. {i + 1}" for i in range(MAX_COUNT))
        rows.append({"problem": f"{QUESTION} Options: {options}", "solution": f"<answer>{LETTERS[count - 1]}</answer>",
                     "path": r["videos"][0]})
    return rows


def make_recipe_data(fmt: str, output: str | Path, num_train: int = 64, num_eval: int = 16, size: int = 448,
                     frames: int = 16, seed: int = 0) -> dict[str, str]:
    """Write `fmt` under `output`; returns the data keys to pass to the recipe ({"train_files": glob,
    "eval_files": glob})."""
    if fmt not in FORMATS:
        raise ValueError(f"unknown format {fmt!r}; one of {', '.join(FORMATS)}")
    output = Path(output)
    params = {"format": fmt, "train": num_train, "eval": num_eval, "size": size, "frames": frames, "seed": seed}
    manifest = output / "recipe_manifest.json"
    if fmt == "video_qa":
        train_jsonl, eval_jsonl = generate_video_task(output / "source", num_train, num_eval, seed=seed,
                                                      size=(size, size), num_frames=frames, fps=2)
        out = {"train_files": str(output / "source" / "train_qa.jsonl"),
               "eval_files": str(output / "source" / "eval_qa.jsonl")}
        if not (manifest.is_file() and json.loads(manifest.read_text()) == params):
            for src, dst in ((train_jsonl, out["train_files"]), (eval_jsonl, out["eval_files"])):
                rows = _video_rows(src)
                Path(dst).write_text("".join(json.dumps(row) + "\n" for row in rows))
            manifest.write_text(json.dumps(params))
        return out
    source = output / "source"
    train_jsonl, eval_jsonl = generate_synthetic_task(source, num_train, num_eval, seed=seed, image_size=(size, size),
                                                      kinds=("counting",))
    answer = (lambda n: f"\\sqrt{{{int(n) ** 2}}}") if fmt == "geometry3k" else str
    out = {"train_files": str(output / "data" / "train-*.parquet"), "eval_files": str(output / "data" / "test-*.parquet")}
    if not (manifest.is_file() and json.loads(manifest.read_text()) == params):
        (output / "data").mkdir(parents=True, exist_ok=True)
        _parquet(read_records(train_jsonl), source, output / "data" / "train-00000-of-00001.parquet", answer)
        _parquet(read_records(eval_jsonl), source, output / "data" / "test-00000-of-00001.parquet", answer)
        manifest.write_text(json.dumps(params))
    return out


def main(argv: list[str] | None = None) -> dict[str, str]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--format", required=True, choices=FORMATS)
    parser.add_argument("--output", required=True, type=Path)
    parser.add_argument("--train", type=int, default=64)
    parser.add_argument("--eval", type=int, default=16)
    parser.add_argument("--size", type=int, default=448, help="image or frame side in pixels (even)")
    parser.add_argument("--frames", type=int, default=16, help="frames per video (video_qa)")
    parser.add_argument("--seed", type=int, default=0)
    a = parser.parse_args(argv)
    keys = make_recipe_data(a.format, a.output, a.train, a.eval, a.size, a.frames, a.seed)
    print(" ".join(f"--data.{k}={v}" for k, v in keys.items()))
    return keys


if __name__ == "__main__":
    main()
