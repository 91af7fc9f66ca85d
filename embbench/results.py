"""The result record of one cell and its JSON store (its provenance: :mod:`embbench.provenance`).

A run directory holds one ``<cell>.json`` per cell, written atomically as soon as the cell
ends, so an interrupted run keeps what finished. Records carry a schema version.

Longer than 600 lines because: the record's schema is one tree of TypedDicts that every command
reads (its fields, bounds and validators side by side), beside the store that writes and reads it.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import math
import os
from pathlib import Path
from typing import Annotated, Any, Callable, Iterator, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, ValidationError, model_validator
from pydantic_core import PydanticCustomError
from typing_extensions import NotRequired, TypedDict  # pydantic needs typing_extensions' TypedDict before Python 3.12

from embbench.bounds import Bytes, Count, Finite, NonNegative, Positive, PositiveCount, Rate, Threads
from embbench.inputs import not_regular, open_schema as _open, read_json, schema_error, validated
from embbench.outputs import atomic_write

__all__ = ["FAILED_STATUSES", "SCHEMA_VERSION", "TIMED_INSTRUMENT_SHARE", "Instrument", "Metrics", "Record", "RecordError",
           "Status", "by_scenario", "load_records", "read_record", "run_directory_lock",
           "scenario_differences", "schema_error", "write_record"]

SCHEMA_VERSION = 1
#: ``skipped``: never started, the memory preflight said it would not fit (``oom``: it ran, and ran out)
Status = Literal["ok", "unsupported", "skipped", "error", "oom", "timeout", "diverged"]
#: The statuses of a cell that started (or should have) and failed: ``run`` exits non-zero on any.
#: ``unsupported`` (this machine or strategy cannot) and ``skipped`` (the memory preflight said it
#: cannot fit) are answers about the machine, not failures.
FAILED_STATUSES = ("error", "oom", "timeout", "diverged")

# The measured figures (Finite, Count, ...): strict (a string or a bool is not a number) and
# finite, the bounds a scenario's fields share (embbench.bounds).


def _ordered_interval(ci: tuple[float, float] | None) -> tuple[float, float] | None:
    if ci is not None and ci[0] > ci[1]:
        raise PydanticCustomError("interval", "low end {low} above high end {high}", {"low": ci[0], "high": ci[1]})
    return ci


# Every part of a record is open to keys it does not know (a newer embbench may add some); the
# keys it declares are checked. NotRequired: a key older records may lack, or one only some
# strategies or runs write; the readers treat its absence as "not measured".


@_open
class StepTimes(TypedDict):
    """Seconds per measured step (:func:`embbench.metrics.summarize`)."""

    n: PositiveCount
    min: Positive
    max: Positive
    mean: Positive
    median: Positive
    p95: Positive
    stddev: NonNegative
    iqr: NonNegative
    samples: Annotated[list[Positive], Field(min_length=1)]
    #: each repeat's median step (records before repeats were the unit lack these three)
    repeat_medians: NotRequired[Annotated[list[Positive], Field(min_length=1)]]
    #: the cell's step time: the median of the repeat medians
    median_of_repeats: NotRequired[Positive]
    #: its 95% interval, t on the log scale of the repeat medians; None: one repeat, or no scipy
    ci95: NotRequired[Annotated[tuple[Positive, Positive] | None, AfterValidator(_ordered_interval)]]


@_open
class Throughput(TypedDict):
    """Samples per second over all ranks: the global batch over the median of the repeat medians
    (``median``), per repeat, and its interval; records made before repeats were the unit hold
    the mean of per-repeat throughputs (``mean``) and a t interval of it instead."""

    unit: NotRequired[str]
    statistic: NotRequired[str]
    per_repeat: Annotated[list[Positive], Field(min_length=1)]
    median: NotRequired[Positive]
    mean: NotRequired[Positive]
    #: the 95% interval [low, high]; None: fewer than two repeats, or no scipy
    ci95: Annotated[tuple[Finite, Finite] | None, AfterValidator(_ordered_interval)]
    ci95_missing: NotRequired[str]  # why there is no interval (scipy missing)


@_open
class MemoryFigures(TypedDict):
    """Bytes of one rank (or of all ranks: ``Memory.sum``); peaks are None where not measured (CPU)."""

    static_device_bytes: Bytes
    static_host_bytes: Bytes
    pinned_bytes: Bytes
    peak_rss_bytes: NotRequired[Bytes | None]
    peak_allocated_bytes: NotRequired[Bytes | None]
    peak_reserved_bytes: NotRequired[Bytes | None]


@_open
class Memory(MemoryFigures):
    """The largest rank's figures, and (``sum``) all ranks' together; without ``sum``, one rank."""

    sum: NotRequired[MemoryFigures]


@_open
class Accuracy(TypedDict):
    train_loss_last10: NotRequired[NonNegative]
    auc: NotRequired[Rate | None]
    auc_missing: NotRequired[str]  # why auc is None (one class only: undefined)
    logloss: NotRequired[NonNegative | None]
    eval_samples: NotRequired[Count]
    auc_standard_error: NotRequired[NonNegative]  # over the evaluation samples (DeLong)
    eval_file: NotRequired[str]  # each sample's score and label, in the run's eval/ folder
    # the training loss's course: its first value, and its highest with the step (absent in older records)
    train_loss_first: NotRequired[NonNegative]
    train_loss_peak: NotRequired[NonNegative]
    train_loss_peak_step: NotRequired[Count]


@_open
class Counters(TypedDict):
    """The strategy's counters over the counted steps (``steps``, [first, end); older records: the measured
    steps) in total and per step, and the hit rates derived from them (None: the strategy counts no hits)."""

    total: dict[str, NonNegative]
    per_step: NotRequired[dict[str, NonNegative]]
    steps: NotRequired[Annotated[tuple[Count, Count], AfterValidator(_ordered_interval)]]
    hit_rate: NotRequired[Rate | None]
    unique_hit_rate: NotRequired[Rate | None]


@_open
class Extra(TypedDict):
    """A strategy's own figures; those the tables read are checked."""

    belady_hit_rate: NotRequired[Rate | None]
    belady_unique_hit_rate: NotRequired[Rate | None]
    window_hit_rate: NotRequired[Rate | None]
    window_unique_hit_rate: NotRequired[Rate | None]
    capacity_rows: NotRequired[Count | None]


