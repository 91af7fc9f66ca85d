"""Where, when and with what a result was made: the commit, the packages, the system and the
devices (a record's ``provenance``, :class:`embbench.results.Provenance`)."""

from __future__ import annotations

import datetime as _dt
import functools
import json
import os
import platform
import re
import socket
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

from embbench import buildinfo

__all__ = ["RELEVANT_PACKAGES", "code_version", "environment", "provenance", "relevant_packages"]


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
