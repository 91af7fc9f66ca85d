"""A cache curve handed to torchrec's planner: torchrec's ``CacheStatistics`` of each table
from an ``embbench curve --out`` JSON file.

    from embbench.cache.torchrec_stats import curve_constraints
    constraints = curve_constraints("curve.json")  # {table: ParameterConstraints(fused_uvm_caching, CacheParams(stats=...))}
    planner = EmbeddingShardingPlanner(topology, constraints=constraints, proposer=EmbeddingOffloadScaleupProposer())

torchrec's ``EmbeddingOffloadScaleupProposer`` then grows each table's cache (its load factor,
``clf``) where the curve says the misses fall most per byte. ``expected_miss_rate(clf)`` is the
curve's miss rate per distinct row (what a cache loads) at ``clf`` of the table's rows,
interpolated linearly between the measured sizes, from 1 at ``clf`` 0 to 0 at ``clf`` 1 (as
torchrec's interface asks: a cache of the whole table misses nothing once loaded). torchrec's
fbgemm cache is LRU, so the LRU line is the default.
"""

from __future__ import annotations

import logging
import os
import re
import warnings
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from torchrec.distributed.types import CacheParams, CacheStatistics

from embbench.cache.curve import read_curve

__all__ = ["CurveCacheStatistics", "PlannedTable", "curve_constraints", "plan_tables"]


class CurveCacheStatistics(CacheStatistics):
    """One table's line of a cache curve as torchrec's ``CacheStatistics``.

    Args:
        curve: a curve (:func:`read_curve`).
        table: the table's name (``all``: all tables in one cache).
        policy: the curve's line to use (``lru``, ``lfu``, ``min``).
    """

    def __init__(self, curve: dict, table: str, policy: str = "lru"):
        scopes = {s["name"]: s for s in curve["scopes"]}
        if table not in scopes:
            raise ValueError(f"table {table!r} is not in the curve (it has {', '.join(scopes)})")
        if policy not in curve["policies"] or policy == "freqcache":
            raise ValueError(f"policy {policy!r}: the curve's lines are {', '.join(p for p in curve['policies'] if p != 'freqcache')}")
        scope = scopes[table]
        self.table, self.policy = table, policy
        self._lookups = scope["distinct"] / curve["counted_steps"]
        misses = [1 - h for h in scope["policies"][policy]["unique_hit_rate"]]
        self._clf = np.array([0.0, *curve["ratios"], 1.0])
        self._miss = np.array([1.0, *misses, 0.0])

    @property
    def expected_lookups(self) -> float:
        """Distinct rows of the table per (global) training batch."""
        return self._lookups

    def expected_miss_rate(self, clf: float) -> float:
        return float(np.interp(clf, self._clf, self._miss))

    @property
    def cacheability(self) -> float:
        """The area under the miss rate over ``clf`` from 0 to 1 (as torchrec's own statistics
        define it): 0 caches perfectly, 1 not at all."""
        return float(np.sum(np.diff(self._clf) * (self._miss[1:] + self._miss[:-1]) / 2))

    def stable_fingerprint(self) -> tuple:
        """What the miss rates depend on (newer torchrec keys its planner cache by it)."""
        return ("embbench-curve", 1, self.table, self.policy, self._lookups, tuple(self._clf), tuple(self._miss))


def curve_constraints(path: str | Path, policy: str = "lru", load_factor: float | None = None) -> dict:
    """torchrec ``ParameterConstraints`` for every table of a curve file: fbgemm's UVM cache
    (``fused_uvm_caching``, LRU) with the curve's statistics, starting at ``load_factor``
    (default the curve's smallest size) for the planner to scale up."""
    from fbgemm_gpu.split_table_batched_embeddings_ops_common import CacheAlgorithm
    from torchrec.distributed.planner import ParameterConstraints

    curve = read_curve(path)
    start = min(curve["ratios"]) if load_factor is None else load_factor
    return {name: ParameterConstraints(compute_kernels=["fused_uvm_caching"],
                                       cache_params=CacheParams(algorithm=CacheAlgorithm.LRU, load_factor=start,
                                                                stats=CurveCacheStatistics(curve, name, policy)))
            for name in curve["tables"]}


