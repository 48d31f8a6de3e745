"""The memory estimate at other device sizes than its priors came from (docs/memory.md): the shipped recipes' residents
on an 80 GB and a 141 GB card, and a data-parallel rank that counts its own shards (also a rank of tp 2 x dp_shard 2,
parallelised by the trainer's own code on the meta device: its shards, its K/V heads, the prefixes its planner holds);
and its contract: `estimate` is a query (nothing changes, the engine least of all), `observe` is the only way it
learns."""

from __future__ import annotations

import dataclasses
import json
import math

import pytest
import torch

from torchplex.models.qwen2_5_vl.args import get_flavor
from torchplex.models.qwen2_5_vl.model import Qwen2_5_VLModel
from torchplex.rollout.kv_pool import GroupKVPool
from torchplex.rollout.protocol import RolloutCapabilities
from torchplex.runtime.build import footprint
from torchplex.runtime.memory_budget import (MICRO_BATCH_SHARE, MICRO_BATCH_TOKENS_WIDE, UNPLANNED, BatchTooLargeError,
                                             no_recompute_bytes, recompute_train_bytes)
from torchplex.runtime.memory_estimate import MemoryEstimator, StepFootprint
from torchplex.runtime.plan import PlanOptions, StepShape, plan_step
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


def recipe_estimator(flavor: str, kv_pool_gib: float, capacity: int, *, dp_size: int = 1, mode: str = "decomposed"):
    """The estimate of a shipped recipe's step (decomposed unless `mode`, activation checkpointing, the reference
    loaded), built from meta-device models of the published geometry in bf16, on a card of `capacity` bytes."""
    args = get_flavor(flavor)
    with torch.device("meta"):
        actor, reference = Qwen2_5_VLModel(args).bfloat16(), Qwen2_5_VLModel(args).bfloat16()
    from torchplex.models.qwen2_5_vl.parallelize import apply_activation_checkpointing
    apply_activation_checkpointing(actor)
    engine = PoolOnly(args, kv_pool_gib)
    settings = StepSettings(reward_names=["accuracy"], reward_weights=[1.0],
                            plan=PlanOptions(mode=mode, memory_budget_bytes=capacity))
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


# ---- a rank of tp 2 x dp_shard 2, parallelised for real on the meta device ---------------------------------------
@pytest.fixture(scope="module")
def tp2_dp2_rank():
    """Rank 0 of 4 (tp 2 x dp_shard 2) in this process: torch's "fake" process-group backend (collectives do nothing)
    lets the trainer's own parallelisation (TP, activation checkpointing, FSDP2) run on meta-device 7B models. The
    actor, the reference and the rollout engine on the actor, as the trainer builds them; torn down after the
    module."""
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    from torchplex.distributed.mesh import ParallelDims
    from torchplex.models.qwen2_5_vl.parallelize import parallelize_qwen2_5_vl
    from torchplex.rollout.engine import RolloutEngine

    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=4)
    try:
        dims = ParallelDims(dp_shard=2, tp=2, world_size=4, device_type="cpu")
        with torch.device("meta"):
            actor, reference = (Qwen2_5_VLModel(get_flavor("7B")).bfloat16() for _ in range(2))
        whole = {name: p.numel() * p.element_size() for name, p in actor.named_parameters()}
        shapes = {name: tuple(p.shape) for name, p in actor.named_parameters()}
        parallelize_qwen2_5_vl(actor, dims, param_dtype=torch.bfloat16, activation_checkpointing=True)
        parallelize_qwen2_5_vl(reference, dims, param_dtype=torch.bfloat16)
        yield actor, reference.requires_grad_(False), RolloutEngine(actor, kv_pool_bytes=0), whole, shapes
    finally:
        dist.destroy_process_group()


