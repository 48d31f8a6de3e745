"""Streamed groups of the memory manager and the chunked fp32-master AdamW step that uses them.

- The plan of a streamed optimizer phase, checked by hand on a small example.
- The chunked master-weights step under a streaming manager (real copies on a worker thread) gives bitwise the
  parameters and AdamW state of one plain AdamW step over the same fp32 master tensors.
- No chunk is used before its prefetch has landed (a gated, slow copy), and the stream never holds more than the
  plan's window of chunks on the device.
- Resident chunks: the plan's count checked by hand (and forced to 0 by a phase without room), the manager's count
  of bytes equal to the plan's, resident chunks never moved nor waited on, and the chunked step with resident
  chunks bitwise equal to the one without.
"""

from __future__ import annotations

import threading
import time

import pytest
import torch

from torchplex.runtime.master_weights import MasterWeights, split_chunks
from torchplex.runtime.memory import (MemoryManager, MemoryPlan, NoCopyEngine, TensorGroup, ThreadCopyEngine,
                                      module_group, window_bytes)

# phases of the hand-checked example and their groups (bytes):
#   actor 10 (every phase, never moves)   kv 6 transient (rollout)   grads 10 transient (train, optimizer)
#   acts 15 transient (train)             state: 5 chunks of 4, streamed in optimizer, window of 3 chunks = 12
PHASES = ["rollout", "train", "optimizer"]


def example_groups(state_chunks=None, kv_bytes=6):
    tensors = {"actor": torch.zeros(10, dtype=torch.uint8)}
    chunks = state_chunks or [[torch.full((4,), i, dtype=torch.uint8)] for i in range(5)]
    return [TensorGroup("actor", frozenset(PHASES), tensors=lambda: [tensors["actor"]]),
            TensorGroup("kv", frozenset({"rollout"}), "transient", nbytes=kv_bytes),
            TensorGroup("grads", frozenset({"train", "optimizer"}), "transient", nbytes=10),
            TensorGroup("acts", frozenset({"train"}), "transient", nbytes=15),
            TensorGroup("state", frozenset({"optimizer"}), chunks=lambda: chunks, chunk_nbytes=[4] * 5)]


def summary(plan):
    return {r.phase: (r.peak_bytes, r.exposed_bytes, r.stream_window_bytes, r.prefetch_chunks) for r in plan.phases}


def test_plan_of_a_streamed_phase_under_a_budget():
    plan = MemoryPlan.build(example_groups(), PHASES, budget_bytes=45, stream_window=3)
    assert summary(plan) == {
        # the last 3 chunks the optimizer copied out may still be in flight: 10 + 6 + 12
        "rollout": (28, 0, 0, {}),
        # train holds actor + grads + acts = 35; 2 leading chunks (8) still fit under 45, a third would not
        "train": (43, 0, 0, {"state": 2}),
        # actor + grads + a window of 3 chunks; the 3 chunks not prefetched come in after entry: exposed
        "optimizer": (10 + 10 + 12, 12, 12, {}),
    }
    assert plan.phase("optimizer").streamed == ["state"] and "state" not in plan.phase("optimizer").resident
    assert plan.naive_peak_bytes == 10 + 20 + 10 + 15 and plan.host_bytes == 20
    assert plan.floor_bytes == 35  # train's own needs; the optimizer's floor is 20 + one window (12)
    assert "state[:2]" in str(plan) and "state(stream<=" in str(plan)


def test_plan_of_a_streamed_phase_without_budget_prefetches_every_chunk():
    plan = MemoryPlan.build(example_groups(), PHASES, stream_window=3)
    # all 5 chunks come in during train, so the optimizer starts with the whole state (cap 20) and exposes nothing
    assert summary(plan) == {"rollout": (10 + 6 + 20, 0, 0, {}), "train": (35 + 20, 0, 0, {"state": 5}),
                             "optimizer": (20 + 20, 0, 20, {})}


def test_streamed_groups_must_be_offload_and_needed_in_one_phase():
    with pytest.raises(ValueError, match="exactly one phase"):
        TensorGroup("s", frozenset({"train", "optimizer"}), chunk_nbytes=[1, 1])
    other = TensorGroup("t", frozenset({"optimizer"}), chunk_nbytes=[1, 1, 1])
    with pytest.raises(ValueError, match="different chunk counts"):
        MemoryPlan.build(example_groups() + [other], PHASES)


