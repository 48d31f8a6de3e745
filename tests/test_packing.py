"""Packed scoring: a micro-batch's valid tokens in one token dimension, the only scoring path of both scorers.

Padding each group's suffixes (decomposed) or each serial row (prompt + response) to the longest row would make the
decoder's dense parts and the LM head run on up to ~3x the useful tokens with long-tailed responses. The packed
scorers must give the numbers of the definition (`FullSequenceReference`: every sample's own prompt + response, one
plain forward each, no padding, no packing): log-probs, entropies and every parameter gradient, fp32, <= 1e-5; and
the decoder's MLP must see exactly the valid tokens.
"""

from __future__ import annotations

import copy

import pytest
import torch

import torch.nn.functional as F

import torchplex.models.qwen2_5_vl.model as model_module
from torchplex.data.batching import collate, encode_visuals
from torchplex.models.attention import PrefixState
from torchplex.models.packing import PackedCausalAttention, PackedSuffixAttention
from torchplex.runtime.decomposition import DecomposedScorer
from torchplex.runtime.prefixes import fused_prefill
from torchplex.runtime.scoring import ScoreRequest, SerialScorer

TOL = 1e-5
GROUP = 4
# Two groups of G = 4 in one micro-batch, long-tailed: one long row, several short ones, an empty one.
LENGTHS = [23, 1, 3, 0, 2, 5, 1, 4]


@pytest.fixture(scope="module")
def assets(grpo_assets):
    return grpo_assets.prompts, grpo_assets.actor


