"""A preallocated KV pool laid out by GRPO group: one prompt slot shared by n sample slots.

    prefix_k/v[layer]: (groups, Hkv, max_prompt, D)      the prompt's K/V, stored once per prompt
    suffix_k/v[layer]: (groups * n, Hkv, max_new, D)     each sample's own generated tokens

Sample slot s belongs to group s // n, so decode attention reads a prompt's K/V once for all n of its samples
(one batched matmul per group) instead of n times, with no gather and static shapes (CUDA-graph friendly).
A group slot is taken when a prompt is prefilled and given back when all its samples have finished.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch.nn.attention.flex_attention import AuxRequest, BlockMask, flex_attention


class PoolTooSmallError(RuntimeError):
    pass


class GroupKVPool:
    def __init__(self, *, num_layers: int, num_kv_heads: int, head_dim: int, n: int, max_prompt: int,
                 max_new: int, budget_bytes: int, max_groups: int, dtype: torch.dtype, device: torch.device):
        self.n, self.max_prompt, self.max_new = n, max_prompt, max_new
        self.num_layers, self.num_kv_heads, self.head_dim = num_layers, num_kv_heads, head_dim
        self.dtype, self.device = dtype, torch.device(device)
        self.bytes_per_group = self.group_bytes(num_layers, num_kv_heads, head_dim, n, max_prompt, max_new, dtype)
        fit = budget_bytes // self.bytes_per_group
        if fit < 1:
            raise PoolTooSmallError(
                f"one prompt group (prompt {max_prompt} tokens + {n} x {max_new} new tokens) needs "
                f"{self.bytes_per_group / 2**20:.1f} MiB of KV cache but rollout.kv_pool_gib allows "
                f"{budget_bytes / 2**20:.1f} MiB; raise rollout.kv_pool_gib or shorten prompts/max_new_tokens")
        self.num_groups = int(min(fit, max_groups))
        self.free_groups = list(range(self.num_groups))
        self.prompt_split_kv = prompt_split_kv(self.num_groups, num_kv_heads, self.device)  # host-side, once
        self.prompt_len = torch.zeros(self.num_groups, dtype=torch.long, device=self.device)
        self.prefix_k = self.prefix_v = self.suffix_k = self.suffix_v = None
        self.reserve()

    @staticmethod
    def group_bytes(num_layers, num_kv_heads, head_dim, n, max_prompt, max_new, dtype) -> int:
        per_token = 2 * num_layers * num_kv_heads * head_dim * torch.empty((), dtype=dtype).element_size()
        return per_token * (max_prompt + n * max_new)

    @property
    def num_slots(self) -> int:
        return self.num_groups * self.n

    def reserve(self) -> None:
        """Allocate the pool's tensors (again, after `release`)."""
        if self.prefix_k is not None:
            return
        shape_p = (self.num_groups, self.num_kv_heads, self.max_prompt, self.head_dim)
        shape_s = (self.num_slots, self.num_kv_heads, self.max_new, self.head_dim)
        make = lambda shape: [torch.zeros(shape, dtype=self.dtype, device=self.device) for _ in range(self.num_layers)]
        self.prefix_k, self.prefix_v = make(shape_p), make(shape_p)
        self.suffix_k, self.suffix_v = make(shape_s), make(shape_s)

    def release(self) -> None:
        """Drop the pool's memory between rollouts (other phases get it); `reserve` takes it back.

        The blocks stay in PyTorch's caching allocator for the next phases' tensors: returning them to the driver
        (empty_cache) made the next phase wait ~1 s on an H200 to map 36 GiB back (docs/memory.md)."""
        self.prefix_k = self.prefix_v = self.suffix_k = self.suffix_v = None

    @property
    def allocated_bytes(self) -> int:
        return 0 if self.prefix_k is None else self.num_groups * self.bytes_per_group

    # ---- accounting ---------------------------------------------------------------------------------
    def take_group(self) -> int:
        return self.free_groups.pop(0)

    def give_back(self, group: int) -> None:
        self.prompt_len[group] = 0
        self.free_groups.append(group)
        self.free_groups.sort()

    @property
    def prefix_tokens_stored(self) -> int:
        """Prompt tokens held in the pool: once per prompt, however many samples decode from it."""
        return int(self.prompt_len.sum())

    def write_prefix(self, group: int, layer_k: list[torch.Tensor], layer_v: list[torch.Tensor], length: int) -> None:
        """Store one prompt's K/V (per layer (Hkv, L, D)) into its group slot."""
        if length > self.max_prompt:
            raise PoolTooSmallError(f"prompt of {length} tokens exceeds the pool's max_prompt {self.max_prompt}")
        for layer in range(self.num_layers):
            self.prefix_k[layer][group, :, :length] = layer_k[layer][:, :length].to(self.dtype)
            self.prefix_v[layer][group, :, :length] = layer_v[layer][:, :length].to(self.dtype)
        self.prompt_len[group] = length


