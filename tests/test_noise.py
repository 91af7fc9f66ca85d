"""What a record says about the conditions it was measured in (issue 32): the machine's noise
over the timed steps, the threads, every thread's CPU time; and what a run says when its cells
cannot start here (skipped, its own exit code, the scale that fits; --dry-run as run)."""

from __future__ import annotations

import re
import shlex
from pathlib import Path

import pytest
import yaml

from conftest import tiny_scenario
from embbench import launch, noise
from embbench.cli import EXIT_NOTHING_RAN, main
from embbench.scenario import Cell, RunConfig, ScenarioError, load_scenario, parse_scenario
from record_factory import make_record

ROOT = Path(__file__).resolve().parents[1]


def _sample(t: float, busy: float, steal: float = 0.0, cpu: float = 0.0, gpu=None) -> dict:
    return {"time": t, "process_cpu_s": cpu, "machine_busy_s": busy, "machine_steal_s": steal, "load_1min": 1.0,
            "mem_available_bytes": 1 << 30, "gpu": gpu}


def test_other_processes_share_is_the_machines_cpu_time_less_the_cells_own(monkeypatch):
    monkeypatch.setattr(noise.os, "cpu_count", lambda: 4)
    # 10 s on 4 cores: the machine was busy for 14 CPU-s, the cell's ranks took 6 of them
    floor = noise.noise_floor(_sample(0, busy=100), _sample(10, busy=114, steal=0.4), own_cpu_s=6.0)
    assert floor["others_cpu_share"] == pytest.approx(8 / 40) and floor["steal_share"] == pytest.approx(0.01)
    assert noise.flags(floor, 0.02) == ["busy: other processes took 20% of the 4 cores"]
    quiet = noise.noise_floor(_sample(0, busy=100), _sample(10, busy=106.5), own_cpu_s=6.0)
    assert noise.flags(quiet, 0.02) == [] and noise.flags(quiet, 0.15) == ["wide: ±15% over repeats"]


def test_other_processes_on_the_gpu_are_counted_without_the_cells_own_ranks():
    gpu = {"sm_clock_mhz": 1980.0, "temperature_c": 40.0, "compute_pids": [11, 12, 99]}
    floor = noise.noise_floor(_sample(0, 0, gpu=gpu), _sample(1, 0, gpu=gpu), own_cpu_s=0.0, own_pids={11, 12})
    assert floor["gpu_other_processes"] == 1 and floor["gpu"][0] == {"sm_clock_mhz": 1980.0, "temperature_c": 40.0}
    assert noise.flags(floor, None) == ["busy: 1 other process(es) on the GPU"]


def test_a_real_sample_reads_this_machine():
    now = noise.sample()
    assert now["machine_busy_s"] > 0 and now["mem_available_bytes"] > 0 and now["gpu"] is None
    assert 1 <= noise.usable_cores()[0] <= (launch.os.cpu_count() or 1)


def test_threads_default_to_the_usable_cores_over_the_ranks(monkeypatch):
    monkeypatch.setattr(noise, "usable_cores", lambda: (8, "cgroup CPU quota"))
    assert RunConfig().threads_per_rank(1) == 8 and RunConfig().threads_per_rank(3) == 2
    assert RunConfig().threads_per_rank(16) == 1 and RunConfig(threads=3).threads_per_rank(4) == 3


@pytest.mark.parametrize("bad", [0, -1, True, "many"])
def test_run_threads_rejects_what_is_not_a_count(bad):
    with pytest.raises(ScenarioError, match="run.threads"):
        parse_scenario(tiny_scenario(run={"threads": bad}), "t.yaml")


def test_a_cell_records_its_threads_cpu_time_and_noise(tmp_path):
    """One real cell: its record holds what it ran with and what the machine did meanwhile."""
    scenario, cells = parse_scenario(tiny_scenario(run={"threads": 1}, strategies=[{"name": "device"}]), "t.yaml")
    (record,) = launch.run_cells(scenario, "t.yaml", cells, tmp_path)
    m = record.metrics
    assert record.status == "ok" and m["threads"] == 1 and m["usable_cores"] >= 1
    assert 0 < m["cpu_seconds_per_step"]
    assert m["cell_seconds"] > m["build_seconds"]  # the launcher's wall time of the cell: what --dry-run reuses
    floor = m["noise"]
    assert floor["window_s"] > 0 and 0 <= floor["others_cpu_share"] <= 1 and len(floor["load_1min"]) == 2
    step = m["step_time_s"]
    assert len(step["repeat_medians"]) == scenario.run.repeats and step["ci95"][0] <= step["median_of_repeats"]


# --- cells that cannot start here ----------------------------------------------------------------

def _write(tmp_path: Path, raw: dict, name: str = "s.yaml") -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(raw))
    return path


