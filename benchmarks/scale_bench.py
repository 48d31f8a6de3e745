"""Whole GRPO steps at real batch sizes: a list of prompts-per-step values x modes in one process.

    python benchmarks/scale_bench.py --workload img --prompts 8,32,64 --dtype bfloat16 --geometry 7B    # H200
    python benchmarks/scale_bench.py --workload vid --prompts 4,16 --modes decomposed,overlapped ...
    python benchmarks/scale_bench.py --geometry debug --prompt-tokens 32 --response 4 --prompts 1,2      # CPU

The workloads of ../shared/WORKLOADS.md (`img`, `vid`, `img-small`) on step_bench's models and prompts, each mode
built by the trainer's builder (runtime/build.py) from step_bench's Config. Every (P, mode) is a row of
benchmarks/results/scale-YYYYMMDD-<short>.json (topic "scale", ../shared/RESULTS.md): step time (median of the timed
steps after a warm-up), phases, peak allocated GiB (CPU: the process's peak RSS), samples, tokens, and the step's
memory plan against what it held (planned bytes per group and stage, the prefix forms chosen, the KV pool and held
graph measured), and the decode loop's steps and the share of its slot-steps that were live. A row that runs out
of memory or fails is `ok: false` with the error's first line, and the script goes on; a mode whose step passed
--max-step-s is not run at larger P (its row says why). --plot draws step time and seconds per sample against P per
mode.
"""

from __future__ import annotations

import argparse
import faulthandler
import gc
import json
import statistics
import sys
import time
import traceback
from collections import Counter
from contextlib import contextmanager
from pathlib import Path
from types import SimpleNamespace

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks import oom_sites  # noqa: E402
from benchmarks.bench_runtime import bench_config  # noqa: E402
from benchmarks.step_bench import (NullTokenizer, bench_flavor, build_policy, long_tail_stops, make_prompt,  # noqa: E402
                                   sync)
from benchmarks.phase_mfu import (grids_of, logprob_mismatch, matmul_peak, phase_flops, profiled,  # noqa: E402
                                  run_prefill)
from torchplex.components import peak_memory  # noqa: E402
from torchplex.components.flops import mfu, prefill_flops  # noqa: E402
from torchplex.components.metrics import PhaseTimer  # noqa: E402
from torchplex.components.span_clock import span_totals  # noqa: E402
from torchplex.models import fusion  # noqa: E402
from torchplex.models.qwen2_5_vl.parallelize import apply_activation_checkpointing  # noqa: E402
from torchplex.rollout.engine import RolloutEngine  # noqa: E402
from torchplex.rollout.sampling import SamplingParams  # noqa: E402
from torchplex.runtime.build import build_step_runtime  # noqa: E402
from torchplex.runtime.memory_budget import held_at_once_bytes  # noqa: E402

# ../shared/WORKLOADS.md: prompt tokens, (frames, side) of a video prompt, mean response, response cap
WORKLOADS = {"img": dict(prompt_tokens=1024, video=None, mean_response=256, response=1024),
             "vid": dict(prompt_tokens=0, video=(32, 448), mean_response=256, response=1024),
             "img-small": dict(prompt_tokens=1024, video=None, mean_response=128, response=512)}
# -window: the reference in the decode window; -batched: runtime.batched_actor_prefix (the actor prefixes batched at
# the start of training), the default since 2026-12-02, so "decomposed" runs it as well; -unbatched: without it
MODES = ("serial", "decomposed", "decomposed-batched", "decomposed-unbatched", "overlapped", "overlapped-window")
STAGES = ("vision", "rollout", "ref", "train")


def make_video_prompt(args, frames: int, side_px: int, seed: int):
    """A few text tokens, one video of `frames` frames of side_px x side_px (16 temporal grids x 256 merged patches
    for 32 x 448), a question."""
    v = args.vision
    t, side = frames // v.temporal_patch_size, side_px // v.patch_size
    g = torch.Generator().manual_seed(seed)
    patch_dim = v.in_channels * v.temporal_patch_size * v.patch_size ** 2
    text = lambda n: torch.randint(10, 1000, (n,), generator=g).tolist()
    merged = t * side * side // v.spatial_merge_size ** 2
    ids = (text(12) + [args.vision_start_token_id] + [args.video_token_id] * merged + [args.vision_end_token_id]
           + text(12))
    return SimpleNamespace(input_ids=torch.tensor(ids), pixel_values=None, image_grid_thw=None,
                           pixel_values_videos=torch.randn(t * side * side, patch_dim, generator=g),
                           video_grid_thw=torch.tensor([[t, side, side]]), second_per_grid_ts=torch.tensor([1.0]))


