"""Runs side by side: cells matched by id, signed relative deltas, and whether a change in
speed is more than noise.

**The significance test.** Mann-Whitney U (two-sided) on the per-step times of the two
cells (``metrics.step_time_s.samples``), at ``ALPHA``. Step times are skewed with a long
tail (a collection, a page fault, a noisy neighbour), so a rank test is the right tool
rather than one that assumes normality; and a run has tens of steps per cell but usually
only three repeats, too few for a useful test on per-repeat throughput (Welch's t on
three values each rarely detects anything, and a rank test on three values each cannot
reach p < 0.1 at all). Steps of one run are not fully independent (a slow phase of the
machine spans several), so read a small p-value as "a shift beyond this run's step-to-step
noise", not as a guarantee that a rerun reproduces it.

Everything here is a pure function of records; the CLI prints what it returns.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable

from embbench.columns import flat_row, get, gpu_names
from embbench.results import Record, RecordError, by_scenario, load_records, scenario_differences
from embbench.scenario import cell_slug

__all__ = [
    "ALPHA", "METRICS", "TEST", "CellComparison", "Delta", "Metric", "Run", "Significance",
    "compare_precisions", "compare_runs", "fp32_cell_id", "load_runs", "parse_percent", "regressions", "step_time_test", "to_json", "what_differs",
]

ALPHA = 0.05
TEST = "Mann-Whitney U, two-sided, on per-step times"

#: Statuses of a cell that did not fail (``unsupported`` is a property of the machine).
_NOT_FAILED = ("ok", "unsupported")


@dataclass(frozen=True)
class Metric:
    """A number compared between runs, read from :func:`embbench.columns.flat_row`."""

    key: str
    label: str
    higher_is_better: bool
    read: Callable[[dict[str, Any]], float | None]


def _first(*keys: str) -> Callable[[dict[str, Any]], float | None]:
    return lambda row: next((row[k] for k in keys if row.get(k) is not None), None)


METRICS = [
    Metric("throughput", "samples/s", True, _first("throughput")),
    Metric("step_time", "step time (median)", False, _first("step_time_median_s")),
    Metric("device_bytes", "device memory", False, _first("device_bytes")),
    Metric("host_bytes", "host memory", False, _first("host_bytes")),
    # per access where counted, else per distinct row (fbgemm's cache counts only those)
    Metric("hit_rate", "hit rate", True, _first("hit_rate", "unique_hit_rate")),
    Metric("auc", "AUC", True, _first("auc")),
]


@dataclass
class Delta:
    """One metric of one cell in both runs; ``relative`` is ``after / before - 1``."""

    before: float | None
    after: float | None
    relative: float | None
    #: "better", "worse", "same" or None (a value is missing)
    direction: str | None


@dataclass
class Significance:
    test: str
    p_value: float | None
    significant: bool | None
    n_before: int
    n_after: int


@dataclass
class CellComparison:
    """One cell id in a baseline run and in a candidate run."""

    cell_id: str
    status_before: str | None  # None: the cell is not in that run
    status_after: str | None
    differences: list[str] = field(default_factory=list)  # why the two are not comparable
    deltas: dict[str, Delta] = field(default_factory=dict)
    significance: Significance | None = None

    @property
    def comparable(self) -> bool:
        return self.status_before == self.status_after == "ok" and not self.differences


@dataclass
class Run:
    path: Path
    records: list[Record]
    #: the files left out, each with why (``RecordError.path`` names the file)
    damaged: list[RecordError] = field(default_factory=list)

    @property
    def label(self) -> str:
        return str(self.path)

    def damaged_cell(self, cell_id: str) -> RecordError | None:
        """The error of this run's record file of ``cell_id`` (``<slug>.json``), if it was left out."""
        name = f"{cell_slug(cell_id)}.json"
        return next((e for e in self.damaged if e.path is not None and e.path.name == name), None)


def _one_scenario(path: Path, records: list[Record]) -> None:
    """A run directory's tables need one scenario: say which are mixed in it, and how they differ."""
    groups = by_scenario(records)
    if len(groups) > 1:
        first = groups[0][0].scenario
        digests = ", ".join(f"{g[0].scenario['digest'][:10]} ({len(g)} cells)" for g in groups)
        raise ValueError(f"{path}: holds records of {len(groups)} scenarios ({digests}; "
                         f"{scenario_differences(first, groups[1][0].scenario)}); compare, recommend and report read "
                         f"one scenario per run directory: move the others into a directory of their own "
                         f"(`embbench show {path}` lists them by scenario)")


