"""Step plans per mode, and the overlapped step against the decomposed one."""

import copy
import dataclasses
import json

import pytest
import torch

from torchplex.rl.losses import PolicyLossConfig
from torchplex.rollout.engine import RolloutEngine
from torchplex.rollout.sampling import SamplingParams
from torchplex.runtime.decomposition import DecomposedScorer
from torchplex.runtime.plan import PlanOptions, StepShape, plan_step
from torchplex.runtime.settings import StepSettings
from torchplex.runtime.timeline import Timeline, draw_timelines
from torchplex.runtime.window import WindowWorker

from step_runners import grpo_step

RTOL = 1e-5
SHAPE = StepShape(prompt_lengths=(100, 60), group_size=4, max_new_tokens=8, has_reference=True,
                  vision_trainable=False, kv_bytes_per_token=1000, activation_bytes_per_token=8000,
                  prefix_room_bytes=2**30)


def test_serial_schedule_runs_full_forwards_in_order():
    s = plan_step(SHAPE, PlanOptions(mode="serial"))
    assert [p.name for p in s.phases] == ["rollout", "ref", "train"]
    assert s.phase("train").depends_on == ("rollout", "ref")
    assert s.phase("ref").tokens == 4 * 160 + 2 * 4 * 8  # G*(P) + all response tokens


def test_serial_schedule_without_a_reference_says_train_only():
    """Issue 47, defect 11: with kl_coef = 0 (no reference loaded) the serial schedule said "forward in ref and
    train"."""
    s = plan_step(dataclasses.replace(SHAPE, has_reference=False), PlanOptions(mode="serial"))
    assert [p.name for p in s.phases] == ["rollout", "train"]
    assert not any("ref and train" in reason for reason in s.reasons), s.reasons
    assert "every sample is a full prompt+response forward in train" in str(s)


def test_decomposed_schedule_runs_prefix_once_per_prompt():
    s = plan_step(SHAPE, PlanOptions(mode="decomposed"))
    assert [p.name for p in s.phases] == ["vision", "rollout", "ref_prefix", "ref_suffix", "train"]
    assert s.phase("ref_prefix").tokens == 160 and s.phase("ref_prefix").placement == "main"
    assert s.phase("ref_prefix").holds_bytes == 1000 * 160


def test_overlapped_schedule_by_default_fuses_but_keeps_ref_prefix_after_rollout():
    s = plan_step(SHAPE, PlanOptions(mode="overlapped"))
    assert s.phase("actor_prefix").placement == "fused:rollout"
    assert s.phase("ref_prefix").placement == "main" and s.phase("ref_prefix").depends_on == ("rollout",)
    assert any("hides only host-bound work" in r for r in s.reasons)


def test_overlapped_schedule_fuses_actor_prefix_and_moves_ref_prefix_into_the_window():
    s = plan_step(SHAPE, PlanOptions(mode="overlapped", ref_prefix_in_window=True))
    assert s.phase("actor_prefix").placement == "fused:rollout"
    assert s.phase("ref_prefix").placement == "window:rollout"
    assert "actor_prefix" in s.phase("train").depends_on
    assert s.phase("ref_suffix").depends_on == ("rollout", "ref_prefix")
    # the rollout holds the KV pool plus the fused prefix activations until training consumes them
    kv_pool = 1000 * (160 + 2 * 4 * 8)
    assert s.phase("rollout").holds_bytes == kv_pool + 8000 * 160
    assert s.phase("train").tokens == 2 * 4 * 8  # epoch 0 runs no prefix forward
    json.loads(s.to_json())
    assert "window" in str(s)


def test_overlapped_schedule_can_score_finished_samples_in_the_window():
    s = plan_step(SHAPE, PlanOptions(mode="overlapped", ref_suffix_in_window=True))
    assert s.phase("ref_suffix").placement == "window:rollout"
    assert s.phase("ref_prefix").placement == "window:rollout"  # the samples are scored on it there
    assert s.phase("ref_suffix").depends_on == ("rollout", "ref_prefix")
    assert "ref_suffix" in s.phase("train").depends_on
    assert plan_step(SHAPE, PlanOptions(mode="decomposed", ref_suffix_in_window=True)).phase("ref_suffix").placement \
        == "main"  # only the overlapped mode moves work


def test_planner_does_not_fuse_over_the_room_for_held_prefixes():
    s = plan_step(dataclasses.replace(SHAPE, prefix_room_bytes=1000), PlanOptions(mode="overlapped"))
    assert not s.has("actor_prefix") and any("not fused" in r for r in s.reasons)
    assert s.phase("train").tokens == 160 + 2 * 4 * 8


