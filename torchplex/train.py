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
import os
import random
import sys
import time
from pathlib import Path

import numpy as np
import torch

from .components.checkpoint import CheckpointLoadError, CheckpointManager
from .components.console import RunSummary, StopRequest, format_eval, optimizer_notice, setup_logging
from .components.metrics import METRICS_FILENAME, MetricsLogger, PhaseTimer, StepProgress, format_step_line
from .components.optim import build_lr_scheduler, build_optimizer
from .components.plot_metrics import plot_metrics
from .config import Config, ConfigError, check_rewards, load_config, save_config
from .data.processing import load_processor
from .data.prompts import EncodedBatch, PromptEncoder
from .data.records import PromptStream
from .data.skips import DataError
from .data.video import VideoBudget
from .distributed.data_parallel import DataParallelRanks, any_rank, barrier
from .distributed.mesh import build_parallel_dims, destroy_distributed, finish_distributed, init_distributed
from .models import fusion
from .models.qwen2_5_vl.build import build_model
from .distributed.fsdp import reshard
from .models.qwen2_5_vl.parallelize import parallelize_qwen2_5_vl
from .models.qwen2_5_vl.tiny_checkpoint import make_tiny_checkpoint
from .models.qwen2_5_vl.weights import copy_non_weight_files, save_hf_weights
from .evaluation import Evaluator
from .rl.reward_functions import RewardFailureError, RewardLedger, reward_answers
from .rollout.engine import PoolFloor
from .rollout.sampling import SamplingParams, sample_seeds
from .rollout.sglang_backend.engine import build_sglang_engine, check_sglang_available
from .runtime.build import build_step_runtime
from .runtime.rollout_weights import build_rollout_engine
from .run_data import RunData
from .run_folder import RunFolderError, claim_run_folder, may_write_tiny_checkpoint, missing_checkpoint_error
from .sft_warmup import SupervisedWarmup
from .step_metrics import (decode_counters, decode_metrics, flops_metrics, logprob_mismatch, outcome_metrics,
                           residency_metrics, token_metrics)

log = logging.getLogger("torchplex")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}
REFERENCE_WEIGHTS = "reference"  # the warmed-up reference's weights, in the checkpoint folder


