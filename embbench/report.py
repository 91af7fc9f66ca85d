"""Comparison tables of result records (rich)."""

from __future__ import annotations

import dataclasses

from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from embbench.columns import (Reference, all_in_hbm_throughputs, baseline_throughputs, device_need_bytes, flat_row,
                              instrument_columns, speed, tier_names)
from embbench.compare import METRICS, TIER_METRICS, CellComparison, Delta, Significance, repeat_test
from embbench.metrics import accuracy_warnings
from embbench.recommend import CACHE_RATIO, CPU_RUN_CAVEAT, Budget, Recommendation, format_bytes, recommend
from embbench.results import Record
from embbench.stats import interval_text
from embbench.table_view import Column, Grid, Row, View, print_grid, view_part

__all__ = ["COMPARE_COLUMNS", "DELTA_COLUMNS", "RESULT_COLUMNS", "SHOW_COLUMNS", "TIER_COLUMNS", "comparison_grid",
           "delta_grid", "print_comparison", "print_deltas", "print_recommendations", "print_torchrec_plans",
           "profile_tables", "tier_delta_grid", "tier_grid", "verdict"]

_STATUS_STYLE = {"ok": "green", "unsupported": "yellow", "skipped": "yellow", "error": "red", "oom": "magenta", "timeout": "red",
                 "diverged": "red"}

#: Counters of the seed systems' bookkeeping, shown per step when a strategy reports them.
_BOOKKEEPING = {"host_syncs": "syncs", "rows_synced": "rows synced", "hot_batches": "hot", "cold_batches": "cold",
                "pipeline_stalls": "stalls", "host_plan_us": "plan µs",
                "host_wait_us": "wait µs"}


def _mib(n: int | None) -> str:
    return "-" if n is None else f"{n / 2**20:,.1f}"


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def _get(d: dict[str, Any] | None, *keys: str) -> Any:
    for k in keys:
        if not isinstance(d, dict):
            return None
        d = d.get(k)
    return d


def _hit_rates(hit, bound, unique_hit, unique_bound) -> str:
    """Per access (with its bound), and per distinct row when it has a bound of its own."""
    if hit is None:
        return f"{_pct(unique_hit)} uniq" if unique_hit is not None else ""
    text = _pct(hit) + (f" ({_pct(bound)})" if bound is not None else "")
    if unique_hit is not None and unique_bound is not None:
        text += f"\nuniq {_pct(unique_hit)} ({_pct(unique_bound)})"
    return text


#: The results table's columns, most important first: a narrow terminal keeps the first ones.
RESULT_COLUMNS = [
    Column("cell", "cell", always=True, justify="left"),
    Column("status", "status", always=True, justify="left"),
    Column("throughput", "samples/s\n(95% interval)", always=True),
    Column("step_time", "step ms\nrepeats / p95", always=True),
    Column("speedup", "speedup", always=True),
    Column("speedup_hbm", "vs\nHBM", always=True),
    Column("device_bytes", "device MiB\nstatic / peak"),
    Column("hit_rate", "hit rate per\naccess (MIN est.)"),
    Column("cpu", "CPU ms\nper step"),
    Column("host_bytes", "host MiB"),
    Column("auc", "AUC"),
    Column("comm", "comm\nMiB/step"),
    Column("h2d_d2h", "H2D / D2H\nMiB/step"),
    Column("logloss", "logloss"),
    Column("max_dw", "max |Δw|"),
    Column("order", "order"),
    Column("ops_syncs", "ops / syncs\nper step"),
    Column("bookkeeping", "bookkeeping\nper step"),
    Column("instruments", "instruments\ncost"),
    Column("ranks", "ranks"),  # also in the cell id (@wN)
]


