"""Records checked on read with one schema, and one scenario per run directory (issue 28).

A record that fails the schema (:class:`embbench.results.Record`) is named with its file and
the key that fails, and left out, never ranked; a regression gate fails on a candidate cell
that is missing, damaged or non-finite; a table never puts two scenarios side by side.
"""

from __future__ import annotations

import json
import math
import re
import shutil
import tempfile
from pathlib import Path
from typing import Any

import pytest
import yaml
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import embbench.launch as launch
from embbench.cli import main
from embbench.launch import CellOutcome, run_cells
from embbench.results import RecordError, load_records, read_record, write_record
from embbench.scenario import Cell, parse_scenario
from tests.conftest import tiny_scenario
from tests.record_factory import make_record, write_run

ROOT = Path(__file__).resolve().parents[1]
#: A real run (H100, committed): the baseline and a cache cell with counters, bounds and weights.
REAL_RUN = ROOT / "results" / "2026-11-23-h100" / "smoke"
#: file -> cell id
REAL_CELLS = {"device@w1.json": "device@w1", "freqcache_cache_ratio=0.01,policy=lfu_@w1.json": "freqcache[cache_ratio=0.01,policy=lfu]@w1"}


def _cli(capsys, *argv) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def _words(text: str) -> str:
    """Text with its line breaks and runs of spaces as one space (rich wraps long lines)."""
    return " ".join(text.split())


def _no_non_finite(text: str) -> None:
    assert not re.search(r"\b(nan|inf|infinity)\b", text, re.IGNORECASE), text


def test_every_committed_record_validates():
    """Every JSON file under results/ is a record, or a curve (with its tiers), and reads as one."""
    from embbench.cache.curve import CURVE_FORMAT, read_curve
    from embbench.cache.tiers import read_tiers

    files = sorted((ROOT / "results").glob("*/**/*.json"))
    assert len(files) >= 20
    for f in files:
        if json.loads(f.read_text()).get("format") == CURVE_FORMAT:
            read_tiers(f) if "tiers" in json.loads(f.read_text()) else read_curve(f)
        elif json.loads(f.read_text()).get("format") == "embbench-reader-benchmark-1":  # benchmarks/file_store_reads.py
            assert {"store", "probe", "drive_reads_per_s", "uptime"} <= json.loads(f.read_text()).keys(), f
        else:
            read_record(f)  # raises, naming the file and key, if one does not


# --- any mutation of a real record: rejected by name, or shown correctly ------------------------


def _paths(value: Any, prefix: tuple = ()) -> list[tuple]:
    """Every key path of a JSON value (containers and leaves)."""
    out = [prefix] if prefix else []
    if isinstance(value, dict):
        for k, v in value.items():
            out += _paths(v, prefix + (k,))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            out += _paths(v, prefix + (i,))
    return out


_MUTATIONS = ["null", "string", "numeric string", "nan", "inf", "negative", "missing", "shorter", "longer"]


def _mutate(data: dict, path: tuple, how: str) -> bool:
    """Apply ``how`` at ``path``; False when it does not apply there (nothing changed)."""
    parent = data
    for key in path[:-1]:
        parent = parent[key]
    key, value = path[-1], parent[path[-1]]
    if how == "missing":
        if isinstance(parent, list):
            return False
        del parent[key]
    elif how in ("shorter", "longer"):
        if not isinstance(value, list) or (how == "shorter" and not value):
            return False
        parent[key] = value[:-1] if how == "shorter" else value + value[-1:] if value else [1.0]
    elif how == "negative":
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            return False
        parent[key] = -abs(value) - 1
    else:
        parent[key] = {"null": None, "string": "x", "numeric string": "12", "nan": math.nan, "inf": math.inf}[how]
    return True


def _names_the_key(message: str, path: tuple) -> bool:
    """Whether a rejection names the mutated key: the key path that failed is the mutated one,
    inside it or around it, or the record-level check the key feeds (cell id, status)."""
    key = message.split(": ", 1)[0]
    mutated = ".".join(str(p) for p in path)
    if key == mutated or key.startswith(mutated + ".") or mutated.startswith(key + "."):
        return True
    if path[0] == "schema_version":
        return key.startswith("schema_version")
    if path[0] in ("strategy", "params", "world_size"):
        return key == "cell_id"
    return path[0] == "status" and key in ("metrics", "message")


