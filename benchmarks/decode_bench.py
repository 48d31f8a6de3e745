"""Decode step time of the native rollout engine at each ladder size, against that size's floor.

    python benchmarks/decode_bench.py --geometry 7B --groups 64 --group 8 --context 1050 --own 256 \
        --rows 8 16 32 64 128 192 256 384 512 --steps 32 --watchdog-s 170 --out decode-<date>-ladder.json

(meant to finish within two minutes on one GPU, the first size's compilation included; `--whole-layer`
times the engine with each layer one compiled graph instead of three pieces; `--smoke` runs the debug geometry
eagerly on the CPU in seconds, as tests/test_decode_bench.py does.)

Random bf16 weights of the Qwen2.5-VL language geometry (the vision tower plays no part in decode and is cut to one
block). The KV pool is a GRPO rollout's: `--groups` prompt groups of `--group` samples, every prompt `--context`
tokens already in the pool. A step of B rows decodes B samples spread over the groups first (row r: sample r // groups
of group r % groups, like a long-tailed rollout's tail, where most groups still have a live sample), each `--own` tokens
into its response: the rollout's own step (rollout/decode_step.py: its pieces compiled, one CUDA graph per size)
and its per-step bookkeeping (DecodeState.advance), nothing else. Sizes run from the largest down, as a rollout
meets them, so the graphs share one memory pool sized by the first.

The floor of a size is the larger of
  bytes / copy bandwidth: every weight the step reads (the decoder layers, the final norm and the LM head; of the
      embedding table only B rows) plus the K/V it attends to (the prompts of the groups with a row, once each, and
      each row's own tokens), over the bandwidth of a large device copy (read + write counted), and
  FLOPs / matmul peak: 2 x those weights' parameters per row plus the attention (4 x heads x head_dim per key per
      layer), over the FLOP/s of a large bf16 matmul,
both measured in this process. `floor_fraction` is the floor over the measured step time.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from step_bench import bench_flavor  # noqa: E402
from torchplex.models.qwen2_5_vl.model import Qwen2_5_VLModel  # noqa: E402
from torchplex.rollout.decode_state import DecodeState  # noqa: E402
from torchplex.rollout.engine import RolloutEngine  # noqa: E402
from torchplex.rollout.ladder import pool_ladder  # noqa: E402
from torchplex.rollout.sampling import SamplingParams  # noqa: E402

SMOKE = ["--geometry", "debug", "--groups", "2", "--group", "2", "--context", "40", "--own", "4",
         "--rows", "1", "2", "4", "--steps", "2", "--warmup", "1"]


def sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize()


def copy_bandwidth(device, nbytes: int = 2 * 2**30, reps: int = 20) -> float:
    """Bytes/s of a large device copy (read + write counted), the median of `reps`."""
    x = torch.empty(nbytes, dtype=torch.uint8, device=device)
    y = torch.empty_like(x)
    times = []
    for i in range(reps + 3):
        sync(device)
        t = time.perf_counter()
        y.copy_(x)
        sync(device)
        if i >= 3:
            times.append(time.perf_counter() - t)
    return 2 * nbytes / statistics.median(times)


def matmul_peak(device, n: int = 8192, reps: int = 10) -> float:
    """FLOP/s of a large dense matmul (bf16 on CUDA, fp32 on the CPU), the median of `reps`."""
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    a, b = (torch.randn(n, n, device=device, dtype=dtype) for _ in range(2))
    times = []
    for i in range(reps + 3):
        sync(device)
        t = time.perf_counter()
        a @ b
        sync(device)
        if i >= 3:
            times.append(time.perf_counter() - t)
    return 2 * n ** 3 / statistics.median(times)


@dataclass
class StepWork:
    """What one decode step of `rows` rows must read and compute."""

    weight_bytes: int
    kv_bytes: int
    flops: float

    def floor_s(self, bandwidth: float, peak: float) -> tuple[float, float]:
        """(bytes over bandwidth, FLOPs over peak), seconds."""
        return (self.weight_bytes + self.kv_bytes) / bandwidth, self.flops / peak


def step_work(model, pool, rows: int, context: int, own: int) -> StepWork:
    """The weights read once (layers, final norm, LM head, and B rows of the embedding table), the K/V of the groups
    with a row (rows spread over the groups first) and of each row's own tokens, and the FLOPs of both."""
    t = model.args.text
    dense = [p for m in (model.layers, model.norm) for p in m.parameters()] + [model.output_weight]
    weight_params = sum(p.numel() for p in dense)
    element = model.output_weight.element_size()
    weight_bytes = weight_params * element + rows * t.hidden_size * element
    per_token = 2 * t.num_layers * t.num_kv_heads * t.head_dim * pool.prefix_k[0].element_size()
    groups = min(rows, pool.num_groups)
    kv_bytes = per_token * (groups * context + rows * own)
    attention = 4 * t.num_heads * t.head_dim * (context + own) * t.num_layers
    return StepWork(weight_bytes, kv_bytes, float(rows * (2 * weight_params + attention)))


