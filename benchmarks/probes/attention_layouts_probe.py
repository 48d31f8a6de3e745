"""GPU check of the suffix attention layouts (issue 19): the bottom-right causal flash call with grouped K/V heads
against fp32 math on the same tokens, and its time (forward + backward) against the boolean-mask group call it
replaced. One GRPO group: n suffixes of R tokens over one prefix of P tokens, 7B heads (28 query, 4 K/V, 128)."""

import sys
import time

import torch
import torch.nn.functional as F


def timed(fn, reps=10):
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(reps):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - t) / reps


def main(n=8, R=256, P=1050, H=28, Hkv=4, D=128):
    dev, dt = "cuda", torch.bfloat16
    g = torch.Generator(device=dev).manual_seed(0)
    q = torch.randn(n, H, R, D, device=dev, dtype=dt, generator=g, requires_grad=True)
    k = torch.randn(n, Hkv, R, D, device=dev, dtype=dt, generator=g, requires_grad=True)
    v = torch.randn(n, Hkv, R, D, device=dev, dtype=dt, generator=g, requires_grad=True)
    pk = torch.randn(1, Hkv, P, D, device=dev, dtype=dt, generator=g, requires_grad=True)
    pv = torch.randn(1, Hkv, P, D, device=dev, dtype=dt, generator=g, requires_grad=True)

    def new():
        keys = torch.cat([pk.expand(n, -1, -1, -1), k], 2)
        vals = torch.cat([pv.expand(n, -1, -1, -1), v], 2)
        return torch.ops.aten._scaled_dot_product_flash_attention(q, keys, vals, 0.0, True)[0]

    rows = n * R
    owner = torch.arange(rows, device=dev) // R
    step = torch.arange(rows, device=dev) % R
    own = (owner[:, None] == owner[None, :]) & (step[None, :] <= step[:, None])
    mask = torch.cat([torch.ones(rows, P, dtype=torch.bool, device=dev), own], 1)

    def old():
        gq = q.transpose(0, 1).reshape(1, H, rows, D)
        gk = k.transpose(0, 1).reshape(1, Hkv, rows, D)
        gv = v.transpose(0, 1).reshape(1, Hkv, rows, D)
        keys = torch.cat([pk, gk], 2).repeat_interleave(H // Hkv, 1)
        vals = torch.cat([pv, gv], 2).repeat_interleave(H // Hkv, 1)
        o = F.scaled_dot_product_attention(gq, keys, vals, attn_mask=mask[None, None])
        return o.reshape(H, n, R, D).transpose(0, 1)

    # fp32 math reference
    with torch.no_grad():
        keys = torch.cat([pk.expand(n, -1, -1, -1), k], 2).float().repeat_interleave(H // Hkv, 1)
        vals = torch.cat([pv.expand(n, -1, -1, -1), v], 2).float().repeat_interleave(H // Hkv, 1)
        allowed = torch.ones(R, P + R, dtype=torch.bool, device=dev).tril(diagonal=P)
        ref = F.scaled_dot_product_attention(q.float(), keys, vals, attn_mask=allowed)
    rel = lambda o: ((o.float() - ref).norm() / ref.norm()).item()
    out_new, out_old = new(), old()
    w = torch.randn_like(out_new)
    grads = lambda o: torch.autograd.grad((o * w).sum(), [q, k, v, pk])
    gn, go = grads(out_new), grads(out_old)
    grad_rel = max(((a.float() - b.float()).norm() / b.float().norm()).item() for a, b in zip(gn, go))
    fb = lambda f: (lambda: torch.autograd.grad((f() * w).sum(), [q, k, v, pk, pv]))
    print({"shape": dict(n=n, R=R, P=P), "new_rel_err_vs_fp32": rel(out_new), "old_rel_err_vs_fp32": rel(out_old),
           "grad_rel_new_vs_old": grad_rel,
           "new_fwd_bwd_ms": timed(fb(new)) * 1e3, "old_fwd_bwd_ms": timed(fb(old)) * 1e3}, flush=True)


if __name__ == "__main__":
    for R in (256, 1024):
        main(R=R)
    sys.exit(0)
