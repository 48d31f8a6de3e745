"""A step's samples and what every phase reads of them: the experience (responses, rewards, advantages, log-probs),
scoring requests over its samples, their micro-batches, and the reference's log-probs.

The phases only meet through `Experience`, and the log-prob computation is a pluggable `Scorer`, so the serial
baseline (full prompt+response forwards) and the decomposed runtime (prefix once per prompt) run the very same
step code and must produce the same numbers.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Sequence

import torch

from ..data.batching import token_batches
from ..distributed.data_parallel import all_reduce_sums, most_over_ranks
from ..rl.advantages import compute_advantages, dynamic_sampling_keep
from ..rl.losses import kl_penalty
from ..rl.rewards import combine_rewards, is_correct
from ..rollout.engine import SampleOutput
from .scoring import ScoreRequest, Scorer


@dataclass
class Experience:
    """A step's samples, prompt-major: sample s belongs to prompt s // group_size."""

    prompts: list
    answers: list[str]
    group_size: int
    tokens: torch.Tensor              # (N, R) right-padded response tokens
    lengths: torch.Tensor             # (N,)
    sampling_logprobs: torch.Tensor   # (N, R) log-probs under the sampling distribution
    finish_reasons: list[str]
    texts: list[str]
    rewards: torch.Tensor             # (N,)
    reward_parts: dict[str, list[float]]
    correct: list[bool]
    advantages: torch.Tensor          # (N,)
    keep_groups: torch.Tensor         # (B,) groups used for training (dynamic sampling)
    ref_logprobs: torch.Tensor | None = None
    old_logprobs: torch.Tensor | None = None

    @property
    def mask(self) -> torch.Tensor:
        return torch.arange(self.tokens.shape[1], device=self.lengths.device)[None] < self.lengths[:, None]

    def kept_samples(self) -> list[int]:
        g = self.group_size
        return [s for b in range(len(self.prompts)) if bool(self.keep_groups[b]) for s in range(b * g, (b + 1) * g)]

    def token_costs(self, shares_prefix: bool) -> list[int]:
        """Each sample's tokens through the decoder in a micro-batch (MicroBatchLimits): its response (at least one
        token), and without `shares_prefix` its prompt too."""
        prompt = lambda s: 0 if shares_prefix else len(self.prompts[s // self.group_size].input_ids)
        return [max(1, n) + prompt(s) for s, n in enumerate(self.lengths.tolist())]

    def request(self, samples: Sequence[int]) -> ScoreRequest:
        idx = torch.tensor(list(samples), device=self.tokens.device)
        return score_request(self.prompts, self.group_size, samples, self.tokens[idx], self.lengths[idx])


def score_request(prompts: list, group_size: int, samples: Sequence[int], tokens: torch.Tensor,
                  lengths: torch.Tensor) -> ScoreRequest:
    """The request scoring `samples` (prompt-major indices): their right-padded tokens cut to the longest of
    them, and their distinct prompts in order."""
    owners = sorted({s // group_size for s in samples})
    slot = {b: i for i, b in enumerate(owners)}
    host = [int(n) for n in lengths.tolist()]  # one transfer, kept for packing (no later syncs)
    return ScoreRequest([prompts[b] for b in owners], [slot[s // group_size] for s in samples],
                        tokens[:, :max(host)], lengths, host)


def request_from_outputs(prompts: list, group_size: int, samples: Sequence[int], token_ids: Sequence[Sequence[int]],
                         device) -> ScoreRequest:
    """What `Experience.request(samples)` gives, built from the samples' sampled token ids before the step's
    Experience exists (the decode window scores samples as they finish)."""
    lengths = [len(t) for t in token_ids]
    tokens = torch.zeros(len(token_ids), max(lengths), dtype=torch.long)
    for row, ids in enumerate(token_ids):
        tokens[row, :len(ids)] = torch.tensor(ids, dtype=torch.long)
    return score_request(prompts, group_size, samples, tokens.to(device), torch.tensor(lengths, device=device))


@dataclass(frozen=True)
class MicroBatchLimits:
    """How a phase cuts its samples into micro-batches (`micro_batches`). A sample costs the tokens its forward runs
    through the decoder: with `shares_prefix` (the decomposed modes, whose prompt prefix runs once per micro-batch or
    is held) its response, else (serial) its prompt and its response."""

    tokens: int = 0  # at most this many tokens per micro-batch (a longer sample alone); 0: no bound
    sequences: int = 0  # at most this many samples per micro-batch; 0: no bound
    shares_prefix: bool = True


def micro_batches(samples: list[int], group_size: int, limits: MicroBatchLimits, cost: Sequence[int]
                  ) -> list[list[int]]:
    """Sample indices (prompt-major) cut in order into micro-batches within `limits`, `cost[s]` sample s's tokens
    (`Experience.token_costs`), greedily (data.batching.token_batches).

    shares_prefix: a prompt's samples (a group) stay together, and several groups share a micro-batch where the
    limits allow, each prompt's prefix running once for its samples; a group over the limits is cut into pieces
    within them, each piece running the prompt's prefix again (as serial scoring runs it for every sample), the last
    piece packed with the groups after it where they fit. Otherwise the samples are cut alone."""
    max_tokens = limits.tokens or sys.maxsize
    max_seqs = limits.sequences or None
    tokens = lambda s: cost[s]
    if not limits.shares_prefix:
        return token_batches(samples, max_tokens, tokens, max_seqs)
    groups: list[list[int]] = []
    for s in samples:
        if groups and groups[-1][0] // group_size == s // group_size:
            groups[-1].append(s)
        else:
            groups.append([s])
    group_tokens = lambda g: sum(cost[s] for s in g)
    pieces = [piece for g in groups
              for piece in ([g] if group_tokens(g) <= max_tokens and len(g) <= (max_seqs or len(g))
                            else token_batches(g, max_tokens, tokens, max_seqs))]
    return [[s for piece in batch for s in piece]
            for batch in token_batches(pieces, max_tokens, group_tokens, max_seqs, count=len)]


def padded_outputs(flat: Sequence[SampleOutput]) -> tuple[torch.Tensor, torch.Tensor]:
    """(tokens, sampling log-probs) of the samples as (S, longest) host tensors, zeros after each response."""
    width = max(len(o.token_ids) for o in flat)
    tokens = torch.zeros(len(flat), width, dtype=torch.long)
    sampling_lp = torch.zeros(len(flat), width)
    for s, o in enumerate(flat):
        tokens[s, :len(o.token_ids)] = torch.tensor(o.token_ids)
        sampling_lp[s, :len(o.logprobs)] = torch.tensor(o.logprobs)
    return tokens, sampling_lp


def build_experience(prompts: list, answers: list[str], outputs: list[list[SampleOutput]], tokenizer,
                     reward_names: list[str], reward_weights: list[float], advantage: str,
                     dynamic_sampling: bool, device) -> Experience:
    group = len(outputs[0])
    flat = [o for g in outputs for o in g]
    tokens, sampling_lp = padded_outputs(flat)
    texts = tokenizer.batch_decode([o.token_ids for o in flat], skip_special_tokens=True)
    sample_answers = [answers[s // group] for s in range(len(flat))]
    total, parts = combine_rewards(texts, sample_answers, reward_names, reward_weights)
    rewards = torch.tensor(total, dtype=torch.float32)
    keep = dynamic_sampling_keep(rewards, group) if dynamic_sampling else torch.ones(len(prompts), dtype=torch.bool)
    return Experience(
        prompts=prompts, answers=answers, group_size=group, tokens=tokens.to(device),
        lengths=torch.tensor([len(o.token_ids) for o in flat], device=device), sampling_logprobs=sampling_lp.to(device),
        finish_reasons=[o.finish_reason for o in flat], texts=texts, rewards=rewards.to(device), reward_parts=parts,
        correct=[is_correct(t, a) for t, a in zip(texts, sample_answers)],
        advantages=compute_advantages(rewards, group, advantage).to(device), keep_groups=keep)


@torch.no_grad()
def reference_phase(reference, scorer: Scorer, exp: Experience, temperature: float, limits: MicroBatchLimits,
                    scored: dict[int, torch.Tensor] | None = None, dp_group=None) -> None:
    """Per-token log-probs of every response under the frozen reference model, in micro-batches within `limits`.
    `scored` holds samples' log-probs computed elsewhere (the decode window, as the samples finished); they are
    taken, not recomputed. `dp_group` (a reference sharded over data-parallel ranks, gathering its parameters in
    every forward): the ranks' micro-batches, cut by tokens, differ in number, so this rank repeats its last one
    (its scores discarded) up to the most any rank runs."""
    out = torch.zeros(exp.tokens.shape, dtype=torch.float32, device=exp.tokens.device)
    scored = scored if scored is not None else {}
    for s, logp in scored.items():
        out[s, :logp.shape[0]] = logp.float()
    samples = [s for s in range(exp.tokens.shape[0]) if s not in scored]
    batches = micro_batches(samples, exp.group_size, limits, exp.token_costs(limits.shares_prefix))
    passes = most_over_ranks(len(batches), out.device, dp_group) - len(batches)  # before any rank's forward
    for mb in batches:
        logp, _ = scorer.score(reference, exp.request(mb), temperature)
        out[torch.tensor(mb, device=out.device), :logp.shape[1]] = logp.float()
    spare = batches[-1] if batches else [0]  # all of this rank's samples scored in the window: any one will do
    for _ in range(passes):
        scorer.score(reference, exp.request(spare), temperature)
    exp.ref_logprobs = out


def kl_to_reference(exp: Experience, estimator: str, dp_group=None) -> float | None:
    """Mean per-token KL estimate of the sampled responses, over every data-parallel rank's tokens."""
    if exp.ref_logprobs is None or exp.old_logprobs is None:
        return None
    mask = exp.mask
    kl = kl_penalty(exp.old_logprobs, exp.ref_logprobs, estimator)
    kl_sum, count = all_reduce_sums([(kl * mask).sum(), mask.sum()], exp.tokens.device, dp_group)
    return kl_sum / max(count, 1.0)
