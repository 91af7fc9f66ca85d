"""The result record of one cell, its JSON store and its provenance.

A run directory holds one ``<cell>.json`` per cell, written atomically as soon as the cell
ends, so an interrupted run keeps what finished. Records carry a schema version.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import fcntl
import functools
import json
import os
import platform
import re
import socket
import sys
import tempfile
from importlib import metadata
from pathlib import Path
from typing import Any, Callable, Iterator, Literal

from pydantic import BaseModel, ConfigDict, ValidationError

from embbench import buildinfo

__all__ = ["SCHEMA_VERSION", "Record", "RecordError", "Status", "code_version", "environment", "provenance",
           "read_record", "relevant_packages", "run_directory_lock", "write_record", "load_records"]

SCHEMA_VERSION = 1
Status = Literal["ok", "unsupported", "error", "oom", "timeout", "diverged"]


class Record(BaseModel):
    """One cell's result. ``metrics`` is None unless the status is ``ok``."""

    model_config = ConfigDict(extra="forbid")

    schema_version: int = SCHEMA_VERSION
    cell_id: str
    strategy: str
    params: dict[str, Any]
    world_size: int
    status: Status
    message: str | None = None
    #: ``exact``: weights comparable with the baseline's; ``reordered``: compare by accuracy.
    semantics: Literal["exact", "reordered"] = "exact"
    baseline: str
    scenario: dict[str, Any]
    metrics: dict[str, Any] | None = None
    provenance: dict[str, Any]


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def code_version(package_dir: Path, direct_url: dict | None) -> dict[str, Any]:
    """The commit of the embbench in ``package_dir``, and where it was learnt (``source``).

    From the checkout the package lives in (an editable install or a run from the source);
    else from the record written when the package was built (:mod:`embbench.buildinfo`); else
    from pip's record of a VCS install (``direct_url``, PEP 610). Otherwise the commit is
    None and ``reason`` says why.
    """
    found = buildinfo.from_checkout(package_dir.parent)
    if found:
        return {**found, "source": "checkout"}
    recorded = package_dir / buildinfo.RECORD
    if recorded.is_file():
        return {**json.loads(recorded.read_text()), "source": "recorded at build"}
    vcs = (direct_url or {}).get("vcs_info")
    if vcs and vcs.get("commit_id"):
        return {"commit": vcs["commit_id"], "branch": vcs.get("requested_revision"), "dirty": False,
                "source": f"pip's record of the {vcs.get('vcs', 'vcs')} install from {direct_url.get('url')}"}
    if direct_url:
        why = f"installed from {direct_url.get('url')} without a recorded commit (built without git?)"
    else:
        why = f"{package_dir} is neither a git checkout nor a package built by embbench's setup.py"
    return {"commit": None, "branch": None, "dirty": None, "source": None, "reason": why}


def _direct_url() -> dict | None:
    try:
        text = metadata.distribution("embbench").read_text("direct_url.json")
    except metadata.PackageNotFoundError:
        return None
    return json.loads(text) if text else None


#: Installed packages that a result depends on (name prefixes, as pip spells them).
RELEVANT_PACKAGES = ("torch", "fbgemm", "torchrec", "triton", "numpy", "pydantic", "tensordict", "embbench",
                     "nvidia-")


def relevant_packages() -> dict[str, str]:
    """Name -> version of the installed packages that matter (what ``pip freeze`` reads)."""
    found = {}
    for dist in metadata.distributions():
        name = (dist.metadata["Name"] or "").lower().replace("_", "-")
        if name.startswith(RELEVANT_PACKAGES):
            found[name] = dist.version
    return dict(sorted(found.items()))


def _nvidia_driver() -> str | None:
    """The kernel driver's version, from its /proc file (when nvidia-smi is not there)."""
    try:
        text = Path("/proc/driver/nvidia/version").read_text()
    except OSError:
        return None
    match = re.search(r"Kernel Module\s+(\S+)", text)
    return match.group(1) if match else None


def _cpu_model(lscpu: str | None) -> str:
    for line in (lscpu or "").splitlines():
        if line.startswith("Model name:"):
            return line.split(":", 1)[1].strip()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


@functools.lru_cache(maxsize=1)
def environment() -> dict[str, Any]:
    """Code, packages, toolchain and devices, once per process: torch's own
    ``torch.utils.collect_env`` for the system (driver, CUDA, GPUs, CPU), torch for each
    GPU's memory, package metadata for the versions."""
    import torch
    from torch.utils import collect_env

    try:
        env = collect_env.get_env_info()._asdict()
        env_error = None
    except Exception as exc:  # an odd system must not cost the result
        env, env_error = {}, f"torch.utils.collect_env failed: {type(exc).__name__}: {exc}"
    gpus = []
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            gpus.append({"name": p.name, "memory_bytes": p.total_memory, "capability": f"{p.major}.{p.minor}",
                         "multiprocessors": p.multi_processor_count})
    package_dir = Path(__file__).resolve().parent
    return {
        "git": code_version(package_dir, _direct_url()),
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "cuda": torch.version.cuda,  # the CUDA runtime torch was built with and ships
            "cudnn": torch.backends.cudnn.version() if torch.cuda.is_available() else None,
            "nvcc": env.get("cuda_runtime_version"),  # the toolkit on PATH, if any
            "nvidia_driver": env.get("nvidia_driver_version") or _nvidia_driver(),
            "torchrec": _version("torchrec"),
            "fbgemm_gpu": _version("fbgemm-gpu") or _version("fbgemm-gpu-cpu"),
            "embbench": _version("embbench"),
        },
        "packages": relevant_packages(),
        "system": {"os": env.get("os") or platform.platform(), "libc": env.get("libc_version"),
                   "gcc": env.get("gcc_version"), "collect_env_error": env_error},
        "devices": {"cpu": _cpu_model(env.get("cpu_info")), "cpu_count": os.cpu_count(), "gpus": gpus,
                    "gpu_models": env.get("nvidia_gpu_models")},
    }


