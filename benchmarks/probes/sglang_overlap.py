"""Does the trainer's prefix work run beside SGLang's decode? (issue 20) Writes one sglang-*.json results file.

    python tools/make_tiny_checkpoint.py --size 7B --no-weights --output /tmp/ckpt7b   # 7B geometry, no weights
    python benchmarks/probes/sglang_overlap.py --ckpt /tmp/ckpt7b --prompts 8 --out $OUT/sglang-DATE-overlap.json
    (benchmarks/sglang_gpu.sh overlap runs it twice: without, then with an NVIDIA MPS daemon of its own)

SGLang's model runs in its scheduler process, so this process's kernels and SGLang's share the GPU by time-slicing
unless MPS is on. Timed on one GPU, after a warm-up of each: (a) SGLang rolling out P prompts x G samples alone,
(b) the trainer-side work the planner would place beside it, alone: the reference model's no-grad prefix forward
of the same prompts (`DecomposedScorer.prefix`, repeated --prefix-rounds times), (c) both at once: (b) on a side
stream of a second host thread while the main thread waits on SGLang's rollout. gain = (a + b) / c: 1 means the
two only took turns, 2 a perfect overlap. The planner keeps window work beside SGLang off; this is the measurement
that decides whether a backend capability for it is worth building.
"""

from __future__ import annotations

import argparse
import faulthandler
import statistics
import sys
import threading
import time
from contextlib import nullcontext
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.sglang_bench import failed_row, write_results  # noqa: E402
from benchmarks.step_bench import long_tail_stops, make_prompt  # noqa: E402
from torchplex.models.qwen2_5_vl.args import ModelArgs  # noqa: E402
from torchplex.models.qwen2_5_vl.build import build_model  # noqa: E402
from torchplex.rollout.sampling import SamplingParams  # noqa: E402
from torchplex.runtime.decomposition import DecomposedScorer  # noqa: E402


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--ckpt", required=True, help="HF Qwen2.5-VL folder (tools/make_tiny_checkpoint.py writes one)")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--prompt-tokens", type=int, default=1024)
    ap.add_argument("--mean-response", type=int, default=256)
    ap.add_argument("--max-new-tokens", type=int, default=1024)
    ap.add_argument("--prefix-rounds", type=int, default=0, help="prefix passes in (b); 0: as many as fill (a)")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--mps", action="store_true", help="label: an MPS daemon is serving this run (sglang_gpu.sh)")
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--mem-fraction", type=float, default=0.3)
    ap.add_argument("--timeout-s", type=float, default=300.0)
    ap.add_argument("--watchdog-s", type=float, default=0.0)
    ap.add_argument("--out", default="")
    return ap.parse_args(argv)


def sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def measure(engine, reference, prompts, params, rounds: int, device) -> dict:
    """(a), (b) and (c) once each, in seconds."""
    stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def prefix_work():
        with torch.no_grad(), (torch.cuda.stream(stream) if stream is not None else nullcontext()):
            for _ in range(rounds):
                DecomposedScorer().prefix(reference, prompts)
            if stream is not None:
                stream.synchronize()

    sync(device)
    t = time.perf_counter()
    engine.generate(prompts, params)
    rollout = time.perf_counter() - t
    engine.release()
    t = time.perf_counter()
    prefix_work()
    sync(device)
    prefix = time.perf_counter() - t
    done: dict[str, float] = {}
    worker = threading.Thread(target=lambda: (prefix_work(), done.setdefault("prefix", time.perf_counter())))
    sync(device)
    t = time.perf_counter()
    worker.start()
    engine.generate(prompts, params)
    done["rollout"] = time.perf_counter()
    worker.join()
    sync(device)
    together = time.perf_counter() - t
    engine.release()
    return {"rollout_alone_s": rollout, "prefix_alone_s": prefix, "together_s": together,
            "rollout_together_s": done["rollout"] - t, "prefix_together_s": done["prefix"] - t}


def main(argv=None, engine_factory=None) -> dict:
    argv = list(sys.argv[1:] if argv is None else argv)
    a = parse_args(argv)
    if a.watchdog_s:
        faulthandler.dump_traceback_later(a.watchdog_s, exit=True)
    from torchplex.rollout.sglang_backend.engine import (SGLangRolloutEngine, check_sglang_available,
                                                         default_engine_factory)

    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[a.dtype]
    base = {"workload": "img", "backend": "sglang", "suite": "overlap", "mps": a.mps, "prompts": a.prompts,
            "group": a.group}
    rows, engine = [], None
    if a.out:  # a failed row first: SGLang kills this process when its scheduler dies, before any except runs
        write_results(a.out, [failed_row(base, RuntimeError("the probe ended before its measurement finished "
                                                            "(killed or crashed: see its log)"))],
                      argv, device, script="benchmarks/probes/sglang_overlap.py")
    try:
        if engine_factory is None:
            check_sglang_available(device)
        # a folder without weights (make_tiny_checkpoint --no-weights): random-init models here, and SGLang starts on
        # dummy weights; the engine pushes the actor's before the first rollout either way
        dummy = not any(Path(a.ckpt).glob("*.safetensors"))
        load = (lambda seed: build_model(ModelArgs.from_hf_dir(a.ckpt), device=device, dtype=dtype, seed=seed)) \
            if dummy else (lambda seed: build_model(hf_dir=a.ckpt, device=device, dtype=dtype))
        actor, reference = load(0), load(1).eval().requires_grad_(False)
        args = actor.args
        prompts = [make_prompt(args, a.prompt_tokens, seed=i) for i in range(a.prompts)]
        params = SamplingParams(n=a.group, temperature=1.0, max_new_tokens=a.max_new_tokens, seed=0,
                                stop_token_ids=long_tail_stops(args.text.vocab_size, a.mean_response))
        engine = SGLangRolloutEngine(actor, a.ckpt, dtype=a.dtype, mem_fraction=a.mem_fraction, timeout_s=a.timeout_s,
                                     base_gpu_id=device.index or 0, engine_factory=engine_factory or default_engine_factory,
                                     extra_settings={"load_format": "dummy"} if dummy else None)
        engine.generate(prompts, params)  # warm-up: SGLang's JIT kernels, CUDA graphs; our prefix kernels below
        engine.release()
        with torch.no_grad():
            sync(device)
            t = time.perf_counter()
            DecomposedScorer().prefix(reference, prompts)
            sync(device)
            one = time.perf_counter() - t
        rounds = a.prefix_rounds
        if not rounds:  # as much prefix work as one rollout takes, so a perfect overlap would halve the pair
            t = time.perf_counter()
            engine.generate(prompts, params)
            engine.release()
            rounds = max(1, round((time.perf_counter() - t) / max(one, 1e-6)))
        runs = [measure(engine, reference, prompts, params, rounds, device) for _ in range(a.repeats)]
        row = {k: statistics.median(r[k] for r in runs) for k in runs[0]}
        row["gain"] = (row["rollout_alone_s"] + row["prefix_alone_s"]) / row["together_s"]
        rows.append({**base, "geometry": f"{args.text.num_layers}L-{args.text.hidden_size}", "prefix_rounds": rounds,
                     **row, "ok": True, "error": ""})
    except Exception as e:  # noqa: BLE001 - the failure is the row
        import traceback

        traceback.print_exc()
        rows.append(failed_row(base, e))
    finally:
        if engine is not None:
            engine.shutdown()
    print(rows[-1], flush=True)
    return write_results(a.out, rows, argv, device, script="benchmarks/probes/sglang_overlap.py")


if __name__ == "__main__":
    main()
