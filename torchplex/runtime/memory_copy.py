"""Copy engines of the phase-aware memory manager (`runtime/memory.py`) and the host buffers they copy into.

An engine moves `StorageMove`s: it copies a device storage to its host buffer and frees the storage in place
(`untyped_storage().resize_(0)`: modules and optimizers keep their Python tensors), or allocates the storage again
and copies the host buffer back. It returns a `Ticket` the consumer waits on, so a copy started for the next phase
runs while the current phase computes and only the phase that needs the data waits for it.

| engine                 | what it does                                                                            |
|------------------------|-----------------------------------------------------------------------------------------|
| `CudaStreamCopyEngine` | default on CUDA: copies out on one side stream, in on another (the link is full duplex) |
| `NoCopyEngine`         | default on CPU, where device = host: moves nothing                                      |
| `ThreadCopyEngine`     | the contract on CPU: real copies and frees on one FIFO worker thread; CPU tests check   |
|                        | bitwise round trips and waiting through it (`copy_fn` injectable)                       |
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Callable, Protocol

import torch
from torch import Tensor

HOST_ALIGN = 512  # bytes; slots of a host arena start on this boundary (DMA-friendly, any dtype's alignment)


class HostArena:
    """One host allocation carved into a slot per storage.

    The pinned host allocator rounds every request up to a power of two, so one pinned buffer per storage could
    take up to twice a group's bytes (a 300 MB storage would take 512 MB); one arena per group is rounded once.
    `take` returns None when the arena is full (the caller then allocates that storage its own buffer).
    """

    def __init__(self, nbytes: int, pin_memory: bool):
        self.buffer = torch.empty(max(int(nbytes), 1), dtype=torch.uint8, pin_memory=pin_memory)
        self.used = 0

    @property
    def nbytes(self) -> int:
        return self.buffer.numel()

    def take(self, nbytes: int) -> Tensor | None:
        if self.used + nbytes > self.nbytes:
            return None
        view = self.buffer[self.used:self.used + nbytes]
        self.used += -(-nbytes // HOST_ALIGN) * HOST_ALIGN
        return view


@dataclass(eq=False)
class StorageMove:
    """One device storage and its host buffer (uint8, the storage's bytes)."""

    tensor: Tensor  # any tensor on the storage; kept alive so its storage can be resized in place
    host: Tensor
    nbytes: int
    out_event: object = None  # CUDA: the event after this storage's last copy out (a copy in must wait for it)

    def device_bytes(self) -> Tensor:
        return torch.empty(0, dtype=torch.uint8, device=self.tensor.device).set_(self.tensor.untyped_storage())

    def free(self) -> None:
        self.tensor.untyped_storage().resize_(0)

    def allocate(self) -> None:
        self.tensor.untyped_storage().resize_(self.nbytes)


class Ticket(Protocol):
    def wait(self) -> None:
        """After this, work issued on the current stream sees the copy done."""

    def synchronize(self) -> None:
        """After this, the copy is done (host-side)."""


class CopyEngine(Protocol):
    moves_data: bool
    pin_memory: bool

    def offload(self, moves: list[StorageMove]) -> Ticket:
        """Copy each storage to its host buffer, then free the storage."""

    def prefetch(self, moves: list[StorageMove]) -> Ticket:
        """Allocate each storage again and copy its host buffer back."""


class DoneTicket:
    def wait(self) -> None:
        pass

    synchronize = wait


class NoCopyEngine:
    """Device is host (CPU): nothing moves; the manager's bookkeeping runs unchanged."""

    moves_data = False
    pin_memory = False

    def offload(self, moves):
        return DoneTicket()

    def prefetch(self, moves):
        return DoneTicket()


class FutureTicket:
    def __init__(self, future: Future):
        self.future = future

    def wait(self) -> None:
        self.future.result()

    synchronize = wait


def _copy(dst: Tensor, src: Tensor) -> None:
    dst.copy_(src)


class ThreadCopyEngine:
    """Real copies and frees on one worker thread, in submission order like a copy stream: the CUDA engine's
    contract where there is no GPU. `copy_fn(dst, src)` is injectable: tests slow it down or gate it to show that
    nothing is used before its prefetch completes."""

    moves_data = True
    pin_memory = False

    def __init__(self, copy_fn: Callable[[Tensor, Tensor], None] = _copy):
        self.copy_fn = copy_fn
        self.worker = ThreadPoolExecutor(max_workers=1, thread_name_prefix="memory-copy")

    def _offload(self, moves: list[StorageMove]) -> None:
        for m in moves:
            self.copy_fn(m.host, m.device_bytes())
            m.free()

    def _prefetch(self, moves: list[StorageMove]) -> None:
        for m in moves:
            m.allocate()
            self.copy_fn(m.device_bytes(), m.host)

    def offload(self, moves):
        return FutureTicket(self.worker.submit(self._offload, moves))

    def prefetch(self, moves):
        return FutureTicket(self.worker.submit(self._prefetch, moves))


class CudaTicket:
    def __init__(self, event: torch.cuda.Event, device: torch.device):
        self.event, self.device = event, device

    def wait(self) -> None:
        torch.cuda.current_stream(self.device).wait_event(self.event)

    def synchronize(self) -> None:
        self.event.synchronize()


class CudaStreamCopyEngine:
    """Copies on side streams with pinned host buffers; consumers wait on an event, the host never blocks.

    Copies out and copies in run on two streams, so the groups a phase drops on entry go out while the next
    phase's come in (the link is full duplex). A copy in of a storage waits for that storage's last copy out (the
    host buffer must be written before it is read back)."""

    moves_data = True
    pin_memory = True

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self.stream = torch.cuda.Stream(device=self.device)      # copies in
        self.out_stream = torch.cuda.Stream(device=self.device)  # copies out

    def offload(self, moves):
        self.out_stream.wait_stream(torch.cuda.current_stream(self.device))  # the producer's writes land first
        with torch.cuda.stream(self.out_stream):
            for m in moves:
                view = m.device_bytes()
                m.host.copy_(view, non_blocking=True)
                view.record_stream(self.out_stream)  # the allocator must not hand the block out before the copy read it
                m.free()
            event = self.out_stream.record_event()
        for m in moves:
            m.out_event = event
        return CudaTicket(event, self.device)

    def prefetch(self, moves):
        for m in moves:  # allocated on the compute stream, which owns the blocks from then on
            m.allocate()
        self.stream.wait_stream(torch.cuda.current_stream(self.device))  # reused blocks may still be read there
        for event in {id(m.out_event): m.out_event for m in moves if m.out_event is not None}.values():
            self.stream.wait_event(event)
        with torch.cuda.stream(self.stream):
            for m in moves:
                m.device_bytes().copy_(m.host, non_blocking=True)
            return CudaTicket(self.stream.record_event(), self.device)


def default_copy_engine(device: torch.device) -> CopyEngine:
    return CudaStreamCopyEngine(device) if torch.device(device).type == "cuda" else NoCopyEngine()
