"""How long each cell of a scenario would take on this machine (``embbench run --dry-run``).

A cell's time is its start-up, its build and its steps::

    start-up + build + trained x (step + batch) + eval x (step / 2 + batch) + 3 x batch

``trained`` is every training step a cell takes (the longest warm-up, ``repeats`` x ``steps``
timed, the counted steps after them, the untimed steps that count operators), ``eval`` the held-out batches (forward only:
half a step), ``batch`` the time to make one global batch (untimed in the run, but on the
clock of the cell), and the 3 batches the generator's own rate is measured on.

The step comes from the best source there is, and says which:

- ``run <dir>``: the same cell (strategy, parameters, ranks, row precision) of the same shape
  (data, model, optimizer, device and threads) measured on this host before: its median step,
  its batch-making rate, its build and, where the record holds its wall time, its start-up;
- ``calibrated``: the dense model's forward, backward and optimizer step and plain
  embedding-bag lookups with their update, timed here at the cell's local batch and threads
  (a floor: the strategy's own work, a cache's bookkeeping say, is not in it);
- ``rough``: where timing that would take more than :data:`CALIBRATION_BUDGET_S`, a floor from
  the dense model's flops and the lookups' bytes at this machine's measured matmul rate and
  copy bandwidth (batch making not counted).

Without a record, the build is the bytes the cell's ranks allocate (the memory preflight's
estimate) filled at this machine's measured initial-weights rate on every usable core, and the
start-up an assumed :data:`START_UP_S`. Ranks that outnumber the usable cores share them: on
a CPU, a calibrated step is stretched by ranks x threads / usable cores (a record already
holds that contention).
"""

from __future__ import annotations

import functools
import json
import socket
import statistics
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import torch

from embbench.data import NUM_DENSE_FEATURES, Stream, TableSpec
from embbench.data.sources import eval_batches
from embbench.data.weights import initial_weights
from embbench.model import build_model
from embbench.noise import usable_cores
from embbench.results import Record, RecordError, load_records
from embbench.scenario import OPS_STEPS, Cell, Scenario

__all__ = ["CALIBRATION_BUDGET_S", "LONG_RUN_S", "START_UP_S", "CellTime", "StepCost", "cell_times",
           "at_least", "duration", "earlier_records", "fill_rate", "is_too_long", "over_limit"]

#: Seconds a cell takes besides its build and steps where no record says (an assumption, from
#: the smoke scenario's cells on a 2-core machine: processes, data source, model, record).
START_UP_S = {"cpu": 3.0, "cuda": 20.0}
#: The most a calibration may spend timing steps; beyond it, the rough floor.
CALIBRATION_BUDGET_S = 2.0
#: A scenario that would run longer than this gets a --steps suggestion beside its --scale.
LONG_RUN_S = 3600.0
#: An evaluation batch is a forward pass: this share of a training step.
EVAL_SHARE = 0.5
#: Batches the runner makes outside the steps to measure the generator's rate.
GENERATOR_BATCHES = 3
#: Record keys of the run section that change a step's time (the others are counts and limits).
_SHAPE_RUN_KEYS = ("device", "threads", "dense_precision", "deterministic", "sparse_backward")
#: Rows of each table a calibration looks up (ids taken modulo it): the lookup cost is per id.
_CALIBRATION_ROWS = 1 << 14


@dataclass(frozen=True)
class StepCost:
    """What one step of a cell costs, and where the numbers come from."""

    step_s: float  # one training step, every rank's contention included
    batch_s: float  # making one global batch (0: not counted)
    source: str  # "run <dir>", "calibrated" or "rough"
    detail: str  # what the source is, for the line under the table
    build_s: float | None = None  # measured build, or None: modelled from the fill rate
    start_up_s: float | None = None  # measured start-up, or None: assumed


@dataclass(frozen=True)
class CellTime:
    cell_id: str
    seconds: float
    start_up_s: float
    build_s: float
    steps_s: float
    source: str
    detail: str

    @property
    def floor(self) -> bool:
        """Whether the estimate is a lower bound (calibrated or rough: the strategy's own work left out)."""
        return not self.source.startswith("run ")


