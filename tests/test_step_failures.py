"""A step that fails surfaces its own error, not one of the step's clean-up."""

from __future__ import annotations

import pytest

from step_runners import cpu_runner
from torchplex.rl import rewards
from torchplex.rl.reward_functions import RewardFailureError, RewardLedger, reward_answers
from torchplex.rollout.sampling import SamplingParams
from torchplex.data.records import PromptRecord


def broken_reward(response: str, answer: str) -> float:
    raise ZeroDivisionError("the user's reward divided by zero")


def test_a_serial_step_whose_reward_fails_raises_the_reward_error(grpo_assets, monkeypatch):
    """Issue 47, defect 2: any failure inside a serial step became `AttributeError: 'SerialScorer' object has no
    attribute 'new_step'` from the step's failure handler, hiding the error (here rewards failing on more samples
    than reward.max_failure_fraction allows)."""
    monkeypatch.setitem(rewards.REWARD_FUNCTIONS, "broken", broken_reward)
    setup = (grpo_assets.processor, grpo_assets.prompts, grpo_assets.actor, grpo_assets.reference)
    runner = cpu_runner(setup, "serial", budget=0, micro_batch=8, kv_pool=2 * 2**20)
    runner.settings.reward_names, runner.settings.reward_weights = ["broken"], [1.0]
    records = [PromptRecord(id=f"r{i}", prompt="p", answer="1") for i in range(len(grpo_assets.prompts))]
    answers = reward_answers(records, RewardLedger(max_failure_fraction=0.1))
    params = SamplingParams(n=2, max_new_tokens=3, seed=0, stop_token_ids=[grpo_assets.eos_id])
    with pytest.raises(RewardFailureError, match="reward.max_failure_fraction=0.1") as failed:
        runner.run(grpo_assets.prompts, answers, params)
    assert "divided by zero" in str(failed.value)  # the reward's own error, in the message the user sees
