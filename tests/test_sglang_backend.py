"""The SGLang rollout backend without SGLang's GPU runtime (issue 20): request building, output mapping, weight
names and buckets against the checkpoint's HF names, capabilities and the planner, start-up errors, the timeout.

SGLang is never imported here (its runtime needs a GPU); `fake_sglang.FakeSGLangEngine` stands in for
`sglang.Engine` with SGLang's formats and rules, and samples with the native engine as a reference.
"""

from __future__ import annotations

import importlib.util
import signal
import time

import pytest
import torch
from PIL import Image
from safetensors import safe_open

from fake_sglang import FakeSGLangEngine, SilentSGLangEngine, StuckSGLangEngine
from torchplex.data.processing import encode_prompt, load_processor
from torchplex.models.qwen2_5_vl.build import build_model
from torchplex.rollout.engine import RolloutEngine, SampleOutput
from torchplex.rollout.logprob_mismatch import logprob_mismatch
from torchplex.rollout.protocol import RolloutEngineProtocol
from torchplex.rollout.sampling import SamplingParams, sample_seeds
from torchplex.rollout.sglang_backend import engine as sgl_engine
from torchplex.rollout.sglang_backend.engine import (SGLangRolloutEngine, SGLangTimeoutError, SGLangUnavailableError,
                                                     build_sglang_engine, check_sglang_available)
from torchplex.rollout.sglang_backend.requests import build_requests, map_outputs, sampling_params_for
from torchplex.rollout.sglang_backend.weights import buckets, hf_parameters
from torchplex.runtime.plan import PlanOptions, StepShape, plan_step


@pytest.fixture(scope="module")
def prompts(tiny_ckpt):
    processor = load_processor(tiny_ckpt)
    rng = torch.Generator().manual_seed(0)
    image = Image.fromarray(torch.randint(0, 255, (56, 56, 3), generator=rng, dtype=torch.uint8).numpy())
    return [encode_prompt(processor, "How many circles are in the image?", images=[image]),
            encode_prompt(processor, "Say something about the colour red.")]


def checkpoint_names(ckpt) -> dict:
    with safe_open(str(ckpt / "model.safetensors"), "pt") as f:
        return {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}


# ---- requests and outputs -------------------------------------------------------------------------------------
def test_requests_are_one_seeded_request_per_sample_with_the_processor_output(prompts):
    params = SamplingParams(n=3, temperature=0.7, max_new_tokens=5, stop_token_ids=[7])
    seeds = sample_seeds(4, 3, range(2))
    reqs = build_requests(prompts, params, seeds)
    assert len(reqs) == 6 and all(isinstance(r["input_ids"][0], int) for r in reqs)  # single requests
    assert [r["sampling_params"]["sampling_seed"] for r in reqs] == seeds[0] + seeds[1]  # not n=3: distinct seeds
    assert all("n" not in r["sampling_params"] for r in reqs)
    assert reqs[0]["input_ids"] == prompts[0].input_ids.tolist() and reqs[3]["input_ids"] == prompts[1].input_ids.tolist()
    [item] = reqs[0]["image_data"]
    assert item["format"] == "processor_output"  # no second preprocessing: the very tensors of the processor
    assert item["pixel_values"] is prompts[0].pixel_values and item["image_grid_thw"] is prompts[0].image_grid_thw
    assert "image_data" not in reqs[3] and reqs[3]["return_logprob"] is True
    sp = reqs[0]["sampling_params"]
    assert (sp["temperature"], sp["top_p"], sp["top_k"], sp["max_new_tokens"], sp["stop_token_ids"]) == \
        (0.7, 1.0, -1, 5, [7])  # top_k 0 (off) is SGLang's -1
    assert sampling_params_for(SamplingParams(greedy=True), 1)["temperature"] == 0.0
    huge = [sampling_params_for(params, 2**64 + j)["sampling_seed"] for j in range(2)]  # SGLang's seeds are int64
    assert all(0 <= s < 2**63 for s in huge) and huge[0] != huge[1]
    with pytest.raises(ValueError, match="3 seeds"):
        build_requests(prompts, params, [[1, 2], [3, 4]])
    unseeded = build_requests(prompts, params, seeds, seeded=False)  # SGLang's fast configuration
    assert all("sampling_seed" not in r["sampling_params"] for r in unseeded)
    assert [{k: v for k, v in r["sampling_params"].items()} for r in unseeded] == \
        [{k: v for k, v in r["sampling_params"].items() if k != "sampling_seed"} for r in reqs]


