"""Specification of the synthetic visual-reasoning task.

The strongest check here re-derives every answer from the PNG pixels alone: shapes are found as
connected components of non-background pixels, named by their (exact) palette colour, and
classified by how much of their bounding box they fill (square 1.0, circle ~0.79, triangle ~0.5).
"""

from __future__ import annotations

import json
import re
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from torchplex.data.records import load_images, read_records
from torchplex.data.synthetic import (
    ANSWER_INSTRUCTION,
    BACKGROUND,
    PALETTE,
    TASK_KINDS,
    generate_synthetic_task,
)


# ------------------------------------------------------------------------- pixel reference


def _components(mask: np.ndarray) -> list[np.ndarray]:
    """4-connected components of a boolean mask, each as an (N, 2) array of (y, x)."""
    seen = np.zeros_like(mask)
    h, w = mask.shape
    out = []
    for y0, x0 in zip(*np.nonzero(mask)):
        if seen[y0, x0]:
            continue
        stack, pixels = [(y0, x0)], []
        seen[y0, x0] = True
        while stack:
            y, x = stack.pop()
            pixels.append((y, x))
            for ny, nx in ((y + 1, x), (y - 1, x), (y, x + 1), (y, x - 1)):
                if 0 <= ny < h and 0 <= nx < w and mask[ny, nx] and not seen[ny, nx]:
                    seen[ny, nx] = True
                    stack.append((ny, nx))
        out.append(np.array(pixels))
    return out


def _shapes_in(image: Image.Image) -> list[tuple[str, str, float]]:
    """(kind, colour, x-centre) of every shape, read from the pixels only."""
    pixels = np.asarray(image.convert("RGB"))
    colour_names = {rgb: name for name, rgb in PALETTE.items()}
    found = []
    for comp in _components((pixels != BACKGROUND).any(axis=-1)):
        rgbs = {tuple(int(v) for v in pixels[y, x]) for y, x in comp}
        assert len(rgbs) == 1 and next(iter(rgbs)) in colour_names, f"non-palette pixels {rgbs}"
        (ys, xs) = comp[:, 0], comp[:, 1]
        fill = len(comp) / ((np.ptp(ys) + 1) * (np.ptp(xs) + 1))
        kind = "square" if fill > 0.95 else "circle" if fill > 0.68 else "triangle"
        found.append((kind, colour_names[next(iter(rgbs))], (xs.min() + xs.max()) / 2))
    return found


def _answer_from_pixels(question: str, image: Image.Image) -> str:
    shapes = _shapes_in(image)
    if m := re.fullmatch(r"How many (\w+)s are in the image\?", question):
        return str(sum(kind == m[1] for kind, _, _ in shapes))
    if m := re.fullmatch(r"What colour is the (\w+)\?", question):
        (colour,) = [c for kind, c, _ in shapes if kind == m[1]]
        return colour
    if m := re.fullmatch(r"Is the (\w+) left or right of the (\w+)\?", question):
        (xa,) = [x for kind, _, x in shapes if kind == m[1]]
        (xb,) = [x for kind, _, x in shapes if kind == m[2]]
        return "left" if xa < xb else "right"
    if m := re.fullmatch(r"Are there more (\w+) shapes or (\w+) shapes\?", question):
        counts = Counter(c for _, c, _ in shapes)
        assert counts[m[1]] != counts[m[2]]
        return m[1] if counts[m[1]] > counts[m[2]] else m[2]
    raise AssertionError(f"unexpected question {question!r}")


def _question(prompt: str) -> str:
    assert prompt.endswith(" " + ANSWER_INSTRUCTION)
    return prompt[: -len(ANSWER_INSTRUCTION) - 1]


