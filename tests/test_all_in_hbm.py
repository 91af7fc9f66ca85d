"""Every speed ratio is also against the fastest all-in-HBM cell of the run (issue 47, item 2):
`device` stays the reference for weights; torchrec's `gpu_sharded` (fbgemm's fused TBE) is what a
user runs when the tables fit, and a cache is held against the faster of the two."""

from __future__ import annotations

import io

import pytest
from record_factory import make_record
from rich.console import Console

from embbench.columns import all_in_hbm_throughputs, flat_rows
from embbench.recommend import Budget, recommend
from embbench.report import print_comparison, print_recommendations
from embbench.strategy import get_strategy, is_all_in_hbm, load_strategies

MiB = 1 << 20


def _run() -> list:
    return [make_record("device", step_times=[0.010] * 12),
            make_record("gpu_sharded", step_times=[0.008] * 12),
            make_record("freqcache", {"cache_ratio": 0.015}, step_times=[0.009] * 12, device_bytes=100 * MiB),
            make_record("uvm_cache", {"cache_ratio": 0.015}, step_times=[0.012] * 12, device_bytes=100 * MiB),
            # faster, but not fp32 rows: never the reference (as the baseline's fp32 cell)
            make_record("device", step_times=[0.004] * 12, row_precision="bf16"),
            # another scenario: its own reference
            make_record("device", step_times=[0.002] * 12, digest="e" * 64)]


def test_all_in_hbm_is_a_strategy_property():
    assert {name for name in load_strategies() if is_all_in_hbm(name)} == {"device", "gpu_sharded"}
    assert get_strategy("gpu_sharded").all_in_hbm and not get_strategy("uvm_cache").all_in_hbm
    assert not is_all_in_hbm("a_plugin_not_installed_here")


def test_the_ratios_are_against_the_baseline_and_the_fastest_all_in_hbm_cell():
    records = _run()
    references = all_in_hbm_throughputs(records)
    assert references[("d" * 64, 1)].cell_id == "gpu_sharded@w1"
    assert references[("e" * 64, 1)].cell_id == "device@w1"
    rows = {(r["cell_id"], r["scenario_digest"]): r for r in flat_rows(records)}
    freqcache = rows["freqcache[cache_ratio=0.015]@w1", "d" * 64]
    assert freqcache["speedup"] == pytest.approx(0.010 / 0.009)
    assert freqcache["speedup_vs_hbm"] == pytest.approx(0.008 / 0.009)
    assert freqcache["fastest_hbm_cell"] == "gpu_sharded@w1"
    assert rows["gpu_sharded@w1", "d" * 64]["speedup_vs_hbm"] == pytest.approx(1.0)
    assert rows["device@w1", "d" * 64]["speedup_vs_hbm"] == pytest.approx(0.8)
    assert rows["device@w1", "e" * 64]["speedup_vs_hbm"] == pytest.approx(1.0)


def test_a_run_without_an_all_in_hbm_cell_has_no_such_ratio():
    (row,) = flat_rows([make_record("uvm_cache", {"cache_ratio": 0.015}, baseline="uvm")])
    assert row["speedup_vs_hbm"] is None and row["fastest_hbm_cell"] is None


def test_show_prints_both_ratios_and_names_the_reference():
    out = io.StringIO()
    print_comparison(_run()[:4], Console(file=out, width=250, color_system=None))
    text = out.getvalue()
    assert "HBM" in text.split("┡")[0] and "fastest all-in-HBM cell" in text and "gpu_sharded@w1" in text
    line = next(line for line in text.splitlines() if "freqcache" in line)
    assert "1.11x" in line and "0.89x" in line


def test_show_leaves_the_hbm_column_out_where_it_repeats_the_speedup():
    """The fastest all-in-HBM cell is the baseline's: its ratios are the speedups."""
    out = io.StringIO()
    print_comparison([_run()[0], _run()[2]], Console(file=out, width=250, color_system=None))
    assert "HBM" not in out.getvalue().split("┡")[0]


def test_recommend_s_runners_up_carry_both_ratios():
    (rec,) = recommend(_run()[:4], Budget(2048 * MiB))  # the whole tables (1 GiB) fit
    assert rec.best.cell_id == "gpu_sharded@w1"
    out = io.StringIO()
    print_recommendations([rec], Budget(2048 * MiB), "runs/x", Console(file=out, width=250, color_system=None))
    text = out.getvalue()
    assert "vs all-in-HBM" in text
    line = next(line for line in text.splitlines() if "freqcache" in line)
    assert "1.11x" in line and "0.89x" in line


def test_recommend_states_a_cache_winner_against_the_fastest_all_in_hbm_cell():
    records = _run()[:4]
    (rec,) = recommend(records, Budget(200 * MiB))  # the whole tables (1 GiB) do not fit: a cache wins
    assert rec.best.cell_id == "freqcache[cache_ratio=0.015]@w1"
    assert rec.best.vs_hbm == pytest.approx(0.008 / 0.009) and rec.best.fastest_hbm_cell == "gpu_sharded@w1"
    out = io.StringIO()
    print_recommendations([rec], Budget(200 * MiB), "runs/x", Console(file=out, width=250, color_system=None))
    assert "1.11x the baseline, 0.89x the fastest all-in-HBM cell (gpu_sharded@w1)" in out.getvalue()
