"""The published ColossalAI frequency-aware cache (``colossalai``), re-implemented as a reference.

ColossalAI 0.5.0 ships the cache of the paper "A Frequency-aware Software Cache for Large
Recommendation System Embeddings" (Xie et al., arXiv 2208.05321) as ``CachedParamMgr`` under
``CachedEmbeddingBag`` (``FreqAwareEmbeddingBag`` in the versions the paper used). It cannot
be a dependency here (it pins torch <= 2.5.1), so this module reproduces its documented
behaviour on embbench's building blocks, quirks included, each one named:

- **Layout.** The host holds every row; the device holds ``cuda_row_num = int(cache_ratio x
  rows)`` slots. A frequency count over training batches (``profile_batches``) ranks the rows;
  with the ``dataset`` policy an id is looked up at its rank (the published ``idx_map``), with
  ``lfu`` at its own index. (The published manager maps ids to ranks without moving the host
  rows, so an id starts from another id's initial weights; harmless for i.i.d. initial
  weights. Here each row starts from its own, so runs compare with ``device``.)
- **Warm-up.** ``ceil(cuda_row_num x warmup_ratio)`` rows are preloaded: the lowest ranks
  (``dataset``) or the highest counts, which become their LFU counts (``lfu``).
- **Each batch** (``prepare_ids``): the distinct rows of the batch are found; more than
  ``cuda_row_num`` of them is an error naming both numbers (published: an assertion); the
  missing rows are admitted into the lowest free slots in ascending row order; when the free
  slots do not suffice, victims are chosen among the slots this batch does not use: the
  highest rank (``dataset``) or the lowest count (``lfu``; equal counts: the lowest slot,
  where the published ``topk`` leaves the order to the kernel).
- **Every evicted row is written back**, updated or not (``rows_written_back`` counts them all).
- **LFU counts live in the slots.** An admitted row starts from 0 plus its accesses in this
  batch; its count is lost when it leaves. Preloaded rows start from their profile counts, so
  they stay cached far longer than rows admitted later.
- **Optimizer state belongs to the slot** (``optimizer_state: slot``, as published: the
  cache tensor is the optimizer's parameter, its state is indexed by slot): a newly admitted
  row inherits the rowwise-Adagrad accumulator of the slot's previous occupant, and its own
  history stays behind. ``optimizer_state: row`` moves the state with the row (the fix).
- **Host synchronisations.** The published bookkeeping waits for the device several times per
  batch: a ``torch.cuda.synchronize()`` on entry, ``unique`` and boolean indexing (their
  output sizes), ``nonzero``, the ``.cpu()`` copies of row indices and evicted rows, the
  blocking host-to-device copy of admitted rows (one per ``buffer_size`` piece when the
  staging buffer is on). They are done here at the same points and each is counted in
  ``host_syncs``: 4 per batch without misses, 6 with misses, 10 (``dataset``) or 9 (``lfu``)
  with evictions. (Each phase of the published code is also wrapped in a timer that ends in
  ``torch.cuda.synchronize()``; those are instrumentation right after reads that already
  emptied the device queue, and are left out.)
- **Evaluation moves rows** like training: eval batches are admitted, evict rows and (``lfu``)
  add to the counts.
- **No prefetch**: the next batch is not looked at (the paper lists it as future work).

What differs on purpose: the frequency profile reads training batches only (the published
DLRM harness counted the validation and test files too), and flushing returns the tables in
id order.
"""

from __future__ import annotations

import math
from typing import Literal

import torch
from pydantic import Field
from torch import Tensor

from embbench.plugin import (WORK_INSTRUMENT, BuildContext, MemoryFootprint, RowSpace, RowStore, SparseFeatures, SparseModule,
                             Strategy, StrategyParams, TableWiseSharded, per_sample, pooled_lookup)

__all__ = ["CacheTooSmall", "ColossalAICache", "ColossalAIParams", "ColossalAIStrategy"]

_EMPTY = -1  # slot_row of a free slot
_PROTECTED = -2  # slot_row while the batch's own slots are hidden from the dataset policy
_NEVER = torch.iinfo(torch.long).max  # the LFU count of a slot that must not be chosen


