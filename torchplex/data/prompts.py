"""Records -> encoded prompts, with bad samples (unreadable media, processor failures, over-long prompts) set aside
and counted (data/skips.py)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

from .media import build_interleaved_messages, load_media
from .processing import DEFAULT_VIDEO_FPS, PromptInputs, encode_prompt
from .records import BadSampleError, PromptRecord
from .skips import SkipTally, guard_record
from .video import VideoBudget


@dataclass
class EncodedBatch:
    records: list[PromptRecord]
    prompts: list[PromptInputs]
    skipped: list[BadSampleError] = field(default_factory=list)
    # Position of each kept record in the list given to `encode_batch`: lets the caller keep per-prompt state
    # (e.g. sampling seeds keyed on the prompt's place in the global batch) aligned when samples are skipped.
    indices: list[int] = field(default_factory=list)


def _media_of(record: PromptRecord) -> str:
    # Images may be paths, bytes or Arrow-held images (data/sources.py): name paths, count the others.
    media = list(record.images) + list(record.video or []) + list(record.videos)
    paths = [m if isinstance(m, str) else f"<{type(m).__name__} image>" for m in media]
    where = ", ".join(paths[:3]) + (f" (+{len(paths) - 3} more)" if len(paths) > 3 else "")
    if record.origin:
        where = f"{where} (record at {record.origin})" if where else f"record at {record.origin}"
    return where


class PromptEncoder:
    def __init__(self, processor, max_prompt_tokens: int, system: str | None = None,
                 video_budget: VideoBudget | None = None, frames_fps: float = DEFAULT_VIDEO_FPS):
        self.processor = processor
        self.max_prompt_tokens = max_prompt_tokens
        self.system = system
        if video_budget is None:
            image_processor = processor.image_processor
            video_budget = VideoBudget(factor=image_processor.patch_size * image_processor.merge_size)
        budget = video_budget
        # Frames are resized once, here, within the processor's own video pixel bounds: its smart-resize then
        # keeps them as they are instead of resizing a second time.
        size = getattr(getattr(processor, "video_processor", None), "size", None) or {}
        low, high = size.get("shortest_edge"), size.get("longest_edge")
        if low and high:
            budget = dataclasses.replace(budget, min_pixels=max(budget.min_pixels, low),
                                         max_pixels=max(min(budget.max_pixels, high), max(budget.min_pixels, low)))
        self.video_budget = budget
        self.frames_fps = frames_fps
        self.skips = SkipTally()

    @property
    def skipped_total(self) -> int:
        return self.skips.total()

    def encode(self, record: PromptRecord) -> PromptInputs:
        """Encode one record; raises BadSampleError (naming the record and its files) for whatever goes wrong."""
        media = load_media(record, self.video_budget, self.frames_fps)
        messages = build_interleaved_messages(record.prompt, len(media.images), len(media.videos), self.system,
                                              record_id=record.id)
        prompt = guard_record(record.id, _media_of(record), encode_prompt, self.processor, record.prompt,
                              images=media.images or None, videos=media.videos or None, system=self.system,
                              video_fps=[1.0 / s for s in media.video_seconds_per_frame], messages=messages)
        if len(prompt.input_ids) > self.max_prompt_tokens:
            raise BadSampleError(record.id, _media_of(record), f"{len(prompt.input_ids)} tokens, over "
                                 f"data.max_prompt_tokens={self.max_prompt_tokens}", kind="too_long")
        return prompt

    def encode_batch(self, records: list[PromptRecord], phase: str = "train") -> EncodedBatch:
        """The records that encode, in order; the others are counted under `phase` and warned about once."""
        out = EncodedBatch([], [])
        for i, record in enumerate(records):
            try:
                prompt = guard_record(record.id, _media_of(record), self.encode, record)
            except BadSampleError as err:
                out.skipped.append(err)
                self.skips.add(phase, err)
                continue
            out.prompts.append(prompt)
            out.records.append(record)
            out.indices.append(i)
        return out
