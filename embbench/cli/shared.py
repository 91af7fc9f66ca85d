"""What the commands share: the console they print to, the table-view flags, list arguments,
and reading runs with the damaged files named."""

from __future__ import annotations

import argparse
import os
import sys

from rich.console import Console

from embbench.results import RecordError
from embbench.table_view import View, column_names


class _Console(Console):
    def on_broken_pipe(self) -> None:
        raise BrokenPipeError  # rich would exit 1 silently: main() ends quietly (141), as for plain prints


# Tables fit the terminal's width (COLUMNS where set; see embbench/table_view.py). Logs and CI
# are not terminals: there, without COLUMNS, tables get room for most of their columns.
# User text (names, paths, messages) reaches it as rich.text.Text, never inside a markup string
# (escape() is not enough there: a name ending in a backslash escapes what follows); emoji
# codes such as :x: in plain strings are left alone.
console = _Console(width=None if (sys.stdout is not None and sys.stdout.isatty()) or os.environ.get("COLUMNS") else 240,
                   emoji=False)


def add_view_flags(parser, columns, group=None) -> None:
    """``--columns a,b,c`` and ``--wide``: which of the tables' ``columns`` are shown (by
    default, as many as fit the terminal, the others named under the table)."""
    group = group or parser.add_mutually_exclusive_group()
    names = list(dict.fromkeys(c.key for c in columns))  # a row's identity is in each table
    group.add_argument("--columns", type=column_names(names), metavar="A,B,...",
                       help=f"show these columns of the table (after the cell id): {', '.join(names)}")
    group.add_argument("--wide", action="store_true", help="show every column, however wide the table gets")


def view_of(args: argparse.Namespace) -> View:
    return View(args.columns, args.wide)


def comma_names(text: str) -> list[str]:
    """``--strategies a,b``: one name at least, none empty."""
    names = [name.strip() for name in text.split(",")]
    if not any(names):
        raise argparse.ArgumentTypeError("empty: name at least one strategy (leave the flag out to run them all)")
    if not all(names):
        raise argparse.ArgumentTypeError(f"{text!r}: an empty name between commas")
    return names


def skip_damaged(error: RecordError) -> None:
    print(f"warning: {error}; skipped", file=sys.stderr)


def runs_from(paths: list[str], need_records: bool = True) -> list:
    """:func:`embbench.compare.load_runs`, each file it left out named on stderr."""
    from embbench.compare import load_runs

    runs = load_runs(paths, need_records)
    for run in runs:
        for error in run.damaged:
            skip_damaged(error)
    return runs
