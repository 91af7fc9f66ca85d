"""Runs side by side: cells matched by id, signed relative deltas, and whether a change in
speed is more than noise.

**The unit is the repeat** (:mod:`embbench.stats`): each repeat's median step time is one
sample, because consecutive steps of one run are not independent and a second run meets the
run-to-run variance, not the step-to-step one. Two cells are compared by Welch's t on the log of
their repeat medians: the throughput ratio with its 95 % interval and a p-value.

**One verdict per cell** (:func:`judge`), read by the gate, the table's verdict column, the
HTML report and ``recommend`` alike. A cell is *not judged* (the column reads ``~`` and why,
as asv prints ``~``) when either run was busy (named: A or B), has one repeat, or is noisier
than the threshold (the half-width of its interval over repeats against ``--fail-on X`` or,
without a gate, against the change itself), or when its change lies within the A/A noise floor of
the same comparison and that floor is wider than the threshold. A run's interval over its own
repeats misses what changes between runs (A/A pairs of the smoke scenario showed intervals
beyond -10 %), so Welch's t alone never makes a cell "significant": a judged cell reads
``yes`` when its p-value is below alpha *and* its change is beyond the A/A floor where one
is known (:func:`compare_runs` takes it from a candidate that is the baseline's code and
scenario run again: ``compare A A2 B`` holds B to the floor of A against A2).

**The gate** (``--fail-on X%``): a cell not judged at X makes it exit with
:data:`CANNOT_JUDGE`, never with a pass or a fail; a judged cell regresses when it reads
``yes`` and its whole ratio interval lies below ``1 - X``.

**Memory tiers** (``metrics.tiers``: :data:`TIER_METRICS`) get deltas per tier and no verdict:
they are counted over one run's timed steps, not sampled per repeat.

Everything here is a pure function of records; the CLI prints what it returns.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any, Callable

from embbench.columns import flat_row, get, gpu_names, speed, tier_names
from embbench.results import Record, RecordError, by_scenario, load_records, scenario_differences
from embbench.scenario import cell_slug
from embbench.stats import interval_text, spread_text

__all__ = [
    "ALPHA", "CANNOT_JUDGE", "METRICS", "TEST", "TIER_METRICS", "CellComparison", "Delta", "Metric", "Run",
    "Significance", "TierMetric", "aa_floor_of", "aa_noise_floor", "cannot_judge", "compare_precisions", "compare_runs",
    "fp32_cell_id", "judge", "load_runs", "parse_percent", "regressions", "repeat_test", "same_code_and_scenario", "tier_deltas",
    "to_json", "what_differs",
]

ALPHA = 0.05
TEST = "Welch's t on the log of each repeat's median step time"
#: ``compare --fail-on``'s exit code when the noise (or a busy machine) is wider than the threshold.
CANNOT_JUDGE = 3

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
    Metric("logloss", "log-loss", False, _first("logloss")),
]


@dataclass(frozen=True)
class TierMetric:
    """A figure of each memory tier (``metrics.tiers``: :func:`embbench.metrics.memory_tiers`),
    compared tier by tier. It is counted over one run's timed steps, not sampled per repeat, so
    its change is a delta and never a significance claim."""

    #: the column's name (``--columns``), the same in ``show`` and ``compare``
    key: str
    #: the tier's field in the record (``tier.<tier>.<field>`` in :func:`embbench.columns.flat_row`)
    field: str
    label: str
    higher_is_better: bool

    def read(self, row: dict[str, Any], tier: str) -> float | None:
        return row.get(f"tier.{tier}.{self.field}")


#: The tier tables' columns after the cell and its tier, most important first (the label is the header).
TIER_METRICS = [
    TierMetric("tier_hit_rate", "hit_rate", "rows hit\n(all)", True),
    TierMetric("hit_rate_of_reaching", "hit_rate_of_reaching", "rows hit\n(of reaching)", True),
    TierMetric("stall_seconds_per_step", "stall_seconds_per_step", "stall\na step", False),
    TierMetric("bytes_read_per_step", "bytes_read_per_step", "read\na step", False),
    TierMetric("bytes_written_per_step", "bytes_written_per_step", "written\na step", False),
    TierMetric("ios_per_step", "ios_per_step", "I/Os\na step", False),
    TierMetric("read_amplification", "read_amplification", "read\namplification", False),
    TierMetric("reads_per_second", "reads_per_second", "reads/s\nachieved", True),
    TierMetric("reaching_per_step", "reaching_per_step", "rows reaching\na step", False),
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
    """The repeats of a cell in two runs, tested (:func:`embbench.stats.ratio_test`), and the
    verdict on them (:func:`judge`)."""

    test: str
    p_value: float | None
    #: the verdict: the change is real (True), not shown (False), or the cell is not judged (None)
    significant: bool | None
    n_before: int  # repeats
    n_after: int
    #: throughput after / before (median of repeat medians) and its interval
    ratio: float | None = None
    interval: tuple[float, float] | None = None
    #: each run's noise: the half-width of its interval over repeats, relative to its step time
    noise_before: float | None = None
    noise_after: float | None = None
    #: why each side is not to be bet on (a busy machine, a wide interval)
    flags_before: list[str] = field(default_factory=list)
    flags_after: list[str] = field(default_factory=list)
    alpha: float = ALPHA
    #: the A/A noise floor this cell is held to: the largest change between two runs of the same
    #: code and scenario in the same comparison, as ``|log(ratio)|``, where one is known
    aa_floor: float | None = None
    #: why the cell is not judged (None: it is); see :func:`judge`
    not_judged: str | None = None
    #: the names of the two sides in ``not_judged`` (the runs A and B; recommend's two cells)
    names: tuple[str, str] = ("A", "B")


@dataclass
class CellComparison:
    """One cell id in a baseline run and in a candidate run."""

    cell_id: str
    status_before: str | None  # None: the cell is not in that run
    status_after: str | None
    differences: list[str] = field(default_factory=list)  # why the two are not comparable
    deltas: dict[str, Delta] = field(default_factory=dict)
    significance: Significance | None = None
    #: tier -> TierMetric key -> its delta, for the tiers either record has (counted: no significance)
    tier_deltas: dict[str, dict[str, Delta]] = field(default_factory=dict)

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


def repeat_test(before: dict[str, Any], after: dict[str, Any], alpha: float = ALPHA, threshold: float | None = None,
                names: tuple[str, str] = ("A", "B"), aa_floor: float | None = None) -> Significance:
    """Two cells' repeats tested (Welch's t on the log of the repeat medians; see the module doc),
    from their records' metrics, and judged at ``threshold`` (:func:`judge`) and against the A/A
    noise floor ``aa_floor`` (:func:`aa_floor_of`) where one is known: the one judgement of two
    cells that compare, its gate, recommend and the report's verdict all read.

    Raises:
        MissingDependency: scipy is not installed.
    """
    from embbench.stats import ratio_test

    a, b = speed(before), speed(after)
    result = ratio_test(a.repeat_medians_s, b.repeat_medians_s)
    return judge(Significance(TEST, result.p_value, None, result.n_before, result.n_after, result.ratio,
                              result.interval, a.noise, b.noise, a.flags, b.flags, alpha, aa_floor=aa_floor,
                              names=names), threshold)


def judge(sig: Significance, threshold: float | None = None) -> Significance:
    """``sig`` with its verdict at ``threshold`` (a fraction; None: no gate, and a run's noise is
    held to the change itself): why it is not judged, or whether its change is real (see the
    module doc).
    Every reader of a comparison (the gate, the tables, the report, recommend) reads this."""
    why = []
    for name, flags in zip(sig.names, (sig.flags_before, sig.flags_after)):
        why += [f"busy in {name}: {f.removeprefix('busy: ')}" for f in dict.fromkeys(flags) if f.startswith("busy")]
    if sig.interval is None:
        why.append("one repeat, no interval (run.repeats >= 2)")
    change = abs(math.log(sig.ratio))  # on the log scale, where a halving and a doubling are as far
    for name, noise in zip(sig.names, (sig.noise_before, sig.noise_after)):
        if noise is not None and (math.log1p(noise) > change if threshold is None else noise > threshold):
            why.append(f"noise {spread_text(noise)} in {name}, wider than " +
                       (f"the change ({100 * (sig.ratio - 1):+.1f}%)" if threshold is None else f"{100 * threshold:g}%"))
    within_floor = sig.aa_floor is not None and change <= sig.aa_floor
    if within_floor and (threshold is None or sig.aa_floor > -math.log1p(-threshold)):
        why.append(f"within the A/A noise floor ({spread_text(math.expm1(sig.aa_floor))})")
    not_judged = "; ".join(why) or None
    significant = None if not_judged or sig.p_value is None else sig.p_value < sig.alpha and not within_floor
    return replace(sig, not_judged=not_judged, significant=significant)


def _delta(before: float | None, after: float | None, higher_is_better: bool) -> Delta:
    if before is None or after is None:
        return Delta(before, after, None, None)
    relative = after / before - 1 if before else (0.0 if after == before else None)
    if after == before:
        direction = "same"
    else:
        direction = "better" if (after > before) == higher_is_better else "worse"
    return Delta(before, after, relative, direction)


def tier_deltas(before: dict[str, Any], after: dict[str, Any]) -> dict[str, dict[str, Delta]]:
    """The :data:`TIER_METRICS` of each tier either :func:`embbench.columns.flat_row` has, before
    and after (a tier only one has: the other side None, no direction)."""
    tiers = dict.fromkeys(tier_names(before) + tier_names(after))
    return {tier: {m.key: _delta(m.read(before, tier), m.read(after, tier), m.higher_is_better) for m in TIER_METRICS}
            for tier in tiers}


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


def compare_records(before: list[Record], after: list[Record], alpha: float = ALPHA,
                    threshold: float | None = None) -> list[CellComparison]:
    """Every cell id of either run, compared and judged at ``threshold`` (:func:`judge`): the
    baseline strategy's cells first, then by world size and id (the order of the run's table)."""
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
            cell.significance = repeat_test(a.metrics, b.metrics, alpha, threshold)
            cell.tier_deltas = tier_deltas(row_a, row_b)
        out.append(cell)
    return out


def compare_runs(runs: list[Run], alpha: float = ALPHA,
                 threshold: float | None = None) -> list[tuple[Run, list[CellComparison]]]:
    """Each run after the first against the first, judged at ``threshold``; where a candidate is
    the baseline's code and scenario run again (an A/A pair), every cell is held to its noise
    floor (:func:`aa_noise_floor`: the largest change of those pairs)."""
    if len(runs) < 2:
        raise ValueError("compare needs at least two runs")
    pairs = [(run, compare_records(runs[0].records, run.records, alpha, threshold)) for run in runs[1:]]
    floor = _floor(pairs, runs[0])
    if floor is not None:
        for _, cells in pairs:
            for cell in cells:
                if cell.significance:
                    cell.significance = judge(replace(cell.significance, aa_floor=floor), threshold)
    return pairs


def _floor(pairs: list[tuple[Run, list[CellComparison]]], baseline: Run) -> float | None:
    """The largest ``|log(throughput ratio)|`` of a comparable cell over the pairs that are A/A."""
    return max((abs(math.log(c.significance.ratio)) for run, cells in pairs if same_code_and_scenario(baseline, run)
                for c in cells if c.comparable and c.significance), default=None)


def aa_floor_of(runs: list[Run]) -> float | None:
    """The A/A noise floor among ``runs`` as :func:`compare_runs` holds every cell to it: the
    largest throughput change (``|log(ratio)|``) of a cell between the first run and a later one
    that is the same code and scenario run again (:func:`same_code_and_scenario`); None where
    no later run is. The report's verdict and ``recommend --noise-floor-from`` read it too."""
    aa = [run for run in runs[1:] if same_code_and_scenario(runs[0], run)]
    return _floor([(run, compare_records(runs[0].records, run.records)) for run in aa], runs[0]) if aa else None


