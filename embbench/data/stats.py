"""Id-frequency statistics: how skewed a table's accesses are."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

__all__ = ["TableStats", "fit_zipf_alpha", "table_stats"]


def fit_zipf_alpha(counts: np.ndarray, min_count: int = 2) -> float:
    """The Zipf exponent of a rank-frequency curve: minus the least-squares slope of
    log(count) against log(rank), over the ids seen at least ``min_count`` times (the ids
    seen once flatten the tail whatever the law). 0 when fewer than 3 such ids exist."""
    c = np.sort(np.asarray(counts, dtype=np.float64))[::-1]
    c = c[c >= min_count]
    if len(c) < 3:
        return 0.0
    slope = np.polyfit(np.log(np.arange(1, len(c) + 1)), np.log(c), 1)[0]
    return float(-slope)


@dataclass
class TableStats:
    """One table's id stream.

    Attributes:
        accesses: ids looked up (empty fields not counted).
        distinct: distinct ids.
        empty: empty fields (Criteo files only).
        top1_share: the share of accesses that go to the most frequent 1% of the distinct ids.
        singletons: ids seen exactly once.
        alpha: the fitted Zipf exponent (:func:`fit_zipf_alpha`).
    """

    accesses: int
    distinct: int
    empty: int
    top1_share: float
    singletons: int
    alpha: float


def table_stats(counts: np.ndarray, empty: int = 0) -> TableStats:
    """Statistics of one table from the access count of each distinct id."""
    c = np.sort(np.asarray(counts, dtype=np.int64))[::-1]
    total = int(c.sum())
    top = max(1, len(c) // 100)
    return TableStats(
        accesses=total, distinct=len(c), empty=empty,
        top1_share=float(c[:top].sum() / total) if total else 0.0,
        singletons=int((c == 1).sum()), alpha=fit_zipf_alpha(c),
    )
