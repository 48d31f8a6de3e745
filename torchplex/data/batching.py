"""Collate encoded prompts (optionally with responses) into right-padded model batches.

Used by every phase that runs the model over prompts: rollout prefill, reference/actor prefix, and the serial
baseline's full prompt+response forwards. A prompt is anything with the fields of
`torchplex.data.processing.PromptInputs` (input_ids, pixel_values, image_grid_thw, pixel_values_videos,
video_grid_thw, second_per_grid_ts).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from ..models.qwen2_5_vl.args import ModelArgs
from ..models.qwen2_5_vl.rope_index import get_rope_index


@dataclass
class ModelBatch:
    input_ids: torch.Tensor          # (B, T) right-padded
    lengths: torch.Tensor            # (B,) valid tokens per row
    position_ids: torch.Tensor       # (3, B, T)
    next_position: torch.Tensor      # (B,) RoPE position after each row's valid tokens
    pixel_values: torch.Tensor | None
    image_grid_thw: torch.Tensor | None
    pixel_values_videos: torch.Tensor | None
    video_grid_thw: torch.Tensor | None
    prompt_lengths: torch.Tensor     # (B,) prompt part of each row; response tokens after it are text

    @property
    def attention_mask(self) -> torch.Tensor:
        return torch.arange(self.input_ids.shape[1], device=self.lengths.device)[None] < self.lengths[:, None]

    def to(self, device) -> "ModelBatch":
        move = lambda t: None if t is None else t.to(device)
        return ModelBatch(*(move(getattr(self, f)) for f in self.__dataclass_fields__))


def _cat(items: list[torch.Tensor | None]) -> torch.Tensor | None:
    present = [t for t in items if t is not None]
    return torch.cat(present) if present else None


def collate(args: ModelArgs, prompts: Sequence, responses: Sequence[Sequence[int]] | None = None,
            pad_id: int = 0, pad_to_multiple: int = 1) -> ModelBatch:
    """Right-pad prompts (each followed by its response tokens when given) into one batch."""
    prompt_rows = [p.input_ids.tolist() if torch.is_tensor(p.input_ids) else list(p.input_ids) for p in prompts]
    response_rows = [list(r) for r in responses] if responses is not None else [[] for _ in prompts]
    prompt_lengths = torch.tensor([len(r) for r in prompt_rows], dtype=torch.long)
    lengths = prompt_lengths + torch.tensor([len(r) for r in response_rows], dtype=torch.long)
    width = -(-int(lengths.max()) // pad_to_multiple) * pad_to_multiple
    input_ids = torch.full((len(prompt_rows), width), pad_id, dtype=torch.long)
    for i, (p, r) in enumerate(zip(prompt_rows, response_rows)):
        input_ids[i, :len(p) + len(r)] = torch.tensor(p + r, dtype=torch.long)
    image_grid = _cat([p.image_grid_thw for p in prompts])
    video_grid = _cat([p.video_grid_thw for p in prompts])
    seconds = _cat([getattr(p, "second_per_grid_ts", None) for p in prompts])
    # Visual grids are laid out over the prompts only; response tokens continue as text whatever their ids.
    in_prompt = torch.arange(width)[None] < prompt_lengths[:, None]
    position_ids, next_position = get_rope_index(args, input_ids, image_grid, video_grid, seconds, in_prompt)
    if responses is not None:
        for i, r in enumerate(response_rows):
            p = len(prompt_rows[i])
            position_ids[:, i, p:p + len(r)] = next_position[i] + torch.arange(len(r))
        next_position = next_position + lengths - prompt_lengths
    return ModelBatch(input_ids, lengths, position_ids, next_position, _cat([p.pixel_values for p in prompts]),
                      image_grid, _cat([p.pixel_values_videos for p in prompts]), video_grid, prompt_lengths)


def encode_visuals(model, batch: ModelBatch) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Run the vision tower over the batch's images and videos (in batch order)."""
    image = model.encode_vision(batch.pixel_values, batch.image_grid_thw) if batch.pixel_values is not None else None
    video = (model.encode_vision(batch.pixel_values_videos, batch.video_grid_thw)
             if batch.pixel_values_videos is not None else None)
    return image, video


# ---- batches cut by a token budget: the rollout's prefill admissions, the vision tower's encodings, the batched
# prefix forwards and the training and reference micro-batches all cut their items with these, so what the memory
# budget counts is what runs --------------------------------------------------------------------------------------
def token_batches(items: Sequence, max_tokens: int, length=len, max_items: int | None = None,
                  count=lambda item: 1) -> list[list]:
    """`items` in order, cut greedily into batches of at most `max_tokens` tokens (an item longer than that alone)
    and at most `max_items` items, an item counting `count(item)` of them (an item over that alone too)."""
    batches: list[list] = []
    left = items_left = 0
    for item in items:
        if not batches or length(item) > left or (max_items is not None and count(item) > items_left):
            batches.append([])
            left, items_left = max_tokens, max_items if max_items is not None else 0
        batches[-1].append(item)
        left -= length(item)
        items_left -= count(item)
    return batches


def length_groups(items: Sequence, ratio: float = 1.25, length=len) -> list[list]:
    """The items in ascending length, cut where one is longer than `ratio` times its group's shortest: a batch
    right-pads every item to its longest, so one batch per group keeps its padding within `ratio`."""
    groups: list[list] = []
    for item in sorted(items, key=length):
        if not groups or length(item) > ratio * length(groups[-1][0]):
            groups.append([])
        groups[-1].append(item)
    return groups


def padded_tokens(lengths: Sequence[int]) -> int:
    """Tokens of one right-padded batch of these lengths."""
    return len(lengths) * max(lengths) if lengths else 0
