"""Hostile input and faults (issue 16): each probe ends in a one-line message naming the file,
key, flag or line, with no traceback, and a failed cell never takes finished records with it.

The probes run in this process (``embbench.cli.main``) and never start a cell's processes,
except the two that kill a harness whose worker hangs.
"""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

import embbench.launch as launch
import embbench.inputs as inputs
from embbench.cli import main
from embbench.launch import CellOutcome, RecordsNotWritten, reusable_records, run_cells
from embbench.results import Record, RecordError, load_records, read_record, write_record
from embbench.runner import Diverged, _classify, run_cell
from embbench.scenario import Cell, ScenarioError, load_scenario, parse_scenario
from embbench.strategy import RuntimeEnv, broken_strategies, get_strategy, load_strategies
from tests.conftest import _install_plugin, tiny_scenario
from tests.record_factory import make_record

ROOT = Path(__file__).resolve().parents[1]


def _write(tmp_path: Path, raw, name: str = "s.yaml") -> Path:
    path = tmp_path / name
    path.write_text(raw if isinstance(raw, str) else yaml.safe_dump(raw))
    return path


def _cli(capsys, *argv: str) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def _one_clean_line(err: str) -> str:
    """The error output: a single line, no traceback."""
    assert "Traceback" not in err
    lines = [line for line in err.splitlines() if line.strip()]
    assert len(lines) == 1, err
    return lines[0]


def _ok_metrics(**extra) -> dict:
    return {**make_record().metrics, **extra}


def _record(scenario, cell: Cell, status: str = "ok", metrics: dict | None = None, digest: str | None = None) -> Record:
    return Record(cell_id=cell.id, strategy=cell.strategy, params=cell.params, world_size=cell.world_size,
                  status=status, message=None if status == "ok" else f"{status} (a test record)", baseline=scenario.baseline,
                  scenario={"name": scenario.name, "file": "t", "digest": digest or scenario.digest(),
                            "config": scenario.model_dump(mode="json")},
                  metrics=metrics if metrics is not None else (_ok_metrics() if status == "ok" else None),
                  provenance={})


def _ok(cell: Cell, weights: Path | None) -> CellOutcome:
    return CellOutcome("ok", None, _ok_metrics())


# --- the scenario file itself (classes 12, 13, 14) ------------------------------------------


def _symlink_loop(tmp_path: Path) -> Path:
    (tmp_path / "a.yaml").symlink_to(tmp_path / "b.yaml")
    (tmp_path / "b.yaml").symlink_to(tmp_path / "a.yaml")
    return tmp_path / "a.yaml"


def _fifo(tmp_path: Path) -> Path:
    os.mkfifo(tmp_path / "fifo.yaml")
    return tmp_path / "fifo.yaml"


@pytest.mark.parametrize("make, expected", [
    (lambda tmp: tmp, "is a directory"),
    (_symlink_loop, "cannot open the scenario"),
    (lambda tmp: Path("/dev/zero"), "not a regular file"),
    (_fifo, "not a regular file"),
    (lambda tmp: _write(tmp, "name: x\n" + "#" * (2 << 20)), "a scenario is at most"),
    (lambda tmp: (tmp / "latin1.yaml").write_bytes("name: caf\xe9\n".encode("latin-1")) and tmp / "latin1.yaml",
     "line 1: not UTF-8 text"),
    (lambda tmp: tmp / "missing.yaml", "no such scenario file"),
], ids=["directory", "symlink-loop", "dev-zero", "fifo", "huge", "not-utf8", "missing"])
def test_a_scenario_that_is_not_a_readable_yaml_file_is_named(tmp_path, capsys, make, expected):
    path = make(tmp_path)
    code, _, err = _cli(capsys, "run", path)
    line = _one_clean_line(err)
    assert code == 2 and line.startswith(f"error: {path}: ") and expected in line


