"""The strategies' background thread: order, errors, and operators counted like the training thread's."""

import threading

import pytest
import torch

from embbench.metrics import OpCounter
from embbench.worker import BackgroundWorker


def _ops(n: int) -> None:
    x = torch.zeros(3)
    for _ in range(n):
        x = x + 1


def test_tasks_run_in_order_on_one_thread_other_than_the_callers():
    worker = BackgroundWorker(torch.device("cpu"), "test")
    seen = []
    for i in range(20):
        worker.submit(lambda i=i: seen.append((i, threading.get_ident())))
    worker.wait()
    assert [i for i, _ in seen] == list(range(20))
    assert len({t for _, t in seen}) == 1 and seen[0][1] != threading.get_ident()


def test_a_tasks_error_is_raised_by_wait_and_then_forgotten():
    worker = BackgroundWorker(torch.device("cpu"), "test")
    worker.submit(lambda: 1 / 0)
    after = worker.submit(_ops, 1)
    with pytest.raises(ZeroDivisionError):
        worker.wait()
    worker.wait()  # nothing pending any more
    assert after.done() and after.exception() is None


def test_waiting_up_to_a_task_leaves_the_later_ones_running_and_counts_the_block(monkeypatch):
    from embbench import worker as module

    worker = BackgroundWorker(torch.device("cpu"), "test")
    first_may_end, second_may_end = threading.Event(), threading.Event()
    first = worker.submit(first_may_end.wait)
    second = worker.submit(second_may_end.wait)
    real_wait = module.futures.wait

    def wait_and_release(fs):  # the first task can only end once wait() blocks for it
        first_may_end.set()
        return real_wait(fs)

    monkeypatch.setattr(module.futures, "wait", wait_and_release)
    worker.wait(until=first)
    assert first.done() and not second.done()  # the second still waits for its event
    assert worker.counters()["pipeline_stalls"] == 1 and worker.wait_seconds > 0
    worker.wait(until=first)  # already waited for: returns at once
    assert worker.counters()["pipeline_stalls"] == 1
    second_may_end.set()
    worker.wait()
    assert second.done()


def test_ops_of_a_task_handed_over_while_counting_are_counted():
    worker = BackgroundWorker(torch.device("cpu"), "test")
    worker.submit(_ops, 7)  # before the counter: not counted
    worker.wait()
    with OpCounter(torch.device("cpu")) as counter:
        worker.submit(_ops, 5)
        worker.wait()
        _ops(2)  # the calling thread's own
    worker.submit(_ops, 9)  # after: not counted
    worker.wait()
    # torch.zeros and one add per iteration
    assert counter.ops == (1 + 5) + (1 + 2)
