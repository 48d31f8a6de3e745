"""The phase-aware memory plan (`MemoryPlan.build`): per phase, which tensor groups are resident, copied out,
loaded late or prefetched for the next phase, how many chunks of a streamed group are prefetched or kept resident,
and the expected peak, exposed and copied bytes. Plain data: printed as a table, saved as JSON, executed by
`MemoryManager` (runtime/memory.py, where the model is described)."""

from __future__ import annotations

import itertools
import json
from dataclasses import asdict, dataclass, field, replace

from .memory_groups import TensorGroup, window_bytes

GiB = 2**30


@dataclass
class PlannedGroup:
    name: str
    kind: str
    nbytes: int
    needed_in: list[str]
    chunk_nbytes: list[int] | None = None  # streamed group: planned bytes of each chunk
    frozen: bool = False
    resident_chunks: int = 0  # streamed group: its first chunks stay on the device through the whole cycle

    @property
    def resident_bytes(self) -> int:
        return sum(self.chunk_nbytes[:self.resident_chunks]) if self.chunk_nbytes is not None else 0


@dataclass
class PhasePlan:
    phase: str
    needed: list[str]       # groups the phase uses
    resident: list[str]     # on device during the phase: needed (not host, not streamed) + held or prefetched
    offload: list[str]      # on entry: copied out (offload kind) or freed (release kind)
    load: list[str]         # on entry, blocking: not prefetched earlier (offload kind) or reserved (release kind)
    prefetch: list[str]     # started on entry for the next phase, waited on when it enters
    drain: bool             # wait for this entry's copies out before allocating anything (budget too tight)
    peak_bytes: int         # resident + resident chunks + streamed window + copies still in flight unless drained
    naive_bytes: int        # what the phase would hold if nothing ever left the device
    exposed_bytes: int      # copied without overlapping compute: late loads + drained copies + streamed-in chunks
    fits: bool              # peak_bytes <= the plan's budget (True without a budget)
    streamed: list[str] = field(default_factory=list)  # groups this phase walks chunk by chunk (stream())
    stream_window_bytes: int = 0  # most bytes of streamed (not resident) chunks on the device at once in this phase
    # next phase's streamed groups: how many chunks after the resident ones to prefetch (chunks R .. R+k-1)
    prefetch_chunks: dict[str, int] = field(default_factory=dict)
    copy_in_bytes: int = 0   # copied host -> device during this phase, steady state (late loads, prefetches, stream)
    copy_out_bytes: int = 0  # copied device -> host (started) during this phase, steady state


