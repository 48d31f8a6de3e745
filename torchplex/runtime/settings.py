"""What a config says about how a step runs (runtime/build.py maps the config onto these)."""

from __future__ import annotations

from dataclasses import dataclass, field

from ..rl.losses import PolicyLossConfig
from .plan import PlanOptions


@dataclass
class StepSettings:
    reward_names: list[str]
    reward_weights: list[float]
    advantage: str = "grpo"
    dynamic_sampling: bool = False
    temperature: float = 1.0
    # training's and reference scoring's tokens per micro-batch (experience.MicroBatchLimits); 0: the planner's,
    # from the memory budget (MemoryEstimator.estimate)
    micro_batch_tokens: int = 0
    ref_micro_batch_tokens: int = 0
    micro_batch_size: int = 0  # at most this many sequences per training micro-batch; 0: no bound
    ref_micro_batch_size: int = 0  # likewise for reference scoring; 0: micro_batch_size
    ppo_epochs: int = 1
    grad_clip: float = 1.0
    loss: PolicyLossConfig = field(default_factory=PolicyLossConfig)
    plan: PlanOptions = field(default_factory=PlanOptions)
    checkpoint_prefix: bool = False  # activation checkpointing of the prompt prefix forward
    kv_pool_from_budget: bool = False  # size the engine's KV pool each step from the memory budget (kv_pool_gib 0)
    # checkpointed actor: "auto" = a training micro-batch skips the recompute when its whole graph fits in the free
    # memory at its forward (memory.recompute); "always" = every one recomputes
    recompute: str = "auto"
