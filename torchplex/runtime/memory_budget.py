"""The step's memory budget: what the device can give the step, what every resident group takes in each stage, and
from what is left, how each prompt's actor prefix may be held from the rollout to training.

    capacity    memory.budget_gib, or the device's: on CUDA its free memory plus what this process's allocator
                already holds (cached blocks are ours to reuse); on CPU the host's physical memory
    residents   per stage (rollout, ref, train): the bytes of every group on the device then: actor weights, the
                reference weights, optimizer state, gradients, the rollout's KV pool, the training micro-batch's
                activations (with memory.managed, the memory plan's peak of the stage instead of "all resident");
                on CUDA the rollout's and the reference's `unplanned` bytes too: what the last step's peak in the
                stage allocated beyond those groups and the prefixes it held (decode's logits and sampling, a
                reference micro-batch, ...)
    room        capacity - headroom - the largest stage's residents: a prefix held from the rollout prefill to
                training lives through all three stages, so it must fit beside the fullest one

Holding forms, chosen per prompt in admission order (`choose_prefix_forms`):
    graph       the whole autograd graph of the fused prefill (bytes per token: prefixes.SavedBytes, measured on the
                first fused step; memory_estimate's prior until then), for as many prompts as fit in the room
    compact     the fused prefill under per-layer checkpointing (prefixes.CompactPrefix): what it holds is each decoder
                layer's (and trainable vision block's) input, the layer-boundary hidden states, and the prefix K/V
                with their graph (both forms count every storage the held prefix keeps alive once: SavedBytes);
                the backward recomputes layer by layer
    none        not fused: the prompt's actor prefix is computed in training, as in decomposed mode
As many prompts get the whole graph as can while every other fused prompt still fits as compact; then as many
compact as fit; the rest none.
Recompute per training micro-batch (memory.recompute = "auto", with model.activation_checkpointing): a micro-batch
skips the checkpointed blocks' recompute when its whole graph (`no_recompute_bytes`) fits in the memory free at its
forward less the headroom (`needs_recompute`). The budget above counts training at its recompute form
(`recompute_train_bytes`), so the held prefixes always fit; once a step has run, the rooms are capped so that held
prefixes leave room for the whole graphs worth more than they are (`held_cap_for_whole_graphs`: more rounds in
training, fewer prompts fused).
Nothing here is unbounded: without a room there is no fusion, and a step whose smallest form cannot fit fails before
it runs (`BatchTooLargeError`, naming the config keys to change).
"""

from __future__ import annotations

import itertools
import math
import os
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass, field, replace

import torch
import torch.distributed as dist

GRAPH, COMPACT, NONE = "graph", "compact", "none"
HELD_STAGES = ("rollout", "ref", "train")  # a fused prefix is held from the rollout prefill to its training
UNPLANNED = "unplanned"  # a stage's peak beyond its groups and held prefixes, measured by the last step (CUDA)
PREFIX_GRADS = "prefix_grads"  # held batched prefixes' gradients, kept from their micro-batch to the epoch's end
HEADROOM = 0.05  # of capacity, for the allocator's fragmentation and the small tensors no group counts
# Training's unplanned bytes before a step measured them (where stages are measured: CUDA), a fraction of capacity
# (docs/memory.md: the priors and where they came from)
FIRST_TRAIN_UNPLANNED = 0.05
# The whole-graph scale (whole_graph_scale) before a step measured a kept graph, where stages are measured (CUDA):
# kept graphs measured above their estimates (docs/memory.md)
FIRST_WHOLE_GRAPH_SCALE = 1.35
# what to change when a step does not fit, in the order a user reaches for them
FIT_KEYS = ("data.prompts_per_step", "rollout.n_samples", "rollout.max_new_tokens", "rollout.kv_pool_gib",
            "algorithm.micro_batch_tokens", "memory.managed", "memory.budget_gib")
