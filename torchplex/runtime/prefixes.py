"""Prefix states held ahead of their consumer, and the forwards that make them (Rollplex mechanisms 1 and 2).

  PrefixStore     prefix states computed ahead of their consumer (the rollout prefill, the decode window, a batched
                  forward), held per (model, prompt) until a scorer takes them, each once.
  fused_prefill   the actor's prompt prefix computed by the rollout prefill itself, with autograd kept: the same
                  forward on the same weights θk, so the first training epoch reuses its graph instead of running the
                  prefix again. The prompts of one prefill run as one batched forward per holding form; each prompt's
                  state is a slice of it, whose backward waits for the whole batch (DecomposedScorer.finish_backward).
  forms           "graph" (the whole autograd graph), "compact" (each block keeps only its input and recomputes in
                  backward: `CompactPrefix`), "none" (not held: computed in training); memory_budget chooses them.
  hold_prefixes   no-grad prefixes (the reference's) in batched forwards, held for their suffixes.
Everything here is step-scoped and handed over explicitly: the step makes one PrefixStore and gives it to the scorer
(`DecomposedScorer.new_step`) and to these functions. The numbers do not depend on where the work ran
(tests/test_overlap.py holds the overlapped step to the decomposed one).
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Callable, Sequence

import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

from ..data.batching import length_groups, padded_tokens, token_batches
from ..models import fusion
from ..models.attention import PrefixState
from ..models.qwen2_5_vl.parallelize import keep_block_inputs, recompute
from .scoring import TokenCounts

GRAPH, COMPACT, NONE = "graph", "compact", "none"
# padded prompt tokens per batch of prefixes held with autograd in training (batched_actor_prefix), the rollout
# engine's prefill batch (RolloutEngine.prefill_tokens) likewise: the batch's backward recomputes one block over all
# of them at a time (compact form), a transient the budget plans per padded token
HELD_BATCH_TOKENS = 16384
REF_PREFIX_TOKENS = 65536  # padded prompt tokens per batched no-grad prefix forward (~5 GB of transients at 7B)


def kv_bytes(state: PrefixState) -> int:
    """Bytes of a prefix state's K/V over all layers (what the planner's holds_bytes counts for a prefix)."""
    return sum(t.numel() * t.element_size() for t in state.k + state.v)


class PrefixStore:
    """Prefix states computed ahead of their consumer, held per (model, prompt) until a scorer takes them. Taking
    removes them, so each is used once: the actor's prefix of θk serves exactly the first training epoch. `batched`
    marks slices of one batched forward with autograd, whose backward must wait for all of them."""

    def __init__(self):
        self._held: dict[tuple[int, int], tuple[PrefixState, bool]] = {}
        self.served = 0  # takes that found their prefixes held (tests and metrics)
        self._kv_bytes: dict[int, int] = {}       # id(model) -> K/V bytes held now
        self.peak_kv_bytes: dict[int, int] = {}   # id(model) -> the most K/V bytes held at once (checked vs plan)
        # id(model) -> (bytes the fused prefills' held prefixes keep alive, their prompt tokens): what fusion holds
        # from rollout to training, the autograd graph and the K/V, each storage once (SavedBytes)
        self.graph_bytes: dict[int, tuple[int, int]] = {}
        self.compact_bytes: dict[int, tuple[int, int]] = {}  # likewise for the compact form (CompactPrefix)
        # the padded tokens of the largest batch held with autograd (its backward waits for the epoch's end:
        # DecomposedScorer.finish_backward; its transient is measured per such token)
        self.largest_batch_tokens = 0
        self.demoted: dict[int, tuple[str, str]] = {}  # id(prompt) -> (planned form, the form it was held in)

    def _count(self, model_id: int, delta: int) -> None:
        now = self._kv_bytes.get(model_id, 0) + delta
        self._kv_bytes[model_id] = now
        self.peak_kv_bytes[model_id] = max(self.peak_kv_bytes.get(model_id, 0), now)

    def put(self, model, prompt, state: PrefixState, batched: bool = False) -> None:
        self.discard(model, prompt)
        self._held[(id(model), id(prompt))] = (state, batched)
        self._count(id(model), kv_bytes(state))

    def has(self, model, prompt) -> bool:
        return (id(model), id(prompt)) in self._held

    def _pop(self, key) -> tuple[PrefixState, bool]:
        state, batched = self._held.pop(key)
        self._count(key[0], -kv_bytes(state))
        return state, batched

    def discard(self, model, prompt) -> None:
        if (id(model), id(prompt)) in self._held:
            self._pop((id(model), id(prompt)))

    def peek(self, model, prompt) -> PrefixState | None:
        """The prompt's held state, left in the store."""
        held = self._held.get((id(model), id(prompt)))
        return None if held is None else held[0]

    def take(self, model, prompts) -> tuple[list[PrefixState], bool] | None:
        """(the prompts' held states, whether any is a slice of a batched graph), or None unless all are held."""
        keys = [(id(model), id(p)) for p in prompts]
        if not keys or not all(k in self._held for k in keys):
            return None
        self.served += 1
        held = [self._pop(k) for k in keys]
        return [state for state, _ in held], any(batched for _, batched in held)

    def take_some(self, model, prompts) -> tuple[list[PrefixState | None], bool] | None:
        """Like `take` where only some of the prompts are held: their states (None for the others), or None when
        none is held."""
        keys = [(id(model), id(p)) for p in prompts]
        if not any(k in self._held for k in keys):
            return None
        self.served += 1
        held = [self._pop(k) if k in self._held else None for k in keys]
        return [h[0] if h else None for h in held], any(h[1] for h in held if h)

    def clear(self) -> None:
        self._held.clear()
        self._kv_bytes.clear()

    def __len__(self) -> int:
        return len(self._held)


