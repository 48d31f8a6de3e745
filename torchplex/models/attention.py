"""Attention patterns for the decoder, kept out of the model so one model serves every phase.

A decoder layer computes rotated q, k, v and hands them to an *attention context*: a callable
`(layer_idx, q, k, v) -> out` with q (B, H, T, D), k/v (B, Hkv, T, D), out (B, H, T, D). The context decides
what the queries may see (causal over the batch, a recorded prefix, a shared prefix plus the query's own
suffix, a paged KV cache) and what it keeps (K/V of a prefix). The model knows nothing of RL phases.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


def sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None,
         is_causal: bool = False) -> torch.Tensor:
    """Scaled dot-product attention with grouped K/V heads (GQA)."""
    if k.shape[1] != q.shape[1]:
        rep = q.shape[1] // k.shape[1]
        k = k.repeat_interleave(rep, dim=1)
        v = v.repeat_interleave(rep, dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal)


def causal_mask(attention_mask: torch.Tensor | None, segment_ids: torch.Tensor | None,
                length: int, device: torch.device) -> torch.Tensor | None:
    """(B|1, 1, T, T) boolean mask: causal, keys valid, same segment. None when plain causal suffices."""
    if attention_mask is None and segment_ids is None:
        return None
    allowed = torch.ones(length, length, dtype=torch.bool, device=device).tril()[None]
    if segment_ids is not None:
        allowed = allowed & (segment_ids[:, :, None] == segment_ids[:, None, :])
    if attention_mask is not None:
        valid = attention_mask.bool()
        allowed = allowed & valid[:, None, :]
        # A padded query row with no visible key would give NaN; let it see itself (its output is ignored).
        allowed = allowed | torch.eye(length, dtype=torch.bool, device=device)[None]
    return allowed[:, None]


class CausalAttention:
    """Full-sequence causal attention over a padded (attention_mask) or packed (segment_ids) batch."""

    def __init__(self, attention_mask: torch.Tensor | None = None, segment_ids: torch.Tensor | None = None):
        self.attention_mask = attention_mask
        self.segment_ids = segment_ids
        self._mask: torch.Tensor | None = None
        self._built = False

    def mask_for(self, length: int, device: torch.device) -> torch.Tensor | None:
        if not self._built:
            self._mask = causal_mask(self.attention_mask, self.segment_ids, length, device)
            self._built = True
        return self._mask

    def __call__(self, layer: int, q, k, v):
        mask = self.mask_for(q.shape[2], q.device)
        return sdpa(q, k, v, mask=mask, is_causal=mask is None)


@dataclass
class PrefixState:
    """What a suffix needs to continue a prompt: every layer's rotated K/V and the position state.

    k[layer], v[layer]: (B, Hkv, P, D), right-padded; lengths (B,) valid prefix lengths; next_position (B,) the
    RoPE position of the first token after the prompt; last_hidden (B, D) the final-norm hidden state at the
    last prompt token (its logits predict the first response token). Tensors keep their autograd graph when
    the prefix was computed with grad, so suffix gradients flow back into the prefix and the vision tower.
    """

    k: list[torch.Tensor]
    v: list[torch.Tensor]
    lengths: torch.Tensor
    next_position: torch.Tensor
    last_hidden: torch.Tensor

    @property
    def batch_size(self) -> int:
        return self.lengths.shape[0]

    def detach(self) -> "PrefixState":
        return PrefixState([t.detach() for t in self.k], [t.detach() for t in self.v], self.lengths,
                           self.next_position, self.last_hidden.detach())

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.k + self.v)


class PrefixAttention(CausalAttention):
    """Causal attention over right-padded prompts that also records each layer's K/V."""

    def __init__(self, lengths: torch.Tensor):
        length = int(lengths.max())
        valid = torch.arange(length, device=lengths.device)[None] < lengths[:, None]
        super().__init__(attention_mask=None if bool(valid.all()) else valid)
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []

    def __call__(self, layer: int, q, k, v):
        if layer == len(self.k):  # an activation-checkpoint recompute calls again: keep the first record
            self.k.append(k)
            self.v.append(v)
        return super().__call__(layer, q, k, v)


class SharedPrefixAttention:
    """Suffix queries that attend to their prompt's prefix K/V plus their own earlier suffix tokens.

    Suffixes of one prompt (a GRPO group) are laid side by side after the prefix in a single attention call,
    so the prefix K/V enters once per group rather than once per sample; a block mask keeps each suffix from
    seeing its siblings. suffix tokens: (S, R) right-padded to R with valid lengths `suffix_lens`.
    """

    def __init__(self, prefix: PrefixState, prefix_index: torch.Tensor, suffix_lens: torch.Tensor):
        self.prefix = prefix
        self.suffix_lens = suffix_lens
        owners = prefix_index.tolist()
        self.prefix_lengths = prefix.lengths.tolist()  # host ints: no sync inside the layer loop
        self.groups: list[tuple[int, torch.Tensor]] = []
        for b in sorted(set(owners)):
            members = torch.tensor([s for s, o in enumerate(owners) if o == b], device=prefix_index.device)
            self.groups.append((b, members))
        self._masks: dict[int, torch.Tensor] = {}

    def _group_mask(self, b: int, members: torch.Tensor, length: int) -> torch.Tensor:
        if b not in self._masks:
            device = self.suffix_lens.device
            n, plen = members.numel(), self.prefix_lengths[b]
            rows = n * length
            owner = torch.arange(rows, device=device) // length
            step = torch.arange(rows, device=device) % length
            lens = self.suffix_lens[members][owner]
            own = (owner[:, None] == owner[None, :]) & (step[None, :] <= step[:, None]) & (step[None, :] < lens[None, :])
            own = own | torch.eye(rows, dtype=torch.bool, device=device)
            prefix = torch.ones(rows, plen, dtype=torch.bool, device=device)
            self._masks[b] = torch.cat([prefix, own], dim=1)
        return self._masks[b]

    def __call__(self, layer: int, q, k, v):
        out = torch.empty_like(q)
        length = q.shape[2]
        pk, pv = self.prefix.k[layer], self.prefix.v[layer]
        for b, members in self.groups:
            n, plen = members.numel(), self.prefix_lengths[b]
            gq = q[members].transpose(0, 1).reshape(1, q.shape[1], n * length, q.shape[3])
            gk = k[members].transpose(0, 1).reshape(1, k.shape[1], n * length, k.shape[3])
            gv = v[members].transpose(0, 1).reshape(1, v.shape[1], n * length, v.shape[3])
            keys = torch.cat([pk[b:b + 1, :, :plen], gk], dim=2)
            values = torch.cat([pv[b:b + 1, :, :plen], gv], dim=2)
            mask = self._group_mask(b, members, length)
            o = sdpa(gq, keys, values, mask=mask[None, None])
            out[members] = o.reshape(q.shape[1], n, length, q.shape[3]).transpose(0, 1)
        return out
