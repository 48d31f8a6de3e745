"""Scoring on packed tokens: a micro-batch's valid tokens in one token dimension instead of padded rows.

A request's responses are right-padded to the longest (S, R); with long-tailed lengths most of that rectangle is
padding, and the decoder's dense parts and the LM head would run on all of it. Here the scorers run the decoder
on the valid tokens only (models/packing.py attends each sequence over its own keys) and the LM head on the
response tokens only, then scatter the per-token results back into the (S, R) rectangle the loss reads, zeros at
pad positions. Every index is built on the host from host lengths (the rollout outputs' lengths): no device sync
inside the decoder's layer loop.

  decomposed: suffix s's inputs are its response without the last token (lengths[s] - 1 tokens, none when the
              response has <= 1 token); token 0 is predicted by its prompt's last prefix hidden state.
  serial:     row s is its prompt then its response without the last token; response token j is predicted by
              the row's position prompt_len - 1 + j.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from ..data.batching import collate, encode_visuals
from ..models.packing import upload
from ..rl.logprobs import entropy_from_hidden, logprobs_from_hidden

if TYPE_CHECKING:
    from .scoring import ScoreRequest


def _cat_ranges(starts: list[int], lengths: list[int]) -> torch.Tensor:
    """cat(arange(start, start + n)) over the pairs, as one host tensor."""
    parts = [torch.arange(st, st + n) for st, n in zip(starts, lengths) if n > 0]
    return torch.cat(parts) if parts else torch.zeros(0, dtype=torch.long)


def _starts(lengths: list[int]) -> list[int]:
    out, total = [], 0
    for n in lengths:
        out.append(total)
        total += n
    return out


class PackedResponses:
    """Where a request's valid response tokens sit in its (S, R) rectangle, for gathering and scattering back."""

    def __init__(self, request: "ScoreRequest"):
        self.lengths = request.host_lengths()
        self.shape = tuple(request.tokens.shape)
        self.device = request.tokens.device
        width = self.shape[1]
        # Index of response token j of row s in the flattened rectangle: s * R + j.
        self.flat = upload(_cat_ranges([s * width for s in range(self.shape[0])], self.lengths), self.device)
        self.count = sum(self.lengths)

    def gather(self, rect: torch.Tensor) -> torch.Tensor:
        return rect.reshape(-1)[self.flat]

    def scatter(self, values: torch.Tensor) -> torch.Tensor:
        """(N,) -> (S, R), zeros at pad positions; differentiable."""
        out = values.new_zeros(self.shape[0] * self.shape[1])
        return out.index_copy(0, self.flat, values).view(self.shape)


def packed_scores(model, predictors: torch.Tensor, layout: PackedResponses, tokens: torch.Tensor,
                  temperature: float, with_entropy: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Log-probs (and entropies) (S, R) from the predictor hidden states (N, D) of the valid response tokens."""
    weight = model.output_weight
    logp = logprobs_from_hidden(predictors, weight, layout.gather(tokens), temperature=temperature)
    if not with_entropy:
        return layout.scatter(logp), None
    return layout.scatter(logp), layout.scatter(entropy_from_hidden(predictors, weight, temperature).float())


def decomposed_predictors(model, prefix, request: "ScoreRequest", layout: PackedResponses) -> torch.Tensor:
    """Hidden states (N, D) that predict each valid response token, from packed suffixes on `prefix`."""
    owners = list(request.prompt_index)
    first = prefix.last_hidden[upload(torch.tensor(owners), layout.device)]  # (S, D): predicts token 0
    inputs = [max(n - 1, 0) for n in layout.lengths]
    total = sum(inputs)
    if total == 0:
        rows = torch.tensor([s for s, n in enumerate(layout.lengths) if n > 0], dtype=torch.long)
        return first[upload(rows, layout.device)]
    # Suffix inputs: response tokens 0 .. n-2 of each row (token j + 1 is predicted by input j).
    tokens = layout.gather(request.tokens)
    keep = upload(_cat_ranges(_starts(layout.lengths), inputs), layout.device)
    prefix_lengths = [len(p.input_ids) for p in request.prompts]
    rest = model.packed_suffix_forward(prefix, tokens[keep], owners, inputs, prefix_lengths)
    # Predictor of token j of row s: row s of `first` for j = 0, else packed suffix row (start_s + j - 1).
    index, starts, S = [], _starts(inputs), len(owners)
    for s, n in enumerate(layout.lengths):
        if n > 0:
            index.append(torch.tensor([s]))
            index.append(torch.arange(n - 1) + S + starts[s])
    return torch.cat([first, rest])[upload(torch.cat(index), layout.device)]


def serial_predictors(model, request: "ScoreRequest", layout: PackedResponses, pad_id: int
                      ) -> tuple[torch.Tensor, list]:
    """Hidden states (N, D) predicting each valid response token from packed prompt+response rows, and the rows'
    prompts (for the token counts)."""
    prompts = [request.prompts[i] for i in request.prompt_index]
    host_tokens = request.tokens.tolist()
    responses = [host_tokens[s][:max(n - 1, 0)] for s, n in enumerate(layout.lengths)]
    batch = collate(model.args, prompts, responses, pad_id=pad_id)
    image, video = encode_visuals(model, batch.to(layout.device))
    prompt_lens = [len(p.input_ids) for p in prompts]
    seq_lens = [p + len(r) for p, r in zip(prompt_lens, responses)]
    width = batch.input_ids.shape[1]
    flat = _cat_ranges([s * width for s in range(len(prompts))], seq_lens)
    in_prompt = torch.cat([torch.arange(n) < p for p, n in zip(prompt_lens, seq_lens)])
    device = layout.device
    hidden = model.packed_forward(batch.input_ids.reshape(-1)[flat].to(device),
                                  batch.position_ids.reshape(3, -1)[:, flat].to(device), seq_lens,
                                  image_embeds=image, video_embeds=video, prompt_mask=in_prompt.to(device))
    starts = _starts(seq_lens)
    index = _cat_ranges([st + p - 1 for st, p in zip(starts, prompt_lens)], layout.lengths)
    return hidden[upload(index, device)], prompts
