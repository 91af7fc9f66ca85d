"""Criteo-shaped table presets with the real cardinalities."""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["PRESETS", "RENAMED_PRESETS", "TableSpec", "NUM_DENSE_FEATURES", "make_tables", "scaled_rows"]

NUM_DENSE_FEATURES = 13

# Criteo Display Advertising Challenge (Kaggle), 7 days: 26 tables, 33,762,577 rows.
_CRITEO_KAGGLE = [
    1460, 583, 10131227, 2202608, 305, 24, 12517, 633, 3, 93145, 5683, 8351593, 3194,
    27, 14992, 5461306, 10, 5652, 2173, 4, 7046547, 18, 15, 286181, 105, 142572,
]
# Criteo Terabyte, 24 days, ids seen fewer than 3 times dropped (torchrec's DLRM example
# vocabulary, FREQUENCY_THRESHOLD = 3): 26 tables, 177,944,275 rows. The raw 24 days hold
# 882.8M distinct ids; MLPerf DLRM-DCNv2 caps each table at 40M instead (204.2M rows, below).
_CRITEO_1TB_FREQ3 = [
    45833188, 36746, 17245, 7413, 20243, 3, 7114, 1441, 62, 29275261, 1572176, 345138, 10,
    2209, 11267, 128, 4, 974, 14, 48937457, 11316796, 40094537, 452104, 12606, 104, 35,
]
# MLPerf DLRM-DCNv2: Criteo Terabyte hashed to at most 40M rows per table, multi-hot
# (204,184,588 rows), with the reference's per-table bag sizes.
_MLPERF_DCNV2 = [
    40000000, 39060, 17295, 7424, 20265, 3, 7122, 1543, 63, 40000000, 3067956, 405282, 10,
    2209, 11938, 155, 4, 976, 14, 40000000, 40000000, 40000000, 590152, 12973, 108, 36,
]
_MLPERF_DCNV2_BAGS = [3, 2, 1, 2, 6, 1, 1, 1, 1, 7, 3, 8, 1, 6, 9, 5, 1, 1, 1, 12, 100, 27, 10, 3, 1, 1]

PRESETS: dict[str, tuple[list[int], list[int]]] = {
    "criteo_kaggle": (_CRITEO_KAGGLE, [1] * 26),
    "criteo_1tb_freq3": (_CRITEO_1TB_FREQ3, [1] * 26),
    "mlperf_dcnv2": (_MLPERF_DCNV2, _MLPERF_DCNV2_BAGS),
}

#: Old preset names that said less than the truth, and what to write instead.
RENAMED_PRESETS = {
    "criteo_1tb": "criteo_1tb_freq3 (the 177.9M-row vocabulary of Criteo-1TB with ids seen fewer than 3 times "
                  "dropped; raw Criteo-1TB has 882.8M ids; for the 40M-capped MLPerf vocabulary use mlperf_dcnv2)",
}


@dataclass(frozen=True)
class TableSpec:
    """One embedding table.

    Attributes:
        name: the feature's name (``t0`` .. ``t25``); torchrec keys use it too.
        num_rows: rows after scaling.
        dim: embedding dimension.
        bag_size: ids per sample (1 is one-hot).
        alpha: Zipf exponent of the ids' popularity (for real data: fitted to the training counts).
    """

    name: str
    num_rows: int
    dim: int
    bag_size: int
    alpha: float

    @property
    def num_bytes(self) -> int:
        return self.num_rows * self.dim * 4


def scaled_rows(rows: int, scale: float, min_rows: int = 1) -> int:
    """A table of ``rows`` rows at ``scale``: at least ``min_rows`` (and one), at most ``rows``.

    The floor keeps a scaled-down table from degenerating into a few rows that every batch
    hits; a table that is small in the full data (Criteo's 3-row feature) keeps its own size."""
    return min(rows, max(1, min_rows, int(rows * scale)))


def make_tables(preset: str, dim: int, scale: float = 1.0, alpha: float | list[float] = 1.15,
                min_rows: int = 1) -> list[TableSpec]:
    """The preset's tables, with cardinalities multiplied by ``scale`` (:func:`scaled_rows`).

    ``alpha`` is one Zipf exponent for every table or a list with one per table.
    """
    rows, bags = PRESETS[preset]
    alphas = alpha if isinstance(alpha, list) else [alpha] * len(rows)
    if len(alphas) != len(rows):
        raise ValueError(f"alpha: {len(alphas)} values for the {len(rows)} tables of preset {preset}")
    return [
        TableSpec(f"t{i}", scaled_rows(n, scale, min_rows), dim, bag, a)
        for i, (n, bag, a) in enumerate(zip(rows, bags, alphas))
    ]
