"""Peak bytes the actor-training phase allocates for itself, measured on CPU by counting live tensor storages.

    OMP_NUM_THREADS=1 python benchmarks/train_memory_probe.py --geometry probe --out /tmp/train_probe.json
    OMP_NUM_THREADS=1 python benchmarks/train_memory_probe.py --geometry weight_heavy --group 4 --prompt-tokens 64 \
        --response 16 --micro-batch 4

`LiveBytes` is a TorchDispatchMode that adds the bytes of every storage an op creates (forward, backward,
recompute, gradient accumulation: all of it goes through the dispatcher) and subtracts them when the storage dies
(a weakref finaliser), so its peak is the train phase's peak of live tensor bytes without torch.cuda. Kernel-private
workspaces (cuBLAS, attention kernels) are not seen; everything autograd holds is.

The run is the train phase of a GRPO step at a small geometry: an actor with activation
checkpointing, decomposed scoring (one prefix with autograd per group, G suffixes), `train_phase` over several
micro-batches, gradients accumulated in bf16; the window ends where the optimizer phase would begin (step()).
Its measured peak, less parameters and the gradients the phase ends with, is compared with
`memory_plan.train_activation_bytes` at the same sizes. It is measured twice: with the runtime's split backward
(suffix part, then prefix part: `DecomposedScorer.split_prefix_backward`) and with one backward through both, where
every weight the prefix shares waits with its suffix gradient for the prefix part; the difference is close to
one bf16 copy of those gradients (`shared_grad_bytes`) once a micro-batch finds .grad already there.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import weakref
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import memory_plan  # noqa: E402
from step_bench import build, make_experience, make_prompt  # noqa: E402

from torchplex.models.qwen2_5_vl.args import ModelArgs, TextArgs, VisionArgs, get_flavor  # noqa: E402
from torchplex.models.qwen2_5_vl.parallelize import apply_activation_checkpointing  # noqa: E402
from torchplex.rl.losses import PolicyLossConfig  # noqa: E402
from torchplex.runtime.decomposition import DecomposedScorer  # noqa: E402
from torchplex.runtime.training import train_phase  # noqa: E402

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
GEOMETRIES = {"probe": PROBE, "weight_heavy": WEIGHT_HEAVY}


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
    return memory_plan.decoder_param_bytes(t) + 2 * t.vocab_size * t.hidden_size


def measure(args: ModelArgs, *, prompts: int, group: int, prompt_tokens: int, response: int, micro_batch: int,
            dtype=torch.bfloat16, checkpointing: bool = True, seed: int = 0,
            split_prefix_backward: bool = True) -> dict:
    """The train phase's own peak live bytes (above parameters; gradients counted separately) at this geometry."""
    torch.manual_seed(seed)
    actor = build(args, dtype, torch.device("cpu"), seed)
    if checkpointing:
        apply_activation_checkpointing(actor)
    items = [make_prompt(args, prompt_tokens, seed=i) for i in range(prompts)]
    exp = make_experience(items, group, response, args.text.vocab_size, torch.device("cpu"))
    exp.ref_logprobs = torch.zeros(exp.tokens.shape)
    params = [p for p in actor.parameters() if p.requires_grad]
    grads = sum(p.numel() * p.element_size() for p in params)
    live = LiveBytes()
    optimizer = _StopAtStep(params, live)
    with live:
        base = live.live
        train_phase(actor, DecomposedScorer(split_prefix_backward=split_prefix_backward), exp, optimizer, None, PolicyLossConfig(kl_coef=0.01),
                    temperature=1.0, micro_batch_size=micro_batch, whole_groups=True, ppo_epochs=1,
                    grad_clip=1.0, max_len=response)
    peak = optimizer.peaks[-1] - base
    return {"peak_bytes": peak, "grads_bytes": grads, "activation_bytes": peak - grads,
            "prompt_tokens": max(len(p.input_ids) for p in items)}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--geometry", default="probe",
                   help="probe (7B proportions, small), weight_heavy (wide layers, small vocab) or a flavor name")
    p.add_argument("--prompts", type=int, default=2)
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--prompt-tokens", type=int, default=256)
    p.add_argument("--response", type=int, default=64)
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--logits-chunk", type=int, default=1024)
    p.add_argument("--out", default="")
    return p.parse_args(argv)


def main(argv=None) -> dict:
    a = parse_args(argv)
    args = GEOMETRIES[a.geometry] if a.geometry in GEOMETRIES else get_flavor(a.geometry)
    if a.geometry == "debug":
        args = dataclasses.replace(args, image_token_id=2000, video_token_id=2001, vision_start_token_id=2002,
                                   vision_end_token_id=2003)
    sizes = dict(prompts=a.prompts, group=a.group, prompt_tokens=a.prompt_tokens, response=a.response,
                 micro_batch=a.micro_batch)
    got = measure(args, **sizes)
    one_backward = measure(args, **sizes, split_prefix_backward=False)
    plan = dict(prompt_tokens=got["prompt_tokens"], group=a.group, response=a.response, micro_batch=a.micro_batch,
                checkpointing=True, vision_trainable=True)
    est = memory_plan.train_activation_bytes(args, **plan)
    est_one = memory_plan.train_activation_bytes(args, **plan, pending_suffix_grads=True)
    shared = shared_grad_bytes(args.text)
    out = {"settings": vars(a), "measured": got, "estimate": est, "ratio": est["total"] / got["activation_bytes"],
           "one_backward": {"measured": one_backward, "estimate": est_one,
                            "ratio": est_one["total"] / one_backward["activation_bytes"]},
           "shared_grad_bytes": shared, "gain_bytes": one_backward["peak_bytes"] - got["peak_bytes"]}
    for k, v in est.items():
        print(f"  {k:<22}{v / 2**20:10.2f} MiB", flush=True)
    print(f"measured {got['activation_bytes'] / 2**20:.2f} MiB (+ grads {got['grads_bytes'] / 2**20:.2f} MiB), "
          f"estimate {est['total'] / 2**20:.2f} MiB, ratio {out['ratio']:.3f}", flush=True)
    print(f"one backward through prefix and suffixes (before the split): measured "
          f"{one_backward['activation_bytes'] / 2**20:.2f} MiB, estimate {est_one['total'] / 2**20:.2f} MiB; "
          f"the split saves {out['gain_bytes'] / 2**20:.2f} MiB of a {shared / 2**20:.2f} MiB shared-gradient copy",
          flush=True)
    if a.out:
        Path(a.out).write_text(json.dumps(out, indent=2))
    return out


if __name__ == "__main__":
    main()