def long_tailed_request(prompts, seed=0):
    """Prompts 0 and 2 (one and two images), G = 4 responses each, right-padded with pad id 0."""
    g = torch.Generator().manual_seed(seed)
    width = max(LENGTHS)
    tokens = torch.randint(10, 1000, (len(LENGTHS), width), generator=g)
    lengths = torch.tensor(LENGTHS)
    tokens[torch.arange(width)[None] >= lengths[:, None]] = 0
    return ScoreRequest([prompts[0], prompts[2]], [s // GROUP for s in range(len(LENGTHS))], tokens, lengths)


class FullSequenceReference:
    """The definition the packed scorers reproduce: each response scored by a plain forward of its own prompt and
    response (one row, nothing padded or packed), the LM head's log-softmax at temperature read at its tokens."""

    store = None

    def score(self, model, request: ScoreRequest, temperature: float, with_entropy: bool = False):
        width = request.tokens.shape[1]
        rows_logp, rows_entropy = [], []
        for s, i in enumerate(request.prompt_index):
            prompt, n = request.prompts[i], int(request.lengths[s])
            response = request.tokens[s, :n].tolist()
            batch = collate(model.args, [prompt], [response[:-1]] if n else [[]])
            image, video = encode_visuals(model, batch)
            hidden = model(batch.input_ids, batch.position_ids, image_embeds=image, video_embeds=video,
                           prompt_lengths=batch.prompt_lengths)
            start = len(prompt.input_ids) - 1  # the last prompt token predicts response token 0
            log_probs = F.log_softmax(model.logits(hidden[0, start:start + n]).float() / temperature, dim=-1)
            rows_logp.append(F.pad(log_probs[torch.arange(n), response], (0, width - n)))
            rows_entropy.append(F.pad(-(log_probs.exp() * log_probs).sum(-1), (0, width - n)))
        return torch.stack(rows_logp), torch.stack(rows_entropy) if with_entropy else None

    def backward(self, loss):
        loss.backward()

    def finish_backward(self):
        pass


def loss_of(logp, entropy, mask):
    weights = torch.linspace(0.5, 1.5, logp.shape[1])
    return (logp * mask * weights).sum() + 0.1 * (entropy * mask * weights.flip(0)).sum()


def rel(a, b):
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


def scored_with_grads(actor, make_scorer, prompts, held: bool, seed=0):
    model = copy.deepcopy(actor)
    model.visual.requires_grad_(True)
    scorer = make_scorer()
    request = long_tailed_request(prompts, seed)
    if held:  # the overlapped mode: prefixes from the fused rollout prefill, backpropagated in finish_backward
        fused_prefill(scorer, model, scorer.store)(request.prompts)
    logp, entropy = scorer.score(model, request, temperature=0.9, with_entropy=True)
    scorer.backward(loss_of(logp, entropy, request.mask))
    scorer.finish_backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return request.mask, logp.detach(), entropy.detach(), grads


def assert_same(packed, padded):
    mask, logp, entropy, grads = packed
    _, logp_ref, entropy_ref, grads_ref = padded
    assert rel(logp[mask], logp_ref[mask]) <= TOL
    assert rel(entropy[mask], entropy_ref[mask]) <= TOL
    assert (logp[~mask] == 0).all() and (entropy[~mask] == 0).all()  # pads are not scored at all
    assert grads.keys() == grads_ref.keys() and len(grads) > 0
    assert any(n.startswith("visual.") for n in grads)  # the vision tower trains, through the prefix
    for name, g in grads.items():
        assert rel(g, grads_ref[name]) <= TOL, name


@pytest.mark.parametrize("held", [False, True])
def test_packed_decomposed_equals_the_full_sequence_definition_and_every_gradient(assets, held):
    prompts, actor = assets
    packed = scored_with_grads(actor, DecomposedScorer, prompts, held)
    reference = scored_with_grads(actor, FullSequenceReference, prompts, held=False)
    assert_same(packed, reference)


def test_packed_serial_equals_the_full_sequence_definition_and_every_gradient(assets):
    prompts, actor = assets
    packed = scored_with_grads(actor, SerialScorer, prompts, held=False)
    reference = scored_with_grads(actor, FullSequenceReference, prompts, held=False)
    assert_same(packed, reference)


def test_packed_serial_equals_packed_decomposed(assets):
    prompts, actor = assets
    serial = scored_with_grads(actor, SerialScorer, prompts, held=False, seed=1)
    decomposed = scored_with_grads(actor, DecomposedScorer, prompts, held=False, seed=1)
    assert_same(decomposed, serial)


def mlp_rows(model, run) -> int:
    """Token rows the first decoder layer's MLP sees while `run()` runs."""
    rows = [0]
    hook = model.layers[0].feed_forward.register_forward_hook(
        lambda mod, inputs, out: rows.__setitem__(0, rows[0] + inputs[0].shape[:-1].numel()))
    try:
        run()
    finally:
        hook.remove()
    return rows[0]


@torch.no_grad()
def test_decoder_mlp_sees_only_valid_suffix_tokens(assets):
    prompts, actor = assets
    request = long_tailed_request(prompts)
    scorer = DecomposedScorer()
    prefix = scorer.prefix(actor, request.prompts)[0]
    packed = mlp_rows(actor, lambda: scorer.score_on_prefix(actor, prefix, request, 1.0))
    # Suffix inputs are each response without its last token (its last token predicts nothing): 32 rows, where
    # padding every suffix to the longest would run 8 x 22 = 176
    assert packed == sum(max(n - 1, 0) for n in LENGTHS) == 32


@torch.no_grad()
def test_serial_mlp_sees_only_valid_prompt_and_response_tokens(assets):
    prompts, actor = assets
    request = long_tailed_request(prompts)
    packed = mlp_rows(actor, lambda: SerialScorer().score(actor, request, 1.0))
    rows = [request.prompts[i] for i in request.prompt_index]
    assert packed == sum(len(p.input_ids) + max(n - 1, 0) for p, n in zip(rows, LENGTHS))
    assert packed < len(rows) * max(len(p.input_ids) + max(LENGTHS) - 1 for p in rows)  # padded rows: more


@torch.no_grad()
def test_packed_suffix_positions_are_the_padded_ones(assets, monkeypatch):
    """M-RoPE positions of suffix tokens stay prefix end + rope delta + offset: the valid tokens' positions of the
    padded suffix forward, in packed order (the image prompts make the delta non-zero)."""
    prompts, actor = assets
    request = long_tailed_request(prompts)
    prefix = DecomposedScorer().prefix(actor, request.prompts)[0]
    seen = []
    real = model_module.mrope_cos_sin
    monkeypatch.setattr(model_module, "mrope_cos_sin", lambda args, pos, dtype: seen.append(pos) or real(args, pos,
                                                                                                          dtype))
    DecomposedScorer().score_on_prefix(actor, prefix, request, 1.0)
    [packed] = seen
    inputs = torch.tensor(LENGTHS).sub(1).clamp(min=0)
    # collate's positions of each sample's prompt + response, the response part: what a whole sequence would use
    whole = [collate(actor.args, [request.prompts[o]], [request.tokens[s, :m].tolist()]).position_ids[:, 0]
             for s, (o, m) in enumerate(zip(request.prompt_index, inputs.tolist()))]
    expected = torch.cat([w[:, len(request.prompts[o].input_ids):] for w, o in zip(whole, request.prompt_index)], 1)
    assert torch.equal(packed[:, 0], expected)
    assert torch.equal(packed[0, 0], torch.cat([prefix.next_position[o] + torch.arange(m)
                                                for o, m in zip(request.prompt_index, inputs.tolist())]))
    prompt_lens = torch.tensor([len(p.input_ids) for p in request.prompts])
    assert (prefix.next_position != prompt_lens).all()  # the rope delta of the image prompts is not zero


def dense_reference(q, k, v, allowed):
    """Attention of q (H, Nq, D) over k/v (Hkv, Nk, D) with an explicit (Nq, Nk) boolean mask."""
    rep = q.shape[0] // k.shape[0]
    k, v = k.repeat_interleave(rep, 0), v.repeat_interleave(rep, 0)
    scores = (q @ k.transpose(-1, -2)) / q.shape[-1] ** 0.5
    return scores.masked_fill(~allowed, float("-inf")).softmax(-1) @ v


@pytest.mark.parametrize("lengths,owners,suffix_lens", [
    ([5, 1, 5, 3], [0, 1, 1, 0], [2, 0, 4, 2]),  # several lengths, an empty suffix: gathered groups
    ([3, 3, 3], [1, 1], [3, 3]),                  # one length covering every token: the view path
])
def test_packed_contexts_equal_a_dense_masked_reference(lengths, owners, suffix_lens):
    g = torch.Generator().manual_seed(0)
    heads, kv_heads, dim = 4, 2, 8
    rand = lambda *shape: torch.randn(*shape, generator=g, dtype=torch.float64)
    # Serial rows: causal within each, never across.
    n = sum(lengths)
    q, k, v = rand(1, heads, n, dim), rand(1, kv_heads, n, dim), rand(1, kv_heads, n, dim)
    seg = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    allowed = torch.ones(n, n, dtype=torch.bool).tril() & (seg[:, None] == seg[None])
    v = v.transpose(1, 2).contiguous().transpose(1, 2)  # the decoder's v: a (1, N, Hkv, D) projection, transposed
    out = PackedCausalAttention(lengths, q.device)(0, q, k, v)
    assert torch.allclose(out[0], dense_reference(q[0], k[0], v[0], allowed), atol=1e-12)
    # Suffixes on two prompts' prefixes (valid lengths 3 and 6, padded to 6).
    prefix_lens = [3, 6]
    prefix = PrefixState([rand(2, kv_heads, 6, dim)], [rand(2, kv_heads, 6, dim)], torch.tensor(prefix_lens),
                         torch.tensor([3, 6]), rand(2, heads * dim))
    n = sum(suffix_lens)
    q, k, v = rand(1, heads, n, dim), rand(1, kv_heads, n, dim), rand(1, kv_heads, n, dim)
    out = PackedSuffixAttention(prefix, owners, suffix_lens, prefix_lens)(0, q, k, v)
    start = 0
    for o, m in zip(owners, suffix_lens):
        if m == 0:
            continue
        p = prefix_lens[o]
        keys = torch.cat([prefix.k[0][o, :, :p], k[0, :, start:start + m]], dim=1)
        values = torch.cat([prefix.v[0][o, :, :p], v[0, :, start:start + m]], dim=1)
        allowed = torch.ones(m, p + m, dtype=torch.bool).tril(diagonal=p)
        ref = dense_reference(q[0, :, start:start + m], keys, values, allowed)
        assert torch.allclose(out[0, :, start:start + m], ref, atol=1e-12)
        start += m


def reference_varlen(q, k, v, cu_q, cu_k, max_q, max_k, **kwargs):
    """What the flash varlen kernel computes, on CPU: per sequence, causal with the diagonal at the bottom right."""
    assert kwargs.get("window_size", (-1, 0)) == (-1, 0) or kwargs.get("is_causal")
    out = torch.empty_like(q)
    cu_q, cu_k = cu_q.tolist(), cu_k.tolist()
    for i in range(len(cu_q) - 1):
        qs, ks = slice(cu_q[i], cu_q[i + 1]), slice(cu_k[i], cu_k[i + 1])
        m, n = qs.stop - qs.start, ks.stop - ks.start
        assert m <= max_q and n <= max_k
        allowed = torch.ones(m, n, dtype=torch.bool).tril(diagonal=n - m)
        out[qs] = dense_reference(q[qs].transpose(0, 1), k[ks].transpose(0, 1), v[ks].transpose(0, 1),
                                  allowed).transpose(0, 1)
    return out


def test_flash_varlen_layouts_index_the_right_keys(monkeypatch):
    """The CUDA path's one varlen call per layer (packed key index, cu_seqlens), checked on CPU with the kernel
    replaced by its definition: the same outputs as the per-length SDPA path."""
    import torchplex.models.packing as packing

    g = torch.Generator().manual_seed(1)
    heads, kv_heads, dim = 4, 2, 8
    rand = lambda *shape: torch.randn(*shape, generator=g, dtype=torch.float64)
    owners, suffix_lens, prefix_lens = [1, 0, 0, 1, 1], [3, 0, 1, 5, 2], [4, 2]
    prefix = PrefixState([rand(2, kv_heads, 5, dim)], [rand(2, kv_heads, 5, dim)], torch.tensor(prefix_lens),
                         torch.tensor([4, 2]), rand(2, heads * dim))
    n = sum(suffix_lens)
    q, k, v = rand(1, heads, n, dim), rand(1, kv_heads, n, dim), rand(1, kv_heads, n, dim)
    lengths = [4, 1, 6]
    qc, kc, vc = rand(1, heads, 11, dim), rand(1, kv_heads, 11, dim), rand(1, kv_heads, 11, dim)
    expected = (PackedSuffixAttention(prefix, owners, suffix_lens, prefix_lens)(0, q, k, v),
                PackedCausalAttention(lengths, q.device)(0, qc, kc, vc))
    monkeypatch.setattr(packing, "varlen_flash_available", lambda t: True)
    monkeypatch.setattr(packing, "_varlen_attn", reference_varlen)
    got = (PackedSuffixAttention(prefix, owners, suffix_lens, prefix_lens)(0, q, k, v),
           PackedCausalAttention(lengths, q.device)(0, qc, kc, vc))
    for a, b in zip(got, expected):
        assert torch.allclose(a, b, atol=1e-12)


class _SavingVarlen(torch.autograd.Function):
    """reference_varlen saving its inputs for backward as torch's varlen op does (query, key, value, ...)."""

    @staticmethod
    def forward(ctx, q, k, v, cu_q, cu_k, max_q, max_k):
        ctx.save_for_backward(q, k, v)  # as handed over: grouped K/V (enable_gqa) stay grouped
        return reference_varlen(q, k, v, cu_q, cu_k, max_q, max_k)  # no backward: only what it saves is counted


@pytest.mark.parametrize("path", ["sdpa", "varlen grouped", "varlen repeated"])
def test_packed_key_bytes_are_what_autograd_saves_of_the_suffix_keys(monkeypatch, path):
    """The decomposed training forward's whole-graph estimate adds memory_budget.packed_key_bytes with
    suffix_key_heads per layer: the keys and values each suffix attends to (its prompt's prefix rows, its own
    tokens), as saved for backward. Reference: the bytes autograd's saved-tensor hooks see of the K/V handed to the
    kernel. On CPU the masked SDPA path repeats K/V to the query heads, which the estimate once missed (it counted
    the grouped heads, half or less of what is kept)."""
    import torchplex.models.attention as attention
    import torchplex.models.packing as packing
    from torchplex.runtime.memory_budget import packed_key_bytes

    g = torch.Generator().manual_seed(2)
    heads, kv_heads, dim = 4, 2, 8
    rand = lambda *shape: torch.randn(*shape, generator=g, requires_grad=True)
    owners, suffix_lens, prefix_lens = [1, 0, 0, 1, 1], [3, 0, 1, 5, 2], [4, 2]
    prefix = PrefixState([rand(2, kv_heads, 5, dim)], [rand(2, kv_heads, 5, dim)], torch.tensor(prefix_lens),
                         torch.tensor([4, 2]), torch.randn(2, heads * dim))
    n = sum(suffix_lens)
    q, k, v = rand(1, heads, n, dim), rand(1, kv_heads, n, dim), rand(1, kv_heads, n, dim)
    handed = []  # the K/V tensors the kernel got
    if path == "sdpa":
        kernel = attention.F.scaled_dot_product_attention

        def recording(q, k, v, **kw):
            handed.extend([k, v])
            return kernel(q, k, v, **kw)

        monkeypatch.setattr(attention.F, "scaled_dot_product_attention", recording)
    else:
        monkeypatch.setattr(packing, "_flash_path", lambda *a: True)
        params = {"window_size"} | ({"enable_gqa"} if path == "varlen grouped" else set())
        monkeypatch.setattr(packing, "_VARLEN_PARAMS", params)

        def varlen(q, k, v, cu_q, cu_k, max_q, max_k, **kw):
            assert kw.get("enable_gqa", False) == ("enable_gqa" in params)
            handed.extend([k, v])
            return _SavingVarlen.apply(q, k, v, cu_q, cu_k, max_q, max_k)

        monkeypatch.setattr(packing, "_varlen_attn", varlen)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        PackedSuffixAttention(prefix, owners, suffix_lens, prefix_lens)(0, q, k, v)
    ptrs = {t.untyped_storage().data_ptr() for t in handed}
    kept = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes() for t in saved
            if t.untyped_storage().data_ptr() in ptrs}
    rows = sum(prefix_lens[o] + m for o, m in zip(owners, suffix_lens) if m)
    key_heads = packing.suffix_key_heads(heads, kv_heads, dim, "cpu", torch.float32)
    assert key_heads == {"sdpa": heads, "varlen grouped": kv_heads, "varlen repeated": heads}[path]
    assert len(kept) == len(handed) and sum(kept.values()) == packed_key_bytes(rows, 1, key_heads, dim, 4)