_REAL = {name: json.loads((REAL_RUN / name).read_text()) for name in REAL_CELLS}
#: (file, key path) of every key of both records: the baseline's and the cache cell's
_KEYS = [(name, path) for name, record in _REAL.items() for path in _paths(record)]


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(key=st.sampled_from(_KEYS), how=st.sampled_from(_MUTATIONS))
@pytest.mark.slow
def test_any_mutation_of_a_record_is_rejected_by_name_or_shown_correctly(capsys, key, how):
    name, path = key
    cell_id = REAL_CELLS[name]
    data = json.loads(json.dumps(_REAL[name]))
    if not _mutate(data, path, how):
        return
    with tempfile.TemporaryDirectory() as tmp:
        base, run = Path(tmp) / "base", Path(tmp) / "run"
        for d in (base, run):
            d.mkdir()
            for file, record in _REAL.items():
                (d / file).write_text(json.dumps(record))
        target = run / name
        target.write_text(json.dumps(data))  # NaN and Infinity as Python's json writes them
        try:
            read_record(target)
            rejected = None
        except RecordError as e:
            rejected = str(e)
        if rejected is not None:
            assert rejected.startswith(f"{target}: ") and "\n" not in rejected
            assert _names_the_key(rejected[len(f"{target}: "):], path), rejected
        warning = f"warning: {rejected}; skipped\n"
        mixed = rejected is None and path == ("scenario", "digest")  # now a record of another scenario

        code, out, err = _cli(capsys, "show", run)
        assert code == 0 and "Traceback" not in err
        assert (cell_id in out) == (rejected is None)
        if rejected:
            assert err == warning
        else:
            _no_non_finite(out)
            assert ("records of 2 scenarios" in out) == mixed
        code, out, err = _cli(capsys, "show", run, "--json")
        rows = json.loads(out, parse_constant=lambda c: pytest.fail(f"{c} in show --json"))
        assert code == 0 and [r["cell_id"] for r in rows].count(cell_id) == (rejected is None)

        code, out, err = _cli(capsys, "recommend", run, "--device-memory", "80GiB")
        if mixed:
            assert code == 2 and "holds records of 2 scenarios" in err
        else:
            assert code == 0 and (cell_id in out) == (rejected is None)
            assert err == (warning if rejected else "")
            _no_non_finite(out)

        code, out, err = _cli(capsys, "compare", base, run, "--fail-on", "5%")
        if mixed:
            assert code == 2 and "holds records of 2 scenarios" in err
        elif rejected:
            assert code == 1 and _words(f"{cell_id}: its record is damaged ({rejected})") in _words(out)
        else:
            assert code in (0, 1, 3) and "Traceback" not in err  # 3: the real records' noise is wider than 5%
            assert code == 0 or (code == 1 and f"{cell_id}: " in out) or (code == 3 and "cannot judge at 5%" in out)


def test_a_nan_throughput_is_named_and_never_ranked(tmp_path, capsys):
    cache = make_record("freqcache", {"cache_ratio": 0.1}, step_times=[0.004] * 12)
    write_run(tmp_path, [make_record("device", step_times=[0.005] * 12), cache])
    path = tmp_path / "freqcache_cache_ratio=0.1_@w1.json"
    data = json.loads(path.read_text())
    data["metrics"]["throughput"]["mean"] = math.nan
    path.write_text(json.dumps(data))
    code, out, err = _cli(capsys, "recommend", tmp_path, "--device-memory", "80GiB")
    assert code == 0 and err == f"warning: {path}: metrics.throughput.mean: nan is not a finite number; skipped\n"
    assert "freqcache" not in out and "recommended: device@w1" in out
    _no_non_finite(out)


# --- the regression gate ------------------------------------------------------------------------


@pytest.mark.parametrize("damage, reason", [
    (lambda m: m["throughput"].update(mean=math.nan), "metrics.throughput.mean: nan is not a finite number"),
    (lambda m: m["step_time_s"].update(median=None), "metrics.step_time_s.median: Input should be a valid number"),
    (lambda m: m["throughput"].update(ci95=[1.0]), "metrics.throughput.ci95.1: Field required"),
    (lambda m: m["memory"].update(static_device_bytes="1GiB"), "metrics.memory.static_device_bytes: Input should be a valid integer"),
], ids=["nan-throughput", "null-median", "one-value-ci", "string-memory"])
def test_the_gate_fails_on_a_damaged_candidate_cell_naming_it(tmp_path, capsys, damage, reason):
    records = [make_record("device", step_times=[0.005] * 12), make_record("cpu", step_times=[0.02] * 12)]
    base, candidate = write_run(tmp_path / "base", records), write_run(tmp_path / "candidate", records)
    path = candidate / "cpu@w1.json"
    data = json.loads(path.read_text())
    damage(data["metrics"])
    path.write_text(json.dumps(data))
    code, out, err = _cli(capsys, "compare", base, candidate, "--fail-on", "5%")
    assert code == 1 and err == f"warning: {path}: {reason}; skipped\n"
    assert _words(f"cpu@w1: its record is damaged ({path}: {reason})") in _words(out)
    path.unlink()
    code, out, _ = _cli(capsys, "compare", base, candidate, "--fail-on", "5%")
    assert code == 1 and "cpu@w1: missing from the candidate run" in out


