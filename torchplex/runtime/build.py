"""The one place a Config becomes the step runtime: the GRPOStep with its StepSettings, PlanOptions,
PolicyLossConfig, its memory estimate and (memory.managed) the phase-aware residency manager. The trainer builds it
here, and every benchmark runs the trainer (benchmarks/product_run.py), so a config key means one thing everywhere.

What the engine supports (fusion, window hooks) is not mapped from config: the planner reads the engine's declared
capabilities (rollout/protocol.py) every step.
"""

from __future__ import annotations

import torch

from ..components.captured_step import plain_tensors
from ..config import Config
from ..models.qwen2_5_vl.parallelize import heads_per_rank, is_checkpointed, tp_degree
from ..rl.losses import PolicyLossConfig
from .memory import MemoryManager, MemoryPlan, grads_group, kv_pool_group, module_group, optimizer_state_group
from .memory_estimate import Footprint, MemoryEstimator, local_bytes
from .plan import PlanOptions
from .settings import StepSettings
from .step import GRPOStep


def policy_loss_config(cfg: Config) -> PolicyLossConfig:
    a = cfg.algorithm
    return PolicyLossConfig(clip_low=a.clip_low, clip_high=a.clip_high, importance=a.importance, loss_agg=a.loss_agg,
                            kl_coef=a.kl_coef, kl_estimator=a.kl_estimator, entropy_coef=a.entropy_coef)


def plan_options(cfg: Config) -> PlanOptions:
    r = cfg.runtime
    return PlanOptions(mode=r.mode, batched_actor_prefix=r.batched_actor_prefix, batched_ref_prefix=r.batched_ref_prefix,
                       ref_prefix_in_window=r.reference_in_window, ref_suffix_in_window=r.reference_in_window,
                       window_sample_batch=r.window_sample_batch, memory_budget_bytes=int(cfg.memory.budget_gib * 2**30))


def step_settings(cfg: Config) -> StepSettings:
    a = cfg.algorithm
    return StepSettings(reward_names=list(cfg.reward.functions), reward_weights=list(cfg.reward.weights),
                        advantage=a.advantage, dynamic_sampling=a.dynamic_sampling,
                        temperature=cfg.rollout.temperature, micro_batch_tokens=a.micro_batch_tokens,
                        ref_micro_batch_tokens=a.ref_micro_batch_tokens, micro_batch_size=a.micro_batch_size,
                        ref_micro_batch_size=a.ref_micro_batch_size, ppo_epochs=a.ppo_epochs,
                        grad_clip=cfg.optimizer.grad_clip, loss=policy_loss_config(cfg),
                        plan=plan_options(cfg), checkpoint_prefix=cfg.runtime.checkpoint_prefix,
                        kv_pool_from_budget=cfg.rollout.kv_pool_gib == 0, recompute=cfg.memory.recompute)


def footprint(actor, reference, engine, settings: StepSettings, dp_size: int = 1) -> Footprint:
    """What the memory estimate plans with: the models' bytes on this rank, the geometry, how the step runs. The
    attention heads and the MLP width are a rank's (TP splits both over its degree), so the K/V a held prefix keeps
    and the MLP activations a graph saves per token are this rank's."""
    mine = {id(p) for p in actor.parameters()}
    num_heads, num_kv_heads = heads_per_rank(actor)
    trainable = [p for p in actor.parameters() if p.requires_grad]
    t, v = actor.args.text, actor.args.vision
    vision_trains = any(p.requires_grad for p in actor.visual.parameters())
    plan = settings.plan
    fuses = plan.mode == "overlapped" and plan.fuse_actor_prefix and engine.capabilities.prefill_hook
    return Footprint(
        actor_bytes=local_bytes(actor.parameters()), trainable_bytes=local_bytes(trainable),
        reference_bytes=0 if reference is None else local_bytes(p for p in reference.parameters() if id(p) not in mine),
        num_layers=t.num_layers, hidden_size=t.hidden_size, intermediate_size=t.intermediate_size // tp_degree(actor),
        num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=t.head_dim, vocab_size=t.vocab_size,
        element_size=actor.output_weight.element_size(),
        vision_layer=(v.hidden_size, v.intermediate_size, v.spatial_merge_size ** 2) if vision_trains else (0, 0, 0),
        vision_depth=v.depth, checkpointed=is_checkpointed(actor), micro_batch_tokens=settings.micro_batch_tokens,
        ref_micro_batch_tokens=settings.ref_micro_batch_tokens, micro_batch_size=settings.micro_batch_size,
        ref_micro_batch_size=settings.ref_micro_batch_size or settings.micro_batch_size,
        capacity_bytes=plan.memory_budget_bytes, dp_size=dp_size,
        train_rounds=dp_size == 1 and plain_tensors(actor), recompute=settings.recompute,
        kv_pool_from_budget=settings.kv_pool_from_budget, fuses=fuses,
        batched_actor_prefix=plan.batched_actor_prefix, mode=plan.mode)


