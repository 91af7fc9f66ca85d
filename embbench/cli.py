"""``embbench run | strategies | show | compare | report | recommend | project | data check | data prepare |
trace record``."""

from __future__ import annotations

import argparse
import contextlib
import csv
import dataclasses
import json
import os
import re
import signal
import sys
import tempfile
import time
import typing
from pathlib import Path

import torch
from rich.console import Console
from rich.progress import BarColumn, Progress, TextColumn
from rich.table import Table
from rich.text import Text

from embbench.bounds import CURVE_MAX_BATCHES, positive_flag
from embbench.commands import command, run_command
from embbench.device import resolve_device
from embbench.launch import RecordsNotWritten, memory_estimate, other_scenario, outcome_without_launch, run_cells
from embbench.optional import MissingDependency, require
from embbench.outputs import atomic_write, claim_output, head_has
from embbench.progress import RunProgress
from embbench.report import DELTA_COLUMNS, RESULT_COLUMNS, print_comparison, profile_tables
from embbench.results import RUN_CURVE, RecordError, by_scenario, load_records, run_directory_lock, scenario_differences
from embbench.scenario import ScenarioError, load_scenario
from embbench.strategy import RuntimeEnv, Unsupported, broken_strategies, load_strategies
from embbench.table_view import View, column_names
from embbench.torchrun_job import run_cells_in_job, torchrun_ranks


class _Console(Console):
    def on_broken_pipe(self) -> None:
        raise BrokenPipeError  # rich would exit 1 silently: main() says it once, as for plain prints


# Tables fit the terminal's width (COLUMNS where set; see embbench/table_view.py). Logs and CI
# are not terminals: there, without COLUMNS, tables get room for most of their columns.
# User text (names, paths, messages) reaches it as rich.text.Text, never inside a markup string
# (escape() is not enough there: a name ending in a backslash escapes what follows); emoji
# codes such as :x: in plain strings are left alone.
console = _Console(width=None if (sys.stdout is not None and sys.stdout.isatty()) or os.environ.get("COLUMNS") else 240,
                   emoji=False)


#: ``run``'s exit code when no cell of the scenario could start here (each unsupported or skipped).
EXIT_NOTHING_RAN = 4


def _targets_a_gpu(scenario) -> bool:
    """Whether a scenario is written for GPUs: its run.device names CUDA, or its name says GPU."""
    return scenario.run.device == "cuda" or "gpu" in scenario.name.lower()


def _gib(n: int | None) -> str:
    return "?" if n is None else f"{n / 2**30:,.3f}"


def _dry_run(scenario, cells) -> list[str]:
    """The matrix as ``run`` would meet it on this machine (each cell runs, or what ``run`` would
    record without starting it: unsupported, skipped, error, with the reason), the per-rank
    memory estimates here and, for a scenario written for GPUs on a machine without one, on
    its target device too. Returns the ids of the cells that would be skipped."""
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
    grid = Table(title=Text(f"{scenario.name}: {len(cells)} cells (nothing is run)", style="table.title"),
                 header_style="bold", caption=caption)
    for col in ["cell", "device GiB / rank", "host GiB / rank"] + (["on a GPU: device / host GiB"] if on_gpu_too else []) \
            + ["run here"]:
        grid.add_column(col, justify="left" if col in ("cell", "run here") else "right")
    skipped = []
    for cell in cells:
        try:
            estimate = memory_estimate(scenario, cell)
        except Exception:
            estimate = None  # a broken plugin: outcome_without_launch names it
        outcome = outcome_without_launch(scenario, cell)
        if estimate is None:
            device = host = None
        elif here is not None and here.type == "cpu":  # the "device" is the host
            device, host = 0, estimate.device_bytes + estimate.host_bytes + estimate.pinned_bytes
        else:
            device, host = estimate.device_bytes, estimate.host_bytes + estimate.pinned_bytes
        gpu = [f"{_gib(estimate.device_bytes)} / {_gib(estimate.host_bytes + estimate.pinned_bytes)}"
               if estimate else "? / ?"] if on_gpu_too else []
        if outcome is None:
            verdict = Text("yes" if estimate else "yes (no estimate)", style="green")
        else:
            status = "error (a broken plugin)" if outcome.status == "error" else outcome.status  # its only cause here
            verdict = Text.assemble((status, "red" if outcome.status == "error" else "yellow"), f": {outcome.message}")
            if outcome.status == "skipped":
                skipped.append(cell.id)
        grid.add_row(Text(cell.id), _gib(device), _gib(host), *gpu, verdict)
    console.print(grid)
    return skipped


