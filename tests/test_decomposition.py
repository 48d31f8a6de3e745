"""Decomposed scoring/training must reproduce the serial step: log-probs, KL, loss and every gradient."""

import copy

import pytest
import torch

from torchplex.rl.advantages import compute_advantages
from torchplex.rl.losses import PolicyLossConfig
from torchplex.rollout.engine import RolloutEngine
from torchplex.rollout.sampling import SamplingParams
from torchplex.runtime.decomposition import DecomposedScorer
from torchplex.runtime.experience import (Experience, MicroBatchLimits, kl_to_reference, micro_batches,
                                         reference_phase)
from torchplex.runtime.training import train_phase
from torchplex.runtime.scoring import SerialScorer

RTOL = 1e-5


class RecordingSGD(torch.optim.SGD):
    """SGD that keeps a copy of every gradient it applies, by parameter name."""

    def __init__(self, model, lr=0.05):
        self.names = {p: n for n, p in model.named_parameters()}
        super().__init__([p for p in model.parameters() if p.requires_grad], lr=lr)
        self.records = []

    def step(self, closure=None):
        self.records.append({self.names[p]: p.grad.clone() for g in self.param_groups for p in g["params"]
                             if p.grad is not None})
        return super().step(closure)


@pytest.fixture(scope="module")
def assets(grpo_assets):
    return grpo_assets.prompts, grpo_assets.actor, grpo_assets.reference, grpo_assets.eos_id


def make_experience(prompts, model, group, eos, seed=0):
    params = SamplingParams(n=group, temperature=1.0, max_new_tokens=10, stop_token_ids=[eos], seed=seed)
    outputs = RolloutEngine(model, kv_pool_bytes=16 * 2**20).generate(prompts, params)
    flat = [o for g in outputs for o in g]
    width = max(len(o.token_ids) for o in flat)
    tokens = torch.zeros(len(flat), width, dtype=torch.long)
    for s, o in enumerate(flat):
        tokens[s, :len(o.token_ids)] = torch.tensor(o.token_ids)
    rewards = torch.rand(len(flat), generator=torch.Generator().manual_seed(seed))
    return Experience(prompts=prompts, answers=[""] * len(prompts), group_size=group, tokens=tokens,
                      lengths=torch.tensor([len(o.token_ids) for o in flat]), sampling_logprobs=torch.zeros(tokens.shape),
                      finish_reasons=[o.finish_reason for o in flat], texts=[""] * len(flat), rewards=rewards,
                      reward_parts={}, correct=[False] * len(flat), advantages=compute_advantages(rewards, group),
                      keep_groups=torch.ones(len(prompts), dtype=torch.bool))


def run_step(model, reference, scorer, exp, micro_batch_size, ppo_epochs, whole_groups, cfg=None, tokens=0):
    """The reference and training phases at `micro_batch_size` sequences (0: no bound) and `tokens` per micro-batch
    (0: no bound), whole groups where they fit (the prefix modes) or samples alone (serial)."""
    exp = copy.copy(exp)
    exp.ref_logprobs = exp.old_logprobs = None
    limits = MicroBatchLimits(tokens, micro_batch_size, whole_groups)
    reference_phase(reference, scorer, exp, 1.0, limits)
    optimizer = RecordingSGD(model)
    cfg = cfg or PolicyLossConfig(clip_low=0.2, clip_high=0.28, kl_coef=0.1, kl_estimator="k3")
    result = train_phase(model, scorer, exp, optimizer, None, cfg, temperature=1.0, limits=limits,
                         ppo_epochs=ppo_epochs, grad_clip=1e9, max_len=10)
    return exp, result, optimizer.records


def rel(a, b):
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


