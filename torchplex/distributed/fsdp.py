"""Generic FSDP2 helpers that any model, the rollout engine and the step share (no model knowledge).

`gathered` keeps a model's units gathered across a phase whose number of forwards differs between ranks;
`reshard` frees what no-grad forwards left gathered. A model's parallelize function (e.g.
models/qwen2_5_vl/parallelize.py) shards and calls `remember_reshard_after_forward` for each unit it wraps.
"""

from __future__ import annotations

import weakref
from contextlib import contextmanager

import torch.nn as nn
from torch.distributed.fsdp import FSDPModule

# How each non-root unit was sharded (reshard_after_forward), so `gathered` can set it back: FSDP2 has no public
# getter. A model's parallelize function records it with `remember_reshard_after_forward`.
_RESHARD_AFTER_FORWARD: "weakref.WeakKeyDictionary[nn.Module, bool]" = weakref.WeakKeyDictionary()


def remember_reshard_after_forward(unit: nn.Module, reshard_after_forward: bool) -> None:
    """Record how `fully_shard` was called on `unit`, for `gathered` to restore on exit."""
    _RESHARD_AFTER_FORWARD[unit] = reshard_after_forward


@contextmanager
def gathered(model: nn.Module | None):
    """Every FSDP2 unit of `model` gathered once on entry and kept gathered through every forward inside the block;
    resharded on exit and set back to how it was sharded (`remember_reshard_after_forward`). A no-op without FSDP2.

    For phases whose number of forwards differs between data-parallel ranks: rollout (each rank decodes until its
    own samples stop, and prefills as many batches as its prompts need) and reference scoring (frozen weights, as
    many micro-batches as a rank has samples left). With per-forward all-gathers a rank that runs fewer forwards
    leaves the others waiting in a collective; gathered, those forwards run no collectives at all. The cost is the
    model's full (TP-local) weights on every rank for the phase. Gradients recorded inside (the rollout prefill kept
    for training) still reduce at their backward as usual.
    """
    units = [m for m in model.modules() if isinstance(m, FSDPModule)] if model is not None else []
    if not units:
        yield
        return
    for unit in units:  # every rank in the same order: unshard is a collective
        unit.set_reshard_after_forward(False, recurse=False)
        unit.unshard()
    try:
        yield
    finally:
        for unit in units:  # the root (not in the map) keeps FSDP2's own root behaviour: gathered after forward
            unit.set_reshard_after_forward(_RESHARD_AFTER_FORWARD.get(unit, False), recurse=False)
        reshard(model)


def reshard(model: nn.Module) -> None:
    """Free every FSDP2 unit's gathered parameters; a no-op for units already sharded or without FSDP.

    Call it after a no-grad phase. The root unit (embeddings, final norm, LM head) is only resharded at the
    end of a backward, so after forward-only calls it stays gathered: that memory stays in use, an optimizer
    built then would see the gathered copies instead of the sharded parameters, and an optimizer step taken
    then would not reach the gathered copy the next forward reuses.
    """
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def gather_root(model: nn.Module) -> None:
    """Gather an FSDP2 root unit (embeddings, final norm, LM head) before a backward that starts from tensors of an
    earlier forward (the held prompt prefixes), after another backward resharded it. Torch 2.11 does not gather it
    again in such a backward and reads the freed storage (a segmentation fault); later versions gather it there, and
    find it gathered. A no-op without FSDP2; a collective, like the backward that follows."""
    if isinstance(model, FSDPModule):
        model.unshard()
