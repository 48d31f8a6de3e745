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
import inspect
import io
import json
import math
import os
import sys
import textwrap
import tokenize
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
    name: str = "debug"  # the run's name: its folder is <output_dir>/<name>
    output_dir: str = "runs"  # where run folders are made: the run folder is <output_dir>/<name>
    seed: int = 0  # seeds sampling, data order, initial weights of a written tiny model (not the synthetic task)
    description: str = ""  # free text, kept in the run's config.toml
    # A run folder holds one run. true: a folder holding an earlier run (metrics, TensorBoard logs, plots,
    # checkpoints) is emptied first; false: such a folder is refused unless its checkpoint is resumed.
    overwrite: bool = False

    @property
    def run_dir(self) -> Path:
        return Path(self.output_dir) / self.name


@dataclass
class ModelConfig:
    flavor: str = "debug"  # the size of a tiny checkpoint written when absent: a key of models/qwen2_5_vl/args.FLAVORS
    hf_checkpoint: str = ""  # the Hugging Face Qwen2.5-VL folder (config.json + safetensors) to start from; required
    make_tiny_if_missing: bool = True  # build a tiny HF checkpoint at hf_checkpoint when absent (debug runs)
    dtype: Literal["float32", "bfloat16"] = "float32"  # weights and compute of actor, reference and rollout
    freeze_vision: bool = False  # train the language model only; the vision tower is shared with the reference
    activation_checkpointing: bool = False  # recompute each decoder layer in backward instead of holding it
    compile: bool = False  # torch.compile the decoder layers' tensor functions (dynamic sizes)
    # the elementwise chains (RMSNorm, rotary, the gated MLP's product) as compiled kernels and odd-width MLPs on
    # aligned GEMMs (models/fusion.py): "auto" = on a CUDA device, "on", "off"
    fused_elementwise: Literal["auto", "on", "off"] = "auto"


@dataclass
class DataConfig:
    train_file: str = ""  # "" = generate the synthetic task into synthetic_dir
    eval_file: str = ""  # the eval JSONL beside train_file; "" = no evaluation (the synthetic task has its own)
    synthetic_dir: str = "outputs/synthetic"  # where synthetic tasks are written, each in a folder of its own
    # "shapes": images (data/synthetic.py); "video_counting": mp4 files of moving squares (data/synthetic_video.py)
    synthetic_task: Literal["shapes", "video_counting"] = "shapes"
    # the synthetic task's own seed: runs of any job.seed train and evaluate on the same task
    synthetic_seed: int = 0
    synthetic_train: int = 2000  # prompts in the synthetic task's train split
    synthetic_eval: int = 200  # prompts in its eval split
    synthetic_size: int = 0  # side in pixels of the task's images or video frames; 0: 112 (images), 56 (video)
    synthetic_frames: int = 0  # frames per synthetic video; 0: 8
    prompts_per_step: int = 8  # each prompt is sampled rollout.n_samples times
    max_prompt_tokens: int = 1024  # image tokens included
    shuffle: bool = True  # draw train prompts in a new random order every epoch (false: file order)
    eval_prompts: int = 64  # per eval set
    # Users' own data (data/sources.py): globs of JSONL / Parquet / Arrow / CSV / JSON files; win over train_file.
    # Each eval_files entry is one eval set, named after its file stem.
    train_files: list[str] = field(default_factory=list)
    eval_files: list[str] = field(default_factory=list)  # globs of eval files: one eval set per entry
    prompt_key: str = "prompt"  # the column holding the prompt text (or chat messages)
    answer_key: str = "answer"  # the column holding the reference answer
    image_key: str = "images"  # the column holding a row's images (paths, bytes or datasets Images)
    video_key: str = "videos"  # the column holding a row's videos (files or frame lists)
    prompt_suffix: str = ""  # appended to every prompt, e.g. the answer-format instruction of a public recipe
    # mean@k / pass@k with this many samples per eval prompt at rollout.temperature (0 = greedy accuracy only)
    eval_k: int = 0
    # Video files (data/video.py), qwen-vl-utils' budgets: frames per second sampled, frame count bounds,
    # pixels per frame, and pixels summed over a video's frames (the video-token budget x 28*28*2)
    video_fps: float = 2.0  # frames sampled per second of video
    video_min_frames: int = 4  # fewest frames sampled from a video
    video_max_frames: int = 768  # most frames sampled from a video
    video_min_pixels: int = 128 * 28 * 28  # fewest pixels of a sampled frame (resized up to it)
    video_max_pixels: int = 768 * 28 * 28  # most pixels of a sampled frame (resized down to it)
    video_total_pixels: int = 90316800  # most pixels over all a video's frames: int(128000 * 28 * 28 * 0.9)