def regressions(cells: list[CellComparison], threshold: float, candidate: Run | None = None) -> list[str]:
    """Why a regression gate fails: a cell whose verdict at ``threshold`` (a fraction;
    :func:`judge`) is a real change whose whole throughput-ratio interval lies below ``1 - threshold``,
    or a cell that ran in the baseline and failed (error, oom, timeout, ...) in the candidate,
    or is missing from it, or whose record there is damaged (a non-finite figure included:
    ``candidate`` says which files were left out)."""
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
        sig = judge(cell.significance, threshold) if cell.significance else None
        if sig and sig.significant and sig.interval[1] < 1 - threshold:
            out.append(f"{cell.cell_id}: throughput {100 * (sig.ratio - 1):+.1f}% (95% interval "
                       f"{interval_text(sig.interval)}, "
                       f"beyond -{100 * threshold:g}%)")
    return out


def cannot_judge(cells: list[CellComparison], threshold: float) -> list[str]:
    """The comparable cells a gate at ``threshold`` cannot judge (:func:`judge`), each with why:
    either run was measured on a busy machine (named), its noise over repeats is wider than the
    threshold, it has one repeat, or its change is within an A/A floor wider than the threshold."""
    out = []
    for cell in cells:
        why = judge(cell.significance, threshold).not_judged if cell.comparable and cell.significance else None
        if why:
            out.append(f"{cell.cell_id}: cannot judge at {100 * threshold:g}%: {why}")
    return out


