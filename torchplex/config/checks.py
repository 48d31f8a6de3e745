"""What makes a config valid beyond its types: each key's range, the rules between keys, finite floats, reward names
that resolve; and the named algorithm's settings for the keys a run did not give."""

from __future__ import annotations

import math
from typing import get_origin

from .schema import ALGORITHM_DEFAULTS, Config, ConfigError, section_types


def apply_algorithm_defaults(cfg: Config, given: set[str]) -> None:
    """The named algorithm's settings for the algorithm keys that were not given."""
    for key, value in ALGORITHM_DEFAULTS[cfg.algorithm.name].items():
        if f"algorithm.{key}" not in given:
            setattr(cfg.algorithm, key, value)


def reachable(cfg: Config, tokens: int, sequences: int) -> bool:
    """Whether a micro-batch token budget can bind beside a bound on its sequences: `sequences` of the longest
    sequence (a response of rollout.max_new_tokens; its prompt too in serial mode, where a sample costs both) hold
    at least `tokens`. Either 0 (the planner's budget, no bound) always can."""
    longest = cfg.rollout.max_new_tokens + (cfg.data.max_prompt_tokens if cfg.runtime.mode == "serial" else 0)
    return not tokens or not sequences or tokens <= sequences * longest


# Whole-config sanity checks: (key, predicate, requirement). Run after every override so the combined result counts.
_CHECKS = [
    ("rollout.n_samples", lambda c: c.rollout.n_samples >= 2,
     "must be >= 2: the group-relative advantage compares a prompt's samples, so one sample per prompt gives "
     "every advantage 0 and trains nothing"),
    ("rollout.temperature", lambda c: c.rollout.temperature >= 0, "must be >= 0"),
    ("rollout.top_p", lambda c: 0 < c.rollout.top_p <= 1, "must be in (0, 1]"),
    ("rollout.top_k", lambda c: c.rollout.top_k >= 0, "must be >= 0 (0 = off)"),
    ("rollout.sglang_timeout_s", lambda c: c.rollout.sglang_timeout_s > 0, "must be > 0"),
    ("rollout.sglang_mem_fraction", lambda c: 0 < c.rollout.sglang_mem_fraction < 1, "must be in (0, 1)"),
    ("rollout.sglang_bucket_mib", lambda c: c.rollout.sglang_bucket_mib >= 1, "must be >= 1"),
    ("rollout.sglang_deterministic", lambda c: not c.rollout.sglang_deterministic or c.rollout.backend == "sglang",
     "needs rollout.backend = \"sglang\" (the native engine's sampling is seeded per sample already)"),
    ("algorithm.clip_low", lambda c: 0 <= c.algorithm.clip_low < 1, "must be in [0, 1)"),
    ("algorithm.clip_high", lambda c: c.algorithm.clip_high >= 0, "must be >= 0"),
    ("algorithm.micro_batch_tokens", lambda c: c.algorithm.micro_batch_tokens >= 0,
     "must be >= 0 (0 = the planner's, from the memory budget)"),
    ("algorithm.ref_micro_batch_tokens", lambda c: c.algorithm.ref_micro_batch_tokens >= 0,
     "must be >= 0 (0 = the planner's, from the memory budget)"),
    ("algorithm.micro_batch_size", lambda c: c.algorithm.micro_batch_size >= 0, "must be >= 0 (0 = no bound)"),
    ("algorithm.ref_micro_batch_size", lambda c: c.algorithm.ref_micro_batch_size >= 0,
     "must be >= 0 (0 = algorithm.micro_batch_size)"),
    ("algorithm.micro_batch_tokens",
     lambda c: reachable(c, c.algorithm.micro_batch_tokens, c.algorithm.micro_batch_size),
     "can never be reached: algorithm.micro_batch_size sequences of the longest (rollout.max_new_tokens tokens, "
     "+ data.max_prompt_tokens in serial mode) hold fewer. Set one of the two: algorithm.micro_batch_size = 0 (no "
     "bound on sequences) or a smaller algorithm.micro_batch_tokens"),
    ("algorithm.ref_micro_batch_tokens",
     lambda c: reachable(c, c.algorithm.ref_micro_batch_tokens,
                         c.algorithm.ref_micro_batch_size or c.algorithm.micro_batch_size),
     "can never be reached: algorithm.ref_micro_batch_size sequences (0: algorithm.micro_batch_size) of the longest "
     "(rollout.max_new_tokens tokens, + data.max_prompt_tokens in serial mode) hold fewer. Set one of the two: "
     "no bound on sequences or a smaller algorithm.ref_micro_batch_tokens"),
    ("algorithm.ppo_epochs", lambda c: c.algorithm.ppo_epochs >= 1, "must be >= 1 (0 epochs train nothing)"),
    ("memory.budget_gib", lambda c: c.memory.budget_gib >= 0, "must be >= 0 (0 = the device's memory)"),
    ("reward.weights", lambda c: len(c.reward.weights) == len(c.reward.functions),
     "must have one weight per entry of reward.functions"),
    ("reward.max_failure_fraction", lambda c: 0 <= c.reward.max_failure_fraction <= 1, "must be in [0, 1]"),
    ("data.eval_k", lambda c: c.data.eval_k >= 0, "must be >= 0"),
    ("parallelism.dp_shard", lambda c: c.parallelism.dp_shard == -1 or c.parallelism.dp_shard >= 1,
     "must be -1 (all remaining ranks) or >= 1"),
    ("parallelism.tp", lambda c: c.parallelism.tp >= 1, "must be >= 1"),
    ("parallelism.rollout_tp", lambda c: c.parallelism.rollout_tp >= 1, "must be >= 1"),
    ("runtime.reference_in_window", lambda c: not (c.runtime.reference_in_window and c.memory.managed),
     "reads the reference weights during rollout, but memory.managed keeps them on the device only in the ref "
     "phase: turn one of them off"),
]


