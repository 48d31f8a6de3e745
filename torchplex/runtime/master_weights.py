"""Mixed precision for training: bf16 compute parameters in the module, an fp32 master copy that AdamW steps.

    module parameters   bf16, what forward/backward and the rollout read (the decode graph keeps their addresses)
    gradients           bf16, made by backward on the module parameters (half the bytes of fp32 gradients)
    master weights      fp32 copies; AdamW (fp32 moments) steps these, then they are rounded into the module
    AdamW state         exp_avg, exp_avg_sq (fp32) and step, per master tensor

The step runs over parameter chunks, in order: chunk i's bf16 gradients are widened to fp32, AdamW steps chunk i's
master tensors (torch's AdamW skips tensors whose .grad is None, so one optimizer serves every chunk and an lr
scheduler built on `.optimizer` sees one set of param groups), the module's bf16 parameters are overwritten with
the rounded result and the bf16 gradients are freed. Elementwise, this is the same update as one AdamW step over
all master tensors (tests/test_memory_streamed.py holds it bitwise).

With a `MemoryManager` whose plan streams the state (`state_group(streamed=True)` in the "optimizer" phase),
`step()` enters that phase and walks the chunks with `manager.stream()`: chunk i+1's state comes in while chunk i
updates and chunk i's state goes out after, so the phase holds about `stream_window` chunks of state, not all of it.
The first chunks the plan keeps resident (`MemoryPlan.build(max_resident_chunks=...)`) never move: they step first,
without waiting, while the first chunks that do move come in.

Wiring into the trainer (torchplex/train.py is not changed here): build `MasterWeights(actor.parameters(), ...)`
in place of `build_optimizer(...)`, pass it as the optimizer to `StepRunner` (it has `step()` and
`zero_grad(set_to_none=True)`, which is all `train_phase` calls), build the lr scheduler on `.optimizer`, and
register `master_group`, `state_group` and `grads_group` with the memory plan. Checkpoints would save
`state_dict()` (master weights + AdamW state). Plain tensors only: FSDP2's DTensors are not handled yet.
"""

from __future__ import annotations

from typing import Iterable, Sequence

import torch
from torch import Tensor

from .memory_groups import TensorGroup


def split_chunks(numels: list[int], chunk_numel: int, keys: Sequence | None = None) -> list[list[int]]:
    """Consecutive index ranges whose numel stays within `chunk_numel` (a larger tensor gets a chunk of its own);
    with `keys`, a chunk also ends where the key changes (a dtype: one flat buffer per chunk)."""
    chunks: list[list[int]] = [[]]
    total = 0
    for i, n in enumerate(numels):
        if chunks[-1] and (total + n > chunk_numel or (keys is not None and keys[i] != keys[chunks[-1][0]])):
            chunks.append([])
            total = 0
        chunks[-1].append(i)
        total += n
    return chunks if chunks[0] else []


