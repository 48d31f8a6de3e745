"""What transformers' Qwen2_5_VLForConditionalGeneration needs to see a visual prompt as Qwen2.5-VL does.

transformers 5.x lays out multimodal RoPE positions only when it is given `mm_token_type_ids` (0 text, 1 image,
2 video) together with the grids; without them its forward and generate silently fall back to 1-D positions, and
a comparison with it cannot see a wrong position rule. Every test that compares with transformers on an image or
video prompt builds its arguments here. Read from 5.24 (CPU) and 5.17 (GPU image): both take the same keyword
names in forward and generate, but 5.17 truncates `second_per_grid_ts` to an integer (`int(next(...))`), so the
prompts compared here keep it integral (the processor's default of 2 frames per second gives 1.0 s per grid).
"""

from __future__ import annotations

import torch


def mm_token_type_ids(input_ids: torch.Tensor, image_token_id: int, video_token_id: int) -> torch.Tensor:
    return (input_ids == image_token_id).int() + 2 * (input_ids == video_token_id).int()


def hf_prompt_kwargs(prompt, image_token_id: int, video_token_id: int) -> dict:
    """Keyword arguments for transformers' forward/generate on one encoded prompt (a PromptInputs)."""
    input_ids = prompt.input_ids[None]
    kwargs = dict(input_ids=input_ids, attention_mask=torch.ones_like(input_ids),
                  mm_token_type_ids=mm_token_type_ids(input_ids, image_token_id, video_token_id))
    if prompt.pixel_values is not None:
        kwargs.update(pixel_values=prompt.pixel_values, image_grid_thw=prompt.image_grid_thw)
    if prompt.pixel_values_videos is not None:
        seconds = prompt.second_per_grid_ts
        if seconds is not None and not torch.equal(seconds, seconds.round()):
            raise ValueError(f"second_per_grid_ts {seconds.tolist()} is not integral: transformers 5.17 truncates it "
                             f"and 5.24 does not, so the reference would depend on the version")
        kwargs.update(pixel_values_videos=prompt.pixel_values_videos, video_grid_thw=prompt.video_grid_thw,
                      second_per_grid_ts=seconds)
    return kwargs