# Ranges of the numeric keys: a bad value fails at start-up naming the key, not steps later (log_interval = 0 was a
# ZeroDivisionError after the warm-up). Floats must also be finite (checked for every float key below).
_RANGES = [
    ("job.seed", lambda v: 0 <= v < 2**32, "must be in [0, 2**32) (numpy's seed range)"),
    ("data.synthetic_seed", lambda v: 0 <= v < 2**32, "must be in [0, 2**32) (numpy's seed range)"),
    ("data.synthetic_train", lambda v: v >= 1, "must be >= 1"),
    ("data.synthetic_eval", lambda v: v >= 0, "must be >= 0"),
    ("data.synthetic_size", lambda v: v == 0 or (v >= 28 and v % 2 == 0), "must be 0 (the task's default) or an "
     "even number of pixels >= 28"),
    ("data.synthetic_frames", lambda v: v >= 0, "must be >= 0 (0: the task's default)"),
    ("data.prompts_per_step", lambda v: v >= 1, "must be >= 1"),
    ("data.max_prompt_tokens", lambda v: v >= 1, "must be >= 1"),
    ("data.eval_prompts", lambda v: v >= 0, "must be >= 0"),
    ("rollout.max_new_tokens", lambda v: v >= 1, "must be >= 1"),
    ("rollout.kv_pool_gib", lambda v: v >= 0, "must be >= 0 (0 = sized from the memory budget)"),
    ("rollout.max_batch", lambda v: v >= 1, "must be >= 1"),
    ("algorithm.kl_coef", lambda v: v >= 0, "must be >= 0 (0 = no reference model)"),
    ("optimizer.lr", lambda v: v > 0, "must be > 0"),
    ("optimizer.beta1", lambda v: 0 <= v < 1, "must be in [0, 1)"),
    ("optimizer.beta2", lambda v: 0 <= v < 1, "must be in [0, 1)"),
    ("optimizer.eps", lambda v: v > 0, "must be > 0"),
    ("optimizer.weight_decay", lambda v: v >= 0, "must be >= 0"),
    ("lr_scheduler.warmup_steps", lambda v: v >= 0, "must be >= 0"),
    ("lr_scheduler.min_lr_ratio", lambda v: 0 <= v <= 1, "must be in [0, 1]"),
    ("training.steps", lambda v: v >= 1, "must be >= 1"),
    ("training.sft_warmup_steps", lambda v: v >= 0, "must be >= 0"),
    ("training.sft_lr", lambda v: v > 0, "must be > 0"),
    ("training.sft_batch_size", lambda v: v >= 1, "must be >= 1"),
    ("checkpoint.interval", lambda v: v >= 1, "must be >= 1"),
    ("checkpoint.keep_latest_k", lambda v: v >= 0, "must be >= 0 (0 = keep all)"),
    ("metrics.log_interval", lambda v: v >= 1, "must be >= 1"),
    ("metrics.eval_interval", lambda v: v >= 0, "must be >= 0 (0 = no evaluation)"),
]
_CHECKS += [(key, (lambda c, k=key, ok=ok: ok(getattr(getattr(c, k.split(".")[0]), k.split(".")[1]))), req)
            for key, ok, req in _RANGES]


def _non_finite_floats(cfg: Config) -> list[str]:
    """section.key of every float (or list-of-float element) that is nan or inf."""
    bad = []
    for section, keys in section_types().items():
        for key, annotation in keys.items():
            value = getattr(getattr(cfg, section), key)
            values = value if get_origin(annotation) is list else [value]
            if any(isinstance(v, float) and not math.isfinite(v) for v in values):
                bad.append(f"{section}.{key}")
    return bad


def check_values(cfg: Config, origin: str = "") -> None:
    where = f" (config from {origin})" if origin else ""
    for key in _non_finite_floats(cfg):
        section, name = key.split(".")
        raise ConfigError(f"{key} = {getattr(getattr(cfg, section), name)!r} must be a finite number{where}")
    for key, ok, requirement in _CHECKS:
        if not ok(cfg):
            section, name = key.split(".")
            shown = getattr(getattr(cfg, section), name)
            raise ConfigError(f"{key} = {shown!r} {requirement}" + (f" (config from {origin})" if origin else ""))




def check_rewards(cfg: Config, origin: str = "") -> None:
    """Every reward.functions entry and reward.correct name a function: a built-in, "module:function" or
    "path/file.py:function" (importing a user's module runs it). Checked with the config, so a misspelled name is
    one line before any model is loaded."""
    from ..rl.reward_functions import get_reward, is_builtin

    where = f" (config from {origin})" if origin else ""
    named = [(f"reward.functions[{i}]", n) for i, n in enumerate(cfg.reward.functions)]
    for key, name in named + [("reward.correct", cfg.reward.correct)]:
        try:
            get_reward(name)
        except Exception as err:  # noqa: BLE001 - whatever a user's module raises on import is theirs to fix
            reason = err.args[0] if isinstance(err, KeyError) and err.args else f"{type(err).__name__}: {err}"
            if isinstance(err, ModuleNotFoundError) and not is_builtin(name):
                reason += ("; a module must be importable or a file module.py in the folder the name is relative "
                           "to (the command's folder, or the TOML's), or give path/to/file.py:function")
            raise ConfigError(f"{key} = {name!r}{where}: {reason}") from None