def load_runs(paths: list[str | Path], need_records: bool = True) -> list[Run]:
    """Each path's records (damaged files left out, in ``Run.damaged``); a path that is not
    a run, one given twice, a run holding records of more than one scenario, or (with
    ``need_records``) one whose every record is damaged is a ValueError."""
    runs: list[Run] = []
    seen: dict[Path, str] = {}
    for given in paths:
        path = Path(given)
        if not path.exists():
            raise ValueError(f"{path}: no such run directory")
        key = path.resolve()
        if key in seen:
            raise ValueError(f"{path}: the same run is given twice (as {seen[key]} and {given})")
        seen[key] = str(given)
        if path.is_dir() and not any(path.glob("*.json")):
            raise ValueError(f"{path}: not a run directory (no result records *.json in it)")
        damaged: list[RecordError] = []
        records = load_records(path, on_damaged=damaged.append)  # a cell recorded twice is kept once
        if not records and need_records:
            raise ValueError(f"{path}: no usable records (every one is damaged: {damaged[0]})")
        _one_scenario(path, records)
        runs.append(Run(path, records, damaged))
    return runs


def parse_percent(text: str) -> float:
    """``"5%"`` -> 0.05; anything else (a bare number is ambiguous) is a ValueError."""
    value = text.strip()
    try:
        if not value.endswith("%"):
            raise ValueError
        fraction = float(value[:-1]) / 100
    except ValueError:
        raise ValueError(f"--fail-on {text!r}: expected a percentage such as 5%") from None
    if not 0 <= fraction < 1:
        raise ValueError(f"--fail-on {text!r}: expected a percentage from 0% to below 100%")
    return fraction


def step_time_test(before: list[float], after: list[float], alpha: float = ALPHA) -> Significance:
    """Mann-Whitney U (two-sided) of two cells' per-step times (see the module doc).

    Raises:
        MissingDependency: scipy is not installed.
    """
    from embbench.optional import require

    stats = require("scipy.stats", "the significance test (Mann-Whitney U)")

    if len(before) < 2 or len(after) < 2:
        return Significance(TEST, None, None, len(before), len(after))
    p = float(stats.mannwhitneyu(before, after, alternative="two-sided").pvalue)
    return Significance(TEST, p, p < alpha, len(before), len(after))


def _delta(before: float | None, after: float | None, higher_is_better: bool) -> Delta:
    if before is None or after is None:
        return Delta(before, after, None, None)
    relative = after / before - 1 if before else (0.0 if after == before else None)
    if after == before:
        direction = "same"
    else:
        direction = "better" if (after > before) == higher_is_better else "worse"
    return Delta(before, after, relative, direction)


#: Provenance that must match for numbers to be compared: the software that ran the
#: strategies (versions) and the hardware. The git commit may differ: that is what one compares.
_PROVENANCE = ("versions", "devices")


def _provenance_section(record: Record, section: str) -> dict[str, Any]:
    values = dict(record.provenance.get(section) or {})
    if section == "devices" and "gpus" in values:
        values["gpus"] = gpu_names(record.provenance)  # older records hold the names alone
    return values


def what_differs(a: Record, b: Record) -> list[str]:
    """Why two records of the same cell cannot be compared: each differing scenario digest,
    package version (the strategy's package's too) or device, as ``name: before vs after``.
    A key only one record has (written by an embbench that did not record it) is unknown,
    not a difference."""
    out = []
    if get(a.scenario, "digest") != get(b.scenario, "digest"):
        out.append(f"scenario digest: {str(get(a.scenario, 'digest'))[:10]} vs {str(get(b.scenario, 'digest'))[:10]}")
    for section in _PROVENANCE:
        left, right = _provenance_section(a, section), _provenance_section(b, section)
        for key in sorted(set(left) & set(right)):
            if left.get(key) != right.get(key):
                out.append(f"{key}: {left.get(key)} vs {right.get(key)}")
    return out


