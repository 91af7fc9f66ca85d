"""A frequency-aware software cache of embedding rows on the compute device (freqcache v2).

The full tables, with their optimizer state side by side (``[rows, dim + state]``), stay in
host memory (pinned on CUDA). The device holds one fused row space for all tables: a slot
tensor of weights and one of optimizer state, indexed by slot, so a step does one lookup
and one optimizer update whatever the number of tables.

Which row sits in which slot is decided on the host by :class:`~embbench.cache.policy.SlotPlanner`
(LFU over a count-min sketch with decay, eviction by frequency and look-ahead, TinyLFU
admission). The planner needs the batch's ids on the host: ids of the batches the runner
looks ahead to are copied there early (on their own stream on CUDA), so planning reads no
device value in steady state. Each plan then moves rows as contiguous staged blocks:
dirty victims are gathered on the device and copied to a pinned buffer (applied to the
host table before the next gather), missing rows are gathered on the host into a pinned
buffer and copied in, all on a side stream on CUDA. The CPU runs the same code, with plain
buffers and synchronous copies.

The next batch is planned and moved while the current one computes (``prefetch``). Its
plan may evict rows of the running step (as Belady would); the copies out of and into those
slots (the plan's late part, a gather and a scatter on the device, the host copies already
staged) wait for the next forward, when that step has ended, so nothing a running step uses
is overwritten.
With ``plan_thread`` that work (and the look-ahead bookkeeping) runs on a background thread,
beside the step's forward and backward, instead of between them; the step ends when it is
done (``end_step``), so its time stays in the step's.
"""

from __future__ import annotations

import contextlib
import math
import time
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Literal

import numpy as np
import torch
from pydantic import Field
from torch import Tensor

from embbench.cache.policy import Plan, SlotPlanner
from embbench.data.batch import SparseFeatures
from embbench.embedding import RowSpace, RowStore, per_sample, pooled_lookup
from embbench.metrics import belady_hit_rates
from embbench.optim import EmbeddingOptimizer
from embbench.sharding import TableWiseSharded
from embbench.strategy import BuildContext, MemoryFootprint, SparseModule, Strategy, StrategyParams
from embbench.worker import BackgroundWorker

__all__ = ["FreqCache", "FreqCacheParams", "FreqCacheStrategy"]


class FreqCacheParams(StrategyParams):
    cache_ratio: float = Field(0.015, gt=0, le=1, description="share of all rows held on the device")
    policy: Literal["static", "lfu"] = Field("lfu", description="frequencies from the profile only, or counted as training goes")
    admission: Literal["all", "tinylfu"] = Field("tinylfu", description="admit every missing row, or only one more frequent than its victim")
    lookahead: int = Field(8, ge=0, description="upcoming training batches whose rows are evicted last (and whose ids reach the host early)")
    decay_every: int = Field(256, ge=0, description="halve the frequency counts every N training batches (0: never)")
    profile_batches: int = Field(32, ge=0, description="training batches profiled for frequencies and the preload")
    prefetch: bool = Field(True, description="plan and load the next batch's rows while this one computes")
    plan_thread: bool = Field(True, description="do that planning and loading on a background thread, beside the step's compute")
    belady_steps: int = Field(64, ge=0, description="training steps recorded for the Belady bound (0: off)")


@dataclass
class _Upcoming:
    """A batch's ids, sorted on the device (fixed-size ops), on their way to the host.

    ``packed`` (on the host; pinned on CUDA) is ``[2, ids]``: the global rows sorted, and 1
    where a new row starts. ``order`` and ``group`` stay on the device: the position in the
    batch of each sorted id, and the index of its distinct row, so that the device turns the
    plan's slot per distinct row into a slot per id.
    """

    values: Tensor  # the batch's ids tensor, held so that its identity stays unique
    packed: Tensor
    copied: torch.cuda.Event | None
    order: Tensor
    group: Tensor
    unique: tuple[np.ndarray, np.ndarray] | None = None  # (distinct rows, ids of each)
    expected: bool = False

    def distinct(self) -> tuple[np.ndarray, np.ndarray]:
        if self.unique is None:
            sorted_rows, starts = self.packed.numpy()
            first = np.flatnonzero(starts)
            self.unique = sorted_rows[first], np.diff(first, append=len(sorted_rows))
        return self.unique


