"""Phase-aware memory manager: HBM residency decided by which phase produces and consumes each tensor group.

A colocated GRPO step holds actor weights, fp32 master weights, optimizer state, gradients, reference weights, the
rollout KV pool and training activations, but no phase needs all of them at once:

    rollout    actor weights + KV pool
    ref        reference weights
    train      actor weights + gradients + activations
    optimizer  actor weights + gradients + master weights + optimizer state   (the step at the end of train)

Each large group is registered with the phases that need it (`TensorGroup`). `MemoryPlan.build` turns that into
plain data: per phase, what is resident, what is copied out on entry, what is loaded late, what is prefetched for
the next phase, and the expected peak. `MemoryManager.enter(phase)` executes one phase's row: it frees what the
phase does not hold, waits on the prefetches of what it needs, and starts the next phase's prefetches on a copy
engine (a CUDA copy stream on GPU), so transfers overlap the phase's compute.

Group kinds:
    offload    data must survive: copied to a pinned host buffer (allocated once, reused) and the device storage
               freed in place (`untyped_storage().resize_(0)`), so modules and optimizers keep pointing at the same
               Python tensors; prefetch re-allocates the storage and copies back.
    release    data need not survive: `release()` frees it, `reserve()` allocates it again (the rollout KV pool).
    transient  allocated and freed by the phase's own code (gradients, activations): counted, never moved.
    host       lives in host memory throughout (torchao's CPU-offloaded optimizer state): listed, never on device.

The plan's rule: a phase holds what it needs plus what the next phase needs (prefetched during it), as far as a
device budget allows. Whatever the previous phase needed and this one does not hold is copied out on entry; until
those copies finish their memory is still taken (the caching allocator only reuses a block once the copy stream
has read it), so a phase's peak counts them, unless the plan "drains" them (waits for the copies, host-side,
before allocating anything), which it does only when the budget requires it. A group that could not be prefetched
is loaded on entry (blocking). `exposed_bytes` is what is copied without overlap: late loads and drained copies.

On CPU the device is the host: the default `NoCopyEngine` moves nothing but the manager keeps the same
bookkeeping (tracked bytes per phase equal the plan's peaks). The copy engine is injectable: `ThreadCopyEngine`
really frees and restores storages on a worker thread, so CPU tests can check bitwise round trips and that a phase
never starts before its prefetch has landed.
"""

from __future__ import annotations

import itertools
import json
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Iterable, Iterator, Protocol

import torch
from torch import Tensor
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

KINDS = ("offload", "release", "transient", "host")
GiB = 2**30


# ---- groups ---------------------------------------------------------------------------------------------------
def plain_tensors(tensors: Iterable[Tensor]) -> Iterator[Tensor]:
    """The dense tensors that own memory: DTensor shards and torchao's 8-bit optimizer states are unpacked."""
    for t in tensors:
        if is_traceable_wrapper_subclass(t):
            names, _ = t.__tensor_flatten__()
            yield from plain_tensors(getattr(t, n) for n in names)
        else:
            yield t


def tensor_bytes(tensors: Iterable[Tensor]) -> int:
    """Bytes of the distinct storages behind `tensors` (meta tensors: their own numel x element size)."""
    seen, total = set(), 0
    for t in plain_tensors(tensors):
        ptr = 0 if t.device.type == "meta" else t.untyped_storage().data_ptr()
        if ptr and ptr in seen:
            continue
        seen.add(ptr)
        total += t.untyped_storage().nbytes() if ptr else t.numel() * t.element_size()
    return total


@dataclass
class TensorGroup:
    """Tensors with one lifetime: `needed_in` names the phases that produce or consume them.

    `tensors` is called each time the group moves, so lazily created tensors (optimizer state appears at the first
    step) are picked up. `nbytes` overrides the planned size (plan-only groups, e.g. on the meta device, need it).
    """

    name: str
    needed_in: frozenset[str]
    kind: str = "offload"
    tensors: Callable[[], Iterable[Tensor]] | None = None
    nbytes: int | None = None
    release: Callable[[], None] | None = None
    reserve: Callable[[], None] | None = None

    def __post_init__(self) -> None:
        self.needed_in = frozenset(self.needed_in)
        if self.kind not in KINDS:
            raise ValueError(f"group {self.name!r}: kind {self.kind!r} is not one of {KINDS}")
        if not self.needed_in:
            raise ValueError(f"group {self.name!r}: needed_in is empty; a group no phase needs should not be held")

    def planned_bytes(self) -> int:
        if self.nbytes is not None:
            return int(self.nbytes)
        return tensor_bytes(self.tensors()) if self.tensors is not None else 0