def test_validate_rejects_a_dependency_on_a_later_phase():
    s = plan_step(SHAPE, PlanOptions(mode="decomposed"))
    s.phases.reverse()
    with pytest.raises(ValueError, match="depends on"):
        s.validate()


@pytest.fixture(scope="module")
def setup(grpo_assets):
    return grpo_assets.processor, grpo_assets.prompts, grpo_assets.actor, grpo_assets.reference


def run(setup, mode, frozen, ppo_epochs=1, suffix_window=False, threaded=False, stops=None, max_new=6,
        sample_batch=0, loss=None, micro_batch_size=4):
    """One step; stops: stop token ids (default <|im_end|>); threaded: the window's jobs on their own thread."""
    processor, prompts, base, reference = setup
    actor = copy.deepcopy(base)
    actor.visual.requires_grad_(not frozen)
    ref = copy.deepcopy(reference)
    if frozen:
        ref.visual = actor.visual
    engine = RolloutEngine(actor, kv_pool_bytes=16 * 2**20)
    optimizer = torch.optim.SGD([p for p in actor.parameters() if p.requires_grad], lr=0.1)
    settings = StepSettings(reward_names=["format"], reward_weights=[1.0], micro_batch_size=micro_batch_size,
                            ppo_epochs=ppo_epochs, grad_clip=1e9, loss=loss or PolicyLossConfig(kl_coef=0.1),
                            plan=PlanOptions(mode=mode, ref_prefix_in_window=True, ref_suffix_in_window=suffix_window,
                                             window_sample_batch=sample_batch))
    runner = grpo_step(actor, ref, engine, optimizer, processor.tokenizer, settings)
    if threaded:
        runner.window = WindowWorker(runner.device, threaded=True)
    stops = stops or [processor.tokenizer.convert_tokens_to_ids("<|im_end|>")]
    out = runner.run(prompts, [""] * len(prompts),
                     SamplingParams(n=4, max_new_tokens=max_new, stop_token_ids=stops, seed=3))
    runner.window.close()
    return out, actor, runner


def rel(a, b):
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


@pytest.mark.parametrize("frozen,ppo_epochs", [(True, 1), (False, 2)])
def test_overlapped_step_equals_decomposed_step(setup, frozen, ppo_epochs):
    dec, dec_actor, _ = run(setup, "decomposed", frozen, ppo_epochs)
    ovl, ovl_actor, runner = run(setup, "overlapped", frozen, ppo_epochs)
    assert torch.equal(dec.experience.tokens, ovl.experience.tokens)
    mask = dec.experience.mask
    assert rel(ovl.experience.ref_logprobs[mask], dec.experience.ref_logprobs[mask]) < RTOL
    assert rel(ovl.experience.old_logprobs[mask], dec.experience.old_logprobs[mask]) < RTOL
    assert rel(ovl.train.stats.loss, dec.train.stats.loss) < RTOL
    for (name, a), b in zip(ovl_actor.named_parameters(), dec_actor.parameters()):
        assert rel(a, b) < RTOL, name
    # the window really ran the reference prefixes during decode (the three prompts in one batched job) and the
    # fused prefixes were all consumed
    assert [s.lane for s in ovl.timeline.spans if s.name == "ref_prefix"] == ["window"]
    assert len(runner.scorer.store) == 0
    # 3 reference and 3 first-epoch training micro-batches (one group each) took held prefixes instead of computing
    assert runner.scorer.store.served == 6


@pytest.mark.parametrize("micro_batch_size", [4, 2])
def test_overlapped_step_with_entropy_bonus_equals_decomposed_step(setup, micro_batch_size):
    """Issue 16 defect 5: entropy_coef > 0 runs in the overlapped mode (it crashed on main) and gives the decomposed
    step's loss and weights, also with micro-batches of half a group (the fused prefix serves the first half, the
    second runs the prefix again); the loss is pg + kl_coef * KL - entropy_coef * H (token-mean terms)."""
    loss = PolicyLossConfig(kl_coef=0.1, entropy_coef=0.05, loss_agg="token-mean")
    dec, dec_actor, _ = run(setup, "decomposed", False, 2, loss=loss, micro_batch_size=micro_batch_size)
    ovl, ovl_actor, _ = run(setup, "overlapped", False, 2, loss=loss, micro_batch_size=micro_batch_size)
    assert rel(ovl.train.stats.loss, dec.train.stats.loss) < RTOL
    for (name, a), b in zip(ovl_actor.named_parameters(), dec_actor.parameters()):
        assert rel(a, b) < RTOL, name
    stats = ovl.train.stats
    torch.testing.assert_close(stats.loss - stats.pg_loss - 0.1 * stats.kl, -0.05 * stats.entropy, rtol=1e-5,
                               atol=1e-7)


