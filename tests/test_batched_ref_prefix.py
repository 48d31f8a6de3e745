"""runtime.batched_ref_prefix: the reference prefixes of a step's prompts run in batched no-grad forwards at the
start of the ref stage (one per group of similar lengths) and serve the suffix micro-batches. The reference
log-probs and the step are those of one prefix forward per micro-batch (fp32, CPU); the schedule says when it does
not batch and why; the memory budget counts the held K/V in the ref stage."""

from __future__ import annotations

import pytest
import torch

from step_runners import cpu_runner, run_recording
from torchplex.rollout.sampling import SamplingParams
from torchplex.data.batching import length_groups
from torchplex.runtime.prefixes import PrefixStore, hold_prefixes, prompt_length
from torchplex.runtime.decomposition import DecomposedScorer


@pytest.fixture(scope="module")
def setup(grpo_assets):
    return grpo_assets.processor, grpo_assets.prompts, grpo_assets.actor, grpo_assets.reference


def counted_prefixes(model) -> list[int]:
    """Batch sizes of the model's prefix forwards from now on (an instance attribute shadows the method)."""
    calls, original = [], model.prefix_forward

    def prefix_forward(input_ids, *args, **kwargs):
        calls.append(input_ids.shape[0])
        return original(input_ids, *args, **kwargs)

    model.prefix_forward = prefix_forward
    return calls


def step(setup, mode, batched, **settings):
    runner = cpu_runner(setup, mode, budget=2**40, micro_batch=4, kv_pool=2 * 2**20,
                        plan_options={"batched_ref_prefix": batched}, **settings)
    calls = counted_prefixes(runner.reference)
    out = run_recording(runner, setup, runner.reference.layers[0], lambda args: None)
    return out, calls


@pytest.mark.parametrize("mode", ["decomposed", "overlapped"])
def test_batched_reference_prefixes_score_the_same_in_one_forward_per_length_group(setup, mode):
    base, base_calls = step(setup, mode, False)
    got, calls = step(setup, mode, True)
    prompts = setup[1]
    assert not base.plan.ref_prefix_batched and got.plan.ref_prefix_batched
    assert base_calls == [1] * len(prompts)  # micro-batch 4 = one prompt's group: one prefix forward each
    assert calls == [len(g) for g in length_groups(prompts, length=prompt_length)] and len(calls) < len(prompts)
    mask = base.experience.mask
    assert torch.equal(got.experience.tokens, base.experience.tokens)
    ref, new = base.experience.ref_logprobs[mask], got.experience.ref_logprobs[mask]
    assert ((new - ref).abs().max() / ref.abs().max()).item() < 1e-5
    assert abs(got.train.stats.loss - base.train.stats.loss) <= 1e-5 * abs(base.train.stats.loss) + 1e-9
    assert len(got.prefixes) == 0  # every held reference prefix was taken by its micro-batch
    assert any("reference prefixes batched" in r for r in got.plan.reasons)


def test_a_reference_micro_batch_smaller_than_a_group_keeps_one_prefix_per_micro_batch(setup):
    out, calls = step(setup, "decomposed", True, ref_micro_batch_size=2)  # groups of 4 scored in halves
    assert not out.plan.ref_prefix_batched
    assert any("not batched: reference micro-batches of 2 sequences < a group's 4" in r for r in out.plan.reasons)
    assert calls == [1] * (2 * len(setup[1]))  # each half runs its prompt's prefix, as before


def test_the_budget_counts_every_reference_prefix_in_the_ref_stage(setup):
    runner = cpu_runner(setup, "decomposed", budget=2**40, micro_batch=4, kv_pool=2 * 2**20)
    prompts, params = setup[1], SamplingParams(n=4, max_new_tokens=6)
    shape = runner.shape(prompts, params)
    budget = runner.memory.estimate(shape, runner.settings.plan)
    assert budget.residents["ref"]["ref_prefix_kv"] == shape.kv_bytes_per_token * shape.prefix_tokens > 0
    unbatched = cpu_runner(setup, "decomposed", budget=2**40, micro_batch=4, kv_pool=2 * 2**20,
                           plan_options={"batched_ref_prefix": False})
    assert "ref_prefix_kv" not in unbatched.memory.estimate(unbatched.shape(prompts, params), unbatched.settings.plan).residents["ref"]


def test_hold_prefixes_splits_a_group_by_tokens_and_holds_the_same_states(setup):
    """max_tokens cuts a length group into batches of at most that many padded tokens; each prompt's held state
    equals its own one-prompt prefix (fp32)."""
    prompts, reference = setup[1], setup[3]
    scorer = DecomposedScorer()
    store = PrefixStore()
    longest = max(len(p.input_ids) for p in prompts)
    calls = counted_prefixes(reference)
    try:
        forwards = hold_prefixes(scorer, reference, prompts, store, max_tokens=longest)  # one prompt per forward
        assert forwards == len(prompts) == len(calls) and calls == [1] * len(prompts)
        assert hold_prefixes(scorer, reference, prompts, store) == 0  # all held already: nothing runs
        for p in prompts:
            held = store.peek(reference, p)
            with torch.no_grad():
                alone = scorer.prefix(reference, [p])[0]
            for a, b in zip(held.k + held.v, alone.k + alone.v):
                torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    finally:
        del reference.prefix_forward


def test_the_config_key_reaches_the_plan():
    from torchplex.config import load_config
    from torchplex.runtime.build import plan_options

    assert plan_options(load_config([])).batched_ref_prefix is True  # on by default
    assert plan_options(load_config(["--runtime.batched_ref_prefix", "false"])).batched_ref_prefix is False
