"""Time the decode kernel of the prompt part (flex decoding, GQA folded into query rows) over kernel options.

    python benchmarks/probes/flex_decode_tune.py --out best.json   # H200: writes the fastest options per shape
    python benchmarks/probes/flex_decode_tune.py --shapes n8        # GRPO groups of 8 (56 query rows per K/V head)

Shapes are the 7B decode bench's: groups x 4 K/V heads, 7 query rows (n=1) or 56 (n=8), 2048 prompt tokens. Each
configuration is compiled once, captured 16 times in one CUDA graph and timed with triton's do_bench over replays (GPU
time, not the compiled wrapper's launch cost); achieved bandwidth = K/V bytes / time.
"""
import argparse
import faulthandler
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from torch.nn.attention.flex_attention import AuxRequest, flex_attention  # noqa: E402
from triton.testing import do_bench  # noqa: E402

from torchplex.rollout.decode_attention import length_block_mask, length_blocks  # noqa: E402


def time_config(groups, rows, length, options):
    torch._dynamo.reset()
    q = torch.randn(groups, 4, rows, 128, device="cuda", dtype=torch.bfloat16)
    k, v = (torch.randn(groups, 4, length, 128, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    lens = torch.full((groups,), length, device="cuda")
    mask = length_block_mask(length_blocks(lens, length), lambda b, h, qi, kv: kv < lens[b], rows, length)
    fn = torch.compile(lambda q, k, v: flex_attention(q, k, v, block_mask=mask, return_aux=AuxRequest(lse=True),
                                                      kernel_options=options), dynamic=False)
    fn(q, k, v)
    # Time GPU work, not launches: a compiled call's Python wrapper takes tens of microseconds, more than the kernel
    # of a small shape, so time replays of a CUDA graph that holds `calls` back-to-back calls.
    calls = 16
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn(q, k, v)
    ms = do_bench(graph.replay, warmup=20, rep=100) / calls
    return ms * 1e3, 2 * k.numel() * k.element_size() / (ms * 1e-3) / 1e9


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default="")
    ap.add_argument("--shapes", default="n1", choices=["n1", "n8"], help="n1: 64 and 256 groups of one sample "
                    "(7 rows); n8: 8 and 32 groups of 8 samples (56 rows), the decode bench's batch 64 and 256")
    ap.add_argument("--watchdog-s", type=int, default=170)
    a = ap.parse_args()
    faulthandler.dump_traceback_later(a.watchdog_s, exit=True)
    kernels = [dict(BLOCK_N=64, num_stages=3, num_warps=2), dict(BLOCK_N=64, num_stages=3, num_warps=4),
               dict(BLOCK_N=128, num_stages=3, num_warps=4), dict(BLOCK_N=128, num_stages=2, num_warps=8)]
    # (shape, splits to try): None is flex's own choice (2 per SM over batch x heads, at least 1)
    if a.shapes == "n1":
        plan = [((64, 7, 2048), (None, 2, 4, 8), kernels), ((256, 7, 2048), (None, 2), kernels),
                ((8, 56, 2048), (None, 16), kernels[:3:2])]
    else:  # few groups, many rows: the split over the prompt is what spreads the work over the SMs
        kernels_n8 = kernels + [dict(BLOCK_N=64, num_stages=1, num_warps=4),
                                dict(BLOCK_N=32, num_stages=3, num_warps=4)]
        plan = [((8, 56, 2048), (None, 4, 16, 32), kernels_n8), ((32, 56, 2048), (None, 2, 8), kernels_n8)]
    best = {}
    cases = [(shape, split, kern) for shape, splits, kerns in plan for split in splits for kern in kerns]
    for (groups, rows, length), split, kern in cases:
        options = dict(kern) if split is None else dict(kern, SPLIT_KV=split)
        try:
            us, gbps = time_config(groups, rows, length, options)
        except Exception as err:
            print(json.dumps({"shape": [groups, rows, length], "options": options, "error": repr(err)[:300]}), flush=True)
            continue
        print(json.dumps({"shape": [groups, rows, length], "options": options, "us": us, "GBps": gbps}), flush=True)
        key = f"{groups}x{rows}x{length}"
        if key not in best or us < best[key]["us"]:
            best[key] = {"options": options, "us": us, "GBps": gbps}
            if a.out:  # after every improvement: a run cut short still leaves its best so far
                Path(a.out).write_text(json.dumps(best, indent=1))
    print(json.dumps(best, indent=1))


if __name__ == "__main__":
    main()
