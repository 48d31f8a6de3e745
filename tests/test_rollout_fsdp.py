"""Rollout on an FSDP2-sharded actor: ranks decode independently (different prompts, lengths, even none).

Every forward of an FSDP2 unit all-gathers its parameters unless it is already gathered, so with per-forward
gathers a rank that stops decoding earlier than another leaves that one waiting in a collective. The engine gathers
the model once per `generate` (`distributed.fsdp.gathered`); here two gloo ranks run different requests — different
prompt counts, response caps, and one rank a rollout with no prompts — and each must return what the plain model
returns for its request in this process.
"""

from __future__ import annotations

import pytest
import torch
from PIL import Image

from distributed_helpers import free_port, init_gloo, spawn
from torchplex.data.processing import encode_prompt, load_processor
from torchplex.models.qwen2_5_vl.build import build_model
from torchplex.models.qwen2_5_vl.parallelize import apply_fsdp
from torchplex.rollout.engine import RolloutEngine
from torchplex.rollout.sampling import SamplingParams

TIMEOUT_S = 150


def prompts_and_requests(ckpt):
    """The prompts, and per rank a list of (prompt indices, sampling params) rollouts run one after another."""
    processor = load_processor(ckpt)
    rng = torch.Generator().manual_seed(0)
    image = lambda w, h: Image.fromarray(torch.randint(0, 255, (h, w, 3), generator=rng, dtype=torch.uint8).numpy())
    prompts = [encode_prompt(processor, "How many circles are in the image?", images=[image(56, 56)]),
               encode_prompt(processor, "Say something about the colour red."),
               encode_prompt(processor, "Which is left, the square or the circle?", images=[image(84, 112)])]
    params = lambda cap, seed: SamplingParams(n=2, temperature=1.0, max_new_tokens=cap, seed=seed)
    requests = {0: [([0], params(3, 1)), ([], params(4, 2)), ([2], params(2, 3))],
                1: [([1, 2], params(7, 1)), ([0], params(4, 2)), ([1], params(5, 3))]}
    return prompts, requests


def rollouts(model, prompts, requests):
    engine = RolloutEngine(model, kv_pool_bytes=64 * 2**20, compile_decode=False)
    out = []
    for indices, params in requests:
        outputs = engine.generate([prompts[i] for i in indices], params)
        out.append([[(o.token_ids, o.logprobs) for o in group] for group in outputs])
        engine.release()
    return out


def worker(rank: int, world_size: int, port: int, ckpt, out_dir) -> None:
    from torch.distributed.device_mesh import init_device_mesh

    init_gloo(rank, world_size, port)
    try:
        torch.manual_seed(0)
        model = build_model(hf_dir=ckpt).eval()
        apply_fsdp(model, init_device_mesh("cpu", (world_size,)), torch.float32, torch.float32)
        prompts, requests = prompts_and_requests(ckpt)
        torch.save(rollouts(model, prompts, requests[rank]), out_dir / f"rank{rank}.pt")
    finally:
        torch.distributed.destroy_process_group()


@pytest.mark.slow
def test_ranks_with_different_rollouts_decode_independently(tiny_ckpt, tmp_path):
    spawn(worker, 2, (free_port(), tiny_ckpt, tmp_path), TIMEOUT_S, "FSDP2 rollouts of different lengths")
    model = build_model(hf_dir=tiny_ckpt).eval()
    prompts, requests = prompts_and_requests(tiny_ckpt)
    longest = []  # per rank, its first rollout's longest response: the decode steps it ran
    for rank in (0, 1):
        got, expected = torch.load(tmp_path / f"rank{rank}.pt"), rollouts(model, prompts, requests[rank])
        longest.append(max(len(t) for group in expected[0] for t, _ in group))
        assert [len(r) for r in got] == [len(r) for r in expected]
        for got_rollout, expected_rollout in zip(got, expected):
            for got_group, expected_group in zip(got_rollout, expected_rollout):
                for (tokens, logprobs), (want_tokens, want_logprobs) in zip(got_group, expected_group):
                    assert tokens == want_tokens
                    torch.testing.assert_close(torch.tensor(logprobs), torch.tensor(want_logprobs), rtol=1e-5,
                                               atol=1e-6)
    assert longest[0] != longest[1]  # the two ranks really decoded different numbers of steps