def test_a_record_that_would_not_validate_is_never_written(tmp_path):
    record = make_record("device")
    record.metrics["throughput"]["mean"] = math.inf  # added to after it was made
    with pytest.raises(RecordError, match=r"device@w1\.json: not written: metrics\.throughput\.mean: inf is not a finite"):
        write_record(tmp_path, "device@w1", record)
    assert not list(tmp_path.iterdir())


def test_measurements_that_fail_the_schema_are_recorded_as_an_error_naming_the_field(tmp_path):
    scenario, cells = parse_scenario(tiny_scenario(run={"compare_weights": False}), "t.yaml")
    metrics = make_record().metrics | {"generator_samples_per_s": math.inf}
    (record,) = run_cells(scenario, "t.yaml", cells[:1], tmp_path, execute=lambda c, w: CellOutcome("ok", None, metrics))
    assert record.status == "error" and record.metrics is None
    assert record.message == "its measurements fail the record schema: metrics.generator_samples_per_s: inf is not a finite number"
    assert load_records(tmp_path) == [record]


# --- resume -------------------------------------------------------------------------------------


def test_resume_reruns_a_damaged_record_saying_why(tmp_path):
    scenario, cells = parse_scenario(tiny_scenario(run={"compare_weights": False}), "t.yaml")
    ok = lambda cell, weights: CellOutcome("ok", None, make_record().metrics)  # noqa: E731
    run_cells(scenario, "t.yaml", cells, tmp_path, execute=ok)
    path = tmp_path / f"{cells[1].slug}.json"
    data = json.loads(path.read_text())
    del data["metrics"]["warmup_steps"]
    path.write_text(json.dumps(data))
    started, notes = [], []
    run_cells(scenario, "t.yaml", cells, tmp_path, resume=True, execute=ok, on_start=started.append, on_notice=notes.append)
    assert started == [cells[1]]
    assert notes == [f"{path}: metrics.warmup_steps: Field required; that cell runs again"]


# --- one scenario per run directory -------------------------------------------------------------


def _scenario_file(tmp_path: Path) -> Path:
    path = tmp_path / "tiny.yaml"
    path.write_text(yaml.safe_dump(tiny_scenario(run={"compare_weights": False})))
    return path


@pytest.fixture
def no_cells_run(monkeypatch):
    """Runs nothing for real: a cell that would start processes fails the test."""
    def refuse(*args, **kwargs):
        raise AssertionError("a cell was started")
    monkeypatch.setattr(launch, "run_isolated", refuse)


def test_run_into_a_directory_of_another_scenario_is_refused_naming_both(tmp_path, capsys, no_cells_run):
    yaml_file, out = _scenario_file(tmp_path), tmp_path / "run"
    scenario, cells = parse_scenario(yaml.safe_load(yaml_file.read_text()), str(yaml_file))
    run_cells(scenario, str(yaml_file), cells, out, execute=lambda c, w: CellOutcome("ok", None, make_record().metrics))
    longer, _ = parse_scenario(tiny_scenario(run={"compare_weights": False, "steps": 7}), str(yaml_file))
    for extra in ([], ["--resume"], ["--force"], ["--dry-run"]):
        code, _, err = _cli(capsys, "run", yaml_file, "--out", out, "--steps", "7", *extra)
        assert code == 2 and err == (
            f"error: --out {out}: holds 2 record(s) of another scenario (digest {scenario.digest()[:10]}; this run's is "
            f"{longer.digest()[:10]}): run.steps: 3 vs 7. A run directory holds one scenario: give another --out, or "
            "move those records away\n")
    code, out_text, err = _cli(capsys, "run", yaml_file, "--out", out, "--resume", "--quiet")
    assert code == 0 and "device@w1" in out_text  # the same scenario: every cell reused, none run


