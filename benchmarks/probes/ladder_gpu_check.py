"""The decode ladder on a GPU: the compiled, captured decode at each ladder size against the full-pool decode and
the eager reference, on random weights, with long-tailed responses.

    python benchmarks/probes/ladder_gpu_check.py --out ladder-check.json            # debug geometry, ~1-2 min
    python benchmarks/probes/ladder_gpu_check.py --geometry 7B --prompts 16 --out ...  # 7B, a few minutes

Three engines sample the same prompts with the same seeds, in one process:
  eager    no compile, no graphs, the matmul attention, one rung (every slot every step): the CPU tests' path
  full     compiled and captured, the default kernel, one rung (every slot every step)
  ladder   compiled and captured, the default kernel, the default ladder
`ladder` against `full` is the ladder's own effect (same pieces, same kernels; rows only move between GEMM
shapes), `full` against `eager` the compiled path's; tokens may part at a near tie of rounding, after which a
sample's tokens differ, so log-probs are compared up to each sample's first differing token. Also: every
log-prob finite, the rows per step, captures and capture seconds per rollout (a second rollout after a release
captures again), and the compiled graphs per piece (one each, whatever the sizes). Writes one JSON object (topic
"decode", one row per engine); exits non-zero where a check fails.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import math
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from step_bench import bench_flavor, long_tail_stops, make_prompt  # noqa: E402
from torch._dynamo.eval_frame import _debug_get_cache_entry_list  # noqa: E402
from torchplex.models.qwen2_5_vl.model import Qwen2_5_VLModel  # noqa: E402
from torchplex.rollout import decode_attention, decode_step  # noqa: E402
from torchplex.rollout.engine import RolloutEngine  # noqa: E402
from torchplex.rollout.sampling import SamplingParams  # noqa: E402


def agreement(got, want) -> dict:
    """Samples with identical tokens; the largest |log-prob difference| up to each sample's first differing token."""
    same, total, worst = 0, 0, 0.0
    for g_got, g_want in zip(got, want):
        for a, b in zip(g_got, g_want):
            total += 1
            same += a.token_ids == b.token_ids
            agree = next((i for i, (x, y) in enumerate(zip(a.token_ids, b.token_ids)) if x != y),
                         min(len(a.token_ids), len(b.token_ids)))
            diffs = [abs(x - y) for x, y in zip(a.logprobs[:agree + 1], b.logprobs[:agree + 1])]
            worst = max([worst, *diffs])
    return {"same_samples": same, "samples": total, "max_logprob_diff": worst}


def rollout(model, prompts, params, name: str, **engine_args) -> tuple[list, dict]:
    engine = RolloutEngine(model, kv_pool_bytes=0, max_batch=len(prompts) * params.n, **engine_args)
    device = engine.device
    runs = []
    for _ in range(2):  # the second after a release: the graphs are captured again, nothing compiled
        rows = []
        t = time.perf_counter()
        before = engine.stats.captures, engine.stats.capture_s
        out = engine.generate(prompts, params, on_step=lambda info: rows.append(info.rows))
        if device.type == "cuda":
            torch.cuda.synchronize()
        runs.append({"rollout_s": time.perf_counter() - t, "steps": len(rows), "rows": rows,
                     "captures": engine.stats.captures - before[0],
                     "capture_s": engine.stats.capture_s - before[1]})
        engine.release()
    finite = all(math.isfinite(x) for g in out for o in g for x in o.logprobs)
    record = {"workload": "ladder-check", "mode": name, "kernel": engine.decode_kernel,
              "compiled": engine.use_compile, "cuda_graph": engine.use_graphs, "finite": finite, "runs": runs,
              "decode_rows": {str(k): v for k, v in engine.stats.decode_rows.items()}}
    print(json.dumps({k: v for k, v in record.items() if k != "runs"} | {"rollout_s": [r["rollout_s"] for r in runs]}),
          flush=True)
    return out, record


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--geometry", default="debug")
    ap.add_argument("--prompts", type=int, default=16)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--prompt-tokens", type=int, default=256)
    ap.add_argument("--max-new", type=int, default=128)
    ap.add_argument("--mean-response", type=int, default=24)
    ap.add_argument("--out", default="")
    ap.add_argument("--watchdog-s", type=int, default=420)
    ap.add_argument("--device", default="cuda", help="cpu: a smoke run of this script (compiled on the CPU, matmul "
                    "attention, no graphs)")
    a = ap.parse_args(argv)
    faulthandler.dump_traceback_later(a.watchdog_s, exit=True)
    args = bench_flavor(a.geometry, vision_depth=1)
    torch.manual_seed(0)
    with torch.device("meta"):
        model = Qwen2_5_VLModel(args)
    cuda = a.device == "cuda"
    model = model.to(torch.bfloat16 if cuda else torch.float32).to_empty(device=a.device)
    model.init_weights()
    model.eval().requires_grad_(False)
    prompts = [make_prompt(args, a.prompt_tokens, seed=i) for i in range(a.prompts)]
    params = SamplingParams(n=a.group, temperature=1.0, max_new_tokens=a.max_new, seed=1,
                            stop_token_ids=long_tail_stops(args.text.vocab_size, a.mean_response))
    eager, eager_rec = rollout(model, prompts, params, "eager", compile_decode=False, ladder=())
    torch._dynamo.reset()
    full, full_rec = rollout(model, prompts, params, "full", compile_decode=True, ladder=())
    ladder, ladder_rec = rollout(model, prompts, params, "ladder", compile_decode=True)
    pieces = (decode_step.step_in, decode_step.layer_in, decode_attention.attend, decode_step.layer_out,
              decode_step.step_out)
    graphs = {fn.__name__: len(_debug_get_cache_entry_list(fn)) for fn in pieces}
    checks = {"ladder_vs_full": agreement(ladder, full), "full_vs_eager": agreement(full, eager),
              "graphs_per_piece": graphs}
    rows = ladder_rec["runs"][0]["rows"]
    first, second = ladder_rec["runs"]
    checks.update(finite=all(r["finite"] for r in (eager_rec, full_rec, ladder_rec)),
                  one_graph_per_piece=set(graphs.values()) == {1}, rows_shrank=rows[-1] < rows[0],
                  captures_again_after_release=not cuda or second["captures"] == first["captures"] == len(set(rows)))
    ok = all(checks[k] for k in ("finite", "one_graph_per_piece", "rows_shrank", "captures_again_after_release"))
    result = {"topic": "decode", "command": "python benchmarks/probes/ladder_gpu_check.py " + " ".join(argv or []),
              "device": torch.cuda.get_device_name() if cuda else "cpu", "gpus": int(cuda), "torch": torch.__version__,
              "date": time.strftime("%Y-%m-%dT%H:%MZ", time.gmtime()), "checks": checks, "ok": ok,
              "rows": [dict(r, geometry=a.geometry, prompts=a.prompts, group=a.group, ok=r["finite"], error="")
                       for r in (eager_rec, full_rec, ladder_rec)]}
    print(json.dumps(checks), flush=True)
    if a.out:
        Path(a.out).write_text(json.dumps(result, indent=2))
    faulthandler.cancel_dump_traceback_later()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
