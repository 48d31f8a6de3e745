"""Records -> encoded prompts, with bad samples (missing media, over-long prompts) set aside and counted."""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field

from .media import build_interleaved_messages, load_media
from .processing import DEFAULT_VIDEO_FPS, PromptInputs, encode_prompt
from .records import BadSampleError, PromptRecord
from .video import VideoBudget

log = logging.getLogger(__name__)


@dataclass
class EncodedBatch:
    records: list[PromptRecord]
    prompts: list[PromptInputs]
    skipped: list[BadSampleError] = field(default_factory=list)
    # Position of each kept record in the list given to `encode_batch`: lets the caller keep per-prompt state
    # (e.g. sampling seeds keyed on the prompt's place in the global batch) aligned when samples are skipped.
    indices: list[int] = field(default_factory=list)


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
        self.skipped_total = 0

    def encode(self, record: PromptRecord) -> PromptInputs:
        """Encode one record; raises BadSampleError for unreadable media or a prompt over the token budget."""
        media = load_media(record, self.video_budget, self.frames_fps)
        messages = build_interleaved_messages(record.prompt, len(media.images), len(media.videos), self.system,
                                              record_id=record.id)
        prompt = encode_prompt(self.processor, record.prompt, images=media.images or None,
                               videos=media.videos or None, system=self.system,
                               video_fps=[1.0 / s for s in media.video_seconds_per_frame], messages=messages)
        if len(prompt.input_ids) > self.max_prompt_tokens:
            raise BadSampleError(record.id, "", f"prompt has {len(prompt.input_ids)} tokens, over "
                                                f"data.max_prompt_tokens={self.max_prompt_tokens}")
        return prompt

    def encode_batch(self, records: list[PromptRecord]) -> EncodedBatch:
        out = EncodedBatch([], [])
        for i, record in enumerate(records):
            try:
                out.prompts.append(self.encode(record))
                out.records.append(record)
                out.indices.append(i)
            except BadSampleError as err:
                out.skipped.append(err)
                self.skipped_total += 1
                log.warning("skipping sample %s: %s", record.id, err)
        return out
