"""Overlap (Rollplex mechanism 2): scoring work moved into the rollout, where the schedule places it.

  fusion         the actor's prompt prefix computed by the rollout prefill itself, with autograd kept
                 (`fused_prefill`): the same forward on the same weights θk, so the first training epoch reuses its
                 graph instead of running the prefix again. The prompts of one prefill run as one batched forward;
                 each prompt's state is a slice of it, whose backward waits for the whole batch
                 (DecomposedScorer.finish_backward).
  held prefixes  `PrefixStore`: prefix states computed ahead of their consumer (in the rollout prefill or the decode
                 window), held per (model, prompt) until a scorer takes them, each once.
  window jobs    `DecodeWindowJobs`: the reference prefixes once decode has begun, and the reference log-probs of
                 samples as they finish, as the engine's `on_step` / `on_samples_finished` hooks submitting jobs to
                 the decode window (runtime/window.py: a second host thread, its CUDA work on a side stream).

Everything here is step-scoped and handed over explicitly: the executor makes one PrefixStore per step, gives it
to the scorer (`DecomposedScorer.new_step`) and to these functions. The numbers do not depend on where the work
ran (tests/test_overlap.py holds the overlapped step to the decomposed one).
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Callable, Sequence

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from ..models import fusion
from ..models.attention import PrefixState
from ..models.qwen2_5_vl.parallelize import recompute
from .grpo_step import request_from_outputs
from .phases import PhaseName, fused_into
from .planner import Schedule
from .scoring import TokenCounts
from .timeline import Timeline
from .window import WindowWorker


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


class SavedBytes(torch.autograd.graph.saved_tensors_hooks):
    """Counts the distinct storages an autograd graph saves for backward while active, the model's parameters left
    out (they are held anyway): the activations a graph kept alive until its backward."""

    def __init__(self, model):
        self._params = {p.untyped_storage().data_ptr() for p in model.parameters()}
        self._seen: set[int] = set()
        self.nbytes = 0
        super().__init__(self._pack, lambda t: t)

    def count(self, t: torch.Tensor) -> None:
        """Add t's storage, once: a tensor kept for backward by other means (CompactPrefix's block inputs) too."""
        storage = t.untyped_storage()
        key = storage.data_ptr()
        if key not in self._seen and key not in self._params:
            self._seen.add(key)
            self.nbytes += storage.nbytes()

    def _pack(self, t: torch.Tensor) -> torch.Tensor:
        self.count(t)
        return t.detach()  # what autograd keeps: the tensor itself would tie a saved output to its own grad_fn


_COMPACT_CLASSES: dict[type, type] = {}


def _compact_class(cls: type) -> type:
    """`cls` whose forward, while a CompactPrefix is on the instance and autograd is on, runs under non-reentrant
    checkpointing and counts the input it keeps (the layer-boundary hidden state)."""
    if cls not in _COMPACT_CLASSES:
        def forward(self, x, *args, **kwargs):
            counter = self.__dict__.get("_compact_prefix")
            if counter is None or not torch.is_grad_enabled():
                return cls.forward(self, x, *args, **kwargs)
            counter.keep(x)
            return checkpoint(fusion.under_current_mode(cls.forward), self, x, *args, use_reentrant=False, **kwargs)

        _COMPACT_CLASSES[cls] = type(f"Compact{cls.__name__}", (cls,), {"forward": forward})
    return _COMPACT_CLASSES[cls]


class CompactPrefix:
    """While active, the model's decoder layers and vision blocks keep only their inputs for backward, which
    recomputes each from it (PrefixAttention records a layer's K/V once, so the recompute leaves the state as it
    was). Swaps the blocks' classes and puts them back on exit, so parameter names and every other forward stay
    as they are; the recompute calls the original forward. The kept inputs are counted in `saved`, the SavedBytes
    of the same forward: non-reentrant checkpointing saves a block's inputs through its hooks as well, and a count
    of their own counted each input twice (docs/memory.md)."""

    def __init__(self, model, saved: SavedBytes):
        self.blocks = list(model.layers) + list(getattr(model.visual, "blocks", []))
        self.saved = saved

    def keep(self, x: torch.Tensor) -> None:
        x = x.to_local() if hasattr(x, "to_local") else x  # a DTensor: this rank's shard
        if x.requires_grad:  # an input without grad (frozen tower) is not kept for backward
            self.saved.count(x)

    def __enter__(self):
        self._classes = [type(b) for b in self.blocks]
        for b, cls in zip(self.blocks, self._classes):
            b.__dict__["_compact_prefix"] = self
            b.__class__ = _compact_class(cls)
        return self

    def __exit__(self, *exc):
        for b, cls in zip(self.blocks, self._classes):
            b.__class__ = cls
            b.__dict__.pop("_compact_prefix", None)


def fused_prefill(scorer, model, store: PrefixStore, forms: dict[int, str] | None = None
                  ) -> Callable[[Sequence], PrefixState]:
    """A rollout prefill that keeps autograd and holds each prompt's part in `store` for the first training epoch
    (the engine gets the detached state). `scorer` is the step's DecomposedScorer: its prefix reads the frozen
    tower's cached encodings, and it takes the held parts back when training scores the prompts. `forms`: id of
    each prompt -> its holding form from the schedule (memory_budget: "graph", "compact", "none"; None: all
    graph). The prompts of one prefill run as one batch per form, so an unfused prompt keeps no graph.

    With fusion on (models/fusion.py), a form with grad that only one prompt of a prefill batch of several has takes
    the next smaller form there (graph -> compact if the batch has compact prompts, else none; compact -> none):
    that prompt's forward would run alone (H200, img P = 32: it compiled anew, a compiled chain specialising a
    batch of one, and the prefill took 6.7 s instead of 1.8; a forward over one prompt now runs the eager chains).
    The smaller form holds less, so the plan's room still holds; `store.demoted` records each change."""

    def prefill(prompts):
        form_of = {id(p): "graph" if forms is None else forms.get(id(p), "none") for p in prompts}
        if fusion.enabled() and len(prompts) > 1:
            count = lambda form: sum(f == form for f in form_of.values())
            for form, smaller in (("graph", "compact" if count("compact") else "none"), ("compact", "none")):
                for p in prompts:
                    if form_of[id(p)] == form and count(form) == 1:
                        form_of[id(p)] = smaller
                        store.demoted[id(p)] = (form, smaller)
        by_form: dict[str, list] = {}
        for p in prompts:  # in the engine's order within each form: the batches a plan of those forms would run
            by_form.setdefault(form_of[id(p)], []).append(p)
        states = {form: _run(form, ps) for form, ps in by_form.items()}
        if len(states) == 1:
            return next(iter(states.values()))
        parts = {id(p): prompt_part(states[form], b, len(p.input_ids))
                 for form, ps in by_form.items() for b, p in enumerate(ps)}
        return merge_prefix_states([parts[id(p)] for p in prompts])  # the engine's order: its slots follow it

    def _run(form, prompts):
        if form == "none":
            with torch.no_grad():
                return scorer.prefix(model, prompts)[0]
        saved = SavedBytes(model)
        compact = CompactPrefix(model, saved) if form == "compact" else nullcontext()
        with torch.enable_grad():  # the parts too: a view made under no_grad would cut them from the graph
            # graph: a checkpointed actor's blocks keep their whole graphs too, so SavedBytes measures the rate the
            # budget plans this form with (and training's recompute choice reads)
            # one forward over many prompts: the compiled elementwise chains pay with grad too (models/fusion.py);
            # over one prompt the eager ones, as a training micro-batch's: a compiled chain specialises a batch of
            # one, which would compile anew inside the step (H200, 7B, img P = 64, overlapped: a training round's
            # prefix forward took 8.3 s in the timed step against 2.0 in the warm-up, whose rounds were cut
            # otherwise)
            batched = fusion.batched_forward() if len(prompts) > 1 else nullcontext()
            with saved, compact, recompute(form != "graph"), batched:
                state = scorer.prefix(model, prompts)[0]
            for t in state.k + state.v:  # held with their graph until training reads them (saved by attention too)
                saved.count(t)
            for b, p in enumerate(prompts):
                part = state if len(prompts) == 1 else prompt_part(state, b, len(p.input_ids))
                store.put(model, p, part, batched=len(prompts) > 1)
        if len(prompts) > 1:
            padded = padded_tokens([len(p.input_ids) for p in prompts])
            store.largest_batch_tokens = max(store.largest_batch_tokens, padded)
        tokens = sum(len(p.input_ids) for p in prompts)
        counts = store.graph_bytes if form == "graph" else store.compact_bytes
        held, held_tokens = counts.get(id(model), (0, 0))
        counts[id(model)] = (held + saved.nbytes, held_tokens + tokens)
        scorer.counts.add(TokenCounts(prefix_tokens=tokens))
        return state.detach()

    return prefill


