"""``embbench strategies``: the installed strategies, their parameters, and whether each runs here."""

from __future__ import annotations

import argparse

import torch
from rich.table import Table
from rich.text import Text

from embbench.cli.shared import console
from embbench.strategy import RuntimeEnv, broken_strategies, load_strategies, parameter_type


def main(args: argparse.Namespace) -> int:
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    table = Table(title=f"installed strategies (this machine: {device})", header_style="bold", show_lines=True)
    for col in ["name", "what it does", "parameters (default)", "runs here"]:
        table.add_column(col)
    for name, cls in load_strategies().items():
        params = Text("\n").join(
            Text.assemble(f"{key}: {parameter_type(f.annotation)} = {f.default!r}",
                          (f"  {f.description}" if f.description else "", "dim"))
            for key, f in cls.Params.model_fields.items()
        ) or "-"
        try:
            reason = cls().unsupported_reason(RuntimeEnv(device))
            runs = Text("yes", "green") if reason is None else Text.assemble(("no", "yellow"), f": {reason}")
        except Exception as e:  # a broken plugin is listed as such; the others still are
            runs = Text.assemble(("broken", "red"), f": unsupported_reason raised {type(e).__name__}: {e}")
        table.add_row(Text(name), Text(cls.summary), params, runs)
    for name, reason in broken_strategies().items():
        table.add_row(Text(name), "", "", Text.assemble(("broken", "red"), f": {reason}"))
    console.print(table)
    return 0


def register(sub) -> None:
    strategies = sub.add_parser("strategies", help="list installed strategies, their parameters, and whether they run here")
    strategies.set_defaults(func=main)
