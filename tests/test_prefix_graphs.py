"""The reference prefix as bucketed (compiled, captured) graphs against the model's own prefix forward."""

import copy

import pytest
import torch

from torchplex.rl.losses import PolicyLossConfig
from torchplex.rollout.engine import RolloutEngine
from torchplex.rollout.sampling import SamplingParams
from torchplex.runtime import prefix_graphs
from torchplex.runtime.decomposition import DecomposedScorer
from torchplex.runtime.executor import StepRunner, StepSettings
from torchplex.runtime.planner import PlanOptions
from torchplex.runtime.prefix_graphs import PrefixGraphs

RTOL = 1e-5  # fp32: the padded bucket and the unpadded prompt differ only in kernel rounding


def rel(a, b):
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


@pytest.fixture(scope="module")
def assets(grpo_assets):
    return grpo_assets.prompts, grpo_assets.reference


def eager_and_graphs(model, prompt, graphs):
    scorer = DecomposedScorer()
    with torch.no_grad():
        expected, batch = scorer.prefix(model, [prompt])
    image, _ = scorer.visual_embeds(model, [prompt])
    got = graphs(batch.input_ids, batch.position_ids, batch.next_position, image_embeds=image)
    return expected, got


def assert_same_prefix(got, expected):
    assert got.lengths.tolist() == expected.lengths.tolist()
    assert torch.equal(got.next_position, expected.next_position)
    assert rel(got.last_hidden, expected.last_hidden) < RTOL
    for a, b in zip(got.k + got.v, expected.k + expected.v):
        assert a.shape == b.shape
        assert rel(a, b) < RTOL


def test_padded_bucket_equals_the_prompt_forward(assets):
    """Each image prompt right-padded to a 64-token bucket (none is a multiple of 64) gives the prompt's own K/V
    and last hidden state: padding after a prompt cannot reach it under causal attention."""
    prompts, reference = assets
    graphs = PrefixGraphs(reference, bucket=64)
    assert not graphs.capture
    for prompt in prompts:
        assert len(prompt.input_ids) % 64
        expected, got = eager_and_graphs(reference, prompt, graphs)
        assert_same_prefix(got, expected)


@pytest.mark.slow
def test_compiled_bucket_equals_the_prompt_forward(assets):
    """The same through torch.compile (inductor's CPU backend; CUDA adds the captured graph on top)."""
    prompts, reference = assets
    graphs = PrefixGraphs(reference, bucket=128, compile=True)
    for prompt in prompts[:2]:
        expected, got = eager_and_graphs(reference, prompt, graphs)
        assert_same_prefix(got, expected)


def test_graphs_are_captured_once_per_bucket_and_again_after_the_weights_move(assets, monkeypatch):
    """A captured graph reads the weights at their capture-time addresses: a reload elsewhere (the memory manager
    offloading the reference) must drop the graphs. A stand-in for CapturedStep counts captures on CPU."""
    prompts, reference = assets
    model = copy.deepcopy(reference)
    made = []

    class CountingCapture:
        def __init__(self, fn, on_capture=None):
            made.append(self)
            self.fn = fn

        def __call__(self, *args):
            return self.fn(*args)

    monkeypatch.setattr(prefix_graphs, "CapturedStep", CountingCapture)
    graphs = PrefixGraphs(model, bucket=64)
    graphs.capture = True  # the bookkeeping of the CUDA path, replayed by the stand-in
    lengths = [len(p.input_ids) for p in prompts]
    buckets = {-(-n // 64) for n in lengths}
    for prompt in prompts + prompts:
        expected, got = eager_and_graphs(model, prompt, graphs)
        assert_same_prefix(got, expected)
    assert len(made) == len(buckets)
    with torch.no_grad():
        for p in model.parameters():  # new storage, same values: what an offload + reload does
            p.data = p.data.clone()
    eager_and_graphs(model, prompts[0], graphs)
    assert len(made) == len(buckets) + 1


def test_one_prompt_per_call():
    graphs = PrefixGraphs(torch.nn.Linear(2, 2))
    with pytest.raises(ValueError, match="one prompt at a time"):
        graphs(torch.zeros(2, 3, dtype=torch.long), torch.zeros(3, 2, 3, dtype=torch.long), torch.zeros(2))


def test_capture_needs_cuda():
    with pytest.raises(ValueError, match="CUDA"):
        PrefixGraphs(torch.nn.Linear(2, 2), capture=True)


def test_step_with_reference_prefix_graphs_equals_the_eager_step(grpo_assets):
    """Whole overlapped steps (reference prefix in the decode window) with and without the bucketed reference
    prefix: the same reference log-probs, loss and updated weights."""
    processor, prompts = grpo_assets.processor, grpo_assets.prompts

    def step(graphs_on):
        actor, ref = copy.deepcopy(grpo_assets.actor), copy.deepcopy(grpo_assets.reference)
        engine = RolloutEngine(actor, kv_pool_bytes=16 * 2**20)
        optimizer = torch.optim.SGD(actor.parameters(), lr=0.1)
        settings = StepSettings(reward_names=["format"], reward_weights=[1.0], micro_batch_size=4, grad_clip=1e9,
                                loss=PolicyLossConfig(kl_coef=0.1),
                                plan=PlanOptions(mode="overlapped", ref_prefix_in_window=True,
                                                 ref_prefix_graphs=graphs_on))
        runner = StepRunner(actor, ref, engine, optimizer, None, processor.tokenizer, settings)
        eos = processor.tokenizer.convert_tokens_to_ids("<|im_end|>")
        out = runner.run(prompts, [""] * len(prompts),
                         SamplingParams(n=4, max_new_tokens=6, stop_token_ids=[eos], seed=3))
        return out, actor, runner

    eager, eager_actor, _ = step(False)
    graphed, graphed_actor, runner = step(True)
    assert runner.scorer.prefix_graphs[id(runner.reference)].calls == len(prompts)
    assert any("compiled graphs" in r for r in graphed.schedule.reasons)
    mask = eager.experience.mask
    assert torch.equal(graphed.experience.tokens, eager.experience.tokens)
    assert rel(graphed.experience.ref_logprobs[mask], eager.experience.ref_logprobs[mask]) < RTOL
    assert rel(graphed.train.stats.loss, eager.train.stats.loss) < RTOL
    for (name, a), b in zip(graphed_actor.named_parameters(), eager_actor.parameters()):
        assert rel(a, b) < RTOL, name
