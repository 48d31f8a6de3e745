"""runtime/build.py: the one function that turns a Config into the step runtime, used by the trainer and every
benchmark (issue 17: StepRunner was wired by hand in train.py and five benchmark places, so they drifted)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from torchplex.config import load_config
from torchplex.rollout.engine import RolloutEngine
from torchplex.runtime.build import build_step_runtime, step_settings

REPO = Path(__file__).resolve().parents[1]
BY_HAND = {"StepRunner", "StepSettings", "PlanOptions"}


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


def test_no_benchmark_or_trainer_wires_the_step_runner_by_hand():
    files = sorted((REPO / "benchmarks").rglob("*.py")) + [REPO / "torchplex" / "train.py"]
    offenders = {str(p.relative_to(REPO)): sorted(c) for p in files if (c := constructed(p))}
    assert not offenders, f"build the step runtime with torchplex.runtime.build.build_step_runtime: {offenders}"


def test_the_check_sees_a_hand_built_runner(tmp_path):
    probe = tmp_path / "bench.py"
    probe.write_text("from torchplex.runtime import executor\nr = executor.StepRunner(1, 2)\ns = StepSettings([], [])\n")
    assert constructed(probe) == {"StepRunner", "StepSettings"}


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
def test_managed_memory_plans_the_stages_of_the_runners_schedule(grpo_assets, frozen):
    """The memory plan's phases are the schedule's stages (they were a list in train.py, without "vision")."""
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
    assert runner.stages() == stages
    assert [row.phase for row in runner.memory.plan.phases] == stages
    # every group the trainer's step touches is planned: the KV pool (released and resumed through the engine) and
    # the gradients (counted in train) as well as the reference weights and the optimizer state
    assert {g.name for g in runner.memory.plan.groups} == {"optimizer_state", "grads", "kv_pool", "ref_weights"}
    rows = {row.phase: row for row in runner.memory.plan.phases}
    assert "kv_pool" in rows["rollout"].resident and "kv_pool" in rows["ref"].offload
    assert "grads" in rows["train"].needed


@pytest.mark.parametrize("mode", ["serial", "decomposed"])
@pytest.mark.parametrize("packed", [True, False])
def test_packed_scoring_follows_the_config(grpo_assets, mode, packed):
    """runtime.packed_scoring reaches the runner's scorer: packed (the default) or padded rows (the escape hatch
    while the CUDA varlen path is new)."""
    import torch

    args = [f"--runtime.mode={mode}"] + ([] if packed else ["--runtime.packed_scoring=false"])
    cfg = load_config(args)
    assert step_settings(cfg).packed_scoring is packed
    actor = grpo_assets.actor
    optimizer = torch.optim.AdamW([p for p in actor.parameters() if p.requires_grad], lr=0.0)
    runner = build_step_runtime(cfg, actor, grpo_assets.reference, RolloutEngine(actor, kv_pool_bytes=2**20),
                                optimizer, None, grpo_assets.processor.tokenizer)
    assert runner.scorer.pack is packed
