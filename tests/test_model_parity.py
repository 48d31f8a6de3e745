"""Native Qwen2.5-VL vs transformers' Qwen2_5_VLForConditionalGeneration, same random tiny weights, fp32 CPU."""

import pytest
import torch
from hf_reference import mm_token_type_ids
from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

from torchplex.models.qwen2_5_vl.args import get_flavor
from torchplex.models.qwen2_5_vl.model import Qwen2_5_VLModel
from torchplex.models.qwen2_5_vl.rope_index import get_rope_index
from torchplex.models.qwen2_5_vl.state_dict_adapter import Qwen2_5_VLStateDictAdapter

RTOL = 1e-4
IMG, VID, VS, VE = 2000, 2001, 2002, 2003
PATCH = 3 * 2 * 14 * 14


def tiny_args(tie=True, window_size=56):
    args = get_flavor("debug").with_token_ids(image_token_id=IMG, video_token_id=VID, vision_start_token_id=VS,
                                              vision_end_token_id=VE, bos_token_id=2004, eos_token_id=2005)
    args.text.tie_word_embeddings = tie
    args.vision.window_size = window_size
    return args


def build_pair(args, seed=0):
    torch.manual_seed(seed)
    cfg = Qwen2_5_VLConfig(**args.to_hf_config())
    cfg._attn_implementation = "eager"
    hf = Qwen2_5_VLForConditionalGeneration(cfg).eval()
    with torch.no_grad():  # HF's init leaves norms at 1 and biases at 0; perturb so every weight matters
        for p in hf.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    native = Qwen2_5_VLModel(args)
    native.load_state_dict(Qwen2_5_VLStateDictAdapter(args).from_hf(hf.state_dict()))
    return hf, native.eval()


def image_run(grid):
    t, h, w = grid
    return [VS] + [IMG] * (t * h * w // 4) + [VE]


def video_run(grid):
    t, h, w = grid
    return [VS] + [VID] * (t * h * w // 4) + [VE]


def rel_err(a, b):
    return ((a - b).abs().max() / b.abs().max()).item()


def native_logits(native, args, input_ids, attention_mask=None, image=None, video=None):
    image_embeds = native.encode_vision(*image) if image else None
    video_embeds = native.encode_vision(*video[:2]) if video else None
    pos, _ = get_rope_index(args, input_ids, image[1] if image else None, video[1] if video else None,
                            video[2] if video else None, attention_mask)
    hidden = native(input_ids, pos, image_embeds=image_embeds, video_embeds=video_embeds,
                    attention_mask=attention_mask)
    return native.logits(hidden)


def hf_logits(hf, input_ids, attention_mask=None, image=None, video=None):
    # mm_token_type_ids: without them transformers 5.x silently uses 1-D positions (issue 16 defect 4)
    kwargs = dict(input_ids=input_ids, attention_mask=attention_mask,
                  mm_token_type_ids=mm_token_type_ids(input_ids, IMG, VID))
    if image:
        kwargs.update(pixel_values=image[0], image_grid_thw=image[1])
    if video:
        kwargs.update(pixel_values_videos=video[0], video_grid_thw=video[1], second_per_grid_ts=video[2])
    return hf(**kwargs).logits


def pixels(grids):
    grids = torch.tensor(grids)
    return torch.randn(int(grids.prod(-1).sum()), PATCH), grids


@pytest.mark.parametrize("tie", [True, False])
def test_text_only(tie):
    args = tiny_args(tie=tie)
    hf, native = build_pair(args)
    ids = torch.randint(0, 1900, (2, 23))
    with torch.no_grad():
        assert rel_err(native_logits(native, args, ids), hf_logits(hf, ids)) < RTOL


@pytest.mark.parametrize("window_size", [56, 112])
def test_one_image(window_size):
    args = tiny_args(window_size=window_size)
    hf, native = build_pair(args)
    torch.manual_seed(1)
    image = pixels([[1, 12, 16]])
    ids = torch.tensor([[5, 6] + image_run((1, 12, 16)) + [7, 8, 9]])
    with torch.no_grad():
        assert rel_err(native_logits(native, args, ids, image=image), hf_logits(hf, ids, image=image)) < RTOL


def test_two_images_of_different_sizes():
    args = tiny_args(tie=False)
    hf, native = build_pair(args)
    torch.manual_seed(2)
    image = pixels([[1, 8, 12], [1, 6, 4]])
    ids = torch.tensor([[5] + image_run((1, 8, 12)) + [7, 8] + image_run((1, 6, 4)) + [9, 10, 11]])
    with torch.no_grad():
        assert rel_err(native_logits(native, args, ids, image=image), hf_logits(hf, ids, image=image)) < RTOL


def test_video():
    args = tiny_args()
    hf, native = build_pair(args)
    torch.manual_seed(3)
    pix, grid = pixels([[3, 8, 8]])
    # Integral seconds: transformers 5.12 and 5.17 truncate second_per_grid_ts to an int, 5.24 does not
    # (hf_reference.py).
    video = (pix, grid, torch.tensor([2.0]))
    ids = torch.tensor([[5, 6] + video_run((3, 8, 8)) + [7, 8, 9, 10]])
    with torch.no_grad():
        assert rel_err(native_logits(native, args, ids, video=video), hf_logits(hf, ids, video=video)) < RTOL


def test_padded_batch_with_images():
    """Two prompts of different lengths, left-padded as for generation, each with an image."""
    args = tiny_args()
    hf, native = build_pair(args)
    torch.manual_seed(4)
    image = pixels([[1, 4, 8], [1, 8, 4]])
    a = [5, 6] + image_run((1, 4, 8)) + [7, 8, 9, 10, 11, 12]
    b = [5] + image_run((1, 8, 4)) + [7]
    width = max(len(a), len(b))
    ids = torch.tensor([[0] * (width - len(a)) + a, [0] * (width - len(b)) + b])
    mask = torch.tensor([[0] * (width - len(a)) + [1] * len(a), [0] * (width - len(b)) + [1] * len(b)])
    with torch.no_grad():
        ours = native_logits(native, args, ids, attention_mask=mask, image=image)
        ref = hf_logits(hf, ids, attention_mask=mask, image=image)
    valid = mask.bool()
    assert rel_err(ours[valid], ref[valid]) < RTOL
