"""A small synthetic visual-reasoning task that a tiny model can learn in minutes.

Each sample is a small image with a few solid, non-overlapping shapes (circle, square, triangle)
in distinct, saturated colours on a grey background, and a one-word question about it:

- counting:   "How many circles are in the image?"                 -> "3"
- colour:     "What colour is the square?"                          -> "red"
- position:   "Is the triangle left or right of the circle?"        -> "left"
- comparison: "Are there more red shapes or blue shapes?"           -> "blue"

Shapes sit in the cells of a grid (one per cell, with a margin), so they never touch; drawing is
without anti-aliasing, so every pixel is either background or exactly one palette colour. That
makes each answer checkable from the pixels alone (the tests do this).

The defaults are chosen so that the tiny random "debug" model learns the task on a CPU in minutes:

- The background is the grey that Qwen's image processor normalises to ~0 (the CLIP mean). On
  white, every background patch normalises to ~+1.9 in all channels and the random vision tower
  turns the image into one large constant vector with the shapes a small ripple on it; the
  decoder then needs thousands of steps to pick the colours out. On the grey only the shapes
  produce input, and colour questions are learned within a few hundred supervised steps.
- Each shape fills its cell (``jitter=False``): same size and place within the cell, so a shape's
  look does not vary and, at 112 px (4 x 4 cells of 28 px = one merged vision token each), every
  shape is exactly one vision token. ``jitter=True`` draws random sizes (60-100% of the cell) and
  offsets, a harder variant.

``generate_synthetic_task`` writes ``images/*.png``, ``train.jsonl``, ``eval.jsonl`` and a
``manifest.json`` describing the parameters; called again with the same parameters it returns at
once, with different ones it regenerates.

The trainer's task (``prepare_task``) is generated once into a folder of its own under
``data.synthetic_dir``, named after the task, its generator version, ``data.synthetic_seed`` and its
sizes: runs of any ``job.seed`` train and evaluate on the same task (their eval numbers compare),
and a run never rewrites the files another run is reading.
"""

from __future__ import annotations

import functools
import hashlib
import io
import json
import os
import shutil
import tempfile
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
from PIL import Image, ImageDraw
from tqdm import tqdm

# Bump when the images or questions produced for given parameters change, so that existing
# folders are regenerated.
GENERATOR_VERSION = 2  # 2: grey background, shapes fill their cells unless jitter=True

SHAPES: tuple[str, ...] = ("circle", "square", "triangle")
# Far apart in RGB so that a pixel's colour name is unambiguous.
PALETTE: dict[str, tuple[int, int, int]] = {
    "red": (230, 25, 25),
    "green": (20, 160, 50),
    "blue": (30, 60, 230),
    "yellow": (240, 210, 20),
    "purple": (140, 40, 180),
    "orange": (250, 130, 10),
}
# The CLIP mean colour that Qwen's processor subtracts: background pixels normalise to ~0 (see above).
BACKGROUND: tuple[int, int, int] = (123, 117, 104)
TASK_KINDS: tuple[str, ...] = ("counting", "colour", "position", "comparison")
ANSWER_INSTRUCTION = "Put the final answer in <answer></answer>."

_MIN_IMAGE_SIDE = 32
_MAX_COUNT = 4  # counting / comparison answers are in 1..4


@dataclass(frozen=True)
class Shape:
    kind: str  # one of SHAPES
    colour: str  # a PALETTE key
    box: tuple[int, int, int, int]  # x0, y0, x1, y1 (inclusive), in pixels


@dataclass(frozen=True)
class SyntheticSample:
    kind: str  # one of TASK_KINDS
    question: str
    answer: str
    shapes: tuple[Shape, ...]

    @property
    def prompt(self) -> str:
        return f"{self.question} {ANSWER_INSTRUCTION}"


# --------------------------------------------------------------------------------------------
# Scenes
# --------------------------------------------------------------------------------------------


