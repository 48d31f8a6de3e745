"""TP, FSDP2 and activation checkpointing must not change what the model computes.

Distributed runs spawn CPU processes on gloo, one run per mesh shape (FSDP2 2, TP 2, FSDP2 x TP 2x2); every
rank builds the same seeded model, parallelises it, and runs its share of a fixed batch. Rank 0 gathers
full tensors (DTensor.full_tensor()) and saves them; each test checks one of them against the same
computation on the plain model in this process. fp32 throughout; activations and gradients must agree to
RTOL relative to the tensor's largest magnitude.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from distributed_helpers import free_port, init_gloo, spawn
from torchplex.distributed.mesh import ParallelDims, build_parallel_dims, init_distributed
from torchplex.models.qwen2_5_vl.args import get_flavor
from torchplex.models.qwen2_5_vl.model import Qwen2_5_VLModel
from torchplex.distributed.fsdp import reshard
from torchplex.models.qwen2_5_vl.parallelize import check_tp_divisibility, parallelize_qwen2_5_vl
from torchplex.models.qwen2_5_vl.rope_index import get_rope_index

RTOL = 1e-5
LR = 1e-3
# Adam's first step is lr * g / (|g| + eps): with the usual eps=1e-8 it is a sign function for the many
# gradients near 1e-8 and turns reduction-order noise into whole-lr differences. With eps=1e-3 (gradients
# here are up to ~2e-2) the update is still normalised but moves by at most lr/eps = 1x a gradient error.
ADAM_EPS = 1e-3
# Updated parameters: elementwise within RTOL of the value plus 1e-4 of one step (zero-initialised biases
# are nothing but their update, so a relative-only test would compare lr-sized numbers at 1e-5).
PARAM_ATOL = 1e-4 * LR
TIMEOUT_S = 150
ARGS = get_flavor("debug").with_token_ids(image_token_id=2000, video_token_id=2001, vision_start_token_id=2002,
                                          vision_end_token_id=2003)
GRID = (1, 4, 8)  # 32 patches -> 8 merged image tokens in two attention windows
PATCH = 3 * 2 * 14 * 14
NUM_SAMPLES = 4
RESPONSES = torch.tensor([[11, 12, 13, 14], [21, 22, 23, 24]])  # two responses per prompt (a GRPO group)
FP32 = dict(param_dtype=torch.float32, reduce_dtype=torch.float32)


# ---- model, data, losses: shared by the reference and every rank -----------------------------------------

def build_model(freeze_vision: bool = False) -> Qwen2_5_VLModel:
    model = Qwen2_5_VLModel(ARGS)
    model.init_weights(std=0.05, generator=torch.Generator().manual_seed(0))
    model.visual.requires_grad_(not freeze_vision)
    return model


@dataclass
class Batch:
    input_ids: torch.Tensor     # (B, T), every sample: text, one image, text
    position_ids: torch.Tensor  # (3, B, T)
    next_position: torch.Tensor  # (B,)
    pixel_values: torch.Tensor  # (B * patches, PATCH)
    grid_thw: torch.Tensor      # (B, 3)

    def select(self, start: int, count: int) -> "Batch":
        patches = self.pixel_values.shape[0] // self.input_ids.shape[0]
        return Batch(self.input_ids[start:start + count], self.position_ids[:, start:start + count],
                     self.next_position[start:start + count],
                     self.pixel_values[start * patches:(start + count) * patches], self.grid_thw[start:start + count])


def make_batch() -> Batch:
    g = torch.Generator().manual_seed(1)
    t, h, w = GRID
    image = [ARGS.vision_start_token_id] + [ARGS.image_token_id] * (t * h * w // 4) + [ARGS.vision_end_token_id]
    rows = [torch.randint(0, 1900, (3,), generator=g).tolist() + image
            + torch.randint(0, 1900, (6,), generator=g).tolist() for _ in range(NUM_SAMPLES)]
    input_ids = torch.tensor(rows)
    grid_thw = torch.tensor([GRID] * NUM_SAMPLES)
    position_ids, next_position = get_rope_index(ARGS, input_ids, grid_thw)
    pixel_values = torch.randn(NUM_SAMPLES * t * h * w, PATCH, generator=g)
    return Batch(input_ids, position_ids, next_position, pixel_values, grid_thw)


def hidden_states(model: Qwen2_5_VLModel, batch: Batch) -> torch.Tensor:
    return model(batch.input_ids, batch.position_ids,
                 image_embeds=model.encode_vision(batch.pixel_values, batch.grid_thw))


def next_token_loss(model: Qwen2_5_VLModel, batch: Batch) -> torch.Tensor:
    """Mean next-token cross-entropy over this batch (FSDP2 averages the ranks' gradients)."""
    logits = model.logits(hidden_states(model, batch)[:, :-1])
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch.input_ids[:, 1:].reshape(-1))


