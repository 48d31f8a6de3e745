"""Per-token log-probs of sampled responses under a model: the one computation that reference scoring,
old-policy scoring and actor training share.

`SerialScorer` is the baseline (what verl does): every sample is a full prompt+response forward, so the vision
tower and the prompt run G times per prompt. `torchplex.runtime.decomposition.DecomposedScorer` computes the
same numbers with the prompt prefix run once per prompt.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Protocol, Sequence

import torch

from .packing import PackedResponses, packed_scores, serial_predictors


@dataclass
class ScoreRequest:
    """S responses to score; response s continues prompt `prompts[prompt_index[s]]`."""

    prompts: Sequence             # PromptInputs-like, the distinct prompts of this request
    prompt_index: list[int]       # (S,)
    tokens: torch.Tensor          # (S, R) right-padded response tokens
    lengths: torch.Tensor         # (S,) valid response tokens
    lengths_list: list[int] | None = None  # the same on the host, when the caller has them (no device sync)

    def host_lengths(self) -> list[int]:
        if self.lengths_list is None:
            self.lengths_list = [int(n) for n in self.lengths.tolist()]
        return self.lengths_list

    @property
    def mask(self) -> torch.Tensor:
        return torch.arange(self.tokens.shape[1], device=self.lengths.device)[None] < self.lengths[:, None]


_COUNTS_LOCK = threading.Lock()


@dataclass
class TokenCounts:
    """Token-forwards a scoring pass ran through the decoder (prefix and suffix parts)."""

    prefix_tokens: int = 0
    response_tokens: int = 0
    vision_patches: int = 0

    def add(self, other: "TokenCounts") -> None:
        with _COUNTS_LOCK:  # the decode window's thread scores beside the rollout's prefills
            self.prefix_tokens += other.prefix_tokens
            self.response_tokens += other.response_tokens
            self.vision_patches += other.vision_patches

    @property
    def total(self) -> int:
        return self.prefix_tokens + self.response_tokens


class Scorer(Protocol):
    counts: TokenCounts

    def score(self, model, request: ScoreRequest, temperature: float, with_entropy: bool = False
              ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(S, R) log-probs of the response tokens (differentiable when grad is enabled), and entropies."""

    def backward(self, loss: torch.Tensor) -> None:
        """Backpropagate a loss of this scorer's `score` outputs into the model's .grad."""

    def finish_backward(self) -> None:
        """After an epoch's last micro-batch: whatever gradient work `backward` held back."""

    def new_step(self, store=None, vision=None) -> None:
        """A new step's step-scoped state (held prefixes, the frozen tower's encodings), fresh ones when None."""

    def take_counts(self) -> tuple[TokenCounts, int]:
        """(the token-forwards scored since the last call, what the serial step would have scored), reset."""


class SerialScorer:
    """Each response as its own full prompt+response sequence (vision and prompt recomputed per sample), its valid
    tokens packed (runtime/packing.py)."""

    def __init__(self, pad_id: int = 0):
        self.pad_id = pad_id
        self.counts = TokenCounts()

    def new_step(self, store=None, vision=None) -> None:
        """Nothing is step-scoped here (the decomposed scorer holds prefixes and encodings per step)."""

    def take_counts(self) -> tuple[TokenCounts, int]:
        """(this step's token counts, what the serial step scored: the same), the counters reset."""
        counts, self.counts = self.counts, TokenCounts()
        return counts, counts.total

    def score(self, model, request: ScoreRequest, temperature: float, with_entropy: bool = False):
        layout = PackedResponses(request)
        hidden, prompts = serial_predictors(model, request, layout, self.pad_id)
        self.counts.add(TokenCounts(prefix_tokens=sum(len(p.input_ids) for p in prompts), response_tokens=layout.count,
                                    vision_patches=sum(_patches(p) for p in prompts)))
        return packed_scores(model, hidden, layout, request.tokens, temperature, with_entropy)

    def backward(self, loss: torch.Tensor) -> None:
        loss.backward()

    def finish_backward(self) -> None:
        pass  # nothing held back


def _patches(prompt) -> int:
    total = 0
    for grid in (prompt.image_grid_thw, prompt.video_grid_thw):
        if grid is not None:
            total += int(grid.prod(-1).sum())
    return total
