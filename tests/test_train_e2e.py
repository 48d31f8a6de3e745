"""End-to-end specification of the GRPO trainer: whole runs of the tiny model on CPU.

Every run here uses a tiny setting (2 prompts x 4 samples, 8 new tokens, 32 synthetic prompts). The tiny random
model never writes `<answer>` tags, so the task's own rewards are all zero and a step would not move the weights;
runs therefore add the reward `distinct_chars` (a deterministic function of the response text that differs between
samples), so advantages, gradients and the KL term are non-zero and the comparisons below have something to compare.

Runs are single-threaded (`torch.set_num_threads(1)`, `OMP_NUM_THREADS=1` for subprocesses): on a busy 2-core
machine two intra-op threads make these small matmuls ~20x slower, and one thread is also bit-for-bit repeatable.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

from torchplex.config import load_config
from torchplex.data.records import read_records
from torchplex.data.synthetic import generate_synthetic_task
from torchplex.models.qwen2_5_vl.tiny_checkpoint import make_tiny_checkpoint
from torchplex.rl import rewards
from torchplex.rollout.engine import PoolFloor
from torchplex.rollout.kv_pool import GroupKVPool
from torchplex.runtime import training
from torchplex.train import Trainer

REPO_ROOT = Path(__file__).resolve().parents[1]
DEBUG_TOML = REPO_ROOT / "train_configs" / "debug.toml"
TEST_REWARD = "distinct_chars"
SUBPROCESS_TIMEOUT_S = 300
LR = 1e-3  # large enough that a few steps move every weight well above fp32 noise


def distinct_chars_reward(response: str, answer: str) -> float:
    """A reward the random model earns unevenly: the number of distinct characters it wrote, scaled to ~[0, 1]."""
    del answer
    return len(set(response)) / 16


# ---- fixtures and helpers ---------------------------------------------------------------------------------------
@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def uneven_reward(monkeypatch):
    """Registers `distinct_chars` for in-process runs (subprocesses use `launcher`)."""
    monkeypatch.setitem(rewards.REWARD_FUNCTIONS, TEST_REWARD, distinct_chars_reward)


@pytest.fixture(scope="module")
def synthetic_dir(tmp_path_factory) -> Path:
    """Shared by all runs: the trainer regenerates the synthetic task only when its parameters change."""
    return tmp_path_factory.mktemp("synthetic")


def tiny_run_args(ckpt: Path, synthetic: Path, output_dir: Path, name: str = "run") -> list[str]:
    """Overrides of debug.toml (given separately) for a run of a few seconds."""
    args = {
        "job.name": name, "job.output_dir": output_dir,
        "model.hf_checkpoint": ckpt, "model.make_tiny_if_missing": "false",
        "data.synthetic_dir": synthetic, "data.synthetic_train": 32, "data.synthetic_eval": 8,
        "data.prompts_per_step": 2, "data.eval_prompts": 4,
        "rollout.n_samples": 4, "rollout.max_new_tokens": 8,
        "optimizer.lr": LR, "training.steps": 2, "training.sft_warmup_steps": 0,
        "metrics.progress_bar": "false", "metrics.tensorboard": "false", "metrics.eval_interval": 0,
    }
    return [f"--{key}={value}" for key, value in args.items()]


def fast_args(ckpt: Path, synthetic: Path, output_dir: Path, name: str = "run", *extra: str) -> list[str]:
    """debug.toml, a tiny run, and the test reward added to the task's own."""
    return [f"--job.config_file={DEBUG_TOML}", *tiny_run_args(ckpt, synthetic, output_dir, name),
            f"--reward.functions=accuracy,format,{TEST_REWARD}", "--reward.weights=1.0,0.1,1.0", *extra]


def read_metrics(run_dir: Path) -> dict[int, dict]:
    """metrics.jsonl as {step: merged record}; step 0 holds the evaluation before training."""
    out: dict[int, dict] = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        out.setdefault(record["step"], {}).update(record)
    return out


def params_of(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters()}


