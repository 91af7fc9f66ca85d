"""What a drive can feed, and what the reader can issue: random 4 KiB O_DIRECT reads a second at a
few queue depths (issue 43, item 3; ``embbench disk PATH``).

At each depth d the reader keeps d reads in flight over a scratch file it writes in PATH (written
for real: pages only allocated would read as zeros without reaching the drive), and counts the
reads done in ``seconds``. Then the same reads, with the same reader and depth, from a file in
memory (a memfd): the reader's own ceiling, the most it could issue whatever the drive. A drive
number near its ceiling says the reader, not the drive, is the limit. On tmpfs, or on a file
system that refuses O_DIRECT, there is no drive to measure: the result says why, and its drive
numbers are None.
"""

from __future__ import annotations

import os
import secrets
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np

from embbench import owned
from embbench.disk.layout import PAGE
from embbench.disk.pagefile import DirectIOError, PageFile, aligned_pages, ensure_space, mount_of
from embbench.disk.reader import ENGINES, Reader, get_reader

__all__ = ["DEFAULT_DEPTHS", "DepthRate", "DriveProbe", "measure_drive"]

DEFAULT_DEPTHS = (1, 4, 16, 64)
DEFAULT_FILE_BYTES = 1 << 30
#: Largest memory file for the ceiling: past the CPU caches, small enough to take from any host.
CEILING_FILE_BYTES = 256 << 20
#: Pages written a call while filling the scratch file (8 MiB).
FILL_PAGES = 2048
#: Bounds of the arguments: each depth's time, and reads in flight (each a thread of the pread pool).
SECONDS_RANGE = (0.01, 600.0)
MAX_DEPTH = 1024
#: Pages read a call at most (32 MiB of buffer): at the largest depth, 8 rounds of reads a call.
MAX_BATCH_PAGES = 8192
#: The scratch file's name in the measured folder (hidden), then ``<pid>-<random>.pages``.
SCRATCH_PREFIX = ".embbench-disk-probe-"


@dataclass(frozen=True)
class DepthRate:
    """``reads`` random page reads done in ``seconds`` with ``depth`` of them in flight."""

    depth: int
    reads: int
    seconds: float

    @property
    def reads_per_s(self) -> float:
        return self.reads / self.seconds

    @property
    def mib_per_s(self) -> float:
        return self.reads_per_s * PAGE / 2**20

    @property
    def mean_latency_us(self) -> float:
        """Mean time a read takes, from Little's law: ``depth`` in flight at ``reads_per_s``."""
        return self.depth / self.reads_per_s * 1e6

    def as_dict(self) -> dict:
        return {**asdict(self), "reads_per_s": self.reads_per_s, "mib_per_s": self.mib_per_s,
                "mean_latency_us": self.mean_latency_us}


@dataclass(frozen=True)
class DriveProbe:
    """A drive's random-read rates (None when there is no drive to measure: ``problem`` says why)
    beside the reader's rates from memory, at the same depths. ``load`` is the machine's 1-minute
    load average before and after, on ``cpus`` CPUs: busy CPUs lower the reader's ceiling."""

    path: str
    filesystem: str
    device: str
    reader: str
    file_bytes: int
    problem: str | None
    drive: list[DepthRate] | None
    memory: list[DepthRate]
    load: tuple[float, float]
    cpus: int

    @property
    def reader_ceiling(self) -> float:
        """The most reads a second the reader issued, from memory, at any depth."""
        return max(rate.reads_per_s for rate in self.memory)

    def as_dict(self) -> dict:
        return {"path": self.path, "filesystem": self.filesystem, "device": self.device, "reader": self.reader,
                "file_bytes": self.file_bytes, "problem": self.problem,
                "drive": None if self.drive is None else [rate.as_dict() for rate in self.drive],
                "memory": [rate.as_dict() for rate in self.memory], "reader_ceiling_reads_per_s": self.reader_ceiling,
                "load": list(self.load), "cpus": self.cpus}


def _rate(fd: int, pages: int, reader: Reader, depth: int, seconds: float, rng: np.random.Generator) -> DepthRate:
    """Random reads of whole pages of ``fd`` for about ``seconds``, in calls of many reads each
    (so the call's own cost, threads started and joined, is spread thin)."""
    batch = max(256, min(32 * depth, MAX_BATCH_PAGES))
    out = aligned_pages(batch)
    reads, start = 0, time.perf_counter()
    while True:  # one call at least: a rate of no reads in no time is no rate
        reader.transfer(fd, rng.integers(0, pages, size=batch), out, write=False)
        reads += batch
        if (elapsed := time.perf_counter() - start) >= seconds:
            return DepthRate(depth, reads, elapsed)


