"""Sampling: logits processing, batch-independent random numbers, and the log-prob of what was drawn.

Each sample draws with a counter-based generator keyed on (its seed, its decode step, the token id), so its
tokens do not depend on which other sequences share the batch or on the order they arrived in, and no host
generator state is touched per token. Sampling is Gumbel-max over the processed distribution:
    logits / temperature -> top-k -> top-p -> log_softmax -> argmax(logp + Gumbel noise)
and the returned log-prob is that log_softmax at the drawn token, i.e. the log-probability under the
distribution actually sampled from. `processed_logprobs` applies the same processing to teacher-forced
logits, so rollout and scoring agree exactly. Greedy decoding returns log_softmax(logits) at temperature 1.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch
import torch.nn.functional as F


@dataclass
class SamplingParams:
    n: int = 1
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0: off
    greedy: bool = False
    max_new_tokens: int = 32
    stop_token_ids: list[int] = field(default_factory=list)
    seed: int = 0

    def __post_init__(self) -> None:
        if self.n < 1:
            raise ValueError(f"SamplingParams.n must be >= 1, got {self.n}")
        if not self.greedy and self.temperature <= 0:
            raise ValueError(f"SamplingParams.temperature must be > 0 (or greedy=True), got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"SamplingParams.top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < 0 or self.max_new_tokens < 1:
            raise ValueError("SamplingParams.top_k must be >= 0 and max_new_tokens >= 1")


def sample_seeds(seed: int, n: int, prompt_indices: Sequence[int]) -> list[list[int]]:
    """The n samples' seeds of each prompt, keyed on (the step's seed, the prompt's index, the sample). Keyed on a
    prompt's index in the whole batch, a prompt draws the same samples whichever rank or replica samples it."""
    return [[seed * 1_000_003 + g * n + j for j in range(n)] for g in prompt_indices]


