"""Trust round 6 (issue 40): every file the harness reads is checked as a record is
(:mod:`embbench.inputs`), every file it leaves is written whole (:func:`embbench.outputs.atomic_write`),
every bound is finite (:mod:`embbench.bounds`).

Every probe runs in this process and starts no cell's processes.
"""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from embbench.cli import main
from tests.record_factory import make_record, write_run


def _cli(capsys, *argv) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def _disk_full_at_sync(monkeypatch):
    import errno

    def full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)


# --- 1. a cache curve file is checked as a record is --------------------------------------------


def _curve() -> dict:
    from embbench.cache.curve import measure

    rng = np.random.default_rng(0)
    steps = [rng.integers(0, 300, 64) for _ in range(6)]
    return measure(steps, {"t0": 100, "t1": 200}, (0.01, 0.1, 0.5), ("lru", "freqcache", "min"), skip=2)


def _edit(curve: dict, change) -> dict:
    curve = copy.deepcopy(curve)
    change(curve)
    return curve


_DAMAGED_CURVES = [
    (lambda c: c["scopes"].pop(0), "scopes: are ['t0', 't1']; expected all and then each table (t0, t1)"),
    (lambda c: c.pop("scopes"), "scopes: Field required"),
    (lambda c: c.update(ratios=["0.01", "0.1", "0.5"]), "ratios.0: Input should be a valid number"),
    (lambda c: c.update(ratios=[0.01, 0.1]), "scopes.0.capacity: 3 values for 2 ratios"),
    (lambda c: c["scopes"][0]["policies"]["lru"].update(hit_rate=[None, None, None]),
     "scopes.0.policies.lru.hit_rate: null where every ratio was measured"),
    (lambda c: c["scopes"][1]["policies"]["min"].update(unique_hit_rate=[0.1, 1.5, 0.2]),
     "scopes.1.policies.min.unique_hit_rate.1: Input should be less than or equal to 1"),
    (lambda c: c.update(ratios=[0.5, 0.1, 0.01]), "ratios: [0.5, 0.1, 0.01] do not ascend"),
]


@pytest.mark.parametrize("change, expected", _DAMAGED_CURVES)
def test_a_damaged_curve_is_refused_naming_the_file_and_the_key(tmp_path, capsys, change, expected):
    from embbench.cache.curve import read_curve

    path = tmp_path / "curve.json"
    path.write_text(json.dumps(_edit(_curve(), change)))
    with pytest.raises(ValueError) as e:
        read_curve(path)
    assert str(e.value).startswith(f"{path}: {expected}")
    run = write_run(tmp_path / "run", [make_record("device"), make_record("cpu", step_times=[0.02] * 12)])
    code, _, err = _cli(capsys, "recommend", run, "--device-memory", "1GiB", "--curve", path)
    assert code == 2 and err.count("\n") == 1 and err.startswith(f"error: {path}: {expected}")


def test_a_curve_in_bytes_that_are_not_utf8_is_named(tmp_path):
    from embbench.cache.curve import read_curve

    path = tmp_path / "curve.json"
    path.write_bytes(b'{"format": "embbench-curve-1", "\xff": 1}')
    with pytest.raises(ValueError, match=rf"^{path}: line 1: not UTF-8 text \(byte 0xff at offset 32\)$"):
        read_curve(path)


def test_a_damaged_curve_beside_a_run_costs_the_reports_plot_not_the_report(tmp_path, capsys):
    run = write_run(tmp_path / "run", [make_record("device"), make_record("cpu", step_times=[0.02] * 12)])
    (run / "curve.json").write_text(json.dumps(_edit(_curve(), lambda c: c["scopes"].pop(0))))
    code, _, err = _cli(capsys, "report", run, "--out", tmp_path / "r.html")
    assert code == 0 and (tmp_path / "r.html").is_file()
    assert err == (f"warning: {run / 'curve.json'}: scopes: are ['t0', 't1']; expected all and then each table (t0, t1) "
                   "(a damaged curve file; write one with `embbench curve --out`); the report has no cache curve\n")
    assert "expected all and then each table" in (tmp_path / "r.html").read_text()


_JSON = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=4),
                     lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3),
                     max_leaves=6)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(where=st.lists(st.integers(0, 50), min_size=1, max_size=4), value=_JSON)
