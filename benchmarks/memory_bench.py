"""Measured memory of a colocated GRPO step under the phase-aware memory manager, against naive colocation.

    PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True python benchmarks/memory_bench.py --geometry 7B \
        --out outputs/memory_bench_7b.json                                                         # one H200
    OMP_NUM_THREADS=1 python benchmarks/memory_bench.py --geometry debug --prompts 2 --group 4 \
        --prompt-tokens 256 --response 16 --out /tmp/memory_bench_cpu.json                         # CPU
    python benchmarks/memory_bench.py --geometry 7B --plan-only        # the plan only, models on the meta device

Qwen2.5-VL geometry with random bf16 weights (built on meta, `to_empty`, `init_weights`): an actor with activation
checkpointing and a frozen reference, G samples per image-heavy prompt (`step_bench.make_prompt`). Whole steps run
through the executor (`StepRunner`, decomposed mode): real rollout (`RolloutEngine`), reference scoring, PPO
training, and the optimizer phase of `MasterWeights` (bf16 module weights and gradients, fp32 master weights and
fp32 AdamW), whose AdamW state is streamed through the device chunk by chunk.

Groups: actor weights and fp32 master weights stay on the device (the decode graph keeps the actor's addresses); the
reference weights (frozen: copied out once, then only freed) come in for "ref"; the AdamW state lives in pinned host
memory and is streamed in "optimizer", its first chunks prefetched during "train" as far as --budget-gib allows; the
plan keeps the leading chunks every phase has room for resident on the device (never copied; --max-resident-chunks 0
turns that off). Gradients, KV pool, workspaces and activations are transient estimates for the plan.

Reported: the plan (computed naive peak, planned peak per phase), the measured `max_memory_allocated` /
`max_memory_reserved` per phase of the last managed step next to it, and the step time managed vs the same step
with `NoTransferCopyEngine` (frees and zero-filled re-allocations, no host copies): their difference is what the
transfers add. Host-blocked time of the manager (entries + streams) is reported too, and the bytes copied per step
(host -> device and back) as planned and as the manager moved them.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import statistics
import sys
import time
from pathlib import Path

os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from memory_plan import LOGITS_CHUNK, layer_workspace_bytes, train_activation_bytes  # noqa: E402
from step_bench import NullTokenizer, bench_flavor, build, make_prompt  # noqa: E402

from torchplex.runtime.master_weights import MasterWeights  # noqa: E402
from torchplex.models.qwen2_5_vl.model import Qwen2_5_VLModel  # noqa: E402
from torchplex.models.qwen2_5_vl.parallelize import apply_activation_checkpointing  # noqa: E402
from torchplex.rollout.engine import PROMPT_BUCKET, RolloutEngine  # noqa: E402
from torchplex.rollout.kv_pool import GroupKVPool  # noqa: E402
from torchplex.rollout.sampling import SamplingParams  # noqa: E402
from benchmarks.bench_runtime import bench_config  # noqa: E402
from torchplex.runtime.build import build_step_runtime  # noqa: E402
from torchplex.runtime.memory import (GiB, MemoryManager, MemoryPlan, NoTransferCopyEngine, TensorGroup,  # noqa: E402
                                      ThreadCopyEngine, default_copy_engine, module_group)

PHASES = ["rollout", "ref", "train", "optimizer"]


def log(msg: str) -> None:
    print(f"[memory_bench {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def transient_estimates(args, a, prompt_tokens: int, vision_trainable: bool,
                        image_tokens: int | None = None) -> dict[str, tuple[str, int]]:
    """Bytes each phase allocates for itself (estimates for the plan; the run measures the real peaks). The train
    phase's is `memory_plan.train_activation_bytes` (checked on CPU by benchmarks/train_memory_probe.py): under
    decomposed scoring it is dominated by the suffix gradients autograd holds for the weights the prefix shares."""
    t = args.text
    kv_dim = t.num_kv_heads * t.head_dim
    groups = max(1, min(a.prompts, a.max_batch // a.group))
    kv = groups * GroupKVPool.group_bytes(t.num_layers, t.num_kv_heads, t.head_dim, a.group,
                                          -(-prompt_tokens // PROMPT_BUCKET) * PROMPT_BUCKET, a.response, torch.bfloat16)
    work = layer_workspace_bytes(t.hidden_size, kv_dim, t.intermediate_size)
    mb_prompts = max(1, a.micro_batch // a.group)  # whole groups per micro-batch: one prefix, G suffixes
    prefix, suffix = mb_prompts * prompt_tokens, mb_prompts * a.group * a.response
    logits = 2 * LOGITS_CHUNK * t.vocab_size * 4
    train = train_activation_bytes(args, prompt_tokens=prompt_tokens, group=a.group, response=a.response,
                                   micro_batch=a.micro_batch, checkpointing=a.activation_checkpointing,
                                   vision_trainable=vision_trainable, image_tokens=image_tokens)
    return {"kv_pool": ("rollout", kv),
            "prefill_workspace": ("rollout", min(16384, a.prompts * prompt_tokens) * work),
            "ref_workspace": ("ref", prefix * t.num_layers * 2 * kv_dim * 2 + max(prefix, suffix) * work + logits),
            "train_activations": ("train", train["total"])}


def plan_summary(plan: MemoryPlan) -> dict:
    """The plan's streamed-state numbers: resident chunks, bytes copied per step, exposed bytes (GiB)."""
    state = next(g for g in plan.groups if g.name == "optimizer_state")
    return {"resident_chunks": state.resident_chunks, "state_chunks": len(state.chunk_nbytes),
            "resident_gib": state.resident_bytes / GiB, "copy_in_gib": plan.copy_in_bytes / GiB,
            "copy_out_gib": plan.copy_out_bytes / GiB,
            "exposed_gib": sum(r.exposed_bytes for r in plan.phases) / GiB,
            "train_prefetch_chunks": plan.phase("train").prefetch_chunks.get("optimizer_state", 0),
            "peak_gib": {r.phase: r.peak_bytes / GiB for r in plan.phases}}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--geometry", default="7B", help="a flavor of torchplex.models.qwen2_5_vl.args (debug on CPU)")
    p.add_argument("--prompts", type=int, default=4)
    p.add_argument("--group", type=int, default=8, help="G samples per prompt")
    p.add_argument("--prompt-tokens", type=int, default=1024, help="tokens per image-heavy prompt")
    p.add_argument("--response", type=int, default=256, help="new tokens per sample (random weights: all of them)")
    p.add_argument("--micro-batch", type=int, default=8, help="sequences per training micro-batch")
    p.add_argument("--max-batch", type=int, default=256, help="rollout sequences decoded at once")
    p.add_argument("--no-activation-checkpointing", dest="activation_checkpointing", action="store_false")
    p.add_argument("--freeze-vision", action="store_true", help="frozen vision tower shared by actor and reference")
    p.add_argument("--budget-gib", type=float, default=116.0, help="device budget the plan keeps under")
    p.add_argument("--chunk-gib", type=float, default=2.0, help="AdamW state per streamed chunk")
    p.add_argument("--stream-window", type=int, default=3, help="chunks of state on the device in steady state")
    p.add_argument("--max-resident-chunks", type=int, default=-1,
                   help="state chunks the plan may keep on the device throughout (-1: as many as fit, 0: none)")
    p.add_argument("--plan-only", action="store_true", help="build the models on the meta device, print the plan, "
                   "write it to --out and stop (no device needed)")
    p.add_argument("--copy-engine", default="auto", choices=("auto", "thread", "none"),
                   help="auto: CUDA copy streams on GPU, a copy thread on CPU; none: no transfers at all")
    p.add_argument("--eager-decode", action="store_true", help="no torch.compile / CUDA graph for decode")
    p.add_argument("--warmup", type=int, default=1, help="steps before timing (compile, lazy AdamW state)")
    p.add_argument("--steps", type=int, default=3, help="steps per block; all but a block's first are timed")
    p.add_argument("--blocks", type=int, default=1, help="blocks per copy engine, alternating")
    p.add_argument("--lr", type=float, default=1e-6)
    p.add_argument("--out", default="")
    p.add_argument("--watchdog-s", type=int, default=540, help="dump stacks and exit if still running")
    return p.parse_args(argv)


