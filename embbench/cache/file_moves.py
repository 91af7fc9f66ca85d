"""freqcache's moves against a row file (``store: file``) without the training thread reading a
device value (issue 48, item 4).

The training thread only queues device work and hands host buffers to the store's bookkeeping
thread; the device and the bookkeeping thread meet at events, never at a host read of a device
tensor:

- **Announcements.** An entering batch's rows the device holds no slot for, as a fixed-size
  tensor (``-1``: no row), copied by the device into pinned host memory with an event; the
  bookkeeping thread waits for the event, then finds the blocks (``np.unique``), pins them and
  queues their reads (:meth:`FileRows.announce_from_device`).
- **Loads.** Host memory's slots are addressed by the device (on CUDA: registered, mapped host
  memory, :meth:`FileRows.device_slots`), through a *block map* on the device (block -> slot,
  ``-1``: not in host memory). Before a batch's loads the training thread waits for its reads
  (the store's *stall*: a host condition, not a device value) and sends the map's changes since
  the last batch; the loads then read each row from its slot on the device
  (:func:`~embbench.cache.row_copy.move_rows`: padded entries cost nothing).
- **Write-backs** go to a *ring* of ``depth`` entries: the rows (sorted, on the device and copied
  to pinned memory) and their packed values (written by the device into pinned, mapped host
  memory). The bookkeeping thread applies each entry in order once its event has happened (into
  the block's slot, or patched into the file: :meth:`FileRows.scatter`). A load that finds its
  row in an entry the host has not applied yet takes the ring's value (the newest entry wins),
  so a row written back and loaded again before the host applied it is exact without a wait;
  an entry is overwritten
  only after the host applied it (a stall if the host is ``depth`` moves behind).
- **Releases.** A batch's blocks are unpinned by the bookkeeping thread once an event recorded
  after its moves has happened.

A batch that was not announced (evaluation's) moves by the host as before (FreqCache's
``_file_moves``), after every write-back is applied; the ring is emptied after it, as the host
path writes rows back itself. On the CPU the same code runs with no events (the device's work is
done when queued) and the slots, the map and the ring in plain memory.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from concurrent.futures import Future

import numpy as np
import torch
from torch import Tensor

from embbench.cache import row_copy
from embbench.cache.file_rows import FileRows, host_view_on
from embbench.cache.row_copy import move_rows, words

__all__ = ["FileMoves"]

#: A ring entry's padding (sorts after every row).
_NO_ROW = torch.iinfo(torch.int64).max


class FileMoves:
    """The device's side of a :class:`FileRows` store for one freqcache (the module docstring).

    Args:
        rows: the store.
        cache_weights, cache_extras: the cache's slots (the last: the sink).
        max_ids: the length of a plan's move lists.
        sink, pad_row: the plan's padding (slot and row).
        depth: write-back ring entries (two moves a step: early and late).
    """

    def __init__(self, rows: FileRows, cache_weights: Tensor, cache_extras: Tensor, max_ids: int, sink: int,
                 pad_row: int, depth: int = 4):
        self.rows = rows
        self.device = device = cache_weights.device
        self.cuda = device.type == "cuda"
        self.weights, self.extras = words(cache_weights), words(cache_extras)
        self.sink, self.pad_row, self.max_ids, self.depth = sink, pad_row, max_ids, depth
        self.row_words = rows.row_bytes // 4
        self.triton = row_copy.triton_problem(device) is None
        # torch's copies: on a CPU the padded entries are dropped first; on CUDA (without Triton)
        # that would be a host read, so they are padded there (a test checks CUDA's ops on a CPU
        # with this off)
        self.compact = not self.cuda
        # host memory's slots as the device sees them: [slots, block words]
        self.slots = rows.device_slots(device)
        self.block_slot = torch.full((rows.blocks,), -1, dtype=torch.int64, device=device)
        # the file's order of rows (RowOrder) on the device: the moved rows (sorted) and their places
        self.moved = torch.from_numpy(rows.order.moved.astype(np.int64)).to(device)
        self.places = torch.from_numpy(rows.order.places.astype(np.int64)).to(device)
        # the write-back ring: rows on the device (searched by loads) and in host memory (read by
        # the bookkeeping thread), values in host memory the device writes (one spare row: the
        # torch path's padding)
        self.ring_rows = torch.full((depth, max_ids), _NO_ROW, dtype=torch.int64, device=device)
        self.ring_rows_host = torch.empty(depth, max_ids, dtype=torch.int64, pin_memory=self.cuda)
        self.ring_words_host = torch.zeros(depth, max_ids + 1, self.row_words, dtype=torch.int32, pin_memory=self.cuda)
        self.ring_words = host_view_on(self.ring_words_host, device)
        self._no_late = torch.zeros(max_ids, dtype=torch.bool, device=device)
        self._positions = torch.arange(max_ids, device=device)  # a ring entry's places
        self._written = 0  # ring entries written
        self._applied = 0  # ring entries the host has applied (the bookkeeping thread)
        self._applied_changed = threading.Condition()
        self._applying: deque[Future] = deque()

    @property
    def nbytes(self) -> tuple[int, int]:
        """(device bytes, host bytes) beyond the store's: the block map, the order, the ring."""
        return self.footprint(self.rows.blocks, len(self.moved), self.max_ids, self.rows.row_bytes, self.depth)

    @staticmethod
    def footprint(blocks: int, moved: int, max_ids: int, row_bytes: int, depth: int = 4) -> tuple[int, int]:
        """(device bytes, host bytes): the block map (8 bytes a block) and the order's moved rows
        (16 bytes each) on the device, the ring's rows on both sides (8 bytes an id an entry) and
        its values in pinned host memory (a row an id an entry, and a spare row)."""
        ring_rows = depth * max_ids * 8
        return blocks * 8 + moved * 16 + ring_rows, ring_rows + depth * (max_ids + 1) * row_bytes

    # -- announcements and releases -----------------------------------------------------------------

    def announce(self, number: int, rows: Tensor) -> None:
        """Batch ``number`` will load ``rows`` (``-1``: none; on the device, fixed size): the
        bookkeeping thread reads what host memory lacks once the device has copied them out."""
        if not self.cuda:  # (the caller's tensor is its own: where's output)
            self.rows.announce_from_device(number, rows, None)
            return
        host = torch.empty(rows.shape, dtype=torch.int64, pin_memory=True)
        host.copy_(rows, non_blocking=True)
        self.rows.announce_from_device(number, host, self._event())

    def release(self, number: int) -> None:
        """Batch ``number``'s moves are queued: its blocks are unpinned once the device has done them."""
        self.rows.release_after(number, self._event())

    def _event(self) -> "torch.cuda.Event | None":
        if not self.cuda:
            return None
        event = torch.cuda.Event()
        event.record()
        return event

    # -- one move ----------------------------------------------------------------------------------

    def move(self, write_back_slots: Tensor, write_back_rows: Tensor, load_slots: Tensor, load_rows: Tensor,
             live: Tensor, number: int, count: bool) -> None:
        """One padded move list of batch ``number``'s plan (padding: ``sink`` / ``pad_row``):
        the write-backs into the ring, then the loads from host memory's slots and the ring.
        ``count``: the host counts the loads (counted steps only: it reads the rows)."""
        self._write_back(write_back_slots, write_back_rows, live)
        self._load(load_slots, load_rows, live, number, count)

    def _write_back(self, slots: Tensor, rows: Tensor, live: Tensor) -> None:
        if len(rows) > self.max_ids:
            raise ValueError(f"a move of {len(rows):,} rows: the ring holds {self.max_ids:,}")
        entry = self._written % self.depth
        self._wait_applied(self._written - self.depth + 1)  # the entry's last rows are in host memory
        real = (rows != self.pad_row) & (slots != self.sink)
        ordered, order = torch.sort(torch.where(real, rows, _NO_ROW))
        n = len(rows)
        self.ring_rows[entry, :n] = ordered
        self.ring_rows[entry, n:] = _NO_ROW
        index = torch.where(ordered != _NO_ROW, self._positions[:n], -1)
        self._copy(self.ring_words[entry], slots[order], index, live, to_host=True)
        self.ring_rows_host[entry].copy_(self.ring_rows[entry], non_blocking=self.cuda)
        self._applying.append(self.rows.after_device(lambda: self._apply(entry), self._event()))
        self._written += 1

    def _apply(self, entry: int) -> None:
        """(On the bookkeeping thread, once the device wrote the entry.) Its rows into the store."""
        rows = self.ring_rows_host[entry].numpy()
        count = int(np.searchsorted(rows, _NO_ROW))
        if count:
            self.rows.scatter(rows[:count], self.ring_words_host[entry, :count])
        with self._applied_changed:
            self._applied += 1
            self._applied_changed.notify_all()

    def _wait_applied(self, entries: int) -> None:
        """Until the host has applied ``entries`` ring entries (a stall when it has not)."""
        if self._applied >= entries:
            return
        started = time.perf_counter_ns()
        while self._applying and self._applied < entries:
            self._applying.popleft().result()  # (re-raises the bookkeeping's error here)
        self.rows.counts["stall_ns"] += time.perf_counter_ns() - started

    def _load(self, slots: Tensor, rows: Tensor, live: Tensor, number: int, count: bool) -> None:
        blocks, block_slots = self.rows.ready_for(number)  # its reads have arrived
        if len(blocks):
            self.block_slot.index_copy_(0, self._to_device(blocks), self._to_device(block_slots))
        real = (rows != self.pad_row) & (slots != self.sink)
        place = self._place(torch.where(real, rows, 0))
        per = self.rows.rows_per_block
        slot = self.block_slot[place // per]
        self._copy(self.slots, slots, torch.where(real, slot * per + place % per, -1), live, to_host=False,
                   rows_per_block=per)
        # rows the ring holds: written back by a move the host may not have applied yet
        for entry in self._ring_entries():  # oldest first: the newest wins
            ring = self.ring_rows[entry]
            at = torch.searchsorted(ring, rows).clamp_(max=self.max_ids - 1)
            found = real & (ring[at] == rows)
            self._copy(self.ring_words[entry], slots, torch.where(found, at, -1), live, to_host=False)
        if count:
            self.rows.count_loads(rows[real].cpu().numpy(), number)

    def _ring_entries(self) -> list[int]:
        """The ring's entries whose rows host memory may lack, oldest first: those the host has
        not applied yet (one it has applied is in host memory before the load reads it)."""
        first = max(self._applied, self._written - self.depth)  # (a host count: the bookkeeping thread's)
        return [written % self.depth for written in range(first, self._written)]

    def _place(self, rows: Tensor) -> Tensor:
        """Each row's place in the file (RowOrder.place on the device)."""
        if not len(self.moved):
            return rows
        at = torch.searchsorted(self.moved, rows).clamp_(max=len(self.moved) - 1)
        return torch.where(self.moved[at] == rows, self.places[at], rows)

    def _to_device(self, values: np.ndarray) -> Tensor:
        host = torch.from_numpy(np.ascontiguousarray(values, dtype=np.int64))
        if not self.cuda:
            return host
        return host.pin_memory().to(self.device, non_blocking=True)  # (the pinned block is kept until copied)

    def _copy(self, host: Tensor, slots: Tensor, index: Tensor, live: Tensor, to_host: bool,
              rows_per_block: int = 1) -> None:
        """Rows between ``host`` (int32 words: ``[blocks, block words]``, ``rows_per_block`` rows
        of ``row_words`` a block) and the cache's ``slots``: entry i moves host row ``index[i]``
        (``-1``: none). The Triton kernel skips the padding; torch's copies aim it at the sink slot
        (loads) or the ring's spare row (write-backs)."""
        if self.triton:
            flat = host.reshape(-1)
            move_rows(flat.as_strided((flat.numel() // self.row_words, self.row_words), (self.row_words, 1)), self.weights, self.extras, slots, index, self._no_late[: len(slots)],
                      live, sink=self.sink, pad=-1, late_part=False, to_host=to_host, rows_per_block=rows_per_block,
                      block_stride=host.shape[-1] if rows_per_block > 1 else None)
            return
        go = index >= 0
        inside = torch.arange(len(slots), device=self.device) < live.reshape(-1)[:1]
        go = go & inside
        if self.compact:  # the live entries only (on a CPU, where reading which they are costs no wait)
            live_entries = go.nonzero().flatten()
            slots, index, go = slots[live_entries], index[live_entries], go[live_entries]
        blocks = host.view(-1, host.shape[-1])
        per, width = rows_per_block, self.row_words
        rows = blocks.as_strided((blocks.shape[0], per, width), (blocks.shape[1], width, 1))
        w = self.weights.shape[1]
        if to_host:
            spare = len(host) - 1  # the ring's spare row
            at = torch.where(go, index, spare)
            source = torch.where(go, slots, self.sink)
            rows[at // per, at % per] = torch.cat([self.weights[source], self.extras[source]], 1)
        else:
            at = torch.where(go, index, 0)
            into = torch.where(go, slots, self.sink)
            values = rows[at // per, at % per]
            self.weights.index_copy_(0, into, values[:, :w])
            self.extras.index_copy_(0, into, values[:, w:])

    # -- the host's path, and the end ---------------------------------------------------------------

    def drain(self) -> None:
        """Every write-back applied and every announcement's work done (before the host moves rows
        itself, or reads the table)."""
        while self._applying:
            self._applying.popleft().result()
        self.rows.settle()

    def host_moved(self) -> None:
        """The host moved rows itself (a batch not announced): the ring's rows are no longer the
        newest, so none is taken from it again."""
        self.ring_rows.fill_(_NO_ROW)
