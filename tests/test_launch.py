"""Cells run isolated: failures and timeouts are recorded, the run goes on, records persist."""

import json

import pytest
import torch

from embbench.launch import run_cells, run_isolated
from embbench.results import load_records, write_record
from embbench.scenario import parse_scenario
from tests.conftest import tiny_scenario
from tests.record_factory import make_record


@pytest.mark.slow
def test_a_failing_and_a_hanging_cell_are_recorded_and_the_next_cell_runs(tmp_path, plugin_path):
    raw = tiny_scenario(
        run={"time_limit_s": 600},  # no healthy cell comes near it, however slow the machine
        strategies=[{"name": "device"}, {"name": "raises"}, {"name": "sleeps"}, {"name": "cpu"}],
    )
    scenario, cells = parse_scenario(raw, "faulty.yaml")

    def execute(cell, weights):  # a short limit for the cell that can never finish, and for it alone
        limit = 3 if cell.strategy == "sleeps" else None
        return run_isolated(scenario, "faulty.yaml", cell, tmp_path / "logs", weights, time_limit_s=limit)

    records = run_cells(scenario, "faulty.yaml", cells, tmp_path, execute=execute)
    status = {r.strategy: r for r in records}
    assert status["device"].status == "ok" and status["cpu"].status == "ok"
    assert status["raises"].status == "error"
    assert "RuntimeError: boom from the faulty plugin" in status["raises"].message
    assert status["sleeps"].status == "timeout" and "3 s" in status["sleeps"].message
    on_disk = {r.cell_id: r.status for r in load_records(tmp_path)}
    assert on_disk == {"device@w1": "ok", "raises@w1": "error", "sleeps@w1": "timeout", "cpu@w1": "ok"}
    assert status["cpu"].metrics["max_weight_diff_vs_baseline"] < 1e-5
    assert status["cpu"].metrics["train_loss_last10_diff_vs_baseline"] < 1e-6
    assert status["cpu"].metrics["logloss_diff_vs_baseline"] < 1e-6
    assert "logloss_diff_vs_baseline" not in status["device"].metrics  # the baseline itself


def test_an_exact_strategy_s_losses_are_compared_with_the_baseline_s_only_over_the_same_steps():
    """The full-size check that needs no weights on disk: |loss - the baseline's| for exact
    strategies that trained as many steps; none for a reordered one or another step count."""
    from embbench.launch import _loss_diffs

    device = make_record("device")
    device.metrics["accuracy"] = {"train_loss_last10": 0.5, "logloss": 0.45, "auc": 0.7}
    cache = make_record("freqcache")
    cache.metrics["accuracy"] = {"train_loss_last10": 0.5000004, "logloss": 0.45, "auc": 0.7}
    diffs = _loss_diffs(cache, device)
    assert diffs.keys() == {"train_loss_last10_diff_vs_baseline", "logloss_diff_vs_baseline"}
    assert abs(diffs["train_loss_last10_diff_vs_baseline"] - 4e-7) < 1e-9 and diffs["logloss_diff_vs_baseline"] == 0
    assert _loss_diffs(cache.model_copy(update={"semantics": "reordered"}), device) == {}
    longer = make_record("freqcache", warmup_steps_run=40)
    assert _loss_diffs(longer, device) == {} and _loss_diffs(device, device) == {} and _loss_diffs(cache, None) == {}


@pytest.mark.slow
def test_resume_skips_finished_cells(tmp_path):
    raw = tiny_scenario()
    scenario, cells = parse_scenario(raw, "tiny.yaml")
    first = run_cells(scenario, "tiny.yaml", cells[:1], tmp_path)
    started = []
    second = run_cells(scenario, "tiny.yaml", cells, tmp_path, resume=True, on_start=started.append)
    assert [c.id for c in started] == ["cpu@w1"]
    assert second[0].provenance["date"] == first[0].provenance["date"]


def test_a_record_round_trips_through_json(tmp_path):
    record = make_record("x", {"a": 0.5}, baseline="x", provenance={"git": None})
    path = write_record(tmp_path, "x_a=0.5_@w1", record)
    assert load_records(path) == [record]
    assert json.loads(path.read_text())["schema_version"] == 1


def test_unreadable_records_are_clear_errors(tmp_path):
    (tmp_path / "broken.json").write_text("{not json")
    with pytest.raises(ValueError, match="broken.json: not valid JSON"):
        load_records(tmp_path)
    with pytest.raises(FileNotFoundError, match="no result records"):
        load_records(tmp_path / "empty")


def test_a_plugin_that_is_not_a_strategy_is_rejected_naming_it(tmp_path, monkeypatch):
    from embbench.strategy import broken_strategies, get_strategy, load_strategies
    from tests.conftest import _install_plugin

    _install_plugin(tmp_path / "bad", "bad_plugin", {"bad": "bad_plugin:NotAStrategy"},
                    "class NotAStrategy:\n    pass\n", monkeypatch)
    try:
        assert "bad" not in load_strategies() and "device" in load_strategies()
        assert broken_strategies()["bad"].startswith("strategy 'bad' (bad_plugin:NotAStrategy) is not a subclass")
        with pytest.raises(KeyError, match=r"strategy 'bad' \(bad_plugin:NotAStrategy\) is not a subclass"):
            get_strategy("bad")
    finally:
        load_strategies.cache_clear()