def spread_slots(pool, rows: int) -> list[int]:
    """`rows` sample slots, one per group before any group's second: slot j of group g for r = j * groups + g."""
    return sorted((r % pool.num_groups) * pool.n + r // pool.num_groups for r in range(rows))


def time_size(engine, state: DecodeState, step, rows: int, a, device) -> tuple[float, float]:
    """(seconds of the first step at this size: the capture, and the compilation where it is the first; seconds
    per step over `a.steps` steps after `a.warmup`)."""
    state.remap(spread_slots(engine.pool, rows), pool_ladder(engine.pool.num_slots, (rows,)))
    sync(device)
    t = time.perf_counter()
    state.advance(step(state.rows))
    sync(device)
    first_s = time.perf_counter() - t
    for _ in range(a.warmup):
        state.advance(step(state.rows))
    sync(device)
    t = time.perf_counter()
    for _ in range(a.steps):
        state.advance(step(state.rows))
    sync(device)
    return first_s, (time.perf_counter() - t) / a.steps


def decode_pool(engine, a, device) -> tuple[DecodeState, SamplingParams]:
    """The engine's pool with every group's prompt in place (random K/V), and the decode state of samples `a.own`
    tokens into their responses."""
    max_new = a.own + a.warmup + a.steps + 4  # each size starts again from the slots' state: own + 1 tokens
    params = SamplingParams(n=a.group, temperature=1.0, max_new_tokens=max_new, seed=0)
    pool = engine._pool_for(a.group, a.context, max_new, a.groups)
    pool.prompt_len.fill_(a.context)
    for t in pool.prefix_k + pool.prefix_v:
        t.normal_()
    state = DecodeState(pool, params, device)
    state.gen_count.fill_(a.own + 1)
    state.active.fill_(True)
    state.start_pos.fill_(a.context)
    state.seeds.copy_(torch.arange(pool.num_slots, device=device))
    state.last_token.random_(0, engine.model.args.text.vocab_size)
    return state, params


def decode_row(geometry: str, groups: int, group: int, rows: int, per_step: float = 0.0, floor: tuple = (0.0, 0.0),
               peak_bytes: int = 0, error: str = "", variant: str = "", **extra) -> dict:
    """One ladder size as a row of ../shared/RESULTS.md (topic "decode"): a "step" is one decode step of `rows`
    rows (`rows` tokens), `floor_fraction` the floor (the larger of its bytes and FLOPs parts) over its time;
    `error` makes it a failed row."""
    row = {"workload": "decode", "geometry": geometry, "prompts": groups, "group": group,
           "mode": f"rows-{rows}" + (f"-{variant}" if variant else ""),
           "rows": rows, "step_s": per_step, "phases_s": {"decode": per_step} if per_step else {},
           "peak_gib": peak_bytes / 2**30, "samples": rows, "tokens": rows, "ok": not error, "error": error}
    if per_step:
        floor_s = max(floor)
        row.update(step_ms=per_step * 1e3, tokens_per_s=rows / per_step, floor_ms=floor_s * 1e3,
                   floor_bytes_ms=floor[0] * 1e3, floor_flops_ms=floor[1] * 1e3,
                   floor_bound="bytes" if floor[0] >= floor[1] else "flops", floor_fraction=floor_s / per_step)
    return {**row, **extra}


def results_doc(argv: list[str], info: dict, rows: list[dict]) -> dict:
    """The run as a results file of ../shared/RESULTS.md (topic "decode"), the run's facts under "info"."""
    import transformers

    return {"topic": "decode", "command": "python benchmarks/decode_bench.py " + " ".join(argv),
            "device": info["device"], "gpus": 1 if info["device"] != "cpu" else 0, "torch": info["torch"],
            "transformers": transformers.__version__, "date": time.strftime("%Y-%m-%dT%H:%MZ", time.gmtime()),
            "info": info, "rows": rows}


def build(a, device):
    torch.manual_seed(0)
    with torch.device("meta"):
        model = Qwen2_5_VLModel(bench_flavor(a.geometry, vision_depth=1))  # the tower plays no part in decode
    model = model.to(torch.bfloat16 if device.type == "cuda" else torch.float32).to_empty(device=device)
    model.init_weights()
    model.eval().requires_grad_(False)  # the timed loop calls the step directly, outside generate's no_grad
    engine = RolloutEngine(model, kv_pool_bytes=0, max_batch=a.groups * a.group, compile_decode=not a.eager,
                           whole_layer_graphs=a.whole_layer)
    return model, engine


def measure(a, model, engine, device, bandwidth: float, peak: float, emit) -> list[dict]:
    """One row per size, each handed to `emit` as it is made."""
    state, params = decode_pool(engine, a, device)
    if engine.fused_qkv:
        model.fuse_qkv()  # what generate does before decoding
    step = engine.decode_step(params)
    variant = "whole-layer" if a.whole_layer else ""
    rows_out = []
    for rows in sorted(a.rows, reverse=True):
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        try:
            first_s, per_step = time_size(engine, state, step, rows, a, device)
        except Exception as err:  # keep the other sizes' numbers: this one is a failed row
            first = (str(err).strip().splitlines() or [""])[0]
            rows_out.append(decode_row(a.geometry, a.groups, a.group, rows, variant=variant,
                                       error=f"{type(err).__name__}: {first}"[:500]))
            print(json.dumps({**rows_out[-1], "error": repr(err)[:2000]}), flush=True)
            emit(rows_out)
            continue
        work = step_work(model, engine.pool, rows, a.context, a.own + (a.warmup + a.steps) // 2)
        peak_bytes = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else 0
        rows_out.append(decode_row(a.geometry, a.groups, a.group, rows, per_step, work.floor_s(bandwidth, peak),
                                   peak_bytes, variant=variant, first_step_s=first_s, weight_bytes=work.weight_bytes,
                                   kv_bytes=work.kv_bytes, flops=work.flops))
        print(json.dumps(rows_out[-1]), flush=True)
        emit(rows_out)
    return rows_out


def parse(argv: list[str]) -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    ap.add_argument("--smoke", action="store_true", help="the debug geometry on the CPU, eager (tests)")
    ap.add_argument("--geometry", default="7B")
    ap.add_argument("--groups", type=int, default=64, help="prompt groups in the pool")
    ap.add_argument("--group", type=int, default=8, help="samples per prompt group")
    ap.add_argument("--context", type=int, default=1050, help="prompt tokens of every group")
    ap.add_argument("--own", type=int, default=256, help="tokens each sample has generated when timing starts")
    ap.add_argument("--rows", type=int, nargs="+", default=[8, 16, 32, 64, 128, 192, 256, 384, 512],
                    help="ladder sizes to time (each at most groups x group)")
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--eager", action="store_true", help="no compile, no CUDA graph: launch every kernel each step")
    ap.add_argument("--whole-layer", action="store_true", help="RolloutEngine(whole_layer_graphs=True): each layer "
                    "one compiled graph instead of three pieces")
    ap.add_argument("--out", default="")
    ap.add_argument("--watchdog-s", type=int, default=170, help="dump stacks and exit if still running")
    return ap.parse_args(SMOKE + argv if "--smoke" in argv else argv)  # the arguments given win over SMOKE's


def main(argv: list[str] | None = None):
    argv = sys.argv[1:] if argv is None else argv
    a = parse(argv)
    faulthandler.dump_traceback_later(a.watchdog_s, exit=True)
    try:
        return run(a, argv)
    finally:
        faulthandler.cancel_dump_traceback_later()


def run(a, argv: list[str]) -> dict:
    device = torch.device("cpu" if a.smoke else "cuda")
    if a.smoke:
        a.eager = True
    t0 = time.perf_counter()
    bandwidth = copy_bandwidth(device, 2 * 2**30 if device.type == "cuda" else 2**26)
    peak = matmul_peak(device, 8192 if device.type == "cuda" else 256)
    model, engine = build(a, device)
    info = {"device": torch.cuda.get_device_name() if device.type == "cuda" else "cpu", "torch": torch.__version__,
            "geometry": a.geometry, "groups": a.groups, "group": a.group, "context": a.context, "own": a.own,
            "cuda_graph": engine.use_graphs, "compiled": engine.use_compile, "kernel": engine.decode_kernel,
            "whole_layer": a.whole_layer,
            "copy_bandwidth_GBps": bandwidth / 1e9, "matmul_peak_TFLOPs": peak / 1e12}

    def emit(rows: list[dict]) -> dict:
        """The results file as it stands: written after every size, so a size that hangs until the watchdog keeps
        the others' rows."""
        info.update(captures=engine.stats.captures, capture_s=engine.stats.capture_s,
                    wall_s=time.perf_counter() - t0)
        result = results_doc(argv, info, rows)
        if a.out:
            Path(a.out).write_text(json.dumps(result, indent=2))
        return result

    result = emit(measure(a, model, engine, device, bandwidth, peak, emit))
    print(json.dumps(info), flush=True)
    return result


if __name__ == "__main__":
    main()
