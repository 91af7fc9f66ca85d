"""The one place that turns a scenario's ``data`` section into tables and a batch source.

``synthetic`` generates batches on the device; ``criteo_tsv`` reads Criteo files through
the cache (:mod:`embbench.data.criteo`); ``trace`` replays a recorded id stream
(:mod:`embbench.data.trace`). Every source answers ``batch(stream, index, batch_size)``.
"""

from __future__ import annotations

import os
from functools import lru_cache
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from embbench.data.criteo import NUM_TABLES, CriteoDataset, CriteoSource, Progress, input_files, prepare_dataset
from embbench.data.presets import TableSpec, make_tables, scaled_rows
from embbench.data.synthetic import CoAccess, Stream, SyntheticCriteo
from embbench.data.trace import Trace, TraceSource

if TYPE_CHECKING:
    from embbench.scenario import DataConfig, RunConfig

__all__ = ["CACHE_ENV", "DataSizeError", "batches_needed", "check_rows", "criteo_dataset", "data_cache_dir",
           "eval_batches", "load_trace", "open_source", "source_tables"]

#: The environment variable that carries ``--data-cache`` to the cells' processes.
CACHE_ENV = "EMBBENCH_DATA_CACHE"


class DataSizeError(ValueError):
    """A data file with fewer rows than the run reads."""


def data_cache_dir() -> Path:
    """Where parsed files live: ``$EMBBENCH_DATA_CACHE`` (``embbench run`` sets it to its
    ``--data-cache``), else ``results/data-cache``: one folder for every run, its entries
    keyed by the data alone."""
    return Path(os.environ.get(CACHE_ENV) or Path("results") / "data-cache")


def hash_sizes(data: "DataConfig") -> list[int] | None:
    if data.hash_size is None:
        return None
    return data.hash_size if isinstance(data.hash_size, list) else [data.hash_size] * NUM_TABLES


@lru_cache(maxsize=4)
def _dataset(data_json: str, cache_dir: Path, config: type["DataConfig"]) -> CriteoDataset:
    # Keyed by the section's JSON (a pydantic model is not hashable); its class comes along so
    # that this module needs no import of the scenario, which imports it.
    return _prepare(config.model_validate_json(data_json), cache_dir, None, verify=False)


def _files(path: str, fmt) -> list[Path]:
    """``input_files``; a single file that is gone is still named, for its cache entry may serve."""
    try:
        return input_files(path, fmt)
    except FileNotFoundError:
        if any(c in path for c in "*?[") or path.endswith(os.sep):
            raise
        return [Path(path)]


def _prepare(data: "DataConfig", cache_dir: Path, on_progress: Progress | None, verify: bool) -> CriteoDataset:
    eval_spec: Any = _files(data.eval, data.format) if isinstance(data.eval, str) else data.eval
    return prepare_dataset(_files(data.path, data.format), cache_dir, eval_spec, hash_sizes(data),
                           data.min_count, on_progress, verify)


def criteo_dataset(data: "DataConfig", cache_dir: Path | None = None, on_progress: Progress | None = None,
                   verify: bool = False) -> CriteoDataset:
    """The prepared dataset of a ``criteo_tsv`` scenario (converted on first use, then cached).

    Every open checks the cache entries (:func:`embbench.data.criteo.prepare_dataset`);
    ``verify`` hashes them whatever their size.
    """
    cache_dir = (cache_dir or data_cache_dir()).resolve()
    if on_progress is not None or verify:
        _prepare(data, cache_dir, on_progress, verify)  # progress shown or hashes checked; the lookup below is then cheap
    return _dataset(data.model_dump_json(), cache_dir, type(data))


@lru_cache(maxsize=4)
def load_trace(path: str) -> Trace:
    return Trace(path)