def launcher(tmp_path: Path) -> Path:
    """A script that registers `distinct_chars` (same formula) in a fresh interpreter, then runs the trainer."""
    script = tmp_path / "launch_train.py"
    script.write_text(textwrap.dedent(f"""
        import sys
        from torchplex.rl import rewards
        rewards.REWARD_FUNCTIONS[{TEST_REWARD!r}] = lambda response, answer: len(set(response)) / 16
        from torchplex.train import main
        main(sys.argv[1:])
    """))
    return script


def subprocess_env() -> dict[str, str]:
    # PYTHON: run_train.sh uses this interpreter, the one running the tests (with torchplex importable).
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONPATH=str(REPO_ROOT), PYTHON=sys.executable)


# ---- 1. resume -----------------------------------------------------------------------------------------------
class Preempted(RuntimeError):
    pass


def test_resume_after_preemption_reproduces_the_uninterrupted_run(tmp_path, tiny_ckpt, synthetic_dir, uneven_reward):
    """6 steps in one go == 3 steps, a crash, and a resumed run to step 6: same metrics per step, same weights.

    The schedule (warm-up then linear decay over 6 steps), the KL term (reference model) and two PPO epochs all take
    part, and the evaluation at steps 3 and 6 runs the rollout engine in between.
    """
    options = ["--training.steps=6", "--algorithm.kl_coef=0.05", "--algorithm.ppo_epochs=2",
               "--lr_scheduler.warmup_steps=2", "--lr_scheduler.decay=linear", "--checkpoint.enable=true",
               "--checkpoint.interval=3", "--checkpoint.keep_latest_k=0", "--metrics.eval_interval=3"]
    straight = Trainer(load_config(fast_args(tiny_ckpt, synthetic_dir, tmp_path, "straight", *options)))
    straight.train()

    argv = fast_args(tiny_ckpt, synthetic_dir, tmp_path, "resumed", *options)
    first = Trainer(load_config(argv))
    run_step = first.train_step

    def crash_in_step_5():  # step 4 is logged, the checkpoint is step 3's
        if first.step == 5:
            raise Preempted
        return run_step()

    first.train_step = crash_in_step_5
    with pytest.raises(Preempted):
        first.train()
    assert first.checkpoints.saved_steps() == [3]
    second = Trainer(load_config(argv))
    second.train()

    expected, actual = read_metrics(tmp_path / "straight"), read_metrics(tmp_path / "resumed")
    assert sorted(actual) == sorted(expected) == list(range(7))
    records = lambda run: [(r["step"], sorted(r)) for r in map(json.loads, (tmp_path / run / "metrics.jsonl")
                                                              .read_text().splitlines())]
    assert records("resumed") == records("straight")  # step 4's record once, not once per run that logged it
    for step in range(1, 7):
        for key in ("loss", "pg_loss", "reward/mean", "grad_norm", "kl", "lr", "entropy"):
            assert actual[step][key] == expected[step][key], f"step {step} {key}"
    for key in ("eval/accuracy", "eval/format"):
        assert actual[6][key] == expected[6][key]
    assert expected[6]["kl"] > 0 and expected[6]["grad_norm"] > 0  # the comparison is not between zeros
    final, reference = params_of(second.actor), params_of(straight.actor)
    for name in reference:
        torch.testing.assert_close(final[name], reference[name], rtol=0, atol=0, msg=name)
    initial = params_of(first.reference)  # the frozen reference model holds the starting weights
    assert not all(torch.equal(final[name], initial[name]) for name in initial)


