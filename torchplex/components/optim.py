"""Optimizer, learning-rate schedule and gradient clipping.

Learning-rate schedule convention (what `build_lr_scheduler` returns):
training steps are numbered k = 1, 2, ..., total_steps and the trainer calls
`optimizer.step(); lr_scheduler.step()` once per step. Step k then trains with `lr * m(k)`:

    warmup   k <= W:       m(k) = k / W                    (never 0; step W is the first at full lr)
    decay    W < k <= T:   p = (k - W) / (T - W)           (p reaches 1 exactly at the last step T)
        constant:          m = 1
        linear:            m = 1 - (1 - r) * p
        cosine:            m = r + (1 - r) * (1 + cos(pi * p)) / 2
    after    k > T:        m = r (constant: 1)

with W = warmup_steps, T = total_steps, r = min_lr_ratio. torch's LambdaLR evaluates its lambda at
`last_epoch` = k - 1 (0 at construction, which is the lr of step 1), hence `m(last_epoch + 1)` below.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
from torch.distributed.tensor import DTensor
from torch.optim.lr_scheduler import LambdaLR

OPTIMIZER_NAMES = ("adamw", "adamw8bit", "adamw_cpu_offload")
DECAY_NAMES = ("constant", "linear", "cosine")


def _trainable_params(params_or_model: torch.nn.Module | Iterable) -> list:
    """Parameters with requires_grad (frozen ones, e.g. a frozen vision tower, get no state)."""
    if isinstance(params_or_model, torch.nn.Module):
        params = [p for p in params_or_model.parameters() if p.requires_grad]
    else:
        params = list(params_or_model)  # tensors or param-group dicts, passed through as given
    if not params:
        raise ValueError("build_optimizer: no trainable parameters")
    return params


def _param_devices(params: list) -> set[str]:
    tensors: list[torch.Tensor] = []
    for item in params:
        tensors.extend(item["params"] if isinstance(item, dict) else [item])
    return {t.device.type for t in tensors}


def build_optimizer(
    params_or_model: torch.nn.Module | Iterable,
    name: str = "adamw",
    lr: float = 1e-6,
    betas: tuple[float, float] = (0.9, 0.999),
    eps: float = 1e-8,
    weight_decay: float = 0.0,
) -> torch.optim.Optimizer:
    """Build one of OPTIMIZER_NAMES over the trainable parameters.

    adamw:              torch.optim.AdamW; fused kernels when every parameter is on CUDA,
                        otherwise the foreach implementation (CPU tests, mixed devices).
    adamw8bit:          torchao.optim.AdamW8bit, 8-bit blockwise moments for tensors with >= 4096
                        elements. Works on CPU and CUDA, but its step is torch.compile'd: the first
                        step compiles (tens of seconds on CPU) and needs a C++ compiler.
    adamw_cpu_offload:  torchao.optim.CPUOffloadOptimizer around AdamW: moments and the update live
                        on the host, parameters on the GPU. CUDA only, and meant for one GPU
                        (not FSDP); its state_dict is torchao's own, not DCP-reshardable.
                        It copies gradients to the host during backward, so clipping must go
                        through `clip_grad_norm(..., optimizer=...)` to reach those copies.
    """
    params = _trainable_params(params_or_model)
    is_dtensor = [isinstance(p, DTensor) for p in params if not isinstance(p, dict)]
    if any(is_dtensor) and not all(is_dtensor):
        # TP without FSDP2: TP'd decoder weights are DTensors, the replicated rest plain tensors, and a foreach
        # or fused kernel refuses a list mixing both. One param group each keeps the fast kernels.
        params = [{"params": [p for p in params if isinstance(p, DTensor)]},
                  {"params": [p for p in params if not isinstance(p, DTensor)]}]
    hyper = dict(lr=lr, betas=tuple(betas), eps=eps, weight_decay=weight_decay)
    if name == "adamw":
        on_cuda = _param_devices(params) == {"cuda"}
        return torch.optim.AdamW(params, fused=on_cuda, foreach=None if on_cuda else True, **hyper)
    if name == "adamw8bit":
        devices = _param_devices(params) - {"cpu", "cuda"}
        if devices:
            raise ValueError(f"optimizer 'adamw8bit' supports cpu and cuda parameters, not {sorted(devices)}")
        from torchao.optim import AdamW8bit

        return AdamW8bit(params, **hyper)
    if name == "adamw_cpu_offload":
        if not torch.cuda.is_available() or _param_devices(params) != {"cuda"}:
            raise ValueError(
                "optimizer 'adamw_cpu_offload' offloads CUDA parameters to the host: it needs CUDA and "
                f"all parameters on it (found devices {sorted(_param_devices(params))}); use 'adamw' here"
            )
        from torchao.optim import CPUOffloadOptimizer

        return CPUOffloadOptimizer(params, optimizer_class=torch.optim.AdamW, **hyper)
    raise ValueError(f"unknown optimizer {name!r}; choose one of {', '.join(OPTIMIZER_NAMES)}")


def lr_multiplier(step: int, warmup_steps: int, decay: str, total_steps: int, min_lr_ratio: float) -> float:
    """m(k) of the module docstring, for 1-indexed training step k = `step`."""
    if step <= warmup_steps:
        return step / warmup_steps
    if decay == "constant":
        return 1.0
    decay_steps = total_steps - warmup_steps
    if decay_steps <= 0:  # the whole run is warmup; hold the peak afterwards
        return 1.0
    progress = min(1.0, (step - warmup_steps) / decay_steps)
    if decay == "linear":
        return 1.0 - (1.0 - min_lr_ratio) * progress
    if decay == "cosine":
        return min_lr_ratio + (1.0 - min_lr_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress))
    raise ValueError(f"unknown lr decay {decay!r}; choose one of {', '.join(DECAY_NAMES)}")


def build_lr_scheduler(
    optimizer: torch.optim.Optimizer,
    warmup_steps: int = 0,
    decay: str = "constant",
    total_steps: int = 1,
    min_lr_ratio: float = 0.0,
) -> LambdaLR:
    """LambdaLR implementing the schedule in the module docstring.

    The lambda is a plain closure, so the scheduler's state_dict holds only counters: resuming with a
    changed schedule config uses the new config at the restored step.
    """
    if warmup_steps < 0:
        raise ValueError(f"lr warmup_steps must be >= 0, got {warmup_steps}")
    if total_steps < 1:
        raise ValueError(f"lr total_steps must be >= 1, got {total_steps}")
    if not 0.0 <= min_lr_ratio <= 1.0:
        raise ValueError(f"lr min_lr_ratio must be in [0, 1], got {min_lr_ratio}")
    if decay not in DECAY_NAMES:
        raise ValueError(f"unknown lr decay {decay!r}; choose one of {', '.join(DECAY_NAMES)}")

    def multiplier(last_epoch: int) -> float:
        return lr_multiplier(last_epoch + 1, warmup_steps, decay, total_steps, min_lr_ratio)

    return LambdaLR(optimizer, multiplier)


def clip_grad_norm(
    params: Iterable[torch.Tensor],
    max_norm: float | None,
    optimizer: torch.optim.Optimizer | None = None,
) -> float:
    """Total L2 norm of the gradients (before clipping) as a Python float; clip to `max_norm`.

    Works for plain tensors and DTensors (FSDP2 shards): the norm of sharded grads comes back as a
    partial DTensor and `full_tensor()` all-reduces it, so every rank returns the global norm.
    A non-finite norm is returned as is and the gradients are left untouched, so the trainer can see
    it and skip the step. `max_norm` None or <= 0 only measures.

    Pass `optimizer` when it may be torchao's CPUOffloadOptimizer: it has already copied the
    gradients of offloaded parameters to host tensors (`param_d2h_map[p].grad`, on a side stream,
    during backward) and steps on those, so they are scaled too, after that copy has finished.
    """
    params = [p for p in params if p.grad is not None]
    if not params:
        return 0.0
    # Under TP (+FSDP) grads live on different meshes (sharded decoder, replicated vision/embeddings) or are
    # plain tensors; norms cannot be stacked across meshes, so reduce each mesh's group to a full scalar first.
    groups: dict[object, list[torch.Tensor]] = {}
    for p in params:
        groups.setdefault(p.grad.device_mesh if isinstance(p.grad, DTensor) else None, []).append(p)
    squares = []
    for group in groups.values():
        n = torch.nn.utils.get_total_norm([p.grad for p in group], norm_type=2.0)
        squares.append((n.full_tensor() if isinstance(n, DTensor) else n).float() ** 2)
    total_norm = torch.stack([s.to(squares[0].device) for s in squares]).sum().sqrt()
    norm = float(total_norm)
    if max_norm is not None and max_norm > 0 and math.isfinite(norm):
        host_params = _offloaded_host_params(optimizer)  # waits for the device-to-host grad copies
        for group in groups.values():
            torch.nn.utils.clip_grads_with_norm_(group, max_norm, total_norm.to(group[0].grad.device))
        if host_params:
            torch.nn.utils.clip_grads_with_norm_(host_params, max_norm, total_norm.cpu())
    return norm


def _offloaded_host_params(optimizer: torch.optim.Optimizer | None) -> list[torch.Tensor]:
    """Host parameters whose `.grad` an offloading optimizer steps on, once the copies are done."""
    host_params = list(getattr(optimizer, "param_d2h_map", {}).values())
    stream = getattr(optimizer, "stream", None)
    if host_params and stream is not None:
        stream.synchronize()
    return [p for p in host_params if p.grad is not None]
