"""One cell of the matrix on one rank, as a recipe: build, warm up, time, evaluate, record.

:func:`run_cell` reads top to bottom as those phases; each is a function below it, working
on a :class:`_Training` (the built model, its sparse module, the batches, the step counter).
``python -m embbench.runner SPEC.json`` is what :mod:`embbench.launch` starts, once per
rank, with torch.distributed's env:// variables set. Rank 0 writes the measurements to the
spec's ``result`` path; a rank that fails writes ``error.rank<r>.json`` beside it.

Longer than 600 lines because: the recipe is one story told top to bottom, its phases sharing
one private :class:`_Training`; split into files, a reader would follow one cell across them.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import sys
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from embbench import noise, owned
from embbench.data import NUM_DENSE_FEATURES, SparseFeatures, Stream, TableSpec
from embbench.data.sources import eval_batches
from embbench.data.weights import initial_weights
from embbench.device import resolve_device
from embbench.metrics import (OpCounter, StepTimer, auc_logloss, device_memory, instrument_costs, memory_tiers, miss_rate,
                              peak_rss_bytes, speed_figures, tiers_by_table, warmed_up)
from embbench.model import build_model
from embbench.outputs import atomic_write
from embbench.precision import effective_precision, scoped_to_the_cell, with_dense_precision
from embbench.results import EVAL_SCORES, WEIGHTS_NOT_SAVED
from embbench.row_precision import row_type
from embbench.scenario import OPS_STEPS, PROFILE_STEPS, Cell, RunConfig, Scenario
from embbench.stream import TrainingStream
from embbench.strategy import BuildContext, RuntimeEnv, Schedule, SparseModule, Unsupported

__all__ = ["Diverged", "StrategyOutputError", "run_cell"]

#: Warm-up watches the miss rate over windows of this many steps.
_WARMUP_WINDOW = 5


class Diverged(RuntimeError):
    """Training produced a non-finite loss: recorded as status ``diverged``."""


class StrategyOutputError(RuntimeError):
    """A strategy's sparse module returned something other than its contract: pooled
    embeddings (a float32 tensor ``[local batch, tables * dim]`` on the compute device), or
    flushed tables (one float32 ``[rows, dim]`` per table)."""


@scoped_to_the_cell  # run.dense_precision's matmul mode (tf32) for the whole cell
def run_cell(scenario: Scenario, cell: Cell, env: RuntimeEnv, weights_path: Path | None = None,
             process_group: Any = None, schedule: Schedule | None = None, progress: str | None = None,
             profile_path: Path | None = None, work_dir: Path | None = None) -> dict[str, Any]:
    """Train and measure one cell on this rank; returns rank-local measurements.

    Args:
        schedule: train in this batching order instead of the data's own (or the strategy's
            proposal): lets a test train ``device`` on another strategy's schedule.
        progress: a file for the launcher to follow the phase and step (rank 0 writes it).
        profile_path: write a torch.profiler Chrome trace of a few extra steps here.
        work_dir: the cell's own folder for the strategy's files (``BuildContext.work_dir``).
    """
    report = _Progress(progress, env.rank)
    with training_stream(env.device):
        training = _build(scenario, cell, env, process_group, schedule, profile_path is not None, report, work_dir)
        warmup = _warm_up(training, report)
        generator_rate = _generator_rate(training)
        timing = _time_steps(training, report)
        counted = _counted_steps(training, report)
        ops = _count_ops(training)
        profile = _profile(training, profile_path) if profile_path is not None else None
        _catch_up(training, warmup, report)
        accuracy = _evaluate(training, report)
        weights = _save_weights(training, weights_path)
        return _record(training, warmup, timing, counted, generator_rate, ops, profile, accuracy, weights)


def training_stream(device: torch.device):
    """The cell's own stream on CUDA, of the highest priority the device has: where a
    strategy's side stream (made at the default, lowest priority) competes for the GPU, the
    kernels the training step waits for are scheduled first. Nothing on a CPU."""
    if device.type != "cuda":
        return contextlib.nullcontext()
    _, highest = torch.cuda.Stream.priority_range()  # (lowest, highest): lower numbers are higher
    return torch.cuda.stream(torch.cuda.Stream(device, priority=highest))


# --- build --------------------------------------------------------------------------------------


@dataclass
class _Training:
    """What a cell trains with once built, and its steps.

    ``step_index`` is the next training batch; :meth:`timed_step` trains it and moves on.
    """

    run: RunConfig
    env: RuntimeEnv
    process_group: Any
    strategy_name: str
    tables: list[TableSpec]
    global_batch: int
    data: Any
    stream: TrainingStream
    train_steps: int
    sparse: SparseModule
    build_seconds: float
    model: torch.nn.Module
    dense_optimizer: torch.optim.Optimizer
    loss_fn: torch.nn.Module = field(default_factory=torch.nn.BCEWithLogitsLoss)
    step_index: int = 0
    batch_cpu_seconds: float = 0.0
    #: every step's training loss, in order (device tensors: read once, at the end)
    losses: list[torch.Tensor] = field(default_factory=list)
    row_bytes: int = 0  # one row's weights, scale and optimizer state in the cell's row type
    eval_batches: int = 0  # run.eval_batches, at most those the held-out rows hold (each scored once)

    @property
    def device(self) -> torch.device:
        return self.env.device

    def pooled(self, features: SparseFeatures) -> torch.Tensor:
        """The sparse module's pooled embeddings of ``features``, checked against the contract,
        so that a strategy that breaks it is named rather than failing inside the model."""
        out = self.sparse(features)
        dim = self.tables[0].dim
        expected = [features.batch_size, len(self.tables) * dim]
        if not isinstance(out, torch.Tensor):
            got = f"a {type(out).__name__}, not a tensor"
        elif list(out.shape) != expected:
            got = str(list(out.shape))
        elif out.device.type != self.device.type:  # (cuda:1 on cuda:0 is torch's own error to raise)
            got = f"a tensor on {out.device}"
        elif out.dtype != torch.float32:  # embeddings stay fp32 (run.dense_precision is the dense model's)
            got = f"{out.dtype}"
        else:
            return out
        raise StrategyOutputError(f"strategy {self.strategy_name} returned {got}; expected float32 {expected} on "
                                  f"{self.device} (batch, tables x dim = {len(self.tables)} x {dim})")

    def flushed(self) -> list[torch.Tensor]:
        """The sparse module's trained tables, checked against the contract (one float32 tensor
        ``[rows, dim]`` per table, in order), so that a strategy that breaks it is named rather
        than compared wrongly (a short list would be zipped) or failing the whole run."""
        tables = self.sparse.flush()
        expected = [[t.num_rows, t.dim] for t in self.tables]
        if not isinstance(tables, (list, tuple)) or len(tables) != len(expected):
            got = f"{len(tables)} tables" if isinstance(tables, (list, tuple)) else f"a {type(tables).__name__}"
            raise StrategyOutputError(f"strategy {self.strategy_name}: flush() returned {got}; expected a list of "
                                      f"{len(expected)} (one per table)")
        for i, (t, shape) in enumerate(zip(tables, expected)):
            if not isinstance(t, torch.Tensor) or list(t.shape) != shape or t.dtype != torch.float32:
                got = f"a {type(t).__name__}" if not isinstance(t, torch.Tensor) else f"{t.dtype} {list(t.shape)}"
                raise StrategyOutputError(f"strategy {self.strategy_name}: flush() returned {got} for table {i}; "
                                          f"expected float32 {shape} (rows, dim)")
        return list(tables)

    def train_step(self) -> torch.Tensor:
        """One training step, everything a strategy does included; batches are made before."""
        stream, sparse, i = self.stream, self.sparse, self.step_index
        batch, upcoming = stream.get(i), stream.get(i + 1)
        ahead = [stream.get(j).sparse for j in range(i + 1, min(i + 1 + sparse.lookahead, self.train_steps + 1))]
        if ahead:
            sparse.look_ahead(ahead)
        pooled = self.pooled(batch.sparse)
        loss = self.loss_fn(self.model(batch.dense, pooled), batch.labels)
        # The next batch's prefetch once the dense forward is launched (as torchrec's prefetch
        # pipeline does): its launches never delay the forward's, and a strategy gates its side
        # stream on its own lookup, not on this.
        sparse.prefetch(upcoming.sparse)
        self.dense_optimizer.zero_grad(set_to_none=True)
        loss.backward()
        sparse.after_backward()
        self.dense_optimizer.step()
        sparse.end_step()
        return loss.detach()

    def prepare(self, steps: int = 1) -> None:
        """Make the batches of the next ``steps`` steps (and what they look ahead to) now."""
        for i in range(self.step_index, min(self.step_index + steps + 1 + self.sparse.lookahead, self.train_steps + 1)):
            self.stream.get(i)
        self.stream.release(self.step_index)

    def timed_step(self) -> tuple[float, torch.Tensor]:
        """Make this step's batches (untimed, where not made yet; the main thread's CPU time for
        it is added to ``batch_cpu_seconds``), then time the step."""
        made = time.thread_time()
        self.prepare()
        self.batch_cpu_seconds += time.thread_time() - made
        with StepTimer(self.device) as timer:
            loss = self.train_step()
        self.step_index += 1
        self.losses.append(loss)
        return timer.seconds, loss


def _build(scenario: Scenario, cell: Cell, env: RuntimeEnv, process_group: Any, schedule: Schedule | None,
           profile: bool, report: "_Progress", work_dir: Path | None = None) -> _Training:
    """The strategy's sparse module (timed), the dense model and its optimizer, the batches."""
    run, device = scenario.run, env.device
    tables = scenario.tables()
    global_batch = scenario.data.batch_size
    if global_batch % env.world_size:
        raise ValueError(f"data.batch_size {global_batch} does not divide by world size {env.world_size}")
    report("build", force=True)

    strategy = cell.make_strategy()
    reason = strategy.refusal(env, cell.row_precision)
    if reason:
        raise Unsupported(reason)

    # The training batches in the order they are trained: the data's, or a strategy's schedule.
    data = scenario.data_source(device)
    train_steps = run.training_batches_read(profile=profile) - 1
    stream = TrainingStream(data, global_batch, env.rank, env.world_size, num_batches=train_steps + 1)
    if schedule is not None:
        stream.set_schedule(schedule)
    else:
        stream.use_schedule(strategy, tables, run.seed)

    ctx = BuildContext(
        tables=tables, env=env, optimizer=scenario.optimizer.embedding, local_batch_size=global_batch // env.world_size,
        init_weights=lambda t, a, b: initial_weights(tables[t], t, run.seed, a, b),
        train_batches=lambda n: (stream.fresh(i) for i in range(n)),
        warmup_steps=run.warmup_steps, process_group=process_group, train_steps=train_steps,
        row_precision=cell.row_precision, seed=run.seed, sparse_backward=run.sparse_backward, work_dir=work_dir,
    )
    build_start = time.perf_counter()
    sparse = strategy.build(ctx)
    build_seconds = time.perf_counter() - build_start
    torch.manual_seed(run.seed)  # the same dense initial weights for every strategy
    model = build_model(scenario.model, NUM_DENSE_FEATURES, len(tables), tables[0].dim).to(device)
    model = with_dense_precision(model, run.dense_precision, device)  # bf16: autocast around the dense forward
    if env.world_size > 1:
        model = torch.nn.parallel.DistributedDataParallel(model, process_group=process_group)
    dense_optimizer = scenario.optimizer.dense.build(model.parameters())
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    return _Training(run, env, process_group, cell.strategy, tables, global_batch, data, stream, train_steps, sparse,
                     build_seconds, model, dense_optimizer,
                     row_bytes=row_type(cell.row_precision).row_bytes(tables[0].dim, ctx.optimizer.state_width),
                     eval_batches=eval_batches(scenario.data, run))


