"""fae: the hot set and the hot/cold schedule from training data, the two copies of a hot row
kept consistent, and the weights of ``device`` trained on the same schedule."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings, strategies as st

from baselines.fae import HOT_TAG, FaeParams, FaePlan, FaeStrategy, HotColdTables, plan_hot_cold
from baselines.tables import WholeTables
from embbench.data.batch import SparseFeatures
from embbench.data.presets import TableSpec
from embbench.launch import run_cells
from embbench.runner import run_cell
from embbench.scenario import Cell, parse_scenario
from embbench.strategy import RuntimeEnv, ScheduleContext
from tests.conftest import tiny_scenario
from tests.test_sfctr import _context as _build_context, _features as _jagged

CPU = RuntimeEnv(torch.device("cpu"))


def _context(per_sample: list[list[int]], batch_size: int, rows=(10, 10)) -> ScheduleContext:
    """One-hot samples: ``per_sample[j][t]`` is sample j's id in table t."""
    tables = [TableSpec(f"t{i}", n, 4, 1, 1.0) for i, n in enumerate(rows)]
    ids = torch.tensor(per_sample, dtype=torch.long)
    features = SparseFeatures(ids.t().reshape(-1), torch.ones(ids.numel(), dtype=torch.long), len(rows))
    return ScheduleContext(tables=tables, batch_size=batch_size, num_batches=len(per_sample) // batch_size,
                           world_size=1, seed=0, samples=lambda: features)


def test_golden_trace_hot_set_classification_and_phases():
    # Rows 0 and 1 of table 0 and row 0 of table 1 (global row 10) are the most used.
    samples = [[0, 0], [1, 0], [0, 0], [5, 3], [1, 0], [0, 0], [0, 7], [1, 0]]
    ctx = _context(samples, batch_size=2)
    plan, schedule = plan_hot_cold(ctx, FaeParams(hot_ratio=0.15, profile_fraction=1.0, phase_batches=1))
    assert plan.hot_rows.tolist() == [0, 1, 10]  # 3 of 20 rows
    # hot samples: 0 1 2 4 5 7 (six: three hot batches); cold: 3 and 6 (one batch)
    assert plan.hot_samples == 6 and (plan.hot_batches, plan.cold_batches) == (3, 1)
    assert schedule.order.tolist() == [3, 6, 0, 1, 2, 4, 5, 7]
    assert [s[HOT_TAG] for s in schedule.side] == [False, True, True, True]


def test_a_partial_hot_batch_trains_cold_and_every_sample_is_scheduled_once():
    samples = [[0, 0], [5, 3], [0, 0], [0, 7], [0, 0], [0, 0]]
    plan, schedule = plan_hot_cold(_context(samples, batch_size=2), FaeParams(hot_ratio=0.1, profile_fraction=1.0))
    # hot: 0 2 4 5 -> two hot batches; cold: 1 3
    assert (plan.hot_batches, plan.cold_batches) == (2, 1)
    assert schedule.order.tolist() == [1, 3, 0, 2, 4, 5]
    odd = [[0, 0], [5, 3], [0, 0], [0, 7], [0, 0], [2, 2]]
    plan, schedule = plan_hot_cold(_context(odd, batch_size=2), FaeParams(hot_ratio=0.1, profile_fraction=1.0))
    # three hot samples (0 2 4): one hot batch, sample 4 joins the cold ones in stream order
    assert plan.hot_samples == 3 and plan.hot_batches == 1
    assert schedule.order.tolist() == [1, 3, 4, 5, 0, 2]


def test_the_budget_in_bytes_and_the_profile_fraction():
    params = FaeParams(hot_bytes=3 * 4 * 4)  # three rows of dim 4
    assert params.hot_rows_budget(100, 4) == 3
    assert FaeParams().hot_rows_budget(1000, 4) == 15
    with pytest.raises(ValueError, match="hot_ratio or hot_bytes"):
        FaeParams(hot_ratio=0.1, hot_bytes=10)
    samples = [[i % 3, 0] for i in range(40)]
    plan, _ = plan_hot_cold(_context(samples, batch_size=4), FaeParams(profile_fraction=0.25, hot_ratio=1.0))
    assert plan.profiled_samples == 10
    assert len(plan.hot_rows) <= 4  # only rows the profile saw


