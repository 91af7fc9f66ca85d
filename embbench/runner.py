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

from embbench.data import NUM_DENSE_FEATURES, Stream, SyntheticCriteo, TableSpec
from embbench.data.synthetic import _mix
from embbench.metrics import StepTimer, auc_logloss, confidence_interval, device_memory, peak_rss_bytes, summarize
from embbench.model import DLRM
from embbench.scenario import Cell, Scenario
from embbench.strategy import BuildContext, RuntimeEnv, Unsupported

__all__ = ["initial_weights", "resolve_device", "run_cell"]

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


def run_cell(scenario: Scenario, cell: Cell, env: RuntimeEnv, weights_path: Path | None = None,
             process_group: Any = None) -> dict[str, Any]:
    """Train and measure one cell on this rank; returns rank-local measurements."""
    run, device = scenario.run, env.device
    tables = scenario.tables()
    global_batch = scenario.data.batch_size
    if global_batch % env.world_size:
        raise ValueError(f"data.batch_size {global_batch} does not divide by world size {env.world_size}")
    local_batch = global_batch // env.world_size
    data = SyntheticCriteo(tables, run.seed, device)

    def train_batches(n: int):
        for i in range(n):
            yield data.batch(Stream.TRAIN, i, global_batch).shard(env.rank, env.world_size)

    strategy = cell.make_strategy()
    reason = strategy.unsupported_reason(env)
    if reason:
        raise Unsupported(reason)

    # The generator alone, so that it is visibly never the bottleneck.
    with StepTimer(device) as t:
        for i in range(3):
            data.batch(Stream.TRAIN, 10**9 + i, global_batch)
    generator_rate = 3 * global_batch / t.seconds

    ctx = BuildContext(
        tables=tables, env=env, optimizer=scenario.optimizer.embedding, local_batch_size=local_batch,
        init_weights=lambda t, a, b: initial_weights(tables[t], t, run.seed, a, b),
        train_batches=train_batches, warmup_steps=run.warmup_steps, process_group=process_group,
    )
    build_start = time.perf_counter()
    sparse = strategy.build(ctx)
    build_seconds = time.perf_counter() - build_start
    torch.manual_seed(run.seed)  # the same dense initial weights for every strategy
    model = DLRM(scenario.model, NUM_DENSE_FEATURES, len(tables), tables[0].dim).to(device)
    if env.world_size > 1:
        model = torch.nn.parallel.DistributedDataParallel(model, process_group=process_group)
    dense_optimizer = scenario.optimizer.dense.build(model.parameters())
    loss_fn = torch.nn.BCEWithLogitsLoss()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)

    batch_index = 0
    next_batch = data.batch(Stream.TRAIN, 0, global_batch).shard(env.rank, env.world_size)

    def step() -> tuple[float, torch.Tensor]:
        """One training step; returns (seconds, loss). Generating data is not timed."""
        nonlocal batch_index, next_batch
        batch = next_batch
        batch_index += 1
        next_batch = data.batch(Stream.TRAIN, batch_index, global_batch).shard(env.rank, env.world_size)
        with StepTimer(device) as timer:
            pooled = sparse(batch.sparse)
            sparse.prefetch(next_batch.sparse)
            loss = loss_fn(model(batch.dense, pooled), batch.labels)
            dense_optimizer.zero_grad(set_to_none=True)
            loss.backward()
            sparse.after_backward()
            dense_optimizer.step()
        return timer.seconds, loss.detach()

    for _ in range(run.warmup_steps):
        step()
    counters_before = sparse.counters()
    step_seconds: list[float] = []
    repeat_throughput: list[float] = []
    losses: list[torch.Tensor] = []
    for _ in range(run.repeats):
        repeat_seconds = 0.0
        for _ in range(run.steps):
            seconds, loss = step()
            step_seconds.append(seconds)
            losses.append(loss)
            repeat_seconds += seconds
        repeat_throughput.append(run.steps * global_batch / repeat_seconds)
    counters = _sum_counters(counters_before, sparse.counters())
    measured_steps = run.steps * run.repeats

    # Held-out evaluation: a separate stream, never seen by training or frequency statistics.
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
        auc, logloss = auc_logloss(all_logits, all_labels)
        accuracy.update(auc=auc, logloss=logloss, eval_samples=all_labels.numel())

    weights_file = None
    if weights_path is not None:
        flushed = sparse.flush()
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
        "extra": sparse.extra_metrics(),
    }
    ranks = _gather_objects(this_rank, env, process_group)
    total = {k: sum(r["counters"].get(k, 0) for r in ranks) for k in ranks[0]["counters"]}
    return {
        "device": str(device),
        "world_size": env.world_size,
        "samples_per_step": global_batch,
        "measured_steps": measured_steps,
        "warmup_steps": run.warmup_steps,
        "build_seconds": build_seconds,
        "step_time_s": summarize(step_seconds),
        "throughput": {
            "unit": "samples/s (global)",
            "per_repeat": repeat_throughput,
            "mean": sum(repeat_throughput) / len(repeat_throughput),
            "ci95": confidence_interval(repeat_throughput),
        },
        "generator_samples_per_s": generator_rate,
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
    if isinstance(exc, torch.OutOfMemoryError) or "out of memory" in str(exc).lower():
        return "oom"
    return "error"


def main(spec_path: str) -> int:
    """Entry point of one rank (see :mod:`embbench.launch`)."""
    from embbench.scenario import parse_scenario

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
        metrics = run_cell(scenario, cell, env, weights, group)
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
