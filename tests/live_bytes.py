"""A CPU count of live tensor bytes, and the actor-training phase's own peak measured with it.

`LiveBytes` is a TorchDispatchMode that adds the bytes of every storage an op creates (forward, backward, recompute,
gradient accumulation: all of it goes through the dispatcher) and subtracts them when the storage dies (a weakref
finaliser), so its peak is a phase's peak of live tensor bytes without torch.cuda. Kernel-private workspaces (cuBLAS,
attention kernels) are not seen; everything autograd holds is.

`measure` runs the real `train_phase` at a small geometry (an actor with activation checkpointing, decomposed scoring:
one prefix with autograd per group, G suffixes; several micro-batches, gradients accumulated in bf16) under it; the
window ends where the optimizer phase would begin (step()). The tests compare its peak, less the gradients the phase
ends with, with the named-term estimate of train_activation_estimate.py.
"""

from __future__ import annotations

import math
import weakref
from types import SimpleNamespace

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from train_activation_estimate import decoder_param_bytes

from torchplex.models.qwen2_5_vl.args import ModelArgs, TextArgs, VisionArgs
from torchplex.models.qwen2_5_vl.model import Qwen2_5_VLModel
from torchplex.models.qwen2_5_vl.parallelize import apply_activation_checkpointing
from torchplex.rl.advantages import compute_advantages
from torchplex.rl.losses import PolicyLossConfig
from torchplex.runtime.decomposition import DecomposedScorer
from torchplex.runtime.experience import Experience, MicroBatchLimits
from torchplex.runtime.training import train_phase

# 7B's proportions scaled down: vocab/hidden 42 (LM head dominates the logits path), intermediate/hidden 5.3.
PROBE = ModelArgs(
    vision=VisionArgs(depth=4, hidden_size=64, intermediate_size=160, num_heads=4, window_size=56,
                      out_hidden_size=256, fullatt_block_indexes=(1, 3)),
    text=TextArgs(vocab_size=10752, hidden_size=256, intermediate_size=1344, num_layers=4, num_heads=4,
                  num_kv_heads=2, mrope_section=(8, 12, 12), max_position_embeddings=8192),
    image_token_id=2000, video_token_id=2001, vision_start_token_id=2002, vision_end_token_id=2003)

# Wide layers, small vocab: the decoder weights' gradients outweigh the LM-head and entropy chunks.
WEIGHT_HEAVY = ModelArgs(
    vision=VisionArgs(depth=2, hidden_size=64, intermediate_size=160, num_heads=4, window_size=56,
                      out_hidden_size=512, fullatt_block_indexes=(1,)),
    text=TextArgs(vocab_size=4096, hidden_size=512, intermediate_size=2688, num_layers=8, num_heads=8,
                  num_kv_heads=2, mrope_section=(8, 12, 12), max_position_embeddings=8192),
    image_token_id=2000, video_token_id=2001, vision_start_token_id=2002, vision_end_token_id=2003)


class LiveBytes(TorchDispatchMode):
    """Live bytes of the storages created while the mode is active (and their peak since `reset_peak`)."""

    def __init__(self):
        super().__init__()
        self.live = 0
        self.peak = 0
        self._sizes: dict[int, int] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        inputs = {t.untyped_storage()._cdata for t in tree_flatten((args, kwargs))[0] if isinstance(t, torch.Tensor)}
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor) and t.device.type != "meta":
                storage = t.untyped_storage()
                key = storage._cdata
                if key in self._sizes or key in inputs:
                    continue  # a view or an in-place result (of a tensor made before the mode, too): no new memory
                self._sizes[key] = storage.nbytes()
                self.live += storage.nbytes()
                self.peak = max(self.peak, self.live)
                weakref.finalize(storage, self._free, key)
        return out

    def _free(self, key: int) -> None:
        self.live -= self._sizes.pop(key)

    def reset_peak(self) -> None:
        self.peak = self.live


