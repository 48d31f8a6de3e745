"""Prefix/suffix decomposition of reference scoring and actor training (Rollplex mechanism 1).

The prompt prefix (vision + prompt tokens) does not depend on the sampled responses, so per prompt:
  * the vision tower runs once per step when it is frozen (one encoding serves rollout prefill, reference prefix
    and actor prefix), or once per prompt inside the actor prefix when it trains;
  * the model's `prefix_forward` runs once, with autograd when training, and its K/V serve the prompt's G
    response suffixes (`suffix_forward`), whose gradients all flow back into that one prefix graph.
A model thus runs P + G*R token-forwards per prompt instead of the serial G*(P+R). The log-probs are those of
`SerialScorer` to within float rounding; tests/test_decomposition.py holds the two to 1e-5 in fp32.

Training backward runs in two parts (`DecomposedScorer.backward`). Every decoder weight and the token embeddings
serve both the prefix and the suffixes, so in one backward each weight's `AccumulateGrad` node has two inputs: the
suffix part is computed first and would wait in the node's input buffer until the prefix part arrives, a whole
extra copy of those gradients (the size of the held K/V) at the start of the prefix backward. Instead the suffixes read
the prefix tensors detached, as leaves that require grad: their backward accumulates every weight's suffix part
into `.grad` at once and leaves the prefix tensors' gradients on the leaves; a second backward from the prefix
tensors with those gradients adds the prefix part (tests/test_suffix_grad_memory.py measures the difference).

The overlapped mode's fused prefill (runtime/prefixes.py) runs the prompts of one rollout prefill as one batched
forward with autograd, and each prompt's state is a slice of it, held in the step's PrefixStore. A graph can be
backpropagated once, so the prefix part of those micro-batches is held back and run once for the whole batch in
`finish_backward()`, after the epoch's last micro-batch: one batched prefix backward instead of one per prompt (the
activations were held since rollout anyway).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch.distributed.fsdp import FSDPModule
from torch.utils.checkpoint import checkpoint

from ..data.batching import collate
from ..distributed.fsdp import gather_root
from ..models.attention import PrefixState
from ..models.qwen2_5_vl.parallelize import under_current_recompute
from .prefixes import PrefixStore, merge_prefix_states, prompt_part
from .packing import PackedResponses, decomposed_predictors, packed_scores
from .scoring import ScoreRequest, TokenCounts, _patches


def tower_trains(model) -> bool:
    return torch.is_grad_enabled() and any(p.requires_grad for p in model.visual.parameters())


BATCH_PATCHES = 65536  # patches per batched encoding of a frozen tower: 16 of the `img` workload's 896x896 images


class VisionCache:
    """Visual embeddings of this step's prompts, per vision tower, for towers that do not train.

    Keyed by the tower module and the prompt object; one per step (the step's, given to
    DecomposedScorer.new_step). A frozen actor tower shared with the reference model (same module) therefore encodes
    each prompt exactly once per step.
    """

    def __init__(self):
        self._store: dict[tuple[int, int, str], torch.Tensor] = {}
        self.encodes = 0

    def get_many(self, model, prompts, kind: str) -> list[torch.Tensor | None]:
        """Each prompt's visual embeddings from `model`'s tower (None for a prompt without that kind), keyed by the
        tower: a reference sharing the actor's frozen tower reuses the actor's encoding. The prompts not cached yet
        are encoded together, up to BATCH_PATCHES patches per `model.encode_vision` call (the root's method, so an
        FSDP2 root initialises before its tower unit is called): one call per prompt ran the 7B tower's ~30 small
        kernels per block at the host's launch rate, not the GPU's. An FSDP2-sharded tower still encodes one prompt
        per call (see below)."""
        pixels = (lambda p: p.pixel_values) if kind == "image" else (lambda p: p.pixel_values_videos)
        grids = (lambda p: p.image_grid_thw) if kind == "image" else (lambda p: p.video_grid_thw)
        key = lambda p: (id(model.visual), id(p), kind)
        todo = list({id(p): p for p in prompts if pixels(p) is not None and key(p) not in self._store}.values())
        merge = model.args.vision.spatial_merge_size ** 2
        device = next(model.visual.parameters()).device
        # an FSDP2-sharded tower: one prompt per call, as many calls as prompts on every rank. Each call gathers
        # the tower's parameters across the ranks, and batches cut by patch count differ in number between ranks'
        # images (a rank with fewer would leave another waiting in a gather)
        limit = 0 if isinstance(model.visual, FSDPModule) else BATCH_PATCHES
        while todo:
            batch, patches = [], 0
            while todo and (not batch or patches + pixels(todo[0]).shape[0] <= limit):
                patches += pixels(todo[0]).shape[0]
                batch.append(todo.pop(0))
            with torch.no_grad():
                out = model.encode_vision(torch.cat([pixels(p) for p in batch]).to(device),
                                          torch.cat([grids(p) for p in batch]).to(device))
            sizes = [int(grids(p).prod(-1).sum()) // merge for p in batch]
            for p, embeds in zip(batch, out.split(sizes)):
                self._store[key(p)] = embeds
            self.encodes += len(batch)
        return [self._store[key(p)] if pixels(p) is not None else None for p in prompts]


def _leaf(t: torch.Tensor) -> torch.Tensor:
    return t.detach().requires_grad_() if t.requires_grad else t


@dataclass
class DeferredPrefix:
    """A prefix state's differentiable tensors (`roots`, with the prefix graph) and the detached leaves the
    suffixes read instead, in the same order; the prefix backward sends the leaves' gradients into the roots."""

    roots: list[torch.Tensor]
    leaves: list[torch.Tensor]
    model: torch.nn.Module  # whose forward made the roots
    batched: bool = False  # the roots are slices of a batched graph: backpropagated in finish_backward

    @staticmethod
    def split(state: PrefixState, model) -> tuple[PrefixState, "DeferredPrefix | None"]:
        """(the state the suffixes read, the deferred prefix part), or (state, None) when nothing needs grad."""
        roots = state.k + state.v + [state.last_hidden]
        if not any(t.requires_grad for t in roots):
            return state, None
        leaves = [_leaf(t) for t in roots]
        layers = len(state.k)
        detached = PrefixState(leaves[:layers], leaves[layers:2 * layers], state.lengths, state.next_position,
                               leaves[-1])
        return detached, DeferredPrefix(roots, leaves, model)

    def gradients(self) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """(roots, their gradients) for the leaves the suffix backward reached."""
        pairs = [(root, leaf.grad) for root, leaf in zip(self.roots, self.leaves)
                 if leaf is not root and leaf.grad is not None]
        return [r for r, _ in pairs], [g for _, g in pairs]

    def reached(self) -> bool:
        return bool(self.gradients()[0])


