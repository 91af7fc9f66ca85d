"""``ssd_tbe``: fbgemm's SSD table-batched embedding, ``fbgemm_gpu.tbe.ssd.SSDTableBatchedEmbeddingBags``.

The rows live in a RocksDB store on a drive (``store_dir``); a set-associative LRU cache of
them sits in device memory, and the rowwise-Adagrad state in device memory too. fbgemm's
prefetch reads a batch's missed rows from the store and writes evicted rows back, on its own
threads; the optimizer is fused into backward as in fbgemm's other TBEs.

It runs only on a build of fbgemm_gpu with the SSD operators, on CUDA. fbgemm's public wheels
(fbgemm-gpu and fbgemm-gpu-cpu on PyPI, 1.6 to 1.8 at least) are built without them (FBGEMM
#5666: "SSD TBE operators are currently not supported in OSS"), and there the cell is recorded
as ``unsupported`` with the operators it misses, so that a scenario naming ``ssd_tbe`` runs
unchanged for those who have the build. The constructor arguments used here are the same in
fbgemm 1.6 and 1.8.
"""

from __future__ import annotations

import functools
import math
import os
import tempfile
from pathlib import Path

import torch
from pydantic import Field, field_validator
from torch import Tensor

from baselines.torchrec_tables import fbgemm_package, fused_optimizer, sparse_type
from embbench.plugin import (BuildContext, EmbeddingOptimizer, MemoryFootprint, RuntimeEnv, SparseFeatures,
                             SparseModule, Strategy, StrategyParams, TableSpec, TableWiseSharded, Unsupported)

__all__ = ["SSD_CLASSES", "SSD_OPERATORS", "SsdTbeParams", "SsdTbeStrategy", "missing_ssd_operators"]

#: What SSDTableBatchedEmbeddingBags calls that fbgemm's public wheels do not register (1.6, 1.8).
SSD_OPERATORS = ("ssd_cache_populate_actions", "ssd_generate_row_addrs", "ssd_update_row_addrs", "masked_index_put",
                 "masked_index_select", "compact_indices")
SSD_CLASSES = ("EmbeddingRocksDBWrapper",)

_INIT_CHUNK = 1 << 18  # rows written into the store at a time


@functools.cache
def missing_ssd_operators() -> tuple[str, ...]:
    """The SSD operators and classes this process's fbgemm_gpu does not register (empty: it has them)."""
    from baselines._fbgemm import load_ssd_operators

    load_ssd_operators()

    missing = [f"torch.ops.fbgemm.{op}" for op in SSD_OPERATORS if not hasattr(torch.ops.fbgemm, op)]
    for name in SSD_CLASSES:
        try:
            getattr(torch.classes.fbgemm, name)
        except RuntimeError:  # "Tried to instantiate class ..., but it does not exist!"
            missing.append(f"torch.classes.fbgemm.{name}")
    return tuple(missing)


class SsdTbeParams(StrategyParams):
    cache_ratio: float = Field(0.015, gt=0, le=1, description="share of rows in fbgemm's device cache (whole sets of 32)")
    store_dir: str | None = Field(None, description=(
        "an existing folder on the drive to measure, where RocksDB keeps the rows (fbgemm's ssd_storage_directory; "
        "each rank makes its own folder inside and removes it); default: the cell's folder in the run directory"))
    rocksdb_shards: int = Field(1, ge=1, description="RocksDB shards, each with its own thread (ssd_rocksdb_shards)")

    @field_validator("store_dir")
    @classmethod
    def _writable_folder(cls, value: str | None) -> str | None:
        if value is None:
            return None
        path = Path(value).expanduser()
        if not path.is_dir():
            raise ValueError(f"{value}: no such folder")
        if not os.access(path, os.W_OK | os.X_OK):
            raise ValueError(f"{value}: this user cannot write there")
        return str(path)


