"""Running cells inside a torchrun job. :mod:`embbench.launch` starts each cell's ranks as
processes of their own; under torchrun the job owns the processes, and each one runs its
rank of every cell here, with :func:`embbench.runner.run_cell`."""

from __future__ import annotations

import os
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

from embbench.device import resolve_device
from embbench.launch import CellOutcome, _plugin_refusal, reusable_records, run_cells
from embbench.results import Record
from embbench.runner import _classify, run_cell
from embbench.scenario import Cell, Scenario
from embbench.strategy import RuntimeEnv

__all__ = ["launched_by_torchrun", "run_cells_in_job", "torchrun_ranks"]

#: What torchrun sets for every rank; one of them alone means a job, and then all are needed.
_TORCHRUN_ENV = ("TORCHELASTIC_RUN_ID", "RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def torchrun_ranks() -> tuple[int, int, int] | None:
    """``(rank, world size, local rank)`` when torchrun (torch.distributed.run) started this
    process, None when none of its variables is set.

    Raises:
        ValueError: a partial or inconsistent torchrun environment, naming what is missing or wrong.
    """
    present = [k for k in _TORCHRUN_ENV if k in os.environ]
    if not any(k in present for k in ("TORCHELASTIC_RUN_ID", "RANK", "WORLD_SIZE", "LOCAL_RANK")):
        return None
    missing = [k for k in _TORCHRUN_ENV if k not in present]
    if missing:
        raise ValueError(f"environment: {', '.join(present)} set but {', '.join(missing)} not: a partial torchrun "
                         f"environment (start the job with torchrun, or unset {', '.join(present)})")
    values = {}
    for key in ("RANK", "WORLD_SIZE", "LOCAL_RANK"):
        try:
            values[key] = int(os.environ[key])
        except ValueError:
            raise ValueError(f"environment: {key}={os.environ[key]!r} is not an integer") from None
    if not 0 <= values["RANK"] < values["WORLD_SIZE"] or values["LOCAL_RANK"] < 0:
        raise ValueError(f"environment: RANK={values['RANK']}, LOCAL_RANK={values['LOCAL_RANK']} with "
                         f"WORLD_SIZE={values['WORLD_SIZE']}: need 0 <= RANK < WORLD_SIZE and LOCAL_RANK >= 0")
    return values["RANK"], values["WORLD_SIZE"], values["LOCAL_RANK"]


def launched_by_torchrun() -> bool:
    """Whether this process is one rank of a job that torchrun started (its environment checked)."""
    return torchrun_ranks() is not None


def run_cells_in_job(scenario: Scenario, scenario_file: str, cells: list[Cell], out_dir: Path,
                     resume: bool = False, on_start: Callable[[Cell], None] | None = None,
                     on_done: Callable[[Cell, Record], None] | None = None) -> list[Record]:
    """Under torchrun (one host or several): this process is one rank of the job, and every
    rank runs each cell of the job's world size here, in step with the others.

    torchrun owns the processes, so a cell is not isolated: a rank that fails records its
    error, a rank stuck in a collective gives up after the cell's time limit (the process
    group's timeout), and the ranks agree on the first failure. Rank 0 writes the records.
    """
    rank, world, local_rank = torchrun_ranks()
    device = resolve_device(scenario.run.device, local_rank)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if device.type == "cuda" else "gloo",
                            timeout=timedelta(seconds=scenario.run.time_limit_s))
    env = RuntimeEnv(device, world, rank)
    lost: list[str] = []  # the cell in which the job lost a rank: no collective works after it

    def execute(cell: Cell, weights: Path | None) -> CellOutcome:
        if cell.world_size != world:
            return CellOutcome("unsupported", f"this torchrun job has {world} ranks; the cell needs {cell.world_size}", None)
        refused = _plugin_refusal(cell, env)
        if refused:
            return refused
        if lost:
            return CellOutcome("error", f"not run: the job lost a rank in {lost[0]}; run again with --resume", None)
        metrics, mine = None, {"status": "ok"}
        try:
            metrics = run_cell(scenario, cell, env, weights, dist.group.WORLD)
        except Exception as exc:
            mine = {"status": _classify(exc), "message": f"rank {rank}: {type(exc).__name__}: {exc}", "time": time.time()}
        except KeyboardInterrupt:  # torchrun stops every rank when one dies (and on Ctrl-C)
            lost.append(cell.id)
            return CellOutcome("error", f"rank {rank}: stopped by torchrun (a rank died, or Ctrl-C)", None)
        everyone: list[Any] = [None] * world
        try:
            dist.all_gather_object(everyone, mine)
        except Exception as exc:  # a peer was killed, or hung past the process group's timeout
            lost.append(cell.id)
            why = mine.get("message") or f"rank {rank}: {type(exc).__name__}: {exc}"
            return CellOutcome(mine["status"] if mine["status"] != "ok" else "error",
                               f"{why} (a peer rank was killed or hung: the ranks could not agree)", None)
        failures = [o for o in everyone if o["status"] != "ok"]
        if failures:
            first = min(failures, key=lambda o: o["time"])
            return CellOutcome(first["status"], first["message"], None)
        return CellOutcome("ok", None, metrics)

    # Only rank 0 sees its run directory: it decides what --resume reuses, for every rank.
    # (Reused records stay in the run, so later cells are still compared with the baseline.)
    done: list[Any] = [{}]
    if rank == 0 and resume:
        weights_dir = out_dir / "weights" if scenario.weights_compared() else None
        done = [reusable_records(out_dir, scenario, weights_dir, lambda m: print(f"note: {m}", file=sys.stderr))]
    dist.broadcast_object_list(done, src=0)
    try:
        records = run_cells(scenario, scenario_file, cells, out_dir, execute=execute, write=rank == 0,
                            on_start=on_start if rank == 0 else None, on_done=on_done if rank == 0 else None,
                            done=done[0])
    finally:
        dist.destroy_process_group()
    return records if rank == 0 else []
