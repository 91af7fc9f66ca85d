"""``embbench run | strategies | show``."""

from __future__ import annotations

import argparse
import os
import sys
import typing
from pathlib import Path

import torch
from rich.console import Console
from rich.markup import escape
from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn
from rich.table import Table

from embbench.launch import run_cells
from embbench.report import print_comparison
from embbench.results import load_records
from embbench.runner import resolve_device
from embbench.scenario import ScenarioError, load_scenario
from embbench.strategy import RuntimeEnv, Unsupported, load_strategies

# Logs and CI are not terminals: give tables room rather than wrapping every cell.
console = Console(width=None if sys.stdout.isatty() else 180)


def _device_capacity(device: torch.device) -> int:
    if device.type == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _dry_run(scenario, cells) -> None:
    try:
        device = resolve_device(scenario.run.device)
    except Unsupported:
        device = torch.device("cuda")
    capacity = _device_capacity(device) if device.type == "cpu" or torch.cuda.is_available() else None
    tables = scenario.tables()
    table_bytes = sum(t.num_bytes for t in tables)
    grid = Table(title=f"{scenario.name}: {len(cells)} cells (nothing is run)", header_style="bold",
                 caption=f"{len(tables)} tables, {sum(t.num_rows for t in tables):,} rows, "
                         f"{table_bytes / 2**30:,.2f} GiB of weights; per-rank estimates on {device}")
    for col in ["cell", "device GiB / rank", "host GiB / rank", "fits"]:
        grid.add_column(col, justify="left" if col == "cell" else "right")
    for cell in cells:
        est = cell.make_strategy().estimate_memory(tables, scenario.optimizer.embedding, cell.world_size)
        if est is None:
            grid.add_row(escape(cell.id), "?", "?", "?")
            continue
        fits = "?" if capacity is None else ("yes" if est.device_bytes <= capacity else "[red]no[/red]")
        grid.add_row(escape(cell.id), f"{est.device_bytes / 2**30:,.3f}", f"{(est.host_bytes + est.pinned_bytes) / 2**30:,.3f}", fits)
    console.print(grid)


def cmd_run(args: argparse.Namespace) -> int:
    strategies = [s.strip() for s in args.strategies.split(",")] if args.strategies else None
    scenario, cells = load_scenario(args.scenario, steps=args.steps, scale=args.scale, strategies=strategies)
    if args.dry_run:
        _dry_run(scenario, cells)
        return 0
    out = Path(args.out) if args.out else Path("results") / "runs" / f"{Path(args.scenario).stem}-{scenario.digest()[:10]}"
    console.print(f"[bold]{scenario.name}[/bold]: {len(cells)} cells -> {out}")
    with Progress(SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                  TimeElapsedColumn(), console=console, transient=True) as progress:
        task = progress.add_task("starting", total=len(cells))

        def on_start(cell):
            progress.update(task, description=f"running {escape(cell.id)}")

        def on_done(cell, record):
            progress.advance(task)
            style = "green" if record.status == "ok" else "yellow" if record.status == "unsupported" else "red"
            first_line = (record.message or "").splitlines()[0] if record.message else ""
            console.print(f"  [{style}]{record.status:>11}[/{style}]  {escape(cell.id)}  [dim]{escape(first_line)}[/dim]")

        records = run_cells(scenario, str(args.scenario), cells, out, resume=args.resume,
                            on_start=on_start, on_done=on_done)
    print_comparison(records, console, title=scenario.name)
    console.print(f"records: {out}")
    return 0


def _type_name(annotation) -> str:
    if typing.get_origin(annotation) is typing.Literal:
        return " | ".join(repr(a) for a in typing.get_args(annotation))
    return getattr(annotation, "__name__", str(annotation))


def cmd_strategies(args: argparse.Namespace) -> int:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    table = Table(title=f"installed strategies (this machine: {device})", header_style="bold", show_lines=True)
    for col in ["name", "what it does", "parameters (default)", "runs here"]:
        table.add_column(col)
    for name, cls in load_strategies().items():
        params = "\n".join(
            f"{key}: {_type_name(f.annotation)} = {f.default!r}"
            + (f"  [dim]{f.description}[/dim]" if f.description else "")
            for key, f in cls.Params.model_fields.items()
        ) or "-"
        reason = cls().unsupported_reason(RuntimeEnv(device))
        table.add_row(name, escape(cls.summary), escape(params), "[green]yes[/green]" if reason is None else f"[yellow]no[/yellow]: {reason}")
    console.print(table)
    return 0


def cmd_show(args: argparse.Namespace) -> int:
    records = load_records(Path(args.results))
    print_comparison(records, console, title=str(args.results))
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="embbench", description="Benchmark embedding-table placement strategies.")
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run every cell of a scenario and print the comparison")
    run.add_argument("scenario", help="scenario YAML file")
    run.add_argument("--steps", type=int, help="measured steps per repeat (overrides run.steps)")
    run.add_argument("--scale", type=float, help="multiply table cardinalities (overrides data.scale)")
    run.add_argument("--strategies", help="comma-separated subset of the scenario's strategies")
    run.add_argument("--out", help="run directory (default: results/runs/<scenario>-<hash>)")
    run.add_argument("--resume", action="store_true", help="skip cells already recorded in the run directory")
    run.add_argument("--dry-run", action="store_true", help="print the matrix with memory estimates; run nothing")
    run.set_defaults(func=cmd_run)
    strategies = sub.add_parser("strategies", help="list installed strategies, their parameters, and whether they run here")
    strategies.set_defaults(func=cmd_strategies)
    show = sub.add_parser("show", help="print the comparison table of a (partial) run")
    show.add_argument("results", help="a run directory or one record file")
    show.set_defaults(func=cmd_show)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ScenarioError, FileNotFoundError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
