"""torchplex trainer: synchronous on-policy GRPO for Qwen2.5-VL.

    ./run_train.sh                                   # tiny model on CPU, train_configs/debug.toml
    CONFIG_FILE=train_configs/qwen2_5_vl_7b.toml NGPU=8 ./run_train.sh --optimizer.lr=1e-6

Each step: rollout (native engine on the actor's own weights; with parallelism.rollout_tp != tp on a rollout model
that shares them, runtime/rollout_weights.py) -> rewards and group advantages -> reference
log-probs -> PPO-clip training, one GRPOStep (runtime/step.py) a step. `runtime.mode` picks how it runs:
"serial" (every sample a full prompt+response forward), "decomposed" (the prompt prefix once per prompt, shared by
its G samples) or "overlapped" (decomposed, with the actor prefix fused into the rollout prefill).
"""

from __future__ import annotations

import logging
import math
import os
import random
import sys
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from .components.checkpoint import CheckpointLoadError, CheckpointManager
from .components.console import RunSummary, StopRequest, format_eval, optimizer_notice, setup_logging
from .components.metrics import METRICS_FILENAME, MetricsLogger, PhaseTimer, StepProgress, format_step_line
from .components.optim import build_lr_scheduler, build_optimizer, clip_grad_norm
from .components.plot_metrics import plot_metrics
from .config import Config, ConfigError, check_rewards, load_config
from .data.processing import load_processor
from .data.prompts import EncodedBatch, PromptEncoder
from .data.records import PromptStream
from .data.skips import DataError, skip_counts_text
from .data.sources import BadRecords, ColumnKeys, load_records, set_name
from .data.synthetic import prepare_task
from .data.video import VideoBudget
from .distributed.mesh import build_parallel_dims, destroy_distributed, finish_distributed, init_distributed
from .models import fusion
from .models.qwen2_5_vl.build import build_model
from .distributed.fsdp import reshard
from .models.qwen2_5_vl.parallelize import parallelize_qwen2_5_vl
from .models.qwen2_5_vl.tiny_checkpoint import make_tiny_checkpoint
from .models.qwen2_5_vl.weights import copy_non_weight_files, save_hf_weights
from .evaluation import EvalSet, Evaluator
from .rl.reward_functions import RewardFailureError, RewardLedger, reward_answers
from .rollout.logprob_mismatch import mismatch_sums
from .rollout.sampling import SamplingParams, sample_seeds
from .rollout.sglang_backend.engine import build_sglang_engine, check_sglang_available
from .components.flops import step_flops
from .runtime.build import build_step_runtime
from .runtime.memory_budget import COMPACT, GRAPH
from .runtime.phases import Stage
from .runtime.experience import all_reduce_sums, kl_to_reference
from .runtime.rollout_weights import build_rollout_engine
from .runtime.scoring import ScoreRequest, SerialScorer
from .run_folder import RunFolderError, claim_run_folder, may_write_tiny_checkpoint, missing_checkpoint_error

log = logging.getLogger("torchplex")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
REFERENCE_WEIGHTS = "reference"  # the warmed-up reference's weights, in the checkpoint folder


def ensure_tiny_checkpoint(path: Path, flavor: str, seed: int) -> None:
    """Debug runs need no download: write the tiny random checkpoint (tools/make_tiny_checkpoint.py's writer)."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # its one-file "Writing model shards" bar says nothing
    log.info("no checkpoint at %s: writing a tiny random %s checkpoint", path, flavor)
    make_tiny_checkpoint(path, size=flavor, seed=seed)


def visual_grids(prompt) -> list[list[int]]:
    """The (t, h, w) patch grids of a prompt's images and videos."""
    return [grid for grids in (prompt.image_grid_thw, prompt.video_grid_thw) if grids is not None
            for grid in grids.tolist()]


def stop_token_ids(hf_dir: Path, eos_id: int) -> list[int]:
    """The tokens that end a response: the checkpoint's generation_config.json `eos_token_id` (an id or a list;
    Qwen2.5-VL-Instruct lists <|im_end|> and <|endoftext|>), else <|im_end|> alone."""
    from transformers import GenerationConfig

    if not (hf_dir / "generation_config.json").is_file():
        return [eos_id]
    ids = GenerationConfig.from_pretrained(hf_dir).eos_token_id
    ids = [ids] if isinstance(ids, int) else list(ids or [])
    return ids if eos_id in ids else [eos_id, *ids]


