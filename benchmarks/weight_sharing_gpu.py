"""Weight sharing between training and rollout TP degrees on real ranks: check it, then time the resync.

    torchrun --nproc-per-node 2 benchmarks/weight_sharing_gpu.py --out ws_gpu.json                    # 2 x H200, NCCL
    OMP_NUM_THREADS=1 torchrun --nproc-per-node 2 benchmarks/weight_sharing_gpu.py --backend gloo --device cpu \\
        --geometry debug --dtype float32 --out ws_cpu.json                                            # CPU smoke run

Per configuration (actor dp x TP, FSDP2 or not -> rollout TP) the actor is built through the real parallelize
path (random weights, vision tower cut to --vision-depth blocks), the rollout model through WeightSharer, and:
  CHECK  storage   identical/view rollout tensors lie inside the actor's storage (data_ptr ranges), rebuilt do not;
                   the CUDA memory the sharer allocated equals its rebuilt buffers (+ the FSDP2 gather)
         logits    the rollout model's logits equal the actor's own (bf16: relative to the largest logit, <= --rtol)
         update    one SGD step of the actor (forward, backward, step): without FSDP2 the shared rollout tensors
                   show it before any resync (no copy) and rebuilt ones do not; after resync every rollout tensor
                   equals its slice of the actor's full parameter, and the logits still match
  MEASURE  share ratio, buffer bytes and bytes received per resync (the sharer's report); resync seconds, median of
           --repeats (release + resync; resync synchronises CUDA), and the FSDP2-regather part of it.
One JSON line per configuration on rank 0; all of them, with GPU name, torch version and date, in --out.
A failed check is recorded (not raised) so the other configurations still run; the exit code is 1 if any failed.
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
from torch.distributed.tensor import DTensor

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from torchplex.distributed.mesh import build_parallel_dims  # noqa: E402
from torchplex.distributed.weight_layout import ShareKind  # noqa: E402
from torchplex.distributed.weight_sharing import WeightSharer, shares_storage  # noqa: E402
from step_bench import bench_flavor, sync  # noqa: E402
from torchplex.models.qwen2_5_vl.build import build_model  # noqa: E402
from torchplex.distributed.fsdp import reshard  # noqa: E402
from torchplex.models.qwen2_5_vl.parallelize import parallelize_qwen2_5_vl  # noqa: E402
from torchplex.models.qwen2_5_vl.rope_index import get_rope_index  # noqa: E402

SHARED = (ShareKind.IDENTICAL, ShareKind.VIEW)
# (name, dp_shard, tp, fsdp, t_roll) for 2 ranks
CONFIGS = [
    ("tp2->roll1", 1, 2, False, 1),      # two rollout replicas, every TP'd decoder weight rebuilt
    ("tp2->roll2", 1, 2, False, 2),      # identical layouts: everything shared
    ("dp2->roll2", 2, 1, False, 2),      # two unsharded replicas -> one TP 2 rollout: views
    ("fsdp2->roll2", 2, 1, True, 2),     # FSDP2 over 2 -> TP 2 rollout: views of the gathered actor
    ("fsdp2->roll1", 2, 1, True, 1),     # FSDP2 over 2 -> unsplit rollout: the gathered actor itself
]


def log(rank: int, *msg) -> None:
    if rank == 0:
        print(*msg, flush=True)


def make_batch(args, device, grid=(1, 8, 8), text_tokens=24, samples=2) -> dict:
    """Two prompts: text, one image of grid t x h x w patches, text (the same on every rank)."""
    g = torch.Generator().manual_seed(1)
    t, h, w = grid
    image = [args.vision_start_token_id] + [args.image_token_id] * (t * h * w // 4) + [args.vision_end_token_id]
    vocab = min(args.text.vocab_size, 150000) - 100
    rows = [torch.randint(10, vocab, (text_tokens // 2,), generator=g).tolist() + image
            + torch.randint(10, vocab, (text_tokens // 2,), generator=g).tolist() for _ in range(samples)]
    input_ids = torch.tensor(rows)
    grid_thw = torch.tensor([grid] * samples)
    position_ids, _ = get_rope_index(args, input_ids, grid_thw)
    v = args.vision
    patch = v.in_channels * v.temporal_patch_size * v.patch_size ** 2
    return dict(input_ids=input_ids.to(device), position_ids=position_ids.to(device), grid_thw=grid_thw.to(device),
                pixel_values=torch.randn(samples * t * h * w, patch, generator=g).to(device))


def logits(model, b: dict) -> torch.Tensor:
    dtype = model.tok_embeddings.weight.dtype
    image = model.encode_vision(b["pixel_values"].to(dtype), b["grid_thw"])
    return model.logits(model(b["input_ids"], b["position_ids"], image_embeds=image)).float()


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    return ((actual - expected).abs().max() / expected.abs().max().clamp_min(1e-30)).item()


def allocated(device) -> int:
    return torch.cuda.memory_allocated(device) if device.type == "cuda" else 0


def full(t: torch.Tensor) -> torch.Tensor:
    t = t.detach()
    return t.full_tensor() if isinstance(t, DTensor) else t


def run_config(name, dp, tp, fsdp, t_roll, a, args, device, world) -> dict:
    rank = dist.get_rank()
    dtype = getattr(torch, a.dtype)
    dims = build_parallel_dims(dp, tp, world)
    t0 = time.perf_counter()
    actor = build_model(args, device=device, dtype=dtype,
                        parallelize=lambda m: parallelize_qwen2_5_vl(m, dims, fsdp=fsdp, param_dtype=dtype,
                                                                     reduce_dtype=torch.float32))
    sync(device)
    log(rank, f"[{name}] actor built in {time.perf_counter() - t0:.1f} s")
    batch = make_batch(args, device)
    failures: list[str] = []
    before = allocated(device)
    sharer = WeightSharer.for_actor(actor, dims, t_roll)
    sync(device)
    sharer_bytes = allocated(device) - before
    report = sharer.report()
    log(rank, f"[{name}] sharer built: {report.summary()}")

    # CHECK storage: with the actor gathered (what it holds during rollout)
    actor_params = dict(actor.named_parameters())
    for e in sharer.entries:
        inside = shares_storage(e.local, actor_params[e.plan.name])
        if inside != (e.plan.kind in SHARED):
            failures.append(f"storage: {e.plan.kind.value} {e.plan.name} inside actor storage = {inside}")
    gathered_bytes = 0
    if fsdp:  # the unsharded actor the sharer gathered, beside the rebuilt buffers
        gathered_bytes = sum(p.to_local().numel() * p.element_size() if isinstance(p, DTensor) else
                             p.numel() * p.element_size() for p in actor_params.values())
    expected_bytes = report.buffer_bytes + gathered_bytes
    if device.type == "cuda" and not fsdp and abs(sharer_bytes - expected_bytes) > (64 << 20):
        # FSDP2 may keep its own gather buffers: there the numbers are reported, not checked
        failures.append(f"memory: sharer allocated {sharer_bytes} B, rebuilt buffers = {expected_bytes} B")

    # CHECK logits: rollout model vs the actor, same weights
    with torch.no_grad():  # rollout first: an FSDP2 forward of the actor reshards the storage the rollout reads
        rollout_logits = logits(sharer.rollout_model, batch)
        actor_logits = logits(actor, batch)
    err_before = relative_error(rollout_logits, actor_logits)
    if err_before > a.rtol:
        failures.append(f"logits before the step: relative error {err_before:.2e} > {a.rtol}")
    del actor_logits, rollout_logits
    reshard(actor)
    sharer.release()

    # CHECK update: one SGD step of the actor (in place), then what the rollout sees before and after resync
    snapshot = {e.plan.name: e.local.clone() for e in sharer.entries} if not fsdp else {}
    sgd = torch.optim.SGD([p for p in actor.parameters() if p.requires_grad], lr=a.lr, foreach=False)
    out = logits(actor, batch)
    loss = torch.nn.functional.cross_entropy(out[:, :-1].reshape(-1, out.shape[-1]),
                                             batch["input_ids"][:, 1:].reshape(-1))
    loss.backward()
    del out
    reshard(actor)
    sgd.step()
    sgd.zero_grad(set_to_none=True)
    del sgd
    with torch.no_grad():  # bf16: some SGD updates are below a weight's rounding step; this one never is (|w| < 8)
        for p in actor.parameters():
            if p.requires_grad:
                p.add_(1 / 16)
    if not fsdp:  # without FSDP2 the step wrote into the storage the shared tensors alias
        for e in sharer.entries:
            moved = not torch.equal(e.local, snapshot[e.plan.name])
            if moved != (e.plan.kind in SHARED):
                failures.append(f"no-copy update: {e.plan.kind.value} {e.plan.name} changed before resync = {moved}")
    del snapshot
    sharer.resync()
    actor_params = dict(actor.named_parameters())
    worst = 0.0
    for e in sharer.entries:
        want = full(actor_params[e.plan.name])
        if e.actor_range is not None:
            want = want.narrow(*e.actor_range)
        if not torch.equal(e.local, want):
            worst = max(worst, (e.local.float() - want.float()).abs().max().item())
            failures.append(f"resync: {e.plan.kind.value} {e.plan.name} differs from the actor's slice")
        del want
    with torch.no_grad():
        rollout_logits = logits(sharer.rollout_model, batch)
        err_after = relative_error(rollout_logits, logits(actor, batch))
    if err_after > a.rtol:
        failures.append(f"logits after the step: relative error {err_after:.2e} > {a.rtol}")

    # MEASURE resync
    seconds, unshard = [], []
    for _ in range(a.repeats):
        reshard(actor)
        sharer.release()
        sync(device)
        dist.barrier()
        seconds.append(sharer.resync())
        unshard.append(sharer.report().unshard_seconds or 0.0)
    report = sharer.report()

    per_rank = [None] * world
    dist.all_gather_object(per_rank, {"failures": failures, "logits_rel_err": [err_before, err_after],
                                      "resync_s": statistics.median(seconds)})
    result = {
        "config": name, "dp_shard": dp, "tp": tp, "fsdp": fsdp, "t_roll": t_roll, "geometry": a.geometry,
        "vision_depth": a.vision_depth, "dtype": a.dtype, "ok": not any(r["failures"] for r in per_rank),
        "failures": [f"rank {i}: {f}" for i, r in enumerate(per_rank) for f in r["failures"][:10]],
        "share_ratio": report.share_ratio, "identical_gib": report.identical_bytes / 2**30,
        "view_gib": report.view_bytes / 2**30, "rebuilt_gib": report.rebuilt_bytes / 2**30,
        "rollout_gib_per_rank": report.total_bytes / 2**30,
        "received_per_resync_gib": report.rebuild_received_bytes / 2**30,
        "sharer_allocated_gib": sharer_bytes / 2**30, "expected_allocated_gib": expected_bytes / 2**30,
        "resync_ms_median": 1e3 * statistics.median(seconds), "resync_ms_all": [1e3 * s for s in seconds],
        "resync_ms_per_rank": [1e3 * r["resync_s"] for r in per_rank],
        "fsdp_regather_ms_median": 1e3 * statistics.median(unshard) if fsdp else None,
        "logits_rel_err": [r["logits_rel_err"] for r in per_rank], "rtol": a.rtol,
        "resync_check_worst_abs": worst,
    }
    if result["received_per_resync_gib"] > 0 and device.type == "cuda":
        rebuild_s = statistics.median(seconds) - (statistics.median(unshard) if fsdp else 0.0)
        result["rebuild_GBps_received"] = report.rebuild_received_bytes / max(rebuild_s, 1e-9) / 1e9
    reshard(actor)
    del sharer, actor, actor_params
    if device.type == "cuda":
        torch.cuda.empty_cache()
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--geometry", default="7B")
    ap.add_argument("--vision-depth", type=int, default=1)
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    ap.add_argument("--backend", default=None, help="nccl (CUDA default) or gloo")
    ap.add_argument("--device", default=None, help="cuda (default when available) or cpu")
    ap.add_argument("--configs", nargs="*", default=[c[0] for c in CONFIGS])
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--lr", type=float, default=1e-2, help="SGD step size of the update check")
    ap.add_argument("--rtol", type=float, default=None, help="logits tolerance (default 1e-1 bf16, 1e-5 fp32)")
    ap.add_argument("--out", default="")
    ap.add_argument("--watchdog-s", type=int, default=280)
    a = ap.parse_args()
    faulthandler.dump_traceback_later(a.watchdog_s, exit=True)
    if a.rtol is None:
        a.rtol = 1e-1 if a.dtype == "bfloat16" else 1e-5  # bf16: 28 layers of rounding, TP vs whole matmuls
    if a.device == "cpu":  # ParallelDims builds its meshes on default_device(): hide GPUs before CUDA starts
        os.environ["CUDA_VISIBLE_DEVICES"] = ""
    use_cuda = (a.device or ("cuda" if torch.cuda.is_available() else "cpu")) == "cuda"
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    device = torch.device("cuda", local_rank) if use_cuda else torch.device("cpu")
    if use_cuda:
        torch.cuda.set_device(device)
    dist.init_process_group(a.backend or ("nccl" if use_cuda else "gloo"), device_id=device if use_cuda else None)
    rank, world = dist.get_rank(), dist.get_world_size()
    if world != 2:
        raise SystemExit("run with torchrun --nproc-per-node 2")
    args = bench_flavor(a.geometry, a.vision_depth)
    info = {"device": torch.cuda.get_device_name(device) if use_cuda else "cpu", "gpus": world,
            "torch": torch.__version__, "date": time.strftime("%Y-%m-%d %H:%M"), "backend": dist.get_backend(),
            "NCCL_NVLS_ENABLE": os.environ.get("NCCL_NVLS_ENABLE"), "argv": sys.argv[1:]}
    log(rank, json.dumps({"info": info}))
    results = []
    for name, dp, tp, fsdp, t_roll in CONFIGS:
        if name not in a.configs:
            continue
        t0 = time.perf_counter()
        r = run_config(name, dp, tp, fsdp, t_roll, a, args, device, world)
        r["wall_s"] = time.perf_counter() - t0
        results.append(r)
        log(rank, json.dumps(r))
        if a.out and rank == 0:  # written after every configuration: a later hang still leaves these
            Path(a.out).write_text(json.dumps({"info": info, "results": results}, indent=2))
    ok = all(r["ok"] for r in results)
    log(rank, f"all checks {'passed' if ok else 'FAILED'} ({len(results)} configurations)")
    dist.destroy_process_group()
    sys.exit(0 if ok else 1)


if __name__ == "__main__":
    main()
