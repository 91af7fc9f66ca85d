"""Measurement: synchronised step timing, summary statistics, accuracy, memory probes."""

from __future__ import annotations

import collections
import math
import resource
import statistics
import threading
import time
from typing import Any

import torch
from torch import Tensor

__all__ = ["instrument_costs", "memory_tiers", "tiers_by_table", "belady_hit_rate", "belady_hit_rates", "StepTimer", "summarize",
           "speed_figures", "auc_logloss", "peak_rss_bytes", "device_memory", "OpCounter", "miss_rate", "warmed_up",
           "UNSTABLE_LOSS_RATIO", "too_few_eval_samples", "unstable_training", "accuracy_warnings"]

#: A training loss this many times the first step's says the optimizer overshot. The scenarios'
#: old dense Adagrad at lr 0.05 reached 1.7e6 at step 1 (from 0.69) and recovered; a run that does
#: is chaotic: a 1e-7 relative nudge of the initial weights moved its log loss by 1.2e-2 after
#: 112 steps (docs/measurement.md), so accuracy differences between its cells are not the
#: strategies'.
UNSTABLE_LOSS_RATIO = 10.0


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
        #: the calls of each operator by name (``index_add_``, ``sort``): what a test asserts a
        #: step does not issue
        self.by_name: collections.Counter[str] = collections.Counter()
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
                self.by_name: collections.Counter[str] = collections.Counter()

            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                self.ops += 1
                self.by_name[func.overloadpacket.__name__] += 1
                return func(*args, **(kwargs or {}))

            def __exit__(self, *exc):
                super().__exit__(*exc)
                with counter._lock:  # threads add their counts one at a time
                    counter.ops += self.ops
                    counter.by_name.update(self.by_name)

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


def memory_tiers(c: dict[str, int], steps: int, row_bytes: int, page_bytes: int = 4096) -> list[dict[str, Any]] | None:
    """``metrics.tiers``: where each distinct row a batch needs was found, per tier, from a
    cache's counters over ``steps`` timed steps (None: the strategy counts no tiers).

    ``hbm`` is the cache on the device, ``dram`` the host memory below it, ``nvme`` a drive
    below that (freqcache's ``store: file``; without it the host table is the last tier).
    Per tier: ``hit_rate`` is the share of all (distinct-per-batch) accesses it served,
    ``hit_rate_of_reaching`` the share of the accesses that reached it (FBGEMM #5777: the
    second falls as the tier above grows); its traffic a step with the tier below it (rows
    read into it, written out of it: the device's with host memory, host memory's with the
    drive; the drive, last, its own reads and writes); on the drive its I/Os (4 KiB pages), read amplification
    (bytes read over the useful rows' bytes), what the step waited for it (stall) and the I/Os a
    second it achieved while reading (pages moved over the time the reader had one in flight).
    """
    reached = c.get("unique_accesses")
    if not reached or "unique_misses" not in c:
        return None
    per_step = (lambda v: v / steps) if steps else (lambda v: None)

    def share(part: int, whole: int) -> float | None:
        return part / whole if whole else None

    # a row found on the device is one not loaded (a miss may find its row in a staging slot)
    # (rows_loaded where a cache counts it: sfctr's bytes_h2d carries a batch's virtual ids too)
    loaded = c["rows_loaded"] if "rows_loaded" in c else c.get("bytes_h2d", 0) // max(1, row_bytes)
    hbm_hits = reached - loaded
    tiers = [{"tier": "hbm", "hit_rate": share(hbm_hits, reached), "hit_rate_of_reaching": share(hbm_hits, reached),
              "hit_rate_per_access": share(c.get("hits", 0), c.get("accesses", 0)),
              "reaching_per_step": per_step(reached),
              "rows_read_per_step": per_step(loaded), "bytes_read_per_step": per_step(loaded * row_bytes),
              "rows_written_per_step": per_step(c.get("rows_written_back", 0)),
              "bytes_written_per_step": per_step(c.get("bytes_d2h", 0))}]
    if "dram_loads" not in c:
        tiers.append({"tier": "dram", "hit_rate": share(reached - hbm_hits, reached), "hit_rate_of_reaching": 1.0 if
                      reached - hbm_hits else None, "reaching_per_step": per_step(reached - hbm_hits)})
        return tiers
    loads, misses = loaded, c["dram_load_misses"]
    if "nvme_pages_read" not in c:  # a table's share (tiers_by_table): pages hold rows of several tables
        tiers.append(_dram_tier(c, reached, loads, misses, per_step, share, row_bytes))
        tiers.append({"tier": "nvme", "hit_rate": share(misses, reached), "hit_rate_of_reaching": 1.0 if misses else None,
                      "reaching_per_step": per_step(misses), "rows_read_per_step": per_step(misses)})
        return tiers
    pages_read, pages_written = c["nvme_pages_read"], c["nvme_pages_written"]
    reads_s = c["nvme_read_ns"] / 1e9
    tiers.append(_dram_tier(c, reached, loads, misses, per_step, share, row_bytes, pages=(pages_read, pages_written, page_bytes)))
    tiers.append({"tier": "nvme", "hit_rate": share(misses, reached), "hit_rate_of_reaching": 1.0 if misses else None,
                  "reaching_per_step": per_step(misses),
                  "rows_read_per_step": per_step(misses), "bytes_read_per_step": per_step(pages_read * page_bytes),
                  "bytes_written_per_step": per_step(pages_written * page_bytes),
                  "pages_read_per_step": per_step(pages_read), "pages_written_per_step": per_step(pages_written),
                  "ios_per_step": per_step(pages_read + pages_written),
                  "pages_read_on_demand_per_step": per_step(c["nvme_pages_read_on_demand"]),
                  "pages_read_for_writes_per_step": per_step(c.get("nvme_pages_read_for_writes", 0)),
                  # the pages read for rows the device needed, over those rows' bytes (a patch's
                  # read, to merge a written row into a page, brings none)
                  "read_amplification": share((pages_read - c.get("nvme_pages_read_for_writes", 0)) * page_bytes,
                                              misses * row_bytes),
                  "stall_seconds_per_step": per_step(c["stall_ns"] / 1e9),
                  # pages the reader's engine moved over the time it had one in flight (older
                  # records: the pages read ahead over the reading jobs' time)
                  "reads_per_second": share(c.get("nvme_engine_ios", c.get("nvme_pages_read_ahead", 0)), reads_s)
                  if reads_s else None})
    return tiers