def test_noop_manager_tracks_the_streamed_plan():
    plan = MemoryPlan.build(example_groups(), PHASES, budget_bytes=45, stream_window=3)
    manager = MemoryManager(plan, example_groups(), "cpu")
    assert isinstance(manager.engine, NoCopyEngine)
    for cycle in range(2):
        for phase in PHASES:
            record = manager.enter(phase)
            walked = list(manager.stream(5)) if phase == "optimizer" else []
            if cycle == 1:  # steady state: the manager's own count reaches the plan's peak, and no more
                assert record.tracked_bytes == plan.phase(phase).peak_bytes, phase
        assert walked == [0, 1, 2, 3, 4]
    with pytest.raises(ValueError, match="walks 4 chunks"):
        manager.enter("optimizer")
        next(manager.stream(4))


def chunk_storages_bytes(chunks):
    return sum(t.untyped_storage().nbytes() for c in chunks for t in c)


def test_stream_uses_no_chunk_before_its_copy_and_keeps_the_window():
    gate = threading.Event()
    gate.set()

    def slow_copy(dst, src):  # every copy takes a while, and the test can hold them all
        gate.wait()
        time.sleep(0.002)
        dst.copy_(src)

    chunks = [[torch.full((256,), i, dtype=torch.float32), torch.arange(64, dtype=torch.float32) * i]
              for i in range(6)]
    expected = [[t.clone() for t in c] for c in chunks]
    group = TensorGroup("state", frozenset({"use"}), chunks=lambda: chunks,
                        chunk_nbytes=[(256 + 64) * 4] * 6)
    plan = MemoryPlan.build([group], ["idle", "use"], stream_window=3)
    assert plan.phase("idle").prefetch_chunks == {"state": 6}
    plan = MemoryPlan.build([group], ["idle", "use"], budget_bytes=6 * 1280, stream_window=3)
    assert plan.phase("idle").prefetch_chunks == {"state": 3} and plan.phase("use").stream_window_bytes == 3 * 1280
    manager = MemoryManager(plan, [group], "cpu", engine=ThreadCopyEngine(slow_copy))
    manager.enter("idle")
    manager.synchronize()
    assert chunk_storages_bytes(chunks[3:]) == 0  # copied out; the first 3 are prefetched for "use"

    for cycle in range(2):
        manager.enter("use")
        seen = []
        for i in manager.stream(6):
            # the chunk is here, whole: its copy in has finished (a partial copy would show other values)
            assert all(torch.equal(a, b) for a, b in zip(chunks[i], expected[i])), (cycle, i)
            seen.append(chunk_storages_bytes(chunks))
            for t in chunks[i]:
                t.add_(1)  # the phase writes its chunk: the next cycle must see it
            for e in expected[i]:
                e.add_(1)
        assert len(seen) == 6 and max(seen) <= 3 * 1280  # never more than the window on the "device"
        manager.enter("idle")

    manager.synchronize()
    gate.clear()
    try:  # hold every copy: "use" must not hand out chunk 3 (not prefetched) while its copy is held
        manager.enter("use")
        got = []
        walker = threading.Thread(target=lambda: got.extend(manager.stream(6)))
        walker.start()
        walker.join(timeout=0.3)
        assert walker.is_alive() and got == [0, 1, 2][:len(got)] and len(got) <= 3
    finally:
        gate.set()
    walker.join(timeout=10)
    assert got == list(range(6))


# ---- the chunked master-weights step ------------------------------------------------------------------------------
def bf16_model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.GELU(), torch.nn.Linear(32, 32),
                               torch.nn.Linear(32, 4)).to(torch.bfloat16)


def set_grads(params, step):
    g = torch.Generator().manual_seed(100 + step)
    for p in params:
        p.grad = torch.randn(p.shape, generator=g).to(torch.bfloat16)


def test_split_chunks_keeps_order_and_gives_large_tensors_their_own_chunk():
    assert split_chunks([3, 3, 10, 2, 2, 2], 6) == [[0, 1], [2], [3, 4, 5]]