def workload_prompts(args, a, count: int) -> list:
    if a.video:
        return [make_video_prompt(args, a.video[0], a.video[1], seed=i) for i in range(count)]
    return [make_prompt(args, a.prompt_tokens, seed=i) for i in range(count)]


def memory_record(out, runner, engine, phase_timer: PhaseTimer) -> dict:
    """The step's planned bytes (per stage and group, the room for held prefixes, each prompt's form) beside what
    it held: weights, optimizer state, the KV pool, the fused graphs and compact prefixes, the reference prefixes'
    K/V, each stage's peak."""
    s = out.schedule
    tensor_bytes = lambda ts: sum(t.numel() * t.element_size() for t in ts if torch.is_tensor(t))
    # AdamW's moments, not its 0-dim "step" counters
    state = [t for st in runner.optimizer.state.values() for t in st.values() if torch.is_tensor(t) and t.dim()]
    forms = [c.form for c in s.prefix_forms]
    return {"planned": {"capacity_bytes": s.memory.get("capacity_bytes", 0),
                        "room_bytes": s.memory.get("room_bytes", 0), "residents": s.memory.get("residents", {}),
                        "held_graph_bytes": sum(c.bytes for c in s.prefix_forms),
                        "forms": {f: forms.count(f) for f in sorted(set(forms))},
                        "train_room_bytes": s.memory.get("train_room_bytes", 0),
                        # the rooms' cap for the whole graphs the last step's micro-batches kept (memory_budget)
                        "held_cap_bytes": s.memory.get("held_cap_bytes"), "held_cap": s.memory.get("held_cap", ""),
                        "train_held_bytes": sum(c.bytes for c in s.train_prefix_forms),
                        # in rounds training holds one round at a time: its largest's bytes
                        "train_held_at_once_bytes": held_at_once_bytes(s.train_prefix_forms),
                        "train_forms": {f: [c.form for c in s.train_prefix_forms].count(f)
                                        for f in sorted({c.form for c in s.train_prefix_forms})}},
            "measured": {"actor_weights_bytes": tensor_bytes(runner.actor.parameters()),
                         "optimizer_state_bytes": tensor_bytes(state),
                         "kv_pool_bytes": engine.stats.pool_bytes,
                         "held_graph_bytes": sum(b for b, _ in out.prefixes.graph_bytes.values()),
                         "held_compact_bytes": sum(b for b, _ in out.prefixes.compact_bytes.values()),
                         "ref_prefix_kv_peak_bytes": max(out.prefixes.peak_kv_bytes.values(), default=0),
                         "stage_peak_bytes": dict(phase_timer.peak_bytes),
                         # the allocator's retries (each frees its cache, synchronising) and cudaMalloc/cudaFree calls
                         "allocator_events": {k: dict(v) for k, v in phase_timer.allocator_events.items()},
                         # training's windows (executor._learn_train) and each stage's transient beyond its plan
                         "train_windows_bytes": s.memory.get("train_measured", {}),
                         "unplanned_bytes": s.memory.get("unplanned_measured", {})}}


def step_flops(args, exp, mode: str, forms: list[str], vision_stage: bool) -> dict:
    """Counted FLOPs (components/flops.py) of each compute phase of one step of `mode` over its experience:
    the rollout prefill (vision inside), the reference, training, and (frozen tower) the step's one vision pass.
    Overlapped: a prompt whose actor prefix was held from the fused prefill (form graph or compact) runs only that
    prefix's backward in training; its forward is the prefill's. Recomputation is not counted (model FLOPs)."""
    f = phase_flops(args, exp, mode, vision_trains=not vision_stage)  # overlapped counts as decomposed there
    prefill, train, ref = f["prefill"], f["train"], f["reference"]
    if vision_stage and mode != "serial":  # the step's one vision pass serves the prefill, reference and train
        ref.vision = train.vision = prefill.vision = 0.0
    for p, form in zip(exp.prompts, forms):
        if form in ("graph", "compact"):
            held = prefill_flops(args, [len(p.input_ids)], grids_of(p), logit_tokens=0)
            if vision_stage:
                held.vision = 0.0
            train = train + held.scaled(-1.0)
    out = {"prefill": prefill, "reference": ref, "train": train}
    if vision_stage:
        out["vision"] = f["vision"]
    return out


