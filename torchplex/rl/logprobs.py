"""Per-token log-probabilities and entropies of sampled tokens, computed a chunk of tokens at a time.

Qwen2.5's vocabulary has 152k entries, so one fp32 row of logits is ~600 kB and the fp32 logits of a
16k-token micro-batch are ~10 GB: more than the bf16 logits and more than a step can spare. Here the
token axis is flattened and walked `chunk_size` rows at a time, and only one chunk is ever upcast:

- `token_logprobs` is a custom autograd Function. A plain chunked loop would not help training,
  because autograd would keep every chunk's fp32 copy alive for the backward pass. The Function saves
  only the input logits (which exist anyway) and one float per token (the log-sum-exp), and rebuilds
  the softmax of each chunk in the backward pass.
- `logprobs_from_hidden` goes one step further and never materialises the logits at all: it applies
  the LM head per chunk, in the forward and again in the backward pass, so activation memory is
  proportional to `chunk_size`, not to the number of tokens.

Math is done in fp32 (fp64 inputs stay fp64); the returned log-probabilities are fp32. Targets must
be valid token ids everywhere, padding included (use e.g. the pad id and mask the loss).
"""

from __future__ import annotations

import torch
from torch import Tensor


def _compute_dtype(dtype: torch.dtype) -> torch.dtype:
    """fp32 for bf16/fp16/fp32 inputs, fp64 for fp64 inputs."""
    return torch.promote_types(dtype, torch.float32)


def _check_args(temperature: float, chunk_size: int) -> None:
    if not temperature > 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")


def _scaled(logits_chunk: Tensor, temperature: float) -> Tensor:
    """Upcast one chunk of logits and divide by the sampling temperature."""
    x = logits_chunk.to(_compute_dtype(logits_chunk.dtype))
    return x / temperature if temperature != 1.0 else x


def _grad_of_scaled_logits(
    x: Tensor, lse: Tensor, targets: Tensor, grad_out: Tensor, temperature: float
) -> Tensor:
    """d(sum_t g_t * logp_t)/d(logits) for one chunk: g * (onehot(target) - softmax(x)) / temperature."""
    g = grad_out.to(x.dtype).unsqueeze(-1)
    grad = torch.exp(x - lse.unsqueeze(-1)).mul_(g).neg_()
    grad.scatter_add_(-1, targets.unsqueeze(-1), g)
    return grad.div_(temperature) if temperature != 1.0 else grad


class _ChunkedTokenLogProbs(torch.autograd.Function):
    """logits (M, V), targets (M,) -> log_softmax(logits / temperature)[m, targets[m]] (M,)."""

    @staticmethod
    def forward(ctx, logits: Tensor, targets: Tensor, temperature: float, chunk_size: int) -> Tensor:
        num_tokens = logits.shape[0]
        dtype = _compute_dtype(logits.dtype)
        logprobs = torch.empty(num_tokens, dtype=dtype, device=logits.device)
        lse = torch.empty(num_tokens, dtype=dtype, device=logits.device)
        for start in range(0, num_tokens, chunk_size):
            end = min(start + chunk_size, num_tokens)
            x = _scaled(logits[start:end], temperature)
            lse[start:end] = torch.logsumexp(x, dim=-1)
            picked = x.gather(-1, targets[start:end].unsqueeze(-1)).squeeze(-1)
            logprobs[start:end] = picked - lse[start:end]
        ctx.save_for_backward(logits, targets, lse)
        ctx.temperature = temperature
        ctx.chunk_size = chunk_size
        return logprobs

    @staticmethod
    def backward(ctx, grad_logprobs: Tensor):
        logits, targets, lse = ctx.saved_tensors
        grad_logits = torch.empty_like(logits)
        for start in range(0, logits.shape[0], ctx.chunk_size):
            end = min(start + ctx.chunk_size, logits.shape[0])
            x = _scaled(logits[start:end], ctx.temperature)
            grad_logits[start:end] = _grad_of_scaled_logits(
                x, lse[start:end], targets[start:end], grad_logprobs[start:end], ctx.temperature
            )
        return grad_logits, None, None, None


def token_logprobs(
    logits: Tensor, targets: Tensor, temperature: float = 1.0, chunk_size: int = 1024
) -> Tensor:
    """log_softmax(logits / temperature) gathered at `targets`.

    logits (..., T, V), targets (..., T) -> fp32 (..., T).
    Differentiable w.r.t. `logits`; at most `chunk_size` rows of fp32 logits exist at any time,
    forward or backward. Pass contiguous logits: a strided view (e.g. `logits[:, :-1]`) is copied
    once, in its own dtype, when flattened.
    """
    _check_args(temperature, chunk_size)
    if logits.shape[:-1] != targets.shape:
        raise ValueError(
            f"logits {tuple(logits.shape)} and targets {tuple(targets.shape)} disagree: "
            "expected logits (..., T, V) and targets (..., T)"
        )
    vocab = logits.shape[-1]
    flat = _ChunkedTokenLogProbs.apply(
        logits.reshape(-1, vocab), targets.reshape(-1).long(), float(temperature), int(chunk_size)
    )
    return flat.view(targets.shape)


