"""Decomposed training backpropagates the suffixes first, with the prefix tensors they read detached as leaves, then
the prefix from those leaves' gradients (`DecomposedScorer.backward`). Each weight's suffix gradient therefore goes
into .grad at once instead of waiting in autograd's input buffer for the prefix part: the train phase no longer
holds an extra bf16 copy of every shared weight's gradient (decoder layers + token embeddings, 13.2 GiB at 7B).

The numbers are unchanged (tests/test_decomposition.py, test_overlap.py hold them to the serial step); here: the
memory (a CPU count of live tensor bytes over the real train phase, tests/live_bytes.py) and the
order of the two parts, for a prefix computed in the scorer and for one held from the fused rollout prefill.
"""

from __future__ import annotations

import copy

import pytest
import torch

import live_bytes as probe
import train_activation_estimate as estimate
from torchplex.models.qwen2_5_vl.parallelize import apply_activation_checkpointing
from torchplex.runtime.decomposition import DecomposedScorer
from torchplex.runtime.prefixes import fused_prefill
from torchplex.runtime.scoring import ScoreRequest

# Two micro-batches of one group each: the second finds .grad already there, which is when the pending copy was
# extra (the first one's pending buffer simply became .grad).
SIZES = dict(prompts=2, group=4, prompt_tokens=64, response=16, micro_batch=4)


def test_split_backward_lowers_the_train_peak_by_the_pending_gradient_copy():
    args = probe.WEIGHT_HEAVY
    split = probe.measure(args, **SIZES)
    one = probe.measure(args, **SIZES, split_prefix_backward=False)
    assert split["grads_bytes"] == one["grads_bytes"]
    gain = one["peak_bytes"] - split["peak_bytes"]
    shared = probe.shared_grad_bytes(args.text)  # 77.0 MiB: 8 layers of (2h^2 + 2h.kv + 3h.I) + V.h, bf16
    plan = dict(prompt_tokens=split["prompt_tokens"], group=SIZES["group"], response=SIZES["response"],
                micro_batch=SIZES["micro_batch"], checkpointing=True, vision_trainable=True)
    before = estimate.train_activation_bytes(args, **plan, pending_suffix_grads=True)
    after = estimate.train_activation_bytes(args, **plan)
    # expected gain = shared + one weight's out-of-place sum + the backward moment's own terms - the new largest
    # moment (here the LM head's backward) = 71.5 MiB; measured 70.3 MiB
    expected = before["total"] - after["total"]
    assert gain == pytest.approx(expected, rel=0.10), (gain / 2**20, expected / 2**20)
    assert gain >= 0.85 * shared, (gain / 2**20, shared / 2**20)


@pytest.fixture(scope="module")
def assets(grpo_assets):
    return grpo_assets.prompts, grpo_assets.actor


def held_prefix_request(scorer, actor, prompts, group=3, width=5, seed=0):
    """The fused rollout prefill's prefixes (autograd kept, held in the store) and G random responses each."""
    fused_prefill(scorer, actor, scorer.store)(prompts)
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(10, 1000, (group * len(prompts), width), generator=g)
    lengths = torch.randint(1, width + 1, (group * len(prompts),), generator=g)
    return ScoreRequest(prompts, [s // group for s in range(len(tokens))], tokens, lengths)


def weighted_sum(logp, mask):
    return (logp * mask * torch.linspace(0.5, 1.5, logp.shape[1])).sum()


@pytest.mark.parametrize("checkpointing", [False, True])
def test_held_prefix_backward_runs_after_every_suffix_gradient_is_accumulated(assets, monkeypatch, checkpointing):
    """Overlapped mode's fused prefix (held in the PrefixStore): the same two parts, the same gradients as one
    backward through prefix and suffixes (fp32, rel 1e-5); also with the prefix and every layer checkpointed
    (recomputed inside the two backwards)."""
    prompts, base = assets[0][:2], assets[1]
    grads = {}
    for split in (True, False):
        actor = copy.deepcopy(base).requires_grad_(True)
        if checkpointing:
            apply_activation_checkpointing(actor)
        scorer = DecomposedScorer(split_prefix_backward=split, checkpoint_prefix=checkpointing)
        request = held_prefix_request(scorer, actor, prompts)
        logp, _ = scorer.score(actor, request, temperature=1.0)
        assert scorer.store.served == 1 and len(scorer.store) == 0  # the held prefixes were used, not recomputed
        calls = []
        backward = torch.autograd.backward

        def recording(tensors, *a, **kw):
            calls.append({n for n, p in actor.named_parameters() if p.grad is not None})
            return backward(tensors, *a, **kw)

        monkeypatch.setattr(torch.autograd, "backward", recording)
        scorer.backward(weighted_sum(logp, request.mask))
        scorer.finish_backward()  # the two prompts' prefixes are slices of one batched graph: their part comes here
        monkeypatch.undo()
        grads[split] = {n: p.grad.clone() for n, p in actor.named_parameters() if p.grad is not None}
        if split:
            assert len(calls) == 2 and not calls[0]
            shared = {n for n in grads[split] if n.startswith("layers.") or n == "tok_embeddings.weight"}
            assert shared and shared <= calls[1]  # every shared weight holds its suffix part at the prefix's start
            assert not any(n.startswith("visual.") for n in calls[1])  # the tower is reached by the prefix part
        else:
            assert len(calls) == 1
    assert set(grads[True]) == set(grads[False])
    assert any(n.startswith("visual.") for n in grads[True])
    for name, g in grads[False].items():
        err = ((grads[True][name] - g).abs().max() / g.abs().max().clamp_min(1e-30)).item()
        assert err < 1e-5, name


def test_a_plain_backward_of_a_split_score_is_refused(assets):
    """loss.backward() would stop at the detached prefix leaves: the next score says so instead of training
    without the prefix's gradients."""
    prompts, base = assets[0][:1], assets[1]
    actor = copy.deepcopy(base)
    scorer = DecomposedScorer()
    request = held_prefix_request(scorer, actor, prompts)
    logp, _ = scorer.score(actor, request, temperature=1.0)
    weighted_sum(logp, request.mask).backward()
    with pytest.raises(RuntimeError, match="scorer.backward"):
        scorer.score(actor, held_prefix_request(scorer, actor, prompts), temperature=1.0)
