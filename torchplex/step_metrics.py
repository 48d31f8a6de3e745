"""The numbers one RL step logs, each summed or averaged over every data-parallel rank so that all ranks log the
whole job's values: what the step learned (rewards, loss, KL), what it computed (tokens, model FLOPs), how the
rollout went (decode counters, log-prob mismatch) and what the memory manager held."""

from __future__ import annotations

import torch

from .components.flops import step_flops
from .distributed.data_parallel import DataParallelRanks
from .rollout.logprob_mismatch import mismatch_sums
from .runtime.experience import kl_to_reference
from .runtime.memory_budget import COMPACT, GRAPH
from .runtime.phases import Stage


def visual_grids(prompt) -> list[list[int]]:
    """The (t, h, w) patch grids of a prompt's images and videos."""
    return [grid for grids in (prompt.image_grid_thw, prompt.video_grid_thw) if grids is not None
            for grid in grids.tolist()]


def outcome_metrics(out, dp: DataParallelRanks, kl_estimator: str) -> dict[str, float]:
    """Rewards, accuracy, lengths and what training did with them (loss, clipping, gradient norm, entropy, KL)."""
    exp, result = out.experience, out.train
    rewards = exp.rewards.tolist()
    metrics = {
        "samples": dp.sum(float(len(rewards))),
        "reward/mean": dp.mean(rewards),
        "reward/std": dp.std(rewards),
        "accuracy": dp.mean([float(c) for c in exp.correct]),
        "response_length/mean": dp.mean(exp.lengths.float().tolist()),
        "groups/kept_fraction": dp.mean(exp.keep_groups.float().tolist()),
        "skipped/nonfinite_steps": float(result.skipped_nonfinite),
        # training forwards whose checkpointed blocks recomputed or not (memory.recompute, docs/memory.md)
        "recompute/on": float(result.recompute["on"]), "recompute/off": float(result.recompute["off"]),
        # the plan's tokens per training and reference micro-batch (algorithm.micro_batch_tokens), the training
        # forwards they made (micro-batches x epochs)
        "micro_batch/tokens": dp.mean([float(out.plan.budget.micro_batch_tokens)]) if out.plan.budget else 0.0,
        "micro_batch/ref_tokens": dp.mean([float(out.plan.budget.ref_micro_batch_tokens)]) if out.plan.budget else 0.0,
        "micro_batch/train_count": float(result.micro_batches),
    }
    metrics.update({f"reward/{name}": dp.mean(values) for name, values in exp.reward_parts.items()})
    if result.stats is not None:
        s = result.stats
        metrics.update({"loss": float(s.loss), "pg_loss": float(s.pg_loss), "clip_fraction": float(s.clip_fraction),
                        "ratio_mean": float(s.ratio_mean)})
    if result.grad_norms:
        metrics["grad_norm"] = result.grad_norms[-1]
    if result.entropy is not None:
        metrics["entropy"] = result.entropy
    kl = kl_to_reference(exp, kl_estimator, dp.group)
    if kl is not None:
        metrics["kl"] = kl
    return metrics


def logprob_mismatch(exp, dp: DataParallelRanks) -> dict[str, float]:
    """Rollout vs trainer log-probs over the trained samples (rollout/logprob_mismatch.py)."""
    if exp.old_logprobs is None:
        return {}
    idx = torch.tensor(exp.kept_samples(), dtype=torch.long, device=exp.tokens.device)
    sums = mismatch_sums(exp.sampling_logprobs[idx], exp.old_logprobs[idx], exp.mask[idx])
    abs_sum, k3_sum, count = dp.sums(list(sums))
    return {"rollout/logprob_mismatch": abs_sum / max(count, 1.0), "rollout/mismatch_k3": k3_sum / max(count, 1.0)}


