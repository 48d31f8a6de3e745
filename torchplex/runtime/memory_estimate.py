"""The step's memory estimate: a small object with an explicit contract, what the planner and training read.

    estimate(shape)    the MemoryBudget of a step of this shape (memory_budget.py: every group resident per stage,
                       the KV pool, the micro-batches' token budgets, the room left for held prefixes); a query, it
                       changes nothing
    rates              the bytes per token the planner prices each holding form at (StepShape's rates)
    recompute_policy   training's per micro-batch choice: recompute or keep the whole graph (memory.recompute auto)
    observe(footprint) what a step measured (StepFootprint): the rates it learned replace the priors for the next
                       estimates, each in `learned` (MemoryRates), nowhere else

The priors (used until a step measured the quantity; `docs/memory.md` lists where each came from) are estimates from
the geometry: a decoder layer's graph is ~8 hidden-sized and ~4 MLP-sized saved tensors per token, the compact form
one hidden state per layer and the K/V, training at its recompute form, a no-grad forward one layer's tensors at a
time; on CUDA, a first step also counts
FIRST_TRAIN_UNPLANNED of the capacity in training and scales whole-graph estimates by FIRST_WHOLE_GRAPH_SCALE.
Only CUDA measures (the allocator's counters); elsewhere the priors stay.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from ..models.packing import suffix_key_heads
from .memory_budget import (FIRST_TRAIN_UNPLANNED, FIRST_WHOLE_GRAPH_SCALE, HEADROOM, MICRO_BATCH_SHARE,
                            MICRO_BATCH_TOKENS_CAP, MICRO_BATCH_TOKENS_WIDE, PREFIX_GRADS, UNPLANNED, MemoryBudget,
                            agree_on_recompute, batch_token_bound, device_capacity, held_cap_for_whole_graphs,
                            held_gradient_bytes, kv_pool_bytes, largest_fitting, logits_bytes, needs_recompute,
                            no_recompute_bytes, packed_key_bytes, prefix_backward_rate, recompute_train_bytes,
                            step_residents, whole_graph_scale)
from .plan import PlanOptions, StepShape, holds_every_ref_prefix
from .prefixes import HELD_BATCH_TOKENS


def local_bytes(params) -> int:
    """Bytes of these tensors on this rank (a DTensor counts its local shard)."""
    local = [p.to_local() if hasattr(p, "to_local") else p for p in params]
    return sum(t.numel() * t.element_size() for t in local)


@dataclass(frozen=True)
class Footprint:
    """What the step's models and engine hold and how the step runs, fixed for a runner's lifetime."""

    actor_bytes: int
    reference_bytes: int  # the reference's own (a frozen tower shared with the actor is the actor's)
    trainable_bytes: int  # gradients, and half of AdamW's two moments
    num_layers: int
    hidden_size: int
    intermediate_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    element_size: int
    vision_layer: tuple[int, int, int]  # (hidden, intermediate, merge^2) of a trainable tower's block; zeros frozen
    vision_depth: int
    checkpointed: bool  # the actor's blocks recompute in backward (activation checkpointing)
    capacity_bytes: int  # memory.budget_gib, or 0: the device's at each estimate
    # training's and reference scoring's tokens per micro-batch (0: sized here, `MemoryBudget.micro_batch_tokens`),
    # and their bounds on sequences (0: none)
    micro_batch_tokens: int = 0
    ref_micro_batch_tokens: int = 0
    micro_batch_size: int = 0
    ref_micro_batch_size: int = 0
    dp_size: int = 1
    train_rounds: bool = True  # training may hold prefixes in rounds (one process, plain tensors)
    recompute: str = "auto"  # memory.recompute
    kv_pool_from_budget: bool = False
    fuses: bool = False  # the rollout prefill may hold actor prefixes (overlapped, fused, an engine with the hook)
    batched_actor_prefix: bool = True
    mode: str = "decomposed"

    @property
    def kv_bytes_per_token(self) -> int:
        """K and V of one prompt token over all decoder layers."""
        return 2 * self.num_layers * self.num_kv_heads * self.head_dim * self.element_size

    def block_graph_bytes(self) -> tuple[float, float]:
        """(one decoder layer's, one trainable vision block's) whole graph in bytes per merged token: ~8 hidden-sized
        and ~4 MLP-sized saved tensors (norms, q/k/v, attention output; gate, up, activation, product)."""
        layer = lambda hidden, inter: (8 * hidden + 4 * inter) * self.element_size
        hidden, inter, merge = self.vision_layer
        vision = layer(hidden, inter) * merge if hidden else 0
        return layer(self.hidden_size, self.intermediate_size), vision

    def forward_bytes_per_token(self) -> int:
        """What a no-grad forward keeps per token at once: one decoder layer's tensors (the residual stream, its
        normed copy, the queries and the attention output; the MLP's gate, up and their product)."""
        return (4 * self.hidden_size + 3 * self.intermediate_size) * self.element_size

    def graph_prior(self) -> float:
        """Bytes per prompt token a fused prefill's whole graph holds, before it was measured (an overestimate only
        fuses fewer prompts in the first step)."""
        text, vision = self.block_graph_bytes()
        return self.num_layers * text + self.vision_depth * vision

    def compact_prior(self) -> float:
        """Bytes per prompt token of the compact form before it was measured: the hidden state entering each decoder
        layer and its K/V, and (trainable tower) each vision block's input for the patches of a merged token."""
        hidden, _, merge = self.vision_layer
        return (self.hidden_size * self.num_layers * self.element_size + self.kv_bytes_per_token
                + hidden * self.vision_depth * merge * self.element_size)


