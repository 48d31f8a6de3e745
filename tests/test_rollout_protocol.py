"""The rollout protocol: engines declare what they support, the planner places fused and window work only there and
says why not otherwise, and an engine given a hook it does not run raises instead of dropping it (issue 17: with
rollout_tp != tp the schedule said `window:rollout` while SharedRolloutEngine `del`eted the hooks)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from distributed_helpers import free_port, init_gloo, spawn
from torchplex.rollout.engine import RolloutEngine
from torchplex.rollout.protocol import RolloutCapabilities, RolloutEngineProtocol
from torchplex.rollout.sampling import SamplingParams
from benchmarks.disaggregation import RemoteRollout
from torchplex.runtime.plan import PlanOptions, StepShape, plan_step
from torchplex.runtime.rollout_weights import SharedRolloutEngine

SHAPE = StepShape(prompt_lengths=(100, 60), group_size=4, max_new_tokens=8, has_reference=True,
                  vision_trainable=False, kv_bytes_per_token=1000, activation_bytes_per_token=8000,
                  prefix_room_bytes=2**30)
WINDOW = PlanOptions(mode="overlapped", ref_prefix_in_window=True, ref_suffix_in_window=True)
NO_HOOKS = RolloutCapabilities(prefill_hook=False, samples_finished_hook=False, step_hook=False,
                               shares_actor_weights=False, why_not="test engine")


def test_engines_declare_their_capabilities_honestly():
    assert RolloutEngine.capabilities == RolloutCapabilities()  # decodes on the actor: every hook runs
    for engine in (SharedRolloutEngine, RemoteRollout):
        caps = engine.capabilities
        assert not (caps.prefill_hook or caps.step_hook or caps.samples_finished_hook or caps.shares_actor_weights)
        assert caps.why_not
    assert isinstance(RemoteRollout(src=0, device=torch.device("cpu")), RolloutEngineProtocol)


def test_planner_places_window_and_fusion_work_only_where_the_engine_supports_it():
    full = plan_step(SHAPE, WINDOW)
    assert full.phase("ref_prefix").in_window and full.phase("ref_suffix").in_window
    assert full.placed("actor_prefix", "fused:rollout")
    s = plan_step(SHAPE, WINDOW, NO_HOOKS)
    assert not s.has("actor_prefix") and not any(p.in_window for p in s.phases)
    assert s.phase("ref_prefix").placement == s.phase("ref_suffix").placement == "main"
    assert any(r.startswith("actor prefix not fused: the rollout engine has no prefill hook") for r in s.reasons)
    assert any(r.startswith("reference not in the decode window: the rollout engine has no step hook")
               and "test engine" in r for r in s.reasons)
    assert s.stages() == ["vision", "rollout", "ref", "train"]


def test_planner_keeps_the_prefix_window_without_a_finish_hook():
    caps = RolloutCapabilities(samples_finished_hook=False, why_not="no finish hook")
    s = plan_step(SHAPE, WINDOW, caps)
    assert s.phase("ref_prefix").in_window and s.phase("ref_suffix").placement == "main"
    assert any("suffixes not scored in the decode window" in r for r in s.reasons)


def test_an_engine_given_an_unsupported_hook_raises():
    remote = RemoteRollout(src=0, device=torch.device("cpu"))
    params = SamplingParams(n=1, max_new_tokens=1)
    with pytest.raises(ValueError, match="does not support on_step"):
        remote.generate([], params, on_step=lambda info: None)


# ---- a real step with rollout_tp != tp and the window asked for --------------------------------------------
DEBUG_TOML = Path(__file__).resolve().parents[1] / "train_configs" / "debug.toml"
TIMEOUT_S = 240


def _worker(rank: int, world_size: int, port: int, ckpt: str, tmp: str) -> None:
    init_gloo(rank, world_size, port)
    from torchplex.config import load_config
    from torchplex.train import Trainer

    args = {
        "job.config_file": DEBUG_TOML, "job.name": "window_tp", "job.output_dir": tmp,
        "model.hf_checkpoint": ckpt, "model.make_tiny_if_missing": "false",
        "data.synthetic_dir": f"{tmp}/synthetic", "data.synthetic_train": 8, "data.synthetic_eval": 2,
        "data.prompts_per_step": 2, "rollout.n_samples": 2, "rollout.max_new_tokens": 4,
        "training.steps": 1, "training.sft_warmup_steps": 0, "algorithm.kl_coef": 0.05,
        "metrics.progress_bar": "false", "metrics.tensorboard": "false", "metrics.eval_interval": 0,
        "parallelism.tp": 2, "parallelism.rollout_tp": 1,
        "runtime.mode": "overlapped", "runtime.reference_in_window": "true",
    }
    try:
        trainer = Trainer(load_config([f"--{k}={v}" for k, v in args.items()]))
        outs = []
        run = trainer.runner.run
        trainer.runner.run = lambda *a, **kw: outs.append(run(*a, **kw)) or outs[-1]
        trainer.train()
        out = outs[0]
        result = {"engine": type(trainer.engine).__name__, "schedule": out.plan.to_json(),
                  "window_spans": [s.name for s in out.timeline.spans if s.lane == "window"],
                  "ref_finite": bool(torch.isfinite(out.experience.ref_logprobs[out.experience.mask]).all()),
                  "main_spans": [s.name for s in out.timeline.spans if s.lane == "main"]}
        gathered = [None] * world_size
        dist.all_gather_object(gathered, result)
        if rank == 0:
            torch.save(gathered, f"{tmp}/result.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_rollout_tp_step_with_window_placement_records_why_the_window_is_not_used(tiny_ckpt, tmp_path):
    """tp 2, rollout_tp 1, overlapped with the reference in the window: the planner reads the SharedRolloutEngine's
    capabilities, keeps the reference on the main stream and says why, and the step scores every sample there."""
    import json

    spawn(_worker, 2, (free_port(), str(tiny_ckpt), str(tmp_path)), TIMEOUT_S, what="rollout_tp window step")
    for rank in torch.load(tmp_path / "result.pt", weights_only=False):
        assert rank["engine"] == "SharedRolloutEngine"
        schedule = json.loads(rank["schedule"])
        placements = {p["name"]: p["placement"] for p in schedule["phases"]}
        assert placements["ref_prefix"] == placements["ref_suffix"] == "main" and "actor_prefix" not in placements
        assert any("not in the decode window" in r and "rollout_tp != tp" in r for r in schedule["reasons"])
        assert any("not fused" in r for r in schedule["reasons"])
        assert rank["window_spans"] == [] and "ref" in rank["main_spans"] and rank["ref_finite"]