# --- warm up ------------------------------------------------------------------------------------


@dataclass
class _WarmUp:
    steps_run: int
    miss_rates: list[float | None]
    #: device slots the cache had not filled when timing started (None: not a cache that says)
    empty_slots: int | None = None
    #: whether the miss rate was steady when timing started (None: no miss rate to watch)
    steady: bool | None = None


def _warm_up(training: _Training, report: "_Progress") -> _WarmUp:
    """``warmup_steps`` steps, then (up to ``run.warmup_bound``, by default as many steps as are
    timed) on until the cache is steady: at the end of a window of ``_WARMUP_WINDOW`` steps,
    its miss rate is no lower than the window's before by more than 0.2 points
    (:func:`~embbench.metrics.warmed_up`) and its empty slots are none or no fewer than a
    window before (while they fill it loads without evicting or writing back: cheaper than its
    steady state). A strategy with no miss rate stops at the first window. Every rank stops
    at the same step; the record says whether the cache was steady and how many slots were
    empty when timing started (a cell timed while filling is flagged ``filling!``)."""
    run, sparse = training.run, training.sparse
    losses: list[torch.Tensor] = []
    window_rates: list[float | None] = []
    window_empty: list[int | None] = []
    sparse.set_counting("warmup")
    first = window_start = sparse.counters()
    while training.step_index < run.warmup_bound:
        step = training.step_index
        if step >= run.warmup_steps and step % _WARMUP_WINDOW == 0 and _steady(training, window_rates, window_empty):
            break
        report("warmup", step, run.warmup_bound)
        losses.append(training.timed_step()[1])
        if training.step_index % _WARMUP_WINDOW == 0:
            now = sparse.counters()
            window_rates.append(miss_rate(window_start, now))
            window_empty.append(sparse.empty_slots())
            window_start = now
    _check_finite(losses, 0)
    steady = None if miss_rate(first, sparse.counters()) is None else warmed_up(window_rates)
    return _WarmUp(training.step_index, window_rates, sparse.empty_slots(), steady)