def test_any_value_anywhere_in_a_curve_is_read_or_refused_by_name(tmp_path, where, value):
    """Whatever replaces a part of a valid curve, read_curve returns a curve the readers can use
    (its table, its knee, torchrec's statistics) or raises one ValueError naming the file."""
    from embbench.cache.curve import knee, read_curve
    from embbench.cache.curve_scenario import curve_tables

    curve = _curve()
    node = curve
    for step in where:  # walk down to a random part, then replace it
        keys = list(node) if isinstance(node, dict) else list(range(len(node)))
        key = keys[step % len(keys)]
        if not isinstance(node[key], (dict, list)) or not node[key] or step == where[-1]:
            node[key] = value
            break
        node = node[key]
    path = tmp_path / "curve.json"
    path.write_text(json.dumps(curve))
    try:
        read = read_curve(path)
    except ValueError as e:
        assert str(e).startswith(f"{path}: ") and "\n" not in str(e)
        return
    curve_tables(read)
    knee(read)


# --- 4. data import-tbe: the bounds of a scenario, per list item ---------------------------------


def _tbe(tmp_path: Path, text: str | bytes | None = None, **changes) -> Path:
    def fit(s):
        return {"heavy_hitters": [0.2], "zipf_q": 0.5, "zipf_s": s}

    raw = {"T": 2, "E": 1000, "D": 16, "batch_params": {"B": 512}, "indices_params": fit(1.1),
           "pooling_params": {"L": 2, "Ls": [1.0, 3.0]}, "Es": [1000, 300], "Ds": [16, 16],
           "indices_params_list": [fit(1.05), fit(0.8)], **changes}
    path = tmp_path / "tbe-op-config-estimation-100.json"
    data = json.dumps(raw) if text is None else text
    path.write_bytes(data if isinstance(data, bytes) else data.encode())
    return path


@pytest.mark.parametrize("changes, expected", [
    ({"indices_params_list": [{"zipf_q": 0.5, "zipf_s": 1.0}, {"zipf_q": 0.5, "zipf_s": float("inf")}]},
     "indices_params_list.1.zipf_s: Input should be a finite number"),
    ({"Es": [0, -5]}, "Es.0: Input should be greater than 0 (and 1 more)"),
    ({"E": 10**30}, "E: Input should be less than 9223372036854775808"),
    ({"batch_params": {"B": True}}, "batch_params.B: Input should be a valid integer"),
    ({"pooling_params": {"L": 2, "Ls": [1.0, float("nan")]}}, "pooling_params.Ls.1: Input should be a finite number"),
], ids=["zipf-s-infinite", "rows-0", "rows-1e30", "batch-true", "bag-nan"])
def test_a_tbe_report_is_held_to_a_scenarios_bounds_item_by_item(tmp_path, capsys, changes, expected):
    path = _tbe(tmp_path, **changes)
    code, out, err = _cli(capsys, "data", "import-tbe", path)
    assert code == 2 and out == "" and err == f"error: {path}: {expected} (not an fbgemm TBE input report?)\n"


def test_a_scenarios_tables_share_the_bound_on_rows(tmp_path):
    from embbench.scenario import ScenarioError, parse_scenario
    from tests.conftest import tiny_scenario

    raw = tiny_scenario(data={"tables": [{"rows": 10**30}]})
    raw["data"].pop("preset", None)
    with pytest.raises(ScenarioError, match=r"^t\.yaml: data\.tables\[0\]\.rows: Input should be less than 9223372036854775808"):
        parse_scenario(raw, "t.yaml")


def _fifo(tmp_path: Path, name: str) -> Path:
    os.mkfifo(tmp_path / name)
    return tmp_path / name


@pytest.mark.parametrize("argv, name, what", [
    (("data", "import-tbe", "{path}"), "tbe.json", "TBE input report"),
    (("recommend", "{run}", "--device-memory", "1GiB", "--curve", "{path}"), "curve.json", "curve file"),
])
def test_a_fifo_is_refused_by_name_never_read(tmp_path, capsys, argv, name, what):
    path = _fifo(tmp_path, name)
    run = write_run(tmp_path / "run", [make_record("device")])
    code, _, err = _cli(capsys, *(a.format(path=path, run=run) for a in argv))
    assert code == 2 and err == (f"error: {path}: is a FIFO, not a regular file (a {what} is read from a file; "
                                 "this one would block or never end)\n")


def test_a_tbe_report_in_bytes_that_are_not_utf8_is_named(tmp_path, capsys):
    path = _tbe(tmp_path, text=b'{"T": 2, "\xfe": 1}')
    code, _, err = _cli(capsys, "data", "import-tbe", path)
    assert code == 2 and err == f"error: {path}: line 1: not UTF-8 text (byte 0xfe at offset 10)\n"


