"""Evaluation on any number of eval sets: greedy accuracy, and mean@k / pass@j from k samples per prompt.

Metric names: `eval/<set>/accuracy` (greedy), `eval/<set>/mean@k` (mean correctness of the k samples) and
`eval/<set>/pass@j` for j = 1, 2, 4, ... up to k, with the unbiased estimator of Chen et al. 2021 ("Evaluating
Large Language Models Trained on Code", eq. 1): per prompt with n samples of which c are correct,
pass@j = 1 - C(n - c, j) / C(n, j), averaged over prompts. The legacy single eval set (data.eval_file or the
synthetic task) keeps its names `eval/accuracy` and `eval/format`.

Correctness is the reward named by `reward.correct` scoring 1.0 (default "accuracy"); a user reward by import
path works the same. Failures of that reward during eval count as incorrect and never stop the run.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from .data.prompts import PromptEncoder
from .data.records import PromptRecord
from .rl.reward_functions import RewardLedger, get_reward, reward_answers, score_one
from .rl.rewards import format_reward

log = logging.getLogger(__name__)

# generate(prompts, greedy, n) -> per prompt, the n decoded response texts
Generate = Callable[[list, bool, int], list[list[str]]]


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k from n samples with c correct: 1 - C(n-c, k) / C(n, k), as the numerically stable product
    1 - prod_{i=n-c+1}^{n} (1 - k / i)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass@k needs 0 <= c <= n and 1 <= k <= n, got n={n} c={c} k={k}")
    if n - c < k:
        return 1.0
    prod = 1.0
    for i in range(n - c + 1, n + 1):
        prod *= 1.0 - k / i
    return 1.0 - prod


def pass_ks(k: int) -> list[int]:
    """1, 2, 4, ... and k itself."""
    out = [1 << i for i in range(int(math.log2(k)) + 1)] if k >= 1 else []
    return sorted(set(out + ([k] if k >= 1 else [])))


@dataclass
class EvalSet:
    name: str
    records: list[PromptRecord]
    legacy: bool = False  # metric names without the set name (eval/accuracy)

    def key(self, metric: str) -> str:
        return f"eval/{metric}" if self.legacy else f"eval/{self.name}/{metric}"


class Evaluator:
    def __init__(self, sets: Sequence[EvalSet], encoder: PromptEncoder, correct_reward: str, k: int,
                 max_prompts: int, local: Callable[[list], list], mean: Callable[[list[float]], float],
                 sums: Callable[[list[float]], list[float]] = lambda values: values):
        self.sets = list(sets)
        self.encoder = encoder
        self.correct_name = correct_reward
        self.correct_fn = get_reward(correct_reward)  # fail at start-up on an unknown name
        self.k = k
        self.max_prompts = max_prompts
        self.local, self.mean, self.sums = local, mean, sums  # sums: over data-parallel ranks (a collective)
        self.ledger = RewardLedger(max_failure_fraction=1.0)

    def _correct(self, records: list[PromptRecord], texts: list[str]) -> list[float]:
        answers = reward_answers(records, self.ledger)
        scores, failed = score_one(self.correct_name, self.correct_fn, [a.prompt for a in answers], texts, answers,
                                   records, self.ledger)
        return [float(s >= 1.0 and i not in failed) for i, s in enumerate(scores)]

    def run(self, generate: Generate) -> dict[str, float]:
        metrics: dict[str, float] = {}
        for eval_set in self.sets:
            metrics.update(self._run_set(eval_set, generate))
        return metrics

    def _run_set(self, eval_set: EvalSet, generate: Generate) -> dict[str, float]:
        batch = self.encoder.encode_batch(self.local(eval_set.records[:self.max_prompts]), phase="eval")
        records = batch.records
        # The denominators: prompts scored, and those of the set skipped (bad media, too long)
        scored, skipped = self.sums([float(len(batch.prompts)), float(len(batch.skipped))])
        # every rank calls generate and mean (collectives) even with no prompts of its own
        texts = [t[0] for t in generate(batch.prompts, True, 1)]
        out = {eval_set.key("accuracy"): self.mean(self._correct(records, texts) if records else []),
               eval_set.key("prompts"): scored, eval_set.key("skipped"): skipped}
        if eval_set.legacy:
            out[eval_set.key("format")] = self.mean([format_reward(t, r.answer) for t, r in zip(texts, records)])
        if self.k >= 1:
            samples = generate(batch.prompts, False, self.k)
            correct = [self._correct([r] * len(s), list(s)) for r, s in zip(records, samples)]
            out[eval_set.key(f"mean@{self.k}")] = self.mean([sum(c) / len(c) for c in correct])
            for j in pass_ks(self.k):
                out[eval_set.key(f"pass@{j}")] = self.mean([pass_at_k(len(c), int(sum(c)), j) for c in correct])
        return out
