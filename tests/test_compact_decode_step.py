"""rollout.compact_decode through the GRPO step: the runtime's hooks (the fused prefill, samples reported as they
finish) see a compacted rollout as they see the full pool's, and the step gives the same losses and gradients."""

import pytest
import torch
from step_runners import cpu_runner

from torchplex.rollout.sampling import SamplingParams


@pytest.fixture(scope="module")
def setup(grpo_assets):
    return grpo_assets.processor, grpo_assets.prompts, grpo_assets.actor, grpo_assets.reference


@pytest.mark.parametrize("mode", ["decomposed", "overlapped"])
def test_a_step_with_compacted_decode_equals_the_full_pool_step(setup, mode):
    processor, prompts, actor, _ = setup
    vocab = actor.args.text.vocab_size
    eos = processor.tokenizer.convert_tokens_to_ids("<|im_end|>")
    # a quarter of the vocabulary stops a sample: responses of many lengths, so few samples are left at the end
    params = SamplingParams(n=4, max_new_tokens=10, seed=5, stop_token_ids=[eos, *range(vocab - vocab // 4, vocab)])
    runs = {}
    for compact in (False, True):
        runner = cpu_runner(setup, mode, budget=2**40, micro_batch=4, kv_pool=2 * 2**20)
        runner.engine.compact_decode = compact
        out = runner.run(prompts, [""] * len(prompts), params)
        runs[compact] = out, list(runner.optimizer.grads), runner.engine.stats.compactions
    (plain, plain_grads, none), (comp, comp_grads, moved) = runs[False], runs[True]
    assert none == 0 and moved == 1
    lengths = plain.experience.lengths
    assert lengths.min() < lengths.max()
    assert torch.equal(plain.experience.lengths, comp.experience.lengths)
    assert torch.equal(plain.experience.tokens, comp.experience.tokens)
    torch.testing.assert_close(comp.experience.sampling_logprobs, plain.experience.sampling_logprobs, rtol=1e-5,
                               atol=1e-6)
    torch.testing.assert_close(comp.experience.ref_logprobs, plain.experience.ref_logprobs, rtol=1e-5, atol=1e-6)
    assert comp.train.stats.loss.item() == pytest.approx(plain.train.stats.loss.item(), rel=1e-5, abs=1e-7)
    for a, b in zip(plain_grads, comp_grads):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-7)
