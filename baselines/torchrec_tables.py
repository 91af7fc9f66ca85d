"""The ecosystem's placements, set up the way torchrec users set them up.

``gpu_sharded``  torchrec DistributedModelParallel, fused kernel (tables in device memory),
                 sharded table-, row- or column-wise or as the planner decides.
``uvm``          fbgemm EmbeddingLocation.MANAGED: tables in unified memory (torchrec's
                 ``fused_uvm`` kernel).
``uvm_cache``    fbgemm EmbeddingLocation.MANAGED_CACHING: unified memory behind fbgemm's
                 set-associative LRU/LFU cache (torchrec's ``fused_uvm_caching``); with
                 ``prefetch_pipeline``, fbgemm's prefetch pipeline (baselines/torchrec_prefetch.py).

All three let fbgemm's fused optimizer apply the scenario's embedding optimizer in
backward (``exact_sgd`` or ``exact_rowwise_adagrad``: the math of embbench.optim).
"""

from __future__ import annotations

import functools
import math
from typing import Literal

import torch
import torch.distributed as dist
from pydantic import Field
from torch import Tensor

from embbench.plugin import (ROW_PRECISIONS, BuildContext, EmbeddingOptimizer, MemoryFootprint, RuntimeEnv,
                             SparseFeatures, SparseModule, Strategy, StrategyParams, TableSpec, Unsupported,
                             fill_in_parallel, table_bytes)

#: fbgemm's cache associativity on CUDA: the cache holds whole sets of this many rows.
FBGEMM_CACHE_ASSOC = 32

#: What uvm_cache counts per table and training step (columns of :func:`cache_step_counts`).
CACHE_FIELDS = ("accesses", "unique_accesses", "hits", "misses", "unique_misses", "rows_admitted", "rows_evicted")


