"""Rollout on its own TP degree: a RolloutEngine over the WeightSharer's rollout model (parallelism.rollout_tp).

The actor trains under TP `t_train`; rollout runs the same network under TP `t_roll` on a rollout model whose
weights are the actor's storage where the layouts allow and rollout-owned buffers elsewhere
(distributed/weight_sharing.py). `SharedRolloutEngine` has the engine's interface (`generate`, `release`), so
the step and the trainer use it as they use a plain `RolloutEngine`:

  generate   resync the rollout weights (FSDP2 regather + refill of rebuilt buffers: after every optimizer step,
             before the next rollout), sample, then release the gathered actor again
  prompts    the rollout replicas are not the actor's data-parallel groups, so prompts move between them:
               t_roll < t_train  each actor TP group holds k = t_train / t_roll rollout replicas with the same
                                 prompts; replica j samples prompts j, j+k, ... and the k outputs are exchanged
                                 over the rebuild group (the k ranks that hold one rollout shard, one per replica)
               t_roll > t_train  one rollout replica spans k actor TP groups (k data-parallel shards): it samples
                                 the union of their prompts and each rank keeps its own shard's outputs
Each sample's random stream is fixed by its seed (rollout/sampling.py), so which replica samples a prompt does
not change its tokens: rollout_tp = 1 and rollout_tp = tp draw the same samples up to the rounding of the TP'd
matmuls.

What it does not support, declared in `capabilities` (rollout/protocol.py) so the planner places nothing there
and records why: the fused actor prefix and any prefill hook (the actor's prefix K/V holds the actor's TP heads,
the rollout pool needs the rollout's; the rollout prefill encodes its prompts' images with the rollout model's
own, shared, tower); the decode-window hooks (`on_step`, `on_samples_finished`), since replicas decode different
prompts for different numbers of steps, and window work on the actor-TP reference would be a collective the
ranks reach at different times (the reference is then scored after rollout, in the ref stage). Given a hook
anyway, `generate` raises.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Callable, Sequence

import torch
import torch.distributed as dist

from ..distributed.mesh import ParallelDims
from ..distributed.weight_sharing import WeightSharer
from ..rollout.engine import PoolFloor, RolloutEngine, SampleOutput
from ..rollout.protocol import RolloutCapabilities, reject_unsupported_hooks
from ..rollout.sampling import SamplingParams, sample_seeds as default_seeds  # generate() has a sample_seeds


class SharedRolloutEngine:
    """RolloutEngine on the rollout model of a WeightSharer; collective: every rank calls `generate` together."""

    capabilities = RolloutCapabilities(
        prefill_hook=False, samples_finished_hook=False, step_hook=False, shares_actor_weights=False,
        why_not="rollout_tp != tp: rollout replicas hold other TP heads and decode different prompts")

    def __init__(self, actor, parallel_dims: ParallelDims | None, t_roll: int, **engine_kwargs):
        self.sharer = WeightSharer.for_actor(actor, parallel_dims, t_roll)
        # FSDP2: the sharer leaves the actor gathered; an optimizer built next must see the sharded parameters.
        self.sharer.release()
        self.layout = self.sharer.layout
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.engine = RolloutEngine(self.sharer.rollout_model, **engine_kwargs)
        t_train = self.layout.t_train
        self._exchange_group = None  # ranks whose outputs (t_roll < t_train) or prompts (t_roll > t_train) meet
        if t_roll < t_train:
            groups = self.layout.rebuild_groups()
        elif t_roll > t_train:
            groups = self.layout.mesh_ranks()
        else:
            groups = []
        if groups:
            self._exchange_group, _ = dist.new_subgroups_by_enumeration(groups)
            self._exchange_ranks = next(g for g in groups if self.rank in g)
        self.resync_seconds: list[float] = []

    @property
    def model(self):
        return self.sharer.rollout_model

    @property
    def stats(self):
        return self.engine.stats

    # the step's memory estimate reads the pool of the engine that decodes (rollout.protocol)
    @property
    def kv_pool_bytes(self) -> int:
        return self.engine.kv_pool_bytes

    @kv_pool_bytes.setter
    def kv_pool_bytes(self, value: int) -> None:
        self.engine.kv_pool_bytes = value

    @property
    def max_batch(self) -> int:
        return self.engine.max_batch

    @property
    def prefill_tokens(self) -> int:
        return self.engine.prefill_tokens

    def pool_group_bytes(self, n: int, max_prompt: int, max_new: int) -> int:
        return self.engine.pool_group_bytes(n, max_prompt, max_new)

    def release(self) -> None:
        self.engine.release()

    def resume(self) -> None:
        self.engine.resume()

    def update_weights(self) -> None:
        """Resync the rollout weights from the actor (FSDP2 regather + refill of rebuilt buffers); `generate` does
        it first, since every rollout follows an optimizer step."""
        self.resync_seconds.append(self.sharer.resync())

    def generate(self, prompts: Sequence, params: SamplingParams, *,
                 sample_seeds: Sequence[Sequence[int]] | None = None,
                 on_step: Callable | None = None, prefill_fn: Callable | None = None,
                 on_samples_finished: Callable | None = None) -> list[list[SampleOutput]]:
        """Outputs[prompt][sample] for this rank's prompts, as RolloutEngine.generate. No hooks: see the module doc
        (raises if given one)."""
        reject_unsupported_hooks("SharedRolloutEngine", self.capabilities, on_step=on_step, prefill_fn=prefill_fn,
                                 on_samples_finished=on_samples_finished)
        # the engine's numbering when none are given, fixed before the batch is split so each part numbers alike
        seeds = [list(s) for s in (sample_seeds or default_seeds(params.seed, params.n, range(len(prompts))))]
        self.update_weights()
        try:
            if self.layout.t_roll < self.layout.t_train:
                return self._split_over_replicas(list(prompts), params, seeds)
            if self.layout.t_roll > self.layout.t_train:
                return self._merge_data_shards(list(prompts), params, seeds)
            return self._generate(list(prompts), params, seeds)
        finally:
            self.sharer.release()  # FSDP2: the gathered actor is not needed until the next resync

    def _generate(self, prompts: list, params: SamplingParams, seeds: list[list[int]]) -> list[list[SampleOutput]]:
        if not prompts:  # a replica with nothing to sample (fewer prompts than replicas)
            return []
        return self.engine.generate(prompts, params, sample_seeds=seeds)

    def _split_over_replicas(self, prompts, params, seeds):
        """t_roll < t_train: replica j of the k in this actor TP group samples prompts j::k; outputs are swapped."""
        k, j = len(self._exchange_ranks), self._exchange_ranks.index(self.rank)
        mine = list(range(j, len(prompts), k))
        outputs = self._generate([prompts[i] for i in mine], params, [seeds[i] for i in mine])
        gathered: list = [None] * k
        dist.all_gather_object(gathered, outputs, group=self._exchange_group)
        result: list = [None] * len(prompts)
        for r, outs in enumerate(gathered):
            for i, samples in zip(range(r, len(prompts), k), outs):
                result[i] = [replace(s, prompt_index=i) for s in samples]
        return result

    def _merge_data_shards(self, prompts, params, seeds):
        """t_roll > t_train: this replica samples the prompts of its k data shards; each rank keeps its own."""
        gathered: list = [None] * len(self._exchange_ranks)
        dist.all_gather_object(gathered, (prompts, seeds), group=self._exchange_group)
        t_train = self.layout.t_train
        # One entry per data shard: TP peers hold the same prompts, take the one at actor TP coordinate 0.
        shards = [g for r, g in zip(self._exchange_ranks, gathered) if r % t_train == 0]
        own = [r for r in self._exchange_ranks if r % t_train == 0].index(self.rank // t_train * t_train)
        start = sum(len(p) for p, _ in shards[:own])
        all_prompts = [p for ps, _ in shards for p in ps]
        all_seeds = [s for _, ss in shards for s in ss]
        outputs = self._generate(all_prompts, params, all_seeds)[start:start + len(prompts)]
        return [[replace(s, prompt_index=i) for s in samples] for i, samples in enumerate(outputs)]


def build_rollout_engine(actor, parallel_dims: ParallelDims | None, t_roll: int, *, kv_pool_bytes: int,
                         max_batch: int, pad_id: int, device: torch.device, least_pool: PoolFloor | None = None):
    """The trainer's engine: on the actor itself when rollout_tp equals tp, else a SharedRolloutEngine.

    Decode runs as captured CUDA graphs (one per ladder size) only when its weights keep fixed addresses and it
    makes no collective: a plain actor, or a rollout model of TP 1 whose actor is not FSDP2-sharded (FSDP2
    reallocates the gathered storage the shared weights point at on every regather)."""
    t_train = parallel_dims.tp if parallel_dims is not None else 1
    cuda = device.type == "cuda"
    common = dict(kv_pool_bytes=kv_pool_bytes, max_batch=max_batch, pad_id=pad_id, least_pool=least_pool)
    if t_roll == t_train:
        return RolloutEngine(actor, compile_decode=cuda and parallel_dims is None, **common)
    fsdp = parallel_dims is not None and parallel_dims.fsdp_enabled
    return SharedRolloutEngine(actor, parallel_dims, t_roll, compile_decode=cuda and t_roll == 1 and not fsdp,
                               **common)