def token_metrics(out, dp: DataParallelRanks) -> dict[str, float]:
    """Tokens of the step's samples (prompts + responses), the decoder token-forwards of its scoring (reference +
    actor) and what the serial step would have run for the same scoring."""
    exp, report = out.experience, out.report
    prompt_tokens = sum(len(p.input_ids) for p in exp.prompts) * exp.group_size
    local = [prompt_tokens + int(exp.lengths.sum()), report.tokens.prefix_tokens, report.tokens.response_tokens,
             report.serial_equivalent_tokens]
    samples, prefix, response, serial = dp.sums(local)
    return {"tokens/samples": samples, "tokens/prefix": prefix, "tokens/response": response,
            "tokens/serial_equivalent": serial, "tokens/saving_x": serial / max(prefix + response, 1)}


def flops_metrics(out, model_args, has_reference: bool, vision_trains: bool, ppo_epochs: int,
                  dp: DataParallelRanks) -> dict[str, float]:
    """Model FLOPs of each phase of this step (components/flops.step_flops), in TFLOP: a phase's `flops/<phase>_tflop`
    over its `time/<phase>_s` is its achieved rate. Training counts only the kept groups, once per PPO epoch."""
    exp, g = out.experience, out.experience.group_size
    lengths, kept = exp.lengths.tolist(), exp.keep_groups.tolist()
    fused = [c.prompt for c in out.report.held_forms if c.form in (GRAPH, COMPACT) and kept[c.prompt]]

    def count(prompts, fused_rows):
        return step_flops(model_args, [len(exp.prompts[i].input_ids) for i in prompts],
                          [visual_grids(exp.prompts[i]) for i in prompts],
                          [lengths[i * g:(i + 1) * g] for i in prompts],
                          serial=out.plan.mode == "serial", has_reference=has_reference, vision_trains=vision_trains,
                          vision_stage=Stage.VISION in out.plan.stages(), fused=fused_rows)

    every = count(range(len(exp.prompts)), [])
    trained = count([i for i in range(len(exp.prompts)) if kept[i]], [sum(kept[:i]) for i in fused])
    every["train"] = trained["train"].scaled(ppo_epochs)
    names = list(every)
    totals = dp.sums([every[n].total / 1e12 for n in names])
    return {f"flops/{n}_tflop": t for n, t in zip(names, totals)}


def decode_counters(engine) -> dict[str, float]:
    """The native engine's running decode counters (seconds, steps, tokens generated, rows decoded over the steps,
    CUDA graphs captured and their seconds, steps per ladder size `rollout/decode_rows/<rows>`); none for SGLang."""
    stats = getattr(engine, "stats", None)
    if not hasattr(stats, "decode_steps"):  # SGLang's engine keeps no decode-loop counters
        return {}
    return {"rollout/decode_s": stats.decode_s, "rollout/decode_steps": float(stats.decode_steps),
            "rollout/generated_tokens": float(stats.generated_tokens),
            "rollout/row_steps": float(getattr(stats, "row_steps", 0)),
            "rollout/captures": float(getattr(stats, "captures", 0)),
            "rollout/capture_s": float(getattr(stats, "capture_s", 0.0)),
            **{f"rollout/decode_rows/{rows}": float(steps)
               for rows, steps in getattr(stats, "decode_rows", {}).items()}}


def decode_metrics(before: dict[str, float], engine) -> dict[str, float]:
    """This step's share of the engine's running decode counters (`before`: their values when the step began). Only
    the ladder sizes this step decoded at: a size met only in earlier steps is not this step's metric."""
    decoded = {k: v - before.get(k, 0.0) for k, v in decode_counters(engine).items()}
    return {k: v for k, v in decoded.items() if v or not k.startswith("rollout/decode_rows/")}


def residency_metrics(residency) -> dict[str, float]:
    """memory.managed: each phase's planned peak beside the bytes the manager held in it."""
    if residency is None:
        return {}
    metrics = {}
    for record in residency.records[-len(residency.plan.phases):]:
        metrics[f"memory/{record.phase}_plan_gib"] = record.planned_peak_bytes / 2**30
        metrics[f"memory/{record.phase}_tracked_gib"] = record.tracked_bytes / 2**30
    return metrics