@dataclass
class RolloutConfig:
    backend: Literal["native", "sglang"] = "native"  # who samples: torchplex's engine, or a colocated SGLang
    n_samples: int = 8  # group size for the group-relative advantage
    temperature: float = 1.0  # sampling temperature of rollout (and of the log-probs trained on)
    top_p: float = 1.0  # nucleus sampling: the smallest set of tokens holding this probability
    top_k: int = 0  # sample from the k most likely tokens; 0 = off
    max_new_tokens: int = 32  # longest response sampled, in tokens
    kv_pool_gib: float = 1.0  # the rollout KV cache; 0 = sized each step from memory.budget_gib (all groups that fit)
    max_batch: int = 256  # sequences decoded concurrently
    # backend "sglang" (rollout/sglang_backend/): a rollout SGLang does not answer within this fails the step
    sglang_timeout_s: float = 600.0
    sglang_mem_fraction: float = 0.2  # SGLang's mem_fraction_static: its weights + KV cache, of the GPU's memory
    sglang_bucket_mib: int = 512  # weights pushed to SGLang per update_weights_from_tensor call
    # SGLang's deterministic inference (batch-invariant kernels, triton attention, its seeded pytorch sampler): each
    # sample reproducible from its seed, at a cost in speed. Off: SGLang's usual fast configuration, unseeded sampling
    sglang_deterministic: bool = False


@dataclass
class AlgorithmConfig:
    # The named algorithm sets the algorithm keys that are not given (file or command line) to its published values
    # (ALGORITHM_DEFAULTS[name]); a given key always wins. The dataclass defaults below are GRPO's.
    name: Literal["grpo", "dapo", "dr_grpo", "gspo"] = "grpo"
    advantage: Literal["grpo", "dr_grpo", "rloo"] = "grpo"  # how a sample's reward becomes its advantage
    clip_low: float = 0.2  # ratio clipped to [1 - clip_low, 1 + clip_high] ("clip-higher" when they differ)
    clip_high: float = 0.2  # upper clip of the ratio, 1 + clip_high
    # KL penalty to the reference, the run's starting policy (after an SFT warm-up, the warmed-up model); 0 = no
    # reference model is loaded
    kl_coef: float = 0.0
    kl_estimator: Literal["k1", "k2", "k3"] = "k3"  # the KL estimator (docs/losses.md)
    loss_agg: Literal["token-mean", "seq-mean-token-mean", "seq-mean-token-sum",
                      "seq-mean-token-sum-norm"] = "seq-mean-token-mean"  # token losses to one loss: docs/losses.md
    importance: Literal["token", "sequence"] = "token"  # per-token (GRPO) or per-sequence (GSPO) ratio
    dynamic_sampling: bool = False  # drop groups whose rewards are all equal (zero advantage)
    ppo_epochs: int = 1  # passes of training over each step's samples
    # Sequences per forward/backward in every mode. The decomposed modes keep a prompt's group together when this
    # is a multiple of rollout.n_samples (its prefix runs once); a smaller value cuts each group into pieces of
    # this size (each piece runs the prefix again); any other value leaves micro-batches of whole groups only.
    micro_batch_size: int = 8
    # Sequences per reference-scoring forward (no grad, so it can be larger: fewer, bigger kernels per FLOP); 0 =
    # micro_batch_size. Grouped like micro_batch_size.
    ref_micro_batch_size: int = 0
    entropy_coef: float = 0.0  # > 0: an entropy bonus, aggregated like the loss


