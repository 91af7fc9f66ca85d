"""Trust round 5 (issue 33): one cell one file, a lock that follows no link, every output of a
strategy checked, one definition of each bound, undefined is not zero, sizes parsed whole,
out of memory and out of disk said so, and the sweep tool as careful as ``embbench run``.

Every probe runs in this process and starts no cell's processes.
"""

from __future__ import annotations

import json
import os
import stat

import pytest
import torch

from embbench.cli import main
from embbench.launch import CellOutcome, run_cells
from embbench.results import LOCK_FILE, RecordError, load_records, run_directory_lock, write_record
from embbench.scenario import Cell, ScenarioError, cell_slug, parse_scenario
from tests.conftest import _install_plugin, tiny_scenario
from tests.record_factory import make_record


def _cli(capsys, *argv) -> tuple[int, str, str]:
    code = main([str(a) for a in argv])
    out, err = capsys.readouterr()
    return code, out, err


def _ok(cell: Cell, weights) -> CellOutcome:
    return CellOutcome("ok", None, make_record().metrics)


# --- one cell, one file -------------------------------------------------------------------------


@pytest.fixture
def tagged(tmp_path, monkeypatch):
    """A strategy with a free-text parameter (whose values a file name cannot hold as they are)."""
    from embbench.strategy import load_strategies

    _install_plugin(tmp_path / "tagsite", "tag_plugin", {"tagged": "tag_plugin:Tagged"}, """
        from baselines.tables import DeviceStrategy
        from embbench.strategy import StrategyParams

        class TagParams(StrategyParams):
            tag: str = ""

        class Tagged(DeviceStrategy):
            name = "tagged"
            Params = TagParams
        """, monkeypatch)
    yield
    load_strategies.cache_clear()


def test_cells_whose_ids_differ_only_where_the_file_name_drops_get_a_file_each(tmp_path, capsys, tagged):
    raw = tiny_scenario(run={"compare_weights": False}, baseline="tagged",
                        strategies=[{"name": "tagged", "params": {"tag": ["a b", "a/b", "a_b"]}}])
    scenario, cells = parse_scenario(raw, "t.yaml")
    assert len({c.slug for c in cells}) == 3
    assert cell_slug("tagged[tag=a_b]@w1") == "tagged_tag=a_b_@w1"  # a plain id keeps the name runs always had
    run_cells(scenario, "t.yaml", cells, tmp_path, execute=_ok)
    assert sorted(r.cell_id for r in load_records(tmp_path)) == sorted(c.id for c in cells)
    code, out, err = _cli(capsys, "show", tmp_path, "--json")
    assert code == 0 and err == "" and len(json.loads(out)) == 3


def test_a_name_two_cells_would_share_is_refused_never_overwritten(tmp_path):
    write_record(tmp_path, "cpu@w1", make_record("cpu"))
    before = (tmp_path / "cpu@w1.json").read_bytes()
    with pytest.raises(RecordError, match=r"cpu@w1\.json: holds the record of cell cpu@w1; the record of device@w1 "
                                          r"would replace it \(two cells, one file name\); not written"):
        write_record(tmp_path, "cpu@w1", make_record("device"))
    assert (tmp_path / "cpu@w1.json").read_bytes() == before


def test_a_scenario_whose_cells_would_share_a_record_file_is_refused_up_front(monkeypatch):
    import embbench.scenario as scenario_module

    monkeypatch.setattr(scenario_module, "cell_slug", lambda cell_id: "same")  # as two plain ids could meet
    with pytest.raises(ScenarioError, match=r"t.yaml: strategies: cells device@w1 and cpu@w1 would share the record "
                                            r"file same\.json"):
        parse_scenario(tiny_scenario(), "t.yaml")


