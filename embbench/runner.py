"""One cell of the matrix on one rank: build, warm up, measure, evaluate.

``python -m embbench.runner SPEC.json`` is what :mod:`embbench.launch` starts, once per
rank, with torch.distributed's env:// variables set. Rank 0 writes the measurements to the
spec's ``result`` path; a rank that fails writes ``error.rank<r>.json`` beside it.
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from embbench.data import NUM_DENSE_FEATURES, Stream, TableSpec
from embbench.data.synthetic import _mix
from embbench.metrics import (OpCounter, StepTimer, auc_logloss, confidence_interval, device_memory, miss_rate,
                              peak_rss_bytes, summarize, warmed_up)
from embbench.model import build_model
from embbench.optional import MissingDependency
from embbench.precision import effective_precision, scoped_to_the_cell, with_dense_precision
from embbench.scenario import Cell, RunConfig, Scenario
from embbench.stream import TrainingStream
from embbench.strategy import BuildContext, RuntimeEnv, Schedule, Unsupported

__all__ = ["Diverged", "initial_weights", "resolve_device", "run_cell"]

_INIT_CHUNK = 1 << 16


def initial_weights(table: TableSpec, index: int, seed: int, start: int, stop: int) -> torch.Tensor:
    """Rows ``[start, stop)`` of a table's initial weights, uniform in +-1/sqrt(rows).

    Generated in fixed chunks with their own seeds, so any row range can be produced
    without the rows before it, and every strategy and rank gets the same numbers.
    """
    bound = 1.0 / math.sqrt(table.num_rows)
    pieces = []
    for chunk in range(start // _INIT_CHUNK, (stop - 1) // _INIT_CHUNK + 1 if stop > start else 0):
        g = torch.Generator().manual_seed(_mix(seed, 10, index, chunk))
        lo = chunk * _INIT_CHUNK
        rows = min(_INIT_CHUNK, table.num_rows - lo)
        block = torch.rand(rows, table.dim, generator=g) * (2 * bound) - bound
        pieces.append(block[max(start - lo, 0) : stop - lo])
    return torch.cat(pieces) if pieces else torch.empty(0, table.dim)


def resolve_device(requested: str, local_rank: int = 0) -> torch.device:
    if requested == "cpu" or (requested == "auto" and not torch.cuda.is_available()):
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise Unsupported("the scenario asks for device cuda, and CUDA is not available")
    return torch.device("cuda", local_rank)


def _sum_counters(before: dict[str, int], after: dict[str, int]) -> dict[str, int]:
    return {k: after[k] - before.get(k, 0) for k in after}


def _derived_rates(c: dict[str, int]) -> dict[str, float | None]:
    def ratio(a: str, b: str) -> float | None:
        return c[a] / c[b] if c.get(b) and a in c else None

    return {"hit_rate": ratio("hits", "accesses"),
            "unique_hit_rate": (1 - c["unique_misses"] / c["unique_accesses"]) if c.get("unique_accesses") and "unique_misses" in c else None}


class Diverged(RuntimeError):
    """Training produced a non-finite loss: recorded as status ``diverged``."""


#: Untimed steps after the measurement: operator counting, then (if asked) profiling.
_OPS_STEPS = 2
_PROFILE_STEPS = 3
#: Warm-up watches the miss rate over windows of this many steps.
_WARMUP_WINDOW = 5


def training_batches_read(run: RunConfig, profile: bool = True) -> int:
    """How many training batches a cell reads: the longest warm-up, every measured step, the
    untimed steps that count operators (and profile), and the batch the last step prefetches."""
    return run.warmup_bound + run.repeats * run.steps + _OPS_STEPS + (_PROFILE_STEPS if profile else 0) + 1


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


@scoped_to_the_cell  # run.dense_precision's matmul mode (tf32) for the whole cell
def run_cell(scenario: Scenario, cell: Cell, env: RuntimeEnv, weights_path: Path | None = None,
             process_group: Any = None, schedule: Schedule | None = None, progress: str | None = None,
             profile_path: Path | None = None) -> dict[str, Any]:
    """Train and measure one cell on this rank; returns rank-local measurements.

    Args:
        schedule: train in this batching order instead of the data's own (or the strategy's
            proposal): lets a test train ``device`` on another strategy's schedule.
        progress: a file for the launcher to follow the phase and step (rank 0 writes it).
        profile_path: write a torch.profiler Chrome trace of a few extra steps here.
    """
    run, device = scenario.run, env.device
    tables = scenario.tables()
    global_batch = scenario.data.batch_size
    if global_batch % env.world_size:
        raise ValueError(f"data.batch_size {global_batch} does not divide by world size {env.world_size}")
    local_batch = global_batch // env.world_size
    report = _Progress(progress, env.rank)
    report("build", force=True)

    strategy = cell.make_strategy()
    reason = strategy.unsupported_reason(env)
    if reason:
        raise Unsupported(reason)

    # The training batches in the order they are trained: the data's, or a strategy's schedule.
    data = scenario.data_source(device)
    train_steps = training_batches_read(run, profile=profile_path is not None) - 1
    stream = TrainingStream(data, global_batch, env.rank, env.world_size, num_batches=train_steps + 1)
    if schedule is not None:
        stream.set_schedule(schedule)
    else:
        stream.use_schedule(strategy, tables, run.seed)

    ctx = BuildContext(
        tables=tables, env=env, optimizer=scenario.optimizer.embedding, local_batch_size=local_batch,
        init_weights=lambda t, a, b: initial_weights(tables[t], t, run.seed, a, b),
        train_batches=lambda n: (stream.fresh(i) for i in range(n)),
        warmup_steps=run.warmup_steps, process_group=process_group,
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
    loss_fn = torch.nn.BCEWithLogitsLoss()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)

    step_index = 0

    def train_step() -> torch.Tensor:
        """One training step, everything a strategy does included; batches are made before."""
        batch, upcoming = stream.get(step_index), stream.get(step_index + 1)
        ahead = [stream.get(i).sparse for i in range(step_index + 1, min(step_index + 1 + sparse.lookahead, train_steps + 1))]
        if ahead:
            sparse.look_ahead(ahead)
        pooled = sparse(batch.sparse)
        sparse.prefetch(upcoming.sparse)
        loss = loss_fn(model(batch.dense, pooled), batch.labels)
        dense_optimizer.zero_grad(set_to_none=True)
        loss.backward()
        sparse.after_backward()
        dense_optimizer.step()
        sparse.end_step()
        return loss.detach()

    def prepare(steps: int = 1) -> None:
        """Make the batches of the next ``steps`` steps (and what they look ahead to) now."""
        for i in range(step_index, min(step_index + steps + 1 + sparse.lookahead, train_steps + 1)):
            stream.get(i)
        stream.release(step_index)

    def timed_step() -> tuple[float, torch.Tensor]:
        """Make this step's batches (untimed), then time the step."""
        nonlocal step_index
        prepare()
        with StepTimer(device) as timer:
            loss = train_step()
        step_index += 1
        return timer.seconds, loss

    # Warm-up: warmup_steps; with warmup_max_steps, on until the miss rate stops falling.
    warmup_losses: list[torch.Tensor] = []
    window_rates: list[float | None] = []
    window_start = sparse.counters()
    while step_index < run.warmup_bound:
        if step_index >= run.warmup_steps and step_index % _WARMUP_WINDOW == 0 and warmed_up(window_rates):
            break
        report("warmup", step_index, run.warmup_bound)
        warmup_losses.append(timed_step()[1])
        if run.warmup_max_steps and step_index % _WARMUP_WINDOW == 0:
            now = sparse.counters()
            window_rates.append(miss_rate(window_start, now))
            window_start = now
    warmup_run = step_index
    _check_finite(warmup_losses, 0)

    # The generator alone, warm, outside any timed step: visibly never the bottleneck. (It
    # makes the batches the run is about to train: where a drifting source's state is.)
    with StepTimer(device) as t:
        for i in range(3):
            data.batch(Stream.TRAIN, step_index + i, global_batch)
    generator_rate = 3 * global_batch / t.seconds

    counters_before = sparse.counters()
    step_seconds: list[float] = []
    repeat_throughput: list[float] = []
    losses: list[torch.Tensor] = []
    for repeat in range(run.repeats):
        repeat_seconds = 0.0
        for k in range(run.steps):
            report("measure", repeat * run.steps + k, run.repeats * run.steps)
            seconds, loss = timed_step()
            step_seconds.append(seconds)
            losses.append(loss)
            repeat_seconds += seconds
        repeat_throughput.append(run.steps * global_batch / repeat_seconds)
        _check_finite(losses[-run.steps:], warmup_run + repeat * run.steps)
    counters = _sum_counters(counters_before, sparse.counters())
    measured_steps = run.steps * run.repeats

    # Extra untimed steps: how many operators (and, on CUDA, host waits) one step issues.
    # (Batches are made before, so that only the steps are watched.)
    prepare(_OPS_STEPS)
    with OpCounter(device) as ops:
        for _ in range(_OPS_STEPS):
            timed_step()
    profile = None
    if profile_path is not None:
        prepare(_PROFILE_STEPS)
        profile = _profile(timed_step, device, profile_path)

    # Held-out evaluation: a separate stream, never seen by training or frequency statistics.
    report("eval", 0, run.eval_batches, force=True)
    model.eval()
    logits, labels = [], []
    with torch.no_grad():
        for i in range(run.eval_batches):
            batch = data.batch(Stream.EVAL, i, global_batch).shard(env.rank, env.world_size)
            logits.append(model(batch.dense, sparse(batch.sparse)))
            labels.append(batch.labels)
    accuracy: dict[str, Any] = {"train_loss_last10": float(torch.stack(losses[-10:]).mean())}
    if logits:
        all_logits, all_labels = torch.cat(logits), torch.cat(labels)
        if env.world_size > 1:
            all_logits, all_labels = _gather(all_logits, process_group), _gather(all_labels, process_group)
        _check_finite_values({"the evaluation logits": all_logits})
        auc, logloss = auc_logloss(all_logits, all_labels)
        accuracy.update(auc=auc, logloss=logloss, eval_samples=all_labels.numel())

    weights_file = None
    if weights_path is not None:
        flushed = sparse.flush()
        _check_finite_values({f"the trained weights of table {i}": t for i, t in enumerate(flushed)})
        if env.rank == 0:
            weights_path.parent.mkdir(parents=True, exist_ok=True)
            torch.save(flushed, weights_path)
            weights_file = weights_path.name

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
        "counters": counters,
        # the time of the steps the counters cover, on this rank (the projection subtracts them)
        "measured_seconds": sum(step_seconds),
        "extra": sparse.extra_metrics(),
    }
    ranks = _gather_objects(this_rank, env, process_group)
    total = {k: sum(r["counters"].get(k, 0) for r in ranks) for k in ranks[0]["counters"]}
    throughput = {"unit": "samples/s (global)", "per_repeat": repeat_throughput,
                  "mean": sum(repeat_throughput) / len(repeat_throughput)}
    try:
        throughput["ci95"] = confidence_interval(repeat_throughput)
    except MissingDependency as e:  # the measurement stands; only its interval is missing
        throughput["ci95"], throughput["ci95_missing"] = None, str(e)
    return {
        "device": str(device),
        "world_size": env.world_size,
        "samples_per_step": global_batch,
        "measured_steps": measured_steps,
        "warmup_steps": run.warmup_steps,
        "warmup_steps_run": warmup_run,
        "warmup_miss_rates": window_rates,
        "build_seconds": build_seconds,
        "step_time_s": summarize(step_seconds),
        "throughput": throughput,
        "generator_samples_per_s": generator_rate,
        # whether the data source replays its batches from a CUDA graph (None: it does not say)
        "generator_cuda_graph": data.uses_cuda_graph(global_batch) if hasattr(data, "uses_cuda_graph") else None,
        "ops_per_step": ops.ops / _OPS_STEPS,
        "host_syncs_per_step": None if ops.host_syncs is None else ops.host_syncs / _OPS_STEPS,
        "schedule": "strategy" if stream.scheduled else "data",
        "dense_precision": run.dense_precision,
        "dense_precision_effective": effective_precision(run.dense_precision, device),
        "profile": profile,
        # what must fit on each device: the largest rank; and what the job holds in all
        "memory": {**_combine(ranks, max), "sum": _combine(ranks, sum)},
        "accuracy": accuracy,
        "counters": {
            "total": total,
            "per_step": {k: v / measured_steps for k, v in total.items()},
            **_derived_rates(total),
        },
        "extra": _combine_extra([r["extra"] for r in ranks]),
        "per_rank": [{**r, **_derived_rates(r["counters"])} for r in ranks] if env.world_size > 1 else None,
        "weights_file": weights_file,
    }


