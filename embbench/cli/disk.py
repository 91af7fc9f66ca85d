"""``embbench disk PATH``: what the drive holding PATH can read (random 4 KiB O_DIRECT reads a
second at a few queue depths) beside the reader's own ceiling (:func:`embbench.disk.probe.measure_drive`)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from embbench.disk.layout import PAGE
from embbench.disk.probe import DEFAULT_DEPTHS, DriveProbe, measure_drive
from embbench.disk.reader import ENGINES

def register(sub) -> None:
    parser = sub.add_parser("disk", help="measure a drive's random 4 KiB reads a second (for store: file and "
                                         "curve --tiers) beside the reader's ceiling")
    _add_arguments(parser)
    parser.set_defaults(func=main)

def _add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("path", type=Path, help="a folder on the drive to measure (a scratch file is written there)")
    parser.add_argument("--seconds", type=float, default=3.0, help="time at each queue depth (default 3)")
    parser.add_argument("--depths", default=",".join(map(str, DEFAULT_DEPTHS)),
                        help="reads in flight, comma-separated (default %(default)s)")
    parser.add_argument("--file-size", default="1GiB",
                        help="the scratch file's size (default %(default)s; larger than the drive's cache is best)")
    parser.add_argument("--engine", choices=ENGINES, default="pread", help="the reader (default %(default)s)")
    parser.add_argument("--json", action="store_true", help="print the result as JSON instead of a table")

def main(args: argparse.Namespace) -> int:
    from rich.console import Console

    from embbench.recommend import parse_size

    try:
        depths = tuple(int(d) for d in args.depths.split(","))
    except ValueError:
        return _fail(f"--depths {args.depths!r}: expected numbers separated by commas, e.g. 1,4,16,64")
    try:
        probe = measure_drive(args.path, args.seconds, depths, parse_size(args.file_size, "--file-size"),
                              engine=args.engine)
    except (OSError, ValueError) as error:
        return _fail(error.strerror if isinstance(error, OSError) and error.strerror else str(error))
    if args.json:
        print(json.dumps(probe.as_dict(), indent=2))
    else:
        Console().print(probe_table(probe))
    return 0

def _fail(message: str) -> int:
    print(f"embbench disk: {message}", file=sys.stderr)  # one line, however narrow the terminal
    return 2

def probe_table(probe: DriveProbe):
    from rich.table import Table

    table = Table(title=f"Random {PAGE // 1024} KiB reads: {probe.path} ({probe.filesystem} on {probe.device})",
                  caption=_caption(probe))
    for name in ("in flight", "drive reads/s", "drive MiB/s", "mean latency µs", "reader from memory reads/s"):
        table.add_column(name, justify="right")
    for i, memory in enumerate(probe.memory):
        drive = probe.drive[i] if probe.drive else None
        table.add_row(str(memory.depth),
                      *(("—",) * 3 if drive is None else (f"{drive.reads_per_s:,.0f}", f"{drive.mib_per_s:,.1f}",
                                                           f"{drive.mean_latency_us:,.0f}")),
                      f"{memory.reads_per_s:,.0f}")
    return table

def _caption(probe: DriveProbe) -> str:
    from embbench.recommend import format_bytes  # imports torch: only for the command

    lines = [f"reader: {probe.reader}, as many in flight as the row says; its ceiling, from memory: "
             f"{probe.reader_ceiling:,.0f} reads/s",
             f"load average {probe.load[0]:.1f} before, {probe.load[1]:.1f} after, on {probe.cpus} CPUs"]
    if probe.problem:
        lines.append(f"no drive measured: {probe.problem}")
    else:
        lines.append(f"O_DIRECT reads of a {format_bytes(probe.file_bytes)} scratch file; latency = in flight / rate")
    return "\n".join(lines)