def _steady(training: _Training, window_rates: list[float | None], window_empty: list[int | None]) -> bool:
    """Whether the warm-up may end here, on every rank (each sees its own tables): the miss
    rate is steady, and the empty slots are none or no fewer than a window before (rows that
    never come leave some empty at small scales)."""
    filling = len(window_empty) >= 1 and bool(window_empty[-1]) and (
        len(window_empty) < 2 or window_empty[-2] is None or window_empty[-1] < window_empty[-2])
    steady = warmed_up(window_rates) and not filling
    if training.process_group is None:
        return steady
    agreed = torch.tensor(int(steady), device=training.env.device)
    torch.distributed.all_reduce(agreed, op=torch.distributed.ReduceOp.MIN, group=training.process_group)
    return bool(agreed)


# --- time ---------------------------------------------------------------------------------------


def _generator_rate(training: _Training) -> float:
    """Samples per second of the data source alone, warm, outside any timed step: visibly
    never the bottleneck. (It makes the batches the run is about to train: where a
    drifting source's state is.)"""
    with StepTimer(training.device) as t:
        for i in range(3):
            training.data.batch(Stream.TRAIN, training.step_index + i, training.global_batch)
    return 3 * training.global_batch / t.seconds


@dataclass
class _Timing:
    step_seconds: list[float]
    #: the training steps timed, [first, end)
    steps: tuple[int, int]
    #: microseconds this rank spent in collectives over them (a strategy that times its own), or None
    comm_us: int | None
    #: microseconds this rank's training thread spent in the strategy's calls over them (host_step_us), or None
    host_step_us: int | None
    #: this rank's CPU seconds (every thread) in its timed steps, the untimed batch-making excluded
    cpu_seconds: float
    #: the machine sampled at the start and the end of the timed steps (:func:`embbench.noise.sample`)
    machine: tuple[dict[str, Any], dict[str, Any]]
    #: this process's CPU seconds over that whole window (what the noise floor subtracts)
    window_cpu_seconds: float


