"""Where prompt records come from: JSONL files, and Parquet / Arrow / CSV / JSON files read by HF `datasets`.

    [data]
    train_files = ["data/geometry3k/train-*.parquet"]   # globs; several files are concatenated
    eval_files = ["data/geometry3k/test.parquet"]
    prompt_key = "problem"                                # column names, as verl/EasyR1 spell them
    answer_key = "answer"
    image_key = "images"
    video_key = "videos"

A row's images may be paths, encoded bytes, or `datasets` Image values ({"bytes": ..., "path": ...}; read with
decode=False and left in the memory-mapped Arrow table, `StoredImage`, until their batch); one image or a list. Videos are file paths (one or a
list) or a list of frame paths for one pre-extracted video (a list whose items are images, not video files).
Relative paths resolve against the folder of the file that names them. Prompts may place media with
`<image>` / `<video>` (data/media.py).

JSONL files are read line by line, never through Arrow (whose one schema per file trips over answers that are
sometimes numbers and sometimes strings): with the default keys by data/records.py's reader, with custom keys by
`row_to_record` here. Other formats go through `datasets`.

Records that cannot be used are skipped, counted and warned about once per file (`BadRecords`), so one bad row
does not end a run.
"""

from __future__ import annotations

import contextlib
import glob
import json
import logging
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterable

from .records import PromptRecord, read_records_report
from .skips import DataError

log = logging.getLogger(__name__)

VIDEO_SUFFIXES = {".mp4", ".avi", ".mov", ".mkv", ".webm", ".m4v", ".mpg", ".mpeg", ".gif"}
_DATASETS_BUILDERS = {".parquet": "parquet", ".arrow": "arrow", ".csv": "csv", ".json": "json",
                      ".jsonl": "json", ".tsv": "csv"}


@dataclass(frozen=True)
class ColumnKeys:
    prompt: str = "prompt"
    answer: str = "answer"
    images: str = "images"
    videos: str = "videos"
    id: str = "id"

    @property
    def is_default(self) -> bool:
        return self == ColumnKeys()


class BadRecords:
    """Skip + count + warn, naming the record and why (the first SHOWN_PER_FILE of each file one by one, the rest
    counted); the one place records are dropped while reading (encoding failures are counted later, data/skips.py)."""

    SHOWN_PER_FILE = 20

    def __init__(self) -> None:
        self.counts: Counter[str] = Counter()

    def skip(self, file: str, record_id: str, reason: str) -> None:
        self.counts[file] += 1
        if self.counts[file] <= self.SHOWN_PER_FILE:
            log.warning("%s: skipping bad record %s: %s", file, record_id, reason)
        elif self.counts[file] == self.SHOWN_PER_FILE + 1:
            log.warning("%s: more bad records: counted, not shown", file)

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def summary(self) -> None:
        for file, count in self.counts.items():
            log.warning("%s: %d bad record(s) skipped", file, count)


def expand_files(patterns: Iterable[str]) -> list[Path]:
    """Glob patterns -> files in a stable order; a pattern matching nothing is an error (a typo, not no data)."""
    files: list[Path] = []
    for pattern in patterns:
        matches = sorted(glob.glob(str(Path(pattern).expanduser()), recursive=True))
        if not matches:
            raise FileNotFoundError(f"data file pattern {pattern!r} matches no file (cwd: {Path.cwd()})")
        files += [Path(m) for m in matches if Path(m).is_file()]
    return files


def _resolve(folder: Path, path: str) -> str:
    p = Path(path).expanduser()
    return str(p if p.is_absolute() else folder / p)


def _as_list(value: Any) -> list:
    if value is None:
        return []
    return list(value) if isinstance(value, (list, tuple)) else [value]


@dataclass(frozen=True)
class StoredImage:
    """An image kept in its (memory-mapped) Arrow table until a batch needs it: a Parquet set of many GB of
    image bytes then costs no host memory per record."""

    dataset: Any  # a datasets.Dataset with the image column cast to decode=False
    row: int
    column: str
    index: int | None  # position in a list column; None for a single-image column

    def load_image_bytes(self) -> bytes:
        value = self.dataset[self.row][self.column]
        return bytes((value if self.index is None else value[self.index])["bytes"])


def _image_source(value: Any, folder: Path, stored: StoredImage | None = None) -> str | bytes | StoredImage:
    if isinstance(value, dict):  # datasets' Image(decode=False): bytes win, the path may be a bare file name
        if value.get("bytes"):
            return stored if stored is not None else bytes(value["bytes"])
        value = value.get("path")
    if isinstance(value, (bytes, bytearray)) and value:
        return bytes(value)
    if isinstance(value, str) and value:
        return _resolve(folder, value)
    raise ValueError(f"an image must be a path, bytes or {{'bytes', 'path'}}, got {type(value).__name__}")