@pytest.mark.parametrize("frozen_vision,group,micro_batch_size,ppo_epochs", [
    (False, 4, 4, 1), (True, 4, 4, 1), (False, 8, 8, 2), (True, 1, 2, 2), (False, 1, 16, 1), (True, 8, 16, 1),
    (False, 4, 2, 1), (True, 4, 3, 2),  # micro-batches smaller than a group: the groups are cut
])
def test_decomposed_step_equals_serial_step(assets, frozen_vision, group, micro_batch_size, ppo_epochs):
    prompts, base, reference, eos = assets
    exp = make_experience(prompts, base, group, eos, seed=group)
    models = [copy.deepcopy(base) for _ in range(2)]
    for m in models:
        m.visual.requires_grad_(not frozen_vision)
    serial_exp, serial, serial_grads = run_step(models[0], reference, SerialScorer(), exp, micro_batch_size,
                                                ppo_epochs, whole_groups=False)
    scorer = DecomposedScorer()
    dec_exp, dec, dec_grads = run_step(models[1], reference, scorer, exp, micro_batch_size, ppo_epochs,
                                       whole_groups=True)
    mask = exp.mask
    assert rel(dec_exp.ref_logprobs[mask], serial_exp.ref_logprobs[mask]) < RTOL
    assert rel(dec_exp.old_logprobs[mask], serial_exp.old_logprobs[mask]) < RTOL
    assert abs(kl_to_reference(dec_exp, "k3") - kl_to_reference(serial_exp, "k3")) <= RTOL * abs(kl_to_reference(serial_exp, "k3"))
    assert rel(dec.stats.loss, serial.stats.loss) < RTOL
    assert len(dec_grads) == len(serial_grads) == ppo_epochs
    for epoch in range(ppo_epochs):
        assert set(dec_grads[epoch]) == set(serial_grads[epoch])
        assert any(n.startswith("visual.") for n in serial_grads[epoch]) != frozen_vision
        for name, g in serial_grads[epoch].items():
            assert rel(dec_grads[epoch][name], g) < RTOL, (epoch, name)


def test_checkpointed_prefix_gives_the_same_gradients(assets):
    """Activation checkpointing of the prefix recomputes it in backward instead of holding it: same numbers."""
    prompts, base, reference, eos = assets
    exp = make_experience(prompts, base, 4, eos, seed=7)
    models = [copy.deepcopy(base) for _ in range(2)]
    _, held, held_grads = run_step(models[0], reference, DecomposedScorer(), exp, 8, 1, whole_groups=True)
    _, ckpt, ckpt_grads = run_step(models[1], reference, DecomposedScorer(checkpoint_prefix=True), exp, 8, 1,
                                   whole_groups=True)
    assert rel(ckpt.stats.loss, held.stats.loss) < 1e-6
    for name, g in held_grads[0].items():
        assert rel(ckpt_grads[0][name], g) < 1e-6, name


def test_frozen_vision_tower_encodes_each_prompt_once_per_step(assets):
    prompts, base, reference, eos = assets
    exp = make_experience(prompts, base, 4, eos)
    actor = copy.deepcopy(base)
    actor.visual.requires_grad_(False)
    ref = copy.deepcopy(reference)
    ref.visual = actor.visual  # a frozen tower is shared by actor and reference
    scorer = DecomposedScorer()
    RolloutEngine(actor, kv_pool_bytes=16 * 2**20).generate(prompts, SamplingParams(n=4, max_new_tokens=4),
                                                            prefill_fn=scorer.rollout_prefill(actor))
    run_step(actor, ref, scorer, exp, 8, 1, whole_groups=True)
    assert scorer.vision.encodes == sum(1 for p in prompts if p.pixel_values is not None)


def test_a_trainable_tower_prefix_collates_its_prompts_once(assets, monkeypatch):
    """The prefix of a trainable tower's prompts collates (copies, uploads) their pixels once: it used to collate them
    again for the tower, a second copy and upload of every pixel (~0.6 GB per 32 image prompts)."""
    from torchplex.runtime import decomposition

    prompts, base, _, _ = assets
    calls = []
    real = decomposition.collate
    monkeypatch.setattr(decomposition, "collate", lambda *a, **k: calls.append(1) or real(*a, **k))
    state, _ = DecomposedScorer().prefix(base, prompts)  # with grad: the tower trains (the training forward)
    assert len(calls) == 1 and state.batch_size == len(prompts) and state.k[0].requires_grad


