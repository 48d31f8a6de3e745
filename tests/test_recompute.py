"""Activation checkpointing chosen per training micro-batch from the memory budget (memory.recompute = "auto"):
the pure decision as data, the same step numbers whichever micro-batches recompute (against the unwrapped model,
fp32, <= 1e-6), the flag really switching the recompute off (a layer's body runs once per forward instead of
twice), the budget counting training at its recompute form, and the config key's validation."""

import copy
import math

import pytest
import torch

from torchplex.config import ConfigError, load_config
from torchplex.models.qwen2_5_vl.parallelize import (apply_activation_checkpointing, apply_compile, is_checkpointed,
                                                      recompute)
from torchplex.rollout.sampling import SamplingParams
from torchplex.runtime.build import step_settings
from torchplex.runtime.memory_budget import (HEADROOM, LOGIT_CHUNK, LOGIT_COPIES, agree_on_recompute,
                                             needs_recompute, no_recompute_bytes, recompute_train_bytes)

from step_runners import cpu_runner

TOL = 1e-6


# ---- the decision as data ---------------------------------------------------------------------------------------
def test_needs_recompute_when_the_whole_graph_does_not_fit_the_free_memory_less_the_margin():
    assert not needs_recompute(900, free_bytes=1000, margin_bytes=100)   # exactly fits
    assert needs_recompute(901, free_bytes=1000, margin_bytes=100)
    assert needs_recompute(1, free_bytes=50, margin_bytes=100)           # nothing free past the margin
    # a plan over micro-batches computing prefixes of 6 / 36 / 21 tokens at 1,500 B per token (a trainable tower's
    # blocks in it), with 4 response tokens each at 1,000 B (the decoder alone) and a vocab of 8 (96 B of logits per
    # response token), 40,000 B free less a 5,000 B margin
    ests = [no_recompute_bytes(1500.0, t, 1000.0, 4, 8) for t in (6, 36, 21)]
    assert ests == [9_000 + 4_000 + 4 * 4 * 8 * LOGIT_COPIES, 58_384, 35_884]
    assert [needs_recompute(e, 40_000, 5_000) for e in ests] == [False, True, True]
    # responses on held prefixes: the suffix rate alone
    assert no_recompute_bytes(1500.0, 0, 1000.0, 4, 8) == 4_384
    # the LM head runs 1,024 rows at a time (rl/logprobs): the fp32 logits of one chunk, not of every token
    chunk = no_recompute_bytes(0.0, 0, 0.0, LOGIT_CHUNK, 8)
    assert no_recompute_bytes(0.0, 0, 0.0, 5000, 8) == chunk == 3 * 4 * 8 * 1024


def test_recompute_form_is_layer_inputs_plus_one_layer_plus_logits():
    assert recompute_train_bytes(10.0, 100.0, tokens=7, response_tokens=3, vocab_size=5) == 770 + 3 * 4 * 5 * 3
    # far below the whole graph of 28 such layers at the same tokens
    assert recompute_train_bytes(10.0, 100.0, 7, 3, 5) < no_recompute_bytes(28 * 100.0, 4, 28 * 100.0, 3, 5)


def test_held_prefixes_leave_room_for_the_whole_graphs_worth_more_as_data():
    """A budget of 1,000 B (950 usable): the train stage holds 600 B beside its activations (100 B, the recompute
    form), so 250 B of room for held prefixes; micro-batches whose whole graphs take 150, 200 and 240 B; prompts
    of 20 B. Decomposed (rounds hold every prompt in any room that holds one): the cap keeps every graph that can
    be kept, 350 - 240 = 110 B, or one prompt when even that does not fit. Fusing: f prompts fused are held through
    training; 12 fused (240 B) keep none of the graphs (worth 12), 5 fused (100 B) keep all three (5 + 3 x 3)."""
    from torchplex.runtime.memory_budget import WHOLE_GRAPH_WORTH, MemoryBudget, held_cap_for_whole_graphs

    budget = MemoryBudget(1000, {"rollout": {"actor_weights": 400, "kv_pool": 300}, "ref": {"actor_weights": 400},
                                 "train": {"actor_weights": 400, "grads": 200, "activations": 100}})
    assert budget.train_room_bytes == 250 and budget.room_bytes == 250
    sizes, prompts = [150, 200, 240], [20] * 16
    cap, why = held_cap_for_whole_graphs(budget, sizes, prompts, fusing=False)
    assert cap == 110 and why.startswith("3 of 3 micro-batches whole")
    assert held_cap_for_whole_graphs(budget, [340], prompts, fusing=False)[0] == 20  # one prompt at least
    assert held_cap_for_whole_graphs(budget, [50], prompts, fusing=False)[0] == 250  # every graph fits the room
    assert WHOLE_GRAPH_WORTH == 3
    cap, why = held_cap_for_whole_graphs(budget, sizes, prompts, fusing=True)
    # f = 5 (100 B) keeps all three: 5 + 9 = 14; f = 12 (240 B) keeps none: 12; the cap is the rounds' 110 B
    assert cap == 110 and why.startswith("5 prompts fused and 3 of 3")
    cap, why = held_cap_for_whole_graphs(budget, [150] * 2, prompts, fusing=True)  # 200 B free beside 10 prompts
    assert cap == 200 and why.startswith("10 prompts fused and 2 of 2")
    budget.held_cap_bytes = cap
    assert budget.room_bytes == budget.train_room_bytes == 200
    assert budget.to_dict()["held_cap_bytes"] == 200


