"""Build a Qwen2.5-VL model the torchtitan way: on the meta device, then materialised once, then filled."""

from __future__ import annotations

from pathlib import Path

import torch

from .args import ModelArgs
from .model import Qwen2_5_VLModel
from .weights import load_hf_weights


def build_model(args: ModelArgs | None = None, *, hf_dir: str | Path | None = None, device="cpu",
                dtype: torch.dtype = torch.float32, seed: int = 0, parallelize=None) -> Qwen2_5_VLModel:
    """A model whose weights come from `hf_dir` (HF safetensors) or, without it, from a seeded random init.

    `parallelize(model)` (TP/FSDP2) runs on the meta-device model before any storage exists, so nothing large
    is ever allocated twice.
    """
    if args is None:
        if hf_dir is None:
            raise ValueError("build_model needs ModelArgs or an HF checkpoint folder")
        args = ModelArgs.from_hf_dir(hf_dir)
    with torch.device("meta"):
        model = Qwen2_5_VLModel(args)
    model = model.to(dtype=dtype)
    if parallelize is not None:
        model = parallelize(model)
    model.to_empty(device=device)
    if hf_dir is not None:
        load_hf_weights(model, hf_dir)
    else:
        model.init_weights(generator=torch.Generator(device=device).manual_seed(seed))
    return model
