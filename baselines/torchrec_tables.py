"""The ecosystem's placements, set up the way torchrec users set them up.

``gpu_sharded``  torchrec DistributedModelParallel, fused kernel (tables in device memory),
                 sharded table-, row- or column-wise or as the planner decides.
``uvm``          fbgemm EmbeddingLocation.MANAGED: tables in unified memory (torchrec's
                 ``fused_uvm`` kernel).
``uvm_cache``    fbgemm EmbeddingLocation.MANAGED_CACHING: unified memory behind fbgemm's
                 set-associative LRU/LFU cache (torchrec's ``fused_uvm_caching``).

All three let fbgemm's fused optimizer apply the scenario's embedding optimizer in
backward (``exact_sgd`` or ``exact_rowwise_adagrad``: the math of embbench.optim).
"""

from __future__ import annotations

import math
from typing import Literal

import torch
import torch.distributed as dist
from pydantic import Field
from torch import Tensor

from embbench.data.batch import SparseFeatures
from embbench.data.presets import TableSpec
from embbench.optim import EmbeddingOptimizer
from embbench.strategy import (BuildContext, MemoryFootprint, RuntimeEnv, SparseModule, Strategy, StrategyParams)

#: fbgemm's cache associativity on CUDA: the cache holds whole sets of this many rows.
FBGEMM_CACHE_ASSOC = 32

_UVM_STATS = ("num_calls", "num_requested_indices", "num_unique_indices", "num_unique_misses",
              "num_conflict_unique_misses", "num_conflict_misses")


