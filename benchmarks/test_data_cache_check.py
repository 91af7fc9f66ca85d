"""Cost of checking a prepared Criteo cache entry when it is opened.

Every open runs the cheap checks (manifest, sizes, dtypes, shapes, labels 0/1); the full
check adds the value ranges and the xxh3-128 hash of every file: on every open for entries
under 1 GiB, on ``data prepare`` and ``run --verify-data`` for larger ones. The entries
here have the Criteo Kaggle shape (13 float32 dense, 26 int64 raw ids, int8 label, 26
int32 remapped ids per row) at ``EMBBENCH_BENCH_ROWS`` rows (default 4,584,062: a tenth of
the 45,840,617 Kaggle rows; the cost is linear in the bytes):

    .venv/bin/python -m pytest benchmarks/test_data_cache_check.py --benchmark-columns=median,min,max

Read from the page cache; a cold cache adds the disk's read time. Not part of the test
suite: speed is measured here, never asserted.
"""

import json
import os
from pathlib import Path

import numpy as np
import pytest

from embbench.data import cache, criteo

ROWS = int(os.environ.get("EMBBENCH_BENCH_ROWS", 4_584_062))
CHUNK = 1 << 20


def _write(path: Path, dtype, row_shape: tuple, value) -> None:
    array = np.lib.format.open_memmap(path, mode="w+", dtype=dtype, shape=(ROWS, *row_shape))
    for a in range(0, ROWS, CHUNK):
        rows = np.arange(a, min(ROWS, a + CHUNK))
        array[a : a + len(rows)] = value(rows)
    array.flush()


@pytest.fixture(scope="module")
def entries(tmp_path_factory):
    """A file entry and a dataset entry of Kaggle shape, with their manifests."""
    root = tmp_path_factory.mktemp("entries")
    files, dataset = root / "file", root / "dataset"
    files.mkdir(), dataset.mkdir()
    tables = np.arange(criteo.NUM_TABLES)
    _write(files / "labels.npy", np.int8, (), lambda r: r % 2)
    _write(files / "dense.npy", np.float32, (13,), lambda r: np.log1p(r % 97)[:, None].repeat(13, 1))
    _write(files / "ids.npy", np.int64, (26,), lambda r: (r[:, None] * 2654435761 + tables) % 1_000_003)
    (files / "meta.json").write_text(json.dumps({"rows": ROWS, "id_dtype": "<i8", "hash_size": None}))
    _write(dataset / "ids-x.npy", np.int32, (26,), lambda r: (r[:, None] * 40503 + tables) % 100_000)
    (dataset / "meta.json").write_text(json.dumps({"rows": {"x": ROWS}, "cardinalities": [100_000] * 26}))
    for directory in (files, dataset):
        cache.write_manifest(directory)
    return files, dataset


def _check(entries, full: bool) -> None:
    files, dataset = entries
    cache.check_entry(files, criteo._file_layout, criteo._check_file_values, full)
    cache.check_entry(dataset, criteo._dataset_layout, criteo._dataset_values, full)


@pytest.mark.parametrize("full", [False, True], ids=["cheap", "full"])
def test_check_entries(benchmark, entries, full, monkeypatch):
    monkeypatch.setattr(cache, "FULL_CHECK_BYTES", 0)  # however small: cheap unless asked
    gigabytes = sum(p.stat().st_size for d in entries for p in d.iterdir()) / 1e9
    _check(entries, full)  # warm the page cache
    benchmark.extra_info.update(rows=ROWS, gigabytes=gigabytes)
    benchmark.pedantic(_check, (entries, full), rounds=3)


def test_hash_only(benchmark, entries):
    files, dataset = entries
    paths = [p for d in entries for p in d.iterdir() if p.suffix == ".npy"]
    benchmark.extra_info.update(gigabytes=sum(p.stat().st_size for p in paths) / 1e9)
    benchmark.pedantic(lambda: [cache.digest(p) for p in paths], rounds=3)
