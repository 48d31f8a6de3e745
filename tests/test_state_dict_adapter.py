"""HF <-> native Qwen2.5-VL names, and loading/saving safetensors into (sharded) native parameters.

The reference everywhere is transformers itself: its in-memory state dict (v5 layout), what its
``save_pretrained`` writes (legacy layout), and what ``from_pretrained`` reads back.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

from torchplex.models.qwen2_5_vl.args import ModelArgs, get_flavor
from torchplex.models.qwen2_5_vl.model import Qwen2_5_VLModel
from torchplex.models.qwen2_5_vl.state_dict_adapter import Qwen2_5_VLStateDictAdapter
from torchplex.models.qwen2_5_vl.weights import (
    INDEX_FILE, SINGLE_FILE, CheckpointMismatchError, load_hf_weights, save_hf_weights)


def tiny_args(tie: bool, vocab_size: int = 2048) -> ModelArgs:
    args = get_flavor("debug").with_token_ids(image_token_id=10, video_token_id=11, vision_start_token_id=12,
                                              vision_end_token_id=13, bos_token_id=14, eos_token_id=15)
    args.text.tie_word_embeddings = tie
    args.text.vocab_size = vocab_size
    return args


def hf_model(args: ModelArgs, seed: int = 0) -> Qwen2_5_VLForConditionalGeneration:
    torch.manual_seed(seed)
    model = Qwen2_5_VLForConditionalGeneration(Qwen2_5_VLConfig(**args.to_hf_config()))
    with torch.no_grad():  # HF init leaves norms at 1 and biases at 0: perturb so every tensor is distinct
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    return model


def saved_checkpoint(model, directory: Path, **save_kwargs) -> Path:
    model.save_pretrained(directory, **save_kwargs)
    return directory


def checkpoint_tensors(directory: Path) -> dict[str, torch.Tensor]:
    out = {}
    for path in sorted(directory.glob("*.safetensors")):
        out.update(load_file(path))
    return out


@pytest.fixture(scope="module", params=[True, False], ids=["tied", "untied"])
def hf_pair(request, tmp_path_factory):
    """(args, transformers model, folder written by its save_pretrained)."""
    args = tiny_args(tie=request.param)
    model = hf_model(args)
    return args, model, saved_checkpoint(model, tmp_path_factory.mktemp("hf"))


# ---- key mapping ---------------------------------------------------------------------------------
def test_every_in_memory_v5_key_maps_to_native_and_back(hf_pair):
    args, model, _ = hf_pair
    adapter = Qwen2_5_VLStateDictAdapter(args)
    for hf_key in model.state_dict():
        native = adapter.hf_to_native_key(hf_key)
        if hf_key == "lm_head.weight" and args.text.tie_word_embeddings:
            assert native is None
        else:
            assert adapter.native_to_hf_key(native, "v5") == hf_key


def test_every_saved_legacy_key_maps_to_native_and_back(hf_pair):
    args, _, directory = hf_pair
    adapter = Qwen2_5_VLStateDictAdapter(args)
    with safe_open(directory / SINGLE_FILE, framework="pt") as f:
        saved = list(f.keys())
    for hf_key in saved:
        assert adapter.native_to_hf_key(adapter.hf_to_native_key(hf_key), "legacy") == hf_key


def test_native_names_and_shapes_are_those_of_the_native_model(hf_pair):
    args, model, _ = hf_pair
    adapter = Qwen2_5_VLStateDictAdapter(args)
    with torch.device("meta"):
        native_model = Qwen2_5_VLModel(args)
    model_shapes = {k: tuple(v.shape) for k, v in native_model.state_dict().items()}
    from_hf_shapes = {k: tuple(v.shape) for k, v in adapter.from_hf(model.state_dict()).items()}
    assert from_hf_shapes == model_shapes
    assert adapter.expected_native_shapes() == model_shapes


def test_both_layouts_give_the_same_native_tensors(hf_pair):
    args, model, directory = hf_pair
    adapter = Qwen2_5_VLStateDictAdapter(args)
    from_v5 = adapter.from_hf(model.state_dict())
    from_legacy = adapter.from_hf(checkpoint_tensors(directory))
    assert from_v5.keys() == from_legacy.keys()
    for key in from_v5:
        assert torch.equal(from_v5[key], from_legacy[key]), key


def test_to_hf_writes_exactly_the_keys_transformers_saves(hf_pair):
    """Tied: no lm_head.weight (save_pretrained drops it); untied: lm_head.weight present."""
    args, model, directory = hf_pair
    adapter = Qwen2_5_VLStateDictAdapter(args)
    native = adapter.from_hf(model.state_dict())
    assert adapter.to_hf(native, "legacy").keys() == checkpoint_tensors(directory).keys()
    assert ("lm_head.weight" in adapter.to_hf(native, "v5")) == (not args.text.tie_word_embeddings)


def test_renames_do_not_touch_tensors(hf_pair):
    args, model, _ = hf_pair
    adapter = Qwen2_5_VLStateDictAdapter(args)
    hf = model.state_dict()
    native = adapter.from_hf(hf)
    back = adapter.to_hf(native, "v5")
    assert all(back[k] is hf[k] for k in back)
    assert native["visual.patch_embed.weight"].dim() == 5  # Conv3d weight keeps its shape


def test_detect_layout(hf_pair):
    _, model, directory = hf_pair
    detect = Qwen2_5_VLStateDictAdapter.detect_layout
    assert detect(model.state_dict()) == "v5"
    assert detect(checkpoint_tensors(directory)) == "legacy"
    with pytest.raises(ValueError, match="mixes"):
        detect(["visual.merger.ln_q.weight", "model.language_model.norm.weight"])
    with pytest.raises(ValueError, match="cannot tell"):
        detect(["lm_head.weight"])


def test_unknown_keys_raise_naming_the_key():
    adapter = Qwen2_5_VLStateDictAdapter(tiny_args(tie=False))
    with pytest.raises(KeyError, match="model.layers.0.self_attn.rotary.weight"):
        adapter.hf_to_native_key("model.layers.0.self_attn.rotary.weight")
    with pytest.raises(KeyError, match="layers.0.attention.wx.weight"):
        adapter.native_to_hf_key("layers.0.attention.wx.weight")


def test_to_hf_rejects_a_head_that_contradicts_tying():
    tied, untied = Qwen2_5_VLStateDictAdapter(tiny_args(True)), Qwen2_5_VLStateDictAdapter(tiny_args(False))
    with pytest.raises(ValueError, match="output.weight"):
        tied.to_hf({"output.weight": torch.zeros(1)})
    with pytest.raises(KeyError, match="output.weight"):
        untied.to_hf({"norm.weight": torch.zeros(1)})


# ---- loading into the native model ---------------------------------------------------------------
def test_load_into_native_model_matches_transformers_tensors(hf_pair):
    args, model, directory = hf_pair
    native_model = Qwen2_5_VLModel(args)
    report = load_hf_weights(native_model, directory)
    expected = Qwen2_5_VLStateDictAdapter(args).from_hf(model.state_dict())
    loaded = native_model.state_dict()
    assert loaded.keys() == expected.keys()
    for key in expected:
        assert torch.equal(loaded[key], expected[key]), key
    assert sorted(report.loaded) == sorted(expected)
    assert report.skipped == []  # save_pretrained already dropped a tied lm_head
    assert report.layout == "legacy"


def test_load_and_save_see_through_torch_compile(hf_pair, tmp_path):
    args, model, directory = hf_pair
    compiled = torch.compile(Qwen2_5_VLModel(args))  # state dict keys gain "_orig_mod."; never run here
    load_hf_weights(compiled, directory)
    save_hf_weights(compiled, tmp_path)
    saved, original = checkpoint_tensors(tmp_path), checkpoint_tensors(directory)
    assert saved.keys() == original.keys()
    assert all(torch.equal(saved[k], original[k]) for k in original)


def test_load_casts_to_parameter_dtype(tmp_path):
    args = tiny_args(tie=True)
    model = hf_model(args).to(torch.bfloat16)
    model.save_pretrained(tmp_path)
    native_model = Qwen2_5_VLModel(args)  # fp32 parameters
    load_hf_weights(native_model, tmp_path)
    expected = Qwen2_5_VLStateDictAdapter(args).from_hf(model.state_dict())
    for key, value in native_model.state_dict().items():
        assert value.dtype == torch.float32
        assert torch.equal(value, expected[key].float()), key  # bf16 -> fp32 is exact


def test_load_from_v5_layout_and_tied_lm_head_is_skipped(tmp_path):
    """A checkpoint holding the in-memory transformers-5 dict, lm_head.weight included although tied."""
    args = tiny_args(tie=True)
    model = hf_model(args)
    save_file({k: v.contiguous().clone() for k, v in model.state_dict().items()}, tmp_path / SINGLE_FILE)
    native_model = Qwen2_5_VLModel(args)
    report = load_hf_weights(native_model, tmp_path, adapter=Qwen2_5_VLStateDictAdapter(args))
    assert report.layout == "v5" and report.skipped == ["lm_head.weight"]
    assert torch.equal(native_model.tok_embeddings.weight, model.model.language_model.embed_tokens.weight)


def _rewrite(directory: Path, edit) -> Path:
    tensors = load_file(directory / SINGLE_FILE)
    edit(tensors)
    save_file(tensors, directory / SINGLE_FILE)
    return directory / SINGLE_FILE


@pytest.fixture
def untied_checkpoint(tmp_path):
    args = tiny_args(tie=False)
    return args, saved_checkpoint(hf_model(args), tmp_path)


def test_missing_tensor_names_native_key_hf_key_and_file(untied_checkpoint):
    args, directory = untied_checkpoint
    path = _rewrite(directory, lambda t: t.pop("model.layers.2.mlp.up_proj.weight"))
    with pytest.raises(CheckpointMismatchError) as err:
        load_hf_weights(Qwen2_5_VLModel(args), directory)
    for part in ("layers.2.feed_forward.w3.weight", "model.layers.2.mlp.up_proj.weight", str(path)):
        assert part in str(err.value)


def test_unexpected_tensor_names_hf_key_and_file(untied_checkpoint):
    args, directory = untied_checkpoint
    path = _rewrite(directory, lambda t: t.update({"model.layers.9.input_layernorm.weight": torch.ones(128)}))
    with pytest.raises(CheckpointMismatchError) as err:
        load_hf_weights(Qwen2_5_VLModel(args), directory)
    for part in ("model.layers.9.input_layernorm.weight", "layers.9.attention_norm.weight", str(path)):
        assert part in str(err.value)


def test_non_strict_load_reports_missing_and_unexpected(untied_checkpoint):
    args, directory = untied_checkpoint

    def edit(t):
        t.pop("lm_head.weight")
        t["visual.blocks.0.mlp.extra.weight"] = torch.ones(2)
    _rewrite(directory, edit)
    report = load_hf_weights(Qwen2_5_VLModel(args), directory, strict=False)
    assert report.missing == ["output.weight"]
    assert report.unexpected == ["visual.blocks.0.mlp.extra.weight"]


def test_misshaped_tensor_names_keys_file_and_both_shapes(untied_checkpoint):
    args, directory = untied_checkpoint
    path = _rewrite(directory, lambda t: t.update({"visual.merger.mlp.2.weight": torch.zeros(128, 255)}))
    native_model = Qwen2_5_VLModel(args)
    # defined values: the patch embedding is made with torch.empty (init_weights fills it), and uninitialised memory
    # that holds a NaN would compare unequal to itself (CI failed so on 2026-12-02)
    native_model.init_weights(generator=torch.Generator().manual_seed(0))
    before = {k: v.clone() for k, v in native_model.state_dict().items()}
    with pytest.raises(CheckpointMismatchError) as err:
        load_hf_weights(native_model, directory, strict=False)  # shapes are checked even then
    for part in ("visual.merger.fc2.weight", "visual.merger.mlp.2.weight", str(path), "(128, 256)", "(128, 255)"):
        assert part in str(err.value)
    assert all(torch.equal(v, before[k]) for k, v in native_model.state_dict().items())  # untouched


def test_tensor_listed_in_index_but_absent_from_its_shard_names_the_shard(tmp_path):
    args = tiny_args(tie=True)
    hf_model(args).save_pretrained(tmp_path, max_shard_size="300KB")
    shard = sorted(tmp_path.glob("model-*.safetensors"))[0]
    tensors = load_file(shard)
    dropped = sorted(tensors)[0]
    del tensors[dropped]
    save_file(tensors, shard)
    with pytest.raises(CheckpointMismatchError) as err:
        load_hf_weights(Qwen2_5_VLModel(args), tmp_path)
    assert dropped in str(err.value) and str(shard) in str(err.value)


def test_missing_shard_and_missing_weights_name_the_path(tmp_path):
    args = tiny_args(tie=True)
    hf_model(args).save_pretrained(tmp_path / "sharded", max_shard_size="300KB")
    shard = sorted((tmp_path / "sharded").glob("model-*.safetensors"))[1]
    shard.unlink()
    with pytest.raises(FileNotFoundError, match=str(shard)):
        load_hf_weights(Qwen2_5_VLModel(args), tmp_path / "sharded")
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match=str(tmp_path / "empty")):
        load_hf_weights(Qwen2_5_VLModel(args), tmp_path / "empty", adapter=Qwen2_5_VLStateDictAdapter(args))


# ---- saving ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("max_shard_bytes", [None, 300_000], ids=["single", "sharded"])
def test_saved_weights_load_in_transformers_unchanged(tmp_path, max_shard_bytes):
    args = tiny_args(tie=False)
    reference = hf_model(args)
    native_model = Qwen2_5_VLModel(args)
    native_model.load_state_dict(Qwen2_5_VLStateDictAdapter(args).from_hf(reference.state_dict()))
    weight_map = save_hf_weights(native_model, tmp_path, max_shard_bytes=max_shard_bytes)
    assert (tmp_path / INDEX_FILE).is_file() == (max_shard_bytes is not None)
    assert len(set(weight_map.values())) == (1 if max_shard_bytes is None else len(list(tmp_path.glob("model-*"))))

    Qwen2_5_VLConfig(**args.to_hf_config()).save_pretrained(tmp_path)
    reloaded, info = Qwen2_5_VLForConditionalGeneration.from_pretrained(tmp_path, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"]
    for key, value in reference.state_dict().items():
        assert torch.equal(reloaded.state_dict()[key], value), key


def test_save_removes_stale_shards_of_an_earlier_save(tmp_path):
    args = tiny_args(tie=True)
    native_model = Qwen2_5_VLModel(args)
    native_model.init_weights(generator=torch.Generator().manual_seed(0))
    save_hf_weights(native_model, tmp_path, max_shard_bytes=300_000)
    save_hf_weights(native_model, tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == [SINGLE_FILE]


def test_saved_weight_files_get_the_mode_of_any_new_file(tmp_path):
    """Issue 47, defect 11: exported safetensors were written mode 0600 (safetensors' private temporary file), so
    others sharing the run folder could not read the exported model; every file gets 0666 less the umask, as the
    config and tokenizer files beside it."""
    import os
    import stat

    from torchplex.components.checkpoint import save_model_only

    native_model = Qwen2_5_VLModel(tiny_args(tie=True))
    umask = os.umask(0o022)
    try:
        save_hf_weights(native_model, tmp_path / "hf", max_shard_bytes=300_000)
        save_model_only(tmp_path / "model.safetensors", native_model)
        (tmp_path / "hf" / "config.json").write_text("{}")
    finally:
        os.umask(umask)
    files = [*(tmp_path / "hf").glob("*.safetensors"), tmp_path / "model.safetensors", tmp_path / "hf" / "config.json"]
    assert len(files) > 3 and {stat.S_IMODE(p.stat().st_mode) for p in files} == {0o644}


# ---- sharded (DTensor) loading, 2 processes --------------------------------------------------------
def _sharded_load_worker(rank: int, directory: str, store: str, results: str) -> None:
    """FSDP2 (Shard(0), uneven on the odd vocab) and TP-like placements (Shard(1) / Replicate)."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    mesh = init_device_mesh("cpu", (2,))
    args = ModelArgs.from_hf_dir(directory)
    full = Qwen2_5_VLStateDictAdapter(args).from_hf(checkpoint_tensors(Path(directory)))
    out = {}

    fsdp_model = Qwen2_5_VLModel(args)
    for layer in fsdp_model.layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(fsdp_model, mesh=mesh)
    report = load_hf_weights(fsdp_model, directory)
    out["fsdp"] = {k: (v.to_local().clone(), v.placements) for k, v in fsdp_model.state_dict().items()}
    out["fsdp_bytes_read"] = report.bytes_read
    save_hf_weights(fsdp_model, f"{results}.saved")  # collective gathers on both ranks, rank 0 writes

    tp_model = Qwen2_5_VLModel(args)
    for module in tp_model.modules():
        for name, p in list(module._parameters.items()):
            if p is not None:
                placement = Shard(1) if p.dim() >= 2 else Replicate()
                module._parameters[name] = torch.nn.Parameter(distribute_tensor(p.detach(), mesh, [placement]))
    report = load_hf_weights(tp_model, directory)
    out["tp"] = {k: (v.to_local().clone(), v.placements) for k, v in tp_model.state_dict().items()}
    out["tp_bytes_read"] = report.bytes_read
    out["gathered_equal"] = all(torch.equal(v.full_tensor(), full[k]) for k, v in tp_model.state_dict().items()
                                if isinstance(v, DTensor))
    torch.save(out, f"{results}.{rank}")
    dist.destroy_process_group()


@pytest.mark.slow
def test_dtensor_load_reads_only_each_ranks_slice_and_save_gathers(tmp_path):
    args = tiny_args(tie=False, vocab_size=2047)  # odd: Shard(0) of the vocab is uneven (1024 / 1023 rows)
    directory = saved_checkpoint(hf_model(args), tmp_path / "hf")
    full = Qwen2_5_VLStateDictAdapter(args).from_hf(checkpoint_tensors(directory))
    total_bytes = sum(t.numel() * t.element_size() for t in full.values())
    mp.spawn(_sharded_load_worker, args=(str(directory), str(tmp_path / "store"), str(tmp_path / "out")),
             nprocs=2, join=True)

    fsdp_read = tp_read = 0
    for rank in range(2):
        out = torch.load(f"{tmp_path / 'out'}.{rank}", weights_only=False)
        local_bytes = {"fsdp": 0, "tp": 0}
        for mode in ("fsdp", "tp"):
            assert out[mode].keys() == full.keys()
            for key, (local, placements) in out[mode].items():
                (placement,) = placements
                if placement.is_shard():  # torch.chunk is DTensor's (and FSDP2's) uneven rule
                    chunks = torch.chunk(full[key], 2, dim=placement.dim)
                    expected = chunks[rank] if rank < len(chunks) else full[key].narrow(placement.dim, 0, 0)
                else:
                    expected = full[key]
                assert torch.equal(local, expected), (mode, key, rank)
                local_bytes[mode] += local.numel() * local.element_size()
        assert out["fsdp_bytes_read"] == local_bytes["fsdp"]
        assert out["tp_bytes_read"] == local_bytes["tp"]
        assert out["gathered_equal"]
        fsdp_read += out["fsdp_bytes_read"]
        tp_read += out["tp_bytes_read"]
    assert fsdp_read == total_bytes  # Shard(0) everywhere: the two ranks together read the model once
    assert total_bytes < tp_read < 2 * total_bytes  # only replicated norms/biases are read twice
    assert full["tok_embeddings.weight"].shape[0] == 2047
    saved = checkpoint_tensors(Path(f"{tmp_path / 'out'}.saved"))
    assert saved.keys() == checkpoint_tensors(directory).keys()
    assert all(torch.equal(saved[k], v) for k, v in checkpoint_tensors(directory).items())
