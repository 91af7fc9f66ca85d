"""``embbench compare``: runs cell by cell, B, C, ... against A: deltas, their significance and
the ``--fail-on`` gate."""

from __future__ import annotations

import argparse
import json

from rich.text import Text

from embbench.cli.shared import add_view_flags, console, runs_from, view_of
from embbench.report import COMPARE_COLUMNS


def _precision_pairs(runs, threshold: float | None):
    """``--match-on strategy``: in each run, every cell whose rows are not fp32 against the same
    strategy, parameters and world size in fp32."""
    from embbench.compare import ALPHA, compare_precisions

    pairs = [(run, compare_precisions(run.records, ALPHA, threshold)) for run in runs]
    if not any(cells for _, cells in pairs):
        raise ValueError(f"--match-on strategy: no cell with rows in fp16, bf16 or fp8 in {', '.join(r.label for r in runs)} "
                         "(run.row_precision)")
    return pairs


def main(args: argparse.Namespace) -> int:
    from embbench.compare import (ALPHA, CANNOT_JUDGE, TEST, aa_noise_floor, cannot_judge, compare_runs, parse_percent,
                                  regressions, same_code_and_scenario, to_json)
    from embbench.report import print_deltas
    from embbench.stats import spread_text

    threshold = parse_percent(args.fail_on) if args.fail_on is not None else None
    runs = runs_from(args.runs, need_records=False)  # a candidate whose records are all damaged fails the gate
    pairs = compare_runs(runs, ALPHA, threshold) if args.match_on == "cell" else _precision_pairs(runs, threshold)
    failures, undecided = [], []
    for run, cells in pairs:
        found = regressions(cells, threshold, run) if threshold is not None else []
        if threshold is not None and not found and not any(c.comparable for c in cells):
            raise ValueError(f"{run.label}: no cell is comparable with {runs[0].label}, so --fail-on cannot check anything")
        prefix = f"{run.label}: " if len(pairs) > 1 else ""
        failures += [prefix + why for why in found]
        undecided += [prefix + why for why in cannot_judge(cells, threshold)] if threshold is not None else []
    if args.json:
        print(json.dumps(to_json(pairs, runs[0], ALPHA, threshold, failures, undecided), indent=2))
    else:
        for run, cells in pairs:
            before = runs[0].label if args.match_on == "cell" else f"{run.label}: the same cell in fp32"
            after = run.label if args.match_on == "cell" else f"{run.label}: rows in fp16, bf16 or fp8"
            print_deltas(cells, before, after, TEST, console, view_of(args), accuracy=args.match_on != "cell")
            floor = aa_noise_floor(cells) if args.match_on == "cell" and same_code_and_scenario(runs[0], run) else None
            if floor:
                console.print(Text(f"A/A: the same scenario and commit twice. Noise floor on this machine: throughput "
                                   f"changed by {spread_text(floor[0])} (intervals reach {spread_text(floor[1])}); a "
                                   "decision between placements must beat that", style="cyan"))
        if threshold is not None:
            if failures:
                console.print(Text.assemble((f"regression beyond {args.fail_on}:", "red"),
                                            "\n" + "\n".join(f"  {why}" for why in failures)))
            if undecided:
                console.print(Text.assemble((f"cannot judge at {args.fail_on} (exit {CANNOT_JUDGE}):", "yellow"),
                                            "\n" + "\n".join(f"  {why}" for why in undecided)))
            if not failures and not undecided:
                console.print(Text(f"no throughput drop beyond {args.fail_on}: every interval lies above it", style="green"))
    return 1 if failures else CANNOT_JUDGE if undecided else 0


def register(sub) -> None:
    comp = sub.add_parser("compare", help="compare runs cell by cell: deltas and their significance (B, C, ... against A)")
    comp.add_argument("runs", nargs="+", metavar="RUN", help="run directories; the first is the baseline")
    comp.add_argument("--fail-on", metavar="PCT", help="exit 1 when a cell's throughput interval lies below -PCT (e.g. 5%%) "
                      "or a cell fails; exit 3 when a run's noise (or a busy machine) is wider than PCT: cannot judge")
    comp.add_argument("--match-on", choices=("cell", "strategy"), default="cell",
                      help="cell: each run against the first, cell by cell (default); strategy: in each run, every cell "
                           "with rows in fp16/bf16/fp8 against the same strategy, parameters and ranks in fp32")
    comp_output = comp.add_mutually_exclusive_group()
    comp_output.add_argument("--json", action="store_true", help="print the comparison as JSON")
    add_view_flags(comp, COMPARE_COLUMNS, comp_output)
    comp.set_defaults(func=main)
