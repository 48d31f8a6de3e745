"""Planned vs measured memory of the scale rows, as the Markdown tables of docs/memory.md.

    python benchmarks/memory_table.py benchmarks/results/scale-20261201-*.json

For each row that ran: the bytes the step's budget planned per group in its fullest stage beside what the step
held (weights, optimizer state, KV pool, held prefixes: every round's) and each stage's measured peak against its
planned total (training's with the prefixes it holds at once: its largest round's, the fused ones being round 0).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

GIB = 2**30


def gib(x) -> str:
    return f"{x / GIB:.1f}" if x else "0"


def tables(files: list[str]) -> str:
    rows = [r for f in files for r in json.loads(Path(f).read_text())["rows"] if r.get("ok") and "memory" in r]
    out = ["| workload | P | mode | forms | weights (actor+ref) | optimizer | grads | KV pool planned / held | "
           "held prefixes planned / held | activations planned | rollout peak planned / measured | "
           "train peak planned / measured | peak allocated |",
           "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in sorted(rows, key=lambda r: (r["workload"], r["prompts"], r["mode"])):
        plan, meas = r["memory"]["planned"], r["memory"]["measured"]
        res = plan["residents"]
        train, roll = res.get("train", {}), res.get("rollout", {})
        held_plan = plan.get("held_graph_bytes", 0)  # from the rollout to training
        train_held = plan.get("train_held_bytes", 0)  # within training (decomposed's batched actor prefix)
        # what training holds at once: one round's (files before 2026-12-04 have every round's only); the fused
        # prefixes are round 0, freed by their batched backward before round 1's forward
        train_at_once = plan.get("train_held_at_once_bytes", train_held)
        held = meas.get("held_graph_bytes", 0) + meas.get("held_compact_bytes", 0)
        forms = ", ".join([f"{k} {v}" for k, v in plan.get("forms", {}).items()]
                          + [f"in training: {k} {v}" for k, v in plan.get("train_forms", {}).items()])
        peaks = meas.get("stage_peak_bytes", {})
        out.append(
            f"| {r['workload']} | {r['prompts']} | {r['mode']} | {forms} | "
            f"{gib(train.get('actor_weights', 0))} + {gib(train.get('ref_weights', 0))} | "
            f"{gib(train.get('optimizer_state', 0))} | {gib(train.get('grads', 0))} | "
            f"{gib(roll.get('kv_pool', 0))} / {gib(meas.get('kv_pool_bytes', 0))} | {gib(held_plan + train_held)} / "
            f"{gib(held)} | "
            f"{gib(train.get('activations', 0))} | {gib(sum(roll.values()) + held_plan)} / "
            f"{gib(peaks.get('rollout', 0))} | {gib(sum(train.values()) + max(held_plan, train_at_once))} / "
            f"{gib(peaks.get('train', 0))} | "
            f"{r['peak_gib']:.1f} |")
    return "\n".join(out) + "\n\nAll in GiB. Planned: the step's memory budget (`Schedule.memory`); measured: the " \
        "tensors the step held and each stage's allocator peak.\n"


if __name__ == "__main__":
    print(tables(sys.argv[1:]))
