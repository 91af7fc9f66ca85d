"""``embbench report``: one self-contained HTML file with the tables and the plots of runs.

Everything is inside the file (the tables as HTML tables, sorted by a click on a header with
a few lines of inline script; the plots as base64 PNG), so it can be mailed, attached to a
CI job or committed beside the results. A section with nothing to show is left out. It opens
with a verdict (:func:`embbench.report.verdict`): the fastest cell, its margin and whether the
noise allows the decision. Plots (matplotlib, Agg backend): throughput (log axis, each cell
with its interval over repeats, busy cells marked, labels that do not overlap) against device
memory with the Pareto front, hit rate against Belady's bound by cache ratio, step-time
distributions (log axis), the cache curve beside the run, per-rank bars of multi-rank cells,
and the top profiled operators where a run was profiled.
"""

from __future__ import annotations

import base64
import html
import io
import math
import os
import sys
from pathlib import Path
from typing import Any

from rich.console import Console

from embbench.columns import counted_steps, flat_row, get, gpu_names
from embbench.compare import ALPHA, TEST, Run, aa_floor_of, compare_runs
from embbench.optional import require
from embbench.outputs import atomic_write, claim_output, head_has
from embbench.results import RUN_CURVE
from embbench.stats import spread_text
from embbench.table_view import SORT_SCRIPT, html_table

__all__ = ["cache_curve_figure", "check_writable", "hit_rates_figure", "pareto_figure", "pareto_front", "render_report",
           "step_times_figure", "tiers_html", "write_report"]

MiB = 2**20


def pareto_front(points: list[tuple[float, float]]) -> list[int]:
    """Indices of the points (memory, throughput) that no other point beats: none uses no
    more memory and is at least as fast while better in one of the two. Sorted by memory."""
    front = []
    for i, (mem, rate) in enumerate(points):
        dominated = any(m <= mem and r >= rate and (m < mem or r > rate) for j, (m, r) in enumerate(points) if j != i)
        if not dominated:
            front.append(i)
    return sorted(front, key=lambda i: points[i])


def _pyplot():
    """matplotlib.pyplot on the Agg backend (no display: render to memory), imported when a
    report is made (a MissingDependency without matplotlib)."""
    require("matplotlib", "embbench report (its plots)").use("Agg")
    return require("matplotlib.pyplot", "embbench report (its plots)")


def _png(fig) -> str | None:
    """A figure as an inline PNG image (None: no figure, nothing to show)."""
    if fig is None:
        return None
    plt = _pyplot()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100, bbox_inches="tight")
    plt.close(fig)
    return f'<img alt="" src="data:image/png;base64,{base64.b64encode(buf.getvalue()).decode()}">'


def strategy_colours(runs: list[Run]) -> dict[str, Any]:
    """One colour per strategy of all the runs, so a strategy looks the same in every plot."""
    plt = _pyplot()
    names = sorted({r.strategy for run in runs for r in run.records})
    cmap = plt.get_cmap("tab10")
    return {name: cmap(i % 10) for i, name in enumerate(names)}


def _busy(row: dict[str, Any]) -> bool:
    """Whether a cell was timed on a busy machine (its ``busy!`` flag)."""
    return any(flag.startswith("busy") for flag in (row.get("flags") or "").split("; "))


def _marks(row: dict[str, Any]) -> str:
    """A cell label's marks: `` busy!`` (a busy machine), `` filling!`` (a cache timed while it filled)."""
    flags = (row.get("flags") or "").split("; ")
    return "".join(f" {kind}!" for kind in ("busy", "filling") if any(f.startswith(kind) for f in flags))


def _log_axis(ax, which: str) -> None:
    """A log scale whose ticks read as plain numbers (``900,000``, ``2.5``), labelled where
    matplotlib's log formatter would label them (minor ticks too, on a range under a decade)."""
    from matplotlib.ticker import LogFormatterSciNotation

    class Plain(LogFormatterSciNotation):
        def __call__(self, x, pos=None):
            return (f"{x:,.0f}" if x >= 100 else f"{x:.3g}") if super().__call__(x, pos) else ""

    getattr(ax, f"set_{which}scale")("log")
    axis = getattr(ax, f"{which}axis")
    axis.set_major_formatter(Plain())
    axis.set_minor_formatter(Plain(labelOnlyBase=False, minor_thresholds=(1, 0.4)))


