"""What every step benchmark shares: a run of `./run_train.sh` (the path a user runs: a shipped TOML, the Trainer),
its metrics.jsonl read back into a results row, and the random checkpoints and results-file header they need.

The benchmarks add timers and sweeps around this, never their own way of building the step: a setting one needs is a
config key passed on the command line (../shared/RESULTS.md, DEVELOPERS.md "The product is what we measure").
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

PHASES = ("data", "vision", "rollout", "ref", "train")


def random_checkpoint(root: str | Path, flavor: str, mean_response: int, smoke: bool = False) -> Path:
    """The random checkpoint of `flavor` with stop tokens for responses of `mean_response` tokens on average
    (tools/make_tiny_checkpoint.py: Qwen2.5's vocabulary, bf16, made on the GPU), written once under `root`;
    `smoke`: the tiny debug checkpoint instead (CPU). Written by the tool in a process of its own: the GPU memory it
    used (and its CUDA context) must not stay in this process beside the runs, which size their memory budget from
    what the device has free."""
    size = "debug" if smoke else flavor
    path = Path(root) / f"ckpt-{size}-mean{mean_response}"
    if not (path / "config.json").is_file():
        t = time.perf_counter()
        cmd = [sys.executable, str(ROOT / "tools" / "make_tiny_checkpoint.py"), "--output", str(path), "--size", size,
               "--mean-response", str(mean_response)]
        cmd += ["--dtype", "float32"] if smoke else ["--full-vocab", "--dtype", "bfloat16", "--device", "cuda"]
        subprocess.run(cmd, cwd=ROOT, check=True)
        print(f"[bench] random {size} checkpoint {path} in {time.perf_counter() - t:.1f}s", flush=True)
    return path


def run_train(config: str, name: str, overrides: list[str], work: str | Path, timeout_s: float
              ) -> tuple[int, float, Path]:
    """`NGPU=1 CONFIG_FILE=config ./run_train.sh` into <work>/runs/<name>, its output in <work>/<name>.log;
    (exit status, seconds, the log's path). 124: it ran past timeout_s."""
    log_path = Path(work) / f"{name}.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    env = dict(os.environ, CONFIG_FILE=config, NGPU="1", PYTHONUNBUFFERED="1")
    cmd = ["bash", str(ROOT / "run_train.sh"), f"--job.output_dir={Path(work) / 'runs'}", f"--job.name={name}",
           "--metrics.progress_bar=false", *overrides]
    print(f"[bench] CONFIG_FILE={config} {' '.join(cmd[1:])}", flush=True)
    t = time.perf_counter()
    with open(log_path, "w") as log:
        try:
            status = subprocess.run(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                    timeout=timeout_s).returncode
        except subprocess.TimeoutExpired:
            status = 124
    seconds = time.perf_counter() - t
    tail = log_path.read_text(errors="replace").splitlines()[-8:]
    print("\n".join(f"    {line}" for line in tail), flush=True)
    return status, seconds, log_path


def read_metrics(run_dir: str | Path) -> list[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


def ladder_record(record: dict) -> dict:
    """One step's decode at the ladder's sizes (rollout/ladder.py): the steps at each size (`steps_by_rows`), the
    rows decoded over its steps and the share of them that decoded a live sample (`live_fraction`: every token but
    each sample's first, sampled in the prefill), the CUDA graphs it captured and their seconds."""
    by_rows = {key.rsplit("/", 1)[1]: int(v) for key, v in record.items()
               if key.startswith("rollout/decode_rows/") and v}
    row_steps = record.get("rollout/row_steps", 0.0)
    decoded = record.get("rollout/generated_tokens", 0.0) - record.get("samples", 0.0)
    return {"steps_by_rows": by_rows, "row_steps": int(row_steps),
            "live_fraction": decoded / row_steps if row_steps else 0.0,
            "captures": int(record.get("rollout/captures", 0)), "capture_s": record.get("rollout/capture_s", 0.0)}


def steps_row(records: list[dict], launched: float, warm_up_steps: int = 1, peak_tflops: float = 0.0) -> dict:
    """A results row's timing fields from a run's metrics records: the step time (median of the steps after the
    warm-up ones, which compile), each phase's likewise, the peak memory, samples and tokens per step, the decode
    loop's ms per step, each compute phase's MFU (`flops/<phase>_tflop` over its time and `peak_tflops`), the
    micro-batches' token budgets and count, and what a user waits before the first step (`startup_s`: launch to its
    start) and for it (`first_step_s`)."""
    steps = [r for r in records if "time/step_s" in r]
    timed = steps[warm_up_steps:] or steps[-1:]
    median = lambda key: statistics.median(r.get(key, 0.0) for r in timed) if timed else 0.0
    phases = {p: median(f"time/{p}_s") for p in PHASES if median(f"time/{p}_s")}
    first = steps[0] if steps else {}
    row = {"step_s": median("time/step_s"), "steps_s": [r["time/step_s"] for r in steps], "phases_s": phases,
           "peak_gib": max((r.get("memory/peak_gib", 0.0) for r in timed), default=0.0),
           "samples": int(median("samples")), "tokens": int(median("tokens/samples")),
           "response_tokens": int(median("rollout/generated_tokens")),
           "first_step_s": first.get("time/step_s", 0.0),
           "startup_s": first["wall_time"] - first["time/step_s"] - launched if first else 0.0,
           "logprob_mismatch": median("rollout/logprob_mismatch")}
    if "micro_batch/tokens" in (timed[-1] if timed else {}):  # the planner's budgets and what they made
        row["micro_batch"] = {"tokens": int(median("micro_batch/tokens")),
                              "ref_tokens": int(median("micro_batch/ref_tokens")),
                              "train_count": int(median("micro_batch/train_count"))}
    steps_n = median("rollout/decode_steps")
    if steps_n:
        row["decode"] = {"s": median("rollout/decode_s"), "steps": int(steps_n),
                         "ms_per_step": 1e3 * median("rollout/decode_s") / steps_n, **ladder_record(timed[-1])}
    if peak_tflops:
        row["mfu"] = {p: median(f"flops/{p}_tflop") / s / peak_tflops for p, s in phases.items()
                      if f"flops/{p}_tflop" in timed[-1] and s > 0}
        row["peak_tflops"] = peak_tflops
    return row


def last_error(log_path: Path) -> str:
    """The line of a failed run's log that says why (its last error line, else its last line)."""
    lines = [line for line in log_path.read_text(errors="replace").splitlines() if line.strip()] \
        if log_path.is_file() else []
    errors = [line for line in lines if "Error" in line or "error:" in line or "Exception" in line]
    return (errors or lines or ["no output"])[-1].strip()[:400]


def matmul_peak_tflops(n: int = 8192, reps: int = 10) -> float:
    """A dense bf16 matmul's rate on this process's GPU (the MFU denominator), 0 without one."""
    import torch

    if not torch.cuda.is_available():
        return 0.0
    a = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(n, n, device="cuda", dtype=torch.bfloat16)
    for _ in range(3):
        a @ b
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(reps):
        a @ b
    torch.cuda.synchronize()
    rate = 2 * n ** 3 * reps / (time.perf_counter() - t) / 1e12
    del a, b
    torch.cuda.empty_cache()
    return rate


def results_header(topic: str, argv: list[str], script: str) -> dict:
    """The results file's fields besides its rows (../shared/RESULTS.md)."""
    import torch

    try:
        import transformers
        tf = transformers.__version__
    except ImportError:
        tf = ""
    cuda = torch.cuda.is_available()
    return {"topic": topic, "command": f"python benchmarks/{script} " + " ".join(argv),
            "device": torch.cuda.get_device_name() if cuda else "cpu", "gpus": 1 if cuda else 0,
            "torch": torch.__version__, "transformers": tf, "date": time.strftime("%Y-%m-%dT%H:%MZ", time.gmtime())}