# ---- the executor on CPU ---------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def setup(grpo_assets):
    return grpo_assets.processor, grpo_assets.prompts, grpo_assets.actor, grpo_assets.reference


KV_POOL = 2 * 2**20


def runner_for(setup, mode, checkpointed, budget=2**40, policy="auto", checkpoint_prefix=False):
    # decomposed without the batched actor prefix: each micro-batch runs its prompts' prefixes, so they differ; the
    # micro-batches are 4 sequences whatever the budget (a token budget derived from it would shrink with it)
    return cpu_runner(setup, mode, budget=budget, micro_batch=4, kv_pool=KV_POOL, checkpointed=checkpointed,
                      recompute=policy, checkpoint_prefix=checkpoint_prefix, micro_batch_tokens=2**20,
                      plan_options={"batched_actor_prefix": False})


def run_step(runner, setup, counting=False):
    """One step; with `counting`, how often decoder layer 0's and vision block 0's bodies ran with grad enabled
    (a pre-hook on a submodule fires in the forward and again in a recompute, which calls the body; a post-hook
    would not: the recompute stops once it has rebuilt the last tensor backward needs)."""
    prompts, tokenizer = setup[1], setup[0].tokenizer
    stop = [tokenizer.convert_tokens_to_ids("<|im_end|>")]
    params = SamplingParams(n=4, max_new_tokens=6, seed=3, stop_token_ids=stop)
    calls = {"layer": 0, "vision": 0}
    hooks = []
    if counting:
        def counter(name):
            def hook(module, args):
                calls[name] += torch.is_grad_enabled()
            return hook
        hooks = [runner.actor.layers[0].feed_forward.register_forward_pre_hook(counter("layer")),
                 runner.actor.visual.blocks[0].mlp.register_forward_pre_hook(counter("vision"))]
    try:
        out = runner.run(prompts, [""] * len(prompts), params)
    finally:
        for h in hooks:
            h.remove()
    return out, calls


def budget_for(resident: int, threshold: int) -> int:
    """The budget whose free memory in training, less the headroom, is about `threshold` bytes."""
    return math.ceil((threshold + resident) / (1 - HEADROOM)) + 1


@pytest.fixture(scope="module", params=["serial", "decomposed"])
def plain(request, setup):
    """The unwrapped actor's step in this mode (nothing recomputes), and its estimates from a checkpointed run."""
    mode = request.param
    runner = runner_for(setup, mode, checkpointed=False)
    out, calls = run_step(runner, setup, counting=True)
    probe = runner_for(setup, mode, checkpointed=True)
    probe_out, _ = run_step(probe, setup)
    estimates = probe_out.report.recompute["estimates"]
    resident = sum(b for g, b in probe_out.plan.budget.residents["train"].items() if g != "activations")
    return mode, out, runner.optimizer.grads, calls, estimates, resident


def rel(a, b):
    return ((a - b).abs().max() / b.abs().max().clamp_min(1e-30)).item()


