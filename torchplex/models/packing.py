"""Packed (varlen) attention contexts: the valid tokens of several sequences in one token dimension.

Padding a micro-batch to its longest row makes every dense part of the decoder (projections, norms, MLP) and the
LM head run on pad tokens too; with long-tailed response lengths that is up to ~3x the useful work. Here the
decoder runs on (1, N) tokens, N the valid count, and only attention knows where one sequence ends: the contexts
below take the sequence lengths as host lists (known from the rollout outputs, so no device sync per layer) and
attend each sequence over its own keys.

  PackedCausalAttention   plain causal attention within each packed sequence (serial prompt+response rows)
  PackedSuffixAttention   each packed suffix over its prompt's prefix K/V then its own earlier tokens (bottom-right
                          causal), the decomposed layout

On CUDA in half precision both are one varlen flash call per layer (torch.nn.attention.varlen); elsewhere one
SDPA call per distinct length (per (prefix, suffix) length pair), which on CPU in fp32 is the exact reference.
"""

from __future__ import annotations

import inspect

import torch

from .attention import PrefixState, lower_right_causal, sdpa

try:  # the varlen flash entry point; its causal switch moved from is_causal to window_size across releases
    from torch.nn.attention.varlen import varlen_attn as _varlen_attn
    _VARLEN_PARAMS = set(inspect.signature(_varlen_attn).parameters)
except ImportError:  # pragma: no cover - older torch
    _varlen_attn, _VARLEN_PARAMS = None, set()


def _flash_path(device: torch.device, dtype: torch.dtype, head_dim: int) -> bool:
    return (_varlen_attn is not None and device.type == "cuda" and dtype in (torch.float16, torch.bfloat16)
            and head_dim <= 256)


def varlen_flash_available(q: torch.Tensor) -> bool:
    return _flash_path(q.device, q.dtype, q.shape[-1])


def varlen_key_heads(num_heads: int, num_kv_heads: int) -> int:
    """The K/V heads varlen_causal hands the kernel (and autograd saves): the query heads where this torch's varlen
    entry point takes no grouped K/V (torch 2.11: the keys are repeated), else the K/V heads."""
    return num_kv_heads if "enable_gqa" in _VARLEN_PARAMS else num_heads


def suffix_key_heads(num_heads: int, num_kv_heads: int, head_dim: int, device, dtype: torch.dtype) -> int:
    """The heads of the packed keys PackedSuffixAttention's backward keeps per layer on `device` in `dtype`: the
    varlen kernel's (varlen_key_heads) on the flash path, the query heads on the SDPA path (its bottom-right
    causal mask takes the masked kernels, which get K/V repeated to every query head)."""
    if _flash_path(torch.device(device), dtype, head_dim):
        return varlen_key_heads(num_heads, num_kv_heads)
    return num_heads


def varlen_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_q: torch.Tensor, cu_k: torch.Tensor,
                  max_q: int, max_k: int) -> torch.Tensor:
    """Flash varlen attention, causal with the diagonal at the bottom right of each sequence (the flash kernels'
    alignment when a sequence has more keys than queries). q (Nq, H, D), k/v (Nk, Hkv, D) -> (Nq, H, D)."""
    kwargs = {}
    if k.shape[1] != q.shape[1]:
        if "enable_gqa" in _VARLEN_PARAMS:
            kwargs["enable_gqa"] = True
        else:
            rep = q.shape[1] // k.shape[1]
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    if "window_size" in _VARLEN_PARAMS:
        kwargs["window_size"] = (-1, 0)
    else:
        kwargs["is_causal"] = True
    return _varlen_attn(q, k, v, cu_q, cu_k, max_q, max_k, **kwargs)


def upload(t: torch.Tensor, device) -> torch.Tensor:
    """A host-built index tensor on `device` without a host sync: a CUDA copy from pageable memory makes the host
    wait for the stream, one from pinned memory is queued like a kernel (the pinned buffer is kept until it ran)."""
    device = torch.device(device)
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def _cumsum(lengths: list[int]) -> list[int]:
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return out


def _to_heads_first(out: torch.Tensor) -> torch.Tensor:
    """(N, H, D) -> (1, H, N, D), the decoder's attention output layout."""
    return out.transpose(0, 1)[None]


class PackedCausalAttention:
    """Causal attention within each of the packed sequences of lengths `lengths` (host ints, in order).

    q (1, H, N, D), k/v (1, Hkv, N, D), N = sum(lengths). Sequences of one length run as one batched causal SDPA
    call (no mask: flash-class kernels), so no query ever meets another sequence's keys."""

    def __init__(self, lengths: list[int], device):
        self.lengths = [n for n in lengths if n > 0]
        self.total = sum(self.lengths)
        self.max_len = max(self.lengths, default=0)
        self.device = device
        self._bounds = _cumsum(self.lengths)
        self._cu: torch.Tensor | None = None  # the flash path's cu_seqlens, uploaded on first use
        self._groups: list[tuple[int, int, torch.Tensor]] | None = None  # the SDPA path's, built on first use

    def groups(self) -> list[tuple[int, int, torch.Tensor]]:
        """(length, count, packed token index) per distinct sequence length."""
        if self._groups is None:
            by_length: dict[int, list[int]] = {}
            for n, start in zip(self.lengths, self._bounds):
                by_length.setdefault(n, []).append(start)
            self._groups = [(n, len(starts), upload((torch.tensor(starts)[:, None] + torch.arange(n)).reshape(-1),
                                                    self.device)) for n, starts in by_length.items()]
        return self._groups

    def __call__(self, layer: int, q, k, v):
        if varlen_flash_available(q):
            if self._cu is None:
                self._cu = upload(torch.tensor(self._bounds, dtype=torch.int32), q.device)
            o = varlen_causal(q[0].transpose(0, 1), k[0].transpose(0, 1), v[0].transpose(0, 1), self._cu, self._cu,
                              self.max_len, self.max_len)
            return _to_heads_first(o)
        groups = self.groups()
        if len(groups) == 1:  # one length: a view, no gather
            n, count, _ = groups[0]
            split = lambda t: t[0].view(t.shape[1], count, n, t.shape[3]).transpose(0, 1)
            o = sdpa(split(q), split(k), split(v), is_causal=True)  # (count, H, n, D)
            return o.transpose(0, 1).reshape(1, q.shape[1], self.total, q.shape[3])
        out = torch.empty_like(q)
        for n, count, index in groups:
            gather = lambda t: t[0][:, index].view(t.shape[1], count, n, t.shape[3]).transpose(0, 1)
            o = sdpa(gather(q), gather(k), gather(v), is_causal=True)
            out[0, :, index] = o.transpose(0, 1).reshape(q.shape[1], count * n, q.shape[3])
        return out