@dataclass
class PlannedTable:
    """One table of torchrec's plan: where its planner puts the table, and the device bytes
    its storage estimate gives it (all shards together)."""

    name: str
    rows: int
    sharding_type: str
    compute_kernel: str
    #: the cache's size as a fraction of the rows (``fused_uvm_caching`` only)
    load_factor: float | None
    device_bytes: int


def plan_tables(tables: list, curve_path: str | Path, device_bytes: int, world_size: int = 1,
                batch_size: int = 512, policy: str = "lru", host_bytes: int | None = None) -> list[PlannedTable]:
    """torchrec's plan for ``tables`` (:class:`~embbench.data.presets.TableSpec`, rows in fp32)
    on ``world_size`` GPUs of ``device_bytes`` each, on one host of ``host_bytes`` (None: this
    machine's memory, never torchrec's default of 128 GB a rank): its
    ``EmbeddingShardingPlanner`` with the curve's statistics (:func:`curve_constraints`) and its
    ``EmbeddingOffloadScaleupProposer``, ``batch_size`` samples per rank. Planning needs no GPU.
    No plan that fits (torchrec's ``PlannerError``), a curve without the tables, or one measured
    on tables of other sizes is a one-line ValueError."""
    import torch
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology
    from torchrec.distributed.planner.proposers import EmbeddingOffloadScaleupProposer
    from torchrec.distributed.planner.types import PlannerError, Stats

    curve_rows = read_curve(curve_path)["tables"]
    missing = [t.name for t in tables if t.name not in curve_rows]
    other = [f"{t.name}: {curve_rows[t.name]:,} rows in the curve, {t.num_rows:,} in the scenario"
             for t in tables if t.name in curve_rows and curve_rows[t.name] != t.num_rows]
    if missing or other:
        raise ValueError(f"{curve_path}: not a curve of these tables ("
                         + (f"no {', '.join(missing)}" if missing else "; ".join(other[:3]))
                         + "); measure it with `embbench curve SCENARIO --out` on the run's scenario")

    class BestPlan(Stats):  # torchrec hands its stats the chosen sharding options, with their storage
        def log(self, *, best_plan, **_):
            self.options = best_plan

    best = BestPlan()
    ebc = EmbeddingBagCollection(tables=[EmbeddingBagConfig(name=t.name, embedding_dim=t.dim, num_embeddings=t.num_rows,
                                                            feature_names=[t.name]) for t in tables],
                                 device=torch.device("meta"))
    constraints = curve_constraints(curve_path, policy)
    torchrec_log = logging.getLogger("torchrec")
    level = torchrec_log.level
    torchrec_log.setLevel(logging.ERROR)  # its advice on building a Topology and on dry runs, not the user's concern
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", FutureWarning)
            host = host_bytes if host_bytes is not None else os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
            topology = Topology(world_size=world_size, compute_device="cuda", hbm_cap=device_bytes,
                                ddr_cap=host // world_size)
            planner = EmbeddingShardingPlanner(topology=topology, constraints=constraints, batch_size=batch_size,
                                               proposer=EmbeddingOffloadScaleupProposer(), stats=best)
            planner.plan(ebc, [EmbeddingBagCollectionSharder()])
    except PlannerError as e:
        shard = re.search(r"Shard of size Storage\(hbm=(\d+)", str(e))
        raise ValueError(f"torchrec's planner finds no plan of these tables for {device_bytes / 2**20:,.2f} MiB device "
                         f"and {host / world_size / 2**30:,.2f} GiB host memory per rank (less the share it "
                         "reserves for the dense part and the batches)"
                         + (f"; a shard it must place needs {int(shard[1]) / 2**20:,.2f} MiB on the device" if shard else "")
                         + ": plan with a larger --device-memory") from None
    finally:
        torchrec_log.setLevel(level)
    rows = {t.name: t.num_rows for t in tables}
    return [PlannedTable(o.name, rows[o.name], o.sharding_type, o.compute_kernel,
                         o.cache_load_factor if o.compute_kernel == "fused_uvm_caching" else None,
                         int(sum(s.storage.hbm for s in o.shards))) for o in best.options]
