"""Micro-batches sized by tokens (algorithm.micro_batch_tokens, issue 49): every mode's step at any token budget equals
the serial step taken as one whole batch (fp32, 1e-5: losses, reference and old-policy log-probs, every updated
weight), with budgets that cut a group into pieces, hold one group, and pack several groups (overlapped also with the
reference scored in the decode window), and a serial budget of several samples; a partition that drops or repeats a
sample is seen by the same comparison; and the config keys."""

from __future__ import annotations

import pytest
import torch

import torchplex.runtime.training as training
from step_runners import cpu_runner, run_recording
from torchplex.config import ConfigError, load_config
from torchplex.runtime.build import step_settings

RTOL = 1e-5
WHOLE = 2**20  # one micro-batch for the whole step
# tokens per micro-batch, with the tiny step's groups (4 samples of up to 6 tokens; serial adds ~100 prompt tokens)
BUDGETS = {"piece": 7, "group": 24, "groups": 60}


@pytest.fixture(scope="module")
def setup(grpo_assets):
    return grpo_assets.processor, grpo_assets.prompts, grpo_assets.actor, grpo_assets.reference


# "window": overlapped with the reference scored in the decode window as samples finish (what it left, the ref stage
# scores in micro-batches of the budget)
WINDOW = {"ref_prefix_in_window": True, "ref_suffix_in_window": True}


def step(setup, mode: str, tokens: int, ppo_epochs: int = 1):
    """One step at `tokens` per training and reference micro-batch; (output, the actor, each training forward's
    (prompts, samples), each reference forward's likewise)."""
    runner = cpu_runner(setup, "overlapped" if mode == "window" else mode, budget=2**40, micro_batch=0,
                        kv_pool=2 * 2**20, micro_batch_tokens=tokens, ref_micro_batch_tokens=tokens,
                        ppo_epochs=ppo_epochs, plan_options=WINDOW if mode == "window" else None)
    calls = {id(runner.actor): [], id(runner.reference): []}
    score = runner.scorer.score

    def recording(model, request, *args, **kwargs):
        calls[id(model)].append((len(request.prompts), len(request.prompt_index)))
        return score(model, request, *args, **kwargs)

    runner.scorer.score = recording
    out = run_recording(runner, setup, runner.actor.layers[0], lambda args: None)
    return out, runner.actor, calls[id(runner.actor)], calls[id(runner.reference)]


@pytest.fixture(scope="module")
def whole_batch(setup):
    """The serial step as one micro-batch: the definition every partition must reproduce."""
    return step(setup, "serial", WHOLE)


def rel(a, b) -> float:
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def assert_same_step(out, actor, ref_out, ref_actor) -> None:
    exp, want = out.experience, ref_out.experience
    assert torch.equal(exp.tokens, want.tokens)
    mask = want.mask
    assert rel(exp.ref_logprobs[mask], want.ref_logprobs[mask]) < RTOL
    assert rel(exp.old_logprobs[mask], want.old_logprobs[mask]) < RTOL
    assert rel(out.train.stats.loss, ref_out.train.stats.loss) < RTOL
    assert out.train.stats.num_tokens == ref_out.train.stats.num_tokens
    for (name, a), b in zip(actor.named_parameters(), ref_actor.parameters()):
        assert rel(a, b) < RTOL, name


@pytest.mark.parametrize("mode", ["serial", "decomposed", "overlapped", "window"])
@pytest.mark.parametrize("budget", sorted(BUDGETS))
def test_every_mode_at_any_token_budget_equals_the_whole_batch_serial_step(setup, whole_batch, mode, budget):
    out, actor, train_calls, ref_calls = step(setup, mode, BUDGETS[budget])
    assert_same_step(out, actor, *whole_batch[:2])
    groups = len(setup[1])
    assert sum(n for _, n in train_calls) == groups * 4  # each sample trained once
    in_window = len(out.window_jobs.scored)  # the reference log-probs the decode window took
    assert (in_window > 0) == (mode == "window")
    assert sum(n for _, n in ref_calls) == groups * 4 - in_window  # the rest scored once, in the ref stage
    assert out.plan.budget.micro_batch_tokens == out.plan.budget.ref_micro_batch_tokens == BUDGETS[budget]
    if mode == "serial":  # a sample costs its prompt too: every budget here holds one sample
        assert len(train_calls) == groups * 4
    elif budget == "piece":  # groups cut into pieces: more forwards than groups, one prompt each
        assert len(train_calls) > groups and all(p == 1 for p, _ in train_calls)
    elif budget == "groups":  # several groups packed into one forward
        assert len(train_calls) < groups and max(p for p, _ in train_calls) > 1


@pytest.mark.parametrize("mode", ["serial", "decomposed"])
def test_a_budget_of_three_serial_samples_packs_across_groups_and_equals_the_whole_batch(setup, whole_batch, mode):
    """Three of the longest serial samples (prompt and response): serial's micro-batches hold three or more
    (shorter) samples, across its groups of four; the prefix modes' samples cost their responses alone, so the whole
    step is one forward."""
    tokens = 3 * (max(len(p.input_ids) for p in setup[1]) + 6)
    out, actor, train_calls, ref_calls = step(setup, mode, tokens)
    assert_same_step(out, actor, *whole_batch[:2])
    sizes = [n for _, n in train_calls]
    if mode == "serial":
        assert max(sizes) >= 3 and 1 < len(sizes) < 12 and [n for _, n in ref_calls] == sizes
        assert any(p > 1 for p, _ in train_calls)  # a micro-batch with samples of two prompts
    else:
        assert train_calls == ref_calls == [(len(setup[1]), 4 * len(setup[1]))]


