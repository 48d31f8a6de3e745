"""Training configuration: one dataclass per TOML section, read from a file, then overridden on the command line.

    python -m torchplex.train --job.config_file train_configs/debug.toml --optimizer.lr=3e-6 --model.compile true

Precedence is: dataclass default < TOML file < command line (left to right). Every key is checked against the
dataclasses, so a typo fails at start-up naming the key, where it came from and the closest valid key, instead of
silently training with a default. `Config.save` writes the resolved config as TOML so a run folder records exactly
what ran and can be re-launched with `--job.config_file <run>/config.toml`.
"""

from __future__ import annotations

import difflib
import functools
import json
import sys
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Literal, get_args, get_origin, get_type_hints

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover - exercised only on 3.10
    import tomli as tomllib


class ConfigError(ValueError):
    """A config key or value is invalid; the message names the key and the file (or "command line")."""


COMMAND_LINE = "command line"


# ---- sections ---------------------------------------------------------------------------------------------------
@dataclass
class JobConfig:
    config_file: str = ""  # the TOML this config was read from ("" = dataclass defaults only)
    name: str = "debug"
    output_dir: str = "runs"  # the run folder is <output_dir>/<name>
    seed: int = 0
    description: str = ""

    @property
    def run_dir(self) -> Path:
        return Path(self.output_dir) / self.name


@dataclass
class ModelConfig:
    flavor: str = "debug"  # a key of torchplex.models.qwen2_5_vl.args.FLAVORS
    hf_checkpoint: str = ""  # HF folder (config.json + safetensors); "" = random init of `flavor`
    make_tiny_if_missing: bool = True  # build a tiny HF checkpoint at hf_checkpoint when absent (debug runs)
    dtype: Literal["float32", "bfloat16"] = "float32"
    freeze_vision: bool = False
    activation_checkpointing: bool = False
    compile: bool = False


@dataclass
class DataConfig:
    train_file: str = ""  # "" = generate the synthetic task into synthetic_dir
    eval_file: str = ""
    synthetic_dir: str = "outputs/synthetic"
    synthetic_train: int = 2000
    synthetic_eval: int = 200
    prompts_per_step: int = 8  # each prompt is sampled rollout.n_samples times
    max_prompt_tokens: int = 1024  # image tokens included
    shuffle: bool = True
    eval_prompts: int = 64


@dataclass
class RolloutConfig:
    backend: Literal["native", "sglang"] = "native"
    n_samples: int = 8  # group size for the group-relative advantage
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0  # 0 = off
    max_new_tokens: int = 32
    kv_pool_gib: float = 1.0  # 0 = sized each step from the memory budget (memory.budget_gib): all groups if they fit
    max_batch: int = 256  # sequences decoded concurrently


@dataclass
class AlgorithmConfig:
    advantage: Literal["grpo", "dr_grpo", "rloo"] = "grpo"
    clip_low: float = 0.2  # ratio clipped to [1 - clip_low, 1 + clip_high] ("clip-higher" when they differ)
    clip_high: float = 0.28
    kl_coef: float = 0.0  # 0 = no reference model is needed
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"
    loss_agg: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum-norm"] = "token-mean"
    importance: Literal["token", "sequence"] = "token"  # per-token (GRPO) or per-sequence (GSPO) ratio
    dynamic_sampling: bool = False  # drop groups whose rewards are all equal (zero advantage)
    ppo_epochs: int = 1
    micro_batch_size: int = 8  # sequences per forward/backward
    entropy_coef: float = 0.0


@dataclass
class RewardConfig:
    functions: list[str] = field(default_factory=lambda: ["accuracy", "format"])
    weights: list[float] = field(default_factory=lambda: [1.0, 0.1])  # one per function


@dataclass
class OptimizerConfig:
    name: Literal["adamw", "adamw8bit", "adamw_cpu_offload"] = "adamw"
    lr: float = 1e-5
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    weight_decay: float = 0.0
    grad_clip: float = 1.0  # max global grad norm; <= 0 disables clipping


@dataclass
class LRSchedulerConfig:
    warmup_steps: int = 0
    decay: Literal["constant", "linear", "cosine"] = "constant"
    min_lr_ratio: float = 0.0  # floor of linear/cosine decay, as a fraction of optimizer.lr


@dataclass
class TrainingConfig:
    steps: int = 20
    sft_warmup_steps: int = 0  # supervised steps before RL (the debug model starts from random weights)
    sft_lr: float = 1e-3
    sft_batch_size: int = 16


@dataclass
class CheckpointConfig:
    enable: bool = False
    interval: int = 10  # steps
    folder: str = "checkpoints"  # relative to the run folder
    keep_latest_k: int = 2  # 0 = keep all
    resume: bool = True  # load the latest checkpoint in folder when one exists
    export_hf_at_end: bool = False