def row_mfu(args, out, mode: str, phases: dict, prefill_s: float, peak: float) -> dict:
    """MFU and PFLOP of each compute phase of this step (issue 19's `mfu` object) and the rollout-vs-trainer
    log-prob mismatch of its sampled tokens."""
    forms = [c.form for c in out.schedule.prefix_forms] or ["none"] * len(out.experience.prompts)
    flops = step_flops(args, out.experience, mode, forms, "vision" in phases)
    seconds = {"prefill": prefill_s, "reference": phases.get("ref", 0.0), "train": phases.get("train", 0.0),
               "vision": phases.get("vision", 0.0)}
    return {"mfu": {k: mfu(v.total, seconds[k], peak) for k, v in flops.items()},
            "pflop": {k: v.total / 1e15 for k, v in flops.items()},
            "prefill_s": prefill_s, "peak_tflops": peak / 1e12,
            "logprob_mismatch": logprob_mismatch(out.experience) if out.experience.old_logprobs is not None else None}


class ProfilingTimer(PhaseTimer):
    """A PhaseTimer that also profiles the stages named in `stages` (kernel time by category, host gaps)."""

    def __init__(self, device, stages=("vision", "ref", "train")):
        super().__init__(device)
        self.stages, self.profiles = stages, {}

    @contextmanager
    def phase(self, name):
        with super().phase(name):
            if str(name) in self.stages:
                with profiled(self.device, self.profiles.setdefault(str(name), {}), cpu=False):
                    yield
            else:
                yield


def run_row(a, mode: str, P: int, runner, engine, prompts, params, device, warm_up: bool = True,
            peak: float = 0.0) -> dict:
    row = {"workload": a.workload, "geometry": a.geometry, "prompts": P, "group": a.group, "mode": mode,
           "step_s": 0.0, "phases_s": {}, "peak_gib": 0.0, "samples": P * a.group, "tokens": 0, "ok": True,
           "error": ""}
    steps, phases, peak_bytes, out, timer = [], {k: [] for k in STAGES}, 0, None, PhaseTimer(device)
    prefill = []
    # the first step warms up allocators, compilations and the measured rates; --warmup first: only the first
    # mode at each P (the decode step's compilation and capture are the engine's, shared by the modes)
    # (--warm-up-steps more of them where one is run: a later step's plan learns from the first, and a batch shape
    # the first did not meet compiles in the second, not in a timed step)
    first = 0 if not a.repeats else 1 - a.warm_up_steps if warm_up else 1
    for rep in range(first, a.repeats + 1):
        timer.reset()
        if device.type == "cuda":
            peak_memory.reset_peak()
        prefill_before = engine.stats.prefill_s
        decode_before = decode_counts(engine)
        t = time.perf_counter()
        out = runner.run(prompts, [""] * P, params, phase_timer=timer)
        sync(device)
        step_s = time.perf_counter() - t
        kind = "timed" if rep > 0 else "warm-up"
        print(f"[scale_bench {time.strftime('%H:%M:%S')}] {a.workload} P={P} {mode} {kind} "
              f"step {step_s:.2f}s " + " ".join(f"{k} {out.timeline.total_s(k):.2f}s" for k in STAGES), flush=True)
        step_peak = max(timer.peak_bytes.values(), default=0)
        peak_bytes = max(peak_bytes, step_peak)
        if rep <= 0 and a.repeats:  # the last warm-up step's
            row["peak_warm_up_gib"] = step_peak / 2**30  # planned from estimates: the rates are measured in it
            row["peak_warm_up_stage_gib"] = {str(k): v / 2**30 for k, v in timer.peak_bytes.items()}
            row["recompute_warm_up"] = recompute_record(out.schedule)
            row["train_spans_warm_up"] = span_totals(out.train.spans)
        if rep > 0 or not a.repeats:
            row["peak_timed_gib"] = max(row.get("peak_timed_gib", 0.0), step_peak / 2**30)
            steps.append(step_s)
            prefill.append(engine.stats.prefill_s - prefill_before)
            row["decode"] = decode_record(decode_before, decode_counts(engine), engine, P * a.group)
            for k in STAGES:
                phases[k].append(out.timeline.total_s(k))
    exp = out.experience
    row.update(step_s=statistics.median(steps), peak_gib=peak_bytes / 2**30,
               phases_s={k: statistics.median(v) for k, v in phases.items() if any(v)},
               tokens=int(exp.lengths.sum()) + sum(len(p.input_ids) for p in prompts) * a.group,
               response_tokens=int(exp.lengths.sum()), memory=memory_record(out, runner, engine, timer),
               warm_up_step=bool(first <= 0 and a.repeats), warm_up_steps=1 - first if a.repeats else 0)
    row["s_per_sample"] = row["step_s"] / row["samples"]
    row["window_phases"] = [str(ph.name) for ph in out.schedule.phases if ph.in_window]  # beside decode
    jobs = out.window_jobs
    if jobs is not None and jobs.reads_reference:  # the window's jobs: how many ran there, how many the ref stage took
        row["window_jobs"] = {"submitted": {str(k): v for k, v in jobs.submitted.items()},
                              "dropped": {str(k): v for k, v in jobs.dropped.items()},
                              "samples_scored": len(jobs.scored)}
    row["recompute"] = recompute_record(out.schedule)
    # the last timed step's train stage, span by span (host and device seconds; components/span_clock)
    row["train_spans"] = {"totals": span_totals(out.train.spans), "spans": out.train.spans}
    if peak:
        row.update(row_mfu(runner.actor.args, out, mode, row["phases_s"], statistics.median(prefill), peak))
    return row


