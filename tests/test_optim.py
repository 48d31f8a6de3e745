"""Specification of the optimizer factory, the learning-rate schedule and gradient clipping."""

from __future__ import annotations

import math
import time
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from torchplex.components.optim import OPTIMIZER_NAMES, build_lr_scheduler, build_optimizer, clip_grad_norm


def _model(seed: int = 0) -> torch.nn.Module:
    torch.manual_seed(seed)
    return torch.nn.Sequential(torch.nn.Linear(5, 7), torch.nn.ReLU(), torch.nn.Linear(7, 2))


# ---- build_optimizer -------------------------------------------------------------------------------


def test_adamw_from_a_model_covers_only_trainable_params_with_given_hyperparameters():
    model = _model()
    model[0].requires_grad_(False)  # e.g. a frozen tower
    optimizer = build_optimizer(model, "adamw", lr=3e-4, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.1)
    assert type(optimizer) is torch.optim.AdamW
    group = optimizer.param_groups[0]
    assert [id(p) for p in group["params"]] == [id(model[2].weight), id(model[2].bias)]
    assert (group["lr"], group["betas"], group["eps"], group["weight_decay"]) == (3e-4, (0.8, 0.95), 1e-6, 0.1)
    assert group["foreach"] is True and group["fused"] is False  # CPU parameters


def test_adamw_accepts_a_parameter_list():
    model = _model()
    optimizer = build_optimizer(list(model.parameters()), "adamw", lr=1e-3)
    assert len(optimizer.param_groups[0]["params"]) == 4


def test_unknown_optimizer_name_lists_the_known_ones():
    with pytest.raises(ValueError, match="'sgd'.*adamw, adamw8bit, adamw_cpu_offload"):
        build_optimizer(_model(), "sgd", lr=1e-3)
    assert OPTIMIZER_NAMES == ("adamw", "adamw8bit", "adamw_cpu_offload")


def test_adamw8bit_is_built_on_cpu_with_given_hyperparameters():
    from torchao.optim import AdamW8bit

    optimizer = build_optimizer(_model(), "adamw8bit", lr=2e-4, betas=(0.9, 0.99), eps=1e-7, weight_decay=0.05)
    assert isinstance(optimizer, AdamW8bit)
    group = optimizer.param_groups[0]
    # torchao keeps lr as a tensor so that LambdaLR updates it in place without recompiling.
    assert float(group["lr"]) == pytest.approx(2e-4)
    assert (tuple(group["betas"]), group["eps"], group["weight_decay"]) == ((0.9, 0.99), 1e-7, 0.05)


def test_cpu_offload_needs_cuda_parameters():
    with pytest.raises(ValueError, match="adamw_cpu_offload.*CUDA"):
        build_optimizer(_model(), "adamw_cpu_offload", lr=1e-3)


def test_no_trainable_parameters_is_an_error():
    model = _model().requires_grad_(False)
    with pytest.raises(ValueError, match="no trainable parameters"):
        build_optimizer(model, "adamw", lr=1e-3)


# ---- build_lr_scheduler ----------------------------------------------------------------------------


def _lrs_of_training_steps(warmup: int, decay: str, total: int, min_ratio: float, steps: int) -> list[float]:
    """lr used by training steps 1..steps, with the trainer's optimizer.step(); scheduler.step() order."""
    param = torch.nn.Parameter(torch.zeros(1))
    optimizer = torch.optim.SGD([param], lr=2.0)
    scheduler = build_lr_scheduler(optimizer, warmup, decay, total, min_ratio)
    used = []
    for _ in range(steps):
        used.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        scheduler.step()
    return used


def test_warmup_is_linear_and_reaches_peak_at_the_last_warmup_step():
    lrs = _lrs_of_training_steps(warmup=4, decay="constant", total=10, min_ratio=0.0, steps=6)
    assert lrs == pytest.approx([2.0 * 1 / 4, 2.0 * 2 / 4, 2.0 * 3 / 4, 2.0, 2.0, 2.0], rel=1e-12)


