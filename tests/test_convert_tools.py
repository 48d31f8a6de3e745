"""tools/convert_hf_to_dcp.py and tools/convert_dcp_to_hf.py: HF -> DCP -> HF is bit-exact, keeps the
source's layout and non-weight files, loads in transformers, and bad checkpoints fail naming key and file."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from safetensors.torch import load_file, save_file
from transformers import Qwen2_5_VLForConditionalGeneration

from tools.convert_dcp_to_hf import convert_dcp_to_hf
from tools.convert_hf_to_dcp import convert_hf_to_dcp, read_native_state_dict
from tools.make_tiny_checkpoint import make_tiny_checkpoint
from torchplex.models.qwen2_5_vl.args import ModelArgs
from torchplex.models.qwen2_5_vl.state_dict_adapter import Qwen2_5_VLStateDictAdapter
from torchplex.models.qwen2_5_vl.weights import INDEX_FILE, SINGLE_FILE, CheckpointMismatchError

REPO_ROOT = Path(__file__).resolve().parents[1]


def hf_tensors(directory: Path) -> dict[str, torch.Tensor]:
    out: dict[str, torch.Tensor] = {}
    for path in sorted(directory.glob("*.safetensors")):
        out.update(load_file(path))
    return out


def non_weight_files(directory: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in directory.iterdir()
            if p.is_file() and not p.name.endswith((".safetensors", INDEX_FILE))}


def assert_bit_exact(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for key in a:
        assert a[key].dtype == b[key].dtype, key
        assert torch.equal(a[key], b[key]), key


@pytest.fixture(scope="module")
def sharded_ckpt(tmp_path_factory) -> Path:
    return make_tiny_checkpoint(tmp_path_factory.mktemp("sharded"), size="debug", seed=1,
                                tie_word_embeddings=False, max_shard_size="200KB").path


@pytest.fixture(scope="module")
def bf16_ckpt(tiny_ckpt, tmp_path_factory) -> Path:
    """tiny_ckpt with bf16 weights, as published checkpoints are stored."""
    out = tmp_path_factory.mktemp("bf16")
    shutil.copytree(tiny_ckpt, out, dirs_exist_ok=True)
    save_file({k: v.to(torch.bfloat16) for k, v in load_file(tiny_ckpt / SINGLE_FILE).items()},
              out / SINGLE_FILE, metadata={"format": "pt"})
    return out


@pytest.fixture(params=["tied_single", "untied_single", "untied_sharded", "bf16"])
def source(request) -> Path:
    name = {"tied_single": "tiny_ckpt", "untied_single": "tiny_ckpt_untied", "untied_sharded": "sharded_ckpt",
            "bf16": "bf16_ckpt"}[request.param]
    return request.getfixturevalue(name)


def test_round_trip_is_bit_exact(source, tmp_path):
    convert_hf_to_dcp(source, tmp_path / "dcp", progress=False)
    summary = convert_dcp_to_hf(tmp_path / "dcp", tmp_path / "hf", config_from=source, progress=False)
    assert_bit_exact(hf_tensors(tmp_path / "hf"), hf_tensors(source))
    assert summary.layout == "legacy"  # what save_pretrained writes
    assert (tmp_path / "hf" / INDEX_FILE).is_file() == (source / INDEX_FILE).is_file()


def test_dcp_holds_native_names_and_a_config_copy(tiny_ckpt_untied, tmp_path):
    summary = convert_hf_to_dcp(tiny_ckpt_untied, tmp_path, progress=False)
    metadata = dcp.FileSystemReader(str(tmp_path)).read_metadata()
    adapter = Qwen2_5_VLStateDictAdapter(ModelArgs.from_hf_dir(tiny_ckpt_untied))
    assert {k: tuple(m.size) for k, m in metadata.state_dict_metadata.items()} == adapter.expected_native_shapes()
    assert (tmp_path / "config.json").read_bytes() == (tiny_ckpt_untied / "config.json").read_bytes()
    assert summary.num_tensors == len(adapter.expected_native_shapes())


def test_non_weight_files_are_copied_from_config_source(tiny_ckpt, tmp_path):
    convert_hf_to_dcp(tiny_ckpt, tmp_path / "dcp", progress=False)
    summary = convert_dcp_to_hf(tmp_path / "dcp", tmp_path / "hf", config_from=tiny_ckpt, progress=False)
    expected = non_weight_files(tiny_ckpt)
    assert {"config.json", "tokenizer.json", "tokenizer_config.json", "preprocessor_config.json"} <= expected.keys()
    assert non_weight_files(tmp_path / "hf") == expected
    assert sorted(summary.copied) == sorted(expected)


@pytest.mark.parametrize("layout", ["legacy", "v5"])
def test_converted_checkpoint_loads_in_transformers(tiny_ckpt_untied, tmp_path, layout):
    convert_hf_to_dcp(tiny_ckpt_untied, tmp_path / "dcp", progress=False)
    convert_dcp_to_hf(tmp_path / "dcp", tmp_path / "hf", config_from=tiny_ckpt_untied, layout=layout, progress=False)
    prefix = "model.language_model." if layout == "v5" else "model.layers."
    assert any(k.startswith(prefix) for k in hf_tensors(tmp_path / "hf"))
    reference = Qwen2_5_VLForConditionalGeneration.from_pretrained(tiny_ckpt_untied)
    converted, info = Qwen2_5_VLForConditionalGeneration.from_pretrained(tmp_path / "hf", output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    assert_bit_exact(converted.state_dict(), reference.state_dict())


def test_layout_of_a_v5_source_is_kept(tiny_ckpt_untied, tmp_path):
    """A source in the transformers-5 in-memory layout converts back to that layout by default."""
    v5_source = tmp_path / "v5"
    convert_hf_to_dcp(tiny_ckpt_untied, tmp_path / "dcp", progress=False)
    convert_dcp_to_hf(tmp_path / "dcp", v5_source, config_from=tiny_ckpt_untied, layout="v5", progress=False)
    summary = convert_dcp_to_hf(tmp_path / "dcp", tmp_path / "hf", config_from=v5_source, progress=False)
    assert summary.layout == "v5"
    assert_bit_exact(hf_tensors(tmp_path / "hf"), hf_tensors(v5_source))


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_model_part_of_a_training_checkpoint_is_exported(tiny_ckpt_untied, tmp_path):
    """A training checkpoint nests {"model": ..., "optimizer": ...}; only the model part is exported."""
    native, _ = read_native_state_dict(tiny_ckpt_untied, progress=False)
    optimizer = {"state": {"norm.weight": {"exp_avg": torch.ones(128), "step": torch.tensor(3.0)}},
                 "param_groups": [{"lr": 1e-6, "params": ["norm.weight"]}]}
    dcp.save({"model": native, "optimizer": optimizer}, checkpoint_id=str(tmp_path / "step-3"), no_dist=True)
    convert_dcp_to_hf(tmp_path / "step-3", tmp_path / "hf", config_from=tiny_ckpt_untied, progress=False)
    assert_bit_exact(hf_tensors(tmp_path / "hf"), hf_tensors(tiny_ckpt_untied))


# ---- bad checkpoints ------------------------------------------------------------------------------
def broken_copy(src: Path, dst: Path, edit) -> Path:
    shutil.copytree(src, dst)
    tensors = load_file(dst / SINGLE_FILE)
    edit(tensors)
    save_file(tensors, dst / SINGLE_FILE)
    return dst / SINGLE_FILE


def test_missing_tensor_fails_naming_key_and_file(tiny_ckpt, tmp_path):
    path = broken_copy(tiny_ckpt, tmp_path / "hf", lambda t: t.pop("visual.blocks.1.attn.qkv.bias"))
    with pytest.raises(CheckpointMismatchError) as err:
        convert_hf_to_dcp(tmp_path / "hf", tmp_path / "dcp", progress=False)
    for part in ("visual.blocks.1.attn.qkv.bias", str(path)):
        assert part in str(err.value)
    assert not (tmp_path / "dcp").exists()  # nothing is written for a bad checkpoint


def test_unexpected_tensor_fails_naming_key_and_file(tiny_ckpt, tmp_path):
    path = broken_copy(tiny_ckpt, tmp_path / "hf", lambda t: t.update({"model.layers.7.post_attention_layernorm.weight":
                                                                        torch.ones(128)}))
    with pytest.raises(CheckpointMismatchError) as err:
        convert_hf_to_dcp(tmp_path / "hf", tmp_path / "dcp", progress=False)
    for part in ("model.layers.7.post_attention_layernorm.weight", "layers.7.ffn_norm.weight", str(path)):
        assert part in str(err.value)


def test_misshaped_tensor_fails_naming_keys_file_and_shapes(tiny_ckpt, tmp_path):
    args = ModelArgs.from_hf_dir(tiny_ckpt)
    rows = args.text.vocab_size
    path = broken_copy(tiny_ckpt, tmp_path / "hf",
                       lambda t: t.update({"model.embed_tokens.weight": torch.zeros(rows + 1, 128)}))
    with pytest.raises(CheckpointMismatchError) as err:
        convert_hf_to_dcp(tmp_path / "hf", tmp_path / "dcp", progress=False)
    for part in ("tok_embeddings.weight", "model.embed_tokens.weight", str(path), f"({rows}, 128)",
                 f"({rows + 1}, 128)"):
        assert part in str(err.value)


def test_dcp_with_another_geometry_fails_naming_the_key(tiny_ckpt, tiny_ckpt_untied, tmp_path):
    convert_hf_to_dcp(tiny_ckpt, tmp_path / "dcp", progress=False)  # tied: no output.weight
    with pytest.raises(CheckpointMismatchError, match="missing native 'output.weight'"):
        convert_dcp_to_hf(tmp_path / "dcp", tmp_path / "hf", config_from=tiny_ckpt_untied, progress=False)


# ---- command line -----------------------------------------------------------------------------------
def test_command_line_round_trip(tiny_ckpt, tmp_path):
    def run(*argv: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, *argv], cwd=REPO_ROOT, capture_output=True, text=True, check=True)

    to_dcp = run("tools/convert_hf_to_dcp.py", str(tiny_ckpt), str(tmp_path / "dcp"))
    to_hf = run("tools/convert_dcp_to_hf.py", str(tmp_path / "dcp"), str(tmp_path / "hf"),
                "--config-from", str(tiny_ckpt))
    assert "tensors" in to_dcp.stdout and str(tmp_path / "dcp") in to_dcp.stdout
    assert "reading HF tensors" in to_dcp.stderr and "writing HF tensors" in to_hf.stderr  # tqdm bars
    assert "legacy HF layout" in to_hf.stdout
    assert_bit_exact(hf_tensors(tmp_path / "hf"), hf_tensors(tiny_ckpt))