def suffix_hidden(model: Qwen2_5_VLModel, prompt: Batch) -> tuple[torch.Tensor, torch.Tensor]:
    """RESPONSES continuing one prompt via prefix_forward / suffix_forward; returns the hidden states that
    predict each response token (S, R, D) and the suffix hidden states themselves (S, R, D)."""
    prefix = model.prefix_forward(prompt.input_ids, prompt.position_ids, prompt.next_position,
                                  image_embeds=model.encode_vision(prompt.pixel_values, prompt.grid_thw))
    hidden = model.suffix_forward(prefix, RESPONSES)
    first = prefix.last_hidden.expand(RESPONSES.shape[0], 1, -1)
    return torch.cat([first, hidden[:, :-1]], dim=1), hidden


def suffix_loss(model: Qwen2_5_VLModel, prompt: Batch) -> torch.Tensor:
    predicting, _ = suffix_hidden(model, prompt)
    logits = model.logits(predicting)
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), RESPONSES.reshape(-1))


def packed_suffix_hidden(model: Qwen2_5_VLModel, prompt: Batch) -> torch.Tensor:
    """suffix_hidden's suffix hidden states through packed_suffix_forward, (S * R, D)."""
    prefix = model.prefix_forward(prompt.input_ids, prompt.position_ids, prompt.next_position,
                                  image_embeds=model.encode_vision(prompt.pixel_values, prompt.grid_thw))
    s, r = RESPONSES.shape
    return model.packed_suffix_forward(prefix, RESPONSES.reshape(-1), [0] * s, [r] * s)


def packed_suffix_loss(model: Qwen2_5_VLModel, prompt: Batch) -> torch.Tensor:
    """suffix_loss through packed_suffix_forward: the responses without their last token, packed back to back."""
    prefix = model.prefix_forward(prompt.input_ids, prompt.position_ids, prompt.next_position,
                                  image_embeds=model.encode_vision(prompt.pixel_values, prompt.grid_thw))
    s, r = RESPONSES.shape
    packed = model.packed_suffix_forward(prefix, RESPONSES[:, :-1].reshape(-1), [0] * s, [r - 1] * s)
    rows = [torch.cat([prefix.last_hidden, packed[i * (r - 1):(i + 1) * (r - 1)]]) for i in range(s)]
    logits = model.logits(torch.cat(rows))
    return F.cross_entropy(logits, RESPONSES.reshape(-1))


def full(t: torch.Tensor) -> torch.Tensor:
    t = t.detach()
    return t.full_tensor() if isinstance(t, DTensor) else t.clone()


def full_grads(model: Qwen2_5_VLModel) -> dict[str, torch.Tensor]:
    return {n: full(p.grad) for n, p in model.named_parameters() if p.grad is not None}


def make_optimizer(model: Qwen2_5_VLModel) -> torch.optim.Optimizer:
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR, eps=ADAM_EPS)


def train_step(model: Qwen2_5_VLModel, batch: Batch, between: Callable[[], None] = lambda: None
               ) -> tuple[torch.Tensor, dict, dict]:
    """One AdamW step (`between` runs after backward, before the step); returns (loss, full gradients, full
    updated parameters) by native name."""
    optimizer = make_optimizer(model)
    loss = next_token_loss(model, batch)
    loss.backward()
    grads = full_grads(model)
    between()
    optimizer.step()
    return loss.detach(), grads, {n: full(p) for n, p in model.named_parameters()}


def assert_close(actual: torch.Tensor, expected: torch.Tensor, what: str) -> None:
    assert actual.shape == expected.shape, f"{what}: shape {tuple(actual.shape)} != {tuple(expected.shape)}"
    err = ((actual - expected).abs().max() / expected.abs().max().clamp_min(1e-30)).item()
    assert err < RTOL, f"{what}: relative error {err:.2e} >= {RTOL}"


