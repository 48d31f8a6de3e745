"""Write the synthetic visual-reasoning task (PNGs + train.jsonl / eval.jsonl) to a folder.

    python tools/make_synthetic_data.py --output data/synthetic --train 2000 --eval 200 --seed 0

Running it again with the same arguments is instant (the folder's manifest matches).
"""

from __future__ import annotations

import argparse
import sys
from collections import Counter
from pathlib import Path

from torchplex.data.records import read_records
from torchplex.data.synthetic import TASK_KINDS, generate_synthetic_task


def _image_size(text: str) -> tuple[int, int]:
    """'56' or '56x56' -> (width, height)."""
    parts = text.lower().split("x")
    try:
        if len(parts) == 1:
            return int(parts[0]), int(parts[0])
        if len(parts) == 2:
            return int(parts[0]), int(parts[1])
    except ValueError:
        pass
    raise argparse.ArgumentTypeError(f"image size must look like 56 or 56x56, got {text!r}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--output", required=True, type=Path, help="folder to write")
    parser.add_argument("--train", type=int, default=2000, help="number of training samples")
    parser.add_argument("--eval", type=int, default=200, help="number of eval samples")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--image-size", type=_image_size, default=(56, 56), help="e.g. 56 or 112x84")
    parser.add_argument(
        "--kinds", default=",".join(TASK_KINDS), help=f"comma-separated subset of {','.join(TASK_KINDS)}"
    )
    args = parser.parse_args(argv)

    kinds = tuple(k.strip() for k in args.kinds.split(",") if k.strip())
    train_path, eval_path = generate_synthetic_task(
        args.output, args.train, args.eval, seed=args.seed, image_size=args.image_size,
        kinds=kinds, progress=True,
    )
    for path in (train_path, eval_path):
        counts = Counter(r.task for r in read_records(path))
        summary = ", ".join(f"{k}={counts[k]}" for k in kinds)
        print(f"{path}: {sum(counts.values())} records ({summary})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