def row_to_record(row: dict[str, Any], keys: ColumnKeys, folder: Path, default_id: str,
                  dataset: Any = None, row_index: int = 0) -> PromptRecord:
    """One dataset row as a record; raises ValueError naming what is wrong. With `dataset` (the row's source),
    image bytes stay there (`StoredImage`)."""
    prompt = row.get(keys.prompt)
    if isinstance(prompt, list):  # verl stores chat messages; the user turn's text is the prompt
        prompt = "".join(m.get("content", "") for m in prompt if isinstance(m, dict) and m.get("role") == "user")
    if not isinstance(prompt, str) or not prompt.strip():
        raise ValueError(f"missing or empty prompt column {keys.prompt!r}")
    answer = row.get(keys.answer)
    if isinstance(answer, dict) and "ground_truth" in answer:  # verl's reward_model column
        answer = answer["ground_truth"]
    if answer is None or isinstance(answer, bool) or not isinstance(answer, (str, int, float)):
        raise ValueError(f"answer column {keys.answer!r} must be a string or number, got {answer!r}")
    raw_images = row.get(keys.images)
    single = not isinstance(raw_images, (list, tuple))

    def stored(j: int) -> StoredImage | None:
        return None if dataset is None else StoredImage(dataset, row_index, keys.images, None if single else j)

    images = [_image_source(v, folder, stored(j)) for j, v in enumerate(_as_list(raw_images))]
    videos, frames = [], None
    for item in _as_list(row.get(keys.videos)):
        if isinstance(item, (list, tuple)):  # one video given as its frame paths
            if frames is not None or not item:
                raise ValueError("only one non-empty frame-list video per record is supported")
            frames = [_resolve(folder, str(p)) for p in item]
        elif isinstance(item, str) and item:
            videos.append(_resolve(folder, item))
        else:
            raise ValueError(f"a video must be a file path or a list of frame paths, got {item!r}")
    if frames is None and videos and all(Path(v).suffix.lower() not in VIDEO_SUFFIXES for v in videos):
        frames, videos = videos, []  # a flat list of frame images (EasyR1 writes frame folders this way)
    record_id = row.get(keys.id, default_id)
    known = {keys.prompt, keys.answer, keys.images, keys.videos, keys.id}
    meta = {k: v for k, v in row.items() if k not in known and _jsonable(v)}
    return PromptRecord(id=str(record_id), prompt=prompt, answer=str(answer), images=images, video=frames,
                        videos=videos, task=str(row.get("task", "") or ""), meta=meta)


def _with_video_files(record: PromptRecord, folder: Path) -> PromptRecord:
    videos = record.meta.pop("videos", None)
    if videos is None:
        return record
    videos = _as_list(videos)
    if not all(isinstance(v, str) and v for v in videos):
        raise ValueError(f"key 'videos' must be a video file path or a list of them, got {videos!r}")
    record.videos = [_resolve(folder, v) for v in videos]
    return record


def _jsonable(value: Any) -> bool:
    try:
        json.dumps(value)
        return True
    except (TypeError, ValueError):
        return False


def _no_image_decoding(ds):
    """Cast every `datasets` Image column (alone or in a list) to decode=False: bytes stay bytes until a batch
    needs them."""
    from datasets import Image as ImageFeature

    for name, feature in ds.features.items():
        inner = getattr(feature, "feature", None)
        if isinstance(feature, ImageFeature):
            ds = ds.cast_column(name, ImageFeature(decode=False))
        elif isinstance(inner, ImageFeature):
            feature.feature = ImageFeature(decode=False)
            ds = ds.cast_column(name, feature)
    return ds


@contextlib.contextmanager
def _quiet_datasets():
    """`datasets` without its "Generating train split" bars and its own error log lines (a file it cannot read is
    reported once, by `_open_dataset`'s DataError)."""
    from datasets.utils import logging as datasets_logging

    bars, verbosity = datasets_logging.is_progress_bar_enabled(), datasets_logging.get_verbosity()
    datasets_logging.disable_progress_bar()
    datasets_logging.set_verbosity(logging.CRITICAL)
    try:
        yield
    finally:
        datasets_logging.set_verbosity(verbosity)
        if bars:
            datasets_logging.enable_progress_bar()


def _holds_no_rows(path: Path) -> bool:
    """An empty file, or a Parquet file of zero rows: no records, as an empty JSONL (`datasets` refuses both)."""
    if path.stat().st_size == 0:
        return True
    if path.suffix.lower() != ".parquet":
        return False
    import pyarrow.parquet as pq

    try:
        return pq.ParquetFile(path).metadata.num_rows == 0
    except Exception:  # noqa: BLE001 - not readable as Parquet: load_dataset's error names the problem
        return False


