"""Issue 25's GPU matrix: the scenarios scripts/gpu_matrix.sh runs hold the cells the issue asks for."""

from pathlib import Path

import pytest

from embbench.scenario import load_scenario

MATRIX = Path(__file__).resolve().parents[1] / "scenarios" / "gpu_matrix"
STRATEGIES = {"device", "gpu_sharded", "uvm", "uvm_cache", "cpu", "freqcache", "colossalai", "fae", "sfctr"}


def _ratio(cell) -> float | None:
    return cell.params.get("cache_ratio", cell.params.get("hot_ratio"))


@pytest.mark.parametrize("alpha", ["1.15", "1.05"])
def test_the_kaggle_matrix_has_every_strategy_at_three_cache_sizes(alpha):
    scenario, cells = load_scenario(MATRIX / f"kaggle_alpha{alpha}.yaml")
    assert scenario.data.alpha == float(alpha) and scenario.data.embedding_dim == 128
    assert scenario.data.batch_size == 16384 and scenario.data.scale == 1.0
    assert {c.strategy for c in cells} == STRATEGIES
    for strategy in ("freqcache", "colossalai", "fae", "sfctr"):
        assert sorted(_ratio(c) for c in cells if c.strategy == strategy) == [0.005, 0.015, 0.05]
    uvm_cache = {(c.params["algorithm"], c.params["prefetch_pipeline"], c.params["cache_ratio"])
                 for c in cells if c.strategy == "uvm_cache"}
    assert uvm_cache == {(a, p, r) for a in ("lru", "lfu") for p in (False, True) for r in (0.005, 0.015, 0.05)}


@pytest.mark.parametrize("dim, baseline", [(64, "device"), (128, "uvm")])
def test_the_1tb_matrix_at_both_widths(dim, baseline):
    scenario, cells = load_scenario(MATRIX / f"criteo_1tb_dim{dim}.yaml")
    assert scenario.data.preset == "criteo_1tb_freq3" and scenario.data.embedding_dim == dim
    assert scenario.baseline == baseline and {c.strategy for c in cells} == STRATEGIES
    assert {c.params["prefetch_pipeline"] for c in cells if c.strategy == "uvm_cache"} == {False, True}


@pytest.mark.parametrize("path", sorted(MATRIX.glob("*.yaml")), ids=lambda p: p.stem)
def test_every_matrix_scenario_validates_and_names_its_command(path):
    scenario, cells = load_scenario(path)
    assert cells[0].strategy == scenario.baseline and scenario.run.device == "cuda"
    assert f"bash scripts/gpu_matrix.sh {path.stem}" in " ".join(path.read_text().splitlines()[:2])  # its command