@settings(max_examples=40, deadline=None)
@given(data=st.data(), batch=st.integers(1, 4), batches=st.integers(1, 6), ratio=st.floats(0.01, 1.0),
       phase=st.integers(1, 4))
def test_the_schedule_is_a_permutation_and_hot_batches_use_only_hot_rows(data, batch, batches, ratio, phase):
    samples = data.draw(st.lists(st.lists(st.integers(0, 9), min_size=2, max_size=2),
                                 min_size=batch * batches, max_size=batch * batches))
    ctx = _context(samples, batch)
    plan, schedule = plan_hot_cold(ctx, FaeParams(hot_ratio=ratio, profile_fraction=1.0, phase_batches=phase))
    assert sorted(schedule.order.tolist()) == list(range(len(samples)))
    hot_rows = set(plan.hot_rows.tolist())
    assert len(hot_rows) <= FaeParams(hot_ratio=ratio).hot_rows_budget(20, 4)
    tags = [s[HOT_TAG] for s in schedule.side]
    assert tags.count(True) == plan.hot_batches == plan.hot_samples // batch
    for i, hot in enumerate(tags):
        rows = {r + 10 * t for j in schedule.order[i * batch:(i + 1) * batch].tolist() for t, r in enumerate(samples[j])}
        if hot:
            assert rows <= hot_rows
    # alternating phases: the more frequent kind's at most phase_batches long (while the other
    # kind lasts), and no more switches than that needs
    runs = [[tags[0], 1]] if tags else []
    for tag in tags[1:]:
        if tag == runs[-1][0]:
            runs[-1][1] += 1
        else:
            runs.append([tag, 1])
    frequent = tags.count(True) > tags.count(False)
    rounds = -(-max(tags.count(True), tags.count(False)) // phase)
    assert len(runs) <= 2 * rounds
    if min(tags.count(True), tags.count(False)) >= rounds:
        assert all(n <= phase for tag, n in runs if tag == frequent)

FAE = {"hot_ratio": 0.1, "profile_fraction": 0.5, "phase_batches": 3}


def _schedule_of(scenario, params) -> tuple:
    """fae's own schedule for this scenario's run (computed by run_cell the same way)."""
    from embbench.stream import TrainingStream

    run = scenario.run
    steps = run.training_batches_read(profile=False)
    stream = TrainingStream(scenario.data_source(CPU.device), scenario.data.batch_size, 0, 1, num_batches=steps)
    strategy = FaeStrategy(FaeParams(**params))
    return strategy.schedule(stream.schedule_context(scenario.tables(), run.seed)), strategy._plan


def test_device_trained_on_faes_schedule_ends_with_faes_weights(tmp_path):
    raw = tiny_scenario(strategies=[{"name": "device"}, {"name": "fae", "params": FAE}], run={"steps": 4})
    scenario, _ = parse_scenario(raw, "t")
    metrics = run_cell(scenario, Cell("fae", FAE), CPU, tmp_path / "fae.pt")
    schedule, plan = _schedule_of(scenario, FAE)
    run_cell(scenario, Cell("device"), CPU, tmp_path / "device.pt", schedule=schedule)
    for a, b in zip(torch.load(tmp_path / "fae.pt"), torch.load(tmp_path / "device.pt")):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    c = metrics["counters"]["total"]
    assert metrics["schedule"] == "strategy"
    assert c["hot_batches"] > 0 and c["cold_batches"] > 0
    first, end = metrics["counters"]["steps"]  # the counted steps
    assert c["hot_batches"] + c["cold_batches"] == end - first
    assert c["rows_synced"] > 0 and c["rows_synced"] % len(plan.hot_rows) == 0
    extra = metrics["extra"]
    assert extra["hot_rows"] == len(plan.hot_rows) and 0 < extra["hot_sample_fraction"] < 1
    assert "note" not in extra


def test_counters_follow_the_schedule_on_a_golden_run(tmp_path):
    raw = tiny_scenario(run={"warmup_steps": 0, "steps": 12, "repeats": 1})
    scenario, _ = parse_scenario(raw, "t")
    schedule, plan = _schedule_of(scenario, FAE)
    metrics = run_cell(scenario, Cell("fae", FAE), CPU)
    first, end = metrics["counters"]["steps"]  # the counted steps, after the 12 timed ones
    every = [s[HOT_TAG] for s in schedule.side]
    tags = every[first:end]
    switches = sum(every[i - 1] != every[i] for i in range(first, end))  # a sync where the kind changes
    c = metrics["counters"]["total"]
    assert (c["hot_batches"], c["cold_batches"]) == (tags.count(True), tags.count(False))
    assert switches >= 2 and c["rows_synced"] == switches * len(plan.hot_rows)
    assert c["host_syncs"] == 0  # the copy back waits for the device on CUDA only


@pytest.mark.slow
def test_a_hot_set_too_small_for_the_skew_is_said_in_the_record(tmp_path):
    raw = tiny_scenario(strategies=[{"name": "device"}, {"name": "fae", "params": {"hot_ratio": 0.0005}}])
    scenario, cells = parse_scenario(raw, "t")
    records = {r.strategy: r for r in run_cells(scenario, "t", cells, tmp_path)}
    fae = records["fae"]
    assert fae.status == "ok" and fae.semantics == "reordered"
    assert "hot set too small" in fae.metrics["extra"]["note"]
    assert fae.metrics["accuracy"]["auc"] is not None and "max_weight_diff_vs_baseline" not in fae.metrics


def test_fae_cannot_run_on_several_ranks_and_says_why():
    assert "several ranks" in FaeStrategy().unsupported_reason(RuntimeEnv(torch.device("cpu"), world_size=2))
    with pytest.raises(RuntimeError, match="schedule"):
        FaeStrategy().build(None)


@settings(max_examples=30, deadline=None)
@given(steps=st.lists(st.tuples(st.sampled_from(["hot", "cold", "eval"]), st.lists(st.integers(0, 29), min_size=4,
                                                                                   max_size=4)), max_size=10))
@pytest.mark.slow
def test_the_two_copies_of_a_hot_row_stay_consistent_through_switches_and_evaluation(steps):
    hot_rows = torch.tensor([0, 1, 2, 3, 30, 31])  # rows 0-3 of table 0, rows 0-1 of table 1
    plan = FaePlan(hot_rows=hot_rows, hot_samples=0, samples=1, profiled_samples=1, hot_batches=0, cold_batches=0)
    fae, reference = HotColdTables(_build_context(), plan), WholeTables(_build_context())
    for kind, ids in steps:
        if kind == "hot":  # only hot ids: table 0 below 4, table 1 below 2
            ids = [ids[0] % 4, ids[1] % 4, ids[2] % 2, ids[3] % 2]
        features = _jagged([[[ids[0]], [ids[1]]], [[ids[2]], [ids[3]]]])
        features.side[HOT_TAG] = kind == "hot"
        outputs = []
        for module in (fae, reference):
            if kind == "eval":
                with torch.no_grad():
                    outputs.append(module(features))
            else:
                out = module(features)
                (out * torch.linspace(0.5, 2, out.numel()).view_as(out)).sum().backward()
                outputs.append(out.detach())
        torch.testing.assert_close(outputs[0], outputs[1], rtol=0, atol=1e-6)
    for got, want in zip(fae.flush(), reference.flush()):
        torch.testing.assert_close(got, want, rtol=0, atol=1e-6)
    trained = [k for k, _ in steps if k != "eval"]
    c = fae.counters()
    assert (c["hot_batches"], c["cold_batches"]) == (trained.count("hot"), trained.count("cold"))
