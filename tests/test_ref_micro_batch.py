"""algorithm.ref_micro_batch_size: reference scoring in larger micro-batches (fewer, bigger forwards) gives the
same reference log-probs and the same step, in every mode."""

from __future__ import annotations

import pytest
import torch

from step_runners import cpu_runner, run_recording
from torchplex.config import ConfigError, load_config
from torchplex.runtime.build import step_settings


@pytest.fixture(scope="module")
def setup(grpo_assets):
    return grpo_assets.processor, grpo_assets.prompts, grpo_assets.actor, grpo_assets.reference


def step(setup, mode, ref_micro_batch):
    """One step, and how many forwards the reference's first decoder layer ran."""
    runner = cpu_runner(setup, mode, budget=2**40, micro_batch=4, kv_pool=2 * 2**20,
                        ref_micro_batch_size=ref_micro_batch)
    forwards = []
    out = run_recording(runner, setup, runner.reference.layers[0], lambda args: forwards.append(args[0].shape[0]))
    return out, len(forwards)


@pytest.mark.parametrize("mode", ["serial", "decomposed"])
def test_larger_reference_micro_batches_score_the_same_in_fewer_forwards(setup, mode):
    base, base_forwards = step(setup, mode, 0)   # micro_batch_size 4: one prompt's group per forward
    big, big_forwards = step(setup, mode, 12)    # every prompt's group at once
    assert big_forwards < base_forwards
    mask = base.experience.mask
    assert torch.equal(big.experience.tokens, base.experience.tokens)
    ref, got = base.experience.ref_logprobs[mask], big.experience.ref_logprobs[mask]
    assert ((got - ref).abs().max() / ref.abs().max()).item() < 1e-6
    assert abs(big.train.stats.loss - base.train.stats.loss) <= 1e-6 * abs(base.train.stats.loss) + 1e-9


def test_the_config_key_reaches_the_step_and_refuses_negative_values():
    assert step_settings(load_config(["--algorithm.ref_micro_batch_size", "32"])).ref_micro_batch_size == 32
    with pytest.raises(ConfigError, match="algorithm.ref_micro_batch_size"):
        load_config(["--algorithm.ref_micro_batch_size", "-1"])