def test_video_prompts_are_refused_not_dropped(prompts):
    video = type(prompts[0])(prompts[0].input_ids, pixel_values_videos=torch.zeros(4, 8),
                             video_grid_thw=torch.tensor([[1, 2, 2]]))
    with pytest.raises(NotImplementedError, match="video"):
        build_requests([video], SamplingParams(), [[0]])


def _answer(ids, lps, kind):
    return {"output_ids": ids, "meta_info": {"output_token_logprobs": [(lp, t, None) for lp, t in zip(lps, ids)],
                                             "finish_reason": {"type": kind, "matched": 7} if kind else None}}


def test_outputs_map_to_sample_records_prompt_major():
    answers = [_answer([5, 7], [-0.5, -1.0], "stop"), _answer([1, 2, 3], [-1, -2, -3], "length"),
               _answer([4], [-0.25], "length"), _answer([7], [-2.0], "stop")]
    out = map_outputs(answers, 2, 2)
    assert out[0][0] == SampleOutput(0, 0, [5, 7], [-0.5, -1.0], "stop")
    assert out[0][1] == SampleOutput(0, 1, [1, 2, 3], [-1.0, -2.0, -3.0], "length")
    assert out[1][1] == SampleOutput(1, 1, [7], [-2.0], "stop")
    with pytest.raises(RuntimeError, match="aborted"):
        map_outputs([_answer([1], [-1.0], "abort")], 1, 1)
    with pytest.raises(RuntimeError, match="3 requests, 4 were sent"):
        map_outputs(answers[:3], 2, 2)


def test_the_fake_refuses_what_sglang_refuses(tiny_ckpt, prompts):
    """The fake mirrors SGLang 0.5.17's request rules (each from the wheel, see fake_sglang.py), so a request our
    backend builds that SGLang would refuse fails here: a top_k of 0 (verify() wants -1 or >= 1), a key
    SamplingParams has no field for, an unknown generate() keyword, images as PIL or several processor
    outputs per request, image tokens that do not match the grid, an unknown memory tag."""
    fake = FakeSGLangEngine(model_path=str(tiny_ckpt), enable_deterministic_inference=True)
    params = SamplingParams(n=1, max_new_tokens=2)
    [ok] = build_requests(prompts[:1], params, [[0]])
    run = lambda **kw: fake.loop.run_until_complete(fake.async_generate(**{**ok, **kw}))
    assert run()["meta_info"]["finish_reason"]["type"] in ("stop", "length")  # ours is accepted
    sp = ok["sampling_params"]
    for bad in ({**sp, "top_k": 0}, {**sp, "seed": 1}, {**sp, "top_p": 0.0}, {**sp, "sampling_seed": 2**63}):
        with pytest.raises((TypeError, ValueError)):
            run(sampling_params=bad)
    with pytest.raises(TypeError, match="unexpected keyword"):
        run(return_logprobs=True)
    item = ok["image_data"][0]
    image = Image.new("RGB", (56, 56))
    for bad in ([image], [item, item], [{**item, "format": "pixel_values"}],
                [{**item, "image_grid_thw": item["image_grid_thw"][0]}]):
        with pytest.raises(ValueError):
            run(image_data=bad)
    pad = fake.model.args.image_token_id
    ids = ok["input_ids"]
    one_pad = [t for i, t in enumerate(ids) if t != pad or ids.index(pad) == i]  # the unexpanded prompt
    with pytest.raises(ValueError, match="image tokens"):
        run(input_ids=one_pad)
    with pytest.raises(ValueError, match="memory tags"):
        fake.release_memory_occupation(tags=["kv"])
    fake.shutdown()
    fast = FakeSGLangEngine(model_path=str(tiny_ckpt))  # no deterministic inference: a seed is not honoured
    with pytest.raises(ValueError, match="sampling_seed without enable_deterministic_inference"):
        fast.loop.run_until_complete(fast.async_generate(**ok))
    fast.shutdown()


# ---- weights ----------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("which", ["tiny_ckpt", "tiny_ckpt_untied"])
def test_pushed_weight_names_are_the_checkpoint_names_sglang_loads(which, request):
    ckpt = request.getfixturevalue(which)
    model = build_model(hf_dir=ckpt)
    named = dict(hf_parameters(model))
    assert {k: tuple(v.shape) for k, v in named.items()} == checkpoint_names(ckpt)  # every one, with its shape
    model.visual.requires_grad_(False)
    trainable = [k for k, _ in hf_parameters(model, trainable_only=True)]
    assert trainable and not any(k.startswith("visual.") for k in trainable)