class CompactedPool:
    """A pool's live samples as groups of one (n = 1) in its first `num_groups` slots, in place: sample b's prompt
    K/V copied to group slot b and its own K/V to sample slot b (`move`). Decode steps over it run `num_groups` rows
    instead of the pool's every slot, through the same attributes the attention kernels read of a pool; rows past
    the live samples are dead (no prompt, never read). It takes the pool's storage as it is when moved (a pool
    released and reserved again is moved anew)."""

    n = 1

    def __init__(self, pool: GroupKVPool):
        self.pool = pool
        self.num_groups = pool.num_groups  # one compiled shape per pool: as many rows as the pool has groups
        self.max_prompt, self.max_new, self.num_layers = pool.max_prompt, pool.max_new, pool.num_layers
        self.num_kv_heads, self.head_dim, self.dtype, self.device = (pool.num_kv_heads, pool.head_dim, pool.dtype,
                                                                      pool.device)
        self.prompt_split_kv = prompt_split_kv(self.num_groups, self.num_kv_heads, self.device)
        self.prompt_len = torch.zeros(self.num_groups, dtype=torch.long, device=self.device)
        self.prefix_k = self.prefix_v = self.suffix_k = self.suffix_v = None

    @property
    def num_slots(self) -> int:
        return self.num_groups

    def release(self) -> None:
        """Drop the views of the pool's tensors with the pool's own release: views keep their storage alive, and a
        view held past the pool's release kept a second whole pool resident beside the next rollout's (H200, 7B, img
        P = 32: +16.2 GiB at the rollout's peak, 2026-12-04). The next `move` takes the views again."""
        self.prefix_k = self.prefix_v = self.suffix_k = self.suffix_v = None

    def move(self, slots: Sequence[int]) -> None:
        """Move the pool's sample `slots` (at most num_groups of them) to rows 0.. of this view, in that order."""
        pool, rows = self.pool, len(slots)
        if rows > self.num_groups:
            raise ValueError(f"{rows} samples do not fit a compacted pool of {self.num_groups} rows")
        src = torch.tensor(list(slots), dtype=torch.long, device=self.device)
        groups = torch.div(src, pool.n, rounding_mode="floor")
        for layer in range(pool.num_layers):  # each gather is copied out before it is written back
            for store, index in ((pool.prefix_k, groups), (pool.prefix_v, groups), (pool.suffix_k, src),
                                 (pool.suffix_v, src)):
                store[layer][:rows] = store[layer][index]
        self.prompt_len.zero_()
        self.prompt_len[:rows] = pool.prompt_len[groups]
        view = lambda store: [t[:self.num_groups] for t in store]
        self.prefix_k, self.prefix_v = view(pool.prefix_k), view(pool.prefix_v)
        self.suffix_k, self.suffix_v = view(pool.suffix_k), view(pool.suffix_v)


DECODE_KERNELS = ("matmul", "flex")
FLEX_BLOCK = 128  # K/V block of the flex kernels' block masks
# Kernel options of the prompt call. Measured on an H200 (benchmarks/probes/flex_decode_tune.py, 7B geometry, 2048
# prompt tokens, 7 query rows per K/V head): 64 groups x 4 heads ran at 80.8 us with 64-key blocks, 3 pipeline
# stages and 4 warps against 85.4 us with 2 warps (and 65 us vs 92 us inside the whole decode step); 256 groups were
# within 1 % either way; more split-K partitions were slower at both sizes. All three are given: inductor's own
# default on sm_90 has a single stage (torch 2.11-2.13), and num_warps=4 alone ran the whole step at flex's
# default speed (7.97 ms at batch 64, 2026-12-01, against 7.20 ms with the three).
FLEX_PROMPT_OPTIONS = {"BLOCK_N": 64, "num_stages": 3, "num_warps": 4}


