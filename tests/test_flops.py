"""The FLOP counter behind every MFU number: a hand count on the debug geometry, and torch's own FlopCounterMode
on the tiny model's real forward (vision tower, decoder, LM head)."""

import pytest
import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from torchplex.components.flops import (TRAIN_FACTOR, causal_pairs, decoder_flops, decoder_layer_weights,
                                        decomposed_flops, prefill_flops, serial_flops, suffix_pairs,
                                        vision_block_weights, vision_flops, vision_segments)
from torchplex.models.qwen2_5_vl.args import get_flavor
from torchplex.models.qwen2_5_vl.model import Qwen2_5_VLModel


def debug_args():
    return get_flavor("debug").with_token_ids(image_token_id=2000, video_token_id=2001, vision_start_token_id=2002,
                                              vision_end_token_id=2003)


def test_hand_count_debug_geometry():
    """Weights and pairs written out by hand for the debug flavor (hidden 128, 2 KV heads of 32, MLP 256)."""
    a = debug_args()
    assert decoder_layer_weights(a.text) == 128 * 128 * 2 + 128 * 64 * 2 + 3 * 128 * 256
    assert vision_block_weights(a.vision) == 4 * 64 * 64 + 3 * 64 * 128
    assert causal_pairs(4) == 10 and suffix_pairs(3, 2) == 2 * 3 + 3
    f = decoder_flops(a.text, tokens=10, pairs=55, logit_tokens=3)
    assert f.linear == 2 * 10 * 4 * 147456
    assert f.attention == 4 * 128 * 4 * 55
    assert f.lm_head == 2 * 3 * 128 * 2048
    # 10x12 patches, windows of 2x2 merged tokens (56 px): 3 window rows (2, 2, 1 merged) x 3 columns of 2.
    windows, frames = vision_segments(a.vision, (1, 10, 12))
    assert windows == [16, 16, 16, 16, 16, 16, 8, 8, 8] and frames == [120]
    patch_dim = 3 * 2 * 14 * 14
    expected = (2 * 120 * (patch_dim * 64 + 4 * vision_block_weights(a.vision))
                + 4 * 64 * (2 * (6 * 256 + 3 * 64) + 2 * 120 * 120)  # 2 windowed blocks, 2 full (1, 3)
                + 2 * 30 * (256 * 256 + 256 * 128))
    assert vision_flops(a.vision, [(1, 10, 12)]) == expected


def test_modes_count_what_they_run():
    """Decomposed scoring runs the prompt once; serial runs it per sample; both put the LM head on responses."""
    a = debug_args()
    prompt, responses = [50], [[7, 5, 3]]
    d = decomposed_flops(a, prompt, responses)
    s = serial_flops(a, prompt, responses)
    per_layer = decoder_layer_weights(a.text) * a.text.num_layers
    assert d.linear == 2 * per_layer * (50 + 6 + 4 + 2)  # prefix + r-1 suffix tokens each
    assert s.linear == 2 * per_layer * (57 + 55 + 53)
    assert d.lm_head == s.lm_head == 2 * 15 * 128 * 2048
    assert d.attention == 4 * 128 * 4 * (causal_pairs(50) + suffix_pairs(50, 6) + suffix_pairs(50, 4)
                                         + suffix_pairs(50, 2))
    assert TRAIN_FACTOR == 3


@pytest.mark.parametrize("grid", [(1, 8, 8), (1, 10, 12)])
def test_matches_flop_counter_mode(grid):
    """Every matmul and attention FLOP of a real forward (vision + decoder + LM head on a few tokens), as torch's
    FlopCounterMode counts them. The CPU's fused SDPA kernel has no flop formula, so attention runs on the math
    backend, whose matmuls cover the full L x L square even when causal: the decoder's attention is compared at
    L^2 pairs. Everything must agree exactly (integer counts)."""
    a = debug_args()
    torch.manual_seed(0)
    model = Qwen2_5_VLModel(a)
    model.init_weights()
    t, h, w = grid
    merged = t * h * w // 4
    ids = torch.tensor([[5, 6, a.vision_start_token_id] + [a.image_token_id] * merged + [a.vision_end_token_id, 7, 8]])
    pixels = torch.randn(t * h * w, 3 * 2 * 14 * 14)
    length, logit_tokens = ids.shape[1], 4
    with torch.no_grad(), sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter:
        image = model.encode_vision(pixels, torch.tensor([grid]))
        hidden = model(ids, image_embeds=image)
        F.linear(hidden[0, -logit_tokens:], model.output_weight)
    expected = decoder_flops(a.text, length, length * length, logit_tokens).total + vision_flops(a.vision, [grid])
    assert counter.get_total_flops() == pytest.approx(expected, rel=1e-9)
    # The causal count the MFU uses is the lower triangle of that square.
    causal = prefill_flops(a, [length], [grid], logit_tokens=logit_tokens)
    assert causal.total == pytest.approx(expected - 4 * 128 * 4 * (length * length - causal_pairs(length)), rel=1e-9)


def test_step_flops_per_phase_follow_each_modes_work():
    """step_flops (the trainer's flops/<phase>_tflop): serial training is 3x its reference scoring (vision included
    for a trainable tower); the prefix modes score one prefix per prompt; a prompt fused into the rollout prefill
    leaves training only its prefix's backward; a frozen tower in the prefix modes is the vision stage's alone;
    rollout = the prefill plus decoding every response token but the first."""
    from torchplex.components.flops import Flops, decode_flops, step_flops

    a = debug_args()
    lens, grids, responses = [20, 30], [[(1, 4, 8)], [(1, 8, 8)]], [[3, 5], [1, 4]]
    flat = [g for gs in grids for g in gs]
    kw = dict(has_reference=True, vision_trains=True, vision_stage=False)
    serial = step_flops(a, lens, grids, responses, serial=True, **kw)
    assert serial["ref"].total == serial_flops(a, lens, responses, grids).total
    assert serial["train"].total == pytest.approx(TRAIN_FACTOR * serial["ref"].total)
    rollout = prefill_flops(a, lens, flat) + decode_flops(a.text, lens, responses)
    assert serial["rollout"].total == rollout.total
    assert decode_flops(a.text, lens, responses).linear == 2.0 * (2 + 4 + 0 + 3) * 4 * decoder_layer_weights(a.text)
    prefix = step_flops(a, lens, grids, responses, serial=False, **kw)
    assert prefix["ref"].total == decomposed_flops(a, lens, responses, flat).total < serial["ref"].total
    fused = step_flops(a, lens, grids, responses, serial=False, fused=[1], **kw)
    one = prefill_flops(a, [30], grids[1], logit_tokens=0)
    assert prefix["train"].total - fused["train"].total == pytest.approx(one.total)
    frozen = step_flops(a, lens, grids, responses, serial=False, has_reference=False, vision_trains=False,
                        vision_stage=True)
    assert "ref" not in frozen and frozen["vision"].total == vision_flops(a.vision, flat) > 0
    assert all(frozen[p].vision == 0 for p in ("rollout", "train"))
    assert isinstance(frozen["train"], Flops)
