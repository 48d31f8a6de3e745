"""Specification of the JSONL prompt records, image loading and the resumable prompt stream."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from torchplex.data.records import (
    BadSampleError,
    PromptRecord,
    PromptStream,
    RecordFormatError,
    load_images,
    load_video_frames,
    read_records,
    read_records_report,
)


def _write_jsonl(path: Path, lines: list) -> Path:
    """Objects are JSON-encoded; strings are written verbatim (to make malformed lines)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as f:
        for line in lines:
            f.write((line if isinstance(line, str) else json.dumps(line)) + "\n")
    return path


def _png(path: Path, colour=(10, 20, 30), mode="RGB", size=(8, 6)) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.new(mode, size, colour).save(path)
    return path


# ------------------------------------------------------------------------------------ parsing


def test_relative_media_paths_resolve_against_the_jsonl_folder(tmp_path):
    data_dir = tmp_path / "data"
    abs_image = str(tmp_path / "elsewhere" / "x.png")
    path = _write_jsonl(
        data_dir / "train.jsonl",
        [
            {"id": "a", "prompt": "p", "answer": "1", "images": ["imgs/a.png", abs_image]},
            {"id": "b", "prompt": "p", "answer": "2", "video": ["frames/0.png", "frames/1.png"]},
        ],
    )
    a, b = read_records(path)
    folder = data_dir.resolve()
    assert a.images == [str(folder / "imgs" / "a.png"), abs_image]
    assert a.video is None
    assert b.images == []
    assert b.video == [str(folder / "frames" / "0.png"), str(folder / "frames" / "1.png")]


def test_alternative_keys_defaults_and_extra_fields(tmp_path):
    path = _write_jsonl(
        tmp_path / "r.jsonl",
        [
            {"question": "How many?", "answer": 3, "image": "a.png", "source": "x", "meta": {"k": 1}},
            {"prompt": "Text only", "answer": "yes", "task": "chat"},
        ],
    )
    first, second = read_records(path)
    assert first == PromptRecord(
        id="r:1",  # file stem and line number when no id is given
        prompt="How many?",
        answer="3",  # numbers become strings
        images=[str(tmp_path.resolve() / "a.png")],
        meta={"k": 1, "source": "x"},  # unknown keys are kept in meta
    )
    assert second == PromptRecord(id="r:2", prompt="Text only", answer="yes", task="chat")


def test_blank_lines_are_ignored_and_line_numbers_still_count_them(tmp_path):
    path = _write_jsonl(
        tmp_path / "r.jsonl", ["", {"prompt": "p", "answer": "a"}, "   ", {"prompt": "q", "answer": "b"}]
    )
    assert [r.id for r in read_records(path)] == ["r:2", "r:4"]


@pytest.mark.parametrize(
    "bad_line, reason",
    [
        ('{"prompt": "p", "answer": ', "invalid JSON"),
        ('{"prompt": "p"}', "missing 'answer'"),
        ('{"answer": "a"}', "'prompt'"),
        ('["not", "an", "object"]', "JSON object"),
        ('{"prompt": "p", "answer": "a", "images": "x.png"}', "'images'"),
        ('{"prompt": "p", "answer": "a", "image": "x.png", "images": ["y.png"]}', "both 'images' and 'image'"),
    ],
)
def test_malformed_line_error_names_file_line_and_reason(tmp_path, bad_line, reason):
    path = _write_jsonl(tmp_path / "bad.jsonl", [{"prompt": "p", "answer": "a"}, "", bad_line])
    with pytest.raises(RecordFormatError) as info:
        read_records(path)
    assert info.value.line_no == 3
    assert str(path) in str(info.value)
    assert ":3:" in str(info.value)
    assert reason in str(info.value)


def test_duplicate_ids_are_an_error(tmp_path):
    path = _write_jsonl(
        tmp_path / "r.jsonl", [{"id": "x", "prompt": "p", "answer": "a"}, {"id": "x", "prompt": "q", "answer": "b"}]
    )
    with pytest.raises(RecordFormatError, match="duplicate id 'x'"):
        read_records(path)


def test_skip_mode_counts_and_drops_malformed_lines(tmp_path):
    path = _write_jsonl(
        tmp_path / "r.jsonl",
        [
            {"id": "ok1", "prompt": "p", "answer": "a"},
            "{broken",
            {"id": "no-answer", "prompt": "p"},
            {"id": "ok2", "prompt": "p", "answer": "b"},
        ],
    )
    report = read_records_report(path, on_error="skip")
    assert [r.id for r in report.records] == ["ok1", "ok2"]
    assert [s.line_no for s in report.skipped] == [2, 3]
    assert [r.id for r in read_records(path, on_error="skip")] == ["ok1", "ok2"]


# ------------------------------------------------------------------------------------ images