def test_resume_never_takes_a_record_edited_to_another_cell_nor_overwrites_one_it_did_not_write(tmp_path):
    scenario, cells = parse_scenario(tiny_scenario(run={"compare_weights": False}), "t.yaml")  # device, cpu
    run_cells(scenario, "t.yaml", cells, tmp_path, execute=_ok)
    edited = tmp_path / "device@w1.json"
    data = json.loads(edited.read_text())
    data.update(cell_id="cpu@w1", strategy="cpu")  # the device's numbers, claiming to be cpu's
    edited.write_text(json.dumps(data))
    genuine = (tmp_path / "cpu@w1.json").read_bytes()
    started, notes = [], []
    run_cells(scenario, "t.yaml", cells, tmp_path, resume=True, execute=_ok, on_start=started.append,
              on_notice=notes.append)
    assert (tmp_path / "cpu@w1.json").read_bytes() == genuine  # reused, not rewritten
    assert [c.id for c in started] == ["device@w1"]  # its file was damaged: it runs again
    assert any(f"{edited}: holds the record of cell cpu@w1, whose file is cpu@w1.json" in n for n in notes)
    assert {r.cell_id for r in load_records(tmp_path)} == {"device@w1", "cpu@w1"}


def test_records_get_the_permissions_of_the_runs_other_files(tmp_path):
    old = os.umask(0o022)
    try:
        path = write_record(tmp_path, "device@w1", make_record("device"))
    finally:
        os.umask(old)
    assert stat.S_IMODE(path.stat().st_mode) == 0o644


# --- the run lock ------------------------------------------------------------------------------


def test_the_lock_follows_no_link(tmp_path):
    outside = tmp_path / "precious.txt"
    outside.write_text("keep me")
    run = tmp_path / "run"
    run.mkdir()
    (run / LOCK_FILE).symlink_to(outside)
    with pytest.raises(ValueError, match=rf"{LOCK_FILE}: .*is a symbolic link, not a regular file; remove it"):
        with run_directory_lock(run):
            pass
    assert outside.read_text() == "keep me"
    (run / LOCK_FILE).unlink()
    (run / LOCK_FILE).symlink_to(tmp_path / "dangling")
    with pytest.raises(ValueError, match="is a symbolic link"):
        with run_directory_lock(run):
            pass
    assert not (tmp_path / "dangling").exists()


def test_a_lock_path_that_is_not_a_regular_file_is_refused_by_name(tmp_path):
    os.mkfifo(tmp_path / LOCK_FILE)
    with pytest.raises(ValueError, match=rf"{tmp_path / LOCK_FILE}: cannot lock the run directory: is a FIFO, not a "
                                         "regular file; remove it"):
        with run_directory_lock(tmp_path):
            pass


# --- every output of a strategy is checked ------------------------------------------------------


def _broken_device(forward=None, flush=None):
    """The device strategy with its module's forward output or flushed tables altered."""
    from baselines.tables import DeviceStrategy

    class Broken(DeviceStrategy):
        name = "broken"

        def build(self, ctx):
            module = super().build(ctx)
            inner_forward, inner_flush = module.forward, module.flush
            if forward:
                module.forward = lambda features: forward(inner_forward(features))
            if flush:
                module.flush = lambda: flush(inner_flush())
            return module

    return Broken


