"""Tables of runs that fit where they are shown.

A :class:`Grid` is a table before it is drawn: named columns, most important first, and a
row per cell. :func:`fit_columns` alone decides which columns a terminal shows (``run``,
``show`` and ``compare`` all print through :func:`print_grid`): the columns that are
always shown, then as many of the others, in order, as fit the console's width, leaving
out columns no row fills; ``--columns`` picks, ``--wide`` shows all. :func:`html_table`
draws the same grid as a sortable HTML ``<table>`` for the report.
"""

from __future__ import annotations

import argparse
import html
import io
import re
from dataclasses import dataclass, field
from typing import Sequence, Union

from rich.console import Console
from rich.table import Table
from rich.text import Text

__all__ = ["FOLDED_IDENTITY", "SORT_SCRIPT", "Column", "Fit", "Grid", "Row", "View", "column_names", "filled_columns",
           "fit_columns", "fold_id", "html_table", "print_grid", "rich_table", "view_part"]

Cell = Union[str, Text]

#: Wide enough to measure any table at its natural width (no cell wrapped).
_UNBOUNDED = 100_000
#: Where a row's identity (a long cell id) folds onto more lines when that makes room for
#: more columns (``strategy[param=...,param=...]@wN`` ids run to 50 characters and more).
FOLDED_IDENTITY = 32


@dataclass(frozen=True)
class Column:
    """``key`` is the column's name for ``--columns`` and the footer; ``always``: shown at
    any width (the row's identity and its headline numbers)."""

    key: str
    header: str
    always: bool = False
    justify: str = "right"


@dataclass
class Row:
    cells: dict[str, Cell]
    #: what the HTML table sorts a column by (absent: its text)
    sort: dict[str, float | str | None] = field(default_factory=dict)


@dataclass
class Grid:
    """``columns`` in priority order, which is also the order they are drawn in; the first
    is the row's identity. The caption is ``caption`` and the ``notes`` of the columns shown."""

    columns: list[Column]
    rows: list[Row]
    title: str | Text | None = None
    caption: str | None = None
    notes: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class View:
    """What the user asked for: ``columns`` by name (``--columns``), all of them (``--wide``),
    or neither: as many as fit the width."""

    columns: tuple[str, ...] | None = None
    wide: bool = False


def view_part(view: View, columns: Sequence[Column], keep: Sequence[str] = ()) -> View | None:
    """The part of ``view`` for one of the grids a command prints (``--columns`` names columns of
    any of them): the columns it picks of this grid's, after ``keep`` (those that tell its rows
    apart); None where it picks none of them, and the grid is not drawn."""
    if not view.columns:
        return view
    keys = {c.key for c in columns}
    picked = [k for k in view.columns if k in keys]
    return View(tuple(dict.fromkeys([*keep, *picked]))) if picked else None


def column_names(valid: Sequence[str]):
    """An argparse type for ``--columns a,b,c``: names out of ``valid``, an unknown one an
    error that lists them (argparse exits 2)."""

    def parse(text: str) -> tuple[str, ...]:
        names = tuple(dict.fromkeys(n.strip() for n in text.split(",") if n.strip()))
        unknown = [n for n in names if n not in valid]
        if unknown or not names:
            what = f"unknown column {', '.join(map(repr, unknown))}" if unknown else "no column named"
            raise argparse.ArgumentTypeError(f"{what}; valid: {', '.join(valid)}")
        return names

    return parse


def _blank(cell: Cell | None) -> bool:
    text = cell.plain if isinstance(cell, Text) else cell
    return not text or text.strip() in ("", "-")


def filled_columns(grid: Grid) -> list[str]:
    """The keys of the columns some row has a value in ("-" is none)."""
    return [c.key for c in grid.columns if any(not _blank(row.cells.get(c.key)) for row in grid.rows)]


def _caption(grid: Grid, keys: Sequence[str]) -> str:
    return "; ".join(([grid.caption] if grid.caption else []) + [grid.notes[k] for k in keys if k in grid.notes])


