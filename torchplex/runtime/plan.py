"""The step's plan: what each phase of one GRPO step does and where, decided before anything runs, as plain data.

A plan lists the step's phases in execution order, each with the phases it depends on, where it runs
(`placement`), and the memory it holds while it runs; how each prompt's actor prefix is held; the memory budget it
was planned from, with the training and reference micro-batches' token budgets; and why (`reasons`). The step
(runtime/step.py) runs its phases in one fixed order and reads every decision from the plan, so a plan can be
printed, tested and drawn before anything runs; what the step measured is its report, never written back into the
plan.

Phase names and placements come from `phases.py` (the one vocabulary). Placements:
  main          on the main stream, after its dependencies
  fused:<P>     no work of its own: computed inside phase P (the actor prefix inside the rollout prefill, which is the
                same forward on the same weights θk, run once with autograd kept)
  window        inside the rollout decode window: on a second host thread whose CUDA work runs on a side stream
                (runtime/window.py: ordered by events, submitted as its inputs exist), in program order on CPU
Modes: "serial" (full prompt+response forwards), "decomposed" (prefix once per prompt, after rollout) and
"overlapped" (decomposed + fusion + window placement where the planner predicts it pays, and where the rollout
engine supports it: `rollout.protocol.RolloutCapabilities`; otherwise the plan's reasons say why not).
Each phase runs inside one main-stream stage (`Phase.stage`): the stages are what the step times.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field, replace

from ..rollout.protocol import RolloutCapabilities
from .memory_budget import (COMPACT, GRAPH, NONE, MemoryBudget, PrefixChoice, choose_prefix_forms,
                            choose_train_rounds, held_at_once_bytes)
from .phases import FUSED, MAIN, WINDOW, PhaseName, Stage, fused_into, stage_of, window_of


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
    activation_bytes_per_token: float = 0   # what a prefix forward with autograd holds per token
    # what held prefix state may take from the rollout to training (memory_budget.MemoryBudget.room_bytes): the
    # budget less every resident group of the fullest stage; 0 holds nothing
    prefix_room_bytes: int = 0
    # what a prefix computed and held within the train stage may take (MemoryBudget.train_room_bytes); 0: nothing
    train_room_bytes: int = 0
    # what the compact form (prefixes.CompactPrefix: layer-boundary hidden states) holds per prompt token; 0: none
    compact_bytes_per_token: float = 0
    # the reference's prefixes may run batched ahead of its suffixes (the runner's: one GPU or plain tensors, whose
    # forwards gather nothing across ranks, and reference micro-batches of whole groups); why not, otherwise
    ref_prefix_batchable: str = ""
    device: str = "cpu"
    # training's held prefixes may come in rounds (memory_budget.choose_train_rounds): one process (data-parallel
    # ranks hold one form for every prompt in one batch: their FSDP2 collectives must match) and an actor of plain
    # tensors (prefixes.SavedBytes reads each parameter's storage, which a tensor-parallel DTensor does not expose)
    train_rounds: bool = True

    @property
    def prefix_tokens(self) -> int:
        return sum(self.prompt_lengths)


@dataclass(frozen=True)
class PlanOptions:
    mode: str = "decomposed"                      # serial | decomposed | overlapped
    fuse_actor_prefix: bool = True                # overlapped: actor prefix inside the rollout prefill
    # overlapped: reference prefix K/V inside the decode window (a second host thread, runtime/window.py). Off by
    # default: it hides the reference's host-bound launches (a trainable tower: measured faster than decomposed)
    # but not GPU-bound work beside the decode graph (a frozen tower: no gain); docs/performance.md.
    ref_prefix_in_window: bool = False
    # overlapped: the reference log-probs of each sample scored in the decode window as soon as it has finished, on
    # its prompt's held prefix (what the window did not score, the reference phase does); equal up to rounding.
    ref_suffix_in_window: bool = False
    window_sample_batch: int = 0  # the window scores a prompt's finished samples this many at a time; 0: half a group
    # decomposed: the actor prefixes of the step's prompts in batched forwards at the start of training (one per
    # group of similar lengths: data.batching.length_groups), held (compact or whole graph, as the train stage's room
    # allows) for the first epoch's micro-batches, their backward one batched pass after the last
    # (DecomposedScorer.finish_backward): fewer, larger kernels than one prefix forward and backward per
    # micro-batch, which at micro-batch 8 the host's launch rate bounds (training's MFU rose: docs/performance.md);
    # what the room leaves out in later rounds (StepShape.train_rounds), overlapped's unfused prompts likewise
    batched_actor_prefix: bool = True
    # decomposed/overlapped: the reference prefixes of every prompt in batched no-grad forwards at the start of the
    # ref stage (one per group of similar lengths), their K/V held for the reference micro-batches' suffixes (the
    # REF_PREFIX phase's bytes): a prefix forward over four prompts per micro-batch is bound by the host's launch rate
    batched_ref_prefix: bool = True
    # the step's memory budget (memory.budget_gib); 0: the device's (memory_budget.device_capacity). What held
    # prefixes may take is computed from it by the runner (StepShape.prefix_room_bytes)
    memory_budget_bytes: int = 0

    def sample_batch(self, group_size: int) -> int:
        """Finished samples of a prompt per reference window job."""
        return self.window_sample_batch or max(1, group_size // 2)


@dataclass(frozen=True)
class Phase:
    name: PhaseName
    placement: str = MAIN
    depends_on: tuple[str, ...] = ()
    holds_bytes: int = 0  # what the phase keeps alive until its consumer runs (checked: tests/test_phase_bytes.py)
    tokens: int = 0       # decoder token-forwards the phase runs (per model)
    note: str = ""

    @property
    def stage(self) -> Stage:
        """The stage the phase's work runs in."""
        return stage_of(self.name, self.placement)

    @property
    def stages(self) -> tuple[Stage, ...]:
        """Every stage the phase takes part in: a windowed phase's own stage still runs what the window did not
        finish (the reference samples it had not scored when decode ended)."""
        own = stage_of(self.name, MAIN)
        return (self.stage,) if not self.in_window or own == self.stage else (self.stage, own)

    @property
    def in_window(self) -> bool:
        return self.placement.startswith(WINDOW)


