"""The disaggregated baseline of benchmarks/disagg_bench.py (not part of the product): what crosses between a
rollout process and a trainer process in a synchronous step.

The rollout process holds its own copy of the policy weights and a RolloutEngine; the trainer holds the actor,
the reference and the optimizer. Each step:
    rollout  --(sampled tokens, their log-probs, lengths)-->  trainer       `send_outputs` / `RemoteRollout`
    trainer  --(every updated parameter, bucketed)-->         rollout       `WeightTransfer`
Both are broadcasts from the sending rank on a process group that holds the two (NCCL on GPU, gloo on CPU), so
the receiving side simply blocks until the sender is there: rollout k+1 cannot start before the weights of step
k arrive (synchronous, on-policy). Nothing here knows about phases or the model beyond a list of tensors.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Sequence

import torch
import torch.distributed as dist

from torchplex.rollout.engine import RolloutStats, SampleOutput
from torchplex.rollout.protocol import RolloutCapabilities, reject_unsupported_hooks


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@dataclass
class TransferStats:
    seconds: float
    bytes: int
    messages: int


def plan_buckets(tensors: Sequence[torch.Tensor], bucket_bytes: int) -> list[list[int]]:
    """Consecutive runs of same-dtype tensors of at most `bucket_bytes` (a larger tensor gets a bucket alone)."""
    buckets: list[list[int]] = []
    total = 0
    for i, t in enumerate(tensors):
        nbytes = t.numel() * t.element_size()
        if not buckets or total + nbytes > bucket_bytes or t.dtype != tensors[buckets[-1][0]].dtype:
            buckets.append([])
            total = 0
        buckets[-1].append(i)
        total += nbytes
    return buckets


class WeightTransfer:
    """Broadcast a fixed list of parameters from rank `src` to the others, a bucket at a time.

    Both sides build it from their own tensors, in the same order (checked once, by names/shapes/dtypes). The
    receiver copies into its tensors in place: a rollout engine's captured decode graph keeps their addresses.
    One flat buffer per dtype, sized for the largest bucket, is reused every step.
    """

    def __init__(self, named: Sequence[tuple[str, torch.Tensor]], *, src: int, group=None,
                 bucket_bytes: int = 256 * 2**20):
        self.names = [n for n, _ in named]
        self.tensors = [t for _, t in named]
        self.src, self.group = src, group
        self.is_src = dist.get_rank() == src
        self.device = self.tensors[0].device
        signature = [(n, tuple(t.shape), str(t.dtype)) for n, t in named]
        theirs = [signature]
        dist.broadcast_object_list(theirs, src=src, group=group)
        if theirs[0] != signature:
            mismatch = next((a, b) for a, b in zip(theirs[0] + [None], signature + [None]) if a != b)
            raise ValueError(f"WeightTransfer: sender and receiver lists differ (first difference {mismatch})")
        self.buckets = plan_buckets(self.tensors, bucket_bytes)
        self.buffers: dict[torch.dtype, torch.Tensor] = {}
        for bucket in self.buckets:
            dtype = self.tensors[bucket[0]].dtype
            numel = sum(self.tensors[i].numel() for i in bucket)
            if numel > (self.buffers[dtype].numel() if dtype in self.buffers else 0):
                self.buffers[dtype] = torch.empty(numel, dtype=dtype, device=self.device)
        self.total_bytes = sum(t.numel() * t.element_size() for t in self.tensors)

    @torch.no_grad()
    def run(self) -> TransferStats:
        """Send (on src) or receive (elsewhere) every tensor; returns the wall time including a device sync."""
        _sync(self.device)
        t0 = time.perf_counter()
        for bucket in self.buckets:
            members = [self.tensors[i] for i in bucket]
            flat = self.buffers[members[0].dtype][:sum(t.numel() for t in members)]
            if self.is_src:
                torch.cat([t.reshape(-1) for t in members], out=flat)
            dist.broadcast(flat, src=self.src, group=self.group)
            if not self.is_src:
                offset = 0
                for t in members:
                    t.copy_(flat[offset:offset + t.numel()].view_as(t))
                    offset += t.numel()
        _sync(self.device)
        return TransferStats(time.perf_counter() - t0, self.total_bytes, len(self.buckets))


def _pack(outputs: list[list[SampleOutput]], max_new: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(N, max_new + 2) long: tokens, then length, then 1 for finish_reason "stop"; (N, max_new) float32 log-probs."""
    flat = [o for group in outputs for o in group]
    ids = torch.zeros(len(flat), max_new + 2, dtype=torch.long)
    logprobs = torch.zeros(len(flat), max_new, dtype=torch.float32)
    for s, o in enumerate(flat):
        c = len(o.token_ids)
        ids[s, :c] = torch.tensor(o.token_ids, dtype=torch.long)
        logprobs[s, :c] = torch.tensor(o.logprobs, dtype=torch.float32)
        ids[s, max_new] = c
        ids[s, max_new + 1] = int(o.finish_reason == "stop")
    return ids.to(device), logprobs.to(device)


