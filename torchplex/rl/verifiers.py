"""Verifiable rewards for public VLM-RL recipes: math (math-verify), multiple choice, numbers with a tolerance,
box IoU, and the `<think>...</think><answer>...</answer>` format.

Each has the built-in signature `fn(response, answer) -> float`. Where a response has `<answer>` tags their last
content is what is checked (rl/rewards.py's rule); without tags the whole response is, so `\\boxed{}` answers of
math recipes work too. References get the same treatment (Video-R1 stores "<answer>B</answer>").

Math equivalence is math-verify's (Hugging Face's parser + sympy comparison used by open-r1/EasyR1), not our own
parsing: "\\frac{1}{2}", "0.5" and "\\boxed{1/2}" agree; "x = 2" agrees with "2". Its timeouts use SIGALRM, which
only works in the main thread, so off the main thread they are disabled.
"""

from __future__ import annotations

import math
import re
import threading

from .rewards import extract_answer

_CHOICE_RE = re.compile(r"^\(?([A-Z])(?:[).:]|\s|$)")
_CHOICE_IN_TEXT_RE = re.compile(r"(?:answer|option|choice)\s*(?:is|:)?\s*\(?([A-Z])\b\)?", re.IGNORECASE)
_NUMBER_RE = re.compile(r"[-+]?(?:\d+(?:,\d{3})*(?:\.\d*)?|\.\d+)(?:[eE][-+]?\d+)?")
_THINK_ANSWER_RE = re.compile(r"^\s*<think>(?:(?!<think>|</think>).)+</think>\s*<answer>(?:(?!<answer>|</answer>).)+"
                              r"</answer>\s*$", re.DOTALL)


def answer_text(response: str) -> str:
    """The last `<answer>` content when there is one, else the whole response."""
    tagged = extract_answer(response)
    return tagged if tagged is not None else response


# ---- math ----------------------------------------------------------------------------------------------------
def _math_timeout() -> int | None:
    return 5 if threading.current_thread() is threading.main_thread() else None


def math_equal(predicted: str, reference: str) -> bool:
    """math-verify's equivalence of a predicted answer (free text, LaTeX, \\boxed) and a reference answer."""
    from math_verify import parse, verify

    timeout = _math_timeout()
    # A bare reference ("\\frac{1}{2}", "3\\sqrt{3}") needs math delimiters for the LaTeX extractor.
    gold_text = reference if ("$" in reference or "\\boxed" in reference) else f"${reference}$"
    gold = parse(gold_text, parsing_timeout=timeout)
    if not gold:
        gold = parse(reference, parsing_timeout=timeout)
    pred = parse(predicted, parsing_timeout=timeout)
    if not gold or not pred:
        return False
    return bool(verify(gold, pred, timeout_seconds=timeout))


def math_reward(response: str, answer: str) -> float:
    text = answer_text(response)
    if "\\boxed" not in text and "$" not in text and extract_answer(response) is not None:
        text = f"${text}$"  # a tagged bare answer ("\\frac{1}{2}") is LaTeX without delimiters
    return 1.0 if math_equal(text, answer_text(answer)) else 0.0


# ---- multiple choice -----------------------------------------------------------------------------------------
def extract_choice(text: str) -> str | None:
    """The option letter in "B", "(B)", "B. text", "B) text" or "the answer is B"; None if there is none."""
    text = text.strip()
    m = _CHOICE_RE.match(text)
    if m:
        return m.group(1)
    found = _CHOICE_IN_TEXT_RE.findall(text)
    return found[-1].upper() if found else None


def multiple_choice_reward(response: str, answer: str) -> float:
    predicted, reference = extract_choice(answer_text(response)), extract_choice(answer_text(answer))
    return 1.0 if predicted is not None and predicted == reference else 0.0


# ---- numbers ---------------------------------------------------------------------------------------------------
def parse_number(text: str) -> float | None:
    """The last number in `text` ("about 1,250.5 m" -> 1250.5)."""
    found = _NUMBER_RE.findall(text)
    if not found:
        return None
    return float(found[-1].replace(",", ""))


def numeric_equal(predicted: float, reference: float, rel_tol: float = 1e-3, abs_tol: float = 1e-6) -> bool:
    return math.isfinite(predicted) and abs(predicted - reference) <= max(abs_tol, rel_tol * abs(reference))


def numeric_reward(response: str, answer: str, rel_tol: float = 1e-3) -> float:
    predicted, reference = parse_number(answer_text(response)), parse_number(answer_text(answer))
    if predicted is None or reference is None:
        return 0.0
    return 1.0 if numeric_equal(predicted, reference, rel_tol) else 0.0


# ---- boxes -----------------------------------------------------------------------------------------------------
def parse_box(text: str) -> tuple[float, float, float, float] | None:
    """The first four numbers of `text` as (x1, y1, x2, y2), corners sorted; None if fewer than four."""
    found = _NUMBER_RE.findall(text)
    if len(found) < 4:
        return None
    x1, y1, x2, y2 = (float(v.replace(",", "")) for v in found[:4])
    return min(x1, x2), min(y1, y2), max(x1, x2), max(y1, y2)


def box_iou(a: tuple[float, float, float, float], b: tuple[float, float, float, float]) -> float:
    inter_w = max(0.0, min(a[2], b[2]) - max(a[0], b[0]))
    inter_h = max(0.0, min(a[3], b[3]) - max(a[1], b[1]))
    inter = inter_w * inter_h
    union = (a[2] - a[0]) * (a[3] - a[1]) + (b[2] - b[0]) * (b[3] - b[1]) - inter
    return inter / union if union > 0 else 0.0


def iou_reward(response: str, answer: str) -> float:
    predicted, reference = parse_box(answer_text(response)), parse_box(answer_text(answer))
    return box_iou(predicted, reference) if predicted and reference else 0.0


# ---- format ----------------------------------------------------------------------------------------------------
def think_format_reward(response: str, answer: str) -> float:
    """1.0 for exactly `<think>reasoning</think><answer>answer</answer>` (whitespace around allowed), else 0."""
    del answer
    return 1.0 if _THINK_ANSWER_RE.match(response) else 0.0


VERIFIERS = {
    "math": math_reward,
    "multiple_choice": multiple_choice_reward,
    "numeric": numeric_reward,
    "iou": iou_reward,
    "think_format": think_format_reward,
}
