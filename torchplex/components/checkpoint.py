"""Resumable training checkpoints with torch.distributed.checkpoint (DCP).

Layout of one checkpoint, `folder/step-{step}/`:

    .metadata, __*_*.distcp        DCP: model and optimizer state, sharded as they live in memory
                                   (FSDP2 DTensors are saved shard by shard and can be reloaded on a
                                   different world size)
    train_state_rank{r}.pt         per rank: lr scheduler, `extra` (e.g. data-stream position) and the
                                   RNG states (python, numpy, torch CPU, torch CUDA), which differ by rank;
                                   also the optimizer state of optimizers DCP cannot handle (see below)

A checkpoint is written under `folder/.tmp-step-{step}` and renamed to `step-{step}` by rank 0 only
after every rank has finished, so a `step-*` directory is always complete; `latest_step()` also
requires DCP's `.metadata` file. This assumes `folder` is one filesystem seen by all ranks.

Works without a process group (single process: DCP's no-dist mode) and under any process group.

DCP's optimizer helpers need a regular `torch.optim.Optimizer` (they read `optimizer.state`).
torchao's AdamW8bit is one (its 8-bit moments are tensor subclasses DCP saves as is); torchao's
CPUOffloadOptimizer is not, so its own `state_dict()` goes into the per-rank file instead. That is
fine because it is a single-GPU optimizer, but such a checkpoint cannot be resharded. Its
`load_state_dict` alone does not resume it correctly; see `_resync_offloading_optimizer`.
"""

from __future__ import annotations

import contextlib
import random
import re
import shutil
import warnings
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

_STEP_DIR = re.compile(r"^step-(\d+)$")
_TMP_PREFIX = ".tmp-step-"
_DCP_METADATA = ".metadata"


def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _rank() -> int:
    return dist.get_rank() if _distributed() else 0


def _barrier() -> None:
    if _distributed():
        dist.barrier()


