"""Issue 49, point 8: the smaller things a newcomer met, each held to what it now says."""

from __future__ import annotations

from embbench.cli import main
from embbench.recommend import Budget, recommend
from tests.record_factory import make_record, write_run

BUSY = {"noise": {"others_cpu_share": 0.6, "steal_share": 0.0, "cores": 2}}
#: An AUC whose 95% interval reaches 0.5: the run warns it cannot be told from chance.
CHANCE = {"accuracy": {"train_loss_last10": 0.5, "auc": 0.52, "logloss": 0.69, "eval_samples": 256,
                       "auc_standard_error": 0.03}}


def _repeats(ms: float, spread: float = 0.01) -> list[float]:
    return [ms / 1e3 * f for f in (1 - spread, 1, 1 + spread) for _ in range(4)]


def test_recommend_keeps_the_runs_warning_that_the_auc_cannot_be_told_from_chance(tmp_path, capsys):
    records = [make_record("device", step_times=_repeats(10), **CHANCE), make_record("cpu", step_times=_repeats(20), **CHANCE)]
    (rec,) = recommend(records, Budget(1 << 40))
    (caveat,) = [c for c in rec.caveats if c.startswith("accuracy not to be read in 2 cell(s)")]
    assert "device@w1: too few evaluation samples: AUC 0.520" in caveat and "cannot be told from chance" in caveat
    assert main(["recommend", str(write_run(tmp_path / "run", records)), "--device-memory", "16GiB"]) == 0
    assert "cannot be told from chance" in " ".join(capsys.readouterr().out.split())


def test_a_busy_runner_up_whose_interval_excludes_the_winner_is_not_judged_not_called_close():
    best = make_record("device", step_times=_repeats(10))
    busy = make_record("cpu", step_times=_repeats(20), **BUSY)  # half as fast: its interval is far from 1
    (rec,) = recommend([best, busy], Budget(1 << 40))
    (runner,) = rec.runners_up
    assert runner.interval[1] < 1 and runner.significant is None
    assert not any("not faster beyond noise" in c for c in rec.caveats)
    assert "not judged against device@w1: cpu@w1 (busy in this cell: other processes took 60% of the 2 cores)" in rec.caveats


def test_the_results_table_shows_the_auc_when_a_warning_under_it_is_about_the_auc(tmp_path, capsys, monkeypatch):
    from embbench import cli

    monkeypatch.setattr(cli.console, "width", 100)  # too narrow for the AUC column by priority
    plain = write_run(tmp_path / "plain", [make_record("device"), make_record("cpu", step_times=_repeats(20))])
    assert main(["show", str(plain)]) == 0
    assert "AUC" not in capsys.readouterr().out.split("hidden:")[0]
    warned = write_run(tmp_path / "warned", [make_record("device", **CHANCE), make_record("cpu", **CHANCE)])
    assert main(["show", str(warned)]) == 0
    table, warnings = capsys.readouterr().out.split("└", 1)
    assert "AUC" in table and "0.5200" in table and "cannot be told from chance" in " ".join(warnings.split())


def test_setup_envs_steps_are_numbered_once_each_out_of_their_total_and_the_readme_names_triton():
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    script = (root / "scripts/setup_env.sh").read_text()
    total = int(re.search(r"^steps=(\d+)", script, re.M).group(1))
    assert "setup_env: [" not in script.replace('echo "setup_env: [$1/$steps] $2"', "")  # every step line is step()
    numbers = [int(n) for n in re.findall(r"^\s*step (\d+) ", script, re.M)]
    assert sorted(set(numbers)) == list(range(1, total + 1))  # (a step may have two branches: torch kept or installed)
    assert "triton" in script.split(f"step {total} ", 1)[1].splitlines()[0]
    setup = (root / "README.md").read_text().split("## Two commands", 1)[1].split("    scripts/setup_env.sh", 1)[0]
    assert "triton" in setup


def test_curve_takes_the_batch_size_as_run_does(tmp_path, capsys):
    import json

    import yaml

    from tests.conftest import tiny_scenario

    scenario = tmp_path / "s.yaml"
    scenario.write_text(yaml.safe_dump(tiny_scenario()))
    out = tmp_path / "curve.json"
    assert main(["curve", str(scenario), "--warmup", "2", "--steps", "3", "--sizes", "0.1", "--policies", "lru",
                 "--batch-size", "32", "--out", str(out)]) == 0
    assert json.loads(out.read_text())["scenario"]["batch_size"] == 32  # tiny_scenario's own is 64


