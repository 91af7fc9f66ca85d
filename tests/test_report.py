"""show --csv/--json, the live progress of run, and run --profile / --quiet end to end."""

from __future__ import annotations

import csv
import io
import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from record_factory import make_record, write_run
from rich.console import Console

from conftest import tiny_scenario
from embbench.cli import main
from embbench.progress import RunProgress
from embbench.scenario import Cell

ROOT = Path(__file__).resolve().parents[1]


def _run(tmp_path):
    return write_run(tmp_path / "run", [
        make_record("device", step_times=[0.010] * 12, device_bytes=1000),
        make_record("freqcache", {"cache_ratio": 0.1, "policy": "lfu"}, step_times=[0.005] * 12, device_bytes=100,
                    hit_rate=0.9, extra={"belady_hit_rate": 0.95}),
        make_record("uvm", status="unsupported", message="needs CUDA"),
    ])


def test_show_csv_has_one_row_per_cell_with_flat_columns(tmp_path, capsys):
    assert main(["show", str(_run(tmp_path)), "--csv"]) == 0
    rows = list(csv.DictReader(io.StringIO(capsys.readouterr().out)))
    by_id = {r["cell_id"]: r for r in rows}
    assert list(by_id) == ["device@w1", "freqcache[cache_ratio=0.1,policy=lfu]@w1", "uvm@w1"]
    cache = by_id["freqcache[cache_ratio=0.1,policy=lfu]@w1"]
    assert float(cache["throughput"]) == 512 / 0.005 and float(cache["speedup"]) == 2.0
    assert cache["param.cache_ratio"] == "0.1" and cache["param.policy"] == "lfu"
    assert float(cache["hit_rate"]) == 0.9 and float(cache["belady_hit_rate"]) == 0.95
    assert int(cache["device_bytes"]) == 100 and cache["version.torch"] == "2.11.0"
    assert cache["gpus"] == "NVIDIA H100 80GB HBM3"
    assert json.loads(cache["step_time_samples"]) == [0.005] * 12
    assert by_id["uvm@w1"]["status"] == "unsupported" and by_id["uvm@w1"]["message"] == "needs CUDA"
    assert by_id["uvm@w1"]["throughput"] == ""
    assert list(rows[0])[:8] == ["cell_id", "strategy", "world_size", "status", "message", "semantics",
                                 "param.cache_ratio", "param.policy"]


