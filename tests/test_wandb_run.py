"""Specification of the optional Weights & Biases logging (metrics.wandb): offline runs record the metrics, and
asking for it without wandb installed fails with a message saying how to install it."""

from __future__ import annotations

import sys

import pytest

from torchplex.components.metrics import MetricsLogger


def test_wandb_missing_fails_with_a_clear_message(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)  # import wandb -> ImportError
    with pytest.raises(ImportError, match=r"torchplex\[wandb\]"):
        MetricsLogger(tmp_path, tensorboard=False, wandb_project="p")


def test_wandb_is_not_imported_when_off(tmp_path, monkeypatch):
    monkeypatch.setitem(sys.modules, "wandb", None)
    MetricsLogger(tmp_path, tensorboard=False).close()  # no error: never imported


def test_wandb_offline_run_logs_the_step_metrics(tmp_path, monkeypatch):
    # wandb is an optional extra of the package and part of the dev extra the tests are run with
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    logger = MetricsLogger(tmp_path, tensorboard=False, wandb_project="torchplex-test", run_name="t",
                           config={"optimizer": {"lr": 1e-5}})
    logger.log(1, {"loss": 0.5, "eval/set/accuracy": 0.25, "note": "text"})
    logger.close()
    runs = list((tmp_path / "wandb").glob("offline-run-*"))
    assert len(runs) == 1 and list(runs[0].glob("*.wandb"))
