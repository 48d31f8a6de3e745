"""Phase-aware memory manager: device residency decided by which phase produces and consumes each tensor group.

A colocated GRPO step holds actor weights, optimizer state, gradients, reference weights, the rollout KV pool and
training activations, but no phase needs all of them at once:

    rollout    actor weights + KV pool
    ref        actor weights + reference weights
    train      actor weights + gradients + activations + optimizer state (the step at the end of train)

Off by default (`memory.managed`); the 32B recipe (train_configs/qwen2_5_vl_32b.toml) turns it on because the
actor, the reference, the optimizer state and the KV pool do not fit the device together; runtime/build.py
registers those groups and the gradients. Each group names the phases that need it (`TensorGroup`,
runtime/memory_plan.py, which also describes the group kinds), and `MemoryPlan.build` turns that into plain data:
per phase, what is resident, what is copied out on entry, what is loaded late, what is prefetched for the next
phase, and the expected peak. `MemoryManager.enter(phase)` executes one phase's row: it frees what the phase does
not hold, waits on the prefetches of what it needs, and starts the next phase's prefetches on a copy engine (CUDA
copy streams on GPU, runtime/memory_copy.py), so transfers overlap the phase's compute.

An offloaded group's data goes to a host buffer (one allocation per group, reused every step, pinned on CUDA) and
its device storage is freed in place (`untyped_storage().resize_(0)`), so modules and optimizers keep pointing at
the same Python tensors; a prefetch allocates the storage again and copies back.

Decisions follow the actual state, not an assumed order: a skipped phase only means some prefetches are waited on
later or copied out again. On CPU the device is the host: the default `NoCopyEngine` moves nothing but the manager
keeps the same bookkeeping (tracked bytes per phase equal the plan's peaks). The copy engine is injectable:
`ThreadCopyEngine` really frees and restores storages on a worker thread, so CPU tests check bitwise round trips and
that a phase never starts before its prefetch has landed.
"""

from __future__ import annotations

import json
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch

from ..components import peak_memory
from .memory_copy import (CopyEngine, CudaStreamCopyEngine, HostArena, NoCopyEngine, StorageMove,
                          ThreadCopyEngine, Ticket, default_copy_engine)
from .memory_plan import (GiB, KINDS, MemoryPlan, PhasePlan, PlannedGroup, TensorGroup, grads_group, kv_pool_group,
                          module_group, optimizer_state_group, storage_tensors, tensor_bytes)

__all__ = ["ARENA_SLACK_BYTES", "CopyEngine", "CudaStreamCopyEngine", "GiB", "KINDS", "MemoryManager", "MemoryPlan",
           "NoCopyEngine", "PhasePlan", "PhaseRecord", "PlannedGroup", "TensorGroup", "ThreadCopyEngine",
           "default_copy_engine", "grads_group", "kv_pool_group", "module_group", "optimizer_state_group",
           "tensor_bytes"]

ARENA_SLACK_BYTES = 64 * 2**20  # alignment padding and small tensors beyond a group's planned bytes


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
    copy_in_bytes: int = 0              # planned bytes of what the manager copied in during the phase
    copy_out_bytes: int = 0             # planned bytes of what it copied out