# Each named algorithm's published settings of the loss keys (docs/losses.md gives the formulas and sources).
# kl_coef is none of them: DeepSeekMath's GRPO uses 0.04 and needs a reference model, DAPO and Dr. GRPO drop KL.
ALGORITHM_DEFAULTS: dict[str, dict[str, Any]] = {
    # DeepSeekMath (arXiv:2402.03300) eq. 3: 1/G sum_i 1/|o_i| sum_t, group-normalised advantages; PPO's clip 0.2
    "grpo": dict(advantage="grpo", importance="token", loss_agg="seq-mean-token-mean", clip_low=0.2,
                 clip_high=0.2, dynamic_sampling=False),
    # DAPO (arXiv:2503.14476) sections 3.1-3.3: clip-higher 0.2 / 0.28, dynamic sampling, token-level loss
    "dapo": dict(advantage="grpo", importance="token", loss_agg="token-mean", clip_low=0.2, clip_high=0.28,
                 dynamic_sampling=True),
    # Dr. GRPO (arXiv:2503.20783) section 3.1: no std in the advantage, sums over a constant length
    "dr_grpo": dict(advantage="dr_grpo", importance="token", loss_agg="seq-mean-token-sum-norm", clip_low=0.2,
                    clip_high=0.2, dynamic_sampling=False),
    # GSPO (arXiv:2507.18071): the sequence-level ratio s_i, the sequence mean, its experiments' clip 3e-4 / 4e-4
    "gspo": dict(advantage="grpo", importance="sequence", loss_agg="seq-mean-token-mean", clip_low=3e-4,
                 clip_high=4e-4, dynamic_sampling=False),
}


@dataclass
class RewardConfig:
    # the rewards summed into a sample's reward: built-ins (accuracy, format, math, multiple_choice, numeric, iou,
    # think_format) or your own "module:function" / "path/to/file.py:function" (rl/reward_functions.py)
    functions: list[str] = field(default_factory=lambda: ["accuracy", "format"])
    weights: list[float] = field(default_factory=lambda: [1.0, 0.1])  # one per function
    max_failure_fraction: float = 0.1  # stop the run when more of a step's samples than this fail to be scored
    correct: str = "accuracy"  # the reward whose value 1.0 marks an eval answer correct


@dataclass
class OptimizerConfig:
    name: Literal["adamw", "adamw8bit", "adamw_cpu_offload"] = "adamw"  # 8-bit and CPU-offload: torchao's, on GPU
    lr: float = 1e-5  # learning rate of the GRPO steps
    beta1: float = 0.9  # AdamW's first-moment decay
    beta2: float = 0.999  # AdamW's second-moment decay
    eps: float = 1e-8  # AdamW's denominator term
    weight_decay: float = 0.0  # AdamW's decoupled weight decay
    grad_clip: float = 1.0  # max global grad norm; <= 0 disables clipping


@dataclass
class LRSchedulerConfig:
    warmup_steps: int = 0  # steps of linear learning-rate warm-up from 0
    decay: Literal["constant", "linear", "cosine"] = "constant"  # the learning rate after its warm-up, to the end
    min_lr_ratio: float = 0.0  # floor of linear/cosine decay, as a fraction of optimizer.lr


@dataclass
class TrainingConfig:
    steps: int = 20  # GRPO steps
    sft_warmup_steps: int = 0  # supervised steps before RL (the debug model starts from random weights)
    sft_lr: float = 1e-3  # the warm-up's learning rate (its own AdamW)
    sft_batch_size: int = 16  # prompts per warm-up step


@dataclass
class CheckpointConfig:
    enable: bool = False  # save resumable checkpoints (DCP) in the run folder
    interval: int = 10  # steps between checkpoints (and one at the last step and at a Ctrl-C)
    folder: str = "checkpoints"  # relative to the run folder
    keep_latest_k: int = 2  # 0 = keep all
    resume: bool = True  # load the latest checkpoint in folder when one exists
    export_hf_at_end: bool = False  # write the trained weights as a Hugging Face folder, <run folder>/hf_export
    # a checkpoint at the last step too (not only every `interval` steps); false where the HF export is all that is
    # wanted of the end (a 7B checkpoint holds its AdamW state: three times the weights)
    save_last: bool = True


@dataclass
class MetricsConfig:
    log_interval: int = 1  # steps between console lines (metrics.jsonl has every step)
    tensorboard: bool = True  # TensorBoard event files in <run folder>/tb
    eval_interval: int = 10  # 0 = no evaluation
    progress_bar: bool = True  # a progress bar per phase, on a terminal
    wandb: bool = False  # Weights & Biases (pip install 'torchplex[wandb]'); WANDB_MODE=offline works without a login
    wandb_project: str = "torchplex"  # the Weights & Biases project of metrics.wandb


