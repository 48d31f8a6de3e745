"""Specification of answer extraction, the named reward functions and their weighted combination."""

from __future__ import annotations

import pytest

from torchplex.rl.rewards import (
    REWARD_FUNCTIONS,
    accuracy_reward,
    combine_rewards,
    extract_answer,
    format_reward,
    get_reward_fn,
    is_correct,
)


@pytest.mark.parametrize(
    "text, expected",
    [
        ("<answer>3</answer>", "3"),
        ("I think so.\n<answer>  red \n</answer>", "red"),
        ("<answer>2</answer> no wait <answer>4</answer>", "4"),  # the last one counts
        ("<answer>two\nlines</answer>", "two\nlines"),
        ("<answer><answer>5</answer>", "5"),  # a stray opener does not swallow the answer
        ("<answer></answer>", ""),
        ("the answer is 3", None),
        ("<answer>3", None),
        ("3</answer>", None),
    ],
)
def test_extract_answer(text, expected):
    assert extract_answer(text) == expected


@pytest.mark.parametrize(
    "response, answer, expected",
    [
        ("<answer>red</answer>", "red", 1.0),
        ("<answer> Red. </answer>", "red", 1.0),  # case, whitespace, trailing period
        ("<answer>light   blue</answer>", "Light Blue", 1.0),
        ("<answer>blue</answer>", "red", 0.0),
        ("<answer>3.0</answer>", "3", 1.0),  # numbers compare by value
        ("<answer>three</answer>", "3", 1.0),  # number words up to twenty
        ("<answer>3</answer>", "Three", 1.0),
        ("<answer>twenty</answer>", "20", 1.0),
        ("<answer>1,000</answer>", "1000", 1.0),
        ("<answer>-2.50</answer>", "-2.5", 1.0),
        ("<answer>4</answer>", "3", 0.0),
        ("<answer>thirty</answer>", "30", 0.0),  # beyond the word list: compared as text
        ("<answer>3 circles</answer>", "3", 0.0),
        ("3", "3", 0.0),  # no tags, no credit
        ("<answer>2</answer> actually <answer>3</answer>", "3", 1.0),
    ],
)
def test_accuracy_reward(response, answer, expected):
    assert accuracy_reward(response, answer) == expected
    assert is_correct(response, answer) is (expected == 1.0)


@pytest.mark.parametrize(
    "response, expected",
    [
        ("<answer>3</answer>", 1.0),
        ("There are three circles, so\n<answer>3</answer>\n", 1.0),  # reasoning first is fine
        ("<think>count them</think><answer>3</answer>", 1.0),
        ("<answer>3</answer> because I counted", 0.0),  # nothing may follow the answer
        ("<answer>3</answer><answer>3</answer>", 0.0),  # exactly one answer
        ("<answer>   </answer>", 0.0),  # empty answer
        ("</answer>3<answer>", 0.0),
        ("<answer>3", 0.0),
        ("3", 0.0),
    ],
)
def test_format_reward(response, expected):
    assert format_reward(response, "anything") == expected


def test_registry_names_the_reward_functions():
    assert REWARD_FUNCTIONS == {"accuracy": accuracy_reward, "format": format_reward}
    assert get_reward_fn("format") is format_reward


def test_unknown_reward_name_lists_the_known_ones():
    with pytest.raises(KeyError, match="'length'.*known: accuracy, format"):
        get_reward_fn("length")


def test_combine_rewards_weights_each_function():
    responses = [
        "<answer>3</answer>",  # correct, well formed
        "<answer>4</answer>",  # wrong, well formed
        "3",  # no tags: neither
        "<answer>3</answer> done",  # correct, but text after the answer
    ]
    answers = ["3", "3", "3", "3"]
    total, per_fn = combine_rewards(responses, answers, ["accuracy", "format"], [1.0, 0.25])
    assert per_fn == {"accuracy": [1.0, 0.0, 0.0, 1.0], "format": [1.0, 1.0, 0.0, 0.0]}
    assert total == pytest.approx([1.25, 0.25, 0.0, 1.0], abs=1e-12)


def test_combine_rewards_defaults_to_unit_weights():
    total, _ = combine_rewards(["<answer>a</answer>"], ["a"], ["accuracy", "format"])
    assert total == [2.0]


@pytest.mark.parametrize(
    "args, message",
    [
        ((["x"], ["a", "b"], ["accuracy"], [1.0]), "1 responses but 2 answers"),
        ((["x"], ["a"], ["accuracy", "format"], [1.0]), "2 reward names but 1 weights"),
        ((["x"], ["a"], ["accuracy", "accuracy"], [1.0, 1.0]), "repeat"),
        ((["x"], ["a"], [], []), "at least one"),
    ],
)
def test_combine_rewards_rejects_mismatched_inputs(args, message):
    with pytest.raises(ValueError, match=message):
        combine_rewards(*args)
