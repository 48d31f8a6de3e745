"""Colocated vs disaggregated synchronous GRPO on the same GPUs, side by side in one launch (2 ranks).

    OMP_NUM_THREADS=1 torchrun --nproc-per-node 2 benchmarks/disagg_bench.py --device cpu --backend gloo \
        --geometry debug                                                                          # CPU, ~1 min
    torchrun --nproc-per-node 2 benchmarks/disagg_bench.py --out disagg.json                        # 2 H200s

The same steps in every layout: the same prompts (image-heavy, ~--prompt-tokens each), G samples of exactly
--max-new tokens (no stop token), the same per-step sample seeds (keyed on the prompt's global index, as the
trainer does), a frozen reference model and one PPO epoch; weights are random (built on meta, materialised,
seeded init), bf16 on GPU.

  colocated_fsdp       each rank holds actor + reference + rollout engine and takes half the prompts; FSDP2 over
                       the 2 ranks through parallelize_qwen2_5_vl, as the trainer does for dp_shard=2, tp=1 (so,
                       like the trainer, no CUDA-graph decode: FSDP's gathers cannot live inside one).
  colocated_replicate  the same, but each rank holds whole weights and gradients are averaged over the ranks after
                       each backward (DDP-style): decode replays a CUDA graph. Colocation at its best here.
  disaggregated        rank 0 rolls out every prompt on its own copy of the weights; rank 1 scores and trains
                       every sample, then broadcasts each updated parameter (bucketed) back to rank 0; rank 0
                       broadcasts the sampled tokens/log-probs to rank 1 (benchmarks/disaggregation.py).
                       Rollout k+1 waits for the weights of step k.
Colocated layouts run their steps in "serial" and "overlapped" runtime modes alternately (StepRunner); the
disaggregated trainer runs --disagg-trainer mode (default decomposed: the overlapped schedule minus what needs the
rollout on the same GPU). Reported: median step time after --warmup steps (per step the slowest rank), phases,
weight and token transfer times, and colocated/disaggregated step-time ratios (> 1: disaggregation is faster).
The JSON is rewritten after every layout, so a run cut short still leaves the layouts it finished.
"""

from __future__ import annotations

import argparse
import faulthandler
import gc
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.step_bench import NullTokenizer, bench_flavor, build, make_prompt, sync  # noqa: E402
from torchplex.components import peak_memory  # noqa: E402
from torchplex.components.optim import build_optimizer  # noqa: E402
from torchplex.distributed.mesh import build_parallel_dims, finish_distributed, init_distributed  # noqa: E402
from torchplex.models.qwen2_5_vl.parallelize import parallelize_qwen2_5_vl  # noqa: E402
from torchplex.rollout.engine import RolloutEngine  # noqa: E402
from torchplex.rollout.sampling import SamplingParams, sample_seeds as seeds_of  # noqa: E402
from benchmarks.disaggregation import RemoteRollout, WeightTransfer, send_outputs  # noqa: E402
from benchmarks.bench_runtime import bench_config  # noqa: E402
from torchplex.runtime.build import build_step_runtime  # noqa: E402

ROLLOUT_RANK, TRAINER_RANK = 0, 1
PHASES = ("vision", "rollout", "ref", "train")
# The headline pair first: a run cut short by the watchdog still leaves it in the JSON.
LAYOUTS = ("disaggregated", "colocated_replicate", "colocated_fsdp")


