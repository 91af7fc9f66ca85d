"""A record as flat, named columns: the one place that knows where each number lives.

``show --csv/--json``, ``compare``, ``recommend`` and the HTML report all read records
through :func:`flat_row`, so a number means the same thing in each of them.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any

from embbench.results import Record

__all__ = ["Reference", "Speed", "all_in_hbm_throughputs", "baseline_throughputs", "counted_steps", "device_need_bytes", "flat_row", "flat_rows", "get", "gpu_names", "speed", "tier_columns", "tier_names"]


def get(d: Any, *keys: str) -> Any:
    """``d[k1][k2]...``, or None where a level is missing."""
    for k in keys:
        if not isinstance(d, dict):
            return None
        d = d.get(k)
    return d


def gpu_names(provenance: dict[str, Any]) -> list[str]:
    """The names of the GPUs a record was made on: each is a mapping with its ``name`` (and
    memory, capability, ...); records written before provenance came from collect_env hold
    the names alone."""
    gpus = get(provenance, "devices", "gpus") or []
    return [str(g.get("name")) if isinstance(g, dict) else str(g) for g in gpus]


@dataclass(frozen=True)
class Speed:
    """A cell's speed as every table states it: one statistic over repeats (:mod:`embbench.stats`)."""

    #: the step time: the median of the repeat medians (of all steps, for records older than that)
    step_s: float
    #: global samples per second from that same step time
    throughput: float
    throughput_interval: tuple[float, float] | None
    #: each repeat's median step
    repeat_medians_s: list[float]
    #: the interval's half-width over the step time (the larger side); None: no interval
    noise: float | None
    #: why the speed is not to be bet on (:func:`embbench.noise.flags`)
    flags: list[str]


