"""A preallocated KV pool laid out by GRPO group: one prompt slot shared by n sample slots.

    prefix_k/v[layer]: (groups, Hkv, max_prompt, D)      the prompt's K/V, stored once per prompt
    suffix_k/v[layer]: (groups * n, Hkv, max_new, D)     each sample's own generated tokens

Sample slot s belongs to group s // n, so decode attention reads a prompt's K/V once for all n of its samples
(one batched matmul per group) instead of n times, with no gather and static shapes (CUDA-graph friendly).
A group slot is taken when a prompt is prefilled and given back when all its samples have finished.
"""

from __future__ import annotations

import torch


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
        """Drop the pool's memory between rollouts (other phases get it); `reserve` takes it back."""
        self.prefix_k = self.prefix_v = self.suffix_k = self.suffix_v = None
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

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


class GroupedDecodeAttention:
    """Attention context for one decode step over every sample slot of the pool (static shapes).

    q, k, v: (slots, H|Hkv, 1, D). The new k/v are written at each slot's current length; queries attend to
    their group's prompt K/V and to their own generated K/V up to and including the new token. Softmax runs
    over both parts jointly in fp32. Inactive slots compute garbage that nobody reads.
    """

    def __init__(self, pool: GroupKVPool, suffix_len: torch.Tensor):
        self.pool = pool
        self.suffix_len = suffix_len  # (slots,) tokens already generated = write position
        slots = pool.num_slots
        self.rows = torch.arange(slots, device=pool.device)
        self.prefix_valid = torch.arange(pool.max_prompt, device=pool.device)[None] < pool.prompt_len[:, None]
        self.suffix_valid = torch.arange(pool.max_new, device=pool.device)[None] <= suffix_len[:, None]

    def __call__(self, layer: int, q, k, v):
        pool = self.pool
        pool.suffix_k[layer][self.rows, :, self.suffix_len] = k[:, :, 0].to(pool.dtype)
        pool.suffix_v[layer][self.rows, :, self.suffix_len] = v[:, :, 0].to(pool.dtype)
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
