"""Real Criteo click logs (Kaggle or Terabyte TSV files), parsed once into a cache of .npy files.

A Criteo row is 40 tab-separated fields: the label (0 or 1), 13 integer features and 26
categorical ids in hexadecimal; any feature may be empty. The Kaggle ``train.txt`` and the
Terabyte ``day_N`` files share this layout; ``format`` only says how a directory is read.

Two cache levels, both under one folder (``--data-cache``, else ``results/data-cache``):

- ``files/<name>-<key>/``: one input file parsed: ``labels.npy`` (int8), ``dense.npy``
  (float32, ``log(1 + max(x, 0))`` as DLRM does, empty -> 0) and ``ids.npy`` (the raw ids,
  ``id % hash_size`` when a hash size is set, -1 for an empty field). The key hashes the
  file's resolved path and the parsing options (hash sizes, the cache version); ``meta.json``
  records the file's fingerprint (size, modification time, SHA-256 of its first, middle and
  last MiB), and an entry whose source no longer matches it is parsed again.
- ``datasets/<key>/``: one scenario's view of those files: which rows train and which
  evaluate, and the ids remapped to table rows. Row 0 of every table is the shared row of
  empty fields, row 1 the shared row of ids seen fewer than ``min_count`` times in the
  training rows (and of evaluation ids never seen in training), rows 2.. the other training
  ids in increasing id order. Evaluation rows are never counted. The key hashes the file
  entries, the evaluation split and ``min_count``: never a run setting.

Each entry is built, described and checked by :mod:`embbench.data.cache` (atomic entries,
manifests, work folders); this module says what an entry holds and which values are sound.
A damaged entry is rebuilt from its source, or refused with :class:`DataCacheError` when its
source is gone. Cells read the arrays memory-mapped.
"""

from __future__ import annotations

import glob
import gzip
import hashlib
import json
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Literal

import numpy as np
import torch

from embbench.data.batch import Batch, SparseFeatures
from embbench.data.cache import DataCacheError, Damaged, cache_entry, check_entry, out_of_range
from embbench.data.presets import NUM_DENSE_FEATURES
from embbench.data.synthetic import Stream, first_sample

__all__ = [
    "CACHE_VERSION", "CriteoDataset", "CriteoSource", "DataCacheError", "DataFormatError", "NUM_TABLES", "ParsedFile",
    "convert_file", "id_counts", "input_files", "prepare_dataset",
]

CACHE_VERSION = 2  # 2: entries carry a manifest; file entries are keyed by path, their fingerprint checked
NUM_TABLES = 26
COLUMNS = ["label", *(f"I{k}" for k in range(1, NUM_DENSE_FEATURES + 1)), *(f"C{k}" for k in range(1, NUM_TABLES + 1))]
MISSING_ROW, RARE_ROW, FIRST_ID_ROW = 0, 1, 2

#: ``on_progress(file name, bytes read, bytes in all, rows parsed)`` while a file converts.
Progress = Callable[[str, int, int, int], None]


class DataFormatError(ValueError):
    """Input that cannot be read as Criteo rows; the message names ``file:line`` and the column."""


# ---------------------------------------------------------------------------------------------
# finding the files


def _natural_key(path: Path) -> list:
    return [int(part) if part.isdigit() else part for part in re.split(r"(\d+)", path.name)]


def input_files(path: str | Path, fmt: Literal["kaggle", "terabyte"] = "kaggle") -> list[Path]:
    """The files a ``data.path`` names, in order: a file, a glob, or a directory.

    A directory holds Terabyte days (``day_0``, ``day_1``, ... plain or ``.gz``, in day
    order) or, for ``kaggle``, ``train.txt`` (or ``train.txt.gz``).
    """
    text = str(path)
    p = Path(text).expanduser()
    if any(c in text for c in "*?["):
        files = sorted((Path(f) for f in glob.glob(os.path.expanduser(text)) if Path(f).is_file()), key=_natural_key)
        if not files:
            raise FileNotFoundError(f"data.path {text}: the pattern matches no file")
        return files
    if p.is_dir():
        days = sorted((f for f in p.iterdir() if f.is_file() and re.fullmatch(r"day_\d+(\.gz)?", f.name)), key=_natural_key)
        if days:
            return days
        if fmt == "kaggle":
            for name in ("train.txt", "train.txt.gz"):
                if (p / name).is_file():
                    return [p / name]
        wanted = "day_0, day_1, ... (plain or .gz)" + (" or train.txt" if fmt == "kaggle" else "")
        raise FileNotFoundError(f"data.path {text}: a directory without {wanted}")
    if not p.is_file():
        raise FileNotFoundError(f"data.path {text}: no such file or directory")
    return [p]