@pytest.mark.parametrize("kv_pool_gib,groups", [(1.0, 4), (0, 2)])
def test_an_evaluation_before_the_first_step_builds_the_pool_training_uses(tmp_path, tiny_ckpt, synthetic_dir,
                                                                           uneven_reward, monkeypatch, kv_pool_gib,
                                                                           groups):
    """Evaluation at step 0 (4 greedy prompts), a step (2 prompts x 4 samples of 8 tokens), the evaluation after it:
    one pool geometry, so the decode attention compiles once. A 1 GiB pool holds all 4 evaluation prompts; one the
    plan sizes (kv_pool_gib 0) is unknown before the first step, so the evaluation builds training's 2 groups (its
    other prompts wait for a freed group) and the plan keeps it. Without the trainer's floor the first evaluation
    builds a pool of one sample per group that training replaces."""
    built = []
    init = GroupKVPool.__init__

    def record(pool, **kwargs):
        init(pool, **kwargs)
        built.append((pool.num_groups, pool.n, pool.max_new))

    monkeypatch.setattr(GroupKVPool, "__init__", record)
    trainer = Trainer(load_config(fast_args(tiny_ckpt, synthetic_dir, tmp_path, "eval-first", "--training.steps=1",
                                            "--metrics.eval_interval=1", f"--rollout.kv_pool_gib={kv_pool_gib}")))
    assert trainer.engine.least_pool == PoolFloor(n=4, max_new=8, prompts=2)
    trainer.train()
    assert sorted(read_metrics(tmp_path / "eval-first")) == [0, 1] and built == [(groups, 4, 8)]


# ---- 2. data parallel ------------------------------------------------------------------------------------------
@pytest.mark.slow
@pytest.mark.parametrize("mode", ["serial", "overlapped", "overlapped-frozen-tower"])
def test_two_process_fsdp_run_matches_one_process_run(tmp_path, tiny_ckpt, synthetic_dir, uneven_reward, mode):
    """2 gloo ranks with FSDP2, each taking half of every global batch, train like one process on the whole batch.
    In serial mode and in overlapped mode (decomposed scoring, the actor prefix fused into the rollout prefill), also
    with model.freeze_vision (a frozen-tower cache that must not call the FSDP2 tower unit before its root; the
    reference, which one process gives the actor's tower, keeps its own under FSDP2: a unit of the actor's root
    cannot join a second root, "FSDP state has already been lazily initialized for visual").

    Same samples (seeds follow the prompt's index in the global batch), same globally reduced metrics, same
    weights up to fp32 summation order. Adam's eps is raised from 1e-8 to 1e-6 for the weight comparison: Adam
    divides by the gradient's own RMS, so an element whose true gradient is ~0 (key biases: softmax ignores them)
    would otherwise move by ~lr in a direction set by rounding noise; 1e-6 is far below the real gradients here
    (grad norm ~2 over ~1M weights), so every other update is unchanged. micro_batch_size 3 splits the batch
    differently on 1 and 2 ranks (3+3+2 vs 3+1 per rank).
    """
    argv = fast_args(tiny_ckpt, synthetic_dir, tmp_path, "single", "--training.steps=3",
                     "--algorithm.kl_coef=0.05", "--algorithm.micro_batch_size=3", "--optimizer.eps=1e-6",
                     "--checkpoint.export_hf_at_end=true", f"--runtime.mode={mode.removesuffix('-frozen-tower')}",
                     f"--model.freeze_vision={mode.endswith('-frozen-tower')}".lower())
    Trainer(load_config(argv)).train()

    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--rdzv_backend=c10d",
           "--rdzv_endpoint=localhost:0", str(launcher(tmp_path)), *argv, "--job.name=fsdp2"]
    done = subprocess.run(cmd, cwd=tmp_path, env=subprocess_env(), capture_output=True, text=True,
                          timeout=SUBPROCESS_TIMEOUT_S)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]

    single, fsdp = read_metrics(tmp_path / "single"), read_metrics(tmp_path / "fsdp2")
    for step in (1, 2, 3):
        for key in ("reward/mean", "reward/std", "accuracy", "response_length/mean", "tokens/prefix",
                    "tokens/response"):
            assert fsdp[step][key] == pytest.approx(single[step][key], rel=1e-6), f"step {step} {key}"
        for key in ("loss", "pg_loss", "grad_norm", "kl", "entropy", "clip_fraction"):
            assert fsdp[step][key] == pytest.approx(single[step][key], rel=1e-4, abs=1e-6), f"step {step} {key}"
    assert single[3]["grad_norm"] > 0
    expected = load_file(tmp_path / "single" / "hf_export" / "model.safetensors")
    actual = load_file(tmp_path / "fsdp2" / "hf_export" / "model.safetensors")
    assert actual.keys() == expected.keys()
    initial = load_file(tiny_ckpt / "model.safetensors")
    frozen = lambda name: mode.endswith("-frozen-tower") and name.startswith("visual.")
    for name in expected:
        if frozen(name):
            assert torch.equal(actual[name], initial[name]) and torch.equal(expected[name], initial[name]), name
            continue
        assert (expected[name] - initial[name]).abs().max() > LR / 2, f"{name} did not train"  # 3 steps of ~LR
        # 1% of one Adam step: the runs differ only in the order fp32 sums are taken.
        torch.testing.assert_close(actual[name], expected[name], rtol=0, atol=0.01 * LR, msg=name)
    assert any(map(frozen, expected)) == mode.endswith("-frozen-tower")


