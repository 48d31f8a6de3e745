"""The one place a Config becomes the step runtime: StepRunner with its StepSettings, PlanOptions, PolicyLossConfig
and (memory.managed) the phase-aware memory manager. The trainer and every benchmark build it here, so a config
key means the same thing everywhere (tests/test_build.py checks no benchmark wires a StepRunner by hand).

What the engine supports (fusion, window hooks) is not mapped from config: the planner reads the engine's declared
capabilities (rollout/protocol.py) every step.
"""

from __future__ import annotations

import torch

from ..config import Config
from ..rl.losses import PolicyLossConfig
from .executor import StepRunner, StepSettings
from .memory import MemoryManager, MemoryPlan, grads_group, kv_pool_group, module_group, optimizer_state_group
from .planner import PlanOptions


def policy_loss_config(cfg: Config) -> PolicyLossConfig:
    a = cfg.algorithm
    return PolicyLossConfig(clip_low=a.clip_low, clip_high=a.clip_high, importance=a.importance, loss_agg=a.loss_agg,
                            kl_coef=a.kl_coef, kl_estimator=a.kl_estimator, entropy_coef=a.entropy_coef)


def plan_options(cfg: Config) -> PlanOptions:
    r = cfg.runtime
    return PlanOptions(mode=r.mode, ref_prefix_graphs=r.ref_prefix_graphs, batched_actor_prefix=r.batched_actor_prefix,
                       batched_ref_prefix=r.batched_ref_prefix,
                       ref_prefix_in_window=r.reference_in_window, ref_suffix_in_window=r.reference_in_window,
                       window_sample_batch=r.window_sample_batch, memory_budget_bytes=int(cfg.memory.budget_gib * 2**30))


def step_settings(cfg: Config) -> StepSettings:
    a = cfg.algorithm
    return StepSettings(reward_names=list(cfg.reward.functions), reward_weights=list(cfg.reward.weights),
                        advantage=a.advantage, dynamic_sampling=a.dynamic_sampling,
                        temperature=cfg.rollout.temperature, micro_batch_size=a.micro_batch_size,
                        ref_micro_batch_size=a.ref_micro_batch_size, ppo_epochs=a.ppo_epochs,
                        grad_clip=cfg.optimizer.grad_clip, loss=policy_loss_config(cfg),
                        plan=plan_options(cfg), checkpoint_prefix=cfg.runtime.checkpoint_prefix,
                        packed_scoring=cfg.runtime.packed_scoring,
                        kv_pool_from_budget=cfg.rollout.kv_pool_gib == 0, recompute=cfg.memory.recompute)


def build_memory_manager(runner: StepRunner, device: torch.device, kv_pool_bytes: int) -> MemoryManager:
    """Phase residency (runtime/memory.py) over the stages of the runner's schedule: reference weights on the device
    only in "ref", optimizer state only in "train", the rollout's KV pool only in "rollout" (released and resumed
    through the engine), the actor's gradients counted in "train". The actor's weights stay (every stage reads
    them, and the decode graph captured their addresses)."""
    actor_params = list(runner.actor.parameters())
    trainable = [p for p in actor_params if p.requires_grad]
    adam_bytes = 2 * sum(p.numel() * p.element_size() for p in trainable)  # exp_avg + exp_avg_sq
    groups = [optimizer_state_group("optimizer_state", runner.optimizer, ["train"], nbytes=adam_bytes),
              grads_group("grads", runner.actor, ["train"]),
              kv_pool_group(runner.engine, ["rollout"], nbytes=kv_pool_bytes)]
    if runner.reference is not None:  # a shared frozen vision tower belongs to the actor
        groups.append(module_group("ref_weights", runner.reference, ["ref"], exclude=actor_params))
    plan = MemoryPlan.build(groups, [str(stage) for stage in runner.stages()])
    return MemoryManager(plan, groups, device)


def build_step_runtime(cfg: Config, actor, reference, engine, optimizer, lr_scheduler, tokenizer, *,
                       pad_id: int = 0, dp_size: int = 1, dp_group=None, memory: MemoryManager | None = None
                       ) -> StepRunner:
    """The step runner the config describes. With memory.managed (and no `memory` given) the runner's memory
    manager plans the stages of its own schedule."""
    runner = StepRunner(actor, reference, engine, optimizer, lr_scheduler, tokenizer, step_settings(cfg),
                        pad_id=pad_id, dp_size=dp_size, dp_group=dp_group, memory=memory)
    if memory is None and cfg.memory.managed:
        runner.attach_memory(build_memory_manager(runner, runner.device,
                                                   int(cfg.rollout.kv_pool_gib * 2**30) or engine.kv_pool_bytes))
    return runner