def test_fused_prefill_is_one_batched_forward_and_one_batched_prefix_backward(setup, monkeypatch):
    """The rollout prefill of the three prompts runs once, batched, with autograd; epoch 0 backpropagates that one
    graph once, after its three micro-batches (one group each) have run their suffix parts."""
    processor, prompts, base, reference = setup
    forwards, backwards = [], []
    prefix_forward = type(base).prefix_forward
    monkeypatch.setattr(type(base), "prefix_forward", lambda self, *a, **kw: forwards.append(
        (a[0].shape[0], torch.is_grad_enabled())) or prefix_forward(self, *a, **kw))
    finish = DecomposedScorer.finish_backward
    monkeypatch.setattr(DecomposedScorer, "finish_backward", lambda self: backwards.append(
        len(self._held_back[0])) or finish(self))
    out, _, runner = run(setup, "overlapped", True)
    assert forwards[0] == (3, True)  # the fused prefill: one batch of three prompts, autograd on
    assert (3, True) not in forwards[1:]  # ... and the actor's training ran no prefix forward of its own
    layers = len(base.layers)
    assert backwards == [3 * (2 * layers + 1)]  # every prompt's K, V and last hidden state, in one backward
    assert len(runner.scorer._held_back[0]) == 0


def long_tail_stops(setup):
    """Half the vocabulary as stop tokens: responses end after a few tokens, at different steps."""
    vocab = setup[2].args.text.vocab_size
    return list(range(vocab // 2, vocab))


@pytest.mark.parametrize("threaded,sample_batch", [(False, 0), (True, 0), (False, 1), (False, 4)])
def test_reference_scored_in_the_window_equals_decomposed(setup, threaded, sample_batch):
    """Samples scored in the window as they finish, `sample_batch` at a time per prompt (0: half a group of 4)."""
    stops = long_tail_stops(setup)
    dec, dec_actor, _ = run(setup, "decomposed", True, stops=stops, max_new=12)
    ovl, ovl_actor, runner = run(setup, "overlapped", True, suffix_window=True, threaded=threaded, stops=stops,
                                 max_new=12, sample_batch=sample_batch)
    assert torch.equal(dec.experience.tokens, ovl.experience.tokens)
    lengths = dec.experience.lengths.view(3, 4).max(dim=1).values.tolist()
    assert len(set(lengths)) > 1, lengths  # groups finish at different steps: some are scored while others decode
    mask = dec.experience.mask
    # each sample scored on its prompt's prefix as it finished, in parts of its group: equal up to fp32 rounding
    assert rel(ovl.experience.ref_logprobs[mask], dec.experience.ref_logprobs[mask]) < RTOL
    assert rel(ovl.experience.old_logprobs[mask], dec.experience.old_logprobs[mask]) < RTOL
    for (name, a), b in zip(ovl_actor.named_parameters(), dec_actor.parameters()):
        assert rel(a, b) < RTOL, name
    window = [s.name for s in ovl.timeline.spans if s.lane == "window"]
    jobs = ovl.window_jobs
    # what ran in the window and what decode's end left to the ref stage (threaded: jobs not begun are dropped)
    for kind in ("ref_prefix", "ref_suffix"):
        assert window.count(kind) + jobs.dropped[kind] == jobs.submitted[kind], kind
    assert jobs.submitted["ref_prefix"] == 1  # the three prompts' prefixes in one batched job as decode begins
    if sample_batch == 4:  # a whole group: one job per prompt
        assert jobs.submitted["ref_suffix"] == 3
    else:  # samples of one group finished at different checks: scored in parts, at most 4 // batch + 1 per prompt
        assert 3 < jobs.submitted["ref_suffix"] <= 3 * (4 // (sample_batch or 2) + 1)
    if not threaded:  # on the caller's thread a job runs when it is submitted: nothing waits at the end
        assert sum(jobs.dropped.values()) == 0
    rollout = next(s for s in ovl.timeline.spans if s.name == "rollout")
    assert all(rollout.start_s <= s.start_s <= rollout.end_s for s in ovl.timeline.spans if s.lane == "window")
    assert runner.window.jobs_run == len(window)
    # training took the three fused prefixes; the ref stage the held ones of the prompts the window left unscored,
    # in micro-batches that pack what is left of several groups (one take each)
    left = sum(any(i * 4 + j not in jobs.scored for j in range(4)) for i in range(3))
    assert left == 0 or threaded
    assert len(runner.scorer.store) == 0 and 3 + (left > 0) <= runner.scorer.store.served <= 3 + left


@pytest.mark.parametrize("prefix_prompts", [4, 1])
def test_window_jobs_left_when_decode_ends_are_scored_by_the_ref_stage_as_in_decomposed(setup, monkeypatch,
                                                                                       prefix_prompts):
    """Decode's end drops the window jobs not begun (DecodeWindowJobs.finish): the ref stage holds the prefixes they
    would have held, batched, and scores their samples. Here the window's first job runs until decode has ended, so
    every later one is dropped; the step still equals the decomposed one. prefix_prompts 4: the first job held
    every prompt's reference prefix; 1: it held the first prompt's, and the ref stage holds the other two."""
    import threading

    from torchplex.runtime import prefixes
    from torchplex.runtime.window import DecodeWindowJobs

    monkeypatch.setattr("torchplex.runtime.window.WINDOW_PREFIX_PROMPTS", prefix_prompts)
    ref_holds = []
    hold_prefixes = prefixes.hold_prefixes
    monkeypatch.setattr("torchplex.runtime.step.hold_prefixes", lambda scorer, model, prompts, store: (
        ref_holds.append(sum(not store.has(model, p) for p in prompts)), hold_prefixes(scorer, model, prompts, store)))

    gate = threading.Event()
    hold = DecodeWindowJobs._hold_prefixes
    first = []

    def slow_hold(self, prompts):
        if not first:
            first.append(prompts)
            gate.wait(30)
        hold(self, prompts)

    finish = DecodeWindowJobs.finish

    def finish_then_open(self):
        threading.Timer(0.3, gate.set).start()  # the queue is emptied first; then the running job may end
        finish(self)

    monkeypatch.setattr(DecodeWindowJobs, "_hold_prefixes", slow_hold)
    stops = long_tail_stops(setup)
    dec, dec_actor, _ = run(setup, "decomposed", True, stops=stops, max_new=12)
    assert ref_holds == [3]  # decomposed's ref stage holds every prefix
    ref_holds.clear()
    # the gate opens once the overlapped decode has ended (patched after the decomposed run, whose own end would
    # otherwise open it before the overlapped window's first job)
    monkeypatch.setattr(DecodeWindowJobs, "finish", finish_then_open)
    ovl, ovl_actor, runner = run(setup, "overlapped", True, suffix_window=True, threaded=True, stops=stops,
                                 max_new=12, sample_batch=1)
    jobs = ovl.window_jobs
    assert jobs.dropped["ref_suffix"] == jobs.submitted["ref_suffix"] > 0 and not jobs.scored
    assert jobs.dropped["ref_prefix"] == (0 if prefix_prompts == 4 else 2)
    assert ref_holds == [3 - (3 if prefix_prompts == 4 else 1)]  # the ref stage's one batched hold: what was left
    mask = dec.experience.mask
    assert rel(ovl.experience.ref_logprobs[mask], dec.experience.ref_logprobs[mask]) < RTOL
    assert rel(ovl.train.stats.loss, dec.train.stats.loss) < RTOL
    for (name, a), b in zip(ovl_actor.named_parameters(), dec_actor.parameters()):
        assert rel(a, b) < RTOL, name
    # the ref stage took a held prefix for each of the three prompts' reference micro-batches (the window's one
    # batched job held them), as training took the three fused ones
    assert runner.scorer.store.served == 6 and len(runner.scorer.store) == 0


def test_timeline_exports(setup, tmp_path):
    out, _, _ = run(setup, "overlapped", True)
    folder = tmp_path / "not" / "made"  # a bench's --timeline-dir: the exports create it
    trace = json.loads(out.timeline.to_chrome_trace(folder / "t.json").read_text())
    names = {e["name"] for e in trace["traceEvents"] if e["ph"] == "X"}
    assert {"vision", "rollout", "ref_prefix", "ref", "train"} <= names
    png = out.timeline.draw(folder / "t.png", title="overlapped")
    assert png.stat().st_size > 1000
    back = Timeline.from_chrome_trace(folder / "t.json")  # a trace read back is the same spans
    assert [(s.name, s.lane) for s in back.spans] == [(s.name, s.lane) for s in out.timeline.spans]
    assert all(abs(a.start_s - b.start_s) < 1e-6 and abs(a.end_s - b.end_s) < 1e-6
               for a, b in zip(back.spans, out.timeline.spans))
    both = draw_timelines({"first": out.timeline, "read back": back}, folder / "both.png")
    assert both.stat().st_size > png.stat().st_size // 2