def _unpack(ids: torch.Tensor, logprobs: torch.Tensor, num_prompts: int, n: int) -> list[list[SampleOutput]]:
    max_new = logprobs.shape[1]
    ids, logprobs = ids.cpu(), logprobs.cpu()
    outputs = []
    for i in range(num_prompts):
        group = []
        for j in range(n):
            s = i * n + j
            c = int(ids[s, max_new])
            group.append(SampleOutput(i, j, ids[s, :c].tolist(), logprobs[s, :c].tolist(),
                                      "stop" if int(ids[s, max_new + 1]) else "length"))
        outputs.append(group)
    return outputs


def send_outputs(outputs: list[list[SampleOutput]], max_new: int, *, src: int, device, group=None) -> TransferStats:
    """Rollout side: broadcast a step's samples (prompt-major, n per prompt) to the trainer."""
    ids, logprobs = _pack(outputs, max_new, device)
    _sync(device)
    t0 = time.perf_counter()
    dist.broadcast(ids, src=src, group=group)
    dist.broadcast(logprobs, src=src, group=group)
    _sync(device)
    return TransferStats(time.perf_counter() - t0, ids.numel() * 8 + logprobs.numel() * 4, 2)


@dataclass
class RemoteRollout:
    """The trainer's stand-in for a RolloutEngine: `generate` receives the samples the rollout rank broadcasts.

    It has the engine's call signature, so the step runs unchanged on the trainer: its "rollout" stage is
    then the wait for the rollout rank. The prefill/decode-window hooks cannot reach a remote engine: declared in
    `capabilities`, so the planner leaves an overlapped plan's fusion and window work on the trainer's main
    stream (and says so in the plan's reasons). Its KV cache lives in the rollout process: nothing of the trainer's
    memory budget. The weights travel the other way with `WeightTransfer`, which
    the caller runs after each optimizer step (both processes take part in that broadcast).
    """

    capabilities = RolloutCapabilities(
        prefill_hook=False, samples_finished_hook=False, step_hook=False, shares_actor_weights=False,
        why_not="disaggregated: rollout runs in another process")
    kv_pool_bytes = 0
    max_batch = 1 << 20
    prefill_tokens = 16384

    def pool_group_bytes(self, n: int, max_prompt: int, max_new: int) -> int:
        return 0

    src: int
    device: torch.device
    group: object = None
    stats: RolloutStats = field(default_factory=RolloutStats)
    last_wait_s: float = 0.0
    weights: WeightTransfer | None = None  # the trainer's side of the weight broadcast, run by update_weights

    def generate(self, prompts: Sequence, params, *, sample_seeds=None, on_step=None, prefill_fn=None,
                 on_samples_finished=None):
        reject_unsupported_hooks("RemoteRollout", self.capabilities, on_step=on_step, prefill_fn=prefill_fn,
                                 on_samples_finished=on_samples_finished)
        n, max_new = params.n, params.max_new_tokens
        ids = torch.empty(len(prompts) * n, max_new + 2, dtype=torch.long, device=self.device)
        logprobs = torch.empty(len(prompts) * n, max_new, dtype=torch.float32, device=self.device)
        t0 = time.perf_counter()
        dist.broadcast(ids, src=self.src, group=self.group)
        dist.broadcast(logprobs, src=self.src, group=self.group)
        outputs = _unpack(ids, logprobs, len(prompts), n)  # .cpu() waits for the broadcasts
        self.last_wait_s = time.perf_counter() - t0
        return outputs

    def release(self) -> None:
        pass  # nothing held on the trainer between steps

    def resume(self) -> None:
        pass

    def update_weights(self) -> TransferStats | None:
        """Send the updated parameters to the rollout process (a collective with its receiving `run`)."""
        return self.weights.run() if self.weights is not None else None