@pytest.mark.parametrize("forward, flush, expected", [
    (lambda out: out.to(torch.int64), None, r"strategy broken returned torch\.int64; expected float32 \[64, 208\]"),
    (lambda out: out.half(), None, r"strategy broken returned torch\.float16; expected float32"),
    (lambda out: out.double(), None, r"strategy broken returned torch\.float64; expected float32"),
    (None, lambda tables: tables[:1], r"strategy broken: flush\(\) returned 1 tables; expected a list of 26"),
    (None, lambda tables: [t.T for t in tables], r"strategy broken: flush\(\) returned torch\.float32 \[8, \d+\] for "
                                                 r"table 0; expected float32 \[\d+, 8\]"),
    (None, lambda tables: [t.half() for t in tables], r"flush\(\) returned torch\.float16 \[\d+, 8\] for table 0"),
], ids=["forward-int64", "forward-float16", "forward-float64", "flush-one-table", "flush-transposed", "flush-float16"])
def test_a_strategy_that_breaks_its_output_contract_fails_its_cell_named(tmp_path, monkeypatch, forward, flush, expected):
    import embbench.scenario as scenario_module
    from embbench.runner import StrategyOutputError, _classify, run_cell
    from embbench.strategy import RuntimeEnv

    real = scenario_module.get_strategy
    broken = _broken_device(forward, flush)
    monkeypatch.setattr(scenario_module, "get_strategy", lambda name: broken if name == "broken" else real(name))
    scenario, cells = parse_scenario(tiny_scenario(strategies=[{"name": "broken"}], baseline="broken"), "t.yaml")
    with pytest.raises(StrategyOutputError, match=expected) as err:
        run_cell(scenario, cells[0], RuntimeEnv(torch.device("cpu")), tmp_path / "w.pt")
    assert _classify(err.value) == "error"


def test_weights_of_another_shape_cost_the_comparison_not_the_run(tmp_path):
    from embbench.launch import _max_weight_diff

    torch.save([torch.zeros(3, 4), torch.zeros(5, 4)], tmp_path / "base.pt")
    torch.save([torch.zeros(4, 3), torch.zeros(5, 4)], tmp_path / "mine.pt")
    with pytest.raises(RecordError, match=r"mine\.pt: its tables differ in number or shape from the baseline's"):
        _max_weight_diff(tmp_path / "mine.pt", tmp_path / "base.pt")
    torch.save([torch.zeros(3, 4)], tmp_path / "short.pt")
    with pytest.raises(RecordError, match="differ in number or shape"):
        _max_weight_diff(tmp_path / "short.pt", tmp_path / "base.pt")


# --- what a scenario accepts, a record can hold -------------------------------------------------


@pytest.mark.parametrize("overrides, expected", [
    ({"data": {"alpha": float("inf")}}, "t.yaml: data.alpha: Input should be a finite number"),
    ({"run": {"time_limit_s": float("inf")}}, "t.yaml: run.time_limit_s: Input should be a finite number"),
    ({"optimizer": {"embedding": {"lr": float("nan")}}}, "t.yaml: optimizer.embedding.lr: Input should be a finite number"),
    ({"run": {"seed": 2 ** 70}}, "t.yaml: run.seed: Input should be less than 18446744073709551616"),
    ({"run": {"seed": -1}}, "t.yaml: run.seed: Input should be greater than or equal to 0"),
    ({"run": {"world_size": True}}, "t.yaml: run.world_size: true is a boolean, not a number"),
    ({"run": {"steps": True}}, "t.yaml: run.steps: true is a boolean, not a number"),
    ({"strategies": [{"name": "device"}, {"name": "freqcache", "params": {"lookahead": True}}]},
     "t.yaml: strategies[1].params.lookahead: true is a boolean, not a number"),
    ({"strategies": [{"name": "device"}, {"name": "freqcache", "params": {"cache_ratio": float("inf")}}]},
     "t.yaml: strategies[1].params.cache_ratio: Input should be a finite number"),
], ids=["alpha-inf", "time-limit-inf", "lr-nan", "seed-2^70", "seed-negative", "world-size-true", "steps-true",
        "lookahead-true", "param-inf"])
def test_a_value_a_record_could_not_hold_or_a_boolean_for_a_number_is_refused_up_front(overrides, expected):
    with pytest.raises(ScenarioError) as err:
        parse_scenario(tiny_scenario(**overrides), "t.yaml")
    assert str(err.value).splitlines()[0] == expected


def test_booleans_stay_booleans_where_a_field_takes_one():
    scenario, cells = parse_scenario(tiny_scenario(run={"compare_weights": True}, strategies=[
        {"name": "device"}, {"name": "freqcache", "params": {"prefetch": False, "compile": True}}]), "t.yaml")
    assert scenario.run.compare_weights is True and cells[1].make_strategy().params.prefetch is False