class MemoryManager:
    """Executes a `MemoryPlan`: `enter(phase)` at the start of each phase, `close()` after the last one.

    Groups start on the device (where models and optimizers are built). `records` holds one `PhaseRecord` per
    entered phase; `save(path)` writes them beside the plan.
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
            if g.kind == "release" and (g.release is None or g.reserve is None):
                raise ValueError(f"group {g.name!r}: a release group needs release() and reserve()")
        self.engine = engine if engine is not None else default_copy_engine(self.device)
        self.size = {g.name: g.nbytes for g in plan.groups}
        self.on_device = {g.name: g.kind != "host" for g in groups}  # or on its way there
        self.records: list[PhaseRecord] = []
        self._buffers: dict[int, StorageMove] = {}  # id(tensor) -> its host buffer, allocated once
        self._arenas: dict[str, HostArena] = {}     # one host allocation per group
        self._moved: dict[str, list[StorageMove]] = {}
        self._prefetching: dict[str, Ticket] = {}
        self._offloading: dict[str, Ticket] = {}    # in issue order
        self._current: PhaseRecord | None = None
        self._check_disjoint()

    # ---- per phase ----
    def enter(self, phase: str) -> PhaseRecord:
        """Start `phase`: free and copy out what it does not hold, wait for what it needs (loading what was not
        prefetched), start the next phase's prefetches. Returns the phase's record."""
        row = self.plan.phase(phase)
        self.close()
        start = time.perf_counter()
        record = self._current = PhaseRecord(phase, row.peak_bytes, 0)  # _current: moves count on it
        outgoing = self._leave(row, record)
        if row.drain:
            for ticket in self._offloading.values():
                ticket.synchronize()
            self._offloading.clear()
        self._arrive(row, record)
        for name in row.prefetch:
            if not self.on_device[name]:
                self._prefetch(name)
                record.prefetched.append(name)
        record.wait_s = time.perf_counter() - start
        in_flight = 0 if row.drain else sum(self.size[n] for n in outgoing)
        record.tracked_bytes = in_flight + sum(
            self.size[n] for n, g in self.groups.items()
            if (g.kind in ("offload", "release") and self.on_device[n]) or (g.kind == "transient" and n in row.needed))
        if self.device.type == "cuda":
            peak_memory.reset_peak(self.device)
        self.records.append(record)
        return record

    def _leave(self, row: PhasePlan, record: PhaseRecord) -> list[str]:
        """Free the release groups the phase does not need, then start copying out the offload groups it does not
        hold (freed first, so what comes in next has room). Returns the groups copied out."""
        needed, resident = set(row.needed), set(row.resident)
        for name, g in self.groups.items():
            if g.kind == "release" and self.on_device[name] and name not in needed:
                g.release()
                self.on_device[name] = False
                record.offloaded.append(name)
        outgoing = [n for n, g in self.groups.items()
                    if g.kind == "offload" and self.on_device[n] and n not in resident]
        for name in outgoing:
            self._offload(name)
        record.offloaded += outgoing
        return outgoing

    def _arrive(self, row: PhasePlan, record: PhaseRecord) -> None:
        """Make every group the phase needs usable: load what is away (blocking), wait on what was prefetched,
        reserve released groups."""
        for name in row.needed:
            g = self.groups[name]
            if g.kind == "offload" and not self.on_device[name]:
                self._prefetch(name)
                record.loaded.append(name)
            if name in self._prefetching:
                self._prefetching.pop(name).wait()
            if g.kind == "release" and not self.on_device[name]:
                g.reserve()
                self.on_device[name] = True
                record.loaded.append(name)

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

    # ---- moves ----
    def _storages(self, name: str) -> list[StorageMove]:
        """The group's device storages (each once), each with its host buffer (taken from the group's arena the
        first time)."""
        moves, seen = [], set()
        for t in storage_tensors(self.groups[name].tensors()):
            if t.device != self.device:
                continue  # already on the host (e.g. a CPU step counter)
            storage = t.untyped_storage()
            if storage.nbytes() == 0 or storage.data_ptr() in seen:
                continue
            seen.add(storage.data_ptr())
            move = self._buffers.get(id(t))
            if move is None or move.nbytes != storage.nbytes():
                if name not in self._arenas:
                    self._arenas[name] = HostArena(self.size[name] + ARENA_SLACK_BYTES, self.engine.pin_memory)
                host = self._arenas[name].take(storage.nbytes())
                if host is None:  # more than planned: a buffer of its own
                    host = torch.empty(storage.nbytes(), dtype=torch.uint8, pin_memory=self.engine.pin_memory)
                move = self._buffers[id(t)] = StorageMove(t, host, storage.nbytes())
            moves.append(move)
        return moves

    def _offload(self, name: str) -> None:
        pending = self._prefetching.pop(name, None)
        if pending is not None:  # prefetched for a phase that was skipped: storages must exist before we list them
            pending.synchronize()
        moves = self._storages(name) if self.engine.moves_data else []
        self._moved[name] = moves
        self._count(name, "copy_out_bytes")
        self._offloading[name] = self.engine.offload(moves)
        self.on_device[name] = False

    def _prefetch(self, name: str) -> None:
        self._offloading.pop(name, None)
        self._count(name, "copy_in_bytes")
        self._prefetching[name] = self.engine.prefetch(self._moved.pop(name, []))
        self.on_device[name] = True

    def _count(self, name: str, field_name: str) -> None:
        if self._current is not None:
            setattr(self._current, field_name, getattr(self._current, field_name) + self.size[name])

    def _check_disjoint(self) -> None:
        """Two groups sharing a storage would free each other's data: refuse, naming both."""
        owner: dict[int, str] = {}
        for name, g in self.groups.items():
            if g.kind != "offload":
                continue
            for t in storage_tensors(g.tensors()):
                ptr = t.untyped_storage().data_ptr() if t.device.type != "meta" else 0
                if ptr and owner.setdefault(ptr, name) != name:
                    raise ValueError(f"groups {owner[ptr]!r} and {name!r} share a storage; give it to one of "
                                     f"them (module_group(..., exclude=...))")

    # ---- reporting ----
    def save(self, path: str | Path) -> Path:
        """The plan and the measured records side by side, as JSON."""
        self.close()
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"plan": self.plan.to_dict(), "measured": [asdict(r) for r in self.records]},
                                   indent=2))
        return path
