"""The embedded rollout engine: batched multimodal sampling on the actor's own module.

Each prompt is prefilled once (vision + prompt, through the model's `prefix_forward`) into a group slot of the
KV pool, and its n samples decode from that one copy of the prompt's K/V. Prompt groups enter as group slots
free up (continuous batching at group granularity: rollout/decode_loop.py). A decode step runs over the live
samples only: B rows, B the smallest rung of a ladder of sizes that holds them (rollout/ladder.py), each row
decoding one sample slot of the pool in place (no K/V moves); on CUDA the step's pieces are compiled once and one
CUDA graph per ladder size is captured and replayed (rollout/decode_step.py). On CPU it runs eager.

The runtime can watch or use the decode window through `on_step` (called after every decode step) and can
replace the prefill with its own (`prefill_fn`, e.g. one that keeps autograd for the actor's prefix).
"""

from __future__ import annotations

import dataclasses
import logging
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from ..components.captured_step import CAPTURE_ROOM, CapturedStep, plain_tensors
from ..data.batching import collate, encode_visuals
from ..distributed.fsdp import gathered
from ..models.attention import PrefixState
from ..models.qwen2_5_vl.parallelize import heads_per_rank
from .decode_attention import DECODE_KERNELS, FLEX_PROMPT_OPTIONS
from .decode_loop import DecodeLoop, DecodeStepInfo, Hooks
from .decode_state import SampleOutput
from .decode_step import DecodePieces, DecodeStep
from .kv_pool import GroupKVPool, PoolTooSmallError
from .ladder import DEFAULT_LADDER
from .protocol import RolloutCapabilities
from .sampling import SamplingParams, sample_seeds as default_seeds  # generate() has a sample_seeds

__all__ = ["DecodeStepInfo", "PROMPT_BUCKET", "PoolTooSmallError", "RolloutEngine", "RolloutStats", "SampleOutput"]

log = logging.getLogger(__name__)

PROMPT_BUCKET = 256  # the pool's prompt capacity grows in steps of this many tokens


@dataclass(frozen=True)
class PoolFloor:
    """The least pool geometry: samples per prompt, new tokens per sample, prompt groups."""
    n: int
    max_new: int
    prompts: int


@dataclass
class RolloutStats:
    prefill_s: float = 0.0
    decode_s: float = 0.0
    decode_steps: int = 0
    generated_tokens: int = 0
    prefills: int = 0
    max_prefix_tokens_stored: int = 0
    pool_bytes: int = 0
    # decode steps per ladder size (rows per step); its keys are the sizes used. Replaced, not updated, after each
    # rollout, so a copy of the stats keeps its own
    decode_rows: dict[int, int] = field(default_factory=dict)
    row_steps: int = 0  # rows decoded, over all steps (live or not): the decode's work in sample-steps
    captures: int = 0  # CUDA graphs of the decode step captured: one per ladder size used per pool storage
    capture_s: float = 0.0  # part of decode_s
    capture_pool_bytes: int = 0  # the largest capture's reservation: twice it is made free before the next capture


