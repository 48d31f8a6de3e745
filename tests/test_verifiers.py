"""Specification of torchplex.rl.verifiers and rl.reward_functions: math-verify on a table of (non-)equivalent
answers, multiple choice, numeric tolerance, box IoU, think/answer format, user rewards by import path, raising
rewards counted with the record id and the failure-fraction stop."""

from __future__ import annotations

import logging
import sys
import textwrap

import pytest

from torchplex.data.records import PromptRecord
from torchplex.rl import verifiers
from torchplex.rl.reward_functions import (RecordAnswer, RewardFailureError, RewardLedger, get_reward,
                                           reward_answers, score_rewards)
from torchplex.rl.rewards import combine_rewards

EQUIVALENT = [  # (response, reference)
    ("<answer>\\frac{1}{2}</answer>", "0.5"),
    ("The result is \\boxed{\\frac{1}{2}}.", "1/2"),
    ("<answer>$0.5$</answer>", "\\frac{1}{2}"),
    ("\\boxed{3\\sqrt{3}}", "3\\sqrt{3}"),
    ("<answer>\\sqrt{27}</answer>", "3\\sqrt{3}"),
    ("so $x = 2$", "2"),
    ("\\boxed{2\\pi}", "2\\pi"),
    ("<answer>50\\%</answer>", "50"),
    ("\\boxed{(1, 2)}", "(1,2)"),
    ("<answer>1000</answer>", "1,000"),
    ("\\boxed{\\dfrac{3}{4}}", "\\frac{3}{4}"),
]
NOT_EQUIVALENT = [
    ("<answer>\\frac{1}{3}</answer>", "0.5"),
    ("\\boxed{3\\sqrt{2}}", "3\\sqrt{3}"),
    ("<answer>2\\pi</answer>", "2"),
    ("\\boxed{(2, 1)}", "(1,2)"),
    ("no answer at all", "7"),
    ("<answer></answer>", "1"),
]


@pytest.mark.parametrize("response, reference", EQUIVALENT)
def test_math_verifier_accepts_equivalent_answers(response, reference):
    assert verifiers.math_reward(response, reference) == 1.0


@pytest.mark.parametrize("response, reference", NOT_EQUIVALENT)
def test_math_verifier_rejects_different_answers(response, reference):
    assert verifiers.math_reward(response, reference) == 0.0


@pytest.mark.parametrize("response, answer, expected", [
    ("<answer>B</answer>", "B", 1.0), ("<answer>(C) a cat</answer>", "C", 1.0), ("The answer is D.", "D", 1.0),
    ("<answer>B. the red one</answer>", "(B)", 1.0), ("<answer>A</answer>", "B", 0.0), ("I do not know", "A", 0.0),
    ("<think>hmm</think><answer>B</answer>", "<answer>B</answer>", 1.0),  # Video-R1 tags its references
])
def test_multiple_choice(response, answer, expected):
    assert verifiers.multiple_choice_reward(response, answer) == expected


@pytest.mark.parametrize("response, answer, expected", [
    ("<answer>3.1416</answer>", "3.14159", 1.0),  # |diff| 1e-5 < 1e-3 * 3.14
    ("<answer>3.2</answer>", "3.14159", 0.0), ("<answer>about 1,250 m</answer>", "1250", 1.0),
    ("<answer>-0.0000001</answer>", "0", 1.0), ("<answer>none</answer>", "2", 0.0),
])
def test_numeric_with_tolerance(response, answer, expected):
    assert verifiers.numeric_reward(response, answer) == expected


def test_box_iou_against_hand_computed_areas():
    # [0,0,10,10] vs [5,0,15,10]: intersection 50, union 150
    assert verifiers.iou_reward("<answer>[5, 0, 15, 10]</answer>", "[0, 0, 10, 10]") == pytest.approx(1 / 3)
    assert verifiers.iou_reward("<answer>(10,10,0,0)</answer>", "[0,0,10,10]") == 1.0  # corners in any order
    assert verifiers.iou_reward("<answer>[20,20,30,30]</answer>", "[0,0,10,10]") == 0.0
    assert verifiers.iou_reward("<answer>[1,2]</answer>", "[0,0,10,10]") == 0.0


