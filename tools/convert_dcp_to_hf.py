"""Convert a torch.distributed.checkpoint (DCP) folder of native Qwen2.5-VL weights back to HF safetensors.

    python tools/convert_dcp_to_hf.py DCP_DIR HF_DIR --config-from SRC_HF_DIR [--layout legacy|v5]

SRC_HF_DIR is the HF checkpoint the weights came from (or any with the same geometry): its
config.json, tokenizer, processor and chat-template files are copied to HF_DIR, its key layout is
reused (override with --layout) and, when it is sharded, so is its shard size. Weights are streamed
one output file at a time, so memory stays near one shard rather than the whole model.

DCP_DIR is either what convert_hf_to_dcp.py wrote (a bare native state dict) or a torchplex
training checkpoint (`step-N/`, whose "model" part is exported; optimizer state is ignored).
"""

from __future__ import annotations

import argparse
import sys
import time
import warnings
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

if __package__ in (None, ""):  # run as a script: make `torchplex` importable from the repo root
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402
from torch.distributed.checkpoint.metadata import TensorStorageMetadata  # noqa: E402
from tqdm import tqdm  # noqa: E402

from torchplex.models.qwen2_5_vl.args import ModelArgs  # noqa: E402
from torchplex.models.qwen2_5_vl.state_dict_adapter import LAYOUTS, Qwen2_5_VLStateDictAdapter  # noqa: E402
from torchplex.models.qwen2_5_vl.weights import (  # noqa: E402
    CheckpointMismatchError, HFCheckpoint, copy_non_weight_files, finish_hf_weights, plan_shards, save_safetensors,
    shard_file_names)

@dataclass
class DCPToHFSummary:
    dcp_dir: Path
    hf_dir: Path
    layout: str
    num_tensors: int
    total_bytes: int
    files: list[str] = field(default_factory=list)          # safetensors files written
    copied: list[str] = field(default_factory=list)         # non-weight files copied from --config-from
    dtypes: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0

    def __str__(self) -> str:
        dtypes = ", ".join(f"{n} x {d}" for d, n in sorted(self.dtypes.items()))
        return (f"{self.dcp_dir} -> {self.hf_dir} [{self.layout} HF layout]: {self.num_tensors} tensors, "
                f"{self.total_bytes / 2**20:.1f} MiB ({dtypes}) in {len(self.files)} file(s); copied "
                f"{', '.join(self.copied) or 'nothing'}; {self.seconds:.1f} s")


# A torchplex training checkpoint (torchplex.components.checkpoint) saves {"model": ..., "optimizer": ...};
# DCP flattens that to "model.<native name>" keys. No native name starts with "model.".
_TRAINING_MODEL_PREFIX = "model."


@dataclass
class _DCPEntry:
    dcp_key: str                    # the key inside the DCP checkpoint
    meta: TensorStorageMetadata


def _dcp_model_tensors(dcp_dir: Path) -> dict[str, _DCPEntry]:
    """Native name -> entry for the model tensors of a DCP checkpoint: either a bare native state dict
    (what convert_hf_to_dcp writes) or the "model" part of a training checkpoint (the rest ignored)."""
    reader = dcp.FileSystemReader(str(dcp_dir))
    try:
        metadata = reader.read_metadata()
    except FileNotFoundError:
        raise FileNotFoundError(f"{dcp_dir} is not a DCP checkpoint (no .metadata file)") from None
    entries = metadata.state_dict_metadata
    training = any(key.startswith(_TRAINING_MODEL_PREFIX) for key in entries)
    out = {}
    for key, meta in entries.items():
        if training:
            if not key.startswith(_TRAINING_MODEL_PREFIX):
                continue                # optimizer state and the like
            native = key[len(_TRAINING_MODEL_PREFIX):]
        else:
            native = key
        if not isinstance(meta, TensorStorageMetadata):
            raise CheckpointMismatchError(f"DCP entry {key!r} in {dcp_dir} is not a tensor")
        out[native] = _DCPEntry(key, meta)
    return out


def _load_one(reader: dcp.FileSystemReader, entry: _DCPEntry) -> torch.Tensor:
    """Read one tensor: a DCP load of a one-entry state dict reads only that tensor's bytes."""
    target = {entry.dcp_key: torch.empty(entry.meta.size, dtype=entry.meta.properties.dtype)}
    with warnings.catch_warnings():  # DCP warns on every single-process load; that is the intent here
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.load(target, storage_reader=reader, no_dist=True)
    return target[entry.dcp_key]