def test_a_scenario_at_its_bounds_makes_a_record_that_validates():
    from embbench.launch import scenario_info
    from embbench.results import Record

    scenario, cells = parse_scenario(tiny_scenario(run={"seed": 2 ** 64 - 1, "time_limit_s": 1e300},
                                                   data={"alpha": 1e300, "scale": 0.0002}), "t.yaml")
    record = Record(cell_id=cells[0].id, strategy="device", params={}, world_size=1, status="error", message="x",
                    baseline="device", scenario=scenario_info(scenario, "t.yaml"), provenance={})
    assert Record.model_validate_json(record.model_dump_json()) == record


# --- undefined is not zero ----------------------------------------------------------------------


def test_auc_over_one_class_is_null_with_the_reason():
    from embbench.metrics import auc_logloss
    from embbench.results import Record

    logits = torch.tensor([0.3, -1.0, 2.0])
    auc, logloss, why = auc_logloss(logits, torch.zeros(3))
    assert auc is None and logloss > 0 and why == "undefined: all 3 evaluation labels are negative (AUC needs both classes)"
    assert auc_logloss(logits, torch.ones(3))[2].startswith("undefined: all 3 evaluation labels are positive")
    auc, _, why = auc_logloss(logits, torch.tensor([0.0, 0.0, 1.0]))
    assert auc == 1.0 and why is None
    record = make_record()
    record.metrics["accuracy"].update(auc=None, auc_missing="undefined: all 3 evaluation labels are negative")
    assert Record.model_validate_json(record.model_dump_json()).metrics["accuracy"]["auc"] is None


# --- sizes parse whole --------------------------------------------------------------------------


@pytest.mark.parametrize("text", ["16,5GiB", "64GB of RAM", "16GiBs", "GiB", "1e3", "16 GiB 2"])
def test_a_size_is_a_number_and_a_unit_nothing_else(tmp_path, capsys, text):
    from tests.record_factory import write_run

    run = write_run(tmp_path / "run", [make_record("device")])
    code, _, err = _cli(capsys, "recommend", run, "--device-memory", text)
    assert code == 2 and err == (f"error: --device-memory {text!r}: expected a size such as 16GiB, 512MiB, 1.5GB or a "
                                 "number of bytes\n")


def test_sizes_that_are_whole_still_parse():
    from embbench.recommend import parse_size

    assert [parse_size(t) for t in ("16GiB", "16 gib", "1.5GB", "512", " 2MiB ")] == [16 << 30, 16 << 30, 1_500_000_000,
                                                                                         512, 2 << 20]


# --- out of memory says so ----------------------------------------------------------------------


def test_the_cpu_allocators_out_of_memory_is_oom():
    from embbench.runner import _classify

    with pytest.raises(RuntimeError) as err:
        torch.empty(1 << 62, dtype=torch.uint8)  # refused by the allocator at once, nothing touched
    assert "can't allocate memory" in str(err.value) and _classify(err.value) == "oom"


def test_freqcaches_look_ahead_is_bounded_by_the_steps_the_run_hands_it(tmp_path):
    from embbench.runner import run_cell
    from embbench.strategy import RuntimeEnv

    scenario, cells = parse_scenario(tiny_scenario(run={"compare_weights": False}, strategies=[
        {"name": "device"}, {"name": "freqcache", "params": {"lookahead": 1_000_000_000, "compile": False}}]), "t.yaml")
    metrics = run_cell(scenario, cells[1], RuntimeEnv(torch.device("cpu")))  # asked for 13 TiB of window before
    assert metrics["extra"]["lookahead"] == scenario.run.training_batches_read(profile=False) - 1


