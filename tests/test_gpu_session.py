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
def test_the_rehearsal_runs_the_session_s_plan_on_the_cpu_and_archives_each_result(tmp_path):
    """Both calls of the plan, in order, each item in its (shrunk) budget: the CUDA tests (all
    skipped here, but every node must exist), the headline cells (device and gpu_sharded run,
    uvm_cache's recorded unsupported), then call 2's items; each call's ledger, the archive."""
    env = {**os.environ, "OUT": str(tmp_path / "out"), "SESSION_DIR": str(tmp_path / "work"), "PYTHON": sys.executable}
    run = subprocess.run(["bash", "scripts/gpu_session.sh", "--rehearse", "45", "--call", "all"], cwd=ROOT, env=env,
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    first = (tmp_path / "out" / "ledger-call1.txt").read_text()
    second = (tmp_path / "out" / "ledger-call2.txt").read_text()
    assert "install" in first and "skipped (rehearsal)" in first
    archived = _archived(tmp_path / "out")
    records = {name.rsplit("/", 1)[-1]: text for name, text in archived.items()
               if name.startswith("session/kaggle_alpha1.15/") and name.endswith("@w1.json")}
    assert '"status": "ok"' in records["device@w1.json"]
    assert all('"status": "unsupported"' in text for name, text in records.items() if name.startswith("uvm"))
    assert "session/ledger-call1.txt" in archived and "session/ledger-call2.txt" in archived
    line = next(line for line in first.splitlines() if "kaggle_alpha1.15 device@w1" in line)
    assert " ok, " in line and "1.00x device" in line and "instruments" in line, line
    # each call went through its items in the plan's order (each cell run, or said why not)
    for call, ledger in ((1, first), (2, second)):
        runs = list(dict.fromkeys(words[0] for words in map(str.split, ledger.splitlines())
                                  if len(words) > 1 and "@w1" in words[1]))
        planned = list(dict.fromkeys(item.run for item in gpu_session.priority_list()
                                     if item.call == call and item.scenario))
        assert runs and runs == planned[: len(runs)], ledger
    assert "criteo_1tb_dim128 device@w1" in second  # the last item was reached


def test_the_cuda_tests_the_session_runs_exist():
    """pytest exits 4 when a listed test does not exist; the rehearsal may not reach them."""
    for node in gpu_session.CUDA_TEST_NODES:
        path, _, name = node.partition("::")
        assert (ROOT / path).is_file(), node
        assert not name or f"def {name}(" in (ROOT / path).read_text(), node


def test_no_cell_starts_when_its_estimate_exceeds_the_seconds_left(tmp_path, capsys):
    assert gpu_session.main(["20", "--rehearse", "--out", str(tmp_path / "out"), "--work", str(tmp_path / "work")]) == 0
    ledger = (tmp_path / "out" / "ledger-call1.txt").read_text()
    assert "not started, the budget spent: headline: Kaggle shape, cache 1.5 %" in ledger
    assert not (tmp_path / "work" / "kaggle_alpha1.15").exists()  # no cell, no record
    assert "session/ledger-call1.txt" in _archived(tmp_path / "out")


def test_a_cell_waits_for_its_item_s_budget_as_for_the_call_s(tmp_path):
    """An item may use its share of the call only: a cell whose estimate exceeds what is left of
    its item's budget is not started, though the call has time."""
    args = gpu_session.argparse.Namespace(rehearse=True, work=str(tmp_path / "work"), out=str(tmp_path / "out"),
                                          seconds=600.0, spent=0.0, install_note="")
    session = gpu_session.Session(args, call=2)
    item = gpu_session.Item("tiny", gpu_session.MATRIX / "kaggle_headline.yaml", "x", ("device",), budget_s=10)
    session.begin(item)
    assert 0 < session.left() <= 10 < session.ledger.left()
    session.item(item)
    (line,) = [entry for entry in session.ledger.lines if "device@w1" in entry[0]]
    assert line[2] == 0 and line[3].startswith(f"not started: estimate {gpu_session.REHEARSAL_CELL_SECONDS} s > ")


def test_the_plan_is_two_calls_in_the_issue_s_order_each_within_a_device_call():
    items = gpu_session.priority_list()
    assert all(item.scenario is None or item.scenario.exists() for item in items)
    assert [item.call for item in items] == sorted(item.call for item in items)  # call 1's items, then call 2's
    for call in (1, 2):
        budgets = sum(item.budget_s for item in items if item.call == call)
        assert gpu_session.INSTALL_SECONDS[call] + budgets <= gpu_session.CALL_SECONDS - gpu_session.RESERVE_SECONDS
    plan = gpu_session.plan_text().splitlines()
    first, second = plan.index(next(line for line in plan if line.startswith("call 1"))), \
        plan.index(next(line for line in plan if line.startswith("call 2")))
    call1, call2 = plan[first + 1: second], plan[second + 1:]
    # call 1: the headline at fp32 and TF32, gpu_sharded beside device, uvm_cache without its pipeline
    assert call1[0].lstrip().startswith("headline: Kaggle shape") and " 4 cells " in call1[0]
    assert call1[1].lstrip().startswith("headline in TF32") and " 5 cells " in call1[1]
    for item in items[:2]:
        scenario, cells = parse_scenario(gpu_session._raw(item), "x")
        chosen = gpu_session._selected(item, cells)
        assert {"device", "gpu_sharded", "freqcache", "uvm_cache"} == {c.strategy for c in chosen}
        assert all(c.params.get("prefetch_pipeline") is not True for c in chosen) and item.fresh
    assert parse_scenario(gpu_session._raw(items[1]), "x")[0].run.dense_precision == "tf32"
    assert call1[2].lstrip().startswith("CUDA tests")
    # call 2: exactness compiled and eager with device, its A/A; store file against memory; the
    # backward through torch against the kernel; row precisions; the 1TB shape at dim 128
    exactness = items[3]
    scenario, cells = parse_scenario(gpu_session._raw(exactness), "x")
    assert scenario.run.deterministic and {c.id for c in gpu_session._selected(exactness, cells)} == {
        "device@w1", "freqcache[cache_ratio=0.015,compile=auto]@w1", "freqcache[cache_ratio=0.015,compile=False]@w1"}
    assert items[4].against == exactness.run and items[4].strategies == ("device",)
    store = items[5]
    scenario, cells = parse_scenario(gpu_session._raw(store), "x")
    assert store.run == items[1].run and scenario.digest() == parse_scenario(gpu_session._raw(items[1]), "x")[0].digest()
    assert [c.params.get("store") for c in gpu_session._selected(store, cells)] == ["file"]
    backward = items[6]
    assert parse_scenario(gpu_session._raw(backward), "x")[0].run.sparse_backward == "padded_torch"
    assert backward.against == items[1].run and backward.run != items[1].run
    precision = items[7]
    assert sorted(c.row_precision for c in gpu_session._selected(precision, parse_scenario(gpu_session._raw(precision),
                                                                                           "x")[1])) == ["bf16", "fp16", "fp32"]
    big, _ = parse_scenario(gpu_session._raw(items[8]), "x")
    assert big.data.preset == "criteo_1tb_freq3" and big.data.embedding_dim == 128 and items[8].strategies == ("device",)
    assert [line.split("(")[-1] for line in call2 if "cells" in line][-1] == "criteo_1tb_dim128.yaml)"


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