# A derived micro-batch budget (algorithm.micro_batch_tokens 0) is at most this many tokens: a forward this wide
# already fills the matrix units, so a wider one costs memory (better left to held prefixes and whole graphs) and
# gains nothing
MICRO_BATCH_TOKENS_CAP = 16384
# A derived training budget whose whole graph fits fewer tokens than this is sized by its recompute form instead, up
# to this many (checkpointed blocks): a forward narrower than this leaves the matrix units idle longer than
# recomputing its blocks costs
MICRO_BATCH_TOKENS_WIDE = 2048
# The share of what a stage's other residents leave that a derived micro-batch budget may take in the prefix modes:
# the rest is the room for the prefixes they hold (serial holds none and takes all of it)
MICRO_BATCH_SHARE = 0.5


class BatchTooLargeError(RuntimeError):
    """The step cannot fit in the memory budget even with nothing fused and the smallest KV pool."""


@dataclass(frozen=True)
class PrefixChoice:
    """How one prompt's actor prefix is held from the rollout to training (the plan records one per prompt)."""

    prompt: int
    form: str    # GRAPH | COMPACT | NONE
    tokens: int
    bytes: int   # what the chosen form holds (0 for NONE)
    reason: str
    # training's held prefixes (choose_train_rounds): the round it is held in; one round's prefixes are held and
    # backpropagated before the next round's are computed in the same room
    round: int = 0


@dataclass
class MemoryBudget:
    capacity_bytes: int
    residents: dict[str, dict[str, int]] = field(default_factory=dict)  # stage -> group -> bytes
    # the most prefixes held at once may take (held_cap_for_whole_graphs; None: no cap), and why
    held_cap_bytes: int | None = None
    held_cap: str = ""
    kv_pool_bytes: int = 0  # the rollout's KV pool this budget was planned with (sized here when rollout.kv_pool_gib 0)
    # tokens per training and per reference micro-batch (algorithm.micro_batch_tokens, ref_micro_batch_tokens; sized
    # from this budget where those are 0: MemoryEstimator.estimate), and how each was chosen
    micro_batch_tokens: int = 0
    ref_micro_batch_tokens: int = 0
    micro_batch_reason: str = ""

    def stage_bytes(self, stage: str) -> int:
        return sum(self.residents.get(stage, {}).values())

    @property
    def usable_bytes(self) -> int:
        return int(self.capacity_bytes * (1 - HEADROOM))

    @property
    def room_bytes(self) -> int:
        """What a prefix held from the rollout to training may take (never negative), within the held cap."""
        room = max(0, self.usable_bytes - max(self.stage_bytes(s) for s in HELD_STAGES))
        return room if self.held_cap_bytes is None else min(room, self.held_cap_bytes)

    @property
    def train_room_bytes(self) -> int:
        """What a prefix computed and held within the train stage may take (never negative), within the held cap."""
        room = max(0, self.usable_bytes - self.stage_bytes("train"))
        return room if self.held_cap_bytes is None else min(room, self.held_cap_bytes)

    def check(self, what: str = "the step") -> None:
        """Raise BatchTooLargeError when a stage's groups exceed the usable budget. Activations (an estimate until
        training measured them on a GPU) count in the room only: a wrong guess fuses fewer prompts, it does not
        refuse a step that would have run."""
        measured = ("activations", UNPLANNED, PREFIX_GRADS)  # PREFIX_GRADS: none when nothing is held
        need = lambda s: self.stage_bytes(s) - sum(self.residents.get(s, {}).get(g, 0) for g in measured)
        over = [(s, need(s)) for s in HELD_STAGES if need(s) > self.usable_bytes]
        if not over:
            return
        stage, worst = max(over, key=lambda x: x[1])
        groups = ", ".join(f"{g} {b / 2**30:.2f}" for g, b in sorted(self.residents[stage].items(),
                                                                    key=lambda x: -x[1]) if g != "activations")
        raise BatchTooLargeError(
            f"{what} does not fit in memory even with no prefix fused: its {stage} stage needs {worst / 2**30:.2f} GiB "
            f"({groups} GiB) of the {self.usable_bytes / 2**30:.2f} GiB usable ({self.capacity_bytes / 2**30:.2f} GiB "
            f"budget less {HEADROOM:.0%} headroom). Change one of: {', '.join(FIT_KEYS)}")

    def to_dict(self) -> dict:
        return {**asdict(self), "room_bytes": self.room_bytes, "train_room_bytes": self.train_room_bytes,
                "usable_bytes": self.usable_bytes}