def test_the_cells_eta_counts_only_cells_that_ran():
    """Resumed cells and cells that start nothing (unsupported, skipped: 0 s) leave the cells
    bar's count: three of them done in no time made the ETA of the five that run as short."""
    import io

    from rich.console import Console

    from embbench.progress import RunProgress
    from embbench.scenario import Cell

    now = [100.0]
    progress = RunProgress(Console(file=io.StringIO(), width=200), 6, live=False, lines=False, clock=lambda: now[0])
    progress.on_done(Cell("cpu"), make_record("cpu"))  # kept from an earlier run: never started
    for strategy, status, seconds in (("uvm", "unsupported", 0.01), ("device", "ok", 30.0)):
        progress.on_start(Cell(strategy))
        now[0] += seconds
        progress.on_done(Cell(strategy), make_record(strategy, status=status))
    task = progress.progress.tasks[progress._cells]
    assert (task.completed, task.total) == (1, 4) and "2 kept or not started" in task.description


def _curve_and_records(tmp_path):
    import numpy as np

    from embbench.cache.curve import measure

    rng = np.random.default_rng(0)
    steps = [rng.zipf(1.3, 200) % 2000 for _ in range(12)]
    curve = measure(steps, {"t0": 2000}, (0.01, 0.03, 0.1, 0.3), ("lru", "freqcache", "min"), skip=2,
                    freqcache=lambda r: (0.5, 0.4), freqcache_ratios=(0.01, 0.3))
    records = [make_record("device"),
               *[make_record("freqcache", {"cache_ratio": r}, hit_rate=h, unique_hit_rate=h - 0.2)
                 for r, h in ((0.01, 0.5), (0.1, 0.8), (0.3, 0.95))]]
    return curve, records


def test_the_cache_curves_legend_covers_no_panel(tmp_path):
    from embbench.compare import Run
    from embbench.html_report import cache_curve_figure

    curve, records = _curve_and_records(tmp_path)
    fig = cache_curve_figure(Run(tmp_path, records), curve)
    fig.canvas.draw()
    assert all(ax.get_legend() is None for ax in fig.axes)
    (legend,) = fig.legends
    box = legend.get_window_extent()
    assert not any(ax.get_window_extent().overlaps(box) for ax in fig.axes)
    assert {"MIN (envelope)", "measured cells"} <= {t.get_text() for t in legend.get_texts()}


def test_a_second_runs_hit_rate_lines_do_not_hide_the_firsts(tmp_path):
    from embbench.compare import Run
    from embbench.html_report import hit_rates_figure

    _, records = _curve_and_records(tmp_path)
    fig = hit_rates_figure([Run(tmp_path / "a", records), Run(tmp_path / "b", records)])  # the same figures twice
    lines = [line for line in fig.axes[0].get_lines() if len(line.get_xdata())]
    points = [set(zip(line.get_xdata(), line.get_ydata())) for line in lines]
    assert len(lines) == 4  # (hit rate, per distinct row) x two runs
    assert all(not (p & q) for i, p in enumerate(points) for q in points[i + 1:])  # no point drawn over another


def test_the_torchrec_plan_says_why_a_small_table_is_in_a_uvm_cache():
    import io

    from rich.console import Console

    from embbench.recommend import Recommendation
    from embbench.report import print_torchrec_plans

    tables = [{"name": "t0", "rows": 400_000, "sharding_type": "table_wise", "compute_kernel": "fused_uvm_caching",
               "load_factor": 0.2, "device_bytes": 6 << 20},
              {"name": "t1", "rows": 10_000, "sharding_type": "table_wise", "compute_kernel": "fused_uvm_caching",
               "load_factor": 0.5, "device_bytes": 1 << 20}]
    out = io.StringIO()
    plans = {1: {"tables": tables, "host_bytes": 1 << 34, "unavailable": None}}
    print_torchrec_plans(plans, [Recommendation(1, None)], Budget(16 << 30), Console(file=out, width=300))
    text = " ".join(out.getvalue().split())
    assert ("why a table such as t1 (10,000 rows) is cached, not whole on the device: embbench lets torchrec's planner "
            "choose only fbgemm's UVM cache (fused_uvm_caching) for every table") in text
