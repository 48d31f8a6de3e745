"""Shared fixtures: tiny random-weight Qwen2.5-VL checkpoints, built once per test session (~0.3 s each
after imports) by `tools/make_tiny_checkpoint.py`."""

from __future__ import annotations

import sys
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:  # `tools` is a plain folder at the repo root, not an installed package
    sys.path.insert(0, str(REPO_ROOT))

from tools.make_tiny_checkpoint import make_tiny_checkpoint  # noqa: E402

# One intra-op thread: with two, OpenMP's workers spin-wait for each other on the 2-core CI machine and the tiny
# model's ops run about 10x slower (measured); spawned test processes set the same.
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory) -> Path:
    """`debug` flavor, seed 0, tied embeddings, vision window 56 px, one `model.safetensors`."""
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny_ckpt"), size="debug", seed=0).path


@pytest.fixture(scope="session")
def tiny_ckpt_untied(tmp_path_factory) -> Path:
    """Like `tiny_ckpt` but with a separate `lm_head` and a 112 px vision window (4x4 merged patches)."""
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny_ckpt_untied"), size="debug", seed=0,
                                tie_word_embeddings=False, window_size=112).path


@pytest.fixture(scope="session")
def tiny_ckpt_kv4(tmp_path_factory) -> Path:
    """Like `tiny_ckpt` with 4 K/V heads (one per query head): 2 per rank under TP 2, where the `debug` flavor's 2
    leave each rank one, which a cache laid out for the model's global head count would still fill by broadcasting."""
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny_ckpt_kv4"), size="debug", seed=0, num_kv_heads=4).path


@dataclass
class GRPOAssets:
    """Three encoded image prompts (one with two images of different sizes), an actor moved slightly away from
    the checkpoint, and the frozen reference at the checkpoint."""

    processor: object
    prompts: list
    actor: object
    reference: object
    eos_id: int


@pytest.fixture(scope="module")
def grpo_assets(tiny_ckpt) -> GRPOAssets:
    import torch
    from PIL import Image

    from torchplex.data.processing import encode_prompt, load_processor
    from torchplex.models.qwen2_5_vl.build import build_model

    processor = load_processor(tiny_ckpt)
    rng = torch.Generator().manual_seed(0)

    def image(w, h):
        return Image.fromarray(torch.randint(0, 255, (h, w, 3), generator=rng, dtype=torch.uint8).numpy())

    prompts = [encode_prompt(processor, "How many circles?", images=[image(56, 56)]),
               encode_prompt(processor, "Colour of the square?", images=[image(112, 84)]),
               encode_prompt(processor, "Left or right?", images=[image(84, 56), image(56, 112)])]
    actor = build_model(hf_dir=tiny_ckpt)
    with torch.no_grad():  # move away from the checkpoint so actor and reference differ
        for p in actor.parameters():
            p.add_(torch.randn_like(p) * 0.01)
    reference = build_model(hf_dir=tiny_ckpt).eval().requires_grad_(False)
    return GRPOAssets(processor, prompts, actor, reference, processor.tokenizer.convert_tokens_to_ids("<|im_end|>"))


@pytest.fixture(scope="module")
def rollout_prompts(tiny_ckpt):
    """(processor, the checkpoint's model in eval mode, four encoded prompts: one image, text only, another image
    size, two images of different sizes; the <|im_end|> id), one per test module."""
    from PIL import Image

    from torchplex.data.processing import encode_prompt, load_processor
    from torchplex.models.qwen2_5_vl.build import build_model

    processor = load_processor(tiny_ckpt)
    model = build_model(hf_dir=tiny_ckpt).eval()
    rng = torch.Generator().manual_seed(0)

    def image(w, h):
        return Image.fromarray(torch.randint(0, 255, (h, w, 3), generator=rng, dtype=torch.uint8).numpy())

    prompts = [
        encode_prompt(processor, "How many circles are in the image?", images=[image(56, 56)]),
        encode_prompt(processor, "Say something about the colour red and the number 3."),
        encode_prompt(processor, "Which is left, the square or the circle?", images=[image(84, 112)]),
        encode_prompt(processor, "Compare.", images=[image(56, 84), image(112, 56)]),
    ]
    return processor, model, prompts, processor.tokenizer.convert_tokens_to_ids("<|im_end|>")
