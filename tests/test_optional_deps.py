"""Without scipy or matplotlib (a --no-deps install), `run` still runs and measures; the
features that need them fail alone, with one line that says what to install."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml
from record_factory import make_record, write_run

from conftest import tiny_scenario
from embbench.cli import main
from embbench.stats import log_t_interval
from embbench.optional import MissingDependency, require

ROOT = Path(__file__).resolve().parents[1]


def test_require_names_the_feature_the_package_and_how_to_install_it():
    with pytest.raises(MissingDependency, match=r"^the frobnication needs nosuchpkg_x, which cannot be imported here "
                                                r"\(.*\); install it with: pip install nosuchpkg_x$"):
        require("nosuchpkg_x.sub", "the frobnication")


def test_the_interval_without_scipy_is_a_missing_dependency(monkeypatch):
    monkeypatch.setitem(sys.modules, "scipy.stats", None)  # as if not installed
    with pytest.raises(MissingDependency, match="intervals over repeats .Student's t. needs scipy"):
        log_t_interval([1.0, 2.0, 3.0])


@pytest.mark.parametrize("command, module", [(["compare"], "scipy.stats"), (["recommend", "--device-memory", "1GiB"], "scipy.stats"),
                                             (["report"], "matplotlib")])
def test_a_command_whose_library_is_missing_fails_in_one_line(tmp_path, capsys, monkeypatch, command, module):
    a = write_run(tmp_path / "a", [make_record("device"), make_record("cpu", step_times=[0.02] * 12)])
    b = write_run(tmp_path / "b", [make_record("device"), make_record("cpu", step_times=[0.03] * 12)])
    runs = [str(a), str(b)] if command[0] != "recommend" else [str(a)]
    monkeypatch.setitem(sys.modules, module, None)
    out = ["--out", str(tmp_path / "r.html")] if command[0] == "report" else []
    assert main([command[0], *runs, *command[1:], *out]) == 2
    err = capsys.readouterr().err
    package = module.partition(".")[0]
    assert err.count("\n") == 1 and f"needs {package}" in err and f"pip install {package}" in err
    assert not (tmp_path / "r.html").exists()


@pytest.mark.slow
def test_run_without_scipy_and_matplotlib_measures_and_says_what_is_missing(tmp_path):
    # As if not installed, in this run and the processes of its cells: the path finder finds
    # neither (so libraries that probe for them, as torchmetrics does matplotlib, see nothing).
    hide = tmp_path / "hide"
    hide.mkdir()
    (hide / "sitecustomize.py").write_text(textwrap.dedent("""
        import importlib.machinery

        _find_spec = importlib.machinery.PathFinder.find_spec

        def _hidden(cls, name, path=None, target=None):
            return None if name.partition(".")[0] in ("scipy", "matplotlib") else _find_spec(name, path, target)

        importlib.machinery.PathFinder.find_spec = classmethod(_hidden)
    """))
    scenario = tmp_path / "tiny.yaml"
    scenario.write_text(yaml.safe_dump(tiny_scenario(strategies=[{"name": "device"}])))
    out = tmp_path / "run"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(hide), os.environ.get("PYTHONPATH", "")]))
    proc = subprocess.run([sys.executable, "-m", "embbench.cli", "run", str(scenario), "--out", str(out)], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr
    assert "warning: the confidence interval of the throughput needs scipy" in " ".join(proc.stdout.split())
    assert "(no interval: no scipy)" in proc.stdout
    record = json.loads((out / "device@w1.json").read_text())
    assert record["status"] == "ok"
    throughput = record["metrics"]["throughput"]
    assert throughput["ci95"] is None and "needs scipy" in throughput["ci95_missing"]
    assert len(throughput["per_repeat"]) >= 2 and throughput["median"] > 0