@_open
class Instrument(TypedDict):
    """A harness instrument of a cell, the steps it ran in and its cost (:func:`embbench.metrics.instrument_costs`)."""

    name: str
    what: str
    steps: Annotated[tuple[Count, Count], AfterValidator(_ordered_interval)]
    timed: bool
    counted_step_s: NotRequired[Positive]
    cost_s_per_step: NotRequired[Finite]
    cost_share: NotRequired[Finite]


TIMED_INSTRUMENT_SHARE = 0.01  # the most an instrument that runs in timed steps may cost of the step (issue 47)


@_open
class ProfiledOp(TypedDict):
    op: str
    calls: NonNegative
    self_cpu_us: NonNegative
    self_device_us: NonNegative


@_open
class Profile(TypedDict):
    trace: NotRequired[str]
    steps: NotRequired[PositiveCount]
    top_host: NotRequired[list[ProfiledOp]]
    top_device: NotRequired[list[ProfiledOp]]


@_open
class RankMetrics(TypedDict):
    """One rank of a multi-rank cell."""

    rank: Count
    memory: MemoryFigures
    counters: dict[str, NonNegative]
    measured_seconds: NotRequired[Positive]  # absent in records older than the projection's use of it
    timed_comm_us: NotRequired[NonNegative]  # its collectives' time in the timed steps (counters: the counted ones)
    timed_host_step_us: NotRequired[NonNegative]  # its training thread's time in the strategy's calls, timed steps
    extra: NotRequired[dict[str, Any]]
    hit_rate: NotRequired[Rate | None]
    unique_hit_rate: NotRequired[Rate | None]


@_open
class WeightDistance(TypedDict):
    max: NonNegative
    mean: NonNegative
    rows_trained: Count


@_open
class GpuSample(TypedDict):
    """One GPU at one end of the timed steps (:func:`embbench.noise.sample`)."""

    sm_clock_mhz: NotRequired[Finite]
    temperature_c: NotRequired[Finite]


@_open
class Noise(TypedDict):
    """The machine while the steps were timed (:func:`embbench.noise.noise_floor`): what the
    tables, ``compare`` and ``recommend`` read to flag a busy machine."""

    window_s: NotRequired[NonNegative]
    cores: NotRequired[PositiveCount]
    load_1min: NotRequired[list[NonNegative]]  # at the start and at the end
    mem_available_bytes: NotRequired[list[Bytes | None]]
    others_cpu_share: NotRequired[NonNegative | None]  # None: /proc/stat unreadable
    steal_share: NotRequired[NonNegative | None]
    gpu: NotRequired[list[GpuSample]]
    gpu_other_processes: NotRequired[Count]


