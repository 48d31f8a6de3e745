"""Training's spans timed on host and device (components/span_clock): the spans a step records, in order, and the
totals; CUDA's events are stood in for on CPU."""

import time

import pytest
import torch

from torchplex.components.span_clock import SpanClock, span_totals

from step_runners import cpu_runner


def test_host_spans_and_totals():
    clock = SpanClock(torch.device("cpu"))
    for name, pause in (("recompute", 0.02), ("whole_graph", 0.0), ("recompute", 0.01)):
        with clock.span(name):
            time.sleep(pause)
    spans = clock.spans()
    assert [s["name"] for s in spans] == ["recompute", "whole_graph", "recompute"]
    assert spans[0]["host_s"] >= 0.02 and spans[2]["host_s"] >= 0.01
    assert all(s["device_s"] is None and s["idle_before_s"] is None for s in spans)
    totals = span_totals(spans)
    assert totals["recompute"]["count"] == 2 and totals["whole_graph"]["count"] == 1
    assert totals["recompute"]["host_s"] == pytest.approx(spans[0]["host_s"] + spans[2]["host_s"])
    assert totals["recompute"]["device_s"] is None


class _Event:
    """A CUDA event stood in for: `record` stamps the stand-in stream's clock."""
    now = 0.0

    def __init__(self, enable_timing=False):
        self.at = None

    def record(self):
        self.at = _Event.now

    def elapsed_time(self, other):  # milliseconds, as CUDA's
        return (other.at - self.at) * 1e3


def test_device_time_and_the_idle_between_spans(monkeypatch):
    monkeypatch.setattr(torch.cuda, "Event", _Event)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    clock = SpanClock(torch.device("cpu"))
    clock.cuda = True
    for name, start, end in (("prefix_forward", 0.0, 1.0), ("recompute", 1.5, 2.0), ("optimizer", 2.0, 2.25)):
        _Event.now = start
        with clock.span(name):
            _Event.now = end
    spans = clock.spans()
    assert [s["device_s"] for s in spans] == pytest.approx([1.0, 0.5, 0.25])
    assert [s["idle_before_s"] for s in spans] == [None, pytest.approx(0.5), pytest.approx(0.0)]
    assert span_totals(spans)["recompute"]["idle_before_s"] == pytest.approx(0.5)


@pytest.mark.parametrize("mode", ["decomposed", "overlapped"])
def test_a_step_times_each_micro_batch_the_prefix_backward_and_the_optimizer(grpo_assets, mode):
    from torchplex.rollout.sampling import SamplingParams

    setup = (grpo_assets.processor, grpo_assets.prompts, grpo_assets.actor, grpo_assets.reference)
    runner = cpu_runner(setup, mode, budget=2**40, micro_batch=4, kv_pool=2 * 2**20, checkpointed=True,
                        time_train=True)
    out = runner.run(setup[1], [""] * 3, SamplingParams(n=4, max_new_tokens=6, seed=3))
    names = [s["name"] for s in out.train.spans]
    whole = out.schedule.memory["recompute"]["whole"]  # each training forward's choice, in order
    assert len(whole) == 3  # one micro-batch per prompt (4 samples each)
    # decomposed runs the held prefixes' batched forward in the train stage; overlapped held them from the rollout
    assert names == (["prefix_forward"] if mode == "decomposed" else []) + [
        "whole_graph" if w else "recompute" for w in whole] + ["prefix_backward", "optimizer"]
    assert all(s["host_s"] > 0 for s in out.train.spans)
    untimed = cpu_runner(setup, mode, budget=2**40, micro_batch=4, kv_pool=2 * 2**20, checkpointed=True)
    assert untimed.run(setup[1], [""] * 3, SamplingParams(n=4, max_new_tokens=6, seed=3)).train.spans == []