@dataclass
class StepPlan:
    mode: str
    phases: list[Phase] = field(default_factory=list)
    reasons: list[str] = field(default_factory=list)  # why the planner placed things where it did
    prefix_forms: list[PrefixChoice] = field(default_factory=list)  # how each prompt's actor prefix is held
    # decomposed with batched_actor_prefix: how each prompt's actor prefix is held within the train stage
    train_prefix_forms: list[PrefixChoice] = field(default_factory=list)
    # the memory budget it was planned from, with the micro-batches' token budgets (printed and in the JSON)
    budget: MemoryBudget | None = None
    # the ref stage first runs, batched, the reference prefixes it needs (every one; with the window, those of the
    # prompts the window left): batched_ref_prefix
    ref_prefix_batched: bool = False

    def in_window(self, name: str) -> bool:
        """Whether phase `name` runs in the rollout's decode window."""
        return self.has(name) and self.phase(name).in_window

    @property
    def fuses_actor_prefix(self) -> bool:
        """The rollout prefill holds actor prefixes for training (the fused forms in `prefix_forms`)."""
        return self.placed(PhaseName.ACTOR_PREFIX, fused_into(PhaseName.ROLLOUT))

    def held_bytes(self) -> int:
        """The most bytes the plan's held actor prefixes take at once: the fused ones (held through training) and
        training's largest round."""
        return sum(c.bytes for c in self.prefix_forms) + held_at_once_bytes(self.train_prefix_forms)

    def fused_prompts(self) -> list[int]:
        """Prompts whose actor prefix the rollout prefill keeps for training (whole graph or compact)."""
        return [c.prompt for c in self.prefix_forms if c.form != NONE]

    def phase(self, name: str) -> Phase:
        for p in self.phases:
            if p.name == name:
                return p
        raise KeyError(f"no phase {name!r} in the {self.mode} plan; phases: {[p.name for p in self.phases]}")

    def has(self, name: str) -> bool:
        return any(p.name == name for p in self.phases)

    def placed(self, name: str, placement: str) -> bool:
        """Whether phase `name` is scheduled with this placement."""
        return self.has(name) and self.phase(name).placement == placement

    def stages(self) -> list[Stage]:
        """The main-stream stages the phases run in, in execution order (what the step times)."""
        order = list(Stage)
        return sorted({st for p in self.phases for st in p.stages}, key=order.index)

    def validate(self) -> None:
        """Every dependency exists and comes earlier; fused phases name an existing host phase."""
        seen: set[str] = set()
        for p in self.phases:
            for d in p.depends_on:
                if d not in seen:
                    raise ValueError(f"phase {p.name!r} depends on {d!r}, which does not run before it")
            if p.placement.startswith(FUSED) and p.placement.split(":", 1)[1] not in seen:
                raise ValueError(f"phase {p.name!r} is fused into a phase that does not run before it")
            seen.add(p.name)

    def __str__(self) -> str:
        lines = [f"{self.mode} step plan",
                 f"{'phase':<16}{'placement':<24}{'after':<34}{'tokens':>9}{'holds MiB':>11}"]
        for p in self.phases:
            lines.append(f"{p.name:<16}{p.placement:<24}{','.join(p.depends_on) or '-':<34}{p.tokens:>9}"
                         f"{p.holds_bytes / 2**20:>11.1f}" + (f"  {p.note}" if p.note else ""))
        lines += [f"  - {r}" for r in self.reasons]
        if self.budget is not None and self.budget.micro_batch_reason:
            lines.append(f"  micro-batches: {self.budget.micro_batch_reason}")
        for label, choices in (("actor prefixes", self.prefix_forms), ("actor prefixes in training",
                                                                        self.train_prefix_forms)):
            if choices:
                forms = [c.form for c in choices]
                lines.append(f"  {label}: " + ", ".join(f"{forms.count(f)} {f}" for f in sorted(set(forms)))
                             + f", {sum(c.bytes for c in choices) / 2**20:.1f} MiB held")
        return "\n".join(lines)

    def to_json(self) -> str:
        phases = [{**asdict(p), "stage": p.stage} for p in self.phases]
        budget = self.budget or MemoryBudget(0)
        return json.dumps({"mode": self.mode, "phases": phases, "reasons": self.reasons,
                           "micro_batch_tokens": budget.micro_batch_tokens,
                           "ref_micro_batch_tokens": budget.ref_micro_batch_tokens,
                           "prefix_forms": [asdict(c) for c in self.prefix_forms],
                           "train_prefix_forms": [asdict(c) for c in self.train_prefix_forms],
                           "memory": self.budget.to_dict() if self.budget else {},
                           "ref_prefix_batched": self.ref_prefix_batched},
                          indent=2)


