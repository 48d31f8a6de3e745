"""Bad input costs one record, never the run (issue 21, defects 1 and 11): a fuzz of malformed images, videos and
records lines through the trainer's loading path, and the skip tally's counts by phase and reason."""

from __future__ import annotations

import io
import json
import logging
from pathlib import Path

import pytest
from PIL import Image

from torchplex.data.processing import load_processor
from torchplex.data.prompts import PromptEncoder
from torchplex.data.records import BadSampleError, read_records_report
from torchplex.data.skips import SkipTally, guard_record


@pytest.fixture(scope="module")
def encoder(tiny_ckpt):
    return PromptEncoder(load_processor(tiny_ckpt), max_prompt_tokens=400)


def _png_bytes(size=(56, 56), mode="RGB", colour=None) -> bytes:
    buf = io.BytesIO()
    Image.new(mode, size, colour if colour is not None else 0).save(buf, format="PNG")
    return buf.getvalue()


def _media(folder: Path) -> dict[str, Path]:
    """Good and bad media files; the name says which."""
    folder.mkdir(parents=True, exist_ok=True)
    files = {
        "good.png": _png_bytes(),
        "truncated.png": _png_bytes((200, 200), colour=(10, 200, 30))[:300],
        "zero_byte.png": b"",
        "not_an_image.png": b"this is text, not a PNG",
        "tall_20x5000.png": _png_bytes((20, 5000)),  # aspect ratio 250: the processor refuses it
        "one_pixel.png": _png_bytes((1, 1)),  # upscaled to the minimum: readable
        "frame_small.png": _png_bytes((56, 56)),
        "frame_big.png": _png_bytes((112, 84)),  # another grid than frame_small: one video cannot mix them
    }
    paths = {}
    for name, data in files.items():
        paths[name] = folder / name
        paths[name].write_bytes(data)
    for name, mode in (("cmyk.jpg", "CMYK"), ("palette.png", "P"), ("sixteen_bit.png", "I;16"), ("la.png", "LA"),
                       ("rgba.png", "RGBA"), ("float.tif", "F")):
        paths[name] = folder / name
        Image.new(mode, (56, 56)).save(paths[name])
    return paths


def test_fuzzed_records_are_skipped_with_id_and_file_and_the_good_ones_encode(tmp_path, encoder, caplog):
    """Defect 1: one 20x5000 image (`absolute aspect ratio must be smaller than 200`, naming no record) ended the
    run. Every malformed image, video or line must be skipped, counted and named; odd but readable modes encode."""
    media = _media(tmp_path / "media")
    readable = ["good.png", "cmyk.jpg", "palette.png", "sixteen_bit.png", "la.png", "rgba.png", "float.tif",
                "one_pixel.png"]
    bad = {"truncated.png": "media", "zero_byte.png": "media", "not_an_image.png": "media", "missing.png": "media",
           "tall_20x5000.png": "preprocess"}
    lines = [json.dumps({"id": f"ok-{name}", "prompt": "How many?", "answer": "1", "image": name})
             for name in readable]
    lines += [json.dumps({"id": f"bad-{name}", "prompt": "How many?", "answer": "1", "image": name}) for name in bad]
    lines += [json.dumps({"id": "bad-video", "prompt": "What?", "answer": "x",
                          "video": ["frame_small.png", "frame_big.png"]}),
              json.dumps({"id": "ok-video", "prompt": "What?", "answer": "x",
                          "video": ["frame_small.png", "frame_small.png", "frame_small.png"]}),
              json.dumps({"id": "bad-long", "prompt": "word " * 500, "answer": "1"})]
    malformed = ['{"id": "cut", "prompt": "x", "ans', '[1, 2]', '{"prompt": 3, "answer": "1"}',
                 '{"prompt": "p", "answer": [1]}', '{"prompt": "p", "answer": "1", "images": "a.png"}',
                 '{"prompt": "p", "answer": "1", "images": [7]}', '{"prompt": "p"}', 'null', '"just a string"']
    records_file = tmp_path / "media" / "train.jsonl"
    records_file.write_bytes(("\n".join(lines[:3] + malformed + lines[3:]) + "\n").encode() + b"\xff\xfe bad\n")
    assert all(p.is_file() for p in media.values())

    report = read_records_report(records_file, on_error="skip")
    assert len(report.skipped) == len(malformed) + 1  # the non-UTF-8 line too
    assert len(report.records) == len(readable) + len(bad) + 3

    caplog.set_level(logging.WARNING)
    tally = SkipTally()
    encoder.skips = tally
    batch = encoder.encode_batch(report.records, phase="train")
    kept = {r.id for r in batch.records}
    assert kept == {f"ok-{n}" for n in readable} | {"ok-video"}
    skipped = {e.record_id: e for e in batch.skipped}
    assert set(skipped) == {f"bad-{n}" for n in bad} | {"bad-video", "bad-long"}
    for name, kind in bad.items():
        err = skipped[f"bad-{name}"]
        assert err.kind == kind and name in str(err), str(err)
    assert "train.jsonl:" in str(skipped["bad-tall_20x5000.png"])  # the record's file and line
    assert "aspect ratio" in str(skipped["bad-tall_20x5000.png"])
    assert skipped["bad-long"].kind == "too_long" and "max_prompt_tokens" in str(skipped["bad-long"])
    assert "(no media)" not in str(skipped["bad-long"]) and "cannot read :" not in str(skipped["bad-long"])
    assert tally.counts["train/media"] == 4 and tally.counts["train/preprocess"] == 2
    assert tally.counts["train/too_long"] == 1


def test_a_bad_record_is_warned_about_once_and_counted_every_time(tmp_path, encoder, caplog):
    """Defect 11: the same bad record was warned about every time the stream handed it out, and warm-up and eval
    skips were not counted. Counts are per phase; the warning comes once per record and phase."""
    (tmp_path / "x.jsonl").write_text(json.dumps({"id": "gone", "prompt": "p", "answer": "1", "image": "no.png"}))
    record = read_records_report(tmp_path / "x.jsonl").records[0]
    tally = SkipTally()
    encoder.skips = tally
    caplog.set_level(logging.WARNING, logger="torchplex.data.skips")
    for _ in range(3):
        encoder.encode_batch([record], phase="warmup")
    encoder.encode_batch([record], phase="eval")
    warnings = [r for r in caplog.records if "gone" in r.getMessage()]
    assert len(warnings) == 2
    metrics = tally.metrics()
    assert metrics["skipped/warmup/media"] == 3 and metrics["skipped/eval/media"] == 1
    assert tally.total("warmup") == 3 and tally.total() == 4
    tally.add_malformed("train", len(read_records_report(_bad_lines(tmp_path), on_error="skip").skipped))
    assert tally.counts["train/malformed"] == 2
    restored = SkipTally()
    restored.load_state_dict(tally.state_dict())
    assert restored.vector() == tally.vector()


def _bad_lines(tmp_path: Path) -> Path:
    path = tmp_path / "bad.jsonl"
    path.write_text('{"prompt": "p"}\nnot json\n{"prompt": "p", "answer": "1"}\n')
    return path


def test_guard_record_names_record_and_source_and_lets_interrupts_through():
    def boom():
        raise RuntimeError("kaput")

    with pytest.raises(BadSampleError, match="'r7'.*src.png.*RuntimeError: kaput"):
        guard_record("r7", "src.png", boom)

    def interrupted():
        raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        guard_record("r7", "src.png", interrupted)
