"""Which kernels the model's elementwise chains and odd-width matmuls run on (issue 19's profile).

Eager, each RMSNorm is ~7 kernels over fp32 copies of the activations, each rotary embedding ~5 per tensor and
the gated MLP's act(a) * b two: at 7B about a quarter of the GPU's busy time in every compute phase (measured: docs/performance.md). With fusion on,
each chain runs as one `torch.compile`d function (inductor: one kernel; dynamic shapes, so a new batch does not
recompile) where no gradient is taken: the rollout prefill and reference scoring, which it made faster
(docs/performance.md). With grad enabled (training) the chains stay eager: there a compiled call's
host cost (guard checks, the AOT runtime wrapper, its autograd node: ~2 s of GPU idle per 8 training micro-batches
at 7B, measured) exceeded the kernels it saved, because the training phase is bound by the host's launch rate at
micro-batch 8. A batched forward with grad over many prompts (`batched_forward`: the fused prefill, the batched
actor prefix) runs them compiled again: its calls are large enough (tens of thousands of tokens). The same math
either way, so the fp32 CPU tests that compare against transformers and the serial step hold; on a GPU the
rounding may differ in the last bits (a reduction summed in another order).

Odd widths: the vision tower's MLP is 3420 wide, which no 16-byte-aligned GEMM kernel takes, so cuBLAS falls back
to Ampere-era align-2 kernels (~40 % of the rollout prefill's GEMM time at P = 8). With fusion on, a gated MLP whose
width is not a multiple of 8 runs padded with zero rows/columns to a multiple of 64 (`aligned_width`): the padded
units are act(0) * 0 = 0 and feed a zero column of the down projection, so outputs and gradients are the same
and the padding's gradients are zero. The parameters keep their checkpoint shapes; the padded copies are made
per forward (~27 MB per vision block, a fraction of a millisecond).

Off by default: `enable(True)` from the trainer and the benchmarks on CUDA (`model.fused_elementwise`). A
process-wide switch rather than a module attribute: every mode (the serial baseline included) runs the same
kernels for the same grad mode, and torch.compile guards on a module-global bool (one graph per value). Within a
step the kernels do differ by grad mode: the reference and the rollout prefill (no grad) and the batched prefix
forwards run the compiled chains, the actor's training micro-batches the eager ones, and in bf16 the two round
differently (one rounding for a fused chain, one per op eager; on CPU ~30 % of the rotary's and RMSNorm's
outputs differ in the last bit). So with fusion on, the KL to a reference at the actor's own weights is small but
not exactly zero.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from contextlib import contextmanager

import torch
import torch.nn.functional as F

_ON = False
_PAD = False
_BACKEND = "inductor"
ALIGN = 8      # elements: 16 bytes of bf16, what Hopper's TMA-based GEMM kernels need of a leading dimension
PAD_TO = 64    # a padded width is rounded up to this
RECOMPILES = 32


def enable(on: bool, backend: str = "inductor", pad: bool | None = None) -> None:
    """Fusion on or off for the whole process (backend: torch.compile's; tests use "aot_eager", no codegen); `pad`
    (default: as `on`) the odd-width padding alone, so the benchmarks can measure one change at a time."""
    global _ON, _PAD, _BACKEND
    if backend != _BACKEND:
        _compiled.clear()
    _ON, _PAD, _BACKEND = bool(on), bool(on if pad is None else pad), backend
    if _ON and hasattr(torch._dynamo.config, "recompile_limit"):
        # a chain meets a few ranks (text 3-D, vision 2-D, packed and padded), views and plain tensors, sizes of 1
        # (specialised): up to ~a dozen graphs each; past dynamo's default of 8 the rest would run eagerly
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, RECOMPILES)


def enabled() -> bool:
    return _ON


def padding() -> bool:
    return _PAD


def wanted(choice: str, device) -> bool:
    """`model.fused_elementwise` ("auto": on where the kernels pay, a CUDA device; "on"; "off") for `device`."""
    if choice not in ("auto", "on", "off"):
        raise ValueError(f"model.fused_elementwise must be 'auto', 'on' or 'off', not {choice!r}")
    return choice == "on" or (choice == "auto" and torch.device(device).type == "cuda")


def aligned_width(width: int) -> int:
    """The width a gated MLP runs at: unchanged when aligned, or padding off; else the next multiple of PAD_TO."""
    if not _PAD or width % ALIGN == 0:
        return width
    return -(-width // PAD_TO) * PAD_TO


# ---- the eager chains (the reference definitions) ------------------------------------------------------------
def rms_norm_eager(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([-x2, x1], dim=-1)


def rotary_eager(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                 ) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary embedding in the dtype of cos/sin and q/k (the language model's)."""
    return q * cos + rotate_half(q) * sin, k * cos + rotate_half(k) * sin


def rotary_fp32_eager(q: torch.Tensor, k: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotary embedding computed in fp32 and returned in q's dtype (the vision tower's, as the reference does)."""
    cos, sin = cos.float(), sin.float()
    rot = lambda t: (t.float() * cos + rotate_half(t.float()) * sin).to(t.dtype)
    return rot(q), rot(k)


def gated_eager(a: torch.Tensor, b: torch.Tensor, act: Callable) -> torch.Tensor:
    return act(a) * b


_compiled: dict[str, Callable] = {}
_local = threading.local()  # per thread: the decode window's thread never inherits the main thread's context


def _batched_depth() -> int:
    return getattr(_local, "batched", 0)


@contextmanager
def batched_forward():
    """Inside: the compiled chains with grad too. For one forward over many prompts at once (the overlapped
    rollout's fused prefill, the decomposed mode's batched actor prefix): tens of thousands of tokens per call, so
    each compiled call's host cost hides behind its kernels, and its backward is one batched pass as well; a
    training micro-batch is not (see the module docstring)."""
    depth = _batched_depth()
    _local.batched = depth + 1
    try:
        yield
    finally:
        _local.batched = depth


def under_current_mode(fn: Callable) -> Callable:
    """`fn`, run as inside `batched_forward` when it is active now: for a function a checkpoint reruns in backward
    (outside the forward's context), whose rerun must save what its forward saved (compiled and eager chains save
    different tensors)."""
    if not _batched_depth():
        return fn

    def run(*args, **kwargs):
        with batched_forward():
            return fn(*args, **kwargs)

    return run


def _pick(name: str, eager: Callable) -> Callable:
    # inside a compiled region (model.compile's layers, the decode step) the region's compiler fuses the chain;
    # elsewhere compiled only without grad, or inside batched_forward: see the module docstring
    if torch.compiler.is_compiling() or not _ON or (torch.is_grad_enabled() and not _batched_depth()):
        return eager
    fn = _compiled.get(name)
    if fn is None:
        fn = _compiled[name] = torch.compile(eager, dynamic=True, backend=_BACKEND)
    return fn


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    if not _ON:
        return rms_norm_eager(x, weight, eps)
    # without grad a parameter goes in detached: frozen and trainable weights then share a graph
    if not torch.is_grad_enabled():
        weight = weight.detach()
    return _pick("rms_norm", rms_norm_eager)(x, weight, eps)


def rotary(q, k, cos, sin):
    return _pick("rotary", rotary_eager)(q, k, cos, sin)


def rotary_fp32(q, k, cos, sin):
    return _pick("rotary_fp32", rotary_fp32_eager)(q, k, cos, sin)


def gated(a: torch.Tensor, b: torch.Tensor, act: Callable) -> torch.Tensor:
    return _pick("gated", gated_eager)(a, b, act)


def padded_rows(weight: torch.Tensor, bias: torch.Tensor | None, rows: int):
    """weight (out, in) and bias (out,) with zero rows appended up to `rows` outputs."""
    extra = rows - weight.shape[0]
    return F.pad(weight, (0, 0, 0, extra)), None if bias is None else F.pad(bias, (0, extra))


def padded_columns(weight: torch.Tensor, columns: int) -> torch.Tensor:
    """weight (out, in) with zero columns appended up to `columns` inputs."""
    return F.pad(weight, (0, columns - weight.shape[1]))
