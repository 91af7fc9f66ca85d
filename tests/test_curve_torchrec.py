"""A cache curve in torchrec's planner: the CacheStatistics adapter returns the curve's values,
and torchrec's own EmbeddingOffloadScaleupProposer plans with it (on the CPU: planning needs no GPU)."""

import json
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from embbench.cache.curve import measure, read_curve
from embbench.cache.torchrec_stats import CurveCacheStatistics, curve_constraints

ROWS = {"hot": 200_000, "cold": 300_000}


def _write_curve(path, names=tuple(ROWS)):
    """A skewed table and a uniform one (of ``ROWS``' sizes, named ``names``), 20 batches of 4096 ids each."""
    rng = np.random.default_rng(0)
    steps = [np.concatenate([rng.zipf(1.3, 4096) % 200_000, 200_000 + rng.integers(0, 300_000, 4096)]) for _ in range(20)]
    rows = dict(zip(names, ROWS.values()))
    path.write_text(json.dumps(measure(steps, rows, (0.001, 0.01, 0.05, 0.2), ("lru", "min"), skip=4, row_bytes=4 * 65)))
    return path


@pytest.fixture(scope="module")
def curve_file(tmp_path_factory):
    return _write_curve(tmp_path_factory.mktemp("curve") / "curve.json")


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
    with pytest.raises(ValueError, match=f"{bad}: not valid JSON \\(line 1\\): .*; not a curve file"):
        curve_constraints(bad)


# ``recommend --torchrec-plan``: torchrec's plan for the run's tables beside embbench's pick.

MiB = 1 << 20


@pytest.fixture(scope="module")
def plan_run(tmp_path_factory):
    """A run of two tables (t0, t1: ``ROWS``' sizes, dim 16: 30.5 MiB in fp32) whose records hold
    their scenario, with a measured cache that fits 16 MiB, a device cell that does not, and the
    tables' curve beside them."""
    import yaml
    from record_factory import make_record, write_run

    config = yaml.safe_load((Path(__file__).parents[1] / "scenarios" / "smoke.yaml").read_text())
    config["data"] = {"tables": [{"rows": r} for r in ROWS.values()], "embedding_dim": 16, "batch_size": 512}
    records = [make_record("device", step_times=[0.005] * 12, device_bytes=31 * MiB),
               make_record("uvm_cache", {"cache_ratio": 0.05, "algorithm": "lru"}, step_times=[0.008] * 12, device_bytes=2 * MiB)]
    for r in records:
        r.scenario["config"] = config
    run = write_run(tmp_path_factory.mktemp("plan") / "run", records)
    _write_curve(run / "curve.json", ("t0", "t1"))
    return run


def test_recommend_prints_torchrecs_plan_beside_its_own(plan_run, capsys):
    from embbench.cli import main

    assert main(["recommend", str(plan_run), "--device-memory", "16MiB", "--torchrec-plan"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    pick = "uvm_cache[algorithm=lru,cache_ratio=0.05]@w1"
    assert f"recommended: {pick}" in out
    assert out.index(f"recommended: {pick}") < out.index("torchrec's plan at 1 rank(s), 16.00 MiB device memory per rank, ")
    assert "host memory (this machine's: --host-memory sets it)" in out
    assert "fused_uvm_caching" in out and "total │ 500,000" in out
    assert f"embbench measured: {pick}; torchrec plans fused_uvm_caching for " in out


def test_torchrecs_plan_in_json_fits_the_budget_and_follows_it(plan_run, capsys):
    from embbench.cli import main

    plans = {}
    for budget in ("16MiB", "1GiB"):
        assert main(["recommend", str(plan_run), "--device-memory", budget, "--torchrec-plan", "--json"]) == 0
        (rec,) = json.loads(capsys.readouterr().out)
        plan = rec["torchrec_plan"]
        assert plan["unavailable"] is None and [t["name"] for t in plan["tables"]] == ["t0", "t1"]
        assert plan["host_bytes"] == os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")  # measured, not 128 GB
        assert sum(t["device_bytes"] for t in plan["tables"]) <= plan["device_bytes_per_rank"]
        plans[budget] = {t["name"]: (t["compute_kernel"], t["load_factor"]) for t in plan["tables"]}
    # 16 MiB cannot hold 30.5 MiB of rows: torchrec caches; with 1 GiB each table gets a larger cache or the device.
    assert any(k == "fused_uvm_caching" and 0 < lf < 1 for k, lf in plans["16MiB"].values())
    for name, (kernel, load_factor) in plans["1GiB"].items():
        assert kernel == "fused" or load_factor > (plans["16MiB"][name][1] or 1)


def test_no_torchrec_plan_is_one_line_and_the_exit_code_of_the_answer(plan_run, tmp_path, capsys):
    from record_factory import write_run

    from embbench.cli import main
    from embbench.results import load_records

    run = write_run(tmp_path / "run", load_records(plan_run))  # the records without the curve
    assert main(["recommend", str(run), "--device-memory", "16MiB", "--torchrec-plan"]) == 0
    assert f"torchrec plan at 1 rank(s): not made: {run / 'curve.json'}: no curve file" in capsys.readouterr().out
    _write_curve(run / "curve.json")  # tables hot and cold, not the run's
    assert main(["recommend", str(run), "--device-memory", "16MiB", "--torchrec-plan"]) == 0
    assert f"not made: {run / 'curve.json'}: not a curve of these tables (no t0, t1)" in " ".join(capsys.readouterr().out.split())
    _write_curve(run / "curve.json", ("t0", "t1"))
    assert main(["recommend", str(run), "--device-memory", "1MiB", "--host-memory", "2GiB",
                 "--torchrec-plan"]) == 0  # below torchrec's reservation
    out = " ".join(capsys.readouterr().out.split())  # torchrec's PlannerError, said in one line with the budget
    assert ("torchrec plan at 1 rank(s): not made: torchrec's planner finds no plan of these tables for 1.00 MiB device "
            "and 2.00 GiB host memory per rank") in out and "PlannerError" not in out and "128" not in out
    (run / "curve.json").write_text("{")  # damaged: the answer itself refuses it, with or without the plan
    for flags in ([], ["--torchrec-plan"]):
        assert main(["recommend", str(run), "--device-memory", "16MiB", *flags]) == 2
        err = capsys.readouterr().err
        assert err.count("\n") == 1 and f"{run / 'curve.json'}: not valid JSON (line 1)" in err
