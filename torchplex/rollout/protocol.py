"""What the step runtime asks of a rollout engine, and what each engine declares it supports.

The shape follows verl's `BaseRollout` (generate, update weights, release, resume): the step calls `generate` to
sample and `release()` to hand the engine's memory (KV pool, gathered weights) back for the phases after rollout.
`generate` itself takes back what it needs (`resume()`) and, in an engine with weights of its own (SGLang, a
rollout model at another TP degree), first brings them to the actor's current weights (`update_weights()`), so a
step cannot sample from a stale policy. Engines whose weights are the actor's own storage do nothing in either.

Capabilities are declared, not discovered: the planner (runtime/plan.py) places fused or decode-window work
only where the engine supports it and records in the plan why it did not otherwise. An engine given a hook it
does not support raises (`reject_unsupported_hooks`) instead of dropping it, so a plan can never say
`window:rollout` while nothing runs there. This is the seam an SGLang backend plugs into.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Protocol, Sequence, runtime_checkable


@dataclass(frozen=True)
class RolloutCapabilities:
    """prefill_hook        `prefill_fn` replaces the engine's prefill (fusion: the actor prefix kept for training)
    samples_finished_hook `on_samples_finished` is called with samples as they finish (window scoring)
    step_hook            `on_step` is called after every decode step (window work once decode began)
    shares_actor_weights the engine decodes on the actor's own parameters, so prefix state it computes with the
                         actor (and its TP heads) is the actor's
    why_not              one line per missing capability, for the plan's reasons"""

    prefill_hook: bool = True
    samples_finished_hook: bool = True
    step_hook: bool = True
    shares_actor_weights: bool = True
    why_not: str = ""


@runtime_checkable
class RolloutEngineProtocol(Protocol):
    capabilities: RolloutCapabilities
    # what the step's memory estimate reads (runtime/memory_estimate.py): the KV memory generate takes on the
    # device (0: the engine's own, outside the step's budget), the samples decoded at once, the prompt tokens of
    # one prefill, and one prompt group's bytes in the pool (0: not planned by the step)
    kv_pool_bytes: int
    max_batch: int
    prefill_tokens: int

    def pool_group_bytes(self, n: int, max_prompt: int, max_new: int) -> int:
        """KV bytes of one group of n samples of a prompt of max_prompt tokens and max_new new tokens."""

    def generate(self, prompts: Sequence, params, *, sample_seeds: Sequence[Sequence[int]] | None = None,
                 on_step: Callable | None = None, prefill_fn: Callable | None = None,
                 on_samples_finished: Callable | None = None) -> list:
        """outputs[prompt][sample] (rollout.engine.SampleOutput); hooks only where `capabilities` allow."""

    def update_weights(self) -> None:
        """Make the next generate sample from the actor's current weights."""

    def release(self) -> None:
        """Free what generate holds (KV pool, gathered weights) until `resume`."""

    def resume(self) -> None:
        """Take back what `release` freed (a no-op where generate allocates lazily)."""


def reject_unsupported_hooks(engine_name: str, capabilities: RolloutCapabilities, *, on_step=None, prefill_fn=None,
                             on_samples_finished=None) -> None:
    """Raise for a hook the engine does not run: a dropped hook would make the step's plan lie."""
    given = {"on_step": (on_step, capabilities.step_hook), "prefill_fn": (prefill_fn, capabilities.prefill_hook),
             "on_samples_finished": (on_samples_finished, capabilities.samples_finished_hook)}
    unsupported = [name for name, (hook, ok) in given.items() if hook is not None and not ok]
    if unsupported:
        raise ValueError(f"{engine_name} does not support {', '.join(unsupported)} ({capabilities.why_not}); the "
                         f"planner should not have placed work there (runtime/plan.py reads its capabilities)")