def _legend_below(fig, handles: list, labels: list[str], fontsize: float = 7):
    """The legend under the plot (a ``constrained`` figure makes room for it), in as many
    columns (at most 4) as fit the figure's width."""
    for columns in range(min(4, len(labels)), 0, -1):
        legend = fig.legend(handles, labels, loc="outside lower center", ncols=columns, fontsize=fontsize)
        fig.canvas.draw()
        if columns == 1 or legend.get_window_extent().width <= fig.bbox.width:
            return legend
        legend.remove()


def pareto_figure(run: Run, colours: dict[str, Any]):
    """Throughput (log axis) against device memory per rank, a colour per strategy
    (``colours``), each cell with its 95 % interval over repeats, busy cells as crosses, the
    front marked, every cell labelled where no other label is."""
    from embbench.plot_labels import place_labels

    plt = _pyplot()
    rows = [r for r in map(flat_row, run.records) if r["status"] == "ok"]
    if not rows:
        return None
    points = [(r["device_bytes"] / MiB, r["throughput"]) for r in rows]
    fig, ax = plt.subplots(figsize=(8, 5.2), layout="constrained")
    for row, (x, y) in zip(rows, points):
        low, high = row["throughput_ci95_low"], row["throughput_ci95_high"]
        # the point is the median of the repeats, the interval their log-t mean's: max(0, ..) where they part
        ax.errorbar(x, y, yerr=None if low is None else [[max(0, y - low)], [max(0, high - y)]], fmt="X" if _busy(row) else "o",
                    color=colours[row["strategy"]], ms=7, capsize=3, elinewidth=1, zorder=3)
    front = pareto_front(points)
    ax.step([points[i][0] for i in front], [points[i][1] for i in front], where="post", color="0.3", lw=1,
            ls="--", zorder=2)
    ax.scatter([points[i][0] for i in front], [points[i][1] for i in front], s=160, facecolors="none",
               edgecolors="black", zorder=4)
    _log_axis(ax, "y")  # a 10 ms and a 2,000 ms cell on one axis
    ax.set_xlabel("device memory per rank, MiB (peak where measured, else static)")
    ax.set_ylabel("samples/s (log), 95% interval over repeats")
    ax.set_title(f"{run.label}: throughput against device memory")
    ax.grid(alpha=0.3, which="both")
    names = sorted({row["strategy"] for row in rows})
    handles = [plt.Line2D([], [], ls="none", marker="o", color=colours[n]) for n in names]
    labels = list(names)
    handles.append(plt.Line2D([], [], ls="--", color="0.3", marker="o", mfc="none", mec="black", ms=10))
    labels.append("Pareto front")
    if any(map(_busy, rows)):
        handles.append(plt.Line2D([], [], ls="none", marker="X", color="0.3"))
        labels.append("busy!: timed on a busy machine")
    if any(_marks(r).endswith("filling!") for r in rows):
        handles.append(plt.Line2D([], [], ls="none"))
        labels.append("filling!: a cache timed while it still filled")
    _legend_below(fig, handles, labels)
    order = front + [i for i in range(len(rows)) if i not in front]  # the front's labels nearest their points
    place_labels(ax, [points[i] for i in order],
                 [rows[i]["cell_id"] + _marks(rows[i]) for i in order])
    return fig


#: The hit-rate plot's quantities: a line style and a marker each (a family's is its colour).
#: Each later run's cache ratios drawn this factor further right on the log axis (4 %): two runs
#: with the same figures would otherwise draw one over the other.
RUN_NUDGE = 1.04
_HIT_RATES = [("hit_rate", "-", "o", "hit rate"), ("belady_hit_rate", "--", "x", "Belady's bound"),
              ("unique_hit_rate", ":", "s", "per distinct row"), ("belady_unique_hit_rate", "-.", "+", "bound per distinct row")]


