"""Runs the cells of a scenario, each in its own processes under a time limit.

A cell is ``world_size`` processes of :mod:`embbench.runner` (torch.distributed env://
variables set: one process per device, gloo on the CPU, NCCL on GPUs) in a new process
session. An exception, out-of-memory, a crash or a timeout becomes that cell's status; its
processes are reaped, its record is written at once, and the next cell runs.

On the CPU the processes are forked from one server that imported torch, fbgemm and torchrec
once for the whole run (multiprocessing's *forkserver*, started on the first cell, before any
thread of this process could be inherited): a cell starts in a fraction of a second instead of
paying the 4-5 s of those imports again. On CUDA each rank is a fresh interpreter, because a
process forked after CUDA's driver was initialised (importing fbgemm_gpu does it) cannot use it. Each rank is still a process of
its own, in a session of its own, with this process's environment and path at the time the
cell starts, so a crash or a timeout ends that cell only.

Longer than 600 lines because: a cell's life (preflight, processes, time limit, scratch folder,
record) is one sequence in :func:`run_cells` whose steps share :class:`CellOutcome` and the
run's state; the memory preflight (:func:`memory_preflight` and below) is the seam to cut next.
"""

from __future__ import annotations

import contextlib
import json
import math
import multiprocessing
import numbers
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch

from pydantic import ValidationError

from embbench import cell_process, owned
from embbench.data.cache import pid_alive
from embbench.noise import mem_available
from embbench.device import resolve_device
from embbench.provenance import provenance
from embbench.results import (EVAL_DIR, EVAL_SCORES, WEIGHTS_NOT_SAVED, Record, RecordError, Status, load_records,
                              read_record, scenario_differences, schema_error, write_record)
from embbench.eval_scores import write_eval_scores
from embbench.scenario import OPS_STEPS, PROFILE_STEPS, Cell, Scenario
from embbench.strategy import MemoryFootprint, RuntimeEnv, Unsupported, estimate_kwargs

__all__ = ["HOST_HEADROOM", "RANK_PROCESS_BYTES", "CellOutcome", "RecordsNotWritten", "max_ranks", "memory_preflight",
           "other_scenario", "rank_process_bytes", "reusable_records", "run_cells", "run_isolated", "scenario_info"]

#: How long the other ranks may live on after one rank failed (they may be stuck in a collective).
_PEER_GRACE_S = 10.0


@dataclass
class CellOutcome:
    status: Status
    message: str | None
    metrics: dict[str, Any] | None
    #: why a ``skipped`` cell was (:class:`Refusal`'s cause)
    cause: str | None = None


class Refusal(str):
    """The preflight's reason a cell cannot run here, and its ``cause``: ``memory`` or ``drive``
    (space: a smaller ``--scale`` may fit), ``store_dir`` (the folder itself) or ``shape`` (the
    strategy's own refusal of this shape, ``MemoryFootprint.refusal``): no smaller scale mends those."""

    cause: str

    def __new__(cls, text: str, cause: str) -> "Refusal":
        refusal = super().__new__(cls, text)
        refusal.cause = cause
        return refusal


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


#: What the cell server imports once, so that no cell pays for it.
_PRELOAD = ["torch", "fbgemm_gpu", "torchrec", "embbench.runner", "embbench.cell_process"]


_server_ready = False


def _cell_context() -> Any:
    """The forkserver context whose server has imported :data:`_PRELOAD`.

    The first call starts the server and waits until it has imported them (by forking one
    process that does nothing), so that no cell's time limit pays for the imports. The server's
    socket lives in multiprocessing's temporary directory, which the server removes as it exits
    (:mod:`embbench.cell_process`), also after this process was killed."""
    global _server_ready
    from multiprocessing import util

    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    if not _server_ready:
        # Only the server sees the directory's name (it inherits this environment as it starts);
        # the cells and the processes they start must not remove this process's directory.
        os.environ["EMBBENCH_CELL_SERVER_DIR"] = util.get_temp_dir()
        try:
            ready = ctx.Process(target=cell_process.close_alive_pipe, name="embbench-cell-server-ready")
            with _main_module_hidden():
                ready.start()
            ready.join()
        finally:
            del os.environ["EMBBENCH_CELL_SERVER_DIR"]
        _server_ready = True
    return ctx


def _cell_device(scenario: Scenario) -> torch.device:
    """The device a scenario's cells compute on (the CPU where CUDA is asked for and missing: such
    a cell never starts, its strategy or the device refuses it first)."""
    try:
        return resolve_device(scenario.run.device)
    except Unsupported:
        return torch.device("cpu")


class _Interpreter:
    """A rank as a fresh ``python -m embbench.runner`` in a session of its own (used on CUDA), with
    the few methods of a multiprocessing process the launcher uses."""

    def __init__(self, spec_path: Path, log: Path, env: dict[str, str]):
        with open(log, "w") as out:
            self._popen = subprocess.Popen([sys.executable, "-m", "embbench.runner", str(spec_path)], stdout=out,
                                           stderr=subprocess.STDOUT, env=env, start_new_session=True)
        self.pid = self._popen.pid

    @property
    def exitcode(self) -> int | None:
        return self._popen.poll()

    def join(self) -> None:
        self._popen.wait()