def test_linear_decay_reaches_min_lr_at_the_last_step_and_stays():
    # W=2, T=6, r=0.1: decay progress p = (k-2)/4 for k = 3..6, lr = 2 * (1 - 0.9 p).
    lrs = _lrs_of_training_steps(warmup=2, decay="linear", total=6, min_ratio=0.1, steps=8)
    expected = [1.0, 2.0, 2 * 0.775, 2 * 0.55, 2 * 0.325, 2 * 0.1, 2 * 0.1, 2 * 0.1]
    assert lrs == pytest.approx(expected, rel=1e-12)


def test_cosine_decay_follows_half_a_cosine_to_min_lr():
    lrs = _lrs_of_training_steps(warmup=2, decay="cosine", total=6, min_ratio=0.1, steps=8)
    cosine = [0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * p)) for p in (0.25, 0.5, 0.75, 1.0)]
    expected = [1.0, 2.0] + [2 * m for m in cosine] + [2 * 0.1, 2 * 0.1]
    assert lrs == pytest.approx(expected, rel=1e-12)
    assert lrs[3] == pytest.approx(2 * 0.55, rel=1e-12)  # midpoint of the decay: halfway to min


def test_no_warmup_starts_decaying_from_the_first_step():
    lrs = _lrs_of_training_steps(warmup=0, decay="linear", total=4, min_ratio=0.0, steps=4)
    assert lrs == pytest.approx([2 * 0.75, 2 * 0.5, 2 * 0.25, 0.0], abs=1e-12)


def test_a_run_shorter_than_warmup_holds_the_peak_after_warmup():
    lrs = _lrs_of_training_steps(warmup=3, decay="cosine", total=2, min_ratio=0.0, steps=5)
    assert lrs == pytest.approx([2 / 3, 4 / 3, 2.0, 2.0, 2.0], rel=1e-12)


def test_scheduler_state_holds_no_schedule_config():
    # The lambda is a plain function, so a resumed run applies its own (possibly changed) config.
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    state = build_lr_scheduler(optimizer, 2, "cosine", 10, 0.1).state_dict()
    assert state["lr_lambdas"] == [None]


@pytest.mark.parametrize(
    "kwargs, message",
    [
        (dict(warmup_steps=-1), "warmup_steps"),
        (dict(total_steps=0), "total_steps"),
        (dict(min_lr_ratio=1.5), "min_lr_ratio"),
        (dict(decay="step"), "'step'.*constant, linear, cosine"),
    ],
)
def test_invalid_schedule_configuration_is_rejected(kwargs, message):
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=1.0)
    config = dict(warmup_steps=1, decay="linear", total_steps=10, min_lr_ratio=0.0) | kwargs
    with pytest.raises(ValueError, match=message):
        build_lr_scheduler(optimizer, **config)


# ---- clip_grad_norm --------------------------------------------------------------------------------


def _model_with_grads(scale: float = 1.0) -> torch.nn.Module:
    model = _model()
    torch.manual_seed(1)
    (scale * model(torch.randn(8, 5)).pow(2).sum()).backward()
    return model


def _manual_norm(model: torch.nn.Module) -> float:
    return math.sqrt(sum(float(p.grad.double().pow(2).sum()) for p in model.parameters()))


def test_clip_returns_the_pre_clip_l2_norm_and_scales_grads_to_max_norm():
    model = _model_with_grads()
    before = [p.grad.clone() for p in model.parameters()]
    expected_norm = _manual_norm(model)
    max_norm = expected_norm / 4
    norm = clip_grad_norm(model.parameters(), max_norm)
    assert isinstance(norm, float)
    assert norm == pytest.approx(expected_norm, rel=1e-6)
    for grad, old in zip((p.grad for p in model.parameters()), before):
        torch.testing.assert_close(grad, old * (max_norm / expected_norm), rtol=1e-5, atol=1e-7)
    assert _manual_norm(model) == pytest.approx(max_norm, rel=1e-5)


def test_clip_leaves_grads_below_max_norm_unchanged():
    model = _model_with_grads()
    before = [p.grad.clone() for p in model.parameters()]
    norm = clip_grad_norm(model.parameters(), max_norm=1e9)
    assert norm == pytest.approx(_manual_norm(model), rel=1e-6)
    for p, old in zip(model.parameters(), before):
        torch.testing.assert_close(p.grad, old, rtol=0, atol=0)


def test_clip_with_no_max_norm_only_measures():
    model = _model_with_grads()
    before = [p.grad.clone() for p in model.parameters()]
    assert clip_grad_norm(model.parameters(), max_norm=None) == pytest.approx(_manual_norm(model), rel=1e-6)
    for p, old in zip(model.parameters(), before):
        torch.testing.assert_close(p.grad, old, rtol=0, atol=0)


