"""A model of throughput at other world sizes and link bandwidths, from one measured cell.

This is a model, not a measurement. For a cell measured on ``W0`` ranks with a step time of
``T0`` (the median of its repeats' medians: the one statistic ``show``, ``compare`` and every
table print, :func:`embbench.columns.speed`), the rank that spent the most time in
collectives spent ``S0`` seconds per step in them on average (counted as a total over the
measured steps)::

    K0        = T0 - S0                                   compute per step at W0
    t(W, bw)  = K0 * W0 / W  +  C(W) / bw  +  4 * lat      projected step time (lat: W > 1 only)
    samples/s = B / t(W, bw)

``C(W)`` is the bytes the busiest rank sends per training step under table-wise placement
(:func:`comm_bytes_per_rank`, exact for embbench's placement and torchrec's table_wise):
its samples' ids for other ranks' tables, its tables' pooled rows for other ranks'
samples, and the gradients of other ranks' pooled rows going back. ``B`` is the global
batch; ``lat`` a per-collective latency (four all-to-alls per step: lengths, ids, pooled
rows, gradients; default 0). Assumed: compute scales perfectly with 1/W (balanced tables,
data-parallel dense part, no contention for cores or memory), communication does not
overlap compute, one link bandwidth per rank. Projecting from a run on one rank ignores
everything that only a multi-rank run shows (collective overheads, stragglers): prefer a
measured multi-rank cell as the starting point. At the measured world size and the measured
bandwidth the model gives back ``T0``: the measured samples/s it shows are ``show``'s.
"""

from __future__ import annotations

from typing import Any

from embbench.columns import counted_steps, speed
from embbench.data.presets import TableSpec
from embbench.results import Record
from embbench.sharding import plan_table_wise

__all__ = ["ASSUMPTIONS", "DEFAULT_LINKS_GBPS", "comm_bytes_per_rank", "measured_step_and_comm", "project",
           "why_not_projectable"]

#: What every projection assumes, in one line (printed above its table).
ASSUMPTIONS = ("compute scales as 1/W (balanced tables, data-parallel dense part, no contention), communication is "
               "table-wise all-to-all that does not overlap compute, one link bandwidth per rank")

#: Per-rank, per-direction bandwidths (GB/s): H100 NVLink 4, PCIe 5 x16 in practice, 100 Gb/s
#: and 400 Gb/s networks.
DEFAULT_LINKS_GBPS = {"nvlink": 450.0, "pcie5": 50.0, "net400": 50.0, "net100": 12.5}


def comm_bytes_per_rank(tables: list[TableSpec], batch: int, world: int) -> list[int]:
    """Bytes each rank sends to the others in one training step (table-wise placement)."""
    if world == 1:
        return [0]
    owned = [[t for t, o in enumerate(plan_table_wise(tables, world)) if o == r] for r in range(world)]
    local = batch // world
    dim = tables[0].dim
    sent = []
    for r in range(world):
        others = [t for o in range(world) if o != r for t in owned[o]]
        ids = sum(local * tables[t].bag_size * 8 + local * 8 for t in others)  # ids and lengths, int64
        pooled = (world - 1) * local * len(owned[r]) * dim * 4
        grads = len(others) * local * dim * 4
        sent.append(ids + pooled + grads)
    return sent


def measured_step_and_comm(metrics: dict[str, Any]) -> tuple[float, float]:
    """``(T0, S0)``: the step time every table prints (:func:`embbench.columns.speed`: the
    median of the repeats' medians) and the time in collectives per step of the rank that
    spent the most time in collectives."""
    per_rank = metrics.get("per_rank") or [{"counters": metrics["counters"]["total"]}]
    if all("timed_comm_us" in r for r in per_rank):  # over the timed steps, as the step time is
        return speed(metrics).step_s, max(r["timed_comm_us"] for r in per_rank) / 1e6 / metrics["measured_steps"]
    # older records: the counters' steps (the measured ones before the counted steps existed)
    busiest = max(per_rank, key=lambda r: r["counters"].get("comm_us", 0))
    return speed(metrics).step_s, busiest["counters"].get("comm_us", 0) / 1e6 / counted_steps(metrics)


def why_not_projectable(record: Record) -> str | None:
    """Why a measured cell is no ground for a projection, or None: its ranks shared CPU cores
    (the step time then measures the time-sharing, and dividing it by W is meaningless)."""
    m = record.metrics or {}
    if not str(m.get("device", "")).startswith("cpu") or record.world_size == 1:
        return None
    threads, cores = m.get("threads"), m.get("usable_cores")
    if threads is None or cores is None:  # a record from before threads were recorded
        cores = ((record.provenance.get("devices") or {}).get("cpu_count")) or 0
        threads = 1
    if record.world_size * threads > cores:
        return (f"its {record.world_size} ranks x {threads} thread(s) shared {cores} CPU core(s): the step time "
                f"measures the time-sharing")
    return None


def project(record: Record, tables: list[TableSpec], worlds: list[int], links_gbps: dict[str, float],
            latency_s: float = 0.0) -> list[dict[str, Any]]:
    """Projected step time and throughput for each world size and link (see module doc)."""
    m = record.metrics
    batch, w0 = m["samples_per_step"], record.world_size
    t0, s0 = measured_step_and_comm(m)
    compute = max(t0 - s0, 0.0)  # (a median step below the mean collective time: a wildly uneven run)
    rows = []
    for w in worlds:
        busiest = max(comm_bytes_per_rank(tables, batch, w))
        for link, gbps in links_gbps.items():
            t = compute * w0 / w + busiest / (gbps * 1e9) + (4 * latency_s if w > 1 else 0.0)
            rows.append({"world_size": w, "link": link, "gbps": gbps, "step_s": t, "samples_per_s": batch / t,
                         "comm_bytes_per_rank": busiest, "measured_step_s": t0})
    return rows
