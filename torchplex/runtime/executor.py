"""The step executor: runs a planner schedule with the same phase code in every mode.

serial       rollout -> reference (full forwards) -> train (full forwards)
decomposed   [vision] -> rollout -> reference (prefix once per prompt + suffixes) -> train (likewise)
overlapped   decomposed, plus what the schedule moves: the actor prefix fused into the rollout prefill (its graph
             is held and consumed by the first training epoch); the reference prefixes, and the reference
             log-probs of samples as soon as they have finished, computed in the decode window
             (runtime/window.py: a second host thread, its CUDA work on a side stream ordered by events); on CPU
             the window's jobs run in program order when they are submitted.
The numbers do not depend on where a phase ran: tests/test_overlap.py holds overlapped to decomposed.
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field

import torch

from ..components.captured_step import plain_tensors
from ..distributed.fsdp import gathered, reshard
from ..rl.losses import PolicyLossConfig
from ..rollout.sampling import SamplingParams
from .decomposition import DecomposedScorer
from .grpo_step import (Experience, TrainResult, build_experience, reference_phase, request_from_outputs,
                        train_phase)
from .planner import PlanOptions, Schedule, StepShape, plan_step
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
        if memory is not None and (settings.plan.ref_prefix_in_window or settings.plan.ref_suffix_in_window):
            raise ValueError("ref_prefix_in_window/ref_suffix_in_window read the reference weights during rollout, "
                             "but the memory plan keeps them on the device only in the ref phase; use one or the "
                             "other")
        mode = settings.plan.mode
        self.scorer = (SerialScorer(pad_id) if mode == "serial"
                       else DecomposedScorer(pad_id, checkpoint_prefix=settings.checkpoint_prefix))
        if settings.plan.ref_prefix_graphs and mode != "serial" and reference is not None:
            if not plain_tensors(reference):
                raise ValueError("runtime.ref_prefix_graphs needs a reference model of plain tensors (tp 1, not FSDP2-"
                                 "sharded); turn it off for this parallelism")
            self.scorer.prefix_graphs[id(reference)] = PrefixGraphs(reference)
        self.device = next(actor.parameters()).device
        self.window = WindowWorker(self.device)

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
        in_window = lambda name: schedule.has(name) and schedule.phase(name).placement.startswith("window")
        ref_scored: dict[int, torch.Tensor] = {}  # sample -> its reference log-probs, scored in the window
        submitted: set[int] = set()  # prompts whose reference prefix job is queued

        def ref_prefix_job(i: int) -> None:
            if i not in submitted:
                submitted.add(i)
                self.window.submit(lambda p=prompts[i]: self._window_ref_prefix(p, timeline))

        on_step = on_samples_finished = None
        if in_window("ref_prefix"):
            def on_step(info):
                if info.step == 1:  # decode has begun: the prompts' prefills are done
                    for i in range(len(prompts)):
                        ref_prefix_job(i)
        if in_window("ref_suffix"):
            # A job per `batch` finished samples of a prompt, and one for its last ones: each job is an eager forward
            # whose host cost hardly depends on its size, so fewer, larger jobs leave decode more of the host.
            batch = st.plan.sample_batch(params.n)
            pending: dict[int, list] = {}
            finished_count = [0] * len(prompts)

            def on_samples_finished(outputs):
                for o in outputs:
                    i = o.prompt_index
                    pending.setdefault(i, []).append(o)
                    finished_count[i] += 1
                    if len(pending[i]) >= batch or finished_count[i] == params.n:
                        outs = pending.pop(i)
                        ref_prefix_job(i)  # queued before its samples' job: the window runs jobs in order
                        self.window.submit(lambda i=i, outs=outs: self._window_ref_samples(
                            prompts, i, params.n, outs, ref_scored, timeline))

        # The window scores the reference beside decode: gathered from here on (a no-op without FSDP2 or window)
        with gathered(self.reference if in_window("ref_prefix") or in_window("ref_suffix") else None):
            with phase("rollout"):
                try:
                    outputs = self.engine.generate(prompts, params, sample_seeds=sample_seeds, prefill_fn=prefill,
                                                   on_step=on_step, on_samples_finished=on_samples_finished)
                finally:
                    self.window.finish()  # the window's results are read from here on
                self.engine.release()
                for i, prompt in enumerate(prompts):  # a prompt whose samples were all scored needs its prefix no more
                    if all(i * params.n + j in ref_scored for j in range(params.n)):
                        self.scorer.store.discard(self.reference, prompt)
            reshard(self.actor)

            exp = build_experience(prompts, answers, outputs, self.tokenizer, st.reward_names, st.reward_weights,
                                   st.advantage, st.dynamic_sampling, self.device)
            if self.reference is not None:
                # Every rank scores all its samples here (equal numbers: the trainer gives ranks equal shares), so
                # per-forward FSDP2 gathers stay in step; with the window, how many are left differs between ranks,
                # and the reference is gathered once from the rollout on (distributed.fsdp.gathered).
                with phase("ref"):
                    reference_phase(self.reference, self.scorer, exp, st.temperature, st.micro_batch_size, decomposed,
                                    scored=ref_scored)
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

    # ---- decode-window jobs (run by self.window, on its thread and side stream) -----------------------------
    def _window_ref_prefix(self, prompt, timeline: Timeline) -> None:
        with timeline.span("ref_prefix", lane="window"):
            self.scorer.compute_and_hold(self.reference, prompt)

    def _window_ref_samples(self, prompts, i: int, group_size: int, outputs, scored: dict,
                            timeline: Timeline) -> None:
        """Reference log-probs of samples of prompt i that just finished, on its prefix held in the store (kept
        there: later samples of the prompt are scored on it too)."""
        with timeline.span("ref_suffix", lane="window"):
            samples = [i * group_size + o.sample_index for o in outputs]
            request = request_from_outputs(prompts, group_size, samples, [o.token_ids for o in outputs], self.device)
            prefix = self.scorer.store.peek(self.reference, prompts[i])
            if prefix is None:  # its prefix job failed before: finish() reports that
                return
            logp = self.scorer.score_on_prefix(self.reference, prefix, request, self.settings.temperature)
            for row, (s, o) in enumerate(zip(samples, outputs)):
                scored[s] = logp[row, :len(o.token_ids)]