def decode_counts(engine) -> tuple[float, int, int]:
    """The engine's running decode totals: (seconds, steps, tokens generated)."""
    st = engine.stats
    return st.decode_s, st.decode_steps, st.generated_tokens


def decode_record(before, after, engine, samples: int) -> dict:
    """The last timed step's decode loop: its seconds and steps, the pool's sample slots (every step runs over all
    of them: static shapes, until a compaction, `--compact-decode`), and the share of those slot-steps that decoded
    a live sample, `live_fraction` (each sample's first token is sampled in the prefill, the others one per decode
    step); `compactions`: the engine's so far."""
    seconds, steps, tokens = (b - a for a, b in zip(before, after))
    slots = engine.pool.num_slots if engine.pool is not None else 0
    live = (tokens - samples) / (steps * slots) if steps and slots else 0.0
    return {"s": seconds, "steps": steps, "slots": slots, "live_fraction": live,
            "ms_per_step": 1e3 * seconds / steps if steps else 0.0, "compactions": engine.stats.compactions}


def recompute_record(schedule) -> dict:
    """The train phase's per-micro-batch recompute choices: how many forwards recomputed in backward ("on") or kept
    their whole graph ("off"), and for each choice the estimate of its whole graph against the free bytes it was
    compared with (GiB; the free bytes less the headroom), so a peak over the plan shows which choice ran close,
    and (CUDA) what each forward's window measured, in the same order."""
    rc = schedule.memory.get("recompute", {})
    return {"on": rc.get("on", 0), "off": rc.get("off", 0), "scale": rc.get("scale", 1.0),
            "estimate_gib": [b / 2**30 for b in rc.get("estimates", [])],
            "free_gib": [b / 2**30 for b in rc.get("free_bytes", [])],
            "measured_gib": [b / 2**30 for b in rc.get("measured", [])]}


def profile_row(row: dict, P: int, runner, engine, prompts, params, device) -> None:
    """One more step of this row under torch.profiler: kernel time by category per phase, in row["profile"]."""
    ptimer, prefill_profile = ProfilingTimer(device), {}
    with profiled(device, prefill_profile, cpu=False):
        run_prefill(engine, prompts)  # the engine's prefill batches, alone
    runner.run(prompts, [""] * P, params, phase_timer=ptimer)
    row["profile"] = {"prefill": prefill_profile, **ptimer.profiles}


