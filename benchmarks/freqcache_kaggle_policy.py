"""freqcache's policy at the Criteo-Kaggle shape (26 tables, 33.8M rows, batch 16384, 1.5 %
cache) against Belady's MIN, on the CPU, without training: the one-table sweep's procedure
(``embbench.cache.sweep``) on the synthetic Kaggle stream's global rows, default configuration
(look-ahead auto). Slow on a CPU (tens of minutes at 512 counted batches):

    .venv/bin/python benchmarks/freqcache_kaggle_policy.py [--steps 512] [--scale 1.0] [--out FILE.json]
"""

import argparse
import json
import time

from embbench.cache.sweep import Workload, simulate
from embbench.data import Stream, SyntheticCriteo, make_tables
from embbench.embedding import RowSpace


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

    def batch_rows(i):
        return space.global_rows(data.batch(Stream.TRAIN, i, args.batch).sparse).numpy()

    ids = args.batch * sum(t.bag_size for t in tables)
    w = Workload(alpha=1.0, rows=space.num_rows, cache_ratio=args.cache_ratio, batch_ids=ids)  # alpha: the tables'
    r = simulate(w, steps=args.steps, batch_rows=batch_rows)
    result = {"scale": args.scale, "rows": space.num_rows, "batch": args.batch, "ids": ids, "capacity": r["capacity"],
              "lookahead": r["lookahead_batches"], "window_rows": r["window_rows"], "counted_batches": args.steps,
              **{k: r[k] for k in ("hit_rate", "belady_hit_rate", "unique_hit_rate", "belady_unique_hit_rate",
                                   "window_pairs_dropped")},
              "seconds": round(time.time() - started)}
    print(json.dumps(result, indent=1))
    print(f"points below Belady: per access {100 * r['gap']:.2f}, per distinct row {100 * r['unique_gap']:.2f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)


if __name__ == "__main__":
    main()
