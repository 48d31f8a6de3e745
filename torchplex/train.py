"""torchplex trainer: synchronous on-policy GRPO for Qwen2.5-VL.

    ./run_train.sh                                   # tiny model on CPU, train_configs/debug.toml
    CONFIG_FILE=train_configs/qwen2_5_vl_7b.toml NGPU=8 ./run_train.sh --optimizer.lr=1e-6

Each step: rollout (native engine on the actor's own weights; with parallelism.rollout_tp != tp on a rollout model
that shares them, runtime/rollout_weights.py) -> rewards and group advantages -> reference
log-probs -> PPO-clip training, run by the step executor (runtime/executor.py). `runtime.mode` picks the schedule:
"serial" (every sample a full prompt+response forward), "decomposed" (the prompt prefix once per prompt, shared by
its G samples) or "overlapped" (decomposed, with the actor prefix fused into the rollout prefill).
"""

from __future__ import annotations

import logging
import math
import random
import time
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from .components.checkpoint import CheckpointManager
from .components.metrics import METRICS_FILENAME, MetricsLogger, PhaseTimer, StepProgress, format_step_line
from .components.optim import build_lr_scheduler, build_optimizer, clip_grad_norm
from .components.plot_metrics import plot_metrics
from .config import Config, load_config
from .data.processing import load_processor
from .data.prompts import EncodedBatch, PromptEncoder
from .data.records import PromptStream, read_records
from .data.synthetic import generate_synthetic_task
from .distributed.mesh import build_parallel_dims, destroy_distributed, init_distributed
from .models.qwen2_5_vl.build import build_model
from .distributed.fsdp import reshard
from .models.qwen2_5_vl.parallelize import parallelize_qwen2_5_vl
from .models.qwen2_5_vl.tiny_checkpoint import make_tiny_checkpoint
from .models.qwen2_5_vl.weights import copy_non_weight_files, save_hf_weights
from .rl.rewards import format_reward, is_correct
from .rollout.logprob_mismatch import mismatch_sums
from .rollout.sampling import SamplingParams, sample_seeds
from .rollout.sglang_backend.engine import build_sglang_engine, check_sglang_available
from .runtime.build import build_step_runtime
from .runtime.grpo_step import all_reduce_sums, kl_to_reference
from .runtime.rollout_weights import build_rollout_engine
from .runtime.scoring import ScoreRequest, SerialScorer