def at_least(times: list[CellTime]) -> str:
    """``"≥ "`` where any of ``times`` is a floor, for the figure that follows."""
    return "≥ " if any(t.floor for t in times) else ""


def duration(seconds: float) -> str:
    """``42 s``, ``3 min 5 s``, ``2 h 10 min``; ``over 100 days`` beyond (or not finite)."""
    if not seconds < 100 * 86400:
        return "over 100 days"
    seconds = max(0.0, seconds)
    if seconds < 60:
        return f"{seconds:.0f} s" if seconds >= 10 else f"{seconds:.1f} s"
    if seconds < 3600:
        return f"{int(seconds // 60)} min {int(seconds % 60)} s"
    return f"{int(seconds // 3600)} h {int(seconds % 3600 // 60)} min"


# --- earlier records ------------------------------------------------------------------------------


def _same_shape(record: Record, config: dict, smaller: bool = False) -> bool:
    """Whether ``record`` ran ``config``'s shape (``smaller``: the same but at a smaller ``data.scale``)."""
    theirs = record.scenario.get("config") or {}
    data, mine = dict(theirs.get("data") or {}), dict(config["data"])
    if smaller:
        if not (isinstance(data.get("scale"), (int, float)) and data["scale"] < mine["scale"]):
            return False
        data["scale"] = mine["scale"]
    return (data == mine and all(theirs.get(k) == config[k] for k in ("model", "optimizer"))
            and all((theirs.get("run") or {}).get(k) == config["run"][k] for k in _SHAPE_RUN_KEYS))


def earlier_records(scenario: Scenario, directories: list[Path], device: torch.device,
                    smaller: bool = False) -> dict[str, tuple[Record, Path]]:
    """The newest ``ok`` record of each cell id in ``directories`` (run directories) measured on
    this host, on this kind of device, with this scenario's shape; with its directory.
    ``smaller``: of the same shape at a smaller scale instead, the largest such scale."""
    config, host = scenario.model_dump(mode="json"), socket.gethostname()
    found: dict[str, tuple[Record, Path]] = {}

    def rank(record: Record) -> tuple:
        return ((record.scenario["config"]["data"]["scale"],) if smaller else ()) + (record.provenance.get("date", ""),)

    for directory in directories:
        try:
            records = load_records(directory, on_damaged=lambda e: None)
        except (FileNotFoundError, RecordError):
            continue
        for record in records:
            if (record.status != "ok" or record.provenance.get("host") != host
                    or not record.metrics["device"].startswith(device.type) or not _same_shape(record, config, smaller)):
                continue
            best = found.get(record.cell_id)
            if best is None or rank(record) > rank(best[0]):
                found[record.cell_id] = (record, directory)
    return found


#: A recorded step or batch beyond this (a day) is no measurement to build an estimate on.
_ABSURD_S = 86400.0


def _from_record(record: Record, directory: Path) -> StepCost | None:
    """The step cost a record measured; None where its figures are absurd (a step of 1e308 s, a
    generator of 1e-300 samples a second: the record's other figures say nothing either)."""
    m = record.metrics
    step = m["step_time_s"].get("median_of_repeats", m["step_time_s"]["median"])
    batch = m["samples_per_step"] / m["generator_samples_per_s"] if m.get("generator_samples_per_s") else 0.0
    if not (step < _ABSURD_S and batch < _ABSURD_S and m.get("build_seconds", 0) < _ABSURD_S * 30
            and m.get("cell_seconds", 0) < _ABSURD_S * 30):
        return None
    start_up = None
    if "cell_seconds" in m and "build_seconds" in m:
        evaluated = (m.get("accuracy") or {}).get("eval_samples", 0) // m["samples_per_step"]
        trained = m.get("trained_steps", m.get("warmup_steps_run", m["warmup_steps"]) + m["measured_steps"] + OPS_STEPS)
        steps = _steps_seconds(step, batch, trained, evaluated)
        start_up = max(0.0, m["cell_seconds"] - m["build_seconds"] - steps)
    when = record.provenance.get("date", "an unknown date")[:10]
    return StepCost(step, batch, f"run {directory.name}",
                    f"the same cells and shape recorded in {directory} on this host, {when}", m.get("build_seconds"), start_up)