def fbgemm_cache_rows(cache_ratio: float, num_rows: int) -> int:
    """Rows fbgemm's cache really holds for a load factor: whole sets, rounded up."""
    sets = max(1, (int(num_rows * cache_ratio) + FBGEMM_CACHE_ASSOC - 1) // FBGEMM_CACHE_ASSOC)
    return sets * FBGEMM_CACHE_ASSOC


def linear_cache_indices(indices: Tensor, offsets: Tensor, hash_size_cumsum: Tensor, total: int) -> Tensor:
    """fbgemm's linear cache index of every id of a TBE call: its feature's start in the
    cached row space plus the id, or ``total`` for a feature whose table is not cached.

    Args:
        indices, offsets: the TBE's input (``offsets`` ``[F * B + 1]``, feature-major).
        hash_size_cumsum: fbgemm's ``cache_hash_size_cumsum`` (``[F + 1]``, -1 for uncached).
        total: the number of cached rows (``total_cache_hash_size``).
    """
    features = hash_size_cumsum.numel() - 1
    per_feature = offsets[:: (offsets.numel() - 1) // features].diff() if features else offsets[:0]
    feature = torch.repeat_interleave(torch.arange(features, device=indices.device), per_feature,
                                      output_size=indices.numel())
    start = hash_size_cumsum[feature]
    return torch.where(start >= 0, start + indices, total)


def table_bounds(index_table: Tensor, num_tables: int) -> Tensor:
    """Each table's range of linear cache indices, ``[num_tables, 2]`` (start, end), from fbgemm's
    ``cache_index_table_map`` (linear index -> table), in which every cached table holds one
    contiguous range; an uncached table's is empty. Read on the host once (at build)."""
    bounds = torch.zeros(num_tables, 2, dtype=torch.long)
    n = index_table.numel()
    if n:
        change = (index_table[1:] != index_table[:-1]).nonzero().flatten() + 1
        starts = torch.cat([change.new_zeros(1), change]).cpu()
        ends = torch.cat([starts[1:], torch.tensor([n])])
        for table, a, b in zip(index_table[starts.to(index_table.device)].tolist(), starts.tolist(), ends.tolist()):
            if table >= 0:
                if bounds[table, 1] > bounds[table, 0]:
                    raise ValueError(f"fbgemm's cache_index_table_map gives table {table} two ranges")
                bounds[table] = torch.tensor([a, b])
    return bounds


def _per_table(ordered: Tensor, mask: Tensor, bounds: Tensor) -> Tensor:
    """How many entries of ``ordered`` (ascending) that ``mask`` marks fall in each table's
    range: the marked entries' running count read at the ranges' ends. No scatter: nothing
    aims many entries at one address."""
    running = torch.cat([mask.new_zeros(1, dtype=torch.long), mask.long().cumsum(0)])
    at = torch.searchsorted(ordered, bounds)
    return running[at[:, 1]] - running[at[:, 0]]


def cache_step_counts(linear: Tensor, state_before: Tensor, state_after: Tensor, bounds: Tensor) -> Tensor:
    """What one prefetch of fbgemm's set-associative cache did, per table.

    Built only on what every fbgemm release exposes for both LRU and LFU: the cache state
    (``lxu_cache_state``: the linear index held by each slot, -1 when empty) before and
    after the prefetch, and the batch's linear indices. fbgemm's own ``uvm_cache_stats``
    are filled by the LRU path only, in total (not per table); its ``record_cache_metrics``
    counts misses only. All counts are exact: a miss is an id whose row was not cached
    before the prefetch; a slot whose content changed evicted its old row (if any) and
    admitted its new one (fbgemm fills each slot at most once per prefetch).

    Args:
        linear: the batch's linear cache indices (:func:`linear_cache_indices`).
        state_before, state_after: ``lxu_cache_state`` around the prefetch.
        bounds: each table's range of linear indices (:func:`table_bounds`), on ``linear``'s device.

    Returns:
        ``[num_tables, len(CACHE_FIELDS)]`` int64 counts, on ``linear``'s device. Fixed-size
        tensor operations only (no host synchronisation), and per table from sorted values
        at the tables' boundaries (:func:`_per_table`): no accumulating scatter.
    """
    before, after = state_before.reshape(-1), state_after.reshape(-1)
    ids, _ = linear.sort()
    first = torch.ones_like(ids, dtype=torch.bool)
    first[1:] = ids[1:] != ids[:-1]
    if before.numel():
        resident = before.sort().values  # empty slots (-1) sort first and match no id
        hit = resident[torch.searchsorted(resident, ids).clamp_max(resident.numel() - 1)] == ids
    else:
        hit = torch.zeros_like(first)
    changed = before != after
    new_rows, new_order = after.sort()
    old_rows, old_order = before.sort()
    every = torch.ones_like(first)  # an uncached table's ids (the total) lie past every range
    counts = {
        "accesses": _per_table(ids, every, bounds),
        "unique_accesses": _per_table(ids, first, bounds),
        "hits": _per_table(ids, hit, bounds),
        "misses": _per_table(ids, ~hit, bounds),
        "unique_misses": _per_table(ids, first & ~hit, bounds),
        "rows_admitted": _per_table(new_rows, changed[new_order], bounds),  # (-1 lies before every range)
        "rows_evicted": _per_table(old_rows, changed[old_order], bounds),
    }
    return torch.stack([counts[f] for f in CACHE_FIELDS], dim=1)


def cache_counters(counts: Tensor, row_bytes: list[int]) -> dict[str, int]:
    """Per-table cache counts (``[T, len(CACHE_FIELDS)]``) as embbench counters, summed.

    Exact: accesses, hits, misses and their unique forms, rows admitted and evicted.
    Derived from fbgemm's design: every evicted row is written back (fbgemm keeps no dirty
    bit), and a missed row that found no slot (its set was full of rows this batch needs,
    or LFU kept the incumbents) is read and updated in place in unified memory. Bytes count
    weights only, each missed row once each way (rows read more than once in place cross
    more often; the rowwise-Adagrad state stays in unified memory and is not counted).
    """
    c = {f: counts[:, i].tolist() for i, f in enumerate(CACHE_FIELDS)}
    in_place = [m - a for m, a in zip(c["unique_misses"], c["rows_admitted"])]
    out = {f: sum(v) for f, v in c.items()}
    out["rows_written_back"] = out["rows_evicted"]
    out["bytes_h2d"] = sum(m * b for m, b in zip(c["unique_misses"], row_bytes))
    out["bytes_d2h"] = sum((e + p) * b for e, p, b in zip(c["rows_evicted"], in_place, row_bytes))
    return out


class CacheObserver:
    """Counts one fbgemm TBE's cache traffic in training steps: before each prefetch it takes
    the batch's linear indices and a copy of the cache state, after it compares. The prefetch
    runs inside forward (forward hooks), or, with fbgemm's prefetch pipeline
    (``at_prefetch``), in the TBE's own ``prefetch()``, which forward then skips (its
    ``prefetch`` is wrapped): each batch is counted once either way. Evaluation (no grad) is
    not counted, nor any step while ``active`` is False (the timed steps: it is the harness's
    instrument, a clone, three sorts and searches a step, ~20 % of an H100 step at the Kaggle
    shape when it ran in them: results/2026-11-28-h100)."""

    #: what it counts, as ``SparseModule.instruments`` names it
    WHAT = "fbgemm cache traffic per table: a copy of the cache state around each prefetch, compared"

    def __init__(self, tbe: torch.nn.Module, at_prefetch: bool = False):
        self.features = tbe.cache_hash_size_cumsum.numel() - 1
        self.enabled = tbe.lxu_cache_weights.numel() > 0
        self.active = True
        self.counts = torch.zeros(self.features, len(CACHE_FIELDS), dtype=torch.long,
                                  device=tbe.lxu_cache_state.device)
        self.bounds = table_bounds(tbe.cache_index_table_map, self.features).to(tbe.lxu_cache_state.device)
        self.row_bytes = [d * tbe.lxu_cache_weights.element_size() for d in tbe.D_offsets.diff().tolist()]
        self._pending: tuple[Tensor, Tensor] | None = None
        if at_prefetch:
            prefetch = tbe.prefetch

            def counted_prefetch(indices, offsets, *args, **kwargs):  # torchrec passes keywords
                self._before(tbe, (indices, offsets), {})
                prefetch(indices, offsets, *args, **kwargs)
                self._after(tbe, (), None)

            tbe.prefetch = counted_prefetch
        else:
            tbe.register_forward_pre_hook(self._before, with_kwargs=True)
            tbe.register_forward_hook(self._after)

    def _before(self, tbe, args, kwargs) -> None:
        self._pending = None
        if not (self.enabled and self.active and torch.is_grad_enabled()):
            return
        indices = kwargs["indices"] if "indices" in kwargs else args[0]
        offsets = kwargs["offsets"] if "offsets" in kwargs else args[1]
        total = tbe.cache_index_table_map.numel()
        linear = linear_cache_indices(indices.long(), offsets.long(), tbe.cache_hash_size_cumsum, total)
        self._pending = (linear, tbe.lxu_cache_state.clone())

    def _after(self, tbe, args, output) -> None:
        if self._pending is not None:
            linear, before = self._pending
            self._pending = None
            self.counts += cache_step_counts(linear, before, tbe.lxu_cache_state, self.bounds)


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


#: fbgemm's SparseType (and torchrec's DataType) of each row precision; fbgemm's fp8 is NFP8
#: (E4M3 without a per-row scale), its cache holds NFP8 rows as FP16 (torchrec sets that).
FBGEMM_PRECISION = {"fp32": "FP32", "fp16": "FP16", "bf16": "BF16", "fp8": "NFP8"}


def sparse_type(precision: str):
    from baselines._fbgemm import SparseType

    return getattr(SparseType, FBGEMM_PRECISION[precision])


@functools.cache
def fbgemm_cpu_refusal(precision: str) -> str | None:
    """Why fbgemm's CPU kernels cannot train rows stored in ``precision``, found by training a
    tiny table one step (fbgemm-gpu-cpu 1.8 has fp16 CPU kernels, but none for bf16 or NFP8),
    or None. fbgemm's CPU update rounds to nearest (its ``stochastic_rounding`` is CUDA's)."""
    if precision == "fp32":
        return None
    from baselines._fbgemm import ComputeDevice, EmbeddingLocation, PoolingMode, SparseType, \
        SplitTableBatchedEmbeddingBagsCodegen

    try:
        tbe = SplitTableBatchedEmbeddingBagsCodegen(
            [(4, 4, EmbeddingLocation.HOST, ComputeDevice.CPU)], pooling_mode=PoolingMode.SUM,
            weights_precision=sparse_type(precision), output_dtype=SparseType.FP32, device=torch.device("cpu"),
            **fused_optimizer(EmbeddingOptimizer()))
        tbe(torch.tensor([0, 1]), torch.tensor([0, 2])).sum().backward()
    except Exception as e:  # NotImplementedError for the types it has no kernel for
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        return f"row_precision {precision}: {fbgemm_package()}'s CPU kernels cannot train {FBGEMM_PRECISION[precision]} rows ({first})"
    return None


def fbgemm_package() -> str:
    """The installed fbgemm distribution with its version (``fbgemm-gpu-cpu 1.8.0``)."""
    from importlib.metadata import version

    return next((f"{p} {version(p)}" for p in ("fbgemm-gpu-cpu", "fbgemm-gpu") if _installed(p)), "fbgemm")


def _installed(package: str) -> bool:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return bool(version(package))
    except PackageNotFoundError:
        return False


class FbgemmRowPrecision:
    """Strategy mixin: rows in every precision fbgemm stores (``weights_precision``), refused
    where fbgemm's CPU kernels do the work and have no kernel for it."""

    row_precisions = ROW_PRECISIONS
    #: whether fbgemm's CPU kernels train the rows (always, or only without CUDA)
    cpu_kernels_always = False

    def row_precision_reason(self, precision: str, env: RuntimeEnv) -> str | None:
        refused = super().row_precision_reason(precision, env)
        if refused or (env.cuda and not self.cpu_kernels_always):
            return refused
        return fbgemm_cpu_refusal(precision)


class TorchrecTables(SparseModule):
    """An EmbeddingBagCollection sharded by torchrec's DistributedModelParallel."""

    def __init__(self, ctx: BuildContext, kernel: str, sharding: str | None, cache_params=None):
        super().__init__()
        from baselines._fbgemm import (DataType, DistributedModelParallel, EmbeddingBagCollection,
                                       EmbeddingBagCollectionSharder,
                                       EmbeddingBagConfig, EmbeddingShardingPlanner, ParameterConstraints, PoolingType,
                                       ShardingEnv, Topology)

        group = _process_group(ctx)
        device = ctx.env.device
        self.tables, self.keys = ctx.tables, [t.name for t in ctx.tables]
        ebc = EmbeddingBagCollection(
            # init_fn: torchrec draws every table at random once more after sharding (1 s of a 4.7 s
            # build at a twentieth of the Kaggle shape); _load_initial_weights writes them anyway
            tables=[EmbeddingBagConfig(name=t.name, embedding_dim=t.dim, num_embeddings=t.num_rows,
                                       feature_names=[t.name], pooling=PoolingType.SUM,
                                       data_type=getattr(DataType, FBGEMM_PRECISION[ctx.row_precision]),
                                       init_fn=_left_for_load)
                    for t in ctx.tables],
            device=torch.device("meta"),
        )
        sharder = EmbeddingBagCollectionSharder(fused_params=fused_optimizer(ctx.optimizer))
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
        """Every local shard's rows, a chunk at a time (no second copy of a table), on a thread
        per core."""
        chunk = 1 << 18
        jobs = [(i, shard, lo) for i, weight in self._sharded_weights() for shard in weight.local_shards()
                for lo in range(0, shard.metadata.shard_sizes[0], chunk)]

        def fill(job) -> None:
            i, shard, lo = job
            (row, col), (rows, cols) = shard.metadata.shard_offsets, shard.metadata.shard_sizes
            hi = min(rows, lo + chunk)
            block = ctx.init_weights(i, row + lo, row + hi)[:, col : col + cols]
            with torch.no_grad():
                shard.tensor[lo:hi].copy_(block.to(shard.tensor.device))

        fill_in_parallel(fill, jobs)

    def forward(self, features: SparseFeatures) -> Tensor:
        self._accesses += features.values.numel()
        return self._pooled_values(self.dmp(features.to_kjt(self.keys)))

    def _pooled_values(self, pooled) -> Tensor:
        """A sharded collection's KeyedTensor as ``[batch, tables * dim]`` in table order."""
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
                full[row : row + rows, col : col + cols] = shard.tensor.detach().cpu().float()
            if dist.get_world_size(self.group) > 1:
                device = self.dmp.device
                full_dev = full.to(device)
                dist.all_reduce(full_dev, group=self.group)
                full = full_dev.cpu()
            out.append(full)
        return out


def _bytes(tables: list[TableSpec], optimizer: EmbeddingOptimizer, row_precision: str) -> int:
    return table_bytes(tables, optimizer.state_width, row_precision)


def _left_for_load(weight: Tensor) -> Tensor:
    """A table's init_fn: nothing (TorchrecTables writes the initial weights itself)."""
    return weight


def _needs_cuda(env: RuntimeEnv) -> str | None:
    return None if env.cuda else "needs CUDA (fbgemm's unified-memory kernels)"


class GpuShardedParams(StrategyParams):
    sharding: Literal["auto", "table_wise", "row_wise", "column_wise"] = Field(
        "auto", description="torchrec sharding type, or the planner's choice")


class GpuShardedStrategy(FbgemmRowPrecision, Strategy):
    name = "gpu_sharded"
    summary = "torchrec DistributedModelParallel, fused kernel: tables sharded over the devices' memory"
    Params = GpuShardedParams
    all_in_hbm = True  # fbgemm's fused TBE, optimizer fused into backward: what torchrec users run when tables fit

    def unsupported_reason(self, env: RuntimeEnv) -> str | None:
        if self.params.sharding == "row_wise" and not env.cuda:
            return "torchrec shards row_wise only on CUDA devices"
        return None

    def estimate_memory(self, tables, optimizer, world_size, row_precision="fp32"):
        return MemoryFootprint(device_bytes=math.ceil(_bytes(tables, optimizer, row_precision) / world_size))

    def build(self, ctx: BuildContext) -> SparseModule:
        sharding = None if self.params.sharding == "auto" else self.params.sharding
        return TorchrecTables(ctx, kernel="fused", sharding=sharding)


class UvmStrategy(FbgemmRowPrecision, Strategy):
    name = "uvm"
    summary = "fbgemm unified memory (EmbeddingLocation.MANAGED, torchrec fused_uvm): tables on the host"

    def unsupported_reason(self, env: RuntimeEnv) -> str | None:
        return _needs_cuda(env)

    def estimate_memory(self, tables, optimizer, world_size, row_precision="fp32"):
        managed = math.ceil(_bytes(tables, optimizer, row_precision) / world_size)  # fbgemm's EmbeddingLocation.MANAGED
        return MemoryFootprint(host_bytes=managed, managed_bytes=managed)

    def build(self, ctx: BuildContext) -> SparseModule:
        return TorchrecTables(ctx, kernel="fused_uvm", sharding="table_wise")


class UvmCacheParams(StrategyParams):
    cache_ratio: float = Field(0.015, gt=0, le=1, description="fbgemm's cache load factor: share of rows cached")
    algorithm: Literal["lru", "lfu"] = Field("lru", description="fbgemm's cache replacement")
    prefetch_pipeline: bool = Field(False, description=(
        "prefetch the next batch's rows on a side stream while this batch trains, as torchrec's "
        "PrefetchTrainPipelineSparseDist does (LRU only); off until a GPU measures it faster"))


class UvmCacheStrategy(FbgemmRowPrecision, Strategy):
    name = "uvm_cache"
    summary = "fbgemm unified memory behind its set-associative LRU/LFU device cache (fused_uvm_caching)"
    Params = UvmCacheParams

    def unsupported_reason(self, env: RuntimeEnv) -> str | None:
        if self.params.prefetch_pipeline and self.params.algorithm != "lru":
            return "fbgemm's prefetch pipeline supports the LRU cache only (it asserts so in 1.6 and 1.8)"
        return _needs_cuda(env)

    def estimate_memory(self, tables, optimizer, world_size, row_precision="fp32"):
        # fbgemm's cache holds weights only (fp32 rows in fp32, others in fp16); optimizer state
        # stays in unified memory
        cached = fbgemm_cache_rows(self.params.cache_ratio, sum(t.num_rows for t in tables))
        managed = math.ceil(_bytes(tables, optimizer, row_precision) / world_size)  # EmbeddingLocation.MANAGED_CACHING
        element = 4 if row_precision == "fp32" else 2
        return MemoryFootprint(device_bytes=cached * tables[0].dim * element, host_bytes=managed, managed_bytes=managed)

    def build(self, ctx: BuildContext) -> SparseModule:
        from baselines._fbgemm import CacheAlgorithm, CacheParams

        cache = CacheParams(algorithm={"lru": CacheAlgorithm.LRU, "lfu": CacheAlgorithm.LFU}[self.params.algorithm],
                            load_factor=self.params.cache_ratio, prefetch_pipeline=self.params.prefetch_pipeline)
        try:
            return _UvmCacheTables(ctx, kernel="fused_uvm_caching", sharding="table_wise", cache_params=cache,
                                   prefetch_pipeline=self.params.prefetch_pipeline)
        except AssertionError as e:  # fbgemm 1.6-1.8's cache holds FP32, FP16 or NFP8 (as FP16) rows only
            if "cache_precision" in str(e):
                raise Unsupported(f"row_precision {ctx.row_precision}: fbgemm's cache refuses it ({e})") from e
            raise


class _UvmCacheTables(TorchrecTables):
    """fbgemm's cache, counted per table by a :class:`CacheObserver` on each of its TBEs; with
    ``prefetch_pipeline`` driven by a :class:`~baselines.torchrec_prefetch.PrefetchPipeline`
    through the harness's hooks (its TBEs built with fbgemm's ``prefetch_pipeline=True``)."""

    def __init__(self, ctx: BuildContext, prefetch_pipeline: bool = False, **kwargs):
        super().__init__(ctx, **kwargs)
        self._observe(prefetch_pipeline, ctx.env.device)

    def _observe(self, prefetch_pipeline: bool, device: torch.device) -> None:
        from baselines.torchrec_prefetch import PrefetchPipeline

        self._observers = [(tbe, CacheObserver(tbe, at_prefetch=prefetch_pipeline)) for tbe in self._tbes()]
        self.pipeline = PrefetchPipeline(self.dmp.module, device) if prefetch_pipeline else None
        self.lookahead = 1 if prefetch_pipeline else 0  # look_ahead marks when the next batch is ready

    def instruments(self) -> dict[str, str]:
        return {"fbgemm_cache_counts": CacheObserver.WHAT} if any(o.enabled for _, o in self._observers) else {}

    def set_counting(self, mode) -> None:
        for _, observer in self._observers:  # the warm-up's stopping rule reads its miss rate
            observer.active = mode != "off"

    def look_ahead(self, upcoming: list[SparseFeatures]) -> None:
        if self.pipeline is not None:
            self.pipeline.inputs_ready()

    def prefetch(self, features: SparseFeatures) -> None:
        if self.pipeline is not None and torch.is_grad_enabled():
            self.pipeline.prefetch(features, features.to_kjt(self.keys))

    def forward(self, features: SparseFeatures) -> Tensor:
        if self.pipeline is None:
            return super().forward(features)
        if not torch.is_grad_enabled():  # evaluation: torchrec's plain forward (fbgemm prefetches inside)
            self.pipeline.drain()
            return super().forward(features)
        self._accesses += features.values.numel()
        return self._pooled_values(self.pipeline.forward(features, features.to_kjt(self.keys)))

    def counters(self) -> dict[str, int]:
        if self.pipeline is not None:
            self.pipeline.wait()  # the counts of a prefetch are written on its stream
        total: dict[str, int] = {}
        for _, observer in self._observers:
            for k, v in cache_counters(observer.counts, observer.row_bytes).items():
                total[k] = total.get(k, 0) + v
        return total

    def extra_metrics(self) -> dict:
        per_table = {}
        for i, (tbe, observer) in enumerate(self._observers):
            names = list(getattr(tbe, "table_names", None) or [])
            if len(names) != observer.features:
                names = [f"tbe{i}.feature{f}" for f in range(observer.features)]
            for name, row in zip(names, observer.counts.tolist()):
                per_table[name] = dict(zip(CACHE_FIELDS, row))
        return {**super().extra_metrics(),
                "capacity_rows": sum(int(t.lxu_cache_weights.shape[0]) for t in self._tbes()),
                "cache_per_table": per_table}  # cumulative over all training steps, warm-up included
