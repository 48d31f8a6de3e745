"""A GPU's streaming multiprocessors cut into two disjoint groups, each with a stream: the rollout's decode on one,
the decode window's work on the other.

Why. Beside an efficient decode, work on a second stream or on a green context made on its own takes turns with
the decode rather than running beside it: both take the same SMs (../shared/probes/FINDINGS.md, H200). One split of
the device's SM resource by the driver (`cuDevSmResourceSplitByCount`) gives groups that the driver keeps
disjoint; a green context on each, and a stream of each (`torch.cuda.ExternalStream`), confine the kernels launched
there: eager launches on the stream, and a CUDA graph captured on it (a graph captured on another stream and
replayed here is not confined).

The split is by count: the window's group gets at least `window_sms` SMs, rounded up to the driver's granularity
for the architecture; the decode gets the rest. `SmPartition` records what the driver gave.

Needs the driver's green contexts (CUDA 12.4+) and NVIDIA's `cuda-bindings` package (`pip install cuda-bindings`,
shipped beside PyTorch's CUDA builds), imported only here and only when a split is asked for.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


class SmPartitionError(RuntimeError):
    """The device cannot be split as asked (no CUDA, no driver support, a count out of range)."""


@dataclass
class SmPartition:
    decode_stream: torch.cuda.Stream
    window_stream: torch.cuda.Stream
    decode_sms: int
    window_sms: int
    device_sms: int
    _keep: list = field(default_factory=list, repr=False)  # the green contexts and raw streams the streams live in

    def describe(self) -> str:
        return (f"{self.window_sms} of {self.device_sms} SMs for the decode window, {self.decode_sms} for the "
                f"decode")


def _driver():
    try:
        from cuda.bindings import driver
    except ImportError:
        try:  # cuda-python before 12.6 named the module cuda.cuda
            from cuda import cuda as driver
        except ImportError as err:
            raise SmPartitionError("runtime.window_sms needs NVIDIA's cuda-bindings package for the driver's green "
                                   "contexts (pip install cuda-bindings); set runtime.window_sms = 0 to run "
                                   "without a split") from err
    return driver


def _check(result, what: str):
    err, *rest = result
    if int(err) != 0:
        raise SmPartitionError(f"{what} failed: CUDA driver error {err}")
    return rest[0] if len(rest) == 1 else rest


def check_window_sms(window_sms: int, device_sms: int) -> None:
    """A count the split can honour: at least one SM for the window, and the decode keeps at least half the device
    (it streams the weights at every step; a decode on fewer SMs than that was measured well below its rate)."""
    if not 0 < window_sms <= device_sms // 2:
        raise SmPartitionError(f"runtime.window_sms = {window_sms}: must be between 1 and half the device's "
                               f"{device_sms} SMs ({device_sms // 2}); 0 runs without a split")


def split_sms(device: torch.device, window_sms: int) -> SmPartition:
    """Cut `device` into a group of at least `window_sms` SMs for the window and the rest for the decode."""
    device = torch.device(device)
    if device.type != "cuda":
        raise SmPartitionError(f"runtime.window_sms needs a CUDA device, not {device.type}; set it to 0")
    index = device.index if device.index is not None else torch.cuda.current_device()
    total = torch.cuda.get_device_properties(index).multi_processor_count
    check_window_sms(window_sms, total)
    driver = _driver()
    torch.cuda.init()  # the primary context exists before any green context of the device
    dev = _check(driver.cuDeviceGet(index), "cuDeviceGet")
    whole = _check(driver.cuDeviceGetDevResource(dev, driver.CUdevResourceType.CU_DEV_RESOURCE_TYPE_SM),
                   "cuDeviceGetDevResource")
    groups, _, rest = _check(driver.cuDevSmResourceSplitByCount(1, whole, 0, window_sms),
                             "cuDevSmResourceSplitByCount")
    streams, counts, keep = [], [], []
    for resource in (groups[0], rest):
        desc = _check(driver.cuDevResourceGenerateDesc([resource], 1), "cuDevResourceGenerateDesc")
        ctx = _check(driver.cuGreenCtxCreate(desc, dev, driver.CUgreenCtxCreate_flags.CU_GREEN_CTX_DEFAULT_STREAM),
                     "cuGreenCtxCreate")
        raw = _check(driver.cuGreenCtxStreamCreate(ctx, driver.CUstream_flags.CU_STREAM_NON_BLOCKING, 0),
                     "cuGreenCtxStreamCreate")
        keep += [ctx, raw]
        streams.append(torch.cuda.ExternalStream(int(raw), device=device))
        counts.append(int(resource.sm.smCount))
    return SmPartition(decode_stream=streams[1], window_stream=streams[0], decode_sms=counts[1],
                       window_sms=counts[0], device_sms=int(whole.sm.smCount), _keep=keep)
