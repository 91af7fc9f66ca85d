"""The harness's instruments never run in a timed step (issue 47, item 1): they run in the
counted steps after the timed ones, whose counters the record reports, and the record names
each instrument, the steps it ran in and its cost measured in the same run."""

from __future__ import annotations

import pytest
import torch

from embbench import runner
from embbench.cache import freqcache
from embbench.metrics import OpCounter, instrument_costs
from embbench.results import TIMED_INSTRUMENT_SHARE, Record, write_record
from record_factory import make_record
from conftest import tiny_scenario, train_and_flush


def test_freqcache_records_its_belady_stream_in_counted_steps_only(tmp_path, monkeypatch):
    """Each call of the Belady recorder is logged with the runner's phase: only the counted
    steps record (never a timed step, nor the untimed steps that count operators), and the
    record's instruments and counters name those steps."""
    phase = {"now": None}
    calls: list[str] = []
    progress = runner._Progress.__call__

    def follow(self, name, *args, **kwargs):
        phase["now"] = name
        return progress(self, name, *args, **kwargs)

    record = freqcache._StreamRecorder.record

    def logged(self, rows):
        calls.append("ops" if OpCounter.active is not None else phase["now"])
        return record(self, rows)

    monkeypatch.setattr(runner._Progress, "__call__", follow)
    monkeypatch.setattr(freqcache._StreamRecorder, "record", logged)
    raw = tiny_scenario(run={"warmup_steps": 2, "steps": 3, "repeats": 2})
    _, metrics = train_and_flush(raw, "freqcache", {"cache_ratio": 0.05, "belady_steps": 8}, tmp_path=tmp_path)
    assert calls and set(calls) == {"count"}, calls
    timed_end = metrics["warmup_steps_run"] + metrics["measured_steps"]
    assert metrics["counters"]["steps"] == [timed_end, timed_end + 3]
    instruments = {i["name"]: i for i in metrics["instruments"]}
    assert set(instruments) == {"belady_stream", "tiers_by_table", "update_work"}
    for instrument in instruments.values():
        assert instrument["steps"] == [timed_end, timed_end + 3] and instrument["timed"] is False
        assert "cost_share" in instrument
    # each counted step plans the next batch (prefetch): the window is those batches
    assert metrics["extra"]["belady_window"] == [timed_end + 1, timed_end + 1 + len(calls)]


def test_device_counts_its_update_work_over_the_counted_steps_only(tmp_path):
    raw = tiny_scenario(run={"warmup_steps": 1, "steps": 2, "repeats": 2, "sparse_backward": "padded"})
    _, metrics = train_and_flush(raw, "device", tmp_path=tmp_path)
    assert [i["name"] for i in metrics["instruments"]] == ["update_work"]
    counters = metrics["counters"]
    assert counters["steps"] == [5, 7]  # after 1 warm-up and 2 x 2 timed steps
    assert counters["per_step"]["accesses"] == counters["total"]["accesses"] / 2
    # every cell trains the counted steps: the same batches before its evaluation
    assert metrics["trained_steps"] >= 7
    assert counters["total"]["update_entries"] == counters["total"]["accesses"] > 0  # padded: an entry an id


@pytest.mark.parametrize("padded", [True, False])
def test_a_store_that_is_not_counting_issues_no_counting_operator_and_counts_nothing(padded):
    """The row store's work counters (update entries, the most ids on one row) are an
    instrument: off (the timed steps), a step issues none of their operators, by name."""
    from embbench.embedding import RowStore
    from embbench.optim import EmbeddingOptimizer

    def step(counting: bool) -> tuple[dict[str, int], dict[str, int]]:
        store = RowStore(torch.zeros(10, 4), torch.zeros(10, 1), EmbeddingOptimizer(type="rowwise_adagrad", lr=0.1))
        store.padded_aggregation, store.update_kernel, store.counting = padded, False, counting
        rows, offsets = torch.tensor([1, 1, 3, 1, 7]), torch.tensor([0, 2, 5])
        with OpCounter(torch.device("cpu")) as ops:
            store.apply_gradient(rows, offsets, torch.ones(2, 4))
        return dict(ops.by_name), store.work_counters()

    (silent, none), (counted, work) = step(False), step(True)
    assert none == {} and work["ids_max_per_row"] == 3
    # counting adds operators and takes none away
    assert all(counted.get(name, 0) >= n for name, n in silent.items()) and counted != silent
    if padded:  # the search for the most ids on one row
        assert counted["cummax"] == 1 and "cummax" not in silent


