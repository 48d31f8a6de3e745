"""The rollout's decode window as a second host thread: work that runs while the engine decodes, and the
reference work a step places there (`DecodeWindowJobs`).

Why a thread (measured: docs/performance.md): a replay of the captured decode step keeps the GPU busy
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

Without CUDA (or `threaded=False`) a job runs when it is submitted, on the caller's thread: the step's serial
path, in program order, with the same numbers.
"""

from __future__ import annotations

import queue
import threading
from contextlib import nullcontext
from typing import Callable

import torch

from .experience import request_from_outputs
from .phases import PhaseName
from .prefixes import PrefixStore, hold_prefixes
from .timeline import Timeline


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


WINDOW_PREFIX_PROMPTS = 4  # reference prefixes per window job when decode begins: a few thousand tokens of image prompts, fewer launches


class DecodeWindowJobs:
    """The reference work the plan places in the rollout's decode window, as hooks for the engine.

    ref_prefix in the window: once decode has begun (its first step: every prompt's prefill is done), one job per
    WINDOW_PREFIX_PROMPTS prompts holds their reference prefixes (one batched forward, as the ref stage's). ref_suffix in
    the window: a job per `sample_batch` finished samples of a prompt, and one for its last ones, scores them on the
    held prefix (each job is an eager forward whose host cost hardly depends on its size, so fewer, larger jobs leave
    decode more of the host). `scored` maps a sample to its reference log-probs; what the window did not score, the
    ref stage does: when decode ends, the jobs not yet begun are dropped and left to it (`dropped`), as it runs on
    the whole device, batched, where the window's jobs would run one by one.
    """

    def __init__(self, prefix_in_window: bool, suffix_in_window: bool, scorer, reference, prompts: list,
                 group_size: int, sample_batch: int, store: PrefixStore, window: WindowWorker, timeline: Timeline,
                 temperature: float, device: torch.device):
        self.prefix_in_window = prefix_in_window and reference is not None
        self.suffix_in_window = suffix_in_window and reference is not None
        self.scorer, self.reference, self.prompts = scorer, reference, prompts
        self.group_size, self.sample_batch = group_size, sample_batch
        self.prefix_prompts = WINDOW_PREFIX_PROMPTS
        self.store, self.window, self.timeline = store, window, timeline
        self.temperature, self.device = temperature, device
        self.scored: dict[int, torch.Tensor] = {}
        self._submitted: set[int] = set()  # prompts whose reference prefix job is queued
        self._pending: dict[int, list] = {}
        self._finished = [0] * len(prompts)
        # jobs by kind (PhaseName.REF_PREFIX / REF_SUFFIX): submitted, and dropped at the end of decode
        self.submitted = {PhaseName.REF_PREFIX: 0, PhaseName.REF_SUFFIX: 0}
        self.dropped = {PhaseName.REF_PREFIX: 0, PhaseName.REF_SUFFIX: 0}

    @property
    def reads_reference(self) -> bool:
        """The window reads the reference's weights during rollout (FSDP2: gathered from the rollout on)."""
        return self.prefix_in_window or self.suffix_in_window

    def hooks(self) -> dict:
        """The engine's hook arguments: only those of work placed in the window (None otherwise)."""
        return {"on_step": self._on_step if self.prefix_in_window else None,
                "on_samples_finished": self._on_samples_finished if self.suffix_in_window else None}

    def finish(self) -> None:
        """After generate: drop the jobs not begun (the ref stage does their work), wait for the one running
        (re-raising a job's error), then free the held reference prefixes of prompts whose samples were all scored
        there."""
        for job in self.window.finish(drop_waiting=True):
            self.dropped[job.kind] += 1
        for i, prompt in enumerate(self.prompts):
            if all(i * self.group_size + j in self.scored for j in range(self.group_size)):
                self.store.discard(self.reference, prompt)

    # ---- hooks, called on the decode thread ----------------------------------------------------------------
    def _on_step(self, info) -> None:
        if info.step == 1:  # decode has begun: the prompts' prefills are done
            for i in range(0, len(self.prompts), self.prefix_prompts):
                self._prefix_job(i)

    def _on_samples_finished(self, outputs) -> None:
        for o in outputs:
            i = o.prompt_index
            self._pending.setdefault(i, []).append(o)
            self._finished[i] += 1
            if len(self._pending[i]) >= self.sample_batch or self._finished[i] == self.group_size:
                outs = self._pending.pop(i)
                self._prefix_job(i)  # queued before its samples' job: the window runs jobs in order
                self._submit(PhaseName.REF_SUFFIX, lambda i=i, outs=outs: self._score_samples(i, outs))

    def _prefix_job(self, i: int) -> None:
        """Queue the reference prefixes of prompt i's batch (prompts i // prefix_prompts), unless queued before."""
        first = i - i % self.prefix_prompts
        batch = range(first, min(first + self.prefix_prompts, len(self.prompts)))
        todo = [k for k in batch if k not in self._submitted]
        if todo:
            self._submitted.update(todo)
            self._submit(PhaseName.REF_PREFIX, lambda ps=[self.prompts[i] for i in todo]: self._hold_prefixes(ps))

    def _submit(self, kind: PhaseName, fn: Callable[[], None]) -> None:
        fn.kind = kind
        self.submitted[kind] += 1
        self.window.submit(fn)

    # ---- jobs, run by the window (its thread and side stream) ----------------------------------------------
    def _hold_prefixes(self, prompts: list) -> None:
        with self.timeline.span(PhaseName.REF_PREFIX, lane="window"):
            hold_prefixes(self.scorer, self.reference, prompts, self.store)

    def _score_samples(self, i: int, outputs) -> None:
        """Reference log-probs of samples of prompt i that just finished, on its prefix held in the store (kept
        there: later samples of the prompt are scored on it too)."""
        with self.timeline.span(PhaseName.REF_SUFFIX, lane="window"):
            samples = [i * self.group_size + o.sample_index for o in outputs]
            request = request_from_outputs(self.prompts, self.group_size, samples, [o.token_ids for o in outputs],
                                           self.device)
            prefix = self.store.peek(self.reference, self.prompts[i])
            if prefix is None:  # its prefix job failed before: finish() reports that
                return
            logp = self.scorer.score_on_prefix(self.reference, prefix, request, self.temperature)
            for row, (s, o) in enumerate(zip(samples, outputs)):
                self.scored[s] = logp[row, :len(o.token_ids)]

