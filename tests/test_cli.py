"""The command line, end to end, as a user runs it."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
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
    assert "device@w1" in proc.stdout and "run here" in proc.stdout and "yes" in proc.stdout
    assert not (tmp_path / "none").exists()


def test_project_rejects_a_malformed_link_naming_the_flag(tmp_path):
    proc = embbench("project", str(tmp_path), "--links", "nvlink")
    assert proc.returncode == 2
    assert "argument --links: 'nvlink': expected name=GB/s" in proc.stderr


def _tsv_scenario_file(tmp_path: Path, data: dict, strategies: list[dict]) -> Path:
    raw = {"name": "tsv", "data": {"embedding_dim": 8, "batch_size": 128, **data},
           "model": {"arch": "dcnv2", "bottom_mlp": [16, 8], "top_mlp": [16, 1]},
           "run": {"device": "cpu", "warmup_steps": 1, "steps": 3, "repeats": 2, "eval_batches": 2},
           "baseline": "device", "strategies": strategies}
    path = tmp_path / f"{data['source']}.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def test_a_criteo_file_runs_end_to_end_and_records_a_replayable_trace(tmp_path):
    from embbench.data.fake_criteo import write_fake_criteo

    data = write_fake_criteo(tmp_path / "train.txt", 3000, seed=2)
    cache = tmp_path / "cache"
    scenario = _tsv_scenario_file(tmp_path, {"source": "criteo_tsv", "path": str(data), "eval": 0.2, "min_count": 2},
                                  [{"name": "device"}, {"name": "cpu"}, {"name": "freqcache", "params": {"cache_ratio": 0.2}},
                                   {"name": "colossalai", "params": {"cache_ratio": 0.5}}])
    proc = embbench("run", str(scenario), "--out", str(tmp_path / "run"), "--data-cache", str(cache))
    assert proc.returncode == 0, proc.stderr
    records = [json.loads(p.read_text()) for p in (tmp_path / "run").glob("*.json")]
    assert len(records) == 4 and all(r["status"] == "ok" and 0 < r["metrics"]["accuracy"]["auc"] < 1 for r in records)
    # each cell's evaluation scores beside the records, on the same samples (issue 41: recommend's DeLong test)
    from embbench.results import read_eval_scores
    from embbench.stats import auc_standard_error

    scored = [read_eval_scores(tmp_path / "run" / "eval" / r["metrics"]["accuracy"]["eval_file"]) for r in records]
    for r, (scores, labels) in zip(records, scored):
        accuracy = r["metrics"]["accuracy"]
        assert len(labels) == accuracy["eval_samples"] and (labels == scored[0][1]).all()
        assert accuracy["auc_standard_error"] == pytest.approx(auc_standard_error(labels, scores))
        assert "eval_scores" not in accuracy
    assert list(cache.glob("files/train.txt-*/meta.json")), "the parsed file is kept in --data-cache"

    trace = tmp_path / "ids.npz"
    proc = embbench("trace", "record", str(scenario), "--out", str(trace), "--data-cache", str(cache))
    assert proc.returncode == 0, proc.stderr
    checked = embbench("data", "check", str(trace))
    assert checked.returncode == 0 and "a valid trace" in checked.stdout, checked.stderr
    replay = _tsv_scenario_file(tmp_path, {"source": "trace", "path": str(trace)}, [{"name": "device"}])
    proc = embbench("run", str(replay), "--out", str(tmp_path / "replay"))
    assert proc.returncode == 0, proc.stderr


def test_data_check_names_the_bad_line_and_a_bad_file_runs_nothing(tmp_path):
    from embbench.data.fake_criteo import write_fake_criteo

    data = write_fake_criteo(tmp_path / "train.txt", 300, seed=2)
    good = embbench("data", "check", str(data))
    assert good.returncode == 0 and "300 rows" in good.stdout and "Zipf alpha" in good.stdout, good.stderr
    lines = data.read_text().splitlines(keepends=True)
    fields = lines[41].split("\t")
    fields[20] = "12x"
    lines[41] = "\t".join(fields)
    data.write_text("".join(lines))
    bad = embbench("data", "check", str(data))
    assert bad.returncode == 2 and f"{data}:42: column 21 (C7): not a hexadecimal id: '12x'" in bad.stderr
    scenario = _tsv_scenario_file(tmp_path, {"source": "criteo_tsv", "path": str(data)}, [{"name": "device"}])
    proc = embbench("run", str(scenario), "--out", str(tmp_path / "run"))
    assert proc.returncode == 2 and f"{data}:42: column 21" in proc.stderr
    assert not list((tmp_path / "run").glob("*.json"))
