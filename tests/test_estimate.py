"""How long a cell would take here (issue 41, item 5): the estimate's model, its sources (an
earlier run of the same cell and shape, a calibration, a rough floor), and what ``--dry-run``
prints with it: each cell's time and source, the cells the time limit would stop, and the time
of the ``--scale`` it suggests."""

from __future__ import annotations

import re
import shlex
import socket
from pathlib import Path

import pytest
import torch
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import tiny_scenario
from embbench import estimate, launch
from embbench.cli import main
from embbench.scenario import OPS_STEPS, load_scenario, parse_scenario
from record_factory import PROVENANCE, make_record, write_run

CPU = torch.device("cpu")
STEP_S, BATCH_S = 0.02, 0.005  # a calibration's result, where a test fixes it


@pytest.fixture(autouse=True)
def fresh_calibrations(monkeypatch):
    """Each test calibrates anew (a process keeps its calibrations, shared by scales)."""
    monkeypatch.setattr(estimate, "_CALIBRATIONS", {}, raising=False)


@pytest.fixture
def fixed_calibration(monkeypatch):
    """Calibrated steps take STEP_S and batches BATCH_S (the model is under test, not the machine)."""
    monkeypatch.setattr(estimate, "_calibrated_step", lambda *a: (STEP_S, BATCH_S, (STEP_S, STEP_S)))


def _times(raw: dict, run_dirs=(), **flags) -> list[estimate.CellTime]:
    scenario, cells = parse_scenario(raw, "t.yaml")
    if flags:
        scenario = scenario.model_copy(update={"run": scenario.run.model_copy(update=flags)})
    return estimate.cell_times(scenario, cells, list(run_dirs), CPU, lambda cell: None)


def _write(tmp_path: Path, raw: dict) -> Path:
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])  # a fixed patch
@given(steps=st.integers(1, 50), more_steps=st.integers(1, 50), repeats=st.integers(1, 5), more_repeats=st.integers(1, 5))
def test_the_estimate_grows_with_steps_and_repeats(steps, more_steps, repeats, more_repeats, fixed_calibration):
    raw = tiny_scenario(strategies=[{"name": "device"}])
    (few,) = _times(raw, steps=steps, repeats=repeats)
    (many,) = _times(raw, steps=steps + more_steps, repeats=repeats + more_repeats)
    assert many.seconds > few.seconds and many.build_s == few.build_s
    # every trained step costs a step and a batch, evaluation and the generator's check the rest
    trained = 1 + repeats * steps + steps + OPS_STEPS  # warm-up, timed, counted (one repeat), ops
    assert few.steps_s == pytest.approx(trained * (STEP_S + BATCH_S) + 1 * (STEP_S / 2 + BATCH_S) + 3 * BATCH_S)