# --- 2. metrics.noise is declared in the record schema --------------------------------------------


@pytest.mark.parametrize("noise, expected", [
    ("busy", "metrics.noise: Input should be a valid dictionary"),
    ([0.5], "metrics.noise: Input should be a valid dictionary"),
    ({"gpu_other_processes": {"a": 1}}, "metrics.noise.gpu_other_processes: Input should be a valid integer"),
    ({"others_cpu_share": "high"}, "metrics.noise.others_cpu_share: Input should be a valid number"),
    ({"load_1min": [1.0, -2.0]}, "metrics.noise.load_1min.1: Input should be greater than or equal to 0"),
])
def test_a_records_noise_is_checked_as_its_other_figures_are(tmp_path, capsys, noise, expected):
    records = [make_record("device"), make_record("cpu", step_times=[0.02] * 12)]
    run, other = (write_run(tmp_path / name, records) for name in ("run", "other"))
    data = json.loads((run / "cpu@w1.json").read_text())
    data["metrics"]["noise"] = noise
    (run / "cpu@w1.json").write_text(json.dumps(data))
    for argv in (("show", run), ("compare", other, run)):
        code, _, err = _cli(capsys, *argv)
        assert code in (0, 3) and err.startswith(f"warning: {run / 'cpu@w1.json'}: {expected}"), err


def test_a_noise_sample_as_the_runner_writes_it_validates():
    from embbench.noise import noise_floor, sample
    from embbench.results import Record

    record = make_record("device")
    record.metrics["noise"] = noise_floor(sample(), sample(), 0.0)
    Record.model_validate(record.model_dump())


# --- 3. trace import-dlrm checks its tensors and writes whole -------------------------------------


def _dlrm(tmp_path: Path, indices, lengths, name: str = "b.pt") -> Path:
    import torch

    lengths = torch.as_tensor(lengths, dtype=torch.long)
    offsets = torch.cat([torch.zeros(1, dtype=torch.long), torch.cumsum(lengths.reshape(-1), 0)])
    path = tmp_path / name
    torch.save((torch.as_tensor(indices, dtype=torch.long), offsets, lengths), path)
    return path


@pytest.mark.parametrize("make, expected", [
    (lambda tmp: _dlrm(tmp, [1, 2, 3, 4], [[3, -1], [1, 1]]), "lengths[0, 1] = -1 is negative"),
    (lambda tmp: (tmp / "b.pt").write_bytes(b"") or tmp / "b.pt", "an empty file (0 bytes), not a torch file"),
    (lambda tmp: _dlrm(tmp, [2**63 - 1], [[1]]),
     f"indices[0] = {2**63 - 1} is too large: a table holds fewer than 2^63 rows, so an id is at most {2**63 - 2}"),
    (lambda tmp: _dlrm(tmp, [], np.zeros((0, 4))), "lengths has shape [0, 4]: a batch of no tables or no samples"),
    (lambda tmp: _fifo(tmp, "b.pt"), "is a FIFO, not a regular file (a dlrm_datasets batch is read from a file; "
                                     "this one would block or never end)"),
], ids=["negative-lengths", "empty", "id-2^63-1", "no-tables", "fifo"])
def test_a_dlrm_batch_is_checked_before_it_becomes_a_trace(tmp_path, capsys, make, expected):
    path = make(tmp_path)
    code, _, err = _cli(capsys, "trace", "import-dlrm", path, "--out", tmp_path / "t.npz")
    assert code == 2 and err == f"error: {path}: {expected}\n"
    assert not (tmp_path / "t.npz").exists()


def test_the_largest_id_imports_into_a_trace_embbench_reads(tmp_path, capsys):
    from embbench.data.trace import Trace

    path = _dlrm(tmp_path, [2**63 - 2, 0], [[1], [1]])
    code, _, err = _cli(capsys, "trace", "import-dlrm", path, "--out", tmp_path / "t.npz")
    assert code == 0 and err == ""
    assert Trace(tmp_path / "t.npz").num_rows.tolist() == [2**63 - 1, 1]


def test_trace_import_on_a_full_disk_leaves_no_file_and_names_it(tmp_path, capsys, monkeypatch):
    path = _dlrm(tmp_path, [1, 2], [[1], [1]])
    out = tmp_path / "out"
    out.mkdir()
    _disk_full_at_sync(monkeypatch)
    code, _, err = _cli(capsys, "trace", "import-dlrm", path, "--out", out / "t.npz")
    assert code == 2 and "No space left on device" in err and str(out / "t.npz") in err
    assert list(out.iterdir()) == []


