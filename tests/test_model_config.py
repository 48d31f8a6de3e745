"""Issue 16 defect 3 (config fidelity): a checkpoint whose config.json transformers reads differently must not load
silently with other logits. Each variant below is the tiny checkpoint's config.json edited one way; our loader
(build_model) and transformers' own model load the same folder, and their fp32 logits on an image + video prompt
(passed to transformers with mm_token_type_ids, see hf_reference.py) agree to 1e-4 relative; or our loader
refuses the config naming the field, its value and the file."""

from __future__ import annotations

import json
import math

import pytest
import torch
from hf_reference import hf_prompt_kwargs
from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration
from transformers.activations import ACT2FN
from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import Qwen2_5_VLRotaryEmbedding

from torchplex.data.batching import collate, encode_visuals
from torchplex.data.processing import PromptInputs
from torchplex.models.activations import ACTIVATIONS
from torchplex.models.qwen2_5_vl.args import ModelArgs
from torchplex.models.qwen2_5_vl.build import build_model
from torchplex.models.qwen2_5_vl.hf_config import UnsupportedConfigError
from torchplex.models.qwen2_5_vl.rope_scaling import RopeScaling, text_inv_freq

RTOL = 1e-4
PATCH = 3 * 2 * 14 * 14  # channels x temporal patch x patch x patch


@pytest.fixture(scope="module")
def prompt(tiny_ckpt):
    """Text, one image (4x6 patches), text, one video (2 temporal grids of 4x6 patches, 1 s each), text. Built by
    hand rather than by the processor so that it is the same under every transformers version."""
    cfg = json.loads((tiny_ckpt / "config.json").read_text())
    start, end, img, vid = (cfg[k] for k in ("vision_start_token_id", "vision_end_token_id", "image_token_id",
                                             "video_token_id"))
    g = torch.Generator().manual_seed(0)
    text = lambda n: torch.randint(0, 1900, (n,), generator=g).tolist()  # noqa: E731
    ids = text(5) + [start] + [img] * 6 + [end] + text(4) + [start] + [vid] * 12 + [end] + text(6)
    return PromptInputs(input_ids=torch.tensor(ids), pixel_values=torch.randn(24, PATCH, generator=g),
                        image_grid_thw=torch.tensor([[1, 4, 6]]),
                        pixel_values_videos=torch.randn(48, PATCH, generator=g),
                        video_grid_thw=torch.tensor([[2, 4, 6]]), second_per_grid_ts=torch.tensor([1.0]))


def write_variant(base, out, edit) -> None:
    """`out`: the folder `base` with its config.json passed through `edit` (other files linked, not copied)."""
    out.mkdir()
    for f in base.iterdir():
        if f.name != "config.json":
            (out / f.name).symlink_to(f)
    cfg = json.loads((base / "config.json").read_text())
    edit(cfg)
    (out / "config.json").write_text(json.dumps(cfg))


def ours_logits(folder, prompt) -> torch.Tensor:
    model = build_model(hf_dir=folder).eval()
    batch = collate(model.args, [prompt])
    image, video = encode_visuals(model, batch)
    return model.logits(model(batch.input_ids, batch.position_ids, image_embeds=image, video_embeds=video))[0]


def transformers_logits(folder, prompt) -> torch.Tensor:
    hf = Qwen2_5_VLForConditionalGeneration.from_pretrained(folder, dtype=torch.float32).eval()
    return hf(**hf_prompt_kwargs(prompt, hf.config.image_token_id, hf.config.video_token_id)).logits[0]


def rel_err(a, b) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def _set(section, **values):
    def edit(cfg):
        (cfg[section] if section else cfg).update(values)
    return edit


def _drop(section, key):
    def edit(cfg):
        cfg[section].pop(key)
    return edit


def _rope(**values):
    def edit(cfg):
        cfg["text_config"]["rope_parameters"].update(values)
    return edit


def _legacy_rope_scaling(cfg):
    # Qwen's published 4.x spelling; transformers lets a non-empty rope_scaling replace rope_parameters.
    cfg["text_config"]["rope_scaling"] = {"type": "yarn", "factor": 2.0, "original_max_position_embeddings": 1024,
                                          "mrope_section": cfg["text_config"]["rope_parameters"]["mrope_section"]}


