"""The data cache's machinery: a folder of entries, each built whole or not at all, described
by a manifest, and checked whenever it is opened.

Every entry is built in a work folder beside it (``.<entry>.tmp-<pid>-<hex>-<host>``) and
renamed into place when complete; its last file is ``manifest.json``, written atomically,
holding each file's dtype, shape, byte size and xxh3-128 content hash. An entry is checked
whenever it is opened (:func:`check_entry`): a damaged one is rebuilt from its source with a
note saying what was wrong, or refused with :class:`DataCacheError` when its source is gone
(:func:`cache_entry`). Work folders that a dead process of this host left are removed at the
next open. What an entry holds and how its values are checked is its maker's
(:mod:`embbench.data.criteo`); this module knows files, manifests and folders only.
"""

from __future__ import annotations

import json
import math
import mmap
import os
import re
import shutil
import socket
import sys
import uuid
from pathlib import Path
from typing import Callable

import numpy as np

from embbench.commands import command

__all__ = [
    "FULL_CHECK_BYTES", "HOST", "MANIFEST", "DataCacheError", "Damaged", "cache_entry", "check_entry", "digest",
    "out_of_range", "pid_alive", "write_manifest",
]


class DataCacheError(ValueError):
    """A damaged cache entry whose source is gone, so it cannot be rebuilt.

    The message names the entry, what is wrong and the command that rebuilds it; ``scenario``
    (set by the command line) names the scenario file in that command.
    """

    def __init__(self, entry: Path, damage: str, source: Path, cache_dir: Path):
        super().__init__(entry, damage, source, cache_dir)
        self.entry, self.damage, self.source, self.cache_dir = entry, damage, source, cache_dir
        self.scenario = "SCENARIO"

    def __str__(self) -> str:
        return (f"data cache entry {self.entry}: {self.damage}, and its source {self.source} is gone: restore it and "
                f"run `{command('data', 'prepare', self.scenario, '--data-cache', self.cache_dir)}` to rebuild the entry")


MANIFEST = "manifest.json"
_MANIFEST_FORMAT = "embbench-data-cache-manifest-1"
#: Entries smaller than this are hashed and their values checked whenever they are opened;
#: larger ones when ``verify`` asks (``embbench data prepare``, ``run --verify-data``). The
#: cheap checks (manifest, sizes, dtypes, shapes, labels 0/1) run on every open.
FULL_CHECK_BYTES = 1 << 30
_HASH_CHUNK = 1 << 24
_VALUE_CHUNK_ROWS = 1 << 20
HOST = re.sub(r"[^A-Za-z0-9.]", "_", socket.gethostname()) or "host"
# A process's working name beside an entry: ".<entry>.tmp-<pid>-<hex>-<host>" while it is
# built, ".damaged-" while a damaged entry is removed (entries written before hosts were
# named lack the host).
_WORK_DIR = re.compile(r"\..+\.(?:tmp|damaged)-(\d+)-[0-9a-f]{8}(?:-(.+))?")


class Damaged(Exception):
    """What is wrong with a cache entry (the message names the file)."""


def digest(path: Path) -> str:
    """The xxh3-128 hash of a file's bytes, read memory-mapped in chunks (about 17 GB/s from
    memory on one core; the page cache and the disk bound it below that)."""
    from embbench.optional import require

    h = require("xxhash", "checking the data cache").xxh3_128()
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        if size:
            with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as mapped:
                with memoryview(mapped) as view:
                    for a in range(0, size, _HASH_CHUNK):
                        h.update(view[a : a + _HASH_CHUNK])
    return h.hexdigest()


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _npy_layout(path: Path) -> tuple[np.dtype, tuple[int, ...], int]:
    """A .npy file's dtype, shape and the offset of its data, from its header."""
    with open(path, "rb") as f:
        try:
            version = np.lib.format.read_magic(f)
            read = np.lib.format.read_array_header_1_0 if version == (1, 0) else np.lib.format.read_array_header_2_0
            shape, fortran, dtype = read(f)
        except Exception as e:  # numpy parses the header with ast/tokenize: damage raises many kinds
            raise Damaged(f"{path.name} is not a .npy file ({type(e).__name__}: {e})") from None
        if fortran:
            raise Damaged(f"{path.name}: Fortran order, expected C order")
        return dtype, shape, f.tell()


