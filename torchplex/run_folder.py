"""Start-up rules about the folders a run reads and writes: a run folder holds one run, and only the debug run's
tiny checkpoint may be written where a model checkpoint is missing.

Reusing a folder that holds an earlier run appended to its metrics.jsonl (steps 1,2,3,1,2,3), added a second
TensorBoard event file and looped the plot back; a mistyped `--model.hf_checkpoint` silently trained a tiny random
model written at the typo. Both are refused here, naming the key and the path, before anything is written.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from .components.metrics import METRICS_FILENAME, TENSORBOARD_DIRNAME

# debug.toml's model.hf_checkpoint: the one path where a missing checkpoint is written (tools/make_tiny_checkpoint)
DEBUG_HF_CHECKPOINT = "outputs/tiny-qwen2_5_vl"
_REPO = Path(__file__).resolve().parents[1]
# What a run writes into its folder besides config.toml (rewritten by every run) and the checkpoint folder.
_RUN_OUTPUTS = (METRICS_FILENAME, TENSORBOARD_DIRNAME, "metrics.png", "hf_export", "memory_plan.json",
                "memory_measured.json")


class RunFolderError(RuntimeError):
    """A start-up refusal about a folder; the message says what to change."""


def holds_a_run(run_dir: Path, checkpoint_dir: Path) -> bool:
    """Whether `run_dir` has outputs of an earlier run: logged metrics, TensorBoard events or checkpoints."""
    metrics = run_dir / METRICS_FILENAME
    tb = run_dir / TENSORBOARD_DIRNAME
    return ((metrics.is_file() and metrics.stat().st_size > 0) or (tb.is_dir() and any(tb.iterdir()))
            or (checkpoint_dir.is_dir() and any(checkpoint_dir.iterdir())))


def check_run_folder(run_dir: Path, checkpoint_dir: Path, overwrite: bool, resuming: bool) -> str:
    """What to do with the run folder: "new", "resume", or "overwrite" (the caller then calls `clear_run_folder`).

    Raises RunFolderError when it holds an earlier run that is neither resumed nor to be overwritten."""
    if resuming:
        return "resume"
    if not holds_a_run(run_dir, checkpoint_dir):
        return "new"
    if overwrite:
        return "overwrite"
    raise RunFolderError(
        f"the run folder {run_dir} (job.output_dir/job.name) holds an earlier run and no checkpoint of it is "
        f"resumed; pass --job.name=<new name> for a new folder or --job.overwrite=true to replace it (a run that "
        f"saved checkpoints continues with --checkpoint.enable=true)")


def clear_run_folder(run_dir: Path, checkpoint_dir: Path) -> list[str]:
    """Delete what an earlier run wrote (only the trainer's own outputs); returns the names removed."""
    removed = []
    for path in [run_dir / name for name in _RUN_OUTPUTS] + [checkpoint_dir]:
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()
        else:
            continue
        removed.append(path.name)
    return removed


def may_write_tiny_checkpoint(hf_checkpoint: str) -> bool:
    """True only for the debug run's path (relative to the working folder or to the repo)."""
    where = Path(hf_checkpoint).expanduser().resolve()
    return where in {Path(DEBUG_HF_CHECKPOINT).resolve(), (_REPO / DEBUG_HF_CHECKPOINT).resolve()}


def missing_checkpoint_error(hf_checkpoint: str, make_tiny_if_missing: bool) -> str:
    where = Path(hf_checkpoint).expanduser().resolve()
    hint = (f"a tiny random checkpoint is written automatically only at {DEBUG_HF_CHECKPOINT} (the debug run)"
            if make_tiny_if_missing else "set it to a Hugging Face Qwen2.5-VL folder")
    return f"model.hf_checkpoint = {hf_checkpoint!r}: no config.json in {where}; {hint}"