def filter_logits(logits: torch.Tensor, temperature: float = 1.0, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """fp32 logits / temperature with everything outside top-k, then outside the top-p nucleus, set to -inf."""
    logits = logits.float() / temperature
    if top_k and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[..., -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if top_p < 1.0:
        sorted_logits, order = torch.sort(logits, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        mass_before = torch.cumsum(probs, dim=-1) - probs
        drop_sorted = mass_before > top_p  # the token that crosses top_p is kept, the first is always kept
        drop = torch.zeros_like(drop_sorted).scatter(-1, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def processed_logprobs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Log-probabilities of the distribution `sample` draws from, for every vocabulary entry."""
    if params.greedy:
        return torch.log_softmax(logits.float(), dim=-1)
    return torch.log_softmax(filter_logits(logits, params.temperature, params.top_k, params.top_p), dim=-1)


_M32 = 0xFFFFFFFF


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2**32 for 0 <= x < 2**32, in int64 without ever overflowing (signed overflow is undefined in
    the C++ that torch.compile generates on CPU, and gave wrong samples there)."""
    return (x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & _M32


def _fmix32(x: torch.Tensor) -> torch.Tensor:
    """MurmurHash3's 32-bit finaliser on values in [0, 2**32)."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x85EBCA6B)
    x = x ^ (x >> 13)
    x = _mul32(x, 0xC2B2AE35)
    return x ^ (x >> 16)


UNIFORM_BITS = 23  # k + 0.5 for k < 2**23 needs 24 significant bits: exact in float32, so is the division


def unit_interval(bits: torch.Tensor) -> torch.Tensor:
    """32-bit hashes -> float32 uniforms on the grid (k + 0.5) / 2**23, k < 2**23, from the top 23 bits.

    Every value is exact, so the extremes are 2**-24 and 1 - 2**-24, strictly inside (0, 1). (The earlier 24-bit
    version, ((bits >> 8) + 0.5) / 2**24, needed 25 significant bits: its largest value rounded to exactly 1.0,
    whose Gumbel noise is +inf, and that token won whatever its probability, once per 2**24 vocabulary entries.)"""
    return ((bits >> (32 - UNIFORM_BITS)).float() + 0.5) / float(1 << UNIFORM_BITS)


def uniform_noise(seeds: torch.Tensor, steps: torch.Tensor, vocab: int) -> torch.Tensor:
    """(S, vocab) uniforms strictly inside (0, 1), a pure function of (seed, step, token id): a per-(seed, step)
    key, then one finaliser over a Weyl sequence of the token ids (the construction of SplitMix)."""
    seeds, steps = seeds.long(), steps.long()
    key = _fmix32(_fmix32((seeds & _M32) ^ _fmix32((seeds >> 32) & _M32)) ^ (steps & _M32))
    token = _mul32(torch.arange(vocab, device=seeds.device), 0x9E3779B9)
    return unit_interval(_fmix32((key[:, None] + token) & _M32))


def gumbel_noise(uniforms: torch.Tensor) -> torch.Tensor:
    """Gumbel(0, 1) noise -log(E) of uniforms u in (0, 1), with the exponential E = -log(1 - u) taken by log1p.

    1 - u is as uniform as u, and log1p stays accurate where u is tiny (E ~ u, down to 2**-24), where -log(u) of a
    u near 1 would rest on a logarithm accurate near 1 (approximate GPU logarithms may return 0 there, giving +inf
    noise again). For the grid of `unit_interval`, E is in [5.96e-8, 16.64], so the noise is finite and in
    [-2.81, 16.64]: a token masked to -inf never wins, and a token more than 19.4 nats below the row's best can
    never be drawn (its probability is below e**-19.4 ~ 3.7e-9 of the best's; the 23-bit grid cannot resolve it)."""
    return -torch.log(-torch.log1p(-uniforms))


# Reductions over the vocabulary run in chunks, then over the chunks: a decode step has few rows (one per sequence)
# and 152k entries per row, and a one-pass argmax gets one GPU block per row (inductor does not split arg-reductions),
# which leaves most SMs idle. A chunk length that divides the vocabulary needs no padding, so the noise is computed
# inside the chunked reduction instead of being written out first: one kernel for Qwen2.5's 152,064 entries (44 chunks
# of 3,456), most of it the int64 hashing.
VOCAB_CHUNK = 2048


def _chunk_length(vocab: int) -> int:
    """The largest divisor of vocab in [VOCAB_CHUNK / 2, 2 * VOCAB_CHUNK], else VOCAB_CHUNK (with padding)."""
    for length in range(2 * VOCAB_CHUNK, VOCAB_CHUNK // 2 - 1, -1):
        if vocab % length == 0:
            return length
    return VOCAB_CHUNK


def _by_chunks(x: torch.Tensor) -> tuple[torch.Tensor, int]:
    """(S, V) -> (S, chunks, length), padded with -inf where length does not divide V; and the length."""
    length = _chunk_length(x.shape[-1])
    pad = -x.shape[-1] % length
    if pad:
        x = F.pad(x, (0, pad), value=float("-inf"))
    return x.view(x.shape[0], -1, length), length


def chunked_argmax(x: torch.Tensor) -> torch.Tensor:
    """torch.argmax(x, -1) of (S, V), the first maximal entry, computed per chunk and then over the chunks."""
    if x.shape[-1] <= 2 * VOCAB_CHUNK:
        return x.argmax(-1)
    chunks, length = _by_chunks(x)
    best, where = chunks.max(-1)  # the first maximum in each chunk
    chunk = best.argmax(-1, keepdim=True)  # the first chunk holding the overall maximum
    return (chunk * length + where.gather(-1, chunk)).squeeze(-1)


def chunked_logsumexp(x: torch.Tensor) -> torch.Tensor:
    """torch.logsumexp(x, -1) of (S, V), per chunk and then over the chunks (equal up to fp32 rounding)."""
    if x.shape[-1] <= 2 * VOCAB_CHUNK:
        return torch.logsumexp(x, -1)
    return torch.logsumexp(torch.logsumexp(_by_chunks(x)[0], -1), -1)


def sample(logits: torch.Tensor, params: SamplingParams, seeds: torch.Tensor, steps: torch.Tensor
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw one token per row of logits (S, V); return (tokens (S,), their log-probs (S,)).

    The log-prob is log_softmax of the processed logits at the drawn token; the argmax of logp + Gumbel noise is
    that of the processed logits + noise (log_softmax only shifts a row), so the full log_softmax is never formed."""
    if params.greedy:
        scores = logits.float()
        tokens = chunked_argmax(logits)
    else:
        scores = filter_logits(logits, params.temperature, params.top_k, params.top_p)
        gumbel = gumbel_noise(uniform_noise(seeds, steps, logits.shape[-1]))
        tokens = chunked_argmax(scores + gumbel)
    picked = scores.gather(-1, tokens[:, None]).squeeze(-1)
    return tokens, picked - chunked_logsumexp(scores)
