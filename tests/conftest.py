"""Shared fixtures: tiny random-weight Qwen2.5-VL checkpoints, built once per test session (~0.3 s each
after imports) by `tools/make_tiny_checkpoint.py`."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

REPO_ROOT = Path(__file__).resolve().parents[1]
if str(REPO_ROOT) not in sys.path:  # `tools` is a plain folder at the repo root, not an installed package
    sys.path.insert(0, str(REPO_ROOT))

from tools.make_tiny_checkpoint import make_tiny_checkpoint  # noqa: E402


@pytest.fixture(scope="session")
def tiny_ckpt(tmp_path_factory) -> Path:
    """`debug` flavor, seed 0, tied embeddings, vision window 56 px, one `model.safetensors`."""
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny_ckpt"), size="debug", seed=0).path


@pytest.fixture(scope="session")
def tiny_ckpt_untied(tmp_path_factory) -> Path:
    """Like `tiny_ckpt` but with a separate `lm_head` and a 112 px vision window (4x4 merged patches)."""
    return make_tiny_checkpoint(tmp_path_factory.mktemp("tiny_ckpt_untied"), size="debug", seed=0,
                                tie_word_embeddings=False, window_size=112).path
