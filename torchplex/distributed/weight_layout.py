"""Which slice of each weight every rank holds under the actor's and the rollout's TP plans, and what that makes
each rollout parameter: identical, view or rebuilt (torchplex/distributed/weight_sharing.py binds the storage).

Layout rules, for our TP plan (decoder wq/wk/wv/w1/w3 column-parallel = Shard(0) of weight and bias, wo/w2
row-parallel = Shard(1); embeddings, LM head, norms, vision tower replicated over TP). Per parameter, with
the actor's and the rollout's placement over their TP axes:
  Replicate -> Replicate                         identical
  Shard(d) over t -> Shard(d) over t             identical (each rank keeps its actor chunk)
  Replicate -> Shard(d)                          view: narrow(d) of the full tensor
  Shard(d) over t -> Shard(d) over k*t           view: narrow(d) of the actor shard, provided each rank's
                                                 rollout chunk lies inside its actor chunk (see below)
  Shard(d) over k*t -> Shard(d) over t, or -> Replicate (t = 1)
                                                 rebuilt: concatenation of k actor shards from k ranks
So going to a *smaller* rollout TP degree (8 -> 4, 4 -> 2) shares only what is replicated in both plans and
rebuilds every TP'd decoder weight; going to a *larger* one shares everything. Bytes are counted per rank, on
the rollout's local tensors: share ratio = (identical + view bytes) / rollout bytes on the rank.

The view condition is met by choosing which ranks form each rollout TP group (`RolloutLayout`). Only
membership is free: a mesh row listed out of ascending order is not honoured consistently (torch 2.13: the
sub-mesh's DTensor coordinates follow ascending rank order whatever the row says), so rows stay ascending.
The actor's ranks are tp-fastest (rank = dp_index * t_train + a).
  t_roll = k * t_train: a rollout group is k consecutive actor TP groups (contiguous ranks). The rank with
      actor coordinate a in the j-th of them sits at DTensor position j*t_train + a but holds chunk a*k + j
      of the actor's parameter, which lies inside its actor shard a. So the rollout model is the actor with
      its TP chunks reordered - whole heads of wq/wk/wv with the matching input slice of wo, whole slices
      of w1/w3 with the matching slice of w2, the same order in every layer. That is an exact symmetry of
      the network (heads and MLP neurons can be permuted consistently; GQA groups stay whole because each
      chunk holds whole KV heads), so outputs are unchanged; `full_tensor()` of a rollout parameter returns
      the reordered tensor, and `weight_sharing.SharedParam.actor_range` says which slice of the actor's
      parameter a rank holds. With k = 1 or t_train = 1 the order is the natural one.
  t_train = k * t_roll: each actor TP group splits into k rollout replicas (replica j: actor coordinates
      j, k + j, 2k + j, ...), so rollout coordinate c holds chunk c, made of actor shards c*k .. c*k + k - 1:
      those k ranks form the rebuild group, ascending, which is also the concatenation order.

Not covered: layouts that need a transpose or an all-to-all (actor Shard(d), rollout Shard(d') with d != d')
are refused, and so are rollout degrees that split a KV head (rollout TP > num_kv_heads needs a
kv-replicating plan that `parallelize.apply_tp` does not have).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from enum import Enum

import torch
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from torchplex.distributed.mesh import default_device
from torchplex.models.qwen2_5_vl.args import ModelArgs
from torchplex.models.qwen2_5_vl.model import Qwen2_5_VLModel
from torchplex.models.qwen2_5_vl.parallelize import DECODER_LAYER_TP_PLAN, check_tp_divisibility


class ShareKind(str, Enum):
    """How a rollout parameter gets its values on a rank (see the table above)."""

    IDENTICAL = "identical"
    VIEW = "view"
    REBUILT = "rebuilt"


# ---- layout rules -----------------------------------------------------------------------------------------

@dataclass(frozen=True)
class ShardLayout:
    """How one rank holds a parameter over a TP axis: `dim` None means the whole tensor (replicated)."""

    dim: int | None
    degree: int = 1
    coord: int = 0

    @classmethod
    def of(cls, tensor: torch.Tensor, name: str) -> "ShardLayout":
        if not isinstance(tensor, DTensor):
            return cls(None)
        mesh, placement = tensor.device_mesh, tensor.placements[0]
        if isinstance(placement, Replicate) and mesh.ndim == 1:
            return cls(None)
        if mesh.ndim != 1 or not isinstance(placement, Shard):
            raise ValueError(f"weight sharing: {name} has placements {tensor.placements} on a "
                             f"{mesh.ndim}-D mesh; expected Shard or Replicate over one TP axis "
                             f"(is the actor still FSDP-sharded?)")
        return cls(placement.dim % tensor.ndim, mesh.size(), mesh.get_local_rank())

    def chunk(self, size: int) -> tuple[int, int]:
        """(start, length) of this rank's slice of a dimension of `size` along `dim`."""
        length = size // self.degree
        return self.coord * length, length