def _row(r: Record, baseline_rate: dict[tuple[str, int], float], hbm: dict[tuple[str, int], Reference]) -> Row:
    """A cell's numbers as text, and the raw numbers the HTML table sorts by."""
    row = Row({"cell": Text(r.cell_id), "status": Text(r.status, style=_STATUS_STYLE.get(r.status, "")),
               "ranks": str(r.world_size)},
              {"cell": r.cell_id, "status": r.status, "ranks": r.world_size})
    if r.status != "ok" or not r.metrics:
        return row
    m = r.metrics
    step = m["step_time_s"]
    fast = speed(m)
    ci, rate = fast.throughput_interval, fast.throughput
    cpu = m.get("cpu_seconds_per_step")
    base = baseline_rate.get((r.scenario["digest"], r.world_size))
    fastest = hbm.get((r.scenario["digest"], r.world_size))
    # (where the fastest all-in-HBM cell is the baseline's, the column would repeat speedup: left empty)
    hbm_rate = fastest.throughput if fastest and fastest.throughput != base else None
    instruments = instrument_columns(m)
    per_step = _get(m, "counters", "per_step") or {}
    mem = m["memory"]
    auc, logloss = _get(m, "accuracy", "auc"), _get(m, "accuracy", "logloss")
    hit, bound = _get(m, "counters", "hit_rate"), _get(m, "extra", "belady_hit_rate")
    unique_hit = _get(m, "counters", "unique_hit_rate")
    if _get(m, "extra", "window_hit_rate") is not None:  # MIN counted over a window: the policy over the same steps
        hit, unique_hit = m["extra"]["window_hit_rate"], _get(m, "extra", "window_unique_hit_rate")
    # a rounded cell against the baseline in its own precision where the run has it (not its fp32 rounding)
    diff = m.get("max_weight_diff_vs_baseline_same_precision", m.get("max_weight_diff_vs_baseline")) \
        if r.semantics == "exact" else None
    moved = per_step.get("bytes_h2d", 0) + per_step.get("bytes_d2h", 0)
    ops, syncs = m.get("ops_per_step"), m.get("host_syncs_per_step")
    bookkeeping = ", ".join(f"{label} {per_step[k]:,.3g}" for k, label in _BOOKKEEPING.items() if per_step.get(k))
    host = mem["static_host_bytes"] + mem["pinned_bytes"]
    row.cells.update({
        "step_time": f"{fast.step_s * 1e3:,.2f} / {step['p95'] * 1e3:,.2f}",
        "throughput": _throughput_text(rate, ci, fast.flags, bool(m["throughput"].get("ci95_missing"))),
        "cpu": "" if cpu is None else f"{cpu * 1e3:,.2f}",
        "speedup": f"{rate / base:.2f}x" if base else "-",
        "speedup_hbm": f"{rate / hbm_rate:.2f}x" if hbm_rate else "-",
        "instruments": "" if instruments["instruments_cost_share"] is None else
            f"{100 * instruments['instruments_cost_share']:+.1f} % ({instruments['instruments']})",
        "hit_rate": _hit_rates(hit, bound, unique_hit, _get(m, "extra", "belady_unique_hit_rate")),
        "h2d_d2h": "" if not moved else
            f"{per_step.get('bytes_h2d', 0) / 2**20:,.2f} / {per_step.get('bytes_d2h', 0) / 2**20:,.2f}",
        "comm": f"{per_step['bytes_comm'] / 2**20:,.2f}" if per_step.get("bytes_comm") else "",
        "device_bytes": f"{_mib(mem['static_device_bytes'])} / {_mib(mem.get('peak_allocated_bytes'))}",
        "host_bytes": _mib(host),
        "auc": "-" if auc is None else f"{auc:.4f}",
        "logloss": "-" if logloss is None else f"{logloss:.4f}",
        "max_dw": "" if diff is None else f"{diff:.1e}",
        "ops_syncs": "" if ops is None else f"{ops:,.0f}" + ("" if syncs is None else f" / {syncs:,.1f}"),
        "bookkeeping": bookkeeping,
        "order": "" if r.semantics == "exact" else r.semantics,
    })
    row.sort.update({
        "step_time": fast.step_s, "throughput": rate, "cpu": cpu, "speedup": rate / base if base else None,
        "speedup_hbm": rate / hbm_rate if hbm_rate else None, "instruments": instruments["instruments_cost_share"],
        "hit_rate": hit if hit is not None else unique_hit, "h2d_d2h": moved or None,
        "comm": per_step.get("bytes_comm"), "device_bytes": device_need_bytes(mem), "host_bytes": host,
        "auc": auc, "logloss": logloss, "max_dw": diff, "ops_syncs": ops,
    })
    return row


