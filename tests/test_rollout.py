"""The native rollout engine against transformers' generate and against teacher-forced scoring."""

import copy

import pytest
import torch
from hf_reference import hf_prompt_kwargs
from transformers import Qwen2_5_VLForConditionalGeneration

import torchplex.data.batching as batching
from torchplex.data.batching import collate, encode_visuals
from torchplex.rollout.engine import RolloutEngine
from torchplex.rollout.kv_pool import PoolTooSmallError
from torchplex.rollout.sampling import SamplingParams, processed_logprobs

RTOL = 1e-5


@pytest.fixture(scope="module")
def setup(rollout_prompts):
    return rollout_prompts


def teacher_forced(model, prompt, tokens, params):
    with torch.no_grad():
        batch = collate(model.args, [prompt], [tokens])
        image, video = encode_visuals(model, batch)
        hidden = model(batch.input_ids, batch.position_ids, image_embeds=image, video_embeds=video,
                       prompt_lengths=batch.prompt_lengths)
        start = len(prompt.input_ids) - 1
        logp = processed_logprobs(model.logits(hidden[0, start:start + len(tokens)]), params)
        return logp.gather(-1, torch.tensor(tokens)[:, None]).squeeze(-1)


@pytest.fixture(scope="module")
def hf(tiny_ckpt):
    return Qwen2_5_VLForConditionalGeneration.from_pretrained(tiny_ckpt, dtype=torch.float32).eval()


def hf_kwargs(hf, prompt) -> dict:
    return hf_prompt_kwargs(prompt, hf.config.image_token_id, hf.config.video_token_id)


def test_greedy_matches_transformers_generate(setup, hf):
    """Issue 16 defect 4: transformers gets mm_token_type_ids, so its generate lays out M-RoPE positions (its
    rope_deltas are then non-zero for an image prompt) instead of silently using 1-D ones."""
    processor, model, prompts, eos = setup
    params = SamplingParams(greedy=True, max_new_tokens=16, stop_token_ids=[eos])
    engine = RolloutEngine(model, kv_pool_bytes=8 * 2**20)
    outputs = engine.generate(prompts, params)
    for prompt, out in zip(prompts, outputs):
        with torch.no_grad():
            ref = hf.generate(**hf_kwargs(hf, prompt), max_new_tokens=16, do_sample=False, eos_token_id=eos,
                              pad_token_id=eos)
        assert (hf.model.rope_deltas != 0).any().item() == (prompt.pixel_values is not None)
        ref_tokens = ref[0, len(prompt.input_ids):].tolist()
        assert out[0].token_ids == ref_tokens
        assert out[0].finish_reason == ("stop" if ref_tokens[-1] == eos else "length")


def prompt_logits(model, prompt) -> torch.Tensor:
    """Our logits over a prompt, positions from collate (the rule the engine, scorer and trainer all use)."""
    batch = collate(model.args, [prompt])
    image, video = encode_visuals(model, batch)
    return model.logits(model(batch.input_ids, batch.position_ids, image_embeds=image, video_embeds=video))[0]


def rel_err(a, b) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def one_d_positions(args, input_ids, image_grid_thw=None, video_grid_thw=None, second_per_grid_ts=None,
                    attention_mask=None):
    """A wrong rule: every token one step after the previous on all three axes, as for text."""
    mask = attention_mask.long() if attention_mask is not None else torch.ones_like(input_ids)
    positions = (mask.cumsum(-1) - 1).clamp_min(0) * mask
    return positions.expand(3, -1, -1).clone(), mask.sum(-1)


def test_prompt_logits_match_transformers_given_mm_token_type_ids(setup, hf):
    _, model, prompts, _ = setup
    with torch.no_grad():
        for prompt in prompts:
            assert rel_err(prompt_logits(model, prompt), hf(**hf_kwargs(hf, prompt)).logits[0]) < 1e-4


def test_parity_with_transformers_fails_for_a_wrong_position_rule(setup, hf, monkeypatch):
    """Issue 16 defect 4: the comparison above must be able to see a position bug. With our rope index replaced
    by 1-D positions, every image prompt's logits leave transformers' by more than 10x the 1e-4 tolerance (measured
    6e-3..9e-3 on the tiny checkpoint)."""
    _, model, prompts, _ = setup
    monkeypatch.setattr(batching, "get_rope_index", one_d_positions)
    with torch.no_grad():
        errors = [rel_err(prompt_logits(model, p), hf(**hf_kwargs(hf, p)).logits[0])
                  for p in prompts if p.pixel_values is not None]
    assert min(errors) > 1e-3, errors


def test_transformers_without_mm_token_type_ids_cannot_see_the_wrong_rule(setup, hf, monkeypatch):
    """Why defect 4 hid bugs: called without mm_token_type_ids (as the old comparison did), transformers falls back to
    1-D positions, so the wrong 1-D rule matches it and the correct rule does not."""
    _, model, prompts, _ = setup
    prompt = prompts[2]  # one 84x112 image
    kwargs = {k: v for k, v in hf_kwargs(hf, prompt).items() if k != "mm_token_type_ids"}
    with torch.no_grad():
        ref = hf(**kwargs).logits[0]
        correct = prompt_logits(model, prompt)
        monkeypatch.setattr(batching, "get_rope_index", one_d_positions)
        wrong = prompt_logits(model, prompt)
    assert rel_err(wrong, ref) < 1e-4 < rel_err(correct, ref)


