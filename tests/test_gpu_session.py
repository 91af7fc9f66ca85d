"""scripts/gpu_session.sh, the command a lent GPU runs: its rehearsal on the CPU (the same
sequence at a tiny scale, CUDA-only cells recorded unsupported), and its budget."""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
from pathlib import Path

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "scripts"))

import gpu_session  # noqa: E402
from embbench.scenario import parse_scenario  # noqa: E402


def _archived(out: Path) -> dict[str, str]:
    with tarfile.open(out / "session.tgz") as tar:
        # the text files (a cell's evaluation scores, eval/*.npz, are binary)
        return {m.name: tar.extractfile(m).read().decode() for m in tar.getmembers()
                if m.isfile() and not m.name.endswith(".npz")}


@pytest.mark.slow
@pytest.mark.rehearsal
def test_the_rehearsal_runs_the_session_s_sequence_on_the_cpu_and_archives_each_result(tmp_path):
    """The CUDA tests (all skipped here, but every node must exist), the headline cells
    (device and freqcache run, uvm_cache's recorded unsupported), the ledger, the archive."""
    env = {**os.environ, "OUT": str(tmp_path / "out"), "SESSION_DIR": str(tmp_path / "work"), "PYTHON": sys.executable}
    run = subprocess.run(["bash", "scripts/gpu_session.sh", "--rehearse", "80"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    ledger = (tmp_path / "out" / "ledger.txt").read_text()
    assert "install" in ledger and "skipped (rehearsal)" in ledger
    tests_line = next(line for line in ledger.splitlines() if line.startswith("CUDA tests"))
    assert "exit 0" in tests_line, tests_line  # pytest exits 4 when a listed test does not exist
    archived = _archived(tmp_path / "out")
    records = {name.rsplit("/", 1)[-1]: text for name, text in archived.items()
               if name.startswith("session/kaggle_alpha1.15/") and name.endswith("@w1.json")}
    assert '"status": "ok"' in records["device@w1.json"]
    # the headline's two uvm_cache cells (with and without the pipeline); how far the rehearsal
    # gets into the matrix after it depends on the machine's speed
    pipelines = [text for name, text in records.items() if name.startswith("uvm_cache_algorithm=lru,cache_ratio=0.015,")]
    assert len(pipelines) == 2 and all('"status": "unsupported"' in text for text in pipelines)
    assert all('"status": "unsupported"' in text for name, text in records.items() if name.startswith("uvm"))
    assert "session/ledger.txt" in archived and "session/cuda_tests.txt" in archived
    for cell in ("device@w1", "freqcache[cache_ratio=0.015]@w1"):  # ran, or said why not
        line = next(line for line in ledger.splitlines() if cell in line)
        assert " ok, " in line or "not started: estimate" in line, line


def test_no_cell_starts_when_its_estimate_exceeds_the_seconds_left(tmp_path, capsys):
    assert gpu_session.main(["20", "--rehearse", "--out", str(tmp_path / "out"), "--work", str(tmp_path / "work")]) == 0
    ledger = (tmp_path / "out" / "ledger.txt").read_text()
    assert "CUDA tests" in ledger and "not started: estimate 20 s >" in ledger
    assert "not started, the budget spent: headline: Kaggle shape, cache 1.5 %" in ledger
    assert not (tmp_path / "work" / "kaggle_alpha1.15").exists()  # no cell, no record
    assert "session/ledger.txt" in _archived(tmp_path / "out")


def test_the_priority_list_starts_with_the_headline_and_names_existing_scenarios():
    items = gpu_session.priority_list()
    assert items[0].scenario.name == "kaggle_headline.yaml" and items[0].run == "kaggle_alpha1.15"
    assert all(item.scenario.exists() for item in items)
    plan = gpu_session.plan_text().splitlines()
    assert plan[0].startswith("headline: Kaggle shape, cache 1.5 %") and " 4 cells " in plan[0]
    assert plan[1].startswith("headline in TF32") and " 5 cells " in plan[1]
    tf32, _ = parse_scenario(yaml.safe_load(items[1].scenario.read_text()), "x")
    assert tf32.run.dense_precision == "tf32" and items[1].fresh and items[1].profile
    assert plan[2].startswith("A/A: device again") and " 1 cells " in plan[2]
    assert items[2].against == items[0].run and items[2].fresh  # compared with the headline's device
    for line, item, way in ((plan[3], items[3], "padded"), (plan[4], items[4], "unique")):
        assert line.startswith(f"device, sparse_backward {way}") and " 1 cells " in line
        assert parse_scenario(gpu_session._raw(item), "x")[0].run.sparse_backward == way
    assert len({items[1].run, items[3].run, items[4].run}) == 3  # another digest, another folder
    assert plan[5].startswith("exactness: freqcache against device") and " 2 cells " in plan[5]
    exactness, _ = parse_scenario(yaml.safe_load(items[5].scenario.read_text()), "x")
    assert exactness.run.deterministic and items[5].fresh
    assert plan[6].startswith("exactness A/A") and items[6].against == items[5].run
    assert plan[7].startswith("row precision") and "(row_precision.yaml)" in plan[7]
    assert " 1 cells " in plan[8]  # the 1.5 % caches of kaggle_alpha1.15 the headline left: uvm_cache lfu


def test_a_second_call_of_a_session_does_not_run_the_cuda_tests_again(tmp_path):
    """On 2026-11-28 the second call on the warm machine ran them again: 39 s of a lease."""
    work = tmp_path / "work"
    work.mkdir()
    (work / "cuda_tests.txt").write_text("....\n15 passed, 11 deselected in 46.04s\n")
    args = gpu_session.argparse.Namespace(rehearse=True, work=str(work), out=str(tmp_path / "out"), seconds=100.0,
                                          spent=0.0, install_note="")
    session = gpu_session.Session(args)
    session.cuda_tests()
    (line,) = [entry for entry in session.ledger.lines if entry[0] == "CUDA tests"]
    assert line[2] == 0 and line[3] == "ran earlier in this session: 15 passed, 11 deselected in 46.04s"