def test_an_unreadable_scenario_is_named(tmp_path, capsys, monkeypatch):
    path = _write(tmp_path, tiny_scenario())

    def refuse(*args, **kwargs):
        raise PermissionError(errno.EACCES, "Permission denied")

    monkeypatch.setattr(inputs, "open", refuse, raising=False)  # root reads a chmod 000 file (embbench.inputs reads it)
    code, _, err = _cli(capsys, "run", path)
    assert code == 2 and _one_clean_line(err) == f"error: {path}: cannot read the scenario: Permission denied"


# --- keys and values (classes 2, 6, 10, 12) --------------------------------------------------


@pytest.mark.parametrize("text, expected", [
    ("name: a\nname: b\n", "line 2, column 1: invalid YAML: duplicate key 'name' (first on line 1)"),
    ("name: a\nrun:\n  steps: 3\n  steps: 4\n", "line 4, column 3: invalid YAML: duplicate key 'steps' (first on line 3)"),
], ids=["top-level", "nested"])
def test_a_duplicate_key_is_named_with_its_line(tmp_path, text, expected):
    path = _write(tmp_path, text)
    with pytest.raises(ScenarioError) as err:
        load_scenario(path)
    assert str(err.value) == f"{path}: {expected}"


@pytest.mark.parametrize("overrides, expected", [
    ({"run": {"world_size": 0}}, "run.world_size: must be at least 1"),
    ({"run": {"world_size": [1, -4]}}, "run.world_size: must be at least 1"),
    ({"run": {"world_size": []}}, "run.world_size: must be at least 1"),
    ({"model": {"bottom_mlp": [16, 4]}}, "model.bottom_mlp: must end in data.embedding_dim 8, got [16, 4]"),
    ({"model": {"top_mlp": [16, 2]}}, "model.top_mlp: must end in 1 (one logit per sample), got [16, 2]"),
    ({"model": {"bottom_mlp": [-16, 8]}}, "model.bottom_mlp[0]: Input should be greater than 0"),
    ({"model": {"top_mlp": [0, 1]}}, "model.top_mlp[0]: Input should be greater than 0"),
    ({"model": {"arch": "dcn"}}, "model.arch: Input should be 'dlrm' or 'dcnv2'"),
    ({"model": {"cross_layers": 0}}, "model.cross_layers: Input should be greater than or equal to 1"),
    ({"data": {"alpha": -0.5}}, "data.alpha: values must be >= 0, got -0.5"),
    ({"data": {"alpha": "steep"}}, "data.alpha: Input should be a valid number"),
    ({"data": {"drift": {"every": 0, "fraction": 0.1}}}, "data.drift.every: Input should be greater than 0"),
    ({"data": {"drift": {"every": 5, "fraction": 1.5}}}, "data.drift.fraction: Input should be less than or equal to 1"),
    ({"data": {"drift": {"every": 5}}}, "data.drift.fraction: Field required"),
    ({"data": {"source": "trace"}}, "data.scale: only for source synthetic, this data's source is trace (--scale)"),
    ({"data": {"source": "trace", "preset": "criteo_kaggle", "scale": 1.0}}, "data.path: source trace needs a path"),
    ({"data": {"hash_size": 1000}}, "data.hash_size: only for source criteo_tsv, this data's source is synthetic"),
    ({"data": {"source": "criteo_tsv", "path": "x", "scale": 1.0, "hash_size": 0}}, "data.hash_size: values must be >= 1"),
    ({"data": {"source": "criteo_tsv", "path": "x", "scale": 1.0, "eval": 1.5}}, "data.eval: a fraction must be in (0, 1)"),
    ({"data": {"preset": "criteo_1tb"}}, "data.preset: preset 'criteo_1tb' was renamed: use criteo_1tb_freq3"),
], ids=["world-0", "world-negative", "world-empty", "bottom-mlp-dim", "top-mlp-logit", "negative-width", "zero-width",
        "arch", "cross-layers-0", "alpha-negative", "alpha-word", "drift-every-0", "drift-fraction-above-1",
        "drift-no-fraction", "foreign-key", "trace-no-path", "hash-size-synthetic", "hash-size-0", "eval-fraction",
        "renamed-preset"])
