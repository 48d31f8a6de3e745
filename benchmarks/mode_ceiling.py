"""How much faster than decomposed the overlapped step can be, from the scale rows: the ceiling on the ratio.

    python benchmarks/mode_ceiling.py benchmarks/results/scale-20261204-*.json [--plot docs/img/mode-ceiling.png]

Overlapped differs from decomposed only in the prefix work it removes (the actor's prefix forward, fused into
the rollout's prefill) or hides (prefix work placed beside the decode). The prefix backward stays in training:
it needs the suffix's gradients. So even with every prefix forward of the step, the actor's and the reference's,
removed at no cost, an overlapped step takes at least

    decomposed step - actor prefix forward - reference prefix forward,

and `decomposed / that` bounds overlapped / decomposed from above. The actor prefix forward is decomposed's measured
training span (`train_spans.totals.prefix_forward`); the reference's prefix is not timed on its own, so it is the
reference phase's time times the prefix's share of its counted FLOPs (the rollout prefill's FLOPs over the
reference's, `pflop`: prefix and vision tower, against prefix, vision and every response over its prefix).
Rows pair within one file (one run); a file without a timed decomposed row, its spans or FLOPs gives no row.
"""

from __future__ import annotations

import argparse
import json
from dataclasses import dataclass
from pathlib import Path


@dataclass(frozen=True)
class Ceiling:
    file: str
    workload: str
    prompts: int
    decomposed_s: float
    actor_prefix_forward_s: float  # measured: decomposed's training span
    ref_prefix_s: float  # estimated: the reference phase times the prefix's share of its FLOPs
    overlapped_s: float | None  # the same run's overlapped step, when it ran
    response_tokens: tuple[int, int] | None = None  # (overlapped, decomposed): the modes sample their own responses

    @property
    def floor_s(self) -> float:
        """The shortest overlapped step: decomposed without any prefix forward."""
        return self.decomposed_s - self.actor_prefix_forward_s - self.ref_prefix_s

    @property
    def ceiling(self) -> float:
        return self.decomposed_s / self.floor_s

    @property
    def measured(self) -> float | None:
        return self.decomposed_s / self.overlapped_s if self.overlapped_s else None

    def removed_for(self, ratio: float) -> float:
        """Seconds an overlapped step must take off decomposed's to be `ratio` times faster."""
        return self.decomposed_s - self.decomposed_s / ratio


def ceiling_of(file: str, decomposed: dict, overlapped: dict | None) -> Ceiling | None:
    spans = decomposed.get("train_spans", {}).get("totals", {})
    flops = decomposed.get("pflop") or {}
    if "prefix_forward" not in spans or not flops.get("reference"):
        return None
    ref_s = decomposed["phases_s"].get("ref", decomposed["phases_s"].get("reference", 0.0))
    return Ceiling(file=Path(file).name, workload=decomposed["workload"], prompts=decomposed["prompts"],
                   decomposed_s=decomposed["step_s"], actor_prefix_forward_s=spans["prefix_forward"]["device_s"],
                   ref_prefix_s=ref_s * flops["prefill"] / flops["reference"],
                   overlapped_s=overlapped["step_s"] if overlapped else None,
                   response_tokens=(overlapped["response_tokens"], decomposed["response_tokens"])
                   if overlapped and "response_tokens" in overlapped and "response_tokens" in decomposed else None)


def ceilings(files: list[str]) -> list[Ceiling]:
    out = []
    for f in files:
        runs: dict[tuple, dict[str, dict]] = {}
        for r in json.loads(Path(f).read_text())["rows"]:
            if r.get("ok") and r.get("step_s"):
                runs.setdefault((r["workload"], r["prompts"]), {})[r["mode"]] = r
        for modes in runs.values():
            if "decomposed" in modes and (c := ceiling_of(f, modes["decomposed"], modes.get("overlapped"))):
                out.append(c)
    return sorted(out, key=lambda c: (c.workload, c.prompts, c.file))


def table(rows: list[Ceiling], target: float = 1.15) -> str:
    out = ["| run | workload | P | decomposed (s) | actor prefix forward (s) | reference prefix (s, est.) | "
           f"overlapped floor (s) | ceiling | measured | response tokens (o / d) | to remove for {target}x (s) |",
           "|---|---|---|---|---|---|---|---|---|---|---|"]
    for c in rows:
        measured = f"{c.measured:.3f}x" if c.measured else "-"
        tokens = f"{c.response_tokens[0]} / {c.response_tokens[1]}" if c.response_tokens else "-"
        out.append(f"| {c.file} | {c.workload} | {c.prompts} | {c.decomposed_s:.2f} | {c.actor_prefix_forward_s:.2f} | "
                   f"{c.ref_prefix_s:.2f} | {c.floor_s:.2f} | {c.ceiling:.3f}x | {measured} | {tokens} | "
                   f"{c.removed_for(target):.2f} |")
    return "\n".join(out) + (
        "\n\nCeiling: decomposed over decomposed without every prefix forward (the actor's, measured; the "
        "reference's, its FLOP share of the reference phase). Measured: decomposed over overlapped in the same run; a mode that sampled fewer response tokens gains that "
        "much more (a measured ratio can pass its ceiling so).\n")


def plot(rows: list[Ceiling], path: str, target: float = 1.15) -> None:
    """One bar pair per run: the ceiling and the measured ratio, beside the target."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [f"{c.workload} P={c.prompts}  {c.file.removeprefix('scale-').removesuffix('.json')}" for c in rows]
    y = range(len(rows))
    fig, ax = plt.subplots(figsize=(8, 0.35 * len(rows) + 1.2))
    ax.barh([i + 0.2 for i in y], [c.ceiling for c in rows], height=0.4, label="ceiling (no prefix forward)")
    ax.barh([i - 0.2 for i in y], [c.measured or 0 for c in rows], height=0.4, label="measured")
    ax.axvline(target, color="k", linestyle="--", label=f"target {target}x")
    ax.set_yticks(list(y), labels, fontsize=7)
    ax.invert_yaxis()
    ax.set_xlim(0.9, max([target, *(c.ceiling for c in rows)]) + 0.05)
    ax.set_xlabel("decomposed step / overlapped step")
    ax.legend(fontsize=7, loc="upper right")
    fig.tight_layout()
    fig.savefig(path, dpi=120)


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("files", nargs="+", help="scale results (benchmarks/results/scale-*.json)")
    ap.add_argument("--plot", help="also draw the ceilings and measured ratios to this PNG")
    args = ap.parse_args()
    found = ceilings(args.files)
    print(table(found))
    if args.plot:
        plot(found, args.plot)