@_open
class Tier(TypedDict):
    """One memory tier's figures (:func:`embbench.metrics.memory_tiers`): the shares served, its
    traffic a step with the tier below, and on the drive its I/Os and stalls (None: not counted)."""

    tier: Literal["hbm", "dram", "nvme"]
    hit_rate: Rate | None
    hit_rate_of_reaching: Rate | None
    hit_rate_per_access: NotRequired[Rate | None]
    reaching_per_step: NonNegative | None
    rows_read_per_step: NotRequired[NonNegative | None]
    bytes_read_per_step: NotRequired[NonNegative | None]
    rows_written_per_step: NotRequired[NonNegative | None]
    bytes_written_per_step: NotRequired[NonNegative | None]
    write_misses_per_step: NotRequired[NonNegative | None]
    pages_read_per_step: NotRequired[NonNegative | None]
    pages_written_per_step: NotRequired[NonNegative | None]
    ios_per_step: NotRequired[NonNegative | None]
    pages_read_on_demand_per_step: NotRequired[NonNegative | None]
    pages_read_for_writes_per_step: NotRequired[NonNegative | None]
    read_amplification: NotRequired[NonNegative | None]
    stall_seconds_per_step: NotRequired[NonNegative | None]
    reads_per_second: NotRequired[NonNegative | None]


def _one_of_each(tiers: list[dict] | None) -> list[dict] | None:
    names = [t["tier"] for t in tiers or []]
    if len(set(names)) != len(names):
        raise PydanticCustomError("tiers", "a tier listed twice: {names}", {"names": ", ".join(names)})
    return tiers


Tiers = Annotated[list[Tier], Field(min_length=1), AfterValidator(_one_of_each)]


@_open
class Metrics(TypedDict):
    """What an ``ok`` cell measured (:func:`embbench.runner.run_cell`)."""

    device: str
    world_size: PositiveCount
    samples_per_step: PositiveCount
    measured_steps: PositiveCount
    warmup_steps: Count
    warmup_steps_run: NotRequired[Count]  # absent before warm-up could run on: then warmup_steps
    trained_steps: NotRequired[PositiveCount]  # before the evaluation (absent in older records)
    warmup_miss_rates: NotRequired[list[Rate | None]]
    empty_slots_at_timing: NotRequired[Count]  # a cache's slots still empty when timing started (this rank)
    warmup_steady: NotRequired[bool]  # a cache's miss rate was steady when timing started (runner._warm_up)
    build_seconds: NotRequired[NonNegative]
    cell_seconds: NotRequired[NonNegative]  # the cell's wall time in the launcher, start-up to the last rank's end
    step_time_s: StepTimes
    throughput: Throughput
    threads: NotRequired[Threads]  # intra-op threads per rank (run.threads)
    usable_cores: NotRequired[PositiveCount]  # the cores the ranks could use (affinity, cgroup quota)
    cpu_seconds_per_step: NotRequired[NonNegative]  # every thread of every rank, in the timed steps
    noise: NotRequired[Noise]
    generator_samples_per_s: NotRequired[Positive]
    generator_cuda_graph: NotRequired[bool | None]
    ops_per_step: NotRequired[NonNegative]
    host_step_us_per_step: NotRequired[NonNegative]  # counters.host_step_us over the timed steps, per step
    host_syncs_per_step: NotRequired[NonNegative | None]  # None: not counted (CPU)
    schedule: NotRequired[str]
    # with run.deterministic: the operators that had no deterministic implementation (ran as they are)
    deterministic: NotRequired[dict[str, list[str]]]
    profile: NotRequired[Profile | None]
    memory: Memory
    accuracy: NotRequired[Accuracy]
    counters: Counters
    #: the harness's instruments (absent: records before they were named; [] none)
    instruments: NotRequired[list[Instrument]]
    extra: NotRequired[Extra]
    per_rank: NotRequired[Annotated[list[RankMetrics], Field(min_length=1)] | None]  # None: one rank
    weights_file: NotRequired[str | None]
    max_weight_diff_vs_baseline: NotRequired[NonNegative]
    weights_not_compared: NotRequired[str]  # why max_weight_diff_vs_baseline is absent
    #: a rounded cell's max |Δw| from the baseline's cell in its row precision (max_weight_diff_vs_baseline
    #: is from the baseline's first cell, its fp32 one where the run has it)
    max_weight_diff_vs_baseline_same_precision: NotRequired[NonNegative]
    weights_not_compared_same_precision: NotRequired[str]  # why max_weight_diff_vs_baseline_same_precision is absent
    # |this - the baseline's| for exact strategies that trained the same steps (launch._loss_diffs)
    train_loss_last10_diff_vs_baseline: NotRequired[NonNegative]
    logloss_diff_vs_baseline: NotRequired[NonNegative]
    row_bytes: NotRequired[PositiveCount]  # one row's weights, scale and optimizer state in the row type
    #: max and mean |Δw| from the same cell in fp32, over the rows that cell trained
    weight_diff_vs_fp32: NotRequired[WeightDistance]
    weights_not_compared_fp32: NotRequired[str]  # why weight_diff_vs_fp32 is absent
    tiers: NotRequired[Tiers]
    tiers_by_table: NotRequired[dict[str, Tiers]]  # each table's (freqcache), checked as the whole's