def _at_least_as_slow(cost: StepCost, record: Record, directory: Path) -> StepCost:
    """``cost`` raised to the step, batch, build and start-up of the same cell recorded here on
    smaller tables (a floor: larger tables are no faster), named so where that record decides."""
    measured = _from_record(record, directory)
    if measured is None or measured.step_s <= cost.step_s:
        return cost
    scale = record.scenario["config"]["data"]["scale"]
    return StepCost(measured.step_s, max(cost.batch_s, measured.batch_s), f"scaled up from {measured.source}",
                    f"the same cell recorded in {directory} on this host at --scale {scale:g}: a floor, larger "
                    "tables are no faster", measured.build_s, measured.start_up_s)


# --- this machine's rates -------------------------------------------------------------------------


def _timed(work: Callable[[], object], device: torch.device) -> float:
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    work()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return time.perf_counter() - start


@functools.cache
def fill_rate(dim: int) -> float:
    """Bytes of initial weights one core makes per second here (the best of 3 chunks of at most
    4 MiB: a huge dim must not allocate a huge chunk)."""
    table = TableSpec("t", 4096, max(1, min(dim, 256)), 1, 1.0)
    dim = table.dim
    with _threads(1):
        seconds = min(_timed(lambda: initial_weights(table, 0, 0, 0, table.num_rows), torch.device("cpu"))
                      for _ in range(3))
    return table.num_rows * dim * 4 / seconds


class _threads:
    """Intra-op threads for a block, as a cell's rank runs with them."""

    def __init__(self, n: int):
        self.n = n

    def __enter__(self):
        self.before = torch.get_num_threads()
        torch.set_num_threads(self.n)

    def __exit__(self, *exc):
        torch.set_num_threads(self.before)


def _local_features(scenario: Scenario, world_size: int, device: torch.device):
    """A global batch from the scenario's source, rank 0's share, and the seconds making it took
    (the second batch's: the first one sets the source up)."""
    source = scenario.data_source(torch.device("cpu"))
    source.batch(Stream.TRAIN, 0, scenario.data.batch_size)
    start = time.perf_counter()
    batch = source.batch(Stream.TRAIN, 1, scenario.data.batch_size)
    made = time.perf_counter() - start
    local = batch.shard(0, world_size)
    return local.dense.to(device), local.sparse.to(device), local.labels.to(device), made


@functools.cache
def _machine_rates(threads: int) -> tuple[float, float]:
    """(matmul flop/s, copy bytes/s) of this CPU at ``threads`` threads: the rough floor's rates."""
    a, big = torch.rand(512, 512), torch.empty(16 << 20, dtype=torch.uint8)
    with _threads(threads):
        a @ a
        flops = 2 * 512**3 / min(_timed(lambda: a @ a, torch.device("cpu")) for _ in range(3))
        copy = 2 * big.numel() / min(_timed(big.clone, torch.device("cpu")) for _ in range(3))
    return flops, copy


def _rough_step(scenario: Scenario, tables: list[TableSpec], local_batch: int, threads: int) -> float:
    """Seconds of one step from flops and bytes: the dense model's forward and backward (3x the
    forward's multiply-adds, and the interaction's), and each looked-up row read, its gradient
    written and its weights updated (4 passes)."""
    dim = tables[0].dim
    with torch.device("meta"):  # shapes only: a huge --embedding-dim allocates nothing here
        model = build_model(scenario.model, NUM_DENSE_FEATURES, len(tables), dim)
    linear = sum(p.numel() for name, p in model.named_parameters() if name.endswith("weight"))
    interaction = (len(tables) + 1) ** 2 * dim
    flops = 3 * 2 * (linear + interaction) * local_batch
    ids = sum(t.bag_size for t in tables) * local_batch
    flop_rate, copy_rate = _machine_rates(threads)
    return flops / flop_rate + 4 * ids * dim * 4 / copy_rate