def prompt_split_kv(groups: int, kv_heads: int, device: torch.device) -> int | None:
    """Split-K partitions of the prompt call where flex's own choice (two per SM over groups x K/V heads) is four or
    more: one per SM. With few groups (GRPO pools of n = 8) each partition's fp32 partial output is written and
    reduced again, and halving flex's count was faster: 8 groups x 56 rows x 2048 tokens ran at 18.8 us with 4
    partitions against 20.4 us with flex's 8, 31.7 us with 16 (H200, flex_decode_tune.py --shapes n8, 2026-12-01).
    None: flex's own choice (many groups, where it is 1 or 2)."""
    if device.type != "cuda":
        return None
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    flex_default = max(sms // max(groups * kv_heads, 1) * 2, 1)
    return flex_default // 2 if flex_default >= 4 else None


def _length_block_mask(lengths: torch.Tensor, inside, q_len: int, kv_len: int) -> BlockMask:
    """Block mask for rows of batch entry b that see keys [0, lengths[b]), built from tensors only (no host sync,
    CUDA-graph safe). Blocks wholly inside the length skip the mask function `inside`; the one straddling it applies
    it; blocks past it are not visited, so a step reads only the K/V that exist. `inside` should read a tensor that
    is an input of the compiled step (not one computed in it, like `lengths` may be)."""
    blocks = -(-kv_len // FLEX_BLOCK)
    full = torch.div(lengths, FLEX_BLOCK, rounding_mode="floor").clamp(max=blocks)
    partial = ((lengths % FLEX_BLOCK) > 0) & (full < blocks)
    order = torch.arange(blocks, device=lengths.device, dtype=torch.int32)
    shape = (lengths.shape[0], 1, 1, blocks)
    full_idx = order.view(1, 1, 1, -1).expand(shape).contiguous()
    partial_idx = (order.view(1, -1) + full.view(-1, 1).int()).clamp(max=blocks - 1).view(shape).contiguous()
    return BlockMask.from_kv_blocks(partial.int().view(-1, 1, 1), partial_idx, full.int().view(-1, 1, 1), full_idx,
                                    BLOCK_SIZE=FLEX_BLOCK, mask_mod=inside, seq_lengths=(q_len, kv_len),
                                    compute_q_blocks=False)


class GroupedDecodeAttention:
    """Attention context for one decode step over every sample slot of the pool (static shapes).

    q, k, v: (slots, H|Hkv, 1, D). The new k/v are written at each slot's current length; queries attend to
    their group's prompt K/V and to their own generated K/V up to and including the new token. Inactive slots
    compute garbage that nobody reads. Two kernels compute the same thing:

    - "matmul": softmax over both parts jointly in fp32 with batched matmuls over the whole pool (eager, CPU).
    - "flex": two flex-attention calls, the group's n*H/Hkv query rows per K/V head against its prompt (read once)
      and each sample's H/Hkv rows per K/V head against its own tokens, each visiting only the K/V blocks below its length, merged exactly through
      their log-sum-exps. Under torch.compile (CUDA) each call is one fused split-K decoding kernel; eager it is
      flex's unfused reference, which the CPU tests compare with "matmul".
    """

    def __init__(self, pool: GroupKVPool, suffix_len: torch.Tensor, kernel: str = "matmul",
                 flex_options: dict | None = None):
        if kernel not in DECODE_KERNELS:
            raise ValueError(f"decode attention kernel must be one of {DECODE_KERNELS}, got {kernel!r}")
        self.pool, self.kernel = pool, kernel
        if flex_options is None:
            split = pool.prompt_split_kv
            flex_options = FLEX_PROMPT_OPTIONS if split is None else dict(FLEX_PROMPT_OPTIONS, SPLIT_KV=split)
        self.flex_options = flex_options
        self.suffix_len = suffix_len  # (slots,) tokens already generated = write position
        slots = pool.num_slots
        self.rows = torch.arange(slots, device=pool.device)
        if kernel == "flex":
            self._masks: tuple[BlockMask, BlockMask] | None = None  # built at the first layer, shared by all
        else:
            self.prefix_valid = torch.arange(pool.max_prompt, device=pool.device)[None] < pool.prompt_len[:, None]
            self.suffix_valid = torch.arange(pool.max_new, device=pool.device)[None] <= suffix_len[:, None]

    def __call__(self, layer: int, q, k, v):
        pool = self.pool
        pool.suffix_k[layer][self.rows, :, self.suffix_len] = k[:, :, 0].to(pool.dtype)
        pool.suffix_v[layer][self.rows, :, self.suffix_len] = v[:, :, 0].to(pool.dtype)
        if self.kernel == "flex":
            return self._flex(layer, q)
        return self._matmul(layer, q)

    def _flex(self, layer: int, q):
        pool = self.pool
        slots, heads, _, dim = q.shape
        groups, n, hkv = pool.num_groups, pool.n, pool.num_kv_heads
        rep = heads // hkv
        lse_only = AuxRequest(lse=True)
        out_dtype, q = q.dtype, q.to(pool.dtype)
        # The rep query heads of a K/V head are folded into query rows (plain multi-head attention with a few rows,
        # which flex runs as its split-K decoding kernel for any GQA ratio; Qwen2.5-7B has 7). A group's n samples
        # are more rows against its prompt: the prompt's K/V is read once per group.
        if self._masks is None:
            prompt_len, suffix_len = pool.prompt_len, self.suffix_len
            self._masks = (
                _length_block_mask(prompt_len, lambda b, h, q_idx, kv_idx: kv_idx < prompt_len[b], n * rep,
                                   pool.max_prompt),
                _length_block_mask(suffix_len + 1, lambda b, h, q_idx, kv_idx: kv_idx <= suffix_len[b], rep,
                                   pool.max_new))
        prefix_mask, suffix_mask = self._masks
        qg = q.view(groups, n, hkv, rep, dim).transpose(1, 2).reshape(groups, hkv, n * rep, dim)
        o_pre, aux = flex_attention(qg, pool.prefix_k[layer], pool.prefix_v[layer], block_mask=prefix_mask,
                                    return_aux=lse_only, kernel_options=self.flex_options)
        o_pre = o_pre.view(groups, hkv, n, rep, dim).transpose(1, 2).reshape(slots, heads, 1, dim)
        lse_pre = aux.lse.view(groups, hkv, n, rep).transpose(1, 2).reshape(slots, heads, 1)
        o_suf, aux = flex_attention(q.view(slots, hkv, rep, dim), pool.suffix_k[layer], pool.suffix_v[layer],
                                    block_mask=suffix_mask, return_aux=lse_only)
        # The own part always holds the new token, so its lse is finite; an empty prompt's is -inf (weight 0).
        o_suf, lse_suf = o_suf.reshape(slots, heads, 1, dim), aux.lse.reshape(slots, heads, 1)
        top = torch.maximum(lse_pre, lse_suf)
        w_pre, w_suf = torch.exp(lse_pre - top), torch.exp(lse_suf - top)
        out = (o_pre.float() * w_pre[..., None] + o_suf.float() * w_suf[..., None]) / (w_pre + w_suf)[..., None]
        return out.to(out_dtype)

    def _matmul(self, layer: int, q):
        pool = self.pool
        slots, heads, _, dim = q.shape
        groups, n, hkv = pool.num_groups, pool.n, pool.num_kv_heads
        rep = heads // hkv
        scale = dim ** -0.5
        # (groups, Hkv, n*rep, D): the queries of a group's n samples against that group's prompt
        qg = q.view(groups, n, hkv, rep, dim).transpose(1, 2).reshape(groups, hkv, n * rep, dim)
        pk, pv = pool.prefix_k[layer], pool.prefix_v[layer]
        s_pre = torch.matmul(qg, pk.transpose(-1, -2).to(q.dtype)).float() * scale
        s_pre = s_pre.masked_fill(~self.prefix_valid[:, None, None], float("-inf"))
        s_pre = s_pre.view(groups, hkv, n, rep, -1).transpose(1, 2).reshape(slots, hkv, rep, -1)
        qs = q.view(slots, hkv, rep, dim)
        sk, sv = pool.suffix_k[layer], pool.suffix_v[layer]
        s_suf = torch.matmul(qs, sk.transpose(-1, -2).to(q.dtype)).float() * scale
        s_suf = s_suf.masked_fill(~self.suffix_valid[:, None, None], float("-inf"))
        probs = torch.softmax(torch.cat([s_pre, s_suf], dim=-1), dim=-1).to(q.dtype)
        p_pre, p_suf = probs.split([pool.max_prompt, pool.max_new], dim=-1)
        p_pre = p_pre.reshape(groups, n, hkv, rep, -1).transpose(1, 2).reshape(groups, hkv, n * rep, -1)
        o_pre = torch.matmul(p_pre, pv.to(q.dtype)).view(groups, hkv, n, rep, dim).transpose(1, 2)
        o_suf = torch.matmul(p_suf, sv.to(q.dtype))  # (slots, hkv, rep, D)
        out = o_pre.reshape(slots, hkv, rep, dim) + o_suf
        return out.reshape(slots, heads, 1, dim)