def test_buckets_cover_every_tensor_once_in_order_within_the_bound(tiny_ckpt):
    model = build_model(hf_dir=tiny_ckpt)
    named = list(hf_parameters(model))
    sizes = {k: v.numel() * v.element_size() for k, v in named}
    bound = sorted(sizes.values())[-3]  # the two largest tensors exceed it: each goes alone
    got = list(buckets(named, bound))
    assert [k for b in got for k, _ in b] == [k for k, _ in named]
    for b in got:
        assert len(b) == 1 or sum(sizes[k] for k, _ in b) <= bound
    assert all(t.data_ptr() == dict(named)[k].data_ptr() and not t.requires_grad for b in got for k, t in b)
    assert len(list(buckets(named, 1 << 40))) == 1
    with pytest.raises(ValueError):
        list(buckets(named, 0))


def test_buckets_of_a_sharded_actor_hold_full_tensors(tiny_ckpt):
    """FSDP2 parameters are DTensors: the buckets hold `full_tensor()`s, plain tensors equal to the unsharded
    model's (a one-rank gloo mesh in this process: the DTensor path without the cost of spawning ranks)."""
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor

    from distributed_helpers import free_port
    from torchplex.models.qwen2_5_vl.parallelize import apply_fsdp

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        model = build_model(hf_dir=tiny_ckpt)
        apply_fsdp(model, init_device_mesh("cpu", (1,)), torch.float32, torch.float32)
        assert all(isinstance(p, DTensor) for p in model.parameters())
        got = [(k, t) for b in buckets(hf_parameters(model), 64 << 10) for k, t in b]
    finally:
        dist.destroy_process_group()
    plain = list(hf_parameters(build_model(hf_dir=tiny_ckpt)))
    assert [k for k, _ in got] == [k for k, _ in plain]
    for (_, t), (_, ref) in zip(got, plain):
        assert not isinstance(t, DTensor)
        torch.testing.assert_close(t, ref, rtol=0, atol=0)


# ---- capabilities ------------------------------------------------------------------------------------------------
def test_capabilities_keep_fusion_and_window_work_off_and_the_schedule_says_why():
    caps = SGLangRolloutEngine.capabilities
    assert not (caps.prefill_hook or caps.step_hook or caps.samples_finished_hook or caps.shares_actor_weights)
    shape = StepShape(prompt_lengths=(100, 60), group_size=4, max_new_tokens=8, has_reference=True,
                      vision_trainable=False, kv_bytes_per_token=1000, activation_bytes_per_token=8000)
    s = plan_step(shape, PlanOptions(mode="overlapped", ref_prefix_in_window=True, ref_suffix_in_window=True), caps)
    assert not s.has("actor_prefix") and not any(p.in_window for p in s.phases)
    assert any("not fused" in r and "sglang" in r for r in s.reasons)
    assert any("not in the decode window" in r and "sglang" in r for r in s.reasons)
    # the reason points at the measurement (docs/sglang.md: prefix work beside SGLang's decode, with and without MPS)
    window = next(r for r in s.reasons if "not in the decode window" in r)
    assert "hid too little" in window and "docs/sglang.md" in window


# ---- the engine on the fake ---------------------------------------------------------------------------------------
def test_by_default_sglang_runs_its_fast_configuration_with_unseeded_requests(tiny_ckpt, prompts):
    """rollout.sglang_deterministic off: no deterministic inference, FlashInfer text attention, SGLang's own sampler
    and CUDA graphs (nothing turns them off), and requests without seeds; every sample still comes back."""
    engine = SGLangRolloutEngine(build_model(hf_dir=tiny_ckpt), str(tiny_ckpt), dtype="float32",
                                 engine_factory=FakeSGLangEngine)
    settings = engine.engine.settings
    assert not settings.get("enable_deterministic_inference") and settings["attention_backend"] == "flashinfer"
    assert "sampling_backend" not in settings and not settings.get("disable_cuda_graph")
    assert settings["enable_memory_saver"] and settings["mm_attention_backend"] == "triton_attn"
    out = engine.generate(prompts, SamplingParams(n=3, temperature=1.0, max_new_tokens=4, seed=3))
    assert [[(s.prompt_index, s.sample_index) for s in row] for row in out] == [[(i, j) for j in range(3)]
                                                                                for i in range(2)]
    assert all("sampling_seed" not in r["sampling_params"][0] for r in engine.engine.requests)


