"""The attention layouts that run on flash-class kernels give what an explicit boolean mask over the same tokens
gives (fp32, 1e-5), forward and backward: suffixes over prefixes of different lengths, right-padded causal batches,
and the vision tower's packed windows when they do not tile the sequence evenly."""

import torch
import torch.nn.functional as F

from torchplex.models.attention import CausalAttention, PrefixState, SharedPrefixAttention, right_padded
from torchplex.models.qwen2_5_vl.model import VarlenLayout

TOL = 1e-5


def masked(q, k, v, allowed):
    rep = q.shape[1] // k.shape[1]
    return F.scaled_dot_product_attention(q, k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1),
                                          attn_mask=allowed)


def test_suffixes_over_prefixes_of_different_lengths():
    """Each suffix sees its own prompt's prefix (of that prompt's length, not the padded width) and its own earlier
    tokens, never a sibling's: checked per sample against an explicit mask, outputs and gradients."""
    torch.manual_seed(0)
    H, Hkv, D, R = 4, 2, 8, 5
    plens = [7, 4]
    width = max(plens)
    pk = torch.randn(2, Hkv, width, D, requires_grad=True)
    pv = torch.randn(2, Hkv, width, D, requires_grad=True)
    owners = torch.tensor([1, 0, 1, 0, 0])  # interleaved owners: the gather/scatter path
    lens = torch.tensor([5, 3, 2, 5, 1])
    q = torch.randn(5, H, R, D, requires_grad=True)
    k = torch.randn(5, Hkv, R, D, requires_grad=True)
    v = torch.randn(5, Hkv, R, D, requires_grad=True)
    state = PrefixState([pk], [pv], torch.tensor(plens), torch.zeros(2), torch.zeros(2, D))
    out = SharedPrefixAttention(state, owners, lens)(0, q, k, v)
    ref = []
    for s in range(5):
        p = plens[owners[s]]
        keys = torch.cat([pk[owners[s], :, :p], k[s]], dim=1)[None]
        vals = torch.cat([pv[owners[s], :, :p], v[s]], dim=1)[None]
        allowed = torch.ones(R, p + R, dtype=torch.bool).tril(diagonal=p)
        ref.append(masked(q[s:s + 1], keys, vals, allowed)[0])
    ref = torch.stack(ref)
    valid = (torch.arange(R)[None] < lens[:, None])[:, None, :, None]
    assert torch.allclose(out * valid, ref * valid, atol=TOL, rtol=TOL)
    weights = torch.randn_like(out) * valid
    got = torch.autograd.grad((out * weights).sum(), [q, k, v, pk, pv])
    want = torch.autograd.grad((ref * weights).sum(), [q, k, v, pk, pv])
    for g, w in zip(got, want):
        assert torch.allclose(g, w, atol=TOL, rtol=TOL)


def test_right_padded_batch_runs_unmasked_and_agrees():
    torch.manual_seed(1)
    lengths = torch.tensor([6, 3, 1])
    attention_mask = torch.arange(6)[None] < lengths[:, None]
    assert right_padded(attention_mask) and not right_padded(attention_mask.flip(1))
    ctx = CausalAttention(attention_mask=attention_mask)
    assert ctx.mask_for(6, torch.device("cpu")) is None  # the flash path: no mask built
    q, k, v = torch.randn(3, 4, 6, 8), torch.randn(3, 2, 6, 8), torch.randn(3, 2, 6, 8)
    allowed = torch.ones(6, 6, dtype=torch.bool).tril()[None] & attention_mask[:, None, :]
    allowed = (allowed | torch.eye(6, dtype=torch.bool))[:, None]
    valid = attention_mask[:, None, :, None]
    assert torch.allclose(ctx(0, q, k, v) * valid, masked(q, k, v, allowed) * valid, atol=TOL, rtol=TOL)


def test_vision_windows_that_do_not_tile_evenly():
    """Windows of two lengths (edge windows of a grid the window does not divide): gathered per length, each token
    attending within its own segment only."""
    torch.manual_seed(2)
    bounds = [0, 16, 24, 40, 48]
    q, k, v = (torch.randn(48, 2, 8) for _ in range(3))
    out = VarlenLayout(bounds, q.device).attention(q, k, v)
    seg = torch.bucketize(torch.arange(48), torch.tensor(bounds[1:]), right=True)
    allowed = (seg[:, None] == seg[None, :])[None, None]
    t = lambda x: x.transpose(0, 1)[None]
    ref = F.scaled_dot_product_attention(t(q), t(k), t(v), attn_mask=allowed)[0].transpose(0, 1)
    assert torch.allclose(out, ref, atol=TOL, rtol=TOL)
    even = VarlenLayout([0, 16, 32, 48], q.device)
    assert even.groups == [(16, 3, None)]  # tiles the sequence: a view, no index
