"""``embbench run``'s exit status: a CI job that runs a scenario fails when its cells fail
(README "Exit codes")."""

from __future__ import annotations

import pytest
import yaml

import embbench.cli.run as run_cli
from embbench.cli import EXIT_CELLS_FAILED, EXIT_NOTHING_RAN, main
from tests.conftest import tiny_scenario
from tests.record_factory import make_record


def _run_ending_in(tmp_path, monkeypatch, capsys, statuses: dict[str, str]) -> tuple[int, str]:
    """``run`` of a two-cell scenario whose cells end in ``statuses`` (strategy -> status)."""
    path = tmp_path / "s.yaml"
    path.write_text(yaml.safe_dump(tiny_scenario(strategies=[{"name": s} for s in statuses])))
    monkeypatch.setattr(run_cli, "run_cells", lambda *a, **k: [make_record(s, status=st) for s, st in statuses.items()])
    code = main(["run", str(path), "--out", str(tmp_path / "run"), "--quiet"])
    return code, capsys.readouterr().err


@pytest.mark.parametrize("failed", ["error", "timeout", "oom", "diverged"])
def test_a_run_with_a_failed_cell_exits_1_naming_it(tmp_path, monkeypatch, capsys, failed):
    code, err = _run_ending_in(tmp_path, monkeypatch, capsys, {"device": "ok", "cpu": failed})
    assert code == EXIT_CELLS_FAILED == 1
    assert f"1 of 2 cell(s) failed (cpu@w1: {failed}) (exit 1)" in err


def test_a_run_whose_every_runnable_cell_failed_exits_1_not_4(tmp_path, monkeypatch, capsys):
    code, err = _run_ending_in(tmp_path, monkeypatch, capsys, {"device": "skipped", "cpu": "error"})
    assert code == EXIT_CELLS_FAILED and "cpu@w1: error" in err


@pytest.mark.parametrize("answer", ["unsupported", "skipped"])
def test_unsupported_or_skipped_beside_an_ok_cell_is_no_failure(tmp_path, monkeypatch, capsys, answer):
    code, err = _run_ending_in(tmp_path, monkeypatch, capsys, {"device": "ok", "cpu": answer})
    assert code == 0 and "error" not in err


def test_no_cell_that_could_start_exits_4(tmp_path, monkeypatch, capsys):
    code, _ = _run_ending_in(tmp_path, monkeypatch, capsys, {"device": "unsupported", "cpu": "skipped"})
    assert code == EXIT_NOTHING_RAN == 4


def test_the_readmes_exit_codes_are_runs():
    """The README's table of exit codes names the codes ``run`` returns."""
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    rows = {line.split("|")[1].strip(): line.split("|")[2] for line in readme.splitlines()
            if line.startswith("| ") and line.split("|")[1].strip().isdigit()}
    assert "error" in rows[str(EXIT_CELLS_FAILED)] and "diverged" in rows[str(EXIT_CELLS_FAILED)]
    assert "no cell could start" in rows[str(EXIT_NOTHING_RAN)]
    assert "interrupted" in rows["130"] and "bad input" in rows["2"]