def batches_ref_prefix(shape: StepShape, options: PlanOptions) -> bool:
    """Whether a ref stage of its own (no decode window) runs every reference prefix batched ahead of the suffixes:
    `batched_ref_prefix`, where the runner allows it (`StepShape.ref_prefix_batchable`)."""
    return (options.mode != "serial" and shape.has_reference and options.batched_ref_prefix
            and shape.ref_prefix_batchable == "")


def holds_every_ref_prefix(shape: StepShape, options: PlanOptions) -> bool:
    """Whether the ref stage holds every prompt's reference prefix K/V at once, batched ahead of the suffixes or
    held from the decode window: the memory budget counts those bytes in the ref stage."""
    window = options.mode != "serial" and shape.has_reference and (options.ref_prefix_in_window
                                                                     or options.ref_suffix_in_window)
    return window or batches_ref_prefix(shape, options)


def plan_step(shape: StepShape, options: PlanOptions, rollout: RolloutCapabilities = RolloutCapabilities()
              ) -> StepPlan:
    """The step's plan; `rollout` is what the engine supports (fusion and window work only where it can)."""
    if options.mode == "serial":
        return _serial_plan(shape)
    if options.mode not in ("decomposed", "overlapped"):
        raise ValueError(f"runtime.mode must be serial, decomposed or overlapped, got {options.mode!r}")
    s = StepPlan(options.mode)
    held = _fusion(s, shape, options, rollout)
    fused = s.fused_prompts()
    window, suffix_window = _window(s, shape, options, rollout)
    if not shape.vision_trainable:
        s.phases.append(Phase(PhaseName.VISION, note="frozen tower: one encoding per prompt serves every phase"))
    first = ("vision",) if not shape.vision_trainable else ()
    s.phases.append(Phase(PhaseName.ROLLOUT, depends_on=first, holds_bytes=_kv_pool(shape) + (held if fused else 0),
                          tokens=shape.prefix_tokens + _response_bound(shape),
                          note="prefill with autograd kept" if fused else ""))
    if fused:
        s.phases.append(Phase(PhaseName.ACTOR_PREFIX, placement=fused_into(PhaseName.ROLLOUT), depends_on=("rollout",),
                              holds_bytes=held, tokens=0,
                              note=f"epoch 0 reuses the rollout prefill's graph ({len(fused)} prompts)"))
        s.reasons.append("actor prefix fused into the rollout prefill: same forward on the same weights θk, so "
                         "training runs no separate prefix forward in epoch 0")
    if shape.has_reference:
        _reference_phases(s, shape, options, first, window, suffix_window)
    batched = _batched_actor_prefix(s, shape, options)
    rounds_after = _rounds_after_fusion(s, shape, options)
    train_deps = ("rollout",) + (("ref_suffix",) if shape.has_reference else ()) + (
        ("actor_prefix",) if fused or batched else ())
    held_tokens = sum(shape.prompt_lengths[i] for i in fused)
    if batched or rounds_after:  # epoch 0's are the actor_prefix phase's, or (overlapped) the train stage's rounds
        held_tokens += sum(c.tokens for c in s.train_prefix_forms if c.form != NONE)
    prefix_tokens = shape.ppo_epochs * shape.prefix_tokens - held_tokens
    s.phases.append(Phase(PhaseName.TRAIN, depends_on=train_deps,
                          tokens=prefix_tokens + shape.ppo_epochs * _response_bound(shape),
                          note=f"{shape.ppo_epochs} epoch(s); the prefix is recomputed after each optimizer step"))
    s.validate()
    return s


