"""Phase-aware memory manager: HBM residency decided by which phase produces and consumes each tensor group.

A colocated GRPO step holds actor weights, fp32 master weights, optimizer state, gradients, reference weights, the
rollout KV pool and training activations, but no phase needs all of them at once:

    rollout    actor weights + KV pool
    ref        reference weights
    train      actor weights + gradients + activations
    optimizer  actor weights + gradients + master weights + optimizer state   (the step at the end of train)

Each large group is registered with the phases that need it (`TensorGroup`, `memory_groups.py`). `MemoryPlan.build`
(`memory_plan.py`) turns that into plain data: per phase, what is resident, what is copied out on entry, what is
loaded late, what is prefetched for the next phase, and the expected peak. `MemoryManager.enter(phase)` executes one
phase's row: it frees what the phase does not hold, waits on the prefetches of what it needs, and starts the next
phase's prefetches on a copy engine (CUDA copy streams on GPU, `memory_copy.py`), so transfers overlap the phase's
compute.

Group kinds:
    offload    data must survive: copied to a pinned host buffer (allocated once, reused) and the device storage
               freed in place (`untyped_storage().resize_(0)`), so modules and optimizers keep pointing at the same
               Python tensors; prefetch re-allocates the storage and copies back. A `frozen` offload group (the
               reference weights) never changes on the device: after its first copy out it is only freed.
    release    data need not survive: `release()` frees it, `reserve()` allocates it again (the rollout KV pool).
    transient  allocated and freed by the phase's own code (gradients, activations): counted, never moved.
    host       lives in host memory throughout (torchao's CPU-offloaded optimizer state): listed, never on device.

A *streamed* offload group (`chunks`) is needed in one phase only and never held there whole: the phase walks its
chunks with `MemoryManager.stream()`, which prefetches chunk i+1 while chunk i is used and copies chunk i out after,
keeping at most the plan's `stream_window_bytes` of the group on the device (chunks in use, coming in, or still
being copied out). The phase before may prefetch the first chunks where the budget allows. This is how the AdamW
state (2 x fp32 per parameter) goes through the optimizer phase (`runtime/master_weights.py`). Where every phase
has room, the plan may keep a streamed group's first chunks *resident* (`MemoryPlan.build(max_resident_chunks=...)`):
they never move, so each one saves two copies per step; the stream yields them without waiting.

The plan's rule: a phase holds what it needs plus what the next phase needs (prefetched during it), as far as a
device budget allows. Whatever the previous phase needed and this one does not hold is copied out on entry; until
those copies finish their memory is still taken (the caching allocator only reuses a block once the copy stream
has read it), so a phase's peak counts them, unless the plan "drains" them (waits for the copies, host-side,
before allocating anything), which it does only when the budget requires it. A group that could not be prefetched
is loaded on entry (blocking). `exposed_bytes` is what is copied without overlap: late loads, drained copies and
the chunks a streamed phase must bring in after it started.

On CPU the device is the host: the default `NoCopyEngine` moves nothing but the manager keeps the same
bookkeeping (tracked bytes per phase equal the plan's peaks). The copy engine is injectable: `ThreadCopyEngine`
really frees and restores storages on a worker thread, so CPU tests can check bitwise round trips and that a phase
never starts before its prefetch has landed.
"""

from __future__ import annotations

import json
import time
from collections import deque
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Iterator

import torch

from ..components import peak_memory
from .memory_copy import (CopyEngine, CudaStreamCopyEngine, DoneTicket, FutureTicket, HostArena,  # noqa: F401
                          NoCopyEngine, NoTransferCopyEngine, StorageMove, ThreadCopyEngine, Ticket,
                          default_copy_engine)

from .memory_groups import (KINDS, TensorGroup, grads_group, kv_pool_group, module_group,  # noqa: F401
                            optimizer_state_group, plain_tensors, tensor_bytes, window_bytes)
