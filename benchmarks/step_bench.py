"""Random-weight models and prompts shared by the benchmarks that build their own model rather than run
`./run_train.sh`: decode_bench.py (one decode step), sglang_bench.py and probes/sglang_overlap.py (the SGLang backend),
and the multi-GPU ones (multi_gpu_step.py, disagg_bench.py, weight_sharing_gpu.py). Whole GRPO steps are measured
through the trainer instead (scale_bench.py, recipes.py); this module keeps its name because those scripts import it.
"""

from __future__ import annotations

import math
from types import SimpleNamespace

import torch

from torchplex.models.qwen2_5_vl.args import get_flavor
from torchplex.models.qwen2_5_vl.model import Qwen2_5_VLModel


def make_prompt(args, prompt_tokens: int, seed: int):
    """Chat-like prompt: a few text tokens, one square image, a question: at least prompt_tokens tokens (the
    smallest square grid of merged patches that reaches it; 1024 -> 1050)."""
    v = args.vision
    side = max(2, math.ceil((prompt_tokens - 26) ** 0.5)) * v.spatial_merge_size  # patches per side
    grid = torch.tensor([[1, side, side]])
    g = torch.Generator().manual_seed(seed)
    patch_dim = v.in_channels * v.temporal_patch_size * v.patch_size ** 2
    pixels = torch.randn(side * side, patch_dim, generator=g)
    text = lambda n: torch.randint(10, 1000, (n,), generator=g).tolist()
    merged = side * side // v.spatial_merge_size ** 2
    ids = text(12) + [args.vision_start_token_id] + [args.image_token_id] * merged + [args.vision_end_token_id] + text(12)
    return SimpleNamespace(input_ids=torch.tensor(ids), pixel_values=pixels, image_grid_thw=grid,
                           pixel_values_videos=None, video_grid_thw=None, second_per_grid_ts=None)


def build(args, dtype, device, seed):
    with torch.device("meta"):
        model = Qwen2_5_VLModel(args)
    model = model.to(dtype).to_empty(device=device)
    model.init_weights(generator=torch.Generator(device=device).manual_seed(seed))
    return model


def bench_flavor(geometry: str, vision_depth: int = 0):
    """ModelArgs of a named flavor for benchmarks: the debug flavor gets token ids inside its small vocabulary, and
    `vision_depth` > 0 cuts the vision tower to that many blocks (the last one full-attention)."""
    args = get_flavor(geometry)
    if geometry == "debug":
        args = args.with_token_ids(image_token_id=2000, video_token_id=2001, vision_start_token_id=2002,
                                   vision_end_token_id=2003)
    if vision_depth:
        args.vision.depth = vision_depth
        args.vision.fullatt_block_indexes = (vision_depth - 1,)
    return args


def sync(device):
    if device.type == "cuda":
        torch.cuda.synchronize()


def long_tail_stops(vocab: int, mean_response: int) -> list[int]:
    """Stop tokens that make random-weight responses end after a roughly geometric number of tokens with the given
    mean (most short, a tail running to max_new_tokens), like RL rollouts where a few samples set the step's
    length. 0: no stop tokens, every response runs to max_new_tokens."""
    if mean_response <= 0:
        return []
    count = max(1, round(vocab / mean_response))
    return list(range(vocab - count, vocab))


class NullTokenizer:
    """Random-weight models produce no answers worth scoring: every reward is 0 (the KL term still trains)."""

    def batch_decode(self, ids, skip_special_tokens=True):
        return [""] * len(ids)
