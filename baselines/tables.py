"""Whole tables in one place: ``device`` (the reference) and ``cpu`` (host lookups).

Both keep every table, with its optimizer state, in one tensor over the global row space
and train it with :func:`embbench.embedding.pooled_lookup`. They differ only in where the
tensor lives: on the compute device, or on the host with ids and gradients sent there and
pooled embeddings sent back (the classic hybrid CPU-GPU baseline).
"""

from __future__ import annotations

import torch
from torch import Tensor

from embbench.data.batch import SparseFeatures
from embbench.data.presets import TableSpec
from embbench.embedding import RowSpace, RowStore, per_sample, pooled_lookup
from embbench.optim import EmbeddingOptimizer
from embbench.sharding import TableWiseSharded
from embbench.strategy import BuildContext, MemoryFootprint, SparseModule, Strategy


class WholeTables(SparseModule):
    """Every table on the host (``on_host``) or on the compute device; results on the device."""

    def __init__(self, ctx: BuildContext, on_host: bool):
        super().__init__()
        self.space = RowSpace(ctx.tables)
        self.on_host = on_host
        self.compute = ctx.env.device
        self.storage = storage = torch.device("cpu") if on_host else self.compute
        weights = torch.empty(self.space.num_rows, self.space.dim, device=storage)
        self.space.fill_initial(weights, ctx.init_weights)
        self.store = RowStore(weights, ctx.optimizer.new_state(self.space.num_rows, storage), ctx.optimizer)
        self._counts = {"accesses": 0, "bytes_h2d": 0, "bytes_d2h": 0}
        self._remote = storage != self.compute

    def forward(self, features: SparseFeatures) -> Tensor:
        rows = self.space.global_rows(features)
        offsets = features.offsets()
        self._counts["accesses"] += rows.numel()
        if self._remote:
            rows, offsets = rows.to(self.storage), offsets.to(self.storage)
            pooled_bytes = offsets.numel() - 1
            # ids go to the host; pooled rows come back; their gradients go to the host.
            self._counts["bytes_d2h"] += (rows.numel() + offsets.numel()) * 8 + pooled_bytes * self.space.dim * 4
            self._counts["bytes_h2d"] += pooled_bytes * self.space.dim * 4
        return per_sample(pooled_lookup(self.store, rows, offsets, self.compute), features)

    def counters(self) -> dict[str, int]:
        return dict(self._counts)

    def memory(self) -> MemoryFootprint:
        nbytes = self.store.weights.nbytes + self.store.state.nbytes
        return MemoryFootprint(host_bytes=nbytes) if self.on_host else MemoryFootprint(device_bytes=nbytes)

    def flush(self) -> list[Tensor]:
        return [t.cpu().clone() for t in self.space.split(self.store.weights)]


def _table_bytes(tables: list[TableSpec], optimizer: EmbeddingOptimizer, world_size: int) -> int:
    """Per rank, with the tables spread over the ranks (roughly: placement is by table)."""
    return sum(t.num_rows * (t.dim + optimizer.state_width) * 4 for t in tables) // world_size


def _whole_tables(ctx: BuildContext, on_host: bool) -> SparseModule:
    """One rank holds everything; several ranks own whole tables each (table-wise)."""
    if ctx.env.world_size == 1:
        return WholeTables(ctx, on_host)
    return TableWiseSharded(ctx, lambda local: WholeTables(local, on_host))


class DeviceStrategy(Strategy):
    name = "device"
    summary = "every table in device memory (the reference for equivalence); table-wise over ranks"

    def estimate_memory(self, tables, optimizer, world_size):
        return MemoryFootprint(device_bytes=_table_bytes(tables, optimizer, world_size))

    def build(self, ctx: BuildContext) -> SparseModule:
        return _whole_tables(ctx, on_host=False)


class CpuStrategy(Strategy):
    name = "cpu"
    summary = "tables on the host: CPU lookups and updates, pooled rows to the device; table-wise over ranks"

    def estimate_memory(self, tables, optimizer, world_size):
        return MemoryFootprint(host_bytes=_table_bytes(tables, optimizer, world_size))

    def build(self, ctx: BuildContext) -> SparseModule:
        return _whole_tables(ctx, on_host=True)
