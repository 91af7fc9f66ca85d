"""A strategy's background thread: work it hands off so that the training thread goes on.

Strategies that plan on the host (sfctr) run that planning here, beside the
step's device work. :class:`BackgroundWorker` keeps the measurements true for that work:

* its tasks run one at a time, in the order given, on the strategy's device (a new thread
  starts on CUDA device 0 otherwise);
* the operators a task issues are counted by the runner's :class:`~embbench.metrics.OpCounter`
  when the task was handed over while one was counting (a dispatch mode sees one thread only);
* :meth:`wait` says how long the caller waited, so a strategy can report the part of its
  background work that a step could not hide (``host_wait_us``), and re-raises a task's error
  in the training thread, where the cell records it.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Callable
from concurrent import futures
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

from embbench.metrics import OpCounter

__all__ = ["BackgroundWorker"]


class BackgroundWorker:
    """One background thread running tasks in order."""

    def __init__(self, device: torch.device, name: str):
        self._executor = ThreadPoolExecutor(1, thread_name_prefix=name, initializer=_use_device, initargs=(device,))
        self._pending: list[Future] = []
        self.stalls = 0  # waits that blocked
        self.wait_seconds = 0.0  # time they blocked

    def submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        """Run ``fn(*args)`` after every task submitted before it."""
        future = self._executor.submit(_run_counted, OpCounter.active, fn, *args)
        self._pending.append(future)
        return future

    def wait(self, until: Future | None = None) -> None:
        """Wait until every submitted task is done, or only those up to ``until`` (a future
        :meth:`submit` returned; the later ones go on). A task's exception is raised here (the
        first one, in submission order). A wait that blocks counts in :attr:`stalls` and
        :attr:`wait_seconds`."""
        if until is None:
            count = len(self._pending)
        else:  # 0 if it was waited for already
            count = next((i + 1 for i, f in enumerate(self._pending) if f is until), 0)
        done, self._pending = self._pending[:count], self._pending[count:]
        if any(not f.done() for f in done):
            self.stalls += 1
            start = time.perf_counter()
            futures.wait(done)
            self.wait_seconds += time.perf_counter() - start
        for future in done:
            future.result()

    def counters(self) -> dict[str, int]:
        """``pipeline_stalls`` and ``host_wait_us`` (see :data:`~embbench.strategy.COUNTERS`)."""
        return {"pipeline_stalls": self.stalls, "host_wait_us": round(self.wait_seconds * 1e6)}

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)


def _use_device(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.set_device(device)


def _run_counted(counter: OpCounter | None, fn: Callable[..., Any], *args: Any) -> Any:
    with counter.watch() if counter is not None else contextlib.nullcontext():
        return fn(*args)