def device_capacity(device: torch.device) -> int:
    """What the device can give this process now (see the module docstring)."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return int(free + torch.cuda.memory_reserved(device))
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def choose_prefix_forms(prompt_lengths: tuple[int, ...], graph_bytes_per_token: float, room_bytes: int,
                        fusable: bool = True, why_not: str = "", compact_bytes_per_token: float = 0
                        ) -> list[PrefixChoice]:
    """Each prompt's holding form in admission order: the first k prompts whole graphs and the next ones compact
    (compact_bytes_per_token 0: no compact form), k as large as lets every fused prompt fit the room; the
    prompts after those none."""
    n = len(prompt_lengths)
    if not fusable:
        return [PrefixChoice(i, NONE, L, 0, why_not or "fusion off") for i, L in enumerate(prompt_lengths)]
    graph = [math.ceil(graph_bytes_per_token * L) for L in prompt_lengths]
    compact = [math.ceil(compact_bytes_per_token * L) if compact_bytes_per_token else None for L in prompt_lengths]
    # m: prompts fused at all (the longest run of compact forms that fits; all graphs without a compact form)
    fits = lambda sizes: [i for i in range(n + 1) if sum(sizes[:i]) <= room_bytes][-1]
    m = fits(compact) if compact_bytes_per_token else fits(graph)
    k = max(i for i in range(m + 1) if sum(graph[:i]) + sum(c or 0 for c in compact[i:m]) <= room_bytes)
    choices, used = [], 0
    for i, L in enumerate(prompt_lengths):
        form, need = (GRAPH, graph[i]) if i < k else (COMPACT, compact[i]) if i < m else (NONE, 0)
        used += need
        if form == NONE:
            best = compact[i] if compact_bytes_per_token else graph[i]
            reason = f"{best / 2**20:.1f} MiB over the room left: computed in training"
        else:
            reason = f"{need / 2**20:.1f} MiB, {used / 2**20:.1f} of {room_bytes / 2**20:.1f} MiB of room used"
        choices.append(PrefixChoice(i, form, L, need, reason))
    return choices


def choose_train_rounds(prompt_lengths: tuple[int, ...], graph_bytes_per_token: float, room_bytes: int,
                        compact_bytes_per_token: float = 0, first_round: int = 0) -> list[PrefixChoice]:
    """Training's held prefixes in rounds: round `first_round` as `choose_prefix_forms` holds them in the room; the
    prompts it leaves out are chosen again in the same room for the next round, and so on, until every prompt is
    held or one cannot fit even alone (it and those after it: none). The train stage holds one round at a time: its
    micro-batches take the round's prefixes, the round's batched backward frees them, then the next round's are
    computed (the prompts one room leaves out would otherwise run their prefixes per micro-batch, each slower than
    a held one). Overlapped: round 0 is the prefixes held from the fused prefill, and the
    prompts it left out start at round 1."""
    choices: list[PrefixChoice] = []
    start, r = 0, first_round
    while start < len(prompt_lengths):
        chosen = choose_prefix_forms(prompt_lengths[start:], graph_bytes_per_token, room_bytes,
                                     compact_bytes_per_token=compact_bytes_per_token)
        held = [c for c in chosen if c.form != NONE]
        rest = chosen[len(held):]
        if not held:  # not even one fits alone: computed per micro-batch
            choices += [replace(c, prompt=start + c.prompt) for c in rest]
            break
        note = f"round {r}: " if r or rest else ""  # one round alone is not named
        choices += [replace(c, prompt=start + c.prompt, round=r, reason=note + c.reason) for c in held]
        start, r = start + len(held), r + 1
    return choices


def held_at_once_bytes(choices: Sequence[PrefixChoice]) -> int:
    """The most bytes the choices hold at one time: their largest round's."""
    rounds: dict[int, int] = {}
    for c in choices:
        rounds[c.round] = rounds.get(c.round, 0) + c.bytes
    return max(rounds.values(), default=0)