def _scale_that_fits(args: argparse.Namespace, scenario, skipped: list[str]) -> str | None:
    """The ``run`` command at the largest scale (5, 2 or 1 times a power of ten, below the
    scenario's) at which every cell in ``skipped`` passes the memory preflight on this machine
    now, or None when none does down to 1e-9."""
    current = scenario.data.scale
    for exponent in range(0, 10):
        for mantissa in (5, 2, 1):
            scale = float(f"{mantissa}e-{exponent}")
            if scale >= current:
                continue
            flags = {**_shape_flags(args), "scale": scale}
            smaller, cells = load_scenario(args.scenario, strategies=args.strategies, **flags)
            if all(outcome_without_launch(smaller, c) is None for c in cells if c.id in skipped):
                return run_command(args.scenario, strategies=args.strategies, data_cache=args.data_cache, **flags)
    return None


def _say_what_fits(args: argparse.Namespace, scenario, skipped: list[str]) -> None:
    if not skipped:
        return
    command = _scale_that_fits(args, scenario, skipped)
    console.print(Text(f"{len(skipped)} cell(s) would not fit this machine's memory now: " +
                       (f"at a scale that fits them all, run\n  {command}" if command else
                        "no scale down to 1e-9 fits them"), style="yellow"), soft_wrap=True)


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


def _default_run_dir(scenario) -> Path:
    """``results/runs/<scenario's name>-<hash of the effective scenario>`` (the name's characters
    other than letters, digits, ``.`` and ``-`` as ``_``)."""
    name = re.sub(r"[^\w.-]+", "_", scenario.name, flags=re.ASCII).strip("._") or "scenario"
    return Path("results") / "runs" / f"{name}-{scenario.digest()[:10]}"


def _shape_flags(args: argparse.Namespace) -> dict:
    """``run``'s flags that change the scenario, as :func:`load_scenario` and :func:`run_command` take them."""
    return {"steps": args.steps, "scale": args.scale, "batch_size": args.batch_size, "embedding_dim": args.embedding_dim}


def cmd_run(args: argparse.Namespace) -> int:
    torchrun = torchrun_ranks()  # a partial torchrun environment stops here, named
    scenario, cells = load_scenario(args.scenario, strategies=args.strategies, **_shape_flags(args))
    if args.profile and torchrun:
        raise ValueError("--profile: not available under torchrun (run on one host without torchrun to profile)")
    out = Path(args.out) if args.out else _default_run_dir(scenario)
    mixed = other_scenario(out, scenario, str(args.scenario))
    if mixed:  # its tables would put cells of two scenarios side by side
        raise ValueError(mixed)
    if args.dry_run:
        _prepare_data(args.scenario, scenario, _data_cache(args), verify=args.verify_data)
        _say_what_fits(args, scenario, _dry_run(scenario, cells))
        return 0
    _run_directory(out)  # before any data is converted into it
    # One run writes a run directory at a time (rank 0 of a torchrun job writes the records).
    with run_directory_lock(out) if torchrun is None or torchrun[0] == 0 else contextlib.nullcontext():
        if args.profile:
            _claim_profiles(out, cells)
        _prepare_data(args.scenario, scenario, _data_cache(args), verify=args.verify_data)
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
        print_comparison(e.records, console, title=scenario.name, view=_view(args))
        print(f"error: {e}", file=sys.stderr)
        return 1
    if not records:
        return 0  # a torchrun rank other than 0: rank 0 prints
    print_comparison(records, console, title=scenario.name, view=_view(args))
    if args.profile:
        for table in profile_tables(records):
            console.print(table)
    console.print(Text(shown.summary()))
    console.print(Text(f"records: {out}"))
    _say_what_fits(args, scenario, [r.cell_id for r in records if r.status == "skipped"])
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


def _conversion_progress() -> Progress:
    from rich.progress import DownloadColumn, TimeRemainingColumn, TransferSpeedColumn

    return Progress(TextColumn("converting {task.description}", markup=False), BarColumn(), DownloadColumn(),
                    TransferSpeedColumn(),
                    TextColumn("{task.fields[rows]:,} rows, {task.fields[rate]:,.0f} rows/s"), TimeRemainingColumn(),
                    console=console, transient=True)


