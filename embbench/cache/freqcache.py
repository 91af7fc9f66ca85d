"""A frequency-aware software cache of embedding rows on the compute device (freqcache v3).

The full tables, with their optimizer state side by side (``[rows + 1, dim + state]``, the last
row a dummy that padded moves read and write), stay in host memory: on CUDA a host-mapped
pinned tensor that the GPU reads and writes directly, as fbgemm's UVM does. The device holds
one fused row space for all tables: a slot tensor of weights and one of optimizer state (one
extra *sink* slot takes padded writes), so a step does one lookup and one optimizer update
whatever the number of tables.

Which row sits in which slot is decided on the device by
:class:`~embbench.cache.device_planner.DevicePlanner`, in a fixed sequence of tensor
operations of fixed shapes: the host only launches and never reads a device value, so a step
never waits for the device. Each batch the runner looks ahead to enters the planner's window
when it is first seen (its ids are on the device already); the next batch is planned and its
rows moved while the current one computes (``prefetch``), on a side stream on CUDA. The moves
are two padded gathers and scatters against the host table: dirty victims out, missing rows
in. A plan may take cached slots of the running step (as Belady would): those moves (the
plan's late part) wait for that step's backward (:meth:`FreqCache.after_backward`).

Longer than 600 lines because: :class:`FreqCache` is one step (lookup, plan, moves, update,
its CUDA-graph capture) over slot tensors and streams that all its parts share; the helpers
below the class (:class:`CapturedStep`, :class:`_StreamRecorder`) are the seam if it grows.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import math
import time
import weakref
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Iterable, Literal

import numpy as np
import torch
from pydantic import Field, model_validator
from torch import Tensor

from embbench.cache import row_copy
from embbench.cache.file_moves import FileMoves
from embbench.cache.file_rows import FileRows, host_memory_problem
from embbench.cache.row_copy import move_rows, words
from embbench.cache.device_planner import (AUTO_LOOKAHEAD, COUNTERS, DevicePlan, DevicePlanner, StepKind,
                                             auto_window_pairs, cache_window)
from embbench.data.batch import SparseFeatures
from embbench.data.weights import fill_in_parallel
from embbench.disk.layout import PageLayout, RowOrder
from embbench.disk.probe import measure_drive
from embbench.embedding import WORK_INSTRUMENT, RoundedRowStore, RowSpace, RowStore, per_sample, pooled_lookup
from embbench.metrics import belady_hit_rates
from embbench.optim import EmbeddingOptimizer
from embbench.row_precision import ROW_PRECISIONS, row_type
from embbench.sharding import TableWiseSharded
from embbench.strategy import BuildContext, MemoryFootprint, SparseModule, Strategy, StrategyParams, Unsupported

__all__ = ["FreqCache", "FreqCacheParams", "FreqCacheStrategy", "cache_window"]


class FreqCacheParams(StrategyParams):
    cache_ratio: float = Field(0.015, gt=0, le=1, description="share of all rows held on the device")
    policy: Literal["static", "lfu"] = Field("lfu", description="frequencies from the profile only, or counted as training goes")
    admission: Literal["all", "tinylfu"] = Field("tinylfu", description="admit every missing row, or only one more frequent than its victim")
    lookahead: Annotated[int, Field(ge=0)] | Literal["auto"] = Field(
        "auto", description="upcoming training batches in the window: the nearer a row's next use there, the later "
                                  "it is evicted; auto: enough to see ~10 (row, batch) pairs per cache row (8-256 batches, "
                                  "the window at most a tenth of the slot tensors' bytes or 64 MiB, whichever is more)")
    decay_every: int = Field(256, ge=0, description="halve the frequency counts every N training batches (0: never)")
    profile_batches: int = Field(32, ge=0, description="training batches profiled for frequencies and the preload")
    prefetch: bool = Field(True, description="plan and load the next batch's rows while this one computes")
    belady_steps: int = Field(64, ge=0, description="training batches recorded for the Belady bound, in the counted steps "
                                                     "(never the timed ones; 0: off)")
    cuda_graph: bool = Field(True, description="on CUDA, replay the planner's steady-state step from a captured CUDA graph")
    compile: bool | Literal["auto"] = Field(
        "auto", description="compile the steady-state device steps (torch.compile: fused kernels instead of one kernel per "
                            "operation); auto: on CUDA only (on a CPU, compiling takes seconds a run for ~15 % a step)")
    store: Literal["memory", "file"] = Field(
        "memory", description="where the full tables live: host memory, or a file on a drive behind a host-memory cache "
                              "of its pages (read batches ahead, from the look-ahead window)")
    store_dir: str | None = Field(None, description="store: file: the folder of the row file (default: the cell's own "
                                                    "folder in the run directory)")
    dram_ratio: float = Field(0.1, gt=0, le=1, description="store: file: the share of the file's pages host memory holds")
    io_depth: int = Field(32, ge=1, le=1024, description="store: file: reads the reader keeps in flight")
    drive_probe_s: float = Field(1.0, ge=0, le=60, description="store: file: seconds of random reads at io_depth that "
                                                               "measure the drive at build, for the record (0: off)")
    store_layout: Literal["id", "frequency", "table_frequency", "coaccess"] = Field(
        "frequency", description="store: file: rows in pages in id order; frequency: the profile's rows used in more "
                                 "than one batch first, most used first; table_frequency: in each table, the rows the "
                                 "profile saw first; coaccess: the rows the device caches first, then the profile's "
                                 "other rows in pages by the sample that used them (docs/nvme.md: which reads less where)")

    @model_validator(mode="after")
    def _file_store_only(self):
        if self.store == "memory":
            given = sorted(k for k in ("store_dir", "dram_ratio", "io_depth", "drive_probe_s", "store_layout")
                           if k in self.model_fields_set)
            if given:
                raise ValueError(f"{', '.join(given)}: only for store: file (store is memory)")
        return self


#: The drive probe's scratch file at build (store: file): larger than a drive's own cache, quick to write.
_PROBE_FILE_BYTES = 256 << 20
#: Steady-state steps run uncaptured before one is captured (they compile and warm the kernels up).
_EAGER_BEFORE_CAPTURE = 2
#: Every timed step's plan: a training batch that entered the window right after the last one
#: planned, while the step before it may still run.
_STEADY = StepKind(keeps_running=True, number="next")


class CapturedStep:
    """A device step of fixed shapes captured as one CUDA graph (CUDA only).

    Its inputs live in static buffers (shaped as the ones it was captured with): copies of the
    capture's inputs, copied into before each replay, or with ``static_inputs`` the capture's
    input tensors themselves (another graph's outputs, say), which a replay then reads where
    they are, with no copy. Its outputs live in the graph's memory, which the next replay
    overwrites: callers copy what they keep beyond it. The step's state tensors are read and
    written in place, so a replay sees their current values.
    """

    def __init__(self, step, inputs: tuple[Tensor, ...], static_inputs: bool = False):
        self.shapes = [t.shape for t in inputs]
        self.inputs = tuple(inputs) if static_inputs else tuple(t.clone() for t in inputs)
        self.input_copies = 0  # inputs copied into the static buffers, over all replays
        self.output = self._capture(step)

    def _capture(self, step):
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph, capture_error_mode="thread_local"):
            return step(*self.inputs)

    def _replay(self) -> None:
        self.graph.replay()

    def fits(self, inputs: tuple[Tensor, ...]) -> bool:
        return [t.shape for t in inputs] == self.shapes

    def __call__(self, *inputs: Tensor):
        for static, t in zip(self.inputs, inputs):
            if t is not static:
                static.copy_(t)
                self.input_copies += 1
        self._replay()
        return self.output


@dataclass
class _Prefetched:
    values: Tensor  # the batch's ids tensor itself (an id() could be reused)
    slots: Tensor
    plan: int


def _host_timed(method):
    """Adds the training thread's time in ``method`` to ``counters()['host_step_us']``."""

    @functools.wraps(method)
    def timed(self, *args, **kw):
        started = time.perf_counter_ns()
        try:
            return method(self, *args, **kw)
        finally:
            self._host_ns += time.perf_counter_ns() - started

    return timed


def host_table(rows: int, width: int, device: torch.device, dtype: torch.dtype = torch.float32) -> Tensor:
    """``[rows, width]`` zeros in host memory that ``device`` addresses: on CUDA a host-mapped
    pinned tensor (fbgemm's op), which the GPU's gathers and scatters read and write directly."""
    if device.type != "cuda":
        return torch.zeros(rows, width, dtype=dtype)
    import fbgemm_gpu  # noqa: F401  (registers torch.ops.fbgemm)

    table = torch.ops.fbgemm.new_unified_tensor(torch.empty(0, device=device, dtype=dtype), [rows, width], True)
    return table.zero_()


class FreqCache(SparseModule):
    """The cache module on one rank (see the module docstring)."""

    def __init__(self, ctx: BuildContext, params: FreqCacheParams):
        super().__init__()
        self.params = params
        self.space = RowSpace(ctx.tables)
        self.device = ctx.env.device
        self.cuda = self.device.type == "cuda"
        self.optimizer: EmbeddingOptimizer = ctx.optimizer
        n, dim, width = self.space.num_rows, self.space.dim, ctx.optimizer.state_width
        self.num_rows, self.dim = n, dim
        self.capacity = max(1, min(n, math.ceil(params.cache_ratio * n)))
        self.kind = kind = row_type(ctx.row_precision)  # rows stored in it on the host and in the slots
        if kind.packing_problem(dim):
            raise Unsupported(kind.packing_problem(dim))
        self.row_bytes = kind.row_bytes(dim, width)
        self.max_ids = ctx.local_batch_size * sum(t.bag_size for t in ctx.tables)

        # Frequency profile of training batches only (BuildContext never offers eval data): it
        # sizes the window and preloads the most frequent rows.
        profiled, samples = [], []  # samples: each profiled id's sample, for the coaccess layout only
        for batch in ctx.train_batches(params.profile_batches):
            profiled.append(self.space.global_rows(batch.sparse.to(self.device)))
            if params.store == "file" and params.store_layout == "coaccess":
                samples.append(batch.sparse.sample_of_each_id().cpu().numpy())
        lookahead, window_rows = cache_window([len(rows.unique()) for rows in profiled], n, self.capacity,
                                              self.max_ids, self.row_bytes, params.lookahead, ctx.train_steps)
        self.lookahead = lookahead if params.prefetch else 0
        self.planner = DevicePlanner(n, self.capacity, self.max_ids, self.lookahead, self.device, params.admission,
                                     learn=params.policy == "lfu", decay_every=params.decay_every,
                                     window_rows=window_rows)

        # Host table: each row beside its scale (fp8) and optimizer state, packed in the row
        # type's elements (RowType.pack), so one gather moves all of them. In host memory, or
        # in a file (store: file) whose pages host memory caches.
        self.host: Tensor | None = None
        self.file_rows: FileRows | None = None
        if params.store == "file":
            self.file_rows = self._file_rows(ctx, params, profiled, samples)
            self._closer = weakref.finalize(self, self.file_rows.close)  # also at exit after an error
        else:
            self.host = host_table(n + 1, kind.packed_width(dim, width), self.device, kind.carrier)
            host_weights, host_extras = kind.unpack(self.host[:n], dim)
            self.space.fill_initial(host_weights, ctx.init_weights, kind=None if kind.exact else kind,
                                    scales=host_extras[:, :1])
        slots = self.planner.num_slots + 1  # the last: the sink
        self.cache_weights = torch.zeros(slots, dim, dtype=kind.carrier, device=self.device)
        # per slot: the row's scale (fp8) and optimizer state, float32
        self.cache_extras = torch.zeros(slots, kind.extras(width), device=self.device)
        self.store = RowStore(self.cache_weights, self.cache_extras, self.optimizer) if kind.exact else \
            RoundedRowStore(self.cache_weights, self.cache_extras, self.optimizer, kind, ctx.seed)
        ctx.configure(self.store)

        hot = self.planner.profile(profiled)
        warm = self._host_rows(hot).to(self.device)  # preloaded into slots 0..len-1
        self.cache_weights[: len(hot)], self.cache_extras[: len(hot)] = kind.unpack(warm, dim)
        del profiled, samples, warm
        self.file_moves = None if self.file_rows is None else FileMoves(
            self.file_rows, self.cache_weights, self.cache_extras, self.max_ids, self.planner.sink, self.planner.pad_row)

        moves_problem = row_copy.triton_problem(self.device)
        self._triton_moves = moves_problem is None
        self._moves_note = ("triton: padded entries skipped" if moves_problem is None else
                            f"torch: padded to {self.max_ids:,} rows a move ({moves_problem})")
        self._side = torch.cuda.Stream(self.device) if self.cuda else None
        # The steady-state device steps, each with fixed shapes: compiled (torch.compile) and, on
        # CUDA, captured as graphs; and why they are not.
        self._steps = {"enter": self.planner.device_enter, "plan": self._steady_plan, "late": self._late_moves}
        self._compiled: dict[str, tuple] = {}  # name -> (compiled device work, what follows it uncompiled)
        self._compile_worked: set[str] = set()
        self._compile_seconds: dict[str, float] = {}  # each step's first (compiling) call, host seconds
        self._compiling = self.cuda if params.compile == "auto" else params.compile
        self._compile_note = ("not compiled yet" if self._compiling else
                              "off: not on CUDA (compile: auto)" if params.compile == "auto" else "off: compile is false")
        self._captured: dict[str, CapturedStep] = {}
        self._eager_runs = dict.fromkeys(self._steps, 0)
        self._graphs_on = self.cuda and params.cuda_graph
        self._graph_note = ("not captured yet" if self._graphs_on else "off: not on CUDA" if not self.cuda else
                            "off: cuda_graph is false")
        self._graph_checked = False
        self._numbers: dict[int, tuple[Tensor, int]] = {}  # id(values) -> (values, window number)
        self._entering: list[SparseFeatures] = []  # numbered, their device work not queued yet
        self._prefetched: _Prefetched | None = None
        self._late: DevicePlan | None = None  # a plan whose late moves wait for the running step's end
        self._gate: torch.cuda.Event | None = None  # recorded behind the running step's lookup (CUDA)
        self._looked_up = torch.cuda.Event() if self.cuda else None  # that event, made once
        self._running: int | None = None  # the plan of the last forwarded batch
        self._late_batch: int | None = None  # the window number of the late plan's batch (store: file)
        self._moving: int | None = None  # the window number of the batch whose rows move now
        self._held_at_entry: dict[int, Tensor] = {}  # store: file: a batch's rows the device held when announced
        # per table, on the device (no host read a step): distinct rows of training batches, rows
        # loaded into slots, rows written back (metrics.tiers_by_table)
        self._table_names = [t.name for t in ctx.tables]
        self._table_starts = self.space.starts.to(self.device)
        self._table_counts = torch.zeros(len(ctx.tables), 3, dtype=torch.int64, device=self.device)
        # The Belady window: the first belady_steps training batches planned in counted steps
        # (set_counting: the harness's instrument, never in a timed step).
        self._counting = False
        self._host_ns = 0  # the training thread's time in the step's calls (counters: host_step_us)
        self._observed = 0  # training batches planned so far
        self._window_first: int | None = None  # the first recorded one
        self._recorder = _StreamRecorder(params.belady_steps, self.max_ids, self.device)
        self._window_start: dict[str, int] | None = None
        self._window_end: Tensor | None = None

    # -- the look-ahead window --------------------------------------------------------------------

    @_host_timed
    def look_ahead(self, upcoming: list[SparseFeatures]) -> None:
        """Batches seen for the first time enter the planner's window (in look-ahead order).
        Their numbers are given now; their device work is queued after the next forward's
        lookup (:meth:`_enter_pending`), so that the lookup never waits for it (6.45M window
        pairs rewritten a step at the Kaggle shape), or before a plan that needs it."""
        for features in upcoming:
            known = self._numbers.get(id(features.values))
            if known is None or known[0] is not features.values:
                number = self.planner.advance_entered()
                self._numbers[id(features.values)] = (features.values, number)
                self._entering.append(features)
                if self.file_rows is not None:  # its blocks are read from the drive from now on
                    self._announce(number, self.space.global_rows(features.to(self.device)))

    def _announce(self, number: int, rows: Tensor) -> None:
        """Announce to the row file the rows of batch ``number`` that the device holds no slot for
        (the others need no read: issue 50, 12); those it holds are checked again before the
        batch's plan (:meth:`_announce_evicted`), as the plans between may evict them."""
        with self._on_side():  # after the plans queued so far (fixed shapes: no host read)
            held = self.planner.slot_of(rows) != self.planner.sink
            self._held_at_entry[number] = torch.where(held, rows, -1)
            self.file_moves.announce(number, torch.where(held, -1, rows))

    def _announce_evicted(self, number: int) -> None:
        """Before batch ``number`` is planned: its rows the device held when it was announced and
        has evicted since are announced too (read during the step before its plan)."""
        for old in [n for n in self._held_at_entry if n < number]:
            del self._held_at_entry[old]  # (batches planned without their number: evaluation's)
        rows = self._held_at_entry.pop(number, None)
        if rows is not None:
            with self._on_side():
                gone = (rows >= 0) & (self.planner.slot_of(rows.clamp(min=0)) == self.planner.sink)
                self.file_moves.announce(number, torch.where(gone, rows, -1))

    def _enter_pending(self) -> None:
        """Queue the device work of the batches that entered the window since the last call."""
        entering, self._entering = self._entering, []
        for features in entering:
            with self._on_side():  # after the planner's work already queued there
                rows = self.space.global_rows(features.to(self.device))
                self._device_step("enter", rows, eligible=len(rows) == self.max_ids)

    def _window_number(self, features: SparseFeatures) -> int | None:
        known = self._numbers.pop(id(features.values), None)
        return known[1] if known is not None and known[0] is features.values else None

    # -- planning and moving rows ------------------------------------------------------------------

    def _plan(self, features: SparseFeatures, train: bool, running: int | None) -> Tensor:
        """Plan a batch and move its rows; returns the slot of each of its ids."""
        self._enter_pending()  # the plan sees every batch entered so far
        rows = self.space.global_rows(features.to(self.device))
        closes = train and self._observe(rows)
        number = self._window_number(features)
        pid, step = self.planner.advance(train, running, number)
        self._moving = number
        if self.file_rows is not None and number is not None:
            self.file_moves.release(number - 2)  # its late moves are queued (a plan's come at the next forward)
        if train and step == _STEADY and len(rows) == self.max_ids:  # every timed step
            out, replayed = self._device_step("plan", rows, eligible=True)
        else:
            out, replayed = self._plan_and_move(rows, train, step), False
        if replayed:  # the graph's outputs are overwritten by its next replay, which comes after
            # the late moves are queued (they read the move lists where they are) but before
            # this batch's backward has used its slots: those are copied
            out = (out[0].clone(), *out[1:])
            self._check_first_replay(out[0], rows)
        plan = DevicePlan(pid, *out, sink=self.planner.sink, pad_row=self.planner.pad_row)
        if train and self._counting:  # an instrument: counted steps only
            self._count_tables(rows, plan)
        if closes:
            self._window_end = self.planner.counts.clone()
        if running is not None:
            self._late, self._late_batch = plan, number
        if self.file_rows is not None and number is not None:
            self._announce_evicted(number + 1)  # after this plan's evictions
        return plan.slots

    def _count_tables(self, rows: Tensor, plan: DevicePlan) -> None:
        """Per table: the batch's distinct rows, the rows its plan loads and writes back; read from
        sorted rows at the tables' bounds (no scatter onto a few cells, nothing read on the host)."""
        bounds = torch.cat([self._table_starts, self._table_starts.new_tensor([self.num_rows])])  # pads lie past the end

        def per_table(ordered: Tensor, weight: Tensor | None = None) -> Tensor:
            at = torch.searchsorted(ordered, bounds)
            if weight is None:
                return at.diff()
            return torch.cat([weight.new_zeros(1), weight.cumsum(0)])[at].diff()

        ordered = rows.sort().values
        first = torch.ones_like(ordered, dtype=torch.int64)
        first[1:] = ordered[1:] != ordered[:-1]
        self._table_counts += torch.stack([per_table(ordered, first), per_table(plan.load_rows.sort().values),
                                           per_table(plan.write_back_rows.sort().values)], dim=1)

    def table_counters(self) -> dict[str, int]:
        """``table.<name>.<counter>`` for each table: its share of the tier counters."""
        self._join_side()
        counts = self._table_counts.tolist()
        out = {}
        for name, (distinct, loaded, written) in zip(self._table_names, counts):
            out.update({f"table.{name}.unique_accesses": distinct, f"table.{name}.rows_loaded": loaded,
                        f"table.{name}.rows_written_back": written})
        if self.file_rows is not None:
            out.update(self.file_rows.table_counters(self._table_names))
        return out

    def _plan_and_move(self, rows: Tensor, train: bool, step: StepKind) -> tuple[Tensor, ...]:
        """A plan's device work and its early moves; returns the plan's tensors."""
        return self._early_moves(self._planned(rows, train, step))

    def _planned(self, rows: Tensor, train: bool, step: StepKind) -> tuple[Tensor, ...]:
        plan = self.planner.device_step(rows, train, step)
        return (plan.slots, plan.write_back_slots, plan.write_back_rows, plan.load_slots, plan.load_rows, plan.late,
                plan.live)

    def _early_moves(self, out: tuple[Tensor, ...]) -> tuple[Tensor, ...]:
        self._move(*out[1:], late_part=False)
        return out

    def _steady_plan(self, rows: Tensor) -> tuple[Tensor, ...]:
        return self._plan_and_move(rows, True, _STEADY)

    def _steady_planned(self, rows: Tensor) -> tuple[Tensor, ...]:
        return self._planned(rows, True, _STEADY)

    def _late_moves(self, write_back_slots: Tensor, write_back_rows: Tensor, load_slots: Tensor, load_rows: Tensor,
                    late: Tensor, live: Tensor) -> None:
        self._move(write_back_slots, write_back_rows, load_slots, load_rows, late, live, late_part=True)

    def _device_step(self, name: str, *inputs: Tensor, eligible: bool):
        """Run one of the steady-state steps (``self._steps``), of fixed shapes when
        ``eligible``: compiled if compilation is on, and on CUDA replayed from its captured
        graph once it has run a few times. Returns its output and whether it was replayed."""
        captured = self._captured.get(name)
        if eligible and captured is not None and captured.fits(inputs):
            return self._after_graph(name, captured(*inputs)), True
        step = self._compiled_step(name) if eligible else self._steps[name]
        # a row file's moves wait on the host (its reads): never in a graph, the plan's before them
        capturable = not (self.file_moves is not None and name == "late")
        if eligible and self._graphs_on and captured is None and capturable:
            self._eager_runs[name] += 1
            if self._eager_runs[name] > _EAGER_BEFORE_CAPTURE:
                try:
                    self._captured[name] = CapturedStep(self._graph_step(name), inputs,
                                                        static_inputs=self._plan_outputs(inputs))
                except Exception as e:  # an operation torch cannot capture: stay uncaptured, and say why
                    self._graphs_on = False
                    self._graph_note = f"capture of {name} failed: {type(e).__name__}: {e}"
                else:
                    self._graph_note = "captured: " + ", ".join(sorted(self._captured))
                    return self._after_graph(name, self._captured[name](*inputs)), True
        if step is self._steps[name] or name in self._compile_worked:
            return step(*inputs), False
        compiled, finish = self._compiled[name]
        try:  # its first call compiles it (seconds; a warm inductor cache on this machine cuts them)
            started = time.perf_counter()
            out = compiled(*inputs)
            self._compile_seconds[name] = round(time.perf_counter() - started, 3)
        except Exception as e:  # nothing ran yet (a compilation fails before it runs): run eagerly, say why
            self._compiling = False  # every step runs eagerly from here on
            self._compile_worked.clear()
            self._compile_note = f"compiling {name} failed, eager: {type(e).__name__}: {_head_and_tail(str(e))}"
            return self._steps[name](*inputs), False
        self._compile_worked.add(name)
        self._compile_note = "compiled: " + ", ".join(sorted(self._compile_worked))
        # (outside the try: a failure here is not the compiler's, and must not plan the batch twice)
        return finish(out), False

    def _graph_step(self, name: str):
        """What the graph of step ``name`` captures: the step (compiled where it is), but with a row
        file the plan without its moves (:meth:`_after_graph` runs them after each replay)."""
        if self.file_moves is None or name != "plan":
            return self._compiled_step(name)
        self._compiled_step(name)  # (compiles the plan without its moves, where compilation is on)
        return self._compiled["plan"][0] if "plan" in self._compiled else self._steady_planned

    def _after_graph(self, name: str, out):
        return self._early_moves(out) if self.file_moves is not None and name == "plan" else out

    def _plan_outputs(self, inputs: tuple[Tensor, ...]) -> bool:
        """Whether ``inputs`` are the captured plan's own move lists (the late moves' inputs
        once the plan replays): a graph captured on them reads them in place, never a copy."""
        plan = self._captured.get("plan")
        return plan is not None and len(inputs) == len(plan.output) - 1 and all(
            a is b for a, b in zip(inputs, plan.output[1:]))

    @property
    def _moves_outside_compiled(self) -> bool:
        """The moves are no tensor operations to compile: Triton kernels, or the host's I/O."""
        return self._triton_moves or self.file_rows is not None

    def _compiled_step(self, name: str):
        """The step compiled (its shapes fixed: no dynamic shapes), or as it is when compilation
        is off or failed."""
        if not self._compiling or (self._moves_outside_compiled and name == "late"):  # moves only: nothing to compile
            return self._steps[name]
        if name not in self._compiled:
            if self._moves_outside_compiled and name == "plan":  # the moves outside the compiled graph
                self._compiled[name] = (torch.compile(self._steady_planned, dynamic=False, fullgraph=True),
                                        self._early_moves)
            else:
                self._compiled[name] = (torch.compile(self._steps[name], dynamic=False, fullgraph=True), _same)
        compiled, finish = self._compiled[name]
        return lambda *inputs: finish(compiled(*inputs))

    def _check_first_replay(self, slots: Tensor, rows: Tensor) -> None:
        """Once (in warm-up; it waits for the device): the first replayed plan put every id in a
        slot that holds its row."""
        if not self._graph_checked:
            self._graph_checked = True
            if not torch.equal(self.planner.slot_row[slots], rows):
                raise RuntimeError("freqcache: the plan replayed from its CUDA graph put ids in slots that do not "
                                   "hold their rows; run with cuda_graph: false")

    def _move(self, write_back_slots: Tensor, write_back_rows: Tensor, load_slots: Tensor, load_rows: Tensor,
              late: Tensor, live: Tensor, late_part: bool) -> None:
        """The plan's early (or late) moves: dirty victims out to the host table, then the
        missing rows in. The lists are padded to the batch's id capacity with the sink slot and
        the dummy host row: with Triton (CUDA) one launch a direction moves the live entries
        only (:mod:`~embbench.cache.row_copy`), else torch copies the padding there too."""
        sink, pad = self.planner.sink, self.planner.pad_row
        if self.file_rows is not None:
            moves = DevicePlan.moves(late if late_part else ~late, write_back_slots, write_back_rows, load_slots,
                                     load_rows, sink, pad)
            if self._moving is not None:  # an announced batch: the device moves its rows
                self.file_moves.move(*moves, live, self._moving, count=self._counting)
            else:  # one no announcement brought (evaluation's): the host moves them
                self.file_moves.drain()
                self._file_moves(*moves)
                self.file_moves.host_moved()
            return
        if self._triton_moves:
            host, weights, extras = words(self.host), words(self.cache_weights), words(self.cache_extras)
            for slots, rows, to_host in ((write_back_slots, write_back_rows, True), (load_slots, load_rows, False)):
                move_rows(host, weights, extras, slots, rows, late, live, sink=sink, pad=pad, late_part=late_part,
                          to_host=to_host)
            return
        write_back_slots, write_back_rows, load_slots, load_rows = DevicePlan.moves(
            late if late_part else ~late, write_back_slots, write_back_rows, load_slots, load_rows, sink, pad)
        host, kind = self.host, self.kind
        out = kind.pack(self.cache_weights[write_back_slots], self.cache_extras[write_back_slots])
        host.index_copy_(0, write_back_rows.to(host.device), out.to(host.device))
        weights, extras = kind.unpack(host[load_rows.to(host.device)].to(self.device), self.dim)
        self.cache_weights.index_copy_(0, load_slots, weights)
        self.cache_extras.index_copy_(0, load_slots, extras)

    def _file_moves(self, write_back_slots: Tensor, write_back_rows: Tensor, load_slots: Tensor,
                    load_rows: Tensor) -> None:
        """The moves of a batch no announcement brought, against a row file by the host (it reads
        the plan's lists: on CUDA a wait)."""
        kind, pad = self.kind, self.planner.pad_row
        rows = write_back_rows.cpu().numpy()
        out = rows != pad
        if out.any():
            slots = write_back_slots[torch.from_numpy(out).to(self.device)]
            packed = kind.pack(self.cache_weights[slots], self.cache_extras[slots])
            self.file_rows.scatter(rows[out], packed.cpu())
        rows = load_rows.cpu().numpy()
        into = rows != pad
        if into.any():
            weights, extras = kind.unpack(self.file_rows.gather(rows[into], self._moving).to(self.device), self.dim)
            slots = load_slots[torch.from_numpy(into).to(self.device)]
            self.cache_weights.index_copy_(0, slots, weights)
            self.cache_extras.index_copy_(0, slots, extras)

    def _host_rows(self, rows: Tensor) -> Tensor:
        """Packed rows of the host table (from the file's pages with store: file)."""
        if self.file_rows is not None:
            return self.file_rows.gather(rows.cpu().numpy())
        return self.host[rows.to(self.host.device)]

    def _file_rows(self, ctx: BuildContext, params: FreqCacheParams, profiled: list[Tensor],
                   samples: list[np.ndarray]) -> FileRows:
        """The row file, made and filled with the initial weights a chunk at a time (never the
        whole table in memory). Host memory is sized by the profiled batches' blocks."""
        kind, dim, width = self.kind, self.dim, self.optimizer.state_width
        folder = Path(params.store_dir) if params.store_dir else ctx.work_dir
        if folder is None:
            raise Unsupported("store: file needs store_dir (this harness gives the cell no folder of its own)")
        on_host = [rows.cpu().numpy() for rows in profiled]
        layout = PageLayout(self.num_rows, self.row_bytes)
        order = store_order(params.store_layout, self.num_rows, on_host, self.space.starts.tolist(), samples,
                            layout.rows_per_page, self.capacity)
        rows = FileRows.create(folder, ctx.env.rank, self.num_rows, kind.packed_width(dim, width), kind.carrier,
                               params.dram_ratio, batch_blocks=batch_blocks(on_host, layout, order),
                               io_depth=params.io_depth, order=order, table_starts=self.space.starts.numpy())
        rounded = None if kind.exact else kind

        def make_rows(start: int, stop: int) -> Tensor:
            weights = self.space.initial_rows(ctx.init_weights, start, stop)
            extras = torch.zeros(stop - start, kind.extras(width))
            if rounded is not None:
                weights, scale = rounded.encode(weights, None)
                if scale is not None:
                    extras[:, :1] = scale
            return kind.pack(weights, extras)

        rows.fill(make_rows, run=fill_in_parallel)
        self._drive = None
        if params.drive_probe_s and ctx.env.rank == 0:  # the drive's own rate, beside what the store achieves
            try:
                self._drive = measure_drive(folder, params.drive_probe_s, (params.io_depth,), _PROBE_FILE_BYTES,
                                            ceiling_seconds=min(0.5, params.drive_probe_s)).as_dict()
            except OSError as error:  # a drive filled since the preflight: the probe is optional, the cell is not
                if error.errno != errno.ENOSPC:
                    raise
                self._drive = {"path": str(folder), "problem": f"not measured: {error.strerror}"}
        return rows

    def _apply_late(self) -> None:
        """The last plan's moves into slots the step before it used, now that that step's
        update is queued (the side stream waits for the training stream's work so far)."""
        plan, self._late = self._late, None
        if plan is not None:
            self._moving = self._late_batch
            with self._on_side():
                self._device_step("late", plan.write_back_slots, plan.write_back_rows, plan.load_slots,
                                  plan.load_rows, plan.late, plan.live, eligible=True)

    def _on_side(self):
        """The side stream on CUDA, after the training stream's work up to the running step's
        lookup (``self._gate``) where one is recorded, else after all of it queued so far."""
        if not self.cuda:
            return contextlib.nullcontext()
        if self._gate is not None:
            self._side.wait_event(self._gate)
        else:
            self._side.wait_stream(torch.cuda.current_stream(self.device))
        return torch.cuda.stream(self._side)

    def _join_side(self) -> None:
        if self.cuda:
            torch.cuda.current_stream(self.device).wait_stream(self._side)

    # -- the SparseModule interface ------------------------------------------------------------

    @_host_timed
    def forward(self, features: SparseFeatures) -> Tensor:
        """The lookup, launched before any side-stream work of the step: the late moves it waits
        for were queued at the end of the step before (:meth:`after_backward`), the window's
        entries and the next plan are queued after it, gated on an event recorded behind it."""
        self._gate = None
        self._apply_late()  # none left when the harness called after_backward
        prefetched, self._prefetched = self._prefetched, None
        if prefetched is not None and prefetched.values is features.values:
            slots, self._running = prefetched.slots, prefetched.plan
        else:  # no step is running now: only this batch's rows are kept
            with self._on_side():
                slots = self._plan(features, torch.is_grad_enabled(), running=None)
            self._running = self.planner.plans - 1
        self._join_side()
        if self.cuda:
            slots.record_stream(torch.cuda.current_stream(self.device))
        offsets = features.offsets().to(self.device)
        # rounded rows: the rounding is keyed by each id's global row, wherever the row sits
        keys = None if self.kind.exact else self.space.global_rows(features.to(self.device))
        pooled = pooled_lookup(self.store, slots, offsets, self.device, keys)
        if self.cuda:  # the side stream's work of this step waits for the lookup, not the dense forward
            self._looked_up.record(torch.cuda.current_stream(self.device))
            self._gate = self._looked_up
        self._enter_pending()  # on the side stream, beside the dense forward
        return per_sample(pooled, features)

    @_host_timed
    def prefetch(self, features: SparseFeatures) -> None:
        """Plan the next batch and move its rows now; the running batch's slots are kept. (The
        harness calls it once the dense forward is launched; on the side stream it waits for
        the lookup only.)"""
        if self.params.prefetch:
            with self._on_side():
                slots = self._plan(features, True, running=self._running)
            self._prefetched = _Prefetched(features.values, slots, self.planner.plans - 1)

    @_host_timed
    def after_backward(self) -> None:
        """The running step's update is queued: the late moves into its slots follow it on the
        side stream, beside the dense optimizer's step, and the next lookup finds them done."""
        self._gate = None
        self._apply_late()

    @_host_timed
    def end_step(self) -> None:
        """The next batch's planning and moves belong to this step's time."""
        self._gate = None
        self._join_side()

    def _observe(self, rows: Tensor) -> bool:
        """A training batch, about to be planned: in counted steps, the recorded stream for the
        Belady bound and the counters at its window's start (copies, never a read on the host).
        Returns whether this batch closes the window."""
        batch = self._observed
        self._observed += 1
        recorded = len(self._recorder.lengths)
        if not self._counting or recorded >= self.params.belady_steps:
            return False
        self._recorder.record(rows)
        if recorded == 0:
            self._window_start, self._window_first = self.planner.counts.clone(), batch
        return recorded + 1 == self.params.belady_steps

    def instruments(self) -> dict[str, str]:
        belady = {"belady_stream": "each planned training batch's rows copied to the host, for Belady's MIN "
                                   f"(the first {self.params.belady_steps} batches planned in counted steps)"}
        tables = {"tiers_by_table": "each training batch's distinct, loaded and written-back rows per table "
                                    "(metrics.tiers_by_table)"}
        return {**WORK_INSTRUMENT, **(belady if self.params.belady_steps else {}), **tables}

    def set_counting(self, mode) -> None:
        self.store.counting = mode != "off"
        counting = mode == "counted"
        if self._counting and not counting and self._window_start is not None and self._window_end is None:
            self._join_side()
            self._window_end = self.planner.counts.clone()  # the window ends with the counted steps
        self._counting = counting
        if self.file_rows is not None:
            self.file_rows.counting = counting

    # -- reporting -----------------------------------------------------------------------------

    def empty_slots(self) -> int:
        """Empty slots that rows outside the device could still fill (a small table may have
        more slots than rows)."""
        self._join_side()
        planner = self.planner
        empty = int((planner.slot_row[: planner.num_slots] == planner.empty_row).sum())
        return max(0, min(empty, self.num_rows - (planner.num_slots - empty)))

    def counters(self) -> dict[str, int]:
        self._join_side()
        return self._counters(self.planner.counters())

    def _counters(self, c: dict[str, int]) -> dict[str, int]:
        c = dict(c)
        loaded = c.pop("rows_loaded")
        # No host planning and no own host syncs to count (the step's syncs are counted by the
        # runner's operator counter, on CUDA).
        if self.file_moves is not None:  # (the write-backs' own counts: each applied)
            self.file_moves.drain()
        c["host_step_us"] = self._host_ns // 1000
        return {**c, "bytes_h2d": loaded * self.row_bytes, "bytes_d2h": c["rows_written_back"] * self.row_bytes,
                **self.store.work_counters(), **(self.file_rows.counters() if self.file_rows else {}),
                **self.table_counters()}

    def memory(self) -> MemoryFootprint:
        device = self.store.nbytes + self.planner.nbytes
        if self.file_rows is not None:  # the file is on the drive: host memory holds its cached pages
            moves_device, moves_host = self.file_moves.nbytes
            if self.cuda:  # host memory's slots (registered) and the ring's values are pinned
                pinned = self.file_rows.buffer.nbytes + moves_host
                return MemoryFootprint(device_bytes=device + moves_device, pinned_bytes=pinned,
                                       host_bytes=self.file_rows.nbytes + moves_host - pinned)
            return MemoryFootprint(device_bytes=device + moves_device, host_bytes=self.file_rows.nbytes + moves_host)
        if self.cuda:
            return MemoryFootprint(device_bytes=device, host_bytes=0, pinned_bytes=self.host.nbytes)
        return MemoryFootprint(device_bytes=device, host_bytes=self.host.nbytes)

    def flush(self) -> list[Tensor]:
        """Write every dirty slot back, then return the tables."""
        self._gate = None  # the late moves wait for everything queued so far
        self._apply_late()
        self._join_side()
        slots, rows = self.planner.dirty()
        out = self.kind.pack(self.cache_weights[slots], self.cache_extras[slots])
        if self.file_rows is not None:
            self.file_moves.drain()
            self.file_moves.host_moved()
            rows = rows.cpu().numpy()
            real = rows < self.num_rows  # (the dummy row has no place in the file)
            self.file_rows.scatter(rows[real], out.cpu()[torch.from_numpy(real)])
            table = self.file_rows.table()
        else:
            self.host.index_copy_(0, rows.to(self.host.device), out.to(self.host.device))
            table = self.host[: self.num_rows].cpu()
        self.planner.clean()
        weights, extras = self.kind.unpack(table, self.dim)
        if not self.kind.exact:
            weights = self.kind.decode(weights, extras[:, :1] if self.kind.scaled else None)
        return [t.clone() for t in self.space.split(weights)]

    def extra_metrics(self) -> dict:
        """Belady's MIN on the recorded training stream at this capacity (per access and per
        distinct row of each batch), beside this cache's own rates on the same window."""
        self._join_side()
        staging = self.planner.num_slots - self.capacity
        out: dict = {"capacity_rows": self.capacity, "slots": self.planner.num_slots, "staging_slots": staging,
                     **({"staging_note": f"{staging:,} staging slots (room for two batches' ids) beside a cache of "
                                         f"{self.capacity:,} rows: until each has held a staged row, rows staged there "
                                         "stay resident, as extra cache (empty_slots_at_timing)"}
                        if staging > self.capacity else {}),
                     "policy": self.params.policy,
                     "admission": self.params.admission, "lookahead": self.lookahead,
                     "window_rows_per_batch": self.planner.window_rows, "planner": "device",
                     "planner_device_bytes": self.planner.nbytes,
                     "cache_graph_captured": bool(self._captured), "cache_graph": self._graph_note,
                     "cache_moves": self._moves_note,
                     "cache_compiled": sorted(self._compile_worked), "cache_compile": self._compile_note,
                     "cache_compile_seconds": dict(self._compile_seconds),
                     **(self.file_rows.describe() if self.file_rows else {"store": "memory"}),
                     **({"drive": self._drive} if self.file_rows and self._drive else {})}
        if self._window_start is None:
            return out
        end = self._window_end if self._window_end is not None else self.planner.counts  # a run shorter than the window
        window = dict(zip(COUNTERS, (end - self._window_start).tolist()))
        # MIN from the window's start with the best possible content for free (the rows used
        # soonest): a bound for any preload, the profile's included.
        stream = self._recorder.stream()
        per_access, per_distinct = belady_hit_rates(stream, self.capacity, prefilled=True)
        out.update(
            belady_hit_rate=per_access,
            belady_unique_hit_rate=per_distinct,
            window_hit_rate=window["hits"] / max(1, window["accesses"]),
            window_unique_hit_rate=1 - window["unique_misses"] / max(1, window["unique_accesses"]),
            window_accesses=window["accesses"],
            belady_window=[self._window_first, self._window_first + len(stream)],  # training batches
        )
        return out


def _same(out):
    return out


def _head_and_tail(message: str, head: int = 200, tail: int = 800) -> str:
    """A long error's first and last characters: inductor's errors name the kernel first and
    say what failed last, after a subprocess's traceback."""
    return message if len(message) <= head + tail else f"{message[:head]} [...] {message[-tail:]}"


class _StreamRecorder:
    """The rows of the training batches in the Belady window, kept for the bound.

    One buffer made at build (pinned host memory on CUDA, int32: the planner's rows fit) takes
    every recorded batch, copied on a stream of its own: a recorded step allocates no pinned
    memory (a fresh pinned buffer a step cost ~2.8 ms of an H100 step: results/2026-11-28-h100)
    and the training stream never waits for the copy. Not in the strategy's memory footprint:
    it is the benchmark's instrument, not the cache's.
    """

    def __init__(self, steps: int, max_ids: int, device: torch.device):
        self.cuda = device.type == "cuda"
        self.buffer = torch.empty(steps, max_ids, dtype=torch.int32, pin_memory=self.cuda)
        self.lengths: list[int] = []
        self._stream = torch.cuda.Stream(device) if self.cuda else None

    def record(self, rows: Tensor) -> None:
        """Queue a copy of one batch's rows (after the work queued so far on the current stream)."""
        target = self.buffer[len(self.lengths), : len(rows)]
        if self.cuda:
            self._stream.wait_stream(torch.cuda.current_stream(rows.device))
            with torch.cuda.stream(self._stream):
                target.copy_(rows, non_blocking=True)
            rows.record_stream(self._stream)
        else:
            target.copy_(rows)
        self.lengths.append(len(rows))

    def stream(self) -> list[Tensor]:
        """The recorded batches' rows (waits for the copies)."""
        if self.cuda:
            self._stream.synchronize()
        return [self.buffer[i, :n].long() for i, n in enumerate(self.lengths)]


def store_order(store_layout: str, num_rows: int, profiled: list[np.ndarray], table_starts: list[int],
                samples: list[np.ndarray] | None = None, rows_per_page: int = 1, cached: int = 0) -> RowOrder | None:
    """Where ``store: file`` places each row (``store_layout``; None: in id order), from the
    profiled batches' rows (``coaccess``: and each one's sample, the rows a page holds and the
    rows the device caches): the build and the preflight place them alike."""
    if store_layout == "frequency":
        return RowOrder.by_frequency(num_rows, profiled)
    if store_layout == "table_frequency":
        return RowOrder.by_table_frequency(num_rows, profiled, table_starts)
    if store_layout == "coaccess":
        return RowOrder.by_coaccess(num_rows, profiled, samples or [], rows_per_page, cached)
    return None


def batch_blocks(profiled: Iterable[np.ndarray], layout: PageLayout, order: RowOrder | None = None) -> int:
    """The most blocks of a row file one batch touches, its rows placed by ``order``: the profiled
    batches' most, and a quarter more for batches beyond the profile."""
    place = order.place if order is not None else (lambda rows: rows)
    touched = max((len(np.unique(place(rows) // layout.rows_per_page)) for rows in profiled), default=1)
    return math.ceil(1.25 * touched)


class FreqCacheStrategy(Strategy):
    name = "freqcache"
    summary = "frequency-aware software cache: host tables, the hottest rows (and their optimizer state) on the device"
    Params = FreqCacheParams
    row_precisions = ROW_PRECISIONS

    def estimate_memory(self, tables, optimizer, world_size, local_batch_size=None, train_steps=None,
                        row_precision="fp32", train_batches=None):
        n = sum(t.num_rows for t in tables)
        row_bytes = row_type(row_precision).row_bytes(tables[0].dim, optimizer.state_width)
        n = n // world_size  # per rank, roughly: placement is by table
        cached = max(1, math.ceil(self.params.cache_ratio * n))
        device = cached * (row_bytes + DevicePlanner.SLOT_BYTES)
        if local_batch_size is not None:
            # The slots staging two batches, and the look-ahead window at its largest: a batch's
            # ids (8 bytes a pair) for each batch ahead (see DevicePlanner.nbytes).
            max_ids = local_batch_size * sum(t.bag_size for t in tables)
            device += 2 * min(max_ids, n) * (row_bytes + DevicePlanner.SLOT_BYTES)
            ahead, rows = cache_window([], n, cached, max_ids, row_bytes, self.params.lookahead, train_steps)
            pairs = (ahead + 1) * rows
            if self.params.lookahead == "auto":  # a profile of fewer distinct rows a batch looks further
                longest = min(AUTO_LOOKAHEAD[1], train_steps if train_steps is not None else AUTO_LOOKAHEAD[1])
                pairs = min(max(auto_window_pairs(n, cached, max_ids, row_bytes), (AUTO_LOOKAHEAD[0] + 1) * max_ids),
                            (longest + 1) * max_ids)
            device += pairs * 8 if self.params.prefetch else 0
        if self.params.store == "file":  # host memory holds dram_ratio of the file's pages, and a map of them
            layout = PageLayout(n, row_bytes)
            blocks = math.ceil(layout.pages / layout.pages_per_row)
            refusal = None
            if train_batches is not None and world_size == 1:  # the profile the build sizes host memory by
                space = RowSpace(tables)
                features = [batch.sparse for batch in train_batches(self.params.profile_batches)]
                profiled = [space.global_rows(f).numpy() for f in features]
                samples = [f.sample_of_each_id().numpy() for f in features] \
                    if self.params.store_layout == "coaccess" else None
                order = store_order(self.params.store_layout, n, profiled, space.starts.tolist(), samples,
                                    layout.rows_per_page, cached)
                refusal = host_memory_problem(layout, self.params.dram_ratio, batch_blocks(profiled, layout, order))
            # a layout's map: 8 bytes a row it moves. frequency: the rows used twice or more in the
            # profile, and as many rows they displace: at most one per profiled id. coaccess: the
            # profile's rows, as many they displace, and fewer gaps than those rows: three per id.
            moves_per_id = {"id": 0, "coaccess": 3}.get(self.params.store_layout, 1)
            moved = 0 if local_batch_size is None else \
                min(n, moves_per_id * self.params.profile_batches * local_batch_size * sum(t.bag_size for t in tables))
            ids = 0 if local_batch_size is None else local_batch_size * sum(t.bag_size for t in tables)
            moves_device, moves_host = FileMoves.footprint(blocks, moved, ids, row_bytes)  # the moves' map and ring
            return MemoryFootprint(device_bytes=device + moves_device,
                                   host_bytes=math.ceil(self.params.dram_ratio * layout.file_bytes) + blocks * 8
                                   + moved * 8 + moves_host, disk_bytes=layout.file_bytes, disk_dir=self.params.store_dir,
                                   scratch_bytes=_PROBE_FILE_BYTES if self.params.drive_probe_s else 0, refusal=refusal)
        return MemoryFootprint(device_bytes=device, host_bytes=(n + 1) * row_bytes)

    def build(self, ctx: BuildContext) -> SparseModule:
        if ctx.env.world_size == 1:
            return FreqCache(ctx, self.params)
        # Each rank owns and caches whole tables, sized by the same ratio of its rows.
        return TableWiseSharded(ctx, lambda local: FreqCache(local, self.params))
