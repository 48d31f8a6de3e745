"""The config's schema: one dataclass per TOML section, each key's type, default and description (the comment above
or beside its field, which `--help` prints), the named algorithms' settings, and which keys name paths.

The dataclasses are the only schema: the loader (config/loader.py) reads key names and types from them, so adding a
field adds a key, checked and documented, with nothing else to edit.
"""

from __future__ import annotations

import difflib
import functools
import inspect
import io
import textwrap
import tokenize
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any, Literal, get_args, get_origin, get_type_hints


class ConfigError(ValueError):
    """A config key or value is invalid; the message names the key and the file (or "command line")."""


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
    # train the language model only; the reference shares the frozen tower (under FSDP2 it keeps its own copy)
    freeze_vision: bool = False
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
    # Tokens per training forward/backward: serial counts each sample's prompt and response, decomposed/overlapped
    # its response alone (the prompt's prefix runs once per micro-batch or is held), keeping a prompt's samples
    # together and packing several prompts' where they fit; a longer group is cut into pieces. 0 = the planner's,
    # from the memory budget (plan.json, docs/memory.md)
    micro_batch_tokens: int = 0
    # Tokens per reference-scoring forward, counted like micro_batch_tokens; 0 = the planner's (no grad: a larger
    # budget than training's for the same memory)
    ref_micro_batch_tokens: int = 0
    # An upper bound on sequences per training micro-batch, beside its token budget; 0 = no bound. A budget of
    # micro_batch_tokens that this many of the longest sequences cannot reach is refused
    micro_batch_size: int = 0
    # An upper bound on sequences per reference-scoring micro-batch; 0 = micro_batch_size
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


# Keys naming a file or folder. A relative value is relative to the TOML's folder when the file sets it, and to the
# folder the command was run from when the command line sets it (a default is left as it is); run_train.sh, which
# moves to the repo root, passes that folder as TORCHPLEX_CALLER_DIR. The config then holds absolute paths, so
# errors name them.
PATH_KEYS = ("job.output_dir", "model.hf_checkpoint", "data.train_file", "data.eval_file", "data.synthetic_dir",
             "data.train_files", "data.eval_files")  # the last two: lists of glob patterns


# Keys naming reward functions: a "file.py:function" entry is a path (relative as PATH_KEYS are), and a
# "module:function" entry whose module is not importable is looked for as a file in the same folder.
REWARD_KEYS = ("reward.functions", "reward.correct")

# ---- schema lookups ---------------------------------------------------------------------------------------------
@functools.cache
def section_types() -> dict[str, dict[str, Any]]:
    """{section: {key: type annotation}} read from the dataclasses, so they are the only schema."""
    return {f.name: get_type_hints(get_type_hints(Config)[f.name]) for f in fields(Config)}


@functools.cache
def key_descriptions() -> dict[str, dict[str, str]]:
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


def suggest(section: str, key: str | None) -> str:
    """' (did you mean X?)' for the closest valid section or section.key, or ''."""
    sections = section_types()
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


def type_name(annotation: Any) -> str:
    if get_origin(annotation) is Literal:
        return "one of " + ", ".join(repr(a) for a in get_args(annotation))
    if get_origin(annotation) is list:
        return f"list of {get_args(annotation)[0].__name__}"
    return annotation.__name__


