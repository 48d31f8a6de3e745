"""Memory plan of one colocated GRPO step with a reference model: naive colocation vs the phase-aware manager.

    python benchmarks/memory_plan.py --flavor 7B                       # one H200, fp32 master + AdamW
    python benchmarks/memory_plan.py --flavor 32B --dp-shard 8 --json outputs/memory_plan_32b.json
    python benchmarks/memory_plan.py --flavor 7B --activation-checkpointing --hbm-gib 116

Computed, not measured: the geometry comes from `get_flavor` on the meta device (nothing is allocated), and the
byte counts of each tensor group follow from the precision recipe and the rollout/training settings. Runs on CPU in
about a second. The groups and the phases that need them:

    actor_weights      bf16 compute weights         rollout, train, optimizer (the step writes them)
    kv_pool            rollout KV pool              rollout            (freed between rollouts, not copied)
    ref_weights        bf16 reference weights       ref
    grads              gradients                    train, optimizer   (made by backward, freed by zero_grad)
    master_weights     fp32 master weights          optimizer          (--master none: trained in bf16 directly)
    optimizer_state    AdamW moments                optimizer          (8-bit with adamw8bit; host with cpu offload)
    *_activations, *_workspace                      estimates of what each phase allocates for itself
                                                    (train: `train_activation_bytes`, measured on CPU)

"naive" keeps every weight and optimizer tensor on the device all the time (what the trainer does today, which
already frees the KV pool and the gradients between uses); "managed" is `MemoryPlan.build` under --hbm-gib.
Activation estimates are per token per decoder layer in bf16 with fp32 RMSNorm inputs (see `layer_saved_bytes`),
plus, in training, the LM head's fp32 chunks and the suffix gradients held for shared weights
(`train_activation_bytes`, checked against a CPU count of live tensors in benchmarks/train_memory_probe.py); they
are estimates, the H200 run measures the real peaks per phase with torch.cuda.max_memory_allocated.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from torchplex.models.qwen2_5_vl.args import ModelArgs, get_flavor  # noqa: E402
from torchplex.models.qwen2_5_vl.model import Qwen2_5_VLModel  # noqa: E402
from torchplex.rollout.kv_pool import GroupKVPool  # noqa: E402
from torchplex.runtime.memory import GiB, MemoryPlan, TensorGroup, tensor_bytes  # noqa: E402

PHASES = ["rollout", "ref", "train", "optimizer"]
OPTIMIZERS = ("adamw", "adamw8bit", "adamw_cpu_offload")
LOGITS_CHUNK = 1024  # tokens per LM-head chunk in torchplex.rl.logprobs.logprobs_from_hidden


def layer_saved_bytes(hidden: int, kv_dim: int, inter: int) -> int:
    """Bytes autograd keeps per token for one decoder layer (bf16, no recomputation):
    two RMSNorms (fp32 input 4h + bf16 output 2h each), q 2h, k 2kv, v 2kv, attention output 2h,
    SwiGLU gate, silu(gate), up and their product (2I each)."""
    return 2 * 6 * hidden + 4 * hidden + 4 * kv_dim + 4 * 2 * inter


def layer_workspace_bytes(hidden: int, kv_dim: int, inter: int) -> int:
    """Bytes alive per token inside one layer without autograd (prefill, reference scoring)."""
    return 10 * hidden + 4 * kv_dim + 6 * inter


def decoder_param_bytes(t, dtype_bytes: int = 2) -> int:
    """Bytes of the decoder layers' parameters (attention with q/k/v biases, SwiGLU, two norms)."""
    kv_dim = t.num_kv_heads * t.head_dim
    h, i = t.hidden_size, t.intermediate_size
    per_layer = h * h + h + 2 * (kv_dim * h + kv_dim) + h * h + 3 * h * i + 2 * h
    return t.num_layers * per_layer * dtype_bytes


