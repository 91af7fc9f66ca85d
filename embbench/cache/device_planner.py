"""freqcache's slot planner on the device (freqcache v3): every per-batch decision in tensor ops.

The host planner (:class:`~embbench.cache.policy.SlotPlanner`, now the reference model) keeps
the slot map in NumPy and needs each batch's ids on the host. This one keeps all of its state
in tensors on the cache's device and decides with a fixed sequence of operations of fixed
shapes (padded to the batch's id capacity ``max_ids``, the slot count and the window's
capacity), whatever the data: no ``unique``/``nonzero``/boolean indexing, no value read on the
host. The host only launches, so on CUDA a step never waits for the device, and the same code
runs (and is tested, and counted) on CPU tensors.

State (``S`` slots, of which at most ``capacity`` are *cached*; the rest hold *staged* rows
that a batch needs but the policy did not admit; one extra *sink* slot ``S`` takes the writes
of padded entries):

- ``slot_row`` and a copy of it sorted (``map_rows``, ``map_slots``): a row's slot is one
  ``searchsorted`` (fully associative; the map is O(slots), never O(table rows));
- per slot: cached, dirty, the last plan that used it, its row's frequency and its row's next
  use in the look-ahead window;
- a count-min sketch (TinyLFU) of the frequencies of rows not cached;
- the look-ahead window: the distinct ``(row, batch number)`` pairs of the batches looked
  ahead to, as one sorted int64 array (``row << 24 | number``). A batch entering the window is
  merged in (positions by ``searchsorted``, one scatter); pairs of batches already planned are
  dropped in the same pass. A row's next use after batch ``t`` is one ``searchsorted`` for
  ``(row, t + 1)``.

Policy (as the reference's): a row's priority is its frequency, plus a bonus above any
frequency when the window uses it, the larger the nearer its next use (Belady's order inside
the window). The slots are ranked by priority (one sort of all slots: fully associative), the
batch's candidates (rows not cached) by theirs; the i-th candidate beyond the free capacity
contests the i-th weakest cached slot and, with ``tinylfu`` admission, is admitted only if its
priority is higher; candidates not admitted are staged in free (empty or staged) slots for
this step. Slots of this batch are never taken, nor the staged slots of the running one (the
step that may still compute); its cached slots may be, as Belady would: the moves into those
(the plan's *late* moves) wait until it has ended. This batch's own cached rows contest too:
one that loses is demoted to staged in place (it stays resident for this step) and its winner
takes a free slot, as Belady's cache would drop it after this step. (Keeping them cached
through the plan cost 1-2 points on caches near a batch's distinct rows.)
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
from torch import Tensor

__all__ = ["DevicePlan", "DevicePlanner", "StepKind", "cache_window", "window_size"]

#: Bits of a window key that hold the batch number (the rest hold the row).
_NUMBER_BITS = 24
_NUMBER_MASK = (1 << _NUMBER_BITS) - 1
#: Priority bonus per batch by which a row's next use is nearer than the window's end: above
#: any frequency a counter can hold.
_UPCOMING = 1 << 32
#: The priority of a slot that may not be taken (used by this batch or the running one).
_KEPT = 1 << 62
_NO_KEY = torch.iinfo(torch.int64).max
_MULTIPLIERS = [0x9E3779B97F4A7C15, 0xC2B2AE3D27D4EB4F, 0x165667B19E3779F9, 0xD6E8FEB86659FD93]

#: The planner's counters, in the order of its counter tensor.
COUNTERS = ("accesses", "unique_accesses", "hits", "misses", "unique_misses", "rows_admitted",
            "rows_evicted", "rows_written_back", "rows_loaded", "rows_moved_late", "window_pairs_dropped")


#: The automatic window sees about this many distinct (row, batch) pairs per cache row: on the
#: one-table sweeps a window of ~5 times the cache's rows left up to 2.4 points of distinct-row
#: hits to Belady (a 5 % cache, alpha 1.15), ~10 times 0.2 (docs/freqcache.md).
WINDOW_PAIRS_PER_CACHED_ROW = 10
#: Bounds of the automatic look-ahead, in batches.
AUTO_LOOKAHEAD = (8, 256)
#: Room per batch in the window beyond the most distinct rows a profiled batch had.
WINDOW_MARGIN = 1.25
#: The automatic look-ahead's window takes at most this share of the slot tensors' bytes ...
WINDOW_SHARE = 0.1
#: ... or this many bytes, whichever is more: nothing beside a GPU's memory, and enough for the
#: automatic window at the Criteo-Kaggle shape (about 55 MiB, ~90-100 batches) at any row width. A
#: share alone follows the rows' width: at dim 8 it cut that window to 8 batches, and one-table
#: policies fell 2.7-5.9 points per access below Belady (0.00-0.06 at dim 128).
WINDOW_FLOOR_BYTES = 64 << 20


def window_size(profiled_distinct: list[int], capacity: int, max_ids: int, lookahead: int | None,
                max_pairs: int | None = None) -> tuple[int, int]:
    """The look-ahead (in batches) and the window's room per batch (in distinct rows).

    The room is ``WINDOW_MARGIN`` times the most distinct rows of a profiled batch (a batch's
    ids where nothing was profiled). ``lookahead`` None chooses it: long enough to see about
    ``WINDOW_PAIRS_PER_CACHED_ROW`` pairs per cache row (the average profiled batch's distinct
    rows at a time), within ``AUTO_LOOKAHEAD`` and, where ``max_pairs`` is given, no more
    batches than that many pairs hold.
    """
    rows = min(max_ids, math.ceil(WINDOW_MARGIN * max(profiled_distinct))) if profiled_distinct else max_ids
    rows = max(1, rows)
    if lookahead is None:
        per_batch = sum(profiled_distinct) / len(profiled_distinct) if profiled_distinct else max_ids
        lookahead = math.ceil(WINDOW_PAIRS_PER_CACHED_ROW * capacity / max(1.0, per_batch))
        if max_pairs is not None:
            lookahead = min(lookahead, max_pairs // rows - 1)
        lookahead = max(AUTO_LOOKAHEAD[0], min(AUTO_LOOKAHEAD[1], lookahead))
    return lookahead, rows


def auto_window_pairs(num_rows: int, capacity: int, max_ids: int, row_bytes: int) -> int:
    """The (row, batch) pairs an automatic look-ahead's window may hold: its keys (8 bytes a pair)
    within ``WINDOW_SHARE`` of the slot tensors' bytes (rows of ``row_bytes``) or within
    ``WINDOW_FLOOR_BYTES``, whichever is more."""
    slot_tensor_bytes = (DevicePlanner.slots_for(num_rows, capacity, max_ids) + 1) * row_bytes
    return max(WINDOW_FLOOR_BYTES, int(WINDOW_SHARE * slot_tensor_bytes)) // 8


def cache_window(profiled_distinct: list[int], num_rows: int, capacity: int, max_ids: int, row_bytes: int,
                 lookahead: int | str, train_steps: int | None = None) -> tuple[int, int]:
    """freqcache's look-ahead and window room per batch (:func:`window_size`), ``auto``'s window
    bounded by :func:`auto_window_pairs`; either never looks further than the ``train_steps``
    batches the run hands it (a window beyond them would be memory for nothing)."""
    ahead, rows = window_size(profiled_distinct, capacity, max_ids, None if lookahead == "auto" else lookahead,
                              max_pairs=auto_window_pairs(num_rows, capacity, max_ids, row_bytes))
    return (ahead if train_steps is None else min(ahead, train_steps)), rows


def _signed(value: int) -> int:
    return value - (1 << 64) if value >= 1 << 63 else value


@dataclass(frozen=True)
class StepKind:
    """What decides a device step's sequence of operations besides ``train``: whether a step
    is running (its plan is the last one), and how the planned batch's window number follows
    the last one (``next``: by one, as in steady state; ``set``: to ``value``; ``same``: not in
    the window)."""

    keeps_running: bool
    number: str
    value: int | None = None


@dataclass
class DevicePlan:
    """What the rows must do before a batch's lookup: all tensors on the planner's device, of
    fixed length ``max_ids``, padded with the sink slot and the dummy host row.

    Write-backs come first (a load may reuse their slot). Entry ``i`` of the four lists is one
    slot's move; ``late[i]`` marks the moves into slots the running step still uses: they wait
    until that step has ended.
    """

    id: int
    slots: Tensor  # the slot of each id of the batch (its length: the batch's ids)
    write_back_slots: Tensor
    write_back_rows: Tensor
    load_slots: Tensor
    load_rows: Tensor
    late: Tensor
    live: Tensor  # 0-dim: the entries that may move a row (the plan's candidates); the rest are padding
    sink: int  # the padding of slot lists
    pad_row: int  # the padding of host-row lists

    def part(self, late: bool) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """The early (or late) moves, the others replaced by padding: ``(write-back slots,
        write-back rows, load slots, load rows)``."""
        return self.moves(self.late if late else ~self.late, self.write_back_slots, self.write_back_rows,
                          self.load_slots, self.load_rows, self.sink, self.pad_row)

    @staticmethod
    def moves(mine: Tensor, write_back_slots: Tensor, write_back_rows: Tensor, load_slots: Tensor, load_rows: Tensor,
              sink: int, pad_row: int) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """The moves ``mine`` marks, the others replaced by padding (``sink`` and ``pad_row``
        are Python numbers: no host-to-device copy, and a graph captures the ops)."""
        return (torch.where(mine, write_back_slots, sink), torch.where(mine, write_back_rows, pad_row),
                torch.where(mine, load_slots, sink), torch.where(mine, load_rows, pad_row))


class DevicePlanner:
    """The slot map of one freqcache, its policy and its look-ahead window, on ``device``.

    Args:
        num_rows: rows of the global row space (``num_rows`` itself is the dummy row that
            padded entries read and write: the host table has one row more).
        capacity: rows the cache may hold (cached slots).
        max_ids: the most ids one batch may have.
        lookahead: batches the window holds beyond the one being planned.
        admission: ``all`` or ``tinylfu``.
        learn: count the uses of training batches (False: frequencies stay the profile's).
        decay_every: halve the counts every this many training batches (0: never).
        window_rows: the window's room per batch, in distinct rows (default ``max_ids``: any
            batch fits). A batch with more distinct rows than this may overflow the window: the
            pairs that do not fit are dropped (counter ``window_pairs_dropped``), which costs
            hits, never correctness.
    """

    #: Device bytes of metadata per slot: row, sorted map (row and slot), last plan, next use,
    #: frequency (int32 each), cached and dirty flags.
    SLOT_BYTES = 6 * 4 + 2

    def __init__(self, num_rows: int, capacity: int, max_ids: int, lookahead: int, device: torch.device,
                 admission: str = "tinylfu", learn: bool = True, decay_every: int = 0,
                 sketch_width: int | None = None, sketch_depth: int = 4, window_rows: int | None = None):
        if num_rows >= 1 << (63 - _NUMBER_BITS):
            raise ValueError(f"freqcache: {num_rows} rows do not fit the window's keys (at most 2^{63 - _NUMBER_BITS})")
        if num_rows + 2 >= 1 << 31:
            raise ValueError(f"freqcache: {num_rows} rows do not fit the slot map's int32 rows")
        self.num_rows, self.capacity, self.max_ids = num_rows, capacity, max_ids
        self.lookahead, self.device = lookahead, device
        self.admission, self.learn, self.decay_every = admission, learn, decay_every
        self.num_slots = self.slots_for(num_rows, capacity, max_ids)
        self.pad_row, self.empty_row, self.sink = num_rows, num_rows + 1, self.num_slots
        S, m = self.num_slots, max_ids

        def full(n, value, dtype=torch.int64):
            return torch.full((n,), value, dtype=dtype, device=device)

        # Per slot, with the sink at S; rows as int32 (the metadata's bytes grow with the cache).
        self.slot_row = full(S + 1, self.empty_row, torch.int32)
        self.slot_cached = full(S + 1, False, torch.bool)
        self.slot_dirty = full(S + 1, False, torch.bool)
        self.slot_plan = full(S + 1, -1, torch.int32)
        # slot_freq is the head of _freq; its tail takes the count adds of ids without a cached
        # slot, one cell each (not all on the sink: ~383k same-address atomics a step at the
        # Kaggle shape)
        self._freq = full(S + 1 + m, 0, torch.int32)
        self.slot_freq = self._freq[: S + 1]
        self.slot_next = full(S + 1, 0, torch.int32)  # the window number of the row's next use (0: none known)
        self.map_rows = full(S, self.empty_row, torch.int32)
        self.map_slots = torch.arange(S, dtype=torch.int32, device=device)
        self.num_cached = full(1, 0)
        self.counts = full(len(COUNTERS), 0)

        # A row is counted at most once a batch, so with decay a counter stays below about
        # 2 * decay_every times the rows sharing it (about one: the width is at least a batch's
        # ids), plus the profile's: 16-bit counters hold it. Were one to wrap, its estimate is
        # read as 0 (see device_step): a policy error, never a misplaced row.
        width = sketch_width or min(num_rows, capacity + max_ids)
        self.sketch_bits = max(4, int(width - 1).bit_length())
        # Not on CUDA: inductor compiles index_add_ to Triton's atomic_add, which takes no 16-bit
        # integers (the plan step failed to compile on the H100 with int16 counters).
        narrow = 0 < decay_every <= 2048 and torch.device(device).type != "cuda"
        self.sketch = torch.zeros(sketch_depth, 1 << self.sketch_bits, dtype=torch.int16 if narrow else torch.int32,
                                  device=device)
        self._multipliers = torch.tensor([_signed(v) for v in _MULTIPLIERS[:sketch_depth]], device=device)[:, None]
        self._depth_offsets = (torch.arange(sketch_depth, device=device) << self.sketch_bits)[:, None]

        self.window_rows = min(window_rows or m, m)
        self.window_capacity = (lookahead + 1) * self.window_rows
        self.window = full(self.window_capacity, _NO_KEY)
        # The step's scalars live on the device too (a captured graph replays them: a Python
        # number would be baked in), each with its host mirror for the host's own bookkeeping.
        self.entered = 0  # batches that entered the window (numbered from 1)
        self.current = 0  # the number of the window batch planned last (pairs up to it are stale)
        self.plans = 0
        self.trained = 0
        self._scalars = torch.tensor([-1, -2, 0, 0, 0], device=device)
        self._pid, self._running, self._current, self._entered, self._trained = self._scalars.unbind()
        self._positions = torch.arange(m, device=device)
        self._spill = S + 1 + self._positions  # distinct cells past the slots, for padded adds

    @staticmethod
    def slots_for(num_rows: int, capacity: int, max_ids: int) -> int:
        """Slots (without the sink): the cached ones and room to stage two batches' rows (the
        running one's and the planned one's)."""
        return capacity + 2 * min(max_ids, num_rows)

    # -- set-up ----------------------------------------------------------------------------------

    def profile(self, batches: list[Tensor]) -> Tensor:
        """Count profiled training batches (global rows per id) in the sketch and preload the
        most frequent rows (the first rows if there is no profile); returns them. Set-up, not a
        step: it may size its outputs by the data."""
        for rows in batches:
            self._sketch_add(rows.unique(), None)
        if batches:
            rows, counts = torch.cat(batches).unique(return_counts=True)
            hot = rows[torch.argsort(-counts, stable=True)][: self.capacity]
        else:
            hot = torch.arange(min(self.capacity, self.num_rows), device=self.device)
        self.preload(hot)
        return hot

    def preload(self, rows: Tensor) -> None:
        """Cache ``rows`` (distinct, at most ``capacity``) in slots ``0..len-1``, clean."""
        n = len(rows)
        self.slot_row[:n] = rows
        self.slot_cached[:n] = True
        self.slot_freq[:n] = self._sketch_estimate(rows).to(torch.int32)
        self.num_cached.fill_(n)
        self._rebuild_map()

    # -- pieces ------------------------------------------------------------------------------------

    def _cells(self, rows: Tensor) -> Tensor:
        """Flat sketch counter indices ``[depth, len(rows)]`` (multiply-shift hashing; int64
        products wrap, and the masked shift keeps the product's top bits)."""
        hashed = ((rows + 1) * self._multipliers) >> (64 - self.sketch_bits)
        return (hashed & ((1 << self.sketch_bits) - 1)) + self._depth_offsets

    def _sketch_add(self, rows: Tensor, weight: Tensor | None) -> None:
        cells = self._cells(rows)
        dtype = self.sketch.dtype
        ones = torch.ones_like(cells, dtype=dtype) if weight is None else weight.to(dtype).expand_as(cells)
        self.sketch.view(-1).index_add_(0, cells.reshape(-1), ones.reshape(-1))

    def _sketch_estimate(self, rows: Tensor) -> Tensor:
        return self.sketch.view(-1)[self._cells(rows)].amin(0)

    def _lookup(self, rows: Tensor) -> Tensor:
        """The slot of each of ``rows``, or the sink where it has none."""
        rows = rows.to(self.map_rows.dtype)
        at = torch.searchsorted(self.map_rows, rows).clamp_(max=self.num_slots - 1)
        return torch.where(self.map_rows[at] == rows, self.map_slots[at].long(), self.sink)

    def _rebuild_map(self) -> None:
        # In place: a captured graph reads and writes the tensors it was captured with.
        rows, slots = self.slot_row[: self.num_slots].sort()
        self.map_rows.copy_(rows)
        self.map_slots.copy_(slots)

    def _distinct(self, rows: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
        """A batch's rows padded to ``max_ids``: its distinct rows (sorted, padded with the
        dummy row), how many ids each has, and for every id its sorted position and the index
        of its distinct row."""
        m, n = self.max_ids, len(rows)
        if n > m:
            raise ValueError(f"freqcache: a batch has {n} ids, more than the {m} the cache was sized for")
        if n < m:
            rows = torch.cat([rows, rows.new_full((m - n,), self.pad_row)])
        ordered, order = rows.sort()
        starts = torch.ones_like(ordered, dtype=torch.bool)
        torch.ne(ordered[1:], ordered[:-1], out=starts[1:])
        group = torch.cumsum(starts, 0) - 1
        unique = ordered.new_full((m + 1,), self.pad_row).scatter_(0, torch.where(starts, group, m), ordered)[:m]
        # Ids per distinct row: where its run in `ordered` ends minus where it starts. Binary
        # searches, not an accumulating index_add_: inductor sends int64 accumulates to ATen's
        # sorted index_put_ (1.2 ms a step on an H100, results/2026-11-28-h100).
        ids = torch.searchsorted(ordered, unique, right=True) - torch.searchsorted(ordered, unique)
        return unique, ids * (unique < self.pad_row), order, group

    def _mark_planned(self, slots: Tensor) -> None:
        """``slot_plan[slots] = this plan's number``, read on the device: ``index_fill_`` with a
        tensor value would read it on the host (``.item()``: a sync on CUDA, an error in graph
        capture; see :mod:`embbench.host_reads`)."""
        self.slot_plan.index_copy_(0, slots, self._pid.to(self.slot_plan.dtype).expand(len(slots)))

    def _bonus(self, next_use: Tensor) -> Tensor:
        """Belady's order inside the window: the nearer a row's next use, the larger its bonus;
        none where the window does not use it."""
        return torch.where(next_use > self._current, (self._entered + 1 - next_use) * _UPCOMING, 0)

    # -- the look-ahead window -----------------------------------------------------------------

    def enter(self, rows: Tensor) -> int:
        """A looked-ahead batch (its global rows, one per id) enters the window; returns its
        number. Pairs of batches already planned are dropped in the same pass."""
        number = self.advance_entered()
        self.device_enter(rows)
        return number

    def advance_entered(self) -> int:
        """The host's part of :meth:`enter`: the entering batch's number."""
        if self.entered + 1 > _NUMBER_MASK:
            raise ValueError(f"freqcache: more than {_NUMBER_MASK} look-ahead batches in one run")
        self.entered += 1
        return self.entered

    def device_enter(self, rows: Tensor) -> None:
        """:meth:`enter`'s device work (tensor operations only, always the same sequence)."""
        self._entered.add_(1)
        unique = self._distinct(rows)[0]
        valid = unique < self.pad_row
        incoming = torch.where(valid, (unique << _NUMBER_BITS) | self._entered, _NO_KEY)
        C, m, window = self.window_capacity, self.max_ids, self.window
        # Merge the incoming pairs (sorted) with the live ones (of batches not planned yet):
        # a pair's place is the live pairs and incoming pairs before it (the two never tie:
        # their batch numbers differ). Stale pairs go to a dump place past the end.
        live = (window != _NO_KEY) & ((window & _NUMBER_MASK) > self._current)
        live_through = torch.cumsum(live, 0, dtype=torch.int32)
        at = torch.searchsorted(window, incoming)  # stale pairs are still in order: they count here, not below
        # Incoming pairs before each window pair: those whose place in the window is at or
        # before it. `at` rises with the incoming pairs, so the last of each run of equal
        # places marks its count there (distinct places: no accumulating scatter) and a running
        # maximum carries it on; a search of the window's pairs in the incoming ones costs the
        # window's length times a search (6.45M at the Kaggle shape), this a batch's searches.
        at_valid = torch.where(valid, at, C + 1)
        last = torch.ones_like(valid)
        torch.ne(at_valid[1:], at_valid[:-1], out=last[:-1])
        marks = torch.zeros(C + 1 + m, dtype=torch.int32, device=self.device)
        marks.scatter_(0, torch.where(last & valid, at, C + 1 + self._positions), (self._positions + 1).to(torch.int32))
        incoming_before = torch.cummax(marks[:C], 0).values
        at_kept = torch.where(live, live_through - 1 + incoming_before, C + m).long()
        live_before = torch.where(at > 0, live_through[(at - 1).clamp_(min=0)], 0)
        at_incoming = torch.where(valid, live_before + self._positions, C + m)
        merged = torch.full((C + m + 1,), _NO_KEY, dtype=torch.int64, device=self.device)
        merged.scatter_(0, at_kept, window).scatter_(0, at_incoming, incoming)
        window.copy_(merged[:C])
        # Past C: pairs that did not fit (only where window_rows is below a batch's distinct rows).
        self.counts[-1] += (live_through[-1] + valid.sum() - C).clamp_(min=0)
        # Resident rows of the batch without a nearer next use: this batch is it.
        slots = self._lookup(unique)  # the padding (the dummy row) is never resident
        known = self.slot_next[slots]
        self.slot_next.index_copy_(0, slots, torch.where(known > self._current, known, self._entered).to(torch.int32))

    def _next_use(self, rows: Tensor) -> Tensor:
        """Each row's next use in the window after the batch planned now (0: none)."""
        keys = (rows << _NUMBER_BITS) | (self._current + 1)
        at = torch.searchsorted(self.window, keys).clamp_(max=self.window_capacity - 1)
        found = self.window[at]
        return torch.where((found >> _NUMBER_BITS) == rows, found & _NUMBER_MASK, 0)

    # -- planning ----------------------------------------------------------------------------------

    def plan(self, rows: Tensor, train: bool, running: int | None = None, number: int | None = None) -> DevicePlan:
        """Place every row of a batch in a slot.

        Args:
            rows: the batch's global rows, one per id (on the planner's device).
            train: a training batch (counted, and its slots become dirty); else evaluation.
            running: the plan of a step that may still be running: the last plan made, if any.
            number: the batch's window number if it entered the window.
        """
        pid, step = self.advance(train, running, number)
        return self.device_step(rows, train, step, pid)

    def advance(self, train: bool, running: int | None, number: int | None) -> tuple[int, "StepKind"]:
        """The host's part of a plan: its checks and mirrors; returns the plan's number and the
        kind of device step that does the rest (:meth:`device_step`)."""
        pid = self.plans
        if pid >= torch.iinfo(torch.int32).max:
            raise ValueError("freqcache: more than 2^31 plans in one run")
        if running is not None and running != pid - 1:
            raise ValueError(f"freqcache: the running plan must be the last one made ({pid - 1}), got {running}")
        self.plans += 1
        self.trained += int(train)
        next_batch = number is not None and number == self.current + 1  # always so in steady state
        if number is not None:
            self.current = number
        kind = "next" if next_batch else "set" if number is not None else "same"
        return pid, StepKind(running is not None, kind, number if kind == "set" else None)

    def device_step(self, rows: Tensor, train: bool, step: "StepKind", pid: int = -1) -> DevicePlan:
        """A plan's device work: only tensor operations, their sequence fixed by ``train`` and
        ``step`` (so one captured graph replays every steady-state training step)."""
        if step.keeps_running:
            self._running.copy_(self._pid)
        else:
            self._running.fill_(-2)  # no plan has this number
        self._pid.add_(1)
        if step.number == "next":
            self._current.add_(1)
        elif step.number == "set":
            self._current.fill_(step.value)
        S, m, sink = self.num_slots, self.max_ids, self.sink
        n = len(rows)
        unique, ids, order, group = self._distinct(rows)
        valid = unique < self.pad_row
        slot = self._lookup(unique)
        cached = self.slot_cached[slot]  # the sink is never cached
        self._mark_planned(slot)  # kept for this batch from here on

        outside = valid & ~cached
        if train:
            self._trained.add_(1)
            if self.learn:
                # padding and cached rows add 0 to the sketch: padding at cells of distinct dummy
                # keys, so that its zeros do not all land on the dummy row's cells
                self._sketch_add(torch.where(valid, unique, self.empty_row + 1 + self._positions), outside)
                self._freq.index_add_(0, torch.where(cached, slot, self._spill), torch.ones_like(slot, dtype=torch.int32))
                if self.decay_every:  # a shift every step (by 0 mostly): the same work each time
                    halve = (self._trained % self.decay_every == 0).to(torch.int32)
                    self.sketch >>= halve.to(self.sketch.dtype)
                    self.slot_freq >>= halve
        # (clamped: a candidate's score must stay >= 0, above the -1 of rows that are not candidates)
        freq = torch.where(cached, self.slot_freq[slot].long(), self._sketch_estimate(unique).long().clamp_(min=0))
        next_use = self._next_use(unique)

        # Candidates (rows not cached), best first.
        score = torch.where(outside, freq + self._bonus(next_use), -1)
        score, rank = score.sort(descending=True, stable=True)
        cand = score >= 0
        cand_slot, cand_row = slot[rank], unique[rank]
        cand_resident = cand_slot != sink  # staged already: used in place (and promoted if admitted)

        # Slots, weakest first: empty, then staged, then cached by priority; never the staged
        # ones of this batch or the running one. The running batch's cached slots may be taken
        # (as Belady would): those moves are late, done once it has ended. This batch's cached
        # rows may lose their place in the cache too (as Belady's would after this step): they
        # are demoted to staged in place, and their winner takes a free slot.
        self.slot_next.index_copy_(0, torch.where(cached, slot, sink), next_use.to(torch.int32))
        kept = ((self.slot_plan == self._pid) | (self.slot_plan == self._running)) & ~self.slot_cached
        priority = torch.where(self.slot_cached, self.slot_freq.long() + self._bonus(self.slot_next.long()),
                               torch.where(self.slot_row == self.empty_row, -2, -1))
        priority = torch.where(kept, _KEPT, priority)[:S]
        priority, weakest = priority.sort(stable=True)
        free = (priority < 0).sum()
        victims = ((priority >= 0) & (priority < _KEPT)).sum()

        # Admission: the first `room` candidates fill free capacity; the next ones contest the
        # weakest cached slots in turn (candidates' priorities fall, victims' rise).
        position = self._positions
        room = (self.capacity - self.num_cached).clamp_(min=0)
        contest = position - room
        contesting = cand & (contest >= 0) & (contest < victims)
        victim_at = (free + contest).clamp_(0, S - 1)
        victim, victim_priority = weakest[victim_at], priority[victim_at]
        beats = torch.ones_like(contesting) if self.admission == "all" else score > victim_priority
        wins = contesting & beats
        admitted = (cand & (position < room)) | wins
        in_batch = self.slot_plan[victim] == self._pid  # a victim this batch uses stays where it is
        # Rows not resident need a slot: a winner takes its victim's (one this batch does not
        # use), the others the free slots in order.
        takes_victim = wins & ~in_batch
        needs_free = cand & ~cand_resident & ~takes_victim
        free_at = (torch.cumsum(needs_free, 0) - 1).clamp_(0, S - 1)
        incoming = cand & ~cand_resident
        dest = torch.where(takes_victim, victim, weakest[free_at])
        dest = torch.where(incoming, dest, sink)
        # A winner already staged is promoted in place, and a victim this batch uses is demoted
        # in place: each stays as a staged row.
        demoted = torch.where(wins & (cand_resident | in_batch), victim, sink)

        # Evicted rows (dirty ones go back to the host) and loads.
        old_rows = self.slot_row[dest].long()
        write_back = incoming & self.slot_dirty[dest] & (old_rows < self.pad_row)
        plan_out = (torch.where(write_back, dest, sink), torch.where(write_back, old_rows, self.pad_row))
        plan_in = (dest, torch.where(incoming, cand_row, self.pad_row))
        late = incoming & (self.slot_plan[dest] == self._running)

        # The new map.
        self.slot_cached.index_fill_(0, demoted, False)
        self.slot_row.index_copy_(0, dest, cand_row.to(self.slot_row.dtype))
        self.slot_cached.index_copy_(0, torch.where(cand, torch.where(incoming, dest, cand_slot), sink), admitted)
        self.slot_dirty.index_fill_(0, dest, False)
        self._mark_planned(dest)
        cand_freq = freq[rank].to(torch.int32)
        self.slot_freq.index_copy_(0, torch.where(cand, torch.where(incoming, dest, cand_slot), sink), cand_freq)
        # Each distinct row's slot now: its destination where it moves in, else where it was. By
        # gathers through the candidates' order (`rank` inverted): an index_copy_ into
        # torch.cat([slot, sink]) let inductor, under deterministic algorithms, lay `slot` inside
        # that buffer and overwrite it before `cand_resident` was read (issue 47, item 3).
        candidate_of = torch.empty_like(rank).scatter_(0, rank, self._positions)
        batch_slot = torch.where(incoming[candidate_of], dest[candidate_of], slot)
        self.slot_next.index_copy_(0, batch_slot, next_use.to(torch.int32))
        if train:  # (the sink's entries are never read: write-backs test `incoming`)
            self.slot_dirty.index_fill_(0, batch_slot, True)
        self.num_cached += (admitted & ~wins).sum()
        self._rebuild_map()

        if train:
            hits = ids * cached
            self.counts[: len(COUNTERS) - 1] += torch.stack([
                ids.sum(), valid.sum(), hits.sum(), ids.sum() - hits.sum(), outside.sum(), admitted.sum(),
                wins.sum(), write_back.sum(), incoming.sum(), late.sum(),
            ])
        slots = batch_slot[group].new_empty(m).index_copy_(0, order, batch_slot[group])[:n]
        return DevicePlan(pid, slots, *plan_out, *plan_in, late, cand.sum(), sink=sink, pad_row=self.pad_row)

    # -- reporting -----------------------------------------------------------------------------

    def counters(self) -> dict[str, int]:
        """The counters (reads the device: not for a step)."""
        return dict(zip(COUNTERS, self.counts.tolist()))

    def dirty(self) -> tuple[Tensor, Tensor]:
        """Every slot with the host row to write it to (the dummy row where it is not dirty)."""
        dirty = self.slot_dirty[: self.num_slots] & (self.slot_row[: self.num_slots] < self.pad_row)
        slots = torch.arange(self.num_slots, device=self.device)
        return slots, torch.where(dirty, self.slot_row[: self.num_slots].long(), self.pad_row)

    def clean(self) -> None:
        self.slot_dirty.fill_(False)

    @property
    def nbytes(self) -> int:
        """Device bytes of the planner's state (maps, counters, sketch, window)."""
        tensors = (self.slot_row, self.slot_cached, self.slot_dirty, self.slot_plan, self._freq, self.slot_next,
                   self.map_rows, self.map_slots, self.sketch, self.window, self.counts, self._positions, self._spill, self._scalars)
        return sum(t.nbytes for t in tensors)