def hit_rates_figure(runs: list[Run]):
    """Hit rate and Belady's bound against the cache ratio, one colour per family of cells that
    differ only in ``cache_ratio``, one line style per quantity (per distinct row too, where
    recorded): a legend of families plus quantities, not of their product."""
    plt = _pyplot()
    series: dict[str, list[dict[str, Any]]] = {}
    nudge: dict[str, float] = {}  # a later run's points sit a little right of an earlier one's
    for k, run in enumerate(runs):
        for r in map(flat_row, run.records):
            ratio = r.get("param.cache_ratio")
            if r["status"] == "ok" and ratio is not None and (r["hit_rate"] is not None or r["unique_hit_rate"] is not None):
                family = r["cell_id"].replace(f"cache_ratio={ratio}", "cache_ratio=*")
                name = f"{family} ({run.label})" if len(runs) > 1 else family
                series.setdefault(name, []).append(r)
                nudge[name] = RUN_NUDGE ** k  # equal figures of two runs stay two visible points
    if not series:
        return None
    fig, ax = plt.subplots(figsize=(8, 5.2), layout="constrained")
    cmap = plt.get_cmap("tab10")
    handles, labels, shown = [], [], set()
    for i, (family, rows) in enumerate(series.items()):
        rows.sort(key=lambda r: r["param.cache_ratio"])
        for key, style, marker, _ in _HIT_RATES:
            pts = [(r["param.cache_ratio"] * nudge[family], r[key]) for r in rows if r.get(key) is not None]
            if pts:
                ax.plot(*zip(*pts), ls=style, marker=marker, color=cmap(i % 10), alpha=0.85)
                shown.add(key)
        handles.append(plt.Line2D([], [], color=cmap(i % 10), lw=3))
        labels.append(family)
    for key, style, marker, what in _HIT_RATES:
        if key in shown:
            handles.append(plt.Line2D([], [], ls=style, marker=marker, color="0.2"))
            labels.append(what)
    _log_axis(ax, "x")
    ax.set_xlabel("cache ratio (cached rows / all rows)")
    ax.set_ylabel("hit rate")
    ax.set_ylim(0, 1.02)
    ax.set_title("hit rate against Belady's bound")
    ax.grid(alpha=0.3, which="both")
    _legend_below(fig, handles, labels)
    return fig


def step_times_figure(runs: list[Run]):
    """Box plots of every measured cell's step times (ms, a log axis: cells 200x apart share
    it), the runs side by side per cell, busy cells named so."""
    plt = _pyplot()
    boxes, labels = [], []
    for run in runs:
        for r in map(flat_row, run.records):
            if r["status"] == "ok":
                boxes.append([s * 1e3 for s in r["step_time_samples"]])
                labels.append(r["cell_id"] + (f"  ({run.label})" if len(runs) > 1 else "") + _marks(r))
    if not boxes:
        return None
    order = sorted(range(len(labels)), key=lambda i: labels[i], reverse=True)  # top to bottom, by cell
    fig, ax = plt.subplots(figsize=(8, 0.6 + 0.32 * len(boxes)))
    ax.boxplot([boxes[i] for i in order], orientation="horizontal", widths=0.6)
    ax.set_yticks(range(1, len(order) + 1))
    ax.set_yticklabels([labels[i] for i in order], fontsize=7)
    _log_axis(ax, "x")
    ax.set_xlabel("step time, ms, log axis (box: quartiles; whiskers: 1.5 IQR)")
    ax.set_title("step-time distributions")
    ax.grid(alpha=0.3, axis="x", which="both")
    return fig


def plot_per_rank(run: Run) -> list[str]:
    """For each multi-rank cell: per-rank bars of device and host memory, communication and
    hit rate (what each rank holds and does)."""
    plt = _pyplot()
    images = []
    for record in run.records:
        ranks = get(record.metrics, "per_rank")
        if record.status != "ok" or not ranks:
            continue
        steps = counted_steps(record.metrics)  # the steps the counters cover
        panels = [
            ("device MiB (static)", [r["memory"]["static_device_bytes"] / MiB for r in ranks]),
            ("host MiB (static + pinned)", [(r["memory"]["static_host_bytes"] + r["memory"]["pinned_bytes"]) / MiB for r in ranks]),
            ("comm MiB sent / step", [r["counters"].get("bytes_comm", 0) / steps / MiB for r in ranks]),
            ("hit rate", [r.get("hit_rate") if r.get("hit_rate") is not None else r.get("unique_hit_rate") for r in ranks]),
        ]
        panels = [(title, values) for title, values in panels if any(v for v in values if v is not None)]
        if not panels:
            continue
        fig, axes = plt.subplots(1, len(panels), figsize=(3.2 * len(panels), 2.8), squeeze=False)
        for ax, (title, values) in zip(axes[0], panels):
            ax.bar([str(r["rank"]) for r in ranks], [v or 0 for v in values], color="tab:blue")
            ax.set_title(title, fontsize=9)
            ax.set_xlabel("rank", fontsize=8)
        fig.suptitle(f"{record.cell_id} ({run.label})", fontsize=10)
        images.append(_png(fig))
    return images


