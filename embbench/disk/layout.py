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

__all__ = ["PAGE", "PageLayout"]

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
