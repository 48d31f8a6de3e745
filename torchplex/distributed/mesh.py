"""Process-group setup and the (dp_shard, tp) device mesh the trainer parallelises over.

torchtitan 0.3.0's `ParallelDims` builds six mesh axes (pp, dp_replicate, dp_shard, cp, tp, ep), some on a
"fake" backend, and pulls in its config system and the `spmd_types` package; torchplex needs two axes, so
this is a small dataclass with the same vocabulary: `dp_shard` (FSDP2 shards parameters and splits the
batch) and `tp` (tensor parallelism inside each decoder layer). Ranks are laid out tp-fastest, so the ranks
of one TP group are neighbours (on one host, over NVLink, when a job spans several).
"""

from __future__ import annotations

import logging
import os
import sys
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh


def launched_by_torchrun() -> bool:
    return "RANK" in os.environ and "WORLD_SIZE" in os.environ


def default_device() -> torch.device:
    """This process's accelerator (LOCAL_RANK picks the GPU), or the CPU."""
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")


def init_distributed(backend: str | None = None) -> tuple[int, int, torch.device]:
    """Join the job's process group; returns (rank, world_size, device).

    nccl on CUDA, gloo on CPU unless `backend` says otherwise. Outside torchrun (no RANK/WORLD_SIZE in the
    environment) nothing is initialised and this is rank 0 of 1, so the same entry point runs a one-process
    debug job. Calling it again once the group exists just reports the group.
    """
    device = default_device()
    if dist.is_initialized():
        return dist.get_rank(), dist.get_world_size(), device
    if not launched_by_torchrun():
        return 0, 1, device
    if backend is None:
        backend = "nccl" if device.type == "cuda" else "gloo"
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group(backend=backend, device_id=device if device.type == "cuda" else None)
    return dist.get_rank(), dist.get_world_size(), device


def destroy_distributed() -> None:
    if dist.is_initialized():
        dist.destroy_process_group()


def finish_distributed(status: int = 0) -> None:
    """End a job that finished well (or stopped on request: `status` 130): destroy its process group and, on gloo,
    leave without the interpreter's finalisation (exit status `status`).

    After a two-process CPU run had finished, written its results and destroyed its group, gloo's C++ threads
    still aborted rank 0 during finalisation once in CI ("terminate called without an active exception", torch
    2.13; the spawned test workers had shown the same), so torchrun reported the finished job as failed. Nothing
    of the run is left to write at that point: the log handlers and standard streams are flushed first. NCCL jobs
    and one-process runs end normally.
    """
    gloo = dist.is_initialized() and dist.get_backend() == "gloo"
    destroy_distributed()
    if gloo:
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(status)


@dataclass
class ParallelDims:
    """Degrees of the two parallel axes; `world_mesh` is built on first use (needs the process group).

    dp_shard * tp must equal world_size. A degree of 1 keeps its axis in the mesh (as a size-1 group), so
    FSDP2 can still be applied on a pure-TP job for its mixed-precision policy.
    """

    dp_shard: int
    tp: int
    world_size: int
    device_type: str = field(default_factory=lambda: default_device().type)
    _world_mesh: DeviceMesh | None = field(default=None, init=False, repr=False)

    def __post_init__(self) -> None:
        if self.tp < 1:
            raise ValueError(f"parallel dims: tp must be >= 1, got {self.tp}")
        if self.dp_shard == -1:
            if self.world_size % self.tp:
                raise ValueError(f"parallel dims: world_size {self.world_size} is not divisible by tp {self.tp}")
            self.dp_shard = self.world_size // self.tp
        if self.dp_shard < 1:
            raise ValueError(f"parallel dims: dp_shard must be >= 1 or -1 (infer), got {self.dp_shard}")
        if self.dp_shard * self.tp != self.world_size:
            raise ValueError(f"parallel dims: dp_shard ({self.dp_shard}) * tp ({self.tp}) != "
                             f"world_size ({self.world_size})")

    @property
    def world_mesh(self) -> DeviceMesh:
        if self._world_mesh is None:
            self._world_mesh = init_device_mesh(self.device_type, (self.dp_shard, self.tp),
                                                mesh_dim_names=("dp_shard", "tp"))
        return self._world_mesh

    @property
    def dp_mesh(self) -> DeviceMesh:
        """The FSDP axis; also the data-parallel axis (each of its ranks reads different samples)."""
        return self.world_mesh["dp_shard"]

    @property
    def tp_mesh(self) -> DeviceMesh:
        return self.world_mesh["tp"]

    @property
    def tp_enabled(self) -> bool:
        return self.tp > 1

    @property
    def fsdp_enabled(self) -> bool:
        return self.dp_shard > 1

    @property
    def dp_rank(self) -> int:
        """Which data shard this rank reads (TP peers read the same one)."""
        return self.dp_mesh.get_local_rank()


def build_parallel_dims(dp_shard: int, tp: int, world_size: int) -> ParallelDims:
    """Validate the degrees (dp_shard=-1 takes what tp leaves) and return them; the mesh is built lazily."""
    return ParallelDims(dp_shard=dp_shard, tp=tp, world_size=world_size)
