"""freqcache's host slot planner (freqcache v2's; now the reference model of the device
planner, :mod:`embbench.cache.device_planner`): which row sits in which slot, decided on the host.

The planner keeps the whole slot map in NumPy arrays and turns a batch's ids into a
:class:`Plan`: the slot of every distinct row, the rows to copy in (host -> device), and the dirty
rows to copy out (device -> host) before their slots are reused. The device then does a
fixed handful of operations per step whatever the number of tables, and never has to be
asked anything (no host synchronisation).

Slots ``[0, P)`` are of two classes. *Cached* slots hold at most ``capacity`` rows, chosen
by the policy. *Staged* slots hold the rows a batch needs that the policy did not admit
(or that exceed the capacity): they are filled for that step and are the first to be
reused; the ``2 * max_ids`` of them that a step and its prefetched successor can need are
reserved, so a cache smaller than one batch works. A staged row that the next batch needs
is used where it is (so no step ever reads a copy older than the previous step's update).

A batch is planned while the previous one (the *running* step) may still compute. Its
cached rows may still be evicted, as Belady would: the moves into and out of those slots
are the plan's *late* part, which waits until the running step has ended (then the
write-back copies the step's update). Staged slots of the running step are never reused
for the next batch (the reserved ones suffice).

Policy: a cached row counts its uses in its slot; every other row's frequency is
estimated by a count-min sketch (TinyLFU), so a step touches the sketch only for the rows
it misses. Both are halved every ``decay_every`` training batches, so a drifting stream is
followed. A row's score is its frequency plus a large bonus if an upcoming (looked-ahead)
batch uses it, the larger the nearer that batch (Belady's order inside the window), so rows
the next batches need are evicted last, the furthest-needed first. Admission ``tinylfu``
admits a missing row only in place of a cached row with a lower score (or into free
capacity); ``all`` admits every missing row the capacity allows.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["FrequencySketch", "Plan", "SlotPlanner"]

#: Score bonus per batch of the window by which a row's next use is nearer than the window's
#: end: above any frequency the sketch can hold.
_UPCOMING = 1 << 40


#: Values below this are counted in a histogram to find the k-th lowest (see :func:`_lowest`).
_HISTOGRAM = 1 << 12


def _lowest(values: np.ndarray, k: int, guess: int | None = None) -> np.ndarray:
    """The indices of the ``k`` lowest of ``values`` (>= 0), lowest first; ties in index order.

    The k-th lowest value comes from a histogram of the small values: frequency counts are
    small and mostly equal, where ``np.argpartition``'s introselect can take 50x longer.
    A ``guess`` of it (the last plan's) is checked first: where it is right, no histogram.
    """
    if len(values) > k:
        if guess is not None:
            below, equal = np.flatnonzero(values < guess), np.flatnonzero(values == guess)
            if len(below) < k <= len(below) + len(equal):
                return _sorted(values, np.concatenate([below, equal[: k - len(below)]]))
        cumulative = np.cumsum(np.bincount(np.minimum(values, _HISTOGRAM), minlength=_HISTOGRAM + 1))
        kth = int(np.searchsorted(cumulative, k))
        if kth == _HISTOGRAM:  # beyond the histogram: the rest among the large values
            large = values[values >= _HISTOGRAM]
            kth = _kth_lowest(large, k - (len(values) - len(large)))
        below = np.flatnonzero(values < kth)
        pick = np.concatenate([below, np.flatnonzero(values == kth)[: k - len(below)]])
    else:
        pick = np.arange(len(values))
    return _sorted(values, pick)


def _kth_lowest(values: np.ndarray, k: int) -> int:
    """The ``k``-th lowest (from 1) of ``values`` (>= 0): a radix select, a histogram of the
    highest bits at a time (priorities such as ``level * _UPCOMING + frequency`` are few
    distinct values, where ``np.partition``'s introselect is slow)."""
    shift = max(0, int(values.max()).bit_length() - (_HISTOGRAM.bit_length() - 1))
    cumulative = np.cumsum(np.bincount(values >> shift))
    bucket = int(np.searchsorted(cumulative, k))
    if shift == 0:
        return bucket
    inside = values[(values >> shift) == bucket] - (bucket << shift)
    return (bucket << shift) + _kth_lowest(inside, k - (int(cumulative[bucket - 1]) if bucket else 0))


def _sorted(values: np.ndarray, pick: np.ndarray) -> np.ndarray:
    """``pick`` ordered by their values (stable)."""
    return pick[np.argsort(values[pick], kind="stable")]


class FrequencySketch:
    """A count-min sketch of row frequencies (``depth`` hashed counters per row).

    Args:
        width: counters per hash row (rounded up to a power of two).
        depth: hash functions; the estimate is the minimum over them.
    """

    _MULTIPLIERS = np.array([0x9E3779B97F4A7C15, 0xC2B2AE3D27D4EB4F, 0x165667B19E3779F9, 0xD6E8FEB86659FD93],
                            dtype=np.uint64)

    def __init__(self, width: int, depth: int = 4):
        if not 1 <= depth <= len(self._MULTIPLIERS):
            raise ValueError(f"sketch depth must be 1..{len(self._MULTIPLIERS)}, got {depth}")
        self.bits = max(4, int(width - 1).bit_length())
        self.width = 1 << self.bits
        self.counts = np.zeros((depth, self.width), dtype=np.int32)
        self._rows = np.arange(depth, dtype=np.int64)[:, None] * self.width

    def _cells(self, rows: np.ndarray) -> np.ndarray:
        """Flat counter indices ``[depth, len(rows)]`` (multiply-shift hashing)."""
        keys = rows.astype(np.uint64)[None, :] + np.uint64(1)
        with np.errstate(over="ignore"):
            hashed = (keys * self._MULTIPLIERS[: len(self.counts), None]) >> np.uint64(64 - self.bits)
        return hashed.astype(np.int64) + self._rows

    def add(self, rows: np.ndarray) -> None:
        """Count each of ``rows`` once (callers pass distinct rows). Rows that share a counter
        add one to it together, so a counter still holds at least the count of every row
        that maps to it: the estimate never falls below the true count."""
        self.counts.reshape(-1)[self._cells(rows).reshape(-1)] += 1

    def estimate(self, rows: np.ndarray) -> np.ndarray:
        """An upper estimate of each row's count (int64)."""
        return self.counts.reshape(-1)[self._cells(rows)].min(0).astype(np.int64)

    def halve(self) -> None:
        np.right_shift(self.counts, 1, out=self.counts)

    @property
    def nbytes(self) -> int:
        return self.counts.nbytes


@dataclass
class Plan:
    """What the device must do before a batch's lookup (all arrays int64).

    Attributes:
        id: the plan's number (plans are numbered in the order they are made).
        slots: the slot of each distinct row of the batch (in the order they were given).
        write_back_slots / write_back_rows: dirty rows to copy out, slot -> host row, before
            any load (a load may reuse the slot).
        load_slots / load_rows: rows to copy in, host row -> slot.
        late_write_backs / late_loads: the last this many of each go out of / into slots the
            running step still uses: they wait until that step has ended.
    """

    id: int
    slots: np.ndarray
    write_back_slots: np.ndarray
    write_back_rows: np.ndarray
    load_slots: np.ndarray
    load_rows: np.ndarray
    late_write_backs: int = 0
    late_loads: int = 0


class SlotPlanner:
    """The slot map of one freqcache and its policy (see the module docstring).

    Args:
        num_rows: rows of the global row space.
        capacity: rows the cache may hold (cached slots).
        max_ids: the most ids one batch may have (sizes the staged slots).
        admission: ``all`` or ``tinylfu``.
        learn: count the uses of training batches (False: frequencies stay the profile's).
        decay_every: halve the counts every this many training batches (0: never).
    """

    def __init__(self, num_rows: int, capacity: int, max_ids: int, admission: str = "tinylfu",
                 learn: bool = True, decay_every: int = 0, sketch_width: int | None = None):
        self.num_rows, self.capacity, self.max_ids = num_rows, capacity, max_ids
        self.num_slots = capacity + 2 * min(max_ids, num_rows)
        self.admission, self.learn, self.decay_every = admission, learn, decay_every
        self.sketch = FrequencySketch(sketch_width or min(num_rows, capacity + max_ids))
        self.row_slot = np.full(num_rows, -1, dtype=np.int64)
        self.slot_row = np.full(self.num_slots, -1, dtype=np.int64)
        self.slot_cached = np.zeros(self.num_slots, dtype=bool)
        self.slot_dirty = np.zeros(self.num_slots, dtype=bool)
        self.slot_plan = np.full(self.num_slots, -1, dtype=np.int64)  # the last plan that used the slot
        self.slot_freq = np.zeros(self.num_slots, dtype=np.int64)  # the row's frequency when last seen
        # The number of the nearest look-ahead (window) batch that uses a row (0: none), and
        # the same per slot (so victims are ranked without a gather by row).
        self.next_use = np.zeros(num_rows, dtype=np.int32)
        self.slot_next_use = np.zeros(self.num_slots, dtype=np.int32)
        self._window: list[tuple[int, int, np.ndarray]] = []  # looked-ahead batches: (number, place, distinct rows)
        self._entered = 0
        self._kth_freq: int | None = None  # the last plan's highest victim frequency (a guess of the next one's)
        # Each row's occurrences in the window, a doubly linked list in entry order: an
        # occurrence is ``place * max_ids + position`` (a window batch's place in the arrays
        # below, its row's position in it); -1 ends a list.
        self._latest = np.full(num_rows, -1, dtype=np.int32)  # a row's last occurrence
        self._following = np.full((0, max_ids), -1, dtype=np.int32)  # [place, position]: the row's next occurrence
        self._preceding = np.full((0, max_ids), -1, dtype=np.int32)  # ... and its previous one
        self._place_number = np.zeros(0, dtype=np.int32)  # the number of the batch at each place (0: free)
        self.num_cached = 0
        self._cursor = 0  # where the search for free slots goes on
        self.plans = 0
        self.trained = 0
        self.counters = dict.fromkeys(("accesses", "unique_accesses", "hits", "misses", "unique_misses",
                                       "rows_admitted", "rows_evicted", "rows_written_back", "rows_loaded",
                                       "rows_moved_late"), 0)

    # -- set-up and look-ahead ---------------------------------------------------------------

    def profile(self, batches: list[np.ndarray]) -> np.ndarray:
        """Count profiled training batches (rows per id) in the sketch and preload the most
        frequent rows (the first rows if there is no profile); returns the preloaded rows."""
        for rows in batches:
            self.sketch.add(np.unique(rows))
        if batches:
            rows, counts = np.unique(np.concatenate(batches), return_counts=True)
            hot = rows[np.argsort(-counts, kind="stable")][: self.capacity]
        else:
            hot = np.arange(min(self.capacity, self.num_rows))
        self.preload(hot)
        return hot

    def preload(self, rows: np.ndarray) -> np.ndarray:
        """Cache ``rows`` (distinct, at most ``capacity``) in slots ``0..len-1``, clean; returns the slots."""
        slots = np.arange(len(rows))
        self.slot_row[slots], self.row_slot[rows] = rows, slots
        self.slot_cached[slots] = True
        self.slot_freq[slots] = self.sketch.estimate(rows)
        self.slot_next_use[slots] = self.next_use[rows]
        self.num_cached = len(rows)
        return slots

    def expect(self, unique_rows: np.ndarray, sign: int) -> None:
        """A looked-ahead batch's distinct rows (sorted) enter (+1) or leave (-1) the window.

        Each row keeps the number of the first entered window batch that uses it
        (``next_use``): the nearest one where batches enter in the order they are planned.
        Batches may leave in any order: the one that entered as this array leaves (else the
        oldest with these rows). The work is linear in the batch's rows, whatever the
        window's length."""
        if len(unique_rows) > self.max_ids:
            raise ValueError(f"a batch has {len(unique_rows)} distinct rows, more than the {self.max_ids} ids the cache was sized for")
        if sign > 0:
            self._entered += 1
            place = self._free_place()
            self._place_number[place] = self._entered
            occurrence = place * self.max_ids + np.arange(len(unique_rows), dtype=np.int32)
            latest = self._latest[unique_rows]
            again = latest >= 0
            self._preceding[place, : len(unique_rows)] = latest
            self._following[place, : len(unique_rows)] = -1
            self._following.reshape(-1)[latest[again]] = occurrence[again]
            self._latest[unique_rows] = occurrence
            self._window.append((self._entered, place, unique_rows))
            self._set_next_use(unique_rows[~again], self._entered)
        else:
            at = next((i for i, (_, _, r) in enumerate(self._window) if r is unique_rows), None)
            if at is None:  # not the array that entered: the oldest with the same rows
                at = next((i for i, (_, _, r) in enumerate(self._window)
                           if len(r) == len(unique_rows) and np.array_equal(r, unique_rows)), None)
            if at is None:
                raise ValueError("freqcache: a batch leaves the look-ahead window that never entered it")
            _, place, _ = self._window.pop(at)
            self._place_number[place] = 0
            preceding = self._preceding[place, : len(unique_rows)]
            following = self._following[place, : len(unique_rows)]
            before, after = preceding >= 0, following >= 0
            # Unlink the leaving occurrences (a batch that is not the oldest has some before it).
            self._following.reshape(-1)[preceding[before]] = following[before]
            self._preceding.reshape(-1)[following[after]] = preceding[after]
            self._latest[unique_rows[~after]] = preceding[~after]
            # Rows next used in the leaving batch: their next use is the next batch with them.
            first = ~before
            self._set_next_use(unique_rows[first], np.where(after[first], self._place_number[following[first] // self.max_ids], 0))

    def _set_next_use(self, rows: np.ndarray, number: int | np.ndarray) -> None:
        """Set ``next_use`` of ``rows``, and of their slots where they have one."""
        self.next_use[rows] = number
        slots = self.row_slot[rows]
        held = slots >= 0
        self.slot_next_use[slots[held]] = number if np.isscalar(number) else number[held]

    def _free_place(self) -> int:
        """A free place for a window batch in the linked lists' arrays (which grow as needed)."""
        free = np.flatnonzero(self._place_number == 0)
        if len(free):
            return int(free[0])
        place = len(self._place_number)
        grown = max(place + 1, place * 5 // 4)  # by a quarter: close to the window, in few steps
        if grown * self.max_ids > np.iinfo(np.int32).max:
            raise ValueError(f"freqcache: a look-ahead window of {grown} batches of {self.max_ids} ids is too large")
        self._place_number = np.concatenate([self._place_number, np.zeros(grown - place, dtype=np.int32)])
        for name in ("_following", "_preceding"):
            grown_links = np.full((grown, self.max_ids), -1, dtype=np.int32)
            grown_links[:place] = getattr(self, name)
            setattr(self, name, grown_links)
        return place

    def _bonus(self, next_use: np.ndarray) -> np.ndarray:
        """Belady's order inside the window: the sooner a row's next looked-ahead use, the
        larger its bonus; a row the window does not use (``next_use`` 0) gets none."""
        return np.where(next_use > 0, _UPCOMING * (self._entered + 1 - next_use.astype(np.int64)), 0)

    # -- planning ------------------------------------------------------------------------------

    def plan(self, batch: np.ndarray | tuple[np.ndarray, np.ndarray], train: bool, running: int | None = None) -> Plan:
        """Place every row of a batch in a slot.

        Args:
            batch: the batch's global rows, one per id; or already as ``(distinct rows,
                how many ids each has)``.
            train: a training batch (counted, and its slots become dirty); else evaluation.
            running: the plan of a step that may still be running (moves of its slots are late).
        """
        pid = self.plans
        self.plans += 1
        u, per_row = batch if isinstance(batch, tuple) else np.unique(batch, return_counts=True)
        if len(u) > self.max_ids:
            raise ValueError(f"a batch has {len(u)} distinct rows, more than the {self.max_ids} ids the cache was sized for")
        slot = self.row_slot[u]
        resident = slot >= 0
        res_slots = slot[resident]
        self.slot_plan[res_slots] = pid  # kept for this batch from here on
        cached = np.zeros(len(u), dtype=bool)
        cached[resident] = self.slot_cached[res_slots]
        # Cached rows count in their slot; the others in the sketch (so a step touches the
        # sketch only for the rows it misses).
        outside = ~cached
        if train:
            self.trained += 1
            if self.learn:
                self.sketch.add(u[outside])
                self.slot_freq[slot[cached]] += 1
                if self.decay_every and self.trained % self.decay_every == 0:
                    self.sketch.halve()
                    np.right_shift(self.slot_freq, 1, out=self.slot_freq)
        freq = np.empty(len(u), dtype=np.int64)
        freq[cached] = self.slot_freq[slot[cached]]
        freq[outside] = self.sketch.estimate(u[outside])
        staged_now = resident & outside
        self.slot_freq[slot[staged_now]] = freq[staged_now]
        if train:
            ids = int(per_row.sum())
            hits = int(per_row[cached].sum())
            c = self.counters
            c["accesses"] += ids
            c["unique_accesses"] += len(u)
            c["hits"] += hits
            c["misses"] += ids - hits
            c["unique_misses"] += int((~cached).sum())

        def unkept(slots: np.ndarray) -> np.ndarray:
            used = self.slot_plan[slots]
            return slots[(used != pid) & (used != (-2 if running is None else running))]

        # Candidates (rows not cached), best first; victims (unkept cached slots), worst first.
        candidates = np.flatnonzero(~cached)
        score = freq[candidates] + self._bonus(self.next_use[u[candidates]])
        by_score = np.argsort(-score, kind="stable")
        candidates, score = candidates[by_score], score[by_score]
        room = min(self.capacity - self.num_cached, len(candidates))
        victims = priority = np.empty(0, dtype=np.int64)
        wanted = len(candidates) - room
        if wanted > 0:  # only a slot below the best contested candidate's score can be taken
            # This batch's cached slots are victims too: one that loses is demoted in place.
            victims, priority = self._victims(wanted, None if self.admission == "all" else int(score[room]),
                                              kept=np.empty(0, dtype=np.int64))
        admit = np.zeros(len(candidates), dtype=bool)
        admit[:room] = True
        contested = min(len(candidates) - room, len(victims))
        if self.admission == "all":
            admit[room : room + contested] = True
        else:  # scores fall and victim priorities rise: the admitted ones are a prefix
            admit[room : room + contested] = score[room : room + contested] > priority[:contested]
        victims = victims[: int(admit[room:].sum())]
        # A victim this batch uses stays resident for its step, staged (Belady drops it after).
        in_batch = self.slot_plan[victims] == pid
        demoted, victims = victims[in_batch], victims[~in_batch]
        late = victims[self.slot_plan[victims] == running] if running is not None else victims[:0]
        admitted = candidates[admit]

        write_back = [self._evict(victims)]
        self.slot_cached[demoted] = False
        self.num_cached += len(admitted) - len(victims) - len(demoted)
        self.counters["rows_admitted"] += len(admitted)
        self.counters["rows_evicted"] += len(victims) + len(demoted)
        # Admitted rows that are staged now become cached where they are; the others take a
        # victim's slot or a free one. Rejected rows not resident take a free slot, staged.
        promote = slot[admitted][resident[admitted]]
        self.slot_cached[promote] = True
        incoming = admitted[~resident[admitted]]
        staged = candidates[~admit]
        staged = staged[~resident[staged]]
        free_victims = victims[len(incoming):]
        self.slot_cached[free_victims] = False  # a promoted row took their place in the count
        need = max(0, len(incoming) - len(victims)) + len(staged)
        free = np.empty(0, dtype=np.int64)
        if need:
            free = self._free_slots(need, unkept)
            write_back.append(self._evict(free))
        to_slots = np.concatenate([victims[: len(incoming)], free])
        new_rows = u[np.concatenate([incoming, staged])]
        self.slot_row[to_slots], self.row_slot[new_rows] = new_rows, to_slots
        self.slot_cached[to_slots] = np.arange(len(to_slots)) < len(incoming)
        self.slot_dirty[to_slots] = False
        self.slot_plan[to_slots] = pid
        self.slot_freq[to_slots] = freq[np.concatenate([incoming, staged])]
        self.slot_next_use[to_slots] = self.next_use[new_rows]
        batch_slots = self.row_slot[u]
        if train:
            self.slot_dirty[batch_slots] = True  # backward updates them
        self.counters["rows_loaded"] += len(new_rows)
        wb_slots, wb_rows = (np.concatenate(parts) for parts in zip(*write_back))
        if not len(late):
            return Plan(pid, batch_slots, wb_slots, wb_rows, to_slots, new_rows)
        self.counters["rows_moved_late"] += len(late)
        late_out, late_in = np.isin(wb_slots, late), np.isin(to_slots, late)
        out, into = np.argsort(late_out, kind="stable"), np.argsort(late_in, kind="stable")  # the late ones last
        return Plan(pid, batch_slots, wb_slots[out], wb_rows[out], to_slots[into], new_rows[into],
                    late_write_backs=int(late_out.sum()), late_loads=int(late_in.sum()))

    def _victims(self, wanted: int, limit: int | None, kept: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The ``wanted`` cached slots of lowest priority (below ``limit`` if given), lowest
        first (ties in slot order), and their priorities; never one of ``kept``.

        Masks over the whole slot arrays (no gather of every cached slot), then ranks first
        the slots whose row the window does not use: any of them ranks below every other."""
        takeable = self.slot_cached.copy()
        takeable[kept] = False
        upcoming = self.slot_next_use > 0
        plain = np.flatnonzero(takeable & ~upcoming)
        priority = self.slot_freq[plain]
        if limit is not None and limit < _UPCOMING:  # the others are all at least _UPCOMING
            below = priority < limit
            plain, priority = plain[below], priority[below]
        pick = _lowest(priority, wanted, self._kth_freq)
        victims, priority = plain[pick], priority[pick]
        self._kth_freq = int(priority[-1]) if len(priority) else None
        if len(victims) < wanted and (limit is None or limit > _UPCOMING):
            later = np.flatnonzero(takeable & upcoming)
            later_priority = self.slot_freq[later] + self._bonus(self.slot_next_use[later])
            if limit is not None:
                below = later_priority < limit
                later, later_priority = later[below], later_priority[below]
            pick = _lowest(later_priority, wanted - len(victims))
            victims = np.concatenate([victims, later[pick]])
            priority = np.concatenate([priority, later_priority[pick]])
        return victims, priority

    def _free_slots(self, need: int, unkept) -> np.ndarray:
        """``need`` slots that are not cached and not kept, scanned for from where the last
        scan stopped (so a plan touches about ``need`` slots, not all of them)."""
        found, scanned, start = [], 0, self._cursor
        chunk = min(self.num_slots, max(1024, 4 * need))  # no slot twice in one window
        while need > 0 and scanned < self.num_slots:
            window = np.arange(start, start + chunk) % self.num_slots
            free = unkept(window[~self.slot_cached[window]])[:need]
            found.append(free)
            need -= len(free)
            scanned += chunk
            start = int(free[-1]) + 1 if need == 0 else (start + chunk) % self.num_slots
        if need > 0:
            raise RuntimeError("freqcache: no free staged slot (the planner's sizing is wrong)")
        self._cursor = start % self.num_slots
        return np.concatenate(found) if found else np.empty(0, dtype=np.int64)

    def _evict(self, slots: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """Empty ``slots``; returns the dirty ones and their rows (to write back)."""
        rows = self.slot_row[slots]
        occupied = rows >= 0
        self.row_slot[rows[occupied]] = -1
        dirty = occupied & self.slot_dirty[slots]
        self.counters["rows_written_back"] += int(dirty.sum())
        self.slot_row[slots] = -1
        self.slot_dirty[slots] = False
        self.slot_next_use[slots] = 0
        return slots[dirty], rows[dirty]

    # -- reporting -----------------------------------------------------------------------------

    def dirty_slots(self) -> tuple[np.ndarray, np.ndarray]:
        """Every dirty resident slot and its row (for a flush)."""
        slots = np.flatnonzero(self.slot_dirty & (self.slot_row >= 0))
        return slots, self.slot_row[slots]

    def clean(self) -> None:
        self.slot_dirty[:] = False

    @property
    def nbytes(self) -> int:
        arrays = (self.row_slot, self.slot_row, self.slot_cached, self.slot_dirty, self.slot_plan, self.slot_freq,
                  self.next_use, self.slot_next_use, self._latest, self._following, self._preceding)
        return sum(a.nbytes for a in arrays) + self.sketch.nbytes
