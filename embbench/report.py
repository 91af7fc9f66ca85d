"""Comparison tables of result records (rich)."""

from __future__ import annotations

from typing import Any

from rich.console import Console
from rich.table import Table
from rich.text import Text

from embbench.results import Record

__all__ = ["comparison_table", "print_comparison"]

_STATUS_STYLE = {"ok": "green", "unsupported": "yellow", "error": "red", "oom": "magenta", "timeout": "red",
                 "diverged": "red"}

#: Counters of the seed systems' bookkeeping, shown per step when a strategy reports them.
_BOOKKEEPING = {"host_syncs": "syncs", "rows_synced": "rows synced", "hot_batches": "hot", "cold_batches": "cold",
                "pipeline_stalls": "stalls", "host_plan_us": "plan µs"}


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


def _row(r: Record, baseline_rate: dict[int, float]) -> dict[str, str]:
    m = r.metrics or {}
    step = m["step_time_s"]
    ci = m["throughput"]["ci95"]
    rate = m["throughput"]["mean"]
    base = baseline_rate.get(r.world_size)
    per_step = _get(m, "counters", "per_step") or {}
    mem = m["memory"]
    auc, logloss = _get(m, "accuracy", "auc"), _get(m, "accuracy", "logloss")
    hit, bound = _get(m, "counters", "hit_rate"), _get(m, "extra", "belady_hit_rate")
    unique_hit = _get(m, "counters", "unique_hit_rate")
    diff = m.get("max_weight_diff_vs_baseline") if r.semantics == "exact" else None
    moved = per_step.get("bytes_h2d", 0) + per_step.get("bytes_d2h", 0)
    ops, syncs = m.get("ops_per_step"), m.get("host_syncs_per_step")
    bookkeeping = ", ".join(f"{label} {per_step[k]:,.3g}" for k, label in _BOOKKEEPING.items() if per_step.get(k))
    return {
        "ranks": str(r.world_size),
        "step ms\nmedian / p95": f"{step['median'] * 1e3:,.2f} / {step['p95'] * 1e3:,.2f}",
        "samples/s\n(95% CI)": f"{rate:,.0f}" + (f" ±{(ci[1] - ci[0]) / 2:,.0f}" if ci else ""),
        "speedup": f"{rate / base:.2f}x" if base else "-",
        "hit rate\n(bound)": (_pct(hit) + (f" ({_pct(bound)})" if bound is not None else "") if hit is not None
                               else f"{_pct(unique_hit)} uniq" if unique_hit is not None else ""),
        "H2D / D2H\nMiB/step": "" if not moved else
            f"{per_step.get('bytes_h2d', 0) / 2**20:,.2f} / {per_step.get('bytes_d2h', 0) / 2**20:,.2f}",
        "comm\nMiB/step": f"{per_step['bytes_comm'] / 2**20:,.2f}" if per_step.get("bytes_comm") else "",
        "device MiB\nstatic / peak": f"{_mib(mem['static_device_bytes'])} / {_mib(mem.get('peak_allocated_bytes'))}",
        "host MiB": _mib(mem["static_host_bytes"] + mem["pinned_bytes"]),
        "AUC": "-" if auc is None else f"{auc:.4f}",
        "logloss": "-" if logloss is None else f"{logloss:.4f}",
        "max |Δw|": "" if diff is None else f"{diff:.1e}",
        "ops / syncs\nper step": "" if ops is None else f"{ops:,.0f}" + ("" if syncs is None else f" / {syncs:,.1f}"),
        "bookkeeping\nper step": bookkeeping,
        "order": "" if r.semantics == "exact" else r.semantics,
    }


def comparison_table(records: list[Record], title: str | None = None) -> Table:
    """One row per cell: speed against the baseline, memory, accuracy, cache counters.

    Columns that no record fills (a hit rate without caches, say) are left out.
    """
    baseline_name = records[0].baseline if records else None
    records = sorted(records, key=lambda r: (r.strategy != baseline_name, r.world_size, r.cell_id))
    baseline_rate = {
        r.world_size: r.metrics["throughput"]["mean"]
        for r in records if r.strategy == baseline_name and r.status == "ok"
    }
    rows = [(r, _row(r, baseline_rate) if r.status == "ok" and r.metrics else None) for r in records]
    measured = [row for _, row in rows if row]
    columns = [c for c in (measured[0] if measured else {}) if any(row[c] for row in measured)]
    table = Table(title=title, header_style="bold",
                  caption=f"speedup against {baseline_name} at the same ranks; hit rate per access (per distinct row "
                          "where only that is counted), Belady's bound in brackets; device MiB: the largest rank; "
                          "comm: bytes all ranks send to each other; ops: ATen operators per step, syncs: host waits (CUDA); "
                          "max |Δw| only where the training order is the baseline's")
    table.add_column("cell", no_wrap=True)
    table.add_column("status")
    for c in columns:
        table.add_column(c, justify="right")
    for r, row in rows:
        status = Text(r.status, style=_STATUS_STYLE.get(r.status, ""))
        if row is None:
            table.add_row(Text(r.cell_id), status, *[""] * len(columns))
        else:
            table.add_row(Text(r.cell_id), status, *[row[c] for c in columns])
    return table


def print_comparison(records: list[Record], console: Console | None = None, title: str | None = None) -> None:
    console = console or Console()
    console.print(comparison_table(records, title))
    for r in records:  # why a cell has no numbers
        if r.status != "ok" and r.message:
            console.print(Text(f"{r.cell_id}: {r.status}: {r.message}", style=_STATUS_STYLE.get(r.status, "")))
