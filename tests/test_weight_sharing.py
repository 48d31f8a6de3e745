"""Rollout weights shared with the actor across TP degrees: same outputs, real aliasing, correct refresh.

Distributed runs spawn 2 or 4 CPU processes on gloo (one run per actor mesh; each run shares the actor into
one or two rollout TP degrees). Every rank builds the same seeded model, parallelises it as the actor, builds
the rollout models through WeightSharer, runs a rollout forward, one AdamW step of the actor, a resync and a
second rollout forward. Rank 0 saves what all ranks saw; each test checks one behaviour against the plain
model in this process. fp32 throughout; outputs agree to RTOL relative to the tensor's largest magnitude.

Rollout parameters are checked per rank: each rank's local tensor against the slice of the reference
parameter it says it holds (`actor_range`), since a rollout TP group may hold the actor's chunks reordered.
The text model is the debug flavor with 8 query / 4 KV heads (the flavor's 2 KV heads cannot be split 4 ways).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from distributed_helpers import free_port, init_gloo, spawn
from torchplex.distributed.mesh import ParallelDims, build_parallel_dims
from torchplex.distributed.weight_layout import (
    RolloutLayout, ShardLayout, ShareKind, ShareReport, classify, plan_sharing)
from torchplex.distributed.weight_sharing import WeightSharer, shares_storage
from torchplex.models.qwen2_5_vl.args import get_flavor
from torchplex.models.qwen2_5_vl.model import Qwen2_5_VLModel
from torchplex.distributed.fsdp import reshard
from torchplex.models.qwen2_5_vl.parallelize import parallelize_qwen2_5_vl
from torchplex.models.qwen2_5_vl.rope_index import get_rope_index

RTOL = 1e-5
LR = 1e-3
ADAM_EPS = 1e-3  # as in test_parallelize: keeps Adam's first step from amplifying reduction-order noise
PARAM_ATOL = 1e-4 * LR
TIMEOUT_S = 150
_DEBUG = get_flavor("debug").with_token_ids(image_token_id=2000, video_token_id=2001, vision_start_token_id=2002,
                                            vision_end_token_id=2003)
ARGS = dataclasses.replace(_DEBUG, text=dataclasses.replace(_DEBUG.text, num_heads=8, num_kv_heads=4,
                                                            mrope_section=(2, 3, 3)))
GRID = (1, 4, 8)  # 32 patches -> 8 merged image tokens
PATCH = 3 * 2 * 14 * 14
NUM_SAMPLES = 2
FP32 = dict(param_dtype=torch.float32, reduce_dtype=torch.float32)


# ---- model, data, step: shared by the reference and every rank ---------------------------------------------

def build_model() -> Qwen2_5_VLModel:
    model = Qwen2_5_VLModel(ARGS)
    model.init_weights(std=0.05, generator=torch.Generator().manual_seed(0))
    return model


def make_batch() -> dict:
    g = torch.Generator().manual_seed(1)
    t, h, w = GRID
    image = [ARGS.vision_start_token_id] + [ARGS.image_token_id] * (t * h * w // 4) + [ARGS.vision_end_token_id]
    rows = [torch.randint(0, 1900, (3,), generator=g).tolist() + image
            + torch.randint(0, 1900, (5,), generator=g).tolist() for _ in range(NUM_SAMPLES)]
    input_ids = torch.tensor(rows)
    grid_thw = torch.tensor([GRID] * NUM_SAMPLES)
    position_ids, _ = get_rope_index(ARGS, input_ids, grid_thw)
    return dict(input_ids=input_ids, position_ids=position_ids, grid_thw=grid_thw,
                pixel_values=torch.randn(NUM_SAMPLES * t * h * w, PATCH, generator=g))


def select(batch: dict, start: int, count: int) -> dict:
    patches = batch["pixel_values"].shape[0] // NUM_SAMPLES
    return dict(input_ids=batch["input_ids"][start:start + count],
                position_ids=batch["position_ids"][:, start:start + count],
                grid_thw=batch["grid_thw"][start:start + count],
                pixel_values=batch["pixel_values"][start * patches:(start + count) * patches])


def logits(model: Qwen2_5_VLModel, b: dict) -> torch.Tensor:
    image = model.encode_vision(b["pixel_values"], b["grid_thw"])
    return model.logits(model(b["input_ids"], b["position_ids"], image_embeds=image))


def train_step(model: Qwen2_5_VLModel, b: dict) -> torch.Tensor:
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR, eps=ADAM_EPS)
    out = logits(model, b)[:, :-1]
    loss = F.cross_entropy(out.reshape(-1, out.shape[-1]), b["input_ids"][:, 1:].reshape(-1))
    loss.backward()
    optimizer.step()
    return loss.detach()


def full(t: torch.Tensor) -> torch.Tensor:
    t = t.detach()
    return t.full_tensor() if isinstance(t, DTensor) else t.clone()


def full_params(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    return {n: full(p) for n, p in model.named_parameters()}


def local_params(sharer: WeightSharer) -> dict[str, torch.Tensor]:
    return {e.plan.name: e.local.clone() for e in sharer.entries}


def expected_local(reference: torch.Tensor, actor_range: tuple[int, int, int] | None) -> torch.Tensor:
    return reference if actor_range is None else reference.narrow(*actor_range)


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    assert actual.shape == expected.shape, f"shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    return ((actual - expected).abs().max() / expected.abs().max().clamp_min(1e-30)).item()


def assert_params_close(actual: dict, expected: dict, what: str) -> None:
    for name, value in actual.items():
        torch.testing.assert_close(value, expected[name], rtol=RTOL, atol=PARAM_ATOL,
                                   msg=lambda m, name=name: f"{what} {name}: {m}")


def assert_locals_close(result: dict, snapshot: str, names, reference: dict, what: str) -> None:
    """Every rank's local rollout tensors of `names` in `snapshot` against their slices of `reference`."""
    for rank, (local, ranges) in enumerate(zip(result[snapshot], result["ranges"])):
        assert_params_close({n: local[n] for n in names},
                            {n: expected_local(reference[n], ranges[n]) for n in names}, f"rank {rank} {what}")