@torch.no_grad()
def token_entropy(logits: Tensor, temperature: float = 1.0, chunk_size: int = 1024) -> Tensor:
    """Entropy of softmax(logits / temperature) per position: logits (..., T, V) -> (..., T), no grad.

    Uses H = -sum_v p_v * log p_v with log p = x - logsumexp(x), one chunk of fp32 rows at a time
    (the algebraically equal logsumexp(x) - sum_v p_v * x_v subtracts two large numbers and loses
    ~1e-5 in fp32).
    """
    _check_args(temperature, chunk_size)
    vocab = logits.shape[-1]
    flat = logits.reshape(-1, vocab)
    entropy = torch.empty(flat.shape[0], dtype=_compute_dtype(logits.dtype), device=logits.device)
    for start in range(0, flat.shape[0], chunk_size):
        end = min(start + chunk_size, flat.shape[0])
        x = _scaled(flat[start:end], temperature)
        logp = x - torch.logsumexp(x, dim=-1, keepdim=True)
        entropy[start:end] = -(torch.exp(logp) * logp).sum(dim=-1)
    return entropy.view(logits.shape[:-1])


class _ChunkedHiddenLogProbs(torch.autograd.Function):
    """hidden (M, D), weight (V, D), targets (M,) -> log_softmax(hidden @ weight.T / temperature) at targets.

    The logits are computed in the inputs' dtype, exactly like `hidden @ weight.T` would, then
    upcast; the backward pass recomputes each chunk's logits instead of storing them.
    """

    @staticmethod
    def forward(
        ctx, hidden: Tensor, weight: Tensor, targets: Tensor, temperature: float, chunk_size: int
    ) -> Tensor:
        num_tokens = hidden.shape[0]
        dtype = _compute_dtype(hidden.dtype)
        logprobs = torch.empty(num_tokens, dtype=dtype, device=hidden.device)
        lse = torch.empty(num_tokens, dtype=dtype, device=hidden.device)
        for start in range(0, num_tokens, chunk_size):
            end = min(start + chunk_size, num_tokens)
            x = _scaled(hidden[start:end] @ weight.T, temperature)
            lse[start:end] = torch.logsumexp(x, dim=-1)
            picked = x.gather(-1, targets[start:end].unsqueeze(-1)).squeeze(-1)
            logprobs[start:end] = picked - lse[start:end]
        ctx.save_for_backward(hidden, weight, targets, lse)
        ctx.temperature = temperature
        ctx.chunk_size = chunk_size
        return logprobs

    @staticmethod
    def backward(ctx, grad_logprobs: Tensor):
        hidden, weight, targets, lse = ctx.saved_tensors
        need_hidden, need_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_hidden = torch.empty_like(hidden) if need_hidden else None
        # The weight gradient is a sum over all chunks. Summing low-precision partial products in
        # low precision would round once per chunk; an fp32 accumulator (weight-sized, not
        # activation-sized) rounds once at the end, as the unchunked matmul does.
        exact_accumulate = weight.dtype == _compute_dtype(weight.dtype)
        grad_weight = None
        if need_weight:
            acc_dtype = weight.dtype if exact_accumulate else _compute_dtype(weight.dtype)
            grad_weight = torch.zeros(weight.shape, dtype=acc_dtype, device=weight.device)
        for start in range(0, hidden.shape[0], ctx.chunk_size):
            end = min(start + ctx.chunk_size, hidden.shape[0])
            h = hidden[start:end]
            x = _scaled(h @ weight.T, ctx.temperature)
            grad_logits = _grad_of_scaled_logits(
                x, lse[start:end], targets[start:end], grad_logprobs[start:end], ctx.temperature
            ).to(hidden.dtype)  # the unchunked graph holds this gradient in the logits' dtype too
            if need_hidden:
                grad_hidden[start:end] = grad_logits @ weight
            if need_weight:
                if exact_accumulate:
                    grad_weight.addmm_(grad_logits.T, h)
                else:
                    grad_weight += grad_logits.T @ h
        if need_weight and not exact_accumulate:
            grad_weight = grad_weight.to(weight.dtype)
        return grad_hidden, grad_weight, None, None, None


