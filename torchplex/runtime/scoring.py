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

from ..data.batching import collate, encode_visuals
from ..rl.logprobs import entropy_from_hidden, logprobs_from_hidden
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


def response_scores(model, hidden: torch.Tensor, tokens: torch.Tensor, temperature: float, with_entropy: bool,
                    chunk_size: int = 1024) -> tuple[torch.Tensor, torch.Tensor | None]:
    """hidden (S, R, D) where row j predicts tokens[:, j] -> log-probs (S, R) and optionally entropies, both
    differentiable when grad is enabled (the entropy for the loss's entropy bonus)."""
    logp = logprobs_from_hidden(hidden, model.output_weight, tokens, temperature=temperature, chunk_size=chunk_size)
    entropy = None
    if with_entropy:
        entropy = entropy_from_hidden(hidden, model.output_weight, temperature, chunk_size).float()
    return logp, entropy


class SerialScorer:
    """Each response as its own full prompt+response sequence (vision and prompt recomputed per sample).

    pack: run the rows' valid tokens packed (runtime/packing.py), not padded to the longest row."""

    def __init__(self, pad_id: int = 0, pack: bool = True):
        self.pad_id = pad_id
        self.pack = pack
        self.counts = TokenCounts()

    def score(self, model, request: ScoreRequest, temperature: float, with_entropy: bool = False):
        if self.pack:
            layout = PackedResponses(request)
            hidden, prompts = serial_predictors(model, request, layout, self.pad_id)
            self.counts.add(TokenCounts(prefix_tokens=sum(len(p.input_ids) for p in prompts),
                                        response_tokens=layout.count,
                                        vision_patches=sum(_patches(p) for p in prompts)))
            return packed_scores(model, hidden, layout, request.tokens, temperature, with_entropy)
        device = request.tokens.device
        responses = [request.tokens[s, :int(request.lengths[s])].tolist() for s in range(request.tokens.shape[0])]
        prompts = [request.prompts[i] for i in request.prompt_index]
        batch = collate(model.args, prompts, responses, pad_id=self.pad_id).to(device)
        image, video = encode_visuals(model, batch)
        hidden = model(batch.input_ids, batch.position_ids, image_embeds=image, video_embeds=video,
                       attention_mask=batch.attention_mask, prompt_lengths=batch.prompt_lengths)
        # Row j of a response is predicted by the hidden state one position before it.
        prompt_lens = torch.tensor([len(p.input_ids) for p in prompts], device=device)
        width = request.tokens.shape[1]
        index = (prompt_lens[:, None] - 1 + torch.arange(width, device=device)[None]).clamp(max=hidden.shape[1] - 1)
        picked = hidden.gather(1, index[..., None].expand(-1, -1, hidden.shape[-1]))
        self.counts.add(TokenCounts(prefix_tokens=int(prompt_lens.sum()), response_tokens=int(request.lengths.sum()),
                                    vision_patches=sum(_patches(p) for p in prompts)))
        return response_scores(model, picked, request.tokens, temperature, with_entropy)

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
