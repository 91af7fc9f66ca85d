"""The command line, end to end, as a user runs it."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from embbench.scenario import load_scenario

ROOT = Path(__file__).resolve().parents[1]


def embbench(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "embbench.cli", *args], cwd=ROOT, capture_output=True, text=True, timeout=600)


@pytest.mark.slow
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


@pytest.mark.slow
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


@pytest.mark.slow
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


@pytest.mark.slow
def test_a_criteo_file_runs_end_to_end_and_records_a_replayable_trace(tmp_path):
    from embbench.data.fake_criteo import write_fake_criteo

    data = write_fake_criteo(tmp_path / "train.txt", 3500, seed=2)  # 21 batches of 128 to train on
    cache = tmp_path / "cache"
    scenario = _tsv_scenario_file(tmp_path, {"source": "criteo_tsv", "path": str(data), "eval": 0.2, "min_count": 2},
                                  [{"name": "device"}, {"name": "cpu"}, {"name": "freqcache", "params": {"cache_ratio": 0.2}},
                                   {"name": "colossalai", "params": {"cache_ratio": 0.5}}])
    proc = embbench("run", str(scenario), "--out", str(tmp_path / "run"), "--data-cache", str(cache))
    assert proc.returncode == 0, proc.stderr
    records = [json.loads(p.read_text()) for p in (tmp_path / "run").glob("*.json")]
    assert len(records) == 4 and all(r["status"] == "ok" and 0 < r["metrics"]["accuracy"]["auc"] < 1 for r in records)
    # each cell's evaluation scores beside the records, on the same samples (issue 41: recommend's DeLong test)
    from embbench.eval_scores import read_eval_scores
    from embbench.stats import auc_standard_error

    scored = [read_eval_scores(tmp_path / "run", r["metrics"]["accuracy"]["eval_file"]) for r in records]
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


@pytest.mark.slow
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


def test_run_takes_the_shape_as_flags_into_a_directory_named_after_the_scenario(tmp_path, capsys, monkeypatch):
    """--batch-size and --embedding-dim override the scenario (the bottom MLP's last layer
    follows the dim), commands printed for the run carry them, and the default run directory
    is named after the scenario's name, not its file's."""
    from conftest import tiny_scenario
    from embbench.cli import main
    from embbench.commands import effective_flags, run_command
    from tests.test_trust_rounds import _in_process_cells

    _in_process_cells(monkeypatch)  # the record's scenario is the point, not its measurement
    monkeypatch.chdir(tmp_path)
    path = tmp_path / "a_file_name.yaml"
    path.write_text(yaml.safe_dump(tiny_scenario(name="my scenario", strategies=[{"name": "device"}])))
    assert main(["run", str(path), "--batch-size", "32", "--embedding-dim", "4", "--quiet"]) == 0, capsys.readouterr()
    (run,) = (tmp_path / "results" / "runs").iterdir()
    assert run.name.startswith("my_scenario-")
    (record,) = run.glob("*.json")
    config = json.loads(record.read_text())["scenario"]["config"]
    assert (config["data"]["batch_size"], config["data"]["embedding_dim"], config["model"]["bottom_mlp"]) == (32, 4, [16, 4])
    flags = effective_flags(config)
    assert (flags["batch_size"], flags["embedding_dim"]) == (32, 4)
    assert run_command("s.yaml", batch_size=32, embedding_dim=4) == "embbench run s.yaml --batch-size 32 --embedding-dim 4"


def test_the_data_folder_is_ignored_by_git_and_the_data_package_is_not():
    """Criteo files copied into data/ (as docs/data.md does) never show up as changes."""
    if subprocess.run(["git", "-C", str(ROOT), "rev-parse"], capture_output=True).returncode:
        pytest.skip("not a git checkout")

    def ignored(path: str) -> bool:
        return subprocess.run(["git", "-C", str(ROOT), "check-ignore", "-q", "--no-index", path]).returncode == 0

    assert ignored("data/criteo_kaggle/train.txt") and ignored("data/cache/x.npy")
    assert not ignored("embbench/data/new_source.py")


@pytest.mark.slow
def test_printed_commands_start_with_the_executable_the_user_typed(tmp_path):
    """A command printed to be pasted runs as printed: the console script as typed, or the
    interpreter with -m embbench.cli or -m embbench."""
    import os
    import shlex

    from conftest import tiny_scenario
    from embbench.data.fake_criteo import write_fake_criteo

    script = Path(sys.executable).with_name("embbench")  # where the environment has the console script
    write_fake_criteo(tmp_path / "day_0", 1200)
    scenario, cache = tmp_path / "s.yaml", tmp_path / "cache"
    raw = tiny_scenario()
    raw["data"] = {"source": "criteo_tsv", "path": str(tmp_path / "day_0"), "embedding_dim": 8, "batch_size": 64}
    scenario.write_text(yaml.safe_dump(raw))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    programs = [[sys.executable, "-m", "embbench.cli"], [sys.executable, "-m", "embbench"]]
    for program in programs + ([[str(script)]] if script.exists() else []):
        proc = subprocess.run([*program, "data", "prepare", str(scenario), "--data-cache", str(cache)], cwd=tmp_path,
                              capture_output=True, text=True, timeout=600, env=env)
        assert proc.returncode == 0, proc.stderr
        assert f"run it with: {shlex.join([*program, 'run', str(scenario), '--data-cache', str(cache)])}" in proc.stdout


@pytest.mark.slow  # a fresh interpreter importing embbench (over 3 s on 2 cores)
def test_a_ctrl_c_during_the_interpreter_s_exit_prints_no_traceback(tmp_path):
    """Issue 50, 11: after the command, a Ctrl-C that lands in an exit handler (the third of a
    run's, say) ends the process with 130 and no traceback."""
    script = ("import atexit, os, signal, sys, time\n"
              "atexit.register(lambda: (os.kill(os.getpid(), signal.SIGINT), time.sleep(2)))  # runs at exit\n"
              "from embbench.cli import main\n"
              "sys.argv = ['embbench', 'strategies']\n"
              "sys.exit(main())\n")
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                          cwd=Path(__file__).parents[1])
    assert "Traceback" not in done.stderr and "KeyboardInterrupt" not in done.stderr, done.stderr
    assert done.returncode == 130


@pytest.mark.slow  # interpreters importing embbench
@pytest.mark.parametrize("torchrun", [False, True], ids=["plain", "torchrun-rank"])
def test_the_process_exits_with_the_command_s_code_after_its_exit_functions(torchrun):
    """`python -m embbench` ends through exit_process: in a torchrun rank the interpreter's
    teardown is skipped (torch's C++ threads aborted a rank there), never Python's exit
    functions, the flushed output or the code."""
    script = ("import atexit, sys\nfrom embbench.cli import exit_process\n"
              "atexit.register(lambda: print('exit functions ran'))\nprint('output', end='')\nexit_process(3)\n")
    env = {k: v for k, v in os.environ.items() if k != "TORCHELASTIC_RUN_ID"}
    if torchrun:
        env["TORCHELASTIC_RUN_ID"] = "test"
    proc = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 3 and proc.stdout == "outputexit functions ran\n", (proc.stdout, proc.stderr)
