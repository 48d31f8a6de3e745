"""MFU of the compute phases of a GRPO step (rollout prefill, vision tower, reference scoring, training), per mode.

Driven by `step_bench.py --mfu` (that script's flags say the workload):

    python benchmarks/step_bench.py --mfu --geometry 7B --dtype bfloat16 --prompts 32 --group 8 --response 1024 \
        --mean-response 256 --modes serial decomposed --out benchmarks/results/mfu-YYYYMMDD-img.json

The actor samples real rollouts first (the engine, stop tokens that end responses after ~--mean-response tokens), so
every phase runs on the lengths a step would see. A mode NAME-padded (serial-padded, decomposed-padded) scores on
rows padded to the longest instead of packed tokens, to measure packing in the same process. Then, per round and
mode, each phase runs alone between device synchronisations: the rollout prefill (the engine's own prefill, prompts
batched up to its token budget, the first token's logits), the vision tower over every prompt, the reference
log-probs and one training step (PPO forward + backward + AdamW at lr 0, so every round and mode scores the same
policy). FLOPs come from `torchplex.components.flops` for the tokens each phase processed; the peak is a dense bf16
8192^3 matmul timed in the same process. The rollout's sampling log-probs against the trainer's epoch-0 log-probs of
the same tokens give the log-prob mismatch (mean |diff| and k3 KL). `--profile-dir`: one more round of the first mode
under torch.profiler, with each phase's GPU time split into GEMMs, attention, elementwise/norm, reductions, copies
and host gaps.
"""

from __future__ import annotations

import statistics
import sys
import time
import traceback
from contextlib import contextmanager

import torch

from torchplex.components import peak_memory
from torchplex.components.flops import Flops, TRAIN_FACTOR, decomposed_flops, mfu, prefill_flops, serial_flops
from torchplex.components.flops import vision_flops
from torchplex.data.batching import collate, encode_visuals
from torchplex.rl.advantages import compute_advantages
from torchplex.rollout.engine import RolloutEngine
from torchplex.rollout.logprob_mismatch import mismatch_sums
from torchplex.rollout.sampling import SamplingParams
from torchplex.runtime.decomposition import DecomposedScorer
from torchplex.runtime.experience import Experience, padded_outputs
from torchplex.runtime.scoring import SerialScorer

PHASES = ("prefill", "vision", "reference", "train")


def sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def matmul_peak(device, n: int = 8192, reps: int = 10) -> float:
    """Dense bf16 matmul FLOP/s on this device: median of `reps` timed products of random n x n matrices (fp32 and
    a smaller n on the CPU, where it only keeps the MFU arithmetic defined)."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    n = n if device.type == "cuda" else 512
    a, b = torch.randn(n, n, device=device, dtype=dtype), torch.randn(n, n, device=device, dtype=dtype)
    times = []
    for i in range(reps + 3):
        sync(device)
        t = time.perf_counter()
        a @ b
        sync(device)
        if i >= 3:
            times.append(time.perf_counter() - t)
    return 2 * n ** 3 / statistics.median(times)


def grids_of(prompt) -> list[list[int]]:
    out = []
    for g in (prompt.image_grid_thw, prompt.video_grid_thw):
        if g is not None:
            out += g.tolist()
    return out


def rollout_experience(actor, prompts, group: int, max_new: int, stops: list[int], kv_pool_gib: float, device):
    """Sampled responses of the actor as an Experience (random rewards: the loss has a policy-gradient term)."""
    engine = RolloutEngine(actor, kv_pool_bytes=int(kv_pool_gib * 2**30), compile_decode=device.type == "cuda")
    params = SamplingParams(n=group, temperature=1.0, max_new_tokens=max_new, seed=0, stop_token_ids=stops)
    t = time.perf_counter()
    outputs = engine.generate(prompts, params)
    sync(device)
    rollout_s = time.perf_counter() - t
    flat = [o for g in outputs for o in g]
    tokens, sampling = padded_outputs(flat)
    rewards = torch.rand(len(flat), generator=torch.Generator().manual_seed(1))
    exp = Experience(prompts=prompts, answers=[""] * len(prompts), group_size=group, tokens=tokens.to(device),
                     lengths=torch.tensor([len(o.token_ids) for o in flat], device=device),
                     sampling_logprobs=sampling.to(device), finish_reasons=[o.finish_reason for o in flat],
                     texts=[""] * len(flat), rewards=rewards, reward_parts={}, correct=[False] * len(flat),
                     advantages=compute_advantages(rewards, group).to(device),
                     keep_groups=torch.ones(len(prompts), dtype=torch.bool))
    stats = {"rollout_s": rollout_s, "decode_s": engine.stats.decode_s, "decode_steps": engine.stats.decode_steps}
    del engine
    return exp, stats


def prefill_chunks(prompts, budget: int = 16384) -> list[list]:
    """The engine's prefill batches: prompts in order, as many as fit its token budget (at least one)."""
    chunks, take, left = [], [], budget
    for p in prompts:
        n = len(p.input_ids)
        if take and n > left:
            chunks.append(take)
            take, left = [], budget
        take.append(p)
        left -= n
    return chunks + [take] if take else chunks


