"""Run the default training and make the README's headline numbers those of that run, in one command.

    python tools/refresh_readme_numbers.py                    # ./run_train.sh with no arguments (5-15 min on 2 CPU cores)
    python tools/refresh_readme_numbers.py --from-run runs/debug --wall-s 767 --console console.txt

It writes the run's summary to docs/results/debug_run.json (committed: the README's numbers are its numbers), the
run's curves to docs/img/debug_run_metrics.png, and rewrites the README block between the `debug-run` markers from
that file. tests/test_readme_numbers.py checks that the README block is the one the committed file gives.
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import re
import shutil
import subprocess
import sys
import textwrap
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "docs" / "results" / "debug_run.json"
CURVES = REPO / "docs" / "img" / "debug_run_metrics.png"
README = REPO / "README.md"
BEGIN = "<!-- debug-run: begin (written by tools/refresh_readme_numbers.py from docs/results/debug_run.json) -->"
END = "<!-- debug-run: end -->"
TRAIN_WINDOW = 50  # train-batch accuracy: mean of the first and of the last this many GRPO steps


# ---- the run ------------------------------------------------------------------------------------------------
def run_default() -> tuple[float, str]:
    """`./run_train.sh` with no arguments from the repo root; its wall time and console (stdout and stderr)."""
    started, lines = time.perf_counter(), []
    with subprocess.Popen([str(REPO / "run_train.sh")], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                          text=True) as proc:
        for line in proc.stdout:
            print(line, end="", flush=True)
            lines.append(line)
    if proc.returncode != 0:
        raise SystemExit(f"./run_train.sh failed (exit status {proc.returncode}); nothing written")
    return time.perf_counter() - started, "".join(lines)


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=REPO, capture_output=True, text=True, check=True).stdout.strip()


def _metrics(run_dir: Path) -> dict[int, dict]:
    """metrics.jsonl as {step: merged record}."""
    out: dict[int, dict] = {}
    for line in (run_dir / "metrics.jsonl").read_text().splitlines():
        record = json.loads(line)
        out.setdefault(record["step"], {}).update(record)
    return out


def _mean(values: list[float]) -> float:
    return sum(values) / len(values)


def console_excerpt(console: str) -> list[str]:
    """The console with the repeated progress lines cut: the first and last warm-up line, the first and last GRPO
    step line and the last evaluation; "..." lines mark what was cut. Paths are shown relative to the repo."""
    lines = console.replace(f"{REPO}/", "").splitlines()
    warmup = [i for i, line in enumerate(lines) if re.search(r"\] warm-up step \d+/\d+", line)]
    steps = [i for i, line in enumerate(lines) if re.search(r"\] step \d+/\d+ \|", line)]
    evals = [i for i, line in enumerate(lines) if re.search(r"\] eval step [1-9]\d*:", line)]
    cut = set(warmup[1:-1]) | set(steps[1:-1]) | set(evals[:-1])
    out = []
    for i, line in enumerate(lines):
        if i in cut:
            if not out or not out[-1].startswith("..."):
                out.append("...")
            continue
        out.append(line)
    return out


def summarize(run_dir: Path, wall_s: float, console: str, commit: str, load_1min: float | None) -> dict:
    """What the README says of a finished default run, from its folder (metrics.jsonl, config.toml) and console."""
    if sys.version_info >= (3, 11):
        import tomllib
    else:  # pragma: no cover
        import tomli as tomllib
    import torch

    config = tomllib.loads((run_dir / "config.toml").read_text())
    metrics = _metrics(run_dir)
    first = metrics[0]
    evals = [{"point": "before the warm-up (random model)", "accuracy": first["eval/accuracy_before_sft"],
              "format": first["eval/format_before_sft"]}]
    evals += [{"point": f"GRPO step {step}", "step": step, "accuracy": record["eval/accuracy"],
               "format": record["eval/format"]}
              for step, record in sorted(metrics.items()) if "eval/accuracy" in record]
    train = [metrics[step]["accuracy"] for step in sorted(metrics) if step > 0 and "accuracy" in metrics[step]]
    return {
        "command": "./run_train.sh", "commit": commit, "date": datetime.date.today().isoformat(),
        "torch": torch.__version__, "cpu_count": os.cpu_count(), "load_1min_at_start": load_1min,
        "wall_s": round(wall_s), "warmup_steps": config["training"]["sft_warmup_steps"],
        "grpo_steps": config["training"]["steps"], "prompts_per_step": config["data"]["prompts_per_step"],
        "n_samples": config["rollout"]["n_samples"], "eval_prompts": int(first["eval/prompts"]),
        "evals": evals, "train_accuracy_first": round(_mean(train[:TRAIN_WINDOW]), 4),
        "train_accuracy_last": round(_mean(train[-TRAIN_WINDOW:]), 4), "train_window": TRAIN_WINDOW,
        "console_lines": len(console.splitlines()), "console_excerpt": console_excerpt(console),
    }


# ---- the README block -----------------------------------------------------------------------------------------
def render(summary: dict) -> str:
    """The README block of a run summary (docs/results/debug_run.json)."""
    s = summary
    minutes, seconds = divmod(s["wall_s"], 60)
    load = f", load average {s['load_1min_at_start']:.1f} at its start" if s["load_1min_at_start"] is not None else ""
    before, *grpo = s["evals"]
    after, *later = grpo
    rows = [f"| {before['point']} | {before['accuracy']:.3f} | {before['format']:.2f} |",
            f"| after the warm-up ({after['point']}) | {after['accuracy']:.3f} | {after['format']:.2f} |"]
    for i in range(0, len(later), 3):  # three evaluations a row
        group = later[i:i + 3]
        steps = " / ".join(str(e["step"]) for e in group)
        accuracy = " / ".join(format(e["accuracy"], ".3f") for e in group)
        answered = " / ".join(format(e["format"], ".2f") for e in group)
        rows.append(f"| GRPO step {steps} | {accuracy} | {answered} |")
    gain = 100 * (grpo[-1]["accuracy"] - after["accuracy"])
    noise = 100 * math.sqrt(0.25 / s["eval_prompts"])  # the standard error of an accuracy near 0.5
    note = f" ({s['note']})" if s.get("note") else ""  # where the numbers come from, when not from this tool's run
    run = (f"`{s['command']}` with no arguments, run on {s['date']} at commit {s['commit']} (torch {s['torch']}, "
           f"{s['cpu_count']} CPU cores{load}): **{minutes} min {seconds} s** wall time in all, {s['warmup_steps']} "
           f"warm-up steps, {s['grpo_steps']} GRPO steps of {s['prompts_per_step']} prompts x {s['n_samples']} "
           f"samples and {len(s['evals'])} evaluations of all {s['eval_prompts']} eval prompts (greedy). "
           f"`python tools/refresh_readme_numbers.py` runs it again and rewrites this block from its summary, "
           f"`docs/results/debug_run.json`{note}:")
    gained = (f"GRPO added {gain:.1f} points on top of the warm-up (the eval set's noise is about ±{noise:.1f} "
              f"points), and train-batch accuracy went from {s['train_accuracy_first']:.2f} (mean of the first "
              f"{s['train_window']} steps) to {s['train_accuracy_last']:.2f} (last {s['train_window']}).")
    console = (f"The console of that run is {s['console_lines']} lines (stdout and stderr together): the checkpoint "
               f"and eval lines, one line per 50 warm-up steps, the first step's schedule, one line per 10 GRPO steps "
               f"(`metrics.log_interval`; metrics.jsonl has every step), every evaluation, and a closing summary "
               f"(`...` marks the lines left out here). On a terminal a progress bar per phase redraws in place.")
    table = ["| point | eval accuracy | answers in `<answer>` format |", "|---|---|---|", *rows]
    return "\n".join([BEGIN, _wrap(run), "", *table, "", _wrap(gained), "", _wrap(console), "", "```",
                      *s["console_excerpt"], "```", "", "![curves of the default run](docs/img/debug_run_metrics.png)",
                      END])


def _wrap(paragraph: str) -> str:
    return textwrap.fill(paragraph, 118, break_long_words=False, break_on_hyphens=False)


def rewrite_readme(readme: str, block: str) -> str:
    start, end = readme.index(BEGIN), readme.index(END) + len(END)
    return readme[:start] + block + readme[end:]


def readme_block(readme: str) -> str:
    return readme[readme.index(BEGIN):readme.index(END) + len(END)]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--from-run", type=Path, help="summarize this finished default run instead of running one")
    parser.add_argument("--wall-s", type=float, help="with --from-run: its wall time in seconds")
    parser.add_argument("--console", type=Path, help="with --from-run: a file holding its console output")
    args = parser.parse_args(argv)
    load = os.getloadavg()[0]
    if args.from_run:
        if args.wall_s is None or args.console is None:
            parser.error("--from-run needs --wall-s and --console")
        run_dir, wall_s, console = args.from_run, args.wall_s, args.console.read_text()
        load = None  # not known for a run made earlier
    else:
        wall_s, console = run_default()
        run_dir = REPO / "runs" / "debug"
    commit = _git("rev-parse", "--short", "HEAD") + ("-dirty" if _git("status", "--porcelain", "--untracked-files=no")
                                                     else "")
    summary = summarize(run_dir, wall_s, console, commit, load)
    RESULTS.parent.mkdir(parents=True, exist_ok=True)
    RESULTS.write_text(json.dumps(summary, indent=2) + "\n")
    shutil.copyfile(run_dir / "metrics.png", CURVES)
    README.write_text(rewrite_readme(README.read_text(), render(summary)))
    print(f"wrote {RESULTS.relative_to(REPO)}, {CURVES.relative_to(REPO)} and the README's debug-run block")
    return 0


if __name__ == "__main__":
    sys.exit(main())
