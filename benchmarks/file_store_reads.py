"""The file store's reader against its drive (issue 48, item 1): reads a second achieved while
reading ahead, beside what the drive probe (``embbench disk``) measures at the same depth.

    PYTHONPATH=. .venv/bin/python benchmarks/file_store_reads.py /work --depth 32 --out reads.json

A row file of ``--file-size`` (rows of 260 bytes, 15 a page: the 4 GiB scenario's rows) is
filled, then a training loop is played without training: batches of ``--batch-blocks`` random
blocks are announced ``--ahead`` batches before they are gathered and released, as freqcache
does. Achieved: the pages the engine transferred over the time it had one in flight (what
``metrics.tiers`` calls ``reads_per_second``), and the pages over the loop's wall time. Then
the probe reads the same size of file at the same depth. Not a test: nothing here is asserted.
The machine's load is recorded beside the numbers (other work lowers both).
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
from embbench.disk.layout import PAGE
from embbench.disk.probe import measure_drive
from embbench.recommend import parse_size

ROW_FLOATS = 65  # dim 64 and rowwise Adagrad's one float: 260 bytes, 15 rows a page


def store_reads(folder: Path, file_bytes: int, depth: int, batches: int, batch_blocks: int, ahead: int,
                seed: int = 0) -> dict:
    rows_per_page = PAGE // (4 * ROW_FLOATS)
    rows = file_bytes // PAGE * rows_per_page
    dram = min(1.0, (ahead + 3) * batch_blocks / (rows / rows_per_page) * 1.5)
    with tempfile.TemporaryDirectory(dir=folder) as scratch:
        store = FileRows(Path(scratch) / "bench.rows", rows, ROW_FLOATS, torch.float32, dram, batch_blocks,
                         io_depth=depth)
        try:
            started = time.perf_counter()
            store.fill(lambda a, b: torch.arange(a, b, dtype=torch.float32)[:, None].expand(b - a, ROW_FLOATS))
            fill_s = time.perf_counter() - started
            os.sync()
            rng = np.random.default_rng(seed)
            wanted = [rng.choice(store.blocks, batch_blocks, replace=False) * rows_per_page
                      + rng.integers(0, rows_per_page, batch_blocks) for _ in range(batches)]
            before, load = store.counters(), os.getloadavg()[0]
            started = time.perf_counter()
            for number in range(min(ahead, batches)):
                store.announce(number, wanted[number])
            for number in range(batches):
                got = store.gather(wanted[number], number)
                assert torch.equal(got[:, 0], torch.from_numpy(wanted[number]).float())  # the right rows
                store.release(number)
                if number + ahead < batches:
                    store.announce(number + ahead, wanted[number + ahead])
            wall = time.perf_counter() - started
            after = store.counters()
            delta = {k: after[k] - before[k] for k in after}
            return {"reader": store.describe()["store_reader"], "file_bytes": store.layout.file_bytes,
                    "fill_seconds": fill_s, "batches": batches, "batch_blocks": batch_blocks, "ahead": ahead,
                    "depth": depth, "pages_read": delta["nvme_pages_read"],
                    "pages_read_on_demand": delta["nvme_pages_read_on_demand"],
                    "busy_seconds": delta["nvme_read_ns"] / 1e9, "wall_seconds": wall,
                    "reads_per_s_while_reading": delta["nvme_engine_ios"] / (delta["nvme_read_ns"] / 1e9),
                    "reads_per_s_wall": delta["nvme_pages_read"] / wall,
                    "stall_seconds": delta["stall_ns"] / 1e9, "load_before": load, "load_after": os.getloadavg()[0]}
        finally:
            store.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("path", type=Path, help="a folder on the drive (the row file and the probe's go there)")
    parser.add_argument("--depth", type=int, default=32)
    parser.add_argument("--file-size", default="1GiB")
    parser.add_argument("--batches", type=int, default=40)
    parser.add_argument("--batch-blocks", type=int, default=1100, help="blocks a batch reads (the 4 GiB shape's ~1.1k)")
    parser.add_argument("--ahead", type=int, default=8, help="batches announced before they are gathered")
    parser.add_argument("--probe-seconds", type=float, default=3.0)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    file_bytes = parse_size(args.file_size)
    store = store_reads(args.path, file_bytes, args.depth, args.batches, args.batch_blocks, args.ahead)
    probe = measure_drive(args.path, args.probe_seconds, (args.depth,), file_bytes).as_dict()
    drive = probe["drive"][0]["reads_per_s"] if probe["drive"] else None
    result = {"format": "embbench-reader-benchmark-1", "store": store, "probe": probe, "drive_reads_per_s": drive,
              "achieved_share_of_drive": store["reads_per_s_while_reading"] / drive if drive else None,
              "uptime": os.popen("uptime").read().strip(), "cpus": os.cpu_count()}
    print(f"store reader ({store['reader']}): {store['reads_per_s_while_reading']:,.0f} reads/s while reading, "
          f"{store['reads_per_s_wall']:,.0f}/s over the loop; drive probe at {args.depth}: "
          + (f"{drive:,.0f} reads/s ({result['achieved_share_of_drive']:.0%})" if drive else probe["problem"])
          + f"; load {store['load_before']:.2f} -> {probe['load'][1]:.2f} on {os.cpu_count()} CPUs")
    if args.out:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
