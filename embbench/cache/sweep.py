"""freqcache's policy against Belady's MIN on one-table workloads, on the CPU, without training.

``python -m embbench.cache.sweep scenarios/freqcache_policy_sweep.yaml [--out FILE.json]``

Every combination of the sweep file's lists is one workload: a table of ``rows`` rows with
Zipf exponent ``alpha``, batches of ``batch_ids`` ids from the synthetic generator, a cache
of ``cache_ratio`` of the rows. The very planner freqcache trains with
(:class:`~embbench.cache.policy.SlotPlanner`) is driven as the runner drives it (profile and
preload, look-ahead, each batch planned while the previous one runs). The stream is
``profile_batches`` (profiled, then the cache's preload), ``warmup_steps`` and ``steps``
batches; the hit rates over the last ``steps``, per access and per distinct row of each
batch, are compared with Belady's MIN run over the whole stream from an empty cache and
counted over the same batches (both have seen the same past).
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
from pathlib import Path
from typing import Annotated, Callable, Literal

import numpy as np
import torch
from pydantic import Field

from embbench.bounds import Config, Seed
from embbench.cache.device_planner import DevicePlanner, cache_window, window_size
from embbench.cache.policy import SlotPlanner
from embbench.data import Stream, SyntheticCriteo, TableSpec
from embbench.metrics import belady_hit_rates
from embbench.outputs import claim_output, head_has
from embbench.scenario import ScenarioError, read_yaml, validate_config

__all__ = ["Sweep", "Workload", "freqcache_policy", "run_sweep", "simulate"]


# The bounds of a workload's values, for a sweep's lists and a workload alike (finite, no
# boolean for a number: embbench.bounds.Config).
Alpha = Annotated[float, Field(ge=0)]
Rows = Annotated[int, Field(gt=0)]
CacheRatio = Annotated[float, Field(gt=0, le=1)]
BatchIds = Annotated[int, Field(gt=0)]
Admission = Literal["all", "tinylfu"]
Lookahead = Annotated[int, Field(ge=0)] | Literal["auto"]
Planner = Literal["device", "host"]
DriftEvery = Annotated[int, Field(ge=0)]
Fraction = Annotated[float, Field(ge=0, le=1)]
Dim = Annotated[int, Field(gt=0)]


class Sweep(Config):
    """A sweep file: lists are crossed into workloads; the rest applies to all of them."""

    name: str
    description: str = ""
    alpha: list[Alpha] = Field(min_length=1)
    rows: list[Rows] = Field(min_length=1)
    cache_ratio: list[CacheRatio] = Field(min_length=1)
    batch_ids: list[BatchIds] = Field(min_length=1)
    admission: list[Admission] = Field(["tinylfu"], min_length=1)
    lookahead: list[Lookahead] = Field(["auto"], min_length=1)
    planner: list[Planner] = Field(["device"], min_length=1)
    drift_every: list[DriftEvery] = Field([0], min_length=1, description="the hot ids change every this many batches (0: never)")
    dim: list[Dim | None] = Field(
        [None], min_length=1, description="embedding dim: look-ahead auto's window is bounded by bytes as freqcache "
                                          "bounds it (rows with rowwise-Adagrad state); null: no bound")
    drift_fraction: Fraction = Field(0.2, description="the share of hot ids remapped at each change")
    decay_every: int = Field(256, ge=0)
    profile_batches: int = Field(32, ge=0)
    warmup_steps: int = Field(16, ge=0)
    steps: int = Field(64, gt=0)
    seed: Seed = 0


class Workload(Config):
    alpha: Alpha
    rows: Rows
    cache_ratio: CacheRatio
    batch_ids: BatchIds
    admission: Admission = "tinylfu"
    lookahead: Lookahead = "auto"
    planner: Planner = "device"
    drift_every: DriftEvery = 0
    drift_fraction: Fraction = 0.0
    dim: Dim | None = None


def simulate(w: Workload, decay_every: int = 256, profile_batches: int = 32, warmup_steps: int = 16,
             steps: int = 64, seed: int = 0, batch_rows: Callable[[int], np.ndarray] | None = None,
             moves: Callable[[int, np.ndarray, np.ndarray], None] | None = None) -> dict:
    """The policy's and Belady's hit rates on one workload (see the module docstring).
    ``batch_rows(i)``: the rows (global, one per id, ``w.batch_ids`` of them) of training batch
    ``i`` of another stream (several tables); by default the workload's one synthetic table.
    ``moves(i, loaded, written_back)``: told the rows each planned batch ``i`` loads and writes
    back (the preload's as the last profiled batch's)."""
    if batch_rows is None:
        table = TableSpec("t0", w.rows, 1, 1, w.alpha)
        drift = {"drift_every": w.drift_every, "drift_fraction": w.drift_fraction} if w.drift_every else {}
        data = SyntheticCriteo([table], seed, **drift)

        def batch_rows(i: int) -> np.ndarray:
            return data.batch(Stream.TRAIN, i, w.batch_ids).sparse.values.numpy()

    first, total = profile_batches, profile_batches + warmup_steps + steps
    capacity = max(1, min(w.rows, round(w.cache_ratio * w.rows)))
    batches = [batch_rows(i) for i in range(first)]
    # The window as freqcache sizes it from the same profile (its bytes bounded only if dim is given),
    # never beyond the planned batches: a window beyond them is memory for nothing.
    distinct = [len(np.unique(b)) for b in batches]
    if w.dim is None:
        lookahead, window_rows = window_size(distinct, capacity, w.batch_ids, None if w.lookahead == "auto" else w.lookahead)
    else:
        lookahead, window_rows = cache_window(distinct, w.rows, capacity, w.batch_ids, (w.dim + 1) * 4, w.lookahead)
    lookahead = min(lookahead, total - first)
    batches += [batch_rows(i) for i in range(first, total + lookahead)]
    if w.planner == "device":
        c = _drive_device(w, batches, capacity, lookahead, window_rows, first, total, warmup_steps, decay_every, moves)
    else:
        c = _drive_host(w, batches, capacity, lookahead, first, total, warmup_steps, decay_every, moves)
    per_access, per_distinct = belady_hit_rates([torch.from_numpy(b) for b in batches[:total]], capacity,
                                                skip=first + warmup_steps)
    hit, unique_hit = c["hits"] / c["accesses"], 1 - c["unique_misses"] / c["unique_accesses"]
    return {**w.model_dump(), "lookahead_batches": lookahead, "window_rows": window_rows, "capacity": capacity, "hit_rate": hit, "belady_hit_rate": per_access,
            "unique_hit_rate": unique_hit, "belady_unique_hit_rate": per_distinct,
            "window_pairs_dropped": c.get("window_pairs_dropped"),
            "gap": per_access - hit, "unique_gap": per_distinct - unique_hit}


def freqcache_policy(batch_rows, num_rows: int, batch_ids: int, profile_batches: int, warmup_steps: int, steps: int,
                     seed: int = 0):
    """``ratio -> (hit rate, unique hit rate)`` of freqcache's planner at its defaults (device
    planner, TinyLFU admission, automatic look-ahead) on a stream, driven by
    :func:`simulate` exactly as the sweep drives it (``point(ratio, moves)``: and told its
    moves, as :func:`simulate` tells them). ``batch_rows(i)``:
    training batch ``i``'s global rows (batches past the counted ones feed the look-ahead).
    Each ratio is simulated once: the curve and the tier model ask for the same one."""
    runs: dict[float, tuple[tuple[float, float], list]] = {}

    def point(ratio: float, moves=None) -> tuple[float, float]:
        if ratio not in runs:
            told: list = []
            w = Workload(alpha=0.0, rows=num_rows, cache_ratio=ratio, batch_ids=batch_ids)
            r = simulate(w, profile_batches=profile_batches, warmup_steps=warmup_steps, steps=steps, seed=seed,
                         batch_rows=batch_rows, moves=lambda *move: told.append(move))
            runs[ratio] = (r["hit_rate"], r["unique_hit_rate"]), told
        rates, told = runs[ratio]
        for move in told if moves else ():
            moves(*move)
        return rates

    return point


def _drive_host(w: Workload, batches: list[np.ndarray], capacity: int, lookahead: int, first: int, total: int,
                warmup_steps: int, decay_every: int, moves=None) -> dict:
    """The host planner's counters over the counted batches."""
    planner = SlotPlanner(w.rows, capacity, w.batch_ids, w.admission, decay_every=decay_every)
    preloaded = planner.profile(batches[:first])
    if moves:
        moves(max(first - 1, 0), preloaded, preloaded[:0])
    unique = [np.unique(b) for b in batches]
    for b in unique[first + 1 : first + 1 + lookahead]:
        planner.expect(b, +1)
    running, start = None, {}
    for i in range(first, total):
        if i == first + warmup_steps:
            start = dict(planner.counters)
        if i > first and lookahead:  # the batch leaves the window; the next one enters it
            planner.expect(unique[i], -1)
            planner.expect(unique[i + lookahead], +1)
        plan = planner.plan(batches[i], train=True, running=running)
        running = plan.id
        if moves:
            moves(i, plan.load_rows, plan.write_back_rows)
    return {k: planner.counters[k] - start.get(k, 0) for k in planner.counters}


