"""Group-relative advantages for GRPO-family algorithms, and DAPO's dynamic-sampling filter.

Every prompt is sampled `group_size` times and the samples of one prompt are contiguous in the
reward vector, so a group is simply a row of `rewards.view(num_groups, group_size)`. Each sample's
advantage is its reward measured against the other samples of its own prompt; no value network.

A one-sample group has nothing to be compared with, so every method gives it advantage 0 (finite,
never a division by zero): such a sample carries no learning signal, exactly like a group whose
rewards are all equal.
"""

from __future__ import annotations

import torch
from torch import Tensor

ADVANTAGE_METHODS = ("grpo", "dr_grpo", "rloo")


def _grouped(rewards: Tensor, group_size: int) -> Tensor:
    """View `rewards` (N,) as (num_groups, group_size) in a floating dtype, after checking the shape."""
    if rewards.dim() != 1:
        raise ValueError(f"rewards must be 1-D (N,), got shape {tuple(rewards.shape)}")
    if group_size < 1:
        raise ValueError(f"group_size must be >= 1, got {group_size}")
    if rewards.numel() % group_size != 0:
        raise ValueError(
            f"{rewards.numel()} rewards do not split into groups of group_size={group_size}"
        )
    if not rewards.is_floating_point():
        rewards = rewards.to(torch.float32)
    return rewards.view(-1, group_size)


def compute_advantages(
    rewards: Tensor, group_size: int, method: str = "grpo", eps: float = 1e-6
) -> Tensor:
    """Per-sample advantages (N,) from rewards (N,) whose groups of `group_size` are contiguous.

    - "grpo":    (r - mean_g) / (std_g + eps), DeepSeekMath's outcome-supervision advantage (arXiv:2402.03300
                 section 4.1.2: r~_i = (r_i - mean(r)) / std(r)). The paper does not say which std; this is the
                 *sample* std (n - 1 denominator) that verl's `compute_grpo_outcome_advantage` (`torch.std`) and
                 TRL's GRPOTrainer (`Tensor.std`) use, with verl's and TRL's eps added to the std.
    - "dr_grpo": r - mean_g. Dr. GRPO (arXiv:2503.20783, section 3.1) drops the std division because it
                 up-weights groups whose rewards barely differ (too easy or too hard prompts).
    - "rloo":    r_i - mean_{j != i} r_j, the leave-one-out baseline, which equals
                 group_size / (group_size - 1) * (r_i - mean_g).

    The arithmetic runs in float64 and the result is cast back to the rewards' dtype: a float32 mean of equal
    values can be an ulp off, and grpo then divides that ulp by an ulp-sized std + eps (0.7 in groups of 8 gave
    0.056 per sample). A group whose rewards are all equal gets exactly 0 under every method, for any value, dtype
    and group size: it carries no learning signal. group_size == 1 gives all zeros (see module docstring).
    Integer rewards are promoted to float32; floating rewards keep their dtype.
    """
    if method not in ADVANTAGE_METHODS:
        raise ValueError(f"unknown advantage method {method!r}; expected one of {ADVANTAGE_METHODS}")
    groups = _grouped(rewards, group_size)
    if group_size == 1:
        return torch.zeros_like(groups).view(-1)

    exact = groups.to(torch.float64)
    mean = exact.mean(dim=-1, keepdim=True)
    if method == "grpo":
        std = exact.std(dim=-1, keepdim=True, correction=1)
        advantages = (exact - mean) / (std + eps)
    elif method == "dr_grpo":
        advantages = exact - mean
    else:  # rloo
        others_mean = (exact.sum(dim=-1, keepdim=True) - exact) / (group_size - 1)
        advantages = exact - others_mean
    equal = exact.amax(dim=-1, keepdim=True) == exact.amin(dim=-1, keepdim=True)
    advantages = torch.where(equal, torch.zeros((), dtype=torch.float64, device=exact.device), advantages)
    return advantages.to(groups.dtype).reshape(-1)


def dynamic_sampling_keep(rewards: Tensor, group_size: int) -> Tensor:
    """Bool (num_groups,): True for groups whose rewards are not all equal (DAPO dynamic sampling).

    A group with identical rewards has zero advantage everywhere, so it only dilutes the batch; DAPO
    drops such groups and samples more prompts instead. One-sample groups are never kept.
    """
    groups = _grouped(rewards, group_size)
    return groups.amax(dim=-1) != groups.amin(dim=-1)