# What one training micro-batch's whole graph is worth, in prompts whose actor prefix the fused prefill computes: the
# recompute a kept graph saves against the training prefix forward a fused prompt saves (docs/memory.md)
WHOLE_GRAPH_WORTH = 3


def held_cap_for_whole_graphs(budget: MemoryBudget, whole_sizes: Sequence[int], prompt_bytes: Sequence[int],
                              fusing: bool) -> tuple[int, str]:
    """The most bytes of prefixes training may hold at once, so that prefixes leave room for its micro-batches'
    whole graphs where those are worth more: `whole_sizes` are the last step's micro-batches' whole graphs with
    their prefixes held (scaled estimates), `prompt_bytes` each prompt's held prefix (its compact form) in admission
    order. A micro-batch keeps its graph when it fits beside what is held (the usable budget less the train stage's
    other residents). Training's rounds (choose_train_rounds) hold every prompt in any room that holds the largest
    one, so without fusion the cap is the room that keeps every graph that can be kept, never below one prompt.
    Fusing (overlapped), the prompts fused are held through training: of every count f that fits the room, the cap
    takes the one worth most, f + WHOLE_GRAPH_WORTH x the micro-batches kept whole beside them (fusing every prompt
    that fits can leave room for few whole graphs, and cost more than it saves). For a runner whose training holds prefixes in rounds (elsewhere the prompts left out would run their
    prefixes per micro-batch)."""
    train = budget.residents["train"]
    rest = budget.stage_bytes("train") - train.get("activations", 0)
    free = lambda held: budget.usable_bytes - rest - held
    kept = lambda held: sum(w <= free(held) for w in whole_sizes)
    one = max(prompt_bytes, default=0)
    rounds = min(budget.train_room_bytes, max(one, free(0) - max(whole_sizes, default=0)))
    if not fusing:
        return rounds, (f"{kept(rounds)} of {len(whole_sizes)} micro-batches whole beside {rounds / 2**30:.2f} GiB "
                        f"of held prefixes at once")
    sums = itertools.accumulate(prompt_bytes, initial=0)  # f prompts fused hold sums[f]
    options = [(f, max(held, rounds)) for f, held in enumerate(sums) if held <= budget.room_bytes]
    f, cap = max(options, key=lambda o: (o[0] + WHOLE_GRAPH_WORTH * kept(o[1]), o[0]))
    return cap, (f"{f} prompts fused and {kept(cap)} of {len(whole_sizes)} micro-batches whole beside "
                 f"{cap / 2**30:.2f} GiB of held prefixes at once (a whole graph worth {WHOLE_GRAPH_WORTH} fused)")


def largest_fitting(bytes_at: Callable[[int], int], room_bytes: int, floor: int, cap: int) -> int:
    """The largest token count in [floor, cap] whose bytes (`bytes_at`, non-decreasing in it) fit `room_bytes`;
    `floor` when none does (the smallest micro-batch there is)."""
    lo, hi = floor, max(floor, cap)
    if bytes_at(hi) <= room_bytes:
        return hi
    while hi - lo > 1:  # lo fits or is the floor, hi does not fit
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if bytes_at(mid) <= room_bytes else (lo, mid)
    return lo


def kv_pool_bytes(need_all_bytes: int, one_group_bytes: int, rollout_resident_bytes: int, usable_bytes: int,
                  configured_bytes: int = 0) -> int:
    """The rollout's KV pool: `configured_bytes` when set, else as much of what all groups need at once as fits
    beside the rollout stage's other residents, at least one group (the engine admits the others as groups
    finish: RolloutEngine.generate)."""
    if configured_bytes:
        return configured_bytes
    room = usable_bytes - rollout_resident_bytes
    return max(one_group_bytes, min(need_all_bytes, room))


