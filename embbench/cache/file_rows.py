"""freqcache's host rows in a file on a drive, behind a host-memory cache of the file's pages
(``store: file``; issue 43).

The file holds every row packed with its scale and optimizer state (the layout of
:mod:`embbench.disk.layout`: rows whole in 4 KiB pages), read and written with O_DIRECT, so that
the drive is measured and not the kernel's page cache. Host memory holds ``dram_ratio`` of the
file's pages (a *block* is the unit: one page of rows, or the pages of one larger row).

The look-ahead is what lets a drive keep up: each training batch is *announced* when it enters
freqcache's window (batches before it is planned); the blocks it touches that host memory lacks
are queued then on the reader's engine (:class:`~embbench.disk.reader.Engine`: threads that live
across calls and keep the reads of successive announcements in flight together), which reads
each page straight into its slot, and the batch's blocks are pinned until its rows have moved. Announced batches are issued in order
as long as the pinned blocks leave a quarter of host memory free; the rest wait in a queue. A
step waits only for reads that have not arrived (its *stall*); a row that no announcement
brought (an evaluation batch, a write-back into an evicted block) is read on demand, also a
stall. An evicted dirty block is copied out of its slot and written from that copy, so the read
into the slot need not wait; a read of a block whose write (or patch) is still in flight waits
for it.

The bookkeeping arrays are guarded by one lock: an announcement's own work (its blocks, found
with ``np.unique``; pins, evictions, reads queued) runs on a bookkeeping thread, off the caller's
thread, and a call that depends on an announcement waits for it first (the batch's gather and
release). The engine only moves bytes between the file and slots that no one else touches until
their transfer is reaped.

Longer than 600 lines because: host memory's slots, their pins, the reads ahead, the write-backs
and the patches are one set of maps under one lock; split across modules, each part would reach
into the others' arrays.
"""

from __future__ import annotations

import functools
import itertools
import math
import os
import threading
import time
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

import numpy as np
import torch
from torch import Tensor

from embbench import owned
from embbench.cache.slot_lru import SlotLru
from embbench.disk.layout import PAGE, PageLayout, RowOrder
from embbench.disk.pagefile import PageFile, Transfer, aligned_pages
from embbench.disk.reader import Engine, get_reader

__all__ = ["FileRows", "STORE_COUNTERS", "host_memory_problem", "host_view_on"]

#: The counters a file store adds to freqcache's (cumulative; nanoseconds as integers).
STORE_COUNTERS = ("dram_loads", "dram_load_misses", "dram_write_backs", "dram_write_misses", "nvme_pages_read",
                  "nvme_pages_written", "nvme_pages_read_on_demand", "nvme_pages_read_ahead", "nvme_read_ns",
                  "nvme_engine_ios", "nvme_pages_read_for_writes", "stall_ns", "prefetch_batches_waited")


@dataclass
class _Job:
    """One announced batch's reads of the blocks it lacked, straight into their slots."""

    number: int
    slots: np.ndarray  # the slots it fills (their ready flag is set when it is reaped)
    reads: Transfer


def _locked(settle_all: bool):
    """The method runs under the store's lock, after every announcement (``settle_all``) or
    none (a write-back needs none: a block an announcement reads later waits for its writes)."""

    def wrap(method):
        @functools.wraps(method)
        def run(self, *args, **kw):
            if settle_all:
                self._settle(None)
            with self._lock:
                return method(self, *args, **kw)

        return run

    return wrap