def _throughput_text(rate: float, interval: tuple[float, float] | None, flags: list[str], no_scipy: bool) -> Text:
    """``14,099 (13,500-14,700)``, and a mark where the cell is not to be bet on."""
    text = Text(f"{rate:,.0f}")
    if interval:
        text.append(f" ({interval[0]:,.0f}-{interval[1]:,.0f})", style="dim")
    elif no_scipy:
        text.append(" (no interval: no scipy)", style="dim")
    for kind in dict.fromkeys(f.split(":")[0] for f in flags):
        text.append(f" {kind}!", style="bold yellow")
    return text


def host_device_caption(records: list[Record]) -> str | None:
    """What comes first on every table of a run whose device was the host: it is no placement result."""
    if any(r.metrics and str(r.metrics.get("device", "")).startswith("cpu") for r in records):
        return ("the device here is the host CPU: these speeds show the machinery, not a placement decision "
                "(run on the GPU you will train on for that)")
    return None


def _table_order(records: list[Record]) -> list[Record]:
    """The baseline strategy's cells first, then by world size and id."""
    baseline_name = records[0].baseline if records else None
    return sorted(records, key=lambda r: (r.strategy != baseline_name, r.world_size, r.cell_id))


def comparison_grid(records: list[Record], title: str | None = None) -> Grid:
    """One row per cell: speed against the baseline, memory, accuracy, cache counters."""
    baseline_name = records[0].baseline if records else None
    records = _table_order(records)
    baseline_rate, hbm = baseline_throughputs(records), all_in_hbm_throughputs(records)
    fastest = sorted({ref.cell_id for ref in hbm.values()})
    notes = {
        "throughput": "samples/s: the global batch over the median of the repeats' median steps, with its 95% "
                      "interval over repeats; busy!: other processes or the hypervisor took the machine while it was "
                      "timed, wide!: its interval is wider than ±10%, filling!: a cache timed while it still filled (empty slots, or a "
                      "miss rate still falling: cheaper than its steady state)",
        "speedup": f"speedup against {baseline_name} at the same ranks (its fp32 cell where it ran in several row precisions)",
        "speedup_hbm": "vs HBM: speedup against the fastest all-in-HBM cell (every table in device memory) "
                       f"at the same ranks, fp32 ({', '.join(fastest) if fastest else 'none measured'})",
        "instruments": "instruments cost: the harness's counting, in counted steps after the timed ones (never timed): "
                       "their median step over the timed median, less one",
        "hit_rate": "hit rate per access (per distinct row where only that is counted), in brackets Belady's MIN over the "
                    "same steps: per access an estimate a policy can beat, per distinct row (uniq) a bound",
        "cpu": "CPU ms per step: every thread of every rank, the timed steps' and any side thread's work beside them "
               "(beyond step ms x threads: work moved off the clock)",
        "device_bytes": "device MiB: the largest rank",
        "comm": "comm: bytes all ranks send to each other",
        "ops_syncs": "ops: ATen operators per step, syncs: host waits (CUDA)",
        "max_dw": "max |Δw| only where the training order is the baseline's; a fp16 / bf16 / fp8 cell's from the "
                  "baseline's cell in the same precision where the run has one",
    }
    return Grid(RESULT_COLUMNS, [_row(r, baseline_rate, hbm) for r in records], title=title, notes=notes,
                caption=host_device_caption(records))


def print_comparison(records: list[Record], console: Console | None = None, title: str | None = None,
                     view: View = View()) -> None:
    """The results table, the memory tiers' under it where cells record them, and why cells have no
    numbers or numbers not to bet on."""
    console = console or Console()
    if (results := view_part(view, RESULT_COLUMNS)) is not None:
        grid = comparison_grid(records, title)
        if any(accuracy_warnings(r.metrics.get("accuracy")) for r in records if r.status == "ok" and r.metrics):
            # a warning under the table about the AUC is read beside the AUC: at any width
            grid.columns = [dataclasses.replace(c, always=True) if c.key == "auc" else c for c in grid.columns]
        print_grid(grid, console, results)
    _print_tiers(tier_grid(records), console, view)  # right under its results table: it needs no title of its own
    for r in records:  # why a cell has no numbers, or numbers not to bet on
        if r.status != "ok" and r.message:
            console.print(Text(f"{r.cell_id}: {r.status}: {r.message}", style=_STATUS_STYLE.get(r.status, "")))
        elif r.status == "ok" and r.metrics:
            accuracy = r.metrics.get("accuracy")
            why_not = speed(r.metrics).flags + accuracy_warnings(accuracy)
            if why_not:
                console.print(Text(f"{r.cell_id}: {'; '.join(why_not)}", style="yellow"))


