"""Meta's ``dlrm_datasets`` batches as an embbench trace.

Each ``.pt`` file of those datasets holds one batch of every table, as fbgemm's TBE takes it:
``(indices, offsets, lengths)``: ``lengths`` ``[tables, batch]``, ``offsets`` the
``tables * batch + 1`` bag boundaries into the 1-D ``indices`` (table-major). The files carry
no order across batches (each is a sample of a different moment), so a stream made of them
measures each batch's reuse and a cache's hold on the hottest rows, not eviction over time;
:func:`dlrm_to_trace` says so. Tables' cardinalities are not stored: a table has as many rows
as its largest index + 1 over the files read.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from embbench.data.trace import TRACE_FORMAT, TraceError, bags_in_order
from embbench.inputs import user_file
from embbench.outputs import atomic_write

__all__ = ["NOT_OVER_TIME", "dlrm_to_trace", "read_dlrm_batch"]

#: The largest id: its table has id + 1 rows, fewer than 2^63 (embbench.bounds.Rows).
_MAX_ID = (1 << 63) - 2

NOT_OVER_TIME = ("dlrm_datasets files are single batches with no order across them: a curve from them measures reuse "
                 "within and across these samples, not eviction over time")


def read_dlrm_batch(path: str | Path) -> tuple[np.ndarray, np.ndarray]:
    """One file's batch as trace arrays: ``[batch, tables]`` bag lengths (int32) and the ids,
    sample-major (int64). TraceError naming the file and what is wrong otherwise."""
    if user_file(Path(path), "dlrm_datasets batch", None, TraceError) == 0:  # a FIFO is refused, never opened
        raise TraceError(f"{path}: an empty file (0 bytes), not a torch file")
    try:
        data = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # truncated, not a torch file, a pickle torch refuses
        raise TraceError(f"{path}: not a readable torch file ({(str(e).splitlines() or [type(e).__name__])[0]})") from None
    if not isinstance(data, (tuple, list)) or len(data) != 3 or not all(isinstance(t, torch.Tensor) for t in data):
        raise TraceError(f"{path}: expected a tuple of 3 tensors (indices, offsets, lengths), got {type(data).__name__}"
                         + (f" of {len(data)}" if isinstance(data, (tuple, list)) else ""))
    indices, offsets, lengths = data
    for name, t, dims in (("indices", indices, 1), ("offsets", offsets, 1), ("lengths", lengths, 2)):
        if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
            raise TraceError(f"{path}: {name} holds {t.dtype}; expected integers")
        if t.dim() != dims:
            raise TraceError(f"{path}: {name} has shape {list(t.shape)}; expected {dims} dimension{'s' * (dims > 1)}")
    tables, batch = lengths.shape
    if tables == 0 or batch == 0:
        raise TraceError(f"{path}: lengths has shape {list(lengths.shape)}: a batch of no tables or no samples")
    if offsets.numel() != tables * batch + 1:
        raise TraceError(f"{path}: offsets has {offsets.numel()} entries; lengths {list(lengths.shape)} needs "
                         f"{tables * batch + 1} (tables x batch + 1)")
    offsets, lengths, indices = offsets.long(), lengths.long(), indices.long()
    if int(offsets[0]) != 0 or int(offsets[-1]) != indices.numel():
        raise TraceError(f"{path}: offsets run from {int(offsets[0])} to {int(offsets[-1])}; expected 0 to the "
                         f"{indices.numel()} indices")
    if int(lengths.min()) < 0:
        t, i = divmod(int(torch.argmin(lengths.reshape(-1))), batch)
        raise TraceError(f"{path}: lengths[{t}, {i}] = {int(lengths[t, i])} is negative")
    bags = offsets.diff()
    wrong = torch.nonzero(bags != lengths.reshape(-1))
    if len(wrong):
        i = int(wrong[0])
        raise TraceError(f"{path}: bag {i} (table {i // batch}, sample {i % batch}) has {int(bags[i])} ids by offsets, "
                         f"{int(lengths.reshape(-1)[i])} by lengths")
    if indices.numel() and int(indices.min()) < 0:
        raise TraceError(f"{path}: indices[{int(torch.argmin(indices))}] = {int(indices.min())} is negative")
    if indices.numel() and int(indices.max()) >= _MAX_ID + 1:  # a table of id + 1 rows: a count of int64 ids
        raise TraceError(f"{path}: indices[{int(torch.argmax(indices))}] = {int(indices.max())} is too large: a table "
                         f"holds fewer than 2^63 rows, so an id is at most {_MAX_ID}")
    order = (torch.arange(tables).unsqueeze(0) * batch + torch.arange(batch).unsqueeze(1)).reshape(-1)  # (sample, table)
    return lengths.T.numpy().astype(np.int32), bags_in_order(indices, bags, order).numpy()


def dlrm_to_trace(paths: list[str | Path], out: str | Path) -> dict:
    """Write the files' batches, in the order given, as the training stream of an embbench
    trace (no evaluation stream). Returns what was written and :data:`NOT_OVER_TIME`."""
    lengths, values = zip(*(read_dlrm_batch(p) for p in paths))
    widths = {ln.shape[1] for ln in lengths}
    if len(widths) != 1:
        raise TraceError(f"{paths[0]}: the files hold different numbers of tables ({sorted(widths)})")
    lengths, values = np.concatenate(lengths), np.concatenate(values)
    table = np.repeat(np.tile(np.arange(lengths.shape[1]), len(lengths)), lengths.reshape(-1))
    num_rows = np.zeros(lengths.shape[1], np.int64)
    np.maximum.at(num_rows, table, values + 1)
    arrays = {"format": np.array(TRACE_FORMAT), "num_rows": np.maximum(num_rows, 1),
              "train_lengths": lengths, "train_values": values,
              "eval_lengths": np.zeros((0, lengths.shape[1]), np.int32), "eval_values": np.zeros(0, np.int64)}
    atomic_write(Path(out), lambda f: np.savez(f, **arrays), "the trace")  # a full disk leaves no half trace
    return {"batches": len(paths), "samples": len(lengths), "tables": lengths.shape[1], "note": NOT_OVER_TIME}
