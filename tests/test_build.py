"""runtime/build.py: the one function that turns a Config into the step runtime, used by the trainer, which every
benchmark runs (a step wired by hand in the trainer and in benchmarks drifted from it)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from torchplex.config import load_config
from torchplex.rollout.engine import RolloutEngine
from torchplex.rollout.sampling import SamplingParams
from torchplex.runtime.build import build_step_runtime, step_settings

REPO = Path(__file__).resolve().parents[1]
BY_HAND = {"GRPOStep", "StepSettings", "PlanOptions", "MemoryEstimator"}


def constructed(path: Path) -> set[str]:
    """Names of BY_HAND classes the file calls (constructs), by `Name(...)` or `module.Name(...)`."""
    calls = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call):
            f = node.func
            name = f.id if isinstance(f, ast.Name) else f.attr if isinstance(f, ast.Attribute) else None
            if name in BY_HAND:
                calls.add(name)
    return calls


def test_no_benchmark_or_trainer_builds_the_step_by_hand():
    """The trainer builds its step with runtime.build, and a benchmark runs the trainer (benchmarks/product_run.py):
    none constructs the step or its settings itself."""
    files = sorted((REPO / "benchmarks").rglob("*.py")) + [REPO / "torchplex" / "train.py"]
    offenders = {str(p.relative_to(REPO)): sorted(c) for p in files if (c := constructed(p))}
    assert not offenders, f"build the step with torchplex.runtime.build.build_step_runtime: {offenders}"


def test_the_check_sees_a_hand_built_step(tmp_path):
    probe = tmp_path / "bench.py"
    probe.write_text("from torchplex.runtime import step\nr = step.GRPOStep(1, 2)\ns = StepSettings([], [])\n")
    assert constructed(probe) == {"GRPOStep", "StepSettings"}


def test_step_settings_follow_the_config():
    cfg = load_config(["--runtime.mode=overlapped", "--runtime.reference_in_window", "--runtime.window_sample_batch=3",
                       "--algorithm.kl_coef=0.05", "--algorithm.clip_high=0.3", "--algorithm.micro_batch_size=4",
                       "--algorithm.ppo_epochs=2", "--optimizer.grad_clip=0.5", "--rollout.temperature=0.7",
                       "--reward.functions=format", "--reward.weights=2.0", "--runtime.checkpoint_prefix"])
    st = step_settings(cfg)
    assert (st.plan.mode, st.plan.ref_prefix_in_window, st.plan.ref_suffix_in_window, st.plan.window_sample_batch) \
        == ("overlapped", True, True, 3)
    assert (st.loss.kl_coef, st.loss.clip_high, st.micro_batch_size, st.ppo_epochs, st.grad_clip, st.temperature) \
        == (0.05, 0.3, 4, 2, 0.5, 0.7)
    assert (st.reward_names, st.reward_weights, st.checkpoint_prefix) == (["format"], [2.0], True)


@pytest.mark.parametrize("frozen", [True, False])
def test_managed_memory_plans_the_stages_of_the_steps_plan(grpo_assets, frozen):
    """The residency plan's phases are the stages every step of this runtime runs."""
    import copy

    import torch

    actor = copy.deepcopy(grpo_assets.actor)
    actor.visual.requires_grad_(not frozen)
    reference = copy.deepcopy(grpo_assets.reference)
    optimizer = torch.optim.AdamW([p for p in actor.parameters() if p.requires_grad], lr=0.0)
    cfg = load_config(["--runtime.mode=decomposed", "--memory.managed", "--algorithm.kl_coef=0.1"])
    runner = build_step_runtime(cfg, actor, reference, RolloutEngine(actor, kv_pool_bytes=2**20), optimizer, None,
                                grpo_assets.processor.tokenizer)
    stages = ["vision", "rollout", "ref", "train"] if frozen else ["rollout", "ref", "train"]
    prompts, params = grpo_assets.prompts, SamplingParams(n=2, max_new_tokens=4)
    assert [str(s) for s in runner.plan(prompts, params).stages()] == stages  # what the step runs
    assert [row.phase for row in runner.residency.plan.phases] == stages
    # every group the trainer's step touches is planned: the KV pool (released and resumed through the engine) and
    # the gradients (counted in train) as well as the reference weights and the optimizer state
    assert {g.name for g in runner.residency.plan.groups} == {"optimizer_state", "grads", "kv_pool", "ref_weights"}
    rows = {row.phase: row for row in runner.residency.plan.phases}
    assert "kv_pool" in rows["rollout"].resident and "kv_pool" in rows["ref"].offload
    assert "grads" in rows["train"].needed
