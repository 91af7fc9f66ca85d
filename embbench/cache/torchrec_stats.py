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

from pathlib import Path

import numpy as np
from torchrec.distributed.types import CacheParams, CacheStatistics

from embbench.cache.curve import read_curve

__all__ = ["CurveCacheStatistics", "curve_constraints"]


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
