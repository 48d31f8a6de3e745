"""The actor's current weights as SGLang loads them: HF checkpoint names, full tensors, byte-bounded buckets.

Names come from the state dict adapter in the checkpoint ("legacy") layout, the names SGLang's Qwen2.5-VL
`load_weights` reads from a Hub folder; a tied LM head is not sent (the adapter drops it, as transformers does
on save). A DTensor (FSDP2 or TP shard) is gathered with `full_tensor()`, a collective every rank of its mesh
joins; buckets bound how many gathered bytes exist at once, as verl's and SGLang's own update_weights do.
"""

from __future__ import annotations

from typing import Iterable, Iterator

import torch

from ...models.qwen2_5_vl.state_dict_adapter import Qwen2_5_VLStateDictAdapter


def hf_parameters(model, *, trainable_only: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, parameter) of the native model, in its parameter order (the same on every rank)."""
    adapter = Qwen2_5_VLStateDictAdapter(model.args)
    for name, param in model.named_parameters():
        if trainable_only and not param.requires_grad:
            continue
        if name == "output.weight" and adapter.tied:
            continue
        yield adapter.native_to_hf_key(name), param


def full(tensor: torch.Tensor) -> torch.Tensor:
    """The whole tensor: a DTensor's shards gathered (collective), a plain tensor as is; detached either way."""
    from torch.distributed.tensor import DTensor

    if isinstance(tensor, DTensor):
        return tensor.full_tensor().detach()
    return tensor.detach()


def nbytes_of(tensor: torch.Tensor) -> int:
    return tensor.numel() * tensor.element_size()  # a DTensor's global shape: its full size


def buckets(named: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Consecutive groups of full tensors whose bytes stay within `bucket_bytes` (a larger tensor goes alone).

    Sizes are read from the (possibly sharded) parameter before gathering, so every rank cuts the same buckets
    and reaches the same `full_tensor` collectives in the same order."""
    if bucket_bytes <= 0:
        raise ValueError(f"bucket_bytes must be > 0, got {bucket_bytes}")
    bucket, size = [], 0
    for name, tensor in named:
        n = nbytes_of(tensor)
        if bucket and size + n > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, full(tensor)))
        size += n
    if bucket:
        yield bucket
