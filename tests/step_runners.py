"""Step runners over the tiny checkpoint for CPU tests of the executor (the grpo_assets fixture's model and
prompts), with an optimizer that keeps the gradients it stepped on, so tests compare whole steps across settings."""

from __future__ import annotations

import copy
from contextlib import contextmanager

import torch

from torchplex.models.qwen2_5_vl.parallelize import apply_activation_checkpointing
from torchplex.rl.losses import PolicyLossConfig
from torchplex.rollout.engine import RolloutEngine
from torchplex.rollout.sampling import SamplingParams
from torchplex.components.peak_memory import PeakWindows
from torchplex.runtime.build import footprint
from torchplex.runtime.memory_estimate import MemoryEstimator
from torchplex.runtime.plan import PlanOptions
from torchplex.runtime.settings import StepSettings
from torchplex.runtime.step import GRPOStep


class RecordingSGD(torch.optim.SGD):
    """SGD that keeps a copy of every gradient it steps on (the step's gradients, compared across modes)."""

    def step(self, closure=None):
        self.grads = [p.grad.clone() for g in self.param_groups for p in g["params"]]
        return super().step(closure)


def grpo_step(actor, reference, engine, optimizer, tokenizer, settings: StepSettings, *, dp_size: int = 1,
              dp_group=None, windows: PeakWindows | None = None) -> GRPOStep:
    """A GRPOStep with its memory estimate, as runtime/build.py makes one from a config; `windows` stands in for the
    allocator's counters (measured steps on CPU)."""
    device = next(actor.parameters()).device
    memory = MemoryEstimator(footprint(actor, reference, engine, settings, dp_size), engine, device,
                             measured=windows is not None or device.type == "cuda",
                             trainable=[p for p in actor.parameters() if p.requires_grad])
    step = GRPOStep(actor, reference, engine, optimizer, None, tokenizer, settings, memory, dp_size=dp_size,
                    dp_group=dp_group)
    if windows is not None:
        step.windows = windows
    return step


def cpu_runner(setup, mode: str, *, budget: int, micro_batch: int, kv_pool: int, checkpointed: bool = False,
               plan_options: dict | None = None, windows: PeakWindows | None = None, **settings) -> GRPOStep:
    """A GRPOStep of `mode` on a copy of the setup's actor (checkpointed blocks if asked) and reference, a
    memory budget of `budget` bytes (0: the device's), SGD at lr 0.1; `plan_options` go to PlanOptions, `settings`
    to StepSettings; `windows`: scripted allocator counters (a measured step on CPU)."""
    processor, prompts, base, reference = setup
    actor = copy.deepcopy(base)
    if checkpointed:
        apply_activation_checkpointing(actor)
    engine = RolloutEngine(actor, kv_pool_bytes=kv_pool)
    optimizer = RecordingSGD([p for p in actor.parameters() if p.requires_grad], lr=0.1)
    step_settings = StepSettings(reward_names=["format"], reward_weights=[1.0], micro_batch_size=micro_batch,
                                 grad_clip=1e9, loss=PolicyLossConfig(kl_coef=0.1),
                                 plan=PlanOptions(mode=mode, memory_budget_bytes=budget, **(plan_options or {})),
                                 **settings)
    return grpo_step(actor, copy.deepcopy(reference), engine, optimizer, processor.tokenizer, step_settings,
                     windows=windows)


def run_recording(runner: GRPOStep, setup, module: torch.nn.Module, record):
    """One step over the setup's prompts (4 samples of up to 6 tokens each), with `record(args)` called before every
    forward of `module`; returns the step's output."""
    prompts, tokenizer = setup[1], setup[0].tokenizer
    params = SamplingParams(n=4, max_new_tokens=6, seed=3, stop_token_ids=[tokenizer.convert_tokens_to_ids("<|im_end|>")])
    hook = module.register_forward_pre_hook(lambda m, args: record(args))
    try:
        return runner.run(prompts, [""] * len(prompts), params)
    finally:
        hook.remove()


class StandInCounter:
    """The allocator's counters, stood in for on CPU: `now` is what is allocated, `top` the peak since a reset."""

    def __init__(self, now: int = 0):
        self.now = self.top = now

    def allocated(self) -> int:
        return self.now

    def max_allocated(self) -> int:
        return max(self.top, self.now)

    def reset_peak(self) -> None:
        self.top = self.now


class ScriptedWindows(PeakWindows):
    """PeakWindows whose windows each peak `sizes[name]` above what they found (the names entered kept in order);
    the gradients' growth is left out: the scripted peaks hold none."""

    def __init__(self, sizes: dict[str, int], now: int = 2**30):
        super().__init__(StandInCounter(now))
        self.sizes = sizes
        self.names: list[str] = []

    @contextmanager
    def window(self, name, growth=None):
        self.names.append(name)
        with super().window(name):
            yield
            self.counter.top = max(self.counter.top, self.counter.now + self.sizes[name])