def log(msg: str) -> None:
    print(f"[rank {dist.get_rank()} {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def sample_seeds(step: int, group: int, global_indices: list[int]) -> list[list[int]]:
    """Per-sample seeds keyed on (step, the prompt's global index), as Trainer.sample_seeds: a prompt draws the same
    samples in every layout. The seed goes in as data, not in SamplingParams: the engine recaptures its decode
    graph whenever the SamplingParams change."""
    return seeds_of(step * 1009, group, global_indices)


def fingerprint(tensors) -> list[int]:
    """An exact integer checksum per tensor over its bits (position-weighted), computed on the device."""
    out = []
    for t in tensors:
        bits = t.detach().contiguous().view(-1).view({1: torch.int8, 2: torch.int16, 4: torch.int32,
                                                      8: torch.int64}[t.element_size()]).to(torch.int64)
        weight = torch.arange(bits.numel(), device=bits.device) % 65521 + 1
        out.append(int((bits * weight).sum()))
    return out


def trainable_named(model, freeze_vision: bool) -> list[tuple[str, torch.Tensor]]:
    """What the trainer's optimizer changes, in a fixed order both disaggregated ranks derive alike."""
    return [(n, p) for n, p in model.named_parameters() if not (freeze_vision and n.startswith("visual."))]


class ReplicaGradSync:
    """DDP-style data parallelism without a module wrapper (the scorers call prefix_forward/suffix_forward, not
    forward): each rank holds the whole model, and after every backward each parameter's accumulated gradient is
    averaged over the group. Averaging the running sum after each micro-batch is exact for accumulation (the part
    already averaged is the same on every rank), so no hook at the end of accumulation is needed. train_phase
    scales each loss by dp_size, which the averaging undoes, as FSDP2's does."""

    def __init__(self, model, group):
        self.group, self.world = group, dist.get_world_size(group)
        self.handles = [p.register_post_accumulate_grad_hook(self._average)
                        for p in model.parameters() if p.requires_grad]

    def _average(self, p: torch.Tensor) -> None:
        p.grad.div_(self.world)
        dist.all_reduce(p.grad, group=self.group)

    def remove(self) -> None:
        for h in self.handles:
            h.remove()


def step_config(a, mode: str):
    return bench_config(mode, micro_batch=a.micro_batch)


def build_pair(a, margs, dtype, device):
    """Actor (seed 0) and frozen reference (seed 1), whole and materialised: identical on every rank and layout."""
    actor = build(margs, dtype, device, 0)
    reference = build(margs, dtype, device, 1).eval().requires_grad_(False)
    if a.freeze_vision:
        actor.visual.requires_grad_(False)
    return actor, reference


def summarise(rows: list[dict]) -> dict:
    """rows: per step, per rank dicts of seconds -> medians over steps of the slowest rank."""
    keys = rows[0][0].keys()
    return {k: statistics.median(max(r[k] for r in ranks) for ranks in rows) for k in keys}


def run_colocated(a, dp: str, margs, prompts, params, dtype, device) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    actor, reference = build_pair(a, margs, dtype, device)
    grad_sync = None
    if dp == "fsdp":
        # Sharding materialised modules: each rank keeps its chunk of the same seeded weights, so every layout
        # starts from identical parameters (a sharded init would draw different numbers).
        dims = build_parallel_dims(world, 1, world)
        for m in (actor, reference):
            parallelize_qwen2_5_vl(m, dims, param_dtype=dtype, reduce_dtype=torch.float32,
                                   freeze_vision=a.freeze_vision and m is actor)
        dp_group = dims.dp_mesh.get_group()
        compile_decode = False  # as the trainer: FSDP2's all-gathers cannot live inside a captured graph
    else:
        dp_group = dist.group.WORLD
        grad_sync = ReplicaGradSync(actor, dp_group)
        compile_decode = device.type == "cuda"
    if a.freeze_vision:
        reference.visual = actor.visual
    optimizer = build_optimizer(actor, "adamw", a.lr)
    engine = RolloutEngine(actor, kv_pool_bytes=int(a.kv_pool_gib * 2**30), compile_decode=compile_decode)
    if not a.colocated_release_kv:
        # StepRunner releases the KV pool after every rollout, and the engine then captures (and compiles) its
        # decode step again on the next one; the disaggregated rollout rank keeps its pool, so by default the
        # colocated layouts keep theirs too (the memory is there on an H200 at these sizes).
        engine.release = lambda: None
    mine = list(range(rank, len(prompts), world))  # the trainer's dp_rank::dp_size share
    local = [prompts[i] for i in mine]
    runners = {m: build_step_runtime(step_config(a, m), actor, reference, engine, optimizer, None, NullTokenizer(),
                                     dp_size=world, dp_group=dp_group) for m in a.colocated_modes}
    rows = {m: [] for m in runners}
    first_tokens = None
    for step in range(a.warmup + a.steps):
        for mode, runner in runners.items():
            sync(device)
            t0 = time.perf_counter()
            out = runner.run(local, [""] * len(local), params, sample_seeds=sample_seeds(step, params.n, mine))
            sync(device)
            row = {"step_s": time.perf_counter() - t0, **{p: out.timeline.total_s(p) for p in PHASES}}
            gathered = [None] * world
            dist.all_gather_object(gathered, (mine, out.experience.tokens.tolist(), row))
            if first_tokens is None:  # the first step from the shared initial weights, in prompt order
                by_prompt = {i: toks[k * params.n:(k + 1) * params.n] for idx, toks, _ in gathered
                             for k, i in enumerate(idx)}
                first_tokens = [t for i in range(len(prompts)) for t in by_prompt[i]]
            if step >= a.warmup:
                rows[mode].append([r for _, _, r in gathered])
            if rank == 0:
                log(f"colocated_{dp} {mode} step {step}{' (warm-up)' if step < a.warmup else ''}: "
                    f"{max(r['step_s'] for _, _, r in gathered):.2f} s  "
                    + " ".join(f"{p} {row[p]:.2f}" for p in PHASES if row[p]))
    if grad_sync is not None:
        grad_sync.remove()
    result = {m: summarise(r) for m, r in rows.items()}
    if dp == "replicate":  # the replicas must still hold the same bits after every step's averaged update
        prints = [None] * world
        dist.all_gather_object(prints, fingerprint(actor.parameters()))
        result["replicas_equal"] = all(p == prints[0] for p in prints)
    result["first_step_tokens"] = first_tokens
    result["decode_cuda_graph"] = engine.use_graphs
    return result


def run_disaggregated(a, margs, prompts, params, dtype, device) -> dict:
    rank = dist.get_rank()
    everyone = list(range(len(prompts)))
    check_steps = {a.warmup + a.steps - 1, 0}
    rows, checks, first_tokens = [], [], None
    if rank == ROLLOUT_RANK:
        model = build(margs, dtype, device, 0).eval().requires_grad_(False)
        engine = RolloutEngine(model, kv_pool_bytes=int(a.kv_pool_gib * 2**30), compile_decode=device.type == "cuda")
        transfer = WeightTransfer(trainable_named(model, a.freeze_vision), src=TRAINER_RANK,
                                  bucket_bytes=int(a.bucket_mib * 2**20))
        for step in range(a.warmup + a.steps):
            sync(device)
            t0 = time.perf_counter()
            # The pool is kept between steps (nothing else needs the memory here); releasing it would also make the
            # engine capture its decode graph again on the next step.
            outputs = engine.generate(prompts, params, sample_seeds=sample_seeds(step, params.n, everyone))
            sync(device)
            rollout_s = time.perf_counter() - t0
            tokens = send_outputs(outputs, params.max_new_tokens, src=ROLLOUT_RANK, device=device)
            weights = transfer.run()  # waits for the trainer's step, then receives
            row = {"step_s": time.perf_counter() - t0, "rollout": rollout_s, "tokens_send": tokens.seconds,
                   "weights_wait_and_recv": weights.seconds}
            if first_tokens is None:
                first_tokens = [o.token_ids for group in outputs for o in group]
            if step in check_steps:
                checks.append(fingerprint(transfer.tensors))
            rows.append(row)
            log(f"disaggregated rollout step {step}: {row['step_s']:.2f} s  rollout {rollout_s:.2f}  "
                f"tokens {tokens.seconds * 1e3:.1f} ms  weights wait+recv {weights.seconds:.2f}")
        info = {"transfer_bytes": transfer.total_bytes, "buckets": len(transfer.buckets),
                "decode_cuda_graph": engine.use_graphs}
    else:
        actor, reference = build_pair(a, margs, dtype, device)
        if a.freeze_vision:
            reference.visual = actor.visual
        optimizer = build_optimizer(actor, "adamw", a.lr)
        remote = RemoteRollout(src=ROLLOUT_RANK, device=device)
        runner = build_step_runtime(step_config(a, a.disagg_trainer), actor, reference, remote, optimizer, None,
                                    NullTokenizer())
        transfer = WeightTransfer(trainable_named(actor, a.freeze_vision), src=TRAINER_RANK,
                                  bucket_bytes=int(a.bucket_mib * 2**20))
        initial = fingerprint(transfer.tensors)
        for step in range(a.warmup + a.steps):
            sync(device)
            t0 = time.perf_counter()
            out = runner.run(prompts, [""] * len(prompts), params, sample_seeds=sample_seeds(step, params.n, everyone))
            sync(device)
            weights = transfer.run()
            row = {"step_s": time.perf_counter() - t0, "wait_rollout": remote.last_wait_s,
                   **{p: out.timeline.total_s(p) for p in ("vision", "ref", "train")}, "weights_send": weights.seconds}
            if step in check_steps:
                checks.append(fingerprint(transfer.tensors))
            rows.append(row)
            log(f"disaggregated trainer step {step}: {row['step_s']:.2f} s  wait rollout {remote.last_wait_s:.2f}  "
                f"ref {row['ref']:.2f}  train {row['train']:.2f}  weights send {weights.seconds:.3f} "
                f"({transfer.total_bytes / 2**30:.2f} GiB, {transfer.total_bytes / 2**30 / weights.seconds:.1f} GiB/s)")
        info = {"initial_fingerprint": initial}
    gathered = [None] * 2
    dist.all_gather_object(gathered, (rows, checks, first_tokens, info))
    (roll_rows, roll_checks, first_tokens, roll_info), (train_rows, train_checks, _, train_info) = gathered
    timed = slice(a.warmup, None)
    med = lambda rs, k: statistics.median(r[k] for r in rs[timed])
    return {
        # Synchronous: both ranks see the same step period; the trainer's clock includes the weight send.
        "step_s": statistics.median(max(r["step_s"], t["step_s"]) for r, t in zip(roll_rows[timed], train_rows[timed])),
        "rollout_rank": {k: med(roll_rows, k) for k in roll_rows[0]},
        "trainer_rank": {k: med(train_rows, k) for k in train_rows[0]},
        "weight_transfer_s": med(train_rows, "weights_send"),
        # Fractions of the step each GPU computes; the rest it waits for the other one.
        "busy_fraction": {"rollout_rank": med(roll_rows, "rollout") / med(roll_rows, "step_s"),
                          "trainer_rank": sum(med(train_rows, k) for k in ("vision", "ref", "train"))
                          / med(train_rows, "step_s")},
        "weight_transfer_gib": roll_info["transfer_bytes"] / 2**30,
        "weight_buckets": roll_info["buckets"],
        "decode_cuda_graph": roll_info["decode_cuda_graph"],
        # Bitwise equality of the transferred weights, trainer vs rollout rank, after the first and last steps.
        "weights_equal_after_transfer": [r == t for r, t in zip(roll_checks, train_checks)],
        "weights_changed_by_step_0": train_checks[0] != train_info["initial_fingerprint"],
        "first_step_tokens": first_tokens,
    }


def free(device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    dist.barrier()


def compare(result: dict) -> None:
    """Ratios colocated/disaggregated step time, and agreement of the first step's sampled tokens."""
    dis = result.get("disaggregated")
    if dis is None:
        return
    for name in ("colocated_fsdp", "colocated_replicate"):
        if name not in result:
            continue
        col = result[name]
        modes = [m for m in col if isinstance(col[m], dict)]
        result.setdefault("ratio_colocated_over_disaggregated", {})[name] = {
            m: col[m]["step_s"] / dis["step_s"] for m in modes}
        # The inverse is the speedup of colocation, the direction of the 1.57-2.24x reported for the idea.
        result.setdefault("speedup_of_colocated", {})[name] = {m: dis["step_s"] / col[m]["step_s"] for m in modes}
        a, b = col["first_step_tokens"], dis["first_step_tokens"]
        same = sum(x == y for r, s in zip(a, b) for x, y in zip(r, s))
        result.setdefault("first_step_token_agreement", {})[name] = same / max(1, sum(len(r) for r in a))


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu", choices=["cuda", "cpu"])
    ap.add_argument("--backend", default=None, help="nccl on cuda, gloo on cpu by default")
    ap.add_argument("--geometry", default=None, help="3B on cuda, debug on cpu by default")
    ap.add_argument("--dtype", default=None, choices=["float32", "bfloat16"], help="bf16 on cuda, fp32 on cpu")
    ap.add_argument("--layouts", default=",".join(LAYOUTS))
    ap.add_argument("--colocated-modes", default="serial,overlapped")
    ap.add_argument("--disagg-trainer", default="decomposed", choices=["serial", "decomposed"])
    ap.add_argument("--prompts", type=int, default=None, help="8 on cuda, 2 on cpu by default")
    ap.add_argument("--prompt-tokens", type=int, default=None, help="1024 on cuda, 128 on cpu by default")
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--max-new", type=int, default=None, help="256 on cuda, 16 on cpu by default")
    ap.add_argument("--micro-batch", type=int, default=8,
                    help="at most this many sequences per micro-batch (algorithm.micro_batch_size; 0: no bound)")
    ap.add_argument("--lr", type=float, default=1e-6)
    ap.add_argument("--freeze-vision", action="store_true")
    ap.add_argument("--kv-pool-gib", type=float, default=None, help="8 on cuda, 0.25 on cpu by default")
    ap.add_argument("--colocated-release-kv", action="store_true",
                    help="colocated: give the KV pool back after each rollout, as the trainer does")
    ap.add_argument("--bucket-mib", type=float, default=256)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--record-tokens", action="store_true", help="keep the first step's tokens in the JSON")
    ap.add_argument("--out", default="")
    ap.add_argument("--watchdog-s", type=int, default=480, help="dump stacks and exit if still running")
    a = ap.parse_args(argv)
    faulthandler.dump_traceback_later(a.watchdog_s, exit=True)
    gpu = a.device == "cuda"
    a.geometry = a.geometry or ("3B" if gpu else "debug")
    a.dtype = a.dtype or ("bfloat16" if gpu else "float32")
    a.max_new = a.max_new or (256 if gpu else 16)
    a.prompts = a.prompts or (8 if gpu else 2)
    a.prompt_tokens = a.prompt_tokens or (1024 if gpu else 128)
    a.kv_pool_gib = a.kv_pool_gib or (8.0 if gpu else 0.25)
    a.colocated_modes = a.colocated_modes.split(",")
    layouts = a.layouts.split(",")
    if unknown := set(layouts) - set(LAYOUTS):
        raise SystemExit(f"unknown layouts {sorted(unknown)}; choose from {LAYOUTS}")

    rank, world, device = init_distributed(a.backend or ("nccl" if gpu else "gloo"))
    if not gpu:
        device = torch.device("cpu")
    if world != 2:
        raise SystemExit(f"disagg_bench runs on exactly 2 ranks (torchrun --nproc-per-node 2), got {world}")
    log(f"NCCL_NVLS_ENABLE={os.environ.get('NCCL_NVLS_ENABLE')} device {device} geometry {a.geometry} {a.dtype}")
    dtype = getattr(torch, a.dtype)
    margs = bench_flavor(a.geometry)
    prompts = [make_prompt(margs, a.prompt_tokens, seed=i) for i in range(a.prompts)]
    params = SamplingParams(n=a.group, temperature=1.0, max_new_tokens=a.max_new, seed=0)

    result = {"info": {"device": torch.cuda.get_device_name(device) if gpu else "cpu", "world_size": world,
                       "torch": torch.__version__, "date": time.strftime("%Y-%m-%d %H:%M"),
                       "prompt_tokens_each": len(prompts[0].input_ids),
                       "nccl_nvls_enable": os.environ.get("NCCL_NVLS_ENABLE"), **vars(a)}}
    for layout in layouts:
        log(f"layout {layout}")
        if gpu:
            peak_memory.reset_peak(device)
        if layout == "disaggregated":
            result[layout] = run_disaggregated(a, margs, prompts, params, dtype, device)
        else:
            result[layout] = run_colocated(a, layout.removeprefix("colocated_"), margs, prompts, params, dtype, device)
        peaks = [None] * world
        dist.all_gather_object(peaks, peak_memory.max_allocated(device) / 2**30 if gpu else 0.0)
        result[layout]["peak_gib_per_rank"] = peaks
        free(device)
        compare(result)
        if rank == 0:
            record = {k: v for k, v in result.items()}
            if not a.record_tokens:
                record = {k: ({kk: vv for kk, vv in v.items() if kk != "first_step_tokens"} if isinstance(v, dict)
                              else v) for k, v in record.items()}
            if a.out:
                Path(a.out).write_text(json.dumps(record, indent=2))
            log(f"after {layout}:\n" + json.dumps({k: v for k, v in record.items() if k != "info"}, indent=2))
    finish_distributed()


if __name__ == "__main__":
    main()