def assert_grads_close(actual: dict, expected: dict) -> None:
    assert set(actual) == set(expected), f"parameters with gradients differ: {set(actual) ^ set(expected)}"
    for name in expected:
        assert_close(actual[name], expected[name], f"grad {name}")


def assert_params_close(actual: dict, expected: dict) -> None:
    assert set(actual) == set(expected), f"parameter names differ: {set(actual) ^ set(expected)}"
    for name in expected:
        torch.testing.assert_close(actual[name], expected[name], rtol=RTOL, atol=PARAM_ATOL,
                                   msg=lambda m, name=name: f"updated param {name}: {m}")


# ---- what each rank runs --------------------------------------------------------------------------------

def _gather_dp(t: torch.Tensor, dims: ParallelDims) -> torch.Tensor:
    """Concatenate the dp ranks' results along dim 0 (TP peers hold the same one)."""
    parts = [torch.empty_like(t) for _ in range(dims.dp_shard)]
    dist.all_gather(parts, t.contiguous(), group=dims.dp_mesh.get_group())
    return torch.cat(parts)


def _local_batch(dims: ParallelDims) -> Batch:
    per_rank = NUM_SAMPLES // dims.dp_shard
    return make_batch().select(dims.dp_rank * per_rank, per_rank)


def _parallel_model(dims: ParallelDims, freeze_vision: bool = False) -> Qwen2_5_VLModel:
    return parallelize_qwen2_5_vl(build_model(), dims, freeze_vision=freeze_vision, **FP32)


def run_fsdp(dims: ParallelDims) -> dict:
    """FSDP2 over dp ranks: forward, one training step, the prefix/suffix path's gradients, frozen tower."""
    batch = _local_batch(dims)
    model = _parallel_model(dims)
    with torch.no_grad():
        hidden = _gather_dp(hidden_states(model, batch), dims)
    reshard(model)  # the no-grad forward left the root unit gathered; the optimizer must see the shards

    def no_grad_forward_then_reshard():  # e.g. a metric computed between backward and the optimizer step
        with torch.no_grad():
            hidden_states(model, batch)
        reshard(model)

    loss, grads, params = train_step(model, batch, between=no_grad_forward_then_reshard)
    with torch.no_grad():
        hidden_after_step = _gather_dp(hidden_states(model, batch), dims)

    model = _parallel_model(dims)
    suffix_loss(model, batch.select(0, 1)).backward()  # dp rank r continues prompt r * (NUM_SAMPLES / dp)
    suffix_grads = full_grads(model)
    model = _parallel_model(dims)
    packed_suffix_loss(model, batch.select(0, 1)).backward()
    packed_suffix_grads = full_grads(model)

    frozen = _parallel_model(dims, freeze_vision=True)
    next_token_loss(frozen, batch).backward()
    vision_sharded = all(isinstance(p, DTensor) and p.to_local().shape[0] < p.shape[0]
                         for p in frozen.visual.parameters())
    return {"hidden": hidden, "loss": _gather_dp(loss.view(1), dims).mean(), "grads": grads, "params": params,
            "hidden_after_step": hidden_after_step, "suffix_grads": suffix_grads,
            "packed_suffix_grads": packed_suffix_grads, "frozen_grads": full_grads(frozen), "vision_sharded": vision_sharded}


def run_tp(dims: ParallelDims) -> dict:
    """TP over all ranks, the whole batch on each: forward and the prefix/suffix path."""
    model = _parallel_model(dims)
    batch = make_batch()
    with torch.no_grad():
        _, suffix = suffix_hidden(model, batch.select(0, 1))
        packed = packed_suffix_hidden(model, batch.select(0, 1))
        kv_heads_per_rank = model.prefix_forward(batch.input_ids[:1, :4], batch.position_ids[:, :1, :4],
                                                 batch.next_position[:1]).k[0].shape[1]
        return {"hidden": hidden_states(model, batch), "suffix": suffix, "packed_suffix": packed,
                "kv_heads_per_rank": kv_heads_per_rank}


def run_train(dims: ParallelDims) -> dict:
    loss, grads, params = train_step(_parallel_model(dims), _local_batch(dims))
    return {"loss": _gather_dp(loss.view(1), dims).mean(), "grads": grads, "params": params}


RUNS = {f.__name__: f for f in (run_fsdp, run_tp, run_train)}


