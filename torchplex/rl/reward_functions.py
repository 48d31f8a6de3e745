"""Reward functions by name or import path, scored per batch, with failures counted instead of ending the run.

`reward.functions` entries are either built-in names (rl/rewards.py's "accuracy", "format"; rl/verifiers.py's
"math", "multiple_choice", "numeric", "iou", "think_format") or a user function `"package.module:function"` (or
`"path/to/file.py:function"`). A user function is called once per batch with keyword arguments

    fn(prompts=[...], responses=[...], answers=[...], records=[...]) -> list[float]

(`records` are the data/records.py PromptRecords, `None` where the caller had none). Built-ins are per sample.

A function that raises (or returns the wrong count, or a non-finite number) is retried one sample at a time, so
only the samples that fail get reward 0; each failure is counted and logged with the record id. If more than
`max_failure_fraction` of a call's samples fail, `RewardFailureError` stops the run: a broken reward would
otherwise train on zeros silently.

The step's interfaces pass answers as strings; `RecordAnswer` is a `str` (the reference answer) that also
carries its record, prompt and the run's `RewardLedger`, so rewards see the record without those interfaces
changing.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import logging
import math
import os
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from . import rewards, verifiers

log = logging.getLogger(__name__)

BatchRewardFn = Callable[..., Sequence[float]]


class RewardFailureError(RuntimeError):
    """Too large a fraction of one step's samples failed to be scored."""


@dataclass
class RewardLedger:
    max_failure_fraction: float = 0.0
    failures: int = 0
    by_function: dict[str, int] = field(default_factory=dict)
    first_error: dict[str, str] = field(default_factory=dict)  # per function: its first failure, record and error

    def record(self, name: str, record_id: str, err: BaseException) -> None:
        if not self.by_function.get(name):
            self.first_error[name] = f"record {record_id}: {type(err).__name__}: {err}"
            log.warning("reward %r failed on record %s: %s: %s (sample reward 0; later failures are counted in "
                        "reward/failures)", name, record_id, type(err).__name__, err)
        else:
            log.debug("reward %r failed on record %s: %s", name, record_id, err)
        self.failures += 1
        self.by_function[name] = self.by_function.get(name, 0) + 1


class RecordAnswer(str):
    """A reference answer that remembers its record (see the module docstring)."""

    record: Any
    prompt: str
    ledger: RewardLedger | None

    def __new__(cls, answer: str, record: Any = None, prompt: str = "", ledger: RewardLedger | None = None):
        obj = super().__new__(cls, answer)
        obj.record, obj.prompt, obj.ledger = record, prompt, ledger
        return obj


def reward_answers(records: Sequence[Any], ledger: RewardLedger) -> list[RecordAnswer]:
    return [RecordAnswer(r.answer, r, r.prompt, ledger) for r in records]


# ---- resolution ----------------------------------------------------------------------------------------------
def _import(path: str) -> Callable:
    module_name, _, attr = path.rpartition(":")
    if not module_name or not attr:
        raise ValueError(f"reward {path!r}: an import path looks like 'package.module:function'")
    if module_name.endswith(".py"):
        file = Path(module_name).expanduser()
        spec = importlib.util.spec_from_file_location(file.stem, file)
        if spec is None or not file.is_file():
            raise ValueError(f"reward {path!r}: no file {file}")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    else:
        module = importlib.import_module(module_name)
    try:
        fn = getattr(module, attr)
    except AttributeError:
        raise ValueError(f"reward {path!r}: module {module_name} has no {attr!r}") from None
    if not callable(fn):
        raise ValueError(f"reward {path!r} is not callable")
    return fn


def is_builtin(name: str) -> bool:
    return name in rewards.REWARD_FUNCTIONS or name in verifiers.VERIFIERS


def locate_reward(name: str, base: Path) -> str:
    """`name` in a form that resolves from any working folder, `base` being the folder a relative name means (the
    TOML's folder, or the one the command was run from). "path/file.py:f" gets an absolute path; "module:f" stays
    as it is when `module` is importable, else becomes the file base/module.py (base/pkg/module.py for
    "pkg.module:f") where that exists: run_train.sh runs from the repo root, where the caller's module is not on
    the import path. Built-in names and names that locate nowhere are returned unchanged (the check reports them)."""
    module, colon, attr = name.rpartition(":")
    if is_builtin(name) or not colon or not module:
        return name
    if module.endswith(".py"):
        path = Path(module).expanduser()
        return f"{os.path.normpath(path if path.is_absolute() else base / path)}:{attr}"
    try:
        if importlib.util.find_spec(module.split(".")[0]) is not None:
            return name
    except (ImportError, ValueError):
        return name
    candidate = base.joinpath(*module.split(".")).with_suffix(".py")
    return f"{candidate}:{attr}" if candidate.is_file() else name


