"""Four ranks through `NGPU=4 ./run_train.sh` (torchrun, gloo) train like one process on the same global batch.

Four layouts of four CPU processes, each in one of the two decomposed runtimes, so that every layout runs in both:
  dp4_decomposed        FSDP2 over 4 ranks; training holds the actor prefixes in one batched forward per rank
  tp2dp2_overlapped     TP 2 x FSDP2 2; the actor prefix fused into the rollout prefill on the TP'd actor, whose
                        KV pool holds the rank's own K/V heads
  dp4_roll2_overlapped  rollout_tp 2 > tp 1: one rollout replica samples the prompts of two data shards
  tp2dp2_roll1_decomposed  rollout_tp 1 < tp 2: the two replicas of a TP group split its prompts
Each is compared with one process of the same mode (`runtime.mode`), all on a tiny checkpoint with 4 K/V heads (2 per
rank under TP 2, where the debug flavor's 2 would leave one), 2 steps of 4 prompts x 4 samples, a reference model.

Same samples: the trainer keys each prompt's sample seeds by its index in the global batch (Trainer.sample_seeds),
so which rank samples a prompt does not change its tokens. Then the same computation, summed in another order
(FSDP2's reduce-scatter over ranks, TP's split matmuls), in fp32: losses and gradient norms to rel 1e-4, and every
updated weight to 1% of one Adam step (0.01 * lr). Adam's update is ~lr * m / sqrt(v), insensitive to the gradient's
scale, so gradients that differ by fp32 rounding give updates that differ far less than that (observed up to 0.2 %);
eps is raised to 1e-6 for elements whose gradient is ~0, which rounding alone would move by ~lr (as in
test_train_e2e.py). A launcher (TRAIN_MODULE) records each rank's experience, so the split of the prompt batch is
checked too: the data-parallel ranks' shares partition the global batch, TP peers hold the same, and each rank holds
whole groups, with the one-process tokens, advantages and log-probs of its prompts.
"""

from __future__ import annotations

import json
import textwrap
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from test_train_e2e import DEBUG_TOML, LR, REPO_ROOT, read_metrics, run_train_sh, tiny_run_args

STEPS, PROMPTS, N = 2, 4, 4
RUNS = {  # name: (runtime.mode, dp_shard, tp, rollout_tp)
    "dp4_decomposed": ("decomposed", 4, 1, 1),
    "tp2dp2_overlapped": ("overlapped", 2, 2, 2),
    "dp4_roll2_overlapped": ("overlapped", 4, 1, 2),
    "tp2dp2_roll1_decomposed": ("decomposed", 2, 2, 1),
}

REWARD = '''
def distinct_chars(prompts, responses, answers, records):
    """A reward the random model earns unevenly (test_train_e2e.py's), so advantages and updates are non-zero."""
    return [len(set(r)) / 16 for r in responses]
'''
LAUNCHER = '''
"""The trainer, recording each step's experience on every rank in $RECORD_DIR/rank<RANK>.pt."""
import os
import sys

import torch

from torchplex.runtime.step import GRPOStep
from torchplex.train import main

steps = []
run = GRPOStep.run


def recording_run(self, prompts, answers, params, **kwargs):
    out = run(self, prompts, answers, params, **kwargs)
    e = out.experience
    steps.append({"seeds": [list(s) for s in kwargs["sample_seeds"]], "group_size": e.group_size,
                  "tokens": e.tokens, "lengths": e.lengths, "advantages": e.advantages,
                  "old_logprobs": e.old_logprobs, "ref_logprobs": e.ref_logprobs,
                  "engine": type(self.engine).__name__})
    torch.save(steps, os.path.join(os.environ["RECORD_DIR"], "rank%s.pt" % os.environ.get("RANK", "0")))
    return out


GRPOStep.run = recording_run
main(sys.argv[1:])
'''


def launch(tmp: Path, ckpt: Path, name: str, mode: str, ngpu: int, dp: int = 1, tp: int = 1, rollout_tp: int = 1):
    """One run through run_train.sh; returns (metrics by step, the per-rank records)."""
    records = tmp / "records" / name
    records.mkdir(parents=True)
    args = tiny_run_args(ckpt, tmp / "synthetic", tmp, name) + [
        f"--reward.functions=accuracy,format,{tmp / 'reward.py'}:distinct_chars", "--reward.weights=1.0,0.1,1.0",
        f"--data.prompts_per_step={PROMPTS}", f"--rollout.n_samples={N}", f"--training.steps={STEPS}",
        "--algorithm.kl_coef=0.05", "--algorithm.micro_batch_size=3", "--optimizer.eps=1e-6",
        "--checkpoint.export_hf_at_end=true", f"--runtime.mode={mode}", f"--parallelism.dp_shard={dp}",
        f"--parallelism.tp={tp}", f"--parallelism.rollout_tp={rollout_tp}"]
    done = run_train_sh(args, DEBUG_TOML, tmp, NGPU=str(ngpu), TRAIN_MODULE="record_steps", RECORD_DIR=str(records),
                        PYTHONPATH=f"{REPO_ROOT}:{tmp}")
    assert done.returncode == 0, name + done.stdout[-3000:] + done.stderr[-6000:]
    ranks = [torch.load(records / f"rank{r}.pt", weights_only=False) for r in range(ngpu)]
    return {"metrics": read_metrics(tmp / name), "ranks": ranks,
            "plan": json.loads((tmp / name / "plan.json").read_text()),
            "weights": load_file(tmp / name / "hf_export" / "model.safetensors")}


