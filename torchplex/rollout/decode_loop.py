"""One `generate` call of the native engine, as three small moves (gpt-fast's prefill / decode_one_token / the
loop around them):

  admit   prefill waiting prompts into free group slots, in batches of at most `prefill_tokens` prompt tokens, and
          sample each prompt's n first tokens from its last logits
  step    one decode step over the current rows (rollout/decode_step.py): a graph replay on CUDA
  check   every `check_interval` steps (the one host sync): hand finished samples on, return finished groups, admit
          prompts into the freed group slots, and map the live samples to the smallest ladder size that holds them

Continuous batching is at group granularity: a prompt enters when a group slot frees up, and the row map follows
(it grows again after an admission, shrinks as samples finish).
"""

from __future__ import annotations

import time
from collections import Counter, deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from .decode_state import DecodeState, SampleOutput
from .ladder import pool_ladder, rows_for
from .sampling import SamplingParams, sample


@dataclass
class DecodeStepInfo:
    step: int
    active_samples: int  # samples of the prompts decoding (their groups' n each)
    waiting_prompts: int
    rows: int = 0  # the step's ladder size


@dataclass
class Hooks:
    prefill: Callable
    on_step: Callable[[DecodeStepInfo], None] | None = None
    on_samples_finished: Callable[[list[SampleOutput]], None] | None = None


class DecodeLoop:
    def __init__(self, engine, prompts: Sequence, params: SamplingParams, sample_seeds: Sequence[Sequence[int]],
                 hooks: Hooks):
        self.engine, self.pool, self.model = engine, engine.pool, engine.model
        self.prompts, self.params, self.sample_seeds, self.hooks = prompts, params, sample_seeds, hooks
        self.lengths = [len(p.input_ids) for p in prompts]
        self.state = DecodeState(self.pool, params, engine.device)
        self.ladder = pool_ladder(self.pool.num_slots, engine.ladder)
        self.waiting = deque(range(len(prompts)))
        self.results: list[list[SampleOutput] | None] = [None] * len(prompts)
        self.steps = 0
        self.steps_by_rows: Counter[int] = Counter()

    def run(self) -> list[list[SampleOutput]]:
        engine, stats = self.engine, self.engine.stats
        self.admit()
        self.check()
        if engine.fused_qkv:
            self.model.fuse_qkv()  # from this step's weights; in place, so a captured decode graph stays valid
        step_fn = engine.decode_step(self.params)
        with engine.on_decode_stream():
            start, prefill_before = time.perf_counter(), stats.prefill_s
            while self.state.owner:
                self.step(step_fn)
                if self.steps % engine.check_interval == 0 or self.steps >= self.params.max_new_tokens:
                    self.check()
            stats.decode_s += time.perf_counter() - start - (stats.prefill_s - prefill_before)
        stats.pool_bytes = self.pool.allocated_bytes
        merged = Counter(stats.decode_rows)
        merged.update(self.steps_by_rows)
        stats.decode_rows = dict(sorted(merged.items()))  # a new dict: copies of the stats keep their own
        return self.results

    def step(self, step_fn) -> None:
        state = self.state
        state.advance(step_fn(state.rows))
        self.steps += 1
        self.steps_by_rows[state.map.rows] += 1
        self.engine.stats.decode_steps += 1
        self.engine.stats.row_steps += state.map.rows
        if self.hooks.on_step is not None:
            self.hooks.on_step(DecodeStepInfo(self.steps, len(state.owner) * self.params.n, len(self.waiting),
                                              state.map.rows))

    def check(self) -> None:
        state, pool = self.state, self.pool
        state.push()
        active, counts = state.read()
        new, done = state.collect(active, counts, report=self.hooks.on_samples_finished is not None)
        if new and self.hooks.on_samples_finished is not None:
            self.hooks.on_samples_finished(new)
        for group, (prompt, outputs) in done.items():
            self.results[prompt] = outputs
            self.engine.stats.generated_tokens += sum(len(o.token_ids) for o in outputs)
            pool.give_back(group)
        admitted = []
        if self.waiting and pool.free_groups:
            with self.engine.on_caller_stream():  # prefill writes the pool the decode stream reads
                admitted = self.admit()
        live = state.live_slots(active, admitted)
        if admitted or state.map is None or rows_for(len(live), self.ladder) != state.map.rows:
            state.remap(live, self.ladder)

    # ---- prefill --------------------------------------------------------------------------------------
    def admit(self) -> list[int]:
        """Prefill waiting prompts into free group slots while both last; the group slots taken."""
        taken = []
        while self.waiting and self.pool.free_groups:
            batch, budget = [], self.engine.prefill_tokens
            while self.waiting and self.pool.free_groups and (not batch or budget >= self.lengths[self.waiting[0]]):
                i = self.waiting.popleft()
                batch.append((i, self.pool.take_group()))
                budget -= self.lengths[i]
            self.prefill(batch)
            taken += [g for _, g in batch]
        return taken

    def prefill(self, batch: list[tuple[int, int]]) -> None:
        """Prefill (prompt index, group slot) pairs and start their samples."""
        engine, params, dev = self.engine, self.params, self.engine.device
        timed = engine.time_prefill and dev.type == "cuda"
        if timed:
            torch.cuda.synchronize(dev)
        t0 = time.perf_counter()
        prefix = self.hooks.prefill([self.prompts[i] for i, _ in batch])
        last_logits = self.model.logits(prefix.last_hidden.detach())
        first_step = torch.zeros(params.n, dtype=torch.long, device=dev)
        for b, (i, g) in enumerate(batch):
            self.pool.write_prefix(g, [k[b].detach() for k in prefix.k], [v[b].detach() for v in prefix.v],
                                   self.lengths[i])
            seeds = torch.tensor(list(self.sample_seeds[i]), device=dev)
            tokens, logprobs = sample(last_logits[b:b + 1].expand(params.n, -1), params, seeds, first_step)
            self.state.start_group(g, i, seeds, prefix.next_position[b], tokens, logprobs)
        if timed:
            torch.cuda.synchronize(dev)
        stats = engine.stats
        stats.prefill_s += time.perf_counter() - t0
        stats.prefills += 1
        stats.max_prefix_tokens_stored = max(stats.max_prefix_tokens_stored, self.pool.prefix_tokens_stored)
