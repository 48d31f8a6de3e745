"""Specification of the GRPO-family losses, against hand-computed values (tol 1e-6) and finite differences."""

import math

import pytest
import torch

from torchplex.rl.losses import (
    AGGREGATION_MODES,
    K3_LOG_RATIO_CLAMP,
    BatchTotals,
    LossStats,
    PolicyLossConfig,
    aggregate,
    kl_penalty,
    policy_loss,
)

TOL = 1e-6
F64 = torch.float64


def _t(values) -> torch.Tensor:
    return torch.tensor(values, dtype=F64)


def _close(actual, expected, tol=TOL):
    torch.testing.assert_close(actual, torch.as_tensor(expected, dtype=actual.dtype), atol=tol, rtol=0)


# ----------------------------------------------------------------------------- KL estimators

LOGP = [-0.5, -1.2, -2.0, -0.1]
REF = [-0.7, -1.0, -3.5, -0.1]


def test_kl_k1_is_the_log_ratio():
    _close(kl_penalty(_t(LOGP), _t(REF), "k1"), [p - r for p, r in zip(LOGP, REF)])


def test_kl_k2_is_half_the_squared_log_ratio():
    _close(kl_penalty(_t(LOGP), _t(REF), "k2"), [0.5 * (p - r) ** 2 for p, r in zip(LOGP, REF)])


def test_kl_k3_is_schulmans_low_variance_estimator():
    expected = [math.exp(r - p) - (r - p) - 1 for p, r in zip(LOGP, REF)]
    _close(kl_penalty(_t(LOGP), _t(REF), "k3"), expected)


def test_kl_k3_clamps_the_log_ratio_so_it_stays_finite():
    logp, ref = _t([-200.0, 0.0]), _t([0.0, -200.0])  # log ratios ref - logp = +200 and -200
    c = K3_LOG_RATIO_CLAMP
    expected = [math.exp(c) - c - 1, math.exp(-c) + c - 1]
    out = kl_penalty(logp.float(), ref.float(), "k3")
    assert torch.isfinite(out).all()
    torch.testing.assert_close(out.double(), _t(expected), rtol=1e-6, atol=0)


def test_unknown_kl_estimator_is_named():
    with pytest.raises(ValueError, match=r"'k4'.*k1.*k2.*k3"):
        kl_penalty(_t(LOGP), _t(REF), "k4")


# ----------------------------------------------------------------------------- aggregation

VALUES = [[1.0, 2.0, 3.0, 4.0], [5.0, 6.0, 7.0, 8.0], [9.0, 9.0, 9.0, 9.0]]
MASK = [[1, 1, 0, 0], [1, 1, 1, 0], [0, 0, 0, 0]]  # the last row is all padding


def _valid_rows():
    return [[v for v, m in zip(vr, mr) if m] for vr, mr in zip(VALUES, MASK) if any(mr)]


def test_token_mean_divides_by_the_number_of_valid_tokens():
    rows = _valid_rows()
    expected = sum(map(sum, rows)) / sum(map(len, rows))
    _close(aggregate(_t(VALUES), torch.tensor(MASK), "token-mean"), expected)


def test_seq_mean_token_mean_averages_per_sequence_means_over_all_sequences():
    """Issue 16 defect 5 (empty rows): the empty row counts as a sequence contributing 0, as in TRL and verl:
    (mean(1, 2) + mean(5, 6, 7) + 0) / 3 = (1.5 + 6 + 0) / 3 = 2.5 (main dropped it: 3.75)."""
    _close(aggregate(_t(VALUES), torch.tensor(MASK), "seq-mean-token-mean"), 2.5)


def test_seq_mean_token_sum_averages_per_sequence_sums():
    """verl's seq-mean-token-sum: ((1 + 2) + (5 + 6 + 7) + 0) / 3 = 7."""
    _close(aggregate(_t(VALUES), torch.tensor(MASK), "seq-mean-token-sum"), 7.0)


def test_seq_mean_token_sum_norm_divides_sums_by_max_len_times_sequences():
    """Dr. GRPO: 21 / (4 * 3) = 1.75."""
    _close(aggregate(_t(VALUES), torch.tensor(MASK), "seq-mean-token-sum-norm"), 1.75)