def test_deterministic_sglang_samples_each_seed_like_the_native_engine(tiny_ckpt, prompts):
    actor = build_model(hf_dir=tiny_ckpt)
    engine = SGLangRolloutEngine(actor, str(tiny_ckpt), dtype="float32", engine_factory=FakeSGLangEngine,
                                 deterministic=True)
    fake = engine.engine
    assert isinstance(engine, RolloutEngineProtocol) and fake.settings["enable_memory_saver"]
    assert fake.settings["enable_deterministic_inference"] and fake.settings["tp_size"] == 1
    assert (fake.settings["attention_backend"], fake.settings["sampling_backend"]) == ("triton", "pytorch")
    with torch.no_grad():  # the actor moved away from the checkpoint SGLang loaded
        for p in actor.parameters():
            p.add_(0.05 * torch.randn_like(p))
    params = SamplingParams(n=2, temperature=1.0, max_new_tokens=4, seed=3)
    out = engine.generate(prompts, params)
    ref = RolloutEngine(actor, kv_pool_bytes=32 << 20, compile_decode=False).generate(prompts, params)
    for mine, theirs in zip(out, ref):  # the actor's samples: pushed weights, seeds and images all arrived
        for a, b in zip(mine, theirs):
            assert (a.prompt_index, a.sample_index, a.token_ids, a.finish_reason) == \
                (b.prompt_index, b.sample_index, b.token_ids, b.finish_reason)
            torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), rtol=1e-5, atol=1e-5)
    # one single-request async_generate call per sample: SGLang 0.5.17's batched call fails the whole batch with a
    # KeyError when one of its requests finishes before the last is sent (requests.build_requests)
    assert len(fake.requests) == len(prompts) * params.n and all(len(r["input_ids"]) == 1 for r in fake.requests)
    assert sum(map(len, fake.pushes)) == len(list(actor.parameters()))  # first push: everything
    engine.release()
    assert fake.released == {"kv_cache", "weights"}
    engine.generate(prompts[:1], params)  # resumed, then every weight pushed again (released memory is garbage)
    assert not fake.released and sum(map(len, fake.pushes)) == 2 * len(list(actor.parameters()))
    actor.visual.requires_grad_(False)
    before = len(fake.pushes)
    engine.generate(prompts[:1], params)  # not released since: only what training changes
    assert not any(k.startswith("visual.") for push in fake.pushes[before:] for k in push)
    with pytest.raises(ValueError, match="does not support on_step"):
        engine.generate(prompts, params, on_step=lambda info: None)
    assert engine.stats.weight_push_s and engine.stats.generate_s and engine.stats.release_s


def test_a_tp_group_samples_on_its_first_rank_and_broadcasts(tiny_ckpt, prompts):
    """rollout_tp > 1: the engine lives on the group's first rank and the outputs reach every rank (a one-rank
    gloo group here: the broadcast path, without spawning ranks)."""
    import torch.distributed as dist

    from distributed_helpers import free_port

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    try:
        actor = build_model(hf_dir=tiny_ckpt)
        engine = SGLangRolloutEngine(actor, str(tiny_ckpt), tp_size=2, group=dist.group.WORLD, dtype="float32",
                                     engine_factory=FakeSGLangEngine)
        assert engine.leader and engine.engine.settings["tp_size"] == 2
        out = engine.generate(prompts, SamplingParams(n=2, max_new_tokens=3))
    finally:
        dist.destroy_process_group()
    assert [[(s.prompt_index, s.sample_index) for s in row] for row in out] == [[(0, 0), (0, 1)], [(1, 0), (1, 1)]]


def test_a_scheduler_that_never_answers_fails_the_rollout_after_the_timeout(tiny_ckpt, prompts):
    engine = SGLangRolloutEngine(build_model(hf_dir=tiny_ckpt), str(tiny_ckpt), dtype="float32", timeout_s=0.3,
                                 engine_factory=SilentSGLangEngine)
    t0 = time.perf_counter()
    with pytest.raises(SGLangTimeoutError, match="rollout.sglang_timeout_s = 0.3 s"):
        engine.generate(prompts, SamplingParams(n=2, max_new_tokens=2))
    assert time.perf_counter() - t0 < 10


