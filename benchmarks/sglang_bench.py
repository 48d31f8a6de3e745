"""The SGLang rollout backend against the native one (issue 20), writing benchmarks/results/sglang-*.json.

    python benchmarks/sglang_bench.py --suite train --ckpt /tmp/tiny --steps 4 --out benchmarks/results/sglang-DATE-train.json
    python benchmarks/sglang_bench.py --suite step --ckpt /tmp/ckpt7b --workloads img-small,img --out ...

train  a GRPO run of --steps steps on the checkpoint through the trainer (torchplex.train.Trainer), once per
       backend: rewards and losses finite, the rollout's log-probs against the trainer's recomputation (mean
       |rollout - trainer| and k3 per step: with SGLang they track the trainer only if every push reached it), and
       the bytes and seconds of each weight push.
step   the step benchmark of ../shared/WORKLOADS.md (img-small: P = 2, responses mean 128 cap 512; img: P = 8, mean
       256 cap 1024; G = 8) on the checkpoint's geometry with random image prompts, both backends side by side:
       step, rollout and weight-push time, GPU memory freed by SGLang's release during training, log-prob mismatch.
Every row records its "backend" and "deterministic": SGLang's deterministic inference (`--sglang-deterministic`,
rollout.sglang_deterministic: batch-invariant kernels, seeded samples) or its usual fast configuration; native
rows read false (their sampling is seeded per sample, but their kernels are not batch-invariant on a GPU).
A failure is a row with "ok": false and the error's first line. SGLang spawns its scheduler: this module is
import-safe (everything runs under `if __name__ == "__main__"`). benchmarks/sglang_gpu.sh installs SGLang and
runs both suites on the H200.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

WORKLOADS = {"img-small": dict(prompts=2, mean_response=128, cap=512), "img": dict(prompts=8, mean_response=256, cap=1024)}
BACKENDS = ("native", "sglang")


def parse_args(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--suite", choices=["train", "step"], required=True)
    ap.add_argument("--ckpt", required=True, help="HF Qwen2.5-VL folder (tools/make_tiny_checkpoint.py writes one)")
    ap.add_argument("--backends", default="native,sglang")
    ap.add_argument("--steps", type=int, default=4, help="train: GRPO steps per backend")
    ap.add_argument("--workloads", default="img-small,img", help="step: names of WORKLOADS")
    ap.add_argument("--prompts", type=int, default=0, help="step: prompts per step (0: the workload's P)")
    ap.add_argument("--group", type=int, default=8)
    ap.add_argument("--prompt-tokens", type=int, default=1024)
    ap.add_argument("--repeats", type=int, default=2, help="step: timed steps after one warm-up step")
    ap.add_argument("--max-new-tokens", type=int, default=0, help="step: response cap (0: the workload's)")
    ap.add_argument("--mean-response", type=int, default=0, help="step: mean response length (0: the workload's)")
    ap.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16"])
    ap.add_argument("--mem-fraction", type=float, default=0.3, help="SGLang's mem_fraction_static")
    ap.add_argument("--kv-pool-gib", type=float, default=16.0, help="native engine's KV pool")
    ap.add_argument("--timeout-s", type=float, default=600.0)
    ap.add_argument("--sglang-deterministic", action="store_true",
                    help="rollout.sglang_deterministic: SGLang's deterministic inference (default: its fast setup)")
    ap.add_argument("--out", default="")
    a = ap.parse_args(argv)
    a.backends = [b for b in a.backends.split(",") if b]
    a.workloads = [w for w in a.workloads.split(",") if w]
    bad = [b for b in a.backends if b not in BACKENDS] + [w for w in a.workloads if w not in WORKLOADS]
    if bad:
        ap.error(f"unknown backend or workload: {', '.join(bad)}")
    return a


def versions() -> dict:
    import transformers

    out = {"torch": torch.__version__, "transformers": transformers.__version__}
    try:
        import importlib.metadata as md

        out["sglang"] = md.version("sglang")
    except Exception:  # not installed: the sglang rows say why
        out["sglang"] = None
    return out


def write_results(path: str, rows: list[dict], argv: list[str], device: torch.device,
                  script: str = "benchmarks/sglang_bench.py") -> dict:
    """One results file per ../shared/RESULTS.md (topic "sglang")."""
    doc = {"topic": "sglang", "command": f"python {script} " + " ".join(argv),
           "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
           "gpus": 1 if device.type == "cuda" else 0, **versions(),
           "date": time.strftime("%Y-%m-%dT%H:%MZ", time.gmtime()), "rows": rows}
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(json.dumps(doc, indent=1) + "\n")
    return doc


def failed_row(base: dict, error: BaseException) -> dict:
    first = (str(error).strip().splitlines() or [""])[0]
    return {**base, "ok": False, "error": f"{type(error).__name__}: {first}"[:500]}


def finite(values) -> bool:
    return all(math.isfinite(v) for v in values)


# ---- train: a GRPO run through the trainer ----------------------------------------------------------------------
def train_row(a, backend: str, out_dir: Path, engine_factory=None) -> dict:
    from torchplex import train
    from torchplex.config import load_config
    from torchplex.rollout.sglang_backend import engine as sgl_engine

    saved = sgl_engine.default_engine_factory, train.check_sglang_available
    if engine_factory is not None:  # tests: a stand-in for sglang.Engine, on any device (restored below)
        sgl_engine.default_engine_factory = engine_factory
        train.check_sglang_available = lambda device: None
    try:
        return _train(a, backend, out_dir, train, load_config)
    finally:
        sgl_engine.default_engine_factory, train.check_sglang_available = saved


def length_reward(response: str, answer: str) -> float:
    """A reward that differs within a group even for a random model, so every step has a gradient and moves the
    weights SGLang must then be given (the task's own rewards are all 0 for the tiny random checkpoint)."""
    return len(response) / 100


def _train(a, backend, out_dir, train, load_config) -> dict:
    from torchplex.rl import rewards

    rewards.REWARD_FUNCTIONS.setdefault("bench_length", length_reward)
    args = {"job.config_file": Path(__file__).resolve().parents[1] / "train_configs" / "debug.toml",
            "job.output_dir": out_dir, "job.name": f"sglang_bench_{backend}", "rollout.backend": backend,
            "model.hf_checkpoint": a.ckpt, "model.make_tiny_if_missing": "false", "model.dtype": a.dtype,
            "data.synthetic_dir": out_dir / "synthetic", "data.synthetic_train": 64, "data.synthetic_eval": 4,
            "data.prompts_per_step": 4, "rollout.n_samples": a.group, "rollout.max_new_tokens": 32,
            "rollout.sglang_mem_fraction": a.mem_fraction, "rollout.sglang_timeout_s": a.timeout_s,
            "rollout.kv_pool_gib": min(a.kv_pool_gib, 2.0), "training.steps": a.steps,
            "rollout.sglang_deterministic": str(backend == "sglang" and a.sglang_deterministic).lower(),
            "training.sft_warmup_steps": 0, "metrics.progress_bar": "false", "metrics.tensorboard": "false",
            "metrics.eval_interval": 0, "checkpoint.enable": "false", "reward.functions": '["bench_length"]',
            "reward.weights": "[1.0]"}
    trainer = train.Trainer(load_config([f"--{k}={v}" for k, v in args.items()]))
    steps = []
    try:
        start = [p.detach().clone() for p in trainer.actor.parameters()]
        for _ in range(a.steps):
            metrics, _ok = trainer.train_step()
            steps.append(metrics)
        changed = any(not torch.equal(p0, p.detach()) for p0, p in zip(start, trainer.actor.parameters()))
        stats = getattr(trainer.engine, "stats", None)
        pushes = list(getattr(stats, "weight_push_s", []))
        row = {"workload": "tiny-grpo", "backend": backend, "steps": len(steps),
               "step_s": statistics.median(m["time/step_s"] for m in steps),
               "reward_mean": [m["reward/mean"] for m in steps], "loss": [m.get("loss", float("nan")) for m in steps],
               # a loss of ~0 is a step whose responses all ran to max_new_tokens: token-mean advantages cancel
               "response_length": [m["response_length/mean"] for m in steps],
               "logprob_mismatch": statistics.mean(m["rollout/logprob_mismatch"] for m in steps),
               "logprob_mismatch_per_step": [m["rollout/logprob_mismatch"] for m in steps],
               "mismatch_k3": statistics.mean(m["rollout/mismatch_k3"] for m in steps),
               "weight_push_s": statistics.median(pushes) if pushes else 0.0,
               "weight_push_bytes": list(getattr(stats, "weight_push_bytes", [])), "weights_changed": changed,
               "error": ""}
        row["ok"] = changed and finite(row["reward_mean"]) and finite(row["loss"]) and math.isfinite(row["logprob_mismatch"])
        return row
    finally:
        if hasattr(trainer.engine, "shutdown"):
            trainer.engine.shutdown()


# ---- step: the step benchmark with both backends ------------------------------------------------------------------
def step_rows(a, backend: str, workload: str, device: torch.device, engine_factory=None) -> dict:
    from benchmarks.bench_runtime import bench_config
    from benchmarks.step_bench import NullTokenizer, long_tail_stops, make_prompt
    from torchplex.components import peak_memory
    from torchplex.models.qwen2_5_vl.build import build_model
    from torchplex.rollout.logprob_mismatch import logprob_mismatch
    from torchplex.rollout.sampling import SamplingParams
    from torchplex.rollout.sglang_backend.engine import (SGLangRolloutEngine, check_sglang_available,
                                                         default_engine_factory)
    from torchplex.runtime.build import build_step_runtime
    from torchplex.runtime.rollout_weights import build_rollout_engine

    w = WORKLOADS[workload]
    P = a.prompts or w["prompts"]
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[a.dtype]
    actor = build_model(hf_dir=a.ckpt, device=device, dtype=dtype)
    reference = build_model(hf_dir=a.ckpt, device=device, dtype=dtype).eval().requires_grad_(False)
    args = actor.args
    prompts = [make_prompt(args, a.prompt_tokens, seed=i) for i in range(P)]
    params = SamplingParams(n=a.group, temperature=1.0, max_new_tokens=a.max_new_tokens or w["cap"], seed=0,
                            stop_token_ids=long_tail_stops(args.text.vocab_size, a.mean_response or w["mean_response"]))
    if backend == "sglang":
        if engine_factory is None:
            check_sglang_available(device)
        engine = SGLangRolloutEngine(actor, a.ckpt, dtype=a.dtype, mem_fraction=a.mem_fraction,
                                     timeout_s=a.timeout_s, base_gpu_id=device.index or 0,
                                     engine_factory=engine_factory or default_engine_factory,
                                     deterministic=a.sglang_deterministic)
    else:
        engine = build_rollout_engine(actor, None, 1, kv_pool_bytes=int(a.kv_pool_gib * 2**30), max_batch=256,
                                      pad_id=0, device=device)
    freed: list[float] = []
    if device.type == "cuda" and backend == "sglang":  # what SGLang's release hands back (device-wide free memory)
        release = engine.release

        def measured_release():
            torch.cuda.synchronize()
            before = torch.cuda.mem_get_info(device)[0]
            release()
            freed.append((torch.cuda.mem_get_info(device)[0] - before) / 2**30)
        engine.release = measured_release
    optimizer = torch.optim.AdamW([p for p in actor.parameters() if p.requires_grad], lr=1e-6)
    runner = build_step_runtime(bench_config("decomposed"), actor, reference, engine, optimizer, None,
                                NullTokenizer())
    times, rollout, mismatch, k3 = [], [], [], []
    try:
        for rep in range(a.repeats + 1):
            if device.type == "cuda":
                torch.cuda.synchronize()
            t0 = time.perf_counter()
            out = runner.run(prompts, [""] * P, params)
            if device.type == "cuda":
                torch.cuda.synchronize()
            if rep:  # the first step warms up (compilation, CUDA graphs, SGLang's JIT kernels)
                times.append(time.perf_counter() - t0)
                rollout.append(out.timeline.total_s("rollout"))
                exp = out.experience
                m = logprob_mismatch(exp.sampling_logprobs, exp.old_logprobs, exp.mask)
                mismatch.append(m["mean_abs"])
                k3.append(m["k3"])
        stats = getattr(engine, "stats", None)
        pushes = list(getattr(stats, "weight_push_s", []))[1:]
        return {"workload": workload, "geometry": f"{args.text.num_layers}L-{args.text.hidden_size}",
                "prompts": P, "group": a.group, "mode": "decomposed", "backend": backend,
                "step_s": statistics.median(times), "phases_s": {"rollout": statistics.median(rollout)},
                "weight_push_s": statistics.median(pushes) if pushes else 0.0,
                "released_gib": statistics.median(freed) if freed else 0.0,
                "peak_gib": peak_memory.max_allocated(device) / 2**30 if device.type == "cuda" else 0.0,
                "samples": P * a.group, "tokens": int(out.experience.lengths.sum()),
                "logprob_mismatch": statistics.mean(mismatch), "mismatch_k3": statistics.mean(k3),
                "ok": finite(times + mismatch), "error": ""}
    finally:
        if hasattr(engine, "shutdown"):
            engine.shutdown()


def main(argv=None, engine_factory=None) -> dict:
    argv = list(sys.argv[1:] if argv is None else argv)
    a = parse_args(argv)
    device = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")
    rows = []
    out_dir = Path(tempfile.mkdtemp(prefix="sglang_bench_"))  # the trainer's run folders, not results
    for backend in a.backends:
        cases = ["tiny-grpo"] if a.suite == "train" else a.workloads
        for workload in cases:
            base = {"workload": workload, "backend": backend, "suite": a.suite,
                    "deterministic": backend == "sglang" and a.sglang_deterministic}
            print(f"[sglang_bench {time.strftime('%H:%M:%S')}] {a.suite} {workload} {backend}", flush=True)
            try:
                row = (train_row(a, backend, out_dir, engine_factory) if a.suite == "train"
                       else step_rows(a, backend, workload, device, engine_factory))
                rows.append({**base, **row})
            except Exception as e:  # noqa: BLE001 - a failed case is a row, the next case still runs
                traceback.print_exc()
                rows.append(failed_row(base, e))
            print(json.dumps(rows[-1]), flush=True)
            # after every row: a later row that hangs until the device call's limit kills the process must not
            # take the finished rows with it
            write_results(a.out, rows, argv, device)
            if device.type == "cuda":
                from torchplex.components import peak_memory
                torch.cuda.empty_cache()
                peak_memory.reset_peak(device)  # what the step's windows carried too
    return write_results(a.out, rows, argv, device)  # also with no rows: the file says what ran


if __name__ == "__main__":
    main()