def same_code_and_scenario(a: Run, b: Run) -> bool:
    """Whether two runs are an A/A pair: the same effective scenario by the same clean commit."""
    def identity(run: Run) -> set[tuple[Any, Any, Any]]:
        return {(r.scenario.get("digest"), get(r.provenance, "git", "commit"), get(r.provenance, "git", "dirty"))
                for r in run.records}

    ida, idb = identity(a), identity(b)
    return len(ida) == 1 and ida == idb and None not in next(iter(ida))[:2] and next(iter(ida))[2] is False


def aa_noise_floor(cells: list[CellComparison]) -> tuple[float, float] | None:
    """Over the comparable cells of an A/A pair: the largest throughput change seen, and the
    largest reach of a ratio interval (both as fractions): what a decision between two
    placements must beat on this machine. None without a comparable cell."""
    tests = [c.significance for c in cells if c.comparable and c.significance and c.significance.ratio]
    if not tests:
        return None
    change = max(abs(t.ratio - 1) for t in tests)
    reach = max((max(abs(t.interval[0] - 1), abs(t.interval[1] - 1)) for t in tests if t.interval), default=change)
    return change, reach


def to_json(pairs: list[tuple[Run, list[CellComparison]]], baseline: Run, alpha: float,
            threshold: float | None, failures: list[str], undecided: list[str] = ()) -> dict[str, Any]:
    """The comparison as plain data (what ``compare --json`` prints)."""
    def floor(run: Run, cells: list[CellComparison]) -> dict[str, float] | None:
        found = aa_noise_floor(cells) if same_code_and_scenario(baseline, run) else None
        return {"largest_change": found[0], "largest_interval_reach": found[1]} if found else None

    return {
        "baseline_run": baseline.label,
        "test": TEST,
        "alpha": alpha,
        "fail_on": threshold,
        "regressions": failures,
        "cannot_judge": list(undecided),
        "runs": [{
            "run": run.label,
            "aa_noise_floor": floor(run, cells),
            "cells": [{**asdict(c), "comparable": c.comparable} for c in cells],
        } for run, cells in pairs],
    }


# --- across row precisions (``compare --match-on strategy``) ----------------------------------------


def fp32_cell_id(record: Record) -> str:
    """The id of the same strategy, parameters and world size with rows in fp32."""
    from embbench.scenario import Cell

    return Cell(record.strategy, record.params, record.world_size).id


def compare_precisions(records: list[Record], alpha: float = ALPHA, threshold: float | None = None) -> list[CellComparison]:
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
        out += compare_records([reference.model_copy(update={"cell_id": record.cell_id})], [record], alpha, threshold)
    return out
