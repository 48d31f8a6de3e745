"""The actor prefixes a step holds for training: the forms its fused rollout prefill really held, and training's own
held prefixes (the plan's `train_prefix_forms`), computed in batched forwards before the micro-batches of their round.

Decomposed (runtime.batched_actor_prefix): a round's prompts' prefixes run in batched forwards (one per group of
similar lengths, at most HELD_BATCH_TOKENS padded tokens each: the budget's bound on their backward), held for the
first epoch's micro-batches, and backpropagated in one pass after the round (DecomposedScorer.finish_backward); the
prompts one room left out follow in later rounds of the same room. Overlapped: round 0 is what the fused prefill
held, the prompts it left out start at round 1. Data-parallel ranks hold one form for every prompt and run one batch
each, so their FSDP2 collectives match.
"""

from __future__ import annotations

import math
from dataclasses import replace

from ..data.batching import length_groups, token_batches
from .memory_budget import COMPACT, NONE, PrefixChoice, agree_on_held_form
from .prefixes import HELD_BATCH_TOKENS, PrefixStore, fused_prefill, prompt_length


def held_forms_after_prefill(forms: list[PrefixChoice], prompts: list, store: PrefixStore, compact_rate: float,
                             reasons: list[str]) -> list[PrefixChoice]:
    """`forms` as the fused prefill held them (prefixes.fused_prefill demotes a prompt alone in its form in a
    prefill batch), each change with its reason (one line for all of them in `reasons`)."""
    held, changed = [], 0
    for c in forms:
        planned, form = store.demoted.get(id(prompts[c.prompt]), (c.form, c.form))
        if form == c.form:
            held.append(c)
            continue
        held.append(replace(c, form=form, bytes=math.ceil(compact_rate * c.tokens) if form == COMPACT else 0,
                            reason=f"planned {planned}, held {form}: alone in its form in its prefill batch, a "
                            "compiled forward of one prompt would compile anew (prefixes.fused_prefill)"))
        changed += 1
    if changed:
        reasons.append(f"{changed} prompt(s) held in a smaller form than planned: alone in their form in a prefill "
                       "batch (prefixes.fused_prefill)")
    return held


class TrainPrefixes:
    """One step's training-held actor prefixes: which prompt is held in which form and round, and `hold_round(r)`,
    which runs round r's batched forwards (measured in the "prefix_forward" window). `held_train_forms` records the
    forms the forwards really held; `reasons` gets a line for every form that differs from the plan."""

    def __init__(self, scorer, actor, prompts: list, plan, prefill_forms: list[PrefixChoice], keep_groups: list[bool],
                 prefixes: PrefixStore, windows, compact_rate: float, reasons: list[str], *, dp_size: int = 1,
                 dp_group=None, device=None, batched_actor_prefix: bool = False):
        self.prompts, self.plan, self.prefixes, self.windows = prompts, plan, prefixes, windows
        self.compact_rate, self.reasons, self.dp_size = compact_rate, reasons, dp_size
        choices = plan.train_prefix_forms
        agree = dp_size > 1 and batched_actor_prefix and plan.mode == "decomposed"
        self.held = self._forms(choices, keep_groups, dp_group, device) if agree else {
            id(prompts[c.prompt]): c.form for c in choices if c.form != NONE and keep_groups[c.prompt]}
        last = max((c.round for c in choices if c.form != NONE), default=0)
        self.rounds = [last] * len(prompts)  # a prompt held in none runs with the last round
        for c in prefill_forms + choices:
            if c.form != NONE:
                self.rounds[c.prompt] = c.round
        self.in_rounds = bool(self.held) and last > 0
        self._prefill = fused_prefill(scorer, actor, prefixes, self.held) if self.held else None
        self.held_train_forms: list[PrefixChoice] = []

    def _forms(self, choices: list[PrefixChoice], keep_groups: list[bool], dp_group, device) -> dict[int, str]:
        """id(prompt) -> its form when data-parallel ranks hold decomposed prefixes: one form for every prompt of
        every rank (agree_on_held_form), the dropped groups' too, as the overlapped mode holds them: a rank pads its
        micro-batches with passes over its dropped groups (training.equal_micro_batches), which must find their
        prefixes held to run the same FSDP2 collectives as another rank's real micro-batches."""
        form = agree_on_held_form([c.form for c in choices], dp_group, device)
        if any(c.form != form for c in choices):
            self.reasons.append(f"actor prefixes in training held as {form} for every prompt: the data-parallel "
                                "ranks' agreed form (memory_budget.agree_on_held_form)")
        return {id(self.prompts[c.prompt]): form for c in choices} if form != NONE else {}

    def hold_round(self, r: int) -> None:
        """Round r's kept prompts' actor prefixes in batched forwards, held for epoch 0's micro-batches of the
        round: one batch per group of similar lengths (little padding held) of at most HELD_BATCH_TOKENS;
        data-parallel ranks run one batch each, as their FSDP2 gathers must match in number."""
        prompts = [p for b, p in enumerate(self.prompts) if id(p) in self.held and self.rounds[b] == r]
        if not prompts:
            return
        batches = ([b for g in length_groups(prompts, length=prompt_length)
                    for b in token_batches(g, HELD_BATCH_TOKENS, prompt_length)] if self.dp_size == 1 else [prompts])
        windows = self.windows
        stays = windows.counter.allocated if windows.counter is not None else None
        with windows.window("prefix_forward", growth=stays):  # its transient beyond what the batches keep held
            for batch in batches:
                self._prefill(batch)
        self.held_train_forms = held_forms_after_prefill(self.plan.train_prefix_forms, self.prompts, self.prefixes,
                                                         self.compact_rate, self.reasons)
