"""Prompt records: one JSON object per line, each a question about zero or more images or a video.

A line looks like

    {"id": "q17", "prompt": "How many circles are in the image?", "answer": "3",
     "images": ["images/q17.png"], "task": "counting"}

Accepted keys: ``id`` (defaults to ``"<file stem>:<line>"``), ``prompt`` or ``question``,
``answer`` (numbers are turned into strings), ``images`` (list of paths) or ``image`` (one path),
``video`` (list of frame paths), ``task`` and ``meta`` (a dict). Any other key is kept in ``meta``
so that dataset-specific fields survive the round trip. Relative media paths are resolved against
the folder holding the JSONL file, so a dataset folder can be moved as a whole.

Images are opened lazily (``load_images``) by the trainer, one batch at a time: a broken file
then costs one sample (``BadSampleError``), not the run.

``PromptStream`` hands out batches of records in a deterministic, per-epoch shuffled order and
can save and restore its position so that a resumed run sees exactly the batches it would have.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np
from PIL import Image

logger = logging.getLogger(__name__)

_SHOWN_LINES = 20  # malformed lines listed one by one in read_records' warning
_KNOWN_KEYS = {"id", "prompt", "question", "answer", "images", "image", "video", "task", "meta"}


@dataclass
class PromptRecord:
    """One RL prompt: the text, the reference answer, and the media it is about."""

    id: str
    prompt: str
    answer: str
    # Paths, encoded bytes, or images left in an Arrow table (data/sources.py); opened by data/media.py.
    images: list[Any] = field(default_factory=list)
    # Frame paths of one video, in temporal order; None when the record has no video.
    video: list[str] | None = None
    # Video files (mp4 and the like), decoded and sampled by data/video.py.
    videos: list[str] = field(default_factory=list)
    task: str = ""
    meta: dict[str, Any] = field(default_factory=dict)
    # Where the record came from ("file.jsonl:17"), so a skipped record can be found; "" when built in code.
    origin: str = field(default="", compare=False)


class RecordFormatError(ValueError):
    """A line of a records file is not a valid record; the message names the file and line."""

    def __init__(self, path: str | Path, line_no: int, reason: str):
        self.path = str(path)
        self.line_no = line_no
        self.reason = reason
        super().__init__(f"{self.path}:{line_no}: {reason}")


class BadSampleError(Exception):
    """A record could not be turned into model inputs: a file unreadable, the prompt too long, or the processor
    failed on it (`kind`).

    Raised by ``load_images`` so that the trainer can drop this one sample, count it and warn,
    instead of stopping a long run on one corrupt file.
    """

    def __init__(self, record_id: str, path: str, reason: str, kind: str = "media"):
        self.record_id = record_id
        self.path = path
        self.reason = reason
        self.kind = kind  # a `skips.REASONS` entry: what the skip is counted as
        what = {"media": "cannot read", "too_long": "prompt from", "preprocess": "cannot process"}.get(kind, "bad")
        super().__init__(f"record {record_id!r}: {what} {path or '(no media)'}: {reason}")


@dataclass
class SkippedLine:
    line_no: int
    reason: str


@dataclass
class RecordsFile:
    """What ``read_records_report`` found in one file: the good records and the skipped lines."""

    path: str
    records: list[PromptRecord]
    skipped: list[SkippedLine] = field(default_factory=list)


# --------------------------------------------------------------------------------------------
# Reading
# --------------------------------------------------------------------------------------------


def _resolve(folder: Path, media_path: str) -> str:
    p = Path(media_path).expanduser()
    return str(p if p.is_absolute() else folder / p)


def _str_list(value: Any, key: str) -> list[str]:
    if not isinstance(value, list) or not all(isinstance(v, str) and v for v in value):
        raise ValueError(f"key {key!r} must be a list of non-empty path strings, got {value!r}")
    return value


def _parse_record(obj: Any, folder: Path, default_id: str) -> PromptRecord:
    """Build a record from one decoded JSON line; raises ValueError naming the bad key."""
    if not isinstance(obj, dict):
        raise ValueError(f"expected a JSON object, got {type(obj).__name__}")

    if "prompt" in obj and "question" in obj:
        raise ValueError("both 'prompt' and 'question' given; use one")
    prompt = obj.get("prompt", obj.get("question"))
    if not isinstance(prompt, str) or not prompt.strip():
        raise ValueError("missing or empty 'prompt' (or 'question')")

    if "answer" not in obj:
        raise ValueError("missing 'answer'")
    answer = obj["answer"]
    if isinstance(answer, bool) or not isinstance(answer, (str, int, float)):
        raise ValueError(f"'answer' must be a string or number, got {answer!r}")
    answer = str(answer)

    if "images" in obj and "image" in obj:
        raise ValueError("both 'images' and 'image' given; use one")
    if "image" in obj:
        if not isinstance(obj["image"], str) or not obj["image"]:
            raise ValueError(f"key 'image' must be a path string, got {obj['image']!r}")
        images = [obj["image"]]
    else:
        images = _str_list(obj.get("images", []), "images")

    video = None
    if obj.get("video") is not None:
        video = _str_list(obj["video"], "video")
        if not video:
            raise ValueError("key 'video' is an empty frame list")

    record_id = obj.get("id", default_id)
    if not isinstance(record_id, (str, int)) or isinstance(record_id, bool):
        raise ValueError(f"'id' must be a string or integer, got {record_id!r}")

    task = obj.get("task", "")
    if not isinstance(task, str):
        raise ValueError(f"'task' must be a string, got {task!r}")

    meta = obj.get("meta", {})
    if not isinstance(meta, dict):
        raise ValueError(f"'meta' must be an object, got {meta!r}")
    extra = {k: v for k, v in obj.items() if k not in _KNOWN_KEYS}

    return PromptRecord(
        id=str(record_id),
        prompt=prompt,
        answer=answer,
        images=[_resolve(folder, p) for p in images],
        video=None if video is None else [_resolve(folder, p) for p in video],
        task=task,
        meta={**meta, **extra},
    )


def read_records_report(
    path: str | Path, on_error: Literal["raise", "skip"] = "raise"
) -> RecordsFile:
    """Read a JSONL records file, returning the records and (in skip mode) what was skipped.

    Blank lines are ignored. With ``on_error="raise"`` the first malformed line raises a
    ``RecordFormatError`` naming the file and 1-based line number.
    """
    if on_error not in ("raise", "skip"):
        raise ValueError(f"on_error must be 'raise' or 'skip', got {on_error!r}")
    path = Path(path)
    folder = path.resolve().parent
    result = RecordsFile(path=str(path), records=[])
    seen_ids: dict[str, int] = {}
    with open(path, "rb") as f:  # bytes: a line that is not UTF-8 costs that line, not the file
        for line_no, raw in enumerate(f, start=1):
            if not raw.strip():
                continue
            try:
                try:
                    obj = json.loads(raw.decode("utf-8"))
                except UnicodeDecodeError as e:
                    raise ValueError(f"not UTF-8 ({e.reason} at byte {e.start})") from None
                except json.JSONDecodeError as e:
                    raise ValueError(f"invalid JSON ({e.msg} at column {e.colno})") from None
                record = _parse_record(obj, folder, default_id=f"{path.stem}:{line_no}")
                record.origin = f"{path}:{line_no}"
                if record.id in seen_ids:
                    raise ValueError(
                        f"duplicate id {record.id!r} (first on line {seen_ids[record.id]})"
                    )
            except (ValueError, TypeError, RecursionError) as e:
                if on_error == "raise":
                    raise RecordFormatError(path, line_no, str(e)) from None
                result.skipped.append(SkippedLine(line_no, str(e)))
                continue
            seen_ids[record.id] = line_no
            result.records.append(record)
    return result


def read_records(
    path: str | Path, on_error: Literal["raise", "skip"] = "raise"
) -> list[PromptRecord]:
    """Read a JSONL records file (see the module docstring for the format).

    In skip mode malformed lines are dropped and their number logged as one warning; use
    ``read_records_report`` to get the skipped lines themselves.
    """
    result = read_records_report(path, on_error)
    if result.skipped:
        shown = result.skipped[:_SHOWN_LINES]
        more = len(result.skipped) - len(shown)
        logger.warning(
            "%s: skipped %d malformed line(s):\n%s%s", path, len(result.skipped),
            "\n".join(f"  line {s.line_no}: {s.reason}" for s in shown), f"\n  ... and {more} more" if more else "",
        )
    return result.records


# --------------------------------------------------------------------------------------------
# Media
# --------------------------------------------------------------------------------------------


def _open_rgb(record_id: str, path: str) -> Image.Image:
    try:
        with Image.open(path) as im:
            # convert() forces the full decode here, so truncated files fail now and the
            # file handle is closed before we return.
            return im.convert("RGB")
    except FileNotFoundError:
        raise BadSampleError(record_id, path, "file not found") from None
    except Exception as e:  # noqa: BLE001
        # PIL signals undecodable data with OSError (UnidentifiedImageError), ValueError,
        # SyntaxError, struct.error... depending on the format plugin: any of them costs one sample.
        raise BadSampleError(record_id, path, f"{type(e).__name__}: {e}") from None


def load_images(record: PromptRecord) -> list[Image.Image] | None:
    """Open the record's images followed by its video frames, all as RGB.

    Returns None for a text-only record. Raises ``BadSampleError`` if any file is missing or
    cannot be decoded. Use ``load_video_frames`` when the video must be kept apart.
    """
    paths = list(record.images) + list(record.video or [])
    if not paths:
        return None
    return [_open_rgb(record.id, p) for p in paths]


def load_video_frames(record: PromptRecord) -> list[Image.Image] | None:
    """Open only the record's video frames (RGB), or None if it has no video."""
    if not record.video:
        return None
    return [_open_rgb(record.id, p) for p in record.video]


