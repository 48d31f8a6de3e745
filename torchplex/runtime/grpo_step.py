"""One synchronous GRPO step as separate phases: rollout -> rewards/advantages -> reference -> actor training.

The phases only meet through `Experience`, and the log-prob computation is a pluggable `Scorer`, so the serial
baseline (full prompt+response forwards) and the decomposed runtime (prefix once per prompt) run the very same
step code and must produce the same numbers.
"""

from __future__ import annotations

import dataclasses
import math
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch
import torch.distributed as dist

from ..components.optim import clip_grad_norm
from ..components.peak_memory import PeakWindows, grad_bytes
from ..components.span_clock import SpanClock, span_or_nothing
from ..distributed.fsdp import reshard
from ..models.qwen2_5_vl.parallelize import recompute
from ..rl.advantages import compute_advantages, dynamic_sampling_keep
from ..rl.losses import BatchTotals, LossStats, PolicyLossConfig, kl_penalty, policy_loss
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


def micro_batches(samples: list[int], group_size: int, micro_batch_size: int, whole_groups: bool) -> list[list[int]]:
    """Split sample indices (prompt-major) into micro-batches of at most micro_batch_size sequences, in every mode.

    whole_groups (the decomposed modes, where a group's samples share one prefix forward): micro_batch_size //
    group_size whole groups per micro-batch, so exactly micro_batch_size sequences when it is a multiple of the group
    size (fewer when it is not: the rest of a group never joins the next micro-batch); when micro_batch_size is
    below the group size, each group is cut into pieces of micro_batch_size sequences, and each piece runs the
    group's prompt prefix again (as serial scoring runs it for every sample)."""
    if not whole_groups:
        return [samples[i:i + micro_batch_size] for i in range(0, len(samples), micro_batch_size)]
    groups: list[list[int]] = []
    for s in samples:
        if groups and groups[-1][0] // group_size == s // group_size:
            groups[-1].append(s)
        else:
            groups.append([s])
    if micro_batch_size < group_size:
        return [g[i:i + micro_batch_size] for g in groups for i in range(0, len(g), micro_batch_size)]
    per = micro_batch_size // group_size
    return [[s for g in groups[i:i + per] for s in g] for i in range(0, len(groups), per)]


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
def reference_phase(reference, scorer: Scorer, exp: Experience, temperature: float, micro_batch_size: int,
                    whole_groups: bool, scored: dict[int, torch.Tensor] | None = None) -> None:
    """Per-token log-probs of every response under the frozen reference model. `scored` holds samples' log-probs
    computed elsewhere (the decode window, as the samples finished); they are taken, not recomputed."""
    out = torch.zeros(exp.tokens.shape, dtype=torch.float32, device=exp.tokens.device)
    scored = scored if scored is not None else {}
    for s, logp in scored.items():
        out[s, :logp.shape[0]] = logp.float()
    samples = [s for s in range(exp.tokens.shape[0]) if s not in scored]
    for mb in micro_batches(samples, exp.group_size, micro_batch_size, whole_groups):
        logp, _ = scorer.score(reference, exp.request(mb), temperature)
        out[torch.tensor(mb, device=out.device), :logp.shape[1]] = logp.float()
    exp.ref_logprobs = out


@dataclass
class TrainResult:
    stats: LossStats | None
    grad_norms: list[float] = field(default_factory=list)
    skipped_nonfinite: int = 0
    entropy: float | None = None
    # training forwards (micro-batches x epochs) whose checkpointed blocks recomputed in backward, and those that did
    # not, as `recompute_for` decided (both 0 without it)
    recompute: dict[str, int] = field(default_factory=lambda: {"on": 0, "off": 0})
    # per choice of `recompute_for`, in order: what its micro-batch's window measured (its forward and backward above
    # what it found; empty without windows)
    measured_bytes: list[int] = field(default_factory=list)
    # with a SpanClock (StepSettings.time_train): each micro-batch's forward and backward (named as its window), the
    # batched prefix's backward and the optimizer step, timed on the host and the device (components/span_clock)
    spans: list[dict] = field(default_factory=list)


