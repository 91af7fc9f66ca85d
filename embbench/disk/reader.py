"""The reader: many page reads (or writes) in one call, with enough of them in flight to keep a
drive busy (issue 43, item 3).

One 4 KiB read from an NVMe drive takes 50-100 µs; a million reads a second needs hundreds in
flight. Python cannot issue them: its own ceiling is about 240k reads/s from memory on one thread
and falls with more (the GIL). So the reads go to a small C library (``pageio.c``), built on first
use with the system C compiler into a per-user cache keyed by the source's hash and loaded with
ctypes, which releases the GIL for the whole call. Two engines:

- ``pread``: a pool of T threads, each doing one pread/pwrite at a time (T requests in flight);
- ``io_uring``: one thread keeping T requests in an io_uring (raw system calls, no liburing).

Without a compiler (or when the build fails, or the built file fails its checks: its bytes'
hash, its functions, one read through them) a Python thread pool of ``os.preadv``/``os.pwritev``
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
    name and renamed, so processes that build at once never load half a file. What is loaded is
    checked first: the file against the hash of the bytes the build wrote (a truncated or
    replaced file is rebuilt, never mapped: a short library kills the process with SIGBUS), then
    its functions and one read through them (:func:`_check_loaded`); any failure falls back."""
    compiler = _compiler()
    try:
        library = _library_path()
    except OSError as error:  # an install that left the C file out
        return None, f"no C source: {error}"
    if not _intact(library):
        if not compiler or shutil.which(compiler[0]) is None:
            damaged = f" (and {library} is damaged)" if library.exists() else ""
            return None, f"no C compiler: {compiler[0] if compiler else 'CC'} not found{damaged}"
        try:
            library.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.TemporaryDirectory(dir=library.parent) as scratch:
                built = Path(scratch) / library.name
                done = subprocess.run([*compiler, *_FLAGS, "-o", str(built), str(_SOURCE)],
                                      capture_output=True, text=True, timeout=120)
                if done.returncode != 0:
                    first = (done.stderr.strip().splitlines() or ["no message"])[0]
                    return None, f"C build failed: {first}"
                digest = Path(scratch) / "digest"
                digest.write_text(_digest(built))
                os.replace(built, library)
                os.replace(digest, _digest_file(library))  # last: until it is there, the library reads as unfinished
        except (OSError, subprocess.SubprocessError) as error:
            return None, f"C build failed: {error}"
        if not _intact(library):
            return None, f"{library} changed while it was built (another process building it?)"
    try:
        lib = _load(library)
    except (OSError, AttributeError) as error:  # not a library, or without the functions the reader calls
        return None, f"loading {library} failed: {error}"
    problem = _check_loaded(lib)
    return (None, f"{library}: {problem}") if problem else (lib, "")


def _library_path() -> Path:
    """Where the library of this source and build command is (or will be) in the cache."""
    key = hashlib.sha256(_SOURCE.read_bytes() + " ".join(_FLAGS).encode()).hexdigest()[:16]
    return _cache_dir() / f"pageio-{key}.so"


def _digest_file(library: Path) -> Path:
    return library.with_name(library.name + ".sha256")


def _digest(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()


def _intact(library: Path) -> bool:
    """Whether ``library`` is the file its build wrote (its bytes' hash is the one recorded then)."""
    try:
        return library.is_file() and _digest_file(library).read_text().strip() == _digest(library)
    except OSError:
        return False


@functools.lru_cache(maxsize=None)
def _check_loaded(lib: ctypes.CDLL) -> str:
    """Why the loaded library cannot be used, or "": two pages written to a file in memory and
    read back through it must come back as they were."""
    fd = os.memfd_create("embbench-pageio-check")
    try:
        pages = np.array([1, 0], dtype=np.int64)
        data = np.zeros((2, PAGE), dtype=np.uint8)
        data[0], data[1] = 7, 9
        back = np.zeros_like(data)
        for write, buf in ((1, data), (0, back)):
            index, done = ctypes.c_int64(-1), ctypes.c_int64(0)
            code = lib.pageio_threads(fd, write, pages.ctypes.data, 2, buf.ctypes.data, PAGE, 2, ctypes.byref(index),
                                      ctypes.byref(done))
            if code != 0:
                return f"its check transfer failed ({os.strerror(code) if code > 0 else f'code {code}'})"
        return "" if np.array_equal(back, data) else "its check read returned other bytes than were written"
    finally:
        os.close(fd)


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
