"""Decode attention in the KV pool's own layout, for a step over B rows that each decode one sample slot.

Row r of a decode step decodes the sample in slot `slot_of_row[r]` (rollout/ladder.py). The attention writes each
row's new k/v into the pool at `[slot_of_row, :, write_at]`, scatters the rows' queries into the pool's slot layout
(zero queries for slots no row maps to), attends there and gathers the outputs back to the rows. So its shapes are
the pool's whatever B is (one compilation per pool geometry), and its cost follows the rows' slots through the
lengths it is given (`slot_lengths`): a group no row maps to has prompt length 0 and a slot no row maps to has own
length 0, so the flex kernels visit none of their K/V blocks.

Two kernels compute the same thing for every slot a row maps to:
- "matmul": softmax over the prompt part and the own part jointly in fp32 with batched matmuls over the whole pool
  (eager, CPU).
- "flex": two flex-attention calls, the group's n*H/Hkv query rows per K/V head against its prompt (read once for
  the group's samples) and each slot's H/Hkv rows per K/V head against its own tokens, each visiting only the K/V
  blocks below its length, merged exactly through their log-sum-exps. Under torch.compile (CUDA) each call is one
  fused split-K decoding kernel; eager it is flex's unfused reference, which the CPU tests compare with "matmul".
A slot with no keys at all (no row maps to it, and its group has none either) gets output 0, never NaN.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.nn.attention.flex_attention import AuxRequest, BlockMask, flex_attention

DECODE_KERNELS = ("matmul", "flex")
FLEX_BLOCK = 128  # K/V block of the flex kernels' block masks
# Kernel options of the prompt call, tuned with benchmarks/probes/flex_decode_tune.py at the 7B geometry (7 query rows
# per K/V head): 64-key blocks, 3 pipeline stages and 4 warps beat flex's defaults alone and inside the whole decode
# step, and more split-K partitions did not. All three are given: inductor's own default on sm_90 has a single
# stage, and num_warps=4 alone left the step at flex's default speed.
FLEX_PROMPT_OPTIONS = {"BLOCK_N": 64, "num_stages": 3, "num_warps": 4}


def prompt_split_kv(groups: int, kv_heads: int, device: torch.device) -> int | None:
    """Split-K partitions of the prompt call where flex's own choice (two per SM over groups x K/V heads) is four or
    more: one per SM. With few groups (GRPO pools of n = 8) each partition's fp32 partial output is written and
    reduced again, and halving flex's count was faster (flex_decode_tune.py --shapes n8).
    None: flex's own choice (many groups, where it is 1 or 2)."""
    if device.type != "cuda":
        return None
    sms = torch.cuda.get_device_properties(device).multi_processor_count
    flex_default = max(sms // max(groups * kv_heads, 1) * 2, 1)
    return flex_default // 2 if flex_default >= 4 else None


@dataclass(frozen=True)
class PoolShape:
    """The pool geometry and kernel a decode step is compiled for: constants of its attention (torch.compile guards
    on them, so each distinct value is one compilation of the attention, never one per step)."""

    groups: int
    n: int  # sample slots per group
    max_prompt: int
    max_new: int
    dtype: torch.dtype
    kernel: str = "matmul"
    flex_options: tuple | None = None  # the prompt call's kernel options, as sorted (key, value) pairs

    @property
    def slots(self) -> int:
        return self.groups * self.n


def length_blocks(lengths: torch.Tensor, kv_len: int) -> tuple[torch.Tensor, ...]:
    """The block lists of a mask where batch entry b sees keys [0, lengths[b]), from tensors only (no host sync,
    CUDA-graph safe): (partial count, partial index, full count, full index) of BlockMask.from_kv_blocks. Blocks
    wholly inside the length are full (no mask function), the one straddling it partial, blocks past it absent."""
    blocks = -(-kv_len // FLEX_BLOCK)
    full = torch.div(lengths, FLEX_BLOCK, rounding_mode="floor").clamp(max=blocks)
    partial = ((lengths % FLEX_BLOCK) > 0) & (full < blocks)
    order = torch.arange(blocks, device=lengths.device, dtype=torch.int32)
    shape = (lengths.shape[0], 1, 1, blocks)
    full_idx = order.view(1, 1, 1, -1).expand(shape).contiguous()
    partial_idx = (order.view(1, -1) + full.view(-1, 1).int()).clamp(max=blocks - 1).view(shape).contiguous()
    return partial.int().view(-1, 1, 1), partial_idx, full.int().view(-1, 1, 1), full_idx


def length_block_mask(blocks: tuple[torch.Tensor, ...], inside, q_len: int, kv_len: int) -> BlockMask:
    """The BlockMask of `length_blocks`' lists; `inside` is the mask function of the straddling block. Building it
    computes nothing, so a compiled call may take the lists as inputs; `inside` should read a tensor that is an input
    of that call."""
    return BlockMask.from_kv_blocks(*blocks, BLOCK_SIZE=FLEX_BLOCK, mask_mod=inside, seq_lengths=(q_len, kv_len),
                                    compute_q_blocks=False)


def slot_lengths(shape: PoolShape, slot_of_row: torch.Tensor, write_at: torch.Tensor, prompt_len: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """(prompt length per group, own length per slot) a step attends with: a group's prompt only where a row maps
    to one of its slots, a slot's own tokens up to and including the new one only where a row maps to it."""
    mapped = torch.zeros(shape.slots, dtype=torch.bool, device=slot_of_row.device)
    mapped = mapped.index_put((slot_of_row,), torch.ones_like(slot_of_row, dtype=torch.bool))
    own_len = torch.zeros(shape.slots, dtype=torch.long, device=slot_of_row.device)
    own_len = own_len.index_put((slot_of_row,), write_at + 1)
    return prompt_len * mapped.view(shape.groups, shape.n).any(-1), own_len


def attention_masks(shape: PoolShape, group_len: torch.Tensor, own_len: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """What `attend` reads of the lengths, built once per step and shared by every layer: the lengths and their
    block lists (flex), or the boolean masks of valid keys (matmul)."""
    if shape.kernel == "flex":
        return (group_len, own_len, *length_blocks(group_len, shape.max_prompt),
                *length_blocks(own_len, shape.max_new))
    prefix_valid = torch.arange(shape.max_prompt, device=group_len.device)[None] < group_len[:, None]
    suffix_valid = torch.arange(shape.max_new, device=own_len.device)[None] < own_len[:, None]
    return prefix_valid, suffix_valid


def attend(shape: PoolShape, q, k, v, prefix_k, prefix_v, suffix_k, suffix_v, slot_of_row, write_at, masks):
    """One layer's decode attention for B rows: q (B, H, 1, D), k, v (B, Hkv, 1, D) -> (B, H, 1, D). Writes the
    rows' new k/v into the layer's pool tensors (in place) and attends in the pool's layout (module docstring)."""
    suffix_k[slot_of_row, :, write_at] = k[:, :, 0].to(shape.dtype)
    suffix_v[slot_of_row, :, write_at] = v[:, :, 0].to(shape.dtype)
    q_slots = q.new_zeros((shape.slots, *q.shape[1:])).index_put((slot_of_row,), q)
    return attend_slots(shape, q_slots, prefix_k, prefix_v, suffix_k, suffix_v, masks)[slot_of_row]


def attend_slots(shape: PoolShape, q_slots, prefix_k, prefix_v, suffix_k, suffix_v, masks):
    """The attention of every slot's query (S, H, 1, D), the slot's new k/v already in the pool."""
    core = _flex if shape.kernel == "flex" else _matmul
    return core(shape, q_slots, prefix_k, prefix_v, suffix_k, suffix_v, masks)


def _flex(shape: PoolShape, q, prefix_k, prefix_v, suffix_k, suffix_v, masks):
    slots, heads, _, dim = q.shape
    groups, n, hkv = shape.groups, shape.n, prefix_k.shape[1]
    rep = heads // hkv
    group_len, own_len, prompt_blocks, own_blocks = masks[0], masks[1], masks[2:6], masks[6:10]
    lse_only = AuxRequest(lse=True)
    out_dtype, q = q.dtype, q.to(shape.dtype)
    # The rep query heads of a K/V head are folded into query rows (plain multi-head attention with a few rows,
    # which flex runs as its split-K decoding kernel for any GQA ratio; Qwen2.5-7B has 7). A group's n samples
    # are more rows against its prompt: the prompt's K/V is read once per group.
    prefix_mask = length_block_mask(prompt_blocks, lambda b, h, q_idx, kv_idx: kv_idx < group_len[b], n * rep,
                                    shape.max_prompt)
    own_mask = length_block_mask(own_blocks, lambda b, h, q_idx, kv_idx: kv_idx < own_len[b], rep, shape.max_new)
    qg = q.view(groups, n, hkv, rep, dim).transpose(1, 2).reshape(groups, hkv, n * rep, dim)
    o_pre, aux = flex_attention(qg, prefix_k, prefix_v, block_mask=prefix_mask, return_aux=lse_only,
                                kernel_options=dict(shape.flex_options) if shape.flex_options else None)
    o_pre = o_pre.view(groups, hkv, n, rep, dim).transpose(1, 2).reshape(slots, heads, 1, dim)
    lse_pre = aux.lse.view(groups, hkv, n, rep).transpose(1, 2).reshape(slots, heads, 1)
    o_suf, aux = flex_attention(q.view(slots, hkv, rep, dim), suffix_k, suffix_v, block_mask=own_mask,
                                return_aux=lse_only)
    o_suf, lse_suf = o_suf.reshape(slots, heads, 1, dim), aux.lse.reshape(slots, heads, 1)
    # A mapped slot's own part holds its new token, so its lse is finite and the merge below is the exact one; an
    # empty part (a group's prompt no row needs, an unmapped slot) has lse -inf and weight 0. A slot with both parts
    # empty would divide 0 by 0: its weights are taken against 0 and its output is 0.
    top = torch.maximum(lse_pre, lse_suf)
    top = torch.where(top == float("-inf"), torch.zeros_like(top), top)
    w_pre, w_suf = torch.exp(lse_pre - top), torch.exp(lse_suf - top)
    total = w_pre + w_suf
    total = torch.where(total > 0, total, torch.ones_like(total))
    out = (o_pre.float() * w_pre[..., None] + o_suf.float() * w_suf[..., None]) / total[..., None]
    return out.to(out_dtype)


def _matmul(shape: PoolShape, q, prefix_k, prefix_v, suffix_k, suffix_v, masks):
    slots, heads, _, dim = q.shape
    groups, n, hkv = shape.groups, shape.n, prefix_k.shape[1]
    rep = heads // hkv
    prefix_valid, suffix_valid = masks
    scale = dim ** -0.5
    # Keys a row may not see get the lowest finite score, not -inf: a row with at least one key gives the same
    # softmax (their exp is 0), and a slot with none (unmapped) gives finite garbage instead of NaN.
    lowest = torch.finfo(torch.float32).min
    # (groups, Hkv, n*rep, D): the queries of a group's n samples against that group's prompt
    qg = q.view(groups, n, hkv, rep, dim).transpose(1, 2).reshape(groups, hkv, n * rep, dim)
    s_pre = torch.matmul(qg, prefix_k.transpose(-1, -2).to(q.dtype)).float() * scale
    s_pre = s_pre.masked_fill(~prefix_valid[:, None, None], lowest)
    s_pre = s_pre.view(groups, hkv, n, rep, -1).transpose(1, 2).reshape(slots, hkv, rep, -1)
    s_suf = torch.matmul(q.view(slots, hkv, rep, dim), suffix_k.transpose(-1, -2).to(q.dtype)).float() * scale
    s_suf = s_suf.masked_fill(~suffix_valid[:, None, None], lowest)
    probs = torch.softmax(torch.cat([s_pre, s_suf], dim=-1), dim=-1).to(q.dtype)
    p_pre, p_suf = probs.split([shape.max_prompt, shape.max_new], dim=-1)
    p_pre = p_pre.reshape(groups, n, hkv, rep, -1).transpose(1, 2).reshape(groups, hkv, n * rep, -1)
    o_pre = torch.matmul(p_pre, prefix_v.to(q.dtype)).view(groups, hkv, n, rep, dim).transpose(1, 2)
    o_suf = torch.matmul(p_suf, suffix_v.to(q.dtype))  # (slots, hkv, rep, D)
    out = o_pre.reshape(slots, hkv, rep, dim) + o_suf
    return out.reshape(slots, heads, 1, dim)
