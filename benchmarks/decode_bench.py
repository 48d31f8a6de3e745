"""Decode-step speed of the native rollout engine against its bandwidth floor and transformers' generate.

    python benchmarks/decode_bench.py --geometry 7B --batch 64 256 --group 1 8 --context 2048 --steps 64 --hf \
        --hf-batch 64 256

Random bf16 weights with the Qwen2.5-VL language geometry (the vision tower plays no part in decode and is cut
to one block). A batch of B sequences is B/n prompt groups of n samples (`--group`): n=1 gives every sequence its
own 2048-token context, n=8 is a GRPO rollout (8 samples of each prompt reading that prompt's one copy of K/V).
The contexts are already in the KV pool, so the timed loop is pure decode: embed, 28 layers over the cache, LM
head, sampling. The floor is the bytes one step must read (weights + every prompt's K/V, once) over the copy
bandwidth measured in the same process. transformers runs `generate` on B sequences of the same length (it has no
shared-prefix decode: a group of n samples is n sequences with n copies of the prompt's K/V, the same work as B
distinct prompts); its per-step time is the median time between two of its generated tokens inside one `generate`
call (a stopping criterion that only timestamps each step).
Also runs a long loop of replays (--long-steps) under a watchdog, since long CUDA-graph replay loops hung on
this machine before (../shared/probes/FINDINGS.md).
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

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from step_bench import bench_flavor  # noqa: E402
from torchplex.models.qwen2_5_vl.model import Qwen2_5_VLModel  # noqa: E402
from torchplex.rollout.engine import RolloutEngine  # noqa: E402
from torchplex.rollout.sampling import SamplingParams  # noqa: E402


def copy_bandwidth(device) -> float:
    """Bytes/s of a large device-to-device copy (read + write counted)."""
    x = torch.empty(2 * 2**30, dtype=torch.uint8, device=device)
    y = torch.empty_like(x)
    for _ in range(3):
        y.copy_(x)
    torch.cuda.synchronize()
    t = time.perf_counter()
    reps = 20
    for _ in range(reps):
        y.copy_(x)
    torch.cuda.synchronize()
    return 2 * x.numel() * reps / (time.perf_counter() - t)


def native_decode(model, batch: int, context: int, steps: int, warmup: int, compile_decode: bool,
                  kernel: str | None = None, graphs: bool = True, profile_dir: str = "",
                  flex_options: dict | None = None, group: int = 1, fused_qkv: bool | None = None,
                  compile_options: dict | None = None):
    """Seconds per decode step (and the first step's seconds: compilation + capture) of `batch` sequences in
    groups of `group` samples sharing one prompt context."""
    args = model.args
    if batch % group:
        raise ValueError(f"--batch {batch} is not a multiple of --group {group}")
    engine = RolloutEngine(model, kv_pool_bytes=200 * 2**30, max_batch=batch, compile_decode=compile_decode,
                           decode_kernel=kernel, flex_options=flex_options, fused_qkv=fused_qkv,
                           compile_options=compile_options)
    if engine.fused_qkv:
        model.fuse_qkv()  # what generate() does before decoding
    engine.use_graphs = engine.use_graphs and graphs
    max_new = steps + warmup + 2 + 4  # 4: the profiled steps
    pool = engine._pool_for(group, context, max_new, batch // group)
    pool.prompt_len[:] = context
    for t in pool.prefix_k + pool.prefix_v:
        t.normal_(0, 1)
    params = SamplingParams(n=group, temperature=1.0, max_new_tokens=max_new, seed=0)
    step_fn = engine._step(params)
    dev = model.output_weight.device
    tokens = torch.randint(0, args.text.vocab_size, (batch,), device=dev)
    seeds = torch.arange(batch, device=dev)
    start = torch.full((batch,), context, device=dev)

    def run(i):
        nonlocal tokens
        count = torch.full((batch,), i + 1, device=dev)
        tok, lp = step_fn(params, tokens, start + i, count - 1, seeds, count)
        tokens = tok.clone()

    t = time.perf_counter()
    run(0)
    torch.cuda.synchronize()
    first_s = time.perf_counter() - t
    for i in range(1, warmup):
        run(i)
    torch.cuda.synchronize()
    t = time.perf_counter()
    for i in range(warmup, warmup + steps):
        run(i)
    torch.cuda.synchronize()
    per_step = (time.perf_counter() - t) / steps
    if profile_dir:
        kernel_table(lambda: [run(warmup + steps + i) for i in range(4)], Path(profile_dir),
                     f"b{batch}_n{group}_{engine.decode_kernel}" + ("_autotune" if compile_options else ""))
    kv_bytes = sum(x.numel() * x.element_size() for x in pool.prefix_k + pool.prefix_v)
    engine.release()
    return per_step, kv_bytes, first_s


AUTOTUNE = {"max_autotune_gemm": True}


def kernel_table(work, out_dir: Path, name: str, top: int = 25) -> None:
    """GPU time per kernel over `work` (torch.profiler), the largest first, written to out_dir/kernels_<name>.txt."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        work()
        torch.cuda.synchronize()
    out_dir.mkdir(parents=True, exist_ok=True)
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=top, max_name_column_width=70)
    (out_dir / f"kernels_{name}.txt").write_text(table)
    print(table[:4000], flush=True)


