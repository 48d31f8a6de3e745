"""Specification of torchplex.data.processing: chat template, vision token expansion, video layout."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
from hf_reference import hf_prompt_kwargs
from PIL import Image
from transformers import Qwen2_5_VLForConditionalGeneration, Qwen2_5_VLProcessor
from transformers.image_utils import OPENAI_CLIP_MEAN, OPENAI_CLIP_STD

from torchplex.data.processing import PromptInputs, build_messages, encode_prompt, load_processor

PATCH, MERGE, TEMPORAL = 14, 2, 2
PIXELS_PER_PATCH = 3 * TEMPORAL * PATCH * PATCH


def _image(height: int, width: int, seed: int) -> Image.Image:
    rng = np.random.default_rng(seed)
    return Image.fromarray(rng.integers(0, 256, (height, width, 3), dtype=np.uint8))


def _block_lengths(ids: list[int], start_id: int, end_id: int) -> list[int]:
    """Number of tokens between each vision_start / vision_end pair."""
    starts = [i for i, t in enumerate(ids) if t == start_id]
    ends = [i for i, t in enumerate(ids) if t == end_id]
    return [e - s - 1 for s, e in zip(starts, ends)]


@pytest.fixture(scope="module")
def processor(tiny_ckpt):
    return load_processor(tiny_ckpt)


@pytest.fixture(scope="module")
def model(tiny_ckpt):
    return Qwen2_5_VLForConditionalGeneration.from_pretrained(tiny_ckpt).eval()


def _ids(processor, *tokens: str) -> list[int]:
    return processor.tokenizer.convert_tokens_to_ids(list(tokens))


def test_load_processor_returns_a_qwen2_5_vl_processor(processor):
    assert isinstance(processor, Qwen2_5_VLProcessor)
    assert processor.image_token_id == processor.tokenizer.convert_tokens_to_ids("<|image_pad|>")
    assert processor.video_token_id == processor.tokenizer.convert_tokens_to_ids("<|video_pad|>")


def test_load_processor_names_the_folder_and_missing_files(tmp_path):
    (tmp_path / "config.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match=f"{tmp_path}.*tokenizer_config.json.*preprocessor_config.json"):
        load_processor(tmp_path)
    with pytest.raises(FileNotFoundError, match="nowhere"):
        load_processor(tmp_path / "nowhere")


def test_chat_template_renders_qwen_chatml(processor):
    rendered = processor.apply_chat_template(build_messages("How many?", num_images=1), tokenize=False,
                                             add_generation_prompt=True)
    assert rendered == ("<|im_start|>system\nYou are a helpful assistant.<|im_end|>\n"
                        "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>How many?<|im_end|>\n"
                        "<|im_start|>assistant\n")


def test_chat_template_with_system_video_and_finished_turn(processor):
    messages = build_messages("Describe.", num_images=1, num_videos=1, system="Be brief.")
    messages.append({"role": "assistant", "content": "<answer>2</answer>"})
    rendered = processor.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    assert rendered == ("<|im_start|>system\nBe brief.<|im_end|>\n"
                        "<|im_start|>user\n<|vision_start|><|image_pad|><|vision_end|>"
                        "<|vision_start|><|video_pad|><|vision_end|>Describe.<|im_end|>\n"
                        "<|im_start|>assistant\n<answer>2</answer><|im_end|>\n")


def test_text_only_prompt_is_the_tokenized_template(processor):
    inputs = encode_prompt(processor, "What is 2 + 3?", system="Answer with a number.")
    expected = ("<|im_start|>system\nAnswer with a number.<|im_end|>\n<|im_start|>user\nWhat is 2 + 3?<|im_end|>\n"
                "<|im_start|>assistant\n")
    assert inputs.input_ids.tolist() == processor.tokenizer(expected).input_ids
    assert inputs.input_ids.dtype == torch.long and inputs.input_ids.dim() == 1
    vision_fields = [f.name for f in dataclasses.fields(PromptInputs) if f.name != "input_ids"]
    assert all(getattr(inputs, name) is None for name in vision_fields)


def test_image_prompt_has_one_pad_per_merged_patch(processor):
    # 60x90 rounds to 56x84 px (multiples of patch*merge = 28) = 4x6 patches = 6 merged tokens.
    inputs = encode_prompt(processor, "How many red circles?", images=[_image(60, 90, seed=0)])
    assert inputs.image_grid_thw.tolist() == [[1, 4, 6]]
    assert inputs.pixel_values.shape == (4 * 6, PIXELS_PER_PATCH)
    image_pad, start, end = _ids(processor, "<|image_pad|>", "<|vision_start|>", "<|vision_end|>")
    ids = inputs.input_ids.tolist()
    assert ids.count(image_pad) == 1 * 4 * 6 // MERGE ** 2
    assert _block_lengths(ids, start, end) == [6]
    assert (inputs.pixel_values_videos, inputs.video_grid_thw, inputs.second_per_grid_ts) == (None, None, None)


def test_two_images_of_different_sizes_get_their_own_pad_blocks(processor):
    images = [_image(60, 90, seed=0), _image(200, 130, seed=1)]
    inputs = encode_prompt(processor, "Compare them.", images=images)
    # 200x130 -> 196x140 px = 27440 <= max 50176 px -> 14x10 patches = 35 merged tokens.
    assert inputs.image_grid_thw.tolist() == [[1, 4, 6], [1, 14, 10]]
    assert inputs.pixel_values.shape == (4 * 6 + 14 * 10, PIXELS_PER_PATCH)
    start, end = _ids(processor, "<|vision_start|>", "<|vision_end|>")
    assert _block_lengths(inputs.input_ids.tolist(), start, end) == [6, 35]


def test_image_pixels_are_exactly_the_image_processor_output(processor):
    images = [_image(60, 90, seed=0), _image(200, 130, seed=1)]
    reference = processor.image_processor(images=images, return_tensors="pt")
    inputs = encode_prompt(processor, "Compare them.", images=images)
    assert torch.equal(inputs.pixel_values, reference["pixel_values"])
    assert torch.equal(inputs.image_grid_thw, reference["image_grid_thw"])


def _reference_video_patches(frames: list[Image.Image]) -> torch.Tensor:
    """Qwen2-VL's video layout written out from its definition, for frames already at a multiple of 28
    (so resizing is the identity): normalise, pad to a multiple of T by repeating the last frame, then
    order patches (t, h-block, w-block, h-in-block, w-in-block) with features (C, T, p, p)."""
    video = torch.stack([torch.from_numpy(np.asarray(f, dtype=np.float32)).permute(2, 0, 1) for f in frames])
    video = (video / 255 - torch.tensor(OPENAI_CLIP_MEAN).view(3, 1, 1)) / torch.tensor(OPENAI_CLIP_STD).view(3, 1, 1)
    if len(frames) % TEMPORAL:
        video = torch.cat([video, video[-1:].expand(TEMPORAL - len(frames) % TEMPORAL, -1, -1, -1)])
    f, c, h, w = video.shape
    gt, gh, gw = f // TEMPORAL, h // PATCH, w // PATCH
    x = video.reshape(gt, TEMPORAL, c, gh // MERGE, MERGE, PATCH, gw // MERGE, MERGE, PATCH)
    x = x.permute(0, 3, 6, 4, 7, 2, 1, 5, 8)
    return x.reshape(gt * gh * gw, c * TEMPORAL * PATCH * PATCH)


def test_video_prompt_grid_tokens_and_timing(processor):
    frames = [_image(56, 84, seed=k) for k in range(5)]  # odd: padded to 6 frames -> 3 temporal steps
    inputs = encode_prompt(processor, "What moves?", videos=[frames], video_fps=4.0)
    assert inputs.video_grid_thw.tolist() == [[3, 4, 6]]
    assert inputs.pixel_values_videos.shape == (3 * 4 * 6, PIXELS_PER_PATCH)
    assert inputs.second_per_grid_ts.tolist() == [TEMPORAL / 4.0]
    video_pad, start, end = _ids(processor, "<|video_pad|>", "<|vision_start|>", "<|vision_end|>")
    ids = inputs.input_ids.tolist()
    assert ids.count(video_pad) == 3 * 4 * 6 // MERGE ** 2
    assert _block_lengths(ids, start, end) == [18]
    assert (inputs.pixel_values, inputs.image_grid_thw) == (None, None)


def test_video_pixels_follow_qwen_temporal_layout(processor):
    frames = [_image(56, 84, seed=k) for k in range(5)]
    inputs = encode_prompt(processor, "What moves?", videos=[frames])
    torch.testing.assert_close(inputs.pixel_values_videos, _reference_video_patches(frames), atol=1e-5, rtol=0)


def test_image_and_video_in_one_prompt(processor):
    inputs = encode_prompt(processor, "Same scene?", images=[_image(60, 90, seed=0)],
                           videos=[[_image(56, 84, seed=k) for k in range(4)]])
    start, end = _ids(processor, "<|vision_start|>", "<|vision_end|>")
    assert _block_lengths(inputs.input_ids.tolist(), start, end) == [6, 2 * 4 * 6 // MERGE ** 2]
    assert inputs.image_grid_thw.tolist() == [[1, 4, 6]] and inputs.video_grid_thw.tolist() == [[2, 4, 6]]


@torch.no_grad()
def test_transformers_forward_uses_the_image(processor, model):
    logits = []
    for seed in (0, 1):
        inputs = encode_prompt(processor, "How many?", images=[_image(60, 90, seed=seed)])
        out = model(**hf_prompt_kwargs(inputs, model.config.image_token_id, model.config.video_token_id))
        assert out.logits.shape == (1, inputs.input_ids.numel(), model.config.text_config.vocab_size)
        assert torch.isfinite(out.logits).all()
        logits.append(out.logits[0, -1])
    assert not torch.allclose(logits[0], logits[1])  # different pixels reach the last position


@torch.no_grad()
def test_transformers_forward_on_a_video_prompt(processor, model):
    inputs = encode_prompt(processor, "What moves?", videos=[[_image(56, 84, seed=k) for k in range(4)]])
    out = model(**hf_prompt_kwargs(inputs, model.config.image_token_id, model.config.video_token_id))
    assert out.logits.shape[:2] == (1, inputs.input_ids.numel())
    assert torch.isfinite(out.logits).all()
