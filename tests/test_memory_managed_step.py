"""A trainer step under the phase-aware memory manager, with real offload copies and frees (CPU), gives exactly
the numbers of the unmanaged step: nothing is read while its storage is away."""

import json

import torch

from torchplex.config import load_config
from torchplex.runtime import memory
from torchplex.train import Trainer


def run(tmp_path, tiny_ckpt, name, managed):
    torch.manual_seed(0)
    cfg = load_config([
        f"--model.hf_checkpoint={tiny_ckpt}", f"--job.output_dir={tmp_path}", f"--job.name={name}",
        f"--data.synthetic_dir={tmp_path / 'synth'}", "--data.synthetic_train=16", "--data.synthetic_eval=4",
        "--data.prompts_per_step=2", "--rollout.n_samples=2", "--rollout.max_new_tokens=6",
        "--algorithm.kl_coef=0.05", "--training.steps=2", "--metrics.eval_interval=0", "--metrics.tensorboard=false",
        "--metrics.progress_bar=false", "--runtime.mode=decomposed", f"--memory.managed={managed}",
        "--reward.functions=format", "--reward.weights=1.0"])
    trainer = Trainer(cfg)
    trainer.train()
    rows = [json.loads(line) for line in (tmp_path / name / "metrics.jsonl").read_text().splitlines()]
    return trainer, rows


def test_managed_step_equals_unmanaged_step(tmp_path, tiny_ckpt, monkeypatch):
    moved = []

    def copy(dst, src):
        moved.append(src.numel())
        dst.copy_(src)

    # real copies to host buffers and real frees of the device storage, on a worker thread
    monkeypatch.setattr(memory, "default_copy_engine", lambda device: memory.ThreadCopyEngine(copy))
    managed, managed_rows = run(tmp_path, tiny_ckpt, "managed", True)
    _, plain_rows = run(tmp_path, tiny_ckpt, "plain", False)
    for a, b in zip(managed_rows, plain_rows):
        for key in ("loss", "kl", "grad_norm", "reward/mean"):
            if key in b:
                assert a[key] == b[key], key
    assert moved, "the reference weights and optimizer state must really have moved"
    phases = [r.phase for r in managed.residency.records]
    assert phases == ["rollout", "ref", "train"] * 2
    assert "memory/ref_plan_gib" in managed_rows[-1]
    saved = json.loads((tmp_path / "managed" / "memory_measured.json").read_text())
    assert len(saved["measured"]) == 6
    # the reference is away after its phase (offloaded), back on the device only inside "ref"
    assert all(p.untyped_storage().nbytes() == 0 for p in managed.reference.parameters())
