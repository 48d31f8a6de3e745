"""The Config the step benchmarks run: their CLI choices on top of the trainer's defaults, turned into the step
runtime by the trainer's own builder (torchplex/runtime/build.py), so a benchmark measures the step the trainer runs.
"""

from __future__ import annotations

from torchplex.config import Config


def bench_config(mode: str = "decomposed", *, micro_batch: int = 8, ref_micro_batch: int = 0, kl_coef: float = 0.01,
                 window: bool = False, window_sample_batch: int = 0, ref_prefix_graphs: bool = False) -> Config:
    """A step of `mode` with the benchmarks' loss (one `format` reward, a reference at kl_coef, the symmetric
    0.2 clip their earlier results were measured with); window: the reference in the decode window. `micro_batch` /
    `ref_micro_batch` bound the sequences per micro-batch (algorithm.micro_batch_size, ref_micro_batch_size; 0: no
    bound) beside the token budgets the planner derives from the memory budget."""
    cfg = Config()
    cfg.reward.functions, cfg.reward.weights = ["format"], [1.0]
    cfg.algorithm.micro_batch_size = micro_batch
    cfg.algorithm.ref_micro_batch_size = ref_micro_batch
    cfg.algorithm.kl_coef = kl_coef
    cfg.algorithm.clip_low = cfg.algorithm.clip_high = 0.2
    cfg.runtime.mode = mode
    cfg.runtime.reference_in_window = window
    cfg.runtime.window_sample_batch = window_sample_batch
    cfg.runtime.ref_prefix_graphs = ref_prefix_graphs
    return cfg
