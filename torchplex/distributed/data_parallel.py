"""Reductions over a job's data-parallel ranks, so that every rank logs the whole job's numbers and takes the same
decisions (each data-parallel rank holds its own share of the prompts; tensor-parallel peers share one)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Sequence

import torch
import torch.distributed as dist


def all_reduce_sums(values: Sequence[float | torch.Tensor], device, dp_group) -> list[float]:
    """Sums over data-parallel ranks (in float64) of per-rank partial sums; the values themselves without a group."""
    total = torch.tensor([float(v) for v in values], dtype=torch.float64, device=device)
    if dp_group is not None:
        dist.all_reduce(total, group=dp_group)
    return total.tolist()


def most_over_ranks(count: int, device, dp_group) -> int:
    """The largest `count` over the data-parallel ranks (`count` itself without a group): how many forwards every
    rank runs where a sharded model gathers its parameters in each one."""
    return _over_ranks(count, device, dp_group, dist.ReduceOp.MAX)


def fewest_over_ranks(count: int, device, dp_group) -> int:
    """The smallest `count` over the data-parallel ranks (`count` itself without a group)."""
    return _over_ranks(count, device, dp_group, dist.ReduceOp.MIN)


def _over_ranks(count: int, device, dp_group, op) -> int:
    if dp_group is None:
        return count
    reduced = torch.tensor([count], device=device)
    dist.all_reduce(reduced, op=op, group=dp_group)
    return int(reduced.item())


@dataclass(frozen=True)
class DataParallelRanks:
    """This rank's place among the data-parallel ranks and the reductions over them. `group` is None with one
    data-parallel rank: every reduction is then the local value and nothing is communicated."""

    device: torch.device
    rank: int = 0
    size: int = 1
    group: dist.ProcessGroup | None = None

    def local(self, items: list) -> list:
        """This rank's share of a global batch."""
        return items[self.rank::self.size]

    def sums(self, values: Sequence[float | torch.Tensor]) -> list[float]:
        return all_reduce_sums(values, self.device, self.group)

    def sum(self, value: float) -> float:
        return self.sums([value])[0]

    def mean(self, values: list[float]) -> float:
        total, count = self.sums([sum(values), len(values)])
        return total / max(count, 1)

    def std(self, values: list[float]) -> float:
        """Sample standard deviation (Bessel-corrected, like torch.std) over every rank's values."""
        n, s, sq = self.sums([len(values), sum(values), sum(v * v for v in values)])
        return math.sqrt(max(sq - s * s / n, 0.0) / (n - 1)) if n > 1 else 0.0

    def fewest(self, count: int) -> int:
        """The smallest `count` over the ranks."""
        return fewest_over_ranks(count, self.device, self.group)


def any_rank(flag: bool, device: torch.device) -> bool:
    """Whether `flag` holds on any rank of the job (a collective over every rank, not only data-parallel ones)."""
    if not dist.is_initialized():
        return flag
    total = torch.tensor([float(flag)], device=device)
    dist.all_reduce(total)
    return bool(total.item())


def barrier() -> None:
    if dist.is_initialized():
        dist.barrier()