def test_aggregations_equal_trls_grpo_and_dr_grpo_losses_with_an_empty_row():
    """Issue 16 defect 5: with one empty row of 32, seq-mean-token-mean is TRL's loss_type="grpo" and
    seq-mean-token-sum-norm its "dr_grpo" (main gave 32/31 of them), token-mean its "bnpo"/"dapo" on one process."""
    values, mask = _ragged_batch(seed=3, n=6, t=7)
    values, mask = values.repeat(6, 1)[:32], mask.repeat(6, 1)[:32]
    mask[5] = False
    assert (mask.sum(-1) == 0).sum() >= 1
    m = mask.to(F64)
    trl_grpo = ((values * m).sum(-1) / m.sum(-1).clamp(min=1.0)).mean()
    trl_dr_grpo = (values * m).sum() / (values.size(0) * values.size(1))
    trl_bnpo = (values * m).sum() / m.sum().clamp(min=1.0)
    _close(aggregate(values, mask, "seq-mean-token-mean"), trl_grpo.item(), tol=1e-12)
    _close(aggregate(values, mask, "seq-mean-token-sum-norm"), trl_dr_grpo.item(), tol=1e-12)
    _close(aggregate(values, mask, "token-mean"), trl_bnpo.item(), tol=1e-12)


def test_given_normalisers_replace_the_defaults():
    rows = _valid_rows()
    total = sum(map(sum, rows))
    mask = torch.tensor(MASK)
    _close(aggregate(_t(VALUES), mask, "token-mean", total_tokens=10.0), total / 10)
    _close(
        aggregate(_t(VALUES), mask, "seq-mean-token-mean", total_seqs=4),
        sum(sum(r) / len(r) for r in rows) / 4,
    )
    _close(
        aggregate(_t(VALUES), mask, "seq-mean-token-sum-norm", total_seqs=4, max_len=16),
        total / (16 * 4),
    )


def test_fully_masked_batch_aggregates_to_zero():
    for mode in AGGREGATION_MODES:
        _close(aggregate(_t(VALUES), torch.zeros(3, 4, dtype=torch.bool), mode), 0.0)


def test_padding_values_never_leak_even_if_not_finite():
    values = _t(VALUES)
    values[0, 3], values[1, 3] = float("inf"), float("nan")
    clean = aggregate(_t(VALUES), torch.tensor(MASK), "token-mean")
    _close(aggregate(values, torch.tensor(MASK), "token-mean"), clean.item())


def test_unknown_aggregation_mode_is_named():
    with pytest.raises(ValueError, match=r"'seq-sum'.*token-mean"):
        aggregate(_t(VALUES), torch.tensor(MASK), "seq-sum")


def test_non_positive_normaliser_is_named():
    with pytest.raises(ValueError, match="total_tokens"):
        aggregate(_t(VALUES), torch.tensor(MASK), "token-mean", total_tokens=0)


def _ragged_batch(seed=0, n=6, t=7):
    """Random values and a right-padded mask whose rows have 0..t valid tokens."""
    gen = torch.Generator().manual_seed(seed)
    lengths = torch.tensor([3, 7, 1, 0, 5, 2])[:n]
    mask = torch.arange(t)[None, :] < lengths[:, None]
    return torch.randn(n, t, generator=gen, dtype=F64), mask


def _micro_batches(mask, sizes=(2, 3, 1)):
    """Row slices of the mini-batch, each trimmed to its own longest row (so T differs)."""
    start = 0
    for size in sizes:
        rows = slice(start, start + size)
        width = max(int(mask[rows].sum(-1).max()), 1)
        yield rows, width
        start += size


@pytest.mark.parametrize("mode", AGGREGATION_MODES)
def test_micro_batch_sum_equals_full_batch(mode):
    values, mask = _ragged_batch()
    totals = BatchTotals.from_mask(mask)
    full = aggregate(values, mask, mode)
    parts = [
        aggregate(
            values[rows, :width],
            mask[rows, :width],
            mode,
            total_tokens=totals.total_tokens,
            total_seqs=totals.total_seqs,
            max_len=totals.max_len,
        )
        for rows, width in _micro_batches(mask)
    ]
    _close(sum(parts), full.item())


