"""Records with chosen numbers, written as a run directory, for the tests of the commands
that read runs (compare, report, recommend, show)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from embbench.metrics import memory_tiers, speed_figures
from embbench.results import Record, write_record
from embbench.scenario import Cell

BATCH = 512
PROVENANCE = {
    "date": "2026-01-01T00:00:00+00:00", "command": "embbench run smoke.yaml", "host": "test",
    "git": {"commit": "0" * 40, "branch": "main", "dirty": False},
    "versions": {"python": "3.11.7", "torch": "2.11.0", "cuda": "12.8", "torchrec": "1.6.1", "fbgemm_gpu": "1.6.0", "embbench": "0.1.0"},
    "devices": {"cpu": "test cpu", "cpu_count": 16, "gpus": [
        {"name": "NVIDIA H100 80GB HBM3", "memory_bytes": 85 * 10**9, "capability": "9.0", "multiprocessors": 132}]},
}


#: A row's bytes in the tier counters below: dim 8 in fp32 with a rowwise-adagrad state.
ROW_BYTES = 36


def cache_counters(reached: int, loaded: int, written_back: int = 0) -> dict[str, int]:
    """A device cache's cumulative counters as :func:`embbench.metrics.memory_tiers` reads them:
    ``reached`` distinct rows over the batches, ``loaded`` of them into the cache from host
    memory, ``written_back`` out of it."""
    return {"unique_accesses": reached, "unique_misses": loaded, "hits": 0, "accesses": 0,
            "bytes_h2d": loaded * ROW_BYTES, "bytes_d2h": written_back * ROW_BYTES, "rows_written_back": written_back}


def file_store_counters(reached: int, loaded: int, dram_misses: int, pages_read: int, pages_written: int = 0,
                        stall_s: float = 0.0, read_s: float = 0.0, dram_write_backs: int = 0) -> dict[str, int]:
    """:func:`cache_counters` of a cache whose host rows are in a file (``store: file``): of the
    ``loaded`` rows, ``dram_misses`` were not in host memory and came from the drive's pages."""
    return {**cache_counters(reached, loaded, dram_write_backs), "dram_loads": loaded, "dram_load_misses": dram_misses,
            "dram_write_backs": dram_write_backs, "dram_write_misses": 0, "nvme_pages_read": pages_read,
            "nvme_pages_written": pages_written, "nvme_pages_read_on_demand": 0, "nvme_pages_read_ahead": pages_read,
            "nvme_read_ns": int(read_s * 1e9),
            "stall_ns": int(stall_s * 1e9), "prefetch_batches_waited": 0}


def make_record(strategy: str = "device", params: dict | None = None, world_size: int = 1, status: str = "ok",
                step_times: list[float] | None = None, repeats: int = 3, device_bytes: int = 1 << 30,
                peak_bytes: int | None = None, host_bytes: int = 0, hit_rate: float | None = None,
                unique_hit_rate: float | None = None, extra: dict | None = None, auc: float | None = 0.75,
                digest: str = "d" * 64, provenance: dict | None = None, per_rank: list | None = None,
                message: str | None = None, baseline: str = "device", row_precision: str = "fp32",
                tier_counters: dict[str, int] | None = None, **metric_overrides: Any) -> Record:
    """A record whose step times (seconds) are ``step_times`` split into ``repeats`` repeats (in
    order), its speed figures made as the runner makes them; with ``tier_counters`` (the cache's
    cumulative counters over those steps), its ``metrics.tiers`` too."""
    cell = Cell(strategy, params or {}, world_size, row_precision)
    metrics = None
    if status == "ok":
        step_times = step_times or [0.01] * 12
        step_time, throughput = speed_figures(step_times, len(step_times) // repeats, BATCH)
        memory = {"static_device_bytes": device_bytes, "static_host_bytes": host_bytes, "pinned_bytes": 0,
                  "peak_rss_bytes": 1 << 30, "peak_allocated_bytes": peak_bytes, "peak_reserved_bytes": peak_bytes}
        metrics = {
            "device": "cuda:0", "world_size": world_size, "samples_per_step": BATCH, "measured_steps": len(step_times),
            "warmup_steps": 3, "build_seconds": 0.1, "step_time_s": step_time, "throughput": throughput,
            "generator_samples_per_s": 1e6,
            "memory": {**memory, "sum": {k: None if v is None else v * world_size for k, v in memory.items()}},
            "accuracy": {"train_loss_last10": 0.5, **({"auc": auc, "logloss": 0.5} if auc is not None else {})},
            "counters": {"total": {}, "per_step": {}, "hit_rate": hit_rate, "unique_hit_rate": unique_hit_rate},
            "extra": extra or {},
            "per_rank": per_rank,
            "weights_file": None,
            **({"tiers": memory_tiers(tier_counters, len(step_times), ROW_BYTES)} if tier_counters else {}),
            **metric_overrides,
        }
    if status != "ok" and message is None:
        message = f"{status} (a test record)"  # every status but ok says why
    return Record(cell_id=cell.id, strategy=strategy, params=params or {}, world_size=world_size,
                  row_precision=row_precision, status=status,
                  message=message, baseline=baseline,
                  scenario={"name": "smoke", "file": "scenarios/smoke.yaml", "digest": digest, "config": {}},
                  metrics=metrics, provenance=provenance or PROVENANCE)


def write_run(directory: Path, records: list[Record]) -> Path:
    """The records as a run directory, one ``<cell slug>.json`` each (as ``embbench run`` writes)."""
    for r in records:
        write_record(directory, Cell(r.strategy, r.params, r.world_size, r.row_precision).slug, r)
    return directory
