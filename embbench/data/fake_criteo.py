"""Small seeded files in the Criteo TSV layout, for tests and for measuring the parser.

The ids follow a Zipf law per table, a share of the fields are empty, a few integer
features are negative (as in the real data), and the label depends on two tables' ids and
one dense feature, so a model can learn it.
"""

from __future__ import annotations

import gzip
import shutil
from pathlib import Path

import numpy as np

from embbench.data.presets import NUM_DENSE_FEATURES

__all__ = ["write_fake_criteo"]


def write_fake_criteo(path: str | Path, rows: int, seed: int = 0, cardinality: int = 200, missing: float = 0.05,
                      gz: bool = False) -> Path:
    """Write ``rows`` Criteo-format lines to ``path`` (gzip-compressed when ``gz``)."""
    import pyarrow as pa
    import pyarrow.csv as pacsv

    rng = np.random.default_rng(seed)
    columns: dict[str, pa.Array] = {}
    effect = np.zeros(rows)
    dense0 = None
    for k in range(NUM_DENSE_FEATURES):
        x = rng.geometric(0.05, rows) - 2  # mostly positive, some -1 (Criteo has a few negatives)
        empty = rng.random(rows) < missing
        columns[f"I{k + 1}"] = pa.array(np.where(empty, None, x).tolist(), type=pa.int64()).cast(pa.string())
        if k == 0:
            dense0 = np.log1p(np.maximum(np.where(empty, 0, x), 0))
    for t in range(26):
        n = max(2, int(cardinality * (1 + t % 5)))
        vocabulary = pa.array([f"{v:08x}" for v in rng.choice(2**32, size=n, replace=False)])
        ranks = np.minimum(rng.zipf(1.2, rows), n) - 1
        empty = rng.random(rows) < missing
        indices = pa.array(ranks, mask=empty)
        columns[f"C{t + 1}"] = vocabulary.take(indices)
        if t < 2:
            effect += np.where(empty, 0, np.sin(ranks * 12.9898 + t) > 0) * 1.5
    logit = -3.5 + effect + 0.4 * dense0
    labels = (rng.random(rows) < 1 / (1 + np.exp(-logit))).astype(np.int64)
    table = pa.table({"label": pa.array(labels).cast(pa.string()),
                      **{f"I{k + 1}": columns[f"I{k + 1}"] for k in range(NUM_DENSE_FEATURES)},
                      **{f"C{t + 1}": columns[f"C{t + 1}"] for t in range(26)}})
    path = Path(path)
    plain = path.with_name(path.name + ".plain") if gz else path
    pacsv.write_csv(table, plain, pacsv.WriteOptions(include_header=False, delimiter="\t", quoting_style="none"))
    if gz:
        with open(plain, "rb") as src, gzip.open(path, "wb", compresslevel=1) as dst:
            shutil.copyfileobj(src, dst)
        plain.unlink()
    return path