def compare_records(before: list[Record], after: list[Record], alpha: float = ALPHA) -> list[CellComparison]:
    """Every cell id of either run, compared: the baseline strategy's cells first, then by
    world size and id (the order of the run's table)."""
    by_id_before = {r.cell_id: r for r in before}
    by_id_after = {r.cell_id: r for r in after}
    everything = {**by_id_after, **by_id_before}
    ids = sorted(everything, key=lambda i: (everything[i].strategy != everything[i].baseline, everything[i].world_size, i))
    out = []
    for cell_id in ids:
        a, b = by_id_before.get(cell_id), by_id_after.get(cell_id)
        cell = CellComparison(cell_id, a.status if a else None, b.status if b else None)
        if a and b:
            cell.differences = what_differs(a, b)
        if a and b and cell.comparable:
            row_a, row_b = flat_row(a), flat_row(b)
            cell.deltas = {m.key: _delta(m.read(row_a), m.read(row_b), m.higher_is_better) for m in METRICS}
            cell.significance = step_time_test(row_a["step_time_samples"], row_b["step_time_samples"], alpha)
        out.append(cell)
    return out


def compare_runs(runs: list[Run], alpha: float = ALPHA) -> list[tuple[Run, list[CellComparison]]]:
    """Each run after the first against the first."""
    if len(runs) < 2:
        raise ValueError("compare needs at least two runs")
    return [(run, compare_records(runs[0].records, run.records, alpha)) for run in runs[1:]]


def regressions(cells: list[CellComparison], threshold: float, candidate: Run | None = None) -> list[str]:
    """Why a regression gate fails: a cell whose throughput dropped by more than
    ``threshold`` (a fraction) with a significant change in step times, or a cell that ran
    in the baseline and failed (error, oom, timeout, ...) in the candidate, or is missing
    from it, or whose record there is damaged (a non-finite figure included: ``candidate``
    says which files were left out)."""
    out = []
    for cell in cells:
        if cell.status_before == "ok" and cell.status_after is None:
            damaged = candidate.damaged_cell(cell.cell_id) if candidate else None
            why = f"its record is damaged ({damaged})" if damaged else "missing from the candidate run"
            out.append(f"{cell.cell_id}: {why}")
            continue
        if cell.status_before == "ok" and cell.status_after is not None and cell.status_after not in _NOT_FAILED:
            out.append(f"{cell.cell_id}: was ok, now {cell.status_after}")
            continue
        rate = cell.deltas.get("throughput")
        if rate and rate.relative is not None and rate.relative < -threshold and cell.significance \
                and cell.significance.significant:
            out.append(f"{cell.cell_id}: throughput {100 * rate.relative:+.1f}% "
                       f"(p={cell.significance.p_value:.2g}, beyond -{100 * threshold:g}%)")
    return out


def to_json(pairs: list[tuple[Run, list[CellComparison]]], baseline: Run, alpha: float,
            threshold: float | None, failures: list[str]) -> dict[str, Any]:
    """The comparison as plain data (what ``compare --json`` prints)."""
    return {
        "baseline_run": baseline.label,
        "test": TEST,
        "alpha": alpha,
        "fail_on": threshold,
        "regressions": failures,
        "runs": [{
            "run": run.label,
            "cells": [{**asdict(c), "comparable": c.comparable} for c in cells],
        } for run, cells in pairs],
    }


# --- across row precisions (``compare --match-on strategy``) ----------------------------------------


def fp32_cell_id(record: Record) -> str:
    """The id of the same strategy, parameters and world size with rows in fp32."""
    from embbench.scenario import Cell

    return Cell(record.strategy, record.params, record.world_size).id


def compare_precisions(records: list[Record], alpha: float = ALPHA) -> list[CellComparison]:
    """Each cell of one run whose rows are not fp32 (B) against the same strategy, parameters
    and world size in fp32 (A), as :func:`compare_records` compares two runs' cells. Cells of
    one run share the scenario digest (``run.row_precision`` is not part of it)."""
    fp32 = {r.cell_id: r for r in records if r.row_precision == "fp32"}
    out = []
    for record in sorted((r for r in records if r.row_precision != "fp32"), key=lambda r: r.cell_id):
        reference = fp32.get(fp32_cell_id(record))
        if reference is None:
            out.append(CellComparison(record.cell_id, None, record.status))
            continue
        # the fp32 record under this cell's id, so that the two are matched as one cell
        out += compare_records([reference.model_copy(update={"cell_id": record.cell_id})], [record], alpha)
    return out