def _tie_in_text_config_only(cfg):
    cfg["tie_word_embeddings"] = False
    cfg["text_config"]["tie_word_embeddings"] = True


def _root_text_field_ignored(cfg):
    # With a text_config, transformers builds the text model from it alone: a stray root value is not read.
    cfg["text_config"].pop("rms_norm_eps")
    cfg["rms_norm_eps"] = 0.05


def _vision_rope_theta_at_top_level(cfg):
    # transformers moves a top-level rope_theta into rope_parameters when those do not set one
    cfg["vision_config"].pop("rope_parameters")
    cfg["vision_config"]["rope_theta"] = 3.0


VARIANTS = {
    "text_gelu": _set("text_config", hidden_act="gelu"),
    "text_gelu_pytorch_tanh": _set("text_config", hidden_act="gelu_pytorch_tanh"),
    "text_gelu_new": _set("text_config", hidden_act="gelu_new"),
    "vision_gelu_pytorch_tanh": _set("vision_config", hidden_act="gelu_pytorch_tanh"),
    "vision_quick_gelu": _set("vision_config", hidden_act="quick_gelu"),
    "rope_linear": _rope(rope_type="linear", factor=4.0),
    "rope_yarn": _rope(rope_type="yarn", factor=4.0, original_max_position_embeddings=2048),
    "rope_yarn_all_options": _rope(rope_type="yarn", factor=8.0, original_max_position_embeddings=64, beta_fast=16,
                                   beta_slow=2, mscale=1.0, mscale_all_dim=0.5, truncate=False),
    "rope_yarn_explicit_attention_factor": _rope(rope_type="yarn", factor=4.0, attention_factor=1.5),
    "legacy_rope_scaling_wins": _legacy_rope_scaling,
    "missing_rms_norm_eps": _drop("text_config", "rms_norm_eps"),
    "missing_tokens_per_second": _drop("vision_config", "tokens_per_second"),
    "vision_rope_theta_at_top_level": _vision_rope_theta_at_top_level,
    "tie_in_text_config_only": _tie_in_text_config_only,
    "root_text_field_ignored": _root_text_field_ignored,
}


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_config_variant_loads_with_transformers_logits(variant, tiny_ckpt, tmp_path, prompt):
    """Defect 3: each variant used to load with logits 1e-3..0.35 off transformers' (or, for the tie, not at all)."""
    write_variant(tiny_ckpt, tmp_path / variant, VARIANTS[variant])
    with torch.no_grad():
        ours, ref = ours_logits(tmp_path / variant, prompt), transformers_logits(tmp_path / variant, prompt)
    assert ours.shape == ref.shape
    assert rel_err(ours, ref) < RTOL


def _sliding(cfg):
    # saved configs carry an explicit all-full layer_types, which transformers keeps over use_sliding_window
    cfg["text_config"].pop("layer_types", None)
    cfg["text_config"].update(use_sliding_window=True, sliding_window=16, max_window_layers=2)


REFUSED = {
    "sliding_window": (_sliding, "text_config.use_sliding_window = True"),
    "layer_types": (_set("text_config", layer_types=["full_attention"] * 3 + ["sliding_attention"]),
                    r"text_config.layer_types = \["),
    "rope_dynamic": (_rope(rope_type="dynamic", factor=2.0), "rope_parameters.rope_type = 'dynamic'"),
    "rope_longrope": (_rope(rope_type="longrope", short_factor=[1.0] * 16, long_factor=[2.0] * 16,
                            original_max_position_embeddings=1024), "rope_parameters.rope_type = 'longrope'"),
    "partial_rotary": (_rope(partial_rotary_factor=0.5), "partial_rotary_factor = 0.5"),
    "text_prelu": (_set("text_config", hidden_act="prelu"), "text_config.hidden_act = 'prelu'"),
    "vision_xielu": (_set("vision_config", hidden_act="xielu"), "vision_config.hidden_act = 'xielu'"),
    "attention_dropout": (_set("text_config", attention_dropout=0.1), "text_config.attention_dropout = 0.1"),
    "head_dim": (_set("text_config", head_dim=16), "text_config.head_dim = 16"),
    "mrope_four_sections": (_rope(mrope_section=[4, 4, 4, 4]), r"rope_parameters.mrope_section = \[4, 4, 4, 4\]"),
    "vision_rope_linear": (_set("vision_config", rope_parameters={"rope_type": "linear", "factor": 2.0}),
                           "vision_config.rope_parameters.rope_type = 'linear'"),
}