@dataclass
class MemoryRates:
    """What the estimator learned from the steps it observed (None: not measured yet, the prior stands)."""

    graph_bytes_per_token: float | None = None  # a fused prefill's whole graph, per prompt token (SavedBytes)
    compact_bytes_per_token: float | None = None  # the compact form likewise (CompactPrefix)
    # the largest training micro-batch's forward and backward at the recompute form the budget counts, above what
    # it found (any micro-batch without checkpointed blocks), the largest seen
    train_activation_bytes: int | None = None
    prefix_backward_rate: float | None = None  # the held batches' backward, per padded token of the largest batch
    prefix_forward_bytes: int = 0  # the batched actor prefix forward's transient beyond what it holds
    whole_graph_scale: float | None = None  # measured whole graph / its estimate (memory_budget.whole_graph_scale)
    whole_graph_sizes: list[int] = field(default_factory=list)  # the last step's micro-batches' whole graphs
    unplanned_bytes: dict[str, int] = field(default_factory=dict)  # stage -> peak beyond its plan (CUDA)


@dataclass
class StepFootprint:
    """What one step measured (CUDA; the CPU leaves the peaks empty), for `MemoryEstimator.observe`."""

    graph: tuple[int, int] | None = None  # (bytes the fused graphs held, their prompt tokens)
    compact: tuple[int, int] | None = None
    held_bytes: int = 0  # held prefixes' bytes over the step (graph and compact)
    stage_peaks: dict[str, int] = field(default_factory=dict)  # rollout / ref: the stage's peak
    planned: dict[str, dict[str, int]] = field(default_factory=dict)  # the plan's residents per stage
    train_above: dict[str, int] = field(default_factory=dict)  # training's windows: peak above what they found
    train_stayed: dict[str, int] = field(default_factory=dict)  # what stayed allocated after each window
    train_rigid_peak: int | None = None  # training's peak outside the whole-graph windows
    train_entry: int = 0  # what was allocated when training began
    largest_held_batch_tokens: int = 0
    recompute: dict = field(default_factory=dict)  # the policy's log: estimates, measured, whole, held_estimates


def bounded(tokens: int, sequences: int, longest: int) -> int:
    """A micro-batch's tokens within its bound on sequences (0: none) of at most `longest` tokens each."""
    return min(tokens, sequences * longest) if sequences else tokens


