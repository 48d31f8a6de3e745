"""The step-level phase planner: an RL step's schedule as plain data.

A schedule lists the step's phases in execution order, each with the phases it depends on, where it runs
(`placement`), and the memory it holds while it runs. The executor (`executor.py`) only follows it, so the same
phase code runs in every mode and a schedule can be printed, tested and drawn before anything runs.

Placements:
  main          on the main stream, after its dependencies
  fused:<P>     no work of its own: computed inside phase P (the actor prefix inside the rollout prefill, which is the
                same forward on the same weights θk, run once with autograd kept)
  window        inside the rollout decode window: on a second host thread whose CUDA work runs on a side stream
                (runtime/window.py: ordered by events, submitted as its inputs exist), in program order on CPU
Modes: "serial" (full prompt+response forwards), "decomposed" (prefix once per prompt, after rollout) and
"overlapped" (decomposed + fusion + window placement where the planner predicts it pays).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field


@dataclass(frozen=True)
class StepShape:
    """What the planner needs to know about a step's batch and models."""

    prompt_lengths: tuple[int, ...]
    group_size: int
    max_new_tokens: int
    has_reference: bool = True
    vision_trainable: bool = True
    ppo_epochs: int = 1
    kv_bytes_per_token: int = 0             # K+V over all layers, one token, one model
    activation_bytes_per_token: int = 0     # what a prefix forward with autograd holds per token
    device: str = "cpu"

    @property
    def prefix_tokens(self) -> int:
        return sum(self.prompt_lengths)


