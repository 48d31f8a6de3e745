"""Where the compute phases' time goes (issue 19), without a rollout: kernel time by category per phase and variant.

    python benchmarks/probes/phase_profile.py --geometry 7B --prompts 8 --variants decomposed decomposed-padded \
        decomposed-recompute serial --out prof.json

Responses are drawn with the long-tailed lengths a rollout of the `img` workload gives (geometric, mean
--mean-response, capped at --response; random token ids), so no decode step is compiled and the run takes a
minute, not the several a real rollout costs. Per variant: a warm-up round, a timed round, then one profiled
round of each phase — the engine's prefill (no grad), the vision tower alone, the reference log-probs, one
training step (PPO forward + backward + AdamW at lr 0) — split by benchmarks/phase_mfu.py's kernel categories
(GEMM, attention, norm/reduction, elementwise, copies) with the host gaps (wall time no kernel covers).
Variants: `decomposed` / `serial` (packed scoring; the actor checkpointed but told not to recompute), `-padded`
(padded rows instead of packed tokens), `-recompute` (every checkpointed block recomputes in backward), `-eager`
(models/fusion.py off: eager elementwise chains, the odd-width MLP unpadded), `-nopad` (fused chains, unpadded MLP).
--fused sets fusion for the variants that name neither.
"""

from __future__ import annotations

import argparse
import copy
import faulthandler
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.phase_mfu import matmul_peak, phase_flops, profiled, run_prefill, run_vision  # noqa: E402
from benchmarks.step_bench import bench_flavor, build_policy, make_experience, make_prompt, sync  # noqa: E402
from torchplex.components.flops import mfu  # noqa: E402
from torchplex.models import fusion  # noqa: E402
from torchplex.models.qwen2_5_vl.parallelize import apply_activation_checkpointing, recompute  # noqa: E402
from torchplex.rl.losses import PolicyLossConfig  # noqa: E402
from torchplex.rollout.engine import RolloutEngine  # noqa: E402
from torchplex.runtime.decomposition import DecomposedScorer  # noqa: E402
from torchplex.runtime.grpo_step import reference_phase, train_phase  # noqa: E402
from torchplex.runtime.scoring import SerialScorer  # noqa: E402


