"""The strategy interface and the registry.

A *strategy* is a placement of the embedding tables (all on the device, on the host, in
unified memory, behind a cache, ...). The harness knows strategies only through this
interface and never branches on a strategy's name. Strategies are discovered through the
``embbench.strategies`` entry-point group; the built-in ones register there exactly as a
third party's would::

    [project.entry-points."embbench.strategies"]
    my_cache = "my_package.module:MyCacheStrategy"
"""

from __future__ import annotations

import abc
import contextlib
import inspect
import sys
import types
import typing
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from importlib.metadata import entry_points
from typing import Annotated, Any, Callable, ClassVar, Iterator, Literal, Union

import torch
from torch import Tensor

from embbench.bounds import Config
from embbench.data.batch import Batch, SparseFeatures
from embbench.data.presets import TableSpec
from embbench.optim import EmbeddingOptimizer
from embbench.row_precision import ROW_PRECISIONS

__all__ = [
    "COUNTERS", "BuildContext", "Counting", "MemoryFootprint", "NoParams", "RuntimeEnv", "Schedule", "ScheduleContext",
    "Semantics", "SparseModule", "Strategy", "StrategyParams", "Unsupported", "broken_strategies", "estimate_kwargs",
    "get_strategy", "is_all_in_hbm", "load_strategies", "parameter_type", "strategy_version",
]

#: Counter names every strategy reports (cumulative since build; absent ones count as 0).
COUNTERS = {
    "accesses": "ids looked up (with repeats)",
    "unique_accesses": "distinct rows looked up, summed over steps",
    "hits": "ids served from the device-side cache",
    "misses": "ids whose row had to be fetched into the cache",
    "unique_misses": "distinct rows fetched into the cache",
    "rows_admitted": "rows copied into the cache",
    "rows_loaded": "rows read from the host into the cache (where bytes_h2d carries more than rows: sfctr's virtual ids)",
    "rows_evicted": "rows removed from the cache",
    "rows_written_back": "evicted or flushed rows that were updated, copied back to the host",
    "rows_moved_late": "cached rows evicted from a slot the running step still used: moved once it had ended",
    "window_pairs_dropped": "look-ahead (row, batch) pairs that did not fit the window (costs hits, never correctness)",
    "update_entries": "entries the embedding optimizer's update processed, padding included",
    "update_entries_max_per_row": "the most update entries aimed at one row in a step, summed over steps",
    "ids_max_per_row": "the most ids of a step's batch on one row, summed over steps",
    "bytes_h2d": "bytes moved host -> device (rows, state, pooled embeddings)",
    "bytes_d2h": "bytes moved device -> host (rows, state, ids, gradients)",
    "bytes_comm": "bytes this rank sent to other ranks (ids, pooled rows, their gradients)",
    "comm_us": "microseconds this rank spent in those collectives",
    "host_syncs": "times the strategy's bookkeeping waited for the device (a value read on the host)",
    "rows_synced": "rows copied between two copies of a row kept by the strategy (e.g. hot device copy and host)",
    "hot_batches": "training batches whose every id was in the strategy's hot set",
    "cold_batches": "training batches with at least one id outside the hot set",
    "pipeline_stalls": "times a step waited for the strategy's own pipeline (planning or copies not done)",
    "host_step_us": "microseconds the training thread spent in the strategy's calls of its steps (on CUDA its "
                    "host work and waits, not the device's; on a CPU the work itself)",
    "host_plan_us": "microseconds the host spent planning batches (slot assignment, staging)",
    "host_wait_us": "microseconds the training thread waited for the strategy's background thread (planning it did not hide)",
}

#: Which of the harness's instruments run (:meth:`SparseModule.set_counting`): ``warmup`` those
#: the warm-up's stopping rule reads (the miss rate), ``off`` none (the timed steps, and the steps
#: that count operators or profile them), ``counted`` every one (the counted steps, whose counters
#: the record reports).
Counting = Literal["warmup", "off", "counted"]

#: ``exact``: a strategy trains the same weights as the baseline step for step (max |Δw| is
#: meaningful); ``reordered``: it changes the order of training samples (compare by accuracy).
Semantics = Literal["exact", "reordered"]


class Unsupported(Exception):
    """Raised by a strategy that cannot run in this environment; the message says why."""