def test_batch_totals_count_tokens_all_sequences_and_width():
    _, mask = _ragged_batch()
    assert BatchTotals.from_mask(mask) == BatchTotals(total_tokens=18.0, total_seqs=6, max_len=7)


# ----------------------------------------------------------------------------- PPO clip

RATIOS = [0.5, 0.75, 0.9, 1.0, 1.25, 1.5]
CLIP_LOW, CLIP_HIGH = 0.2, 0.28  # DAPO's asymmetric range [0.8, 1.28]


def _clip_case():
    """Row 0 has advantage +1, row 1 advantage -1; old logprobs chosen so that ratio = RATIOS."""
    old = _t([[-1.0 - 0.1 * i for i in range(len(RATIOS))]] * 2)
    logp = (old + _t([math.log(r) for r in RATIOS])).requires_grad_()
    return logp, old, _t([1.0, -1.0]), torch.ones(2, len(RATIOS), dtype=torch.bool)


def _hand_ppo(ratio, adv):
    """(per-token loss, clipped branch active, d loss / d ratio) from the PPO-clip definition."""
    clipped = min(max(ratio, 1 - CLIP_LOW), 1 + CLIP_HIGH)
    active = clipped * adv < ratio * adv
    return -min(ratio * adv, clipped * adv), active, (0.0 if active else -adv)


def test_ppo_clip_loss_and_gradient_with_asymmetric_range():
    logp, old, adv, mask = _clip_case()
    cfg = PolicyLossConfig(clip_low=CLIP_LOW, clip_high=CLIP_HIGH)
    loss, _ = policy_loss(logp, old, adv, mask, cfg)
    loss.backward()
    n = 2 * len(RATIOS)
    cases = [[_hand_ppo(r, a) for r in RATIOS] for a in (1.0, -1.0)]
    _close(loss, sum(c[0] for row in cases for c in row) / n)
    # d loss / d logp = d loss / d ratio * ratio (token-mean: each token weighs 1 / n)
    expected_grad = [[c[2] * r / n for c, r in zip(row, RATIOS)] for row in cases]
    _close(logp.grad, expected_grad)


def test_raising_clip_high_only_changes_positive_advantage_tokens_above_1_2():
    logp, old, adv, mask = _clip_case()
    wide = policy_loss(logp, old, adv, mask, PolicyLossConfig(clip_low=0.2, clip_high=0.28))[0]
    narrow = policy_loss(logp, old, adv, mask, PolicyLossConfig(clip_low=0.2, clip_high=0.2))[0]
    # A=+1, ratio 1.25: -1.25 (inside 1.28) vs -1.2; ratio 1.5: -1.28 vs -1.2. A=-1 tokens: unchanged.
    _close(wide - narrow, ((-1.25 - -1.2) + (-1.28 - -1.2)) / 12)


def test_clip_fraction_counts_tokens_where_the_clipped_branch_is_active():
    logp, old, adv, mask = _clip_case()
    _, stats = policy_loss(logp, old, adv, mask, PolicyLossConfig(clip_low=CLIP_LOW, clip_high=CLIP_HIGH))
    active = [_hand_ppo(r, a)[1] for a in (1.0, -1.0) for r in RATIOS]
    _close(stats.clip_fraction, sum(active) / len(active))
    _close(stats.ratio_mean, sum(RATIOS) / len(RATIOS))
    assert stats.num_tokens.item() == 12


def test_on_policy_gradient_is_minus_advantage_times_token_weight():
    logp = _t([[-1.0, -2.0, -0.5], [-0.3, -0.7, -1.1]]).requires_grad_()
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]], dtype=torch.bool)
    adv = _t([2.0, -1.0])
    loss, stats = policy_loss(logp, logp.detach(), adv, mask, PolicyLossConfig(loss_agg="token-mean"))
    loss.backward()
    _close(loss, -(2.0 * 3 - 1.0) / 4)
    _close(logp.grad, [[-2.0 / 4] * 3, [1.0 / 4, 0.0, 0.0]])
    _close(stats.clip_fraction, 0.0)