def _response_bound(shape: StepShape) -> int:
    """An upper bound on the step's response tokens."""
    return len(shape.prompt_lengths) * shape.group_size * shape.max_new_tokens


def _kv_pool(shape: StepShape) -> int:
    return shape.kv_bytes_per_token * (shape.prefix_tokens + _response_bound(shape))


def _serial_plan(shape: StepShape) -> StepPlan:
    serial_tokens = shape.group_size * shape.prefix_tokens + _response_bound(shape)
    s = StepPlan("serial", [
        Phase(PhaseName.ROLLOUT, holds_bytes=_kv_pool(shape), tokens=shape.prefix_tokens + _response_bound(shape)),
        Phase(PhaseName.REF, depends_on=("rollout",), tokens=serial_tokens) if shape.has_reference else None,
        Phase(PhaseName.TRAIN, depends_on=("rollout",) + (("ref",) if shape.has_reference else ()),
              tokens=serial_tokens),
    ])
    s.phases = [p for p in s.phases if p is not None]
    s.reasons.append("serial: every sample is a full prompt+response forward in "
                     + ("ref and train" if shape.has_reference else "train"))
    s.validate()
    return s


def _fusion(s: StepPlan, shape: StepShape, options: PlanOptions, rollout: RolloutCapabilities) -> int:
    """Each prompt's holding form from the rollout prefill to training (`s.prefix_forms`); returns what the
    fused prompts hold."""
    overlapped = options.mode == "overlapped"
    fuse = overlapped and options.fuse_actor_prefix
    why_not = "decomposed mode" if not overlapped else "fuse_actor_prefix off"
    if fuse and not (rollout.prefill_hook and rollout.shares_actor_weights):
        fuse = False
        why_not = f"the rollout engine {_missing(rollout, 'prefill_hook', 'shares_actor_weights')} ({rollout.why_not})"
        s.reasons.append(f"actor prefix not fused: {why_not}")
    s.prefix_forms = choose_prefix_forms(shape.prompt_lengths, shape.activation_bytes_per_token,
                                         shape.prefix_room_bytes, fusable=fuse, why_not=why_not,
                                         compact_bytes_per_token=shape.compact_bytes_per_token)
    fused = s.fused_prompts()
    # each form's prompts as one (rounded once: a measured rate times their tokens is what they held)
    tokens_of = lambda form: sum(c.tokens for c in s.prefix_forms if c.form == form)
    held = (round(shape.activation_bytes_per_token * tokens_of(GRAPH))
            + round(shape.compact_bytes_per_token * tokens_of(COMPACT)))
    if fuse and len(fused) < len(shape.prompt_lengths):
        s.reasons.append((f"actor prefix fused for {len(fused)} of {len(shape.prompt_lengths)} prompts" if fused
                          else "actor prefix not fused") + ": the room for "
                         f"held prefixes is {shape.prefix_room_bytes / 2**30:.2f} GiB at "
                         f"{shape.activation_bytes_per_token / 2**20:.2f} MiB per token of graph; the others are "
                         f"computed in training")
    return held


