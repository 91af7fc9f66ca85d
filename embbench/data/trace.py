"""Id-stream traces: record the ids a scenario produces, replay them as a data source.

A trace is an uncompressed ``.npz`` with, for each stream ``s`` in ``train`` and ``eval``:

- ``s_lengths``: int32 ``[samples, tables]``, the bag length of each sample in each table;
- ``s_values``: int64, the ids, sample-major (sample 0's ids of table 0, of table 1, ...);
- optionally ``s_labels`` (float32 ``[samples]``) and ``s_dense`` (float32 ``[samples, 13]``);

plus ``num_rows`` (int64 ``[tables]``, each table's cardinality) and ``format``
(``embbench-trace-1``). Sample-major storage lets a replay cut batches of any size.

When a trace carries no labels or dense features, the replay synthesises them
deterministically from the seed: dense features are standard normal, and labels come from
a hidden teacher over the recorded ids (a fixed pseudo-random effect per id, as in the
synthetic data), so a model still has something to learn. The throughput and cache
behaviour of a placement depend on the ids only.
"""

from __future__ import annotations

import math
import sys
import zipfile
import zlib
from pathlib import Path

import numpy as np
import torch

from embbench.data.batch import Batch, SparseFeatures
from embbench.data.presets import NUM_DENSE_FEATURES
from embbench.data.synthetic import Stream, _hash_effect, _mix, first_sample
from embbench.inputs import user_file
from embbench.outputs import atomic_write

__all__ = ["TRACE_FORMAT", "Trace", "TraceError", "TraceSource", "bags_in_order", "is_trace", "record_trace"]

TRACE_FORMAT = "embbench-trace-1"
_STREAMS = {Stream.TRAIN: "train", Stream.EVAL: "eval"}


class TraceError(ValueError):
    """A trace file that cannot be replayed; the message names the file and the key."""


def bags_in_order(values: torch.Tensor, lengths: torch.Tensor, order: torch.Tensor) -> torch.Tensor:
    """The ids of the bags ``order`` (indices into ``lengths``), concatenated in that order."""
    starts = torch.cumsum(lengths, 0) - lengths
    picked = lengths[order]
    total = int(picked.sum())
    first = torch.repeat_interleave(starts[order], picked, output_size=total)
    within = torch.arange(total) - torch.repeat_interleave(torch.cumsum(picked, 0) - picked, picked, output_size=total)
    return values[first + within]


def _sample_major(batch: Batch) -> tuple[np.ndarray, np.ndarray]:
    """A batch's (table-major) bags as ``[B, T]`` lengths and sample-major values."""
    sparse = batch.sparse.to("cpu")
    t, b = sparse.num_tables, sparse.batch_size
    order = (torch.arange(t).unsqueeze(0) * b + torch.arange(b).unsqueeze(1)).reshape(-1)  # (sample, table)
    values = bags_in_order(sparse.values.long(), sparse.lengths.long(), order)
    return sparse.lengths.view(t, b).T.numpy().astype(np.int32), values.numpy().astype(np.int64)


def record_trace(source, num_rows: list[int], batch_size: int, train_batches: int, eval_batches: int,
                 out: Path, features: bool = False) -> dict[str, int]:
    """Write the first batches of each stream of ``source`` to ``out`` (a .npz trace).

    Returns the samples written per stream.
    """
    arrays: dict[str, np.ndarray] = {"format": np.array(TRACE_FORMAT), "num_rows": np.asarray(num_rows, dtype=np.int64)}
    written = {}
    for stream, count in ((Stream.TRAIN, train_batches), (Stream.EVAL, eval_batches)):
        name = _STREAMS[stream]
        lengths, values, labels, dense = [], [], [], []
        for i in range(count):
            batch = source.batch(stream, i, batch_size)
            ln, vs = _sample_major(batch)
            lengths.append(ln)
            values.append(vs)
            if features:
                labels.append(batch.labels.cpu().numpy().astype(np.float32))
                dense.append(batch.dense.cpu().numpy().astype(np.float32))
        arrays[f"{name}_lengths"] = np.concatenate(lengths) if lengths else np.zeros((0, len(num_rows)), np.int32)
        arrays[f"{name}_values"] = np.concatenate(values) if values else np.zeros(0, np.int64)
        if features and count:
            arrays[f"{name}_labels"] = np.concatenate(labels)
            arrays[f"{name}_dense"] = np.concatenate(dense)
        written[name] = count * batch_size
    out.parent.mkdir(parents=True, exist_ok=True)
    atomic_write(out, lambda f: np.savez(f, **arrays), "the trace")  # a full disk leaves no half trace
    return written


