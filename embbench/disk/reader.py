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
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np

from embbench.disk.layout import PAGE

__all__ = ["DEFAULT_DEPTH", "ENGINES", "Engine", "Reader", "Ticket", "TransferError", "get_reader", "native_library"]

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


class Ticket:
    """A submission to an :class:`Engine`: :meth:`done` without waiting, :meth:`wait` until all
    of its pages are transferred (raising TransferError for the lowest failed one)."""

    def __init__(self, engine: "Engine", handle, keep=None):
        self._engine, self._handle, self._keep = engine, handle, keep  # keep: buffers alive until done
        self._outcome: tuple[int, int, int] | None = None
        # One thread at a time asks the engine (the first to wait frees the native ticket: a
        # second waiting on it at once would wait on freed memory, for ever).
        self._lock = threading.Lock()

    def done(self) -> bool:
        if self._outcome is not None:
            return True
        if not self._lock.acquire(blocking=False):  # another thread is waiting for it: not known done
            return False
        try:
            return self._outcome is not None or self._engine._poll(self._handle)
        finally:
            self._lock.release()

    def wait(self) -> None:
        with self._lock:
            if self._outcome is None:
                self._outcome = self._engine._wait(self._handle)
                self._keep = None
        code, index, done = self._outcome
        if code != 0:
            raise TransferError(max(code, 0), index, done)

    def __del__(self):
        if self._outcome is None and self._handle is not None:
            try:
                self.wait()
            except Exception:  # (a failure nobody waited for: the file is closing anyway)
                pass


class Engine:
    """Threads that live across calls and keep the pages of many submissions in flight (the file
    store's reads ahead; issue 48). :meth:`submit` queues transfers between pages of a file and
    pages of a buffer (``buf[buf_pages[i]]``: reads land where the caller wants them, no staging
    copy) and returns a :class:`Ticket` at once; an ``urgent`` submission goes to the queue's
    front. :meth:`stats` says how long a transfer was in flight (``busy_ns``), and the pages read
    and written, so that reads a second while reading can be measured. Native (``pageio.c``)
    where the library loads, else a Python pool of ``os.preadv`` that says so in ``name``."""

    def __init__(self, threads: int):
        if threads < 1:
            raise ValueError(f"engine threads {threads}: must be at least 1")
        lib, why = native_library()
        self._lib = _engine_functions(lib) if lib is not None else None
        self._handle = self._lib.pageio_engine_open(threads) if self._lib is not None else None
        if self._lib is not None and not self._handle:
            self._lib, why = None, "the native engine could not start its threads"
        elif lib is not None and self._lib is None:
            why = "the library has no engine"
        self.threads = threads if self._handle is None else self._lib.pageio_engine_threads(self._handle)
        self.name = (f"native pread engine, {self.threads} threads" if self._handle is not None else
                     f"python preadv engine, {threads} threads ({why})")
        if self._handle is None:
            self._py = _PythonEngine(threads)

    def submit(self, fd: int, pages: np.ndarray, buf: np.ndarray, buf_pages: np.ndarray, write: bool,
               urgent: bool = False) -> Ticket:
        """Transfer page ``pages[i]`` of ``fd`` to (or, ``write``, from) page ``buf_pages[i]`` of
        ``buf`` (uint8 ``[n, PAGE]``, C-contiguous) for each i. The caller checks bounds (PageFile
        does) and keeps ``buf`` alive; the ticket keeps it too."""
        pages = np.ascontiguousarray(pages, dtype=np.int64)
        if self._lib is None:
            return self._py.submit(self, fd, pages, buf, np.asarray(buf_pages, dtype=np.int64), write, urgent)
        if self._handle is None:
            raise ValueError("the reader's engine is closed")
        addresses = np.ascontiguousarray(buf.ctypes.data + np.asarray(buf_pages, dtype=np.uint64) * PAGE, dtype=np.uint64)
        handle = self._lib.pageio_engine_submit(self._handle, fd, int(write), pages.ctypes.data,
                                                addresses.ctypes.data, len(pages), int(urgent))
        if not handle:
            raise MemoryError("the reader's engine could not queue the transfers (out of memory)")
        return Ticket(self, handle, keep=buf)

    def stats(self) -> dict[str, int]:
        """``busy_ns`` (a transfer in flight), ``pages_read``, ``pages_written``, ``pending``."""
        if self._lib is None:
            return self._py.stats()
        if self._handle is None:
            raise ValueError("the reader's engine is closed")
        out = (ctypes.c_int64 * 4)()
        self._lib.pageio_engine_stats(self._handle, out)
        return {"busy_ns": out[0], "pages_read": out[1], "pages_written": out[2], "pending": out[3]}

    def close(self) -> None:
        """Finish what is queued and end the threads; safe to call twice (tickets stay readable)."""
        if self._handle is not None:
            handle, self._handle = self._handle, None
            self._lib.pageio_engine_close(handle)
        elif self._lib is None:
            self._py.close()

    def _poll(self, handle) -> bool:
        if self._lib is None:
            return handle.done()
        return bool(self._lib.pageio_ticket_done(self._handle, handle)) if self._handle else True

    def _wait(self, handle) -> tuple[int, int, int]:
        if self._lib is None:
            return handle.result()
        index, done = ctypes.c_int64(-1), ctypes.c_int64(0)
        if self._handle:
            code = self._lib.pageio_ticket_wait(self._handle, handle, ctypes.byref(index), ctypes.byref(done))
        else:  # closed: its threads finished every request before they ended
            code = self._lib.pageio_ticket_result(handle, ctypes.byref(index), ctypes.byref(done))
        self._lib.pageio_ticket_free(handle)
        return code, index.value, done.value