def _two_scenarios(tmp_path: Path) -> Path:
    """A directory with a run of ``steps: 5`` and one cell of ``steps: 7`` (whose baseline is faster)."""
    def record(strategy, seconds, steps):
        r = make_record(strategy, step_times=[seconds] * 12, digest=f"{steps}" * 64)
        r.scenario["config"] = {"name": "smoke", "run": {"steps": steps}}
        return r
    return [write_run(tmp_path / "five", [record("device", 0.010, 5), record("cpu", 0.020, 5)]),
            write_run(tmp_path / "seven", [record("device", 0.005, 7), record("cpu", 0.020, 7)])]


def test_show_puts_each_scenario_in_a_table_of_its_own_with_speedups_within_it(tmp_path, capsys):
    five, seven = _two_scenarios(tmp_path)
    code, out, err = _cli(capsys, "show", five, seven)
    out, run = _words(out), f"{five} {seven}"  # a long title wraps
    assert code == 0 and err == "" and f"{run}: records of 2 scenarios: one table each, no speedup across them" in out
    assert f"{run}: scenario smoke 5555555555" in out
    assert f"{run}: scenario smoke 7777777777 (against 5555555555: run.steps: 5 vs 7)" in out
    assert out.count("0.50x") == 1 and "0.25x" in out  # cpu against the device of its own scenario only
    code, out, _ = _cli(capsys, "show", five, seven, "--json")
    speedups = {(r["scenario_digest"][0], r["cell_id"]): r["speedup"] for r in json.loads(out)}
    assert speedups == {("5", "device@w1"): 1.0, ("5", "cpu@w1"): 0.5, ("7", "device@w1"): 1.0, ("7", "cpu@w1"): 0.25}


@pytest.mark.parametrize("command", [["recommend", "RUN", "--device-memory", "80GiB"], ["compare", "RUN", "OTHER"],
                                     ["compare", "OTHER", "RUN"], ["report", "RUN", "--out", "OUT"]])
def test_commands_that_rank_or_compare_refuse_a_directory_of_two_scenarios(tmp_path, capsys, command):
    five, seven = _two_scenarios(tmp_path)
    run = five
    shutil.copy(seven / "device@w1.json", run / "device@w1.json")  # one cell of another scenario among them
    other = write_run(tmp_path / "other", [make_record("device")])
    argv = [{"RUN": run, "OTHER": other, "OUT": tmp_path / "r.html"}.get(a, a) for a in command]
    code, _, err = _cli(capsys, *argv)
    assert code == 2 and err.startswith(f"error: {run}: holds records of 2 scenarios (5555555555 (1 cells), "
                                        "7777777777 (1 cells); run.steps: 5 vs 7)")
    assert not (tmp_path / "r.html").exists()


def test_the_same_cell_given_twice_is_listed_once(tmp_path, capsys):
    run = write_run(tmp_path / "run", [make_record("device"), make_record("cpu", step_times=[0.02] * 12)])
    (tmp_path / "copy").mkdir()
    shutil.copy(run / "cpu@w1.json", tmp_path / "copy" / "cpu@w1.json")
    for argv in (["show", run, tmp_path / "copy"], ["show", run, run], ["show", run, run / "cpu@w1.json"]):
        code, out, err = _cli(capsys, *argv)
        assert code == 0 and err == "" and out.count("│ cpu@w1 ") == 1, out
    code, out, _ = _cli(capsys, "show", run, run, "--json")
    assert sorted(r["cell_id"] for r in json.loads(out)) == ["cpu@w1", "device@w1"]


def test_a_differing_copy_of_a_cell_is_named_and_left_out(tmp_path, capsys):
    run = write_run(tmp_path / "run", [make_record("device"), make_record("cpu", step_times=[0.02] * 12)])
    other = write_run(tmp_path / "zz", [make_record("cpu", step_times=[0.03] * 12)])
    code, out, err = _cli(capsys, "show", run, other)
    assert code == 0 and out.count("│ cpu@w1 ") == 1
    assert err == (f"warning: {other / 'cpu@w1.json'}: holds cpu@w1 of the same scenario as {run / 'cpu@w1.json'} and "
                   "differs from it; left out (compare them with `embbench compare`); skipped\n")


