"""SGLangRolloutEngine: one colocated `sglang.Engine` per rollout group, behind rollout/protocol.py.

Started once (its scheduler process loads the checkpoint folder and captures its CUDA graphs); before every
rollout the actor's current weights are pushed (`update_weights_from_tensor`, CUDA IPC from this process), and
after it the engine's KV cache and weights are released (`release_memory_occupation`, SGLang's memory saver) so
the trainer's reference, backward and optimizer phases get that memory; `resume` takes it back. After a release
SGLang's weight memory holds nothing meaningful, so the next push sends every parameter; otherwise only the
trainable ones (a frozen vision tower is not sent again).

Capabilities (declared, the planner reads them): the model runs in SGLang's scheduler process, so there is no
prefill hook (no fused actor prefix), no per-decode-step hook, and finished samples are not streamed back (one
`async_generate` call per sample, all awaited together; handing finished ones on early is future work). The trainer's
prefix and reference work therefore run after rollout, and the plan says why. Running such work beside SGLang's
decode anyway (from a second host thread of this process, as the decode window does) hid little of it: without MPS
the two processes time-slice the GPU, and with an MPS daemon at most about a third of the prefix work was hidden
(docs/sglang.md, benchmarks/probes/sglang_overlap.py). That does not pay for holding its results through the
rollout, so no capability for it is declared.

rollout_tp > 1: the engine runs on the first rank of the actor's TP group (SGLang's own TP over the group's
GPUs); every rank joins the `full_tensor` gathers, the first one pushes and samples, and the outputs are
broadcast to the others (TP peers hold the same prompts). Where the scheduler stops answering (died, hung), the
step fails after `rollout.sglang_timeout_s` with that said, instead of waiting forever: a rollout, and each
weight push, release and resume (SGLang's own calls for those have no timeout).
"""

from __future__ import annotations

import asyncio
import contextlib
import importlib.util
import logging
import os
import signal
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch
import torch.distributed as dist

from ..protocol import RolloutCapabilities, reject_unsupported_hooks
from ..sampling import SamplingParams, sample_seeds as default_seeds  # generate() has a sample_seeds
from .requests import build_requests, map_outputs
from .weights import buckets, hf_parameters

log = logging.getLogger(__name__)

INSTALL_HINT = ("install it with `pip install 'torchplex[sglang]'` (sglang==0.5.17, transformers==5.12.1, "
                "tokenizers==0.22.2); on a GPU image whose torch SGLang's wheels do not match, install the three "
                "wheel folders of benchmarks/sglang_gpu.sh instead (docs/sglang.md)")


class SGLangUnavailableError(RuntimeError):
    """rollout.backend = "sglang" where SGLang cannot run: not installed, or no CUDA device."""


class SGLangTimeoutError(RuntimeError):
    """SGLang did not answer a rollout within rollout.sglang_timeout_s."""


def check_sglang_available(device: torch.device) -> None:
    """Fail at start-up, before any model is loaded, where the SGLang backend cannot run."""
    if device.type != "cuda":
        raise SGLangUnavailableError(
            f"rollout.backend = 'sglang' needs a CUDA device, this process runs on {device.type} (SGLang's CPU "
            f"backend needs its CPU kernels built from source); use rollout.backend = 'native' here")
    if importlib.util.find_spec("sglang") is None:
        raise SGLangUnavailableError(f"rollout.backend = 'sglang' but SGLang is not installed: {INSTALL_HINT}")
    conflict = allocator_conflict(os.environ.get("PYTORCH_CUDA_ALLOC_CONF", ""))
    if conflict:
        raise SGLangUnavailableError(conflict)


def allocator_conflict(alloc_conf: str) -> str:
    """Why SGLang cannot start under this PYTORCH_CUDA_ALLOC_CONF ("" when it can). Its memory saver (what releases
    the KV cache and weights while the actor trains) refuses expandable segments, and the scheduler process that
    inherits the variable then dies while loading the model."""
    options = dict(kv.split(":", 1) for kv in alloc_conf.replace(" ", "").split(",") if ":" in kv)
    if options.get("expandable_segments", "").lower() == "true":
        return ("rollout.backend = 'sglang' cannot run with PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True: "
                "SGLang's memory saver (torch_memory_saver) refuses it and its scheduler dies at start-up; unset "
                "PYTORCH_CUDA_ALLOC_CONF (or drop expandable_segments from it) for this run")
    return ""