@_open
class ScenarioInfo(TypedDict):
    """The effective scenario a record was made with."""

    name: str
    digest: Annotated[str, Field(min_length=1)]
    file: NotRequired[str]
    config: NotRequired[dict[str, Any]]  # the scenario itself (``project`` and the what-differs messages read it)


@_open
class Devices(TypedDict):
    cpu: NotRequired[str | None]
    cpu_count: NotRequired[PositiveCount | None]
    gpus: NotRequired[list[dict[str, Any] | str]]  # older records hold the names alone


@_open
class Provenance(TypedDict):
    """Where, when and with what a record was made (:func:`embbench.provenance.provenance`); all of it optional,
    as records of older versions hold less."""

    date: NotRequired[str]
    command: NotRequired[str]
    host: NotRequired[str]
    git: NotRequired[dict[str, Any] | None]
    versions: NotRequired[dict[str, Any]]
    packages: NotRequired[dict[str, Any]]
    system: NotRequired[dict[str, Any]]
    devices: NotRequired[Devices]


def _record_error(key: str, message: str) -> PydanticCustomError:
    """An error of one field, raised from the record's own validator (pydantic would name only the record)."""
    return PydanticCustomError("record_field", "{key}: {message}", {"key": key, "message": message})


class Record(BaseModel):
    """One cell's result: the one schema of a record, checked when it is made (so a record that
    would not validate is never written) and when it is read (:func:`read_record`).

    ``metrics`` is what an ``ok`` cell measured and is None for every other status, whose
    ``message`` says why.
    """

    model_config = ConfigDict(extra="forbid")

    schema_version: int = SCHEMA_VERSION
    cell_id: str
    strategy: str
    params: dict[str, Any]
    world_size: PositiveCount
    #: the type the cell stored its rows in (``run.row_precision``); records before it: fp32
    row_precision: Literal["fp32", "fp16", "bf16", "fp8"] = "fp32"
    status: Status
    message: str | None = None
    #: ``exact``: weights comparable with the baseline's; ``reordered``: compare by accuracy.
    semantics: Literal["exact", "reordered"] = "exact"
    baseline: str
    scenario: ScenarioInfo
    metrics: Metrics | None = None
    provenance: Provenance

    @model_validator(mode="before")
    @classmethod
    def _standard_json(cls, data: Any) -> Any:
        """No NaN or infinity anywhere (JSON has none; Python's json reads and writes them)."""
        def check(value: Any, key: str) -> None:
            if isinstance(value, float) and not math.isfinite(value):
                raise _record_error(key, f"{value} is not a finite number")
            items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
            for k, v in items:
                check(v, f"{key}.{k}" if key else str(k))

        check(data, "")
        return data

    @model_validator(mode="after")
    def _consistent(self) -> "Record":
        from embbench.scenario import Cell

        expected = Cell(self.strategy, self.params, self.world_size, self.row_precision).id
        if self.cell_id != expected:
            raise _record_error("cell_id", f"{self.cell_id!r} does not match its strategy, params, world_size "
                                           "and row_precision "
                                           f"(which make {expected!r})")
        if self.status == "ok" and self.metrics is None:
            raise _record_error("metrics", "status ok without its measurements")
        if self.metrics is not None and not {"median", "mean"} & set(self.metrics["throughput"]):
            raise _record_error("metrics.throughput", "neither median nor mean")
        for i, tool in enumerate((self.metrics or {}).get("instruments") or []):  # timed: its cost, under 1 %
            if tool["timed"] and (tool.get("cost_share") is None or tool["cost_share"] >= TIMED_INSTRUMENT_SHARE):
                raise _record_error(f"metrics.instruments.{i}", f"{tool['name']} ran in timed steps " + (
                    "without its measured cost" if tool.get("cost_share") is None else
                    f"and cost {100 * tool['cost_share']:.1f} % of the step (at most {100 * TIMED_INSTRUMENT_SHARE:.0f} %)"))
        if self.status != "ok" and self.metrics is not None:
            raise _record_error("metrics", f"measurements in a record of status {self.status} (only ok has them)")
        if self.status != "ok" and not (self.message or "").strip():
            raise _record_error("message", f"status {self.status} without its reason")
        return self


