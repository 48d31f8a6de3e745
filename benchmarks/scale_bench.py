"""Whole GRPO steps at real batch sizes, through the path a user runs: one `./run_train.sh` run per (prompts per step
P, mode), with a shipped recipe's TOML, on the reference workloads of ../shared/WORKLOADS.md.

    python benchmarks/scale_bench.py --workload img --prompts 8,32,64 --modes serial,decomposed,overlapped   # GPU
    python benchmarks/scale_bench.py --workload vid --prompts 4,16 --modes decomposed,overlapped
    python benchmarks/scale_bench.py --smoke --prompts 1,2 --modes serial,decomposed                       # CPU
    python benchmarks/scale_bench.py --config train_configs/qwen2_5_vl_3b.toml --workload img-256 --prompts 4 \
        --topic microbatch --budgets 0,40 --set rollout.kv_pool_gib=0   # issue 49: each mode at two memory budgets

A workload is a random checkpoint of the recipe's geometry whose stop tokens give long-tailed responses of the
workload's mean (tools/make_tiny_checkpoint.py --mean-response) and the trainer's own synthetic task at the
workload's image or video size (data.synthetic_size, data.synthetic_frames); everything else is the recipe's
settings plus `--set` overrides (config keys, recorded in the results). Each row is read from its run's
metrics.jsonl (benchmarks/product_run.py): the step time (median of the timed steps after --warm-up-steps), the
phases, peak allocated GiB, samples and tokens per step, the decode loop, MFU per compute phase (the trainer's
counted FLOPs over a dense bf16 matmul rate measured here), the rollout-vs-trainer log-prob mismatch. A run that fails
is an `ok: false` row with its error, and the script goes on; a mode whose step passed --max-step-s is not run at
larger P. Rows go to benchmarks/results/<topic>-YYYYMMDD-<workload>.json (--topic, "scale" by default:
../shared/RESULTS.md), and --plot draws step time and seconds per sample against P per mode. --budgets runs every
(P, mode) at each memory.budget_gib given (0: the device's), a row's `budget_gib`; each row carries the micro-batch
token budgets the planner chose and the training micro-batches they made (`micro_batch`, from the run's metrics).
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.product_run import (last_error, matmul_peak_tflops, random_checkpoint, read_metrics,  # noqa: E402
                                    results_header, run_train, steps_row)

# ../shared/WORKLOADS.md: the synthetic task at this size, responses of this mean and cap
WORKLOADS = {
    "img": dict(task="shapes", size=896, frames=0, mean_response=256, response=1024),  # 1,024 vision tokens
    "vid": dict(task="video_counting", size=448, frames=32, mean_response=256, response=1024),  # 16 x 256 tokens
    "img-small": dict(task="shapes", size=896, frames=0, mean_response=128, response=512),
    # issue 49's shape: the img prompts with responses of exactly 256 tokens (no long-tail stop tokens: a random
    # model almost never samples the two stop ids it keeps)
    "img-256": dict(task="shapes", size=896, frames=0, mean_response=0, response=256),
}
MODES = ("serial", "decomposed", "overlapped")


def workload_overrides(a, P: int) -> list[str]:
    w = WORKLOADS[a.workload]
    steps = a.warm_up_steps + a.repeats
    size = 112 if a.smoke else w["size"]
    return [f"--data.synthetic_task={w['task']}", f"--data.synthetic_size={size}",
            f"--data.synthetic_frames={w['frames'] if not a.smoke else 8 if w['frames'] else 0}",
            f"--data.synthetic_dir={Path(a.work) / f'synthetic-{a.workload}-{size}'}",
            f"--data.synthetic_train={max(P * steps, 8)}", "--data.synthetic_eval=1",
            f"--data.prompts_per_step={P}", f"--rollout.max_new_tokens={8 if a.smoke else w['response']}",
            f"--training.steps={steps}", "--checkpoint.enable=false", "--metrics.eval_interval=0",
            "--training.sft_warmup_steps=0", "--job.overwrite=true"]


def failed_row(a, mode: str, P: int, error: str, budget_gib: float = 0.0) -> dict:
    return {"workload": a.workload, "config": a.config, "prompts": P, "mode": mode, "budget_gib": budget_gib,
            "step_s": 0.0, "phases_s": {}, "peak_gib": 0.0, "samples": 0, "tokens": 0, "ok": False, "error": error}


def run_row(a, ckpt: Path, P: int, mode: str, budget_gib: float = 0.0) -> dict:
    """One `run_train.sh` run of (P, mode) at memory.budget_gib `budget_gib` (0: the device's), as a results row."""
    name = f"{a.topic}-{a.workload}-{P}-{mode}" + (f"-{budget_gib:g}gib" if budget_gib else "")
    overrides = [f"--model.hf_checkpoint={ckpt}", f"--runtime.mode={mode}", *workload_overrides(a, P),
                 *(f"--{kv}" for kv in a.set), *([f"--memory.budget_gib={budget_gib:g}"] if budget_gib else [])]
    launched = time.time()
    status, seconds, log = run_train(a.config, name, overrides, a.work, a.run_timeout_s)
    records = read_metrics(Path(a.work) / "runs" / name)
    if status != 0:
        return dict(failed_row(a, mode, P, f"exit {status}: {last_error(log)}", budget_gib), run_s=seconds,
                    steps_s=[r["time/step_s"] for r in records if "time/step_s" in r])
    row = {"workload": a.workload, "config": a.config, "geometry": a.geometry, "prompts": P, "mode": mode,
           "budget_gib": budget_gib, "ok": True, "error": "", "run_s": seconds, "warm_up_steps": a.warm_up_steps,
           **steps_row(records, launched, a.warm_up_steps, a.peak_tflops)}
    row["group"] = row["samples"] // P if P else 0
    row["s_per_sample"] = row["step_s"] / max(row["samples"], 1)
    return row


def draw(rows: list[dict], path: Path, title: str) -> Path:
    """Step time and seconds per sample against P, one line per mode and memory budget (the rows that ran)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(10, 4))
    for mode, budget in dict.fromkeys((r["mode"], r.get("budget_gib", 0)) for r in rows):
        ok = sorted((r for r in rows if (r["mode"], r.get("budget_gib", 0)) == (mode, budget) and r["ok"]),
                    key=lambda r: r["prompts"])
        label = f"{mode}, {budget:g} GiB" if budget else mode
        if ok:
            P = [r["prompts"] for r in ok]
            left.plot(P, [r["step_s"] for r in ok], marker="o", label=label)
            right.plot(P, [r["s_per_sample"] for r in ok], marker="o", label=label)
    left.set(xlabel="prompts per step P", ylabel="step time (s)", title="step time")
    right.set(xlabel="prompts per step P", ylabel="seconds per sample", title="cost per sample")
    for ax in (left, right):
        ax.grid(alpha=0.3)
        if ax.get_lines():
            ax.legend()
    fig.suptitle(title)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def parse(argv: list[str]):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", default="train_configs/qwen2_5_vl_7b.toml", help="the recipe TOML the runs start from")
    ap.add_argument("--workload", default="img", choices=sorted(WORKLOADS))
    ap.add_argument("--prompts", default="8,32,64", help="comma-separated prompts per step")
    ap.add_argument("--modes", default="serial,decomposed,overlapped", help=f"comma-separated subset of {MODES}")
    ap.add_argument("--warm-up-steps", type=int, default=1, help="steps before the timed ones (compilation)")
    ap.add_argument("--repeats", type=int, default=2, help="timed steps")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="a config override for every run, e.g. algorithm.micro_batch_tokens=8192")
    ap.add_argument("--budgets", default="0", help="comma-separated memory.budget_gib per (P, mode); 0: the device's")
    ap.add_argument("--topic", default="scale", help="the results file's topic (../shared/RESULTS.md)")
    ap.add_argument("--work", default="/tmp/scale", help="run folders, data, logs, the random checkpoint")
    ap.add_argument("--ckpt-root", default=None, help="where the random checkpoint is written (default: --work)")
    ap.add_argument("--max-step-s", type=float, default=240.0, help="a mode past this is not run at larger P")
    ap.add_argument("--run-timeout-s", type=float, default=900)
    ap.add_argument("--watchdog-s", type=float, default=0, help="dump every thread's stack and exit after this long")
    ap.add_argument("--smoke", action="store_true", help="CPU: the tiny debug checkpoint, small images, 8 tokens")
    ap.add_argument("--out", default="", help="results JSON (default benchmarks/results/TOPIC-DATE-<workload>.json)")
    ap.add_argument("--plot", default="", help="PNG of step time and s/sample vs P")
    a = ap.parse_args(argv)
    a.prompt_list = [int(x) for x in a.prompts.split(",") if x]
    a.mode_list = [m for m in a.modes.split(",") if m]
    a.budget_list = [float(x) for x in a.budgets.split(",") if x]
    if set(a.mode_list) - set(MODES):
        ap.error(f"unknown modes {sorted(set(a.mode_list) - set(MODES))}; choose from {MODES}")
    if a.smoke:
        a.set = ["model.dtype=float32", "model.compile=false", "model.activation_checkpointing=false",
                 "rollout.n_samples=2", "rollout.kv_pool_gib=0.25", "algorithm.micro_batch_size=4", *a.set]
    return a


def main(argv: list[str] | None = None) -> dict:
    import tomllib

    argv = sys.argv[1:] if argv is None else argv
    a = parse(argv)
    if a.watchdog_s:
        faulthandler.dump_traceback_later(a.watchdog_s, exit=True)
    a.geometry = tomllib.loads(Path(a.config).read_text())["model"]["flavor"]
    a.peak_tflops = matmul_peak_tflops()
    ckpt = random_checkpoint(a.ckpt_root or a.work, a.geometry, WORKLOADS[a.workload]["mean_response"], a.smoke)
    rows: list[dict] = []
    result = {**results_header(a.topic, argv, "scale_bench.py"), "peak_tflops": a.peak_tflops, "overrides": a.set,
              "rows": rows}
    out = Path(a.out or f"benchmarks/results/{a.topic}-{time.strftime('%Y%m%d', time.gmtime())}-{a.workload}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    stopped: dict[tuple, str] = {}
    for P in a.prompt_list:
        for budget in a.budget_list:
            for mode in a.mode_list:
                key = (mode, budget)
                row = (failed_row(a, mode, P, stopped[key], budget) if key in stopped
                       else run_row(a, ckpt, P, mode, budget))
                if row["ok"] and row["step_s"] > a.max_step_s:
                    stopped[key] = (f"skipped: the step at P={P} took {row['step_s']:.0f} s > --max-step-s "
                                    f"{a.max_step_s:.0f}")
                rows.append(row)
                out.write_text(json.dumps(result, indent=2))  # after every row: a run stopped at its limit keeps them
                print(f"[scale_bench] {a.workload} P={P} {mode} budget {budget:g} GiB: " + (
                    f"{row['step_s']:.2f} s, {row['s_per_sample']:.3f} s/sample, peak {row['peak_gib']:.1f} GiB"
                    if row["ok"] else f"FAILED {row['error']}"), flush=True)
    if a.plot:
        draw(rows, Path(a.plot), f"{a.workload}, {a.geometry} ({result['device']})")
    print(f"wrote {out}")
    return result


if __name__ == "__main__":
    main()