def _progress_callback(progress: Progress):
    """An ``on_progress`` for the Criteo converter: one bar per file, bytes read and rows/s."""
    tasks: dict[str, tuple] = {}

    def on_progress(name: str, done: int, total: int, rows: int) -> None:
        if name not in tasks:
            tasks[name] = (progress.add_task(name, total=total, rows=0, rate=0.0), time.perf_counter())
        task, start = tasks[name]
        progress.update(task, completed=done, rows=rows, rate=rows / max(time.perf_counter() - start, 1e-9))

    return on_progress


def _data_cache(args: argparse.Namespace) -> Path:
    """``--data-cache``, else one folder shared by every run: its entries are keyed by the data alone."""
    return Path(args.data_cache) if args.data_cache else Path("results") / "data-cache"


def _prepare_data(path: str, scenario, cache_dir: Path, verify: bool = False,
                  batches: tuple[int, int] | None = None) -> None:
    """Point the cells at the data cache and, for files, convert and check them before any
    cell starts (a malformed or too short file, or a damaged cache entry that cannot be
    rebuilt, stops the run here, with nothing run). ``verify`` hashes every entry;
    ``batches``: the training and evaluation batches a command other than ``run`` reads."""
    from embbench.data.criteo import DataCacheError
    from embbench.data.sources import CACHE_ENV, check_rows, criteo_dataset, stream_rows

    os.environ[CACHE_ENV] = str(cache_dir.resolve())
    if scenario.data.source == "synthetic":
        return
    if scenario.data.source == "criteo_tsv":
        try:
            with _conversion_progress() as progress:
                criteo_dataset(scenario.data, cache_dir, _progress_callback(progress), verify=verify)
        except DataCacheError as e:
            e.scenario = path  # the rebuild command names this scenario file
            raise
    check_rows(scenario.data, scenario.run, stream_rows(scenario.data), batches)


def _stats_table(title: str, stats: list, caption: str) -> Table:
    console.print(Text(title), soft_wrap=True)  # a path: one line, never wrapped into a table's width
    grid = Table(header_style="bold", caption=Text(caption, style="table.caption"))
    for col in ["table", "accesses", "distinct ids", "empty", "seen once", "top 1% ids' share", "Zipf alpha"]:
        grid.add_column(col, justify="right")
    for i, st in enumerate(stats):
        empty = f"{st.empty / (st.accesses + st.empty):.1%}" if st.accesses + st.empty else "-"
        grid.add_row(f"t{i}", f"{st.accesses:,}", f"{st.distinct:,}", empty, f"{st.singletons:,}",
                     f"{st.top1_share:.1%}", f"{st.alpha:.2f}")
    return grid


def cmd_data_check(args: argparse.Namespace) -> int:
    import numpy as np

    from embbench.data.criteo import NUM_TABLES, convert_file, id_counts, input_files
    from embbench.data.stats import table_stats
    from embbench.data.synthetic import Stream

    if str(args.path).endswith(".npz"):
        from embbench.data.trace import Trace

        trace = Trace(args.path)
        samples = {s: trace.samples(s) for s in Stream}
        stats = [table_stats(trace.counts(t)) for t in range(len(trace.num_rows))]
        features = "recorded" if trace.has_features(Stream.TRAIN) else "absent (a replay synthesises them)"
        console.print(_stats_table(
            f"{args.path}: a valid trace", stats,
            f"{samples[Stream.TRAIN]:,} training and {samples[Stream.EVAL]:,} evaluation samples; {len(stats)} tables "
            f"of {', '.join(f'{n:,}' for n in trace.num_rows)} rows; bag sizes {trace.bag_sizes()}; labels and dense "
            f"features {features}. Statistics of the training stream."))
        return 0
    hash_sizes = [args.hash_size] * NUM_TABLES if args.hash_size else None
    with tempfile.TemporaryDirectory(prefix="embbench-check-") as tmp:
        cache = Path(args.data_cache) if args.data_cache else Path(tmp)
        with _conversion_progress() as progress:
            parsed = [convert_file(f, cache, hash_sizes, _progress_callback(progress), verify=True)
                      for f in input_files(args.path, args.format)]
        rows = sum(f.rows for f in parsed)
        positives = sum(int(np.asarray(f.array("labels"), dtype=np.int64).sum()) for f in parsed)
        counts = id_counts([(f, 0, f.rows) for f in parsed])
        stats = [table_stats(c, empty=rows - int(c.sum())) for _, c in counts]
    console.print(_stats_table(
        f"{args.path}: {len(parsed)} valid file(s), {rows:,} rows", stats,
        f"labels: {positives / rows:.2%} positive; ids {'modulo ' + str(args.hash_size) if args.hash_size else 'as written'}; "
        "Zipf alpha: least-squares slope of log count against log rank, ids seen twice or more"))
    return 0


