"""A preallocated KV pool laid out by GRPO group: one prompt slot shared by n sample slots.

    prefix_k/v[layer]: (groups, Hkv, max_prompt, D)      the prompt's K/V, stored once per prompt
    suffix_k/v[layer]: (groups * n, Hkv, max_new, D)     each sample's own generated tokens

Sample slot s belongs to group s // n, so decode attention reads a prompt's K/V once for all n of its samples
(rollout/decode_attention.py) instead of n times, with static shapes (CUDA-graph friendly). A group slot is taken
when a prompt is prefilled and given back when all its samples have finished. A rollout of fewer samples per prompt
than the pool's n uses the first sample slots of each group and leaves the others idle.
"""

from __future__ import annotations

import torch

from .decode_attention import prompt_split_kv


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
        (empty_cache) makes the next phase wait for the driver to map tens of GiB back."""
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
