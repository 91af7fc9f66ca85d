"""``embbench run``: every cell of a scenario (or ``--dry-run``: what would run, with memory
and time estimates), then the comparison table."""

from __future__ import annotations

import argparse
import contextlib
import re
import sys
import tempfile
from pathlib import Path

import torch
from rich.table import Table
from rich.text import Text

from embbench.bounds import positive_flag
from embbench.cli.data import data_cache, prepare_data
from embbench.cli.shared import add_view_flags, comma_names, console, view_of
from embbench.commands import run_command
from embbench.device import resolve_device
from embbench.estimate import LONG_RUN_S, at_least, cell_times, duration, is_too_long, over_limit
from embbench.launch import (HOST_HEADROOM, RANK_PROCESS_BYTES, RecordsNotWritten, memory_estimate, other_scenario,
                             outcome_without_launch, rank_process_bytes, run_cells)
from embbench.optional import MissingDependency, require
from embbench.outputs import claim_output, head_has
from embbench.progress import RunProgress
from embbench.report import SHOW_COLUMNS, print_comparison, profile_tables
from embbench.results import FAILED_STATUSES, run_directory_lock
from embbench.scenario import load_scenario
from embbench.strategy import Unsupported
from embbench.torchrun_job import run_cells_in_job, torchrun_ranks


# ``run``'s exit codes (README "Exit codes", docs/guarantees.md): 0 every cell ok, or unsupported
# or skipped here beside at least one ok; 2 bad input (embbench.cli); 130 interrupted.
#: A cell failed (:data:`embbench.results.FAILED_STATUSES`), or a record could not be written.
EXIT_CELLS_FAILED = 1
#: No cell of the scenario could start here (each unsupported or skipped).
EXIT_NOTHING_RAN = 4


def _targets_a_gpu(scenario) -> bool:
    """Whether a scenario is written for GPUs: its run.device names CUDA, or its name says GPU."""
    return scenario.run.device == "cuda" or "gpu" in scenario.name.lower()


def _gib(n: int | None) -> str:
    return "?" if n is None else f"{n / 2**30:,.3f}"


def _dry_run(scenario, cells, run_dirs: list[Path]) -> list[str]:
    """The matrix as ``run`` would meet it on this machine (each cell runs, or what ``run`` would
    record without starting it: unsupported, skipped, error, with the reason), the per-rank
    memory estimates here and, for a scenario written for GPUs on a machine without one, on
    its target device too, and the time of each cell that runs (:mod:`embbench.estimate`, from
    the records in ``run_dirs`` where they match). Returns the ids of the cells that would be skipped."""
    try:
        here = resolve_device(scenario.run.device)
    except Unsupported:
        here = None
    on_gpu_too = _targets_a_gpu(scenario) and (here is None or here.type != "cuda")
    tables = scenario.tables()
    table_bytes = sum(t.num_bytes for t in tables)
    caption = (f"{len(tables)} tables, {sum(t.num_rows for t in tables):,} rows, {table_bytes / 2**30:,.2f} GiB of weights; "
               f"per-rank estimates on this machine ({here or 'no usable device'})")
    if on_gpu_too:
        caption += " and, as the scenario is written for GPUs, on a GPU (device memory there, host memory beside it)"
    caption += (f"; host memory with each rank's process (interpreter and libraries), of which a cell may take "
                f"{100 * (1 - HOST_HEADROOM):.0f}% of what is free")
    grid = Table(title=Text(f"{scenario.name}: {len(cells)} cells (nothing is run)", style="table.title"),
                 header_style="bold", caption=caption)
    for col in ["cell", "device GiB / rank", "host GiB / rank"] + (["on a GPU: device / host GiB"] if on_gpu_too else []) \
            + ["time here (source)", "run here"]:
        grid.add_column(col, justify="left" if col in ("cell", "run here", "time here (source)") else "right")
    skipped = []
    estimates, outcomes = {}, {}
    for cell in cells:
        try:
            estimates[cell.id] = memory_estimate(scenario, cell)
        except Exception:
            estimates[cell.id] = None  # a broken plugin: outcome_without_launch names it
        outcomes[cell.id] = outcome_without_launch(scenario, cell)
    times = {t.cell_id: t for t in _cell_times(scenario, [c for c in cells if outcomes[c.id] is None], run_dirs, here,
                                               estimates)}
    for cell in cells:
        estimate, outcome = estimates[cell.id], outcomes[cell.id]
        process = rank_process_bytes(here or torch.device("cpu"))  # each rank's interpreter and libraries
        if estimate is None:
            device = host = None
        elif here is not None and here.type == "cpu":  # the "device" is the host
            device, host = 0, estimate.device_bytes + estimate.host_bytes + estimate.pinned_bytes + process
        else:
            device, host = estimate.device_bytes, estimate.host_bytes + estimate.pinned_bytes + process
        on_gpu_host = estimate.host_bytes + estimate.pinned_bytes + RANK_PROCESS_BYTES["cuda"] if estimate else None
        gpu = [f"{_gib(estimate.device_bytes)} / {_gib(on_gpu_host)}" if estimate else "? / ?"] if on_gpu_too else []
        if outcome is None:
            verdict = Text("yes" if estimate else "yes (no estimate)", style="green")
        else:
            status = "error (a broken plugin)" if outcome.status == "error" else outcome.status  # its only cause here
            verdict = Text.assemble((status, "red" if outcome.status == "error" else "yellow"), f": {outcome.message}")
            if outcome.status == "skipped":
                skipped.append(cell.id)
        time_here = times.get(cell.id)
        shown = Text(f"{at_least([time_here])}{duration(time_here.seconds)} ({time_here.source})" if time_here else "-",
                     style="red" if time_here and time_here.seconds > scenario.run.time_limit_s else "")
        grid.add_row(Text(cell.id), _gib(device), _gib(host), *gpu, shown, verdict)
    console.print(grid)
    _say_times(scenario, list(times.values()))
    return skipped


