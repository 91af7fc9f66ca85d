"""The trust rounds (issues 26 and 28): a hostile user's probes of traces, run directories,
flags, the environment, user text on the terminal, printed commands and output files. Each
ends in a one-line message naming what is wrong (exit 2), or in the output the user meant.
"""

from __future__ import annotations

import os
import shlex
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, example, given, settings, strategies as st

from embbench.data.synthetic import Stream, SyntheticCriteo
from embbench.data.presets import make_tables
from embbench.data.trace import record_trace
from tests.conftest import tiny_scenario
from tests.test_hostile_inputs import _cli, _one_clean_line, _wait, _write

ROOT = Path(__file__).resolve().parents[1]


# --- damaged and fractional traces (issue 26) --------------------------------------------------


@pytest.fixture
def trace(tmp_path) -> Path:
    tables = make_tables("criteo_kaggle", 8, scale=1e-5)
    out = tmp_path / "t.npz"
    record_trace(SyntheticCriteo(tables, 7), [t.num_rows for t in tables], 64, 13, 2, out)
    return out


def _trace_scenario(tmp_path: Path, trace: Path) -> Path:
    raw = tiny_scenario(data={"source": "trace", "path": str(trace), "embedding_dim": 8, "batch_size": 64})
    raw["data"] = {k: v for k, v in raw["data"].items() if k not in ("preset", "scale")}
    return _write(tmp_path, raw)


