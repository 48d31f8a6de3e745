"""Each phase's declared bytes (`Phase.holds_bytes`) against what it held in a real step on CPU (issue 17: the
planner's holds_bytes was read by nothing, so nothing said whether it was true).

  ref_prefix    (decode window) the reference's prefix K/V held per prompt from the window until the ref stage:
                the most the step's PrefixStore held at once equals the declared K/V bytes exactly (fp32).
  actor_prefix  (fused) the fused prefill's autograd graph, held from rollout to training: the saved activations
                measured by `prefixes.SavedBytes`; from the second step on the planner declares the measured bytes
                per token (the first step's number is an estimate), so a step of the same prompts declares exactly
                what it then holds.
"""

from __future__ import annotations

import copy

import pytest
import torch

from torchplex.rl.losses import PolicyLossConfig
from torchplex.rollout.engine import RolloutEngine
from torchplex.rollout.sampling import SamplingParams
from torchplex.runtime.plan import PlanOptions
from torchplex.runtime.settings import StepSettings

from step_runners import grpo_step


@pytest.fixture(scope="module")
def two_steps(grpo_assets):
    actor = copy.deepcopy(grpo_assets.actor)
    actor.visual.requires_grad_(False)
    reference = copy.deepcopy(grpo_assets.reference)
    reference.visual = actor.visual
    optimizer = torch.optim.SGD([p for p in actor.parameters() if p.requires_grad], lr=0.0)
    settings = StepSettings(reward_names=["format"], reward_weights=[1.0], micro_batch_size=4, grad_clip=1e9,
                            loss=PolicyLossConfig(kl_coef=0.1), plan=PlanOptions(mode="overlapped",
                                                                                  ref_prefix_in_window=True))
    runner = grpo_step(actor, reference, RolloutEngine(actor, kv_pool_bytes=16 * 2**20), optimizer,
                       grpo_assets.processor.tokenizer, settings)
    params = SamplingParams(n=4, max_new_tokens=4, stop_token_ids=[grpo_assets.eos_id], seed=3)
    outs = [runner.run(grpo_assets.prompts, [""] * 3, params) for _ in range(2)]
    return outs, actor, reference


def test_reference_prefix_holds_what_the_plan_declares(two_steps):
    outs, _, reference = two_steps
    for out in outs:
        phase = out.plan.phase("ref_prefix")
        assert phase.in_window and phase.holds_bytes > 0
        assert out.prefixes.peak_kv_bytes[id(reference)] == phase.holds_bytes


def test_fused_actor_prefix_holds_what_the_plan_declares(two_steps):
    outs, actor, _ = two_steps
    first, second = outs
    measured = [out.prefixes.graph_bytes[id(actor)][0] for out in outs]
    assert measured[0] == measured[1] > 0  # the same prompts: the same graph
    declared = second.plan.phase("actor_prefix").holds_bytes
    assert declared == measured[1]
    kv_pool = second.plan.phase("rollout").holds_bytes - declared  # the rollout holds the pool and the graph
    assert kv_pool == first.plan.phase("rollout").holds_bytes - first.plan.phase("actor_prefix").holds_bytes
    # the K/V slices it holds for training are part of that graph's outputs: every prompt's, once
    t = actor.args.text
    kv_per_token = 2 * t.num_layers * t.num_kv_heads * t.head_dim * 4
    tokens = sum(len(p.input_ids) for p in outs[0].experience.prompts)
    assert outs[1].prefixes.peak_kv_bytes[id(actor)] == kv_per_token * tokens
