"""Phase-aware memory manager: the plan for given groups/phases, bitwise offload/prefetch round trips, waiting on
prefetches (a deliberately slow, gated copy), the KV pool's release/reserve group and the CPU no-op bookkeeping.

The GRPO example below uses small integer sizes so every plan entry can be checked by hand:
    actor 10 (rollout, train, optimizer)   master 20 (optimizer)   adam 40 (optimizer)   ref 10 (ref)
    grads 10 transient (train, optimizer)  acts 15 transient (train)  kv 30 release (rollout)
"""

from __future__ import annotations

import copy
import json
import threading
import time

import pytest
import torch

from torchplex.rollout.kv_pool import GroupKVPool
from torchplex.runtime.memory import (MemoryManager, MemoryPlan, NoCopyEngine, TensorGroup, ThreadCopyEngine,
                                      kv_pool_group, module_group, optimizer_state_group)

PHASES = ["rollout", "ref", "train", "optimizer"]
SIZES = {"actor": 10, "master": 20, "adam": 40, "ref": 10, "grads": 10, "acts": 15, "kv": 30}


class FakePool:
    """Release/reserve bookkeeping of a KV pool without tensors."""

    def __init__(self):
        self.reserved = True

    def release(self):
        self.reserved = False

    def reserve(self):
        self.reserved = True


def grpo_groups(with_tensors: bool = False, adam_kind: str = "offload") -> tuple[list[TensorGroup], dict]:
    """The example groups; with_tensors backs each offload group with a uint8 tensor of its size (CPU)."""
    data = {n: torch.full((SIZES[n],), i, dtype=torch.uint8) for i, n in enumerate(["actor", "master", "adam", "ref"])}
    pool = FakePool()

    def group(name, needed, kind="offload"):
        tensors = (lambda t=data[name]: [t]) if with_tensors and kind == "offload" else None
        return TensorGroup(name, frozenset(needed), kind, tensors=tensors, nbytes=SIZES[name],
                           release=pool.release if kind == "release" else None,
                           reserve=pool.reserve if kind == "release" else None)

    groups = [group("actor", {"rollout", "train", "optimizer"}), group("master", {"optimizer"}),
              group("adam", {"optimizer"}, adam_kind), group("ref", {"ref"}),
              group("grads", {"train", "optimizer"}, "transient"), group("acts", {"train"}, "transient"),
              group("kv", {"rollout"}, "release")]
    return groups, {"data": data, "pool": pool}


def rows(plan: MemoryPlan) -> dict[str, dict]:
    return {r.phase: {"resident": set(r.resident), "offload": set(r.offload), "load": set(r.load),
                      "prefetch": set(r.prefetch), "drain": r.drain, "peak": r.peak_bytes, "naive": r.naive_bytes,
                      "exposed": r.exposed_bytes} for r in plan.phases}


# ---- the plan -----------------------------------------------------------------------------------------------------
def test_plan_without_budget_holds_each_phase_and_the_next():
    plan = MemoryPlan.build(grpo_groups()[0], PHASES)
    expected = {
        # rollout: actor + kv, ref prefetched; master/adam (optimizer's) are still being copied out: 10+30+10+60
        "rollout": dict(resident={"actor", "kv", "ref"}, offload={"master", "adam"}, load={"kv"}, prefetch={"ref"},
                        drain=False, peak=110, naive=80 + 30, exposed=0),
        # ref: actor stays because train needs it next (held, not copied); kv is freed
        "ref": dict(resident={"ref", "actor"}, offload={"kv"}, load=set(), prefetch=set(), drain=False,
                    peak=20, naive=80, exposed=0),
        "train": dict(resident={"actor", "grads", "acts", "master", "adam"}, offload={"ref"}, load=set(),
                      prefetch={"master", "adam"}, drain=False, peak=10 + 10 + 15 + 60 + 10, naive=80 + 25,
                      exposed=0),
        "optimizer": dict(resident={"actor", "master", "adam", "grads"}, offload=set(), load=set(), prefetch=set(),
                          drain=False, peak=80, naive=90, exposed=0),
    }
    assert rows(plan) == expected
    assert (plan.peak_bytes, plan.naive_peak_bytes) == (110, 110)