def test_bad_values_are_refused_before_anything_runs(overrides, expected):
    with pytest.raises(ScenarioError) as err:
        parse_scenario(tiny_scenario(**overrides), "bad.yaml")
    assert str(err.value).startswith(f"bad.yaml: {expected}")


@pytest.mark.parametrize("section, flag", [("run", "--steps"), ("data", "--scale")])
def test_an_override_into_a_section_that_is_not_a_mapping_names_the_section(tmp_path, capsys, section, flag):
    path = _write(tmp_path, tiny_scenario(**{section: 5}))
    code, _, err = _cli(capsys, "run", path, flag, "1")
    assert code == 2 and _one_clean_line(err).startswith(f"error: {path}: {section}: Input should be a valid dictionary")


# --- command-line arguments (classes 12, 13) -------------------------------------------------


@pytest.mark.parametrize("argv, flag, expected", [
    (["project", "RUN", "--worlds", "0"], "--worlds", "must be above 0, got 0"),
    (["project", "RUN", "--worlds", "-4"], "--worlds", "must be above 0, got -4"),
    (["project", "RUN", "--worlds", "1,x"], "--worlds", "'x' is not a number"),
    (["project", "RUN", "--links", "x=0"], "--links", "x: must be above 0, got 0"),
    (["project", "RUN", "--links", "nvlink"], "--links", "'nvlink': expected name=GB/s"),
    (["run", "S", "--steps", "0"], "--steps", "must be above 0, got 0"),
    (["run", "S", "--scale", "nan"], "--scale", "must be above 0, got nan"),
    (["data", "check", "P", "--hash-size", "0"], "--hash-size", "must be above 0, got 0"),
    (["data", "prepare", "S", "--scale", "-1"], "--scale", "must be above 0, got -1"),
    (["trace", "record", "S", "--out", "t.npz", "--train-batches", "0"], "--train-batches", "must be above 0, got 0"),
    (["trace", "record", "S", "--out", "t.npz", "--eval-batches", "-1"], "--eval-batches", "must be at least 0, got -1"),
    # the trust rounds (issue 28): empty, NaN, infinite and out-of-range values
    (["run", "S", "--strategies", ""], "--strategies", "empty: name at least one strategy"),
    (["run", "S", "--strategies", " , "], "--strategies", "empty: name at least one strategy"),
    (["run", "S", "--strategies", "device,,cpu"], "--strategies", "'device,,cpu': an empty name between commas"),
    (["run", "S", "--scale", "inf"], "--scale", "must be a finite number, got inf"),
    (["run", "S", "--scale", "2"], "--scale", "must be at most 1, got 2"),
    (["recommend", "R", "--device-memory", "1GiB", "--auc-tolerance", "nan"], "--auc-tolerance", "must be at least 0, got nan"),
    (["recommend", "R", "--device-memory", "1GiB", "--auc-tolerance", "-0.1"], "--auc-tolerance", "must be at least 0, got -0.1"),
    (["recommend", "R", "--device-memory", "1GiB", "--auc-tolerance", "2"], "--auc-tolerance", "must be at most 1, got 2"),
    (["project", "R", "--latency-us=-1e6"], "--latency-us", "must be at least 0, got -1e6"),
    (["project", "R", "--latency-us", "nan"], "--latency-us", "must be at least 0, got nan"),
    (["project", "R", "--latency-us", "inf"], "--latency-us", "must be a finite number, got inf"),
    (["project", "R", "--links", "x=inf"], "--links", "x: must be a finite number, got inf"),
], ids=["worlds-0", "worlds-negative", "worlds-word", "links-zero", "links-malformed", "steps-0", "scale-nan",
        "hash-size-0", "prepare-scale", "train-batches-0", "eval-batches-negative", "strategies-empty",
        "strategies-blank", "strategies-hole", "scale-inf", "scale-2", "auc-nan", "auc-negative", "auc-2",
        "latency-negative", "latency-nan", "latency-inf", "links-inf"])