def _rich_html(renderables: list) -> str:
    """rich renderables as inline-styled HTML (the very tables the terminal shows)."""
    console = Console(record=True, width=300, file=io.StringIO(), color_system="truecolor", emoji=False)
    for r in renderables:
        console.print(r)
    return console.export_html(inline_styles=True, code_format="<pre class=\"rich\">{code}</pre>")


def _profile_html(run: Run) -> str:
    from embbench.report import profile_tables

    tables = profile_tables(run.records)
    return _rich_html(tables) if tables else ""


_STYLE = """
body { font-family: system-ui, sans-serif; margin: 24px; color: #222; background: #fff; }
h1 { font-size: 22px; } h2 { font-size: 18px; margin-top: 28px; border-bottom: 1px solid #ddd; }
pre.rich { font-size: 11px; line-height: 1.25; background: #fff; overflow-x: auto; }
.scroll { overflow-x: auto; }
table.sortable { border-collapse: collapse; font-size: 12px; margin: 8px 0; }
table.sortable caption { font-weight: bold; text-align: left; padding: 4px 0; }
table.sortable th, table.sortable td { border: 1px solid #ddd; padding: 3px 6px; vertical-align: top; }
table.sortable th { background: #f4f4f4; cursor: pointer; user-select: none; }
table.sortable th[aria-sort=ascending]::after { content: " \\25B2"; }
table.sortable th[aria-sort=descending]::after { content: " \\25BC"; }
table.sortable tbody tr:nth-child(even) { background: #fafafa; }
.right { text-align: right; } .left { text-align: left; } td.right, td.left { white-space: nowrap; }
img { max-width: 100%; margin: 8px 0; border: 1px solid #eee; }
.meta { color: #555; font-size: 13px; }
.warning { background: #fff4d6; border: 1px solid #e0b040; padding: 6px 10px; font-size: 14px; }
.verdict { background: #f3f7ff; border: 1px solid #9ab; padding: 6px 10px; font-size: 14px; }
.verdict ul { margin: 4px 0; padding-left: 20px; }
"""


def plot_cache_curve(run: Run) -> str | None:
    """The run's cache curve (``RUN/curve.json``, from ``embbench curve --out``) as a plot
    (:func:`cache_curve_figure`); a damaged curve file is a warning in its place."""
    from embbench.cache.curve import read_curve

    path = Path(run.path) / RUN_CURVE
    if not os.path.lexists(path):
        return None
    try:
        curve = read_curve(path)
    except ValueError as e:  # a damaged curve costs its plot, never the report
        print(f"warning: {e}; the report has no cache curve", file=sys.stderr)
        return f"<p class=\"warning\">{html.escape(str(e))}; no cache curve</p>"
    return _png(cache_curve_figure(run, curve))


def _ratio_edge(ratios: list[float], i: int) -> float:
    """Between ratio ``i`` and the next, on a log axis (the last: half a step beyond it)."""
    ahead = ratios[i + 1] if i + 1 < len(ratios) else ratios[i] * (ratios[i] / ratios[i - 1] if i else 2)
    return (ratios[i] * ahead) ** 0.5