def module_group(name: str, module: torch.nn.Module, needed_in: Iterable[str], *,
                 exclude: Iterable[Tensor] = ()) -> TensorGroup:
    """A module's parameters; `exclude` drops parameters another group owns (a vision tower shared by actor and
    reference belongs to the actor only)."""
    skip = {id(p) for p in exclude}
    return TensorGroup(name, frozenset(needed_in), "offload",
                       tensors=lambda: [p for p in module.parameters() if id(p) not in skip])


def optimizer_state_group(name: str, optimizer: torch.optim.Optimizer, needed_in: Iterable[str],
                          nbytes: int | None = None) -> TensorGroup:
    """An optimizer's state tensors (empty until the first step: pass `nbytes` to plan before it).

    torchao's CPUOffloadOptimizer keeps its state on the host already: the group is of kind "host".
    """
    host_opts = getattr(optimizer, "optim_dict", None)
    if host_opts is not None:
        states = lambda: [v for opt in host_opts.values() for s in opt.state.values() for v in s.values()
                          if isinstance(v, Tensor)]
        return TensorGroup(name, frozenset(needed_in), "host", tensors=states, nbytes=nbytes)
    states = lambda: [v for s in optimizer.state.values() for v in s.values() if isinstance(v, Tensor)]
    return TensorGroup(name, frozenset(needed_in), "offload", tensors=states, nbytes=nbytes)


def grads_group(name: str, module: torch.nn.Module, needed_in: Iterable[str]) -> TensorGroup:
    """Gradients of the trainable parameters: created by backward, freed by `zero_grad(set_to_none=True)`."""
    size = tensor_bytes(p for p in module.parameters() if p.requires_grad)
    return TensorGroup(name, frozenset(needed_in), "transient", nbytes=size)


def kv_pool_group(pool, needed_in: Iterable[str] = ("rollout",), name: str = "kv_pool") -> TensorGroup:
    """A `GroupKVPool` (anything with release()/reserve()): its contents die with each rollout, so it is freed
    rather than copied."""
    return TensorGroup(name, frozenset(needed_in), "release", nbytes=pool.num_groups * pool.bytes_per_group,
                       release=pool.release, reserve=pool.reserve)


# ---- the plan -------------------------------------------------------------------------------------------------
@dataclass
class PlannedGroup:
    name: str
    kind: str
    nbytes: int
    needed_in: list[str]


@dataclass
class PhasePlan:
    phase: str
    needed: list[str]       # groups the phase uses
    resident: list[str]     # on device during the phase: needed (not host) + held or prefetched for the next
    offload: list[str]      # on entry: copied out (offload kind) or freed (release kind)
    load: list[str]         # on entry, blocking: not prefetched earlier (offload kind) or reserved (release kind)
    prefetch: list[str]     # started on entry for the next phase, waited on when it enters
    drain: bool             # wait for this entry's copies out before allocating anything (budget too tight)
    peak_bytes: int         # resident + copies still in flight unless drained
    naive_bytes: int        # what the phase would hold if nothing ever left the device
    exposed_bytes: int      # copied without overlapping compute: late loads + drained copies
    fits: bool              # peak_bytes <= the plan's budget (True without a budget)