class PackedSuffixAttention:
    """Packed suffixes, each attending to its prompt's prefix K/V then to its own earlier tokens.

    Suffix s has `lengths[s]` tokens (host ints; 0 allowed) at consecutive packed positions, continues prompt
    `owners[s]` (a row of `prefix`), whose valid length is prefix_lengths[owners[s]] (host ints). Query i of a
    suffix sees the whole prefix and its suffix tokens 0..i: causal with the diagonal at the bottom right, the
    layout SharedPrefixAttention runs padded. Gradients reach the prefix K/V (and so the prefix graph) through
    the gathers.
    """

    def __init__(self, prefix: PrefixState, owners: list[int], lengths: list[int], prefix_lengths: list[int]):
        self.prefix = prefix
        self.device = prefix.k[0].device
        starts = _cumsum(lengths)
        self.total = starts[-1]
        self._live = [(s, o, prefix_lengths[o], n, starts[s]) for s, (o, n) in enumerate(zip(owners, lengths))
                      if n > 0]
        self._groups = None  # the SDPA path's, built on first use
        self._varlen = None  # (key gather index, cu_q, cu_k, max_q, max_k), built on first flash use

    def groups(self):
        """Per (prefix length, suffix length): (prefix length, suffix length, count, the suffixes' packed token
        index, their owners' prefix rows, the bottom-right causal mask for kernels without that alignment)."""
        if self._groups is None:
            by_pair: dict[tuple[int, int], list[tuple[int, int]]] = {}
            for _, o, plen, n, start in self._live:
                by_pair.setdefault((plen, n), []).append((o, start))
            self._groups = []
            for (plen, n), members in by_pair.items():
                index = (torch.tensor([st for _, st in members])[:, None] + torch.arange(n)).reshape(-1)
                rows = torch.tensor([o for o, _ in members])
                mask = torch.ones(n, plen + n, dtype=torch.bool).tril(diagonal=plen)
                self._groups.append((plen, n, len(members), upload(index, self.device), upload(rows, self.device),
                                     upload(mask, self.device)))
        return self._groups

    def _varlen_layout(self):
        """Packed keys of every suffix: its prompt's valid prefix rows, then its own tokens, as an index into
        cat(prefix K flattened (B * P), suffix K (N)); built on the host once per forward. Empty suffixes hold no
        packed tokens, so the queries are the packed tokens as they are."""
        if self._varlen is None:
            width = self.prefix.k[0].shape[2]
            base = self.prefix.k[0].shape[0] * width
            parts, cu_k = [], [0]
            for _, o, plen, n, start in self._live:
                parts += [torch.arange(plen) + o * width, torch.arange(n) + base + start]
                cu_k.append(cu_k[-1] + plen + n)
            cu_q = _cumsum([n for *_, n, _ in self._live])
            self._varlen = (upload(torch.cat(parts), self.device),
                            upload(torch.tensor(cu_q, dtype=torch.int32), self.device),
                            upload(torch.tensor(cu_k, dtype=torch.int32), self.device),
                            max(n for *_, n, _ in self._live), max(p + n for _, _, p, n, _ in self._live))
        return self._varlen

    def __call__(self, layer: int, q, k, v):
        pk, pv = self.prefix.k[layer], self.prefix.v[layer]
        if varlen_flash_available(q) and self._live:
            kidx, cu_q, cu_k, max_q, max_k = self._varlen_layout()
            flat = lambda p, t: torch.cat([p.transpose(1, 2).reshape(-1, p.shape[1], p.shape[3]),
                                           t[0].transpose(0, 1)])[kidx]
            o = varlen_causal(q[0].transpose(0, 1), flat(pk, k), flat(pv, v), cu_q, cu_k, max_q, max_k)
            return _to_heads_first(o)
        groups = self.groups()
        out = None if len(groups) == 1 and groups[0][2] * groups[0][1] == self.total else torch.empty_like(q)
        for plen, n, count, index, rows, mask in groups:
            gather = lambda t: t[0][:, index].view(t.shape[1], count, n, t.shape[3]).transpose(0, 1)
            keys = torch.cat([pk[rows, :, :plen], gather(k)], dim=2)
            values = torch.cat([pv[rows, :, :plen], gather(v)], dim=2)
            o = lower_right_causal(gather(q), keys, values, mask)  # (count, H, n, D)
            o = o.transpose(0, 1).reshape(q.shape[1], count * n, q.shape[3])
            if out is None:  # one group covering every token, packed in order
                return o[None]
            out[0, :, index] = o
        return out
