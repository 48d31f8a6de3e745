"""Model FLOPs of the phases of a GRPO step, counted from the geometry and the tokens each phase processed.

The one convention every MFU number of the project uses (issue 19):
  * a forward pass costs 2 FLOPs per matmul weight per token that uses it (N = the non-embedding matmul weights:
    q/k/v/o and the three MLP projections of every decoder layer; biases, norms and other elementwise work are not
    counted, as in the usual 6*N*D accounting);
  * the LM head (2 * hidden * vocab per token) only on the tokens whose logits are computed (response tokens);
  * attention adds 4 * hidden FLOPs per (query, key) pair per layer (Q.K^T and P.V, every query head), counted
    over the pairs the layout needs, never the masked-out part: a causal prompt of L tokens has L(L+1)/2 pairs,
    a suffix of r tokens after a shared prefix of p has r*p + r(r+1)/2;
  * the vision tower on its patches: the patch embedding, 32 blocks (window attention over windows, full attention
    over frames, bidirectional: n^2 pairs per segment) and the patch merger on the merged tokens;
  * forward + backward = 3x the forward (activation recomputation is not counted: these are model FLOPs).
MFU = counted FLOPs / phase seconds / a dense bf16 matmul peak measured on the same device.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterable, Sequence

from ..models.qwen2_5_vl.args import ModelArgs, TextArgs, VisionArgs

TRAIN_FACTOR = 3  # backward ~ 2x forward: dL/dx and dL/dW are each one matmul of the forward's size


def decoder_layer_weights(t: TextArgs) -> int:
    """Matmul weights of one decoder layer (q, k, v, o, gate, up, down)."""
    kv = t.num_kv_heads * t.head_dim
    return t.hidden_size * (2 * t.hidden_size + 2 * kv) + 3 * t.hidden_size * t.intermediate_size


def vision_block_weights(v: VisionArgs) -> int:
    """Matmul weights of one vision block (fused qkv, proj, gate, up, down)."""
    return 4 * v.hidden_size ** 2 + 3 * v.hidden_size * v.intermediate_size


def causal_pairs(length: int) -> int:
    """(query, key) pairs of causal attention over one sequence: each token sees itself and what came before."""
    return length * (length + 1) // 2


def suffix_pairs(prefix: int, suffix: int) -> int:
    """Pairs of a suffix of `suffix` tokens attending to a prefix of `prefix` tokens and causally to itself."""
    return suffix * prefix + causal_pairs(suffix)


def vision_segments(v: VisionArgs, grid_thw: Sequence[int]) -> tuple[list[int], list[int]]:
    """Patch counts of the attention segments of one image/video (t, h, w in patches): (windows, frames).

    Windows tile each frame's grid of merged tokens in squares of window_size pixels (edge windows are cut),
    as VisionTransformer._windows lays them out."""
    t, h, w = grid_thw
    m = v.spatial_merge_size
    side = v.window_size // m // v.patch_size  # merged tokens per window side
    gh, gw = h // m, w // m
    rows = [min(side, gh - r) for r in range(0, gh, side)]
    cols = [min(side, gw - c) for c in range(0, gw, side)]
    windows = [a * b * m * m for a in rows for b in cols] * t
    return windows, [h * w] * t


@dataclass
class Flops:
    """FLOPs of one pass, split by kind (all forward-pass FLOPs; `train` multiplies by TRAIN_FACTOR)."""

    linear: float = 0.0
    attention: float = 0.0
    lm_head: float = 0.0
    vision: float = 0.0

    @property
    def total(self) -> float:
        return self.linear + self.attention + self.lm_head + self.vision

    def __add__(self, other: "Flops") -> "Flops":
        return Flops(self.linear + other.linear, self.attention + other.attention, self.lm_head + other.lm_head,
                     self.vision + other.vision)

    def scaled(self, factor: float) -> "Flops":
        return Flops(self.linear * factor, self.attention * factor, self.lm_head * factor, self.vision * factor)


def vision_flops(v: VisionArgs, grids: Iterable[Sequence[int]]) -> float:
    """Forward FLOPs of the vision tower over the given grids (t, h, w in patches)."""
    patch_dim = v.in_channels * v.temporal_patch_size * v.patch_size ** 2
    merged_dim = v.hidden_size * v.spatial_merge_size ** 2
    total = 0.0
    for grid in grids:
        windows, frames = vision_segments(v, grid)
        patches = sum(frames)
        full_blocks = len(v.fullatt_block_indexes)
        pairs = (v.depth - full_blocks) * sum(n * n for n in windows) + full_blocks * sum(n * n for n in frames)
        merged = patches // v.spatial_merge_size ** 2
        total += 2 * patches * (patch_dim * v.hidden_size + v.depth * vision_block_weights(v))
        total += 4 * v.hidden_size * pairs
        total += 2 * merged * (merged_dim * merged_dim + merged_dim * v.out_hidden_size)
    return total


def decoder_flops(t: TextArgs, tokens: int, pairs: int, logit_tokens: int) -> Flops:
    """Forward FLOPs of the decoder over `tokens` tokens whose attention covers `pairs` (query, key) pairs per
    layer, with the LM head on `logit_tokens` of them."""
    return Flops(linear=2.0 * tokens * t.num_layers * decoder_layer_weights(t),
                 attention=4.0 * t.hidden_size * t.num_layers * pairs,
                 lm_head=2.0 * logit_tokens * t.hidden_size * t.vocab_size)


def prefill_flops(args: ModelArgs, prompt_lens: Sequence[int], grids: Iterable[Sequence[int]] = (),
                  logit_tokens: int | None = None) -> Flops:
    """Forward FLOPs of causal prompt prefills (one per prompt), vision tower included; the LM head on one token
    per prompt (the logits of the first sampled token) unless `logit_tokens` says otherwise."""
    f = decoder_flops(args.text, sum(prompt_lens), sum(causal_pairs(n) for n in prompt_lens),
                      len(prompt_lens) if logit_tokens is None else logit_tokens)
    return f + Flops(vision=vision_flops(args.vision, grids))


def decomposed_flops(args: ModelArgs, prompt_lens: Sequence[int], response_lens: Sequence[Sequence[int]],
                     grids: Iterable[Sequence[int]] = ()) -> Flops:
    """Forward FLOPs of scoring responses as suffixes of their prompt's prefix: one prefill per prompt (no LM head:
    its last hidden state goes through the head as a response token) plus every response over its prefix.
    response_lens[i]: the response lengths of prompt i's samples (the LM head runs on every response token)."""
    prefix = prefill_flops(args, prompt_lens, grids, logit_tokens=0)
    responses = sum(sum(r) for r in response_lens)
    # A response of r tokens runs r - 1 suffix tokens; its first token is predicted by the prefix's last state.
    pairs = sum(suffix_pairs(p, max(r - 1, 0)) for p, rs in zip(prompt_lens, response_lens) for r in rs)
    suffix_tokens = sum(max(r - 1, 0) for rs in response_lens for r in rs)
    return prefix + decoder_flops(args.text, suffix_tokens, pairs, responses)