class Trainer:
    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.rank, self.world, self.device = init_distributed()
        if cfg.rollout.backend == "sglang":  # before any model is loaded: say what to install
            check_sglang_available(self.device)
        p = cfg.parallelism
        self.dims = build_parallel_dims(p.dp_shard, p.tp, self.world) if self.world > 1 else None
        # Every rank draws the same global batch; each data-parallel rank takes its share (TP peers share one).
        self.dp_rank = self.dims.dp_rank if self.dims else 0
        self.dp_size = self.dims.dp_shard if self.dims else 1
        self.dp_group = self.dims.dp_mesh.get_group() if self.dims and self.dp_size > 1 else None
        self.run_dir = cfg.job.run_dir
        ckpt = Path(cfg.model.hf_checkpoint)
        # Refused before anything is written: a typo must not leave a tiny random model (or a run folder) behind.
        missing_ckpt = not (ckpt / "config.json").is_file()
        if missing_ckpt and not (cfg.model.make_tiny_if_missing and may_write_tiny_checkpoint(str(ckpt))):
            raise FileNotFoundError(missing_checkpoint_error(cfg.model.hf_checkpoint, cfg.model.make_tiny_if_missing))
        check_rewards(cfg)  # a config built in code is checked as a loaded one is
        self._seed(cfg.job.seed)

        if missing_ckpt:
            if self.rank == 0:
                ensure_tiny_checkpoint(ckpt, cfg.model.flavor, cfg.job.seed)
            self._barrier()
        self.processor = load_processor(ckpt)
        self.tokenizer = self.processor.tokenizer
        self.eos_id = self.tokenizer.convert_tokens_to_ids("<|im_end|>")
        self.stop_ids = stop_token_ids(ckpt, self.eos_id)
        self.pad_id = self.tokenizer.pad_token_id or 0
        d = cfg.data
        factor = self.processor.image_processor.patch_size * self.processor.image_processor.merge_size
        video_budget = VideoBudget(fps=d.video_fps, min_frames=d.video_min_frames, max_frames=d.video_max_frames,
                                   min_pixels=d.video_min_pixels, max_pixels=d.video_max_pixels,
                                   total_pixels=d.video_total_pixels, factor=factor)
        self.encoder = PromptEncoder(self.processor, cfg.data.max_prompt_tokens, video_budget=video_budget)
        self.data_files: dict[str, str] = {}
        self.stop = StopRequest()
        self.summary = RunSummary(self.run_dir, cfg.training.steps, cfg.training.sft_warmup_steps,
                                  checkpoints_enabled=cfg.checkpoint.enable)

        self.train_records, eval_sets = self._load_data()
        self.eval_records = [r for s in eval_sets for r in s.records]
        self.evaluator = Evaluator(eval_sets, self.encoder, cfg.reward.correct, d.eval_k, d.eval_prompts,
                                   local=self._local, mean=self._mean,
                                   sums=lambda values: all_reduce_sums(values, self.device, self.dp_group))
        self.reward_ledger = RewardLedger(cfg.reward.max_failure_fraction)
        self.stream = PromptStream(self.train_records, cfg.data.prompts_per_step, seed=cfg.job.seed,
                                   shuffle=cfg.data.shuffle)

        # The run folder is taken once the checkpoint path, rewards and data have passed their checks: a launch that
        # fails one leaves an earlier run's folder as it was, and a live run's folder is never touched (run_folder.py)
        self.checkpoints = CheckpointManager(self.run_dir / cfg.checkpoint.folder, cfg.checkpoint.interval,
                                             cfg.checkpoint.keep_latest_k, cfg.checkpoint.enable)
        resuming = cfg.checkpoint.enable and cfg.checkpoint.resume and self.checkpoints.latest_step() is not None
        self.run_lock = claim_run_folder(self.run_dir, self.checkpoints.folder, cfg.job.overwrite, resuming,
                                         self.rank, self._any_rank)
        if self.rank == 0:
            cfg.save(self.run_dir / "config.toml")

        dtype = DTYPES[cfg.model.dtype]
        self.actor = build_model(hf_dir=ckpt, device=self.device, dtype=dtype, parallelize=self._parallelize)
        if cfg.model.freeze_vision:
            self.actor.visual.requires_grad_(False)
        self.reference = None
        if cfg.algorithm.kl_coef > 0:  # coefficient 0: the reference is never loaded
            self.reference = build_model(hf_dir=ckpt, device=self.device, dtype=dtype,
                                         parallelize=self._parallelize).eval().requires_grad_(False)
        if cfg.rollout.backend == "sglang":  # a colocated sglang.Engine, weights pushed before each rollout
            r = cfg.rollout
            self.engine = build_sglang_engine(self.actor, str(ckpt), self.dims, cfg.parallelism.rollout_tp,
                                              self.device, dtype=cfg.model.dtype, mem_fraction=r.sglang_mem_fraction,
                                              timeout_s=r.sglang_timeout_s, bucket_mib=r.sglang_bucket_mib,
                                              deterministic=r.sglang_deterministic,
                                              seed=cfg.job.seed)
        else:  # rollout_tp != tp: rollout runs on a model sharing the actor's storage (runtime/rollout_weights.py)
            self.engine = build_rollout_engine(self.actor, self.dims, cfg.parallelism.rollout_tp,
                                               kv_pool_bytes=int(cfg.rollout.kv_pool_gib * 2**30),
                                               max_batch=cfg.rollout.max_batch, pad_id=self.pad_id,
                                               device=self.device)
        if self.reference is not None and cfg.model.freeze_vision:
            self.reference.visual = self.actor.visual  # the same frozen weights: keep one copy, encode once
        o = cfg.optimizer
        notice = optimizer_notice(o.name, self.device.type)
        if notice and self.rank == 0:
            log.warning(notice)
        self.optimizer = build_optimizer(self.actor, o.name, o.lr, (o.beta1, o.beta2), o.eps, o.weight_decay)
        self.lr_scheduler = build_lr_scheduler(self.optimizer, cfg.lr_scheduler.warmup_steps, cfg.lr_scheduler.decay,
                                               cfg.training.steps, cfg.lr_scheduler.min_lr_ratio)
        self.metrics = MetricsLogger(self.run_dir, tensorboard=cfg.metrics.tensorboard, rank=self.rank,
                                     wandb_project=cfg.metrics.wandb_project if cfg.metrics.wandb else None,
                                     run_name=cfg.job.name, config=cfg.to_dict())
        self.runner = build_step_runtime(cfg, self.actor, self.reference, self.engine, self.optimizer,
                                         self.lr_scheduler, self.tokenizer, pad_id=self.pad_id, dp_size=self.dp_size,
                                         dp_group=self.dp_group)
        self.residency = self.runner.residency  # memory.managed: what is on the device in each stage
        if self.residency is not None and self.rank == 0:
            (self.run_dir / "memory_plan.json").write_text(self.residency.plan.to_json())
            log.info("memory plan:\n%s", self.residency.plan)
        self._plan_written = False
        self.step = 0
        self.skipped_samples = 0
        self.unequal_share_dropped = 0  # good prompts cut so that every data-parallel rank has as many

    # ---- setup helpers --------------------------------------------------------------------------------
    def _barrier(self) -> None:
        if dist.is_initialized():
            dist.barrier()

    def _any_rank(self, flag: bool) -> bool:
        """Whether `flag` holds on any rank of the job (a collective over every rank)."""
        if not dist.is_initialized():
            return flag
        total = torch.tensor([float(flag)], device=self.device)
        dist.all_reduce(total)
        return bool(total.item())

    def _parallelize(self, model):
        m = self.cfg.model
        fusion.enable(fusion.wanted(m.fused_elementwise, self.device))
        if self.dims is None and not (m.activation_checkpointing or m.compile):
            return model
        return parallelize_qwen2_5_vl(model, self.dims, param_dtype=DTYPES[m.dtype], reduce_dtype=torch.float32,
                                      activation_checkpointing=m.activation_checkpointing, compile=m.compile,
                                      freeze_vision=m.freeze_vision)

    def _seed(self, seed: int) -> None:
        random.seed(seed)
        np.random.seed(seed)
        torch.manual_seed(seed)

    def _load_data(self) -> tuple[list, list[EvalSet]]:
        d = self.cfg.data
        keys = ColumnKeys(prompt=d.prompt_key, answer=d.answer_key, images=d.image_key, videos=d.video_key)
        self.bad_records = BadRecords()  # rows dropped while reading: skipped/<phase>/malformed, skipped/bad_records
        if d.train_files:  # users' own data (data/sources.py): one eval set per eval_files entry
            train = self._read(keys, d.train_files, "train")
            evals = [EvalSet(set_name(p), self._read(keys, [p], "eval")) for p in d.eval_files]
        else:
            if d.train_file:
                train_path, eval_path = Path(d.train_file), Path(d.eval_file) if d.eval_file else None
                for key, path in (("data.train_file", train_path), ("data.eval_file", eval_path)):
                    if path is not None and not path.is_file():
                        raise FileNotFoundError(f"{key} = {str(path)!r}: no such file")
            else:  # the task of data.synthetic_seed, in a folder of its own (data/synthetic.py)
                task = (d.synthetic_dir, d.synthetic_task, d.synthetic_seed, d.synthetic_train, d.synthetic_eval,
                        d.synthetic_size, d.synthetic_frames)
                if self.rank == 0:
                    prepare_task(*task)
                self._barrier()
                train_path, eval_path = prepare_task(*task)
            train = self._read(keys, [str(train_path)], "train")
            evals = [EvalSet("eval", self._read(keys, [str(eval_path)], "eval"), legacy=True)] if eval_path else []
        self.bad_records.summary()
        skipped = skip_counts_text(self.encoder.skips.metrics())
        if len(train) < d.prompts_per_step:
            raise DataError(f"{self.data_files['train']}: {len(train)} valid records, fewer than one step's "
                            f"data.prompts_per_step={d.prompts_per_step} (skipped: {skipped})")
        for eval_set in evals:
            if not eval_set.records:
                raise DataError(f"eval set {eval_set.name!r} ({self.data_files['eval']}): no valid record "
                                f"(skipped: {skipped})")
        return train, evals

    def _read(self, keys: ColumnKeys, patterns: list[str], phase: str) -> list:
        """Valid records of the files `patterns` match; bad rows are counted once for the job (data-parallel
        rank 0) under `phase`."""
        before = self.bad_records.total
        records = load_records(patterns, keys=keys, bad=self.bad_records, prompt_suffix=self.cfg.data.prompt_suffix)
        if self.dp_rank == 0:
            self.encoder.skips.add_malformed(phase, self.bad_records.total - before)
        self.data_files[phase] = ", ".join(filter(None, [self.data_files.get(phase), *patterns]))
        return records

    def _no_valid_sample(self, phase: str) -> DataError:
        return DataError(f"a {phase} step has no valid sample: every record of its batch was skipped "
                         f"({self.data_files.get('train' if phase == 'warmup' else phase, '?')}; skipped so far: "
                         f"{skip_counts_text(self.encoder.skips.metrics(self._skip_vector()))})")

    def _skip_vector(self) -> list[float]:
        """The skip counts summed over data-parallel ranks (collective)."""
        return all_reduce_sums(self.encoder.skips.vector(), self.device, self.dp_group)

    def _local(self, items: list) -> list:
        """This data-parallel rank's share of a global batch."""
        return items[self.dp_rank::self.dp_size]

    def sampling_params(self, greedy: bool = False, n: int | None = None) -> SamplingParams:
        r = self.cfg.rollout
        return SamplingParams(n=n or r.n_samples, temperature=r.temperature, top_p=r.top_p, top_k=r.top_k,
                              greedy=greedy, max_new_tokens=r.max_new_tokens, stop_token_ids=self.stop_ids,
                              seed=self.cfg.job.seed * 100_003 + self.step * 1009)

    @staticmethod
    def sample_seeds(params: SamplingParams, global_indices: list[int]) -> list[list[int]]:
        """Seeds of each prompt's samples, keyed on the prompt's index in the step's global batch.

        Keyed on the global index (not the position in this rank's share), a prompt draws the same samples
        whatever the number of data-parallel ranks or the samples skipped before it. With one rank and no skips
        this is the engine's default numbering.
        """
        return sample_seeds(params.seed, params.n, global_indices)

    # ---- supervised warm-up ---------------------------------------------------------------------------
    def sft_warmup(self) -> None:
        """A few supervised steps on `<answer>{answer}</answer>` so the random debug model answers in format."""
        t = self.cfg.training
        if t.sft_warmup_steps <= 0:
            return
        stream = PromptStream(self.train_records, t.sft_batch_size, seed=self.cfg.job.seed + 1)
        optimizer = build_optimizer(self.actor, "adamw", t.sft_lr)
        scorer = SerialScorer(self.pad_id)
        progress = StepProgress(t.sft_warmup_steps, rank=self.rank, enable=self.cfg.metrics.progress_bar,
                                desc="warmup")
        for step in range(1, t.sft_warmup_steps + 1):
            if self.stop.requested:  # the loop's end says so (_stopped_line)
                break
            batch = self.encoder.encode_batch(self._local(stream.next_batch()), phase="warmup")
            if self._fewest(len(batch.prompts)) == 0:  # every rank skips the step, or none (collectives)
                if self._sum(len(batch.prompts)) == 0:
                    raise self._no_valid_sample("warmup")
                continue
            targets = [self.tokenizer(f"<answer>{r.answer}</answer>", add_special_tokens=False)["input_ids"]
                       + [self.eos_id] for r in batch.records]
            width = max(len(x) for x in targets)
            tokens = torch.tensor([x + [self.pad_id] * (width - len(x)) for x in targets], device=self.device)
            lengths = torch.tensor([len(x) for x in targets], device=self.device)
            request = ScoreRequest(batch.prompts, list(range(len(batch.prompts))), tokens, lengths)
            logp, _ = scorer.score(self.actor, request, temperature=1.0)
            loss = -(logp * request.mask).sum() / self._sum(float(request.mask.sum()))
            optimizer.zero_grad(set_to_none=True)
            (loss * self.dp_size).backward()
            clip_grad_norm(self.actor.parameters(), 1.0)
            reshard(self.actor)
            optimizer.step()
            progress.update(step, {"sft/loss": loss.item()})
            self.summary.warmup_done = step
            if step % 50 == 0 or step == t.sft_warmup_steps:
                progress.write(f"warm-up step {step}/{t.sft_warmup_steps} | loss {loss.item():.4f}")
        progress.close()
        del optimizer
        if self.reference is not None and not self.stop.requested:
            self._start_reference_at_actor()

    @torch.no_grad()
    def _start_reference_at_actor(self) -> None:
        """The reference of an RL run is its starting policy: after a warm-up, the warmed-up actor (not the checkpoint
        the warm-up started from, which put the KL term far from 0 at the first GRPO step). Saved with the
        checkpoints, so that a resumed run keeps it."""
        actor = dict(self.actor.named_parameters())
        for name, param in self.reference.named_parameters():
            if param is not actor[name]:  # a frozen vision tower is one module of both models
                param.copy_(actor[name])
        if self.cfg.checkpoint.enable:
            self.checkpoints.save_weights(REFERENCE_WEIGHTS, self.reference)

    # ---- evaluation ------------------------------------------------------------------------------------
    def evaluate(self) -> dict[str, float]:
        """Every eval set (evaluation.py); logs one summary line."""
        return self.evaluator.run(self._generate_texts)

    def _generate_texts(self, prompts: list, greedy: bool, n: int) -> list[list[str]]:
        if not prompts and self.dp_group is None:
            return []  # with several ranks, one without prompts still joins the collectives (an empty rollout)
        outputs = self.engine.generate(prompts, self.sampling_params(greedy=greedy, n=n))
        reshard(self.actor)
        return [self.tokenizer.batch_decode([o.token_ids for o in group], skip_special_tokens=True)
                for group in outputs]

    def _equal_share(self, batch: EncodedBatch) -> EncodedBatch:
        """The batch cut to the fewest prompts any data-parallel rank has (skipped bad samples make shares unequal).

        Ranks must run the same micro-batches through the FSDP2-sharded actor (each forward and backward is a
        collective), and in the overlapped mode every pass must find its prompt's prefix held, which equal numbers
        of prompts guarantee. The prompts cut are counted (`skipped/unequal_share`); with one rank nothing is cut."""
        if self.dp_size == 1:
            return batch
        keep = self._fewest(len(batch.prompts))
        self.unequal_share_dropped += int(self._sum(len(batch.prompts) - keep))
        if keep < len(batch.prompts):
            log.warning("dropping %d of this rank's %d prompts: another data-parallel rank has only %d valid ones",
                        len(batch.prompts) - keep, len(batch.prompts), keep)
        return EncodedBatch(batch.records[:keep], batch.prompts[:keep], batch.skipped, batch.indices[:keep])

    def _fewest(self, count: int) -> int:
        """The smallest `count` over the data-parallel ranks."""
        if self.dp_group is None:
            return count
        fewest = torch.tensor([count], device=self.device)
        dist.all_reduce(fewest, op=dist.ReduceOp.MIN, group=self.dp_group)
        return int(fewest.item())

    def _sum(self, value: float) -> float:
        total = torch.tensor([value], dtype=torch.float64, device=self.device)
        if self.dp_group is not None:
            dist.all_reduce(total, group=self.dp_group)
        return float(total[0])

    def _mean(self, values: list[float]) -> float:
        total = torch.tensor([sum(values), len(values)], dtype=torch.float64, device=self.device)
        if self.dp_group is not None:
            dist.all_reduce(total, group=self.dp_group)
        return float(total[0] / max(total[1], 1))

    def _std(self, values: list[float]) -> float:
        """Sample standard deviation (Bessel-corrected, like torch.std) over every data-parallel rank's values."""
        total = torch.tensor([len(values), sum(values), sum(v * v for v in values)], dtype=torch.float64,
                             device=self.device)
        if self.dp_group is not None:
            dist.all_reduce(total, group=self.dp_group)
        n, s, sq = total.tolist()
        return math.sqrt(max(sq - s * s / n, 0.0) / (n - 1)) if n > 1 else 0.0

    # ---- one RL step ------------------------------------------------------------------------------------
    def train_step(self) -> tuple[dict[str, float], bool]:
        cfg, timer = self.cfg, PhaseTimer(self.device)
        t0 = time.perf_counter()
        with timer.phase("data"):
            global_batch = self.stream.next_batch()
            positions = self._local(list(range(len(global_batch))))
            batch = self.encoder.encode_batch([global_batch[i] for i in positions])
            global_indices = [positions[i] for i in batch.indices]
        self.skipped_samples += int(self._sum(len(batch.skipped)))  # every rank keeps the global count
        if self._sum(len(batch.prompts)) == 0:
            raise self._no_valid_sample("train")
        batch = self._equal_share(batch)
        global_indices = global_indices[:len(batch.prompts)]
        metrics: dict[str, float] = {"skipped/bad_samples": float(self.skipped_samples),
                                     "skipped/unequal_share": float(self.unequal_share_dropped),
                                     **self.encoder.skips.metrics(self._skip_vector())}
        if not batch.prompts:  # the same on every rank (_equal_share)
            return metrics, False
        params = self.sampling_params()
        decode_before = self._decode_counters()
        out = self.runner.run(batch.prompts, reward_answers(batch.records, self.reward_ledger), params,
                              sample_seeds=self.sample_seeds(params, global_indices), phase_timer=timer)
        exp, result = out.experience, out.train
        if not self._plan_written and self.rank == 0:  # the first step's plan, and why work runs where
            (self.run_dir / "plan.json").write_text(out.plan.to_json())
            log.info("step plan:\n%s", out.plan)
        self._plan_written = True
        rewards = exp.rewards
        prompt_tokens = sum(len(p.input_ids) for p in batch.prompts) * params.n
        metrics.update({
            "samples": self._sum(float(len(rewards))),
            "tokens/samples": self._sum(float(prompt_tokens + int(exp.lengths.sum()))),  # prompts + responses
            "reward/mean": self._mean(rewards.tolist()),
            "reward/std": self._std(rewards.tolist()),
            "accuracy": self._mean([float(c) for c in exp.correct]),
            "response_length/mean": self._mean(exp.lengths.float().tolist()),
            "groups/kept_fraction": self._mean(exp.keep_groups.float().tolist()),
            "lr": self.optimizer.param_groups[0]["lr"],
            "skipped/nonfinite_steps": float(result.skipped_nonfinite),
            # training forwards whose checkpointed blocks recomputed or not (memory.recompute, docs/memory.md)
            "recompute/on": float(result.recompute["on"]), "recompute/off": float(result.recompute["off"]),
            "reward/failures": self._sum(float(self.reward_ledger.failures)),
            "skipped/bad_records": float(self.bad_records.total),
        })
        metrics.update(self._token_metrics(out.report))
        metrics.update(self._flops_metrics(out))
        decoded = {k: v - decode_before.get(k, 0.0) for k, v in self._decode_counters().items()}
        # the ladder sizes this step decoded at (a size met only in earlier steps is not this step's metric)
        metrics.update({k: v for k, v in decoded.items() if v or not k.startswith("rollout/decode_rows/")})
        for name, values in exp.reward_parts.items():
            metrics[f"reward/{name}"] = self._mean(values)
        if result.stats is not None:
            s = result.stats
            metrics.update({"loss": float(s.loss), "pg_loss": float(s.pg_loss), "clip_fraction": float(s.clip_fraction),
                            "ratio_mean": float(s.ratio_mean)})
        if result.grad_norms:
            metrics["grad_norm"] = result.grad_norms[-1]
        if result.entropy is not None:
            metrics["entropy"] = result.entropy
        kl = kl_to_reference(exp, cfg.algorithm.kl_estimator, self.dp_group)
        if kl is not None:
            metrics["kl"] = kl
        metrics.update(self._logprob_mismatch(exp))
        metrics.update(timer.metrics())
        if self.residency is not None:  # plan next to what the manager held (and measured, on CUDA)
            for record in self.residency.records[-len(self.residency.plan.phases):]:
                metrics[f"memory/{record.phase}_plan_gib"] = record.planned_peak_bytes / 2**30
                metrics[f"memory/{record.phase}_tracked_gib"] = record.tracked_bytes / 2**30
        metrics["time/step_s"] = time.perf_counter() - t0
        return metrics, result.skipped_nonfinite == 0

    def _logprob_mismatch(self, exp) -> dict[str, float]:
        """Rollout vs trainer log-probs over the trained samples (rollout/logprob_mismatch.py), every rank's."""
        if exp.old_logprobs is None:
            return {}
        idx = torch.tensor(exp.kept_samples(), dtype=torch.long, device=exp.tokens.device)
        sums = mismatch_sums(exp.sampling_logprobs[idx], exp.old_logprobs[idx], exp.mask[idx])
        abs_sum, k3_sum, count = all_reduce_sums(list(sums), self.device, self.dp_group)
        return {"rollout/logprob_mismatch": abs_sum / max(count, 1.0), "rollout/mismatch_k3": k3_sum / max(count, 1.0)}

    def _flops_metrics(self, out) -> dict[str, float]:
        """Model FLOPs of each phase of this step (components/flops.step_flops), every rank's, in TFLOP: a phase's
        `flops/<phase>_tflop` over its `time/<phase>_s` is its achieved rate (the benchmarks' MFU)."""
        exp, g = out.experience, out.experience.group_size
        lengths = exp.lengths.tolist()
        kept = exp.keep_groups.tolist()
        fused = [c.prompt for c in out.report.held_forms if c.form in (GRAPH, COMPACT) and kept[c.prompt]]
        count = lambda prompts, fused: step_flops(
            self.actor.args, [len(exp.prompts[i].input_ids) for i in prompts], [visual_grids(exp.prompts[i]) for i in prompts],
            [lengths[i * g:(i + 1) * g] for i in prompts], serial=out.plan.mode == "serial",
            has_reference=self.reference is not None, vision_trains=self.runner.vision_trainable(),
            vision_stage=Stage.VISION in out.plan.stages(), fused=fused)
        every = count(range(len(exp.prompts)), [])
        trained = count([i for i in range(len(exp.prompts)) if kept[i]], [sum(kept[:i]) for i in fused])
        every["train"] = trained["train"].scaled(self.cfg.algorithm.ppo_epochs)
        names = list(every)
        totals = all_reduce_sums([every[n].total / 1e12 for n in names], self.device, self.dp_group)
        return {f"flops/{n}_tflop": t for n, t in zip(names, totals)}

    def _decode_counters(self) -> dict[str, float]:
        """The native engine's running decode counters (seconds, steps, tokens generated, rows decoded over the steps,
        CUDA graphs captured and their seconds, steps per ladder size `rollout/decode_rows/<rows>`); none for
        SGLang."""
        stats = getattr(self.engine, "stats", None)
        if not hasattr(stats, "decode_steps"):  # SGLang's engine keeps no decode-loop counters
            return {}
        return {"rollout/decode_s": stats.decode_s, "rollout/decode_steps": float(stats.decode_steps),
                "rollout/generated_tokens": float(stats.generated_tokens),
                "rollout/row_steps": float(getattr(stats, "row_steps", 0)),
                "rollout/captures": float(getattr(stats, "captures", 0)),
                "rollout/capture_s": float(getattr(stats, "capture_s", 0.0)),
                **{f"rollout/decode_rows/{rows}": float(steps)
                   for rows, steps in getattr(stats, "decode_rows", {}).items()}}

    def _token_metrics(self, report) -> dict[str, float]:
        """Decoder token-forwards of this step's scoring (reference + actor), and what serial would have run."""
        local = [report.tokens.prefix_tokens, report.tokens.response_tokens, report.serial_equivalent_tokens]
        prefix, response, serial = all_reduce_sums(local, self.device, self.dp_group)  # the whole job's work
        return {"tokens/prefix": prefix, "tokens/response": response, "tokens/serial_equivalent": serial,
                "tokens/saving_x": serial / max(prefix + response, 1)}

    # ---- the loop ------------------------------------------------------------------------------------------
    def train(self) -> dict[str, float]:
        cfg, started = self.cfg, time.perf_counter()
        self.stop.install()
        try:
            last_eval = self._train_loop()
        finally:
            self.stop.uninstall()
        if cfg.checkpoint.export_hf_at_end and not self.stop.requested:
            save_hf_weights(self.actor, self.run_dir / "hf_export")
            if self.rank == 0:
                copy_non_weight_files(self.cfg.model.hf_checkpoint, self.run_dir / "hf_export")
        self.metrics.close()
        if self.residency is not None and self.rank == 0:
            self.residency.save(self.run_dir / "memory_measured.json")
        if self.rank == 0:
            self.summary.plot = self._plot()
        self.summary.steps_done, self.summary.stopped_early = self.step, self.stop.requested
        self.summary.seconds = time.perf_counter() - started
        self.summary.skipped = {"skipped/unequal_share": self.unequal_share_dropped,
                                **self.encoder.skips.metrics(self._skip_vector())}
        if self.rank == 0:
            for line in self.summary.lines():
                log.info(line)
        if self.run_lock is not None:
            self.run_lock.release()
        return last_eval

    def _resume(self) -> None:
        self.step, extra, failed = self.checkpoints.load_newest(self.actor, self.optimizer, self.lr_scheduler)
        for step, err in failed:
            log.warning("checkpoint of step %d cannot be loaded (%s): falling back to an older one", step, err)
        self.stream.load_state_dict(extra["data"])
        self.skipped_samples = extra.get("skipped_samples", 0)
        self.unequal_share_dropped = extra.get("unequal_share_dropped", 0)
        self.encoder.skips.load_state_dict(extra.get("skips", {}))
        if self.reference is not None and self.cfg.training.sft_warmup_steps > 0:  # the warmed-up policy
            if not self.checkpoints.load_weights(REFERENCE_WEIGHTS, self.reference):
                log.warning("no %s in %s: the reference model is model.hf_checkpoint, not the warmed-up policy",
                            REFERENCE_WEIGHTS, self.checkpoints.folder)
        dropped = self.metrics.drop_after(self.step)  # logged after the checkpoint: they are logged again
        self.summary.resumed_from = self.step
        log.info("resumed from step %d (%s)%s", self.step, self.checkpoints.step_dir(self.step),
                 f"; {dropped} metrics records of later steps removed from {METRICS_FILENAME}" if dropped else "")

    def _eval_and_log(self, step: int, label: str = "") -> dict[str, float]:
        result = self.evaluate()
        if self.rank == 0:
            log.info(format_eval(step, result, label))
        return result

    def _save(self) -> None:
        self.summary.checkpoint = self.checkpoints.save(
            self.step, self.actor, self.optimizer, self.lr_scheduler,
            extra={"data": self.stream.state_dict(), "skipped_samples": self.skipped_samples,
                   "unequal_share_dropped": self.unequal_share_dropped, "skips": self.encoder.skips.state_dict()})

    def _train_loop(self) -> dict[str, float]:
        cfg = self.cfg
        evaluating = bool(self.eval_records) and cfg.metrics.eval_interval > 0
        if cfg.checkpoint.enable and cfg.checkpoint.resume and self.checkpoints.latest_step() is not None:
            self._resume()
        elif cfg.training.sft_warmup_steps > 0:
            if evaluating:
                before = self._eval_and_log(0, "before the warm-up")
                self.metrics.log(0, {f"{k}_before_sft": v for k, v in before.items()})
            self.sft_warmup()
        last_eval: dict[str, float] = {}
        if self.step == 0 and evaluating and not self.stop.requested:
            last_eval = self._eval_and_log(0)
            self.summary.add_eval(0, last_eval)
            self.metrics.log(0, last_eval)
        progress = StepProgress(cfg.training.steps, initial=self.step, rank=self.rank, enable=cfg.metrics.progress_bar,
                                desc="grpo")
        while self.step < cfg.training.steps and not self.stop.requested:
            self.step += 1
            metrics, finite = self.train_step()
            last = self.step == cfg.training.steps
            evaluated = evaluating and (self.step % cfg.metrics.eval_interval == 0 or last)
            if evaluated:
                last_eval = self.evaluate()
                self.summary.add_eval(self.step, last_eval)
                metrics.update(last_eval)
            self.metrics.log(self.step, metrics)
            progress.update(self.step, metrics)
            if self.step % cfg.metrics.log_interval == 0:
                progress.write(format_step_line(self.step, cfg.training.steps, metrics))
            if evaluated:  # every eval set's line (named sets log eval/<set>/..., not eval/prompts)
                progress.write(format_eval(self.step, last_eval))
            stopping = self.stop.requested and not last
            at_end = last and cfg.checkpoint.save_last
            if finite and (self.checkpoints.should_save(self.step, last=at_end) or (stopping and cfg.checkpoint.enable)):
                self._save()
        progress.close()
        if self.stop.requested and self.rank == 0:
            log.info(self._stopped_line())
        return last_eval

    def _stopped_line(self) -> str:
        """What a stop on request (Ctrl-C) leaves to resume from."""
        warmup = self.cfg.training.sft_warmup_steps
        if not self.summary.resumed_from and self.step == 0 and self.summary.warmup_done < warmup:
            return (f"stopped during the warm-up at step {self.summary.warmup_done}/{warmup} on request; the warm-up "
                    f"is not checkpointed: the same command starts it over")
        if self.summary.checkpoint is not None:
            return f"stopped at step {self.step} on request; the same command resumes from {self.summary.checkpoint}"
        if not self.cfg.checkpoint.enable:
            return (f"stopped at step {self.step} on request; checkpoints are off (checkpoint.enable = false): "
                    f"nothing to resume from")
        return f"stopped at step {self.step} on request; no checkpoint was saved: the same command starts over"

    def _plot(self) -> Path | None:
        try:
            return plot_metrics(self.run_dir)
        except Exception as err:  # a plot must never fail a finished run
            log.warning("could not plot metrics: %s", err)
            return None