def cache_curve_figure(run: Run, curve: dict):
    """A cache curve of all tables in one cache, per distinct row: one panel per policy family
    with Belady's MIN as the envelope, the run's measured cells of that family as points, and
    the sizes below one batch's distinct rows shaded. A policy measured at a few sizes only
    (freqcache: a simulation each) is drawn as those points: a line between them would claim
    the sizes between, and can pass above MIN."""
    from embbench.cache.curve import below_one_batch

    lines = curve["scopes"][0]["policies"]
    families = [p for p in curve["policies"] if p != "min"]
    if not families:
        return None
    ratios = curve["ratios"]
    measured: dict[str, list[tuple[float, float]]] = {}
    for r in run.records:
        ratio, rate = r.params.get("cache_ratio"), flat_row(r).get("unique_hit_rate")
        family = "freqcache" if r.strategy == "freqcache" else str(r.params.get("algorithm", "")).lower()
        if r.status == "ok" and isinstance(ratio, (int, float)) and rate is not None and family in families:
            measured.setdefault(family, []).append((ratio, rate))
    small = [i for i, below in enumerate(below_one_batch(curve)) if below]
    plt = _pyplot()
    fig, axes = plt.subplots(1, len(families), figsize=(3.4 * len(families), 3.6), squeeze=False, sharey=True,
                             layout="constrained")
    for ax, family in zip(axes[0], families):
        if "min" in lines:
            ax.plot(ratios, lines["min"]["unique_hit_rate"], ls="--", color="black", label="MIN (envelope)")
        points = [(x, y) for x, y in zip(ratios, lines[family]["unique_hit_rate"]) if y is not None]
        if points:
            sparse = None in lines[family]["unique_hit_rate"]  # measured at some sizes only
            ax.plot(*zip(*points), ls="none" if sparse else "-", marker="o" if sparse or len(points) <= 3 else ".",
                    label=f"{family} (curve)")
        if family in measured:
            ax.scatter(*zip(*measured[family]), color="red", zorder=3, label="measured cells")
        if small:
            ax.axvspan(ratios[0] / 1.2, _ratio_edge(ratios, small[-1]), color="0.92", lw=0,
                       zorder=0, label="below one batch's distinct rows")
        _log_axis(ax, "x")
        ax.set_title(family.upper() if family in ("lru", "lfu") else family, fontsize=9)
        ax.set_xlabel("cache ratio")
        ax.grid(alpha=0.3, which="both")
    axes[0][0].set_ylabel("hit rate per distinct row")
    axes[0][0].set_ylim(0, 1.02)
    fig.suptitle(f"{run.label}: cache curve ({curve['counted_steps']} batches), all tables in one cache", fontsize=9)
    legend = {}  # one legend under the panels: inside one it covered measured points
    for ax in axes[0]:
        for handle, label in zip(*ax.get_legend_handles_labels()):
            legend.setdefault(label, handle)
    _legend_below(fig, list(legend.values()), list(legend), fontsize=7)
    return fig


def tiers_html(runs: list[Run]) -> str:
    """The memory tiers (``metrics.tiers``) of the cells that record them: a table per run and,
    with several runs, each against the first (counted: no significance); nothing where no cell
    records tiers."""
    from embbench.report import tier_delta_grid, tier_grid

    grids = [tier_grid(run.records, title=f"{run.label}: memory tiers") for run in runs]
    if not any(grid.rows for grid in grids):
        return ""
    if len(runs) > 1:
        grids += [tier_delta_grid(cells, title=f"{run.label} against {runs[0].label}: memory tiers")
                  for run, cells in compare_runs(runs)]
    return "<h2>Memory tiers</h2>" + "".join(_scrolling(html_table(grid)) for grid in grids if grid.rows)