def serial_flops(args: ModelArgs, prompt_lens: Sequence[int], response_lens: Sequence[Sequence[int]],
                 grids: Sequence[Sequence[Sequence[int]]] = ()) -> Flops:
    """Forward FLOPs of scoring every response as its own prompt+response sequence (vision per sample).
    grids[i]: the visual grids of prompt i (repeated for each of its samples)."""
    grids = list(grids) or [[] for _ in prompt_lens]
    f = Flops()
    for p, rs, g in zip(prompt_lens, response_lens, grids):
        for r in rs:
            f = f + decoder_flops(args.text, p + r, causal_pairs(p + r), r)
            f = f + Flops(vision=vision_flops(args.vision, g))
    return f


def mfu(flops: float, seconds: float, peak_flops_per_s: float) -> float:
    """Model FLOPs utilisation of a phase: its counted FLOPs over its time and the measured peak."""
    return flops / seconds / peak_flops_per_s if seconds > 0 and peak_flops_per_s > 0 else 0.0


def decode_flops(t: TextArgs, prompt_lens: Sequence[int], response_lens: Sequence[Sequence[int]]) -> Flops:
    """Forward FLOPs of decoding the responses token by token after their prompt's prefill: each generated token
    but the first (sampled from the prefill's logits) runs the decoder over its prompt and its own earlier tokens."""
    tokens = sum(max(r - 1, 0) for rs in response_lens for r in rs)
    pairs = sum(suffix_pairs(p, max(r - 1, 0)) for p, rs in zip(prompt_lens, response_lens) for r in rs)
    return decoder_flops(t, tokens, pairs, tokens)


def step_flops(args: ModelArgs, prompt_lens: Sequence[int], grids: Sequence[Sequence[Sequence[int]]],
               response_lens: Sequence[Sequence[int]], *, serial: bool, has_reference: bool, vision_trains: bool,
               vision_stage: bool, fused: Sequence[int] = ()) -> dict[str, Flops]:
    """Model FLOPs of each phase of one GRPO step (the trainer's `flops/<phase>` metrics, which the benchmarks turn
    into MFU): rollout (the prompts' prefill and the decode), the reference's scoring, training (forward and
    backward, TRAIN_FACTOR), and the vision stage of a frozen tower in the prefix modes (`vision_stage`: the tower
    runs once per step and no other phase counts it). Serial scoring runs every sample whole; the prefix modes
    score suffixes on a prefix per prompt, and in training the prompts whose actor prefix the rollout's prefill
    computed (`fused`, indices into the prompts) run only that prefix's backward (counted at twice its forward)."""
    flat = [g for gs in grids for g in gs]
    prefill = prefill_flops(args, prompt_lens, flat)
    rollout = prefill + decode_flops(args.text, prompt_lens, response_lens)
    if serial:
        scoring = serial_flops(args, prompt_lens, response_lens, grids)
    else:
        scoring = decomposed_flops(args, prompt_lens, response_lens, flat)
    train = scoring.scaled(TRAIN_FACTOR)
    if not vision_trains:  # a frozen tower runs forward only
        train.vision = scoring.vision
    for i in fused:  # the prefix forward ran in the rollout's prefill: its backward is what training adds
        prefix = prefill_flops(args, [prompt_lens[i]], grids[i], logit_tokens=0)
        train = train + Flops(prefix.linear, prefix.attention, 0.0, prefix.vision if vision_trains else 0.0).scaled(-1)
    out = {"rollout": rollout, "train": train}
    if has_reference:
        out["ref"] = scoring
    if vision_stage and not serial:
        vision = Flops(vision=vision_flops(args.vision, flat))
        for phase in out.values():
            phase.vision = 0.0
        out["vision"] = vision
    return out
