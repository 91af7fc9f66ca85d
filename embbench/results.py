"""The result record of one cell, its JSON store and its provenance.

A run directory holds one ``<cell>.json`` per cell, written atomically as soon as the cell
ends, so an interrupted run keeps what finished. Records carry a schema version.
"""

from __future__ import annotations

import datetime as _dt
import json
import os
import platform
import socket
import subprocess
import sys
import tempfile
from importlib import metadata
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

__all__ = ["SCHEMA_VERSION", "Record", "Status", "provenance", "write_record", "load_records"]

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


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(["git", *args], capture_output=True, text=True, timeout=10,
                             cwd=Path(__file__).resolve().parent)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def _version(package: str) -> str | None:
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def provenance() -> dict[str, Any]:
    """Where, when, with what code and packages, and by which command a result was made."""
    import torch

    gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if torch.cuda.is_available() else []
    return {
        "date": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(sys.argv),
        "host": socket.gethostname(),
        "git": {
            "commit": _git("rev-parse", "HEAD"),
            "branch": _git("rev-parse", "--abbrev-ref", "HEAD"),
            "dirty": bool(_git("status", "--porcelain", "--untracked-files=no")),
        },
        "versions": {
            "python": platform.python_version(),
            "torch": torch.__version__,
            "cuda": torch.version.cuda,
            "torchrec": _version("torchrec"),
            "fbgemm_gpu": _version("fbgemm-gpu") or _version("fbgemm-gpu-cpu"),
            "embbench": _version("embbench"),
        },
        "devices": {"cpu": _cpu_name(), "cpu_count": os.cpu_count(), "gpus": gpus},
    }


def write_record(directory: Path, slug: str, record: Record) -> Path:
    """Write ``<slug>.json`` atomically (a reader never sees half a file)."""
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / f"{slug}.json"
    fd, tmp = tempfile.mkstemp(dir=directory, prefix=f".{slug}.", suffix=".tmp")
    with os.fdopen(fd, "w") as f:
        f.write(record.model_dump_json(indent=2))
    os.replace(tmp, path)
    return path


def load_records(path: Path) -> list[Record]:
    """Every record of a run directory (or one record file)."""
    files = [path] if path.is_file() else sorted(path.glob("*.json"))
    if not files:
        raise FileNotFoundError(f"{path}: no result records (*.json) here")
    records = []
    for f in files:
        try:
            data = json.loads(f.read_text())
        except json.JSONDecodeError as e:
            raise ValueError(f"{f}: not valid JSON (line {e.lineno}): {e.msg}") from None
        if data.get("schema_version") != SCHEMA_VERSION:
            raise ValueError(f"{f}: schema_version {data.get('schema_version')!r}, expected {SCHEMA_VERSION}")
        records.append(Record.model_validate(data))
    return records
