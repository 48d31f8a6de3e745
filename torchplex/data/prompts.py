"""Records -> encoded prompts, with bad samples (unreadable media, processor failures, over-long prompts) set aside
and counted (data/skips.py)."""

from __future__ import annotations

from dataclasses import dataclass, field

from .processing import PromptInputs, encode_prompt
from .records import BadSampleError, PromptRecord, load_images, load_video_frames
from .skips import SkipTally, guard_record


@dataclass
class EncodedBatch:
    records: list[PromptRecord]
    prompts: list[PromptInputs]
    skipped: list[BadSampleError] = field(default_factory=list)
    # Position of each kept record in the list given to `encode_batch`: lets the caller keep per-prompt state
    # (e.g. sampling seeds keyed on the prompt's place in the global batch) aligned when samples are skipped.
    indices: list[int] = field(default_factory=list)


def _media_of(record: PromptRecord) -> str:
    paths = list(record.images) + list(record.video or [])
    where = ", ".join(paths[:3]) + (f" (+{len(paths) - 3} more)" if len(paths) > 3 else "")
    if record.origin:
        where = f"{where} (record at {record.origin})" if where else f"record at {record.origin}"
    return where


class PromptEncoder:
    def __init__(self, processor, max_prompt_tokens: int, system: str | None = None):
        self.processor = processor
        self.max_prompt_tokens = max_prompt_tokens
        self.system = system
        self.skips = SkipTally()

    @property
    def skipped_total(self) -> int:
        return self.skips.total()

    def encode(self, record: PromptRecord) -> PromptInputs:
        """Encode one record; raises BadSampleError (naming the record and its files) for whatever goes wrong."""
        media = load_images(record) or []
        frames = load_video_frames(record)
        images = media[:len(record.images)]
        prompt = guard_record(record.id, _media_of(record), encode_prompt, self.processor, record.prompt,
                              images=images or None, videos=[frames] if frames else None, system=self.system)
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
