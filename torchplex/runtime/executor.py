"""The step executor: a loop over the planner schedule's stages, with the same phase code in every mode.

The schedule (runtime/planner.py) says which phases run and where; `StepRunner.run` plans it and runs each of
its main-stream stages (runtime/phases.py) in order, reading placements from it:
    vision    frozen tower: one encoding per prompt, cached for every phase
    rollout   the engine's generate, with the prefill it is given (fused: the actor prefix kept for training) and
              the decode-window hooks of the phases placed there (runtime/overlap.py)
    ref       the reference's log-probs of what the window did not score (serial: full forwards)
    train     old-policy log-probs, losses, backward and the optimizer step
serial       rollout -> ref (full forwards) -> train (full forwards)
decomposed   [vision] -> rollout -> ref (prefix once per prompt + suffixes) -> train (likewise)
overlapped   decomposed, plus what the schedule moves into the rollout (fusion, window jobs: runtime/overlap.py)
The numbers do not depend on where a phase ran: tests/test_overlap.py holds overlapped to decomposed.
"""

from __future__ import annotations

from contextlib import ExitStack, contextmanager, nullcontext
import math
from dataclasses import dataclass, field, replace

import torch

from ..components.captured_step import plain_tensors
from ..components.peak_memory import PeakWindows
from ..components.span_clock import SpanClock, span_or_nothing
from ..distributed.fsdp import gathered, reshard
from ..models.packing import suffix_key_heads
from ..models.qwen2_5_vl.parallelize import is_checkpointed
from ..rl.losses import PolicyLossConfig
from ..rollout.sampling import SamplingParams
from .decomposition import DecomposedScorer, VisionCache
from .memory_budget import (COMPACT, FIRST_TRAIN_UNPLANNED, FIRST_WHOLE_GRAPH_SCALE, HEADROOM, NONE, PREFIX_GRADS,
                            UNPLANNED, MemoryBudget, PrefixChoice, agree_on_held_form, agree_on_recompute,
                            batch_token_bound, device_capacity, held_at_once_bytes, held_cap_for_whole_graphs,
                            held_gradient_bytes, kv_pool_bytes, needs_recompute, no_recompute_bytes,
                            packed_key_bytes, prefix_backward_rate, recompute_train_bytes, step_residents,
                            whole_graph_scale)
from .grpo_step import Experience, TrainResult, build_experience, reference_phase, train_phase
from .overlap import (HELD_BATCH_TOKENS, DecodeWindowJobs, PrefixStore, fused_prefill, hold_prefixes, length_groups,
                      rollout_prefill, token_batches)
from .phases import Stage
from .planner import PlanOptions, Schedule, StepShape, holds_every_ref_prefix, plan_step
from .prefix_graphs import PrefixGraphs
from .scoring import SerialScorer
from .timeline import Timeline
from .window import WindowWorker


@dataclass
class StepSettings:
    reward_names: list[str]
    reward_weights: list[float]
    advantage: str = "grpo"
    dynamic_sampling: bool = False
    temperature: float = 1.0
    micro_batch_size: int = 8
    ref_micro_batch_size: int = 0  # reference scoring's; 0: micro_batch_size
    ppo_epochs: int = 1
    grad_clip: float = 1.0
    loss: PolicyLossConfig = field(default_factory=PolicyLossConfig)
    plan: PlanOptions = field(default_factory=PlanOptions)
    checkpoint_prefix: bool = False  # activation checkpointing of the prompt prefix forward
    packed_scoring: bool = True  # scorers run a micro-batch's valid tokens only (runtime/packing.py)
    kv_pool_from_budget: bool = False  # size the engine's KV pool each step from the memory budget (kv_pool_gib 0)
    # checkpointed actor: "auto" = a training micro-batch skips the recompute when its whole graph fits in the free
    # memory at its forward (memory.recompute); "always" = every one recomputes
    recompute: str = "auto"
    # time the train stage's spans (its batched prefix forward, each micro-batch, the held prefixes' backward, the
    # optimizer step) on host and device (components/span_clock; TrainResult.spans): a diagnostic for benchmarks
    time_train: bool = False


@dataclass
class StepOutput:
    experience: Experience
    train: TrainResult
    schedule: Schedule
    timeline: Timeline
    prefixes: PrefixStore | None = None  # the step's held prefixes (emptied at its end; peaks kept)
    window_jobs: DecodeWindowJobs | None = None  # the decode window's jobs: submitted, scored, dropped at decode's end


@dataclass
class _Step:
    """One step's state as it passes through the stages."""

    prompts: list
    answers: list[str]
    params: SamplingParams
    sample_seeds: object
    schedule: Schedule
    timeline: Timeline
    prefixes: PrefixStore
    vision: VisionCache  # the frozen tower's encodings of this step's prompts
    gathers: ExitStack  # the reference gathered from the rollout through the ref stage, when the window reads it
    window_jobs: DecodeWindowJobs | None = None
    outputs: list | None = None
    experience: Experience | None = None
    result: TrainResult | None = None
    stage: str = "start"  # the stage running (a failing step's error names it)


