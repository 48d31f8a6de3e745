"""The shipped recipes, run as a user runs them: `NGPU=1 ./run_train.sh` with the recipe's TOML, on a random checkpoint
of its geometry and local data in its own format, for a few GRPO steps plus evaluation, a checkpoint save, a resume
from it and the HF export. One row per (recipe, compile setting) in benchmarks/results/recipes-*.json (topic
"recipes", ../shared/RESULTS.md), read from the runs' own metrics.jsonl; a failed run is an `ok: false` row.

    python benchmarks/recipes.py --recipe qwen2_5_vl_7b --compile both --out $OUT/recipes.json   # one GPU
    python benchmarks/recipes.py --recipe all --smoke --work /tmp/recipes-smoke                   # CPU, tiny model

Each recipe runs twice through run_train.sh:
  A  `--training.steps=S`: evaluation before the first step and after the last, a checkpoint at step S
  B  the same command with `--training.steps=S+1`: resumes from step S's checkpoint, runs one more step (and the
     evaluation of the last step) and exports the weights in HF format; `checkpoint.save_last=false`, since the
     export already holds the final weights (a second 7B checkpoint with its AdamW state would not fit one
     machine's disk beside the first)
The row's step time is the median of run A's steps after the first (the first compiles), phases likewise; its
metrics are run B's last step. `--compile both` runs A twice more, with model.compile on and off (no save), so the
two settings are measured side by side.

What differs from the recipe is listed in each row's "overrides" with the reason: the checkpoint and data paths,
the steps, and `--set` values (the device-time budget of a benchmark call: fewer prompts per step and eval prompts).
Checkpoints are written where --ckpt-root says (the input model, made once per geometry: full vocabulary, bf16 on the
GPU, stop tokens for long-tailed responses), run folders under --work, training checkpoints under --save-root; each
recipe first checks that they have room.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import shutil
import sys
import time
import tomllib
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.product_run import (ROOT, last_error, matmul_peak_tflops, random_checkpoint, read_metrics,  # noqa: E402
                                    results_header, run_train, steps_row)
from tools.make_recipe_data import make_recipe_data  # noqa: E402

# recipe (train_configs/<stem>.toml) -> its data format (tools/make_recipe_data.py), None: the synthetic task.
# The 32B recipe needs several GPUs (tp 2): the multi-GPU benchmarks run it.
RECIPES = {"qwen2_5_vl_3b": None, "qwen2_5_vl_7b": None, "clevr_count_7b": "clevr_count",
           "geometry3k_7b": "geometry3k", "video_reasoning_7b": "video_qa"}
# --smoke: sizes a 2-core CPU runs in seconds per step
SMOKE_SETTINGS = ("data.prompts_per_step=2", "rollout.n_samples=2", "rollout.max_new_tokens=8", "data.eval_prompts=2",
                  "data.eval_k=0", "rollout.kv_pool_gib=0.25", "algorithm.micro_batch_size=4")
FLAVOR_PARAMS = {"3B": 3.75e9, "7B": 8.29e9, "debug": 1.2e6}  # parameters, for the disk check


def recipe_toml(recipe: str) -> dict:
    return tomllib.loads((ROOT / "train_configs" / f"{recipe}.toml").read_text())


def data_overrides(a, recipe: str, fmt: str | None) -> list[str]:
    """The data keys of the recipe's format, made locally."""
    if fmt is None:  # the recipe's synthetic task, at the image size of the reference workload
        return [f"--data.synthetic_dir={Path(a.work) / f'synthetic-{a.image_size}'}",
                f"--data.synthetic_size={a.image_size}", f"--data.synthetic_train={a.train_records}",
                f"--data.synthetic_eval={a.eval_records}"]
    size = a.frame_size if fmt == "video_qa" else a.image_size
    keys = make_recipe_data(fmt, Path(a.work) / f"data-{fmt}-{size}", a.train_records, a.eval_records, size=size,
                            frames=a.frames)
    return [f"--data.{k}={v}" for k, v in keys.items()]