@pytest.mark.parametrize("streamed", [False, True], ids=["unmanaged", "streamed"])
def test_chunked_master_step_equals_one_adamw_step_bitwise(streamed):
    hyper = dict(lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1)
    model, ref_model = bf16_model(), bf16_model()
    master = MasterWeights(model.parameters(), chunk_bytes=8 * 200, fused=False, **hyper)
    assert len(master.chunks) >= 3  # several chunks, or the test shows nothing
    # the reference: one torch AdamW over fp32 copies of the same bf16 parameters, bf16 grads widened to fp32
    ref_params = list(ref_model.parameters())
    ref_master = [p.detach().float().clone() for p in ref_params]
    ref_opt = torch.optim.AdamW(ref_master, foreach=True, **hyper)

    groups = [module_group("actor", model, PHASES), master.master_group(needed_in=PHASES),
              master.grads_group(), master.state_group()]
    if streamed:
        window = window_bytes([master.state_bytes(c) for c in master.chunks], 3)
        plan = MemoryPlan.build(groups, PHASES, budget_bytes=sum(g.planned_bytes() for g in groups[:3]) + window,
                                stream_window=3)
        master.memory = MemoryManager(plan, groups, "cpu", engine=ThreadCopyEngine())
        assert plan.phase("optimizer").streamed == ["optimizer_state"]
        assert 0 < plan.phase("train").prefetch_chunks["optimizer_state"] < len(master.chunks)
    for step in range(3):
        if master.memory is not None:
            master.memory.enter("rollout")
            master.memory.enter("train")
        set_grads(model.parameters(), step)
        set_grads(ref_params, step)
        master.step()
        for p, m in zip(ref_params, ref_master):
            m.grad = p.grad.float()
        ref_opt.step()
        with torch.no_grad():
            for p, m in zip(ref_params, ref_master):
                p.copy_(m)
                p.grad = None
        assert all(p.grad is None for p in model.parameters())  # freed by the step
    state_of = lambda i: [master.optimizer.state[master.master[j]] for j in master.chunks[i]]
    ref_state_of = lambda i: [ref_opt.state[ref_master[j]] for j in master.chunks[i]]
    chunks = range(len(master.chunks))
    if master.memory is not None:
        master.memory.enter("rollout")
        master.memory.synchronize()
        moments = [s[k] for i in chunks for s in state_of(i) for k in ("exp_avg", "exp_avg_sq")]
        assert moments and all(t.untyped_storage().nbytes() == 0 for t in moments)  # away outside the optimizer
        master.memory.enter("train")
        master.memory.enter("optimizer")
        chunks = master.memory.stream(len(master.chunks))  # compare each chunk's state while it is here
    for i in chunks:
        for a, b in zip(state_of(i), ref_state_of(i)):
            assert torch.equal(a["exp_avg"], b["exp_avg"]) and torch.equal(a["exp_avg_sq"], b["exp_avg_sq"])
            assert float(a["step"]) == float(b["step"]) == 3
    for p, q in zip(model.parameters(), ref_params):
        assert p.dtype == torch.bfloat16 and torch.equal(p, q)
    for m, r in zip(master.master, ref_master):
        assert torch.equal(m, r)


# ---- resident chunks ----------------------------------------------------------------------------------------------
def test_plan_keeps_the_chunks_every_phase_has_room_for_resident():
    # Budget 45. Train holds 35 of its own, so 2 chunks (8) fit there, resident or prefetched: the optimizer starts
    # with 2 chunks either way and brings the other 3 (12) in late, so exposed is 12 for R = 0, 1, 2; resident ones
    # are never copied, so R = 2 (a third chunk would take train to 47). Copies per step: 3 chunks in, 3 out.
    plan = MemoryPlan.build(example_groups(), PHASES, budget_bytes=45, stream_window=3, max_resident_chunks=None)
    assert plan.resident_chunks == {"state": 2}
    assert summary(plan) == {
        # actor + kv + the 2 resident chunks + the stream's last window (3 chunks) still going out
        "rollout": (10 + 6 + 8 + 12, 0, 0, {}),
        # train's room all taken by the resident chunks: nothing left to prefetch
        "train": (35 + 8, 0, 0, {}),
        # actor + grads + resident + a window of the 3 moving chunks, all of them loaded late
        "optimizer": (20 + 8 + 12, 12, 12, {}),
    }
    assert (plan.copy_in_bytes, plan.copy_out_bytes) == (12, 12)
    assert plan.host_bytes == 12  # host buffers for the moving chunks only
    assert "first 2 resident" in str(plan) and "state[:2]" in str(plan)
    assert plan.to_dict()["groups"][-1]["resident_chunks"] == 2
    # the same example without resident chunks (the default): 2 prefetched in train, 5 in and 5 out
    plain = MemoryPlan.build(example_groups(), PHASES, budget_bytes=45, stream_window=3)
    assert plain.resident_chunks == {"state": 0} and plain.phase("train").prefetch_chunks == {"state": 2}
    assert (plain.copy_in_bytes, plain.copy_out_bytes) == (20, 20)
    # a cap on R: one resident chunk, one prefetched after it
    one = MemoryPlan.build(example_groups(), PHASES, budget_bytes=45, stream_window=3, max_resident_chunks=1)
    assert one.resident_chunks == {"state": 1} and one.phase("train").prefetch_chunks == {"state": 1}
    assert "state[1:2]" in str(one) and one.phase("optimizer").exposed_bytes == 12


