"""Actor training of one GRPO step: PPO-clip epochs over the kept samples, gradient accumulation over micro-batches,
one optimizer step per epoch.

Every micro-batch loss is normalised by the whole mini-batch's totals (summed over data-parallel ranks), so
accumulating micro-batches equals one full-batch step, whatever the partition: the micro-batches are cut by tokens
(experience.micro_batches, within the plan's token budget: `TrainSettings.limits`), and their number differs with
the response lengths. The scorer (runtime/scoring.py, decomposition.py) computes the log-probs; what the step's
memory plan adds around the micro-batches comes in a `TrainMemory` (whether each recomputes its checkpointed blocks,
the peak windows that measure it, the rounds of held prefixes), so this module knows nothing of memory.
"""

from __future__ import annotations

import dataclasses
import math
from contextlib import nullcontext
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch
import torch.distributed as dist

from ..components.optim import clip_grad_norm
from ..components.peak_memory import PeakWindows, grad_bytes
from ..distributed.data_parallel import all_reduce_sums, most_over_ranks
from ..distributed.fsdp import reshard
from ..models.qwen2_5_vl.parallelize import recompute
from ..rl.losses import BatchTotals, LossStats, PolicyLossConfig, policy_loss
from .experience import Experience, MicroBatchLimits, micro_batches
from .scoring import ScoreRequest, Scorer


@dataclass
class TrainSettings:
    loss: PolicyLossConfig
    temperature: float = 1.0
    # how the samples are cut into micro-batches (tokens, sequences; the prefix modes keep a group's samples together
    # where they fit, as they share one prefix forward): the step sets the plan's token budget every step
    limits: MicroBatchLimits = field(default_factory=MicroBatchLimits)
    ppo_epochs: int = 1
    grad_clip: float = 1.0
    max_len: int = 1  # the response cap (loss aggregations that normalise by a constant length)
    dp_size: int = 1
    dp_group: object = None


@dataclass
class TrainMemory:
    """What the step's memory plan adds around training's micro-batches (every field optional).

    recompute_for(micro-batch, request), asked before each forward: whether the actor's checkpointed blocks
    recompute in its backward; windows: the allocator's peak of each micro-batch's forward and backward ("recompute",
    "whole_graph", or "micro_batch" without a choice) and of the batched prefix backward ("prefix_backward"); rounds
    (one process only): each prompt's round
    of held prefixes, the first epoch running round 0's micro-batches, the held prefixes' backward, then
    `hold_round(1)` and round 1's micro-batches, and so on (the caller held round 0 before)."""

    recompute_for: Callable[[list[int], ScoreRequest], bool] | None = None
    windows: PeakWindows | None = None
    rounds: Sequence[int] | None = None
    hold_round: Callable[[int], None] | None = None


@dataclass
class TrainResult:
    stats: LossStats | None
    grad_norms: list[float] = field(default_factory=list)
    skipped_nonfinite: int = 0
    entropy: float | None = None
    # training forwards (micro-batches x epochs) whose checkpointed blocks recomputed in backward, and those that did
    # not, as `recompute_for` decided (both 0 without it)
    recompute: dict[str, int] = field(default_factory=lambda: {"on": 0, "off": 0})
    # per choice of `recompute_for`, in order: what its micro-batch's window measured (empty without windows)
    measured_bytes: list[int] = field(default_factory=list)
    micro_batches: int = 0  # training forwards and backwards run (micro-batches x epochs, passes included)


def _global_stats(stats: LossStats, dp_group) -> LossStats:
    """This rank's loss statistics -> the global batch's, as one process holding every sample would log them: each
    rank's losses are already normalised by the global totals, so they add up; the means are weighted by each
    rank's valid tokens (what `LossStats.merge` does within a rank)."""
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


def equal_micro_batches(batches: list[list[int]], exp: Experience, limits: MicroBatchLimits, dp_size: int,
                        dp_group) -> list[tuple[list[int], bool]]:
    """(micro-batch, live) pairs: this rank's micro-batches, then passes that train nothing (live False) up to the
    largest count over the data-parallel ranks.

    Every forward and backward of an FSDP2-sharded actor gathers parameters and reduces gradients across the ranks,
    so all of them must run the same number; dynamic sampling drops different numbers of groups on different ranks,
    and micro-batches cut by tokens differ in number with the ranks' response lengths. A pass scores the groups this
    rank dropped (in the overlapped mode their prefixes are held like the kept ones, so the pass runs the same
    collectives as a real micro-batch), else repeats its last micro-batch."""
    plan = [(mb, True) for mb in batches]
    if dp_size == 1:
        return plan
    missing = most_over_ranks(len(batches), exp.tokens.device, dp_group) - len(batches)
    if missing:
        kept = set(exp.kept_samples())
        dropped = [s for s in range(exp.tokens.shape[0]) if s not in kept]
        spare = micro_batches(dropped, exp.group_size, limits, exp.token_costs(limits.shares_prefix))
        repeat = (batches or spare or [list(range(exp.group_size))])[-1:]
        plan += [(mb, False) for mb in (spare + repeat * missing)[:missing]]
    return plan