def test_bad_flags_are_named(capsys, argv, flag, expected):
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and "Traceback" not in err
    assert f"argument {flag}: {expected}" in err.splitlines()[-1]


def test_out_pointing_at_a_file_or_an_unwritable_place_is_named(tmp_path, capsys):
    scenario = _write(tmp_path, tiny_scenario())
    a_file = _write(tmp_path, "x", "file.txt")
    code, _, err = _cli(capsys, "run", scenario, "--out", a_file)
    assert code == 2 and _one_clean_line(err) == f"error: --out {a_file}: exists and is not a directory"
    code, _, err = _cli(capsys, "run", scenario, "--out", a_file / "sub")
    assert code == 2 and _one_clean_line(err) == f"error: --out {a_file / 'sub'}: cannot write there: Not a directory"


# --- result records (classes 11, 12, 13) -----------------------------------------------------


@pytest.fixture
def tiny():
    return parse_scenario(tiny_scenario(), "t.yaml")


@pytest.mark.parametrize("content, expected", [
    ("[1, 2]", "a JSON list, not a result record"),
    ("{not json", "not valid JSON (line 1)"),
    (b"\xff\xfe", "not UTF-8 text"),
    ('{"schema_version": 99}', "schema_version 99, expected 1"),
    ('{"schema_version": 1, "cell_id": 3}', "cell_id: Input should be a valid string"),
    ("OK_NULL_METRICS", "status ok without its measurements"),
    ("OK_EMPTY_METRICS", "metrics.device: Field required"),
], ids=["json-list", "not-json", "not-utf8", "other-schema", "pydantic", "ok-null-metrics", "ok-empty-metrics"])
def test_a_damaged_record_is_named_by_show_and_project(tmp_path, capsys, tiny, content, expected):
    scenario, cells = tiny
    path = tmp_path / "damaged.json"
    if isinstance(content, bytes):
        path.write_bytes(content)
    elif content.startswith("OK_"):
        data = json.loads(_record(scenario, cells[0]).model_dump_json())
        data["metrics"] = None if content == "OK_NULL_METRICS" else {}
        path.write_text(json.dumps(data))
    else:
        path.write_text(content)
    with pytest.raises(RecordError) as err:
        read_record(path)
    assert str(err.value).startswith(f"{path}: ") and expected in str(err.value)
    for command in ("show", "project"):  # alone in its file: named, then "nothing to show"
        code, _, err_text = _cli(capsys, command, path)
        assert code == 2 and "Traceback" not in err_text and f"{path}: " in err_text and expected in err_text


def test_show_skips_a_damaged_record_naming_it_and_shows_the_rest(tmp_path, capsys, tiny):
    scenario, cells = tiny
    write_record(tmp_path, cells[0].slug, _record(scenario, cells[0]))
    (tmp_path / "broken.json").write_text("[]")
    code, out, err = _cli(capsys, "show", tmp_path)
    assert code == 0 and cells[0].id in out
    assert _one_clean_line(err) == f"warning: {tmp_path / 'broken.json'}: a JSON list, not a result record (an object); skipped"


def test_project_from_a_record_without_its_scenario_is_named(tmp_path, capsys, tiny):
    scenario, cells = tiny
    record = _record(scenario, cells[0])
    record.scenario.pop("config")
    write_record(tmp_path, cells[0].slug, record)
    code, _, err = _cli(capsys, "project", tmp_path)
    assert code == 2 and _one_clean_line(err) == f"error: {tmp_path}: the record of {cells[0].id} holds no scenario config to project from"


def test_show_of_nothing_is_named(tmp_path, capsys):
    code, _, err = _cli(capsys, "show", tmp_path / "nowhere")
    assert code == 2 and "nowhere: no result records here" in _one_clean_line(err)


# --- resume (classes 4, 11) ------------------------------------------------------------------