def attention_check(model, device) -> float:
    """Largest |flex - matmul| / max|matmul| of one decode attention call on the GPU, compiled flex against the eager
    matmul kernel, for groups of n=4 with prompt lengths that straddle flex's K/V blocks."""
    from torchplex.rollout.kv_pool import GroupedDecodeAttention, GroupKVPool

    t = model.args.text
    pool = GroupKVPool(num_layers=1, num_kv_heads=t.num_kv_heads, head_dim=t.head_dim, n=4, max_prompt=640,
                       max_new=200, budget_bytes=2**30, max_groups=3, dtype=torch.bfloat16, device=device)
    pool.prompt_len.copy_(torch.tensor([1, 300, 640]))
    for x in pool.prefix_k + pool.prefix_v + pool.suffix_k + pool.suffix_v:
        x.normal_()
    suffix_len = torch.tensor([0, 5, 127, 128, 129, 199, 3, 64, 100, 150, 1, 2], device=device)
    q, k, v = (torch.randn(12, h, 1, t.head_dim, device=device, dtype=torch.bfloat16)
               for h in (t.num_heads, t.num_kv_heads, t.num_kv_heads))
    ref = GroupedDecodeAttention(pool, suffix_len, "matmul")(0, q, k, v).float()
    flex = torch.compile(lambda q, k, v: GroupedDecodeAttention(pool, suffix_len, "flex")(0, q, k, v))(q, k, v).float()
    return ((flex - ref).abs().max() / ref.abs().max()).item()


def hf_model(args):
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    cfg = Qwen2_5_VLConfig(**args.to_hf_config())
    with torch.device("cuda"):
        return Qwen2_5_VLForConditionalGeneration(cfg).to(torch.bfloat16).eval()


class StepClock:
    """A transformers stopping criterion that never stops: it timestamps each generated token (after a device
    sync), so per-step decode time comes from inside one `generate` call, free of the prefill's run-to-run noise."""

    def __init__(self):
        self.times: list[float] = []

    def __call__(self, input_ids, scores, **kwargs):
        torch.cuda.synchronize()
        self.times.append(time.perf_counter())
        return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)


def hf_decode(hf, batch: int, context: int, new_tokens: int, warm_up: bool = True) -> dict:
    """transformers' generate on `batch` sequences of `context` random tokens: the median time between two
    generated tokens (per decode step), and the generate call's wall time."""
    from transformers import StoppingCriteriaList

    ids = torch.randint(0, 1000, (batch, context), device=hf.device)
    mask = torch.ones_like(ids)

    def generate(k, clock=None):
        with torch.no_grad():
            hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=k, min_new_tokens=k, do_sample=True,
                        pad_token_id=0, stopping_criteria=StoppingCriteriaList([clock] if clock else []))

    if warm_up:
        generate(2)
    clock = StepClock()
    torch.cuda.synchronize()
    t = time.perf_counter()
    generate(1 + new_tokens, clock)
    wall = time.perf_counter() - t
    steps = [b - a for a, b in zip(clock.times, clock.times[1:])]  # the first token comes with the prefill
    torch.cuda.empty_cache()
    return {"step_ms": statistics.median(steps) * 1e3, "step_ms_min": min(steps) * 1e3,
            "step_ms_max": max(steps) * 1e3, "steps": len(steps), "generate_s": wall}


