"""A file of 4 KiB pages on a drive, read and written many pages a call with O_DIRECT.

O_DIRECT makes every read go to the drive, not the page cache, so what is measured is the drive.
It needs page-aligned buffers (``aligned_pages``) and a file system that does it: tmpfs takes
O_DIRECT since Linux 6.6 but its "reads" are memory copies, and some file systems refuse it
(EINVAL). With ``direct=True`` (the default) both are errors naming the path; ``direct=False``
opens through the page cache and ``direct_problem`` says why the numbers are not the drive's.
"""

from __future__ import annotations

import errno
import mmap
import os
import shutil
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from embbench.disk.layout import PAGE
from embbench.disk.reader import Engine, Reader, Ticket, TransferError, get_reader

__all__ = ["DirectIOError", "Mount", "PageFile", "Transfer", "aligned_pages", "ensure_space", "mount_of"]

#: File systems whose files live in memory: O_DIRECT there measures memory, not a drive.
MEMORY_FILESYSTEMS = ("tmpfs", "ramfs", "hugetlbfs")


class DirectIOError(OSError):
    """The file cannot be read with O_DIRECT from a drive (tmpfs, or the file system refuses it);
    ``problem`` says which."""

    def __init__(self, path: Path, problem: str):
        super().__init__(errno.EINVAL, f"{path}: cannot read with O_DIRECT from a drive: {problem} "
                                       "(direct=False reads through the page cache, measuring memory)")
        self.problem = problem


def aligned_pages(count: int) -> np.ndarray:
    """``count`` zeroed pages, uint8 [count, PAGE], in memory aligned to a page (an anonymous
    mapping, as O_DIRECT requires)."""
    if count < 0:
        raise ValueError(f"aligned_pages: count must be >= 0, got {count}")
    if count == 0:
        return np.zeros((0, PAGE), dtype=np.uint8)
    return np.frombuffer(mmap.mmap(-1, count * PAGE), dtype=np.uint8).reshape(count, PAGE)


@dataclass(frozen=True)
class Mount:
    """The mount a path is on: its mount point, file system type and device (``/dev/vda``)."""

    point: str
    filesystem: str
    device: str


def _unescape(field: str) -> str:
    # /proc/self/mountinfo writes space, tab, newline and backslash in paths as octal escapes.
    for escaped, char in ((r"\040", " "), (r"\011", "\t"), (r"\012", "\n"), (r"\134", "\\")):
        field = field.replace(escaped, char)
    return field


def mount_of(path: str | os.PathLike) -> Mount:
    """The mount holding ``path`` (or the folder it would be created in), from /proc/self/mountinfo:
    the longest mount point above it, the last one listed when mounts stack."""
    target = os.path.realpath(path)
    best = Mount("/", "unknown", "unknown")
    try:
        lines = Path("/proc/self/mountinfo").read_text().splitlines()
    except OSError:
        return best
    for line in lines:
        fields = line.split()
        if "-" not in fields:
            continue
        point = _unescape(fields[4])
        dash = fields.index("-")
        inside = target == point or target.startswith(point.rstrip("/") + "/")
        if inside and len(point) >= len(best.point):
            best = Mount(point, fields[dash + 1], _unescape(fields[dash + 2]))
    return best


def _format_bytes(n: int) -> str:
    from embbench.recommend import format_bytes  # the project's one byte formatter; imported only on error

    return format_bytes(n)


def ensure_space(folder: Path, need: int, what: str) -> None:
    """An OSError (ENOSPC) saying what is needed and what is free, when ``folder``'s drive lacks
    ``need`` bytes for ``what`` (named in the message)."""
    free = shutil.disk_usage(folder).free
    if need > free:
        raise OSError(errno.ENOSPC, f"not enough space for {what}: needs {_format_bytes(need)}, "
                                    f"{_format_bytes(free)} free on {mount_of(folder).device}")


def _memory_problem(mount: Mount) -> str:
    return f"{mount.filesystem}: O_DIRECT reads would be memory reads, not the drive's"