def _grid(image_size: tuple[int, int]) -> tuple[int, int]:
    """Grid columns and rows: cells of at least ~18 px, between 2 and 4 per side."""
    w, h = image_size
    return max(2, min(4, w // 18)), max(2, min(4, h // 18))


def _place(
    rng: np.random.Generator,
    image_size: tuple[int, int],
    cells: Sequence[tuple[int, int]],
    kinds_colours: Sequence[tuple[str, str]],
    jitter: bool,
) -> tuple[Shape, ...]:
    """Put one shape into each given (column, row) cell: filling it, or with random size and offset."""
    cols, rows = _grid(image_size)
    cell_w, cell_h = image_size[0] // cols, image_size[1] // rows
    side_max = min(cell_w, cell_h) - 4  # >= 2 px margin on each side keeps shapes apart
    side_min = max(7, int(0.6 * side_max))
    shapes = []
    for (col, row), (kind, colour) in zip(cells, kinds_colours):
        side = int(rng.integers(side_min, side_max + 1)) if jitter else side_max
        x0 = col * cell_w + 2 + (int(rng.integers(0, side_max - side + 1)) if jitter else 0)
        y0 = row * cell_h + 2 + (int(rng.integers(0, side_max - side + 1)) if jitter else 0)
        shapes.append(Shape(kind, colour, (x0, y0, x0 + side - 1, y0 + side - 1)))
    return tuple(shapes)


def _all_cells(image_size: tuple[int, int]) -> list[tuple[int, int]]:
    cols, rows = _grid(image_size)
    return [(c, r) for r in range(rows) for c in range(cols)]


def _place_anywhere(
    rng: np.random.Generator,
    image_size: tuple[int, int],
    kinds: list[str],
    colours: list[str],
    jitter: bool,
) -> tuple[Shape, ...]:
    """Put the shapes into distinct random cells."""
    cells = _all_cells(image_size)
    picked = [cells[i] for i in rng.choice(len(cells), size=len(kinds), replace=False)]
    return _place(rng, image_size, picked, list(zip(kinds, colours)), jitter)


def _plural(shape: str) -> str:
    return shape + "s"


def _counting(
    rng: np.random.Generator, image_size: tuple[int, int], jitter: bool
) -> SyntheticSample:
    capacity = len(_all_cells(image_size))
    target = str(rng.choice(SHAPES))
    others = [s for s in SHAPES if s != target]
    count = int(rng.integers(1, min(_MAX_COUNT, capacity) + 1))
    distractors = int(rng.integers(0, min(3, capacity - count) + 1))
    kinds = [target] * count + [str(rng.choice(others)) for _ in range(distractors)]
    rng.shuffle(kinds)
    colours = [str(rng.choice(list(PALETTE))) for _ in kinds]
    shapes = _place_anywhere(rng, image_size, kinds, colours, jitter)
    return SyntheticSample(
        "counting", f"How many {_plural(target)} are in the image?", str(count), shapes
    )


def _colour(
    rng: np.random.Generator, image_size: tuple[int, int], jitter: bool
) -> SyntheticSample:
    n = int(rng.integers(2, len(SHAPES) + 1))
    kinds = [str(k) for k in rng.permutation(SHAPES)[:n]]  # each shape kind at most once
    colours = [str(c) for c in rng.permutation(list(PALETTE))[:n]]
    shapes = _place_anywhere(rng, image_size, kinds, colours, jitter)
    asked = int(rng.integers(n))
    return SyntheticSample("colour", f"What colour is the {kinds[asked]}?", colours[asked], shapes)


def _position(
    rng: np.random.Generator, image_size: tuple[int, int], jitter: bool
) -> SyntheticSample:
    cols, rows = _grid(image_size)
    a, b, third = (str(k) for k in rng.permutation(SHAPES))
    col_a, col_b = (int(c) for c in rng.choice(cols, size=2, replace=False))
    cells = [(col_a, int(rng.integers(rows))), (col_b, int(rng.integers(rows)))]
    kinds = [a, b]
    if rng.random() < 0.5:  # a distractor of the third kind, anywhere free
        free = [c for c in _all_cells(image_size) if c not in cells]
        cells.append(free[int(rng.integers(len(free)))])
        kinds.append(third)
    colours = [str(c) for c in rng.permutation(list(PALETTE))[: len(kinds)]]
    shapes = _place(rng, image_size, cells, list(zip(kinds, colours)), jitter)
    # Different grid columns and one shape per cell => the boxes' x ranges never overlap.
    answer = "left" if shapes[0].box[0] < shapes[1].box[0] else "right"
    return SyntheticSample("position", f"Is the {a} left or right of the {b}?", answer, shapes)


def _comparison(
    rng: np.random.Generator, image_size: tuple[int, int], jitter: bool
) -> SyntheticSample:
    capacity = len(_all_cells(image_size))
    colour_a, colour_b, *rest = (str(c) for c in rng.permutation(list(PALETTE)))
    # Distinct counts (so there is an answer) that fit in the grid together.
    pairs = [
        (a, b)
        for a in range(1, _MAX_COUNT + 1)
        for b in range(1, _MAX_COUNT + 1)
        if a != b and a + b <= capacity
    ]
    n_a, n_b = pairs[int(rng.integers(len(pairs)))]
    distractors = int(rng.integers(0, min(2, capacity - n_a - n_b) + 1))
    colours = [colour_a] * n_a + [colour_b] * n_b
    colours += [str(rng.choice(rest)) for _ in range(distractors)]
    rng.shuffle(colours)
    kinds = [str(rng.choice(SHAPES)) for _ in colours]
    shapes = _place_anywhere(rng, image_size, kinds, colours, jitter)
    answer = colour_a if n_a > n_b else colour_b
    return SyntheticSample(
        "comparison", f"Are there more {colour_a} shapes or {colour_b} shapes?", answer, shapes
    )


_MAKERS = {
    "counting": _counting,
    "colour": _colour,
    "position": _position,
    "comparison": _comparison,
}


def make_sample(
    rng: np.random.Generator, kind: str, image_size: tuple[int, int], jitter: bool = False
) -> SyntheticSample:
    """Draw one random scene and question of the given task kind (``jitter``: see the module doc)."""
    if kind not in _MAKERS:
        raise KeyError(f"unknown synthetic task kind {kind!r}; known: {', '.join(TASK_KINDS)}")
    return _MAKERS[kind](rng, image_size, jitter)


def render(shapes: Sequence[Shape], image_size: tuple[int, int]) -> Image.Image:
    """Draw the shapes (no anti-aliasing, so only palette colours and background appear)."""
    image = Image.new("RGB", image_size, BACKGROUND)
    draw = ImageDraw.Draw(image)
    for s in shapes:
        x0, y0, x1, y1 = s.box
        fill = PALETTE[s.colour]
        if s.kind == "circle":
            draw.ellipse((x0, y0, x1, y1), fill=fill)
        elif s.kind == "square":
            draw.rectangle((x0, y0, x1, y1), fill=fill)
        elif s.kind == "triangle":  # pointing up
            draw.polygon([((x0 + x1) / 2, y0), (x0, y1), (x1, y1)], fill=fill)
        else:
            raise ValueError(f"unknown shape kind {s.kind!r}")
    return image


# --------------------------------------------------------------------------------------------
# Writing a dataset folder
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Params:
    version: int
    num_train: int
    num_eval: int
    seed: int
    image_size: tuple[int, int]
    kinds: tuple[str, ...]
    jitter: bool

    def to_json(self) -> dict:
        d = asdict(self)
        d["image_size"] = list(self.image_size)
        d["kinds"] = list(self.kinds)
        return d


def _png_bytes(image: Image.Image) -> bytes:
    buf = io.BytesIO()
    image.save(buf, format="PNG")
    return buf.getvalue()


def _generate_split(
    split: str,
    num: int,
    rng: np.random.Generator,
    params: _Params,
    out_dir: Path,
    exclude: set[str],
    progress: bool,
) -> tuple[list[dict], set[str]]:
    """Generate ``num`` samples whose (question, image) is not in ``exclude``; write the PNGs."""
    records, keys = [], set()
    # disable=None: drawn on a terminal only (in a log file every redraw would be a line)
    bar = tqdm(total=num, desc=f"synthetic {split}", unit="img", disable=None if progress else True)
    attempts = 0
    while len(records) < num:
        attempts += 1
        if attempts > 20 * num + 1000:
            raise RuntimeError(
                f"could not draw {num} distinct {split} samples at image size {params.image_size}; "
                "ask for fewer samples or larger images"
            )
        # Round-robin over kinds keeps the mix balanced even for a small eval split.
        kind = params.kinds[len(records) % len(params.kinds)]
        sample = make_sample(rng, kind, params.image_size, params.jitter)
        png = _png_bytes(render(sample.shapes, params.image_size))
        key = hashlib.sha256(sample.question.encode() + b"\0" + png).hexdigest()
        if key in exclude or key in keys:
            continue  # keeps eval disjoint from train, and samples within a split unique
        keys.add(key)
        name = f"images/{split}_{len(records):06d}.png"
        (out_dir / name).write_bytes(png)
        records.append(
            {
                "id": f"{split}-{len(records):06d}",
                "prompt": sample.prompt,
                "answer": sample.answer,
                "images": [name],
                "task": sample.kind,
                "meta": {"shapes": [asdict(s) for s in sample.shapes]},
            }
        )
        bar.update(1)
    bar.close()
    return records, keys


def _write_jsonl(path: Path, records: list[dict]) -> None:
    tmp = path.with_suffix(".jsonl.tmp")
    with open(tmp, "w", encoding="utf-8") as f:
        for r in records:
            f.write(json.dumps(r) + "\n")
    tmp.replace(path)


def _task_params(num_train: int, num_eval: int, seed: int, image_size: tuple[int, int], kinds: Sequence[str],
                 jitter: bool) -> _Params:
    """The generation parameters, checked: a big enough image, known task kinds, non-negative counts."""
    image_size = (int(image_size[0]), int(image_size[1]))
    if min(image_size) < _MIN_IMAGE_SIDE:
        raise ValueError(
            f"image_size must be at least {_MIN_IMAGE_SIDE} px per side, got {image_size}"
        )
    kinds = tuple(kinds)
    if not kinds:
        raise ValueError("kinds must name at least one task kind")
    for k in kinds:
        if k not in _MAKERS:
            raise KeyError(f"unknown synthetic task kind {k!r}; known: {', '.join(TASK_KINDS)}")
    if num_train < 0 or num_eval < 0:
        raise ValueError(f"sample counts must be >= 0, got train={num_train} eval={num_eval}")
    return _Params(GENERATOR_VERSION, num_train, num_eval, seed, image_size, kinds, bool(jitter))


def _already_written(out_dir: Path, params: _Params) -> bool:
    """True when `out_dir` holds both splits and a manifest recording exactly `params`."""
    manifest_path = out_dir / "manifest.json"
    if manifest_path.exists() and (out_dir / "train.jsonl").exists() and (out_dir / "eval.jsonl").exists():
        try:
            return json.loads(manifest_path.read_text()) == params.to_json()
        except json.JSONDecodeError:
            pass  # a damaged manifest just means: regenerate
    return False


def _clear_for_rewrite(out_dir: Path) -> None:
    """Remove the manifest and the old split images. The manifest goes last and first: removed before writing,
    rewritten after, so an interrupted generation is never mistaken for a finished one."""
    (out_dir / "manifest.json").unlink(missing_ok=True)
    image_dir = out_dir / "images"
    image_dir.mkdir(parents=True, exist_ok=True)
    for old in [*image_dir.glob("train_*.png"), *image_dir.glob("eval_*.png")]:
        old.unlink()


def generate_synthetic_task(
    out_dir: str | Path,
    num_train: int,
    num_eval: int,
    seed: int = 0,
    image_size: tuple[int, int] = (56, 56),
    kinds: Sequence[str] = TASK_KINDS,
    progress: bool | None = None,
    jitter: bool = False,
) -> tuple[Path, Path]:
    """Write the synthetic task to ``out_dir`` and return ``(train.jsonl, eval.jsonl)`` paths.

    ``jitter=True`` draws shapes of random size and offset within their cells (harder than the
    default, where each shape fills its cell). Deterministic in the parameters. Train and eval come
    from different RNG streams of ``seed`` and share no (question, image) pair. If
    ``out_dir/manifest.json`` already records the same parameters (and the files exist), nothing is
    regenerated. ``progress=None`` shows a bar only for large runs.
    """
    params = _task_params(num_train, num_eval, seed, image_size, kinds, jitter)
    out_dir = Path(out_dir)
    train_path, eval_path = out_dir / "train.jsonl", out_dir / "eval.jsonl"
    if _already_written(out_dir, params):
        return train_path, eval_path
    _clear_for_rewrite(out_dir)

    if progress is None:
        progress = num_train + num_eval >= 1000
    # Eval first, from its own stream, so that the eval set does not change with num_train.
    eval_records, eval_keys = _generate_split(
        "eval", num_eval, np.random.default_rng([seed, 1]), params, out_dir, set(), progress
    )
    train_records, _ = _generate_split(
        "train", num_train, np.random.default_rng([seed, 0]), params, out_dir, eval_keys, progress
    )
    _write_jsonl(train_path, train_records)
    _write_jsonl(eval_path, eval_records)
    (out_dir / "manifest.json").write_text(json.dumps(params.to_json(), indent=2) + "\n")
    return train_path, eval_path


# The trainer's synthetic tasks (data.synthetic_task) by default: image side of the shapes task; side, frames and
# rate of the video task's mp4 files
SHAPES_IMAGE_SIZE = (112, 112)
VIDEO_SIZE, VIDEO_FRAMES, VIDEO_FPS = (56, 56), 8, 4


def write_once(folder: Path, write: Callable[[Path], object]) -> Path:
    """`folder` written whole or not at all: `write(tmp)` fills a temporary sibling that one rename puts in place,
    so a reader never sees a folder half written; a folder already in place is reused, never rewritten (runs may be
    reading it). When two processes race, the first rename wins and the other's copy is dropped."""
    manifest = folder / "manifest.json"
    if manifest.is_file():
        return folder
    folder.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".tmp-{folder.name}-", dir=folder.parent))
    try:
        write(tmp)
        try:
            os.rename(tmp, folder)
        except OSError:
            if not manifest.is_file():  # not a finished task folder: not ours to replace
                raise RuntimeError(f"{folder} exists but holds no finished synthetic task (no manifest.json); "
                                   f"remove it to have it generated again") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return folder