def classify(actor: ShardLayout, rollout: ShardLayout, name: str = "parameter") -> ShareKind:
    """Which of identical / view / rebuilt a parameter is, from its actor and rollout layouts (see module doc)."""
    if actor.dim is None:
        return ShareKind.IDENTICAL if rollout.dim is None else ShareKind.VIEW
    if rollout.dim is None:
        return ShareKind.REBUILT
    if actor.dim != rollout.dim:
        raise NotImplementedError(f"weight sharing: {name} is sharded on dim {actor.dim} by the actor and dim "
                                  f"{rollout.dim} by the rollout; that needs an all-to-all, not supported")
    if rollout.degree == actor.degree:
        return ShareKind.IDENTICAL
    if rollout.degree % actor.degree == 0:
        return ShareKind.VIEW
    if actor.degree % rollout.degree == 0:
        return ShareKind.REBUILT
    raise ValueError(f"weight sharing: TP degrees {actor.degree} (actor) and {rollout.degree} (rollout) of {name} "
                     f"do not divide one another")


_DECODER_PARAM = re.compile(r"^layers\.\d+\.(?P<module>.+)\.(?P<leaf>weight|bias)$")


def planned_layout(name: str, degree: int) -> ShardLayout:
    """The layout DECODER_LAYER_TP_PLAN gives `name` at TP `degree` (rank 0's), without building anything."""
    m = _DECODER_PARAM.match(name)
    style = DECODER_LAYER_TP_PLAN.get(m["module"]) if m else None
    if degree == 1 or style is None:
        return ShardLayout(None)
    if isinstance(style, ColwiseParallel):
        return ShardLayout(0, degree)
    if isinstance(style, RowwiseParallel):
        return ShardLayout(1, degree) if m["leaf"] == "weight" else ShardLayout(None)
    raise TypeError(f"weight sharing: no layout rule for TP style {type(style).__name__} of {name}")


@dataclass(frozen=True)
class ParamPlan:
    """One rollout parameter on one rank: its kind, the dim it is cut or assembled along, its local bytes."""

    name: str
    kind: ShareKind
    dim: int | None
    local_bytes: int
    sources: int = 1  # ranks whose actor shards a rebuilt parameter is assembled from (k)


@dataclass
class ShareReport:
    """Bytes of the rollout model's local parameters on one rank, by how they are obtained."""

    t_train: int
    t_roll: int
    identical_bytes: int = 0
    view_bytes: int = 0
    rebuilt_bytes: int = 0           # rollout-owned buffers
    rebuild_received_bytes: int = 0  # what one resync receives from other ranks (rebuilt minus own shards)
    identical_params: int = 0
    view_params: int = 0
    rebuilt_params: int = 0
    resync_seconds: float | None = None  # last resync: FSDP regather (if any) + rebuild
    unshard_seconds: float | None = None  # the FSDP-regather part of it

    @classmethod
    def from_plans(cls, plans: list[ParamPlan], t_train: int, t_roll: int) -> "ShareReport":
        report = cls(t_train, t_roll)
        for p in plans:
            setattr(report, f"{p.kind.value}_bytes", getattr(report, f"{p.kind.value}_bytes") + p.local_bytes)
            setattr(report, f"{p.kind.value}_params", getattr(report, f"{p.kind.value}_params") + 1)
            if p.kind is ShareKind.REBUILT:
                report.rebuild_received_bytes += p.local_bytes * (p.sources - 1) // p.sources
        return report

    @property
    def total_bytes(self) -> int:
        return self.identical_bytes + self.view_bytes + self.rebuilt_bytes

    @property
    def buffer_bytes(self) -> int:
        return self.rebuilt_bytes

    @property
    def share_ratio(self) -> float:
        """Fraction of the rollout's parameter bytes on this rank that are not copied."""
        return (self.identical_bytes + self.view_bytes) / max(self.total_bytes, 1)

    def summary(self) -> str:
        pct = lambda b: 100.0 * b / max(self.total_bytes, 1)
        line = (f"TP {self.t_train}->{self.t_roll}: share {100 * self.share_ratio:.1f}% "
                f"(identical {pct(self.identical_bytes):.1f}%, view {pct(self.view_bytes):.1f}%, "
                f"rebuilt {pct(self.rebuilt_bytes):.1f}%), buffers {self.buffer_bytes / 2**20:.1f} MiB, "
                f"received per resync {self.rebuild_received_bytes / 2**20:.1f} MiB")
        if self.resync_seconds is not None:
            line += f", resync {1e3 * self.resync_seconds:.2f} ms"
        return line


