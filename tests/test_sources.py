"""Specification of torchplex.data.sources and data.media: users' files (Parquet with image bytes, JSONL, globs,
column keys), images interleaved with text, bad records skipped and counted."""

from __future__ import annotations

import io
import json
import logging

import pytest
from datasets import Dataset, Features, Image as ImageFeature, List, Value
from PIL import Image

from torchplex.data.media import build_interleaved_messages, open_image
from torchplex.data.processing import load_processor
from torchplex.data.prompts import PromptEncoder
from torchplex.data.records import BadSampleError, PromptRecord
from torchplex.data.skips import DataError
from torchplex.data.sources import BadRecords, ColumnKeys, StoredImage, expand_files, load_records, set_name


def png_bytes(colour: str, size=(40, 30)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, colour).save(buf, "PNG")
    return buf.getvalue()


def write_parquet(path, rows: dict) -> None:
    features = Features({"problem": Value("string"), "answer": Value("string"), "images": List(ImageFeature())})
    Dataset.from_dict(rows, features=features).to_parquet(str(path))


@pytest.fixture(scope="module")
def processor(tiny_ckpt):
    return load_processor(tiny_ckpt)


def test_parquet_with_image_bytes_several_per_record_and_custom_keys(tmp_path):
    write_parquet(tmp_path / "train-0.parquet", {
        "problem": ["Compare <image> with <image>.", "How many shapes?"],
        "answer": ["left", "3"],
        "images": [[{"bytes": png_bytes("red"), "path": None}, {"bytes": png_bytes("blue"), "path": None}],
                   [{"bytes": png_bytes("green"), "path": None}]],
    })
    write_parquet(tmp_path / "train-1.parquet", {"problem": ["Colour?"], "answer": ["red"],
                                                 "images": [[{"bytes": png_bytes("red"), "path": None}]]})
    records = load_records([str(tmp_path / "train-*.parquet")], ColumnKeys(prompt="problem"))
    assert [r.id for r in records] == ["train-0:0", "train-0:1", "train-1:0"]
    assert [len(r.images) for r in records] == [2, 1, 1]
    # left in the memory-mapped Arrow table, not copied into the records, until a batch opens them
    assert all(isinstance(i, StoredImage) for r in records for i in r.images)
    assert open_image("x", records[0].images[1]).getpixel((0, 0)) == (0, 0, 255)
    assert open_image("x", records[2].images[0]).getpixel((0, 0)) == (255, 0, 0)


def test_jsonl_with_custom_keys_reads_mixed_answer_types_line_by_line(tmp_path):
    rows = [{"question": "a?", "label": 3}, {"question": "b?", "label": "three"}, {"question": "c?"}]
    (tmp_path / "mixed.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    bad = BadRecords()
    records = load_records([str(tmp_path / "mixed.jsonl")], ColumnKeys(prompt="question", answer="label"), bad)
    assert [(r.id, r.answer) for r in records] == [("mixed:1", "3"), ("mixed:2", "three")] and bad.total == 1


def test_image_given_as_a_path_in_a_datasets_dict_resolves_next_to_the_file(tmp_path):
    Image.new("RGB", (30, 30), "red").save(tmp_path / "a.png")
    (tmp_path / "d.json").write_text(json.dumps([{"q": "colour?", "a": 1, "img": "a.png"}]))
    [record] = load_records([str(tmp_path / "d.json")], ColumnKeys(prompt="q", answer="a", images="img"))
    assert record.images == [str(tmp_path / "a.png")] and record.answer == "1"
    assert open_image(record.id, {"bytes": None, "path": record.images[0]}).size == (30, 30)


def test_default_jsonl_keeps_the_legacy_reader_and_bad_lines_are_each_named(tmp_path, caplog):
    """Issue 21 defect 11: only the first malformed line's reason was shown; each bad line is named (up to
    BadRecords.SHOWN_PER_FILE per file, the rest counted)."""
    lines = [{"id": "a", "prompt": "p", "answer": "1"}, {"id": "b", "prompt": "p"}, "not json",
             {"id": "c", "prompt": "p", "answer": 2}]
    (tmp_path / "r.jsonl").write_text("\n".join(x if isinstance(x, str) else json.dumps(x) for x in lines))
    bad = BadRecords()
    with caplog.at_level(logging.WARNING):
        records = load_records([str(tmp_path / "r.jsonl")], bad=bad)
    assert [r.id for r in records] == ["a", "c"]
    assert bad.total == 2
    shown = [m for m in caplog.messages if "skipping bad record" in m]
    assert len(shown) == 2 and "line 3" in shown[1]
    many = BadRecords()
    caplog.clear()
    with caplog.at_level(logging.WARNING):
        for i in range(BadRecords.SHOWN_PER_FILE + 5):
            many.skip("f.jsonl", f"r{i}", "bad")
    assert many.total == BadRecords.SHOWN_PER_FILE + 5 and len(caplog.messages) == BadRecords.SHOWN_PER_FILE + 1


def test_bad_rows_of_a_parquet_file_are_skipped_not_fatal(tmp_path):
    rows = {"problem": ["ok", "", "ok too"], "answer": ["1", "2", "3"], "images": [[], [], []]}
    write_parquet(tmp_path / "t.parquet", rows)
    bad = BadRecords()
    records = load_records([str(tmp_path / "t.parquet")], ColumnKeys(prompt="problem"), bad)
    assert [r.prompt for r in records] == ["ok", "ok too"] and bad.counts == {str(tmp_path / "t.parquet"): 1}


def test_an_empty_parquet_file_holds_no_records_like_an_empty_jsonl(tmp_path):
    """Issue 47, defect 5: an empty Parquet file (train or eval) was a 53-line `datasets` traceback where an empty
    JSONL gives no records (and the trainer's one-line error)."""
    write_parquet(tmp_path / "empty.parquet", {"problem": [], "answer": [], "images": []})
    (tmp_path / "zero_bytes.parquet").write_bytes(b"")
    (tmp_path / "empty.jsonl").write_text("")
    expected = load_records([str(tmp_path / "empty.jsonl")])
    assert expected == []
    for name in ("empty.parquet", "zero_bytes.parquet"):
        assert load_records([str(tmp_path / name)], ColumnKeys(prompt="problem")) == expected


def test_an_unreadable_parquet_file_is_one_error_naming_it(tmp_path):
    """Issue 47, defect 5: a file `datasets` cannot read is one DataError naming the file and the cause."""
    (tmp_path / "broken.parquet").write_bytes(b"not a parquet file")
    with pytest.raises(DataError, match=r"broken\.parquet: cannot be read as parquet \(ArrowInvalid: .*magic"):
        load_records([str(tmp_path / "broken.parquet")])


@pytest.mark.parametrize("suffix", ["parquet", "jsonl", "default jsonl"])
def test_a_wrong_column_key_is_one_error_naming_the_key_and_the_file_columns(tmp_path, caplog, suffix):
    """Issue 47, defect 6: `--data.prompt_key=nosuch` printed a "skipping bad record" line per row and never named
    the columns the file has."""
    rows = {"problem": ["a?", "b?", "c?"], "answer": ["1", "2", "3"], "images": [[], [], []]}
    if suffix == "parquet":
        path, keys = tmp_path / "t.parquet", ColumnKeys(prompt="nosuch")
        write_parquet(path, rows)
    else:
        path = tmp_path / "t.jsonl"
        path.write_text("".join(json.dumps({"problem": p, "answer": a}) + "\n"
                                for p, a in zip(rows["problem"], rows["answer"])))
        keys = ColumnKeys() if suffix == "default jsonl" else ColumnKeys(prompt="nosuch")
    wrong = keys.prompt
    with caplog.at_level(logging.WARNING), pytest.raises(DataError) as failed:
        load_records([str(path)], keys)
    columns = "answer, images, problem" if suffix == "parquet" else "answer, problem"
    assert str(failed.value) == f"{path} has no column {wrong!r} (data.prompt_key = {wrong!r}); its columns: {columns}"
    assert not [m for m in caplog.messages if "skipping bad record" in m]


def test_reading_a_parquet_file_prints_no_progress_bar(tmp_path, capfd):
    """Issue 47, defect 11: `datasets` printed "Generating train split" bars for every train and eval file."""
    write_parquet(tmp_path / "fresh.parquet", {"problem": ["a?"], "answer": ["1"], "images": [[]]})
    capfd.readouterr()
    assert len(load_records([str(tmp_path / "fresh.parquet")], ColumnKeys(prompt="problem"))) == 1
    out, err = capfd.readouterr()
    assert out == "" and err == ""


def test_a_pattern_matching_nothing_is_an_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="matches no file"):
        expand_files([str(tmp_path / "missing-*.parquet")])