def write_record(directory: Path, slug: str, record: Record) -> Path:
    """Write ``<slug>.json`` atomically (a reader never sees half a file), after checking the
    record against the schema once more (its metrics may have been added to since it was made).

    Raises:
        RecordError: the record does not validate; nothing is written.
        OSError: the directory cannot be written (disk full, read-only, ...); no partial
            file is left behind and an earlier record of the cell is kept.
    """
    try:
        text = Record.model_validate(record.model_dump()).model_dump_json(indent=2)
    except ValidationError as e:
        raise RecordError(f"{directory / slug}.json: not written: {schema_error(e)}") from None
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{slug}.json"
    other = _genuine_cell(path)
    if other is not None and other != record.cell_id:  # two cells, one name: never one over the other
        raise RecordError(f"{path}: holds the record of cell {other}; the record of {record.cell_id} would replace "
                          "it (two cells, one file name); not written")
    return atomic_write(path, lambda f: f.write(text.encode()))  # with the run's other files' permissions


def _genuine_cell(path: Path) -> str | None:
    """The cell id of the record at ``path`` if that file is its own (named after it), else None
    (no file, or damaged: its cell may take the name back)."""
    from embbench.scenario import cell_slug

    try:
        data = json.loads(path.read_bytes()) if path.is_file() else None
    except (OSError, ValueError, RecursionError):
        return None
    cell = data.get("cell_id") if isinstance(data, dict) else None
    return cell if isinstance(cell, str) and f"{cell_slug(cell)}.json" == path.name else None


#: The lock a run holds on its run directory; it names the holder's pid.
LOCK_FILE = ".embbench-run.lock"


@contextlib.contextmanager
def run_directory_lock(directory: Path) -> Iterator[None]:
    """Hold ``directory`` for this run: another run into it is refused at once.

    An OS lock (``flock``) on ``directory/.embbench-run.lock``, so a run that is killed, even
    by SIGKILL, leaves no stale lock (the kernel drops it with the process) and ``--resume``
    can follow; the file holds the pid of the run holding it.

    Raises:
        ValueError: another process holds the directory (naming it and the pid), or it
            cannot be locked.
    """
    path = directory / LOCK_FILE
    try:
        # Never through a link (it would truncate a file elsewhere); O_NONBLOCK: a FIFO put there opens at once.
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_NONBLOCK, 0o644)
    except OSError as e:
        kind = not_regular(path)
        raise ValueError(f"{path}: cannot create the run directory's lock: "
                         f"{kind + '; remove it' if kind else e.strerror}") from None
    try:
        kind = not_regular(path, os.fstat(fd).st_mode)
        if kind:
            raise ValueError(f"{path}: cannot lock the run directory: {kind}; remove it")
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
            raise ValueError(f"another run is writing to {directory}/ (pid {holder})") from None
        except OSError as e:  # a file system without locks
            raise ValueError(f"{path}: cannot lock the run directory: {e.strerror}") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        yield
    finally:
        os.close(fd)


class RecordError(ValueError):
    """A record file that cannot be used (damaged, foreign, incomplete); the message names it,
    and :func:`load_records` sets ``path`` (so a reader can tell which cell's file it was)."""

    path: Path | None = None


def read_record(path: Path) -> Record:
    """One record file, checked against the schema (:class:`Record`).

    Raises:
        RecordError: naming the file and what is wrong (unreadable, not JSON, not a record,
            another schema version, the first field that fails the schema, by its key path).
    """
    data = read_json(path, "result record", RecordError)  # a FIFO, a device, bytes that are not UTF-8 or JSON: named
    if data.get("schema_version") != SCHEMA_VERSION:
        raise RecordError(f"{path}: schema_version {data.get('schema_version')!r}, expected {SCHEMA_VERSION}")
    record = validated(Record, data, path, RecordError)
    from embbench.scenario import cell_slug

    if path.name != f"{cell_slug(record.cell_id)}.json":  # edited, or copied over another cell's file
        raise RecordError(f"{path}: holds the record of cell {record.cell_id}, whose file is "
                          f"{cell_slug(record.cell_id)}.json; a record belongs to its own file")
    return record