class PageFile:
    """A file of ``pages`` pages, read and written whole pages at a time by ``reader`` (by default
    the native pread pool with 16 in flight). Several threads may read and write at once; pages
    written concurrently by two callers end as one of the two."""

    def __init__(self, path: Path, fd: int, pages: int, direct: bool, direct_problem: str | None, mount: Mount,
                 reader: Reader):
        self.path, self._fd, self.pages, self.direct = path, fd, pages, direct
        self.direct_problem, self.mount, self.reader = direct_problem, mount, reader

    @property
    def filesystem(self) -> str:
        return self.mount.filesystem

    def __repr__(self) -> str:
        how = "O_DIRECT" if self.direct else f"buffered: {self.direct_problem}"
        return f"PageFile({str(self.path)!r}, {self.pages} pages, {self.filesystem}, {how}, {self.reader.name})"

    # ----------------------------------------------------------------- making and opening

    @classmethod
    def create(cls, path: str | os.PathLike, pages: int, *, direct: bool = True, reader: Reader | None = None) -> PageFile:
        """A new file of ``pages`` zero pages. Refuses a path that exists, a folder that does not,
        and a drive without the space (saying what is needed and what is free). The space is
        allocated now (fallocate), so a full drive shows here and not in the middle of a run; pages
        never written read as zeros without reaching the drive (write them before measuring)."""
        path = Path(path)
        if pages < 0:
            raise ValueError(f"{path}: pages must be >= 0, got {pages}")
        folder = path.parent
        if not folder.is_dir():
            raise FileNotFoundError(errno.ENOENT, f"cannot create {path}: the folder {folder} does not exist")
        if path.exists() or path.is_symlink():
            raise FileExistsError(errno.EEXIST, f"{path} exists: refusing to overwrite it (remove it, or open it)")
        need, mount = pages * PAGE, mount_of(folder)
        if direct and mount.filesystem in MEMORY_FILESYSTEMS:  # said before a byte of memory is taken
            raise DirectIOError(path, _memory_problem(mount))
        ensure_space(folder, need, str(path))
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            try:
                if need:
                    os.posix_fallocate(fd, 0, need)
            except OSError as error:
                if error.errno == errno.ENOSPC:
                    raise OSError(errno.ENOSPC, f"no space left on {mount.device} allocating "
                                                f"{_format_bytes(need)} for {path}") from None
                if error.errno not in (errno.EOPNOTSUPP, errno.EINVAL):
                    raise
                os.ftruncate(fd, need)  # a file system without fallocate: a sparse file of zeros
        except BaseException:
            os.close(fd)
            path.unlink(missing_ok=True)
            raise
        os.close(fd)
        try:
            return cls.open(path, direct=direct, reader=reader)
        except BaseException:
            path.unlink(missing_ok=True)
            raise

    @classmethod
    def open(cls, path: str | os.PathLike, direct: bool = True, *, reader: Reader | None = None) -> PageFile:
        """An existing page file, for reading and writing."""
        path = Path(path)
        if not path.is_file():
            what = "is not a regular file" if path.exists() else "does not exist"
            raise FileNotFoundError(errno.ENOENT, f"page file {path} {what}")
        size = path.stat().st_size
        if size % PAGE:
            raise ValueError(f"{path}: {size} bytes is not a whole number of {PAGE}-byte pages")
        mount = mount_of(path)
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
        problem = _direct_problem(path, fd, size, mount) if direct else None
        if problem is not None:
            os.close(fd)
            raise DirectIOError(path, problem)
        if direct:
            os.close(fd)
            fd = os.open(path, os.O_RDWR | os.O_CLOEXEC | os.O_DIRECT)
        else:
            problem = _direct_problem(path, fd, size, mount) or "opened without O_DIRECT: reads may come from the page cache"
        return cls(path, fd, size // PAGE, direct, problem, mount, reader or get_reader())

    # ----------------------------------------------------------------- transfers

    def fileno(self) -> int:
        if self._fd is None:
            raise ValueError(f"page file {self.path} is closed")
        return self._fd

    def read(self, pages: np.ndarray, out: np.ndarray) -> None:
        """Reads page ``pages[i]`` into ``out[i]`` for each i, ``out`` uint8 [len(pages), PAGE]
        (page-aligned when direct: see ``aligned_pages``). Blocks, without the GIL."""
        self._transfer(pages, out, write=False)

    def write(self, pages: np.ndarray, data: np.ndarray) -> None:
        """Writes ``data[i]`` to page ``pages[i]`` for each i (no page twice in one call)."""
        self._transfer(pages, data, write=True)

    def submit(self, engine: Engine, pages: np.ndarray, buf: np.ndarray, buf_pages: np.ndarray, write: bool,
               urgent: bool = False) -> "Transfer":
        """Queues, on ``engine``'s threads, page ``pages[i]`` to (or from) page ``buf_pages[i]``
        of ``buf`` for each i, and returns at once; :meth:`Transfer.wait` raises an error naming
        the file and the page. The caller keeps ``buf``'s pages untouched until then."""
        fd = self.fileno()
        pages = self._checked(pages, None, write)
        buf_pages = np.ascontiguousarray(buf_pages, dtype=np.int64)
        if not isinstance(buf, np.ndarray) or buf.dtype != np.uint8 or buf.ndim != 2 or buf.shape[1] != PAGE \
                or not buf.flags.c_contiguous or not (write or buf.flags.writeable):
            raise ValueError(f"{self.path}: the buffer must be C-contiguous, writeable uint8 [n, {PAGE}]")
        if buf_pages.shape != pages.shape or (len(buf_pages) and (buf_pages.min() < 0 or buf_pages.max() >= len(buf))):
            raise ValueError(f"{self.path}: buffer pages must be one per page and within the buffer's {len(buf)}")
        if self.direct and len(pages) and buf.ctypes.data % PAGE:
            raise ValueError(f"{self.path}: the buffer is not {PAGE}-byte aligned, as O_DIRECT needs")
        return Transfer(self, engine.submit(fd, pages, buf, buf_pages, write, urgent), pages, write)

    def _transfer(self, pages: np.ndarray, buf: np.ndarray, write: bool) -> None:
        fd = self.fileno()
        pages = self._checked(pages, buf, write)
        try:
            self.reader.transfer(fd, pages, buf, write)
        except TransferError as error:
            raise self._failure(error, pages, write) from None

    def _checked(self, pages: np.ndarray, buf: np.ndarray | None, write: bool) -> np.ndarray:
        what = "data" if write else "out"
        pages = np.asarray(pages)
        if pages.ndim != 1 or not (np.issubdtype(pages.dtype, np.integer) or pages.size == 0):
            raise ValueError(f"{self.path}: pages must be a 1-D integer array, got {pages.dtype} {pages.shape}")
        pages = np.ascontiguousarray(pages, dtype=np.int64)
        if buf is None:  # (submit checks its buffer itself)
            return self._checked_pages(pages, write)
        if not isinstance(buf, np.ndarray) or buf.dtype != np.uint8 or buf.shape != (len(pages), PAGE):
            got = f"{buf.dtype} {buf.shape}" if isinstance(buf, np.ndarray) else type(buf).__name__
            raise ValueError(f"{self.path}: {what} must be uint8 [{len(pages)}, {PAGE}] (one page per page "
                             f"number), got {got}")
        if not buf.flags.c_contiguous or not (write or buf.flags.writeable):
            raise ValueError(f"{self.path}: {what} must be C-contiguous" + ("" if write else " and writeable"))
        if self.direct and len(pages) and buf.ctypes.data % PAGE:
            raise ValueError(f"{self.path}: {what} is not {PAGE}-byte aligned, as O_DIRECT needs "
                             "(allocate it with aligned_pages)")
        return self._checked_pages(pages, write)

    def _checked_pages(self, pages: np.ndarray, write: bool) -> np.ndarray:
        if len(pages):
            bad = pages[(pages < 0) | (pages >= self.pages)]
            if len(bad):
                raise ValueError(f"{self.path}: page {bad[0]} is out of range: the file has {self.pages} pages")
            if write and len(np.unique(pages)) != len(pages):
                seen, counts = np.unique(pages, return_counts=True)
                raise ValueError(f"{self.path}: page {seen[counts > 1][0]} is written twice in one call")
        return pages

    def _failure(self, error: TransferError, pages: np.ndarray, write: bool) -> OSError:
        verb = "writing" if write else "reading"
        page = f"page {pages[error.index]}" if 0 <= error.index < len(pages) else "pages"
        if error.errno == 0:
            return OSError(errno.EIO, f"short {'write' if write else 'read'} of {page} in {self.path}: "
                                      f"{error.done} of {PAGE} bytes (was the file truncated?)")
        if error.errno == errno.ENOSPC:
            return OSError(errno.ENOSPC, f"no space left on {self.mount.device} writing {self.path} ({page})")
        return OSError(error.errno, f"{os.strerror(error.errno)} {verb} {page} of {self.path}")

    # ----------------------------------------------------------------- closing

    def close(self) -> None:
        if self._fd is not None:
            fd, self._fd = self._fd, None
            os.close(fd)

    def remove(self) -> None:
        """Closes and deletes the file."""
        self.close()
        self.path.unlink(missing_ok=True)

    def __enter__(self) -> PageFile:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class Transfer:
    """Pages queued by :meth:`PageFile.submit`: :meth:`done`, or :meth:`wait` for them (an error
    names the file and the page)."""

    def __init__(self, file: PageFile, ticket: Ticket, pages: np.ndarray, write: bool):
        self._file, self._ticket, self._pages, self._write = file, ticket, pages, write

    def done(self) -> bool:
        return self._ticket.done()

    def wait(self) -> None:
        try:
            self._ticket.wait()
        except TransferError as error:
            raise self._file._failure(error, self._pages, self._write) from None


def _direct_problem(path: Path, fd: int, size: int, mount: Mount) -> str | None:
    """Why reads of this file with O_DIRECT would not measure a drive, or None."""
    if mount.filesystem in MEMORY_FILESYSTEMS:
        return _memory_problem(mount)
    try:
        direct = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_DIRECT)
    except OSError as error:
        if error.errno != errno.EINVAL:
            raise
        return f"the file system ({mount.filesystem}) refuses O_DIRECT (EINVAL)"
    try:
        if size:  # some file systems take the flag at open and refuse the reads
            os.preadv(direct, [aligned_pages(1)], 0)
    except OSError as error:
        if error.errno != errno.EINVAL:
            raise
        return f"the file system ({mount.filesystem}) refuses O_DIRECT reads (EINVAL)"
    finally:
        os.close(direct)
    return None