def test_a_phase_without_room_keeps_no_chunk_resident():
    # kv 20: rollout holds 10 + 20 + the stream's tail 12 = 42 of 45, so one resident chunk (4) would put it over
    # (or make it drain the tail, exposing 12 more); train can still prefetch 2 chunks, so R = 0 exposes least
    plan = MemoryPlan.build(example_groups(kv_bytes=20), PHASES, budget_bytes=45, stream_window=3,
                            max_resident_chunks=None)
    assert plan.resident_chunks == {"state": 0}
    assert summary(plan) == {"rollout": (42, 0, 0, {}), "train": (43, 0, 0, {"state": 2}),
                             "optimizer": (32, 12, 12, {})}


def test_without_budget_every_chunk_stays_resident():
    plan = MemoryPlan.build(example_groups(), PHASES, stream_window=3, max_resident_chunks=None)
    assert plan.resident_chunks == {"state": 5} and plan.copy_in_bytes == plan.copy_out_bytes == 0
    assert plan.host_bytes == 0 and sum(r.exposed_bytes for r in plan.phases) == 0
    assert [r.peak_bytes for r in plan.phases] == [10 + 6 + 20, 35 + 20, 20 + 20]


def test_noop_manager_tracks_the_plan_with_resident_chunks():
    plan = MemoryPlan.build(example_groups(), PHASES, budget_bytes=45, stream_window=3, max_resident_chunks=1)
    manager = MemoryManager(plan, example_groups(), "cpu")
    for cycle in range(3):
        for phase in PHASES:
            record = manager.enter(phase)
            if phase == "optimizer":
                assert list(manager.stream(5)) == [0, 1, 2, 3, 4]
            if cycle > 0:  # steady state: peaks and bytes copied are the plan's
                row = plan.phase(phase)
                assert record.tracked_bytes == row.peak_bytes, phase
                assert (record.copy_in_bytes, record.copy_out_bytes) == (row.copy_in_bytes, row.copy_out_bytes), phase
    assert plan.copy_in_bytes == plan.copy_out_bytes == 16


class CountingEngine(ThreadCopyEngine):
    """Real copies on a thread, gated by `gate`; remembers every tensor it moved."""

    def __init__(self):
        self.gate = threading.Event()
        self.gate.set()
        self.moved: list[int] = []
        super().__init__(self.gated_copy)

    def gated_copy(self, dst, src):
        self.gate.wait()
        dst.copy_(src)

    def offload(self, moves):
        self.moved += [id(m.tensor) for m in moves]
        return super().offload(moves)

    def prefetch(self, moves):
        self.moved += [id(m.tensor) for m in moves]
        return super().prefetch(moves)