def _dram_tier(c: dict[str, int], reached: int, loads: int, misses: int, per_step, share, row_bytes: int,
               pages: tuple[int, int, int] | None = None) -> dict:
    """Host memory's tier: its traffic with the drive below it (the device's with host memory is
    the hbm row's): the rows it lacked, in the pages read for them and the pages written out;
    a table's share (``pages`` None: a page holds rows of several tables) in its rows' bytes."""
    tier = {"tier": "dram", "hit_rate": share(loads - misses, reached), "hit_rate_of_reaching": share(loads - misses, loads),
            "reaching_per_step": per_step(loads), "rows_read_per_step": per_step(misses),
            "write_misses_per_step": per_step(c["dram_write_misses"])}
    if pages is None:
        return {**tier, "bytes_read_per_step": per_step(misses * row_bytes)}
    pages_read, pages_written, page_bytes = pages
    return {**tier, "bytes_read_per_step": per_step(pages_read * page_bytes),
            "bytes_written_per_step": per_step(pages_written * page_bytes)}


def tiers_by_table(c: dict[str, int], steps: int, row_bytes: int) -> dict[str, list[dict[str, Any]]] | None:
    """``metrics.tiers_by_table``: :func:`memory_tiers` of each table, from its ``table.<name>.*``
    counters (freqcache's): the same tiers and rates; the drive's rows, not its pages (a page may
    hold rows of several tables). None where no table is counted."""
    tables: dict[str, dict[str, int]] = {}
    for key, value in c.items():
        if key.startswith("table."):
            name, counter = key[len("table."):].rsplit(".", 1)
            tables.setdefault(name, {})[counter] = value
    if not tables:
        return None
    out = {}
    for name, t in tables.items():
        counts = {"unique_accesses": t.get("unique_accesses", 0), "unique_misses": 0,
                  "bytes_h2d": t.get("rows_loaded", 0) * row_bytes, "rows_written_back": t.get("rows_written_back", 0),
                  "bytes_d2h": t.get("rows_written_back", 0) * row_bytes,
                  **{k: v for k, v in t.items() if k.startswith("dram_")}}
        out[name] = memory_tiers(counts, steps, row_bytes)
    return out