@pytest.mark.parametrize("which", ["all", "none", "mix"])
def test_recompute_choice_keeps_the_unwrapped_step(setup, plain, which):
    """Budgets that make every training micro-batch recompute, none, and some: losses, log-probs and every parameter
    gradient within 1e-6 of the unwrapped actor's step; the layer bodies run once per forward without recompute,
    twice with it (so a flag the checkpointed forward ignored would fail the counts)."""
    mode, ref_out, ref_grads, ref_calls, estimates, resident = plain
    assert len(set(estimates)) > 1  # the micro-batches differ (prompt and response lengths), so a mix exists
    threshold = {"all": min(estimates) // 2, "none": 2**40,
                 "mix": (sorted(estimates)[0] + sorted(estimates)[-1]) // 2}[which]
    runner = runner_for(setup, mode, checkpointed=True, budget=budget_for(resident, threshold))
    out, calls = run_step(runner, setup, counting=True)
    log = out.report.recompute
    assert log["estimates"] == estimates
    decisions = [needs_recompute(e, f, 0) for e, f in zip(log["estimates"], log["free_bytes"])]
    on, off = sum(decisions), len(decisions) - sum(decisions)
    assert {"all": off == 0, "none": on == 0, "mix": on and off}[which]
    assert (out.train.recompute["on"], out.train.recompute["off"]) == (on, off)
    assert (log["on"], log["off"]) == (on, off)

    assert torch.equal(out.experience.tokens, ref_out.experience.tokens)
    mask = out.experience.mask
    assert rel(out.experience.old_logprobs[mask], ref_out.experience.old_logprobs[mask]) < TOL
    assert rel(out.train.stats.loss, ref_out.train.stats.loss) < TOL
    assert len(runner.optimizer.grads) == len(ref_grads)
    for g, r in zip(runner.optimizer.grads, ref_grads):
        assert rel(g, r) < TOL

    # per forward, the unwrapped layer body runs ref_calls / forwards times; a recomputing forward runs it again
    forwards = len(decisions)
    for name in ("layer", "vision"):
        assert ref_calls[name] % forwards == 0 and ref_calls[name] > 0
    per = {name: ref_calls[name] // forwards for name in ref_calls}
    if which == "mix":  # the micro-batches differ in how often they call a block (decomposed: prefix + suffix)
        assert ref_calls["layer"] < calls["layer"] < 2 * ref_calls["layer"]
    else:
        scale = 2 if which == "all" else 1
        assert calls == {name: scale * per[name] * forwards for name in per}


def test_always_recomputes_every_micro_batch(setup):
    runner = runner_for(setup, "decomposed", checkpointed=True, policy="always")
    out, calls = run_step(runner, setup)
    assert out.train.recompute["off"] == 0 and out.train.recompute["on"] > 0
    assert "estimates" not in out.report.recompute


def test_recompute_block_switches_the_checkpointed_forward(setup):
    """recompute(False) keeps the whole graph (the body runs once through forward and backward), recompute(True)
    and the default rerun it in backward; the flag is restored after the block."""
    actor = copy.deepcopy(setup[2])
    apply_activation_checkpointing(actor)
    assert is_checkpointed(actor) and not is_checkpointed(setup[2])
    layer = actor.layers[0]
    runs = []
    hook = layer.feed_forward.register_forward_pre_hook(lambda *a: runs.append(1))
    x = torch.randn(1, 5, actor.args.text.hidden_size, requires_grad=True)
    cos, sin = torch.ones(1, 1, 5, actor.args.text.head_dim), torch.zeros(1, 1, 5, actor.args.text.head_dim)
    attend = lambda layer, q, k, v: q  # what attention does is beside the point here
    for flag, expect in ((False, 1), (True, 2), (None, 2)):
        runs.clear()
        with recompute(actor, flag) if flag is not None else torch.enable_grad():
            y = layer(x, cos, sin, attend, 0)
        y.sum().backward()
        assert len(runs) == expect, (flag, len(runs))
    hook.remove()


def test_budget_counts_training_at_its_recompute_form(setup):
    """Item 4 of the brief: a checkpointed actor's first-step training activations are the recompute form (layer
    inputs, one layer's graph, logits), far below the whole-graph estimate, so held prefixes get their room."""
    params = SamplingParams(n=4, max_new_tokens=6, seed=3)
    # decomposed: no prefix held in batches, whose backward would be the larger transient (test_memory_budget)
    plain_runner = runner_for(setup, "decomposed", checkpointed=False)
    ckpt_runner = runner_for(setup, "decomposed", checkpointed=True)
    shape = ckpt_runner.shape(setup[1], params)
    plain_shape = plain_runner.shape(setup[1], params)
    plain_act = plain_runner.memory.estimate(plain_shape, plain_runner.settings.plan).residents["train"]["activations"]
    budget = ckpt_runner.memory.estimate(shape, ckpt_runner.settings.plan)
    t = ckpt_runner.actor.args.text
    tokens = 4 * 6 + 1 * max(shape.prompt_lengths)
    want = recompute_train_bytes(shape.compact_bytes_per_token, max(ckpt_runner.memory.fp.block_graph_bytes()),
                                 tokens, 4 * 6, t.vocab_size)
    assert budget.residents["train"]["activations"] == want
    assert want < plain_act


def test_config_key_defaults_to_auto_and_refuses_other_values():
    assert load_config([]).memory.recompute == "auto"
    assert step_settings(load_config(["--memory.recompute=always"])).recompute == "always"
    with pytest.raises(ConfigError, match=r"memory\.recompute"):
        load_config(["--memory.recompute=sometimes"])


def test_fused_graph_form_of_a_checkpointed_actor_holds_the_whole_graph(setup):
    """Defect (before this change): with the actor's blocks checkpointed, the overlapped step's "graph" form ran
    the fused prefill through checkpoint(), so SavedBytes measured only the layer inputs and the rate training's
    recompute choice reads was far below the whole graph. Now the form holds (and measures) what the unwrapped
    actor's does, and the overlapped step (auto, nothing forced) gives the unwrapped step's numbers."""
    outs = {}
    for checkpointed in (False, True):
        runner = runner_for(setup, "overlapped", checkpointed=checkpointed)
        out, _ = run_step(runner, setup)
        nbytes, tokens = out.prefixes.graph_bytes[id(runner.actor)]
        outs[checkpointed] = (out, runner.optimizer.grads, nbytes / tokens)
    (plain_out, plain_grads, plain_rate), (out, grads, rate) = outs[False], outs[True]
    assert [c.form for c in out.plan.prefix_forms] == ["graph"] * 3
    assert rate == plain_rate
    assert out.train.recompute["off"] > 0
    assert rel(out.train.stats.loss, plain_out.train.stats.loss) < TOL
    for g, r in zip(grads, plain_grads):
        assert rel(g, r) < TOL


def test_compiled_checkpointed_layer_follows_the_flag(setup):
    """model.compile compiles the layer's tensor functions, and the checkpoint wrapper around them reads the flag
    eagerly: under recompute(True) and recompute(False) the compiled layer gives the eager gradients, through
    compiled graphs (the flag is not baked into any of them)."""
    actor = copy.deepcopy(setup[2])
    apply_activation_checkpointing(actor)
    layer = actor.layers[0]
    t = actor.args.text
    x = torch.randn(1, 5, t.hidden_size)
    cos, sin = torch.ones(1, 1, 5, t.head_dim), torch.zeros(1, 1, 5, t.head_dim)
    attend = lambda layer_index, q, k, v: q * (k.mean() + v.mean())  # every projection gets a gradient

    def grads(flag):
        layer.zero_grad(set_to_none=True)
        with recompute(actor, flag):
            layer(x, cos, sin, attend, 0).square().sum().backward()
        return [p.grad.clone() for p in layer.parameters()]

    eager = grads(True)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    apply_compile(actor, backend="eager")
    on = grads(True)
    off = grads(False)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] >= 2  # the two functions of the layer
    for a, b, c in zip(eager, on, off):
        assert rel(b, a) < TOL and rel(c, a) < TOL


def test_checkpointed_prefix_reruns_with_the_forwards_choice(setup):
    """runtime.checkpoint_prefix wraps the whole prefix forward in checkpoint(), whose rerun happens in backward,
    outside the forward's recompute(False) block: it must rerun with the forward's choice (the blocks inside not
    checkpointed), or the rerun saves other tensors than the forward did. Same numbers as the unwrapped actor."""
    plain = runner_for(setup, "decomposed", checkpointed=False, checkpoint_prefix=True)
    plain_out, _ = run_step(plain, setup)
    runner = runner_for(setup, "decomposed", checkpointed=True, checkpoint_prefix=True)
    out, _ = run_step(runner, setup)
    assert out.train.recompute["off"] > 0 and out.train.recompute["on"] == 0
    assert rel(out.train.stats.loss, plain_out.train.stats.loss) < TOL
    for g, r in zip(runner.optimizer.grads, plain.optimizer.grads):
        assert rel(g, r) < TOL


@pytest.mark.parametrize("policy", ["auto", "always"])
def test_trainer_logs_recompute_counts(tiny_ckpt, tmp_path, policy):
    """The step's metrics carry how many training forwards recomputed (recompute/on) and how many did not."""
    import json
    from pathlib import Path

    from torchplex.train import Trainer

    debug = Path(__file__).resolve().parents[1] / "train_configs" / "debug.toml"
    args = {"job.config_file": debug, "job.output_dir": tmp_path, "model.hf_checkpoint": tiny_ckpt,
            "model.make_tiny_if_missing": "false", "model.activation_checkpointing": "true",
            "memory.recompute": policy, "data.synthetic_dir": tmp_path / "data", "data.synthetic_train": 8,
            "data.synthetic_eval": 2, "data.prompts_per_step": 2, "rollout.n_samples": 2,
            "rollout.max_new_tokens": 4, "training.steps": 1, "training.sft_warmup_steps": 0,
            "metrics.progress_bar": "false", "metrics.tensorboard": "false", "metrics.eval_interval": 0}
    trainer = Trainer(load_config([f"--{k}={v}" for k, v in args.items()]))
    trainer.train()
    record = {}
    for line in (trainer.run_dir / "metrics.jsonl").read_text().splitlines():
        r = json.loads(line)
        if r["step"] == 1:
            record.update(r)
    assert record["recompute/on"] + record["recompute/off"] > 0
    assert (record["recompute/on"] == 0) if policy == "auto" else (record["recompute/off"] == 0)


def _agree_worker(rank, world_size, port, needs, results):
    import torch.distributed as dist
    from distributed_helpers import init_gloo

    from torchplex.runtime.memory_budget import agree_on_recompute

    from torchplex.distributed.mesh import ParallelDims
    from torchplex.models.qwen2_5_vl.args import get_flavor
    from torchplex.models.qwen2_5_vl.model import Qwen2_5_VLModel
    from torchplex.models.qwen2_5_vl.parallelize import parallelize_qwen2_5_vl
    from torchplex.runtime.step import _tp_group

    init_gloo(rank, world_size, port)
    results[rank] = [agree_on_recompute(n, dist.group.WORLD, torch.device("cpu")) for n in needs[rank]]
    # the group the executor agrees over: the TP mesh's, found from a TP'd actor's weights
    model = Qwen2_5_VLModel(get_flavor("debug"))
    assert _tp_group(model) is None
    dims = ParallelDims(dp_shard=1, tp=world_size, world_size=world_size, device_type="cpu")
    parallelize_qwen2_5_vl(model, dims, tp=True, fsdp=False, activation_checkpointing=True)
    group = _tp_group(model)
    assert group is not None and dist.get_world_size(group) == world_size
    dist.destroy_process_group()


def test_tensor_parallel_peers_agree_on_recompute():
    """TP peers whose own choices differ (free memory differs a little) all recompute when any must: a TP'd
    block's recompute reruns its all-reduces, so a split choice would hang. One choice per micro-batch."""
    from distributed_helpers import free_port, spawn

    manager = torch.multiprocessing.Manager()
    results = manager.dict()
    needs = [[True, False, False], [False, False, True]]
    spawn(_agree_worker, 2, (free_port(), needs, results), timeout_s=60)
    assert results[0] == results[1] == [True, False, True]
    assert agree_on_recompute(False, None, torch.device("cpu")) is False


@pytest.mark.parametrize("policy", ["always", "auto"])
def test_training_learns_its_activations_from_recomputing_micro_batches_only(setup, policy):
    """Defect (H200, img P = 8, overlapped): the warm-up step kept every micro-batch's whole graph, so the recompute
    form the budget counts was never measured and the next step planned it from the estimate (9.0 GiB; 14.3 ran).
    Each micro-batch is measured in its own window now: one that recomputed is what the next plan counts (the
    largest seen); one that kept its whole graph used what was free by design and is not counted. The allocator's
    counters are stood in for (CPU): a recomputing micro-batch peaks 5 MB above its entry, a whole graph 50 MB."""
    from step_runners import ScriptedWindows

    windows = ScriptedWindows({"recompute": 5_000_000, "whole_graph": 50_000_000, "prefix_backward": 0})
    runner = cpu_runner(setup, "decomposed", budget=2**40, micro_batch=4, kv_pool=KV_POOL, checkpointed=True,
                        recompute=policy, plan_options={"batched_actor_prefix": False}, windows=windows)
    out, _ = run_step(runner, setup)  # budget 2**40: "auto" keeps graphs
    recomputed = policy == "always"
    assert set(windows.names) == {"recompute" if recomputed else "whole_graph", "prefix_backward"}
    assert runner.memory.learned.train_activation_bytes == (5_000_000 if recomputed else None)
    params = SamplingParams(n=4, max_new_tokens=6, seed=3)
    act = runner.memory.estimate(runner.shape(setup[1], params), runner.settings.plan).residents["train"]["activations"]
    assert (act == 5_000_000) == recomputed


def graphs_take(setup, factor: float, monkeypatch):
    """A checkpointed decomposed runner on stand-in counters (CPU) under which each kept graph peaks at `factor` x the
    estimate its choice was made with; returns it and the list the estimates are appended to."""
    from step_runners import ScriptedWindows

    sizes = {"recompute": 1_000, "prefix_backward": 0, "whole_graph": 0}
    runner = cpu_runner(setup, "decomposed", budget=2**40, micro_batch=4, kv_pool=KV_POOL, checkpointed=True,
                        plan_options={"batched_actor_prefix": False}, windows=ScriptedWindows(sizes))
    estimates = []
    policy = runner.memory.recompute_policy

    def scripted(*args):
        choose, log = policy(*args), args[-1]

        def choice(mb, req):
            on = choose(mb, req)
            estimates.append(log["estimates"][-1])
            sizes["whole_graph"] = int(factor * estimates[-1])
            return on

        return choice

    monkeypatch.setattr(runner.memory, "recompute_policy", scripted)
    return runner, estimates


def free_bytes(runner, monkeypatch, free: int) -> None:
    """The memory free at every training forward, stood in for."""
    monkeypatch.setattr(runner.memory, "free_for_training", lambda budget, held=0: (free, 0))


def test_whole_graph_estimates_learn_what_the_kept_graphs_took(setup, monkeypatch):
    """Defect (H200, 7B, vid P = 16, both decomposed modes): a micro-batch whose whole-graph estimate (17.1 GB) just
    fit what was free less the margin (17.1 of 24.6 GB free) kept its graph and ran out of memory: the estimate's
    rate is the prefix's graph per token, and a suffix forward takes more. What each kept graph measured against its
    estimate now scales the next steps' estimates (never below 1). Stand-in counters (CPU): every whole graph peaks
    at 3x its estimate; the budget is set so the second step's scaled estimates no longer fit."""
    from torchplex.runtime.memory_budget import FIRST_WHOLE_GRAPH_SCALE

    runner, estimates = graphs_take(setup, 3, monkeypatch)  # budget 2**40: the first step keeps every graph
    out, _ = run_step(runner, setup)
    log = out.report.recompute
    assert log["scale"] == FIRST_WHOLE_GRAPH_SCALE  # nothing measured yet, stages measured: the prior
    assert not any(x is False for x in log["whole"]) and out.train.recompute["on"] == 0
    assert out.train.measured_bytes == [3 * e for e in estimates] == log["measured"]
    assert runner.memory.learned.whole_graph_scale == pytest.approx(3.0)
    # the next step: free memory that holds each estimate twice over, not three times -> every micro-batch recomputes
    free_bytes(runner, monkeypatch, 2 * max(estimates))
    out, _ = run_step(runner, setup)
    log = out.report.recompute
    assert log["scale"] == pytest.approx(3.0) and out.train.recompute["off"] == 0 and out.train.recompute["on"] > 0
    from torchplex.runtime.memory_budget import whole_graph_scale
    assert whole_graph_scale(1.0, [10, 10], [5, 40], [True, False]) == 1.0  # a recomputed forward is not a graph
    assert whole_graph_scale(2.0, [10], [15], [True]) == 2.0  # never smaller than what earlier steps measured


def test_until_a_kept_graph_is_measured_the_choices_carry_the_first_step_prior(setup, monkeypatch):
    """Defect (H200, 7B, vid P = 16, overlapped): the first step priced whole graphs at their bare estimate (scale 1),
    kept a micro-batch estimated at 67.6 GiB whose graph took 80.8, and peaked at 135.9 GiB. Where stages are
    measured, the choices now price graphs at FIRST_WHOLE_GRAPH_SCALE until one is measured; a step that kept none
    keeps the prior, and the first measured ratio replaces it, a smaller one too. Without counters (CPU), 1."""
    from torchplex.runtime.memory_budget import FIRST_WHOLE_GRAPH_SCALE

    assert FIRST_WHOLE_GRAPH_SCALE > 1.1
    plain = runner_for(setup, "decomposed", checkpointed=True)
    out, _ = run_step(plain, setup)
    log = out.report.recompute
    assert log["scale"] == 1.0 and all(log["whole"]) and plain.memory.learned.whole_graph_scale is None
    free = int(1.2 * max(log["estimates"]))  # every graph fits at scale 1, the largest not at the prior

    runner, _ = graphs_take(setup, 1.1, monkeypatch)
    free_bytes(runner, monkeypatch, 0)  # nothing fits: none kept, the prior stays
    out, _ = run_step(runner, setup)
    log = out.report.recompute
    assert log["scale"] == FIRST_WHOLE_GRAPH_SCALE and not any(log["whole"])
    assert runner.memory.learned.whole_graph_scale is None
    free_bytes(runner, monkeypatch, free)
    out, _ = run_step(runner, setup)
    log = out.report.recompute
    assert log["scale"] == FIRST_WHOLE_GRAPH_SCALE
    assert log["whole"] == [math.ceil(e * FIRST_WHOLE_GRAPH_SCALE) <= free for e in log["estimates"]]
    assert any(log["whole"]) and not all(log["whole"])  # at scale 1 all would have been kept
    # measured: below the prior, it replaces it
    assert runner.memory.learned.whole_graph_scale == pytest.approx(1.1, rel=1e-3)
    out, _ = run_step(runner, setup)
    assert out.report.recompute["scale"] == pytest.approx(1.1, rel=1e-3)


@pytest.mark.parametrize("mode", ["decomposed", "overlapped"])
def test_whole_graph_estimate_prices_responses_at_the_decoder_rate(setup, mode):
    """Defect (H200, 7B, img P = 8): micro-batches on held prefixes were estimated at 18.6-31.0 GiB and the largest
    whole graph measured 16.5 (overlapped's one kept graph: 5.8 of 26.2): the estimate priced a response token at
    the fused prefix graph's rate, which holds a trainable tower's blocks for each merged image token, so most
    micro-batches recomputed that had room not to. What autograd saves in each whole-graph training forward (the
    prefixes held, so the responses alone: overlap.SavedBytes, parameters left out) must be covered by the estimate,
    and by no more than 2x (priced at the prefix rate: 2.7x on the tiny geometry, whose tower is 2/3 of that rate)."""
    from torchplex.runtime.prefixes import SavedBytes

    runner = cpu_runner(setup, mode, budget=2**40, micro_batch=4, kv_pool=KV_POOL, checkpointed=True)
    scorer, saved = runner.scorer, []
    score = scorer.score

    def measuring(model, req, *args, **kwargs):
        if model is not runner.actor or not torch.is_grad_enabled():
            return score(model, req, *args, **kwargs)
        graph = SavedBytes(model)
        with graph:
            out = score(model, req, *args, **kwargs)
        saved.append(graph.nbytes)
        return out

    scorer.score = measuring
    out, _ = run_step(runner, setup)
    log = out.report.recompute
    assert all(log["whole"]) and len(saved) == len(log["estimates"]) > 1
    text, vision = runner.memory.fp.block_graph_bytes()
    assert vision > text and log["suffix_bytes_per_token"] == runner.actor.args.text.num_layers * text
    for est, nbytes in zip(log["estimates"], saved):
        assert nbytes <= est <= 2 * nbytes


def test_free_memory_for_a_training_forward_leaves_out_the_gradients_its_backward_makes(setup, monkeypatch):
    """Defect (H200, 7B, every run): the first micro-batch of a step found 15.4 GiB more free than the next, the
    bf16 gradients its own backward creates, and chose its recompute as if it could keep them for its graph. The
    allocator's counters are stood in for (CPU): what is free less the gradients not yet made, whichever exist."""
    from torchplex.runtime.memory_budget import MemoryBudget

    runner = runner_for(setup, "decomposed", checkpointed=True)  # budget 2**40: the budget's branch (capacity)
    trainable = [p for p in runner.actor.parameters() if p.requires_grad]
    size = lambda ps: sum(p.numel() * p.element_size() for p in ps)
    total = size(trainable)
    monkeypatch.setattr(runner.memory, "device", torch.device("cuda"))
    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (10 * total, 100 * total))
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 0)
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 0)
    budget = MemoryBudget(100 * total)
    for p in trainable:
        p.grad = None
    assert runner.memory.free_for_training(budget) == (9 * total, int(HEADROOM * 100 * total))
    made = trainable[: len(trainable) // 2]
    for p in made:
        p.grad = torch.zeros_like(p)
    assert runner.memory.free_for_training(budget)[0] == 9 * total + size(made)
    for p in trainable:
        p.grad = torch.zeros_like(p)
    assert runner.memory.free_for_training(budget)[0] == 10 * total
    runner.actor.requires_grad_(False)  # a frozen parameter gets no gradient: nothing of it is pending
    for p in trainable:
        p.grad = None
    assert runner.memory.free_for_training(budget)[0] == 10 * total


def test_decomposed_whole_graph_estimate_counts_the_packed_suffix_keys(setup, monkeypatch):
    """Defect (H200, 7B, vid P = 16): the packed suffix attention gathers each sample's prompt rows into its keys,
    and autograd saves them (12.8 GiB in one micro-batch of 8 samples on 4,110-token prompts, repeated to the query
    heads by torch 2.11's varlen call); the whole-graph estimate counted responses and computed prefixes only. Each
    decomposed choice now adds G x prompt rows + responses of K and V per layer, in the heads the attention path
    keeps (test_packing checks those bytes against what autograd saves)."""
    from torchplex.runtime import memory_estimate
    from torchplex.models.packing import suffix_key_heads
    from torchplex.runtime.memory_budget import packed_key_bytes

    monkeypatch.setattr(memory_estimate, "no_recompute_bytes", lambda *a: 0)  # what is left: the packed keys alone
    runner = runner_for(setup, "decomposed", checkpointed=True)
    seen = []
    policy = runner.memory.recompute_policy

    def recording(*args):
        choose = policy(*args)
        return lambda mb, req: (seen.append(req), choose(mb, req))[1]

    monkeypatch.setattr(runner.memory, "recompute_policy", recording)
    out, _ = run_step(runner, setup)
    t, w = runner.actor.args.text, runner.actor.output_weight
    heads = suffix_key_heads(t.num_heads, t.num_kv_heads, t.head_dim, w.device, w.dtype)
    assert heads == t.num_heads > t.num_kv_heads  # CPU: the masked SDPA path keeps K/V repeated to the query heads
    expected = [packed_key_bytes(sum(len(r.prompts[i].input_ids) for i in r.prompt_index) + sum(r.host_lengths()),
                                 t.num_layers, heads, t.head_dim, w.element_size())
                for r in seen]
    assert out.report.recompute["estimates"] == expected and min(expected) > 0


def test_the_budget_caps_held_prefixes_for_the_last_steps_whole_graphs(setup):
    """Defect (H200, 7B, img P = 64, overlapped): the budget counted training at its recompute form, so 56 fused
    prefixes filled the room through training and 52 of 64 micro-batches recomputed (+7 s) where decomposed kept
    all 64 whole. A step now learns its micro-batches' whole graphs with their prefixes held (each choice's estimate
    less the prefixes it computes, scaled) and the next plans cap the held prefixes' rooms with them."""
    from torchplex.runtime.memory_estimate import StepFootprint

    runner = cpu_runner(setup, "decomposed", budget=2**40, micro_batch=4, kv_pool=KV_POOL, checkpointed=True,
                        plan_options={"batched_actor_prefix": False})  # micro-batches compute their prefixes
    params = SamplingParams(n=4, max_new_tokens=6, seed=3)
    shape = runner.shape(setup[1], params)
    first = runner.memory.estimate(shape, runner.settings.plan)
    assert first.held_cap_bytes is None and first.held_cap == ""  # before any step: nothing learned
    out, _ = run_step(runner, setup)
    log = out.report.recompute
    assert all(log["whole"]) and len(log["held_estimates"]) == len(log["estimates"]) > 1
    assert all(h < e for h, e in zip(log["held_estimates"], log["estimates"]))  # the computed prefixes left out
    sizes = [math.ceil(e * runner.memory.graph_scale()) for e in log["held_estimates"]]
    assert runner.memory.learned.whole_graph_sizes == sizes
    # the cap applies only where training holds its prefixes in rounds (batched_actor_prefix): a runner that does,
    # having observed the same step
    rounds = cpu_runner(setup, "decomposed", budget=2**40, micro_batch=4, kv_pool=KV_POOL, checkpointed=True,
                        plan_options={"batched_actor_prefix": True})
    rounds.memory.observe(StepFootprint(recompute=log))
    shape = rounds.shape(setup[1], params)  # with what the step measured
    first = rounds.memory.estimate(shape, rounds.settings.plan)
    assert first.held_cap_bytes == first.train_room_bytes  # the room, uncapped
    assert runner.memory.estimate(shape, runner.settings.plan).held_cap_bytes is None  # no rounds: no cap
    # the tiny model's whole graphs are below its recompute form's count (the cap never binds): graphs k x as
    # large, the largest twice that count, and a budget whose room beside the largest holds 3 of the largest
    # prompt's prefix: the cap
    k = math.ceil(2 * first.residents["train"]["activations"] / max(sizes))
    big = dict(log, held_estimates=[k * e for e in log["held_estimates"]])
    sizes = [math.ceil(e * rounds.memory.graph_scale()) for e in big["held_estimates"]]
    one = math.ceil(shape.compact_bytes_per_token * max(shape.prompt_lengths))
    resident = first.stage_bytes("train") - first.residents["train"]["activations"] + max(sizes)
    assert max(sizes) > first.residents["train"]["activations"]
    capped = cpu_runner(setup, "decomposed", budget=budget_for(resident, 3 * one), micro_batch=4, kv_pool=KV_POOL,
                        checkpointed=True, plan_options={"batched_actor_prefix": True})
    capped.memory.observe(StepFootprint(recompute=big))
    planned = capped.memory.estimate(shape, capped.settings.plan)
    assert 3 * one <= planned.held_cap_bytes <= 3 * one + 1 and planned.train_room_bytes == planned.held_cap_bytes
    plan = capped.plan(setup[1], params)
    assert plan.budget.held_cap.startswith(f"{len(sizes)} of {len(sizes)} micro-batches whole")
    always = cpu_runner(setup, "decomposed", budget=budget_for(resident, 3 * one), micro_batch=4, kv_pool=KV_POOL,
                        checkpointed=True, recompute="always", plan_options={"batched_actor_prefix": True})
    always.memory.observe(StepFootprint(recompute=big))
    assert always.memory.estimate(shape, always.settings.plan).held_cap_bytes is None  # nothing to keep room for