def rich_table(grid: Grid, keys: Sequence[str], identity_width: int | None = None) -> Table:
    """The grid with the columns ``keys`` (in that order) as a rich Table; the row's identity
    at most ``identity_width`` wide (None: as wide as it is)."""
    by_key = {c.key: c for c in grid.columns}
    caption = _caption(grid, keys)
    # User text (titles name scenarios and paths; captions name strategies) is never read as markup.
    title = Text(grid.title, style="table.title") if isinstance(grid.title, str) else grid.title
    table = Table(title=title, header_style="bold", caption=Text(caption, style="table.caption") if caption else None)
    for key in keys:
        # fold, not crop: on a narrow terminal a long cell id breaks over lines rather than losing its end
        table.add_column(by_key[key].header, justify=by_key[key].justify, overflow="fold",
                         max_width=identity_width if key == grid.columns[0].key else None)
    for row in grid.rows:
        cells = [_text(row.cells.get(key)) for key in keys]
        if identity_width is not None:
            cells[0] = Text(fold_id(cells[0].plain, identity_width), style=cells[0].style)
        table.add_row(*cells)
    return table


#: Where a cell id may break: after ``[`` or ``,`` and before ``@`` (``strategy[a=1,b=2]@w1@bf16``).
_ID_BREAKS = re.compile(r"(?<=[\[,])|(?=@)")


def fold_id(cell_id: str, width: int) -> str:
    """``cell_id`` on lines of at most ``width`` characters, broken only between its parts (a
    parameter, the ranks); a single part longer than ``width`` is left for rich to fold."""
    lines = [""]
    for part in _ID_BREAKS.split(cell_id):
        if lines[-1] and len(lines[-1]) + len(part) > width:
            lines.append("")
        lines[-1] += part
    return "\n".join(lines)


def _text(cell: Cell | None) -> Text:
    return cell if isinstance(cell, Text) else Text(cell or "")  # a str is never read as markup


def _natural_width(console: Console, grid: Grid, keys: Sequence[str], identity_width: int | None = None) -> int:
    """How wide the table of ``keys`` is with no cell wrapped (but the identity, past ``identity_width``)."""
    table = rich_table(grid, keys, identity_width)
    return console.measure(table, options=console.options.update_width(_UNBOUNDED)).maximum


@dataclass
class Fit:
    """The keys of the columns to draw, of those left out for want of width, and the width
    the row's identity folds at (None: it does not)."""

    shown: list[str]
    hidden: list[str] = field(default_factory=list)
    identity_width: int | None = None


def fit_columns(grid: Grid, console: Console, view: View = View()) -> Fit:
    """Which columns to draw.

    ``view.columns``: the row's identity and those, in the order given (empty or not).
    ``view.wide``: every filled column. Otherwise the ``always`` columns, then each other
    filled column, by priority, that still fits ``console.width`` (a wide one left out
    does not stop a narrower one after it); where that leaves some out, long row ids fold
    at :data:`FOLDED_IDENTITY` if that brings in the first of them. Columns no row fills
    are left out, not "hidden".
    """
    identity = grid.columns[0].key
    if view.columns:
        return Fit([identity] + [k for k in view.columns if k != identity])
    filled = filled_columns(grid)
    if view.wide:
        return Fit(filled)
    fit = _by_priority(grid, console, filled, None)
    if fit.hidden:
        folded = _by_priority(grid, console, filled, FOLDED_IDENTITY)
        if fit.hidden[0] in folded.shown:
            return folded
    return fit


def _by_priority(grid: Grid, console: Console, filled: list[str], identity_width: int | None) -> Fit:
    always = {c.key for c in grid.columns if c.always}
    fit = Fit([k for k in filled if k in always], [], identity_width)
    for key in filled:
        if key in always:
            continue
        candidate = [k for k in filled if k in fit.shown or k == key]  # drawn in priority order
        if _natural_width(console, grid, candidate, identity_width) <= console.width:
            fit.shown = candidate
        else:
            fit.hidden.append(key)
    return fit