@dataclass(frozen=True)
class PlanOptions:
    mode: str = "decomposed"                      # serial | decomposed | overlapped
    fuse_actor_prefix: bool = True                # overlapped: actor prefix inside the rollout prefill
    # overlapped: reference prefix K/V inside the decode window (a second host thread, runtime/window.py). Off by
    # default: on the H200 it hid the reference's host-bound launches (trainable tower: 1.08x -> 1.12x over
    # decomposed) but not GPU-bound work beside the decode graph (frozen tower: no gain); docs/benchmarks.md.
    ref_prefix_in_window: bool = False
    # overlapped: the reference log-probs of each sample scored in the decode window as soon as it has finished, on
    # its prompt's held prefix (what the window did not score, the reference phase does); equal up to rounding.
    ref_suffix_in_window: bool = False
    window_sample_batch: int = 0  # the window scores a prompt's finished samples this many at a time; 0: half a group
    # decomposed/overlapped: the reference prefix as compiled graphs per prompt-length bucket, captured on CUDA
    # (runtime/prefix_graphs.py): an eager prefix is host-bound (3B, 987 tokens: ~0.17 s of host time on the H200).
    ref_prefix_graphs: bool = False
    held_activation_budget_bytes: int = 2**62     # fusion holds prefix activations across the rollout

    def sample_batch(self, group_size: int) -> int:
        """Finished samples of a prompt per reference window job."""
        return self.window_sample_batch or max(1, group_size // 2)


@dataclass(frozen=True)
class Phase:
    name: str
    placement: str = "main"
    depends_on: tuple[str, ...] = ()
    holds_bytes: int = 0
    tokens: int = 0       # decoder token-forwards the phase runs (per model)
    note: str = ""


@dataclass
class Schedule:
    mode: str
    phases: list[Phase] = field(default_factory=list)
    reasons: list[str] = field(default_factory=list)  # why the planner placed things where it did

    def phase(self, name: str) -> Phase:
        for p in self.phases:
            if p.name == name:
                return p
        raise KeyError(f"no phase {name!r} in the {self.mode} schedule; phases: {[p.name for p in self.phases]}")

    def has(self, name: str) -> bool:
        return any(p.name == name for p in self.phases)

    def validate(self) -> None:
        """Every dependency exists and comes earlier; fused phases name an existing host phase."""
        seen: set[str] = set()
        for p in self.phases:
            for d in p.depends_on:
                if d not in seen:
                    raise ValueError(f"phase {p.name!r} depends on {d!r}, which does not run before it")
            if p.placement.startswith("fused:") and p.placement.split(":", 1)[1] not in seen:
                raise ValueError(f"phase {p.name!r} is fused into a phase that does not run before it")
            seen.add(p.name)

    def __str__(self) -> str:
        lines = [f"{self.mode} step schedule", f"{'phase':<16}{'placement':<24}{'after':<34}{'tokens':>9}{'holds MiB':>11}"]
        for p in self.phases:
            lines.append(f"{p.name:<16}{p.placement:<24}{','.join(p.depends_on) or '-':<34}{p.tokens:>9}"
                         f"{p.holds_bytes / 2**20:>11.1f}")
        lines += [f"  - {r}" for r in self.reasons]
        return "\n".join(lines)

    def to_json(self) -> str:
        return json.dumps({"mode": self.mode, "phases": [asdict(p) for p in self.phases], "reasons": self.reasons},
                          indent=2)


def plan_step(shape: StepShape, options: PlanOptions) -> Schedule:
    g, P = shape.group_size, shape.prefix_tokens
    R = len(shape.prompt_lengths) * g * shape.max_new_tokens  # upper bound on response tokens
    kv_pool = shape.kv_bytes_per_token * (P + R)
    if options.mode == "serial":
        serial_tokens = g * P + R
        s = Schedule("serial", [
            Phase("rollout", holds_bytes=kv_pool, tokens=P + R),
            Phase("ref", depends_on=("rollout",), tokens=serial_tokens) if shape.has_reference else None,
            Phase("train", depends_on=("rollout",) + (("ref",) if shape.has_reference else ()), tokens=serial_tokens),
        ])
        s.phases = [p for p in s.phases if p is not None]
        s.reasons.append("serial: every sample is a full prompt+response forward in ref and train")
        s.validate()
        return s
    if options.mode not in ("decomposed", "overlapped"):
        raise ValueError(f"runtime.mode must be serial, decomposed or overlapped, got {options.mode!r}")
    s = Schedule(options.mode)
    overlapped = options.mode == "overlapped"
    held = shape.activation_bytes_per_token * P
    fuse = overlapped and options.fuse_actor_prefix
    if fuse and held > options.held_activation_budget_bytes:
        fuse = False
        s.reasons.append(f"actor prefix not fused: holding its activations across rollout needs {held / 2**30:.2f} GiB, "
                         f"over the {options.held_activation_budget_bytes / 2**30:.2f} GiB budget")
    suffix_window = overlapped and options.ref_suffix_in_window and shape.has_reference
    # the window scores samples on their prompt's reference prefix, so it computes that prefix too
    window = suffix_window or (overlapped and options.ref_prefix_in_window and shape.has_reference)
    if not shape.vision_trainable:
        s.phases.append(Phase("vision", note="frozen tower: one encoding per prompt serves every phase"))
    first = ("vision",) if not shape.vision_trainable else ()
    s.phases.append(Phase("rollout", depends_on=first, holds_bytes=kv_pool + (held if fuse else 0), tokens=P + R,
                          note="prefill with autograd kept" if fuse else ""))
    if fuse:
        s.phases.append(Phase("actor_prefix", placement="fused:rollout", depends_on=("rollout",), holds_bytes=held,
                              tokens=0, note="epoch 0 reuses the rollout prefill's graph"))
        s.reasons.append("actor prefix fused into the rollout prefill: same forward on the same weights θk, so "
                         "training runs no separate prefix forward in epoch 0")
    if shape.has_reference:
        ref_kv = shape.kv_bytes_per_token * P
        if window:
            s.phases.append(Phase("ref_prefix", placement="window:rollout", depends_on=first, holds_bytes=ref_kv,
                                  tokens=P))
            s.reasons.append("reference prefix K/V computed in the rollout decode window (second host thread, side "
                             "stream): its host-bound launches run beside the decode loop's")
        else:
            s.phases.append(Phase("ref_prefix", depends_on=("rollout",), holds_bytes=ref_kv, tokens=P))
            if overlapped:
                s.reasons.append("reference prefix after rollout: the decode window hides only host-bound work "
                                 "(measured on the H200); set ref_prefix_in_window to place it there")
        if options.ref_prefix_graphs:
            s.reasons.append("reference prefix as compiled graphs per prompt-length bucket (replayed CUDA graphs on a "
                             "GPU): microseconds of host time per prompt instead of one launch per kernel")
        if suffix_window:
            batch = options.sample_batch(g)
            s.phases.append(Phase("ref_suffix", placement="window:rollout", depends_on=("rollout", "ref_prefix"),
                                  tokens=R, note=f"per {batch} finished samples of a prompt, and its last ones"))
            s.reasons.append("reference suffixes of finished samples scored in the decode window: the slowest "
                             "samples decode on while the others are scored")
        else:
            s.phases.append(Phase("ref_suffix", depends_on=("rollout", "ref_prefix"), tokens=R))
    train_deps = ("rollout",) + (("ref_suffix",) if shape.has_reference else ()) + (("actor_prefix",) if fuse else ())
    prefix_tokens = (shape.ppo_epochs - 1) * P if fuse else shape.ppo_epochs * P
    s.phases.append(Phase("train", depends_on=train_deps, tokens=prefix_tokens + shape.ppo_epochs * R,
                          note=f"{shape.ppo_epochs} epoch(s); the prefix is recomputed after each optimizer step"))
    s.validate()
    return s
