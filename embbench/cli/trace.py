"""``embbench trace record | import-dlrm``: id streams as .npz traces."""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
from rich.text import Text

from embbench.bounds import positive_flag
from embbench.cli.data import data_cache, prepare_data
from embbench.cli.shared import console
from embbench.outputs import claim_output
from embbench.scenario import load_scenario


def record(args: argparse.Namespace) -> int:
    from embbench.data.sources import batches_needed
    from embbench.data.trace import is_trace, record_trace

    claim_output(Path(args.out), "--out", "embbench trace record", is_trace, args.overwrite)
    scenario, _ = load_scenario(args.scenario, scale=args.scale)
    train = args.train_batches or scenario.run.training_batches_read()
    evaluation = args.eval_batches if args.eval_batches is not None else scenario.run.eval_batches
    prepare_data(args.scenario, scenario, data_cache(args), batches=(train, evaluation))  # what it records, not a run's
    if args.eval_batches is None:  # as a run evaluates: each held-out row once, whole batches
        evaluation = batches_needed(scenario.data, scenario.run)[1]
    tables = scenario.tables()
    source = scenario.data_source(torch.device("cpu"), (train, evaluation))
    written = record_trace(source, [t.num_rows for t in tables], scenario.data.batch_size, train, evaluation,
                           Path(args.out), features=args.features)
    console.print(Text(f"{args.out}: {written['train']:,} training and {written['eval']:,} evaluation samples of "
                       f"{len(tables)} tables ({'with' if args.features else 'without'} labels and dense features)"))
    return 0


def import_dlrm(args: argparse.Namespace) -> int:
    from embbench.data.dlrm_datasets import dlrm_to_trace
    from embbench.data.trace import is_trace

    claim_output(Path(args.out), "--out", "embbench trace", is_trace, args.overwrite)
    info = dlrm_to_trace(args.files, args.out)
    console.print(Text(f"{args.out}: {info['batches']} batches, {info['samples']:,} training samples of {info['tables']} "
                       f"tables (no evaluation stream). Note: {info['note']}"))
    return 0


def register(sub) -> None:
    trace = sub.add_parser("trace", help="record the id stream a scenario produces")
    trace_sub = trace.add_subparsers(dest="trace_command", required=True)
    record_cmd = trace_sub.add_parser("record", help="write a scenario's training and evaluation id streams to a .npz trace")
    record_cmd.add_argument("scenario", help="scenario YAML file")
    record_cmd.add_argument("--out", required=True, help="the trace file (.npz)")
    record_cmd.add_argument("--train-batches", type=positive_flag(int), help="training batches (default: what a run of the scenario reads)")
    record_cmd.add_argument("--eval-batches", type=positive_flag(int, zero=True), help="evaluation batches (default: run.eval_batches)")
    record_cmd.add_argument("--features", action="store_true", help="also record labels and dense features")
    record_cmd.add_argument("--overwrite", action="store_true", help="replace an existing file that is not a trace (never a record)")
    record_cmd.add_argument("--scale", type=positive_flag(float, at_most=1), help="as `run --scale` (synthetic data only)")
    record_cmd.add_argument("--data-cache", help="parsed-file cache of a criteo_tsv scenario (default: results/data-cache)")
    record_cmd.set_defaults(func=record)
    dlrm = trace_sub.add_parser("import-dlrm", help="Meta's dlrm_datasets batches (.pt files of indices, offsets, lengths) "
                                                     "as a trace's training stream, in the order given")
    dlrm.add_argument("files", nargs="+", help="the .pt files, one batch each")
    dlrm.add_argument("--out", required=True, help="the trace file (.npz)")
    dlrm.add_argument("--overwrite", action="store_true", help="replace an existing file that is not a trace (never a record)")
    dlrm.set_defaults(func=import_dlrm)