def test_a_record_under_another_cells_file_name_is_damaged_naming_both(tmp_path, capsys):
    run = write_run(tmp_path / "run", [make_record("device"), make_record("cpu", step_times=[0.02] * 12)])
    shutil.copy(run / "cpu@w1.json", run / "cpu@w1 (copy).json")
    code, out, err = _cli(capsys, "show", run)
    assert code == 0 and out.count("│ cpu@w1 ") == 1
    assert err == (f"warning: {run / 'cpu@w1 (copy).json'}: holds the record of cell cpu@w1, whose file is cpu@w1.json; "
                   "a record belongs to its own file; skipped\n")


def test_the_speedup_is_against_the_baseline_with_fp32_rows_where_it_ran_in_several_precisions(tmp_path, capsys):
    """A row-precision scenario runs its baseline in fp32, fp16 and fp8: every speedup is against
    the fp32 one, whatever the order of the records (on an H100 the fp8 cell was taken)."""
    run = write_run(tmp_path / "a", [make_record("device", step_times=[0.010] * 12),
                                     make_record("device", step_times=[0.020] * 12, row_precision="fp16"),
                                     make_record("device", step_times=[0.040] * 12, row_precision="fp8"),
                                     make_record("uvm_cache", step_times=[0.020] * 12, row_precision="fp8")])
    code, out, _ = _cli(capsys, "show", run, "--json")
    speedups = {r["cell_id"]: r["speedup"] for r in json.loads(out)}
    assert code == 0 and speedups == {"device@w1": 1.0, "device@w1@fp16": 0.5, "device@w1@fp8": 0.25,
                                      "uvm_cache@w1@fp8": 0.5}


@pytest.mark.parametrize("damage, key", [
    (lambda tiers: "hbm", "metrics.tiers"),
    (lambda tiers: [{k: v for k, v in tiers[0].items() if k != "tier"}] + tiers[1:], "metrics.tiers.0.tier"),
    (lambda tiers: [{**tiers[0], "hit_rate": 2.0}] + tiers[1:], "metrics.tiers.0.hit_rate"),
    (lambda tiers: tiers[:2] + [{**tiers[2], "bytes_read_per_step": -4096.0}], "metrics.tiers.2.bytes_read_per_step"),
    (lambda tiers: [{**tiers[0], "tier": "tape"}] + tiers[1:], "metrics.tiers.0.tier"),
    (lambda tiers: tiers + tiers[:1], "metrics.tiers"),
])
def test_a_damaged_tiers_section_is_named_when_the_record_is_read(tmp_path, capsys, damage, key):
    """Issue 50, 7: metrics.tiers is in the record schema: show, compare and report skip the
    record naming the key, never a traceback."""
    from record_factory import file_store_counters

    counters = file_store_counters(reached=1000, loaded=400, dram_misses=100, pages_read=120, read_s=0.01)
    good = make_record("freqcache", {"store": "file"}, tier_counters=counters)
    run = write_run(tmp_path / "run", [make_record("device"), good])
    read_record(next(run.glob("freqcache*.json")))  # the undamaged one reads
    base = shutil.copytree(run, tmp_path / "base")
    data = json.loads(next(run.glob("freqcache*.json")).read_text())
    data["metrics"]["tiers"] = damage(data["metrics"]["tiers"])
    target = next(run.glob("freqcache*.json"))
    target.write_text(json.dumps(data))
    with pytest.raises(RecordError, match=f"^{target}: {key}"):
        read_record(target)
    if key == "metrics.tiers" and isinstance(data["metrics"]["tiers"], str):  # the commands, once (a TypeError before)
        for argv in (["show", run], ["compare", base, run], ["report", run, "--out", tmp_path / "r.html"]):
            code, out, err = _cli(capsys, *argv)
            assert "Traceback" not in err and f"{target}: {key}" in _words(err + out), argv


def test_each_table_s_tiers_are_checked_as_the_whole_s(tmp_path):
    """metrics.tiers_by_table (freqcache's per-table tiers) is held to the tiers' schema: a
    negative hit rate in one table's tier is refused by name."""
    record = make_record("device")
    tier = {"tier": "hbm", "hit_rate": 0.5, "hit_rate_of_reaching": 0.5, "reaching_per_step": 10.0}
    record.metrics["tiers_by_table"] = {"t0": [tier]}
    assert read_record(write_record(tmp_path, "device@w1", record)).metrics["tiers_by_table"]["t0"][0]["hit_rate"] == 0.5
    record.metrics["tiers_by_table"]["t0"][0]["hit_rate"] = -0.5
    with pytest.raises(RecordError, match=r"tiers_by_table\.t0\.0\.hit_rate"):
        write_record(tmp_path / "b", "device@w1", record)
