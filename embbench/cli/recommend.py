"""``embbench recommend``: the fastest measured placement that fits a memory budget, and why
not the others (with ``--torchrec-plan``, torchrec's planner's proposal beside it)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
from pathlib import Path

from rich.text import Text

from embbench.bounds import positive_flag
from embbench.cli.shared import console, runs_from
from embbench.commands import command
from embbench.results import RUN_CURVE


def main(args: argparse.Namespace) -> int:
    from embbench.recommend import Budget, parse_size, recommend
    from embbench.report import print_recommendations, print_torchrec_plans

    budget = Budget(parse_size(args.device_memory, "--device-memory"),
                    parse_size(args.host_memory, "--host-memory") if args.host_memory else None)
    runs = runs_from([args.run] + ([args.noise_floor_from] if args.noise_floor_from else []))
    records = runs[0].records
    floor = _aa_floor(runs, args) if args.noise_floor_from else None
    curve_file = Path(args.curve) if args.curve else Path(args.run) / RUN_CURVE
    curve = None
    if args.curve or curve_file.exists():
        from embbench.cache.curve import read_curve

        curve = read_curve(curve_file)
        if not args.json:
            console.print(Text(f"cache curve: {curve_file} (a ratio to measure next stops at its knee)", style="dim"))
    recs = recommend(records, budget, args.auc_tolerance, run_dir=args.run, curve=curve, aa_floor=floor)
    plans = {r.world_size: _torchrec_plan(records, curve_file, budget, r.world_size)
             for r in recs} if args.torchrec_plan else {}
    if args.json:
        print(json.dumps([{**dataclasses.asdict(r), **({"torchrec_plan": plans[r.world_size]} if plans else {})}
                          for r in recs], indent=2))
    else:
        print_recommendations(recs, budget, args.run, console)
        if plans:
            print_torchrec_plans(plans, recs, budget, console)
    return 0


def _aa_floor(runs, args: argparse.Namespace) -> float | None:
    """``--noise-floor-from``: the A/A noise floor of the run against the same scenario and
    commit run again (:func:`embbench.compare.aa_floor_of`), said once."""
    import math

    from embbench.compare import aa_floor_of, same_code_and_scenario
    from embbench.stats import spread_text

    if not same_code_and_scenario(*runs):
        raise ValueError(f"--noise-floor-from {args.noise_floor_from}: not the same scenario and clean commit as "
                         f"{args.run}, so the two are no A/A pair (`embbench compare` names what differs)")
    floor = aa_floor_of(runs)
    if floor is not None and not args.json:
        console.print(Text(f"A/A noise floor of {args.run} against {args.noise_floor_from}: "
                           f"{spread_text(math.expm1(floor))}; a winner must beat it", style="cyan"))
    return floor


def _torchrec_plan(records, curve_file: Path, budget, world_size: int) -> dict:
    """``recommend --torchrec-plan``: torchrec's planner on the run's tables at the budget (the
    host: ``--host-memory``, else this machine's memory), with the curve's statistics; where it
    cannot plan, why (the answer is still embbench's)."""
    device_bytes = budget.device_bytes
    host_bytes = budget.host_bytes or os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    out = {"world_size": world_size, "device_bytes_per_rank": device_bytes, "host_bytes": host_bytes, "tables": None,
           "unavailable": None}
    config = next((r.scenario for r in records if r.scenario.get("config")), None)
    try:
        if not curve_file.exists():
            raise ValueError(f"{curve_file}: no curve file (write one with `{command('curve', 'SCENARIO', '--out', curve_file)}`)")
        if config is None:
            raise ValueError("the records hold no scenario config to take the tables from")
        from embbench.cache.torchrec_stats import plan_tables
        from embbench.scenario import parse_scenario

        scenario, _ = parse_scenario(config["config"], config.get("file", "<record>"))
        tables = plan_tables(scenario.tables(), curve_file, device_bytes, world_size,
                             max(1, scenario.data.batch_size // world_size), host_bytes=host_bytes)
        out["tables"] = [dataclasses.asdict(t) for t in tables]
    except Exception as e:  # noqa: BLE001 - torchrec missing or its planner refusing must not cost the answer
        first = (str(e).strip().splitlines() or [""])[0]
        out["unavailable"] = f"{type(e).__name__}: {first}" if not isinstance(e, (ValueError, OSError)) else first
    return out


def register(sub) -> None:
    rec = sub.add_parser("recommend", help="the fastest measured placement that fits a memory budget, and why not the others")
    rec.add_argument("run", help="a run directory")
    rec.add_argument("--device-memory", required=True, metavar="SIZE", help="per device, e.g. 16GiB, 80GB, 512MiB")
    rec.add_argument("--host-memory", metavar="SIZE", help="per host (all ranks together)")
    rec.add_argument("--auc-tolerance", type=positive_flag(float, zero=True, at_most=1), default=0.001,
                     help="leave out cells whose AUC is below the baseline's by more than this (default 0.001)")
    rec.add_argument("--json", action="store_true", help="print the recommendation as JSON")
    rec.add_argument("--noise-floor-from", metavar="RUN2",
                     help="the same scenario and commit run again: every speed decision is held to the A/A noise "
                          "floor of the two runs, as `compare RUN RUN2 ...` holds it")
    rec.add_argument("--curve", help="an `embbench curve --out` JSON of the scenario (default RUN/curve.json if there): "
                                     "a suggested cache ratio stops at its knee")
    rec.add_argument("--torchrec-plan", action="store_true",
                     help="also print torchrec's planner's proposal for the run's tables at the same device memory, "
                          "with the curve's miss rates as its cache statistics (needs the curve)")
    rec.set_defaults(func=main)
