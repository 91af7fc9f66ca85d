"""The reader: many page reads (or writes) in one call, with enough of them in flight to keep a
drive busy (issue 43, item 3).

One 4 KiB read from an NVMe drive takes 50-100 µs; a million reads a second needs hundreds in
flight. Python cannot issue them: its own ceiling is about 240k reads/s from memory on one thread
and falls with more (the GIL). So the reads go to a small C library (``pageio.c``), built on first
use with the system C compiler into a per-user cache keyed by the source's hash and loaded with
ctypes, which releases the GIL for the whole call. Two engines:

- ``pread``: a pool of T threads, each doing one pread/pwrite at a time (T requests in flight);
- ``io_uring``: one thread keeping T requests in an io_uring (raw system calls, no liburing).

Without a compiler (or when the build fails) a Python thread pool of ``os.preadv``/``os.pwritev``
does the same work, slower, and its ``name`` says so and why.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import itertools
import os
import shlex
import shutil
import subprocess
import tempfile
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from embbench.disk.layout import PAGE

__all__ = ["DEFAULT_DEPTH", "ENGINES", "Reader", "TransferError", "get_reader", "native_library"]

#: Requests in flight by default: enough for a SATA/NVMe drive's queue to work in parallel.
DEFAULT_DEPTH = 16
ENGINES = ("pread", "io_uring", "python")
_SOURCE = Path(__file__).with_name("pageio.c")
_FLAGS = ["-O2", "-shared", "-fPIC", "-pthread"]


class TransferError(Exception):
    """A page transfer failed: ``errno`` (0 for a short transfer: end of file), the failed
    page's ``index`` in the call's page list (-1 when no page is to blame) and the bytes it got."""

    def __init__(self, errno: int, index: int, done: int):
        super().__init__(errno, index, done)
        self.errno, self.index, self.done = errno, index, done


def _cache_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "embbench"


def _compiler() -> list[str]:
    return shlex.split(os.environ.get("CC") or "cc")


@functools.lru_cache(maxsize=None)
def _load(library: Path) -> ctypes.CDLL:
    lib = ctypes.CDLL(str(library))  # CDLL, not PyDLL: calls run without the GIL
    argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_void_p, ctypes.c_int64, ctypes.c_void_p, ctypes.c_int64,
                ctypes.c_int, ctypes.POINTER(ctypes.c_int64), ctypes.POINTER(ctypes.c_int64)]
    for name in ("pageio_threads", "pageio_uring"):
        getattr(lib, name).argtypes = argtypes
        getattr(lib, name).restype = ctypes.c_int
    lib.pageio_uring_check.restype = ctypes.c_int
    return lib


def native_library() -> tuple[ctypes.CDLL | None, str]:
    """The built library, or None and why not. Builds it once per source version: the file's
    name holds the hash of the source and the build command, and it is written under a temporary
    name and renamed, so processes that build at once never load half a file."""
    compiler = _compiler()
    try:
        source = _SOURCE.read_bytes()
    except OSError as error:  # an install that left the C file out
        return None, f"no C source: {error}"
    key = hashlib.sha256(source + " ".join(_FLAGS).encode()).hexdigest()[:16]
    library = _cache_dir() / f"pageio-{key}.so"
    if not library.exists():
        if not compiler or shutil.which(compiler[0]) is None:
            return None, f"no C compiler: {compiler[0] if compiler else 'CC'} not found"
        try:
            library.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=library.parent) as scratch:
                built = Path(scratch) / library.name
                done = subprocess.run([*compiler, *_FLAGS, "-o", str(built), str(_SOURCE)],
                                      capture_output=True, text=True, timeout=120)
                if done.returncode != 0:
                    first = (done.stderr.strip().splitlines() or ["no message"])[0]
                    return None, f"C build failed: {first}"
                os.replace(built, library)
        except (OSError, subprocess.SubprocessError) as error:
            return None, f"C build failed: {error}"
    try:
        return _load(library), ""
    except OSError as error:
        return None, f"loading {library} failed: {error}"


class Reader:
    """Transfers pages between a file descriptor and a buffer of whole pages. Thread-safe: each
    call keeps its own state, so several threads may transfer at once (each with its own T in
    flight)."""

    def __init__(self, engine: str, threads: int, lib: ctypes.CDLL | None = None, why_python: str = ""):
        self.engine, self.threads, self._lib = engine, threads, lib
        kind = {"python": "python preadv pool", "io_uring": "native io_uring"}.get(engine, "native pread pool")
        why = f" ({why_python})" if why_python else ""
        #: What does the reads, whatever the depth (and why it is the Python pool, when it is).
        self.kind = kind + why
        self.name = f"{kind}, {threads} {'in flight' if engine == 'io_uring' else 'threads'}{why}"
        if engine == "python":
            self._pool = ThreadPoolExecutor(threads, thread_name_prefix="embbench-preadv")

    def __repr__(self) -> str:
        return f"Reader({self.name!r})"

    def transfer(self, fd: int, pages: np.ndarray, buf: np.ndarray, write: bool) -> None:
        """Reads page ``pages[i]`` of ``fd`` into ``buf[i]`` (or writes ``buf[i]`` there) for every
        i; blocks until all are done; raises TransferError for the lowest failed index. The caller
        checks shapes and bounds (PageFile does)."""
        if len(pages) == 0:
            return
        if self._lib is None:
            return self._python_transfer(fd, pages, buf, write)
        run = self._lib.pageio_uring if self.engine == "io_uring" else self._lib.pageio_threads
        index, done = ctypes.c_int64(-1), ctypes.c_int64(0)
        code = run(fd, int(write), pages.ctypes.data, len(pages), buf.ctypes.data, PAGE, self.threads,
                   ctypes.byref(index), ctypes.byref(done))
        if code != 0:
            raise TransferError(max(code, 0), index.value, done.value)

    def _python_transfer(self, fd: int, pages: np.ndarray, buf: np.ndarray, write: bool) -> None:
        taken = itertools.count()  # next() on a count is atomic under the GIL
        failures: list[TransferError] = []
        flat = memoryview(buf.reshape(-1))
        offsets = (pages * PAGE).tolist()

        def work() -> None:
            while (i := next(taken)) < len(offsets) and not failures:
                done = 0
                try:
                    while done < PAGE:
                        part = [flat[i * PAGE + done:(i + 1) * PAGE]]
                        n = os.pwritev(fd, part, offsets[i] + done) if write else os.preadv(fd, part, offsets[i] + done)
                        if n == 0:
                            raise TransferError(0, i, done)
                        done += n
                except OSError as error:
                    failures.append(TransferError(error.errno or 0, i, done))
                except TransferError as error:
                    failures.append(error)

        helpers = [self._pool.submit(work) for _ in range(min(self.threads, len(offsets)) - 1)]
        work()  # the calling thread is one of the workers, as in the native pool
        for helper in helpers:
            helper.result()
        if failures:
            raise min(failures, key=lambda f: f.index)


_readers: dict[tuple[str, int], Reader] = {}
_readers_lock = threading.Lock()


def get_reader(threads: int = DEFAULT_DEPTH, engine: str = "pread") -> Reader:
    """The reader with ``threads`` requests in flight. ``engine``: ``pread`` (native thread pool),
    ``io_uring`` (native, one thread) or ``python``; a native engine whose library cannot be built
    or loaded gives the Python pool, whose ``name`` says why."""
    if engine not in ENGINES:
        raise ValueError(f"reader engine {engine!r}: expected one of {', '.join(ENGINES)}")
    if threads < 1:
        raise ValueError(f"reader threads {threads}: must be at least 1")
    with _readers_lock:
        lib, why = (None, "") if engine == "python" else native_library()
        if engine == "io_uring" and lib is not None and (code := lib.pageio_uring_check()) != 0:
            lib, why = None, f"no io_uring here: {os.strerror(code)}"
        chosen = engine if lib is not None or engine == "python" else "python"
        key = (chosen if not why else f"{chosen}:{why}", threads)
        if key not in _readers:
            _readers[key] = Reader(chosen, threads, lib, why)
        return _readers[key]