def all_reduce_sums(values: Sequence[float | torch.Tensor], device, dp_group) -> list[float]:
    """Sums over data-parallel ranks (in float64) of per-rank partial sums; the values themselves without a group."""
    total = torch.tensor([float(v) for v in values], dtype=torch.float64, device=device)
    if dp_group is not None:
        dist.all_reduce(total, group=dp_group)
    return total.tolist()


def _global_stats(stats: LossStats, dp_group) -> LossStats:
    """This rank's loss statistics -> the global batch's, as one process holding every sample would log them.

    Each rank's losses are already normalised by the global totals, so they add up; the means are weighted by
    each rank's valid tokens (what `LossStats.merge` does within a rank).
    """
    n = float(stats.num_tokens)
    means = {"clip_fraction": stats.clip_fraction, "ratio_mean": stats.ratio_mean, "kl": stats.kl,
             "entropy": stats.entropy}
    present = [name for name, value in means.items() if value is not None]
    loss, pg_loss, tokens, *weighted = all_reduce_sums(
        [stats.loss, stats.pg_loss, n] + [float(means[name]) * n for name in present], stats.loss.device, dp_group)
    global_means = dict.fromkeys(means)
    global_means.update({name: torch.tensor(w / max(tokens, 1.0)) for name, w in zip(present, weighted)})
    return LossStats(loss=torch.tensor(loss), pg_loss=torch.tensor(pg_loss), num_tokens=torch.tensor(tokens),
                     **global_means)


def _global_totals(mask: torch.Tensor, max_len: int, dp_size: int, dp_group) -> BatchTotals:
    totals = BatchTotals.from_mask(mask, max_len=max_len)
    if dp_size > 1:
        t = torch.tensor([totals.total_tokens, totals.total_seqs], dtype=torch.float64, device=mask.device)
        dist.all_reduce(t, group=dp_group)
        totals = BatchTotals(total_tokens=float(t[0]), total_seqs=int(t[1]), max_len=max_len)
    return totals


def equal_micro_batches(batches: list[list[int]], exp: Experience, micro_batch_size: int, whole_groups: bool,
                        dp_size: int, dp_group) -> list[tuple[list[int], bool]]:
    """(micro-batch, live) pairs: this rank's micro-batches, then passes that train nothing (live False) up to the
    largest count over the data-parallel ranks.

    Every forward and backward of an FSDP2-sharded actor gathers parameters and reduces gradients across the ranks,
    so all of them must run the same number; dynamic sampling drops different numbers of groups on different ranks.
    A pass scores the groups this rank dropped (in the overlapped mode their prefixes are held like the kept ones,
    so the pass runs the same collectives as a real micro-batch), else repeats its last micro-batch.
    """
    plan = [(mb, True) for mb in batches]
    if dp_size == 1:
        return plan
    count = torch.tensor([len(batches)], device=exp.tokens.device)
    dist.all_reduce(count, op=dist.ReduceOp.MAX, group=dp_group)
    missing = int(count.item()) - len(batches)
    if missing:
        kept = set(exp.kept_samples())
        dropped = [s for s in range(exp.tokens.shape[0]) if s not in kept]
        spare = micro_batches(dropped, exp.group_size, micro_batch_size, whole_groups)
        repeat = (batches or spare or [list(range(exp.group_size))])[-1:]
        plan += [(mb, False) for mb in (spare + repeat * missing)[:missing]]
    return plan