# SGLang's fast text attention here. Its own default on Hopper is FlashAttention-3, which the GPU image's repacked
# sglang-kernel wheel leaves out (../shared/gpu/SGLANG.md); FlashInfer is its other usual backend, installed with it.
FAST_ATTENTION_BACKEND = "flashinfer"


def engine_settings(model_path: str, *, tp_size: int, dtype: str, mem_fraction: float, seed: int,
                    base_gpu_id: int = 0, deterministic: bool = False) -> dict:
    """`sglang.Engine` keyword arguments. By default SGLang's usual fast configuration: CUDA graphs and the radix
    cache (its defaults, left on), FlashInfer text attention (`FAST_ATTENTION_BACKEND`), its default sampler; the
    vision tower's attention stays "triton_attn", seen working on the GPU machine (a small share of a rollout). Beside
    them only what this backend needs: the memory saver (release/resume free the KV cache and the weights), no
    grammar backend, no server warm-up. deterministic (rollout.sglang_deterministic): deterministic inference with
    the triton attention backend and the pytorch sampler, the settings seen working there (SGLANG.md), under which
    `sampling_seed` reproduces a sample."""
    settings = dict(model_path=str(model_path), tp_size=tp_size, base_gpu_id=base_gpu_id, dtype=dtype,
                    random_seed=seed, mem_fraction_static=mem_fraction, attention_backend=FAST_ATTENTION_BACKEND,
                    mm_attention_backend="triton_attn", grammar_backend="none", enable_memory_saver=True,
                    skip_server_warmup=True, log_level="warning")
    if deterministic:
        settings.update(attention_backend="triton", sampling_backend="pytorch", enable_deterministic_inference=True)
    return settings


def default_engine_factory(**settings):
    from sglang.srt.entrypoints.engine import Engine  # lazy: only when the backend is chosen

    return Engine(**settings)


@dataclass
class SGLangStats:
    """Seconds per call, one entry per rollout (benchmarks read these)."""
    weight_push_s: list[float] = field(default_factory=list)
    weight_push_bytes: list[int] = field(default_factory=list)
    generate_s: list[float] = field(default_factory=list)
    release_s: list[float] = field(default_factory=list)
    resume_s: list[float] = field(default_factory=list)
    generated_tokens: int = 0


def _check(result, what: str) -> None:
    """SGLang's control calls answer (success, message); a failure must not pass silently."""
    if isinstance(result, tuple) and result and result[0] is False:
        raise RuntimeError(f"SGLang {what} failed: {result[1] if len(result) > 1 else result}")


@contextlib.contextmanager
def deadline(seconds: float, what: str):
    """Raise SGLangTimeoutError in this (main) thread if the block runs past `seconds`.

    SGLang's control calls (update_weights_from_tensor, release/resume_memory_occupation) are synchronous
    `loop.run_until_complete(...)` with no timeout of their own: a scheduler that stops answering would hold
    the step forever. A SIGALRM interrupts the wait (PEP 475: a handler that raises ends the blocked call); off
    the main thread, where no signal can be delivered, the block runs unbounded. A timer already set (a test
    runner's) is re-armed with what it had left."""
    if threading.current_thread() is not threading.main_thread() or not hasattr(signal, "setitimer"):
        yield
        return

    def expired(signum, frame):
        raise SGLangTimeoutError(
            f"SGLang did not answer {what} within rollout.sglang_timeout_s = {seconds:g} s: its scheduler process "
            f"may have died or hung (its log is above)")

    previous = signal.signal(signal.SIGALRM, expired)
    outer_left, _ = signal.setitimer(signal.ITIMER_REAL, seconds)
    t0 = time.monotonic()
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
        if outer_left:
            signal.setitimer(signal.ITIMER_REAL, max(outer_left - (time.monotonic() - t0), 1e-3))


