"""Files that output flags write (``report --out``, ``trace record --out``, ``run --profile``,
the policy sweep's ``--out``): never one the command did not make.

Every output flag checks its target with :func:`claim_output` before any work: a target that
exists may be replaced only when it is an earlier output of the same command (recognised by
its content: the report's generator mark, the trace's format, ...) or when the user says
so (``--overwrite``). A result record is never replaced by anything but ``embbench run``.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path
from typing import BinaryIO, Callable

__all__ = ["atomic_write", "claim_output", "head_has"]

#: How much of an existing file is read to recognise it.
_HEAD = 1 << 16


def head_has(path: Path, *marks: bytes) -> bool:
    """Whether the start of ``path`` holds every one of ``marks`` (False if it cannot be read)."""
    try:
        with open(path, "rb") as f:
            head = f.read(_HEAD)
    except OSError:
        return False
    return all(mark in head for mark in marks)


def atomic_write(path: Path, write: Callable[[BinaryIO], object], what: str | None = None) -> Path:
    """Write ``path`` whole or not at all: ``write(file)`` fills a temporary file beside it,
    which is synced (a full disk shows here) and renamed over ``path``. Made with the
    permissions ``open`` gives (the umask's; ``mkstemp`` alone would make 0600).

    Raises:
        OSError: from ``write`` or the file system (a full disk: ``No space left on device``);
            the temporary file is removed and an existing ``path`` is kept. With ``what``,
            it says ``cannot write WHAT: ...`` and names ``path``.
    """
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        mask = os.umask(0)
        os.umask(mask)
        os.fchmod(fd, 0o666 & ~mask)
        with os.fdopen(fd, "wb") as f:
            write(f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException as e:
        Path(tmp).unlink(missing_ok=True)
        if what is not None and isinstance(e, OSError):
            raise OSError(e.errno, f"cannot write {what}: {e.strerror}", str(path)) from None
        raise
    return path


def _is_record(path: Path) -> bool:
    """A result record (``embbench run`` writes ``schema_version`` and ``cell_id`` first)."""
    return head_has(path, b'"schema_version"', b'"cell_id"')


def claim_output(path: Path, flag: str, command: str, made_here: Callable[[Path], bool],
                 overwrite: bool = False) -> None:
    """Check, before the work, that ``command``'s ``flag`` may write ``path``.

    Args:
        made_here: whether an existing file is an earlier output of ``command`` (which it may
            replace).
        overwrite: the user allows replacing any other file (never a result record).

    Raises:
        ValueError: naming the flag and the file: a directory, a missing or unwritable
            directory, a result record, or a file ``command`` did not make (without ``overwrite``).
    """
    try:
        if path.is_dir():
            raise ValueError(f"{flag} {path}: is a directory; give a file name")
        parent = path.parent if str(path.parent) else Path(".")
        if not parent.is_dir():
            raise ValueError(f"{flag} {path}: no such directory {parent}")
        if not os.access(parent, os.W_OK) or (path.exists() and not os.access(path, os.W_OK)):
            raise ValueError(f"{flag} {path}: not writable")
        if not path.exists() and not path.is_symlink():
            return
        if path.is_file() and _is_record(path):
            raise ValueError(f"{flag} {path}: is a result record; only `embbench run` writes records: "
                             "give another file name")
        if not overwrite and not (path.is_file() and made_here(path)):
            raise ValueError(f"{flag} {path}: exists and was not made by `{command}`; give another file name, "
                             "or --overwrite to replace it")
    except OSError as e:  # a name too long, a loop of links, ...
        raise ValueError(f"{flag} {path}: {e.strerror}") from None
