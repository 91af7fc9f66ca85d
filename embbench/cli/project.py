"""``embbench project``: a model of throughput at other world sizes and link bandwidths, from a run."""

from __future__ import annotations

import argparse
from pathlib import Path

from rich.table import Table
from rich.text import Text

from embbench.bounds import positive_flag
from embbench.cli.shared import console, skip_damaged
from embbench.results import RecordError, load_records


def main(args: argparse.Namespace) -> int:
    from embbench.projection import ASSUMPTIONS, DEFAULT_LINKS_GBPS, project, why_not_projectable
    from embbench.scenario import parse_scenario

    links = args.links or dict(DEFAULT_LINKS_GBPS)
    records = [r for r in load_records(Path(args.results), on_damaged=skip_damaged) if r.status == "ok"]
    if not records:
        raise ValueError(f"{args.results}: no finished (ok) cells to project from")
    refused = {r.cell_id: why for r in records if (why := why_not_projectable(r))}
    trusted = [r for r in records if r.cell_id not in refused]
    for cell_id, why in refused.items():
        console.print(Text(f"not projected from {cell_id}: {why}", style="yellow"))
    if not trusted:
        raise ValueError(f"{args.results}: no cell to project from (each one's ranks shared CPU cores); measure on "
                         "one rank per core, or on GPUs")
    console.print(Text(f"assumed: {ASSUMPTIONS}", style="dim"))
    table = Table(title="PROJECTION — a model (embbench/projection.py), not a measurement: samples/s", header_style="bold",
                  caption="t(W, bw) = (T0 - S0) * W0 / W + C(W) / bw + 4 * latency; T0: the measured step (median of the repeats' medians, as show) and "
                          "S0: time in collectives, on the rank with the most; C: bytes the busiest rank sends per step; "
                          "measured: the cell's own world size (its measured samples/s in brackets)")
    table.add_column("cell", justify="left")
    table.add_column("world", justify="right")
    for link, gbps in links.items():
        table.add_column(f"{link}\n{gbps:g} GB/s", justify="right")
    one_rank = []
    for record in trusted:
        if "config" not in record.scenario:
            raise RecordError(f"{args.results}: the record of {record.cell_id} holds no scenario config to project from")
        scenario, _ = parse_scenario(record.scenario["config"], record.scenario.get("file", "<record>"))
        rows = project(record, scenario.tables(), args.worlds, links, args.latency_us * 1e-6)
        if record.world_size == 1 and any(w > 1 for w in args.worlds):
            one_rank.append(record.cell_id)
        for world in args.worlds:
            rates = [f"{row['samples_per_s']:,.0f}" for row in rows if row["world_size"] == world]
            measured = world == record.world_size
            label = Text(f"{world} (measured: {record.metrics['samples_per_step'] / rows[0]['measured_step_s']:,.0f})"
                         if measured else str(world), style="bold" if measured else "")
            table.add_row(Text(record.cell_id), label, *rates)
        table.add_section()
    console.print(table)
    if one_rank:
        console.print(Text(f"{', '.join(one_rank)}: measured on one rank, so no collective was measured: the "
                           "scaling shown is the model's assumption alone; project from a multi-rank cell", style="yellow"))
    return 0


def _world_sizes(text: str) -> list[int]:
    """``--worlds 1,2,4``: world sizes of at least 1."""
    return [positive_flag(int)(item) for item in text.split(",")]


def _links(text: str) -> dict[str, float]:
    """``--links nvlink=450,net100=12.5``: names with bandwidths above 0 GB/s."""
    links = {}
    for item in text.split(","):
        name, sep, gbps = item.partition("=")
        if not sep or not name:
            raise argparse.ArgumentTypeError(f"{item!r}: expected name=GB/s,... e.g. nvlink=450,net100=12.5")
        try:
            links[name] = positive_flag(float)(gbps)
        except argparse.ArgumentTypeError as e:
            raise argparse.ArgumentTypeError(f"{name}: {e}") from None
    return links


def register(sub) -> None:
    proj = sub.add_parser("project", help="model throughput at other world sizes and link bandwidths from a run")
    proj.add_argument("results", help="a run directory or one record file")
    proj.add_argument("--worlds", type=_world_sizes, default=[1, 2, 4, 8], help="world sizes to project (default 1,2,4,8)")
    proj.add_argument("--links", type=_links, help="name=GB/s,... per-rank link bandwidths (default nvlink, pcie5, net400, net100)")
    proj.add_argument("--latency-us", type=positive_flag(float, zero=True), default=0.0, help="latency per collective (4 per step), microseconds")
    proj.set_defaults(func=main)
