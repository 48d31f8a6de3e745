"""Qwen2.5-VL geometry: dataclasses, named flavors, and HF `config.json` conversion both ways."""

from __future__ import annotations

import copy
import json
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path

from .rope_scaling import RopeScaling


@dataclass
class VisionArgs:
    depth: int = 32
    hidden_size: int = 1280
    intermediate_size: int = 3420
    num_heads: int = 16
    in_channels: int = 3
    patch_size: int = 14
    spatial_merge_size: int = 2
    temporal_patch_size: int = 2
    tokens_per_second: float = 2.0
    window_size: int = 112
    out_hidden_size: int = 3584
    fullatt_block_indexes: tuple[int, ...] = (7, 15, 23, 31)
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-6   # transformers hard-codes 1e-6 for the tower's norms, whatever the config says
    hidden_act: str = "silu"

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


@dataclass
class TextArgs:
    vocab_size: int = 152064
    hidden_size: int = 3584
    intermediate_size: int = 18944
    num_layers: int = 28
    num_heads: int = 28
    num_kv_heads: int = 4
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    mrope_section: tuple[int, int, int] = (16, 24, 24)
    max_position_embeddings: int = 128000
    tie_word_embeddings: bool = False
    hidden_act: str = "silu"
    rope_scaling: RopeScaling = field(default_factory=RopeScaling)

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_heads


@dataclass
class ModelArgs:
    vision: VisionArgs = field(default_factory=VisionArgs)
    text: TextArgs = field(default_factory=TextArgs)
    image_token_id: int = 151655
    video_token_id: int = 151656
    vision_start_token_id: int = 151652
    vision_end_token_id: int = 151653
    bos_token_id: int = 151643
    eos_token_id: int = 151645
    pad_token_id: int | None = None

    def __post_init__(self) -> None:
        t, v = self.text, self.vision
        if t.hidden_size % t.num_heads or t.num_heads % t.num_kv_heads:
            raise ValueError(f"text: hidden_size {t.hidden_size}, num_heads {t.num_heads}, "
                             f"num_kv_heads {t.num_kv_heads} do not divide")
        if 2 * sum(t.mrope_section) != t.head_dim:
            raise ValueError(f"text.mrope_section {t.mrope_section} must sum to head_dim/2 = {t.head_dim // 2}")
        if v.hidden_size % v.num_heads or v.head_dim % 4:
            raise ValueError(f"vision: head_dim {v.head_dim} must be a multiple of 4")
        if v.out_hidden_size != t.hidden_size:
            raise ValueError(f"vision.out_hidden_size {v.out_hidden_size} != text.hidden_size {t.hidden_size}")

    # ---- HF config.json -------------------------------------------------------------------------
    @classmethod
    def from_hf_config(cls, cfg: dict, source: str | Path = "config.json") -> "ModelArgs":
        """Read a transformers 4.x (flat) or 5.x (`text_config`) Qwen2.5-VL config dict as transformers reads
        it; a field this model does not reproduce raises UnsupportedConfigError naming it and `source`."""
        from .hf_config import parse_hf_config  # it builds ModelArgs: imported here to keep one direction

        return parse_hf_config(cfg, source)

    @classmethod
    def from_hf_dir(cls, path: str | Path) -> "ModelArgs":
        config_path = Path(path) / "config.json"
        if not config_path.is_file():
            raise FileNotFoundError(f"no config.json in HF checkpoint folder {path}")
        with open(config_path) as f:
            return cls.from_hf_config(json.load(f), config_path)

    def to_hf_config(self) -> dict:
        """A transformers-5 style `config.json` dict (also read by transformers 4.5x)."""
        t, v = self.text, self.vision
        text_config = {
            "model_type": "qwen2_5_vl_text",
            "vocab_size": t.vocab_size,
            "hidden_size": t.hidden_size,
            "intermediate_size": t.intermediate_size,
            "num_hidden_layers": t.num_layers,
            "num_attention_heads": t.num_heads,
            "num_key_value_heads": t.num_kv_heads,
            "hidden_act": t.hidden_act,
            "rms_norm_eps": t.rms_norm_eps,
            "max_position_embeddings": t.max_position_embeddings,
            "rope_parameters": {"rope_theta": t.rope_theta, "mrope_section": list(t.mrope_section),
                                **_rope_scaling_to_hf(t.rope_scaling)},
            "tie_word_embeddings": t.tie_word_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "pad_token_id": self.pad_token_id,
            "use_sliding_window": False,
        }
        vision_config = {
            "model_type": "qwen2_5_vl_vision",
            "depth": v.depth,
            "hidden_size": v.hidden_size,
            "intermediate_size": v.intermediate_size,
            "num_heads": v.num_heads,
            "in_channels": v.in_channels,
            "patch_size": v.patch_size,
            "spatial_merge_size": v.spatial_merge_size,
            "temporal_patch_size": v.temporal_patch_size,
            "tokens_per_second": int(v.tokens_per_second) if float(v.tokens_per_second).is_integer() else v.tokens_per_second,
            "window_size": v.window_size,
            "out_hidden_size": v.out_hidden_size,
            "fullatt_block_indexes": list(v.fullatt_block_indexes),
            "hidden_act": v.hidden_act,
        }
        return {
            "architectures": ["Qwen2_5_VLForConditionalGeneration"],
            "model_type": "qwen2_5_vl",
            "text_config": text_config,
            "vision_config": vision_config,
            "image_token_id": self.image_token_id,
            "video_token_id": self.video_token_id,
            "vision_start_token_id": self.vision_start_token_id,
            "vision_end_token_id": self.vision_end_token_id,
            "tie_word_embeddings": t.tie_word_embeddings,
            "bos_token_id": self.bos_token_id,
            "eos_token_id": self.eos_token_id,
            "pad_token_id": self.pad_token_id,
        }

    def with_token_ids(self, **token_ids: int) -> "ModelArgs":
        out = copy.deepcopy(self)
        for name, value in token_ids.items():
            if name not in {f.name for f in fields(self)}:
                raise KeyError(f"unknown token id field {name!r}")
            setattr(out, name, value)
        return out

    def to_dict(self) -> dict:
        return asdict(self)


