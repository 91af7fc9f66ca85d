"""Runs the cells of a scenario, each in its own processes under a time limit.

A cell is ``world_size`` processes of :mod:`embbench.runner` (torch.distributed env://
variables set: one process per device, gloo on the CPU, NCCL on GPUs) in a new process
session. An exception, out-of-memory, a crash or a timeout becomes that cell's status; its
processes are reaped, its record is written at once, and the next cell runs.
"""

from __future__ import annotations

import json
import os
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

from embbench.results import Record, Status, load_records, provenance, write_record
from embbench.runner import resolve_device
from embbench.scenario import Cell, Scenario
from embbench.strategy import RuntimeEnv, Unsupported

__all__ = ["CellOutcome", "run_cells", "run_isolated"]

#: How long the other ranks may live on after one rank failed (they may be stuck in a collective).
_PEER_GRACE_S = 10.0


@dataclass
class CellOutcome:
    status: Status
    message: str | None
    metrics: dict[str, Any] | None


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _kill(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    for p in procs:
        p.wait()


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


def run_isolated(scenario: Scenario, scenario_file: str, cell: Cell, log_dir: Path,
                 weights_path: Path | None = None, time_limit_s: float | None = None,
                 on_progress: Callable[[str, int, int], None] | None = None,
                 profile_path: Path | None = None) -> CellOutcome:
    """Run one cell in ``cell.world_size`` fresh processes and report how it ended.

    ``on_progress(phase, step, total)`` follows rank 0 through build, warmup, measure and eval;
    ``profile_path`` asks for a torch.profiler trace of a few extra steps there.
    """
    limit = time_limit_s if time_limit_s is not None else scenario.run.time_limit_s
    log_dir.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="embbench-cell-") as tmp:
        tmp_dir = Path(tmp)
        spec = {
            "scenario": scenario.model_dump(mode="json"),
            "scenario_file": scenario_file,
            "cell": {"strategy": cell.strategy, "params": cell.params, "world_size": cell.world_size},
            "result": str(tmp_dir / "result.json"),
            "weights": str(weights_path) if weights_path else None,
            "progress": str(tmp_dir / "progress.json"),
            "profile": str(profile_path) if profile_path else None,
        }
        spec_path = tmp_dir / "spec.json"
        spec_path.write_text(json.dumps(spec))
        port = _free_port()
        procs, logs = [], []
        for rank in range(cell.world_size):
            env = dict(os.environ, RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(cell.world_size),
                       LOCAL_WORLD_SIZE=str(cell.world_size), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                       PYTHONUNBUFFERED="1")
            log = log_dir / f"{cell.slug}.rank{rank}.log"
            logs.append(log)
            with open(log, "w") as out:
                procs.append(subprocess.Popen([sys.executable, "-m", "embbench.runner", str(spec_path)],
                                              stdout=out, stderr=subprocess.STDOUT, env=env, start_new_session=True))
        deadline = time.monotonic() + limit
        first_failure: float | None = None
        progress = None
        try:
            while any(p.poll() is None for p in procs):
                progress = _poll_progress(tmp_dir / "progress.json", progress, on_progress)
                now = time.monotonic()
                if now > deadline:
                    _kill(procs)
                    return CellOutcome("timeout", f"exceeded the time limit of {limit:g} s", None)
                if first_failure is None and any(p.returncode not in (None, 0) for p in procs):
                    first_failure = now
                if first_failure is not None and now - first_failure > _PEER_GRACE_S:
                    break
                time.sleep(0.05)
        finally:
            _kill(procs)  # reaps everything, also on KeyboardInterrupt
        _poll_progress(tmp_dir / "progress.json", progress, on_progress)  # the last phase reached
        errors = [(json.loads(p.read_text()), p.stem.removeprefix("error.rank")) for p in tmp_dir.glob("error.rank*.json")]
        if errors:
            # The first failure is the cause; the peers then fail in their collectives.
            error, rank = min(errors, key=lambda e: e[0]["time"])
            prefix = f"rank {rank}: " if cell.world_size > 1 else ""
            others = f" (then {len(errors) - 1} more rank(s) failed)" if len(errors) > 1 else ""
            return CellOutcome(error["status"], f"{prefix}{error['type']}: {error['message']}{others}", None)
        failed = [(r, p.returncode) for r, p in enumerate(procs) if p.returncode != 0]
        if failed:
            rank, code = failed[0]
            how = f"killed by signal {-code}" if code < 0 else f"exited with code {code}"
            hint = " (the kernel's OOM killer sends signal 9)" if code == -signal.SIGKILL else ""
            return CellOutcome("error", f"rank {rank} {how}{hint}; log tail:\n{_tail(logs[rank])}", None)
        result = tmp_dir / "result.json"
        if not result.exists():
            return CellOutcome("error", "the run ended without a result", None)
        return CellOutcome("ok", None, json.loads(result.read_text()))