def _window(s: StepPlan, shape: StepShape, options: PlanOptions, rollout: RolloutCapabilities) -> tuple[bool, bool]:
    """(reference prefixes in the decode window, reference suffixes too), where the options and the engine allow."""
    overlapped = options.mode == "overlapped"
    suffix_window = overlapped and options.ref_suffix_in_window and shape.has_reference
    # the window scores samples on their prompt's reference prefix, so it computes that prefix too
    window = suffix_window or (overlapped and options.ref_prefix_in_window and shape.has_reference)
    if window and not rollout.step_hook:  # the window's first jobs start once decode has begun (on_step)
        window = suffix_window = False
        s.reasons.append(f"reference not in the decode window: the rollout engine {_missing(rollout, 'step_hook')} "
                         f"({rollout.why_not}); it runs after rollout, in the ref stage")
    if suffix_window and not rollout.samples_finished_hook:
        suffix_window = False
        window = options.ref_prefix_in_window
        s.reasons.append(f"reference suffixes not scored in the decode window: the rollout engine "
                         f"{_missing(rollout, 'samples_finished_hook')} ({rollout.why_not})")
    return window, suffix_window


def _reference_phases(s: StepPlan, shape: StepShape, options: PlanOptions, first: tuple, window: bool,
                      suffix_window: bool) -> None:
    ref_kv, R = shape.kv_bytes_per_token * shape.prefix_tokens, _response_bound(shape)
    batch_ref = batches_ref_prefix(shape, options)
    s.ref_prefix_batched = batch_ref  # with the window: what it left (jobs not begun when decode ended)
    if window:
        s.phases.append(Phase(PhaseName.REF_PREFIX, placement=window_of(PhaseName.ROLLOUT), depends_on=first,
                              holds_bytes=ref_kv, tokens=shape.prefix_tokens))
        s.reasons.append("reference prefix K/V computed in the rollout decode window (second host thread, side "
                         "stream): its host-bound launches run beside the decode loop's")
    else:
        s.phases.append(Phase(PhaseName.REF_PREFIX, depends_on=("rollout",), holds_bytes=ref_kv,
                              tokens=shape.prefix_tokens,
                              note="batched: one forward per group of similar lengths" if batch_ref else ""))
        if batch_ref:
            s.reasons.append("reference prefixes batched at the start of the ref stage (one no-grad forward per "
                             "group of similar lengths), their K/V held for the suffix micro-batches")
        elif options.batched_ref_prefix:
            s.reasons.append(f"reference prefixes not batched: {shape.ref_prefix_batchable}; one prefix forward "
                             "per reference micro-batch")
        if options.mode == "overlapped":
            s.reasons.append("reference prefix after rollout: the decode window hides only host-bound work; set "
                             "runtime.reference_in_window to place it there")
    if suffix_window:
        s.phases.append(Phase(PhaseName.REF_SUFFIX, placement=window_of(PhaseName.ROLLOUT),
                              depends_on=("rollout", "ref_prefix"), tokens=R,
                              note=f"per {options.sample_batch(shape.group_size)} finished samples of a prompt, "
                                   "and its last ones"))
        s.reasons.append("reference suffixes of finished samples scored in the decode window: the slowest "
                         "samples decode on while the others are scored")
    else:
        s.phases.append(Phase(PhaseName.REF_SUFFIX, depends_on=("rollout", "ref_prefix"), tokens=R))


