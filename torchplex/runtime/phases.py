"""The step's phase vocabulary, defined once: the step's plan, the step itself, the memory plan, the
timeline's colours and the metrics' phase timers all spell phases with these names.

Two levels:
  phases   what the plan places (`plan.Phase`): vision, rollout, actor_prefix, ref_prefix, ref_suffix,
           ref (serial: full forwards), train. Each has a placement: on the main stream, fused into another
           phase, or in the rollout's decode window.
  stages   the main-stream sections the step runs in order and times (`Stage`): vision, rollout, ref, train.
           A phase runs inside one stage (`stage_of`): a main ref_prefix inside `ref`, a windowed one inside
           `rollout`. Memory residency (runtime/memory_plan.py) and the phase timers (time/<stage>_s) are per
           stage, since that is what a phase boundary on the main stream is.
"""

from __future__ import annotations

from enum import StrEnum


class PhaseName(StrEnum):
    VISION = "vision"              # frozen tower: one encoding per prompt for every phase
    ROLLOUT = "rollout"            # prefill + decode
    ACTOR_PREFIX = "actor_prefix"  # the actor's prompt prefix with autograd (decomposed training)
    REF_PREFIX = "ref_prefix"      # the reference's prompt prefix K/V
    REF_SUFFIX = "ref_suffix"      # the reference's log-probs of the responses on that prefix
    REF = "ref"                    # serial: the reference's full prompt+response forwards
    TRAIN = "train"                # old-policy scoring, losses, backward, optimizer step


class Stage(StrEnum):
    """Main-stream sections, in execution order."""

    VISION = "vision"
    ROLLOUT = "rollout"
    REF = "ref"
    TRAIN = "train"


# Where a phase placed on the main stream runs.
_MAIN_STAGE = {
    PhaseName.VISION: Stage.VISION,
    PhaseName.ROLLOUT: Stage.ROLLOUT,
    PhaseName.ACTOR_PREFIX: Stage.TRAIN,
    PhaseName.REF_PREFIX: Stage.REF,
    PhaseName.REF_SUFFIX: Stage.REF,
    PhaseName.REF: Stage.REF,
    PhaseName.TRAIN: Stage.TRAIN,
}

MAIN = "main"
FUSED = "fused"
WINDOW = "window"


def fused_into(host: PhaseName) -> str:
    """Placement of a phase with no work of its own: computed inside `host`."""
    return f"{FUSED}:{host}"


def window_of(host: PhaseName) -> str:
    """Placement of a phase run in `host`'s decode window (second host thread, side stream)."""
    return f"{WINDOW}:{host}"


def stage_of(name: str, placement: str) -> Stage:
    """The main-stream stage a phase runs in: its own for `main`, its host's when fused or windowed."""
    kind, _, host = placement.partition(":")
    if kind == MAIN:
        return _MAIN_STAGE[PhaseName(name)]
    if kind in (FUSED, WINDOW):
        return _MAIN_STAGE[PhaseName(host)]
    raise ValueError(f"unknown placement {placement!r} of phase {name!r}")


# One colour per phase in every timeline picture, so side-by-side timelines compare.
PHASE_COLOURS = {
    PhaseName.VISION: "tab:gray", PhaseName.ROLLOUT: "tab:red", PhaseName.REF: "tab:blue",
    PhaseName.REF_PREFIX: "tab:orange", PhaseName.REF_SUFFIX: "tab:green", PhaseName.TRAIN: "tab:purple",
    PhaseName.ACTOR_PREFIX: "tab:brown",
}