def is_trace(path: Path) -> bool:
    """Whether ``path`` is an embbench trace (its ``format`` array says so), damaged or not otherwise."""
    try:
        with np.load(path, allow_pickle=False) as data:
            return str(data["format"]) == TRACE_FORMAT
    except Exception:  # not an .npz, no format array, truncated: not a trace this command made
        return False


class Trace:
    """A trace file, loaded and checked (every id inside its table, shapes consistent)."""

    def __init__(self, path: str | Path):
        self.path = Path(path).expanduser()
        arrays = self._read()
        fmt = str(arrays.get("format", ""))
        if fmt != TRACE_FORMAT:
            raise TraceError(f"{self.path}: format {fmt!r}, expected {TRACE_FORMAT!r}")
        self.num_rows = self._integers("num_rows", self._need(arrays, "num_rows"))
        self.streams: dict[Stream, dict[str, np.ndarray]] = {}
        for stream, name in _STREAMS.items():
            lengths = self._integers(f"{name}_lengths", self._need(arrays, f"{name}_lengths"))
            values = self._integers(f"{name}_values", self._need(arrays, f"{name}_values"))
            if lengths.ndim != 2 or lengths.shape[1] != len(self.num_rows):
                raise TraceError(f"{self.path}: {name}_lengths has shape {lengths.shape}, expected [samples, {len(self.num_rows)}]")
            if (lengths < 0).any() or int(lengths.sum()) != len(values):
                raise TraceError(f"{self.path}: {name}_lengths (sum {int(lengths.sum())}) does not match {name}_values ({len(values)} ids)")
            table = np.repeat(np.tile(np.arange(len(self.num_rows)), len(lengths)), lengths.reshape(-1))
            bad = (values < 0) | (values >= self.num_rows[table])
            if bad.any():
                i = int(np.argmax(bad))
                raise TraceError(f"{self.path}: {name}_values[{i}] = {int(values[i])} is outside table {int(table[i])} "
                                 f"(num_rows {int(self.num_rows[table[i]])})")
            entry = {"lengths": lengths.astype(np.int64), "values": values.astype(np.int64), "table": table}
            for key, shape in (("labels", (len(lengths),)), ("dense", (len(lengths), NUM_DENSE_FEATURES))):
                if f"{name}_{key}" in arrays:
                    a = arrays[f"{name}_{key}"]
                    if a.shape != shape:
                        raise TraceError(f"{self.path}: {name}_{key} has shape {a.shape}, expected {list(shape)}")
                    entry[key] = a.astype(np.float32)
            self.streams[stream] = entry

    def _read(self) -> dict[str, np.ndarray]:
        """Every array of the file; a TraceError naming the file when it is missing, empty,
        truncated (a partial copy) or not an .npz at all."""
        if user_file(self.path, "trace", None, TraceError) == 0:  # a FIFO is refused, never opened
            raise TraceError(f"{self.path}: an empty file (0 bytes), not an .npz trace")
        try:
            with np.load(self.path, allow_pickle=False) as data:
                return {k: data[k] for k in data.files}
        except (zipfile.BadZipFile, EOFError, zlib.error) as e:  # a partial copy: the zip or a member cut short
            raise TraceError(f"{self.path}: truncated or damaged .npz trace ({e})") from None
        except (OSError, ValueError) as e:
            raise TraceError(f"{self.path}: not an .npz trace ({e})") from None

    def _integers(self, key: str, a: np.ndarray) -> np.ndarray:
        """``a`` as int64: ids and lengths are integers. A float array holding only integral
        values is converted (said on stderr); any other value is refused, the first one named."""
        if a.dtype.kind in "iu":
            return a.astype(np.int64)
        if a.dtype.kind != "f":
            raise TraceError(f"{self.path}: {key} holds {a.dtype} values; expected integers")
        flat = a.reshape(-1)
        bad = ~np.isfinite(flat) | (flat != np.round(flat)) | (np.abs(flat) > 2**53)
        if bad.any():
            i = int(np.argmax(bad))
            where = np.unravel_index(i, a.shape) if a.ndim > 1 else (i,)
            raise TraceError(f"{self.path}: {key}[{', '.join(map(str, where))}] = {float(flat[i])!r} is not an integer "
                             f"({key} must hold integers, not {a.dtype})")
        print(f"note: {self.path}: {key} is {a.dtype} holding only integers; converted to int64", file=sys.stderr)
        return a.astype(np.int64)

    def _need(self, arrays: dict, key: str) -> np.ndarray:
        if key not in arrays:
            raise TraceError(f"{self.path}: missing array {key!r}")
        return arrays[key]

    def samples(self, stream: Stream) -> int:
        return len(self.streams[stream]["lengths"])

    def has_features(self, stream: Stream) -> bool:
        return "labels" in self.streams[stream]

    def counts(self, table: int, stream: Stream = Stream.TRAIN) -> np.ndarray:
        """How often each distinct id of a table occurs in a stream."""
        s = self.streams[stream]
        return np.unique(s["values"][s["table"] == table], return_counts=True)[1]

    def bag_sizes(self) -> list[int]:
        """The mean training bag length of each table, rounded (at least 1)."""
        lengths = self.streams[Stream.TRAIN]["lengths"]
        means = lengths.mean(0) if len(lengths) else np.ones(len(self.num_rows))
        return [max(1, round(float(m))) for m in means]


