"""HF Qwen2.5-VL parameter names <-> torchplex native names, both directions. Pure renames.

Two HF layouts exist for the same tensors:

* ``"legacy"`` -- what published Hub checkpoints hold, what transformers <= 4.51 kept in memory, and
  what transformers 5.x ``save_pretrained`` still *writes* (it reverts its load-time renaming):
  ``visual.*``, ``model.embed_tokens.weight``, ``model.layers.*``, ``model.norm.weight``, ``lm_head.weight``.
* ``"v5"`` -- the in-memory ``state_dict()`` of transformers >= 4.52 / 5.x:
  ``model.visual.*``, ``model.language_model.*``, ``lm_head.weight``.

Tensors are never reshaped: native tensors keep the HF shapes (the patch embedding keeps its Conv3d
5-D weight), so a conversion is bit-exact by construction.

Tied embeddings: transformers keeps ``lm_head.weight`` in its in-memory state dict even when tied, but
``save_pretrained`` drops it. The native model has no ``output.weight`` when tied, so ``from_hf`` drops
``lm_head.weight`` and ``to_hf`` writes it only for untied models -- matching what transformers saves.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from typing import Literal, TypeVar

from torchplex.models.qwen2_5_vl.args import ModelArgs

Layout = Literal["v5", "legacy"]
LAYOUTS: tuple[Layout, ...] = ("legacy", "v5")

# Where each tower lives in each HF layout. Native names use "visual." and no text prefix.
_HF_VISION_PREFIX: dict[str, str] = {"legacy": "visual.", "v5": "model.visual."}
_HF_TEXT_PREFIX: dict[str, str] = {"legacy": "model.", "v5": "model.language_model."}
_NATIVE_VISION_PREFIX = "visual."
_HF_LM_HEAD = "lm_head.weight"
_NATIVE_OUTPUT = "output.weight"

# (native suffix, HF suffix) templates; {i} is a block/layer index, {p} is "weight" or "bias".
_VISION_RENAMES: tuple[tuple[str, str], ...] = (
    ("patch_embed.weight", "patch_embed.proj.weight"),
    ("blocks.{i}.norm1.weight", "blocks.{i}.norm1.weight"),
    ("blocks.{i}.norm2.weight", "blocks.{i}.norm2.weight"),
    ("blocks.{i}.attn.qkv.{p}", "blocks.{i}.attn.qkv.{p}"),
    ("blocks.{i}.attn.proj.{p}", "blocks.{i}.attn.proj.{p}"),
    ("blocks.{i}.mlp.w1.{p}", "blocks.{i}.mlp.gate_proj.{p}"),
    ("blocks.{i}.mlp.w3.{p}", "blocks.{i}.mlp.up_proj.{p}"),
    ("blocks.{i}.mlp.w2.{p}", "blocks.{i}.mlp.down_proj.{p}"),
    ("merger.norm.weight", "merger.ln_q.weight"),
    ("merger.fc1.{p}", "merger.mlp.0.{p}"),
    ("merger.fc2.{p}", "merger.mlp.2.{p}"),
)
_TEXT_RENAMES: tuple[tuple[str, str], ...] = (
    ("tok_embeddings.weight", "embed_tokens.weight"),
    ("layers.{i}.attention_norm.weight", "layers.{i}.input_layernorm.weight"),
    ("layers.{i}.attention.wq.{p}", "layers.{i}.self_attn.q_proj.{p}"),
    ("layers.{i}.attention.wk.{p}", "layers.{i}.self_attn.k_proj.{p}"),
    ("layers.{i}.attention.wv.{p}", "layers.{i}.self_attn.v_proj.{p}"),
    ("layers.{i}.attention.wo.weight", "layers.{i}.self_attn.o_proj.weight"),
    ("layers.{i}.ffn_norm.weight", "layers.{i}.post_attention_layernorm.weight"),
    ("layers.{i}.feed_forward.w1.weight", "layers.{i}.mlp.gate_proj.weight"),
    ("layers.{i}.feed_forward.w3.weight", "layers.{i}.mlp.up_proj.weight"),
    ("layers.{i}.feed_forward.w2.weight", "layers.{i}.mlp.down_proj.weight"),
    ("norm.weight", "norm.weight"),
)


class _Rule:
    """One template pair compiled into a matcher for each side and a formatter for the other."""

    def __init__(self, src: str, dst: str) -> None:
        pattern = re.escape(src).replace(r"\{i\}", r"(?P<i>\d+)").replace(r"\{p\}", r"(?P<p>weight|bias)")
        self._regex = re.compile(pattern + r"\Z")
        self._dst = dst

    def apply(self, suffix: str) -> str | None:
        m = self._regex.match(suffix)
        return None if m is None else self._dst.format(**m.groupdict())


def _compile(pairs: Iterable[tuple[str, str]], reverse: bool) -> tuple[_Rule, ...]:
    return tuple(_Rule(hf, native) if reverse else _Rule(native, hf) for native, hf in pairs)


_VISION_TO_HF = _compile(_VISION_RENAMES, reverse=False)
_VISION_FROM_HF = _compile(_VISION_RENAMES, reverse=True)
_TEXT_TO_HF = _compile(_TEXT_RENAMES, reverse=False)
_TEXT_FROM_HF = _compile(_TEXT_RENAMES, reverse=True)


def _first_match(rules: tuple[_Rule, ...], suffix: str) -> str | None:
    for rule in rules:
        out = rule.apply(suffix)
        if out is not None:
            return out
    return None


def _hf_key_layout(key: str) -> Layout | None:
    """The layout a single HF key belongs to; None for ``lm_head.weight``, which both layouts share."""
    if key == _HF_LM_HEAD:
        return None
    if key.startswith(("model.visual.", "model.language_model.")):
        return "v5"
    if key.startswith(("visual.", "model.")):
        return "legacy"
    raise KeyError(f"{key!r} is not a Qwen2.5-VL HF parameter name (expected a visual., model. or "
                   f"lm_head. prefix)")


T = TypeVar("T")


class Qwen2_5_VLStateDictAdapter:
    """Renames Qwen2.5-VL state dicts between HF (either layout) and torchplex native names."""

    def __init__(self, args: ModelArgs) -> None:
        self.args = args

    @property
    def tied(self) -> bool:
        return self.args.text.tie_word_embeddings

    # ---- layouts --------------------------------------------------------------------------------
    @staticmethod
    def detect_layout(hf_keys: Iterable[str]) -> Layout:
        """``"v5"`` or ``"legacy"`` from a checkpoint's keys; mixed or empty key sets are an error."""
        found: dict[Layout, str] = {}
        for key in hf_keys:
            layout = _hf_key_layout(key)
            if layout is not None:
                found.setdefault(layout, key)
        if len(found) == 1:
            return next(iter(found))
        if not found:
            raise ValueError("cannot tell the HF layout: no visual.* or model.* keys among the checkpoint's keys")
        raise ValueError(f"checkpoint mixes HF layouts: {found['legacy']!r} is legacy (transformers <= 4.51 / "
                         f"Hub) but {found['v5']!r} is transformers-5 in-memory layout")

    # ---- single keys ----------------------------------------------------------------------------
    def hf_to_native_key(self, key: str) -> str | None:
        """Native name for an HF key of either layout; None for a key the native model does not keep
        (``lm_head.weight`` of a tied model). Raises KeyError for a key that is not a Qwen2.5-VL name."""
        if key == _HF_LM_HEAD:
            return None if self.tied else _NATIVE_OUTPUT
        layout = _hf_key_layout(key)
        assert layout is not None
        vision_prefix, text_prefix = _HF_VISION_PREFIX[layout], _HF_TEXT_PREFIX[layout]
        if key.startswith(vision_prefix):
            native = _first_match(_VISION_FROM_HF, key[len(vision_prefix):])
            if native is not None:
                return _NATIVE_VISION_PREFIX + native
        elif key.startswith(text_prefix):
            native = _first_match(_TEXT_FROM_HF, key[len(text_prefix):])
            if native is not None:
                return native
        raise KeyError(f"HF key {key!r} ({layout} layout) has no native Qwen2.5-VL counterpart")

    def is_dropped_hf_key(self, key: str) -> bool:
        """True for an HF key the native model deliberately does not keep (tied ``lm_head.weight``)."""
        return self.tied and key == _HF_LM_HEAD

    def native_to_hf_key(self, key: str, layout: Layout = "legacy") -> str:
        """HF name of a native key in the given layout. Raises KeyError for an unknown native key."""
        if layout not in LAYOUTS:
            raise ValueError(f"unknown HF layout {layout!r}; expected one of {LAYOUTS}")
        if key == _NATIVE_OUTPUT:
            return _HF_LM_HEAD
        if key.startswith(_NATIVE_VISION_PREFIX):
            hf = _first_match(_VISION_TO_HF, key[len(_NATIVE_VISION_PREFIX):])
            if hf is not None:
                return _HF_VISION_PREFIX[layout] + hf
        else:
            hf = _first_match(_TEXT_TO_HF, key)
            if hf is not None:
                return _HF_TEXT_PREFIX[layout] + hf
        raise KeyError(f"{key!r} is not a native Qwen2.5-VL parameter name")

    # ---- whole state dicts ----------------------------------------------------------------------
    def from_hf(self, state_dict: Mapping[str, T]) -> dict[str, T]:
        """Native state dict from an HF one (either layout); values are passed through untouched."""
        out: dict[str, T] = {}
        source_of: dict[str, str] = {}
        for hf_key, value in state_dict.items():
            native = self.hf_to_native_key(hf_key)
            if native is None:
                continue
            if native in out:
                raise ValueError(f"HF keys {source_of[native]!r} and {hf_key!r} both map to native {native!r}")
            out[native], source_of[native] = value, hf_key
        return out

    def to_hf(self, native_state_dict: Mapping[str, T], layout: Layout = "legacy") -> dict[str, T]:
        """HF state dict in ``layout`` from a native one. ``lm_head.weight`` is written only when the
        embeddings are untied (as ``save_pretrained`` does); a native ``output.weight`` is an error when
        tied and required when untied, so a mismatched ``args`` cannot silently drop or invent a head."""
        if self.tied and _NATIVE_OUTPUT in native_state_dict:
            raise ValueError(f"native state dict has {_NATIVE_OUTPUT!r} but args.text.tie_word_embeddings "
                             f"is True (a tied model has no separate output projection)")
        if not self.tied and _NATIVE_OUTPUT not in native_state_dict:
            raise KeyError(f"native state dict lacks {_NATIVE_OUTPUT!r} but args.text.tie_word_embeddings "
                           f"is False")
        return {self.native_to_hf_key(key, layout): value for key, value in native_state_dict.items()}

    # ---- expected geometry ----------------------------------------------------------------------
    def expected_native_shapes(self) -> dict[str, tuple[int, ...]]:
        """Every native key this geometry has, with its shape: what a checkpoint must hold.
        Lets the conversion tools validate a checkpoint without building the model."""
        v, t = self.args.vision, self.args.text
        dv, iv = v.hidden_size, v.intermediate_size
        merged = dv * v.spatial_merge_size**2
        shapes: dict[str, tuple[int, ...]] = {
            "visual.patch_embed.weight": (dv, v.in_channels, v.temporal_patch_size, v.patch_size, v.patch_size),
        }
        for i in range(v.depth):
            b = f"visual.blocks.{i}."
            shapes.update({
                b + "norm1.weight": (dv,), b + "norm2.weight": (dv,),
                b + "attn.qkv.weight": (3 * dv, dv), b + "attn.qkv.bias": (3 * dv,),
                b + "attn.proj.weight": (dv, dv), b + "attn.proj.bias": (dv,),
                b + "mlp.w1.weight": (iv, dv), b + "mlp.w1.bias": (iv,),
                b + "mlp.w3.weight": (iv, dv), b + "mlp.w3.bias": (iv,),
                b + "mlp.w2.weight": (dv, iv), b + "mlp.w2.bias": (dv,),
            })
        shapes.update({
            "visual.merger.norm.weight": (dv,),
            "visual.merger.fc1.weight": (merged, merged), "visual.merger.fc1.bias": (merged,),
            "visual.merger.fc2.weight": (v.out_hidden_size, merged), "visual.merger.fc2.bias": (v.out_hidden_size,),
        })
        d, hd = t.hidden_size, t.head_dim
        q, kv = t.num_heads * hd, t.num_kv_heads * hd
        shapes["tok_embeddings.weight"] = (t.vocab_size, d)
        for i in range(t.num_layers):
            b = f"layers.{i}."
            shapes.update({
                b + "attention_norm.weight": (d,),
                b + "attention.wq.weight": (q, d), b + "attention.wq.bias": (q,),
                b + "attention.wk.weight": (kv, d), b + "attention.wk.bias": (kv,),
                b + "attention.wv.weight": (kv, d), b + "attention.wv.bias": (kv,),
                b + "attention.wo.weight": (d, q),
                b + "ffn_norm.weight": (d,),
                b + "feed_forward.w1.weight": (t.intermediate_size, d),
                b + "feed_forward.w3.weight": (t.intermediate_size, d),
                b + "feed_forward.w2.weight": (d, t.intermediate_size),
            })
        shapes["norm.weight"] = (d,)
        if not t.tie_word_embeddings:
            shapes[_NATIVE_OUTPUT] = (t.vocab_size, d)
        return shapes