@settings(max_examples=10, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(scale=st.floats(1e-4, 0.01), factor=st.floats(1.5, 20))
def test_the_estimate_grows_with_the_scale(scale, factor, fixed_calibration):
    small, large = (_times(tiny_scenario(data={"scale": s}, strategies=[{"name": "device"}]))[0]
                    for s in (scale, min(1.0, scale * factor)))
    assert large.build_s >= small.build_s and large.seconds >= small.seconds
    assert small.source == "calibrated" and "the strategy's own work not included" in small.detail


def test_ranks_that_outnumber_the_cores_stretch_a_calibrated_step(monkeypatch, fixed_calibration):
    monkeypatch.setattr(estimate, "usable_cores", lambda: (2, "a test's reading"))
    one, four = (_times(tiny_scenario(run={"world_size": w, "threads": 1}, strategies=[{"name": "device"}]))[0]
                 for w in (1, 4))
    # one rank on 2 cores runs at full speed; 4 ranks x 1 thread share 2 cores: each step twice as long
    assert four.steps_s == pytest.approx(2 * one.steps_s)
    assert "4 rank(s) x 1 thread(s) on 2 usable core(s): x2.0" in four.detail


def test_a_calibration_that_would_take_too_long_gives_a_rough_floor_said_so(monkeypatch):
    monkeypatch.setattr(estimate, "CALIBRATION_BUDGET_S", 0.0)
    monkeypatch.setattr(estimate, "_calibrated_step", lambda *a: pytest.fail("calibrated past its budget"))
    (cell,) = _times(tiny_scenario(strategies=[{"name": "device"}]))
    assert cell.source == "rough" and "flops" in cell.detail and "a floor" in cell.detail and cell.steps_s > 0


def test_a_real_calibration_times_a_step_here():
    scenario, _ = parse_scenario(tiny_scenario(), "t.yaml")
    step, batch, (fastest, slowest) = estimate._calibrated_step(scenario, scenario.tables(), 1, 1, CPU)
    assert 0 < fastest <= step <= slowest and batch > 0
    assert estimate.fill_rate(8) > 0


def _earlier(scenario, strategy="device", step=0.5, host=None, date="2026-01-01T00:00:00+00:00", **metrics):
    """A record of ``strategy`` with this scenario's shape, measured here (or on ``host``)."""
    record = make_record(strategy, step_times=[step] * 4, repeats=2, device="cpu", digest=scenario.digest(),
                         provenance={**PROVENANCE, "host": host or socket.gethostname(), "date": date}, **metrics)
    return record.model_copy(update={"scenario": {**record.scenario, "config": scenario.model_dump(mode="json")}})


def test_an_earlier_run_of_the_same_cell_and_shape_gives_the_estimate_and_is_named(tmp_path, fixed_calibration):
    raw = tiny_scenario(strategies=[{"name": "device"}, {"name": "cpu"}])
    scenario, _ = parse_scenario(raw, "t.yaml")
    # 0.5 s steps, a 512-sample batch made in 0.1 s, 2 s of build, and a wall time that leaves 4 s of start-up:
    # its own 6 steps and 2 evaluated batches (1,024 samples) and the generator's 3 batches
    wall = 4 + 2 + 6 * 0.6 + 2 * (0.25 + 0.1) + 3 * 0.1
    record = _earlier(scenario, generator_samples_per_s=5120.0, build_seconds=2.0, cell_seconds=wall,
                      trained_steps=6, accuracy={"train_loss_last10": 0.5, "eval_samples": 1024})
    run = write_run(tmp_path / "tiny-0123456789", [record])
    device, cpu = _times(raw, [run])
    run_cfg = scenario.run
    trained = run_cfg.warmup_bound + run_cfg.repeats * run_cfg.steps + run_cfg.counted_steps + OPS_STEPS
    assert device.source == "run tiny-0123456789" and "recorded in" in device.detail and "2026-01-01" in device.detail
    assert device.seconds == pytest.approx(4 + 2 + trained * 0.6 + run_cfg.eval_batches * 0.35 + 0.3)
    assert cpu.source == "calibrated"  # no record of it


def test_records_of_another_host_shape_or_status_are_not_used_and_the_newest_wins(tmp_path, fixed_calibration):
    raw = tiny_scenario(strategies=[{"name": "device"}])
    scenario, _ = parse_scenario(raw, "t.yaml")
    other, _ = parse_scenario(tiny_scenario(data={"batch_size": 128}), "t.yaml")
    elsewhere = write_run(tmp_path / "a", [_earlier(scenario, host="another-host")])
    reshaped = write_run(tmp_path / "b", [_earlier(other)])
    failed = make_record("device", status="error", provenance={**PROVENANCE, "host": socket.gethostname()})
    broken = write_run(tmp_path / "c", [failed])
    assert _times(raw, [elsewhere, reshaped, broken, tmp_path / "missing"])[0].source == "calibrated"
    old = write_run(tmp_path / "old", [_earlier(scenario, step=0.5, date="2026-01-01T00:00:00+00:00")])
    new = write_run(tmp_path / "new", [_earlier(scenario, step=0.1, date="2026-02-01T00:00:00+00:00")])
    assert _times(raw, [new, old])[0].source == _times(raw, [old, new])[0].source == "run new"


def test_dry_run_shows_each_cells_time_its_source_the_total_and_the_cells_the_limit_stops(tmp_path, capsys,
                                                                                            monkeypatch):
    monkeypatch.setenv("COLUMNS", "250")
    raw = tiny_scenario(run={"time_limit_s": 0.5}, strategies=[{"name": "device"}, {"name": "cpu"}])
    path = _write(tmp_path, raw)
    scenario, _ = parse_scenario(raw, str(path))
    write_run(tmp_path / "out", [_earlier(scenario, "cpu", step=0.01)])
    assert main(["run", str(path), "--dry-run", "--out", str(tmp_path / "out")]) == 0
    out = capsys.readouterr().out
    device_line = next(line for line in out.splitlines() if "device@w1" in line)
    cpu_line = next(line for line in out.splitlines() if "cpu@w1" in line)
    # a calibration is a floor (≥), a record of the same cell is not
    assert re.search(r"≥ [\d.]+ s \(calibrated\)", device_line) and re.search(r"│ [\d.]+ s \(run out\)", cpu_line)
    assert re.search(r"estimated time here: ≥ .* for 2 cell\(s\)", out)
    assert "calibrated: dense model and plain lookups timed here" in out and "run out: " in out
    # at least the 3 s start-up each: both past a 0.5 s limit
    assert "2 cell(s) would hit run.time_limit_s (0.5 s) and end as timeout: device@w1, cpu@w1" in out


def _suggested(out: str, after: str) -> tuple[str, str]:
    """The command printed after ``after`` and the line under it."""
    match = re.search(re.escape(after) + r"\n\s+(embbench run .*)\n\s+(.*)", out)
    return match.group(1), match.group(2)


def _flag(command: str, flag: str) -> float:
    words = shlex.split(command)
    return float(words[words.index(flag) + 1])


def test_the_suggested_scale_states_its_time_and_fewer_steps_when_it_would_hit_the_limit(tmp_path, capsys,
                                                                                          monkeypatch, fixed_calibration):
    raw = tiny_scenario(run={"steps": 40, "time_limit_s": 30}, strategies=[{"name": "device"}, {"name": "cpu"}])
    path = _write(tmp_path, raw)
    scenario, cells = parse_scenario(raw, str(path))
    need = max(launch.memory_preflight(scenario, c, CPU)[0]["host"] for c in cells)
    free = int((launch.RANK_PROCESS_BYTES["cpu"] + need // 3) / (1 - launch.HOST_HEADROOM))  # a third of the tables
    monkeypatch.setattr(launch, "_free_host_bytes", lambda: (free, "a test's reading"))
    assert main(["run", str(path), "--dry-run"]) == 0
    out = capsys.readouterr().out
    command, time_line = _suggested(out, "at a scale that fits them all, run")
    assert _flag(command, "--scale") < scenario.data.scale
    assert re.fullmatch(r"estimated ≥ [\d.]+ s for 2 cell\(s\), the longest [\d.]+ s \(calibrated\)", time_line)

    # steps that take 1 s each: 1 + 2 x 40 + 2 trained steps are past the 30 s limit; fewer steps fit
    monkeypatch.setattr(estimate, "_calibrated_step", lambda *a: (1.0, 0.0, (1.0, 1.0)))
    estimate._CALIBRATIONS.clear()  # (this process calibrated the shape above)
    assert main(["run", str(path), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert re.search(r"estimated .*; 2 past run.time_limit_s \(30 s\)", out)
    command, time_line = _suggested(out, "that is past the time limit; with fewer measured steps:")
    steps = int(_flag(command, "--steps"))
    assert steps < 40 and "past run.time_limit_s" not in time_line
    smaller, cells = load_scenario(path, scale=_flag(command, "--scale"), steps=steps)
    assert all(t.seconds <= 30 for t in estimate.cell_times(smaller, cells, [], CPU, lambda c: None))


def test_a_huge_embedding_dim_is_estimated_from_shapes_without_allocating_it():
    """Issue 50, 9: `--embedding-dim 1e9 --dry-run` built the dense model whole (128 GB and more)."""
    scenario, _ = parse_scenario(tiny_scenario(data={"embedding_dim": 10**9}, model={"bottom_mlp": [16, 10**9]}), "t.yaml")
    tables = scenario.tables()
    step = estimate._rough_step(scenario, tables, 64, 1)
    assert 0 < step < float("inf")
    assert 0 < estimate.fill_rate(10**9) < float("inf")  # timed on a chunk of bounded size


@pytest.mark.parametrize("figures", [{"step": 1e300}, {"generator_samples_per_s": 1e-300}])
def test_an_earlier_run_s_absurd_figures_are_not_an_estimate(tmp_path, fixed_calibration, figures):
    """Issue 50, 9: a recorded step of 1e300 s or a generator of 1e-300 samples a second failed the
    estimate (an overflow); such a record gives none, the calibration does."""
    raw = tiny_scenario(strategies=[{"name": "device"}])
    scenario, _ = parse_scenario(raw, "t.yaml")
    run = write_run(tmp_path / "absurd", [_earlier(scenario, **figures)])
    (device,) = _times(raw, [run])
    assert device.source == "calibrated"
    assert estimate.duration(float("inf")) == estimate.duration(1e300) == "over 100 days"


def test_one_calibration_serves_every_scale_so_the_estimate_grows_with_the_tables(monkeypatch):
    """Issue 49, point 3: a machine's load between two calibrations made --scale 0.0001 look longer
    than --scale 0.2; a shape is calibrated once, and only the build grows with the tables."""
    calls = []
    monkeypatch.setattr(estimate, "_calibrated_step", lambda *a: calls.append(a) or (STEP_S / len(calls), BATCH_S,
                                                                                      (STEP_S, STEP_S)))
    scales = [0.0001, 0.001, 0.01, 0.05]
    times = [_times(tiny_scenario(data={"scale": s}, strategies=[{"name": "device"}]))[0] for s in scales]
    assert len(calls) == 1  # without the shared calibration, each later one here is faster
    assert all(a.seconds < b.seconds and a.steps_s == b.steps_s for a, b in zip(times, times[1:]))


def test_a_cell_measured_on_smaller_tables_is_a_floor_for_larger_ones(tmp_path, fixed_calibration):
    """Issue 49, point 3: a run at --scale 0.0001 (slow steps, recorded) made that scale look
    longer than --scale 0.2, estimated from the calibration's floor alone."""
    small_raw, large_raw = (tiny_scenario(data={"scale": s}, strategies=[{"name": "device"}]) for s in (0.0002, 0.002))
    small, _ = parse_scenario(small_raw, "t.yaml")
    run = write_run(tmp_path / "tiny-small", [_earlier(small, step=0.5, build_seconds=2.0)])
    (measured,) = _times(small_raw, [run])
    (larger,) = _times(large_raw, [run])
    assert measured.source == "run tiny-small"
    assert larger.seconds >= measured.seconds and larger.source == "scaled up from run tiny-small" and larger.floor
    assert "at --scale 0.0002: a floor" in larger.detail
    (alone,) = _times(large_raw)  # without the record: the calibration's floor, far below
    assert alone.seconds < measured.seconds