def decode_row(geometry: str, batch: int, group: int, variant: str, per_step: float = 0.0, floor: float = 0.0,
               peak_bytes: int = 0, error: str = "", **extra) -> dict:
    """One (batch, group, variant) as a row of ../shared/RESULTS.md: a "step" is one decode step of `batch`
    sequences (`batch` tokens), `floor_fraction` the bandwidth floor over its time; `error` makes it a failed row."""
    row = {"workload": "decode", "geometry": geometry, "prompts": batch // group, "group": group, "mode": variant,
           "step_s": per_step, "phases_s": {"decode": per_step} if per_step else {}, "peak_gib": peak_bytes / 2**30,
           "samples": batch, "tokens": batch, "ok": not error, "error": error, "batch": batch, "variant": variant}
    if per_step:
        row.update(step_ms=per_step * 1e3, tokens_per_s=batch / per_step, floor_ms=floor * 1e3,
                   fraction_of_floor=floor / per_step, floor_fraction=floor / per_step)
    return {**row, **extra}


def results_doc(argv: list[str], info: dict, rows: list[dict]) -> dict:
    """The run as a results file of ../shared/RESULTS.md (topic "decode"), the run's facts under "info"."""
    import transformers

    return {"topic": "decode", "command": "python benchmarks/decode_bench.py " + " ".join(argv),
            "device": info["gpu"], "gpus": 1, "torch": info["torch"], "transformers": transformers.__version__,
            "date": time.strftime("%Y-%m-%dT%H:%MZ", time.gmtime()), "info": info, "rows": rows}