def plan_sharing(args: ModelArgs, t_train: int, t_roll: int, dtype: torch.dtype = torch.bfloat16
                 ) -> list[ParamPlan]:
    """Per-parameter plan on one rank, from the layout rules alone (meta device; no process group)."""
    with torch.device("meta"):
        model = Qwen2_5_VLModel(args)
    for degree in (t_train, t_roll):
        check_tp_divisibility(model, degree)
    itemsize = torch.empty((), dtype=dtype).element_size()
    plans = []
    for name, p in model.named_parameters():
        actor, rollout = planned_layout(name, t_train), planned_layout(name, t_roll)
        kind = classify(actor, rollout, name)
        dim = rollout.dim if rollout.dim is not None else actor.dim
        plans.append(ParamPlan(name, kind, dim, p.numel() // rollout.degree * itemsize,
                               actor.degree // rollout.degree if kind is ShareKind.REBUILT else 1))
    return plans


# ---- which ranks form the rollout's TP groups ---------------------------------------------------------------

@dataclass(frozen=True)
class RolloutLayout:
    """Rollout TP groups arranged over an actor whose ranks are tp-fastest (rank = dp * t_train + coord)."""

    world_size: int
    t_train: int
    t_roll: int

    def __post_init__(self) -> None:
        for what, t in (("t_train", self.t_train), ("t_roll", self.t_roll)):
            if t < 1 or self.world_size % t:
                raise ValueError(f"rollout layout: {what} = {t} must divide world_size {self.world_size}")
        if self.t_roll % self.t_train and self.t_train % self.t_roll:
            raise ValueError(f"rollout layout: t_train {self.t_train} and t_roll {self.t_roll} must divide one another")

    @property
    def k(self) -> int:
        return max(self.t_roll // self.t_train, self.t_train // self.t_roll)

    def mesh_ranks(self) -> list[list[int]]:
        """Rows: rollout replicas (each a rollout TP group, ranks ascending)."""
        t_a, t_r, k = self.t_train, self.t_roll, self.k
        if t_r >= t_a:
            return [list(range(start, start + t_r)) for start in range(0, self.world_size, t_r)]
        return [[d * t_a + c * k + j for c in range(t_r)] for d in range(self.world_size // t_a) for j in range(k)]

    def chunk_of(self, rank: int) -> int:
        """Which 1/t_roll slice of a TP'd parameter (along its shard dim) `rank` holds during rollout."""
        a = rank % self.t_train
        if self.t_roll >= self.t_train:
            return a * self.k + rank // self.t_train % self.k
        return a // self.k

    def rebuild_groups(self) -> list[list[int]]:
        """For t_roll < t_train: the k ranks whose actor shards make up one rollout shard, in concat order."""
        if self.t_roll >= self.t_train:
            return []
        k = self.k
        return [[d * self.t_train + c * k + j for j in range(k)]
                for d in range(self.world_size // self.t_train) for c in range(self.t_roll)]

    def replica_of(self, rank: int) -> int:
        """Which rollout replica (row of `mesh_ranks`) a rank serves: replicas sample different prompts."""
        return next(i for i, row in enumerate(self.mesh_ranks()) if rank in row)

    def device_mesh(self, device_type: str | None = None) -> DeviceMesh:
        """The (replica, tp) mesh; collective: every rank builds it."""
        return DeviceMesh(device_type or default_device().type, torch.tensor(self.mesh_ranks()),
                          mesh_dim_names=("replica", "tp"))
