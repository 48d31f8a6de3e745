"""Issue 16, defect 1: the sampler must never leave the distribution it reports.

The uniforms behind the Gumbel noise used to reach exactly 1.0 (((bits >> 8) + 0.5) / 2**24 rounds its largest value
up in float32), giving +inf noise: that token won whatever its probability, also when top-k/top-p had removed it,
once per 2**24 vocabulary entries (0.9 % of draws at Qwen2.5's 152,064). Three kinds of check:
- every possible hash value maps strictly inside (0, 1) with finite noise (exhaustive over the bits used);
- at V = 152,064, hashes at the extremes are forced onto chosen tokens by inverting MurmurHash3's finaliser, so
  the old failure happens on every such draw instead of on 1 in 2**24 entries;
- >= 100,000 draws per setting follow the reported distribution (support, finite log-probs, chi-square), eagerly
  and compiled.
"""
import pytest
import torch

from torchplex.rollout.sampling import (UNIFORM_BITS, SamplingParams, gumbel_noise, processed_logprobs, sample,
                                        unit_interval, uniform_noise)

M32 = 0xFFFFFFFF
C1, C2, WEYL = 0x85EBCA6B, 0xC2B2AE35, 0x9E3779B9
QWEN_VOCAB = 152_064


# ---- MurmurHash3's fmix32 and its inverse in plain Python, written from the published finaliser --------------
def fmix32(x: int) -> int:
    x ^= x >> 16
    x = (x * C1) & M32
    x ^= x >> 13
    x = (x * C2) & M32
    return x ^ (x >> 16)


def unfmix32(x: int) -> int:
    x ^= x >> 16  # a shift by >= half the width undoes itself
    x = (x * pow(C2, -1, 1 << 32)) & M32
    x ^= (x >> 13) ^ (x >> 26)
    x = (x * pow(C1, -1, 1 << 32)) & M32
    return x ^ (x >> 16)


def seed_step_hitting(token: int, bits: int, seed: int) -> tuple[int, int]:
    """(seed, step) whose hash of `token` is `bits`: the decode step is free, so solve uniform_noise's key for it."""
    key = (unfmix32(bits) - token * WEYL) & M32
    a = fmix32((seed & M32) ^ fmix32((seed >> 32) & M32))
    return seed, unfmix32(key) ^ a


TOP = M32  # the largest hash: the old construction's u == 1.0
BOTTOM = 0  # the smallest: u -> 0


def test_inverted_finaliser_reproduces_uniform_noise():
    """The helper really forces the hash (else the tests below would test nothing)."""
    assert all(unfmix32(fmix32(x)) == x for x in (0, 1, 12345, M32, 0xDEADBEEF))
    for token, bits in ((5, TOP), (QWEN_VOCAB - 1, TOP), (77_777, BOTTOM)):
        seed, step = seed_step_hitting(token, bits, seed=3 * 1_000_003 + 7)
        u = uniform_noise(torch.tensor([seed]), torch.tensor([step]), token + 1)[0, token]
        assert u.item() == unit_interval(torch.tensor([bits], dtype=torch.long)).item()


def test_every_hash_maps_strictly_inside_the_unit_interval_with_finite_noise():
    """Defect 1: all 2**23 values of the bits used (with the dropped low bits all 0 and all 1) give 0 < u < 1 in
    float32 and finite Gumbel noise; the extremes are 2**-24 and 1 - 2**-24."""
    k = torch.arange(1 << UNIFORM_BITS, dtype=torch.long) << (32 - UNIFORM_BITS)
    for bits in (k, k | ((1 << (32 - UNIFORM_BITS)) - 1)):
        u = unit_interval(bits)
        assert u.dtype == torch.float32
        assert u.min().item() == 2.0 ** -24 and u.max().item() == 1.0 - 2.0 ** -24
        assert u.unique().numel() == 1 << UNIFORM_BITS  # no two hashes collapse onto one value
        noise = gumbel_noise(u)
        assert torch.isfinite(noise).all()
    assert gumbel_noise(torch.tensor([2.0 ** -24, 1 - 2.0 ** -24])).tolist() == pytest.approx([16.6355, -2.8114],
                                                                                              abs=1e-3)


def _rows(kind: str, vocab: int, winner: int) -> tuple[torch.Tensor, SamplingParams]:
    g = torch.Generator().manual_seed(vocab)
    if kind == "greedy-peaked":  # all mass on one token
        logits = torch.full((vocab,), float("-inf"))
        logits[winner] = 0.0
        return logits, SamplingParams(temperature=1.0)
    if kind == "peaked":  # every other token ~e**-40 of it: none may ever be drawn
        logits = torch.zeros(vocab)
        logits[winner] = 40.0
        return logits, SamplingParams(temperature=1.0)
    logits = torch.randn(vocab, generator=g) - 15.0  # a tail of ~1e-4 of the mass even at 152,064 entries
    logits[winner:winner + 3] = torch.tensor([6.0, 5.9, 5.8])
    if kind == "top-k 1":
        return logits, SamplingParams(temperature=1.3, top_k=1)
    if kind == "top-p 0.5":  # the nucleus is the first two (mass before the third ~0.69 > 0.5)
        return logits, SamplingParams(temperature=0.9, top_p=0.5)
    raise ValueError(kind)