def step_residents(*, actor_bytes: int, reference_bytes: int, optimizer_bytes: int, grad_bytes: int,
                   kv_pool_bytes: int, train_activation_bytes: int, managed: dict[str, int] | None = None
                   ) -> dict[str, dict[str, int]]:
    """Bytes of each group on the device per stage. Unmanaged, every group stays resident except the gradients
    (made in training, freed by zero_grad) and the KV pool (released after the rollout); `managed`: the memory
    plan's peak per stage of the groups it moves (runtime/memory.py), beside the actor weights it never moves."""
    if managed is not None:
        return {s: {"actor_weights": actor_bytes, "managed_groups": managed.get(s, 0),
                    **({"activations": train_activation_bytes} if s == "train" else {})} for s in HELD_STAGES}
    base = {"actor_weights": actor_bytes, "ref_weights": reference_bytes, "optimizer_state": optimizer_bytes}
    return {"rollout": {**base, "kv_pool": kv_pool_bytes}, "ref": dict(base),
            "train": {**base, "grads": grad_bytes, "activations": train_activation_bytes}}


LOGIT_COPIES = 3  # fp32 logits of a response token live ~3 times over in training: logits, log-softmax, entropy
# rl/logprobs applies the LM head this many rows at a time (forward and backward), the chunk size scoring uses: the
# fp32 logits alive at once are one chunk's, however many response tokens the micro-batch has
LOGIT_CHUNK = 1024


def logits_bytes(response_tokens: int, vocab_size: int) -> int:
    return LOGIT_COPIES * 4 * vocab_size * min(response_tokens, LOGIT_CHUNK)


def no_recompute_bytes(prefix_bytes_per_token: float, prefix_tokens: int, suffix_bytes_per_token: float,
                       response_tokens: int, vocab_size: int) -> int:
    """A training forward's activations with every block keeping its whole graph: the prefixes it computes (not
    those held from a fused prefill or a batched prefix forward) at the prefix graph's rate, a trainable tower's
    blocks included; its responses at the suffix rate, the decoder layers' alone (a response token never enters the
    vision tower, and priced at the prefix rate the estimate was twice what kept graphs measured); plus the fp32 logits (one LM-head chunk's: `logits_bytes`)."""
    return (math.ceil(prefix_bytes_per_token * prefix_tokens + suffix_bytes_per_token * response_tokens)
            + logits_bytes(response_tokens, vocab_size))


def packed_key_bytes(key_tokens: int, layers: int, key_heads: int, head_dim: int, element_size: int) -> int:
    """The K and V a decomposed training forward's packed suffix attention saves for backward in every layer: each
    suffix's keys are its prompt's prefix rows then its own tokens (models/packing.py, gathered per sample), so a
    group of G samples on a P-token prefix saves G x P rows (in `key_heads`: repeated to the query heads where the
    attention path repeats them)."""
    return 2 * key_tokens * layers * key_heads * head_dim * element_size


def whole_graph_scale(previous: float | None, estimates: Sequence[int], measured: Sequence[int],
                      whole: Sequence[bool]) -> float | None:
    """What a training forward's whole graph took against `no_recompute_bytes`' estimate, the largest ratio over
    the forwards that kept it (`whole`) and the earlier steps' (`previous`), never below 1: the next steps'
    choices multiply the estimate by it. None while no kept graph has been measured (previous None and none kept
    here): the caller's prior stands (FIRST_WHOLE_GRAPH_SCALE); a measured ratio replaces that prior, below it too.
    A forward's backward allocates beyond what its graph saves (the activations' gradients of the layer in
    flight, the logits' in fp32), which no per-token rate counts: a graph kept at its bare estimate can run out of
    the memory it found free."""
    ratios = [m / e for e, m, w in zip(estimates, measured, whole) if w and e > 0]
    if previous is None and not ratios:
        return None
    return max([previous or 1.0, 1.0, *ratios])