def test_frozen_tower_encodes_the_uncached_prompts_together(assets, monkeypatch):
    """A frozen (or no-grad) tower encodes the prompts it has not cached in one batched call, not one call per
    prompt (host-bound at 7B); each prompt's embeddings equal its own encoding (fp32, 1e-5), and a cached prompt is
    not encoded again."""
    from torchplex.runtime import decomposition

    prompts, base, _, _ = assets
    images = [p for p in prompts if p.pixel_values is not None]
    assert len(images) >= 2
    calls = []
    real = base.encode_vision
    monkeypatch.setattr(base, "encode_vision", lambda pix, grid: calls.append(pix.shape[0]) or real(pix, grid))
    cache = decomposition.VisionCache()
    got = cache.get_many(base, prompts, "image")
    assert len(calls) == 1 and cache.encodes == len(images)
    with torch.no_grad():
        for p, e in zip(prompts, got):
            if p.pixel_values is None:
                assert e is None
            else:
                torch.testing.assert_close(e, real(p.pixel_values, p.image_grid_thw), rtol=1e-5, atol=1e-5)
    cache.get_many(base, prompts + prompts[:1], "image")
    assert len(calls) == 1  # all cached
    monkeypatch.setattr(decomposition, "BATCH_PATCHES", 1)  # a patch budget below one prompt: one call per prompt
    decomposition.VisionCache().get_many(base, prompts, "image")
    assert len(calls) == 1 + len(images)


def test_token_forwards_saving(assets):
    """P + G*R per prompt instead of G*(P+R)."""
    prompts, base, reference, eos = assets
    exp = make_experience(prompts, base, 8, eos)
    scorer = DecomposedScorer()
    with torch.no_grad():
        reference_phase(reference, scorer, exp, 1.0, MicroBatchLimits(0, 64, True))
    P = sum(len(p.input_ids) for p in prompts)
    R = int(exp.lengths.sum())
    assert scorer.counts.prefix_tokens == P and scorer.counts.response_tokens == R
    assert scorer.serial_equivalent_tokens == 8 * P + R


def by_sequences(samples, group, size, whole):
    """micro_batches at `size` sequences and no token bound."""
    return micro_batches(samples, group, MicroBatchLimits(0, size, whole), [1] * (max(samples) + 1))


def test_micro_batch_size_bounds_sequences_in_every_mode():
    """Issue 16 defect 5: micro_batch_size bounds sequences per micro-batch also with whole groups (main: max(1,
    micro_batch_size // group) groups, so 4 with groups of 8 ran 8 sequences): at most micro_batch_size, exactly
    when it is a multiple of the group size; a group larger than it is cut into pieces of that size."""
    samples = list(range(16))
    for mbs in (1, 2, 3, 4, 5, 8, 12, 16):
        for whole in (False, True):
            batches = by_sequences(samples, 8, mbs, whole)
            assert [s for b in batches for s in b] == samples
            assert max(len(b) for b in batches) <= mbs
    assert by_sequences(samples, 8, 4, True) == [samples[0:4], samples[4:8], samples[8:12], samples[12:16]]
    assert by_sequences(samples, 8, 3, True) == [[0, 1, 2], [3, 4, 5], [6, 7], [8, 9, 10], [11, 12, 13], [14, 15]]
    assert by_sequences(samples, 4, 8, True) == [samples[0:8], samples[8:16]]
    assert by_sequences(samples, 4, 6, True) == [samples[i:i + 4] for i in range(0, 16, 4)]  # groups stay whole