def _max_weight_diff(a: Path, b: Path) -> float:
    left, right = torch.load(a), torch.load(b)
    return max(float((x - y).abs().max()) if x.numel() else 0.0 for x, y in zip(left, right))


def _trained_steps(record: Record) -> int:
    m = record.metrics
    return m.get("warmup_steps_run", m["warmup_steps"]) + m["measured_steps"]


def _weights_comparable(record: Record, baseline: Record | None) -> str | None:
    """Why a record's flushed weights cannot be compared with the baseline's, or None."""
    if record.semantics != "exact":
        return "training order differs from the baseline's (semantics: reordered): compare AUC"
    if baseline is None:
        return "the baseline has no flushed weights"
    if _trained_steps(record) != _trained_steps(baseline):
        return f"trained {_trained_steps(record)} steps, the baseline {_trained_steps(baseline)} (warm-up until steady)"
    return None


def run_cells(scenario: Scenario, scenario_file: str, cells: list[Cell], out_dir: Path, resume: bool = False,
              on_start: Callable[[Cell], None] | None = None,
              on_done: Callable[[Cell, Record], None] | None = None,
              execute: Callable[[Cell, Path | None], CellOutcome] | None = None,
              write: bool = True,
              on_progress: Callable[[Cell, str, int, int], None] | None = None,
              profile_dir: Path | None = None) -> list[Record]:
    """Run every cell (the baseline's first), writing each record as soon as it ends.

    ``execute`` runs one cell (default: its own processes on this host, see
    :func:`run_isolated`); ``write`` is False on the ranks of a torchrun job other than 0.
    ``on_progress(cell, phase, step, total)`` follows a running cell; ``profile_dir`` gets a
    torch.profiler Chrome trace per cell (``<cell>.trace.json``).
    """
    if execute is None:
        def execute(cell: Cell, weights: Path | None) -> CellOutcome:
            follow = (lambda phase, step, total: on_progress(cell, phase, step, total)) if on_progress else None
            profile = profile_dir / f"{cell.slug}.trace.json" if profile_dir is not None else None
            return _outcome_without_launch(scenario, cell) or run_isolated(
                scenario, scenario_file, cell, out_dir / "logs", weights, on_progress=follow, profile_path=profile)
    done: dict[str, Record] = {}
    if resume and out_dir.exists() and any(out_dir.glob("*.json")):
        done = {r.cell_id: r for r in load_records(out_dir) if r.status in ("ok", "unsupported")}
    compare = scenario.weights_compared()
    weights_dir = out_dir / "weights"
    scenario_info = {"name": scenario.name, "file": scenario_file, "digest": scenario.digest(),
                     "config": scenario.model_dump(mode="json")}
    baseline_record: Record | None = None
    records = []
    for cell in cells:
        if cell.id in done:
            record = done[cell.id]
        else:
            if on_start:
                on_start(cell)
            outcome = execute(cell, weights_dir / f"{cell.slug}.pt" if compare else None)
            record = Record(cell_id=cell.id, strategy=cell.strategy, params=cell.params, world_size=cell.world_size,
                            status=outcome.status, message=outcome.message, semantics=cell.strategy_class().semantics,
                            baseline=scenario.baseline, scenario=scenario_info, metrics=outcome.metrics,
                            provenance=provenance())
        if write and record.status == "ok" and compare and record.metrics.get("weights_file"):
            if cell.strategy == scenario.baseline and baseline_record is None:
                baseline_record = record
            why_not = _weights_comparable(record, baseline_record)
            mine = weights_dir / record.metrics["weights_file"]
            theirs = weights_dir / baseline_record.metrics["weights_file"] if baseline_record else None
            if why_not is None and mine.exists() and theirs.exists():
                record.metrics["max_weight_diff_vs_baseline"] = _max_weight_diff(mine, theirs)
            elif why_not is not None:
                record.metrics["weights_not_compared"] = why_not
        if write:
            write_record(out_dir, cell.slug, record)
        records.append(record)
        if on_done:
            on_done(cell, record)
    return records