#: A run's cache curve (``embbench curve --out RUN/curve.json``), beside its records and not one.
RUN_CURVE = "curve.json"

#: The key of a rank's accuracy under which the runner hands the launcher each evaluation
#: sample's score and label; the launcher moves them into ``<run>/eval/<cell>.npz``
#: (:func:`write_eval_scores`) and the record keeps the file's name (``accuracy.eval_file``).
EVAL_SCORES = "eval_scores"
EVAL_DIR = "eval"
#: How ``metrics.weights_not_compared`` begins where the rank could not write the flushed weights
#: (a full disk): the launcher says it on the console too.
WEIGHTS_NOT_SAVED = "cannot save the flushed weights"


def load_records(paths: Path | list[Path], on_damaged: Callable[[RecordError], None] | None = None) -> list[Record]:
    """Every record of one or more run directories (or record files), each checked
    (:func:`read_record`); the one way records are read.

    A file given twice (a run named twice) is read once, and a cell recorded twice for the
    same scenario is kept once (the first file by name); the other copy is told to
    ``on_damaged`` when it differs.

    Args:
        on_damaged: called with the error of each file that cannot be used, which is then
            left out; None raises it.

    Raises:
        FileNotFoundError: nothing there, or no records in a directory.
        RecordError: a damaged record (without ``on_damaged``).
    """
    files: list[Path] = []
    for path in [paths] if isinstance(paths, Path) else paths:
        if path.is_dir():
            found = sorted(f for f in path.glob("*.json") if f.name != RUN_CURVE)
        elif path.exists():
            found = [path]
        else:
            raise FileNotFoundError(f"{path}: no result records here (no such run directory or record file)")
        if not found:
            raise FileNotFoundError(f"{path}: no result records (*.json) here")
        files += found
    records: dict[tuple[str, str], tuple[Record, Path]] = {}
    seen: set[Path] = set()
    for f in files:
        if f.resolve() in seen:
            continue
        seen.add(f.resolve())
        try:
            record = read_record(f)
            key = (record.cell_id, record.scenario["digest"])
            first, first_file = records.setdefault(key, (record, f))
            if first is not record and first != record:
                raise RecordError(f"{f}: holds {record.cell_id} of the same scenario as {first_file} "
                                  "and differs from it; left out (compare them with `embbench compare`)")
        except RecordError as e:
            e.path = f
            if on_damaged is None:
                raise
            on_damaged(e)
    return [record for record, _ in records.values()]


def _flatten(value: Any, prefix: str = "") -> dict[str, Any]:
    if isinstance(value, dict):
        return {k: v for key, inner in value.items() for k, v in _flatten(inner, f"{prefix}{key}.").items()}
    if isinstance(value, list):
        return {k: v for i, inner in enumerate(value) for k, v in _flatten(inner, f"{prefix}{i}.").items()} \
            or {prefix.rstrip("."): []}
    return {prefix.rstrip("."): value}


def scenario_differences(a: dict[str, Any], b: dict[str, Any], limit: int = 4) -> str:
    """What differs between two records' scenarios (``scenario`` of each), as
    ``key: a vs b; ...`` over their configs, or by digest where a record holds no config."""
    if not a.get("config") or not b.get("config"):
        return f"digest {a['digest'][:10]} vs {b['digest'][:10]} (a record holds no scenario config to say what differs)"
    left, right = _flatten(a["config"]), _flatten(b["config"])
    keys = sorted(k for k in set(left) | set(right) if left.get(k, "(none)") != right.get(k, "(none)"))
    if not keys:
        return f"digest {a['digest'][:10]} vs {b['digest'][:10]} (the configs agree: another embbench's digest?)"
    shown = [f"{k}: {left.get(k, '(none)')} vs {right.get(k, '(none)')}" for k in keys[:limit]]
    return "; ".join(shown) + (f"; and {len(keys) - limit} more" if len(keys) > limit else "")


def by_scenario(records: list[Record]) -> list[list[Record]]:
    """The records grouped by scenario digest, in the order each scenario first appears."""
    groups: dict[str, list[Record]] = {}
    for r in records:
        groups.setdefault(r.scenario["digest"], []).append(r)
    return list(groups.values())