def cmd_data_prepare(args: argparse.Namespace) -> int:
    scenario, _ = load_scenario(args.scenario, scale=args.scale)
    cache = _data_cache(args)
    if scenario.data.source == "synthetic":
        console.print(Text(f"{args.scenario}: synthetic data is generated as it runs; nothing to prepare"))
        return 0
    start = time.perf_counter()
    _prepare_data(args.scenario, scenario, cache, verify=True)  # every entry hashed, whatever its size
    tables = scenario.tables()
    console.print(Text(f"{args.scenario}: ready in {time.perf_counter() - start:,.1f} s, cache {cache}\n"
                       f"  {len(tables)} tables, {sum(t.num_rows for t in tables):,} rows: {[t.num_rows for t in tables]}\n"
                       f"  run it with: {run_command(args.scenario, data_cache=args.data_cache)}"),
                  soft_wrap=True)  # a command is not wrapped: it is pasted as one line
    return 0


def cmd_trace_record(args: argparse.Namespace) -> int:
    from embbench.data.sources import batches_needed
    from embbench.data.trace import is_trace, record_trace

    claim_output(Path(args.out), "--out", "embbench trace record", is_trace, args.overwrite)
    scenario, _ = load_scenario(args.scenario, scale=args.scale)
    train = args.train_batches or scenario.run.training_batches_read()
    evaluation = args.eval_batches if args.eval_batches is not None else scenario.run.eval_batches
    _prepare_data(args.scenario, scenario, _data_cache(args), batches=(train, evaluation))  # what it records, not a run's
    if args.eval_batches is None:  # as a run evaluates: each held-out row once, whole batches
        evaluation = batches_needed(scenario.data, scenario.run)[1]
    tables = scenario.tables()
    source = scenario.data_source(torch.device("cpu"), (train, evaluation))
    written = record_trace(source, [t.num_rows for t in tables], scenario.data.batch_size, train, evaluation,
                           Path(args.out), features=args.features)
    console.print(Text(f"{args.out}: {written['train']:,} training and {written['eval']:,} evaluation samples of "
                       f"{len(tables)} tables ({'with' if args.features else 'without'} labels and dense features)"))
    return 0


def cmd_data_import_tbe(args: argparse.Namespace) -> int:
    import yaml

    from embbench.data.tbe_config import NOT_REPRODUCED, read_tbe_report, synthetic_data

    data = synthetic_data(read_tbe_report(args.report))
    print(f"# from {args.report}; {NOT_REPRODUCED}\n" + yaml.safe_dump({"data": data}, sort_keys=False), end="")
    return 0


def cmd_trace_import_dlrm(args: argparse.Namespace) -> int:
    from embbench.data.dlrm_datasets import dlrm_to_trace
    from embbench.data.trace import is_trace

    claim_output(Path(args.out), "--out", "embbench trace", is_trace, args.overwrite)
    info = dlrm_to_trace(args.files, args.out)
    console.print(Text(f"{args.out}: {info['batches']} batches, {info['samples']:,} training samples of {info['tables']} "
                       f"tables (no evaluation stream). Note: {info['note']}"))
    return 0