@dataclass
class RuntimeConfig:
    # serial: every sample a full prompt+response forward; decomposed: the prompt prefix once per prompt, shared by
    # its samples; overlapped: decomposed, with the actor prefix fused into the rollout prefill
    mode: Literal["serial", "decomposed", "overlapped"] = "serial"
    checkpoint_prefix: bool = False  # decomposed/overlapped: recompute the prefix in backward instead of holding it
    # decomposed: the step's actor prefixes in batched forwards at the start of training, held for the first
    # epoch's micro-batches as the train stage's memory allows, their backward one batched pass (plan.PlanOptions);
    # on one process the prompts that room leaves out follow in rounds of the same room, and overlapped holds the
    # prompts its fused prefill left out in such rounds (memory_budget.choose_train_rounds); false: one prefix
    # forward and backward per micro-batch for every prompt not held
    batched_actor_prefix: bool = True
    # decomposed/overlapped: every prompt's reference prefix in batched no-grad forwards at the start of the ref stage,
    # their K/V held for the reference micro-batches' suffixes (plan.PlanOptions)
    batched_ref_prefix: bool = True
    # overlapped: the reference prefixes, and the reference log-probs of each sample as soon as it has finished,
    # computed in the rollout decode window on a second host thread (runtime/window.py); equal up to rounding
    reference_in_window: bool = False
    window_sample_batch: int = 0  # overlapped window: finished samples of a prompt per job; 0: half a group


@dataclass
class ParallelismConfig:
    dp_shard: int = -1  # -1 = every rank left over after tp
    tp: int = 1  # tensor-parallel degree of training
    rollout_tp: int = 1  # tensor-parallel degree of rollout; != tp: a rollout model sharing the actor's weights


@dataclass
class MemoryConfig:
    managed: bool = False  # plan and keep each stage's residency (weights, KV pool, held prefixes) to a budget
    # what the step may use on its device; 0 = the device's (CUDA: free + this process's cached blocks; CPU: the
    # host's memory). Held prefixes and a budget-sized KV pool get what every resident group leaves (docs/memory.md)
    budget_gib: float = 0.0
    # with model.activation_checkpointing: "auto" = each training micro-batch skips the recompute when its whole graph
    # fits in the memory free at its forward (docs/memory.md); "always" = every micro-batch recomputes
    recompute: Literal["auto", "always"] = "auto"


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
        _apply_algorithm_defaults(cfg, _apply_tables(cfg, data, origin))
        _check_values(cfg, origin)
        return cfg

    def save(self, path: str | Path) -> Path:
        """Write the resolved config as TOML (loadable with `--job.config_file path`). Paths are written absolute
        (a relative one left is relative to the working folder), since a TOML's relative paths mean its folder."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        data = self.to_dict()
        for key in PATH_KEYS:
            section, name = key.split(".")
            if data[section][name]:
                data[section][name] = _absolute(data[section][name], Path.cwd())
        path.write_text("# resolved torchplex config\n" + to_toml(data))
        return path


# ---- schema lookups ---------------------------------------------------------------------------------------------
@functools.cache
def _sections() -> dict[str, dict[str, Any]]:
    """{section: {key: type annotation}} read from the dataclasses, so they are the only schema."""
    return {f.name: get_type_hints(get_type_hints(Config)[f.name]) for f in fields(Config)}


@functools.cache
def _descriptions() -> dict[str, dict[str, str]]:
    """{section: {key: description}}: each field's comment in its dataclass (the comment lines right above it, then
    the one ending its line), so the dataclasses stay the one place a key is described."""
    return {f.name: _field_comments(get_type_hints(Config)[f.name]) for f in fields(Config)}


def _field_comments(cls: type) -> dict[str, str]:
    names = {f.name for f in fields(cls)}
    out: dict[str, str] = {}
    above: list[str] = []  # comment lines since the last statement or blank line
    statement: list[tokenize.TokenInfo] = []  # the tokens of the statement being read, comments aside
    inline: list[str] = []  # comments on the lines of that statement
    source = textwrap.dedent(inspect.getsource(cls))
    for token in tokenize.generate_tokens(io.StringIO(source).readline):
        if token.type == tokenize.COMMENT:
            (inline if statement else above).append(token.string.lstrip("#").strip())
        elif token.type == tokenize.NL and not statement and not token.line.strip():
            above = []  # a blank line ends a comment block
        elif token.type == tokenize.NEWLINE:
            if len(statement) > 1 and statement[0].string in names and statement[1].string == ":":
                out.setdefault(statement[0].string, " ".join(above + inline))
            above, statement, inline = [], [], []
        elif token.type not in (tokenize.NL, tokenize.INDENT, tokenize.DEDENT):
            statement.append(token)
    return out


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


def _set(cfg: Config, section: str, key: str, value: Any, origin: str, from_text: bool = False) -> str:
    """Set section.key and return that name."""
    annotation, name = _annotation(section, key, origin), f"{section}.{key}"
    value = _parse_text(value, annotation, name, origin) if from_text else _coerce(value, annotation, name, origin)
    setattr(getattr(cfg, section), key, value)
    return name


def _apply_tables(cfg: Config, data: dict[str, Any], origin: str) -> set[str]:
    """Set every key of {section: {key: value}}; return the names set."""
    given = set()
    for section, table in data.items():
        if not isinstance(table, dict):
            raise ConfigError(f"{section} = {table!r} in {origin} is not inside a [section]{_suggest('', section)}")
        for key, value in table.items():
            given.add(_set(cfg, section, key, value, origin))
    return given


def _apply_algorithm_defaults(cfg: Config, given: set[str]) -> None:
    """The named algorithm's settings for the algorithm keys that were not given."""
    for key, value in ALGORITHM_DEFAULTS[cfg.algorithm.name].items():
        if f"algorithm.{key}" not in given:
            setattr(cfg.algorithm, key, value)


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
    ("algorithm.micro_batch_size", lambda c: c.algorithm.micro_batch_size >= 1, "must be >= 1"),
    ("algorithm.ref_micro_batch_size", lambda c: c.algorithm.ref_micro_batch_size >= 0, "must be >= 0 (0: micro_batch_size)"),
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
    for section, keys in _sections().items():
        for key, annotation in keys.items():
            value = getattr(getattr(cfg, section), key)
            values = value if get_origin(annotation) is list else [value]
            if any(isinstance(v, float) and not math.isfinite(v) for v in values):
                bad.append(f"{section}.{key}")
    return bad