@pytest.fixture(scope="module")
def runs(tiny_ckpt_kv4, tmp_path_factory) -> dict:
    """One-process runs of both modes and the four layouts (~2 minutes on 2 cores)."""
    tmp = tmp_path_factory.mktemp("multi_rank")
    (tmp / "reward.py").write_text(textwrap.dedent(REWARD))
    (tmp / "record_steps.py").write_text(textwrap.dedent(LAUNCHER))
    out = {f"single_{mode}": launch(tmp, tiny_ckpt_kv4, f"single_{mode}", mode, 1)
           for mode in ("decomposed", "overlapped")}
    for name, (mode, dp, tp, rollout_tp) in RUNS.items():
        out[name] = launch(tmp, tiny_ckpt_kv4, name, mode, 4, dp, tp, rollout_tp)
    out["initial"] = load_file(tiny_ckpt_kv4 / "model.safetensors")
    return out


def reference_of(runs: dict, name: str) -> dict:
    return runs[f"single_{RUNS[name][0]}"]


@pytest.mark.slow
def test_each_layout_runs_what_it_names(runs):
    """The comparisons below are of the paths they claim: the mode, the fused prefill on the TP'd actor, and a
    rollout model of its own TP degree where rollout_tp != tp."""
    for name, (mode, _, tp, rollout_tp) in RUNS.items():
        plan, ranks = runs[name]["plan"], runs[name]["ranks"]
        assert plan["mode"] == mode, name
        engine = "SharedRolloutEngine" if rollout_tp != tp else "RolloutEngine"
        assert {step["engine"] for rank in ranks for step in rank} == {engine}, name
    placements = lambda name: {p["name"]: p["placement"] for p in runs[name]["plan"]["phases"]}
    assert placements("tp2dp2_overlapped")["actor_prefix"] == "fused:rollout"
    assert "actor_prefix" not in placements("dp4_roll2_overlapped")  # no prefill hook on a separate rollout model
    assert placements("dp4_decomposed")["actor_prefix"] == "main"
    assert {f["form"] for f in runs["dp4_decomposed"]["plan"]["train_prefix_forms"]} == {"graph"}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(RUNS))
def test_four_ranks_train_like_one_process(runs, name):
    got, want = runs[name]["metrics"], reference_of(runs, name)["metrics"]
    for step in range(1, STEPS + 1):
        for key in ("reward/mean", "reward/std", "response_length/mean", "tokens/prefix", "tokens/response"):
            assert got[step][key] == pytest.approx(want[step][key], rel=1e-6), f"step {step} {key}"
        for key in ("loss", "pg_loss", "grad_norm", "kl", "entropy", "clip_fraction"):
            assert got[step][key] == pytest.approx(want[step][key], rel=1e-4, abs=1e-6), f"step {step} {key}"
    assert want[STEPS]["grad_norm"] > 0 and want[STEPS]["kl"] > 0
    expected, actual, initial = reference_of(runs, name)["weights"], runs[name]["weights"], runs["initial"]
    assert actual.keys() == expected.keys()
    for key in expected:
        assert (expected[key] - initial[key]).abs().max() > LR / 2, f"{key} did not train"
        torch.testing.assert_close(actual[key], expected[key], rtol=0, atol=0.01 * LR, msg=key)


def one_process_rows(single: list[dict], step: int) -> dict[tuple, dict]:
    """The one-process run's step as {a prompt's sample seeds: its group's rows}."""
    rec = single[step]
    g = rec["group_size"]
    return {tuple(seeds): {key: rec[key][b * g:(b + 1) * g] for key in ("tokens", "lengths", "advantages",
                                                                          "old_logprobs", "ref_logprobs")}
            for b, seeds in enumerate(rec["seeds"])}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(RUNS))
def test_each_rank_holds_whole_groups_of_its_share_of_the_prompts(runs, name):
    """Rank r of data shard d (ranks tp-fastest) samples prompts d, d + dp, ... of the global batch: the shards
    partition it, TP peers hold the same prompts, and every prompt's group of N samples lies on one rank with the
    one-process tokens, group advantages (normalised within the whole group) and log-probs."""
    _, dp, tp, _ = RUNS[name]
    single = reference_of(runs, name)["ranks"][0]
    for step in range(STEPS):
        groups = one_process_rows(single, step)
        assert len(groups) == PROMPTS
        shards = []
        for rank, records in enumerate(runs[name]["ranks"]):
            rec = records[step]
            seeds = [tuple(s) for s in rec["seeds"]]
            assert rec["group_size"] == N and rec["tokens"].shape[0] == N * len(seeds), (name, rank)
            if rank % tp == 0:
                shards.append(seeds)
            else:  # a TP peer of rank - rank % tp
                assert seeds == [tuple(s) for s in runs[name]["ranks"][rank - rank % tp][step]["seeds"]]
            for b, key in enumerate(seeds):
                want, rows = groups[key], slice(b * N, (b + 1) * N)
                assert torch.equal(rec["lengths"][rows], want["lengths"]), (name, rank, step)
                width = int(want["lengths"].max())
                assert torch.equal(rec["tokens"][rows, :width], want["tokens"][:, :width]), (name, rank, step)
                torch.testing.assert_close(rec["advantages"][rows], want["advantages"], rtol=0, atol=1e-6)
                for lp in ("old_logprobs", "ref_logprobs"):
                    mask = torch.arange(width)[None] < want["lengths"][:, None]
                    torch.testing.assert_close(rec[lp][rows, :width][mask], want[lp][:, :width][mask], rtol=0,
                                               atol=1e-5, msg=f"{name} rank {rank} step {step} {lp}")
        assert len(shards) == dp
        assert sorted(k for shard in shards for k in shard) == sorted(groups)  # each prompt on exactly one shard
        assert [len(shard) for shard in shards] == [PROMPTS // dp] * dp