@pytest.mark.slow
def test_the_deferred_prefix_backward_finds_the_fsdp2_root_gathered(tmp_path, tiny_ckpt, synthetic_dir):
    """The held prompt prefixes' backward (DecomposedScorer) starts from their K/V and last hidden state after the
    suffix backward has resharded the FSDP2 root unit (embeddings, final norm): torch 2.11 did not gather it again
    there and crashed reading its freed storage (SIGSEGV in the multi-process decomposed and overlapped runs). The
    runtime gathers it first; a launcher records, at every such backward on both ranks, whether the final norm's
    weight is the gathered tensor (not the DTensor shard), on any torch version."""
    record = tmp_path / "root_states"
    script = tmp_path / "launch_train.py"
    script.write_text(textwrap.dedent(f"""
        import json, os, sys
        import torch
        import torchplex.train as train
        keep, states = train.Trainer._build_optimizer, []
        def build_optimizer(self):
            train.ACTOR = self.actor
            return keep(self)
        train.Trainer._build_optimizer = build_optimizer
        backward = torch.autograd.backward
        def spy(*args, **kwargs):
            if "grad_tensors" in kwargs:  # the deferred prefixes' backward (a loss's own backward passes none)
                states.append(type(train.ACTOR.norm.weight).__name__)
                with open({str(record)!r} + os.environ["RANK"], "w") as f:  # a finished gloo job ends in os._exit
                    json.dump(states, f)
            return backward(*args, **kwargs)
        torch.autograd.backward = spy
        train.main(sys.argv[1:])
    """))
    argv = [*tiny_run_args(tiny_ckpt, synthetic_dir, tmp_path, "fsdp2"), "--runtime.mode=overlapped",
            "--algorithm.micro_batch_size=3", "--training.steps=1"]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--rdzv_backend=c10d",
           "--rdzv_endpoint=localhost:0", str(script), f"--job.config_file={DEBUG_TOML}", *argv]
    done = subprocess.run(cmd, cwd=tmp_path, env=subprocess_env(), capture_output=True, text=True,
                          timeout=SUBPROCESS_TIMEOUT_S)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    for rank in (0, 1):
        states = json.loads((tmp_path / f"root_states{rank}").read_text())
        assert states and "DTensor" not in states, (rank, states)  # gathered: a plain Parameter


UNREWARDED = "unrewarded"  # an answer whose samples all earn 0: dynamic sampling drops the group