_DIRECTION_STYLE = {"better": "green", "worse": "red", "same": "dim"}


def _delta_text(delta: Delta | None, with_values: str | None = None) -> Text:
    """``+5.2%`` coloured by direction (``with_values``: a format for ``before -> after``)."""
    if delta is None or delta.direction is None:
        return Text("-", style="dim")
    change = "=" if delta.direction == "same" else (f"{100 * delta.relative:+.1f}%" if delta.relative is not None else "new")
    text = Text(f"{delta.before:{with_values}} → {delta.after:{with_values}}  " if with_values else "")
    text.append(change, style=_DIRECTION_STYLE[delta.direction])
    return text


def _significance_text(sig: Significance | None) -> Text:
    """The verdict (:func:`embbench.compare.judge`): ``yes p=0.003 [-12%, -4%]`` (the throughput
    ratio's interval), ``no p=0.4 [...]``, or ``~`` and why the cell is not judged."""
    if sig is None:
        return Text("n/a", style="dim")
    if sig.not_judged:
        text = Text(f"~ {sig.not_judged}", style="yellow")
    elif sig.significant:
        text = Text(f"yes p={sig.p_value:.2g}", style="bold")
    else:
        text = Text(f"no p={sig.p_value:.2g}", style="dim")
    if sig.interval:
        text.append(f" {interval_text(sig.interval)}", style="dim" if sig.not_judged else "")
    return text


def _status_change(cell: CellComparison, before: str, after: str) -> Text:
    if cell.status_before is None:
        return Text(f"only in {after}", style="yellow")
    if cell.status_after is None:
        return Text(f"only in {before}", style="yellow")
    if cell.status_before != cell.status_after:
        return Text(f"{cell.status_before} → {cell.status_after}", style="red" if cell.status_before == "ok" else "green")
    if cell.differences:
        return Text("not comparable", style="magenta")
    return Text(cell.status_after, style=_STATUS_STYLE.get(cell.status_after, ""))


#: The comparison's columns, most important first (as RESULT_COLUMNS); then every other
#: metric of METRICS in its order.
_LABEL = {m.key: m.label for m in METRICS}
DELTA_COLUMNS = [
    Column("cell", "cell", always=True, justify="left"),
    Column("status", "status", always=True, justify="left"),
    Column("throughput", _LABEL["throughput"], always=True),
    Column("step_time", _LABEL["step_time"], always=True),
    Column("significant", "significant", always=True),
    *[Column(m.key, m.label) for m in METRICS if m.key not in ("throughput", "step_time")],
]


#: metrics whose delta shows both values (an accuracy's change is read in its own units)
_DELTA_VALUES = {"throughput": ",.0f", "auc": ".4f", "logloss": ".4f"}


def delta_grid(cells: list[CellComparison], test: str, title: str = "B against A", accuracy: bool = False) -> Grid:
    """One row per cell id: run B (the candidate) against run A (the baseline), signed
    relative deltas coloured green where better and red where worse. ``accuracy``: the AUC
    and log-loss columns are kept at any width (where accuracy is the point: row precision)."""
    rows = []
    for cell in cells:
        row = Row({"cell": Text(cell.cell_id), "status": _status_change(cell, "A", "B")},
                  {"cell": cell.cell_id})
        if cell.deltas:
            for m in METRICS:
                delta = cell.deltas.get(m.key)
                row.cells[m.key] = _delta_text(delta, _DELTA_VALUES.get(m.key))
                row.sort[m.key] = delta.relative if delta else None
            row.cells["significant"] = _significance_text(cell.significance)
            row.sort["significant"] = cell.significance.p_value if cell.significance else None
        rows.append(row)
    columns = [dataclasses.replace(c, always=True) if accuracy and c.key in ("auc", "logloss") else c
               for c in DELTA_COLUMNS]
    return Grid(columns, rows, title=Text(title, style="bold"),
                caption=f"relative change of the candidate; green better, red worse; significant: {test}, judged only "
                        "where neither run was busy, each run's noise is below the threshold (--fail-on, else the change) "
                        "and the change is beyond any A/A floor; ~: not judged, and why")