def test_load_images_returns_rgb_images_then_video_frames(tmp_path):
    _png(tmp_path / "gray.png", colour=128, mode="L")
    _png(tmp_path / "rgba.png", colour=(1, 2, 3, 4), mode="RGBA")
    _png(tmp_path / "f0.png", colour=(50, 0, 0))
    _png(tmp_path / "f1.png", colour=(60, 0, 0))
    record = PromptRecord(
        id="r",
        prompt="p",
        answer="a",
        images=[str(tmp_path / "gray.png"), str(tmp_path / "rgba.png")],
        video=[str(tmp_path / "f0.png"), str(tmp_path / "f1.png")],
    )
    images = load_images(record)
    assert [im.mode for im in images] == ["RGB"] * 4
    assert [im.getpixel((0, 0)) for im in images] == [(128, 128, 128), (1, 2, 3), (50, 0, 0), (60, 0, 0)]
    assert [im.getpixel((0, 0)) for im in load_video_frames(record)] == [(50, 0, 0), (60, 0, 0)]


def test_text_only_record_has_no_images(tmp_path):
    record = PromptRecord(id="t", prompt="p", answer="a")
    assert load_images(record) is None
    assert load_video_frames(record) is None


def test_missing_image_raises_bad_sample_error(tmp_path):
    missing = str(tmp_path / "nope.png")
    record = PromptRecord(id="r7", prompt="p", answer="a", images=[missing])
    with pytest.raises(BadSampleError) as info:
        load_images(record)
    assert (info.value.record_id, info.value.path) == ("r7", missing)
    assert "not found" in info.value.reason


@pytest.mark.parametrize("content", [b"this is not an image", b""])
def test_undecodable_image_raises_bad_sample_error(tmp_path, content):
    bad = tmp_path / "bad.png"
    bad.write_bytes(content)
    record = PromptRecord(id="r8", prompt="p", answer="a", video=[str(bad)])
    with pytest.raises(BadSampleError) as info:
        load_images(record)
    assert (info.value.record_id, info.value.path) == ("r8", str(bad))


def test_truncated_image_raises_bad_sample_error(tmp_path):
    # Random pixels so the PNG is large enough that half of it cuts into the image data.
    good = tmp_path / "good.png"
    rng = np.random.default_rng(0)
    Image.fromarray(rng.integers(0, 255, (64, 64, 3), dtype=np.uint8)).save(good)
    data = good.read_bytes()
    good.write_bytes(data[: len(data) // 2])
    with pytest.raises(BadSampleError):
        load_images(PromptRecord(id="r9", prompt="p", answer="a", images=[str(good)]))


# ------------------------------------------------------------------------------------ stream


def _records(n: int) -> list[PromptRecord]:
    return [PromptRecord(id=f"r{i}", prompt=f"p{i}", answer=str(i)) for i in range(n)]


def _ids(batch: list[PromptRecord]) -> list[str]:
    return [r.id for r in batch]


def test_resumed_stream_continues_with_the_same_batches():
    records = _records(10)
    reference = PromptStream(records, prompts_per_step=4, seed=3)
    expected = [_ids(reference.next_batch()) for _ in range(8)]

    first = PromptStream(records, prompts_per_step=4, seed=3)
    seen = [_ids(first.next_batch()) for _ in range(3)]
    state = json.loads(json.dumps(first.state_dict()))  # must survive a JSON checkpoint

    resumed = PromptStream(records, prompts_per_step=4, seed=3)
    resumed.load_state_dict(state)
    seen += [_ids(resumed.next_batch()) for _ in range(5)]
    assert seen == expected


def test_each_epoch_visits_every_record_once_in_a_new_order():
    records = _records(12)
    stream = PromptStream(records, prompts_per_step=3, seed=0)
    epochs = [[i for _ in range(4) for i in _ids(stream.next_batch())] for _ in range(3)]
    for order in epochs:
        assert sorted(order) == sorted(r.id for r in records)
    assert epochs[0] != epochs[1] != epochs[2]
    assert stream.epoch == 2


def test_batches_straddle_epoch_boundaries_and_keep_their_size():
    stream = PromptStream(_records(5), prompts_per_step=3, seed=1)
    batches = [_ids(stream.next_batch()) for _ in range(5)]  # 15 prompts = exactly 3 epochs
    assert all(len(b) == 3 for b in batches)
    flat = [i for b in batches for i in b]
    for e in range(3):
        assert sorted(flat[5 * e : 5 * e + 5]) == [f"r{i}" for i in range(5)]


def test_unshuffled_stream_keeps_file_order_and_seed_changes_shuffle():
    records = _records(6)
    plain = PromptStream(records, prompts_per_step=6, seed=0, shuffle=False)
    assert _ids(plain.next_batch()) == [f"r{i}" for i in range(6)]
    a = _ids(PromptStream(_records(50), 50, seed=0).next_batch())
    b = _ids(PromptStream(_records(50), 50, seed=1).next_batch())
    assert a != b


def test_loading_state_from_a_different_dataset_is_refused():
    state = PromptStream(_records(10), prompts_per_step=2, seed=0).state_dict()
    with pytest.raises(ValueError, match="num_records"):
        PromptStream(_records(11), prompts_per_step=2, seed=0).load_state_dict(state)
    with pytest.raises(ValueError, match="seed"):
        PromptStream(_records(10), prompts_per_step=2, seed=5).load_state_dict(state)
