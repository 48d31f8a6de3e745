"""A Qwen2.5-VL `config.json` read the way transformers reads it, or refused.

Every field transformers' Qwen2.5-VL model honours is either reproduced here (with transformers' own default
when the key is missing) or refused with an error naming the field, its value and the file: a checkpoint must
never load with logits that differ from transformers' for the same weights. docs/model_config.md lists each
field and what happens to it. The defaults and rules below were read from transformers 5.24's
configuration_qwen2_5_vl.py / modeling_qwen2_5_vl.py / modeling_rope_utils.py (5.17 has the same defaults).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ..activations import ACTIVATIONS
from .args import ModelArgs, TextArgs, VisionArgs
from .rope_scaling import RopeScaling

# Qwen2_5_VLTextConfig / Qwen2_5_VLVisionConfig / Qwen2_5_VLConfig field defaults. They are not the published
# checkpoints' values (rms_norm_eps 1e-5 vs 1e-6, tokens_per_second 4 vs 2...): a key absent from a config.json
# gets these in transformers, so it gets them here.
TEXT_DEFAULTS: dict[str, Any] = {
    "vocab_size": 152064, "hidden_size": 8192, "intermediate_size": 29568, "num_hidden_layers": 80,
    "num_attention_heads": 64, "num_key_value_heads": 8, "hidden_act": "silu", "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-5, "use_sliding_window": False, "sliding_window": 4096, "max_window_layers": 80,
    "attention_dropout": 0.0, "bos_token_id": 151643, "eos_token_id": 151645, "pad_token_id": None,
}
TEXT_ROPE_THETA = 1_000_000.0      # Qwen2_5_VLTextConfig.default_theta
MROPE_SECTION = (16, 24, 24)       # Qwen2_5_VLRotaryEmbedding's fallback when rope_parameters has none
VISION_DEFAULTS: dict[str, Any] = {
    "depth": 32, "hidden_size": 3584, "hidden_act": "silu", "intermediate_size": 3420, "num_heads": 16,
    "in_channels": 3, "patch_size": 14, "spatial_merge_size": 2, "temporal_patch_size": 2, "tokens_per_second": 4,
    "window_size": 112, "out_hidden_size": 3584, "fullatt_block_indexes": (7, 15, 23, 31),
}
VISION_ROPE_THETA = 10_000.0       # PreTrainedConfig.default_theta (the vision config does not override it)
ROOT_DEFAULTS: dict[str, Any] = {
    "image_token_id": 151655, "video_token_id": 151656, "vision_start_token_id": 151652,
    "vision_end_token_id": 151653, "tie_word_embeddings": False,
}


class UnsupportedConfigError(ValueError):
    """A config.json field this model cannot reproduce as transformers would (or a geometry that is invalid)."""


class _Reader:
    """Values of one config section, with transformers' defaults and errors that name the file and the field."""

    def __init__(self, section: dict, prefix: str, defaults: dict[str, Any], source: str):
        self.section, self.prefix, self.defaults, self.source = section, prefix, defaults, source

    def get(self, key: str, default: Any = ...) -> Any:
        value = self.section.get(key)
        if value is None:  # missing, or written as null: transformers falls back to the field default
            return self.defaults.get(key) if default is ... else default
        return value

    def refuse(self, key: str, value: Any, why: str) -> UnsupportedConfigError:
        return UnsupportedConfigError(f"{self.source}: {self.prefix}{key} = {value!r} is not supported: {why}")