from .memory_plan import GiB, MemoryPlan, PhasePlan, PlannedGroup  # noqa: F401

ARENA_SLACK_BYTES = 64 * 2**20  # alignment padding and small tensors beyond a group's planned bytes


# ---- the manager ----------------------------------------------------------------------------------------------
Unit = tuple  # (group name, chunk index or None): what one copy moves


@dataclass
class PhaseRecord:
    phase: str
    planned_peak_bytes: int
    tracked_bytes: int                  # the manager's own count: groups it holds + copies in flight + transients
    measured_peak_bytes: int | None = None      # torch.cuda.max_memory_allocated over the phase (None off CUDA)
    measured_reserved_bytes: int | None = None  # max_memory_reserved: also sees blocks awaiting a copy
    offloaded: list[str] = field(default_factory=list)
    loaded: list[str] = field(default_factory=list)
    prefetched: list[str] = field(default_factory=list)
    wait_s: float = 0.0                 # host time `enter` blocked (late loads, drains, slow prefetches)
    chunks_streamed: int = 0            # chunks `stream()` walked in this phase
    stream_wait_s: float = 0.0          # host time `stream()` blocked (room for the next chunk, host-side waits)
    copy_in_bytes: int = 0              # planned bytes of what the manager copied in during the phase
    copy_out_bytes: int = 0             # planned bytes of what it copied out (a frozen group's free is no copy)