def test_two_epochs_with_groups_cut_and_packed_equal_the_whole_batch(setup):
    """The overlapped step's fused prefixes serve the first epoch's pieces; the second epoch runs on the updated
    weights, cut by the same budget."""
    want, want_actor, _, _ = step(setup, "serial", WHOLE, ppo_epochs=2)
    for tokens in (BUDGETS["piece"], BUDGETS["groups"]):
        out, actor, _, _ = step(setup, "overlapped", tokens, ppo_epochs=2)
        assert_same_step(out, actor, want, want_actor)


@pytest.mark.parametrize("fault", ["drop", "repeat"])
def test_a_partition_that_drops_or_repeats_a_sample_is_seen(setup, whole_batch, monkeypatch, fault):
    """The comparison above sees a wrong partition: training's micro-batches losing their last sample, or scoring a
    sample twice, move the step's weights past the tolerance."""
    cut = training.micro_batches

    def faulty(samples, group_size, limits, cost):
        batches = cut(samples, group_size, limits, cost)
        if fault == "drop":
            return batches[:-1] + [batches[-1][:-1]] if len(batches[-1]) > 1 else batches[:-1]
        return batches + [batches[0][:1]]

    monkeypatch.setattr(training, "micro_batches", faulty)
    _, actor, _, _ = step(setup, "decomposed", BUDGETS["group"])
    assert max(rel(a, b) for a, b in zip(actor.parameters(), whole_batch[1].parameters())) > 10 * RTOL


def test_the_config_keys_reach_the_step_and_a_budget_the_sequence_bound_cannot_reach_is_refused():
    cfg = load_config(["--algorithm.micro_batch_tokens=4096", "--algorithm.ref_micro_batch_tokens=8000",
                       "--algorithm.micro_batch_size=8"])
    st = step_settings(cfg)
    assert (st.micro_batch_tokens, st.ref_micro_batch_tokens, st.micro_batch_size) == (4096, 8000, 8)
    assert load_config([]).algorithm.micro_batch_tokens == 0 == load_config([]).algorithm.micro_batch_size
    # serial: a sample is up to data.max_prompt_tokens + rollout.max_new_tokens = 1024 + 32 tokens
    with pytest.raises(ConfigError, match=r"algorithm\.micro_batch_tokens = 5000 .*algorithm\.micro_batch_size"):
        load_config(["--algorithm.micro_batch_tokens=5000", "--algorithm.micro_batch_size=4"])
    load_config(["--algorithm.micro_batch_tokens=4000", "--algorithm.micro_batch_size=4"])
    # the prefix modes: a sample costs its response alone
    with pytest.raises(ConfigError, match=r"algorithm\.micro_batch_tokens = 200 .*algorithm\.micro_batch_size"):
        load_config(["--runtime.mode=decomposed", "--algorithm.micro_batch_tokens=200",
                     "--algorithm.micro_batch_size=4"])
    with pytest.raises(ConfigError, match=r"algorithm\.ref_micro_batch_tokens = 200 .*algorithm\.ref_micro_batch_size"):
        load_config(["--runtime.mode=decomposed", "--algorithm.ref_micro_batch_tokens=200",
                     "--algorithm.micro_batch_size=4"])
    for key in ("micro_batch_tokens", "ref_micro_batch_tokens", "micro_batch_size"):
        with pytest.raises(ConfigError, match=f"algorithm.{key}"):
            load_config([f"--algorithm.{key}=-1"])


def test_a_rank_whose_samples_the_window_scored_still_joins_the_other_ranks_reference_forwards(monkeypatch):
    """A reference sharded over data-parallel ranks gathers its parameters in every forward, so every rank runs as
    many as the busiest: a rank whose samples were all scored in the decode window (no micro-batch of its own) runs
    the passes on a sample of its own, discarded; its log-probs are the window's."""
    from torchplex.runtime import experience

    group, width = 2, 3
    scored = {s: torch.full((width,), -float(s + 1)) for s in range(2 * group)}

    class Exp:
        group_size, tokens, ref_logprobs = group, torch.zeros(2 * group, width, dtype=torch.long), None

        def token_costs(self, shares_prefix):
            return [width] * (2 * group)

        def request(self, samples):
            return list(samples)

    class Scorer:
        calls: list = []

        def score(self, model, request, temperature):
            self.calls.append(request)
            return torch.zeros(len(request), width), None

    monkeypatch.setattr(experience, "most_over_ranks", lambda count, device, group: count + 2)
    exp, scorer = Exp(), Scorer()
    experience.reference_phase(None, scorer, exp, 1.0, experience.MicroBatchLimits(tokens=width), scored=scored)
    assert len(scorer.calls) == 2  # the busiest rank's count, none of this rank's own
    torch.testing.assert_close(exp.ref_logprobs, torch.stack([scored[s] for s in range(2 * group)]))