def test_plan_under_budget_defers_prefetches_and_drains_copies():
    plan = MemoryPlan.build(grpo_groups()[0], PHASES, budget_bytes=80)
    expected = {
        # holding ref (10) is cheaper than loading it late, but then the 60 outgoing only fit once drained
        "rollout": dict(resident={"actor", "kv", "ref"}, offload={"master", "adam"}, load={"kv"}, prefetch={"ref"},
                        drain=True, peak=50, naive=110, exposed=60),
        "ref": dict(resident={"ref", "actor"}, offload={"kv"}, load=set(), prefetch=set(), drain=False,
                    peak=20, naive=80, exposed=0),
        # prefetching adam (40) and draining ref (10) exposes 30; prefetching master instead would expose 40
        "train": dict(resident={"actor", "grads", "acts", "adam"}, offload={"ref"}, load=set(), prefetch={"adam"},
                      drain=True, peak=75, naive=105, exposed=10),
        "optimizer": dict(resident={"actor", "master", "adam", "grads"}, offload=set(), load={"master"},
                          prefetch=set(), drain=False, peak=80, naive=90, exposed=20),
    }
    assert rows(plan) == expected
    assert all(r.fits for r in plan.phases)


def test_plan_marks_phases_over_budget():
    plan = MemoryPlan.build(grpo_groups()[0], PHASES, budget_bytes=70)
    assert [r.phase for r in plan.phases if not r.fits] == ["optimizer"]  # needs 80 whatever the plan
    assert "OVER BUDGET" in str(plan)


def test_host_group_counts_in_host_bytes_never_in_a_peak():
    plan = MemoryPlan.build(grpo_groups(adam_kind="host")[0], PHASES)
    assert plan.phase("optimizer").peak_bytes == 10 + 20 + 10
    assert "adam" in plan.phase("optimizer").needed and "adam" not in plan.phase("optimizer").resident
    assert "adam" not in plan.phase("train").prefetch
    # host buffers: adam (always there) + every offload group that leaves the device somewhere
    assert plan.host_bytes == 40 + 20 + 10


def test_plan_json_and_table():
    plan = MemoryPlan.build(grpo_groups()[0], PHASES, budget_bytes=80)
    data = json.loads(plan.to_json())
    assert [p["phase"] for p in data["phases"]] == PHASES
    assert data["phases"][2]["peak_bytes"] == 75 and data["budget_bytes"] == 80
    assert {g["name"]: g["nbytes"] for g in data["groups"]} == SIZES
    text = str(plan)
    assert all(p in text for p in PHASES) and "drained" in text


def test_plan_rejects_unknown_phase_and_duplicate_names():
    with pytest.raises(ValueError, match="'ghost'.*'eval'"):
        MemoryPlan.build([TensorGroup("ghost", frozenset({"eval"}), nbytes=1)], PHASES)
    with pytest.raises(ValueError, match="duplicate group names: \\['a'\\]"):
        MemoryPlan.build([TensorGroup("a", frozenset({"ref"}), nbytes=1)] * 2, PHASES)


# ---- the manager on CPU: bookkeeping ------------------------------------------------------------------------------
def test_cpu_noop_manager_tracks_the_plan():
    groups, state = grpo_groups(with_tensors=True)
    plan = MemoryPlan.build(groups, PHASES, budget_bytes=80)
    before = {n: t.clone() for n, t in state["data"].items()}
    manager = MemoryManager(plan, groups, "cpu")
    assert isinstance(manager.engine, NoCopyEngine)
    for cycle in range(2):
        for phase in PHASES:
            record = manager.enter(phase)
            row = plan.phase(phase)
            assert record.tracked_bytes == row.peak_bytes, (cycle, phase)
            assert state["pool"].reserved == (phase == "rollout")
            if cycle == 1:  # from the second cycle on, the transfers are exactly the plan's
                assert (set(record.offloaded), set(record.loaded), set(record.prefetched)) == \
                       (set(row.offload), set(row.load), set(row.prefetch)), phase
    manager.close()
    assert all(torch.equal(state["data"][n], before[n]) for n in before)  # device == host: nothing moved
    assert all(r.measured_peak_bytes is None for r in manager.records)



def test_bytes_copied_per_step_are_the_plans():
    # budget 80 (see above): rollout copies master + adam out (60) and ref in (10); train copies ref out (10) and
    # adam in (40); the optimizer loads master (20); freeing the KV pool copies nothing
    groups, _ = grpo_groups(with_tensors=True)
    plan = MemoryPlan.build(groups, PHASES, budget_bytes=80)
    assert {r.phase: (r.copy_in_bytes, r.copy_out_bytes) for r in plan.phases} == {
        "rollout": (10, 60), "ref": (0, 0), "train": (40, 10), "optimizer": (20, 0)}
    assert (plan.copy_in_bytes, plan.copy_out_bytes) == (70, 70)
    assert "in 0.00 GiB, out 0.00 GiB" in str(plan)
    manager = MemoryManager(plan, groups, "cpu")
    for cycle in range(2):
        for phase in PHASES:
            record = manager.enter(phase)
            if cycle == 1:
                row = plan.phase(phase)
                assert (record.copy_in_bytes, record.copy_out_bytes) == (row.copy_in_bytes, row.copy_out_bytes)