def long_tailed_lengths(n: int, mean: int, cap: int) -> torch.Tensor:
    """n response lengths drawn geometric with this mean, capped, at least 1: a rollout's long tail."""
    u = torch.rand(n, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    p = torch.tensor(-1.0 / mean, dtype=torch.float64)
    return torch.clamp(torch.ceil(torch.log1p(-u) / torch.log1p(p)), 1, cap).long()


def gap_attribution(prof, min_gap_us: float = 500.0, top: int = 15) -> dict:
    """Where the host was when the GPU ran dry: every interval of at least min_gap_us with no kernel running, charged
    to the innermost CPU op spanning its midpoint and that op's first torchplex/benchmarks stack frame (a profile
    recorded with_stack). Returns the idle seconds per (op, frame), largest first, and the gaps' total."""
    import bisect

    events = prof.events()
    cuda = torch.autograd.DeviceType.CUDA
    kernels = sorted((e.time_range.start, e.time_range.end) for e in events if e.device_type == cuda)
    gaps, end = [], None
    for s, e in kernels:
        if end is not None and s - end >= min_gap_us:
            gaps.append((end, s))
        end = e if end is None else max(end, e)
    cpu = sorted((e for e in events if e.device_type != cuda and e.time_range.end - e.time_range.start < 2e5),
                 key=lambda e: e.time_range.start)
    starts = [e.time_range.start for e in cpu]
    frame = lambda e: next((f for f in (e.stack or []) if "torchplex/" in f or "benchmarks/" in f), "")
    charged: dict[str, float] = {}
    for a, b in gaps:
        m = (a + b) / 2
        best = None
        for i in range(bisect.bisect_right(starts, m) - 1, max(-1, bisect.bisect_right(starts, m) - 20000), -1):
            e = cpu[i]
            if e.time_range.end >= m and (best is None or e.time_range.end - e.time_range.start
                                          < best.time_range.end - best.time_range.start):
                best = e
        key = f"{best.name} @ {frame(best)}" if best is not None else "(no CPU op)"
        charged[key] = charged.get(key, 0.0) + (b - a) / 1e6
    busy_us = sum(e - s for s, e in kernels)
    return {"kernels": len(kernels), "kernel_mean_us": busy_us / max(1, len(kernels)),
            "gaps": len(gaps), "idle_s": sum(b - a for a, b in gaps) / 1e6, "min_gap_us": min_gap_us,
            "by_op_s": dict(sorted(charged.items(), key=lambda kv: -kv[1])[:top])}


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser()
    ap.add_argument("--geometry", default="7B")
    ap.add_argument("--ref-micro-batch", type=int, default=0, help="reference scoring's micro-batch (0: --micro-batch)")
    ap.add_argument("--fused", choices=["auto", "on", "off"], default="auto",
                    help="model.fused_elementwise for both models (auto: on a GPU; models/fusion.py)")
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--prompt-tokens", type=int, default=1024)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--mean-response", type=int, default=256)
    ap.add_argument("--response", type=int, default=1024)
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--variants", nargs="+", default=["decomposed", "serial"])
    ap.add_argument("--no-profile", action="store_true", help="time only")
    ap.add_argument("--gap-us", type=float, default=500.0, help="with --gaps: the shortest idle interval counted")
    ap.add_argument("--profile-variants", nargs="*", default=[], help="profile only these variants (default: all)")
    ap.add_argument("--gaps", action="store_true", help="instead of the kernel categories: one profiled round of "
                    "the reference and training phases with Python stacks, the GPU's idle gaps charged to the CPU op "
                    "and source line the host was in")
    ap.add_argument("--watchdog-s", type=int, default=0)
    ap.add_argument("--out", default="")
    a = ap.parse_args(argv)
    if a.watchdog_s:
        faulthandler.dump_traceback_later(a.watchdog_s, exit=True)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[a.dtype]
    args = bench_flavor(a.geometry)
    peak = matmul_peak(device)
    actor, reference, optimizer = build_policy(args, dtype, device, freeze_vision=False, fused=a.fused)
    apply_activation_checkpointing(actor)
    prompts = [make_prompt(args, a.prompt_tokens, seed=i) for i in range(a.prompts)]
    lengths = long_tailed_lengths(a.prompts * a.group, a.mean_response, a.response)
    exp = make_experience(prompts, a.group, int(lengths.max()), args.text.vocab_size, device, lengths=lengths)
    lengths = exp.lengths.tolist()
    engine = RolloutEngine.__new__(RolloutEngine)  # only its prefill
    engine.model, engine.pad_id, engine.device = actor, 0, device
    result = {"probe": "phase_profile", "command": "python benchmarks/probes/phase_profile.py " + " ".join(argv or sys.argv[1:]),
              "device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "torch": torch.__version__,
              "date": time.strftime("%Y-%m-%dT%H:%MZ", time.gmtime()), "peak_tflops": peak / 1e12,
              "responses": {"mean": statistics.mean(lengths), "max": max(lengths)}, "rows": []}
    print(f"[profile] peak {peak / 1e12:.0f} TFLOP/s; responses mean {statistics.mean(lengths):.0f} max {max(lengths)}",
          flush=True)
    loss = PolicyLossConfig(kl_coef=0.01)

    fused = fusion.wanted(a.fused, device)

    def phases(variant: str, into: dict | None = None, gaps: dict | None = None):
        base = variant.split("-")[0]
        on = fused and "-eager" not in variant
        fusion.enable(on, pad=on and "-nopad" not in variant)
        pack, again = "-padded" not in variant, "-recompute" in variant
        scorer = SerialScorer(pack=pack) if base == "serial" else DecomposedScorer(pack=pack)
        whole = base != "serial"
        e = copy.copy(exp)
        e.ref_logprobs = e.old_logprobs = None
        seconds = {}
        steps = {"prefill": lambda: run_prefill(engine, prompts), "vision": lambda: run_vision(actor, prompts),
                 "reference": lambda: reference_phase(reference, scorer, e, 1.0, a.ref_micro_batch or a.micro_batch,
                                                      whole),
                 "train": lambda: train_phase(actor, scorer, e, optimizer, None, loss, temperature=1.0,
                                              micro_batch_size=a.micro_batch, whole_groups=whole, ppo_epochs=1,
                                              grad_clip=1.0, max_len=e.tokens.shape[1])}
        if hasattr(scorer, "new_step"):
            scorer.new_step()
        with recompute(again):
            for name, work in steps.items():
                if into is not None:
                    with profiled(device, into.setdefault(name, {})):
                        work()
                elif gaps is not None:  # each phase under its own stack-recording profiler
                    from torch.profiler import ProfilerActivity, profile
                    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA], with_stack=True) as prof:
                        work()
                        sync(device)
                    gaps[name] = gap_attribution(prof, min_gap_us=a.gap_us)
                else:
                    sync(device)
                    t = time.perf_counter()
                    work()
                    sync(device)
                    seconds[name] = time.perf_counter() - t
        return seconds, e

    for variant in a.variants:
        base = variant.split("-")[0]
        row = {"variant": variant, "ok": True, "error": ""}
        profile_this = not a.profile_variants or variant in a.profile_variants
        try:
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats()
            phases(variant)  # warm-up
            seconds, e = phases(variant)
            flops = phase_flops(args, e, base, vision_trains=True)
            row.update(fused_elementwise=fusion.enabled(), padded_widths=fusion.padding(), seconds=seconds, mfu={k: mfu(flops[k].total, seconds[k], peak) for k in seconds},
                       pflop={k: flops[k].total / 1e15 for k in seconds},
                       peak_gib=torch.cuda.max_memory_allocated() / 2**30 if device.type == "cuda" else 0.0)
            print(f"[profile {time.strftime('%H:%M:%S')}] {variant}: "
                  + " ".join(f"{k} {v:.2f}s ({row['mfu'][k]:.1%})" for k, v in seconds.items())
                  + f" peak {row['peak_gib']:.1f} GiB", flush=True)
            if a.out:  # the timed row first: parsing a profile of a 7B training step takes minutes
                Path(a.out).write_text(json.dumps({**result, "rows": result["rows"] + [row]}, indent=2))
            if a.gaps and profile_this:
                row["gaps"] = {}
                phases(variant, gaps=row["gaps"])
                for name, g in row["gaps"].items():
                    print(f"    {name}: {g['kernels']} kernels, mean {g['kernel_mean_us']:.1f} us; GPU idle "
                          f"{g['idle_s']:.2f}s in {g['gaps']} gaps >= {g['min_gap_us']:.0f} us:", flush=True)
                    for k, v in g["by_op_s"].items():
                        print(f"      {v:7.3f}s  {k}", flush=True)
            elif not a.no_profile and profile_this:
                row["profile"] = {}
                phases(variant, row["profile"])
                for k, p in row["profile"].items():
                    cats = " ".join(f"{c} {s:.2f}" for c, s in p["by_category_s"].items())
                    print(f"    {k}: wall {p['wall_s']:.2f}s busy {p['kernel_busy_s']:.2f}s gaps {p['host_gap_s']:.2f}s"
                          f" | {cats}", flush=True)
        except Exception as err:  # an OOM is a row with ok: false
            row.update(ok=False, error=f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}")
            print(f"[profile] {variant} failed: {row['error']}", flush=True)
            if device.type == "cuda":
                torch.cuda.empty_cache()
        result["rows"].append(row)
        if a.out:
            Path(a.out).write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