def merge_prefix_states(states: list[PrefixState]) -> PrefixState:
    """Stack single-prompt prefix states into one right-padded batch (differentiable)."""
    if len(states) == 1:
        return states[0]
    width = max(int(s.lengths.max()) for s in states)
    pad = lambda t: F.pad(t, (0, 0, 0, width - t.shape[2]))
    layers = range(len(states[0].k))
    return PrefixState([torch.cat([pad(s.k[i]) for s in states]) for i in layers],
                       [torch.cat([pad(s.v[i]) for s in states]) for i in layers],
                       torch.cat([s.lengths for s in states]), torch.cat([s.next_position for s in states]),
                       torch.cat([s.last_hidden for s in states]))


def prompt_part(state: PrefixState, b: int, length: int) -> PrefixState:
    """Prompt b of a right-padded batch as a one-prompt state of its own length (differentiable views)."""
    return PrefixState([t[b:b + 1, :, :length] for t in state.k], [t[b:b + 1, :, :length] for t in state.v],
                       state.lengths[b:b + 1], state.next_position[b:b + 1], state.last_hidden[b:b + 1])


def _storage(t: torch.Tensor) -> torch.UntypedStorage:
    """t's storage; a DTensor's (an FSDP2 or TP parameter, a TP layer's saved input) is its local shard's: the
    wrapper has no storage of its own."""
    if isinstance(t, DTensor):
        with torch.no_grad():
            t = t.to_local()
    return t.untyped_storage()


class SavedBytes(torch.autograd.graph.saved_tensors_hooks):
    """Counts the distinct storages an autograd graph saves for backward while active, the model's parameters left
    out (they are held anyway): the activations a graph kept alive until its backward."""

    def __init__(self, model):
        self._params = {_storage(p).data_ptr() for p in model.parameters()}
        self._seen: set[int] = set()
        self.nbytes = 0
        super().__init__(self._pack, lambda t: t)

    def count(self, t: torch.Tensor) -> None:
        """Add t's storage, once: a tensor kept for backward by other means (CompactPrefix's block inputs) too."""
        storage = _storage(t)
        key = storage.data_ptr()
        if key not in self._seen and key not in self._params:
            self._seen.add(key)
            self.nbytes += storage.nbytes()

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        self.count(t)
        return t.detach()  # what autograd keeps: the tensor itself would tie a saved output to its own grad_fn


class CompactPrefix:
    """While active, the model's decoder layers and vision blocks keep only their inputs for backward, which
    recomputes each from it (PrefixAttention records a layer's K/V once, so the recompute leaves the state as it
    was): `parallelize.keep_block_inputs`, on blocks the step wrapped once at set-up (`parallelize.wrap_blocks`).
    The kept inputs are counted in `saved`, the SavedBytes of the same forward (each storage once: non-reentrant
    checkpointing saves a block's input through its hooks as well)."""

    def __init__(self, model, saved: SavedBytes):
        self.model, self.saved = model, saved

    def keep(self, x: torch.Tensor) -> None:
        x = x.to_local() if hasattr(x, "to_local") else x  # a DTensor: this rank's shard
        if x.requires_grad:  # an input without grad (frozen tower) is not kept for backward
            self.saved.count(x)

    def __enter__(self):
        self._context = keep_block_inputs(self.model, self.keep)
        self._context.__enter__()
        return self

    def __exit__(self, *exc):
        return self._context.__exit__(*exc)


def _demote_lone_forms(prompts, form_of: dict[int, str], store) -> None:
    """With fusion on (models/fusion.py), a form with grad that only one prompt of a prefill batch of several has
    takes the next smaller form there (graph -> compact if the batch has compact prompts, else none; compact ->
    none): that prompt's forward would run alone, and a compiled chain specialises a batch of one, which would
    compile anew inside the step. The smaller form holds less, so the plan's room still holds; `store.demoted`
    records each change."""
    if not fusion.enabled() or len(prompts) < 2:
        return
    count = lambda form: sum(f == form for f in form_of.values())
    for form, smaller in (("graph", "compact" if count("compact") else "none"), ("compact", "none")):
        for p in prompts:
            if form_of[id(p)] == form and count(form) == 1:
                form_of[id(p)] = smaller
                store.demoted[id(p)] = (form, smaller)