def test_resume_reruns_damaged_stale_and_unsupported_cells_naming_them(tmp_path, tiny):
    scenario, cells = tiny  # device (baseline), cpu
    weights = tmp_path / "weights"
    weights.mkdir()
    torch.save([torch.zeros(2, 2)], weights / "good.pt")
    (weights / "truncated.pt").write_bytes((weights / "good.pt").read_bytes()[:40])
    write_record(tmp_path, cells[0].slug, _record(scenario, cells[0], metrics=_ok_metrics(weights_file="good.pt")))
    write_record(tmp_path, cells[1].slug, _record(scenario, cells[1], metrics=_ok_metrics(weights_file="truncated.pt")))
    other = Cell("cpu", {}, 2)
    write_record(tmp_path, other.slug, _record(scenario, other, digest="0" * 64))
    write_record(tmp_path, "device@w2", _record(scenario, Cell("device", {}, 2), status="unsupported"))
    (tmp_path / "x@w1.json").write_text(json.dumps({**json.loads(_record(scenario, Cell("x")).model_dump_json()),
                                                     "metrics": None}))
    notes: list[str] = []
    done = reusable_records(tmp_path, scenario, weights, notes.append)
    assert set(done) == {cells[0].id}
    assert any(n.startswith(f"{weights / 'truncated.pt'}: flushed weights missing or damaged") for n in notes)
    assert any(n.startswith(f"{tmp_path / 'x@w1.json'}: metrics: status ok without its measurements") for n in notes)
    assert any("1 record(s) were made with another scenario" in n and "cpu@w2.json" in n for n in notes)


def test_resume_with_other_steps_reruns_every_cell(tmp_path, tiny):
    scenario, cells = tiny
    run_cells(scenario, "t.yaml", cells, tmp_path, execute=_ok)
    longer, _ = parse_scenario(tiny_scenario(run={"steps": 7}), "t.yaml")
    started, notes = [], []
    run_cells(longer, "t.yaml", cells, tmp_path, resume=True, execute=_ok, on_start=started.append,
              on_notice=notes.append)
    assert started == cells and "2 record(s) were made with another scenario" in notes[0]
    started.clear()
    run_cells(longer, "t.yaml", cells, tmp_path, resume=True, execute=_ok, on_start=started.append)
    assert started == []


# --- cells that cannot run here (classes 2, 3) -----------------------------------------------


def test_a_world_size_beyond_the_machine_is_unsupported_naming_the_limit(tmp_path, capsys):
    scenario, cells = parse_scenario(tiny_scenario(run={"world_size": 1000}), "t.yaml")
    (record,) = [r for r in run_cells(scenario, "t.yaml", cells[:1], tmp_path) if r.world_size == 1000]
    assert record.status == "unsupported" and "needs 1000 ranks; at most" in record.message
    assert "CPU ranks on this machine" in record.message
    code, out, _ = _cli(capsys, "run", _write(tmp_path, tiny_scenario(run={"world_size": 1000})), "--dry-run")
    assert code == 0 and "needs 1000 ranks" in out