def host_profile_row(row: dict, P: int, runner, prompts, params, first: int, count: int) -> None:
    """One more step of this row with training micro-batches first .. first + count - 1 under torch.profiler with
    the host's events and Python stacks (started and stopped from the runner's per-micro-batch recompute choice,
    which training asks before each forward): where the GPU went idle, charged to the host op and source line it
    waited on (probes/phase_profile.gap_attribution), and the host ops by self time, in row["host_profile"]."""
    from torch.profiler import ProfilerActivity, profile

    from benchmarks.probes.phase_profile import gap_attribution

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    prof = profile(activities=activities, with_stack=True)
    state = {"seen": 0, "on": False, "t": 0.0}
    choose = runner._recompute_for

    def stop():
        if state["on"]:
            prof.stop()
            state["on"], state["wall_s"] = False, time.perf_counter() - state["t"]

    def timed_choices(step):
        decide = choose(step)

        def choice(mb, req):
            if state["seen"] == first:
                prof.start()
                state["on"], state["t"] = True, time.perf_counter()
            elif state["seen"] == first + count:
                stop()
            state["seen"] += 1
            return decide(mb, req)

        return choice

    runner._recompute_for = timed_choices
    try:
        runner.run(prompts, [""] * P, params)
        stop()
    finally:
        del runner._recompute_for  # the class's method again
    if "wall_s" not in state:
        row["host_profile"] = {"error": f"training ran {state['seen']} micro-batches, fewer than {first + 1}"}
        return
    ops = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:15]
    row["host_profile"] = {"micro_batches": [first, min(first + count, state["seen"])], "wall_s": state["wall_s"],
                           **gap_attribution(prof),
                           "host_self_s": {e.key: e.self_cpu_time_total / 1e6 for e in ops}}


def failed_row(a, mode: str, P: int, error: str) -> dict:
    return {"workload": a.workload, "geometry": a.geometry, "prompts": P, "group": a.group, "mode": mode,
            "step_s": 0.0, "phases_s": {}, "peak_gib": 0.0, "samples": P * a.group, "tokens": 0, "ok": False,
            "error": error}