def write_records_dropping_rank_1_groups(synthetic: Path, path: Path) -> None:
    """Eight prompts in file order; with 4 prompts a step and 2 ranks (rank r takes positions r, r + 2), rank 1 keeps
    one group of two at step 1 (position 1 unrewarded) and none at step 2 (positions 5 and 7): the ranks score
    different numbers of micro-batches, and one has nothing to train on."""
    train_path, _ = generate_synthetic_task(synthetic, 32, 8, seed=0, image_size=(112, 112))
    rows = [{"id": r.id, "prompt": r.prompt, "answer": r.answer, "images": r.images} for r in read_records(train_path)]
    rows = rows[:8]
    for i in (1, 5, 7):
        rows[i]["answer"] = UNREWARDED
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["serial", "overlapped", "window", "serial-tokens", "overlapped-tokens"])
def test_two_process_run_with_groups_dropped_on_one_rank_matches_one_process(tmp_path, tiny_ckpt, synthetic_dir,
                                                                              mode):
    """Dynamic sampling drops different numbers of groups on the two ranks (one rank keeps none at step 2): FSDP2
    needs every rank in every collective, so the ranks must still run the same micro-batches. The run finishes and
    trains like one process on the whole batch (same metrics, same weights up to fp32 summation order). "window"
    also scores the reference in the decode window, where how much is left for the reference phase differs by rank;
    "-tokens" cuts micro-batches by a token budget on a checkpoint whose responses vary in length (stop tokens for a
    mean of 4 tokens): serial's budget holds one or two samples, so its ranks make different numbers of training and
    reference micro-batches (the sharded reference gathers in every forward: reference_phase evens them out);
    overlapped's ranks cut alike by sequences (GRPOStep.limits), one process by the budget."""
    records = tmp_path / "train.jsonl"
    write_records_dropping_rank_1_groups(synthetic_dir, records)
    script = tmp_path / "launch_train.py"
    script.write_text(textwrap.dedent(f"""
        import sys
        from torchplex.rl import rewards
        rewards.REWARD_FUNCTIONS[{TEST_REWARD!r}] = (
            lambda response, answer: 0.0 if answer == {UNREWARDED!r} else len(set(response)) / 16)
        from torchplex.train import main
        main(sys.argv[1:])
    """))
    if mode.endswith("-tokens"):
        tiny_ckpt = make_tiny_checkpoint(tmp_path / "ckpt", size="debug", seed=0, mean_response=4).path
    argv = [f"--job.config_file={DEBUG_TOML}", *tiny_run_args(tiny_ckpt, synthetic_dir, tmp_path, "single"),
            f"--reward.functions={TEST_REWARD}", "--reward.weights=1.0", f"--data.train_file={records}",
            "--data.shuffle=false", "--data.prompts_per_step=4", "--algorithm.dynamic_sampling=true",
            "--algorithm.kl_coef=0.05", "--algorithm.micro_batch_size=4", "--optimizer.eps=1e-6",
            "--checkpoint.export_hf_at_end=true"]
    budget = {"serial-tokens": 135, "overlapped-tokens": 40}.get(mode)
    argv += (["--runtime.mode=overlapped", "--runtime.reference_in_window"] if mode == "window" else
             [f"--runtime.mode={mode.removesuffix('-tokens')}"])
    if budget:
        argv += ["--algorithm.micro_batch_size=0", f"--algorithm.micro_batch_tokens={budget}",
                 f"--algorithm.ref_micro_batch_tokens={budget}"]
    env = subprocess_env()
    for name, launch in (("single", [sys.executable, str(script)]),
                         ("fsdp2", [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
                                    "--rdzv_backend=c10d", "--rdzv_endpoint=localhost:0", str(script)])):
        done = subprocess.run([*launch, *argv, f"--job.name={name}"], cwd=tmp_path, env=env, capture_output=True,
                              text=True, timeout=SUBPROCESS_TIMEOUT_S)
        assert done.returncode == 0, name + done.stdout[-3000:] + done.stderr[-6000:]
    single, fsdp = read_metrics(tmp_path / "single"), read_metrics(tmp_path / "fsdp2")
    for step in (1, 2):
        assert single[step]["grad_norm"] > 0
        assert fsdp[step]["reward/mean"] == pytest.approx(single[step]["reward/mean"], rel=1e-6), f"step {step}"
        # rank 1 scored as many micro-batches as rank 0, some of them passes that train nothing
        assert fsdp[step]["tokens/response"] > single[step]["tokens/response"]
        for key in ("loss", "pg_loss", "grad_norm", "kl", "entropy"):
            assert fsdp[step][key] == pytest.approx(single[step][key], rel=1e-4, abs=1e-6), f"step {step} {key}"
    expected = load_file(tmp_path / "single" / "hf_export" / "model.safetensors")
    actual = load_file(tmp_path / "fsdp2" / "hf_export" / "model.safetensors")
    for name in expected:
        torch.testing.assert_close(actual[name], expected[name], rtol=0, atol=0.01 * LR, msg=name)