class TraceSource:
    """Replays a trace: batch ``i`` of a stream is its samples ``[i * B, (i + 1) * B)``, as
    :class:`embbench.data.criteo.CriteoSource` takes them (training cyclically, evaluation once).

    Args:
        trace: the loaded trace.
        seed: seeds the synthesised dense features and labels when the trace has none.
        device: where batches go.
    """

    def __init__(self, trace: Trace, seed: int, device: torch.device | str = "cpu"):
        self.trace, self.seed, self.device = trace, seed, torch.device(device)
        self._torch = {}
        for stream, s in trace.streams.items():
            lengths = torch.from_numpy(s["lengths"])
            self._torch[stream] = (lengths, torch.from_numpy(s["values"]))
        n = len(trace.num_rows)
        g = torch.Generator().manual_seed(_mix(seed, 6))
        self._table_weights = torch.randn(n, generator=g, dtype=torch.float64) * 2.5 / math.sqrt(n)
        self._dense_weights = torch.randn(NUM_DENSE_FEATURES, generator=g, dtype=torch.float64) * 0.3

    def batch(self, stream: Stream, index: int, batch_size: int) -> Batch:
        stream = Stream(stream)
        lengths, values = self._torch[stream]
        total, tables = lengths.shape
        if total == 0:
            raise TraceError(f"{self.trace.path}: the {stream.name.lower()} stream has no samples")
        samples = (torch.arange(batch_size) + first_sample(stream, index, batch_size, total)) % total
        bags = (samples.unsqueeze(0) * tables + torch.arange(tables).unsqueeze(1)).reshape(-1)  # table-major
        flat = lengths.reshape(-1)
        ids = bags_in_order(values, flat, bags)
        batch_lengths = flat[bags]
        s = self.trace.streams[stream]
        if "labels" in s:
            dense = torch.from_numpy(s["dense"][samples.numpy()]) if "dense" in s else self._dense(stream, index, batch_size)
            labels = torch.from_numpy(s["labels"][samples.numpy()])
        else:
            dense = self._dense(stream, index, batch_size)
            labels = self._teacher(ids, batch_lengths, dense, stream, index, tables, batch_size)
        sparse = SparseFeatures(ids, batch_lengths, tables)
        return Batch(dense, sparse, labels).to(self.device)

    def _dense(self, stream: Stream, index: int, batch_size: int) -> torch.Tensor:
        g = torch.Generator().manual_seed(_mix(self.seed, 7, int(stream), index))
        return torch.randn(batch_size, NUM_DENSE_FEATURES, generator=g)

    def _teacher(self, ids, lengths, dense, stream, index, tables, batch_size) -> torch.Tensor:
        """Labels from a fixed effect per recorded id (mean over each bag) and the dense features."""
        table_of = torch.repeat_interleave(torch.arange(tables), lengths.view(tables, -1).sum(1), output_size=ids.numel())
        effects = torch.zeros(ids.numel(), dtype=torch.float64)
        for t in range(tables):
            mask = table_of == t
            effects[mask] = _hash_effect(ids[mask], _mix(self.seed, 4, t))
        bag = torch.repeat_interleave(torch.arange(lengths.numel()), lengths, output_size=ids.numel())
        per_bag = torch.zeros(lengths.numel(), dtype=torch.float64).index_add_(0, bag, effects) / lengths.clamp_min(1)
        logit = -1.0 + (per_bag.view(tables, batch_size) * self._table_weights.unsqueeze(1)).sum(0) + dense.double() @ self._dense_weights
        g = torch.Generator().manual_seed(_mix(self.seed, 8, int(stream), index))
        return (torch.rand(batch_size, generator=g, dtype=torch.float64) < torch.sigmoid(logit)).float()