def _local_bytes(params) -> int:
    """Bytes of these tensors on this rank (a DTensor counts its local shard)."""
    local = [p.to_local() if hasattr(p, "to_local") else p for p in params]
    return sum(t.numel() * t.element_size() for t in local)


def _tp_group(model):
    """The tensor-parallel process group of a TP'd actor (its decoder weights are DTensors on a mesh with a "tp"
    axis), else None."""
    weight = model.layers[0].attention.wq.weight
    mesh = getattr(weight, "device_mesh", None)
    if mesh is None or "tp" not in (mesh.mesh_dim_names or ()):
        return None
    return mesh["tp"].get_group()


class StepRunner:
    def __init__(self, actor, reference, engine, optimizer, lr_scheduler, tokenizer, settings: StepSettings,
                 *, pad_id: int = 0, dp_size: int = 1, dp_group=None, memory=None):
        self.actor, self.reference, self.engine = actor, reference, engine
        self.optimizer, self.lr_scheduler, self.tokenizer = optimizer, lr_scheduler, tokenizer
        self.settings = settings
        self.dp_size, self.dp_group = dp_size, dp_group
        self.memory = None  # runtime.memory.MemoryManager: residency of tensor groups per stage
        if memory is not None:
            self.attach_memory(memory)
        mode = settings.plan.mode
        self.scorer = (SerialScorer(pad_id, pack=settings.packed_scoring) if mode == "serial"
                       else DecomposedScorer(pad_id, checkpoint_prefix=settings.checkpoint_prefix,
                                             pack=settings.packed_scoring))
        if settings.plan.ref_prefix_graphs and mode != "serial" and reference is not None:
            if not plain_tensors(reference):
                raise ValueError("runtime.ref_prefix_graphs needs a reference model of plain tensors (tp 1, not FSDP2-"
                                 "sharded); turn it off for this parallelism")
            self.scorer.prefix_graphs[id(reference)] = PrefixGraphs(reference)
        self.device = next(actor.parameters()).device
        self.window = WindowWorker(self.device)
        # what a fused prefill's graph held per prompt token, measured (overlap.SavedBytes); until the first fused
        # step, an estimate (_graph_estimate)
        self._activation_bytes_per_token: float | None = None
        # likewise for the compact form (overlap.CompactPrefix); until measured, one hidden state per decoder layer
        # (a trainable tower's block inputs per vision token besides)
        self._compact_bytes_per_token: float | None = None
        # the largest training micro-batch's forward and backward at the recompute form the budget counts (without
        # checkpointed blocks: any micro-batch), above what it found, measured on CUDA (peak_memory.PeakWindows) and
        # kept as the largest seen; until then the budget's estimate (memory_budget.recompute_train_bytes)
        self._train_activation_bytes: int | None = None
        # the batched held prefixes' backward after an epoch (DecomposedScorer.finish_backward), above what it
        # found, per padded token of the largest held batch: measured on CUDA, until then
        # memory_budget.prefix_backward_rate's estimate
        self._prefix_backward_rate: float | None = None
        # decomposed's batched actor prefix forward in the train stage: its transient beyond what it holds (CUDA)
        self._prefix_forward_bytes = 0
        # measured whole graph / its estimate of training forwards that kept it (memory_budget.whole_graph_scale);
        # None until a kept graph was measured (_graph_scale: the prior)
        self._whole_graph_scale: float | None = None
        # the last step's training micro-batches' whole graphs with their prefixes held (scaled estimates), which
        # the budget weighs against held prefixes (memory_budget.held_cap_for_whole_graphs); empty until a step ran
        self._whole_graph_sizes: list[int] = []
        self.windows = PeakWindows.for_device(self.device)  # the allocator's counters (CUDA; None elsewhere)
        # the rollout's and the reference's last peak beyond their plans (residents and the prefixes really held):
        # the transients no group counts (decode's logits and sampling, a reference micro-batch, ...); the next
        # plans count them in the stage (memory_budget.UNPLANNED); CUDA only
        self._unplanned_bytes: dict[str, int] = {}
        self._stage_peaks: dict[str, int] = {}  # this step's, per stage (_stage)
        self._stage_entry = 0  # what was allocated when the current stage began (CUDA)
        self.failed_schedule: Schedule | None = None  # the last failed step's (run)

    def attach_memory(self, memory) -> None:
        if self.settings.plan.ref_prefix_in_window or self.settings.plan.ref_suffix_in_window:
            raise ValueError("ref_prefix_in_window/ref_suffix_in_window read the reference weights during rollout, "
                             "but the memory plan keeps them on the device only in the ref phase; use one or the "
                             "other")
        self.memory = memory

    def stages(self) -> list[Stage]:
        """The stages every step of this runner runs (they depend on the mode, the models and the engine, not on
        the batch): what a memory plan plans."""
        shape = StepShape(prompt_lengths=(1,), group_size=1, max_new_tokens=1, has_reference=self.reference is not None,
                          vision_trainable=self._vision_trainable(), ppo_epochs=self.settings.ppo_epochs)
        return plan_step(shape, self.settings.plan, self.engine.capabilities).stages()

    def _vision_trainable(self) -> bool:
        return any(p.requires_grad for p in self.actor.visual.parameters())

    def shape(self, prompts, params: SamplingParams) -> StepShape:
        return StepShape(prompt_lengths=tuple(len(p.input_ids) for p in prompts), group_size=params.n,
                         max_new_tokens=params.max_new_tokens, has_reference=self.reference is not None,
                         vision_trainable=self._vision_trainable(),
                         ppo_epochs=self.settings.ppo_epochs, kv_bytes_per_token=self._kv_bytes_per_token(),
                         activation_bytes_per_token=self._activation_bytes_per_token or self._graph_estimate(),
                         compact_bytes_per_token=self._compact_bytes_per_token or self._compact_estimate(),
                         ref_prefix_batchable=self._ref_prefix_unbatchable(params.n), device=self.device.type,
                         train_rounds=self._train_rounds())

    def _fuses_actor_prefix(self) -> bool:
        """Whether this runner's rollout prefill may hold actor prefixes (overlapped, fusion on, an engine with the
        prefill hook)."""
        plan = self.settings.plan
        return bool(plan.mode == "overlapped" and plan.fuse_actor_prefix and self.engine.capabilities.prefill_hook)

    def _train_rounds(self) -> bool:
        """Whether training may hold prefixes in rounds (StepShape.train_rounds): one process, plain tensors."""
        return self.dp_size == 1 and plain_tensors(self.actor)

    def _ref_prefix_unbatchable(self, group_size: int) -> str:
        """Why the reference prefixes cannot run batched ahead of the suffixes ("" when they can): on several ranks
        a sharded reference gathers per forward, and the ranks' prompts fall in different numbers of length groups;
        a reference micro-batch smaller than a group scores a group in pieces, each taking the prefix again."""
        if self.reference is None:
            return "no reference model"
        if self.dp_size > 1 and not plain_tensors(self.reference):
            return "the reference is sharded across data-parallel ranks"
        size = self.settings.ref_micro_batch_size or self.settings.micro_batch_size
        if size < group_size:
            return f"reference micro-batches of {size} < a group's {group_size}"
        return ""

    def _graph_estimate(self) -> float:
        """Bytes per prompt token a fused prefill's whole graph holds, before it was measured: per decoder layer
        about 8 hidden-sized and 4 MLP-sized saved tensors (norms, q/k/v, attention output; gate, up, activation,
        product), a trainable tower's blocks likewise for the 4 patches of a merged token. An overestimate only
        fuses fewer prompts in the first step (7B: ~6 MiB per token; the H200 measured several MB)."""
        text, vision = self._block_graph_estimates()
        return self.actor.args.text.num_layers * text + self.actor.args.vision.depth * vision

    def _block_graph_estimates(self) -> tuple[float, float]:
        """(one decoder layer's, one trainable vision block's) whole graph in bytes per merged token (see
        _graph_estimate); the vision one 0 for a frozen tower."""
        args, size = self.actor.args, self.actor.output_weight.element_size()
        layer = lambda hidden, inter: (8 * hidden + 4 * inter) * size
        v = args.vision
        trainable = self._vision_trainable()
        vision = layer(v.hidden_size, v.intermediate_size) * v.spatial_merge_size ** 2 if trainable else 0
        return layer(args.text.hidden_size, args.text.intermediate_size), vision

    def _kv_bytes_per_token(self) -> int:
        """K and V of one prompt token over all decoder layers."""
        t = self.actor.args.text
        return 2 * t.num_layers * t.num_kv_heads * t.head_dim * self.actor.output_weight.element_size()

    def _compact_estimate(self) -> float:
        """Bytes per prompt token the compact form holds, before it was measured: the hidden state entering each
        decoder layer and its K/V, and (trainable tower) each vision block's input for the 4 patches a merged
        token has."""
        args, size = self.actor.args, self.actor.output_weight.element_size()
        text = args.text.hidden_size * args.text.num_layers * size + self._kv_bytes_per_token()
        v = args.vision
        vision = v.hidden_size * v.depth * v.spatial_merge_size ** 2 * size if self._vision_trainable() else 0
        return text + vision

    def run(self, prompts: list, answers: list[str], params: SamplingParams, *, sample_seeds=None,
            phase_timer=None) -> StepOutput:
        """One step. `phase_timer` (a components.metrics.PhaseTimer) also records each stage's time and peak
        memory; `sample_seeds` fixes each sample's random stream (see RolloutEngine.generate)."""
        schedule = self.plan(prompts, params)
        step = _Step(prompts, answers, params, sample_seeds, schedule,
                     Timeline(sync_cuda=self.device.type == "cuda"), PrefixStore(), VisionCache(), ExitStack())
        if schedule.mode != "serial":
            self.scorer.new_step(step.prefixes, step.vision)
        work = {Stage.VISION: self._vision, Stage.ROLLOUT: self._rollout, Stage.REF: self._reference,
                Stage.TRAIN: self._train}
        try:
            self._run_stages(step, work, phase_timer)
        except BaseException as e:  # nothing of a failed step stays alive (its held prefix graphs above all)
            # what it planned, what its stages peaked at, and (CUDA) what the failing stage measured up to the error:
            # its entry, its windows, the prefixes held (bytes, tokens per model), for the report of the failure
            schedule.memory["stage_peaks_measured"] = {**self._stage_peaks, **(
                {str(step.stage): self.windows.peak()} if self.windows.counter is not None else {})}
            if self.windows.counter is not None:
                schedule.memory["failed_stage_measured"] = {
                    "entry_bytes": self._stage_entry, "allocated_bytes": self.windows.counter.allocated(),
                    "windows_above_bytes": dict(self.windows.above), "windows_stayed_bytes": dict(self.windows.stayed),
                    "held_graph": [list(v) for v in step.prefixes.graph_bytes.values()],
                    "held_compact": [list(v) for v in step.prefixes.compact_bytes.values()],
                    "largest_held_batch_tokens": step.prefixes.largest_batch_tokens}
            step.prefixes.clear()
            if schedule.mode != "serial":  # the serial scorer holds nothing between steps (and has no new_step)
                self.scorer.new_step()
            self.failed_schedule = schedule
            e.add_note(f"in the {step.stage} stage of a step of {len(prompts)} prompts ({schedule.mode})")
            raise
        self._learn_unplanned(step)
        if id(self.actor) in step.prefixes.graph_bytes:
            nbytes, tokens = step.prefixes.graph_bytes[id(self.actor)]
            self._activation_bytes_per_token = nbytes / tokens
        if id(self.actor) in step.prefixes.compact_bytes:
            nbytes, tokens = step.prefixes.compact_bytes[id(self.actor)]
            self._compact_bytes_per_token = nbytes / tokens
        step.prefixes.clear()  # prefixes of groups dynamic sampling dropped: free their graphs
        if self.memory is not None:
            self.memory.close()
        return StepOutput(step.experience, step.result, schedule, step.timeline, step.prefixes, step.window_jobs)

    def _run_stages(self, step: _Step, work: dict, phase_timer) -> None:
        prompts, answers, schedule = step.prompts, step.answers, step.schedule
        self._stage_peaks = {}
        with step.gathers:
            for stage in schedule.stages():
                step.stage = stage
                with self._stage(stage, step.timeline, phase_timer):
                    work[stage](step)
                if stage is Stage.ROLLOUT:  # rewards and advantages: host work between the stages, timed in neither
                    step.experience = build_experience(prompts, answers, step.outputs, self.tokenizer,
                                                       self.settings.reward_names, self.settings.reward_weights,
                                                       self.settings.advantage, self.settings.dynamic_sampling,
                                                       self.device)

    def _learn_unplanned(self, step: _Step) -> None:
        """The rollout's and the reference's peak beyond their plans (the stage's residents and the prefixes the step
        really held) become the stage's `unplanned` bytes in the next plans (measured on CUDA only: `_stage_peaks`).
        Training's are measured against its entry and its windows instead (`_learn_train`): a micro-batch that
        skips its recompute uses what is left by design, and counted here that would shrink the held prefixes step
        after step."""
        residents = step.schedule.memory.get("residents", {})
        held = sum(b for b, _ in step.prefixes.graph_bytes.values()) + sum(
            b for b, _ in step.prefixes.compact_bytes.values())
        for stage in (Stage.ROLLOUT, Stage.REF):
            if stage in self._stage_peaks:
                planned = sum(b for g, b in residents.get(stage, {}).items() if g != UNPLANNED) + held
                self._unplanned_bytes[str(stage)] = max(0, self._stage_peaks[stage] - planned)
        step.schedule.memory["unplanned_measured"] = dict(self._unplanned_bytes)

    def plan(self, prompts: list, params: SamplingParams) -> Schedule:
        """This step's schedule, for what the engine declares it supports and what its memory budget leaves for
        held prefixes (raises memory_budget.BatchTooLargeError, before anything runs, when even the smallest
        forms do not fit)."""
        shape = self.shape(prompts, params)
        budget = self.memory_budget(shape, params)
        budget.check(f"a step of {len(prompts)} prompts x {params.n} samples of up to {params.max_new_tokens} tokens")
        schedule = plan_step(replace(shape, prefix_room_bytes=budget.room_bytes,
                                     train_room_bytes=budget.train_room_bytes), self.settings.plan,
                             self.engine.capabilities)
        schedule.memory = budget.to_dict()
        return schedule

    def memory_budget(self, shape: StepShape, params: SamplingParams) -> MemoryBudget:
        """The budget (PlanOptions.memory_budget_bytes, else the device's) and every group resident per stage. With
        kv_pool_from_budget, the engine's KV pool is sized here: what all groups need, as far as the room allows."""
        nbytes = _local_bytes
        actor = list(self.actor.parameters())
        trainable = [p for p in actor if p.requires_grad]
        ref_bytes = 0
        if self.reference is not None:  # a frozen tower shared with the actor is the actor's
            mine = {id(p) for p in actor}
            ref_bytes = nbytes(p for p in self.reference.parameters() if id(p) not in mine)
        t = self.actor.args.text
        mbs, n = self.settings.micro_batch_size, shape.group_size
        # the training micro-batch: its suffix graphs, the prefix graphs of its (unfused) prompts, fp32 logits
        rate = shape.activation_bytes_per_token
        train_act = self._train_activation_bytes
        tokens = mbs * shape.max_new_tokens + math.ceil(mbs / n) * max(shape.prompt_lengths)
        if train_act is None and is_checkpointed(self.actor):  # the recompute form, whatever memory.recompute: a
            # micro-batch skips the recompute only in what is left after the held prefixes (recompute_for)
            train_act = recompute_train_bytes(shape.compact_bytes_per_token, max(self._block_graph_estimates()),
                                              tokens, mbs * shape.max_new_tokens, t.vocab_size)
        elif train_act is None:
            train_act = math.ceil(rate * tokens + 4 * mbs * shape.max_new_tokens * t.vocab_size)
        # prefixes held in batches (fused into the rollout prefill, or batched in training) bring two more: their
        # gradients from the micro-batches, kept until the epoch's end, and the batched backward then (its
        # transient is the activations' peak when larger than a micro-batch's: the two never overlap)
        held_grads = 0
        cap = self._held_batch_cap()
        if cap:
            rate_back = self._prefix_backward_rate or prefix_backward_rate(max(self._block_graph_estimates()))
            # the rollout admits prompts in order; training batches them by length, data-parallel ranks in one batch
            lengths = shape.prompt_lengths if self.settings.plan.mode == "overlapped" else sorted(shape.prompt_lengths)
            bound = batch_token_bound(lengths, cap if self.dp_size == 1 else sum(lengths))
            train_act = max(train_act, math.ceil(rate_back * bound), self._prefix_forward_bytes)
            hidden_bytes = t.hidden_size * self.actor.output_weight.element_size()
            held_grads = held_gradient_bytes(shape.kv_bytes_per_token, hidden_bytes, shape.prefix_tokens)
        pool_group = getattr(self.engine, "pool_group_bytes", None)
        one_group = pool_group(n, max(shape.prompt_lengths), shape.max_new_tokens) if pool_group else 0
        groups = min(len(shape.prompt_lengths), max(1, getattr(self.engine, "max_batch", n) // n))
        pool = getattr(self.engine, "kv_pool_bytes", 0)
        managed = None
        if self.memory is not None:
            managed = {row.phase: row.peak_bytes for row in self.memory.plan.phases}
        capacity = self.settings.plan.memory_budget_bytes or device_capacity(self.device)
        residents = step_residents(actor_bytes=nbytes(actor), reference_bytes=ref_bytes,
                                   optimizer_bytes=2 * nbytes(trainable), grad_bytes=nbytes(trainable),
                                   kv_pool_bytes=0, train_activation_bytes=train_act, managed=managed)
        if held_grads:
            residents["train"][PREFIX_GRADS] = held_grads
        budget = MemoryBudget(capacity, residents)
        if self.settings.kv_pool_from_budget and one_group:
            pool = kv_pool_bytes(groups * one_group, one_group, budget.stage_bytes("rollout"), budget.usable_bytes)
            self.engine.kv_pool_bytes = pool
        if one_group and pool < one_group:
            pool = one_group  # the engine cannot run with less: counted so the check below names the keys
        if managed is None:
            residents["rollout"]["kv_pool"] = pool
        else:  # the part of a pool sized past what the memory plan was built with (kv_pool_gib 0)
            planned_pool = sum(g.nbytes for g in self.memory.plan.groups if g.name == "kv_pool")
            residents["rollout"]["kv_pool"] = max(0, pool - planned_pool)
        if holds_every_ref_prefix(shape, self.settings.plan):  # the REF_PREFIX phase's bytes
            residents["ref"]["ref_prefix_kv"] = shape.kv_bytes_per_token * shape.prefix_tokens
        for stage, nb in self._unplanned_bytes.items():  # measured by the last step (_learn_unplanned)
            residents[stage][UNPLANNED] = nb
        if self.windows.counter is not None and str(Stage.TRAIN) not in self._unplanned_bytes:
            residents["train"][UNPLANNED] = int(FIRST_TRAIN_UNPLANNED * capacity)  # until a step measures it
        plan = self.settings.plan
        # only where training's rounds hold what the cap leaves out (else those prompts would run their prefixes
        # per micro-batch: H200, 7B, 0.74-1.41 s each against 0.25-0.42 held)
        rounds = plan.batched_actor_prefix and self._train_rounds()
        if self._whole_graph_sizes and rounds and self.settings.recompute == "auto" and is_checkpointed(self.actor):
            smallest = shape.compact_bytes_per_token or shape.activation_bytes_per_token
            budget.held_cap_bytes, budget.held_cap = held_cap_for_whole_graphs(
                budget, self._whole_graph_sizes, [math.ceil(smallest * L) for L in shape.prompt_lengths],
                self._fuses_actor_prefix())
        return budget

    @contextmanager
    def _stage(self, stage: Stage, timeline: Timeline, phase_timer):
        with timeline.span(stage), (phase_timer.phase(stage) if phase_timer else nullcontext()):
            if self.memory is not None and stage in {row.phase for row in self.memory.plan.phases}:
                self.memory.enter(stage)  # waits for this stage's groups, starts the next stage's prefetches
            # the stage's peak (_learn_unplanned); training's windows inside it (_learn_train); the counters are the
            # allocator's host-side books, read without a device sync
            peaks = self.windows.counter is not None and stage in (Stage.ROLLOUT, Stage.REF, Stage.TRAIN)
            if peaks:
                self._stage_entry = self.windows.begin()
            yield
            if peaks:
                self._stage_peaks[str(stage)] = self.windows.peak()

    # ---- the stages ------------------------------------------------------------------------------------------
    def _vision(self, step: _Step) -> None:
        with torch.no_grad():
            self.scorer.visual_embeds(self.actor, step.prompts)  # fills the step's cache

    def _rollout(self, step: _Step) -> None:
        st, schedule = self.settings, step.schedule
        prefill = None
        if schedule.mode != "serial" and self.engine.capabilities.prefill_hook:
            prefill = rollout_prefill(schedule, self.scorer, self.actor, step.prefixes, step.prompts)
        jobs = step.window_jobs = DecodeWindowJobs(
            schedule, self.scorer, self.reference, step.prompts, step.params.n, st.plan.sample_batch(step.params.n),
            step.prefixes, self.window, step.timeline, st.temperature, self.device)
        # The window scores the reference beside decode: gathered from here through the ref stage (a no-op without
        # FSDP2 or window work)
        step.gathers.enter_context(gathered(self.reference if jobs.reads_reference else None))
        try:
            step.outputs = self.engine.generate(step.prompts, step.params, sample_seeds=step.sample_seeds,
                                                prefill_fn=prefill, **jobs.hooks())
        finally:
            jobs.finish()  # the window's results are read from here on
        self._record_demotions(step, step.schedule.prefix_forms)
        self.engine.release()
        reshard(self.actor)

    def _record_demotions(self, step: _Step, forms: list[PrefixChoice]) -> None:
        """`forms` (the schedule's rollout or training ones) as the fused prefill held them (overlap.fused_prefill
        demotes a prompt alone in its form in a prefill batch), each change with its reason."""
        changed = 0
        for i, c in enumerate(forms):
            planned, held = step.prefixes.demoted.get(id(step.prompts[c.prompt]), (c.form, c.form))
            if held == c.form:
                continue
            rate = self._compact_bytes_per_token or self._compact_estimate()
            forms[i] = replace(c, form=held, bytes=math.ceil(rate * c.tokens) if held == COMPACT else 0,
                               reason=f"planned {planned}, held {held}: alone in its form in its prefill batch, a "
                               "compiled forward of one prompt would compile anew (overlap.fused_prefill)")
            changed += 1
        if changed:
            step.schedule.reasons.append(f"{changed} prompt(s) held in a smaller form than planned: alone in their "
                                         "form in a prefill batch (overlap.fused_prefill)")

    def _reference(self, step: _Step) -> None:
        # Every rank scores all its samples here (equal numbers: the trainer gives ranks equal shares), so
        # per-forward FSDP2 gathers stay in step; with the window, how many are left differs between ranks,
        # and the reference is gathered once from the rollout on (distributed.fsdp.gathered).
        st = self.settings
        if step.schedule.ref_prefix_batched:  # the prompts whose samples the window did not all score
            g, scored = step.params.n, step.window_jobs.scored
            left = [p for i, p in enumerate(step.prompts) if any(i * g + j not in scored for j in range(g))]
            hold_prefixes(self.scorer, self.reference, left, step.prefixes)
        reference_phase(self.reference, self.scorer, step.experience, st.temperature,
                        st.ref_micro_batch_size or st.micro_batch_size,
                        step.schedule.mode != "serial", scored=step.window_jobs.scored)
        reshard(self.reference)
        step.gathers.close()

    def _train(self, step: _Step) -> None:
        st = self.settings
        choices = step.schedule.train_prefix_forms
        if self.dp_size > 1 and st.plan.batched_actor_prefix and step.schedule.mode == "decomposed":
            # data-parallel: one form for every prompt of every rank (agree_on_held_form), the dropped groups'
            # too, as the overlapped mode holds them: a rank pads its micro-batches with passes over its dropped
            # groups (equal_micro_batches), which must find their prefixes held to run the same FSDP2 collectives
            # as another rank's real micro-batches
            form = agree_on_held_form([c.form for c in choices], self.dp_group, self.device)
            held = {id(step.prompts[c.prompt]): form for c in choices} if form != NONE else {}
            if any(c.form != form for c in choices):
                step.schedule.reasons.append(f"actor prefixes in training held as {form} for every prompt: the "
                                             "data-parallel ranks' agreed form (memory_budget.agree_on_held_form)")
        else:
            keep = step.experience.keep_groups.tolist()
            held = {id(step.prompts[c.prompt]): c.form for c in choices if c.form != NONE and keep[c.prompt]}
        clock = SpanClock(self.device) if st.time_train else None
        timed = span_or_nothing(clock)
        # each prompt's round (memory_budget.choose_train_rounds; overlapped: the fused prompts are round 0); a
        # prompt held in none runs with the last round
        last = max((c.round for c in choices if c.form != NONE), default=0)
        rounds = [last] * len(step.prompts)
        for c in step.schedule.prefix_forms + choices:
            if c.form != NONE:
                rounds[c.prompt] = c.round
        prefill = fused_prefill(self.scorer, self.actor, step.prefixes, held) if held else None

        def hold_round(r: int) -> None:  # batched_actor_prefix: a round's kept prompts' actor prefixes in batched
            # forwards, held for epoch 0's micro-batches of the round
            prompts = [p for b, p in enumerate(step.prompts) if id(p) in held and rounds[b] == r]
            if not prompts:
                return
            # one batch per group of similar lengths (little padding held) of at most HELD_BATCH_TOKENS (their
            # backward's transient: memory_budget.batch_token_bound); data-parallel ranks run one batch each, as
            # their FSDP2 gathers must match in number whatever their prompts' lengths
            batches = ([b for g in length_groups(prompts) for b in token_batches(g, HELD_BATCH_TOKENS)]
                       if self.dp_size == 1 else [prompts])
            # its transient beyond what the batches keep held (growth: what stays allocated): the train stage's
            # peak when larger than a micro-batch's or the held batches' backward (_learn_train)
            stays = self.windows.counter.allocated if self.windows.counter is not None else None
            with timed("prefix_forward"), self.windows.window("prefix_forward", growth=stays):
                for batch in batches:
                    prefill(batch)

        if held:
            hold_round(0)
        step.result = train_phase(self.actor, self.scorer, step.experience, self.optimizer, self.lr_scheduler,
                                  st.loss, temperature=st.temperature, micro_batch_size=st.micro_batch_size,
                                  whole_groups=step.schedule.mode != "serial", ppo_epochs=st.ppo_epochs,
                                  grad_clip=st.grad_clip, max_len=step.params.max_new_tokens, dp_size=self.dp_size,
                                  dp_group=self.dp_group, recompute_for=self._recompute_for(step),
                                  windows=self.windows if self.windows.counter is not None else None,
                                  clock=clock, rounds=rounds if held and last else None, hold_round=hold_round)
        if held:  # every round's forms as they were held
            self._record_demotions(step, step.schedule.train_prefix_forms)
        if clock is not None:
            step.result.spans = clock.spans()
        step.schedule.memory.setdefault("recompute", {}).update(step.result.recompute)
        self._learn_train(step)

    def _learn_train(self, step: _Step) -> None:
        """What the train stage's windows measured (CUDA), for the next plans: the micro-batches' activations at
        the recompute form (a micro-batch that kept its whole graph used what was free by design, so it is not
        counted), the largest seen; the batched prefix backward's rate per padded token of the largest held batch;
        the batched prefix forward's transient; and the stage's peak outside those windows beyond its entry, the
        gradients and the prefixes held in training (the train stage's `unplanned` bytes)."""
        above = self.windows.above
        names = ("recompute",) if is_checkpointed(self.actor) else ("whole_graph", "micro_batch")
        act = max((above[n] for n in names if n in above), default=None)
        if act is not None:
            self._train_activation_bytes = max(act, self._train_activation_bytes or 0)
        if "prefix_backward" in above and step.prefixes.largest_batch_tokens:
            self._prefix_backward_rate = above["prefix_backward"] / step.prefixes.largest_batch_tokens
        if "prefix_forward" in above:
            self._prefix_forward_bytes = above["prefix_forward"]
        log = step.schedule.memory.get("recompute", {})
        if step.result.measured_bytes and "estimates" in log:
            log["measured"] = list(step.result.measured_bytes)  # beside each choice's estimate, in its order
            self._whole_graph_scale = whole_graph_scale(self._whole_graph_scale, log["estimates"],
                                                        step.result.measured_bytes, log["whole"])
        if log.get("held_estimates"):
            self._whole_graph_sizes = [math.ceil(e * self._graph_scale()) for e in log["held_estimates"]]
        if self.windows.counter is not None:  # and what peaked outside those windows (the stage's unplanned bytes)
            elastic = ("whole_graph",) if is_checkpointed(self.actor) else ()
            grads = _local_bytes(p for p in self.actor.parameters() if p.requires_grad)
            largest = max((b for n, b in above.items() if n not in elastic), default=0)
            rigid = self.windows.peak(excluding=elastic)
            # the batched prefixes (in the train room): the largest round's
            held = self.windows.stayed.get("prefix_forward", 0)
            self._unplanned_bytes[str(Stage.TRAIN)] = max(0, rigid - self._stage_entry - grads - held - largest)
        step.schedule.memory["train_measured"] = {
            **above, "largest_held_batch_tokens": step.prefixes.largest_batch_tokens,
            "prefix_forward_held": self.windows.stayed.get("prefix_forward", 0)}

    def _held_batch_cap(self) -> int:
        """The most padded tokens one batch of held prefixes takes (0: this runner holds none in batches): the
        rollout's prefill batch (overlapped, fused) or HELD_BATCH_TOKENS (batched_actor_prefix: decomposed's
        batches, overlapped's rounds in training), the larger where both apply."""
        plan, caps = self.settings.plan, [0]
        if self._fuses_actor_prefix():
            caps.append(getattr(self.engine, "prefill_tokens", HELD_BATCH_TOKENS))
        # decomposed's batched prefixes; overlapped's rounds in training for the prompts not fused
        rounds = plan.mode == "overlapped" and self._train_rounds()
        if plan.batched_actor_prefix and (plan.mode == "decomposed" or rounds):
            caps.append(HELD_BATCH_TOKENS)
        return max(caps)

    def _recompute_for(self, step: _Step):
        """The train phase's per-micro-batch choice (memory.recompute): "always" True; "auto" True unless the
        forward's whole graph (memory_budget.no_recompute_bytes over the tokens it runs: its responses at the
        decoder layers' rate, _block_graph_estimates', and the prefixes not held at the prefix graph's) fits in
        `_free_for_training` less the headroom. Each choice's
        estimate and the free bytes are kept in schedule.memory["recompute"]; an actor without checkpointed
        blocks has nothing to recompute (every forward counts as "off")."""
        if not is_checkpointed(self.actor):
            return lambda mb, req: False
        if self.settings.recompute == "always":
            return lambda mb, req: True
        rate = self._activation_bytes_per_token or self._graph_estimate()
        suffix_rate = self.actor.args.text.num_layers * self._block_graph_estimates()[0]
        vocab = self.actor.args.text.vocab_size
        serial = step.schedule.mode == "serial"
        t, size = self.actor.args.text, self.actor.output_weight.element_size()
        key_heads = suffix_key_heads(t.num_heads, t.num_kv_heads, t.head_dim, self.device,
                                     self.actor.output_weight.dtype)
        tp_group = _tp_group(self.actor)
        log = step.schedule.memory.setdefault("recompute", {})
        scale = self._graph_scale()
        log.update(bytes_per_token=rate, suffix_bytes_per_token=suffix_rate, scale=scale, estimates=[], free_bytes=[],
                   whole=[], held_estimates=[])

        def decide(mb, req) -> bool:
            responses = sum(req.host_lengths())
            if serial:  # every sample runs its whole prompt
                prefix = sum(len(req.prompts[i].input_ids) for i in req.prompt_index)
            else:
                prefix = sum(len(p.input_ids) for p in req.prompts if not self.scorer.store.has(self.actor, p))
            est = no_recompute_bytes(rate, prefix, suffix_rate, responses, vocab)
            if not serial:  # the suffixes' packed keys: each sample's prompt rows and its own tokens
                keys = sum(len(req.prompts[i].input_ids) for i in req.prompt_index) + responses
                key_bytes = packed_key_bytes(keys, t.num_layers, key_heads, t.head_dim, size)
                est += key_bytes
                # the same forward with its prefixes held: what the next plans keep room for
                log["held_estimates"].append(no_recompute_bytes(rate, 0, suffix_rate, responses, vocab) + key_bytes)
            free, margin = self._free_for_training(step)
            log["estimates"].append(est)  # unscaled: what whole_graph_scale compares the measured bytes with
            log["free_bytes"].append(free - margin)
            on = agree_on_recompute(needs_recompute(math.ceil(est * scale), free, margin), tp_group, self.device)
            log["whole"].append(not on)
            return on

        return decide

    def _graph_scale(self) -> float:
        """The factor on the whole-graph estimates: the learned one (memory_budget.whole_graph_scale); before a kept
        graph was measured, FIRST_WHOLE_GRAPH_SCALE where stages are measured (CUDA), else 1 (nothing will be)."""
        if self._whole_graph_scale is not None:
            return self._whole_graph_scale
        return FIRST_WHOLE_GRAPH_SCALE if self.windows.counter is not None else 1.0

    def _free_for_training(self, step: _Step) -> tuple[int, int]:
        """(free bytes now, margin) for a training forward. CUDA: the device's free memory plus the allocator's
        cached blocks (within memory.budget_gib when set), less the gradients the forward's backward will create
        (before the step's first backward, every one: H200, 7B, the first micro-batch found 15.4 GiB more free than
        the next), margin 5 % of the capacity; CPU: the budget less what it counts resident in training (activations
        aside; the gradients whole) and the held prefixes."""
        mem = step.schedule.memory
        capacity = mem["capacity_bytes"]
        if self.device.type == "cuda":
            free, total = torch.cuda.mem_get_info(self.device)
            allocated = torch.cuda.memory_allocated(self.device)
            free += torch.cuda.memory_reserved(self.device) - allocated
            # the gradients the next backward creates (a DTensor's: this rank's shard)
            pending = _local_bytes(p for p in self.actor.parameters() if p.requires_grad and p.grad is None)
            if self.settings.plan.memory_budget_bytes:
                return min(free, capacity - allocated) - pending, int(HEADROOM * capacity)
            return free - pending, int(HEADROOM * total)
        resident = sum(b for g, b in mem["residents"]["train"].items() if g != "activations")
        held = sum(c.bytes for c in step.schedule.prefix_forms) + held_at_once_bytes(step.schedule.train_prefix_forms)
        return capacity - resident - held, int(HEADROOM * capacity)