def fbgemm_cache_rows(cache_ratio: float, num_rows: int) -> int:
    """Rows fbgemm's cache really holds for a load factor: whole sets, rounded up."""
    sets = max(1, (int(num_rows * cache_ratio) + FBGEMM_CACHE_ASSOC - 1) // FBGEMM_CACHE_ASSOC)
    return sets * FBGEMM_CACHE_ASSOC


def counters_from_uvm_cache_stats(stats: list[int], row_bytes: int) -> dict[str, int]:
    """fbgemm's uvm_cache_stats (see fbgemm_gpu UVMCacheStatsIndex) as embbench counters.

    fbgemm counts requests and *unique* misses only: ``hits``/``misses`` per access are not
    observable, so only the per-unique-row counters are filled. A conflict miss (its set was
    full of rows this batch needs) is read from unified memory without being admitted.
    """
    s = dict(zip(_UVM_STATS, (int(x) for x in stats)))
    admitted = s["num_unique_misses"] - s["num_conflict_unique_misses"]
    return {
        "accesses": s["num_requested_indices"],
        "unique_accesses": s["num_unique_indices"],
        "unique_misses": s["num_unique_misses"],
        "rows_admitted": admitted,
        "bytes_h2d": s["num_unique_misses"] * row_bytes,
    }


def _process_group(ctx: BuildContext):
    """The ranks' group; a one-process gloo group when the harness runs a single process."""
    if ctx.process_group is not None:
        return ctx.process_group
    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    return dist.group.WORLD


def fused_optimizer(optimizer: EmbeddingOptimizer) -> dict:
    """fbgemm's fused optimizer arguments for the scenario's embedding optimizer (its math
    is embbench.optim's: exact, duplicates summed first, one update per row and step)."""
    from baselines._fbgemm import EmbOptimType

    kind = {"sgd": EmbOptimType.EXACT_SGD, "rowwise_adagrad": EmbOptimType.EXACT_ROWWISE_ADAGRAD}[optimizer.type]
    return {"optimizer": kind, "learning_rate": optimizer.lr, "eps": optimizer.eps}


class TorchrecTables(SparseModule):
    """An EmbeddingBagCollection sharded by torchrec's DistributedModelParallel."""

    def __init__(self, ctx: BuildContext, kernel: str, sharding: str | None, cache_params=None,
                 extra_fused: dict | None = None):
        super().__init__()
        from baselines._fbgemm import (DistributedModelParallel, EmbeddingBagCollection, EmbeddingBagCollectionSharder,
                                       EmbeddingBagConfig, EmbeddingShardingPlanner, ParameterConstraints, PoolingType,
                                       ShardingEnv, Topology)

        group = _process_group(ctx)
        device = ctx.env.device
        self.tables, self.keys = ctx.tables, [t.name for t in ctx.tables]
        ebc = EmbeddingBagCollection(
            tables=[EmbeddingBagConfig(name=t.name, embedding_dim=t.dim, num_embeddings=t.num_rows,
                                       feature_names=[t.name], pooling=PoolingType.SUM) for t in ctx.tables],
            device=torch.device("meta"),
        )
        sharder = EmbeddingBagCollectionSharder(fused_params={**fused_optimizer(ctx.optimizer), **(extra_fused or {})})
        constraints = {
            t.name: ParameterConstraints(
                sharding_types=[sharding] if sharding else None, compute_kernels=[kernel],
                cache_params=cache_params, pooling_factors=[float(t.bag_size)],
            )
            for t in ctx.tables
        }
        world = dist.get_world_size(group)
        topology = Topology(world_size=world, local_world_size=world, compute_device=device.type,
                            hbm_cap=torch.cuda.get_device_properties(device).total_memory if device.type == "cuda" else None)
        planner = EmbeddingShardingPlanner(topology=topology, constraints=constraints,
                                           batch_size=ctx.local_batch_size)
        try:
            plan = planner.collective_plan(ebc, [sharder], group)
        except Exception as e:  # the planner's way of saying "does not fit"
            if "insufficient" in str(e).lower() or "memory" in str(e).lower():
                raise torch.OutOfMemoryError(f"torchrec's planner found no plan that fits: {e}") from e
            raise
        self.plan = plan
        self.dmp = DistributedModelParallel(ebc, env=ShardingEnv.from_process_group(group), device=device,
                                            plan=plan, sharders=[sharder])
        self.group = group
        self._load_initial_weights(ctx)
        self._accesses = 0

    def _sharded_weights(self):
        """(table index, ShardedTensor) for every table."""
        state = self.dmp.state_dict()
        for i, t in enumerate(self.tables):
            (key,) = [k for k in state if k.endswith(f"embedding_bags.{t.name}.weight")]
            yield i, state[key]

    def _load_initial_weights(self, ctx: BuildContext) -> None:
        with torch.no_grad():
            for i, weight in self._sharded_weights():
                for shard in weight.local_shards():
                    (row, col), (rows, cols) = shard.metadata.shard_offsets, shard.metadata.shard_sizes
                    for lo in range(0, rows, 1 << 20):  # a chunk at a time: no second copy of a table
                        hi = min(rows, lo + (1 << 20))
                        block = ctx.init_weights(i, row + lo, row + hi)[:, col : col + cols]
                        shard.tensor[lo:hi].copy_(block.to(shard.tensor.device))

    def forward(self, features: SparseFeatures) -> Tensor:
        self._accesses += features.values.numel()
        pooled = self.dmp(features.to_kjt(self.keys))
        if pooled.keys() == self.keys:
            return pooled.values()
        # Sharded outputs come grouped by shard, not in feature order: put them back.
        by_key = pooled.to_dict()
        return torch.cat([by_key[k] for k in self.keys], dim=1)

    def counters(self) -> dict[str, int]:
        return {"accesses": self._accesses}

    def extra_metrics(self) -> dict:
        """The plan: each table's sharding type, kernel and ranks."""
        return {"plan": {
            name: {"sharding": p.sharding_type, "kernel": p.compute_kernel, "ranks": p.ranks}
            for module_plan in self.plan.plan.values() for name, p in module_plan.items()
        }}

    def _tbes(self):
        from baselines._fbgemm import SplitTableBatchedEmbeddingBagsCodegen

        # The sharded collection keeps its lookups (and their fbgemm TBEs) outside its
        # registered submodules, in ``_lookups``.
        lookups = getattr(self.dmp.module, "_lookups", [])
        return [m for lookup in lookups for m in lookup.modules() if isinstance(m, SplitTableBatchedEmbeddingBagsCodegen)]

    def memory(self) -> MemoryFootprint:
        """This rank's weights, optimizer state and cache, by where fbgemm put them
        (``*_host`` is the compute device's own memory when that device is the CPU)."""
        on_cpu = self.dmp.device.type == "cpu"
        footprint = MemoryFootprint()
        for tbe in self._tbes():
            for name in ("weights", "momentum1"):
                for place in ("dev", "uvm", "host"):
                    t = getattr(tbe, f"{name}_{place}", None)
                    nbytes = t.numel() * t.element_size() if t is not None else 0
                    if place == "dev" or (place == "host" and on_cpu):
                        footprint.device_bytes += nbytes
                    else:
                        footprint.host_bytes += nbytes
            cache = getattr(tbe, "lxu_cache_weights", None)
            footprint.device_bytes += cache.numel() * cache.element_size() if cache is not None else 0
        return footprint

    def flush(self) -> list[Tensor]:
        """Full tables on every rank: each rank fills the rows it owns, then a sum-reduce."""
        out = []
        for i, weight in self._sharded_weights():
            full = torch.zeros(self.tables[i].num_rows, self.tables[i].dim)
            for shard in weight.local_shards():
                (row, col), (rows, cols) = shard.metadata.shard_offsets, shard.metadata.shard_sizes
                full[row : row + rows, col : col + cols] = shard.tensor.detach().cpu()
            if dist.get_world_size(self.group) > 1:
                device = self.dmp.device
                full_dev = full.to(device)
                dist.all_reduce(full_dev, group=self.group)
                full = full_dev.cpu()
            out.append(full)
        return out


def _bytes(tables: list[TableSpec], optimizer: EmbeddingOptimizer) -> int:
    return sum(t.num_rows * (t.dim + optimizer.state_width) * 4 for t in tables)


def _needs_cuda(env: RuntimeEnv) -> str | None:
    return None if env.cuda else "needs CUDA (fbgemm's unified-memory kernels)"


class GpuShardedParams(StrategyParams):
    sharding: Literal["auto", "table_wise", "row_wise", "column_wise"] = Field(
        "auto", description="torchrec sharding type, or the planner's choice")


class GpuShardedStrategy(Strategy):
    name = "gpu_sharded"
    summary = "torchrec DistributedModelParallel, fused kernel: tables sharded over the devices' memory"
    Params = GpuShardedParams

    def unsupported_reason(self, env: RuntimeEnv) -> str | None:
        if self.params.sharding == "row_wise" and not env.cuda:
            return "torchrec shards row_wise only on CUDA devices"
        return None

    def estimate_memory(self, tables, optimizer, world_size):
        return MemoryFootprint(device_bytes=math.ceil(_bytes(tables, optimizer) / world_size))

    def build(self, ctx: BuildContext) -> SparseModule:
        sharding = None if self.params.sharding == "auto" else self.params.sharding
        return TorchrecTables(ctx, kernel="fused", sharding=sharding)


class UvmStrategy(Strategy):
    name = "uvm"
    summary = "fbgemm unified memory (EmbeddingLocation.MANAGED, torchrec fused_uvm): tables on the host"

    def unsupported_reason(self, env: RuntimeEnv) -> str | None:
        return _needs_cuda(env)

    def estimate_memory(self, tables, optimizer, world_size):
        return MemoryFootprint(host_bytes=math.ceil(_bytes(tables, optimizer) / world_size))

    def build(self, ctx: BuildContext) -> SparseModule:
        return TorchrecTables(ctx, kernel="fused_uvm", sharding="table_wise")


class UvmCacheParams(StrategyParams):
    cache_ratio: float = Field(0.015, gt=0, le=1, description="fbgemm's cache load factor: share of rows cached")
    algorithm: Literal["lru", "lfu"] = Field("lru", description="fbgemm's cache replacement")
    prefetch_pipeline: bool = Field(False, description="prefetch the next batch's rows (torchrec TrainPipelinePrefetch)")


class UvmCacheStrategy(Strategy):
    name = "uvm_cache"
    summary = "fbgemm unified memory behind its set-associative LRU/LFU device cache (fused_uvm_caching)"
    Params = UvmCacheParams

    def unsupported_reason(self, env: RuntimeEnv) -> str | None:
        if self.params.prefetch_pipeline:
            return "prefetch_pipeline needs torchrec's TrainPipelinePrefetch, which embbench does not drive yet"
        return _needs_cuda(env)

    def estimate_memory(self, tables, optimizer, world_size):
        # fbgemm's cache holds weights only; optimizer state stays in unified memory
        cached = fbgemm_cache_rows(self.params.cache_ratio, sum(t.num_rows for t in tables))
        return MemoryFootprint(device_bytes=cached * tables[0].dim * 4,
                               host_bytes=math.ceil(_bytes(tables, optimizer) / world_size))

    def build(self, ctx: BuildContext) -> SparseModule:
        from baselines._fbgemm import CacheAlgorithm, CacheParams

        cache = CacheParams(algorithm={"lru": CacheAlgorithm.LRU, "lfu": CacheAlgorithm.LFU}[self.params.algorithm],
                            load_factor=self.params.cache_ratio, prefetch_pipeline=False)
        return _UvmCacheTables(ctx, kernel="fused_uvm_caching", sharding="table_wise", cache_params=cache,
                               extra_fused={"gather_uvm_cache_stats": True})


class _UvmCacheTables(TorchrecTables):
    """fbgemm's cache counters, mapped onto embbench's names."""

    def counters(self) -> dict[str, int]:
        total: dict[str, int] = {}
        for tbe in self._tbes():
            row_bytes = tbe.max_D * 4  # only weights are cached (fp32); the state stays in UVM
            for k, v in counters_from_uvm_cache_stats(tbe.get_uvm_cache_stats().tolist(), row_bytes).items():
                total[k] = total.get(k, 0) + v
        return total

    def extra_metrics(self) -> dict:
        return {**super().extra_metrics(),
                "capacity_rows": sum(int(t.lxu_cache_weights.shape[0]) for t in self._tbes())}
