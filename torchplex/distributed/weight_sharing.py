"""Rollout weights that reuse the actor's storage when training and rollout use different TP degrees.

Training prefers one tensor-parallel degree (t_train), rollout another (t_roll). Instead of a second full copy
of the actor, the rollout model (the same Qwen2.5-VL module, TP'd over a rollout mesh, built on the meta
device) gets, per parameter, one of three things on each rank:

  identical  its local tensor IS the actor's local tensor (same storage, offset, shape, strides)
  view       its local tensor is a narrow of the actor's local tensor (a strided view, no copy)
  rebuilt    its local tensor spans actor shards held by other ranks: a rollout-owned buffer, refilled by an
             all-gather over the k = t_train / t_roll ranks that hold the pieces, after every optimizer step

"The actor's local tensor" is what the actor holds during rollout: under FSDP2 the unsharded parameter (all
dp shards gathered, still TP-sharded; FSDP2 keeps that tensor object across reshard/unshard and only
resizes its storage, so views taken once stay valid), otherwise the TP-local parameter itself.

Which of the three each parameter is, and which ranks form the rollout's TP groups so that views exist, is
decided in torchplex/distributed/weight_layout.py (`classify`, `RolloutLayout`, `plan_sharing`); this module
binds the storage (`WeightSharer`) and keeps it current.

Memory baseline: under FSDP2 "shared" means shared with the gathered actor. The gathered TP-local actor is
itself a copy of the dp shards; sharing pays off because the runtime holds it during rollout anyway. See
docs/weight_sharing.md for the numbers and what a leaner schedule would release.

Lifecycle (collective calls: every rank of the job makes them, in the same order):
  sharer = WeightSharer.for_actor(actor, parallel_dims, t_roll)   # actor left gathered, rollout ready
  ... rollout on sharer.rollout_model ...
  sharer.release()            # FSDP2: free the gathered actor before training (no-op without FSDP)
  ... actor forward/backward, optimizer.step() ...
  sharer.resync()             # FSDP2: regather the actor (shared weights follow); refill rebuilt buffers
Without FSDP the identical/view weights follow optimizer.step() by themselves (it updates in place);
only rebuilt ones need `resync`. The actor must update its parameters in place (torch.optim and DCP loads
do); a parameter replaced by a new tensor is detected at the next resync.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from torchplex.distributed.mesh import ParallelDims
from torchplex.distributed.weight_layout import ParamPlan, RolloutLayout, ShardLayout, ShareKind, ShareReport, classify
from torchplex.models.qwen2_5_vl.args import ModelArgs
from torchplex.models.qwen2_5_vl.model import Qwen2_5_VLModel
from torchplex.models.qwen2_5_vl.parallelize import apply_tp


def build_rollout_model(args: ModelArgs, rollout_mesh: DeviceMesh | None) -> Qwen2_5_VLModel:
    """The rollout model on the meta device, TP'd over `rollout_mesh["tp"]` (None or size 1: not TP'd).
    WeightSharer gives it storage; nothing is allocated here."""
    with torch.device("meta"):
        model = Qwen2_5_VLModel(args)
    if rollout_mesh is not None and rollout_mesh["tp"].size() > 1:
        apply_tp(model, rollout_mesh["tp"])
    return model.requires_grad_(False)


def shares_storage(inner: torch.Tensor, outer: torch.Tensor) -> bool:
    """True when every element `inner` addresses lies inside the storage region `outer` addresses."""
    inner = inner.to_local() if isinstance(inner, DTensor) else inner
    outer = outer.to_local() if isinstance(outer, DTensor) else outer
    if inner.untyped_storage().data_ptr() != outer.untyped_storage().data_ptr() or inner.untyped_storage().size() == 0:
        return False

    def extent(t: torch.Tensor) -> tuple[int, int]:
        last = sum((s - 1) * st for s, st in zip(t.shape, t.stride())) if t.numel() else -1
        return t.storage_offset() * t.element_size(), (t.storage_offset() + last + 1) * t.element_size()

    (a0, a1), (b0, b1) = extent(inner), extent(outer)
    return b0 <= a0 and a1 <= b1


# ---- the live sharer ---------------------------------------------------------------------------------------

@dataclass
class SharedParam:
    """One rollout parameter on this rank and where its values come from."""

    plan: ParamPlan
    local: torch.Tensor     # the rollout's local tensor (identical/view: aliases `source`; rebuilt: a buffer)
    source: torch.Tensor    # the actor's local tensor this rank holds during rollout
    actor_range: tuple[int, int, int] | None  # (dim, start, length) of the actor's parameter `local` holds;
                                              # None: all of it
    actor_module: nn.Module  # where the actor's parameter lives (re-read at each resync)
    actor_leaf: str


@dataclass
class _Bucket:
    entries: list[SharedParam] = field(default_factory=list)
    numel: int = 0


def _local(t: torch.Tensor) -> torch.Tensor:
    return (t.to_local() if isinstance(t, DTensor) else t).detach()


class WeightSharer:
    """Points `rollout_model`'s parameters at `actor`'s storage where the layouts allow, rebuilds the rest.

    Collective: every rank constructs it (and calls resync/release) in the same order. `rollout_model` must
    come from `build_rollout_model` over `layout.device_mesh()` (or be untouched meta params when t_roll is 1).
    On return the actor is gathered (FSDP2) and the rollout model is ready.
    """

    def __init__(self, actor: nn.Module, rollout_model: nn.Module, layout: RolloutLayout, *,
                 bucket_bytes: int = 256 << 20):
        self.actor, self.rollout_model, self.layout = actor, rollout_model, layout
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        world = dist.get_world_size() if dist.is_initialized() else 1
        if world != layout.world_size:
            raise ValueError(f"weight sharing: layout is for {layout.world_size} ranks, the job has {world}")
        self._fsdp_modules = [m for m in actor.modules() if isinstance(m, FSDPModule)]
        self._rebuild_group = None
        if layout.rebuild_groups():
            self._rebuild_group, _ = dist.new_subgroups_by_enumeration(layout.rebuild_groups())
        self._unshard_seconds = self._gather_actor()
        self.entries = self._share(bucket_bytes)
        self._last_resync_seconds: float | None = None
        self._rebuild()

    @classmethod
    def for_actor(cls, actor: Qwen2_5_VLModel, parallel_dims: ParallelDims | None, t_roll: int,
                  **kwargs) -> "WeightSharer":
        """Build the rollout mesh and meta model for TP `t_roll` over this job and share `actor` into it."""
        world = parallel_dims.world_size if parallel_dims is not None else 1
        layout = RolloutLayout(world, parallel_dims.tp if parallel_dims is not None else 1, t_roll)
        mesh = layout.device_mesh(parallel_dims.device_type) if t_roll > 1 else None
        return cls(actor, build_rollout_model(actor.args, mesh), layout, **kwargs)

    # ---- construction ----------------------------------------------------------------------------------
    def _actor_tp_ranks(self) -> list[int]:
        start = self.rank // self.layout.t_train * self.layout.t_train
        return list(range(start, start + self.layout.t_train))

    def _layout_of(self, t: torch.Tensor, name: str, side: str, degree: int, ranks: list[int]) -> ShardLayout:
        got = ShardLayout.of(t, name)
        if got.dim is not None:
            mesh_ranks = t.device_mesh.mesh.flatten().tolist()
            if got.degree != degree or mesh_ranks != ranks:
                raise ValueError(f"weight sharing: {side} parameter {name} is sharded over ranks {mesh_ranks}; "
                                 f"expected the TP group {ranks} of degree {degree} (see RolloutLayout)")
        return got

    def _share(self, bucket_bytes: int) -> list[SharedParam]:
        actor_params = dict(self.actor.named_parameters())
        rollout_row = next(row for row in self.layout.mesh_ranks() if self.rank in row)
        replaced: dict[int, nn.Parameter] = {}
        entries = []
        for name, meta in list(self.rollout_model.named_parameters(remove_duplicate=False)):
            module_name, _, leaf = name.rpartition(".")
            module = self.rollout_model.get_submodule(module_name)
            if id(meta) in replaced:  # a tied parameter: share the one already built
                setattr(module, leaf, replaced[id(meta)])
                continue
            if name not in actor_params:
                raise KeyError(f"weight sharing: rollout parameter {name} has no actor parameter of that name")
            actor_param = actor_params[name]
            if tuple(actor_param.shape) != tuple(meta.shape):
                raise ValueError(f"weight sharing: {name} is {tuple(actor_param.shape)} in the actor and "
                                 f"{tuple(meta.shape)} in the rollout model")
            a = self._layout_of(actor_param, name, "actor", self.layout.t_train, self._actor_tp_ranks())
            r = self._layout_of(meta, name, "rollout", self.layout.t_roll, rollout_row)
            if r.dim is not None:  # the chunk this rank really holds, not its position in the group
                r = ShardLayout(r.dim, r.degree, self.layout.chunk_of(self.rank))
            kind = classify(a, r, name)
            source = _local(actor_param)
            local, actor_range = self._rollout_local(name, kind, a, r, source, meta.shape)
            dim = r.dim if r.dim is not None else a.dim
            sources = a.degree // r.degree if kind is ShareKind.REBUILT else 1
            plan = ParamPlan(name, kind, dim, local.numel() * local.element_size(), sources)
            actor_module_name, _, actor_leaf = name.rpartition(".")
            entries.append(SharedParam(plan, local, source, actor_range, self.actor.get_submodule(actor_module_name),
                                       actor_leaf))
            with torch.no_grad():
                value = local if not isinstance(meta, DTensor) else DTensor.from_local(
                    local, meta.device_mesh, meta.placements, run_check=False, shape=meta.shape, stride=meta.stride())
            param = nn.Parameter(value, requires_grad=False)
            setattr(module, leaf, param)
            replaced[id(meta)] = param
        buffers = [name for name, _ in self.rollout_model.named_buffers()]
        if buffers:  # Qwen2_5_VLModel has none; a model that grows some needs them shared here too
            raise NotImplementedError(f"weight sharing: rollout buffers {buffers} are not handled")
        self._buckets = self._make_buckets([e for e in entries if e.plan.kind is ShareKind.REBUILT], bucket_bytes)
        return entries

    def _rollout_local(self, name: str, kind: ShareKind, a: ShardLayout, r: ShardLayout, source: torch.Tensor,
                       shape: torch.Size) -> tuple[torch.Tensor, tuple[int, int, int] | None]:
        """The rollout's local tensor and the (dim, start, length) of the actor's parameter it holds."""
        if kind is ShareKind.IDENTICAL:
            if a.dim is None:
                return source, None
            if a.coord != r.coord:
                raise ValueError(f"weight sharing: {name} has actor chunk {a.coord}, rollout chunk {r.coord}")
            return source, (a.dim, *a.chunk(shape[a.dim]))
        if kind is ShareKind.VIEW:
            size = shape[r.dim]
            if size % r.degree:
                raise ValueError(f"weight sharing: dim {r.dim} of {name} ({size}) does not split into {r.degree}")
            start, length = r.chunk(size)
            held_start, held = a.chunk(size) if a.dim is not None else (0, size)
            if not (held_start <= start and start + length <= held_start + held):
                raise ValueError(f"weight sharing: rollout shard {start}:{start + length} of {name} is not inside "
                                 f"this rank's actor shard {held_start}:{held_start + held}; build the rollout "
                                 f"mesh with RolloutLayout.device_mesh()")
            return source.narrow(r.dim, start - held_start, length), (r.dim, start, length)
        # REBUILT: k actor shards, in the rebuild group's order, concatenated along the actor's shard dim.
        k = a.degree // r.degree
        group = next(g for g in self.layout.rebuild_groups() if self.rank in g)
        if a.coord != r.coord * k + group.index(self.rank):
            raise ValueError(f"weight sharing: rebuild of {name} expects actor coordinate "
                             f"{r.coord * k + group.index(self.rank)} on rank {self.rank}, found {a.coord}")
        local_shape = list(source.shape)
        local_shape[a.dim] *= k
        buffer = torch.empty(local_shape, dtype=source.dtype, device=source.device)
        return buffer, None if r.dim is None else (r.dim, *r.chunk(shape[r.dim]))

    @staticmethod
    def _make_buckets(entries: list[SharedParam], bucket_bytes: int) -> list[_Bucket]:
        """Group rebuilt parameters (same dtype) so each all-gather moves about `bucket_bytes`."""
        buckets: list[_Bucket] = []
        open_by_dtype: dict[torch.dtype, _Bucket] = {}
        for e in entries:
            b = open_by_dtype.get(e.source.dtype)
            if b is None or (b.numel and (b.numel + e.source.numel()) * e.source.element_size() > bucket_bytes):
                b = open_by_dtype[e.source.dtype] = _Bucket()
                buckets.append(b)
            b.entries.append(e)
            b.numel += e.source.numel()
        return buckets

    # ---- per step --------------------------------------------------------------------------------------
    def _gather_actor(self) -> float:
        """FSDP2: (re)gather every unit so the actor's unsharded storage holds the current weights. A unit
        left gathered by a no-grad call is resharded first, else unshard() would be a no-op on stale data."""
        if not self._fsdp_modules:
            return 0.0
        t0 = time.perf_counter()
        for m in self._fsdp_modules:
            m.reshard()
        handles = [m.unshard(async_op=True) for m in self._fsdp_modules]
        for h in handles:
            if h is not None:
                h.wait()
        return time.perf_counter() - t0

    def _rebuild(self) -> None:
        k = self.layout.k
        with torch.no_grad():
            for bucket in self._buckets:
                send = torch.cat([e.source.reshape(-1) for e in bucket.entries])
                recv = send.new_empty(k, send.numel())
                if dist.get_backend(self._rebuild_group) == "gloo":  # gloo has no all_gather_into_tensor
                    dist.all_gather(list(recv.unbind(0)), send, group=self._rebuild_group)
                else:
                    dist.all_gather_into_tensor(recv, send, group=self._rebuild_group)
                offset = 0
                for e in bucket.entries:
                    n, piece = e.source.numel(), e.source.shape
                    step = piece[e.plan.dim]
                    for i in range(k):
                        e.local.narrow(e.plan.dim, i * step, step).copy_(recv[i, offset:offset + n].view(piece))
                    offset += n

    def _check_still_shared(self) -> None:
        for e in self.entries:
            current = getattr(e.actor_module, e.actor_leaf)
            if _local(current).untyped_storage().data_ptr() != e.source.untyped_storage().data_ptr():
                raise RuntimeError(f"weight sharing: the actor's {e.plan.name} now lives in new storage (was it "
                                   f"replaced rather than updated in place?); build a new WeightSharer")

    def resync(self) -> float:
        """After optimizer.step(): regather the FSDP2 actor (identical/view weights follow it) and refill the
        rebuilt buffers. Returns the seconds it took (also in `report()`)."""
        t0 = time.perf_counter()
        self._unshard_seconds = self._gather_actor()
        self._check_still_shared()
        self._rebuild()
        if self.entries and self.entries[0].source.device.type == "cuda":
            torch.cuda.synchronize()
        self._last_resync_seconds = time.perf_counter() - t0
        return self._last_resync_seconds

    def release(self) -> None:
        """Free the gathered FSDP2 actor before training. The rollout's identical/view weights point at that
        storage, so the rollout model must not run again before the next `resync`."""
        for m in self._fsdp_modules:
            m.reshard()

    @property
    def ready(self) -> bool:
        """False while the actor storage the rollout points at is released."""
        return all(e.local.untyped_storage().size() > 0 for e in self.entries)

    def report(self) -> ShareReport:
        report = ShareReport.from_plans([e.plan for e in self.entries], self.layout.t_train, self.layout.t_roll)
        report.resync_seconds = self._last_resync_seconds
        report.unshard_seconds = self._unshard_seconds if self._fsdp_modules else None
        return report