def _engine_functions(lib: ctypes.CDLL) -> ctypes.CDLL | None:
    """The engine's functions of the library, typed (None: a library without them)."""
    p, i64, ptr = ctypes.c_void_p, ctypes.c_int64, ctypes.POINTER(ctypes.c_int64)
    signatures = {"pageio_engine_open": ([ctypes.c_int], p), "pageio_engine_threads": ([p], ctypes.c_int),
                  "pageio_engine_submit": ([p, ctypes.c_int, ctypes.c_int, p, p, i64, ctypes.c_int], p),
                  "pageio_ticket_done": ([p, p], ctypes.c_int),
                  "pageio_ticket_wait": ([p, p, ptr, ptr], ctypes.c_int), "pageio_ticket_free": ([p], None),
                  "pageio_ticket_result": ([p, ptr, ptr], ctypes.c_int),
                  "pageio_engine_stats": ([p, ptr], None), "pageio_engine_close": ([p], None)}
    try:
        for name, (args, result) in signatures.items():
            getattr(lib, name).argtypes, getattr(lib, name).restype = args, result
    except AttributeError:
        return None
    return lib


class _PythonEngine:
    """The engine without the native library: a pool of threads doing ``os.preadv``. An urgent
    submission runs on the calling thread (nothing is ahead of it)."""

    def __init__(self, threads: int):
        self.threads = threads
        self._pool = ThreadPoolExecutor(threads, thread_name_prefix="embbench-engine")
        self._lock = threading.Lock()
        self._in_flight = 0
        self._since = 0
        self._counts = {"busy_ns": 0, "pages_read": 0, "pages_written": 0, "pending": 0}

    def submit(self, engine: Engine, fd, pages, buf, buf_pages, write, urgent) -> Ticket:
        flat = memoryview(buf.reshape(-1))

        def one(i: int) -> tuple[int, int, int]:
            self._enter(1)
            done = 0
            try:
                at = int(buf_pages[i]) * PAGE
                while done < PAGE:
                    part = [flat[at + done:at + PAGE]]
                    offset = int(pages[i]) * PAGE + done
                    n = os.pwritev(fd, part, offset) if write else os.preadv(fd, part, offset)
                    if n == 0:
                        return (-1, i, done)
                    done += n
                return (0, -1, 0)
            except OSError as error:
                return (error.errno or 0, i, done)
            finally:
                self._leave(1, write)

        chunks = [range(k, len(pages), self.threads) for k in range(min(self.threads, len(pages)))]

        def run(chunk) -> tuple[int, int, int]:
            outcomes = [one(i) for i in chunk]
            failed = [o for o in outcomes if o[0] != 0]
            return min(failed, key=lambda o: o[1]) if failed else (0, -1, 0)

        if urgent:
            results = [run(chunk) for chunk in chunks]
            future = _Done(results)
        else:
            future = _Gathered([self._pool.submit(run, chunk) for chunk in chunks])
        return Ticket(engine, future, keep=buf)

    def _enter(self, n: int) -> None:
        with self._lock:
            if self._in_flight == 0:
                self._since = time.perf_counter_ns()
            self._in_flight += n

    def _leave(self, n: int, write: bool) -> None:
        with self._lock:
            self._in_flight -= n
            if self._in_flight == 0:
                self._counts["busy_ns"] += time.perf_counter_ns() - self._since
            self._counts["pages_written" if write else "pages_read"] += n

    def stats(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)

    def close(self) -> None:
        self._pool.shutdown(wait=True)


class _Gathered:
    def __init__(self, futures):
        self._futures = futures

    def done(self) -> bool:
        return all(f.done() for f in self._futures)

    def result(self) -> tuple[int, int, int]:
        failed = [o for o in (f.result() for f in self._futures) if o[0] != 0]
        return min(failed, key=lambda o: o[1]) if failed else (0, -1, 0)


class _Done(_Gathered):
    def __init__(self, outcomes):
        self._outcomes = outcomes

    def done(self) -> bool:
        return True

    def result(self) -> tuple[int, int, int]:
        failed = [o for o in self._outcomes if o[0] != 0]
        return min(failed, key=lambda o: o[1]) if failed else (0, -1, 0)