def _open_dataset(path: Path):
    """The file as a `datasets.Dataset` (images left undecoded), or None when it holds no rows."""
    from datasets import load_dataset

    builder = _DATASETS_BUILDERS.get(path.suffix.lower())
    if builder is None:
        raise ValueError(f"{path}: unknown data file type {path.suffix!r}; use one of {sorted(_DATASETS_BUILDERS)}")
    if _holds_no_rows(path):
        return None
    kwargs = {"delimiter": "\t"} if path.suffix.lower() == ".tsv" else {}
    with _quiet_datasets():
        try:
            ds = load_dataset(builder, data_files=str(path), split="train", **kwargs)
        except Exception as err:  # noqa: BLE001 - datasets wraps the cause; the user needs the file and the cause
            cause = err.__cause__ or err
            raise DataError(f"{path}: cannot be read as {builder} ({type(cause).__name__}: "
                            f"{str(cause).strip().splitlines()[0] if str(cause).strip() else ''})") from None
        return _no_image_decoding(ds)


def check_columns(path: Path, columns: Iterable[str], keys: ColumnKeys) -> None:
    """A prompt or answer column that no row of the file has is a wrong key, not a file of bad rows: one error
    naming the key and the columns the file has (instead of a "skipping bad record" line per row)."""
    columns = set(columns)
    for key, name in (("data.prompt_key", keys.prompt), ("data.answer_key", keys.answer)):
        if name not in columns:
            raise DataError(f"{path} has no column {name!r} ({key} = {name!r}); its columns: "
                            f"{', '.join(sorted(columns)) or 'none'}")


def _jsonl_rows(path: Path, bad: BadRecords) -> Iterable[tuple[int, dict[str, Any]]]:
    """(line number, object) of a JSONL file read line by line: no Arrow schema, so a column may mix types."""
    with open(path, encoding="utf-8") as f:
        for line_no, line in enumerate(f, start=1):
            if not line.strip():
                continue
            try:
                row = json.loads(line)
            except json.JSONDecodeError as e:
                bad.skip(str(path), f"line {line_no}", f"invalid JSON ({e.msg})")
                continue
            if isinstance(row, dict):
                yield line_no, row
            else:
                bad.skip(str(path), f"line {line_no}", f"expected a JSON object, got {type(row).__name__}")


def _jsonl_columns(path: Path) -> set[str]:
    """Every key of any object line of a JSONL file."""
    columns: set[str] = set()
    for _, row in _jsonl_rows(path, BadRecords()):
        columns.update(row)
    return columns


def read_file(path: Path, keys: ColumnKeys, bad: BadRecords) -> list[PromptRecord]:
    if path.suffix.lower() == ".jsonl" and keys.is_default:
        report = read_records_report(path, on_error="skip")
        if report.skipped and not report.records and (columns := _jsonl_columns(path)):
            check_columns(path, columns, keys)  # every line bad: first, is it the file's column names?
        for skipped in report.skipped:
            bad.skip(str(path), f"line {skipped.line_no}", skipped.reason)
        records = []
        for record in report.records:  # that reader keeps unknown keys in meta; video files are ours
            try:
                records.append(_with_video_files(record, path.resolve().parent))
            except ValueError as e:
                bad.skip(str(path), record.id, str(e))
        return records
    folder = path.resolve().parent
    records = []
    if path.suffix.lower() == ".jsonl":
        rows, dataset = list(_jsonl_rows(path, bad)), None
        columns = {key for _, row in rows for key in row}
    else:
        dataset = _open_dataset(path)
        if dataset is None:
            return []
        rows, columns = enumerate(dataset), dataset.column_names
    if columns:
        check_columns(path, columns, keys)
    for index, row in rows:
        default_id = f"{path.stem}:{index}"
        try:
            records.append(row_to_record(row, keys, folder, default_id, dataset, index))
        except ValueError as e:
            bad.skip(str(path), str(row.get(keys.id, default_id)), str(e))
    return records


def set_name(pattern: str) -> str:
    """An eval set's name from its file pattern: "data/test-*.parquet" -> "test"."""
    return Path(pattern).stem.split("*")[0].rstrip("-_.") or Path(pattern).parent.name or "eval"


def load_records(patterns: Iterable[str], keys: ColumnKeys = ColumnKeys(), bad: BadRecords | None = None,
                 prompt_suffix: str = "") -> list[PromptRecord]:
    """Every record of every file the patterns match, in file order; a repeated id is a bad record.
    `prompt_suffix` is appended to every prompt (a recipe's answer-format instruction)."""
    bad = bad if bad is not None else BadRecords()
    records: list[PromptRecord] = []
    seen: set[str] = set()
    for path in expand_files(patterns):
        for record in read_file(path, keys, bad):
            if record.id in seen:
                bad.skip(str(path), record.id, "duplicate id")
                continue
            seen.add(record.id)
            if prompt_suffix:
                record.prompt = f"{record.prompt} {prompt_suffix}"
            records.append(record)
    return records
