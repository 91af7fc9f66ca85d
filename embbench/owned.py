"""Files a run writes outside its own folders (a row file in a user's ``store_dir``, the drive
probe's scratch file): each proves whose it is, and goes whatever ends its run (issue 50).

A file is ours only if it proves it: before it is made, an *owner note* is written beside it
(``NAME.embbench-owner``: JSON naming the file, its run and the pids that keep it alive). A
file without one, or whose note names another file, is never opened nor removed, whatever its
name: a user's ``embbench-notes.rows`` stays.

Who removes it:

- the process that made it, when it is done (:func:`release`);
- the launcher, when the cell ends however it ends (ok, error, timeout, Ctrl-C, a rank
  SIGKILLed): each rank lists what it claims in the cell's *claims list*
  (``EMBBENCH_CLAIMS``), and the launcher removes every listed file whose note names its run
  (:func:`remove_claimed`), as it removes the cell's work folder;
- the next run that looks in the folder, when every pid its note names is dead (the launcher
  itself SIGKILLed): :func:`remove_abandoned`.
"""

from __future__ import annotations

import json
import os
import secrets
import stat
from dataclasses import dataclass
from pathlib import Path

from embbench.data.cache import pid_alive

__all__ = ["CLAIMS_ENV", "NOTE_SUFFIX", "RUN_ENV", "Owner", "abandoned_bytes", "claim", "owner_of", "release",
           "remove_abandoned", "remove_claimed", "run_id"]

NOTE_SUFFIX = ".embbench-owner"
#: The launcher's run id (``<launcher pid>-<random>``), given to its ranks.
RUN_ENV = "EMBBENCH_RUN_ID"
#: The cell's claims list (a file in its scratch folder), given to its ranks.
CLAIMS_ENV = "EMBBENCH_CLAIMS"
#: An owner note is a few hundred bytes; a larger file there is not one.
_NOTE_MAX_BYTES = 4096

_own_run: tuple[int, str] | None = None  # (pid, run id): a forked process is a run of its own


def run_id() -> str:
    """This process's run: the launcher's (given to a rank), else its own (``<pid>-<random>``)."""
    global _own_run
    given = os.environ.get(RUN_ENV)
    if given:
        return given
    if _own_run is None or _own_run[0] != os.getpid():
        _own_run = (os.getpid(), f"{os.getpid()}-{secrets.token_hex(6)}")
    return _own_run[1]


def _run_pid(run: str) -> int | None:
    head = run.split("-", 1)[0]
    return int(head) if head.isdigit() else None


@dataclass(frozen=True)
class Owner:
    """What a file's owner note says: its run and the pids that keep it (the maker's and its
    run's launcher's)."""

    run: str
    pids: tuple[int, ...]

    def alive(self) -> bool:
        return any(pid_alive(pid) for pid in self.pids)


def _note(path: Path) -> Path:
    return path.with_name(path.name + NOTE_SUFFIX)


def _read_regular(path: Path, max_bytes: int) -> bytes | None:
    """The bytes of a regular file (never through a link, never a FIFO's blocking open), or None."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode) or info.st_size > max_bytes:
            return None
        return os.read(fd, max_bytes + 1)
    finally:
        os.close(fd)


def owner_of(path: Path) -> Owner | None:
    """The owner of ``path`` as its note says, or None: no note, a damaged one, or one that names
    another file (then the file is not ours)."""
    data = _read_regular(_note(Path(path)), _NOTE_MAX_BYTES)
    if data is None:
        return None
    try:
        note = json.loads(data)
        pids = tuple(int(p) for p in note["pids"] if isinstance(p, int) and not isinstance(p, bool) and p > 0)
        if note["file"] != Path(path).name or not isinstance(note["run"], str) or not pids:
            return None
    except (ValueError, TypeError, KeyError):
        return None
    return Owner(note["run"], pids)


def claim(path: Path) -> None:
    """Before ``path`` is made: its owner note (this process, its run and the run's launcher), and
    its line in the cell's claims list where a launcher gave one. Refuses a note already there."""
    path = Path(path)
    run = run_id()
    pids = [os.getpid()] + [p for p in (_run_pid(run),) if p and p != os.getpid()]
    listing = os.environ.get(CLAIMS_ENV)
    if listing:  # first: a rank killed right after making the file still leaves it listed
        with open(listing, "a") as out:
            out.write(str(path.absolute()) + "\n")
            out.flush()
            os.fsync(out.fileno())
    fd = os.open(_note(path), os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    with os.fdopen(fd, "w") as out:
        json.dump({"file": path.name, "run": run, "pids": pids}, out)


def release(path: Path) -> None:
    """Remove ``path`` and its owner note (the maker, done with it)."""
    path = Path(path)
    path.unlink(missing_ok=True)
    _note(path).unlink(missing_ok=True)


def _remove(path: Path) -> bool:
    """Remove a claimed file that is a regular file or gone (never a link, folder or FIFO someone
    put in its place), then its note."""
    try:
        if stat.S_ISREG(os.lstat(path).st_mode):
            path.unlink()
        else:
            return False
    except FileNotFoundError:
        pass
    _note(path).unlink(missing_ok=True)
    return True


def remove_claimed(listing: Path, run: str) -> list[str]:
    """Remove every file in the claims list ``listing`` whose note names ``run`` (the launcher, as
    a cell ends); the files removed."""
    data = _read_regular(Path(listing), 1 << 20)
    removed = []
    for line in (data or b"").decode(errors="replace").splitlines():
        path = Path(line)
        owner = owner_of(path)
        if owner is not None and owner.run == run and _remove(path):
            removed.append(line)
    return removed


def _claimed_in(folder: Path, pattern: str) -> list[tuple[Path, Owner]]:
    found = []
    for note in sorted(Path(folder).glob(pattern + NOTE_SUFFIX)):
        path = note.with_name(note.name.removesuffix(NOTE_SUFFIX))
        owner = owner_of(path)
        if owner is not None:
            found.append((path, owner))
    return found


def remove_abandoned(folder: Path, pattern: str) -> tuple[list[str], list[tuple[Path, Owner]]]:
    """In ``folder``, the files matching ``pattern`` that prove to be a run's: those whose every
    owner is dead are removed; returns them and the live ones (path, owner)."""
    removed, live = [], []
    for path, owner in _claimed_in(folder, pattern):
        if owner.alive():
            live.append((path, owner))
        elif _remove(path):
            removed.append(str(path))
    return removed, live


def abandoned_bytes(folder: Path) -> int:
    """Bytes of the files in ``folder`` that dead runs left (the next run's removes them): free
    space for a preflight."""
    total = 0
    for path, owner in _claimed_in(folder, "*"):
        if not owner.alive():
            try:
                info = os.lstat(path)
            except OSError:
                continue
            if stat.S_ISREG(info.st_mode):
                total += info.st_blocks * 512
    return total