def _folder_bytes(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


# ------------------------------------------------------------------------- tests


@pytest.mark.parametrize("image_size", [(56, 56), (112, 84), (40, 40)])
def test_every_answer_matches_the_drawn_image(tmp_path, image_size):
    train_path, eval_path = generate_synthetic_task(tmp_path, 60, 20, seed=7, image_size=image_size)
    for path in (train_path, eval_path):
        for record in read_records(path):
            (image,) = load_images(record)
            assert image.size == image_size
            assert _answer_from_pixels(_question(record.prompt), image) == record.answer, record.id


def test_same_seed_gives_identical_files(tmp_path):
    generate_synthetic_task(tmp_path / "a", 40, 10, seed=3)
    generate_synthetic_task(tmp_path / "b", 40, 10, seed=3)
    a, b = _folder_bytes(tmp_path / "a"), _folder_bytes(tmp_path / "b")
    assert len(a) == 40 + 10 + 3  # PNGs, train.jsonl, eval.jsonl, manifest.json
    assert a == b


def test_different_seed_gives_different_samples(tmp_path):
    train_a, _ = generate_synthetic_task(tmp_path / "a", 40, 10, seed=0)
    train_b, _ = generate_synthetic_task(tmp_path / "b", 40, 10, seed=1)
    assert [r.prompt for r in read_records(train_a)] != [r.prompt for r in read_records(train_b)]


def test_train_and_eval_share_no_sample(tmp_path):
    train_path, eval_path = generate_synthetic_task(tmp_path, 200, 100, seed=0)

    def keys(path):
        return {(r.prompt, Path(r.images[0]).read_bytes()) for r in read_records(path)}

    train_keys, eval_keys = keys(train_path), keys(eval_path)
    assert len(train_keys) == 200 and len(eval_keys) == 100  # unique within each split too
    assert not train_keys & eval_keys


def test_eval_split_does_not_depend_on_train_size(tmp_path):
    _, eval_small = generate_synthetic_task(tmp_path / "a", 10, 20, seed=0)
    _, eval_large = generate_synthetic_task(tmp_path / "b", 100, 20, seed=0)
    assert eval_small.read_text() == eval_large.read_text()


def test_records_are_balanced_over_kinds_and_instruct_the_answer_format(tmp_path):
    train_path, _ = generate_synthetic_task(tmp_path, 40, 8, seed=0)
    records = read_records(train_path)
    assert Counter(r.task for r in records) == {k: 10 for k in TASK_KINDS}
    for r in records:
        assert r.prompt.endswith("Put the final answer in <answer></answer>.")
        assert r.answer and " " not in r.answer  # single-word answers
        assert r.images[0].startswith(str(tmp_path.resolve()))


def test_kinds_can_be_restricted_and_unknown_kinds_are_rejected(tmp_path):
    train_path, _ = generate_synthetic_task(tmp_path / "c", 12, 4, kinds=("counting",))
    assert {r.task for r in read_records(train_path)} == {"counting"}
    with pytest.raises(KeyError, match="known: counting, colour, position, comparison"):
        generate_synthetic_task(tmp_path / "d", 4, 4, kinds=("counting", "shading"))


def test_second_call_with_same_parameters_does_not_rewrite(tmp_path):
    train_path, eval_path = generate_synthetic_task(tmp_path, 20, 5, seed=0)
    before = {p: p.stat().st_mtime_ns for p in tmp_path.rglob("*") if p.is_file()}
    assert generate_synthetic_task(tmp_path, 20, 5, seed=0) == (train_path, eval_path)
    assert {p: p.stat().st_mtime_ns for p in tmp_path.rglob("*") if p.is_file()} == before


def test_changed_parameters_regenerate_and_remove_stale_images(tmp_path):
    generate_synthetic_task(tmp_path, 20, 5, seed=0)
    train_path, eval_path = generate_synthetic_task(tmp_path, 8, 3, seed=1, image_size=(64, 64))
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert (manifest["num_train"], manifest["num_eval"], manifest["seed"]) == (8, 3, 1)
    assert manifest["image_size"] == [64, 64]
    assert len(read_records(train_path)) == 8 and len(read_records(eval_path)) == 3
    assert len(list((tmp_path / "images").glob("*.png"))) == 8 + 3
    assert _folder_bytes(tmp_path) == _folder_bytes(_fresh(tmp_path.parent / "fresh", 8, 3, 1, (64, 64)))


def _fresh(folder: Path, num_train, num_eval, seed, image_size) -> Path:
    generate_synthetic_task(folder, num_train, num_eval, seed=seed, image_size=image_size)
    return folder


def test_interrupted_generation_is_redone(tmp_path):
    train_path, _ = generate_synthetic_task(tmp_path, 10, 4, seed=0)
    expected = train_path.read_text()
    # A run killed mid-way leaves no manifest (it is written last) and possibly partial files.
    (tmp_path / "manifest.json").unlink()
    train_path.write_text('{"truncated": ')
    generate_synthetic_task(tmp_path, 10, 4, seed=0)
    assert train_path.read_text() == expected


def test_too_small_images_are_rejected(tmp_path):
    with pytest.raises(ValueError, match="image_size"):
        generate_synthetic_task(tmp_path, 4, 4, image_size=(16, 56))


def _boxes(path: Path) -> list[tuple[int, int, int, int]]:
    return [tuple(s["box"]) for r in read_records(path) for s in r.meta["shapes"]]


def test_by_default_each_shape_fills_its_cell(tmp_path):
    # 112 px -> a 4 x 4 grid of 28 px cells (one merged Qwen vision token each); a 2 px margin
    # on every side leaves a 24 px shape whose corner is at 28 * cell + 2.
    train_path, _ = generate_synthetic_task(tmp_path, 40, 8, seed=0, image_size=(112, 112))
    for x0, y0, x1, y1 in _boxes(train_path):
        assert (x0 % 28, y0 % 28) == (2, 2)
        assert (x1 - x0 + 1, y1 - y0 + 1) == (24, 24)


def test_jitter_varies_size_and_offset_inside_the_cell(tmp_path):
    train_path, eval_path = generate_synthetic_task(tmp_path, 60, 20, seed=7, image_size=(112, 112), jitter=True)
    boxes = _boxes(train_path)
    sides = {x1 - x0 + 1 for x0, _, x1, _ in boxes}
    assert min(sides) >= 14 and max(sides) <= 24 and len(sides) > 5  # 60%..100% of the 24 px
    for x0, y0, x1, y1 in boxes:  # never leaves its cell's margin
        assert x0 % 28 >= 2 and y0 % 28 >= 2 and x1 % 28 <= 25 and y1 % 28 <= 25
    for path in (train_path, eval_path):
        for record in read_records(path):
            (image,) = load_images(record)
            assert _answer_from_pixels(_question(record.prompt), image) == record.answer, record.id


def test_changing_jitter_regenerates(tmp_path):
    reused, fresh = tmp_path / "reused", tmp_path / "fresh"
    generate_synthetic_task(reused, 8, 4, seed=0)
    generate_synthetic_task(reused, 8, 4, seed=0, jitter=True)
    generate_synthetic_task(fresh, 8, 4, seed=0, jitter=True)
    assert json.loads((reused / "manifest.json").read_text())["jitter"] is True
    assert _folder_bytes(reused) == _folder_bytes(fresh)


def test_background_is_what_the_image_processor_normalises_to_zero():
    # Qwen2.5-VL normalises pixels with the CLIP mean/std; the background should land within
    # half a grey level of 0 so that only the shapes give the vision tower any input.
    from transformers.image_utils import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD

    normalised = [(c / 255 - m) / s for c, m, s in zip(BACKGROUND, OPENAI_CLIP_MEAN, OPENAI_CLIP_STD)]
    assert max(abs(v) for v in normalised) < 0.5 / 255 / min(OPENAI_CLIP_STD)
    assert BACKGROUND not in PALETTE.values()


def test_a_task_folder_is_written_whole_or_not_at_all_and_reused(tmp_path):
    """Issue 47, defect 10: the trainer's task folder appears by one rename of a finished copy, is reused when
    present (never rewritten under a run reading it), and a generation that fails leaves nothing behind."""
    from torchplex.data.synthetic import prepare_task, write_once

    def failing(folder):
        (folder / "half.png").write_bytes(b"x")
        raise RuntimeError("interrupted")

    with pytest.raises(RuntimeError, match="interrupted"):
        write_once(tmp_path / "task", failing)
    assert list(tmp_path.iterdir()) == []
    train, eval_ = prepare_task(tmp_path, "shapes", seed=3, num_train=4, num_eval=2)
    assert train.parent.name == "shapes-v2-seed3-4train-2eval-112x112px" and eval_.parent == train.parent
    stamps = {p: p.stat().st_mtime_ns for p in train.parent.rglob("*")}
    assert write_once(train.parent, failing) == train.parent  # present: `write` is not called
    assert prepare_task(tmp_path, "shapes", seed=3, num_train=4, num_eval=2) == (train, eval_)
    assert {p: p.stat().st_mtime_ns for p in train.parent.rglob("*")} == stamps
    assert [p.name for p in tmp_path.iterdir()] == [train.parent.name]