def ensure_tiny_checkpoint(path: Path, flavor: str, seed: int) -> None:
    """Debug runs need no download: write the tiny random checkpoint (tools/make_tiny_checkpoint.py's writer)."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # its one-file "Writing model shards" bar says nothing
    log.info("no checkpoint at %s: writing a tiny random %s checkpoint", path, flavor)
    make_tiny_checkpoint(path, size=flavor, seed=seed)


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
    """One run: built from a Config (checkpoint, data, models, rollout engine, optimizer, the step runtime), then
    `train()`: an optional supervised warm-up, evaluations, and `training.steps` GRPO steps with checkpoints."""

    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.rank, self.world, self.device = init_distributed()
        if cfg.rollout.backend == "sglang":  # before any model is loaded: say what to install
            check_sglang_available(self.device)
        p = cfg.parallelism
        self.dims = build_parallel_dims(p.dp_shard, p.tp, self.world) if self.world > 1 else None
        # Every rank draws the same global batch; each data-parallel rank takes its share (TP peers share one).
        dp_size = self.dims.dp_shard if self.dims else 1
        self.dp = DataParallelRanks(self.device, self.dims.dp_rank if self.dims else 0, dp_size,
                                    self.dims.dp_mesh.get_group() if self.dims and dp_size > 1 else None)
        self.run_dir = cfg.job.run_dir
        ckpt = self._checkpoint_folder()
        self._load_tokenizer(ckpt)
        self.stop = StopRequest()
        self.summary = RunSummary(self.run_dir, cfg.training.steps, cfg.training.sft_warmup_steps,
                                  checkpoints_enabled=cfg.checkpoint.enable)
        self._load_data()
        self._claim_run_folder()
        self._build_models(ckpt)
        self._build_optimizer()
        self.metrics = MetricsLogger(self.run_dir, tensorboard=cfg.metrics.tensorboard, rank=self.rank,
                                     wandb_project=cfg.metrics.wandb_project if cfg.metrics.wandb else None,
                                     run_name=cfg.job.name, config=cfg.to_dict())
        self.runner = build_step_runtime(cfg, self.actor, self.reference, self.engine, self.optimizer,
                                         self.lr_scheduler, self.tokenizer, pad_id=self.pad_id, dp_size=dp_size,
                                         dp_group=self.dp.group)
        self.residency = self.runner.residency  # memory.managed: what is on the device in each stage
        if self.residency is not None and self.rank == 0:
            (self.run_dir / "memory_plan.json").write_text(self.residency.plan.to_json())
            log.info("memory plan:\n%s", self.residency.plan)
        self._plan_written = False
        self.step = 0
        self.skipped_samples = 0
        self.unequal_share_dropped = 0  # good prompts cut so that every data-parallel rank has as many

    # ---- setup ----------------------------------------------------------------------------------------
    def _checkpoint_folder(self) -> Path:
        """model.hf_checkpoint, written as a tiny random model first where allowed and absent. Refused before
        anything is written: a typo must not leave a tiny random model (or a run folder) behind."""
        cfg = self.cfg
        ckpt = Path(cfg.model.hf_checkpoint)
        missing = not (ckpt / "config.json").is_file()
        if missing and not (cfg.model.make_tiny_if_missing and may_write_tiny_checkpoint(str(ckpt))):
            raise FileNotFoundError(missing_checkpoint_error(cfg.model.hf_checkpoint, cfg.model.make_tiny_if_missing))
        check_rewards(cfg)  # a config built in code is checked as a loaded one is
        self._seed(cfg.job.seed)
        if missing:
            if self.rank == 0:
                ensure_tiny_checkpoint(ckpt, cfg.model.flavor, cfg.job.seed)
            barrier()
        return ckpt

    def _load_tokenizer(self, ckpt: Path) -> None:
        """The checkpoint's processor, its stop and pad tokens, and the prompt encoder (data.video_* budget)."""
        d = self.cfg.data
        self.processor = load_processor(ckpt)
        self.tokenizer = self.processor.tokenizer
        self.eos_id = self.tokenizer.convert_tokens_to_ids("<|im_end|>")
        self.stop_ids = stop_token_ids(ckpt, self.eos_id)
        self.pad_id = self.tokenizer.pad_token_id or 0
        factor = self.processor.image_processor.patch_size * self.processor.image_processor.merge_size
        video_budget = VideoBudget(fps=d.video_fps, min_frames=d.video_min_frames, max_frames=d.video_max_frames,
                                   min_pixels=d.video_min_pixels, max_pixels=d.video_max_pixels,
                                   total_pixels=d.video_total_pixels, factor=factor)
        self.encoder = PromptEncoder(self.processor, d.max_prompt_tokens, video_budget=video_budget)

    def _load_data(self) -> None:
        cfg, d = self.cfg, self.cfg.data
        self.data = RunData(d, self.encoder, self.dp, self.rank)
        self.train_records = self.data.train
        self.eval_records = [r for s in self.data.eval_sets for r in s.records]
        self.evaluator = Evaluator(self.data.eval_sets, self.encoder, cfg.reward.correct, d.eval_k, d.eval_prompts,
                                   local=self.dp.local, mean=self.dp.mean, sums=self.dp.sums)
        self.reward_ledger = RewardLedger(cfg.reward.max_failure_fraction)
        self.stream = PromptStream(self.train_records, d.prompts_per_step, seed=cfg.job.seed, shuffle=d.shuffle)

    def _claim_run_folder(self) -> None:
        """Taken once the checkpoint path, rewards and data have passed their checks: a launch that fails one leaves
        an earlier run's folder as it was, and a live run's folder is never touched (run_folder.py)."""
        c = self.cfg.checkpoint
        self.checkpoints = CheckpointManager(self.run_dir / c.folder, c.interval, c.keep_latest_k, c.enable)
        resuming = c.enable and c.resume and self.checkpoints.latest_step() is not None
        self.run_lock = claim_run_folder(self.run_dir, self.checkpoints.folder, self.cfg.job.overwrite, resuming,
                                         self.rank, lambda flag: any_rank(flag, self.device))
        if self.rank == 0:
            save_config(self.cfg, self.run_dir / "config.toml")

    def _build_models(self, ckpt: Path) -> None:
        """The actor, the reference (only with algorithm.kl_coef > 0) and the rollout engine."""
        cfg, dtype = self.cfg, DTYPES[self.cfg.model.dtype]
        self.actor = build_model(hf_dir=ckpt, device=self.device, dtype=dtype, parallelize=self._parallelize)
        if cfg.model.freeze_vision:
            self.actor.visual.requires_grad_(False)
        self.reference = None
        if cfg.algorithm.kl_coef > 0:  # coefficient 0: the reference is never loaded
            self.reference = build_model(hf_dir=ckpt, device=self.device, dtype=dtype,
                                         parallelize=self._parallelize).eval().requires_grad_(False)
        r = cfg.rollout
        if r.backend == "sglang":  # a colocated sglang.Engine, weights pushed before each rollout
            self.engine = build_sglang_engine(self.actor, str(ckpt), self.dims, cfg.parallelism.rollout_tp,
                                              self.device, dtype=cfg.model.dtype, mem_fraction=r.sglang_mem_fraction,
                                              timeout_s=r.sglang_timeout_s, bucket_mib=r.sglang_bucket_mib,
                                              deterministic=r.sglang_deterministic, seed=cfg.job.seed)
        else:  # rollout_tp != tp: rollout runs on a model sharing the actor's storage (runtime/rollout_weights.py)
            # every pool at least the training rollout's (this rank's prompts): an evaluation before the first step
            # builds the pool training reuses, so the decode attention compiles for one geometry
            floor = PoolFloor(n=r.n_samples, max_new=r.max_new_tokens,
                              prompts=-(-cfg.data.prompts_per_step // self.dp.size))
            self.engine = build_rollout_engine(self.actor, self.dims, cfg.parallelism.rollout_tp,
                                               kv_pool_bytes=int(r.kv_pool_gib * 2**30), max_batch=r.max_batch,
                                               pad_id=self.pad_id, device=self.device, least_pool=floor)
        # the same frozen weights: one copy, encoded once. Not under FSDP2, where the tower is a unit of the
        # actor's root and cannot join the reference's too: the reference keeps its own sharded copy
        if self.reference is not None and cfg.model.freeze_vision and not (self.dims and self.dims.fsdp_enabled):
            self.reference.visual = self.actor.visual

    def _build_optimizer(self) -> None:
        cfg, o = self.cfg, self.cfg.optimizer
        notice = optimizer_notice(o.name, self.device.type)
        if notice and self.rank == 0:
            log.warning(notice)
        self.optimizer = build_optimizer(self.actor, o.name, o.lr, (o.beta1, o.beta2), o.eps, o.weight_decay)
        self.lr_scheduler = build_lr_scheduler(self.optimizer, cfg.lr_scheduler.warmup_steps, cfg.lr_scheduler.decay,
                                               cfg.training.steps, cfg.lr_scheduler.min_lr_ratio)

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
        """A few supervised steps on `<answer>{answer}</answer>` (sft_warmup.py); the reference then starts at the
        warmed-up actor."""
        t = self.cfg.training
        if t.sft_warmup_steps <= 0:
            return
        warmup = SupervisedWarmup(self.actor, self.encoder, self.tokenizer, self.eos_id, self.pad_id, self.dp,
                                  self.data.no_valid_sample)
        progress = StepProgress(t.sft_warmup_steps, rank=self.rank, enable=self.cfg.metrics.progress_bar,
                                desc="warmup")
        self.summary.warmup_done = warmup.run(self.train_records, t, self.cfg.job.seed,
                                              lambda: self.stop.requested, progress)
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
        if not prompts and self.dp.group is None:
            return []  # with several ranks, one without prompts still joins the collectives (an empty rollout)
        outputs = self.engine.generate(prompts, self.sampling_params(greedy=greedy, n=n))
        reshard(self.actor)
        return [self.tokenizer.batch_decode([o.token_ids for o in group], skip_special_tokens=True)
                for group in outputs]

    # ---- one RL step ------------------------------------------------------------------------------------
    def _next_batch(self, timer: PhaseTimer) -> tuple[EncodedBatch, list[int]]:
        """This rank's share of the next global batch, encoded (bad samples skipped) and cut to the fewest prompts
        any data-parallel rank has; with each prompt's index in the global batch."""
        with timer.phase("data"):
            global_batch = self.stream.next_batch()
            positions = self.dp.local(list(range(len(global_batch))))
            batch = self.encoder.encode_batch([global_batch[i] for i in positions])
            global_indices = [positions[i] for i in batch.indices]
        self.skipped_samples += int(self.dp.sum(len(batch.skipped)))  # every rank keeps the global count
        if self.dp.sum(len(batch.prompts)) == 0:
            raise self.data.no_valid_sample("train")
        batch = self._equal_share(batch)
        return batch, global_indices[:len(batch.prompts)]

    def _equal_share(self, batch: EncodedBatch) -> EncodedBatch:
        """The batch cut to the fewest prompts any data-parallel rank has (skipped bad samples make shares unequal).

        Ranks must run the same micro-batches through the FSDP2-sharded actor (each forward and backward is a
        collective), and in the overlapped mode every pass must find its prompt's prefix held, which equal numbers
        of prompts guarantee. The prompts cut are counted (`skipped/unequal_share`); with one rank nothing is cut."""
        if self.dp.size == 1:
            return batch
        keep = self.dp.fewest(len(batch.prompts))
        self.unequal_share_dropped += int(self.dp.sum(len(batch.prompts) - keep))
        if keep < len(batch.prompts):
            log.warning("dropping %d of this rank's %d prompts: another data-parallel rank has only %d valid ones",
                        len(batch.prompts) - keep, len(batch.prompts), keep)
        return EncodedBatch(batch.records[:keep], batch.prompts[:keep], batch.skipped, batch.indices[:keep])

    def train_step(self) -> tuple[dict[str, float], bool]:
        """One GRPO step (runtime/step.py) on the next batch; its metrics, and whether its update was applied (a
        non-finite loss or gradient skips it)."""
        t0, timer = time.perf_counter(), PhaseTimer(self.device)
        batch, global_indices = self._next_batch(timer)
        metrics: dict[str, float] = {"skipped/bad_samples": float(self.skipped_samples),
                                     "skipped/unequal_share": float(self.unequal_share_dropped),
                                     **self.data.skip_metrics()}
        if not batch.prompts:  # the same on every rank (_equal_share)
            return metrics, False
        params = self.sampling_params()
        decode_before = decode_counters(self.engine)
        out = self.runner.run(batch.prompts, reward_answers(batch.records, self.reward_ledger), params,
                              sample_seeds=self.sample_seeds(params, global_indices), phase_timer=timer)
        if not self._plan_written and self.rank == 0:  # the first step's plan, and why work runs where
            (self.run_dir / "plan.json").write_text(out.plan.to_json())
            log.info("step plan:\n%s", out.plan)
        self._plan_written = True
        metrics.update(outcome_metrics(out, self.dp, self.cfg.algorithm.kl_estimator))
        metrics.update({"lr": self.optimizer.param_groups[0]["lr"],
                        "reward/failures": self.dp.sum(float(self.reward_ledger.failures)),
                        "skipped/bad_records": float(self.data.bad_records.total)})
        metrics.update(token_metrics(out, self.dp))
        metrics.update(flops_metrics(out, self.actor.args, self.reference is not None,
                                     self.runner.vision_trainable(), self.cfg.algorithm.ppo_epochs, self.dp))
        metrics.update(decode_metrics(decode_before, self.engine))
        metrics.update(logprob_mismatch(out.experience, self.dp))
        metrics.update(timer.metrics())
        metrics.update(residency_metrics(self.residency))
        metrics["time/step_s"] = time.perf_counter() - t0
        return metrics, out.train.skipped_nonfinite == 0

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
        self.summary.skipped = {"skipped/unequal_share": self.unequal_share_dropped, **self.data.skip_metrics()}
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
