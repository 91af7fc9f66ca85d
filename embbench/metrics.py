"""Measurement: synchronised step timing, summary statistics, accuracy, memory probes."""

from __future__ import annotations

import math
import resource
import statistics
import threading
import time
from typing import Any

import torch
from torch import Tensor

__all__ = ["belady_hit_rate", "belady_hit_rates", "StepTimer", "summarize", "speed_figures", "auc_logloss", "peak_rss_bytes",
           "device_memory", "OpCounter", "miss_rate", "warmed_up"]


class StepTimer:
    """Times regions with no pending device work at either end.

    On CUDA it records events on the current stream and synchronises at the end; on the CPU
    it reads a monotonic clock (CPU ops are synchronous).
    """

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"

    def __enter__(self) -> "StepTimer":
        if self.cuda:
            torch.cuda.synchronize()
            self._start = torch.cuda.Event(enable_timing=True)
            self._end = torch.cuda.Event(enable_timing=True)
            self._start.record()
        else:
            self._t0 = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        if self.cuda:
            self._end.record()
            self._end.synchronize()
            self.seconds = self._start.elapsed_time(self._end) / 1e3
        else:
            self.seconds = time.perf_counter() - self._t0


class OpCounter:
    """Counts the ATen operator calls issued inside it (forward, backward and optimizer alike)
    and, on CUDA, the operations that made the host wait for the device. A region compiled with
    ``torch.compile`` runs compiled here too: its ATen calls are counted, its fused kernels not.

    It sees every op through a TorchDispatchMode, which slows the ops it watches: use it on
    extra, untimed steps only. A dispatch mode watches one thread: a strategy's own threads
    count their ops into the counter active when their work was handed to them
    (:attr:`active`, :meth:`watch`; see :class:`embbench.worker.BackgroundWorker`).
    """

    #: The counter whose ``with`` block is running (on any thread), if one is.
    active: "OpCounter | None" = None

    def __init__(self, device: torch.device):
        self.cuda = device.type == "cuda"
        self.ops = 0
        self.host_syncs: int | None = 0 if self.cuda else None
        self._lock = threading.Lock()

    def watch(self):
        """A context manager that counts the ops the calling thread issues inside it."""
        from torch.utils._python_dispatch import TorchDispatchMode

        counter = self

        class _Count(TorchDispatchMode):
            @classmethod
            def ignore_compile_internals(cls) -> bool:
                # A compiled region (torch.compile) runs compiled, not eagerly, while it is
                # counted: its fused kernels are not ATen ops; the ops it dispatches (library
                # kernels it calls, such as sort) are counted.
                return True

            def __init__(self):
                super().__init__()
                self.ops = 0

            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                self.ops += 1
                return func(*args, **(kwargs or {}))

            def __exit__(self, *exc):
                super().__exit__(*exc)
                with counter._lock:  # threads add their counts one at a time
                    counter.ops += self.ops

        return _Count()

    def __enter__(self) -> "OpCounter":
        self._mode = self.watch()
        self._mode.__enter__()
        OpCounter.active = self
        if self.cuda:
            import warnings

            self._warnings = warnings.catch_warnings(record=True)
            self._caught = self._warnings.__enter__()
            warnings.simplefilter("always")
            self._sync_mode = torch.cuda.get_sync_debug_mode()
            torch.cuda.set_sync_debug_mode("warn")
        return self

    def __exit__(self, *exc) -> None:
        OpCounter.active = None
        self._mode.__exit__(*exc)
        if self.cuda:
            torch.cuda.set_sync_debug_mode(self._sync_mode)
            self.host_syncs = sum("synchronizing" in str(w.message) for w in self._caught)
            self._warnings.__exit__(*exc)


def miss_rate(before: dict[str, int], after: dict[str, int]) -> float | None:
    """Misses per access between two counter snapshots (per distinct row where only those are
    counted); None when the strategy counts no misses."""
    for misses, accesses in (("misses", "accesses"), ("unique_misses", "unique_accesses")):
        if misses in after and accesses in after:
            n = after[accesses] - before.get(accesses, 0)
            return (after[misses] - before.get(misses, 0)) / n if n else None
    return None


def warmed_up(window_rates: list[float | None], tolerance: float = 0.002) -> bool:
    """Whether a cache is steady: no miss rate to watch, or the last window's miss rate is no
    longer lower than the one before by more than ``tolerance`` (absolute)."""
    if not window_rates:
        return False
    if window_rates[-1] is None:
        return True
    return len(window_rates) >= 2 and window_rates[-2] is not None and window_rates[-1] >= window_rates[-2] - tolerance


def _percentile(sorted_values: list[float], q: float) -> float:
    """Linear-interpolated percentile (numpy's default) of sorted values."""
    pos = (len(sorted_values) - 1) * q
    lo, hi = math.floor(pos), math.ceil(pos)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def summarize(samples: list[float]) -> dict[str, Any]:
    """min, max, mean, median, p95, stddev, iqr and the raw samples."""
    s = sorted(samples)
    return {
        "n": len(s),
        "min": s[0],
        "max": s[-1],
        "mean": statistics.fmean(s),
        "median": statistics.median(s),
        "p95": _percentile(s, 0.95),
        "stddev": statistics.stdev(s) if len(s) > 1 else 0.0,
        "iqr": _percentile(s, 0.75) - _percentile(s, 0.25),
        "samples": samples,
    }