def _time_steps(training: _Training, report: "_Progress") -> _Timing:
    """``repeats`` x ``steps`` timed steps, with the harness's instruments off (their counts come
    from :func:`_counted_steps`).

    Each repeat's batches are made before it, untimed, and the main thread's CPU time for making
    batches is taken out of the cell's CPU time, so that it holds every thread's work on the steps
    (a strategy's own threads included). The intra-op threads that help make a batch are not
    taken out: their share is the same for every strategy of a scenario.
    """
    run = training.run
    first_step = training.step_index
    training.sparse.set_counting("off")
    counters_before = training.sparse.counters()  # (read between steps: times, not instruments, are wanted here)
    step_seconds: list[float] = []
    losses: list[torch.Tensor] = []
    gpu = noise.gpu_id(training.device)
    start = noise.sample(gpu)
    batch_cpu_before = training.batch_cpu_seconds
    for repeat in range(run.repeats):
        made = time.thread_time()
        training.prepare(run.steps)
        training.batch_cpu_seconds += time.thread_time() - made
        for k in range(run.steps):
            report("measure", repeat * run.steps + k, run.repeats * run.steps)
            seconds, loss = training.timed_step()
            step_seconds.append(seconds)
            losses.append(loss)
        _check_finite(losses[-run.steps:], first_step + repeat * run.steps)
    end = noise.sample(gpu)
    window_cpu = end["process_cpu_s"] - start["process_cpu_s"]
    making_batches = training.batch_cpu_seconds - batch_cpu_before
    timed = _sum_counters(counters_before, training.sparse.counters())
    return _Timing(step_seconds, (first_step, training.step_index), timed.get("comm_us"), timed.get("host_step_us"),
                   max(0.0, window_cpu - making_batches),
                   (start, end), window_cpu)


@dataclass
class _Counted:
    #: the training steps counted, [first, end)
    steps: tuple[int, int]
    step_seconds: list[float]
    counters: dict[str, int]


def _counted_steps(training: _Training, report: "_Progress") -> _Counted:
    """``run.steps`` steps right after the timed ones with every instrument on: the strategy's
    counters over them (the record's ``counters``), and their step times, which less the timed
    steps' are what the instruments cost (``metrics.instruments``). Every cell runs them, so that
    every cell of a scenario trains the same batches."""
    sparse, steps = training.sparse, training.run.counted_steps
    training.prepare(steps)
    sparse.set_counting("counted")
    first_step, before = training.step_index, sparse.counters()
    step_seconds = []
    for k in range(steps):
        report("count", k, steps)
        step_seconds.append(training.timed_step()[0])
    counters = _sum_counters(before, sparse.counters())
    sparse.set_counting("off")
    _check_finite(training.losses[-steps:], first_step)
    return _Counted((first_step, training.step_index), step_seconds, counters)