class MasterWeights:
    """An fp32 master copy of a module's trainable (bf16) parameters with a chunked AdamW step.

    `chunk_bytes` sizes the chunks by their AdamW state (8 bytes per parameter). `memory` and `phase`: the manager
    whose plan streams this state in that phase (set after building the plan, which needs the groups first).
    """

    def __init__(self, params: Iterable[torch.nn.Parameter], *, chunk_bytes: int = 2**30, lr: float = 1e-6,
                 betas: tuple[float, float] = (0.9, 0.999), eps: float = 1e-8, weight_decay: float = 0.0,
                 fused: bool | None = None, memory=None, phase: str = "optimizer"):
        self.params = [p for p in params if p.requires_grad]
        if not self.params:
            raise ValueError("MasterWeights: no trainable parameters")
        with torch.no_grad():
            self.master = [p.detach().to(torch.float32, copy=True) for p in self.params]
        on_cuda = all(p.device.type == "cuda" for p in self.params)
        fused = on_cuda if fused is None else fused
        self.optimizer = torch.optim.AdamW(self.master, lr=lr, betas=tuple(betas), eps=eps,
                                           weight_decay=weight_decay, fused=fused, foreach=None if fused else True)
        self.chunks = split_chunks([m.numel() for m in self.master], max(1, chunk_bytes // 8))
        self.memory, self.phase = memory, phase

    # ---- what train_phase calls ----
    def zero_grad(self, set_to_none: bool = True) -> None:
        for p in self.params:
            if set_to_none:
                p.grad = None
            elif p.grad is not None:
                p.grad.zero_()

    @property
    def param_groups(self) -> list[dict]:
        return self.optimizer.param_groups

    def step(self) -> None:
        """One AdamW step of every chunk; under a streaming memory plan the state moves chunk by chunk."""
        chunks: Iterable[int] = range(len(self.chunks))
        if self.memory is not None:
            self.memory.enter(self.phase)
            if self.memory.plan.phase(self.phase).streamed:
                chunks = self.memory.stream(len(self.chunks))
        for i in chunks:
            self.step_chunk(i)

    @torch.no_grad()
    def step_chunk(self, i: int) -> None:
        idx = self.chunks[i]
        params, master = [self.params[j] for j in idx], [self.master[j] for j in idx]
        for p, m in zip(params, master):
            m.grad = None if p.grad is None else p.grad.to(torch.float32)
            p.grad = None  # the bf16 gradient is not needed again: free it now, chunk by chunk
        self.optimizer.step()  # steps exactly the tensors with a .grad: this chunk's
        stepped = [(p, m) for p, m in zip(params, master) if m.grad is not None]
        for _, m in stepped:
            m.grad = None
        if stepped:
            torch._foreach_copy_([p for p, _ in stepped], [m for _, m in stepped])  # round to bf16

    # ---- memory groups ----
    def state_bytes(self, chunk: list[int]) -> int:
        """AdamW's state of these master tensors: two fp32 moments, plus the step counter where AdamW keeps it on
        the device (fused)."""
        step_bytes = 4 if self.optimizer.defaults.get("fused") else 0
        return sum(8 * self.master[j].numel() + step_bytes for j in chunk)

    def _state_of(self, chunk: list[int]) -> list[Tensor]:
        out = []
        for j in chunk:
            state = self.optimizer.state.get(self.master[j], {})
            out += [v for v in state.values() if isinstance(v, Tensor)]
        return out

    def state_group(self, name: str = "optimizer_state", needed_in: Iterable[str] = ("optimizer",), *,
                    streamed: bool = True) -> TensorGroup:
        """The AdamW state: streamed chunk by chunk in its (single) phase, or moved whole."""
        if streamed:
            return TensorGroup(name, frozenset(needed_in), "offload",
                               chunks=lambda: [self._state_of(c) for c in self.chunks],
                               chunk_nbytes=[self.state_bytes(c) for c in self.chunks])
        everything = [j for c in self.chunks for j in c]
        return TensorGroup(name, frozenset(needed_in), "offload", tensors=lambda: self._state_of(everything),
                           nbytes=self.state_bytes(everything))

    def master_group(self, name: str = "master_weights", needed_in: Iterable[str] = ("optimizer",), *,
                     streamed: bool = False) -> TensorGroup:
        """The fp32 master weights. Needed in every phase keeps them on the device; streamed moves them with the
        state (twice the traffic; for when the device cannot hold them)."""
        if streamed:
            return TensorGroup(name, frozenset(needed_in), "offload",
                               chunks=lambda: [[self.master[j] for j in c] for c in self.chunks],
                               chunk_nbytes=[sum(4 * self.master[j].numel() for j in c) for c in self.chunks])
        return TensorGroup(name, frozenset(needed_in), "offload", tensors=lambda: list(self.master))

    def grads_group(self, name: str = "grads", needed_in: Iterable[str] = ("train", "optimizer")) -> TensorGroup:
        """The bf16 gradients backward makes (transient: created in train, freed chunk by chunk by the step)."""
        return TensorGroup(name, frozenset(needed_in), "transient",
                           nbytes=sum(p.numel() * p.element_size() for p in self.params))

    def workspace_bytes(self) -> int:
        """The fp32 gradients of the largest chunk, alive while it steps."""
        return max(sum(4 * self.master[j].numel() for j in c) for c in self.chunks)

    # ---- checkpoints ----
    def state_dict(self) -> dict:
        return {"master": [m.detach().clone() for m in self.master], "optimizer": self.optimizer.state_dict()}

    @torch.no_grad()
    def load_state_dict(self, state: dict) -> None:
        for m, p, saved in zip(self.master, self.params, state["master"]):
            m.copy_(saved)
            p.copy_(m)
        self.optimizer.load_state_dict(state["optimizer"])