def write_manifest(directory: Path) -> None:
    """Describe every file of a finished entry, flushed to disk; the manifest itself last, atomically."""
    files = {}
    for path in sorted(directory.iterdir()):
        _fsync(path)
        files[path.name] = {"bytes": path.stat().st_size, "xxh3_128": digest(path)}
        if path.suffix == ".npy":
            dtype, shape, _ = _npy_layout(path)
            files[path.name].update(dtype=dtype.str, shape=list(shape))
    tmp = directory / f"{MANIFEST}.tmp"
    with open(tmp, "w") as f:
        f.write(json.dumps({"format": _MANIFEST_FORMAT, "files": files}, sort_keys=True))
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, directory / MANIFEST)
    _fsync(directory)


def _read_manifest(directory: Path) -> dict:
    path = directory / MANIFEST
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise Damaged(f"no {MANIFEST} (an interrupted build, or an entry written before manifests)") from None
    except (OSError, UnicodeDecodeError) as e:
        raise Damaged(f"{MANIFEST} cannot be read ({e})") from None
    try:
        manifest = json.loads(text)
        files = manifest["files"]
        sound = (manifest["format"] == _MANIFEST_FORMAT and isinstance(files, dict) and all(
            isinstance(f, dict) and isinstance(f.get("bytes"), int) and isinstance(f.get("xxh3_128"), str)
            for f in files.values()))
    except (ValueError, KeyError, TypeError) as e:
        raise Damaged(f"{MANIFEST} is not a manifest ({type(e).__name__}: {e})") from None
    # Written canonically: any other text (even JSON-equivalent) is a changed file.
    if not sound or json.dumps(manifest, sort_keys=True) != text:
        raise Damaged(f"{MANIFEST} is not the manifest as written (its text was changed)")
    return files


def check_entry(directory: Path, layout: Callable[[dict], dict[str, tuple[np.dtype, tuple]]],
                check_values: Callable[[Path, dict, bool], None], verify: bool) -> dict:
    """The entry's meta after checking it, else :class:`Damaged` naming the file and the fault.

    Always: the manifest, every file it lists present at its size, ``meta.json`` at its
    hash, and every array's header agreeing with the manifest and with ``layout(meta)``
    (dtype, shape), its data filling the file exactly. When ``verify`` or the entry is
    smaller than :data:`FULL_CHECK_BYTES`: every file's content hash too. ``check_values``
    checks the arrays' values first (``full`` says whether the hashes will be checked).
    """
    files = _read_manifest(directory)
    for name, info in files.items():
        path = directory / name
        if not path.is_file():  # or the manifest's name of it was changed: then say so, naming the manifest
            unlisted = sorted(p.name for p in directory.iterdir() if p.name not in files and p.name != MANIFEST)
            also = f" ({MANIFEST} lists it; {', '.join(unlisted)} is not listed there)" if unlisted else ""
            raise Damaged(f"{name} is missing{also}")
        if path.stat().st_size != info["bytes"]:
            raise Damaged(f"{name} is {path.stat().st_size:,} bytes, {MANIFEST} says {info['bytes']:,}")
    if "meta.json" not in files or digest(directory / "meta.json") != files["meta.json"]["xxh3_128"]:
        raise Damaged(f"meta.json does not match {MANIFEST}")
    meta = json.loads((directory / "meta.json").read_text())
    for name, (dtype, shape) in layout(meta).items():
        if name not in files:
            raise Damaged(f"{name} is not in {MANIFEST}")
        have_dtype, have_shape, offset = _npy_layout(directory / name)
        # The manifest's text as written ("=i8" is the same dtype as "<i8", but not the text written).
        listed = (files[name].get("dtype"), tuple(files[name].get("shape", ())))
        if (have_dtype.str, have_shape) != listed:
            raise Damaged(f"{name} holds {have_dtype.str} {have_shape}, {MANIFEST} says {listed[0]} {listed[1]}")
        if (have_dtype, have_shape) != (np.dtype(dtype), tuple(shape)):
            raise Damaged(f"{name} holds {have_dtype} {have_shape}, meta.json says {np.dtype(dtype)} {tuple(shape)}")
        if offset + have_dtype.itemsize * math.prod(have_shape) != files[name]["bytes"]:
            raise Damaged(f"{name}: its header's {have_dtype} {have_shape} does not fill its {files[name]['bytes']:,} bytes")
    full = verify or sum(f["bytes"] for f in files.values()) < FULL_CHECK_BYTES
    check_values(directory, meta, full)  # before the hashes: a value out of range says more than a hash
    if full:
        for name, info in files.items():
            if digest(directory / name) != info["xxh3_128"]:
                raise Damaged(f"{name} does not match its content hash in {MANIFEST} (one of the two changed after "
                              "they were written)")
    return meta


