"""How much of the rollout model can live in the actor's storage, per TP pair: layout rules or a live run.

    python benchmarks/share_ratio.py                         # 7B / 32B table from the layout rules (meta device)
    python benchmarks/share_ratio.py --flavors 72B --pairs 8:4 4:8
    torchrun --nproc_per_node 4 benchmarks/share_ratio.py --live --flavor debug --dp 2 --tp 2 --t-roll 1  # CPU
    torchrun --nproc_per_node 8 benchmarks/share_ratio.py --live --flavor 32B --dp 1 --tp 8 --t-roll 4 \\
        --dtype bfloat16                                      # H200 node: measured resync time

The table counts bytes of the rollout model's local parameters on one rank (all ranks hold the same amount):
identical (the actor's own tensor), view (a narrow of it), rebuilt (a rollout-owned buffer refilled by an
all-gather after each optimizer step). `own in rebuilt` is the part of the rebuilt bytes that already sits on
the rank (its own actor shard): a rollout layer that kept each rebuilt weight as k pieces could view that
part too, so `share ratio + own in rebuilt` is the ceiling of any scheme that copies only what other ranks
hold. The live mode builds a random actor (FSDP2 over --dp, TP over --tp), shares it into TP --t-roll and
times `resync()` (FSDP2 regather + rebuild) over --repeats steps.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from torchplex.distributed.weight_layout import ShareKind, ShareReport, plan_sharing  # noqa: E402
from torchplex.distributed.weight_sharing import WeightSharer  # noqa: E402
from torchplex.models.qwen2_5_vl.args import get_flavor  # noqa: E402

GiB = 2 ** 30


def _group(name: str) -> str:
    """Coarse parameter family, for the 'what gets rebuilt' breakdown."""
    if name.startswith("visual."):
        return "vision tower"
    if name.startswith("layers."):
        return "decoder " + name.split(".")[2] + "." + name.split(".")[3]
    return name.rsplit(".", 1)[0]


def table(flavors: list[str], pairs: list[tuple[int, int]], dtype: torch.dtype) -> str:
    rows = ["| geometry | TP train -> rollout | rollout bytes / rank | identical | view | rebuilt | share ratio "
            "| buffer / rank | received per resync / rank | own in rebuilt |",
            "|---|---|---|---|---|---|---|---|---|---|"]
    notes = []
    for flavor in flavors:
        args = get_flavor(flavor)
        for t_train, t_roll in pairs:
            try:
                plans = plan_sharing(args, t_train, t_roll, dtype)
            except ValueError as e:
                rows.append(f"| {flavor} | {t_train} -> {t_roll} | not a valid TP degree for this geometry "
                            f"| | | | | | | |")
                notes.append(f"{flavor} TP {t_train}->{t_roll}: {e}")
                continue
            r = ShareReport.from_plans(plans, t_train, t_roll)
            pct = lambda b: f"{100 * b / r.total_bytes:.1f}%"
            own = r.rebuilt_bytes - r.rebuild_received_bytes
            rows.append(f"| {flavor} | {t_train} -> {t_roll} | {r.total_bytes / GiB:.2f} GiB "
                        f"| {pct(r.identical_bytes)} | {pct(r.view_bytes)} | {pct(r.rebuilt_bytes)} "
                        f"| **{100 * r.share_ratio:.1f}%** "
                        f"| {r.buffer_bytes / GiB:.2f} GiB | {r.rebuild_received_bytes / GiB:.2f} GiB | {pct(own)} |")
            rebuilt = sorted({_group(p.name) for p in plans if p.kind is ShareKind.REBUILT})
            if rebuilt:
                notes.append(f"{flavor} TP {t_train}->{t_roll} rebuilds: {', '.join(rebuilt)}")
    return "\n".join(rows + [""] + [f"- {n}" for n in notes])


def live(args: argparse.Namespace) -> None:
    from torchplex.distributed.mesh import build_parallel_dims, default_device, finish_distributed, init_distributed
    from torchplex.models.qwen2_5_vl.build import build_model
    from torchplex.models.qwen2_5_vl.parallelize import parallelize_qwen2_5_vl

    rank, world, device = init_distributed()
    dims = build_parallel_dims(args.dp, args.tp, world)
    dtype = getattr(torch, args.dtype)
    actor = build_model(get_flavor(args.flavor), device=device, dtype=dtype,
                        parallelize=lambda m: parallelize_qwen2_5_vl(m, dims, param_dtype=dtype, reduce_dtype=dtype))
    sharer = WeightSharer.for_actor(actor, dims, args.t_roll)
    seconds, unshard = [], []
    for _ in range(args.repeats):
        sharer.release()
        seconds.append(sharer.resync())
        unshard.append(sharer.report().unshard_seconds or 0.0)
    if rank == 0:
        print(f"{args.flavor} on {world} x {default_device().type}, dp {args.dp} x tp {args.tp} -> rollout tp "
              f"{args.t_roll}, {args.dtype}")
        print(sharer.report().summary())
        print(f"resync median {1e3 * statistics.median(seconds):.2f} ms over {args.repeats} "
              f"(of which FSDP2 regather {1e3 * statistics.median(unshard):.2f} ms)")
    finish_distributed()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--flavors", nargs="+", default=["7B", "32B"])
    p.add_argument("--pairs", nargs="+", default=["8:4", "4:2", "4:8", "2:4"], help="t_train:t_roll")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--live", action="store_true", help="measure a real sharer (run under torchrun)")
    p.add_argument("--flavor", default="debug")
    p.add_argument("--dp", type=int, default=-1)
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--t-roll", type=int, default=1)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    if args.live:
        live(args)
        return
    pairs = [tuple(int(x) for x in pair.split(":")) for pair in args.pairs]
    print(table(args.flavors, pairs, getattr(torch, args.dtype)))


if __name__ == "__main__":
    main()