# The CUDA allocator's settings for the native backend: expandable segments let the phases' different tensor shapes
# reuse freed memory instead of fragmenting it (the rollout's KV pool, then training's activations)
ALLOCATOR_SETTINGS = "expandable_segments:True"

# Errors a user fixes by changing the config, the command or the data: shown as their message alone (exit 2)
USER_ERRORS = (ConfigError, RunFolderError, DataError, FileNotFoundError, RewardFailureError, CheckpointLoadError)


def main(argv: list[str] | None = None) -> None:
    """The command line's entry point. A job on a gloo process group that finished well ends the process here
    (`finish_distributed`); errors destroy the group and exit with their status."""
    setup_logging(int(os.environ.get("RANK", "0")))
    try:
        cfg = load_config(argv)
        if cfg.rollout.backend == "native":  # before CUDA is initialised; SGLang's memory saver refuses them
            os.environ.setdefault("PYTORCH_CUDA_ALLOC_CONF", ALLOCATOR_SETTINGS)
        trainer = Trainer(cfg)
        trainer.train()
        status = 130 if trainer.stop.requested else 0  # stopped by Ctrl-C: the status shells and schedulers expect
        finish_distributed(status)
        if status:
            raise SystemExit(status)
    except USER_ERRORS as err:
        print(f"error: {err}", file=sys.stderr, flush=True)
        raise SystemExit(2) from None
    except KeyboardInterrupt:  # a second Ctrl-C, or one before the loop started
        print("\ninterrupted", file=sys.stderr, flush=True)
        raise SystemExit(130) from None
    finally:
        destroy_distributed()  # after an error (a finished job's group is gone already)


if __name__ == "__main__":
    main()