def test_a_scheduler_stuck_on_a_weight_push_fails_after_the_timeout(tiny_ckpt, prompts):
    """Defect: only generate had a timeout; SGLang's update_weights_from_tensor / release / resume are synchronous
    run_until_complete calls without one, so a scheduler hung on a push held the step (and the device call)
    until it was killed."""
    engine = SGLangRolloutEngine(build_model(hf_dir=tiny_ckpt), str(tiny_ckpt), dtype="float32", timeout_s=0.3,
                                 engine_factory=StuckSGLangEngine)
    t0 = time.perf_counter()
    with pytest.raises(SGLangTimeoutError, match="update_weights_from_tensor within rollout.sglang_timeout_s"):
        engine.generate(prompts, SamplingParams(n=2, max_new_tokens=2))
    assert time.perf_counter() - t0 < 10


def test_deadline_leaves_an_outer_timer_running():
    fired = []
    previous = signal.signal(signal.SIGALRM, lambda *a: fired.append(1))
    try:
        signal.setitimer(signal.ITIMER_REAL, 0.4)
        with sgl_engine.deadline(5.0, "x"):
            pass
        time.sleep(0.8)
        assert fired == [1]  # the outer timer (a test runner's, say) still went off
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


# ---- start-up errors -----------------------------------------------------------------------------------------------
def test_startup_fails_on_cpu_and_without_sglang_saying_what_to_install():
    with pytest.raises(SGLangUnavailableError, match="needs a CUDA device"):
        check_sglang_available(torch.device("cpu"))
    assert importlib.util.find_spec("sglang") is None  # CI has no SGLang: the second message is the one users see
    import sys

    import torchplex.train  # noqa: F401 - the trainer imports the backend's module, never SGLang itself
    assert "sglang" not in sys.modules
    with pytest.raises(SGLangUnavailableError, match=r"pip install 'torchplex\[sglang\]'.*sglang_gpu.sh"):
        check_sglang_available(torch.device("cuda", 0))
    with pytest.raises(ValueError, match="rollout_tp = 1 or = tp"):
        build_sglang_engine(None, "x", None, 2, torch.device("cpu"), dtype="float32", mem_fraction=0.2,
                            timeout_s=1, bucket_mib=1, seed=0, engine_factory=FakeSGLangEngine)


def test_expandable_segments_are_refused_before_sglang_starts(monkeypatch):
    """SGLang's memory saver refuses PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True and its scheduler died at
    start-up on the H200 (an SGLang traceback, then the process killed): say so at start-up instead, naming it."""
    from torchplex.rollout.sglang_backend.engine import allocator_conflict

    for conf in ("expandable_segments:True", "max_split_size_mb:64, expandable_segments:true"):
        why = allocator_conflict(conf)
        assert "PYTORCH_CUDA_ALLOC_CONF" in why and "expandable_segments" in why
    for conf in ("", "expandable_segments:False", "max_split_size_mb:64"):
        assert allocator_conflict(conf) == ""
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: object() if name == "sglang" else None)
    monkeypatch.setenv("PYTORCH_CUDA_ALLOC_CONF", "expandable_segments:True")
    with pytest.raises(SGLangUnavailableError, match="torch_memory_saver"):
        check_sglang_available(torch.device("cuda", 0))
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF")
    check_sglang_available(torch.device("cuda", 0))  # the same machine without the variable passes the check


def test_trainer_with_backend_sglang_on_cpu_fails_before_loading_anything(tmp_path):
    from torchplex.config import load_config
    from torchplex.train import Trainer

    cfg = load_config(["--job.config_file=train_configs/debug.toml", "--rollout.backend=sglang",
                       f"--job.output_dir={tmp_path}", f"--model.hf_checkpoint={tmp_path}/absent"])
    with pytest.raises(SGLangUnavailableError, match="needs a CUDA device"):
        Trainer(cfg)
    assert not (tmp_path / "absent").exists()  # failed before writing a tiny checkpoint or loading a model


def test_logprob_mismatch_is_the_mean_abs_difference_and_k3():
    rollout = torch.tensor([[-1.0, -2.0, -0.5], [-0.1, -3.0, -9.0]])
    trainer = torch.tensor([[-1.1, -1.8, -0.5], [-0.1, -3.5, 0.0]])
    mask = torch.tensor([[True, True, True], [True, True, False]])
    d = torch.tensor([-0.1, 0.2, 0.0, 0.0, -0.5])
    got = logprob_mismatch(rollout, trainer, mask)
    assert got["mean_abs"] == pytest.approx(0.8 / 5)
    assert got["k3"] == pytest.approx(float((d.exp() - 1 - d).mean()))  # Schulman's k3 of KL(rollout || trainer)