class SGLangRolloutEngine:
    # What the step's memory estimate reads of an engine (rollout.protocol): SGLang's KV cache lives inside its own
    # memory fraction (rollout.sglang_mem_fraction), not in the step's budget, and it batches its own requests
    kv_pool_bytes = 0
    max_batch = 1 << 20
    prefill_tokens = 16384

    def pool_group_bytes(self, n: int, max_prompt: int, max_new: int) -> int:
        return 0

    capabilities = RolloutCapabilities(
        prefill_hook=False, samples_finished_hook=False, step_hook=False, shares_actor_weights=False,
        why_not="rollout.backend = sglang: the model runs in SGLang's scheduler process, which takes no prefill "
                "or decode-step hook, and finished samples are not streamed back; prefix work run beside its decode "
                "from a thread of ours hid too little of it to hold prefixes through the rollout for (docs/sglang.md)")

    def __init__(self, actor, model_path: str, *, tp_size: int = 1, group=None, dtype: str = "bfloat16",
                 mem_fraction: float = 0.2, timeout_s: float = 600.0, bucket_bytes: int = 512 << 20, seed: int = 0,
                 base_gpu_id: int = 0, engine_factory: Callable = default_engine_factory,
                 extra_settings: dict | None = None, deterministic: bool = False):
        if timeout_s <= 0:
            raise ValueError(f"rollout.sglang_timeout_s must be > 0, got {timeout_s}")
        self.actor = actor
        self.group = group  # rollout_tp > 1: the ranks of one SGLang engine; None: this rank alone
        self.leader = group is None or dist.get_rank(group) == 0
        self._leader_rank = dist.get_global_rank(group, 0) if group is not None else 0
        self.timeout_s = float(timeout_s)
        self.bucket_bytes = int(bucket_bytes)
        self.stats = SGLangStats()
        self.deterministic = deterministic  # seeded requests, SGLang's deterministic inference (engine_settings)
        self.settings = engine_settings(model_path, tp_size=tp_size, dtype=dtype, mem_fraction=mem_fraction,
                                        seed=seed, base_gpu_id=base_gpu_id, deterministic=deterministic)
        self.settings.update(extra_settings or {})
        self.engine = None
        if self.leader:
            t0 = time.perf_counter()
            self.engine = engine_factory(**self.settings)
            log.info("sglang engine up in %.1f s (tp_size %d)", time.perf_counter() - t0, tp_size)
        self._released = False
        self._full_push = True  # the engine's weights are the checkpoint's until the first push

    def _control(self, name: str, **kwargs) -> float:
        """One of SGLang's synchronous control calls, bounded by rollout.sglang_timeout_s and checked for failure;
        the seconds it took."""
        t0 = time.perf_counter()
        with deadline(self.timeout_s, name):
            result = getattr(self.engine, name)(**kwargs)
        _check(result, name)
        return time.perf_counter() - t0

    # ---- memory --------------------------------------------------------------------------------------------
    def release(self) -> None:
        """Free SGLang's KV cache and weights until `resume` (their contents are not kept: weights are pushed
        again at the next rollout)."""
        if self._released:
            return
        if self.engine is not None:
            self.stats.release_s.append(self._control("release_memory_occupation", tags=["kv_cache", "weights"]))
        self._released = True
        self._full_push = True

    def resume(self) -> None:
        if not self._released:
            return
        if self.engine is not None:
            self.stats.resume_s.append(self._control("resume_memory_occupation", tags=["weights", "kv_cache"]))
        self._released = False

    # ---- weights -------------------------------------------------------------------------------------------
    def update_weights(self) -> None:
        """Push the actor's current weights (every parameter after a release or at the first push, else the
        trainable ones), bucket by bucket; every rank of the group joins the gathers."""
        t0, sent = time.perf_counter(), 0
        named = hf_parameters(self.actor, trainable_only=not self._full_push)
        for bucket in buckets(named, self.bucket_bytes):
            sent += sum(t.numel() * t.element_size() for _, t in bucket)
            if self.engine is not None:
                self._control("update_weights_from_tensor", named_tensors=bucket, flush_cache=True)
            del bucket  # the gathered copies go before the next bucket is gathered
        self._full_push = False
        self.stats.weight_push_s.append(time.perf_counter() - t0)
        self.stats.weight_push_bytes.append(sent)

    # ---- sampling ------------------------------------------------------------------------------------------
    def generate(self, prompts: Sequence, params: SamplingParams, *,
                 sample_seeds: Sequence[Sequence[int]] | None = None, on_step: Callable | None = None,
                 prefill_fn: Callable | None = None, on_samples_finished: Callable | None = None) -> list:
        """outputs[prompt][sample] from SGLang, sampled with the actor's current weights (pushed first)."""
        reject_unsupported_hooks("SGLangRolloutEngine", self.capabilities, on_step=on_step, prefill_fn=prefill_fn,
                                 on_samples_finished=on_samples_finished)
        seeds = [list(s) for s in (sample_seeds or default_seeds(params.seed, params.n, range(len(prompts))))]
        self.resume()
        self.update_weights()
        outputs: list = []
        if self.engine is not None and prompts:
            t0 = time.perf_counter()
            requests = build_requests(prompts, params, seeds, seeded=self.deterministic)

            async def answer_all():
                return await asyncio.gather(*(self.engine.async_generate(**r) for r in requests))
            answers = self._await(answer_all())
            outputs = map_outputs(answers, len(prompts), params.n)
            self.stats.generate_s.append(time.perf_counter() - t0)
            self.stats.generated_tokens += sum(len(s.token_ids) for row in outputs for s in row)
        if self.group is not None:
            box = [outputs]
            dist.broadcast_object_list(box, src=self._leader_rank, group=self.group)
            outputs = box[0]
        return outputs

    def _await(self, coroutine):
        """Run one SGLang coroutine on the engine's event loop, failing after timeout_s instead of hanging."""
        loop = self.engine.loop
        try:
            return loop.run_until_complete(asyncio.wait_for(coroutine, self.timeout_s))
        except asyncio.TimeoutError:
            raise SGLangTimeoutError(
                f"SGLang did not answer the rollout within rollout.sglang_timeout_s = {self.timeout_s:g} s: its "
                f"scheduler process may have died or hung (its log is above); raise the key for longer rollouts"
            ) from None

    def shutdown(self) -> None:
        if self.engine is not None:
            self.engine.shutdown()
            self.engine = None