def recompute_train_bytes(compact_bytes_per_token: float, layer_bytes_per_token: float, tokens: int,
                          response_tokens: int, vocab_size: int) -> int:
    """The same forward's activations when its blocks recompute: every block's input (the compact rate), the one
    block whose graph the backward rebuilds at a time, plus the fp32 logits."""
    return (math.ceil((compact_bytes_per_token + layer_bytes_per_token) * tokens)
            + logits_bytes(response_tokens, vocab_size))


BACKWARD_LAYERS = 6  # decoder layers' graphs a held batch's backward allocates at once, measured (docs/memory.md)


def prefix_backward_rate(layer_bytes_per_token: float) -> float:
    """Bytes per padded token of a held batch that its backward allocates at once, before it was measured: the
    compact form rebuilds one block's graph over the whole batch and makes that graph's gradients beside it, a
    trainable tower's blocks likewise, with the weights' gradients of the blocks in flight (BACKWARD_LAYERS
    decoder layers' graphs, measured; the measured rate replaces it from the first step that held a batch)."""
    return BACKWARD_LAYERS * layer_bytes_per_token


def held_gradient_bytes(kv_bytes_per_token: int, hidden_bytes: int, prefix_tokens: int) -> int:
    """What the micro-batches' backward leaves for held batched prefixes until the epoch's end: the gradient of each
    prompt token's K/V in every layer and of its last hidden state (DeferredPrefix.gradients), at most every
    prompt's (the prompts held are chosen after this is counted)."""
    return (kv_bytes_per_token + hidden_bytes) * prefix_tokens


def batch_token_bound(lengths, cap: int) -> int:
    """The most padded tokens a batch of consecutive `lengths` can take when each batch holds at most `cap`
    tokens (a longer one alone): the largest count x longest over every run that fits, for any cut into batches
    (the engine's prefill batches are also cut by its pool's free groups)."""
    best = 0
    for i in range(len(lengths)):
        total, longest, j = 0, 0, i
        while j < len(lengths) and (j == i or total + lengths[j] <= cap):
            total += lengths[j]
            longest = max(longest, lengths[j])
            j += 1
        best = max(best, (j - i) * longest)
    return best


def needs_recompute(est_bytes: int, free_bytes: int, margin_bytes: int) -> bool:
    """Whether a training micro-batch must recompute: its no-recompute activations do not fit in what is free
    less the margin."""
    return est_bytes > free_bytes - margin_bytes


def agree_on_recompute(need: bool, group, device) -> bool:
    """One choice for every rank of `group` (tensor-parallel peers): recompute when any of them must. A TP'd
    block's recompute reruns its row-parallel all-reduces, so peers that chose differently would wait on each
    other's collectives; their free memory can differ a little, which near the threshold flips the choice."""
    if group is None:
        return need
    flag = torch.tensor([float(need)], device=device)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
    return bool(flag.item())


def agree_on_held_form(forms: list[str], group, device) -> str:
    """One holding form for every prompt of every rank of `group` (data-parallel ranks), from each rank's
    planned `forms` (one per prompt): GRAPH when every rank planned a graph for each of its prompts, COMPACT when
    every rank held each prompt in some form (a compact form takes less than a graph), else NONE. An FSDP2
    actor's forward gathers its parameters on every rank, so the ranks must run the same held prefill forwards
    (one per form) and the same prefix forwards in training (one per micro-batch whose prompts are not held);
    forms planned from each rank's own prompt lengths can differ."""
    code = 0 if not forms or NONE in forms else 2 if set(forms) == {GRAPH} else 1
    if group is not None:
        flag = torch.tensor([code], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MIN, group=group)
        code = int(flag.item())
    return {2: GRAPH, 1: COMPACT}.get(code, NONE)
