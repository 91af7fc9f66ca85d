"""What runs in the cell server (:func:`embbench.launch._cell_context`) and in the ranks it forks.

The server listens on a socket file in a temporary directory the launcher made, whose name it
finds in ``EMBBENCH_CELL_SERVER_DIR`` when it imports this module (only the server is started
with it set). It ends after the launcher has ended (the launcher removes the directory as it
exits normally), also when the launcher was killed (SIGKILL) and could not clean up: then this
removes the directory as the server exits, so a killed run leaves nothing in the temp dir.
"""

from __future__ import annotations

import atexit
import importlib
import os
import shutil
import sys
from pathlib import Path

__all__ = ["close_alive_pipe", "rank_main"]

_directory = os.environ.get("EMBBENCH_CELL_SERVER_DIR")
if _directory:
    atexit.register(shutil.rmtree, _directory, ignore_errors=True)


def close_alive_pipe() -> None:
    """In a process the server forked: let go of the server's "alive" pipe. The server stays up
    while any process holds it, and hands it to every process it forks; a rank ends when the
    server does, so holding it would keep both alive for ever once the launcher is killed.
    (multiprocessing's own name for it, Python 3.10-3.13.)"""
    from multiprocessing import forkserver

    alive = getattr(getattr(forkserver, "_forkserver", None), "_forkserver_alive_fd", None)
    if isinstance(alive, int):
        os.close(alive)


def rank_main(spec_path: str, log: str, environ: dict[str, str], path: list[str]) -> None:
    """One rank of a cell, forked from the cell server: a session of its own (so that the
    launcher can kill all it starts), its log as stdout and stderr, and the launcher's
    environment and import path as they are now (a plugin installed since the server started
    included)."""
    server = os.getppid()  # the rank ends itself once its parent is gone (embbench.runner)
    os.setsid()
    close_alive_pipe()
    fd = os.open(log, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    sys.stdout.reconfigure(line_buffering=True)
    sys.stderr.reconfigure(line_buffering=True)
    os.environ.clear()
    os.environ.update(environ, EMBBENCH_LAUNCHER_PID=str(server))
    extra = [p for p in environ.get("PYTHONPATH", "").split(os.pathsep) + path if p and p not in sys.path]
    sys.path[:0] = list(dict.fromkeys(extra))
    importlib.invalidate_caches()
    from embbench import runner

    code = runner.main(spec_path)
    if os.getppid() != server:  # the launcher and its server are gone: nobody else removes the cell's scratch
        shutil.rmtree(Path(spec_path).parent, ignore_errors=True)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)  # as `python -m embbench.runner` does: no interpreter teardown (gloo's threads)
