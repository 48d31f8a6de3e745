"""Specification of group-relative advantages, checked against plain-python formulas (tol 1e-6)."""

import statistics

import pytest
import torch

from torchplex.rl.advantages import ADVANTAGE_METHODS, compute_advantages, dynamic_sampling_keep

TOL = 1e-6
# Two groups of four samples each: a varied one and a binary one.
REWARDS = [1.0, 0.0, 0.5, 2.0, 0.0, 1.0, 1.0, 0.0]
GROUP_SIZE = 4


def _groups(values, size):
    return [values[i : i + size] for i in range(0, len(values), size)]


def _assert_close(actual: torch.Tensor, expected: list[float]) -> None:
    torch.testing.assert_close(actual, torch.tensor(expected, dtype=actual.dtype), atol=TOL, rtol=0)


def test_grpo_normalises_by_unbiased_group_std():
    eps = 1e-6
    expected = []
    for group in _groups(REWARDS, GROUP_SIZE):
        mean, std = statistics.mean(group), statistics.stdev(group)  # stdev: (n - 1) denominator
        expected += [(r - mean) / (std + eps) for r in group]
    out = compute_advantages(torch.tensor(REWARDS, dtype=torch.float64), GROUP_SIZE, "grpo", eps)
    _assert_close(out, expected)


def test_grpo_std_is_not_the_population_std():
    group = REWARDS[:GROUP_SIZE]
    mean, pstd = statistics.mean(group), statistics.pstdev(group)
    population_version = torch.tensor([(r - mean) / pstd for r in group], dtype=torch.float64)
    out = compute_advantages(torch.tensor(group, dtype=torch.float64), GROUP_SIZE, "grpo")
    assert not torch.allclose(out, population_version, atol=1e-3)


def test_dr_grpo_only_subtracts_group_mean():
    expected = []
    for group in _groups(REWARDS, GROUP_SIZE):
        expected += [r - statistics.mean(group) for r in group]
    _assert_close(compute_advantages(torch.tensor(REWARDS), GROUP_SIZE, "dr_grpo"), expected)


def test_rloo_subtracts_mean_of_the_other_samples():
    expected = []
    for group in _groups(REWARDS, GROUP_SIZE):
        for i, r in enumerate(group):
            others = group[:i] + group[i + 1 :]
            expected.append(r - sum(others) / len(others))
    _assert_close(compute_advantages(torch.tensor(REWARDS), GROUP_SIZE, "rloo"), expected)


@pytest.mark.parametrize("method", ADVANTAGE_METHODS)
def test_constant_reward_group_gets_zero_advantage(method):
    rewards = torch.tensor([3.0, 3.0, 3.0, 0.0, 1.0, 1.0])
    out = compute_advantages(rewards, 3, method)
    _assert_close(out[:3], [0.0, 0.0, 0.0])
    assert out[3:].abs().sum() > 0


@pytest.mark.parametrize("method", ADVANTAGE_METHODS)
def test_group_size_one_gives_finite_zeros(method):
    out = compute_advantages(torch.tensor([1.0, -2.0, 5.0]), 1, method)
    _assert_close(out, [0.0, 0.0, 0.0])


def test_integer_rewards_are_promoted_to_float():
    out = compute_advantages(torch.tensor([1, 0, 0, 0]), 4, "dr_grpo")
    assert out.dtype == torch.float32
    _assert_close(out, [0.75, -0.25, -0.25, -0.25])


def test_unknown_method_names_it_and_the_allowed_ones():
    with pytest.raises(ValueError, match=r"'ppo'.*grpo.*dr_grpo.*rloo"):
        compute_advantages(torch.zeros(4), 2, "ppo")


def test_rewards_not_divisible_into_groups_is_rejected():
    with pytest.raises(ValueError, match="group_size=4"):
        compute_advantages(torch.zeros(6), 4)


def test_dynamic_sampling_keeps_only_groups_with_reward_spread():
    rewards = torch.tensor([1.0, 1.0, 1.0, 0.0, 1.0, 0.0, 2.0, 2.0, 2.0, 0.0, 0.0, 5.0])
    keep = dynamic_sampling_keep(rewards, 3)
    assert keep.dtype == torch.bool
    assert keep.tolist() == [False, True, False, True]


def test_dynamic_sampling_never_keeps_single_sample_groups():
    assert dynamic_sampling_keep(torch.tensor([0.0, 1.0]), 1).tolist() == [False, False]