def test_the_dry_run_estimate_counts_freqcaches_window():
    from embbench.launch import memory_preflight

    scenario, cells = parse_scenario(tiny_scenario(run={"steps": 1000}, strategies=[
        {"name": "device"}, {"name": "freqcache", "params": {"lookahead": [8, 1000, 1_000_000_000]}}]), "t.yaml")
    device = [memory_preflight(scenario, cell, torch.device("cpu"))[0]["device"] for cell in cells[1:]]
    max_ids = 64 * 26  # a batch's ids: the window's room per batch at most, 8 bytes a pair
    assert device[1] - device[0] == (1000 - 8) * max_ids * 8
    steps = scenario.run.training_batches_read() - 1
    assert device[2] - device[0] == (steps - 8) * max_ids * 8  # never further than the run's batches


def _estimating(monkeypatch, estimate):
    import embbench.scenario as scenario_module
    from baselines.tables import DeviceStrategy
    from embbench.strategy import MemoryFootprint

    class Estimates(DeviceStrategy):
        name = "estimates"

        def estimate_memory(self, tables, optimizer, world_size):
            return MemoryFootprint(**estimate)

    real = scenario_module.get_strategy
    monkeypatch.setattr(scenario_module, "get_strategy", lambda name: Estimates if name == "estimates" else real(name))
    return parse_scenario(tiny_scenario(strategies=[{"name": "estimates"}], baseline="estimates"), "t.yaml")


@pytest.mark.parametrize("estimate, shown", [({"device_bytes": float("nan")}, "device_bytes nan"),
                                             ({"host_bytes": -1}, "host_bytes -1"),
                                             ({"pinned_bytes": float("inf")}, "pinned_bytes inf")])
def test_a_memory_estimate_that_is_no_number_of_bytes_fails_its_cell_named(monkeypatch, estimate, shown):
    from embbench.launch import outcome_without_launch

    scenario, cells = _estimating(monkeypatch, estimate)
    outcome = outcome_without_launch(scenario, cells[0])
    assert outcome.status == "error" and outcome.message == (
        f"strategy 'estimates': estimate_memory returned {shown}; expected a finite number of bytes, at least 0")


# --- out of disk says so ------------------------------------------------------------------------


def _disk_full_at_sync(monkeypatch):
    import errno

    def full(fd):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "fsync", full)


def test_a_full_disk_for_the_weights_copy_costs_the_comparison_not_the_cell(tmp_path, monkeypatch):
    from embbench.runner import run_cell
    from embbench.strategy import RuntimeEnv

    scenario, cells = parse_scenario(tiny_scenario(), "t.yaml")
    weights = tmp_path / "weights" / "device@w1.pt"
    weights.parent.mkdir()
    _disk_full_at_sync(monkeypatch)  # the copy is written whole or not at all (a link to /dev/full is replaced)
    metrics = run_cell(scenario, cells[0], RuntimeEnv(torch.device("cpu")), weights)
    assert metrics["weights_file"] is None and metrics["step_time_s"]["n"] > 0
    assert metrics["weights_not_compared"] == f"cannot save the flushed weights to {weights}: No space left on device"


def test_report_on_a_full_disk_leaves_no_file_and_names_it(tmp_path, capsys, monkeypatch):
    from tests.record_factory import write_run

    run = write_run(tmp_path / "run", [make_record("device"), make_record("cpu", step_times=[0.02] * 12)])
    out = tmp_path / "out"
    out.mkdir()
    _disk_full_at_sync(monkeypatch)
    code, _, err = _cli(capsys, "report", run, "--out", out / "r.html")
    assert code == 2 and err == f"error: --out {out / 'r.html'}: cannot write the report: No space left on device\n"
    assert list(out.iterdir()) == []


def test_trace_record_on_a_full_disk_leaves_no_file_and_names_it(tmp_path, capsys, monkeypatch):
    import yaml

    scenario = tmp_path / "t.yaml"
    scenario.write_text(yaml.safe_dump(tiny_scenario()))
    out = tmp_path / "out"
    out.mkdir()
    _disk_full_at_sync(monkeypatch)
    code, _, err = _cli(capsys, "trace", "record", scenario, "--out", out / "t.npz", "--train-batches", "2")
    assert code == 2 and err == (f"error: [Errno 28] cannot write the trace: No space left on device: "
                                 f"'{out / 't.npz'}'\n")
    assert list(out.iterdir()) == []


