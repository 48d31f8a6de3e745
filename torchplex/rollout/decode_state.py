"""The state of one rollout's samples while they decode, in two layouts.

Per sample slot of the pool (S,): the last token, tokens generated so far, whether it still decodes, its prompt's
next RoPE position, its seed, and its output tokens and log-probs (S, max_new + 1: the last column is where a
finished row's step writes, never read). This layout holds at every finished-sample check. Between checks the
steps read and return the same per row of the current row map (`Rows`, rollout/ladder.py), and write their outputs
straight into the slots' output rows. At a check the live rows go back to their slots (`push`), the host reads
the slots once (`read`), finished groups are returned and new ones admitted (`start_group`), and where the ladder
size changed or groups were admitted, the rows are mapped anew (`remap`).

A rollout of fewer samples per prompt than the pool's n (an evaluation on the training pool) uses each group's
first `params.n` sample slots; the others never decode.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from .decode_step import Rows
from .ladder import RowMap, row_map
from .sampling import SamplingParams


@dataclass
class SampleOutput:
    prompt_index: int
    sample_index: int
    token_ids: list[int]
    logprobs: list[float]
    finish_reason: str  # "stop" (a stop token was sampled, and is included) | "length"


class DecodeState:
    def __init__(self, pool, params: SamplingParams, device: torch.device):
        self.n, self.stride, self.max_new = params.n, pool.n, params.max_new_tokens
        self.num_slots, self.device = pool.num_slots, device
        self.stop_token_ids = list(params.stop_token_ids)
        self.stop_ids = torch.tensor(params.stop_token_ids or [-1], device=device)
        slots = lambda dtype: torch.zeros(self.num_slots, dtype=dtype, device=device)
        self.last_token, self.gen_count = slots(torch.long), slots(torch.long)
        self.start_pos, self.seeds, self.active = slots(torch.long), slots(torch.long), slots(torch.bool)
        self.out_tokens = torch.zeros(self.num_slots, self.max_new + 1, dtype=torch.long, device=device)
        self.out_logprobs = torch.zeros(self.num_slots, self.max_new + 1, dtype=torch.float32, device=device)
        self.owner: dict[int, int] = {}  # group slot -> prompt index
        self.finished: dict[int, SampleOutput] = {}  # slot -> output, for slots of groups still decoding
        self.map: RowMap | None = None
        self.rows: Rows | None = None

    def group_slots(self, group: int) -> range:
        return range(group * self.stride, group * self.stride + self.n)

    # ---- admission ------------------------------------------------------------------------------------
    def start_group(self, group: int, prompt: int, seeds: torch.Tensor, next_position, tokens, logprobs) -> None:
        """The group's samples (n seeds), their first tokens sampled from the prompt's last logits."""
        s = slice(group * self.stride, group * self.stride + self.n)
        self.seeds[s] = seeds
        self.start_pos[s] = next_position
        self.last_token[s], self.out_tokens[s, 0], self.out_logprobs[s, 0] = tokens, tokens, logprobs
        self.gen_count[s] = 1
        self.active[s] = ~torch.isin(tokens, self.stop_ids) & (self.max_new > 1)
        self.owner[group] = prompt

    # ---- per step -------------------------------------------------------------------------------------
    def advance(self, out: tuple[torch.Tensor, ...]) -> None:
        """Take a step's outputs (decode_step.step_out): its tokens and log-probs into the slots' output rows, the
        rows' next state for the next step."""
        tokens, logprobs, column, last, count, active = out
        rows = self.rows
        self.out_tokens[rows.slot_of_row, column] = tokens
        self.out_logprobs[rows.slot_of_row, column] = logprobs
        rows.last_token, rows.gen_count, rows.active = last, count, active

    # ---- at a check -----------------------------------------------------------------------------------
    def push(self) -> None:
        """The live rows' state back into their slots (scratch rows keep theirs)."""
        if self.map is None:
            return
        rows, live = self.rows, self.map.live
        index = rows.slot_of_row[:live]
        for slot_t, row_t in ((self.last_token, rows.last_token), (self.gen_count, rows.gen_count),
                              (self.active, rows.active)):
            slot_t[index] = row_t[:live]

    def read(self) -> tuple[list[bool], list[int]]:
        """Every slot's activity and generated count, on the host: the check's one sync."""
        active, counts = torch.stack([self.active.long(), self.gen_count]).tolist()
        return [bool(a) for a in active], counts

    def collect(self, active: list[bool], counts: list[int], report: bool
                ) -> tuple[list[SampleOutput], dict[int, tuple[int, list[SampleOutput]]]]:
        """(the samples finished since the last check, if `report`; group slot -> (prompt, its outputs in sample
        order) of the prompts whose samples have all finished). Those group slots are no longer owned: the caller
        gives them back to the pool."""
        done = [g for g in self.owner if not any(active[s] for s in self.group_slots(g))]
        wanted = set(done) if not report else set(self.owner)
        new = [(s, self.owner[g], j) for g in self.owner if g in wanted for j, s in enumerate(self.group_slots(g))
               if not active[s] and s not in self.finished]
        outputs = self._outputs(new, counts)
        self.finished.update((s, o) for (s, _, _), o in zip(new, outputs))
        groups = {g: (self.owner.pop(g), [self.finished.pop(s) for s in self.group_slots(g)]) for g in done}
        return outputs, groups

    def _outputs(self, samples: list[tuple[int, int, int]], counts: list[int]) -> list[SampleOutput]:
        """SampleOutputs of (slot, prompt, sample) triples, their tokens read in one transfer."""
        if not samples:
            return []
        width = max(counts[s] for s, _, _ in samples)
        index = torch.tensor([s for s, _, _ in samples], device=self.device)
        tokens, logprobs = self.out_tokens[index, :width].tolist(), self.out_logprobs[index, :width].tolist()
        outputs = []
        for (s, i, j), toks, lps in zip(samples, tokens, logprobs):
            c = counts[s]
            reason = "stop" if c and toks[c - 1] in self.stop_token_ids else "length"
            outputs.append(SampleOutput(i, j, toks[:c], lps[:c], reason))
        return outputs

    def live_slots(self, active: list[bool], admitted: Sequence[int]) -> list[int]:
        """The slots the next steps must decode: the active slots of groups still decoding, and every sample slot
        of the groups just admitted (whose activity the host has not read)."""
        fresh = set(admitted)
        return [s for g in sorted(self.owner) for s in self.group_slots(g) if g in fresh or active[s]]

    def remap(self, live_slots: Sequence[int], ladder: Sequence[int]) -> None:
        """Rows for the next steps: the smallest rung that holds `live_slots`, their state gathered from the slots,
        scratch rows at token 0, own position 0, inactive (rollout/ladder.py)."""
        self.map = m = row_map(live_slots, self.num_slots, ladder)
        index = torch.tensor(m.slot_of_row, device=self.device)
        state = [t[index] for t in (self.last_token, self.gen_count, self.active, self.start_pos, self.seeds)]
        for t, scratch in zip(state, (0, 1, False, 0, 0)):
            t[m.live:] = scratch
        self.rows = Rows(index, *state)
