"""A frequency-aware software cache of embedding rows on the compute device.

The full tables, with their optimizer state, stay in host memory; the device holds
``capacity`` rows of all tables (one shared cache). A profile of training batches ranks
the rows by frequency, and the host copy is stored in rank order, so a row's index is its
rank: warm-up preloads the hottest ``capacity`` rows, and the ``static`` policy evicts the
coldest cached row by rank. The ``lfu`` policy starts from the profile's counts, counts
every training access, and keeps the counts across eviction.

Each step the batch's rows are resolved to cache slots with fixed-size tensor ops (no
data-dependent shapes): sort the ids, find the first occurrence of each missing row, pick
victims with ``topk`` over slot priorities (slots this batch or the prefetched one uses
are excluded), write dirty victims (row *and* optimizer state) back, load the missing rows
(row and state), and update the two maps. Writes that a fixed-size op must do anyway go to
a trash slot / trash row at the end of each array. Counters are device tensors, read only
when asked for.

A batch whose distinct rows cannot all be cached (more than the free capacity) is trained
through an explicit bypass: its uncached rows are gathered from the host, updated with the
same math, and written back; nothing is admitted.
"""

from __future__ import annotations

import math
from typing import Literal

import torch
from pydantic import Field
from torch import Tensor

from embbench.data.batch import SparseFeatures
from embbench.embedding import RowSpace, RowStore, per_sample, pooled_lookup
from embbench.metrics import belady_hit_rate
from embbench.optim import EmbeddingOptimizer
from embbench.sharding import TableWiseSharded
from embbench.strategy import BuildContext, MemoryFootprint, SparseModule, Strategy, StrategyParams

__all__ = ["FreqCache", "FreqCacheParams", "FreqCacheStrategy"]

_COUNTER_NAMES = ("accesses", "unique_accesses", "hits", "misses", "unique_misses", "rows_admitted",
                  "rows_evicted", "rows_written_back", "bytes_h2d", "bytes_d2h")


class FreqCacheParams(StrategyParams):
    cache_ratio: float = Field(0.015, gt=0, le=1, description="share of all rows held on the device")
    policy: Literal["static", "lfu"] = Field("lfu", description="evict by profile rank, or by counts that survive eviction")
    profile_batches: int = Field(32, ge=0, description="training batches profiled for frequency ranks")
    prefetch: bool = Field(True, description="admit the next batch's rows while this one computes")
    belady_steps: int = Field(64, ge=0, description="training steps recorded for the Belady bound (0: off)")


def _alloc_host(shape: tuple[int, ...], device: torch.device) -> Tensor:
    """Host memory the compute device can read and write without the CPU.

    On CUDA, fbgemm's host-mapped unified tensor (zero-copy over PCIe, so gathers and
    write-backs are device kernels with no host synchronisation); on the CPU, plain memory.
    """
    if device.type == "cuda":
        import fbgemm_gpu  # noqa: F401  (registers torch.ops.fbgemm)

        proto = torch.empty(0, device=device)
        return torch.ops.fbgemm.new_unified_tensor(proto, list(shape), True).zero_()
    return torch.zeros(shape)


class _CacheStore(RowStore):
    """The cache slots as a RowStore: backward marks updated slots dirty."""

    def __init__(self, cache: "FreqCache"):
        super().__init__(cache.cache_weights, cache.cache_state, cache.optimizer)
        self.cache = cache

    def apply_gradient(self, rows: Tensor, offsets: Tensor, grad_pooled: Tensor) -> None:
        super().apply_gradient(rows, offsets, grad_pooled)
        self.cache.slot_dirty[rows] = True


class _BypassStore(RowStore):
    """The distinct rows of a batch too large to cache, gathered from the cache or the host.

    Index ``i`` is ``rows[i]``; after the update each row goes back where it came from
    (cached slots are protected, so they are still there), and nothing is admitted.
    """

    def __init__(self, cache: "FreqCache", rows: Tensor):
        c = cache
        self.cache, self.slot = cache, c.row_to_slot[rows].long()
        self.cached = self.slot >= 0
        self.host_rows = rows[~self.cached].to(c.host_weights.device)
        weights = torch.empty(rows.numel(), c.cache_weights.shape[1], device=c.device)
        state = torch.empty(rows.numel(), c.cache_state.shape[1], device=c.device)
        weights[self.cached] = c.cache_weights[self.slot[self.cached]]
        state[self.cached] = c.cache_state[self.slot[self.cached]]
        weights[~self.cached] = c.host_weights[self.host_rows].to(c.device)
        state[~self.cached] = c.host_state[self.host_rows].to(c.device)
        super().__init__(weights, state, c.optimizer)

    def apply_gradient(self, rows: Tensor, offsets: Tensor, grad_pooled: Tensor) -> None:
        super().apply_gradient(rows, offsets, grad_pooled)
        c, slots = self.cache, self.slot[self.cached]
        c.cache_weights[slots] = self.weights[self.cached]
        c.cache_state[slots] = self.state[self.cached]
        c.slot_dirty[slots] = True
        c.host_weights[self.host_rows] = self.weights[~self.cached].to(c.host_weights.device)
        c.host_state[self.host_rows] = self.state[~self.cached].to(c.host_state.device)