def test_data_check_refuses_a_fifo_trace_by_name(tmp_path, capsys):
    path = _fifo(tmp_path, "t.npz")
    code, _, err = _cli(capsys, "data", "check", path)
    assert code == 2 and err == (f"error: {path}: is a FIFO, not a regular file (a trace is read from a file; "
                                 "this one would block or never end)\n")


# --- 5, 6, 7. embbench curve: its own reads, its flags, its --out ----------------------------------


def _scenario_file(tmp_path: Path, raw: dict, name: str = "t.yaml") -> Path:
    import yaml

    path = tmp_path / name
    path.write_text(yaml.safe_dump(raw))
    return path


@pytest.fixture
def tiny(tmp_path) -> Path:
    from tests.conftest import tiny_scenario

    return _scenario_file(tmp_path, tiny_scenario())


def test_the_curve_needs_the_batches_it_reads_not_those_a_run_would(tmp_path, capsys, tiny):
    from tests.conftest import tiny_scenario

    code, _, err = _cli(capsys, "trace", "record", tiny, "--out", tmp_path / "t.npz", "--train-batches", "12",
                        "--eval-batches", "0")
    assert code == 0, err  # trace record, too, needs what it records (12 batches), not a run's
    raw = tiny_scenario(data={"source": "trace", "path": str(tmp_path / "t.npz"), "embedding_dim": 8, "batch_size": 64},
                        run={"steps": 10, "repeats": 5})  # a run would read 56 batches
    del raw["data"]["preset"], raw["data"]["scale"]
    scenario = _scenario_file(tmp_path, raw, "trace.yaml")
    code, out, err = _cli(capsys, "curve", scenario, "--warmup", "4", "--steps", "8", "--policies", "lru,min")
    assert code == 0 and err == "" and "8 batches after 4 of warm-up" in " ".join(out.split()), err
    code, _, err = _cli(capsys, "curve", scenario, "--warmup", "4", "--steps", "9", "--policies", "lru")
    assert code == 2 and err == (f"error: data.path {tmp_path / 't.npz'}: the train stream has 768 rows; this command "
                                 "needs 832 (13 batches of 64). Set data.epochs: 2 to read it 2 times, or ask for fewer steps\n")


def test_a_curve_of_freqcache_alone_is_shown(capsys, tiny):
    code, out, err = _cli(capsys, "curve", tiny, "--warmup", "2", "--steps", "2", "--policies", "freqcache",
                          "--sizes", "0.05,0.2")
    assert code == 0 and err == "" and "freqcache" in out


@pytest.mark.parametrize("argv, expected", [
    (("--sizes", "0.05,0.2", "--freqcache-sizes", "0.1"),
     "error: --freqcache-sizes 0.1: not among --sizes 0.05,0.2; freqcache is driven at sizes of the curve\n"),
    (("--steps", "1000000000"), "argument --steps: must be at most 10000, got 1000000000"),
    (("--warmup", "10001"), "argument --warmup: must be at most 10000, got 10001"),
])
def test_curve_flags_are_bounded_and_none_is_silently_ignored(capsys, tiny, argv, expected):
    try:
        code, _, err = _cli(capsys, "curve", tiny, *argv)
    except SystemExit as e:  # argparse
        code, err = e.code, capsys.readouterr().err
    assert code == 2 and expected in err


def test_curve_out_on_a_full_disk_leaves_no_file_and_names_it(tmp_path, capsys, monkeypatch, tiny):
    out = tmp_path / "out"
    out.mkdir()
    _disk_full_at_sync(monkeypatch)
    code, _, err = _cli(capsys, "curve", tiny, "--warmup", "1", "--steps", "2", "--policies", "lru",
                        "--out", out / "c.json")
    assert code == 2 and err == f"error: [Errno 28] cannot write the curve: No space left on device: '{out / 'c.json'}'\n"
    assert list(out.iterdir()) == []


# --- 8, 9. every bound finite, every count bounded ------------------------------------------------


@pytest.mark.parametrize("argv, expected", [
    (["nan", "--rehearse"], "argument seconds: must be at least 0, got nan"),
    (["inf", "--rehearse"], "argument seconds: must be a finite number, got inf"),
    (["60", "--spent", "nan"], "argument --spent: must be at least 0, got nan"),
])
def test_a_gpu_sessions_budget_is_a_finite_number(capsys, argv, expected):
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "scripts"))
    import gpu_session

    with pytest.raises(SystemExit) as e:
        gpu_session.main(argv)
    assert e.value.code == 2 and expected in capsys.readouterr().err


