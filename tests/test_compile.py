"""model.compile with activation checkpointing, the recipes' settings: a whole GRPO step in every mode compiles a
bounded number of graphs however many decoder layers the model has (nothing per layer in what dynamo guards: a
graph per layer used to exhaust the recompile limit at 7B's 28 layers and fail the first step on torch 2.11), and
gives the uncompiled step's numbers (fp32, 1e-5)."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend

from torchplex.models.qwen2_5_vl.model import Qwen2_5_VLModel

from torchplex.models.qwen2_5_vl.parallelize import COMPILED_GRAPHS, apply_compile, parallelize_qwen2_5_vl
from torchplex.rollout.sampling import SamplingParams

from step_runners import cpu_runner

LAYERS = 2 * COMPILED_GRAPHS  # more decoder layers than the graphs a compiled layer function may keep
TOL = 1e-5


@pytest.fixture(scope="module")
def deep_setup(grpo_assets):
    """The tiny checkpoint's geometry with LAYERS decoder layers, random weights; actor and reference differ."""
    base = grpo_assets.actor
    args = dataclasses.replace(base.args, text=dataclasses.replace(base.args.text, num_layers=LAYERS))
    models = []
    for seed in (0, 1):
        model = Qwen2_5_VLModel(args)
        model.init_weights(std=0.05, generator=torch.Generator().manual_seed(seed))
        models.append(model)
    return grpo_assets.processor, grpo_assets.prompts, models[0], models[1].eval().requires_grad_(False)


def run_step(runner, setup):
    processor, prompts = setup[0], setup[1]
    eos = processor.tokenizer.convert_tokens_to_ids("<|im_end|>")
    params = SamplingParams(n=2, max_new_tokens=4, seed=3, stop_token_ids=[eos])
    return runner.run(prompts, [""] * len(prompts), params)


@pytest.mark.parametrize("mode", ["serial", "decomposed", "overlapped"])
def test_compiled_checkpointed_step_compiles_a_bounded_number_of_graphs(deep_setup, mode):
    eager = cpu_runner(deep_setup, mode, budget=0, micro_batch=4, kv_pool=2**24, checkpointed=True,
                       recompute="always")
    expected = run_step(eager, deep_setup)
    compiled = cpu_runner(deep_setup, mode, budget=0, micro_batch=4, kv_pool=2**24, checkpointed=True,
                       recompute="always")
    counter = CompileCounterWithBackend("aot_eager")
    torch._dynamo.reset()
    apply_compile(compiled.actor, backend=counter)
    with torch._dynamo.config.patch(fail_on_recompile_limit_hit=True):  # never a silent fall-back to eager
        out = run_step(compiled, deep_setup)
    assert 0 < counter.frame_count <= COMPILED_GRAPHS, f"{counter.frame_count} graphs for {LAYERS} layers"
    assert out.train.recompute["on"] > 0  # the checkpointed layers recomputed around the compiled functions
    assert torch.equal(out.experience.tokens, expected.experience.tokens)
    assert float((out.train.stats.loss - expected.train.stats.loss).abs()) <= TOL * float(expected.train.stats.loss.abs())
    for got, want in zip(compiled.optimizer.grads, eager.optimizer.grads):
        assert float((got - want).abs().max()) <= TOL * float(want.abs().max()) + 1e-12


def test_parallelize_compiles_the_layer_functions_and_checkpoints_the_eager_layer(grpo_assets):
    model = parallelize_qwen2_5_vl(copy.deepcopy(grpo_assets.actor), None, activation_checkpointing=True,
                                   compile=True, compile_backend="eager")
    layer = model.layers[0]
    assert type(layer).__name__ == "CheckpointedDecoderLayer"
    assert "attention_inputs" in vars(layer) and "attention_outputs" in vars(layer)  # the compiled functions
    assert not hasattr(layer, "_compiled_call_impl") or layer._compiled_call_impl is None  # the layer call is eager
