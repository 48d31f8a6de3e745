"""VisionCache on an FSDP2-sharded tower: every rank must make the same number of encode calls.

Each `encode_vision` call of a sharded model all-gathers the root's and the tower's parameters, so ranks that
encode their prompts in different numbers of calls leave one waiting in a collective the other never joins. The
batched encoding split the prompts by their patch count, which differs between ranks' data (image sizes); here
rank 0's two small images fit one batch and rank 1's two larger ones do not.
"""

from __future__ import annotations

import pytest
import torch
from PIL import Image

from distributed_helpers import free_port, init_gloo, spawn
from torchplex.data.processing import encode_prompt, load_processor
from torchplex.models.qwen2_5_vl.build import build_model
from torchplex.models.qwen2_5_vl.parallelize import apply_fsdp

TIMEOUT_S = 120


def rank_prompts(ckpt, rank):
    processor = load_processor(ckpt)
    rng = torch.Generator().manual_seed(rank)
    image = lambda w, h: Image.fromarray(torch.randint(0, 255, (h, w, 3), generator=rng, dtype=torch.uint8).numpy())
    size = (56, 56) if rank == 0 else (112, 112)  # 16 or 64 patches each
    return [encode_prompt(processor, "How many circles?", images=[image(*size)]),
            encode_prompt(processor, "Colour of the square?", images=[image(*size)])]


def worker(rank: int, world_size: int, port: int, ckpt, out_dir) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    from torchplex.runtime import decomposition

    init_gloo(rank, world_size, port)
    try:
        decomposition.BATCH_PATCHES = 64  # rank 0: one batch of 2 x 16 patches; rank 1: 2 x 64, two batches
        model = build_model(hf_dir=ckpt).eval().requires_grad_(False)
        apply_fsdp(model, init_device_mesh("cpu", (world_size,)), torch.float32, torch.float32)
        embeds = decomposition.VisionCache().get_many(model, rank_prompts(ckpt, rank), "image")
        torch.save([e.clone() for e in embeds], out_dir / f"rank{rank}.pt")
    finally:
        torch.distributed.destroy_process_group()


@pytest.mark.slow
def test_ranks_with_different_image_sizes_encode_in_step(tiny_ckpt, tmp_path):
    spawn(worker, 2, (free_port(), tiny_ckpt, tmp_path), TIMEOUT_S, "FSDP2 frozen-tower encodes")
    model = build_model(hf_dir=tiny_ckpt).eval()
    for rank in (0, 1):
        got = torch.load(tmp_path / f"rank{rank}.pt")
        with torch.no_grad():
            for p, e in zip(rank_prompts(tiny_ckpt, rank), got, strict=True):
                torch.testing.assert_close(e, model.encode_vision(p.pixel_values, p.image_grid_thw),
                                           rtol=1e-5, atol=1e-5)