# ---- what each rank runs --------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Run:
    dp_shard: int
    tp: int                     # the actor's TP degree
    t_rolls: tuple[int, ...]    # rollout TP degrees shared from that actor
    fsdp: bool

    @property
    def world_size(self) -> int:
        return self.dp_shard * self.tp


RUNS = {
    "tp2": Run(1, 2, (1, 2), fsdp=False),
    "replicated2": Run(2, 1, (2,), fsdp=False),  # two full actor replicas, each stepping on the whole batch
    "fsdp2": Run(2, 1, (2, 1), fsdp=True),
    "tp4": Run(1, 4, (2,), fsdp=False),
    "fsdp2_tp2": Run(2, 2, (4, 1), fsdp=True),
}
# Runs of one world size share one set of processes (one after the other): process start-up dominates.
WORLDS = {w: tuple(name for name, r in RUNS.items() if r.world_size == w) for w in (2, 4)}


def _gather_objects(obj) -> list:
    out = [None] * dist.get_world_size()
    dist.all_gather_object(out, obj)
    return out


def run_sharing(dims: ParallelDims, t_rolls: tuple[int, ...], fsdp: bool) -> dict:
    batch = make_batch()
    actor = parallelize_qwen2_5_vl(build_model(), dims, fsdp=fsdp, **FP32)
    sharers = {t: WeightSharer.for_actor(actor, dims, t) for t in t_rolls}
    result: dict = {t: {} for t in t_rolls}
    with torch.no_grad():
        for t, s in sharers.items():
            actor_params = dict(actor.named_parameters())  # gathered: what the actor holds during rollout
            result[t]["kinds"] = {e.plan.name: e.plan.kind for e in s.entries}
            result[t]["ranges"] = _gather_objects({e.plan.name: e.actor_range for e in s.entries})
            result[t]["aliased"] = _gather_objects(
                {e.plan.name: shares_storage(e.local, actor_params[e.plan.name]) for e in s.entries})
            result[t]["logits"] = _gather_objects(logits(s.rollout_model, batch))
    for s in sharers.values():
        s.release()
    result["ready_after_release"] = all(s.ready for s in sharers.values())

    if fsdp:  # FSDP2 averages the dp ranks' gradients: each takes its share of the batch
        per_rank = NUM_SAMPLES // dims.dp_shard
        loss = train_step(actor, select(batch, dims.dp_rank * per_rank, per_rank))
        reshard(actor)
        result["loss"] = sum(_gather_objects(loss)[::dims.tp]) / dims.dp_shard
    else:  # unsharded replicas do not talk: each steps on the whole batch
        result["loss"] = train_step(actor, batch)
    for t, s in sharers.items():
        if not fsdp:  # under FSDP2 the released storage must not be read before resync
            result[t]["before_resync"] = _gather_objects(local_params(s))
        s.resync()
        result[t]["after_resync"] = _gather_objects(local_params(s))
        with torch.no_grad():
            result[t]["logits_after_step"] = _gather_objects(logits(s.rollout_model, batch))
        result[t]["report"] = s.report()
    result["actor_params"] = full_params(actor)
    return result


