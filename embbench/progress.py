"""What ``embbench run`` shows while it runs: each cell's phase, step k of n, elapsed time
and ETA (rich.progress) on a terminal; a line per finished cell; and a summary of the wall
time per cell at the end. And what a long computation of other commands (``embbench curve``)
shows: its phase, k of n, elapsed time and ETA."""

from __future__ import annotations

import time
from typing import Callable

from rich.console import Console
from rich.progress import (
    BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn, TimeRemainingColumn,
)

from rich.text import Text

from embbench.results import Record
from embbench.scenario import Cell

__all__ = ["PhaseProgress", "RunProgress"]

_STYLE = {"ok": "green", "unsupported": "yellow"}
#: A cell done faster than this started no processes (unsupported, skipped): its time is no sample for the ETA.
INSTANT_S = 1.0


def _bars(console: Console, live: bool) -> Progress:
    """A phase's bar: what, k of n, elapsed time and ETA (drawn on a terminal only)."""
    return Progress(SpinnerColumn(), TextColumn("{task.description}", markup=False), BarColumn(), MofNCompleteColumn(),
                    TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn(),
                    console=console, transient=True, disable=not live)


class PhaseProgress:
    """A ``progress(what, done, total)`` callback (:data:`embbench.cache.curve.Progress`) that
    shows the phase ``what`` as a live bar on a terminal (``live``), and otherwise prints a line
    as each phase starts and, in a long one, every ``every`` seconds (a log shows where the
    time went, and that it goes on)."""

    def __init__(self, console: Console, live: bool, clock: Callable[[], float] = time.monotonic, every: float = 30):
        self.console, self.live, self.clock, self.every = console, live, clock, every
        self.progress = _bars(console, live)
        self._task = self.progress.add_task("", total=None)
        self._phase: str | None = None
        self._begin = self._told = clock()

    def __enter__(self) -> "PhaseProgress":
        self.progress.start()
        return self

    def __exit__(self, *exc) -> None:
        self.progress.stop()

    def __call__(self, what: str, done: int, total: int) -> None:
        now = self.clock()
        if what != self._phase:  # a new phase: its own bar, elapsed time and ETA
            self._phase = what
            self.progress.reset(self._task, total=total or None, completed=done, description=what)
            self._line(f"{what}: {total} to do", now)
        else:
            self.progress.update(self._task, total=total or None, completed=done)
            if now - self._told >= self.every and done < total:
                self._line(f"{what}: {done} of {total} done", now)

    def _line(self, text: str, now: float) -> None:
        if not self.live:
            self.console.print(Text(f"{text} ({now - self._begin:.0f} s so far)", style="dim"))
            self._told = now


class RunProgress:
    """Callbacks for :func:`embbench.launch.run_cells` that drive the display.

    Args:
        console: where to print.
        cells: how many cells the run has.
        live: show the live bars (a terminal, not ``--quiet``); off, nothing is redrawn.
        lines: print a line per finished cell (off with ``--quiet``).
        clock: seconds, monotonic (a test passes its own).
    """

    def __init__(self, console: Console, cells: int, live: bool, lines: bool = True,
                 clock: Callable[[], float] = time.monotonic):
        self.console, self.lines, self.clock = console, lines, clock
        self.progress = _bars(console, live)
        self._cells = self.progress.add_task("cells", total=cells)
        self._phase = self.progress.add_task("", total=None, visible=False)
        self._started: dict[str, float] = {}
        self.wall: dict[str, float | None] = {}  # cell id -> seconds (None: kept from an earlier run)
        self._not_run = 0
        self._begin = clock()

    def __enter__(self) -> "RunProgress":
        self.progress.start()
        return self

    def __exit__(self, *exc) -> None:
        self.progress.stop()

    def on_start(self, cell: Cell) -> None:
        self._started[cell.id] = self.clock()
        self.progress.reset(self._phase, total=None, description=f"{cell.id}  starting", visible=True)

    def on_progress(self, cell: Cell, phase: str, step: int, total: int) -> None:
        """``step`` steps of ``total`` done in ``phase`` (build, warmup, measure, count, catch-up, eval)."""
        description = f"{cell.id}  {phase}"  # plain text: the column does not read markup
        task = self.progress.tasks[self._phase]
        if task.description != description:  # a new phase: its own bar, elapsed time and ETA
            self.progress.reset(self._phase, total=total or None, completed=step, description=description)
        else:
            self.progress.update(self._phase, total=total or None, completed=step)

    def on_done(self, cell: Cell, record: Record) -> None:
        start = self._started.pop(cell.id, None)
        self.wall[cell.id] = None if start is None else self.clock() - start
        if self.wall[cell.id] is None or self.wall[cell.id] < INSTANT_S:
            # kept from an earlier run, or not started (unsupported, skipped): no sample of a cell's time,
            # so it leaves the bar's count instead of making its ETA as short as it took
            task = self.progress.tasks[self._cells]
            self.progress.update(self._cells, total=max(task.completed, (task.total or 0) - 1))
            self._not_run += 1
            self.progress.update(self._cells, description=f"cells ({self._not_run} kept or not started)")
        else:
            self.progress.advance(self._cells)
        self.progress.update(self._phase, visible=False)
        if self.lines:
            style = _STYLE.get(record.status, "red")
            first_line = record.message.splitlines()[0] if record.message else ""
            took = "" if self.wall[cell.id] is None else f"{self.wall[cell.id]:6.1f} s"
            self.console.print(Text.assemble("  ", (f"{record.status:>11}", style), f"  {took:>8}  {cell.id}  ",
                                             (first_line, "dim")))

    def summary(self) -> str:
        """``wall time per cell: a 3.1 s, b 4.0 s (resumed: c); total 7.2 s``."""
        ran = [f"{cell} {seconds:.1f} s" for cell, seconds in self.wall.items() if seconds is not None]
        kept = [cell for cell, seconds in self.wall.items() if seconds is None]
        text = "wall time per cell: " + (", ".join(ran) if ran else "none ran")
        if kept:
            text += f" (kept from the run directory: {', '.join(kept)})"
        return text + f"; total {self.clock() - self._begin:.1f} s"