@dataclass
class MetricsConfig:
    log_interval: int = 1
    tensorboard: bool = True
    eval_interval: int = 10  # 0 = no evaluation
    progress_bar: bool = True


@dataclass
class RuntimeConfig:
    mode: Literal["serial", "decomposed", "overlapped"] = "serial"
    checkpoint_prefix: bool = False  # decomposed/overlapped: recompute the prefix in backward instead of holding it
    # decomposed/overlapped: the reference prefix as compiled graphs per prompt-length bucket (CUDA graphs on a GPU);
    # needs a reference of plain tensors (tp 1, no FSDP2 sharding)
    ref_prefix_graphs: bool = False
    # overlapped: the reference prefixes, and the reference log-probs of each sample as soon as it has finished,
    # computed in the rollout decode window on a second host thread (runtime/window.py); equal up to rounding
    reference_in_window: bool = False
    window_sample_batch: int = 0  # overlapped window: finished samples of a prompt per job; 0: half a group


@dataclass
class ParallelismConfig:
    dp_shard: int = -1  # -1 = every rank left over after tp
    tp: int = 1
    rollout_tp: int = 1


@dataclass
class MemoryConfig:
    managed: bool = False
    # what the step may use on its device; 0 = the device's (CUDA: free + this process's cached blocks; CPU: the
    # host's memory). Held prefixes and a budget-sized KV pool get what every resident group leaves (docs/memory.md)
    budget_gib: float = 0.0