def _worker(rank: int, world_size: int, port: int, run: str, dp_shard: int, tp: int, out_path: str) -> None:
    init_gloo(rank, world_size, port)
    try:
        result = RUNS[run](build_parallel_dims(dp_shard, tp, world_size))
        if rank == 0:
            torch.save(result, out_path)
    finally:
        dist.destroy_process_group()


def run_distributed(run: Callable[[ParallelDims], dict], dp_shard: int, tp: int, out_dir) -> dict:
    world_size = dp_shard * tp
    out_path = str(out_dir / f"{run.__name__}_{dp_shard}x{tp}.pt")
    spawn(_worker, world_size, (free_port(), run.__name__, dp_shard, tp, out_path), TIMEOUT_S, what=run.__name__)
    return torch.load(out_path)


@pytest.fixture(scope="module")
def fsdp2(tmp_path_factory) -> dict:
    return run_distributed(run_fsdp, dp_shard=2, tp=1, out_dir=tmp_path_factory.mktemp("fsdp2"))


@pytest.fixture(scope="module")
def tp2(tmp_path_factory) -> dict:
    return run_distributed(run_tp, dp_shard=1, tp=2, out_dir=tmp_path_factory.mktemp("tp2"))


@pytest.fixture(scope="module")
def fsdp2_tp2(tmp_path_factory) -> dict:
    return run_distributed(run_train, dp_shard=2, tp=2, out_dir=tmp_path_factory.mktemp("fsdp2_tp2"))


# ---- reference: the plain model in this process -----------------------------------------------------------

@pytest.fixture(scope="module")
def reference() -> dict:
    batch = make_batch()
    model = build_model()
    with torch.no_grad():
        hidden = hidden_states(model, batch)
        _, suffix = suffix_hidden(model, batch.select(0, 1))
    loss, grads, params = train_step(model, batch)
    with torch.no_grad():
        hidden_after_step = hidden_states(model, batch)

    # Two dp ranks each continue their first prompt (0 and 2); FSDP2 averages their gradients.
    model = build_model()
    ((suffix_loss(model, batch.select(0, 1)) + suffix_loss(model, batch.select(2, 1))) / 2).backward()
    suffix_grads = full_grads(model)

    frozen = build_model(freeze_vision=True)
    next_token_loss(frozen, batch).backward()
    return {"hidden": hidden, "suffix": suffix, "loss": loss, "grads": grads, "params": params,
            "hidden_after_step": hidden_after_step, "suffix_grads": suffix_grads, "frozen_grads": full_grads(frozen)}


# ---- FSDP2 over 2 ranks -------------------------------------------------------------------------------

@pytest.mark.slow
def test_fsdp2_forward_matches_single_process(fsdp2, reference):
    assert_close(fsdp2["hidden"], reference["hidden"], "hidden")


@pytest.mark.slow
def test_fsdp2_training_step_matches_single_process(fsdp2, reference):
    assert_close(fsdp2["loss"], reference["loss"], "loss")
    assert any(n.startswith("visual.") for n in fsdp2["grads"]), "gradients must reach the vision tower"
    assert_grads_close(fsdp2["grads"], reference["grads"])
    assert_params_close(fsdp2["params"], reference["params"])


@pytest.mark.slow
def test_fsdp2_reshard_lets_the_next_forward_see_the_step(fsdp2, reference):
    """A no-grad forward between backward and step re-gathers the root unit; after reshard() the forward
    following the step must use the updated weights, not that gathered copy."""
    assert_close(fsdp2["hidden_after_step"], reference["hidden_after_step"], "hidden after step")


@pytest.mark.slow
def test_fsdp2_prefix_suffix_gradients_match_single_process(fsdp2, reference):
    """Each decoder layer runs twice per step (prefix, then suffix); FSDP2 must sum both uses' gradients."""
    assert_grads_close(fsdp2["suffix_grads"], reference["suffix_grads"])


@pytest.mark.slow
def test_fsdp2_packed_suffix_gradients_match_single_process(fsdp2, reference):
    """packed_suffix_forward is a root entry point under FSDP2 too (registered like suffix_forward): the packed
    suffixes' gradients equal the padded single-process ones."""
    assert_grads_close(fsdp2["packed_suffix_grads"], reference["suffix_grads"])


@pytest.mark.slow
def test_fsdp2_shards_frozen_vision_tower_without_gradients(fsdp2, reference):
    assert fsdp2["vision_sharded"], "FSDP2 must shard the frozen vision tower too"
    assert not any(n.startswith("visual.") for n in fsdp2["frozen_grads"])
    assert_grads_close(fsdp2["frozen_grads"], reference["frozen_grads"])