def _extremes(block: np.ndarray, per_column: bool) -> tuple[np.ndarray, np.ndarray]:
    """The minimum and maximum of a block of rows, of each column when ``per_column`` (rows
    folded 64 to a line first: numpy reduces a few long lines several times faster)."""
    if not per_column:
        return block.min(), block.max()
    n = len(block) // 64 * 64
    rows = [block[n:]]
    if n:
        folded = block[:n].reshape(n // 64, -1)
        rows += [folded.min(0).reshape(64, -1), folded.max(0).reshape(64, -1)]
    rows = np.concatenate(rows)
    return rows.min(0), rows.max(0)


def out_of_range(array: np.ndarray, low: np.ndarray | int, high: np.ndarray | int) -> tuple[int, int] | None:
    """(row, column) of the first value outside ``[low, high)`` (NaN included), checked in
    chunks of rows by their minimum and maximum (about 6 GB/s); or None."""
    per_column = np.ndim(low) > 0 or np.ndim(high) > 0
    for a in range(0, len(array), _VALUE_CHUNK_ROWS):
        block = np.asarray(array[a : a + _VALUE_CHUNK_ROWS])
        smallest, largest = _extremes(block, per_column)
        if np.all(smallest >= low) and np.all(largest < high):  # NaN fails both
            continue
        bad = ~((block >= low) & (block < high)).reshape(len(block), -1)
        row = int(np.argmax(bad.any(1)))
        return a + row, int(np.argmax(bad[row]))
    return None


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` of this host is alive (another user's counts as alive)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's process
        return True
    return True


def _remove_dead_work_dirs(parent: Path) -> None:
    """Remove what processes of this host that have died left half-built or half-removed.

    A live process's directory is never touched (its pid in the name answers); one of
    another host (a shared cache) is left to that host.
    """
    if not parent.is_dir():
        return
    for path in parent.iterdir():
        match = _WORK_DIR.fullmatch(path.name)
        if match and match.group(2) in (None, HOST) and not pid_alive(int(match.group(1))):
            shutil.rmtree(path, ignore_errors=True)


def _work_dir(final: Path, what: str) -> Path:
    return final.parent / f".{final.name}.{what}-{os.getpid()}-{uuid.uuid4().hex[:8]}-{HOST}"


def _discard(final: Path) -> None:
    """Move a damaged entry out of the way (atomically), then delete it."""
    doomed = _work_dir(final, "damaged")
    try:
        os.rename(final, doomed)
    except FileNotFoundError:  # another process discarded it first
        return
    shutil.rmtree(doomed, ignore_errors=True)


def _atomic_dir(final: Path, fill: Callable[[Path], None]) -> None:
    """Build a directory under a temporary name, write its manifest and rename it into place."""
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = _work_dir(final, "tmp")
    tmp.mkdir()
    try:
        fill(tmp)
        write_manifest(tmp)
        try:
            os.rename(tmp, final)
        except OSError:
            if not (final / MANIFEST).exists():  # not another process finishing the same entry first
                raise
            shutil.rmtree(tmp)
        _fsync(final.parent)
    except OSError as e:
        shutil.rmtree(tmp, ignore_errors=True)
        if e.filename is None:  # a write's error (a full disk) names no file: name the entry
            raise OSError(e.errno, f"cannot build the data cache entry: {e.strerror}", str(final)) from None
        raise
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise


def cache_entry(final: Path, fill: Callable[[Path], None], check: Callable[[Path, bool], dict], verify: bool,
                source: Path | None = None) -> dict:
    """The checked meta of the entry at ``final``: built if missing, rebuilt if damaged.

    ``source`` is the file the entry is rebuilt from when it is gone (then a damaged entry
    is refused with :class:`DataCacheError`); None: it can always be rebuilt.
    """
    _remove_dead_work_dirs(final.parent)
    if final.exists():
        try:
            return check(final, verify)
        except Damaged as e:
            if source is not None and not source.exists():
                raise DataCacheError(final, str(e), source, final.parent.parent) from None
            origin = f" from {source}" if source is not None else ""
            print(f"note: data cache entry {final}: {e}; rebuilding it{origin}", file=sys.stderr)
            _discard(final)
    _atomic_dir(final, fill)
    return check(final, False)  # the hashes were just computed from these files
