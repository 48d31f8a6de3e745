"""Command line over torchplex.models.qwen2_5_vl.tiny_checkpoint: write a random Qwen2.5-VL checkpoint.

    python tools/make_tiny_checkpoint.py --output /tmp/tiny [--size debug] [--seed 0] [--untied]
        [--window-size N] [--max-shard-size 200KB] [--min-pixels N] [--max-pixels N] [--num-kv-heads N]
    python tools/make_tiny_checkpoint.py --output /tmp/ckpt7b --size 7B --full-vocab --device cuda \
        --dtype bfloat16 --mean-response 256     # the published 7B geometry and vocabulary, seconds on a GPU

What the folder holds is documented in the package module (the trainer writes one itself for debug runs).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `torchplex` importable from the repo root
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from torchplex.models.qwen2_5_vl.tiny_checkpoint import (  # noqa: E402,F401 - re-exported for callers of the tool
    DEFAULT_MAX_PIXELS, DEFAULT_MIN_PIXELS, DEFAULT_VIDEO_MAX_PIXELS, DEFAULT_VIDEO_MIN_PIXELS, INIT_STD,
    NON_SPECIAL_ADDED_TOKENS, SPECIAL_TOKENS, TinyCheckpoint, make_tiny_checkpoint, model_args_for, train_tokenizer)


def main(argv: list[str] | None = None) -> TinyCheckpoint:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--output", required=True, help="folder to write (created if missing)")
    parser.add_argument("--size", default="debug", help="flavor from torchplex.models.qwen2_5_vl.args")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--untied", action="store_true", help="separate lm_head (tie_word_embeddings false)")
    parser.add_argument("--window-size", type=int, default=None, help="vision window size in pixels")
    parser.add_argument("--num-kv-heads", type=int, default=None,
                        help="decoder K/V heads (a divisor of the flavor's query heads; default the flavor's)")
    parser.add_argument("--max-shard-size", default=None, help='e.g. "200KB": write a sharded index')
    parser.add_argument("--min-pixels", type=int, default=None,
                        help=f"image processor budget (default {DEFAULT_MIN_PIXELS}; Qwen's with --full-vocab)")
    parser.add_argument("--max-pixels", type=int, default=None,
                        help=f"image processor budget (default {DEFAULT_MAX_PIXELS}; Qwen's with --full-vocab)")
    parser.add_argument("--video-min-pixels", type=int, default=None)
    parser.add_argument("--video-max-pixels", type=int, default=None)
    parser.add_argument("--no-weights", action="store_true",
                        help="config, tokenizer and processor only (SGLang's load_format=dummy)")
    parser.add_argument("--full-vocab", action="store_true",
                        help="Qwen2.5's vocabulary and token ids, the flavor's published vocab size and Qwen's "
                             "pixel budgets (for --size 3B / 7B / 32B)")
    parser.add_argument("--device", default=None, help="make the weights there (e.g. cuda), with the native model")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--mean-response", type=int, default=0,
                        help="stop tokens that end random responses after ~this many tokens on average")
    a = parser.parse_args(argv)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # keep the CLI to its one summary line
    start = time.perf_counter()
    ckpt = make_tiny_checkpoint(
        a.output, size=a.size, seed=a.seed, tie_word_embeddings=False if a.untied else None,
        window_size=a.window_size, max_shard_size=a.max_shard_size, min_pixels=a.min_pixels,
        max_pixels=a.max_pixels, video_min_pixels=a.video_min_pixels, video_max_pixels=a.video_max_pixels,
        weights=not a.no_weights, full_vocab=a.full_vocab, device=a.device, dtype=a.dtype,
        mean_response=a.mean_response, num_kv_heads=a.num_kv_heads)
    print(f"{ckpt.summary()} in {time.perf_counter() - start:.1f}s")
    return ckpt


if __name__ == "__main__":
    main()