def test_micro_batches_by_tokens_pack_groups_cut_the_long_ones_and_keep_every_sample_once():
    """Issue 49: a token budget packs several groups into a micro-batch where they fit, cuts a group over it into
    pieces (the last piece packed with the groups after it), and cuts serial's samples alone; a sample over the
    budget runs alone."""
    cut = lambda samples, costs, tokens, seqs=0, whole=True: micro_batches(samples, 4, MicroBatchLimits(
        tokens, seqs, whole), costs)
    two = [2] * 12  # groups of 8 tokens
    assert cut(range(12), two, 16) == [list(range(8)), list(range(8, 12))]
    assert cut(range(12), two, 10) == [list(range(4)), list(range(4, 8)), list(range(8, 12))]
    assert cut(range(12), two, 16, seqs=6) == [list(range(4)), list(range(4, 8)), list(range(8, 12))]
    assert cut(range(8), [3, 3, 3, 3, 1, 1, 1, 1], 9) == [[0, 1, 2], [3, 4, 5, 6, 7]]
    assert cut(range(8), [3, 3, 3, 3, 1, 1, 1, 1], 9, whole=False) == [[0, 1, 2], [3, 4, 5, 6, 7]]
    assert cut(range(4), [20, 1, 1, 1], 5) == [[0], [1, 2, 3]]  # longer than the budget: alone
    g = torch.Generator().manual_seed(0)
    for trial in range(200):
        costs = torch.randint(1, 12, (16,), generator=g).tolist()
        samples = [s for s in range(16) if torch.rand(1, generator=g).item() > 0.2]
        tokens, seqs = int(torch.randint(1, 40, (1,), generator=g)), [0, 3, 8][trial % 3]
        for whole in (False, True):
            batches = cut(samples, costs, tokens, seqs, whole)
            assert [s for b in batches for s in b] == samples  # in order, none dropped or repeated
            for b in batches:
                assert len(b) == 1 or sum(costs[s] for s in b) <= tokens
                assert not seqs or len(b) <= seqs
            if whole:  # a group within the limits is never cut
                for first in range(0, 16, 4):
                    group = [s for s in samples if s // 4 == first // 4]
                    if group and sum(costs[s] for s in group) <= tokens and (not seqs or len(group) <= seqs):
                        assert sum(1 for b in batches if set(group) & set(b)) == 1


@pytest.mark.parametrize("scorer_kind,micro_batch_size", [("serial", 3), ("decomposed", 4), ("decomposed", 2)])
def test_entropy_bonus_trains_and_subtracts_coef_times_entropy(assets, scorer_kind, micro_batch_size):
    """Issue 16 defect 5: algorithm.entropy_coef > 0 crashed on main (train_phase never passed the entropy to
    policy_loss). With token-mean aggregation the step's loss is the coefficient-0 loss minus coef * the logged mean
    entropy, in serial and decomposed scoring, over two PPO epochs; the bonus has a gradient (the weights' gradients
    change), and decomposed equals serial with it."""
    prompts, base, reference, eos = assets
    exp = make_experience(prompts, base, 4, eos, seed=5)
    whole = scorer_kind == "decomposed"
    results = {}
    for coef in (0.0, 0.05):
        cfg = PolicyLossConfig(loss_agg="token-mean", kl_coef=0.1, entropy_coef=coef)
        scorer = DecomposedScorer() if whole else SerialScorer()
        _, result, grads = run_step(copy.deepcopy(base), reference, scorer, exp, micro_batch_size, 2, whole, cfg)
        results[coef] = result, grads
    (plain, plain_grads), (bonus, bonus_grads) = results[0.0], results[0.05]
    assert bonus.entropy == pytest.approx(plain.entropy, rel=1e-6) and bonus.entropy > 0
    # loss = pg + kl_coef * KL - entropy_coef * H, every term token-mean (the stats are the last epoch's)
    assert plain.stats.entropy is None and bonus.stats.entropy is not None
    extra = bonus.stats.loss - bonus.stats.pg_loss - 0.1 * bonus.stats.kl
    torch.testing.assert_close(extra, -0.05 * bonus.stats.entropy, rtol=1e-5, atol=1e-7)
    torch.testing.assert_close(plain.stats.loss - plain.stats.pg_loss - 0.1 * plain.stats.kl, torch.tensor(0.0),
                               rtol=0, atol=1e-7)
    changed = [n for n in plain_grads[0] if not torch.allclose(plain_grads[0][n], bonus_grads[0][n], atol=1e-9)]
    assert changed, "the entropy bonus has no gradient"
    if whole:
        _, serial, serial_grads = run_step(copy.deepcopy(base), reference, SerialScorer(), exp, micro_batch_size, 2,
                                           False, PolicyLossConfig(loss_agg="token-mean", kl_coef=0.1,
                                                                   entropy_coef=0.05))
        assert rel(bonus.stats.loss, serial.stats.loss) < RTOL
        for epoch in range(2):
            for name, g in serial_grads[epoch].items():
                assert rel(bonus_grads[epoch][name], g) < RTOL, (epoch, name)