# ---- 3. bad input and non-finite steps ---------------------------------------------------------------------------
def write_records_with_two_bad_ones(synthetic: Path, path: Path) -> None:
    """Six prompts in file order: good, missing image, good, over-long prompt, good, good."""
    train_path, _ = generate_synthetic_task(synthetic, 32, 8, seed=0, image_size=(112, 112))
    good = [{"id": r.id, "prompt": r.prompt, "answer": r.answer, "images": r.images} for r in read_records(train_path)]
    missing = dict(good[1], id="missing-image", images=[str(path.parent / "no_such_image.png")])
    long = dict(good[3], id="long-prompt", prompt="How many circles are there? " * 200)
    rows = [good[0], missing, good[2], long, good[4], good[5]]
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))


def test_bad_samples_are_skipped_counted_and_the_run_goes_on(tmp_path, tiny_ckpt, synthetic_dir, uneven_reward):
    records = tmp_path / "train.jsonl"
    write_records_with_two_bad_ones(synthetic_dir, records)
    argv = fast_args(tiny_ckpt, synthetic_dir, tmp_path, "bad", "--training.steps=3", f"--data.train_file={records}",
                     "--data.shuffle=false", "--data.max_prompt_tokens=400")
    trainer = Trainer(load_config(argv))
    trainer.train()

    metrics = read_metrics(tmp_path / "bad")
    # Steps see (good, missing image), (good, long prompt), (good, good): one bad sample in each of the first two.
    assert [metrics[step]["skipped/bad_samples"] for step in (1, 2, 3)] == [1, 2, 2]
    assert [metrics[step]["tokens/serial_equivalent"] > 0 for step in (1, 2, 3)] == [True] * 3
    assert all(math.isfinite(metrics[step]["loss"]) and metrics[step]["grad_norm"] > 0 for step in (1, 2, 3))
    assert trainer.step == 3


@pytest.mark.slow
def test_two_process_run_with_bad_samples_on_one_rank_cuts_the_other_share(tmp_path, tiny_ckpt, synthetic_dir):
    """Six prompts a step on 2 ranks (rank r takes positions r, r + 2, r + 4): rank 1's positions 1 and 3 are bad,
    so it has one valid prompt and rank 0 three. Every rank trains on one (the others' micro-batches would otherwise
    outnumber its own inside FSDP2's collectives); the two cut prompts are counted, and the run goes on."""
    records = tmp_path / "train.jsonl"
    write_records_with_two_bad_ones(synthetic_dir, records)
    argv = fast_args(tiny_ckpt, synthetic_dir, tmp_path, "bad2", "--training.steps=2", f"--data.train_file={records}",
                     "--data.shuffle=false", "--data.max_prompt_tokens=400", "--data.prompts_per_step=6",
                     "--runtime.mode=overlapped")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", "--rdzv_backend=c10d",
           "--rdzv_endpoint=localhost:0", str(launcher(tmp_path)), *argv]
    done = subprocess.run(cmd, cwd=tmp_path, env=subprocess_env(), capture_output=True, text=True,
                          timeout=SUBPROCESS_TIMEOUT_S)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    metrics = read_metrics(tmp_path / "bad2")
    assert [metrics[step]["skipped/bad_samples"] for step in (1, 2)] == [2, 4]
    assert [metrics[step]["skipped/unequal_share"] for step in (1, 2)] == [2, 4]
    assert all(math.isfinite(metrics[step]["loss"]) and metrics[step]["grad_norm"] > 0 for step in (1, 2))