def _count_ops(training: _Training) -> OpCounter:
    """Extra untimed steps: how many operators (and, on CUDA, host waits) one step issues.
    (Batches are made before, so that only the steps are watched.)"""
    training.prepare(OPS_STEPS)
    with OpCounter(training.device) as ops:
        for _ in range(OPS_STEPS):
            training.timed_step()
    return ops


def _catch_up(training: _Training, warmup: _WarmUp, report: "_Progress") -> None:
    """Untimed steps up to the longest warm-up a cell may run, so that every cell of a scenario
    has trained the same batches when it is evaluated: a cache that warmed up longer would
    otherwise be compared after more training (its accuracy and weights against the baseline's)."""
    missing = training.run.warmup_bound - warmup.steps_run
    if missing > 0:
        report("catch-up", 0, missing, force=True)
        training.prepare(missing)
        for _ in range(missing):
            training.timed_step()
        _check_finite(training.losses[-missing:], training.step_index - missing)


def _profile(training: _Training, path: Path, top: int = 15) -> dict[str, Any]:
    """A few untimed steps under torch.profiler: a Chrome trace at ``path`` and the operators
    that took the most time on the host and on the device."""
    from torch.profiler import ProfilerActivity, profile

    device = training.device
    training.prepare(PROFILE_STEPS)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        for _ in range(PROFILE_STEPS):
            training.timed_step()
    path.parent.mkdir(parents=True, exist_ok=True)
    prof.export_chrome_trace(str(path))
    events = prof.key_averages()

    def device_us(e) -> float:
        return float(getattr(e, "self_device_time_total", getattr(e, "self_cuda_time_total", 0.0)))

    def rows(key) -> list[dict[str, Any]]:
        ranked = sorted(events, key=key, reverse=True)[:top]
        return [{"op": e.key, "calls": e.count / PROFILE_STEPS, "self_cpu_us": e.self_cpu_time_total / PROFILE_STEPS,
                 "self_device_us": device_us(e) / PROFILE_STEPS} for e in ranked if key(e) > 0]

    return {"trace": path.name, "steps": PROFILE_STEPS, "top_host": rows(lambda e: e.self_cpu_time_total),
            "top_device": rows(device_us) if device.type == "cuda" else []}


# --- evaluate -----------------------------------------------------------------------------------


def _evaluate(training: _Training, report: "_Progress") -> dict[str, Any]:
    """The last training losses (the same batches in every cell: :func:`_catch_up`), and AUC and
    log loss on a held-out stream, never seen by training or frequency statistics."""
    run, env, group = training.run, training.env, training.process_group
    report("eval", 0, training.eval_batches, force=True)
    training.model.eval()
    logits, labels = [], []
    with torch.no_grad():
        for i in range(training.eval_batches):
            batch = training.data.batch(Stream.EVAL, i, training.global_batch).shard(env.rank, env.world_size)
            logits.append(training.model(batch.dense, training.pooled(batch.sparse)))
            labels.append(batch.labels)
    accuracy: dict[str, Any] = {"train_loss_last10": float(torch.stack(training.losses[-10:]).mean()),
                                **_loss_course(training.losses)}
    if logits:
        all_logits, all_labels = torch.cat(logits), torch.cat(labels)
        if env.world_size > 1:
            all_logits, all_labels = _gather(all_logits, group), _gather(all_labels, group)
        _check_finite_values({"the evaluation logits": all_logits})
        auc, logloss, no_auc = auc_logloss(all_logits, all_labels)
        accuracy.update(auc=auc, logloss=logloss, eval_samples=all_labels.numel(), **({"auc_missing": no_auc} if no_auc else {}))
        if auc is not None:
            accuracy.update(_auc_noise(all_logits, all_labels))
        if env.rank == 0:  # the launcher moves them into the run's eval/ folder (EVAL_SCORES)
            accuracy[EVAL_SCORES] = {"scores": all_logits.float().cpu().flatten().tolist(),
                                     "labels": all_labels.cpu().flatten().int().tolist()}
    return accuracy


def _auc_noise(logits: torch.Tensor, labels: torch.Tensor) -> dict[str, float]:
    """The AUC's standard error over the evaluation samples (DeLong), where scipy is installed
    and both labels occur twice or more (one sample of a label has no variance to estimate)."""
    from embbench.optional import MissingDependency
    from embbench.stats import auc_standard_error

    try:
        error = auc_standard_error(labels.cpu().flatten().numpy(), logits.float().cpu().flatten().numpy())
    except MissingDependency:
        return {}
    return {"auc_standard_error": error} if math.isfinite(error) else {}