def test_show_json_is_the_same_rows_for_notebooks(tmp_path, capsys):
    assert main(["show", str(_run(tmp_path)), "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["cell_id"] for r in rows] == ["device@w1", "freqcache[cache_ratio=0.1,policy=lfu]@w1", "uvm@w1"]
    assert rows[0]["speedup"] == 1.0 and rows[0]["throughput_per_repeat"] == [512 / 0.01] * 3
    assert "throughput" not in rows[2]


def test_show_of_a_directory_that_is_not_a_run_is_one_line(tmp_path, capsys):
    assert main(["show", str(tmp_path), "--csv"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "no result records (*.json) here" in err


# -- progress ---------------------------------------------------------------------------------

class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def _drive(progress: RunProgress, clock: Clock) -> None:
    cells = [Cell("device"), Cell("freqcache", {"cache_ratio": 0.1})]
    for i, cell in enumerate(cells):
        progress.on_start(cell)
        for phase, total in (("build", 0), ("warmup", 3), ("measure", 10), ("eval", 2)):
            for step in range(max(total, 1)):
                clock.now += 0.5
                progress.on_progress(cell, phase, step, total)
        progress.on_done(cell, make_record(cell.strategy, cell.params))
    progress.on_done(Cell("cpu"), make_record("cpu"))  # kept from an earlier run: never started here


def test_without_a_terminal_only_a_line_per_cell_and_the_summary_are_printed():
    out, clock = io.StringIO(), Clock()
    console = Console(file=out, width=200)
    with RunProgress(console, 3, live=False, clock=clock) as progress:
        _drive(progress, clock)
    text = out.getvalue()
    assert "measure" not in text and "ETA" not in text  # no live display
    assert text.splitlines() == [
        "           ok     8.0 s  device@w1  ",
        "           ok     8.0 s  freqcache[cache_ratio=0.1]@w1  ",
        "           ok            cpu@w1  ",
    ]
    assert progress.summary() == ("wall time per cell: device@w1 8.0 s, freqcache[cache_ratio=0.1]@w1 8.0 s "
                                  "(kept from the run directory: cpu@w1); total 16.0 s")


def test_quiet_prints_nothing_while_running():
    out, clock = io.StringIO(), Clock()
    with RunProgress(Console(file=out, width=200), 3, live=False, lines=False, clock=clock) as progress:
        _drive(progress, clock)
    assert out.getvalue() == ""


def test_on_a_terminal_the_phase_step_and_eta_are_shown():
    out, clock = io.StringIO(), Clock()
    console = Console(file=out, width=200, force_terminal=True, color_system=None)
    progress = RunProgress(console, 2, live=True, clock=clock).__enter__()
    cell = Cell("freqcache", {"cache_ratio": 0.1})
    progress.on_start(cell)
    progress.on_progress(cell, "measure", 3, 10)
    task = progress.progress.tasks[progress._phase]
    assert (task.description, task.completed, task.total) == ("freqcache[cache_ratio=0.1]@w1  measure", 3, 10)
    progress.progress.refresh()
    rendered = out.getvalue()
    assert "freqcache[cache_ratio=0.1]@w1  measure" in rendered and "3/10" in rendered and "ETA" in rendered
    progress.on_progress(cell, "eval", 0, 4)  # a new phase starts its own bar
    task = progress.progress.tasks[progress._phase]
    assert (task.completed, task.total) == (0, 4)
    progress.__exit__(None, None, None)


# -- run end to end ---------------------------------------------------------------------------

@pytest.mark.slow
def test_run_quiet_with_profile_writes_traces_and_show_lists_the_top_operators(tmp_path):
    scenario = tmp_path / "tiny.yaml"
    scenario.write_text(yaml.safe_dump(tiny_scenario(strategies=[{"name": "device"}])))
    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "embbench.cli", "run", str(scenario), "--quiet", "--profile",
                           "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    assert "      ok  " not in proc.stdout  # --quiet: no line per cell
    assert "wall time per cell: device@w1 " in proc.stdout and "top operators" in proc.stdout
    assert (out / "profiles" / "device@w1.trace.json").exists()
    record = json.loads((out / "device@w1.json").read_text())
    assert record["metrics"]["profile"]["top_host"]
    assert record["provenance"]["versions"]["strategy"].startswith("embbench ")
    shown = subprocess.run([sys.executable, "-m", "embbench.cli", "show", str(out)], cwd=ROOT, capture_output=True,
                           text=True, timeout=300)
    assert "device@w1: top operators by self host time" in shown.stdout


def test_an_auc_from_too_few_evaluation_samples_says_so_under_the_table():
    """An AUC whose 95% interval reaches 0.5 (a coin) is said to mean little; one measured on
    enough held-out rows, or without a standard error (an older record), is not."""
    from embbench.metrics import too_few_eval_samples
    from embbench.report import print_comparison

    few, many = make_record("device"), make_record("freqcache", {"cache_ratio": 0.1})
    few.metrics["accuracy"].update(auc=0.514, auc_standard_error=0.13, eval_samples=20)
    many.metrics["accuracy"].update(auc=0.75, auc_standard_error=0.012, eval_samples=2048)
    assert too_few_eval_samples(many.metrics["accuracy"]) is None
    assert too_few_eval_samples({"auc": 0.51}) is None
    import torch

    from embbench.runner import _auc_noise  # one positive sample: no variance to estimate, no (NaN) error recorded
    assert _auc_noise(torch.tensor([0.1, 0.2, 0.3]), torch.tensor([1.0, 0.0, 0.0])) == {}
    out = io.StringIO()
    print_comparison([few, many], Console(file=out, width=200, color_system=None))
    lines = [line for line in out.getvalue().splitlines() if "evaluation samples" in line]
    assert lines == ["device@w1: too few evaluation samples: AUC 0.514 ± 0.255 (95%, 20 samples) cannot be told from "
                     "chance (0.5); score more held-out rows (data.eval, run.eval_batches)"]
