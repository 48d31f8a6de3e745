"""models/fusion.py: the compiled elementwise chains and the zero-padded odd-width MLP compute what the eager model
computes (fp32, CPU), forward and backward, and a new shape does not recompile."""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.nn.functional as F

from torchplex.models import fusion
from torchplex.models.activations import activation
from torchplex.models.qwen2_5_vl.args import FLAVORS
from torchplex.models.qwen2_5_vl.model import GatedMLP, Qwen2_5_VLModel

TOL = dict(rtol=1e-5, atol=1e-6)


@pytest.fixture
def fused():
    """Fusion on for one test, off again after it (a process-wide switch)."""
    def on(backend="aot_eager"):
        fusion.enable(True, backend=backend)
    yield on
    fusion.enable(False)


def test_aligned_width_pads_only_odd_widths_and_only_with_fusion_on(fused):
    assert fusion.aligned_width(3420) == 3420  # off: the checkpoint's width
    fused()
    assert [fusion.aligned_width(w) for w in (3420, 18944, 128, 60, 1)] == [3456, 18944, 128, 64, 64]


def test_padded_mlp_gives_the_same_outputs_and_gradients_and_keeps_its_shapes(fused, monkeypatch):
    torch.manual_seed(0)
    mlp = GatedMLP(24, 52, bias=True)  # 52: not a multiple of 8, runs at 64
    x = torch.randn(7, 24, requires_grad=True)

    def run():
        mlp.zero_grad(set_to_none=True)
        x.grad = None
        out = mlp(x)
        (out * torch.linspace(-1, 1, out.numel()).view_as(out)).sum().backward()
        return out.detach(), x.grad.clone(), {n: p.grad.clone() for n, p in mlp.named_parameters()}

    ref = run()
    fused()
    got = run()
    torch.testing.assert_close(got[0], ref[0], **TOL)
    torch.testing.assert_close(got[1], ref[1], **TOL)
    for name, grad in ref[2].items():
        assert got[2][name].shape == grad.shape == dict(mlp.named_parameters())[name].shape
        torch.testing.assert_close(got[2][name], grad, **TOL)
    # the padding is really used: the hidden width the down projection sees is 64
    seen = []
    original = F.linear
    monkeypatch.setattr(F, "linear", lambda inp, w, b=None: seen.append(tuple(w.shape)) or original(inp, w, b))
    mlp(x)
    assert (24, 64) in seen and (64, 24) in seen


def test_compiled_chains_match_eager_and_a_new_shape_does_not_recompile(fused):
    """Inductor's kernels (CPU here) against the eager definitions without grad, where they run; dynamic shapes:
    the second batch shape reuses the first compilation (a recompile per micro-batch would cost seconds each).
    With grad enabled the eager chains run: nothing is compiled."""
    from torch._dynamo.utils import counters

    fused("inductor")
    silu = activation("silu")

    def chains(T, eager):
        g = torch.Generator().manual_seed(T)
        x, w = torch.randn(2, T, 16, generator=g), torch.randn(16, generator=g)
        q, k = torch.randn(2, 4, T, 8, generator=g), torch.randn(2, 2, T, 8, generator=g)
        cos, sin = torch.randn(2, 1, T, 8, generator=g), torch.randn(2, 1, T, 8, generator=g)
        a, b = torch.randn(T, 12, generator=g), torch.randn(T, 12, generator=g)
        if eager:
            return [fusion.rms_norm_eager(x, w, 1e-6), *fusion.rotary_eager(q, k, cos, sin),
                    *fusion.rotary_fp32_eager(q, k, cos, sin), fusion.gated_eager(a, b, silu)]
        return [fusion.rms_norm(x, w, 1e-6), *fusion.rotary(q, k, cos, sin),
                *fusion.rotary_fp32(q, k, cos, sin), fusion.gated(a, b, silu)]

    for T in (5, 9):
        before = counters["frames"]["ok"]
        with torch.no_grad():
            got, ref = chains(T, eager=False), chains(T, eager=True)
        for g_, r_ in zip(got, ref):
            torch.testing.assert_close(g_, r_, **TOL)
        if T == 5:
            assert counters["frames"]["ok"] > before  # compiled
        else:
            assert counters["frames"]["ok"] == before, "a new sequence length recompiled a chain"
    before = counters["frames"]["ok"]
    x = torch.randn(3, 7, 16, requires_grad=True)
    fusion.rms_norm(x, torch.ones(16), 1e-6).sum().backward()
    assert counters["frames"]["ok"] == before and x.grad is not None  # with grad: eager


