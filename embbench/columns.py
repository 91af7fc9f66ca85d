"""A record as flat, named columns: the one place that knows where each number lives.

``show --csv/--json``, ``compare``, ``recommend`` and the HTML report all read records
through :func:`flat_row`, so a number means the same thing in each of them.
"""

from __future__ import annotations

from typing import Any

from embbench.results import Record

__all__ = ["device_need_bytes", "flat_row", "flat_rows", "get", "gpu_names"]


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


def device_need_bytes(memory: dict[str, Any]) -> int:
    """What must fit on one device: the measured peak allocation where the device reports
    one (CUDA), else the strategy's static device bytes (a CPU "device" has no allocator peak)."""
    peak = memory.get("peak_allocated_bytes")
    return max(peak, memory["static_device_bytes"]) if peak is not None else memory["static_device_bytes"]


def flat_row(record: Record) -> dict[str, Any]:
    """One cell's numbers and the raw fields people filter on, as ``column -> value``.

    Scalars except ``throughput_per_repeat`` and ``step_time_samples`` (lists). Memory is per
    rank (the largest rank) unless the column says ``all_ranks``; counters are per step.
    """
    p = record.provenance
    row: dict[str, Any] = {
        "cell_id": record.cell_id,
        "strategy": record.strategy,
        "world_size": record.world_size,
        "row_precision": record.row_precision,
        "status": record.status,
        "message": record.message,
        "semantics": record.semantics,
        **{f"param.{k}": v for k, v in sorted(record.params.items())},
    }
    m = record.metrics
    if m:
        step, rate, mem = m["step_time_s"], m["throughput"], m["memory"]
        all_ranks = mem.get("sum") or mem
        ci = rate.get("ci95") or [None, None]
        row.update({
            "throughput": rate["mean"],
            "speedup": None,  # needs the baseline's record: see flat_rows
            "throughput_ci95_low": ci[0],
            "throughput_ci95_high": ci[1],
            **({"throughput_ci95_missing": rate["ci95_missing"]} if "ci95_missing" in rate else {}),
            "step_time_median_s": step["median"],
            "step_time_p95_s": step["p95"],
            "step_time_iqr_s": step["iqr"],
            "step_time_stddev_s": step["stddev"],
            "measured_steps": step["n"],
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
            "row_bytes": m.get("row_bytes"),
            "max_weight_diff_vs_fp32": get(m, "weight_diff_vs_fp32", "max"),
            "mean_weight_diff_vs_fp32": get(m, "weight_diff_vs_fp32", "mean"),
            "build_seconds": m.get("build_seconds"),
            "generator_samples_per_s": m.get("generator_samples_per_s"),
            **{k: m[k] for k in ("ops_per_step", "host_syncs_per_step", "warmup_steps_run", "weights_not_compared") if k in m},
            **{f"per_step.{k}": v for k, v in sorted((get(m, "counters", "per_step") or {}).items())},
            "throughput_per_repeat": rate["per_repeat"],
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


def flat_rows(records: list[Record]) -> list[dict[str, Any]]:
    """:func:`flat_row` of each record, with ``speedup``: its throughput over the baseline's
    of the same scenario at the same world size (None without a measured baseline)."""
    base = {(r.scenario["digest"], r.world_size): r.metrics["throughput"]["mean"] for r in records
            if r.strategy == r.baseline and r.status == "ok" and r.metrics}
    rows = []
    for r in records:
        row = flat_row(r)
        key = (r.scenario["digest"], r.world_size)
        if "throughput" in row and base.get(key):
            row["speedup"] = row["throughput"] / base[key]
        rows.append(row)
    return rows
