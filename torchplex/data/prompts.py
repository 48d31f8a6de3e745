"""Records -> encoded prompts, with bad samples (missing media, over-long prompts) set aside and counted."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from .processing import PromptInputs, encode_prompt
from .records import BadSampleError, PromptRecord, load_images, load_video_frames

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
    def __init__(self, processor, max_prompt_tokens: int, system: str | None = None):
        self.processor = processor
        self.max_prompt_tokens = max_prompt_tokens
        self.system = system
        self.skipped_total = 0

    def encode(self, record: PromptRecord) -> PromptInputs:
        """Encode one record; raises BadSampleError for unreadable media or a prompt over the token budget."""
        media = load_images(record) or []
        frames = load_video_frames(record)
        images = media[:len(record.images)]
        prompt = encode_prompt(self.processor, record.prompt, images=images or None,
                               videos=[frames] if frames else None, system=self.system)
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
