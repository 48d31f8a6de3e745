"""Qwen2.5-VL weights straight between HF safetensors and (possibly sharded) native parameters.

Loading reads one tensor at a time with ``safetensors.safe_open`` and copies it into the parameter in
place, so no rank ever holds a second full copy of the model. For a DTensor parameter (FSDP2 / TP) each
rank reads only its own slice with ``get_slice``: the slice comes from DTensor's own local-shape/offset
rule, so uneven shards (``torch.chunk`` semantics: the last ranks get less, possibly nothing) line up
with what ``distribute_tensor`` would have produced.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import shutil
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file
from torch import nn
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from torchplex.models.qwen2_5_vl.args import ModelArgs
from torchplex.models.qwen2_5_vl.state_dict_adapter import Layout, Qwen2_5_VLStateDictAdapter

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


# Files of an HF folder that hold weights; everything else (config, tokenizer, processor, chat
# template, generation config, README...) belongs with any converted or exported copy of the weights.
_WEIGHT_SUFFIXES = (".safetensors", ".safetensors.index.json", ".bin", ".bin.index.json", ".pt", ".pth",
                    ".ckpt", ".h5", ".msgpack", ".gguf")


class CorruptCheckpointError(ValueError):
    """A safetensors file of the checkpoint cannot be read (truncated or corrupt); the message names the file."""


@contextlib.contextmanager
def _safe_open_named(path: Path, framework: str = "pt"):
    """`safe_open`, with its SafetensorError (a bare "incomplete metadata" or similar) naming the file, whether
    raised opening the header or reading a tensor inside the block."""
    try:
        with safe_open(path, framework=framework) as f:
            yield f
    except SafetensorError as err:
        raise CorruptCheckpointError(f"{path}: cannot read this safetensors file ({err}); it is truncated or "
                                     f"corrupt: download or convert it again") from None


class CheckpointMismatchError(ValueError):
    """The checkpoint's tensors do not match the model's parameters (missing, unexpected, mis-shaped)."""


# ---- reading an HF checkpoint folder ------------------------------------------------------------
@dataclass
class HFCheckpoint:
    """Which safetensors file holds each HF key of a checkpoint folder (single file or sharded)."""

    directory: Path
    weight_map: dict[str, Path]

    @classmethod
    def open(cls, hf_dir: str | os.PathLike) -> "HFCheckpoint":
        directory = Path(hf_dir)
        index_path, single_path = directory / INDEX_FILE, directory / SINGLE_FILE
        if index_path.is_file():
            with open(index_path) as f:
                index = json.load(f)
            if "weight_map" not in index:
                raise CheckpointMismatchError(f"{index_path} has no 'weight_map'")
            weight_map = {key: directory / name for key, name in index["weight_map"].items()}
            for path in sorted(set(weight_map.values())):
                if not path.is_file():
                    raise FileNotFoundError(f"shard {path} listed in {index_path} does not exist")
            return cls(directory, weight_map)
        if single_path.is_file():
            with _safe_open_named(single_path, framework="pt") as f:
                return cls(directory, {key: single_path for key in f.keys()})
        if not directory.is_dir():
            raise FileNotFoundError(f"HF checkpoint folder {directory} does not exist")
        raise FileNotFoundError(f"no {SINGLE_FILE} or {INDEX_FILE} in HF checkpoint folder {directory}")

    @property
    def expected_location(self) -> Path:
        """Where a tensor absent from the checkpoint should have been: the one file, or the index."""
        files = self.files
        return files[0] if len(files) == 1 and files[0].name == SINGLE_FILE else self.directory / INDEX_FILE

    @property
    def files(self) -> list[Path]:
        return sorted(set(self.weight_map.values()))

    def keys_by_file(self, keys: list[str] | None = None) -> dict[Path, list[str]]:
        """Keys grouped by the file holding them, so each file is opened once."""
        grouped: dict[Path, list[str]] = {}
        for key in self.weight_map if keys is None else keys:
            grouped.setdefault(self.weight_map[key], []).append(key)
        return grouped

    def header_shapes(self) -> dict[str, tuple[int, ...] | None]:
        """Shape of every tensor, read from the file headers only (no tensor data); None for a key the
        index lists but its file lacks."""
        shapes: dict[str, tuple[int, ...] | None] = {}
        for path, keys in self.keys_by_file().items():
            with _safe_open_named(path, framework="pt") as f:
                present = set(f.keys())
                for key in keys:
                    shapes[key] = tuple(f.get_slice(key).get_shape()) if key in present else None
        return shapes

    def iter_tensors(self) -> Iterator[tuple[str, Path, torch.Tensor]]:
        """(HF key, file, full tensor) for every tensor, one at a time, file by file."""
        for path, keys in self.keys_by_file().items():
            with _safe_open_named(path, framework="pt") as f:
                for key in keys:
                    yield key, path, f.get_tensor(key)


# ---- loading ------------------------------------------------------------------------------------
@dataclass
class LoadReport:
    """What ``load_hf_weights`` did; with ``strict=False`` the missing/unexpected lists may be non-empty."""

    hf_dir: Path
    layout: Layout
    loaded: list[str] = field(default_factory=list)        # native keys filled from the checkpoint
    missing: list[str] = field(default_factory=list)       # native keys the checkpoint lacks
    unexpected: list[str] = field(default_factory=list)    # HF keys with no parameter to go to
    skipped: list[str] = field(default_factory=list)       # HF keys dropped on purpose (tied lm_head)
    bytes_read: int = 0                                    # bytes this rank read from disk

    def summary(self) -> str:
        return (f"loaded {len(self.loaded)} tensors ({self.bytes_read / 2**20:.1f} MiB on this rank) from "
                f"{self.hf_dir} [{self.layout} layout]; missing {len(self.missing)}, unexpected "
                f"{len(self.unexpected)}, skipped {len(self.skipped)}")


# Name components that wrappers add around the native modules: torch.compile(model) and
# activation-checkpoint wrappers (whose own state-dict hook usually strips it already).
_WRAPPER_PARTS = ("_orig_mod", "_checkpoint_wrapped_module")


def native_state_dict(model: nn.Module, keep_vars: bool = False) -> dict[str, torch.Tensor]:
    """``model.state_dict()`` under native names, with wrapper name components removed."""
    return {".".join(part for part in name.split(".") if part not in _WRAPPER_PARTS): value
            for name, value in model.state_dict(keep_vars=keep_vars).items()}


def _resolve_adapter(model: nn.Module | None, hf_dir: Path | None,
                     adapter: Qwen2_5_VLStateDictAdapter | None) -> Qwen2_5_VLStateDictAdapter:
    if adapter is not None:
        return adapter
    args = getattr(model, "args", None) or getattr(getattr(model, "_orig_mod", None), "args", None)
    if isinstance(args, ModelArgs):
        return Qwen2_5_VLStateDictAdapter(args)
    if hf_dir is not None:
        return Qwen2_5_VLStateDictAdapter(ModelArgs.from_hf_dir(hf_dir))
    raise ValueError("pass adapter=Qwen2_5_VLStateDictAdapter(args): it cannot be inferred here")


def _is_plain_sharding(dtensor: DTensor) -> bool:
    """True when every placement is an even-or-uneven contiguous Shard or a Replicate, i.e. the local
    tensor is one rectangular block of the global tensor (not so for _StridedShard or Partial)."""
    return all(type(p) is Shard or isinstance(p, Replicate) for p in dtensor.placements)


def _read_into(param: torch.Tensor, f, hf_key: str) -> int:
    """Copy tensor ``hf_key`` of open file ``f`` into ``param`` (this rank's part only). Returns bytes read."""
    if isinstance(param, DTensor):
        local = param.to_local()
        if _is_plain_sharding(param):
            local_shape, offset = compute_local_shape_and_global_offset(
                param.shape, param.device_mesh, param.placements)
            if math.prod(local_shape) == 0:     # an uneven shard can be empty on the last ranks
                return 0
            index = tuple(slice(o, o + n) for o, n in zip(offset, local_shape))
            block = f.get_slice(hf_key)[index]
        else:   # rare layouts: read it all, keep this rank's part without communicating
            full = f.get_tensor(hf_key)
            block = distribute_tensor(full.to(local.device), param.device_mesh, param.placements,
                                      src_data_rank=None).to_local()
            local.copy_(block)
            return full.numel() * full.element_size()
        local.copy_(block)
    else:
        block = f.get_tensor(hf_key)
        param.copy_(block)
    return block.numel() * block.element_size()


def _materialised_params(model: nn.Module) -> dict[str, torch.Tensor]:
    """The model's Parameters themselves (keep_vars: not detached copies, so copy_ writes into the model) under
    native names; refuses a parameter still on the meta device."""
    params = native_state_dict(model, keep_vars=True)
    for name, p in params.items():
        if p.is_meta:
            raise RuntimeError(f"parameter {name!r} is on the meta device; materialise the model "
                               f"(model.to_empty(device=...)) before loading weights")
    return params


def _match_keys(checkpoint: HFCheckpoint, adapter: Qwen2_5_VLStateDictAdapter, params: Mapping[str, torch.Tensor],
                report: LoadReport) -> dict[str, str]:
    """The HF key of each native parameter the checkpoint has; records skipped, unexpected and missing keys."""
    hf_key_of: dict[str, str] = {}
    for hf_key in checkpoint.weight_map:
        if adapter.is_dropped_hf_key(hf_key):
            report.skipped.append(hf_key)
            continue
        native = _native_or_none(adapter, hf_key)
        if native in params:
            hf_key_of[native] = hf_key
        else:
            report.unexpected.append(hf_key)
    report.missing = [name for name in params if name not in hf_key_of]
    return hf_key_of


def _check_against_headers(checkpoint: HFCheckpoint, adapter: Qwen2_5_VLStateDictAdapter,
                           params: Mapping[str, torch.Tensor], hf_key_of: Mapping[str, str], report: LoadReport,
                           strict: bool) -> None:
    """Raise one CheckpointMismatchError listing every problem, from the file headers alone, before any parameter
    is touched: a failed load leaves the model as it was. Missing and unexpected keys count only when `strict`."""
    problems = []
    if strict:
        for name in report.missing:
            problems.append(f"missing: native {name!r} (HF {_hf_or_none(adapter, name, report.layout)!r}, expected "
                            f"in {checkpoint.expected_location}) shape {tuple(params[name].shape)} not found")
        for hf_key in report.unexpected:
            problems.append(f"unexpected: HF {hf_key!r} in {checkpoint.weight_map[hf_key]} (native "
                            f"{_native_or_none(adapter, hf_key)!r}) has no parameter in the model")
    shapes = checkpoint.header_shapes()
    for name, hf_key in hf_key_of.items():
        path, found, expected = checkpoint.weight_map[hf_key], shapes[hf_key], tuple(params[name].shape)
        if found is None:
            problems.append(f"missing: native {name!r} (HF {hf_key!r}) is listed in {INDEX_FILE} but absent "
                            f"from {path}")
        elif found != expected:
            problems.append(f"shape mismatch: native {name!r} (HF {hf_key!r} in {path}): model expects "
                            f"{expected}, checkpoint has {found}")
    if problems:
        raise CheckpointMismatchError(f"checkpoint {checkpoint.directory} does not match the model:\n  "
                                      + "\n  ".join(problems))


def _copy_tensors(checkpoint: HFCheckpoint, params: Mapping[str, torch.Tensor], hf_key_of: Mapping[str, str],
                  report: LoadReport) -> None:
    """Copy each matched tensor into its parameter (this rank's part), opening each file once."""
    native_of = {hf_key: name for name, hf_key in hf_key_of.items()}
    by_file = checkpoint.keys_by_file([hf_key_of[name] for name in params if name in hf_key_of])
    with torch.no_grad():
        for path, hf_keys in by_file.items():
            with _safe_open_named(path, framework="pt") as f:
                for hf_key in hf_keys:
                    report.bytes_read += _read_into(params[native_of[hf_key]], f, hf_key)
                    report.loaded.append(native_of[hf_key])


def load_hf_weights(model: nn.Module, hf_dir: str | os.PathLike,
                    adapter: Qwen2_5_VLStateDictAdapter | None = None, strict: bool = True) -> LoadReport:
    """Fill ``model``'s parameters (native names, plain tensors or DTensors, any device) in place from
    the HF safetensors checkpoint in ``hf_dir``, casting to each parameter's dtype.

    Raises CheckpointMismatchError for a mis-shaped tensor always, and for missing or unexpected
    tensors when ``strict``; each message names the native key, the HF key and the file.
    """
    checkpoint = HFCheckpoint.open(hf_dir)
    adapter = _resolve_adapter(model, checkpoint.directory, adapter)
    report = LoadReport(hf_dir=checkpoint.directory, layout=adapter.detect_layout(checkpoint.weight_map))
    params = _materialised_params(model)
    hf_key_of = _match_keys(checkpoint, adapter, params, report)
    _check_against_headers(checkpoint, adapter, params, hf_key_of, report, strict)
    _copy_tensors(checkpoint, params, hf_key_of, report)
    return report


def _native_or_none(adapter: Qwen2_5_VLStateDictAdapter, hf_key: str) -> str | None:
    try:
        return adapter.hf_to_native_key(hf_key)
    except KeyError:
        return None


def _hf_or_none(adapter: Qwen2_5_VLStateDictAdapter, native: str, layout: Layout) -> str | None:
    try:
        return adapter.native_to_hf_key(native, layout)
    except KeyError:
        return None


# ---- saving -------------------------------------------------------------------------------------
def plan_shards(sizes: Mapping[str, int], max_shard_bytes: int | None) -> list[list[str]]:
    """Greedy packing of keys (in order) into files of at most ``max_shard_bytes`` each (None: one
    file); a tensor larger than the limit gets a file of its own."""
    if max_shard_bytes is None:
        return [list(sizes)]
    shards: list[list[str]] = [[]]
    used = 0
    for key, size in sizes.items():
        if shards[-1] and used + size > max_shard_bytes:
            shards.append([])
            used = 0
        shards[-1].append(key)
        used += size
    return shards


def shard_file_names(num_shards: int) -> list[str]:
    """transformers' file names: ``model.safetensors`` alone, else ``model-0000i-of-0000n.safetensors``."""
    if num_shards == 1:
        return [SINGLE_FILE]
    return [f"model-{i + 1:05d}-of-{num_shards:05d}.safetensors" for i in range(num_shards)]


def finish_hf_weights(out: Path, weight_map: Mapping[str, str], total_bytes: int) -> None:
    """Write the index when there is more than one file and delete weight files of an earlier save into
    the same folder: a leftover index or shard would otherwise be read instead of the new weights."""
    files = set(weight_map.values())
    for path in list(out.glob("model*.safetensors")) + [out / INDEX_FILE]:
        if path.name not in files and path.is_file():
            path.unlink()
    if len(files) > 1:
        index = {"metadata": {"total_size": total_bytes}, "weight_map": dict(sorted(weight_map.items()))}
        with open(out / INDEX_FILE, "w") as f:
            json.dump(index, f, indent=2)
            f.write("\n")


def nbytes(t: torch.Tensor) -> int:
    """Bytes of the full (global, for a DTensor) tensor."""
    return math.prod(t.shape) * t.element_size()


def save_safetensors(tensors: Mapping[str, torch.Tensor], path: str | os.PathLike,
                     metadata: dict[str, str] | None = None) -> None:
    """safetensors' `save_file`, the file then given the mode any new file gets (0666 less the umask): safetensors
    writes through a private temporary file, which left exported weights readable by their owner only (0600)."""
    save_file(tensors, str(path), metadata=metadata)
    os.chmod(path, 0o666 & ~_umask())


def _umask() -> int:
    """The process's umask, read without changing it where Linux tells it (os.umask can only set it, and setting it
    for a moment would race with files other threads create)."""
    try:
        with open("/proc/self/status") as status:
            return next(int(line.split()[1], 8) for line in status if line.startswith("Umask:"))
    except (OSError, StopIteration, ValueError):
        umask = os.umask(0o022)
        os.umask(umask)
        return umask


def save_hf_weights(model_or_state_dict: nn.Module | Mapping[str, torch.Tensor], out_dir: str | os.PathLike,
                    layout: Layout = "legacy", max_shard_bytes: int | None = None,
                    adapter: Qwen2_5_VLStateDictAdapter | None = None) -> dict[str, str]:
    """Write native weights as HF safetensors in ``layout`` (one file, or shards of at most
    ``max_shard_bytes`` plus ``model.safetensors.index.json``). Returns the HF key -> file name map.

    DTensors are gathered one output file at a time with ``full_tensor()``, so in a distributed job
    every rank must call this (the gathers are collectives); only global rank 0 writes.
    """
    if isinstance(model_or_state_dict, nn.Module):
        adapter = _resolve_adapter(model_or_state_dict, None, adapter)
        native = native_state_dict(model_or_state_dict)
    else:
        if adapter is None:
            raise ValueError("save_hf_weights of a plain state dict needs adapter=Qwen2_5_VLStateDictAdapter(args)")
        native = dict(model_or_state_dict)
    hf = dict(sorted(adapter.to_hf(native, layout).items()))
    writer = not (dist.is_available() and dist.is_initialized()) or dist.get_rank() == 0

    out = Path(out_dir)
    if writer:
        out.mkdir(parents=True, exist_ok=True)
    shards = plan_shards({k: nbytes(t) for k, t in hf.items()}, max_shard_bytes)
    weight_map: dict[str, str] = {}
    for name, keys in zip(shard_file_names(len(shards)), shards):
        tensors = {}
        for key in keys:
            t = hf[key].detach()
            if isinstance(t, DTensor):
                t = t.full_tensor()
            if writer:
                tensors[key] = t.to("cpu").contiguous()
            weight_map[key] = name
        if writer:
            save_safetensors(tensors, out / name, metadata={"format": "pt"})
        del tensors
    if writer:
        finish_hf_weights(out, weight_map, sum(nbytes(t) for t in hf.values()))
    return weight_map


def copy_non_weight_files(src: str | os.PathLike, dst: str | os.PathLike) -> list[str]:
    """Copy config, tokenizer, processor and template files (top level, not hidden, not weights) of HF
    folder ``src`` into ``dst``, so saved weights become a loadable checkpoint. Returns the names."""
    src, dst = Path(src), Path(dst)
    dst.mkdir(parents=True, exist_ok=True)
    copied = []
    for path in sorted(src.iterdir()):
        if path.is_file() and not path.name.startswith(".") and not path.name.endswith(_WEIGHT_SUFFIXES):
            shutil.copy(path, dst / path.name)
            copied.append(path.name)
    return copied