@pytest.mark.slow
def test_a_cuda_cell_runs_each_rank_in_a_fresh_interpreter(tmp_path, monkeypatch):
    """Forked ranks cannot use CUDA once the server initialised its driver (importing fbgemm_gpu
    does): where the cell's device is CUDA, each rank is `python -m embbench.runner`."""
    from embbench import launch

    started = []
    real = launch._Interpreter

    def spy(*args, **kwargs):
        started.append(args[0])
        return real(*args, **kwargs)

    monkeypatch.setattr(launch, "_cell_device", lambda scenario: torch.device("cuda"))
    monkeypatch.setattr(launch, "_Interpreter", spy)
    scenario, cells = parse_scenario(tiny_scenario(strategies=[{"name": "device"}]), "t.yaml")
    outcome = launch.run_isolated(scenario, "t.yaml", cells[0], tmp_path / "logs")
    assert outcome.status == "ok", outcome.message
    assert len(started) == 1  # one rank, started as an interpreter of its own


def test_a_ctrl_c_inside_a_rank_s_start_still_kills_that_rank(monkeypatch, tmp_path):
    """The interrupt can land after the rank was forked and before start() returns: the rank
    must be killed all the same (multiprocessing would otherwise join it at exit: a hang)."""
    import multiprocessing.process

    from embbench import launch

    started = []
    real_start = multiprocessing.process.BaseProcess.start

    def start_then_interrupt(self):
        real_start(self)
        if self.name.endswith("-rank0"):  # a rank's, not the cell server's own readiness probe
            started.append(self)
            raise KeyboardInterrupt

    monkeypatch.setattr(multiprocessing.process.BaseProcess, "start", start_then_interrupt)
    scenario, cells = parse_scenario(tiny_scenario(strategies=[{"name": "device"}]), "t.yaml")
    with pytest.raises(KeyboardInterrupt):
        launch.run_isolated(scenario, "t.yaml", cells[0], tmp_path / "logs")
    assert len(started) == 1 and started[0].exitcode is not None  # killed and reaped, not left running


@pytest.fixture
def leaving_plugin(tmp_path, monkeypatch):
    """Strategies that leave things behind: a file claimed in a folder of the user's (as a row
    file in a store_dir is) and a child process, then end ok or SIGKILLed."""
    from tests.conftest import _install_plugin

    _install_plugin(tmp_path / "leavesite", "leaving_plugin",
                    {"leaves_ok": "leaving_plugin:LeavesOk", "leaves_killed": "leaving_plugin:LeavesKilled"}, """
        import os, signal, subprocess, sys
        from pathlib import Path
        from baselines.tables import DeviceStrategy
        from embbench import owned

        def leave(folder):
            path = Path(folder) / f"embbench-{os.getpid()}-rank0-0.rows"
            owned.claim(path)
            path.write_bytes(b"rows")
            child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
            (Path(folder) / "child.pid").write_text(str(child.pid))

        class LeavesOk(DeviceStrategy):
            name = "leaves_ok"
            summary = "claims a file and starts a child, then trains"
            def build(self, ctx):
                leave(os.environ["LEAVE_IN"])
                return super().build(ctx)

        class LeavesKilled(DeviceStrategy):
            name = "leaves_killed"
            summary = "claims a file and starts a child, then is SIGKILLed"
            def build(self, ctx):
                leave(os.environ["LEAVE_IN"])
                os.kill(os.getpid(), signal.SIGKILL)
        """, monkeypatch)
    folder = tmp_path / "store"
    folder.mkdir()
    monkeypatch.setenv("LEAVE_IN", str(folder))
    yield folder


@pytest.mark.parametrize("strategy", ["leaves_ok", "leaves_killed"])
def test_a_cell_s_claimed_files_go_when_it_ends_however_it_ends(tmp_path, leaving_plugin, strategy):
    scenario, cells = parse_scenario(tiny_scenario(strategies=[{"name": strategy}], baseline=strategy), "t.yaml")
    outcome = run_isolated(scenario, "t.yaml", cells[0], tmp_path / "logs")
    assert outcome.status == ("ok" if strategy == "leaves_ok" else "oom"), outcome.message
    assert sorted(p.name for p in leaving_plugin.iterdir()) == ["child.pid"]  # the row file and its note are gone


@pytest.mark.parametrize("strategy", ["leaves_ok", "leaves_killed"])
def test_a_child_a_rank_started_is_killed_with_the_cell(tmp_path, leaving_plugin, strategy):
    import os
    import time

    from embbench.data.cache import pid_alive

    scenario, cells = parse_scenario(tiny_scenario(strategies=[{"name": strategy}], baseline=strategy), "t.yaml")
    run_isolated(scenario, "t.yaml", cells[0], tmp_path / "logs")
    child = int((leaving_plugin / "child.pid").read_text())
    for _ in range(100):  # killed, then reaped by init (its parent, the rank, has ended)
        if not pid_alive(child) or open(f"/proc/{child}/stat").read().split()[2] == "Z":
            break
        time.sleep(0.05)
    alive = pid_alive(child) and open(f"/proc/{child}/stat").read().split()[2] != "Z"
    if alive:
        os.kill(child, 9)
    assert not alive


def test_flushed_weights_that_cannot_be_saved_are_said_on_the_console_once(tmp_path):
    """Issue 50, 11: a full disk during the weights copy was in each record only."""
    from embbench.launch import CellOutcome

    scenario, cells = parse_scenario(tiny_scenario(), "t.yaml")
    why = f"cannot save the flushed weights to {tmp_path}/weights/x.pt: No space left on device"

    def execute(cell, weights):
        return CellOutcome("ok", None, {**make_record().metrics, "weights_file": None, "weights_not_compared": why})

    notes = []
    records = run_cells(scenario, "t.yaml", cells, tmp_path, execute=execute, on_notice=notes.append)
    assert all(r.metrics["weights_not_compared"] == why for r in records)
    assert len(notes) == 1 and notes[0].startswith(why) and "not compared" in notes[0]
