"""Compiled flex-attention decoding against an fp64 reference, case by case (GPU diagnosis of the decode kernel)."""
import faulthandler
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from torch.nn.attention.flex_attention import AuxRequest, flex_attention  # noqa: E402

from torchplex.rollout.decode_attention import length_block_mask, length_blocks  # noqa: E402

faulthandler.dump_traceback_later(240, exit=True)
dev = "cuda"
compiled = torch.compile(flex_attention, dynamic=False)


def reference(q, k, v, lengths):
    rep = q.shape[1] // k.shape[1]
    k, v = k.double().repeat_interleave(rep, 1), v.double().repeat_interleave(rep, 1)
    s = q.double() @ k.transpose(-1, -2) * q.shape[-1] ** -0.5
    valid = torch.arange(k.shape[2], device=q.device)[None] < lengths[:, None]
    s = s.masked_fill(~valid[:, None, None], float("-inf"))
    return torch.softmax(s, -1) @ v, torch.logsumexp(s, -1)


def case(name, B, H, Hkv, Lq, L, lengths, use_mask=True, dtype=torch.bfloat16):
    g = torch.Generator(device=dev).manual_seed(0)
    q = torch.randn(B, H, Lq, 128, device=dev, dtype=dtype, generator=g)
    k = torch.randn(B, Hkv, L, 128, device=dev, dtype=dtype, generator=g)
    v = torch.randn(B, Hkv, L, 128, device=dev, dtype=dtype, generator=g)
    lengths = torch.tensor(lengths, device=dev)
    mask = (length_block_mask(length_blocks(lengths, L), lambda b, h, qi, kv: kv < lengths[b], Lq, L) if use_mask
            else None)
    out, aux = compiled(q, k, v, block_mask=mask, enable_gqa=H != Hkv, return_aux=AuxRequest(lse=True))
    ref_o, ref_lse = reference(q, k, v, lengths)
    row = {"case": name, "out_err": ((out.double() - ref_o).abs().max() / ref_o.abs().max()).item(),
           "lse_err": (aux.lse.double() - ref_lse).abs().max().item()}
    print(json.dumps(row), flush=True)
    return row


rows = []
for args in [("plain", 3, 28, 4, 1, 256, [256] * 3, False), ("mask_full", 3, 28, 4, 1, 256, [256] * 3),
             ("mask_lengths", 3, 28, 4, 1, 256, [1, 100, 256]), ("mha_lengths", 3, 4, 4, 1, 256, [1, 100, 256]),
             ("gqa8_lengths", 3, 32, 4, 1, 256, [1, 100, 256]), ("q4", 3, 28, 4, 4, 256, [1, 100, 256]),
             ("kv200", 3, 28, 4, 1, 200, [1, 128, 200]), ("kv200_q4", 3, 28, 4, 4, 200, [5, 129, 199]),
             ("big", 64, 28, 4, 1, 2048, [2048] * 64)]:
    try:
        rows.append(case(*args))
    except Exception as err:
        print(json.dumps({"case": args[0], "error": repr(err)[:1500]}), flush=True)
