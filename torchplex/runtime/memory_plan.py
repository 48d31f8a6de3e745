"""What the phase-aware memory manager moves, and when: tensor groups and the plan built from them.

A `TensorGroup` is a set of tensors with one lifetime, registered with the phases that need it; the helpers below
build the groups a GRPO step has (a module's parameters, an optimizer's state, gradients, the rollout KV pool).
`MemoryPlan.build` turns the groups and the step's phases into plain data: per phase, what is resident, what is
copied out or freed on entry, what is loaded late, what is prefetched for the next phase, whether the copies out
are drained first, and the expected peak, exposed and copied bytes. The plan prints as a table and saves as JSON,
so it can be read and tested without a device; `MemoryManager` (runtime/memory.py) executes it.
"""

from __future__ import annotations

import itertools
import json
from dataclasses import asdict, dataclass
from typing import Callable, Iterable, Iterator

import torch
from torch import Tensor
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

GiB = 2**30
KINDS = ("offload", "release", "transient", "host")


# ---- groups -------------------------------------------------------------------------------------------------------
def storage_tensors(tensors: Iterable[Tensor]) -> Iterator[Tensor]:
    """The dense tensors that own memory: DTensor shards and torchao's 8-bit optimizer states are unpacked."""
    for t in tensors:
        if is_traceable_wrapper_subclass(t):
            names, _ = t.__tensor_flatten__()
            yield from storage_tensors(getattr(t, n) for n in names)
        else:
            yield t


def tensor_bytes(tensors: Iterable[Tensor]) -> int:
    """Bytes of the distinct storages behind `tensors` (meta tensors: their own numel x element size)."""
    seen, total = set(), 0
    for t in storage_tensors(tensors):
        ptr = 0 if t.device.type == "meta" else t.untyped_storage().data_ptr()
        if ptr and ptr in seen:
            continue
        seen.add(ptr)
        total += t.untyped_storage().nbytes() if ptr else t.numel() * t.element_size()
    return total