def test_resident_chunks_are_never_moved_nor_waited_on():
    chunks = [[torch.full((4,), i, dtype=torch.uint8)] for i in range(5)]
    groups = example_groups(chunks)
    plan = MemoryPlan.build(groups, PHASES, budget_bytes=45, stream_window=3, max_resident_chunks=None)
    assert plan.resident_chunks == {"state": 2}
    engine = CountingEngine()
    manager = MemoryManager(plan, groups, "cpu", engine=engine)
    for cycle in range(2):
        for phase in PHASES:
            manager.enter(phase)
            if phase == "optimizer":
                for i in manager.stream(5):
                    chunks[i][0].add_(1)
                    # the moving chunks on the "device" stay within the window (3 chunks)
                    assert chunk_storages_bytes(chunks[2:]) <= plan.phase("optimizer").stream_window_bytes == 12
    manager.enter("rollout")
    manager.synchronize()
    resident = {id(t) for c in chunks[:2] for t in c}
    moving = [id(t) for c in chunks[2:] for t in c]
    assert not resident & set(engine.moved)
    assert all(engine.moved.count(t) == 5 for t in moving)  # out at the first rollout, then 2 cycles x (in, out)
    assert all(c[0].untyped_storage().nbytes() == (4 if i < 2 else 0) for i, c in enumerate(chunks))

    engine.gate.clear()  # hold every copy: the resident chunks are still handed out at once
    try:
        manager.enter("train")
        manager.enter("optimizer")
        got = []
        walker = threading.Thread(target=lambda: got.extend((i, int(chunks[i][0][0])) for i in manager.stream(5)))
        walker.start()
        walker.join(timeout=0.3)
        assert walker.is_alive() and [i for i, _ in got] == [0, 1]
    finally:
        engine.gate.set()
    walker.join(timeout=10)
    assert got == [(i, i + 2) for i in range(5)]  # every chunk as the two walks left it: resident or moved back


def layered_bf16_model(seed=0):
    torch.manual_seed(seed)
    return torch.nn.Sequential(*[torch.nn.Linear(16, 16) for _ in range(6)]).to(torch.bfloat16)


def run_master_steps(max_resident_chunks, steps=3):
    """Steps of the chunked master-weights AdamW under a streaming manager with real copies (one chunk per layer:
    2176 bytes of state), the budget leaving train room for 4 of the 6 chunks."""
    model = layered_bf16_model()
    master = MasterWeights(model.parameters(), chunk_bytes=8 * 272, fused=False, lr=1e-2, betas=(0.9, 0.95),
                           weight_decay=0.1)
    assert len(master.chunks) == 6
    groups = [module_group("actor", model, PHASES), master.master_group(needed_in=PHASES),
              master.grads_group(), master.state_group()]
    budget = sum(g.planned_bytes() for g in groups[:3]) + 4 * 2176
    plan = MemoryPlan.build(groups, PHASES, budget_bytes=budget, stream_window=3,
                            max_resident_chunks=max_resident_chunks)
    engine = CountingEngine()
    master.memory = MemoryManager(plan, groups, "cpu", engine=engine)
    for step in range(steps):
        master.memory.enter("rollout")
        master.memory.enter("train")
        set_grads(model.parameters(), step)
        master.step()
    master.memory.enter("rollout")
    master.memory.synchronize()
    states = []
    master.memory.enter("train")
    master.memory.enter("optimizer")
    for i in master.memory.stream(6):  # read each chunk's state while it is on the device
        states += [v.clone() for j in master.chunks[i] for v in master.optimizer.state[master.master[j]].values()]
    return plan, engine, [p.detach().clone() for p in model.parameters()], [m.clone() for m in master.master], states


def test_master_step_with_resident_chunks_is_bitwise_the_step_without():
    plan, engine, params, masters, states = run_master_steps(None)
    plain, plain_engine, ref_params, ref_masters, ref_states = run_master_steps(0)
    r = plan.resident_chunks["optimizer_state"]
    assert 0 < r < 6 and plain.resident_chunks["optimizer_state"] == 0
    # the same exposed bytes (train's room is shared), fewer copies
    assert sum(x.exposed_bytes for x in plan.phases) == sum(x.exposed_bytes for x in plain.phases)
    assert plan.copy_out_bytes == (6 - r) * 2176 < plain.copy_out_bytes == 6 * 2176
    assert len(engine.moved) < len(plain_engine.moved)
    assert all(torch.equal(a, b) for a, b in zip(params, ref_params))
    assert all(torch.equal(a, b) for a, b in zip(masters, ref_masters))
    assert len(states) == len(ref_states) == 6 * 2 * 3 and all(torch.equal(a, b) for a, b in zip(states, ref_states))
