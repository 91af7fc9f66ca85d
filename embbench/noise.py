"""The noise floor of a measurement: what else the machine did while a cell was timed.

A cell samples the machine at the start and at the end of its timed steps (:func:`sample`):
load average, the CPU time all processes spent (``/proc/stat``), the time stolen by a
hypervisor, the memory available, and on CUDA the GPU's clock, temperature and the other
processes on it. With the CPU time the cell's own ranks spent over the same window,
:func:`noise_floor` says how much of the machine *other* processes took. :func:`flags` turns a
record's noise into the warnings the tables, ``compare`` and ``recommend`` print: a cell
measured on a busy machine, or whose interval over repeats is wide, is not a result to bet on.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path
from typing import Any

from embbench.stats import spread_text

__all__ = ["BUSY_OTHERS_SHARE", "BUSY_STEAL_SHARE", "WIDE_NOISE", "flags", "gpu_id", "mem_available", "noise_floor",
           "sample", "usable_cores"]

#: Other processes took more than this share of the cores this process may use: a busy machine.
BUSY_OTHERS_SHARE = 0.10
#: The hypervisor stole more than this share of the CPU time: a busy host.
BUSY_STEAL_SHARE = 0.02
#: An interval over repeats wider than ±this share of the step time: a noisy cell.
WIDE_NOISE = 0.10

# /proc/stat's cpu line: user nice system idle iowait irq softirq steal guest guest_nice
# (guest time is already in user). Busy is everything but idle, iowait and steal.
_BUSY_FIELDS = (0, 1, 2, 5, 6)
_STEAL_FIELD = 7


def usable_cores() -> tuple[int, str]:
    """The cores this process may use, and what sets the number: its CPU affinity, lowered to
    the cgroup's CPU quota (``cpu.max``, cgroup v2; ``cfs_quota_us`` / ``cfs_period_us``, v1)."""
    cores, source = len(os.sched_getaffinity(0)), "CPU affinity"
    quota = None
    try:
        limit, period = Path("/sys/fs/cgroup/cpu.max").read_text().split()[:2]
        quota = None if limit == "max" else int(limit) / int(period)
    except (OSError, ValueError):
        try:
            limit = int(Path("/sys/fs/cgroup/cpu/cpu.cfs_quota_us").read_text())
            period = int(Path("/sys/fs/cgroup/cpu/cpu.cfs_period_us").read_text())
            quota = limit / period if limit > 0 else None
        except (OSError, ValueError):
            pass
    if quota is not None and int(quota) < cores:
        cores, source = max(1, int(quota)), "cgroup CPU quota"
    return cores, source


def _proc_stat() -> tuple[float, float] | None:
    """(busy, stolen) CPU seconds of the whole machine since boot, or None where unreadable."""
    try:
        fields = [int(v) for v in Path("/proc/stat").read_text().splitlines()[0].split()[1:]]
    except (OSError, ValueError, IndexError):
        return None
    hz = os.sysconf("SC_CLK_TCK")
    steal = fields[_STEAL_FIELD] if len(fields) > _STEAL_FIELD else 0
    return sum(fields[i] for i in _BUSY_FIELDS if i < len(fields)) / hz, steal / hz


def mem_available() -> int | None:
    """The kernel's MemAvailable in bytes, or None where unreadable."""
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def gpu_id(device: Any) -> str | None:
    """nvidia-smi's id of a torch CUDA device (its UUID: indices differ under
    CUDA_VISIBLE_DEVICES), or None for a CPU device."""
    if getattr(device, "type", None) != "cuda":
        return None
    import torch

    uuid = str(getattr(torch.cuda.get_device_properties(device), "uuid", ""))
    return uuid if uuid.startswith(("GPU-", "MIG-")) else f"GPU-{uuid}"


def _gpu(ident: str) -> dict[str, Any] | None:
    """One GPU's SM clock, temperature and compute processes (nvidia-smi), or None."""
    def query(*args: str) -> list[str]:
        out = subprocess.run(["nvidia-smi", f"--id={ident}", *args, "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=10, check=True)
        return [line for line in out.stdout.strip().splitlines() if line.strip()]

    try:
        clock, temperature = (float(v) for v in query("--query-gpu=clocks.sm,temperature.gpu")[0].split(","))
        pids = [int(line.split(",")[0]) for line in query("--query-compute-apps=pid")]
    except (OSError, subprocess.SubprocessError, ValueError, IndexError):
        return None
    return {"sm_clock_mhz": clock, "temperature_c": temperature, "compute_pids": pids}


def sample(gpu: str | None = None) -> dict[str, Any]:
    """The machine now: monotonic time, load average, machine CPU seconds (busy, stolen), this
    process's CPU seconds (all its threads), memory available and, given a :func:`gpu_id`, that GPU."""
    import time

    gpu_now = _gpu(gpu) if gpu is not None else None  # before the clocks: nvidia-smi costs CPU
    stat = _proc_stat()
    return {
        "time": time.monotonic(),
        "process_cpu_s": time.process_time(),
        "machine_busy_s": stat[0] if stat else None,
        "machine_steal_s": stat[1] if stat else None,
        "load_1min": os.getloadavg()[0],
        "mem_available_bytes": mem_available(),
        "gpu": gpu_now,
    }


def noise_floor(before: dict[str, Any], after: dict[str, Any], own_cpu_s: float,
                own_pids: set[int] = frozenset()) -> dict[str, Any]:
    """What the machine did between two samples besides this cell, whose ranks (``own_pids``)
    spent ``own_cpu_s`` CPU seconds (all ranks, all threads) in that window."""
    wall = after["time"] - before["time"]
    cores = os.cpu_count() or 1
    out: dict[str, Any] = {
        "window_s": wall,
        "cores": cores,
        "load_1min": [before["load_1min"], after["load_1min"]],
        "mem_available_bytes": [before["mem_available_bytes"], after["mem_available_bytes"]],
        "others_cpu_share": None,
        "steal_share": None,
    }
    if before["machine_busy_s"] is not None and after["machine_busy_s"] is not None and wall > 0:
        others = max(0.0, after["machine_busy_s"] - before["machine_busy_s"] - own_cpu_s)
        out["others_cpu_share"] = others / (wall * cores)
        out["steal_share"] = (after["machine_steal_s"] - before["machine_steal_s"]) / (wall * cores)
    gpus = [s["gpu"] for s in (before, after) if s.get("gpu")]
    if gpus:
        out["gpu"] = [{k: v for k, v in g.items() if k != "compute_pids"} for g in gpus]
        out["gpu_other_processes"] = max(len(set(g["compute_pids"]) - set(own_pids)) for g in gpus)
    return out


def flags(noise: dict[str, Any] | None, relative_noise: float | None) -> list[str]:
    """Why a cell's speed is not to be bet on: a busy machine while it was timed, or a wide
    interval over its repeats (``relative_noise``: its half-width over the step time)."""
    out = []
    noise = noise or {}
    share, steal = noise.get("others_cpu_share"), noise.get("steal_share")
    if share is not None and share > BUSY_OTHERS_SHARE:
        out.append(f"busy: other processes took {100 * share:.0f}% of the {noise.get('cores')} cores")
    if steal is not None and steal > BUSY_STEAL_SHARE:
        out.append(f"busy: {100 * steal:.0f}% of the CPU time stolen by the hypervisor")
    if noise.get("gpu_other_processes"):
        out.append(f"busy: {noise['gpu_other_processes']} other process(es) on the GPU")
    if relative_noise is not None and relative_noise > WIDE_NOISE:
        out.append(f"wide: {spread_text(relative_noise, 0)} over repeats")
    return out
