"""Start-up rules about the folders a run reads and writes: a run folder holds one run, a live run's folder is
never touched, and only the debug run's tiny checkpoint may be written where a model checkpoint is missing.

Reusing a folder that holds an earlier run appended to its metrics.jsonl (steps 1,2,3,1,2,3), added a second
TensorBoard event file and looped the plot back; a mistyped `--model.hf_checkpoint` silently trained a tiny random
model written at the typo. Both are refused here, naming the key and the path, before anything is written.

A run holds its folder with an exclusive lock on `<run folder>/.lock` (flock: the OS releases it when the process
ends, however it ends). A second launch into the folder of a live run is refused, even with `job.overwrite = true`;
the trainer takes the folder only after every other start-up check, so a launch that fails one deletes nothing.
"""

from __future__ import annotations

import fcntl
import logging
import os
import shutil
import socket
from collections.abc import Callable
from pathlib import Path

from .components.metrics import METRICS_FILENAME, TENSORBOARD_DIRNAME

# debug.toml's model.hf_checkpoint: the one path where a missing checkpoint is written (tools/make_tiny_checkpoint)
DEBUG_HF_CHECKPOINT = "outputs/tiny-qwen2_5_vl"
_REPO = Path(__file__).resolve().parents[1]
# What a run writes into its folder besides config.toml (rewritten by every run) and the checkpoint folder.
_RUN_OUTPUTS = (METRICS_FILENAME, TENSORBOARD_DIRNAME, "metrics.png", "hf_export", "memory_plan.json",
                "memory_measured.json")


log = logging.getLogger("torchplex")
LOCK_FILENAME = ".lock"


class RunFolderError(RuntimeError):
    """A start-up refusal about a folder; the message says what to change."""


class RunLock:
    """This process's hold on a run folder: an exclusive flock on its lock file, kept until `release` or the
    process's end."""

    def __init__(self, path: Path, file) -> None:
        self.path, self._file = path, file

    def release(self) -> None:
        if self._file is not None:
            fcntl.flock(self._file, fcntl.LOCK_UN)
            self._file.close()
            self._file = None
            _HELD.pop(self.path, None)


# Locks this process holds, by lock file: runs one after another in one process (tests, notebooks) take the folder
# again, which flock, counting each open file on its own, would refuse.
_HELD: dict[Path, RunLock] = {}


def lock_run_folder(run_dir: Path) -> RunLock:
    """Hold `run_dir` for this process; RunFolderError when another process's run holds it."""
    run_dir.mkdir(parents=True, exist_ok=True)
    path = (run_dir / LOCK_FILENAME).resolve()
    if path in _HELD:
        return _HELD[path]
    file = open(path, "a+")
    try:
        fcntl.flock(file, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        file.seek(0)
        holder = file.read().strip() or "another process"
        file.close()
        raise RunFolderError(f"the run folder {run_dir} is in use by a running job ({holder}); nothing was changed: "
                             f"wait for it to end, or pass --job.name=<new name> for a new folder") from None
    file.seek(0)
    file.truncate()
    file.write(f"pid {os.getpid()} on {socket.gethostname()}\n")
    file.flush()
    _HELD[path] = RunLock(path, file)
    return _HELD[path]


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


def claim_run_folder(run_dir: Path, checkpoint_dir: Path, overwrite: bool, resuming: bool, rank: int = 0,
                     any_rank: Callable[[bool], bool] = lambda flag: flag) -> RunLock | None:
    """Take the run folder, once every other start-up check has passed: rank 0 locks it (a live run's folder is
    refused), every rank applies `check_run_folder`, and rank 0 clears an earlier run when told to overwrite it.
    `any_rank(flag)`: whether `flag` holds on any rank of the job (a collective). Returns rank 0's lock."""
    lock, refused = None, None
    if rank == 0:
        try:
            lock = lock_run_folder(run_dir)
        except RunFolderError as err:
            refused = err
    if any_rank(refused is not None):
        raise refused or RunFolderError(f"the run folder {run_dir} is in use by a running job (rank 0 says which)")
    decision = check_run_folder(run_dir, checkpoint_dir, overwrite, resuming)
    any_rank(False)  # every rank has looked before rank 0 clears anything
    if rank == 0 and decision == "overwrite":
        removed = clear_run_folder(run_dir, checkpoint_dir)
        log.info("%s held an earlier run: replaced (job.overwrite = true; removed %s)", run_dir, ", ".join(removed))
    return lock


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
    if not hf_checkpoint.strip():  # not '.': a value the user never set
        return ("model.hf_checkpoint is not set: pass --model.hf_checkpoint=<Hugging Face Qwen2.5-VL folder>, or a "
                "config that sets it (--job.config_file train_configs/debug.toml: the tiny debug model)")
    where = Path(hf_checkpoint).expanduser().resolve()
    hint = (f"a tiny random checkpoint is written automatically only at {DEBUG_HF_CHECKPOINT} (the debug run)"
            if make_tiny_if_missing else "set it to a Hugging Face Qwen2.5-VL folder")
    return f"model.hf_checkpoint = {hf_checkpoint!r}: no config.json in {where}; {hint}"