def _loss_course(losses: list[torch.Tensor]) -> dict[str, Any]:
    """The first training loss and the highest, with its step: a peak far above the first says
    the optimizer overshot (:func:`embbench.metrics.unstable_training`)."""
    if not losses:
        return {}
    course = torch.stack(losses).float().cpu()
    peak = int(course.argmax())
    return {"train_loss_first": float(course[0]), "train_loss_peak": float(course[peak]), "train_loss_peak_step": peak}


def _save_weights(training: _Training, path: Path | None) -> dict[str, Any]:
    """The trained weights, flushed to full tables and saved by rank 0 (for the baseline
    comparison): the record's ``weights_file`` (None when not asked), and where the file
    cannot be written (a full disk), ``weights_not_compared`` saying why: it costs the
    comparison, never the measurement."""
    if path is None:
        return {"weights_file": None}
    flushed = training.flushed()
    _check_finite_values({f"the trained weights of table {i}": t for i, t in enumerate(flushed)})
    if training.env.rank != 0:
        return {"weights_file": None}
    data = io.BytesIO()
    torch.save(flushed, data)  # in memory first: torch's writer turns a short write into "unexpected pos N vs M"
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(path, lambda f: f.write(data.getbuffer()))  # whole or not at all: no half file to compare
    except OSError as e:
        return {"weights_file": None, "weights_not_compared": f"{WEIGHTS_NOT_SAVED} to {path}: {e.strerror}"}
    return {"weights_file": path.name}


# --- record -------------------------------------------------------------------------------------


def _record(training: _Training, warmup: _WarmUp, timing: _Timing, counted: _Counted, generator_rate: float, ops: OpCounter,
            profile: dict[str, Any] | None, accuracy: dict[str, Any], weights: dict[str, Any]) -> dict[str, Any]:
    """The cell's measurements: this rank's, combined with the other ranks' where they differ."""
    run, env, device, sparse = training.run, training.env, training.device, training.sparse
    footprint = sparse.memory()
    this_rank = {
        "rank": env.rank,
        "memory": {
            "static_device_bytes": footprint.device_bytes,
            "static_host_bytes": footprint.host_bytes,
            "pinned_bytes": footprint.pinned_bytes,
            "peak_rss_bytes": peak_rss_bytes(),
            **device_memory(device),
        },
        "counters": counted.counters,
        # the projection's communication time: of the timed steps, as its step time is
        **({} if timing.comm_us is None else {"timed_comm_us": timing.comm_us}),
        **({} if timing.host_step_us is None else {"timed_host_step_us": timing.host_step_us}),
        # the time of the steps the counters cover, on this rank (the projection subtracts them)
        "measured_seconds": sum(timing.step_seconds),
        "cpu_seconds": timing.cpu_seconds,
        "window_cpu_seconds": timing.window_cpu_seconds,
        "pid": os.getpid(),
        "extra": sparse.extra_metrics(),
    }
    ranks = _gather_objects(this_rank, env, training.process_group)
    total = {k: sum(r["counters"].get(k, 0) for r in ranks) for k in ranks[0]["counters"]}
    measured_steps = run.steps * run.repeats
    counted_steps = counted.steps[1] - counted.steps[0]
    data, global_batch = training.data, training.global_batch
    step_time, throughput = speed_figures(timing.step_seconds, run.steps, global_batch)
    own_cpu = sum(r["window_cpu_seconds"] for r in ranks)
    machine = noise.noise_floor(*timing.machine, own_cpu, {r["pid"] for r in ranks})
    return {
        "device": str(device),
        "world_size": env.world_size,
        "samples_per_step": global_batch,
        "measured_steps": measured_steps,
        "warmup_steps": run.warmup_steps,
        "warmup_steps_run": warmup.steps_run,
        # every step trained before the evaluation: the same for every cell of a scenario (_catch_up)
        "trained_steps": training.step_index,
        "warmup_miss_rates": warmup.miss_rates,
        **({} if warmup.empty_slots is None else {"empty_slots_at_timing": warmup.empty_slots}),
        **({} if warmup.steady is None else {"warmup_steady": warmup.steady}),
        "build_seconds": training.build_seconds,
        "step_time_s": step_time,
        "throughput": throughput,
        "threads": torch.get_num_threads(),
        "usable_cores": noise.usable_cores()[0],
        # every thread's CPU time in the timed steps, per step: summed over ranks, as throughput is
        "cpu_seconds_per_step": sum(r["cpu_seconds"] for r in ranks) / measured_steps,
        "noise": machine,
        "generator_samples_per_s": generator_rate,
        # whether the data source replays its batches from a CUDA graph (None: it does not say)
        "generator_cuda_graph": data.uses_cuda_graph(global_batch) if hasattr(data, "uses_cuda_graph") else None,
        "ops_per_step": ops.ops / OPS_STEPS,
        "host_syncs_per_step": None if ops.host_syncs is None else ops.host_syncs / OPS_STEPS,
        # the training thread's time in the strategy's calls, a timed step (the busiest rank's)
        **({"host_step_us_per_step": max(r["timed_host_step_us"] for r in ranks) / measured_steps}
           if all("timed_host_step_us" in r for r in ranks) else {}),
        "schedule": "strategy" if training.stream.scheduled else "data",
        "dense_precision": training.run.dense_precision,
        "dense_precision_effective": effective_precision(training.run.dense_precision, training.device),
        "row_bytes": training.row_bytes,
        "profile": profile,
        # what must fit on each device: the largest rank; and what the job holds in all
        "memory": {**_combine(ranks, max), "sum": _combine(ranks, sum)},
        "accuracy": accuracy,
        "counters": {
            "total": total,
            "per_step": {k: v / counted_steps for k, v in total.items()},
            "steps": list(counted.steps),
            **_derived_rates(total),
        },
        "instruments": instrument_costs(sparse.instruments(), timing.steps, timing.step_seconds, counted.steps,
                                        counted.step_seconds),
        "extra": _combine_extra([r["extra"] for r in ranks]),
        **({"tiers": tiers} if (tiers := memory_tiers(total, counted_steps, training.row_bytes)) else {}),
        **({"tiers_by_table": by_table} if (by_table := tiers_by_table(total, counted_steps, training.row_bytes)) else {}),
        "per_rank": [{**r, **_derived_rates(r["counters"])} for r in ranks] if env.world_size > 1 else None,
        **weights,
    }


