"""A cache curve in torchrec's planner: the CacheStatistics adapter returns the curve's values,
and torchrec's own EmbeddingOffloadScaleupProposer plans with it (on the CPU: planning needs no GPU)."""

import json

import numpy as np
import pytest
import torch

from embbench.cache.curve import measure, read_curve
from embbench.cache.torchrec_stats import CurveCacheStatistics, curve_constraints

ROWS = {"hot": 200_000, "cold": 300_000}


@pytest.fixture(scope="module")
def curve_file(tmp_path_factory):
    """A skewed table and a uniform one, 20 batches of 4096 ids each."""
    rng = np.random.default_rng(0)
    steps = [np.concatenate([rng.zipf(1.3, 4096) % 200_000, 200_000 + rng.integers(0, 300_000, 4096)]) for _ in range(20)]
    path = tmp_path_factory.mktemp("curve") / "curve.json"
    path.write_text(json.dumps(measure(steps, ROWS, (0.001, 0.01, 0.05, 0.2), ("lru", "min"), skip=4, row_bytes=4 * 65)))
    return path


def test_statistics_are_the_curves_values(curve_file):
    curve = read_curve(curve_file)
    for scope in curve["scopes"]:
        stats = CurveCacheStatistics(curve, scope["name"], "lru")
        misses = [1 - h for h in scope["policies"]["lru"]["unique_hit_rate"]]
        assert [stats.expected_miss_rate(r) for r in curve["ratios"]] == pytest.approx(misses)
        assert stats.expected_miss_rate(0) == 1 and stats.expected_miss_rate(1) == 0
        assert stats.expected_miss_rate(0.1) == pytest.approx(misses[2] + (misses[3] - misses[2]) / 3)  # linear from 0.05 to 0.2
        assert stats.expected_lookups == scope["distinct"] / curve["counted_steps"]
        assert 0 < stats.cacheability < 1
    hot, cold = (CurveCacheStatistics(curve, name) for name in ("hot", "cold"))
    assert hot.cacheability < cold.cacheability  # the skewed table caches better
    with pytest.raises(ValueError, match="policy 'lfu'"):
        CurveCacheStatistics(curve, "hot", "lfu")
    with pytest.raises(ValueError, match="table 'warm' is not in the curve"):
        CurveCacheStatistics(curve, "warm")


def test_torchrec_planner_scales_caches_with_the_curve(curve_file):
    from torchrec import EmbeddingBagCollection, EmbeddingBagConfig
    from torchrec.distributed.embeddingbag import EmbeddingBagCollectionSharder
    from torchrec.distributed.planner import EmbeddingShardingPlanner, Topology
    from torchrec.distributed.planner.proposers import EmbeddingOffloadScaleupProposer

    ebc = EmbeddingBagCollection(tables=[EmbeddingBagConfig(name=n, embedding_dim=64, num_embeddings=r, feature_names=[n])
                                         for n, r in ROWS.items()], device=torch.device("meta"))
    constraints = curve_constraints(curve_file)
    planner = EmbeddingShardingPlanner(topology=Topology(world_size=1, compute_device="cuda", hbm_cap=60 << 20),
                                       constraints=constraints, proposer=EmbeddingOffloadScaleupProposer(), batch_size=4096)
    plan = planner.plan(ebc, [EmbeddingBagCollectionSharder()]).plan[""]
    for name in ROWS:
        assert plan[name].compute_kernel == "fused_uvm_caching"
        # The proposer moved the cache off the starting load factor, within the budget.
        assert 0.001 < plan[name].cache_params.load_factor < 1
        stats = plan[name].cache_params.stats  # a copy the planner made
        assert stats.stable_fingerprint() == constraints[name].cache_params.stats.stable_fingerprint()


def test_a_file_that_is_not_a_curve_is_refused_by_name(tmp_path):
    bad = tmp_path / "record.json"
    bad.write_text('{"schema_version": 3}')
    with pytest.raises(ValueError, match=f"{bad}: not a curve file"):
        read_curve(bad)
    bad.write_text("{")
    with pytest.raises(ValueError, match=f"{bad}: not a curve file \\(not JSON"):
        curve_constraints(bad)