class SsdTables(SparseModule):
    """The tables of one rank in one SSDTableBatchedEmbeddingBags."""

    def __init__(self, ctx: BuildContext, params: SsdTbeParams):
        super().__init__()
        from baselines._fbgemm import EmbeddingLocation, PoolingMode, SparseType, ssd_tbe

        ASSOC, SSDTableBatchedEmbeddingBags, UVMCacheStatsIndex = ssd_tbe()

        dim = ctx.tables[0].dim
        if ctx.optimizer.type != "rowwise_adagrad":
            raise Unsupported(f"fbgemm's SSD TBE trains with rowwise Adagrad or Adam, not {ctx.optimizer.type}")
        if any(t.dim != dim for t in ctx.tables) or dim % 4:
            raise Unsupported("fbgemm's SSD TBE stores rows of one width, a multiple of 4 (embedding_dim)")
        # RocksDB's own folder, removed with the module: a store_dir given, else the cell's work folder
        base = params.store_dir or ctx.work_dir  # the cell's own folder, which the harness removes
        self.folder = tempfile.TemporaryDirectory(dir=base, prefix=f"ssd_tbe-rank{ctx.env.rank}-")
        num_rows = sum(t.num_rows for t in ctx.tables)
        self.tbe = SSDTableBatchedEmbeddingBags(
            embedding_specs=[(t.num_rows, t.dim) for t in ctx.tables], feature_table_map=None,
            cache_sets=max(1, math.ceil(params.cache_ratio * num_rows / ASSOC)),
            ssd_storage_directory=self.folder.name, ssd_rocksdb_shards=params.rocksdb_shards,
            ssd_cache_location=EmbeddingLocation.DEVICE, weights_precision=sparse_type(ctx.row_precision),
            output_dtype=SparseType.FP32, pooling_mode=PoolingMode.SUM, gather_ssd_cache_stats=True,
            **fused_optimizer(ctx.optimizer),
        )
        self._stats = UVMCacheStatsIndex
        self._write_initial_weights(ctx)
        self._accesses = 0

    def _write_initial_weights(self, ctx: BuildContext) -> None:
        """Every row into the store, keyed by its global row (fbgemm's key: table start + row)."""
        width, dtype, start = self.tbe.cache_row_dim, self.tbe.lxu_cache_weights.dtype, 0
        for t, table in enumerate(ctx.tables):
            for lo in range(0, table.num_rows, _INIT_CHUNK):
                hi = min(table.num_rows, lo + _INIT_CHUNK)
                block = torch.nn.functional.pad(ctx.init_weights(t, lo, hi), (0, width - table.dim)).to(dtype)
                keys = torch.arange(start + lo, start + hi, dtype=torch.int64)
                self.tbe.ssd_db.set(keys, block.contiguous(), torch.tensor([hi - lo]))
            start += table.num_rows

    def forward(self, features: SparseFeatures) -> Tensor:
        values = features.values.long()
        self._accesses += values.numel()
        return self.tbe(values, features.offsets().long())  # [B, T * D]: already sample-major

    def counters(self) -> dict[str, int]:
        stats = self.tbe.ssd_cache_stats.tolist()
        unique_misses = int(stats[self._stats.num_unique_misses])
        row_bytes = self.tbe.cache_row_dim * self.tbe.lxu_cache_weights.element_size()
        return {"accesses": self._accesses, "unique_accesses": int(stats[self._stats.num_unique_indices]),
                "unique_misses": unique_misses, "bytes_h2d": unique_misses * row_bytes}

    def memory(self) -> MemoryFootprint:
        """The cache and the optimizer state (fbgemm's ``*_dev`` / ``*_uvm`` / ``*_host`` buffers);
        the rows themselves are on the drive."""
        footprint = MemoryFootprint()
        for name, buffer in self.tbe.named_buffers():
            nbytes = buffer.numel() * buffer.element_size()
            if name.endswith("_uvm"):
                footprint.host_bytes += nbytes
                footprint.managed_bytes += nbytes
            elif buffer.is_cuda:
                footprint.device_bytes += nbytes
            else:
                footprint.host_bytes += nbytes
        return footprint

    def flush(self) -> list[Tensor]:
        was_training = self.tbe.training
        self.tbe.train()  # fbgemm's flush writes nothing in eval mode
        self.tbe.flush(force=True)  # the cached rows into the store
        self.tbe.train(was_training)
        return [w.float() for w in self.tbe.debug_split_embedding_weights()]


class SsdTbeStrategy(Strategy):
    name = "ssd_tbe"
    summary = "fbgemm's SSD TBE: rows in RocksDB on a drive behind its device cache (needs fbgemm's SSD build and CUDA)"
    Params = SsdTbeParams
    row_precisions = ("fp32", "fp16")  # SSDTableBatchedEmbeddingBags asserts FP32 or FP16 weights

    def unsupported_reason(self, env: RuntimeEnv) -> str | None:
        try:
            missing = missing_ssd_operators()
        except ImportError as e:
            return f"fbgemm_gpu's SSD TBE does not import: {e}"
        if missing:
            return (f"{fbgemm_package()} has no SSD TBE operators ({', '.join(missing)}): fbgemm's public wheels "
                    "are built without them (FBGEMM #5666); it runs on a build of fbgemm_gpu with them, on CUDA")
        if not env.cuda:
            return "needs CUDA (fbgemm's SSD TBE has no CPU kernels)"
        return None

    def estimate_memory(self, tables: list[TableSpec], optimizer: EmbeddingOptimizer, world_size: int,
                        row_precision: str = "fp32") -> MemoryFootprint:
        rows = sum(t.num_rows for t in tables)
        element = 4 if row_precision == "fp32" else 2
        cache = math.ceil(self.params.cache_ratio * rows / 32) * 32 * tables[0].dim * element
        state = rows * optimizer.state_width * 4  # rowwise Adagrad's state, in device memory
        return MemoryFootprint(device_bytes=(cache + state) // world_size)

    def build(self, ctx: BuildContext) -> SparseModule:
        def build_local(local: BuildContext) -> SparseModule:
            return SsdTables(local, self.params)

        # several ranks: each owns whole tables, in its own store (table-wise, like device and cpu)
        return build_local(ctx) if ctx.env.world_size == 1 else TableWiseSharded(ctx, build_local)