def epoch_plans(exp: Experience, s: TrainSettings, rounds: Sequence[int] | None) -> list[list[tuple[int, list, bool]]]:
    """Each epoch's (round, micro-batch, live) in order: the first epoch by rounds of held prefixes (when given),
    the later ones as one round."""
    samples, cost = exp.kept_samples(), exp.token_costs(s.limits.shares_prefix)
    cut = lambda chosen: micro_batches(chosen, exp.group_size, s.limits, cost)
    batches = equal_micro_batches(cut(samples), exp, s.limits, s.dp_size, s.dp_group)
    plain = [(0, mb, live) for mb, live in batches]
    first = plain
    if rounds is not None and max(rounds, default=0) > 0:
        if s.dp_size > 1:
            raise ValueError("held prefixes in rounds run on one process only (the ranks' collectives must match)")
        first = [(r, mb, True) for r in sorted(set(rounds))
                 for mb in cut([x for x in samples if rounds[x // exp.group_size] == r])]
    return [first] + [plain] * (s.ppo_epochs - 1)


class TrainPhase:
    """The actor's PPO-clip update of one step (see the module docstring)."""

    def __init__(self, actor, scorer: Scorer, optimizer, lr_scheduler, settings: TrainSettings):
        self.actor, self.scorer, self.optimizer, self.lr_scheduler = actor, scorer, optimizer, lr_scheduler
        self.s = settings
        # the actor's parameters as the optimizer got them, before any forward: a forward leaves an FSDP2 root unit
        # gathered (the held prefixes' graph needs it until its backward), and a gathered unit's parameters() are its
        # unsharded copies, whose gradients the reduce-scatter moves to these (clipping the copies misses them)
        self.params = list(actor.parameters())

    def run(self, exp: Experience, memory: TrainMemory | None = None) -> TrainResult:
        s, memory = self.s, memory or TrainMemory()
        samples = exp.kept_samples()
        idx_all = torch.tensor(samples, dtype=torch.long, device=exp.tokens.device)
        totals = _global_totals(exp.mask[idx_all], s.max_len, s.dp_size, s.dp_group)  # every rank, even without
        if totals.total_seqs == 0:  # samples: the same on every rank
            return TrainResult(stats=None)
        if exp.old_logprobs is None:
            exp.old_logprobs = torch.zeros(exp.tokens.shape, dtype=torch.float32, device=exp.tokens.device)
        result, entropies, epoch_stats = TrainResult(stats=None), [], []
        trainable = [p for p in self.params if p.requires_grad]
        window = self._windows(memory, trainable)
        for epoch, plan in enumerate(epoch_plans(exp, s, memory.rounds)):
            self.optimizer.zero_grad(set_to_none=True)
            epoch_stats = self._epoch(exp, epoch, plan, totals, memory, window, result, entropies)
            with window("prefix_backward"):
                self.scorer.finish_backward()  # the batched prefixes' part, once every slice has its gradient
            self._optimizer_step(exp, trainable, epoch_stats, result)
        if self.lr_scheduler is not None:
            self.lr_scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        self._finish(exp, epoch_stats, entropies, result)
        return result

    def _windows(self, memory: TrainMemory, trainable):
        """A context per named span: its peak above what it found (memory.windows), or nothing."""
        if memory.windows is None:
            return lambda name: nullcontext()
        return lambda name: memory.windows.window(name, growth=lambda: grad_bytes(trainable))

    def _epoch(self, exp, epoch, plan, totals, memory, window, result, entropies) -> list[LossStats]:
        stats, held_round = [], 0  # the caller held round 0
        for r, mb, live in plan:
            if r != held_round:  # a new round: the last one's held prefixes backpropagate, then its own are held
                with window("prefix_backward"):
                    self.scorer.finish_backward()
                memory.hold_round(held_round := r)
            stats.append(self._micro_batch(exp, epoch, mb, live, totals, memory, window, result, entropies))
        return stats

    def _micro_batch(self, exp, epoch, mb, live, totals, memory, window, result, entropies) -> LossStats:
        """One micro-batch's forward, loss and backward; epoch 0 records the old policy's log-probs (on-policy: the
        forward at θk is the old policy) and the entropies logged."""
        s, cfg = self.s, self.s.loss
        req = exp.request(mb)
        idx = torch.tensor(mb, device=exp.tokens.device)
        width = req.tokens.shape[1]
        bonus = cfg.entropy_coef != 0  # the entropy enters the loss (with its gradient) in every epoch
        on = memory.recompute_for(mb, req) if memory.recompute_for is not None else None
        name = "micro_batch" if on is None else "recompute" if on else "whole_graph"
        with window(name):  # its peak
            with recompute(self.actor, on) if on is not None else nullcontext():
                logp, entropy = self.scorer.score(self.actor, req, s.temperature, with_entropy=epoch == 0 or bonus)
            result.micro_batches += 1
            if on is not None:
                result.recompute["on" if on else "off"] += 1
            old = exp.old_logprobs[idx, :width]
            if epoch == 0 and live:
                exp.old_logprobs[idx, :width] = old = logp.detach().float()
            if epoch == 0:  # detached: the logged mean must not keep this micro-batch's graph alive
                logged = None if entropy is None else entropy.detach()
                entropies.append((logged, req.mask if live else torch.zeros_like(req.mask)))
            ref = exp.ref_logprobs[idx, :width] if exp.ref_logprobs is not None else None
            loss, stats = policy_loss(logp.float(), old, exp.advantages[idx], req.mask, cfg, ref_logprobs=ref,
                                      entropy=entropy if bonus else None, total_tokens=totals.total_tokens,
                                      total_seqs=totals.total_seqs, max_len=totals.max_len)
            if not live:  # a pass that only keeps this rank in step with the others: no gradient, no statistics
                loss = loss * 0.0
                stats = dataclasses.replace(stats, loss=stats.loss * 0, pg_loss=stats.pg_loss * 0,
                                            num_tokens=stats.num_tokens * 0)  # no weight in any mean
            # FSDP2 averages gradients over data-parallel ranks; the loss is already normalised globally.
            self.scorer.backward(loss * s.dp_size)  # decomposed: the suffix part, then the prefix part
            del logp, loss, entropy  # the spent graph (it keeps the prefix leaves) goes before the next forward
        if memory.windows is not None and on is not None:
            result.measured_bytes.append(memory.windows.last[name])
        return stats

    def _optimizer_step(self, exp, trainable, epoch_stats, result) -> None:
        """Clip and step, unless the gradients or a loss are not finite on any rank (then the epoch is skipped)."""
        grad_norm = clip_grad_norm(trainable, self.s.grad_clip)
        result.grad_norms.append(grad_norm)
        finite = math.isfinite(grad_norm) and all(bool(torch.isfinite(st.loss)) for st in epoch_stats)
        if self.s.dp_size > 1:  # one rank's non-finite loss must stop every rank's step, or the FSDP shards diverge
            finite = all_reduce_sums([not finite], exp.tokens.device, self.s.dp_group)[0] == 0
        if not finite:
            self.optimizer.zero_grad(set_to_none=True)
            result.skipped_nonfinite += 1
            return
        reshard(self.actor)  # FSDP2: drop gathered copies so the step and the next forward see the same weights
        self.optimizer.step()

    def _finish(self, exp, epoch_stats, entropies, result) -> None:
        """The step's loss statistics and entropy over every rank: all ran the same epochs and micro-batches, so
        every rank reaches these collectives; the entropy is token-weighted, whatever the split."""
        dp = self.s.dp_group if self.s.dp_size > 1 else None
        if epoch_stats:
            stats = LossStats.merge(epoch_stats)
            result.stats = _global_stats(stats, dp) if dp is not None else stats
        ent = [(float((e * m).sum()), float(m.sum())) for e, m in entropies if e is not None]
        if ent:
            ent_sum, count = all_reduce_sums([sum(a for a, _ in ent), sum(b for _, b in ent)], exp.tokens.device, dp)
            result.entropy = ent_sum / max(count, 1.0)


def train_phase(actor, scorer: Scorer, exp: Experience, optimizer, lr_scheduler, loss_cfg: PolicyLossConfig, *,
                temperature: float, limits: MicroBatchLimits, ppo_epochs: int, grad_clip: float, max_len: int,
                dp_size: int = 1, dp_group=None) -> TrainResult:
    """One TrainPhase run without memory hooks: the same update, for callers that hold no plan (tests, tools)."""
    settings = TrainSettings(loss_cfg, temperature, limits, ppo_epochs, grad_clip, max_len, dp_size, dp_group)
    return TrainPhase(actor, scorer, optimizer, lr_scheduler, settings).run(exp)