def _calibrated_step(scenario: Scenario, tables: list[TableSpec], world_size: int, threads: int,
                     device: torch.device) -> tuple[float, float, tuple[float, float]]:
    """(step seconds, batch seconds, (fastest, slowest step)) of rank 0 at this batch, timed here:
    the dense model and its optimizer, and embedding-bag lookups into a small table updated with
    the embedding optimizer's learning rate (the median of up to 5 steps after one warm-up)."""
    dense, sparse, labels, made = _local_features(scenario, world_size, device)
    dim = tables[0].dim
    torch.manual_seed(0)
    model = build_model(scenario.model, NUM_DENSE_FEATURES, len(tables), dim).to(device)
    optimizer = scenario.optimizer.dense.build(model.parameters())
    weight = torch.rand(_CALIBRATION_ROWS, dim, device=device, requires_grad=True)
    ids, offsets, lr = sparse.values % _CALIBRATION_ROWS, sparse.offsets()[:-1], scenario.optimizer.embedding.lr
    loss_fn = torch.nn.BCEWithLogitsLoss()

    def step():
        pooled = torch.nn.functional.embedding_bag(ids, weight, offsets, mode="sum", sparse=True)
        optimizer.zero_grad()
        loss = loss_fn(model(dense, pooled.view(len(tables), sparse.batch_size, dim).transpose(0, 1)
                             .reshape(sparse.batch_size, -1)).squeeze(-1), labels)
        loss.backward()
        optimizer.step()
        with torch.no_grad():
            grad = weight.grad.coalesce()
            weight.index_add_(0, grad.indices()[0], grad.values(), alpha=-lr)
        weight.grad = None

    with _threads(threads):
        first = _timed(step, device)  # allocations, first-call work: not kept
        times = [_timed(step, device) for _ in range(max(1, min(5, int(CALIBRATION_BUDGET_S / max(first, 1e-6)) - 1)))]
    return statistics.median(times), made, (min(times), max(times))


# --- the estimate ---------------------------------------------------------------------------------


def _steps_seconds(step: float, batch: float, trained: int, evaluated: int) -> float:
    return trained * (step + batch) + evaluated * (EVAL_SHARE * step + batch) + GENERATOR_BATCHES * batch


def _contention(scenario: Scenario, world_size: int, device: torch.device) -> tuple[float, int]:
    """How much slower a step runs when ``world_size`` ranks share this CPU's usable cores
    (1 on a GPU: a rank each), and each rank's threads."""
    threads = scenario.run.threads_per_rank(world_size)
    if device.type == "cuda":
        return 1.0, threads
    return max(1.0, world_size * threads / usable_cores()[0]), threads


def _fresh_cost(scenario: Scenario, tables: list[TableSpec], world_size: int, device: torch.device,
                calibrations: dict) -> StepCost:
    """A step's cost without a record: calibrated here when that is quick, else rough."""
    stretch, threads = _contention(scenario, world_size, device)
    local = scenario.data.batch_size // world_size
    shared = f"{world_size} rank(s) x {threads} thread(s) on {usable_cores()[0]} usable core(s)" + (
        f": x{stretch:.1f}" if stretch > 1 else "")
    key = (_step_shape(scenario), world_size, threads, device.type)
    if key not in calibrations:
        rough = _rough_step(scenario, tables, local, threads) if device.type == "cpu" else 0.0
        # a warm-up and one timed step at least; the rough floor is optimistic (criteo_8gpu at scale
        # 0.2, 8 ranks on 2 cores: 0.49 s rough, 1.69 s timed), hence 4x
        if 2 * 4 * rough <= CALIBRATION_BUDGET_S:
            step, batch, (fastest, slowest) = _calibrated_step(scenario, tables, world_size, threads, device)
            # a shared machine's load can stretch a step many times over: say when it did meanwhile
            spread = (f"; its steps took {fastest * 1e3:.0f}-{slowest * 1e3:.0f} ms: this machine's load moves the "
                      "estimate that much" if slowest > 2 * fastest else "")
            calibrations[key] = StepCost(
                step * stretch, batch * stretch, "calibrated",
                f"dense model and plain lookups timed here at a local batch of {local} ({shared}); "
                f"the strategy's own work not included: a floor{spread}")
        else:
            calibrations[key] = StepCost(
                rough * stretch, 0.0, "rough",
                f"from the dense model's flops and the lookups' bytes at this CPU's measured matmul rate and copy "
                f"bandwidth, local batch {local} ({shared}); batch making not counted: a floor")
    return calibrations[key]


