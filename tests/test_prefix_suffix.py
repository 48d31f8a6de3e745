"""prefix_forward + suffix_forward must equal the plain full-sequence forward: logits and every gradient."""

import torch

from torchplex.models.qwen2_5_vl.args import get_flavor
from torchplex.models.qwen2_5_vl.model import Qwen2_5_VLModel
from torchplex.models.qwen2_5_vl.rope_index import get_rope_index

RTOL = 1e-5
IMG = 2000
PATCH = 3 * 2 * 14 * 14


def make_model(seed=0):
    args = get_flavor("debug").with_token_ids(image_token_id=IMG, video_token_id=2001, vision_start_token_id=2002,
                                              vision_end_token_id=2003)
    torch.manual_seed(seed)
    model = Qwen2_5_VLModel(args)
    model.init_weights(std=0.05)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    return args, model


def prompt(grid):
    t, h, w = grid
    return [5, 6, 2002] + [IMG] * (t * h * w // 4) + [2003, 7, 8]


def full_reference(model, args, prompt_ids, grid, pix, responses):
    """Each response run as prompt+response through forward(); returns per-response logits over its tokens
    (the positions predicting response tokens) and the summed loss."""
    outs = []
    for resp in responses:
        ids = torch.tensor([prompt_ids + resp])
        pos, _ = get_rope_index(args, ids, grid)
        hidden = model(ids, pos, image_embeds=model.encode_vision(pix, grid))
        p = len(prompt_ids)
        outs.append(model.logits(hidden[0, p - 1:p - 1 + len(resp)]))
    return outs


def decomposed(model, args, prompt_ids, grid, pix, responses):
    ids = torch.tensor([prompt_ids])
    pos, nxt = get_rope_index(args, ids, grid)
    prefix = model.prefix_forward(ids, pos, nxt, image_embeds=model.encode_vision(pix, grid))
    width = max(len(r) for r in responses)
    tokens = torch.tensor([r + [0] * (width - len(r)) for r in responses])
    lens = torch.tensor([len(r) for r in responses])
    hidden = model.suffix_forward(prefix, tokens, lens)
    outs = []
    for i, r in enumerate(responses):
        # logits predicting response token j: last prefix position for j=0, suffix position j-1 after that
        h = torch.cat([prefix.last_hidden[0:1], hidden[i, :len(r) - 1]])
        outs.append(model.logits(h))
    return outs


def loss_of(logit_list, responses):
    return sum(torch.nn.functional.cross_entropy(l, torch.tensor(r), reduction="sum") for l, r in zip(logit_list, responses))


def grads(model):
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def test_group_of_four_suffixes_matches_full_forward():
    args, model = make_model()
    grid = torch.tensor([[1, 8, 12]])
    torch.manual_seed(1)
    pix = torch.randn(96, PATCH, )
    prompt_ids = prompt((1, 8, 12))
    responses = [[11, 12, 13, 14, 15], [21, 22], [31, 32, 33, 34, 35, 36, 37, 38], [41]]

    ref = full_reference(model, args, prompt_ids, grid, pix, responses)
    loss_of(ref, responses).backward()
    ref_grads = grads(model)
    model.zero_grad(set_to_none=True)

    ours = decomposed(model, args, prompt_ids, grid, pix, responses)
    loss_of(ours, responses).backward()
    our_grads = grads(model)

    for a, b in zip(ours, ref):
        assert ((a - b).abs().max() / b.abs().max()).item() < RTOL
    assert set(our_grads) == set(ref_grads)
    vision_grads = [n for n in ref_grads if n.startswith("visual.")]
    assert vision_grads, "gradients must reach the vision tower"
    for name, g in ref_grads.items():
        err = (our_grads[name] - g).abs().max() / g.abs().max().clamp_min(1e-30)
        assert err.item() < RTOL, name


def test_several_prompts_in_one_prefix_state():
    """Two prompts of different lengths in one right-padded prefix batch, suffixes interleaved."""
    args, model = make_model(seed=3)
    grids = torch.tensor([[1, 4, 4], [1, 8, 4]])
    torch.manual_seed(2)
    pix = torch.randn(16 + 32, PATCH, )
    p0, p1 = prompt((1, 4, 4)), prompt((1, 8, 4)) + [9, 9, 9]
    width = max(len(p0), len(p1))
    ids = torch.tensor([p0 + [0] * (width - len(p0)), p1 + [0] * (width - len(p1))])
    lengths = torch.tensor([len(p0), len(p1)])
    mask = torch.arange(width)[None] < lengths[:, None]
    with torch.no_grad():
        pos, nxt = get_rope_index(args, ids, grids, attention_mask=mask)
        prefix = model.prefix_forward(ids, pos, nxt, lengths, image_embeds=model.encode_vision(pix, grids))
        responses = [[11, 12, 13], [21, 22, 23, 24], [31], [41, 42]]
        owner = torch.tensor([1, 0, 1, 0])
        tokens = torch.tensor([r + [0] * (4 - len(r)) for r in responses])
        hidden = model.suffix_forward(prefix, tokens, torch.tensor([len(r) for r in responses]), owner)
        for i, r in enumerate(responses):
            p = [p0, p1][owner[i]]
            g = grids[owner[i]:owner[i] + 1]
            pv = pix[:16] if owner[i] == 0 else pix[16:]
            full_ids = torch.tensor([p + r])
            fpos, _ = get_rope_index(args, full_ids, g)
            full = model(full_ids, fpos, image_embeds=model.encode_vision(pv, g))
            ref = full[0, len(p):]
            assert ((hidden[i, :len(r)] - ref).abs().max() / ref.abs().max()).item() < RTOL
            last_ref = full[0, len(p) - 1]
            assert ((prefix.last_hidden[owner[i]] - last_ref).abs().max() / last_ref.abs().max()).item() < RTOL