def source_tables(data: "DataConfig") -> list[TableSpec]:
    """The tables of a scenario's data: a preset's or those it names, or those the files or the trace hold."""
    dim = data.embedding_dim
    if data.source == "synthetic" and data.tables is not None:  # named tables (data.alpha is then one value)
        return [TableSpec(f"t{i}", scaled_rows(t.rows, data.scale, data.min_rows_per_table), dim, t.bag_size,
                          data.alpha if t.alpha is None else t.alpha) for i, t in enumerate(data.tables)]
    if data.source == "synthetic":
        return make_tables(data.preset, dim, data.scale, data.alpha, data.min_rows_per_table)
    if data.source == "criteo_tsv":
        ds = criteo_dataset(data)
        return [TableSpec(f"t{i}", n, dim, 1, a) for i, (n, a) in enumerate(zip(ds.cardinalities, ds.alphas))]
    from embbench.data.stats import fit_zipf_alpha

    trace = load_trace(data.path)
    return [TableSpec(f"t{i}", int(n), dim, bag, fit_zipf_alpha(trace.counts(i)))
            for i, (n, bag) in enumerate(zip(trace.num_rows, trace.bag_sizes()))]


def eval_batches(data: "DataConfig", run: "RunConfig") -> int:
    """The evaluation batches a run reads: ``run.eval_batches``, at most as many whole batches
    as the held-out rows hold, so that each is scored once (``data.epochs`` repeats the
    training rows only; the last rows, fewer than a batch, are not scored)."""
    if data.source == "synthetic":
        return run.eval_batches
    return min(run.eval_batches, stream_rows(data)[Stream.EVAL] // data.batch_size)


def batches_needed(data: "DataConfig", run: "RunConfig") -> tuple[int, int]:
    """Training and evaluation batches a run reads (at most: with a profile, and the longest warm-up)."""
    return run.training_batches_read(), eval_batches(data, run)


def check_rows(data: "DataConfig", run: "RunConfig", rows: dict[Stream, int],
               batches: tuple[int, int] | None = None) -> None:
    """Raise :class:`DataSizeError` if a stream that is read has fewer rows than one batch, or
    the training stream fewer than what is read (``data.epochs`` times its rows may be read; the
    held-out rows are read once, as many whole batches as they hold: :func:`eval_batches`).
    ``batches``: the training and evaluation batches another reader takes instead (``curve``,
    ``trace record``)."""
    train, evaluation = batches or (run.training_batches_read(), run.eval_batches)
    reader = "the run" if batches is None else "this command"
    for stream, count in ((Stream.TRAIN, train), (Stream.EVAL, evaluation)):
        if count and rows[stream] < data.batch_size:
            raise DataSizeError(f"data.path {data.path}: the {stream.name.lower()} stream has {rows[stream]:,} rows, "
                                f"fewer than one batch (data.batch_size {data.batch_size})")
    have, need = rows[Stream.TRAIN], train * data.batch_size
    if train and have * data.epochs < need:
        epochs = -(-need // have)
        what = (f"{train} batches of {data.batch_size}" if batches is not None else
                f"warm-up, {run.steps} steps x {run.repeats} repeats, {run.counted_steps} counted steps, a few untimed "
                f"steps and one prefetched batch: "
                f"{train} batches of {data.batch_size}")
        raise DataSizeError(f"data.path {data.path}: the train stream has {have:,} rows; {reader} needs {need:,} "
                            f"({what}). Set data.epochs: {epochs} to read it {epochs} times, or ask for fewer steps")


def stream_rows(data: "DataConfig") -> dict[Stream, int]:
    if data.source == "criteo_tsv":
        ds = criteo_dataset(data)
        return {s: ds.rows(s) for s in Stream}
    trace = load_trace(data.path)
    return {s: trace.samples(s) for s in Stream}


def open_source(data: "DataConfig", run: "RunConfig", device: torch.device | str,
                batches: tuple[int, int] | None = None):
    """The batch source of a scenario, after checking that its data holds what the run reads
    (or ``batches``: the training and evaluation batches another reader takes)."""
    tables = source_tables(data)
    if data.source == "synthetic":
        drift = {} if data.drift is None else {"drift_every": data.drift.every, "drift_fraction": data.drift.fraction}
        coaccess = None if data.coaccess is None else CoAccess(**data.coaccess.model_dump())
        return SyntheticCriteo(tables, run.seed, device, **drift, coaccess=coaccess)
    check_rows(data, run, stream_rows(data), batches)
    if data.source == "criteo_tsv":
        return CriteoSource(criteo_dataset(data), device)
    return TraceSource(load_trace(data.path), run.seed, device)