def build_sglang_engine(actor, model_path: str, parallel_dims, rollout_tp: int, device: torch.device, *,
                        dtype: str, mem_fraction: float, timeout_s: float, bucket_mib: int, seed: int,
                        deterministic: bool = False, engine_factory: Callable | None = None) -> SGLangRolloutEngine:
    """The trainer's SGLang engine: one per rank at rollout_tp = 1, one per actor TP group at rollout_tp = tp."""
    tp = parallel_dims.tp if parallel_dims is not None else 1
    if rollout_tp not in (1, tp):
        raise ValueError(f"rollout.backend = 'sglang' supports parallelism.rollout_tp = 1 or = tp ({tp}), got "
                         f"{rollout_tp}: the ranks of one SGLang engine must hold the same prompts")
    group = parallel_dims.tp_mesh.get_group() if rollout_tp > 1 else None
    base_gpu_id = device.index or 0
    if group is not None:  # the group's first rank's GPU and the next rollout_tp - 1 ones
        base_gpu_id -= dist.get_rank(group)
    return SGLangRolloutEngine(actor, model_path, tp_size=rollout_tp, group=group, dtype=dtype,
                               mem_fraction=mem_fraction, timeout_s=timeout_s, bucket_bytes=bucket_mib << 20,
                               seed=seed, base_gpu_id=base_gpu_id, deterministic=deterministic,
                               engine_factory=engine_factory or default_engine_factory)
