"""One function of fixed-shape tensors captured as a CUDA graph and replayed: the rollout's decode step, one graph
per ladder size."""

from __future__ import annotations

import time
from typing import Callable

import torch
from torch.distributed.tensor import DTensor


def plain_tensors(model) -> bool:
    """Whether a model's weights are plain tensors: FSDP2 units gather theirs in hooks and DTensor ops cannot be
    captured, so captured graphs and weight copies made for them (the decode step's fused q/k/v) need this."""
    return not hasattr(model, "unshard") and not any(isinstance(p, DTensor) for p in model.parameters())


CAPTURE_ROOM = 2**30  # driver-free bytes a capture is given when no earlier capture measured its pool


def make_room(need: int) -> bool:
    """Return the caching allocator's unused blocks to the driver when it has fewer than `need` bytes free; whether
    it did. A capture's private pool takes new memory from the driver, and while a capture is under way the
    allocator may not free its cached blocks for it (cudaFree cannot be captured): with the device's free memory
    cached by the earlier phases the capture fails though enough is reserved. The check is one driver call;
    the emptying, when needed, costs the next phases' re-mapping (docs/memory.md)."""
    free, _ = torch.cuda.mem_get_info()
    if free >= need:
        return False
    torch.cuda.empty_cache()
    return True


class CapturedStep:
    """A function of fixed-shape tensors captured as one CUDA graph on first call and replayed after.

    Inputs are copied into static buffers, the outputs are static buffers overwritten by the next replay. What the
    function reads besides its inputs (the rollout's KV pool, the weights) must keep its addresses while the graph
    is replayed: a new KV pool or moved weights need a new capture. Warm-up runs on a side stream first, as capture
    requires. The capture is begun by hand rather than through `torch.cuda.graph`, whose entry empties the device
    and pinned-host caches: after every rollout's recapture the next phases would allocate all their memory from
    the driver again. Each capture gets its own private memory pool (a pool whose graphs are all gone is freed, and
    cannot be handed to a later capture), or the one of `pool` (a `torch.cuda.graph_pool_handle()` shared by graphs
    that never run at once, e.g. the rollout's decode step at each ladder size): then a graph's scratch memory may
    hold another graph's outputs, so read a graph's outputs before replaying another graph of the pool.
    Mode "thread_local": copy threads of the memory manager may keep issuing copies while this thread captures.
    Before capturing, the driver is made to have `room_bytes` free (`make_room`); `pool_bytes` is what the capture
    reserved (its pool, and anything other threads reserved meanwhile: an upper bound), for the next one's room.
    """

    def __init__(self, fn, on_capture: Callable[[float], None] | None = None, room_bytes: int = CAPTURE_ROOM,
                 pool=None):
        self.fn = fn
        self.mempool = pool
        self.on_capture = on_capture
        self.room_bytes = room_bytes
        self.pool_bytes = 0
        self.graph = None

    def _capture(self, args):
        t0 = time.perf_counter()
        self.static_in = [a.clone() for a in args]
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            for _ in range(2):
                self.fn(*self.static_in)
            make_room(self.room_bytes)
            reserved = torch.cuda.memory_reserved()
            self.graph = torch.cuda.CUDAGraph()
            self.graph.capture_begin(pool=self.mempool, capture_error_mode="thread_local")
            try:
                self.static_out = self.fn(*self.static_in)
            finally:
                self.graph.capture_end()
                self.pool_bytes = torch.cuda.memory_reserved() - reserved
        torch.cuda.current_stream().wait_stream(side)
        if self.on_capture is not None:
            self.on_capture(time.perf_counter() - t0)

    def __call__(self, *args):
        if self.graph is None:
            self._capture(args)
        for buf, a in zip(self.static_in, args):
            buf.copy_(a)
        self.graph.replay()
        return self.static_out