def _source_layout_and_shard_bytes(src: Path) -> tuple[str, int | None]:
    """The source checkpoint's key layout and largest shard size (None when it is a single file).
    A source without weights (config and tokenizer only) gets the Hub's legacy layout, one file."""
    try:
        checkpoint = HFCheckpoint.open(src)
    except FileNotFoundError:
        return "legacy", None
    layout = Qwen2_5_VLStateDictAdapter.detect_layout(checkpoint.weight_map)
    files = checkpoint.files
    return layout, (max(p.stat().st_size for p in files) if len(files) > 1 else None)


def convert_dcp_to_hf(dcp_dir: str | Path, hf_dir: str | Path, config_from: str | Path, layout: str | None = None,
                      max_shard_bytes: int | None = None, progress: bool = True) -> DCPToHFSummary:
    """Write DCP checkpoint ``dcp_dir`` as HF safetensors in ``hf_dir`` using ``config_from``'s
    config, non-weight files, layout (unless ``layout``) and shard size (unless ``max_shard_bytes``)."""
    start = time.perf_counter()
    dcp_dir, hf_dir, src = Path(dcp_dir), Path(hf_dir), Path(config_from)
    if hf_dir.resolve() == src.resolve():
        raise ValueError(f"HF_DIR must differ from --config-from ({src}): it would overwrite the source")
    adapter = Qwen2_5_VLStateDictAdapter(ModelArgs.from_hf_dir(src))
    src_layout, src_shard_bytes = _source_layout_and_shard_bytes(src)
    layout = layout or src_layout
    if layout not in LAYOUTS:
        raise ValueError(f"unknown layout {layout!r}; expected one of {LAYOUTS}")
    if max_shard_bytes is None:
        max_shard_bytes = src_shard_bytes

    tensors = _dcp_model_tensors(dcp_dir)
    expected = adapter.expected_native_shapes()
    problems = [f"missing native {k!r} shape {s}" for k, s in expected.items() if k not in tensors]
    problems += [f"unexpected native {k!r}" for k in tensors if k not in expected]
    problems += [f"shape mismatch for native {k!r}: config implies {expected[k]}, DCP has {tuple(e.meta.size)}"
                 for k, e in tensors.items() if k in expected and tuple(e.meta.size) != expected[k]]
    if problems:
        raise CheckpointMismatchError(f"DCP checkpoint {dcp_dir} does not match the geometry of "
                                      f"{src / 'config.json'}:\n  " + "\n  ".join(problems))

    hf_name = {native: adapter.native_to_hf_key(native, layout) for native in sorted(tensors)}
    sizes = {k: e.meta.size.numel() * e.meta.properties.dtype.itemsize for k, e in tensors.items()}
    shards = plan_shards({k: sizes[k] for k in sorted(tensors, key=hf_name.get)}, max_shard_bytes)
    hf_dir.mkdir(parents=True, exist_ok=True)
    reader = dcp.FileSystemReader(str(dcp_dir))
    weight_map: dict[str, str] = {}
    bar = tqdm(total=len(tensors), desc="writing HF tensors", unit="tensor", disable=not progress)
    for file_name, keys in zip(shard_file_names(len(shards)), shards):
        out: dict[str, torch.Tensor] = {}
        for key in keys:
            out[hf_name[key]] = _load_one(reader, tensors[key])
            weight_map[hf_name[key]] = file_name
            bar.update()
        save_safetensors(out, hf_dir / file_name, metadata={"format": "pt"})
    bar.close()
    finish_hf_weights(hf_dir, weight_map, sum(sizes.values()))
    copied = copy_non_weight_files(src, hf_dir)
    return DCPToHFSummary(
        dcp_dir=dcp_dir, hf_dir=hf_dir, layout=layout, num_tensors=len(tensors), total_bytes=sum(sizes.values()),
        files=shard_file_names(len(shards)), copied=copied,
        dtypes=dict(Counter(str(e.meta.properties.dtype).removeprefix("torch.") for e in tensors.values())),
        seconds=time.perf_counter() - start)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("dcp_dir", type=Path, help="DCP folder of native weights")
    parser.add_argument("hf_dir", type=Path, help="output HF checkpoint folder")
    parser.add_argument("--config-from", type=Path, required=True,
                        help="HF checkpoint folder whose config/tokenizer/processor files and layout to use")
    parser.add_argument("--layout", choices=LAYOUTS, default=None,
                        help="HF key layout to write (default: that of --config-from's weights)")
    parser.add_argument("--max-shard-bytes", type=int, default=None,
                        help="split into files of at most this many bytes (default: like --config-from)")
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    args = parser.parse_args(argv)
    print(convert_dcp_to_hf(args.dcp_dir, args.hf_dir, args.config_from, layout=args.layout,
                            max_shard_bytes=args.max_shard_bytes, progress=not args.no_progress))


if __name__ == "__main__":
    main()