def main(argv: list[str] | None = None):
    argv = sys.argv[1:] if argv is None else argv
    ap = argparse.ArgumentParser()
    ap.add_argument("--geometry", default="7B")
    ap.add_argument("--batch", type=int, nargs="+", default=[64, 256])
    ap.add_argument("--group", type=int, nargs="+", default=[1], help="samples per prompt group: 1 = every sequence "
                    "its own context; 8 = GRPO-shaped (8 samples read one prompt's K/V)")
    ap.add_argument("--context", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--warmup", type=int, default=8)
    ap.add_argument("--hf", action="store_true", help="also time transformers' generate")
    ap.add_argument("--hf-new-tokens", type=int, default=32)
    ap.add_argument("--hf-batch", type=int, nargs="+", default=[64], help="batches to time transformers at")
    ap.add_argument("--autotune", action="store_true", help="also time the step compiled with inductor's GEMM "
                    "autotuning (RolloutEngine(compile_options={'max_autotune_gemm': True}): Triton templates "
                    "against cuBLAS per shape)")
    ap.add_argument("--eager", action="store_true", help="no compile, no CUDA graph: launch every kernel each step")
    ap.add_argument("--baseline", action="store_true",
                    help="also time the matmul-attention step compiled (no flex) and eager (no compile, no graph)")
    ap.add_argument("--qkv-baseline", action="store_true", help="also time the step with q/k/v projected by three "
                    "GEMMs (RolloutEngine(fused_qkv=False); the engine's default on CUDA fuses them)")
    ap.add_argument("--profile-dir", default="", help="write per-kernel GPU time tables of a few steps here")
    ap.add_argument("--flex-options-file", default="", help="JSON of benchmarks/probes/flex_decode_tune.py: use its "
                    "fastest kernel options for the prompt call (key '<groups>x<rows>x<context>')")
    ap.add_argument("--long-steps", type=int, default=0, help="replays in the long-run hang check")
    ap.add_argument("--out", default="")
    ap.add_argument("--watchdog-s", type=int, default=540, help="dump stacks and exit if still running")
    a = ap.parse_args(argv)
    faulthandler.dump_traceback_later(a.watchdog_s, exit=True)
    dev = torch.device("cuda")
    args = bench_flavor(a.geometry, vision_depth=1)  # the tower plays no part in decode
    info = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "date": time.strftime("%Y-%m-%d"),
            "geometry": a.geometry, "context": a.context, "cuda_graph": not a.eager,
            "cublas_workspace_config": os.environ.get("CUBLAS_WORKSPACE_CONFIG", "")}
    hf_ms = {}
    if a.hf:  # first, while the GPU holds nothing else: a batch-256 prefill of 2048 tokens needs most of the card
        import transformers
        info["transformers"] = transformers.__version__
        hf = hf_model(args)
        for i, batch in enumerate(a.hf_batch):
            t = time.perf_counter()
            try:
                timing = hf_decode(hf, batch, a.context, a.hf_new_tokens, warm_up=i == 0)
                hf_ms[batch] = timing["step_ms"]
            except torch.OutOfMemoryError as err:
                timing, hf_ms[batch] = {"error": str(err)[:200]}, None
            torch.cuda.empty_cache()
            info.setdefault("transformers_steps", {})[batch] = timing
            print(json.dumps({"hf_batch": batch, **timing, "wall_s": time.perf_counter() - t}), flush=True)
        del hf
        torch.cuda.empty_cache()
    torch.manual_seed(0)
    with torch.device("meta"):
        model = Qwen2_5_VLModel(args)
    model = model.to(torch.bfloat16).to_empty(device=dev)
    model.init_weights()
    model.eval().requires_grad_(False)  # the timed loop calls the step directly, outside generate's no_grad
    bw = copy_bandwidth(dev)
    info["copy_bandwidth_GBps"] = bw / 1e9
    lm = model.layers, model.tok_embeddings, model.norm
    weight_bytes = sum(p.numel() * p.element_size() for m in lm for p in m.parameters())
    weight_bytes += model.output_weight.numel() * model.output_weight.element_size() * (model.output is not None)
    rows = []
    if not a.eager:
        try:
            info["flex_vs_matmul_max_rel_err"] = attention_check(model, dev)
        except Exception as err:
            info["flex_vs_matmul_max_rel_err"] = repr(err)[:2000]
        print(json.dumps({"flex_vs_matmul_max_rel_err": info["flex_vs_matmul_max_rel_err"]}), flush=True)
    tuned = json.loads(Path(a.flex_options_file).read_text()) if a.flex_options_file else {}
    for group in a.group:
        variants = [("compiled", not a.eager, None, True)]
        if a.qkv_baseline:
            variants.append(("compiled_separate_qkv", True, None, True))
        if a.autotune:
            variants.append(("compiled_autotune", True, None, True))
        if a.baseline:
            variants += [("compiled_matmul", True, "matmul", True), ("eager_matmul", False, "matmul", False)]
        for batch in a.batch:
            for label, compile_decode, kernel, graphs in variants:
                if label not in ("compiled", "compiled_separate_qkv", "compiled_autotune") and batch != a.batch[0]:
                    continue
                q_rows = args.text.num_heads // args.text.num_kv_heads * group  # query rows per K/V head
                options = tuned.get(f"{batch // group}x{q_rows}x{a.context}", {}).get("options")
                t = time.perf_counter()
                torch.cuda.reset_peak_memory_stats(dev)
                try:
                    per_step, kv_bytes, first_s = native_decode(model, batch, a.context, a.steps, a.warmup,
                                                                compile_decode, kernel, graphs, a.profile_dir,
                                                                options, group,
                                                                False if label.endswith("separate_qkv") else None,
                                                                AUTOTUNE if label.endswith("autotune") else None)
                except Exception as err:  # keep the other variants' numbers: this one is a failed row
                    first = (str(err).strip().splitlines() or [""])[0]
                    error = f"{type(err).__name__}: {first}"[:500]
                    rows.append(decode_row(a.geometry, batch, group, label, error=error,
                                           peak_bytes=torch.cuda.max_memory_allocated(dev)))
                    print(json.dumps({**rows[-1], "error": repr(err)[:2000]}), flush=True)
                    continue
                # One step reads every weight once (the tied/untied LM head included) and each prompt's K/V once.
                floor = (weight_bytes + kv_bytes) / bw
                row = decode_row(a.geometry, batch, group, label, per_step, floor, torch.cuda.max_memory_allocated(dev),
                                 flex_options=options, first_step_s=first_s, wall_s=time.perf_counter() - t)
                if hf_ms.get(batch):
                    row.update(hf_step_ms=hf_ms[batch], speedup_vs_hf=hf_ms[batch] / (per_step * 1e3))
                rows.append(row)
                print(json.dumps(row), flush=True)
    if a.long_steps:
        t = time.perf_counter()
        per_step, _, _ = native_decode(model, a.batch[0], a.context, a.long_steps, 2, not a.eager)
        info["long_run"] = {"batch": a.batch[0], "replays": a.long_steps, "step_ms": per_step * 1e3,
                            "completed": True, "wall_s": time.perf_counter() - t}
        print(json.dumps(info["long_run"]), flush=True)
    result = results_doc(argv, info, rows)
    print(json.dumps(info))
    if a.out:
        Path(a.out).write_text(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
