"""Multi-process CPU tests: a gloo process group per spawned worker, with a deadline on the whole run."""

from __future__ import annotations

import os
import socket
import time

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def init_gloo(rank: int, world_size: int, port: int) -> None:
    """Join a gloo group on localhost; one thread per process keeps 2 cores from thrashing."""
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world_size)


def _run_then_exit(rank: int, fn, *args) -> None:
    """fn(rank, *args), then leave without the interpreter's finalisation: once a worker has destroyed its process
    group and written its result, gloo's C++ threads can still abort it at teardown ("terminate called without an
    active exception", seen once in CI on torch 2.13), which spawn reports as the test's failure. An exception from fn
    still propagates as usual."""
    import sys

    fn(rank, *args)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def spawn(fn, world_size: int, args: tuple, timeout_s: float, what: str = "") -> None:
    """Run fn(rank, world_size, *args) in world_size spawned processes; fail the test past the deadline."""
    context = mp.start_processes(_run_then_exit, args=(fn, world_size, *args), nprocs=world_size, join=False,
                                 start_method="spawn")
    deadline = time.monotonic() + timeout_s
    while not context.join(timeout=1):
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            pytest.fail(f"{what or fn.__name__} on {world_size} processes did not finish within {timeout_s} s")