def _per_sample(fn: Callable[[str, str], float]) -> BatchRewardFn:
    def batch(prompts, responses, answers, records):
        del prompts, records
        return [float(fn(r, a)) for r, a in zip(responses, answers)]
    return batch


def get_reward(name: str) -> BatchRewardFn:
    """A batch reward for `name`: a built-in (looked up at call time, so tests can register one) or an import path."""
    if name in rewards.REWARD_FUNCTIONS:
        return _per_sample(rewards.REWARD_FUNCTIONS[name])
    if name in verifiers.VERIFIERS:
        return _per_sample(verifiers.VERIFIERS[name])
    if ":" in name:
        fn = _import(name)
        params = inspect.signature(fn).parameters
        missing = [p for p in ("prompts", "responses", "answers", "records") if p not in params]
        if missing and not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values()):
            raise ValueError(f"reward {name!r} must accept keyword arguments prompts, responses, answers, records "
                             f"(missing {missing})")
        return fn
    known = sorted({*rewards.REWARD_FUNCTIONS, *verifiers.VERIFIERS})
    raise KeyError(f"unknown reward function {name!r}; known: {', '.join(known)}, or 'module:function'")


# ---- scoring -------------------------------------------------------------------------------------------------
def _checked(values: Any, n: int) -> list[float]:
    values = [float(v) for v in values]
    if len(values) != n:
        raise ValueError(f"returned {len(values)} rewards for {n} samples")
    if not all(math.isfinite(v) for v in values):
        raise ValueError(f"returned a non-finite reward in {values}")
    return values


def _record_id(answer: Any, index: int) -> str:
    record = getattr(answer, "record", None)
    return str(getattr(record, "id", f"sample {index}"))


def score_one(name: str, fn: BatchRewardFn, prompts, responses, answers, records,
              ledger: RewardLedger) -> tuple[list[float], set[int]]:
    """Scores of one reward over the batch, and the indices of the samples it failed on."""
    n = len(responses)
    try:
        return _checked(fn(prompts=prompts, responses=responses, answers=answers, records=records), n), set()
    except Exception:  # noqa: BLE001 - any user error: find the samples it comes from, one at a time
        pass
    scores, failed = [0.0] * n, set()
    for i in range(n):
        try:
            scores[i] = _checked(fn(prompts=prompts[i:i + 1], responses=responses[i:i + 1],
                                    answers=answers[i:i + 1], records=records[i:i + 1]), 1)[0]
        except Exception as err:  # noqa: BLE001
            failed.add(i)
            ledger.record(name, _record_id(answers[i], i), err)
    return scores, failed


def score_rewards(responses: Sequence[str], answers: Sequence[str], names: Sequence[str],
                  weights: Sequence[float] | None = None) -> tuple[list[float], dict[str, list[float]]]:
    """`rewards.combine_rewards`' contract, with batch/user functions and failure accounting."""
    if len(responses) != len(answers):
        raise ValueError(f"{len(responses)} responses but {len(answers)} answers")
    if not names:
        raise ValueError("combine_rewards needs at least one reward name")
    if len(set(names)) != len(names):
        raise ValueError(f"reward names repeat: {list(names)}")
    weights = [1.0] * len(names) if weights is None else list(weights)
    if len(weights) != len(names):
        raise ValueError(f"{len(names)} reward names but {len(weights)} weights")
    fns = [get_reward(n) for n in names]  # fail on an unknown name before scoring anything
    responses, answers = list(responses), list(answers)
    ledger = next((a.ledger for a in answers if getattr(a, "ledger", None) is not None), None) or RewardLedger()
    prompts = [getattr(a, "prompt", "") for a in answers]
    records = [getattr(a, "record", None) for a in answers]
    per_fn, failed = {}, set()
    for name, fn in zip(names, fns):
        per_fn[name], bad = score_one(name, fn, prompts, responses, answers, records, ledger)
        failed |= bad
    if responses and len(failed) / len(responses) > ledger.max_failure_fraction:
        first = "; ".join(f"{name!r} first failed on {where}" for name, where in ledger.first_error.items())
        raise RewardFailureError(f"reward functions failed on {len(failed)} of {len(responses)} samples, over "
                                 f"reward.max_failure_fraction={ledger.max_failure_fraction} (failures so far: "
                                 f"{ledger.by_function}; {first})")
    total = [sum(w * per_fn[n][i] for n, w in zip(names, weights)) for i in range(len(responses))]
    return total, per_fn