@pytest.mark.parametrize("damage, expected", [
    (lambda data: data[: len(data) // 2], "truncated or damaged .npz trace"),
    (lambda data: data[:-30], "truncated or damaged .npz trace"),
    (lambda data: b"", "an empty file (0 bytes), not an .npz trace"),
], ids=["half", "tail-cut", "empty"])
def test_a_damaged_trace_is_named_by_data_check_and_run(tmp_path, capsys, trace, damage, expected):
    trace.write_bytes(damage(trace.read_bytes()))
    code, _, err = _cli(capsys, "data", "check", trace)
    assert code == 2 and _one_clean_line(err).startswith(f"error: {trace}: {expected}")
    code, _, err = _cli(capsys, "run", _trace_scenario(tmp_path, trace), "--out", tmp_path / "run")
    assert code == 2 and _one_clean_line(err).startswith(f"error: {trace}: {expected}")


def _with_values(trace: Path, values: np.ndarray) -> None:
    arrays = dict(np.load(trace))
    arrays["train_values"] = values
    np.savez(trace, **arrays)


def test_fractional_ids_are_refused_naming_the_array_and_the_element(tmp_path, capsys, trace):
    values = np.load(trace)["train_values"].astype(np.float64)
    values[3] = 3.5
    _with_values(trace, values)
    code, _, err = _cli(capsys, "data", "check", trace)
    assert code == 2 and _one_clean_line(err) == (
        f"error: {trace}: train_values[3] = 3.5 is not an integer (train_values must hold integers, not float64)")
    code, _, err = _cli(capsys, "run", _trace_scenario(tmp_path, trace), "--out", tmp_path / "run")
    assert code == 2 and "train_values[3] = 3.5 is not an integer" in _one_clean_line(err)


def test_integral_float_ids_are_converted_and_said_so(tmp_path, capsys, trace):
    ids = np.load(trace)["train_values"]
    _with_values(trace, ids.astype(np.float32))
    code, out, err = _cli(capsys, "data", "check", trace)
    assert code == 0 and "a valid trace" in out
    assert _one_clean_line(err) == f"note: {trace}: train_values is float32 holding only integers; converted to int64"
    from embbench.data.trace import Trace

    assert np.array_equal(Trace(trace).streams[Stream.TRAIN]["values"], ids)


# --- two runs into one --out (issue 26) --------------------------------------------------------


def _embbench(*argv) -> list[str]:
    return [sys.executable, "-m", "embbench.cli", *map(str, argv)]


@pytest.mark.slow
def test_a_second_run_into_the_same_out_is_refused_and_a_killed_one_leaves_no_stale_lock(tmp_path, plugin_path):
    raw = tiny_scenario(run={"time_limit_s": 600}, strategies=[{"name": "device"}, {"name": "sleeps"}])
    scenario, out = _write(tmp_path, raw), tmp_path / "run"
    first = subprocess.Popen(_embbench("run", scenario, "--out", out), cwd=ROOT, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    try:
        assert _wait(lambda: (out / "device@w1.json").exists(), 600), first.communicate(timeout=5)  # a healthy cell: no tight bound
        second = subprocess.run(_embbench("run", scenario, "--out", out), cwd=ROOT, capture_output=True, text=True,
                                timeout=120)
        assert second.returncode == 2
        assert _one_clean_line(second.stderr) == f"error: another run is writing to {out}/ (pid {first.pid})"
        first.kill()  # SIGKILL: no cleanup runs; the kernel drops the lock with the process
        first.wait(timeout=30)
    finally:
        first.kill()
    resumed = subprocess.run(_embbench("run", scenario, "--out", out, "--resume", "--strategies", "device"), cwd=ROOT,
                             capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0 and "kept from the run directory: device@w1" in resumed.stdout, resumed.stderr[-2000:]


# --- flags, the environment and stdout (issue 28) ----------------------------------------------


@pytest.mark.parametrize("env, expected", [
    ({"TORCHELASTIC_RUN_ID": "1", "WORLD_SIZE": "2"},
     "error: environment: TORCHELASTIC_RUN_ID, WORLD_SIZE set but RANK, LOCAL_RANK, MASTER_ADDR, MASTER_PORT not: "
     "a partial torchrun environment (start the job with torchrun, or unset TORCHELASTIC_RUN_ID, WORLD_SIZE)"),
    ({"WORLD_SIZE": "2", "RANK": "0"}, "TORCHELASTIC_RUN_ID, LOCAL_RANK, MASTER_ADDR, MASTER_PORT not"),
    ({"TORCHELASTIC_RUN_ID": "1", "RANK": "one", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "h",
      "MASTER_PORT": "1"}, "error: environment: RANK='one' is not an integer"),
    ({"TORCHELASTIC_RUN_ID": "1", "RANK": "2", "WORLD_SIZE": "2", "LOCAL_RANK": "0", "MASTER_ADDR": "h",
      "MASTER_PORT": "1"}, "need 0 <= RANK < WORLD_SIZE"),
], ids=["no-rank", "no-run-id", "rank-word", "rank-too-big"])
def test_a_partial_torchrun_environment_is_named(tmp_path, capsys, monkeypatch, env, expected):
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    code, _, err = _cli(capsys, "run", _write(tmp_path, tiny_scenario()), "--out", tmp_path / "run")
    assert code == 2 and expected in _one_clean_line(err)
    assert not (tmp_path / "run").exists()


@pytest.fixture
def a_run(tmp_path) -> Path:
    from tests.record_factory import make_record, write_run

    return write_run(tmp_path / "a run", [make_record("device"), make_record("cpu")])


@pytest.mark.slow
def test_a_closed_stdout_is_one_line(a_run):
    proc = subprocess.run(_embbench("show", a_run), cwd=ROOT, capture_output=False,
                          stderr=subprocess.PIPE, text=True, preexec_fn=lambda: os.close(1), timeout=120)
    assert proc.returncode == 2
    assert _one_clean_line(proc.stderr) == ("error: standard output is closed; embbench show prints its results there "
                                            "(redirect it to a file or /dev/null instead)")


@pytest.mark.parametrize("flags", [[], ["--csv"]], ids=["table", "csv"])
@pytest.mark.slow
def test_a_pipe_closed_early_ends_quietly(a_run, flags):
    """`show --csv | head`: the reader has what it wanted; exit 141 as SIGPIPE would, nothing said (issue 49)."""
    proc = subprocess.Popen(_embbench("show", a_run, *flags), cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    proc.stdout.close()  # `| head` that has read enough, before anything was written
    err = proc.stderr.read()
    assert proc.wait(timeout=120) == 141
    assert err == ""


# --- user text is never markup (issue 28) -------------------------------------------------------


def _flat(text: str) -> str:
    """Output with line breaks and padding removed (a long title may wrap)."""
    return "".join(text.split())


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(name=st.text(alphabet="ab[]/\\:x#=@", min_size=1, max_size=12))
@example(name="a[/tmp]")
@example(name="a[bold]b")
@example(name=":x:")
@example(name="a\\")
@example(name="\\[b]")
@pytest.mark.slow
def test_names_and_paths_with_brackets_and_backslashes_reach_the_terminal_unchanged(tmp_path, capsys, monkeypatch, name):
    _in_process_cells(monkeypatch)
    tmp_path = Path(tempfile.mkdtemp(dir=tmp_path))  # one per example: names like ":" and ":/" share a path
    scenario = _write(tmp_path, tiny_scenario(name=name))
    out = tmp_path / ("o" + name) / "run"
    code, text, err = _cli(capsys, "run", scenario, "--dry-run")
    assert code == 0 and f"{name}: 2 cells (nothing is run)" in text, err
    code, text, err = _cli(capsys, "run", scenario, "--out", out, "--quiet")
    assert code == 0, err
    assert _flat(f"{name}: 2 cells -> {out}") in _flat(text) and _flat(f"records: {out}") in _flat(text)
    assert _flat(name) in _flat(text.split("cells ->")[1])  # the table's title
    code, text, err = _cli(capsys, "show", out)
    assert code == 0 and _flat(str(out)) in _flat(text), err


# --- printed commands run as printed (issue 28) ---------------------------------------------------


def _in_process_cells(monkeypatch, device_bytes=lambda cell: 0, interrupt: bool = False):
    """``embbench run`` without processes: each cell 'measures' at once (``device_bytes`` its memory)."""
    from embbench.cli import run as run_command
    from embbench.launch import CellOutcome, run_cells
    from tests.record_factory import make_record

    def measure(cell, weights):
        if interrupt:
            raise KeyboardInterrupt
        metrics = make_record().metrics  # a complete record's measurements (the schema checks them)
        metrics["memory"] = {**metrics["memory"], "static_device_bytes": device_bytes(cell)}
        return CellOutcome("ok", None, metrics)

    monkeypatch.setattr(run_command, "run_cells", lambda *a, **kw: run_cells(*a, **{**kw, "execute": measure}))


def _parsed(command: str):
    from embbench.cli import build_parser

    argv = shlex.split(command)
    assert argv[:2] == ["embbench", "run"], command
    return build_parser().parse_args(argv[1:])


def test_recommends_command_carries_the_runs_steps_scale_and_quoted_path(tmp_path, capsys, monkeypatch):
    raw = tiny_scenario(strategies=[{"name": "device"}, {"name": "freqcache", "params": {"cache_ratio": [0.1, 0.2]}}])
    scenario, run = _write(tmp_path, raw, "my scenario.yaml"), tmp_path / "a run"
    _in_process_cells(monkeypatch, lambda cell: int((10 + 1000 * cell.params.get("cache_ratio", 1)) * 2**20))
    assert _cli(capsys, "run", scenario, "--steps", "6", "--scale", "0.0003", "--out", run)[0] == 0
    code, out, err = _cli(capsys, "recommend", run, "--device-memory", "60MiB")
    assert code == 0, err
    lines = out.splitlines()
    command = lines[next(i for i, line in enumerate(lines) if "to measure it:" in line) + 1].strip()
    args = _parsed(command)
    assert (Path(args.scenario), args.steps, args.scale, args.strategies, Path(args.out), args.resume) == (
        scenario, 6, 0.0003, ["freqcache"], run, True)


def test_recommends_suggestion_followed_as_printed_adds_the_cell_and_reuses_the_others(tmp_path, capsys, monkeypatch):
    """"add 0.05 to ...'s cache_ratio list in S, then <command>": the edited scenario is the same
    scenario for the run directory (its strategy list is not what a cell's measurement depends on)."""
    raw = tiny_scenario(strategies=[{"name": "device"}, {"name": "freqcache", "params": {"cache_ratio": [0.1, 0.2]}}])
    scenario, run = _write(tmp_path, raw, "s.yaml"), tmp_path / "run"
    measured = []

    def device_bytes(cell):
        measured.append(cell.id)
        return int((10 + 1000 * cell.params.get("cache_ratio", 1)) * 2**20)

    _in_process_cells(monkeypatch, device_bytes)
    assert _cli(capsys, "run", scenario, "--steps", "6", "--out", run)[0] == 0
    before = sorted(p.name for p in run.glob("*.json"))
    code, out, err = _cli(capsys, "recommend", run, "--device-memory", "60MiB")
    lines = out.splitlines()
    at = next(i for i, line in enumerate(lines) if "to measure it:" in line)
    ratio = float(lines[at].split("add ")[1].split(" ")[0])
    raw["strategies"][1]["params"]["cache_ratio"].append(ratio)  # the edit, as printed
    _write(tmp_path, raw, "s.yaml")
    measured.clear()
    code, _, err = _cli(capsys, *shlex.split(lines[at + 1].strip())[1:])
    assert code == 0, err
    assert measured == [f"freqcache[cache_ratio={ratio:g}]@w1"], "only the suggested cell runs; the others are reused"
    assert len(list(run.glob("*.json"))) == len(before) + 1


def test_an_interrupted_run_prints_the_command_that_resumes_it(tmp_path, capsys, monkeypatch):
    scenario, run = _write(tmp_path, tiny_scenario(), "s c.yaml"), tmp_path / "my run"
    _in_process_cells(monkeypatch, interrupt=True)
    code, _, err = _cli(capsys, "run", scenario, "--steps", "4", "--scale", "0.0003", "--strategies", "cpu",
                        "--out", run, "--data-cache", tmp_path / "a cache")
    assert code == 130
    args = _parsed(_one_clean_line(err).split("this runs the others: ")[1])
    assert (Path(args.scenario), args.steps, args.scale, args.strategies, Path(args.out), Path(args.data_cache),
            args.resume) == (scenario, 4, 0.0003, ["cpu"], run, tmp_path / "a cache", True)


def test_data_prepare_prints_the_run_that_reads_its_cache(tmp_path, capsys, monkeypatch):
    from embbench.data.fake_criteo import write_fake_criteo

    monkeypatch.setenv("EMBBENCH_DATA_CACHE", "")  # prepare sets it; the monkeypatch restores it
    write_fake_criteo(tmp_path / "day 0", 1500)  # the run reads 16 batches of 64 for training
    raw = tiny_scenario(data={"source": "criteo_tsv", "path": str(tmp_path / "day 0"), "eval": 0.25, "embedding_dim": 8,
                              "batch_size": 64, "preset": "criteo_kaggle", "scale": 1.0})
    scenario, cache = _write(tmp_path, raw, "my s.yaml"), tmp_path / "a cache"
    code, out, err = _cli(capsys, "data", "prepare", scenario, "--data-cache", cache)
    assert code == 0, err
    args = _parsed(out.split("run it with: ")[1].strip())
    assert (Path(args.scenario), Path(args.data_cache)) == (scenario, cache)


# --- no output flag overwrites a file it did not make (issue 28) ----------------------------------


def test_report_never_replaces_a_record_or_a_file_it_did_not_make(a_run, capsys):
    record = a_run / "device@w1.json"
    before = record.read_bytes()
    code, _, err = _cli(capsys, "report", a_run, "--out", record)
    assert code == 2 and _one_clean_line(err) == (
        f"error: --out {record}: is a result record; only `embbench run` writes records: give another file name")
    code, _, err = _cli(capsys, "report", a_run, "--out", record, "--overwrite")
    assert code == 2 and "is a result record" in _one_clean_line(err) and record.read_bytes() == before
    notes = a_run.parent / "notes.html"
    notes.write_text("<html>my notes</html>")
    code, _, err = _cli(capsys, "report", a_run, "--out", notes)
    assert code == 2 and _one_clean_line(err) == (f"error: --out {notes}: exists and was not made by `embbench report`; "
                                                  "give another file name, or --overwrite to replace it")
    assert notes.read_text() == "<html>my notes</html>"
    report = a_run.parent / "report.html"
    assert _cli(capsys, "report", a_run, "--out", report)[0] == 0
    assert _cli(capsys, "report", a_run, "--out", report)[0] == 0  # its own earlier report
    assert _cli(capsys, "report", a_run, "--out", notes, "--overwrite")[0] == 0 and "my notes" not in notes.read_text()


def test_trace_record_never_replaces_a_record_or_a_file_it_did_not_make(tmp_path, capsys, a_run, trace):
    scenario = _write(tmp_path, tiny_scenario())
    for target, expected in ((a_run / "cpu@w1.json", "is a result record"),
                             (_write(tmp_path, {"mine": 1}, "ids.npz"), "exists and was not made by `embbench trace record`")):
        before = target.read_bytes()
        code, _, err = _cli(capsys, "trace", "record", scenario, "--out", target, "--train-batches", "1")
        assert code == 2 and _one_clean_line(err).startswith(f"error: --out {target}: {expected}")
        assert target.read_bytes() == before
    assert _cli(capsys, "trace", "record", scenario, "--out", trace, "--train-batches", "1")[0] == 0  # a trace: replaced


def test_profile_never_replaces_a_file_it_did_not_make(tmp_path, capsys):
    out = tmp_path / "run"
    (out / "profiles").mkdir(parents=True)
    mine = out / "profiles" / "device@w1.trace.json"
    mine.write_text("my own notes")
    code, _, err = _cli(capsys, "run", _write(tmp_path, tiny_scenario()), "--out", out, "--profile")
    assert code == 2 and _one_clean_line(err).startswith(f"error: --profile {mine}: exists and was not made by")
    assert mine.read_text() == "my own notes"


def test_the_sweep_never_replaces_a_file_it_did_not_make(tmp_path, capsys):
    from embbench.cache.sweep import main as sweep_main

    target = _write(tmp_path, {"mine": 1}, "results.json")
    assert sweep_main([str(ROOT / "scenarios" / "sweeps" / "freqcache_policy_history.yaml"), "--out", str(target)]) == 2
    assert "exists and was not made by" in _one_clean_line(capsys.readouterr().err)