@pytest.mark.parametrize("case", list(REFUSED))
def test_unsupported_config_is_refused_naming_field_value_and_file(case, tiny_ckpt, tmp_path):
    """Defect 3: fields transformers honours and this model does not reproduce used to be ignored silently."""
    edit, message = REFUSED[case]
    write_variant(tiny_ckpt, tmp_path / case, edit)
    with pytest.raises(UnsupportedConfigError, match=message) as info:
        build_model(hf_dir=tmp_path / case)
    assert str(tmp_path / case / "config.json") in str(info.value)


def test_transformers_does_apply_the_refused_sliding_window(tiny_ckpt, tmp_path, prompt):
    """Why use_sliding_window is refused rather than ignored: transformers' logits change with it (the prompt is
    longer than the 16-token window)."""
    write_variant(tiny_ckpt, tmp_path / "v", _sliding)
    assert prompt.input_ids.numel() > 16
    with torch.no_grad():
        assert rel_err(transformers_logits(tmp_path / "v", prompt), transformers_logits(tiny_ckpt, prompt)) > 1e-3


def test_sliding_window_that_covers_no_layer_is_accepted(tiny_ckpt, tmp_path, prompt):
    """use_sliding_window with max_window_layers >= num_hidden_layers slides no layer in transformers either."""
    def edit(cfg):
        cfg["text_config"].pop("layer_types", None)
        cfg["text_config"].update(use_sliding_window=True, sliding_window=4, max_window_layers=4)
    write_variant(tiny_ckpt, tmp_path / "v", edit)
    with torch.no_grad():
        assert rel_err(ours_logits(tmp_path / "v", prompt), transformers_logits(tmp_path / "v", prompt)) < RTOL


def test_flat_4x_config_reads_text_fields_from_the_root(tiny_ckpt):
    """A 4.x-style config (no text_config) keeps its text fields at the root, rope under rope_scaling."""
    cfg = json.loads((tiny_ckpt / "config.json").read_text())
    text = cfg.pop("text_config")
    rope = text.pop("rope_parameters")
    flat = {**cfg, **text, "rope_scaling": {"type": "mrope", "mrope_section": rope["mrope_section"]},
            "rope_theta": 5000.0, "rms_norm_eps": 1e-3}
    ref = Qwen2_5_VLConfig(**flat).text_config
    args = ModelArgs.from_hf_config(flat)
    assert (args.text.rms_norm_eps, args.text.rope_theta) == (ref.rms_norm_eps, ref.rope_parameters["rope_theta"])
    assert args.text.rope_scaling.rope_type == "default" and args.text.num_layers == ref.num_hidden_layers


def test_missing_keys_take_transformers_defaults():
    """A minimal config: every absent field is transformers' default, not the published checkpoints' value."""
    cfg = {"text_config": {"hidden_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2,
                           "rope_parameters": {"mrope_section": [4, 6, 6]}},
           "vision_config": {"out_hidden_size": 128}}
    ref = Qwen2_5_VLConfig(**cfg)
    args = ModelArgs.from_hf_config(cfg)
    t, v = ref.text_config, ref.vision_config
    assert (args.text.rms_norm_eps, args.text.vocab_size, args.text.max_position_embeddings, args.text.num_layers,
            args.text.intermediate_size, args.text.rope_theta, args.text.hidden_act) == (
        t.rms_norm_eps, t.vocab_size, t.max_position_embeddings, t.num_hidden_layers, t.intermediate_size,
        t.rope_parameters["rope_theta"], t.hidden_act)
    assert (args.vision.tokens_per_second, args.vision.hidden_size, args.vision.depth, args.vision.window_size,
            args.vision.rope_theta, args.text.tie_word_embeddings) == (
        v.tokens_per_second, v.hidden_size, v.depth, v.window_size, v.rope_parameters["rope_theta"],
        ref.tie_word_embeddings)