def finish(result: dict, out: str) -> dict:
    """Write the result JSON (when asked) and stop the watchdog."""
    if out:
        Path(out).parent.mkdir(parents=True, exist_ok=True)
        Path(out).write_text(json.dumps(result, indent=2))
        log(f"wrote {out}")
    faulthandler.cancel_dump_traceback_later()
    return result


def main(argv=None) -> dict:
    a = parse_args(argv)
    faulthandler.dump_traceback_later(a.watchdog_s, exit=True)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    args = bench_flavor(a.geometry)
    dtype = torch.bfloat16
    t0 = time.perf_counter()
    if a.plan_only:  # sizes only: nothing is allocated (AdamW unfused on meta: no 4-byte step counters per tensor)
        device = torch.device("meta")
        with device:
            actor, reference = Qwen2_5_VLModel(args).to(dtype), Qwen2_5_VLModel(args).to(dtype)
        reference.eval().requires_grad_(False)
    else:
        actor = build(args, dtype, device, 0)
        reference = build(args, dtype, device, 1).eval().requires_grad_(False)
    if a.freeze_vision:
        actor.visual.requires_grad_(False)
        reference.visual = actor.visual
    if a.activation_checkpointing and not a.plan_only:
        apply_activation_checkpointing(actor)
    master = MasterWeights(actor.parameters(), chunk_bytes=int(a.chunk_gib * GiB), lr=a.lr)
    prompts = [make_prompt(args, a.prompt_tokens, seed=i) for i in range(a.prompts)]
    prompt_tokens = max(len(p.input_ids) for p in prompts)
    image_tokens = max(int((p.input_ids == args.image_token_id).sum()) for p in prompts)
    estimates = transient_estimates(args, a, prompt_tokens, any(p.requires_grad for p in actor.visual.parameters()),
                                    image_tokens)
    if not a.plan_only:
        engine = RolloutEngine(actor, kv_pool_bytes=estimates["kv_pool"][1] + 2**26, max_batch=a.max_batch,
                               compile_decode=device.type == "cuda" and not a.eager_decode)
    log(f"built {a.geometry} actor + reference + fp32 master ({len(master.chunks)} state chunks) on {device} "
        f"in {time.perf_counter() - t0:.1f}s")

    groups = [module_group("actor_weights", actor, PHASES),
              master.master_group(needed_in=PHASES),
              module_group("ref_weights", reference, {"ref"}, exclude=actor.parameters(), frozen=True),
              master.grads_group(),
              master.state_group(),
              TensorGroup("optimizer_workspace", frozenset({"optimizer"}), "transient",
                          nbytes=master.workspace_bytes())]
    groups += [TensorGroup(name, frozenset({phase}), "transient", nbytes=b) for name, (phase, b) in estimates.items()]
    # the rollout's fused q/k/v copy (RolloutEngine.fused_qkv, on by default on CUDA): on the device in every phase
    if a.plan_only or engine.fused_qkv:
        qkv_bytes = sum(t.numel() * t.element_size() for layer in actor.layers
                        for m in (layer.attention.wq, layer.attention.wk, layer.attention.wv) for t in (m.weight, m.bias))
        groups.append(TensorGroup("decode_qkv_copy", frozenset(PHASES), "transient", nbytes=qkv_bytes))
    budget = int(a.budget_gib * GiB)
    plan = MemoryPlan.build(groups, PHASES, budget_bytes=budget, stream_window=a.stream_window,
                            max_resident_chunks=None if a.max_resident_chunks < 0 else a.max_resident_chunks)
    print(plan, flush=True)
    planned = plan_summary(plan)
    log(f"plan: {planned['resident_chunks']} of {planned['state_chunks']} state chunks resident "
        f"({planned['resident_gib']:.2f} GiB); copied per step {planned['copy_in_gib']:.2f} GiB in, "
        f"{planned['copy_out_gib']:.2f} GiB out; exposed {planned['exposed_gib']:.2f} GiB")
    if a.plan_only:
        result = {"info": {"prompt_tokens": prompt_tokens, "image_tokens": image_tokens, **vars(a)},
                  "naive_peak_gib": plan.naive_peak_bytes / GiB, "plan_peak_gib": plan.peak_bytes / GiB,
                  "planned": planned, "plan": plan.to_dict(), "plan_table": str(plan)}
        return finish(result, a.out)
    copy_engine = {"auto": default_copy_engine(device) if device.type == "cuda" else ThreadCopyEngine(),
                   "thread": ThreadCopyEngine(), "none": NoTransferCopyEngine()}[a.copy_engine]
    manager = MemoryManager(plan, groups, device, engine=copy_engine)
    master.memory = manager
    host_s = manager.reserve_host()
    host_gib = sum(arena.nbytes for arena in manager._arenas.values()) / GiB
    log(f"host buffers: {host_gib:.2f} GiB ({'pinned' if copy_engine.pin_memory else 'pageable'}) in {host_s:.1f}s")

    runner = build_step_runtime(bench_config("decomposed", micro_batch=a.micro_batch), actor, reference, engine,
                                master, None, NullTokenizer(), memory=manager)
    optimizer_s = []
    plain_step = master.step

    def stream_sync():  # the compute stream only: the manager's copy streams run on (as in a training loop)
        if device.type == "cuda":
            torch.cuda.current_stream(device).synchronize()

    def timed_step():  # the optimizer phase's own time (inside "train" on the executor's timeline)
        stream_sync()
        start = time.perf_counter()
        plain_step()
        stream_sync()
        optimizer_s.append(time.perf_counter() - start)

    master.step = timed_step

    def run_block(copy, first_seed: int, steps: int) -> list[dict]:
        """steps + 1 consecutive steps with one copy engine; step k's time is the interval between the starts of
        steps k and k+1, so copies still running at a step's end (optimizer state going back to the host) overlap
        the next step's rollout as they do in a training loop, and are charged where they block."""
        manager.synchronize()  # the previous engine's copies land before another engine takes over
        manager.engine = copy
        rows, starts = [], []
        for i in range(steps + 1):
            stream_sync()
            starts.append(time.perf_counter())
            if rows:
                rows[-1]["step_s"] = starts[-1] - starts[-2]
            if i == steps:
                break
            params = SamplingParams(n=a.group, temperature=1.0, max_new_tokens=a.response, seed=first_seed + i)
            out = runner.run(prompts, [""] * len(prompts), params)
            records = manager.records[-len(PHASES):]
            phases = {k: out.timeline.total_s(k) for k in ("vision", "rollout", "ref", "train")}
            phases["optimizer"] = optimizer_s[-1]
            rows.append({"phase_s": phases, "records": records,
                         "host_blocked_s": sum(r.wait_s + r.stream_wait_s for r in records),
                         "copy_in_gib": sum(r.copy_in_bytes for r in records) / GiB,
                         "copy_out_gib": sum(r.copy_out_bytes for r in records) / GiB,
                         "tokens": int(out.experience.lengths.sum())})
        return rows

    no_transfer = NoTransferCopyEngine()
    for r in run_block(copy_engine, 0, a.warmup):
        log(f"warm-up step: {r['step_s']:.2f}s")
    managed, baseline = [], []
    for rep in range(a.blocks):  # alternating blocks, so drift (clocks, allocator state) hits both alike
        # A block's first step starts with every copy landed; steady state is the steps after it.
        managed += run_block(copy_engine, 100 + 10 * rep, a.steps)[1:]
        baseline += run_block(no_transfer, 200 + 10 * rep, a.steps)[1:]
        log(f"block {rep}: managed {[round(r['step_s'], 2) for r in managed[-(a.steps - 1):]]}s, no-transfer "
            f"{[round(r['step_s'], 2) for r in baseline[-(a.steps - 1):]]}s, host-blocked "
            f"{managed[-1]['host_blocked_s'] * 1e3:.0f}ms")
    manager.synchronize()

    last = managed[-1]["records"]
    gib = lambda b: None if b is None else b / GiB
    per_phase = []
    for rec in last:
        row = plan.phase(rec.phase)
        measured = rec.measured_peak_bytes
        per_phase.append({
            "phase": rec.phase, "plan_gib": gib(row.peak_bytes), "naive_plan_gib": gib(row.naive_bytes),
            "tracked_gib": gib(rec.tracked_bytes), "allocated_gib": gib(measured),
            "reserved_gib": gib(rec.measured_reserved_bytes),
            # naive colocation with this phase's measured transients in place of the plan's estimates
            "naive_measured_gib": None if measured is None else gib(row.naive_bytes + measured - rec.tracked_bytes),
            "enter_wait_ms": rec.wait_s * 1e3, "stream_wait_ms": rec.stream_wait_s * 1e3,
            "chunks_streamed": rec.chunks_streamed, "copy_in_gib": gib(rec.copy_in_bytes),
            "copy_out_gib": gib(rec.copy_out_bytes), "plan_copy_in_gib": gib(row.copy_in_bytes),
            "plan_copy_out_gib": gib(row.copy_out_bytes)})
    print(f"\n{'phase':<11}{'plan':>8}{'naive':>8}{'tracked':>9}{'alloc':>8}{'reserved':>9}{'wait ms':>9}"
          f"{'stream ms':>10}{'in GiB':>8}{'out GiB':>8}")
    fmt = lambda x: "-" if x is None else f"{x:.2f}"
    for r in per_phase:
        print(f"{r['phase']:<11}{fmt(r['plan_gib']):>8}{fmt(r['naive_plan_gib']):>8}{fmt(r['tracked_gib']):>9}"
              f"{fmt(r['allocated_gib']):>8}{fmt(r['reserved_gib']):>9}{r['enter_wait_ms']:>9.1f}"
              f"{r['stream_wait_ms']:>10.1f}{fmt(r['copy_in_gib']):>8}{fmt(r['copy_out_gib']):>8}")
    med = lambda rows, key: statistics.median(r[key] for r in rows)
    step_managed, step_baseline = med(managed, "step_s"), med(baseline, "step_s")
    measured_alloc = [r["allocated_gib"] for r in per_phase if r["allocated_gib"] is not None]
    naive_measured = [r["naive_measured_gib"] for r in per_phase if r["naive_measured_gib"] is not None]
    result = {
        "info": {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
                 "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"), "prompt_tokens": prompt_tokens,
                 "copy_engine": type(copy_engine).__name__, "state_chunks": len(master.chunks),
                 "alloc_conf": os.environ.get("PYTORCH_CUDA_ALLOC_CONF"), **vars(a)},
        "precision": "bf16 module weights and gradients, fp32 master weights, fp32 AdamW moments",
        "naive_peak_gib": gib(plan.naive_peak_bytes),  # computed: every weight and optimizer tensor resident
        "naive_measured_gib": max(naive_measured) if naive_measured else None,
        "plan_peak_gib": gib(plan.peak_bytes), "plan_floor_gib": gib(plan.floor_bytes),
        "budget_gib": a.budget_gib, "host_buffers_gib": host_gib, "host_reserve_s": host_s,
        "measured_peak_allocated_gib": max(measured_alloc) if measured_alloc else None,
        "measured_peak_reserved_gib": max((r["reserved_gib"] for r in per_phase if r["reserved_gib"] is not None),
                                          default=None),
        "per_phase": per_phase,
        "step_s": {"managed": step_managed, "no_transfer": step_baseline,
                   "managed_all": [r["step_s"] for r in managed], "no_transfer_all": [r["step_s"] for r in baseline]},
        # what the host transfers add to the step: managed vs the same step without copies
        "transfer_overhead_fraction": (step_managed - step_baseline) / step_baseline,
        "host_blocked_s": med(managed, "host_blocked_s"),
        # the plan's resident chunks and bytes copied per step, and what the manager moved in the last managed step
        "planned": planned,
        "copied_per_step_gib": {"plan_in": planned["copy_in_gib"], "plan_out": planned["copy_out_gib"],
                                "measured_in": managed[-1]["copy_in_gib"], "measured_out": managed[-1]["copy_out_gib"]},
        "phase_s": {"managed": managed[-1]["phase_s"], "no_transfer": baseline[-1]["phase_s"]},
        "plan": plan.to_dict(), "plan_table": str(plan),
    }
    log(f"naive {result['naive_peak_gib']:.1f} GiB (computed), plan {result['plan_peak_gib']:.1f} GiB, measured "
        f"allocated {fmt(result['measured_peak_allocated_gib'])} GiB; step {step_managed:.2f}s managed vs "
        f"{step_baseline:.2f}s without transfers ({100 * result['transfer_overhead_fraction']:+.1f}%); copied "
        f"{managed[-1]['copy_in_gib']:.2f} GiB in, {managed[-1]['copy_out_gib']:.2f} GiB out per step "
        f"({planned['resident_chunks']} of {planned['state_chunks']} state chunks resident)")
    return finish(result, a.out)


if __name__ == "__main__":
    main()