def test_placeholders_put_images_where_the_prompt_says():
    [msg] = build_interleaved_messages("Compare <image> with <image>.", 2, 0)
    assert [c["type"] for c in msg["content"]] == ["text", "image", "text", "image", "text"]
    assert msg["content"][0]["text"] == "Compare " and msg["content"][4]["text"] == "."
    [msg] = build_interleaved_messages("No placeholder", 2, 1)
    assert [c["type"] for c in msg["content"]] == ["image", "image", "video", "text"]
    with pytest.raises(BadSampleError, match="placeholders"):
        build_interleaved_messages("one <image>", 2, 0, record_id="r")


def test_interleaved_record_encodes_images_in_text_order(processor):
    """The image pads of an interleaved prompt sit between the text pieces, in the order of the images."""
    encoder = PromptEncoder(processor, max_prompt_tokens=4096)
    record = PromptRecord(id="r", prompt="ALPHA <image> BRAVO <image> CHARLIE", answer="x",
                          images=[png_bytes("red", (56, 56)), png_bytes("blue", (112, 56))])
    inputs = encoder.encode(record)
    assert inputs.image_grid_thw.tolist() == [[1, 4, 4], [1, 4, 8]]
    text = processor.tokenizer.decode(inputs.input_ids)
    first, second = text.index("<|vision_start|>"), text.rindex("<|vision_start|>")
    assert text.index("ALPHA") < first < text.index("BRAVO") < second < text.index("CHARLIE")
    assert text.count("<|image_pad|>") == (16 + 32) // 4


def test_corrupt_image_bytes_are_a_bad_sample_not_a_crash(processor):
    encoder = PromptEncoder(processor, max_prompt_tokens=4096)
    good = PromptRecord(id="good", prompt="p", answer="1", images=[png_bytes("red")])
    broken = PromptRecord(id="broken", prompt="p", answer="1", images=[png_bytes("red")[:40]])
    batch = encoder.encode_batch([good, broken])
    assert [r.id for r in batch.records] == ["good"] and batch.skipped[0].record_id == "broken"


def test_eval_set_names_and_prompt_suffix(tmp_path):
    assert [set_name(p) for p in ("data/test-*.parquet", "geo/test.parquet", "x/*.jsonl")] == ["test", "test", "x"]
    (tmp_path / "r.jsonl").write_text(json.dumps({"prompt": "Find x.", "answer": "2"}) + "\n")
    [record] = load_records([str(tmp_path / "r.jsonl")], prompt_suffix="Answer in \\boxed{}.")
    assert record.prompt == "Find x. Answer in \\boxed{}."