def test_grpo_steps_with_backend_sglang_push_the_trained_weights_each_step(tiny_ckpt, tmp_path, monkeypatch):
    """Two trainer steps with rollout.backend = "sglang" (the fake engine in SGLang's place): rewards and losses
    finite, every rollout preceded by a push of the actor's current weights (changed by the step before), and the
    engine's log-probs tracking the trainer's recomputation (the fake samples in float32 with the native math)."""
    import math

    from torchplex.config import load_config
    from torchplex import train
    from torchplex.rl import rewards

    monkeypatch.setattr(train, "check_sglang_available", lambda device: None)
    monkeypatch.setattr(sgl_engine, "default_engine_factory", FakeSGLangEngine)
    # a reward that differs within a group, so a random model's step has a gradient
    monkeypatch.setitem(rewards.REWARD_FUNCTIONS, "accuracy", lambda response, answer: float(len(response)))
    args = {"job.config_file": "train_configs/debug.toml", "job.output_dir": tmp_path, "rollout.backend": "sglang",
            "model.hf_checkpoint": tiny_ckpt, "model.make_tiny_if_missing": "false",
            "data.synthetic_dir": tmp_path / "synthetic", "data.synthetic_train": 8, "data.synthetic_eval": 2,
            "data.prompts_per_step": 2, "rollout.n_samples": 2, "rollout.max_new_tokens": 4,
            "training.steps": 2, "training.sft_warmup_steps": 0, "metrics.progress_bar": "false",
            "metrics.tensorboard": "false", "metrics.eval_interval": 0, "checkpoint.enable": "false"}
    trainer = train.Trainer(load_config([f"--{k}={v}" for k, v in args.items()]))
    fake = trainer.engine.engine
    assert isinstance(trainer.engine, SGLangRolloutEngine) and isinstance(fake, FakeSGLangEngine)
    assert not fake.settings.get("enable_deterministic_inference")  # rollout.sglang_deterministic is off
    pushed = []
    push = fake.update_weights_from_tensor
    fake.update_weights_from_tensor = lambda named_tensors, **kw: (
        pushed.append({k: t.clone() for k, t in named_tensors}) or push(named_tensors, **kw))
    steps = []
    for _ in range(2):
        before = {k: p.detach().clone() for k, p in hf_parameters(trainer.actor)}
        n = len(pushed)
        metrics, ok = trainer.train_step()
        assert ok and math.isfinite(metrics["loss"]) and math.isfinite(metrics["reward/mean"])
        sent = {k: t for bucket in pushed[n:] for k, t in bucket.items()}
        assert sent.keys() == before.keys()  # the whole actor, as it was at this rollout
        assert all(torch.equal(sent[k], before[k]) for k in before)
        assert metrics["rollout/logprob_mismatch"] < 1e-4 and 0 <= metrics["rollout/mismatch_k3"] < 1e-6
        steps.append(sent)
    assert any(not torch.equal(steps[0][k], steps[1][k]) for k in steps[0])  # the step changed what SGLang saw


def test_sglang_deterministic_reaches_the_engine_and_needs_the_sglang_backend(tiny_ckpt, monkeypatch):
    """rollout.sglang_deterministic = true starts SGLang in its deterministic mode; with the native backend the key
    would be ignored, so loading fails naming both keys."""
    from torchplex.config import ConfigError, load_config

    with pytest.raises(ConfigError, match=r"rollout\.sglang_deterministic.*rollout\.backend"):
        load_config(["--job.config_file=train_configs/debug.toml", "--rollout.sglang_deterministic=true"])
    cfg = load_config(["--job.config_file=train_configs/debug.toml", "--rollout.backend=sglang",
                       "--rollout.sglang_deterministic=true"])
    assert cfg.rollout.sglang_deterministic
    engine = build_sglang_engine(build_model(hf_dir=tiny_ckpt), str(tiny_ckpt), None, 1, torch.device("cpu"),
                                 dtype="float32", mem_fraction=0.2, timeout_s=60, bucket_mib=64, seed=0,
                                 deterministic=cfg.rollout.sglang_deterministic, engine_factory=FakeSGLangEngine)
    assert engine.deterministic and engine.engine.settings["enable_deterministic_inference"]