@torch.no_grad()
def run_prefill(engine_like, prompts) -> None:
    for chunk in prefill_chunks(prompts):
        state = engine_like.default_prefill(chunk)
        engine_like.model.logits(state.last_hidden)


@torch.no_grad()
def run_vision(model, prompts) -> None:
    for chunk in prefill_chunks(prompts):
        encode_visuals(model, collate(model.args, chunk).to(next(model.parameters()).device))


def run_scoring(mode: str, actor, reference, optimizer, exp, mbs: int, device):
    """(reference seconds, train seconds, the experience with ref/old log-probs) for one mode. A mode ending in
    "-padded" runs the scorers' padded layout instead of packed tokens (the before side of packing, issue 19)."""
    from step_bench import run_mode

    pack = not mode.endswith("-padded")
    scorer, whole = ((SerialScorer(pack=pack), False) if base_mode(mode) == "serial"
                     else (DecomposedScorer(pack=pack), True))
    ref_s, train_s, _, exp = run_mode(scorer, actor, reference, optimizer, exp, mbs, whole, device)
    return ref_s, train_s, exp


def base_mode(mode: str) -> str:
    """serial or decomposed, for a mode name with or without its "-padded" variant."""
    return mode.removesuffix("-padded")


def phase_flops(args, exp: Experience, mode: str, vision_trains: bool) -> dict[str, Flops]:
    """Counted FLOPs of each phase for this mode on this experience."""
    prompts = exp.prompts
    lens = [len(p.input_ids) for p in prompts]
    grids = [grids_of(p) for p in prompts]
    lengths = exp.lengths.tolist()
    g = exp.group_size
    responses = [lengths[i * g:(i + 1) * g] for i in range(len(prompts))]
    if base_mode(mode) == "serial":
        fwd = serial_flops(args, lens, responses, grids)
    else:
        fwd = decomposed_flops(args, lens, responses, [x for gs in grids for x in gs])
    train = Flops(fwd.linear, fwd.attention, fwd.lm_head, 0.0).scaled(TRAIN_FACTOR)
    train.vision = fwd.vision * (TRAIN_FACTOR if vision_trains else 1)
    return {"prefill": prefill_flops(args, lens, [x for gs in grids for x in gs]),
            "vision": Flops(vision=vision_flops(args.vision, [x for gs in grids for x in gs])),
            "reference": fwd, "train": train}


def logprob_mismatch(exp: Experience) -> dict[str, float]:
    """Rollout (sampling) vs trainer (epoch-0, same weights) log-probs of the sampled tokens: mean |diff|, its max
    and the k3 estimate of KL(rollout || trainer) (torchplex.rollout.logprob_mismatch, as the trainer logs them)."""
    abs_sum, k3_sum, tokens = mismatch_sums(exp.sampling_logprobs, exp.old_logprobs, exp.mask)
    worst = (exp.old_logprobs - exp.sampling_logprobs)[exp.mask].abs().max().item()
    return {"mean_abs_diff": abs_sum / tokens, "max_abs_diff": worst, "k3_kl": k3_sum / tokens, "tokens": int(tokens)}