def build_residency(actor, reference, engine, optimizer, stages: list[str], kv_pool_bytes: int) -> MemoryManager:
    """Phase residency (runtime/memory.py) over the step's stages: reference weights on the device only in "ref",
    optimizer state only in "train", the rollout's KV pool only in "rollout" (released and resumed through the
    engine), the actor's gradients counted in "train". The actor's weights stay (every stage reads them, and the
    decode graph captured their addresses)."""
    actor_params = list(actor.parameters())
    trainable = [p for p in actor_params if p.requires_grad]
    adam_bytes = 2 * sum(p.numel() * p.element_size() for p in trainable)  # exp_avg + exp_avg_sq
    groups = [optimizer_state_group("optimizer_state", optimizer, ["train"], nbytes=adam_bytes),
              grads_group("grads", actor, ["train"]), kv_pool_group(engine, ["rollout"], nbytes=kv_pool_bytes)]
    if reference is not None:  # a shared frozen vision tower belongs to the actor
        groups.append(module_group("ref_weights", reference, ["ref"], exclude=actor_params))
    return MemoryManager(MemoryPlan.build(groups, stages), groups, torch.device(next(iter(actor_params)).device))


def step_stages(mode: str, has_reference: bool, vision_frozen: bool) -> list[str]:
    """The stages every step of this runtime runs (what the residency plan plans)."""
    return ((["vision"] if vision_frozen and mode != "serial" else []) + ["rollout"]
            + (["ref"] if has_reference else []) + ["train"])


def build_step_runtime(cfg: Config, actor, reference, engine, optimizer, lr_scheduler, tokenizer, *,
                       pad_id: int = 0, dp_size: int = 1, dp_group=None) -> GRPOStep:
    """The step the config describes, with its memory estimate and (memory.managed) its residency manager."""
    settings = step_settings(cfg)
    device = next(actor.parameters()).device
    residency, managed_peaks, pool_bytes = None, None, 0
    if cfg.memory.managed:
        pool_bytes = int(cfg.rollout.kv_pool_gib * 2**30) or engine.kv_pool_bytes
        frozen = not any(p.requires_grad for p in actor.visual.parameters())
        residency = build_residency(actor, reference, engine, optimizer,
                                    step_stages(settings.plan.mode, reference is not None, frozen), pool_bytes)
        managed_peaks = {row.phase: row.peak_bytes for row in residency.plan.phases}
    trainable = [p for p in actor.parameters() if p.requires_grad]
    memory = MemoryEstimator(footprint(actor, reference, engine, settings, dp_size), engine, device,
                             measured=device.type == "cuda", trainable=trainable, managed_peaks=managed_peaks,
                             planned_pool_bytes=pool_bytes)
    return GRPOStep(actor, reference, engine, optimizer, lr_scheduler, tokenizer, settings, memory, pad_id=pad_id,
                    dp_size=dp_size, dp_group=dp_group, residency=residency)