class FreqCache(SparseModule):
    """The cache module on one rank (see the module docstring)."""

    def __init__(self, ctx: BuildContext, params: FreqCacheParams):
        super().__init__()
        self.params = params
        self.space = RowSpace(ctx.tables)
        self.device = ctx.env.device
        self.optimizer: EmbeddingOptimizer = ctx.optimizer
        n, dim, width = self.space.num_rows, self.space.dim, ctx.optimizer.state_width
        self.num_rows = n
        self.capacity = c = max(1, min(n, math.ceil(params.cache_ratio * n)))
        self.row_bytes = (dim + width) * 4

        # Frequency profile of training batches only (BuildContext never offers eval data).
        counts = torch.zeros(n, dtype=torch.long, device=self.device)
        for batch in ctx.train_batches(params.profile_batches):
            rows = self.space.global_rows(batch.sparse.to(self.device))
            counts.index_add_(0, rows, torch.ones_like(rows))
        order = torch.sort(counts, descending=True, stable=True).indices  # rank -> global row
        # Per-row maps are what a cache pays for every row of the tables: int32, and the
        # inverse permutation (needed only to flush) on the host.
        self.rank_of_row = torch.empty(n, dtype=torch.int32, device=self.device)
        self.rank_of_row[order] = torch.arange(n, dtype=torch.int32, device=self.device)
        self.row_of_rank = order.cpu()

        # Host copy in rank order, plus one trash row at index n.
        self.host_weights = _alloc_host((n + 1, dim), self.device)
        self.host_state = _alloc_host((n + 1, width), self.device)
        rank_of_row_host = self.rank_of_row.cpu()
        self.space.fill_initial(self.host_weights, ctx.init_weights, position=lambda rows: rank_of_row_host[rows].long())

        # Device side: C slots plus a trash slot at index c.
        self.cache_weights = torch.zeros(c + 1, dim, device=self.device)
        self.cache_state = torch.zeros(c + 1, width, device=self.device)
        self.slot_to_row = torch.full((c + 1,), n, dtype=torch.long, device=self.device)
        self.row_to_slot = torch.full((n + 1,), -1, dtype=torch.int32, device=self.device)
        self.slot_dirty = torch.zeros(c + 1, dtype=torch.bool, device=self.device)
        self.slot_protected = torch.zeros(c + 1, dtype=torch.bool, device=self.device)
        # LFU counts live per row, so they survive eviction; the trash row counts -1.
        self.row_counts = torch.cat([counts[order], counts.new_full((1,), -1)]) if params.policy == "lfu" else None
        del counts, order
        self._counters = torch.zeros(len(_COUNTER_NAMES), dtype=torch.long, device=self.device)
        self.store = _CacheStore(self)

        # Warm-up: the hottest rows, clean.
        hot = torch.arange(c, device=self.device)
        self.cache_weights[:c] = self.host_weights[:c].to(self.device)
        self.cache_state[:c] = self.host_state[:c].to(self.device)
        self.slot_to_row[:c] = hot
        self.row_to_slot[:c] = hot.to(torch.int32)

        self._prefetched: tuple[Tensor, Tensor] | None = None  # (the batch's ids, their rows)
        self._side_stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self._protected_bound = 0  # ids of the batch whose slots are protected
        self._bypassed = False
        # The Belady window: the first belady_steps training batches after warm-up.
        self._warmup_steps = ctx.warmup_steps
        self._observed = 0
        self._recorded: list[Tensor] = []
        self._window_start: Tensor | None = None
        self._window_end: Tensor | None = None
        self._close_window = False

    # -- bookkeeping ---------------------------------------------------------------------------

    def _priority(self) -> Tensor:
        """Eviction priority of each slot (lowest goes first); empty slots are lowest."""
        if self.params.policy == "lfu":
            return self.row_counts[self.slot_to_row[: self.capacity]]
        return -self.slot_to_row[: self.capacity]

    def _count(self, **values: Tensor | int) -> None:
        for name, v in values.items():
            self._counters[_COUNTER_NAMES.index(name)] += v

    def _admit(self, rows: Tensor, count: bool) -> Tensor:
        """Make every row of ``rows`` resident; return the slot of each. Needs the batch's
        distinct rows to fit in the unprotected slots (checked by the caller)."""
        n, c = self.num_rows, self.capacity
        sorted_rows, _ = rows.sort()
        first = torch.ones_like(sorted_rows, dtype=torch.bool)
        first[1:] = sorted_rows[1:] != sorted_rows[:-1]
        slot_before = self.row_to_slot[sorted_rows].long()
        missing = first & (slot_before < 0)

        in_use = self.slot_protected.clone()
        in_use[torch.where(slot_before >= 0, slot_before, c)] = True
        priority = self._priority().masked_fill(in_use[:c], torch.iinfo(torch.long).max)
        k = min(rows.numel(), c)
        victims = torch.topk(priority, k, largest=False, sorted=True).indices
        slot = torch.where(missing, victims[(torch.cumsum(missing, 0) - 1).clamp(0, k - 1)], c)

        # Evict: dirty victims (row and optimizer state) go back to the host.
        old_rows = self.slot_to_row[slot]
        evicted = missing & (old_rows < n)
        write_back = evicted & self.slot_dirty[slot]
        target = torch.where(write_back, old_rows, n).to(self.host_weights.device)
        self.host_weights.index_copy_(0, target, self.cache_weights[slot].to(self.host_weights.device))
        self.host_state.index_copy_(0, target, self.cache_state[slot].to(self.host_state.device))
        self.row_to_slot[torch.where(evicted, old_rows, n)] = -1

        # Admit: the missing rows (and their state) come in, clean.
        load = torch.where(missing, sorted_rows, n)
        load_host = load.to(self.host_weights.device)
        self.cache_weights.index_copy_(0, slot, self.host_weights[load_host].to(self.device))
        self.cache_state.index_copy_(0, slot, self.host_state[load_host].to(self.device))
        self.slot_to_row[slot] = load
        self.row_to_slot[load] = slot.to(torch.int32)
        self.slot_dirty[slot] = False
        self.row_to_slot[n], self.slot_to_row[c] = -1, n  # the trash stays trash

        if count:
            num_missing = missing.sum()
            self._count(accesses=rows.numel(), unique_accesses=first.sum(), hits=(slot_before >= 0).sum(),
                misses=(slot_before < 0).sum(),
                unique_misses=num_missing, rows_admitted=num_missing, rows_evicted=evicted.sum(),
                rows_written_back=write_back.sum(), bytes_h2d=num_missing * self.row_bytes,
                bytes_d2h=write_back.sum() * self.row_bytes)
        return self.row_to_slot[rows].long()

    def _fits(self, rows: Tensor, may_sync: bool = True) -> bool:
        """Whether the distinct rows of ``rows`` fit the unprotected slots. Free of host
        synchronisation when even all ids would fit; else one count is read (if allowed)."""
        free = self.capacity - self._protected_bound
        if rows.numel() <= free:
            return True
        return may_sync and int(torch.unique(rows).numel()) <= free

    def _observe(self, rows: Tensor) -> None:
        """A training batch, seen once, when it is first resolved (in forward or prefetch):
        LFU counts, the recorded stream for the Belady bound, and its counter window."""
        if self.row_counts is not None:
            self.row_counts.index_add_(0, rows, torch.ones_like(rows))
        step = self._observed
        self._observed += 1
        window = range(self._warmup_steps, self._warmup_steps + self.params.belady_steps)
        if self.params.belady_steps and step < window.stop:
            self._recorded.append(rows.detach().clone())
            if step == window.start:
                self._window_start = self._counters.clone()
            if step == window.stop - 1:
                self._close_window = True  # snapshot once this batch is counted

    # -- the SparseModule interface ------------------------------------------------------------

    def _ranked_rows(self, features: SparseFeatures) -> Tensor:
        return self.rank_of_row[self.space.global_rows(features.to(self.device))].long()

    def forward(self, features: SparseFeatures) -> Tensor:
        training = torch.is_grad_enabled()
        offsets = features.offsets().to(self.device)
        prefetched, self._prefetched = self._prefetched, None
        if self._side_stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(self._side_stream)
        self.slot_protected.zero_()
        self._protected_bound = 0
        if prefetched is not None and prefetched[0] is features.values:
            rows = prefetched[1]
            slots = self.row_to_slot[rows].long()
        else:
            rows = self._ranked_rows(features)
            if training:
                self._observe(rows)
            if not self._fits(rows):
                return self._bypass(features, rows, offsets, training)
            slots = self._admit(rows, count=training)
        self._snapshot_window()
        self.slot_protected[slots] = True
        self._protected_bound = rows.numel()
        self._bypassed = False
        return per_sample(pooled_lookup(self.store, slots, offsets, self.device), features)

    def prefetch(self, features: SparseFeatures) -> None:
        """Admit the next batch's rows now (on a side stream on CUDA); the current batch's
        slots are protected, so nothing it uses is evicted under it."""
        if not self.params.prefetch or self._bypassed:
            return  # after a bypass, an admitted row could be staler than its host copy
        rows = self._ranked_rows(features)
        if not self._fits(rows, may_sync=False):
            # Only when both batches' ids fit for sure: a host read here would stall the
            # step mid-way. The batch is then admitted (or bypassed) in its own forward.
            return
        self._observe(rows)
        if self._side_stream is None:
            self._admit(rows, count=True)
        else:
            self._side_stream.wait_stream(torch.cuda.current_stream(self.device))
            with torch.cuda.stream(self._side_stream):
                self._admit(rows, count=True)
            rows.record_stream(self._side_stream)
        self._snapshot_window()
        self._prefetched = (features.values, rows)  # the tensor itself: an id() could be reused

    def _bypass(self, features: SparseFeatures, rows: Tensor, offsets: Tensor, training: bool) -> Tensor:
        """A batch whose distinct rows exceed the free slots: train it from where its rows are."""
        unique, position = torch.unique(rows, return_inverse=True)
        store = _BypassStore(self, unique)
        self.slot_protected[store.slot[store.cached]] = True
        self._protected_bound = rows.numel()
        self._bypassed = True
        if training:
            hits = (self.row_to_slot[rows] >= 0).sum()
            from_host = (~store.cached).sum() * self.row_bytes  # gathered, then written back
            self._count(accesses=rows.numel(), unique_accesses=unique.numel(), hits=hits,
                        misses=rows.numel() - hits, unique_misses=(~store.cached).sum(),
                        bytes_h2d=from_host, bytes_d2h=from_host)
            self._snapshot_window()
        return per_sample(pooled_lookup(store, position, offsets, self.device), features)

    def _snapshot_window(self) -> None:
        if self._close_window:
            self._window_end = self._counters.clone()
            self._close_window = False

    # -- reporting -----------------------------------------------------------------------------

    def counters(self) -> dict[str, int]:
        return dict(zip(_COUNTER_NAMES, self._counters.tolist()))

    def memory(self) -> MemoryFootprint:
        device = sum(t.nbytes for t in (self.cache_weights, self.cache_state, self.slot_to_row, self.row_to_slot,
                                        self.slot_dirty, self.slot_protected, self.rank_of_row)
                     ) + (self.row_counts.nbytes if self.row_counts is not None else 0)
        host = self.host_weights.nbytes + self.host_state.nbytes + self.row_of_rank.nbytes
        if self.device.type == "cuda":
            return MemoryFootprint(device_bytes=device, pinned_bytes=host)
        return MemoryFootprint(device_bytes=device, host_bytes=host)

    def flush(self) -> list[Tensor]:
        """Write every dirty cached row back, then return the tables in their original order."""
        if self._side_stream is not None:
            torch.cuda.current_stream(self.device).wait_stream(self._side_stream)
        c, n = self.capacity, self.num_rows
        dirty = self.slot_dirty[:c] & (self.slot_to_row[:c] < n)
        target = torch.where(dirty, self.slot_to_row[:c], n).to(self.host_weights.device)
        self.host_weights.index_copy_(0, target, self.cache_weights[:c].to(self.host_weights.device))
        self.host_state.index_copy_(0, target, self.cache_state[:c].to(self.host_state.device))
        self.slot_dirty.zero_()
        by_rank = self.host_weights[:n].cpu()
        full = torch.empty_like(by_rank)
        full[self.row_of_rank] = by_rank
        return [t.clone() for t in self.space.split(full)]

    def extra_metrics(self) -> dict:
        """Belady's MIN on the recorded training id stream at this capacity, beside this
        cache's own hit rate on the same window of steps."""
        out: dict = {"capacity_rows": self.capacity, "policy": self.params.policy}
        if self._window_start is None:
            return out
        end = self._window_end if self._window_end is not None else self._counters  # a run shorter than the window
        stream = [r.cpu() for r in self._recorded]
        window = dict(zip(_COUNTER_NAMES, (end - self._window_start).tolist()))
        out.update(
            belady_hit_rate=belady_hit_rate(stream, self.capacity, skip=self._warmup_steps, prefilled=True),
            window_hit_rate=window["hits"] / max(1, window["accesses"]),
            window_accesses=window["accesses"],
            belady_window=[self._warmup_steps, len(stream)],
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