class MemoryEstimator:
    def __init__(self, footprint: Footprint, engine, device: torch.device, measured: bool, trainable=(),
                 managed_peaks: dict[str, int] | None = None, planned_pool_bytes: int = 0):
        self.fp, self.engine, self.device = footprint, engine, torch.device(device)
        self.trainable = list(trainable)  # the actor's trainable parameters: the gradients a backward will make
        self.measured = measured  # the allocator's counters are read (CUDA)
        self.managed_peaks = managed_peaks  # memory.managed: the residency plan's peak per stage
        self.planned_pool_bytes = planned_pool_bytes  # the KV pool the residency plan was built with
        self.learned = MemoryRates()

    # ---- the rates the planner prices held prefixes at ---------------------------------------------------------
    def graph_rate(self) -> float:
        return self.learned.graph_bytes_per_token or self.fp.graph_prior()

    def compact_rate(self) -> float:
        return self.learned.compact_bytes_per_token or self.fp.compact_prior()

    def graph_scale(self) -> float:
        """The factor on whole-graph estimates: the learned one; before a kept graph was measured,
        FIRST_WHOLE_GRAPH_SCALE where stages are measured, else 1 (nothing will be)."""
        if self.learned.whole_graph_scale is not None:
            return self.learned.whole_graph_scale
        return FIRST_WHOLE_GRAPH_SCALE if self.measured else 1.0

    # ---- estimate -----------------------------------------------------------------------------------------------
    def estimate(self, shape: StepShape, options: PlanOptions) -> MemoryBudget:
        """The budget of a step of this shape: every group resident per stage, the KV pool (sized from the budget
        with kv_pool_from_budget: `MemoryBudget.kv_pool_bytes`), the micro-batches' token budgets and what they take
        (`_size_micro_batches`), the held cap from the last step's whole graphs."""
        fp = self.fp
        budget = MemoryBudget(fp.capacity_bytes or device_capacity(self.device), self._residents(shape))
        residents = budget.residents
        one_group = self.engine.pool_group_bytes(shape.group_size, max(shape.prompt_lengths), shape.max_new_tokens)
        groups = min(len(shape.prompt_lengths), max(1, self.engine.max_batch // shape.group_size))
        pool = self.engine.kv_pool_bytes
        if fp.kv_pool_from_budget and one_group:
            pool = kv_pool_bytes(groups * one_group, one_group, budget.stage_bytes("rollout"), budget.usable_bytes)
        budget.kv_pool_bytes = pool
        if one_group and pool < one_group:
            pool = one_group  # the engine cannot run with less: counted so the check names the keys
        residents["rollout"]["kv_pool"] = pool if self.managed_peaks is None else max(0, pool - self.planned_pool_bytes)
        if holds_every_ref_prefix(shape, options):  # the REF_PREFIX phase's bytes
            residents["ref"]["ref_prefix_kv"] = shape.kv_bytes_per_token * shape.prefix_tokens
        for stage, nbytes in self.learned.unplanned_bytes.items():
            residents[stage][UNPLANNED] = nbytes
        if self.measured and "train" not in self.learned.unplanned_bytes:
            residents["train"][UNPLANNED] = int(FIRST_TRAIN_UNPLANNED * budget.capacity_bytes)
        self._size_micro_batches(shape, options, budget)
        rounds = fp.batched_actor_prefix and fp.train_rounds
        if self.learned.whole_graph_sizes and rounds and fp.recompute == "auto" and fp.checkpointed:
            smallest = shape.compact_bytes_per_token or shape.activation_bytes_per_token
            budget.held_cap_bytes, budget.held_cap = held_cap_for_whole_graphs(
                budget, self.learned.whole_graph_sizes, [math.ceil(smallest * L) for L in shape.prompt_lengths],
                fp.fuses)
        return budget

    def _residents(self, shape: StepShape) -> dict[str, dict[str, int]]:
        """Every group per stage but the KV pool: weights, optimizer state, gradients, the held batched prefixes'
        gradients and their backward's transient as training's activations (`_size_micro_batches` adds the
        micro-batch's: the two never overlap)."""
        fp = self.fp
        train_act, held_grads = 0, 0
        cap = self._held_batch_cap()
        if cap:
            rate = self.learned.prefix_backward_rate or prefix_backward_rate(max(fp.block_graph_bytes()))
            # the rollout admits prompts in order; training batches them by length, data-parallel ranks in one batch
            lengths = shape.prompt_lengths if fp.mode == "overlapped" else sorted(shape.prompt_lengths)
            bound = batch_token_bound(lengths, cap if fp.dp_size == 1 else sum(lengths))
            train_act = max(train_act, math.ceil(rate * bound), self.learned.prefix_forward_bytes)
            held_grads = held_gradient_bytes(shape.kv_bytes_per_token, fp.hidden_size * fp.element_size,
                                             shape.prefix_tokens)
        residents = step_residents(actor_bytes=fp.actor_bytes, reference_bytes=fp.reference_bytes,
                                   optimizer_bytes=2 * fp.trainable_bytes, grad_bytes=fp.trainable_bytes,
                                   kv_pool_bytes=0, train_activation_bytes=train_act, managed=self.managed_peaks)
        if held_grads:
            residents["train"][PREFIX_GRADS] = held_grads
        return residents

    # ---- micro-batches by tokens --------------------------------------------------------------------------------
    def _size_micro_batches(self, shape: StepShape, options: PlanOptions, budget: MemoryBudget) -> None:
        """Training's and the reference's tokens per micro-batch (the configured ones, else the largest whose bytes fit
        their stage: `micro_batch_tokens`), into `budget` with what each takes in its stage's activations. Training
        counts its micro-batch at its recompute form when checkpointed (held prefixes always fit; the learned bytes
        once measured), and sizes it with `_train_tokens`."""
        fp, residents = self.fp, budget.residents
        budget.micro_batch_tokens, why = self._train_tokens(shape, budget)
        tokens = budget.micro_batch_tokens
        counted = (self.learned.train_activation_bytes if self.learned.train_activation_bytes is not None
                   else self.train_micro_batch_bytes(shape, tokens, whole=not fp.checkpointed))
        residents["train"]["activations"] = max(residents["train"].get("activations", 0), counted)
        reasons = [f"training {tokens:,} tokens ({why})"]
        if shape.has_reference:
            held = holds_every_ref_prefix(shape, options)
            budget.ref_micro_batch_tokens, why = self._tokens_for(
                shape, budget, "ref", fp.ref_micro_batch_tokens, fp.ref_micro_batch_size,
                lambda t: self.ref_micro_batch_bytes(shape, t, held), one_group=True)
            residents["ref"]["activations"] = self.ref_micro_batch_bytes(shape, budget.ref_micro_batch_tokens, held)
            reasons.append(f"reference {budget.ref_micro_batch_tokens:,} tokens ({why})")
        budget.micro_batch_reason = "; ".join(reasons)

    def _train_tokens(self, shape: StepShape, budget: MemoryBudget) -> tuple[int, str]:
        """(training's tokens per micro-batch, why): the largest whose whole graph fits (its recompute form with
        memory.recompute "always"). Where blocks are checkpointed and whole graphs fit fewer than
        MICRO_BATCH_TOKENS_WIDE, the largest up to that whose recompute form fits: a narrower forward loses more to
        idle matrix units than recomputing its blocks costs (the recompute policy still keeps a whole graph where the
        memory free at its forward holds it)."""
        fp = self.fp
        whole = not (fp.checkpointed and fp.recompute == "always")
        bytes_at = lambda kept: lambda t: math.ceil(
            (self.graph_scale() if kept else 1.0) * self.train_micro_batch_bytes(shape, t, kept))
        tokens, why = self._tokens_for(shape, budget, "train", fp.micro_batch_tokens, fp.micro_batch_size,
                                       bytes_at(whole), one_group=False)
        if whole and fp.checkpointed and not fp.micro_batch_tokens and tokens < MICRO_BATCH_TOKENS_WIDE:
            wider, how = self._tokens_for(shape, budget, "train", 0, fp.micro_batch_size, bytes_at(False),
                                          one_group=False, widest=MICRO_BATCH_TOKENS_WIDE)
            if wider > tokens:
                return wider, f"{how}, recomputing its blocks: whole graphs fit {tokens:,}"
        return tokens, why

    def _tokens_for(self, shape: StepShape, budget: MemoryBudget, stage: str, configured: int, sequences: int,
                    bytes_at, one_group: bool, widest: int = MICRO_BATCH_TOKENS_CAP) -> tuple[int, str]:
        """(tokens per micro-batch of `stage`, why): `configured`, else the largest in [one sequence (one group with
        `one_group` in the prefix modes: its prefix then serves it whole), the cap] whose `bytes_at` fits the stage's
        share of what its other residents leave (MICRO_BATCH_SHARE in the prefix modes, all of it in serial: no held
        prefixes); the cap is the least of `widest` (MICRO_BATCH_TOKENS_CAP or _WIDE), the whole step and `sequences`
        of the longest."""
        if configured:
            return configured, "configured"
        serial = self.fp.mode == "serial"
        longest = shape.max_new_tokens + (max(shape.prompt_lengths) if serial else 0)
        floor = longest * (min(shape.group_size, sequences or shape.group_size) if one_group and not serial else 1)
        caps = {"MICRO_BATCH_TOKENS_CAP" if widest == MICRO_BATCH_TOKENS_CAP else "MICRO_BATCH_TOKENS_WIDE": widest,
                "the whole step": shape.group_size * (len(shape.prompt_lengths) * shape.max_new_tokens
                                                      + (shape.prefix_tokens if serial else 0))}
        if sequences:
            caps["the sequence bound"] = sequences * longest
        cap_name, cap = min(caps.items(), key=lambda kv: kv[1])
        share = 1.0 if serial else MICRO_BATCH_SHARE
        others = budget.stage_bytes(stage) - budget.residents[stage].get("activations", 0)
        room = int(share * max(0, budget.usable_bytes - others))
        tokens = largest_fitting(bytes_at, room, floor, cap)
        if tokens >= cap:
            return tokens, f"capped at {cap_name}"
        if bytes_at(tokens) > room:
            return tokens, f"one {'group' if floor > longest else 'sequence'}, the smallest: nothing fits " \
                           f"{room / 2**30:.2f} GiB"
        return tokens, f"the largest whose bytes fit {share:.0%} of the {room / share / 2**30:.2f} GiB the {stage} " \
                       f"stage leaves"

    def train_micro_batch_bytes(self, shape: StepShape, tokens: int, whole: bool) -> int:
        """What a training micro-batch of `tokens` (serial: prompt and response rows; the prefix modes: responses)
        takes: its whole graph (`whole_graph_bytes`) or its recompute form (`recompute_train_bytes`). Its samples
        count at full length (shorter ones put more samples, each with its prompt's packed keys, in a budget:
        algorithm.micro_batch_size bounds them); in the prefix modes the prefixes of the groups it touches count
        unless the step holds them (fused, or batched in training)."""
        fp, P, R = self.fp, max(shape.prompt_lengths), shape.max_new_tokens
        tokens = bounded(tokens, fp.micro_batch_size, R + (P if fp.mode == "serial" else 0))
        if fp.mode == "serial":
            responses = math.ceil(tokens * R / (P + R))
            prefix, key_rows = tokens - responses, 0
        else:
            samples = math.ceil(tokens / R)
            held = fp.fuses or fp.batched_actor_prefix
            prefix = 0 if held else min(len(shape.prompt_lengths), math.ceil(samples / shape.group_size)) * P
            responses, key_rows = tokens, samples * P + tokens
        if whole:
            return self.whole_graph_bytes(prefix, responses, key_rows)
        return recompute_train_bytes(shape.compact_bytes_per_token, max(fp.block_graph_bytes()), prefix + responses,
                                     responses, fp.vocab_size)

    def ref_micro_batch_bytes(self, shape: StepShape, tokens: int, prefixes_held: bool) -> int:
        """What a reference micro-batch of `tokens` takes at once (no grad): one layer's tensors over its tokens and
        the prefixes it computes (none where the ref stage holds every prefix), one layer's packed suffix keys, one
        LM-head chunk's logits."""
        fp, P, R = self.fp, max(shape.prompt_lengths), shape.max_new_tokens
        tokens = bounded(tokens, fp.ref_micro_batch_size, R + (P if fp.mode == "serial" else 0))
        if fp.mode == "serial":
            return fp.forward_bytes_per_token() * tokens + logits_bytes(tokens, fp.vocab_size)
        samples = math.ceil(tokens / R)
        prefix = 0 if prefixes_held else min(len(shape.prompt_lengths), math.ceil(samples / shape.group_size)) * P
        keys = packed_key_bytes(samples * P + tokens, 1, self._key_heads(), fp.head_dim, fp.element_size)
        return fp.forward_bytes_per_token() * (prefix + tokens) + keys + logits_bytes(tokens, fp.vocab_size)

    def whole_graph_bytes(self, prefix_tokens: int, response_tokens: int, key_rows: int) -> int:
        """A training forward's activations with every block keeping its graph (before `graph_scale`): the prefixes it
        computes at the prefix graph's rate, its responses at the decoder layers' (`no_recompute_bytes`), and the
        packed suffix keys of `key_rows` rows (0: serial, whose attention keeps no gathered keys)."""
        fp = self.fp
        est = no_recompute_bytes(self.graph_rate(), prefix_tokens, fp.num_layers * fp.block_graph_bytes()[0],
                                 response_tokens, fp.vocab_size)
        if key_rows:
            est += packed_key_bytes(key_rows, fp.num_layers, self._key_heads(), fp.head_dim, fp.element_size)
        return est

    def _key_heads(self) -> int:
        fp = self.fp
        return suffix_key_heads(fp.num_heads, fp.num_kv_heads, fp.head_dim, self.device,
                                torch.bfloat16 if fp.element_size == 2 else torch.float32)

    def _held_batch_cap(self) -> int:
        """The most padded tokens one batch of held prefixes takes (0: none held in batches): the rollout's prefill
        batch (fused) or HELD_BATCH_TOKENS (batched actor prefixes in training), the larger where both apply."""
        fp, caps = self.fp, [0]
        if fp.fuses:
            caps.append(self.engine.prefill_tokens)
        rounds = fp.mode == "overlapped" and fp.train_rounds
        if fp.batched_actor_prefix and (fp.mode == "decomposed" or rounds):
            caps.append(HELD_BATCH_TOKENS)
        return max(caps)

    # ---- training's recompute choice ---------------------------------------------------------------------------
    def recompute_policy(self, serial: bool, held, tp_group, budget: MemoryBudget, held_bytes: int, log: dict):
        """recompute_for(micro-batch, request) for training (TrainMemory.recompute_for): without checkpointed blocks
        nothing recomputes (every forward counts as keeping its graph); "always" recomputes; "auto" keeps the whole graph (no_recompute_bytes over what the
        forward computes, scaled by graph_scale()) where it fits the memory free less the headroom. `held(prompt)`
        says whether a prompt's prefix is held, `held_bytes` what the plan holds at most; each choice's estimate
        and the free bytes go to `log`."""
        fp = self.fp
        if not fp.checkpointed:
            return lambda mb, req: False
        if fp.recompute == "always":
            return lambda mb, req: True
        scale = self.graph_scale()
        log.update(bytes_per_token=self.graph_rate(), suffix_bytes_per_token=fp.num_layers * fp.block_graph_bytes()[0],
                   scale=scale, estimates=[], free_bytes=[], whole=[], held_estimates=[])

        def decide(mb, req) -> bool:
            responses = sum(req.host_lengths())
            prompt_rows = sum(len(req.prompts[i].input_ids) for i in req.prompt_index)
            prefix = prompt_rows if serial else sum(len(p.input_ids) for p in req.prompts if not held(p))
            # the prefix modes' packed suffix keys: each sample's prompt rows and its own tokens
            key_rows = 0 if serial else prompt_rows + responses
            est = self.whole_graph_bytes(prefix, responses, key_rows)
            if not serial:
                log["held_estimates"].append(self.whole_graph_bytes(0, responses, key_rows))
            free, margin = self.free_for_training(budget, held_bytes)
            log["estimates"].append(est)  # unscaled: what whole_graph_scale compares the measured bytes with
            log["free_bytes"].append(free - margin)
            on = agree_on_recompute(needs_recompute(math.ceil(est * scale), free, margin), tp_group, self.device)
            log["whole"].append(not on)
            return on

        return decide

    def free_for_training(self, budget: MemoryBudget, held_bytes: int = 0) -> tuple[int, int]:
        """(free bytes now, margin) for a training forward. CUDA: the device's free memory plus the allocator's
        cached blocks (within the configured budget when set), less the gradients the forward's backward will create
        (before the step's first backward, every one), margin HEADROOM of the capacity; CPU: the budget less what it
        counts resident in training (activations aside, gradients whole) and the held prefixes."""
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            allocated = torch.cuda.memory_allocated(self.device)
            free += torch.cuda.memory_reserved(self.device) - allocated
            pending = local_bytes(p for p in self.trainable if p.requires_grad and p.grad is None)
            if self.fp.capacity_bytes:
                return min(free, budget.capacity_bytes - allocated) - pending, int(HEADROOM * budget.capacity_bytes)
            return free - pending, int(HEADROOM * total)
        resident = sum(b for g, b in budget.residents["train"].items() if g != "activations")
        return budget.capacity_bytes - resident - held_bytes, int(HEADROOM * budget.capacity_bytes)

    # ---- observe ------------------------------------------------------------------------------------------------
    def observe(self, step: StepFootprint) -> None:
        """Learn from a step's measurements: the held forms' rates, the stages' unplanned bytes, training's
        activations, the held batches' backward rate and forward transient, the whole-graph scale and sizes."""
        learned = self.learned
        if step.graph:
            learned.graph_bytes_per_token = step.graph[0] / step.graph[1]
        if step.compact:
            learned.compact_bytes_per_token = step.compact[0] / step.compact[1]
        for stage in ("rollout", "ref"):
            if stage in step.stage_peaks:
                planned = sum(b for g, b in step.planned.get(stage, {}).items() if g != UNPLANNED) + step.held_bytes
                learned.unplanned_bytes[stage] = max(0, step.stage_peaks[stage] - planned)
        self._observe_training(step)

    def _observe_training(self, step: StepFootprint) -> None:
        learned, above, fp = self.learned, step.train_above, self.fp
        names = ("recompute",) if fp.checkpointed else ("whole_graph", "micro_batch")
        act = max((above[n] for n in names if n in above), default=None)
        if act is not None:
            learned.train_activation_bytes = max(act, learned.train_activation_bytes or 0)
        if "prefix_backward" in above and step.largest_held_batch_tokens:
            learned.prefix_backward_rate = above["prefix_backward"] / step.largest_held_batch_tokens
        if "prefix_forward" in above:
            learned.prefix_forward_bytes = above["prefix_forward"]
        log = step.recompute
        if log.get("measured") and "estimates" in log:
            learned.whole_graph_scale = whole_graph_scale(learned.whole_graph_scale, log["estimates"],
                                                          log["measured"], log["whole"])
        if log.get("held_estimates"):
            learned.whole_graph_sizes = [math.ceil(e * self.graph_scale()) for e in log["held_estimates"]]
        if step.train_rigid_peak is not None:  # what peaked outside those windows: training's unplanned bytes
            elastic = ("whole_graph",) if fp.checkpointed else ()
            largest = max((b for n, b in above.items() if n not in elastic), default=0)
            held = step.train_stayed.get("prefix_forward", 0)  # the batched prefixes (in the train room)
            learned.unplanned_bytes["train"] = max(
                0, step.train_rigid_peak - step.train_entry - fp.trainable_bytes - held - largest)
