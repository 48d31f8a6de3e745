"""Specification of chunked log-probs/entropy: equal to the unchunked torch reference, without its memory."""

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from torchplex.rl.logprobs import entropy_from_hidden, logprobs_from_hidden, token_entropy, token_logprobs

TOL = 1e-6
B, T, V, D = 2, 12, 50, 16  # B * T = 24 flattened tokens


def _reference_logprobs(logits, targets, temperature=1.0):
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    return logp.gather(-1, targets.unsqueeze(-1)).squeeze(-1)


def _inputs(dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    logits = (3.0 * torch.randn(B, T, V, generator=gen)).to(dtype)
    targets = torch.randint(0, V, (B, T), generator=gen)
    return logits, targets


class _LargestTensor(TorchDispatchMode):
    """Records the largest tensor (in elements) any op produces while active, optionally of one dtype."""

    def __init__(self, dtype=None):
        super().__init__()
        self.dtype = dtype
        self.max_numel = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor) and self.dtype in (None, t.dtype):
                self.max_numel = max(self.max_numel, t.numel())
        return out


@pytest.mark.parametrize("chunk_size", [1, 5, 8, 24, 1024])  # 5 does not divide 24; 1024 > 24
def test_token_logprobs_equals_log_softmax_gather(chunk_size):
    logits, targets = _inputs()
    out = token_logprobs(logits, targets, chunk_size=chunk_size)
    assert out.shape == (B, T) and out.dtype == torch.float32
    torch.testing.assert_close(out, _reference_logprobs(logits, targets), atol=TOL, rtol=0)


def test_token_logprobs_applies_temperature_before_softmax():
    logits, targets = _inputs()
    out = token_logprobs(logits, targets, temperature=0.7, chunk_size=5)
    torch.testing.assert_close(out, _reference_logprobs(logits, targets, 0.7), atol=TOL, rtol=0)


def test_token_logprobs_of_bf16_logits_are_computed_in_fp32():
    logits, targets = _inputs(torch.bfloat16)
    out = token_logprobs(logits, targets, chunk_size=7)
    assert out.dtype == torch.float32
    torch.testing.assert_close(out, _reference_logprobs(logits, targets), atol=TOL, rtol=0)


def test_token_logprobs_accepts_unbatched_input():
    logits, targets = _inputs()
    out = token_logprobs(logits[0], targets[0], chunk_size=5)
    torch.testing.assert_close(out, _reference_logprobs(logits[0], targets[0]), atol=TOL, rtol=0)


@pytest.mark.parametrize("chunk_size", [5, 8])
def test_token_logprobs_gradient_equals_unchunked_autograd(chunk_size):
    logits, targets = _inputs()
    weights = torch.randn(B, T, generator=torch.Generator().manual_seed(1))
    ours = logits.clone().requires_grad_()
    (token_logprobs(ours, targets, temperature=0.7, chunk_size=chunk_size) * weights).sum().backward()
    ref = logits.clone().requires_grad_()
    (_reference_logprobs(ref, targets, 0.7) * weights).sum().backward()
    torch.testing.assert_close(ours.grad, ref.grad, atol=TOL, rtol=0)


def test_token_logprobs_gradient_of_bf16_logits_matches_reference_to_bf16_precision():
    logits, targets = _inputs(torch.bfloat16)
    ours = logits.clone().requires_grad_()
    token_logprobs(ours, targets, chunk_size=5).sum().backward()
    ref = logits.clone().requires_grad_()
    _reference_logprobs(ref, targets).sum().backward()
    assert ours.grad.dtype == torch.bfloat16
    torch.testing.assert_close(ours.grad.float(), ref.grad.float(), atol=2**-8, rtol=2**-7)


def test_token_logprobs_passes_gradcheck_in_fp64():
    logits, targets = _inputs(torch.float64)
    logits = logits[:, :5].clone().requires_grad_()
    assert torch.autograd.gradcheck(
        lambda x: token_logprobs(x, targets[:, :5], temperature=1.3, chunk_size=3), (logits,)
    )


def _saved_for_backward(fn):
    """Run fn() and return (dtype, numel) of every tensor autograd saves for the backward pass."""
    saved = []

    def pack(t):
        saved.append((t.dtype, t.numel()))
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return out, saved