# --- helpers ------------------------------------------------------------------------------------


def _sum_counters(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    return {k: after[k] - before.get(k, 0) for k in after}


def _derived_rates(c: dict[str, int]) -> dict[str, float | None]:
    def ratio(a: str, b: str) -> float | None:
        return c[a] / c[b] if c.get(b) and a in c else None

    return {"hit_rate": ratio("hits", "accesses"),
            "unique_hit_rate": (1 - c["unique_misses"] / c["unique_accesses"]) if c.get("unique_accesses") and "unique_misses" in c else None}


class _Progress:
    """Writes the cell's phase and step to a small JSON file the launcher polls (at most
    every 0.2 s, atomically); nothing when no file is given or on ranks other than 0."""

    def __init__(self, path: str | None, rank: int):
        self.path = Path(path) if path and rank == 0 else None
        self._last, self._phase = 0.0, ""

    def __call__(self, phase: str, step: int = 0, total: int = 0, force: bool = False) -> None:
        now = time.monotonic()
        if self.path is None or (not force and phase == self._phase and now - self._last < 0.2):
            return
        self._last, self._phase = now, phase
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps({"phase": phase, "step": step, "total": total}))
        os.replace(tmp, self.path)


def _check_finite(losses: list[torch.Tensor], first_step: int) -> None:
    """Raise :class:`Diverged` naming the first step whose loss is not finite (one host read)."""
    if not losses:
        return
    finite = torch.isfinite(torch.stack(losses)).cpu()
    if not bool(finite.all()):
        bad = int((~finite).nonzero()[0, 0])
        raise Diverged(f"the training loss is not finite at step {first_step + bad} "
                       f"({float(losses[bad])}); training diverged")


def _check_finite_values(named: dict[str, torch.Tensor]) -> None:
    """Raise :class:`Diverged` if a value is not finite (training can blow the weights up
    while the loss stays finite, or poison rows that no later batch reads)."""
    for name, t in named.items():
        bad = int((~torch.isfinite(t)).sum())
        if bad:
            raise Diverged(f"{name} hold {bad} non-finite value(s) after training; training diverged")


def _gather_objects(obj: dict, env: RuntimeEnv, group: Any) -> list[dict]:
    if env.world_size == 1:
        return [obj]
    out: list[Any] = [None] * env.world_size
    dist.all_gather_object(out, obj, group=group)
    return out


def _combine(ranks: list[dict], how) -> dict[str, int | None]:
    keys = ranks[0]["memory"]
    return {k: None if ranks[0]["memory"][k] is None else how(r["memory"][k] for r in ranks) for k in keys}