def kernel_category(name: str) -> str:
    n = name.lower()
    if any(k in n for k in ("flash", "fmha", "attention", "attn")):
        return "attention"
    if any(k in n for k in ("gemm", "cutlass", "xmma", "nvjet", "cublas", "sm90_", "splitk", "gemv")):
        return "gemm"
    if any(k in n for k in ("memcpy", "memset", "copy", "cat", "index", "gather", "scatter")):
        return "copy/index"
    if any(k in n for k in ("reduce", "softmax", "norm", "sum", "max")):
        return "reduction/norm"
    if "triton" in n:
        return "fused (triton)"
    return "elementwise/other"


def profile_phase(work, device) -> dict:
    """GPU time of one run of `work` by kernel category, and the host gaps: wall time not covered by any kernel."""
    out: dict = {}
    with profiled(device, out):
        work()
    return out


@contextmanager
def profiled(device, into: dict, cpu: bool = True):
    """Profile the enclosed code; on exit `into` holds profile_phase's summary of it. cpu=False records the GPU's
    kernels alone: the summary needs nothing else, and a 7B training step's host events take minutes to parse."""
    from torch.profiler import ProfilerActivity, profile

    sync(device)
    on_gpu = torch.device(device).type == "cuda"
    # without a GPU the host's events are all there is (the profiler takes no empty list)
    activities = ([ProfilerActivity.CPU] if cpu or not on_gpu else []) + ([ProfilerActivity.CUDA] if on_gpu else [])
    with profile(activities=activities) as prof:
        t = time.perf_counter()
        yield
        sync(device)
        wall = time.perf_counter() - t
    into.update(kernel_summary(prof, wall))


def kernel_summary(prof, wall: float) -> dict:
    """Kernel time by category and the 12 largest kernels of a finished profile, and the host gaps: wall time
    not covered by any kernel."""
    spans, by_cat, top = [], {}, {}
    for e in prof.events():
        if e.device_type != torch.autograd.DeviceType.CUDA:
            continue
        start, end = e.time_range.start, e.time_range.end
        spans.append((start, end))
        cat = kernel_category(e.name)
        by_cat[cat] = by_cat.get(cat, 0.0) + (end - start) / 1e6
        top[e.name] = top.get(e.name, 0.0) + (end - start) / 1e6
    spans.sort()
    busy, cur = 0.0, None
    for s, e in spans:  # union of kernel intervals
        if cur is None or s > cur[1]:
            if cur:
                busy += cur[1] - cur[0]
            cur = [s, e]
        else:
            cur[1] = max(cur[1], e)
    if cur:
        busy += cur[1] - cur[0]
    busy /= 1e6
    return {"wall_s": wall, "kernel_busy_s": busy, "host_gap_s": max(wall - busy, 0.0),
            "by_category_s": dict(sorted(by_cat.items(), key=lambda kv: -kv[1])),
            "top_kernels_s": dict(sorted(top.items(), key=lambda kv: -kv[1])[:12])}