def speed_figures(step_seconds: list[float], steps_per_repeat: int, samples_per_step: int) -> tuple[dict, dict]:
    """A record's ``step_time_s`` and ``throughput``: every step summarized, and the speed over
    repeats (:mod:`embbench.stats`): the median of the repeat medians and, from the same statistic,
    the throughput; each with its interval (None without scipy, said in ``ci95_missing``)."""
    from embbench.optional import MissingDependency
    from embbench.stats import repeat_medians, summarize_repeats

    medians = repeat_medians(step_seconds, steps_per_repeat)
    step_time = {**summarize(step_seconds), "repeat_medians": medians, "median_of_repeats": statistics.median(medians)}
    throughput: dict[str, Any] = {"unit": "samples/s (global)", "statistic": "global batch / median of repeat medians",
                                  "per_repeat": [samples_per_step / m for m in medians],
                                  "median": samples_per_step / step_time["median_of_repeats"]}
    try:
        repeats = summarize_repeats(medians)
        step_time["ci95"], throughput["ci95"] = repeats.step_interval_s, repeats.throughput(samples_per_step)[1]
    except MissingDependency as e:  # the measurement stands; only its interval is missing
        step_time["ci95"] = throughput["ci95"] = None
        throughput["ci95_missing"] = str(e)
    return step_time, throughput


def auc_logloss(logits: Tensor, labels: Tensor) -> tuple[float, float]:
    """ROC AUC (torchmetrics) and mean log-loss of logits against 0/1 labels."""
    from torchmetrics.functional.classification import binary_auroc

    logits, labels = logits.float().cpu(), labels.float().cpu()
    auc = float(binary_auroc(torch.sigmoid(logits), labels.long()))
    logloss = float(torch.nn.functional.binary_cross_entropy_with_logits(logits, labels))
    return auc, logloss


def peak_rss_bytes() -> int:
    """This process's peak resident set size."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def device_memory(device: torch.device) -> dict[str, int | None]:
    """Peak allocated and reserved device bytes since the last reset (None on the CPU)."""
    if device.type != "cuda":
        return {"peak_allocated_bytes": None, "peak_reserved_bytes": None}
    return {
        "peak_allocated_bytes": torch.cuda.max_memory_allocated(device),
        "peak_reserved_bytes": torch.cuda.max_memory_reserved(device),
    }


def belady_hit_rate(steps: list[Tensor], capacity: int, skip: int = 0, prefilled: bool = False) -> float | None:
    """The hit rate per access of Belady's MIN (see :func:`belady_hit_rates`)."""
    return belady_hit_rates(steps, capacity, skip, prefilled)[0]


def belady_hit_rates(steps: list[Tensor], capacity: int, skip: int = 0,
                     prefilled: bool = False) -> tuple[float | None, float | None]:
    """The hit rates of Belady's MIN on this id stream at this capacity: per access, and per
    distinct row of each step (what a perfect cache would have to move).

    Rows are counted once per step (a step's repeated ids of a row share its fate), MIN with
    bypass: after each step the cache keeps the rows whose next use comes soonest, so a
    missing row is admitted only in place of a cached row used later; of rows next used in
    the same step, the one with more ids there is kept. This is the optimum per distinct row
    and step (any order of equal next uses is); per access (weighted by repeats) it is MIN's
    choice with that tie-break, near-optimal, not a strict bound. (Without the tie-break,
    when more rows recur in every step than the cache holds, MIN keeps an arbitrary share of
    them and falls far below a frequency policy per access.) Steps before ``skip`` are
    simulated but not counted, so the bound covers the same window as the cache it is
    compared with. ``prefilled``: the cache starts full of the best rows for free (as a
    cache preloaded at warm-up does), i.e. a row that finds a free slot counts as a hit.
    """
    import heapq

    unique_counts = []
    for ids in steps:
        rows, counts = torch.unique(ids, return_counts=True)
        unique_counts.append(dict(zip(rows.tolist(), counts.tolist())))
    # A row's rank after each step: (when it is next used, minus its ids then); lower is kept.
    never = (len(steps), 0)
    next_use: list[dict[int, tuple[int, int]]] = [{} for _ in steps]
    upcoming: dict[int, tuple[int, int]] = {}
    for t in range(len(steps) - 1, -1, -1):
        for row, count in unique_counts[t].items():
            next_use[t][row] = upcoming.get(row, never)
            upcoming[row] = (t, -count)
    cached: dict[int, tuple[int, int]] = {}  # row -> its rank
    heap: list[tuple[int, int, int]] = []  # (minus the rank, row): the worst on top; stale entries are skipped
    hits = accesses = distinct_hits = distinct = 0
    for t, rows in enumerate(unique_counts):
        counted = t >= skip
        distinct += len(rows) if counted else 0
        missing: list[int] = []
        for row, count in rows.items():
            accesses += count if counted else 0
            if row in cached:
                hits += count if counted else 0
                distinct_hits += counted
                when, more = cached[row] = next_use[t][row]
                heapq.heappush(heap, (-when, -more, row))
            else:
                missing.append(row)
        # After the step the cache keeps the best-ranked rows: admit a missing row only in
        # place of a cached one ranked worse (or into a free slot).
        for row in sorted(missing, key=lambda r: next_use[t][r]):
            if len(cached) < capacity and prefilled and counted:
                hits += rows[row]
                distinct_hits += 1
            if len(cached) >= capacity:
                while cached.get(heap[0][2]) != (-heap[0][0], -heap[0][1]):
                    heapq.heappop(heap)  # stale
                if (-heap[0][0], -heap[0][1]) <= next_use[t][row]:
                    continue
                del cached[heapq.heappop(heap)[2]]
            when, more = cached[row] = next_use[t][row]
            heapq.heappush(heap, (-when, -more, row))
    if not accesses:
        return None, None
    return hits / accesses, distinct_hits / distinct