@dataclass
class Config:
    job: JobConfig = field(default_factory=JobConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    optimizer: OptimizerConfig = field(default_factory=OptimizerConfig)
    lr_scheduler: LRSchedulerConfig = field(default_factory=LRSchedulerConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    metrics: MetricsConfig = field(default_factory=MetricsConfig)
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    parallelism: ParallelismConfig = field(default_factory=ParallelismConfig)
    memory: MemoryConfig = field(default_factory=MemoryConfig)

    def to_dict(self) -> dict[str, dict[str, Any]]:
        return asdict(self)  # deep-copies the lists

    @classmethod
    def from_dict(cls, data: dict[str, Any], origin: str = "dict") -> "Config":
        """Defaults overridden by `data` ({section: {key: value}}); missing keys keep their default."""
        cfg = cls()
        _apply_tables(cfg, data, origin)
        _check_values(cfg)
        return cfg

    def save(self, path: str | Path) -> Path:
        """Write the resolved config as TOML (loadable with `--job.config_file path`)."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("# resolved torchplex config\n" + to_toml(self.to_dict()))
        return path


# ---- schema lookups ---------------------------------------------------------------------------------------------
@functools.cache
def _sections() -> dict[str, dict[str, Any]]:
    """{section: {key: type annotation}} read from the dataclasses, so they are the only schema."""
    return {f.name: get_type_hints(get_type_hints(Config)[f.name]) for f in fields(Config)}


def _suggest(section: str, key: str | None) -> str:
    """' (did you mean X?)' for the closest valid section or section.key, or ''."""
    sections = _sections()
    if key is None:
        close = difflib.get_close_matches(section, list(sections), n=1)
        return f" (did you mean [{close[0]}]?)" if close else ""
    close = difflib.get_close_matches(key, list(sections.get(section, {})), n=1)
    if close:
        return f" (did you mean {section}.{close[0]}?)"
    # The key may live in another section (`training.lr` for `optimizer.lr`): match the key part alone.
    by_key = {k: f"{s}.{k}" for s, keys in sections.items() for k in keys}
    close = difflib.get_close_matches(key, list(by_key), n=1)
    return f" (did you mean {by_key[close[0]]}?)" if close else ""


def _type_name(annotation: Any) -> str:
    if get_origin(annotation) is Literal:
        return "one of " + ", ".join(repr(a) for a in get_args(annotation))
    if get_origin(annotation) is list:
        return f"list of {get_args(annotation)[0].__name__}"
    return annotation.__name__


# ---- value checking ---------------------------------------------------------------------------------------------
def _coerce(value: Any, annotation: Any, key: str, origin: str) -> Any:
    """Return `value` as `annotation` (ints widen to float), or raise naming the key and its origin."""
    where = f"{key} in {origin}"
    kind = get_origin(annotation)
    if kind is Literal:
        allowed = get_args(annotation)
        if not isinstance(value, str) or value not in allowed:
            raise ConfigError(f"{where}: {value!r} is not allowed; expected one of {', '.join(map(repr, allowed))}")
        return value
    if kind is list:
        if not isinstance(value, list):
            raise ConfigError(f"{where}: expected a {_type_name(annotation)}, got {value!r}")
        return [_coerce(v, get_args(annotation)[0], f"{key}[{i}]", origin) for i, v in enumerate(value)]
    ok = {
        bool: isinstance(value, bool),
        int: isinstance(value, int) and not isinstance(value, bool),
        float: isinstance(value, (int, float)) and not isinstance(value, bool),
        str: isinstance(value, str),
    }[annotation]
    if not ok:
        raise ConfigError(f"{where}: expected {annotation.__name__}, got {type(value).__name__} {value!r}")
    return float(value) if annotation is float else value


def _parse_text(text: str, annotation: Any, key: str, origin: str) -> Any:
    """Parse a command-line string into `annotation` (then checked by `_coerce`)."""
    kind = get_origin(annotation)
    try:
        if kind is list:
            if text.strip().startswith("["):  # a TOML array: --reward.weights '[1.0, 0.5]'
                value = tomllib.loads(f"v = {text}")["v"]
            else:  # comma separated: --reward.functions accuracy,format
                items = [t.strip() for t in text.split(",") if t.strip()]
                value = [_parse_text(t, get_args(annotation)[0], f"{key}[{i}]", origin) for i, t in enumerate(items)]
        elif annotation is bool:
            lowered = text.strip().lower()
            if lowered not in ("true", "false", "1", "0"):
                raise ValueError("expected true, false, 1 or 0")
            value = lowered in ("true", "1")
        elif annotation is int:
            value = int(text)
        elif annotation is float:
            value = float(text)
        else:  # str and Literal
            value = text
    except ConfigError:  # a list element already named itself
        raise
    except (ValueError, tomllib.TOMLDecodeError) as e:
        raise ConfigError(f"{key} in {origin}: cannot parse {text!r} as {_type_name(annotation)} ({e})") from None
    return _coerce(value, annotation, key, origin)


def _annotation(section: str, key: str, origin: str) -> Any:
    """The declared type of section.key, or a ConfigError naming the unknown section/key and a close valid one."""
    sections = _sections()
    if section not in sections:
        raise ConfigError(f"unknown section [{section}] in {origin}{_suggest(section, None)}; "
                          f"valid sections: {', '.join(sections)}")
    if key not in sections[section]:
        raise ConfigError(f"unknown key {section}.{key} in {origin}{_suggest(section, key)}")
    return sections[section][key]


def _set(cfg: Config, section: str, key: str, value: Any, origin: str, from_text: bool = False) -> None:
    annotation, name = _annotation(section, key, origin), f"{section}.{key}"
    value = _parse_text(value, annotation, name, origin) if from_text else _coerce(value, annotation, name, origin)
    setattr(getattr(cfg, section), key, value)


def _apply_tables(cfg: Config, data: dict[str, Any], origin: str) -> None:
    for section, table in data.items():
        if not isinstance(table, dict):
            raise ConfigError(f"{section} = {table!r} in {origin} is not inside a [section]{_suggest('', section)}")
        for key, value in table.items():
            _set(cfg, section, key, value, origin)


# Whole-config sanity checks: (key, predicate, requirement). Run after every override so the combined result counts.
_CHECKS = [
    ("rollout.n_samples", lambda c: c.rollout.n_samples >= 1, "must be >= 1"),
    ("rollout.temperature", lambda c: c.rollout.temperature >= 0, "must be >= 0"),
    ("rollout.top_p", lambda c: 0 < c.rollout.top_p <= 1, "must be in (0, 1]"),
    ("rollout.top_k", lambda c: c.rollout.top_k >= 0, "must be >= 0 (0 = off)"),
    ("algorithm.clip_low", lambda c: 0 <= c.algorithm.clip_low < 1, "must be in [0, 1)"),
    ("algorithm.clip_high", lambda c: c.algorithm.clip_high >= 0, "must be >= 0"),
    ("algorithm.micro_batch_size", lambda c: c.algorithm.micro_batch_size >= 1, "must be >= 1"),
    ("rollout.kv_pool_gib", lambda c: c.rollout.kv_pool_gib >= 0, "must be >= 0 (0 = sized from the memory budget)"),
    ("memory.budget_gib", lambda c: c.memory.budget_gib >= 0, "must be >= 0 (0 = the device's memory)"),
    ("reward.weights", lambda c: len(c.reward.weights) == len(c.reward.functions),
     "must have one weight per entry of reward.functions"),
    ("parallelism.dp_shard", lambda c: c.parallelism.dp_shard == -1 or c.parallelism.dp_shard >= 1,
     "must be -1 (all remaining ranks) or >= 1"),
    ("parallelism.tp", lambda c: c.parallelism.tp >= 1, "must be >= 1"),
    ("parallelism.rollout_tp", lambda c: c.parallelism.rollout_tp >= 1, "must be >= 1"),
    ("runtime.reference_in_window", lambda c: not (c.runtime.reference_in_window and c.memory.managed),
     "reads the reference weights during rollout, but memory.managed keeps them on the device only in the ref "
     "phase: turn one of them off"),
]


def _check_values(cfg: Config, origin: str = "") -> None:
    for key, ok, requirement in _CHECKS:
        if not ok(cfg):
            section, name = key.split(".")
            shown = getattr(getattr(cfg, section), name)
            raise ConfigError(f"{key} = {shown!r} {requirement}" + (f" (config from {origin})" if origin else ""))


# ---- loading ----------------------------------------------------------------------------------------------------
def _split_argv(argv: list[str]) -> list[tuple[str, str, str | None]]:
    """`--section.key=value` / `--section.key value` / bare `--section.key` (booleans) -> (section, key, text)."""
    out, i = [], 0
    while i < len(argv):
        token = argv[i]
        if not token.startswith("--"):
            raise ConfigError(f"unexpected argument {token!r} on the {COMMAND_LINE}; "
                              f"overrides look like --section.key=value or --section.key value")
        name, has_eq, text = token[2:].partition("=")
        if not has_eq:
            if i + 1 < len(argv) and not argv[i + 1].startswith("--"):
                text, i = argv[i + 1], i + 1
            else:
                text = None
        section, dot, key = name.partition(".")
        if not dot:
            raise ConfigError(f"--{name} on the {COMMAND_LINE} is not of the form --section.key"
                              f"{_suggest('', name)}")
        out.append((section, key, text))
        i += 1
    return out


def load_toml(path: str | Path) -> dict[str, Any]:
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except FileNotFoundError:
        raise ConfigError(f"config file {str(path)!r} not found (cwd: {Path.cwd()})") from None
    except tomllib.TOMLDecodeError as e:
        raise ConfigError(f"{path} is not valid TOML: {e}") from None


def load_config(argv: list[str] | None = None) -> Config:
    """Defaults, then the TOML named by `--job.config_file`, then every other `--section.key` override."""
    argv = sys.argv[1:] if argv is None else list(argv)
    if "-h" in argv or "--help" in argv:
        print(format_help())
        raise SystemExit(0)
    overrides = _split_argv(argv)
    cfg, origin = Config(), COMMAND_LINE
    config_files = [text for section, key, text in overrides if (section, key) == ("job", "config_file")]
    if config_files and config_files[-1]:
        origin = config_files[-1]
        _apply_tables(cfg, load_toml(origin), origin)
    for section, key, text in overrides:
        if text is None:  # a bare flag switches a boolean on
            annotation = _annotation(section, key, COMMAND_LINE)
            if annotation is not bool:
                raise ConfigError(f"--{section}.{key} on the {COMMAND_LINE} needs a value ({_type_name(annotation)})")
            text = "true"
        _set(cfg, section, key, text, COMMAND_LINE, from_text=True)
    _check_values(cfg, origin if origin == COMMAND_LINE else f"{origin} + {COMMAND_LINE}")
    return cfg


def format_help() -> str:
    lines = ["torchplex training options: --section.key=value (after --job.config_file FILE.toml)"]
    defaults = Config().to_dict()
    for section, keys in _sections().items():
        lines.append(f"[{section}]")
        lines += [f"  --{section + '.' + k:<38} {_type_name(t):<40} default {defaults[section][k]!r}"
                  for k, t in keys.items()]
    return "\n".join(lines)


# ---- writing ----------------------------------------------------------------------------------------------------
def _toml_value(value: Any) -> str:
    if isinstance(value, bool):  # before int: bool is an int subclass
        return "true" if value else "false"
    if isinstance(value, (int, float)):
        return repr(value)  # repr round-trips floats exactly; inf/nan spell the same in TOML
    if isinstance(value, str):
        # JSON string escapes are a subset of TOML basic-string escapes; TOML also forbids a raw DEL.
        return json.dumps(value).replace("\x7f", "\\u007f")
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    raise TypeError(f"cannot write {type(value).__name__} {value!r} as TOML")


def to_toml(data: dict[str, dict[str, Any]]) -> str:
    """{section: {key: scalar or list}} as TOML; only the flat types the config uses."""
    blocks = []
    for section, table in data.items():
        blocks.append(f"[{section}]\n" + "".join(f"{k} = {_toml_value(v)}\n" for k, v in table.items()))
    return "\n".join(blocks)
