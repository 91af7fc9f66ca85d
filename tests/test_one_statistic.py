"""One throughput statistic everywhere (issue 49, point 6): ``project``'s measured point is the
median of the repeats' medians that ``show`` prints, not the mean step."""

from __future__ import annotations

import statistics

import pytest

from embbench.columns import flat_row
from embbench.projection import project
from embbench.scenario import parse_scenario
from tests.conftest import tiny_scenario
from tests.record_factory import make_record


def test_project_measures_what_show_prints():
    steps = [0.010] * 11 + [0.100] * 1  # one slow step: its mean is 17.5 ms, the medians' median 10 ms
    record = make_record("device", step_times=steps, repeats=3)
    assert statistics.mean(steps) > 1.5 * statistics.median(steps)
    scenario, _ = parse_scenario(tiny_scenario(), "t.yaml")
    (row,) = project(record, scenario.tables(), [1], {"any": 1.0})
    shown = flat_row(record)["throughput"]
    assert record.metrics["samples_per_step"] / row["measured_step_s"] == pytest.approx(shown, rel=1e-12)
    assert row["samples_per_s"] == pytest.approx(shown, rel=1e-12)  # one rank: no collective, the point itself
