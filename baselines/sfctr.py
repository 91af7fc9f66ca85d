"""``sfctr``: ScaleFreeCTR's MixCache with virtual sparse ids (Guo et al., "ScaleFreeCTR:
MixCache-based Distributed Training System for CTR Models with Huge Embedding Table",
arXiv:2104.08542).

The tables, with their optimizer state, live in host memory; the device holds a cache of
``cache_ratio`` of the rows. The *host* plans every batch ahead of time: it maps the batch's
distinct rows to cache slots and rewrites the ids into those slots (the "virtual sparse ids"),
so the device does a plain dense lookup on its cache tensor. Victims are chosen (by ``lru``
or ``lfu``) only among slots that no running or queued batch uses, so a batch planned
``pipeline_depth`` steps ahead never disturbs the ones before it.

The pipeline: a planner thread plans the next ``pipeline_depth`` batches (seen through the
lookahead hook) while the device trains the current one; a batch's copies (evicted rows back
to the host, missing rows in) are applied in batch order, in ``prefetch`` of the step before
when its plan is ready, else just before its lookup. Applying in order is what keeps a row that
is evicted and re-admitted within the window right: its write-back precedes its reload.
``pipeline_depth: 0`` plans each batch in its own forward (every step waits for planning).
Each step ends when the plans queued during it are done (``end_step``): the planner's work is
timed in the step that started it, never left to run while the harness makes the next batch.

Semantics are exact: the same weights as ``device``.
"""

from __future__ import annotations

import math
import threading
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Literal

import torch
from pydantic import Field
from torch import Tensor

from embbench.plugin import (WORK_INSTRUMENT, BackgroundWorker, BuildContext, MemoryFootprint, RowSpace, RowStore, SparseFeatures,
                             SparseModule, Strategy, StrategyParams, TableWiseSharded, per_sample, pooled_lookup)

__all__ = ["MixCache", "SfctrParams", "SfctrStrategy"]

_COUNTER_NAMES = ("accesses", "unique_accesses", "hits", "misses", "unique_misses", "rows_admitted", "rows_loaded", "rows_evicted",
                  "rows_written_back", "bytes_h2d", "bytes_d2h", "host_syncs", "pipeline_stalls", "host_plan_us", "host_wait_us")


class SfctrParams(StrategyParams):
    cache_ratio: float = Field(0.015, gt=0, le=1, description="share of all rows held in the device cache")
    pipeline_depth: int = Field(2, ge=0, le=4, description=(
        "batches the host plans ahead of the one training (0: each batch is planned in its own step)"))
    policy: Literal["lru", "lfu"] = Field("lru", description="evict the least recently or least often used row")


@dataclass
class _Plan:
    """One batch resolved to cache slots by the host."""

    values: Tensor  # the batch's ids tensor: plans are matched to batches by it
    virtual_ids: Tensor  # the slot of every id, on the device
    slots: Tensor  # the distinct slots the batch uses (pinned until it has trained)
    load_rows: Tensor
    load_slots: Tensor
    evict_rows: Tensor
    evict_slots: Tensor
    applied: bool = False


