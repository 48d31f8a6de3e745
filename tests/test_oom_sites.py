"""benchmarks/oom_sites.py: the live blocks of an allocator snapshot summed by the code that allocated them."""

from benchmarks import oom_sites


def _block(size, state, *files):
    return {"size": size, "state": state,
            "frames": [{"filename": f, "line": i + 1, "name": f"fn{i}"} for i, f in enumerate(files)]}


def test_live_blocks_are_summed_by_our_innermost_frames_and_ranked():
    ours = "/x/torchplex/runtime/overlap.py"
    snapshot = {"segments": [
        {"blocks": [_block(3 << 30, "active_allocated", "/torch/nn/functional.py", ours),
                    _block(1 << 30, "active_allocated", "/torch/nn/functional.py", ours),
                    _block(5 << 30, "inactive", ours)]},  # cached, not live: not counted
        {"blocks": [_block(2 << 30, "active_allocated", "/torch/autograd/graph.py"),
                    _block(1 << 29, "active_allocated")]}]}
    s = oom_sites.summarize(snapshot)
    assert s["active_gib"] == 6.5
    first, second, third = s["sites"]
    assert first == {"gib": 4.0, "blocks": 2, "where": "runtime/overlap.py:2 fn1"}
    assert second["where"] == "autograd/graph.py:1 fn0" and second["gib"] == 2.0  # none of ours: the innermost
    assert third["where"] == "(no stack)" and third["gib"] == 0.5
    assert len(oom_sites.summarize(snapshot, top=1)["sites"]) == 1
