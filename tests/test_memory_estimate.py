"""The memory estimate at other device sizes than its priors came from (docs/memory.md): the shipped recipes' residents
on an 80 GB and a 141 GB card, and a data-parallel rank that counts its own shards; and its contract: `estimate` is a
query (nothing changes, the engine least of all), `observe` is the only way it learns."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from torchplex.models.qwen2_5_vl.args import get_flavor
from torchplex.models.qwen2_5_vl.model import Qwen2_5_VLModel
from torchplex.rollout.kv_pool import GroupKVPool
from torchplex.rollout.protocol import RolloutCapabilities
from torchplex.runtime.build import footprint
from torchplex.runtime.memory_budget import UNPLANNED, BatchTooLargeError
from torchplex.runtime.memory_estimate import MemoryEstimator, StepFootprint
from torchplex.runtime.plan import PlanOptions, StepShape
from torchplex.runtime.settings import StepSettings

GiB = 2**30
H100, H200 = 79 * GiB, 139 * GiB  # what the cards give a process (nvidia-smi's total less the driver's share)


class PoolOnly:
    """What the estimate reads of an engine (rollout.protocol): a pool of `kv_pool_gib`, the recipes' max batch."""

    capabilities = RolloutCapabilities()

    def __init__(self, args, kv_pool_gib: float, max_batch: int = 512):
        self.args, self.kv_pool_bytes, self.max_batch, self.prefill_tokens = args, int(kv_pool_gib * GiB), max_batch, 16384

    def pool_group_bytes(self, n: int, max_prompt: int, max_new: int) -> int:
        t = self.args.text
        return GroupKVPool.group_bytes(t.num_layers, t.num_kv_heads, t.head_dim, n, -(-max_prompt // 256) * 256,
                                       max_new, torch.bfloat16)


def recipe_estimator(flavor: str, kv_pool_gib: float, capacity: int, *, dp_size: int = 1):
    """The estimate of a shipped recipe's step (decomposed, activation checkpointing, the reference loaded), built
    from meta-device models of the published geometry in bf16, on a card of `capacity` bytes."""
    args = get_flavor(flavor)
    with torch.device("meta"):
        actor, reference = Qwen2_5_VLModel(args).bfloat16(), Qwen2_5_VLModel(args).bfloat16()
    from torchplex.models.qwen2_5_vl.parallelize import apply_activation_checkpointing
    apply_activation_checkpointing(actor)
    engine = PoolOnly(args, kv_pool_gib)
    settings = StepSettings(reward_names=["accuracy"], reward_weights=[1.0], micro_batch_size=8,
                            plan=PlanOptions(mode="decomposed", memory_budget_bytes=capacity))
    fp = footprint(actor, reference, engine, settings)
    if dp_size > 1:  # a rank of FSDP2 over dp_size: its shard of every parameter and of the AdamW state
        fp = dataclasses.replace(fp, actor_bytes=fp.actor_bytes // dp_size, reference_bytes=fp.reference_bytes // dp_size,
                                 trainable_bytes=fp.trainable_bytes // dp_size, dp_size=dp_size, train_rounds=False)
    return MemoryEstimator(fp, engine, torch.device("cpu"), measured=False), settings


def img_shape(prompts: int) -> StepShape:
    """The `img` workload: ~1,050-token prompts, G = 8, responses to 1,024 tokens."""
    return StepShape(prompt_lengths=(1050,) * prompts, group_size=8, max_new_tokens=1024)


def test_the_7b_recipe_is_refused_on_an_80_gb_card_naming_the_keys():
    """Weights, gradients, AdamW state and the reference: 83 GB before any activation or KV cache."""
    memory, settings = recipe_estimator("7B", 32.0, H100)
    budget = memory.estimate(img_shape(8), settings.plan)
    train = budget.residents["train"]
    assert sum(train[g] for g in ("actor_weights", "ref_weights", "optimizer_state", "grads")) > 77 * GiB
    with pytest.raises(BatchTooLargeError, match=r"rollout stage.*data\.prompts_per_step.*memory\.managed"):
        budget.check("the 7B recipe")


@pytest.mark.parametrize("prompts", [8, 64])
def test_the_7b_recipe_fits_a_141_gb_card_with_room_for_held_prefixes(prompts):
    memory, settings = recipe_estimator("7B", 32.0, H200)
    budget = memory.estimate(img_shape(prompts), settings.plan)
    budget.check("the 7B recipe")
    assert budget.residents["rollout"]["kv_pool"] == 32 * GiB
    assert budget.room_bytes > 20 * GiB and budget.train_room_bytes >= budget.room_bytes


def test_the_3b_recipe_fits_an_80_gb_card_with_its_own_kv_pool():
    memory, settings = recipe_estimator("3B", 40.0, H100)
    budget = memory.estimate(img_shape(64), settings.plan)
    budget.check("the 3B recipe")
    assert budget.stage_bytes("rollout") > 60 * GiB  # the 40 GiB pool beside weights, reference and AdamW state


def test_a_data_parallel_rank_counts_its_shards_not_the_whole_model():
    """A rank of 8-way FSDP2 holds an eighth of the weights, gradients and AdamW state: the 7B step that one 80 GB
    card refuses fits each rank of an 8-GPU node (a budget counting the whole model would refuse it there too)."""
    whole, settings = recipe_estimator("7B", 32.0, H100)
    rank, _ = recipe_estimator("7B", 32.0, H100, dp_size=8)
    shape = img_shape(8)
    assert rank.fp.actor_bytes * 8 == whole.fp.actor_bytes
    budget = rank.estimate(shape, settings.plan)
    budget.check("a rank's share of the 7B recipe")
    assert budget.residents["train"]["grads"] * 8 == whole.estimate(shape, settings.plan).residents["train"]["grads"]


def test_estimate_is_a_query_and_observe_is_how_it_learns():
    """Neither estimating nor planning from it changes the estimator or the engine, with rollout.kv_pool_gib 0 too
    (the budget says the pool's size, the step applies it); `observe` changes what the next estimate counts."""
    memory, settings = recipe_estimator("7B", 32.0, H200)
    memory.fp = dataclasses.replace(memory.fp, kv_pool_from_budget=True)
    memory.engine.kv_pool_bytes = 0
    before = dataclasses.asdict(memory.learned)
    first = memory.estimate(img_shape(64), settings.plan)
    second = memory.estimate(img_shape(64), settings.plan)
    assert first.to_dict() == second.to_dict() and dataclasses.asdict(memory.learned) == before
    assert memory.engine.kv_pool_bytes == 0 and first.kv_pool_bytes > 0
    memory.observe(StepFootprint(stage_peaks={"rollout": first.stage_bytes("rollout") + 3 * GiB},
                                 planned=first.residents))
    assert memory.estimate(img_shape(64), settings.plan).residents["rollout"][UNPLANNED] == 3 * GiB