def test_per_token_advantages_equal_broadcast_per_sequence_advantages():
    logp, old, adv, mask = _clip_case()
    cfg = PolicyLossConfig(clip_low=CLIP_LOW, clip_high=CLIP_HIGH)
    per_seq, _ = policy_loss(logp, old, adv, mask, cfg)
    per_token, _ = policy_loss(logp, old, adv[:, None].expand(-1, len(RATIOS)), mask, cfg)
    _close(per_token, per_seq.item())


# ----------------------------------------------------------------------------- GSPO

GSPO_OLD = [[-1.0, -2.0, -0.5, -1.5], [-0.2, -0.9, -1.3, -0.4]]
GSPO_DELTA = [[0.10, -0.02, 0.05, 9.99], [0.30, 0.50, 0.40, 0.10]]  # row 0's last token is padding
GSPO_MASK = [[1, 1, 1, 0], [1, 1, 1, 1]]
GSPO_ADV = [1.5, 0.8]


def _gspo_inputs():
    logp = (_t(GSPO_OLD) + _t(GSPO_DELTA)).requires_grad_()
    return logp, _t(GSPO_OLD), _t(GSPO_ADV), torch.tensor(GSPO_MASK, dtype=torch.bool)


def _hand_seq_ratios():
    ratios = []
    for delta, mask in zip(GSPO_DELTA, GSPO_MASK):
        valid = [d for d, m in zip(delta, mask) if m]
        ratios.append(math.exp(sum(valid) / len(valid)))
    return ratios  # ~[1.044, 1.380]


def test_gspo_ratio_is_exp_of_mean_token_log_ratio_for_every_token():
    logp, old, adv, mask = _gspo_inputs()
    cfg = PolicyLossConfig(importance="sequence", clip_low=0.5, clip_high=1.0, loss_agg="seq-mean-token-mean")
    loss, stats = policy_loss(logp, old, adv, mask, cfg)
    s = _hand_seq_ratios()
    _close(stats.ratio_mean, (3 * s[0] + 4 * s[1]) / 7)  # token-weighted
    _close(loss, -(s[0] * GSPO_ADV[0] + s[1] * GSPO_ADV[1]) / 2)  # nothing clipped here


def test_gspo_gradient_is_sequence_ratio_times_advantage_per_token():
    logp, old, adv, mask = _gspo_inputs()
    cfg = PolicyLossConfig(importance="sequence", clip_low=0.5, clip_high=1.0, loss_agg="token-mean")
    policy_loss(logp, old, adv, mask, cfg)[0].backward()
    s = _hand_seq_ratios()
    # Token form: d s_{i,t} / d logp_{i,t} = s_i, so each valid token gets -A_i * s_i / total_tokens.
    expected = [[-a * si / 7 if m else 0.0 for m in row] for a, si, row in zip(GSPO_ADV, s, GSPO_MASK)]
    _close(logp.grad, expected)


def test_gspo_token_form_has_the_gradient_of_the_sequence_objective():
    logp, old, adv, mask = _gspo_inputs()
    cfg = PolicyLossConfig(
        importance="sequence", clip_low=0.02, clip_high=0.1, loss_agg="seq-mean-token-mean"
    )
    policy_loss(logp, old, adv, mask, cfg)[0].backward()
    # The paper's sequence-level objective, written directly (row 1, s ~ 1.38, is clipped).
    ref = logp.detach().clone().requires_grad_()
    m = mask.to(F64)
    s = torch.exp(((ref - old) * m).sum(-1) / m.sum(-1))
    objective = torch.minimum(s * adv, s.clamp(1 - 0.02, 1 + 0.1) * adv).mean()
    (-objective).backward()
    _close(logp.grad, ref.grad)
    assert logp.grad[0, :3].abs().min() > 0 and logp.grad[1].abs().max() == 0