def print_grid(grid: Grid, console: Console, view: View = View()) -> None:
    """The grid's table as :func:`fit_columns` says, and a footer naming the columns left out."""
    fit = fit_columns(grid, console, view)
    table = rich_table(grid, fit.shown, fit.identity_width)
    if view.wide:  # every column at its natural width: wider than a terminal, its lines wrap (`less -S` scrolls)
        width = console.width
        console.width = max(width, _natural_width(console, grid, fit.shown))
        try:
            console.print(table)
        finally:
            console.width = width
    else:
        console.print(table)
    if fit.hidden:
        console.print(Text(f"hidden: {', '.join(fit.hidden)} — --wide shows all, --columns picks", style="dim"))


# -- HTML ---------------------------------------------------------------------------------------

#: Renders rich Text into styled segments for HTML (never printed).
_HTML_CONSOLE = Console(file=io.StringIO(), width=_UNBOUNDED, color_system="truecolor")


def _html_cell(cell: Cell | None) -> str:
    out = []
    for segment in _text(cell).render(_HTML_CONSOLE, end=""):
        body = html.escape(segment.text).replace("\n", "<br>")
        css = segment.style.get_html_style() if segment.style else ""
        out.append(f'<span style="{css}">{body}</span>' if css else body)
    return "".join(out)


def html_table(grid: Grid) -> str:
    """Every filled column of the grid as an HTML ``<table class="sortable">``: each cell
    carries its sort value (``data-sort``) where it has one; :data:`SORT_SCRIPT` sorts it."""
    by_key = {c.key: c for c in grid.columns}
    keys = filled_columns(grid)
    title = grid.title.plain if isinstance(grid.title, Text) else grid.title
    caption = _caption(grid, keys)
    parts = ['<table class="sortable">']
    if title:
        parts.append(f"<caption>{html.escape(title)}</caption>")
    headers = [f'<th class="{by_key[k].justify}" title="click to sort">{_html_cell(by_key[k].header)}</th>' for k in keys]
    parts.append("<thead><tr>" + "".join(headers) + "</tr></thead><tbody>")
    for row in grid.rows:
        cells = []
        for k in keys:
            value = row.sort.get(k)
            sort = "" if value is None else f' data-sort="{html.escape(str(value))}"'
            cells.append(f'<td class="{by_key[k].justify}"{sort}>{_html_cell(row.cells.get(k))}</td>')
        parts.append("<tr>" + "".join(cells) + "</tr>")
    parts.append("</tbody></table>")
    if caption:
        parts.append(f'<p class="meta">{html.escape(caption)}</p>')
    return "".join(parts)


#: Click a header to sort its table by that column; again to reverse. Numbers (``data-sort``
#: or a numeric text) numerically, the rest as text; empty cells last either way.
SORT_SCRIPT = """
for (const th of document.querySelectorAll("table.sortable th")) {
  th.addEventListener("click", () => {
    const table = th.closest("table"), body = table.tBodies[0], i = th.cellIndex;
    const ascending = th.getAttribute("aria-sort") !== "ascending";
    for (const other of th.parentNode.cells) other.removeAttribute("aria-sort");
    th.setAttribute("aria-sort", ascending ? "ascending" : "descending");
    const value = row => {
      const cell = row.cells[i], text = cell.dataset.sort ?? cell.textContent.trim();
      return text === "" || text === "-" ? null : isNaN(text) ? text : Number(text);
    };
    const rows = [...body.rows].sort((a, b) => {
      const x = value(a), y = value(b);
      if (x === null || y === null) return (x === null) - (y === null);
      const order = typeof x === "number" && typeof y === "number" ? x - y
        : String(x).localeCompare(String(y), undefined, {numeric: true});
      return ascending ? order : -order;
    });
    body.append(...rows);
  });
}
"""
