"""``embbench data check | prepare | import-tbe``, and the data preparation every command that
reads a scenario's data starts with (:func:`prepare_data`)."""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from pathlib import Path

from rich.progress import BarColumn, Progress, TextColumn
from rich.table import Table
from rich.text import Text

from embbench.bounds import positive_flag
from embbench.cli.shared import console
from embbench.commands import run_command
from embbench.scenario import load_scenario


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


def data_cache(args: argparse.Namespace) -> Path:
    """``--data-cache``, else one folder shared by every run: its entries are keyed by the data alone."""
    return Path(args.data_cache) if args.data_cache else Path("results") / "data-cache"


def prepare_data(path: str, scenario, cache_dir: Path, verify: bool = False,
                  batches: tuple[int, int] | None = None) -> None:
    """Point the cells at the data cache and, for files, convert and check them before any
    cell starts (a malformed or too short file, or a damaged cache entry that cannot be
    rebuilt, stops the run here, with nothing run). ``verify`` hashes every entry;
    ``batches``: the training and evaluation batches a command other than ``run`` reads."""
    from embbench.data.cache import DataCacheError
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


def check(args: argparse.Namespace) -> int:
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


def prepare(args: argparse.Namespace) -> int:
    scenario, _ = load_scenario(args.scenario, scale=args.scale)
    cache = data_cache(args)
    if scenario.data.source == "synthetic":
        console.print(Text(f"{args.scenario}: synthetic data is generated as it runs; nothing to prepare"))
        return 0
    start = time.perf_counter()
    prepare_data(args.scenario, scenario, cache, verify=True)  # every entry hashed, whatever its size
    tables = scenario.tables()
    console.print(Text(f"{args.scenario}: ready in {time.perf_counter() - start:,.1f} s, cache {cache}\n"
                       f"  {len(tables)} tables, {sum(t.num_rows for t in tables):,} rows: {[t.num_rows for t in tables]}\n"
                       f"  run it with: {run_command(args.scenario, data_cache=args.data_cache)}"),
                  soft_wrap=True)  # a command is not wrapped: it is pasted as one line
    return 0


def import_tbe(args: argparse.Namespace) -> int:
    import yaml

    from embbench.data.tbe_config import NOT_REPRODUCED, read_tbe_report, synthetic_data

    data = synthetic_data(read_tbe_report(args.report))
    print(f"# from {args.report}; {NOT_REPRODUCED}\n" + yaml.safe_dump({"data": data}, sort_keys=False), end="")
    return 0


def register(sub) -> None:
    data = sub.add_parser("data", help="check Criteo files or traces; prepare a scenario's data cache")
    data_sub = data.add_subparsers(dest="data_command", required=True)
    check_cmd = data_sub.add_parser("check", help="validate Criteo TSV files or a trace; print rows, cardinalities, skew")
    check_cmd.add_argument("path", help="a file, a glob, or a directory of day_N files (plain or .gz); or a trace .npz")
    check_cmd.add_argument("--format", choices=["kaggle", "terabyte"], default="kaggle", help="how a directory is read")
    check_cmd.add_argument("--hash-size", type=positive_flag(int), help="count ids modulo this, as data.hash_size does")
    check_cmd.add_argument("--data-cache", help="keep the parsed files in this folder (default: a temporary one)")
    check_cmd.set_defaults(func=check)
    prepare_cmd = data_sub.add_parser("prepare", help="build a scenario's data cache ahead of `embbench run`")
    prepare_cmd.add_argument("scenario", help="scenario YAML file")
    prepare_cmd.add_argument("--data-cache", help="the folder `run --data-cache` will read (default: results/data-cache); "
                          "existing entries are hashed and rebuilt if damaged")
    prepare_cmd.add_argument("--scale", type=positive_flag(float, at_most=1), help="as `run --scale` (synthetic data only)")
    prepare_cmd.set_defaults(func=prepare)
    tbe = data_sub.add_parser("import-tbe", help="the data: section (synthetic) for an fbgemm TBE input report "
                                                   "(the JSON FBGEMM_REPORT_INPUT_PARAMS_INTERVAL writes)")
    tbe.add_argument("report", help="a tbe-<op>-config-estimation-<iteration>.json file")
    tbe.set_defaults(func=import_tbe)
