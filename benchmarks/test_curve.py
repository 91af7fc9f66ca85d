"""Benchmark of cache curves (``embbench curve``) at the full Criteo-Kaggle shape: 26 tables
(33.8M rows), batch 16384, 512 training batches (48 of warm-up, 464 counted), 12 cache
sizes from 0.1 % to 20 %, for all tables together and each table alone.

    .venv/bin/python -m pytest benchmarks/test_curve.py --benchmark-columns=min,max -s

Making the batches takes minutes (SyntheticCriteo makes dense features and labels too; about
0.5 s a batch on one core) and is not measured: the stream is made once per session.
freqcache's planner reads its look-ahead beyond the 512 batches (up to 256 more). Not part
of the test suite: speed is measured here, never asserted.
"""

import numpy as np
import pytest

from embbench.cache.curve import DEFAULT_RATIOS, measure
from embbench.cache.sweep import freqcache_policy
from embbench.data import Stream, SyntheticCriteo, make_tables
from embbench.embedding import RowSpace

BATCH, BATCHES, WARMUP = 16384, 512, 48


@pytest.fixture(scope="module")
def kaggle():
    """``i -> training batch i's global rows`` (each made once) and the tables' rows."""
    tables = make_tables("criteo_kaggle", dim=16)
    space, data, made = RowSpace(tables), SyntheticCriteo(tables, seed=0), {}

    def batch_rows(i: int) -> np.ndarray:
        if i not in made:
            made[i] = space.global_rows(data.batch(Stream.TRAIN, i, BATCH).sparse).numpy()
        return made[i]

    return batch_rows, {t.name: t.num_rows for t in tables}


def _report(benchmark, curve, policies):
    every = curve["scopes"][0]["policies"]
    benchmark.extra_info.update({f"{p}_unique_hit_rate": every[p]["unique_hit_rate"] for p in policies})


def test_lru_and_min_at_12_sizes(benchmark, kaggle):
    batch_rows, tables = kaggle
    steps = [batch_rows(i) for i in range(BATCHES)]
    curve = benchmark.pedantic(measure, (steps, tables, DEFAULT_RATIOS, ("lru", "min"), WARMUP, 4 * 17), rounds=1)
    _report(benchmark, curve, ("lru", "min"))


def test_lfu_at_12_sizes(benchmark, kaggle):
    batch_rows, tables = kaggle
    steps = [batch_rows(i) for i in range(BATCHES)]
    curve = benchmark.pedantic(measure, (steps, tables, DEFAULT_RATIOS, ("lfu",), WARMUP, 4 * 17), rounds=1)
    _report(benchmark, curve, ("lfu",))


def test_freqcache_at_3_sizes(benchmark, kaggle):
    """freqcache's device planner (on CPU tensors) driven as the sweep drives it, all tables in
    one cache, at the smallest, middle and largest size."""
    batch_rows, tables = kaggle
    steps = [batch_rows(i) for i in range(BATCHES)]
    ratios = (DEFAULT_RATIOS[0], DEFAULT_RATIOS[6], DEFAULT_RATIOS[-1])
    point = freqcache_policy(batch_rows, sum(tables.values()), len(steps[0]), 32, WARMUP - 32, BATCHES - WARMUP)
    for i in range(BATCHES, BATCHES + 256):  # the look-ahead's batches: made before the clock starts
        batch_rows(i)
    curve = benchmark.pedantic(measure, (steps, tables, ratios, ("freqcache",), WARMUP, 4 * 17, point, ratios), rounds=1)
    _report(benchmark, curve, ("freqcache",))
