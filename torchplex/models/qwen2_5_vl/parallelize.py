"""Apply tensor parallelism, activation checkpointing, torch.compile and FSDP2 to Qwen2.5-VL, in that order.

The order is torchtitan's: TP first turns the decoder's linear weights into DTensors on the `tp` mesh; the
checkpoint and compile wrappers then see the TP'd layers; FSDP2 last shards every parameter (TP'd or not)
over the `dp_shard` mesh, giving 2-D (dp_shard, tp) DTensors for the TP'd weights.

What gets split, and why:
  decoder layers  Megatron-style TP: wq/wk/wv and w1/w3 column-parallel (each rank owns whole heads and a
                  slice of the MLP), wo and w2 row-parallel (one all-reduce after attention, one after the
                  MLP). The residual stream stays a plain, replicated tensor between layers, so the attention
                  contexts (causal, prefix, shared-prefix) run unchanged on the rank's local heads, and the
                  K/V a PrefixState records are that rank's heads only.
  embeddings /    replicated over tp. They are tied in the small flavors, and `model.logits` reads the weight
  LM head         directly rather than through a module call, so a vocab-parallel split would need
                  vocab-parallel log-softmax in every caller; FSDP2 still shards them over dp_shard.
  vision tower    replicated over tp. The fused `qkv` weight is laid out (3, heads, head_dim) on its output
                  dim, so a plain column split would hand a rank all of q and half of k; splitting it right
                  needs a strided layout, for a ~0.67B-parameter tower beside a 7B decoder. Every TP peer
                  encodes the same images; FSDP2 shards it over dp_shard. Gradients stay identical across TP
                  peers because the residual-stream gradient is all-reduced at each column-parallel input.
No sequence parallelism: the attention contexts need the whole sequence, and norms are cheap at these widths.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.nn as nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, parallelize_module
from torch.utils.checkpoint import checkpoint

from torchplex.distributed.fsdp import remember_reshard_after_forward
from torchplex.distributed.mesh import ParallelDims
from .. import fusion
from .model import Qwen2_5_VLModel

# Entry points besides forward() that callers use. FSDP2 only hooks `forward`; registering these makes each
# call go through the root's pre/post-forward: gather the root unit (embeddings, final norm, LM head, which
# `logits` reads without a module call), wire its gradients into the reduce-scatter, and, for whichever
# runs first, initialise FSDP with the model as root (encode_vision would otherwise make the tower root).
# `embed` and `decode` are internals of these and are not safe to call directly under FSDP.
ROOT_METHODS = ("encode_vision", "prefix_forward", "suffix_forward", "packed_forward", "packed_suffix_forward",
                "logits")

DECODER_LAYER_TP_PLAN = {
    "attention.wq": ColwiseParallel(),
    "attention.wk": ColwiseParallel(),
    "attention.wv": ColwiseParallel(),
    "attention.wo": RowwiseParallel(),
    "feed_forward.w1": ColwiseParallel(),
    "feed_forward.w3": ColwiseParallel(),
    "feed_forward.w2": RowwiseParallel(),
}


def check_tp_divisibility(model: Qwen2_5_VLModel, tp: int) -> None:
    """Each TP rank must own whole attention heads (q and kv) and an even slice of the MLP."""
    t = model.args.text
    for name, value in (("text.num_heads", t.num_heads), ("text.num_kv_heads", t.num_kv_heads),
                        ("text.intermediate_size", t.intermediate_size)):
        if value % tp:
            raise ValueError(f"tensor parallel degree {tp} does not divide {name} = {value}; "
                             f"choose tp among the divisors of {name}")


def tp_degree(model: Qwen2_5_VLModel) -> int:
    """The degree `apply_tp` split `model`'s decoder layers over (1: not split), read off a column-parallel weight's
    mesh: its "tp" axis (an FSDP2 axis beside it, as in a 2-D (dp_shard, tp) mesh, shards storage, not heads)."""
    mesh = getattr(model.layers[0].attention.wk.weight, "device_mesh", None)
    names = tuple(mesh.mesh_dim_names or ()) if mesh is not None else ()
    return mesh.size(names.index("tp")) if "tp" in names else 1


def heads_per_rank(model: Qwen2_5_VLModel) -> tuple[int, int]:
    """(query heads, K/V heads) one rank's attention projects: whole heads, the model's over its TP degree. What a
    rank's KV cache holds per token and layer, not the model's global count."""
    t, tp = model.args.text, tp_degree(model)
    return t.num_heads // tp, t.num_kv_heads // tp


def apply_tp(model: Qwen2_5_VLModel, tp_mesh) -> None:
    check_tp_divisibility(model, tp_mesh.size())
    for layer in model.layers:
        # use_local_output (the default) hands plain local tensors back to the layer, so
        # `.view(b, t, -1, head_dim)` in Attention sees num_heads / tp heads.
        parallelize_module(layer, tp_mesh, DECODER_LAYER_TP_PLAN)


# ---- activation checkpointing ------------------------------------------------------------------------
# Each block's class is swapped once, at set-up, for a subclass whose forward may run under non-reentrant
# checkpointing, the way FSDP2 swaps classes, instead of wrapping the block in another module: parameter names stay
# exactly `layers.3.attention.wq.weight`, so loaders, optimizers and state dicts see the same model either way.
# Whether a forward checkpoints is read from the block instance, set by the contexts below on the model's blocks
# (never a class swap at run time):
#   _recomputes    activation checkpointing is configured for this block (apply_activation_checkpointing)
#   _recompute     the current choice for a configured block (`recompute`, default True)
#   _keep_inputs   a callable counting the input each block keeps (`keep_block_inputs`: the compact prefix form),
#                  which checkpoints every block of the model, configured or not
# Eager recompute replays the layer's Python side effects: a PrefixAttention context records that layer's
# K/V once more during backward (extra list entries after the first num_layers; those are never read).
_CHECKPOINTED_CLASSES: dict[type, type] = {}


def blocks_of(model: nn.Module) -> list[nn.Module]:
    """The model's decoder layers and vision blocks: the units a checkpoint wraps."""
    return list(model.layers) + list(getattr(model.visual, "blocks", []))