def _worker(rank: int, world_size: int, port: int, out_path: str) -> None:
    init_gloo(rank, world_size, port)
    try:
        results = {}
        for run in WORLDS[world_size]:
            r = RUNS[run]
            results[run] = run_sharing(build_parallel_dims(r.dp_shard, r.tp, world_size), r.t_rolls, r.fsdp)
        if rank == 0:
            torch.save(results, out_path)
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    """Spawns the processes of a world size at most once, on first use of one of its runs."""
    cache: dict[str, dict] = {}

    def get(run: str) -> dict:
        if run not in cache:
            world_size = RUNS[run].world_size
            out_path = str(tmp_path_factory.mktemp(f"world{world_size}") / "result.pt")
            spawn(_worker, world_size, (free_port(), out_path), TIMEOUT_S, what=f"runs {WORLDS[world_size]}")
            cache.update(torch.load(out_path, weights_only=False))
        return cache[run]

    return get


@pytest.fixture(scope="module")
def reference() -> dict:
    batch = make_batch()
    model = build_model()
    initial = full_params(model)
    with torch.no_grad():
        before = logits(model, batch)
    loss = train_step(model, batch)
    with torch.no_grad():
        after = logits(model, batch)
    return {"params": initial, "logits": before, "loss": loss, "updated": full_params(model), "logits_after": after}


# (run, rollout TP degree): (actor TP, rollout TP) in {(2,1), (1,2), (4,2), (2,4)}, FSDP2 over 2 dp ranks in
# the fsdp* runs, plus the identical layouts (2,2) and (1,1).
CASES = [(name, t) for name, r in RUNS.items() for t in r.t_rolls]
NON_FSDP = [c for c in CASES if not RUNS[c[0]].fsdp]
IDS = [f"{r}-troll{t}" for r, t in CASES]
SHARED = (ShareKind.IDENTICAL, ShareKind.VIEW)


@pytest.mark.slow
@pytest.mark.parametrize("run,t_roll", CASES, ids=IDS)
def test_rollout_forward_matches_single_process(runs, reference, run, t_roll):
    result = runs(run)[t_roll]
    for rank, (out, out_after) in enumerate(zip(result["logits"], result["logits_after_step"])):
        assert relative_error(out, reference["logits"]) <= RTOL, f"rank {rank} logits before the step"
        assert relative_error(out_after, reference["logits_after"]) <= RTOL, f"rank {rank} logits after the step"


