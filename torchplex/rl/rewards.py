"""Reward functions for answer-in-tags tasks, chosen by name from the config.

Every reward function has the signature ``fn(response: str, answer: str) -> float`` where
``response`` is the decoded completion (without the prompt) and ``answer`` the record's
reference answer. Prompts ask for the final answer in ``<answer></answer>``; the answer is the
content of the *last* such pair, so a model may think aloud (and even draft answers) first.

- "accuracy": 1.0 if the extracted answer equals the reference after normalisation (case,
  whitespace, a trailing period; numbers compared by value, with number words zero..twenty
  understood), else 0.0. A response without answer tags scores 0.0.
- "format":   1.0 if the response holds exactly one well-formed, non-empty ``<answer>...</answer>``
  with nothing but whitespace after it, else 0.0.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence

RewardFn = Callable[[str, str], float]

_ANSWER_RE = re.compile(r"<answer>((?:(?!<answer>).)*?)</answer>", re.DOTALL)

_NUMBER_WORDS = {
    w: i
    for i, w in enumerate(
        "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen "
        "fifteen sixteen seventeen eighteen nineteen twenty".split()
    )
}
# Plain decimal numbers with optional sign and thousands separators: "3", "-2.50", "1,000".
_NUMBER_RE = re.compile(r"[+-]?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|[+-]?\.\d+")


def extract_answer(text: str) -> str | None:
    """Content of the last ``<answer>...</answer>`` in ``text``, stripped; None if there is none."""
    matches = _ANSWER_RE.findall(text)
    return matches[-1].strip() if matches else None


def normalize_answer(text: str) -> str:
    """Lower-case, collapse whitespace, drop trailing periods."""
    return " ".join(text.lower().split()).rstrip(".").rstrip()


def _as_number(normalized: str) -> float | None:
    if normalized in _NUMBER_WORDS:
        return float(_NUMBER_WORDS[normalized])
    if _NUMBER_RE.fullmatch(normalized):
        return float(normalized.replace(",", ""))
    return None


def answers_match(predicted: str, reference: str) -> bool:
    """Whether two answer strings mean the same, numerically when both are numbers."""
    p, r = normalize_answer(predicted), normalize_answer(reference)
    if p == r:
        return True
    p_num, r_num = _as_number(p), _as_number(r)
    return p_num is not None and r_num is not None and p_num == r_num


def accuracy_reward(response: str, answer: str) -> float:
    predicted = extract_answer(response)
    return 1.0 if predicted is not None and answers_match(predicted, answer) else 0.0


def format_reward(response: str, answer: str) -> float:
    del answer  # the format does not depend on the reference
    if response.count("<answer>") != 1 or response.count("</answer>") != 1:
        return 0.0
    start = response.index("<answer>")
    end = response.index("</answer>")
    if end < start:
        return 0.0
    content = response[start + len("<answer>") : end]
    if not content.strip():
        return 0.0
    trailing = response[end + len("</answer>") :]
    return 1.0 if not trailing.strip() else 0.0


REWARD_FUNCTIONS: dict[str, RewardFn] = {
    "accuracy": accuracy_reward,
    "format": format_reward,
}


def get_reward_fn(name: str) -> RewardFn:
    try:
        return REWARD_FUNCTIONS[name]
    except KeyError:
        raise KeyError(
            f"unknown reward function {name!r}; known: {', '.join(sorted(REWARD_FUNCTIONS))}"
        ) from None


def is_correct(response: str, answer: str) -> bool:
    """Eval-time correctness: the same test as the accuracy reward."""
    return accuracy_reward(response, answer) == 1.0


def combine_rewards(
    responses: Sequence[str],
    answers: Sequence[str],
    names: Sequence[str],
    weights: Sequence[float] | None = None,
) -> tuple[list[float], dict[str, list[float]]]:
    """Score each response with every named reward and return the weighted sum per response.

    Returns ``(total, per_fn)``: ``total[i] = sum_k weights[k] * per_fn[names[k]][i]``, and the
    unweighted per-function scores for logging. ``weights=None`` means 1.0 each. Names may also be
    rl/verifiers.py's built-ins or user functions by import path; a failing function is counted
    (rl/reward_functions.py, which does the scoring).
    """
    # Imported here: reward_functions builds on this module's registry.
    from .reward_functions import score_rewards

    return score_rewards(responses, answers, names, weights)