class FileRows:
    """``rows`` packed rows of ``width`` ``dtype`` elements, in a file at ``path`` (made here,
    removed by :meth:`close`, or by the launcher when the cell ends: see :meth:`create`), behind a host-memory cache of ``dram_ratio`` of its blocks.
    :meth:`create` names the file and finds the ones earlier runs left.

    Args:
        batch_blocks: the most distinct blocks one batch touches (from the profile): host memory
            keeps that many free for reads on demand, and must hold twice as many (a smaller
            ``dram_ratio`` is refused, saying which is needed).
        direct: read and write with O_DIRECT (False only where a test must run on tmpfs).
        io_depth: reads the reader keeps in flight.
        order: where each row sits in the file (:class:`~embbench.disk.layout.RowOrder`; default
            row r at place r). The callers speak of rows; pages hold places.
        table_starts: each table's first row: the loads and write-backs are counted per table too.
    """

    @classmethod
    def create(cls, folder: Path, rank: int, rows: int, width: int, dtype: torch.dtype, dram_ratio: float,
               batch_blocks: int, **kw) -> "FileRows":
        """A store in ``folder``, named after this process and claimed for its run
        (:mod:`embbench.owned`: an owner note beside it, so the launcher removes it when the
        cell ends, however it ends), after removing the row files that runs which are gone left
        there. Only a file whose owner note proves it a run's is touched; one another live run
        holds is refused by name (two runs must not share a store_dir); a sibling rank's, of
        this run, is left alone."""
        folder = Path(folder)
        if not folder.is_dir():
            raise ValueError(f"store_dir {folder}: " + ("not a directory" if folder.exists() else "does not exist"))
        if not os.access(folder, os.W_OK | os.X_OK):
            raise ValueError(f"store_dir {folder}: not writable by this user")
        removed, live = owned.remove_abandoned(folder, f"{_PREFIX}*.rows")
        others = [(path, owner) for path, owner in live if owner.run != owned.run_id()]
        if others:
            path, owner = others[0]
            raise ValueError(f"store_dir {folder}: {path.name} belongs to another run still going (pids "
                             f"{', '.join(map(str, owner.pids))}): give each run its own store_dir")
        path = folder / f"{_PREFIX}{os.getpid()}-rank{rank}-{next(_made)}.rows"
        owned.claim(path)
        try:
            store = cls(path, rows, width, dtype, dram_ratio, batch_blocks, **kw)
        except BaseException:
            owned.release(path)
            raise
        store.removed_stale = removed
        return store

    def __init__(self, path: Path, rows: int, width: int, dtype: torch.dtype, dram_ratio: float, batch_blocks: int,
                 direct: bool = True, io_depth: int = 32, order: RowOrder | None = None,
                 table_starts: np.ndarray | None = None):
        self.dtype, self.width = dtype, width
        self.table_starts = np.zeros(1, np.int64) if table_starts is None else np.asarray(table_starts, np.int64)
        # per table: dram_loads, dram_load_misses, dram_write_backs, dram_write_misses
        self.table_counts = np.zeros((len(self.table_starts), 4), np.int64)
        self.counting = True  # the per-table counts, an instrument: off in timed steps (FreqCache.set_counting)
        self.order = order or RowOrder(rows)
        self.row_bytes = width * torch.empty(0, dtype=dtype).element_size()
        self.layout = layout = PageLayout(rows, self.row_bytes)
        self.rows_per_block, self.block_pages = layout.rows_per_page, layout.pages_per_row
        self.block_bytes = self.block_pages * PAGE
        self.blocks = math.ceil(rows / self.rows_per_block) if rows else 0
        problem = host_memory_problem(layout, dram_ratio, batch_blocks)
        if problem:
            raise ValueError(problem)
        self.capacity = capacity = min(self.blocks, math.ceil(dram_ratio * self.blocks))
        self.reserve = min(batch_blocks, capacity // 2)  # kept free for reads on demand
        self.removed_stale: list[str] = []
        self.file = PageFile.create(path, layout.pages, direct=direct, reader=get_reader(io_depth))
        self.engine = Engine(io_depth)  # the reads ahead, on demand and the write-backs
        self.path = self.file.path
        self.buffer = aligned_pages(capacity * self.block_pages)  # [pages, PAGE] uint8
        self._rows = self._block_rows(self.buffer)  # every row of every slot: [slot, row in block, byte]
        self.block_slot = np.full(self.blocks, -1, np.int64)
        self.slot_block = np.full(capacity, -1, np.int64)
        self.lru = SlotLru(capacity)  # pins, arrivals, recency: the victims without a scan of every slot
        # (read-only views: they change through self.lru)
        self.ready, self.pins, self.last_use = (_read_only(a) for a in (self.lru.ready, self.lru.pins, self.lru.last_use))
        self.dirty = np.zeros(capacity, bool)
        self.read_for = np.full(capacity, -1, np.int64)  # the batch whose announcement read the slot's block
        self.filled_by = np.full(capacity, -1, np.int64)  # the job that fills the slot
        self._patcher = ThreadPoolExecutor(1, thread_name_prefix="embbench-rows-patch")  # read, patch, write
        self._lock = threading.RLock()  # the bookkeeping's: the caller's thread and the announcements'
        self._books = ThreadPoolExecutor(1, thread_name_prefix="embbench-rows-books")  # announcements, in order
        self._announcing: deque[tuple[int, Future]] = deque()  # (number, its work), not waited for yet
        self._jobs: deque[_Job] = deque()  # submitted, not reaped, in order
        # blocks with a write (a write-back or a patch) in flight: a read of one waits for it
        self._writing: dict[int, Transfer | Future] = {}
        self._writes: deque[tuple[np.ndarray, Transfer | Future]] = deque()  # in flight, in order
        self._queued: deque[tuple[int, np.ndarray]] = deque()  # announced, not issued: (number, blocks)
        self._pinned: dict[int, np.ndarray] = {}  # issued batch -> its slots
        # an announced batch's reads and writes, counted when its rows move (its reads may be
        # issued many batches before: the step that loads them is the one they serve, and the one
        # that counts the rows they bring)
        self._issued: dict[int, list[tuple[int, int]]] = {}
        self.counts = dict.fromkeys(STORE_COUNTERS, 0)
        # blocks whose slot changed since the device's block map was last told (FileMoves)
        self._changed: set[int] = set()
        self._registered = None  # the buffer's address while CUDA maps it (device_slots)

    # -- what the caller sees --------------------------------------------------------------------

    @property
    def nbytes(self) -> int:
        """Host memory the store holds: its blocks and its maps."""
        maps = self.order.nbytes + self.block_slot.nbytes + self.lru.nbytes + sum(
            a.nbytes for a in (self.slot_block, self.dirty, self.read_for, self.filled_by))
        return self.buffer.nbytes + maps

    def describe(self) -> dict:
        return {"store": "file", "store_file": str(self.path), "store_file_bytes": self.layout.file_bytes,
                "store_filesystem": self.file.filesystem, "store_direct": self.file.direct,
                "store_direct_problem": self.file.direct_problem, "store_reader": self.engine.name,
                "dram_blocks": self.capacity, "store_blocks": self.blocks, "rows_per_block": self.rows_per_block,
                "block_bytes": self.block_bytes, "store_layout": self.order.name,
                "store_rows_moved": len(self.order.moved), "store_files_removed": self.removed_stale}

    def fill(self, make_rows: Callable[[int, int], Tensor], chunk_blocks: int = 4096,
             run: Callable[[Callable, list], None] | None = None) -> None:
        """Write every row once, a chunk of whole blocks at a time: ``make_rows(start, stop)``
        returns rows ``[start, stop)`` packed (``[n, width]`` of ``dtype``). ``run(fill, jobs)``
        may run the chunks side by side (they write distinct pages). With rows moved by the
        order, their values are made first (a pass over the chunks that hold them)."""
        step = chunk_blocks * self.rows_per_block
        jobs = [(lo, min(self.layout.rows, lo + step)) for lo in range(0, self.layout.rows, step)]
        moved = self.order.moved
        moved_values = torch.empty(len(moved), self.row_bytes, dtype=torch.uint8)

        def packed(lo: int, hi: int) -> Tensor:
            return make_rows(lo, hi).contiguous().view(torch.uint8).reshape(hi - lo, self.row_bytes)

        def collect(job: tuple[int, int]) -> None:
            a, b = np.searchsorted(moved, job)
            if a < b:
                moved_values[a:b] = packed(*job)[torch.from_numpy(moved[a:b] - job[0])]

        if len(moved):
            (run or _serially)(collect, jobs)
        row_at_moved = self.order.row_at(moved)  # the row at each moved place (the moved set is also theirs)

        def fill(job: tuple[int, int]) -> None:
            lo, hi = job  # places
            blocks = math.ceil((hi - lo) / self.rows_per_block)
            staging = aligned_pages(blocks * self.block_pages)
            padded = torch.zeros(blocks * self.rows_per_block, self.row_bytes, dtype=torch.uint8)
            padded[: hi - lo] = packed(lo, hi)  # the rows that stay at their own place
            a, b = np.searchsorted(moved, job)  # the places of moved rows here (the moved set is theirs)
            if a < b:
                rows_there = row_at_moved[a:b]
                padded[torch.from_numpy(moved[a:b] - lo)] = moved_values[torch.from_numpy(np.searchsorted(moved, rows_there))]
            self._block_rows(staging).copy_(padded.view(blocks, self.rows_per_block, self.row_bytes))
            first = lo // self.rows_per_block
            self.file.write(self._pages_of(np.arange(first, first + blocks)), staging)

        (run or _serially)(fill, jobs)

    def announce(self, number: int, rows: np.ndarray) -> None:
        """Training batch ``number`` (in window order) will touch ``rows``: read what host memory
        lacks, in the background, as soon as there is room. A batch may be announced again with
        more rows (before its rows move): they join it, ahead of the later batches. Returns at
        once: the bookkeeping thread does the work."""
        rows = np.array(rows, dtype=np.int64)  # (a copy: the caller may reuse its array)
        self._announcing.append((number, self._books.submit(self._announced, number, rows)))

    def settle(self) -> None:
        """Wait for every announcement's (and release's) work on the bookkeeping thread."""
        self._settle(None)

    def _settle(self, upto: int | None) -> None:
        """(On the caller's thread.) Wait for the announcements of batches up to ``upto`` (all:
        None), re-raising their errors."""
        later: deque[tuple[int, Future]] = deque()
        while self._announcing:
            number, work = self._announcing.popleft()
            if upto is None or number <= upto:
                work.result()
            else:
                later.append((number, work))
        self._announcing = later

    def _announced(self, number: int, rows: np.ndarray) -> None:
        """(On the bookkeeping thread.) The batch's blocks, then, under the lock, its reads."""
        blocks = np.unique(self.order.place(rows) // self.rows_per_block)
        if not len(blocks):
            return
        with self._lock:
            self._queue(number, blocks)

    def _queue(self, number: int, blocks: np.ndarray) -> None:
        at = len(self._queued)
        while at and self._queued[at - 1][0] > number:
            at -= 1
        self._queued.insert(at, (number, blocks))
        self._issue()

    def release(self, number: int) -> None:
        """Batch ``number``'s rows have moved: its blocks may be evicted again (after its
        announcements, and those of the batches before it)."""
        self._settle(number)
        with self._lock:
            self._release(number)

    def release_after(self, number: int, moved: "torch.cuda.Event | None") -> None:
        """As :meth:`release`, done by the bookkeeping thread once the device's moves have
        happened (``moved``; None: they have); the caller returns at once."""
        self._announcing.append((number, self._books.submit(self._released, number, moved)))

    def _released(self, number: int, moved) -> None:
        if moved is not None:
            moved.synchronize()  # (on the bookkeeping thread: the device's moves out of the slots are done)
        with self._lock:
            self._release(number)

    # -- the device's side of the moves (embbench.cache.file_moves) --------------------------------

    def announce_from_device(self, number: int, rows: Tensor, copied: "torch.cuda.Event | None") -> None:
        """As :meth:`announce`, with the batch's rows in a host tensor that the device fills
        (``-1``: no row; fixed size), ready once ``copied`` has happened: the bookkeeping
        thread waits for it, drops the padding and finds the blocks."""
        self._announcing.append((number, self._books.submit(self._announced_from_device, number, rows, copied)))

    def _announced_from_device(self, number: int, rows: Tensor, copied) -> None:
        if copied is not None:
            copied.synchronize()
        rows = rows.numpy()
        self._announced(number, rows[rows >= 0])

    def ready_for(self, number: int) -> tuple[np.ndarray, np.ndarray]:
        """(Before batch ``number``'s rows move on the device.) Wait for its announcements and
        reads (a stall where they have not arrived); returns the blocks whose slot changed since
        the last call and their slots (-1: gone), for the device's block map."""
        self._settle(number)
        with self._lock:
            self._issue(upto=number)
            self._wait_for(number)
            self._count_issued(number)
            if number in self._pinned:  # its pages are used now (their rows' write-backs come later)
                self._touch(self._pinned[number])
            blocks = np.fromiter(self._changed, np.int64, len(self._changed))
            self._changed.clear()
            return blocks, self.block_slot[blocks]

    def after_device(self, work: Callable[[], None], done: "torch.cuda.Event | None") -> Future:
        """Run ``work`` on the bookkeeping thread, in order with the announcements, once the
        device has reached ``done`` (the device's write-backs: :class:`FileMoves`)."""
        def run():
            if done is not None:
                done.synchronize()
            work()

        return self._books.submit(run)  # (the caller waits for it: not an announcement)

    @_locked(False)
    def count_loads(self, rows: np.ndarray, number: int) -> None:
        """(Counted steps: an instrument.) The rows batch ``number``'s moves loaded on the device
        from host memory, and those host memory lacked when it was announced (its misses: their
        block was read for it, or for a later batch announced first whose read it used first);
        each was announced, so its block is pinned and holds it."""
        places = self.order.place(rows)
        slots = self.block_slot[places // self.rows_per_block]
        if (slots < 0).any():
            raise RuntimeError(f"{self.path}: batch {number} loaded rows no announcement brought into host memory "
                               f"(rows {rows[slots < 0][:5].tolist()}): the device read a block that is not there")
        missed = self.read_for[slots] >= number  # (read for it, or for a later batch and first used by it)
        self.counts["dram_loads"] += len(rows)
        self.counts["dram_load_misses"] += int(missed.sum())
        if self.counting:
            self._count_tables(self._tables_of(rows), 0, missed)

    def device_slots(self, device: torch.device) -> Tensor:
        """Host memory's slots as int32 words that ``device`` addresses (``[slots, block
        words]``): on CUDA the buffer registered with the driver (mapped, so the GPU's loads
        read it over the bus) and seen as a CUDA tensor; elsewhere the buffer itself."""
        flat = torch.from_numpy(self.buffer).view(-1).view(torch.int32)
        if device.type != "cuda":
            return flat.view(self.capacity, -1)
        address, size = self.buffer.ctypes.data, self.buffer.nbytes
        if self._registered is None:
            error = torch.cuda.cudart().cudaHostRegister(address, size, 3)  # portable | mapped
            if int(error) != 0:
                raise RuntimeError(f"{self.path}: cudaHostRegister of host memory's {size:,} bytes failed: {error}")
            self._registered = address
        return host_view_on(flat.view(self.capacity, -1), device)

    def _count_issued(self, number: int) -> None:
        """Batch ``number``'s reads and writes, into the counters (once)."""
        for pages_read, pages_written in self._issued.pop(number, []):
            self.counts["nvme_pages_read"] += pages_read
            self.counts["nvme_pages_read_ahead"] += pages_read
            self.counts["nvme_pages_written"] += pages_written

    def _release(self, number: int) -> None:
        self._count_issued(number)  # (a batch the host moved: not counted at its loads)
        slots = self._pinned.pop(number, None)
        if slots is not None:
            self._wait_for(number)  # (done by now): an unpinned slot must hold what it says
            self.lru.unpin(slots)
        self._queued = deque((n, b) for n, b in self._queued if n != number)  # never issued: drop it
        self._issue()

    def gather(self, rows: np.ndarray, number: int | None = None) -> Tensor:
        """Rows ``rows`` (distinct), packed: ``[len(rows), width]`` of ``dtype``. ``number``:
        the batch whose plan loads them (counts a row its announcement read as a miss of
        host memory; its announcements, and those before it, are done first)."""
        if number is not None:
            self._settle(number)
        with self._lock:
            return self._gather(rows, number)

    def _gather(self, rows: np.ndarray, number: int | None) -> Tensor:
        tables = self._tables_of(rows) if self.counting else None
        rows = self.order.place(rows)  # (from here on, rows are places)
        out = torch.empty(len(rows), self.row_bytes, dtype=torch.uint8)
        for part in self._parts(rows):  # more blocks than host memory has room for: a part at a time
            slots, within, missed = self._resident(rows[part], number)
            self.counts["dram_loads"] += len(part)
            self.counts["dram_load_misses"] += int(missed.sum())
            if tables is not None:
                self._count_tables(tables[part], 0, missed)
            out[torch.from_numpy(part)] = self._rows[torch.from_numpy(slots), torch.from_numpy(within)]
        return out.view(self.dtype)

    def _parts(self, rows: np.ndarray) -> list[np.ndarray]:
        """Positions of ``rows`` in parts that each touch at most the reserve's blocks (one part,
        all of them, when they fit)."""
        blocks = rows // self.rows_per_block
        distinct = np.unique(blocks)
        if len(distinct) <= max(1, self.reserve):
            return [np.arange(len(rows))]
        order = np.argsort(blocks, kind="stable")
        part_of = np.searchsorted(distinct, blocks[order]) // max(1, self.reserve)
        return np.split(order, np.flatnonzero(np.diff(part_of)) + 1)

    @_locked(False)
    def scatter(self, rows: np.ndarray, values: Tensor) -> None:
        """Write packed rows (distinct). Rows whose block host memory holds are written there
        (the file gets them when the block is evicted); the others are patched into the file by
        a background job (read, patch, write): a write-back never waits for a read."""
        tables = self._tables_of(rows) if self.counting else None
        rows = self.order.place(rows)  # (from here on, rows are places)
        values = values.contiguous().view(torch.uint8).reshape(len(rows), self.row_bytes)
        held = self.block_slot[rows // self.rows_per_block] >= 0
        self.counts["dram_write_backs"] += len(rows)
        self.counts["dram_write_misses"] += int((~held).sum())
        if tables is not None:
            self._count_tables(tables, 2, ~held)
        if not held.all():
            self._submit_patch(rows[~held], values[torch.from_numpy(~held)].clone())
        slots, within, _ = self._resident(rows[held], None)
        self._rows[torch.from_numpy(slots), torch.from_numpy(within)] = values[torch.from_numpy(held)]
        self.dirty[slots] = True

    @_locked(True)
    def table(self) -> Tensor:
        """Every row (``[rows, width]``), read back from the file after writing every dirty
        block: what :meth:`flush` of the cache returns. Holds the whole table: for tests."""
        self.write_dirty()
        out = torch.empty(self.layout.rows, self.width, dtype=self.dtype)
        per = 4096
        for first in range(0, self.blocks, per):
            blocks = np.arange(first, min(self.blocks, first + per))
            staging = aligned_pages(len(blocks) * self.block_pages)
            self.file.read(self._pages_of(blocks), staging)
            view = self._block_rows(staging)
            lo = first * self.rows_per_block
            hi = min(self.layout.rows, lo + len(blocks) * self.rows_per_block)
            rows = torch.from_numpy(self.order.row_at(np.arange(lo, hi)))
            out[rows] = view.reshape(-1, self.row_bytes)[: hi - lo].view(self.dtype)
        return out

    @_locked(True)
    def write_dirty(self) -> None:
        """Every dirty block to the file (waits for the background jobs first)."""
        self._drain()
        slots = np.flatnonzero(self.dirty & (self.slot_block >= 0))
        if len(slots):
            self._write(self.slot_block[slots], slots)
            self.dirty[slots] = False

    def _tables_of(self, rows: np.ndarray) -> np.ndarray:
        return np.searchsorted(self.table_starts, np.asarray(rows, dtype=np.int64), side="right") - 1

    def _count_tables(self, tables: np.ndarray, column: int, missed: np.ndarray) -> None:
        """Per table: rows (column) and those host memory lacked (column + 1)."""
        n = len(self.table_starts)
        self.table_counts[:, column] += np.bincount(tables, minlength=n)
        self.table_counts[:, column + 1] += np.bincount(tables[missed], minlength=n)

    @_locked(True)
    def table_counters(self, names: list[str]) -> dict[str, int]:
        """``table.<name>.<counter>``: the host tier's counters of each table."""
        out = {}
        for name, counts in zip(names, self.table_counts.tolist()):
            for key, value in zip(("dram_loads", "dram_load_misses", "dram_write_backs", "dram_write_misses"), counts):
                out[f"table.{name}.{key}"] = value
        return out

    @_locked(True)
    def counters(self) -> dict[str, int]:
        self._reap()
        engine = self.engine.stats()  # the time it had a transfer in flight, and its transfers
        self.counts["nvme_read_ns"] = engine["busy_ns"]
        self.counts["nvme_engine_ios"] = engine["pages_read"] + engine["pages_written"]
        return dict(self.counts)

    def close(self, remove: bool = True) -> None:
        """Stop the background work and close (and remove, with its owner note) the file; safe
        to call twice."""
        self._books.shutdown(wait=True, cancel_futures=True)
        self._announcing.clear()
        self._patcher.shutdown(wait=True, cancel_futures=True)
        if self._registered is not None:
            torch.cuda.cudart().cudaHostUnregister(self._registered)
            self._registered = None
        self.engine.close()
        self.file.close()
        if remove:
            owned.release(self.path)

    # -- host memory ---------------------------------------------------------------------------

    def _issue(self, upto: int | None = None) -> None:
        """Issue queued announcements in order while their pins leave the reserve of host memory
        (the first always goes: the batch planned next must not wait for room; so do those of
        batches up to ``upto``, whose rows are about to move)."""
        reserve = self.reserve
        self._reap()
        while self._queued:
            number, blocks = self._queued[0]
            slots = self.block_slot[blocks]
            present = slots >= 0
            more = int((~present).sum()) + int((self.pins[slots[present]] == 0).sum())
            due = upto is not None and number <= upto
            if self._pinned and not due and self.lru.pinned + more > self.capacity - reserve:
                return
            self._queued.popleft()
            missing = blocks[~present]
            self._touch(slots[present])
            self.lru.pin(slots[present])
            if len(missing):
                victims = self._evict(len(missing))
                leaving = self._attach(missing, victims)
                self.lru.pin(victims)
                self.read_for[victims] = number
                self._submit(number, leaving, missing, victims)
                slots = self.block_slot[blocks]
            self._pinned[number] = slots if number not in self._pinned else np.concatenate([self._pinned[number], slots])

    def _evict(self, k: int, keep: np.ndarray | None = None) -> np.ndarray:
        """``k`` unpinned slots, empty ones first then the least recently used, never one of
        ``keep`` (the slots the caller is about to use); their dirty blocks are written by the
        job that fills them (before it reads)."""
        victims = self.lru.victims(k, keep)  # (never a slot being read into)
        if victims is None:
            raise RuntimeError(f"{self.path}: host memory holds {self.capacity:,} blocks, {self.lru.evictable(keep):,} of "
                               f"them free of announced batches: {k:,} more do not fit (a batch touched more blocks "
                               "than the profiled ones: raise dram_ratio)")
        return victims

    def _attach(self, blocks: np.ndarray, slots: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``slots`` will hold ``blocks`` (not ready until they are read); returns the dirty
        blocks that leave host memory, and their slots: they must be written before the read."""
        old = self.slot_block[slots]
        self.block_slot[old[old >= 0]] = -1
        self._changed.update(old[old >= 0].tolist())
        self._changed.update(blocks.tolist())
        dirty = (old >= 0) & self.dirty[slots]
        leaving = (old[dirty], slots[dirty])
        self.slot_block[slots] = blocks
        self.block_slot[blocks] = slots
        self.dirty[slots] = False
        self.lru.attach(slots)
        return leaving

    def _submit(self, number: int, leaving: tuple[np.ndarray, np.ndarray], blocks: np.ndarray,
                slots: np.ndarray) -> None:
        """Dirty victims out (from a copy), and ``blocks`` read straight into ``slots``."""
        pages_written = self._write_back(*leaving)
        self._wait_for_writes(blocks)
        self.filled_by[slots] = number
        reads = self.file.submit(self.engine, self._pages_of(blocks), self.buffer, self._slot_pages(slots), write=False)
        self._jobs.append(_Job(number, slots, reads))
        self._issued.setdefault(number, []).append((len(blocks) * self.block_pages, pages_written))

    def _write_back(self, blocks: np.ndarray, slots: np.ndarray) -> int:
        """Queue the writes of dirty ``blocks`` leaving ``slots``, from a copy (the slots may be
        read into at once); returns the pages written."""
        if not len(blocks):
            return 0
        copy = self.buffer[self._slot_pages(slots)]  # (fancy indexing copies, into aligned memory below)
        staging = aligned_pages(len(copy))
        staging[:] = copy
        writes = self.file.submit(self.engine, self._pages_of(blocks), staging, np.arange(len(staging)), write=True)
        self._track_writes(blocks, writes)
        return len(blocks) * self.block_pages

    def _track_writes(self, blocks: np.ndarray, writes: Transfer | Future) -> None:
        self._writes.append((blocks, writes))
        for block in blocks.tolist():
            self._writing[block] = writes

    def _wait_for_writes(self, blocks: np.ndarray) -> None:
        """Before ``blocks`` are read: the writes of them still in flight."""
        if not self._writing:
            return
        for block in np.intersect1d(blocks, np.fromiter(self._writing, np.int64, len(self._writing))).tolist():
            _finish(self._writing[block])
        self._reap_writes()

    def _reap_writes(self, everything: bool = False) -> None:
        while self._writes and (everything or self._writes[0][1].done()):
            blocks, writes = self._writes.popleft()
            _finish(writes)  # re-raises its error (a full disk), naming the file
            for block in blocks.tolist():
                if self._writing.get(block) is writes:
                    del self._writing[block]

    def _submit_patch(self, rows: np.ndarray, values: Tensor) -> None:
        """A background job writes ``rows`` into their blocks in the file (which host memory
        does not hold): reads them, after the writes of them in flight, patches and writes them.
        A later read of those blocks waits for it."""
        blocks, where = np.unique(rows // self.rows_per_block, return_inverse=True)
        pages = len(blocks) * self.block_pages
        self.counts["nvme_pages_read"] += pages
        self.counts["nvme_pages_read_for_writes"] += pages
        self.counts["nvme_pages_written"] += pages
        before = [self._writing[b] for b in blocks.tolist() if b in self._writing]
        patch = self._patcher.submit(self._patch, before, blocks, where, rows % self.rows_per_block, values)
        self._track_writes(blocks, patch)

    def _patch(self, before: list, blocks: np.ndarray, where: np.ndarray, within: np.ndarray, values: Tensor) -> None:
        """(On the patch thread.) Read ``blocks``, write the rows into them, write them back."""
        for writes in before:
            _finish(writes)
        staging = aligned_pages(len(blocks) * self.block_pages)
        every = np.arange(len(staging))
        self.file.submit(self.engine, self._pages_of(blocks), staging, every, write=False).wait()
        self._block_rows(staging)[torch.from_numpy(where), torch.from_numpy(within)] = values
        self.file.submit(self.engine, self._pages_of(blocks), staging, every, write=True).wait()

    def _resident(self, rows: np.ndarray, number: int | None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Each row's slot and place in it, once its block is in host memory (waiting for
        reads in flight, reading on demand what no announcement brought), and whether it came
        from the drive for batch ``number`` (or on demand)."""
        rows = np.asarray(rows, dtype=np.int64)
        blocks = rows // self.rows_per_block
        slots = self.block_slot[blocks]
        absent = slots < 0
        on_demand = np.zeros(len(rows), bool)
        if absent.any():
            on_demand = absent
            self._read_on_demand(np.unique(blocks[absent]), keep=slots[~absent])
            slots = self.block_slot[blocks]
        if not self.ready[slots].all():
            self._wait_for(int(self.filled_by[slots[~self.ready[slots]]].max()))
        self._touch(slots)
        missed = on_demand if number is None else on_demand | (self.read_for[slots] >= number)
        return slots, rows % self.rows_per_block, missed

    def _read_on_demand(self, blocks: np.ndarray, keep: np.ndarray) -> None:
        """Read ``blocks`` now (ahead of the reads queued), into slots other than ``keep`` (those
        of the caller's other rows)."""
        started = time.perf_counter_ns()
        self._reap()
        victims = self._evict(len(blocks), keep)
        self.counts["nvme_pages_written"] += self._write_back(*self._attach(blocks, victims))
        self._wait_for_writes(blocks)
        self.file.submit(self.engine, self._pages_of(blocks), self.buffer, self._slot_pages(victims), write=False,
                         urgent=True).wait()
        self.lru.arrived(victims)
        self.read_for[victims] = -1
        self.counts["nvme_pages_read"] += len(blocks) * self.block_pages
        self.counts["nvme_pages_read_on_demand"] += len(blocks) * self.block_pages
        self.counts["stall_ns"] += time.perf_counter_ns() - started

    def _wait_for(self, number: int) -> None:
        """Wait for the jobs up to batch ``number``'s (the worker runs them in order)."""
        started = time.perf_counter_ns()
        waited = False
        while self._jobs and self._jobs[0].number <= number:
            waited |= not self._jobs[0].reads.done()
            self._reap_one()
        self.counts["stall_ns"] += time.perf_counter_ns() - started
        self.counts["prefetch_batches_waited"] += int(waited)

    def _drain(self) -> None:
        """Every transfer in flight: the reads, the write-backs and the patches."""
        if self._jobs:
            self._wait_for(self._jobs[-1].number)
        self._reap_writes(everything=True)

    def _reap(self) -> None:
        while self._jobs and self._jobs[0].reads.done():
            self._reap_one()
        self._reap_writes()

    def _reap_one(self) -> None:
        job = self._jobs.popleft()
        job.reads.wait()  # re-raises its error (an I/O error) here, naming the file
        self.lru.arrived(job.slots[self.filled_by[job.slots] == job.number])

    def _touch(self, slots: np.ndarray) -> None:
        self.lru.touch(slots)

    # -- bytes between the file and the slots ----------------------------------------------------

    def _pages_of(self, blocks: np.ndarray) -> np.ndarray:
        blocks = np.asarray(blocks, dtype=np.int64)
        if self.block_pages == 1:
            return blocks
        return (blocks[:, None] * self.block_pages + np.arange(self.block_pages)).reshape(-1)

    def _block_rows(self, pages: np.ndarray) -> Tensor:
        """A ``[blocks, rows per block, row bytes]`` view of a page buffer."""
        return torch.from_numpy(pages).view(-1).as_strided(
            (len(pages) // self.block_pages, self.rows_per_block, self.row_bytes), (self.block_bytes, self.row_bytes, 1))

    def _slot_pages(self, slots: np.ndarray) -> np.ndarray:
        return self._pages_of(slots)  # slots are laid out in host memory as blocks are in the file

    def _write(self, blocks: np.ndarray, slots: np.ndarray) -> None:
        staging = aligned_pages(len(blocks) * self.block_pages)
        staging[:] = self.buffer[self._slot_pages(slots)]
        self.file.write(self._pages_of(blocks), staging)


def host_memory_problem(layout: PageLayout, dram_ratio: float, batch_blocks: int) -> str | None:
    """Why ``dram_ratio`` of a store of ``layout`` cannot hold two batches' blocks (a batch touches
    up to ``batch_blocks``), or None: the store refuses it, and the preflight (from the same
    profile) before it starts."""
    blocks = layout.pages // layout.pages_per_row
    capacity = min(blocks, math.ceil(dram_ratio * blocks))
    needed = min(blocks, 2 * batch_blocks)
    if capacity >= needed:
        return None
    return (f"dram_ratio {dram_ratio:g} holds {capacity:,} of the store's {blocks:,} blocks of "
            f"{layout.pages_per_row * PAGE // 1024} KiB; a batch touches up to {batch_blocks:,} and host memory must "
            f"hold two batches': dram_ratio >= {math.ceil(100 * needed / blocks) / 100:.2f} is needed")


#: Row files are named ``embbench-<pid>-rank<r>-<n>.rows`` (the n-th this process made).
_PREFIX = "embbench-"
_made = itertools.count()


def host_view_on(host: Tensor, device: torch.device) -> Tensor:
    """A contiguous int32 or int64 tensor in pinned (or registered) host memory as a tensor of
    ``device`` without a copy: on CUDA the same memory, which the GPU reads and writes over the
    bus (unified addressing: the host address is the device's); elsewhere ``host`` itself."""
    if device.type != "cuda":
        return host
    if not host.is_contiguous() or host.dtype not in (torch.int32, torch.int64):
        raise ValueError("host_view_on: a contiguous int32 or int64 tensor")
    return torch.as_tensor(_DeviceView(host), device=device)


class _DeviceView:
    """Host memory as CUDA's array interface describes it: torch makes a CUDA tensor of it
    without a copy (the view keeps ``host`` alive)."""

    def __init__(self, host: Tensor):
        self.host = host
        self.__cuda_array_interface__ = {"shape": tuple(host.shape), "typestr": "<i4" if host.dtype == torch.int32 else "<i8",
                                         "data": (host.data_ptr(), False), "version": 3, "strides": None}


def _read_only(array: np.ndarray) -> np.ndarray:
    view = array.view()
    view.flags.writeable = False
    return view


def _finish(writes: Transfer | Future) -> None:
    """Wait for a write-back (a Transfer) or a patch (a Future), re-raising its error."""
    if isinstance(writes, Transfer):
        writes.wait()
    else:
        writes.result()


def _serially(fill: Callable, jobs: list) -> None:
    for job in jobs:
        fill(job)
