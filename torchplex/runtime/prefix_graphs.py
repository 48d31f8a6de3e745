"""The reference model's prompt prefix as compiled graphs, one per prompt-length bucket, captured on CUDA.

Why: measured on the H200 (docs/benchmarks.md, long-tailed whole steps), an eager 987-token prefix forward of the
3B reference held the host ~0.17 s, launch after launch. Run as a decode-window slice it stalls the
decode loop for that long; run in the reference phase it is most of that phase. A captured graph launches in
microseconds, so the only cost left is the GPU's.

How: the embedding (with the visual embeddings spliced in, data-dependent) stays eager; the decoder layers run as
`torch.compile(dynamic=False)` over the prompt right-padded to a multiple of `bucket` tokens, with plain causal
attention: a padded position can only be seen by later (padded) positions, so the first L rows, their K/V and
the last hidden state are those of the unpadded prompt up to the kernels' rounding. On CUDA each bucket's graph
is captured once and replayed; the graph reads the weights where they lay at capture, so a move of any
parameter (the memory manager offloading and reloading the reference) drops the captured graphs.

No autograd: this serves frozen models (the reference), never the actor's training prefix.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from ..components.captured_step import CapturedStep, plain_tensors
from ..models.attention import PrefixState, sdpa

log = logging.getLogger(__name__)

PREFIX_BUCKET = 256


class _RecordingCausal:
    """Causal attention over one unpadded-or-right-padded prompt, recording each layer's rotated K/V."""

    def __init__(self):
        self.k: list[torch.Tensor] = []
        self.v: list[torch.Tensor] = []

    def __call__(self, layer: int, q, k, v):
        self.k.append(k)
        self.v.append(v)
        return sdpa(q, k, v, is_causal=True)


class PrefixGraphs:
    """No-grad prefix forwards of one frozen model, compiled per bucket of prompt length (and captured on CUDA).

    compile and capture default to "on CUDA": elsewhere the same padded path runs eagerly (inductor's CPU code
    would pay a minute of compilation per bucket for little).
    """

    def __init__(self, model, *, bucket: int = PREFIX_BUCKET, compile: bool | None = None,
                 capture: bool | None = None):
        if not plain_tensors(model):
            raise ValueError("PrefixGraphs needs a model of plain tensors (not FSDP2/DTensor-sharded)")
        self.model = model
        self.bucket = bucket
        device = next(model.parameters()).device
        compile = device.type == "cuda" if compile is None else compile
        self.capture = device.type == "cuda" if capture is None else capture
        if self.capture and device.type != "cuda":
            raise ValueError("PrefixGraphs(capture=True) needs a CUDA model")
        if compile:
            # One compilation per bucket, all of one code object: past dynamo's default limit of 8 it would run
            # eager, which is not what a captured graph should hold.
            torch._dynamo.config.recompile_limit = max(torch._dynamo.config.recompile_limit, 64)
        self._decode = torch.compile(self._layers, dynamic=False) if compile else self._layers
        self._captured: dict[int, CapturedStep] = {}
        self._weights_at: tuple[int, ...] = ()
        self.calls = 0

    def _layers(self, h: torch.Tensor, position_ids: torch.Tensor) -> list[torch.Tensor]:
        attn = _RecordingCausal()
        hidden = self.model.decode(h, position_ids, attn)
        return [hidden, *attn.k, *attn.v]

    def _weights_key(self) -> tuple[int, ...]:
        return tuple(p.data_ptr() for p in self.model.parameters())

    def _run(self, width: int, h: torch.Tensor, position_ids: torch.Tensor) -> list[torch.Tensor]:
        if not self.capture:
            return self._decode(h, position_ids)
        key = self._weights_key()
        if key != self._weights_at:  # weights moved (offload/reload): graphs read the old addresses
            self._captured.clear()
            self._weights_at = key
        if width not in self._captured:
            self._captured[width] = CapturedStep(self._decode, on_capture=lambda s: log.info(
                "reference prefix: captured the %d-token bucket in %.2fs", width, s))
        return self._captured[width](h, position_ids)

    @torch.no_grad()
    def __call__(self, input_ids: torch.Tensor, position_ids: torch.Tensor, next_position: torch.Tensor, *,
                 image_embeds: torch.Tensor | None = None, video_embeds: torch.Tensor | None = None) -> PrefixState:
        """PrefixState of one prompt: input_ids (1, L), position_ids (3, 1, L), next_position (1,)."""
        if input_ids.shape[0] != 1:
            raise ValueError(f"PrefixGraphs runs one prompt at a time, got a batch of {input_ids.shape[0]}")
        self.calls += 1
        length = input_ids.shape[1]
        width = -(-length // self.bucket) * self.bucket
        h = self.model.embed(input_ids, image_embeds, video_embeds)
        pad = width - length
        h = F.pad(h, (0, 0, 0, pad))
        # Padded positions repeat the last one: any value would do, these rows are never read.
        position_ids = torch.cat([position_ids, position_ids[:, :, -1:].expand(-1, -1, pad)], dim=2)
        out = self._run(width, h, position_ids)
        layers = len(self.model.layers)
        hidden, ks, vs = out[0], out[1:1 + layers], out[1 + layers:]
        # Copies out of the graph's static outputs, which the next replay overwrites.
        k = [t[:, :, :length].clone() for t in ks]
        v = [t[:, :, :length].clone() for t in vs]
        lengths = torch.tensor([length], device=input_ids.device)
        return PrefixState(k, v, lengths, next_position, hidden[:, length - 1].clone())