def _profile(step, device: torch.device, path: Path, top: int = 15) -> dict[str, Any]:
    """A few untimed steps under torch.profiler: a Chrome trace at ``path`` and the operators
    that took the most time on the host and on the device."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        for _ in range(_PROFILE_STEPS):
            step()
    path.parent.mkdir(parents=True, exist_ok=True)
    prof.export_chrome_trace(str(path))
    events = prof.key_averages()

    def device_us(e) -> float:
        return float(getattr(e, "self_device_time_total", getattr(e, "self_cuda_time_total", 0.0)))

    def rows(key) -> list[dict[str, Any]]:
        ranked = sorted(events, key=key, reverse=True)[:top]
        return [{"op": e.key, "calls": e.count / _PROFILE_STEPS, "self_cpu_us": e.self_cpu_time_total / _PROFILE_STEPS,
                 "self_device_us": device_us(e) / _PROFILE_STEPS} for e in ranked if key(e) > 0]

    return {"trace": path.name, "steps": _PROFILE_STEPS, "top_host": rows(lambda e: e.self_cpu_time_total),
            "top_device": rows(device_us) if device.type == "cuda" else []}


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
    if isinstance(exc, (torch.OutOfMemoryError, MemoryError)) or "out of memory" in str(exc).lower():
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
        cell = Cell(spec["cell"]["strategy"], spec["cell"]["params"], spec["cell"]["world_size"])
        device = resolve_device(scenario.run.device, local_rank)
        if world > 1:
            if device.type == "cuda":
                torch.cuda.set_device(device)
            dist.init_process_group("nccl" if device.type == "cuda" else "gloo", rank=rank, world_size=world)
            group = dist.group.WORLD
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // world))
        env = RuntimeEnv(device=device, world_size=world, rank=rank)
        weights = Path(spec["weights"]) if spec.get("weights") else None
        profile = Path(spec["profile"]) if spec.get("profile") else None
        metrics = run_cell(scenario, cell, env, weights, group, progress=spec.get("progress"), profile_path=profile)
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