class RolloutEngine:
    """The native engine (rollout.protocol.RolloutEngineProtocol): it decodes on the model it is given, the actor's
    own parameters in the trainer, so every hook runs and a prefill computed with the actor is its own."""

    capabilities = RolloutCapabilities()

    def __init__(self, model, *, kv_pool_bytes: int, max_batch: int = 256, kv_dtype: torch.dtype | None = None,
                 compile_decode: bool | None = None, prefill_tokens: int = 16384, check_interval: int | None = None,
                 pad_id: int = 0, decode_kernel: str | None = None, flex_options: dict | None = None,
                 decode_priority: bool = False, fused_qkv: bool | None = None, compile_options: dict | None = None,
                 ladder: Sequence[int] = DEFAULT_LADDER, whole_layer_graphs: bool = False,
                 least_pool: PoolFloor | None = None):
        self.model = model
        # least_pool: the geometry every pool has at least (the training rollout's), so that a rollout of fewer
        # samples, prompts or tokens before the first training one (an evaluation) builds the pool training reuses:
        # one geometry, one compilation of the decode attention instead of two
        self.least_pool = least_pool
        self.kv_pool_bytes = int(kv_pool_bytes)
        self.max_batch = max_batch
        self.kv_dtype = kv_dtype
        self.device = next(model.parameters()).device
        # compile_decode: the decode step's pieces are torch.compile'd and, on CUDA, each ladder size's step is
        # captured once per pool storage as a CUDA graph and replayed per token. FSDP2-wrapped modules are captured
        # uncompiled (their hooks are not traced here).
        self.compile_decode = self.device.type == "cuda" if compile_decode is None else compile_decode
        self.use_graphs = self.compile_decode and self.device.type == "cuda"
        self.use_compile = self.compile_decode and not hasattr(model, "unshard")
        if self.use_compile:
            # A graph of `attend`/`step_in` per pool geometry and of `step_out` per sampling params, each piece one
            # code object: past dynamo's default limit of 8 a piece would run eager, which cannot be captured with
            # the flex kernels.
            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
        self.decode_kernel = self._kernel(decode_kernel)
        self.flex_options = flex_options
        # compile_options: inductor options of the decode pieces' torch.compile, e.g. {"max_autotune_gemm": True}
        # (inductor benchmarks Triton GEMM templates against cuBLAS per shape: minutes more compilation).
        self.compile_options = compile_options
        # whole_layer_graphs: each decoder layer's decode as one compiled graph (decode_step.layer_step) instead of
        # three pieces: fusion across their borders, a compilation of the layer per pool geometry
        self.pieces = DecodePieces(self.use_compile, compile_options, whole_layer=whole_layer_graphs)
        # ladder: the row counts a decode step may run at (rollout/ladder.py); a pool's rungs are those below its
        # slot count and the slot count itself. An empty ladder runs every slot at every step.
        self.ladder = tuple(ladder)
        self._steps: dict[str, DecodeStep] = {}  # by sampling params (seed 0), repr
        self._graph_pool = None  # the memory pool the decode graphs of the current pool storage share
        self._compiled_shapes: set = set()  # (sampling params, pool geometry) compiled so far, for the log
        self.prefill_tokens = prefill_tokens
        # Checking for finished samples costs a host sync; on GPU do it every few steps.
        self.check_interval = check_interval or (4 if self.device.type == "cuda" else 1)
        self.pad_id = pad_id
        # decode_priority (CUDA): decode steps run on a stream of the highest priority, so that when decode-window
        # work runs beside them on another stream, the GPU's block scheduler hands free SMs to decode first.
        self.decode_priority = decode_priority
        self.fused_qkv = self._fused_qkv(fused_qkv)
        self._decode_stream: torch.cuda.Stream | None = None
        self._caller_stream: torch.cuda.Stream | None = None  # generate's stream while decode runs on its own
        self.pool: GroupKVPool | None = None
        self.stats = RolloutStats()
        # time_prefill (CUDA): synchronize around each prefill so stats.prefill_s is its device time, not the time
        # to enqueue it (benchmarks computing prefill MFU turn it on; it costs a sync per admission)
        self.time_prefill = False

    def _kernel(self, kernel: str | None) -> str:
        """The decode attention's kernel: flex pays only compiled on CUDA (inductor's CPU flex has no log-sum-exp
        output); elsewhere "matmul" is the faster of the two."""
        kernel = kernel or ("flex" if self.use_compile and self.device.type == "cuda" else "matmul")
        if kernel not in DECODE_KERNELS:
            raise ValueError(f"decode_kernel must be one of {DECODE_KERNELS}, got {kernel!r}")
        return kernel

    def _fused_qkv(self, fused_qkv: bool | None) -> bool:
        """Whether decode steps project q/k/v with one GEMM on a fused copy of the three weights (model.fuse_qkv,
        refreshed at every generate; 2*(H + 2*Hkv)*D*hidden bytes per layer), one GEMM instead of three per layer
        and step. Default: wherever the decode is compiled on CUDA and the weights are plain tensors."""
        plain = plain_tensors(self.model)
        if fused_qkv and not plain:
            raise ValueError("fused_qkv needs a model of plain tensors (not FSDP2- or TP-sharded)")
        return (self.use_compile and self.device.type == "cuda" and plain) if fused_qkv is None else fused_qkv

    # ---- pool lifetime -------------------------------------------------------------------------------
    @property
    def num_kv_heads(self) -> int:
        """The K/V heads this rank's attention projects, what the pool stores: a TP'd model's over its degree."""
        return heads_per_rank(self.model)[1]

    def _new_storage(self) -> None:
        """The pool's tensors changed (or are gone): captured graphs must not keep the old addresses."""
        for step in self._steps.values():
            step.graphs.clear()
        self._graph_pool = None

    def _pool_dtype(self) -> torch.dtype:
        return self.kv_dtype or next(self.model.parameters()).dtype

    def _pool_for(self, n: int, max_prompt: int, max_new: int, num_prompts: int) -> GroupKVPool:
        """The pool for a rollout of `num_prompts` prompts x n samples: the current one where it fits, else a new one
        of this geometry (each new geometry compiles the decode attention once more)."""
        max_prompt = -(-max_prompt // PROMPT_BUCKET) * PROMPT_BUCKET  # few pool shapes: few compilations
        if self.least_pool is not None:
            floor = self.least_pool
            n, max_new = max(n, floor.n), max(max_new, floor.max_new)
            # with a byte budget the pool holds what it allows; without one yet (the runner sizes it at the first
            # step) exactly the training rollout's groups, the most that step's plan gives it (more prompts wait)
            num_prompts = max(num_prompts, floor.prompts) if self.kv_pool_bytes else floor.prompts
        pool = self.pool
        if pool is None or not self._pool_fits(pool, n, max_prompt, max_new, num_prompts):
            self.pool = None  # drop the old tensors before sizing the new ones
            t = self.model.args.text
            max_groups = max(1, min(num_prompts, self.max_batch // n))
            # kv_pool_bytes 0 (rollout.kv_pool_gib 0, before the runner sized it from the memory budget, e.g. an
            # evaluation before the first step): what this call's groups need
            budget = self.kv_pool_bytes or max_groups * self.pool_group_bytes(n, max_prompt, max_new)
            pool = GroupKVPool(num_layers=t.num_layers, num_kv_heads=self.num_kv_heads, head_dim=t.head_dim, n=n,
                               max_prompt=max_prompt, max_new=max_new, budget_bytes=budget,
                               max_groups=max_groups, dtype=self._pool_dtype(), device=self.device)
            self._new_storage()
        if pool.prefix_k is None:
            pool.reserve()
            self._new_storage()
        self.pool = pool
        return pool

    def _pool_fits(self, pool: GroupKVPool, n: int, max_prompt: int, max_new: int, num_prompts: int) -> bool:
        """Whether `pool` serves this rollout as it is. A rollout of fewer samples, shorter prompts or fewer new tokens
        (an evaluation, greedy or eval_k samples, on the training pool) uses it: its spare sample slots never decode,
        and it needs no new compilation. A budget re-sized between rollouts (the runner's memory budget) rebuilds it
        only if the pool holds more groups than the budget now allows, or fewer than the rollout could use."""
        if (pool.dtype != self._pool_dtype() or n > pool.n or max_prompt > pool.max_prompt
                or max_new > pool.max_new):
            return False
        cap = self.max_batch // pool.n  # the groups this budget allows the pool (kv_pool_bytes 0: no cap)
        if self.kv_pool_bytes:
            cap = min(cap, self.kv_pool_bytes // pool.bytes_per_group)
            if cap < 1:
                return False
        return max(1, min(num_prompts, cap)) <= pool.num_groups <= (max(1, cap) if self.kv_pool_bytes
                                                                      else pool.num_groups)

    def pool_group_bytes(self, n: int, max_prompt: int, max_new: int) -> int:
        """KV bytes of one prompt group in this engine's pool (its prompt capacity rounded up as `_pool_for` does):
        what the memory budget sizes the pool in."""
        t = self.model.args.text
        max_prompt = -(-max_prompt // PROMPT_BUCKET) * PROMPT_BUCKET
        return GroupKVPool.group_bytes(t.num_layers, self.num_kv_heads, t.head_dim, n, max_prompt, max_new,
                                       self._pool_dtype())

    def release(self) -> None:
        """Give the KV pool's memory back (between rollouts), and the decode graphs', which held its addresses; the
        next `generate` takes the pool again."""
        if self.pool is not None:
            self.pool.release()
        self._new_storage()

    def resume(self) -> None:
        """Nothing to take back ahead of time: `generate` reserves the pool it needs (`_pool_for`)."""

    def update_weights(self) -> None:
        """Nothing to copy: the engine reads the actor's parameters themselves (a captured decode graph keeps their
        addresses, which the optimizer updates in place)."""

    # ---- prefill -------------------------------------------------------------------------------------
    @torch.no_grad()
    def default_prefill(self, prompts: Sequence) -> PrefixState:
        batch = collate(self.model.args, prompts, pad_id=self.pad_id).to(self.device)
        image, video = encode_visuals(self.model, batch)
        return self.model.prefix_forward(batch.input_ids, batch.position_ids, batch.next_position, batch.lengths,
                                         image_embeds=image, video_embeds=video)

    # ---- decode --------------------------------------------------------------------------------------
    def default_flex_options(self, pool: GroupKVPool) -> dict:
        """The flex prompt call's kernel options for `pool` (decode_attention.FLEX_PROMPT_OPTIONS, split-K by SMs)."""
        split = pool.prompt_split_kv
        return FLEX_PROMPT_OPTIONS if split is None else dict(FLEX_PROMPT_OPTIONS, SPLIT_KV=split)

    def decode_step(self, params: SamplingParams) -> DecodeStep:
        """The decode step for these sampling params on the current pool (rollout/decode_step.py). The seed reaches
        the step as per-sample tensors, so a new seed per GRPO step reuses the same step, its compiled pieces and
        (until the pool's storage changes) its captured graphs."""
        key = dataclasses.replace(params, seed=0)
        pool = self.pool
        shape = (repr(key), pool.num_groups, pool.n, pool.max_prompt, pool.max_new)
        if self.use_compile and shape not in self._compiled_shapes:  # later steps and rollouts replay
            self._compiled_shapes.add(shape)
            log.info("rollout: decode pieces for %d groups x n=%d, prompts <= %d, <= %d new tokens (compiled on "
                     "first use: the layers once, the attention per pool geometry, the sampling per params)",
                     pool.num_groups, pool.n, pool.max_prompt, pool.max_new)
        if repr(key) not in self._steps:
            self._steps[repr(key)] = DecodeStep(self, key, self._capture if self.use_graphs else None)
        return self._steps[repr(key)]

    def _capture(self, fn: Callable) -> CapturedStep:
        """A CUDA graph of one ladder size's step, captured on its first call into the memory pool the graphs of
        this pool storage share (they never run at once, and each step's outputs are read before the next)."""
        if self._graph_pool is None:
            self._graph_pool = torch.cuda.graph_pool_handle()
        room = max(CAPTURE_ROOM, 2 * self.stats.capture_pool_bytes)
        captured = CapturedStep(fn, lambda seconds: self._count_capture(seconds, captured), room,
                                pool=self._graph_pool)
        return captured

    def _count_capture(self, seconds: float, captured: CapturedStep) -> None:
        self.stats.captures += 1
        self.stats.capture_s += seconds
        self.stats.capture_pool_bytes = max(self.stats.capture_pool_bytes, captured.pool_bytes)

    def generate(self, prompts: Sequence, params: SamplingParams, *, sample_seeds: Sequence[Sequence[int]] | None = None,
                 on_step: Callable[[DecodeStepInfo], None] | None = None,
                 prefill_fn: Callable[[Sequence], PrefixState] | None = None,
                 on_samples_finished: Callable[[list[SampleOutput]], None] | None = None) -> list[list[SampleOutput]]:
        """Sample `params.n` responses for each prompt. Returns outputs[prompt][sample].

        on_samples_finished(outputs) is called at each check with the samples that have finished since the last
        one, while the others decode on (the runtime scores them in the decode window); they are the very outputs
        that are returned. An FSDP2 model is gathered once for the whole call (`distributed.fsdp.gathered`): ranks
        decode as many steps as their own samples need, with no collective per step."""
        with gathered(self.model):  # also with no prompts: a rank without any still joins the gathering
            if not prompts:
                return []
            return self._generate(prompts, params, sample_seeds, Hooks(prefill_fn or self.default_prefill, on_step,
                                                                       on_samples_finished))

    @torch.no_grad()
    def _generate(self, prompts, params: SamplingParams, sample_seeds, hooks: Hooks) -> list[list[SampleOutput]]:
        lengths = [len(p.input_ids) for p in prompts]
        pool = self._pool_for(params.n, max(lengths), params.max_new_tokens, len(prompts))
        too_long = [i for i, L in enumerate(lengths) if L > pool.max_prompt]
        if too_long:
            raise PoolTooSmallError(f"prompts {too_long} are longer than the pool's max_prompt {pool.max_prompt}")
        if sample_seeds is None:
            sample_seeds = default_seeds(params.seed, params.n, range(len(prompts)))
        return DecodeLoop(self, prompts, params, sample_seeds, hooks).run()

    @contextmanager
    def on_decode_stream(self):
        """The decode loop on the high-priority stream (decode_priority on CUDA), ordered after everything the
        caller's stream had enqueued and before everything it enqueues afterwards."""
        if not (self.decode_priority and self.device.type == "cuda"):
            yield
            return
        if self._decode_stream is None:
            self._decode_stream = torch.cuda.Stream(self.device, priority=-100)  # clamped to the highest
        caller = self._caller_stream = torch.cuda.current_stream(self.device)
        self._decode_stream.wait_stream(caller)
        try:
            with torch.cuda.stream(self._decode_stream):
                yield
        finally:
            caller.wait_stream(self._decode_stream)  # the pool and the outputs are read or freed there next
            self._caller_stream = None

    @contextmanager
    def on_caller_stream(self):
        """Back on the caller's stream (a prefill inside the decode loop), ordered on both sides."""
        caller = self._caller_stream
        if caller is None:
            yield
            return
        caller.wait_stream(self._decode_stream)
        with torch.cuda.stream(caller):
            yield
        self._decode_stream.wait_stream(caller)
