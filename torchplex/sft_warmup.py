"""The supervised warm-up before RL (training.sft_warmup_steps): a few steps of cross-entropy on
`<answer>{answer}</answer><|im_end|>` after each prompt, so that a random or untuned model starts answering in the
format the rewards read. Its own AdamW (training.sft_lr), dropped when it ends."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch

from .components.metrics import StepProgress
from .components.optim import build_optimizer, clip_grad_norm
from .config.schema import TrainingConfig
from .data.prompts import EncodedBatch, PromptEncoder
from .data.records import PromptStream
from .distributed.data_parallel import DataParallelRanks
from .distributed.fsdp import reshard
from .runtime.scoring import ScoreRequest, SerialScorer


@dataclass
class SupervisedWarmup:
    actor: torch.nn.Module
    encoder: PromptEncoder
    tokenizer: object
    eos_id: int
    pad_id: int
    dp: DataParallelRanks
    no_valid_sample: Callable[[str], Exception]  # the error raised when no rank has a valid prompt

    def run(self, records: list, t: TrainingConfig, seed: int, stopped: Callable[[], bool],
            progress: StepProgress) -> int:
        """Up to t.sft_warmup_steps steps on batches of t.sft_batch_size records; returns the steps done (fewer
        when `stopped()` turns true). A step no rank has a valid prompt for is skipped on every rank."""
        stream = PromptStream(records, t.sft_batch_size, seed=seed + 1)
        optimizer = build_optimizer(self.actor, "adamw", t.sft_lr)
        done = 0
        for step in range(1, t.sft_warmup_steps + 1):
            if stopped():
                break
            batch = self.encoder.encode_batch(self.dp.local(stream.next_batch()), phase="warmup")
            if self.dp.fewest(len(batch.prompts)) == 0:  # every rank skips the step, or none (collectives)
                if self.dp.sum(len(batch.prompts)) == 0:
                    raise self.no_valid_sample("warmup")
                continue
            loss = self._step(batch, optimizer)
            done = step
            progress.update(step, {"sft/loss": loss})
            if step % 50 == 0 or step == t.sft_warmup_steps:
                progress.write(f"warm-up step {step}/{t.sft_warmup_steps} | loss {loss:.4f}")
        progress.close()
        return done

    def _step(self, batch: EncodedBatch, optimizer) -> float:
        """One optimizer step on the batch's answers; the loss is the mean over every rank's answer tokens."""
        device = self.dp.device
        targets = [self.tokenizer(f"<answer>{r.answer}</answer>", add_special_tokens=False)["input_ids"]
                   + [self.eos_id] for r in batch.records]
        width = max(len(x) for x in targets)
        tokens = torch.tensor([x + [self.pad_id] * (width - len(x)) for x in targets], device=device)
        lengths = torch.tensor([len(x) for x in targets], device=device)
        request = ScoreRequest(batch.prompts, list(range(len(batch.prompts))), tokens, lengths)
        logp, _ = SerialScorer(self.pad_id).score(self.actor, request, temperature=1.0)
        loss = -(logp * request.mask).sum() / self.dp.sum(float(request.mask.sum()))
        optimizer.zero_grad(set_to_none=True)
        (loss * self.dp.size).backward()  # FSDP averages gradients over the ranks; the loss is already the job's
        clip_grad_norm(self.actor.parameters(), 1.0)
        reshard(self.actor)
        optimizer.step()
        return loss.item()
