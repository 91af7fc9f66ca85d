"""Caches timed while they fill (issue 49, point 4): by default a cache warms up until it is
steady, within as many steps as are timed; a cell timed while filling is flagged ``filling!``
in the tables, the HTML report and ``recommend``."""

from __future__ import annotations

import io

import torch
from record_factory import make_record, write_run
from rich.console import Console

from embbench.cli import main
from embbench.columns import speed
from embbench.runner import run_cell
from embbench.scenario import Cell, parse_scenario
from embbench.strategy import RuntimeEnv
from tests.conftest import tiny_scenario

CPU = RuntimeEnv(torch.device("cpu"))
MiB = 1 << 20


def test_by_default_a_cache_warms_up_until_steady_within_the_timed_steps():
    """No ``warmup_max_steps`` in the scenario: the warm-up goes on past ``warmup_steps`` until
    the miss rate is steady and the slots no longer fill, at most as many steps as are timed;
    ``null`` keeps it at exactly ``warmup_steps``, and the record then says the cache was not
    known to be steady."""
    raw = tiny_scenario(run={"warmup_steps": 2, "steps": 5, "repeats": 2})
    del raw["run"]["warmup_max_steps"]  # the default
    scenario, _ = parse_scenario(raw, "t")
    assert scenario.run.warmup_max_steps == "auto" and scenario.run.warmup_bound == 10
    params = {"cache_ratio": 0.02, "profile_batches": 0, "belady_steps": 0}
    cache = run_cell(scenario, Cell("freqcache", params), CPU)
    assert 5 <= cache["warmup_steps_run"] <= 10 and len(cache["warmup_miss_rates"]) == cache["warmup_steps_run"] // 5
    assert isinstance(cache["warmup_steady"], bool) and "empty_slots_at_timing" in cache
    # caught up to the bound (+ the counted steps, one repeat's, and the operator-counting steps)
    assert cache["trained_steps"] == 10 + 10 + 5 + 2
    extra = cache["extra"]  # at small scale the staging slots dwarf the cache: the record says so
    assert extra["staging_slots"] == extra["slots"] - extra["capacity_rows"] > extra["capacity_rows"]
    assert extra["staging_note"].startswith(f"{extra['staging_slots']:,} staging slots")
    fixed, _ = parse_scenario(tiny_scenario(run={"warmup_steps": 2, "warmup_max_steps": None, "steps": 5, "repeats": 2}), "t")
    short = run_cell(fixed, Cell("freqcache", params), CPU)
    assert short["warmup_steps_run"] == 2 and short["warmup_steady"] is False
    assert any(f.startswith("filling: ") for f in speed(_timed(short)).flags)


def _timed(metrics: dict) -> dict:
    """A runner's metrics as the record holds them (the speed figures, a quiet machine)."""
    return {**metrics, "noise": {}}


def _records(**filling) -> list:
    return [make_record("device", step_times=[0.010] * 12, device_bytes=900 * MiB),
            make_record("freqcache", {"cache_ratio": 0.01}, step_times=[0.008] * 12, device_bytes=100 * MiB,
                        warmup_steps_run=3, **filling)]


def test_a_cache_timed_with_empty_slots_or_a_falling_miss_rate_is_flagged_filling_everywhere(tmp_path):
    from embbench.compare import Run
    from embbench.html_report import pareto_figure, strategy_colours, step_times_figure
    from embbench.report import print_comparison

    steady = make_record("freqcache", step_times=[0.008] * 12, empty_slots_at_timing=0, warmup_steady=True)
    assert not speed(steady.metrics).flags
    assert speed(make_record("freqcache", warmup_steady=False, warmup_steps_run=3).metrics).flags == [
        "filling: its miss rate still fell after 3 warm-up steps"]
    run = Run(tmp_path, _records(empty_slots_at_timing=19_241, warmup_steady=True))
    assert speed(run.records[1].metrics).flags == ["filling: 19,241 of its slots were empty when timing started"]

    console = Console(file=io.StringIO(), width=250, record=True)
    print_comparison(run.records, console)
    table = console.export_text()
    assert "filling!" in table and "freqcache[cache_ratio=0.01]@w1: filling: 19,241 of its slots" in table

    fig = pareto_figure(run, strategy_colours([run]))
    labels = {t.get_text() for t in fig.axes[0].texts}
    assert "freqcache[cache_ratio=0.01]@w1 filling!" in labels and "device@w1" in labels
    ticks = [t.get_text() for t in step_times_figure([run]).axes[0].get_yticklabels()]
    assert "freqcache[cache_ratio=0.01]@w1 filling!" in ticks


def test_recommend_names_a_winner_timed_while_filling(tmp_path, capsys):
    run_dir = write_run(tmp_path / "run", _records(empty_slots_at_timing=19_241))
    assert main(["recommend", str(run_dir), "--device-memory", "512MiB"]) == 0
    out = capsys.readouterr().out
    assert "recommended: freqcache[cache_ratio=0.01]@w1" in out
    assert "filling: 19,241 of its slots were empty when timing started" in out


def test_the_kaggle_shape_gpu_scenarios_warm_up_until_freqcache_s_slots_are_full():
    """At the Criteo-Kaggle shape (1.5 % cache, alpha 1.15) freqcache's 1.36M slots (852k of them
    staging) fill by the step ``results/freqcache_kaggle_fill.json`` measured (issue 47, item 5:
    266,676 were still empty after 100 steps): the GPU scenarios of that shape may warm up past
    it, to the end of the warm-up window that holds it."""
    import json
    from pathlib import Path

    from embbench.runner import _WARMUP_WINDOW

    root = Path(__file__).parents[1]
    fill = json.loads((root / "results" / "freqcache_kaggle_fill.json").read_text())
    assert (fill["rows"], fill["batch"], fill["slots"]) == (33_762_577, 16384, 1_358_407)
    full = fill["full_at_step"]
    assert full and dict(fill["empty_slots_by_step"])[full] == 0
    for name in ("kaggle_headline", "kaggle_headline_tf32", "row_precision", "kaggle_alpha1.15"):
        scenario, _ = parse_scenario(_yaml(root / "scenarios" / "gpu_matrix" / f"{name}.yaml"), name)
        assert scenario.data.batch_size == fill["batch"] and scenario.data.scale == 1.0, name
        assert scenario.run.warmup_bound >= full + _WARMUP_WINDOW, name


def _yaml(path):
    import yaml

    return yaml.safe_load(path.read_text())