@contextlib.contextmanager
def _main_module_hidden():
    """While a process starts: multiprocessing would have it run this process's ``__main__``
    again (the ``embbench`` script, or ``-m embbench.cli``) to find names pickled there. A rank
    needs none (its target is :mod:`embbench.cell_process`'s), so it is not told of one: no
    second import of the command in every rank, and no rank that fails before its log opens."""
    main = sys.modules["__main__"]
    saved = {key: getattr(main, key) for key in ("__spec__", "__file__") if hasattr(main, key)}
    main.__spec__ = None
    if "__file__" in saved:
        del main.__file__
    try:
        yield
    finally:
        for key, value in saved.items():
            setattr(main, key, value)


def _kill(procs: list[Any]) -> None:
    """Kill the ranks and every process they started (each rank leads a session of its own):
    the session too of a rank that has ended, where a plugin's child may live on."""
    procs = [p for p in procs if p.pid is not None]  # one interrupted before it started has nothing to kill
    for p in procs:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):  # not yet in its own session, or nothing left in it
            if p.exitcode is None:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(p.pid, signal.SIGKILL)
    for p in procs:
        p.join()


def _tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def _poll_progress(path: Path, last: dict | None, on_progress: Callable[[str, int, int], None] | None) -> dict | None:
    """Pass the runner's latest phase and step on, when it changed."""
    if on_progress is None:
        return last
    try:
        now = json.loads(path.read_text())
    except (OSError, ValueError):
        return last
    if now != last:
        on_progress(now["phase"], now["step"], now["total"])
    return now


#: A cell's scratch folder under TMPDIR: ``embbench-cell-<pid of the launcher>-<random>``.
_SCRATCH = re.compile(r"embbench-cell-(\d+)-.+")


def remove_dead_scratch() -> None:
    """Remove the cells' scratch folders whose launcher has died without removing them (a
    SIGKILL), as the data cache removes the work folders of dead processes; a live
    launcher's folders are never touched."""
    for path in Path(tempfile.gettempdir()).glob("embbench-cell-*"):
        match = _SCRATCH.fullmatch(path.name)
        if match and path.is_dir() and not path.is_symlink() and not pid_alive(int(match.group(1))):
            shutil.rmtree(path, ignore_errors=True)


@contextlib.contextmanager
def _cell_work_dir(path: Path):
    """The cell's work folder, emptied first (a killed run's files go) and removed at the end
    (after the ranks are reaped: ``run_isolated`` kills them before leaving)."""
    shutil.rmtree(path, ignore_errors=True)
    path.mkdir(parents=True)
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)
        with contextlib.suppress(OSError):  # the run's work/ folder too, once no cell has a folder there
            path.parent.rmdir()


def _keep_eval_scores(metrics: dict[str, Any] | None, path: Path) -> None:
    """Move the evaluation's per-sample scores out of a cell's metrics into ``path`` (the record
    keeps the file's name: ``recommend`` compares AUCs on the same samples); a file that cannot
    be written costs that comparison only."""
    accuracy = (metrics or {}).get("accuracy") or {}
    scores = accuracy.pop(EVAL_SCORES, None)
    if scores is None:
        return
    try:
        write_eval_scores(path, scores["scores"], scores["labels"])
        accuracy["eval_file"] = path.name
    except OSError:
        pass