def cmd_curve(args: argparse.Namespace) -> int:
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
    scenario, _ = load_scenario(args.scenario, scale=args.scale)
    _prepare_data(args.scenario, scenario, _data_cache(args), batches=(args.warmup + args.steps, 0))  # its own reads
    curve = scenario_curve(scenario, args.sizes, args.policies, args.warmup, args.steps, args.freqcache_sizes)
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

    names = _names(text)
    unknown = [n for n in names if n not in POLICIES]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown policy {', '.join(unknown)}; known: {', '.join(POLICIES)}")
    return [p for p in POLICIES if p in names]


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
        params = Text("\n").join(
            Text.assemble(f"{key}: {_type_name(f.annotation)} = {f.default!r}",
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


def _skip_damaged(error: RecordError) -> None:
    print(f"warning: {error}; skipped", file=sys.stderr)


def _csv_columns(rows: list[dict]) -> list[str]:
    """Every column any cell has: in the order of the fullest row, the parameters after the
    cell's identity and status."""
    keys = list(dict.fromkeys(k for row in sorted(rows, key=len, reverse=True) for k in row))
    params = [k for k in keys if k.startswith("param.")]
    rest = [k for k in keys if not k.startswith("param.")]
    at = rest.index("semantics") + 1
    return rest[:at] + params + rest[at:]


def _load_runs(paths: list[str], need_records: bool = True) -> list:
    """:func:`embbench.compare.load_runs`, each file it left out named on stderr."""
    from embbench.compare import load_runs

    runs = load_runs(paths, need_records)
    for run in runs:
        for error in run.damaged:
            _skip_damaged(error)
    return runs


def _scenario_title(group: list, first: list, where: str, groups: int) -> Text:
    """A table's title: where its records are from and, among several scenarios, which one
    (and what differs from the first)."""
    if groups == 1:
        return Text(where)
    info = group[0].scenario
    title = f"{where}: scenario {info['name']} {info['digest'][:10]}"
    if group is not first:
        title += f" (against {first[0].scenario['digest'][:10]}: {scenario_differences(first[0].scenario, info)})"
    return Text(title)


def cmd_show(args: argparse.Namespace) -> int:
    records = load_records([Path(p) for p in args.results], on_damaged=_skip_damaged)
    where = " ".join(args.results)
    if not records:
        raise RecordError(f"{where}: no usable records")
    groups = by_scenario(records)  # speedups are against the baseline of the same scenario only
    if args.csv or args.json:
        from embbench.columns import flat_rows

        rows = [row for group in groups for row in flat_rows(group)]
        if args.json:
            print(json.dumps(rows, indent=2))
        else:
            columns = _csv_columns(rows)
            writer = csv.DictWriter(sys.stdout, columns, lineterminator="\n")
            writer.writeheader()
            writer.writerows({k: json.dumps(v) if isinstance(v, list) else v for k, v in row.items()} for row in rows)
        return 0
    if len(groups) > 1:
        console.print(Text(f"{where}: records of {len(groups)} scenarios: one table each, no speedup across them",
                           style="yellow"))
    for group in groups:
        print_comparison(group, console, title=_scenario_title(group, groups[0], where, len(groups)), view=_view(args))
    for table in profile_tables(records):
        console.print(table)
    return 0


def cmd_recommend(args: argparse.Namespace) -> int:
    from embbench.recommend import Budget, parse_size, recommend
    from embbench.report import print_recommendations, print_torchrec_plans

    budget = Budget(parse_size(args.device_memory, "--device-memory"),
                    parse_size(args.host_memory, "--host-memory") if args.host_memory else None)
    records = _load_runs([args.run])[0].records
    curve_file = Path(args.curve) if args.curve else Path(args.run) / RUN_CURVE
    curve = None
    if args.curve or curve_file.exists():
        from embbench.cache.curve import read_curve

        curve = read_curve(curve_file)
        if not args.json:
            console.print(Text(f"cache curve: {curve_file} (a ratio to measure next stops at its knee)", style="dim"))
    recs = recommend(records, budget, args.auc_tolerance, run_dir=args.run, curve=curve)
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


def _precision_pairs(runs, threshold: float | None):
    """``--match-on strategy``: in each run, every cell whose rows are not fp32 against the same
    strategy, parameters and world size in fp32."""
    from embbench.compare import ALPHA, compare_precisions

    pairs = [(run, compare_precisions(run.records, ALPHA, threshold)) for run in runs]
    if not any(cells for _, cells in pairs):
        raise ValueError(f"--match-on strategy: no cell with rows in fp16, bf16 or fp8 in {', '.join(r.label for r in runs)} "
                         "(run.row_precision)")
    return pairs


def cmd_compare(args: argparse.Namespace) -> int:
    from embbench.compare import (ALPHA, CANNOT_JUDGE, TEST, aa_noise_floor, cannot_judge, compare_runs, parse_percent,
                                  regressions, same_code_and_scenario, to_json)
    from embbench.report import print_deltas
    from embbench.stats import spread_text

    threshold = parse_percent(args.fail_on) if args.fail_on is not None else None
    runs = _load_runs(args.runs, need_records=False)  # a candidate whose records are all damaged fails the gate
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
            print_deltas(cells, before, after, TEST, console, _view(args))
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


def cmd_report(args: argparse.Namespace) -> int:
    from embbench.html_report import check_writable, write_report

    out = Path(args.out)
    check_writable(out, args.overwrite)  # before the work, not after it
    runs = _load_runs(args.runs)
    write_report(runs, out)
    console.print(Text(f"report: {out} ({out.stat().st_size / 1024:,.0f} KiB, self-contained)"))
    return 0


def cmd_project(args: argparse.Namespace) -> int:
    from embbench.projection import ASSUMPTIONS, DEFAULT_LINKS_GBPS, project, why_not_projectable
    from embbench.scenario import parse_scenario

    links = args.links or dict(DEFAULT_LINKS_GBPS)
    records = [r for r in load_records(Path(args.results), on_damaged=_skip_damaged) if r.status == "ok"]
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
                  caption="t(W, bw) = (T0 - S0) * W0 / W + C(W) / bw + 4 * latency; T0: measured mean step and "
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


def _add_view_flags(parser, columns, group=None) -> None:
    """``--columns a,b,c`` and ``--wide``: which of a table's ``columns`` are shown (by
    default, as many as fit the terminal, the others named under the table)."""
    group = group or parser.add_mutually_exclusive_group()
    names = [c.key for c in columns]
    group.add_argument("--columns", type=column_names(names), metavar="A,B,...",
                       help=f"show these columns of the table (after the cell id): {', '.join(names)}")
    group.add_argument("--wide", action="store_true", help="show every column, however wide the table gets")


def _view(args: argparse.Namespace) -> View:
    return View(args.columns, args.wide)


def _names(text: str) -> list[str]:
    """``--strategies a,b``: one name at least, none empty."""
    names = [name.strip() for name in text.split(",")]
    if not any(names):
        raise argparse.ArgumentTypeError("empty: name at least one strategy (leave the flag out to run them all)")
    if not all(names):
        raise argparse.ArgumentTypeError(f"{text!r}: an empty name between commas")
    return names


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


def _add_data_commands(sub) -> None:
    data = sub.add_parser("data", help="check Criteo files or traces; prepare a scenario's data cache")
    data_sub = data.add_subparsers(dest="data_command", required=True)
    check = data_sub.add_parser("check", help="validate Criteo TSV files or a trace; print rows, cardinalities, skew")
    check.add_argument("path", help="a file, a glob, or a directory of day_N files (plain or .gz); or a trace .npz")
    check.add_argument("--format", choices=["kaggle", "terabyte"], default="kaggle", help="how a directory is read")
    check.add_argument("--hash-size", type=positive_flag(int), help="count ids modulo this, as data.hash_size does")
    check.add_argument("--data-cache", help="keep the parsed files in this folder (default: a temporary one)")
    check.set_defaults(func=cmd_data_check)
    prepare = data_sub.add_parser("prepare", help="build a scenario's data cache ahead of `embbench run`")
    prepare.add_argument("scenario", help="scenario YAML file")
    prepare.add_argument("--data-cache", help="the folder `run --data-cache` will read (default: results/data-cache); "
                         "existing entries are hashed and rebuilt if damaged")
    prepare.add_argument("--scale", type=positive_flag(float, at_most=1), help="as `run --scale` (synthetic data only)")
    prepare.set_defaults(func=cmd_data_prepare)
    tbe = data_sub.add_parser("import-tbe", help="the data: section (synthetic) for an fbgemm TBE input report "
                                                   "(the JSON FBGEMM_REPORT_INPUT_PARAMS_INTERVAL writes)")
    tbe.add_argument("report", help="a tbe-<op>-config-estimation-<iteration>.json file")
    tbe.set_defaults(func=cmd_data_import_tbe)
    trace = sub.add_parser("trace", help="record the id stream a scenario produces")
    trace_sub = trace.add_subparsers(dest="trace_command", required=True)
    record = trace_sub.add_parser("record", help="write a scenario's training and evaluation id streams to a .npz trace")
    record.add_argument("scenario", help="scenario YAML file")
    record.add_argument("--out", required=True, help="the trace file (.npz)")
    record.add_argument("--train-batches", type=positive_flag(int), help="training batches (default: what a run of the scenario reads)")
    record.add_argument("--eval-batches", type=positive_flag(int, zero=True), help="evaluation batches (default: run.eval_batches)")
    record.add_argument("--features", action="store_true", help="also record labels and dense features")
    record.add_argument("--overwrite", action="store_true", help="replace an existing file that is not a trace (never a record)")
    record.add_argument("--scale", type=positive_flag(float, at_most=1), help="as `run --scale` (synthetic data only)")
    record.add_argument("--data-cache", help="parsed-file cache of a criteo_tsv scenario (default: results/data-cache)")
    record.set_defaults(func=cmd_trace_record)
    dlrm = trace_sub.add_parser("import-dlrm", help="Meta's dlrm_datasets batches (.pt files of indices, offsets, lengths) "
                                                     "as a trace's training stream, in the order given")
    dlrm.add_argument("files", nargs="+", help="the .pt files, one batch each")
    dlrm.add_argument("--out", required=True, help="the trace file (.npz)")
    dlrm.add_argument("--overwrite", action="store_true", help="replace an existing file that is not a trace (never a record)")
    dlrm.set_defaults(func=cmd_trace_import_dlrm)


def _add_curve_command(sub) -> None:
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
    curve.add_argument("--data-cache", help="parsed-file cache of a criteo_tsv scenario (default: results/data-cache)")
    from embbench.cache.tiers import parse_iops, parse_tiers

    curve.add_argument("--tiers", type=parse_tiers, metavar="hbm=1.5%,dram=10%",
                       help="also model the tiers: a device cache of that share of the rows over a host cache of that share "
                            "of the pages over a drive (page reads and writes a batch; in the --out .json as `tiers`)")
    curve.add_argument("--iops", type=parse_iops, metavar="N", help="with --tiers: the drive's random 4 KiB reads a second")
    curve.add_argument("--step-ms", type=positive_flag(float), help="with --tiers: a measured step, to say whether the drive keeps up")
    curve.set_defaults(func=cmd_curve)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="embbench", description="Benchmark embedding-table placement strategies.")
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run every cell of a scenario and print the comparison")
    run.add_argument("scenario", help="scenario YAML file")
    run.add_argument("--steps", type=positive_flag(int), help="measured steps per repeat (overrides run.steps)")
    run.add_argument("--scale", type=positive_flag(float, at_most=1), help="multiply table cardinalities (overrides data.scale)")
    run.add_argument("--batch-size", type=positive_flag(int), help="global batch size (overrides data.batch_size)")
    run.add_argument("--embedding-dim", type=positive_flag(int),
                     help="embedding dimension (overrides data.embedding_dim; the bottom MLP's last layer follows it)")
    run.add_argument("--strategies", type=_names, help="comma-separated subset of the scenario's strategies")
    run.add_argument("--out", help="run directory (default: results/runs/<scenario's name>-<hash>)")
    run.add_argument("--resume", action="store_true", help="skip cells already recorded in the run directory")
    run.add_argument("--dry-run", action="store_true", help="print the matrix with memory estimates; run nothing")
    run.add_argument("--force", action="store_true", help="run cells the memory preflight says cannot fit")
    run.add_argument("--data-cache", help="folder of parsed data files, shared across runs (default: results/data-cache)")
    run.add_argument("--verify-data", action="store_true",
                     help="hash the data cache entries even when they are 1 GiB or more (smaller ones always are)")
    run.add_argument("--quiet", action="store_true", help="no live progress and no line per cell; the table and a summary only")
    run.add_argument("--profile", action="store_true",
                     help="a torch.profiler Chrome trace per cell (untimed extra steps) in <run dir>/profiles/, "
                          "top operators in the record")
    _add_view_flags(run, RESULT_COLUMNS)
    run.set_defaults(func=cmd_run)
    _add_data_commands(sub)
    strategies = sub.add_parser("strategies", help="list installed strategies, their parameters, and whether they run here")
    strategies.set_defaults(func=cmd_strategies)
    show = sub.add_parser("show", help="print the comparison table of a (partial) run")
    show.add_argument("results", nargs="+", help="run directories or record files (each cell of a scenario listed once)")
    export = show.add_mutually_exclusive_group()
    export.add_argument("--csv", action="store_true", help="one row per cell, flat columns, for spreadsheets")
    export.add_argument("--json", action="store_true", help="the same rows as a JSON list, for notebooks")
    _add_view_flags(show, RESULT_COLUMNS, export)
    show.set_defaults(func=cmd_show)
    _add_curve_command(sub)
    rec = sub.add_parser("recommend", help="the fastest measured placement that fits a memory budget, and why not the others")
    rec.add_argument("run", help="a run directory")
    rec.add_argument("--device-memory", required=True, metavar="SIZE", help="per device, e.g. 16GiB, 80GB, 512MiB")
    rec.add_argument("--host-memory", metavar="SIZE", help="per host (all ranks together)")
    rec.add_argument("--auc-tolerance", type=positive_flag(float, zero=True, at_most=1), default=0.001,
                     help="leave out cells whose AUC is below the baseline's by more than this (default 0.001)")
    rec.add_argument("--json", action="store_true", help="print the recommendation as JSON")
    rec.add_argument("--curve", help="an `embbench curve --out` JSON of the scenario (default RUN/curve.json if there): "
                                     "a suggested cache ratio stops at its knee")
    rec.add_argument("--torchrec-plan", action="store_true",
                     help="also print torchrec's planner's proposal for the run's tables at the same device memory, "
                          "with the curve's miss rates as its cache statistics (needs the curve)")
    rec.set_defaults(func=cmd_recommend)
    comp = sub.add_parser("compare", help="compare runs cell by cell: deltas and their significance (B, C, ... against A)")
    comp.add_argument("runs", nargs="+", metavar="RUN", help="run directories; the first is the baseline")
    comp.add_argument("--fail-on", metavar="PCT", help="exit 1 when a cell's throughput interval lies below -PCT (e.g. 5%%) "
                      "or a cell fails; exit 3 when a run's noise (or a busy machine) is wider than PCT: cannot judge")
    comp.add_argument("--match-on", choices=("cell", "strategy"), default="cell",
                      help="cell: each run against the first, cell by cell (default); strategy: in each run, every cell "
                           "with rows in fp16/bf16/fp8 against the same strategy, parameters and ranks in fp32")
    comp_output = comp.add_mutually_exclusive_group()
    comp_output.add_argument("--json", action="store_true", help="print the comparison as JSON")
    _add_view_flags(comp, DELTA_COLUMNS, comp_output)
    comp.set_defaults(func=cmd_compare)
    rep = sub.add_parser("report", help="one self-contained HTML file: the tables and plots of one or more runs")
    rep.add_argument("runs", nargs="+", metavar="RUN", help="run directories; with several, the first is the baseline of the comparison")
    rep.add_argument("--out", default="report.html", help="the HTML file to write (default report.html)")
    rep.add_argument("--overwrite", action="store_true", help="replace an existing file that is not a report (never a record)")
    rep.set_defaults(func=cmd_report)
    proj = sub.add_parser("project", help="model throughput at other world sizes and link bandwidths from a run")
    proj.add_argument("results", help="a run directory or one record file")
    proj.add_argument("--worlds", type=_world_sizes, default=[1, 2, 4, 8], help="world sizes to project (default 1,2,4,8)")
    proj.add_argument("--links", type=_links, help="name=GB/s,... per-rank link bandwidths (default nvlink, pcie5, net400, net100)")
    proj.add_argument("--latency-us", type=positive_flag(float, zero=True), default=0.0, help="latency per collective (4 per step), microseconds")
    proj.set_defaults(func=cmd_project)
    return parser


def _interrupt(signum, frame):
    raise KeyboardInterrupt  # SIGTERM unwinds like Ctrl-C: the cell's processes are killed, records kept


def _stdout_gone() -> int:
    """``| head`` closed the pipe: say so once; nothing more goes to the closed pipe (not even
    at exit, where Python flushes stdout)."""
    os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    print("error: standard output was closed before everything was written (broken pipe)", file=sys.stderr)
    return 141  # 128 + SIGPIPE, as a shell reports a command killed by a closed pipe


def main(argv: list[str] | None = None) -> int:
    try:
        return _main(argv)
    except KeyboardInterrupt:  # another Ctrl-C while the first unwinds (its message, the handlers' reset): said once
        return 130


def _main(argv: list[str] | None) -> int:
    args = build_parser().parse_args(argv)
    if sys.stdout is None:  # started with stdout closed (>&-): there is nowhere to print to
        print(f"error: standard output is closed; embbench {args.command} prints its results there "
              "(redirect it to a file or /dev/null instead)", file=sys.stderr)
        return 2
    previous = signal.signal(signal.SIGTERM, _interrupt)
    try:
        return args.func(args)
    except BrokenPipeError:
        return _stdout_gone()
    except (ScenarioError, RecordError, ValueError, OSError, MissingDependency) as e:  # OSError names its file
        print(f"error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
    finally:
        signal.signal(signal.SIGTERM, previous)


if __name__ == "__main__":
    sys.exit(main())
