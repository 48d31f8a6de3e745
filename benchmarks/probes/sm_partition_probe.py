"""Does a memory-bound decode beside a compute-bound prefix forward overlap when the two run on disjoint SM
partitions? (issue 18: the 1.15x overlapped-vs-decomposed target needs ~3.4 s of training-side work hidden beside the
decode at img P = 32. `benchmarks/mode_ceiling.py` since bounds what hiding can give: the step's prefix forwards are
2.7-3.3 s there, so even all of them hidden stays under 1.15x; this probe says how much of that, or of vid's larger
prefix work, a partition could hide.)

`../shared/probes/FINDINGS.md` measured streams and `torch.cuda.GreenContext.create` twice: the two contexts took the
same SMs and ran in turns. Here one `cuDevSmResourceSplitByCount` call (cuda-bindings' driver API) cuts the device into
a group of N SMs and the remainder, which the driver guarantees disjoint; each gets a green context and a stream
(`torch.cuda.ExternalStream`). Work is launched eagerly on those streams (a graph captured elsewhere and replayed on a
green stream ignores its SM limit).

Decode: a batch of `--batch` rows through `--layers` layers of the 7B decoder's GEMMs (weights streamed from HBM,
one copy). Prefix: `--tokens` rows through the same layers of a second weight copy (compute-bound). For each N the
prefix runs on N SMs and the decode on the rest, as many prefix chunks as fill the decode's time; the speedup is the
time of the same work one after the other on the whole GPU over the time side by side (ideal ~2 when balanced).

    run(command="CUBLAS_WORKSPACE_CONFIG=:0:0 timeout -k 5 200 python benchmarks/probes/sm_partition_probe.py \
        --watchdog-s 190 --out $OUT/sm-partition.json")

Run on an H100 on 2026-12-06 (benchmarks/probes/sm_partition-20261206-*.json, docs/benchmarks.md). The speedup of a
graphed row is against the decode graph captured on every SM (the first run, h100, compared graphed rows with the
eager decode on every SM, which the host's launches slow at batch 64, on cold clocks). The second run (h100-warm):
beside the prefix chain the graphed decode on its part ran 1.5-1.9x slower than alone on every SM, and side by side
lost against one after the other (graphed: 0.78-0.98x at 32, 64 and 256 rows), so the runtime has no split. A failed partition stays a
row with its error.
"""
from __future__ import annotations

import argparse
import faulthandler
import json
import os
import sys
import time

import torch

HIDDEN, QKV, MLP = 3584, 3584 + 2 * 512, 18944  # Qwen2.5-VL-7B's decoder: 28 heads, 4 K/V heads of 128, MLP 18944


def layer_weights(layers: int, seed: int) -> list[tuple[torch.Tensor, ...]]:
    g = torch.Generator(device="cuda").manual_seed(seed)
    make = lambda *shape: (torch.randn(*shape, device="cuda", generator=g, dtype=torch.bfloat16) * 0.02)
    return [(make(HIDDEN, QKV), make(HIDDEN, HIDDEN), make(HIDDEN, 2 * MLP), make(MLP, HIDDEN)) for _ in range(layers)]


def forward(x: torch.Tensor, weights) -> torch.Tensor:
    """The decoder's GEMMs in order (no attention over a cache: the GEMMs are the weight-streaming part)."""
    for wqkv, wo, wgu, wd in weights:
        q = (x @ wqkv)[:, :HIDDEN]
        x = x + q @ wo
        gu = x @ wgu
        x = x + (torch.nn.functional.silu(gu[:, :MLP]) * gu[:, MLP:]) @ wd
    return x


def check(result):
    err, *rest = result
    if int(err) != 0:
        raise RuntimeError(f"CUDA driver error {err}")
    return rest[0] if len(rest) == 1 else rest


def partitions(sms: int):
    """(streams, SM counts): a group of at least `sms` SMs and the remainder, disjoint."""
    try:
        from cuda.bindings import driver
    except ImportError:  # cuda-python before 12.6 named the module cuda.cuda
        from cuda import cuda as driver

    dev = check(driver.cuDeviceGet(torch.cuda.current_device()))
    whole = check(driver.cuDeviceGetDevResource(dev, driver.CUdevResourceType.CU_DEV_RESOURCE_TYPE_SM))
    groups, _, rest = check(driver.cuDevSmResourceSplitByCount(1, whole, 0, sms))
    streams, counts = [], []
    for resource in (groups[0], rest):
        desc = check(driver.cuDevResourceGenerateDesc([resource], 1))
        ctx = check(driver.cuGreenCtxCreate(desc, dev, driver.CUgreenCtxCreate_flags.CU_GREEN_CTX_DEFAULT_STREAM))
        stream = check(driver.cuGreenCtxStreamCreate(ctx, driver.CUstream_flags.CU_STREAM_NON_BLOCKING, 0))
        streams.append(torch.cuda.ExternalStream(int(stream)))
        counts.append(int(resource.sm.smCount))
    return streams, counts, int(whole.sm.smCount)