def prompt_length(p) -> int:
    return len(p.input_ids)


def length_groups(prompts: Sequence, ratio: float = 1.25, length: Callable = prompt_length) -> list[list]:
    """The prompts in ascending length, cut where one is longer than `ratio` times its group's shortest. A batched
    prefix forward right-pads every prompt to its batch's longest, so one batch per group keeps what it holds within
    `ratio` of what the memory budget counts (a held form's rate times each prompt's own length)."""
    groups: list[list] = []
    for p in sorted(prompts, key=length):
        if not groups or length(p) > ratio * length(groups[-1][0]):
            groups.append([])
        groups[-1].append(p)
    return groups


# padded prompt tokens per batch of prefixes held with autograd in training (batched_actor_prefix), the rollout
# engine's prefill batch (RolloutEngine.prefill_tokens) likewise: the batch's backward recomputes one block over all
# of them at a time (compact form), a transient the budget plans per padded token
HELD_BATCH_TOKENS = 16384


def token_batches(items: Sequence, max_tokens: int, length: Callable = prompt_length) -> list[list]:
    """`items` in order, cut into batches of at most `max_tokens` tokens each (one item longer than that alone), as
    the rollout engine admits prompts into one prefill."""
    batches: list[list] = []
    left = 0
    for item in items:
        if not batches or length(item) > left:
            batches.append([])
            left = max_tokens
        batches[-1].append(item)
        left -= length(item)
    return batches


