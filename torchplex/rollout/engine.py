"""The embedded rollout engine: batched multimodal sampling on the actor's own module.

Each prompt is prefilled once (vision + prompt, through the model's `prefix_forward`) into a group slot of the
KV pool, and its n samples decode from that one copy of the prompt's K/V. Prompt groups enter as group slots
free up (continuous batching at group granularity); a decode step runs over every slot of the pool with static
shapes, so on CUDA it is compiled once (torch.compile: fused elementwise work, sampling and flex-attention decoding
kernels) and captured as one CUDA graph that every later step replays. On CPU it runs eager.

The runtime can watch or use the decode window through `on_step` (called after every decode step) and can
replace the prefill with its own (`prefill_fn`, e.g. one that keeps autograd for the actor's prefix).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections import deque
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from ..components.captured_step import CAPTURE_ROOM, CapturedStep, plain_tensors
from ..data.batching import collate, encode_visuals
from ..distributed.fsdp import gathered
from ..models.attention import PrefixState
from .kv_pool import DECODE_KERNELS, CompactedPool, GroupedDecodeAttention, GroupKVPool, PoolTooSmallError
from .protocol import RolloutCapabilities
from .sampling import SamplingParams, sample, sample_seeds as default_seeds  # generate() has a sample_seeds


log = logging.getLogger(__name__)

PROMPT_BUCKET = 256  # the pool's prompt capacity grows in steps of this many tokens


@dataclass
class SampleOutput:
    prompt_index: int
    sample_index: int
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str  # "stop" (a stop token was sampled, and is included) | "length"


@dataclass
class DecodeStepInfo:
    step: int
    active_samples: int
    waiting_prompts: int


@dataclass
class RolloutStats:
    prefill_s: float = 0.0
    decode_s: float = 0.0
    decode_steps: int = 0
    generated_tokens: int = 0
    prefills: int = 0
    max_prefix_tokens_stored: int = 0
    pool_bytes: int = 0
    captures: int = 0  # CUDA graphs of the decode step captured (one per pool storage: each rollout after a release)
    capture_s: float = 0.0  # part of decode_s
    capture_pool_bytes: int = 0  # the largest capture's reservation: twice it is made free before the next capture
    compactions: int = 0  # rollouts whose live samples moved to the compacted rows (compact_decode)


@dataclass
class _DecodeStep:
    """One layout's decode step: the sampling params it was made for, compiled, and what is called (on CUDA the
    captured graph, made again for each pool storage)."""
    params: SamplingParams | None = None
    compiled: Callable | None = None
    fn: Callable | None = None


class RolloutEngine:
    """The native engine (rollout.protocol.RolloutEngineProtocol): it decodes on the model it is given, the actor's
    own parameters in the trainer, so every hook runs and a prefill computed with the actor is its own."""

    capabilities = RolloutCapabilities()

    def __init__(self, model, *, kv_pool_bytes: int, max_batch: int = 256, kv_dtype: torch.dtype | None = None,
                 compile_decode: bool | None = None, prefill_tokens: int = 16384, check_interval: int | None = None,
                 pad_id: int = 0, decode_kernel: str | None = None, flex_options: dict | None = None,
                 decode_priority: bool = False, fused_qkv: bool | None = None, compile_options: dict | None = None,
                 compact_decode: bool = False):
        self.model = model
        self.kv_pool_bytes = int(kv_pool_bytes)
        self.max_batch = max_batch
        self.kv_dtype = kv_dtype
        self.device = next(model.parameters()).device
        # compile_decode: the decode step is torch.compile'd and, on CUDA, captured once as a CUDA graph and
        # replayed per token. FSDP2-wrapped modules are captured uncompiled (their hooks are not traced here).
        self.compile_decode = self.device.type == "cuda" if compile_decode is None else compile_decode
        self.use_graphs = self.compile_decode and self.device.type == "cuda"
        self.use_compile = self.compile_decode and not hasattr(model, "unshard")
        if self.use_compile:
            # One compilation per pool geometry x sampling params, all of one code object: past dynamo's default
            # limit of 8 the step would run eager, which cannot be captured with the flex kernels.
            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
        # The flex kernels only pay compiled on CUDA (inductor's CPU flex has no log-sum-exp output); elsewhere
        # "matmul" is the faster of the two.
        self.decode_kernel = decode_kernel or ("flex" if self.use_compile and self.device.type == "cuda" else "matmul")
        if self.decode_kernel not in DECODE_KERNELS:
            raise ValueError(f"decode_kernel must be one of {DECODE_KERNELS}, got {self.decode_kernel!r}")
        self.flex_options = flex_options
        # compile_options: inductor options of the decode step's torch.compile, e.g. {"max_autotune_gemm": True}
        # (inductor benchmarks Triton GEMM templates against cuBLAS per shape: minutes more compilation).
        self.compile_options = compile_options
        # the decode step per layout, by the engine attribute it reads: the pool, or its compacted rows
        self._steps = {"pool": _DecodeStep(), "_compacted": _DecodeStep()}
        self._compiled_shapes: set = set()  # (sampling params, pool geometry) compiled so far, for the log
        # compact_decode: once no prompt waits and the live samples fit one per group slot, they move to the pool's
        # first rows as groups of one (kv_pool.CompactedPool) and decode on with a step over those rows alone; the
        # full-pool step ran every slot to the longest response's end. One more compiled step per pool geometry
        # (and, on CUDA, one more capture per pool storage). Off by default: not yet measured on a GPU.
        self.compact_decode = compact_decode
        self._compacted: CompactedPool | None = None
        self.prefill_tokens = prefill_tokens
        # Checking for finished samples costs a host sync; on GPU do it every few steps.
        self.check_interval = check_interval or (4 if self.device.type == "cuda" else 1)
        self.pad_id = pad_id
        # decode_priority (CUDA): decode steps run on a stream of the highest priority, so that when decode-window
        # work runs beside them on another stream, the GPU's block scheduler hands free SMs to decode first.
        self.decode_priority = decode_priority
        # fused_qkv: decode steps project q/k/v with one GEMM on a fused copy of the three weights (model.fuse_qkv,
        # refreshed at every generate; 2*(H + 2*Hkv)*D*hidden bytes per layer, 0.9 GiB at 7B bf16). Measured on the
        # H200 (docs/benchmarks.md): 7B, 8 prompts x 8 samples, 6.24 -> 5.60 ms per step. Default: wherever the
        # decode step is compiled on CUDA and the weights are plain tensors.
        plain = plain_tensors(model)
        if fused_qkv and not plain:
            raise ValueError("fused_qkv needs a model of plain tensors (not FSDP2- or TP-sharded)")
        self.fused_qkv = (self.use_compile and self.device.type == "cuda" and plain) if fused_qkv is None \
            else fused_qkv
        self._decode_stream: torch.cuda.Stream | None = None
        self._caller_stream: torch.cuda.Stream | None = None  # generate's stream while decode runs on its own
        self.pool: GroupKVPool | None = None
        self.stats = RolloutStats()
        # time_prefill (CUDA): synchronize around each prefill so stats.prefill_s is its device time, not the time
        # to enqueue it (benchmarks computing prefill MFU turn it on; it costs a sync per admission)
        self.time_prefill = False

    def _count_capture(self, seconds: float, captured: CapturedStep) -> None:
        self.stats.captures += 1
        self.stats.capture_s += seconds
        self.stats.capture_pool_bytes = max(self.stats.capture_pool_bytes, captured.pool_bytes)

    def _new_storage(self) -> None:
        """The pool's tensors changed: captured graphs must not keep the old addresses."""
        for st in self._steps.values():
            st.fn = None

    # ---- pool lifetime -------------------------------------------------------------------------------
    def _pool_for(self, n: int, max_prompt: int, max_new: int, num_prompts: int) -> GroupKVPool:
        t = self.model.args.text
        dtype = self.kv_dtype or next(self.model.parameters()).dtype
        max_prompt = -(-max_prompt // PROMPT_BUCKET) * PROMPT_BUCKET  # few pool shapes: few compilations
        pool = self.pool
        max_groups = max(1, min(num_prompts, self.max_batch // n))
        # a budget re-sized between rollouts (the runner's memory budget) rebuilds the pool only if it changes how
        # many groups it holds: each new geometry is a new decode compilation
        # kv_pool_bytes 0 (rollout.kv_pool_gib 0, before the runner sized it from the memory budget, e.g. an
        # evaluation before the first step): what this call's groups need
        budget = self.kv_pool_bytes or max_groups * self.pool_group_bytes(n, max_prompt, max_new)
        groups = lambda: min(max_groups, budget // pool.bytes_per_group)
        if (pool is None or pool.n != n or pool.max_prompt < max_prompt or pool.max_new != max_new
                or pool.dtype != dtype or groups() != pool.num_groups):
            self.pool = self._compacted = None  # drop the old tensors before sizing the new ones
            pool = GroupKVPool(num_layers=t.num_layers, num_kv_heads=t.num_kv_heads, head_dim=t.head_dim, n=n,
                               max_prompt=max_prompt, max_new=max_new, budget_bytes=budget,
                               max_groups=max_groups, dtype=dtype, device=self.device)
            self._new_storage()
        if pool.prefix_k is None:
            pool.reserve()
            self._new_storage()
        self.pool = pool
        return pool

    def pool_group_bytes(self, n: int, max_prompt: int, max_new: int) -> int:
        """KV bytes of one prompt group in this engine's pool (its prompt capacity rounded up as `_pool_for` does):
        what the memory budget sizes the pool in."""
        t = self.model.args.text
        dtype = self.kv_dtype or next(self.model.parameters()).dtype
        max_prompt = -(-max_prompt // PROMPT_BUCKET) * PROMPT_BUCKET
        return GroupKVPool.group_bytes(t.num_layers, t.num_kv_heads, t.head_dim, n, max_prompt, max_new, dtype)

    def release(self) -> None:
        """Give the KV pool's memory back (between rollouts); the next `generate` takes it again."""
        if self.pool is not None:
            self.pool.release()
        if self._compacted is not None:
            self._compacted.release()  # its views would keep the released storage alive

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
    def _decode_step(self, params: SamplingParams, pool, tokens, positions, suffix_len, seeds, steps):
        model = self.model
        h = model.tok_embeddings(tokens[:, None])
        attn = GroupedDecodeAttention(pool, suffix_len, self.decode_kernel, self.flex_options)
        hidden = model.decode(h, positions.view(1, -1, 1).expand(3, -1, 1), attn, fused_qkv=self.fused_qkv)
        return sample(model.logits(hidden[:, 0]), params, seeds, steps)

    def _step(self, params: SamplingParams, layout: str = "pool"):
        """The decode step for these sampling params over `layout`'s rows (the pool's every slot, or its compacted
        live samples): eager, compiled, and (CUDA) replayed from one captured graph.

        Shapes are static for the pool's lifetime, so one compilation serves every step of every rollout on it."""
        # The seed reaches the step as per-sample tensors, so a new seed per GRPO step reuses the compiled step; the
        # compiled function outlives pool release/reserve (same shapes), only the CUDA graph is captured again. It
        # reads the layout through the engine's attribute, as a pool rebuilt at another size is read.
        st = self._steps[layout]
        key = dataclasses.replace(params, seed=0)
        if st.params != key:
            st.params = key  # one object per distinct params: what the compiled step's guards see
            fn = lambda *state: self._decode_step(key, getattr(self, layout), *state)
            st.compiled = (torch.compile(fn, dynamic=False, options=self.compile_options) if self.use_compile
                           else fn)
            st.fn = None
        if st.fn is None:
            pool = getattr(self, layout)
            shape = (repr(key), layout, pool.num_groups, pool.n, pool.max_prompt, pool.max_new)
            if self.use_compile and shape not in self._compiled_shapes:  # later steps and rollouts replay
                self._compiled_shapes.add(shape)
                log.info("rollout: compiling the decode step for %d groups x n=%d, prompts <= %d, <= %d new tokens "
                         "(about a minute on a GPU the first time)", pool.num_groups, pool.n, pool.max_prompt,
                         pool.max_new)
            room = max(CAPTURE_ROOM, 2 * self.stats.capture_pool_bytes)
            st.fn = (CapturedStep(st.compiled, lambda s: self._count_capture(s, st.fn), room) if self.use_graphs
                     else st.compiled)
        fn = st.fn
        return lambda params, *state: fn(*state)

    def generate(self, prompts: Sequence, params: SamplingParams, *, sample_seeds: Sequence[Sequence[int]] | None = None,
                 on_step: Callable[[DecodeStepInfo], None] | None = None,
                 prefill_fn: Callable[[Sequence], PrefixState] | None = None,
                 on_samples_finished: Callable[[list[SampleOutput]], None] | None = None) -> list[list[SampleOutput]]:
        """Sample `params.n` responses for each prompt. Returns outputs[prompt][sample].

        on_samples_finished(outputs) is called at each check with the samples that have finished since the last
        one, while the others decode on (the runtime scores them in the decode window); they are the very outputs
        that are returned. An FSDP2 model is gathered once for the whole call (`distributed.fsdp.gathered`): ranks decode
        as many steps as their own samples need, with no collective per step."""
        with gathered(self.model):  # also with no prompts: a rank without any still joins the gathering
            if not prompts:
                return []
            return self._generate(prompts, params, sample_seeds, on_step, prefill_fn, on_samples_finished)

    @torch.no_grad()
    def _generate(self, prompts, params, sample_seeds, on_step, prefill_fn, on_samples_finished):
        n, max_new = params.n, params.max_new_tokens
        lengths = [len(p.input_ids) for p in prompts]
        pool = self._pool_for(n, max(lengths), max_new, len(prompts))
        too_long = [i for i, L in enumerate(lengths) if L > pool.max_prompt]
        if too_long:
            raise PoolTooSmallError(f"prompts {too_long} are longer than the pool's max_prompt {pool.max_prompt}")
        if sample_seeds is None:
            sample_seeds = default_seeds(params.seed, n, range(len(prompts)))
        prefill_fn = prefill_fn or self.default_prefill
        dev, slots = self.device, pool.num_slots
        stop_ids = torch.tensor(params.stop_token_ids or [-1], device=dev)

        last_token = torch.zeros(slots, dtype=torch.long, device=dev)
        gen_count = torch.zeros(slots, dtype=torch.long, device=dev)    # tokens sampled so far
        start_pos = torch.zeros(slots, dtype=torch.long, device=dev)    # RoPE position of the first new token
        seeds = torch.zeros(slots, dtype=torch.long, device=dev)
        active = torch.zeros(slots, dtype=torch.bool, device=dev)
        out_tokens = torch.zeros(slots, max_new, dtype=torch.long, device=dev)
        out_logprobs = torch.zeros(slots, max_new, dtype=torch.float32, device=dev)
        owner: dict[int, int] = {}  # group slot -> prompt index
        results: list[list[SampleOutput] | None] = [None] * len(prompts)
        waiting = deque(range(len(prompts)))
        rows = torch.arange(slots, device=dev)
        step = 0

        def admit():
            while waiting and pool.free_groups:
                take, budget = [], self.prefill_tokens
                while waiting and pool.free_groups and (not take or budget >= lengths[waiting[0]]):
                    i = waiting.popleft()
                    take.append((i, pool.take_group()))
                    budget -= lengths[i]
                timed = self.time_prefill and dev.type == "cuda"
                if timed:
                    torch.cuda.synchronize(dev)
                t0 = time.perf_counter()
                prefix = prefill_fn([prompts[i] for i, _ in take])
                last_logits = self.model.logits(prefix.last_hidden.detach())
                for b, (i, g) in enumerate(take):
                    L = lengths[i]
                    pool.write_prefix(g, [k[b].detach() for k in prefix.k], [v[b].detach() for v in prefix.v], L)
                    owner[g] = i
                    s = slice(g * n, (g + 1) * n)
                    seeds[s] = torch.tensor(list(sample_seeds[i]), device=dev)
                    start_pos[s] = prefix.next_position[b]
                    tok, lp = sample(last_logits[b:b + 1].expand(n, -1), params, seeds[s],
                                     torch.zeros(n, dtype=torch.long, device=dev))
                    last_token[s], out_tokens[s, 0], out_logprobs[s, 0] = tok, tok, lp
                    gen_count[s] = 1
                    active[s] = ~torch.isin(tok, stop_ids) & (max_new > 1)
                if timed:
                    torch.cuda.synchronize(dev)
                self.stats.prefill_s += time.perf_counter() - t0
                self.stats.prefills += 1
                self.stats.max_prefix_tokens_stored = max(self.stats.max_prefix_tokens_stored,
                                                          pool.prefix_tokens_stored)

        finished_samples: dict[int, SampleOutput] = {}  # slot -> output, for slots of groups still decoding

        def sample_output(s: int, i: int, j: int, c: int) -> SampleOutput:
            toks = out_tokens[s, :c].tolist()
            reason = "stop" if toks and toks[-1] in params.stop_token_ids else "length"
            return SampleOutput(i, j, toks, out_logprobs[s, :c].tolist(), reason)

        def finish(i: int, outs: list[SampleOutput]) -> None:
            self.stats.generated_tokens += sum(len(o.token_ids) for o in outs)
            results[i] = outs

        def collect_finished() -> list[bool]:
            slot_active = active.tolist()
            if on_samples_finished is not None:
                counts, new = gen_count.tolist(), []
                for g, i in owner.items():
                    for s in range(g * n, (g + 1) * n):
                        if not slot_active[s] and s not in finished_samples:
                            finished_samples[s] = sample_output(s, i, s % n, counts[s])
                            new.append(finished_samples[s])
                if new:
                    on_samples_finished(new)
            done_groups = [g for g in owner if not any(slot_active[g * n:(g + 1) * n])]
            if not done_groups:
                return slot_active
            counts = gen_count.tolist()
            for g in done_groups:
                i = owner.pop(g)
                finish(i, [finished_samples.pop(s, None) or sample_output(s, i, s % n, counts[s])
                           for s in range(g * n, (g + 1) * n)])
                active[g * n:(g + 1) * n] = False
                pool.give_back(g)
            return slot_active

        # after compaction (compact_decode): row b decodes sample_of[b] = (prompt, sample); done holds the finished
        sample_of: list[tuple[int, int]] = []
        done: dict[tuple[int, int], SampleOutput] = {}

        def compact(slot_active: list[bool]) -> bool:
            """Move the live samples to the compacted rows, if they fit one per group slot and none waits."""
            nonlocal last_token, gen_count, start_pos, seeds, active, out_tokens, out_logprobs, rows
            if not self.compact_decode or waiting or n == 1 or not 0 < sum(slot_active) <= pool.num_groups:
                return False
            live = [s for s in range(slots) if slot_active[s]]
            counts = gen_count.tolist()
            for g, i in owner.items():  # the finished samples of groups still decoding leave their slots now
                for s in range(g * n, (g + 1) * n):
                    if not slot_active[s]:
                        done[i, s % n] = finished_samples.pop(s, None) or sample_output(s, i, s % n, counts[s])
            sample_of[:] = [(owner[s // n], s % n) for s in live]
            if self._compacted is None:
                self._compacted = CompactedPool(pool)
            self._compacted.move(live)  # the same storage as the pool's: a captured step stays valid (_new_storage)
            index = torch.tensor(live, device=dev)
            rows_n = self._compacted.num_slots

            def take(t, fill):
                out = t.new_full((rows_n, *t.shape[1:]), fill)
                out[:len(live)] = t[index]
                return out

            last_token, gen_count, start_pos, seeds = (take(last_token, 0), take(gen_count, 1), take(start_pos, 0),
                                                       take(seeds, 0))
            active, out_tokens, out_logprobs = take(active, False), take(out_tokens, 0), take(out_logprobs, 0.0)
            rows = torch.arange(rows_n, device=dev)
            self.stats.compactions += 1
            return True

        def collect_compacted() -> None:
            row_active, counts, new = active.tolist(), gen_count.tolist(), []
            decoding = set(owner.values())  # prompts not yet returned
            for b, (i, j) in enumerate(sample_of):
                if not row_active[b] and i in decoding and (i, j) not in done:
                    done[i, j] = sample_output(b, i, j, counts[b])
                    new.append(done[i, j])
            if new and on_samples_finished is not None:
                on_samples_finished(new)
            for g, i in list(owner.items()):
                if all((i, j) in done for j in range(n)):
                    owner.pop(g)
                    finish(i, [done.pop((i, j)) for j in range(n)])
                    pool.give_back(g)

        admit()
        collect_finished()
        admit()
        if self.fused_qkv:
            self.model.fuse_qkv()  # from this step's weights; in place, so a captured decode graph stays valid
        step_fn = self._step(params)
        compacted = False
        with self._on_decode_stream():
            t_decode = time.perf_counter()
            while owner:
                write_at = (gen_count - 1).clamp(max=max_new - 2)
                positions = start_pos + write_at
                tok, lp = step_fn(params, last_token, positions, write_at, seeds, gen_count)
                if self.use_graphs:
                    tok, lp = tok.clone(), lp.clone()  # outputs of a CUDA graph are overwritten by the next replay
                idx = gen_count.clamp(max=max_new - 1)
                out_tokens[rows, idx] = torch.where(active, tok, out_tokens[rows, idx])
                out_logprobs[rows, idx] = torch.where(active, lp, out_logprobs[rows, idx])
                last_token = torch.where(active, tok, last_token)
                gen_count = gen_count + active.long()
                active = active & ~torch.isin(tok, stop_ids) & (gen_count < max_new)
                step += 1
                self.stats.decode_steps += 1
                if on_step is not None:
                    on_step(DecodeStepInfo(step, len(owner) * n, len(waiting)))
                if step % self.check_interval == 0 or step >= max_new:
                    if compacted:
                        collect_compacted()
                        continue
                    slot_active = collect_finished()
                    if owner and compact(slot_active):
                        compacted = True
                        step_fn = self._step(params, "_compacted")
                    elif waiting and pool.free_groups:
                        self.stats.decode_s += time.perf_counter() - t_decode
                        with self._on_caller_stream():  # prefill writes the pool the decode stream reads
                            admit()
                        t_decode = time.perf_counter()
            self.stats.decode_s += time.perf_counter() - t_decode
        self.stats.pool_bytes = pool.allocated_bytes
        return results

    @contextmanager
    def _on_decode_stream(self):
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
    def _on_caller_stream(self):
        """Back on the caller's stream (a prefill inside the decode loop), ordered on both sides."""
        caller = self._caller_stream
        if caller is None:
            yield
            return
        caller.wait_stream(self._decode_stream)
        with torch.cuda.stream(caller):
            yield
        self._decode_stream.wait_stream(caller)
