"""The public interface for writing a placement strategy: everything a plugin imports.

A strategy package imports from here only (``from embbench.plugin import ...``); the
built-in strategies in ``baselines/`` do the same (a test holds them to it), so what they
can do a third party's package can do. The names below keep their meaning across releases;
the modules they come from are embbench's inside and may move.

The interface (:mod:`embbench.strategy`):

- :class:`Strategy`: a placement: its name, parameters, where it runs, how it is built.
- :class:`StrategyParams`: base class of a strategy's parameters (pydantic: typed, defaulted,
  validated, no unknown keys).
- :class:`SparseModule`: what ``Strategy.build`` returns: features in, pooled embeddings out,
  trained inside backward; ``memory()``, ``flush()`` and the optional hooks.
- :class:`BuildContext`: the tables, device, optimizer, initial weights and training stream
  a module is built from.
- :class:`RuntimeEnv`: the device, rank and world size (``unsupported_reason``'s argument).
- :class:`MemoryFootprint`: the static bytes a module holds (device, host, pinned, managed).
- :class:`Unsupported`: raised when the strategy cannot run here; the message says why.
- :class:`ScheduleContext`, :class:`Schedule`: for a strategy that proposes the training order.
- ``COUNTERS``: the counter names ``SparseModule.counters()`` may report, each explained.

The data a module sees:

- :class:`SparseFeatures`: one batch's ids per table (a torchrec KeyedJaggedTensor's layout).
- :class:`Batch`: what ``BuildContext.train_batches(n)`` yields (``.sparse`` is the features).
- :class:`TableSpec`: one table's name, rows, dim and ids per sample.
- :class:`EmbeddingOptimizer`: the scenario's embedding optimizer and its exact update.

Building blocks for a strategy that holds rows itself (:mod:`embbench.embedding`):

- :class:`RowSpace`: all tables as one range of global rows.
- :class:`RowStore`: rows and their optimizer state on one device; ``WORK_INSTRUMENT`` names its
  work counting for ``SparseModule.instruments`` (switched by ``RowStore.counting``).
- :func:`whole_store`: every row of a space, initialised, in the cell's row precision.
- :func:`pooled_lookup`: sum-pooled bags whose backward applies the optimizer to the store.
- :func:`per_sample`: pooled bags (table-major) as the module's output ``[B, T * D]``.
- :func:`stored_rows`: a store's rows as float32 (for ``flush``).
- :class:`TableWiseSharded`: several ranks, each owning whole tables, around a one-rank module.
- :class:`BackgroundWorker`: one thread that runs a module's host work in order.
- :func:`fill_in_parallel`: run independent jobs (initialising chunks of rows) on every core.
- ``ROW_PRECISIONS``, :func:`table_bytes`: the row precisions a strategy may accept, and what
  tables cost in one of them (for ``Strategy.estimate_memory``).

A complete, installable example: ``examples/embbench-plugin-example`` in the repository.
"""

from __future__ import annotations

from embbench.data.batch import Batch, SparseFeatures
from embbench.data.presets import TableSpec
from embbench.data.weights import fill_in_parallel
from embbench.embedding import WORK_INSTRUMENT, RowSpace, RowStore, per_sample, pooled_lookup, stored_rows, whole_store
from embbench.optim import EmbeddingOptimizer
from embbench.row_precision import ROW_PRECISIONS, table_bytes
from embbench.sharding import TableWiseSharded
from embbench.strategy import (COUNTERS, BuildContext, MemoryFootprint, RuntimeEnv, Schedule, ScheduleContext,
                               SparseModule, Strategy, StrategyParams, Unsupported)
from embbench.worker import BackgroundWorker

__all__ = [
    "COUNTERS", "ROW_PRECISIONS", "BackgroundWorker", "Batch", "BuildContext", "EmbeddingOptimizer", "MemoryFootprint",
    "RowSpace", "RowStore", "RuntimeEnv", "Schedule", "ScheduleContext", "SparseFeatures", "SparseModule", "Strategy",
    "StrategyParams", "TableSpec", "TableWiseSharded", "Unsupported", "WORK_INSTRUMENT", "fill_in_parallel", "per_sample",
    "pooled_lookup", "stored_rows", "table_bytes", "whole_store",
]
