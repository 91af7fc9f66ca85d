"""``embbench report``: one self-contained HTML file of the tables and plots of one or more runs."""

from __future__ import annotations

import argparse
from pathlib import Path

from rich.text import Text

from embbench.cli.shared import console, runs_from


def main(args: argparse.Namespace) -> int:
    from embbench.html_report import check_writable, write_report

    out = Path(args.out)
    check_writable(out, args.overwrite)  # before the work, not after it
    runs = runs_from(args.runs)
    write_report(runs, out)
    console.print(Text(f"report: {out} ({out.stat().st_size / 1024:,.0f} KiB, self-contained)"))
    return 0


def register(sub) -> None:
    rep = sub.add_parser("report", help="one self-contained HTML file: the tables and plots of one or more runs")
    rep.add_argument("runs", nargs="+", metavar="RUN", help="run directories; with several, the first is the baseline of the comparison")
    rep.add_argument("--out", default="report.html", help="the HTML file to write (default report.html)")
    rep.add_argument("--overwrite", action="store_true", help="replace an existing file that is not a report (never a record)")
    rep.set_defaults(func=main)