def _prefix_backward(roots: list[torch.Tensor], grads: list[torch.Tensor], models: list) -> None:
    """The deferred prefixes' backward from their roots, the models' FSDP2 root units gathered first (the suffix
    backward before it resharded them: `distributed.fsdp.gather_root`)."""
    if roots:
        for model in {id(m): m for m in models}.values():
            gather_root(model)
        torch.autograd.backward(roots, grad_tensors=grads)


class DecomposedScorer:
    """split_prefix_backward: with autograd on, the suffixes read detached prefix leaves and `backward(loss)` runs
    the suffix part, then the prefix part (see the module docstring); False keeps one backward through both
    (the same numbers up to summation order, plus a pending copy of the shared weights' gradients). A micro-batch's
    suffixes run as one packed token dimension (runtime/packing.py)."""

    def __init__(self, pad_id: int = 0, checkpoint_prefix: bool = False, vision_cache: VisionCache | None = None,
                 split_prefix_backward: bool = True):
        self.pad_id = pad_id
        self.checkpoint_prefix = checkpoint_prefix
        self.split_prefix_backward = split_prefix_backward
        self._deferred: list[DeferredPrefix] = []  # prefix parts of scored losses, until `backward` runs them
        # (roots, gradients, models) of batched prefixes, for finish_backward
        self._held_back: tuple[list, list, list] = ([], [], [])
        self.vision = vision_cache or VisionCache()
        self.store = PrefixStore()
        self.counts = TokenCounts()
        self.serial_equivalent_tokens = 0  # what SerialScorer would have run for the same requests

    def new_step(self, store: PrefixStore | None = None, vision: VisionCache | None = None) -> None:
        """A new step with its step-scoped state, the step's own: the held prefixes (`store`, which
        the overlap code fills) and the frozen tower's encodings (`vision`); fresh ones when None."""
        self.vision = vision if vision is not None else VisionCache()
        self.store = store if store is not None else PrefixStore()
        self._deferred.clear()
        self._held_back = ([], [], [])

    def take_counts(self) -> tuple[TokenCounts, int]:
        """(the token-forwards scored since the last call, what the serial step would have scored), reset."""
        counts, serial = self.counts, self.serial_equivalent_tokens
        self.counts, self.serial_equivalent_tokens = TokenCounts(), 0
        return counts, serial

    def backward(self, loss: torch.Tensor) -> None:
        """loss.backward() for losses of this scorer's `score` outputs: the suffix part (every weight's suffix
        gradient goes straight into .grad), then one backward of the deferred prefixes from their leaves'
        gradients (the prefix part is added to the same .grad). Prefixes sliced from a batched fused prefill are
        held back for `finish_backward`."""
        loss.backward()
        deferred, self._deferred = self._deferred, []
        roots, grads, models = [], [], []
        for d in deferred:
            r, g = d.gradients()
            if d.batched:
                self._held_back[0].extend(r)
                self._held_back[1].extend(g)
                self._held_back[2].append(d.model)
            else:
                roots += r
                grads += g
                models.append(d.model)
        _prefix_backward(roots, grads, models)
        for d in deferred:  # consumed; the caller's spent graph may still hold the leaves
            for leaf in d.leaves:
                leaf.grad = None

    def finish_backward(self) -> None:
        """After an epoch's last micro-batch: the held-back prefix part of the batched fused prefill, one backward
        through the whole batch's graph (each prompt's slice brings its micro-batch's gradients)."""
        held, self._held_back = self._held_back, ([], [], [])
        _prefix_backward(*held)

    def visual_embeds(self, model, prompts, batch=None) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """The prompts' visual embeddings: a trainable tower's forward (over `batch`, the prompts' collated batch,
        when the caller has it: collating again would copy and upload every pixel a second time, ~0.6 GB per 32
        image prompts), else the frozen tower's cached encodings."""
        if tower_trains(model):
            batch = batch if batch is not None else collate(model.args, prompts, pad_id=self.pad_id)
            device = next(model.parameters()).device
            run = lambda pix, grid: None if pix is None else model.encode_vision(pix.to(device), grid.to(device))
            return run(batch.pixel_values, batch.image_grid_thw), run(batch.pixel_values_videos, batch.video_grid_thw)
        cat = lambda xs: torch.cat(xs) if xs else None
        images = [e for e in self.vision.get_many(model, prompts, "image") if e is not None]
        videos = [e for e in self.vision.get_many(model, prompts, "video") if e is not None]
        return cat(images), cat(videos)

    def prefix(self, model, prompts):
        """PrefixState of the distinct prompts (right-padded batch), with autograd when grad is enabled; a state
        held in the store for all of them is used instead of recomputing (and the batch is None: nothing
        collated)."""
        state, batch, _ = self._prefix(model, prompts)
        return state, batch

    def _prefix(self, model, prompts):
        """(state, collated batch (None when the store held a state: nothing collated, whose pixels would be copied
        and uploaded for nothing), whether the state is a slice of a batched graph held in the store)."""
        held = self.store.take(model, prompts)
        if held is not None:
            return merge_prefix_states(held[0]), None, held[1]
        some = self.store.take_some(model, prompts)
        if some is not None:  # a micro-batch of fused and unfused prompts (the budget fused only some): compute the
            # rest; merged with batched slices, its prefix backward waits for finish_backward with theirs
            states, batched = some
            rest = [p for p, st in zip(prompts, states) if st is None]
            computed = self._prefix(model, rest)[0]
            parts = iter([prompt_part(computed, b, len(p.input_ids)) for b, p in enumerate(rest)])
            return merge_prefix_states([st if st is not None else next(parts) for st in states]), None, batched
        device = next(model.parameters()).device
        batch = collate(model.args, prompts, pad_id=self.pad_id).to(device)
        image, video = self.visual_embeds(model, prompts, batch)
        run = lambda img, vid: model.prefix_forward(batch.input_ids, batch.position_ids, batch.next_position,
                                                     batch.lengths, image_embeds=img, video_embeds=vid)
        if self.checkpoint_prefix and torch.is_grad_enabled():
            return checkpoint(under_current_recompute(model, run), image, video, use_reentrant=False), batch, False
        return run(image, video), batch, False

    def score(self, model, request: ScoreRequest, temperature: float, with_entropy: bool = False):
        """Log-probs (and entropies) of the request's responses. With autograd on (and split_prefix_backward),
        differentiate a loss of them with `self.backward(loss)`: a plain loss.backward() stops at the prefix."""
        if any(d.reached() for d in self._deferred):
            raise RuntimeError("a loss of an earlier DecomposedScorer.score was backpropagated with loss.backward(); "
                               "use scorer.backward(loss), which also runs the prefix part")
        # prompts whose prefix comes from the store were computed elsewhere (rollout prefill, window): not counted
        computed = sum(len(p.input_ids) for p in request.prompts if not self.store.has(model, p))
        prefix, batch, batched = self._prefix(model, request.prompts)
        if self.split_prefix_backward and torch.is_grad_enabled():
            prefix, deferred = DeferredPrefix.split(prefix, model)
            if deferred is not None:
                deferred.batched = batched
                self._deferred.append(deferred)
        return self._suffix_scores(model, prefix, request, temperature, with_entropy,
                                   prompt_tokens=computed)

    @torch.no_grad()
    def score_on_prefix(self, model, prefix: PrefixState, request: ScoreRequest, temperature: float):
        """No-grad log-probs of the request's responses on a prefix state of its prompts that the caller computed
        and keeps (the decode window scores a prompt's samples in parts, as they finish, on one prefix)."""
        return self._suffix_scores(model, prefix, request, temperature, False, prompt_tokens=0)[0]

    def _suffix_scores(self, model, prefix: PrefixState, request: ScoreRequest, temperature: float,
                       with_entropy: bool, prompt_tokens: int):
        layout = PackedResponses(request)
        self._count(request, prompt_tokens, layout.count)
        hidden = decomposed_predictors(model, prefix, request, layout)
        return packed_scores(model, hidden, layout, request.tokens, temperature, with_entropy)

    def _count(self, request: ScoreRequest, prompt_tokens: int, response_tokens: int) -> None:
        self.counts.add(TokenCounts(prefix_tokens=prompt_tokens, response_tokens=response_tokens,
                                    vision_patches=sum(_patches(p) for p in request.prompts)))
        self.serial_equivalent_tokens += sum(len(request.prompts[i].input_ids) for i in request.prompt_index)
        self.serial_equivalent_tokens += response_tokens

    def rollout_prefill(self, model):
        """A no-grad prefill for the rollout engine that takes the visual embeddings from this step's cache, so the
        frozen tower's one encoding per prompt also serves rollout (the fused prefill is prefixes.fused_prefill)."""

        @torch.no_grad()
        def prefill(prompts):
            return self.prefix(model, prompts)[0]

        return prefill