def _combine_extra(extras: list[dict]) -> dict:
    """Rank 0's extra metrics; a cache bound over all ranks, weighted by their accesses."""
    combined = dict(extras[0])
    if len(extras) > 1 and all("belady_hit_rate" in e and e.get("window_accesses") for e in extras):
        accesses = sum(e["window_accesses"] for e in extras)
        for key in ("belady_hit_rate", "window_hit_rate"):
            combined[key] = sum(e[key] * e["window_accesses"] for e in extras) / accesses
        combined["window_accesses"] = accesses
    return combined


def _gather(t: torch.Tensor, group: Any) -> torch.Tensor:
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    dist.all_gather(parts, t.contiguous(), group=group)
    return torch.cat(parts)


def _classify(exc: BaseException) -> str:
    if isinstance(exc, Unsupported):
        return "unsupported"
    if isinstance(exc, Diverged):
        return "diverged"
    # CUDA's OOM, Python's, and the CPU allocator's ("DefaultCPUAllocator: can't allocate memory")
    if isinstance(exc, (torch.OutOfMemoryError, MemoryError)) or any(
            words in str(exc).lower() for words in ("out of memory", "can't allocate memory")):
        return "oom"
    return "error"


def _die_with_the_launcher(scratch: Path) -> None:
    """Exit (removing the cell's scratch directory) as soon as the launcher is gone.

    The ranks run in their own session, so a killed harness (SIGKILL included) would leave
    them running, and a hung one would live forever. A thread watches the parent pid: when
    the launcher dies the rank is re-parented, and ``os._exit`` ends it from any thread.
    """
    import shutil
    import threading

    launcher = int(os.environ.get("EMBBENCH_LAUNCHER_PID", os.getppid()))

    def watch() -> None:
        while os.getppid() == launcher:
            time.sleep(0.2)
        if os.environ.get(owned.CLAIMS_ENV):  # the row files this cell made outside its scratch
            owned.remove_claimed(Path(os.environ[owned.CLAIMS_ENV]), owned.run_id())
        shutil.rmtree(scratch, ignore_errors=True)
        os._exit(1)

    threading.Thread(target=watch, name="embbench-launcher-watch", daemon=True).start()


def main(spec_path: str) -> int:
    """Entry point of one rank (see :mod:`embbench.launch`)."""
    from embbench.scenario import parse_scenario

    _die_with_the_launcher(Path(spec_path).parent)
    spec = json.loads(Path(spec_path).read_text())
    rank = int(os.environ.get("RANK", 0))
    world = int(os.environ.get("WORLD_SIZE", 1))
    local_rank = int(os.environ.get("LOCAL_RANK", rank))
    result_path = Path(spec["result"])
    group = None
    try:
        scenario, _ = parse_scenario(spec["scenario"], spec["scenario_file"])
        cell = Cell(spec["cell"]["strategy"], spec["cell"]["params"], spec["cell"]["world_size"],
                    spec["cell"].get("row_precision", "fp32"))
        device = resolve_device(scenario.run.device, local_rank)
        if world > 1:
            if device.type == "cuda":
                torch.cuda.set_device(device)
            dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=rank, world_size=world)
            group = dist.group.WORLD
        torch.set_num_threads(scenario.run.threads_per_rank(world))
        env = RuntimeEnv(device=device, world_size=world, rank=rank)
        weights = Path(spec["weights"]) if spec.get("weights") else None
        profile = Path(spec["profile"]) if spec.get("profile") else None
        metrics = run_cell(scenario, cell, env, weights, group, progress=spec.get("progress"), profile_path=profile,
                           work_dir=Path(spec["work_dir"]) if spec.get("work_dir") else None)
        if rank == 0:
            tmp = result_path.with_suffix(".tmp")
            tmp.write_text(json.dumps(metrics))
            os.replace(tmp, result_path)
        code = 0
    except BaseException as exc:  # recorded for the launcher, then a non-zero exit
        (result_path.parent / f"error.rank{rank}.json").write_text(json.dumps({
            "status": _classify(exc), "type": type(exc).__name__, "message": str(exc),
            "traceback": traceback.format_exc(), "time": time.time(),
        }))
        traceback.print_exc()
        code = 1
    finally:
        if group is not None and dist.is_initialized() and code == 0:
            dist.barrier(group=group)  # no rank tears down while another still talks
            dist.destroy_process_group()
    return code


if __name__ == "__main__":
    code = main(sys.argv[1])
    sys.stdout.flush()
    sys.stderr.flush()
    # Skip interpreter teardown: gloo's threads can abort it ("terminate called without an
    # active exception") after everything is written, which would read as a crashed rank.
    os._exit(code)
