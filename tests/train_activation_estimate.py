"""A named-term estimate of what the actor-training phase allocates beyond weights and gradients, the reference the
memory tests hold the real train phase to (measured with live_bytes.measure on the CPU). Its terms follow what the
runtime keeps alive: a mismatch means the runtime started holding something the terms do not name.
"""

from __future__ import annotations

from torchplex.models.qwen2_5_vl.args import ModelArgs

LOGITS_CHUNK = 1024  # tokens per LM-head chunk in torchplex.rl.logprobs.logprobs_from_hidden


def layer_saved_bytes(hidden: int, kv_dim: int, inter: int) -> int:
    """Bytes autograd keeps per token for one decoder layer (bf16, no recomputation):
    two RMSNorms (fp32 input 4h + bf16 output 2h each), q 2h, k 2kv, v 2kv, attention output 2h,
    SwiGLU gate, silu(gate), up and their product (2I each)."""
    return 2 * 6 * hidden + 4 * hidden + 4 * kv_dim + 4 * 2 * inter


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
    pending_suffix_grads: one backward through prefix and suffixes (`split_prefix_backward=False`): every parameter
                both parts use (decoder layers, token embeddings) waits with its suffix gradient in its
                AccumulateGrad input buffer until the prefix part arrives, so the backward moment also holds a whole
                bf16 copy of those gradients and one weight's sum out of place.
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