@pytest.mark.parametrize("kind", ["greedy-peaked", "peaked", "top-k 1", "top-p 0.5"])
def test_extreme_hashes_never_leave_the_support_at_qwen_vocabulary(kind):
    """Defect 1 at V = 152,064: draws whose hash is the largest possible on a token outside the support (masked by
    -inf, by top-k or top-p, or of probability ~e**-40), and the smallest possible on the support's own token,
    still draw from the support with a finite log-prob. The old construction drew the outside token every time."""
    winner = 100_000
    logits, params = _rows(kind, QWEN_VOCAB, winner)
    support = processed_logprobs(logits[None], params)[0] > -30  # the tokens that may be drawn at all
    assert 1 <= int(support.sum()) <= 2
    outsiders = [0, 5, 2047, 2048, 99_999, winner + 2, QWEN_VOCAB - 1]
    pairs = [seed_step_hitting(t, TOP, seed=11 * 1_000_003 + j) for j, t in enumerate(outsiders)]
    pairs.append(seed_step_hitting(winner, BOTTOM, seed=5))  # the support's token at its smallest noise
    seeds, steps = (torch.tensor(list(c)) for c in zip(*pairs))
    tokens, logps = sample(logits.expand(len(pairs), -1), params, seeds, steps)
    assert support[tokens].all(), tokens
    assert torch.isfinite(logps).all()
    torch.testing.assert_close(logps, processed_logprobs(logits[None], params)[0][tokens])


def chi_square_p_value(counts: torch.Tensor, probs: torch.Tensor, draws: int, min_expected: float = 5.0) -> float:
    """Pearson's goodness-of-fit p-value; bins expected below `min_expected` are pooled into one (the usual rule).
    The chi-square survival function at x with df degrees of freedom is the regularised upper incomplete gamma
    function Q(df / 2, x / 2)."""
    expected = probs.double() * draws
    big = expected >= min_expected
    obs = torch.cat([counts[big].double(), counts[~big].double().sum()[None]])
    exp = torch.cat([expected[big], expected[~big].sum()[None]])
    if exp[-1] < min_expected:  # the pooled bin too small: fold it into the smallest kept bin
        obs[-2] += obs[-1]
        exp[-2] += exp[-1]
        obs, exp = obs[:-1], exp[:-1]
    stat = ((obs - exp) ** 2 / exp).sum()
    df = obs.numel() - 1
    return float(torch.special.gammaincc(torch.tensor(df / 2, dtype=torch.float64), stat / 2))


def test_chi_square_rejects_a_wrong_distribution():
    """The goodness-of-fit check has power: draws of a slightly different distribution fail it."""
    p = torch.softmax(torch.randn(50, generator=torch.Generator().manual_seed(1)), 0)
    q = torch.softmax(torch.log(p) + 0.15 * torch.randn(50, generator=torch.Generator().manual_seed(2)), 0)
    counts = torch.bincount(torch.multinomial(q, 100_000, replacement=True,
                                              generator=torch.Generator().manual_seed(3)), minlength=50)
    assert chi_square_p_value(counts, p, 100_000) < 1e-6
    counts = torch.bincount(torch.multinomial(p, 100_000, replacement=True,
                                              generator=torch.Generator().manual_seed(3)), minlength=50)
    assert chi_square_p_value(counts, p, 100_000) > 1e-3


DRAWS = 100_000
VOCAB = 128  # 100,000 full rows per setting at 152,064 entries take an hour of CPU; the extremes are forced above


@pytest.mark.parametrize("kind", ["greedy-peaked", "top-k 1", "top-p 0.5", "plain"])
def test_many_draws_stay_in_the_support_and_follow_the_reported_distribution(kind):
    """Defect 1: 100,000 draws (one seed each, and decode steps that differ) never leave the support, every log-prob
    is finite and equals the reported probability's log, and a chi-square test of the draws against the reported
    probabilities passes (p > 1e-3; fixed seeds, so the outcome is deterministic)."""
    if kind == "plain":
        logits, params = torch.randn(VOCAB, generator=torch.Generator().manual_seed(4)) * 2, SamplingParams()
    else:
        logits, params = _rows(kind, VOCAB, winner=37)
    probs = processed_logprobs(logits[None], params)[0].exp()
    seeds = torch.arange(DRAWS) + 9 * 1_000_003
    tokens, logps = sample(logits.expand(DRAWS, -1), params, seeds, seeds % 97)
    assert (probs[tokens] > 0).all()
    assert torch.isfinite(logps).all()
    torch.testing.assert_close(logps, probs[tokens].log(), rtol=1e-5, atol=1e-6)
    counts = torch.bincount(tokens, minlength=VOCAB)
    if kind in ("greedy-peaked", "top-k 1"):
        assert counts.max().item() == DRAWS
    else:
        assert chi_square_p_value(counts, probs, DRAWS) > 1e-3


@pytest.mark.slow  # one inductor compile of `sample`: ~40 s of C++ compilation on 2 cores
def test_compiled_sampling_draws_what_eager_sampling_draws():
    """Defect 1 in compiled decode: torch.compile'd `sample` gives eager's tokens and log-probs, on random rows and
    on rows whose hashes are forced to the extremes on tokens outside a top-k set (chunked vocabulary: 6,000)."""
    vocab, rows = 6000, 64
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(0)) * 3
    params = SamplingParams(temperature=0.8, top_k=3)
    seeds, steps = torch.arange(rows) + 1_000_003, torch.arange(rows) % 7
    forced = [seed_step_hitting(t, TOP, seed=t) for t in (1, 2999, vocab - 1)]
    seeds[:3], steps[:3] = torch.tensor([s for s, _ in forced]), torch.tensor([s for _, s in forced])
    compiled = torch.compile(sample, dynamic=False)
    tokens, logps = sample(logits, params, seeds, steps)
    c_tokens, c_logps = compiled(logits, params, seeds, steps)
    assert torch.equal(c_tokens, tokens)
    torch.testing.assert_close(c_logps, logps, rtol=1e-5, atol=1e-6)
    allowed = processed_logprobs(logits, params) > float("-inf")
    assert allowed.gather(-1, tokens[:, None]).all() and torch.isfinite(logps).all()