def train_phase(actor, scorer: Scorer, exp: Experience, optimizer, lr_scheduler, loss_cfg: PolicyLossConfig,
                *, temperature: float, micro_batch_size: int, whole_groups: bool, ppo_epochs: int,
                grad_clip: float, max_len: int, dp_size: int = 1, dp_group=None,
                recompute_for: Callable[[list[int], ScoreRequest], bool] | None = None,
                windows: PeakWindows | None = None, clock: SpanClock | None = None,
                rounds: Sequence[int] | None = None, hold_round: Callable[[int], None] | None = None) -> TrainResult:
    """PPO-clip epochs over the kept samples with gradient accumulation; one optimizer step per epoch.

    recompute_for(micro-batch, request), asked before each forward: whether the actor's checkpointed blocks
    recompute in its backward (models/qwen2_5_vl/parallelize.recompute); None leaves them as they are.
    windows: measures each micro-batch's forward and backward ("recompute", "whole_graph", or "micro_batch" without
    a choice) and the batched prefix's backward ("prefix_backward"), above what they found (runtime/peak_memory).
    clock: times the same spans and the optimizer step ("optimizer": clipping and the step) on host and device.
    rounds (one process only): each prompt's round of held prefixes (memory_budget.choose_train_rounds): the first
    epoch runs the micro-batches of round 0's prompts, then the held prefixes' backward (`scorer.finish_backward`),
    `hold_round(1)`, round 1's micro-batches, and so on (the caller held round 0 before); later epochs hold nothing.

    Every micro-batch loss is normalised by the whole mini-batch's totals (summed over data-parallel ranks), so
    accumulating micro-batches equals one full-batch step, whatever the partition.
    """
    samples = exp.kept_samples()
    idx_all = torch.tensor(samples, dtype=torch.long, device=exp.tokens.device)
    totals = _global_totals(exp.mask[idx_all], max_len, dp_size, dp_group)  # every rank, also one with no samples
    if totals.total_seqs == 0:  # the same on every rank
        return TrainResult(stats=None)
    batches = equal_micro_batches(micro_batches(samples, exp.group_size, micro_batch_size, whole_groups), exp,
                                  micro_batch_size, whole_groups, dp_size, dp_group)
    # the first epoch's: (round, micro-batches of its prompts' samples), rounds in order
    first = [(0, batches)]
    if rounds is not None and max(rounds, default=0) > 0:
        if dp_size > 1:
            raise ValueError("held prefixes in rounds run on one process only (the ranks' collectives must match)")
        first = [(r, [(mb, True) for mb in micro_batches([s for s in samples if rounds[s // exp.group_size] == r],
                                                          exp.group_size, micro_batch_size, whole_groups)])
                 for r in sorted(set(rounds))]
    if exp.old_logprobs is None:
        exp.old_logprobs = torch.zeros(exp.tokens.shape, dtype=torch.float32, device=exp.tokens.device)
    result = TrainResult(stats=None)
    trainable = [p for p in actor.parameters() if p.requires_grad]
    measure = (lambda name: windows.window(name, growth=lambda: grad_bytes(trainable))) if windows else (
        lambda name: nullcontext())
    timed = span_or_nothing(clock)

    @contextmanager
    def window(name):
        with timed(name), measure(name):
            yield
    epoch_stats: list[LossStats] = []
    entropies = []
    for epoch in range(ppo_epochs):
        optimizer.zero_grad(set_to_none=True)
        epoch_stats = []
        plan = [(r, mb, live) for r, mbs in (first if epoch == 0 else [(0, batches)]) for mb, live in mbs]
        held_round = 0  # the caller held round 0
        for r, mb, live in plan:
            if r != held_round:  # a new round: the last one's held prefixes backpropagate, then its own are held
                with window("prefix_backward"):
                    scorer.finish_backward()
                hold_round(held_round := r)
            req = exp.request(mb)
            idx = torch.tensor(mb, device=exp.tokens.device)
            width = req.tokens.shape[1]
            bonus = loss_cfg.entropy_coef != 0  # the entropy enters the loss (with its gradient) in every epoch
            on = recompute_for(mb, req) if recompute_for is not None else None
            name = "micro_batch" if on is None else "recompute" if on else "whole_graph"
            with window(name):  # its peak
                with recompute(on) if on is not None else nullcontext():
                    logp, entropy = scorer.score(actor, req, temperature, with_entropy=epoch == 0 or bonus)
                if on is not None:
                    result.recompute["on" if on else "off"] += 1
                old = exp.old_logprobs[idx, :width]
                if epoch == 0 and live:  # on-policy: the epoch-0 forward at θk is the old policy
                    exp.old_logprobs[idx, :width] = old = logp.detach().float()
                if epoch == 0:  # detached: the logged mean must not keep this micro-batch's graph alive
                    logged = None if entropy is None else entropy.detach()
                    entropies.append((logged, req.mask if live else torch.zeros_like(req.mask)))
                ref = exp.ref_logprobs[idx, :width] if exp.ref_logprobs is not None else None
                loss, stats = policy_loss(logp.float(), old, exp.advantages[idx], req.mask,
                                          loss_cfg, ref_logprobs=ref, entropy=entropy if bonus else None,
                                          total_tokens=totals.total_tokens, total_seqs=totals.total_seqs,
                                          max_len=totals.max_len)
                if not live:  # a pass that only keeps this rank in step with the others: no gradient, no statistics
                    loss = loss * 0.0
                    stats = dataclasses.replace(stats, loss=stats.loss * 0, pg_loss=stats.pg_loss * 0,
                                                num_tokens=stats.num_tokens * 0)  # no weight in any mean
                # FSDP2 averages gradients over data-parallel ranks; the loss is already normalised globally.
                scorer.backward(loss * dp_size)  # decomposed: the suffix part, then the prefix part
                del logp, loss, entropy  # the spent graph (it keeps the prefix leaves) goes before the next forward
            epoch_stats.append(stats)
            if windows is not None and on is not None:
                result.measured_bytes.append(windows.last[name])
        with window("prefix_backward"):
            scorer.finish_backward()  # decomposed: the batched fused prefix's part, once every slice has its gradient
        with timed("optimizer"):
            grad_norm = clip_grad_norm(trainable, grad_clip)
            result.grad_norms.append(grad_norm)
            finite = math.isfinite(grad_norm) and all(bool(torch.isfinite(s.loss)) for s in epoch_stats)
            if dp_size > 1:  # one rank's non-finite loss must stop every rank's step, or the FSDP shards diverge
                finite = all_reduce_sums([not finite], exp.tokens.device, dp_group)[0] == 0
            if not finite:
                optimizer.zero_grad(set_to_none=True)
                result.skipped_nonfinite += 1
                continue
            reshard(actor)  # FSDP2: drop gathered copies so the step and the next forward see the same weights
            optimizer.step()
    if lr_scheduler is not None:
        lr_scheduler.step()
    optimizer.zero_grad(set_to_none=True)
    # Collectives every rank reaches: all run the same epochs (the skip test uses the global grad norm) and the same
    # micro-batches (equal_micro_batches), so every rank has statistics and entropies, if only zero-weight ones.
    if epoch_stats:
        stats = LossStats.merge(epoch_stats)
        result.stats = _global_stats(stats, dp_group) if dp_size > 1 else stats
    # Token-weighted over micro-batches and ranks, so the value does not depend on how the batch was split.
    ent = [(float((e * m).sum()), float(m.sum())) for e, m in entropies if e is not None]
    if ent:
        ent_sum, ent_count = all_reduce_sums([sum(a for a, _ in ent), sum(b for _, b in ent)], exp.tokens.device,
                                             dp_group if dp_size > 1 else None)
        result.entropy = ent_sum / max(ent_count, 1.0)
    return result


def kl_to_reference(exp: Experience, estimator: str, dp_group=None) -> float | None:
    """Mean per-token KL estimate of the sampled responses, over every data-parallel rank's tokens."""
    if exp.ref_logprobs is None or exp.old_logprobs is None:
        return None
    mask = exp.mask
    kl = kl_penalty(exp.old_logprobs, exp.ref_logprobs, estimator)
    kl_sum, count = all_reduce_sums([(kl * mask).sum(), mask.sum()], exp.tokens.device, dp_group)
    return kl_sum / max(count, 1.0)