def run_mfu(a, args, dtype, device, prompts, build, stops: list[int], progress=lambda results: None) -> dict:
    """The whole measurement; returns the results object of ../shared/RESULTS.md (topic mfu), and hands it to
    `progress` after every timed round."""
    peak = matmul_peak(device)
    print(f"[mfu] dense matmul peak {peak / 1e12:.0f} TFLOP/s", flush=True)
    actor = build(args, dtype, device, 0)
    reference = build(args, dtype, device, 1).eval().requires_grad_(False)
    if a.freeze_vision:
        actor.visual.requires_grad_(False)
    from torchplex.models.qwen2_5_vl.parallelize import apply_activation_checkpointing, apply_compile
    if a.activation_checkpointing:
        apply_activation_checkpointing(actor)
    if a.compile:
        apply_compile(actor)
        apply_compile(reference)
    vision_trains = not a.freeze_vision
    optimizer = torch.optim.AdamW([p for p in actor.parameters() if p.requires_grad], lr=0.0,
                                  foreach=device.type != "cuda", fused=device.type == "cuda")
    exp, rollout = rollout_experience(actor, prompts, a.group, a.response, stops, a.kv_pool_gib, device)
    lengths = exp.lengths.tolist()
    print(f"[mfu] rollout {rollout['rollout_s']:.1f}s, responses mean {statistics.mean(lengths):.0f} "
          f"max {max(lengths)}", flush=True)
    engine_like = RolloutEngine.__new__(RolloutEngine)  # only its prefill: no KV pool needed
    engine_like.model, engine_like.pad_id, engine_like.device = actor, 0, device
    modes = a.modes
    times = {m: {k: [] for k in PHASES} for m in modes}
    peaks, errors, mismatch, profiles = {m: 0.0 for m in modes}, {}, {}, {}
    def results() -> dict:
        """The results object from what has been measured so far (written after every round, so a run stopped
        at its time limit still leaves its finished rounds)."""
        rows = []
        samples = exp.tokens.shape[0]
        prompt_tokens = sum(len(p.input_ids) for p in prompts)
        for m in modes:
            row = {"workload": a.workload, "geometry": a.geometry, "prompts": len(prompts), "group": a.group, "mode": m,
                   "samples": samples,
                   "tokens": prompt_tokens * (a.group if base_mode(m) == "serial" else 1) + sum(lengths),
                   "peak_gib": peaks[m], "ok": m not in errors, "error": errors.get(m, "")}
            if m not in errors and not times[m]["train"]:
                row.update({"ok": False, "error": "no timed round finished (stopped at the time limit)"})
            if row["ok"]:
                med = {k: statistics.median(v) for k, v in times[m].items()}
                flops = phase_flops(args, exp, m, vision_trains)
                row.update({"step_s": med["prefill"] + rollout["decode_s"] + med["reference"] + med["train"],
                            "phases_s": {**med, "decode": rollout["decode_s"]},
                            "mfu": {k: mfu(flops[k].total, med[k], peak) for k in PHASES},
                            "pflop": {k: flops[k].total / 1e15 for k in PHASES},
                            "logprob_mismatch": mismatch.get(m)})
                if m in profiles:
                    row["profile"] = profiles[m]
            else:
                row.update({"step_s": None, "phases_s": {}})
            rows.append(row)
        return {"peak_tflops": peak / 1e12, "rollout": rollout,
                "response_lengths": {"mean": statistics.mean(lengths), "max": max(lengths), "cap": a.response},
                "note": "step_s = prefill + decode (one rollout, shared by the modes) + reference + train, each phase "
                        "timed alone; the vision tower also runs inside prefill, reference and train",
                "rows": rows}
    for rep in range(a.repeats + 1):
        for m in modes:
            if m in errors:
                continue
            try:
                if device.type == "cuda":
                    peak_memory.reset_peak()
                sync(device)
                t = time.perf_counter()
                run_prefill(engine_like, prompts)
                sync(device)
                pre = time.perf_counter() - t
                run_vision(actor, prompts)
                sync(device)
                vis = time.perf_counter() - t - pre
                ref_s, train_s, out = run_scoring(m, actor, reference, optimizer, exp, a.micro_batch, device)
                if m not in mismatch:
                    mismatch[m] = logprob_mismatch(out)
                if device.type == "cuda":
                    peaks[m] = max(peaks[m], peak_memory.max_allocated() / 2**30)
                print(f"[mfu {time.strftime('%H:%M:%S')}] {'timed' if rep else 'warm-up'} {m}: prefill {pre:.2f}s "
                      f"vision {vis:.2f}s reference {ref_s:.2f}s train {train_s:.2f}s", flush=True)
                if rep:
                    for k, v in zip(PHASES, (pre, vis, ref_s, train_s)):
                        times[m][k].append(v)
                    progress(results())
            except Exception as err:  # an OOM or any failure is a row with ok: false, not a missing row
                errors[m] = f"{type(err).__name__}: {str(err).split('. ')[0] if str(err) else ''}"
                traceback.print_exc(file=sys.stdout)
                torch.cuda.empty_cache() if device.type == "cuda" else None
    if a.profile_dir:  # the first mode only: a profiled round of every mode would double the run
        for m in [m for m in modes[:1] if m not in errors]:
            profiles[m] = {
                "prefill": profile_phase(lambda: run_prefill(engine_like, prompts), device),
                "vision": profile_phase(lambda: run_vision(actor, prompts), device),
            }
            holder = {}
            profiles[m]["reference+train"] = profile_phase(
                lambda: holder.setdefault("r", run_scoring(m, actor, reference, optimizer, exp, a.micro_batch,
                                                            device)), device)
    progress(results())
    return results()