def _checkpoints(block: nn.Module) -> bool:
    state = block.__dict__
    return state.get("_keep_inputs") is not None or (state.get("_recomputes", False) and state.get("_recompute", True))


def _checkpointed_class(cls: type[nn.Module]) -> type[nn.Module]:
    if cls not in _CHECKPOINTED_CLASSES:
        def forward(self, *args, **kwargs):
            if not torch.is_grad_enabled() or not _checkpoints(self):  # nothing to save (rollout, reference), or
                # told to keep the whole graph; checkpoint() is opaque to torch.compile, which decode sees through
                return cls.forward(self, *args, **kwargs)
            keep = self.__dict__.get("_keep_inputs")
            if keep is not None:
                keep(args[0])
            return checkpoint(fusion.under_current_mode(cls.forward), self, *args, use_reentrant=False, **kwargs)

        _CHECKPOINTED_CLASSES[cls] = type(f"Checkpointed{cls.__name__}", (cls,), {"forward": forward})
    return _CHECKPOINTED_CLASSES[cls]


def wrap_blocks(model: nn.Module) -> None:
    """Give every block the checkpoint-capable class (idempotent; no block recomputes until told to)."""
    for block in blocks_of(model):
        if not any(isinstance(block, c) for c in _CHECKPOINTED_CLASSES.values()):
            block.__class__ = _checkpointed_class(type(block))


def checkpoint_block(block: nn.Module) -> None:
    """Recompute this block's activations in backward instead of keeping them. Idempotent."""
    if not any(isinstance(block, c) for c in _CHECKPOINTED_CLASSES.values()):
        block.__class__ = _checkpointed_class(type(block))
    block.__dict__["_recomputes"] = True


def is_checkpointed(model: nn.Module) -> bool:
    """Whether any decoder layer or vision block of `model` recomputes in backward (checkpoint_block)."""
    return any(b.__dict__.get("_recomputes", False) for b in blocks_of(model))


@contextmanager
def _block_attribute(model: nn.Module, name: str, value):
    blocks = blocks_of(model)
    before = [b.__dict__.get(name) for b in blocks]
    for b in blocks:
        b.__dict__[name] = value
    try:
        yield
    finally:
        for b, old in zip(blocks, before):
            if old is None:
                b.__dict__.pop(name, None)
            else:
                b.__dict__[name] = old


def recompute(model: nn.Module, enabled: bool):
    """Within this block, `model`'s checkpointed decoder layers and vision blocks recompute in backward
    (`enabled`, the default outside any block) or keep their whole graph like unwrapped ones (the same numbers, no
    recompute: the memory budget lets a micro-batch that fits skip the ~1/3 extra compute). Decided at forward time:
    the backward of a forward run under recompute(model, False) recomputes nothing, wherever it runs."""
    return _block_attribute(model, "_recompute", bool(enabled))


def keep_block_inputs(model: nn.Module, keep):
    """Within this block, every block of `model` (wrap_blocks) keeps only its input for backward, which recomputes
    it from there, and calls `keep(input)` on it: the compact form of a held prefix (runtime/prefixes.py)."""
    return _block_attribute(model, "_keep_inputs", keep)