def test_a_drained_phase_starts_after_its_copies_out_and_data_survives_the_cycle():
    groups, state = grpo_groups(with_tensors=True)
    plan = MemoryPlan.build(groups, PHASES, budget_bytes=80)  # rollout drains master + adam (see above)
    data, before = state["data"], {n: t.clone() for n, t in state["data"].items()}
    manager = MemoryManager(plan, groups, "cpu", engine=ThreadCopyEngine())
    for cycle in range(2):
        manager.enter("rollout")
        # no synchronize(): enter itself waited for the copies out, so the storages are already freed
        assert data["master"].untyped_storage().nbytes() == 0 and data["adam"].untyped_storage().nbytes() == 0
        for phase in PHASES[1:]:
            manager.enter(phase)
        assert all(torch.equal(data[n], before[n]) for n in plan.phase("optimizer").needed if n in data)
    manager.synchronize()
    assert all(torch.equal(data[n], before[n]) for n in ["actor", "master", "adam"])


def test_kv_pool_group_is_released_and_reserved():
    pool = GroupKVPool(num_layers=2, num_kv_heads=1, head_dim=4, n=2, max_prompt=8, max_new=4, budget_bytes=10**6,
                       max_groups=2, dtype=torch.float32, device=torch.device("cpu"))
    full = pool.allocated_bytes
    group = kv_pool_group(pool, needed_in={"rollout"})
    # groups x (K, V) x layers x kv heads x head dim x 4 B x (prompt + n x new tokens)
    assert group.planned_bytes() == full == 2 * 2 * 2 * 1 * 4 * 4 * (8 + 2 * 4)
    plan = MemoryPlan.build([group], ["rollout", "ref", "train"])
    manager = MemoryManager(plan, [group], "cpu")
    seen = []
    for phase in ["rollout", "ref", "train", "rollout"]:
        record = manager.enter(phase)
        seen.append((phase, pool.allocated_bytes, pool.prefix_k is None, record.tracked_bytes))
    assert seen == [("rollout", full, False, full), ("ref", 0, True, 0), ("train", 0, True, 0),
                    ("rollout", full, False, full)]
    assert manager.records[1].offloaded == ["kv_pool"] and manager.records[3].loaded == ["kv_pool"]


# ---- real moves: offload -> prefetch ------------------------------------------------------------------------------
# "use" needs the groups, "idle" does not and neither does its next phase (so they leave), "other" prefetches them.
MOVE_PHASES = ["use", "idle", "other"]


ENGINES = [("cpu", lambda device: ThreadCopyEngine())]
if torch.cuda.is_available():  # the same specification for the CUDA copy stream where there is one
    from torchplex.runtime.memory import CudaStreamCopyEngine

    ENGINES.append(("cuda", CudaStreamCopyEngine))


def tiny_model_and_optimizer(device, seed=0):
    torch.manual_seed(seed)
    model = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 4)).to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, foreach=True)
    return model, optimizer


def train_step(model, optimizer, x):
    optimizer.zero_grad(set_to_none=True)
    model(x).square().mean().backward()
    optimizer.step()


def state_tensors(optimizer):
    return [v for s in optimizer.state.values() for v in s.values()]