@dataclass
class MemoryPlan:
    phases: list[PhasePlan]
    groups: list[PlannedGroup]
    budget_bytes: int | None = None
    stream_window: int = 3  # chunks of a stream on the device in steady state: in use, coming in, going out

    @classmethod
    def build(cls, groups: list[TensorGroup], phases: list[str], budget_bytes: int | None = None,
              stream_window: int = 3, max_resident_chunks: int | None = 0) -> "MemoryPlan":
        """Per phase (cyclic: the last phase's next is the first), choose which of the next phase's groups to hold
        (for a streamed group: how many of its leading chunks) and whether to drain: the choice that fits the
        budget with the fewest exposed bytes, then the lowest peak (when nothing fits: the lowest peak).

        Resident chunks (`max_resident_chunks`: at most this many; 0, the default, keeps none; None: no cap). A
        streamed phase may keep the first R chunks of its streamed groups on the device through the whole cycle:
        never copied out or in, counted in every phase's peak; the previous phase's prefetch (k chunks), the
        stream's window, its exposed bytes and its tail then concern chunks R.. only.

        R and k draw on the same room in the phase before the streamed one (train, usually the tightest): the
        streamed phase starts with R + k chunks on the device whichever way they got there, so turning a
        prefetched chunk into a resident one leaves the exposed bytes as they are and saves its two copies per step
        (and the bandwidth they take from the phases they overlap), while holding it in every other phase too. So
        R is chosen over whole plans, each built as above with its R (which picks k): fewest exposed bytes first,
        then the fewest bytes copied per step, then the lowest peak. Copies rank before the peak because under the
        budget a lower peak buys nothing while every copy takes bandwidth. In effect R is the largest that fits
        every phase without exposing more (a phase with no room for it would have to drain or drop a prefetch), and
        k takes what room the phase before has left. Several streamed phases get their R in turn, the others fixed.
        """
        _validate(groups, phases)
        if stream_window < 2:
            raise ValueError(f"stream_window must be >= 2 (the chunk in use and the next), got {stream_window}")
        if max_resident_chunks is not None and max_resident_chunks < 0:
            raise ValueError(f"max_resident_chunks must be >= 0 or None (no cap), got {max_resident_chunks}")
        info = [PlannedGroup(g.name, g.kind, g.planned_bytes(), [p for p in phases if p in g.needed_in],
                             g.planned_chunk_bytes(), g.frozen) for g in groups]
        chunk_count = {g.needed_in[0]: len(g.chunk_nbytes) for g in info if g.chunk_nbytes is not None}
        resident = {p: 0 for p in chunk_count}
        plan = cls._build(info, phases, budget_bytes, stream_window, resident)
        for p, n in chunk_count.items():
            top = n if max_resident_chunks is None else min(n, max_resident_chunks)
            for r in range(1, top + 1):
                trial = cls._build(info, phases, budget_bytes, stream_window, {**resident, p: r})
                if trial._choice_key() < plan._choice_key():
                    plan, resident[p] = trial, r  # the next streamed phase's trials start from this R
        return plan

    def _choice_key(self) -> tuple:
        exposed, copied = sum(r.exposed_bytes for r in self.phases), self.copy_in_bytes + self.copy_out_bytes
        if all(r.fits for r in self.phases):
            return (False, exposed, copied, self.peak_bytes)
        return (True, self.peak_bytes, exposed, copied)

    @classmethod
    def _build(cls, info: list[PlannedGroup], phases: list[str], budget_bytes: int | None, stream_window: int,
               resident_chunks: dict[str, int]) -> "MemoryPlan":
        """The plan with `resident_chunks[phase]` leading chunks of that phase's streamed groups kept resident."""
        info = [replace(g, resident_chunks=resident_chunks.get(g.needed_in[0], 0)) if g.chunk_nbytes is not None
                else g for g in info]
        by_name = {g.name: g for g in info}
        kind = lambda n: by_name[n].kind
        dev = lambda names: sum(by_name[n].nbytes for n in names if kind(n) != "host")
        moving = lambda names: sum(by_name[n].nbytes for n in names if not by_name[n].frozen)  # copied out
        needed = {p: [g.name for g in info if p in g.needed_in] for p in phases}
        plain = {p: [n for n in needed[p] if by_name[n].chunk_nbytes is None] for p in phases}
        streamed = {p: [n for n in needed[p] if by_name[n].chunk_nbytes is not None] for p in phases}
        # per chunk of each phase's stream (its streamed groups in lockstep), the resident ones left out
        per_chunk = {p: [sum(c) for c in zip(*(by_name[n].chunk_nbytes for n in streamed[p]))]
                     [resident_chunks.get(p, 0):] for p in phases}
        kept = sum(g.resident_bytes for g in info)  # on the device in every phase
        window = {p: window_bytes(per_chunk[p], stream_window) for p in phases}
        all_offload = [g.name for g in info if g.kind == "offload"]

        chosen, kchunks, drains = {}, {}, {}
        for i, p in enumerate(phases):
            prev, nxt = phases[i - 1], phases[(i + 1) % len(phases)]
            candidates = [n for n in plain[nxt] if kind(n) == "offload" and n not in needed[p]]
            k_options = range(len(per_chunk[nxt]) + 1) if nxt != p else [0]
            nxt_floor = dev(plain[nxt]) + kept
            best = None
            for r in range(len(candidates) + 1):
                for pick in itertools.combinations(candidates, r):
                    resident = plain[p] + list(pick)
                    outgoing = [n for n in plain[prev] if kind(n) == "offload" and n not in resident]
                    out_bytes = moving(outgoing) + window[prev]  # the previous stream's tail: at least a window
                    for k in k_options:
                        held = sum(per_chunk[nxt][:k])
                        skipped = dev(c for c in candidates if c not in pick) + sum(per_chunk[nxt][k:])
                        # holding k chunks also holds them at the next phase's start
                        nxt_over = budget_bytes is not None and k > 0 and \
                            nxt_floor + max(window[nxt], held) > budget_bytes
                        for drain in (False, True):
                            peak = dev(resident) + kept + held + window[p] + (0 if drain else out_bytes)
                            over = (budget_bytes is not None and peak > budget_bytes) or nxt_over
                            exposed = skipped + (out_bytes if drain else 0)
                            key = (over, peak, exposed, drain) if over else (over, exposed, peak, drain)
                            if best is None or key < best[0]:
                                best = (key, list(pick), k, drain)
            chosen[p], kchunks[p], drains[p] = best[1], best[2], best[3]

        cap = {p: max(window[p], sum(per_chunk[p][:kchunks[phases[i - 1]]])) if streamed[p] else 0
               for i, p in enumerate(phases)}
        rows = []
        for i, p in enumerate(phases):
            prev, nxt = phases[i - 1], phases[(i + 1) % len(phases)]
            resident = [n for n in plain[p] if kind(n) != "host"] + chosen[p]
            held_before = plain[prev] + chosen[prev]
            outgoing = [n for n in held_before if kind(n) == "offload" and n not in resident]
            freed = [n for n in needed[prev] if kind(n) == "release" and n not in needed[p]]
            late = [n for n in plain[p] if kind(n) == "offload" and n not in held_before]
            reserved = [n for n in needed[p] if kind(n) == "release" and n not in needed[prev]]
            prefetch = [n for n in chosen[p] if n not in needed[prev]]
            out_bytes = moving(outgoing) + cap[prev]
            drain = drains[p] and out_bytes > 0
            held_next = sum(per_chunk[nxt][:kchunks[p]])
            streamed_late = sum(per_chunk[p][kchunks[prev]:]) if streamed[p] else 0
            peak = dev(resident) + kept + held_next + cap[p] + (0 if drain else out_bytes)
            rows.append(PhasePlan(
                phase=p, needed=needed[p], resident=resident, offload=outgoing + freed, load=late + reserved,
                prefetch=prefetch, drain=drain, peak_bytes=peak,
                naive_bytes=dev(all_offload) + dev(n for n in needed[p] if kind(n) != "offload"),
                exposed_bytes=dev(late) + (out_bytes if drain else 0) + streamed_late,
                fits=budget_bytes is None or peak <= budget_bytes, streamed=streamed[p], stream_window_bytes=cap[p],
                prefetch_chunks={n: kchunks[p] for n in streamed[nxt]} if kchunks[p] else {},
                copy_in_bytes=dev(late) + dev(n for n in prefetch if kind(n) == "offload") + held_next
                + streamed_late,
                copy_out_bytes=moving(outgoing) + (sum(per_chunk[p]) if streamed[p] else 0)))
        return cls(rows, info, budget_bytes, stream_window)

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
        """Bytes copied host -> device per step in steady state (a frozen group's first copy out not counted)."""
        return sum(r.copy_in_bytes for r in self.phases)

    @property
    def copy_out_bytes(self) -> int:
        """Bytes copied device -> host per step in steady state."""
        return sum(r.copy_out_bytes for r in self.phases)

    @property
    def resident_chunks(self) -> dict[str, int]:
        """Streamed groups' chunks that never leave the device."""
        return {g.name: g.resident_chunks for g in self.groups if g.chunk_nbytes is not None}

    @property
    def floor_bytes(self) -> int:
        """The least any plan can peak at: the largest phase's own needs (no prefetch, every copy drained; a
        streamed group counts one window of chunks)."""
        by_name = {g.name: g for g in self.groups}

        def need(row):
            chunks = [sum(c) for c in zip(*(by_name[n].chunk_nbytes for n in row.streamed))]
            return (sum(by_name[n].nbytes for n in row.needed if by_name[n].kind != "host" and n not in row.streamed)
                    + window_bytes(chunks, self.stream_window))

        return max(need(r) for r in self.phases)

    @property
    def host_bytes(self) -> int:
        """Host memory the plan needs: buffers of groups offloaded somewhere, plus host-resident groups."""
        moved = {n for r in self.phases for n in r.offload + r.streamed}
        return sum(g.nbytes - g.resident_bytes for g in self.groups
                   if g.kind == "host" or (g.kind == "offload" and g.name in moved))

    def to_dict(self) -> dict:
        return asdict(self)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2)

    def __str__(self) -> str:
        gib = lambda b: f"{b / GiB:8.2f}"
        lines = [f"{'group':<22}{'kind':<11}{'GiB':>8}  needed in"]
        for g in self.groups:
            kept = f", first {g.resident_chunks} resident" if g.resident_chunks else ""
            chunks = f" ({len(g.chunk_nbytes)} chunks, streamed{kept})" if g.chunk_nbytes is not None else ""
            frozen = " (frozen)" if g.frozen else ""
            lines.append(f"{g.name:<22}{g.kind:<11}{gib(g.nbytes)}  {', '.join(g.needed_in)}{chunks}{frozen}")
        budget = "none" if self.budget_bytes is None else f"{self.budget_bytes / GiB:.2f} GiB"
        lines += ["", f"budget {budget}; host buffers {self.host_bytes / GiB:.2f} GiB; copied per step: in "
                      f"{self.copy_in_bytes / GiB:.2f} GiB, out {self.copy_out_bytes / GiB:.2f} GiB",
                  f"{'phase':<11}{'peak':>8}{'naive':>8}{'exposed':>8}  resident | offload | load | prefetch"]
        kept = {n: k for n, k in self.resident_chunks.items() if k}
        for r in self.phases:
            flag = "" if r.fits else "  OVER BUDGET"
            drain = " (drained)" if r.drain else ""
            resident = (r.resident + [f"{n}[:{k}]" for n, k in kept.items()]
                        + [f"{n}(stream<={r.stream_window_bytes / GiB:.2f})" for n in r.streamed])
            prefetch = r.prefetch + [f"{n}[{kept.get(n) or ''}:{kept.get(n, 0) + k}]"
                                     for n, k in r.prefetch_chunks.items()]
            lines.append(f"{r.phase:<11}{gib(r.peak_bytes)}{gib(r.naive_bytes)}{gib(r.exposed_bytes)}  "
                         f"{' '.join(resident) or '-'} | {' '.join(r.offload) or '-'}{drain} | "
                         f"{' '.join(r.load) or '-'} | {' '.join(prefetch) or '-'}{flag}")
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
    for p in phases:  # streamed groups of one phase are walked in lockstep: chunk i of each together
        counts = {g.name: len(g.planned_chunk_bytes()) for g in groups if g.streamed and p in g.needed_in}
        if len(set(counts.values())) > 1:
            raise ValueError(f"streamed groups of phase {p!r} have different chunk counts: {counts}")