def print_deltas(cells: list[CellComparison], before: str, after: str, test: str, console: Console,
                 view: View = View(), accuracy: bool = False) -> None:
    """The delta table (``accuracy``: its AUC and log-loss at any width), then why cells are
    not comparable (each distinct reason once)."""
    console.print(Text(f"A = {before}\nB = {after}"))
    if (deltas := view_part(view, DELTA_COLUMNS)) is not None:
        print_grid(delta_grid(cells, test, accuracy=accuracy), console, deltas)
    _print_tiers(tier_delta_grid(cells), console, view)
    reasons: dict[str, list[str]] = {}
    for cell in cells:
        if cell.differences:
            reasons.setdefault("; ".join(cell.differences), []).append(cell.cell_id)
    for why, ids in reasons.items():
        which = "every cell" if len(ids) == len(cells) else ", ".join(ids)
        console.print(Text(f"not comparable ({which}): {why}", style="magenta"))


def verdict(records: list[Record], run_dir: str = "RUN", aa_floor: float | None = None) -> list[str]:
    """A run's answer in a line per world size: the fastest cell (ranked as ``recommend`` ranks
    them with no memory budget: a cell whose AUC falls below the baseline's beyond its noise is
    left out), its margin over the next fastest, and whether the noise allows the decision:
    the verdict ``compare`` and its gate read (:func:`embbench.compare.repeat_test`) on the two,
    held to the A/A noise floor ``aa_floor`` (:func:`embbench.compare.aa_floor_of`) as
    ``compare`` holds every cell to it."""
    out = []
    for rec in recommend(records, Budget(device_bytes=2**62), run_dir=run_dir, aa_floor=aa_floor):
        where = f"{rec.world_size} rank(s)"
        # with no memory budget, a measured cell is left out for its accuracy only
        lost = sum(rec.excluded.get(r.cell_id) is not None for r in records
                   if r.world_size == rec.world_size and r.status == "ok")
        lost_text = f" ({lost} measured cell(s) left out: AUC below the baseline's, see `recommend`)" if lost else ""
        if rec.best is None:
            out.append(f"{where}: no measured cell to choose{lost_text}")
            continue
        best = rec.best
        head = f"{where}: fastest {best.cell_id} ({best.throughput:,.0f} samples/s){lost_text}"
        if not rec.runners_up:
            out.append(f"{head}, the only one: nothing to decide between")
            continue
        metrics = {r.cell_id: r.metrics for r in records if r.world_size == rec.world_size}
        runner = rec.runners_up[0]
        sig = repeat_test(metrics[runner.cell_id], metrics[best.cell_id], names=("the runner-up", "the best"),
                          aa_floor=aa_floor)
        margin = f"{100 * (best.throughput / runner.throughput - 1):+.1f}%"
        head += f", {margin}{' ' + interval_text(sig.interval) if sig.interval else ''} over {runner.cell_id}"
        if sig.not_judged:
            out.append(f"{head}: cannot judge: {sig.not_judged}")
        elif sig.significant:
            out.append(f"{head}: faster beyond noise (p={sig.p_value:.2g}): the noise allows the decision")
        else:
            out.append(f"{head}: not faster beyond noise (p={sig.p_value:.2g}): choose between them by memory or "
                       "accuracy, or run more repeats")
    return out


# -- memory tiers (metrics.tiers: the device cache, host memory, a drive) -----------------------------

#: One row per cell and tier; the same columns in show and compare.
TIER_COLUMNS = [
    Column("cell", "cell", always=True, justify="left"),
    Column("tier", "tier", always=True, justify="left"),
    *[Column(m.key, m.label, always=m.key in ("tier_hit_rate", "hit_rate_of_reaching")) for m in TIER_METRICS],
]


def _duration(seconds: float) -> str:
    for unit, scale in (("s", 1), ("ms", 1e-3), ("µs", 1e-6)):
        if seconds >= scale:
            return f"{seconds / scale:,.2f} {unit}"
    return "0" if seconds == 0 else f"{seconds * 1e9:,.0f} ns"