def provenance(strategy: str | None = None) -> dict[str, Any]:
    """Where, when, with what code and packages, and by which command a result was made;
    with ``strategy``, also ``versions.strategy``: the package and version that install it."""
    from embbench.strategy import strategy_version

    env = environment()
    return {
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(sys.argv),
        "host": socket.gethostname(),
        **env,
        # a copy: environment() is cached for the whole process
        "versions": {**env["versions"], **({"strategy": strategy_version(strategy)} if strategy else {})},
    }


def write_record(directory: Path, slug: str, record: Record) -> Path:
    """Write ``<slug>.json`` atomically (a reader never sees half a file).

    Raises:
        OSError: the directory cannot be written (disk full, read-only, ...); no partial
            file is left behind and an earlier record of the cell is kept.
    """
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{slug}.json"
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{slug}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as f:
            f.write(record.model_dump_json(indent=2))
            f.flush()
            os.fsync(f.fileno())  # a full disk shows here, not after the rename
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    return path


#: The lock a run holds on its run directory; it names the holder's pid.
LOCK_FILE = ".embbench-run.lock"


@contextlib.contextmanager
def run_directory_lock(directory: Path) -> Iterator[None]:
    """Hold ``directory`` for this run: another run into it is refused at once.

    An OS lock (``flock``) on ``directory/.embbench-run.lock``, so a run that is killed, even
    by SIGKILL, leaves no stale lock (the kernel drops it with the process) and ``--resume``
    can follow; the file holds the pid of the run holding it.

    Raises:
        ValueError: another process holds the directory (naming it and the pid), or it
            cannot be locked.
    """
    path = directory / LOCK_FILE
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:
        raise ValueError(f"{path}: cannot create the run directory's lock: {e.strerror}") from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "?"
            raise ValueError(f"another run is writing to {directory}/ (pid {holder})") from None
        except OSError as e:  # a file system without locks
            raise ValueError(f"{path}: cannot lock the run directory: {e.strerror}") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        yield
    finally:
        os.close(fd)


class RecordError(ValueError):
    """A record file that cannot be used (damaged, foreign, incomplete); the message names it."""


#: What the tables and projections read of an ``ok`` record (key: its keys); without them it is damaged.
_OK_METRICS: dict[str, tuple[str, ...]] = {
    "step_time_s": ("median", "p95"), "throughput": ("mean", "ci95"),
    "memory": ("static_device_bytes", "static_host_bytes", "pinned_bytes"), "counters": ("total",),
    "measured_steps": (), "samples_per_step": (),
}


def _missing_metrics(metrics: Any) -> list[str]:
    if not isinstance(metrics, dict):
        return ["all"]
    missing = []
    for key, inner in _OK_METRICS.items():
        if key not in metrics:
            missing.append(key)
        elif inner and not isinstance(metrics[key], dict):
            missing.append(f"{key} (not a mapping)")
        else:
            missing += [f"{key}.{k}" for k in inner if k not in metrics[key]]
    return missing


def read_record(path: Path) -> Record:
    """One record file, checked.

    Raises:
        RecordError: naming the file and what is wrong (unreadable, not JSON, not a record,
            another schema version, an ``ok`` record without its measurements).
    """
    if not path.is_file():  # a FIFO would block, a device never end
        raise RecordError(f"{path}: not a regular file")
    try:
        data = json.loads(path.read_bytes().decode("utf-8"))
    except OSError as e:
        raise RecordError(f"{path}: cannot read: {e.strerror}") from None
    except UnicodeDecodeError:
        raise RecordError(f"{path}: not UTF-8 text; not a result record") from None
    except json.JSONDecodeError as e:
        raise RecordError(f"{path}: not valid JSON (line {e.lineno}): {e.msg}") from None
    if not isinstance(data, dict):
        raise RecordError(f"{path}: a JSON {type(data).__name__}, not a result record (an object)")
    if data.get("schema_version") != SCHEMA_VERSION:
        raise RecordError(f"{path}: schema_version {data.get('schema_version')!r}, expected {SCHEMA_VERSION}")
    try:
        record = Record.model_validate(data)
    except ValidationError as e:
        first = e.errors()[0]
        key = ".".join(str(p) for p in first["loc"]) or "record"
        raise RecordError(f"{path}: {key}: {first['msg']}") from None
    missing = _missing_metrics(record.metrics) if record.status == "ok" else []
    if missing:
        raise RecordError(f"{path}: status ok without its measurements (metrics: missing {', '.join(missing)})")
    return record


def load_records(path: Path, on_damaged: Callable[[RecordError], None] | None = None) -> list[Record]:
    """Every record of a run directory (or one record file).

    Args:
        on_damaged: called with the error of each file that cannot be used, which is then
            skipped; None raises it.

    Raises:
        FileNotFoundError: nothing there, or no records in the directory.
        RecordError: a damaged record (without ``on_damaged``).
    """
    if path.is_dir():
        files = sorted(path.glob("*.json"))
    elif path.exists():
        files = [path]
    else:
        raise FileNotFoundError(f"{path}: no result records here (no such run directory or record file)")
    if not files:
        raise FileNotFoundError(f"{path}: no result records (*.json) here")
    records = []
    for f in files:
        try:
            records.append(read_record(f))
        except RecordError as e:
            if on_damaged is None:
                raise
            on_damaged(e)
    return records
