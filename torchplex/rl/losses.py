"""GRPO-family policy loss: PPO-clip surrogate (token- or sequence-level ratio), KL and entropy terms.

All per-token quantities are (N, T): N sequences (rows) by T response positions, with a validity
`mask` (nonzero = a response token that counts). Every reduction goes through `aggregate`, whose
normalisers can be supplied by the caller. That is what makes gradient accumulation exact: split a
mini-batch by rows into micro-batches, pass the *mini-batch* totals (`BatchTotals.from_mask` on the
full mask) to every micro-batch call, and the micro-batch losses (and their gradients) sum to the
full-batch loss. Under data parallelism the totals must also be summed over ranks by the caller.

Padding positions may hold anything (even inf or nan logprobs): inputs are zeroed there before any
arithmetic, so they contribute exactly 0 to the loss and receive exactly 0 gradient.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

AGGREGATION_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum", "seq-mean-token-sum-norm")
KL_ESTIMATORS = ("k1", "k2", "k3")
IMPORTANCE_LEVELS = ("token", "sequence")

# k3 exponentiates the log-ratio: exp(20) ~ 4.9e8 is far from fp32 overflow (exp(88)), and a policy
# that drifted e^20 away from the reference is broken anyway. Beyond the clamp the k3 value is
# constant, so those tokens get no KL gradient.
K3_LOG_RATIO_CLAMP = 20.0


def _check_choice(kind: str, value: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ValueError(f"unknown {kind} {value!r}; expected one of {allowed}")


def kl_penalty(logprobs: Tensor, ref_logprobs: Tensor, estimator: str) -> Tensor:
    """Per-token estimate of KL(pi || pi_ref) from sampled-token log-probs (Schulman's estimators).

    With log_ratio = logp - logp_ref:
      k1 = log_ratio                          (unbiased, high variance, can be negative)
      k2 = 0.5 * log_ratio**2                 (biased, low variance, >= 0)
      k3 = exp(-log_ratio) + log_ratio - 1    (unbiased, low variance, >= 0; the GRPO default)
    For k3 the log-ratio is clamped to +-K3_LOG_RATIO_CLAMP before exponentiating.
    """
    _check_choice("KL estimator", estimator, KL_ESTIMATORS)
    if logprobs.shape != ref_logprobs.shape:
        raise ValueError(
            f"logprobs {tuple(logprobs.shape)} and ref_logprobs {tuple(ref_logprobs.shape)} differ"
        )
    log_ratio = logprobs - ref_logprobs
    if estimator == "k1":
        return log_ratio
    if estimator == "k2":
        return 0.5 * log_ratio.square()
    ref_log_ratio = (-log_ratio).clamp(-K3_LOG_RATIO_CLAMP, K3_LOG_RATIO_CLAMP)
    return torch.exp(ref_log_ratio) - ref_log_ratio - 1.0


@dataclass(frozen=True)
class BatchTotals:
    """Normalisers of a whole mini-batch, to be passed to every micro-batch's `aggregate`/`policy_loss`."""

    total_tokens: float  # valid tokens in the mini-batch
    total_seqs: int  # sequences (rows), empty ones included, as TRL and verl count them
    max_len: int  # padded response length (Dr. GRPO's constant normaliser)

    @classmethod
    def from_mask(cls, mask: Tensor, max_len: int | None = None) -> "BatchTotals":
        """Totals of a (N, T) mask; `max_len` defaults to T. Syncs with the device once."""
        valid = mask.bool()
        return cls(
            total_tokens=float(valid.sum().item()),
            total_seqs=int(mask.shape[0]),
            max_len=int(mask.shape[-1] if max_len is None else max_len),
        )


def _check_positive(name: str, value: float | Tensor | None) -> None:
    # Only plain numbers are checked: reading a tensor's value would force a device sync.
    if isinstance(value, (int, float)) and not value > 0:
        raise ValueError(f"{name} must be > 0, got {value}")


def aggregate(
    values: Tensor,
    mask: Tensor,
    mode: str,
    *,
    total_tokens: float | Tensor | None = None,
    total_seqs: int | Tensor | None = None,
    max_len: int | None = None,
) -> Tensor:
    """Reduce per-token `values` (N, T) over valid positions of `mask` (N, T) to a scalar.

    - "token-mean":              sum(values * mask) / total_tokens                 (DAPO)
    - "seq-mean-token-mean":     sum_i mean_{valid t}(values[i, t]) / total_seqs   (GRPO, GSPO)
    - "seq-mean-token-sum":      sum(values * mask) / total_seqs
    - "seq-mean-token-sum-norm": sum(values * mask) / (max_len * total_seqs)   (Dr. GRPO)
    (verl's `agg_loss` names; docs/losses.md gives the sources.)

    Defaults (this call's own batch): total_tokens = number of valid tokens (at least 1, so an empty
    batch gives 0 rather than nan), total_seqs = number of rows, max_len = T. A row with no valid
    token counts as a sequence and contributes 0, as in TRL's GRPOTrainer (`.mean()` over rows of a
    `clamp(min=1)` per-row mean) and verl's `agg_loss` (the mean over the local batch): the
    normaliser is the number of samples drawn, whatever their lengths. Pass the mini-batch totals
    when this is a micro-batch, and the sum over micro-batches equals the full-batch value.
    """
    _check_choice("aggregation mode", mode, AGGREGATION_MODES)
    if values.dim() != 2 or values.shape != mask.shape:
        raise ValueError(
            f"values {tuple(values.shape)} and mask {tuple(mask.shape)} must both be (N, T)"
        )
    _check_positive("total_tokens", total_tokens)
    _check_positive("total_seqs", total_seqs)
    _check_positive("max_len", max_len)
    valid = mask.bool()
    masked = torch.where(valid, values, torch.zeros((), dtype=values.dtype, device=values.device))

    if mode == "token-mean":
        if total_tokens is None:
            total_tokens = valid.sum().clamp(min=1).to(values.dtype)
        return masked.sum() / total_tokens

    tokens_per_seq = valid.sum(dim=-1)
    if total_seqs is None:
        total_seqs = max(values.shape[0], 1)
    if mode == "seq-mean-token-mean":
        seq_means = masked.sum(dim=-1) / tokens_per_seq.clamp(min=1).to(values.dtype)
        return seq_means.sum() / total_seqs
    if mode == "seq-mean-token-sum":
        return masked.sum() / total_seqs
    if max_len is None:
        max_len = values.shape[-1]
    return masked.sum() / (max_len * total_seqs)


def masked_mean(values: Tensor, mask: Tensor) -> Tensor:
    """Mean of `values` over valid positions of `mask` (0 when none are valid)."""
    return aggregate(values, mask, "token-mean")


@dataclass
class PolicyLossConfig:
    """How the GRPO-family loss is formed. Defaults are GRPO's (DeepSeekMath eq. 3: the per-sequence
    token mean, then the mean over sequences; PPO's clip 0.2), except kl_coef: the paper's 0.04 needs a
    reference model, so it is opt-in. The named algorithms' settings (torchplex.config
    ALGORITHM_DEFAULTS, docs/losses.md):
    DAPO: clip_high=0.28, loss_agg="token-mean". Dr. GRPO: loss_agg="seq-mean-token-sum-norm".
    GSPO: importance="sequence", clip 3e-4 / 4e-4, loss_agg="seq-mean-token-mean" (the paper's
    sequence objective: each sequence weighs the same whatever its length).
    """

    clip_low: float = 0.2
    clip_high: float = 0.2
    importance: str = "token"
    loss_agg: str = "seq-mean-token-mean"
    kl_coef: float = 0.0
    kl_estimator: str = "k3"
    entropy_coef: float = 0.0

    def __post_init__(self) -> None:
        _check_choice("importance level", self.importance, IMPORTANCE_LEVELS)
        _check_choice("aggregation mode", self.loss_agg, AGGREGATION_MODES)
        _check_choice("KL estimator", self.kl_estimator, KL_ESTIMATORS)
        if not 0.0 <= self.clip_low < 1.0:
            raise ValueError(f"clip_low must be in [0, 1), got {self.clip_low}")
        if not self.clip_high >= 0.0:
            raise ValueError(f"clip_high must be >= 0, got {self.clip_high}")
        if not self.kl_coef >= 0.0:
            raise ValueError(f"kl_coef must be >= 0, got {self.kl_coef}")


@dataclass
class LossStats:
    """Detached 0-dim tensors describing one `policy_loss` call (no host sync is forced).

    `loss` and `pg_loss` use the same normalisers as the loss, so they add up over micro-batches;
    the means are over this call's valid tokens and combine with `num_tokens` weights (`merge`).
    """

    loss: Tensor
    pg_loss: Tensor
    clip_fraction: Tensor  # fraction of valid tokens where the clipped branch of the min is active
    ratio_mean: Tensor  # mean importance ratio over valid tokens
    num_tokens: Tensor  # valid tokens in this call
    kl: Tensor | None = None  # mean per-token KL estimate (when ref_logprobs were given)
    entropy: Tensor | None = None  # mean per-token entropy (when entropy was given)

    @staticmethod
    def merge(parts: list["LossStats"]) -> "LossStats":
        """Stats of the union of micro-batches: summed losses, token-weighted means."""
        if not parts:
            raise ValueError("merge needs at least one LossStats")
        num_tokens = torch.stack([p.num_tokens for p in parts]).sum()
        denom = num_tokens.clamp(min=1)

        def weighted(name: str) -> Tensor | None:
            values = [getattr(p, name) for p in parts]
            if any(v is None for v in values):
                return None
            return sum(v * p.num_tokens for v, p in zip(values, parts)) / denom

        return LossStats(
            loss=torch.stack([p.loss for p in parts]).sum(),
            pg_loss=torch.stack([p.pg_loss for p in parts]).sum(),
            clip_fraction=weighted("clip_fraction"),
            ratio_mean=weighted("ratio_mean"),
            num_tokens=num_tokens,
            kl=weighted("kl"),
            entropy=weighted("entropy"),
        )


def _importance_ratio(logprobs: Tensor, old_logprobs: Tensor, valid: Tensor, importance: str) -> Tensor:
    """Per-token importance ratio (N, T); 1 at padding. Inputs are already zero at padding."""
    log_ratio = logprobs - old_logprobs
    if importance == "token":
        return torch.exp(log_ratio)
    # GSPO: s_i = exp(mean over valid tokens of log_ratio), the same value for every token of row i.
    # Token-level form from the paper: s_{i,t} = sg[s_i] * pi(y_t) / sg[pi(y_t)], i.e. its value is
    # s_i and d s_{i,t} / d logp_t = s_i, while no gradient flows through s_i itself. With a
    # per-sequence advantage this reproduces the gradient of the sequence-level objective.
    tokens_per_seq = valid.sum(dim=-1, keepdim=True).clamp(min=1).to(log_ratio.dtype)
    seq_log_ratio = (log_ratio.sum(dim=-1, keepdim=True) / tokens_per_seq).detach()
    token_log_ratio = seq_log_ratio + (logprobs - logprobs.detach())
    return torch.exp(torch.where(valid, token_log_ratio, torch.zeros_like(token_log_ratio)))


def _check_policy_loss_inputs(logprobs: Tensor, old_logprobs: Tensor, advantages: Tensor, mask: Tensor,
                              cfg: PolicyLossConfig, ref_logprobs: Tensor | None, entropy: Tensor | None) -> None:
    """Refuse mis-shaped inputs and a KL or entropy coefficient without its tensor, naming the argument."""
    if logprobs.dim() != 2:
        raise ValueError(f"logprobs must be (N, T), got shape {tuple(logprobs.shape)}")
    named = {"old_logprobs": old_logprobs, "mask": mask, "ref_logprobs": ref_logprobs, "entropy": entropy}
    for name, tensor in named.items():
        if tensor is not None and tensor.shape != logprobs.shape:
            raise ValueError(
                f"{name} has shape {tuple(tensor.shape)}, expected {tuple(logprobs.shape)} like logprobs"
            )
    if advantages.shape not in (logprobs.shape[:1], logprobs.shape):
        raise ValueError(
            f"advantages has shape {tuple(advantages.shape)}, expected (N,) = {tuple(logprobs.shape[:1])} "
            f"or (N, T) = {tuple(logprobs.shape)}"
        )
    if cfg.kl_coef > 0 and ref_logprobs is None:
        raise ValueError(f"kl_coef={cfg.kl_coef} > 0 but no ref_logprobs were given")
    if cfg.entropy_coef != 0 and entropy is None:
        raise ValueError(f"entropy_coef={cfg.entropy_coef} != 0 but no entropy was given")


def _clipped_surrogate(ratio: Tensor, adv: Tensor, cfg: PolicyLossConfig) -> tuple[Tensor, Tensor]:
    """Per-token PPO-clip loss -min(ratio * A, clip(ratio) * A), and where the clipped branch is the active one."""
    clipped_ratio = ratio.clamp(1.0 - cfg.clip_low, 1.0 + cfg.clip_high)
    surrogate = ratio * adv
    clipped_surrogate = clipped_ratio * adv
    return -torch.minimum(surrogate, clipped_surrogate), clipped_surrogate < surrogate


def _loss_stats(loss: Tensor, pg_loss: Tensor, ratio: Tensor, clip_active: Tensor, mask: Tensor,
                kl: Tensor | None, entropy: Tensor | None, dtype: torch.dtype) -> LossStats:
    """The detached `LossStats` of one call: its losses, and means over its valid tokens (no host sync)."""
    valid = mask.bool()
    with torch.no_grad():
        return LossStats(
            loss=loss.detach(),
            pg_loss=pg_loss.detach(),
            clip_fraction=masked_mean((clip_active & valid).to(dtype), mask),
            ratio_mean=masked_mean(ratio, mask),
            num_tokens=valid.sum(),
            kl=None if kl is None else masked_mean(kl.detach(), mask),
            entropy=None if entropy is None else masked_mean(entropy.detach(), mask),
        )


def policy_loss(
    logprobs: Tensor,
    old_logprobs: Tensor,
    advantages: Tensor,
    mask: Tensor,
    cfg: PolicyLossConfig,
    *,
    ref_logprobs: Tensor | None = None,
    entropy: Tensor | None = None,
    total_tokens: float | Tensor | None = None,
    total_seqs: int | Tensor | None = None,
    max_len: int | None = None,
) -> tuple[Tensor, LossStats]:
    """PPO-clip policy loss of GRPO/DAPO/Dr. GRPO/GSPO, plus optional KL and entropy terms.

    logprobs, old_logprobs, mask (and ref_logprobs, entropy if given): (N, T); advantages: (N,) per
    sequence (or (N, T) per token). Per token:
        pg = -min(ratio * A, clip(ratio, 1 - clip_low, 1 + clip_high) * A)
    and the scalar loss is
        aggregate(pg) + kl_coef * aggregate(kl_penalty(logprobs, ref)) - entropy_coef * aggregate(entropy)
    with `cfg.loss_agg` and the given totals throughout. Only `logprobs` (and `entropy`, if the caller
    made it differentiable) receive gradients; old/ref log-probs and advantages are constants.
    """
    _check_policy_loss_inputs(logprobs, old_logprobs, advantages, mask, cfg, ref_logprobs, entropy)
    valid = mask.bool()
    zero = torch.zeros((), dtype=logprobs.dtype, device=logprobs.device)

    def clean(t: Tensor) -> Tensor:  # zero padding so garbage there can't leak into values or grads
        return torch.where(valid, t, zero)

    def agg(t: Tensor) -> Tensor:
        return aggregate(t, mask, cfg.loss_agg, total_tokens=total_tokens, total_seqs=total_seqs, max_len=max_len)

    logprobs = clean(logprobs)
    old_logprobs = clean(old_logprobs.detach())
    adv = advantages.detach()
    adv = clean(adv.unsqueeze(-1).expand_as(logprobs) if adv.dim() == 1 else adv)

    ratio = _importance_ratio(logprobs, old_logprobs, valid, cfg.importance)
    pg_per_token, clip_active = _clipped_surrogate(ratio, adv, cfg)
    pg_loss = agg(pg_per_token)
    loss = pg_loss

    kl = None
    if ref_logprobs is not None:
        kl = clean(kl_penalty(logprobs, clean(ref_logprobs.detach()), cfg.kl_estimator))
        if cfg.kl_coef > 0:
            loss = loss + cfg.kl_coef * agg(kl)

    if entropy is not None:
        entropy = clean(entropy)
        if cfg.entropy_coef != 0:
            loss = loss - cfg.entropy_coef * agg(entropy)

    return loss, _loss_stats(loss, pg_loss, ratio, clip_active, mask, kl, entropy, logprobs.dtype)
