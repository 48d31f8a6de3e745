"""The step executor: runs a planner schedule with the same phase code in every mode.

serial       rollout -> reference (full forwards) -> train (full forwards)
decomposed   [vision] -> rollout -> reference (prefix once per prompt + suffixes) -> train (likewise)
overlapped   decomposed, plus what the schedule moves: the actor prefix fused into the rollout prefill (its graph
             is held and consumed by the first training epoch) and the reference prefix computed in the decode
             window, one prompt per decode step, on a side CUDA stream (events order it before the reference
             suffixes); on CPU the slices run in program order between decode steps.
The numbers do not depend on where a phase ran: tests/test_overlap.py holds overlapped to decomposed.
"""

from __future__ import annotations

from collections import deque
from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field

import torch

from ..models.qwen2_5_vl.parallelize import reshard
from ..rl.losses import PolicyLossConfig
from ..rollout.sampling import SamplingParams
from .decomposition import DecomposedScorer
from .grpo_step import Experience, TrainResult, build_experience, reference_phase, train_phase
from .planner import PlanOptions, Schedule, StepShape, plan_step
from .prefix_graphs import PrefixGraphs, graphs_supported
from .scoring import SerialScorer
from .timeline import Timeline


@dataclass
class StepSettings:
    reward_names: list[str]
    reward_weights: list[float]
    advantage: str = "grpo"
    dynamic_sampling: bool = False
    temperature: float = 1.0
    micro_batch_size: int = 8
    ppo_epochs: int = 1
    grad_clip: float = 1.0
    loss: PolicyLossConfig = field(default_factory=PolicyLossConfig)
    plan: PlanOptions = field(default_factory=PlanOptions)
    checkpoint_prefix: bool = False  # activation checkpointing of the prompt prefix forward


@dataclass
class StepOutput:
    experience: Experience
    train: TrainResult
    schedule: Schedule
    timeline: Timeline


class StepRunner:
    def __init__(self, actor, reference, engine, optimizer, lr_scheduler, tokenizer, settings: StepSettings,
                 *, pad_id: int = 0, dp_size: int = 1, dp_group=None, memory=None):
        self.actor, self.reference, self.engine = actor, reference, engine
        self.optimizer, self.lr_scheduler, self.tokenizer = optimizer, lr_scheduler, tokenizer
        self.settings = settings
        self.dp_size, self.dp_group = dp_size, dp_group
        self.memory = memory  # runtime.memory.MemoryManager: residency of tensor groups per phase
        if memory is not None and settings.plan.ref_prefix_in_window:
            raise ValueError("ref_prefix_in_window reads the reference weights during rollout, but the memory plan "
                             "keeps them on the device only in the ref phase; use one or the other")
        mode = settings.plan.mode
        self.scorer = (SerialScorer(pad_id) if mode == "serial"
                       else DecomposedScorer(pad_id, checkpoint_prefix=settings.checkpoint_prefix))
        if settings.plan.ref_prefix_graphs and mode != "serial" and reference is not None:
            if not graphs_supported(reference):
                raise ValueError("runtime.ref_prefix_graphs needs a reference model of plain tensors (tp 1, not FSDP2-"
                                 "sharded); turn it off for this parallelism")
            self.scorer.prefix_graphs[id(reference)] = PrefixGraphs(reference)
        self.device = next(actor.parameters()).device
        self.side_stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None

    def shape(self, prompts, params: SamplingParams) -> StepShape:
        t = self.actor.args.text
        kv = 2 * t.num_layers * t.num_kv_heads * t.head_dim * self.actor.output_weight.element_size()
        return StepShape(prompt_lengths=tuple(len(p.input_ids) for p in prompts), group_size=params.n,
                         max_new_tokens=params.max_new_tokens, has_reference=self.reference is not None,
                         vision_trainable=any(p.requires_grad for p in self.actor.visual.parameters()),
                         ppo_epochs=self.settings.ppo_epochs, kv_bytes_per_token=kv,
                         activation_bytes_per_token=kv * 8, device=self.device.type)

    def run(self, prompts: list, answers: list[str], params: SamplingParams, *, sample_seeds=None,
            phase_timer=None) -> StepOutput:
        """One step. `phase_timer` (a components.metrics.PhaseTimer) also records each main phase's time and
        peak memory; `sample_seeds` fixes each sample's random stream (see RolloutEngine.generate)."""
        st = self.settings
        schedule = plan_step(self.shape(prompts, params), st.plan)
        timeline = Timeline(sync_cuda=self.device.type == "cuda")

        @contextmanager
        def phase(name):
            with timeline.span(name), (phase_timer.phase(name) if phase_timer else nullcontext()):
                if self.memory is not None and name in {row.phase for row in self.memory.plan.phases}:
                    self.memory.enter(name)  # waits for this phase's groups, starts the next phase's prefetches
                yield

        decomposed = schedule.mode != "serial"
        if decomposed:
            self.scorer.new_step()
        if schedule.has("vision"):
            with phase("vision"), torch.no_grad():
                self.scorer.visual_embeds(self.actor, prompts)  # fills the step's cache

        prefill = None
        if decomposed:
            fused = schedule.has("actor_prefix") and schedule.phase("actor_prefix").placement == "fused:rollout"
            prefill = self.scorer.rollout_prefill(self.actor, keep_for_training=fused)
        window = deque()
        if schedule.has("ref_prefix") and schedule.phase("ref_prefix").placement.startswith("window"):
            window.extend(prompts)

        def on_step(info):
            if window:  # one prompt's reference prefix per decode step
                prompt = window.popleft()
                with timeline.span("ref_prefix", lane="window", sync=False), self._side():
                    self.scorer.compute_and_hold(self.reference, prompt)

        with phase("rollout"):
            outputs = self.engine.generate(prompts, params, sample_seeds=sample_seeds, prefill_fn=prefill,
                                           on_step=on_step if window else None)
            self.engine.release()
        while window:  # decode ended before every slice ran: finish them now
            on_step(None)
        if self.side_stream is not None:
            torch.cuda.current_stream().wait_stream(self.side_stream)
        reshard(self.actor)

        exp = build_experience(prompts, answers, outputs, self.tokenizer, st.reward_names, st.reward_weights,
                               st.advantage, st.dynamic_sampling, self.device)
        if self.reference is not None:
            with phase("ref"):
                reference_phase(self.reference, self.scorer, exp, st.temperature, st.micro_batch_size, decomposed)
                reshard(self.reference)
        with phase("train"):
            result = train_phase(self.actor, self.scorer, exp, self.optimizer, self.lr_scheduler, st.loss,
                                 temperature=st.temperature, micro_batch_size=st.micro_batch_size,
                                 whole_groups=decomposed, ppo_epochs=st.ppo_epochs, grad_clip=st.grad_clip,
                                 max_len=params.max_new_tokens, dp_size=self.dp_size, dp_group=self.dp_group)
        if decomposed:
            self.scorer.store.clear()  # prefixes of groups dynamic sampling dropped: free their graphs
        if self.memory is not None:
            self.memory.close()
        return StepOutput(exp, result, schedule, timeline)

    def _side(self):
        if self.side_stream is None:
            return nullcontext()
        self.side_stream.wait_stream(torch.cuda.current_stream())
        return torch.cuda.stream(self.side_stream)