# --------------------------------------------------------------------------------------------
# Batching
# --------------------------------------------------------------------------------------------


class PromptStream:
    """An endless, deterministic stream of prompt batches, reshuffled every epoch.

    Epoch ``e`` visits the records in the order of a permutation drawn from an RNG seeded with
    ``(seed, e)``. Because the RNG is re-created from those two integers at every epoch boundary,
    its whole state is the epoch number: ``state_dict()`` (epoch, index into the epoch's order,
    seed) therefore pins the future batches exactly, and is plain JSON.

    A batch that runs past the end of an epoch is completed from the start of the next one, so
    every record is used equally often and every batch has ``prompts_per_step`` records.
    """

    def __init__(
        self,
        records: Sequence[PromptRecord],
        prompts_per_step: int,
        seed: int,
        shuffle: bool = True,
    ):
        if not records:
            raise ValueError("PromptStream needs at least one record")
        if prompts_per_step < 1:
            raise ValueError(f"prompts_per_step must be >= 1, got {prompts_per_step}")
        self.records = list(records)
        self.prompts_per_step = prompts_per_step
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0
        self.index = 0  # position in the current epoch's order
        self._order = self._epoch_order(0)

    def _epoch_order(self, epoch: int) -> np.ndarray:
        n = len(self.records)
        if not self.shuffle:
            return np.arange(n)
        return np.random.default_rng([self.seed, epoch]).permutation(n)

    def next_batch(self) -> list[PromptRecord]:
        batch: list[PromptRecord] = []
        while len(batch) < self.prompts_per_step:
            if self.index == len(self.records):
                self.epoch += 1
                self.index = 0
                self._order = self._epoch_order(self.epoch)
            batch.append(self.records[int(self._order[self.index])])
            self.index += 1
        return batch

    def __iter__(self) -> Iterator[list[PromptRecord]]:
        while True:
            yield self.next_batch()

    def state_dict(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "index": self.index,
            "seed": self.seed,
            "shuffle": self.shuffle,
            "num_records": len(self.records),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        # A position only means something for the same data and shuffling; refuse silently
        # wrong resumes.
        for key, mine in (
            ("seed", self.seed),
            ("shuffle", self.shuffle),
            ("num_records", len(self.records)),
        ):
            if state.get(key) != mine:
                raise ValueError(
                    f"PromptStream state has {key}={state.get(key)!r} but this stream has {mine!r}"
                )
        if not 0 <= state["index"] <= len(self.records):
            raise ValueError(f"PromptStream state index {state['index']} out of range")
        self.epoch = int(state["epoch"])
        self.index = int(state["index"])
        self._order = self._epoch_order(self.epoch)