class MemoryManager:
    """Executes a `MemoryPlan`: `enter(phase)` at the start of each phase, `close()` after the last one; a phase
    with streamed groups walks them with `for i in manager.stream(): ...`.

    Decisions follow the actual state, not an assumed order: a skipped phase only means some prefetches are waited
    on later or copied out again. Groups start on the device (where models and optimizers are built).
    """

    def __init__(self, plan: MemoryPlan, groups: list[TensorGroup], device: torch.device | str,
                 engine: CopyEngine | None = None):
        self.plan, self.device = plan, torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:  # compare like tensors report it: cuda:N
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.groups = {g.name: g for g in groups}
        if sorted(self.groups) != sorted(g.name for g in plan.groups):
            raise ValueError(f"groups {sorted(self.groups)} differ from the plan's {[g.name for g in plan.groups]}")
        for g in groups:
            if g.kind == "offload" and g.tensors is None:
                raise ValueError(f"group {g.name!r}: an offload group needs `tensors` to be managed (plan-only?)")
            if g.streamed and g.chunks is None:
                raise ValueError(f"group {g.name!r}: a streamed group needs `chunks` to be managed (plan-only?)")
            if g.kind == "release" and (g.release is None or g.reserve is None):
                raise ValueError(f"group {g.name!r}: a release group needs release() and reserve()")
        self.engine = engine if engine is not None else default_copy_engine(self.device)
        self.size = {g.name: g.nbytes for g in plan.groups}
        self.chunk_size = {g.name: g.chunk_nbytes for g in plan.groups if g.chunk_nbytes is not None}
        self.on_device = {g.name: g.kind != "host" for g in groups if not g.streamed}  # or on its way there
        self.chunk_on_device = {n: [True] * len(sizes) for n, sizes in self.chunk_size.items()}
        self.resident_chunks = plan.resident_chunks  # never moved
        self.records: list[PhaseRecord] = []
        self._buffers: dict[int, StorageMove] = {}  # id(tensor) -> its host buffer, allocated once
        self._arenas: dict[str, HostArena] = {}     # one host allocation per group
        self._moved: dict[Unit, list[StorageMove]] = {}
        self._prefetching: dict[Unit, Ticket] = {}
        self._offloading: dict[Unit, Ticket] = {}   # in issue order
        self._host_valid: set[Unit] = set()         # frozen units whose host copy is current
        self._tail_bytes = 0                        # the last stream's chunks still being copied out
        self._current: PhaseRecord | None = None
        self._check_disjoint()

    # ---- per phase ----
    def enter(self, phase: str) -> PhaseRecord:
        row = self.plan.phase(phase)
        self.close()
        start = time.perf_counter()
        resident, needed = set(row.resident), set(row.needed)
        record = self._current = PhaseRecord(phase, row.peak_bytes, 0)  # _current: moves count on it
        for name, g in self.groups.items():  # free first, so what comes in next has room
            if g.kind == "release" and self.on_device[name] and name not in needed:
                g.release()
                self.on_device[name] = False
                record.offloaded.append(name)
        outgoing = [n for n, g in self.groups.items()
                    if g.kind == "offload" and not g.streamed and self.on_device[n] and n not in resident]
        for name in outgoing:
            self._offload((name, None))
        record.offloaded += outgoing
        for name, on in self.chunk_on_device.items():  # streamed groups outside their phase (or its prefetch)
            keep = len(on) if name in needed else self.resident_chunks[name] + row.prefetch_chunks.get(name, 0)
            leaving = [i for i in range(keep, len(on)) if on[i]]
            for i in leaving:
                self._offload((name, i))
            if leaving:
                record.offloaded.append(name)
        tail = self._tail_bytes
        self._tail_bytes = 0
        if row.drain:
            for ticket in self._offloading.values():
                ticket.synchronize()
            self._offloading.clear()
        for name in row.needed:
            g = self.groups[name]
            if g.streamed:
                continue  # walked by stream()
            if g.kind == "offload" and not self.on_device[name]:
                self._prefetch((name, None))
                record.loaded.append(name)
            if (name, None) in self._prefetching:
                self._prefetching.pop((name, None)).wait()
            if g.kind == "release" and not self.on_device[name]:
                g.reserve()
                self.on_device[name] = True
                record.loaded.append(name)
        for name in row.prefetch:
            if not self.on_device[name]:
                self._prefetch((name, None))
                record.prefetched.append(name)
        for name, k in row.prefetch_chunks.items():
            first = self.resident_chunks[name]
            coming = [i for i in range(first, first + k) if not self.chunk_on_device[name][i]]
            for i in coming:
                self._prefetch((name, i))
            if coming:
                record.prefetched.append(name)
        record.wait_s = time.perf_counter() - start
        in_flight = sum(self.size[n] for n in outgoing if not self.groups[n].frozen) + tail
        record.tracked_bytes = (
            sum(self.size[n] for n, g in self.groups.items()
                if g.kind in ("offload", "release") and not g.streamed and self.on_device[n])
            + sum(b for n, on in self.chunk_on_device.items() for b, o in zip(self.chunk_size[n], on) if o)
            + sum(self.size[n] for n in row.needed if self.groups[n].kind == "transient")
            + (0 if row.drain else in_flight))
        if self.device.type == "cuda":
            peak_memory.reset_peak(self.device)
        self.records.append(record)
        return record

    def stream(self, num_chunks: int | None = None) -> Iterator[int]:
        """Walk the current phase's streamed groups: yields chunk indices in order; when it yields i, chunk i of
        every streamed group is on the device (its copy waited on) and after the loop body it is copied out.

        Chunks i+1 .. i+window-2 are prefetched ahead; a prefetch that would take the chunks on the device (in
        use, coming in, or still going out) past the plan's `stream_window_bytes` first waits, host-side, for the
        oldest copies out (their blocks return to the allocator only then). `num_chunks` checks the caller's count.
        The plan's resident chunks (the first R) are yielded without waiting and never copied out; while they are
        walked, the first moving chunks come in as far as the window allows (no copy out to wait for yet)."""
        record = self._current
        if record is None:
            raise RuntimeError("stream() runs inside a phase: call enter(phase) first")
        row = self.plan.phase(record.phase)
        names = row.streamed
        if not names:
            raise ValueError(f"phase {record.phase!r} streams no group; the plan streams "
                             f"{[r.phase for r in self.plan.phases if r.streamed]}")
        n = len(self.chunk_size[names[0]])
        if num_chunks is not None and num_chunks != n:
            raise ValueError(f"the caller walks {num_chunks} chunks, the plan's streamed groups have {n}")
        size = [sum(self.chunk_size[name][i] for name in names) for i in range(n)]
        on = lambda i: all(self.chunk_on_device[name][i] for name in names)
        kept = self.resident_chunks[names[0]]  # the plan gives a phase's streamed groups one R
        live = {i: size[i] for i in range(kept, n) if on(i)}  # moving chunks on the device (or still going out)
        going_out: deque[int] = deque()
        static = record.tracked_bytes - sum(live.values())
        peak = record.tracked_bytes
        lookahead = max(1, self.plan.stream_window - 2)

        def make_room(need: int) -> None:
            while going_out and sum(live.values()) + need > row.stream_window_bytes:
                oldest = going_out.popleft()
                for name in names:
                    ticket = self._offloading.pop((name, oldest), None)
                    if ticket is not None:
                        ticket.synchronize()
                live.pop(oldest)

        def bring(j: int) -> None:
            nonlocal peak
            for name in names:
                if not self.chunk_on_device[name][j]:
                    self._prefetch((name, j))
            live[j] = size[j]
            peak = max(peak, static + sum(live.values()))

        for i in range(n):
            t0 = time.perf_counter()
            if i < kept:  # a resident chunk needs no copy: meanwhile the first moving chunks fill the window
                for j in (j for j in range(kept, n) if not on(j)):
                    if sum(live.values()) + size[j] > row.stream_window_bytes:
                        break
                    bring(j)
            for j in range(i, min(n, i + lookahead + 1)) if i >= kept else ():
                if not on(j):
                    make_room(size[j])
                    bring(j)
            for name in names:
                ticket = self._prefetching.pop((name, i), None)
                if ticket is not None:
                    ticket.wait()
            record.stream_wait_s += time.perf_counter() - t0
            yield i
            record.chunks_streamed += 1
            if i < kept:
                continue  # resident: stays
            for name in names:
                self._offload((name, i))
            going_out.append(i)
        record.tracked_bytes = peak
        self._tail_bytes = sum(live.values())

    def close(self) -> None:
        """End the current phase's measurement (called by `enter`; call it after the step's last phase)."""
        if self._current is not None and self.device.type == "cuda":
            self._current.measured_peak_bytes = peak_memory.max_allocated(self.device)
            self._current.measured_reserved_bytes = torch.cuda.max_memory_reserved(self.device)
        self._current = None

    def synchronize(self) -> None:
        """Wait (host-side) for every copy in flight."""
        for tickets in (self._offloading, self._prefetching):
            for ticket in tickets.values():
                ticket.synchronize()
        self._offloading.clear()

    def reserve_host(self) -> float:
        """Allocate now the host buffers of every group the plan moves (pinned on CUDA; slow for tens of GiB),
        instead of at their first copy out. Returns the seconds it took."""
        start = time.perf_counter()
        moved = {n for r in self.plan.phases for n in r.offload + r.streamed}
        for name in moved:
            if self.groups[name].kind == "offload" and self.engine.moves_data:
                self._arena(name)
        return time.perf_counter() - start

    # ---- moves ----
    def _arena(self, name: str) -> HostArena:
        if name not in self._arenas:
            kept = sum(self.chunk_size[name][:self.resident_chunks[name]]) if name in self.chunk_size else 0
            self._arenas[name] = HostArena(self.size[name] - kept + ARENA_SLACK_BYTES, self.engine.pin_memory)
        return self._arenas[name]

    def _storages(self, unit: Unit) -> list[StorageMove]:
        name, chunk = unit
        g = self.groups[name]
        moves, seen = [], set()
        for t in plain_tensors(g.tensors() if chunk is None else g.chunks()[chunk]):
            if t.device != self.device:
                continue  # already on the host (e.g. a CPU step counter)
            storage = t.untyped_storage()
            if storage.nbytes() == 0 or storage.data_ptr() in seen:
                continue
            seen.add(storage.data_ptr())
            move = self._buffers.get(id(t))
            if move is None or move.nbytes != storage.nbytes():
                host = self._arena(name).take(storage.nbytes())
                if host is None:  # more than planned: a buffer of its own
                    host = torch.empty(storage.nbytes(), dtype=torch.uint8, pin_memory=self.engine.pin_memory)
                move = self._buffers[id(t)] = StorageMove(t, host, storage.nbytes())
            moves.append(move)
        return moves

    def _set_on_device(self, unit: Unit, value: bool) -> None:
        name, chunk = unit
        if chunk is None:
            self.on_device[name] = value
        else:
            self.chunk_on_device[name][chunk] = value

    def _offload(self, unit: Unit) -> None:
        pending = self._prefetching.pop(unit, None)
        if pending is not None:  # prefetched for a phase that was skipped: storages must exist before we list them
            pending.synchronize()
        moves = self._storages(unit) if self.engine.moves_data else []
        self._moved[unit] = moves
        if self.groups[unit[0]].frozen and unit in self._host_valid:
            for m in moves:  # the host copy is still current: only free (ordered after the last reader's stream)
                m.free()
        else:
            self._count(unit, "copy_out_bytes")
            ticket = self.engine.offload(moves)
            if self.groups[unit[0]].frozen:  # first copy out: drained, so no plan ever counts it in flight
                ticket.synchronize()
                self._host_valid.add(unit)
            else:
                self._offloading[unit] = ticket
        self._set_on_device(unit, False)

    def _prefetch(self, unit: Unit) -> None:
        self._offloading.pop(unit, None)
        self._count(unit, "copy_in_bytes")
        self._prefetching[unit] = self.engine.prefetch(self._moved.pop(unit, []))
        self._set_on_device(unit, True)

    def _count(self, unit: Unit, field_name: str) -> None:
        name, chunk = unit
        if self._current is not None:
            nbytes = self.size[name] if chunk is None else self.chunk_size[name][chunk]
            setattr(self._current, field_name, getattr(self._current, field_name) + nbytes)

    def _check_disjoint(self) -> None:
        """Two groups sharing a storage would free each other's data: refuse, naming both."""
        owner: dict[int, str] = {}
        for name, g in self.groups.items():
            if g.kind != "offload":
                continue
            for t in plain_tensors(g.tensors()):
                ptr = t.untyped_storage().data_ptr() if t.device.type != "meta" else 0
                if ptr and owner.setdefault(ptr, name) != name:
                    raise ValueError(f"groups {owner[ptr]!r} and {name!r} share a storage; give it to one of "
                                     f"them (module_group(..., exclude=...))")

    # ---- reporting ----
    def report(self) -> str:
        gib = lambda b: "-" if b is None else f"{b / GiB:.2f}"
        lines = [f"{'phase':<11}{'plan GiB':>10}{'tracked':>10}{'measured':>10}{'reserved':>10}{'wait ms':>10}"
                 f"{'stream ms':>10}"]
        for r in self.records:
            lines.append(f"{r.phase:<11}{gib(r.planned_peak_bytes):>10}{gib(r.tracked_bytes):>10}"
                         f"{gib(r.measured_peak_bytes):>10}{gib(r.measured_reserved_bytes):>10}{r.wait_s * 1e3:>10.1f}"
                         f"{r.stream_wait_s * 1e3:>10.1f}")
        return "\n".join(lines)

    def save(self, path: str | Path) -> Path:
        """The plan and the measured records side by side, as JSON."""
        self.close()
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"plan": self.plan.to_dict(), "measured": [asdict(r) for r in self.records]},
                                   indent=2))
        return path