def render_report(runs: list[Run]) -> str:
    """The report of one or more runs as one HTML document (the first run is the baseline
    of the comparison)."""
    from embbench.report import comparison_grid, delta_grid, host_device_caption

    _pyplot()  # without matplotlib, fail before any work
    parts = [f"<!DOCTYPE html><html><head><meta charset=\"utf-8\">{GENERATOR}<title>embbench report</title>",
             f"<style>{_STYLE}</style></head><body><h1>embbench report</h1>"]
    host = host_device_caption([r for run in runs for r in run.records])
    if host:  # before anything else: such speeds decide nothing about placement
        parts.append(f"<p class=\"warning\"><b>Read first:</b> {html.escape(host)}.</p>")
    parts.append(_verdict_html(runs))
    for run in runs:
        first = run.records[0]
        p = first.provenance
        parts.append(f"<p class=\"meta\"><b>{html.escape(run.label)}</b>: scenario {html.escape(str(get(first.scenario, 'name')))} "
                     f"({html.escape(str(get(first.scenario, 'digest'))[:10])}), commit {html.escape(str(get(p, 'git', 'commit'))[:10])}, "
                     f"{html.escape(str(p.get('date')))}, {html.escape(str(get(p, 'devices', 'cpu')))}, "
                     f"GPUs: {html.escape(', '.join(gpu_names(p)) or 'none')}, {len(run.records)} cells</p>")
    parts.append("<h2>Results</h2>")
    parts += [_scrolling(html_table(comparison_grid(run.records, title=run.label))) for run in runs]
    if len(runs) > 1:
        parts.append(f"<h2>Comparison against {html.escape(runs[0].label)}</h2>")
        parts.append(f"<p class=\"meta\">significance: {html.escape(TEST)}, alpha {ALPHA}; the interval is that of the "
                     "throughput ratio; busy!/wide!: a run measured on a busy machine, or with an interval wider "
                     "than ±10%</p>")
        parts += [_scrolling(html_table(delta_grid(cells, TEST, title=f"{run.label} against {runs[0].label}")))
                  for run, cells in compare_runs(runs)]
    parts.append(tiers_html(runs))
    sections = [
        ("Throughput against device memory", [_png(pareto_figure(run, strategy_colours(runs))) for run in runs]),
        ("Hit rate against Belady's bound", [_png(hit_rates_figure(runs))]),
        ("Cache curve (embbench curve)", [plot_cache_curve(run) for run in runs]),
        ("Step times", [_png(step_times_figure(runs))]),
        ("Per rank", [img for run in runs for img in plot_per_rank(run)]),
    ]
    for title, images in sections:
        images = [i for i in images if i]
        if images:  # no heading over nothing (per rank on one-rank runs, hit rates without caches)
            parts.append(f"<h2>{html.escape(title)}</h2>" + "".join(images))
    profiles = "".join(_profile_html(run) for run in runs)
    if profiles:
        parts.append("<h2>Top operators (profiled cells)</h2>" + profiles)
    parts.append(f"<script>{SORT_SCRIPT}</script></body></html>")
    return "\n".join(parts)


def _verdict_html(runs: list[Run]) -> str:
    """The report's first word (:func:`embbench.report.verdict`): per run and world size, the
    fastest cell, its margin and whether the noise allows the decision, held to the A/A noise
    floor of the runs where two are the same scenario and commit (as the comparison below is)."""
    from embbench.report import verdict

    floor = aa_floor_of(runs) if len(runs) > 1 else None
    items = "".join(f"<li>{html.escape(line)}</li>" for line in
                    (f"{run.label}: {line}" if len(runs) > 1 else line
                     for run in runs for line in verdict(run.records, str(run.path), aa_floor=floor)))
    held = (f"; held to the A/A noise floor of these runs, {spread_text(math.expm1(floor))}" if floor is not None else "")
    return (f'<div class="verdict"><b>Verdict</b> (speed; the margin\'s 95% interval over repeats{html.escape(held)})'
            f'<ul>{items}</ul></div>')


def _scrolling(table: str) -> str:
    """A table that scrolls sideways on its own when the window is narrower (not the page)."""
    return f'<div class="scroll">{table}</div>'


#: Marks the reports this command wrote, which a later report may replace (claim_output).
GENERATOR = '<meta name="generator" content="embbench report">'


def check_writable(out: Path, overwrite: bool = False) -> None:
    """A ValueError saying why ``out`` cannot be written, if it cannot: see
    :func:`embbench.outputs.claim_output` (a previous report may be replaced, nothing else)."""
    claim_output(out, "--out", "embbench report", lambda path: head_has(path, GENERATOR.encode()), overwrite)


def write_report(runs: list[Run], out: Path) -> Path:
    """Render and write the report; an unwritable ``out`` is a one-line ValueError."""
    text = render_report(runs)
    try:
        atomic_write(out, lambda f: f.write(text.encode("utf-8")))  # a full disk leaves no half report
    except OSError as e:
        raise ValueError(f"--out {out}: cannot write the report: {e.strerror}") from None
    return out