class MixCache(SparseModule):
    """The MixCache on one rank (see the module docstring)."""

    def __init__(self, ctx: BuildContext, params: SfctrParams):
        super().__init__()
        self.params = params
        self.lookahead = params.pipeline_depth
        self.space = RowSpace(ctx.tables)
        self.device = ctx.env.device
        n, dim, width = self.space.num_rows, self.space.dim, ctx.optimizer.state_width
        self.capacity = c = max(1, min(n, math.ceil(params.cache_ratio * n)))
        self.row_bytes = (dim + width) * 4
        pinned = self.device.type == "cuda"
        self.host_weights = torch.empty(n, dim, pin_memory=pinned)
        self.space.fill_initial(self.host_weights, ctx.init_weights)
        self.host_state = ctx.optimizer.new_state(n, "cpu", pin_memory=pinned)
        self.store = RowStore(torch.zeros(c, dim, device=self.device), torch.zeros(c, width, device=self.device),
                              ctx.optimizer)
        ctx.configure(self.store)

        # The planner's state, on the host only (the device never sees it).
        self.slot_of_row = torch.full((n,), -1, dtype=torch.long)
        self.row_of_slot = torch.full((c,), -1, dtype=torch.long)
        self.pins = torch.zeros(c, dtype=torch.long)  # queued or running batches using each slot
        self.last_use = torch.zeros(c, dtype=torch.long)  # lru: plan tick of the slot's last use
        self.row_counts = torch.zeros(n, dtype=torch.long) if params.policy == "lfu" else None  # survive eviction
        self._tick = 0
        self._lock = threading.Lock()

        self._queue: deque[tuple[Tensor, Future]] = deque()  # planned batches not yet trained, in order
        self._unapplied: deque[_Plan] = deque()  # plans whose copies are still to be made, in order
        self._training: _Plan | None = None  # the batch whose step runs now
        self._planner = BackgroundWorker(self.device, "sfctr-plan") if params.pipeline_depth else None
        self._side_stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self._counts = dict.fromkeys(_COUNTER_NAMES, 0)

    # -- planning (the planner thread, or inline) ---------------------------------------------------

    def _rows_on_host(self, features: SparseFeatures, ready: torch.cuda.Event | None) -> Tensor:
        """The batch's global rows on the host. On CUDA they are computed and copied on a side
        stream after ``ready`` (recorded when the batch was handed over), so only this thread
        waits for them, never the training stream."""
        if ready is None:
            return self.space.global_rows(features).cpu()
        with torch.cuda.stream(self._side_stream):
            self._side_stream.wait_event(ready)
            rows = self.space.global_rows(features).to("cpu", non_blocking=True)
            self._side_stream.synchronize()
        return rows

    def _plan(self, features: SparseFeatures, ready: torch.cuda.Event | None, count: bool) -> _Plan:
        start = time.perf_counter()
        rows = self._rows_on_host(features, ready)
        unique, inverse = torch.unique(rows, return_inverse=True)
        if unique.numel() > self.capacity:
            raise ValueError(f"sfctr: a batch needs {unique.numel()} distinct rows but the cache holds "
                             f"{self.capacity} rows (cache_ratio={self.params.cache_ratio}); raise cache_ratio")
        with self._lock:
            slots = self.slot_of_row[unique]
            hit = slots >= 0
            self.pins[slots[hit]] += 1
            missing = unique[~hit]
            free = self.pins == 0
            if int(free.sum()) < missing.numel():
                self.pins[slots[hit]] -= 1
                raise ValueError(
                    f"sfctr: a batch needs {missing.numel()} more cache slots but only {int(free.sum())} of "
                    f"{self.capacity} are not in use by the batches in flight (the training one and up to "
                    f"pipeline_depth={self.params.pipeline_depth} planned ahead); raise cache_ratio or lower pipeline_depth")
            priority = self.last_use.clone() if self.row_counts is None else self.row_counts[self.row_of_slot.clamp(min=0)]
            priority[self.row_of_slot < 0] = -1  # empty slots go first
            priority[~free] = torch.iinfo(torch.long).max
            victims = torch.topk(priority, missing.numel(), largest=False, sorted=True).indices
            old = self.row_of_slot[victims]
            evicted = old >= 0
            self.slot_of_row[old[evicted]] = -1
            self.slot_of_row[missing] = victims
            self.row_of_slot[victims] = missing
            self.pins[victims] += 1
            slots[~hit] = victims
            self._tick += 1
            self.last_use[slots] = self._tick
            if self.row_counts is not None:
                self.row_counts.index_add_(0, unique, torch.bincount(inverse, minlength=unique.numel()))
        virtual = slots[inverse]
        if self._side_stream is not None:
            virtual = virtual.pin_memory()
        plan = _Plan(features.values, virtual.to(self.device, non_blocking=True), slots, missing, victims,
                     old[evicted], victims[evicted])
        self._unapplied.append(plan)  # plans are made one at a time, so this is plan order
        if count:
            ids_hit = int(hit[inverse].sum())
            self._add(accesses=rows.numel(), unique_accesses=unique.numel(), hits=ids_hit, misses=rows.numel() - ids_hit,
                      unique_misses=missing.numel(), rows_admitted=missing.numel(), rows_loaded=missing.numel(),
                      rows_evicted=int(evicted.sum()),
                      rows_written_back=int(evicted.sum()), bytes_h2d=missing.numel() * self.row_bytes + virtual.numel() * 8,
                      bytes_d2h=int(evicted.sum()) * self.row_bytes,
                      host_plan_us=int((time.perf_counter() - start) * 1e6))
        return plan

    def _add(self, **values: int) -> None:
        with self._lock:
            for name, value in values.items():
                self._counts[name] += value

    def _submit(self, features: SparseFeatures) -> None:
        """Queue the batch's plan (on the planner thread when there is one)."""
        ready = None if self._side_stream is None else _recorded(self.device)
        if self._planner is not None:
            future = self._planner.submit(self._plan, features, ready, True)
        else:
            future = Future()
            future.set_result(self._plan(features, ready, True))
        self._queue.append((features.values, future))

    def _planned(self, values: Tensor) -> Future | None:
        return next((f for v, f in self._queue if v is values), None)

    # -- copies, in plan order (the main thread) ----------------------------------------------------

    def _apply_through(self, plan: _Plan) -> None:
        """Make the copies of every plan up to ``plan``, in the order they were planned."""
        while not plan.applied:
            step = self._unapplied.popleft()
            if step.evict_slots.numel():
                evict = step.evict_slots.to(self.device)
                self.host_weights[step.evict_rows] = self.store.weights[evict].cpu()
                self.host_state[step.evict_rows] = self.store.state[evict].cpu()
                self._add(host_syncs=int(self.device.type == "cuda"))
            if step.load_slots.numel():
                load = step.load_slots.to(self.device)
                self.store.weights[load] = self.host_weights[step.load_rows].to(self.device, non_blocking=True)
                self.store.state[load] = self.host_state[step.load_rows].to(self.device, non_blocking=True)
            step.applied = True

    def _unpin(self, plan: _Plan) -> None:
        with self._lock:
            self.pins[plan.slots] -= 1

    def _drain(self) -> None:
        """Finish every queued plan, make its copies, and forget the queue (before evaluation
        or flush: batches planned but never trained release their slots)."""
        plans = [f.result() for _, f in self._queue]
        if plans:
            self._apply_through(plans[-1])
        self._queue.clear()
        if self._training is not None:
            plans.append(self._training)
            self._training = None
        for plan in plans:
            self._unpin(plan)

    # -- the SparseModule interface ---------------------------------------------------------------

    def _release_trained(self) -> None:
        """The previous training batch has updated its rows: its slots may be evicted now."""
        if self._training is not None:
            self._unpin(self._training)
            self._training = None

    def look_ahead(self, upcoming: list[SparseFeatures]) -> None:
        self._release_trained()  # called at the start of a step, after the last one's backward
        for features in upcoming:
            if self._planned(features.values) is None:
                self._submit(features)

    def prefetch(self, features: SparseFeatures) -> None:
        """The next batch's copies now, if its plan is ready (never waits for the planner)."""
        if self._planner is None:
            return
        future = self._planned(features.values)
        if future is None:
            self._submit(features)  # no lookahead (e.g. behind table-wise placement): plan one ahead
        elif future.done():
            self._apply_through(future.result())

    def forward(self, features: SparseFeatures) -> Tensor:
        offsets = features.offsets().to(self.device)
        if not torch.is_grad_enabled():
            self._drain()
            plan = self._plan(features, None if self._side_stream is None else _recorded(self.device), count=False)
            self._apply_through(plan)
            self._unpin(plan)
            return per_sample(pooled_lookup(self.store, plan.virtual_ids, offsets, self.device), features)
        self._release_trained()
        future = self._planned(features.values)
        if future is None:  # the first batch, or no lookahead: planned now, trained first
            self._submit(features)
            self._queue.rotate(1)
            future = self._queue[0][1]
        if self._planner is None or not future.done():
            self._add(pipeline_stalls=1)  # this step waits for its own planning
        plan = future.result()
        while self._queue[0][1] is not future:
            stale = self._queue.popleft()[1].result()  # planned, never trained
            self._apply_through(stale)
            self._unpin(stale)
        self._queue.popleft()
        self._apply_through(plan)
        self._training = plan
        return per_sample(pooled_lookup(self.store, plan.virtual_ids, offsets, self.device), features)

    def end_step(self) -> None:
        """The plans queued in this step are timed in it (they may be for later batches)."""
        if self._planner is not None:
            self._planner.wait()

    def instruments(self) -> dict[str, str]:
        return dict(WORK_INSTRUMENT)

    def set_counting(self, mode) -> None:
        for store in (self.store,):  # its work counters: the harness's, off in timed steps
            store.counting = mode != "off"

    def counters(self) -> dict[str, int]:
        with self._lock:
            counts = dict(self._counts)
        if self._planner is not None:  # the step's ends waiting for the planner
            for name, value in self._planner.counters().items():
                counts[name] += value
        return {**counts, **self.store.work_counters()}

    def memory(self) -> MemoryFootprint:
        device = self.store.weights.nbytes + self.store.state.nbytes
        host = self.host_weights.nbytes + self.host_state.nbytes
        maps = sum(t.nbytes for t in (self.slot_of_row, self.row_of_slot, self.pins, self.last_use))
        maps += self.row_counts.nbytes if self.row_counts is not None else 0
        if self.device.type == "cuda":
            return MemoryFootprint(device_bytes=device, pinned_bytes=host, host_bytes=maps)
        return MemoryFootprint(device_bytes=device, host_bytes=host + maps)

    def flush(self) -> list[Tensor]:
        """Every cached row back to the host, then the host tables."""
        self._drain()
        cached = self.row_of_slot >= 0
        slots = torch.nonzero(cached).flatten()
        self.host_weights[self.row_of_slot[slots]] = self.store.weights[slots.to(self.device)].cpu()
        self.host_state[self.row_of_slot[slots]] = self.store.state[slots.to(self.device)].cpu()
        return [t.clone() for t in self.space.split(self.host_weights)]

    def extra_metrics(self) -> dict:
        return {"capacity_rows": self.capacity, "policy": self.params.policy, "pipeline_depth": self.params.pipeline_depth}

    def __del__(self):
        if getattr(self, "_planner", None) is not None:
            self._planner.shutdown()


def _recorded(device: torch.device) -> torch.cuda.Event:
    event = torch.cuda.Event()
    event.record(torch.cuda.current_stream(device))
    return event


class SfctrStrategy(Strategy):
    name = "sfctr"
    summary = "ScaleFreeCTR MixCache: host tables, a device cache planned on the host ahead of time (virtual ids)"
    Params = SfctrParams

    def estimate_memory(self, tables, optimizer, world_size):
        n = sum(t.num_rows for t in tables) // world_size  # per rank, roughly: placement is by table
        row_bytes = (tables[0].dim + optimizer.state_width) * 4
        cached = max(1, math.ceil(self.params.cache_ratio * n))
        per_row = 8 + (8 if self.params.policy == "lfu" else 0)  # slot of each row, lfu counts
        return MemoryFootprint(device_bytes=cached * row_bytes, host_bytes=n * (row_bytes + per_row) + cached * 24)

    def build(self, ctx: BuildContext) -> SparseModule:
        if ctx.env.world_size == 1:
            return MixCache(ctx, self.params)
        return TableWiseSharded(ctx, lambda local: MixCache(local, self.params))