def test_token_logprobs_saves_only_inputs_and_one_fp32_per_token():
    # A naive loop over chunks would keep every chunk's fp32 copy alive until backward, i.e. the
    # full (tokens, V) fp32 matrix spread over chunks; the Function keeps logits + one lse per token.
    logits, targets = _inputs(torch.bfloat16)
    logits.requires_grad_()
    out, saved = _saved_for_backward(lambda: token_logprobs(logits, targets, chunk_size=4))
    assert sum(n for dtype, n in saved if dtype == torch.float32) == B * T
    assert sum(n for _, n in saved) == logits.numel() + 2 * B * T
    out.sum().backward()


def test_token_logprobs_transients_stay_within_one_chunk():
    # bf16 logits make any (tokens, V) fp32 buffer stand out: only chunk-sized fp32 tensors may exist.
    logits, targets = _inputs(torch.bfloat16)
    logits.requires_grad_()
    chunk_size = 4
    with _LargestTensor(dtype=torch.float32) as probe:
        token_logprobs(logits, targets, chunk_size=chunk_size).sum().backward()
    assert 0 < probe.max_numel <= chunk_size * V


@pytest.mark.parametrize("chunk_size", [5, 1024])
def test_token_entropy_equals_softmax_entropy(chunk_size):
    logits, _ = _inputs()
    logp = torch.log_softmax(logits.double() / 0.7, dim=-1)
    expected = -(logp.exp() * logp).sum(-1).float()
    out = token_entropy(logits, temperature=0.7, chunk_size=chunk_size)
    torch.testing.assert_close(out, expected, atol=TOL, rtol=0)


def test_token_entropy_carries_no_gradient():
    logits, _ = _inputs()
    assert not token_entropy(logits.requires_grad_(), chunk_size=5).requires_grad


def _hidden_inputs(dtype=torch.float32):
    gen = torch.Generator().manual_seed(2)
    hidden = torch.randn(B, T, D, generator=gen).to(dtype)
    weight = (0.5 * torch.randn(V, D, generator=gen)).to(dtype)
    targets = torch.randint(0, V, (B, T), generator=gen)
    return hidden, weight, targets


@pytest.mark.parametrize("chunk_size", [5, 8, 1024])
def test_logprobs_from_hidden_equals_full_lm_head(chunk_size):
    hidden, weight, targets = _hidden_inputs()
    out = logprobs_from_hidden(hidden, weight, targets, temperature=0.7, chunk_size=chunk_size)
    torch.testing.assert_close(
        out, _reference_logprobs(hidden @ weight.T, targets, 0.7), atol=TOL, rtol=0
    )


@pytest.mark.parametrize("chunk_size", [5, 8])
def test_logprobs_from_hidden_gradients_equal_unchunked_autograd(chunk_size):
    hidden, weight, targets = _hidden_inputs()
    weights = torch.randn(B, T, generator=torch.Generator().manual_seed(3))
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    out = logprobs_from_hidden(h, w, targets, temperature=0.7, chunk_size=chunk_size)
    (out * weights).sum().backward()
    h_ref, w_ref = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    (_reference_logprobs(h_ref @ w_ref.T, targets, 0.7) * weights).sum().backward()
    torch.testing.assert_close(h.grad, h_ref.grad, atol=TOL, rtol=0)
    # The weight gradient (entries up to ~4) sums the chunks in another order: relative 1e-6 too.
    torch.testing.assert_close(w.grad, w_ref.grad, atol=TOL, rtol=TOL)


def test_logprobs_from_hidden_with_frozen_weight_gives_only_the_hidden_gradient():
    hidden, weight, targets = _hidden_inputs()
    h = hidden.clone().requires_grad_()
    logprobs_from_hidden(h, weight, targets, chunk_size=5).sum().backward()
    h_ref = hidden.clone().requires_grad_()
    _reference_logprobs(h_ref @ weight.T, targets).sum().backward()
    assert weight.grad is None
    torch.testing.assert_close(h.grad, h_ref.grad, atol=TOL, rtol=0)


