"""Convert an HF Qwen2.5-VL safetensors checkpoint into a torch.distributed.checkpoint (DCP) folder.

    python tools/convert_hf_to_dcp.py HF_DIR DCP_DIR

The DCP folder holds the native state dict (torchplex names, HF dtypes and shapes unchanged) and a
copy of ``config.json``; a training job loads it with ``dcp.load`` straight into sharded parameters.
Runs in one process with no process group. Every tensor is checked against the geometry in
``config.json`` (from the file headers) before any tensor is read. Peak host memory is one copy of the
model: DCP writes a whole state dict at once.
"""

from __future__ import annotations

import argparse
import shutil
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
from tqdm import tqdm  # noqa: E402

from torchplex.models.qwen2_5_vl.args import ModelArgs  # noqa: E402
from torchplex.models.qwen2_5_vl.state_dict_adapter import Qwen2_5_VLStateDictAdapter  # noqa: E402
from torchplex.models.qwen2_5_vl.weights import CheckpointMismatchError, HFCheckpoint  # noqa: E402


@dataclass
class HFToDCPSummary:
    hf_dir: Path
    dcp_dir: Path
    layout: str
    num_tensors: int
    total_bytes: int
    dtypes: dict[str, int] = field(default_factory=dict)   # dtype name -> number of tensors
    skipped: list[str] = field(default_factory=list)       # HF keys dropped on purpose (tied lm_head)
    seconds: float = 0.0

    def __str__(self) -> str:
        dtypes = ", ".join(f"{n} x {d}" for d, n in sorted(self.dtypes.items()))
        skipped = f"; dropped {self.skipped} (tied embeddings)" if self.skipped else ""
        return (f"{self.hf_dir} [{self.layout} HF layout] -> {self.dcp_dir}: {self.num_tensors} tensors, "
                f"{self.total_bytes / 2**20:.1f} MiB ({dtypes}){skipped}; {self.seconds:.1f} s")


def check_against_config(checkpoint: HFCheckpoint, adapter: Qwen2_5_VLStateDictAdapter) -> dict[str, str]:
    """Native -> HF key for every tensor to convert, after checking the file headers (no tensor data)
    against the geometry of config.json; raises one CheckpointMismatchError listing every problem."""
    layout = adapter.detect_layout(checkpoint.weight_map)
    expected = adapter.expected_native_shapes()
    shapes = checkpoint.header_shapes()
    problems: list[str] = []
    reported: set[str] = set()  # native keys already in a problem, so none is also listed as missing
    hf_key_of: dict[str, str] = {}
    for hf_key, path in checkpoint.weight_map.items():
        if adapter.is_dropped_hf_key(hf_key):
            continue
        try:
            native = adapter.hf_to_native_key(hf_key)
        except KeyError as e:
            problems.append(f"unexpected: HF {hf_key!r} in {path}: {e.args[0]}")
            continue
        found = shapes[hf_key]
        reported.add(native)
        if native not in expected:
            problems.append(f"unexpected: HF {hf_key!r} in {path} (native {native!r}) is not part of this "
                            f"geometry")
        elif found is None:
            problems.append(f"missing: native {native!r} (HF {hf_key!r}) is listed in the index but absent "
                            f"from {path}")
        elif found != expected[native]:
            problems.append(f"shape mismatch: native {native!r} (HF {hf_key!r} in {path}): config.json implies "
                            f"{expected[native]}, checkpoint has {found}")
        else:
            hf_key_of[native] = hf_key
            reported.discard(native)
    for native, shape in expected.items():
        if native not in reported and native not in hf_key_of:
            problems.append(f"missing: native {native!r} (HF {adapter.native_to_hf_key(native, layout)!r}, "
                            f"expected in {checkpoint.expected_location}) shape {shape}")
    if problems:
        raise CheckpointMismatchError(f"checkpoint {checkpoint.directory} does not match its config.json:\n  "
                                      + "\n  ".join(problems))
    return hf_key_of


def read_native_state_dict(hf_dir: str | Path, progress: bool = True) -> tuple[dict[str, torch.Tensor], HFToDCPSummary]:
    """All tensors of an HF checkpoint under native names, validated against its config.json."""
    start = time.perf_counter()
    checkpoint = HFCheckpoint.open(hf_dir)
    adapter = Qwen2_5_VLStateDictAdapter(ModelArgs.from_hf_dir(hf_dir))
    hf_key_of = check_against_config(checkpoint, adapter)
    native_of = {hf_key: native for native, hf_key in hf_key_of.items()}

    state: dict[str, torch.Tensor] = {}
    skipped: list[str] = []
    for hf_key, _, tensor in tqdm(checkpoint.iter_tensors(), total=len(checkpoint.weight_map),
                                  desc="reading HF tensors", unit="tensor", disable=not progress):
        if hf_key in native_of:
            state[native_of[hf_key]] = tensor
        else:
            skipped.append(hf_key)  # only a tied lm_head.weight gets here
    summary = HFToDCPSummary(
        hf_dir=checkpoint.directory, dcp_dir=Path(), layout=adapter.detect_layout(checkpoint.weight_map),
        num_tensors=len(state), total_bytes=sum(t.numel() * t.element_size() for t in state.values()),
        dtypes=dict(Counter(str(t.dtype).removeprefix("torch.") for t in state.values())),
        skipped=skipped, seconds=time.perf_counter() - start)
    return state, summary


def convert_hf_to_dcp(hf_dir: str | Path, dcp_dir: str | Path, progress: bool = True) -> HFToDCPSummary:
    """Write HF checkpoint ``hf_dir`` as a single-process DCP checkpoint in ``dcp_dir`` (+ config.json)."""
    hf_dir, dcp_dir = Path(hf_dir), Path(dcp_dir)
    if dcp_dir.resolve() == hf_dir.resolve():
        raise ValueError(f"DCP_DIR must differ from HF_DIR ({hf_dir})")
    state, summary = read_native_state_dict(hf_dir, progress=progress)
    start = time.perf_counter()
    dcp_dir.mkdir(parents=True, exist_ok=True)
    # no_dist: plan and write in this process alone, whether or not a process group exists.
    with warnings.catch_warnings():  # DCP warns on every single-process call; that is the intent here
        warnings.filterwarnings("ignore", message="torch.distributed is disabled")
        dcp.save(state, storage_writer=dcp.FileSystemWriter(str(dcp_dir)), no_dist=True)
    shutil.copy(hf_dir / "config.json", dcp_dir / "config.json")
    summary.dcp_dir = dcp_dir
    summary.seconds += time.perf_counter() - start
    return summary


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("hf_dir", type=Path, help="HF checkpoint folder (config.json + safetensors)")
    parser.add_argument("dcp_dir", type=Path, help="output torch.distributed.checkpoint folder")
    parser.add_argument("--no-progress", action="store_true", help="hide the progress bar")
    args = parser.parse_args(argv)
    print(convert_hf_to_dcp(args.hf_dir, args.dcp_dir, progress=not args.no_progress))


if __name__ == "__main__":
    main()