@dataclass
class MemoryPlan:
    phases: list[PhasePlan]
    groups: list[PlannedGroup]
    budget_bytes: int | None = None

    @classmethod
    def build(cls, groups: list[TensorGroup], phases: list[str], budget_bytes: int | None = None) -> "MemoryPlan":
        """Per phase (cyclic: the last phase's next is the first), choose which of the next phase's groups to hold
        and whether to drain: the choice that fits the budget with the fewest exposed bytes, then the lowest peak
        (when nothing fits: the lowest peak)."""
        _validate(groups, phases)
        info = [PlannedGroup(g.name, g.kind, g.planned_bytes(), [p for p in phases if p in g.needed_in])
                for g in groups]
        by_name = {g.name: g for g in info}
        kind = lambda n: by_name[n].kind
        dev = lambda names: sum(by_name[n].nbytes for n in names if kind(n) != "host")
        needed = {p: [g.name for g in info if p in g.needed_in] for p in phases}
        all_offload = [g.name for g in info if g.kind == "offload"]

        chosen, drains = {}, {}
        for i, p in enumerate(phases):
            prev, nxt = phases[i - 1], phases[(i + 1) % len(phases)]
            candidates = [n for n in needed[nxt] if kind(n) == "offload" and n not in needed[p]]
            best = None
            for r in range(len(candidates) + 1):
                for pick in itertools.combinations(candidates, r):
                    resident = needed[p] + list(pick)
                    outgoing = [n for n in needed[prev] if kind(n) == "offload" and n not in resident]
                    skipped = dev(c for c in candidates if c not in pick)
                    for drain in (False, True):
                        peak = dev(resident) + (0 if drain else dev(outgoing))
                        over = budget_bytes is not None and peak > budget_bytes
                        exposed = skipped + (dev(outgoing) if drain else 0)
                        key = (over, peak, exposed, drain) if over else (over, exposed, peak, drain)
                        if best is None or key < best[0]:
                            best = (key, list(pick), drain)
            chosen[p], drains[p] = best[1], best[2]

        rows = []
        for i, p in enumerate(phases):
            prev = phases[i - 1]
            resident = [n for n in needed[p] if kind(n) != "host"] + chosen[p]
            held_before = needed[prev] + chosen[prev]
            outgoing = [n for n in held_before if kind(n) == "offload" and n not in resident]
            freed = [n for n in needed[prev] if kind(n) == "release" and n not in needed[p]]
            late = [n for n in needed[p] if kind(n) == "offload" and n not in held_before]
            reserved = [n for n in needed[p] if kind(n) == "release" and n not in needed[prev]]
            drain = drains[p] and bool(outgoing)
            peak = dev(resident) + (0 if drain else dev(outgoing))
            rows.append(PhasePlan(
                phase=p, needed=needed[p], resident=resident, offload=outgoing + freed, load=late + reserved,
                prefetch=[n for n in chosen[p] if n not in needed[prev]], drain=drain, peak_bytes=peak,
                naive_bytes=dev(all_offload) + dev(n for n in needed[p] if kind(n) != "offload"),
                exposed_bytes=dev(late) + (dev(outgoing) if drain else 0),
                fits=budget_bytes is None or peak <= budget_bytes))
        return cls(rows, info, budget_bytes)

    def phase(self, name: str) -> PhasePlan:
        for row in self.phases:
            if row.phase == name:
                return row
        raise KeyError(f"phase {name!r} is not in the memory plan; phases: {[r.phase for r in self.phases]}")

    @property
    def peak_bytes(self) -> int:
        return max(r.peak_bytes for r in self.phases)

    @property
    def naive_peak_bytes(self) -> int:
        return max(r.naive_bytes for r in self.phases)

    @property
    def floor_bytes(self) -> int:
        """The least any plan can peak at: the largest phase's own needs (no prefetch, every copy drained)."""
        size = {g.name: g.nbytes for g in self.groups if g.kind != "host"}
        return max(sum(size.get(n, 0) for n in r.needed) for r in self.phases)

    @property
    def host_bytes(self) -> int:
        """Host memory the plan needs: buffers of groups offloaded somewhere, plus host-resident groups."""
        moved = {n for r in self.phases for n in r.offload}
        return sum(g.nbytes for g in self.groups
                   if g.kind == "host" or (g.kind == "offload" and g.name in moved))

    def to_dict(self) -> dict:
        return asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    def __str__(self) -> str:
        gib = lambda b: f"{b / GiB:8.2f}"
        lines = [f"{'group':<22}{'kind':<11}{'GiB':>8}  needed in"]
        lines += [f"{g.name:<22}{g.kind:<11}{gib(g.nbytes)}  {', '.join(g.needed_in)}" for g in self.groups]
        budget = "none" if self.budget_bytes is None else f"{self.budget_bytes / GiB:.2f} GiB"
        lines += ["", f"budget {budget}; host buffers {self.host_bytes / GiB:.2f} GiB",
                  f"{'phase':<11}{'peak':>8}{'naive':>8}{'exposed':>8}  resident | offload | load | prefetch"]
        for r in self.phases:
            flag = "" if r.fits else "  OVER BUDGET"
            drain = " (drained)" if r.drain else ""
            lines.append(f"{r.phase:<11}{gib(r.peak_bytes)}{gib(r.naive_bytes)}{gib(r.exposed_bytes)}  "
                         f"{' '.join(r.resident) or '-'} | {' '.join(r.offload) or '-'}{drain} | "
                         f"{' '.join(r.load) or '-'} | {' '.join(r.prefetch) or '-'}{flag}")
        lines.append(f"{'max':<11}{gib(self.peak_bytes)}{gib(self.naive_peak_bytes)}")
        return "\n".join(lines)