class ColossalAIParams(StrategyParams):
    cache_ratio: float = Field(0.01, gt=0, le=1, description="share of rows cached: cuda_row_num = int(ratio x rows)")
    evict_policy: Literal["dataset", "lfu"] = Field(
        "dataset", description="evict the highest profile rank (EvictionStrategy.DATASET) or the lowest slot count (LFU)")
    optimizer_state: Literal["slot", "row"] = Field(
        "slot", description="state bound to the cache slot, as published, or moved with the row (the fix)")
    warmup_ratio: float = Field(0.7, ge=0, le=1, description="share of the cache preloaded with the hottest rows")
    profile_batches: int = Field(32, ge=0, description="training batches counted for the frequency ranking")
    buffer_size: int = Field(0, ge=0, description="rows per staged host<->device copy (0: one copy per transfer)")
    pin_weight: bool = Field(False, description="keep the host rows in pinned memory (CUDA)")


class CacheTooSmall(RuntimeError):
    """A batch needs more distinct rows than the cache has slots."""


class ColossalAICache(SparseModule):
    """The published cache on one rank (see the module docstring)."""

    def __init__(self, ctx: BuildContext, params: ColossalAIParams):
        super().__init__()
        self.params = params
        self.device = ctx.env.device
        self.space = space = RowSpace(ctx.tables)
        n, dim, width = space.num_rows, space.dim, ctx.optimizer.state_width
        self.num_rows, self.dim = n, dim
        self.capacity = c = int(params.cache_ratio * n)
        if c < 1:
            raise ValueError(f"colossalai: cache_ratio {params.cache_ratio} of {n} rows leaves no cache row "
                             f"(cuda_row_num = int(ratio x rows) = 0)")
        self.lfu = params.evict_policy == "lfu"
        self.state_moves = params.optimizer_state == "row" and width > 0
        self.row_bytes = (dim + (width if self.state_moves else 0)) * 4

        # Frequencies of training batches only (BuildContext never offers evaluation data).
        counts = torch.zeros(n, dtype=torch.long, device=self.device)
        for batch in ctx.train_batches(params.profile_batches):
            rows = space.global_rows(batch.sparse.to(self.device))
            counts.index_add_(0, rows, torch.ones_like(rows))
        by_count = torch.sort(counts, descending=True, stable=True).indices
        # idx_map: global row -> host row (its rank for `dataset`; itself for `lfu`, as published)
        self.idx_map = torch.arange(n, device=self.device)
        if not self.lfu:
            self.idx_map[by_count] = torch.arange(n, device=self.device)

        # Host rows (and their optimizer state, when it moves with them), indexed by host row.
        pin = params.pin_weight and self.device.type == "cuda"
        self.host = host = torch.zeros(n, dim + (width if self.state_moves else 0), pin_memory=pin)
        idx_map_host = self.idx_map.cpu()
        space.fill_initial(host[:, :dim], ctx.init_weights, position=lambda rows: idx_map_host[rows])

        # Device side: the slots, their optimizer state, and the two maps.
        self.cache_weights = torch.zeros(c, dim, device=self.device)
        self.cache_state = torch.zeros(c, width, device=self.device)
        self.store = RowStore(self.cache_weights, self.cache_state, ctx.optimizer)
        ctx.configure(self.store)
        self.slot_row = torch.full((c,), _EMPTY, dtype=torch.long, device=self.device)  # cached_idx_map
        self.row_slot = torch.full((n,), _EMPTY, dtype=torch.long, device=self.device)  # inverted_cached_idx
        self.slot_count = torch.full((c,), _NEVER, dtype=torch.long, device=self.device) if self.lfu else None
        self.free_slots = c
        self._reset_counters()

        # Warm-up: the hottest rows, by rank (dataset) or by count (lfu, which keeps the counts).
        preload = min(math.ceil(c * params.warmup_ratio), n)
        self.preloaded = preload
        if preload:
            rows = by_count[:preload] if self.lfu else torch.arange(preload, device=self.device)
            slots = torch.arange(preload, device=self.device)
            self._load(rows.cpu(), slots)
            self._assign(rows, slots)
            if self.lfu:
                self.slot_count[slots] = counts[rows]
        del counts, by_count
        self._reset_counters()  # the counters start with training

    # -- counting --------------------------------------------------------------------------

    def _reset_counters(self) -> None:
        self._counts = dict.fromkeys(("accesses", "unique_accesses", "unique_misses", "rows_admitted", "rows_evicted",
                                      "rows_written_back", "bytes_h2d", "bytes_d2h", "host_syncs"), 0)
        self._misses = torch.zeros((), dtype=torch.long, device=self.device)  # per access, read when asked
        self._inherited = torch.zeros((), dtype=torch.long, device=self.device)

    def _waited(self, times: int = 1) -> None:
        """The host waited for the device (a size, a value or a blocking copy)."""
        self._counts["host_syncs"] += times

    def _to_host(self, index: Tensor) -> Tensor:
        """Row indices read on the host, as the published bookkeeping reads them."""
        if index.numel():
            self._waited()
            self._counts["bytes_d2h"] += index.numel() * 8
        return index.cpu()

    # -- moving rows -----------------------------------------------------------------------

    def _pieces(self, count: int) -> list[slice]:
        """The staging buffer: ``buffer_size`` rows per copy, or one copy."""
        step = self.params.buffer_size or max(count, 1)
        return [slice(lo, min(count, lo + step)) for lo in range(0, count, step)]

    def _load(self, host_rows: Tensor, slots: Tensor) -> None:
        """Host rows (and state, if it moves) into cache slots: gathered, staged, copied."""
        for piece in self._pieces(host_rows.numel()):
            staged = self.host.index_select(0, host_rows[piece])
            if self.device.type == "cuda":
                staged = staged.pin_memory()
            staged = staged.to(self.device)  # blocking, as published
            self._waited()
            self.cache_weights.index_copy_(0, slots[piece], staged[:, : self.dim])
            if self.state_moves:
                self.cache_state.index_copy_(0, slots[piece], staged[:, self.dim :])
        self._counts["bytes_h2d"] += host_rows.numel() * self.row_bytes

    def _write_back(self, slots: Tensor) -> None:
        """Cache slots (and state, if it moves) back to their host rows, whatever happened to them."""
        host_rows = self._to_host(self.slot_row[slots])
        for piece in self._pieces(slots.numel()):
            rows = self.cache_weights.index_select(0, slots[piece])
            if self.state_moves:
                rows = torch.cat([rows, self.cache_state.index_select(0, slots[piece])], 1)
            self.host.index_copy_(0, host_rows[piece], rows.cpu())
            self._waited()
        self._counts["rows_written_back"] += slots.numel()
        self._counts["bytes_d2h"] += slots.numel() * self.row_bytes

    def _assign(self, rows: Tensor, slots: Tensor) -> None:
        self.slot_row[slots] = rows
        self.row_slot[rows] = slots
        self.free_slots -= rows.numel()

    def _release(self, slots: Tensor) -> None:
        self.row_slot[self.slot_row[slots]] = _EMPTY
        self.slot_row[slots] = _EMPTY
        self.free_slots += slots.numel()

    # -- one batch (the published prepare_ids) ---------------------------------------------

    def _victims(self, count: int, batch_rows: Tensor) -> Tensor:
        """``count`` occupied slots that the batch does not use, by the eviction policy."""
        in_batch = torch.isin(self.slot_row, batch_rows)
        hidden = in_batch.nonzero().squeeze(1)
        self._waited()  # nonzero: its size
        if self.lfu:
            kept = self.slot_count[hidden]
            self.slot_count[hidden] = _NEVER
            victims = torch.sort(self.slot_count, stable=True).indices[:count]
            self.slot_count[hidden] = kept
            return victims
        kept = self.slot_row[in_batch]
        self._waited()  # boolean indexing: its size (the published code indexes by the mask)
        self.slot_row[hidden] = _PROTECTED
        victims = torch.topk(self.slot_row, count).indices  # highest rank = coldest; free/protected lowest
        self.slot_row[hidden] = kept
        return victims

    def _prepare(self, rows: Tensor) -> Tensor:
        """Make every host row of ``rows`` resident; return the slot of each."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        self._waited()  # the synchronize that opens the published prepare_ids
        unique, repeats = torch.unique(rows, return_counts=True)
        self._waited()  # unique: its size
        if unique.numel() > self.capacity:
            raise CacheTooSmall(
                f"colossalai: a batch needs {unique.numel()} distinct rows but the cache holds {self.capacity} "
                f"(cuda_row_num = int(cache_ratio {self.params.cache_ratio} x {self.num_rows} rows)); "
                f"raise cache_ratio or lower the batch size (the published CachedParamMgr asserts here)")
        absent = torch.isin(unique, self.slot_row, invert=True)
        missing = unique[absent]
        self._waited()  # boolean indexing: its size
        self._misses += repeats[absent].sum()
        missing_host = self._to_host(missing)

        evict = missing.numel() - self.free_slots
        if evict > 0:
            victims = self._victims(evict, unique)
            self._write_back(victims)
            self._release(victims)
            self._counts["rows_evicted"] += evict
        slots = (self.slot_row == _EMPTY).nonzero().squeeze(1)[: missing.numel()]
        self._waited()  # nonzero: its size
        if not self.state_moves:
            self._inherited += (self.cache_state[slots] != 0).any(1).sum()  # state of a previous occupant
        self._load(missing_host, slots)
        self._assign(missing, slots)
        if self.lfu:
            self.slot_count[slots] = 0  # the count a row had before it left is gone
            self.slot_count.scatter_add_(0, self.row_slot[unique], repeats)

        c = self._counts
        c["accesses"] += rows.numel()
        c["unique_accesses"] += unique.numel()
        c["unique_misses"] += missing.numel()
        c["rows_admitted"] += missing.numel()
        return self.row_slot[rows]

    # -- the SparseModule interface --------------------------------------------------------

    def forward(self, features: SparseFeatures) -> Tensor:
        features = features.to(self.device)
        slots = self._prepare(self.idx_map[self.space.global_rows(features)])  # eval batches too, as published
        return per_sample(pooled_lookup(self.store, slots, features.offsets(), self.device), features)

    def instruments(self) -> dict[str, str]:
        return dict(WORK_INSTRUMENT)

    def set_counting(self, mode) -> None:
        for store in (self.store,):  # its work counters: the harness's, off in timed steps
            store.counting = mode != "off"

    def counters(self) -> dict[str, int]:
        misses = int(self._misses)
        return {**self._counts, "misses": misses, "hits": self._counts["accesses"] - misses, **self.store.work_counters()}

    def memory(self) -> MemoryFootprint:
        device = sum(t.nbytes for t in (self.cache_weights, self.cache_state, self.slot_row, self.row_slot, self.idx_map))
        device += self.slot_count.nbytes if self.lfu else 0
        if self.host.is_pinned():
            return MemoryFootprint(device_bytes=device, pinned_bytes=self.host.nbytes)
        return MemoryFootprint(device_bytes=device, host_bytes=self.host.nbytes)

    def flush(self) -> list[Tensor]:
        """Every cached row goes back and the cache is emptied (as published); the tables in id order."""
        occupied = (self.slot_row != _EMPTY).nonzero().squeeze(1)
        self._write_back(occupied)
        self._release(occupied)
        if self.lfu:
            self.slot_count.fill_(_NEVER)
        by_id = self.host[:, : self.dim][self.idx_map.cpu()]
        return [t.clone() for t in self.space.split(by_id)]

    def extra_metrics(self) -> dict:
        out = {"capacity_rows": self.capacity, "preloaded_rows": self.preloaded,
               "evict_policy": self.params.evict_policy, "optimizer_state": self.params.optimizer_state}
        if self.cache_state.shape[1] and not self.state_moves:
            out["admissions_inheriting_state"] = int(self._inherited)  # since build, eval included
        return out


class ColossalAIStrategy(Strategy):
    name = "colossalai"
    summary = "reference: ColossalAI 0.5.0's published frequency-aware cache (CachedParamMgr), quirks included"
    Params = ColossalAIParams

    def estimate_memory(self, tables, optimizer, world_size):
        n = sum(t.num_rows for t in tables) // world_size  # per rank, roughly: placement is by table
        p, dim, width = self.params, tables[0].dim, optimizer.state_width
        cached = max(1, int(p.cache_ratio * n))
        host_row = dim + (width if p.optimizer_state == "row" else 0)
        # cache rows and their state, slot -> row (and lfu counts) per slot; idx_map and row -> slot per row
        device = cached * ((dim + width) * 4 + 8 + (8 if p.evict_policy == "lfu" else 0)) + n * 16
        host = n * host_row * 4
        if p.pin_weight:
            return MemoryFootprint(device_bytes=device, pinned_bytes=host)
        return MemoryFootprint(device_bytes=device, host_bytes=host)

    def build(self, ctx: BuildContext) -> SparseModule:
        if ctx.env.world_size == 1:
            return ColossalAICache(ctx, self.params)
        # Table-wise, as the published ParallelCachedEmbeddingBagTablewise: one cache per rank
        # for the tables it owns, int(ratio x its rows) slots.
        return TableWiseSharded(ctx, lambda local: ColossalAICache(local, self.params))
