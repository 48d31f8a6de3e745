"""Draw the training curves of a run from its metrics.jsonl: command line over torchplex.components.plot_metrics.

    python tools/plot_metrics.py RUN_DIR [--out PNG]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `torchplex` importable from the repo root
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from torchplex.components.plot_metrics import (  # noqa: E402,F401 - re-exported for callers of the tool
    METRICS_FILENAME, PLOT_FILENAME, MetricsHistory, Panel, Series, _panels, plot_metrics, read_metrics)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("run_dir", type=Path, help="run directory holding metrics.jsonl")
    parser.add_argument("--out", type=Path, default=None, help="output PNG (default RUN_DIR/metrics.png)")
    args = parser.parse_args(argv)
    try:
        path = plot_metrics(args.run_dir, args.out)
    except (FileNotFoundError, ValueError) as error:
        print(f"plot_metrics: error: {error}", file=sys.stderr)
        return 1
    print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