@pytest.mark.slow
@pytest.mark.parametrize("run,t_roll", CASES, ids=IDS)
def test_shared_parameters_lie_inside_actor_storage(runs, run, t_roll):
    result = runs(run)[t_roll]
    for rank, aliased in enumerate(result["aliased"]):
        for name, kind in result["kinds"].items():
            assert aliased[name] == (kind in SHARED), f"rank {rank}: {kind.value} {name} aliased={aliased[name]}"


@pytest.mark.slow
@pytest.mark.parametrize("run,t_roll", NON_FSDP, ids=[f"{r}-troll{t}" for r, t in NON_FSDP])
def test_shared_parameters_follow_optimizer_step_without_copy(runs, reference, run, t_roll):
    """Without FSDP the actor's step updates its storage in place: shared rollout weights show it at once,
    rebuilt ones keep the old values until resync."""
    result = runs(run)[t_roll]
    shared = [n for n, kind in result["kinds"].items() if kind in SHARED]
    rebuilt = [n for n, kind in result["kinds"].items() if kind not in SHARED]
    assert_locals_close(result, "before_resync", shared, reference["updated"], "shared, before resync:")
    assert_locals_close(result, "before_resync", rebuilt, reference["params"], "rebuilt, before resync:")
    for name in rebuilt:  # the step did move them, so the previous check tells stale from updated
        assert (reference["updated"][name] - reference["params"][name]).abs().max() > 0.1 * LR


@pytest.mark.slow
@pytest.mark.parametrize("run,t_roll", CASES, ids=IDS)
def test_resync_brings_every_parameter_to_the_updated_actor(runs, reference, run, t_roll):
    result = runs(run)[t_roll]
    assert_locals_close(result, "after_resync", list(result["kinds"]), reference["updated"], "after resync:")


@pytest.mark.slow
@pytest.mark.parametrize("run,t_roll", [("fsdp2", 2), ("fsdp2", 1), ("fsdp2_tp2", 4)])
def test_fsdp_shared_weights_need_only_the_actors_own_regather(runs, run, t_roll):
    """Going to an equal or larger rollout TP degree copies nothing: the update arrives through the FSDP2
    unshard the actor needs for rollout anyway, and no rollout buffer exists."""
    result = runs(run)
    report = result[t_roll]["report"]
    assert report.buffer_bytes == 0 and report.rebuild_received_bytes == 0
    assert report.unshard_seconds is not None and report.resync_seconds >= report.unshard_seconds > 0
    assert not result["ready_after_release"], "release() must free the gathered actor the rollout points at"


@pytest.mark.slow
@pytest.mark.parametrize("run,t_roll", CASES, ids=IDS)
def test_live_sharing_follows_the_layout_rules(runs, run, t_roll):
    """The benchmark's meta-device plan and the live sharer classify and count every parameter alike."""
    t_train = RUNS[run].tp
    plans = plan_sharing(ARGS, t_train, t_roll, dtype=torch.float32)
    result = runs(run)[t_roll]
    assert result["kinds"] == {p.name: p.kind for p in plans}
    expected, live = ShareReport.from_plans(plans, t_train, t_roll), result["report"]
    for field in ("identical_bytes", "view_bytes", "rebuilt_bytes", "rebuild_received_bytes"):
        assert getattr(live, field) == getattr(expected, field), field
    assert live.resync_seconds > 0


@pytest.mark.slow
def test_fsdp2_tp2_training_step_matches_single_process(runs, reference):
    result = runs("fsdp2_tp2")
    assert relative_error(result["loss"], reference["loss"]) <= RTOL
    assert_params_close(result["actor_params"], reference["updated"], "updated actor param")


# ---- layout rules, one process ---------------------------------------------------------------------------

@pytest.mark.parametrize("world,t_train,t_roll", [(4, 2, 4), (4, 1, 2), (8, 2, 8), (8, 4, 8), (4, 4, 2),
                                                  (8, 8, 2), (8, 2, 1), (4, 2, 2)])
