"""Where the tables should live, for a memory budget: from measured records only.

Each world size of a run gets its own answer: the fastest cell whose measured memory fits
the budget, the runners-up (and whether the winner is faster beyond noise), and every
other cell with the reason it was left out. Nothing is extrapolated silently: where the
records do not cover the budget (every measured cache is too big, or the budget leaves room
for a much larger cache than any measured), the answer is a list of cells to *run*, each
with the estimate that sized it, never a recommendation of an unmeasured cell.

Memory that must fit (per rank, the largest rank of a cell): on the device, the measured
peak allocation where the device reports one (CUDA) and otherwise the strategy's static
device bytes; on the host, the static host and pinned bytes of all ranks together (one host).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import numpy as np
from pydantic import ByteSize, TypeAdapter, ValidationError

from embbench.columns import flat_rows, get, speed
from embbench.commands import effective_flags, run_command
from embbench.compare import ALPHA, repeat_test
from embbench.eval_scores import read_eval_scores
from embbench.metrics import accuracy_warnings
from embbench.results import Record, RecordError
from embbench.stats import AucComparison, delong, interval_text

__all__ = ["Budget", "Candidate", "Recommendation", "Suggestion", "accuracy_reference", "format_bytes", "parse_size",
           "recommend"]

#: What a run on a CPU answers (said before any cell is named): every cell's "device" memory is
#: this host's, so which placement fits a GPU's memory is not measured here.
CPU_RUN_CAVEAT = ("the placement question cannot be answered here: measured with the host CPU as the device, so "
                  "this ranks the cells' speed on this machine, and no cell's memory is a GPU's (measure on the GPU "
                  "you will train on)")
#: The parameter that sizes a cache (a convention of the built-in cached strategies).
CACHE_RATIO = "cache_ratio"
#: Suggest a larger cache when the budget allows this many times the largest one measured.
_ROOM_FACTOR = 1.5


#: A size, whole: a number and an optional unit, nothing else (pydantic's ByteSize reads the
#: first number of ``16,5GiB`` and ignores what follows ``64GB`` in ``64GB of RAM``).
_SIZE = re.compile(r"\s*[0-9]+(\.[0-9]+)?\s*([kmgtpe]i?b|b)?\s*", re.IGNORECASE)


def parse_size(text: str, flag: str = "size") -> int:
    """``16GiB``, ``512MiB``, ``1.5GB`` (powers of 1000), or a number of bytes; a ValueError
    naming ``flag`` otherwise."""
    malformed = ValueError(f"{flag} {text!r}: expected a size such as 16GiB, 512MiB, 1.5GB or a number of bytes")
    if not _SIZE.fullmatch(text):
        raise malformed
    try:
        size = int(TypeAdapter(ByteSize).validate_python(text.strip()))
    except ValidationError:
        raise malformed from None
    if size <= 0:
        raise ValueError(f"{flag} {text!r}: must be more than 0 bytes")
    return size


def format_bytes(n: float) -> str:
    """``n`` bytes in the largest of GiB, MiB and KiB that leaves at least 1 (else B), to at
    least two significant digits: ``2.19 MiB``, ``512 B``, ``0.5 B`` (a per-step average may
    be a fraction of a byte; ``0.0 MiB`` says nothing)."""
    for unit, scale in (("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= scale:
            return f"{n / scale:,.2f} {unit}"
    return f"{n:,.0f} B" if abs(n) >= 10 else f"{n:.2g} B"


@dataclass(frozen=True)
class Budget:
    device_bytes: int
    host_bytes: int | None = None


@dataclass
class Candidate:
    """A measured cell that fits, as the answer shows it."""

    cell_id: str
    throughput: float
    device_bytes: int
    host_bytes: int
    auc: float | None
    #: against the fastest cell: ``throughput / best - 1`` and the repeats' test verdict
    relative_to_best: float = 0.0
    p_value: float | None = None
    significant: bool | None = None
    #: the interval of ``throughput / best`` (Welch's t over repeats)
    interval: tuple[float, float] | None = None
    #: why this cell's speed is not to be bet on (a busy machine, a wide interval)
    flags: list[str] = field(default_factory=list)
    #: why its speed is not judged against the best's (:func:`embbench.compare.judge`), or None
    not_judged: str | None = None
    #: the type its rows are stored in (``run.row_precision``)
    row_precision: str = "fp32"
    #: its throughput over the baseline's, and over the fastest all-in-HBM cell's (named), or None
    vs_baseline: float | None = None
    vs_hbm: float | None = None
    fastest_hbm_cell: str | None = None

    @property
    def hbm_differs(self) -> bool:
        """Whether the ratio to the fastest all-in-HBM cell says more than the speedup (that
        cell is not the baseline's)."""
        return self.vs_hbm is not None and self.vs_hbm != self.vs_baseline

    def reference_ratios(self) -> str:
        """``, 0.95x the baseline, 0.91x the fastest all-in-HBM cell (gpu_sharded@w1)``: the speed
        against both references (the baseline stays the reference for weights)."""
        parts = [f"{self.vs_baseline:.2f}x the baseline" if self.vs_baseline is not None else "",
                 f"{self.vs_hbm:.2f}x the fastest all-in-HBM cell ({self.fastest_hbm_cell})" if self.hbm_differs else ""]
        return "".join(f", {p}" for p in parts if p)


@dataclass
class Suggestion:
    """A cell worth running because the records do not cover the budget (an estimate)."""

    family: str
    cache_ratio: float
    #: what to add to the scenario file, then ``command`` (the run's own settings, shell-quoted)
    edit: str
    command: str
    basis: str


@dataclass
class Recommendation:
    world_size: int
    best: Candidate | None
    runners_up: list[Candidate] = field(default_factory=list)
    excluded: dict[str, str] = field(default_factory=dict)  # cell id -> why
    suggestions: list[Suggestion] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    #: what must be read before the answer: a CPU run, a winner not ahead beyond noise, a busy machine
    caveats: list[str] = field(default_factory=list)


def _round_down(x: float, digits: int = 2) -> float:
    """``x`` rounded down to ``digits`` significant digits (a ratio that surely fits); the
    1e-9 keeps a fit's rounding noise (0.04999999...) from costing a digit."""
    scale = 10 ** (digits - 1 - math.floor(math.log10(x)))
    return math.floor(x * scale * (1 + 1e-9)) / scale


def _family(record: Record) -> str:
    """A cell id with its cache ratio left out: the cells that differ only in cache size."""
    rest = ",".join(f"{k}={v}" for k, v in sorted(record.params.items()) if k != CACHE_RATIO)
    return f"{record.strategy}[{rest}{',' if rest else ''}{CACHE_RATIO}=?]@w{record.world_size}"


def _fixed_overhead(family: str, fixed: float, slope: float, ratio: float, whole: Record, whole_bytes: int,
                    all_rows: float | None) -> str:
    """Why a cache costs more device memory than no cache at this scale: its fixed part (state
    that does not shrink with the cache) exceeds every table on the device; and, where the
    records say how many rows the tables have, from how many rows the cache pays."""
    text = (f"{family}: about {format_bytes(fixed)} of its device memory is fixed (it does not shrink with "
            f"{CACHE_RATIO}), more than every table on the device ({format_bytes(whole_bytes)}, {whole.cell_id}): "
            "at this scale the cache costs more device memory than no cache")
    if all_rows:  # per row of the tables: the device's bytes against the cache's at ``ratio``
        saved = whole_bytes / all_rows - slope / all_rows * ratio
        if saved > 0:
            text += (f"; at {CACHE_RATIO}={ratio:g} it needs less than {whole.strategy} from about "
                     f"{_round_down(fixed / saved):,.0f} rows (these tables have {all_rows:,.0f})")
    return text


def _cache_suggestions(records: list[Record], rows: dict[str, dict[str, Any]], budget: Budget,
                       winner: str | None, run_dir: str, curve: dict | None = None) -> tuple[list[Suggestion], list[str]]:
    """For each family of cells that differ only in ``cache_ratio``: the largest ratio whose
    device memory fits, from a line through the measured (ratio, device bytes), where the
    records do not cover it: every measured ratio is too big, or the ``winner`` is this
    family's largest measured cache and the budget has room for a much larger one. With a
    cache ``curve`` (``embbench curve``), a suggestion past the curve's knee is the knee."""
    from embbench.cache.curve import knee  # only with a curve

    knee_point = knee(curve) if curve else None
    # the cell that holds every table on the device (the baseline), for what a cache's fixed part costs
    whole = next((r for r in records if r.strategy == r.baseline and r.status == "ok" and r.row_precision == "fp32"), None)
    families: dict[str, list[Record]] = {}
    for r in records:
        if r.status == "ok" and isinstance(r.params.get(CACHE_RATIO), (int, float)):
            families.setdefault(_family(r), []).append(r)
    suggestions, notes = [], []
    for family, members in families.items():
        ratios = np.array([r.params[CACHE_RATIO] for r in members], dtype=float)
        need = np.array([rows[r.cell_id]["device_bytes"] for r in members], dtype=float)
        host = max(rows[r.cell_id]["host_bytes_all_ranks"] for r in members)
        if budget.host_bytes is not None and host > budget.host_bytes:
            notes.append(f"{family}: its host memory ({format_bytes(host)}) exceeds the host budget at every cache ratio")
            continue
        if len(set(ratios)) >= 2:
            slope, fixed = np.polyfit(ratios, need, 1)
            basis = f"a line through {len(members)} measured ratios: {format_bytes(fixed)} + {format_bytes(slope / 100)} per 0.01"
        else:
            slope, fixed = need[0] / ratios[0], 0.0
            basis = (f"proportional to the one measured ratio ({ratios[0]:g}: {format_bytes(need[0])}); the fixed part is "
                     "unknown, so the estimate is optimistic: measure it")
        if slope <= 0:
            notes.append(f"{family}: device memory does not grow with {CACHE_RATIO} in these records; cannot size a cache")
            continue
        sized = next((r for r in members if rows[r.cell_id].get("capacity_rows") and r.params[CACHE_RATIO]), None)
        all_rows = rows[sized.cell_id]["capacity_rows"] / sized.params[CACHE_RATIO] if sized else None
        if all_rows:  # rows a ratio of 1 would cache, from a cell that says how many rows it caches
            basis += f"; about {slope / all_rows:,.0f} bytes per cached row"
        if whole and fixed > rows[whole.cell_id]["device_bytes"]:
            notes.append(_fixed_overhead(family, fixed, slope, min(ratios), whole, rows[whole.cell_id]["device_bytes"],
                                         all_rows))
        best_ratio = (budget.device_bytes - fixed) / slope
        if best_ratio <= 0:
            notes.append(f"{family}: its fixed device memory (about {format_bytes(fixed)}) exceeds the budget at any {CACHE_RATIO}")
            continue
        if best_ratio >= 1:  # a cache of every row is every table on the device
            notes.append(f"{family}: the budget holds a cache of every row ({CACHE_RATIO}=1): with every table on the "
                         f"device no cache is needed; that is `{members[0].baseline}`" + ("" if whole else ": measure it"))
            continue
        fits = need <= budget.device_bytes
        if fits.any():
            largest = max((r for r, f in zip(members, fits) if f), key=lambda r: r.params[CACHE_RATIO])
            if largest.cell_id != winner or best_ratio < _ROOM_FACTOR * largest.params[CACHE_RATIO]:
                continue  # covered: a measured cache fits, and a larger one would not change the answer
        ratio = _round_down(best_ratio)
        if knee_point and knee_point[0] < ratio:
            ratio = _round_down(knee_point[0])
            basis += (f"; the cache curve's knee: MIN hits {100 * knee_point[1]:.1f}% of distinct rows at {ratio:g}, "
                      f"a larger cache gains little")
        scenario = members[0].scenario.get("file", "SCENARIO.yaml")
        edit = f"add {ratio:g} to {members[0].strategy}'s {CACHE_RATIO} list in {scenario}"
        command = run_command(scenario, run_dir, strategies=[members[0].strategy], resume=True,
                              **effective_flags(members[0].scenario.get("config") or {}))
        suggestions.append(Suggestion(family, ratio, edit, command, basis))
    return suggestions, notes


def accuracy_reference(records: list[Record]) -> Record | None:
    """The cell every AUC is held against (``--auc-tolerance``): the baseline strategy's, with
    rows in fp32 where the run has it (a cell in fp16, bf16 or fp8 is held against fp32, never
    against another reduced precision)."""
    measured = [r for r in records if r.strategy == r.baseline and r.status == "ok"]
    return next((r for r in measured if r.row_precision == "fp32"), measured[0] if measured else None)


def _auc_test(reference: Record, record: Record, run_dir: str) -> AucComparison | str | None:
    """``record``'s AUC against ``reference``'s: DeLong's test on the same evaluation samples
    (the run's ``eval/`` files); where they are missing, the two standard errors the records
    hold, unpaired (wider than the paired one); None where neither is there. An eval file that
    is there and damaged (:func:`read_eval_scores`) cannot be judged: what is wrong, as a string."""
    files = [get(x.metrics, "accuracy", "eval_file") for x in (reference, record)]
    if all(files):
        try:
            (a, labels_a), (b, labels_b) = (read_eval_scores(Path(run_dir), f, get(x.metrics, "accuracy", "eval_samples"))
                                            for f, x in zip(files, (reference, record)))
        except RecordError as e:
            return str(e)
        if np.array_equal(labels_a, labels_b):
            return delong(labels_a, a, b)
    aucs = [get(x.metrics, "accuracy", "auc") for x in (reference, record)]
    errors = [get(x.metrics, "accuracy", "auc_standard_error") for x in (reference, record)]
    if None in aucs or None in errors:
        return None
    from embbench.optional import require

    se = math.hypot(*errors)
    norm = require("scipy.stats", "the comparison of AUCs").norm
    return AucComparison(aucs[0], aucs[1], se, float(2 * norm.sf(abs(aucs[1] - aucs[0]) / se)) if se else 1.0,
                         samples=get(record.metrics, "accuracy", "eval_samples"))


def _auc_noise_text(test: AucComparison) -> str:
    how = "DeLong" if test.paired else "unpaired standard errors"
    return (f"±{test.standard_error:.4f}, p={test.p_value:.2g}, {how} on the same "
            + (f"{test.samples:,} " if test.samples else "") + "evaluation samples")


def _listed(cells: list[Candidate], text: Callable[[Candidate], str]) -> str:
    return ", ".join(text(c) for c in cells[:3]) + (f" and {len(cells) - 3} more" if len(cells) > 3 else "")


def _winner_caveats(best: Candidate, runners_up: list[Candidate]) -> list[str]:
    """Why the winner may not be the winner: a runner-up whose interval reaches it (not slower
    beyond noise), one whose interval is clear of it but that the verdict does not judge (said
    so, with why: a busy machine, say), or a winner measured on a busy machine or with a wide interval."""
    out = []
    # not judged with an interval clear of the winner (a busy machine, say): "close" would misstate it
    unjudged = [c for c in runners_up if c.significant is None and c.interval and not c.interval[0] <= 1 <= c.interval[1]]
    close = [c for c in runners_up if not c.significant and c not in unjudged]  # the verdict of the runners-up column
    if close:
        out.append(f"{best.cell_id} is not faster beyond noise than "
                   + _listed(close, lambda c: c.cell_id + ("" if c.interval is None else f" {interval_text(c.interval, 0)}"))
                   + ": run more repeats, or choose among them by memory or accuracy")
    if unjudged:
        out.append(f"not judged against {best.cell_id}: " + _listed(unjudged, lambda c: f"{c.cell_id} ({c.not_judged})"))
    if best.flags:
        out.append(f"{best.cell_id}: {'; '.join(best.flags)}")
    return out


def recommend(records: list[Record], budget: Budget, auc_tolerance: float = 0.001, alpha: float = ALPHA,
              run_dir: str = "RUN", curve: dict | None = None, aa_floor: float | None = None) -> list[Recommendation]:
    """One recommendation per world size of the records (see the module doc); suggested
    cells are to be run into ``run_dir``, at no more than the knee of ``curve`` (an
    ``embbench curve`` of the scenario) where one is given. Each runner-up is judged against the
    best as ``compare`` judges two runs (:func:`embbench.compare.repeat_test`), held to the A/A
    noise floor ``aa_floor`` (:func:`embbench.compare.aa_floor_of`) where one is known.

    A cell is left out when it did not finish (its status), when its memory exceeds the
    budget (by how much), or when its AUC is below the baseline's at the same world size
    by more than ``auc_tolerance`` and beyond its sampling error (:func:`_auc_test`; a drop
    within it is a note, not a reason).
    """
    rows = {row["cell_id"]: row for row in flat_rows(records)}  # with the speed ratios
    out = []
    for world in sorted({r.world_size for r in records}):
        mine = [r for r in records if r.world_size == world]
        rec = Recommendation(world, None)
        base = accuracy_reference(mine)
        base_auc = rows[base.cell_id]["auc"] if base else None
        if base_auc is None:
            rec.notes.append(f"accuracy not checked: no measured AUC of the baseline ({mine[0].baseline}) at {world} rank(s)")
        if any(rows[r.cell_id].get("peak_allocated_bytes") is None for r in mine if r.status == "ok"):
            rec.notes.append("where no device peak was measured (a CPU device), device memory is the strategy's static bytes")
        fitting: list[Candidate] = []
        for r in mine:
            row = rows[r.cell_id]
            if r.status != "ok":
                first_line = (r.message or "").splitlines()[0] if r.message else ""
                rec.excluded[r.cell_id] = f"status {r.status}" + (f": {first_line}" if first_line else "")
                continue
            why = []
            if row["device_bytes"] > budget.device_bytes:
                why.append(f"needs {format_bytes(row['device_bytes'])} device memory per rank, "
                           f"{format_bytes(row['device_bytes'] - budget.device_bytes)} over the budget")
            if budget.host_bytes is not None and row["host_bytes_all_ranks"] > budget.host_bytes:
                why.append(f"needs {format_bytes(row['host_bytes_all_ranks'])} host memory, "
                           f"{format_bytes(row['host_bytes_all_ranks'] - budget.host_bytes)} over the budget")
            if base_auc is not None and row["auc"] is not None and row["auc"] < base_auc - auc_tolerance:
                drop = (f"AUC {row['auc']:.4f} is {base_auc - row['auc']:.4f} below the baseline's {base_auc:.4f} "
                        f"(tolerance {auc_tolerance:g})")
                test = _auc_test(base, r, run_dir)
                if isinstance(test, str):
                    why.append(f"{drop}; cannot judge it against its sampling error: {test}")
                elif test is None:
                    why.append(drop + ", not weighed against its sampling error (no evaluation scores in the records)")
                elif test.p_value < alpha:
                    why.append(f"{drop}, beyond its sampling error ({_auc_noise_text(test)})")
                else:
                    rec.notes.append(f"{r.cell_id}: {drop}, within its sampling error ({_auc_noise_text(test)}): "
                                     "not left out")
            if why:
                rec.excluded[r.cell_id] = "; ".join(why)
            else:
                fitting.append(Candidate(r.cell_id, row["throughput"], row["device_bytes"], row["host_bytes_all_ranks"],
                                         row["auc"], flags=speed(r.metrics).flags, row_precision=r.row_precision,
                                         vs_baseline=row.get("speedup"), vs_hbm=row.get("speedup_vs_hbm"),
                                         fastest_hbm_cell=row.get("fastest_hbm_cell")))
        fitting.sort(key=lambda c: -c.throughput)
        if any(str(r.metrics.get("device", "")).startswith("cpu") for r in mine if r.metrics):
            rec.caveats.append(CPU_RUN_CAVEAT)
        accuracy = [f"{r.cell_id}: {w}" for r in mine if r.status == "ok" and r.metrics
                    for w in accuracy_warnings(r.metrics.get("accuracy"))]
        if accuracy:  # the run's own warning: an AUC check on such numbers decides nothing
            rec.caveats.append(f"accuracy not to be read in {len(accuracy)} cell(s): " + "; ".join(accuracy[:2])
                               + (f"; and {len(accuracy) - 2} more" if len(accuracy) > 2 else ""))
        if fitting:
            rec.best, rec.runners_up = fitting[0], fitting[1:]
            metrics = {r.cell_id: r.metrics for r in mine}
            for c in rec.runners_up:
                c.relative_to_best = c.throughput / rec.best.throughput - 1
                test = repeat_test(metrics[rec.best.cell_id], metrics[c.cell_id], alpha, names=("the best", "this cell"),
                                   aa_floor=aa_floor)
                c.p_value, c.significant, c.interval, c.not_judged = (test.p_value, test.significant, test.interval,
                                                                      test.not_judged)
            rec.caveats += _winner_caveats(rec.best, rec.runners_up)
        else:
            needs = [rows[r.cell_id]["device_bytes"] for r in mine if r.status == "ok"]
            rec.notes.append("no measured cell qualifies" + (
                f"; the smallest needs {format_bytes(min(needs))} device memory per rank" if needs else ""))
        rec.suggestions, notes = _cache_suggestions(mine, rows, budget, rec.best.cell_id if rec.best else None, run_dir,
                                                    curve)
        rec.notes += notes
        out.append(rec)
    return out