def parse_hf_config(cfg: dict, source: str | Path = "config.json") -> ModelArgs:
    source = str(source)
    # transformers 5 builds the text config from `text_config` alone when there is one; only a flat (4.x-style)
    # config has its text fields at the root.
    nested = cfg.get("text_config") is not None
    text = _Reader(cfg["text_config"] if nested else cfg, "text_config." if nested else "", TEXT_DEFAULTS, source)
    vision = _Reader(cfg.get("vision_config") or {}, "vision_config.", VISION_DEFAULTS, source)
    root = _Reader(cfg, "", ROOT_DEFAULTS, source)

    text_args = _text_args(text, root, nested)
    vision_args = _vision_args(vision)
    # Token ids do not change logits; a text_config value wins over the root one, as before.
    token_ids = {key: text.section.get(key, cfg.get(key, TEXT_DEFAULTS[key]))
                 for key in ("bos_token_id", "eos_token_id", "pad_token_id")}
    try:
        return ModelArgs(vision=vision_args, text=text_args,
                         **{key: root.get(key) for key in ("image_token_id", "video_token_id",
                                                           "vision_start_token_id", "vision_end_token_id")},
                         **token_ids)
    except ValueError as e:
        raise UnsupportedConfigError(f"{source}: {e}") from e


def _text_args(text: _Reader, root: _Reader, nested: bool) -> TextArgs:
    hidden, heads = text.get("hidden_size"), text.get("num_attention_heads")
    kv_heads = text.section.get("num_key_value_heads", TEXT_DEFAULTS["num_key_value_heads"]) or heads
    num_layers = text.get("num_hidden_layers")

    act = text.get("hidden_act")
    if act not in ACTIVATIONS:
        raise text.refuse("hidden_act", act, f"supported activations are {sorted(ACTIVATIONS)}")
    head_dim = text.section.get("head_dim")
    if head_dim is not None and head_dim != hidden // heads:
        # transformers' attention splits heads by hidden_size // num_attention_heads but its RoPE reads head_dim
        raise text.refuse("head_dim", head_dim,
                          f"it differs from hidden_size / num_attention_heads = {hidden // heads}")
    dropout = text.get("attention_dropout")
    if dropout:
        raise text.refuse("attention_dropout", dropout, "this model has no attention dropout (transformers applies "
                          "it in train mode); set it to 0.0")
    _check_no_sliding_window(text, num_layers)

    tie_root = bool(root.section.get("tie_word_embeddings", False))
    # transformers 5 ties when the root says so, or (pre-v5 saves) when only text_config does.
    tie = tie_root or (nested and bool(text.section.get("tie_word_embeddings", False)))
    max_positions = text.get("max_position_embeddings")
    rope_theta, mrope_section, scaling = _text_rope(text, max_positions)
    return TextArgs(
        vocab_size=text.get("vocab_size"), hidden_size=hidden, intermediate_size=text.get("intermediate_size"),
        num_layers=num_layers, num_heads=heads, num_kv_heads=kv_heads, rms_norm_eps=float(text.get("rms_norm_eps")),
        rope_theta=rope_theta, mrope_section=mrope_section, max_position_embeddings=max_positions,
        tie_word_embeddings=tie, hidden_act=act, rope_scaling=scaling)


def _check_no_sliding_window(text: _Reader, num_layers: int) -> None:
    """transformers (>= 5, sdpa and eager too) masks layers >= max_window_layers to a sliding window when
    use_sliding_window is true; this model's attention has no window, so such a config is refused."""
    layer_types = text.section.get("layer_types")
    if layer_types is not None:
        if "sliding_attention" in layer_types:
            raise text.refuse("layer_types", layer_types, "sliding-window attention layers are not implemented")
        return
    if not text.get("use_sliding_window"):
        return
    window, first = text.section.get("sliding_window", TEXT_DEFAULTS["sliding_window"]), text.get("max_window_layers")
    if window is not None and first < num_layers:
        raise text.refuse("use_sliding_window", True, f"transformers then limits layers {first}..{num_layers - 1} "
                          f"to a {window}-token sliding window, which this model does not implement")


