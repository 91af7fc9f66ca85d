"""The cache simulators of the curves and the tier model: LRU, LFU and Belady's MIN over a
stream of batches, vectorised with NumPy (:mod:`embbench.cache.curve` draws their curves).

Every policy here is a cache of whole rows in front of a batched lookup: a step's distinct
rows are looked up against the cache as it was after the previous step (a step's repeated
ids of a row share its fate), then the cache is updated. Hit rates are counted per access
(each id) and per distinct row of each step (what a cache has to move).

- **MIN** (:func:`min_hits`): after each step the cache keeps the rows whose next use comes
  soonest, of rows next used together the one with more ids then (Belady with bypass, the
  semantics of :func:`embbench.metrics.belady_hit_rates`). Rows with the same next use and
  the same ids then have the same future, so the cache is a histogram over those *keys*, not
  a set of rows: a step takes out the keys that end at it (its hits), adds its rows' next
  keys, and keeps the ``capacity`` best. The work per step is the keys it touches plus the
  steps ahead, whatever the capacity.
- **LRU** and **LFU** keep the ``capacity`` rows ranked first by a key that only an access
  changes (LRU: the step of the last use; LFU: the steps that used the row, then the last
  one): stack algorithms (a smaller cache holds a subset of a larger one), so every size is
  read off one pass over the stream as the rank of each accessed row (Mattson). Rows of
  equal key (used in the same step) have no order: each is ranked at random among them,
  and the hit rates are their exact expectation.

Where the tier below needs to know *which* rows miss and which leave the cache (in training
every row a step uses is updated, so each is written back as it leaves),
:func:`stack_trace` and :func:`min_trace` run one capacity row by row on the same model: a
:class:`CacheTrace`.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["CacheTrace", "MinKeys", "StepRows", "min_hits", "min_trace", "stack_hits", "stack_trace", "step_rows"]


@dataclass(frozen=True)
class StepRows:
    """An id stream as the distinct rows of each step (ascending) and their ids, with each
    (step, row)'s previous use (a step; -1: none), next use (where it is in these arrays;
    -1: none) and number (the row's first step is 1). One flat array each, step ``t`` at
    ``[start[t], start[t + 1])``."""

    rows: np.ndarray
    counts: np.ndarray
    prev: np.ndarray
    following: np.ndarray
    nth: np.ndarray
    start: np.ndarray

    @property
    def num_steps(self) -> int:
        return len(self.start) - 1

    def step(self, t: int) -> slice:
        return slice(int(self.start[t]), int(self.start[t + 1]))

    def step_of(self) -> np.ndarray:
        """The step of each entry."""
        return np.repeat(np.arange(self.num_steps, dtype=np.int64), np.diff(self.start))

    def previous(self) -> np.ndarray:
        """Each entry's previous use of its row (an entry; -1: none)."""
        previous = np.full(len(self.rows), -1, np.int64)
        again = np.flatnonzero(self.following >= 0)
        previous[self.following[again]] = again
        return previous

    def split(self, group: np.ndarray, groups: int) -> list["StepRows"]:
        """The entries of each group (``group``: each entry's, in ``[0, groups)``; all uses
        of a row in one group, e.g. its table)."""
        steps = self.num_steps
        order = np.argsort(group, kind="stable")  # by group, each group's entries in step order
        where = np.empty(len(order), np.int64)
        where[order] = np.arange(len(order))
        sizes = np.bincount(group * steps + self.step_of(), minlength=groups * steps).reshape(groups, steps)
        first = np.concatenate([[0], np.cumsum(sizes.sum(1))])
        following = self.following[order]
        again = following >= 0
        following[again] = where[following[again]]
        rows, counts, prev, nth = (a[order] for a in (self.rows, self.counts, self.prev, self.nth))
        parts = []
        for g in range(groups):
            part = slice(int(first[g]), int(first[g + 1]))
            parts.append(StepRows(rows[part], counts[part], prev[part], following[part] - first[g], nth[part],
                                  np.concatenate([[0], np.cumsum(sizes[g])])))
        return parts


@dataclass(frozen=True)
class CacheTrace:
    """One cache at one capacity run row by row over a :class:`StepRows`: which entries miss
    (``missed``, one flag per entry), and the rows that leave the cache at each step
    (``evicted[t]``; a row the step used and the cache did not keep leaves at that step)."""

    missed: np.ndarray
    evicted: list[np.ndarray]


def _ranges(starts: np.ndarray, lengths: np.ndarray) -> np.ndarray:
    """``arange(starts[i], starts[i] + lengths[i])`` for every ``i``, one after another."""
    lengths = np.asarray(lengths, np.int64)
    return np.repeat(np.asarray(starts, np.int64) - np.cumsum(lengths) + lengths, lengths) + np.arange(int(lengths.sum()))


def _distinct(ids) -> tuple[np.ndarray, np.ndarray]:
    """The distinct values of ``ids`` (ascending) and how often each occurs."""
    ids = np.sort(np.asarray(ids).reshape(-1))
    first = np.flatnonzero(np.concatenate([[True], ids[1:] != ids[:-1]])) if len(ids) else np.empty(0, np.int64)
    return ids[first].astype(np.int64, copy=False), np.diff(np.append(first, len(ids)))


def _by_row(rows: np.ndarray) -> np.ndarray:
    """The indices of ``rows`` grouped by row, each row's in index order (so in step order)."""
    bits = len(rows).bit_length()
    if len(rows) and rows.min() >= 0 and int(rows.max()).bit_length() + bits <= 63:
        packed = (rows << bits) | np.arange(len(rows))  # one plain sort of (row, index): 3-4x a stable argsort's speed
        packed.sort()
        return packed & ((1 << bits) - 1)
    return np.argsort(rows, kind="stable")


def step_rows(steps: list) -> StepRows:
    """The :class:`StepRows` of a list of steps' ids (arrays of any shape and integer type)."""
    uniques = [_distinct(s) for s in steps]
    rows = np.concatenate([u for u, _ in uniques] + [np.empty(0, np.int64)])
    counts = np.concatenate([c for _, c in uniques] + [np.empty(0, np.int64)])
    start = np.concatenate([[0], np.cumsum([len(u) for u, _ in uniques], dtype=np.int64)])
    order = _by_row(rows)
    by_row = rows[order]
    same = by_row[1:] == by_row[:-1]
    earlier, later = order[:-1][same], order[1:][same]
    following, prev = np.full(len(rows), -1, np.int64), np.full(len(rows), -1, np.int64)
    following[earlier] = later
    prev[later] = np.searchsorted(start, earlier, side="right") - 1
    # The number of each use of a row: its place in the row's run of the sorted order.
    place = np.arange(len(rows))
    nth = np.empty(len(rows), np.int64)
    nth[order] = place - np.maximum.accumulate(np.where(np.concatenate([[True], ~same]), place, 0)) + 1
    return StepRows(rows, counts, prev, following, nth, start)


class MinKeys:
    """The keys of one stream for :func:`min_hits`, shared by every capacity.

    A key is (next use, ids then); key ``i`` ranks before ``i + 1`` (sooner, then more ids).
    ``offset[e]:offset[e + 1]`` are the keys ending at step ``e`` (``e`` = the number of
    steps: never used again, one key).
    """

    def __init__(self, s: StepRows):
        num = s.num_steps
        # Each entry's own key as a key's end: its step's counts, most ids first.
        own = np.empty(len(s.rows), np.int64)
        offset, value = [0], []
        for e in range(num):
            counts = s.counts[s.step(e)]
            present = np.bincount(counts) > 0
            more = np.cumsum(present[::-1])[::-1] - present  # present values above each
            own[s.step(e)] = offset[-1] + more[counts]
            value.append(np.flatnonzero(present)[::-1])
            offset.append(offset[-1] + len(value[-1]))
        value.append(np.zeros(1, np.int64))  # never used again: one key
        self.offset = np.append(offset, offset[-1] + 1)
        self.value = np.concatenate(value)
        self.end = np.repeat(np.arange(num + 1), np.diff(self.offset))
        self.key = np.full(len(s.rows), self.offset[num], np.int64)
        again = s.following >= 0
        self.key[again] = own[s.following[again]]
        # What each step adds: its rows' keys (distinct, with how many rows), per end too.
        self.adds = []
        for t in range(num):
            first = self.offset[t + 1]
            many = np.bincount(self.key[s.step(t)] - first)
            at = np.flatnonzero(many)
            self.adds.append((at + first, many[at], np.bincount(self.end[at + first], many[at], num + 1).astype(np.int64)))


class _MinTrace:
    """Which rows :func:`min_hits` keeps, for :func:`min_trace`. The rows of a key are
    interchangeable; of a key's rows (in the order they joined it) the cache holds the last
    ``held`` to join and loses the first of them: so the rows held are implicit in ``held``."""

    def __init__(self, s: StepRows, k: MinKeys):
        self.s = s
        self.members = np.argsort(k.key, kind="stable")  # each key's entries, in step order
        self.first = np.searchsorted(k.key[self.members], np.arange(len(k.value) + 1))
        self.joined = np.zeros(len(k.value), np.int64)  # entries that joined each key so far
        self.missed = np.ones(len(s.rows), bool)
        self.evicted = [np.empty(0, np.int64)] * s.num_steps

    def _held(self, keys: np.ndarray, skipped: np.ndarray, many: np.ndarray) -> np.ndarray:
        """Entries of ``keys``: ``many`` of each after the first ``joined - skipped``."""
        return self.members[_ranges(self.first[keys] + self.joined[keys] - skipped, many)]

    def hit(self, lo: int, hi: int, held: np.ndarray) -> None:
        """The keys ``[lo, hi)`` end: the rows held of them hit."""
        keys = lo + np.flatnonzero(held[lo:hi])
        self.missed[self.s.following[self._held(keys, held[keys], held[keys])]] = False

    def evict(self, t: int, first_key: int, before: np.ndarray, after: np.ndarray) -> None:
        """Step ``t`` cut the rows held of keys from ``first_key`` from ``before`` to ``after``."""
        cut = np.flatnonzero(before > after)
        self.evicted[t] = self.s.rows[self._held(first_key + cut, before[cut], before[cut] - after[cut])]


def min_trace(s: StepRows, capacity: int, keys: MinKeys | None = None) -> CacheTrace:
    """:func:`min_hits`' cache row by row: which entries miss, which rows leave at each step
    (of rows with the same future, the ones that joined it first)."""
    trace = _MinTrace(s, keys or MinKeys(s))
    min_hits(s, capacity, keys=keys, trace=trace)
    return CacheTrace(trace.missed, trace.evicted)


def min_hits(s: StepRows, capacity: int, skip: int = 0, prefilled: bool = False,
             keys: MinKeys | None = None, trace: _MinTrace | None = None) -> tuple[int, int, int, int]:
    """Belady's MIN with bypass on ``s`` at ``capacity`` rows (see the module docstring and
    :func:`embbench.metrics.belady_hit_rates`): ``(hits, accesses, distinct hits, distinct
    rows)`` over the steps from ``skip``. ``prefilled``: a row that finds a free slot hits.
    ``keys``: the stream's keys, to share between capacities. ``trace``: told which rows
    hit and leave (:func:`min_trace`)."""
    if trace is not None and prefilled:
        raise ValueError("min_hits: a prefilled cache is not traced (its free slots hold no row in particular)")
    k = keys or MinKeys(s)
    offset, value = k.offset, k.value
    held = np.zeros(len(value), np.int64)  # surviving rows per key
    per_end = np.zeros(s.num_steps + 1, np.int64)
    size = top = 0  # rows held; every key from ``top`` on holds none
    hits = accesses = distinct_hits = distinct = 0
    for t in range(s.num_steps):
        lo, hi = offset[t], offset[t + 1]
        ending = int(per_end[t])
        if t >= skip:
            here = s.step(t)
            hits += int(held[lo:hi] @ value[lo:hi])
            distinct_hits += ending
            accesses += int(s.counts[here].sum())
            distinct += here.stop - here.start
            if prefilled and size < capacity:  # every row seen is held: the new ones fill the free slots
                new = here.start + np.flatnonzero(s.prev[here] == -1)
                soonest = new[np.argsort(k.key[new], kind="stable")[: capacity - size]]
                hits += int(s.counts[soonest].sum())
                distinct_hits += len(soonest)
        if trace is not None:
            trace.hit(lo, hi, held)
        held[lo:hi] = 0
        per_end[t] = 0
        size -= ending
        at, many, ends = k.adds[t]
        held[at] += many
        if trace is not None:
            trace.joined[at] += many
        per_end += ends
        size += int(many.sum())
        if size > capacity:  # keep the best ``capacity``: cut at the key where they run out
            cum = np.cumsum(per_end)
            e = int(np.searchsorted(cum, capacity))
            before = int(cum[e - 1]) if e else 0
            inside = np.cumsum(held[offset[e] : offset[e + 1]])
            j = int(np.searchsorted(inside, capacity - before))
            cut = offset[e] + j
            touched = slice(cut, max(top, cut + 1, int(at[-1]) + 1 if len(at) else 0))
            was = held[touched].copy() if trace is not None else None
            held[cut] = capacity - before - (int(inside[j - 1]) if j else 0)
            held[cut + 1 : max(top, cut + 1)] = 0
            held[at[at > cut]] = 0
            if trace is not None:
                trace.evict(t, cut, was, held[touched])
            per_end[e], per_end[e + 1 :] = capacity - before, 0
            size, top = capacity, cut + 1
        elif len(at):
            top = max(top, int(at[-1]) + 1)
    return hits, accesses, distinct_hits, distinct


def _tally(classes: np.ndarray, weights: np.ndarray, span: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The distinct ``classes`` (ascending, below ``span``), how many of each, and the sum of
    their ``weights``: counted over the span where it is short, else sorted."""
    if span <= 4 * len(classes):
        rows = np.bincount(classes, minlength=span)
        at = np.flatnonzero(rows)
        return at, rows[at], np.bincount(classes, weights, minlength=span)[at]
    at, where = np.unique(classes, return_inverse=True)
    return at, np.bincount(where, minlength=len(at)), np.bincount(where, weights, minlength=len(at))


def stack_hits(s: StepRows, capacities, policy: str, skip: int = 0) -> tuple[np.ndarray, np.ndarray]:
    """The expected hits and distinct hits of LRU or LFU (``policy``) at each of
    ``capacities`` rows, counted over the steps from ``skip``, from an empty cache.

    LRU keeps the rows last used latest; LFU the rows used in the most steps so far, then
    the ones last used latest. A row is hit where fewer than ``capacity`` rows rank above it
    after the previous step; rows of equal rank (used in the same steps) are ordered at
    random, so a row ranked among ``group`` of them after ``above`` others is hit with
    probability ``clip(capacity - above, 0, group) / group``.
    """
    if policy not in ("lru", "lfu"):
        raise ValueError(f"stack_hits: policy {policy!r} is not lru or lfu")
    capacities = np.asarray(capacities, dtype=np.float64)[:, None]
    num = s.num_steps
    # Rows per rank class, the higher the better: LRU's the step of the last use; LFU's
    # (steps used so far, last one) as ``uses * num + last``.
    lfu = policy == "lfu"
    held = np.zeros((num + 1) * num if lfu else num, np.int64)
    hits, distinct_hits = np.zeros(len(capacities)), np.zeros(len(capacities))
    for t in range(num):
        here = s.step(t)
        prev, uses = s.prev[here], s.nth[here] - 1  # uses before this step
        again = prev >= 0
        rank = (uses * num + prev)[again] if lfu else prev[again]
        at, rows_at, ids_at = _tally(rank, s.counts[here][again], (t + 1) * num if lfu else t)
        if t >= skip and len(at):
            cum = np.cumsum(held[: at[-1] + 1])
            above, group = held.sum() - cum[at], held[at]
            share = np.clip(capacities - above, 0, group) / group
            hits += share @ ids_at
            distinct_hits += share @ rows_at
        held[at] -= rows_at
        if lfu:  # the step's rows join class (uses, t)
            joined = np.bincount(s.nth[here])
            held[np.flatnonzero(joined) * num + t] += joined[joined > 0]
        else:
            held[t] = here.stop - here.start
    return hits, distinct_hits


def stack_trace(s: StepRows, capacity: int, policy: str, tie: np.ndarray | None = None, seed: int = 0) -> CacheTrace:
    """LRU or LFU (``policy``) at ``capacity`` rows, row by row: the cache of
    :func:`stack_hits` with rows of equal rank ordered by ``tie`` (one value per entry, the
    higher kept; by default drawn at random from ``seed``, so the hit rates average to
    :func:`stack_hits`' over seeds).

    Every entry joins its class (LRU: its step; LFU: its uses so far and its step) when its
    step comes, and leaves it at its row's next use. Entries in (class, tie) order: the cache
    holds the entries alive from a cut on, and the cut only moves up (a rank changes only by
    a use, which raises it), so the whole run walks each entry once."""
    if policy not in ("lru", "lfu"):
        raise ValueError(f"stack_trace: policy {policy!r} is not lru or lfu")
    num = s.num_steps
    step = s.step_of()
    if tie is None:
        tie = np.random.default_rng(seed).random(len(s.rows))
    ranked = np.lexsort((tie, step if policy == "lru" else s.nth * num + step))  # worst first
    position = np.empty(len(ranked), np.int64)
    position[ranked] = np.arange(len(ranked))
    previous = s.previous()
    ends = np.full(len(s.rows), num, np.int64)  # the step at which each entry stops being its row's
    again = s.following >= 0
    ends[again] = step[s.following[again]]
    missed = np.ones(len(s.rows), bool)
    evicted = []
    cut = held = 0  # the cache: the live entries ranked from ``cut`` on, ``held`` of them
    for t in range(num):
        here = s.step(t)
        before = previous[here]
        hit = before >= 0
        hit[hit] = position[before[hit]] >= cut
        missed[here] = ~hit
        joins = position[here] >= cut
        out = [s.rows[here][~joins]]  # used and not kept: out again at once
        held += int(joins.sum()) - int(hit.sum())
        while held > capacity:  # the lowest live entries leave
            window = ranked[cut : cut + 4 * (held - capacity) + 1024]
            alive = window[(step[window] <= t) & (ends[window] > t)]
            leaving = alive[: held - capacity]
            out.append(s.rows[leaving])
            held -= len(leaving)
            cut = int(position[leaving[-1]]) + 1 if len(leaving) else cut + len(window)  # just past the last to leave
        evicted.append(np.concatenate(out))
    return CacheTrace(missed, evicted)
