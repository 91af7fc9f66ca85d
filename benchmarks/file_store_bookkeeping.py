"""The file store's host-memory bookkeeping alone (issue 48): milliseconds an announced batch
costs in pins, evictions, recency and releases, without a byte moved.

    PYTHONPATH=. .venv/bin/python benchmarks/file_store_bookkeeping.py /tmp --capacity 50000 200000

A store of the 4 GiB shape (1M blocks of 15 rows of 260 bytes) is made at a ``dram_ratio`` that
gives each ``--capacity`` of host slots; its file is allocated, never written, and its transfers
are replaced by ones that are done at once, so that only the bookkeeping is timed. Batches of
``--batch-blocks`` distinct blocks (half from a hot set of a quarter of host memory, half from
the whole file) are announced ``--ahead`` batches before their rows are used and released, as
freqcache does, on the caller's thread. Host memory is filled first (its empty slots are
cheap); then ``--batches`` batches are timed. Not a test: nothing here is asserted.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

from embbench.cache.file_rows import FileRows

ROW_FLOATS = 65  # dim 64 and rowwise Adagrad's one float: 260 bytes, 15 rows a page
BLOCKS = 1 << 20  # the 4 GiB shape's pages


class _Done:
    """A transfer that has already happened (nothing is read or written)."""

    def done(self) -> bool:
        return True

    def wait(self) -> None:
        pass


def bookkeeping(folder: Path, capacity: int, batch_blocks: int, ahead: int, batches: int, seed: int = 0) -> dict:
    rows_per_block = 4096 // (4 * ROW_FLOATS)
    rng = np.random.default_rng(seed)
    with tempfile.TemporaryDirectory(dir=folder) as scratch:
        store = FileRows(Path(scratch) / "bench.rows", BLOCKS * rows_per_block, ROW_FLOATS, torch.float32,
                         capacity / BLOCKS, batch_blocks, direct=False)
        store.file.submit = lambda *args, **kw: _Done()
        hot = rng.choice(BLOCKS, capacity // 4, replace=False)

        def batch() -> np.ndarray:
            half = batch_blocks // 2
            return np.unique(np.concatenate([rng.choice(hot, half, replace=False),
                                             rng.choice(BLOCKS, batch_blocks - half, replace=False)]))

        warmup = 2 * capacity // batch_blocks
        wanted = [batch() for _ in range(warmup + batches + ahead)]
        seconds = []
        try:
            with store._lock:  # (the bookkeeping thread's work, here on the caller's)
                for number in range(ahead):
                    store._queue(number, wanted[number])
                for number in range(warmup + batches):
                    started = time.perf_counter()
                    store._queue(number + ahead, wanted[number + ahead])  # announced
                    store._touch(store.block_slot[wanted[number]])  # its rows used (gather)
                    store._release(number)  # its rows moved
                    seconds.append(time.perf_counter() - started)
        finally:
            store.close()
    timed = np.array(seconds[warmup:]) * 1e3
    return {"capacity": store.capacity, "batch_blocks": batch_blocks, "ahead": ahead, "batches": batches,
            "ms_per_batch_median": float(np.median(timed)), "ms_per_batch_mean": float(timed.mean()),
            "ms_per_batch_p90": float(np.percentile(timed, 90))}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("path", type=Path, help="a folder for the (allocated, never written) row file of 4 GiB")
    parser.add_argument("--capacity", type=int, nargs="+", default=[50_000, 200_000], help="host slots")
    parser.add_argument("--batch-blocks", type=int, default=1500)
    parser.add_argument("--ahead", type=int, default=4, help="batches announced before their rows are used")
    parser.add_argument("--batches", type=int, default=200)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    results = []
    for capacity in args.capacity:
        result = bookkeeping(args.path, capacity, args.batch_blocks, args.ahead, args.batches)
        results.append(result)
        print(f"capacity {result['capacity']:,} slots, {args.batch_blocks:,} blocks a batch: "
              f"{result['ms_per_batch_median']:.2f} ms a batch (median; mean {result['ms_per_batch_mean']:.2f}, "
              f"p90 {result['ms_per_batch_p90']:.2f})", flush=True)
    if args.out:
        args.out.write_text(json.dumps({"results": results, "uptime": os.popen("uptime").read().strip()}, indent=1)
                            + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