YARN_CASES = [
    {"rope_type": "linear", "factor": 3.0},
    {"rope_type": "yarn", "factor": 4.0},
    {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 4096, "truncate": False},
    {"rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 32768, "beta_fast": 8, "beta_slow": 2},
    {"rope_type": "yarn", "factor": 2.0, "mscale": 0.707, "mscale_all_dim": 1.0},
    {"rope_type": "yarn", "factor": 1.0},
]


@pytest.mark.parametrize("rope", YARN_CASES, ids=[str(sorted(c.items())) for c in YARN_CASES])
def test_scaled_rope_frequencies_equal_transformers(rope):
    """inv_freq and attention scaling of linear/yarn at the 7B geometry (head_dim 128, theta 1e6) against
    transformers' Qwen2_5_VLRotaryEmbedding; fp32, 1e-6 relative."""
    cfg = {"text_config": {"hidden_size": 3584, "num_attention_heads": 28, "num_key_value_heads": 4,
                           "max_position_embeddings": 128000,
                           "rope_parameters": {**rope, "mrope_section": [16, 24, 24], "rope_theta": 1e6}}}
    ref = Qwen2_5_VLRotaryEmbedding(Qwen2_5_VLConfig(**cfg).text_config)
    t = ModelArgs.from_hf_config(cfg).text
    inv_freq, scale = text_inv_freq(t.rope_scaling, t.rope_theta, t.head_dim, t.max_position_embeddings)
    assert torch.allclose(inv_freq, ref.inv_freq, rtol=1e-6, atol=0)
    assert math.isclose(scale, ref.attention_scaling, rel_tol=1e-12)


def test_default_rope_scaling_is_one():
    assert text_inv_freq(RopeScaling(), 1e6, 128, 128000)[1] == 1.0


@pytest.mark.parametrize("name", sorted(ACTIVATIONS))
def test_activation_equals_transformers_act2fn(name):
    x = torch.linspace(-12, 12, 4001)
    assert torch.allclose(ACTIVATIONS[name](x), ACT2FN[name](x), rtol=1e-6, atol=1e-7)



def test_to_hf_config_round_trips_activation_and_rope_scaling():
    """What to_hf_config writes for a non-default variant transformers reads as the same model, and so do we."""
    args = ModelArgs.from_hf_config(json.loads(json.dumps(
        {"text_config": {"hidden_size": 128, "num_attention_heads": 4, "num_key_value_heads": 2, "hidden_act": "gelu",
                         "max_position_embeddings": 8192,
                         "rope_parameters": {"rope_type": "yarn", "factor": 4.0, "mrope_section": [4, 6, 6],
                                             "original_max_position_embeddings": 2048, "mscale": 1.0}},
         "vision_config": {"out_hidden_size": 128, "hidden_act": "quick_gelu"}})))
    written = args.to_hf_config()
    assert ModelArgs.from_hf_config(written) == args
    ref = Qwen2_5_VLConfig(**written)
    assert (ref.text_config.hidden_act, ref.vision_config.hidden_act) == ("gelu", "quick_gelu")
    t = args.text
    inv_freq, scale = text_inv_freq(t.rope_scaling, t.rope_theta, t.head_dim, t.max_position_embeddings)
    rotary = Qwen2_5_VLRotaryEmbedding(ref.text_config)
    assert torch.allclose(inv_freq, rotary.inv_freq, rtol=1e-6, atol=0) and scale == rotary.attention_scaling


def test_model_with_a_non_default_activation_pickles():
    """The MLP holds its activation function: every one must be a named function, not a lambda."""
    import pickle

    from torchplex.models.qwen2_5_vl.model import GatedMLP
    for name in ACTIVATIONS:
        pickle.dumps(GatedMLP(8, 16, bias=False, hidden_act=name))