def test_a_scenario_no_cell_of_which_fits_is_skipped_exits_4_and_prints_the_scale_that_fits(tmp_path, capsys,
                                                                                             monkeypatch):
    raw = tiny_scenario(strategies=[{"name": "device"}, {"name": "cpu"}])
    path = _write(tmp_path, raw)
    scenario, cells = parse_scenario(raw, str(path))
    need = max(launch.memory_preflight(scenario, c, launch.resolve_device("cpu"))[0]["host"] for c in cells)
    free = int((launch.RANK_PROCESS_BYTES["cpu"] + need // 3) / (1 - launch.HOST_HEADROOM))  # a third of the tables
    monkeypatch.setattr(launch, "_free_host_bytes", lambda: (free, "a test's reading"))
    assert main(["run", str(path), "--out", str(tmp_path / "run")]) == EXIT_NOTHING_RAN == 4
    out, err = capsys.readouterr()
    assert "skipped" in out and f"no cell of {path} can start on this machine (exit 4)" in err
    command = re.search(r"run\n\s+(embbench run .*)", out).group(1)
    scale = float(shlex.split(command)[shlex.split(command).index("--scale") + 1])
    assert scale < scenario.data.scale
    smaller, cells = load_scenario(path, scale=scale)
    assert all(launch.outcome_without_launch(smaller, c) is None for c in cells)  # the printed scale fits


def test_dry_run_answers_as_run_does_and_shows_a_gpu_scenario_on_its_gpu(tmp_path, capsys, monkeypatch):
    """On a machine without CUDA, a GPU scenario's uvm cells are what run records (unsupported),
    and each cell shows its estimate on a GPU beside this machine's."""
    raw = tiny_scenario(name="tiny_1gpu", strategies=[{"name": "device"}, {"name": "uvm"}])
    monkeypatch.setenv("COLUMNS", "250")
    assert main(["run", str(_write(tmp_path, raw)), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "on a GPU: device / host GiB" in out
    uvm_line = next(line for line in out.splitlines() if "uvm@w1" in line)
    assert "unsupported: needs CUDA" in uvm_line
    scenario, cells = parse_scenario(raw, "t.yaml")
    record = launch.run_cells(scenario, "t.yaml", [c for c in cells if c.strategy == "uvm"], tmp_path / "run")[0]
    assert record.status == "unsupported" and record.message in uvm_line


# --- project knows when it cannot ------------------------------------------------------------------

def _projectable(world: int, threads: int | None, cores: int | None, device: str = "cpu"):
    extra = {} if threads is None else {"threads": threads, "usable_cores": cores}
    record = make_record("device", world_size=world, device=device, **extra)
    scenario = {**record.scenario, "config": tiny_scenario(run={"world_size": world})}
    return record.model_copy(update={"scenario": scenario})


def test_project_refuses_cells_whose_ranks_shared_cores_and_prints_one_row_per_world(tmp_path, capsys, monkeypatch):
    from record_factory import write_run

    monkeypatch.setenv("COLUMNS", "200")
    shared = _projectable(8, threads=1, cores=2)
    write_run(tmp_path / "shared", [shared])
    assert main(["project", str(tmp_path / "shared")]) == 2
    out, err = capsys.readouterr()
    assert "not projected from device@w8: its 8 ranks x 1 thread(s) shared 2 CPU core(s)" in out
    assert "no cell to project from" in err

    write_run(tmp_path / "fine", [_projectable(2, threads=1, cores=2), _projectable(1, threads=2, cores=2)])
    assert main(["project", str(tmp_path / "fine"), "--worlds", "1,2,4,8"]) == 0
    out = capsys.readouterr().out
    assert out.count("assumed: compute scales as 1/W") == 1
    body = [line for line in out.splitlines() if line.startswith("│")]
    assert len(body) == 2 * 4  # a row per cell and world size, the links as columns
    assert "2 (measured:" in out and "measured on one rank, so no collective was measured" in out


def test_old_records_without_threads_are_judged_by_the_machines_cores():
    from embbench.projection import why_not_projectable

    assert "shared 16 CPU core(s)" in why_not_projectable(_projectable(32, None, None))  # the factory's 16 cores
    assert why_not_projectable(_projectable(8, None, None)) is None
    assert why_not_projectable(_projectable(8, threads=4, cores=2, device="cuda:0")) is None  # GPUs: not shared


# --- labels that tell the truth ----------------------------------------------------------------------

def test_the_table_calls_min_per_access_an_estimate_and_a_cpu_run_no_placement_result():
    import io

    from rich.console import Console

    from embbench.report import RESULT_COLUMNS, print_comparison

    assert next(c for c in RESULT_COLUMNS if c.key == "hit_rate").header == "hit rate per\naccess (MIN est.)"
    records = [make_record("device", device="cpu"),
               make_record("freqcache", {"cache_ratio": 0.1}, device="cpu", hit_rate=0.967,
                           extra={"belady_hit_rate": 0.966, "belady_unique_hit_rate": 0.5})]
    console = Console(width=400, record=True, file=io.StringIO())
    print_comparison(records, console)
    text = " ".join(console.export_text().split())
    assert "96.7% (96.6%)" in text and "Belady's MIN over the same steps: per access an estimate a policy can beat" in text
    assert text.index("the device here is the host CPU") < text.index("Belady's MIN")  # said first
    console = Console(width=400, record=True, file=io.StringIO())
    print_comparison([make_record("device")], console)  # measured on a GPU: nothing to say
    assert "the device here is the host CPU" not in console.export_text()