# ---- TP over 2 ranks -----------------------------------------------------------------------------------

@pytest.mark.slow
def test_tp2_forward_matches_single_process(tp2, reference):
    assert_close(tp2["hidden"], reference["hidden"], "hidden")


@pytest.mark.slow
def test_tp2_suffix_forward_matches_single_process(tp2, reference):
    assert tp2["kv_heads_per_rank"] == ARGS.text.num_kv_heads // 2, "each TP rank keeps K/V of its own heads"
    assert_close(tp2["suffix"], reference["suffix"], "suffix hidden")
    assert_close(tp2["packed_suffix"], reference["suffix"].reshape(tp2["packed_suffix"].shape), "packed suffix")


# ---- FSDP2 x TP on 2 x 2 ranks -------------------------------------------------------------------------

@pytest.mark.slow
def test_fsdp2_x_tp2_training_step_matches_single_process(fsdp2_tp2, reference):
    assert_close(fsdp2_tp2["loss"], reference["loss"], "loss")
    assert_grads_close(fsdp2_tp2["grads"], reference["grads"])
    assert_params_close(fsdp2_tp2["params"], reference["params"])


# ---- one process ---------------------------------------------------------------------------------------

def test_activation_checkpointing_keeps_gradients():
    batch = make_batch().select(0, 2)
    plain = build_model()
    next_token_loss(plain, batch).backward()
    checkpointed = parallelize_qwen2_5_vl(build_model(), None, activation_checkpointing=True)
    assert type(checkpointed.layers[0]).__name__ == "CheckpointedDecoderLayer"
    assert type(checkpointed.visual.blocks[0]).__name__ == "CheckpointedVisionBlock"
    next_token_loss(checkpointed, batch).backward()
    assert_grads_close(full_grads(checkpointed), full_grads(plain))


def test_compiled_checkpointed_layers_keep_gradients():
    """compile on top of activation checkpointing, through the prefix/suffix path, whose attention contexts
    mutate themselves inside the checkpointed layers. The "eager" backend runs dynamo's tracing (where such
    mutations are accepted or refused) without code generation; a refusal would silently fall back to
    uncompiled layers, so the test also checks that graphs were captured."""
    prompt = make_batch().select(0, 1)
    plain = build_model()
    suffix_loss(plain, prompt).backward()
    compiled = parallelize_qwen2_5_vl(build_model(), None, activation_checkpointing=True, compile=True,
                                      compile_backend="eager")
    torch._dynamo.utils.counters.clear()
    suffix_loss(compiled, prompt).backward()
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] > 0, "no decoder-layer graph was compiled"
    assert_grads_close(full_grads(compiled), full_grads(plain))


def test_tp_degree_must_divide_heads():
    check_tp_divisibility(build_model(), 2)
    with pytest.raises(ValueError, match="num_heads"):
        check_tp_divisibility(build_model(), 3)  # debug flavor: 4 heads, 2 kv heads
    with pytest.raises(ValueError, match="num_kv_heads"):
        check_tp_divisibility(build_model(), 4)


def test_init_distributed_outside_torchrun_is_one_process(monkeypatch):
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    assert init_distributed() == (0, 1, torch.device("cpu"))
    assert not dist.is_initialized()


class Exited(Exception):
    pass


def test_finish_distributed_on_gloo_destroys_the_group_then_exits_zero(monkeypatch, tmp_path):
    """A finished gloo job leaves by os._exit(0) after destroying its group and flushing its logs (finalisation
    can abort it in gloo's threads); without a group nothing exits."""
    import logging

    from torchplex.distributed import mesh

    calls = []
    monkeypatch.setattr(logging, "shutdown", lambda: calls.append(("logs flushed", dist.is_initialized())))

    def fake_exit(code):
        calls.append(("exit", code, dist.is_initialized()))
        raise Exited

    monkeypatch.setattr(os, "_exit", fake_exit)
    mesh.finish_distributed()  # no group: returns
    assert calls == []
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    with pytest.raises(Exited):
        mesh.finish_distributed()
    assert calls == [("logs flushed", False), ("exit", 0, False)]


def test_parallel_dims_validate_degrees():
    assert build_parallel_dims(-1, 2, 8).dp_shard == 4
    with pytest.raises(ValueError, match="world_size"):
        build_parallel_dims(2, 2, 6)
