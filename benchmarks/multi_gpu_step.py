"""Whole GRPO steps on 2 ranks: actor (and reference) under TP 2, rollout under TP --rollout-tps, per runtime mode.

    torchrun --nproc-per-node 2 benchmarks/multi_gpu_step.py --out multi_gpu_step.json                     # 2 x H200
    OMP_NUM_THREADS=1 torchrun --nproc-per-node 2 benchmarks/multi_gpu_step.py --backend gloo --device cpu \\
        --geometry debug --dtype float32 --prompts 2 --prompt-tokens 256 --response 8 --out step_cpu.json   # CPU

Random weights of the named geometry, image-heavy prompts (one square image, ~--prompt-tokens tokens each, the same
on both ranks: TP peers train on the same data), G = --group samples of exactly --response tokens (no stop token),
a frozen reference (KL term), AdamW. The step is the trainer's: `StepRunner.run` with the engine the trainer builds
(`build_rollout_engine`): rollout TP 1 runs on a WeightSharer rollout model (two replicas, one per GPU, each
sampling half of the prompts; rebuilt weights re-synced before every rollout; decode as one captured CUDA graph),
rollout TP 2 on the TP'd actor itself. As in the trainer, the overlapped mode does not fuse the actor prefix into
the rollout prefill when the TP degrees differ. Per (rollout TP, mode): median step seconds over --repeats after
one warm-up step, with the median of each phase (timeline), and the resync seconds for rollout TP 1.
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

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from step_bench import NullTokenizer, bench_flavor, make_prompt, sync  # noqa: E402
from torchplex.components import peak_memory  # noqa: E402
from torchplex.components.optim import build_optimizer  # noqa: E402
from torchplex.distributed.mesh import build_parallel_dims  # noqa: E402
from torchplex.models.qwen2_5_vl.build import build_model  # noqa: E402
from torchplex.models.qwen2_5_vl.parallelize import parallelize_qwen2_5_vl  # noqa: E402
from torchplex.rollout.sampling import SamplingParams  # noqa: E402
from benchmarks.bench_runtime import bench_config  # noqa: E402
from torchplex.runtime.build import build_step_runtime  # noqa: E402
from torchplex.runtime.rollout_weights import SharedRolloutEngine, build_rollout_engine  # noqa: E402

PHASES = ("vision", "rollout", "ref", "train")


def log(*msg) -> None:
    if dist.get_rank() == 0:
        print(*msg, flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--geometry", default="3B")
    ap.add_argument("--vision-depth", type=int, default=0, help="cut the vision tower to this many blocks (0: all)")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--backend", default=None)
    ap.add_argument("--device", default=None)
    ap.add_argument("--prompts", type=int, default=4)
    ap.add_argument("--prompt-tokens", type=int, default=1024)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--response", type=int, default=128)
    ap.add_argument("--micro-batch", type=int, default=8,
                    help="at most this many sequences per micro-batch (algorithm.micro_batch_size; 0: no bound)")
    ap.add_argument("--modes", nargs="+", default=["serial", "overlapped"])
    ap.add_argument("--rollout-tps", nargs="+", type=int, default=[1, 2])
    ap.add_argument("--freeze-vision", action="store_true")
    ap.add_argument("--kv-pool-gib", type=float, default=16.0)
    ap.add_argument("--no-graphs", action="store_true", help="eager decode even where the engine would capture it")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", default="")
    ap.add_argument("--watchdog-s", type=int, default=280)
    a = ap.parse_args()
    faulthandler.dump_traceback_later(a.watchdog_s, exit=True)
    if a.device == "cpu":  # ParallelDims builds its meshes on default_device(): hide GPUs before CUDA starts
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    use_cuda = (a.device or ("cuda" if torch.cuda.is_available() else "cpu")) == "cuda"
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    dist.init_process_group(a.backend or ("nccl" if use_cuda else "gloo"), device_id=device if use_cuda else None)
    world = dist.get_world_size()
    dims = build_parallel_dims(1, world, world)  # actor TP over every rank
    dtype = getattr(torch, a.dtype)
    args = bench_flavor(a.geometry, a.vision_depth)
    info = {"device": torch.cuda.get_device_name(device) if use_cuda else "cpu", "gpus": world,
            "torch": torch.__version__, "date": time.strftime("%Y-%m-%d %H:%M"), "backend": dist.get_backend(),
            "NCCL_NVLS_ENABLE": os.environ.get("NCCL_NVLS_ENABLE"), "actor_tp": world, **vars(a)}
    log(json.dumps({"info": info}))

    t0 = time.perf_counter()
    par = lambda m: parallelize_qwen2_5_vl(m, dims, param_dtype=dtype, reduce_dtype=torch.float32,
                                           freeze_vision=a.freeze_vision)
    actor = build_model(args, device=device, dtype=dtype, seed=0, parallelize=par)
    reference = build_model(args, device=device, dtype=dtype, seed=1, parallelize=par).eval().requires_grad_(False)
    if a.freeze_vision:
        reference.visual = actor.visual
    optimizer = build_optimizer(actor, "adamw", lr=1e-7)
    prompts = [make_prompt(args, a.prompt_tokens, seed=i) for i in range(a.prompts)]  # same on every rank
    params = SamplingParams(n=a.group, temperature=1.0, max_new_tokens=a.response, seed=0)
    sync(device)
    log(f"models built in {time.perf_counter() - t0:.1f} s; prompt tokens {[len(p.input_ids) for p in prompts]}")

    results: dict = {"info": info, "steps": {}}
    for t_roll in a.rollout_tps:
        engine = build_rollout_engine(actor, dims, t_roll, kv_pool_bytes=int(a.kv_pool_gib * 2**30), max_batch=256,
                                      pad_id=0, device=device)
        shared = isinstance(engine, SharedRolloutEngine)
        if a.no_graphs:
            (engine.engine if shared else engine).use_graphs = False
        if shared:
            log(f"rollout TP {t_roll}: {engine.sharer.report().summary()}; decode graphs {engine.engine.use_graphs}")
        for mode in a.modes:
            # fusion only where the engine decodes on the actor: the planner reads engine.capabilities
            runner = build_step_runtime(bench_config(mode, micro_batch=a.micro_batch), actor, reference, engine,
                                        optimizer, None, NullTokenizer())
            times = {k: [] for k in PHASES + ("step_s",)}
            resync = []
            for rep in range(a.repeats + 1):  # the first step warms up kernels, allocator and the decode graph
                if use_cuda:
                    peak_memory.reset_peak(device)
                dist.barrier()
                t = time.perf_counter()
                out = runner.run(prompts, [""] * len(prompts), params)
                sync(device)
                step_s = time.perf_counter() - t
                if rep:
                    times["step_s"].append(step_s)
                    for k in PHASES:
                        times[k].append(out.timeline.total_s(k))
                    if shared:
                        resync.append(engine.resync_seconds[-1])
                log(f"rollout TP {t_roll} {mode} step {rep}: {step_s:.2f} s"
                    + (" (warm-up)" if rep == 0 else ""))
            row = {k: statistics.median(v) for k, v in times.items() if v}
            row["peak_gib"] = peak_memory.max_allocated(device) / 2**30 if use_cuda else 0.0
            row["schedule"] = str(out.schedule)
            if shared:
                row["resync_ms_median"] = 1e3 * statistics.median(resync)
                row["share_ratio"] = engine.sharer.report().share_ratio
            slowest = [None] * world
            dist.all_gather_object(slowest, row["step_s"])
            row["step_s_per_rank"] = slowest
            results["steps"][f"rollout_tp{t_roll}/{mode}"] = row
            log(json.dumps({f"rollout_tp{t_roll}/{mode}": {k: v for k, v in row.items() if k != "schedule"}}))
            if a.out and dist.get_rank() == 0:
                Path(a.out).write_text(json.dumps(results, indent=2))
        engine.release()
        del engine
        if use_cuda:
            torch.cuda.empty_cache()
    steps = results["steps"]
    for t_roll in a.rollout_tps:
        if f"rollout_tp{t_roll}/serial" in steps:
            base = steps[f"rollout_tp{t_roll}/serial"]["step_s"]
            for mode in a.modes:
                steps[f"rollout_tp{t_roll}/{mode}"]["speedup_vs_serial"] = base / steps[f"rollout_tp{t_roll}/{mode}"]["step_s"]
    summary = {k: {"step_s": v["step_s"], "speedup_vs_serial": v.get("speedup_vs_serial")} for k, v in steps.items()}
    log(json.dumps({"summary": summary}))
    if a.out and dist.get_rank() == 0:
        Path(a.out).write_text(json.dumps(results, indent=2))
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