def _rope_scaling_to_hf(s: RopeScaling) -> dict:
    """The `rope_parameters` keys transformers reads for this rope_type (None fields left to its defaults)."""
    if s.rope_type == "default":
        return {"rope_type": "default"}
    if s.rope_type == "linear":
        return {"rope_type": "linear", "factor": s.factor}
    out = {"rope_type": "yarn", "factor": s.factor, "beta_fast": s.beta_fast, "beta_slow": s.beta_slow,
           "truncate": s.truncate}
    for key in ("original_max_position_embeddings", "attention_factor", "mscale", "mscale_all_dim"):
        if getattr(s, key) is not None:
            out[key] = getattr(s, key)
    return out


def _vision(out_hidden: int) -> VisionArgs:
    return VisionArgs(out_hidden_size=out_hidden)


# Published geometries (Qwen/Qwen2.5-VL-*-Instruct config.json) plus a tiny debug size.
FLAVORS: dict[str, ModelArgs] = {
    "debug": ModelArgs(
        vision=VisionArgs(depth=4, hidden_size=64, intermediate_size=128, num_heads=4, window_size=56,
                          out_hidden_size=128, fullatt_block_indexes=(1, 3)),
        text=TextArgs(vocab_size=2048, hidden_size=128, intermediate_size=256, num_layers=4, num_heads=4,
                      num_kv_heads=2, mrope_section=(4, 6, 6), max_position_embeddings=8192,
                      tie_word_embeddings=True),
    ),
    "3B": ModelArgs(
        vision=_vision(2048),
        text=TextArgs(vocab_size=151936, hidden_size=2048, intermediate_size=11008, num_layers=36,
                      num_heads=16, num_kv_heads=2, tie_word_embeddings=True),
    ),
    "7B": ModelArgs(
        vision=_vision(3584),
        text=TextArgs(vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_layers=28,
                      num_heads=28, num_kv_heads=4),
    ),
    "32B": ModelArgs(
        vision=_vision(5120),
        text=TextArgs(vocab_size=152064, hidden_size=5120, intermediate_size=27648, num_layers=64,
                      num_heads=40, num_kv_heads=8),
    ),
    "72B": ModelArgs(
        vision=_vision(8192),
        text=TextArgs(vocab_size=152064, hidden_size=8192, intermediate_size=29568, num_layers=80,
                      num_heads=64, num_kv_heads=8),
    ),
}


def get_flavor(name: str) -> ModelArgs:
    if name not in FLAVORS:
        raise KeyError(f"unknown Qwen2.5-VL flavor {name!r}; known: {sorted(FLAVORS)}")
    return copy.deepcopy(FLAVORS[name])