def _drive_device(w: Workload, batches: list[np.ndarray], capacity: int, lookahead: int, window_rows: int, first: int,
                  total: int, warmup_steps: int, decay_every: int, moves=None) -> dict:
    """The device planner's counters over the counted batches (on the CPU), driven as freqcache
    drives it: the window holds the ``lookahead`` batches after the one being planned."""
    rows = [torch.from_numpy(b) for b in batches]
    planner = DevicePlanner(w.rows, capacity, w.batch_ids, lookahead, torch.device("cpu"), w.admission,
                            decay_every=decay_every, window_rows=window_rows)
    preloaded = planner.profile(rows[:first])
    if moves:
        moves(max(first - 1, 0), preloaded.numpy(), np.empty(0, np.int64))
    numbers: dict[int, int] = {}
    running, start = None, {}
    for i in range(first, total):
        if i == first + warmup_steps:
            start = planner.counters()
        for j in range(i + 1, i + 1 + lookahead):
            if j not in numbers:
                numbers[j] = planner.enter(rows[j])
        plan = planner.plan(rows[i], train=True, running=running, number=numbers.pop(i, None))
        running = plan.id
        if moves:  # the padding's host row is past the table's
            loaded, written = plan.load_rows.numpy(), plan.write_back_rows.numpy()
            moves(i, loaded[loaded < plan.pad_row], written[written < plan.pad_row])
    end = planner.counters()
    return {k: end[k] - start.get(k, 0) for k in end}


