"""freqcache's policy at the Criteo-Kaggle shape (26 tables, 33.8M rows, batch 16384, 1.5 %
cache) against Belady's MIN, on the CPU, without training: the one-table sweep's procedure
(``embbench.cache.sweep``) on the synthetic Kaggle stream's global rows, default configuration
(look-ahead auto). Slow on a CPU (tens of minutes at 512 counted batches):

    .venv/bin/python benchmarks/freqcache_kaggle_policy.py [--steps 512] [--scale 1.0] [--out FILE.json]
"""

import argparse
import json
import math
import time

import numpy as np
import torch

from embbench.cache.device_planner import window_size
from embbench.cache.sweep import Workload, _drive_device
from embbench.data import Stream, SyntheticCriteo, make_tables
from embbench.embedding import RowSpace
from embbench.metrics import belady_hit_rates


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=512)
    parser.add_argument("--scale", type=float, default=1.0)
    parser.add_argument("--batch", type=int, default=16384)
    parser.add_argument("--cache-ratio", type=float, default=0.015)
    parser.add_argument("--out")
    args = parser.parse_args()
    started = time.time()
    tables = make_tables("criteo_kaggle", dim=128, scale=args.scale)
    space, data = RowSpace(tables), SyntheticCriteo(tables, seed=0)
    profile, warmup = 32, 16
    total = profile + warmup + args.steps

    def rows(i):
        return space.global_rows(data.batch(Stream.TRAIN, i, args.batch).sparse).numpy()

    batches = [rows(i) for i in range(profile)]
    capacity = math.ceil(args.cache_ratio * space.num_rows)
    ids = len(batches[0])
    lookahead, window_rows = window_size([len(np.unique(b)) for b in batches], capacity, ids, None)
    batches += [rows(i) for i in range(profile, total + lookahead)]
    w = Workload(alpha=1.0, rows=space.num_rows, cache_ratio=args.cache_ratio, batch_ids=ids)
    c = _drive_device(w, batches, capacity, lookahead, window_rows, profile, total, warmup, 256)
    per_access, per_distinct = belady_hit_rates([torch.from_numpy(b) for b in batches[:total]], capacity,
                                                skip=profile + warmup)
    hit, unique_hit = c["hits"] / c["accesses"], 1 - c["unique_misses"] / c["unique_accesses"]
    result = {"scale": args.scale, "rows": space.num_rows, "batch": args.batch, "ids": ids, "capacity": capacity,
              "lookahead": lookahead, "window_rows": window_rows, "counted_batches": args.steps,
              "hit_rate": hit, "belady_hit_rate": per_access, "unique_hit_rate": unique_hit,
              "belady_unique_hit_rate": per_distinct, "window_pairs_dropped": c["window_pairs_dropped"],
              "seconds": round(time.time() - started)}
    print(json.dumps(result, indent=1))
    print(f"points below Belady: per access {100 * (per_access - hit):.2f}, per distinct row "
          f"{100 * (per_distinct - unique_hit):.2f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
