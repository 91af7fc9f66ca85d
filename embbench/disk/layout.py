"""Where each row of a table sits in a file of 4 KiB pages.

Rows no larger than a page are packed whole into pages (a row never straddles two pages, so
one read brings it; the tail of a page that a row does not fit is left unused). A larger row
starts on a page boundary and takes as many whole pages as it needs. Reads and writes are
always whole pages: what O_DIRECT asks, and what a drive does anyway.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

__all__ = ["PAGE", "PageLayout", "ROW_ORDERS", "RowOrder"]

#: Bytes in a page: the unit of every read and write (a drive's usual logical block is 512 B or 4 KiB).
PAGE = 4096


@dataclass(frozen=True)
class PageLayout:
    """``rows`` rows of ``row_bytes`` bytes each, laid out in pages."""

    rows: int
    row_bytes: int

    def __post_init__(self):
        if self.rows < 0 or self.row_bytes <= 0:
            raise ValueError(f"a page layout needs rows >= 0 and row_bytes > 0, got {self.rows} and {self.row_bytes}")

    @property
    def rows_per_page(self) -> int:
        """Rows that share one page (1 when a row takes a page or more)."""
        return max(1, PAGE // self.row_bytes)

    @property
    def pages_per_row(self) -> int:
        """Pages one row takes (1 for rows that share pages)."""
        return max(1, math.ceil(self.row_bytes / PAGE))

    @property
    def pages(self) -> int:
        """Pages in the file."""
        if self.pages_per_row > 1:
            return self.rows * self.pages_per_row
        return math.ceil(self.rows / self.rows_per_page)

    @property
    def file_bytes(self) -> int:
        return self.pages * PAGE

    def first_page(self, rows: np.ndarray) -> np.ndarray:
        """The (first) page of each row."""
        rows = np.asarray(rows, dtype=np.int64)
        return rows * self.pages_per_row if self.pages_per_row > 1 else rows // self.rows_per_page

    def offset_in_page(self, rows: np.ndarray) -> np.ndarray:
        """Each row's byte offset inside its (first) page."""
        rows = np.asarray(rows, dtype=np.int64)
        return np.zeros_like(rows) if self.pages_per_row > 1 else (rows % self.rows_per_page) * self.row_bytes

    def useful_share(self) -> float:
        """The share of a read page's bytes that hold rows (the rest is page tail)."""
        return min(1.0, self.rows_per_page * self.row_bytes / (self.pages_per_row * PAGE))


#: How rows are placed in the file: ``id`` (row r at place r), ``frequency`` (the profile's
#: rows used in more than one batch at the file's first places, most used first: hot rows share
#: pages), ``table_frequency`` (in each table's own range, every row the profile saw first,
#: most used first: the rows of a table that were seen share pages, away from its unseen ones)
#: or ``coaccess`` (the rows the device caches first, then the profile's other rows in pages by
#: the sample that used them: rows used together, across tables, share a page).
ROW_ORDERS = ("id", "frequency", "table_frequency", "coaccess")


