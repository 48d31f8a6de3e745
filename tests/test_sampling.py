"""The sampler draws from the distribution it reports, and its chunked reductions equal the plain ones."""
import math

import pytest
import torch

from torchplex.rollout.sampling import (VOCAB_CHUNK, SamplingParams, chunked_argmax, chunked_logsumexp,
                                        processed_logprobs, sample)


# one pass (up to 2 chunks' worth); 6161 = 61 x 101 in padded chunks of VOCAB_CHUNK; 6000 in two chunks of 3000
@pytest.mark.parametrize("vocab", [VOCAB_CHUNK - 5, 2 * VOCAB_CHUNK, 3 * VOCAB_CHUNK + 17, 6000])
def test_chunked_reductions_equal_plain_ones(vocab):
    g = torch.Generator().manual_seed(vocab)
    x = torch.randn(6, vocab, generator=g)
    x[1, :] = 0.0  # all tied: the first entry
    x[2, :] = float("-inf")
    x[2, vocab - 1] = 1.0  # the only finite entry is the last one (inside the padded chunk)
    x[3, [7, vocab // 2, vocab - 2]] = 50.0  # tied maxima in different chunks: the first one
    assert torch.equal(chunked_argmax(x), x.argmax(-1))
    torch.testing.assert_close(chunked_logsumexp(x), torch.logsumexp(x, -1), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("params", [SamplingParams(temperature=1.0), SamplingParams(temperature=0.7, top_k=4),
                                    SamplingParams(temperature=1.3, top_p=0.8)])
def test_draws_follow_the_distribution_they_report(params):
    """8000 draws (one per seed) from one row of logits whose mass sits on a few tokens spread over several vocabulary
    chunks: each token's frequency is within 4.5 standard deviations of its processed probability, tokens outside
    the processed support are never drawn, and the returned log-prob is that probability's log."""
    vocab, draws = 3 * VOCAB_CHUNK + 100, 8000
    logits = torch.full((vocab,), -30.0)
    support = torch.tensor([3, VOCAB_CHUNK - 1, VOCAB_CHUNK, 2 * VOCAB_CHUNK + 5, vocab - 1])
    logits[support] = torch.tensor([1.0, 0.2, -0.5, 0.8, 0.0])
    rows = logits.expand(draws, vocab)
    tokens, logps = sample(rows, params, torch.arange(draws), torch.full((draws,), 3))
    expected = processed_logprobs(logits[None], params)[0].exp()
    counts = torch.bincount(tokens, minlength=vocab).double()
    drawn = expected > 1e-6
    assert counts[~drawn].sum() == 0
    p = expected[drawn].double()
    sigma = (p * (1 - p) / draws).sqrt()
    assert ((counts[drawn] / draws - p).abs() <= 4.5 * sigma).all(), (counts[drawn] / draws, p)
    torch.testing.assert_close(logps, expected[tokens].log(), rtol=1e-5, atol=1e-6)


def test_noise_depends_on_seed_and_step_only():
    """A row's draw does not depend on the other rows of the batch (continuous batching relies on it)."""
    logits = torch.randn(5, 3000, generator=torch.Generator().manual_seed(0))
    params = SamplingParams(temperature=1.0)
    seeds, steps = torch.tensor([11, 12, 13, 14, 15]), torch.tensor([0, 4, 4, 9, 2])
    tokens, logps = sample(logits, params, seeds, steps)
    for i in range(5):
        t, lp = sample(logits[i:i + 1], params, seeds[i:i + 1], steps[i:i + 1])
        assert t.item() == tokens[i].item() and math.isclose(lp.item(), logps[i].item(), rel_tol=1e-6)
    other, _ = sample(logits, params, seeds, steps + 1)
    assert not torch.equal(other, tokens)