def launched_by_torchrun() -> bool:
    """Whether this process is one rank of a job that torchrun (torch.distributed.run) started."""
    return "TORCHELASTIC_RUN_ID" in os.environ


def run_cells_in_job(scenario: Scenario, scenario_file: str, cells: list[Cell], out_dir: Path,
                     resume: bool = False, on_start: Callable[[Cell], None] | None = None,
                     on_done: Callable[[Cell, Record], None] | None = None) -> list[Record]:
    """Under torchrun (one host or several): this process is one rank of the job, and every
    rank runs each cell of the job's world size here, in step with the others.

    torchrun owns the processes, so a cell is not isolated: a rank that fails records its
    error, a rank stuck in a collective gives up after the cell's time limit (the process
    group's timeout), and the ranks agree on the first failure. Rank 0 writes the records.
    """
    from datetime import timedelta

    import torch.distributed as dist

    from embbench.runner import _classify, run_cell

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    device = resolve_device(scenario.run.device, int(os.environ.get("LOCAL_RANK", 0)))
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                            timeout=timedelta(seconds=scenario.run.time_limit_s))
    env = RuntimeEnv(device, world, rank)

    def execute(cell: Cell, weights: Path | None) -> CellOutcome:
        if cell.world_size != world:
            return CellOutcome("unsupported", f"this torchrun job has {world} ranks; the cell needs {cell.world_size}", None)
        reason = cell.make_strategy().unsupported_reason(env)
        if reason:
            return CellOutcome("unsupported", reason, None)
        metrics, mine = None, {"status": "ok"}
        try:
            metrics = run_cell(scenario, cell, env, weights, dist.group.WORLD)
        except Exception as exc:
            mine = {"status": _classify(exc), "message": f"rank {rank}: {type(exc).__name__}: {exc}", "time": time.time()}
        everyone: list[Any] = [None] * world
        dist.all_gather_object(everyone, mine)
        failures = [o for o in everyone if o["status"] != "ok"]
        if failures:
            first = min(failures, key=lambda o: o["time"])
            return CellOutcome(first["status"], first["message"], None)
        return CellOutcome("ok", None, metrics)

    # Only rank 0 sees its run directory: it decides what --resume skips, for every rank.
    skip = [None]
    if rank == 0 and resume and out_dir.exists() and any(out_dir.glob("*.json")):
        skip = [{r.cell_id for r in load_records(out_dir) if r.status in ("ok", "unsupported")}]
    dist.broadcast_object_list(skip, src=0)
    todo = [c for c in cells if c.id not in (skip[0] or set())]
    try:
        run_cells(scenario, scenario_file, todo, out_dir, execute=execute, write=rank == 0,
                  on_start=on_start if rank == 0 else None, on_done=on_done if rank == 0 else None)
    finally:
        dist.destroy_process_group()
    return load_records(out_dir) if rank == 0 else []


def _outcome_without_launch(scenario, cell) -> CellOutcome | None:
    """The cells that need no processes: those this machine cannot run."""
    try:
        device = resolve_device(scenario.run.device)
    except Unsupported as e:
        return CellOutcome("unsupported", str(e), None)
    if device.type == "cuda" and cell.world_size > torch.cuda.device_count():
        return CellOutcome("unsupported", f"needs {cell.world_size} GPUs, this machine has {torch.cuda.device_count()}", None)
    reason = cell.make_strategy().unsupported_reason(RuntimeEnv(device, cell.world_size))
    return CellOutcome("unsupported", reason, None) if reason else None
