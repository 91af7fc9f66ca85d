"""``hot_copy``: every table in host memory, and a copy of its hottest rows on the compute device.

The hottest rows are the ones the first ``profile_batches`` training batches look up most.
A batch's ids on those rows are pooled and trained on the device; the others on the host,
whose pooled rows go to the device. Each row is trained in exactly one place (its device copy
if it has one, else its host row), so the model trains the same weights as ``device``;
``flush`` puts the device copies back into the host tables.

It uses only :mod:`embbench.plugin`, embbench's public interface for strategies.
"""

from __future__ import annotations

import math

import torch
from pydantic import Field
from torch import Tensor

from embbench.plugin import (BuildContext, EmbeddingOptimizer, MemoryFootprint, RowSpace, RowStore, SparseFeatures,
                             SparseModule, Strategy, StrategyParams, TableSpec, TableWiseSharded, per_sample,
                             pooled_lookup, table_bytes, whole_store)

__all__ = ["HotCopyModule", "HotCopyParams", "HotCopyStrategy", "hottest_rows"]

_HOST = torch.device("cpu")


class HotCopyParams(StrategyParams):
    hot_ratio: float = Field(0.05, gt=0, le=1, description="share of all rows copied to the device")
    profile_batches: int = Field(16, ge=1, description="training batches counted to choose the hot rows")

    def hot_rows(self, num_rows: int) -> int:
        return min(num_rows, math.ceil(self.hot_ratio * num_rows))


def hottest_rows(space: RowSpace, batches, count: int) -> Tensor:
    """The ``count`` global rows that ``batches`` look up most (ties: the lower row), sorted."""
    lookups = torch.zeros(space.num_rows, dtype=torch.long)
    for batch in batches:
        lookups += torch.bincount(space.global_rows(batch.sparse).cpu(), minlength=space.num_rows)
    # a stable sort keeps equal counts in row order: the choice does not depend on the sort
    order = torch.sort(lookups, descending=True, stable=True).indices
    return order[:count].sort().values


class HotCopyModule(SparseModule):
    def __init__(self, ctx: BuildContext, params: HotCopyParams):
        super().__init__()
        self.space = RowSpace(ctx.tables)
        self.compute = ctx.env.device
        self.host = whole_store(self.space, ctx, _HOST)
        hot = hottest_rows(self.space, ctx.train_batches(params.profile_batches), params.hot_rows(self.space.num_rows))
        self.hot = hot.to(self.compute)
        self.hot_copy = RowStore(self.host.weights[hot].to(self.compute), self.host.state[hot].to(self.compute),
                                 ctx.optimizer)
        ctx.configure(self.hot_copy)
        self._counts = {"accesses": 0, "hits": 0, "bytes_h2d": 0, "bytes_d2h": 0}

    def forward(self, features: SparseFeatures) -> Tensor:
        rows, offsets = self.space.global_rows(features), features.offsets()
        # each id's place among the sorted hot rows; it is hot when the row there is its own
        slot = torch.searchsorted(self.hot, rows).clamp_(max=len(self.hot) - 1)
        is_hot = self.hot[slot] == rows
        hot_before = torch.cat([offsets.new_zeros(1), is_hot.cumsum(0)])  # hot ids before each position
        hot_offsets = hot_before[offsets]
        hot_slots, cold_rows = slot[is_hot], rows[~is_hot]
        pooled = pooled_lookup(self.hot_copy, hot_slots, hot_offsets, self.compute) + \
            pooled_lookup(self.host, cold_rows.to(_HOST), (offsets - hot_offsets).to(_HOST), self.compute)
        self._count(rows.numel(), hot_slots.numel(), cold_rows.numel(), offsets.numel(), pooled.shape)
        return per_sample(pooled, features)

    def _count(self, ids: int, hits: int, cold_ids: int, num_offsets: int, pooled_shape: torch.Size) -> None:
        self._counts["accesses"] += ids
        self._counts["hits"] += hits
        if self.compute != _HOST:
            pooled_bytes = pooled_shape.numel() * 4
            # cold ids and their offsets go to the host, their pooled rows come back, the gradient goes
            self._counts["bytes_d2h"] += (cold_ids + num_offsets) * 8 + pooled_bytes
            self._counts["bytes_h2d"] += pooled_bytes

    def counters(self) -> dict[str, int]:
        return dict(self._counts)

    def memory(self) -> MemoryFootprint:
        return MemoryFootprint(device_bytes=self.hot_copy.nbytes + self.hot.nbytes, host_bytes=self.host.nbytes)

    def flush(self) -> list[Tensor]:
        weights = self.host.weights.clone()
        weights[self.hot.to(_HOST)] = self.hot_copy.weights.to(_HOST)
        return [t.clone() for t in self.space.split(weights)]


class HotCopyStrategy(Strategy):
    name = "hot_copy"
    summary = "host tables with a device copy of the hottest rows (embbench's example plugin); table-wise over ranks"
    Params = HotCopyParams

    def estimate_memory(self, tables: list[TableSpec], optimizer: EmbeddingOptimizer, world_size: int) -> MemoryFootprint:
        hot = self.params.hot_rows(sum(t.num_rows for t in tables))
        row_bytes = (tables[0].dim + optimizer.state_width) * 4
        host = table_bytes(tables, optimizer.state_width)
        return MemoryFootprint(device_bytes=hot * (row_bytes + 8) // world_size, host_bytes=host // world_size)

    def build(self, ctx: BuildContext) -> SparseModule:
        def build_local(local: BuildContext) -> SparseModule:
            return HotCopyModule(local, self.params)

        return build_local(ctx) if ctx.env.world_size == 1 else TableWiseSharded(ctx, build_local)
