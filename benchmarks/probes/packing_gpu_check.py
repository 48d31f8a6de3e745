"""Packed (varlen flash) scoring against the padded path on the GPU, in bf16, before a long benchmark relies on it.

    python benchmarks/probes/packing_gpu_check.py        # exit 0: packed == padded within bf16 tolerance

tests/test_packing.py holds the two paths equal in fp32 on the CPU, where packed attention is SDPA under a mask;
on CUDA in bf16 it is torch.nn.attention.varlen's flash kernel instead, which no CPU test reaches. This runs the debug
geometry on the GPU with long-tailed responses (two prompts of one image, G = 4) through both scorers, packed and
padded, forward + backward, and compares log-probs and every parameter gradient. Tolerance: bf16 rounding of two
different kernels, 5e-2 relative to the largest value (a wrong mask or alignment gives errors of order 1).
"""

from __future__ import annotations

import copy
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.step_bench import bench_flavor, build, make_prompt  # noqa: E402
from torchplex.models.packing import varlen_flash_available  # noqa: E402
from torchplex.runtime.decomposition import DecomposedScorer  # noqa: E402
from torchplex.runtime.scoring import ScoreRequest, SerialScorer  # noqa: E402

LENGTHS = [230, 1, 31, 0, 20, 57, 1, 44]
TOL = 5e-2


def scored(actor, scorer, request):
    model = copy.deepcopy(actor)
    logp, _ = scorer.score(model, request, temperature=1.0, with_entropy=False)
    weights = torch.linspace(0.5, 1.5, logp.shape[1], device=logp.device)
    scorer.backward((logp.float() * request.mask * weights).sum())
    scorer.finish_backward()
    return logp.detach().float(), {n: p.grad.float() for n, p in model.named_parameters() if p.grad is not None}


def main() -> int:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")  # CPU: fp32, SDPA (the script's own check)
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    args = bench_flavor("debug")
    actor = build(args, dtype, device, 0)
    prompts = [make_prompt(args, 200, seed=i) for i in range(2)]
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(10, 1000, (len(LENGTHS), max(LENGTHS)), generator=g)
    lengths = torch.tensor(LENGTHS)
    tokens[torch.arange(tokens.shape[1])[None] >= lengths[:, None]] = 0
    request = ScoreRequest(prompts, [s // 4 for s in range(len(LENGTHS))], tokens.to(device), lengths.to(device))
    mask = request.mask
    q = torch.zeros(1, 8, 1, args.text.head_dim, device=device, dtype=dtype)
    print(f"varlen flash available: {varlen_flash_available(q)}; torch {torch.__version__}")
    worst = 0.0
    for name, make in (("serial", SerialScorer), ("decomposed", DecomposedScorer)):
        lp_pack, g_pack = scored(actor, make(pack=True), request)
        lp_pad, g_pad = scored(actor, make(pack=False), request)
        rel = lambda a, b: ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()
        errs = {"logp": rel(lp_pack[mask], lp_pad[mask])}
        errs.update({n: rel(g_pack[n], g_pad[n]) for n in g_pad})
        top = max(errs.items(), key=lambda kv: kv[1])
        worst = max(worst, top[1])
        print(f"{name}: log-prob rel err {errs['logp']:.2e}; worst gradient {top[0]} {top[1]:.2e}; "
              f"{len(g_pad)} gradients, same keys {g_pack.keys() == g_pad.keys()}")
        if g_pack.keys() != g_pad.keys():
            return 1
    print("OK" if worst <= TOL else f"FAIL: {worst:.2e} > {TOL}")
    return 0 if worst <= TOL else 1


if __name__ == "__main__":
    sys.exit(main())
