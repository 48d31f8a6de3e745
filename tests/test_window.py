"""The decode-window worker: order, grad mode, errors; and requests built from rollout outputs."""

import threading

import pytest
import torch

from torchplex.runtime.experience import Experience, request_from_outputs, score_request
from torchplex.runtime.window import WindowWorker


@pytest.mark.parametrize("threaded", [False, True])
def test_jobs_run_in_submission_order_with_grad_off(threaded):
    worker = WindowWorker(torch.device("cpu"), threaded=threaded)
    seen = []
    for i in range(20):
        worker.submit(lambda i=i: seen.append((i, torch.is_grad_enabled(), threading.current_thread().name)))
    worker.finish()
    worker.close()
    assert [i for i, _, _ in seen] == list(range(20))
    assert not any(grad for _, grad, _ in seen)
    names = {name for _, _, name in seen}
    assert names == ({"torchplex-window"} if threaded else {threading.current_thread().name})
    assert worker.jobs_run == 20


@pytest.mark.parametrize("threaded", [False, True])
def test_a_failed_job_raises_at_finish_and_skips_the_rest(threaded):
    worker = WindowWorker(torch.device("cpu"), threaded=threaded)
    ran = []
    worker.submit(lambda: ran.append(1))
    worker.submit(lambda: 1 / 0)
    worker.submit(lambda: ran.append(3))
    with pytest.raises(RuntimeError, match="decode-window job failed") as err:
        worker.finish()
    assert isinstance(err.value.__cause__, ZeroDivisionError)
    assert ran == [1]
    worker.submit(lambda: ran.append(4))  # the error was handed over: the worker serves the next step
    worker.finish()
    worker.close()
    assert ran == [1, 4]


def test_finish_can_drop_the_jobs_not_begun_and_waits_for_the_running_one():
    """Once decode has ended the jobs still queued are handed back, in order, not run (the ref stage does their
    work); the job running then completes."""
    worker = WindowWorker(torch.device("cpu"), threaded=True)
    started, gate, ran = threading.Event(), threading.Event(), []
    worker.submit(lambda: (started.set(), gate.wait(10), ran.append(0)))
    later = [lambda i=i: ran.append(i) for i in range(1, 4)]
    for job in later:
        worker.submit(job)
    assert started.wait(10)
    threading.Timer(0.2, gate.set).start()  # after finish has emptied the queue, the running job may end
    dropped = worker.finish(drop_waiting=True)
    assert dropped == later and ran == [0] and worker.jobs_run == 1
    worker.submit(lambda: ran.append(9))  # the worker serves the next step
    worker.finish()
    worker.close()
    assert ran == [0, 9]


def test_finish_without_dropping_runs_every_job():
    worker = WindowWorker(torch.device("cpu"), threaded=True)
    ran = []
    for i in range(5):
        worker.submit(lambda i=i: ran.append(i))
    assert worker.finish() == [] and ran == list(range(5))
    worker.close()


def test_request_from_outputs_equals_the_experience_request():
    group = 3
    token_ids = [[5, 6, 7], [8], [9, 10], [11, 12, 13, 14], [15], [16, 17]]
    width = max(map(len, token_ids))
    tokens = torch.tensor([t + [0] * (width - len(t)) for t in token_ids])
    lengths = torch.tensor([len(t) for t in token_ids])
    exp = Experience(prompts=["p0", "p1"], answers=["", ""], group_size=group, tokens=tokens, lengths=lengths,
                     sampling_logprobs=torch.zeros(6, width), finish_reasons=["stop"] * 6, texts=[""] * 6,
                     rewards=torch.zeros(6), reward_parts={}, correct=[False] * 6, advantages=torch.zeros(6),
                     keep_groups=torch.ones(2, dtype=torch.bool))
    for samples in ([0, 1, 2], [3, 4, 5], [0, 1, 2, 3, 4, 5], [4, 5]):
        want = exp.request(samples)
        got = request_from_outputs(exp.prompts, group, samples, [token_ids[s] for s in samples], "cpu")
        assert got.prompts == want.prompts and got.prompt_index == want.prompt_index
        assert torch.equal(got.tokens, want.tokens) and torch.equal(got.lengths, want.lengths)
    # the group of samples 0-2 is cut to its own longest response, not the step's
    assert score_request(exp.prompts, group, [0, 1, 2], tokens[:3], lengths[:3]).tokens.shape == (3, 3)


def test_micro_batches_keep_groups_whole_also_when_some_samples_are_missing():
    from torchplex.runtime.experience import MicroBatchLimits, micro_batches

    cut = lambda samples, size, whole: micro_batches(samples, 4, MicroBatchLimits(0, size, whole), [1] * 10)
    assert cut(list(range(8)), 4, True) == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert cut(list(range(8)), 8, True) == [list(range(8))]
    assert cut([0, 2, 3, 5, 6, 9], 4, True) == [[0, 2, 3], [5, 6, 9]]  # partial groups share a micro-batch
    assert cut([0, 2, 3, 5, 6, 9], 8, True) == [[0, 2, 3, 5, 6, 9]]
    assert cut([0, 2, 3, 5, 6, 9], 2, True) == [[0, 2], [3], [5, 6], [9]]  # a group over the bound is cut
    assert cut(list(range(5)), 2, False) == [[0, 1], [2, 3], [4]]