def timed(fn, streams) -> float:
    for s in streams:
        s.synchronize()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    for s in streams:
        s.synchronize()
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def repeat(fn, stream, n: int):
    def run():
        with torch.cuda.stream(stream):
            for _ in range(n):
                fn()
    return run


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--batches", default="32,64,256", help="decode rows (live samples), one set of runs each")
    ap.add_argument("--tokens", type=int, default=4096, help="prefix rows per chunk")
    ap.add_argument("--sms", default="16,32,48,66", help="SMs of the prefix's partition, one run each")
    ap.add_argument("--decode-s", type=float, default=0.4, help="decode time per measurement on the whole GPU")
    ap.add_argument("--watchdog-s", type=float, default=250)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    faulthandler.dump_traceback_later(args.watchdog_s, exit=True)
    actor, ref = layer_weights(args.layers, 0), layer_weights(args.layers, 1)
    xp = torch.randn(args.tokens, HIDDEN, device="cuda", dtype=torch.bfloat16)
    prefix = lambda: forward(xp, ref)
    main_stream = torch.cuda.Stream()
    timed(repeat(prefix, main_stream, 3), [main_stream])
    t_pre = timed(repeat(prefix, main_stream, 10), [main_stream]) / 10
    weight_bytes = sum(w.numel() * w.element_size() for layer in actor for w in layer)
    flops = 2 * args.tokens * weight_bytes / 2
    rows = []
    head = dict(topic="probe", probe="sm_partition", command="python " + " ".join(sys.argv),
                device=torch.cuda.get_device_name(), gpus=1, torch=torch.__version__,
                date=time.strftime("%Y-%m-%dT%H:%MZ", time.gmtime()), layers=args.layers,
                tokens=args.tokens, prefix_ms=round(t_pre * 1e3, 2),
                prefix_tflops=round(flops / t_pre / 1e12, 1),
                cublas_workspace=os.environ.get("CUBLAS_WORKSPACE_CONFIG"), rows=rows)
    print(json.dumps({k: v for k, v in head.items() if k != "rows"}), flush=True)

    def dump():
        with open(args.out, "w") as f:
            json.dump(head, f, indent=1)

    cuts = {}
    for n in (int(s) for s in args.sms.split(",")):
        try:
            cuts[n] = partitions(n)
        except Exception as e:  # a split that failed stays a row with its error
            rows.append(dict(prefix_sms_asked=n, ok=False, error=f"split: {type(e).__name__}: {e}"))
    for batch in (int(b) for b in args.batches.split(",")):
        xd = torch.randn(batch, HIDDEN, device="cuda", dtype=torch.bfloat16)
        decode = lambda: forward(xd, actor)
        timed(repeat(decode, main_stream, 20), [main_stream])  # clocks up before the baseline
        t_eager = timed(repeat(decode, main_stream, 50), [main_stream]) / 50
        whole = torch.cuda.CUDAGraph()  # the baseline of the graphed rows: one step captured on every SM
        with torch.cuda.graph(whole, stream=main_stream):
            forward(xd, actor)
        timed(repeat(whole.replay, main_stream, 20), [main_stream])
        t_graph = timed(repeat(whole.replay, main_stream, 50), [main_stream]) / 50
        steps = max(1, int(args.decode_s / t_graph))
        base = dict(batch=batch, decode_ms=round(t_eager * 1e3, 3), decode_graph_ms=round(t_graph * 1e3, 3),
                    decode_hbm_tb_s=round(weight_bytes / t_graph / 1e12, 2), decode_steps=steps)
        print(json.dumps(base), flush=True)
        for n, ((s_pre, s_dec), (n_pre, n_dec), total) in cuts.items():
            for graphed in (False, True):
                row = dict(base, prefix_sms_asked=n, prefix_sms=n_pre, decode_sms=n_dec, device_sms=total,
                           decode_graph=graphed, ok=False, error="")
                rows.append(row)
                try:
                    step = decode
                    if graphed:  # one decode step captured on the decode partition's stream (the SM limit holds)
                        timed(repeat(decode, s_dec, 2), [s_dec])
                        graph = torch.cuda.CUDAGraph()
                        with torch.cuda.graph(graph, stream=s_dec):
                            forward(xd, actor)
                        step = graph.replay
                    for s, fn in ((s_pre, prefix), (s_dec, step)):
                        timed(repeat(fn, s, 2), [s])
                    d_alone = timed(repeat(step, s_dec, steps), [s_dec])
                    p_one = timed(repeat(prefix, s_pre, 2), [s_pre]) / 2
                    chunks = max(1, round(d_alone / p_one))  # prefix work that fills the decode's time
                    p_alone = timed(repeat(prefix, s_pre, chunks), [s_pre])

                    def both():
                        repeat(prefix, s_pre, chunks)()
                        repeat(step, s_dec, steps)()

                    t_both = min(timed(both, [s_pre, s_dec]) for _ in range(2))
                    t_dec = t_graph if graphed else t_eager  # the same kind of decode on every SM
                    serial_whole = steps * t_dec + chunks * t_pre
                    row.update(ok=True, chunks=chunks, decode_alone_s=round(d_alone, 4),
                               prefix_alone_s=round(p_alone, 4), together_s=round(t_both, 4),
                               serial_whole_gpu_s=round(serial_whole, 4),
                               decode_slowdown=round(d_alone / (steps * t_dec), 3),
                               prefix_slowdown=round(p_alone / (chunks * t_pre), 3),
                               decode_slowdown_together=round(t_both / (steps * t_dec), 3),
                               speedup=round(serial_whole / t_both, 3),
                               ideal=round(serial_whole / max(d_alone, p_alone), 3))
                except Exception as e:  # a row that failed stays, with its error
                    row["error"] = f"{type(e).__name__}: {e}"
                print(json.dumps(row), flush=True)
                dump()
    dump()


if __name__ == "__main__":
    main()