@contextlib.contextmanager
def _quiet_single_process_dcp():
    """DCP warns that it "assumes" single-process mode even when asked for it explicitly."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        yield


def _dcp_handles(optimizer: torch.optim.Optimizer) -> bool:
    return isinstance(getattr(optimizer, "state", None), Mapping)


@torch.no_grad()
def _resync_offloading_optimizer(optimizer: torch.optim.Optimizer) -> None:
    """Finish loading torchao's CPUOffloadOptimizer (checked with torchao 0.18 on CUDA):

    1. Its step updates host copies of the parameters (`param_d2h_map`) and copies them back to the
       GPU, so the host copies must become the loaded weights, not the weights it was built with.
    2. Its `param_groups` lists `d_param_groups`, the group dicts its on-device optimizer `d_opt`
       (small tensors) had at construction; `d_opt.load_state_dict` replaced those dicts, so the
       lr scheduler would set the lr of dead dicts. Point the list at the live ones.
    """
    for param, host_copy in getattr(optimizer, "param_d2h_map", {}).items():
        host_copy.copy_(param.detach())
    device_optimizer = getattr(optimizer, "d_opt", None)
    if device_optimizer is not None and hasattr(optimizer, "d_param_groups"):
        optimizer.d_param_groups = device_optimizer.param_groups


def _interrupted(err: BaseException) -> bool:
    """Whether `err` is a Ctrl-C: a KeyboardInterrupt, or DCP's CheckpointException holding one (DCP catches what
    each rank raises during a save or load, a Ctrl-C included, and raises them together)."""
    if isinstance(err, KeyboardInterrupt):
        return True
    failures = getattr(err, "failures", None)
    return isinstance(failures, Mapping) and any(isinstance(failure[0], KeyboardInterrupt)
                                                 for failure in failures.values())


@contextlib.contextmanager
def _written_whole(tmp_dir: Path, rank: int):
    """Around the writing of `tmp_dir`: when anything stops it (a second Ctrl-C included), the partial folder goes,
    and a Ctrl-C that DCP wrapped comes out as the KeyboardInterrupt it was (the trainer then exits 130)."""
    try:
        yield
    except BaseException as err:
        if rank == 0:
            shutil.rmtree(tmp_dir, ignore_errors=True)
        if _interrupted(err) and not isinstance(err, KeyboardInterrupt):
            raise KeyboardInterrupt from None
        raise


class CheckpointLoadError(RuntimeError):
    """No checkpoint of a folder could be loaded; the message (one line) gives each one's folder and reason, and how
    to start over."""


def _first_line(err: BaseException) -> str:
    """The gist of an error: DCP's CheckpointException carries each rank's traceback, whose last line is the cause."""
    lines = [line.strip() for line in str(err).strip().splitlines() if line.strip()]
    if not lines:
        return ""
    return (lines[-1] if any(line.startswith("Traceback") for line in lines) else lines[0])[:300]


def _train_state_filename(rank: int) -> str:
    return f"train_state_rank{rank}.pt"


# --------------------------------------------------------------------------------------------------
# RNG state: stored as plain containers + tensors so that torch.load(weights_only=True) can read it.
# --------------------------------------------------------------------------------------------------


def capture_rng_state() -> dict[str, Any]:
    np_state = np.random.get_state(legacy=False)
    state: dict[str, Any] = {
        "python": random.getstate(),
        "numpy": {
            "bit_generator": np_state["bit_generator"],
            "key": torch.from_numpy(np_state["state"]["key"].astype(np.int64)),
            "pos": int(np_state["state"]["pos"]),
            "has_gauss": int(np_state["has_gauss"]),
            "gauss": float(np_state["gauss"]),
        },
        "torch_cpu": torch.get_rng_state(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["torch_cuda"] = torch.cuda.get_rng_state()  # this rank's current device
    return state


def restore_rng_state(state: Mapping[str, Any]) -> None:
    random.setstate(state["python"])
    np_state = state["numpy"]
    np.random.set_state(
        {
            "bit_generator": np_state["bit_generator"],
            "state": {"key": np_state["key"].numpy().astype(np.uint32), "pos": np_state["pos"]},
            "has_gauss": np_state["has_gauss"],
            "gauss": np_state["gauss"],
        }
    )
    torch.set_rng_state(state["torch_cpu"])
    if "torch_cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["torch_cuda"])


def _check_loadable(value: Any, where: str) -> None:
    """`extra` is read back with weights_only=True: fail at save time, naming the key, not at resume."""
    if isinstance(value, Mapping):
        for key, item in value.items():
            if not isinstance(key, (str, int)):
                raise TypeError(f"checkpoint extra: key {key!r} in {where} must be str or int")
            _check_loadable(item, f"{where}[{key!r}]")
    elif isinstance(value, (list, tuple)):
        for i, item in enumerate(value):
            _check_loadable(item, f"{where}[{i}]")
    elif not (value is None or isinstance(value, (str, int, float, bool, torch.Tensor))):
        raise TypeError(
            f"checkpoint extra: {where} has type {type(value).__name__}; use dicts, lists, numbers, "
            "strings or tensors"
        )


# --------------------------------------------------------------------------------------------------
# Manager
# --------------------------------------------------------------------------------------------------


class CheckpointManager:
    """Saves every `interval` steps (and at the last step) into `folder/step-{step}`, keeps the newest
    `keep_latest_k` (0 keeps all), and restores model, optimizer, lr scheduler, `extra` and RNG.

    `enable` only gates `should_save`; an explicit `save()` or `load()` always runs.
    All ranks must call `save`, `load` and `save_model_only` (they are collective when distributed).
    """

    def __init__(self, folder: Path | str, interval: int, keep_latest_k: int = 0, enable: bool = True) -> None:
        if enable and interval < 1:
            raise ValueError(f"checkpoint interval must be >= 1, got {interval}")
        if keep_latest_k < 0:
            raise ValueError(f"checkpoint keep_latest_k must be >= 0 (0 keeps all), got {keep_latest_k}")
        self.folder = Path(folder)
        self.interval = interval
        self.keep_latest_k = keep_latest_k
        self.enable = enable

    # ---- queries ---------------------------------------------------------------------------------

    def step_dir(self, step: int) -> Path:
        return self.folder / f"step-{step}"

    def should_save(self, step: int, last: bool = False) -> bool:
        return self.enable and (last or step % self.interval == 0)

    def saved_steps(self) -> list[int]:
        """Steps of complete checkpoints in `folder`, ascending."""
        if not self.folder.is_dir():
            return []
        steps = []
        for entry in self.folder.iterdir():
            match = _STEP_DIR.match(entry.name)
            if match and (entry / _DCP_METADATA).is_file():
                steps.append(int(match.group(1)))
        return sorted(steps)

    def latest_step(self) -> int | None:
        steps = self.saved_steps()
        return steps[-1] if steps else None

    # ---- save ------------------------------------------------------------------------------------

    def save(
        self,
        step: int,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        lr_scheduler: torch.optim.lr_scheduler.LRScheduler | None = None,
        extra: Mapping[str, Any] | None = None,
    ) -> Path:
        extra = dict(extra or {})
        _check_loadable(extra, "extra")
        rank = _rank()
        tmp_dir = self.folder / f"{_TMP_PREFIX}{step}"
        final_dir = self.step_dir(step)

        if rank == 0:
            self.folder.mkdir(parents=True, exist_ok=True)
            # Leftovers of saves that crashed half-way are never valid checkpoints.
            for stale in self.folder.glob(f"{_TMP_PREFIX}*"):
                shutil.rmtree(stale, ignore_errors=True)
            tmp_dir.mkdir()
        _barrier()

        with _written_whole(tmp_dir, rank):
            state: dict[str, Any] = {"model": get_model_state_dict(model)}
            if optimizer is not None and _dcp_handles(optimizer):
                state["optimizer"] = get_optimizer_state_dict(model, optimizer)
            with _quiet_single_process_dcp():
                dcp.save(state, checkpoint_id=str(tmp_dir), no_dist=not _distributed())

            train_state = {
                "step": int(step),
                "lr_scheduler": lr_scheduler.state_dict() if lr_scheduler is not None else None,
                "extra": extra,
                "rng": capture_rng_state(),
                "optimizer": None if optimizer is None or _dcp_handles(optimizer) else optimizer.state_dict(),
            }
            torch.save(train_state, tmp_dir / _train_state_filename(rank))
            _barrier()  # every rank's shards and train state are on disk
        if rank == 0:
            self._put_in_place(tmp_dir, final_dir)
            self._prune()
        _barrier()  # nobody reads `folder` before the rename and pruning are done
        return final_dir

    def _put_in_place(self, tmp_dir: Path, final_dir: Path) -> None:
        """Rename the finished `tmp_dir` to `final_dir`; a folder already there is first moved aside under a
        temporary name, so that an interruption leaves no half-deleted checkpoint (temporary folders are never
        loaded, and the next save removes them)."""
        if final_dir.exists():
            aside = self.folder / f"{_TMP_PREFIX}replaced-{final_dir.name}"
            shutil.rmtree(aside, ignore_errors=True)
            final_dir.rename(aside)
            shutil.rmtree(aside)
        tmp_dir.rename(final_dir)

    def _prune(self) -> None:
        if self.keep_latest_k <= 0:
            return
        for old_step in self.saved_steps()[: -self.keep_latest_k]:
            aside = self.folder / f"{_TMP_PREFIX}pruned-{old_step}"  # out of saved_steps() before it is deleted
            self.step_dir(old_step).rename(aside)
            shutil.rmtree(aside, ignore_errors=True)

    def save_weights(self, name: str, model: torch.nn.Module) -> Path:
        """`model`'s weights alone in `folder/name` (DCP, resharded on load like a step's checkpoint), written under
        a temporary name and renamed when complete; outside the steps' pruning. Collective, like `save`."""
        rank = _rank()
        tmp_dir, final_dir = self.folder / f"{_TMP_PREFIX}{name}", self.folder / name
        if rank == 0:
            self.folder.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(tmp_dir, ignore_errors=True)
            tmp_dir.mkdir()
        _barrier()
        with _written_whole(tmp_dir, rank):
            with _quiet_single_process_dcp():
                dcp.save({"model": get_model_state_dict(model)}, checkpoint_id=str(tmp_dir),
                         no_dist=not _distributed())
            _barrier()
        if rank == 0:
            self._put_in_place(tmp_dir, final_dir)
        _barrier()
        return final_dir

    def load_weights(self, name: str, model: torch.nn.Module) -> bool:
        """Load `folder/name` (written by `save_weights`) into `model`; False when there is none."""
        path = self.folder / name
        if not (path / _DCP_METADATA).is_file():
            return False
        state = {"model": get_model_state_dict(model)}
        with _quiet_single_process_dcp():
            dcp.load(state, checkpoint_id=str(path), no_dist=not _distributed())
        set_model_state_dict(model, state["model"])
        return True

    # ---- load ------------------------------------------------------------------------------------

    def load(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        lr_scheduler: torch.optim.lr_scheduler.LRScheduler | None = None,
        step: int | None = None,
    ) -> tuple[int, dict[str, Any]]:
        """Restore the checkpoint of `step` (default: the latest) and return `(step, extra)`.

        `model` and `optimizer` must already be built (and parallelised) the way they will train;
        DCP loads into their current sharding. Passing `optimizer=None` loads weights only.
        """
        available = self.saved_steps()
        if step is None:
            if not available:
                raise FileNotFoundError(f"no checkpoint (step-N/{_DCP_METADATA}) in {self.folder}")
            step = available[-1]
        elif step not in available:
            raise FileNotFoundError(f"no checkpoint {self.step_dir(step)}; available steps: {available}")
        ckpt_dir = self.step_dir(step)
        # Checked first so that a failed load leaves the model untouched.
        train_state_path = ckpt_dir / _train_state_filename(_rank())
        if not train_state_path.is_file():
            raise FileNotFoundError(
                f"{train_state_path} is missing: the checkpoint was saved with fewer ranks; "
                "model and optimizer reshard, but per-rank RNG/extra state cannot"
            )

        optimizer_in_dcp = optimizer is not None and _dcp_handles(optimizer)
        state: dict[str, Any] = {"model": get_model_state_dict(model)}
        if optimizer_in_dcp:
            state["optimizer"] = get_optimizer_state_dict(model, optimizer)
        with _quiet_single_process_dcp():
            dcp.load(state, checkpoint_id=str(ckpt_dir), no_dist=not _distributed())
        set_model_state_dict(model, state["model"])
        if optimizer_in_dcp:
            set_optimizer_state_dict(model, optimizer, state["optimizer"])

        # map_location: RNG states must be CPU tensors; optimizer.load_state_dict moves state to params.
        train_state = torch.load(train_state_path, map_location="cpu", weights_only=True)
        if optimizer is not None and not optimizer_in_dcp:
            if train_state.get("optimizer") is None:
                raise KeyError(f"{train_state_path} has no state for {type(optimizer).__name__}")
            optimizer.load_state_dict(train_state["optimizer"])
            _resync_offloading_optimizer(optimizer)
        if lr_scheduler is not None:
            if train_state["lr_scheduler"] is None:
                raise KeyError(f"{train_state_path} has no lr_scheduler state (saved without one)")
            lr_scheduler.load_state_dict(train_state["lr_scheduler"])
        restore_rng_state(train_state["rng"])
        return int(train_state["step"]), dict(train_state["extra"])

    def load_newest(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer | None = None,
        lr_scheduler: torch.optim.lr_scheduler.LRScheduler | None = None,
    ) -> tuple[int, dict[str, Any], list[tuple[int, str]]]:
        """Restore the newest checkpoint that loads; returns `(step, extra, failed)`, `failed` being the newer
        checkpoints that did not load, as (step, reason naming the folder). A corrupt newest checkpoint (a
        truncated `.distcp`) then costs the steps since the one before it, not the run.

        Each attempt loads every piece of state, so an older checkpoint overwrites whatever a failed one set."""
        failed: list[tuple[int, str]] = []
        steps = self.saved_steps()
        if not steps:
            raise FileNotFoundError(f"no checkpoint (step-N/{_DCP_METADATA}) in {self.folder}")
        for step in reversed(steps):
            try:
                loaded, extra = self.load(model, optimizer, lr_scheduler, step=step)
                return loaded, extra, failed
            except (KeyboardInterrupt, SystemExit):
                raise
            except BaseException as err:  # noqa: BLE001 - DCP's CheckpointException is a BaseException
                failed.append((step, f"{self.step_dir(step)}: {type(err).__name__}: {_first_line(err)}"))
        reasons = "; ".join(f"step {step}: {reason}" for step, reason in failed)
        raise CheckpointLoadError(f"no checkpoint in {self.folder} loads ({reasons}); to start over, move "
                                  f"{self.folder} aside, or pass --checkpoint.resume=false --job.overwrite=true "
                                  f"(which deletes it)")

    @staticmethod
    def save_model_only(
        path: Path | str,
        model: torch.nn.Module,
        transform: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]] | None = None,
    ) -> Path:
        return save_model_only(path, model, transform)