def fused_prefill(scorer, model, store: PrefixStore, forms: dict[int, str] | None = None
                  ) -> Callable[[Sequence], PrefixState]:
    """A rollout prefill that keeps autograd and holds each prompt's part in `store` for the first training epoch
    (the engine gets the detached state). `scorer` is the step's DecomposedScorer: its prefix reads the frozen
    tower's cached encodings, and it takes the held parts back when training scores the prompts. `forms`: id of
    each prompt -> its holding form (GRAPH, COMPACT, NONE; None: all graph). The prompts of one prefill run as one
    batch per form, so an unfused prompt keeps no graph."""

    def prefill(prompts):
        form_of = {id(p): GRAPH if forms is None else forms.get(id(p), NONE) for p in prompts}
        _demote_lone_forms(prompts, form_of, store)
        by_form: dict[str, list] = {}
        for p in prompts:  # in the engine's order within each form: the batches a plan of those forms would run
            by_form.setdefault(form_of[id(p)], []).append(p)
        states = {form: _held_forward(scorer, model, store, form, ps) for form, ps in by_form.items()}
        if len(states) == 1:
            return next(iter(states.values()))
        parts = {id(p): prompt_part(states[form], b, len(p.input_ids))
                 for form, ps in by_form.items() for b, p in enumerate(ps)}
        return merge_prefix_states([parts[id(p)] for p in prompts])  # the engine's order: its slots follow it

    return prefill


def _held_forward(scorer, model, store: PrefixStore, form: str, prompts) -> PrefixState:
    """One batched prefix forward of `prompts` in holding form `form`, each prompt's part held in `store` and the
    bytes its graph keeps alive counted (graph_bytes / compact_bytes); returns the detached state."""
    if form == NONE:
        with torch.no_grad():
            return scorer.prefix(model, prompts)[0]
    saved = SavedBytes(model)
    compact = CompactPrefix(model, saved) if form == COMPACT else nullcontext()
    with torch.enable_grad():  # the parts too: a view made under no_grad would cut them from the graph
        # graph: a checkpointed actor's blocks keep their whole graphs too, so SavedBytes measures the rate the budget
        # plans this form with. One forward over many prompts runs the compiled elementwise chains with grad
        # (models/fusion.py); over one prompt the eager ones, as a training micro-batch's: a compiled chain
        # specialises a batch of one, which would compile anew inside the step
        batched = fusion.batched_forward() if len(prompts) > 1 else nullcontext()
        with saved, compact, recompute(model, form != GRAPH), batched:
            state = scorer.prefix(model, prompts)[0]
        for t in state.k + state.v:  # held with their graph until training reads them (saved by attention too)
            saved.count(t)
        for b, p in enumerate(prompts):
            part = state if len(prompts) == 1 else prompt_part(state, b, len(p.input_ids))
            store.put(model, p, part, batched=len(prompts) > 1)
    if len(prompts) > 1:
        store.largest_batch_tokens = max(store.largest_batch_tokens, padded_tokens([len(p.input_ids) for p in prompts]))
    tokens = sum(len(p.input_ids) for p in prompts)
    counts = store.graph_bytes if form == GRAPH else store.compact_bytes
    held, held_tokens = counts.get(id(model), (0, 0))
    counts[id(model)] = (held + saved.nbytes, held_tokens + tokens)
    scorer.counts.add(TokenCounts(prefix_tokens=tokens))
    return state.detach()


def prompt_length(p) -> int:
    return len(p.input_ids)


def hold_prefixes(scorer, model, prompts: Sequence, store: PrefixStore, max_tokens: int = REF_PREFIX_TOKENS) -> int:
    """No-grad prefixes of `model` (the reference) for those of `prompts` not held yet, in batched forwards (one per
    group of similar lengths, each at most `max_tokens` padded tokens), each prompt's part held in `store` for its
    scoring; returns the forwards run. The same forward as one per scoring micro-batch, on more prompts at once."""
    todo = [p for p in prompts if not store.has(model, p)]
    forwards = 0
    for group in length_groups(todo, length=prompt_length):
        width = len(group[-1].input_ids)  # ascending: the group's longest pads the batch
        for batch in token_batches(group, max_tokens, prompt_length, max_items=max(1, max_tokens // width)):
            with torch.no_grad():
                state = scorer.prefix(model, batch)[0]
            for b, p in enumerate(batch):
                store.put(model, p, state if len(batch) == 1 else prompt_part(state, b, len(p.input_ids)))
            forwards += 1
    scorer.counts.add(TokenCounts(prefix_tokens=sum(len(p.input_ids) for p in todo)))
    return forwards
