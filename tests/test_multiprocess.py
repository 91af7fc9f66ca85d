"""Several ranks (gloo processes on the CPU): every strategy trains what one process trains,
failures end the cell cleanly, and the 8-rank scenario runs end to end."""

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from embbench.launch import run_cells
from embbench.results import load_records
from embbench.scenario import parse_scenario
from embbench.sharding import plan_table_wise
from embbench.strategy import COUNTERS
from embbench.data import make_tables
from tests.conftest import tiny_scenario

ROOT = Path(__file__).resolve().parents[1]
STRATEGIES = [
    {"name": "device"},
    {"name": "cpu"},
    {"name": "freqcache", "params": {"cache_ratio": 0.05}},
    {"name": "gpu_sharded", "params": {"sharding": "table_wise"}},
    {"name": "sfctr", "params": {"cache_ratio": 0.3, "pipeline_depth": 2}},
]


@pytest.mark.slow
@pytest.mark.parametrize("opt_type", ["sgd", "rowwise_adagrad"])
def test_two_ranks_train_what_one_process_trains(tmp_path, opt_type):
    raw = tiny_scenario(optimizer={"embedding": {"type": opt_type, "lr": 0.1}}, run={"world_size": [1, 2]},
                        strategies=STRATEGIES)
    scenario, cells = parse_scenario(raw, "two.yaml")
    records = run_cells(scenario, "two.yaml", cells, tmp_path)
    assert [r.status for r in records] == ["ok"] * len(cells), [(r.cell_id, r.message) for r in records]
    baseline = records[0]
    assert baseline.cell_id == "device@w1"
    for r in records:
        # the shared vocabulary, and each table's share of it (table.<name>.<counter>: freqcache's tiers by table)
        assert {name.rsplit(".", 1)[-1] for name in r.metrics["counters"]["total"]} <= set(COUNTERS), r.cell_id
    for r in records[1:]:
        assert r.metrics["max_weight_diff_vs_baseline"] < 1e-5, r.cell_id
        assert r.metrics["accuracy"]["auc"] == pytest.approx(baseline.metrics["accuracy"]["auc"], abs=1e-3)
    two = {r.strategy: r for r in records if r.world_size == 2}
    assert len(two["freqcache"].metrics["per_rank"]) == 2
    assert two["freqcache"].metrics["counters"]["total"]["bytes_comm"] > 0
    memory = two["device"].metrics["memory"]
    assert memory["sum"]["static_device_bytes"] >= memory["static_device_bytes"] > 0


@pytest.mark.slow
def test_four_ranks_end_to_end(tmp_path):
    raw = tiny_scenario(run={"world_size": [1, 4], "steps": 2, "repeats": 1},
                        strategies=[{"name": "device"}, {"name": "freqcache", "params": {"cache_ratio": 0.05}}])
    scenario, cells = parse_scenario(raw, "four.yaml")
    cells = [c for c in cells if c.id in ("device@w1", "freqcache[cache_ratio=0.05]@w4")]
    records = run_cells(scenario, "four.yaml", cells, tmp_path)
    four = records[1]
    assert four.status == "ok", four.message
    assert four.metrics["max_weight_diff_vs_baseline"] < 1e-5
    owned = sorted(t for r in four.metrics["per_rank"] for t in r["extra"]["tables_owned"])
    assert owned == list(range(26))


@pytest.mark.slow
def test_a_rank_that_raises_fails_its_cell_and_the_next_cell_runs(tmp_path, rank_plugin):
    raw = tiny_scenario(run={"world_size": 2, "time_limit_s": 600},
                        strategies=[{"name": "rank1_raises"}, {"name": "cpu"}], baseline="cpu")
    scenario, cells = parse_scenario(raw, "ranks.yaml")
    records = {r.strategy: r for r in run_cells(scenario, "ranks.yaml", cells, tmp_path)}
    assert records["rank1_raises"].status == "error"
    assert records["rank1_raises"].message.startswith("rank 1: RuntimeError: rank 1 gives up")
    assert records["cpu"].status == "ok"


def test_table_wise_plan_gives_every_rank_a_table_and_balances_the_large_ones():
    tables = make_tables("criteo_1tb_freq3", 16)
    owner = plan_table_wise(tables, 8)
    assert set(owner) == set(range(8))
    load = [sum(t.num_rows for t, o in zip(tables, owner) if o == r) for r in range(8)]
    assert max(load) == max(t.num_rows for t in tables)  # the largest table alone sets the peak
    with pytest.raises(ValueError, match="needs a table per rank"):
        plan_table_wise(tables[:3], 4)