def _step_shape(scenario: Scenario) -> str:
    """What a calibrated or rough step depends on: the scenario's shape without the tables' sizes
    (``data.scale``) or the run's counts. Two estimates of one shape share one calibration, so
    that ``--scale`` (or ``--steps``) alone moves only what it changes: the build grows with the
    tables, and a busy moment of the machine cannot make smaller tables look slower."""
    config = scenario.model_dump(mode="json")
    return json.dumps([{**config["data"], "scale": None}, config["model"], config["optimizer"],
                       [config["run"][k] for k in _SHAPE_RUN_KEYS]], sort_keys=True)


#: Calibrated and rough steps of this process, by (:func:`_step_shape`, ranks, threads, device type).
_CALIBRATIONS: dict = {}


def cell_times(scenario: Scenario, cells: list[Cell], run_dirs: list[Path], device: torch.device,
               bytes_to_fill: Callable[[Cell], int | None]) -> list[CellTime]:
    """Each cell's estimated wall time here (:mod:`embbench.estimate`'s model).

    ``run_dirs``: run directories whose records of the same shape give measured steps;
    ``bytes_to_fill(cell)``: the bytes its ranks allocate and fill (None: the tables' bytes).
    """
    tables = scenario.tables()
    run = scenario.run
    trained = run.warmup_bound + run.repeats * run.steps + run.counted_steps + OPS_STEPS
    evaluated = eval_batches(scenario.data, run)
    earlier = earlier_records(scenario, run_dirs, device)
    smaller = earlier_records(scenario, run_dirs, device, smaller=True)
    times = []
    for cell in cells:
        cost = _from_record(*earlier[cell.id]) if cell.id in earlier else None
        measured = cost is not None  # here, on these tables (a record of absurd figures gives none)
        if cost is None:
            cost = _fresh_cost(scenario, tables, cell.world_size, device, _CALIBRATIONS)
            if cell.id in smaller:  # larger tables are no faster than the same cell measured on smaller ones
                cost = _at_least_as_slow(cost, *smaller[cell.id])
        build = cost.build_s
        if build is None or not measured:  # measured on smaller tables: at least its build
            filled = bytes_to_fill(cell)
            filled = sum(t.num_bytes for t in tables) if filled is None else filled
            build = max(build or 0.0, filled / (fill_rate(tables[0].dim) * usable_cores()[0]))
        start_up = START_UP_S["cuda" if device.type == "cuda" else "cpu"] if cost.start_up_s is None else cost.start_up_s
        steps = _steps_seconds(cost.step_s, cost.batch_s, trained, evaluated)
        times.append(CellTime(cell.id, start_up + build + steps, start_up, build, steps, cost.source, cost.detail))
    return times


def over_limit(times: list[CellTime], limit_s: float) -> list[CellTime]:
    """The cells whose estimate exceeds ``run.time_limit_s``: the run would stop them (timeout)."""
    return [t for t in times if t.seconds > limit_s]


def is_too_long(times: list[CellTime], limit_s: float) -> bool:
    """Whether a run of these cells needs fewer steps: longer than :data:`LONG_RUN_S` in all, or a cell past its limit."""
    return sum(t.seconds for t in times) > LONG_RUN_S or bool(over_limit(times, limit_s))