def rank0_bytes(shapes: dict[str, tuple], tp: int, dp: int) -> int:
    """Rank 0's bytes (bf16) by the layout rules (models/qwen2_5_vl/parallelize.py): a decoder layer's q/k/v and gate/up
    weights and biases split by rows over tp, its o/down weights by columns; then FSDP2 splits every parameter's rows
    over dp, rank 0 taking the rounded-up share."""
    total = 0
    for name, shape in shapes.items():
        rows, cols = shape[0], math.prod(shape[1:])
        if ".attention.w" in name or ".feed_forward.w" in name:
            if name.split(".")[-2] in ("wo", "w2"):
                cols //= tp
            else:
                rows //= tp
        total += -(-rows // dp) * cols * 2
    return total


def rank_estimator(actor, reference, engine, capacity: int, mode: str = "decomposed"):
    settings = StepSettings(reward_names=["accuracy"], reward_weights=[1.0], micro_batch_size=8,
                            kv_pool_from_budget=True, plan=PlanOptions(mode=mode, memory_budget_bytes=capacity))
    return MemoryEstimator(footprint(actor, reference, engine, settings, dp_size=2), engine, torch.device("cpu"),
                           measured=False), settings


def test_a_tp2_dp2_rank_counts_its_shards_by_the_layout_rules(tp2_dp2_rank):
    """Rank 0 of tp 2 x dp_shard 2 holds a quarter of every TP'd decoder weight and half of the rest (embeddings,
    norms, the vision tower: replicated over tp); its budget counts those bytes for the weights, the reference, the
    gradients and AdamW's two moments, and the 7B step that an 80 GB card refuses whole fits the rank. A budget that
    counts the whole model, or the model over 4 (as if every weight were split 4 ways), fails here."""
    actor, reference, engine, whole, shapes = tp2_dp2_rank
    memory, settings = rank_estimator(actor, reference, engine, H100)
    mine = rank0_bytes(shapes, tp=2, dp=2)
    assert sum(whole.values()) / 4 < mine < sum(whole.values()) / 2
    assert memory.fp.actor_bytes == memory.fp.reference_bytes == memory.fp.trainable_bytes == mine
    budget = memory.estimate(img_shape(8), settings.plan)
    budget.check("a tp 2 x dp 2 rank's share of the 7B recipe")
    train = budget.residents["train"]
    assert (train["actor_weights"], train["ref_weights"], train["grads"], train["optimizer_state"]) == (
        mine, mine, mine, 2 * mine)


def test_a_tp_rank_kv_pool_and_held_prefix_kv_count_its_own_heads(tp2_dp2_rank):
    """7B has 4 K/V heads; under TP 2 a rank's attention projects 2, and its KV pool and the K/V of its held prefixes
    hold those: half the model's K/V per token (and half its MLP width, what the activation priors count). With the
    pool sized from the budget (rollout.kv_pool_gib 0), every group of the step fits the rank's pool at its own heads'
    bytes."""
    actor, reference, engine, _, _ = tp2_dp2_rank
    t = actor.args.text
    rank_kv_per_token = 2 * t.num_layers * (t.num_kv_heads // 2) * t.head_dim * 2  # K and V, bf16
    memory, settings = rank_estimator(actor, reference, engine, H100)
    assert memory.fp.kv_bytes_per_token == rank_kv_per_token
    assert memory.fp.intermediate_size == t.intermediate_size // 2  # the MLP activations a rank's graph saves
    group_tokens = 1280 + 8 * 1024  # the pool's prompt capacity (1,050 rounded up to 256) + 8 samples' responses
    assert engine.pool_group_bytes(8, 1050, 1024) == rank_kv_per_token * group_tokens
    budget = memory.estimate(img_shape(8), settings.plan)
    assert budget.kv_pool_bytes == budget.residents["rollout"]["kv_pool"] == 8 * rank_kv_per_token * group_tokens


@pytest.mark.parametrize("mode", ["decomposed", "overlapped"])
def test_the_planner_holds_a_tp_dp_rank_prefixes_at_its_own_rates_and_room(tp2_dp2_rank, mode):
    """The planner's held-prefix forms on one rank of tp 2 x dp 2 (32 img prompts of 1,050 tokens, G = 8): each held
    prompt at the rank's compact rate (every layer's replicated hidden state, the rank's 2 K/V heads, the trainable
    tower's block inputs), as many as the rank's room holds, all in one round (data-parallel ranks hold in one batch:
    their FSDP2 collectives must match). Decomposed holds them in training, overlapped in the fused rollout prefill."""
    import types

    from torchplex.rollout.sampling import SamplingParams
    from torchplex.runtime.step import GRPOStep

    actor, reference, engine, _, _ = tp2_dp2_rank
    memory, settings = rank_estimator(actor, reference, engine, H100, mode)
    step = GRPOStep(actor, reference, engine, None, None, None, settings, memory, dp_size=2)
    plan = step.plan([types.SimpleNamespace(input_ids=[0] * 1050)] * 32, SamplingParams(n=8, max_new_tokens=1024))
    t, v = actor.args.text, actor.args.vision
    rank_kv_per_token = 2 * t.num_layers * (t.num_kv_heads // 2) * t.head_dim * 2
    rate = (t.num_layers * t.hidden_size + v.depth * v.hidden_size * v.spatial_merge_size ** 2) * 2 + rank_kv_per_token
    assert memory.compact_rate() == rate
    forms = plan.train_prefix_forms if mode == "decomposed" else plan.prefix_forms
    room = plan.budget.train_room_bytes if mode == "decomposed" else plan.budget.room_bytes
    held = [c for c in forms if c.form != "none"]
    assert {(c.form, c.bytes, c.round) for c in held} == {("compact", math.ceil(rate * 1050), 0)}
    assert len(held) * math.ceil(rate * 1050) <= room < (len(held) + 1) * math.ceil(rate * 1050)
    assert 0 < len(held) < 32  # the room binds: a different rate or room would hold another count


# ---- micro-batches by tokens (issue 49) -------------------------------------------------------------------------
def issue_shape(memory: MemoryEstimator) -> StepShape:
    """Issue 49's shape: 4 image prompts of ~1,050 tokens x G = 8, 256 response tokens, with the estimator's rates
    (what GRPOStep.shape gives it)."""
    return StepShape(prompt_lengths=(1050,) * 4, group_size=8, max_new_tokens=256,
                     kv_bytes_per_token=memory.fp.kv_bytes_per_token, activation_bytes_per_token=memory.graph_rate(),
                     compact_bytes_per_token=memory.compact_rate())


@pytest.mark.parametrize("mode", ["serial", "decomposed", "overlapped"])
def test_the_planner_sizes_micro_batches_by_tokens_from_the_card(mode):
    """The 3B recipe on the issue's shape: the planner's token budget grows with the card, fits it by the estimator's
    own accounting (the micro-batch's whole graph within its share of what the train stage leaves, one more token
    past it unless a cap stopped it; the train stage within the usable bytes), and stands in the plan's printout and
    JSON."""
    tokens = {}
    for card in (H100, H200):
        memory, settings = recipe_estimator("3B", 8.0, card, mode=mode)
        shape = issue_shape(memory)
        budget = memory.estimate(shape, settings.plan)
        budget.check("the issue's step")
        t = tokens[card] = budget.micro_batch_tokens
        train = budget.residents["train"]
        room = (1.0 if mode == "serial" else MICRO_BATCH_SHARE) * (
            budget.usable_bytes - budget.stage_bytes("train") + train["activations"])
        whole = lambda n: memory.train_micro_batch_bytes(shape, n, whole=True)
        assert whole(t) <= room and budget.stage_bytes("train") <= budget.usable_bytes
        assert "capped" in budget.micro_batch_reason or whole(t + 1) > room, budget.micro_batch_reason
        plan = plan_step(dataclasses.replace(shape, prefix_room_bytes=budget.room_bytes), settings.plan)
        plan.budget = budget
        assert f"micro-batches: training {t:,} tokens" in str(plan)
        assert json.loads(plan.to_json())["micro_batch_tokens"] == t
    assert tokens[H200] > tokens[H100]


# The planner's training micro-batch on issue 49's shape, in samples (its tokens over a sample's: 1,050 + 256 in
# serial, 256 in the prefix modes), per (mode, card): the least and the most it may be
PLANNED_SAMPLES = {
    ("serial", H100): (2, 7),  # what ran of serial at 3B on an 80 GB card: 2 samples; 8 ran out of memory
    ("serial", H200): (5, 12),
    ("decomposed", H100): (8, 31),  # a whole group at least, not the whole step
    ("decomposed", H200): (32, 32),  # the whole step: 4 groups of 8
    ("overlapped", H100): (8, 31),
    ("overlapped", H200): (32, 32),
}


@pytest.mark.parametrize("mode,card", sorted(PLANNED_SAMPLES))
def test_the_planned_micro_batch_per_mode_and_card_as_data(mode, card):
    memory, settings = recipe_estimator("3B", 8.0, card, mode=mode)
    tokens = memory.estimate(issue_shape(memory), settings.plan).micro_batch_tokens
    least, most = PLANNED_SAMPLES[(mode, card)]
    assert least <= tokens // (256 + (1050 if mode == "serial" else 0)) <= most, tokens


def test_where_whole_graphs_fit_only_narrow_micro_batches_the_budget_is_sized_by_the_recompute_form():
    """At a 56 GiB cap the 3B recipe's decomposed whole graphs fit ~5 samples: the planner takes a group (what
    MICRO_BATCH_TOKENS_WIDE allows) at its recompute form, which fits the same room; with memory.recompute "always"
    the same; on a 141 GB card, where whole graphs fit wide micro-batches, whole graphs size it."""
    memory, settings = recipe_estimator("3B", 8.0, 56 * GiB)
    shape = issue_shape(memory)
    budget = memory.estimate(shape, settings.plan)
    room = MICRO_BATCH_SHARE * (budget.usable_bytes - budget.stage_bytes("train")
                                + budget.residents["train"]["activations"])
    assert budget.micro_batch_tokens == MICRO_BATCH_TOKENS_WIDE == 8 * 256
    assert memory.train_micro_batch_bytes(shape, MICRO_BATCH_TOKENS_WIDE, whole=False) <= room
    assert memory.train_micro_batch_bytes(shape, MICRO_BATCH_TOKENS_WIDE, whole=True) > room
    assert "recomputing its blocks: whole graphs fit" in budget.micro_batch_reason
    memory.fp = dataclasses.replace(memory.fp, recompute="always")
    assert memory.estimate(shape, settings.plan).micro_batch_tokens >= MICRO_BATCH_TOKENS_WIDE
    memory, settings = recipe_estimator("3B", 8.0, H200)
    assert "recomputing" not in memory.estimate(issue_shape(memory), settings.plan).micro_batch_reason


def test_on_the_same_card_the_prefix_modes_hold_more_samples_per_micro_batch_than_serial():
    """A serial sample costs its prompt's 1,050 tokens too; a decomposed one its 256 response tokens: the budgets the
    planner picks on an 80 GB card hold several times more decomposed samples (the issue's 2-sample micro-batch was
    512 tokens)."""
    samples = {}
    for mode, cost in (("serial", 1050 + 256), ("decomposed", 256)):
        memory, settings = recipe_estimator("3B", 8.0, H100, mode=mode)
        samples[mode] = memory.estimate(issue_shape(memory), settings.plan).micro_batch_tokens // cost
    assert samples["decomposed"] >= 3 * samples["serial"] >= 3


def test_a_configured_token_budget_and_a_bound_on_sequences_are_what_the_plan_uses():
    memory, settings = recipe_estimator("3B", 8.0, H100)
    memory.fp = dataclasses.replace(memory.fp, micro_batch_tokens=1000, ref_micro_batch_size=2)
    budget = memory.estimate(issue_shape(memory), settings.plan)
    assert budget.micro_batch_tokens == 1000 and "training 1,000 tokens (configured)" in budget.micro_batch_reason
    assert budget.ref_micro_batch_tokens == 2 * 256  # two full-length samples: the bound on sequences


def test_the_memory_plan_counts_a_micro_batch_by_its_tokens():
    """A training micro-batch of T tokens: in serial T prompt and response rows (the train stage's activations are
    their recompute form: the recipe checkpoints); in the prefix modes T response tokens, and the prompt prefixes it
    computes: one per group it touches, none where the step holds them (batched in training). The ref stage's
    activations are its micro-batch's, which grow with its tokens."""
    memory, settings = recipe_estimator("3B", 8.0, H100, mode="serial")
    shape, fp = issue_shape(memory), memory.fp
    for tokens in (2 * 1306, 4 * 1306):
        memory.fp = dataclasses.replace(fp, micro_batch_tokens=tokens)
        budget = memory.estimate(shape, settings.plan)
        responses = tokens * 256 // 1306
        assert budget.residents["train"]["activations"] == recompute_train_bytes(
            memory.compact_rate(), max(fp.block_graph_bytes()), tokens, responses, fp.vocab_size)

    memory, settings = recipe_estimator("3B", 8.0, H100)
    shape = issue_shape(memory)
    samples = (1, 8, 9, 16)
    held = {n: memory.train_micro_batch_bytes(shape, n * 256, whole=True) for n in samples}
    memory.fp = dataclasses.replace(memory.fp, batched_actor_prefix=False)
    computed = {n: memory.train_micro_batch_bytes(shape, n * 256, whole=True) for n in samples}
    prefix = lambda groups: no_recompute_bytes(memory.graph_rate(), groups * 1050, 0, 0, 0)
    assert abs(computed[8] - held[8] - prefix(1)) <= 1  # one group: its prompt's prefix (rounding apart)
    assert abs(computed[9] - held[9] - prefix(2)) <= 1  # a ninth sample touches the next group
    assert held[16] - held[8] > held[8] - held[1] > 0  # responses and their keys grow with the tokens

    refs = []
    for tokens in (2048, 4096):
        memory.fp = dataclasses.replace(memory.fp, ref_micro_batch_tokens=tokens)
        budget = memory.estimate(shape, settings.plan)
        refs.append(budget.residents["ref"]["activations"])
        assert budget.ref_micro_batch_tokens == tokens
    assert refs[1] > refs[0] > 0
