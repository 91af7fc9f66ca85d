"""Criteo-shaped data: presets, the synthetic generator, and the batch layout."""

from embbench.data.batch import Batch, SparseFeatures
from embbench.data.presets import NUM_DENSE_FEATURES, PRESETS, TableSpec, make_tables
from embbench.data.synthetic import Stream, SyntheticCriteo, ZipfSampler

__all__ = [
    "Batch", "SparseFeatures", "NUM_DENSE_FEATURES", "PRESETS", "TableSpec", "make_tables",
    "Stream", "SyntheticCriteo", "ZipfSampler",
]