#: How each tier figure reads (bytes and times in the unit that fits them).
_TIER_FORMAT = {
    "tier_hit_rate": _pct, "hit_rate_of_reaching": _pct, "stall_seconds_per_step": _duration,
    "bytes_read_per_step": format_bytes, "bytes_written_per_step": format_bytes,
    "ios_per_step": lambda v: f"{v:,.1f}", "read_amplification": lambda v: f"{v:,.2f}x",
    "reads_per_second": lambda v: f"{v:,.0f}", "reaching_per_step": lambda v: f"{v:,.1f}",
}
#: The rows a step moves, shown under its bytes (where the tier counts rows).
_TIER_ROWS = {"bytes_read_per_step": "rows_read_per_step", "bytes_written_per_step": "rows_written_per_step"}
_TIER_NOTES = {
    "tier_hit_rate": "rows hit (all): the share of every distinct row a batch needs that the tier served (the tiers "
                     "add up to 100%; the results table's hit rate is per access)",
    "hit_rate_of_reaching": "(of reaching): the share of those that reached it, having missed every tier above",
    "stall_seconds_per_step": "stall: what a step waited for the drive's reads",
    "bytes_read_per_step": "read/written: the tier's traffic with the tier below it (hbm: read from host memory; "
                           "dram: read from the drive; nvme, the last: the drive's own)",
    "ios_per_step": "I/Os: 4 KiB pages read and written on the drive",
    "read_amplification": "read amplification: bytes read over the useful rows' bytes",
    "reads_per_second": "reads/s: pages a second while the drive was read",
}
_COUNTED = "counted over the timed steps of one run: a count, not a sample over repeats"


def _tier_value(key: str, value: float | None) -> str:
    return "" if value is None else _TIER_FORMAT[key](value)


def _store_notes(records: list[Record]) -> list[str]:
    """Where each cell's rows file was, and whether its figures are a drive's."""
    notes = []
    for r in records:
        extra = _get(r.metrics, "extra") or {}
        if extra.get("store") != "file":
            continue
        how = "O_DIRECT" if extra.get("store_direct") else f"not a drive's figures: {extra.get('store_direct_problem')}"
        notes.append(f"{r.cell_id}: rows file on {extra.get('store_filesystem')} ({how}), reader "
                     f"{extra.get('store_reader')}, host memory holds {extra.get('dram_blocks')} of its "
                     f"{extra.get('store_blocks')} blocks")
    return notes


def tier_grid(records: list[Record], title: str | None = "memory tiers") -> Grid:
    """One row per cell and tier of the records with ``metrics.tiers`` (none: a grid without rows)."""
    rows = []
    for r in _table_order(records):
        if r.status != "ok" or not r.metrics:
            continue
        flat = flat_row(r)
        for tier in tier_names(flat):
            row = Row({"cell": Text(r.cell_id), "tier": tier}, {"cell": r.cell_id, "tier": tier})
            for m in TIER_METRICS:
                value = m.read(flat, tier)
                row.cells[m.key] = _tier_value(m.key, value)
                row.sort[m.key] = value
                moved = flat.get(f"tier.{tier}.{_TIER_ROWS.get(m.key)}")
                if value is not None and moved is not None:
                    row.cells[m.key] += f"\n{moved:,.1f} rows"
            rows.append(row)
    caption = "; ".join([_COUNTED, *_store_notes(records)])
    return Grid(TIER_COLUMNS, rows, title=title, caption=caption, notes=_TIER_NOTES)


def _print_tiers(grid: Grid, console: Console, view: View) -> None:
    """A tier table, unless no cell has tiers or ``--columns`` picks none of its columns."""
    if grid.rows and (part := view_part(view, TIER_COLUMNS, keep=["tier"])) is not None:
        print_grid(grid, console, part)


def _tier_delta_text(key: str, delta: Delta) -> Text:
    """``before → after  +5.2%`` in the figure's own units, the change coloured by direction."""
    text = Text(f"{_tier_value(key, delta.before) or '-'} → {_tier_value(key, delta.after) or '-'}  ")
    return text.append_text(_delta_text(delta)) if delta.direction else text


def tier_delta_grid(cells: list[CellComparison], title: str = "memory tiers: B against A") -> Grid:
    """One row per cell and tier compared (:attr:`CellComparison.tier_deltas`): each figure in A
    and B and its relative change; no significance (counts, not repeats)."""
    rows = []
    for cell in cells:
        for tier, deltas in cell.tier_deltas.items():
            row = Row({"cell": Text(cell.cell_id), "tier": tier}, {"cell": cell.cell_id, "tier": tier})
            for m in TIER_METRICS:
                delta = deltas[m.key]
                if delta.before is not None or delta.after is not None:
                    row.cells[m.key] = _tier_delta_text(m.key, delta)
                    row.sort[m.key] = delta.relative
            rows.append(row)
    return Grid(TIER_COLUMNS, rows, title=Text(title, style="bold"), notes=_TIER_NOTES,
                caption=f"A → B and the relative change; green better, red worse; {_COUNTED}, so no significance "
                        "is claimed")