def prepare_task(root: str | Path, task: str, seed: int, num_train: int, num_eval: int, size: int = 0,
                 frames: int = 0) -> tuple[Path, Path]:
    """The trainer's synthetic task `task` ("shapes" or "video_counting") under `root`, generated when absent;
    returns its (train.jsonl, eval.jsonl). `size`: side of the images or frames, `frames`: per video (0: the
    task's default, data.synthetic_size / synthetic_frames)."""
    if task == "video_counting":
        from .synthetic_video import VERSION, generate_video_task

        side, frames = size or VIDEO_SIZE[0], frames or VIDEO_FRAMES
        name, shape = f"video_counting-v{VERSION}", f"{side}x{side}px-{frames}frames"
        generate = functools.partial(generate_video_task, size=(side, side), num_frames=frames, fps=VIDEO_FPS)
    else:
        side = size or SHAPES_IMAGE_SIZE[0]
        name, shape = f"shapes-v{GENERATOR_VERSION}", f"{side}x{side}px"
        generate = functools.partial(generate_synthetic_task, image_size=(side, side))
    folder = Path(root) / f"{name}-seed{seed}-{num_train}train-{num_eval}eval-{shape}"
    write_once(folder, lambda tmp: generate(tmp, num_train, num_eval, seed=seed))
    return folder / "train.jsonl", folder / "eval.jsonl"