def _validate(groups: list[TensorGroup], phases: list[str]) -> None:
    if not phases or len(set(phases)) != len(phases):
        raise ValueError(f"phases must be a non-empty list of distinct names, got {phases}")
    names = [g.name for g in groups]
    dup = sorted({n for n in names if names.count(n) > 1})
    if dup:
        raise ValueError(f"duplicate group names: {dup}")
    for g in groups:
        unknown = sorted(g.needed_in - set(phases))
        if unknown:
            raise ValueError(f"group {g.name!r} is needed in unknown phase(s) {unknown}; phases: {phases}")


# ---- copy engines ---------------------------------------------------------------------------------------------
@dataclass(eq=False)
class StorageMove:
    """One device storage and its host buffer (uint8, the storage's bytes)."""

    tensor: Tensor  # any tensor on the storage; kept alive so its storage can be resized in place
    host: Tensor
    nbytes: int

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
    """Real copies and frees on one worker thread, in submission order like a copy stream. `copy_fn(dst, src)` is
    injectable: tests slow it down or gate it to show that nothing is used before its prefetch completes."""

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
    """Copies on a side stream with pinned host buffers; consumers wait on an event, the host never blocks."""

    moves_data = True
    pin_memory = True

    def __init__(self, device: torch.device):
        self.device = torch.device(device)
        self.stream = torch.cuda.Stream(device=self.device)

    def offload(self, moves):
        self.stream.wait_stream(torch.cuda.current_stream(self.device))  # the producer's writes land first
        with torch.cuda.stream(self.stream):
            for m in moves:
                view = m.device_bytes()
                m.host.copy_(view, non_blocking=True)
                view.record_stream(self.stream)  # the allocator must not hand the block out before the copy read it
                m.free()
            return CudaTicket(self.stream.record_event(), self.device)

    def prefetch(self, moves):
        for m in moves:  # allocated on the compute stream, which owns the blocks from then on
            m.allocate()
        self.stream.wait_stream(torch.cuda.current_stream(self.device))  # reused blocks may still be read there
        with torch.cuda.stream(self.stream):
            for m in moves:
                m.device_bytes().copy_(m.host, non_blocking=True)
            return CudaTicket(self.stream.record_event(), self.device)


def default_copy_engine(device: torch.device) -> CopyEngine:
    return CudaStreamCopyEngine(device) if torch.device(device).type == "cuda" else NoCopyEngine()


# ---- the manager ----------------------------------------------------------------------------------------------
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