def _batched_actor_prefix(s: StepPlan, shape: StepShape, options: PlanOptions) -> bool:
    """Decomposed: the actor prefixes held within training (`s.train_prefix_forms`), in rounds of the train room
    where the runner allows; whether any is held."""
    if options.mode == "overlapped" or not options.batched_actor_prefix:
        return False
    choose = choose_train_rounds if shape.train_rounds else choose_prefix_forms
    s.train_prefix_forms = [
        replace(c, reason=f"held within training: {c.reason}")
        for c in choose(shape.prompt_lengths, shape.activation_bytes_per_token, shape.train_room_bytes,
                        compact_bytes_per_token=shape.compact_bytes_per_token)]
    count = sum(c.form != NONE for c in s.train_prefix_forms)
    if not count:
        s.reasons.append("actor prefix not batched in training: no room for a held prefix in the train stage")
        return False
    rounds = 1 + max((c.round for c in s.train_prefix_forms), default=0)
    deps = ("rollout",) + (("ref_suffix",) if shape.has_reference else ())
    where = ("before training's micro-batches" if rounds == 1 else
             f"in {rounds} rounds, each before its micro-batches and backpropagated after them")
    s.phases.append(Phase(PhaseName.ACTOR_PREFIX, depends_on=deps, holds_bytes=held_at_once_bytes(s.train_prefix_forms),
                          tokens=sum(c.tokens for c in s.train_prefix_forms if c.form != NONE),
                          note=f"{count} prompts in batched forwards {where}"))
    in_rounds = f", {rounds} rounds of what the room holds" if rounds > 1 else ""
    s.reasons.append(f"actor prefix batched in training for {count} of {len(shape.prompt_lengths)} prompts "
                     f"(room {shape.train_room_bytes / 2**30:.2f} GiB{in_rounds}): one batched forward per "
                     "group of similar lengths and one backward instead of one per micro-batch")
    return True


def _rounds_after_fusion(s: StepPlan, shape: StepShape, options: PlanOptions) -> bool:
    """Overlapped: the prompts the fused prefill left out, held in training in rounds after the fused ones."""
    left = [i for i, c in enumerate(s.prefix_forms) if c.form == NONE]
    if not (options.mode == "overlapped" and options.batched_actor_prefix and shape.train_rounds and left):
        return False
    chosen = choose_train_rounds(tuple(shape.prompt_lengths[i] for i in left), shape.activation_bytes_per_token,
                                 shape.train_room_bytes, compact_bytes_per_token=shape.compact_bytes_per_token,
                                 first_round=1)
    s.train_prefix_forms = [replace(c, prompt=left[c.prompt], reason=f"held within training: {c.reason}")
                            for c in chosen]
    count = sum(c.form != NONE for c in s.train_prefix_forms)
    if count:
        rounds = len({c.round for c in s.train_prefix_forms if c.form != NONE})
        s.reasons.append(f"actor prefix of {count} of the {len(left)} prompts not fused held in training in "
                         f"{rounds} round(s) after the fused prompts' backward (room "
                         f"{shape.train_room_bytes / 2**30:.2f} GiB): batched forwards instead of one per "
                         "micro-batch")
    return True


def _missing(rollout: RolloutCapabilities, *names: str) -> str:
    return "has no " + " and no ".join(n for n in names if not getattr(rollout, n)).replace("_", " ")