def draw(rows: list[dict], path: Path, title: str) -> Path:
    """Step time and seconds per sample against P, one line per mode (the rows that ran)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for mode in dict.fromkeys(r["mode"] for r in rows):
        ok = sorted((r for r in rows if r["mode"] == mode and r["ok"]), key=lambda r: r["prompts"])
        if ok:
            P = [r["prompts"] for r in ok]
            left.plot(P, [r["step_s"] for r in ok], marker="o", label=mode)
            right.plot(P, [r["step_s"] / r["samples"] for r in ok], marker="o", label=mode)
    left.set(xlabel="prompts per step P", ylabel="step time (s)", title="step time")
    right.set(xlabel="prompts per step P", ylabel="seconds per sample", title="cost per sample")
    for ax in (left, right):
        ax.grid(alpha=0.3)
        if ax.get_lines():  # every row failed: an empty chart, no legend
            ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def parse(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--workload", default="img", choices=sorted(WORKLOADS))
    ap.add_argument("--prompts", default="8,32,64", help="comma-separated prompts per step")
    ap.add_argument("--modes", default="serial,decomposed,overlapped", help="comma-separated subset of "
                    + ",".join(MODES) + ", run in this order at each P")
    ap.add_argument("--geometry", default="7B")
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--prompt-tokens", type=int, default=0, help="image prompts of this size instead of the workload's")
    ap.add_argument("--video", default="", help="FRAMES,SIDE: video prompts of this size instead of the workload's")
    ap.add_argument("--response", type=int, default=0, help="response cap instead of the workload's")
    ap.add_argument("--mean-response", type=int, default=-1,
                    help="mean response instead of the workload's (0: no stops)")
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--repeats", type=int, default=2, help="timed steps after the warm-up (0: the one step is timed)")
    ap.add_argument("--memory-budget-gib", type=float, default=0.0, help="memory.budget_gib (0: the device's)")
    ap.add_argument("--kv-pool-gib", type=float, default=0.0, help="rollout.kv_pool_gib (0: sized from the budget)")
    ap.add_argument("--compact-decode", action="store_true",
                    help="rollout.compact_decode: the live samples decode alone once they fit one per group slot")
    ap.add_argument("--managed", action="store_true", help="memory.managed: offload groups between stages")
    ap.add_argument("--freeze-vision", action="store_true")
    ap.add_argument("--warmup", default="each", choices=["each", "modes", "first"],
                    help="a warm-up step before the timed steps of every (P, mode); of every mode at the first P only "
                         "(later P: a warm-up rollout for the new pool); or of the first mode at the first P only "
                         "(the later modes' first steps then run cold: ratios in one run favour the first mode)")
    ap.add_argument("--warm-up-steps", type=int, default=1,
                    help="untimed steps where --warmup runs one (H200, 7B, img P = 64, overlapped: the timed step's "
                         "plan, learned from the warm-up, batched a prefix shape the warm-up had not compiled)")
    ap.add_argument("--ref-micro-batch", type=int, default=0,
                    help="algorithm.ref_micro_batch_size: sequences per reference-scoring forward (0: --micro-batch)")
    ap.add_argument("--fused", choices=["auto", "on", "off"], default="auto",
                    help="model.fused_elementwise for both models (auto: on a GPU; models/fusion.py)")
    ap.add_argument("--activation-checkpointing", action="store_true",
                    help="model.activation_checkpointing: the actor's decoder layers and vision blocks recompute")
    ap.add_argument("--padded", action="store_true", help="runtime.packed_scoring false: score padded rows")
    ap.add_argument("--profile", default="", help="P:MODE[,MODE...]: one more step of each of those rows under "
                    "torch.profiler (kernel time by category per phase, in the row's `profile`)")
    ap.add_argument("--host-profile", default="", help="P:MODE:FIRST:COUNT: one more step of that row with training "
                    "micro-batches FIRST..FIRST+COUNT-1 profiled with host events and stacks (the GPU's idle gaps "
                    "charged to host ops and source lines, in the row's `host_profile`)")
    ap.add_argument("--oom-sites", action="store_true",
                    help="record allocation stacks (slower host): a row that fails keeps its live memory by site")
    ap.add_argument("--memory-cap-gib", type=float, default=0.0,
                    help="diagnostic: the allocator refuses to hold more than this (set_per_process_memory_fraction) "
                         "while the planner still sees the whole device, so with --oom-sites a step that peaks above "
                         "it fails there and its row keeps what was live at that moment, by site")
    ap.add_argument("--plot-from", nargs="+", default=[],
                    help="results files of earlier runs: only draw their rows (one workload) into --plot and stop")
    ap.add_argument("--watchdog-s", type=int, default=0,
                    help="dump every thread's stack and exit if still running after this many seconds (0: none)")
    ap.add_argument("--max-step-s", type=float, default=240.0, help="a mode past this is not run at larger P")
    ap.add_argument("--out", default="", help="results JSON (default benchmarks/results/scale-DATE-<workload>.json)")
    ap.add_argument("--plot", default="",
                    help="PNG of step time and s/sample vs P (default docs/img/scale-<workload>.png)")
    a = ap.parse_args(argv)
    if a.warm_up_steps < 1:
        ap.error(f"--warm-up-steps wants 1 or more, got {a.warm_up_steps} (--warmup first leaves the later modes none)")
    w = WORKLOADS[a.workload]
    a.video = (tuple(int(x) for x in a.video.split(",")) if a.video
               else None if a.prompt_tokens else w["video"])
    a.prompt_tokens = a.prompt_tokens or w["prompt_tokens"]
    a.response = a.response or w["response"]
    a.mean_response = w["mean_response"] if a.mean_response < 0 else a.mean_response
    a.prompt_list = [int(x) for x in a.prompts.split(",") if x]
    a.mode_list = [m for m in a.modes.split(",") if m]
    hp = a.host_profile.split(":") if a.host_profile else []
    if hp and len(hp) != 4:
        ap.error(f"--host-profile wants P:MODE:FIRST:COUNT, got {a.host_profile!r}")
    a.host_profile = (int(hp[0]), hp[1], int(hp[2]), int(hp[3])) if hp else (0, "", 0, 0)
    a.profile = ((int(a.profile.split(":")[0]), set(a.profile.split(":")[1].split(","))) if a.profile
                 else (0, set()))
    unknown = (set(a.mode_list) | a.profile[1] | ({a.host_profile[1]} if a.host_profile[1] else set())) - set(MODES)
    if unknown:
        ap.error(f"unknown modes {sorted(unknown)}; choose from {MODES}")
    return a


def main(argv=None) -> dict:
    a = parse(argv)
    if a.plot_from:  # rows of several runs (e.g. one process per P) in one chart
        files = [json.loads(Path(f).read_text()) for f in a.plot_from]
        rows = [r for f in files for r in f["rows"] if r["workload"] == a.workload]
        plot = Path(a.plot or f"docs/img/scale-{a.workload}.png")
        first = files[0]
        draw(rows, plot, f"{a.workload}, {rows[0]['geometry'] if rows else a.geometry}, G={a.group} ({first['device']})")
        print(f"wrote {plot} from {len(rows)} rows")
        return {"rows": rows}
    if a.watchdog_s:
        faulthandler.dump_traceback_later(a.watchdog_s, exit=True)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[a.dtype]
    args = bench_flavor(a.geometry)
    peak = matmul_peak(device)  # the dense matmul rate the rows' MFU divide by, measured in this process
    print(f"[scale_bench] dense matmul peak {peak / 1e12:.0f} TFLOP/s", flush=True)
    if a.oom_sites and not oom_sites.record():
        print("[scale_bench] --oom-sites: no CUDA device, nothing recorded", flush=True)
    if a.memory_cap_gib and device.type == "cuda":
        total = torch.cuda.get_device_properties(device).total_memory
        fraction = min(1.0, a.memory_cap_gib * 2**30 / total)
        torch.cuda.set_per_process_memory_fraction(fraction, torch.cuda.current_device())
        print(f"[scale_bench] allocator capped at {a.memory_cap_gib:.1f} GiB of {total / 2**30:.1f}", flush=True)
    actor, reference, optimizer = build_policy(args, dtype, device, a.freeze_vision, a.fused)
    if a.activation_checkpointing:
        apply_activation_checkpointing(actor)
    engine = RolloutEngine(actor, kv_pool_bytes=int(a.kv_pool_gib * 2**30), compile_decode=device.type == "cuda",
                           compact_decode=a.compact_decode,
                           max_batch=max(a.prompt_list) * a.group)
    engine.time_prefill = True  # prefill_s as device time: the rows' prefill MFU
    params = SamplingParams(n=a.group, temperature=1.0, max_new_tokens=a.response, seed=0,
                            stop_token_ids=long_tail_stops(args.text.vocab_size, a.mean_response))
    rows, stopped = [], {}
    result = {"topic": "scale", "command": "python benchmarks/scale_bench.py " + " ".join(argv or sys.argv[1:]),
              "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu",
              "gpus": 1 if device.type == "cuda" else 0, "torch": torch.__version__,
              "transformers": _transformers_version(), "date": time.strftime("%Y-%m-%dT%H:%MZ", time.gmtime()),
              "peak_tflops": peak / 1e12, "activation_checkpointing": a.activation_checkpointing,
              "fused_elementwise": fusion.enabled(), "micro_batch": a.micro_batch, "ref_micro_batch": a.ref_micro_batch,
              "packed_scoring": not a.padded, "compact_decode": a.compact_decode, "rows": rows}
    out = Path(a.out or f"benchmarks/results/scale-{time.strftime('%Y%m%d', time.gmtime())}-{a.workload}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    # One runner per mode for the whole run: the rates it measured (held-prefix bytes per token, training
    # activations) carry over to the next P, so only the first P needs a whole warm-up step of each mode's plan.
    runners: dict[str, object] = {}

    def close(runner) -> None:
        runner.window.close()
        if runner.memory is not None:
            runner.memory.close()

    for i, P in enumerate(a.prompt_list):
        prompts = workload_prompts(args, a, P)
        if i and a.warmup in ("first", "modes") and a.repeats:
            # a new P is a new KV-pool shape: its decode step compiles and captures in this rollout, outside any row.
            # The pool must be the one the steps will use: the first mode's plan sizes it from this P's budget (else
            # the engine keeps the previous P's size, and the first timed step compiles its own pool shape)
            if a.mode_list[0] in runners:
                runners[a.mode_list[0]].plan(prompts, params)
            t = time.perf_counter()
            engine.generate(prompts, params)
            engine.release()
            print(f"[scale_bench] P={P} warm-up rollout {time.perf_counter() - t:.1f}s", flush=True)
        for k, mode in enumerate(a.mode_list):
            if mode in stopped:
                rows.append(failed_row(a, mode, P, stopped[mode]))
                continue
            try:
                if mode not in runners:
                    cfg = bench_config(mode.split("-")[0], micro_batch=a.micro_batch,
                                       ref_micro_batch=a.ref_micro_batch,
                                       window=mode.endswith("-window"))
                    cfg.rollout.kv_pool_gib, cfg.memory.budget_gib, cfg.memory.managed = (
                        a.kv_pool_gib, a.memory_budget_gib, a.managed)
                    cfg.model.activation_checkpointing = a.activation_checkpointing
                    cfg.runtime.packed_scoring = not a.padded
                    # -batched: the default since 2026-12-02 (the name kept for earlier commands)
                    cfg.runtime.batched_actor_prefix = not mode.endswith("-unbatched")
                    runners[mode] = build_step_runtime(cfg, actor, reference, engine, optimizer, None,
                                                       NullTokenizer())
                    runners[mode].settings.time_train = True  # rows' train_spans: where training's time goes
                row = run_row(a, mode, P, runners[mode], engine, prompts, params, device,
                              warm_up=a.warmup == "each" or (i == 0 and (k == 0 or a.warmup == "modes")), peak=peak)
                if row["step_s"] > a.max_step_s:
                    stopped[mode] = (f"skipped: the step at P={P} took {row['step_s']:.0f} s > --max-step-s "
                                     f"{a.max_step_s:.0f}")
            except Exception as e:  # out of memory included: the row says so and the next one runs
                first = (str(e).strip().splitlines() or [type(e).__name__])[0]
                where = "".join(f" ({note})" for note in getattr(e, "__notes__", []))  # the runner's: which stage
                row = failed_row(a, mode, P, f"{type(e).__name__}{where}: {first}")
                failed = runners[mode].failed_schedule if mode in runners else None
                if failed is not None:  # its plan and its stages' peaks (the failing one's up to the error)
                    row["failed_step"] = {"memory": failed.memory,
                                          "forms": Counter(c.form for c in failed.prefix_forms),
                                          "train_forms": Counter(c.form for c in failed.train_prefix_forms)}
                if a.oom_sites:  # the allocator's live blocks by allocation site, at the failed allocation
                    row["oom_sites"] = oom_sites.last()
                print(f"[scale_bench] {a.workload} P={P} {mode} failed:\n{traceback.format_exc(limit=3)}", flush=True)
                if mode in runners:  # a fresh runner for the next P: nothing of a failed step is reused
                    close(runners.pop(mode))
            finally:
                engine.release()
                optimizer.zero_grad(set_to_none=True)
                gc.collect()
                if device.type == "cuda":
                    torch.cuda.empty_cache()
            rows.append(row)
            out.write_text(json.dumps(result, indent=2))  # after every row: a run stopped at its limit keeps its rows
            if row["ok"] and P == a.profile[0] and mode in a.profile[1]:  # after the row is safe: parsing a 7B profile takes minutes
                try:
                    profile_row(row, P, runners[mode], engine, prompts, params, device)
                finally:
                    engine.release()
                out.write_text(json.dumps(result, indent=2))
            if row["ok"] and (P, mode) == a.host_profile[:2]:
                try:
                    host_profile_row(row, P, runners[mode], prompts, params, *a.host_profile[2:])
                finally:
                    engine.release()
                out.write_text(json.dumps(result, indent=2))
    for runner in runners.values():
        close(runner)
    out.write_text(json.dumps(result, indent=2))
    plot = Path(a.plot or f"docs/img/scale-{a.workload}.png")
    draw(rows, plot, f"{a.workload}, {a.geometry}, G={a.group} ({result['device']})")
    for r in rows:
        print(f"{r['workload']:<10}P={r['prompts']:<4}{r['mode']:<12}"
              + (f"{r['step_s']:8.2f} s {r['s_per_sample']:.3f} s/sample peak {r['peak_gib']:.1f} GiB" if r["ok"]
                 else f"FAILED {r['error']}"))
    print(f"wrote {out} and {plot}")
    return result


def _transformers_version() -> str:
    try:
        import transformers
        return transformers.__version__
    except ImportError:
        return ""


if __name__ == "__main__":
    main()