class MemoryManager:
    """Executes a `MemoryPlan`: `enter(phase)` at the start of each phase, `close()` after the last one.

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
            if g.kind == "release" and (g.release is None or g.reserve is None):
                raise ValueError(f"group {g.name!r}: a release group needs release() and reserve()")
        self.engine = engine if engine is not None else default_copy_engine(self.device)
        self.on_device = {g.name: g.kind != "host" for g in groups}  # on device, or on its way there
        self.records: list[PhaseRecord] = []
        self._buffers: dict[int, StorageMove] = {}  # id(tensor) -> its host buffer, allocated once
        self._moved: dict[str, list[StorageMove]] = {}
        self._prefetching: dict[str, Ticket] = {}
        self._offloading: dict[str, Ticket] = {}
        self._current: PhaseRecord | None = None
        self._check_disjoint()

    # ---- per phase ----
    def enter(self, phase: str) -> PhaseRecord:
        row = self.plan.phase(phase)
        self.close()
        start = time.perf_counter()
        resident, needed = set(row.resident), set(row.needed)
        record = PhaseRecord(phase, row.peak_bytes, 0)
        for name, g in self.groups.items():  # free first, so what comes in next has room
            if g.kind == "release" and self.on_device[name] and name not in needed:
                g.release()
                self.on_device[name] = False
                record.offloaded.append(name)
        outgoing = [n for n, g in self.groups.items()
                    if g.kind == "offload" and self.on_device[n] and n not in resident]
        for name in outgoing:
            self._offload(name)
        record.offloaded += outgoing
        if row.drain:
            for name in outgoing:
                self._offloading[name].synchronize()
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
        for name in row.prefetch:
            if not self.on_device[name]:
                self._prefetch(name)
                record.prefetched.append(name)
        record.wait_s = time.perf_counter() - start
        size = {g.name: g.nbytes for g in self.plan.groups}.__getitem__
        record.tracked_bytes = (
            sum(size(n) for n, g in self.groups.items() if g.kind in ("offload", "release") and self.on_device[n])
            + sum(size(n) for n in row.needed if self.groups[n].kind == "transient")
            + (0 if row.drain else sum(size(n) for n in outgoing)))
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        self._current = record
        self.records.append(record)
        return record

    def close(self) -> None:
        """End the current phase's measurement (called by `enter`; call it after the step's last phase)."""
        if self._current is not None and self.device.type == "cuda":
            self._current.measured_peak_bytes = torch.cuda.max_memory_allocated(self.device)
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
        moves, seen = [], set()
        for t in plain_tensors(self.groups[name].tensors()):
            if t.device != self.device:
                continue  # already on the host (e.g. a CPU step counter)
            storage = t.untyped_storage()
            if storage.nbytes() == 0 or storage.data_ptr() in seen:
                continue
            seen.add(storage.data_ptr())
            move = self._buffers.get(id(t))
            if move is None or move.nbytes != storage.nbytes():
                host = torch.empty(storage.nbytes(), dtype=torch.uint8, pin_memory=self.engine.pin_memory)
                move = self._buffers[id(t)] = StorageMove(t, host, storage.nbytes())
            moves.append(move)
        return moves

    def _offload(self, name: str) -> None:
        pending = self._prefetching.pop(name, None)
        if pending is not None:  # prefetched for a phase that was skipped: storages must exist before we list them
            pending.synchronize()
        self._moved[name] = self._storages(name) if self.engine.moves_data else []
        self._offloading[name] = self.engine.offload(self._moved[name])
        self.on_device[name] = False

    def _prefetch(self, name: str) -> None:
        self._offloading.pop(name, None)
        self._prefetching[name] = self.engine.prefetch(self._moved.pop(name, []))
        self.on_device[name] = True

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
        mib = lambda b: "-" if b is None else f"{b / GiB:.2f}"
        lines = [f"{'phase':<11}{'plan GiB':>10}{'tracked':>10}{'measured':>10}{'reserved':>10}{'wait ms':>10}"]
        for r in self.records:
            lines.append(f"{r.phase:<11}{mib(r.planned_peak_bytes):>10}{mib(r.tracked_bytes):>10}"
                         f"{mib(r.measured_peak_bytes):>10}{mib(r.measured_reserved_bytes):>10}{r.wait_s * 1e3:>10.1f}")
        return "\n".join(lines)

    def save(self, path: str | Path) -> Path:
        """The plan and the measured records side by side, as JSON."""
        self.close()
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({"plan": self.plan.to_dict(), "measured": [asdict(r) for r in self.records]},
                                   indent=2))
        return path
