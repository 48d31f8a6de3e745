"""The decode ladder (rollout/ladder.py): every decode step runs the smallest rung of row counts that holds the live
samples, each row decoding one slot of the KV pool in place. The reference is the full-pool path, a ladder of the
one rung "every slot" (the row map is then the identity: every slot decodes at every step, finished ones included,
as the engine did before the ladder): the same tokens, and fp32 log-probs within 1e-6."""

import pytest
import torch
from torch._dynamo.eval_frame import _debug_get_cache_entry_list

from torchplex.rollout import decode_attention, decode_step
from torchplex.rollout.decode_step import DecodePieces
from torchplex.rollout.engine import PoolFloor, RolloutEngine
from torchplex.rollout.ladder import pool_ladder, row_map, rows_for
from torchplex.rollout.sampling import SamplingParams

POOL = 8 * 2**20
FULL_POOL = ()  # the ladder whose one rung is every slot of the pool


@pytest.fixture(scope="module")
def setup(rollout_prompts):
    _, model, prompts, eos = rollout_prompts
    return model, prompts, eos


def long_tailed(model, eos, n=3, max_new=14, seed=7):
    """Sampling under which responses end at many lengths: a quarter of the vocabulary stops a sample."""
    vocab = model.args.text.vocab_size
    return SamplingParams(n=n, temperature=1.0, max_new_tokens=max_new, seed=seed,
                          stop_token_ids=[eos, *range(vocab - vocab // 4, vocab)])


def generate(model, prompts, params, **engine_args):
    """(outputs, each step's rows, the engine) of one rollout."""
    engine = RolloutEngine(model, kv_pool_bytes=POOL, **engine_args)
    rows = []
    outputs = engine.generate(prompts, params, on_step=lambda info: rows.append(info.rows))
    return outputs, rows, engine


def assert_same_samples(got, want):
    """Same tokens and finish reasons per (prompt, sample); fp32 log-probs within 1e-6."""
    assert [[(o.prompt_index, o.sample_index, o.token_ids, o.finish_reason) for o in g] for g in got] == \
        [[(o.prompt_index, o.sample_index, o.token_ids, o.finish_reason) for o in g] for g in want]
    for g_got, g_want in zip(got, want):
        for a, b in zip(g_got, g_want):
            torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), rtol=1e-6, atol=1e-6)


# ---- the ladder and the row map -------------------------------------------------------------------------
def test_a_pools_rungs_are_the_sizes_below_its_slots_then_its_slots():
    assert pool_ladder(512) == (8, 16, 32, 64, 128, 192, 256, 384, 512)
    assert pool_ladder(300) == (8, 16, 32, 64, 128, 192, 256, 300)
    assert pool_ladder(12, (16, 4, 8, 4)) == (4, 8, 12) and pool_ladder(12, ()) == (12,)
    assert [rows_for(live, (4, 8, 12)) for live in (0, 1, 4, 5, 8, 9, 12)] == [4, 4, 4, 8, 8, 12, 12]
    with pytest.raises(ValueError, match="13 live samples"):
        rows_for(13, (4, 8, 12))


def test_rows_hold_the_live_slots_first_then_scratch_rows_on_a_slot_outside_them():
    m = row_map([1, 2, 5], 8, (4, 8))
    assert m.slot_of_row == (1, 2, 5, 0) and m.live == 3 and m.scratch == 0 and m.rows == 4
    m = row_map([0, 1, 2, 5, 6], 8, (4, 8))  # the top rung: every slot is its own row
    assert m.slot_of_row == tuple(range(8)) and m.live == 8 and m.scratch is None
    assert row_map([0, 1, 3], 4, (1, 2, 4)).slot_of_row == (0, 1, 2, 3)


# ---- the attention in the pool's layout -------------------------------------------------------------------
def pool_attention_case(kernel):
    """Three groups of two slots: group 0 with a 5-token prompt, group 1 free (no prompt), group 2 with 200 tokens
    (two of flex's 128-key blocks, the second partial). Rows: slots 0, 4, 5 live, two scratch rows on slot 3 (free
    group, unmapped sibling slot 2)."""
    torch.manual_seed(0)
    groups, n, hkv, heads, dim, max_prompt, max_new = 3, 2, 2, 4, 16, 256, 8
    shape = decode_attention.PoolShape(groups, n, max_prompt, max_new, torch.float32, kernel)
    prefix_k, prefix_v = torch.randn(2, groups, hkv, max_prompt, dim).unbind(0)
    suffix_k, suffix_v = torch.randn(2, groups * n, hkv, max_new, dim).unbind(0)
    prompt_len = torch.tensor([5, 0, 200])
    slot_of_row, write_at = torch.tensor([0, 4, 5, 3, 3]), torch.tensor([2, 0, 6, 0, 0])
    q = torch.randn(5, heads, 1, dim)
    k, v = torch.randn(2, 5, hkv, 1, dim).unbind(0)
    return shape, q, k, v, prefix_k, prefix_v, suffix_k, suffix_v, prompt_len, slot_of_row, write_at


def reference_row(q, prefix_k, prefix_v, suffix_k, suffix_v, prompt_len, write_at):
    """One row's attention by its definition: its group's prompt then its own tokens up to the new one."""
    keys = torch.cat([prefix_k[:, :prompt_len], suffix_k[:, :write_at + 1]], dim=1)  # (Hkv, L, D)
    values = torch.cat([prefix_v[:, :prompt_len], suffix_v[:, :write_at + 1]], dim=1)
    rep = q.shape[0] // keys.shape[0]
    scores = torch.einsum("hd,hld->hl", q[:, 0], keys.repeat_interleave(rep, 0)) * q.shape[-1] ** -0.5
    return torch.einsum("hl,hld->hd", scores.softmax(-1), values.repeat_interleave(rep, 0))[:, None]


@pytest.mark.parametrize("kernel", ["matmul", "flex"])
def test_pool_attention_of_live_rows_is_their_own_and_nothing_is_nan(kernel):
    shape, q, k, v, pk, pv, sk, sv, prompt_len, slot_of_row, write_at = pool_attention_case(kernel)
    before_k = sk.clone()
    masks = decode_attention.attention_masks(shape, *decode_attention.slot_lengths(shape, slot_of_row, write_at,
                                                                                   prompt_len))
    out = decode_attention.attend(shape, q, k, v, pk, pv, sk, sv, slot_of_row, write_at, masks)
    assert torch.isfinite(out).all()  # scratch rows too, though slot 2 beside them has no keys at all
    for r in range(3):
        s = int(slot_of_row[r])
        torch.testing.assert_close(sk[s, :, write_at[r]], k[r, :, 0])
        want = reference_row(q[r], pk[s // 2], pv[s // 2], sk[s], sv[s], int(prompt_len[s // 2]), int(write_at[r]))
        torch.testing.assert_close(out[r], want, rtol=1e-5, atol=1e-5)
    changed = (sk != before_k).any(-1).any(1)  # (slot, position): what the step wrote
    assert changed.nonzero().tolist() == [[0, 2], [3, 0], [4, 0], [5, 6]]
    # every slot of the pool's layout is finite, slot 2 (no prompt, no own token) included: flex gives it 0
    q_slots = torch.zeros(6, *q.shape[1:]).index_put((slot_of_row,), q)
    slots = decode_attention.attend_slots(shape, q_slots, pk, pv, sk, sv, masks)
    assert torch.isfinite(slots).all()
    if kernel == "flex":
        assert (slots[2] == 0).all()


def test_a_group_no_row_maps_to_visits_no_kv_blocks():
    """flex's block lists: group 1 (free) and group 0 (live, but no row maps to it here) visit no prompt block,
    group 2 both of its blocks; unmapped slots no own block."""
    shape = decode_attention.PoolShape(3, 2, 256, 8, torch.float32, "flex")
    group_len, own_len = decode_attention.slot_lengths(shape, torch.tensor([4, 5, 4]), torch.tensor([1, 3, 1]),
                                                       torch.tensor([5, 0, 200]))
    assert group_len.tolist() == [0, 0, 200] and own_len.tolist() == [0, 0, 0, 0, 2, 4]
    masks = decode_attention.attention_masks(shape, group_len, own_len)
    prompt_partial, _, prompt_full, _ = masks[2:6]
    own_partial, _, own_full, _ = masks[6:10]
    assert (prompt_partial + prompt_full).flatten().tolist() == [0, 0, 2]
    assert (own_partial + own_full).flatten().tolist() == [0, 0, 0, 0, 1, 1]


# ---- whole rollouts -----------------------------------------------------------------------------------------
@pytest.mark.parametrize("kernel", ["matmul", "flex"])
def test_ladder_decode_samples_what_the_full_pool_decode_samples(setup, kernel):
    """Four prompts x 3 samples (12 slots), long-tailed: the steps run at 10, 6, 4, 2 and 1 rows (the smallest rung
    of 1, 2, 3, 4, 6, 8, 10, 12 over the live samples) where the full pool runs all 12, with the same samples."""
    model, prompts, eos = setup
    params = long_tailed(model, eos)
    full, full_rows, _ = generate(model, prompts, params, decode_kernel=kernel, ladder=FULL_POOL)
    got, rows, engine = generate(model, prompts, params, decode_kernel=kernel, ladder=(1, 2, 3, 4, 6, 8, 10))
    assert set(full_rows) == {12}
    assert rows == sorted(rows, reverse=True) and len(set(rows)) >= 4 and rows[-1] < 4  # several transitions
    assert_same_samples(got, full)
    assert engine.stats.decode_rows == {r: rows.count(r) for r in sorted(set(rows))}
    assert engine.stats.row_steps == sum(rows) < sum(full_rows)


def test_a_groups_samples_leave_the_rows_as_each_ends(setup):
    """One prompt x 4 samples of lengths 4, 2, 12 (max_new_tokens) and 1 (a stop token first, from the prefill):
    step t runs the smallest rung over the samples that still need a token, those longer than t; each sample is
    reported at the check right after its last token; the rest of the group decodes on against its prompt."""
    model, prompts, eos = setup
    params = long_tailed(model, eos, n=4, max_new=12, seed=7)
    want, _, _ = generate(model, prompts[:1], params, ladder=FULL_POOL)
    lengths = [len(o.token_ids) for o in want[0]]
    assert lengths == [4, 2, 12, 1]
    engine = RolloutEngine(model, kv_pool_bytes=POOL, ladder=(1, 2, 3))
    rows, reported = [], {}
    got = engine.generate(prompts[:1], params, on_step=lambda info: rows.append(info.rows),
                          on_samples_finished=lambda outs: reported.update(
                              (o.sample_index, engine.stats.decode_steps) for o in outs))
    assert rows == [rows_for(sum(L > t for L in lengths), (1, 2, 3, 4)) for t in range(1, max(lengths))]
    assert rows == [3, 2, 2] + [1] * 8
    assert reported == {j: L - 1 for j, L in enumerate(lengths)}
    assert_same_samples(got, want)


def test_prompts_are_admitted_into_freed_groups_while_the_rows_shrink(setup):
    """A pool of two groups for four prompts x 2 samples: the rows shrink as samples end and grow again when a
    waiting prompt takes a freed group slot; the samples are those of one pool holding every prompt at once."""
    model, prompts, eos = setup
    params = long_tailed(model, eos, n=2, max_new=12, seed=1)
    want, _, _ = generate(model, prompts, params, ladder=FULL_POOL)
    engine = RolloutEngine(model, kv_pool_bytes=POOL, max_batch=4, ladder=(1, 2, 3))
    steps = []
    got = engine.generate(prompts, params, on_step=lambda info: steps.append((info.rows, info.waiting_prompts)))
    assert engine.pool.num_groups == 2 and steps[0][1] == 2 and steps[-1][1] == 0  # two prompts waited at first
    grew = [i for i in range(1, len(steps)) if steps[i][0] > steps[i - 1][0] and steps[i][1] < steps[i - 1][1]]
    shrank = [i for i in range(1, len(steps)) if steps[i][0] < steps[i - 1][0]]
    assert grew and shrank and min(shrank) < max(grew)  # an admission after the rows had shrunk
    assert_same_samples(got, want)


def test_an_evaluation_decodes_on_the_training_pool(setup):
    """Greedy n = 1 and 2 samples of up to 8 tokens, after a rollout of 3 x 14: the same pool (its spare sample
    slots never decode), no new one, and the samples a fresh engine gives on a pool of the evaluation's own shape."""
    model, prompts, eos = setup
    engine = RolloutEngine(model, kv_pool_bytes=POOL)
    engine.generate(prompts, long_tailed(model, eos))
    pool, storage = engine.pool, engine.pool.suffix_k[0]
    for params in (SamplingParams(n=1, greedy=True, max_new_tokens=8, stop_token_ids=[eos]),
                   long_tailed(model, eos, n=2, max_new=8, seed=3)):
        rows = []
        got = engine.generate(prompts[:3], params, on_step=lambda info: rows.append(info.rows))
        assert engine.pool is pool and engine.pool.suffix_k[0] is storage
        assert max(rows) <= rows_for(3 * params.n, pool_ladder(pool.num_slots))
        assert_same_samples(got, RolloutEngine(model, kv_pool_bytes=POOL).generate(prompts[:3], params))


@pytest.mark.parametrize("kv_pool_bytes", [POOL, 0])
def test_an_evaluation_before_the_first_rollout_builds_the_training_pool(setup, kv_pool_bytes):
    """With the training rollout as the engine's least pool (the trainer's), a greedy evaluation of 2 prompts x 8
    tokens run first builds the pool of 4 prompts x 3 samples x 14 tokens, which training then reuses (one geometry:
    one compilation of the decode attention); its samples are those of an engine without the floor. Without it the
    training rollout needs a new pool."""
    model, prompts, eos = setup
    train = long_tailed(model, eos)
    evaluation = SamplingParams(n=1, greedy=True, max_new_tokens=8, stop_token_ids=[eos])
    floor = PoolFloor(n=train.n, max_new=train.max_new_tokens, prompts=len(prompts))
    engine = RolloutEngine(model, kv_pool_bytes=kv_pool_bytes, least_pool=floor)
    got = engine.generate(prompts[:2], evaluation)
    pool = engine.pool
    assert (pool.n, pool.max_new, pool.num_groups) == (train.n, train.max_new_tokens, len(prompts))
    assert_same_samples(got, RolloutEngine(model, kv_pool_bytes=kv_pool_bytes).generate(prompts[:2], evaluation))
    engine.release()  # as the runner does between a rollout and the next
    assert_same_samples(engine.generate(prompts, train),
                        RolloutEngine(model, kv_pool_bytes=kv_pool_bytes).generate(prompts, train))
    assert engine.pool is pool

    plain = RolloutEngine(model, kv_pool_bytes=kv_pool_bytes)
    plain.generate(prompts[:2], evaluation)
    first = plain.pool
    plain.generate(prompts, train)
    assert plain.pool is not first and (first.n, first.max_new) == (1, 8)


def cache_entries() -> dict[str, int]:
    pieces = (decode_step.step_in, decode_step.layer_in, decode_attention.attend, decode_step.layer_out,
              decode_step.layer_step, decode_step.step_out)
    return {fn.__name__: len(_debug_get_cache_entry_list(fn)) for fn in pieces}


@pytest.mark.slow
@pytest.mark.parametrize("kernel,backend,whole_layer", [("matmul", "inductor", False), ("flex", "aot_eager", False),
                                                        ("matmul", "aot_eager", True)])
def test_decode_pieces_compile_once_for_every_ladder_size_and_layer(setup, kernel, backend, whole_layer):
    """Compiled (inductor's CPU backend; flex, whose CPU lowering has no log-sum-exp, traced by dynamo and AOT
    autograd and run eagerly): one graph of each piece (or of the whole layer) serves every ladder size (12, 8, 4, 2
    rows) and every layer with the samples of the eager full pool; an evaluation on the training pool adds only a
    sampling graph."""
    model, prompts, eos = setup
    params = long_tailed(model, eos, max_new=10)
    want, _, _ = generate(model, prompts, params, decode_kernel=kernel, ladder=FULL_POOL)
    torch._dynamo.reset()
    engine = RolloutEngine(model, kv_pool_bytes=POOL, compile_decode=True, decode_kernel=kernel, ladder=(2, 4, 8))
    engine.pieces = DecodePieces(True, backend=backend, whole_layer=whole_layer)
    rows = []
    got = engine.generate(prompts, params, on_step=lambda info: rows.append(info.rows))
    assert set(rows) == {12, 8, 4, 2}
    assert_same_samples(got, want)
    layers = {"layer_step": 1} if whole_layer else {"layer_in": 1, "attend": 1, "layer_out": 1}
    expected = dict.fromkeys(("step_in", "layer_in", "attend", "layer_out", "layer_step", "step_out"), 0)
    assert cache_entries() == {**expected, "step_in": 1, "step_out": 1, **layers}
    engine.release()
    engine.generate(prompts[:2], SamplingParams(n=1, greedy=True, max_new_tokens=6, stop_token_ids=[eos]))
    assert cache_entries() == {**expected, "step_in": 1, "step_out": 2, **layers}