def fingerprint(path: Path, sample: int = 1 << 20) -> str:
    """Size, modification time and the SHA-256 of the first, middle and last MiB of a file.

    Hashing whole files of tens of GB would cost minutes per run; a file edited in place
    changes its modification time, and a file replaced by another differs in its samples.
    """
    st = path.stat()
    h = hashlib.sha256(f"{st.st_size}:{st.st_mtime_ns}".encode())
    with open(path, "rb") as f:
        for start in sorted({0, max(0, st.st_size // 2 - sample // 2), max(0, st.st_size - sample)}):
            f.seek(start)
            h.update(f.read(sample))
    return h.hexdigest()


# ---------------------------------------------------------------------------------------------
# .npy files written as a stream


_HEADER_BYTES = 128


def _npy_header(dtype: np.dtype, shape: tuple[int, ...]) -> bytes:
    """A version 1.0 .npy header padded to a fixed size, so it can be rewritten in place."""
    text = f"{{'descr': {np.dtype(dtype).str!r}, 'fortran_order': False, 'shape': {shape!r}, }}"
    head = b"\x93NUMPY\x01\x00"
    body_len = _HEADER_BYTES - len(head) - 2
    body = text.ljust(body_len - 1).encode() + b"\n"
    assert len(body) == body_len, "shape too long for the fixed header"
    return head + body_len.to_bytes(2, "little") + body


class _NpyWriter:
    """Appends rows to a .npy file whose length is written when it is closed."""

    def __init__(self, path: Path, dtype, row_shape: tuple[int, ...] = ()):
        self.file = open(path, "wb")
        self.dtype, self.row_shape, self.rows = np.dtype(dtype), row_shape, 0
        self.file.write(_npy_header(self.dtype, (0, *row_shape)))

    def append(self, block: np.ndarray) -> None:
        self.file.write(np.ascontiguousarray(block, dtype=self.dtype).tobytes())
        self.rows += len(block)

    def close(self) -> None:
        self.file.seek(0)
        self.file.write(_npy_header(self.dtype, (self.rows, *self.row_shape)))
        self.file.close()


# ---------------------------------------------------------------------------------------------
# parsing


_HEX_DIGITS = b"0123456789abcdefABCDEF"
_TO_NIBBLE = bytes.maketrans(_HEX_DIGITS, bytes([*range(16), *range(10, 16)]))


def _parse_hex(column) -> tuple[np.ndarray, int | None, str]:
    """Hexadecimal ids -> int64, -1 where empty. Returns (ids, first bad row or None, why)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    arr = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    n = len(arr)
    valid = ~np.asarray(arr.is_null().to_numpy(zero_copy_only=False), dtype=bool)
    if not valid.any():
        return np.full(n, -1, dtype=np.int64), None, ""
    lengths = pc.binary_length(arr).fill_null(0).to_numpy(zero_copy_only=False)
    width = int(lengths.max())
    if width > 16:
        return np.empty(0), int(np.argmax(lengths > 16)), "more than 16 hex digits"
    padded = pc.utf8_lpad(arr.fill_null(""), width, "0")
    offsets = np.frombuffer(padded.buffers()[1], dtype=np.int32)[padded.offset : padded.offset + n + 1]
    if np.any(np.diff(offsets) != width):  # a multi-byte character: not hexadecimal
        return np.empty(0), int(np.argmax(np.diff(offsets) != width)), "not a hexadecimal id"
    text = bytes(memoryview(padded.buffers()[2])[offsets[0] : offsets[-1]])
    if text.translate(None, _HEX_DIGITS):  # something is left after deleting every hex digit
        data = np.frombuffer(text, dtype=np.uint8).reshape(n, width)
        bad = ~np.isin(data, np.frombuffer(_HEX_DIGITS, dtype=np.uint8)).all(1)
        return np.empty(0), int(np.argmax(bad)), "not a hexadecimal id"
    nibbles = np.frombuffer(text.translate(_TO_NIBBLE), dtype=np.uint8).reshape(n, width)  # C speed
    values = np.zeros(n, dtype=np.uint64)
    for j in range(width):
        values = (values << np.uint64(4)) | nibbles[:, j]
    too_big = (values >= np.uint64(1 << 63)) & valid
    if too_big.any():
        return np.empty(0), int(np.argmax(too_big)), "an id of 2^63 or more"
    ids = values.astype(np.int64)
    ids[~valid] = -1
    return ids, None, ""


def _open_text(path: Path):
    """The file's byte stream (gzip by its magic bytes, whatever its name) and the raw handle
    whose position measures progress. A file that is not text is an error naming the line."""
    raw = open(path, "rb")
    gz = raw.read(2) == b"\x1f\x8b"
    raw.seek(0)
    try:
        head = gzip.open(path).read(1 << 16) if gz else raw.read(1 << 16)
    except (OSError, EOFError) as e:
        raw.close()
        raise DataFormatError(f"{path}: not a readable gzip file ({e})") from None
    raw.seek(0)
    bad = head.find(b"\0")
    if bad < 0:
        try:
            head.decode("utf-8")
        except UnicodeDecodeError as e:
            bad = e.start if e.start < len(head) - 4 else -1  # a character cut at the sample's end is fine
    if bad >= 0:
        raw.close()
        line = head.count(b"\n", 0, bad) + 1
        raise DataFormatError(f"{path}:{line}: not a text file (binary byte at offset {bad})")
    return (gzip.GzipFile(fileobj=raw) if gz else raw), raw


def _fields_error(path: Path, line: int, text: bytes) -> str | None:
    """What is wrong with one line of text, or None (the slow, exact check behind pyarrow's)."""
    try:
        s = text.decode("utf-8").rstrip("\n")
    except UnicodeDecodeError:
        return f"{path}:{line}: not text (invalid UTF-8)"
    fields = s.split("\t")
    if len(fields) != len(COLUMNS):
        return f"{path}:{line}: {len(fields)} tab-separated columns, expected {len(COLUMNS)}"
    for k, (name, value) in enumerate(zip(COLUMNS, fields)):
        where = f"{path}:{line}: column {k + 1} ({name})"
        if k == 0 and value not in ("0", "1"):
            return f"{where}: label {value!r}, expected 0 or 1"
        if 1 <= k <= NUM_DENSE_FEATURES and value and not re.fullmatch(r"[+-]?\d+", value):
            return f"{where}: {value!r} is not an integer"
        if k > NUM_DENSE_FEATURES and value and not re.fullmatch(r"[0-9a-fA-F]{1,16}", value):
            return f"{where}: {value!r} is not a hexadecimal id"
    return None


def _locate_error(path: Path, first_line: int, fallback: str) -> DataFormatError:
    """Find the first bad line at or after ``first_line`` (pyarrow's own errors lack it)."""
    stream, raw = _open_text(path)
    with raw, stream:
        for line, text in enumerate(stream, start=1):
            if line >= first_line:
                message = _fields_error(path, line, text)
                if message:
                    return DataFormatError(message)
    return DataFormatError(f"{path}: {fallback}")


@dataclass
class ParsedFile:
    """One converted input file in the cache (arrays opened memory-mapped on demand)."""

    source: str
    directory: Path
    rows: int
    fingerprint: str

    def array(self, name: str) -> np.ndarray:
        return np.load(self.directory / f"{name}.npy", mmap_mode="r")


def _file_key(path: Path, hash_sizes: list[int] | None) -> str:
    options = json.dumps({"version": CACHE_VERSION, "path": str(path), "hash_size": hash_sizes}, sort_keys=True)
    return hashlib.sha256(options.encode()).hexdigest()[:16]


def _file_layout(meta: dict) -> dict[str, tuple[np.dtype, tuple]]:
    rows = meta["rows"]
    return {"labels.npy": (np.int8, (rows,)), "dense.npy": (np.float32, (rows, NUM_DENSE_FEATURES)),
            "ids.npy": (np.dtype(meta["id_dtype"]), (rows, NUM_TABLES))}


def _check_file_values(directory: Path, meta: dict, full: bool) -> None:
    """Labels 0/1 always (one byte a row); ids within ``[-1, hash size)`` and dense values
    finite and >= 0 when ``full``."""
    bad = out_of_range(np.load(directory / "labels.npy", mmap_mode="r"), 0, 2)
    if bad:
        raise Damaged(f"labels.npy: row {bad[0]} holds a label other than 0 or 1")
    if not full:
        return
    high = np.array(meta["hash_size"]) if meta["hash_size"] else np.iinfo(np.int64).max
    bad = out_of_range(np.load(directory / "ids.npy", mmap_mode="r"), -1, high)
    if bad:
        raise Damaged(f"ids.npy: row {bad[0]}, table {bad[1]}: an id outside [-1, hash size)")
    bad = out_of_range(np.load(directory / "dense.npy", mmap_mode="r"), 0, np.inf)
    if bad:
        raise Damaged(f"dense.npy: row {bad[0]}, feature {bad[1]}: not a finite log(1 + x) >= 0")


def convert_file(path: Path, cache_dir: Path, hash_sizes: list[int] | None = None,
                 on_progress: Progress | None = None, block_size: int = 1 << 24, verify: bool = False) -> ParsedFile:
    """Parse one Criteo TSV file (plain or gzip) into the cache, or find it there (checked).

    A cached entry whose file changed (fingerprint) or that is damaged is parsed again; when
    the file is gone, an intact entry is used and a damaged one refused (:class:`DataCacheError`).
    ``verify`` hashes the entry whatever its size.
    """
    path = Path(path).expanduser()
    final = cache_dir / "files" / f"{re.sub(r'[^A-Za-z0-9_.-]', '_', path.name)}-{_file_key(path.resolve(), hash_sizes)}"
    present = path.is_file()
    if not present and not final.exists():
        raise FileNotFoundError(f"{path}: no such file (and no data cache entry parsed from it in {cache_dir})")
    current = fingerprint(path) if present else None

    def fill(tmp: Path) -> None:
        rows, id_dtype = _parse(path, tmp, hash_sizes, on_progress, block_size)
        (tmp / "meta.json").write_text(json.dumps({"source": str(path), "fingerprint": current, "rows": rows,
                                                   "id_dtype": id_dtype.str, "hash_size": hash_sizes,
                                                   "version": CACHE_VERSION}))

    def check(directory: Path, full: bool) -> dict:
        meta = check_entry(directory, _file_layout, _check_file_values, full)
        if current is not None and meta["fingerprint"] != current:
            raise Damaged(f"{path} changed since it was parsed (size, modification time or content)")
        return meta

    meta = cache_entry(final, fill, check, verify, source=path)
    return ParsedFile(meta["source"], final, meta["rows"], meta["fingerprint"])


def _parse(path: Path, out: Path, hash_sizes: list[int] | None, on_progress: Progress | None,
           block_size: int) -> tuple[int, np.dtype]:
    """Parse ``path`` into ``out``; the rows and the dtype of the ids."""
    import pyarrow as pa
    import pyarrow.csv as pacsv

    types = {name: pa.int64() for name in COLUMNS[: 1 + NUM_DENSE_FEATURES]}
    types.update({name: pa.string() for name in COLUMNS[1 + NUM_DENSE_FEATURES :]})
    id_dtype = np.int32 if hash_sizes and max(hash_sizes) <= 2**31 else np.int64
    writers = {
        "labels": _NpyWriter(out / "labels.npy", np.int8),
        "dense": _NpyWriter(out / "dense.npy", np.float32, (NUM_DENSE_FEATURES,)),
        "ids": _NpyWriter(out / "ids.npy", id_dtype, (NUM_TABLES,)),
    }
    total_bytes = path.stat().st_size
    stream, raw = _open_text(path)
    rows = 0
    try:
        reader = pacsv.open_csv(
            stream,
            read_options=pacsv.ReadOptions(column_names=COLUMNS, block_size=block_size),
            parse_options=pacsv.ParseOptions(delimiter="\t", quote_char=False, ignore_empty_lines=False),
            convert_options=pacsv.ConvertOptions(column_types=types, strings_can_be_null=True),
        )
        while True:
            try:
                batch = reader.read_next_batch()
            except StopIteration:
                break
            except pa.ArrowInvalid as e:
                raise _locate_error(path, rows + 1, str(e)) from None
            _convert_batch(batch, path, rows, hash_sizes, writers)
            rows += batch.num_rows
            if on_progress:
                on_progress(path.name, raw.tell(), total_bytes, rows)
    except pa.ArrowInvalid as e:  # raised while opening: the first block is bad
        raise _locate_error(path, rows + 1, str(e)) from None
    finally:
        stream.close()
        raw.close()
        for w in writers.values():
            w.close()
    if rows == 0:
        raise DataFormatError(f"{path}: no rows")
    return rows, np.dtype(id_dtype)


def _convert_batch(batch, path: Path, rows_before: int, hash_sizes: list[int] | None, writers: dict) -> None:
    def fail(row: int, column: int, why: str) -> DataFormatError:
        return DataFormatError(f"{path}:{rows_before + row + 1}: column {column + 1} ({COLUMNS[column]}): {why}")

    label_col = batch.column(0)
    if label_col.null_count:  # an empty label, or an empty line (pyarrow reads it as all empty)
        row = int(np.argmax(label_col.is_null().to_numpy(zero_copy_only=False)))
        raise _locate_error(path, rows_before + row + 1, "empty label")
    labels = label_col.to_numpy()
    bad = (labels != 0) & (labels != 1)
    if bad.any():
        row = int(np.argmax(bad))
        raise fail(row, 0, f"label {int(labels[row])}, expected 0 or 1")
    dense = np.empty((batch.num_rows, NUM_DENSE_FEATURES), dtype=np.float32)
    for k in range(NUM_DENSE_FEATURES):
        x = batch.column(1 + k).fill_null(0).to_numpy()
        dense[:, k] = np.log1p(np.maximum(x, 0))
    ids = np.empty((batch.num_rows, NUM_TABLES), dtype=writers["ids"].dtype)
    for t in range(NUM_TABLES):
        column = 1 + NUM_DENSE_FEATURES + t
        values, bad_row, why = _parse_hex(batch.column(column))
        if bad_row is not None:
            raise fail(bad_row, column, f"{why}: {batch.column(column)[bad_row].as_py()!r}")
        if hash_sizes:
            values = np.where(values >= 0, values % hash_sizes[t], -1)
        ids[:, t] = values
    writers["labels"].append(labels.astype(np.int8))
    writers["dense"].append(dense)
    writers["ids"].append(ids)


# ---------------------------------------------------------------------------------------------
# a scenario's dataset: training and evaluation rows, ids remapped to table rows

_CHUNK_ROWS = 1 << 22


@dataclass
class _Segment:
    """Rows ``[lo, hi)`` of one converted file, with its remapped ids."""

    file: ParsedFile
    ids_path: Path
    lo: int
    hi: int


@dataclass
class CriteoDataset:
    """A prepared scenario dataset: table cardinalities and the rows of each stream.

    Attributes:
        cardinalities: rows of each table (training ids that survive, plus the missing and
            rare rows).
        alphas: the Zipf exponent fitted to each table's training counts.
        train, eval: the segments of each stream, in order.
    """

    directory: Path
    cardinalities: list[int]
    alphas: list[float]
    train: list[_Segment]
    eval: list[_Segment]

    def rows(self, stream: Stream) -> int:
        return sum(s.hi - s.lo for s in (self.train if stream == Stream.TRAIN else self.eval))


def _split(files: list[ParsedFile], eval_fraction: float | None) -> tuple[list[tuple], list[tuple]]:
    """(file, lo, hi) of the training rows and of the evaluation rows: the last fraction."""
    total = sum(f.rows for f in files)
    n_eval = 0 if eval_fraction is None else max(1, round(total * eval_fraction))
    if n_eval >= total:
        raise DataFormatError(f"data.eval {eval_fraction}: leaves no training rows of {total}")
    train, ev, start = [], [], 0
    for f in files:
        cut = min(max(total - n_eval - start, 0), f.rows)
        if cut:
            train.append((f, 0, cut))
        if cut < f.rows:
            ev.append((f, cut, f.rows))
        start += f.rows
    return train, ev


def id_counts(train: list[tuple]) -> list[tuple[np.ndarray, np.ndarray]]:
    """Per table, the distinct ids of the rows ``(file, lo, hi)`` and how often each occurs."""
    parts: list[list[tuple[np.ndarray, np.ndarray]]] = [[] for _ in range(NUM_TABLES)]
    for f, lo, hi in train:
        ids = f.array("ids")
        for a in range(lo, hi, _CHUNK_ROWS):
            block = np.asarray(ids[a : min(hi, a + _CHUNK_ROWS)])
            for t in range(NUM_TABLES):
                col = block[:, t]
                parts[t].append(np.unique(col[col >= 0], return_counts=True))
    out = []
    for t in range(NUM_TABLES):
        values = np.concatenate([u for u, _ in parts[t]]) if parts[t] else np.empty(0, np.int64)
        counts = np.concatenate([c for _, c in parts[t]]) if parts[t] else np.empty(0, np.int64)
        unique, inverse = np.unique(values, return_inverse=True)
        out.append((unique, np.bincount(inverse, weights=counts, minlength=len(unique)).astype(np.int64)))
    return out


def _remap(ids: np.ndarray, vocabularies: list[np.ndarray]) -> np.ndarray:
    """Raw (hashed) ids -> table rows: 0 empty, 1 rare or unseen, 2 + index in the vocabulary."""
    out = np.empty(ids.shape, dtype=np.int32)
    for t, vocab in enumerate(vocabularies):
        col = ids[:, t]
        pos = np.searchsorted(vocab, col)
        found = vocab[np.minimum(pos, len(vocab) - 1)] == col if len(vocab) else np.zeros(len(col), bool)
        out[:, t] = np.where(col < 0, MISSING_ROW, np.where(found, pos + FIRST_ID_ROW, RARE_ROW))
    return out


def _dataset_layout(meta: dict) -> dict[str, tuple[np.dtype, tuple]]:
    return {f"ids-{name}.npy": (np.int32, (rows, NUM_TABLES)) for name, rows in meta["rows"].items()}


def _dataset_values(directory: Path, meta: dict, full: bool) -> None:
    """Every remapped id within its table, ``[0, cardinality)``, when ``full``."""
    if not full:
        return
    for name in meta["rows"]:
        bad = out_of_range(np.load(directory / f"ids-{name}.npy", mmap_mode="r"), 0, np.array(meta["cardinalities"]))
        if bad:
            raise Damaged(f"ids-{name}.npy: row {bad[0]}, table {bad[1]}: a row outside the table")


def prepare_dataset(files: list[Path], cache_dir: Path, eval_spec: float | list[Path] | None, hash_sizes: list[int] | None,
                    min_count: int, on_progress: Progress | None = None, verify: bool = False) -> CriteoDataset:
    """Convert the files (if not cached) and build the scenario's view of them (if not cached).

    Args:
        files: the training files (with the evaluation rows too when ``eval_spec`` is a fraction).
        cache_dir: the cache folder.
        eval_spec: the fraction of the rows, at the end, that evaluate; or evaluation files.
        hash_sizes: one modulus per table, or None.
        min_count: training ids seen fewer times share one row per table.
        on_progress: called while files convert.
        verify: hash every entry whatever its size (smaller ones are hashed anyway).
    """
    from embbench.data.stats import fit_zipf_alpha

    parsed = [convert_file(f, cache_dir, hash_sizes, on_progress, verify=verify) for f in files]
    eval_files = ([convert_file(f, cache_dir, hash_sizes, on_progress, verify=verify) for f in eval_spec]
                  if isinstance(eval_spec, list) else [])
    fraction = eval_spec if isinstance(eval_spec, float) else None
    train, ev = _split(parsed, fraction)
    ev += [(f, 0, f.rows) for f in eval_files]
    # The key follows the data only: the file entries, the split and min_count.
    key = json.dumps({"version": CACHE_VERSION, "train": [f.directory.name for f in parsed], "eval": fraction,
                      "eval_files": [f.directory.name for f in eval_files], "min_count": min_count})
    final = cache_dir / "datasets" / hashlib.sha256(key.encode()).hexdigest()[:16]
    # What it is built from: an entry built from other versions of the files is rebuilt.
    spec = {"version": CACHE_VERSION, "train": [[f.directory.name, f.fingerprint, lo, hi] for f, lo, hi in train],
            "eval": [[f.directory.name, f.fingerprint, lo, hi] for f, lo, hi in ev], "min_count": min_count}
    inputs = {f.directory.name: f for f, _, _ in train + ev}

    def fill(tmp: Path) -> None:
        started = time.perf_counter()
        counts = id_counts(train)
        vocabularies = [unique[count >= min_count] for unique, count in counts]
        for name, f in inputs.items():
            ids = f.array("ids")
            out = _NpyWriter(tmp / f"ids-{name}.npy", np.int32, (NUM_TABLES,))
            for a in range(0, f.rows, _CHUNK_ROWS):
                out.append(_remap(np.asarray(ids[a : a + _CHUNK_ROWS]), vocabularies))
            out.close()
        meta = {"spec": spec, "rows": {name: f.rows for name, f in inputs.items()},
                "cardinalities": [len(v) + FIRST_ID_ROW for v in vocabularies],
                "alphas": [fit_zipf_alpha(count) for _, count in counts], "seconds": time.perf_counter() - started}
        (tmp / "meta.json").write_text(json.dumps(meta))

    def check(directory: Path, full: bool) -> dict:
        meta = check_entry(directory, _dataset_layout, _dataset_values, full)
        if meta["spec"] != spec:
            raise Damaged("meta.json: built from other versions of its input files")
        return meta

    meta = cache_entry(final, fill, check, verify)

    def segments(parts: list[tuple]) -> list[_Segment]:
        return [_Segment(f, final / f"ids-{f.directory.name}.npy", lo, hi) for f, lo, hi in parts]

    return CriteoDataset(final, meta["cardinalities"], meta["alphas"], segments(train), segments(ev))


class CriteoSource:
    """Batches of a prepared dataset, addressed by ``(stream, index)`` like the synthetic data.

    Batch ``i`` of a stream is its rows ``[i * B, (i + 1) * B)``: the training rows taken
    cyclically (whether a run may read past their end, ``epochs``, is checked before it
    starts), the held-out rows once (:func:`embbench.data.synthetic.first_sample`).
    """

    def __init__(self, dataset: CriteoDataset, device: torch.device | str = "cpu"):
        self.dataset = dataset
        self.device = torch.device(device)
        self._streams = {}
        for stream, segments in ((Stream.TRAIN, dataset.train), (Stream.EVAL, dataset.eval)):
            arrays = [(s.file.array("labels"), s.file.array("dense"), np.load(s.ids_path, mmap_mode="r"), s.lo, s.hi)
                      for s in segments]
            self._streams[stream] = (arrays, np.cumsum([0] + [hi - lo for *_, lo, hi in arrays]))

    def batch(self, stream: Stream, index: int, batch_size: int) -> Batch:
        arrays, starts = self._streams[Stream(stream)]
        total = int(starts[-1])
        if total == 0:
            raise DataFormatError(f"the {Stream(stream).name.lower()} stream has no rows")
        labels, dense, ids = [], [], []
        position, left = first_sample(stream, index, batch_size, total), batch_size
        while left:
            seg = int(np.searchsorted(starts, position, side="right")) - 1
            lab, den, idx, lo, _ = arrays[seg]
            a = lo + position - int(starts[seg])
            take = min(left, int(starts[seg + 1]) - position)
            labels.append(lab[a : a + take])
            dense.append(den[a : a + take])
            ids.append(idx[a : a + take])
            left -= take
            position = (position + take) % total
        rows = np.concatenate(ids)
        sparse = SparseFeatures(
            torch.from_numpy(np.ascontiguousarray(rows.T)).reshape(-1).to(self.device, torch.long),
            torch.ones(NUM_TABLES * batch_size, dtype=torch.long, device=self.device), NUM_TABLES,
        )
        return Batch(torch.from_numpy(np.concatenate(dense)).to(self.device),
                     sparse, torch.from_numpy(np.concatenate(labels).astype(np.float32)).to(self.device))