@dataclass
class _Late:
    """A plan's copies out of and into slots the running step still used (done at the next
    forward): dirty rows to write back, and rows already copied to the device, to scatter."""

    out_slots: Tensor
    out_rows: np.ndarray
    out_at: int  # where in the pinned write-back buffer they go (after the plan's other write-backs)
    in_slots: Tensor
    rows: Tensor


@dataclass
class _Buffers:
    """Pinned host buffers, two of each used in turn, with the event of the copy that last
    read or wrote each (none on the CPU)."""

    rows_in: list[Tensor]
    index: list[Tensor]
    rows_out: Tensor
    events: dict[tuple[str, int], torch.cuda.Event] = field(default_factory=dict)


class FreqCache(SparseModule):
    """The cache module on one rank (see the module docstring)."""

    def __init__(self, ctx: BuildContext, params: FreqCacheParams):
        super().__init__()
        self.params = params
        self.lookahead = params.lookahead if params.prefetch else 0
        self.space = RowSpace(ctx.tables)
        self.device = ctx.env.device
        self.cuda = self.device.type == "cuda"
        self.optimizer: EmbeddingOptimizer = ctx.optimizer
        n, dim, width = self.space.num_rows, self.space.dim, ctx.optimizer.state_width
        self.num_rows, self.dim = n, dim
        self.capacity = max(1, min(n, math.ceil(params.cache_ratio * n)))
        self.row_bytes = (dim + width) * 4
        self.max_ids = ctx.local_batch_size * sum(t.bag_size for t in ctx.tables)
        self.planner = SlotPlanner(n, self.capacity, self.max_ids, params.admission, learn=params.policy == "lfu",
                                   decay_every=params.decay_every)

        # Host table: each row beside its optimizer state, so one gather moves both.
        self.host = torch.zeros(n, dim + width, pin_memory=self.cuda)
        self.space.fill_initial(self.host[:, :dim], ctx.init_weights)
        slots = self.planner.num_slots
        self.cache_weights = torch.zeros(slots, dim, device=self.device)
        self.cache_state = torch.zeros(slots, width, device=self.device)
        self.store = RowStore(self.cache_weights, self.cache_state, self.optimizer)

        # Frequency profile of training batches only (BuildContext never offers eval data);
        # the most frequent rows are preloaded.
        profiled = [self.space.global_rows(batch.sparse.to(self.device)).cpu().numpy()
                    for batch in ctx.train_batches(params.profile_batches)]
        hot = torch.from_numpy(self.planner.profile(profiled))
        warm = self.host[hot].to(self.device)  # preloaded into slots 0..len-1
        self.cache_weights[: len(hot)] = warm[:, :dim]
        self.cache_state[: len(hot)] = warm[:, dim:]
        del profiled, warm

        pin = self.cuda
        self._pinned = _Buffers(
            rows_in=[torch.empty(self.max_ids, dim + width, pin_memory=pin) for _ in range(2)],
            index=[torch.empty(4 * self.max_ids, dtype=torch.long, pin_memory=pin) for _ in range(2)],
            rows_out=torch.empty(2 * self.max_ids, dim + width, pin_memory=pin),
        )
        self._side = torch.cuda.Stream(self.device) if self.cuda else None
        self._id_copies = torch.cuda.Stream(self.device) if self.cuda else None
        # Write-backs copied out to the pinned buffer, not yet applied to the host table:
        # (the copy's event, host rows, offset in the buffer).
        self._pending_write_back: list[tuple[torch.cuda.Event | None, Tensor, int]] = []
        self._late: _Late | None = None
        self._upcoming: dict[int, _Upcoming] = {}
        self._prefetched: tuple[Tensor, Tensor, int] | None = None  # (the batch's ids, their slots, plan)
        self._prefetch_task: Future | None = None  # the worker's task that sets _prefetched
        self._running: int | None = None  # the plan of the last forwarded batch
        self._own = {"host_syncs": 0, "pipeline_stalls": 0, "host_plan_us": 0}
        # Everything below that the planner touches (planner, _upcoming, _prefetched, _own's
        # plan counters, the Belady recording) is touched by one thread at a time: the
        # worker's tasks run in order, and the training thread waits for them first.
        self._worker = BackgroundWorker(self.device, "freqcache-plan") if params.prefetch and params.plan_thread else None
        # The Belady window: the first belady_steps training batches after warm-up.
        self._warmup_steps = ctx.warmup_steps
        self._observed = 0
        self._recorded: list[np.ndarray] = []
        self._window_start: dict[str, int] | None = None
        self._window_end: dict[str, int] | None = None

    # -- ids on the host -------------------------------------------------------------------------

    def look_ahead(self, upcoming: list[SparseFeatures]) -> None:
        self._in_background(self._look_ahead, list(upcoming))

    def _look_ahead(self, upcoming: list[SparseFeatures]) -> None:
        """Start copying the upcoming batches' rows to the host; count the rows of those
        already there as upcoming (they are then evicted last)."""
        for features in upcoming:
            entry = self._upcoming.get(id(features.values))
            if entry is None or entry.values is not features.values:
                self._upcoming[id(features.values)] = self._copy_rows(features)
        for entry in self._upcoming.values():  # in look-ahead order: the planner ranks by entry order
            if entry.expected:
                continue
            if entry.copied is not None and not entry.copied.query():
                break  # a later batch enters only after this one
            self.planner.expect(entry.distinct()[0], +1)
            entry.expected = True

    def _copy_rows(self, features: SparseFeatures) -> _Upcoming:
        rows = self.space.global_rows(features.to(self.device))
        sorted_rows, order = rows.sort()
        starts = torch.ones_like(sorted_rows)
        torch.ne(sorted_rows[1:], sorted_rows[:-1], out=starts[1:])
        group = torch.cumsum(starts, 0) - 1
        packed = torch.stack([sorted_rows, starts])
        if not self.cuda:
            return _Upcoming(features.values, packed, None, order, group)
        host = torch.empty(packed.shape, dtype=packed.dtype, pin_memory=True)
        self._id_copies.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(self._id_copies):
            host.copy_(packed, non_blocking=True)
            copied = torch.cuda.Event()
            copied.record()
        packed.record_stream(self._id_copies)
        return _Upcoming(features.values, host, copied, order, group)

    def _host_rows(self, features: SparseFeatures) -> _Upcoming:
        """The batch's ids, sorted, on the host (its distinct rows counted out of the window)."""
        entry = self._upcoming.pop(id(features.values), None)
        if entry is None or entry.values is not features.values:
            entry = self._copy_rows(features)
            self._own["host_syncs"] += int(self.cuda)  # not looked ahead: its ids are waited for
        elif entry.copied is not None and not entry.copied.query():
            self._own["pipeline_stalls"] += 1  # looked ahead, but its copy is not done yet
        if entry.copied is not None:
            entry.copied.synchronize()
        if entry.expected:
            self.planner.expect(entry.distinct()[0], -1)  # no longer upcoming: it is this batch
        return entry

    # -- planning and moving rows ------------------------------------------------------------------

    def _plan(self, features: SparseFeatures, train: bool, running: int | None) -> tuple[Plan, _Upcoming]:
        start = time.perf_counter()
        entry = self._host_rows(features)
        closes = train and self._observe(entry)
        plan = self.planner.plan(entry.distinct(), train, running)
        if closes:
            self._window_end = self._counters()
        self._own["host_plan_us"] += round((time.perf_counter() - start) * 1e6)
        return plan, entry

    def _wait(self, key: tuple[str, int]) -> None:
        """Wait (counted as a stall) until the copy that last used a pinned buffer is done."""
        event = self._pinned.events.pop(key, None)
        if event is not None and not event.query():
            self._own["pipeline_stalls"] += 1
            event.synchronize()

    def _mark(self, key: tuple[str, int]) -> None:
        if self.cuda:
            event = torch.cuda.Event()
            event.record()
            self._pinned.events[key] = event

    def _finish_write_back(self) -> None:
        """Apply the write-backs copied out to the pinned buffer to the host table."""
        for event, rows, at in self._pending_write_back:
            if event is not None and not event.query():
                self._own["pipeline_stalls"] += 1
                event.synchronize()
            self.host.index_copy_(0, rows, self._pinned.rows_out[at : at + len(rows)])
        self._pending_write_back = []

    def _copy_out(self, slots: Tensor, rows: np.ndarray, at: int) -> None:
        """Dirty slots: one gather on the device, one copy into the pinned buffer at ``at``."""
        out = torch.cat([self.cache_weights.index_select(0, slots), self.cache_state.index_select(0, slots)], 1)
        self._pinned.rows_out[at : at + len(rows)].copy_(out, non_blocking=True)
        event = None
        if self.cuda:
            event = torch.cuda.Event()
            event.record()
        self._pending_write_back.append((event, torch.from_numpy(rows), at))
        if not self.cuda:
            self._finish_write_back()

    def _scatter(self, slots: Tensor, rows: Tensor) -> None:
        self.cache_weights.index_copy_(0, slots, rows[:, : self.dim])
        self.cache_state.index_copy_(0, slots, rows[:, self.dim :])

    def _on_side(self):
        """The side stream on CUDA, after the work queued so far on the training stream."""
        if not self.cuda:
            return contextlib.nullcontext()
        self._side.wait_stream(torch.cuda.current_stream(self.device))
        return torch.cuda.stream(self._side)

    def _move(self, plan: Plan, entry: _Upcoming) -> Tensor:
        """Do a plan's copies (on the side stream on CUDA) but its late part (kept for
        :meth:`_apply_late`); returns the slot of each id of the batch, on the device."""
        b, turn = self._pinned, plan.id % 2
        with self._on_side():
            self._finish_write_back()  # a row copied out by the last plan may be loaded now
            n_out, n_in = len(plan.write_back_slots), len(plan.load_slots)
            early_out, early_in = n_out - plan.late_write_backs, n_in - plan.late_loads
            packed = np.concatenate([plan.write_back_slots, plan.load_slots, plan.slots])
            if self.cuda:  # all of a plan's indices in one copy
                self._wait(("index", turn))
                b.index[turn][: len(packed)].numpy()[:] = packed
                index = b.index[turn][: len(packed)].to(self.device, non_blocking=True)
                self._mark(("index", turn))
            else:
                index = torch.from_numpy(packed)
            out_slots, in_slots = index[:n_out], index[n_out : n_out + n_in]
            if early_out:  # dirty victims: one gather, one copy out
                self._copy_out(out_slots[:early_out], plan.write_back_rows[:early_out], at=0)
            rows = index.new_empty(0)
            if n_in:  # missing rows: one host gather into pinned memory, one copy in
                self._wait(("rows", turn))
                staged = b.rows_in[turn][:n_in]
                torch.index_select(self.host, 0, torch.from_numpy(plan.load_rows), out=staged)
                rows = staged.to(self.device, non_blocking=True)
                self._mark(("rows", turn))
                self._scatter(in_slots[:early_in], rows[:early_in])
            if plan.late_write_backs or plan.late_loads:
                self._late = _Late(out_slots[early_out:], plan.write_back_rows[early_out:], early_out,
                                   in_slots[early_in:], rows[early_in:])
            # The slot of each distinct row, spread to the ids that use it.
            slots = torch.empty_like(entry.order).index_copy_(0, entry.order, index[n_out + n_in :][entry.group])
        if self.cuda:
            slots.record_stream(torch.cuda.current_stream(self.device))
            entry.order.record_stream(self._side)
            entry.group.record_stream(self._side)
        return slots

    def _apply_late(self) -> None:
        """The last plan's late part, now that the step that used those slots has ended:
        write back its dirty rows first, then scatter the rows loaded into those slots."""
        late, self._late = self._late, None
        if late is None:
            return
        with self._on_side():
            if len(late.out_rows):
                self._copy_out(late.out_slots, late.out_rows, at=late.out_at)
            if len(late.in_slots):
                self._scatter(late.in_slots, late.rows)

    # -- the SparseModule interface ------------------------------------------------------------

    def _in_background(self, fn, *args) -> Future | None:
        """Run ``fn`` on the worker thread if there is one, else now."""
        if self._worker is None:
            fn(*args)
            return None
        return self._worker.submit(fn, *args)

    def _join(self, until: Future | None = None) -> None:
        """Wait for the worker's tasks, or those up to ``until`` (the training thread reads
        what they wrote next)."""
        if self._worker is not None:
            self._worker.wait(until)

    def forward(self, features: SparseFeatures) -> Tensor:
        # The prefetch task wrote _prefetched; look-ahead tasks after it may go on (they touch
        # only the planner's window and the id copies, which this path does not read).
        prefetch, self._prefetch_task = self._prefetch_task, None
        if prefetch is not None:
            self._join(until=prefetch)
        self._apply_late()  # the step that used those slots has ended (its work is queued before this)
        prefetched, self._prefetched = self._prefetched, None
        if prefetched is not None and prefetched[0] is features.values:
            slots, self._running = prefetched[1], prefetched[2]
        else:  # no step is running now: only this batch's rows are kept
            self._join()
            plan, entry = self._plan(features, torch.is_grad_enabled(), running=None)
            slots, self._running = self._move(plan, entry), plan.id
        if self.cuda:
            torch.cuda.current_stream(self.device).wait_stream(self._side)
        offsets = features.offsets().to(self.device)
        return per_sample(pooled_lookup(self.store, slots, offsets, self.device), features)

    def prefetch(self, features: SparseFeatures) -> None:
        """Plan the next batch and move its rows now; the running batch's slots are kept."""
        if self.params.prefetch:
            self._prefetch_task = self._in_background(self._prefetch, features, self._running)

    def _prefetch(self, features: SparseFeatures, running: int | None) -> None:
        plan, entry = self._plan(features, True, running=running)
        self._prefetched = (features.values, self._move(plan, entry), plan.id)  # the tensor itself: an id() could be reused

    def end_step(self) -> None:
        """The next batch's planning and copies belong to this step's time: wait for them."""
        self._join()
        if self.cuda:
            torch.cuda.current_stream(self.device).wait_stream(self._side)

    def _observe(self, entry: _Upcoming) -> bool:
        """A training batch, about to be planned: the recorded stream for the Belady bound and
        its counter window. Returns whether this batch closes the window."""
        step = self._observed
        self._observed += 1
        start, stop = self._warmup_steps, self._warmup_steps + self.params.belady_steps
        if not self.params.belady_steps or step >= stop:
            return False
        self._recorded.append(entry.packed[0].numpy().copy())  # the batch's rows, one per id (sorted)
        if step == start:
            self._window_start = self._counters()
        return step == stop - 1

    # -- reporting -----------------------------------------------------------------------------

    def counters(self) -> dict[str, int]:
        self._join()
        return self._counters()

    def _counters(self) -> dict[str, int]:
        c = dict(self.planner.counters)
        loaded = c.pop("rows_loaded")
        own = {**self._own, "host_wait_us": 0}
        if self._worker is not None:  # its waits for the planning thread
            for name, value in self._worker.counters().items():
                own[name] += value
        return {**c, "bytes_h2d": loaded * self.row_bytes, "bytes_d2h": c["rows_written_back"] * self.row_bytes, **own}

    def memory(self) -> MemoryFootprint:
        self._join()
        device = self.cache_weights.nbytes + self.cache_state.nbytes
        b = self._pinned
        staging = sum(t.nbytes for t in (*b.rows_in, *b.index, b.rows_out))
        host = self.planner.nbytes
        if self.cuda:
            return MemoryFootprint(device_bytes=device, host_bytes=host, pinned_bytes=self.host.nbytes + staging)
        return MemoryFootprint(device_bytes=device, host_bytes=host + self.host.nbytes + staging)

    def flush(self) -> list[Tensor]:
        """Write every dirty slot back, then return the tables."""
        self._join()
        self._apply_late()
        if self.cuda:
            torch.cuda.current_stream(self.device).wait_stream(self._side)
        self._finish_write_back()
        slots, rows = self.planner.dirty_slots()
        index = torch.from_numpy(slots).to(self.device)
        out = torch.cat([self.cache_weights[index], self.cache_state[index]], 1).cpu()
        self.host.index_copy_(0, torch.from_numpy(rows), out)
        self.planner.clean()
        return [t.clone() for t in self.space.split(self.host[:, : self.dim])]

    def extra_metrics(self) -> dict:
        """Belady's MIN on the recorded training stream at this capacity (per access and per
        distinct row of each batch), beside this cache's own rates on the same window."""
        self._join()
        out: dict = {"capacity_rows": self.capacity, "slots": self.planner.num_slots, "policy": self.params.policy,
                     "admission": self.params.admission, "lookahead": self.lookahead}
        if self._window_start is None:
            return out
        end = self._window_end if self._window_end is not None else self._counters()  # a run shorter than the window
        window = {k: end[k] - self._window_start[k] for k in end}
        # MIN from the window's start with the best possible content for free (the rows used
        # soonest): a bound for any preload, the profile's included.
        stream = [torch.from_numpy(r) for r in self._recorded[self._warmup_steps :]]
        per_access, per_distinct = belady_hit_rates(stream, self.capacity, prefilled=True)
        out.update(
            belady_hit_rate=per_access,
            belady_unique_hit_rate=per_distinct,
            window_hit_rate=window["hits"] / max(1, window["accesses"]),
            window_unique_hit_rate=1 - window["unique_misses"] / max(1, window["unique_accesses"]),
            window_accesses=window["accesses"],
            belady_window=[self._warmup_steps, len(self._recorded)],
        )
        return out


class FreqCacheStrategy(Strategy):
    name = "freqcache"
    summary = "frequency-aware software cache: host tables, the hottest rows (and their optimizer state) on the device"
    Params = FreqCacheParams

    def estimate_memory(self, tables, optimizer, world_size):
        n = sum(t.num_rows for t in tables)
        row_bytes = (tables[0].dim + optimizer.state_width) * 4
        n = n // world_size  # per rank, roughly: placement is by table
        cached = max(1, math.ceil(self.params.cache_ratio * n))
        # cache rows + per-slot maps; per row: int32 rank and slot, and an int64 count for lfu
        per_row = 8 + (8 if self.params.policy == "lfu" else 0)
        return MemoryFootprint(device_bytes=cached * (row_bytes + 10) + n * per_row, host_bytes=n * (row_bytes + 8))

    def build(self, ctx: BuildContext) -> SparseModule:
        if ctx.env.world_size == 1:
            return FreqCache(ctx, self.params)
        # Each rank owns and caches whole tables, sized by the same ratio of its rows.
        return TableWiseSharded(ctx, lambda local: FreqCache(local, self.params))