@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
def test_clip_reports_a_non_finite_norm_and_leaves_grads_alone(bad):
    model = _model_with_grads()
    model[0].weight.grad[0, 0] = bad
    before = [p.grad.clone() for p in model.parameters()]
    norm = clip_grad_norm(model.parameters(), max_norm=1.0)
    assert (math.isinf(norm) and norm > 0) if bad == float("inf") else math.isnan(norm)
    for p, old in zip(model.parameters(), before):
        torch.testing.assert_close(p.grad, old, rtol=0, atol=0, equal_nan=True)


class _GradOffloader:
    """Like torchao's CPUOffloadOptimizer during backward: each parameter's gradient is copied to a
    "host" twin (`param_d2h_map[p].grad`) as soon as it is accumulated; the step then uses the twin."""

    def __init__(self, params) -> None:
        self.param_d2h_map = {p: p.detach().clone() for p in params}
        for param in self.param_d2h_map:
            param.register_post_accumulate_grad_hook(self._copy_grad)

    def _copy_grad(self, param: torch.Tensor) -> None:
        self.param_d2h_map[param].grad = param.grad.clone()


def test_clip_also_scales_the_gradient_copies_of_an_offloading_optimizer():
    model = _model()
    offloader = _GradOffloader(model.parameters())
    torch.manual_seed(1)
    model(torch.randn(8, 5)).pow(2).sum().backward()
    expected_norm = _manual_norm(model)
    clip_grad_norm(model.parameters(), expected_norm / 3, optimizer=offloader)
    for param, host in offloader.param_d2h_map.items():
        torch.testing.assert_close(host.grad, param.grad, rtol=0, atol=0)
    assert _manual_norm(model) == pytest.approx(expected_norm / 3, rel=1e-5)


def test_clip_without_grads_is_zero():
    assert clip_grad_norm(_model().parameters(), max_norm=1.0) == 0.0


# ---- DTensor gradients (FSDP2, 2 gloo ranks) -------------------------------------------------------


def _dtensor_clip_worker(rank: int, world_size: int, tmp_dir: str) -> None:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmp_dir}/rendezvous", rank=rank, world_size=world_size)
    mesh = init_device_mesh("cpu", (world_size,))
    reference = _model_with_grads()  # unsharded, same data on every rank
    reference_norm = _manual_norm(reference)

    sharded = _model()
    fully_shard(sharded, mesh=mesh)
    torch.manual_seed(1)
    # FSDP2 averages gradients over ranks; identical batches make that average the reference grad.
    sharded(torch.randn(8, 5)).pow(2).sum().backward()
    norm = clip_grad_norm(sharded.parameters(), max_norm=reference_norm / 2)
    clip_grad_norm(reference.parameters(), max_norm=reference_norm / 2)
    torch.save(
        {
            "norm": norm,
            "reference_norm": reference_norm,
            "grads": [p.grad.full_tensor() for p in sharded.parameters()],
            "reference_grads": [p.grad for p in reference.parameters()],
        },
        Path(tmp_dir) / f"result_rank{rank}.pt",
    )
    dist.barrier()  # neither rank tears gloo down while its peer still talks (SIGABRT at exit, ~1 run in 12)
    dist.destroy_process_group()


@pytest.mark.slow
def test_clip_on_fsdp2_dtensor_grads_matches_the_unsharded_model(tmp_path):
    context = mp.start_processes(
        _dtensor_clip_worker, args=(2, str(tmp_path)), nprocs=2, join=False, start_method="spawn"
    )
    deadline = time.monotonic() + 180
    while not context.join(timeout=1):
        if time.monotonic() > deadline:
            for process in context.processes:
                process.kill()
            pytest.fail("DTensor clip workers did not finish within 180 s")
    for rank in (0, 1):
        result = torch.load(tmp_path / f"result_rank{rank}.pt", weights_only=True)
        assert result["norm"] == pytest.approx(result["reference_norm"], rel=1e-5)
        for grad, reference in zip(result["grads"], result["reference_grads"]):
            torch.testing.assert_close(grad, reference, rtol=1e-5, atol=1e-7)