def _cell_times(scenario, cells, run_dirs: list[Path], here, memory: dict) -> list:
    """:func:`embbench.estimate.cell_times` of the cells that run here, their ranks' bytes from the memory estimates."""
    def bytes_to_fill(cell):
        est = memory.get(cell.id)
        return None if est is None else cell.world_size * (est.device_bytes + est.host_bytes + est.pinned_bytes)

    return cell_times(scenario, cells, run_dirs, here, bytes_to_fill) if cells and here is not None else []


def _say_times(scenario, times: list) -> None:
    """The estimated total, where each cell's time came from, and the cells the time limit would stop."""
    if not times:
        return
    sources = {t.source: t.detail for t in sorted(times, key=lambda t: t.source)}
    lines = [f"estimated time here: {at_least(times)}{duration(sum(t.seconds for t in times))} for {len(times)} cell(s) "
             "(start-up + build + steps; ≥: a floor; docs/measurement.md#how-long-a-run-takes)"]
    lines += [f"  {source}: {detail}" for source, detail in sources.items()]
    late = over_limit(times, scenario.run.time_limit_s)
    if late:
        lines.append(f"{len(late)} cell(s) would hit run.time_limit_s ({duration(scenario.run.time_limit_s)}) and end "
                     f"as timeout: {', '.join(t.cell_id for t in late)}")
    console.print(Text("\n".join(lines)), soft_wrap=True)


def _scale_that_fits(args: argparse.Namespace, scenario, skipped: list[str]) -> dict | None:
    """The largest scale (5, 2 or 1 times a power of ten, below the scenario's) at which every
    cell in ``skipped`` passes the memory preflight on this machine now (the ``run`` flags that
    make it), or None when none does down to 1e-9."""
    current = scenario.data.scale
    for exponent in range(0, 10):
        for mantissa in (5, 2, 1):
            scale = float(f"{mantissa}e-{exponent}")
            if scale >= current:
                continue
            flags = {**_shape_flags(args), "scale": scale}
            smaller, cells = load_scenario(args.scenario, strategies=args.strategies, **flags)
            if all(outcome_without_launch(smaller, c) is None for c in cells if c.id in skipped):
                return flags
    return None


