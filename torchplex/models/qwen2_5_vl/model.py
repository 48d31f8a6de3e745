"""Qwen2.5-VL in native PyTorch: a windowed-attention vision tower and a Qwen2 decoder with multimodal RoPE.

The forward API is shaped for the RL runtime rather than for `generate`:
  encode_vision   pixel patches -> visual embeddings (reusable by several later calls)
  prefix_forward  prompt (visual embeddings spliced in) -> PrefixState (per-layer K/V + position state)
  suffix_forward  response tokens attending to a PrefixState; G suffixes share one prefix without copies
  forward         plain full-sequence forward over a padded or packed batch
All of them return final-norm hidden states; `logits()` applies the LM head so callers can chunk it.
Parameter names follow docs/architecture.md; nothing here knows about parallelism or RL phases.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from .. import fusion
from ..activations import activation
from ..attention import CausalAttention, PrefixAttention, PrefixState, SharedPrefixAttention
from ..packing import PackedCausalAttention, PackedSuffixAttention, upload
from .args import ModelArgs, TextArgs, VisionArgs
from .rope_index import text_positions
from .rope_scaling import text_inv_freq


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return fusion.rms_norm(x, self.weight, self.eps)


class GatedMLP(nn.Module):
    """Gated MLP: w2(act(w1 x) * w3 x); SwiGLU with the published configs' hidden_act "silu"."""

    def __init__(self, dim: int, hidden: int, bias: bool, hidden_act: str = "silu"):
        super().__init__()
        self.w1 = nn.Linear(dim, hidden, bias=bias)
        self.w3 = nn.Linear(dim, hidden, bias=bias)
        self.w2 = nn.Linear(hidden, dim, bias=bias)
        self.act = activation(hidden_act)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        width = fusion.aligned_width(self.w1.out_features)
        if width == self.w1.out_features:
            return self.w2(fusion.gated(self.w1(x), self.w3(x), self.act))
        # an odd width (the vision tower's 3420) runs zero-padded on aligned GEMM kernels: see models/fusion.py
        w1, b1 = fusion.padded_rows(self.w1.weight, self.w1.bias, width)
        w3, b3 = fusion.padded_rows(self.w3.weight, self.w3.bias, width)
        h = fusion.gated(F.linear(x, w1, b1), F.linear(x, w3, b3), self.act)
        return F.linear(h, fusion.padded_columns(self.w2.weight, width), self.w2.bias)


# ---------------------------------------------------------------------------------------------------
# Vision tower
# ---------------------------------------------------------------------------------------------------