def logprobs_from_hidden(
    hidden: Tensor,
    weight: Tensor,
    targets: Tensor,
    temperature: float = 1.0,
    chunk_size: int = 1024,
) -> Tensor:
    """Log-probabilities of `targets` under the LM head `weight` applied to `hidden`, chunk by chunk.

    hidden (..., T, D), weight (V, D) (the `output.weight` / tied embedding, no bias),
    targets (..., T) -> fp32 (..., T). Equals `token_logprobs(hidden @ weight.T, targets, temperature)`
    and is differentiable w.r.t. both `hidden` and `weight`, but neither the full logits nor their
    gradient ever exist: activation memory is O(chunk_size * V). `weight` must be the full
    (unsharded) matrix.
    """
    _check_args(temperature, chunk_size)
    if hidden.shape[:-1] != targets.shape:
        raise ValueError(
            f"hidden {tuple(hidden.shape)} and targets {tuple(targets.shape)} disagree: "
            "expected hidden (..., T, D) and targets (..., T)"
        )
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(
            f"weight must be (V, D) with D = hidden.shape[-1] = {hidden.shape[-1]}, "
            f"got {tuple(weight.shape)}"
        )
    if weight.dtype != hidden.dtype:
        raise ValueError(f"hidden is {hidden.dtype} but weight is {weight.dtype}; cast one first")
    flat = _ChunkedHiddenLogProbs.apply(
        hidden.reshape(-1, hidden.shape[-1]),
        weight,
        targets.reshape(-1).long(),
        float(temperature),
        int(chunk_size),
    )
    return flat.view(targets.shape)


class _ChunkedHiddenEntropy(torch.autograd.Function):
    """hidden (M, D), weight (V, D) -> entropy of softmax(hidden @ weight.T / temperature) (M,), differentiable.

    With p = softmax(x) and H = -sum_v p_v log p_v, dH/dx_v = -p_v (log p_v + H); the backward pass rebuilds each
    chunk's log-probabilities from the saved log-sum-exp, as `_ChunkedHiddenLogProbs` does."""

    @staticmethod
    def forward(ctx, hidden: Tensor, weight: Tensor, temperature: float, chunk_size: int) -> Tensor:
        dtype = _compute_dtype(hidden.dtype)
        entropy = torch.empty(hidden.shape[0], dtype=dtype, device=hidden.device)
        lse = torch.empty_like(entropy)
        for start in range(0, hidden.shape[0], chunk_size):
            end = min(start + chunk_size, hidden.shape[0])
            x = _scaled(hidden[start:end] @ weight.T, temperature)
            lse[start:end] = torch.logsumexp(x, dim=-1)
            logp = x - lse[start:end, None]
            entropy[start:end] = -(torch.exp(logp) * logp).sum(dim=-1)
        ctx.save_for_backward(hidden, weight, lse, entropy)
        ctx.temperature, ctx.chunk_size = temperature, chunk_size
        return entropy

    @staticmethod
    def backward(ctx, grad_entropy: Tensor):
        hidden, weight, lse, entropy = ctx.saved_tensors
        need_hidden, need_weight = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_hidden = torch.empty_like(hidden) if need_hidden else None
        grad_weight = torch.zeros(weight.shape, dtype=_compute_dtype(weight.dtype), device=weight.device) \
            if need_weight else None
        for start in range(0, hidden.shape[0], ctx.chunk_size):
            end = min(start + ctx.chunk_size, hidden.shape[0])
            h = hidden[start:end]
            logp = _scaled(h @ weight.T, ctx.temperature) - lse[start:end, None]
            g = grad_entropy[start:end].to(logp.dtype)[:, None]
            grad_logits = (torch.exp(logp) * (logp + entropy[start:end, None])).mul_(-g)
            if ctx.temperature != 1.0:
                grad_logits.div_(ctx.temperature)
            grad_logits = grad_logits.to(hidden.dtype)
            if need_hidden:
                grad_hidden[start:end] = grad_logits @ weight
            if need_weight:
                grad_weight += grad_logits.T.to(grad_weight.dtype) @ h.to(grad_weight.dtype)
        if need_weight:
            grad_weight = grad_weight.to(weight.dtype)
        return grad_hidden, grad_weight, None, None


def entropy_from_hidden(hidden: Tensor, weight: Tensor, temperature: float = 1.0, chunk_size: int = 1024) -> Tensor:
    """Entropy of softmax(hidden @ weight.T / temperature) per position, hidden (..., T, D) -> (..., T), chunk by
    chunk like `logprobs_from_hidden`, and differentiable w.r.t. hidden and weight (the entropy bonus of the loss,
    algorithm.entropy_coef, needs its gradient). Equals `token_entropy(hidden @ weight.T, temperature)`."""
    _check_args(temperature, chunk_size)
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[-1]:
        raise ValueError(f"weight must be (V, D) with D = hidden.shape[-1] = {hidden.shape[-1]}, "
                         f"got {tuple(weight.shape)}")
    if weight.dtype != hidden.dtype:
        raise ValueError(f"hidden is {hidden.dtype} but weight is {weight.dtype}; cast one first")
    flat = _ChunkedHiddenEntropy.apply(hidden.reshape(-1, hidden.shape[-1]), weight, float(temperature),
                                       int(chunk_size))
    return flat.view(hidden.shape[:-1])