def _check_values(cfg: Config, origin: str = "") -> None:
    where = f" (config from {origin})" if origin else ""
    for key in _non_finite_floats(cfg):
        section, name = key.split(".")
        raise ConfigError(f"{key} = {getattr(getattr(cfg, section), name)!r} must be a finite number{where}")
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
        # The defaults shown are those of the run these arguments would start (its config file and overrides).
        rest = [a for a in argv if a not in ("-h", "--help")]
        try:
            cfg, origin = _load(rest), _origin_of(rest)
        except ConfigError as err:
            cfg, origin = Config(), f"built-in defaults; the given config does not load: {err}"
        print(format_help(cfg, origin))
        raise SystemExit(0)
    return _load(argv)


def _origin_of(argv: list[str]) -> str:
    overrides = _split_argv(argv)
    files = [text for section, key, text in overrides if (section, key) == ("job", "config_file") and text]
    origin = files[-1] if files else "built-in defaults"
    if any((section, key) != ("job", "config_file") for section, key, _ in overrides):
        origin += f" + {COMMAND_LINE}"
    return origin


# Keys naming a file or folder. A relative value is relative to the TOML's folder when the file sets it, and to the
# folder the command was run from when the command line sets it (a default is left as it is); run_train.sh, which moves to the
# repo root, passes that folder as TORCHPLEX_CALLER_DIR. The config then holds absolute paths, so errors name them.
PATH_KEYS = ("job.output_dir", "model.hf_checkpoint", "data.train_file", "data.eval_file", "data.synthetic_dir",
             "data.train_files", "data.eval_files")  # the last two: lists of glob patterns


def caller_dir() -> Path:
    return Path(os.environ.get("TORCHPLEX_CALLER_DIR") or os.getcwd())


def _absolute(value: str | list[str], base: Path) -> str | list[str]:
    if isinstance(value, list):  # data.train_files / eval_files: glob patterns
        return [_absolute(v, base) for v in value]
    path = Path(value).expanduser()
    return os.path.normpath(path if path.is_absolute() else base / path)


# Keys naming reward functions: a "file.py:function" entry is a path (relative as PATH_KEYS are), and a
# "module:function" entry whose module is not importable is looked for as a file in the same folder.
REWARD_KEYS = ("reward.functions", "reward.correct")


def _resolve_paths(cfg: Config, bases: dict[str, Path]) -> None:
    """Make the path keys that were set absolute (`bases`: key -> folder it is relative to); defaults are left."""
    from .rl.reward_functions import locate_reward

    for key, base in bases.items():
        section, name = key.split(".")
        value = getattr(getattr(cfg, section), name)
        if key in PATH_KEYS and value:
            setattr(getattr(cfg, section), name, _absolute(value, base))
        elif key in REWARD_KEYS and value:
            located = [locate_reward(v, base) for v in value] if isinstance(value, list) else locate_reward(value, base)
            setattr(getattr(cfg, section), name, located)