def test_data_prepare_on_a_full_disk_names_the_entry(tmp_path, capsys, monkeypatch):
    import errno

    import yaml

    import embbench.data.cache as data_cache
    from embbench.data.fake_criteo import write_fake_criteo

    source = write_fake_criteo(tmp_path / "train.txt", 200, seed=3)
    raw = tiny_scenario(data={"source": "criteo_tsv", "path": str(source), "eval": 0.25, "embedding_dim": 8,
                              "batch_size": 64, "preset": "criteo_kaggle", "scale": 1.0})
    del raw["data"]["preset"], raw["data"]["scale"]
    scenario = tmp_path / "tsv.yaml"
    scenario.write_text(yaml.safe_dump(raw))

    def full(directory):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(data_cache, "write_manifest", full)
    code, _, err = _cli(capsys, "data", "prepare", scenario, "--data-cache", tmp_path / "cache")
    assert code == 2 and "cannot build the data cache entry: No space left on device: " in err
    assert f"'{tmp_path / 'cache'}/" in err  # the entry, by its path
    assert not [p for p in (tmp_path / "cache").rglob("*") if ".tmp-" in p.name]


# --- the sweep tool is a user-facing command too -------------------------------------------------


_SWEEP = "name: s\nalpha: [1.1]\nrows: [2000]\ncache_ratio: [0.05]\nbatch_ids: [128]\nsteps: 4\nwarmup_steps: 2\n"


@pytest.mark.parametrize("content, expected", [
    (None, "{path}: no such scenario file"),
    ("DIR", "{path}: is a directory, not a scenario file"),
    (b"name: s\n\xff\n", "{path}: line 2: not UTF-8 text (byte 0xff at offset 8)"),
    (_SWEEP + "rows: [10]\n", "{path}: line 8, column 1: invalid YAML: duplicate key 'rows' (first on line 3)"),
    (_SWEEP.replace("rows: [2000]", "rows: [0]"), "{path}: rows[0]: Input should be greater than 0"),
    (_SWEEP.replace("cache_ratio: [0.05]", "cache_ratio: [1.5]"), "{path}: cache_ratio[0]: Input should be less than or equal to 1"),
    (_SWEEP.replace("alpha: [1.1]", "alpha: [-1]"), "{path}: alpha[0]: Input should be greater than or equal to 0"),
    (_SWEEP.replace("alpha: [1.1]", "alpha: [.nan]"), "{path}: alpha[0]: Input should be a finite number"),
    (_SWEEP.replace("steps: 4", "steps: true"), "{path}: steps: true is a boolean, not a number"),
    ("[1, 2]", "{path}: a sweep is a mapping of keys, got list"),
], ids=["missing", "directory", "not-utf8", "duplicate-key", "rows-0", "cache-ratio-1.5", "alpha-negative", "alpha-nan",
        "steps-true", "not-a-mapping"])
def test_the_sweep_tool_validates_as_run_does(tmp_path, capsys, content, expected):
    from embbench.cache.sweep import main

    path = tmp_path / "sweep.yaml"
    if content == "DIR":
        path.mkdir()
    elif isinstance(content, bytes):
        path.write_bytes(content)
    elif content is not None:
        path.write_text(content)
    assert main([str(path)]) == 2
    assert capsys.readouterr().err == f"error: {expected.format(path=path)}\n"


def test_the_sweeps_look_ahead_is_bounded_by_its_stream():
    from embbench.cache.sweep import Workload, simulate

    result = simulate(Workload(alpha=1.1, rows=500, cache_ratio=0.1, batch_ids=64, lookahead=1_000_000_000),
                      profile_batches=4, warmup_steps=2, steps=4)  # hung building a billion batches before
    assert result["lookahead_batches"] == 6 and 0 <= result["hit_rate"] <= 1
