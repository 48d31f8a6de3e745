"""Phase planner schedules, and the overlapped executor against decomposed-serial execution."""

import copy
import json

import pytest
import torch

from torchplex.rl.losses import PolicyLossConfig
from torchplex.rollout.engine import RolloutEngine
from torchplex.rollout.sampling import SamplingParams
from torchplex.runtime.executor import StepRunner, StepSettings
from torchplex.runtime.planner import PlanOptions, StepShape, plan_step

RTOL = 1e-5
SHAPE = StepShape(prompt_lengths=(100, 60), group_size=4, max_new_tokens=8, has_reference=True,
                  vision_trainable=False, kv_bytes_per_token=1000, activation_bytes_per_token=8000)


def test_serial_schedule_runs_full_forwards_in_order():
    s = plan_step(SHAPE, PlanOptions(mode="serial"))
    assert [p.name for p in s.phases] == ["rollout", "ref", "train"]
    assert s.phase("train").depends_on == ("rollout", "ref")
    assert s.phase("ref").tokens == 4 * 160 + 2 * 4 * 8  # G*(P) + all response tokens


def test_decomposed_schedule_runs_prefix_once_per_prompt():
    s = plan_step(SHAPE, PlanOptions(mode="decomposed"))
    assert [p.name for p in s.phases] == ["vision", "rollout", "ref_prefix", "ref_suffix", "train"]
    assert s.phase("ref_prefix").tokens == 160 and s.phase("ref_prefix").placement == "main"
    assert s.phase("ref_prefix").holds_bytes == 1000 * 160


def test_overlapped_schedule_by_default_fuses_but_keeps_ref_prefix_after_rollout():
    s = plan_step(SHAPE, PlanOptions(mode="overlapped"))
    assert s.phase("actor_prefix").placement == "fused:rollout"
    assert s.phase("ref_prefix").placement == "main" and s.phase("ref_prefix").depends_on == ("rollout",)
    assert any("no gain" in r for r in s.reasons)


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


def test_planner_does_not_fuse_over_the_activation_budget():
    s = plan_step(SHAPE, PlanOptions(mode="overlapped", held_activation_budget_bytes=1000))
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


def run(setup, mode, frozen, ppo_epochs=1):
    processor, prompts, base, reference = setup
    actor = copy.deepcopy(base)
    actor.visual.requires_grad_(not frozen)
    ref = copy.deepcopy(reference)
    if frozen:
        ref.visual = actor.visual
    engine = RolloutEngine(actor, kv_pool_bytes=16 * 2**20)
    optimizer = torch.optim.SGD([p for p in actor.parameters() if p.requires_grad], lr=0.1)
    settings = StepSettings(reward_names=["format"], reward_weights=[1.0], micro_batch_size=4, ppo_epochs=ppo_epochs,
                            grad_clip=1e9, loss=PolicyLossConfig(kl_coef=0.1),
                            plan=PlanOptions(mode=mode, ref_prefix_in_window=True))
    runner = StepRunner(actor, ref, engine, optimizer, None, processor.tokenizer, settings)
    eos = processor.tokenizer.convert_tokens_to_ids("<|im_end|>")
    out = runner.run(prompts, [""] * len(prompts), SamplingParams(n=4, max_new_tokens=6, stop_token_ids=[eos], seed=3))
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
    # the window really ran the reference prefixes during decode and the fused prefixes were all consumed
    assert [s.lane for s in ovl.timeline.spans if s.name == "ref_prefix"] == ["window"] * len(setup[1])
    assert len(runner.scorer.store) == 0
    # 3 reference and 3 first-epoch training micro-batches (one group each) took held prefixes instead of computing
    assert runner.scorer.store.served == 6


def test_timeline_exports(setup, tmp_path):
    out, _, _ = run(setup, "overlapped", True)
    folder = tmp_path / "not" / "made"  # a bench's --timeline-dir: the exports create it
    trace = json.loads(out.timeline.to_chrome_trace(folder / "t.json").read_text())
    names = {e["name"] for e in trace["traceEvents"] if e["ph"] == "X"}
    assert {"vision", "rollout", "ref_prefix", "ref", "train"} <= names
    png = out.timeline.draw(folder / "t.png", title="overlapped")
    assert png.stat().st_size > 1000
