"""How far the rollout engine's log-probs are from the trainer's recomputation of them (the old policy).

Per response token, with d = trainer - rollout log-prob of the sampled token:
  mean |d|                                      what users track between an inference engine and the trainer
  k3 = exp(d) - 1 - d                           Schulman's unbiased, non-negative estimator of
                                                KL(rollout || trainer) from samples drawn by the rollout
Both are 0 when the engine samples from the trainer's own distribution (the native engine, up to the rounding
of its batched decode), and measure the drift of a separate engine (SGLang) otherwise.
"""

from __future__ import annotations

import torch


def mismatch_sums(rollout_logprobs: torch.Tensor, trainer_logprobs: torch.Tensor, mask: torch.Tensor
                  ) -> tuple[float, float, float]:
    """(sum |d|, sum k3, token count) over the masked entries, for a mean across ranks."""
    m = mask.bool()
    d = (trainer_logprobs.float() - rollout_logprobs.float())[m]
    return float(d.abs().sum()), float((torch.expm1(d) - d).sum()), float(m.sum())


def logprob_mismatch(rollout_logprobs: torch.Tensor, trainer_logprobs: torch.Tensor, mask: torch.Tensor
                     ) -> dict[str, float]:
    """{"mean_abs": mean |d|, "k3": mean k3} over the masked response tokens (0 for none)."""
    abs_sum, k3_sum, count = mismatch_sums(rollout_logprobs, trainer_logprobs, mask)
    return {"mean_abs": abs_sum / max(count, 1.0), "k3": k3_sum / max(count, 1.0)}