def test_logprobs_equal_teacher_forced_scoring_with_temperature_top_p_top_k(setup):
    _, model, prompts, eos = setup
    params = SamplingParams(n=3, temperature=0.7, top_p=0.9, top_k=40, max_new_tokens=12, stop_token_ids=[eos], seed=5)
    outputs = RolloutEngine(model, kv_pool_bytes=8 * 2**20).generate(prompts, params)
    for prompt, group in zip(prompts, outputs):
        assert len(group) == 3
        for out in group:
            ref = teacher_forced(model, prompt, out.token_ids, params)
            ours = torch.tensor(out.logprobs)
            assert ((ours - ref).abs() / ref.abs().clamp_min(1e-3)).max().item() < RTOL


def test_n8_holds_prompt_once_and_equals_sampling_each_alone(setup):
    _, model, prompts, eos = setup
    prompt = prompts[0]
    params = SamplingParams(n=8, temperature=1.0, max_new_tokens=10, stop_token_ids=[eos], seed=11)
    engine = RolloutEngine(model, kv_pool_bytes=8 * 2**20)
    group = engine.generate([prompt], params)[0]
    assert engine.stats.max_prefix_tokens_stored == len(prompt.input_ids)  # once, not 8 times
    assert len({tuple(o.token_ids) for o in group}) > 1, "8 samples at temperature 1 should differ"
    seeds = [11 * 1_000_003 + j for j in range(8)]
    for j, out in enumerate(group):
        alone = RolloutEngine(model, kv_pool_bytes=8 * 2**20).generate(
            [prompt], SamplingParams(n=1, temperature=1.0, max_new_tokens=10, stop_token_ids=[eos]),
            sample_seeds=[[seeds[j]]])[0][0]
        assert alone.token_ids == out.token_ids
        assert torch.allclose(torch.tensor(alone.logprobs), torch.tensor(out.logprobs), rtol=RTOL, atol=1e-6)


def test_continuous_batching_with_a_pool_smaller_than_the_batch(setup):
    """A pool with room for one group still serves four prompts, in turn, with the same results."""
    _, model, prompts, eos = setup
    params = SamplingParams(n=2, temperature=0.9, max_new_tokens=8, stop_token_ids=[eos], seed=3)
    big = RolloutEngine(model, kv_pool_bytes=8 * 2**20).generate(prompts, params)
    small_engine = RolloutEngine(model, kv_pool_bytes=8 * 2**20, max_batch=2)
    small = small_engine.generate(prompts, params)
    assert small_engine.pool.num_groups == 1 and small_engine.stats.prefills == len(prompts)
    assert [[o.token_ids for o in g] for g in small] == [[o.token_ids for o in g] for g in big]


def test_request_that_can_never_fit_fails_clearly(setup):
    _, model, prompts, _ = setup
    engine = RolloutEngine(model, kv_pool_bytes=1024)
    with pytest.raises(PoolTooSmallError, match="kv_pool_gib"):
        engine.generate(prompts[:1], SamplingParams(max_new_tokens=8))


def test_decode_window_callback_and_pool_release(setup):
    _, model, prompts, eos = setup
    engine = RolloutEngine(model, kv_pool_bytes=8 * 2**20)
    steps = []
    params = SamplingParams(n=2, max_new_tokens=6, seed=1)
    first = engine.generate(prompts[:2], params, on_step=steps.append)
    assert [s.step for s in steps] == list(range(1, len(steps) + 1)) and len(steps) >= 5
    assert engine.pool.allocated_bytes > 0
    engine.release()
    assert engine.pool.allocated_bytes == 0
    again = engine.generate(prompts[:2], params)
    assert [[o.token_ids for o in g] for g in again] == [[o.token_ids for o in g] for g in first]


def test_flex_decode_kernel_equals_matmul_kernel(setup):
    """The flex-attention decode path (prompt once per group + own tokens, merged by log-sum-exp) samples the same
    tokens with the same log-probs as the joint-softmax matmul path; prompts of different lengths, n=3."""
    _, model, prompts, eos = setup
    params = SamplingParams(n=3, temperature=0.8, top_p=0.95, max_new_tokens=9, stop_token_ids=[eos], seed=2)
    ref = RolloutEngine(model, kv_pool_bytes=8 * 2**20, decode_kernel="matmul").generate(prompts, params)
    flex = RolloutEngine(model, kv_pool_bytes=8 * 2**20, decode_kernel="flex").generate(prompts, params)
    for g_ref, g_flex in zip(ref, flex):
        for a, b in zip(g_ref, g_flex):
            assert a.token_ids == b.token_ids
            assert torch.allclose(torch.tensor(a.logprobs), torch.tensor(b.logprobs), rtol=RTOL, atol=1e-6)


