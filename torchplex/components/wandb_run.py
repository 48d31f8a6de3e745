"""Optional Weights & Biases logging (`metrics.wandb = true`), started only on rank 0 and only when enabled.

wandb is an optional extra (`pip install 'torchplex[wandb]'`), so it is imported here, never at module load.
Set WANDB_MODE=offline to log without an account or network; the run then lands in `<run_dir>/wandb/` and can be
uploaded later with `wandb sync`.
"""

from __future__ import annotations

import hashlib
from pathlib import Path


def start_wandb(run_dir: Path, project: str, name: str, config: dict | None):
    try:
        import wandb
    except ImportError:
        raise ImportError("metrics.wandb = true needs the wandb package: pip install 'torchplex[wandb]' "
                          "(or set metrics.wandb = false)") from None
    # an id derived from the run folder with resume="allow": a resumed run continues the same W&B run
    run_id = f"{name or 'run'}-{hashlib.sha1(str(run_dir.resolve()).encode()).hexdigest()[:8]}"
    return wandb.init(project=project, name=name or None, dir=str(run_dir), config=config or {}, id=run_id,
                      resume="allow")