def padded_tokens(lengths: Sequence[int]) -> int:
    """Tokens of one right-padded batch of these lengths."""
    return len(lengths) * max(lengths) if lengths else 0


REF_PREFIX_TOKENS = 65536  # padded prompt tokens per batched no-grad prefix forward (~5 GB of transients at 7B)


def hold_prefixes(scorer, model, prompts: Sequence, store: PrefixStore, max_tokens: int = REF_PREFIX_TOKENS) -> int:
    """No-grad prefixes of `model` (the reference) for those of `prompts` not held yet, in batched forwards (one per
    group of similar lengths, each at most `max_tokens` padded tokens), each prompt's part held in `store` for its
    scoring; returns the forwards run. The same forward as one per scoring micro-batch, on more prompts at once."""
    todo = [p for p in prompts if not store.has(model, p)]
    forwards = 0
    for group in length_groups(todo):
        width = len(group[-1].input_ids)  # ascending: the group's longest pads the batch
        per = max(1, max_tokens // width)
        for start in range(0, len(group), per):
            batch = group[start:start + per]
            with torch.no_grad():
                state = scorer.prefix(model, batch)[0]
            for b, p in enumerate(batch):
                store.put(model, p, state if len(batch) == 1 else prompt_part(state, b, len(p.input_ids)))
            forwards += 1
    scorer.counts.add(TokenCounts(prefix_tokens=sum(len(p.input_ids) for p in todo)))
    return forwards


def rollout_prefill(schedule: Schedule, scorer, actor, store: PrefixStore, prompts: Sequence):
    """The prefill the schedule gives the engine: fused (autograd kept, held for training) where the actor prefix
    is placed in the rollout (for the prompts the schedule fuses), else the scorer's no-grad prefill (the frozen
    tower's one encoding serves rollout)."""
    if schedule.placed(PhaseName.ACTOR_PREFIX, fused_into(PhaseName.ROLLOUT)):
        return fused_prefill(scorer, actor, store, {id(prompts[c.prompt]): c.form for c in schedule.prefix_forms})
    return scorer.rollout_prefill(actor)


WINDOW_PREFIX_PROMPTS = 4  # reference prefixes per window job when decode begins: ~4,200 tokens at img, fewer launches


class DecodeWindowJobs:
    """The reference work a schedule places in the rollout's decode window, as hooks for the engine.

    ref_prefix in the window: once decode has begun (its first step: every prompt's prefill is done), one job per
    WINDOW_PREFIX_PROMPTS prompts holds their reference prefixes (one batched forward, as the ref stage's). ref_suffix in
    the window: a job per `sample_batch` finished samples of a prompt, and one for its last ones, scores them on the
    held prefix (each job is an eager forward whose host cost hardly depends on its size, so fewer, larger jobs leave
    decode more of the host). `scored` maps a sample to its reference log-probs; what the window did not score, the
    ref stage does: when decode ends, the jobs not yet begun are dropped and left to it (`dropped`), as it runs on
    the whole device, batched, where the window's jobs would run one by one.
    """

    def __init__(self, schedule: Schedule, scorer, reference, prompts: list, group_size: int, sample_batch: int,
                 store: PrefixStore, window: WindowWorker, timeline: Timeline, temperature: float,
                 device: torch.device):
        in_window = lambda name: schedule.has(name) and schedule.phase(name).in_window
        self.prefix_in_window = in_window(PhaseName.REF_PREFIX) and reference is not None
        self.suffix_in_window = in_window(PhaseName.REF_SUFFIX) and reference is not None
        self.scorer, self.reference, self.prompts = scorer, reference, prompts
        self.group_size, self.sample_batch = group_size, sample_batch
        self.prefix_prompts = WINDOW_PREFIX_PROMPTS
        self.store, self.window, self.timeline = store, window, timeline
        self.temperature, self.device = temperature, device
        self.scored: dict[int, torch.Tensor] = {}
        self._submitted: set[int] = set()  # prompts whose reference prefix job is queued
        self._pending: dict[int, list] = {}
        self._finished = [0] * len(prompts)
        # jobs by kind (PhaseName.REF_PREFIX / REF_SUFFIX): submitted, and dropped at the end of decode
        self.submitted = {PhaseName.REF_PREFIX: 0, PhaseName.REF_SUFFIX: 0}
        self.dropped = {PhaseName.REF_PREFIX: 0, PhaseName.REF_SUFFIX: 0}

    @property
    def reads_reference(self) -> bool:
        """The window reads the reference's weights during rollout (FSDP2: gathered from the rollout on)."""
        return self.prefix_in_window or self.suffix_in_window

    def hooks(self) -> dict:
        """The engine's hook arguments: only those of work placed in the window (None otherwise)."""
        return {"on_step": self._on_step if self.prefix_in_window else None,
                "on_samples_finished": self._on_samples_finished if self.suffix_in_window else None}

    def finish(self) -> None:
        """After generate: drop the jobs not begun (the ref stage does their work), wait for the one running
        (re-raising a job's error), then free the held reference prefixes of prompts whose samples were all scored
        there."""
        for job in self.window.finish(drop_waiting=True):
            self.dropped[job.kind] += 1
        for i, prompt in enumerate(self.prompts):
            if all(i * self.group_size + j in self.scored for j in range(self.group_size)):
                self.store.discard(self.reference, prompt)

    # ---- hooks, called on the decode thread ----------------------------------------------------------------
    def _on_step(self, info) -> None:
        if info.step == 1:  # decode has begun: the prompts' prefills are done
            for i in range(0, len(self.prompts), self.prefix_prompts):
                self._prefix_job(i)

    def _on_samples_finished(self, outputs) -> None:
        for o in outputs:
            i = o.prompt_index
            self._pending.setdefault(i, []).append(o)
            self._finished[i] += 1
            if len(self._pending[i]) >= self.sample_batch or self._finished[i] == self.group_size:
                outs = self._pending.pop(i)
                self._prefix_job(i)  # queued before its samples' job: the window runs jobs in order
                self._submit(PhaseName.REF_SUFFIX, lambda i=i, outs=outs: self._score_samples(i, outs))

    def _prefix_job(self, i: int) -> None:
        """Queue the reference prefixes of prompt i's batch (prompts i // prefix_prompts), unless queued before."""
        first = i - i % self.prefix_prompts
        batch = range(first, min(first + self.prefix_prompts, len(self.prompts)))
        todo = [k for k in batch if k not in self._submitted]
        if todo:
            self._submitted.update(todo)
            self._submit(PhaseName.REF_PREFIX, lambda ps=[self.prompts[i] for i in todo]: self._hold_prefixes(ps))

    def _submit(self, kind: PhaseName, fn: Callable[[], None]) -> None:
        fn.kind = kind
        self.submitted[kind] += 1
        self.window.submit(fn)

    # ---- jobs, run by the window (its thread and side stream) ----------------------------------------------
    def _hold_prefixes(self, prompts: list) -> None:
        with self.timeline.span(PhaseName.REF_PREFIX, lane="window"):
            hold_prefixes(self.scorer, self.reference, prompts, self.store)

    def _score_samples(self, i: int, outputs) -> None:
        """Reference log-probs of samples of prompt i that just finished, on its prefix held in the store (kept
        there: later samples of the prompt are scored on it too)."""
        with self.timeline.span(PhaseName.REF_SUFFIX, lane="window"):
            samples = [i * self.group_size + o.sample_index for o in outputs]
            request = request_from_outputs(self.prompts, self.group_size, samples, [o.token_ids for o in outputs],
                                           self.device)
            prefix = self.store.peek(self.reference, self.prompts[i])
            if prefix is None:  # its prefix job failed before: finish() reports that
                return
            logp = self.scorer.score_on_prefix(self.reference, prefix, request, self.temperature)
            for row, (s, o) in enumerate(zip(samples, outputs)):
                self.scored[s] = logp[row, :len(o.token_ids)]

