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


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
@pytest.mark.parametrize("method", ADVANTAGE_METHODS)
def test_equal_rewards_give_exactly_zero_for_every_value_dtype_and_group_size(method, dtype):
    """Issue 16 defect 2: equal rewards in a group must give exactly 0 (compute_advantages(full((8,), 0.7), 8,
    "grpo") gave 0.056 per sample in float32: the mean was an ulp off and grpo divided it by an ulp-sized std)."""
    values = [0.7, 0.1, 1 / 3, -2.3, 1e-8, 123.456, 1e6 + 0.1, 0.0, -0.0, 1.0, 0.3]
    for size in (2, 3, 5, 7, 8, 16, 64, 100):
        for v in values:
            other = torch.full((size,), 0.25, dtype=dtype)
            other[0] = 1.0  # a varied group beside it keeps its own advantages
            rewards = torch.cat([torch.full((size,), v, dtype=dtype), other])
            out = compute_advantages(rewards, size, method)
            assert out.dtype == dtype
            assert torch.equal(out[:size], torch.zeros(size, dtype=dtype)), (method, dtype, size, v, out[:size])
            assert out[size:].abs().sum() > 0
            reference = compute_advantages(other.double(), size, method).to(dtype)
            torch.testing.assert_close(out[size:], reference, rtol=1e-6, atol=0)


def test_grpo_matches_the_published_formula_with_the_sample_std():
    """DeepSeekMath's (r - mean) / std, with the sample (n - 1) std of verl and TRL and their eps = 1e-6, in plain
    Python for a float32 batch; Dr. GRPO's r - mean without the std."""
    rewards = [0.7, 0.7, 0.7, 0.2, 1.0, 0.0, 0.0, 1.0]
    out = compute_advantages(torch.tensor(rewards), 4, "grpo")
    dr = compute_advantages(torch.tensor(rewards), 4, "dr_grpo")
    for g in range(2):
        group = [float(torch.tensor(r)) for r in rewards[4 * g:4 * g + 4]]  # the float32 values, exactly
        mean, std = statistics.mean(group), statistics.stdev(group)
        expected = [(r - mean) / (std + 1e-6) for r in group]
        torch.testing.assert_close(out[4 * g:4 * g + 4], torch.tensor(expected), rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(dr[4 * g:4 * g + 4], torch.tensor([r - mean for r in group]), rtol=0, atol=1e-7)
