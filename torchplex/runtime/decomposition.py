"""Prefix/suffix decomposition of reference scoring and actor training (Rollplex mechanism 1).

The prompt prefix (vision + prompt tokens) does not depend on the sampled responses, so per prompt:
  * the vision tower runs once per step when it is frozen (one encoding serves rollout prefill, reference prefix
    and actor prefix), or once per prompt inside the actor prefix when it trains;
  * the model's `prefix_forward` runs once, with autograd when training, and its K/V serve the prompt's G
    response suffixes (`suffix_forward`), whose gradients all flow back into that one prefix graph.
A model thus runs P + G*R token-forwards per prompt instead of the serial G*(P+R). The log-probs are those of
`SerialScorer` to within float rounding; tests/test_decomposition.py holds the two to 1e-5 in fp32.
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint

from ..data.batching import collate
from .scoring import ScoreRequest, TokenCounts, _patches, response_scores


def tower_trains(model) -> bool:
    return torch.is_grad_enabled() and any(p.requires_grad for p in model.visual.parameters())


class VisionCache:
    """Visual embeddings of this step's prompts, per vision tower, for towers that do not train.

    Keyed by the tower module and the prompt object; `new_step()` clears it. A frozen actor tower shared with the
    reference model (same module) therefore encodes each prompt exactly once per step.
    """

    def __init__(self):
        self._store: dict[tuple[int, int, str], torch.Tensor] = {}
        self.encodes = 0

    def new_step(self) -> None:
        self._store.clear()

    def get(self, tower, prompt, kind: str):
        pixels = prompt.pixel_values if kind == "image" else prompt.pixel_values_videos
        grid = prompt.image_grid_thw if kind == "image" else prompt.video_grid_thw
        if pixels is None:
            return None
        key = (id(tower), id(prompt), kind)
        if key not in self._store:
            device = next(tower.parameters()).device
            with torch.no_grad():
                self._store[key] = tower(pixels.to(device), grid.to(device))
            self.encodes += 1
        return self._store[key]


class DecomposedScorer:
    def __init__(self, pad_id: int = 0, checkpoint_prefix: bool = False, vision_cache: VisionCache | None = None):
        self.pad_id = pad_id
        self.checkpoint_prefix = checkpoint_prefix
        self.vision = vision_cache or VisionCache()
        self.counts = TokenCounts()
        self.serial_equivalent_tokens = 0  # what SerialScorer would have run for the same requests

    def new_step(self) -> None:
        self.vision.new_step()

    def visual_embeds(self, model, prompts) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        if tower_trains(model):
            batch = collate(model.args, prompts, pad_id=self.pad_id)
            device = next(model.parameters()).device
            run = lambda pix, grid: None if pix is None else model.encode_vision(pix.to(device), grid.to(device))
            return run(batch.pixel_values, batch.image_grid_thw), run(batch.pixel_values_videos, batch.video_grid_thw)
        cat = lambda xs: torch.cat(xs) if xs else None
        images = [e for p in prompts if (e := self.vision.get(model.visual, p, "image")) is not None]
        videos = [e for p in prompts if (e := self.vision.get(model.visual, p, "video")) is not None]
        return cat(images), cat(videos)

    def prefix(self, model, prompts):
        """PrefixState of the distinct prompts (right-padded batch), with autograd when grad is enabled."""
        device = next(model.parameters()).device
        batch = collate(model.args, prompts, pad_id=self.pad_id).to(device)
        image, video = self.visual_embeds(model, prompts)
        run = lambda img, vid: model.prefix_forward(batch.input_ids, batch.position_ids, batch.next_position,
                                                     batch.lengths, image_embeds=img, video_embeds=vid)
        if self.checkpoint_prefix and torch.is_grad_enabled():
            return checkpoint(run, image, video, use_reentrant=False), batch
        return run(image, video), batch

    def score(self, model, request: ScoreRequest, temperature: float, with_entropy: bool = False):
        prefix, batch = self.prefix(model, request.prompts)
        device = request.tokens.device
        owner = torch.tensor(request.prompt_index, device=device)
        first = prefix.last_hidden[owner][:, None]  # predicts response token 0
        if request.tokens.shape[1] > 1:
            # Suffix inputs are the responses without their last token: row j predicts token j + 1.
            rest = model.suffix_forward(prefix, request.tokens[:, :-1], (request.lengths - 1).clamp(min=1), owner)
            hidden = torch.cat([first, rest], dim=1)
        else:
            hidden = first
        prompt_tokens = int(batch.lengths.sum())
        response_tokens = int(request.lengths.sum())
        self.counts.add(TokenCounts(prefix_tokens=prompt_tokens, response_tokens=response_tokens,
                                    vision_patches=sum(_patches(p) for p in request.prompts)))
        self.serial_equivalent_tokens += int(batch.lengths[owner].sum()) + response_tokens
        return response_scores(model, hidden, request.tokens, temperature, with_entropy)

    def rollout_prefill(self, model):
        """A prefill for the rollout engine that takes the visual embeddings from this step's cache, so the
        frozen tower's one encoding per prompt also serves rollout."""

        @torch.no_grad()
        def prefill(prompts):
            return self.prefix(model, prompts)[0]

        return prefill
