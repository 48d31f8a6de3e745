"""Specification of tools/make_tiny_checkpoint.py: what the written folder contains and how it loads."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch
from safetensors.torch import load_file
from transformers import (AutoProcessor, AutoTokenizer, Qwen2_5_VLForConditionalGeneration,
                          Qwen2_5_VLProcessor)
from transformers.utils import is_torchvision_available

from tools.make_tiny_checkpoint import (DEFAULT_MAX_PIXELS, DEFAULT_MIN_PIXELS, DEFAULT_VIDEO_MAX_PIXELS,
                                        DEFAULT_VIDEO_MIN_PIXELS, INIT_STD, NON_SPECIAL_ADDED_TOKENS,
                                        SPECIAL_TOKENS, main, make_tiny_checkpoint)
from torchplex.data.processing import load_processor
from torchplex.models.qwen2_5_vl.args import ModelArgs, get_flavor


def _safetensors_state(folder) -> dict[str, torch.Tensor]:
    state: dict[str, torch.Tensor] = {}
    for shard in sorted(folder.glob("*.safetensors")):
        state.update(load_file(shard))
    return state


@pytest.fixture(scope="module")
def tiny_model(tiny_ckpt):
    return Qwen2_5_VLForConditionalGeneration.from_pretrained(tiny_ckpt).eval()


def test_tokenizer_loads_with_2048_tokens(tiny_ckpt):
    tokenizer = AutoTokenizer.from_pretrained(tiny_ckpt)
    assert type(tokenizer).__name__ == "Qwen2Tokenizer"
    assert len(tokenizer) == 2048


def test_qwen_added_tokens_follow_the_bpe_vocab_in_qwen_order(tiny_ckpt):
    tokenizer = AutoTokenizer.from_pretrained(tiny_ckpt)
    added = SPECIAL_TOKENS + NON_SPECIAL_ADDED_TOKENS
    first = len(tokenizer) - len(added)
    assert tokenizer.convert_tokens_to_ids(list(added)) == list(range(first, len(tokenizer)))
    assert (tokenizer.eos_token, tokenizer.pad_token) == ("<|im_end|>", "<|endoftext|>")


def test_decoding_skips_specials_but_keeps_tool_and_fim_tokens(tiny_ckpt):
    tokenizer = AutoTokenizer.from_pretrained(tiny_ckpt)
    text = "".join(SPECIAL_TOKENS) + "red" + "".join(NON_SPECIAL_ADDED_TOKENS)
    assert tokenizer.decode(tokenizer(text).input_ids, skip_special_tokens=True) == \
        "red" + "".join(NON_SPECIAL_ADDED_TOKENS)


def test_special_tokens_map_to_config_ids(tiny_ckpt):
    tokenizer = AutoTokenizer.from_pretrained(tiny_ckpt)
    config = json.loads((tiny_ckpt / "config.json").read_text())
    expected = {"image_token_id": "<|image_pad|>", "video_token_id": "<|video_pad|>",
                "vision_start_token_id": "<|vision_start|>", "vision_end_token_id": "<|vision_end|>",
                "bos_token_id": "<|endoftext|>", "eos_token_id": "<|im_end|>", "pad_token_id": "<|endoftext|>"}
    for key, token in expected.items():
        assert config[key] == tokenizer.convert_tokens_to_ids(token), key
    generation = json.loads((tiny_ckpt / "generation_config.json").read_text())
    assert generation["eos_token_id"] == [tokenizer.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>")]


def test_tokenizer_round_trips_prompt_text_and_keeps_specials_whole(tiny_ckpt):
    tokenizer = AutoTokenizer.from_pretrained(tiny_ckpt)
    text = ("How many blue squares are in the top left?\n<think>\nI count 3, so 3 + 4 = 7.\n</think>\n"
            "<answer>7</answer>")
    assert tokenizer.decode(tokenizer(text).input_ids) == text
    # byte-level BPE: text outside the corpus still round-trips
    assert tokenizer.decode(tokenizer("Ünïcödé ✓ 42").input_ids) == "Ünïcödé ✓ 42"
    for token in SPECIAL_TOKENS + NON_SPECIAL_ADDED_TOKENS:
        assert tokenizer(f"a {token} b").input_ids.count(tokenizer.convert_tokens_to_ids(token)) == 1, token


def test_config_is_the_debug_flavor_with_vocab_rounded_to_64(tiny_ckpt):
    args = ModelArgs.from_hf_dir(tiny_ckpt)
    flavor = get_flavor("debug")
    assert args.vision == flavor.vision
    assert dataclasses.replace(args.text, vocab_size=flavor.text.vocab_size) == flavor.text
    assert args.text.vocab_size % 64 == 0
    assert args.text.vocab_size >= len(AutoTokenizer.from_pretrained(tiny_ckpt))


def test_model_loads_in_float32_with_sane_init(tiny_model):
    params = dict(tiny_model.named_parameters())
    assert all(p.dtype == torch.float32 for p in params.values())
    norms = [p for name, p in params.items() if "norm" in name or "ln_q" in name]
    assert norms and all(torch.equal(p, torch.ones_like(p)) for p in norms)
    embed = tiny_model.get_input_embeddings().weight
    assert abs(embed.std().item() - INIT_STD) < 0.1 * INIT_STD
    biases = [p for name, p in params.items() if name.endswith(".bias")]
    assert biases and all(p.abs().max() > 0 for p in biases)  # non-zero, so a loader dropping one fails


def test_tied_checkpoint_stores_no_lm_head(tiny_ckpt, tiny_model):
    assert "lm_head.weight" not in _safetensors_state(tiny_ckpt)
    assert tiny_model.lm_head.weight.data_ptr() == tiny_model.get_input_embeddings().weight.data_ptr()


def test_untied_checkpoint_has_its_own_lm_head_and_window(tiny_ckpt_untied):
    state = _safetensors_state(tiny_ckpt_untied)
    assert not torch.equal(state["lm_head.weight"], state["model.embed_tokens.weight"])
    args = ModelArgs.from_hf_dir(tiny_ckpt_untied)
    assert (args.text.tie_word_embeddings, args.vision.window_size) == (False, 112)


def test_window_size_must_be_a_multiple_of_patch_times_merge(tmp_path):
    with pytest.raises(ValueError, match="window_size 50"):
        make_tiny_checkpoint(tmp_path, window_size=50)


def test_cli_writes_sharded_index_with_weights_identical_to_single_file(tiny_ckpt, tmp_path, capsys):
    out = tmp_path / "sharded"
    main(["--output", str(out), "--seed", "0", "--max-shard-size", "1MB"])
    summary = capsys.readouterr().out.strip().splitlines()[-1]
    assert str(out) in summary and "vocab=2048" in summary and "sharded" in summary
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) > 1
    assert not (out / "model.safetensors").exists()
    single, sharded = _safetensors_state(tiny_ckpt), _safetensors_state(out)
    assert single.keys() == sharded.keys() == index["weight_map"].keys()
    assert all(torch.equal(single[k], sharded[k]) for k in single)
    loaded = Qwen2_5_VLForConditionalGeneration.from_pretrained(out).state_dict()
    reference = Qwen2_5_VLForConditionalGeneration.from_pretrained(tiny_ckpt).state_dict()
    assert all(torch.equal(loaded[k], reference[k]) for k in reference)


def test_seed_changes_weights_but_not_tokenizer(tiny_ckpt, tmp_path):
    other = make_tiny_checkpoint(tmp_path, seed=1).path
    assert (other / "tokenizer.json").read_text() == (tiny_ckpt / "tokenizer.json").read_text()
    a, b = _safetensors_state(tiny_ckpt), _safetensors_state(other)
    assert not torch.equal(a["model.embed_tokens.weight"], b["model.embed_tokens.weight"])


def test_image_and_video_processor_configs_carry_pixel_budgets(tiny_ckpt):
    image_processor = load_processor(tiny_ckpt).image_processor  # what the trainer loads, with or without torchvision
    assert (image_processor.size.shortest_edge, image_processor.size.longest_edge) == (DEFAULT_MIN_PIXELS,
                                                                                       DEFAULT_MAX_PIXELS)
    assert (image_processor.patch_size, image_processor.merge_size, image_processor.temporal_patch_size) == (14, 2, 2)
    video = json.loads((tiny_ckpt / "video_preprocessor_config.json").read_text())
    assert video["video_processor_type"] == "Qwen2VLVideoProcessor"
    assert video["size"] == {"shortest_edge": DEFAULT_VIDEO_MIN_PIXELS, "longest_edge": DEFAULT_VIDEO_MAX_PIXELS}


def test_auto_processor_loads_when_torchvision_is_installed(tiny_ckpt):
    # transformers 5 builds Qwen's video processor on torchvision only and AutoProcessor always
    # loads it (huggingface/transformers#48558); torchplex.data.processing.load_processor covers
    # the torchvision-free case.
    if is_torchvision_available():
        assert isinstance(AutoProcessor.from_pretrained(tiny_ckpt), Qwen2_5_VLProcessor)
    else:
        with pytest.raises(ImportError, match="[Tt]orchvision"):
            AutoProcessor.from_pretrained(tiny_ckpt)


# ---- published geometries (tools/make_tiny_checkpoint.py --size 7B --full-vocab ...) -----------------------------
QWEN_IDS = {"<|endoftext|>": 151643, "<|im_start|>": 151644, "<|im_end|>": 151645, "<|vision_start|>": 151652,
            "<|vision_end|>": 151653, "<|image_pad|>": 151655, "<|video_pad|>": 151656, "<tool_call>": 151657,
            "<|file_sep|>": 151664}  # Qwen/Qwen2.5-VL-7B-Instruct's tokenizer.json


@pytest.mark.parametrize("size, vocab", [("3B", 151936), ("7B", 152064)])
def test_full_vocab_checkpoint_has_qwens_token_ids_and_the_published_vocab(tmp_path, size, vocab):
    ckpt = make_tiny_checkpoint(tmp_path, size=size, full_vocab=True, weights=False, mean_response=256)
    tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    assert len(tokenizer) == 151665 and ckpt.vocab_size == vocab
    assert {t: tokenizer.convert_tokens_to_ids(t) for t in QWEN_IDS} == QWEN_IDS
    args = ModelArgs.from_hf_dir(tmp_path)
    assert (args.text.vocab_size, args.image_token_id, args.eos_token_id) == (vocab, 151655, 151645)
    assert dataclasses.replace(args.text, vocab_size=0) == dataclasses.replace(get_flavor(size).text, vocab_size=0)
    # the published processor budgets, and the text round-trips through the real-size tokenizer
    image = json.loads((tmp_path / "preprocessor_config.json").read_text())
    assert (image["size"]["shortest_edge"], image["size"]["longest_edge"]) == (56 * 56, 28 * 28 * 16384)
    ids = tokenizer("How many circles? <answer>3</answer>").input_ids
    assert tokenizer.decode(ids) == "How many circles? <answer>3</answer>" and max(ids) < 151643
    # Qwen's two stop tokens first, then vocab / 256 ids for long-tailed random responses
    eos = json.loads((tmp_path / "generation_config.json").read_text())["eos_token_id"]
    assert eos[:2] == [151645, 151643] and len(eos) == 2 + round(vocab / 256) and eos[-1] == vocab - 1


def test_native_bf16_weights_load_the_same_in_transformers_and_torchplex(tmp_path):
    """--device/--dtype: the native model's init written by save_hf_weights (HF names, bf16), random biases too."""
    from torchplex.models.qwen2_5_vl.build import build_model

    make_tiny_checkpoint(tmp_path, dtype="bfloat16", device="cpu", seed=3)
    state = _safetensors_state(tmp_path)
    assert {t.dtype for t in state.values()} == {torch.bfloat16}
    native = build_model(hf_dir=tmp_path, dtype=torch.bfloat16)
    hf = Qwen2_5_VLForConditionalGeneration.from_pretrained(tmp_path, dtype=torch.bfloat16)
    assert torch.equal(native.layers[1].attention.wq.bias, hf.model.language_model.layers[1].self_attn.q_proj.bias)
    assert native.layers[1].attention.wq.bias.abs().sum() > 0  # random, not zero
    assert abs(float(native.tok_embeddings.weight.float().std()) - INIT_STD) < 0.002


def test_trainer_stops_on_the_checkpoints_generation_config_eos_ids(tmp_path):
    from torchplex.train import stop_token_ids

    make_tiny_checkpoint(tmp_path, weights=False, mean_response=64)
    eos = json.loads((tmp_path / "generation_config.json").read_text())["eos_token_id"]
    tokenizer = AutoTokenizer.from_pretrained(tmp_path)
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert stop_token_ids(tmp_path, im_end) == eos and len(eos) > 2
    (tmp_path / "generation_config.json").unlink()
    assert stop_token_ids(tmp_path, im_end) == [im_end]
