"""parallelism.rollout_tp != tp in the trainer: rollout on a model sharing the actor's weights trains like rollout
on the actor itself.

Two gloo processes run the tiny GRPO trainer four times (3 steps, 2 prompts x 4 samples, a reference model):
  actor TP 2:          rollout TP 2 (the actor itself)  vs  rollout TP 1 (two replicas, one prompt each)
  actor FSDP2 dp 2:    rollout TP 1 (the actor itself)  vs  rollout TP 2 (one replica over both data shards)
Within a pair the actor, reference and training code are the same, and every sample's random stream is fixed by its
seed, so the only difference is the rollout's matmul rounding (a TP'd vs an unsplit model). The reference of each
comparison is therefore the run with rollout_tp == tp, and:
  * sampled tokens and lengths are identical (a rounding-level change of the logits could flip a Gumbel-max
    choice only at a near tie: none occurs in these runs; the sampling log-probs agree to fp32 rounding, 1e-5);
  * given identical tokens, the training step is the same computation: losses and every updated weight equal
    the reference run bit for bit (asserted with zero tolerance).
The rebuilt rollout weights must follow every optimizer step (resync before each rollout): with the rebuild left
out of the resync (tried), the TP 1 rollout samples other tokens from step 2 on and the test fails.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from distributed_helpers import free_port, init_gloo, spawn

TIMEOUT_S = 240
STEPS = 3
RUNS = {  # name: (dp_shard, tp, rollout_tp)
    "tp2_roll2": (1, 2, 2),
    "tp2_roll1": (1, 2, 1),
    "dp2_roll1": (2, 1, 1),
    "dp2_roll2": (2, 1, 2),
}
PAIRS = [("tp2_roll1", "tp2_roll2"), ("dp2_roll2", "dp2_roll1")]  # (run under test, reference)
DEBUG_TOML = Path(__file__).resolve().parents[1] / "train_configs" / "debug.toml"


def run_args(ckpt: str, synthetic: str, output_dir: str, name: str, dp: int, tp: int, rollout_tp: int) -> list[str]:
    args = {
        "job.config_file": DEBUG_TOML, "job.name": name, "job.output_dir": output_dir,
        "model.hf_checkpoint": ckpt, "model.make_tiny_if_missing": "false",
        "data.synthetic_dir": synthetic, "data.synthetic_train": 32, "data.synthetic_eval": 8,
        "data.prompts_per_step": 2, "rollout.n_samples": 4, "rollout.max_new_tokens": 8,
        "optimizer.lr": 1e-3, "training.steps": STEPS, "training.sft_warmup_steps": 0,
        "algorithm.kl_coef": 0.05, "reward.functions": "accuracy,format,distinct_chars",
        "reward.weights": "1.0,0.1,1.0",
        "metrics.progress_bar": "false", "metrics.tensorboard": "false", "metrics.eval_interval": 0,
        "parallelism.dp_shard": dp, "parallelism.tp": tp, "parallelism.rollout_tp": rollout_tp,
    }
    return [f"--{key}={value}" for key, value in args.items()]


def _full(t: torch.Tensor) -> torch.Tensor:
    t = t.detach()
    return t.full_tensor() if isinstance(t, DTensor) else t.clone()


def _worker(rank: int, world_size: int, port: int, ckpt: str, tmp: str) -> None:
    init_gloo(rank, world_size, port)
    from torchplex.config import load_config
    from torchplex.rl import rewards
    from torchplex.train import Trainer

    # A reward the random model earns unevenly, so advantages and updates are non-zero (as in test_train_e2e).
    rewards.REWARD_FUNCTIONS["distinct_chars"] = lambda response, answer: len(set(response)) / 16
    try:
        results = {}
        for name, (dp, tp, rollout_tp) in RUNS.items():
            trainer = Trainer(load_config(run_args(ckpt, f"{tmp}/synthetic", tmp, name, dp, tp, rollout_tp)))
            initial = {n: _full(p) for n, p in trainer.actor.named_parameters()}
            steps = []
            run = trainer.runner.run

            def recording_run(*args, **kwargs):
                out = run(*args, **kwargs)
                exp = out.experience
                steps.append({"tokens": exp.tokens.clone(), "lengths": exp.lengths.clone(),
                              "sampling_logprobs": exp.sampling_logprobs.clone(),
                              "loss": out.train.stats.loss.detach().clone()})
                return out

            trainer.runner.run = recording_run
            trainer.train()
            gathered = [None] * world_size
            dist.all_gather_object(gathered, steps)
            results[name] = {"steps": gathered, "initial": initial, "engine": type(trainer.engine).__name__,
                             "params": {n: _full(p) for n, p in trainer.actor.named_parameters()}}
        if rank == 0:
            torch.save(results, f"{tmp}/result.pt")
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def runs(tiny_ckpt, tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("rollout_tp")
    spawn(_worker, 2, (free_port(), str(tiny_ckpt), str(tmp)), TIMEOUT_S, what="rollout_tp trainer runs")
    return torch.load(tmp / "result.pt", weights_only=False)


@pytest.mark.slow
def test_separate_rollout_model_only_when_degrees_differ(runs):
    assert runs["tp2_roll1"]["engine"] == runs["dp2_roll2"]["engine"] == "SharedRolloutEngine"
    assert runs["tp2_roll2"]["engine"] == runs["dp2_roll1"]["engine"] == "RolloutEngine"


@pytest.mark.slow
@pytest.mark.parametrize("run,reference", PAIRS)
def test_rollout_tp_samples_the_same_tokens(runs, run, reference):
    for rank, (got, want) in enumerate(zip(runs[run]["steps"], runs[reference]["steps"])):
        assert len(got) == len(want) == STEPS
        for step, (g, w) in enumerate(zip(got, want), start=1):
            assert torch.equal(g["tokens"], w["tokens"]), f"rank {rank} step {step} tokens"
            assert torch.equal(g["lengths"], w["lengths"]), f"rank {rank} step {step} lengths"
            torch.testing.assert_close(g["sampling_logprobs"], w["sampling_logprobs"], rtol=0, atol=1e-5,
                                       msg=f"rank {rank} step {step} sampling log-probs")


@pytest.mark.slow
@pytest.mark.parametrize("run,reference", PAIRS)
def test_rollout_tp_trains_bit_for_bit_like_the_reference(runs, run, reference):
    for rank, (got, want) in enumerate(zip(runs[run]["steps"], runs[reference]["steps"])):
        for step, (g, w) in enumerate(zip(got, want), start=1):
            assert torch.equal(g["loss"], w["loss"]), f"rank {rank} step {step} loss {g['loss']} vs {w['loss']}"
    for name, value in runs[run]["params"].items():
        assert torch.equal(value, runs[reference]["params"][name]), name
    # the steps did train the weights a TP 1 rollout must rebuild (else equal tokens would not show the resync)
    for name in ("layers.0.attention.wq.weight", "layers.1.feed_forward.w2.weight"):
        assert (runs[run]["params"][name] - runs[run]["initial"][name]).abs().max() > 0.5e-3, name


# ---- the KV pool of a TP'd model holds the rank's own K/V heads ------------------------------------------------
def _prompts(ckpt: str) -> list:
    from PIL import Image

    from torchplex.data.processing import encode_prompt, load_processor

    processor = load_processor(ckpt)
    rng = torch.Generator().manual_seed(0)
    image = lambda w, h: Image.fromarray(torch.randint(0, 255, (h, w, 3), generator=rng, dtype=torch.uint8).numpy())
    return [encode_prompt(processor, "How many circles?", images=[image(56, 56)]),
            encode_prompt(processor, "Colour of the square?", images=[image(112, 84)])]


def _rollout(model, prompts: list) -> dict:
    from torchplex.rollout.engine import RolloutEngine
    from torchplex.rollout.sampling import SamplingParams

    engine = RolloutEngine(model, kv_pool_bytes=8 * 2**20)
    outputs = engine.generate(prompts, SamplingParams(n=3, max_new_tokens=12, seed=7))
    return {"tokens": [s.token_ids for group in outputs for s in group],
            "logprobs": [s.logprobs for group in outputs for s in group],
            "pool_heads": engine.pool.prefix_k[0].shape[1], "group_bytes": engine.pool_group_bytes(3, 100, 12)}


def _pool_worker(rank: int, world_size: int, port: int, ckpts: list[str], tmp: str) -> None:
    init_gloo(rank, world_size, port)
    from torchplex.distributed.mesh import ParallelDims
    from torchplex.models.qwen2_5_vl.build import build_model
    from torchplex.models.qwen2_5_vl.parallelize import parallelize_qwen2_5_vl

    try:
        results = {}
        for ckpt in ckpts:
            prompts = _prompts(ckpt)
            plain = _rollout(build_model(hf_dir=ckpt).eval(), prompts)
            tp = build_model(hf_dir=ckpt).eval()
            parallelize_qwen2_5_vl(tp, ParallelDims(dp_shard=1, tp=world_size, world_size=world_size),
                                   param_dtype=torch.float32)
            results[ckpt] = {"tp1": plain, "tp2": _rollout(tp, prompts), "kv_heads": tp.args.text.num_kv_heads}
        if rank == 0:
            torch.save(results, f"{tmp}/pool.pt")
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def pool_runs(tiny_ckpt, tiny_ckpt_kv4, tmp_path_factory) -> dict:
    tmp = tmp_path_factory.mktemp("tp_pool")
    ckpts = [str(tiny_ckpt), str(tiny_ckpt_kv4)]
    spawn(_pool_worker, 2, (free_port(), ckpts, str(tmp)), TIMEOUT_S, what="TP rollouts")
    return torch.load(tmp / "pool.pt", weights_only=False)


@pytest.mark.slow
def test_a_tp_rank_pool_holds_its_own_kv_heads_and_samples_like_one_process(pool_runs):
    """Rollout on the actor under TP 2 (parallelism.rollout_tp == tp): each rank's attention projects num_kv_heads / 2
    heads, and its KV pool holds those. Defect: the pool was laid out with the model's global K/V head count. With the
    `debug` flavor's 2 K/V heads (1 per rank) the rank's one head was broadcast into both slots (twice the memory the
    budget planned, same tokens); with 4 (2 per rank, as 7B's 4 under TP 2) the prefill's K/V did not fit the pool
    and the rollout failed. The TP'd engine now samples the one-process tokens (fp32; log-probs to rounding: 1e-5),
    with half the one-process pool per group."""
    for ckpt, run in pool_runs.items():
        tp1, tp2 = run["tp1"], run["tp2"]
        assert tp1["pool_heads"] == run["kv_heads"] and tp2["pool_heads"] == run["kv_heads"] // 2, ckpt
        assert tp2["group_bytes"] * 2 == tp1["group_bytes"], ckpt
        assert tp2["tokens"] == tp1["tokens"], ckpt
        for got, want in zip(tp2["logprobs"], tp1["logprobs"]):
            torch.testing.assert_close(torch.tensor(got), torch.tensor(want), rtol=0, atol=1e-5)
    assert {run["kv_heads"] for run in pool_runs.values()} == {2, 4}