@dataclass
class TensorGroup:
    """Tensors with one lifetime: `needed_in` names the phases that produce or consume them.

    Kinds (what the manager does when no phase at hand needs the group):
        offload    copied to a host buffer and the device storage freed in place; copied back before a phase
                   that needs it (model weights, optimizer state)
        release    `release()` frees it and `reserve()` allocates it again: its data need not survive (KV pool)
        transient  allocated and freed by the phase's own code (gradients, activations): counted, never moved
        host       in host memory throughout (a CPU-offloaded optimizer's state): listed, never on the device

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


def kv_pool_group(pool, needed_in: Iterable[str] = ("rollout",), name: str = "kv_pool",
                  nbytes: int | None = None) -> TensorGroup:
    """A `GroupKVPool` (release()/reserve()), or a rollout engine (rollout/protocol.py: release()/resume()) whose
    pool is planned at `nbytes`: its contents die with each rollout, so it is freed rather than copied."""
    if nbytes is None:
        nbytes = pool.num_groups * pool.bytes_per_group
    reserve = pool.reserve if hasattr(pool, "reserve") else pool.resume
    return TensorGroup(name, frozenset(needed_in), "release", nbytes=nbytes, release=pool.release, reserve=reserve)


# ---- the plan -----------------------------------------------------------------------------------------------------
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
    resident: list[str]     # on device during the phase: needed (not host) + prefetched for the next phase
    offload: list[str]      # on entry: copied out (offload kind) or freed (release kind)
    load: list[str]         # on entry, blocking: not prefetched earlier (offload kind) or reserved (release kind)
    prefetch: list[str]     # started on entry for the next phase, waited on when it enters
    drain: bool             # wait for this entry's copies out before allocating anything (budget too tight)
    peak_bytes: int         # resident + copies out still in flight unless drained
    naive_bytes: int        # what the phase would hold if nothing ever left the device
    exposed_bytes: int      # copied without overlapping compute: late loads + drained copies
    fits: bool              # peak_bytes <= the plan's budget (True without a budget)
    copy_in_bytes: int = 0   # copied host -> device during this phase, steady state (late loads and prefetches)
    copy_out_bytes: int = 0  # copied device -> host (started) during this phase, steady state


class _Sizes:
    """Byte sums over group names."""

    def __init__(self, groups: list[PlannedGroup]):
        self.by_name = {g.name: g for g in groups}

    def kind(self, name: str) -> str:
        return self.by_name[name].kind

    def device(self, names: Iterable[str]) -> int:
        """Bytes the groups take on the device (host groups never do)."""
        return sum(self.by_name[n].nbytes for n in names if self.kind(n) != "host")


@dataclass
class MemoryPlan:
    phases: list[PhasePlan]
    groups: list[PlannedGroup]
    budget_bytes: int | None = None

    @classmethod
    def build(cls, groups: list[TensorGroup], phases: list[str], budget_bytes: int | None = None) -> "MemoryPlan":
        """Per phase (cyclic: the last phase's next is the first), choose which of the next phase's groups to hold
        (prefetched during this phase) and whether to drain this entry's copies out: the choice that fits the
        budget with the fewest exposed bytes, then the lowest peak (when nothing fits: the lowest peak).

        Until a copy out finishes, its memory is still taken (the caching allocator reuses a block only once the
        copy stream has read it), so a phase's peak counts the copies it started on entry unless it drains them:
        waits, host-side, before allocating anything. Draining exposes those copies, so it is chosen only when the
        budget requires it; likewise a group not prefetched is loaded on entry, blocking.
        """
        _validate(groups, phases)
        info = [PlannedGroup(g.name, g.kind, g.planned_bytes(), [p for p in phases if p in g.needed_in])
                for g in groups]
        sizes = _Sizes(info)
        needed = {p: [g.name for g in info if p in g.needed_in] for p in phases}
        choices = [_choose(sizes, needed, phases, i, budget_bytes) for i in range(len(phases))]
        naive_held = sizes.device(g.name for g in info if g.kind == "offload")
        rows = [_phase_row(sizes, needed, phases, i, choices, budget_bytes, naive_held) for i in range(len(phases))]
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
    def copy_in_bytes(self) -> int:
        """Bytes copied host -> device per step in steady state."""
        return sum(r.copy_in_bytes for r in self.phases)

    @property
    def copy_out_bytes(self) -> int:
        """Bytes copied device -> host per step in steady state."""
        return sum(r.copy_out_bytes for r in self.phases)

    @property
    def floor_bytes(self) -> int:
        """The least any plan can peak at: the largest phase's own needs (no prefetch, every copy drained)."""
        sizes = _Sizes(self.groups)
        return max(sizes.device(r.needed) for r in self.phases)

    @property
    def host_bytes(self) -> int:
        """Host memory the plan needs: buffers of groups offloaded somewhere, plus host-resident groups."""
        moved = {n for r in self.phases for n in r.offload}
        return sum(g.nbytes for g in self.groups if g.kind == "host" or (g.kind == "offload" and g.name in moved))

    def to_dict(self) -> dict:
        return asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    def __str__(self) -> str:
        gib = lambda b: f"{b / GiB:8.2f}"
        lines = [f"{'group':<22}{'kind':<11}{'GiB':>8}  needed in"]
        lines += [f"{g.name:<22}{g.kind:<11}{gib(g.nbytes)}  {', '.join(g.needed_in)}" for g in self.groups]
        budget = "none" if self.budget_bytes is None else f"{self.budget_bytes / GiB:.2f} GiB"
        lines += ["", f"budget {budget}; host buffers {self.host_bytes / GiB:.2f} GiB; copied per step: in "
                      f"{self.copy_in_bytes / GiB:.2f} GiB, out {self.copy_out_bytes / GiB:.2f} GiB",
                  f"{'phase':<11}{'peak':>8}{'naive':>8}{'exposed':>8}  resident | offload | load | prefetch"]
        for r in self.phases:
            flag = "" if r.fits else "  OVER BUDGET"
            drain = " (drained)" if r.drain else ""
            lines.append(f"{r.phase:<11}{gib(r.peak_bytes)}{gib(r.naive_bytes)}{gib(r.exposed_bytes)}  "
                         f"{' '.join(r.resident) or '-'} | {' '.join(r.offload) or '-'}{drain} | "
                         f"{' '.join(r.load) or '-'} | {' '.join(r.prefetch) or '-'}{flag}")
        lines.append(f"{'max':<11}{gib(self.peak_bytes)}{gib(self.naive_peak_bytes)}")
        return "\n".join(lines)


def _choose(sizes: _Sizes, needed: dict[str, list[str]], phases: list[str], i: int,
            budget_bytes: int | None) -> tuple[list[str], bool]:
    """Phase i's (groups of the next phase to prefetch, drain): every subset of the candidates is tried, each with
    and without draining. Over budget, the lowest peak wins; within it, the fewest exposed bytes, then the lowest
    peak, then not draining."""
    p, prev, nxt = phases[i], phases[i - 1], phases[(i + 1) % len(phases)]
    candidates = [n for n in needed[nxt] if sizes.kind(n) == "offload" and n not in needed[p]]
    best = None
    for r in range(len(candidates) + 1):
        for pick in itertools.combinations(candidates, r):
            resident = needed[p] + list(pick)
            out_bytes = sizes.device(n for n in needed[prev] if sizes.kind(n) == "offload" and n not in resident)
            skipped = sizes.device(c for c in candidates if c not in pick)
            for drain in (False, True):
                peak = sizes.device(resident) + (0 if drain else out_bytes)
                over = budget_bytes is not None and peak > budget_bytes
                exposed = skipped + (out_bytes if drain else 0)
                key = (over, peak, exposed, drain) if over else (over, exposed, peak, drain)
                if best is None or key < best[0]:
                    best = (key, list(pick), drain)
    return best[1], best[2]


def _phase_row(sizes: _Sizes, needed: dict[str, list[str]], phases: list[str], i: int,
               choices: list[tuple[list[str], bool]], budget_bytes: int | None, naive_held: int) -> PhasePlan:
    """Phase i's row, given every phase's choice: what leaves on entry is what the previous phase held (its needs
    and its prefetches) and this one does not."""
    p, prev = phases[i], phases[i - 1]
    (pick, drain), (prev_pick, _) = choices[i], choices[i - 1]
    kind = sizes.kind
    resident = [n for n in needed[p] if kind(n) != "host"] + pick
    held_before = needed[prev] + prev_pick
    outgoing = [n for n in held_before if kind(n) == "offload" and n not in resident]
    freed = [n for n in needed[prev] if kind(n) == "release" and n not in needed[p]]
    late = [n for n in needed[p] if kind(n) == "offload" and n not in held_before]
    reserved = [n for n in needed[p] if kind(n) == "release" and n not in needed[prev]]
    prefetch = [n for n in pick if n not in needed[prev]]
    out_bytes = sizes.device(outgoing)
    drain = drain and out_bytes > 0
    peak = sizes.device(resident) + (0 if drain else out_bytes)
    return PhasePlan(
        phase=p, needed=needed[p], resident=resident, offload=outgoing + freed, load=late + reserved,
        prefetch=prefetch, drain=drain, peak_bytes=peak,
        naive_bytes=naive_held + sizes.device(n for n in needed[p] if kind(n) != "offload"),
        exposed_bytes=sizes.device(late) + (out_bytes if drain else 0),
        fits=budget_bytes is None or peak <= budget_bytes,
        copy_in_bytes=sizes.device(late) + sizes.device(prefetch), copy_out_bytes=out_bytes)


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