def run_isolated(scenario: Scenario, scenario_file: str, cell: Cell, log_dir: Path,
                 weights_path: Path | None = None, time_limit_s: float | None = None,
                 on_progress: Callable[[str, int, int], None] | None = None,
                 profile_path: Path | None = None, work_dir: Path | None = None) -> CellOutcome:
    """Run one cell in ``cell.world_size`` fresh processes and report how it ended.

    ``on_progress(phase, step, total)`` follows rank 0 through build, warmup, measure and eval;
    ``profile_path`` asks for a torch.profiler trace of a few extra steps there. ``work_dir``:
    the cell's own folder for its strategy's files (a row file), made empty here and removed
    when the cell ends, however it ends (default: inside its scratch folder).
    """
    limit = time_limit_s if time_limit_s is not None else scenario.run.time_limit_s
    log_dir.mkdir(parents=True, exist_ok=True)
    remove_dead_scratch()
    with tempfile.TemporaryDirectory(prefix=f"embbench-cell-{os.getpid()}-") as tmp, \
            _cell_work_dir(work_dir or Path(tmp) / "work") as work:  # the pid: see remove_dead_scratch
        tmp_dir = Path(tmp)
        spec = {
            "scenario": scenario.model_dump(mode="json"),
            "scenario_file": scenario_file,
            "cell": {"strategy": cell.strategy, "params": cell.params, "world_size": cell.world_size,
                     "row_precision": cell.row_precision},
            "result": str(tmp_dir / "result.json"),
            "weights": str(weights_path) if weights_path else None,
            "progress": str(tmp_dir / "progress.json"),
            "profile": str(profile_path) if profile_path else None,
            "work_dir": str(work),
        }
        spec_path = tmp_dir / "spec.json"
        claims = tmp_dir / "claims.txt"  # what the ranks make outside the cell's folders (embbench.owned)
        spec_path.write_text(json.dumps(spec))
        port = _free_port()
        procs: list[Any] = []
        logs = [log_dir / f"{cell.slug}.rank{rank}.log" for rank in range(cell.world_size)]
        # Forked from the cell server where the cell computes on the CPU. Not on CUDA: importing
        # fbgemm_gpu asks torch.cuda.is_available(), which initialises the driver in the server,
        # and a process forked after that cannot use CUDA; there each rank is a fresh interpreter.
        forked = _cell_device(scenario).type != "cuda"
        ctx = _cell_context() if forked else None  # before the clock: the first cell waits for the imports
        deadline = time.monotonic() + limit
        first_failure: float | None = None
        progress = None
        try:
            for rank, log in enumerate(logs):
                # EMBBENCH_LAUNCHER_PID is the rank's to set: its parent is the cell server, which
                # ends with this process (a rank whose parent is gone ends itself).
                env = {k: v for k, v in os.environ.items() if k != "EMBBENCH_LAUNCHER_PID"}
                env.update(RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(cell.world_size),
                           LOCAL_WORLD_SIZE=str(cell.world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                           PYTHONUNBUFFERED="1", **{owned.RUN_ENV: owned.run_id(), owned.CLAIMS_ENV: str(claims)})
                try:
                    if forked:
                        proc = ctx.Process(target=cell_process.rank_main, args=(str(spec_path), str(log), env, list(sys.path)),
                                           name=f"embbench-{cell.slug}-rank{rank}", daemon=False)
                        # listed before it starts: a Ctrl-C that lands inside start() must still
                        # kill it, or the exit would wait for it (multiprocessing joins its children)
                        procs.append(proc)
                        with _main_module_hidden():
                            proc.start()
                    else:
                        procs.append(_Interpreter(spec_path, log, dict(env, EMBBENCH_LAUNCHER_PID=str(os.getpid()))))
                except OSError as e:  # out of processes or memory: this cell fails, the run goes on
                    return CellOutcome("error", f"cannot start rank {rank}: {e}", None)
            while any(p.exitcode is None for p in procs):
                progress = _poll_progress(tmp_dir / "progress.json", progress, on_progress)
                now = time.monotonic()
                if now > deadline:
                    _kill(procs)
                    return CellOutcome("timeout", f"exceeded the time limit of {limit:g} s", None)
                if first_failure is None and any(p.exitcode not in (None, 0) for p in procs):
                    first_failure = now
                if first_failure is not None and now - first_failure > _PEER_GRACE_S:
                    break
                time.sleep(0.05)
            # How the ranks ended by themselves (those still running are killed below).
            ended = [(r, p.exitcode) for r, p in enumerate(procs) if p.exitcode not in (None, 0)]
        finally:
            _kill(procs)  # reaps everything, also on KeyboardInterrupt
            owned.remove_claimed(claims, owned.run_id())  # the files the ranks made outside work/ (a row file)
        _poll_progress(tmp_dir / "progress.json", progress, on_progress)  # the last phase reached
        errors = [(json.loads(p.read_text()), p.stem.removeprefix("error.rank")) for p in tmp_dir.glob("error.rank*.json")]
        if errors:
            # The first failure is the cause; the peers then fail in their collectives.
            error, rank = min(errors, key=lambda e: e[0]["time"])
            prefix = f"rank {rank}: " if cell.world_size > 1 else ""
            others = f" (then {len(errors) - 1} more rank(s) failed)" if len(errors) > 1 else ""
            return CellOutcome(error["status"], f"{prefix}{error['type']}: {error['message']}{others}", None)
        if ended:
            rank, code = ended[0]
            how = f"killed by signal {-code}" if code < 0 else f"exited with code {code}"
            if code == -signal.SIGKILL:  # not sent by us (that is a timeout): the OOM killer's signal
                return CellOutcome("oom", f"rank {rank} {how}, most likely by the kernel's OOM killer; log tail:\n"
                                          f"{_tail(logs[rank])}", None)
            return CellOutcome("error", f"rank {rank} {how}; log tail:\n{_tail(logs[rank])}", None)
        result = tmp_dir / "result.json"
        if not result.exists():
            return CellOutcome("error", "the run ended without a result", None)
        return CellOutcome("ok", None, json.loads(result.read_text()))


def _load_weights(path: Path) -> list[torch.Tensor]:
    """A flushed-weights file; :class:`RecordError` naming it when it is missing or damaged."""
    try:
        return torch.load(path, weights_only=True)
    except Exception as e:  # truncated zip, pickle garbage, missing file: all mean "damaged"
        raise RecordError(f"{path}: flushed weights missing or damaged ({type(e).__name__}: {e})") from None


def _max_weight_diff(a: Path, b: Path) -> float:
    left, right = _load_weights(a), _load_weights(b)
    shapes = [[list(t.shape) for t in w] if isinstance(w, list) and all(isinstance(t, torch.Tensor) for t in w) else None
              for w in (left, right)]
    if shapes[0] is None or shapes[0] != shapes[1]:  # a file of another scenario, or one not made by the runner
        raise RecordError(f"{a}: its tables differ in number or shape from the baseline's in {b}; not compared")
    return max(float((x - y).abs().max()) if x.numel() else 0.0 for x, y in zip(left, right))


def weight_distance(mine: Path, fp32: Path, initial: list[torch.Tensor]) -> dict[str, float | int]:
    """How far a cell's flushed weights are from the same cell's in fp32, over the rows the fp32
    cell trained (those that moved from ``initial``): untrained rows differ only by the
    rounding of their initial weights to the row type, which says nothing about training."""
    left, right = _load_weights(mine), _load_weights(fp32)
    largest, total, count, rows = 0.0, 0.0, 0, 0
    for x, y, start in zip(left, right, initial):
        trained = (y != start).any(1)
        diff = (x[trained] - y[trained]).abs()
        if diff.numel():
            largest, total = max(largest, float(diff.max())), total + float(diff.sum(dtype=torch.float64))
            count, rows = count + diff.numel(), rows + int(trained.sum())
    return {"max": largest, "mean": total / count if count else 0.0, "rows_trained": rows}


def _initial_tables(scenario: Scenario) -> list[torch.Tensor]:
    from embbench.data.weights import initial_weights

    tables = scenario.tables()
    return [initial_weights(t, i, scenario.run.seed, 0, t.num_rows) for i, t in enumerate(tables)]


def reusable_records(out_dir: Path, scenario: Scenario, weights_dir: Path | None,
                     on_notice: Callable[[str], None]) -> dict[str, Record]:
    """The ``ok`` records of an earlier run of this very scenario in ``out_dir``, by cell id.

    Not reused (the cell runs again), each told to ``on_notice``: a damaged record or
    weights file, a record of another effective scenario (other --steps, --scale or edits),
    and every record not ``ok`` (an ``unsupported`` may be supported now, e.g. under torchrun).
    """
    if not out_dir.is_dir():
        return {}
    digest = scenario.digest()
    done: dict[str, Record] = {}
    stale = []
    for path in sorted(out_dir.glob("*.json")):
        try:
            record = read_record(path)
            if record.scenario.get("digest") != digest:
                stale.append(path.name)
                continue
            if record.status != "ok":
                continue
            if weights_dir is not None and record.metrics.get("weights_file"):
                _load_weights(weights_dir / record.metrics["weights_file"])
        except RecordError as e:
            on_notice(f"{e}; that cell runs again")
            continue
        done[record.cell_id] = record
    if stale:
        on_notice(f"{out_dir}: {len(stale)} record(s) were made with another scenario (other --steps, --scale or "
                  f"edits; digest differs from {digest[:10]}): {', '.join(stale)}; those cells run again")
    return done


def scenario_info(scenario: Scenario, scenario_file: str) -> dict[str, Any]:
    """A record's ``scenario``: the effective scenario its cell ran with."""
    return {"name": scenario.name, "file": scenario_file, "digest": scenario.digest(),
            "config": scenario.model_dump(mode="json")}


def other_scenario(out_dir: Path, scenario: Scenario, scenario_file: str) -> str | None:
    """Why ``out_dir`` cannot take this scenario's records: it holds records of another
    effective scenario (other --steps, --scale or edits), named with both digests and what
    differs; None when it holds none (damaged records are left to ``--resume`` to rerun)."""
    if not out_dir.is_dir() or not any(out_dir.glob("*.json")):
        return None
    mine = scenario_info(scenario, scenario_file)
    others = [r for r in load_records(out_dir, on_damaged=lambda e: None) if r.scenario["digest"] != mine["digest"]]
    if not others:
        return None
    digests = sorted({r.scenario["digest"][:10] for r in others})
    return (f"--out {out_dir}: holds {len(others)} record(s) of another scenario (digest {', '.join(digests)}; this "
            f"run's is {mine['digest'][:10]}): {scenario_differences(others[0].scenario, mine)}. A run directory holds "
            "one scenario: give another --out, or move those records away")


def _new_record(**fields: Any) -> Record:
    """The record of a cell that just ran; measurements that fail the schema (a non-finite
    number, say) make it an ``error`` naming the field, never a record that cannot be read."""
    try:
        return Record(**fields)
    except ValidationError as e:
        return Record(**{**fields, "status": "error", "metrics": None,
                         "message": f"its measurements fail the record schema: {schema_error(e)}"})


class RecordsNotWritten(RuntimeError):
    """Some records could not be written (disk full, directory gone); ``records`` holds every
    cell's record, the files written before are kept."""

    def __init__(self, message: str, records: list[Record]):
        super().__init__(message)
        self.records = records


def _trained_steps(record: Record) -> int:
    """The steps a cell trained before its evaluation (older records: its warm-up and measured
    steps and the untimed ones after them, before cells caught up to the longest warm-up)."""
    m = record.metrics
    if "trained_steps" in m:
        return m["trained_steps"]
    return m.get("warmup_steps_run", m["warmup_steps"]) + m["measured_steps"] + OPS_STEPS + (PROFILE_STEPS if m.get("profile") else 0)


def _weights_comparable(record: Record, baseline: Record | None) -> str | None:
    """Why a record's flushed weights cannot be compared with the baseline's, or None."""
    if record.semantics != "exact":
        return "training order differs from the baseline's (semantics: reordered): compare AUC"
    if baseline is None:
        return "the baseline has no flushed weights"
    if _trained_steps(record) != _trained_steps(baseline):
        return f"trained {_trained_steps(record)} steps, the baseline {_trained_steps(baseline)} (warm-up until steady)"
    return None


def _same_precision_diff(record: Record, baseline: Record | None, baseline_name: str, weights_dir: Path) -> dict[str, Any]:
    """A rounded cell's max |Δw| from the baseline's cell in the same row precision (``baseline``,
    None where the run has none with flushed weights), or why there is none: an exact strategy
    in fp16 matches the baseline in fp16 bit for bit, while its ``max_weight_diff_vs_baseline``
    (from the fp32 baseline when the run has it) is rounding."""
    why_not = (f"no flushed weights of {baseline_name} in this run (not among its cells, or it did not end ok)"
               if baseline is None
               else _weights_comparable(record, baseline))
    if why_not is None:
        try:
            return {"max_weight_diff_vs_baseline_same_precision": _max_weight_diff(
                weights_dir / record.metrics["weights_file"], weights_dir / baseline.metrics["weights_file"])}
        except RecordError as e:
            why_not = str(e)
    return {"weights_not_compared_same_precision": why_not}


def _loss_diffs(record: Record, baseline: Record | None) -> dict[str, float]:
    """An exact strategy's training loss (the last 10 steps') and evaluation log loss minus the
    baseline's, absolute: a full-size correctness check that costs nothing. Both trained the
    same batches (:func:`embbench.runner._catch_up`); where they ran the same arithmetic in the
    same order (the CPU) they agree within float rounding, ~1e-6. On CUDA, float atomics sum in
    any order, and training amplifies a last-bit difference (docs/measurement.md): there, judge
    the difference against two runs of the baseline itself."""
    if (baseline is None or record is baseline or record.status != "ok" or record.semantics != "exact"
            or _trained_steps(record) != _trained_steps(baseline)):
        return {}
    mine, theirs = record.metrics.get("accuracy") or {}, baseline.metrics.get("accuracy") or {}
    return {f"{key}_diff_vs_baseline": abs(mine[key] - theirs[key]) for key in ("train_loss_last10", "logloss")
            if mine.get(key) is not None and theirs.get(key) is not None}


def run_cells(scenario: Scenario, scenario_file: str, cells: list[Cell], out_dir: Path, resume: bool = False,
              on_start: Callable[[Cell], None] | None = None,
              on_done: Callable[[Cell, Record], None] | None = None,
              execute: Callable[[Cell, Path | None], CellOutcome] | None = None,
              write: bool = True,
              on_progress: Callable[[Cell, str, int, int], None] | None = None,
              profile_dir: Path | None = None,
              on_notice: Callable[[str], None] | None = None,
              force: bool = False,
              done: dict[str, Record] | None = None) -> list[Record]:
    """Run every cell (the baseline's first), writing each record as soon as it ends.

    ``execute`` runs one cell (default: its own processes on this host, see
    :func:`run_isolated`); ``write`` is False on the ranks of a torchrun job other than 0.
    ``on_progress(cell, phase, step, total)`` follows a running cell; ``profile_dir`` gets a
    torch.profiler Chrome trace per cell (``<cell>.trace.json``). ``on_notice`` hears about
    records that ``resume`` cannot reuse (default: stderr); ``force`` runs cells that the
    memory preflight refuses; ``done`` gives the records to reuse instead of ``resume``.

    Raises:
        RecordsNotWritten: after every cell ran, when some records could not be written.
    """
    notice = on_notice or (lambda message: print(f"note: {message}", file=sys.stderr))
    if execute is None:
        def execute(cell: Cell, weights: Path | None) -> CellOutcome:
            follow = (lambda phase, step, total: on_progress(cell, phase, step, total)) if on_progress else None
            profile = profile_dir / f"{cell.slug}.trace.json" if profile_dir is not None else None
            return outcome_without_launch(scenario, cell, force, out_dir) or run_isolated(
                scenario, scenario_file, cell, out_dir / "logs", weights, on_progress=follow, profile_path=profile,
                work_dir=out_dir / "work" / cell.slug)
    compare = scenario.weights_compared()
    weights_dir = out_dir / "weights"
    if done is None:
        done = reusable_records(out_dir, scenario, weights_dir if compare else None, notice) if resume else {}
    write_errors: list[str] = []
    info = scenario_info(scenario, scenario_file)
    baseline_record: Record | None = None
    baseline_by_precision: dict[str, Record] = {}  # the baseline's cell in each row precision, with its weights
    baseline_ok: Record | None = None  # the baseline's record, for the loss check
    fp32_records: dict[str, Record] = {}  # by the fp32 cell's id
    told_unsaved = False  # that flushed weights could not be saved
    initial: list[torch.Tensor] | None = None
    records = []
    for cell in cells:
        if cell.id in done:
            record = done[cell.id]
        else:
            if on_start:
                on_start(cell)
            started = time.monotonic()
            outcome = execute(cell, weights_dir / f"{cell.slug}.pt" if compare else None)
            if outcome.metrics is not None:  # start-up to the last rank's end: what --dry-run's estimate reuses
                outcome.metrics["cell_seconds"] = time.monotonic() - started
            _keep_eval_scores(outcome.metrics, out_dir / EVAL_DIR / f"{cell.slug}.npz")
            record = _new_record(cell_id=cell.id, strategy=cell.strategy, params=cell.params, world_size=cell.world_size,
                                 row_precision=cell.row_precision,
                                 status=outcome.status, message=outcome.message, semantics=cell.strategy_class().semantics,
                                 baseline=scenario.baseline, scenario=info, metrics=outcome.metrics,
                                 provenance=provenance(cell.strategy))
        if record.status == "ok" and cell.strategy == scenario.baseline and baseline_ok is None:
            baseline_ok = record
        unsaved = (record.metrics or {}).get("weights_not_compared", "") if cell.id not in done else ""
        if unsaved.startswith(WEIGHTS_NOT_SAVED) and not told_unsaved:  # a full disk: said once, not only in records
            notice(f"{unsaved}; the weights of this and later cells are not compared where they cannot be saved "
                   "(each record says so)")
            told_unsaved = True
        diffs = _loss_diffs(record, baseline_ok) if write else {}
        if diffs:
            record.metrics.update(diffs)
        if write and record.status == "ok" and compare and record.metrics.get("weights_file"):
            if cell.strategy == scenario.baseline and baseline_record is None:
                baseline_record = record
            if cell.strategy == scenario.baseline:
                baseline_by_precision.setdefault(cell.row_precision, record)
            why_not = _weights_comparable(record, baseline_record)
            mine = weights_dir / record.metrics["weights_file"]
            theirs = weights_dir / baseline_record.metrics["weights_file"] if baseline_record else None
            if cell.id in done:
                pass  # compared when it was written
            elif why_not is None and mine.exists() and theirs.exists():
                try:
                    record.metrics["max_weight_diff_vs_baseline"] = _max_weight_diff(mine, theirs)
                except RecordError as e:
                    record.metrics["weights_not_compared"] = str(e)
            elif why_not is not None:
                record.metrics["weights_not_compared"] = why_not
            same = baseline_by_precision.get(cell.row_precision)
            if cell.row_precision != "fp32" and same is not record and cell.id not in done:
                record.metrics.update(_same_precision_diff(record, same, f"{scenario.baseline} in {cell.row_precision}",
                                                           weights_dir))
            fp32_id = Cell(cell.strategy, cell.params, cell.world_size).id
            if cell.row_precision == "fp32":
                fp32_records[cell.id] = record
            elif cell.id not in done:  # the distance from the fp32 cell, or why there is none
                fp32 = fp32_records.get(fp32_id)
                if fp32 is None:
                    record.metrics["weights_not_compared_fp32"] = (
                        f"no flushed weights of {fp32_id} in this run (fp32 is not in run.row_precision, "
                        "or that cell did not end ok)")
                elif _trained_steps(fp32) != _trained_steps(record):
                    record.metrics["weights_not_compared_fp32"] = (
                        f"trained {_trained_steps(record)} steps, {fp32_id} {_trained_steps(fp32)} (warm-up until steady)")
                else:
                    initial = initial if initial is not None else _initial_tables(scenario)
                    try:
                        record.metrics["weight_diff_vs_fp32"] = weight_distance(
                            mine, weights_dir / fp32.metrics["weights_file"], initial)
                    except RecordError as e:
                        record.metrics["weights_not_compared_fp32"] = str(e)
        if write and cell.id not in done:  # a reused record stays as it was written
            try:
                write_record(out_dir, cell.slug, record)
            except (OSError, RecordError) as e:  # disk full, directory removed: told once, the other cells still run
                if not write_errors:
                    notice(f"cannot write {out_dir / cell.slug}.json: {e.strerror or e}" if isinstance(e, OSError)
                           else str(e))  # a RecordError names the file and the field
                write_errors.append(cell.id)
        records.append(record)
        if on_done:
            on_done(cell, record)
    if write_errors:
        raise RecordsNotWritten(f"{len(write_errors)} of {len(cells)} record(s) could not be written to {out_dir} "
                                f"({', '.join(write_errors)}); the records written before are kept", records)
    return records


def max_ranks(device: torch.device) -> tuple[int, str]:
    """The most ranks one cell may start on this machine, and what sets that limit."""
    if device.type == "cuda":
        return torch.cuda.device_count(), "GPUs on this machine (one rank per GPU)"
    cores = os.cpu_count() or 1
    # Oversubscribed gloo ranks still run (tests use 4 on 2 cores); a thousand forks do not.
    return 4 * cores, f"CPU ranks on this machine (4 per core, {cores} cores)"


def _host_memory_bytes() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def _read_int(path: str) -> int | None:
    try:
        text = Path(path).read_text().split()[0]
    except (OSError, IndexError):
        return None
    return int(text) if text.isdigit() else None  # "max": no limit


#: What each rank's process takes besides its strategy's estimate: the interpreter, torch and the
#: libraries a cell imports, its batches. Measured: a CPU rank of the smoke scenario peaked at
#: 375-381 MiB (results/2026-11-25-cpu-freqcache-v3), a bare interpreter with torch, fbgemm and
#: torchrec imported holds 428 MiB (2026-11-29, 2 cores); a CUDA rank of the smoke scenario
#: 1.65-1.91 GiB with its CUDA context (results/2026-11-23-h100/smoke).
RANK_PROCESS_BYTES = {"cpu": 512 << 20, "cuda": 2 << 30}
#: The share of the free host memory a cell leaves unused: what no estimate counts (allocator
#: slack, the page cache a data source reads through, the launcher, other users of the machine).
HOST_HEADROOM = 0.10


def rank_process_bytes(device: torch.device) -> int:
    """:data:`RANK_PROCESS_BYTES` of a rank on ``device``."""
    return RANK_PROCESS_BYTES["cuda" if device.type == "cuda" else "cpu"]


def _free_host_bytes() -> tuple[int, str]:
    """Host memory a new process can still take without swapping, and where the number comes
    from: the kernel's MemAvailable, lowered to the room left under this container's cgroup
    limit (cgroup v2, then v1), never above the machine's memory.

    Pinned memory is part of it: page-locked pages are taken from the same RAM and cannot be
    reclaimed. (RLIMIT_MEMLOCK is no reading of what CUDA may pin: the NVIDIA driver does not
    charge cudaHostAlloc to it.)"""
    free, source = _host_memory_bytes(), "physical memory"
    available = mem_available()
    if available is not None and available < free:
        free, source = available, "MemAvailable"
    for limit_file, usage_file in (("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current"),
                                   ("/sys/fs/cgroup/memory/memory.limit_in_bytes",
                                    "/sys/fs/cgroup/memory/memory.usage_in_bytes")):
        limit, used = _read_int(limit_file), _read_int(usage_file)
        if limit is not None and used is not None and limit - used < free:
            free, source = max(limit - used, 0), "room under the cgroup's memory limit"
    return free, source


def _free_device_bytes(device: torch.device) -> tuple[int, int]:
    """(free, total) bytes of a GPU, read with nvidia-smi so that the launcher opens no CUDA
    context of its own (that would hold memory the cell needs); the total, as free, where
    nvidia-smi cannot say."""
    props = torch.cuda.get_device_properties(device)
    uuid = str(getattr(props, "uuid", ""))
    try:
        out = subprocess.run(["nvidia-smi", f"--id={uuid if uuid.startswith(('GPU-', 'MIG-')) else 'GPU-' + uuid}", "--query-gpu=memory.free,memory.total",
                              "--format=csv,noheader,nounits"], capture_output=True, text=True, timeout=30, check=True)
        free_mib, total_mib = (int(v) for v in out.stdout.strip().splitlines()[0].split(","))
        return free_mib << 20, total_mib << 20
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return props.total_memory, props.total_memory


def memory_estimate(scenario: Scenario, cell: Cell) -> MemoryFootprint | None:
    """The strategy's static bytes per rank for this cell (``Strategy.estimate_memory``, given the
    run's batch, training batches and row precision where it declares them), or None."""
    strategy = cell.make_strategy()
    estimate = strategy.estimate_memory
    key = (scenario.digest(), cell.id, getattr(estimate, "__func__", estimate))  # a method replaced: asked anew
    if key not in _estimates:  # --dry-run asks twice a cell (its row, its preflight); a profile is costly
        run = estimate_kwargs(strategy, local_batch_size=scenario.data.batch_size // cell.world_size,
                              train_steps=scenario.run.training_batches_read() - 1, row_precision=cell.row_precision,
                              train_batches=lambda n: _training_batches(scenario, n))
        _estimates[key] = estimate(scenario.tables(), scenario.optimizer.embedding, cell.world_size, **run)
    return _estimates[key]


_estimates: dict[tuple[str, str, Callable], MemoryFootprint | None] = {}


_made_batches: dict[tuple[str, int], list] = {}


def _training_batches(scenario: Scenario, n: int) -> list:
    """The first ``n`` training batches a rank of a one-rank cell builds with (``ctx.train_batches``:
    the data's order), made as the runner makes them, for an estimate that depends on the data (a
    row file's blocks a batch touches); the last scenario's are kept (its cells ask in turn)."""
    key = (scenario.digest(), n)
    if key not in _made_batches:
        from embbench.stream import TrainingStream

        run = scenario.run
        stream = TrainingStream(scenario.data_source(torch.device("cpu")), scenario.data.batch_size, 0, 1,
                                num_batches=run.training_batches_read())
        _made_batches.clear()
        _made_batches[key] = [stream.fresh(i) for i in range(n)]
    return _made_batches[key]


def memory_preflight(scenario: Scenario, cell: Cell, device: torch.device,
                     run_dir: Path | None = None) -> tuple[dict[str, int] | None, str | None]:
    """The strategy's static-memory estimate for this cell (bytes per rank: ``device``, ``host``)
    and why it cannot fit on this machine now, or None for the reason when it fits or is unknown.

    Checked against what is free now, before any rank pins host memory or allocates managed
    memory (so that a placement that cannot fit is refused, not left to thrash or wake the
    OOM killer): the host holds every rank's host and pinned bytes (and, on a CPU device, its
    device bytes too), against :func:`_free_host_bytes` (pinned pages cannot be swapped out);
    each rank's GPU holds its device bytes, and its device and managed bytes together, against
    that GPU's free memory: managed memory oversubscribing the GPU can hang it. A strategy's
    ``estimate_memory`` that raises is a broken plugin: it raises ``RuntimeError`` naming the
    strategy. A file the strategy writes (``disk_bytes``) is held to the free space of its
    folder's drive (``disk_dir``, else ``run_dir``: the cell's folder is in the run directory).
    """
    try:
        est = memory_estimate(scenario, cell)
    except Exception as e:
        raise RuntimeError(f"strategy {cell.strategy!r}: estimate_memory raised {type(e).__name__}: {e}") from e
    if est is None:
        return None, None
    for key in ("device_bytes", "host_bytes", "pinned_bytes"):
        value = getattr(est, key, None)
        if isinstance(value, bool) or not isinstance(value, numbers.Real) or not 0 <= value < math.inf:
            # NaN compares as fitting everywhere; infinity or a negative number is no estimate either
            raise RuntimeError(f"strategy {cell.strategy!r}: estimate_memory returned {key} {value!r}; expected "
                               "a finite number of bytes, at least 0")
    on_host = est.host_bytes + est.pinned_bytes + (est.device_bytes if device.type == "cpu" else 0)
    per_rank = {"device": est.device_bytes, "host": on_host}
    free, source = _free_host_bytes()
    process = rank_process_bytes(device)  # each rank's interpreter and libraries, beside its tables
    if (on_host + process) * cell.world_size > (1 - HOST_HEADROOM) * free:
        pinned = "".join(f", {n / 2**30:,.2f} GiB of it {what}" for n, what in
                         ((est.pinned_bytes, "pinned"), (est.managed_bytes, "managed")) if n)
        return per_rank, Refusal(
            f"not attempted: estimated {(on_host + process) * cell.world_size / 2**30:,.1f} GiB of host memory "
            f"({cell.world_size} rank(s) x {on_host / 2**30:,.2f} GiB{pinned} + {process / 2**30:,.2f} GiB a rank's "
            f"process), this machine has {free / 2**30:,.1f} GiB free ({source}; {_host_memory_bytes() / 2**30:,.1f} "
            f"GiB in all), of which a cell may take {100 * (1 - HOST_HEADROOM):.0f}% (--force runs it anyway)", "memory")
    if est.disk_bytes:
        refused = _disk_preflight(est, cell.world_size, Path(est.disk_dir) if est.disk_dir else run_dir or Path.cwd())
        if refused:
            return per_rank, refused
    if est.refusal:
        return per_rank, Refusal(f"not attempted: {est.refusal}", "shape")
    if device.type == "cuda" and torch.cuda.is_available():
        for rank in range(min(cell.world_size, torch.cuda.device_count())):
            gpu_free, gpu_total = _free_device_bytes(torch.device("cuda", rank))
            if est.device_bytes > gpu_free:
                return per_rank, Refusal(f"not attempted: estimated {est.device_bytes / 2**30:,.1f} GiB of device "
                                         f"memory per rank, GPU {rank} has {gpu_free / 2**30:,.1f} GiB free of "
                                         f"{gpu_total / 2**30:,.1f} GiB (--force runs it anyway)", "memory")
            if est.managed_bytes and est.device_bytes + est.managed_bytes > gpu_free:
                return per_rank, Refusal(
                    f"not attempted: estimated {est.managed_bytes / 2**30:,.1f} GiB of managed (unified) memory per "
                    f"rank beside {est.device_bytes / 2**30:,.1f} GiB of device memory, GPU {rank} has "
                    f"{gpu_free / 2**30:,.1f} GiB free of {gpu_total / 2**30:,.1f} GiB: managed memory beyond the "
                    "GPU's free memory can hang it (--force runs it anyway)", "memory")
    return per_rank, None


def _disk_preflight(est: MemoryFootprint, world_size: int, folder: Path) -> Refusal | None:
    """Why the strategy's files cannot go in ``folder`` (it is missing, not writable, or its drive
    lacks the space), or None. A run directory not made yet is measured where it will be; files
    that dead runs left there (:mod:`embbench.owned`: removed when the cell starts) count as free."""
    if est.disk_dir and not Path(est.disk_dir).is_dir():
        return Refusal(f"not attempted: store_dir {est.disk_dir} " + (
            "is not a directory" if Path(est.disk_dir).exists() else "does not exist"), "store_dir")
    existing = next(p for p in (folder, *folder.parents) if p.exists())
    if est.disk_dir and not os.access(existing, os.W_OK | os.X_OK):
        return Refusal(f"not attempted: store_dir {est.disk_dir} is not writable by this user", "store_dir")
    need = est.disk_bytes * world_size + est.scratch_bytes
    free = shutil.disk_usage(existing).free + owned.abandoned_bytes(existing)
    if need > free:
        scratch = f" and {est.scratch_bytes / 2**30:,.2f} GiB of scratch" if est.scratch_bytes else ""
        return Refusal(f"not attempted: estimated {need / 2**30:,.1f} GiB of files in {folder} ({world_size} rank(s) x "
                       f"{est.disk_bytes / 2**30:,.2f} GiB{scratch}), its drive has {free / 2**30:,.1f} GiB free "
                       "(--force runs it anyway)", "drive")
    return None


def _plugin_refusal(cell: Cell, env: RuntimeEnv) -> CellOutcome | None:
    """The strategy's own ``unsupported_reason`` and row precision check; a plugin that raises
    there fails its cell only."""
    hook = "__init__"
    try:
        strategy = cell.make_strategy()
        hook = "unsupported_reason"
        reason = strategy.unsupported_reason(env)
        hook = "row_precision_reason"
        reason = reason or strategy.row_precision_reason(cell.row_precision, env)
    except Exception as e:
        return CellOutcome("error", f"strategy {cell.strategy!r}: {hook} raised {type(e).__name__}: {e}", None)
    return CellOutcome("unsupported", reason, None) if reason else None


def outcome_without_launch(scenario: Scenario, cell: Cell, force: bool = False,
                           run_dir: Path | None = None) -> CellOutcome | None:
    """The cells that need no processes: those this machine cannot run (``unsupported``), or
    cannot hold (``skipped``: the memory preflight's estimate does not fit what is free); what
    ``run`` records for them and ``--dry-run`` shows."""
    try:
        device = resolve_device(scenario.run.device)
    except Unsupported as e:
        return CellOutcome("unsupported", str(e), None)
    limit, what = max_ranks(device)
    if cell.world_size > limit:
        return CellOutcome("unsupported", f"needs {cell.world_size} ranks; at most {limit} {what}", None)
    refused = _plugin_refusal(cell, RuntimeEnv(device, cell.world_size))
    if refused:
        return refused
    try:
        _, too_big = memory_preflight(scenario, cell, device, run_dir)
    except RuntimeError as e:
        return CellOutcome("error", str(e), None)
    if too_big and not force:
        return CellOutcome("skipped", too_big, None, getattr(too_big, "cause", "memory"))
    return None
