"""The rollout's decode window as a second host thread: work that runs while the engine decodes.

Why a thread. Measured on the H200 (docs/benchmarks.md): a replay of the captured decode step keeps the GPU busy
for milliseconds while the host spends a fraction of that launching it and then waits, whereas the eager
reference forwards are host-bound (a 7B prompt prefix is ~0.1 s of launches for a fraction of that in GPU work).
Run between decode steps on the decode loop's own thread, such a slice stops the decode launches, so the GPU
idles while the host launches the slice (the window "moved" the work instead of hiding it). On a second thread,
with its CUDA work on a side stream, both are launched at once: the step then pays only the GPU time the window
work takes from decode, not its host time. PyTorch releases the GIL inside every operator call, so the two
threads interleave at operator granularity.

Ordering. A job submitted from the decode thread waits (on the GPU) for everything the current stream had
enqueued at submission (an event recorded then), so it never reads a tensor before the main stream wrote it;
`finish()` makes the current stream wait for all window work before anything downstream reads its results.
Jobs run one after another in submission order: a prompt's reference prefix is held before any of its suffixes
is scored.

Without CUDA (or `threaded=False`) a job runs when it is submitted, on the caller's thread: the executor's serial
path, in program order, with the same numbers.
"""

from __future__ import annotations

import queue
import threading
from contextlib import nullcontext
from typing import Callable

import torch


class WindowWorker:
    def __init__(self, device: torch.device, threaded: bool | None = None):
        self.device = torch.device(device)
        self.threaded = self.device.type == "cuda" if threaded is None else threaded
        self.stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self._jobs: queue.Queue = queue.Queue()
        self._error: BaseException | None = None
        self._thread: threading.Thread | None = None
        self.jobs_run = 0

    # ---- what the decode thread calls ---------------------------------------------------------------
    def submit(self, job: Callable[[], None]) -> None:
        """Run `job()` in the window: with grad off, on the side stream, after the current stream's work so far."""
        ready = None
        if self.stream is not None:
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(self.device))
        if not self.threaded:
            self._run(job, ready)
            return
        if self._thread is None:
            self._thread = threading.Thread(target=self._loop, name="torchplex-window", daemon=True)
            self._thread.start()
        self._jobs.put((job, ready))

    def finish(self, drop_waiting: bool = False) -> list[Callable[[], None]]:
        """Wait until every submitted job has run, re-raise the first error of one, and order the current stream
        after all window work (its results are read there next). drop_waiting: the jobs not begun yet are dropped
        instead (returned, in submission order): once decode has ended, what is left runs better where the whole
        device is free, batched (the ref stage)."""
        dropped = []
        if self._thread is not None:
            if drop_waiting:
                while True:
                    try:
                        item = self._jobs.get_nowait()
                    except queue.Empty:
                        break
                    dropped.append(item[0])
                    self._jobs.task_done()
            self._jobs.join()
        if self.stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(self.stream)
        error, self._error = self._error, None
        if error is not None:
            raise RuntimeError("a decode-window job failed") from error
        return dropped

    def close(self) -> None:
        if self._thread is not None:
            self._jobs.put(None)
            self._thread.join()
            self._thread = None

    # ---- the window thread ------------------------------------------------------------------------------
    def _run(self, job, ready) -> None:
        if self._error is not None:  # a failed job's successors would only see its missing results
            return
        stream_ctx = nullcontext()
        if self.stream is not None:
            self.stream.wait_event(ready)
            stream_ctx = torch.cuda.stream(self.stream)
        try:
            with stream_ctx, torch.no_grad():
                job()
            self.jobs_run += 1
        except BaseException as err:  # noqa: BLE001 - handed to the decode thread in finish()
            self._error = err

    def _loop(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)  # the current device is per thread
        while True:
            item = self._jobs.get()
            try:
                if item is None:
                    return
                self._run(*item)
            finally:
                self._jobs.task_done()