def under_current_recompute(model: nn.Module, fn):
    """`fn`, run under `model`'s recompute setting current now: for a function an outer checkpoint() reruns in
    backward (outside the forward's `recompute` block), whose rerun must save what its forward saved."""
    enabled = next((b.__dict__.get("_recompute", True) for b in blocks_of(model)), True)

    def run(*args, **kwargs):
        with recompute(model, enabled):
            return fn(*args, **kwargs)

    return run


def apply_activation_checkpointing(model: Qwen2_5_VLModel) -> None:
    for block in blocks_of(model):
        checkpoint_block(block)


# Compiled graphs a layer function may keep: per grad mode, a padded and a packed batch, a batch of one (sizes of 1
# are specialised), a decode step of one token; every layer shares them.
COMPILED_GRAPHS = 16


def apply_compile(model: Qwen2_5_VLModel, backend="inductor") -> None:
    """Compile each decoder layer's two tensor functions (DecoderLayer.attention_inputs / attention_outputs), with
    dynamic sizes. The attention context between them stays eager: it holds per-layer Python state (a layer index,
    lists of recorded K/V, host length lists) that a compiled layer would guard on (one graph per layer) and side
    effects that activation checkpointing's recompute must not replay. So the graphs are the same for every layer,
    mode and micro-batch size, and checkpointing wraps the eager layer (no checkpoint inside a compiled region).
    The vision blocks stay eager: their window boundaries are host lists that change with every image grid."""
    if hasattr(torch._dynamo.config, "recompile_limit"):
        torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, COMPILED_GRAPHS)
    for layer in model.layers:
        for name in ("attention_inputs", "attention_outputs"):
            setattr(layer, name, torch.compile(getattr(layer, name), backend=backend, dynamic=True))


def compiled_layers(model: Qwen2_5_VLModel) -> bool:
    """Whether apply_compile compiled this model's decoder layers."""
    return "attention_inputs" in vars(model.layers[0])


def apply_fsdp(model: Qwen2_5_VLModel, dp_mesh, param_dtype: torch.dtype, reduce_dtype: torch.dtype,
               reshard_after_forward: bool = True) -> None:
    """One FSDP2 unit per vision block and per decoder layer, one for the rest of the tower, and the root
    (embeddings, final norm, LM head). Frozen parameters are sharded like the others; they get no grads."""
    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=reduce_dtype, cast_forward_inputs=False)
    common = dict(mesh=dp_mesh, mp_policy=mp)
    for unit in [*model.visual.blocks, model.visual, *model.layers]:
        fully_shard(unit, reshard_after_forward=reshard_after_forward, **common)
        remember_reshard_after_forward(unit, reshard_after_forward)
    # reshard_after_forward left unset on the root: FSDP2 then keeps the root unit gathered from its first
    # call until the end of backward, so chunked `logits` calls do not all-gather the LM head per chunk.
    # The price is that a no-grad call (rollout, reference log-probs) leaves it gathered: see `reshard`.
    fully_shard(model, **common)
    for method in ROOT_METHODS:
        register_fsdp_forward_method(model, method)


def parallelize_qwen2_5_vl(
    model: Qwen2_5_VLModel,
    parallel_dims: ParallelDims | None,
    *,
    tp: bool | None = None,
    fsdp: bool | None = None,
    param_dtype: torch.dtype = torch.bfloat16,
    reduce_dtype: torch.dtype = torch.float32,
    activation_checkpointing: bool = False,
    compile: bool = False,
    compile_backend="inductor",
    freeze_vision: bool = False,
    reshard_after_forward: bool = True,
) -> Qwen2_5_VLModel:
    """Parallelise `model` in place (best built on the meta device, materialised afterwards) and return it.

    tp / fsdp default to "the axis has degree > 1"; either may be forced on at degree 1 (FSDP2 at degree 1
    still applies the mixed-precision policy). `parallel_dims` may be None when neither is used.
    FSDP2 averages gradients over dp_shard ranks: each rank's loss should be its local mean (or the caller
    sets `set_gradient_divide_factor` on the FSDP modules and normalises globally).
    """
    if tp is None:
        tp = parallel_dims is not None and parallel_dims.tp_enabled
    if fsdp is None:
        fsdp = parallel_dims is not None and parallel_dims.fsdp_enabled
    if (tp or fsdp) and parallel_dims is None:
        raise ValueError("parallelize_qwen2_5_vl: tp/fsdp requested but parallel_dims is None")

    if freeze_vision:
        model.visual.requires_grad_(False)
    if tp:
        apply_tp(model, parallel_dims.tp_mesh)
    if activation_checkpointing:
        apply_activation_checkpointing(model)
    if compile:
        apply_compile(model, compile_backend)
    if fsdp:
        apply_fsdp(model, parallel_dims.dp_mesh, param_dtype, reduce_dtype, reshard_after_forward)
    return model