class _StopAtStep:
    """The optimizer `train_phase` calls: zero_grad as usual; step() ends the measured window (the optimizer
    phase starts there) and updates nothing, so every epoch sees the same weights."""

    def __init__(self, params, live: LiveBytes):
        self.params, self.live, self.peaks = list(params), live, []

    def zero_grad(self, set_to_none=True):
        for p in self.params:
            p.grad = None

    def step(self):
        self.peaks.append(self.live.peak)


def shared_grad_bytes(t: TextArgs) -> int:
    """bf16 gradients of the parameters the prefix and the suffixes both use: decoder layers, token embeddings."""
    return decoder_param_bytes(t) + 2 * t.vocab_size * t.hidden_size


def _prompt(args: ModelArgs, prompt_tokens: int, seed: int) -> SimpleNamespace:
    """A few text tokens, one square image, a question: at least prompt_tokens tokens."""
    v = args.vision
    side = max(2, math.ceil((prompt_tokens - 26) ** 0.5)) * v.spatial_merge_size  # patches per side
    g = torch.Generator().manual_seed(seed)
    pixels = torch.randn(side * side, v.in_channels * v.temporal_patch_size * v.patch_size ** 2, generator=g)
    text = lambda n: torch.randint(10, 1000, (n,), generator=g).tolist()
    merged = side * side // v.spatial_merge_size ** 2
    ids = (text(12) + [args.vision_start_token_id] + [args.image_token_id] * merged + [args.vision_end_token_id]
           + text(12))
    return SimpleNamespace(input_ids=torch.tensor(ids), pixel_values=pixels,
                           image_grid_thw=torch.tensor([[1, side, side]]), pixel_values_videos=None,
                           video_grid_thw=None, second_per_grid_ts=None)


def _experience(prompts, group: int, response: int, vocab: int) -> Experience:
    """G random responses of `response` tokens per prompt, random rewards."""
    n = len(prompts) * group
    g = torch.Generator().manual_seed(1)
    tokens = torch.randint(10, vocab, (n, response), generator=g)
    rewards = torch.rand(n, generator=g)
    return Experience(prompts=prompts, answers=[""] * len(prompts), group_size=group, tokens=tokens,
                      lengths=torch.full((n,), response), sampling_logprobs=torch.zeros(n, response),
                      finish_reasons=["length"] * n, texts=[""] * n, rewards=rewards, reward_parts={},
                      correct=[False] * n, advantages=compute_advantages(rewards, group),
                      keep_groups=torch.ones(len(prompts), dtype=torch.bool))


def _actor(args: ModelArgs, dtype, seed: int) -> Qwen2_5_VLModel:
    with torch.device("meta"):
        model = Qwen2_5_VLModel(args)
    model = model.to(dtype).to_empty(device="cpu")
    model.init_weights(generator=torch.Generator().manual_seed(seed))
    return model


def measure(args: ModelArgs, *, prompts: int, group: int, prompt_tokens: int, response: int, micro_batch: int,
            dtype=torch.bfloat16, checkpointing: bool = True, seed: int = 0,
            split_prefix_backward: bool = True) -> dict:
    """The train phase's own peak live bytes (above parameters; gradients counted separately) at this geometry."""
    torch.manual_seed(seed)
    actor = _actor(args, dtype, seed)
    if checkpointing:
        apply_activation_checkpointing(actor)
    items = [_prompt(args, prompt_tokens, seed=i) for i in range(prompts)]
    exp = _experience(items, group, response, args.text.vocab_size)
    exp.ref_logprobs = torch.zeros(exp.tokens.shape)
    params = [p for p in actor.parameters() if p.requires_grad]
    grads = sum(p.numel() * p.element_size() for p in params)
    live = LiveBytes()
    optimizer = _StopAtStep(params, live)
    with live:
        base = live.live
        train_phase(actor, DecomposedScorer(split_prefix_backward=split_prefix_backward), exp, optimizer, None,
                    PolicyLossConfig(kl_coef=0.01), temperature=1.0, limits=MicroBatchLimits(0, micro_batch, True),
                    ppo_epochs=1, grad_clip=1.0, max_len=response)
    peak = optimizer.peaks[-1] - base
    return {"peak_bytes": peak, "grads_bytes": grads, "activation_bytes": peak - grads,
            "prompt_tokens": max(len(p.input_ids) for p in items)}