@pytest.mark.parametrize("threads", [2**63, 4097, 0])
def test_run_threads_is_bounded_before_anything_runs(tmp_path, capsys, threads):
    from tests.conftest import tiny_scenario

    path = _scenario_file(tmp_path, tiny_scenario(run={"threads": threads}))
    code, _, err = _cli(capsys, "run", path, "--dry-run")
    assert code == 2 and err == f"error: {path}: run.threads: must be 'auto' or from 1 to 4096, got {threads}\n"


# --- 10. setup_env.sh says why when torch does not import -----------------------------------------


def test_setup_env_names_a_torch_that_installs_but_does_not_import(tmp_path):
    import subprocess

    root = Path(__file__).resolve().parent.parent
    venv = tmp_path / "venv"
    (venv / "bin").mkdir(parents=True)
    (venv / "bin" / "python").write_text(  # pip "installs"; torch's import fails as a broken wheel does
        '#!/bin/bash\nif [ "$1" = "-c" ]; then\n  case "$2" in *"import torch"*)\n'
        '    echo "OSError: libtorch_cpu.so: cannot open shared object file" >&2; exit 1;; esac\n  exit 0\nfi\n')
    (venv / "bin" / "python").chmod(0o755)
    env = {**os.environ, "PATH": "/usr/bin:/bin", "EMBBENCH_VENV": str(venv), "EMBBENCH_TORCH": "torch==2.11.0"}
    out = subprocess.run(["bash", str(root / "scripts" / "setup_env.sh")], env=env, capture_output=True, text=True,
                         timeout=60)
    assert out.returncode == 1
    assert f"setup_env: torch==2.11.0 is installed in {venv} but does not import" in out.stderr
    assert "OSError: libtorch_cpu.so: cannot open shared object file" in out.stderr


# --- 11. a plugin's row_precisions is checked when it is loaded -----------------------------------


def _plugin(tmp_path, monkeypatch, body: str, module: str = "rp_plugin"):
    from tests.conftest import _install_plugin

    _install_plugin(tmp_path / "site", module, {"rp": f"{module}:Rp"}, f"""
        from baselines.tables import DeviceStrategy

        class Rp(DeviceStrategy):
            name = "rp"
{body}
        """, monkeypatch)


@pytest.fixture
def fresh_strategies():
    from embbench.strategy import load_strategies

    load_strategies.cache_clear()
    yield
    load_strategies.cache_clear()


@pytest.mark.parametrize("declared", ['"fp16"', "()", '("fp32", "fp64")', "None"])
def test_a_plugins_row_precisions_is_checked_when_it_is_loaded(tmp_path, monkeypatch, fresh_strategies, declared):
    from embbench.strategy import broken_strategies, load_strategies

    module = f"rp_plugin_{abs(hash(declared))}"  # a module of its own: Python caches one it imported
    _plugin(tmp_path, monkeypatch, f"            row_precisions = {declared}\n", module)
    assert "rp" not in load_strategies()
    assert broken_strategies()["rp"] == (f"strategy 'rp' ({module}:Rp): row_precisions must be a non-empty tuple of "
                                         f"fp32, fp16, bf16, fp8; got {eval(declared)!r}")


def test_the_hook_that_raised_is_named(tmp_path, monkeypatch, fresh_strategies):
    from embbench.launch import outcome_without_launch
    from embbench.scenario import parse_scenario
    from tests.conftest import tiny_scenario

    _plugin(tmp_path, monkeypatch, "            row_precisions = ('fp32', 'fp16')\n\n"
                                   "            def row_precision_reason(self, precision, env):\n"
                                   "                raise RuntimeError('no table yet')\n", "rp_plugin_hook")
    scenario, cells = parse_scenario(tiny_scenario(baseline="rp", strategies=[{"name": "rp"}]), "t.yaml")
    outcome = outcome_without_launch(scenario, cells[0])
    assert outcome.status == "error"
    assert outcome.message == "strategy 'rp': row_precision_reason raised RuntimeError: no table yet"


# --- 12. a cell in another precision says why it has no distance from fp32 -------------------------


