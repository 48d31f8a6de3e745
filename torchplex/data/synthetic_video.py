"""A synthetic video task that writes real video files: count the shapes moving across the frame.

Each sample is an mp4 (MPEG-4 part 2, which every PyAV wheel can encode) of 1..4 coloured squares sliding in
straight lines over a plain background, and a JSONL record

    {"id": "video-train-3", "prompt": "How many squares move in the video? Put the final answer in ...",
     "answer": "2", "videos": ["videos/train-3.mp4"], "task": "video_counting"}

so the whole user path (file -> PyAV frames -> processor -> model -> reward) runs on CPU at tiny sizes. Files
are regenerated only when the parameters in `manifest.json` change.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw

from .synthetic import ANSWER_INSTRUCTION, BACKGROUND, PALETTE
from .video import write_video

QUESTION = "How many squares move in the video?"
MAX_COUNT = 4
VERSION = 1


def _frames(rng: np.random.Generator, count: int, size: tuple[int, int], num_frames: int) -> list[Image.Image]:
    w, h = size
    side = max(4, min(w, h) // 6)
    colours = rng.choice(list(PALETTE), size=count, replace=False)
    # one horizontal lane per square so they never hide each other; each slides left or right at its own speed
    lanes = rng.permutation(max(count, h // side))[:count]
    starts = rng.uniform(0, w - side, size=count)
    speeds = rng.uniform(0.5, 2.0, size=count) * rng.choice([-1, 1], size=count) * (w - side) / num_frames
    frames = []
    for t in range(num_frames):
        image = Image.new("RGB", size, BACKGROUND)
        draw = ImageDraw.Draw(image)
        for lane, start, speed, colour in zip(lanes, starts, speeds, colours):
            x = (start + speed * t) % (w - side)
            y = int(lane) * side % (h - side + 1)
            draw.rectangle([int(x), y, int(x) + side - 1, y + side - 1], fill=PALETTE[str(colour)])
        frames.append(image)
    return frames


def generate_video_task(out_dir: str | Path, num_train: int, num_eval: int, seed: int = 0,
                        size: tuple[int, int] = (56, 56), num_frames: int = 8, fps: int = 4) -> tuple[Path, Path]:
    """Write the videos and `train.jsonl` / `eval.jsonl` under `out_dir`; returns the two JSONL paths."""
    if size[0] % 2 or size[1] % 2:
        raise ValueError(f"video sides must be even (yuv420p), got {size}")
    out_dir = Path(out_dir)
    params = {"version": VERSION, "train": num_train, "eval": num_eval, "seed": seed, "size": list(size),
              "frames": num_frames, "fps": fps}
    paths = out_dir / "train.jsonl", out_dir / "eval.jsonl"
    manifest = out_dir / "manifest.json"
    if manifest.is_file() and all(p.is_file() for p in paths) and json.loads(manifest.read_text()) == params:
        return paths
    (out_dir / "videos").mkdir(parents=True, exist_ok=True)
    for split, n, path in (("train", num_train, paths[0]), ("eval", num_eval, paths[1])):
        rng = np.random.default_rng([seed, 0 if split == "train" else 1])
        lines = []
        for i in range(n):
            count = int(rng.integers(1, MAX_COUNT + 1))
            video = f"videos/{split}-{i}.mp4"
            write_video(str(out_dir / video), _frames(rng, count, size, num_frames), fps=fps)
            lines.append(json.dumps({"id": f"video-{split}-{i}", "prompt": f"{QUESTION} {ANSWER_INSTRUCTION}",
                                     "answer": str(count), "videos": [video], "task": "video_counting"}))
        path.write_text("".join(line + "\n" for line in lines))
    manifest.write_text(json.dumps(params))
    return paths


def main(argv: list[str] | None = None) -> None:
    import argparse

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out_dir")
    parser.add_argument("--train", type=int, default=64)
    parser.add_argument("--eval", type=int, default=16)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--size", type=int, default=56, help="frame side in pixels (even)")
    parser.add_argument("--frames", type=int, default=8)
    parser.add_argument("--fps", type=int, default=4)
    a = parser.parse_args(argv)
    print(*generate_video_task(a.out_dir, a.train, a.eval, a.seed, (a.size, a.size), a.frames, a.fps))


if __name__ == "__main__":
    main()
