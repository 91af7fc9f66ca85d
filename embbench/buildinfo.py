"""Which commit of embbench this is: read from its git checkout, or as recorded at build time.

Standard library only, and importable on its own: ``setup.py`` loads this file to write the
commit into every built package (``embbench/_build_info.json``), so that a copy installed
with ``pip install .`` (no checkout beside it) still names the code it runs.
"""

from __future__ import annotations

import os
import subprocess
from pathlib import Path

__all__ = ["RECORD", "at_build", "from_checkout"]

#: The file, inside the built ``embbench`` package, that holds the commit it was built from.
RECORD = "_build_info.json"


def _git(root: Path, *args: str) -> str | None:
    try:
        out = subprocess.run(["git", *args], capture_output=True, text=True, timeout=10, cwd=root)
    except (OSError, subprocess.TimeoutExpired):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def from_checkout(root: Path) -> dict | None:
    """``commit``, ``branch`` and ``dirty`` (tracked files changed) of the git work tree whose
    top is ``root``; None when ``root`` is not the top of one (a package installed somewhere
    inside another repository must not take that repository's commit) or git is missing."""
    top = _git(root, "rev-parse", "--show-toplevel")
    if top is None or Path(top).resolve() != root.resolve():
        return None
    return {
        "commit": _git(root, "rev-parse", "HEAD"),
        "branch": _git(root, "rev-parse", "--abbrev-ref", "HEAD"),
        "dirty": bool(_git(root, "status", "--porcelain", "--untracked-files=no")),
    }


def at_build(root: Path) -> dict | None:
    """What a build records: the checkout at ``root``; without one (a copy of the sources
    without ``.git``), the commit the builder names in ``EMBBENCH_GIT_COMMIT``; else None."""
    found = from_checkout(root)
    if found is None and os.environ.get("EMBBENCH_GIT_COMMIT"):
        found = {"commit": os.environ["EMBBENCH_GIT_COMMIT"], "branch": None, "dirty": None,
                 "named_by": "EMBBENCH_GIT_COMMIT at build"}
    return found