def _text_rope(text: _Reader, max_positions: int) -> tuple[float, tuple[int, ...], RopeScaling]:
    # transformers: `rope_scaling` (the 4.x name), when present and non-empty, replaces `rope_parameters`.
    key = "rope_scaling" if text.section.get("rope_scaling") else "rope_parameters"
    rope = dict(text.section.get(key) or {})
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    rope_type = "default" if rope_type == "mrope" else rope_type  # Qwen's own name for the default M-RoPE
    theta = float(rope.get("rope_theta", text.get("rope_theta", TEXT_ROPE_THETA)))
    mrope = tuple(rope.get("mrope_section") or MROPE_SECTION)
    if len(mrope) != 3:
        raise text.refuse(f"{key}.mrope_section", list(mrope), "Qwen2.5-VL's M-RoPE has three sections (t, h, w)")
    partial = rope.get("partial_rotary_factor", text.section.get("partial_rotary_factor"))
    if partial not in (None, 1, 1.0):
        raise text.refuse(f"{key}.partial_rotary_factor", partial, "partial rotary embeddings are not implemented")

    if rope_type == "default":
        return theta, mrope, RopeScaling()
    if rope_type == "linear":
        if rope.get("factor") is None:
            raise text.refuse(f"{key}.factor", None, "rope_type 'linear' needs a factor")
        return theta, mrope, RopeScaling("linear", factor=float(rope["factor"]))
    if rope_type == "yarn":
        # A text-level original_max_position_embeddings overrides the rope dict's when transformers builds the
        # model (its Phi-3 rule in standardize_rope_params); otherwise the model's max_position_embeddings.
        original = text.section.get("original_max_position_embeddings") or rope.get(
            "original_max_position_embeddings") or max_positions
        factor = rope.get("factor")
        factor = float(factor) if factor is not None else max_positions / original
        return theta, mrope, RopeScaling(
            "yarn", factor=factor, original_max_position_embeddings=int(original),
            attention_factor=rope.get("attention_factor"),
            beta_fast=float(rope.get("beta_fast") or 32), beta_slow=float(rope.get("beta_slow") or 1),
            mscale=rope.get("mscale"), mscale_all_dim=rope.get("mscale_all_dim"),
            truncate=bool(rope.get("truncate", True)))
    raise text.refuse(f"{key}.rope_type", rope_type, "implemented rope types are default (mrope), linear and yarn; "
                      "dynamic and longrope change frequencies with the sequence length")


def _vision_args(vision: _Reader) -> VisionArgs:
    act = vision.get("hidden_act")
    if act not in ACTIVATIONS:
        raise vision.refuse("hidden_act", act, f"supported activations are {sorted(ACTIVATIONS)}")
    key = "rope_scaling" if vision.section.get("rope_scaling") else "rope_parameters"
    rope = dict(vision.section.get(key) or {})
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    if rope_type not in ("default", "axial"):
        raise vision.refuse(f"{key}.rope_type", rope_type, "the vision tower's RoPE is axial only (transformers "
                            "refuses other types too)")
    for name in ("patch_size", "temporal_patch_size"):
        if not isinstance(vision.get(name), int):
            raise vision.refuse(name, vision.get(name), "only a single integer patch size is implemented")
    # transformers 5.24's attribute_map: num_attention_heads / num_hidden_layers are aliases that win when set.
    return VisionArgs(
        depth=vision.get("num_hidden_layers", vision.get("depth")), hidden_size=vision.get("hidden_size"),
        intermediate_size=vision.get("intermediate_size"),
        num_heads=vision.get("num_attention_heads", vision.get("num_heads")), in_channels=vision.get("in_channels"),
        patch_size=vision.get("patch_size"), spatial_merge_size=vision.get("spatial_merge_size"),
        temporal_patch_size=vision.get("temporal_patch_size"),
        tokens_per_second=float(vision.get("tokens_per_second")), window_size=vision.get("window_size"),
        out_hidden_size=vision.get("out_hidden_size"),
        fullatt_block_indexes=tuple(vision.get("fullatt_block_indexes")),
        rope_theta=float(rope.get("rope_theta", vision.get("rope_theta", VISION_ROPE_THETA))), hidden_act=act)