def run_sweep(sweep: Sweep):
    """Each workload's result, as it is computed."""
    keys = ("alpha", "rows", "cache_ratio", "batch_ids", "admission", "lookahead", "planner", "dim", "drift_every")
    for values in itertools.product(*(getattr(sweep, k) for k in keys)):
        w = Workload(**dict(zip(keys, values)), drift_fraction=sweep.drift_fraction if values[-1] else 0.0)
        yield simulate(w, sweep.decay_every, sweep.profile_batches, sweep.warmup_steps, sweep.steps,
                       sweep.seed)


def _summary(results: list[dict]) -> str:
    lines = []
    for admission, lookahead, planner, dim in sorted({(r["admission"], r["lookahead"], r["planner"], r["dim"]) for r in results},
                                                     key=str):
        group = [r for r in results
                 if (r["admission"], r["lookahead"], r["planner"], r["dim"]) == (admission, lookahead, planner, dim)]
        u, a = [100 * r["unique_gap"] for r in group], [100 * r["gap"] for r in group]
        at_dim = "" if dim is None else f" dim={dim}"
        lines.append(f"planner={planner} admission={admission} lookahead={lookahead}{at_dim}: {len(group)} workloads; points below Belady "
                     f"per distinct row median {statistics.median(u):.2f} worst {max(u):.2f}, "
                     f"per access median {statistics.median(a):.2f} worst {max(a):.2f}")
    return "\n".join(lines)


def _ahead(r: dict) -> str:
    """The look-ahead in batches, marked ``a`` where it was chosen automatically (``/dim`` where
    the window's bytes were bounded for rows of that dim)."""
    dim = "" if r.get("dim") is None else f"/{r['dim']}"
    return f"{r['lookahead_batches']}{'a' if r['lookahead'] == 'auto' else ''}{dim}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m embbench.cache.sweep", description=__doc__.splitlines()[0])
    parser.add_argument("sweep", type=Path, help="sweep YAML file")
    parser.add_argument("--out", type=Path, help="write every workload's result here (JSON)")
    parser.add_argument("--overwrite", action="store_true", help="replace an existing --out that is not a sweep's result")
    args = parser.parse_args(argv)
    if args.out:
        try:
            claim_output(args.out, "--out", parser.prog, lambda path: head_has(path, b'"sweep"', b'"results"'),
                         args.overwrite)
        except ValueError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
    try:  # read and checked as `embbench run` reads a scenario, with the same messages
        sweep = validate_config(Sweep, read_yaml(args.sweep), str(args.sweep), "sweep")
    except ScenarioError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    results = []
    print(f"{'alpha':>5} {'rows':>8} {'cache':>6} {'batch':>6} {'adm':>7} {'ahead':>8} {'plan':>6} {'drift':>5} | "
          f"{'hit':>6} {'MIN':>6} {'gap':>5} | {'uniq':>6} {'MIN':>6} {'gap':>5}")
    for r in run_sweep(sweep):
        results.append(r)
        print(f"{r['alpha']:5.2f} {r['rows']:8d} {r['cache_ratio']:6.3f} {r['batch_ids']:6d} {r['admission']:>7} "
              f"{_ahead(r):>8} {r['planner']:>6} {r['drift_every']:5d} | {100 * r['hit_rate']:6.2f} {100 * r['belady_hit_rate']:6.2f} "
              f"{100 * r['gap']:5.2f} | {100 * r['unique_hit_rate']:6.2f} {100 * r['belady_unique_hit_rate']:6.2f} "
              f"{100 * r['unique_gap']:5.2f}", flush=True)
    print(_summary(results))
    if args.out:
        args.out.write_text(json.dumps({"sweep": sweep.model_dump(), "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