def test_model_with_fusion_and_an_odd_vision_width_trains_like_the_eager_model(fused):
    """The tiny model with a 108-wide vision MLP (padded to 128): same hidden states and gradients, and the same
    hidden states without grad, where the chains run compiled."""
    base = FLAVORS["debug"]
    args = dataclasses.replace(base, vision=dataclasses.replace(base.vision, intermediate_size=108),
                               image_token_id=10, vision_start_token_id=11, vision_end_token_id=12)
    torch.manual_seed(0)
    model = Qwen2_5_VLModel(args)
    model.init_weights(generator=torch.Generator().manual_seed(0))
    v = args.vision
    grid = torch.tensor([[1, 4, 4]])
    pixels = torch.randn(16, v.in_channels * v.temporal_patch_size * v.patch_size ** 2)
    ids = torch.tensor([[5, 6, args.vision_start_token_id] + [args.image_token_id] * 4 + [args.vision_end_token_id, 9]])

    def run():
        model.zero_grad(set_to_none=True)
        h = model(ids, image_embeds=model.encode_vision(pixels, grid))
        model.logits(h).float().logsumexp(-1).sum().backward()
        return h.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    ref = run()
    fused()
    got = run()
    torch.testing.assert_close(got[0], ref[0], rtol=1e-5, atol=1e-5)
    assert got[1].keys() == ref[1].keys() and any(k.startswith("visual.blocks") for k in ref[1])
    for name in ref[1]:
        torch.testing.assert_close(got[1][name], ref[1][name], rtol=1e-5, atol=1e-5, msg=name)
    with torch.no_grad():  # where the chains run compiled (the rollout prefill, reference scoring)
        scored = model(ids, image_embeds=model.encode_vision(pixels, grid))
    torch.testing.assert_close(scored, ref[0], rtol=1e-5, atol=1e-5)


def test_a_batched_forward_with_grad_runs_the_compiled_chains_and_its_recompute_replays_them(fused):
    """fusion.batched_forward (the fused prefill, the batched actor prefix): the chains run compiled with grad too,
    and a checkpointed model's backward, outside the context, recomputes with the compiled chains as its forward
    did (compiled and eager chains save different tensors: a recompute with the other kind fails checkpoint's
    check). Hidden states and gradients are those of the eager model."""
    from torch._dynamo.utils import counters

    from torchplex.models.qwen2_5_vl.parallelize import apply_activation_checkpointing

    args = dataclasses.replace(FLAVORS["debug"], image_token_id=10, vision_start_token_id=11, vision_end_token_id=12)
    torch.manual_seed(0)
    model = Qwen2_5_VLModel(args)
    model.init_weights(generator=torch.Generator().manual_seed(0))
    apply_activation_checkpointing(model)
    ids = torch.tensor([[5, 6, 7, 8, 9, 13, 14]])

    def run(batched):
        model.zero_grad(set_to_none=True)
        with fusion.batched_forward() if batched else torch.enable_grad():
            h = model(ids)
        model.logits(h).float().logsumexp(-1).sum().backward()  # outside the context: the recompute runs here
        return h.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    ref = run(False)
    fused("aot_eager")
    before = counters["frames"]["ok"]
    eager_again = run(False)  # fusion on, with grad, no context: eager chains, nothing compiled
    assert counters["frames"]["ok"] == before
    got = run(True)
    assert counters["frames"]["ok"] > before  # compiled with grad inside the context
    for out in (eager_again, got):
        torch.testing.assert_close(out[0], ref[0], rtol=1e-5, atol=1e-5)
        for name in ref[1]:
            torch.testing.assert_close(out[1][name], ref[1][name], rtol=1e-5, atol=1e-5, msg=name)
