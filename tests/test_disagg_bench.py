"""Specification of benchmarks/disagg_bench.py on CPU: the colocated and disaggregated layouts run the same step.

One torchrun launch of 2 gloo ranks, debug geometry, 2 prompts x 4 samples x 6 new tokens, one step per layout.
  - The first step's sampled tokens are the same in both layouts (reference: the colocated FSDP run, where each
    rank sampled half the prompts; tolerance: none, every token equal), since both start from the same seeded
    weights and seed each sample by the prompt's global index.
  - After the disaggregated transfer, the rollout rank's weights equal the trainer's bit for bit (exact integer
    checksums over every parameter's bits), and the step did change them (lr 1e-3), so the check can fail.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from torchplex.rollout.engine import SampleOutput
from benchmarks.disaggregation import _pack, _unpack, plan_buckets

REPO_ROOT = Path(__file__).resolve().parents[1]
PROMPTS, GROUP, MAX_NEW = 2, 4, 6


@pytest.fixture(scope="module")
def bench_result(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("disagg") / "result.json"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(REPO_ROOT / "benchmarks" / "disagg_bench.py"), "--device", "cpu", "--backend", "gloo",
           "--geometry", "debug", "--layouts", "colocated_fsdp,disaggregated", "--colocated-modes", "serial",
           "--prompts", str(PROMPTS), "--prompt-tokens", "40", "--group", str(GROUP), "--max-new", str(MAX_NEW),
           "--warmup", "0", "--steps", "1", "--lr", "1e-3", "--record-tokens", "--watchdog-s", "120",
           "--out", str(out)]
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=REPO_ROOT, env=env, capture_output=True, text=True, timeout=150)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.mark.slow
def test_first_step_tokens_are_the_same_in_both_layouts(bench_result):
    colocated = bench_result["colocated_fsdp"]["first_step_tokens"]
    disaggregated = bench_result["disaggregated"]["first_step_tokens"]
    assert len(colocated) == PROMPTS * GROUP and all(len(t) == MAX_NEW for t in colocated)
    assert len({tuple(t) for t in colocated}) > 1  # samples differ: the comparison is not between constants
    assert disaggregated == colocated
    assert bench_result["first_step_token_agreement"]["colocated_fsdp"] == 1.0


@pytest.mark.slow
def test_rollout_rank_receives_the_trainers_weights_bitwise(bench_result):
    disaggregated = bench_result["disaggregated"]
    assert disaggregated["weights_changed_by_step_0"]
    assert disaggregated["weights_equal_after_transfer"] == [True]
    assert disaggregated["weight_transfer_gib"] > 0 and disaggregated["step_s"] > 0
    assert bench_result["ratio_colocated_over_disaggregated"]["colocated_fsdp"]["serial"] > 0


def test_buckets_keep_order_split_at_the_byte_limit_and_at_dtype_changes():
    f32 = lambda n: torch.zeros(n, dtype=torch.float32)  # 4 bytes per element
    tensors = [f32(10), f32(10), f32(10), torch.zeros(4, dtype=torch.bfloat16), f32(100), f32(1)]
    # 80 bytes: two fp32x10 fit, the third starts a bucket; a dtype change always does; a tensor over the limit
    # gets a bucket of its own.
    assert plan_buckets(tensors, bucket_bytes=80) == [[0, 1], [2], [3], [4], [5]]
    assert [i for b in plan_buckets(tensors, bucket_bytes=10**6) for i in b] == list(range(len(tensors)))


def test_rollout_outputs_survive_the_wire_format_exactly():
    g = torch.Generator().manual_seed(0)
    outputs = [[SampleOutput(i, j, torch.randint(0, 150000, (c,), generator=g).tolist(),
                             torch.randn(c, generator=g).tolist(), reason)
                for j, (c, reason) in enumerate([(5, "length"), (2, "stop"), (1, "stop")])] for i in range(2)]
    ids, logprobs = _pack(outputs, max_new=5, device="cpu")
    back = _unpack(ids, logprobs, num_prompts=2, n=3)
    for got, want in zip([o for grp in back for o in grp], [o for grp in outputs for o in grp]):
        assert (got.prompt_index, got.sample_index, got.token_ids, got.finish_reason) == \
            (want.prompt_index, want.sample_index, want.token_ids, want.finish_reason)
        # float32 on both ends of the wire: bit-exact (tolerance 0)
        assert got.logprobs == torch.tensor(want.logprobs, dtype=torch.float32).tolist()