@pytest.mark.parametrize("precisions, expected", [
    (["fp16"], "no flushed weights of device@w1 in this run (fp32 is not in run.row_precision, or that cell did not end ok)"),
    (["fp32", "fp16"], None),
])
def test_a_cell_without_an_fp32_cell_records_why(tmp_path, precisions, expected):
    import torch

    from embbench.launch import CellOutcome, run_cells
    from embbench.scenario import parse_scenario
    from tests.conftest import tiny_scenario

    raw = tiny_scenario(run={"row_precision": precisions, "compare_weights": True}, strategies=[{"name": "device"}])
    scenario, cells = parse_scenario(raw, "t.yaml")
    flushed = [torch.zeros(t.num_rows, t.dim) for t in scenario.tables()]

    def execute(cell, weights: Path) -> CellOutcome:
        weights.parent.mkdir(parents=True, exist_ok=True)
        torch.save(flushed, weights)
        return CellOutcome("ok", None, make_record(row_precision=cell.row_precision, weights_file=weights.name).metrics)

    records = {r.cell_id: r for r in run_cells(scenario, "t.yaml", cells, tmp_path, execute=execute)}
    metrics = records["device@w1@fp16"].metrics
    if expected is None:
        assert "weight_diff_vs_fp32" in metrics and "weights_not_compared_fp32" not in metrics
    else:
        assert metrics["weights_not_compared_fp32"] == expected and "weight_diff_vs_fp32" not in metrics


# --- 13. left from round 5 ------------------------------------------------------------------------


def test_a_disk_that_fills_during_the_weights_copy_costs_that_column_and_leaves_no_file(tmp_path, monkeypatch):
    """torch.save writing to a file that fills failed the cell with "unexpected pos N vs M"
    and left a truncated .pt; the copy is now serialised in memory and written whole."""
    import errno

    import torch

    import embbench.outputs as outputs
    from embbench.runner import run_cell
    from embbench.scenario import parse_scenario
    from embbench.strategy import RuntimeEnv
    from tests.conftest import tiny_scenario

    real = os.fdopen

    class Filling:  # takes 100 bytes, then the disk is full
        def __init__(self, f):
            self.f = f

        def write(self, data):
            self.f.write(bytes(data)[:100])
            raise OSError(errno.ENOSPC, "No space left on device")

        def __getattr__(self, name):
            return getattr(self.f, name)

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

    monkeypatch.setattr(outputs.os, "fdopen", lambda fd, mode: Filling(real(fd, mode)))
    scenario, cells = parse_scenario(tiny_scenario(), "t.yaml")
    weights = tmp_path / "weights" / "device@w1.pt"
    metrics = run_cell(scenario, cells[0], RuntimeEnv(torch.device("cpu")), weights)
    assert metrics["step_time_s"]["n"] > 0 and metrics["weights_file"] is None
    assert metrics["weights_not_compared"] == f"cannot save the flushed weights to {weights}: No space left on device"
    assert list(weights.parent.iterdir()) == []


def test_a_ctrl_c_in_the_interrupt_handlers_reset_prints_no_traceback(tmp_path, capsys, monkeypatch):
    import signal

    import embbench.cli as cli

    def interrupted(args):
        raise KeyboardInterrupt  # the first Ctrl-C

    real, calls = signal.signal, []

    def reset(signum, handler):
        calls.append(signum)
        if len(calls) == 2:  # the finally's reset of SIGTERM: the next Ctrl-C lands here
            raise KeyboardInterrupt
        return real(signum, handler)

    monkeypatch.setattr(cli.show, "main", interrupted)
    monkeypatch.setattr(signal, "signal", reset)
    previous = signal.getsignal(signal.SIGTERM)
    code = cli.main(["show", str(tmp_path)])
    monkeypatch.undo()
    signal.signal(signal.SIGTERM, previous)  # the reset the test interrupted
    assert code == 130 and capsys.readouterr().err == "interrupted\n"


def test_the_scratch_folders_of_dead_launchers_are_removed_at_the_next_start(tmp_path, monkeypatch):
    import subprocess
    import tempfile

    from embbench.launch import remove_dead_scratch

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    dead = subprocess.Popen(["true"])
    dead.wait()
    (tmp_path / f"embbench-cell-{dead.pid}-abc").mkdir()  # a run killed by SIGKILL left it
    (tmp_path / f"embbench-cell-{os.getpid()}-def").mkdir()  # a live run's
    (tmp_path / "embbench-cell-xyz").mkdir()  # no pid: not known to be dead
    remove_dead_scratch()
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"embbench-cell-{os.getpid()}-def", "embbench-cell-xyz"]