def test_a_cell_that_cannot_fit_in_memory_is_not_attempted_unless_forced(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(launch, "_host_memory_bytes", lambda: 1024)  # a 1 KiB machine
    scenario, cells = parse_scenario(tiny_scenario(), "t.yaml")
    records = run_cells(scenario, "t.yaml", cells, tmp_path)
    assert [r.status for r in records] == ["skipped", "skipped"]  # never started: not an oom
    assert "not attempted: estimated" in records[0].message and "this machine has 0.0 GiB" in records[0].message
    assert launch.outcome_without_launch(scenario, cells[0], force=True) is None
    code, out, _ = _cli(capsys, "run", _write(tmp_path, tiny_scenario()), "--dry-run")
    assert code == 0 and "skipped: not attempted: estimated" in out and "GiB of host memory" in out


def test_memory_errors_are_oom_and_a_huge_learning_rate_diverges():
    assert _classify(MemoryError()) == "oom" and _classify(RuntimeError("CUDA out of memory")) == "oom"
    # (an infinite one is refused up front: tests/test_trust_round5.py)
    scenario, _ = parse_scenario(tiny_scenario(optimizer={"embedding": {"type": "sgd", "lr": 1e38}}), "t")
    with pytest.raises(Diverged, match="not finite at step"):
        run_cell(scenario, Cell("device"), RuntimeEnv(torch.device("cpu")))


# --- plugins (class 7) -----------------------------------------------------------------------


@pytest.fixture
def broken_plugins(tmp_path, monkeypatch):
    """One entry point that cannot be imported, one whose unsupported_reason raises, one
    whose estimate_memory raises."""
    _install_plugin(tmp_path / "site", "broken_plugin", {
        "unimportable": "no_such_module_anywhere:Nothing",
        "asks_raises": "broken_plugin:AsksRaises",
        "estimates_raise": "broken_plugin:EstimatesRaise",
    }, """
        from baselines.tables import DeviceStrategy

        class AsksRaises(DeviceStrategy):
            name = "asks_raises"
            summary = "unsupported_reason raises"
            def unsupported_reason(self, env):
                raise RuntimeError("cannot tell")

        class EstimatesRaise(DeviceStrategy):
            name = "estimates_raise"
            summary = "estimate_memory raises"
            def estimate_memory(self, tables, optimizer, world_size):
                raise ZeroDivisionError("no estimate")
        """, monkeypatch)
    yield
    load_strategies.cache_clear()


def test_a_broken_entry_point_is_listed_broken_and_the_others_work(broken_plugins, capsys):
    assert "device" in load_strategies() and "unimportable" not in load_strategies()
    assert "ModuleNotFoundError" in broken_strategies()["unimportable"]
    with pytest.raises(KeyError, match="'unimportable' .* cannot be loaded"):
        get_strategy("unimportable")
    code, out, _ = _cli(capsys, "strategies")
    assert code == 0 and "unimportable" in out and "asks_raises" in out and "cannot tell" in out
    with pytest.raises(ScenarioError, match=r"t: strategies\[2\].name: strategy 'unimportable'"):
        parse_scenario(tiny_scenario(strategies=[{"name": "device"}, {"name": "cpu"}, {"name": "unimportable"}]), "t")


def test_a_plugin_raising_outside_its_cell_fails_its_cell_only(broken_plugins, tmp_path, capsys):
    raw = tiny_scenario(strategies=[{"name": "device"}, {"name": "asks_raises"}, {"name": "estimates_raise"}])
    scenario, cells = parse_scenario(raw, "t.yaml")
    outcomes = {c.strategy: launch.outcome_without_launch(scenario, c) for c in cells}
    assert outcomes["device"] is None
    assert outcomes["asks_raises"].status == "error" and "unsupported_reason raised RuntimeError" in outcomes["asks_raises"].message
    assert outcomes["estimates_raise"].status == "error" and "estimate_memory raised ZeroDivisionError" in outcomes["estimates_raise"].message
    code, out, _ = _cli(capsys, "run", _write(tmp_path, raw), "--dry-run")
    assert code == 0 and "broken" in out and "device@w1" in out


# --- writing records (class 8) ---------------------------------------------------------------


def test_a_full_disk_is_reported_once_every_cell_runs_and_what_was_written_is_kept(tmp_path, tiny, monkeypatch):
    scenario, cells = tiny
    real_replace = os.replace
    calls = []

    def full_after_the_first(src, dst):
        calls.append(dst)
        if len(calls) > 1:
            raise OSError(errno.ENOSPC, "No space left on device")
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", full_after_the_first)
    notes, started = [], []
    with pytest.raises(RecordsNotWritten) as err:
        run_cells(scenario, "t.yaml", cells, tmp_path, execute=_ok, on_notice=notes.append, on_start=started.append)
    assert started == cells and len(err.value.records) == 2
    assert notes == [f"cannot write {tmp_path / cells[1].slug}.json: No space left on device"]
    assert "1 of 2 record(s) could not be written" in str(err.value) and cells[1].id in str(err.value)
    assert [p.name for p in tmp_path.iterdir()] == [f"{cells[0].slug}.json"]  # no temp file left behind
    assert load_records(tmp_path)[0].cell_id == cells[0].id


# --- killing the harness (class 1) -----------------------------------------------------------


def _worker_pids(scratch: str, harness: int) -> list[int]:
    """The processes the harness started (its cell server and the cells' ranks): their
    environment names the harness's scratch directory as TMPDIR, as the harness's does."""
    pids = []
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and int(proc.name) != harness and \
                    f"TMPDIR={scratch}\0".encode() in (proc / "environ").read_bytes():
                pids.append(int(proc.name))
        except OSError:
            pass
    return pids


def _wait(condition, timeout: float = 30.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.1)
    return False


def _as_from_a_terminal() -> None:
    """Ctrl-C's default restored in the child: a shell ignores SIGINT in the jobs it starts in
    the background, and Python then never raises KeyboardInterrupt, so the suite run with `&`
    would test nohup's behaviour, not a user's Ctrl-C."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)


@pytest.mark.skipif(not Path("/proc").is_dir(), reason="finds the worker through /proc")
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM, signal.SIGKILL], ids=["ctrl-c", "sigterm", "sigkill"])
@pytest.mark.slow
def test_a_killed_harness_takes_its_hung_worker_and_scratch_directory_with_it(tmp_path, plugin_path, sig):
    scratch = tmp_path / "tmp"
    scratch.mkdir()
    raw = tiny_scenario(run={"time_limit_s": 600}, strategies=[{"name": "sleeps"}], baseline="sleeps")
    harness = subprocess.Popen([sys.executable, "-m", "embbench.cli", "run", str(_write(tmp_path, raw)),
                                "--out", str(tmp_path / "run")], cwd=ROOT, env=dict(os.environ, TMPDIR=str(scratch)),
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               preexec_fn=_as_from_a_terminal)
    try:
        def ranks() -> list[int]:  # forked by the cell server, itself one of the harness's processes
            workers = _worker_pids(str(scratch), harness.pid)
            return [p for p in workers if int((Path("/proc") / str(p) / "stat").read_text().rsplit(")", 1)[1].split()[1])
                    in workers]

        log = tmp_path / "run" / "logs" / "sleeps@w1.rank0.log"  # the rank opens it first thing
        assert _wait(lambda: ranks() and log.exists(), 90), "the worker never started"
        workers = _worker_pids(str(scratch), harness.pid)
        harness.send_signal(sig)
        _, err = harness.communicate(timeout=30)
        assert _wait(lambda: not _worker_pids(str(scratch), harness.pid), 15), "the worker outlived the harness"
        # (torchinductor_<user>: torch's compile cache, shared by design, made by importing torchrec)
        leftovers = lambda: [p for p in scratch.iterdir() if not p.name.startswith("torchinductor_")]  # noqa: E731
        assert _wait(lambda: not leftovers(), 15), leftovers()
        if sig != signal.SIGKILL:
            assert harness.returncode == 130 and "Traceback" not in err
            assert "interrupted: the finished cells' records are kept" in err
    finally:
        harness.kill()
        for pid in _worker_pids(str(scratch), harness.pid) if scratch.exists() else []:
            os.kill(pid, signal.SIGKILL)
    assert workers


# --- under torchrun (class 9) ----------------------------------------------------------------


@pytest.mark.slow
def test_under_torchrun_a_killed_rank_fails_its_cell_and_the_rest_are_recorded_not_run(tmp_path, rank_plugin):
    raw = tiny_scenario(run={"world_size": 2, "time_limit_s": 600},
                        strategies=[{"name": "rank1_dies"}, {"name": "device"}], baseline="rank1_dies")
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "-m",
                           "embbench.cli", "run", str(_write(tmp_path, raw)), "--out", str(out)],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    records = {r.strategy: r for r in load_records(out)}
    assert records["rank1_dies"].status == "error", proc.stderr[-3000:]
    assert records["device"].status == "error" and "not run: the job lost a rank in rank1_dies@w2" in records["device"].message
