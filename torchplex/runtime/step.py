"""One synchronous GRPO step, top to bottom:

    plan       the step's plan (runtime/plan.py) from its shape and the memory estimate (memory_estimate.py)
    vision     a frozen tower encodes each prompt once, for every phase (prefix modes)
    rollout    the engine samples G responses per prompt; its prefill holds the fused actor prefixes, its decode
               window runs the reference work the plan places there (runtime/window.py)
    rewards    rewards and group advantages: the step's Experience
    reference  the reference's log-probs of what the window did not score (serial: full forwards)
    train      old-policy log-probs, losses, backward and the optimizer step (runtime/training.py), with the actor
               prefixes the plan holds in training
Every phase reads its decisions from the plan and writes what it measured into the step's report (`StepReport`), from
which the memory estimate learns (`MemoryEstimator.observe`). The same phase code runs in every mode:
    serial       rollout -> reference (full forwards) -> train (full forwards)
    decomposed   [vision] -> rollout -> reference (prefix once per prompt + suffixes) -> train (likewise)
    overlapped   decomposed, plus the actor prefix fused into the rollout prefill and window work where planned
The numbers do not depend on where a phase ran: tests hold overlapped and decomposed to serial.
"""

from __future__ import annotations

from contextlib import ExitStack, contextmanager, nullcontext
from dataclasses import dataclass, field, replace

import torch

from ..components.captured_step import plain_tensors
from ..components.peak_memory import PeakWindows
from ..distributed.data_parallel import fewest_over_ranks
from ..distributed.fsdp import gathered, reshard
from ..models.qwen2_5_vl.parallelize import wrap_blocks
from ..rollout.sampling import SamplingParams
from .decomposition import DecomposedScorer, VisionCache
from .experience import Experience, MicroBatchLimits, build_experience, reference_phase
from .held_prefixes import TrainPrefixes, held_forms_after_prefill
from .memory_budget import PrefixChoice
from .memory_estimate import MemoryEstimator, StepFootprint
from .phases import PhaseName, Stage
from .plan import StepPlan, StepShape, plan_step
from .prefixes import PrefixStore, fused_prefill, hold_prefixes
from .scoring import SerialScorer, TokenCounts
from .settings import StepSettings
from .timeline import Timeline
from .training import TrainMemory, TrainPhase, TrainResult, TrainSettings
from .window import DecodeWindowJobs, WindowWorker


@dataclass
class StepReport:
    """What one step measured, beside its plan: the stages' peaks, the holding forms the prefill really used, the
    decode window's jobs, training's recompute choices and memory windows, the scoring's token counts."""

    held_forms: list[PrefixChoice] = field(default_factory=list)
    held_train_forms: list[PrefixChoice] = field(default_factory=list)
    stage_peaks: dict[str, int] = field(default_factory=dict)
    recompute: dict = field(default_factory=dict)
    footprint: StepFootprint = field(default_factory=StepFootprint)
    tokens: TokenCounts = field(default_factory=TokenCounts)
    serial_equivalent_tokens: int = 0  # what the serial step would have scored for the same samples
    reasons: list[str] = field(default_factory=list)  # what ran differently from the plan, and why


@dataclass
class StepOutput:
    experience: Experience
    train: TrainResult
    plan: StepPlan
    report: StepReport
    timeline: Timeline
    prefixes: PrefixStore  # the step's held prefixes (emptied at its end; peaks kept)
    window_jobs: DecodeWindowJobs | None = None


@dataclass
class _State:
    """One step's inputs and what its phases produced, as they run."""

    prompts: list
    answers: list[str]
    params: SamplingParams
    sample_seeds: object
    plan: StepPlan
    report: StepReport
    timeline: Timeline
    prefixes: PrefixStore
    gathers: ExitStack  # the reference gathered from the rollout through the ref stage, when the window reads it
    window_jobs: DecodeWindowJobs | None = None
    outputs: list | None = None
    experience: Experience | None = None
    result: TrainResult | None = None
    stage: str = "plan"  # the phase running (a failing step's error names it)


