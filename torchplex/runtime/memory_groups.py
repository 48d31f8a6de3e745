"""Tensor groups of the phase-aware memory manager (runtime/memory.py): what a group is, and helpers that build one
from a module, an optimizer's state, gradients or a KV pool."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterable, Iterator

import torch
from torch import Tensor
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

KINDS = ("offload", "release", "transient", "host")

# ---- groups -------------------------------------------------------------------------------------------------------
def plain_tensors(tensors: Iterable[Tensor]) -> Iterator[Tensor]:
    """The dense tensors that own memory: DTensor shards and torchao's 8-bit optimizer states are unpacked."""
    for t in tensors:
        if is_traceable_wrapper_subclass(t):
            names, _ = t.__tensor_flatten__()
            yield from plain_tensors(getattr(t, n) for n in names)
        else:
            yield t


def tensor_bytes(tensors: Iterable[Tensor]) -> int:
    """Bytes of the distinct storages behind `tensors` (meta tensors: their own numel x element size)."""
    seen, total = set(), 0
    for t in plain_tensors(tensors):
        ptr = 0 if t.device.type == "meta" else t.untyped_storage().data_ptr()
        if ptr and ptr in seen:
            continue
        seen.add(ptr)
        total += t.untyped_storage().nbytes() if ptr else t.numel() * t.element_size()
    return total


@dataclass
class TensorGroup:
    """Tensors with one lifetime: `needed_in` names the phases that produce or consume them.

    Kinds (what the manager does when no phase at hand needs the group):
        offload    copied to a host buffer and the device storage freed in place; copied back before a phase
                   that needs it (model weights, optimizer state)
        release    `release()` frees it and `reserve()` allocates it again: its data need not survive (KV pool)
        transient  allocated and freed by the phase's own code (gradients, activations): counted, never moved
        host       in host memory throughout (a CPU-offloaded optimizer's state): listed, never on the device

    `tensors` is called each time the group moves, so lazily created tensors (optimizer state appears at the first
    step) are picked up. `nbytes` overrides the planned size (plan-only groups, e.g. on the meta device, need it).
    """

    name: str
    needed_in: frozenset[str]
    kind: str = "offload"
    tensors: Callable[[], Iterable[Tensor]] | None = None
    nbytes: int | None = None
    release: Callable[[], None] | None = None
    reserve: Callable[[], None] | None = None

    def __post_init__(self) -> None:
        self.needed_in = frozenset(self.needed_in)
        if self.kind not in KINDS:
            raise ValueError(f"group {self.name!r}: kind {self.kind!r} is not one of {KINDS}")
        if not self.needed_in:
            raise ValueError(f"group {self.name!r}: needed_in is empty; a group no phase needs should not be held")

    def planned_bytes(self) -> int:
        if self.nbytes is not None:
            return int(self.nbytes)
        return tensor_bytes(self.tensors()) if self.tensors is not None else 0


def module_group(name: str, module: torch.nn.Module, needed_in: Iterable[str], *,
                 exclude: Iterable[Tensor] = ()) -> TensorGroup:
    """A module's parameters; `exclude` drops parameters another group owns (a vision tower shared by actor and
    reference belongs to the actor only)."""
    skip = {id(p) for p in exclude}
    return TensorGroup(name, frozenset(needed_in), "offload",
                       tensors=lambda: [p for p in module.parameters() if id(p) not in skip])


def optimizer_state_group(name: str, optimizer: torch.optim.Optimizer, needed_in: Iterable[str],
                          nbytes: int | None = None) -> TensorGroup:
    """An optimizer's state tensors (empty until the first step: pass `nbytes` to plan before it).

    torchao's CPUOffloadOptimizer keeps its state on the host already: the group is of kind "host".
    """
    host_opts = getattr(optimizer, "optim_dict", None)
    if host_opts is not None:
        states = lambda: [v for opt in host_opts.values() for s in opt.state.values() for v in s.values()
                          if isinstance(v, Tensor)]
        return TensorGroup(name, frozenset(needed_in), "host", tensors=states, nbytes=nbytes)
    states = lambda: [v for s in optimizer.state.values() for v in s.values() if isinstance(v, Tensor)]
    return TensorGroup(name, frozenset(needed_in), "offload", tensors=states, nbytes=nbytes)


def grads_group(name: str, module: torch.nn.Module, needed_in: Iterable[str]) -> TensorGroup:
    """Gradients of the trainable parameters: created by backward, freed by `zero_grad(set_to_none=True)`."""
    size = tensor_bytes(p for p in module.parameters() if p.requires_grad)
    return TensorGroup(name, frozenset(needed_in), "transient", nbytes=size)


def kv_pool_group(pool, needed_in: Iterable[str] = ("rollout",), name: str = "kv_pool",
                  nbytes: int | None = None) -> TensorGroup:
    """A `GroupKVPool` (release()/reserve()), or a rollout engine (rollout/protocol.py: release()/resume()) whose
    pool is planned at `nbytes`: its contents die with each rollout, so it is freed rather than copied."""
    if nbytes is None:
        nbytes = pool.num_groups * pool.bytes_per_group
    reserve = pool.reserve if hasattr(pool, "reserve") else pool.resume
    return TensorGroup(name, frozenset(needed_in), "release", nbytes=nbytes, release=pool.release, reserve=reserve)
