"""The command line, end to end, as a user runs it."""

import json
import subprocess
import sys
from pathlib import Path

import yaml

from embbench.scenario import load_scenario

ROOT = Path(__file__).resolve().parents[1]


def embbench(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "embbench.cli", *args], cwd=ROOT, capture_output=True, text=True, timeout=600)


def test_run_smoke_prints_the_table_and_writes_a_record_per_cell(tmp_path):
    out = tmp_path / "run"
    proc = embbench("run", "scenarios/smoke.yaml", "--steps", "3", "--out", str(out))
    assert proc.returncode == 0, proc.stderr
    assert "device@w1" in proc.stdout and "cpu@w1" in proc.stdout and "samples/s" in proc.stdout
    records = sorted(out.glob("*.json"))
    _, cells = load_scenario(ROOT / "scenarios/smoke.yaml")
    assert sorted(p.stem for p in records) == sorted(c.slug for c in cells)
    assert {"device", "cpu", "freqcache"} <= {c.strategy for c in cells}
    data = json.loads(records[0].read_text())
    assert data["status"] == "ok" and data["provenance"]["versions"]["torch"]
    assert data["scenario"]["config"]["run"]["steps"] == 3
    shown = embbench("show", str(out))
    assert shown.returncode == 0 and "cpu@w1" in shown.stdout


def test_strategies_lists_the_installed_ones():
    proc = embbench("strategies")
    assert proc.returncode == 0
    for name in ("device", "cpu", "freqcache", "cache_ratio"):
        assert name in proc.stdout


def test_a_misspelled_key_fails_naming_it(tmp_path):
    raw = yaml.safe_load((ROOT / "scenarios/smoke.yaml").read_text())
    raw["run"]["warmup_step"] = raw["run"].pop("warmup_steps")
    path = tmp_path / "typo.yaml"
    path.write_text(yaml.safe_dump(raw))
    proc = embbench("run", str(path))
    assert proc.returncode == 2
    assert f"{path}: run.warmup_step: unknown key" in proc.stderr


def test_dry_run_estimates_memory_and_runs_nothing(tmp_path):
    proc = embbench("run", "scenarios/smoke.yaml", "--dry-run", "--out", str(tmp_path / "none"))
    assert proc.returncode == 0
    assert "device@w1" in proc.stdout and "fits" in proc.stdout
    assert not (tmp_path / "none").exists()


def test_project_rejects_a_malformed_link_naming_the_flag(tmp_path):
    proc = embbench("project", str(tmp_path), "--links", "nvlink")
    assert proc.returncode == 2
    assert "argument --links: 'nvlink': expected name=GB/s" in proc.stderr