def test_unknown_decode_kernel_is_named():
    with pytest.raises(ValueError, match="decode_kernel.*'cuda'"):
        RolloutEngine(torch.nn.Linear(2, 2), kv_pool_bytes=1, decode_kernel="cuda")


@pytest.mark.slow
def test_compiled_decode_step_equals_eager(setup):
    """torch.compile of the whole decode step (what CUDA runs before graph capture; here inductor's CPU backend, with
    the matmul kernel: CPU flex has no log-sum-exp output) samples the same tokens as eager with log-probs equal to
    teacher-forced scoring."""
    _, model, prompts, eos = setup
    params = SamplingParams(n=2, temperature=0.9, top_k=50, max_new_tokens=6, stop_token_ids=[eos], seed=4)
    eager = RolloutEngine(model, kv_pool_bytes=8 * 2**20).generate(prompts[:2], params)
    engine = RolloutEngine(model, kv_pool_bytes=8 * 2**20, compile_decode=True)
    assert engine.use_compile and engine.decode_kernel == "matmul"
    compiled = engine.generate(prompts[:2], params)
    assert [[o.token_ids for o in g] for g in compiled] == [[o.token_ids for o in g] for g in eager]
    for prompt, group in zip(prompts, compiled):
        for out in group:
            ref = teacher_forced(model, prompt, out.token_ids, params)
            assert ((torch.tensor(out.logprobs) - ref).abs() / ref.abs().clamp_min(1e-3)).max().item() < 1e-4


def test_decode_step_is_reused_across_seeds_and_pool_release(setup):
    """A new seed per GRPO step and the pool's release between rollouts keep the same decode step (its compiled
    pieces; on CUDA only its graphs are captured again): recompiling per step would cost seconds each time."""
    _, model, prompts, eos = setup
    engine = RolloutEngine(model, kv_pool_bytes=8 * 2**20)
    engine.generate(prompts[:2], SamplingParams(n=2, max_new_tokens=3, seed=1))
    step = engine.decode_step(SamplingParams(n=2, max_new_tokens=3, seed=1))
    engine.release()
    engine.generate(prompts[:2], SamplingParams(n=2, max_new_tokens=3, seed=2))
    assert engine.decode_step(SamplingParams(n=2, max_new_tokens=3, seed=2)) is step
    engine.generate(prompts[:2], SamplingParams(n=2, max_new_tokens=3, seed=2, temperature=0.5))
    assert engine.decode_step(SamplingParams(n=2, max_new_tokens=3, temperature=0.5)) is not step  # other sampling


def test_on_samples_finished_reports_every_sample_once_as_it_finishes(setup):
    processor, model, prompts, eos = setup
    vocab = model.args.text.vocab_size
    params = SamplingParams(n=3, max_new_tokens=12, stop_token_ids=list(range(vocab // 2, vocab)), seed=5)
    engine = RolloutEngine(model, kv_pool_bytes=8 * 2**20)
    reported = []
    outputs = engine.generate(prompts, params, on_samples_finished=lambda outs: reported.append(
        (list(outs), engine.stats.decode_steps)))
    flat = [(o, step) for outs, step in reported for o in outs]
    assert sorted((o.prompt_index, o.sample_index) for o, _ in flat) == [(i, j) for i in range(4) for j in range(3)]
    for o, step in flat:
        assert o is outputs[o.prompt_index][o.sample_index]
        assert len(o.token_ids) <= step + 1
    # samples of one prompt were reported at different steps: scoring need not wait for the group's slowest
    steps = {}
    for o, step in flat:
        steps.setdefault(o.prompt_index, set()).add(step)
    assert any(len(v) > 1 for v in steps.values())


def test_fused_qkv_decode_equals_separate_projections_and_follows_weight_updates(setup):
    """The decode step's fused q/k/v copy gives the three projections' tokens and log-probs (fp32, rel 1e-5), and
    is refreshed from the weights at every generate (an optimizer step in between changes nothing)."""
    processor, model, prompts, eos = setup
    params = SamplingParams(n=2, temperature=0.9, max_new_tokens=10, stop_token_ids=[eos], seed=4)
    trained = copy.deepcopy(model)
    fused = RolloutEngine(trained, kv_pool_bytes=8 * 2**20, fused_qkv=True)
    for update in range(2):
        if update:  # an update of the weights after the first rollout
            with torch.no_grad():
                for p in trained.parameters():
                    p.add_(torch.randn_like(p) * 0.02)
        want = RolloutEngine(copy.deepcopy(trained), kv_pool_bytes=8 * 2**20).generate(prompts, params)
        got = fused.generate(prompts, params)
        for w_group, g_group in zip(want, got):
            for w, g in zip(w_group, g_group):
                assert g.token_ids == w.token_ids
                lw, lg = torch.tensor(w.logprobs), torch.tensor(g.logprobs)
                assert ((lg - lw).abs().max() / lw.abs().max()).item() < RTOL
    assert all(layer.attention.qkv_copy is not None for layer in trained.layers)
    assert not any("qkv_copy" in name for name, _ in trained.named_parameters())
    assert not RolloutEngine(model, kv_pool_bytes=2**20).fused_qkv  # the default fuses only compiled CUDA decode