def train_activation_bytes(args: ModelArgs, *, prompt_tokens: int, group: int, response: int, micro_batch: int,
                           checkpointing: bool, vision_trainable: bool, image_tokens: int | None = None,
                           logits_chunk: int = LOGITS_CHUNK, pending_suffix_grads: bool = False) -> dict[str, int]:
    """What the actor-training phase allocates beyond weights and the accumulated gradients, per micro-batch of
    whole groups under decomposed scoring (one prefix with autograd, G suffixes on it), bf16 weights.

    held        autograd's saved tensors for the whole micro-batch: each layer's input (checkpointing) or its
                saved activations, the prefix's recorded K/V, the vision tower's block inputs (when it trains),
                the pixel batch (fp32 and bf16) and the suffixes' attention mask
    then the largest of three moments:
    entropy     the forward's entropy of one LM-head chunk (`entropy_from_hidden`): four fp32 [chunk x V] tensors
                (the bf16 logits are freed once upcast)
    lm_head     the LM head's backward (`logprobs_from_hidden`): an fp32 [V x D] weight-gradient accumulator, a
                bf16 [V x D] partial product and one chunk's fp32 logits / softmax / gradient
    backward    the start of the prefix backward: one layer's recompute, the gradients of the prefix K/V that the
                suffix backward left on the detached prefix leaves, and one weight's gradient before it is added
                to .grad (the runtime backpropagates the suffixes first, accumulating every weight's suffix part
                into .grad at once, then the prefix: `DecomposedScorer.backward`)
    pending_suffix_grads: the runtime before that split (one backward through prefix and suffixes, measured on
                the H200 on 2026-11-29): every parameter both parts use (decoder layers, token embeddings) waits
                with its suffix gradient in its AccumulateGrad input buffer until the prefix part arrives, so the
                backward moment also holds a whole bf16 copy of those gradients and one weight's sum out of place.
    Measured on CPU by benchmarks/train_memory_probe.py (tests/test_memory_train_estimate.py).
    """
    t, v = args.text, args.vision
    kv_dim = t.num_kv_heads * t.head_dim
    h, vocab = t.hidden_size, t.vocab_size
    saved = layer_saved_bytes(h, kv_dim, t.intermediate_size)
    mb_prompts = max(1, micro_batch // group)
    prefix, suffix = mb_prompts * prompt_tokens, mb_prompts * group * response
    per_layer = 2 * h if checkpointing else saved
    image = prompt_tokens if image_tokens is None else image_tokens
    patches = mb_prompts * image * v.spatial_merge_size ** 2
    vision_saved = layer_saved_bytes(v.hidden_size, v.hidden_size, v.intermediate_size)
    vision = 0
    if vision_trainable:
        vision = patches * v.depth * (2 * v.hidden_size if checkpointing else vision_saved)
    pixels = patches * v.in_channels * v.temporal_patch_size * v.patch_size ** 2 * (4 + 2)  # fp32 batch + bf16
    mask = suffix * (prefix + suffix) * 3  # the suffixes' block mask (bool) and its additive form in attention
    held = (prefix + suffix) * t.num_layers * per_layer + prefix * t.num_layers * 4 * kv_dim + vision + pixels + mask
    chunk = min(logits_chunk, suffix)
    entropy = chunk * vocab * 4 * 4
    lm_head = 4 * vocab * h + max(2 * vocab * h + 6 * chunk * vocab, 14 * chunk * vocab)
    recompute = (max(prefix, suffix) * saved if checkpointing else 0) + (
        patches * vision_saved if vision_trainable and checkpointing else 0)
    kv_grads = prefix * t.num_layers * 4 * kv_dim  # bf16 K and V gradients of every prefix layer
    weight_grad = 2 * h * t.intermediate_size  # the largest decoder weight's gradient, bf16
    backward = recompute + kv_grads + weight_grad
    if pending_suffix_grads:  # + every shared weight's pending suffix part, and one sum made out of place
        backward += decoder_param_bytes(t) + 2 * vocab * h + weight_grad
    return {"held": held, "entropy": entropy, "lm_head": lm_head, "backward": backward,
            "total": held + max(entropy, lm_head, backward)}


def param_counts(args: ModelArgs) -> tuple[list[int], list[int], int]:
    """(numel of each language-model parameter, of each vision-tower parameter, bf16 bytes of one decoder layer)."""
    with torch.device("meta"):
        model = Qwen2_5_VLModel(args).to(torch.bfloat16)
    layer_bytes = max(tensor_bytes(layer.parameters()) for layer in model.layers)
    named = list(model.named_parameters())
    return ([p.numel() for n, p in named if not n.startswith("visual.")],
            [p.numel() for n, p in named if n.startswith("visual.")], layer_bytes)


def adamw8bit_state_bytes(numels: list[int], small_bytes: int, block: int = 256) -> int:
    """torchao AdamW8bit: two states per parameter; tensors with >= 4096 values divisible by the block are uint8
    codes + one fp32 scale per block + a 256-entry fp32 code map, the others plain tensors of `small_bytes`."""
    total = 0
    for n in numels:
        total += 2 * (n + 4 * (n // block) + 4 * 256) if n >= 4096 and n % block == 0 else 2 * n * small_bytes
    return total


def step_groups(args: ModelArgs, counts, s: argparse.Namespace, optimizer: str) -> list[TensorGroup]:
    text, vision, layer_bytes = counts
    t = args.text
    shard = s.dp_shard
    total = sum(text) + sum(vision)
    trainable_numels = text if s.freeze_vision else text + vision
    trainable = sum(trainable_numels)
    master = 4 if s.master == "fp32" else 0
    state_elem = 4 if s.master == "fp32" else 2  # torch AdamW keeps moments in the dtype of what it steps
    grad_elem = 4 if s.grad_dtype == "fp32" else 2
    kv_dim = t.num_kv_heads * t.head_dim
    prompts = -(-s.prompts // shard)  # this rank's share of the step's prompts

    if optimizer == "adamw8bit":
        state = adamw8bit_state_bytes(trainable_numels, state_elem)
    else:
        state = 2 * trainable * state_elem
    state_kind = "host" if optimizer == "adamw_cpu_offload" else "offload"

    groups_at_once = max(1, min(prompts, s.max_batch // s.group))
    kv = groups_at_once * GroupKVPool.group_bytes(t.num_layers, t.num_kv_heads, t.head_dim, s.group,
                                                  s.prompt_tokens, s.response_tokens, torch.bfloat16)
    if s.kv_pool_gib:
        kv = min(kv, int(s.kv_pool_gib * GiB))

    mb_prompts = max(1, s.micro_batch // s.group)  # whole groups per micro-batch: one prefix, G suffixes
    prefix_tokens, suffix_tokens = mb_prompts * s.prompt_tokens, mb_prompts * s.group * s.response_tokens
    logits = 2 * LOGITS_CHUNK * t.vocab_size * 4  # fp32 logits of one chunk and their softmax/gradient
    work = layer_workspace_bytes(t.hidden_size, kv_dim, t.intermediate_size)
    gather = 2 * layer_bytes if shard > 1 else 0  # FSDP2: this layer's and the next one's unsharded weights

    def g(name, needed, nbytes, kind="offload"):
        return TensorGroup(name, frozenset(needed), kind, nbytes=int(nbytes))

    groups = [
        g("actor_weights", {"rollout", "train", "optimizer"}, 2 * total / shard),
        g("kv_pool", {"rollout"}, kv, "release"),
        g("prefill_workspace", {"rollout"}, min(s.prefill_tokens, prompts * s.prompt_tokens) * work + gather,
          "transient"),
        g("ref_weights", {"ref"}, 2 * (total - (sum(vision) if s.freeze_vision else 0)) / shard),
        g("ref_workspace", {"ref"}, prefix_tokens * t.num_layers * 2 * kv_dim * 2
          + max(prefix_tokens, suffix_tokens) * work + logits + gather, "transient"),
        g("train_activations", {"train"}, train_activation_bytes(
            args, prompt_tokens=s.prompt_tokens, group=s.group, response=s.response_tokens, micro_batch=s.micro_batch,
            checkpointing=s.activation_checkpointing, vision_trainable=not s.freeze_vision,
            image_tokens=s.image_tokens)["total"] + gather, "transient"),
        g("grads", {"train", "optimizer"}, trainable * grad_elem / shard, "transient"),
    ]
    if master:
        groups.append(g("master_weights", {"optimizer"}, trainable * master / shard, state_kind))
    groups.append(g("optimizer_state", {"optimizer"}, state / shard, state_kind))
    if optimizer == "adamw_cpu_offload":  # torchao copies gradients into pinned host tensors during backward
        groups.append(g("host_grads", {"optimizer"}, trainable * grad_elem / shard, "host"))
    return groups


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--flavor", default="7B", help="a key of torchplex.models.qwen2_5_vl.args.FLAVORS")
    p.add_argument("--optimizer", default="adamw", choices=OPTIMIZERS, help="the one whose full plan is printed")
    p.add_argument("--master", default="fp32", choices=("fp32", "none"), help="fp32 master weights or pure bf16")
    p.add_argument("--grad-dtype", default="bf16", choices=("bf16", "fp32"))
    p.add_argument("--hbm-gib", type=float, default=139.0, help="device budget per GPU (H200: about 139 GiB usable)")
    p.add_argument("--dp-shard", type=int, default=1, help="FSDP2 ranks sharing weights, grads and optimizer state")
    p.add_argument("--prompts", type=int, default=16, help="prompts per step (all ranks)")
    p.add_argument("--group", type=int, default=8, help="G samples per prompt")
    p.add_argument("--prompt-tokens", type=int, default=1024)
    p.add_argument("--image-tokens", type=int, default=1000, help="merged image tokens within the prompt")
    p.add_argument("--response-tokens", type=int, default=1024)
    p.add_argument("--max-batch", type=int, default=256, help="sequences decoded at once (rollout.max_batch)")
    p.add_argument("--kv-pool-gib", type=float, default=0.0, help="cap on the KV pool (0: what the batch needs)")
    p.add_argument("--prefill-tokens", type=int, default=16384, help="tokens per prefill chunk")
    p.add_argument("--micro-batch", type=int, default=8, help="sequences per training micro-batch")
    p.add_argument("--activation-checkpointing", action="store_true")
    p.add_argument("--freeze-vision", action="store_true", help="frozen tower shared by actor and reference")
    p.add_argument("--pcie-gbs", type=float, default=50.0, help="host<->device copy bandwidth, GB/s")
    p.add_argument("--json", default="", help="also write every optimizer's plan here")
    return p.parse_args(argv)


def kv_room_bytes(groups: list[TensorGroup], budget: int, peak) -> int | None:
    """The largest KV pool for which `peak(plan)` stays within the budget (None: nothing fits even without KV)."""
    def fits(kv: int) -> bool:
        sized = [dataclasses.replace(g, nbytes=kv) if g.name == "kv_pool" else g for g in groups]
        return peak(MemoryPlan.build(sized, PHASES, budget)) <= budget

    if not fits(0):
        return None
    lo, hi = 0, budget
    while hi - lo > 2**24:  # 16 MiB
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if fits(mid) else (lo, mid)
    return lo


def main(argv=None) -> dict:
    s = parse_args(argv)
    args = get_flavor(s.flavor)
    budget = int(s.hbm_gib * GiB)
    counts = param_counts(args)
    print(f"Qwen2.5-VL {s.flavor}: {(sum(counts[0]) + sum(counts[1])) / 1e9:.2f}B parameters; GRPO with reference, "
          f"G={s.group}, {s.prompts} prompts x ({s.prompt_tokens} prompt + {s.response_tokens} response tokens); "
          f"master {s.master}, grads {s.grad_dtype}, dp_shard {s.dp_shard}, "
          f"activation checkpointing {'on' if s.activation_checkpointing else 'off'}; budget {s.hbm_gib:g} GiB/GPU")
    groups = {name: step_groups(args, counts, s, name) for name in OPTIMIZERS}
    plans = {name: MemoryPlan.build(g, PHASES, budget) for name, g in groups.items()}
    print(f"\n== plan for {s.optimizer} (per GPU, GiB) ==\n{plans[s.optimizer]}\n")
    gib = lambda b: "-" if b is None else f"{b / GiB:.1f}"
    print(f"{'optimizer':<19}{'naive':>7}{'floor':>7}{'managed':>8}{'exposed':>8}{'copy s':>7}{'host':>7}{'KV room':>8}"
          f"{'(naive)':>8}   managed peak per phase (GiB)")
    summary = {}
    for name, plan in plans.items():
        exposed = sum(r.exposed_bytes for r in plan.phases)
        room = kv_room_bytes(groups[name], budget, lambda p: p.peak_bytes)
        naive_room = kv_room_bytes(groups[name], budget, lambda p: p.naive_peak_bytes)
        per_phase = "  ".join(f"{r.phase} {r.peak_bytes / GiB:.1f}" for r in plan.phases)
        over = lambda b: "*" if b > budget else " "
        print(f"{name:<19}{gib(plan.naive_peak_bytes):>6}{over(plan.naive_peak_bytes)}"
              f"{gib(plan.floor_bytes):>6}{over(plan.floor_bytes)}{gib(plan.peak_bytes):>7}"
              f"{over(plan.peak_bytes)}{gib(exposed):>8}{exposed / (s.pcie_gbs * 1e9):>7.1f}{gib(plan.host_bytes):>7}"
              f"{gib(room):>8}{gib(naive_room):>8}   {per_phase}")
        summary[name] = dict(naive_peak_bytes=plan.naive_peak_bytes, floor_bytes=plan.floor_bytes,
                             managed_peak_bytes=plan.peak_bytes,
                             exposed_bytes=exposed, host_bytes=plan.host_bytes, kv_room_bytes=room,
                             naive_kv_room_bytes=naive_room)
    print(f"* over the {s.hbm_gib:g} GiB budget. floor: the largest phase's own needs (the least any plan can "
          f"peak at); managed: the plan under the budget, which holds more when that hides copies; exposed: bytes "
          f"copied without overlap per step (late loads, drained copies), 'copy s' at {s.pcie_gbs:g} GB/s; host: "
          f"pinned host memory; KV room: the largest KV pool that still fits, managed and (naive).")
    out = {"settings": vars(s), "summary": summary, "plans": {n: p.to_dict() for n, p in plans.items()}}
    if s.json:
        path = Path(s.json)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(out, indent=2))
        print(f"wrote {path}")
    return out


if __name__ == "__main__":
    main()