@pytest.mark.parametrize("mode", AGGREGATION_MODES)
def test_gspo_gradient_matches_finite_differences(mode):
    logp, old, adv, mask = _gspo_inputs()
    cfg = PolicyLossConfig(importance="sequence", clip_low=0.02, clip_high=0.1, loss_agg=mode)
    policy_loss(logp, old, adv, mask, cfg)[0].backward()
    h = 1e-6
    numeric = torch.zeros_like(logp)
    for i, t in mask.nonzero().tolist():
        plus, minus = logp.detach().clone(), logp.detach().clone()
        plus[i, t] += h
        minus[i, t] -= h
        f_plus = policy_loss(plus, old, adv, mask, cfg)[0]
        f_minus = policy_loss(minus, old, adv, mask, cfg)[0]
        numeric[i, t] = (f_plus - f_minus) / (2 * h)
    _close(logp.grad, numeric)


# ----------------------------------------------------------------------------- KL and entropy terms


def test_kl_term_adds_coefficient_times_aggregated_k3_and_reports_mean_kl():
    logp, old, adv, mask = _gspo_inputs()
    ref = old - 0.3
    base, _ = policy_loss(logp, old, adv, mask, PolicyLossConfig(loss_agg="token-mean"))
    loss, stats = policy_loss(logp, old, adv, mask, PolicyLossConfig(kl_coef=0.1, loss_agg="token-mean"),
                              ref_logprobs=ref)
    per_token = [
        [math.exp(-0.3 - d) + 0.3 + d - 1 for d, m in zip(drow, mrow) if m]
        for drow, mrow in zip(GSPO_DELTA, GSPO_MASK)
    ]
    kl_mean = sum(map(sum, per_token)) / 7
    _close(loss, base.item() + 0.1 * kl_mean)  # token-mean aggregation == the mean here
    _close(stats.kl, kl_mean)
    _close(stats.pg_loss, base.item())


def test_entropy_bonus_is_subtracted():
    logp, old, adv, mask = _gspo_inputs()
    entropy = _t([[1.0, 2.0, 3.0, 100.0], [0.5, 0.5, 0.5, 0.5]])
    base, _ = policy_loss(logp, old, adv, mask, PolicyLossConfig(loss_agg="seq-mean-token-mean"))
    cfg = PolicyLossConfig(loss_agg="seq-mean-token-mean", entropy_coef=0.01)
    loss, stats = policy_loss(logp, old, adv, mask, cfg, entropy=entropy)
    _close(loss, base.item() - 0.01 * (2.0 + 0.5) / 2)
    _close(stats.entropy, (6.0 + 2.0) / 7)


def test_padding_with_non_finite_logprobs_gives_finite_loss_and_zero_gradient():
    logp, old, adv, mask = _gspo_inputs()
    ref = old - 0.3
    cfg = PolicyLossConfig(kl_coef=0.1)
    clean, _ = policy_loss(logp, old, adv, mask, cfg, ref_logprobs=ref)
    dirty_logp = logp.detach().clone()
    dirty_logp[0, 3] = -float("inf")
    dirty_logp.requires_grad_()
    dirty_old, dirty_ref = old.clone(), ref.clone()
    dirty_old[0, 3], dirty_ref[0, 3] = float("nan"), -float("inf")
    loss, _ = policy_loss(dirty_logp, dirty_old, adv, mask, cfg, ref_logprobs=dirty_ref)
    loss.backward()
    _close(loss, clean.item())
    assert torch.isfinite(dirty_logp.grad).all() and dirty_logp.grad[0, 3] == 0