#: What ``--columns`` may name: in run and show (the results' and tiers' tables), in compare.
SHOW_COLUMNS = RESULT_COLUMNS + TIER_COLUMNS
COMPARE_COLUMNS = DELTA_COLUMNS + TIER_COLUMNS


def print_recommendations(recs: list[Recommendation], budget: Budget, source: str, console: Console) -> None:
    """The answer of ``embbench recommend``: per world size the fastest cell that fits, the
    runners-up, what was left out and why, and the cells worth running."""
    host = format_bytes(budget.host_bytes) if budget.host_bytes is not None else "not limited"
    console.print(Text(f"budget: {format_bytes(budget.device_bytes)} device memory per rank, host memory {host}; "
                       f"from the records in {source} (measured only)"))
    for rec in recs:
        console.print(Text(f"\n{rec.world_size} rank(s)", style="bold"))
        # A CPU run's caveat comes before the answer, which it then names no recommendation; the others after it.
        host_first = [c for c in rec.caveats if c == CPU_RUN_CAVEAT]
        for caveat in host_first:
            console.print(Text(f"read first: {caveat}", style="bold yellow"))
        if rec.best:
            b = rec.best
            console.print(Text.assemble("fastest on this machine: " if host_first else "recommended: ", (b.cell_id, "bold green"),
                                        f"  {b.throughput:,.0f} samples/s, device {format_bytes(b.device_bytes)}, "
                                        f"host {format_bytes(b.host_bytes)}" + (f", AUC {b.auc:.4f}" if b.auc is not None else "")
                                        + (f", rows in {b.row_precision}" if b.row_precision != "fp32" else "")
                                        + b.reference_ratios()))
        for caveat in rec.caveats:
            if caveat not in host_first:
                console.print(Text(f"caveat: {caveat}", style="yellow"))
        if rec.runners_up:
            table = Table(title="runners-up", header_style="bold", title_justify="left",
                          caption="vs best: throughput against the recommended cell; significant: Welch's t over repeats, "
                                  "with the 95% interval of the ratio, as compare judges it (~: not judged, and why)")
            hbm = any(c.hbm_differs for c in [rec.best, *rec.runners_up])  # else it repeats the speedup
            for col in ["cell", "samples/s", "vs best", "significant", "vs baseline", *(["vs all-in-HBM"] if hbm else []),
                        "device", "host", "AUC"]:
                table.add_column(col, justify="left" if col == "cell" else "right")
            for c in rec.runners_up:
                sig = Significance("", c.p_value, c.significant, 0, 0, interval=c.interval, not_judged=c.not_judged)
                table.add_row(Text(c.cell_id), f"{c.throughput:,.0f}", f"{100 * c.relative_to_best:+.1f}%",
                              _significance_text(sig), *[f"{x:.2f}x" if x is not None else "-"
                                                         for x in (c.vs_baseline, *([c.vs_hbm] if hbm else []))],
                              format_bytes(c.device_bytes), format_bytes(c.host_bytes),
                              "-" if c.auc is None else f"{c.auc:.4f}")
            console.print(table)
        if rec.excluded:
            table = Table(title="left out", header_style="bold", title_justify="left")
            table.add_column("cell", no_wrap=True)
            table.add_column("why")
            for cell_id, why in rec.excluded.items():
                table.add_row(Text(cell_id), Text(why))
            console.print(table)
        for s in rec.suggestions:
            console.print(Text(f"not covered by the records: {s.family} at {CACHE_RATIO}={s.cache_ratio:g} "
                               f"(an estimate: {s.basis})\n  to measure it: {s.edit}, then run\n    {s.command}", style="yellow"),
                          soft_wrap=True)  # the command is pasted as one line: not wrapped
        for note in rec.notes:
            console.print(Text(f"note: {note}", style="dim"))