def check_room(a, flavor: str) -> str:
    """'' when the input checkpoint, a training checkpoint and the HF export fit where they go, else why not."""
    params = FLAVOR_PARAMS["debug" if a.smoke else flavor]
    need = [(Path(a.save_root), 6 * params, "a training checkpoint (bf16 weights + AdamW moments)"),
            (Path(a.work), 2 * params, "the HF export")]
    if not (Path(a.ckpt_root) / f"ckpt-{'debug' if a.smoke else flavor}-mean{a.mean_response}").is_dir():
        need.append((Path(a.ckpt_root), 2 * params, "the input checkpoint"))
    by_device: dict[int, list] = {}  # what lands on one filesystem
    for path, nbytes, what in need:
        path.mkdir(parents=True, exist_ok=True)
        by_device.setdefault(path.stat().st_dev, []).append((path, nbytes, what))
    for items in by_device.values():
        total, free = sum(n for _, n, _ in items), shutil.disk_usage(items[0][0]).free
        if total > free:
            return (f"{' + '.join(w for _, _, w in items)} need {total / 1e9:.0f} GB at {items[0][0]}, "
                    f"{free / 1e9:.0f} GB free")
    return ""


def recipe_rows(a, recipe: str) -> list[dict]:
    toml = recipe_toml(recipe)
    flavor, mode = toml["model"]["flavor"], toml["runtime"]["mode"]
    config = f"train_configs/{recipe}.toml"
    base = {"recipe": recipe, "mode": mode, "geometry": flavor, "ok": False, "error": ""}
    room = check_room(a, flavor)
    if room:
        return [dict(base, compile=toml["model"]["compile"], error=f"not run: {room}")]
    ckpt = random_checkpoint(a.ckpt_root, flavor, a.mean_response, smoke=a.smoke)
    data = data_overrides(a, recipe, RECIPES[recipe])
    sets = [(kv.split("::")[0], kv.split("::")[1] if "::" in kv else a.set_reason) for kv in a.set]
    common = [f"--model.hf_checkpoint={ckpt}", *data, *(f"--{kv}" for kv, _ in sets)]
    overrides = {"model.hf_checkpoint": "a random checkpoint of the recipe's geometry (no hub)",
                 **{d.split("=")[0][2:]: "local data in the recipe's format" for d in data},
                 **{kv.split("=")[0]: reason for kv, reason in sets},
                 "training.steps": f"{a.steps} GRPO steps, then a resumed run of one more",
                 "checkpoint.interval": "a checkpoint at the last step of the first run"}
    save = [f"--checkpoint.folder={Path(a.save_root) / recipe}", "--checkpoint.keep_latest_k=1"]
    settings = {"recipe": [toml["model"]["compile"]], "both": [True, False], "on": [True], "off": [False]}[a.compile]
    settings = [False] if a.smoke else settings
    rows = []
    for compiled in settings:
        name = f"{recipe}-compile-{'on' if compiled else 'off'}"
        row = dict(base, compile=compiled, overrides=overrides)
        cycle = a.cycle and compiled == settings[0]  # the save / resume / export cycle runs once per recipe
        flags = [*common, f"--model.compile={str(compiled).lower()}", f"--training.steps={a.steps}",
                 "--job.overwrite=true", f"--checkpoint.enable={str(cycle).lower()}",
                 f"--checkpoint.interval={a.steps}", "--checkpoint.export_hf_at_end=false", *save]
        launched = time.time()
        status, seconds, log = run_train(config, name, flags, a.work, a.run_timeout_s)
        records = read_metrics(Path(a.work) / "runs" / name)
        row.update(steps_row(records, launched, peak_tflops=a.peak_tflops), run_s=seconds,
                   eval_steps=[r["step"] for r in records if "eval/prompts" in r or any(
                       k.startswith("eval/") and k.endswith("/prompts") for k in r)])
        if status != 0:
            rows.append(dict(row, error=f"run A exit {status}: {last_error(log)}"))
            continue
        if cycle:
            resume = [f"--training.steps={a.steps + 1}" if f.startswith("--training.steps=") else f for f in flags
                      if not f.startswith(("--job.overwrite", "--checkpoint.export_hf_at_end"))]
            status, seconds_b, log_b = run_train(config, f"{name}-resume", [f"--job.name={name}", *resume,
                                                                          "--checkpoint.save_last=false"], a.work,
                                                 a.run_timeout_s)
            records = read_metrics(Path(a.work) / "runs" / name)
            export = Path(a.work) / "runs" / name / "hf_export"
            resumed = f"resumed from step {a.steps}" in log_b.read_text(errors="replace")
            exported = (export / "config.json").is_file() and any(export.glob("*.safetensors"))
            row.update(resume_run_s=seconds_b, resumed=resumed, exported=exported,
                       resumed_steps=[r["step"] for r in records if "time/step_s" in r][a.steps:])
            if status != 0 or not (resumed and exported):
                rows.append(dict(row, error=f"run B exit {status}, resumed {resumed}, exported {exported}: "
                                 f"{last_error(log_b)}"))
                continue
            shutil.rmtree(export, ignore_errors=True)  # room for the next recipe
        shutil.rmtree(Path(a.save_root) / recipe, ignore_errors=True)
        row.update(ok=True, metrics={k: v for k, v in records[-1].items() if isinstance(v, (int, float))})
        rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--recipe", action="append", required=True, help=f"one of {', '.join(RECIPES)}, or all")
    p.add_argument("--compile", choices=("recipe", "both", "on", "off"), default="recipe",
                   help="the recipe's model.compile, both (on and off, side by side), on or off")
    p.add_argument("--no-cycle", dest="cycle", action="store_false",
                   help="no checkpoint save, resume and export: the GRPO steps alone")
    p.add_argument("--steps", type=int, default=3, help="GRPO steps of the first run (the resumed run adds one)")
    p.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                   help="a config override for every run, e.g. data.prompts_per_step=16, recorded in the rows with "
                        "--set-reason or its own after '::' (rollout.kv_pool_gib=16::an H100's 80 GB)")
    p.add_argument("--set-reason", default="the device-time budget of one benchmark call",
                   help="why the --set values differ from the recipe (recorded in the rows)")
    p.add_argument("--mean-response", type=int, default=256, help="random responses' mean length (stop tokens)")
    p.add_argument("--image-size", type=int, default=896, help="synthetic images' side: 1,024 vision tokens")
    p.add_argument("--frame-size", type=int, default=448)
    p.add_argument("--frames", type=int, default=32)
    p.add_argument("--train-records", type=int, default=128)
    p.add_argument("--eval-records", type=int, default=16)
    p.add_argument("--work", default="/tmp/recipes", help="run folders, data, logs")
    p.add_argument("--ckpt-root", default=None, help="input checkpoints (default: --work)")
    p.add_argument("--save-root", default=None, help="training checkpoints (default: --work)")
    p.add_argument("--run-timeout-s", type=float, default=900)
    p.add_argument("--watchdog-s", type=float, default=0, help="dump every thread's stack and exit after this long")
    p.add_argument("--smoke", action="store_true", help="CPU: the tiny debug checkpoint, float32, small data")
    p.add_argument("--out", default=None, help="results JSON (rows are added to an existing file)")
    a = p.parse_args(argv)
    if a.watchdog_s:
        faulthandler.dump_traceback_later(a.watchdog_s, exit=True)
    a.ckpt_root, a.save_root = a.ckpt_root or a.work, a.save_root or a.work
    if a.smoke:
        a.image_size, a.frame_size, a.frames, a.train_records, a.eval_records = 112, 56, 8, 8, 4
        a.set = [*SMOKE_SETTINGS, *a.set]
        a.set_reason = "a CPU smoke run of the tiny model"
    recipes = list(RECIPES) if "all" in a.recipe else [r for arg in a.recipe for r in arg.split(",")]
    unknown = [r for r in recipes if r not in RECIPES]
    if unknown:
        p.error(f"unknown recipe {unknown}; one of {', '.join(RECIPES)}")
    a.peak_tflops = matmul_peak_tflops()
    out = Path(a.out or f"benchmarks/results/recipes-{time.strftime('%Y%m%d', time.gmtime())}.json")
    result = json.loads(out.read_text()) if out.is_file() else {"rows": []}
    result.update(results_header("recipes", argv, "recipes.py"))
    out.parent.mkdir(parents=True, exist_ok=True)
    for recipe in recipes:
        try:
            rows = recipe_rows(a, recipe)
        except Exception as err:  # the next recipe still runs; the row says what failed
            rows = [{"recipe": recipe, "ok": False, "error": f"{type(err).__name__}: {err}"[:400]}]
        result["rows"] += rows
        out.write_text(json.dumps(result, indent=2))
        for r in rows:
            print(f"[recipes] {r['recipe']} compile={r.get('compile')}: " + (
                f"ok, step {r['step_s']:.2f} s, peak {r['peak_gib']:.1f} GiB" if r["ok"] else f"FAILED {r['error']}"),
                flush=True)
    return result


if __name__ == "__main__":
    main()