def test_rollout_layout_gives_each_rank_its_pieces(world, t_train, t_roll):
    """Every rank appears once; a more-sharded rollout shard lies inside the rank's own actor shard; a
    less-sharded one is assembled, in order, from the actor shards of the rank's rebuild group."""
    layout = RolloutLayout(world, t_train, t_roll)
    rows = layout.mesh_ranks()
    assert sorted(r for row in rows for r in row) == list(range(world))
    assert all(row == sorted(row) for row in rows), "process groups order ranks ascending"
    size = 8 * max(t_train, t_roll)
    actor_chunk = lambda rank: range(rank % t_train * size // t_train, (rank % t_train + 1) * size // t_train)
    for row in rows:
        assert sorted(layout.chunk_of(rank) for rank in row) == list(range(t_roll)), "a replica holds every chunk"
        for rank in row:
            c = layout.chunk_of(rank)
            rollout_chunk = range(c * size // t_roll, (c + 1) * size // t_roll)
            if t_roll >= t_train:
                assert set(rollout_chunk) <= set(actor_chunk(rank))
            else:
                group = next(g for g in layout.rebuild_groups() if rank in g)
                assert [i for r in group for i in actor_chunk(r)] == list(rollout_chunk)


def test_rollout_layout_examples():
    assert RolloutLayout(4, 2, 4).mesh_ranks() == [[0, 1, 2, 3]]
    # rank 2 (dp replica 1, actor chunk 0 of 2) holds rollout chunk 1 of 4, inside its actor chunk
    assert [RolloutLayout(4, 2, 4).chunk_of(r) for r in range(4)] == [0, 2, 1, 3]
    assert RolloutLayout(4, 4, 2).mesh_ranks() == [[0, 2], [1, 3]]
    assert RolloutLayout(4, 4, 2).rebuild_groups() == [[0, 1], [2, 3]]
    with pytest.raises(ValueError, match="divide one another"):
        RolloutLayout(12, 4, 6)


def test_classification_rules():
    rep, col2, col4, row2 = ShardLayout(None), ShardLayout(0, 2), ShardLayout(0, 4), ShardLayout(1, 2)
    assert classify(rep, rep) is ShareKind.IDENTICAL
    assert classify(col2, col2) is ShareKind.IDENTICAL
    assert classify(rep, col2) is ShareKind.VIEW
    assert classify(col2, col4) is ShareKind.VIEW
    assert classify(col4, col2) is ShareKind.REBUILT
    assert classify(row2, rep) is ShareKind.REBUILT
    with pytest.raises(NotImplementedError, match="all-to-all"):
        classify(col2, row2, "x")


def _decoder_tp_numel(args) -> int:
    """Parameters the TP plan splits: per layer q/k/v weights and biases, o, gate, up, down."""
    t = args.text
    qkv = (t.num_heads + 2 * t.num_kv_heads) * t.head_dim * (t.hidden_size + 1)
    return t.num_layers * (qkv + t.num_heads * t.head_dim * t.hidden_size + 3 * t.hidden_size * t.intermediate_size)


@pytest.mark.parametrize("t_train,t_roll", [(2, 1), (1, 2), (4, 2), (2, 4), (2, 2)])
def test_share_plan_counts_bytes_by_hand(t_train, t_roll):
    plans = plan_sharing(ARGS, t_train, t_roll, dtype=torch.float32)
    report = ShareReport.from_plans(plans, t_train, t_roll)
    with torch.device("meta"):
        total = sum(p.numel() for p in Qwen2_5_VLModel(ARGS).parameters())
    split = _decoder_tp_numel(ARGS)
    local_split_bytes = 4 * split // t_roll
    assert report.identical_bytes + report.view_bytes + report.rebuilt_bytes == 4 * (total - split) + local_split_bytes
    if t_roll < t_train:
        assert report.rebuilt_bytes == local_split_bytes and report.view_bytes == 0
        k = t_train // t_roll
        assert report.rebuild_received_bytes == local_split_bytes * (k - 1) // k
    elif t_roll > t_train:
        assert report.view_bytes == local_split_bytes and report.rebuilt_bytes == 0
    else:
        assert report.identical_bytes == report.total_bytes


def test_share_ratio_of_32b_at_tp8_to_4():
    args = get_flavor("32B")
    report = ShareReport.from_plans(plan_sharing(args, 8, 4), 8, 4)
    with torch.device("meta"):
        total = sum(p.numel() for p in Qwen2_5_VLModel(args).parameters())
    replicated = total - _decoder_tp_numel(args)
    assert report.share_ratio == pytest.approx(replicated / (replicated + _decoder_tp_numel(args) / 4), rel=1e-9)


@pytest.mark.parametrize("flavor,t_train,t_roll,table", [
    ("7B", 4, 2, dict(gib=9.37, share=0.351, ceiling=0.676, buffer_gib=6.08, received_gib=3.04)),
    ("32B", 8, 4, dict(gib=18.71, share=0.223, ceiling=0.612, buffer_gib=14.53, received_gib=7.27))])
def test_share_table_and_resync_bytes_of_the_recipes_follow_the_layout_formula(flavor, t_train, t_roll, table):
    """The docs/weight_sharing.md rows of a smaller rollout TP, from the meta-device plan, against the formula: per
    rank, everything the TP plan replicates is identical (2 bytes a parameter, bf16), each TP'd decoder weight is
    rebuilt at its rollout shard (1 / t_roll), nothing is a view; a resync receives the (k - 1) / k of each rebuilt
    shard that other ranks hold (k = t_train / t_roll), and the rank's own 1 / k of it is what rollout linears kept
    as k pieces could view too: the ceiling of per-rank sharing is share + own."""
    args = get_flavor(flavor)
    report = ShareReport.from_plans(plan_sharing(args, t_train, t_roll), t_train, t_roll)
    with torch.device("meta"):
        total = sum(p.numel() for p in Qwen2_5_VLModel(args).parameters())
    split, k = _decoder_tp_numel(args), t_train // t_roll
    rebuilt = 2 * split // t_roll
    assert (report.identical_bytes, report.view_bytes, report.rebuilt_bytes) == (2 * (total - split), 0, rebuilt)
    assert report.buffer_bytes == rebuilt and report.rebuild_received_bytes == rebuilt * (k - 1) // k
    own = rebuilt - report.rebuild_received_bytes
    gib = 2**30
    measured = dict(gib=report.total_bytes / gib, share=report.share_ratio,
                    ceiling=report.share_ratio + own / report.total_bytes, buffer_gib=report.buffer_bytes / gib,
                    received_gib=report.rebuild_received_bytes / gib)
    assert measured == pytest.approx(table, abs=0.005)  # the table's rounding


def test_plan_refuses_tp_that_splits_heads():
    with pytest.raises(ValueError, match="num_heads"):
        plan_sharing(get_flavor("7B"), 8, 4)  # 28 query heads


def test_one_process_rollout_model_is_the_actors_storage():
    """Without a process group (t_train = t_roll = 1) every rollout parameter is the actor's own tensor."""
    actor, batch = build_model(), make_batch()
    sharer = WeightSharer.for_actor(actor, None, 1)
    actor_params = dict(actor.named_parameters())
    assert all(e.plan.kind is ShareKind.IDENTICAL and shares_storage(e.local, actor_params[e.plan.name])
               for e in sharer.entries)
    assert sharer.report().share_ratio == 1.0 and sharer.report().buffer_bytes == 0
    with torch.no_grad():
        assert relative_error(logits(sharer.rollout_model, batch), logits(actor, batch)) == 0.0
    assert not any(p.requires_grad for p in sharer.rollout_model.parameters())