def test_instrument_costs_are_the_counted_steps_median_less_the_timed_ones():
    costs = instrument_costs({"b": "second", "a": "first"}, (10, 14), [0.010, 0.011, 0.012, 0.030], (14, 17),
                             [0.0125, 0.0135, 0.013])
    assert [c["name"] for c in costs] == ["a", "b"]
    assert costs[0]["steps"] == [14, 17] and costs[0]["timed"] is False
    assert costs[0]["counted_step_s"] == pytest.approx(0.013)
    assert costs[0]["cost_s_per_step"] == pytest.approx(0.013 - 0.0115)
    assert costs[0]["cost_share"] == pytest.approx((0.013 - 0.0115) / 0.0115)
    assert instrument_costs({}, (0, 1), [1.0], (1, 2), [1.0]) == []
    assert instrument_costs({"a": "x"}, (0, 4), [1.0], (2, 6), [1.0])[0]["timed"] is True  # overlapping steps


def _instrument(**overrides):
    return {"name": "fbgemm_cache_counts", "what": "x", "steps": [20, 50], "timed": False, "counted_step_s": 0.0125,
            "cost_s_per_step": 0.0025, "cost_share": 0.25, **overrides}


def _with_instrument(**changes) -> dict:
    """A valid uvm_cache record's fields, its one instrument changed (None: the key left out)."""
    data = make_record("uvm_cache", instruments=[_instrument()]).model_dump()
    instrument = data["metrics"]["instruments"][0]
    instrument.update(changes)
    for key in [k for k, v in changes.items() if v is None]:
        del instrument[key]
    return data


def test_the_record_refuses_an_instrument_timed_without_its_cost_or_above_one_percent(tmp_path):
    ok = make_record("uvm_cache", instruments=[_instrument()])
    assert write_record(tmp_path, ok.cell_id.replace("@", "_"), ok).exists()  # counted steps only: any cost
    Record.model_validate(_with_instrument(timed=True, cost_share=TIMED_INSTRUMENT_SHARE / 2))
    with pytest.raises(ValueError, match=r"metrics.instruments.0: fbgemm_cache_counts ran in timed steps and cost "
                                         r"25.0 % of the step \(at most 1 %\)"):
        Record.model_validate(_with_instrument(timed=True))
    with pytest.raises(ValueError, match="ran in timed steps without its measured cost"):
        Record.model_validate(_with_instrument(timed=True, cost_share=None))
    with pytest.raises(ValueError, match="low end 50 above high end 20"):
        Record.model_validate(_with_instrument(steps=[50, 20]))



def test_freqcache_counts_its_tables_in_counted_steps_only_and_without_a_scatter(tmp_path, monkeypatch):
    """The per-table counts (metrics.tiers_by_table) are an instrument: they run in the counted
    steps only, are named in the record, and issue no accumulating scatter onto the tables'
    few cells (the sorted rows are read at the tables' bounds)."""
    phase = {"now": None}
    calls: list[tuple[str, dict[str, int]]] = []
    progress, count_tables = runner._Progress.__call__, freqcache.FreqCache._count_tables

    def follow(self, name, *args, **kwargs):
        phase["now"] = name
        return progress(self, name, *args, **kwargs)

    def logged(self, rows, plan):
        with OpCounter(torch.device("cpu")) as ops:
            count_tables(self, rows, plan)
        calls.append((phase["now"], dict(ops.by_name)))

    monkeypatch.setattr(runner._Progress, "__call__", follow)
    monkeypatch.setattr(freqcache.FreqCache, "_count_tables", logged)
    raw = tiny_scenario(run={"warmup_steps": 2, "steps": 3, "repeats": 2})
    _, metrics = train_and_flush(raw, "freqcache", {"cache_ratio": 0.05}, tmp_path=tmp_path)
    assert calls and {name for name, _ in calls} == {"count"}, [name for name, _ in calls]
    assert all(not {"index_add_", "index_add", "scatter_add_", "scatter_add"} & set(ops) for _, ops in calls), calls[0][1]
    assert "tiers_by_table" in {i["name"] for i in metrics["instruments"]}
    by_table = metrics["tiers_by_table"]
    assert sum(t[0]["reaching_per_step"] for t in by_table.values()) == pytest.approx(metrics["tiers"][0]["reaching_per_step"])