log = logging.getLogger("torchplex")
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def ensure_tiny_checkpoint(path: Path, flavor: str, seed: int) -> None:
    """Debug runs need no download: write the tiny random checkpoint (tools/make_tiny_checkpoint.py's writer)."""
    log.info("no checkpoint at %s: writing a tiny random %s checkpoint", path, flavor)
    make_tiny_checkpoint(path, size=flavor, seed=seed)


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
        if self.rank == 0:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            cfg.save(self.run_dir / "config.toml")
        self._seed(cfg.job.seed)

        ckpt = Path(cfg.model.hf_checkpoint)
        if not (ckpt / "config.json").is_file():
            if not cfg.model.make_tiny_if_missing:
                raise FileNotFoundError(f"model.hf_checkpoint: no config.json in {ckpt} (set it to an HF "
                                        f"Qwen2.5-VL folder, or model.make_tiny_if_missing = true for a debug run)")
            if self.rank == 0:
                ensure_tiny_checkpoint(ckpt, cfg.model.flavor, cfg.job.seed)
            self._barrier()
        self.processor = load_processor(ckpt)
        self.tokenizer = self.processor.tokenizer
        self.eos_id = self.tokenizer.convert_tokens_to_ids("<|im_end|>")
        self.pad_id = self.tokenizer.pad_token_id or 0
        self.encoder = PromptEncoder(self.processor, cfg.data.max_prompt_tokens)

        self.train_records, self.eval_records = self._load_data()
        self.stream = PromptStream(self.train_records, cfg.data.prompts_per_step, seed=cfg.job.seed,
                                   shuffle=cfg.data.shuffle)

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
                                              seed=cfg.job.seed)
        else:  # rollout_tp != tp: rollout runs on a model sharing the actor's storage (runtime/rollout_weights.py)
            self.engine = build_rollout_engine(self.actor, self.dims, cfg.parallelism.rollout_tp,
                                               kv_pool_bytes=int(cfg.rollout.kv_pool_gib * 2**30),
                                               max_batch=cfg.rollout.max_batch, pad_id=self.pad_id,
                                               device=self.device)
        if self.reference is not None and cfg.model.freeze_vision:
            self.reference.visual = self.actor.visual  # the same frozen weights: keep one copy, encode once
        o = cfg.optimizer
        self.optimizer = build_optimizer(self.actor, o.name, o.lr, (o.beta1, o.beta2), o.eps, o.weight_decay)
        self.lr_scheduler = build_lr_scheduler(self.optimizer, cfg.lr_scheduler.warmup_steps, cfg.lr_scheduler.decay,
                                               cfg.training.steps, cfg.lr_scheduler.min_lr_ratio)
        self.checkpoints = CheckpointManager(self.run_dir / cfg.checkpoint.folder, cfg.checkpoint.interval,
                                             cfg.checkpoint.keep_latest_k, cfg.checkpoint.enable)
        self.metrics = MetricsLogger(self.run_dir, tensorboard=cfg.metrics.tensorboard, rank=self.rank)
        self.runner = build_step_runtime(cfg, self.actor, self.reference, self.engine, self.optimizer,
                                         self.lr_scheduler, self.tokenizer, pad_id=self.pad_id, dp_size=self.dp_size,
                                         dp_group=self.dp_group)
        self.memory = self.runner.memory  # memory.managed: residency per stage of the runner's schedule
        if self.memory is not None and self.rank == 0:
            (self.run_dir / "memory_plan.json").write_text(self.memory.plan.to_json())
            log.info("memory plan:\n%s", self.memory.plan)
        self._schedule_written = False
        self.step = 0
        self.skipped_samples = 0
        self.unequal_share_dropped = 0  # good prompts cut so that every data-parallel rank has as many

    # ---- setup helpers --------------------------------------------------------------------------------
    def _barrier(self) -> None:
        if dist.is_initialized():
            dist.barrier()

    def _parallelize(self, model):
        m = self.cfg.model
        if self.dims is None and not (m.activation_checkpointing or m.compile):
            return model
        return parallelize_qwen2_5_vl(model, self.dims, param_dtype=DTYPES[m.dtype], reduce_dtype=torch.float32,
                                      activation_checkpointing=m.activation_checkpointing, compile=m.compile,
                                      freeze_vision=m.freeze_vision)

    def _seed(self, seed: int) -> None:
        random.seed(seed)
        np.random.seed(seed)
        torch.manual_seed(seed)

    def _load_data(self):
        d = self.cfg.data
        if d.train_file:
            train_path, eval_path = Path(d.train_file), Path(d.eval_file) if d.eval_file else None
        else:
            if self.rank == 0:
                generate_synthetic_task(d.synthetic_dir, d.synthetic_train, d.synthetic_eval, seed=self.cfg.job.seed,
                                        image_size=(112, 112))
            self._barrier()
            train_path, eval_path = generate_synthetic_task(d.synthetic_dir, d.synthetic_train, d.synthetic_eval,
                                                            seed=self.cfg.job.seed, image_size=(112, 112))
        train = read_records(train_path, on_error="skip")
        evals = read_records(eval_path, on_error="skip") if eval_path else []
        return train, evals

    def _local(self, items: list) -> list:
        """This data-parallel rank's share of a global batch."""
        return items[self.dp_rank::self.dp_size]

    def sampling_params(self, greedy: bool = False, n: int | None = None) -> SamplingParams:
        r = self.cfg.rollout
        return SamplingParams(n=n or r.n_samples, temperature=r.temperature, top_p=r.top_p, top_k=r.top_k,
                              greedy=greedy, max_new_tokens=r.max_new_tokens, stop_token_ids=[self.eos_id],
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
        progress = StepProgress(t.sft_warmup_steps, rank=self.rank, enable=self.cfg.metrics.progress_bar)
        for step in range(1, t.sft_warmup_steps + 1):
            batch = self.encoder.encode_batch(self._local(stream.next_batch()))
            if self._fewest(len(batch.prompts)) == 0:  # every rank skips the step, or none (collectives)
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
            if step % 50 == 0 or step == t.sft_warmup_steps:
                log.info("sft step %d/%d loss %.4f", step, t.sft_warmup_steps, loss.item())
        progress.close()
        del optimizer

    # ---- evaluation ------------------------------------------------------------------------------------
    def evaluate(self) -> dict[str, float]:
        records = self._local(self.eval_records[:self.cfg.data.eval_prompts])
        batch = self.encoder.encode_batch(records)
        if not batch.prompts and self.dp_group is None:
            return {}  # with several ranks, one without prompts still joins the collectives (an empty rollout)
        outputs = self.engine.generate(batch.prompts, self.sampling_params(greedy=True, n=1))
        reshard(self.actor)
        texts = self.tokenizer.batch_decode([o[0].token_ids for o in outputs], skip_special_tokens=True)
        correct = [float(is_correct(t, r.answer)) for t, r in zip(texts, batch.records)]
        formatted = [format_reward(t, r.answer) for t, r in zip(texts, batch.records)]
        return {"eval/accuracy": self._mean(correct), "eval/format": self._mean(formatted)}

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
        batch = self._equal_share(batch)
        global_indices = global_indices[:len(batch.prompts)]
        metrics: dict[str, float] = {"skipped/bad_samples": float(self.skipped_samples),
                                     "skipped/unequal_share": float(self.unequal_share_dropped)}
        if not batch.prompts:  # the same on every rank (_equal_share)
            return metrics, False
        params = self.sampling_params()
        out = self.runner.run(batch.prompts, [r.answer for r in batch.records], params,
                              sample_seeds=self.sample_seeds(params, global_indices), phase_timer=timer)
        exp, result = out.experience, out.train
        if not self._schedule_written and self.rank == 0:  # the first step's schedule, and why work runs where
            (self.run_dir / "schedule.json").write_text(out.schedule.to_json())
            log.info("step schedule:\n%s", out.schedule)
        self._schedule_written = True
        rewards = exp.rewards
        metrics.update({
            "reward/mean": self._mean(rewards.tolist()),
            "reward/std": self._std(rewards.tolist()),
            "accuracy": self._mean([float(c) for c in exp.correct]),
            "response_length/mean": self._mean(exp.lengths.float().tolist()),
            "groups/kept_fraction": self._mean(exp.keep_groups.float().tolist()),
            "lr": self.optimizer.param_groups[0]["lr"],
            "skipped/nonfinite_steps": float(result.skipped_nonfinite),
        })
        metrics.update(self._token_metrics())
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
        if self.memory is not None:  # plan next to what the manager held (and measured, on CUDA)
            for record in self.memory.records[-len(self.memory.plan.phases):]:
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

    def _token_metrics(self) -> dict[str, float]:
        """Decoder token-forwards of this step's scoring (reference + actor), and what serial would have run."""
        scorer = self.runner.scorer
        counts = scorer.counts
        local = [counts.prefix_tokens, counts.response_tokens,
                 getattr(scorer, "serial_equivalent_tokens", counts.total)]
        prefix, response, serial = all_reduce_sums(local, self.device, self.dp_group)  # the whole job's work
        out = {"tokens/prefix": prefix, "tokens/response": response, "tokens/serial_equivalent": serial,
               "tokens/saving_x": serial / max(prefix + response, 1)}
        counts.prefix_tokens = counts.response_tokens = counts.vision_patches = 0
        if hasattr(scorer, "serial_equivalent_tokens"):
            scorer.serial_equivalent_tokens = 0
        return out

    # ---- the loop ------------------------------------------------------------------------------------------
    def train(self) -> dict[str, float]:
        cfg = self.cfg
        if cfg.checkpoint.enable and cfg.checkpoint.resume and self.checkpoints.latest_step() is not None:
            self.step, extra = self.checkpoints.load(self.actor, self.optimizer, self.lr_scheduler)
            self.stream.load_state_dict(extra["data"])
            self.skipped_samples = extra.get("skipped_samples", 0)
            self.unequal_share_dropped = extra.get("unequal_share_dropped", 0)
            dropped = self.metrics.drop_after(self.step)  # logged after the checkpoint: they are logged again
            log.info("resumed from step %d%s", self.step,
                     f" ({dropped} metrics records of later steps removed from {METRICS_FILENAME})" if dropped else "")
        elif cfg.training.sft_warmup_steps > 0:
            if self.eval_records and cfg.metrics.eval_interval > 0:
                before = self.evaluate()
                self.metrics.log(0, {f"{k}_before_sft": v for k, v in before.items()})
                log.info("eval before SFT warm-up: %s", before)
            self.sft_warmup()
        last_eval: dict[str, float] = {}
        if self.step == 0 and self.eval_records and cfg.metrics.eval_interval > 0:
            last_eval = self.evaluate()
            self.metrics.log(0, last_eval)
            log.info("eval at step 0: %s", last_eval)
        progress = StepProgress(cfg.training.steps, initial=self.step, rank=self.rank, enable=cfg.metrics.progress_bar)
        while self.step < cfg.training.steps:
            self.step += 1
            metrics, finite = self.train_step()
            last = self.step == cfg.training.steps
            if self.eval_records and cfg.metrics.eval_interval > 0 and (self.step % cfg.metrics.eval_interval == 0 or last):
                last_eval = self.evaluate()
                metrics.update(last_eval)
            self.metrics.log(self.step, metrics)
            progress.update(self.step, metrics)
            if self.step % cfg.metrics.log_interval == 0:
                line = format_step_line(self.step, cfg.training.steps, metrics)
                progress.write(line) if cfg.metrics.progress_bar else log.info(line)
            if finite and self.checkpoints.should_save(self.step, last=last):
                self.checkpoints.save(self.step, self.actor, self.optimizer, self.lr_scheduler,
                                      extra={"data": self.stream.state_dict(), "skipped_samples": self.skipped_samples,
                                             "unequal_share_dropped": self.unequal_share_dropped})
        progress.close()
        if cfg.checkpoint.export_hf_at_end:
            save_hf_weights(self.actor, self.run_dir / "hf_export")
            if self.rank == 0:
                copy_non_weight_files(self.cfg.model.hf_checkpoint, self.run_dir / "hf_export")
        self.metrics.close()
        if self.memory is not None and self.rank == 0:
            self.memory.save(self.run_dir / "memory_measured.json")
        if self.rank == 0:
            self._plot()
        return last_eval

    def _plot(self) -> None:
        try:
            log.info("metrics plot: %s", plot_metrics(self.run_dir))
        except Exception as err:  # a plot must never fail a finished run
            log.warning("could not plot metrics: %s", err)


def main(argv: list[str] | None = None) -> None:
    logging.basicConfig(level=logging.INFO, format="[%(asctime)s] %(message)s", datefmt="%H:%M:%S")
    cfg = load_config(argv)
    trainer = Trainer(cfg)
    trainer.train()
    destroy_distributed()


if __name__ == "__main__":
    main()
