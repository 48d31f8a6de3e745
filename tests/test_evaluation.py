"""Specification of torchplex.evaluation: several eval sets, greedy accuracy, mean@k and the unbiased pass@k of
Chen et al. 2021 checked against its binomial formula."""

from __future__ import annotations

import itertools
from math import comb

import pytest

from torchplex.data.processing import load_processor
from torchplex.data.prompts import PromptEncoder
from torchplex.data.records import PromptRecord
from torchplex.evaluation import EvalSet, Evaluator, pass_at_k, pass_ks


@pytest.mark.parametrize("n, c, k", [(n, c, k) for n in (1, 2, 5, 10, 16) for c in range(n + 1)
                                     for k in sorted({1, 2, n // 2 or 1, n}) if k <= n])
def test_pass_at_k_is_chen_et_al_formula(n, c, k):
    expected = 1 - comb(n - c, k) / comb(n, k)  # eq. 1 of "Evaluating Large Language Models Trained on Code"
    assert pass_at_k(n, c, k) == pytest.approx(expected, abs=1e-12)


def test_pass_at_k_limits_and_brute_force():
    assert pass_at_k(8, 3, 1) == pytest.approx(3 / 8)  # pass@1 is the mean
    # brute force: the fraction of k-subsets of 5 samples (2 correct) that hold a correct one
    samples = [1, 1, 0, 0, 0]
    subsets = list(itertools.combinations(samples, 3))
    assert pass_at_k(5, 2, 3) == pytest.approx(sum(any(s) for s in subsets) / len(subsets))
    with pytest.raises(ValueError):
        pass_at_k(4, 5, 1)
    assert pass_ks(8) == [1, 2, 4, 8] and pass_ks(6) == [1, 2, 4, 6] and pass_ks(1) == [1]


@pytest.fixture(scope="module")
def encoder(tiny_ckpt):
    return PromptEncoder(load_processor(tiny_ckpt), max_prompt_tokens=512)


def test_every_eval_set_gets_its_own_greedy_and_sampled_metrics(encoder):
    math_set = EvalSet("math", [PromptRecord(id=f"m{i}", prompt=f"q{i}", answer=str(i)) for i in range(3)])
    count_set = EvalSet("count", [PromptRecord(id="c0", prompt="how many", answer="2")])
    # greedy: m0 right, m1 wrong, m2 right, c0 wrong; samples: m0 2/4, m1 0/4, m2 4/4, c0 1/4
    greedy = {"q0": "<answer>0</answer>", "q1": "<answer>9</answer>", "q2": "<answer>2</answer>",
              "how many": "<answer>3</answer>"}
    sampled = {"q0": ["<answer>0</answer>", "x", "<answer>0</answer>", "y"], "q1": ["a", "b", "c", "d"],
               "q2": ["<answer>2</answer>"] * 4, "how many": ["<answer>2</answer>", "n", "n", "n"]}
    calls = []

    def generate(prompts, greedy_mode, n):
        texts = [encoder.processor.tokenizer.decode(p.input_ids) for p in prompts]
        keys = [next(k for k in greedy if f"{k}<|im_end|>" in t) for t in texts]
        calls.append((len(prompts), greedy_mode, n))
        return [[greedy[k]] for k in keys] if greedy_mode else [sampled[k] for k in keys]

    evaluator = Evaluator([math_set, count_set], encoder, "accuracy", k=4, max_prompts=10, local=lambda x: x,
                          mean=lambda v: sum(v) / max(len(v), 1))
    m = evaluator.run(generate)
    assert calls == [(3, True, 1), (3, False, 4), (1, True, 1), (1, False, 4)]
    assert m["eval/math/accuracy"] == pytest.approx(2 / 3) and m["eval/count/accuracy"] == 0.0
    assert m["eval/math/mean@4"] == pytest.approx((0.5 + 0 + 1) / 3)
    assert m["eval/math/pass@1"] == pytest.approx(m["eval/math/mean@4"])
    assert m["eval/math/pass@2"] == pytest.approx((pass_at_k(4, 2, 2) + 0 + 1) / 3)
    assert m["eval/math/pass@4"] == pytest.approx(2 / 3)
    assert m["eval/count/pass@2"] == pytest.approx(0.5)  # 1 - C(3,2)/C(4,2)
    assert "eval/math/format" not in m


def test_the_legacy_set_keeps_its_metric_names(encoder):
    legacy = EvalSet("eval", [PromptRecord(id="a", prompt="q", answer="1")], legacy=True)
    evaluator = Evaluator([legacy], encoder, "accuracy", k=0, max_prompts=10, local=lambda x: x,
                          mean=lambda v: sum(v) / max(len(v), 1))
    assert evaluator.run(lambda prompts, g, n: [["<answer>1</answer>"]] * len(prompts)) == \
        {"eval/accuracy": 1.0, "eval/format": 1.0, "eval/prompts": 1.0, "eval/skipped": 0.0}


def test_each_set_reports_its_denominators(encoder, tmp_path):
    """Issue 21 defect 11 with several eval sets: a set whose records are skipped says how many it scored of how
    many it was given (eval/<set>/prompts, eval/<set>/skipped), and the console line shows them per set."""
    from torchplex.components.console import format_eval

    good = EvalSet("good", [PromptRecord(id="g", prompt="q", answer="1")])
    bad = EvalSet("bad", [PromptRecord(id="b", prompt="q", answer="1", images=[str(tmp_path / "gone.png")]),
                          PromptRecord(id="b2", prompt="q", answer="1")])
    evaluator = Evaluator([good, bad], encoder, "accuracy", k=0, max_prompts=10, local=lambda x: x,
                          mean=lambda v: sum(v) / max(len(v), 1))
    m = evaluator.run(lambda prompts, g, n: [["<answer>1</answer>"]] * len(prompts))
    assert (m["eval/good/prompts"], m["eval/good/skipped"]) == (1.0, 0.0)
    assert (m["eval/bad/prompts"], m["eval/bad/skipped"]) == (1.0, 1.0)
    assert format_eval(5, m) == "eval step 5: good: accuracy 1.000 | 1/1 prompts || bad: accuracy 1.000 | 1/2 prompts"
