"""Where the memory was when a CUDA allocation failed: the live blocks of the allocator's snapshot at that moment,
summed by the code that allocated them (torch.cuda.memory's history, python stacks). A diagnostic for runs that
run out of memory (scale_bench --oom-sites), not a measurement: recording stacks slows the host.

`record()` starts the history and attaches an out-of-memory observer (where this torch has one) that summarises the
snapshot at the failing allocation, before the exception unwinds the frames that held the tensors; `last()` returns
that summary (or, without the observer, one taken when asked).
"""

from __future__ import annotations

import torch

_state: dict = {"summary": None}


def site_of(frames: list[dict], ours: str = "torchplex", depth: int = 3) -> str:
    """The innermost `depth` frames of our code (file:line function), innermost first; else the innermost frame."""
    mine = [f for f in frames if ours in f.get("filename", "")][:depth]
    picked = mine or frames[:1]
    return " < ".join(f"{'/'.join(f.get('filename', '?').split('/')[-2:])}:{f.get('line', '?')} {f.get('name', '?')}"
                      for f in picked) or "(no stack)"


def summarize(snapshot: dict, top: int = 25) -> dict:
    """Live (active) bytes of a torch.cuda.memory._snapshot() by allocation site, the largest `top` sites."""
    sites: dict[str, list[int]] = {}
    active = 0
    for seg in snapshot.get("segments", []):
        for block in seg.get("blocks", []):
            if block.get("state") != "active_allocated":
                continue
            active += block["size"]
            entry = sites.setdefault(site_of(block.get("frames", [])), [0, 0])
            entry[0] += block["size"]
            entry[1] += 1
    ranked = sorted(sites.items(), key=lambda kv: -kv[1][0])[:top]
    return {"active_gib": active / 2**30,
            "sites": [{"gib": b / 2**30, "blocks": n, "where": where} for where, (b, n) in ranked]}


def record(max_entries: int = 200_000) -> bool:
    """Start recording allocation stacks and summarise the snapshot at the first failed allocation (CUDA only)."""
    if not torch.cuda.is_available():
        return False
    torch.cuda.memory._record_memory_history(max_entries=max_entries, stacks="python")
    attach = getattr(torch._C, "_cuda_attach_out_of_memory_observer", None)
    if attach is not None:
        def observe(device, alloc, device_allocated, device_free):
            if _state["summary"] is None:  # the first failure: later ones see what its unwinding left
                _state["summary"] = {"failed_alloc_gib": alloc / 2**30, **summarize(torch.cuda.memory._snapshot())}
        attach(observe)
    return True


def last() -> dict | None:
    """The summary taken at the failed allocation (then forgotten), else one of the memory live now."""
    summary, _state["summary"] = _state["summary"], None
    if summary is None and torch.cuda.is_available():
        summary = {"at": "after the failure", **summarize(torch.cuda.memory._snapshot())}
    return summary
