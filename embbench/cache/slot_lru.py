"""Host memory's slots in the file store (:mod:`embbench.cache.file_rows`) in the order they are
evicted, kept with work proportional to the slots a call names, never to host memory (issue 48:
a scan of every slot on each call grew with host memory, not with the batch).

A slot may be evicted when no announced batch pins it and it is empty or its block has arrived
(never a slot being read into). Empty slots go first, then the least recently used.

Recency is a queue of touches, oldest first: a touch appends its slots with the clock's value,
and an entry is live while it is its slot's last touch (a later touch leaves it stale, dropped
when an eviction or a compaction passes it). An eviction walks the queue from its oldest
entries, a piece at a time, and puts back the live ones it passed, merged into one chunk: its
work is the victims, the stale entries (once each), and the pinned or unarrived slots older
than the victims (a slot is touched when it is pinned and when it is attached: these are few).
"""

from __future__ import annotations

from collections import deque

import numpy as np

__all__ = ["SlotLru"]


class SlotLru:
    """``capacity`` slots: their pins, whether their block has arrived (``ready``), whether they
    hold a block at all (``empty``), when they were last used (``last_use``, a clock of
    touches), and how many are pinned (``pinned``). The arrays are read freely; they change only
    through the methods. ``examined``: the queue's entries evictions have looked at (an
    instrument: the work grows with the victims, not with host memory)."""

    PIECE = 1024  # an eviction looks at a chunk of the queue this much (and twice its victims) at a time
    SLACK = 4096  # stale entries allowed beyond the slots (twice over) before a compaction

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.pins = np.zeros(capacity, np.int32)  # announced batches not yet moved that need the slot
        self.ready = np.zeros(capacity, bool)
        self.empty = np.ones(capacity, bool)
        self.last_use = np.zeros(capacity, np.int64)
        self.pinned = 0  # slots with pins
        self.examined = 0
        self._clock = 0
        # every slot below this one holds a block (slots are filled in order: the empty ones are
        # the victims first, lowest first)
        self._filled_below = 0
        self._touches: deque[tuple[np.ndarray, np.ndarray]] = deque()  # (slots, their touch), oldest first
        self._entries = 0  # in the queue, live or stale
        self._position = np.zeros(capacity, np.int64)  # scratch: a touch's duplicates
        self._kept = np.zeros(capacity, bool)  # scratch: the slots an eviction must not take

    @property
    def nbytes(self) -> int:
        arrays = (self.pins, self.ready, self.empty, self.last_use, self._position, self._kept)
        # (the queue by its count: another thread may be changing it)
        return sum(a.nbytes for a in arrays) + 2 * 8 * self._entries

    def touch(self, slots: np.ndarray) -> None:
        """``slots`` were used now (the same slot may appear more than once)."""
        slots = np.asarray(slots, dtype=np.int64)
        self._clock += 1
        if not len(slots):
            return
        at = np.arange(len(slots))
        self._position[slots] = at  # one position per slot wins, whichever: the others are its duplicates
        slots = slots[self._position[slots] == at]
        self.last_use[slots] = self._clock
        self._touches.append((slots, np.full(len(slots), self._clock, np.int64)))
        self._entries += len(slots)
        if self._entries > 2 * self.capacity + self.SLACK:
            self._compact()

    def attach(self, slots: np.ndarray) -> None:
        """``slots`` now hold new blocks, not arrived yet (used now)."""
        self.empty[slots] = False
        self.ready[slots] = False
        self.touch(slots)

    def arrived(self, slots: np.ndarray) -> None:
        """The blocks of ``slots`` have been read into them."""
        self.ready[slots] = True

    def pin(self, slots: np.ndarray) -> None:
        """One pin more on each of ``slots`` (a slot named twice gets two)."""
        slots, times = np.unique(np.asarray(slots, dtype=np.int64), return_counts=True)
        self.pinned += int((self.pins[slots] == 0).sum())
        self.pins[slots] += times.astype(np.int32)

    def unpin(self, slots: np.ndarray) -> None:
        """One pin less on each of ``slots`` (a slot named twice loses two)."""
        slots, times = np.unique(np.asarray(slots, dtype=np.int64), return_counts=True)
        if (self.pins[slots] < times).any():
            raise ValueError(f"slot {int(slots[self.pins[slots] < times][0])} unpinned more often than pinned")
        self.pins[slots] -= times.astype(np.int32)
        self.pinned -= int((self.pins[slots] == 0).sum())

    def victims(self, k: int, keep: np.ndarray | None = None) -> np.ndarray | None:
        """``k`` slots that may be evicted, never one of ``keep``: the empty ones first, then the
        least recently used; None when fewer than ``k`` may be (the queue is left as it was)."""
        if keep is not None:
            self._kept[keep] = True
        try:
            found = [self._empty_victims(k)]
            need = k - len(found[0])
            passed = []
            while need > 0 and self._touches:
                slots, touched = self._touches.popleft()
                piece = 2 * need + self.PIECE  # (a long chunk a piece at a time: the one a compaction leaves)
                if len(slots) > piece:
                    self._touches.appendleft((slots[piece:], touched[piece:]))
                    slots, touched = slots[:piece], touched[:piece]
                self.examined += len(slots)
                live = self.last_use[slots] == touched
                self._entries -= len(slots) - int(live.sum())
                slots, touched = slots[live], touched[live]
                passed.append((slots, touched))
                free = (self.pins[slots] == 0) & self.ready[slots] & ~self.empty[slots] & ~self._kept[slots]
                taken = slots[np.flatnonzero(free)[:need]]
                found.append(taken)
                need -= len(taken)
            if passed:  # back at the front, the victims too: they go stale when they are attached
                self._touches.appendleft(tuple(np.concatenate(parts) for parts in zip(*passed)))
        finally:
            if keep is not None:
                self._kept[keep] = False
        return np.concatenate(found) if need <= 0 else None

    def _empty_victims(self, k: int) -> np.ndarray:
        """Up to ``k`` empty slots not pinned nor kept, lowest first (moving ``_filled_below`` past the
        slots filled since)."""
        found, at, below_all = [], self._filled_below, True
        while k > 0 and at < self.capacity:
            window = np.arange(at, min(self.capacity, at + k + 64))
            empty = self.empty[window]
            if below_all:
                below_all = not empty.any()
                self._filled_below = int(window[-1] + 1 if below_all else window[np.argmax(empty)])
            taken = window[empty & (self.pins[window] == 0) & ~self._kept[window]][:k]
            found.append(taken)
            k -= len(taken)
            at = int(window[-1]) + 1
        return np.concatenate(found) if found else np.zeros(0, np.int64)

    def evictable(self, keep: np.ndarray | None = None) -> int:
        """How many slots may be evicted, ``keep`` aside (a scan of every slot: for an error's
        message)."""
        free = (self.pins == 0) & (self.ready | self.empty)
        if keep is not None:
            free[keep] = False
        return int(free.sum())

    def _compact(self) -> None:
        """The queue without its stale entries (when they outnumber the slots: no eviction has
        passed them)."""
        slots, touched = (np.concatenate(parts) for parts in zip(*self._touches))
        live = self.last_use[slots] == touched
        self._touches = deque([(slots[live], touched[live])])
        self._entries = int(live.sum())
