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

import torch


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


_M1 = -4658895280553007687  # 0xbf58476d1ce4e5b9 as int64
_M2 = -7723592293110705685  # 0x94d049bb133111eb as int64
_GOLDEN = -7046029254386353131  # 0x9e3779b97f4a7c15 as int64


def _mix(x: torch.Tensor) -> torch.Tensor:
    """splitmix64 finaliser on int64 (arithmetic shifts masked to act as logical shifts)."""
    x = x ^ ((x >> 30) & ((1 << 34) - 1))
    x = x * _M1
    x = x ^ ((x >> 27) & ((1 << 37) - 1))
    x = x * _M2
    return x ^ ((x >> 31) & ((1 << 33) - 1))


def uniform_noise(seeds: torch.Tensor, steps: torch.Tensor, vocab: int) -> torch.Tensor:
    """(S, vocab) uniforms in (0, 1), a pure function of (seed, step, token id)."""
    key = _mix(seeds.long() * _GOLDEN + steps.long())
    x = _mix(key[:, None] + torch.arange(vocab, device=seeds.device) * _GOLDEN)
    bits = (x >> 40) & ((1 << 24) - 1)
    return (bits.float() + 0.5) / float(1 << 24)


def sample(logits: torch.Tensor, params: SamplingParams, seeds: torch.Tensor, steps: torch.Tensor
           ) -> tuple[torch.Tensor, torch.Tensor]:
    """Draw one token per row of logits (S, V); return (tokens (S,), their log-probs (S,))."""
    logp = processed_logprobs(logits, params)
    if params.greedy:
        tokens = torch.argmax(logits, dim=-1)
    else:
        gumbel = -torch.log(-torch.log(uniform_noise(seeds, steps, logits.shape[-1])))
        tokens = torch.argmax(logp + gumbel, dim=-1)
    return tokens, logp.gather(-1, tokens[:, None]).squeeze(-1)