def _run_time(args: argparse.Namespace, flags: dict) -> tuple:
    """The estimated cell times of ``run`` with these flags, and that scenario's time limit."""
    scenario, cells = load_scenario(args.scenario, strategies=args.strategies, **flags)
    here = resolve_device(scenario.run.device)
    runs = [c for c in cells if outcome_without_launch(scenario, c) is None]
    return _cell_times(scenario, runs, _earlier_run_dirs(args, scenario), here,
                       {c.id: memory_estimate(scenario, c) for c in runs}), scenario.run.time_limit_s


def _fewer_steps(args: argparse.Namespace, flags: dict, steps: int) -> tuple[dict, list]:
    """The flags with the most measured steps below ``steps`` (halving) at which the run fits
    :func:`is_too_long`'s bounds, or at ``--steps 1`` when none does; with the times there."""
    while True:
        steps = max(1, steps // 2)
        fewer = {**flags, "steps": steps}
        times, limit = _run_time(args, fewer)
        if steps == 1 or not is_too_long(times, limit):
            return fewer, times


def _say_what_fits(args: argparse.Namespace, scenario, skipped: list[str]) -> None:
    """After the skipped cells' reasons: the scale at which those refused for room (memory, a
    drive's space) would run; those refused for their store_dir are named apart, as no scale
    mends them."""
    if not skipped:
        return
    causes = {cell.id: getattr(outcome_without_launch(scenario, cell), "cause", None)
              for cell in load_scenario(args.scenario, strategies=args.strategies, **_shape_flags(args))[1]
              if cell.id in skipped}
    folders = [cell for cell, cause in causes.items() if cause == "store_dir"]
    if folders:
        console.print(Text(f"{len(folders)} cell(s) cannot use their store_dir (see each one's reason): give them an "
                           "existing folder this user can write", style="yellow"), soft_wrap=True)
    shapes = [cell for cell, cause in causes.items() if cause == "shape"]
    if shapes:
        console.print(Text(f"{len(shapes)} cell(s) refuse this shape (see each one's reason): a smaller --scale does "
                           "not mend that", style="yellow"), soft_wrap=True)
    skipped = [cell for cell in skipped if cell not in folders + shapes]
    if not skipped:
        return
    room = " and ".join(sorted({{"drive": "drive space"}.get(causes.get(c) or "memory", "memory") for c in skipped}))
    flags = _scale_that_fits(args, scenario, skipped)
    if flags is None:
        console.print(Text(f"{len(skipped)} cell(s) would not fit this machine's {room} now: no scale down to 1e-9 "
                           "fits them", style="yellow"), soft_wrap=True)
        return
    command = lambda f: run_command(args.scenario, strategies=args.strategies, data_cache=args.data_cache, **f)  # noqa: E731
    times, limit = _run_time(args, flags)
    lines = [f"{len(skipped)} cell(s) would not fit this machine's {room} now: at a scale that fits them all, run",
             f"  {command(flags)}", f"  {_time_line(times, limit)}"]
    if is_too_long(times, limit):
        fewer, fewer_times = _fewer_steps(args, flags, load_scenario(args.scenario, **flags)[0].run.steps)
        fits = not is_too_long(fewer_times, limit)
        lines += [f"that is {'over an hour' if sum(t.seconds for t in times) > LONG_RUN_S else 'past the time limit'}; "
                  + ("with fewer measured steps:" if fits else "even one measured step a repeat is too long (the build "
                     "and warm-up dominate): a smaller --scale or fewer --strategies"),
                  f"  {command(fewer)}", f"  {_time_line(fewer_times, limit)}"]
    console.print(Text("\n".join(lines), style="yellow"), soft_wrap=True)


def _time_line(times: list, limit: float) -> str:
    late = over_limit(times, limit)
    return (f"estimated {at_least(times)}{duration(sum(t.seconds for t in times))} for {len(times)} cell(s), the longest "
            f"{duration(max((t.seconds for t in times), default=0))} ({', '.join(sorted({t.source for t in times}))})"
            + (f"; {len(late)} past run.time_limit_s ({duration(limit)})" if late else ""))


def _run_directory(path: Path) -> Path:
    """``--out``: a directory this process can write into (made if missing)."""
    if path.exists() and not path.is_dir():
        raise ValueError(f"--out {path}: exists and is not a directory")
    try:
        path.mkdir(parents=True, exist_ok=True)
        tempfile.TemporaryFile(dir=path).close()
    except OSError as e:
        raise ValueError(f"--out {path}: cannot write there: {e.strerror or e}") from None
    return path


def _run_name(scenario) -> str:
    """The scenario's name as a folder name (characters other than letters, digits, ``.`` and ``-`` as ``_``)."""
    return re.sub(r"[^\w.-]+", "_", scenario.name, flags=re.ASCII).strip("._") or "scenario"


def _default_run_dir(scenario) -> Path:
    """``results/runs/<scenario's name>-<hash of the effective scenario>``."""
    return Path("results") / "runs" / f"{_run_name(scenario)}-{scenario.digest()[:10]}"


def _earlier_run_dirs(args: argparse.Namespace, scenario) -> list[Path]:
    """Where earlier runs of the scenario may be: ``--out`` and ``results/runs/<name>-*``."""
    return ([Path(args.out)] if args.out else []) + sorted((Path("results") / "runs").glob(f"{_run_name(scenario)}-*"))


def _shape_flags(args: argparse.Namespace) -> dict:
    """``run``'s flags that change the scenario, as :func:`load_scenario` and :func:`run_command` take them."""
    return {"steps": args.steps, "scale": args.scale, "batch_size": args.batch_size, "embedding_dim": args.embedding_dim}


def main(args: argparse.Namespace) -> int:
    torchrun = torchrun_ranks()  # a partial torchrun environment stops here, named
    scenario, cells = load_scenario(args.scenario, strategies=args.strategies, **_shape_flags(args))
    if args.profile and torchrun:
        raise ValueError("--profile: not available under torchrun (run on one host without torchrun to profile)")
    out = Path(args.out) if args.out else _default_run_dir(scenario)
    mixed = other_scenario(out, scenario, str(args.scenario))
    if mixed:  # its tables would put cells of two scenarios side by side
        raise ValueError(mixed)
    if args.dry_run:
        prepare_data(args.scenario, scenario, data_cache(args), verify=args.verify_data)
        _say_what_fits(args, scenario, _dry_run(scenario, cells, _earlier_run_dirs(args, scenario)))
        return 0
    _run_directory(out)  # before any data is converted into it
    # One run writes a run directory at a time (rank 0 of a torchrun job writes the records).
    with run_directory_lock(out) if torchrun is None or torchrun[0] == 0 else contextlib.nullcontext():
        if args.profile:
            _claim_profiles(out, cells)
        prepare_data(args.scenario, scenario, data_cache(args), verify=args.verify_data)
        return _run_and_print(args, scenario, cells, out)


def _profile_dir(out: Path) -> Path:
    return out / "profiles"


def _claim_profiles(out: Path, cells) -> None:
    """``--profile`` replaces an earlier profile of a cell, nothing else."""
    _profile_dir(out).mkdir(exist_ok=True)
    for cell in cells:
        claim_output(_profile_dir(out) / f"{cell.slug}.trace.json", "--profile", "embbench run --profile",
                     lambda path: head_has(path, b'"traceEvents"'))


def _run_and_print(args: argparse.Namespace, scenario, cells, out: Path) -> int:
    console.print(Text.assemble((scenario.name, "bold"), f": {len(cells)} cells -> {out}"))
    try:  # the cells need scipy for the interval only: say so once, here, and run
        require("scipy.stats", "the confidence interval of the throughput")
    except MissingDependency as e:
        console.print(Text(f"warning: {e}. The records get none (throughput.ci95_missing); "
                           "compare, recommend and report need scipy too.", style="yellow"))
    shown = RunProgress(console, len(cells), live=console.is_terminal and not args.quiet, lines=not args.quiet)
    try:
        with shown:
            records = _run_with_progress(args, scenario, cells, out, shown)
    except KeyboardInterrupt:
        again = run_command(args.scenario, out, strategies=args.strategies, data_cache=args.data_cache, resume=True,
                            force=args.force, profile=args.profile, **_shape_flags(args))
        print(f"interrupted: the finished cells' records are kept in {out}; this runs the others: {again}", file=sys.stderr)
        return 130
    except RecordsNotWritten as e:
        print_comparison(e.records, console, title=scenario.name, view=view_of(args))
        print(f"error: {e}", file=sys.stderr)
        return EXIT_CELLS_FAILED
    if not records:
        return 0  # a torchrun rank other than 0: rank 0 prints
    print_comparison(records, console, title=scenario.name, view=view_of(args))
    if args.profile:
        for table in profile_tables(records):
            console.print(table)
    console.print(Text(shown.summary()))
    console.print(Text(f"records: {out}"))
    _say_what_fits(args, scenario, [r.cell_id for r in records if r.status == "skipped"])
    failed = [r for r in records if r.status in FAILED_STATUSES]
    if failed:  # a CI job running a scenario fails with its cells
        print(f"error: {len(failed)} of {len(records)} cell(s) failed ("
              + ", ".join(f"{r.cell_id}: {r.status}" for r in failed) + f") (exit {EXIT_CELLS_FAILED})", file=sys.stderr)
        return EXIT_CELLS_FAILED
    if all(r.status in ("unsupported", "skipped") for r in records):
        print(f"error: no cell of {args.scenario} can start on this machine (exit {EXIT_NOTHING_RAN})", file=sys.stderr)
        return EXIT_NOTHING_RAN
    return 0


def _run_with_progress(args: argparse.Namespace, scenario, cells, out: Path, shown: RunProgress) -> list:
    """Run the cells, ``shown`` following them: phase, step k of n, ETA; a line per finished cell."""

    def on_notice(message):
        console.print(Text.assemble("  ", ("note", "yellow"), f": {message}"))

    if torchrun_ranks():
        return run_cells_in_job(scenario, str(args.scenario), cells, out, resume=args.resume,
                                on_start=shown.on_start, on_done=shown.on_done)
    return run_cells(scenario, str(args.scenario), cells, out, resume=args.resume, on_start=shown.on_start,
                     on_done=shown.on_done, on_progress=shown.on_progress, on_notice=on_notice, force=args.force,
                     profile_dir=_profile_dir(out) if args.profile else None)


def register(sub) -> None:
    run = sub.add_parser("run", help="run every cell of a scenario and print the comparison")
    run.add_argument("scenario", help="scenario YAML file")
    run.add_argument("--steps", type=positive_flag(int), help="measured steps per repeat (overrides run.steps)")
    run.add_argument("--scale", type=positive_flag(float, at_most=1), help="multiply table cardinalities (overrides data.scale)")
    run.add_argument("--batch-size", type=positive_flag(int), help="global batch size (overrides data.batch_size)")
    run.add_argument("--embedding-dim", type=positive_flag(int),
                     help="embedding dimension (overrides data.embedding_dim; the bottom MLP's last layer follows it)")
    run.add_argument("--strategies", type=comma_names, help="comma-separated subset of the scenario's strategies")
    run.add_argument("--out", help="run directory (default: results/runs/<scenario's name>-<hash>)")
    run.add_argument("--resume", action="store_true", help="skip cells already recorded in the run directory")
    run.add_argument("--dry-run", action="store_true", help="print the matrix with memory and time estimates; run nothing")
    run.add_argument("--force", action="store_true", help="run cells the memory preflight says cannot fit")
    run.add_argument("--data-cache", help="folder of parsed data files, shared across runs (default: results/data-cache)")
    run.add_argument("--verify-data", action="store_true",
                     help="hash the data cache entries even when they are 1 GiB or more (smaller ones always are)")
    run.add_argument("--quiet", action="store_true", help="no live progress and no line per cell; the table and a summary only")
    run.add_argument("--profile", action="store_true",
                     help="a torch.profiler Chrome trace per cell (untimed extra steps) in <run dir>/profiles/, "
                          "top operators in the record")
    add_view_flags(run, SHOW_COLUMNS)
    run.set_defaults(func=main)