def _fill(write, pages: int, rng: np.random.Generator) -> None:
    """Writes every page, each different (its number in its first bytes), so none reads as a hole."""
    chunk = aligned_pages(min(FILL_PAGES, pages))
    chunk[:] = rng.integers(0, 256, size=chunk.shape, dtype=np.uint8)
    for first in range(0, pages, FILL_PAGES):
        numbers = np.arange(first, min(first + FILL_PAGES, pages), dtype=np.int64)
        part = chunk[: len(numbers)]
        part[:, :8] = numbers.view(np.uint8).reshape(-1, 8)
        write(numbers, part)


def _check_folder(path: Path, file_bytes: int) -> None:
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such folder")
    if not path.is_dir():
        raise NotADirectoryError(f"{path} is not a folder")
    if os.statvfs(path).f_flag & os.ST_RDONLY or not os.access(path, os.W_OK | os.X_OK):
        raise PermissionError(f"{path} is not writable: the probe writes a scratch file there")
    ensure_space(path, file_bytes, f"the probe's scratch file in {path}")


def measure_drive(path: str | os.PathLike, seconds: float = 3.0, depths: tuple[int, ...] = DEFAULT_DEPTHS,
                  file_bytes: int = DEFAULT_FILE_BYTES, *, engine: str = "pread", ceiling_seconds: float | None = None,
                  seed: int = 0) -> DriveProbe:
    """Measures the drive holding the folder ``path`` (see the module's doc). The scratch file is
    removed when done, also on an error or an interrupt. ``ceiling_seconds`` (default: ``seconds``,
    at most 1) is the time each depth gets from memory."""
    path = Path(path)
    low, high = SECONDS_RANGE
    for name, value in (("seconds", seconds), ("ceiling seconds", ceiling_seconds)):
        if value is not None and not low <= value <= high:  # NaN fails both
            raise ValueError(f"{name} {value}: expected {low:g} to {high:g} seconds at each depth")
    if not depths or any(isinstance(d, bool) or not isinstance(d, int) or not 1 <= d <= MAX_DEPTH for d in depths):
        raise ValueError(f"depths {', '.join(map(str, depths)) or '(none)'}: expected 1 to {MAX_DEPTH} reads in flight")
    if file_bytes < PAGE:
        raise ValueError(f"file size {file_bytes} bytes: at least one page ({PAGE} bytes)")
    _check_folder(path, file_bytes)
    mount, rng, load_before = mount_of(path), np.random.default_rng(seed), os.getloadavg()[0]
    pages = file_bytes // PAGE
    drive, problem = None, None
    owned.remove_abandoned(path, f"{SCRATCH_PREFIX}*.pages")  # a killed probe's: its owners are dead
    scratch = path / f"{SCRATCH_PREFIX}{os.getpid()}-{secrets.token_hex(4)}.pages"
    owned.claim(scratch)  # the launcher removes it if this process is killed in a cell
    try:
        with PageFile.create(scratch, pages, reader=get_reader(max(depths), engine)) as file:
            _fill(file.write, pages, rng)
            os.fsync(file.fileno())
            drive = [_rate(file.fileno(), pages, get_reader(depth, engine), depth, seconds, rng) for depth in depths]
    except DirectIOError as refused:
        problem = refused.problem
    finally:
        owned.release(scratch)
    memory = _memory_rates(min(file_bytes, CEILING_FILE_BYTES) // PAGE, depths, engine,
                           min(seconds, 1.0) if ceiling_seconds is None else ceiling_seconds, rng)
    return DriveProbe(str(path), mount.filesystem, mount.device, get_reader(max(depths), engine).kind, file_bytes,
                      problem, drive, memory, (load_before, os.getloadavg()[0]), os.cpu_count() or 1)


def _memory_rates(pages: int, depths, engine: str, seconds: float, rng: np.random.Generator) -> list[DepthRate]:
    """The same reads from a file in memory (a memfd: no drive, no path, gone when closed)."""
    fd = os.memfd_create("embbench-disk-probe")
    try:
        os.ftruncate(fd, pages * PAGE)
        writer = get_reader(max(depths), engine)
        _fill(lambda numbers, data: writer.transfer(fd, numbers, data, write=True), pages, rng)
        return [_rate(fd, pages, get_reader(depth, engine), depth, seconds, rng) for depth in depths]
    finally:
        os.close(fd)


if __name__ == "__main__":  # a module, not a command: say which command measures a drive
    import sys

    print("usage: embbench disk PATH [--seconds S] [--depths D,D,...] [--file-size SIZE] [--engine E] [--json]\n"
          "(python -m embbench.disk.probe runs nothing: `embbench disk --help` says more)", file=sys.stderr)
    sys.exit(2)