def save_model_only(
    path: Path | str,
    model: torch.nn.Module,
    transform: Callable[[dict[str, torch.Tensor]], dict[str, torch.Tensor]] | None = None,
) -> Path:
    """Export the full (unsharded) weights to one `.safetensors` file, written by rank 0.

    Collective under FSDP2: every rank must call it (the shards are gathered). `transform` maps the
    native state dict before writing, e.g. a state-dict adapter to Hugging Face names.
    Peak host memory is one full copy of the model on rank 0.
    """
    from torchplex.models.qwen2_5_vl.weights import save_safetensors  # the usual file mode, not safetensors' 0600

    path = Path(path)
    options = StateDictOptions(full_state_dict=True, cpu_offload=True)
    state = get_model_state_dict(model, options=options)
    if _rank() == 0:
        if transform is not None:
            state = transform(state)
        # safetensors refuses tensors that share storage (tied embeddings): copy the later aliases.
        seen: set[tuple[int, int]] = set()
        tensors: dict[str, torch.Tensor] = {}
        for name, tensor in state.items():
            tensor = tensor.detach()
            key = (tensor.untyped_storage().data_ptr(), tensor.untyped_storage().nbytes())
            tensors[name] = tensor.clone().contiguous() if key in seen else tensor.contiguous()
            seen.add(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp_path = path.with_name(path.name + ".tmp")
        save_safetensors(tensors, tmp_path)
        tmp_path.replace(path)
    _barrier()
    return path