def test_logprobs_from_hidden_bf16_gradients_match_reference_to_bf16_precision():
    hidden, weight, targets = _hidden_inputs(torch.bfloat16)
    h, w = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    logprobs_from_hidden(h, w, targets, chunk_size=5).sum().backward()
    h_ref, w_ref = hidden.clone().requires_grad_(), weight.clone().requires_grad_()
    _reference_logprobs(h_ref @ w_ref.T, targets).sum().backward()
    assert h.grad.dtype == w.grad.dtype == torch.bfloat16
    torch.testing.assert_close(h.grad.float(), h_ref.grad.float(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(w.grad.float(), w_ref.grad.float(), atol=2e-2, rtol=2e-2)


def test_logprobs_from_hidden_passes_gradcheck_in_fp64():
    hidden, weight, targets = _hidden_inputs(torch.float64)
    h = hidden[:, :4].clone().requires_grad_()
    w = weight.clone().requires_grad_()
    assert torch.autograd.gradcheck(
        lambda a, b: logprobs_from_hidden(a, b, targets[:, :4], temperature=1.3, chunk_size=3), (h, w)
    )


def test_logprobs_from_hidden_never_materialises_full_logits():
    tokens, chunk_size = 64, 4
    gen = torch.Generator().manual_seed(4)
    hidden = torch.randn(tokens, D, generator=gen, requires_grad=True)
    weight = torch.randn(V, D, generator=gen, requires_grad=True)
    targets = torch.randint(0, V, (tokens,), generator=gen)
    _, saved = _saved_for_backward(
        lambda: logprobs_from_hidden(hidden, weight, targets, chunk_size=chunk_size)
    )
    # Saved for backward: hidden, weight, targets and one lse per token -- no logits.
    assert sum(n for _, n in saved) == tokens * D + V * D + 2 * tokens
    with _LargestTensor() as probe:
        logprobs_from_hidden(hidden, weight, targets, chunk_size=chunk_size).sum().backward()
    # Largest legitimate tensors: one chunk of logits, the hidden states/grad, the weight/grad.
    assert probe.max_numel <= max(chunk_size * V, tokens * D, V * D)
    assert probe.max_numel < tokens * V


def test_mismatched_shapes_are_rejected_with_both_shapes():
    logits, targets = _inputs()
    with pytest.raises(ValueError, match=r"\(2, 12, 50\).*\(2, 11\)"):
        token_logprobs(logits, targets[:, :11])
    hidden, weight, targets = _hidden_inputs()
    with pytest.raises(ValueError, match=r"\(50, 15\)"):
        logprobs_from_hidden(hidden, weight[:, :15], targets)


@pytest.mark.parametrize("temperature,chunk_size", [(1.0, 5), (0.7, 24), (1.3, 1000)])
def test_entropy_from_hidden_value_and_gradient_equal_plain_autograd(temperature, chunk_size):
    """Issue 16 defect 5 (the entropy bonus needs a gradient): the chunked entropy of hidden @ weight.T equals
    -sum softmax * log_softmax of the unchunked logits, and so do its gradients w.r.t. hidden and weight
    (float64, 1e-10), with a non-uniform upstream gradient."""
    gen = torch.Generator().manual_seed(1)
    hidden = torch.randn(B, T, D, generator=gen, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(V, D, generator=gen, dtype=torch.float64, requires_grad=True)
    upstream = torch.randn(B, T, generator=gen, dtype=torch.float64)
    logp = torch.log_softmax(hidden @ weight.T / temperature, dim=-1)
    reference = -(logp.exp() * logp).sum(-1)
    ref_grads = torch.autograd.grad((reference * upstream).sum(), (hidden, weight))
    out = entropy_from_hidden(hidden, weight, temperature, chunk_size)
    grads = torch.autograd.grad((out * upstream).sum(), (hidden, weight))
    torch.testing.assert_close(out, reference, rtol=1e-10, atol=1e-10)
    torch.testing.assert_close(out.detach(), token_entropy(hidden.detach() @ weight.detach().T, temperature),
                               rtol=1e-10, atol=1e-10)
    for got, want in zip(grads, ref_grads):
        torch.testing.assert_close(got, want, rtol=1e-10, atol=1e-10)