def print_torchrec_plans(plans: dict[int, dict], recs: list[Recommendation], budget: Budget, console: Console) -> None:
    """``recommend --torchrec-plan``: per world size, torchrec's plan for the same tables and
    budget (its cost model: an estimate, not a measurement) beside embbench's measured pick."""
    picks = {r.world_size: r.best for r in recs}
    for world, plan in plans.items():
        if plan["tables"] is None:
            console.print(Text(f"torchrec plan at {world} rank(s): not made: {plan['unavailable']}", style="yellow"))
            continue
        tables = plan["tables"]
        console.print()
        table = Table(title=Text(f"torchrec's plan at {world} rank(s), {format_bytes(budget.device_bytes)} device memory "
                                 f"per rank, {format_bytes(plan['host_bytes'])} host memory"
                                 + ("" if budget.host_bytes else " (this machine's: --host-memory sets it)"),
                                 style="bold"), title_justify="left", header_style="bold",
                      caption="torchrec's EmbeddingShardingPlanner and EmbeddingOffloadScaleupProposer, with the cache "
                              "curve's LRU miss rates; rows in fp32; device MiB: its storage estimate (an estimate, not "
                              "measured)")
        for col in ["table", "rows", "sharding", "kernel", "cache load factor", "device MiB"]:
            table.add_column(col, justify="left" if col in ("table", "sharding", "kernel") else "right")
        for t in tables:
            table.add_row(t["name"], f"{t['rows']:,}", t["sharding_type"], t["compute_kernel"],
                          "-" if t["load_factor"] is None else f"{t['load_factor']:.3g}", _mib(t["device_bytes"]))
        cached = [t for t in tables if t["load_factor"] is not None]
        total = sum(t["device_bytes"] for t in tables)
        table.add_section()
        table.add_row("total", f"{sum(t['rows'] for t in tables):,}", "", f"{len(cached)} cached", "", _mib(total))
        console.print(table)
        share = (sum(t["load_factor"] * t["rows"] for t in cached) / sum(t["rows"] for t in cached)) if cached else 0
        best = picks.get(world)
        console.print(Text(f"embbench measured: {best.cell_id if best else 'no cell that fits'}; torchrec plans "
                           f"fused_uvm_caching for {len(cached)} of {len(tables)} tables"
                           + (f" (caching {100 * share:.1f}% of their rows)" if cached else "")
                           + f" and {len(tables) - len(cached)} whole on the device: {format_bytes(total)} of the "
                           f"{format_bytes(budget.device_bytes)} budget (torchrec keeps the rest for the dense part "
                           "and the input batches)"))
        if cached:
            smallest = min(cached, key=lambda t: t["rows"])
            console.print(Text(f"why a table such as {smallest['name']} ({smallest['rows']:,} rows) is cached, not whole on "
                               "the device: embbench lets torchrec's planner choose only fbgemm's UVM cache "
                               "(fused_uvm_caching) for every table, so that it sizes each cache from the curve; its "
                               "proposer moves a table whole onto the device only when its cache grows to about all "
                               "its rows or would move more than the table holds, so a table whose cache gains little "
                               "from growing stays a cache, though it would fit whole",
                               style="dim"))


def profile_tables(records: list[Record], top: int = 10) -> list[Table]:
    """The top operators of each profiled cell (``run --profile``), by self time per step on
    the device (CUDA) and on the host."""
    tables = []
    for r in records:
        profile = _get(r.metrics, "profile")
        if not profile:
            continue
        for key, where in (("top_device", "device"), ("top_host", "host")):
            rows = profile.get(key) or []
            if not rows:
                continue
            table = Table(title=Text(f"{r.cell_id}: top operators by self {where} time", style="bold"), title_justify="left",
                          header_style="bold",
                          caption=Text(f"per step, over {profile.get('steps', '?')} untimed steps; "
                                       f"trace: profiles/{profile.get('trace', '?')}"))
            on_device = any(op["self_device_us"] for op in rows)  # a CPU run has no device times
            for col in ["operator", "calls", "self host µs"] + (["self device µs"] if on_device else []):
                table.add_column(col, justify="left" if col == "operator" else "right")
            for op in rows[:top]:
                table.add_row(Text(op["op"]), f"{op['calls']:,.1f}", f"{op['self_cpu_us']:,.1f}",
                              *([f"{op['self_device_us']:,.1f}"] if on_device else []))
            tables.append(table)
    return tables
