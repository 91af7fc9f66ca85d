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
#: pages) or ``table_frequency`` (in each table's own range, every row the profile saw first,
#: most used first: the rows of a table that were seen share pages, away from its unseen ones).
ROW_ORDERS = ("id", "frequency", "table_frequency")


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
    def _ordered(cls, rows: int, profiled: list[np.ndarray], starts: list[int], min_batches: int, name: str):
        if not profiled:
            return cls(rows, name)
        seen, counts = np.unique(np.concatenate([np.unique(np.asarray(b, np.int64)) for b in profiled]),
                                 return_counts=True)
        keep = counts >= min_batches
        seen, counts = seen[keep], counts[keep]
        moved, places = [], []
        for lo, hi in zip(starts, [*starts[1:], rows]):
            a, b = np.searchsorted(seen, [lo, hi])
            hot = seen[a:b][np.lexsort((seen[a:b], -counts[a:b]))]  # most used first, ties by id
            k = len(hot)
            displaced = np.setdiff1d(np.arange(lo, lo + k, dtype=np.int64), hot, assume_unique=True)  # in the hot places
            vacated = np.sort(hot[hot >= lo + k])  # the places the hot rows leave
            moved += [hot, displaced]
            places += [np.arange(lo, lo + k, dtype=np.int64), vacated]
        moved, places = np.concatenate(moved), np.concatenate(places)
        stays = moved == places
        order = np.argsort(moved[~stays], kind="stable")
        return cls(rows, name, moved[~stays][order], places[~stays][order])

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