@pytest.mark.parametrize("response, expected", [
    ("<think>2+2</think><answer>4</answer>", 1.0), ("  <think>a\nb</think>\n<answer>4</answer>\n", 1.0),
    ("<answer>4</answer>", 0.0), ("<think>x</think><answer>4</answer> extra", 0.0),
    ("<think>x</think><think>y</think><answer>4</answer>", 0.0), ("<think></think><answer>4</answer>", 0.0),
])
def test_think_answer_format(response, expected):
    assert verifiers.think_format_reward(response, "4") == expected


@pytest.fixture
def user_module(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(textwrap.dedent("""
        def length_bonus(prompts, responses, answers, records):
            return [len(r) / 10 + (1.0 if rec is not None and rec.meta.get("bonus") else 0.0)
                    for r, rec in zip(responses, records)]

        def fragile(prompts, responses, answers, records):
            out = []
            for r, rec in zip(responses, records):
                if "boom" in r:
                    raise RuntimeError("cannot score " + rec.id)
                out.append(1.0)
            return out

        def wrong_count(prompts, responses, answers, records):
            return [1.0]
    """))
    monkeypatch.syspath_prepend(str(tmp_path))
    yield tmp_path
    sys.modules.pop("my_rewards", None)


def records(n: int) -> list[PromptRecord]:
    return [PromptRecord(id=f"r{i}", prompt=f"q{i}", answer="1", meta={"bonus": i == 0}) for i in range(n)]


def test_user_reward_by_import_path_sees_prompt_response_answer_and_record(user_module):
    ledger = RewardLedger(max_failure_fraction=0.0)
    total, parts = combine_rewards(["abcde", "ab"], reward_answers(records(2), ledger),
                                   ["my_rewards:length_bonus", "format"], [1.0, 1.0])
    assert parts["my_rewards:length_bonus"] == [1.5, 0.2] and total == [1.5, 0.2]
    by_file = get_reward(f"{user_module / 'my_rewards.py'}:length_bonus")  # a file path works too
    assert list(by_file(prompts=["q"], responses=["abc"], answers=["1"], records=[None])) == [pytest.approx(0.3)]


def test_raising_reward_is_counted_with_the_record_id_and_scores_zero(user_module, caplog):
    ledger = RewardLedger(max_failure_fraction=0.5)
    with caplog.at_level(logging.WARNING):
        total, parts = score_rewards(["fine", "boom", "ok", "fine"], reward_answers(records(4), ledger),
                                     ["my_rewards:fragile"])
    assert total == [1.0, 0.0, 1.0, 1.0]
    assert ledger.failures == 1 and ledger.by_function == {"my_rewards:fragile": 1}
    assert any("r1" in m and "cannot score r1" in m for m in caplog.messages)


def test_too_many_failures_stop_the_run(user_module):
    ledger = RewardLedger(max_failure_fraction=0.25)
    with pytest.raises(RewardFailureError, match="2 of 4 samples"):
        score_rewards(["boom", "boom", "ok", "ok"], reward_answers(records(4), ledger), ["my_rewards:fragile"])
    assert ledger.failures == 2


def test_a_reward_returning_the_wrong_count_fails_per_sample(user_module):
    ledger = RewardLedger(max_failure_fraction=1.0)
    total, _ = score_rewards(["a", "b"], reward_answers(records(2), ledger), ["my_rewards:wrong_count"])
    assert total == [1.0, 1.0] and ledger.failures == 0  # one sample at a time it returns one value: fine


def test_bad_import_paths_name_the_problem(user_module):
    with pytest.raises(KeyError, match="unknown reward function"):
        get_reward("no_such_reward")
    with pytest.raises(ModuleNotFoundError):
        get_reward("no_such_module_xyz:fn")
    with pytest.raises(ValueError, match="has no 'missing'"):
        get_reward("my_rewards:missing")


def test_record_answer_is_still_the_answer_string():
    answer = RecordAnswer("42", record=None, prompt="q")
    assert answer == "42" and answer.strip() == "42" and isinstance(answer, str)