class StrategyParams(Config):
    """Base class of a strategy's parameters: typed, defaulted, validated, no unknown keys, no
    infinity, no boolean for a number (:class:`embbench.bounds.Config`)."""


class NoParams(StrategyParams):
    pass


def parameter_type(annotation: Any) -> str:
    """A parameter's type as a person reads it in ``embbench strategies``: ``int | 'auto'``,
    ``'static' | 'lfu'``, ``list[float]`` (constraints such as ``ge=0`` are left out)."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is Annotated:
        return parameter_type(args[0])
    if origin is Literal:
        return " | ".join(repr(a) for a in args)
    if origin is Union or origin is types.UnionType:
        return " | ".join(parameter_type(a) for a in args)
    if annotation is None or annotation is type(None):
        return "None"
    if origin is not None:
        return f"{getattr(origin, '__name__', origin)}[{', '.join(parameter_type(a) for a in args)}]"
    return getattr(annotation, "__name__", str(annotation))


@dataclass(frozen=True)
class RuntimeEnv:
    """What the current machine and process offer."""

    device: torch.device
    world_size: int = 1
    rank: int = 0

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"


@dataclass
class MemoryFootprint:
    """Static bytes a strategy holds, per rank.

    ``device_bytes`` are on the compute device (which is the CPU on a machine without GPUs).
    ``managed_bytes``: of ``host_bytes``, those in CUDA managed (unified) memory, which the GPU
    pages in on demand: the preflight also holds them to the GPU's free memory.
    ``disk_bytes``: a file the strategy writes on a drive, in ``disk_dir`` (None: the cell's
    own folder in the run directory); the preflight holds them to that drive's free space, with
    ``scratch_bytes`` beside them (once for the cell, not per rank: a drive probe's file).
    """

    device_bytes: int = 0
    host_bytes: int = 0
    pinned_bytes: int = 0
    managed_bytes: int = 0
    disk_bytes: int = 0
    disk_dir: str | None = None
    scratch_bytes: int = 0
    #: why the strategy cannot run at this shape, known before it starts (the preflight skips the cell)
    refusal: str | None = None


@dataclass
class BuildContext:
    """Everything a strategy needs to build its sparse module on one rank.

    Attributes:
        tables: the model's tables (all ranks see all tables).
        env: device, rank and world size.
        optimizer: the embedding optimizer, whose math the module must apply.
        local_batch_size: samples per step on this rank.
        init_weights: ``init_weights(t, start, stop)`` returns rows ``[start, stop)`` of
            table ``t``'s initial weights (float32, on the CPU); every strategy starts from them.
        train_batches: ``train_batches(n)`` iterates over the first ``n`` training batches
            (this rank's share) for frequency statistics; evaluation data is never offered.
        warmup_steps: training steps the harness runs before it measures.
        process_group: the torch.distributed group of the ranks, or None for one process.
        train_steps: training batches the run hands the module in all: no look-ahead reaches
            further (None: not told).
        row_precision: the type the rows are stored in (``run.row_precision``: fp32, fp16,
            bf16, fp8; see :mod:`embbench.row_precision`); only ever one the strategy accepted
            (:meth:`Strategy.row_precision_reason`).
        seed: the scenario's seed (for a strategy's own random streams, e.g. stochastic rounding).
        sparse_backward: ``run.sparse_backward`` (auto, padded, padded_torch, unique): how a store built from
            :mod:`embbench.embedding` sums its row gradients; applied by :meth:`configure`.
        work_dir: a folder of this cell's own for files the strategy keeps (a row file), inside
            the run directory; the harness removes it when the cell ends, however it ends
            (None: the harness gives none, as in a test that builds a module directly).
    """

    tables: list[TableSpec]
    env: RuntimeEnv
    optimizer: EmbeddingOptimizer
    local_batch_size: int
    init_weights: Callable[[int, int, int], Tensor]
    train_batches: Callable[[int], Iterator[Batch]]
    warmup_steps: int = 0
    process_group: Any = None
    train_steps: int | None = None
    row_precision: str = "fp32"
    seed: int = 0
    sparse_backward: str = "auto"
    work_dir: Path | None = None

    def configure(self, store) -> None:
        """Apply ``run.sparse_backward`` to an :class:`~embbench.embedding.RowStore` the
        strategy built (auto leaves the store's own choice: padded on CUDA; padded_torch never
        takes the update kernel)."""
        store.padded_aggregation = {"auto": None, "padded": True, "padded_torch": True, "unique": False}[
            self.sparse_backward]
        if self.sparse_backward == "padded_torch":
            store.update_kernel = False


@dataclass
class ScheduleContext:
    """What a strategy may use to propose the order of training samples.

    Attributes:
        tables: the model's tables.
        batch_size: the global batch size.
        num_batches: training batches the run will use (warm-up, measurement, extra steps).
        world_size: ranks of the run (every rank computes the schedule; it must be deterministic).
        seed: the scenario's seed.
        samples: ``samples()`` returns the sparse features of all ``num_batches * batch_size``
            training samples in stream order (sample ``j`` of batch ``i`` is ``i * B + j``),
            on the compute device. Training data only: evaluation data is never offered.
    """

    tables: list[TableSpec]
    batch_size: int
    num_batches: int
    world_size: int
    seed: int
    samples: Callable[[], SparseFeatures]


@dataclass
class Schedule:
    """A batching order of the training samples.

    Attributes:
        order: ``num_batches * batch_size`` sample indices (into ``ScheduleContext.samples()``):
            training batch ``i`` is ``order[i * B : (i + 1) * B]``.
        side: optional, one dict per batch, attached to that batch's ``SparseFeatures.side``.
    """

    order: Tensor
    side: list[dict[str, Any]] | None = None


class SparseModule(torch.nn.Module, abc.ABC):
    """Maps a batch's sparse features to pooled embeddings and trains them.

    ``forward`` returns ``[local_batch, num_tables * dim]`` on the compute device, table-major
    like torchrec's KeyedTensor. The embedding optimizer runs inside backward (or in
    :meth:`after_backward`); the harness's dense optimizer never sees embedding weights.

    With several ranks each rank's loss is the mean over its share of the global batch and
    DDP averages the dense gradients; a module averages the embedding gradients over the
    ranks the same way (torchrec's all-to-all does, through its gradient division), so W
    ranks train what one process trains on the global batch.
    """

    #: Training batches beyond the current one that :meth:`look_ahead` should receive.
    lookahead: int = 0

    @abc.abstractmethod
    def forward(self, features: SparseFeatures) -> Tensor: ...

    def look_ahead(self, upcoming: list[SparseFeatures]) -> None:
        """Each training step, before forward: the features of the next ``lookahead`` training
        batches (``upcoming[0]`` is the batch :meth:`prefetch` receives in this step; fewer near
        the end of the run). The same objects are later given to ``prefetch`` and ``forward``."""

    def prefetch(self, features: SparseFeatures) -> None:
        """The next batch, given early so that its transfers can overlap this step."""

    def after_backward(self) -> None:
        """Called once per step after backward (for strategies that update there)."""

    def end_step(self) -> None:
        """Called at the end of every training step, inside its timed region: finish what the
        step handed to the strategy's own threads or streams, so that the step's time
        includes it (work left running would otherwise go on, untimed, while the harness
        makes the next batch). Work for later batches may still overlap this step's compute."""

    def counters(self) -> dict[str, int]:
        """Cumulative counters; names from :data:`COUNTERS`."""
        return {}

    def instruments(self) -> dict[str, str]:
        """The harness's instruments in this module, name -> what it records: work a step does
        only to be measured (counting per table, recording ids for a bound), which the runner
        keeps out of the timed steps (:meth:`set_counting`). A strategy's own bookkeeping (what
        its placement needs anyway) is none."""
        return {}

    def set_counting(self, mode: Counting) -> None:
        """Which instruments run in the steps from now on (:data:`Counting`); a module is built
        in ``warmup``. The runner calls it between steps, never inside one."""

    def empty_slots(self) -> int | None:
        """Device slots a cache has not filled yet (None: not a cache that says). A cache with
        empty slots loads without evicting, which its steady state does not: the warm-up goes
        on while any remain (within ``run.warmup_max_steps``). Reads the device: not in a step."""
        return None

    @abc.abstractmethod
    def memory(self) -> MemoryFootprint: ...

    @abc.abstractmethod
    def flush(self) -> list[Tensor]:
        """The trained weights as full host tables (on every rank), one tensor per table."""

    def extra_metrics(self) -> dict[str, Any]:
        """Anything else worth recording (e.g. the id stream sample for a cache bound)."""
        return {}


class Strategy(abc.ABC):
    """A placement strategy: its parameters, where it can run, and how to build it."""

    #: Name used in scenarios (must equal the entry-point name).
    name: ClassVar[str]
    #: One line for ``embbench strategies``.
    summary: ClassVar[str] = ""
    #: The parameter model; scenario values are validated against it.
    Params: ClassVar[type[StrategyParams]] = NoParams
    #: ``reordered`` if :meth:`schedule` changes the order of training samples.
    semantics: ClassVar[Semantics] = "exact"
    #: The row precisions (``run.row_precision``) it can store rows in; the others are
    #: ``unsupported`` (never run in fp32 under another name).
    row_precisions: ClassVar[tuple[str, ...]] = ("fp32",)
    #: Every row and its optimizer state in the compute device's memory ("all-in-HBM" on a GPU):
    #: what to run when the tables fit, and so what a cache's speed is also held against
    #: (:func:`embbench.columns.all_in_hbm_throughputs`: the fastest such cell of a run).
    all_in_hbm: ClassVar[bool] = False

    def __init__(self, params: StrategyParams | None = None):
        self.params = params if params is not None else self.Params()

    def unsupported_reason(self, env: RuntimeEnv) -> str | None:
        """Why this strategy cannot run here, or None if it can."""
        return None

    def row_precision_reason(self, precision: str, env: RuntimeEnv) -> str | None:
        """Why this strategy cannot store its rows in ``precision`` here, or None if it can."""
        if precision in self.row_precisions:
            return None
        return f"row_precision {precision}: {self.name} stores rows in {' or '.join(self.row_precisions)} only"

    def refusal(self, env: RuntimeEnv, row_precision: str = "fp32") -> str | None:
        """Why this cell cannot run here (:meth:`unsupported_reason`, then the row precision), or None."""
        return self.unsupported_reason(env) or self.row_precision_reason(row_precision, env)

    def estimate_memory(self, tables: list[TableSpec], optimizer: EmbeddingOptimizer, world_size: int) -> MemoryFootprint | None:
        """Static bytes per rank before anything is built (for ``--dry-run``), if known.

        An override may also declare the keyword arguments ``local_batch_size`` (samples per
        step on a rank), ``train_steps`` (the training batches the run hands the module, so
        the most :meth:`SparseModule.look_ahead` ever sees) and ``row_precision`` (the cell's
        ``run.row_precision``: :func:`~embbench.row_precision.table_bytes` counts its rows) and
        ``train_batches`` (as ``BuildContext.train_batches``: the first n training batches, made
        as a one-rank cell's build gets them; ``world_size`` 1 only, and costly: for a refusal
        that depends on the data, returned as ``MemoryFootprint.refusal``); the preflight and
        ``--dry-run`` pass those it declares (:func:`estimate_kwargs`)."""
        return None

    def schedule(self, ctx: ScheduleContext) -> Schedule | None:
        """The batching order this strategy proposes for the training samples, or None for the
        data's own order. Called once per rank before :meth:`build`, on training data only."""
        return None

    @abc.abstractmethod
    def build(self, ctx: BuildContext) -> SparseModule: ...


def estimate_kwargs(strategy: Strategy, **run: Any) -> dict[str, Any]:
    """Of ``run`` (``local_batch_size``, ``train_steps``, ``row_precision``, ``train_batches``), what
    ``strategy.estimate_memory`` declares."""
    accepted = inspect.signature(strategy.estimate_memory).parameters
    return {key: value for key, value in run.items() if key in accepted}


def _validate(name: str, cls: object, source: str) -> type[Strategy]:
    where = f"strategy {name!r} ({source})"
    if not (isinstance(cls, type) and issubclass(cls, Strategy)):
        raise TypeError(f"{where} is not a subclass of embbench.strategy.Strategy: {cls!r}")
    if getattr(cls, "name", None) != name:
        raise TypeError(f"{where}: class {cls.__name__} declares name {getattr(cls, 'name', None)!r}")
    if not (isinstance(cls.Params, type) and issubclass(cls.Params, StrategyParams)):
        raise TypeError(f"{where}: Params must subclass embbench.strategy.StrategyParams")
    declared = cls.row_precisions
    if not (isinstance(declared, (tuple, list, frozenset, set)) and declared
            and all(isinstance(p, str) and p in ROW_PRECISIONS for p in declared)):
        raise TypeError(f"{where}: row_precisions must be a non-empty tuple of {', '.join(ROW_PRECISIONS)}; "
                        f"got {declared!r}")
    return cls


@cache
def _discover() -> tuple[dict[str, type[Strategy]], dict[str, str]]:
    """Every ``embbench.strategies`` entry point: the usable strategies, and why the others are
    broken (an import that fails, or exits, a class that breaks the contract, a name taken twice).

    A plugin runs its import here: whatever it prints goes to stderr (stdout may be a command's
    JSON), and whatever it raises, ``SystemExit`` included, breaks that plugin only. A plugin that
    takes a built-in strategy's name is ignored, named with both entry points (the built-in stays);
    two plugins that take one name are both broken."""
    by_name: dict[str, list] = {}
    for ep in entry_points(group="embbench.strategies"):
        by_name.setdefault(ep.name, []).append(ep)
    found: dict[str, type[Strategy]] = {}
    broken: dict[str, str] = {}
    for name, points in by_name.items():
        builtin = [ep for ep in points if _is_builtin(ep)]
        if len(points) > 1:
            where = " and ".join(_entry_point_text(ep) for ep in points)
            if len(builtin) != 1:
                broken[name] = f"strategy {name!r} is registered twice: {where}"
                continue
            for ep in points:
                if ep is not builtin[0]:
                    broken[f"{name} ({ep.value})"] = (f"strategy {name!r} is registered twice: {where}; the built-in "
                                                      "one is used, the plugin's is ignored (rename it)")
            points = builtin
        ep = points[0]
        try:
            with contextlib.redirect_stdout(sys.stderr):
                found[name] = _validate(name, ep.load(), ep.value)
        except KeyboardInterrupt:
            raise
        except BaseException as e:  # a third party's package must not break (or end) every command
            broken[name] = str(e) if isinstance(e, TypeError) else \
                f"strategy {name!r} ({ep.value}) cannot be loaded: {type(e).__name__}: {e}"
    return dict(sorted(found.items())), dict(sorted(broken.items()))


def _is_builtin(ep) -> bool:
    return ep.dist is not None and ep.dist.name == "embbench"


def _entry_point_text(ep) -> str:
    return f"{ep.value} ({ep.dist.name} {ep.dist.version})" if ep.dist is not None else ep.value


def load_strategies() -> dict[str, type[Strategy]]:
    """Every usable strategy installed through the ``embbench.strategies`` entry points."""
    return dict(_discover()[0])


def broken_strategies() -> dict[str, str]:
    """The installed entry points that cannot be used, each with the reason."""
    return dict(_discover()[1])


#: Tests install plugins on the fly and start discovery afresh.
load_strategies.cache_clear = _discover.cache_clear  # type: ignore[attr-defined]


def strategy_version(name: str) -> str | None:
    """``"<distribution> <version>"`` of the package whose entry point installs strategy
    ``name`` (``"embbench 0.1.0"`` for the built-in ones), or None if none does."""
    for ep in entry_points(group="embbench.strategies", name=name):
        return f"{ep.dist.name} {ep.dist.version}" if ep.dist is not None else None
    return None


def is_all_in_hbm(name: str) -> bool:
    """Whether the strategy registered as ``name`` keeps every table in device memory
    (:attr:`Strategy.all_in_hbm`); False for a name not installed here."""
    try:
        return get_strategy(name).all_in_hbm
    except KeyError:
        return False


def get_strategy(name: str) -> type[Strategy]:
    """The strategy class registered as ``name``.

    Raises:
        KeyError: unknown or broken, with the reason and the usable names.
    """
    strategies, broken = _discover()
    if name in broken:
        raise KeyError(f"{broken[name]}; usable: {', '.join(strategies)}")
    if name not in strategies:
        raise KeyError(f"unknown strategy {name!r}; installed: {', '.join(strategies)}")
    return strategies[name]