def _tp_group(model):
    """The tensor-parallel process group of a TP'd actor (its decoder weights are DTensors on a mesh with a "tp"
    axis), else None."""
    mesh = getattr(model.layers[0].attention.wq.weight, "device_mesh", None)
    if mesh is None or "tp" not in (mesh.mesh_dim_names or ()):
        return None
    return mesh["tp"].get_group()


class GRPOStep:
    def __init__(self, actor, reference, engine, optimizer, lr_scheduler, tokenizer, settings: StepSettings,
                 memory: MemoryEstimator, *, pad_id: int = 0, dp_size: int = 1, dp_group=None, residency=None):
        self.actor, self.reference, self.engine, self.tokenizer = actor, reference, engine, tokenizer
        self.settings, self.memory, self.residency = settings, memory, residency
        self.dp_size, self.dp_group = dp_size, dp_group
        wrap_blocks(actor)  # the compact prefix form checkpoints the actor's blocks (parallelize.keep_block_inputs)
        serial = settings.plan.mode == "serial"
        self.scorer = SerialScorer(pad_id) if serial else DecomposedScorer(pad_id, settings.checkpoint_prefix)
        self.device = next(actor.parameters()).device
        self.window = WindowWorker(self.device)
        self.windows = PeakWindows.for_device(self.device)  # the allocator's counters (CUDA; None elsewhere)
        self.train_phase = TrainPhase(actor, self.scorer, optimizer, lr_scheduler, TrainSettings(
            settings.loss, settings.temperature, MicroBatchLimits(shares_prefix=not serial), settings.ppo_epochs,
            settings.grad_clip, 1, dp_size, dp_group))
        self.failed_plan: StepPlan | None = None  # the last failed step's, with what it measured

    @property
    def optimizer(self):
        return self.train_phase.optimizer

    def limits(self, s: _State, tokens: int, training: bool) -> MicroBatchLimits:
        """Training's or reference scoring's micro-batch limits at `tokens` per micro-batch (the plan's budget).
        Data-parallel prefix modes cut by sequences instead, as many on every rank (the fewest full-length responses
        any rank's budget holds): a micro-batch runs the sharded prefix forwards of the prompts it does not hold, and
        a group cut into pieces takes its held prefix in the first only, so the ranks' micro-batches must have the
        same groups and pieces for their FSDP2 collectives to match (responses cut by tokens differ per rank)."""
        st = self.settings
        sequences = st.micro_batch_size if training else st.ref_micro_batch_size or st.micro_batch_size
        if self.dp_size == 1 or st.plan.mode == "serial":
            return MicroBatchLimits(tokens, sequences, shares_prefix=st.plan.mode != "serial")
        fit = fewest_over_ranks(max(1, tokens // s.params.max_new_tokens), self.device, self.dp_group)
        return MicroBatchLimits(0, min(fit, sequences or fit), shares_prefix=True)

    def vision_trainable(self) -> bool:
        return any(p.requires_grad for p in self.actor.visual.parameters())

    # ---- plan ---------------------------------------------------------------------------------------------------
    def shape(self, prompts, params: SamplingParams) -> StepShape:
        return StepShape(prompt_lengths=tuple(len(p.input_ids) for p in prompts), group_size=params.n,
                         max_new_tokens=params.max_new_tokens, has_reference=self.reference is not None,
                         vision_trainable=self.vision_trainable(), ppo_epochs=self.settings.ppo_epochs,
                         kv_bytes_per_token=self.memory.fp.kv_bytes_per_token,
                         activation_bytes_per_token=self.memory.graph_rate(),
                         compact_bytes_per_token=self.memory.compact_rate(),
                         ref_prefix_batchable=self._ref_prefix_unbatchable(params), device=self.device.type,
                         train_rounds=self.memory.fp.train_rounds)

    def plan(self, prompts, params: SamplingParams) -> StepPlan:
        """This step's plan, for what the engine declares it supports and what the memory estimate leaves for held
        prefixes (raises memory_budget.BatchTooLargeError, before anything runs, when even the smallest forms do
        not fit)."""
        shape = self.shape(prompts, params)
        budget = self.memory.estimate(shape, self.settings.plan)
        budget.check(f"a step of {len(prompts)} prompts x {params.n} samples of up to {params.max_new_tokens} tokens")
        plan = plan_step(replace(shape, prefix_room_bytes=budget.room_bytes, train_room_bytes=budget.train_room_bytes),
                         self.settings.plan, self.engine.capabilities)
        plan.budget = budget
        return plan

    def _ref_prefix_unbatchable(self, params: SamplingParams) -> str:
        """Why the reference prefixes cannot run batched ahead of the suffixes ("" when they can): on several ranks
        a sharded reference gathers per forward, and the ranks' prompts fall in different numbers of length groups;
        reference micro-batches that may cut a group (fewer sequences than a group, or a configured token budget
        below a group of full-length responses) score it in pieces, each taking the prefix again (a derived budget
        holds a group: MemoryEstimator.estimate)."""
        if self.reference is None:
            return "no reference model"
        if self.dp_size > 1 and not plain_tensors(self.reference):
            return "the reference is sharded across data-parallel ranks"
        st, g = self.settings, params.n
        size = st.ref_micro_batch_size or st.micro_batch_size
        if size and size < g:
            return f"reference micro-batches of {size} sequences < a group's {g}"
        if st.ref_micro_batch_tokens and st.ref_micro_batch_tokens < g * params.max_new_tokens:
            return (f"reference micro-batches of {st.ref_micro_batch_tokens} tokens may cut a group of {g} x "
                    f"{params.max_new_tokens}")
        return ""

    # ---- the step -----------------------------------------------------------------------------------------------
    def run(self, prompts: list, answers: list[str], params: SamplingParams, *, sample_seeds=None,
            phase_timer=None) -> StepOutput:
        """One step. `phase_timer` (components.metrics.PhaseTimer) also records each stage's time and peak memory;
        `sample_seeds` fixes each sample's random stream (see RolloutEngine.generate)."""
        plan = self.plan(prompts, params)
        s = _State(prompts, answers, params, sample_seeds, plan, StepReport(held_forms=list(plan.prefix_forms)),
                   Timeline(sync_cuda=self.device.type == "cuda"), PrefixStore(), ExitStack())
        if plan.mode != "serial":
            self.scorer.new_step(s.prefixes, VisionCache())
        stages = plan.stages()
        try:
            with s.gathers:
                if Stage.VISION in stages:
                    self._phase(s, Stage.VISION, phase_timer, self._vision)
                self._phase(s, Stage.ROLLOUT, phase_timer, self._rollout)
                s.experience = self._rewards(s)
                if Stage.REF in stages:
                    self._phase(s, Stage.REF, phase_timer, self._reference)
                self._phase(s, Stage.TRAIN, phase_timer, self._train)
        except BaseException as e:  # nothing of a failed step stays alive (its held prefix graphs above all)
            self._failed(s, e)
            raise
        return self._finish(s)

    @contextmanager
    def _stage(self, s: _State, stage: Stage, phase_timer):
        s.stage = str(stage)
        with s.timeline.span(stage), (phase_timer.phase(stage) if phase_timer else nullcontext()):
            if self.residency is not None and stage in {row.phase for row in self.residency.plan.phases}:
                self.residency.enter(stage)  # waits for this stage's groups, starts the next stage's prefetches
            measured = self.windows.counter is not None and stage is not Stage.VISION
            entry = self.windows.begin() if measured else 0
            if stage is Stage.TRAIN:
                s.report.footprint.train_entry = entry
            yield
            if measured:
                s.report.stage_peaks[str(stage)] = self.windows.peak()

    def _phase(self, s: _State, stage: Stage, phase_timer, work) -> None:
        with self._stage(s, stage, phase_timer):
            work(s)

    def _vision(self, s: _State) -> None:
        with torch.no_grad():
            self.scorer.visual_embeds(self.actor, s.prompts)  # fills the step's cache

    def _rollout(self, s: _State) -> None:
        plan, st = s.plan, self.settings
        prefill = None
        if plan.mode != "serial" and self.engine.capabilities.prefill_hook:
            prefill = (fused_prefill(self.scorer, self.actor, s.prefixes,
                                     {id(s.prompts[c.prompt]): c.form for c in plan.prefix_forms})
                       if plan.fuses_actor_prefix else self.scorer.rollout_prefill(self.actor))
        jobs = s.window_jobs = DecodeWindowJobs(
            plan.in_window(PhaseName.REF_PREFIX), plan.in_window(PhaseName.REF_SUFFIX), self.scorer, self.reference,
            s.prompts, s.params.n, st.plan.sample_batch(s.params.n), s.prefixes, self.window, s.timeline,
            st.temperature, self.device)
        # the window scores the reference beside decode: gathered from here through the ref stage (a no-op without
        # FSDP2 or window work)
        s.gathers.enter_context(gathered(self.reference if jobs.reads_reference else None))
        if st.kv_pool_from_budget:  # the pool the plan was sized with (rollout.kv_pool_gib 0)
            self.engine.kv_pool_bytes = plan.budget.kv_pool_bytes
        try:
            s.outputs = self.engine.generate(s.prompts, s.params, sample_seeds=s.sample_seeds, prefill_fn=prefill,
                                             **jobs.hooks())
        finally:
            jobs.finish()  # the window's results are read from here on
        s.report.held_forms = held_forms_after_prefill(plan.prefix_forms, s.prompts, s.prefixes,
                                                       self.memory.compact_rate(), s.report.reasons)
        self.engine.release()
        reshard(self.actor)

    def _rewards(self, s: _State) -> Experience:
        """Rewards and group advantages: host work between the rollout and the reference, timed in neither."""
        st = self.settings
        s.stage = "rewards"
        return build_experience(s.prompts, s.answers, s.outputs, self.tokenizer, st.reward_names, st.reward_weights,
                                st.advantage, st.dynamic_sampling, self.device)

    def _reference(self, s: _State) -> None:
        # Every rank scores all its samples here, in as many forwards as the rank with the most (reference_phase), so
        # per-forward FSDP2 gathers stay in step; with the window, how many are left differs between ranks, and the
        # reference is gathered once from the rollout on (distributed.fsdp.gathered).
        st = self.settings
        if s.plan.ref_prefix_batched:  # the prompts whose samples the window did not all score
            g, scored = s.params.n, s.window_jobs.scored
            left = [p for i, p in enumerate(s.prompts) if any(i * g + j not in scored for j in range(g))]
            hold_prefixes(self.scorer, self.reference, left, s.prefixes)
        # a reference sharded over the ranks and not gathered for the window gathers in every forward: the ranks'
        # micro-batches, cut by tokens, are evened out in number
        sharded = self.dp_size > 1 and not plain_tensors(self.reference) and not s.window_jobs.reads_reference
        limits = self.limits(s, s.plan.budget.ref_micro_batch_tokens, training=False)
        reference_phase(self.reference, self.scorer, s.experience, st.temperature, limits, scored=s.window_jobs.scored,
                        dp_group=self.dp_group if sharded else None)
        reshard(self.reference)
        s.gathers.close()

    def _train(self, s: _State) -> None:
        held = TrainPrefixes(self.scorer, self.actor, s.prompts, s.plan, s.report.held_forms,
                             s.experience.keep_groups.tolist(), s.prefixes, self.windows, self.memory.compact_rate(),
                             s.report.reasons, dp_size=self.dp_size, dp_group=self.dp_group, device=self.device,
                             batched_actor_prefix=self.settings.plan.batched_actor_prefix)
        log = s.report.recompute
        recompute_for = self.memory.recompute_policy(
            s.plan.mode == "serial", lambda p: self.scorer.store.has(self.actor, p), _tp_group(self.actor),
            s.plan.budget, s.plan.held_bytes(), log)
        windows = self.windows if self.windows.counter is not None else None
        self.train_phase.s = replace(self.train_phase.s, max_len=s.params.max_new_tokens,
                                     limits=self.limits(s, s.plan.budget.micro_batch_tokens, training=True))
        held.hold_round(0)
        s.result = self.train_phase.run(s.experience, TrainMemory(
            recompute_for=recompute_for, windows=windows, rounds=held.rounds if held.in_rounds else None,
            hold_round=held.hold_round))
        log.update(s.result.recompute)  # how many forwards recomputed and how many kept their graph
        s.report.held_train_forms = held.held_train_forms
        if windows is not None:
            self._measure_train(s, held)

    def _measure_train(self, s: _State, held: "TrainPrefixes") -> None:
        """Training's windows for the memory estimate: each one's peak above what it found, what stayed, the
        stage's peak outside the whole-graph windows, the largest held batch, each kept graph's measured bytes."""
        fp, above = s.report.footprint, self.windows.above
        elastic = ("whole_graph",) if self.memory.fp.checkpointed else ()
        fp.train_above, fp.train_stayed = dict(above), dict(self.windows.stayed)
        fp.train_rigid_peak = self.windows.peak(excluding=elastic)
        fp.largest_held_batch_tokens = s.prefixes.largest_batch_tokens
        if s.result.measured_bytes and "estimates" in s.report.recompute:
            s.report.recompute["measured"] = list(s.result.measured_bytes)

    # ---- after the step -----------------------------------------------------------------------------------------
    def _finish(self, s: _State) -> StepOutput:
        """The step's report (what the memory estimate learns from), its held prefixes freed."""
        report = s.report
        fp = report.footprint
        fp.graph = s.prefixes.graph_bytes.get(id(self.actor))
        fp.compact = s.prefixes.compact_bytes.get(id(self.actor))
        fp.held_bytes = (sum(b for b, _ in s.prefixes.graph_bytes.values())
                         + sum(b for b, _ in s.prefixes.compact_bytes.values()))
        fp.stage_peaks = {k: v for k, v in report.stage_peaks.items() if k in ("rollout", "ref")}
        fp.planned = s.plan.budget.residents if s.plan.budget else {}
        fp.recompute = report.recompute
        self.memory.observe(fp)
        report.tokens, report.serial_equivalent_tokens = self.scorer.take_counts()
        s.prefixes.clear()  # prefixes of groups dynamic sampling dropped: free their graphs
        if self.residency is not None:
            self.residency.close()
        return StepOutput(s.experience, s.result, s.plan, report, s.timeline, s.prefixes, s.window_jobs)

    def _failed(self, s: _State, e: BaseException) -> None:
        """A failed step: its held prefixes freed, its plan kept with the stages' peaks (CUDA: the failing stage's
        up to the error) for the failure's report, the error noted with the stage that raised it."""
        if self.windows.counter is not None:
            s.report.stage_peaks[s.stage] = self.windows.peak()
        self.failed_plan = s.plan
        self.failed_report = s.report
        s.prefixes.clear()
        self.scorer.new_step()
        self.scorer.take_counts()
        e.add_note(f"in the {s.stage} stage of a step of {len(s.prompts)} prompts ({s.plan.mode})")

    def close(self) -> None:
        self.window.close()
        if self.residency is not None:
            self.residency.close()