@pytest.mark.slow
def test_criteo_8gpu_scenario_runs_on_eight_cpu_processes(tmp_path):
    """The shipped 8-GPU scenario, freqcache at one of its three cache ratios (each cell is
    8 ranks on this machine's cores: one shows the scenario runs), at a CPU's scale."""
    import yaml

    raw = yaml.safe_load((ROOT / "scenarios" / "criteo_8gpu.yaml").read_text())
    (freqcache,) = [s for s in raw["strategies"] if s["name"] == "freqcache"]
    assert 0.015 in freqcache["params"]["cache_ratio"]
    freqcache["params"]["cache_ratio"] = 0.015
    scenario = tmp_path / "criteo_8gpu.yaml"
    scenario.write_text(yaml.safe_dump(raw))
    out = tmp_path / "run"
    proc = subprocess.run(
        [sys.executable, "-m", "embbench.cli", "run", str(scenario), "--scale", "0.0001",
         "--steps", "1", "--strategies", "freqcache,uvm", "--out", str(out)],
        cwd=ROOT, capture_output=True, text=True, timeout=1200,
    )
    assert proc.returncode == 0, proc.stderr
    assert "freqcache[cache_ratio=0.015,policy=lfu]@w8" in proc.stdout
    assert "uvm@w8: unsupported: needs CUDA" in proc.stdout
    assert len(list(out.glob("*.json"))) == 2


def test_projection_counts_the_bytes_a_measured_run_sent_and_reproduces_its_step_time(tmp_path):
    """The model's communication term equals what the ranks really sent, and at the measured
    point with the measured bandwidth it gives back the measured step time."""
    from embbench.columns import flat_row, speed
    from embbench.projection import comm_bytes_per_rank, project
    from embbench.columns import counted_steps

    raw = tiny_scenario(run={"world_size": 2, "steps": 3, "repeats": 1},
                        strategies=[{"name": "freqcache", "params": {"cache_ratio": 0.05}}], baseline="freqcache")
    scenario, cells = parse_scenario(raw, "proj.yaml")
    (record,) = run_cells(scenario, "proj.yaml", cells, tmp_path)
    assert record.status == "ok", record.message
    m = record.metrics
    steps, counted = m["measured_steps"], counted_steps(m)  # the counters cover the counted steps
    sent = [r["counters"]["bytes_comm"] / counted for r in m["per_rank"]]
    assert sent == comm_bytes_per_rank(scenario.tables(), scenario.data.batch_size, 2)
    # the collectives' time of the timed steps, as the step time is (the counters' are the counted steps')
    seconds = max(r["timed_comm_us"] for r in m["per_rank"]) / 1e6 / steps
    measured_gbps = max(sent) / seconds / 1e9
    (row,) = project(record, scenario.tables(), [2], {"measured": measured_gbps})
    # the step time show prints (the median of the repeats' medians), the measured samples/s show's
    assert row["step_s"] == pytest.approx(speed(m).step_s, rel=1e-6)
    assert m["samples_per_step"] / row["measured_step_s"] == pytest.approx(flat_row(record)["throughput"], rel=1e-9)
    faster = project(record, scenario.tables(), [2, 4], {"x": measured_gbps * 10})
    assert faster[0]["step_s"] < row["step_s"] and faster[1]["comm_bytes_per_rank"] > 0


@pytest.mark.slow
def test_under_torchrun_every_rank_runs_the_cells_of_the_job_size(tmp_path):
    """`torchrun ... -m embbench.cli run`: cells of the job's world size run in the ranks,
    others are recorded as unsupported, rank 0 writes and prints."""
    raw = tiny_scenario(run={"world_size": [1, 2]},
                        strategies=[{"name": "device"}, {"name": "freqcache", "params": {"cache_ratio": 0.05}}])
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(raw))
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "-m", "embbench.cli", "run",
         str(path), "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=600,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    records = {r.cell_id: r for r in load_records(out)}
    assert records["device@w1"].status == "unsupported"
    assert "this torchrun job has 2 ranks" in records["device@w1"].message
    assert records["device@w2"].status == records["freqcache[cache_ratio=0.05]@w2"].status == "ok"
    assert records["freqcache[cache_ratio=0.05]@w2"].metrics["max_weight_diff_vs_baseline"] < 1e-5
    assert proc.stdout.count("freqcache[cache_ratio=0.05]@w2") >= 1
    # Resumed after losing a cell's record: the baseline is reused, the cell reruns and is
    # still compared with the baseline's weights.
    next(out.glob("freqcache*.json")).unlink()
    resumed = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "-m", "embbench.cli", "run",
         str(path), "--out", str(out), "--resume"], cwd=ROOT, capture_output=True, text=True, timeout=600,
    )
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    again = {r.cell_id: r for r in load_records(out)}
    assert again["device@w2"].provenance == records["device@w2"].provenance
    assert again["freqcache[cache_ratio=0.05]@w2"].metrics["max_weight_diff_vs_baseline"] < 1e-5