@pytest.mark.parametrize("importance", ["token", "sequence"])
@pytest.mark.parametrize("mode", AGGREGATION_MODES)
def test_policy_loss_micro_batches_sum_to_full_batch_loss_gradient_and_stats(mode, importance):
    gen = torch.Generator().manual_seed(7)
    _, mask = _ragged_batch()
    n, t = mask.shape
    old = -torch.rand(n, t, generator=gen, dtype=F64) * 3
    logp = (old + 0.3 * torch.randn(n, t, generator=gen, dtype=F64)).requires_grad_()
    ref = old + 0.2 * torch.randn(n, t, generator=gen, dtype=F64)
    entropy = torch.rand(n, t, generator=gen, dtype=F64)
    adv = torch.randn(n, generator=gen, dtype=F64)
    cfg = PolicyLossConfig(
        clip_high=0.28, importance=importance, loss_agg=mode, kl_coef=0.05, entropy_coef=0.01
    )
    full, full_stats = policy_loss(logp, old, adv, mask, cfg, ref_logprobs=ref, entropy=entropy)
    full_grad = torch.autograd.grad(full, logp)[0]

    totals = BatchTotals.from_mask(mask)
    parts, grad = [], torch.zeros_like(logp)
    for rows, width in _micro_batches(mask):
        cols = slice(0, width)
        mb_logp = logp.detach()[rows, cols].clone().requires_grad_()
        loss, stats = policy_loss(
            mb_logp, old[rows, cols], adv[rows], mask[rows, cols], cfg,
            ref_logprobs=ref[rows, cols], entropy=entropy[rows, cols],
            total_tokens=totals.total_tokens, total_seqs=totals.total_seqs, max_len=totals.max_len,
        )  # fmt: skip
        loss.backward()
        grad[rows, cols] = mb_logp.grad
        parts.append(stats)
    merged = LossStats.merge(parts)
    _close(merged.loss, full.item())
    _close(merged.pg_loss, full_stats.pg_loss.item())
    _close(grad, full_grad)
    for name in ("clip_fraction", "ratio_mean", "kl", "entropy"):
        _close(getattr(merged, name), getattr(full_stats, name).item())
    assert merged.num_tokens.item() == full_stats.num_tokens.item()


# ----------------------------------------------------------------------------- validation


@pytest.mark.parametrize(
    "kwargs, bad",
    [
        ({"importance": "group"}, "'group'"),
        ({"loss_agg": "sum"}, "'sum'"),
        ({"kl_estimator": "k9"}, "'k9'"),
        ({"clip_low": 1.0}, "clip_low"),
        ({"clip_high": -0.1}, "clip_high"),
    ],
)
def test_config_rejects_bad_values_by_name(kwargs, bad):
    with pytest.raises(ValueError, match=bad):
        PolicyLossConfig(**kwargs)


def test_kl_coefficient_without_reference_logprobs_is_an_error():
    logp, old, adv, mask = _gspo_inputs()
    with pytest.raises(ValueError, match="ref_logprobs"):
        policy_loss(logp, old, adv, mask, PolicyLossConfig(kl_coef=0.1))


def test_entropy_coefficient_without_entropy_is_an_error():
    logp, old, adv, mask = _gspo_inputs()
    with pytest.raises(ValueError, match="entropy"):
        policy_loss(logp, old, adv, mask, PolicyLossConfig(entropy_coef=0.01))


def test_shape_mismatch_names_the_argument():
    logp, old, adv, mask = _gspo_inputs()
    with pytest.raises(ValueError, match="old_logprobs"):
        policy_loss(logp, old[:, :3], adv, mask, PolicyLossConfig())
    with pytest.raises(ValueError, match="advantages"):
        policy_loss(logp, old, adv[:1], mask, PolicyLossConfig())


def test_default_aggregation_is_grpos_sequence_mean():
    """Issue 16 defect 5: PolicyLossConfig's defaults are GRPO's, and DeepSeekMath's GRPO objective (eq. 3) is
    1/G sum_i 1/|o_i| sum_t: the per-sequence token mean (main defaulted to token-mean)."""
    assert PolicyLossConfig().loss_agg == "seq-mean-token-mean"
    logp = _t([[-1.0, -2.0, -0.5], [-0.3, -0.7, -1.1]]).requires_grad_()
    mask = torch.tensor([[1, 1, 1], [1, 0, 0]], dtype=torch.bool)
    loss, _ = policy_loss(logp, logp.detach(), _t([2.0, -1.0]), mask, PolicyLossConfig())
    _close(loss, (-2.0 + 1.0) / 2)  # on-policy ratio 1: -(mean_t A_i) averaged over the two sequences

