"""Whole tables in one place: ``device`` (the reference) and ``cpu`` (host lookups).

``device`` keeps every table, with its optimizer state, in one tensor over the global row
space on the compute device and trains it with :func:`embbench.plugin.pooled_lookup`.
``cpu`` is the classic hybrid CPU-GPU baseline: the tables live in host memory inside
fbgemm's CPU table-batched embedding kernel (the fast CPU path torchrec uses), ids and
gradients go to the host, pooled embeddings come back, and the update is fbgemm's fused
``exact_sgd`` / ``exact_rowwise_adagrad``: the math of embbench.optim.
"""

from __future__ import annotations

import torch
from torch import Tensor

from baselines.torchrec_tables import FbgemmRowPrecision, fused_optimizer, sparse_type
from embbench.plugin import (ROW_PRECISIONS, WORK_INSTRUMENT, BuildContext, EmbeddingOptimizer, MemoryFootprint, RowSpace,
                             SparseFeatures, SparseModule, Strategy, TableSpec, TableWiseSharded, fill_in_parallel,
                             per_sample, pooled_lookup, stored_rows, table_bytes, whole_store)

_INIT_CHUNK = 1 << 20  # rows of initial weights written at a time: no second copy of a table


class WholeTables(SparseModule):
    """Every table in device memory, trained by embbench's fused lookup and update."""

    def __init__(self, ctx: BuildContext):
        super().__init__()
        self.space = RowSpace(ctx.tables)
        self.compute = ctx.env.device
        self.store = whole_store(self.space, ctx, self.compute)
        self._accesses = 0

    def forward(self, features: SparseFeatures) -> Tensor:
        rows = self.space.global_rows(features)
        self._accesses += rows.numel()
        return per_sample(pooled_lookup(self.store, rows, features.offsets(), self.compute), features)

    def counters(self) -> dict[str, int]:
        return {"accesses": self._accesses, **self.store.work_counters()}

    def instruments(self) -> dict[str, str]:
        return dict(WORK_INSTRUMENT)

    def set_counting(self, mode) -> None:
        self.store.counting = mode != "off"

    def memory(self) -> MemoryFootprint:
        return MemoryFootprint(device_bytes=self.store.nbytes)

    def flush(self) -> list[Tensor]:
        return [t.cpu().clone() for t in self.space.split(stored_rows(self.store))]


class HostTables(SparseModule):
    """Every table in host memory, looked up and updated by fbgemm's CPU kernel; the pooled
    rows ``[B, T * D]`` (already the sample-major layout) go to the compute device."""

    def __init__(self, ctx: BuildContext):
        super().__init__()
        from baselines._fbgemm import (ComputeDevice, EmbeddingLocation, PoolingMode, SparseType,
                                       SplitTableBatchedEmbeddingBagsCodegen)

        RowSpace(ctx.tables)  # checks that every table has the same dim
        self.compute = ctx.env.device
        self.dim = ctx.tables[0].dim
        self.tbe = SplitTableBatchedEmbeddingBagsCodegen(
            [(t.num_rows, t.dim, EmbeddingLocation.HOST, ComputeDevice.CPU) for t in ctx.tables],
            pooling_mode=PoolingMode.SUM, weights_precision=sparse_type(ctx.row_precision), output_dtype=SparseType.FP32,
            device=torch.device("cpu"), **fused_optimizer(ctx.optimizer),
        )
        tables = self.tbe.split_embedding_weights()

        def fill(job: tuple[int, int]) -> None:
            t, lo = job
            hi = min(tables[t].shape[0], lo + _INIT_CHUNK)
            with torch.no_grad():
                tables[t][lo:hi].copy_(ctx.init_weights(t, lo, hi))

        fill_in_parallel(fill, [(t, lo) for t, w in enumerate(tables) for lo in range(0, w.shape[0], _INIT_CHUNK)])
        self._counts = {"accesses": 0, "bytes_h2d": 0, "bytes_d2h": 0}
        self._remote = self.compute.type != "cpu"

    def forward(self, features: SparseFeatures) -> Tensor:
        values, offsets = features.values, features.offsets()
        self._counts["accesses"] += values.numel()
        if self._remote:
            pooled_bytes = (offsets.numel() - 1) * self.dim * 4
            # ids go to the host; pooled rows come back; their gradients go to the host.
            self._counts["bytes_d2h"] += (values.numel() + offsets.numel()) * 8 + pooled_bytes
            self._counts["bytes_h2d"] += pooled_bytes
        pooled = self.tbe(values.to("cpu", torch.long), offsets.to("cpu", torch.long))
        return pooled.to(self.compute)

    def counters(self) -> dict[str, int]:
        return dict(self._counts)

    def memory(self) -> MemoryFootprint:
        state = getattr(self.tbe, "momentum1_host", None)
        return MemoryFootprint(host_bytes=self.tbe.weights_host.nbytes + (state.nbytes if state is not None else 0))

    def flush(self) -> list[Tensor]:
        return [w.detach().to(torch.float32, copy=True) for w in self.tbe.split_embedding_weights()]


def _table_bytes(tables: list[TableSpec], optimizer: EmbeddingOptimizer, world_size: int, row_precision: str) -> int:
    """Per rank, with the tables spread over the ranks (roughly: placement is by table)."""
    return table_bytes(tables, optimizer.state_width, row_precision) // world_size


def _table_wise(ctx: BuildContext, build) -> SparseModule:
    """One rank holds everything; several ranks own whole tables each (table-wise)."""
    return build(ctx) if ctx.env.world_size == 1 else TableWiseSharded(ctx, build)


class DeviceStrategy(Strategy):
    name = "device"
    summary = "every table in device memory (the reference for equivalence); table-wise over ranks"
    row_precisions = ROW_PRECISIONS
    all_in_hbm = True

    def estimate_memory(self, tables, optimizer, world_size, row_precision="fp32"):
        return MemoryFootprint(device_bytes=_table_bytes(tables, optimizer, world_size, row_precision))

    def build(self, ctx: BuildContext) -> SparseModule:
        return _table_wise(ctx, WholeTables)


class CpuStrategy(FbgemmRowPrecision, Strategy):
    name = "cpu"
    summary = "tables on the host: fbgemm's CPU kernel looks up and updates, pooled rows to the device; table-wise over ranks"
    cpu_kernels_always = True

    def estimate_memory(self, tables, optimizer, world_size, row_precision="fp32"):
        return MemoryFootprint(host_bytes=_table_bytes(tables, optimizer, world_size, row_precision))

    def build(self, ctx: BuildContext) -> SparseModule:
        return _table_wise(ctx, HostTables)
