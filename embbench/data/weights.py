"""The tables' initial weights: every strategy and every rank starts from the same numbers."""

from __future__ import annotations

import math
import os
from concurrent.futures import ThreadPoolExecutor
from typing import Callable, Iterable, TypeVar

import torch

from embbench.data.presets import TableSpec
from embbench.data.synthetic import _mix

__all__ = ["fill_in_parallel", "initial_weights"]

_INIT_CHUNK = 1 << 16

Job = TypeVar("Job")


def initial_weights(table: TableSpec, index: int, seed: int, start: int, stop: int) -> torch.Tensor:
    """Rows ``[start, stop)`` of a table's initial weights, uniform in +-1/sqrt(rows).

    Generated in fixed chunks with their own seeds, so any row range can be produced
    without the rows before it, and every strategy and rank gets the same numbers. A chunk
    inside the range is generated straight into the result and scaled in place (the same
    float operations as ``rand * (2 * bound) - bound``: the same bits, without temporaries).
    """
    bound = 1.0 / math.sqrt(table.num_rows)
    out = torch.empty(max(0, stop - start), table.dim)
    for chunk in range(start // _INIT_CHUNK, (stop - 1) // _INIT_CHUNK + 1 if stop > start else 0):
        g = torch.Generator().manual_seed(_mix(seed, 10, index, chunk))
        lo = chunk * _INIT_CHUNK
        rows = min(_INIT_CHUNK, table.num_rows - lo)
        a, b = max(start, lo), min(stop, lo + rows)
        target = out[a - start : b - start]
        if (a, b) == (lo, lo + rows):
            torch.rand(rows, table.dim, generator=g, out=target)
        else:  # a part of the chunk: generate all of it (the same numbers), keep the part
            target.copy_(torch.rand(rows, table.dim, generator=g)[a - lo : b - lo])
        target.mul_(2 * bound).sub_(bound)
    return out


def fill_in_parallel(fill: Callable[[Job], None], jobs: Iterable[Job], workers: int | None = None) -> None:
    """``fill(job)`` for every job, on a thread per core (up to ``workers``).

    The CPU generator is serial, and a full-size model's tables take tens of CPU-seconds, so
    the chunks of initial weights are made side by side (torch releases the GIL in its ops).
    Each job must write rows no other job writes: the result does not depend on the order.
    """
    jobs = list(jobs)
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    workers = max(1, min(workers or cores, len(jobs)))
    if workers == 1:
        for job in jobs:
            fill(job)
        return
    with ThreadPoolExecutor(workers) as pool:
        for done in pool.map(fill, jobs):  # re-raises a job's exception
            del done
