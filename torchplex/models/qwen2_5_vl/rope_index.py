"""Multimodal RoPE position ids for Qwen2.5-VL prompts.

Text tokens advance one position per token on all three axes (t, h, w). A run of image or video pad
tokens gets a 3-D grid of positions starting at the current position: t from the frame index (scaled by
`tokens_per_second * seconds_per_grid` for videos), h and w from the merged patch row/column. Text after
a visual run continues at `start + max(grid_h, grid_w) // merge` (the rule of transformers >= 5).
"""

from __future__ import annotations

import torch

from .args import ModelArgs


def vision_grid_positions(start: int, grid_thw: tuple[int, int, int], merge: int,
                          time_interval: float) -> torch.Tensor:
    """(3, t*h*w) positions of one image/video's merged tokens, in the order the vision tower emits them."""
    t, h, w = grid_thw[0], grid_thw[1] // merge, grid_thw[2] // merge
    tt = (torch.arange(t) * time_interval).long() + start
    hh = torch.arange(h) + start
    ww = torch.arange(w) + start
    return torch.stack([
        tt.view(t, 1, 1).expand(t, h, w),
        hh.view(1, h, 1).expand(t, h, w),
        ww.view(1, 1, w).expand(t, h, w),
    ]).reshape(3, -1)


def get_rope_index(
    args: ModelArgs,
    input_ids: torch.Tensor,
    image_grid_thw: torch.Tensor | None = None,
    video_grid_thw: torch.Tensor | None = None,
    second_per_grid_ts: torch.Tensor | list[float] | None = None,
    attention_mask: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Positions (3, B, T) for a batch of prompts, and each prompt's next text position (B,).

    Grids are consumed in batch order (all images of sample 0, then sample 1, ...), as the processor emits
    them. Padding (attention_mask == 0) gets position 0 and is skipped when laying out the grids.
    """
    batch, length = input_ids.shape
    merge = args.vision.spatial_merge_size
    images = iter(image_grid_thw.tolist() if image_grid_thw is not None else [])
    videos = iter(video_grid_thw.tolist() if video_grid_thw is not None else [])
    seconds = iter(torch.as_tensor(second_per_grid_ts).tolist() if second_per_grid_ts is not None else [])
    position_ids = torch.zeros(3, batch, length, dtype=torch.long)
    next_position = torch.zeros(batch, dtype=torch.long)
    ids_cpu = input_ids.cpu()
    mask_cpu = attention_mask.bool().cpu() if attention_mask is not None else None
    for b in range(batch):
        valid = mask_cpu[b] if mask_cpu is not None else torch.ones(length, dtype=torch.bool)
        ids = ids_cpu[b][valid].tolist()
        pieces, pos, i = [], 0, 0
        while i < len(ids):
            token = ids[i]
            if token in (args.image_token_id, args.video_token_id):
                j = i
                while j < len(ids) and ids[j] == token:
                    j += 1
                is_video = token == args.video_token_id
                grid = next(videos if is_video else images, None)
                if grid is None:
                    kind = "video" if is_video else "image"
                    raise ValueError(f"sample {b}: more {kind} pad runs than {kind}_grid_thw rows")
                interval = args.vision.tokens_per_second * next(seconds, 1.0) if is_video else 1.0
                grid_pos = vision_grid_positions(pos, grid, merge, interval)
                if grid_pos.shape[1] != j - i:
                    raise ValueError(f"sample {b}: {j - i} pad tokens but grid {grid} gives {grid_pos.shape[1]}")
                pieces.append(grid_pos)
                pos += max(grid[1], grid[2]) // merge
                i = j
            else:
                j = i
                while j < len(ids) and ids[j] not in (args.image_token_id, args.video_token_id):
                    j += 1
                pieces.append(torch.arange(pos, pos + j - i).expand(3, -1))
                pos += j - i
                i = j
        if pieces:
            laid = torch.cat(pieces, dim=1)
            position_ids[:, b, valid] = laid
            next_position[b] = laid.max() + 1
    return position_ids.to(input_ids.device), next_position.to(input_ids.device)


def text_positions(start: torch.Tensor, length: int) -> torch.Tensor:
    """(3, B, length) positions of text continuing at `start` (B,)."""
    pos = start.view(-1, 1) + torch.arange(length, device=start.device)
    return pos.unsqueeze(0).expand(3, -1, -1)