def speed(metrics: dict[str, Any]) -> Speed:
    """A record's :class:`Speed`. Records made before repeats were the unit are read by the same
    rule: their repeat medians from the steps in order, their throughput interval recomputed."""
    from embbench.noise import flags
    from embbench.optional import MissingDependency
    from embbench.stats import repeat_medians, summarize_repeats

    step, rate, batch = metrics["step_time_s"], metrics["throughput"], metrics["samples_per_step"]
    medians = step.get("repeat_medians")
    if not medians:
        try:
            medians = repeat_medians(step["samples"], len(step["samples"]) // len(rate["per_repeat"]))
        except ValueError:  # steps that do not split into its repeats: one sample, no interval
            medians = [statistics.median(step["samples"])]
    try:
        summary = summarize_repeats(medians)
    except MissingDependency:  # no scipy: the point without its interval
        summary = None
    step_s = step.get("median_of_repeats") or statistics.median(medians)
    if summary is None:
        interval, noise = None, None
    else:
        interval, noise = summary.throughput(batch)[1], summary.noise
    return Speed(step_s, batch / step_s, interval, list(medians), noise,
                 flags(metrics.get("noise"), noise) + filling_flags(metrics))


def filling_flags(metrics: dict[str, Any]) -> list[str]:
    """``filling``: a cache timed while it still filled, so cheaper than in its steady state
    (it loads without evicting or writing back): slots empty when timing started, or a miss
    rate that had not settled (the runner's warm-up rule, :func:`embbench.runner._warm_up`)."""
    empty = metrics.get("empty_slots_at_timing")
    if empty:
        return [f"filling: {empty:,} of its slots were empty when timing started"]
    if metrics.get("warmup_steady") is False:
        return [f"filling: its miss rate still fell after {metrics.get('warmup_steps_run')} warm-up steps"]
    return []


def device_need_bytes(memory: dict[str, Any]) -> int:
    """What must fit on one device: the measured peak allocation where the device reports
    one (CUDA), else the strategy's static device bytes (a CPU "device" has no allocator peak)."""
    peak = memory.get("peak_allocated_bytes")
    return max(peak, memory["static_device_bytes"]) if peak is not None else memory["static_device_bytes"]


def flat_row(record: Record) -> dict[str, Any]:
    """One cell's numbers and the raw fields people filter on, as ``column -> value``.

    Scalars except ``throughput_per_repeat``, ``step_time_repeat_medians`` and ``step_time_samples``
    (lists). Memory is per
    rank (the largest rank) unless the column says ``all_ranks``; counters are per step; the memory
    tiers' figures are ``tier.<tier>.<field>`` (:func:`tier_columns`).
    """
    p = record.provenance
    row: dict[str, Any] = {
        "cell_id": record.cell_id,
        "strategy": record.strategy,
        "world_size": record.world_size,
        "status": record.status,
        "message": record.message,
        "semantics": record.semantics,
        **{f"param.{k}": v for k, v in sorted(record.params.items())},
        "row_precision": record.row_precision,
    }
    m = record.metrics
    if m:
        step, rate, mem = m["step_time_s"], m["throughput"], m["memory"]
        all_ranks = mem.get("sum") or mem
        fast = speed(m)
        ci = fast.throughput_interval or [None, None]
        cpu = m.get("cpu_seconds_per_step")  # every thread of every rank, per step
        row.update({
            "throughput": fast.throughput,
            "speedup": None,  # needs the baseline's record: see flat_rows
            "speedup_vs_hbm": None,  # and the fastest all-in-HBM cell's
            "fastest_hbm_cell": None,
            "throughput_ci95_low": ci[0],
            "throughput_ci95_high": ci[1],
            **({"throughput_ci95_missing": rate["ci95_missing"]} if "ci95_missing" in rate else {}),
            "noise": fast.noise,
            "flags": "; ".join(fast.flags),
            "step_time_median_s": fast.step_s,
            "step_time_p95_s": step["p95"],
            "step_time_iqr_s": step["iqr"],
            "step_time_stddev_s": step["stddev"],
            "measured_steps": step["n"],
            "repeats": len(fast.repeat_medians_s),
            "threads": m.get("threads"),
            "cpu_seconds_per_step": cpu,
            "others_cpu_share": get(m, "noise", "others_cpu_share"),
            "device_bytes": device_need_bytes(mem),
            "static_device_bytes": mem["static_device_bytes"],
            "peak_allocated_bytes": mem.get("peak_allocated_bytes"),
            "peak_reserved_bytes": mem.get("peak_reserved_bytes"),
            "host_bytes": mem["static_host_bytes"] + mem["pinned_bytes"],
            "host_bytes_all_ranks": all_ranks["static_host_bytes"] + all_ranks["pinned_bytes"],
            "static_host_bytes": mem["static_host_bytes"],
            "pinned_bytes": mem["pinned_bytes"],
            "peak_rss_bytes": mem.get("peak_rss_bytes"),
            "hit_rate": get(m, "counters", "hit_rate"),
            "unique_hit_rate": get(m, "counters", "unique_hit_rate"),
            "belady_hit_rate": get(m, "extra", "belady_hit_rate"),
            "belady_unique_hit_rate": get(m, "extra", "belady_unique_hit_rate"),
            "capacity_rows": get(m, "extra", "capacity_rows"),
            "auc": get(m, "accuracy", "auc"),
            "logloss": get(m, "accuracy", "logloss"),
            "train_loss_last10": get(m, "accuracy", "train_loss_last10"),
            "max_weight_diff_vs_baseline": m.get("max_weight_diff_vs_baseline"),
            "max_weight_diff_vs_baseline_same_precision": m.get("max_weight_diff_vs_baseline_same_precision"),
            "row_bytes": m.get("row_bytes"),
            "max_weight_diff_vs_fp32": get(m, "weight_diff_vs_fp32", "max"),
            "mean_weight_diff_vs_fp32": get(m, "weight_diff_vs_fp32", "mean"),
            "build_seconds": m.get("build_seconds"),
            "generator_samples_per_s": m.get("generator_samples_per_s"),
            **instrument_columns(m),
            **{k: m[k] for k in ("ops_per_step", "host_syncs_per_step", "warmup_steps_run", "weights_not_compared",
                                 "weights_not_compared_same_precision",
                                 "train_loss_last10_diff_vs_baseline", "logloss_diff_vs_baseline") if k in m},
            **{f"per_step.{k}": v for k, v in sorted((get(m, "counters", "per_step") or {}).items())},
            **tier_columns(m),
            "throughput_per_repeat": rate["per_repeat"],
            "step_time_repeat_medians": fast.repeat_medians_s,
            "step_time_samples": step["samples"],
        })
    row.update({
        "scenario": get(record.scenario, "name"),
        "scenario_digest": get(record.scenario, "digest"),
        "git_commit": get(p, "git", "commit"),
        "git_dirty": get(p, "git", "dirty"),
        "date": p.get("date"),
        "host": p.get("host"),
        **{f"version.{k}": v for k, v in (p.get("versions") or {}).items()},
        "gpus": ", ".join(gpu_names(p)),
        "cpu": get(p, "devices", "cpu"),
    })
    return row


def counted_steps(metrics: dict[str, Any]) -> int:
    """The steps a record's counters cover (records before the counted steps: the measured ones)."""
    steps = (metrics.get("counters") or {}).get("steps")
    return steps[1] - steps[0] if steps else metrics["measured_steps"]


def instrument_columns(metrics: dict[str, Any]) -> dict[str, Any]:
    """``metrics.instruments`` as columns: their names, and what they cost together in the
    counted steps (per step, and as a share of the timed step); None where the record has none."""
    instruments = metrics.get("instruments") or []
    first = instruments[0] if instruments else {}
    return {"instruments": ", ".join(i["name"] for i in instruments) or None,
            "instruments_cost_s_per_step": first.get("cost_s_per_step"), "instruments_cost_share": first.get("cost_share")}


def tier_columns(metrics: dict[str, Any]) -> dict[str, Any]:
    """``metrics.tiers`` (:func:`embbench.metrics.memory_tiers`) as ``tier.<tier>.<field>``
    columns, the tiers in the record's order (the device's first)."""
    tiers = {t["tier"]: dict(t) for t in metrics.get("tiers") or []}
    if "nvme" in tiers and "dram" in tiers:  # records before issue 49 gave host memory the device's traffic
        dram, nvme = tiers["dram"], tiers["nvme"]
        dram.pop("rows_written_per_step", None)
        dram.update({k: nvme.get(k) for k in ("rows_read_per_step", "bytes_read_per_step", "bytes_written_per_step")})
    return {f"tier.{name}.{k}": v for name, t in tiers.items() for k, v in t.items() if k != "tier"}


def tier_names(row: dict[str, Any]) -> list[str]:
    """The tiers a :func:`flat_row` has columns of, in their order."""
    return list(dict.fromkeys(k.split(".")[1] for k in row if k.startswith("tier.")))


def baseline_throughputs(records: list[Record]) -> dict[tuple[str, int], float]:
    """The throughput each record's speedup is against, by (scenario digest, world size): its own
    scenario's baseline at the same ranks (never across scenarios), with fp32 rows where the
    baseline also ran in lower precisions (the reference each precision is set beside)."""
    base: dict[tuple[str, int], float] = {}
    for r in sorted(records, key=lambda r: r.row_precision != "fp32"):
        if r.strategy == r.baseline and r.status == "ok" and r.metrics:
            base.setdefault((r.scenario["digest"], r.world_size), speed(r.metrics).throughput)
    return base


@dataclass(frozen=True)
class Reference:
    """The cell a speed ratio is against: its id and throughput."""

    cell_id: str
    throughput: float


def all_in_hbm_throughputs(records: list[Record]) -> dict[tuple[str, int], Reference]:
    """The fastest cell of each scenario and world size whose strategy keeps every table in
    device memory (``Strategy.all_in_hbm``: ``device``, torchrec's ``gpu_sharded``), fp32 rows:
    what a cache is also held against, beside the baseline (which stays the reference for
    weights). Strategies not installed here count as not all-in-HBM."""
    from embbench.strategy import is_all_in_hbm

    best: dict[tuple[str, int], Reference] = {}
    for r in records:
        if r.status == "ok" and r.metrics and r.row_precision == "fp32" and is_all_in_hbm(r.strategy):
            key, rate = (r.scenario["digest"], r.world_size), speed(r.metrics).throughput
            if key not in best or rate > best[key].throughput:
                best[key] = Reference(r.cell_id, rate)
    return best


def flat_rows(records: list[Record]) -> list[dict[str, Any]]:
    """:func:`flat_row` of each record, with ``speedup``: its throughput over
    :func:`baseline_throughputs`, and ``speedup_vs_hbm``: over the fastest all-in-HBM cell
    (:func:`all_in_hbm_throughputs`, named in ``fastest_hbm_cell``); None without one measured."""
    base, hbm = baseline_throughputs(records), all_in_hbm_throughputs(records)
    rows = []
    for r in records:
        row = flat_row(r)
        key = (r.scenario["digest"], r.world_size)
        if "throughput" in row and base.get(key):
            row["speedup"] = row["throughput"] / base[key]
        if "throughput" in row and key in hbm:
            row["speedup_vs_hbm"], row["fastest_hbm_cell"] = row["throughput"] / hbm[key].throughput, hbm[key].cell_id
        rows.append(row)
    return rows