class RowOrder:
    """Where each row sits in the file: row ``r`` at place ``r`` (its page and offset are the
    place's, :class:`PageLayout`), except the ``moved`` rows (sorted), which sit at ``places``.
    The moved rows' places are the moved rows' own ids in another order (a permutation of
    them), so the map is two arrays the size of the moved set, never of the table (int32 where
    the rows fit: 8 bytes a moved row)."""

    def __init__(self, rows: int, name: str = "id", moved: np.ndarray | None = None, places: np.ndarray | None = None):
        self.rows, self.name = rows, name
        kind = np.int32 if rows < 2**31 else np.int64
        self.moved = np.empty(0, kind) if moved is None else np.asarray(moved).astype(kind)
        self.places = np.empty(0, kind) if places is None else np.asarray(places).astype(kind)

    @classmethod
    def by_frequency(cls, rows: int, profiled: list[np.ndarray], min_batches: int = 2) -> "RowOrder":
        """``frequency``: rows used by at least ``min_batches`` of the ``profiled`` batches
        (global rows) at the file's first places, most used first (ties by id); the rows they
        displace take the places they left."""
        return cls._ordered(rows, profiled, [0], min_batches, "frequency")

    @classmethod
    def by_table_frequency(cls, rows: int, profiled: list[np.ndarray], table_starts) -> "RowOrder":
        """``table_frequency``: in each table's range (tables start at ``table_starts``), every
        row the profile used at the range's first places, most used first."""
        return cls._ordered(rows, profiled, list(table_starts), 1, "table_frequency")

    @classmethod
    def by_coaccess(cls, rows: int, profiled: list[np.ndarray], samples: list[np.ndarray], rows_per_page: int,
                    cached: int) -> "RowOrder":
        """``coaccess``: rows placed so that a page holds rows the profile used together.

        At the file's first places, as ``frequency`` places them, the rows the device caches
        (at most ``cached``: the profile's rows used in two batches or more, most used first;
        they are rarely read). From the next page on, every other row the profile used, in
        groups: a group is the rows whose first use was by one sample (``samples[i]``: the
        sample of each id of ``profiled[i]``), across tables; groups follow in the order of
        their samples, and a group that does not fit in what is left of a page starts the next
        one (the gap keeps rows the profile never used; a group larger than a page fills
        pages of its own). So when a sample's rows are used together again they come in one
        read, not one a row."""
        if not profiled:
            return cls(rows, "coaccess")
        if len(samples) != len(profiled) or any(len(r) != len(s) for r, s in zip(profiled, samples)):
            raise ValueError("the coaccess layout needs the sample of every profiled id (one array a batch, "
                             "the length of its rows)")
        seen, counts = cls._batch_counts(profiled)
        often = counts >= 2
        hot = seen[often][np.lexsort((seen[often], -counts[often]))][:max(0, cached)]
        ids = np.concatenate([np.asarray(b, np.int64) for b in profiled])
        offsets = np.cumsum([0] + [int(np.max(s)) + 1 if len(s) else 0 for s in samples[:-1]])
        sample = np.concatenate([np.asarray(s, np.int64) + o for s, o in zip(samples, offsets)])
        used, first = np.unique(ids, return_index=True)  # each row's first use (used is seen)
        cold = ~np.isin(used, hot, assume_unique=True)
        used, group, used_in = used[cold], sample[first[cold]], counts[cold]
        # most used first, then by first sample: a group is the rows a sample used first that
        # were used as often (an entity's rows recur together, so they count alike)
        in_order = np.lexsort((used, group, -used_in))
        used, group, used_in = used[in_order], group[in_order], used_in[in_order]
        new = np.r_[True, (group[1:] != group[:-1]) | (used_in[1:] != used_in[:-1]), True]
        sizes = np.diff(np.flatnonzero(new)) if len(used) else np.empty(0, int)
        start = -(-len(hot) // rows_per_page) * rows_per_page  # the page after the cached rows
        starts = cls._pack(sizes, start, rows_per_page)
        if len(sizes) and (starts + sizes).max() > rows:  # no room for the gaps: one after another
            starts = len(hot) + np.concatenate([[0], np.cumsum(sizes)[:-1]])
        within = np.arange(len(used)) - np.repeat(np.cumsum(sizes) - sizes, sizes)
        places = np.concatenate([np.arange(len(hot), dtype=np.int64), np.repeat(starts, sizes) + within])
        return cls._arranged(rows, "coaccess", np.concatenate([hot, used]), places)

    @staticmethod
    def _pack(sizes: np.ndarray, start: int, rows_per_page: int) -> np.ndarray:
        """Where each group of ``sizes`` rows starts, in pages from place ``start`` (a page
        boundary), each group in turn: in the fullest page it fits in whole (best fit), else
        in a new page; a group larger than a page takes new pages of its own, its last one
        open to later groups."""
        starts = np.empty(len(sizes), np.int64)
        room: list[list[int]] = [[] for _ in range(rows_per_page)]  # room[r]: pages with r places left
        page = start // rows_per_page  # the next new page
        for i, size in enumerate(sizes.tolist()):
            left = next((r for r in range(size, rows_per_page) if room[r]), None)
            if left is None:  # new pages
                at, taken = page * rows_per_page, -(-size // rows_per_page)
                page += taken
                left = taken * rows_per_page - size
                if left:
                    room[left].append(page - 1)
            else:
                p = room[left].pop()
                at = p * rows_per_page + rows_per_page - left
                left -= size
                if left:
                    room[left].append(p)
            starts[i] = at
        return starts

    @staticmethod
    def _batch_counts(profiled: list[np.ndarray]) -> tuple[np.ndarray, np.ndarray]:
        """The rows the profiled batches used (sorted), and in how many batches each."""
        return np.unique(np.concatenate([np.unique(np.asarray(b, np.int64)) for b in profiled]), return_counts=True)

    @classmethod
    def _ordered(cls, rows: int, profiled: list[np.ndarray], starts: list[int], min_batches: int, name: str):
        if not profiled:
            return cls(rows, name)
        seen, counts = cls._batch_counts(profiled)
        keep = counts >= min_batches
        seen, counts = seen[keep], counts[keep]
        placed, places = [], []
        for lo, hi in zip(starts, [*starts[1:], rows]):
            a, b = np.searchsorted(seen, [lo, hi])
            hot = seen[a:b][np.lexsort((seen[a:b], -counts[a:b]))]  # most used first, ties by id
            placed.append(hot)
            places.append(np.arange(lo, lo + len(hot), dtype=np.int64))
        return cls._arranged(rows, name, np.concatenate(placed), np.concatenate(places))

    @classmethod
    def _arranged(cls, rows: int, name: str, placed: np.ndarray, places: np.ndarray) -> "RowOrder":
        """``placed`` rows at ``places`` (distinct); each row whose place they take (places
        not among the placed rows' ids) goes, in order, to a place they leave (placed rows'
        ids not among the places): a permutation that moves as few rows as that allows."""
        placed, places = np.asarray(placed, np.int64), np.asarray(places, np.int64)
        displaced = np.setdiff1d(places, placed)  # sorted
        vacated = np.setdiff1d(placed, places)  # sorted, as many
        moved, to = np.concatenate([placed, displaced]), np.concatenate([places, vacated])
        stays = moved == to
        order = np.argsort(moved[~stays], kind="stable")
        return cls(rows, name, moved[~stays][order], to[~stays][order])

    def place(self, rows: np.ndarray) -> np.ndarray:
        """Each row's place in the file."""
        rows = np.asarray(rows, dtype=np.int64)
        return self._lookup(rows, self.moved, self.places)

    def row_at(self, places: np.ndarray) -> np.ndarray:
        """The row at each place."""
        places = np.asarray(places, dtype=np.int64)
        # the moved set sorted is also the moved places' set sorted (made here: fill and reads of
        # the whole table only)
        return self._lookup(places, self.moved, self.moved[np.argsort(self.places, kind="stable")])

    @staticmethod
    def _lookup(keys: np.ndarray, sorted_keys: np.ndarray, values: np.ndarray) -> np.ndarray:
        if not len(sorted_keys) or not len(keys):
            return keys
        at = np.minimum(np.searchsorted(sorted_keys, keys), len(sorted_keys) - 1)
        return np.where(sorted_keys[at] == keys, values[at], keys).astype(np.int64)

    @property
    def nbytes(self) -> int:
        return self.moved.nbytes + self.places.nbytes