def test_a_non_finite_loss_skips_that_step_and_its_checkpoint(tmp_path, tiny_ckpt, synthetic_dir, uneven_reward,
                                                               monkeypatch):
    argv = fast_args(tiny_ckpt, synthetic_dir, tmp_path, "nan", "--training.steps=3", "--checkpoint.enable=true",
                     "--checkpoint.interval=1", "--checkpoint.keep_latest_k=0")
    trainer = Trainer(load_config(argv))
    loss_fn = training.policy_loss

    def nan_loss_at_step_2(*args, **kwargs):
        loss, stats = loss_fn(*args, **kwargs)
        return (loss * math.nan, stats) if trainer.step == 2 else (loss, stats)

    monkeypatch.setattr(training, "policy_loss", nan_loss_at_step_2)
    snapshots = [params_of(trainer.actor)]
    run_step = trainer.train_step

    def step_and_snapshot():
        out = run_step()
        snapshots.append(params_of(trainer.actor))
        return out

    trainer.train_step = step_and_snapshot
    trainer.train()

    def moved(before: dict, after: dict) -> bool:
        return any(not torch.equal(before[name], after[name]) for name in before)

    assert [moved(snapshots[i], snapshots[i + 1]) for i in range(3)] == [True, False, True]
    metrics = read_metrics(tmp_path / "nan")
    assert [metrics[step]["skipped/nonfinite_steps"] for step in (1, 2, 3)] == [0, 1, 0]
    assert math.isnan(float(metrics[2]["grad_norm"]))
    assert trainer.checkpoints.saved_steps() == [1, 3]


# ---- 4. the launcher ---------------------------------------------------------------------------------------------
def run_train_sh(args: list[str], config_file: Path, cwd: Path, **env: str) -> subprocess.CompletedProcess:
    """run_train.sh with `config_file`; `env` adds to the environment (NGPU, TRAIN_MODULE, ...)."""
    env = dict(subprocess_env(), CONFIG_FILE=str(config_file), **env)
    return subprocess.run([str(REPO_ROOT / "run_train.sh"), *args], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=SUBPROCESS_TIMEOUT_S)


@pytest.mark.slow
def test_run_train_sh_trains_and_fills_the_run_folder(tmp_path, tiny_ckpt, synthetic_dir):
    done = run_train_sh(tiny_run_args(tiny_ckpt, synthetic_dir, tmp_path, "launched") + ["--metrics.tensorboard=true"],
                        DEBUG_TOML, cwd=tmp_path)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-6000:]
    run_dir = tmp_path / "launched"
    assert sorted(read_metrics(run_dir)) == [1, 2]
    assert load_config(["--job.config_file", str(run_dir / "config.toml")]).data.prompts_per_step == 2
    with Image.open(run_dir / "metrics.png") as plot:
        assert plot.size[0] > 100
    assert list((run_dir / "tb").glob("events.out.tfevents.*"))


@pytest.mark.slow
def test_run_train_sh_names_a_mistyped_key_and_its_file(tmp_path):
    config = tmp_path / "typo.toml"
    config.write_text(DEBUG_TOML.read_text().replace("\nlr = ", "\nlearning_rate = "))
    done = run_train_sh([], config, cwd=tmp_path)
    assert done.returncode != 0
    assert "optimizer.learning_rate" in done.stderr + done.stdout
    assert str(config) in done.stderr + done.stdout


# ---- 5. decomposed runtime -----------------------------------------------------------------------------------------
def test_decomposed_mode_trains_like_serial_mode(tmp_path, tiny_ckpt, synthetic_dir, uneven_reward):
    """Same seed, same samples; prefix-once scoring gives the serial losses up to fp32 summation order, also with
    the overlapped schedule scoring the reference in the decode window."""
    runs = {}
    for name, flags in (("serial", ["--runtime.mode=serial"]), ("decomposed", ["--runtime.mode=decomposed"]),
                        ("window", ["--runtime.mode=overlapped", "--runtime.reference_in_window"])):
        argv = fast_args(tiny_ckpt, synthetic_dir, tmp_path, name, *flags, "--algorithm.kl_coef=0.05",
                         "--algorithm.micro_batch_size=4")
        Trainer(load_config(argv)).train()
        runs[name] = read_metrics(tmp_path / name)
    serial = runs["serial"]
    for step in (1, 2):
        for name in ("decomposed", "window"):
            run = runs[name]
            assert run[step]["reward/mean"] == serial[step]["reward/mean"]
            assert run[step]["tokens/prefix"] < serial[step]["tokens/prefix"]  # the prompt ran once, not 4 times
            for key in ("loss", "pg_loss", "grad_norm", "kl", "entropy"):
                assert run[step][key] == pytest.approx(serial[step][key], rel=1e-4, abs=1e-6), f"{name} {step} {key}"
    assert serial[2]["grad_norm"] > 0 and serial[2]["kl"] > 0