def check_rewards(cfg: Config, origin: str = "") -> None:
    """Every reward.functions entry and reward.correct name a function: a built-in, "module:function" or
    "path/file.py:function" (importing a user's module runs it). Checked with the config, so a misspelled name is
    one line before any model is loaded."""
    from .rl.reward_functions import get_reward, is_builtin

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


def _load(argv: list[str]) -> Config:
    overrides = _split_argv(argv)
    cfg, origin, given = Config(), COMMAND_LINE, set()
    bases: dict[str, Path] = {}
    config_files = [text for section, key, text in overrides if (section, key) == ("job", "config_file")]
    if config_files and config_files[-1]:
        origin = _absolute(config_files[-1], caller_dir())
        tables = load_toml(origin)
        given = _apply_tables(cfg, tables, origin)
        cfg.job.config_file = origin
        bases = {f"{section}.{key}": Path(origin).parent for section, table in tables.items()
                 if isinstance(table, dict) for key in table}
    for section, key, text in overrides:
        bases[f"{section}.{key}"] = caller_dir()  # set on the command line: relative to the caller's folder
        if text is None:  # a bare flag switches a boolean on
            annotation = _annotation(section, key, COMMAND_LINE)
            if annotation is not bool:
                raise ConfigError(f"--{section}.{key} on the {COMMAND_LINE} needs a value ({_type_name(annotation)})")
            text = "true"
        if (section, key) == ("job", "config_file"):
            continue  # read above
        given.add(_set(cfg, section, key, text, COMMAND_LINE, from_text=True))
    _apply_algorithm_defaults(cfg, given)
    _resolve_paths(cfg, bases)
    _check_values(cfg, origin if origin == COMMAND_LINE else f"{origin} + {COMMAND_LINE}")
    check_rewards(cfg, origin if origin == COMMAND_LINE else f"{origin} + {COMMAND_LINE}")
    return cfg


HELP_HEAD = """usage: [NGPU=n] [CONFIG_FILE=file.toml] ./run_train.sh [--section.key=value ...]
       python -m torchplex.train --job.config_file file.toml [--section.key=value ...]

run_train.sh environment: NGPU (processes per node, default 1), CONFIG_FILE (default train_configs/debug.toml),
NNODES and RDZV_ENDPOINT (several nodes), LOG_RANK (local ranks shown, default 0), PYTHON, OMP_NUM_THREADS.
Overrides win over the file. Values shown: {origin}."""


HELP_KEY_WIDTH, HELP_TYPE_WIDTH, HELP_WIDTH = 38, 40, 120


def format_help(cfg: Config | None = None, origin: str = "built-in defaults") -> str:
    """Every key with its type, the value this run would use (`cfg`: its config file plus overrides) and what it
    does. A type wider than its column puts the value on the next line, under the values."""
    lines = [HELP_HEAD.format(origin=origin)]
    values, descriptions = (cfg or Config()).to_dict(), _descriptions()
    value_column = 4 + HELP_KEY_WIDTH + 1 + HELP_TYPE_WIDTH + 1
    for section, keys in _sections().items():
        lines.append(f"[{section}]")
        for key, annotation in keys.items():
            name, value = f"--{section}.{key}", repr(values[section][key])
            type_name = _type_name(annotation)
            if len(type_name) < HELP_TYPE_WIDTH:  # at least two spaces between type and value
                lines.append(f"  {name:<{HELP_KEY_WIDTH + 2}} {type_name:<{HELP_TYPE_WIDTH}} {value}")
            else:
                lines += [f"  {name:<{HELP_KEY_WIDTH + 2}} {type_name}", " " * value_column + value]
            lines += textwrap.wrap(descriptions[section][key], HELP_WIDTH, initial_indent=" " * 6,
                                   subsequent_indent=" " * 6)
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


def main(argv: list[str] | None = None) -> int:
    """`python -m torchplex.config ARGS`: check a config (run_train.sh does, before torchrun starts any process), so
    a mistake prints its one-line message and nothing else; exit status 2 when it does not load."""
    try:
        load_config(argv)
    except ConfigError as err:
        print(f"config error: {err}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
