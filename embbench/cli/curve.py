"""``embbench curve``: hit rate against cache size of LRU, LFU, freqcache and Belady's MIN on a
scenario's training ids."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from rich.text import Text

from embbench.bounds import CURVE_MAX_BATCHES, positive_flag
from embbench.cli.data import data_cache, prepare_data
from embbench.cli.shared import comma_names, console
from embbench.outputs import atomic_write, claim_output, head_has
from embbench.progress import PhaseProgress
from embbench.scenario import load_scenario


def main(args: argparse.Namespace) -> int:
    from embbench.cache.curve import CURVE_FORMAT, to_csv
    from embbench.cache.curve_scenario import curve_tables, scenario_curve

    out = Path(args.out) if args.out else None
    if out is not None:
        if out.suffix not in (".json", ".csv"):
            raise ValueError(f"--out {out}: give a .json or .csv file name")
        claim_output(out, "--out", "embbench curve", lambda path: head_has(path, CURVE_FORMAT.encode())
                     or head_has(path, b"scope,rows,policy,ratio"), args.overwrite)
    if (args.iops or args.step_ms) and not args.tiers:
        raise ValueError("--iops and --step-ms are the drive's and the step's for --tiers: give --tiers too")
    if args.tiers and out is not None and out.suffix == ".csv":
        raise ValueError(f"--out {out}: --tiers writes its section into a .json --out, not a .csv")
    elsewhere = sorted(set(args.freqcache_sizes or ()) - set(args.sizes))
    if elsewhere:
        raise ValueError(f"--freqcache-sizes {','.join(map(str, elsewhere))}: not among --sizes "
                         f"{','.join(map(str, args.sizes))}; freqcache is driven at sizes of the curve")
    scenario, _ = load_scenario(args.scenario, scale=args.scale, batch_size=args.batch_size)
    prepare_data(args.scenario, scenario, data_cache(args), batches=(args.warmup + args.steps, 0))  # its own reads
    with PhaseProgress(console, live=console.is_terminal) as progress:
        curve = scenario_curve(scenario, args.sizes, args.policies, args.warmup, args.steps, args.freqcache_sizes, progress)
    for shown in curve_tables(curve):
        console.print(shown)
    if args.tiers:  # the tier model: embbench.cache.tiers
        from embbench.cache.tiers import scenario_tiers, tiers_table

        curve["tiers"] = scenario_tiers(scenario, args.tiers, args.policies, args.warmup, args.steps, args.iops, args.step_ms)
        console.print(tiers_table(curve["tiers"], scenario.name))
    if out is not None:
        text = to_csv(curve) if out.suffix == ".csv" else json.dumps(curve, indent=1)
        atomic_write(out, lambda f: f.write(text.encode()), "the curve")  # a full disk leaves no half curve
        console.print(Text(f"{out}: every size, policy and table"))
    return 0


def _ratios(text: str) -> list[float]:
    """``--sizes 0.001,0.01``: cache ratios in (0, 1]."""
    return sorted({positive_flag(float, at_most=1)(item) for item in text.split(",")})


def _policies(text: str) -> list[str]:
    from embbench.cache.curve import POLICIES

    names = comma_names(text)
    unknown = [n for n in names if n not in POLICIES]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown policy {', '.join(unknown)}; known: {', '.join(POLICIES)}")
    return [p for p in POLICIES if p in names]


def register(sub) -> None:
    from embbench.cache.curve import DEFAULT_RATIOS, POLICIES

    curve = sub.add_parser("curve", help="hit rate against cache size of LRU, LFU, freqcache and Belady's MIN on a "
                                         "scenario's training ids, per table and all together")
    curve.add_argument("scenario", help="scenario YAML file (its data section: synthetic, Criteo files or a trace)")
    curve.add_argument("--sizes", type=_ratios, default=list(DEFAULT_RATIOS), metavar="R,R,...",
                       help="cache sizes as ratios of the rows (default 12 from 0.001 to 0.2, log-spaced)")
    curve.add_argument("--policies", type=_policies, default=list(POLICIES), metavar="P,P,...",
                       help=f"any of {','.join(POLICIES)} (default all)")
    curve.add_argument("--freqcache-sizes", type=_ratios, metavar="R,R,...",
                       help="where freqcache's planner is driven, a simulation each (default the smallest, middle and largest size)")
    curve.add_argument("--warmup", type=positive_flag(int, zero=True, at_most=CURVE_MAX_BATCHES), default=48,
                       help="training batches simulated before counting (default 48: freqcache's 32 profiled and 16 "
                            f"warm-up; at most {CURVE_MAX_BATCHES:,}: the curve holds them in memory)")
    curve.add_argument("--steps", type=positive_flag(int, at_most=CURVE_MAX_BATCHES), default=64,
                       help=f"training batches counted (default 64, at most {CURVE_MAX_BATCHES:,})")
    curve.add_argument("--out", help="also write every size, policy and table: a .json or .csv file")
    curve.add_argument("--overwrite", action="store_true", help="replace an existing --out that is not a curve (never a record)")
    curve.add_argument("--scale", type=positive_flag(float, at_most=1), help="as `run --scale` (synthetic data only)")
    curve.add_argument("--batch-size", type=positive_flag(int), help="as `run --batch-size`: the global batch")
    curve.add_argument("--data-cache", help="parsed-file cache of a criteo_tsv scenario (default: results/data-cache)")
    from embbench.cache.tiers import parse_iops, parse_tiers

    curve.add_argument("--tiers", type=parse_tiers, metavar="hbm=1.5%,dram=10%",
                       help="also model the tiers: a device cache of that share of the rows over a host cache of that share "
                            "of the pages over a drive (page reads and writes a batch; in the --out .json as `tiers`)")
    curve.add_argument("--iops", type=parse_iops, metavar="N", help="with --tiers: the drive's random 4 KiB reads a second "
                                                                    "(`embbench disk PATH` measures one)")
    curve.add_argument("--step-ms", type=positive_flag(float), help="with --tiers: a measured step, to say whether the drive keeps up")
    curve.set_defaults(func=main)
