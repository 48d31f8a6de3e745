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

    - "grpo":    (r - mean_g) / (std_g + eps), with the *unbiased* (n - 1) standard deviation,
                 as `torch.std`'s default and the GRPO reference implementations use.
    - "dr_grpo": r - mean_g. Dr. GRPO drops the std division because it up-weights groups whose
                 rewards barely differ (too easy or too hard prompts).
    - "rloo":    r_i - mean_{j != i} r_j, the leave-one-out baseline, which equals
                 group_size / (group_size - 1) * (r_i - mean_g).

    Groups with all-equal rewards get advantage 0 under every method (grpo: 0 / (0 + eps)).
    group_size == 1 gives all zeros (see module docstring). Integer rewards are promoted to float32;
    floating rewards keep their dtype.
    """
    if method not in ADVANTAGE_METHODS:
        raise ValueError(f"unknown advantage method {method!r}; expected one of {ADVANTAGE_METHODS}")
    groups = _grouped(rewards, group_size)
    if group_size == 1:
        return torch.zeros_like(groups).view(-1)

    mean = groups.mean(dim=-1, keepdim=True)
    if method == "grpo":
        std = groups.std(dim=-1, keepdim=True, correction=1)
        advantages = (groups - mean) / (std + eps)
    elif method == "dr_grpo":
        advantages = groups - mean
    else:  # rloo
        others_mean = (groups.sum(dim=-1, keepdim=True) - groups) / (group_size - 1)
        advantages = groups - others_mean
    return advantages.reshape(-1)


def dynamic_sampling_keep(rewards: Tensor, group_size: int) -> Tensor:
    """Bool (num_groups,): True for groups whose rewards are not all equal (DAPO dynamic sampling).

    A group with identical rewards has zero advantage everywhere, so it only dilutes the batch; DAPO
    drops such groups and samples more prompts instead. One-sample groups are never kept.
    """
    groups = _grouped(rewards, group_size)
    return groups.amax(dim=-1) != groups.amin(dim=-1)
