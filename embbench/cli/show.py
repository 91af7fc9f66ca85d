"""``embbench show``: the comparison table of a (partial) run, or its rows as CSV or JSON."""

from __future__ import annotations

import argparse
import csv
import json
import sys
from pathlib import Path

from rich.text import Text

from embbench.cli.shared import add_view_flags, console, skip_damaged, view_of
from embbench.report import SHOW_COLUMNS, print_comparison, profile_tables
from embbench.results import RecordError, by_scenario, load_records, scenario_differences


def _csv_columns(rows: list[dict]) -> list[str]:
    """Every column any cell has: in the order of the fullest row, the parameters after the
    cell's identity and status."""
    keys = list(dict.fromkeys(k for row in sorted(rows, key=len, reverse=True) for k in row))
    params = [k for k in keys if k.startswith("param.")]
    rest = [k for k in keys if not k.startswith("param.")]
    at = rest.index("semantics") + 1
    return rest[:at] + params + rest[at:]


def _scenario_title(group: list, first: list, where: str, groups: int) -> Text:
    """A table's title: where its records are from and, among several scenarios, which one
    (and what differs from the first)."""
    if groups == 1:
        return Text(where)
    info = group[0].scenario
    title = f"{where}: scenario {info['name']} {info['digest'][:10]}"
    if group is not first:
        title += f" (against {first[0].scenario['digest'][:10]}: {scenario_differences(first[0].scenario, info)})"
    return Text(title)


def main(args: argparse.Namespace) -> int:
    records = load_records([Path(p) for p in args.results], on_damaged=skip_damaged)
    where = " ".join(args.results)
    if not records:
        raise RecordError(f"{where}: no usable records")
    groups = by_scenario(records)  # speedups are against the baseline of the same scenario only
    if args.csv or args.json:
        from embbench.columns import flat_rows

        rows = [row for group in groups for row in flat_rows(group)]
        if args.json:
            print(json.dumps(rows, indent=2))
        else:
            columns = _csv_columns(rows)
            writer = csv.DictWriter(sys.stdout, columns, lineterminator="\n")
            writer.writeheader()
            writer.writerows({k: json.dumps(v) if isinstance(v, list) else v for k, v in row.items()} for row in rows)
        return 0
    if len(groups) > 1:
        console.print(Text(f"{where}: records of {len(groups)} scenarios: one table each, no speedup across them",
                           style="yellow"))
    for group in groups:
        print_comparison(group, console, title=_scenario_title(group, groups[0], where, len(groups)), view=view_of(args))
    for table in profile_tables(records):
        console.print(table)
    return 0


def register(sub) -> None:
    show = sub.add_parser("show", help="print the comparison table of a (partial) run")
    show.add_argument("results", nargs="+", help="run directories or record files (each cell of a scenario listed once)")
    export = show.add_mutually_exclusive_group()
    export.add_argument("--csv", action="store_true", help="one row per cell, flat columns, for spreadsheets")
    export.add_argument("--json", action="store_true", help="the same rows as a JSON list, for notebooks")
    add_view_flags(show, SHOW_COLUMNS, export)
    show.set_defaults(func=main)