@pytest.mark.parametrize("device,make_engine", ENGINES, ids=[d for d, _ in ENGINES])
def test_offload_then_prefetch_is_bitwise_and_the_model_still_trains(device, make_engine):
    model, optimizer = tiny_model_and_optimizer(device)
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(1)).to(device)
    train_step(model, optimizer, x)  # the optimizer state now exists
    ref_model = copy.deepcopy(model)  # the same step without the manager
    ref_optimizer = torch.optim.AdamW(ref_model.parameters(), lr=1e-2, foreach=True)
    ref_optimizer.load_state_dict(copy.deepcopy(optimizer.state_dict()))

    groups = [module_group("weights", model, {"use"}), optimizer_state_group("adam", optimizer, {"use"})]
    engine = make_engine(torch.device(device))
    manager = MemoryManager(MemoryPlan.build(groups, MOVE_PHASES), groups, device, engine=engine)
    manager.enter("use")
    record = manager.enter("idle")
    manager.synchronize()
    assert set(record.offloaded) == {"weights", "adam"}
    device_state = [t for t in state_tensors(optimizer) if t.device.type == device]
    assert all(t.untyped_storage().nbytes() == 0 for t in [*model.parameters(), *device_state])  # really freed
    manager.enter("other")
    manager.enter("use")

    for p, q in zip(model.parameters(), ref_model.parameters()):
        assert torch.equal(p, q)
    for a, b in zip(state_tensors(optimizer), state_tensors(ref_optimizer)):
        assert torch.equal(a, b)
    train_step(model, optimizer, x)  # same Python objects: the optimizer still steps the module's parameters
    train_step(ref_model, ref_optimizer, x)
    for p, q in zip(model.parameters(), ref_model.parameters()):
        assert torch.equal(p, q)


def test_enter_waits_for_a_slow_prefetch_and_does_not_wait_for_the_next_ones():
    gate = threading.Event()
    copies_done = []

    def slow_copy(dst, src):  # a copy that only finishes when the test opens the gate
        gate.wait()
        dst.copy_(src)
        copies_done.append(time.perf_counter())

    weights = torch.arange(64, dtype=torch.float32)
    expected = weights.clone()
    group = TensorGroup("weights", frozenset({"use"}), tensors=lambda: [weights])
    manager = MemoryManager(MemoryPlan.build([group], MOVE_PHASES), [group], "cpu", engine=ThreadCopyEngine(slow_copy))
    gate.set()
    manager.enter("use")
    manager.enter("idle")
    manager.synchronize()  # offloaded: storage freed
    assert weights.untyped_storage().nbytes() == 0

    gate.clear()
    try:
        record = manager.enter("other")  # starts the prefetch for "use" and returns while the copy is held
        assert record.prefetched == ["weights"] and len(copies_done) == 1

        returned = []
        entering = threading.Thread(target=lambda: returned.append((manager.enter("use"), time.perf_counter())))
        entering.start()
        entering.join(timeout=0.3)
        assert entering.is_alive() and not returned  # "use" may not start: its prefetch has not landed
    finally:
        gate.set()  # never leave the copy thread blocked
    entering.join(timeout=10)
    assert not entering.is_alive()
    assert len(copies_done) == 2 and returned[0][1] >= copies_done[-1]  # it returned only after the copy finished
    assert torch.equal(weights, expected)


def test_torchao_8bit_state_round_trips_bitwise():
    from torchao.optim.subclass_8bit import OptimState8bit

    state = OptimState8bit.zeros((64, 64), True, 256, "cpu")
    g = torch.Generator().manual_seed(0)
    state.codes.copy_(torch.randint(0, 256, state.codes.shape, generator=g, dtype=torch.uint8))
    state.scale.copy_(torch.rand(state.scale.shape, generator=g))
    before = [state.codes.clone(), state.scale.clone(), state.qmap.clone()]
    group = TensorGroup("adam8bit", frozenset({"use"}), tensors=lambda: [state])
    assert group.planned_bytes() == 64 * 64 + 16 * 4 + 256 * 4  # codes (uint8) + block scales + code map (fp32)
    manager = MemoryManager(MemoryPlan.build([group], MOVE_PHASES), [group], "cpu", engine=ThreadCopyEngine())
    for phase in ["use", "idle"]:
        manager.enter(phase)
    manager.synchronize()
    assert state.codes.untyped_storage().nbytes() == 0
    for phase in ["other", "use"]:
        manager.enter(phase)
    assert all(torch.equal(a, b) for a, b in zip([state.codes, state.scale, state.qmap], before))


def test_groups_sharing_a_storage_are_refused_unless_excluded():
    actor = torch.nn.Linear(4, 4)
    reference = torch.nn.Sequential(torch.nn.Linear(4, 4))
    reference[0].weight = actor.weight  # e.g. a frozen vision tower shared by actor and reference
    shared = [module_group("actor", actor, {"train"}), module_group("reference", reference, {"ref"})]
    with pytest.raises(ValueError, match="'actor' and 'reference' share a storage"):
        MemoryManager(MemoryPlan.build(shared, ["ref", "train"]), shared, "cpu")
    owned = [shared[0], module_group("reference", reference, {"ref"}, exclude=actor.parameters())]
    MemoryManager(MemoryPlan.build(owned, ["ref", "train"]), owned, "cpu")
