"""Commands the tool prints for the user to run, as they can be pasted: shell-quoted
(shlex.join), and carrying the settings that made the run's effective scenario, so that
following one measures what the run measured."""

from __future__ import annotations

import shlex
import sys
from pathlib import Path
from typing import Any

__all__ = ["command", "effective_flags", "program", "run_command"]


def program() -> list[str]:
    """embbench as the user started it: the console script as typed (``.venv/bin/embbench``),
    or this interpreter with ``-m embbench.cli`` or ``-m embbench``; plain ``embbench`` when
    started otherwise (from Python, as the tests do)."""
    typed = sys.argv[0] if sys.argv and sys.argv[0] else ""
    if Path(typed).name == "embbench":
        return [typed]
    here = Path(__file__).parent
    for module, main in (("embbench.cli", here / "cli" / "__main__.py"), ("embbench", here / "__main__.py")):
        if typed and Path(typed).resolve() == main.resolve():
            return [sys.executable, "-m", module]
    return ["embbench"]


def command(*args: str | Path) -> str:
    """An embbench command line as it can be pasted: :func:`program`, then ``args``, shell-quoted."""
    return shlex.join([*program(), *map(str, args)])


def effective_flags(config: dict[str, Any]) -> dict[str, Any]:
    """``--steps``, ``--scale``, ``--batch-size`` and ``--embedding-dim`` as a record's effective
    scenario (``record.scenario["config"]``) has them; none for what the config does not hold
    (a record without it)."""
    run, data = config.get("run") or {}, config.get("data") or {}
    flags = {"steps": run.get("steps"), "batch_size": data.get("batch_size"), "embedding_dim": data.get("embedding_dim")}
    if data.get("source", "synthetic") == "synthetic":
        flags["scale"] = data.get("scale")  # the other sources refuse --scale
    return {k: v for k, v in flags.items() if v is not None}


def run_command(scenario: str | Path, out: str | Path | None = None, steps: int | None = None, scale: float | None = None,
                strategies: list[str] | None = None, data_cache: str | Path | None = None, resume: bool = False,
                force: bool = False, profile: bool = False, batch_size: int | None = None,
                embedding_dim: int | None = None) -> str:
    """``embbench run`` with these settings, shell-quoted (no ``--out``: the default run directory)."""
    argv = ["run", str(scenario)]
    if steps is not None:
        argv += ["--steps", str(steps)]
    if scale is not None:
        argv += ["--scale", repr(float(scale))]  # repr: the exact float, so the same scenario digest
    if batch_size is not None:
        argv += ["--batch-size", str(batch_size)]
    if embedding_dim is not None:
        argv += ["--embedding-dim", str(embedding_dim)]
    if strategies:
        argv += ["--strategies", ",".join(strategies)]
    if out is not None:
        argv += ["--out", str(out)]
    if data_cache is not None:
        argv += ["--data-cache", str(data_cache)]
    argv += ["--resume"] * resume + ["--force"] * force + ["--profile"] * profile
    return command(*argv)