def instrument_costs(instruments: dict[str, str], timed: tuple[int, int], timed_seconds: list[float],
                     counted: tuple[int, int], counted_seconds: list[float]) -> list[dict[str, Any]]:
    """``metrics.instruments``: each of the harness's instruments in a cell (name -> what it
    records), the training steps it ran in (``steps``, [first, end): the counted steps, right
    after the timed ones, ``timed``: whether any step it ran in was timed) and what it cost,
    measured in the same run: the counted steps' median step less the timed steps' (the same
    code but for the instruments), per step and as a share of the timed step. Several
    instruments share one figure (they run together); below the steps' noise it may be negative."""
    if not instruments:
        return []
    timed_step, counted_step = statistics.median(timed_seconds), statistics.median(counted_seconds)
    cost = counted_step - timed_step
    overlap = counted[0] < timed[1] and timed[0] < counted[1]
    return [{"name": name, "what": what, "steps": list(counted), "timed": overlap, "counted_step_s": counted_step,
             "cost_s_per_step": cost, "cost_share": cost / timed_step}
            for name, what in sorted(instruments.items())]


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


def auc_logloss(logits: Tensor, labels: Tensor) -> tuple[float | None, float, str | None]:
    """ROC AUC (torchmetrics) and mean log-loss of logits against 0/1 labels, and why there
    is no AUC: it is undefined over one class (torchmetrics would say 0)."""
    from torchmetrics.functional.classification import binary_auroc

    logits, labels = logits.float().cpu(), labels.float().cpu()
    logloss = float(torch.nn.functional.binary_cross_entropy_with_logits(logits, labels))
    positives = int(labels.sum())
    if positives in (0, labels.numel()):
        return None, logloss, (f"undefined: all {labels.numel()} evaluation labels are "
                               f"{'positive' if positives else 'negative'} (AUC needs both classes)")
    return float(binary_auroc(torch.sigmoid(logits), labels.long())), logloss, None


def unstable_training(accuracy: dict[str, Any] | None) -> str | None:
    """Why a cell's accuracy says little about its strategy (its training loss spiked far above
    the first step's), or None."""
    accuracy = accuracy or {}
    first, peak = accuracy.get("train_loss_first"), accuracy.get("train_loss_peak")
    if first is None or peak is None or peak <= UNSTABLE_LOSS_RATIO * first:
        return None
    return (f"unstable training: the loss reached {peak:.3g} at step {accuracy.get('train_loss_peak_step')} "
            f"(the first was {first:.3g}): accuracy differences between cells are the training's chaos, "
            f"not the strategies' (lower the learning rate)")


def too_few_eval_samples(accuracy: dict[str, Any] | None) -> str | None:
    """Why a cell's AUC means little: its 95% interval (1.96 standard errors over the
    evaluation samples, DeLong) reaches 0.5, a coin's AUC; or None (also without a standard
    error: an older record, or no scipy)."""
    accuracy = accuracy or {}
    auc, error = accuracy.get("auc"), accuracy.get("auc_standard_error")
    if auc is None or error is None or abs(auc - 0.5) > 1.96 * error:
        return None
    return (f"too few evaluation samples: AUC {auc:.3f} ± {1.96 * error:.3f} (95%, {accuracy.get('eval_samples', '?'):,} "
            f"samples) cannot be told from chance (0.5); score more held-out rows (data.eval, run.eval_batches)")


def accuracy_warnings(accuracy: dict[str, Any] | None) -> list[str]:
    """Why a cell's AUC is not to be read (:func:`unstable_training`, :func:`too_few_eval_samples`):
    the lines under the results table, recommend's caveats and what keeps the AUC column shown."""
    return [w for w in (unstable_training(accuracy), too_few_eval_samples(accuracy)) if w]


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
    Computed by :func:`embbench.cache.curve.min_hits` (vectorised: about a second for 64
    batches of the Criteo-Kaggle shape).
    """
    from embbench.cache.curve import min_hits, step_rows  # embbench.cache imports this module

    hits, accesses, distinct_hits, distinct = min_hits(step_rows([s.cpu().numpy() for s in steps]), capacity, skip,
                                                       prefilled)
    if not accesses:
        return None, None
    return hits / accesses, distinct_hits / distinct