class VarlenLayout:
    """Segments of a packed sequence for bidirectional attention within each, grouped by length: each group is one
    batched SDPA call (flash kernels, no mask), so a tower with hundreds of windows costs a few launches per layer.

    Built once per tower forward (the index tensors go to the device once, not once per layer). A group whose
    segments tile the whole sequence in order (equal windows of equal images, or whole frames) is a view of the
    sequence: no gather in, no scatter out.
    """

    def __init__(self, cu_seqlens: list[int], device):
        by_length: dict[int, list[int]] = {}
        for start, end in zip(cu_seqlens[:-1], cu_seqlens[1:]):
            by_length.setdefault(end - start, []).append(start)
        self.total = cu_seqlens[-1]
        self.groups: list[tuple[int, int, torch.Tensor | None]] = []  # (length, count, patch index or None)
        for n, starts in by_length.items():
            if starts == list(range(0, self.total, n)):
                self.groups.append((n, len(starts), None))
            else:
                index = (torch.tensor(starts)[:, None] + torch.arange(n)).reshape(-1).to(device)
                self.groups.append((n, len(starts), index))

    def attention(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q/k/v (S, H, D) -> (S, H, D), each token attending to its own segment."""
        if len(self.groups) == 1 and self.groups[0][2] is None:
            n, count, _ = self.groups[0]
            split = lambda t: t.view(count, n, t.shape[1], t.shape[2]).transpose(1, 2)
            return F.scaled_dot_product_attention(split(q), split(k), split(v)).transpose(1, 2).reshape(q.shape)
        out = torch.empty_like(q)
        for n, count, index in self.groups:
            if index is None:
                index = torch.arange(self.total, device=q.device)
            gather = lambda t: t[index].view(count, n, t.shape[1], t.shape[2]).transpose(1, 2)
            o = F.scaled_dot_product_attention(gather(q), gather(k), gather(v))
            out[index] = o.transpose(1, 2).reshape(-1, q.shape[1], q.shape[2])
        return out


def varlen_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cu_seqlens) -> torch.Tensor:
    """Bidirectional attention within each segment of a packed sequence. q/k/v: (S, H, D); cu_seqlens: the
    segment boundaries, or their VarlenLayout."""
    layout = cu_seqlens if isinstance(cu_seqlens, VarlenLayout) else VarlenLayout(cu_seqlens, q.device)
    return layout.attention(q, k, v)


class VisionAttention(nn.Module):
    def __init__(self, args: VisionArgs):
        super().__init__()
        self.num_heads = args.num_heads
        self.qkv = nn.Linear(args.hidden_size, 3 * args.hidden_size, bias=True)
        self.proj = nn.Linear(args.hidden_size, args.hidden_size, bias=True)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cu_seqlens) -> torch.Tensor:
        seq = x.shape[0]
        q, k, v = self.qkv(x).view(seq, 3, self.num_heads, -1).unbind(1)
        # Rotate in fp32, as the reference does, then return to the activation dtype.
        q, k = fusion.rotary_fp32(q, k, cos[:, None], sin[:, None])
        return self.proj(varlen_attention(q, k, v, cu_seqlens).reshape(seq, -1))


class VisionBlock(nn.Module):
    def __init__(self, args: VisionArgs):
        super().__init__()
        self.norm1 = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.attn = VisionAttention(args)
        self.norm2 = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.mlp = GatedMLP(args.hidden_size, args.intermediate_size, bias=True, hidden_act=args.hidden_act)

    def forward(self, x, cos, sin, cu_seqlens):
        x = x + self.attn(self.norm1(x), cos, sin, cu_seqlens)
        return x + self.mlp(self.norm2(x))


class PatchMerger(nn.Module):
    """Concatenate each merge x merge block of patches and project to the language model width."""

    def __init__(self, args: VisionArgs):
        super().__init__()
        self.merged_dim = args.hidden_size * args.spatial_merge_size ** 2
        self.norm = RMSNorm(args.hidden_size, 1e-6)
        self.fc1 = nn.Linear(self.merged_dim, self.merged_dim)
        self.fc2 = nn.Linear(self.merged_dim, args.out_hidden_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(self.norm(x).view(-1, self.merged_dim))))


class PatchEmbed(nn.Module):
    """A Conv3d whose stride equals its kernel is a linear map of each flattened patch; the weight keeps
    the Conv3d shape (D, C, Tp, P, P) so checkpoints map one to one."""

    def __init__(self, args: VisionArgs):
        super().__init__()
        a = args
        self.weight = nn.Parameter(
            torch.empty(a.hidden_size, a.in_channels, a.temporal_patch_size, a.patch_size, a.patch_size))

    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        w = self.weight
        return F.linear(pixel_values.to(w.dtype), w.reshape(w.shape[0], -1))


class VisionTransformer(nn.Module):
    def __init__(self, args: VisionArgs):
        super().__init__()
        self.args = args
        self.patch_embed = PatchEmbed(args)
        self.blocks = nn.ModuleList(VisionBlock(args) for _ in range(args.depth))
        self.merger = PatchMerger(args)

    # The layout helpers below work on host lists: grids are tiny and their results are index tensors.
    def _rotary(self, grid_thw: list[list[int]], device) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-patch 2-D rotary angles (h then w), patches in merge-block-major order."""
        m, dim = self.args.spatial_merge_size, self.args.head_dim // 2
        inv_freq = 1.0 / (self.args.rope_theta ** (torch.arange(0, dim, 2, device=device, dtype=torch.float) / dim))
        coords = []
        for t, h, w in grid_thw:
            hh = torch.arange(h, device=device).view(h // m, m, 1, 1).expand(h // m, m, w // m, m)
            ww = torch.arange(w, device=device).view(1, 1, w // m, m).expand(h // m, m, w // m, m)
            hw = torch.stack([hh.transpose(1, 2).reshape(-1), ww.transpose(1, 2).reshape(-1)], dim=-1)
            coords.append(hw.repeat(t, 1))
        coords = torch.cat(coords).float()
        angles = (coords[:, :, None] * inv_freq).flatten(1)  # (N, dim): h angles then w angles
        angles = torch.cat([angles, angles], dim=-1)
        return angles.cos(), angles.sin()

    def _windows(self, grid_thw: list[list[int]]) -> tuple[torch.Tensor, list[int]]:
        """Order of merged tokens that makes each attention window contiguous, and the window boundaries
        (in patches). Windows tile each frame's merged grid in squares of window_size pixels."""
        a = self.args
        m2 = a.spatial_merge_size ** 2
        side = a.window_size // a.spatial_merge_size // a.patch_size
        order, bounds, offset = [], [0], 0
        for t, h, w in grid_thw:
            gh, gw = h // a.spatial_merge_size, w // a.spatial_merge_size
            ids = torch.arange(t * gh * gw).view(t, gh, gw) + offset
            for f in range(t):
                for r in range(0, gh, side):
                    for c in range(0, gw, side):
                        win = ids[f, r:r + side, c:c + side].reshape(-1)
                        order.append(win)
                        bounds.append(bounds[-1] + win.numel() * m2)
            offset += t * gh * gw
        return torch.cat(order), bounds

    def forward(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        """pixel_values (N_patches, C*Tp*P*P) -> merged visual embeddings (N_patches / merge^2, D_text)."""
        a = self.args
        grids = grid_thw.tolist()
        m2 = a.spatial_merge_size ** 2
        x = self.patch_embed(pixel_values)
        cos, sin = self._rotary(grids, x.device)
        window_order, window_bounds = self._windows(grids)
        window_order = window_order.to(x.device)
        full_bounds = [0]
        for t, h, ww in grids:
            for _ in range(t):
                full_bounds.append(full_bounds[-1] + h * ww)
        # Permute patches (in groups of merge^2) into window order; every block sees the same order.
        permute = lambda y: y.view(-1, m2, y.shape[-1])[window_order].reshape(-1, y.shape[-1])
        x, cos, sin = permute(x), permute(cos), permute(sin)
        # Full-attention blocks attend within each frame; the order inside a frame does not change it.
        full, windowed = VarlenLayout(full_bounds, x.device), VarlenLayout(window_bounds, x.device)
        for i, block in enumerate(self.blocks):
            x = block(x, cos, sin, full if i in a.fullatt_block_indexes else windowed)
        merged = self.merger(x)
        return merged[torch.argsort(window_order)]


# ---------------------------------------------------------------------------------------------------
# Language model
# ---------------------------------------------------------------------------------------------------

def mrope_cos_sin(args: TextArgs, position_ids: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """position_ids (3, B, T) -> cos, sin (B, 1, T, D). Frequency band i of each section takes its angle from
    the t, h or w axis (mrope_section), the two halves of the head dim repeat the same bands. Scaled RoPE
    (linear, yarn) changes the frequencies, and yarn multiplies cos and sin by its attention factor in fp32."""
    inv_freq, scale = text_inv_freq(args.rope_scaling, args.rope_theta, args.head_dim, args.max_position_embeddings,
                                    position_ids.device)
    angles = position_ids[..., None].float() * inv_freq  # (3, B, T, D/2)
    axis = torch.cat([torch.full((n,), i, device=position_ids.device) for i, n in enumerate(args.mrope_section)])
    angles = angles.gather(0, axis.view(1, 1, 1, -1).expand(1, *angles.shape[1:])).squeeze(0)
    angles = torch.cat([angles, angles], dim=-1)
    cos, sin = angles.cos(), angles.sin()
    if scale != 1.0:
        cos, sin = cos * scale, sin * scale
    return cos.to(dtype)[:, None], sin.to(dtype)[:, None]


class Attention(nn.Module):
    def __init__(self, args: TextArgs):
        super().__init__()
        self.num_heads, self.num_kv_heads, self.head_dim = args.num_heads, args.num_kv_heads, args.head_dim
        self.wq = nn.Linear(args.hidden_size, args.num_heads * args.head_dim, bias=True)
        self.wk = nn.Linear(args.hidden_size, args.num_kv_heads * args.head_dim, bias=True)
        self.wv = nn.Linear(args.hidden_size, args.num_kv_heads * args.head_dim, bias=True)
        self.wo = nn.Linear(args.num_heads * args.head_dim, args.hidden_size, bias=False)

        # A fused copy of wq|wk|wv (weight, bias) for no-grad decode: one projection launch instead of three, which
        # at decode batch sizes are each latency-bound. Not a parameter: refreshed by fuse_qkv() after the weights
        # change, in place, so a CUDA graph that reads it stays valid.
        self.qkv_copy: tuple[torch.Tensor, torch.Tensor] | None = None

    @torch.no_grad()
    def fuse_qkv(self) -> None:
        """Copy the current wq|wk|wv into the fused copy (allocated on first use, or when the weights moved)."""
        parts = (self.wq, self.wk, self.wv)
        w = self.wq.weight
        if self.qkv_copy is None or (self.qkv_copy[0].device, self.qkv_copy[0].dtype) != (w.device, w.dtype):
            rows = sum(m.weight.shape[0] for m in parts)
            self.qkv_copy = (w.new_empty(rows, w.shape[1]), w.new_empty(rows))
        start = 0
        for m in parts:
            end = start + m.weight.shape[0]
            self.qkv_copy[0][start:end].copy_(m.weight)
            self.qkv_copy[1][start:end].copy_(m.bias)
            start = end

    def project(self, x, cos, sin, fused_qkv: bool = False):
        """Rotated q (B, H, T, D) and k, v (B, Hkv, T, D) of x (B, T, hidden)."""
        b, t, _ = x.shape
        if fused_qkv:  # the decode step, after fuse_qkv(); never with autograd (the copy has none)
            qkv = F.linear(x, *self.qkv_copy).view(b, t, -1, self.head_dim).transpose(1, 2)
            q, k, v = qkv.split([self.num_heads, self.num_kv_heads, self.num_kv_heads], dim=1)
        else:
            q = self.wq(x).view(b, t, -1, self.head_dim).transpose(1, 2)
            k = self.wk(x).view(b, t, -1, self.head_dim).transpose(1, 2)
            v = self.wv(x).view(b, t, -1, self.head_dim).transpose(1, 2)
        return (*fusion.rotary(q, k, cos, sin), v)

    def output(self, out: torch.Tensor) -> torch.Tensor:
        """The output projection of the attention result (B, H, T, D) -> (B, T, hidden)."""
        b, _, t, _ = out.shape
        return self.wo(out.transpose(1, 2).reshape(b, t, -1))

    def forward(self, x, cos, sin, attn, layer: int, fused_qkv: bool = False):
        return self.output(attn(layer, *self.project(x, cos, sin, fused_qkv)))


class DecoderLayer(nn.Module):
    """One decoder layer, written as two pure tensor functions around the attention context's call:
    `attention_inputs` (norm, q/k/v, rotary) and `attention_outputs` (output projection, residual, norm, MLP,
    residual). The context (a Python object holding a layer's cache, masks and host lists) stays outside both, so
    a compiler given the two functions (parallelize.apply_compile) sees the same graph in every layer and phase."""

    def __init__(self, args: TextArgs):
        super().__init__()
        self.attention_norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.attention = Attention(args)
        self.ffn_norm = RMSNorm(args.hidden_size, args.rms_norm_eps)
        self.feed_forward = GatedMLP(args.hidden_size, args.intermediate_size, bias=False, hidden_act=args.hidden_act)

    def attention_inputs(self, h, cos, sin, fused_qkv: bool = False):
        return self.attention.project(self.attention_norm(h), cos, sin, fused_qkv)

    def attention_outputs(self, h, out):
        h = h + self.attention.output(out)
        return h + self.feed_forward(self.ffn_norm(h))

    def forward(self, h, cos, sin, attn, layer: int, fused_qkv: bool = False):
        return self.attention_outputs(h, attn(layer, *self.attention_inputs(h, cos, sin, fused_qkv)))


class Qwen2_5_VLModel(nn.Module):
    def __init__(self, args: ModelArgs):
        super().__init__()
        self.args = args
        t = args.text
        self.visual = VisionTransformer(args.vision)
        self.tok_embeddings = nn.Embedding(t.vocab_size, t.hidden_size)
        self.layers = nn.ModuleList(DecoderLayer(t) for _ in range(t.num_layers))
        self.norm = RMSNorm(t.hidden_size, t.rms_norm_eps)
        self.output = None if t.tie_word_embeddings else nn.Linear(t.hidden_size, t.vocab_size, bias=False)

    @torch.no_grad()
    def init_weights(self, std: float = 0.02, generator: torch.Generator | None = None) -> None:
        """Random init for a model built on the meta device and materialised with `to_empty`."""
        for module in self.modules():
            if isinstance(module, RMSNorm):
                module.weight.fill_(1.0)
            elif isinstance(module, nn.Linear):
                module.weight.normal_(0.0, std, generator=generator)
                if module.bias is not None:
                    module.bias.zero_()
            elif isinstance(module, nn.Embedding):
                module.weight.normal_(0.0, std, generator=generator)
        self.visual.patch_embed.weight.normal_(0.0, std, generator=generator)

    @property
    def output_weight(self) -> torch.Tensor:
        return self.tok_embeddings.weight if self.output is None else self.output.weight

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden, self.output_weight)

    # ---- (a) vision -----------------------------------------------------------------------------
    def encode_vision(self, pixel_values: torch.Tensor, grid_thw: torch.Tensor) -> torch.Tensor:
        return self.visual(pixel_values, grid_thw)

    # ---- shared pieces ----------------------------------------------------------------------------
    def embed(self, input_ids: torch.Tensor, image_embeds: torch.Tensor | None = None,
              video_embeds: torch.Tensor | None = None, prompt_lengths: torch.Tensor | None = None,
              prompt_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Token embeddings with visual embeddings spliced in at the image/video pad tokens, in order.

        With `prompt_lengths` (B,), only the first prompt_lengths[b] tokens of row b can be visual slots: a pad id
        that a policy happened to sample in its response is an ordinary token there. `prompt_mask` (B, T) says
        the same per token, for packed rows.
        """
        h = self.tok_embeddings(input_ids)
        in_prompt = prompt_mask
        if prompt_lengths is not None:
            in_prompt = torch.arange(input_ids.shape[1], device=input_ids.device)[None] < prompt_lengths[:, None]
        for token_id, embeds, kind in ((self.args.image_token_id, image_embeds, "image"),
                                       (self.args.video_token_id, video_embeds, "video")):
            slots = input_ids == token_id
            if in_prompt is not None:
                slots = slots & in_prompt
            count = int(slots.sum())
            have = 0 if embeds is None else embeds.shape[0]
            if count != have:
                raise ValueError(f"{count} {kind} pad tokens in input_ids but {have} {kind} embeddings")
            if count:
                h = h.masked_scatter(slots[..., None], embeds.to(h.dtype))
        return h

    def decode(self, h: torch.Tensor, position_ids: torch.Tensor, attn, fused_qkv: bool = False) -> torch.Tensor:
        """Run the decoder layers over embeddings h (B, T, D) at positions (3, B, T); final-norm hidden.
        fused_qkv: project q/k/v with the fused copies of `fuse_qkv()` (no-grad decode only)."""
        cos, sin = mrope_cos_sin(self.args.text, position_ids, h.dtype)
        for i, layer in enumerate(self.layers):
            h = layer(h, cos, sin, attn, i, fused_qkv)
        return self.norm(h)

    def fuse_qkv(self) -> None:
        """(Re)build every layer's fused q/k/v copy from the current weights (in place after the first call)."""
        for layer in self.layers:
            layer.attention.fuse_qkv()

    # ---- (d) full sequence --------------------------------------------------------------------------
    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor | None = None, *,
                image_embeds: torch.Tensor | None = None, video_embeds: torch.Tensor | None = None,
                attention_mask: torch.Tensor | None = None, segment_ids: torch.Tensor | None = None,
                prompt_lengths: torch.Tensor | None = None) -> torch.Tensor:
        """Hidden states (B, T, D) of a padded (attention_mask) or packed (segment_ids) batch."""
        if position_ids is None:
            position_ids = torch.arange(input_ids.shape[1], device=input_ids.device).expand(3, *input_ids.shape)
        h = self.embed(input_ids, image_embeds, video_embeds, prompt_lengths)
        return self.decode(h, position_ids, CausalAttention(attention_mask, segment_ids))

    # ---- (b) prefix -------------------------------------------------------------------------------
    def prefix_forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, next_position: torch.Tensor,
                       lengths: torch.Tensor | None = None, *, image_embeds: torch.Tensor | None = None,
                       video_embeds: torch.Tensor | None = None) -> PrefixState:
        """Forward over right-padded prompts (B, P), keeping every layer's K/V for later suffixes."""
        if lengths is None:
            lengths = torch.full((input_ids.shape[0],), input_ids.shape[1], device=input_ids.device)
        h = self.embed(input_ids, image_embeds, video_embeds)
        attn = PrefixAttention(lengths)
        hidden = self.decode(h, position_ids, attn)
        last = hidden[torch.arange(hidden.shape[0], device=hidden.device), lengths - 1]
        return PrefixState(attn.k, attn.v, lengths, next_position, last)

    # ---- (c) suffix -------------------------------------------------------------------------------
    def suffix_forward(self, prefix: PrefixState, tokens: torch.Tensor, suffix_lens: torch.Tensor | None = None,
                       prefix_index: torch.Tensor | None = None) -> torch.Tensor:
        """Hidden states (S, R, D) of response tokens (S, R); suffix s continues prompt prefix_index[s]."""
        s, r = tokens.shape
        if prefix_index is None:
            if prefix.batch_size != 1:
                raise ValueError("prefix_index is required when the prefix state holds several prompts")
            prefix_index = torch.zeros(s, dtype=torch.long, device=tokens.device)
        if suffix_lens is None:
            suffix_lens = torch.full((s,), r, device=tokens.device)
        positions = text_positions(prefix.next_position[prefix_index], r)
        h = self.tok_embeddings(tokens)
        return self.decode(h, positions, SharedPrefixAttention(prefix, prefix_index, suffix_lens))

    # ---- packed (varlen) variants: valid tokens only, no padding ---------------------------------------
    def packed_forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor, lengths: list[int], *,
                       image_embeds: torch.Tensor | None = None, video_embeds: torch.Tensor | None = None,
                       prompt_mask: torch.Tensor | None = None) -> torch.Tensor:
        """Hidden states (N, D) of sequences packed back to back: input_ids (N,), position_ids (3, N), each
        sequence's length in `lengths` (host ints, summing to N); plain causal attention within each."""
        h = self.embed(input_ids[None], image_embeds, video_embeds,
                       prompt_mask=None if prompt_mask is None else prompt_mask[None])
        return self.decode(h, position_ids[:, None], PackedCausalAttention(lengths, input_ids.device))[0]

    def packed_suffix_forward(self, prefix: PrefixState, tokens: torch.Tensor, owners: list[int],
                              lengths: list[int], prefix_lengths: list[int] | None = None) -> torch.Tensor:
        """Hidden states (N, D) of packed suffix tokens (N,): suffix s is the next lengths[s] tokens and continues
        prompt owners[s] (host ints; lengths may be 0). The same numbers as suffix_forward's valid rows."""
        if prefix_lengths is None:
            prefix_lengths = prefix.lengths.tolist()
        device = tokens.device
        owner_of = torch.tensor([o for o, n in zip(owners, lengths) for _ in range(n)], dtype=torch.long)
        offset = torch.cat([torch.arange(n) for n in lengths]) if lengths else torch.zeros(0, dtype=torch.long)
        # Text continuing each prompt: its next position plus the offset in the suffix, on all three axes.
        positions = (prefix.next_position[upload(owner_of, device)] + upload(offset, device)).expand(3, 1, -1)
        h = self.tok_embeddings(tokens)[None]
        attn = PackedSuffixAttention(prefix, owners, lengths, prefix_lengths)
        return self.decode(h, positions, attn)[0]
