"""runtime.window_sms: the device cut into the decode window's SMs and the decode's (components/sm_partition.py).

The split itself needs a GPU (measured in benchmarks/probes/sm_partition_probe.py and scale_bench's window rows); here:
what is refused before it is tried, and what the split changes in the engine and the runner it is given to."""

from __future__ import annotations

import threading

import pytest
import torch

from torchplex.components.captured_step import CapturedStep
from torchplex.components.sm_partition import SmPartition, SmPartitionError, check_window_sms, split_sms
from torchplex.config import ConfigError, load_config
from torchplex.rollout.engine import RolloutEngine, SplitDecode
from torchplex.rollout.sampling import SamplingParams
from torchplex.runtime import build
from torchplex.runtime.build import build_step_runtime


@pytest.mark.parametrize("window_sms", [0, -8, 67, 132])
def test_a_window_of_no_sms_or_more_than_half_the_device_is_refused(window_sms):
    with pytest.raises(SmPartitionError, match=r"runtime\.window_sms = .*between 1 and half the device's 132"):
        check_window_sms(window_sms, 132)
    check_window_sms(66, 132)  # half the device stays the decode's


def test_without_cuda_the_split_fails_naming_the_key():
    with pytest.raises(SmPartitionError, match=r"runtime\.window_sms needs a CUDA device.*set it to 0"):
        split_sms(torch.device("cpu"), 32)


@pytest.mark.parametrize("args, keys", [
    (["--runtime.mode=overlapped", "--runtime.window_sms=32"], r"runtime\.window_sms.*reference_in_window"),
    (["--runtime.mode=decomposed", "--runtime.reference_in_window=true", "--runtime.window_sms=32"],
     r"runtime\.window_sms.*runtime\.mode"),
    (["--runtime.mode=overlapped", "--runtime.reference_in_window=true", "--runtime.window_sms=32"],
     r"runtime\.window_sms.*rollout\.compact_decode"),
    (["--runtime.window_sms=-1"], r"runtime\.window_sms.*>= 0"),
])
def test_a_split_without_window_work_is_refused_at_load_naming_the_keys(args, keys):
    """A split with nothing in the window would only take SMs from the decode."""
    with pytest.raises(ConfigError, match=keys):
        load_config(args)
    assert load_config(["--runtime.mode=overlapped", "--runtime.reference_in_window=true",
                        "--rollout.compact_decode=true", "--runtime.window_sms=32"]).runtime.window_sms == 32


def test_setting_a_split_drops_the_captured_steps(grpo_assets):
    """A captured decode graph keeps the SMs of the stream it was captured on: a new split must capture anew, or
    the decode would replay graphs of the old one (a captured fn left in place is what this sees)."""
    engine = RolloutEngine(grpo_assets.actor, kv_pool_bytes=2**20)
    for st in engine._steps.values():
        st.fn = st.fn_split = object()  # stands for captures of the previous split
    split = SplitDecode(stream=object(), active=lambda: True)
    engine.split_decode = split
    assert engine.split_decode is split
    assert all(st.fn is None and st.fn_split is None for st in engine._steps.values())
    for st in engine._steps.values():
        st.fn = "captured for this split"
    engine.split_decode = split  # the same split: its captures stay
    assert all(st.fn == "captured for this split" for st in engine._steps.values())


def test_a_split_decode_step_replays_the_split_graph_only_while_the_window_works(grpo_assets, monkeypatch):
    """Each step picks the graph captured on the decode's SMs while `active()` holds, else the one on every SM
    (what `_step` returns is what the decode loop calls per token)."""
    calls = []  # a replay of each capture, told apart by the stream it is captured on (the real ones need a GPU)
    monkeypatch.setattr(CapturedStep, "__call__", lambda self, *state: calls.append(
        "whole" if self.capture_stream is None else "split"))
    engine = RolloutEngine(grpo_assets.actor, kv_pool_bytes=2**20)
    busy = []
    engine.split_decode = SplitDecode(stream=object(), active=lambda: bool(busy))
    params = SamplingParams(n=2, max_new_tokens=4)
    engine._pool_for(2, 16, 4, 1)
    engine.use_graphs, engine.use_compile = True, False  # as on CUDA: two captures per layout
    step = engine._step(params)
    st = engine._steps["pool"]
    assert st.fn_split.capture_stream is engine.split_decode.stream and st.fn.capture_stream is None
    step(params)
    busy.append(1)
    step(params)
    busy.clear()
    step(params)
    assert calls == ["whole", "split", "whole"]
    engine.split_decode = None  # no split: one capture per layout
    engine._step(params)
    assert st.fn is not None and st.fn_split is None


def _runner(grpo_assets, engine, window_sms=32):
    actor = grpo_assets.actor
    cfg = load_config(["--runtime.mode=overlapped", "--runtime.reference_in_window=true",
                       "--rollout.compact_decode=true", f"--runtime.window_sms={window_sms}",
                       "--algorithm.kl_coef=0.1"])
    optimizer = torch.optim.AdamW([p for p in actor.parameters() if p.requires_grad], lr=0.0)
    return build_step_runtime(cfg, actor, grpo_assets.reference, engine, optimizer, None,
                              grpo_assets.processor.tokenizer)


def test_the_split_gives_the_window_its_stream_and_the_engine_the_decodes(grpo_assets, monkeypatch):
    decode, window = object(), object()
    asked = []

    def fake_split(device, window_sms):
        asked.append(window_sms)
        return SmPartition(decode_stream=decode, window_stream=window, decode_sms=84, window_sms=48, device_sms=132)

    monkeypatch.setattr(build, "split_sms", fake_split)
    engine = RolloutEngine(grpo_assets.actor, kv_pool_bytes=2**20)
    runner = _runner(grpo_assets, engine, window_sms=40)
    assert asked == [40]
    assert runner.window.stream is window
    assert engine.split_decode is runner.split_decode and engine.split_decode.stream is decode
    assert runner.sm_partition.describe() == "48 of 132 SMs for the decode window, 84 for the decode"
    # the decode takes the split's graph while the window has a job queued or running
    assert not engine.split_decode.active()
    runner.window.threaded, runner.window.stream = True, None  # the stand-in stream takes no CUDA event
    gate = threading.Event()
    runner.window.submit(gate.wait)
    assert engine.split_decode.active()
    gate.set()
    runner.window.finish()
    runner.window.close()
    assert not engine.split_decode.active()


def test_an_engine_that_cannot_split_its_decode_is_refused_naming_the_key(grpo_assets):
    class OtherEngine:
        pass

    with pytest.raises(ValueError, match=r"runtime\.window_sms: the rollout engine OtherEngine"):
        build.split_for_window(object(), OtherEngine(), 32)


def test_on_cpu_a_configured_split_fails_at_build_naming_the_key(grpo_assets):
    with pytest.raises(SmPartitionError, match=r"runtime\.window_sms needs a CUDA device"):
        _runner(grpo_assets, RolloutEngine(grpo_assets.actor, kv_pool_bytes=2**20))
