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
    """Scaled dot-product attention with grouped K/V heads (GQA).

    Without a mask the K/V heads go in as they are (enable_gqa): flash kernels read each K/V head for its query
    heads, where a copy repeated to every query head would cost memory traffic and, saved for backward, memory.
    The masked kernels take no grouped heads, so a mask still gets the repeated copy."""
    if k.shape[1] != q.shape[1]:
        if mask is None:
            return F.scaled_dot_product_attention(q, k, v, is_causal=is_causal, enable_gqa=True)
        rep = q.shape[1] // k.shape[1]
        k = k.repeat_interleave(rep, dim=1)
        v = v.repeat_interleave(rep, dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal)


def lower_right_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Causal attention of q (B, H, Tq, D) over k/v (B, Hkv, Tk, D), Tk >= Tq, with the diagonal at the bottom
    right: query i sees keys up to Tk - Tq + i. `mask` (Tq, Tk) is that pattern, for devices without the kernel.

    On CUDA in half precision this is the flash kernel, whose causal flag means exactly this alignment when the
    lengths differ (the same call torch.nn.attention.bias.causal_lower_right makes; that helper's mask is a tensor
    subclass, which cannot be created under a dispatch mode such as a memory tracker), with grouped K/V heads
    read as they are. Elsewhere an explicit boolean mask."""
    if q.is_cuda and q.dtype in (torch.float16, torch.bfloat16) and q.shape[-1] <= 256:
        return torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, 0.0, True)[0]
    return sdpa(q, k, v, mask=mask)


def right_padded(attention_mask: torch.Tensor) -> bool:
    """Whether every row's valid tokens come first. Causal attention then needs no mask for them: a valid query
    only sees earlier positions, all valid, and a pad query (whose output nobody reads) still sees position 0."""
    valid = attention_mask.bool()
    return bool((valid[:, 1:] <= valid[:, :-1]).all())


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
            # Right padding needs no mask, so the batch runs on the flash (is_causal) kernels, not a masked one.
            plain = self.segment_ids is None and (self.attention_mask is None or right_padded(self.attention_mask))
            self._mask = None if plain else causal_mask(self.attention_mask, self.segment_ids, length, device)
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
        # Right-padded prompts: plain causal attention is exact for every valid position (see right_padded), and
        # the K/V recorded at pad positions are never read (suffixes and the KV pool take each prompt's length).
        super().__init__()
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []

    def __call__(self, layer: int, q, k, v):
        if layer == len(self.k):  # an activation-checkpoint recompute calls again: keep the first record
            self.k.append(k)
            self.v.append(v)
        return super().__call__(layer, q, k, v)


class SharedPrefixAttention:
    """Suffix queries that attend to their prompt's prefix K/V plus their own earlier suffix tokens.

    suffix tokens: (S, R) right-padded to R with valid lengths `suffix_lens`. Each suffix's keys are its prompt's
    prefix followed by its own tokens, attended causally with the causal diagonal at the bottom right (query i
    sees the prefix and its own tokens up to i): one flash-kernel call per distinct prefix length covers every
    suffix of those prompts, and no query meets its siblings' keys, so nothing is computed to be masked away.
    A valid query never sees a pad key (pads come after it); pad queries' outputs are not read.
    """

    def __init__(self, prefix: PrefixState, prefix_index: torch.Tensor, suffix_lens: torch.Tensor):
        self.prefix = prefix
        self.suffix_lens = suffix_lens
        owners = prefix_index.tolist()
        prefix_lengths = prefix.lengths.tolist()  # host ints: no sync inside the layer loop
        by_length: dict[int, list[int]] = {}
        for s, o in enumerate(owners):
            by_length.setdefault(prefix_lengths[o], []).append(s)
        device = prefix_index.device
        # (prefix length, the suffixes (None: all of them, in order), their owners' rows of the prefix state)
        self.parts: list[tuple[int, torch.Tensor | None, torch.Tensor]] = []
        for plen, samples in by_length.items():
            index = None if samples == list(range(len(owners))) else torch.tensor(samples, device=device)
            self.parts.append((plen, index, prefix_index if index is None else prefix_index[index]))
        self._masks: dict[tuple[int, int], torch.Tensor] = {}  # (prefix, suffix length) -> mask, off the flash path

    def __call__(self, layer: int, q, k, v):
        pk, pv = self.prefix.k[layer], self.prefix.v[layer]
        length = q.shape[2]
        out = None if len(self.parts) == 1 and self.parts[0][1] is None else torch.empty_like(q)
        for plen, index, owner in self.parts:
            pick = (lambda t: t) if index is None else (lambda t: t[index])
            keys = torch.cat([pk[owner, :, :plen], pick(k)], dim=2)
            values = torch.cat([pv[owner, :, :plen], pick(v)], dim=2)
            mask = self._masks.get((plen, length))
            if mask is None:
                mask = torch.ones(length, plen + length, dtype=torch.bool, device=q.device).tril(diagonal=plen)
                self._masks[(plen, length)] = mask
            o = lower_right_causal(pick(q), keys, values, mask)
            if out is None:
                return o
            out[index] = o
        return out
